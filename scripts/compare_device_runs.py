"""Compares two sides of scripts/gpu-check.sh's parity check (for example the CPU plugin's and the
CUDA plugin's), each a folder holding greedy.jsonl and sampled.jsonl (`grpo generate`),
run/metrics.jsonl (`grpo run`, 3 steps) and export/model.safetensors (`grpo export`).

Prints, per part, what matched and the largest differences; exits 1 when greedy or sampled tokens
differ, when a log-prob differs by more than --logprob-tol, or when an exported parameter differs by
more than --param-tol (relative to the tensor's largest magnitude). Standard library only.

Usage: python3 scripts/compare_device_runs.py REFERENCE_DIR OTHER_DIR [--logprob-tol 1e-4]
                                              [--param-tol 1e-4]
"""
import argparse
import json
import math
import struct
import sys
from pathlib import Path

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("reference", type=Path)
p.add_argument("other", type=Path)
p.add_argument("--logprob-tol", type=float, default=1e-4)
p.add_argument("--param-tol", type=float, default=1e-4)
a = p.parse_args()
problems = []


def samples(path):
    rows = {}
    for line in path.read_text().splitlines():
        v = json.loads(line)
        if "error" in v:
            problems.append(f"{path}: prompt {v['prompt_index']}: {v['error']}")
            continue
        rows[(v["prompt_index"], v["sample_index"])] = v
    return rows


def compare_samples(name):
    ref, other = samples(a.reference / name), samples(a.other / name)
    if ref.keys() != other.keys():
        problems.append(f"{name}: different samples: {sorted(ref.keys() ^ other.keys())[:5]}")
    same, worst, diverged = 0, 0.0, []
    for key in sorted(ref.keys() & other.keys()):
        r, o = ref[key], other[key]
        n = 0
        while n < min(len(r["response_ids"]), len(o["response_ids"])) and \
                r["response_ids"][n] == o["response_ids"][n]:
            n += 1
        if r["response_ids"] == o["response_ids"]:
            same += 1
        else:
            diverged.append(f"prompt {key[0]} sample {key[1]} at token {n}")
        for x, y in zip(r["logprobs"][:n], o["logprobs"][:n]):
            worst = max(worst, abs(x - y))
    tokens = sum(len(v["response_ids"]) for v in ref.values())
    print(f"{name}: {same}/{len(ref)} samples token-identical ({tokens} tokens); "
          f"largest log-prob difference {worst:.3g}")
    if diverged:
        problems.append(f"{name}: tokens differ: {', '.join(diverged[:5])}")
    if worst > a.logprob_tol:
        problems.append(f"{name}: log-prob difference {worst:.3g} > {a.logprob_tol}")


def metrics(path):
    steps = {}
    for line in path.read_text().splitlines():
        v = json.loads(line)
        if "step" in v and "run" not in v:
            steps[v["step"]] = v
    return steps


def compare_metrics():
    ref, other = metrics(a.reference / "run/metrics.jsonl"), metrics(a.other / "run/metrics.jsonl")
    if ref.keys() != other.keys():
        problems.append(f"metrics.jsonl: steps {sorted(ref)} vs {sorted(other)}")
    skip = ("timing", "perf/", "throughput", "time", "memory", "compile")
    for step in sorted(ref.keys() & other.keys()):
        worst = []
        for key, x in ref[step].items():
            y = other[step].get(key)
            if any(s in key for s in skip) or not isinstance(x, (int, float)) or \
                    not isinstance(y, (int, float)) or isinstance(x, bool):
                continue
            d = abs(x - y) / max(1.0, abs(x))
            worst.append((d, key, x, y))
        worst.sort(reverse=True)
        shown = ", ".join(f"{k} {x:.6g} vs {y:.6g}" for _, k, x, y in worst[:3])
        print(f"metrics step {step}: {len(worst)} values compared; largest differences: {shown}")


def safetensors(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] != "F32":
            problems.append(f"{path}: {name} is {t['dtype']}, expected F32")
            continue
        lo, hi = t["data_offsets"]
        out[name] = struct.unpack(f"<{(hi - lo) // 4}f", body[lo:hi])
    return out


def compare_params():
    ref = safetensors(a.reference / "export/model.safetensors")
    other = safetensors(a.other / "export/model.safetensors")
    if ref.keys() != other.keys():
        problems.append(f"model.safetensors: tensors differ: {sorted(ref.keys() ^ other.keys())}")
    worst = (0.0, "")
    for name in sorted(ref.keys() & other.keys()):
        scale = max(max(abs(x) for x in ref[name]), 1e-12)
        d = max(abs(x - y) for x, y in zip(ref[name], other[name])) / scale
        if math.isnan(d) or d > worst[0]:
            worst = (d, name)
    count = sum(len(v) for v in ref.values())
    print(f"parameters after 3 steps: {len(ref)} tensors, {count} values; largest difference "
          f"{worst[0]:.3g} of the tensor's largest magnitude ({worst[1]})")
    if not worst[0] <= a.param_tol:
        problems.append(f"parameters: difference {worst[0]:.3g} > {a.param_tol} in {worst[1]}")


compare_samples("greedy.jsonl")
compare_samples("sampled.jsonl")
compare_metrics()
compare_params()
for line in problems:
    print("MISMATCH:", line)
sys.exit(1 if problems else 0)
