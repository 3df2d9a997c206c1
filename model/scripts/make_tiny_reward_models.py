"""Tiny random-weight sequence classifiers (reward models) with reference scores from transformers.

Writes model/fixtures/tiny_rm/<family>/{config.json, model.safetensors, reference.safetensors}:
  llama: LlamaForSequenceClassification, 1 label (a reward model), Llama 3 rope_scaling;
  qwen2: Qwen2ForSequenceClassification, 2 labels, QKV bias;
  qwen3: Qwen3ForSequenceClassification, 1 label, q/k RMSNorm, head_dim 32.
All: 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 384, pad_token_id 0, f32 weights.
reference.safetensors holds, for each fixed token sequence i, `input_ids_<i>` (I32, [T]) and
`scores_<i>` (F32, [num_labels]): the model's logits for that sequence alone. Sequence 2 ends in
two tokens equal to the pad id, which transformers skips when it picks the position it reads.

Usage: python3 make_tiny_reward_models.py      Needs: pip install torch transformers safetensors
"""
import os
from importlib.metadata import version
import torch
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification,
                          Qwen3Config, Qwen3ForSequenceClassification)

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.join(here, '..', 'fixtures', 'tiny_rm')
common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
models = {
    'llama': (LlamaForSequenceClassification, LlamaConfig(**common, num_labels=1, rope_theta=500000.0,
              rope_scaling={'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                            'original_max_position_embeddings': 32})),
    'qwen2': (Qwen2ForSequenceClassification, Qwen2Config(**common, num_labels=2, rope_theta=1000000.0)),
    'qwen3': (Qwen3ForSequenceClassification, Qwen3Config(**common, num_labels=1, head_dim=32, rope_theta=1000000.0)),
}
sequences = [
    [1, 17, 250, 3, 99, 383, 42],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200, 201, 202, 203, 300, 301, 302, 303, 4, 2, 1, 100, 2],
    [1, 40, 41, 42, 2, 0, 0],
    [77],
]
for seed, (name, (cls, config)) in enumerate(models.items()):
    torch.manual_seed(2000 + seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # Make norms and biases non-trivial so a loader that drops them fails.
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
            scores = model(input_ids=ids).logits[0].to(torch.float32).contiguous()
            ref[f'input_ids_{i}'] = ids[0].to(torch.int32).contiguous()
            ref[f'scores_{i}'] = scores
    save_file(ref, os.path.join(out, 'reference.safetensors'),
              metadata={'generated_by': f"model/scripts/make_tiny_reward_models.py with torch {torch.__version__}, transformers {version('transformers')}"})
    print(name, 'labels', config.num_labels, 'files', sorted(os.listdir(out)), 'scores', [ref[f'scores_{i}'].tolist() for i in range(len(sequences))])
