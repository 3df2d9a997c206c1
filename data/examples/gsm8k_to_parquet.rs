//! Converts GSM8K JSON lines to VeRL-schema Parquet with the data crate alone (what
//! `grpo preprocess gsm8k` does), so the read benchmark needs no build of the whole CLI.
//!
//! ```text
//! cargo run --release -p data --example gsm8k_to_parquet -- train.jsonl train.parquet train
//! ```

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output, split] = args.as_slice() else {
        return Err("usage: gsm8k_to_parquet INPUT.jsonl OUTPUT.parquet train|test".into());
    };
    let report =
        data::preprocess::gsm8k::preprocess_gsm8k(&PathBuf::from(input), &PathBuf::from(output), split)?;
    println!(
        "wrote {} rows in {} row groups to {}",
        report.rows, report.row_groups, output
    );
    Ok(())
}
