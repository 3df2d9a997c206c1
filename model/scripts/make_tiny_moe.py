"""Tiny random-weight Qwen3-MoE checkpoints with reference outputs from transformers.

Writes model/fixtures/tiny/<name>/{config.json, model.safetensors, reference.safetensors}:
  qwen3_moe:        transformers 5's stacked expert layout (`mlp.experts.gate_up_proj`
                    [E, 2*moe_ffn, hidden], `mlp.experts.down_proj` [E, hidden, moe_ffn]),
                    norm_topk_prob true, layer 1 dense (mlp_only_layers [1]), untied head;
  qwen3_moe_legacy: the per-expert layout of the published checkpoints
                    (`mlp.experts.{e}.{gate,up,down}_proj.weight`), norm_topk_prob false,
                    decoder_sparse_step 2 (layers 1 and 3 sparse), tied head.
All: hidden 64, 4 heads / 2 KV heads, head_dim 32, 8 experts of width 32, top 2, vocab 384, f32.
Routers are drawn wide (std 0.5) so no token's k-th and (k+1)-th expert are near a tie.
reference.safetensors holds, for each fixed token sequence i, `input_ids_<i>` (I32, [T]),
`logits_<i>` (F32, [T, vocab]) and `experts_<i>` (I32, [sparse layers, T, k]): the experts
transformers' router chose, in its top-k order.

Usage: python3 make_tiny_moe.py      Needs: pip install torch transformers safetensors
"""
import json, os
from importlib.metadata import version
import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.join(here, '..', 'fixtures', 'tiny')
common = dict(vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
              num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1, rope_theta=1000000.0,
              router_aux_loss_coef=0.001, bos_token_id=1, eos_token_id=2, pad_token_id=0)
models = {
    'qwen3_moe': Qwen3MoeConfig(**common, num_hidden_layers=3, norm_topk_prob=True, mlp_only_layers=[1],
                                tie_word_embeddings=False),
    'qwen3_moe_legacy': Qwen3MoeConfig(**common, num_hidden_layers=4, norm_topk_prob=False, decoder_sparse_step=2,
                                       tie_word_embeddings=True),
}
sequences = [
    [1, 17, 250, 3, 99, 383, 42],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200, 201, 202, 203, 300, 301, 302, 303, 0, 2, 1, 100],
    [77],
]


def per_expert(state, config):
    """The stacked expert tensors split into the published per-expert names."""
    out = {}
    for name, t in state.items():
        if name.endswith('mlp.experts.gate_up_proj'):
            prefix = name[: -len('gate_up_proj')]
            gate, up = t.chunk(2, dim=1)
            for e in range(config.num_experts):
                out[f'{prefix}{e}.gate_proj.weight'] = gate[e].contiguous()
                out[f'{prefix}{e}.up_proj.weight'] = up[e].contiguous()
        elif name.endswith('mlp.experts.down_proj'):
            prefix = name[: -len('down_proj')]
            for e in range(config.num_experts):
                out[f'{prefix}{e}.down_proj.weight'] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


for seed, (name, config) in enumerate(models.items()):
    torch.manual_seed(2000 + seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith('norm.weight'):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith('mlp.gate.weight'):
                p.copy_(0.5 * torch.randn_like(p))
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    state = {k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == 'lm_head.weight')}
    if name == 'qwen3_moe_legacy':
        state = per_expert(state, config)
    meta = {'format': 'pt'}
    save_file(state, os.path.join(out, 'model.safetensors'), metadata=meta)
    ref = {}
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, 'gate')]
    with torch.no_grad():
        for i, seq in enumerate(sequences):
            ids = torch.tensor([seq])
            chosen = []
            hooks = [model.model.layers[l].mlp.gate.register_forward_hook(
                lambda _m, _i, o: chosen.append(o[2].to(torch.int32))) for l in sparse]
            logits = model(input_ids=ids).logits[0].to(torch.float32).contiguous()
            for h in hooks:
                h.remove()
            ref[f'input_ids_{i}'] = ids[0].to(torch.int32).contiguous()
            ref[f'logits_{i}'] = logits
            ref[f'experts_{i}'] = torch.stack(chosen).contiguous()
            # The routing margin: how far each token's k-th probability is above the (k+1)-th.
    save_file(ref, os.path.join(out, 'reference.safetensors'),
              metadata={'generated_by': f"model/scripts/make_tiny_moe.py with torch {torch.__version__}, transformers {version('transformers')}"})
    print(name, 'params', sum(p.numel() for p in model.parameters()), 'sparse layers', sparse,
          'files', sorted(os.listdir(out)))
