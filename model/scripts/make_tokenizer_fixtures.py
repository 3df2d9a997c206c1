"""Expected token ids and rendered chat templates, produced with Hugging Face transformers.

Writes
  model/fixtures/tokenizer_ids.json: for each test string of model/fixtures/tokenizer_strings.json,
      the ids of the Qwen3 and Llama 3 tokenizer.json files and of the SmolLM2 GGUF tokenizer
      (add_special_tokens False; and True for Llama 3, whose tokenizer.json post-processor adds
      nothing: its chat template writes <|begin_of_text|> itself);
  model/fixtures/chat_templates.json: apply_chat_template(..., tokenize=False) output for fixed
      conversations, with and without add_generation_prompt, for the Qwen3, Llama 3 and SmolLM2
      templates.

The SmolLM2 tokenizer is built from the GGUF's vocabulary the way
shared/reference/gguf/gguf_tok_to_json.py does (Digits(individual) + ByteLevel), loaded as
transformers' PreTrainedTokenizerFast; its ids are also compared with transformers' own GGUF
tokenizer conversion (AutoTokenizer.from_pretrained(gguf_file=...)) and any difference is reported.

Usage: python3 make_tokenizer_fixtures.py ASSETS_DIR
  ASSETS_DIR holds SmolLM2-135M-Instruct.Q4_1.gguf, qwen3/ and llama3/ (see fetch_assets.sh).
Needs: pip install transformers tokenizers gguf numpy jinja2
"""
import json, os, sys, tempfile
from importlib.metadata import version
from gguf import GGUFReader
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors, AddedToken
from transformers import AutoTokenizer, PreTrainedTokenizerFast

assets = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
fixtures = os.path.join(here, '..', 'fixtures')
strings = json.load(open(os.path.join(fixtures, 'tokenizer_strings.json')))['strings']
gguf_path = os.path.join(assets, 'SmolLM2-135M-Instruct.Q4_1.gguf')

# SmolLM2 tokenizer from the GGUF vocabulary (as shared/reference/gguf/gguf_tok_to_json.py).
r = GGUFReader(gguf_path); f = r.fields
toks = f['tokenizer.ggml.tokens'].contents()
types = f['tokenizer.ggml.token_type'].contents()
merges = [tuple(m.split(' ', 1)) for m in f['tokenizer.ggml.merges'].contents()]
tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=merges, fuse_unk=False, byte_fallback=False))
tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
tok.decoder = decoders.ByteLevel()
tok.post_processor = processors.ByteLevel(trim_offsets=False)
tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(toks, types) if ty == 3])
tmp = tempfile.mkdtemp()
tok.save(os.path.join(tmp, 'tokenizer.json'))
g = lambda k: f[k].contents()
smol = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tmp, 'tokenizer.json'),
                               bos_token=toks[g('tokenizer.ggml.bos_token_id')], eos_token=toks[g('tokenizer.ggml.eos_token_id')],
                               pad_token=toks[g('tokenizer.ggml.padding_token_id')], unk_token=toks[g('tokenizer.ggml.unknown_token_id')])
smol.chat_template = g('tokenizer.chat_template')

qwen3 = AutoTokenizer.from_pretrained(os.path.join(assets, 'qwen3'))
llama3 = AutoTokenizer.from_pretrained(os.path.join(assets, 'llama3'))

try:
    smol_hf = AutoTokenizer.from_pretrained(assets, gguf_file='SmolLM2-135M-Instruct.Q4_1.gguf')
except Exception as e:  # report, the fixture does not depend on it
    smol_hf = None
    print('transformers GGUF tokenizer conversion failed:', e)

ids = {'qwen3': [], 'llama3': [], 'llama3_with_special': [], 'smollm2_gguf': []}
for s in strings:
    ids['qwen3'].append(qwen3.encode(s, add_special_tokens=False))
    ids['llama3'].append(llama3.encode(s, add_special_tokens=False))
    ids['llama3_with_special'].append(llama3.encode(s, add_special_tokens=True))
    ids['smollm2_gguf'].append(smol.encode(s, add_special_tokens=False))
    if smol_hf is not None:
        other = smol_hf.encode(s, add_special_tokens=False)
        if other != ids['smollm2_gguf'][-1]:
            print('NOTE: transformers GGUF conversion differs on', repr(s), other[:12], ids['smollm2_gguf'][-1][:12])
    for name, t in [('qwen3', qwen3), ('llama3', llama3), ('smollm2_gguf', smol)]:
        assert t.decode(ids[name][-1]) == s, (name, s, t.decode(ids[name][-1]))

json.dump({'generated_by': f"model/scripts/make_tokenizer_fixtures.py with transformers {version('transformers')}, tokenizers {version('tokenizers')}",
           'strings_file': 'tokenizer_strings.json', 'ids': ids}, open(os.path.join(fixtures, 'tokenizer_ids.json'), 'w'))

conversations = [
    [{'role': 'user', 'content': 'What is the capital of France?'}],
    [{'role': 'system', 'content': 'You are a terse assistant.'},
     {'role': 'user', 'content': 'Hi!'},
     {'role': 'assistant', 'content': 'Hello. How can I help?'},
     {'role': 'user', 'content': 'Count to 3 with digits: 1 2 3.'}],
    [{'role': 'system', 'content': '  Padded system prompt with trailing newline\n'},
     {'role': 'user', 'content': 'Ünïcödé 🤖  two  spaces\n\nand newlines'}],
    [{'role': 'user', 'content': 'What is 2+2?'},
     {'role': 'assistant', 'content': '<think>\nadd them\n</think>\n\n4'},
     {'role': 'user', 'content': 'And 3+3?'}],
]
chat = {}
for name, t in [('qwen3', qwen3), ('llama3', llama3), ('smollm2', smol)]:
    cases = []
    for messages in conversations:
        for gen in (False, True):
            text = t.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            cases.append({'messages': messages, 'add_generation_prompt': gen, 'expected': text})
    chat[name] = cases
# Qwen3 with tools: exercises tojson (Python json.dumps output) and tool-call / tool-response turns.
tools = [{'type': 'function', 'function': {'name': 'get_weather', 'description': 'Weather for a city, in °C',
          'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}, 'days': {'type': 'integer'}},
                         'required': ['city']}}}]
tool_messages = [
    {'role': 'system', 'content': 'Use tools when useful.'},
    {'role': 'user', 'content': 'Weather in Zürich?'},
    {'role': 'assistant', 'content': '', 'tool_calls': [{'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': 'Zürich', 'days': 2}}}]},
    {'role': 'tool', 'content': '{"temp": 21.5}'},
    {'role': 'tool', 'content': 'second result'},
]
chat['qwen3_tools'] = [{'messages': tool_messages, 'tools': tools, 'add_generation_prompt': gen,
                        'expected': qwen3.apply_chat_template(tool_messages, tools=tools, tokenize=False, add_generation_prompt=gen)}
                       for gen in (False, True)]
json.dump({'generated_by': f"model/scripts/make_tokenizer_fixtures.py with transformers {version('transformers')}",
           'templates': {'qwen3': 'qwen3/tokenizer_config.json', 'llama3': 'llama3/tokenizer_config.json',
                         'smollm2': 'SmolLM2-135M-Instruct.Q4_1.gguf tokenizer.chat_template'},
           'cases': chat}, open(os.path.join(fixtures, 'chat_templates.json'), 'w'), ensure_ascii=False, indent=1)
print('wrote tokenizer_ids.json and chat_templates.json for', len(strings), 'strings')
