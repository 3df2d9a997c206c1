"""Whole-file check: the Parquet file `grpo preprocess gsm8k` wrote against the one VeRL's
examples/data_preprocess/gsm8k.py wrote (data/tests/fixtures/verl_gsm8k_reference.py OUT_DIR keeps
it), both read by pyarrow: same schema, same number of rows, every value equal.

    python3 data/benches/compare_gsm8k.py OURS.parquet VERL.parquet
"""

import sys

import pyarrow.parquet as pq


def main():
    ours = pq.read_table(sys.argv[1])
    verl = pq.read_table(sys.argv[2])
    assert ours.schema.remove_metadata() == verl.schema.remove_metadata(), (ours.schema, verl.schema)
    assert ours.num_rows == verl.num_rows, (ours.num_rows, verl.num_rows)
    # Row groups differ (we write 1024-row groups); compare the values.
    assert ours.combine_chunks().equals(verl.combine_chunks().replace_schema_metadata(None)), "values differ"
    print(f"identical: {ours.num_rows} rows, schema {ours.schema.names}")


if __name__ == "__main__":
    main()
