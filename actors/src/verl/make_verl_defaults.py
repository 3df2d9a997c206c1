"""Writes verl_defaults.tsv: every leaf key of VeRL's full trainer config with its default value.

Run from a checkout of volcengine/verl at the commit `grpo verl` follows
(b178a3cd56f58b2d502255daba591e92833930a7):

    python3 actors/src/verl/make_verl_defaults.py /path/to/verl > actors/src/verl/verl_defaults.tsv

A leaf is a scalar, a list or an empty mapping of `verl/trainer/config/_generated_ppo_trainer.yaml`
(the config `python3 -m verl.trainer.main_ppo` starts from, with every default filled in).
Hydra's `_target_` entries name VeRL's Python classes and are left out. Each line is the dotted
key, a tab, and the default as JSON (interpolations such as `${oc.select:a.b,1}` stay strings,
and so does Hydra's `???`, a value the user must give).
"""

import json
import sys

import yaml

COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"


def leaves(node, prefix):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            if key == "_target_":
                continue
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node


def main():
    root = sys.argv[1]
    with open(f"{root}/verl/trainer/config/_generated_ppo_trainer.yaml") as f:
        config = yaml.safe_load(f)
    print(f"# leaf keys of verl/trainer/config/_generated_ppo_trainer.yaml at volcengine/verl {COMMIT}")
    for key, value in leaves(config, ""):
        print(f"{key}\t{json.dumps(value)}")


if __name__ == "__main__":
    main()
