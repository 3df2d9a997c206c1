//! A rollout worker as a real process (`grpo worker --role rollout`) over loopback gRPC, on a
//! tiny random-weight Llama: it generates exactly what an engine built in-process from the
//! same recipe does, and after a weight update what an engine over the new weights does.

mod common;

use actors::auth::Token;
use actors::roles::rollout::{LocalRollout, RemoteRollout, RolloutRole, WeightUpdate};
use actors::roles::RoleError;
use actors::setup;
use common::WorkerProcess;
use rollout::{GenerationRequest, Sample, SamplingParams};
use std::fs;
use std::path::{Path, PathBuf};

/// The tiny Llama fixture's config with a word-level tokenizer (one token per embedding row)
/// and a plain chat template; the recipe asks for random weights.
fn write_run(root: &Path) -> PathBuf {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = root.join("model");
    fs::create_dir_all(&model).unwrap();
    let fixture = repo.join("model/fixtures/tiny/llama");
    for file in ["config.json", "model.safetensors"] {
        fs::copy(fixture.join(file), model.join(file)).unwrap();
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
    fs::write(model.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = root.join("chat.jinja");
    fs::write(&template, "{% for m in messages %}{{ m.content }} {% endfor %}").unwrap();
    // The worker opens the recipe's data (as the orchestrator does), so it needs some.
    let data = common::arithmetic(root, "train", 1, 8);
    let recipe = root.join("recipe.yaml");
    let text = format!(
        "model:\n  path: {model}\n  chat_template: {template}\n  random_init: true\n\
         data:\n  train_files: {data}\n  train_batch_size: 2\n  max_prompt_length: 48\n  max_response_length: 16\n\
         rollout:\n  n: 2\n  max_num_seqs: 4\n\
         actor:\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 2\n\
         trainer:\n  seed: 3\n  output_dir: {out}\n",
        model = model.display(),
        template = template.display(),
        data = data.display(),
        out = root.join("out").display(),
    );
    fs::write(&recipe, text).unwrap();
    recipe
}

fn start_worker(recipe: &Path, token_file: &Path) -> (WorkerProcess, String) {
    let mut worker = WorkerProcess::start(&mut common::worker("rollout", recipe, token_file));
    let address = worker.loopback_address();
    (worker, address)
}

fn requests() -> Vec<GenerationRequest> {
    vec![
        GenerationRequest {
            id: 1,
            prompt: vec![5, 17, 200, 33],
            n: 1,
            seed: 0,
            params: SamplingParams::greedy(10),
            multi_turn: None,
        },
        GenerationRequest {
            id: 2,
            prompt: vec![301, 4, 9],
            n: 2,
            seed: 11,
            params: SamplingParams {
                temperature: 1.0,
                max_new_tokens: 8,
                ..Default::default()
            },
            multi_turn: None,
        },
    ]
}

async fn generate(role: &dyn RolloutRole) -> Result<Vec<Sample>, RoleError> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let result = role.generate(requests(), tx).await;
    let mut samples = Vec::new();
    while let Ok(s) = rx.try_recv() {
        samples.push(s);
    }
    samples.sort_by_key(|s| (s.request_id, s.sample_index));
    result.map(|_| samples)
}

fn same(a: &[Sample], b: &[Sample]) {
    assert_eq!(a.len(), 3);
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(format!("{x:?}"), format!("{y:?}"));
    }
}

#[test]
fn a_rollout_worker_process_generates_like_the_in_process_engine_and_takes_new_weights() {
    let dir = tempfile::tempdir().unwrap();
    let recipe_path = write_run(dir.path());
    let token = Token::generate();
    let token_file = dir.path().join("token");
    token.write(&token_file).unwrap();
    let (_worker, address) = start_worker(&recipe_path, &token_file);

    // The same engine in this process, built as the orchestrator builds it.
    let recipe = actors::recipe::load_recipe(&recipe_path, &[]).unwrap();
    let prepared = actors::prepare::prepare(&recipe).unwrap();
    let client = setup::open_client(&recipe).unwrap();
    let weights = prepared.upload_rollout_weights(&recipe, &client).unwrap();
    let local = LocalRollout::new(prepared.rollout_engine(&recipe, &client, weights, 0).unwrap());
    // Other weights, as a learner would hold them (f32), and an engine over them at version 1.
    let config = &prepared.model.weights.config;
    let trained = model::random_init(config, 77);
    let trained_buffers: std::sync::Arc<[xla::runtime::Buffer]> =
        rollout::upload_weights(&client, &trained, xla::DType::F32, 0)
            .unwrap()
            .into();
    let local_trained = LocalRollout::new(
        prepared
            .rollout_engine(&recipe, &client, trained_buffers.clone(), 1)
            .unwrap(),
    );

    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let remote = RemoteRollout::new(&address, &token, None).unwrap();
        assert_eq!(remote.refresh().await.unwrap(), 0);
        let expected = generate(&local).await.unwrap();
        let got = generate(&remote).await.unwrap();
        same(&got, &expected);
        assert!(
            !got[0].text.is_empty(),
            "the worker decodes text with the recipe's tokenizer"
        );

        remote
            .update_weights(WeightUpdate {
                version: 1,
                params: trained_buffers.into(),
            })
            .await
            .unwrap();
        assert_eq!(remote.weight_version(), 1);
        let expected = generate(&local_trained).await.unwrap();
        let got = generate(&remote).await.unwrap();
        same(&got, &expected);
        assert!(got.iter().all(|s| s.weight_version == 1));
    });
}
