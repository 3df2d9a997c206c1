"""Peer of rollout_bench: Hugging Face transformers `generate` (PyTorch, CPU, batched) on the
same prompts (token ids), sampling at temperature 1 with no top-k/top-p, EOS ignored.

usage: hf_generate_peer.py MODEL_DIR PROMPTS_JSON NEW_TOKENS [f32|bf16]
The dtype of the model (weights and compute) is the optional 4th argument, else the environment
variable ROLLOUT_PEER_DTYPE (so that `rollout_bench`, which passes three arguments, can run the
peer in bf16: `ROLLOUT_PEER_DTYPE=bf16 cargo run ... --example rollout_bench -- --dtype bf16`),
else f32. bf16 loads the model with `dtype=torch.bfloat16` (weights, activations and KV cache in
bf16, as a transformers user asking for bf16 gets).
ROLLOUT_PEER_GROUP=N (default 1) asks `generate` for N samples of each prompt
(`num_return_sequences=N`), as `rollout_bench --group N` does of the engine.
prints `peer_tokens_per_s X`, `peer_seconds S` (the timed `generate`) and details."""
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

model_dir, prompts_file, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
dtype_name = sys.argv[4] if len(sys.argv) > 4 else os.environ.get("ROLLOUT_PEER_DTYPE", "f32")
dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
if dtype_name not in dtypes:
    sys.exit(f"hf_generate_peer.py: unknown dtype {dtype_name!r} (4th argument or "
             f"ROLLOUT_PEER_DTYPE); use f32 or bf16")
group = int(os.environ.get("ROLLOUT_PEER_GROUP", "1"))
prompts = json.load(open(prompts_file))
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtypes[dtype_name])
model.eval()
ids = torch.tensor(prompts, dtype=torch.long)  # all prompts have the same length: no padding
mask = torch.ones_like(ids)
with torch.inference_mode():
    # Warm-up (first-call initialisation), not timed.
    model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                   top_p=1.0, max_new_tokens=2, min_new_tokens=2, pad_token_id=0,
                   num_return_sequences=group)
    start = time.time()
    cpu_start = time.process_time()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        num_return_sequences=group,
    )
    elapsed = time.time() - start
    cpu = time.process_time() - cpu_start
generated = (out.shape[1] - ids.shape[1]) * out.shape[0]
print(f"peer: transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
      f"{torch.get_num_threads()} threads, {dtype_name} (model dtype {model.dtype}), "
      f"batch {out.shape[0]} ({ids.shape[0]} prompts x {group} samples)")
print(f"peer: {generated} tokens in {elapsed:.1f} s; CPU time of generate {cpu:.1f} s = "
      f"{generated / cpu:.1f} tokens per CPU-second (OpenMP threads that spin while waiting "
      f"count as busy)")
print(f"peer_tokens_per_s {generated / elapsed:.2f}")
print(f"peer_seconds {elapsed:.3f}")
