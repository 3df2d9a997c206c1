#!/usr/bin/env bash
# Benchmark: rows/s reading the GSM8K Parquet file with the data crate against pyarrow, same run.
#   data/benches/read_bench.sh [GSM8K_TRAIN_JSONL] [REPEATS]
# Converts the JSON lines with the data crate (examples/gsm8k_to_parquet.rs, what `grpo preprocess
# gsm8k` runs), then times both readers on that file.
set -euo pipefail
cd "$(dirname "$0")/../.."
input=${1:-data/gsm8k/train.jsonl}
repeats=${2:-5}
python3 -c 'import pyarrow' 2>/dev/null || python3 -m pip install --quiet pyarrow
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
cargo build --release --quiet -p data --example read_bench --example gsm8k_to_parquet
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$CARGO_TARGET_DIR/release/examples/gsm8k_to_parquet" "$input" "$tmp/train.parquet" train
READ_BENCH_BIN="$CARGO_TARGET_DIR/release/examples/read_bench" python3 data/benches/read_bench.py "$tmp/train.parquet" "$repeats"
