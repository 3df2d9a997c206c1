//! Request builders shared by the engine tests.
#![allow(dead_code)]

use std::sync::Arc;

use rollout::{Engine, Episode, EpisodeStats, GenerationRequest, Resume, Sample, SamplingParams, Turn};

/// A request for `n` samples of `prompt` with its own `seed`.
pub fn request(id: u64, prompt: &[u32], n: usize, seed: u64, params: SamplingParams) -> GenerationRequest {
    GenerationRequest {
        id,
        prompt: prompt.to_vec(),
        n,
        seed,
        params,
        multi_turn: None,
    }
}

/// Sampling at `temperature` with top-k / top-p (0 / 1.0: off), up to `max_new_tokens`.
pub fn sampled(temperature: f32, top_k: usize, top_p: f32, max_new_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        max_new_tokens,
        ..Default::default()
    }
}

/// The samples of request `id`, in sample-index order.
pub fn of_request(samples: &[Sample], id: u64) -> Vec<&Sample> {
    let mut v: Vec<&Sample> = samples.iter().filter(|s| s.request_id == id).collect();
    v.sort_by_key(|s| s.sample_index);
    v
}

/// Submits every request, runs the engine until all are done and returns every sample,
/// sorted by (request, sample index).
pub fn generate(engine: &mut Engine, requests: &[GenerationRequest]) -> Vec<Sample> {
    for r in requests {
        engine.submit(r.clone()).unwrap();
    }
    let mut all = engine.run_to_completion().unwrap();
    all.sort_by_key(|s| (s.request_id, s.sample_index));
    all
}

/// Bit-for-bit equal tokens, finish reasons and log-probs, sample by sample.
pub fn assert_identical(got: &[Sample], expected: &[Sample], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: sample count");
    for (g, e) in got.iter().zip(expected) {
        let at = format!("{what}: request {} sample {}", e.request_id, e.sample_index);
        assert_eq!(g.response_ids, e.response_ids, "{at}: tokens");
        assert_eq!(g.finish_reason, e.finish_reason, "{at}");
        let bits = |s: &Sample| s.logprobs.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(g), bits(e), "{at}: log-prob bits");
    }
}

/// 20 requests of 4 samples whose samples finish at different steps (3 to 30 new tokens, tiny
/// vocabulary of 32), so holes open below long-lived samples in every slot group and waiting
/// requests take them.
pub fn staggered_requests() -> Vec<GenerationRequest> {
    [3usize, 30, 5, 8, 13, 21, 4, 27, 9, 6]
        .iter()
        .cycle()
        .take(20)
        .enumerate()
        .map(|(i, &len)| {
            let id = i as u64 + 1;
            let prompt: Vec<u32> = (0..2 + i % 5).map(|t| (7 * id as u32 + t as u32) % 32).collect();
            request(id, &prompt, 4, 100 + id, sampled(1.0, 0, 1.0, len))
        })
        .collect()
}

/// A multi-turn request whose turns end at tokens 0-3 (an eighth of the tiny vocabulary).
pub fn episode(
    id: u64,
    prompt: &[u32],
    n: usize,
    max_new_tokens: usize,
    max_turn_tokens: usize,
) -> GenerationRequest {
    let mut params = sampled(1.0, 0, 1.0, max_new_tokens);
    params.stop_token_ids = vec![0, 1, 2, 3];
    GenerationRequest {
        multi_turn: Some(Episode {
            max_turn_tokens,
            row: Arc::new(serde_json::Value::Null),
        }),
        ..request(id, prompt, n, 40 + id, params)
    }
}

/// The environment of these tests: after turn k (1-based) it writes `len` tokens `[20 + k,
/// 9, 30, ...]` (none of them a stop token), and it ends the episode after `turns` model
/// turns.
pub fn answer(turn: &Turn, turns: u32, len: usize) -> Resume {
    let stats = EpisodeStats {
        tool_calls: 1,
        ..Default::default()
    };
    if turn.turns >= turns {
        Resume::Finish { stats }
    } else {
        let tokens = (0..len as u32)
            .map(|i| match i {
                0 => 20 + turn.turns,
                1 => 9,
                2 => 30,
                i => 4 + (5 * i) % 28,
            })
            .collect();
        Resume::Continue { tokens, stats }
    }
}

/// Steps the engine, answering every parked turn at once by `respond`, until nothing is left;
/// returns every sample, sorted by (request, sample index).
pub fn run_episodes(
    engine: &mut Engine,
    requests: &[GenerationRequest],
    respond: impl Fn(&Turn) -> Resume,
) -> Vec<Sample> {
    for r in requests {
        engine.submit(r.clone()).unwrap();
    }
    let mut all = Vec::new();
    while engine.has_work() || engine.parked_samples() > 0 {
        all.extend(engine.step().unwrap());
        for turn in engine.take_turns() {
            assert!(engine.resume(turn.id, respond(&turn)).unwrap());
        }
    }
    all.sort_by_key(|s| (s.request_id, s.sample_index));
    all
}
