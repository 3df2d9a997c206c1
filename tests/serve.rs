//! `grpo serve`, the OpenAI-compatible API, driven by a Python agent program that uses only the
//! standard library's HTTP client (`fixtures/openai_agent.py`), on the tiny random model: the
//! key is checked, chat and text completions return the prompt's and completion's token ids
//! with their log-probs, a greedy chat answer equals `grpo generate`'s tokens and log-probs, a
//! seed repeats its samples, and bad requests get OpenAI-style errors.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use common::*;

struct Serving(std::process::Child);

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn an_agent_program_talks_to_grpo_serve_as_to_an_openai_server() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _, _) = tiny_inputs(dir.path(), 4, 4);
    let mut child = grpo()
        .args([
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--port",
            "0",
            "--api-key",
            "secret",
        ])
        .args(["--max-num-seqs", "8", "--max-model-len", "256"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let serving = Serving(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let base = format!(
        "{}/v1",
        line.trim()
            .strip_prefix("listening on ")
            .expect("the address line")
    );

    let agent = std::process::Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/openai_agent.py"
        ))
        .args([&base, "secret"])
        .output()
        .unwrap();
    assert!(
        agent.status.success(),
        "{}",
        String::from_utf8_lossy(&agent.stderr)
    );
    let seen: serde_json::Value = serde_json::from_slice(&agent.stdout).unwrap();
    drop(serving);

    assert_eq!(seen["models"], serde_json::json!([200, "model"]));
    assert_eq!(
        (seen["no_key"].as_u64(), seen["wrong_key"].as_u64()),
        (Some(401), Some(401))
    );
    let chat = &seen["chat"];
    let ids: Vec<u32> = serde_json::from_value(chat["token_ids"].clone()).unwrap();
    let logprobs: Vec<f32> = serde_json::from_value(chat["logprobs"].clone()).unwrap();
    assert_eq!((ids.len(), logprobs.len()), (8, 8));
    assert_eq!(chat["finish_reason"], "length");
    assert_eq!(chat["usage"]["completion_tokens"], 8);
    assert_eq!(
        chat["usage"]["prompt_tokens"],
        chat["prompt_token_ids"].as_array().unwrap().len()
    );
    // The prompt as ids through /v1/completions: the same greedy answer.
    assert_eq!(seen["completion"]["token_ids"], chat["token_ids"]);
    assert_eq!(seen["completion"]["text"], chat["text"]);

    // `grpo generate` on the same prompt: the same tokens and log-probs.
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "What is 2 + 3?\n").unwrap();
    let o = run_grpo(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--chat",
        "--prompts-file",
        prompts.to_str().unwrap(),
        "--max-new-tokens",
        "8",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let generated: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(generated["response_ids"], chat["token_ids"]);
    let reference: Vec<f32> = serde_json::from_value(generated["logprobs"].clone()).unwrap();
    for (a, b) in logprobs.iter().zip(&reference) {
        assert!(
            (a - b).abs() < 1e-5,
            "served {logprobs:?} vs generated {reference:?}"
        );
    }

    let sampled = seen["sampled"].as_array().unwrap();
    assert_eq!(sampled[0].as_array().unwrap().len(), 3);
    assert_eq!(sampled[0], sampled[1], "the same seed gives the same samples");
    for (key, expected) in [
        ("stream", "`stream: true` is not served"),
        ("too_long", "exceed the server's --max-model-len (256)"),
        ("bad_ids", "token ids of this model's vocabulary"),
    ] {
        assert_eq!(seen[key][0], 400, "{key}: {}", seen[key]);
        let message = seen[key][1]["error"]["message"].as_str().unwrap();
        assert!(message.contains(expected), "{key}: {message}");
        assert_eq!(seen[key][1]["error"]["type"], "invalid_request_error");
    }
}

#[test]
fn serving_beyond_loopback_needs_a_key() {
    let o = run_grpo(&["serve", "--model", "models/none.gguf", "--host", "0.0.0.0"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(stderr.contains("without a key; give --api-key"), "{stderr}");
}
