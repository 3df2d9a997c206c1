#!/usr/bin/env bash
# Training-run benchmark: `grpo run recipes/quickstart.yaml` against the same run written with
# TRL's GRPOTrainer (scripts/bench/trl_grpo_peer.py), alternating ours and theirs ROUNDS times
# on the same machine, then a table of steps per hour and the time breakdown.
#
# usage: scripts/bench/run_vs_trl.sh [STEPS] [ROUNDS]     (defaults: 8 steps, 2 rounds)
# DTYPE=bf16 runs both in bf16 with f32 master weights (grpo: actor.param_dtype and
# rollout.dtype bf16, as recipes/quickstart.yaml has them; TRL: bf16=True, autocast); the
# default is f32 for both. TRL_MICRO_BATCH sets TRL's per_device_train_batch_size (default 32,
# the quickstart's actor.ppo_micro_batch_size; 16 accumulates two micro-batches).
# Needs: the quickstart's assets (scripts/setup.sh), its datasets (scripts/quickstart.sh makes
# them), and `pip install trl` (its dependencies are transformers, accelerate, datasets, torch).
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=${1:-8}
rounds=${2:-2}
out=${BENCH_OUT:-/tmp/grpo-vs-trl}
rm -rf "$out" && mkdir -p "$out"
# GRPO_BIN: a grpo binary to measure (default: build this checkout's release binary).
if [ -z "${GRPO_BIN:-}" ]; then
    cargo build --release --quiet
    GRPO_BIN=target/release/grpo
fi
threads=$(nproc)
dtype=${DTYPE:-f32}
ours_dtype=(--set actor.param_dtype=f32 --set rollout.dtype=f32)
theirs_dtype=()
if [ "$dtype" = bf16 ]; then
    ours_dtype=(--set actor.param_dtype=bf16 --set rollout.dtype=bf16)
    theirs_dtype=(--bf16)
fi
for round in $(seq 1 "$rounds"); do
    echo "round $round: grpo" >&2
    start=$(date +%s.%N)
    "$GRPO_BIN" run recipes/quickstart.yaml --quiet \
        --set trainer.total_training_steps="$steps" --set trainer.test_freq=-1 \
        --set trainer.save_freq=-1 --set trainer.resume_mode=disable \
        --set trainer.val_before_train=false "${ours_dtype[@]}" \
        --set trainer.output_dir="$out/grpo-$round" > "$out/grpo-$round.log" 2>&1
    python3 -c "import sys; print(float(sys.argv[1]) - float(sys.argv[2]))" "$(date +%s.%N)" "$start" > "$out/grpo-$round.wall"
    echo "round $round: trl" >&2
    start=$(date +%s.%N)
    python3 scripts/bench/trl_grpo_peer.py --model-dir models --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        --train datasets/arithmetic/train.parquet --steps "$steps" --threads "$threads" \
        --micro-batch "${TRL_MICRO_BATCH:-32}" \
        --output-dir "$out/trl-$round" "${theirs_dtype[@]}" 2> "$out/trl-$round.log" | grep '^{"step"' > "$out/trl-$round.jsonl"
    python3 -c "import sys; print(float(sys.argv[1]) - float(sys.argv[2]))" "$(date +%s.%N)" "$start" > "$out/trl-$round.wall"
done
python3 scripts/bench/summarize_vs_trl.py "$out" "$rounds"
