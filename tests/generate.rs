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
    let run = |temperature: &str| {
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
            .args(["--temperature", temperature, "--prompts-file"])
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
    let greedy = run("0");
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
    assert_eq!(run("1"), run("1"));
}
