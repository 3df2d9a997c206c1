//! Rematerialisation (`model.enable_gradient_checkpointing`) and scanned layers
//! (`model.scan_layers`): the policy's log-probs and their gradients with every decoder layer
//! recomputed in the backward pass, and with the layers traced once as a loop over their
//! stacked weights, equal those of the plain trace (f32, 1e-5) for Llama, Qwen2, Qwen3 and
//! Gemma 3 (whose scanned body picks each layer's sliding or global attention by a scanned
//! flag), through the shared-prompt packing and the whole-row path; the remat program really
//! recomputes (more products, behind optimization barriers) and the scanned one holds each
//! layer's products once. A mixture-of-experts policy replaying recorded routes (routing
//! replay) gives the same log-probs and gradients plain, recomputed and scanned, and they are
//! not those of its own routing: a recomputation that dropped the replay would fail it.

mod support;

use model::{random_init, ModelConfig};
use support::{assert_close, eval, In, Rng};
use testkit::TinyLlama;
use trainer::policy::DecoderPolicy;
use xla::graph::{grad, Graph, Tensor};
use xla::DType;

/// A tiny model of each family: Llama (3 layers), and the Qwen2 (q/k/v biases), Qwen3 (q/k
/// norms) and Gemma 3 (sliding, global and sliding layers, window 5) fixtures.
fn configs() -> Vec<ModelConfig> {
    let fixture = |family: &str| {
        let path = format!(
            "{}/../model/fixtures/tiny/{family}/config.json",
            env!("CARGO_MANIFEST_DIR")
        );
        ModelConfig::from_hf_file(std::path::Path::new(&path)).unwrap()
    };
    vec![config(), fixture("qwen2"), fixture("qwen3"), fixture("gemma3")]
}

fn config() -> ModelConfig {
    TinyLlama {
        vocab: 16,
        hidden: 32,
        intermediate: 48,
        layers: 3,
        heads: 4,
        kv_heads: 2,
        max_positions: 32,
        initializer_range: 0.2,
    }
    .config()
}

/// How the layers are traced: one trace each, rematerialised, or scanned.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layers {
    Plain,
    Remat,
    Scan,
}

fn policy(config: &ModelConfig, group_size: usize, layers: Layers) -> DecoderPolicy {
    DecoderPolicy {
        config: config.clone(),
        prompt_len: 5,
        response_len: 4,
        micro_batch_size: 4,
        temperature: 0.9,
        group_size,
        blocks: 1,
        remat: layers == Layers::Remat,
        scan: layers == Layers::Scan,
        lora: None,
        lora_form: Default::default(),
        head: Default::default(),
        route_inputs: false,
        moe_lowering: Default::default(),
    }
}

/// The log-probs `[4, L]` and the gradient of `sum(log_probs * weights)` with respect to
/// every parameter, flattened, in parameter order.
fn log_probs_and_grads(
    policy: &DecoderPolicy,
    params: &[Vec<f32>],
    batch: &[Vec<i32>],
    weights: &[f32],
) -> Vec<Vec<f64>> {
    let specs = policy.param_specs();
    let dims: Vec<Vec<i64>> = specs.iter().map(|s| s.dims()).collect();
    let input_dims: Vec<Vec<i64>> = policy.input_specs().iter().map(|s| s.dims.clone()).collect();
    let mut inputs: Vec<In> = params.iter().zip(&dims).map(|(v, d)| In::F32(v, d)).collect();
    inputs.extend(batch.iter().zip(&input_dims).map(|(v, d)| In::I32(v, d)));
    let wdims = [4i64, policy.response_len as i64];
    inputs.push(In::F32(weights, &wdims));
    let (n, b) = (params.len(), batch.len());
    eval(&inputs, |_g: &Graph, ts: &[Tensor]| {
        let out = policy.log_probs(&ts[..n], &ts[n..n + b]);
        let loss = (&out.log_probs * &ts[n + b]).sum_all();
        let wrt: Vec<&Tensor> = ts[..n].iter().collect();
        let mut outs = vec![out.log_probs.clone()];
        outs.extend(grad(&loss, &wrt).unwrap());
        outs
    })
}

#[test]
fn recomputed_and_scanned_layers_give_the_plain_log_probs_and_gradients() {
    for config in configs() {
        let params: Vec<Vec<f32>> = random_init(&config, 3)
            .tensors
            .iter()
            .map(|t| t.to_f32_vec())
            .collect();
        let mut rng = Rng::new(11);
        let weights: Vec<f32> = rng.vec(16, -1.0, 1.0).into_iter().map(|x| x as f32).collect();
        // Two prompts of 3 and 5 tokens, two responses each (of 4, 2, 3 and 1 tokens).
        let p1: &[u32] = &[1, 4, 9];
        let p2: &[u32] = &[1, 7, 2, 11, 3];
        let responses: [&[u32]; 4] = [&[5, 6, 2, 8], &[3, 3], &[12, 1, 4], &[9]];
        let rows: Vec<(&[u32], &[u32])> = vec![
            (p1, responses[0]),
            (p1, responses[1]),
            (p2, responses[2]),
            (p2, responses[3]),
        ];
        for (group, layers) in [
            (2, Layers::Remat),
            (1, Layers::Remat),
            (2, Layers::Scan),
            (1, Layers::Scan),
        ] {
            let (plain, other) = (
                policy(&config, group, Layers::Plain),
                policy(&config, group, layers),
            );
            assert_eq!(plain.shares_prompts(), group == 2);
            let batch = packed_inputs(&plain, &rows, None);
            let want = log_probs_and_grads(&plain, &params, &batch, &weights);
            let got = log_probs_and_grads(&other, &params, &batch, &weights);
            assert!(want[0].iter().any(|&x| x != 0.0));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let what = if i == 0 {
                    "log-probs".to_string()
                } else {
                    format!("gradient of parameter {}", i - 1)
                };
                assert_close(
                    &format!("{}, {layers:?}, group {group}: {what}", config.family),
                    g,
                    w,
                    1e-5,
                );
            }
        }
    }
}

/// The i32 inputs of `rows` packed by `policy` (with `routes` to replay).
fn packed_inputs(
    policy: &DecoderPolicy,
    rows: &[(&[u32], &[u32])],
    routes: Option<&[Vec<u8>]>,
) -> Vec<Vec<i32>> {
    policy
        .pack_routed(rows, routes)
        .unwrap()
        .inputs(policy.replays())
        .into_iter()
        .map(|a| match a {
            trainer::step::HostArray::I32(v) => v,
            trainer::step::HostArray::F32(_) => unreachable!("policy inputs are i32"),
        })
        .collect()
}

#[test]
fn replayed_routes_hold_through_recomputed_and_scanned_layers() {
    let mixed = support::tiny_qwen3_moe();
    // One scanned body needs every layer alike: the same model with every layer sparse.
    let mut sparse = mixed.clone();
    sparse.moe.as_mut().unwrap().mlp_only_layers.clear();
    let p1: &[u32] = &[1, 4, 9];
    let p2: &[u32] = &[1, 7, 2, 11, 3];
    let rows: Vec<(&[u32], &[u32])> = vec![(p1, &[5, 6, 2, 8]), (p1, &[3, 3]), (p2, &[12, 1, 4]), (p2, &[9])];
    let mut rng = Rng::new(5);
    let weights: Vec<f32> = rng.vec(16, -1.0, 1.0).into_iter().map(|x| x as f32).collect();
    for (config, layers) in [
        (&mixed, Layers::Remat),
        (&sparse, Layers::Remat),
        (&sparse, Layers::Scan),
    ] {
        let params: Vec<Vec<f32>> = random_init(config, 3)
            .tensors
            .iter()
            .map(|t| t.to_f32_vec())
            .collect();
        let (lm, k) = (config.moe_layers(), 2);
        // Recorded routes: each position's experts a function of the position and layer, over
        // every position but each row's last (as a rollout records them).
        let routes: Vec<Vec<u8>> = rows
            .iter()
            .map(|(p, r)| {
                (0..p.len() + r.len() - 1)
                    .flat_map(|i| (0..lm * k).map(move |j| ((3 * i + j) % 8) as u8))
                    .collect()
            })
            .collect();
        for group in [1, 2] {
            let replaying = |layers: Layers| DecoderPolicy {
                route_inputs: true,
                ..policy(config, group, layers)
            };
            let (plain, other) = (replaying(Layers::Plain), replaying(layers));
            let batch = packed_inputs(&plain, &rows, Some(&routes));
            let want = log_probs_and_grads(&plain, &params, &batch, &weights);
            let got = log_probs_and_grads(&other, &params, &batch, &weights);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_close(&format!("{layers:?}, group {group}, output {i}"), g, w, 1e-5);
            }
            // The router's own choice (nothing recorded) computes something else.
            let own = log_probs_and_grads(&plain, &params, &packed_inputs(&plain, &rows, None), &weights);
            let apart = own
                .iter()
                .flatten()
                .zip(want.iter().flatten())
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(apart > 1e-3, "replayed and own routing agree to {apart}");
        }
    }
}

#[test]
fn the_remat_program_recomputes_each_layer_and_the_scanned_one_traces_one() {
    let mlir = |layers: Layers| {
        let policy = policy(&config(), 2, layers);
        let g = Graph::new("remat_check");
        let params: Vec<Tensor> = policy
            .param_specs()
            .iter()
            .map(|s| g.parameter(&s.name, DType::F32, &s.dims()))
            .collect();
        let batch: Vec<Tensor> = policy
            .input_specs()
            .iter()
            .map(|s| g.parameter(&s.name, s.dtype, &s.dims))
            .collect();
        let loss = policy.log_probs(&params, &batch).log_probs.sum_all();
        let grads = grad(&loss, &params.iter().collect::<Vec<_>>()).unwrap();
        g.build(&grads.iter().collect::<Vec<_>>())
            .unwrap()
            .mlir()
            .to_string()
    };
    let (plain, remat, scan) = (mlir(Layers::Plain), mlir(Layers::Remat), mlir(Layers::Scan));
    let dots = |m: &str| m.matches("dot_general").count();
    let barriers = |m: &str| m.matches("optimization_barrier").count();
    // One more barrier per layer (3), and the layers' forward products traced a second time.
    assert_eq!(barriers(&remat), barriers(&plain) + 3, "{remat}");
    assert!(
        dots(&remat) > dots(&plain),
        "{} vs {}",
        dots(&remat),
        dots(&plain)
    );
    // One loop forward, one backward; the three layers' products appear once in each.
    assert_eq!(scan.matches("stablehlo.while").count(), 2, "{scan}");
    assert!(dots(&scan) < dots(&plain), "{} vs {}", dots(&scan), dots(&plain));
}
