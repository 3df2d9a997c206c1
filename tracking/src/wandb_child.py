"""grpo's Weights & Biases logger: the user's own `wandb` package in a child process.

Reads one JSON object per line on stdin and answers one line per request on stdout:
  {"init": {"project", "name", "id", "resume", "dir", "config"}} -> {"ok": true, "id": ..., "dir": ...}
  {"log": {"step": N, "metrics": {...}}}                         -> nothing (fire and forget)
  {"generations": {"step": N, "samples": [{"input", "output", "score"}, ...]}} -> nothing
  {"finish": {"exit_code": 0}}                                   -> {"ok": true}, then exits
Errors go to stdout as {"error": "..."} for init and finish; a failed log is reported once.
"""
import json
import math
import os
import sys

# Answers go to the real stdout; anything else printed (wandb's own lines) goes to stderr, so it
# cannot be mistaken for an answer.
PROTOCOL = os.fdopen(os.dup(1), "w")
sys.stdout = sys.stderr


def reply(obj):
    PROTOCOL.write(json.dumps(obj) + "\n")
    PROTOCOL.flush()


def main():
    try:
        import wandb
    except Exception as e:  # the package is missing or broken: say so and stop
        reply({"error": f"cannot import wandb ({type(e).__name__}: {e}); install it with `pip install wandb` in the Python grpo runs (GRPO_PYTHON, else python3)"})
        return
    run = None
    log_failed = False
    table_rows = []
    for line in sys.stdin:
        message = json.loads(line)
        if "init" in message:
            a = message["init"]
            try:
                run = wandb.init(
                    project=a["project"],
                    name=a["name"],
                    id=a.get("id"),
                    resume="allow" if a.get("id") else None,
                    dir=a["dir"],
                    config=a.get("config") or {},
                    settings=wandb.Settings(console="off"),
                )
                reply({"ok": True, "id": run.id, "dir": run.dir})
            except Exception as e:
                reply({"error": f"wandb.init failed: {type(e).__name__}: {e}"})
                return
        elif "log" in message:
            a = message["log"]
            metrics = {k: (math.nan if v is None else v) for k, v in a["metrics"].items()}
            try:
                run.log(metrics, step=a["step"])
            except Exception as e:
                if not log_failed:
                    sys.stderr.write(f"wandb: log failed: {type(e).__name__}: {e}\n")
                    log_failed = True
        elif "generations" in message:
            a = message["generations"]
            samples = a["samples"]
            columns = ["step"] + [f"{kind}_{i + 1}" for i in range(len(samples)) for kind in ("input", "output", "score")]
            row = [a["step"]] + [v for s in samples for v in (s["input"], s["output"], s["score"])]
            # As VeRL: a new table holding the earlier rows and this one.
            if table_rows and len(table_rows[0]) != len(row):
                table_rows.clear()
            table_rows.append(row)
            try:
                run.log({"val/generations": wandb.Table(columns=columns, data=list(table_rows))}, step=a["step"])
            except Exception as e:
                sys.stderr.write(f"wandb: logging val/generations failed: {type(e).__name__}: {e}\n")
        elif "finish" in message:
            try:
                run.finish(exit_code=message["finish"].get("exit_code", 0))
                reply({"ok": True})
            except Exception as e:
                reply({"error": f"wandb.finish failed: {type(e).__name__}: {e}"})
            return


if __name__ == "__main__":
    main()
