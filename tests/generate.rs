//! `grpo generate` on the real SmolLM2-135M-Instruct GGUF, through the rollout engine.

use std::path::PathBuf;
use std::process::Command;

fn gguf() -> PathBuf {
    testkit::smollm2_gguf()
}

#[test]
fn answers_a_chat_question_greedily() {
    let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args([
            "generate",
            "--chat",
            "--prompt",
            "What is the capital of France?",
            "--temperature",
            "0",
        ])
        .args(["--max-new-tokens", "16", "--model"])
        .arg(gguf())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    assert_eq!(text.trim(), "The capital of France is Paris.");
}

#[test]
fn prompts_file_with_n_gives_json_lines_per_sample() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "What is 2 + 3?\n\nName a color.\n").unwrap();
    let run = |sampling: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
            .args([
                "generate",
                "--chat",
                "--n",
                "2",
                "--max-new-tokens",
                "8",
                "--seed",
                "5",
            ])
            .args(sampling)
            .arg("--prompts-file")
            .arg(&prompts)
            .arg("--model")
            .arg(gguf())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let mut lines: Vec<serde_json::Value> = String::from_utf8(o.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        lines.sort_by_key(|v| (v["prompt_index"].as_u64(), v["sample_index"].as_u64()));
        lines
    };
    let greedy = run(&["--temperature", "0"]);
    assert_eq!(
        greedy.len(),
        4,
        "two prompts (the blank line skipped) x two samples: {greedy:?}"
    );
    for v in &greedy {
        let ids = v["response_ids"].as_array().unwrap();
        assert_eq!(ids.len(), v["logprobs"].as_array().unwrap().len());
        assert!(!ids.is_empty() && ids.len() <= 8);
        assert_eq!(v["weight_version"], 0);
    }
    // Greedy samples of one prompt are identical; sampled ones repeat for the same seed.
    assert_eq!(greedy[0]["response_ids"], greedy[1]["response_ids"]);
    assert_eq!(greedy[2]["response_ids"], greedy[3]["response_ids"]);
    assert_eq!(run(&["--temperature", "1"]), run(&["--temperature", "1"]));
    // min-p 1 keeps only the most likely token: sampling at temperature 1 then draws the
    // greedy answers.
    let ids = |lines: &[serde_json::Value]| -> Vec<serde_json::Value> {
        lines.iter().map(|v| v["response_ids"].clone()).collect()
    };
    assert_eq!(ids(&run(&["--temperature", "1", "--min-p", "1"])), ids(&greedy));
}

/// `grpo generate --adapter DIR` with SmolLM2 and a PEFT adapter written by grpo: a fresh one
/// (B = 0) changes nothing, a trained-looking one changes the answer, and an adapter made for
/// another model is refused naming the tensor.
#[test]
fn an_adapter_is_merged_into_the_model() {
    use model::lora::{LoraAdapter, LoraConfig, Target};
    use model::programs::HostModel;
    let dir = tempfile::tempdir().unwrap();
    let config = HostModel::load(&gguf()).unwrap().weights.config;
    let lora = LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: vec![Target::Q, Target::V, Target::Down],
        use_rslora: false,
    };
    let fresh = LoraAdapter::init(&config, &lora, 1);
    fresh
        .save_peft(&dir.path().join("fresh"), "SmolLM2-135M-Instruct")
        .unwrap();
    let mut loud = fresh.clone();
    for t in loud
        .tensors
        .iter_mut()
        .filter(|t| t.name.ends_with("lora_B.weight"))
    {
        let v: Vec<f32> = (0..t.numel())
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 4.0)
            .collect();
        *t = model::HostTensor::from_f32(t.name.clone(), t.shape.clone(), &v);
    }
    loud.save_peft(&dir.path().join("loud"), "SmolLM2-135M-Instruct")
        .unwrap();
    let answer = |adapter: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_grpo"))
            .args(["generate", "--chat", "--prompt", "What is the capital of France?"])
            .args(["--temperature", "0", "--max-new-tokens", "16", "--model"])
            .arg(gguf())
            .arg("--adapter")
            .arg(adapter)
            .output()
            .unwrap()
    };
    let o = answer(&dir.path().join("fresh"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        String::from_utf8(o.stdout).unwrap().trim(),
        "The capital of France is Paris."
    );
    let o = answer(&dir.path().join("loud"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_ne!(
        String::from_utf8(o.stdout).unwrap().trim(),
        "The capital of France is Paris."
    );
    let other = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("model/fixtures/lora/peft_llama");
    let o = answer(&other);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("loading the adapter for")
            && err.contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
        "{err}"
    );
}

#[test]
fn device_and_dtype_pick_the_plugin_and_the_weight_type() {
    let generate = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_grpo"))
            .args(["generate", "--chat", "--prompt", "What is the capital of France?"])
            .args(["--temperature", "0", "--max-new-tokens", "16", "--model"])
            .arg(gguf())
            .args(extra)
            .env("GRPO_PJRT_CUDA", "/nonexistent/xla_cuda_plugin.so")
            .output()
            .unwrap()
    };
    let o = generate(&["--dtype", "bf16"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        String::from_utf8(o.stdout).unwrap().trim(),
        "The capital of France is Paris."
    );

    let o = generate(&["--device", "cuda"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("creating the cuda PJRT client (`grpo devices --plugin cuda` says what is missing)")
            && stderr.contains("/nonexistent/xla_cuda_plugin.so (from $GRPO_PJRT_CUDA) does not exist"),
        "{stderr}"
    );
}
