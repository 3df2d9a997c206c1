//! End-to-end tests of the rollout engine on tiny random models through the CPU plugin:
//! greedy parity with the model crate's step-by-step `Generator` (alone and in a full batch),
//! log-probs against the `logprobs` program, the sampling distribution (chi-square), prefix
//! sharing (one prefill per group), a chunked KV cache and batched prefill against the whole
//! cache, weight hot-swap, rejections, stop rules and the streaming handle.

mod common;

use common::{assert_identical, generate, of_request, request, sampled, staggered_requests};
use testkit::client;

use model::forward::KvWrite;
use model::programs::{DeviceModel, FullLogitsProgram, GenerateOptions, Generator, LogprobsProgram};
use model::{random_init, ModelConfig, ModelTokenizer, ModelWeights};
use rollout::sampling::reference_distribution;
use rollout::{
    upload_weights, Engine, EngineConfig, EngineOutput, FinishReason, GenerationRequest, Sample,
    SamplingParams,
};
use xla::DType;

/// An engine on device 0 with `weights` uploaded in `dtype`, weight version 1.
fn engine_of(
    weights: &ModelWeights,
    dtype: DType,
    settings: EngineConfig,
    tokenizer: Option<ModelTokenizer>,
) -> Engine {
    let buffers = upload_weights(client(), weights, dtype, 0).unwrap();
    Engine::new(client(), &weights.config, buffers, 1, settings, tokenizer).unwrap()
}

/// An f32 engine of `slots` slots of `max_len` positions.
fn engine_with(
    weights: &ModelWeights,
    slots: usize,
    max_len: usize,
    tokenizer: Option<ModelTokenizer>,
) -> Engine {
    engine_of(weights, DType::F32, EngineConfig::new(slots, max_len), tokenizer)
}

fn greedy_reference(weights: &ModelWeights, prompt: &[u32], max_new_tokens: usize) -> Vec<u32> {
    let dm = DeviceModel::upload(client(), weights, DType::F32, 0).unwrap();
    let generator = Generator::new(&dm, 16, 32).unwrap();
    let options = GenerateOptions {
        max_new_tokens,
        temperature: 0.0,
        seed: 0,
        stop_tokens: vec![],
    };
    generator.generate(&dm, prompt, &options).unwrap()
}

/// The largest difference between a sample's per-token log-probs and those the `logprobs`
/// program (weights of `dtype`, at the request's temperature, 1 for greedy) computes on the
/// finished sequence; each sample must carry one log-prob per response token.
fn largest_logprob_gap(
    weights: &ModelWeights,
    dtype: DType,
    requests: &[GenerationRequest],
    samples: &[Sample],
) -> f32 {
    let dm = DeviceModel::upload(client(), weights, dtype, 0).unwrap();
    let program = LogprobsProgram::compile(&dm, 1, 32).unwrap();
    let mut worst = 0f32;
    for s in samples {
        assert_eq!(s.logprobs.len(), s.response_ids.len());
        let r = requests.iter().find(|r| r.id == s.request_id).unwrap();
        let temperature = if r.params.temperature > 0.0 {
            r.params.temperature
        } else {
            1.0
        };
        let mut tokens = s.prompt_ids.clone();
        tokens.extend(&s.response_ids);
        let real = tokens.len();
        let mask: Vec<i32> = (0..32).map(|i| (i < real) as i32).collect();
        tokens.resize(32, 0);
        let (lp, _) = program.run(&dm, &tokens, &mask, temperature).unwrap();
        for (j, &got) in s.logprobs.iter().enumerate() {
            worst = worst.max((got - lp[s.prompt_ids.len() + j]).abs());
        }
    }
    worst
}

#[test]
fn greedy_equals_step_by_step_generation_alone_and_in_a_full_batch() {
    let weights = random_init(&ModelConfig::tiny_llama(), 1);
    let a = [3u32, 7, 1, 9, 4];
    let b = [12u32, 30, 2];
    let expected_a = greedy_reference(&weights, &a, 12);
    let expected_b = greedy_reference(&weights, &b, 9);

    let mut engine = engine_with(&weights, 4, 32, None);
    engine
        .submit(request(1, &a, 1, 0, SamplingParams::greedy(12)))
        .unwrap();
    let alone = engine.run_to_completion().unwrap();
    assert_eq!(alone.len(), 1);
    assert_eq!(alone[0].response_ids, expected_a);
    assert_eq!(alone[0].finish_reason, FinishReason::MaxNewTokens);
    assert_eq!(alone[0].prompt_ids, a.to_vec());

    // Fill all 4 slots with unrelated work; `a` lands in the last slot.
    engine
        .submit(request(2, &b, 1, 0, SamplingParams::greedy(9)))
        .unwrap();
    engine
        .submit(request(
            3,
            &[5, 6, 7, 8, 9, 10, 11],
            2,
            99,
            sampled(1.0, 0, 1.0, 20),
        ))
        .unwrap();
    engine
        .submit(request(1, &a, 1, 0, SamplingParams::greedy(12)))
        .unwrap();
    let batch = engine.run_to_completion().unwrap();
    assert_eq!(batch.len(), 4);
    assert_eq!(of_request(&batch, 1)[0].response_ids, expected_a);
    assert_eq!(of_request(&batch, 2)[0].response_ids, expected_b);
    assert_eq!(engine.stats().prefill_runs, 4, "one prefill per request");
}

#[test]
fn logprobs_equal_the_logprobs_program_and_samples_are_batch_invariant() {
    let weights = random_init(&ModelConfig::tiny_llama(), 3);
    let requests = [
        request(1, &[4, 8, 15, 16, 23, 4], 3, 11, sampled(0.8, 0, 1.0, 10)),
        request(2, &[9], 2, 12, sampled(1.3, 5, 0.9, 10)),
        request(3, &[1, 2], 1, 0, SamplingParams::greedy(10)),
    ];
    let samples = generate(&mut engine_with(&weights, 8, 32, None), &requests);
    assert_eq!(samples.len(), 6);

    let worst = largest_logprob_gap(&weights, DType::F32, &requests, &samples);
    assert!(worst < 1e-5, "engine vs logprobs program: {worst}");

    // The same seeded request alone, in a fresh engine, gives the same tokens.
    let mut alone = engine_with(&weights, 8, 32, None);
    alone.submit(requests[0].clone()).unwrap();
    let solo = alone.run_to_completion().unwrap();
    let mixed = of_request(&samples, 1);
    for s in &solo {
        assert_eq!(s.response_ids, mixed[s.sample_index].response_ids);
    }
    // Different sample indices draw different tokens.
    assert!(mixed.iter().any(|s| s.response_ids != mixed[0].response_ids));
}

#[test]
fn bf16_weights_keep_a_bf16_cache_and_track_the_bf16_logprobs_program() {
    let weights = random_init(&ModelConfig::tiny_llama(), 5);
    let requests = [
        request(1, &[4, 8, 15, 16, 23, 4], 2, 21, sampled(1.0, 0, 1.0, 12)),
        request(2, &[9, 3], 2, 22, sampled(0.7, 0, 1.0, 12)),
    ];
    let mut engine = engine_of(&weights, DType::BF16, EngineConfig::new(4, 32), None);
    // Keys and values in bf16: half the bytes of an f32 cache.
    let c = &weights.config;
    let f32_bytes = 2 * c.num_hidden_layers * 4 * c.num_key_value_heads * 32 * c.head_dim * 4;
    assert_eq!(engine.kv_cache_bytes() * 2, f32_bytes);
    let samples = generate(&mut engine, &requests);
    assert_eq!(samples.len(), 4);

    // The trainer's bf16 program rounds keys and values to bf16 before its attention products,
    // as the cache does, so the two agree to f32 rounding (9e-7 here; with an f32 cache under
    // bf16 weights they differed by up to 0.09).
    let worst = largest_logprob_gap(&weights, DType::BF16, &requests, &samples);
    assert!(worst < 1e-5, "bf16 engine vs bf16 logprobs program: {worst}");
}

#[test]
fn a_group_is_prefilled_once_and_copied_into_its_slots() {
    let weights = random_init(&ModelConfig::tiny_llama(), 4);
    let mut engine = engine_with(&weights, 8, 32, None);
    let prompt = [5u32, 9, 13, 2, 7, 7, 1, 30, 22];
    engine
        .submit(request(1, &prompt, 8, 5, sampled(1.0, 0, 1.0, 6)))
        .unwrap();
    let samples = engine.run_to_completion().unwrap();
    assert_eq!(samples.len(), 8);
    assert_eq!(engine.stats().prefill_runs, 1);
    assert_eq!(engine.stats().decode_steps, 6);
    assert_eq!(engine.stats().generated_tokens, 48);
    let mut indices: Vec<usize> = samples.iter().map(|s| s.sample_index).collect();
    indices.sort();
    assert_eq!(indices, (0..8).collect::<Vec<_>>());
    // Each copied slot holds the prompt's cache: greedy n=3 samples all equal the reference.
    let expected = greedy_reference(&weights, &prompt, 6);
    engine
        .submit(request(2, &prompt, 3, 0, SamplingParams::greedy(6)))
        .unwrap();
    let greedy = engine.run_to_completion().unwrap();
    assert_eq!(engine.stats().prefill_runs, 2);
    for s in &greedy {
        assert_eq!(s.response_ids, expected, "sample {}", s.sample_index);
    }
}

#[test]
fn a_chunked_cache_and_batched_prefill_give_the_tokens_of_the_whole_cache() {
    let weights = random_init(&ModelConfig::tiny_llama(), 6);
    let make = |kv_chunk: usize, prefill_batch: usize| {
        let mut settings = EngineConfig::new(6, 32);
        settings.kv_chunk = kv_chunk;
        settings.prefill_batch = prefill_batch;
        engine_of(&weights, DType::F32, settings, None)
    };
    // Prompts of 3 to 12 tokens, up to 31 positions: decode steps read 1, 2 and 4 chunks of 8.
    let requests = [
        request(1, &[3, 7, 1, 9, 4], 1, 0, SamplingParams::greedy(20)),
        request(
            2,
            &[12, 30, 2, 8, 8, 1, 0, 5, 17, 22, 3, 9],
            1,
            21,
            sampled(1.0, 0, 1.0, 19),
        ),
        request(3, &[4, 4, 2], 1, 22, sampled(0.7, 0, 1.0, 25)),
        request(4, &[6, 1, 28, 3, 9, 9], 1, 23, sampled(1.2, 4, 0.9, 14)),
        request(5, &[2, 11, 5, 5, 20, 1, 7], 2, 24, sampled(1.0, 0, 1.0, 16)),
    ];
    let mut whole = make(32, 1);
    let mut chunked = make(8, 2);
    for r in &requests {
        whole.submit(r.clone()).unwrap();
        chunked.submit(r.clone()).unwrap();
    }
    let expected = whole.run_to_completion().unwrap();
    let got = chunked.run_to_completion().unwrap();
    assert_eq!(got.len(), 6);
    for r in &requests {
        let (want, have) = (of_request(&expected, r.id), of_request(&got, r.id));
        assert_eq!(want.len(), have.len());
        for (w, h) in want.iter().zip(&have) {
            assert_eq!(h.response_ids, w.response_ids, "request {}", r.id);
            for (a, b) in h.logprobs.iter().zip(&w.logprobs) {
                assert!((a - b).abs() < 1e-5, "request {}: {a} vs {b}", r.id);
            }
        }
    }
    assert_eq!(
        of_request(&got, 1)[0].response_ids,
        greedy_reference(&weights, &[3, 7, 1, 9, 4], 20)
    );
    // Same cache size (32 positions = 4 chunks of 8); the four n=1 requests of the first
    // bucket went in two batched runs of 2, request 5 (n=2) alone.
    assert_eq!(chunked.kv_cache_bytes(), whole.kv_cache_bytes());
    assert_eq!(chunked.stats().prefill_runs, 5);
    assert_eq!(whole.stats().prefill_batches, 5);
    assert!(chunked.stats().prefill_batches < 5, "{:?}", chunked.stats());
}

/// The masked cache write (TPU's) and the row scatter (CPU's and GPU's) give the same tokens
/// and log-probs (to rounding: the programs differ), on a whole cache and on a chunked one.
#[test]
fn the_masked_cache_write_gives_the_tokens_of_the_row_scatter() {
    let weights = random_init(&ModelConfig::tiny_llama(), 7);
    let make = |kv_chunk: usize, write: KvWrite| {
        let mut settings = EngineConfig::new(4, 32);
        settings.kv_chunk = kv_chunk;
        settings.kv_write = Some(write);
        engine_of(&weights, DType::F32, settings, None)
    };
    let requests = [
        request(1, &[3, 7, 1, 9, 4], 2, 5, sampled(1.0, 0, 1.0, 22)),
        request(
            2,
            &[12, 30, 2, 8, 8, 1, 0, 5, 17],
            1,
            6,
            SamplingParams::greedy(18),
        ),
        request(3, &[4, 4, 2], 2, 7, sampled(0.8, 4, 0.9, 26)),
    ];
    for kv_chunk in [32, 8] {
        let mut scatter = make(kv_chunk, KvWrite::Scatter);
        let mut masked = make(kv_chunk, KvWrite::Masked);
        for r in &requests {
            scatter.submit(r.clone()).unwrap();
            masked.submit(r.clone()).unwrap();
        }
        let want = scatter.run_to_completion().unwrap();
        let got = masked.run_to_completion().unwrap();
        assert_eq!(got.len(), 5);
        for r in &requests {
            for (w, h) in of_request(&want, r.id).iter().zip(&of_request(&got, r.id)) {
                assert_eq!(
                    h.response_ids, w.response_ids,
                    "chunk {kv_chunk}, request {}",
                    r.id
                );
                for (a, b) in h.logprobs.iter().zip(&w.logprobs) {
                    assert!(
                        (a - b).abs() < 1e-5,
                        "chunk {kv_chunk}, request {}: {a} vs {b}",
                        r.id
                    );
                }
            }
        }
    }
}

/// Upper critical value of chi-square with `df` degrees of freedom at significance 0.001
/// (Wilson-Hilferty approximation, z = 3.0902).
fn chi2_critical_0001(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.0902;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// Pearson chi-square of `observed` counts against probabilities `p`, pooling bins with an
/// expected count under 5. Returns (statistic, degrees of freedom).
fn chi_square(observed: &[usize], p: &[f64]) -> (f64, usize) {
    let total: usize = observed.iter().sum();
    let mut bins: Vec<(f64, f64)> = Vec::new();
    let (mut pooled_e, mut pooled_o) = (0.0, 0.0);
    for (o, &pi) in observed.iter().zip(p) {
        let e = pi * total as f64;
        if e >= 5.0 {
            bins.push((*o as f64, e));
        } else {
            pooled_e += e;
            pooled_o += *o as f64;
        }
    }
    if pooled_e > 0.0 || pooled_o > 0.0 {
        if pooled_e >= 5.0 || bins.is_empty() {
            bins.push((pooled_o, pooled_e));
        } else {
            let smallest = (0..bins.len())
                .min_by(|&a, &b| bins[a].1.partial_cmp(&bins[b].1).unwrap())
                .unwrap();
            bins[smallest].0 += pooled_o;
            bins[smallest].1 += pooled_e;
        }
    }
    let stat = bins.iter().map(|(o, e)| (o - e) * (o - e) / e.max(1e-300)).sum();
    (stat, bins.len().saturating_sub(1))
}

#[test]
fn sampled_token_frequencies_match_the_analytic_distribution() {
    // Significance level 0.001 per configuration, fixed seeds: deterministic.
    let weights = random_init(&ModelConfig::tiny_llama(), 5);
    let prompt = [2u32, 5, 8];
    let dm = DeviceModel::upload(client(), &weights, DType::F32, 0).unwrap();
    let logits = FullLogitsProgram::compile(&dm, 1, 3)
        .unwrap()
        .run(&dm, &prompt, &[1, 1, 1])
        .unwrap();
    let last = &logits[2 * 32..3 * 32];
    let configs = [
        sampled(0.7, 0, 1.0, 1),
        sampled(1.0, 6, 1.0, 1),
        sampled(1.5, 0, 0.75, 1),
        sampled(1.0, 10, 0.8, 1),
        // vLLM's min-p, alone and before top-p.
        SamplingParams {
            min_p: 0.3,
            ..sampled(1.0, 0, 1.0, 1)
        },
        SamplingParams {
            min_p: 0.1,
            ..sampled(1.5, 0, 0.8, 1)
        },
    ];
    let mut engine = engine_with(&weights, 16, 16, None);
    let groups = 50;
    let mut first_counts = Vec::new();
    for (c, params) in configs.iter().enumerate() {
        for g in 0..groups {
            engine
                .submit(request(g, &prompt, 16, 1000 * c as u64 + g, params.clone()))
                .unwrap();
        }
        let samples = engine.run_to_completion().unwrap();
        let mut counts = vec![0usize; 32];
        for s in &samples {
            counts[s.response_ids[0] as usize] += 1;
        }
        let p = reference_distribution(last, params);
        if params.min_p > 0.0 {
            // The test has power: min-p leaves tokens out that plain sampling keeps.
            let full = reference_distribution(
                last,
                &SamplingParams {
                    min_p: 0.0,
                    ..params.clone()
                },
            );
            let kept = |d: &[f64]| d.iter().filter(|&&x| x > 0.0).count();
            assert!(kept(&p) < kept(&full), "config {c}: min-p removed nothing: {p:?}");
        }
        for (t, (&o, &pt)) in counts.iter().zip(&p).enumerate() {
            assert!(
                pt > 0.0 || o == 0,
                "config {c}: token {t} is outside the top-k/top-p set but was sampled {o} times"
            );
        }
        let (stat, df) = chi_square(&counts, &p);
        let critical = chi2_critical_0001(df);
        assert!(df >= 2, "config {c}: too few bins ({df} degrees of freedom)");
        assert!(
            stat < critical,
            "config {c}: chi-square {stat:.1} >= {critical:.1} (df {df}); counts {counts:?}, p {p:?}"
        );
        first_counts.push(counts);
    }
    // The test has power: temperature-0.7 draws are rejected against the temperature-1.5
    // distribution.
    let wrong = reference_distribution(last, &sampled(1.5, 0, 1.0, 1));
    let (stat, df) = chi_square(&first_counts[0], &wrong);
    assert!(
        stat > chi2_critical_0001(df),
        "chi-square {stat:.1} should reject the wrong temperature"
    );
}

#[test]
fn hot_swap_restarts_in_flight_samples_on_the_new_weights() {
    let w1 = random_init(&ModelConfig::tiny_llama(), 6);
    let w2 = random_init(&ModelConfig::tiny_llama(), 7);
    let long = [3u32, 1, 4, 1, 5];
    let short = [9u32, 2, 6];
    let mut engine = engine_with(&w1, 4, 32, None);
    engine
        .submit(request(1, &long, 2, 0, SamplingParams::greedy(10)))
        .unwrap();
    engine
        .submit(request(2, &short, 1, 0, SamplingParams::greedy(2)))
        .unwrap();
    let mut done = Vec::new();
    for _ in 0..3 {
        done.extend(engine.step().unwrap());
    }
    assert_eq!(done.len(), 1, "the short request finished on the old weights");
    assert_eq!(done[0].weight_version, 1);
    assert_eq!(done[0].response_ids, greedy_reference(&w1, &short, 2));

    // Wrong weights are refused by name and change nothing.
    let wrong = {
        let mut c = ModelConfig::tiny_llama();
        c.intermediate_size = 48;
        upload_weights(client(), &random_init(&c, 1), DType::F32, 0).unwrap()
    };
    let err = engine.update_weights(9, wrong).unwrap_err().to_string();
    assert!(
        err.contains("model.layers.0.mlp.gate_proj.weight") && err.contains("[64, 32]"),
        "{err}"
    );
    assert_eq!(engine.weight_version(), 1);

    let restarted = engine
        .update_weights(2, upload_weights(client(), &w2, DType::F32, 0).unwrap())
        .unwrap();
    assert_eq!(restarted, 2);
    engine
        .submit(request(3, &short, 1, 0, SamplingParams::greedy(5)))
        .unwrap();
    let rest = engine.run_to_completion().unwrap();
    let expected_long = greedy_reference(&w2, &long, 10);
    assert_ne!(
        expected_long,
        greedy_reference(&w1, &long, 10),
        "the two models must differ"
    );
    for s in of_request(&rest, 1) {
        assert_eq!(s.weight_version, 2);
        assert_eq!(s.restarts, 1);
        assert_eq!(s.response_ids, expected_long);
    }
    let fresh = of_request(&rest, 3);
    assert_eq!(fresh[0].weight_version, 2);
    assert_eq!(fresh[0].restarts, 0);
    assert_eq!(fresh[0].response_ids, greedy_reference(&w2, &short, 5));
    assert_eq!(engine.stats().restarted_samples, 2);
}

fn word_tokenizer() -> ModelTokenizer {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..32)
        .map(|i| (format!("w{i:02}"), serde_json::json!(i)))
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w00"}
    });
    ModelTokenizer::from_json_bytes(json.to_string().as_bytes(), "test word tokenizer").unwrap()
}

#[test]
fn stop_tokens_stop_strings_and_length_limits_end_samples() {
    let weights = random_init(&ModelConfig::tiny_llama(), 8);
    let prompt = [6u32, 2, 19, 11];
    let greedy = greedy_reference(&weights, &prompt, 12);
    let mut engine = engine_with(&weights, 4, 16, Some(word_tokenizer()));

    let stop_id = greedy[3];
    let j = greedy.iter().position(|&t| t == stop_id).unwrap();
    let mut p = SamplingParams::greedy(12);
    p.stop_token_ids = vec![stop_id];
    engine.submit(request(1, &prompt, 1, 0, p)).unwrap();

    let stop_word = format!("w{:02}", greedy[5]);
    let k = greedy.iter().position(|&t| t == greedy[5]).unwrap();
    let mut p = SamplingParams::greedy(12);
    p.stop_strings = vec![stop_word.clone()];
    engine.submit(request(2, &prompt, 1, 0, p)).unwrap();

    let long_prompt: Vec<u32> = (0..14).collect();
    engine
        .submit(request(3, &long_prompt, 1, 0, SamplingParams::greedy(10)))
        .unwrap();
    let samples = engine.run_to_completion().unwrap();

    let eos = of_request(&samples, 1)[0];
    assert_eq!(eos.response_ids, greedy[..=j].to_vec());
    assert_eq!(eos.finish_reason, FinishReason::Eos(stop_id));
    let words: Vec<String> = greedy.iter().map(|t| format!("w{t:02}")).collect();
    assert_eq!(eos.text, words[..=j].join(" "));

    let stopped = of_request(&samples, 2)[0];
    assert_eq!(stopped.response_ids, greedy[..=k].to_vec());
    assert_eq!(stopped.finish_reason, FinishReason::StopString(stop_word));
    let before: String = words[..k].iter().map(|w| format!("{w} ")).collect();
    assert_eq!(stopped.text, before);

    let limited = of_request(&samples, 3)[0];
    assert_eq!(limited.finish_reason, FinishReason::MaxModelLen);
    assert_eq!(limited.finish_reason.to_string(), "length (max_model_len)");
    assert_eq!(
        stopped.finish_reason.to_string(),
        format!("stop (string \"{}\")", words[k])
    );
    assert_eq!(
        limited.response_ids.len(),
        2,
        "14 prompt tokens + 2 = max_model_len 16"
    );
}

#[test]
fn the_streaming_handle_rejects_bad_requests_and_serves_the_rest() {
    let weights = random_init(&ModelConfig::tiny_llama(), 9);
    let engine = engine_with(&weights, 2, 16, None);
    assert_eq!(engine.kv_cache_bytes(), 2 * 2 * 2 * 2 * 16 * 8 * 4);
    let handle = engine.spawn();
    handle
        .submit(request(1, &[1, 2, 3], 2, 1, sampled(1.0, 0, 1.0, 4)))
        .unwrap();
    handle
        .submit(request(2, &[1; 20], 1, 0, SamplingParams::greedy(4)))
        .unwrap();
    handle
        .submit(request(3, &[1, 2], 3, 0, SamplingParams::greedy(4)))
        .unwrap();
    handle
        .submit(request(4, &[40], 1, 0, SamplingParams::greedy(4)))
        .unwrap();
    handle
        .submit(request(5, &[7, 7], 1, 0, SamplingParams::greedy(4)))
        .unwrap();
    let mut samples = Vec::new();
    let mut rejections = Vec::new();
    while samples.len() < 3 || rejections.len() < 3 {
        match handle
            .outputs()
            .recv_timeout(std::time::Duration::from_secs(60))
            .unwrap()
        {
            EngineOutput::Sample(s) => samples.push(s),
            EngineOutput::Rejected(e) => rejections.push(e.to_string()),
        }
    }
    rejections.sort();
    assert!(
        rejections[0].contains("request 2 rejected") && rejections[0].contains("maximum model length 16"),
        "{}",
        rejections[0]
    );
    assert!(
        rejections[1].contains("request 3 rejected") && rejections[1].contains("max_num_seqs (2)"),
        "{}",
        rejections[1]
    );
    assert!(
        rejections[2].contains("request 4 rejected") && rejections[2].contains("outside the vocabulary"),
        "{}",
        rejections[2]
    );
    assert_eq!(samples.iter().filter(|s| s.request_id == 1).count(), 2);
    assert_eq!(
        of_request(&samples, 5)[0].response_ids,
        greedy_reference(&weights, &[7, 7], 4)
    );
    let engine = handle.shutdown().unwrap();
    assert!(!engine.has_work());
}

/// The real SmolLM2-135M (`scripts/setup.sh` fetches it): greedy engine output in a batch with
/// a sampled neighbour equals the model crate's step-by-step generation, and the text decodes.
#[test]
fn smollm2_greedy_matches_step_by_step_generation() {
    let host = model::programs::HostModel::load(&testkit::smollm2_gguf()).unwrap();
    let prompt = host.tokenizer.encode("The capital of France is", false).unwrap();
    let expected = greedy_reference(&host.weights, &prompt, 8);
    let mut settings = EngineConfig::new(2, 32);
    settings.eos_token_ids = host.stop_tokens();
    let mut engine = engine_of(&host.weights, DType::F32, settings, Some(host.tokenizer.clone()));
    engine
        .submit(request(1, &[1, 2, 3, 4], 1, 3, sampled(1.0, 0, 1.0, 8)))
        .unwrap();
    engine
        .submit(request(2, &prompt, 1, 0, SamplingParams::greedy(8)))
        .unwrap();
    let samples = engine.run_to_completion().unwrap();
    let greedy = of_request(&samples, 2)[0];
    let n = greedy.response_ids.len();
    assert_eq!(greedy.response_ids, expected[..n].to_vec());
    assert_eq!(
        greedy.text,
        host.tokenizer.decode(&greedy.response_ids, true).unwrap()
    );
    assert!(!greedy.text.is_empty());
}

#[test]
fn compacting_live_samples_into_slot_buckets_keeps_every_token_and_log_prob() {
    let weights = random_init(&ModelConfig::tiny_llama(), 9);
    let requests = staggered_requests();
    for dtype in [DType::F32, DType::BF16] {
        let run = |compact: bool| {
            let mut settings = EngineConfig::new(64, 64);
            settings.compact_slots = compact;
            let mut engine = engine_of(&weights, dtype, settings, None);
            let samples = generate(&mut engine, &requests);
            (samples, engine.stats().clone())
        };
        let (every_slot, full) = run(false);
        let (bucketed, compacted) = run(true);
        assert_identical(&bucketed, &every_slot, &format!("{dtype:?}"));
        assert_eq!(full.moved_rows, 0);
        assert_eq!(full.decode_rows, 64 * full.decode_steps);
        assert_eq!(compacted.decode_steps, full.decode_steps);
        assert_eq!(compacted.generated_tokens, full.generated_tokens);
        assert!(compacted.moved_rows > 0, "{dtype:?}: {compacted:?}");
        // Each step runs at most twice its live samples (or the smallest bucket kept, 16
        // rows for this 64-wide model), not all 64 slots.
        assert!(
            compacted.decode_rows <= 2 * compacted.generated_tokens + 16 * compacted.decode_steps
                && 3 * compacted.decode_rows < 2 * full.decode_rows,
            "{dtype:?}: {compacted:?} against {full:?}",
        );
    }
}

/// A request's samples keep every bit whether the engine runs it beside one other request (8
/// live samples: the 8-row slot bucket, when kept) or beside three (16: the full step). The
/// model is the chaos soak's (`tests/chaos.rs`, [`testkit::tiny_chat_weights`]): SmolLM2's
/// vocabulary over a 32-wide trunk,
/// where XLA CPU may give the 16-row step's attention softmax to YNNPACK and not the 8-row
/// step's, so a probe that reads only a few cache positions keeps a bucket that rounds
/// otherwise, and a run's samples then depend on how its requests were split over rollout
/// workers.
#[test]
fn a_requests_samples_do_not_depend_on_how_many_others_share_the_engine() {
    let weights = testkit::tiny_chat_weights();
    let requests: Vec<GenerationRequest> = (1..=4u64)
        .map(|id| {
            let prompt: Vec<u32> = (0..40).map(|t| (id as u32 * 977 + t * 131) % 49152).collect();
            request(id, &prompt, 4, 1000 + id, sampled(1.0, 0, 1.0, 12))
        })
        .collect();
    let run = |requests: &[GenerationRequest]| {
        let mut engine = engine_with(&weights, 16, 108, None);
        generate(&mut engine, requests)
    };
    let two = run(&requests[..2]);
    let four = run(&requests);
    assert_identical(&two, &four[..8], "requests 1 and 2 beside 3 and 4");
}

/// SmolLM2 in bf16 (the quickstart's model and type): a GSM8K-like spread of response
/// lengths gives bit-identical samples with and without slot buckets, and the buckets run
/// fewer rows.
#[test]
fn smollm2_slot_buckets_keep_every_token_and_log_prob_bit() {
    let host = model::programs::HostModel::load(&testkit::smollm2_gguf()).unwrap();
    let prompt = host
        .tokenizer
        .encode("Natalia sold clips to 48 of her friends", false)
        .unwrap();
    let requests: Vec<GenerationRequest> = [4usize, 20, 7, 12]
        .iter()
        .enumerate()
        .map(|(i, &len)| request(i as u64 + 1, &prompt, 4, 40 + i as u64, sampled(1.0, 0, 1.0, len)))
        .collect();
    let run = |compact: bool| {
        let mut settings = EngineConfig::new(32, 64);
        settings.compact_slots = compact;
        let mut engine = engine_of(&host.weights, DType::BF16, settings, None);
        let samples = generate(&mut engine, &requests);
        (samples, engine.stats().clone())
    };
    let (every_slot, full) = run(false);
    let (bucketed, compacted) = run(true);
    assert_identical(&bucketed, &every_slot, "SmolLM2 bf16");
    assert!(compacted.moved_rows > 0, "{compacted:?}");
    assert!(
        2 * compacted.decode_rows < full.decode_rows,
        "{compacted:?} against {full:?}"
    );
}

/// Mistral with a sliding window of 8 in an engine of 32 positions: prefill, decode (whole and
/// chunked cache) and batched prefill mask every position outside the window, and the sampled
/// tokens' log-probs equal the learner-side log-probs program's over the whole sequence.
#[test]
fn a_sliding_window_masks_prefill_and_decode_as_the_logprobs_program_does() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/fixtures/tiny/mistral/config.json");
    let mut config = ModelConfig::from_hf_file(&path).unwrap();
    config.sliding_window = Some(8);
    let weights = random_init(&config, 7);
    let requests: Vec<GenerationRequest> = (0..4)
        .map(|i| {
            request(
                i + 1,
                &[3, 4, 5, 6, 7, 8, 9, 10, 11, 12][..3 + 2 * i as usize],
                2,
                i,
                sampled(1.0, 0, 1.0, 20),
            )
        })
        .collect();
    for (kv_chunk, prefill_batch) in [(0, 1), (8, 2)] {
        let mut settings = EngineConfig::new(8, 32);
        settings.kv_chunk = kv_chunk;
        settings.prefill_batch = prefill_batch;
        let mut engine = engine_of(&weights, DType::F32, settings, None);
        let samples = generate(&mut engine, &requests);
        assert!(samples
            .iter()
            .any(|s| s.prompt_ids.len() + s.response_ids.len() > 16));
        let gap = largest_logprob_gap(&weights, DType::F32, &requests, &samples);
        assert!(
            gap < 1e-5,
            "kv_chunk {kv_chunk}: engine vs logprobs program {gap}"
        );
    }
    // The window changes what is computed: without it the same weights give other log-probs.
    let mut full = weights.clone();
    full.config.sliding_window = None;
    let mut engine = engine_of(&weights, DType::F32, EngineConfig::new(8, 32), None);
    let samples = generate(&mut engine, &requests);
    assert!(largest_logprob_gap(&full, DType::F32, &requests, &samples) > 1e-3);
}
