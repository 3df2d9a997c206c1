"""Gemma 3's chat template as a tokenizer_config.json beside the tiny Gemma 3 fixture, and what
transformers renders from it for fixed conversations (model/fixtures/gemma3_chat.json).

Gemma has no system role: its template puts a leading system message's text, and a blank
line, at the start of the first user turn, and refuses turns that do not alternate
user/assistant. The template text is the one published with google/gemma-3-*-it.

Usage: python3 make_gemma_chat_fixture.py      Needs: pip install transformers
"""
import json, os
from importlib.metadata import version
from transformers.utils.chat_template_utils import render_jinja_template

here = os.path.dirname(os.path.abspath(__file__))
fixtures = os.path.join(here, '..', 'fixtures')
template = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
special = {'bos_token': '<bos>', 'eos_token': '<eos>', 'pad_token': '<pad>'}
with open(os.path.join(fixtures, 'tiny', 'gemma3', 'tokenizer_config.json'), 'w') as f:
    json.dump({**special, 'chat_template': template}, f, indent=1)
conversations = [
    [{'role': 'user', 'content': 'What is the capital of France?'}],
    [{'role': 'system', 'content': 'You are terse.'},
     {'role': 'user', 'content': 'Hi!'},
     {'role': 'assistant', 'content': 'Hello. How can I help?'},
     {'role': 'user', 'content': '  Count to 3.\n'}],
    [{'role': 'system', 'content': 'Answer with a number.'}, {'role': 'user', 'content': 'What is 2+2?'}],
]
cases = []
for messages in conversations:
    for gen in (False, True):
        text = render_jinja_template([messages], chat_template=template, add_generation_prompt=gen, **special)[0][0]
        cases.append({'messages': messages, 'add_generation_prompt': gen, 'expected': text})
refused = [{'role': 'user', 'content': 'a'}, {'role': 'user', 'content': 'b'}]
try:
    render_jinja_template([refused], chat_template=template, **special)
    raise SystemExit('expected the template to refuse two user turns in a row')
except Exception as e:
    error = str(e)
json.dump({'generated_by': f"model/scripts/make_gemma_chat_fixture.py with transformers {version('transformers')}",
           'cases': cases, 'refused': {'messages': refused, 'error': error}},
          open(os.path.join(fixtures, 'gemma3_chat.json'), 'w'), ensure_ascii=False, indent=1)
print('wrote', len(cases), 'cases; refusal:', error)
