"""Prints what an offline wandb run file (`run-<id>.wandb`) holds, as JSON, read with wandb's own
record protobuf: the run's project, name and id, its config, each history row and the exit code.

The file is wandb's LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version), then
32 KiB blocks of records, each with a 7-byte header (CRC-32C, length, type: 1 full, 2 first,
3 middle, 4 last) and a piece of one serialised `Record`.
"""
import json
import math
import struct
import sys

from wandb.proto import wandb_internal_pb2

BLOCK = 32768


def records(path):
    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic, version)
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        piece = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield piece
        elif kind == 2:
            pending = piece
        elif kind == 3:
            pending += piece
        elif kind == 4:
            yield pending + piece
            pending = b""


def finite(v):
    """JSON has no NaN: non-finite numbers print as null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def main():
    out = {"history": [], "config": {}, "run": None, "exit_code": None}
    for raw in records(sys.argv[1]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append(
                {(i.key or "/".join(i.nested_key)): finite(json.loads(i.value_json)) for i in record.history.item}
            )
        elif kind == "run":
            r = record.run
            out["run"] = {"project": r.project, "name": r.display_name, "id": r.run_id}
            for i in r.config.update:
                out["config"][i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
        elif kind == "config":
            for i in record.config.update:
                out["config"][i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    print(json.dumps(out, allow_nan=False))


if __name__ == "__main__":
    main()
