//! The real model: SmolLM2-135M-Instruct from its Q4_1 GGUF, chat-formatted, greedy.
//! - "What is the capital of France?" is answered with Paris;
//! - greedy continuations equal transformers' on the same dequantised weights
//!   (`model/fixtures/smollm2_greedy.json`, made by `model/scripts/make_smollm2_greedy.py`).
//!
//! The GGUF is found in `$GRPO_TEST_ASSETS` or `models/` at the repository root; fetch it with
//! `scripts/setup.sh`.

use std::path::PathBuf;

use model::programs::{DeviceModel, GenerateOptions, Generator, HostModel};
use model::ChatMessage;
use xla::runtime::Client;
use xla::DType;

#[test]
fn smollm2_answers_paris_and_matches_transformers_greedy() {
    let host = HostModel::load(&testkit::smollm2_gguf()).expect("load the GGUF");
    let template = host.chat_template.as_ref().expect("the GGUF has a chat template");
    let client = Client::cpu(1).expect("CPU PJRT client (run scripts/setup.sh)");
    let model = DeviceModel::upload(&client, &host.weights, DType::F32, 0).unwrap();
    let generator = Generator::new(&model, 64, 96).unwrap();
    let stops = host.stop_tokens();
    let options = GenerateOptions {
        max_new_tokens: 24,
        temperature: 0.0,
        seed: 0,
        stop_tokens: stops.clone(),
    };
    let chat_ids = |user: &str| {
        let text = template.render(&[ChatMessage::new("user", user)], true).unwrap();
        host.tokenizer.encode(&text, false).unwrap()
    };

    let prompt = chat_ids("What is the capital of France?");
    let ids = generator.generate(&model, &prompt, &options).unwrap();
    let text = host.tokenizer.decode(&ids, true).unwrap();
    assert!(text.contains("Paris"), "answer without Paris: {text:?}");
    // Greedy is deterministic.
    assert_eq!(generator.generate(&model, &prompt, &options).unwrap(), ids);

    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/smollm2_greedy.json");
    assert!(
        fixture.is_file(),
        "{} is missing: it is committed; remake it with model/scripts/make_smollm2_greedy.py",
        fixture.display()
    );
    let value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&fixture).unwrap()).unwrap();
    let cases = value["cases"].as_array().expect("cases");
    assert!(!cases.is_empty());
    for case in cases {
        let user = case["user"].as_str().unwrap();
        let want_prompt: Vec<u32> = case["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let prompt = chat_ids(user);
        assert_eq!(
            prompt, want_prompt,
            "{user:?}: prompt ids differ from transformers'"
        );
        let mut want: Vec<u32> = case["generated_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        if want.last().is_some_and(|t| stops.contains(t)) {
            want.pop();
        }
        let got = generator.generate(&model, &prompt, &options).unwrap();
        assert_eq!(
            got,
            want,
            "{user:?}: greedy ids differ from transformers' ({:?} vs {:?})",
            host.tokenizer.decode(&got, false).unwrap(),
            case["generated_text"]
        );
    }
}
