//! Tokenizers and chat templates against transformers (`model/scripts/make_tokenizer_fixtures.py`):
//! the Qwen3 and Llama 3 `tokenizer.json` files and the SmolLM2 GGUF tokenizer give the expected
//! ids; the Qwen3, Llama 3 and SmolLM2 chat templates render byte-identically.

mod common;

use model::gguf::GgufFile;
use model::{ChatTemplate, ModelConfig, ModelTokenizer};
use serde_json::Value;

fn strings() -> Vec<String> {
    common::fixture_json("tokenizer_strings.json")["strings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

fn expected_ids(key: &str) -> Vec<Vec<u32>> {
    common::fixture_json("tokenizer_ids.json")["ids"][key]
        .as_array()
        .unwrap()
        .iter()
        .map(|ids| {
            ids.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

fn check(tokenizer: &ModelTokenizer, key: &str, add_special_tokens: bool) {
    let strings = strings();
    let expected = expected_ids(key);
    assert_eq!(strings.len(), expected.len());
    for (s, want) in strings.iter().zip(&expected) {
        let got = tokenizer.encode(s, add_special_tokens).unwrap();
        assert_eq!(&got, want, "{key}: {s:?}");
        if !add_special_tokens {
            assert_eq!(&tokenizer.decode(&got, false).unwrap(), s, "{key}: decode");
        }
    }
}

#[test]
fn qwen3_and_llama3_tokenizer_json() {
    let qwen3 = ModelTokenizer::from_file(&testkit::asset("qwen3/tokenizer.json")).unwrap();
    check(&qwen3, "qwen3", false);
    assert_eq!(qwen3.vocab_size(), 151_669);
    // Qwen3's config (no pad id) with its tokenizer_config: stop at <|endoftext|> and <|im_end|>,
    // pad with <|endoftext|>.
    let config = ModelConfig::from_hf_json(
        &serde_json::json!({"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
            "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "eos_token_id": 151643, "bos_token_id": 151643}),
        "qwen3 config",
    )
    .unwrap();
    qwen3.check_fits(&config).unwrap();
    let template =
        ChatTemplate::from_tokenizer_config(&testkit::asset("qwen3/tokenizer_config.json")).unwrap();
    assert_eq!(
        qwen3.stop_token_ids(&config, Some(&template)),
        vec![151643, 151645]
    );
    assert_eq!(qwen3.pad_token_id(&config, Some(&template)), Some(151643));
    let llama3 = ModelTokenizer::from_file(&testkit::asset("llama3/tokenizer.json")).unwrap();
    check(&llama3, "llama3", false);
    check(&llama3, "llama3_with_special", true);
}

#[test]
fn smollm2_gguf_tokenizer() {
    let gguf = GgufFile::open(&testkit::smollm2_gguf()).unwrap();
    let tokenizer = ModelTokenizer::from_gguf(&gguf).unwrap();
    check(&tokenizer, "smollm2_gguf", false);
    let config = ModelConfig::from_gguf(&gguf).unwrap();
    tokenizer.check_fits(&config).unwrap();
    assert_eq!(tokenizer.token_to_id("<|im_end|>"), Some(2));
    let template = ChatTemplate::from_gguf(&gguf).unwrap();
    assert_eq!(tokenizer.stop_token_ids(&config, Some(&template)), vec![2]);
    assert_eq!(tokenizer.pad_token_id(&config, Some(&template)), Some(2));
    // The Qwen3 tokenizer does not fit SmolLM2's 49,152-row embedding table.
    let qwen3 = ModelTokenizer::from_file(&testkit::asset("qwen3/tokenizer.json")).unwrap();
    let e = qwen3.check_fits(&config).unwrap_err().to_string();
    assert!(e.ends_with("tokenizer.json has 151669 tokens (largest id 151668) but the model's vocab_size is 49152: the tokenizer does not belong to this model"), "{e}");
}

fn check_template(template: &ChatTemplate, key: &str) {
    let fixture = common::fixture_json("chat_templates.json");
    let cases = &fixture["cases"][key];
    assert_eq!(cases.as_array().unwrap().len(), 8);
    check_cases(template, cases, key);
}

/// Each fixture case (`messages`, `add_generation_prompt`, `expected`) renders as transformers did.
fn check_cases(template: &ChatTemplate, cases: &serde_json::Value, what: &str) {
    for case in cases.as_array().unwrap() {
        let got = template
            .render_with(
                &case["messages"],
                case["add_generation_prompt"].as_bool().unwrap(),
                &serde_json::Map::new(),
            )
            .unwrap();
        assert_eq!(
            got,
            case["expected"].as_str().unwrap(),
            "{what}: {}",
            case["messages"]
        );
    }
}

#[test]
fn chat_templates_render_like_transformers() {
    let qwen3 = ChatTemplate::from_tokenizer_config(&testkit::asset("qwen3/tokenizer_config.json")).unwrap();
    assert_eq!(qwen3.eos_token.as_deref(), Some("<|im_end|>"));
    assert_eq!(qwen3.pad_token.as_deref(), Some("<|endoftext|>"));
    check_template(&qwen3, "qwen3");
    // Tool definitions and tool calls go through `tojson`, which must print like Python's json.dumps.
    let fixture = common::fixture_json("chat_templates.json");
    for case in fixture["cases"]["qwen3_tools"].as_array().unwrap() {
        let mut extra = serde_json::Map::new();
        extra.insert("tools".into(), case["tools"].clone());
        let got = qwen3
            .render_with(
                &case["messages"],
                case["add_generation_prompt"].as_bool().unwrap(),
                &extra,
            )
            .unwrap();
        assert_eq!(got, case["expected"].as_str().unwrap());
    }
    let llama3 =
        ChatTemplate::from_tokenizer_config(&testkit::asset("llama3/tokenizer_config.json")).unwrap();
    assert_eq!(llama3.bos_token.as_deref(), Some("<|begin_of_text|>"));
    check_template(&llama3, "llama3");
    let gguf = GgufFile::open(&testkit::smollm2_gguf()).unwrap();
    let smol = ChatTemplate::from_gguf(&gguf).unwrap();
    assert_eq!(
        (smol.bos_token.as_deref(), smol.eos_token.as_deref()),
        (Some("<|im_start|>"), Some("<|im_end|>"))
    );
    check_template(&smol, "smollm2");
}

#[test]
fn smollm2_greedy_prompts_tokenize_like_the_fixture() {
    let fixture = common::fixture_json("smollm2_greedy.json");
    let gguf = GgufFile::open(&testkit::smollm2_gguf()).unwrap();
    let tokenizer = ModelTokenizer::from_gguf(&gguf).unwrap();
    let template = ChatTemplate::from_gguf(&gguf).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for case in cases {
        let messages = [model::ChatMessage::new("user", case["user"].as_str().unwrap())];
        let prompt = template.render(&messages, true).unwrap();
        assert_eq!(prompt, case["prompt"].as_str().unwrap());
        let ids = tokenizer.encode(&prompt, false).unwrap();
        let want: Vec<u32> = case["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids, want);
        let generated: Vec<u32> = case["generated_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            tokenizer.decode(&generated, false).unwrap(),
            case["generated_text"].as_str().unwrap()
        );
    }
    let first = &cases[0];
    assert_eq!(first["user"], Value::from("What is the capital of France?"));
    assert!(first["generated_text"].as_str().unwrap().contains("Paris"));
}

/// Gemma 3's and Mistral's templates (`model/scripts/make_family_chat_fixtures.py`): neither has
/// a system role, so a system message's text opens the first user turn (Gemma's, after a blank
/// line) or the first `[INST]` block (Mistral's), as transformers renders them; turns that do
/// not alternate are refused with the template's own message.
#[test]
fn gemma3_and_mistral_templates_fold_the_system_message_into_the_first_user_turn() {
    let fixture = common::fixture_json("family_chat_templates.json");
    for (family, bos, eos) in [("gemma3", "<bos>", "<eos>"), ("mistral", "<s>", "</s>")] {
        let path = common::fixtures_dir().join(format!("tiny/{family}/tokenizer_config.json"));
        let template = ChatTemplate::from_tokenizer_config(&path).unwrap();
        assert_eq!(
            (template.bos_token.as_deref(), template.eos_token.as_deref()),
            (Some(bos), Some(eos))
        );
        check_cases(&template, &fixture[family]["cases"], family);
        let refused = &fixture[family]["refused"];
        let e = template
            .render_with(&refused["messages"], false, &serde_json::Map::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains(refused["error"].as_str().unwrap()), "{family}: {e}");
    }
}
