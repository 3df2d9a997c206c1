//! `trainer::export` end to end on the tiny Llama fixture: a learner checkpoint with changed
//! parameters is exported as a Hugging Face checkpoint and read back by the model crate.

use std::fs;
use std::path::{Path, PathBuf};

use model::programs::HostModel;
use model::safetensors_io::load_hf_checkpoint;
use model::ModelConfig;
use trainer::checkpoint::{save_checkpoint, TrainerState};
use trainer::export::{export_checkpoint, ExportOptions};
use trainer::policy::DecoderPolicy;
use trainer::step::LearnerState;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/fixtures/tiny/llama")
}

const CHAT_TEMPLATE: &str = "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}\
{% if add_generation_prompt %}<s>assistant{% endif %}";

/// A word-level `tokenizer.json` with one token per embedding row of the tiny model.
fn tokenizer_json(vocab_size: usize) -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    for (id, token) in ["<pad>", "<s>", "</s>", "<unk>"].iter().enumerate() {
        vocab.insert(token.to_string(), id.into());
    }
    for id in 4..vocab_size {
        vocab.insert(format!("w{id}"), id.into());
    }
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": true})
    };
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<pad>"), special(1, "<s>"), special(2, "</s>"), special(3, "<unk>")],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
}

/// The tiny Llama fixture as a complete model directory (config, weights, tokenizer, chat
/// template), optionally with an edited config.
fn model_dir(root: &Path, name: &str, edit_config: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let dir = root.join(name);
    fs::create_dir_all(&dir).unwrap();
    for file in ["model.safetensors", "generation_config.json"] {
        fs::copy(fixture().join(file), dir.join(file)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&fs::read(fixture().join("config.json")).unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap() as usize;
    edit_config(&mut config);
    fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    fs::write(dir.join("tokenizer.json"), tokenizer_json(vocab).to_string()).unwrap();
    let tokenizer_config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE
    });
    fs::write(dir.join("tokenizer_config.json"), tokenizer_config.to_string()).unwrap();
    dir
}

/// Saves a learner checkpoint of the fixture's weights moved by `0.01 * sin(i + k)` (tensor
/// `k`, element `i`), recording `model_path` in `state.json`. Returns the checkpoint directory
/// and the trained values in parameter-table order.
fn trained_checkpoint(output: &Path, model_path: &Path) -> (PathBuf, Vec<Vec<f32>>) {
    let source = load_hf_checkpoint(&fixture()).unwrap();
    let policy = DecoderPolicy {
        config: source.config.clone(),
        prompt_len: 4,
        response_len: 4,
        micro_batch_size: 1,
        temperature: 1.0,
        group_size: 1,
        blocks: 1,
        remat: false,
        scan: false,
        lora: None,
        lora_form: Default::default(),
        head: Default::default(),
        route_inputs: false,
        moe_lowering: Default::default(),
    };
    let specs = policy.param_specs();
    let params: Vec<Vec<f32>> = source
        .tensors
        .iter()
        .enumerate()
        .map(|(k, t)| {
            t.to_f32_vec()
                .iter()
                .enumerate()
                .map(|(i, v)| v + 0.01 * ((i + k) as f32).sin())
                .collect()
        })
        .collect();
    let state = LearnerState {
        adam_step: 3,
        ..LearnerState::fresh(params.clone())
    };
    let trainer_state = TrainerState {
        step: 3,
        weight_version: 3,
        rng_state: serde_json::json!({"seed": 1}),
        sampler_position: serde_json::json!({"index": 24}),
        extra: serde_json::json!({ "model_path": model_path.to_str().unwrap() }),
    };
    let dir = save_checkpoint(output, &trainer_state, &state.to_tensor_files(&specs), None).unwrap();
    (dir, params)
}

#[test]
fn export_writes_the_trained_parameters_config_and_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir(tmp.path(), "source", |_| {});
    let (ck, trained) = trained_checkpoint(&tmp.path().join("run"), &model);
    let out = tmp.path().join("export");
    // The model comes from state.json's extra.model_path.
    let summary = export_checkpoint(&ck, &out, &ExportOptions::default()).unwrap();
    assert_eq!((summary.step, summary.model.clone()), (3, model.clone()));
    assert_eq!(
        summary.files,
        vec![
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    let exported = load_hf_checkpoint(&out).unwrap();
    assert_eq!(exported.tensors.len(), trained.len());
    assert_eq!(summary.parameters, trained.iter().map(Vec::len).sum::<usize>());
    for (t, want) in exported.tensors.iter().zip(&trained) {
        assert_eq!(t.dtype, xla::DType::F32, "{}", t.name);
        assert_eq!(&t.to_f32_vec(), want, "{}", t.name);
    }
    let source_weights = load_hf_checkpoint(&fixture()).unwrap();
    assert_ne!(
        exported.tensors[0], source_weights.tensors[0],
        "the parameters were changed"
    );
    assert_eq!(
        ModelConfig::from_hf_file(&out.join("config.json")).unwrap(),
        ModelConfig::from_hf_file(&model.join("config.json")).unwrap()
    );
    assert_eq!(
        fs::read(out.join("tokenizer.json")).unwrap(),
        fs::read(model.join("tokenizer.json")).unwrap()
    );
    // The export is a model the project itself loads, chat template included.
    let host = HostModel::load(&out).unwrap();
    let template = host.chat_template.expect("the chat template was exported");
    let prompt = template
        .render(&[model::ChatMessage::new("user", "w7 w9")], true)
        .unwrap();
    assert_eq!(prompt, "<s>user w7 w9</s><s>assistant");
    assert_eq!(host.tokenizer.encode("w7 w9", false).unwrap(), vec![7, 9]);
}

#[test]
fn bf16_export_rounds_each_value_to_nearest_even() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir(tmp.path(), "source", |_| {});
    let (ck, trained) = trained_checkpoint(&tmp.path().join("run"), &model);
    let out = tmp.path().join("export-bf16");
    let options = ExportOptions {
        model: Some(model.clone()),
        dtype: xla::DType::BF16,
        merged: false,
    };
    export_checkpoint(&ck, &out, &options).unwrap();
    let exported = load_hf_checkpoint(&out).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    for (t, want) in exported.tensors.iter().zip(&trained) {
        assert_eq!(t.dtype, xla::DType::BF16, "{}", t.name);
        let rounded: Vec<f32> = want.iter().map(|v| half::bf16::from_f32(*v).to_f32()).collect();
        assert_eq!(t.to_f32_vec(), rounded, "{}", t.name);
    }
}

#[test]
fn a_checkpoint_with_a_wrong_checksum_is_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir(tmp.path(), "source", |_| {});
    let (ck, _) = trained_checkpoint(&tmp.path().join("run"), &model);
    let file = ck.join("params.safetensors");
    let mut bytes = fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    fs::write(&file, &bytes).unwrap();
    let out = tmp.path().join("export");
    let err = export_checkpoint(&ck, &out, &ExportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("checkpoint: ")
            && err.contains("step_3/params.safetensors: sha256 is")
            && err.contains("the file is corrupted"),
        "{err}"
    );
    assert!(!out.exists(), "nothing is written for a corrupt checkpoint");
}

#[test]
fn a_model_whose_parameter_table_differs_is_refused_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir(tmp.path(), "source", |_| {});
    let other = model_dir(tmp.path(), "narrower", |c| c["intermediate_size"] = 96.into());
    let (ck, _) = trained_checkpoint(&tmp.path().join("run"), &model);
    let out = tmp.path().join("export");
    let options = ExportOptions {
        model: Some(other.clone()),
        dtype: xla::DType::F32,
        merged: false,
    };
    let err = export_checkpoint(&ck, &out, &options).unwrap_err().to_string();
    assert!(
        err.contains("tensor `model.layers.0.mlp.gate_proj.weight`")
            && err.contains("has shape [128, 64], but")
            && err.contains("narrower expects [96, 64]"),
        "{err}"
    );
    // A tied-embedding config has no lm_head: the checkpoint's extra tensor is named.
    let tied = model_dir(tmp.path(), "tied", |c| c["tie_word_embeddings"] = true.into());
    let options = ExportOptions {
        model: Some(tied),
        dtype: xla::DType::F32,
        merged: false,
    };
    let err = export_checkpoint(&ck, &out, &options).unwrap_err().to_string();
    assert!(
        err.contains("tensor `lm_head.weight` (shape [384, 64])") && err.contains("is not a parameter of"),
        "{err}"
    );
    assert!(!out.exists());
}
