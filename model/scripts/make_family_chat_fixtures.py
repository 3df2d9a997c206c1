"""Gemma 3's and Mistral's chat templates as tokenizer_config.json files beside the tiny Gemma 3
and Mistral fixtures, and what transformers renders from them for fixed conversations
(model/fixtures/family_chat_templates.json).

Neither family has a system role: Gemma's template puts a leading system message's text, and a
blank line, at the start of the first user turn; Mistral's (Mistral-7B-Instruct-v0.3's and
Mixtral's) inside the first [INST] block. Both refuse turns that do not alternate
user/assistant. The template texts are the ones published with google/gemma-3-*-it and
mistralai/Mistral-7B-Instruct-v0.3.

Usage: python3 make_family_chat_fixtures.py      Needs: pip install transformers
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
mistral = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)
families = {
    'gemma3': (template, {'bos_token': '<bos>', 'eos_token': '<eos>', 'pad_token': '<pad>'}),
    'mistral': (mistral, {'bos_token': '<s>', 'eos_token': '</s>'}),
}
for family, (text, special) in families.items():
    with open(os.path.join(fixtures, 'tiny', family, 'tokenizer_config.json'), 'w') as f:
        json.dump({**special, 'chat_template': text}, f, indent=1)
conversations = [
    [{'role': 'user', 'content': 'What is the capital of France?'}],
    [{'role': 'system', 'content': 'You are terse.'},
     {'role': 'user', 'content': 'Hi!'},
     {'role': 'assistant', 'content': 'Hello. How can I help?'},
     {'role': 'user', 'content': '  Count to 3.\n'}],
    [{'role': 'system', 'content': 'Answer with a number.'}, {'role': 'user', 'content': 'What is 2+2?'}],
]
out = {}
for family, (text, special) in families.items():
    cases = []
    for messages in conversations:
        for gen in (False, True):
            rendered = render_jinja_template([messages], chat_template=text, add_generation_prompt=gen, **special)[0][0]
            cases.append({'messages': messages, 'add_generation_prompt': gen, 'expected': rendered})
    refused = [{'role': 'user', 'content': 'a'}, {'role': 'user', 'content': 'b'}]
    try:
        render_jinja_template([refused], chat_template=text, **special)
        raise SystemExit(f'expected the {family} template to refuse two user turns in a row')
    except Exception as e:
        error = str(e)
    out[family] = {'cases': cases, 'refused': {'messages': refused, 'error': error}}
    print(family, len(cases), 'cases; refusal:', error)
json.dump({'generated_by': f"model/scripts/make_family_chat_fixtures.py with transformers {version('transformers')}",
           **out}, open(os.path.join(fixtures, 'family_chat_templates.json'), 'w'), ensure_ascii=False, indent=1)
