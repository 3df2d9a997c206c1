"""Reference values for GGUF dequantisation, computed with the `gguf` Python package
(gguf-py, llama.cpp's own reference implementation in numpy), independent of the Rust code.

Writes model/fixtures/gguf_dequant.json:
  blocks:  for F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: two blocks of raw bytes (hex) and
           the values gguf.quants.dequantize gives for them;
  smollm2: rows of real SmolLM2-135M-Instruct tensors (Q8_0 token_embd, Q4_1 projections), in
           Hugging Face layout (q/k un-permuted as reference/gguf/gguf_llama_to_hf.py does),
           plus the sum of every value of each tensor.

Usage: python3 make_quant_fixtures.py ASSETS_DIR   (ASSETS_DIR holds SmolLM2-135M-Instruct.Q4_1.gguf)
Needs: pip install gguf numpy
"""
import json, os, sys
import numpy as np
from gguf import GGUFReader, GGMLQuantizationType as T
from gguf.quants import dequantize

here = os.path.dirname(os.path.abspath(__file__))
out_path = os.path.join(here, '..', 'fixtures', 'gguf_dequant.json')
rng = np.random.default_rng(20261130)

def f16_bytes(values):
    return np.asarray(values, dtype=np.float16).tobytes()

def random_block(qtype):
    """Random quantised bytes whose f16 scale fields are finite, moderate numbers."""
    if qtype == T.F16:
        return f16_bytes(rng.normal(0, 2, 32))
    if qtype == T.BF16:
        u = rng.normal(0, 2, 32).astype(np.float32).view(np.uint32)
        return (u >> 16).astype(np.uint16).tobytes()
    if qtype == T.Q8_0:
        return f16_bytes([rng.uniform(0.001, 0.05)]) + rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
    if qtype == T.Q4_0:
        return f16_bytes([rng.uniform(0.001, 0.05)]) + rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
    if qtype == T.Q4_1:
        return f16_bytes([rng.uniform(0.001, 0.05), rng.uniform(-0.2, 0.2)]) + rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
    if qtype == T.Q4_K:
        return f16_bytes([rng.uniform(0.001, 0.01), rng.uniform(0.001, 0.01)]) + rng.integers(0, 256, 12 + 128, dtype=np.uint8).tobytes()
    if qtype == T.Q5_K:
        return f16_bytes([rng.uniform(0.001, 0.01), rng.uniform(0.001, 0.01)]) + rng.integers(0, 256, 12 + 32 + 128, dtype=np.uint8).tobytes()
    if qtype == T.Q6_K:
        return rng.integers(0, 256, 128 + 64 + 16, dtype=np.uint8).tobytes() + f16_bytes([rng.uniform(0.0005, 0.005)])
    raise ValueError(qtype)

blocks = []
for qtype in [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]:
    raw = random_block(qtype) + random_block(qtype)
    values = dequantize(np.frombuffer(raw, dtype=np.uint8), qtype).astype(np.float32).reshape(-1)
    assert np.all(np.isfinite(values))
    blocks.append({'type': qtype.name, 'bytes_hex': raw.hex(), 'values': [float(v) for v in values]})

def unpermute(w, nh):
    return w.reshape(nh, w.shape[0] // nh // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

reader = GGUFReader(os.path.join(sys.argv[1], 'SmolLM2-135M-Instruct.Q4_1.gguf'))
heads = int(reader.fields['llama.attention.head_count'].contents())
kv_heads = int(reader.fields['llama.attention.head_count_kv'].contents())
by_name = {t.name: t for t in reader.tensors}
real = []
for gguf_name, hf_name, rows, heads_for_unpermute in [
    ('token_embd.weight', 'model.embed_tokens.weight', [0, 1, 9999, 49151], None),
    ('blk.0.attn_q.weight', 'model.layers.0.self_attn.q_proj.weight', [0, 1, 31, 32, 575], heads),
    ('blk.0.attn_k.weight', 'model.layers.0.self_attn.k_proj.weight', [0, 1, 32, 33, 191], kv_heads),
    ('blk.7.ffn_down.weight', 'model.layers.7.mlp.down_proj.weight', [0, 575], None),
    ('blk.29.attn_norm.weight', 'model.layers.29.input_layernorm.weight', None, None),
]:
    t = by_name[gguf_name]
    shape = [int(x) for x in reversed(t.shape)]
    w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    if heads_for_unpermute:
        w = unpermute(w, heads_for_unpermute)
    entry = {'gguf_name': gguf_name, 'hf_name': hf_name, 'type': t.tensor_type.name, 'shape': shape,
             'sum': float(w.astype(np.float64).sum())}
    if rows is None:
        entry['rows'] = {'0': [float(v) for v in w]}
    else:
        entry['rows'] = {str(r): [float(v) for v in w[r]] for r in rows}
    real.append(entry)

from importlib.metadata import version
json.dump({'generated_by': f"model/scripts/make_quant_fixtures.py with gguf {version('gguf')}",
           'blocks': blocks, 'smollm2': real}, open(out_path, 'w'))
print('wrote', out_path, os.path.getsize(out_path), 'bytes')
