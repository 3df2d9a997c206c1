//! `grpo export` end to end: a learner checkpoint of the tiny Llama fixture is exported by the
//! binary and read back; a corrupt checkpoint is refused with the file named.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use model::safetensors_io::load_hf_checkpoint;
use model::HostTensor;
use trainer::checkpoint::{save_checkpoint, TrainerState};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("model/fixtures/tiny/llama")
}

fn grpo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(args)
        .output()
        .expect("running grpo")
}

/// The fixture as a model directory with a word-level tokenizer (one token per embedding row).
fn model_dir(root: &Path) -> PathBuf {
    let dir = root.join("model");
    fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "model.safetensors"] {
        fs::copy(fixture().join(file), dir.join(file)).unwrap();
    }
    let mut vocab = serde_json::Map::new();
    vocab.insert("<unk>".into(), 0.into());
    for id in 1..384 {
        vocab.insert(format!("w{id}"), id.into());
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    dir
}

/// A checkpoint whose parameters are the fixture's scaled by 1.5, recording `model_path`.
fn checkpoint(run: &Path, model: &Path) -> (PathBuf, Vec<Vec<f32>>) {
    let source = load_hf_checkpoint(&fixture()).unwrap();
    let mut trained = Vec::new();
    let params: Vec<HostTensor> = source
        .tensors
        .iter()
        .map(|t| {
            let values: Vec<f32> = t.to_f32_vec().iter().map(|v| v * 1.5).collect();
            trained.push(values.clone());
            HostTensor::from_f32(&t.name, t.shape.clone(), &values)
        })
        .collect();
    let state = TrainerState {
        step: 7,
        weight_version: 7,
        rng_state: serde_json::Value::Null,
        sampler_position: serde_json::Value::Null,
        extra: serde_json::json!({ "model_path": model.to_str().unwrap() }),
    };
    (
        save_checkpoint(run, &state, &[("params", params)], None).unwrap(),
        trained,
    )
}

#[test]
fn export_of_a_run_directory_writes_its_newest_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir(tmp.path());
    let run = tmp.path().join("run");
    let (_, trained) = checkpoint(&run, &model);
    // Folders that do not exist yet are made.
    let out = tmp.path().join("exported/new/folder");
    let result = grpo(&["export", run.to_str().unwrap(), "--output", out.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        result.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(
        stdout.contains("exported step 7 of")
            && stdout.contains("config.json, model.safetensors, tokenizer.json"),
        "{stdout}"
    );
    let exported = load_hf_checkpoint(&out).unwrap();
    for (t, want) in exported.tensors.iter().zip(&trained) {
        assert_eq!(&t.to_f32_vec(), want, "{}", t.name);
    }
}

#[test]
fn a_corrupt_checkpoint_is_refused_and_help_shows_an_example() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir(tmp.path());
    let (ck, _) = checkpoint(&tmp.path().join("run"), &model);
    let file = ck.join("params.safetensors");
    let mut bytes = fs::read(&file).unwrap();
    bytes[100] ^= 0x10;
    fs::write(&file, &bytes).unwrap();
    let out = tmp.path().join("exported");
    let result = grpo(&[
        "export",
        ck.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--dtype",
        "bf16",
    ]);
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert_eq!(result.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("grpo export failed: checkpoint: ")
            && stderr.contains("step_7/params.safetensors: sha256 is"),
        "{stderr}"
    );
    assert!(!out.exists());

    let help = grpo(&["export", "--help"]);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains("Examples:") && text.contains("grpo export runs/gsm8k/checkpoints/step_200 --output"),
        "{text}"
    );
}
