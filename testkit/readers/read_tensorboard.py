"""Prints the scalars of a TensorBoard log directory as JSON ({tag: [[step, value], ...]}), read by
TensorBoard's own EventAccumulator (the loader behind its scalar dashboard, including its purge
of orphaned steps when a run restarts)."""
import json
import math
import sys

from tensorboard.backend.event_processing import event_accumulator


def finite(v):
    """JSON has no NaN: non-finite values print as null."""
    return v if math.isfinite(v) else None


def main():
    acc = event_accumulator.EventAccumulator(sys.argv[1], size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    out = {tag: [[e.step, finite(e.value)] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    print(json.dumps(out, allow_nan=False))


if __name__ == "__main__":
    main()
