"""`grpo generate` against transformers' `generate` on one GPU or the CPU: the same random-weight
model (made here from a config.json with torch's seed 0 and saved as safetensors for both), the
same prompts, greedy decoding, the same number of new tokens, the same compute type on both sides
(`--dtype`: bf16 by default on a GPU, f32 on the CPU).

transformers runs its default `generate` (dynamic KV cache, SDPA attention: what TRL's trainer uses
when vLLM is off), batch = all prompts, after one warm-up call. `grpo generate` runs twice in new
processes: cold (compiling its programs into the executable cache) and warm (loading them from
it); its rate counts the engine's whole loop, prefill included, as it prints it.

Usage: python3 scripts/bench/hf_generate_peer.py --grpo target/release/grpo --work DIR
          --config recipes/configs/Qwen2.5-0.5B-Instruct/config.json --tokenizer models/qwen3
          [--prompts 64] [--new-tokens 256] [--device cuda|cpu] [--dtype bf16|f32]
Needs torch and transformers.
"""
import argparse
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

p = argparse.ArgumentParser()
p.add_argument("--grpo", required=True)
p.add_argument("--work", type=Path, required=True)
p.add_argument("--config", type=Path, required=True)
p.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json")
p.add_argument("--prompts", type=int, default=64)
p.add_argument("--new-tokens", type=int, default=256)
p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
p.add_argument("--dtype", choices=["bf16", "f32"], default=None)
a = p.parse_args()
dtype = a.dtype or ("bf16" if a.device == "cuda" else "f32")
torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32


def sync():
    if a.device == "cuda":
        torch.cuda.synchronize()

model_dir = a.work / "model"
model_dir.mkdir(parents=True, exist_ok=True)
config = AutoConfig.from_pretrained(a.config.parent)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype).to(a.device).eval()
parameters = sum(p.numel() for p in model.parameters())
model.save_pretrained(model_dir)
for name in ("tokenizer.json", "tokenizer_config.json"):
    if (a.tokenizer / name).exists():
        shutil.copy(a.tokenizer / name, model_dir / name)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
tokenizer.padding_side = "left"
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token

# Prompts of 40-70 tokens, different in each row.
prompts = [
    f"Question {i}: a train leaves station {i % 17} at {i % 12 + 1} o'clock and travels "
    f"{30 + i} miles per hour for {i % 5 + 2} hours. A second train leaves {i % 7} hours later "
    f"at {45 + i % 9} miles per hour. How far apart are they at the end, and why?"
    for i in range(a.prompts)
]
(a.work / "prompts.txt").write_text("\n".join(prompts) + "\n")
batch = tokenizer(prompts, return_tensors="pt", padding=True).to(a.device)
prompt_tokens = int(batch["attention_mask"].sum())


def hf_generate(new_tokens):
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
    sync()
    return time.perf_counter() - t, (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]


hf_generate(8)
hf_seconds, hf_tokens = hf_generate(a.new_tokens)
del model
if a.device == "cuda":
    torch.cuda.empty_cache()


def grpo_generate():
    cmd = [a.grpo, "generate", "--device", a.device, "--dtype", dtype, "--model", str(model_dir),
           "--prompts-file", str(a.work / "prompts.txt"), "--max-new-tokens", str(a.new_tokens),
           "--max-num-seqs", str(a.prompts), "--temperature", "0"]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"grpo generate failed:\n{r.stderr}")
    m = re.search(r"\[(\d+) new tokens in ([0-9.]+)s", r.stderr)
    return int(m.group(1)), float(m.group(2)), wall


cold_tokens, cold_seconds, cold_wall = grpo_generate()
tokens, seconds, wall = grpo_generate()
result = {
    "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
    "model": f"{config.model_type} {parameters / 1e6:.0f}M random weights, {dtype}",
    "prompts": a.prompts, "prompt_tokens": prompt_tokens, "new_tokens_per_prompt": a.new_tokens,
    "hf_tokens": hf_tokens, "hf_seconds": round(hf_seconds, 3),
    "hf_tokens_per_s": round(hf_tokens / hf_seconds, 1),
    "grpo_cold": {"tokens": cold_tokens, "engine_seconds": cold_seconds, "process_seconds": round(cold_wall, 2)},
    "grpo_warm": {"tokens": tokens, "engine_seconds": seconds, "process_seconds": round(wall, 2)},
    "grpo_warm_tokens_per_s": round(tokens / seconds, 1),
    "ratio_grpo_warm_over_hf": round((tokens / seconds) / (hf_tokens / hf_seconds), 2),
}
print(json.dumps(result, indent=1))
(a.work / "result.json").write_text(json.dumps(result, indent=1))
