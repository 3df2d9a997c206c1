"""Tiny random-weight Llama, Qwen2, Qwen3 and Mistral checkpoints with reference logits from transformers.

Writes model/fixtures/tiny/<family>/{config.json, model.safetensors, reference.safetensors}:
  llama: untied head, Llama 3 rope_scaling, rope_theta 500000;
  qwen2: tied head, QKV bias (biases set non-zero so they matter);
  qwen3: untied head, q/k RMSNorm (weights set away from 1), head_dim 32 != hidden/heads;
  mistral: untied head, head_dim 32 != hidden/heads (as Mistral Small's), no sliding window;
  mistral_window: tied head, a sliding window of 5 positions (the longest sequence has 24, so
  the window masks).
All: 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 384, f32 weights.
reference.safetensors holds, for each fixed token sequence i, `input_ids_<i>` (I32, [T]) and
`logits_<i>` (F32, [T, vocab]): the prefill logits of every position from transformers in f32.

Usage: python3 make_tiny_models.py [NAME ...]   (default: every family; each family's seed is
fixed, so one can be made alone)      Needs: pip install torch transformers safetensors
"""
import json, os, sys
from importlib.metadata import version
import torch
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.join(here, '..', 'fixtures', 'tiny')
common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
models = {
    'llama': (LlamaForCausalLM, LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
              rope_scaling={'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                            'original_max_position_embeddings': 32})),
    'qwen2': (Qwen2ForCausalLM, Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)),
    'qwen3': (Qwen3ForCausalLM, Qwen3Config(**common, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0)),
    'mistral': (MistralForCausalLM, MistralConfig(**common, head_dim=32, tie_word_embeddings=False,
                rope_theta=1000000.0, sliding_window=None)),
    'mistral_window': (MistralForCausalLM, MistralConfig(**common, tie_word_embeddings=True, rope_theta=10000.0,
                       sliding_window=5)),
}
sequences = [
    [1, 17, 250, 3, 99, 383, 42],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200, 201, 202, 203, 300, 301, 302, 303, 0, 2, 1, 100],
    [77],
]
only = sys.argv[1:]
for seed, (name, (cls, config)) in enumerate(models.items()):
    if only and name not in only:
        continue
    torch.manual_seed(1000 + seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # Make norms, biases and q/k norms non-trivial so a loader that drops them fails.
            if pname.endswith('norm.weight'):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith('.bias'):
                p.copy_(0.1 * torch.randn_like(p))
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    ref = {}
    with torch.no_grad():
        for i, seq in enumerate(sequences):
            ids = torch.tensor([seq])
            logits = model(input_ids=ids).logits[0].to(torch.float32).contiguous()
            ref[f'input_ids_{i}'] = ids[0].to(torch.int32).contiguous()
            ref[f'logits_{i}'] = logits
    save_file(ref, os.path.join(out, 'reference.safetensors'),
              metadata={'generated_by': f"model/scripts/make_tiny_models.py with torch {torch.__version__}, transformers {version('transformers')}"})
    print(name, 'params', sum(p.numel() for p in model.parameters()), 'files', sorted(os.listdir(out)))
