"""Prints the scalars of a TensorBoard log directory as JSON ({tag: [[step, value], ...]}), and its
text summaries under "text" ({tag: [[step, text], ...]}), read by TensorBoard's own
EventAccumulator (the loader behind its dashboards, including its purge of orphaned steps when
a run restarts)."""
import json
import math
import sys

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util


def finite(v):
    """JSON has no NaN: non-finite values print as null."""
    return v if math.isfinite(v) else None


def main():
    acc = event_accumulator.EventAccumulator(sys.argv[1], size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    acc.Reload()
    out = {tag: [[e.step, finite(e.value)] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    out["text"] = {
        tag: [[e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()] for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
        if acc.SummaryMetadata(tag).plugin_data.plugin_name == "text"
    }
    print(json.dumps(out, allow_nan=False))


if __name__ == "__main__":
    main()
