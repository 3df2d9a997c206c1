//! The rollout engine on the tiny Mistral fixture with its sliding window of 5 positions (made by
//! `model/scripts/make_tiny_models.py`): sampled continuations that run past the window are the
//! same tokens, with log-probs within 1e-5 (tensor parallelism sums the heads' shares in
//! another order), on one device and over tensor parallelism of 2 and 4 (KV heads replicated)
//! and slot groups x TP=2, with the whole cache and a chunked one.

mod common;

use common::{generate, request, sampled};

use model::safetensors_io::load_hf_checkpoint;
use rollout::{upload_weights_on, Engine, EngineConfig};
use xla::DType;

#[test]
fn mistral_with_a_sliding_window_samples_alike_over_tensor_parallelism() {
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/fixtures/tiny/mistral_window");
    let weights = load_hf_checkpoint(&fixture).unwrap();
    assert_eq!(weights.config.sliding_window, Some(5));
    let client = testkit::cpu_client(4);
    let requests: Vec<_> = (0..3u64)
        .map(|i| {
            request(
                i + 1,
                &[3, 4, 5, 6, 7, 8, 9][..3 + 2 * i as usize],
                2,
                i,
                sampled(1.0, 0, 1.0, 12),
            )
        })
        .collect();
    for kv_chunk in [0, 8] {
        let mut reference = None;
        for (devices, tp) in [(1, 1), (2, 2), (4, 4), (4, 2)] {
            let what = format!("{devices} devices, tensor parallel {tp}, kv_chunk {kv_chunk}");
            let mut settings = EngineConfig::new(4, 24);
            settings.kv_chunk = kv_chunk;
            settings.tensor_parallel = tp;
            settings.eos_token_ids = Vec::new();
            let on: Vec<usize> = (0..devices).collect();
            let buffers = upload_weights_on(client, &weights, DType::F32, &on, tp).unwrap();
            let mut engine = Engine::new(client, &weights.config, buffers, 1, settings, None).unwrap();
            let samples = generate(&mut engine, &requests);
            assert!(
                samples
                    .iter()
                    .all(|s| s.prompt_ids.len() + s.response_ids.len() > 5),
                "{what}"
            );
            match &reference {
                None => reference = Some(samples),
                Some(want) => {
                    for (got, want) in samples.iter().zip(want) {
                        assert_eq!(
                            got.response_ids, want.response_ids,
                            "{what}: request {}",
                            want.request_id
                        );
                        let gap = got
                            .logprobs
                            .iter()
                            .zip(&want.logprobs)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0f32, f32::max);
                        assert!(
                            gap < 1e-5,
                            "{what}: request {}: log-probs differ by {gap}",
                            want.request_id
                        );
                    }
                }
            }
        }
    }
}
