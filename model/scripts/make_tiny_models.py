"""Tiny random-weight Llama, Qwen2, Qwen3, Mistral and Gemma 3 checkpoints with reference logits from transformers.

Writes model/fixtures/tiny/<family>/{config.json, model.safetensors, reference.safetensors}:
  llama: untied head, Llama 3 rope_scaling, rope_theta 500000;
  qwen2: tied head, QKV bias (biases set non-zero so they matter);
  qwen3: untied head, q/k RMSNorm (weights set away from 1), head_dim 32 != hidden/heads;
  mistral: untied head, head_dim 32 != hidden/heads (as Mistral Small's), no sliding window;
  mistral_window: tied head, a sliding window of 5 positions (the longest sequence has 24, so
  the window masks);
  gemma3: Gemma3ForCausalLM, 3 layers (sliding, global, sliding) with a window of 5, head_dim 32,
  query_pre_attn_scalar 24 (so neither head width scales the scores), the global layer's RoPE
  linearly scaled by 8 at base 1e6 and the sliding layers' unscaled at base 1e4, tied head;
  gemma3_gguf: llama.cpp's gemma3 GGUF of another such model (query_pre_attn_scalar = head_dim,
  as llama.cpp assumes below 27B), every tensor f32 (model-f32.gguf) or its projections in Q8_0
  (model-q8_0.gguf), norms stored plus one as llama.cpp's converter writes them;
  mistral_gguf: the `mistral` fixture's weights as llama.cpp's converter writes a Mistral model
  (architecture `llama`, Q and K rows permuted, head width in attention.key_length), f32
  (model-f32.gguf) and Q8_0 projections (model-q8_0.gguf); its reference logits are `mistral`'s.
Others: 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 384, f32 weights.
reference.safetensors holds, for each fixed token sequence i, `input_ids_<i>` (I32, [T]) and
`logits_<i>` (F32, [T, vocab]): the prefill logits of every position from transformers in f32;
gemma3's also holds greedy continuations: `greedy_prompt_<i>` and its 16 tokens `greedy_<i>`.

Usage: python3 make_tiny_models.py [NAME ...]   (default: every family; each family's seed is
fixed, so one can be made alone)      Needs: pip install torch transformers safetensors
"""
import json, os, sys
from importlib.metadata import version
import torch
from safetensors.torch import save_file
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
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


def gemma3_config(query_pre_attn_scalar):
    return Gemma3TextConfig(**{**common, 'num_hidden_layers': 3}, head_dim=32, tie_word_embeddings=True,
                            query_pre_attn_scalar=query_pre_attn_scalar, sliding_window=5,
                            layer_types=['sliding_attention', 'full_attention', 'sliding_attention'],
                            rope_parameters={'full_attention': {'rope_type': 'linear', 'factor': 8.0,
                                                                'rope_theta': 1000000.0},
                                             'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0}})


models['gemma3'] = (Gemma3ForCausalLM, gemma3_config(24))
sequences = [
    [1, 17, 250, 3, 99, 383, 42],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200, 201, 202, 203, 300, 301, 302, 303, 0, 2, 1, 100],
    [77],
]
greedy_prompts = [[1, 17, 250, 3, 99, 383, 42], [5, 6, 7, 8, 9, 10, 11, 12, 13], [77, 3]]
only = sys.argv[1:]
for seed, (name, (cls, config)) in enumerate(models.items()):
    if only and name not in only:
        continue
    torch.manual_seed(1000 + seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # Make norms, biases and q/k norms non-trivial so a loader that drops them fails.
            # Gemma's norms scale by 1 + w: their offsets set away from 0 instead.
            if pname.endswith('norm.weight'):
                p.copy_((0.0 if name == 'gemma3' else 1.0) + 0.2 * torch.randn_like(p))
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
        if name == 'gemma3':
            # Greedy continuations (argmax of each step's last logits, no stop token) past the
            # sliding window, each step's best token at least 1e-3 above the runner-up so that
            # rounding cannot flip it.
            for i, seq in enumerate(greedy_prompts):
                ids = list(seq)
                for _ in range(16):
                    last = model(input_ids=torch.tensor([ids])).logits[0, -1]
                    top = torch.topk(last, 2).values
                    assert top[0] - top[1] > 1e-3, (i, ids)
                    ids.append(int(last.argmax()))
                ref[f'greedy_prompt_{i}'] = torch.tensor(seq, dtype=torch.int32)
                ref[f'greedy_{i}'] = torch.tensor(ids[len(seq):], dtype=torch.int32)
    save_file(ref, os.path.join(out, 'reference.safetensors'),
              metadata={'generated_by': f"model/scripts/make_tiny_models.py with torch {torch.__version__}, transformers {version('transformers')}"})
    print(name, 'params', sum(p.numel() for p in model.parameters()), 'files', sorted(os.listdir(out)))


# llama.cpp's gemma3 GGUF: the same architecture under llama.cpp's names, norms stored as
# 1 + w (convert_hf_to_gguf.py's Gemma3Model), the global layers every second one
# (attention.sliding_window_pattern 2, where llama.cpp's default is 6).
if not only or 'gemma3_gguf' in only:
    import gguf
    from gguf.quants import quantize
    config = gemma3_config(32)
    torch.manual_seed(1000 + len(models))
    model = Gemma3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith('norm.weight'):
                p.copy_(0.2 * torch.randn_like(p))
    out = os.path.join(root, 'gemma3_gguf')
    os.makedirs(out, exist_ok=True)
    names = {'self_attn.q_proj.weight': 'attn_q.weight', 'self_attn.k_proj.weight': 'attn_k.weight',
             'self_attn.v_proj.weight': 'attn_v.weight', 'self_attn.o_proj.weight': 'attn_output.weight',
             'self_attn.q_norm.weight': 'attn_q_norm.weight', 'self_attn.k_norm.weight': 'attn_k_norm.weight',
             'input_layernorm.weight': 'attn_norm.weight',
             'post_attention_layernorm.weight': 'post_attention_norm.weight',
             'pre_feedforward_layernorm.weight': 'ffn_norm.weight',
             'post_feedforward_layernorm.weight': 'post_ffw_norm.weight',
             'mlp.gate_proj.weight': 'ffn_gate.weight', 'mlp.up_proj.weight': 'ffn_up.weight',
             'mlp.down_proj.weight': 'ffn_down.weight'}
    state = model.state_dict()
    for quant in ['f32', 'q8_0']:
        w = gguf.GGUFWriter(os.path.join(out, f'model-{quant}.gguf'), 'gemma3')
        w.add_block_count(config.num_hidden_layers)
        w.add_context_length(config.max_position_embeddings)
        w.add_embedding_length(config.hidden_size)
        w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count(config.num_attention_heads)
        w.add_head_count_kv(config.num_key_value_heads)
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        w.add_layer_norm_rms_eps(config.rms_norm_eps)
        w.add_rope_freq_base(1000000.0)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(8.0)
        w.add_sliding_window(config.sliding_window)
        w.add_uint32('gemma3.attention.sliding_window_pattern', 2)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)

        def add(name, t):
            a = t.detach().to(torch.float32).numpy()
            if quant == 'q8_0' and a.ndim >= 2 and not name.startswith('token_embd'):
                w.add_tensor(name, quantize(a, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(name, a)

        add('token_embd.weight', state['model.embed_tokens.weight'])
        for l in range(config.num_hidden_layers):
            for hf, gg in names.items():
                t = state[f'model.layers.{l}.{hf}']
                add(f'blk.{l}.{gg}', t + 1 if hf.endswith('norm.weight') else t)
        add('output_norm.weight', state['model.norm.weight'] + 1)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    ref = {}
    with torch.no_grad():
        for i, seq in enumerate(sequences):
            ids = torch.tensor([seq])
            ref[f'input_ids_{i}'] = ids[0].to(torch.int32).contiguous()
            ref[f'logits_{i}'] = model(input_ids=ids).logits[0].to(torch.float32).contiguous()
    save_file(ref, os.path.join(out, 'reference.safetensors'),
              metadata={'generated_by': f"model/scripts/make_tiny_models.py with torch {torch.__version__}, transformers {version('transformers')}, gguf-py {version('gguf')}"})
    print('gemma3_gguf', sorted(os.listdir(out)))


# llama.cpp's GGUF of a Mistral model: convert_hf_to_gguf.py writes MistralForCausalLM as its
# `llama` architecture, with the Q and K rows permuted (LlamaModel.permute) and the head width,
# which is not hidden / heads here, as attention.key_length. Made from the `mistral` fixture's
# saved weights, so that fixture's reference logits are this file's too.
if not only or 'mistral_gguf' in only:
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file
    config = models['mistral'][1]
    state = load_file(os.path.join(root, 'mistral', 'model.safetensors'))
    out = os.path.join(root, 'mistral_gguf')
    os.makedirs(out, exist_ok=True)

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {'self_attn.v_proj.weight': 'attn_v.weight', 'self_attn.o_proj.weight': 'attn_output.weight',
             'input_layernorm.weight': 'attn_norm.weight', 'post_attention_layernorm.weight': 'ffn_norm.weight',
             'mlp.gate_proj.weight': 'ffn_gate.weight', 'mlp.up_proj.weight': 'ffn_up.weight',
             'mlp.down_proj.weight': 'ffn_down.weight'}
    for quant in ['f32', 'q8_0']:
        w = gguf.GGUFWriter(os.path.join(out, f'model-{quant}.gguf'), 'llama')
        w.add_block_count(config.num_hidden_layers)
        w.add_context_length(config.max_position_embeddings)
        w.add_embedding_length(config.hidden_size)
        w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count(config.num_attention_heads)
        w.add_head_count_kv(config.num_key_value_heads)
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        w.add_rope_dimension_count(config.head_dim)
        w.add_layer_norm_rms_eps(config.rms_norm_eps)
        w.add_rope_freq_base(1000000.0)
        w.add_vocab_size(config.vocab_size)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)

        def add(name, t):
            a = t.detach().to(torch.float32).numpy()
            if quant == 'q8_0' and a.ndim >= 2 and not name.startswith('token_embd'):
                w.add_tensor(name, quantize(a, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(name, a)

        add('token_embd.weight', state['model.embed_tokens.weight'])
        for l in range(config.num_hidden_layers):
            p = f'model.layers.{l}.'
            add(f'blk.{l}.attn_q.weight', permute(state[p + 'self_attn.q_proj.weight'], config.num_attention_heads))
            add(f'blk.{l}.attn_k.weight', permute(state[p + 'self_attn.k_proj.weight'], config.num_key_value_heads))
            for hf, gg in names.items():
                add(f'blk.{l}.{gg}', state[p + hf])
        add('output_norm.weight', state['model.norm.weight'])
        add('output.weight', state['lm_head.weight'])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    print('mistral_gguf', sorted(os.listdir(out)))
