"""Rows/s reading one Parquet file: the data crate (examples/read_bench.rs) against pyarrow, in
the same run on the same file. Prints a Markdown table for BENCHMARKS.md.

    python3 data/benches/read_bench.py FILE.parquet [REPEATS]   (see read_bench.sh)

pyarrow measures: `read_table` (decode to Arrow columns, no Python objects) and
`read_table + to_pylist` (every row into Python dicts, the analogue of our `Example`s: VeRL's
RLHFDataset goes through pandas/datasets rows the same way).
"""

import json
import os
import subprocess
import sys
import time

import pyarrow
import pyarrow.parquet as pq


def best_rate(repeats, rows, run):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        seen = run()
        best = min(best, time.perf_counter() - start)
        assert seen == rows, (seen, rows)
    return rows / best


def main():
    path = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    binary = os.environ.get("READ_BENCH_BIN", "target/release/examples/read_bench")
    rows = pq.ParquetFile(path).metadata.num_rows
    results = []
    out = subprocess.run([binary, path, str(repeats)], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        results.append(json.loads(line))
    # Single-threaded pyarrow is the like-for-like peer (the Rust reader uses one thread);
    # pyarrow's default multi-threaded read is reported too.
    for threads in (False, True):
        suffix = "" if not threads else " (threads)"
        results.append({
            "reader": f"pyarrow {pyarrow.__version__}{suffix}",
            "measure": "read_table",
            "rows": rows,
            "rows_per_s": best_rate(repeats, rows, lambda: pq.read_table(path, use_threads=threads).num_rows),
        })
        results.append({
            "reader": f"pyarrow {pyarrow.__version__}{suffix}",
            "measure": "read_table + to_pylist",
            "rows": rows,
            "rows_per_s": best_rate(repeats, rows, lambda: len(pq.read_table(path, use_threads=threads).to_pylist())),
        })
    peer = next(r for r in results if r["reader"].startswith("pyarrow") and r["measure"] == "read_table + to_pylist"
                and "threads" not in r["reader"])
    print(f"File: `{path}`, {rows} rows, best of {repeats}.\n")
    print("| reader | measure | rows/s | vs pyarrow to_pylist (1 thread) |")
    print("|---|---|---:|---:|")
    for r in results:
        print(f"| {r['reader']} | {r['measure']} | {r['rows_per_s']:,.0f} | {r['rows_per_s'] / peer['rows_per_s']:.2f}x |")


if __name__ == "__main__":
    main()
