"""Peer of rollout_bench: Hugging Face transformers `generate` (PyTorch, CPU, batched) on the
same prompts (token ids), sampling at temperature 1 with no top-k/top-p, EOS ignored.

usage: hf_generate_peer.py MODEL_DIR PROMPTS_JSON NEW_TOKENS
prints `peer_tokens_per_s X` and details."""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

model_dir, prompts_file, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompts = json.load(open(prompts_file))
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
model.eval()
ids = torch.tensor(prompts, dtype=torch.long)  # all prompts have the same length: no padding
mask = torch.ones_like(ids)
with torch.inference_mode():
    # Warm-up (first-call initialisation), not timed.
    model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                   top_p=1.0, max_new_tokens=2, min_new_tokens=2, pad_token_id=0)
    start = time.time()
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
    )
    elapsed = time.time() - start
generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
print(f"peer: transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
      f"{torch.get_num_threads()} threads, f32, batch {ids.shape[0]}")
print(f"peer: {generated} tokens in {elapsed:.1f} s")
print(f"peer_tokens_per_s {generated / elapsed:.2f}")
