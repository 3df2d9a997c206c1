#!/usr/bin/env bash
# Runs the PJRT runtime tests and the GEMM benchmark through the XLA CUDA plugin, in one go, on an
# NVIDIA machine. Installs the plugin (jax-cuda13-pjrt) and the nvidia-* CUDA wheels with pip
# first; the runtime preloads those libraries itself before creating the CUDA client.
#
#   scripts/gpu-check.sh            # from the repository root
#   PYTHON=python3.12 scripts/gpu-check.sh
#   SKIP_PIP=1 scripts/gpu-check.sh # when the wheels are already installed
#
# Everything it prints is also written to gpu-check-<UTC time>.log; paste the benchmark lines into
# BENCHMARKS.md ("Compute core (xla)").
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
LOG="gpu-check-$(date -u +%Y%m%dT%H%M%SZ).log"
exec > >(tee "$LOG") 2>&1

echo "== host"
date -u
if ! command -v nvidia-smi >/dev/null; then
  echo "nvidia-smi not found: this script needs an NVIDIA GPU with its driver installed" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

if [[ "${SKIP_PIP:-0}" != "1" ]]; then
  echo "== installing the CUDA PJRT plugin and the CUDA libraries"
  # jax-cuda13-plugin[with-cuda] pulls jax-cuda13-pjrt (the plugin) and the nvidia-* wheels
  # (cudart, cublas, cudnn, nccl, nvjitlink, ...).
  "$PYTHON" -m pip install --upgrade jax-cuda13-pjrt 'jax-cuda13-plugin[with-cuda]'
fi
export GRPO_PYTHON="$PYTHON"

echo "== plugins and devices"
"$PYTHON" -m pip list 2>/dev/null | grep -Ei '^(jax-cuda13|nvidia-)' || true
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target-gpu-check}"
cargo run --release -q -- devices --plugin cuda

echo "== runtime tests through the CUDA plugin"
# GRPO_TEST_PLUGIN makes tests/runtime*.rs use the CUDA client instead of the CPU one.
GRPO_TEST_PLUGIN=cuda GRPO_SKIP_TPU_TESTS=1 \
  cargo test --release -p xla --test runtime --test runtime_cache -- --test-threads=1

echo "== GEMM benchmark through the CUDA plugin (crate vs bare PJRT calls)"
cargo run --release -p xla --example runtime_bench -- --plugin cuda --n 2048 --iters 50 --calls 20000
cargo run --release -p xla --example runtime_bench -- --plugin cuda --n 8192 --iters 20 --calls 2000

echo "== done; log in $LOG"
