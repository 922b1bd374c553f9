#!/usr/bin/env bash
# Check bankml's GPU path (CuPy) against its exact CPU path on this machine (docs/gpu.md).
#
#   scripts/gpu-check.sh [--cuda|--rocm] [--with-llama-server] [bench/gpu_check.py ARGS...]
#   scripts/gpu-check.sh --compile-only
#
# From a clean clone, with Python 3.10+ and a CUDA or a ROCm GPU: creates .venv (the one `make`
# uses), installs bankml with CuPy (`.[cuda]` or `.[rocm]`, guessed from nvidia-smi / rocm-smi
# unless given), fetches the default model (scripts/fetch-model.sh), runs bench/gpu_check.py
# --device cuda and leaves gpu_check.json and gpu_check.log in $OUT (default bench/out). Its
# last line of output is the report as one JSON line.
#
# --with-llama-server also compares the paths with llama-server, built once by
# scripts/build-llama-server.sh (needs CMake and a C++ compiler; about 10 minutes on 2 cores,
# seconds once built): on CUDA its CUDA build (`--cuda`: nvcc too), run with every layer on the
# GPU. $BANKML_LLAMA_SERVER_CUDA (on CUDA) or $BANKML_LLAMA_SERVER names a binary instead.
#
# --compile-only needs no GPU: it compiles every CUDA kernel of bankml/engine_cupy/cuda with NVRTC
# (the nvidia-cuda-nvrtc wheel, installed into $VENV unless that venv already finds libnvrtc)
# for sm_80 and sm_90 and prints one JSON line {"kernels": N, "compiled": N, ...}; its exit
# status is 0 only when every kernel compiled.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
OUT=${OUT:-bench/out}
extra="" with_server="" compile_only="" args=()
for arg in "$@"; do
  case $arg in
    --compile-only) compile_only=1 ;;
    --cuda) extra=cuda ;;
    --rocm) extra=rocm ;;
    --with-llama-server) with_server=1 ;;
    *) args+=("$arg") ;;
  esac
done
if [ -n "$compile_only" ]; then
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  # the compiler module needs nothing but the standard library and libnvrtc
  if ! PYTHONPATH=. "$VENV/bin/python" -c 'import sys; from bankml.engine_cupy import nvrtc
sys.exit(nvrtc.find_library() is None)'; then
    echo "gpu-check: installing nvidia-cuda-nvrtc into $VENV" >&2
    "$VENV/bin/python" -m pip install -q "nvidia-cuda-nvrtc>=13" >&2
  fi
  PYTHONPATH=. exec "$VENV/bin/python" -m bankml.engine_cupy.cuda_kernels
fi
if [ -z "$extra" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    extra=cuda
  elif command -v rocm-smi >/dev/null 2>&1 || [ -e /dev/kfd ]; then
    extra=rocm
  else
    echo "gpu-check: neither nvidia-smi nor rocm-smi found; say --cuda or --rocm" >&2
    exit 2
  fi
fi

echo "gpu-check: installing bankml[$extra] into $VENV" >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
# pytest: the check reuses the oracle tests' comparison functions (tests/test_forward.py)
"$VENV/bin/python" -m pip install -q -e ".[$extra]" pytest >&2
model=$(PYTHON="$VENV/bin/python" scripts/fetch-model.sh)

# on CUDA the reference is llama-server's CUDA build, every layer on the GPU (-ngl 99); on ROCm
# the CPU build (bankml's decode step is CUDA's alone)
server=none server_args=()
if [ "$extra" = cuda ]; then
  server=${BANKML_LLAMA_SERVER_CUDA:-${BANKML_LLAMA_SERVER:-none}}
  if [ -n "$with_server" ] && [ "$server" = none ]; then
    server=$(scripts/build-llama-server.sh --cuda | tail -n 1)
  fi
  [ "$server" != none ] && server_args=(--ngl 99)
else
  server=${BANKML_LLAMA_SERVER:-none}
  if [ -n "$with_server" ] && [ "$server" = none ]; then
    server=$(scripts/build-llama-server.sh | tail -n 1)
  fi
fi

mkdir -p "$OUT"
{
  if [ "$extra" = cuda ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  else
    rocm-smi --showproductname 2>/dev/null || true
  fi
} >"$OUT/gpu_check.log" 2>&1
set +e
PYTHONUNBUFFERED=1 "$VENV/bin/python" bench/gpu_check.py --device cuda --out "$OUT" \
  --model "$model" --llama-server "$server" "${server_args[@]}" "${args[@]}" 2>&1 |
  tee -a "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
