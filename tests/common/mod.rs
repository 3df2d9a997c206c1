//! Helpers shared by the end-to-end tests: the real SmolLM2 tokenizer and chat template on a
//! tiny random-weight decoder (so a whole training loop runs in seconds), and datasets made by
//! `grpo preprocess`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The `grpo` binary under test.
pub fn grpo() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_grpo"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

/// Runs `grpo args...` and returns its output.
pub fn run_grpo(args: &[&str]) -> Output {
    grpo().args(args).output().expect("run grpo")
}

/// The SmolLM2 GGUF fetched by `scripts/setup.sh`.
pub fn smollm2_gguf() -> PathBuf {
    let dir = std::env::var_os("GRPO_TEST_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models"));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.is_file(),
        "{} is missing: run scripts/setup.sh",
        path.display()
    );
    path
}

/// A Hugging Face model directory `dir/tiny-smollm2`: SmolLM2's tokenizer and chat template on
/// a 2-layer, 32-wide Llama with random weights (seed 7).
pub fn tiny_chat_model(dir: &Path) -> PathBuf {
    let gguf = model::GgufFile::open(&smollm2_gguf()).expect("open the GGUF");
    let mut config = model::ModelConfig::from_gguf(&gguf).expect("GGUF config");
    config.hidden_size = 32;
    config.intermediate_size = 64;
    config.num_hidden_layers = 2;
    config.num_attention_heads = 4;
    config.num_key_value_heads = 2;
    config.head_dim = 8;
    config.initializer_range = 0.05;
    let files_dir = dir.join("tokenizer-files");
    std::fs::create_dir_all(&files_dir).unwrap();
    let files = model::write_gguf_tokenizer_files(&gguf, &config, &files_dir).expect("tokenizer files");
    let weights = model::random_init(&config, 7);
    let out = dir.join("tiny-smollm2");
    let refs: Vec<&Path> = files.iter().map(|p| p.as_path()).collect();
    model::save_hf_checkpoint(&out, &weights, &refs).expect("save the tiny model");
    out
}

/// `grpo preprocess arithmetic` into `dir/NAME.parquet`.
pub fn arithmetic(dir: &Path, name: &str, seed: u64, count: usize) -> PathBuf {
    let path = dir.join(format!("{name}.parquet"));
    let out = run_grpo(&[
        "preprocess",
        "arithmetic",
        "--seed",
        &seed.to_string(),
        "--count",
        &count.to_string(),
        "--output",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    path
}

/// Reads `OUTPUT/metrics.jsonl`, the later line winning for a repeated step.
pub fn metrics(output: &Path) -> std::collections::BTreeMap<u64, serde_json::Value> {
    let text = std::fs::read_to_string(output.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        .map(|v| (v["step"].as_u64().expect("step"), v))
        .collect()
}

/// Reads `OUTPUT/prompts.jsonl`: the dataset rows each step trained on.
pub fn prompts_seen(output: &Path) -> std::collections::BTreeMap<u64, Vec<u64>> {
    let text = std::fs::read_to_string(output.join("prompts.jsonl")).expect("prompts.jsonl");
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        .map(|v| {
            let ids = v["indices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            (v["step"].as_u64().unwrap(), ids)
        })
        .collect()
}
