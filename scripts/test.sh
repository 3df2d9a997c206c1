#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, then runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export GRPO_TEST_ASSETS="$PWD/models"
# Ray 2.60 with its dashboard (the Jobs API the `ray` launcher submits workers through), for the
# tests that start a local Ray head: WITH its dependencies (aiohttp, grpcio, ...), unlike the
# plugins. A test-only need: the quickstart does not install it.
PY=${PYTHON:-python3}
"$PY" -c 'import ray, ray.dashboard, aiohttp; assert ray.__version__ == "2.60.0"' 2>/dev/null ||
    "$PY" -m pip install --quiet --disable-pip-version-check 'ray[default]==2.60.0'
# That `ray`, also where pip's script directory is not on PATH.
RAY_SCRIPTS=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
export RAY="${RAY:-$RAY_SCRIPTS/ray}"
cargo test --workspace "$@"
