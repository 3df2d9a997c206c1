#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, then runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export GRPO_TEST_ASSETS="$PWD/models"
# The `ray` that setup.sh installed, also where pip's script directory is not on PATH.
RAY_SCRIPTS=$("${PYTHON:-python3}" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
export RAY="${RAY:-$RAY_SCRIPTS/ray}"
cargo test --workspace "$@"
