//! Reward-model scoring throughput: `DeviceClassifier` on a real-size trunk (SmolLM2-135M with
//! a random one-label `score` head), against transformers' `AutoModelForSequenceClassification`
//! on the same checkpoint and token ids (`classifier_bench_hf.py`).
//!
//! ```text
//! cargo run --release -p model --example classifier_bench -- make-rm MODEL.gguf OUT_DIR
//! cargo run --release -p model --example classifier_bench -- score OUT_DIR [--dtype f32|bf16]
//!     [--batch 8] [--sequences 64] [--max-len 256]
//! ```
//!
//! `score` prints `grpo_sequences_per_s <rate>` and the first four scores.

use std::path::Path;
use std::time::Instant;

use model::classifier::{ClassifierWeights, DeviceClassifier, SCORE_WEIGHT};
use model::programs::HostModel;
use model::HostTensor;
use xla::runtime::Client;
use xla::DType;

/// The benchmark's token ids, shared with `classifier_bench_hf.py`: row `r` has
/// `max_len / 2 + (37 r mod max_len / 2)` tokens.
fn sequences(count: usize, max_len: usize) -> Vec<Vec<u32>> {
    (0..count)
        .map(|r| {
            let len = max_len / 2 + (37 * r) % (max_len / 2);
            (0..len)
                .map(|c| ((17 + 7919 * r + 31 * c) % 49000 + 100) as u32)
                .collect()
        })
        .collect()
}

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("make-rm") if args.len() == 3 => make_rm(Path::new(&args[1]), Path::new(&args[2])),
        Some("score") if args.len() >= 2 => score(&args),
        _ => {
            eprintln!("usage: classifier_bench make-rm MODEL.gguf OUT_DIR | score RM_DIR [--dtype f32|bf16] [--batch 8] [--sequences 64] [--max-len 256]");
            std::process::exit(2);
        }
    }
}

/// The GGUF's model with a random one-label score head (seed 0), saved as transformers saves a
/// `LlamaForSequenceClassification`, with the GGUF's tokenizer files.
fn make_rm(gguf: &Path, out: &Path) {
    let host = HostModel::load(gguf).expect("load the model");
    let weights = host.weights;
    let hidden = weights.config.hidden_size;
    let mut state = 0x9e3779b97f4a7c15u64;
    let score: Vec<f32> = (0..hidden)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect();
    let files_dir = out.with_extension("tokenizer");
    std::fs::create_dir_all(&files_dir).unwrap();
    let gguf_file = model::GgufFile::open(gguf).unwrap();
    let files = model::write_gguf_tokenizer_files(&gguf_file, &weights.config, &files_dir).unwrap();
    let refs: Vec<&Path> = files.iter().map(|p| p.as_path()).collect();
    let head = HostTensor::from_f32(SCORE_WEIGHT, vec![1, hidden], &score);
    ClassifierWeights::with_head(weights.to_dtype(DType::F32), head)
        .and_then(|rm| rm.save(out, &refs))
        .expect("save the reward model");
    println!("{}", out.display());
}

fn score(args: &[String]) {
    let dtype = match arg(args, "--dtype", "f32").as_str() {
        "bf16" => DType::BF16,
        _ => DType::F32,
    };
    let batch: usize = arg(args, "--batch", "8").parse().unwrap();
    let count: usize = arg(args, "--sequences", "64").parse().unwrap();
    let max_len: usize = arg(args, "--max-len", "256").parse().unwrap();
    let weights = ClassifierWeights::load(Path::new(&args[1])).expect("load the reward model");
    let client = Client::cpu(1).expect("the CPU client");
    let mut classifier = DeviceClassifier::upload(&client, &weights, dtype, 0).unwrap();
    let inputs = sequences(count, max_len);
    // Warm up: compile every shape the timed loop runs.
    for chunk in inputs.chunks(batch) {
        classifier.score(chunk).unwrap();
    }
    let start = Instant::now();
    let mut scores = Vec::new();
    for chunk in inputs.chunks(batch) {
        scores.extend(classifier.score(chunk).unwrap().into_iter().map(|s| s[0]));
    }
    let took = start.elapsed().as_secs_f64();
    println!(
        "grpo_sequences_per_s {:.2} ({count} sequences in {took:.2} s, batch {batch}, {dtype})",
        count as f64 / took
    );
    println!("grpo_first_scores {:?}", &scores[..4]);
}
