#!/usr/bin/env bash
# The native engine's CuPy path on a lent GPU machine, in one command (docs/device-check.md).
#
#   scripts/device-check.sh --prepare   HERE, before the device call: downloads the wheels the
#                                       engine needs and the machine lacks into .whl/, copies the
#                                       reference llama-server (and its libgomp) and a
#                                       vocabulary-only GGUF into .device/ (both git-ignored
#                                       through .git/info/exclude, never committed)
#   bash scripts/device-check.sh [ARGS...]   THERE, as the device tool's command: installs the wheels
#                                       into /tmp/site, runs bench/device_check.py --device cuda
#                                       ARGS, and leaves device_check.json and device_check.log in
#                                       $OUT (bench/out without $OUT)
#
# Why a vocabulary file: the default model (92 MB) cannot travel (64 MiB), so every model is
# built on the machine by tests/tiny_models.py, which needs the default model's vocabulary only.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEEL_PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
                 manylinux2014_x86_64 manylinux1_x86_64)
# What the engine path imports that the machine's image lacks (KINDS.md's package list): gguf
# (pure Python; its needs numpy, pyyaml, requests and tqdm are there). llguidance, twisted and
# treq are not imported by Model, the sampler's logprobs or the tests' helpers used here.
WHEELS=(gguf)
# the time the check gives itself, and the hard stop around it (the device call's timeout_s
# must exceed the latter: docs/device-check.md)
BUDGET_S=${DEVICE_CHECK_BUDGET_S:-270}
HARD_STOP_S=${DEVICE_CHECK_HARD_STOP_S:-360}

prepare() {
  set -e
  local py=${PYTHON:-.venv/bin/python} exclude binary gomp name version platforms=()
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  for dir in /.whl/ /.device/; do
    grep -qxF "$dir" "$exclude" 2>/dev/null || echo "$dir" >>"$exclude"
  done
  rm -rf .whl .device
  mkdir -p .whl .device/lib
  for p in "${WHEEL_PLATFORMS[@]}"; do platforms+=(--platform "$p"); done
  for name in "${WHEELS[@]}"; do  # the version this venv tests with
    version=$("$py" -c "from importlib.metadata import version; print(version('$name'))")
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${platforms[@]}" -d .whl "$name==$version"
  done
  binary=$(scripts/build-llama-server.sh | tail -n 1)
  cp "$binary" .device/llama-server
  # libgomp is the one library it links that a CUDA image may lack (libstdc++/libc are there)
  gomp=$(ldd "$binary" | awk '/libgomp/ {print $3}')
  [ -n "$gomp" ] && cp -L "$gomp" .device/lib/
  "$py" bench/device_check.py --write-vocab .device/vocab.gguf >/dev/null
  echo "prepared (carry .whl and .device):"
  du -shc .whl .device
  # what a device call sends: tracked and untracked-not-ignored files, and the carried folders
  local tree carried
  tree=$(git ls-files -z --cached --others --exclude-standard | du --files0-from=- -cb 2>/dev/null | tail -n 1 | cut -f1)
  carried=$(du -sb .whl .device | awk '{s += $1} END {print s}')
  echo "travels: $((tree + carried)) bytes (tree $tree + carried $carried) of the 67108864 allowed"
  [ $((tree + carried)) -lt 67108864 ] || { echo "over the device tool's 64 MiB" >&2; return 1; }
}

run_there() {
  local out=$1 server=none
  shift
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  chmod +x .device/llama-server 2>/dev/null  # in case the copy lost the mode bits
  if [ -x .device/llama-server ]; then
    if ldd .device/llama-server | grep -q "not found"; then
      export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    ldd .device/llama-server | grep -E "gomp|stdc|not found" || true
    server=$PWD/.device/llama-server
  fi
  export PYTHONUNBUFFERED=1
  timeout -k 10 "$HARD_STOP_S" python3 bench/device_check.py --device cuda --out "$out" \
    --llama-server "$server" --budget-s "$BUDGET_S" "$@"
  local status=$?
  [ $status -eq 124 ] && echo "device-check: stopped after ${HARD_STOP_S} s; $out/device_check.json holds what was done"
  return $status
}

if [ "${1:-}" = "--prepare" ]; then
  prepare
else
  out=${OUT:-bench/out}
  mkdir -p "$out"
  run_there "$out" "$@" 2>&1 | tee "$out/device_check.log"
  exit "${PIPESTATUS[0]}"
fi
