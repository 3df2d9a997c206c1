"""Table of `scripts/bench/run_vs_trl.sh`'s results: steps per hour and time per phase of grpo
and of TRL, medians over the steps after the first (the first holds compilation and warm-up),
per round, and the whole process's wall time.

usage: summarize_vs_trl.py OUT_DIR ROUNDS
"""
import json
import statistics
import sys


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def ours(path):
    # Training steps only (a validation line at step 0 has no timings).
    rows = [r for r in map(json.loads, open(path)) if "timing_s/step" in r]
    later = rows[1:] or rows
    return {
        "step": median([r["timing_s/step"] for r in later]),
        "gen": median([r["timing_s/gen"] for r in later]),
        "reward": median([r["timing_s/reward"] for r in later]),
        "update": median([r["timing_s/update"] for r in later]),
        "other": median([r["timing_s/step"] - r["timing_s/gen"] - r["timing_s/reward"]
                         - r["timing_s/update"] for r in later]),
        "reward_mean": statistics.mean(r.get("critic/score/mean", r.get("reward/mean")) for r in rows),
        "steps": len(rows),
    }


def theirs(path):
    rows = [json.loads(line) for line in open(path)]
    later = rows[1:] or rows
    return {
        "step": median([r["seconds"] for r in later]),
        "gen": median([r["gen_seconds"] - r["reward_seconds"] for r in later]),
        "reward": median([r["reward_seconds"] for r in later]),
        "update": median([r["update_seconds"] for r in later]),
        "other": 0.0,
        "reward_mean": statistics.mean(r["reward_mean"] for r in rows),
        "steps": len(rows),
    }


def main():
    out, rounds = sys.argv[1], int(sys.argv[2])
    print("| round | system | steps | s/step (median, steps 2..) | steps/hour | generation | reward | update | rest | wall (process) | mean reward |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for r in range(1, rounds + 1):
        a = ours(f"{out}/grpo-{r}/metrics.jsonl")
        b = theirs(f"{out}/trl-{r}.jsonl")
        for name, x, wall in (("grpo", a, f"{out}/grpo-{r}.wall"), ("TRL", b, f"{out}/trl-{r}.wall")):
            w = float(open(wall).read())
            print(f"| {r} | {name} | {x['steps']} | {x['step']:.2f} s | {3600 / x['step']:.0f} | "
                  f"{x['gen']:.2f} s | {x['reward']:.4f} s | {x['update']:.2f} s | {x['other']:.3f} s | "
                  f"{w:.0f} s | {x['reward_mean']:.3f} |")
        ratios.append(b["step"] / a["step"])
    print()
    print("steps/hour, grpo / TRL, per round: " + ", ".join(f"{x:.2f}x" for x in ratios)
          + f"; median {median(ratios):.2f}x")


if __name__ == "__main__":
    main()
