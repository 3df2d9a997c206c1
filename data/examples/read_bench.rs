//! Reading speed of the data crate on a Parquet file, printed as one JSON line per measurement
//! (rows/s); `data/benches/read_bench.py` runs it beside pyarrow on the same file.
//!
//! ```text
//! cargo run --release -p data --example read_bench -- FILE.parquet [REPEATS]
//! ```
//!
//! Measures: `examples` (every row into an `Example`: prompt messages, data_source, ground
//! truth and all other columns as JSON, streaming row group by row group), `random_batches`
//! (shuffled batches of 256 rows by global index, as the trainer reads them) and `prompts_only`
//! (the prompt column alone, as `data.filter_overlong_prompts` reads it). The best of REPEATS
//! runs (default 5) is reported.

use std::path::PathBuf;
use std::time::Instant;

use data::sampler::epoch_order;
use data::{ColumnNames, ParquetDataset};

fn best_rate(repeats: usize, rows: u64, mut run: impl FnMut() -> u64) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..repeats {
        let start = Instant::now();
        let seen = run();
        let seconds = start.elapsed().as_secs_f64();
        assert_eq!(seen, rows, "every row read");
        best = best.min(seconds);
    }
    rows as f64 / best
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().ok_or("usage: read_bench FILE.parquet [REPEATS]")?);
    let repeats: usize = args.next().map(|r| r.parse()).transpose()?.unwrap_or(5);
    let dataset = ParquetDataset::open(std::slice::from_ref(&path), ColumnNames::default())?;
    let rows = dataset.len();

    let examples = best_rate(repeats, rows, || {
        let mut count = 0;
        for example in dataset.iter() {
            let example = example.expect("row decodes");
            std::hint::black_box(&example);
            count += 1;
        }
        count
    });
    let order = epoch_order(rows, 1, 0);
    let random_batches = best_rate(repeats, rows, || {
        let mut count = 0;
        for batch in order.chunks(256) {
            let examples = dataset.read(batch).expect("batch decodes");
            count += std::hint::black_box(examples).len() as u64;
        }
        count
    });
    let prompts_only = best_rate(repeats, rows, || {
        let mut count = 0;
        dataset
            .for_each_prompt(|_, _, _, prompt| {
                std::hint::black_box(prompt);
                count += 1;
                Ok(())
            })
            .expect("prompts decode");
        count
    });
    for (name, rate) in [
        ("examples", examples),
        ("random_batches", random_batches),
        ("prompts_only", prompts_only),
    ] {
        println!(
            "{{\"reader\": \"grpo-data\", \"measure\": \"{name}\", \"rows\": {rows}, \"rows_per_s\": {rate:.0}}}"
        );
    }
    Ok(())
}
