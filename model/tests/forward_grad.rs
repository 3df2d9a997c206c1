//! The gradient of the summed log-probabilities (`logprobs_graph`, at a temperature, over a
//! padded batch) with respect to sampled parameters of the tiny Llama, Qwen2, Qwen3 and Qwen3-MoE models
//! matches central finite differences along random unit directions, in f32.
//!
//! Tolerance: |analytic - numeric| <= 1e-2 * max(|analytic|, |numeric|) + 2e-3, with step
//! h = 0.05 along a unit-norm direction of the whole tensor (the loss is about -100 in f32,
//! so rounding contributes ~1e-4 to the numeric derivative).

use std::path::PathBuf;
use testkit::client;

use model::forward::{logprobs_graph, DecoderParams};
use model::params::param_table;
use model::programs::DeviceModel;
use model::safetensors_io::load_hf_checkpoint;
use rand::{Rng, SeedableRng};
use xla::graph::{value_and_grad, Graph};
use xla::runtime::Buffer;
use xla::DType;

const BATCH: usize = 2;
const LEN: usize = 9;

fn gradient_matches_finite_differences(family: &str, names: &[&str]) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/tiny")
        .join(family);
    let weights = load_hf_checkpoint(&dir).expect("tiny checkpoint");
    let config = weights.config.clone();
    let model = DeviceModel::upload(client(), &weights, DType::F32, 0).unwrap();
    let table = param_table(&config);
    let wrt: Vec<usize> = names
        .iter()
        .map(|n| {
            table
                .iter()
                .position(|s| s.name == *n)
                .unwrap_or_else(|| panic!("{family} has no parameter {n}"))
        })
        .collect();

    // Program 1: loss and gradients. Program 2: loss only.
    let build = |with_grad: bool| {
        let g = Graph::new(if with_grad { "lp_grad" } else { "lp_loss" });
        let p = DecoderParams::declare(&g, &config, DType::F32);
        let tokens = g.parameter("tokens", DType::I32, &[BATCH as i64, LEN as i64]);
        let mask = g.parameter("mask", DType::I32, &[BATCH as i64, LEN as i64]);
        let temp = g.parameter("temperature", DType::F32, &[]);
        let loss_of = |args: &[xla::graph::Tensor]| {
            let p = DecoderParams::from_tensors(&config, args).unwrap();
            let (lp, ent) = logprobs_graph(&g, &p, &tokens, &mask, &temp);
            // Entropy enters with a small weight so its gradient is checked too.
            &lp.sum_all() + &(&ent.sum_all() * 0.1)
        };
        let program = if with_grad {
            let (loss, grads) = value_and_grad(loss_of, &p.all, &wrt).unwrap();
            let mut outs = vec![&loss];
            outs.extend(grads.iter());
            g.build(&outs).unwrap()
        } else {
            let loss = loss_of(&p.all);
            g.build(&[&loss]).unwrap()
        };
        program.compile(client()).unwrap()
    };
    let grad_exe = build(true);
    let loss_exe = build(false);

    let tokens: Vec<i32> = vec![
        1, 17, 250, 3, 99, 383, 42, 7, 8, //
        5, 6, 7, 200, 201, 0, 0, 0, 0,
    ];
    let mask: Vec<i32> = vec![
        1, 1, 1, 1, 1, 1, 1, 1, 1, //
        1, 1, 1, 1, 1, 0, 0, 0, 0,
    ];
    let dims = [BATCH as i64, LEN as i64];
    let tb = client().buffer_from_host(&tokens, &dims, 0).unwrap();
    let mb = client().buffer_from_host(&mask, &dims, 0).unwrap();
    let temp = client().buffer_from_host(&[0.8f32], &[], 0).unwrap();
    let run = |exe: &xla::runtime::Executable, replace: Option<(usize, &Buffer)>| {
        let mut args: Vec<&Buffer> = model.weights().iter().collect();
        if let Some((i, b)) = replace {
            args[i] = b;
        }
        args.extend([&tb, &mb, &temp]);
        exe.execute(&args).unwrap()
    };
    let out = run(&grad_exe, None);
    let loss0 = out[0].to_host::<f32>().unwrap()[0];
    assert!(loss0.is_finite() && loss0 < 0.0, "{family}: loss {loss0}");

    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let h = 0.05f64;
    for (k, &index) in wrt.iter().enumerate() {
        let grad = out[1 + k].to_host::<f32>().unwrap();
        let base = weights.get(&table[index].name).unwrap().to_f32_vec();
        assert_eq!(grad.len(), base.len());
        let mut dir: Vec<f64> = (0..base.len()).map(|_| rng.random::<f64>() - 0.5).collect();
        let norm = dir.iter().map(|x| x * x).sum::<f64>().sqrt();
        dir.iter_mut().for_each(|x| *x /= norm);
        let analytic: f64 = grad.iter().zip(&dir).map(|(g, d)| *g as f64 * d).sum();
        let shape: Vec<i64> = table[index].shape.iter().map(|&d| d as i64).collect();
        let loss_at = |sign: f64| {
            let moved: Vec<f32> = base
                .iter()
                .zip(&dir)
                .map(|(w, d)| (*w as f64 + sign * h * d) as f32)
                .collect();
            let b = client().buffer_from_host(&moved, &shape, 0).unwrap();
            let o = run(&loss_exe, Some((index, &b)));
            o[0].to_host::<f32>().unwrap()[0] as f64
        };
        let numeric = (loss_at(1.0) - loss_at(-1.0)) / (2.0 * h);
        let tol = 1e-2 * analytic.abs().max(numeric.abs()) + 2e-3;
        assert!(
            (analytic - numeric).abs() <= tol,
            "{family} {}: analytic directional derivative {analytic}, finite difference {numeric}",
            table[index].name
        );
        assert!(
            analytic.abs() > 1e-3,
            "{family} {}: gradient is ~0 ({analytic}): the parameter does not reach the loss",
            table[index].name
        );
    }
}

#[test]
fn llama_logprob_gradients_match_finite_differences() {
    gradient_matches_finite_differences(
        "llama",
        &[
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.self_attn.v_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.norm.weight",
            "lm_head.weight",
        ],
    );
}

#[test]
fn qwen2_logprob_gradients_match_finite_differences() {
    gradient_matches_finite_differences(
        "qwen2",
        &[
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.1.self_attn.k_proj.bias",
            "model.layers.0.self_attn.o_proj.weight",
            "model.layers.1.mlp.gate_proj.weight",
        ],
    );
}

#[test]
fn mistral_logprob_gradients_match_finite_differences() {
    gradient_matches_finite_differences(
        "mistral",
        &[
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.self_attn.o_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.norm.weight",
            "lm_head.weight",
        ],
    );
}

/// Gemma 3: the four `1 + w` norms of a sliding and of the global layer, the GeGLU MLP, the
/// q/k norms and the tied, scaled embedding.
#[test]
fn gemma3_logprob_gradients_match_finite_differences() {
    gradient_matches_finite_differences(
        "gemma3",
        &[
            "model.embed_tokens.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.1.pre_feedforward_layernorm.weight",
            "model.layers.1.post_feedforward_layernorm.weight",
            "model.layers.2.input_layernorm.weight",
            "model.layers.1.self_attn.q_norm.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.2.self_attn.v_proj.weight",
            "model.norm.weight",
        ],
    );
}

#[test]
fn qwen3_logprob_gradients_match_finite_differences() {
    gradient_matches_finite_differences(
        "qwen3",
        &[
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.1.self_attn.k_norm.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.1.post_attention_layernorm.weight",
            "lm_head.weight",
        ],
    );
}

/// The router gets its gradient through the chosen experts' probabilities (the choice itself is
/// piecewise constant); the stacked experts through the chosen ones; layer 1 is dense.
#[test]
fn qwen3_moe_logprob_gradients_match_finite_differences() {
    gradient_matches_finite_differences(
        "qwen3_moe",
        &[
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.2.mlp.experts.down_proj",
            "model.layers.2.mlp.gate.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.layers.2.self_attn.k_norm.weight",
        ],
    );
    gradient_matches_finite_differences(
        "qwen3_moe_legacy",
        &[
            "model.layers.1.mlp.gate.weight",
            "model.layers.3.mlp.experts.gate_up_proj",
        ],
    );
}
