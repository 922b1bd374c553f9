#!/usr/bin/env bash
# A separate virtual environment for llama.cpp build 11434's own convert_hf_to_gguf.py, the
# converter `bankml convert` is compared with byte for byte in tests/test_convert.py. It needs
# torch (the CPU build), which bankml itself never imports, so it lives in a per-machine cache
# beside the llama-server build, never in bankml's .venv. Idempotent; prints the venv's python on
# the last line of stdout.
set -euo pipefail

CACHE="${BANKML_CACHE:-$HOME/.cache/bankml}"
SRC="$CACHE/llama-server/11434/src/llama.cpp"
VENV="$CACHE/convert-reference/venv"
STAMP="$VENV/.complete-11434"
TORCH=2.13.0

if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import torch, transformers, gguf, sentencepiece" 2>/dev/null; then
  echo "$VENV/bin/python"
  exit 0
fi

exec 3>&1 1>&2   # progress to stderr, the path alone to stdout

# the converter's source (gguf-py included) is the llama-server build's
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
  "$(dirname "$0")/build-llama-server.sh" --source >/dev/null
fi

rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch's CPU wheel: the machine's wheel directory when it holds one, else PyTorch's CPU index
# (a plain `pip install torch` could pick a CUDA build)
WHEEL="$(ls /opt/wheels/torch-$TORCH+cpu-*.whl 2>/dev/null | head -n 1 || true)"
if [ -n "$WHEEL" ]; then
  "$VENV/bin/pip" install -q "$WHEEL"
else
  "$VENV/bin/pip" install -q "torch==$TORCH" --index-url https://download.pytorch.org/whl/cpu
fi
# the rest of requirements/requirements-convert_hf_to_gguf.txt (transformers for the tokenizers,
# sentencepiece, protobuf), and gguf-py from the same source tree as the converter
"$VENV/bin/pip" install -q "numpy>=2.2,<2.5" "sentencepiece>=0.1.98,<0.3.0" "transformers==4.57.6" \
  "protobuf>=4.21.0,<5.0.0" safetensors
"$VENV/bin/pip" install -q --no-deps "$SRC/gguf-py"
"$VENV/bin/python" -c "import torch, transformers, gguf, sentencepiece"
touch "$STAMP"
echo "$VENV/bin/python" >&3
