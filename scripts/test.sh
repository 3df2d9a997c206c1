#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, then runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export GRPO_TEST_ASSETS="$PWD/models"
cargo test --workspace "$@"
