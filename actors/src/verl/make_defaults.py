"""Writes the defaults `grpo verl` builds VeRL's config from, for one VeRL commit.

VeRL composes its trainer config with Hydra and commits the result for each training engine
(`model_engine`: dp for FSDP, megatron, veomni, torchtitan) as
`verl/trainer/config/_generated_ppo{,_ENGINE}_trainer.yaml`. This script reads each of them in a
checkout of VeRL and writes `actors/src/verl/defaults/COMMIT8-ENGINE.tsv`: every leaf key with
its default value. Following a new VeRL release is

    python3 actors/src/verl/make_defaults.py /path/to/verl [COMMIT]

(COMMIT: when the checkout is not a git work tree), then a new `VerlVersion` in
`actors/src/verl/version.rs` and a review of the keys the table test names as uncovered.

A leaf is a scalar, a list or an empty mapping. Hydra's `_target_` entries name VeRL's Python
classes and are left out. Each line is the dotted key, a tab, and the default as JSON
(interpolations such as `${oc.select:a.b,1}` stay strings, and so does Hydra's `???`, a value
the user must give).
"""

import glob
import json
import os
import re
import subprocess
import sys

import yaml


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
    if len(sys.argv) > 2:
        commit = sys.argv[2]
    else:
        commit = subprocess.check_output(["git", "-C", root, "rev-parse", "HEAD"], text=True).strip()
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "defaults")
    pattern = os.path.join(root, "verl/trainer/config/_generated_ppo*_trainer.yaml")
    for path in sorted(glob.glob(pattern)):
        engine = re.fullmatch(r"_generated_ppo_?(.*)_trainer\.yaml", os.path.basename(path)).group(1) or "dp"
        with open(path) as f:
            config = yaml.safe_load(f)
        out = os.path.join(out_dir, f"{commit[:8]}-{engine}.tsv")
        with open(out, "w") as f:
            f.write(f"# leaf keys of verl/trainer/config/{os.path.basename(path)} at VeRL {commit}\n")
            for key, value in leaves(config, ""):
                f.write(f"{key}\t{json.dumps(value)}\n")
        print(out)


if __name__ == "__main__":
    main()
