"""Tiny random-weight Qwen3-MoE checkpoints with reference outputs from transformers.

Writes model/fixtures/tiny/<name>/{config.json, model.safetensors, reference.safetensors}:
  qwen3_moe:        transformers 5's stacked expert layout (`mlp.experts.gate_up_proj`
                    [E, 2*moe_ffn, hidden], `mlp.experts.down_proj` [E, hidden, moe_ffn]),
                    norm_topk_prob true, layer 1 dense (mlp_only_layers [1]), untied head;
  qwen3_moe_legacy: the per-expert layout of the published checkpoints
                    (`mlp.experts.{e}.{gate,up,down}_proj.weight`), norm_topk_prob false,
                    decoder_sparse_step 2 (layers 1 and 3 sparse), tied head.
  qwen3_moe_gguf/{model-f32.gguf, model-q8_0.gguf}: llama.cpp's qwen3moe layout of a 2-layer model,
                    every layer sparse, f32 and with Q8_0 projections and experts.
All: hidden 64, 4 heads / 2 KV heads, head_dim 32, 8 experts of width 32, top 2, vocab 384, f32.
Routers are drawn wide (std 0.5) so no token's k-th and (k+1)-th expert are near a tie.
reference.safetensors holds, for each fixed token sequence i, `input_ids_<i>` (I32, [T]),
`logits_<i>` (F32, [T, vocab]), `experts_<i>` (I32, [sparse layers, T, k]): the experts
transformers' router chose, in its top-k order, and `aux_loss_<i>` (F32, [1]): its
load-balancing loss (`output_router_logits=True`, before `router_aux_loss_coef`).

Usage: python3 make_tiny_moe.py      Needs: pip install torch transformers safetensors gguf
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


def random_model(config, seed):
    """A random model whose norms are away from 1 (so a loader that drops them fails) and whose
    routers are wide (so no token's k-th and (k+1)-th expert are near a tie)."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith('norm.weight'):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith('mlp.gate.weight'):
                p.copy_(0.5 * torch.randn_like(p))
    return model


for seed, (name, config) in enumerate(models.items()):
    model = random_model(config, 2000 + seed)
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
            result = model(input_ids=ids, output_router_logits=True)
            logits = result.logits[0].to(torch.float32).contiguous()
            for h in hooks:
                h.remove()
            # transformers' load_balancing_loss_func over the sparse layers (before its coefficient).
            ref[f'aux_loss_{i}'] = result.aux_loss.reshape(1).to(torch.float32).contiguous()
            ref[f'input_ids_{i}'] = ids[0].to(torch.int32).contiguous()
            ref[f'logits_{i}'] = logits
            ref[f'experts_{i}'] = torch.stack(chosen).contiguous()
            # The routing margin: how far each token's k-th probability is above the (k+1)-th.
    save_file(ref, os.path.join(out, 'reference.safetensors'),
              metadata={'generated_by': f"model/scripts/make_tiny_moe.py with torch {torch.__version__}, transformers {version('transformers')}"})
    print(name, 'params', sum(p.numel() for p in model.parameters()), 'sparse layers', sparse,
          'files', sorted(os.listdir(out)))


# llama.cpp's qwen3moe GGUF of a third model, every layer sparse (llama.cpp's qwen3moe has no
# dense layers): model-f32.gguf with every tensor f32, model-q8_0.gguf with the projections and
# experts in Q8_0 (as llama.cpp's quantize writes them), and reference.safetensors as above.
import numpy as np
import gguf
from gguf.quants import quantize

config = Qwen3MoeConfig(**common, num_hidden_layers=2, norm_topk_prob=True, tie_word_embeddings=False)
model = random_model(config, 2002)
out = os.path.join(root, 'qwen3_moe_gguf')
os.makedirs(out, exist_ok=True)
names = {'self_attn.q_proj.weight': 'attn_q.weight', 'self_attn.k_proj.weight': 'attn_k.weight',
         'self_attn.v_proj.weight': 'attn_v.weight', 'self_attn.o_proj.weight': 'attn_output.weight',
         'self_attn.q_norm.weight': 'attn_q_norm.weight', 'self_attn.k_norm.weight': 'attn_k_norm.weight',
         'input_layernorm.weight': 'attn_norm.weight', 'post_attention_layernorm.weight': 'ffn_norm.weight',
         'mlp.gate.weight': 'ffn_gate_inp.weight', 'mlp.experts.down_proj': 'ffn_down_exps.weight'}
for quant in ['f32', 'q8_0']:
    w = gguf.GGUFWriter(os.path.join(out, f'model-{quant}.gguf'), 'qwen3moe')
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_parameters['rope_theta'])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name, t):
        a = t.detach().to(torch.float32).numpy()
        if quant == 'q8_0' and a.ndim >= 2 and not name.startswith('token_embd'):
            w.add_tensor(name, quantize(a, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)

    state = model.state_dict()
    add('token_embd.weight', state['model.embed_tokens.weight'])
    for l in range(config.num_hidden_layers):
        for hf, gg in names.items():
            add(f'blk.{l}.{gg}', state[f'model.layers.{l}.{hf}'])
        gate, up = state[f'model.layers.{l}.mlp.experts.gate_up_proj'].chunk(2, dim=1)
        add(f'blk.{l}.ffn_gate_exps.weight', gate.contiguous())
        add(f'blk.{l}.ffn_up_exps.weight', up.contiguous())
    add('output_norm.weight', state['model.norm.weight'])
    add('output.weight', state['lm_head.weight'])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
ref = {}
with torch.no_grad():
    for i, seq in enumerate(sequences):
        ids = torch.tensor([seq])
        chosen = []
        hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, o: chosen.append(o[2].to(torch.int32)))
                 for layer in model.model.layers]
        result = model(input_ids=ids, output_router_logits=True)
        for h in hooks:
            h.remove()
        ref[f'input_ids_{i}'] = ids[0].to(torch.int32).contiguous()
        ref[f'logits_{i}'] = result.logits[0].to(torch.float32).contiguous()
        ref[f'experts_{i}'] = torch.stack(chosen).contiguous()
        ref[f'aux_loss_{i}'] = result.aux_loss.reshape(1).to(torch.float32).contiguous()
save_file(ref, os.path.join(out, 'reference.safetensors'),
          metadata={'generated_by': f"model/scripts/make_tiny_moe.py with torch {torch.__version__}, transformers {version('transformers')}, gguf-py {version('gguf')}"})
print('qwen3_moe_gguf', sorted(os.listdir(out)))
