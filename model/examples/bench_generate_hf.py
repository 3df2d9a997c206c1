"""The Hugging Face transformers (PyTorch, CPU, f32) side of bench_generate.rs: the same
SmolLM2-135M-Instruct GGUF (dequantised by transformers), the same token ids, the same shapes.

Prints `hf_prefill <tokens/s>`, `hf_decode_single <tokens/s>`, `hf_decode_batched <tokens/s>`.

Usage: python3 bench_generate_hf.py MODEL.gguf [--prefill-batch 4] [--prefill-len 128]
                                    [--decode-steps 32] [--decode-slots 16] [--threads N]
Needs: pip install torch transformers gguf
"""
import argparse, os, time
import torch
from transformers import AutoModelForCausalLM, DynamicCache

p = argparse.ArgumentParser()
p.add_argument('model')
p.add_argument('--prefill-batch', type=int, default=4)
p.add_argument('--prefill-len', type=int, default=128)
p.add_argument('--decode-steps', type=int, default=32)
p.add_argument('--decode-slots', type=int, default=16)
p.add_argument('--threads', type=int, default=0, help='torch threads (0: torch default)')
a = p.parse_args()
if a.threads > 0:
    torch.set_num_threads(a.threads)


def token(row, col):
    return (17 + 7919 * row + 31 * col) % 49000 + 100


model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(a.model)),
                                             gguf_file=os.path.basename(a.model),
                                             dtype=torch.float32).eval()


@torch.inference_mode()
def prefill_rate(b, t, reps=2):
    ids = torch.tensor([[token(r, c) for c in range(t)] for r in range(b)])
    model(input_ids=ids, logits_to_keep=1)
    start = time.perf_counter()
    for _ in range(reps):
        model(input_ids=ids, logits_to_keep=1)
    return reps * b * t / (time.perf_counter() - start)


@torch.inference_mode()
def decode_rate(slots, steps):
    ids = torch.tensor([[token(s, c) for c in range(16)] for s in range(slots)])
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def step(pos):
        nxt = torch.tensor([[token(s, pos)] for s in range(slots)])
        model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)

    step(16)
    start = time.perf_counter()
    for i in range(steps):
        step(17 + i)
    return slots * steps / (time.perf_counter() - start)


print(f'hf_prefill {prefill_rate(a.prefill_batch, a.prefill_len):.1f}')
print(f'hf_decode_single {decode_rate(1, a.decode_steps):.1f}')
print(f'hf_decode_batched {decode_rate(a.decode_slots, a.decode_steps):.1f}')
print(f'# torch {torch.__version__}, {torch.get_num_threads()} threads')
