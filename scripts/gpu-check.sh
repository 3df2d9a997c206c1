#!/usr/bin/env bash
# Everything this project checks on an NVIDIA GPU, in one go, through the XLA CUDA plugin:
#
#   1. the plugin and its device (`grpo devices --plugin cuda`);
#   2. the PJRT runtime tests (xla/tests/runtime*.rs with GRPO_TEST_PLUGIN=cuda);
#   3. the GEMM benchmark (crate vs bare PJRT calls), n=2048 and n=8192;
#   4. parity with the CPU plugin on the end-to-end tests' tiny chat model, in f32:
#      `grpo generate` greedy and sampled (same seeds), and three GRPO steps of `grpo run`
#      followed by `grpo export`; scripts/compare_device_runs.py compares tokens, log-probs,
#      every step's metrics and every exported parameter;
#   5. `grpo generate` against transformers' `generate` on the same GPU, same random-weight
#      Qwen2.5-0.5B (bf16), same prompts, greedy (scripts/bench/hf_generate_peer.py);
#   6. four GRPO steps of recipes/gsm8k-smollm2.yaml on that model in bf16 (a reading of the
#      step time on the GPU; random weights earn no reward).
#
#   scripts/gpu-check.sh                  # from the repository root, after scripts/setup.sh
#   SKIP_PIP=1 scripts/gpu-check.sh       # the CUDA wheels are already installed
#
# Binaries come from `cargo build --release` unless GRPO_BIN_DIR names a folder that holds
# prebuilt ones (grpo, runtime, runtime_cache, runtime_bench, tiny_chat_model). The CPU side of
# step 4 runs here unless GPU_CHECK_CPU_REFERENCE names a folder where this script's CPU side
# already ran (GPU_CHECK_ONLY=cpu writes just that, for a host without the GPU's CPU plugin).
# Step 5 needs torch and transformers (GPU build) in python3, and a Qwen tokenizer folder:
# models/qwen3 (model/scripts/fetch_assets.sh fetches it) or QWEN_TOKENIZER.
#
# Everything it prints is also written to gpu-check-<UTC time>/log, beside the outputs; paste the
# results into BENCHMARKS.md.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="${PYTHON:-python3}"
OUT_DIR="${GPU_CHECK_OUT:-$ROOT/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/log") 2>&1
failed=()
step() { echo; echo "== $*"; }
check() { "$@" || { echo "FAILED ($?): $*"; failed+=("$*"); }; }

if [[ -n "${GRPO_BIN_DIR:-}" ]]; then
  BIN=$(cd "$GRPO_BIN_DIR" && pwd)
else
  step "building (release)"
  cargo build --release -q --bin grpo || exit 1
  cargo build --release -q -p testkit --example tiny_chat_model || exit 1
  cargo build --release -q -p xla --example runtime_bench || exit 1
  BIN=$ROOT/target/release
  ln -sf examples/tiny_chat_model examples/runtime_bench "$BIN/" 2>/dev/null || true
fi
GRPO=$BIN/grpo

# One side of the parity check on DEVICE, in DIR: the tiny model and its data (copied from
# FROM, the other side's folder, when given: the same weights on both sides), `grpo generate`
# greedy and sampled, a 3-step `grpo run` and its export.
parity_side() {
  local device=$1 dir=$2 from=${3:-}
  mkdir -p "$dir"
  if [[ -n "$from" ]]; then
    cp -r "$from/tiny-smollm2" "$from/train.parquet" "$from/val.parquet" "$dir/" || return 1
  else
    "$BIN/tiny_chat_model" "$dir" >/dev/null || return 1
    for split in train:1:32 val:2:8; do
      IFS=: read -r name seed count <<<"$split"
      "$GRPO" preprocess arithmetic --seed "$seed" --count "$count" --output "$dir/$name.parquet" || return 1
    done
  fi
  local model=$dir/tiny-smollm2 gen=("$GRPO" generate --device "$device" --model "$dir/tiny-smollm2"
    --prompts-file "$dir/val.parquet" --max-new-tokens 24 --max-num-seqs 16)
  "${gen[@]}" --n 1 --temperature 0 >"$dir/greedy.jsonl" || return 1
  "${gen[@]}" --n 4 --temperature 1 --top-p 0.9 --seed 11 >"$dir/sampled.jsonl" || return 1
  cat >"$dir/recipe.yaml" <<EOF
model:
  path: $model
data:
  train_files: $dir/train.parquet
  val_files: $dir/val.parquet
  train_batch_size: 4
  max_prompt_length: 96
  max_response_length: 12
rollout:
  n: 4
  max_num_seqs: 16
  dtype: f32
reward:
  scorers:
    starts_with_a_word: {kind: format_regex, pattern: '^\S'}
  data_sources:
    grpo/arithmetic: starts_with_a_word
actor:
  param_dtype: f32
  optim:
    lr: 1.0e-3
  ppo_mini_batch_size: 2
  ppo_micro_batch_size: 4
  use_kl_loss: true
trainer:
  total_training_steps: 3
  test_freq: 3
  save_freq: 3
  output_dir: $dir/run
  seed: 3
cluster:
  device: $device
EOF
  "$GRPO" run "$dir/recipe.yaml" --quiet || return 1
  "$GRPO" export "$dir/run/checkpoints/step_3" --output "$dir/export" || return 1
}

if [[ "${GPU_CHECK_ONLY:-}" == cpu ]]; then
  step "CPU side of the parity check only, into $OUT_DIR/cpu"
  parity_side cpu "$OUT_DIR/cpu" || exit 1
  exit 0
fi

step "host"
date -u
if ! command -v nvidia-smi >/dev/null; then
  echo "nvidia-smi not found: this script needs an NVIDIA GPU with its driver installed" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
if [[ "${SKIP_PIP:-0}" != "1" ]]; then
  step "installing the CUDA PJRT plugin and the CUDA libraries"
  "$PYTHON" -m pip install --upgrade jax-cuda13-pjrt 'jax-cuda13-plugin[with-cuda]'
fi
export GRPO_PYTHON="$PYTHON"

step "1. plugins and devices"
"$PYTHON" -m pip list 2>/dev/null | grep -Ei '^(jax-cuda13|nvidia-)' || true
check "$GRPO" devices --plugin cuda

step "2. runtime tests through the CUDA plugin"
if [[ -n "${GRPO_BIN_DIR:-}" ]]; then
  for t in runtime runtime_cache; do
    check env GRPO_TEST_PLUGIN=cuda GRPO_SKIP_TPU_TESTS=1 "$BIN/$t" --test-threads=1
  done
else
  check env GRPO_TEST_PLUGIN=cuda GRPO_SKIP_TPU_TESTS=1 \
    cargo test --release -p xla --test runtime --test runtime_cache -- --test-threads=1
fi

step "3. GEMM benchmark through the CUDA plugin (crate vs bare PJRT calls)"
check "$BIN/runtime_bench" --plugin cuda --n 2048 --iters 50 --calls 20000
check "$BIN/runtime_bench" --plugin cuda --n 8192 --iters 20 --calls 2000

step "4. parity with the CPU plugin (tiny chat model, f32)"
CPU_REF="${GPU_CHECK_CPU_REFERENCE:-}"
if [[ -z "$CPU_REF" ]]; then
  CPU_REF=$OUT_DIR/cpu
  check parity_side cpu "$CPU_REF"
fi
check parity_side cuda "$OUT_DIR/cuda" "$CPU_REF"
check "$PYTHON" scripts/compare_device_runs.py "$CPU_REF" "$OUT_DIR/cuda"

step "5. grpo generate vs transformers generate (random-weight Qwen2.5-0.5B, bf16, greedy)"
check "$PYTHON" scripts/bench/hf_generate_peer.py --grpo "$GRPO" --work "$OUT_DIR/peer" \
  --config recipes/configs/Qwen2.5-0.5B-Instruct/config.json --tokenizer "${QWEN_TOKENIZER:-models/qwen3}"

step "6. GRPO steps on the GPU: recipes/gsm8k-smollm2.yaml on step 5's random-weight model (bf16)"
"$GRPO" preprocess gsm8k --input data/gsm8k/train.jsonl --output "$OUT_DIR/gsm8k/train.parquet" >/dev/null &&
  check "$GRPO" run recipes/gsm8k-smollm2.yaml --set model.path="$OUT_DIR/peer/model" \
    --set data.train_files="$OUT_DIR/gsm8k/train.parquet" --set "data.val_files=[]" --set trainer.test_freq=-1 \
    --set cluster.device=cuda --set rollout.dtype=bf16 --set actor.param_dtype=bf16 \
    --set trainer.total_training_steps=4 --set trainer.save_freq=-1 \
    --set trainer.output_dir="$OUT_DIR/gsm8k/run"

step "done; outputs and log in $OUT_DIR"
if ((${#failed[@]})); then
  printf 'failed: %s\n' "${failed[@]}"
  exit 1
fi
