"""The transformers (PyTorch, CPU) side of classifier_bench.rs: the same reward-model checkpoint
(made by `classifier_bench make-rm`), the same token ids, batches right-padded with an attention
mask as a reward-model worker pads them.

Prints `hf_sequences_per_s <rate>` and the first four scores.

Usage: python3 classifier_bench_hf.py RM_DIR [--dtype f32|bf16] [--batch 8] [--sequences 64]
                                      [--max-len 256] [--threads N]
Needs: pip install torch transformers
"""
import argparse, time
import torch
from transformers import AutoModelForSequenceClassification

p = argparse.ArgumentParser()
p.add_argument('model')
p.add_argument('--dtype', default='f32', choices=['f32', 'bf16'])
p.add_argument('--batch', type=int, default=8)
p.add_argument('--sequences', type=int, default=64)
p.add_argument('--max-len', type=int, default=256)
p.add_argument('--threads', type=int, default=0, help='torch threads (0: torch default)')
a = p.parse_args()
if a.threads > 0:
    torch.set_num_threads(a.threads)

half = a.max_len // 2
rows = [[(17 + 7919 * r + 31 * c) % 49000 + 100 for c in range(half + (37 * r) % half)] for r in range(a.sequences)]
dtype = torch.bfloat16 if a.dtype == 'bf16' else torch.float32
model = AutoModelForSequenceClassification.from_pretrained(a.model, dtype=dtype).eval()
pad = model.config.pad_token_id


def batches():
    for i in range(0, len(rows), a.batch):
        chunk = rows[i:i + a.batch]
        width = max(len(r) for r in chunk)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in chunk])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk])
        yield ids, mask


with torch.inference_mode():
    for ids, mask in batches():
        model(input_ids=ids, attention_mask=mask)
    start = time.perf_counter()
    scores = []
    for ids, mask in batches():
        scores.extend(model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist())
    took = time.perf_counter() - start
print(f'hf_sequences_per_s {len(rows) / took:.2f} ({len(rows)} sequences in {took:.2f} s, batch {a.batch}, {a.dtype})')
print('hf_first_scores', scores[:4])
