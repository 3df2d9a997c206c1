//! The rollout engine on the tiny Gemma 3 fixture (sliding, global and sliding layers, a window
//! of 5, two RoPE bases): greedy continuations past the window equal transformers' (made by
//! `model/scripts/make_tiny_models.py`), with the whole cache and a chunked one with batched
//! prefill, on one device and over tensor parallelism of 2 and 4 (the KV heads replicated), and
//! slot groups x TP=2.

mod common;

use common::{generate, request};

use model::safetensors_io::load_hf_checkpoint;
use rollout::{upload_weights_on, Engine, EngineConfig, SamplingParams};
use xla::DType;

fn fixture() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/fixtures/tiny/gemma3")
}

/// transformers' greedy continuations: (prompt, 16 tokens) per prompt.
fn greedy_reference() -> Vec<(Vec<u32>, Vec<u32>)> {
    let bytes = std::fs::read(fixture().join("reference.safetensors")).unwrap();
    let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        let t = reference.tensor(key).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::I32, "{key}");
        t.data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
            .collect()
    };
    (0..3)
        .map(|i| (ids(&format!("greedy_prompt_{i}")), ids(&format!("greedy_{i}"))))
        .collect()
}

#[test]
fn gemma3_greedy_tokens_equal_transformers_on_one_device_and_over_tensor_parallelism() {
    let weights = load_hf_checkpoint(&fixture()).unwrap();
    let config = weights.config.clone();
    let reference = greedy_reference();
    let client = testkit::cpu_client(4);
    for (kv_chunk, prefill_batch) in [(0, 1), (8, 2)] {
        for (devices, tp) in [(1, 1), (2, 2), (4, 4), (4, 2)] {
            let what = format!("{devices} devices, tensor parallel {tp}, kv_chunk {kv_chunk}");
            let mut settings = EngineConfig::new(4, 32);
            settings.kv_chunk = kv_chunk;
            settings.prefill_batch = prefill_batch;
            settings.tensor_parallel = tp;
            // transformers' continuations ran without a stop token.
            settings.eos_token_ids = Vec::new();
            let on: Vec<usize> = (0..devices).collect();
            let buffers = upload_weights_on(client, &weights, DType::F32, &on, tp).unwrap();
            let mut engine = Engine::new(client, &config, buffers, 1, settings, None).unwrap();
            let requests: Vec<_> = reference
                .iter()
                .enumerate()
                .map(|(i, (prompt, _))| request(i as u64, prompt, 1, 0, SamplingParams::greedy(16)))
                .collect();
            let samples = generate(&mut engine, &requests);
            for (sample, (prompt, want)) in samples.iter().zip(&reference) {
                assert_eq!(&sample.response_ids, want, "{what}: prompt {prompt:?}");
            }
        }
    }
}
