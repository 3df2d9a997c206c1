"""LoRA adapters on the tiny fixture models, with reference logits from transformers + PEFT.

Writes under model/fixtures/lora/:
  peft_llama/        an adapter PEFT made on tiny/llama: r 4, lora_alpha 8, all-linear, A and B
                     both random (init_lora_weights=False, so B is not zero and the adapter
                     matters); reference.safetensors: the PeftModel's logits;
  peft_qwen2_rslora/ on tiny/qwen2 (QKV bias, tied head): r 2, lora_alpha 3, use_rslora,
                     q_proj, v_proj and down_proj only; reference.safetensors likewise;
  peft_qwen3_moe/    on tiny/qwen3_moe (layers 0 and 2 experts, layer 1 dense): r 2, lora_alpha 3,
                     target_modules q_proj and down_proj (the dense layer's), target_parameters
                     mlp.experts.gate_up_proj and mlp.experts.down_proj (PEFT's ParamWrapper:
                     one A [r*E, in], B [out, r*E] per stacked tensor); reference.safetensors;
  grpo_llama_reference.safetensors: the logits of grpo_llama/, an adapter WRITTEN BY GRPO
                     (`GRPO_WRITE_LORA_FIXTURE=1 cargo test -p model --test lora`), loaded
                     with PeftModel.from_pretrained on tiny/llama;
  grpo_qwen3_moe_reference.safetensors: likewise for grpo_qwen3_moe/ (k_proj, o_proj and both
                     stacked experts) on tiny/qwen3_moe.
reference files hold, for each fixed token sequence i, `input_ids_<i>` (I32, [T]) and
`logits_<i>` (F32, [T, vocab]).

Usage: python3 model/scripts/make_lora_fixtures.py
Needs: pip install torch 'transformers>=5' peft safetensors (transformers 4 reads the tiny models' v5
config.json with other RoPE settings; the versions used are recorded in the reference files)
"""
import os
from importlib.metadata import version

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

# Relative paths from the repository root, so base_model_name_or_path names the fixture portably.
os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
fixtures = os.path.join('model', 'fixtures')
out_root = os.path.join(fixtures, 'lora')
sequences = [
    [1, 17, 250, 3, 99, 383, 42],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200, 201, 202, 203, 300, 301, 302, 303, 0, 2, 1, 100],
]
made_by = (f"model/scripts/make_lora_fixtures.py with torch {torch.__version__}, "
           f"transformers {version('transformers')}, peft {version('peft')}")


def base(family):
    return AutoModelForCausalLM.from_pretrained(os.path.join(fixtures, 'tiny', family),
                                                torch_dtype=torch.float32).eval()


def save_logits(model, path):
    ref = {}
    with torch.no_grad():
        for i, seq in enumerate(sequences):
            ids = torch.tensor([seq])
            ref[f'input_ids_{i}'] = ids[0].to(torch.int32).contiguous()
            ref[f'logits_{i}'] = model(input_ids=ids).logits[0].to(torch.float32).contiguous()
    save_file(ref, path, metadata={'generated_by': made_by})


def peft_made(name, family, seed, **lora):
    torch.manual_seed(seed)
    model = get_peft_model(base(family), LoraConfig(task_type='CAUSAL_LM', lora_dropout=0.0,
                                                   init_lora_weights=False, **lora)).eval()
    out = os.path.join(out_root, name)
    model.save_pretrained(out, safe_serialization=True)
    os.remove(os.path.join(out, 'README.md'))  # PEFT's model card template
    save_logits(model, os.path.join(out, 'reference.safetensors'))
    print(name, sorted(os.listdir(out)))


os.makedirs(out_root, exist_ok=True)
peft_made('peft_llama', 'llama', 2000, r=4, lora_alpha=8, target_modules='all-linear')
peft_made('peft_qwen2_rslora', 'qwen2', 2001, r=2, lora_alpha=3, use_rslora=True,
          target_modules=['q_proj', 'v_proj', 'down_proj'])

peft_made('peft_qwen3_moe', 'qwen3_moe', 2002, r=2, lora_alpha=3,
          target_modules=['q_proj', 'down_proj'],
          target_parameters=['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'])

for family in ['llama', 'qwen3_moe']:
    grpo_dir = os.path.join(out_root, f'grpo_{family}')
    if os.path.isdir(grpo_dir):
        model = PeftModel.from_pretrained(base(family), grpo_dir).eval()
        save_logits(model, os.path.join(out_root, f'grpo_{family}_reference.safetensors'))
        print(f'grpo_{family}_reference.safetensors')
    else:
        print(f'{grpo_dir} is missing: write it with GRPO_WRITE_LORA_FIXTURE=1 cargo test -p model --test lora, '
              'then run this script again')
