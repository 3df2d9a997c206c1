"""Checks a Hugging Face checkpoint written by the Rust exporter (examples/gguf_to_hf.rs) with
transformers: the model loads, and its logits, token ids and chat prompt equal those of
transformers' own GGUF loader on the same file.

Usage: python3 check_hf_export.py EXPORTED_DIR ASSETS_DIR   Needs: pip install torch transformers gguf accelerate
"""
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

exported, assets = sys.argv[1], sys.argv[2]
name = 'SmolLM2-135M-Instruct.Q4_1.gguf'
ours = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
ref = AutoModelForCausalLM.from_pretrained(assets, gguf_file=name, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(exported)
messages = [{'role': 'user', 'content': 'What is the capital of France? Answer in 1 sentence.'}]
prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
ids = tok.encode(prompt, add_special_tokens=False)
ref_tok = AutoTokenizer.from_pretrained(assets, gguf_file=name)
print('chat prompt equal to GGUF tokenizer template:', prompt == ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
print('ids equal to transformers GGUF tokenizer:', ids == ref_tok.encode(prompt, add_special_tokens=False), len(ids), 'tokens')
with torch.no_grad():
    a = ours(torch.tensor([ids])).logits[0]
    b = ref(torch.tensor([ids])).logits[0]
print('max |logit difference| over', a.shape[0], 'positions:', float((a - b).abs().max()))
out = ours.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
print('greedy:', repr(tok.decode(out[0, len(ids):])))
