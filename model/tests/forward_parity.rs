//! Parity of the compiled decoder with Hugging Face transformers on the tiny random-weight
//! Llama (Llama 3 RoPE scaling, untied head), Qwen2 (QKV bias, tied head) and Qwen3 (q/k norm,
//! head_dim != hidden/heads) fixtures made by `model/scripts/make_tiny_models.py`, and the
//! Qwen3-MoE ones of `model/scripts/make_tiny_moe.py`:
//! - every position's logits within 1e-4 (right- and left-padded batches);
//! - log-probabilities and entropies at a temperature against the reference logits;
//! - prefill + step-by-step decode (in a multi-slot cache, other slots busy) equals the
//!   reference logits of the whole sequence.

use std::path::PathBuf;
use testkit::client;

use model::programs::{
    DecodeProgram, DeviceModel, FullLogitsProgram, KvCache, LogprobsProgram, PrefillProgram, PrefillRequest,
};
use model::safetensors_io::load_hf_checkpoint;
use xla::DType;

const TOL: f32 = 1e-4;

fn fixture_dir(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/tiny")
        .join(family)
}

/// The reference sequences and their logits `[T * vocab]`.
fn reference(family: &str) -> Vec<(Vec<u32>, Vec<f32>)> {
    let path = fixture_dir(family).join("reference.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; make it with python3 model/scripts/make_tiny_models.py",
            path.display()
        )
    });
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("reference safetensors");
    let mut out = Vec::new();
    for i in 0.. {
        let Ok(ids) = st.tensor(&format!("input_ids_{i}")) else {
            break;
        };
        let ids: Vec<u32> = ids
            .data()
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect();
        let logits: Vec<f32> = st
            .tensor(&format!("logits_{i}"))
            .unwrap()
            .data()
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        out.push((ids, logits));
    }
    assert!(!out.is_empty(), "no sequences in {}", path.display());
    out
}

fn load(family: &str) -> DeviceModel {
    let weights = load_hf_checkpoint(&fixture_dir(family)).expect("tiny checkpoint");
    DeviceModel::upload(client(), &weights, DType::F32, 0).expect("upload")
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn full_logits_match(family: &str) {
    full_logits_within(family, TOL)
}

fn full_logits_within(family: &str, tol: f32) {
    full_logits_of(family, &load(family), tol)
}

/// llama.cpp's qwen3moe GGUF of a third tiny MoE: f32 to the 1e-5, and with Q8_0
/// projections and experts to within the quantisation's error.
#[test]
fn qwen3_moe_gguf_logits_match_transformers() {
    let load = |file: &str| {
        let gguf = model::GgufFile::open(&fixture_dir("qwen3_moe_gguf").join(file)).unwrap();
        let config = model::ModelConfig::from_gguf(&gguf).unwrap();
        assert_eq!(config.family, model::Family::Qwen3Moe);
        gguf.load_weights(&config).unwrap()
    };
    let exact = load("model-f32.gguf");
    let quantised = load("model-q8_0.gguf");
    for (name, tol) in [("model-f32.gguf", 1e-5), ("model-q8_0.gguf", 0.15)] {
        let weights = if name.contains("q8") { &quantised } else { &exact };
        let device = DeviceModel::upload(client(), weights, DType::F32, 0).expect("upload");
        full_logits_of("qwen3_moe_gguf", &device, tol);
    }
    // Q8_0 rounds each value to a step of its 32-block's largest magnitude / 127: within half
    // a step of the f32 file's, the stacked gate and up halves included.
    for (q, f) in quantised.tensors.iter().zip(&exact.tensors) {
        let (q, f, name) = (q.to_f32_vec(), f.to_f32_vec(), &f.name);
        let step = f.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
        let worst = q.iter().zip(&f).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(
            worst <= 0.5 * step * 1.01,
            "{name}: {worst} off, half a step is {}",
            0.5 * step
        );
    }
}

fn full_logits_of(family: &str, model: &DeviceModel, tol: f32) {
    let vocab = model.config().vocab_size;
    let refs = reference(family);
    let len = refs.iter().map(|r| r.0.len()).max().unwrap();
    let batch = refs.len();
    let program = FullLogitsProgram::compile(model, batch, len).unwrap();
    for left_pad in [false, true] {
        let mut tokens = vec![0u32; batch * len];
        let mut mask = vec![0i32; batch * len];
        for (b, (ids, _)) in refs.iter().enumerate() {
            let off = if left_pad { len - ids.len() } else { 0 };
            for (i, &t) in ids.iter().enumerate() {
                tokens[b * len + off + i] = t;
                mask[b * len + off + i] = 1;
            }
        }
        let logits = program.run(model, &tokens, &mask).unwrap();
        for (b, (ids, want)) in refs.iter().enumerate() {
            let off = if left_pad { len - ids.len() } else { 0 };
            let start = (b * len + off) * vocab;
            let got = &logits[start..start + ids.len() * vocab];
            let d = max_abs_diff(got, want);
            assert!(
                d < tol,
                "{family} sequence {b} (left padded: {left_pad}): max |logit - transformers| = {d}"
            );
        }
    }
}

fn log_softmax(row: &[f32], temperature: f32) -> Vec<f64> {
    let x: Vec<f64> = row.iter().map(|&v| v as f64 / temperature as f64).collect();
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    x.iter().map(|v| v - lse).collect()
}

fn logprobs_match(family: &str, chunk: Option<usize>) {
    let model = load(family);
    let vocab = model.config().vocab_size;
    let refs = reference(family);
    let len = refs.iter().map(|r| r.0.len()).max().unwrap();
    let batch = refs.len();
    let program = match chunk {
        Some(c) => LogprobsProgram::compile_chunked(&model, batch, len, c).unwrap(),
        None => LogprobsProgram::compile(&model, batch, len).unwrap(),
    };
    let temperature = 0.7f32;
    let mut tokens = vec![0u32; batch * len];
    let mut mask = vec![0i32; batch * len];
    for (b, (ids, _)) in refs.iter().enumerate() {
        for (i, &t) in ids.iter().enumerate() {
            tokens[b * len + i] = t;
            mask[b * len + i] = 1;
        }
    }
    let (lp, ent) = program.run(&model, &tokens, &mask, temperature).unwrap();
    for (b, (ids, logits)) in refs.iter().enumerate() {
        for t in 0..len {
            let (want_lp, want_ent) = if t == 0 || t >= ids.len() {
                (0.0, 0.0)
            } else {
                let ls = log_softmax(&logits[(t - 1) * vocab..t * vocab], temperature);
                let e: f64 = -ls.iter().map(|l| l.exp() * l).sum::<f64>();
                (ls[ids[t] as usize], e)
            };
            let (g_lp, g_ent) = (lp[b * len + t] as f64, ent[b * len + t] as f64);
            assert!(
                (g_lp - want_lp).abs() < 2e-4 && (g_ent - want_ent).abs() < 2e-4,
                "{family} seq {b} pos {t}: logprob {g_lp} vs {want_lp}, entropy {g_ent} vs {want_ent}"
            );
        }
    }
}

fn decode_matches_prefill(family: &str) {
    let model = load(family);
    let vocab = model.config().vocab_size;
    let refs = reference(family);
    let (ids, want) = &refs[1];
    let (other, _) = &refs[0];
    let num_slots = 3;
    let max_len = 32;
    let prompt_len = 5;
    let mut cache = KvCache::new(&model, num_slots, max_len).unwrap();
    let prefill = PrefillProgram::compile(&model, 2, 8, num_slots, max_len).unwrap();
    let decode = DecodeProgram::compile(&model, num_slots, max_len).unwrap();
    // Slot 0 first holds a longer, different sequence that the new prompt must fully replace.
    let long: Vec<u32> = ids.iter().rev().take(8).cloned().collect();
    prefill
        .run(
            &model,
            &mut cache,
            &[PrefillRequest {
                slot: 0,
                tokens: &long,
            }],
        )
        .unwrap();
    // Now slot 0 gets the prompt under test and slot 2 another sequence, in one batch.
    let logits = prefill
        .run(
            &model,
            &mut cache,
            &[
                PrefillRequest {
                    slot: 0,
                    tokens: &ids[..prompt_len],
                },
                PrefillRequest {
                    slot: 2,
                    tokens: &other[..4],
                },
            ],
        )
        .unwrap();
    let d = max_abs_diff(&logits[0], &want[(prompt_len - 1) * vocab..prompt_len * vocab]);
    assert!(d < TOL, "{family} prefill last-token logits differ by {d}");
    for (other_pos, pos) in (4..).zip(prompt_len..ids.len()) {
        // Slot 1 idle; slot 2 keeps decoding its own sequence alongside.
        let steps = [
            Some((ids[pos], pos)),
            None,
            (other_pos < other.len()).then(|| (other[other_pos], other_pos)),
        ];
        let logits = decode.run(&model, &mut cache, &steps).unwrap();
        let d = max_abs_diff(&logits[..vocab], &want[pos * vocab..(pos + 1) * vocab]);
        assert!(
            d < TOL,
            "{family} decode at position {pos} differs from transformers by {d}"
        );
    }
    // The other sequence's last decode step matches its own reference too.
    let (_, other_want) = &refs[0];
    let steps = [None, None, Some((other[other.len() - 1], other.len() - 1))];
    let mut fresh = KvCache::new(&model, num_slots, max_len).unwrap();
    prefill
        .run(
            &model,
            &mut fresh,
            &[PrefillRequest {
                slot: 2,
                tokens: &other[..other.len() - 1],
            }],
        )
        .unwrap();
    let logits = decode.run(&model, &mut fresh, &steps).unwrap();
    let d = max_abs_diff(
        &logits[2 * vocab..3 * vocab],
        &other_want[(other.len() - 1) * vocab..other.len() * vocab],
    );
    assert!(d < TOL, "{family} decode in slot 2 differs by {d}");
}

#[test]
fn llama_full_logits_match_transformers() {
    full_logits_match("llama");
}

#[test]
fn qwen2_full_logits_match_transformers() {
    full_logits_match("qwen2");
}

#[test]
fn qwen3_full_logits_match_transformers() {
    full_logits_match("qwen3");
}

/// Mistral (`head_dim` 32 against hidden 64 / 4 heads, as Mistral Small's is set apart): the
/// issue's 1e-5 in f32.
#[test]
fn mistral_full_logits_match_transformers() {
    full_logits_within("mistral", 1e-5);
}

#[test]
fn mistral_logprobs_and_decode_match_transformers_and_prefill() {
    logprobs_match("mistral", Some(2));
    decode_matches_prefill("mistral");
}

/// A sliding window of 5 over sequences of up to 24 tokens: the window masks, in the full
/// forward, the log-probs and every decode step.
#[test]
fn mistral_sliding_window_matches_transformers_in_prefill_logprobs_and_decode() {
    full_logits_within("mistral_window", 1e-5);
    logprobs_match("mistral_window", None);
    decode_matches_prefill("mistral_window");
}

/// Gemma 3 (sliding, global, sliding layers; window 5 over sequences of up to 24 tokens; two
/// RoPE bases, the global one linearly scaled; `query_pre_attn_scalar` 24 against a head width
/// of 32; GeGLU; four `1 + w` norms per layer; scaled embeddings): the 1e-5 in f32, in
/// the full forward, the log-probs and every decode step.
#[test]
fn gemma3_matches_transformers_in_prefill_logprobs_and_decode() {
    full_logits_within("gemma3", 1e-5);
    logprobs_match("gemma3", Some(3));
    decode_matches_prefill("gemma3");
}

/// llama.cpp's gemma3 GGUF (norms stored plus one, its own norm names, the global layer every
/// second one from `attention.sliding_window_pattern`, linear RoPE scaling from its metadata):
/// f32 to 1e-5, Q8_0 projections within the quantisation's error.
#[test]
fn gemma3_gguf_logits_match_transformers() {
    for (file, tol) in [("model-f32.gguf", 1e-5), ("model-q8_0.gguf", 0.15)] {
        let gguf = model::GgufFile::open(&fixture_dir("gemma3_gguf").join(file)).unwrap();
        let config = model::ModelConfig::from_gguf(&gguf).unwrap();
        assert_eq!(config.family, model::Family::Gemma3);
        let safetensors = model::ModelConfig::from_hf_json(
            &serde_json::json!({
                "model_type": "gemma3_text", "vocab_size": 384, "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 32,
                "sliding_window": 5, "max_position_embeddings": 256, "bos_token_id": 1,
                "eos_token_id": 2, "pad_token_id": 0, "initializer_range": 0.02,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "rope_scaling": {"rope_type": "linear", "factor": 8.0}
            }),
            "the fixture's transformers config",
        )
        .unwrap();
        // GGUF stores the epsilon as an f32.
        assert_eq!(config.rms_norm_eps, 1e-6f32 as f64);
        let same_eps = model::ModelConfig {
            rms_norm_eps: config.rms_norm_eps,
            ..safetensors
        };
        assert_eq!(
            config, same_eps,
            "{file}: GGUF metadata read as transformers' config"
        );
        let weights = gguf.load_weights(&config).unwrap();
        let device = DeviceModel::upload(client(), &weights, DType::F32, 0).expect("upload");
        full_logits_of("gemma3_gguf", &device, tol);
    }
}

/// llama.cpp's GGUF of a Mistral model (its `llama` architecture, Q and K rows permuted, a head
/// width other than hidden / heads from `attention.key_length`): the same logits as the Mistral
/// checkpoint it was written from, f32 to 1e-5, Q8_0 projections within the quantisation's error.
#[test]
fn mistral_gguf_logits_match_transformers() {
    for (file, tol) in [("model-f32.gguf", 1e-5), ("model-q8_0.gguf", 0.15)] {
        let gguf = model::GgufFile::open(&fixture_dir("mistral_gguf").join(file)).unwrap();
        let config = model::ModelConfig::from_gguf(&gguf).unwrap();
        assert_eq!(
            (config.head_dim, config.hidden_size, config.num_attention_heads),
            (32, 64, 4)
        );
        assert!(
            !config.tie_word_embeddings,
            "{file}: the GGUF has its own output.weight"
        );
        let weights = gguf.load_weights(&config).unwrap();
        let device = DeviceModel::upload(client(), &weights, DType::F32, 0).expect("upload");
        full_logits_of("mistral", &device, tol);
    }
}

/// Qwen3-MoE, both checkpoint layouts (stacked experts with `norm_topk_prob` and a dense layer;
/// per-expert tensors without it, every other layer sparse): the 1e-5 in f32.
#[test]
fn qwen3_moe_full_logits_match_transformers() {
    full_logits_within("qwen3_moe", 1e-5);
    full_logits_within("qwen3_moe_legacy", 1e-5);
}

#[test]
fn qwen3_moe_logprobs_and_entropy_match_transformers() {
    logprobs_match("qwen3_moe", Some(3));
}

#[test]
fn qwen3_moe_decode_step_by_step_equals_prefill() {
    decode_matches_prefill("qwen3_moe");
    decode_matches_prefill("qwen3_moe_legacy");
}

#[test]
fn llama_logprobs_and_entropy_match_transformers() {
    logprobs_match("llama", None);
}

#[test]
fn qwen2_logprobs_and_entropy_match_transformers_head_in_chunks_of_5() {
    logprobs_match("qwen2", Some(5));
}

#[test]
fn qwen3_logprobs_and_entropy_match_transformers_head_in_chunks_of_1() {
    logprobs_match("qwen3", Some(1));
}

#[test]
fn llama_decode_step_by_step_equals_prefill() {
    decode_matches_prefill("llama");
}

#[test]
fn qwen2_decode_step_by_step_equals_prefill() {
    decode_matches_prefill("qwen2");
}

#[test]
fn qwen3_decode_step_by_step_equals_prefill() {
    decode_matches_prefill("qwen3");
}

#[test]
fn bad_inputs_are_refused_with_clear_messages() {
    let model = load("llama");
    let mut cache = KvCache::new(&model, 2, 16).unwrap();
    let prefill = PrefillProgram::compile(&model, 1, 8, 2, 16).unwrap();
    let long = [1u32; 9];
    let err = prefill
        .run(
            &model,
            &mut cache,
            &[PrefillRequest {
                slot: 0,
                tokens: &long,
            }],
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("prompt 0 has 9 tokens; this program takes 1 to 8"),
        "{err}"
    );
    let err = prefill
        .run(
            &model,
            &mut cache,
            &[PrefillRequest {
                slot: 5,
                tokens: &[1, 2],
            }],
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("slot 5 is out of range (cache has 2 slots)"),
        "{err}"
    );
    let err = prefill
        .run(
            &model,
            &mut cache,
            &[PrefillRequest {
                slot: 0,
                tokens: &[384],
            }],
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("token id 384 is outside the vocabulary of 384"),
        "{err}"
    );
    let decode = DecodeProgram::compile(&model, 2, 16).unwrap();
    let err = decode
        .run(&model, &mut cache, &[Some((1, 16)), None])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("slot 0: position 16 is past the cache length 16"),
        "{err}"
    );
    let mut small = KvCache::new(&model, 1, 16).unwrap();
    let err = decode.run(&model, &mut small, &[None]).unwrap_err().to_string();
    assert!(
        err.contains("compiled for a cache of 2 slots x 16 positions, given 1 x 16"),
        "{err}"
    );
}

#[test]
fn bf16_weights_give_f32_logits_close_to_transformers() {
    // bf16 weights: narrow dot operands, f32 results and f32 element-wise work. The error is
    // that of rounding the weights (~3 significant digits), far above f32's but bounded.
    let weights = load_hf_checkpoint(&fixture_dir("qwen3")).expect("tiny checkpoint");
    let model = DeviceModel::upload(client(), &weights, DType::BF16, 0).unwrap();
    let refs = reference("qwen3");
    let (ids, want) = &refs[0];
    let program = FullLogitsProgram::compile(&model, 1, ids.len()).unwrap();
    let got = program.run(&model, ids, &vec![1; ids.len()]).unwrap();
    let d = max_abs_diff(&got, want);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(
        d > 0.0 && d < 2e-2 * scale.max(1.0),
        "bf16 logits differ by {d} (logit scale {scale})"
    );
}
