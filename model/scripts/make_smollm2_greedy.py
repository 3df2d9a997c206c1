"""Greedy continuations of SmolLM2-135M-Instruct (from its Q4_1 GGUF) by Hugging Face transformers,
for the generation test of the Rust model.

transformers loads the GGUF with `gguf_file=` (it dequantises with the `gguf` package and undoes
llama.cpp's q/k permutation) and runs in f32. Prompts are chat-formatted with the GGUF's chat
template (rendered by transformers), tokenized with the GGUF-vocabulary tokenizer
(Digits + ByteLevel, as shared/reference/gguf/gguf_tok_to_json.py), and continued greedily for
up to 24 tokens (stopping at <|im_end|>).

Writes model/fixtures/smollm2_greedy.json: for each prompt, the user text, the rendered chat
prompt, its ids, the generated ids and their text.

Usage: python3 make_smollm2_greedy.py ASSETS_DIR    Needs: pip install torch transformers gguf
"""
import json, os, sys, tempfile
from importlib.metadata import version
import torch
from gguf import GGUFReader
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors, AddedToken
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

assets = sys.argv[1]
name = 'SmolLM2-135M-Instruct.Q4_1.gguf'
here = os.path.dirname(os.path.abspath(__file__))
f = GGUFReader(os.path.join(assets, name)).fields
toks = f['tokenizer.ggml.tokens'].contents(); types = f['tokenizer.ggml.token_type'].contents()
merges = [tuple(m.split(' ', 1)) for m in f['tokenizer.ggml.merges'].contents()]
tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=merges, fuse_unk=False, byte_fallback=False))
tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
tok.decoder = decoders.ByteLevel(); tok.post_processor = processors.ByteLevel(trim_offsets=False)
tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(toks, types) if ty == 3])
tmp = tempfile.mkdtemp(); tok.save(os.path.join(tmp, 'tokenizer.json'))
tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tmp, 'tokenizer.json'), bos_token='<|im_start|>',
                                    eos_token='<|im_end|>', pad_token='<|im_end|>', unk_token='<|endoftext|>')
tokenizer.chat_template = f['tokenizer.chat_template'].contents()

model = AutoModelForCausalLM.from_pretrained(assets, gguf_file=name, dtype=torch.float32).eval()
eos = int(f['tokenizer.ggml.eos_token_id'].contents())
cases = []
for user in ['What is the capital of France?', 'Write one sentence about the sea.', 'What is 12 plus 7?']:
    prompt = tokenizer.apply_chat_template([{'role': 'user', 'content': user}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    new = out[0, len(ids):].tolist()
    text = tokenizer.decode(new, skip_special_tokens=False)
    print(repr(user), '->', repr(text))
    cases.append({'user': user, 'prompt': prompt, 'prompt_ids': ids, 'generated_ids': new, 'generated_text': text})
json.dump({'generated_by': f"model/scripts/make_smollm2_greedy.py with torch {torch.__version__}, transformers {version('transformers')}, gguf {version('gguf')}",
           'model': name, 'max_new_tokens': 24, 'eos_token_id': eos, 'cases': cases},
          open(os.path.join(here, '..', 'fixtures', 'smollm2_greedy.json'), 'w'), ensure_ascii=False, indent=1)
