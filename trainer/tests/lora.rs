//! The learner with a LoRA policy (`DecoderPolicy::lora`): the adapters are its parameters, the
//! base weights its frozen tensors (`StepConfig::frozen`).
//!
//! - One update of the adapters is the full fine-tune's gradient projected onto them: with
//!   AdamW made a plain gradient step (`lr = eps`, so `m/(sqrt(v)+eps) = g/(|g|+eps) ≈ g/eps`),
//!   a full learner's step on the merged weights gives `ΔW = -G`, and the LoRA learner's step
//!   from the same point gives `ΔA = s·Bᵀ·ΔW` and `ΔB = s·ΔW·Aᵀ` (f32).
//! - The reference is the base without adapters: zero adapters as the reference parameters
//!   give the base model's log-probs, with no second copy of the weights; the current
//!   log-probs are the merged model's.
//! - With bf16 compute the base is held in bf16 and the learner's state is the adapters only.

mod support;

use model::lora::{lora_table, LoraAdapter, LoraConfig, Target};
use model::{random_init, HostTensor, ModelConfig, ModelWeights};
use support::{client, Rng};
use testkit::TinyLlama;
use trainer::config::{OptimConfig, Parallelism, PolicyLossConfig, Strategy};
use trainer::policy::DecoderPolicy;
use trainer::step::{build_train_programs, mini_batch_normalizer, Learner, MicroBatchHost, StepConfig};
use xla::DType;

const ROWS: usize = 8;
const GROUP: usize = 4;
const EPS: f64 = 1e4;

fn config() -> ModelConfig {
    TinyLlama {
        vocab: 16,
        hidden: 32,
        intermediate: 48,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        max_positions: 16,
        initializer_range: 0.1,
    }
    .config()
}

fn lora() -> LoraConfig {
    LoraConfig {
        rank: 2,
        alpha: 3.0,
        targets: vec![Target::Q, Target::V, Target::O, Target::Down],
        use_rslora: false,
    }
}

/// A PEFT-initialised adapter with `B` drawn too, so that both factors get a gradient.
fn adapter(config: &ModelConfig) -> LoraAdapter {
    adapter_of(config, &lora())
}

fn adapter_of(config: &ModelConfig, lora: &LoraConfig) -> LoraAdapter {
    let mut a = LoraAdapter::init(config, lora, 3);
    let mut rng = Rng::new(4);
    for t in a.tensors.iter_mut().filter(|t| t.name.ends_with("lora_B.weight")) {
        let v: Vec<f32> = (0..t.numel()).map(|_| rng.uniform(-0.2, 0.2) as f32).collect();
        *t = HostTensor::from_f32(t.name.clone(), t.shape.clone(), &v);
    }
    a
}

fn policy(config: &ModelConfig, lora: Option<LoraConfig>) -> DecoderPolicy {
    policy_in_blocks(config, lora, 1)
}

/// The policy with its rows in `blocks` blocks (one per data-parallel device).
fn policy_in_blocks(config: &ModelConfig, lora: Option<LoraConfig>, blocks: usize) -> DecoderPolicy {
    DecoderPolicy {
        config: config.clone(),
        prompt_len: 3,
        response_len: 2,
        micro_batch_size: ROWS,
        temperature: 1.0,
        group_size: GROUP,
        blocks,
        remat: false,
        scan: false,
        lora,
        lora_form: Default::default(),
        head: Default::default(),
        route_inputs: false,
        moe_lowering: Default::default(),
    }
}

/// A learner for `policy` from `params` (and the frozen base, with LoRA), whose AdamW step is
/// the plain gradient step `-g` (up to `|g|/EPS`).
fn learner(policy: &DecoderPolicy, params: &[Vec<f32>], base: &ModelWeights, dtype: DType) -> Learner {
    learner_over(policy, params, base, dtype, Parallelism::default())
}

/// [`learner`] laid out over the devices of `parallel` (a 4-device client).
fn learner_over(
    policy: &DecoderPolicy,
    params: &[Vec<f32>],
    base: &ModelWeights,
    dtype: DType,
    parallel: Parallelism,
) -> Learner {
    let cfg = StepConfig {
        loss: PolicyLossConfig::default(),
        optim: OptimConfig {
            lr: EPS,
            eps: EPS,
            weight_decay: 0.0,
            grad_clip: None,
            ..Default::default()
        },
        compute_dtype: dtype,
        micro_batch_size: ROWS as i64,
        response_len: 2,
        parallel,
        frozen: policy.frozen_specs(),
        value_loss: None,
    };
    let specs = policy.param_specs();
    let programs =
        build_train_programs(&cfg, &specs, &policy.input_specs(), |p, b| policy.log_probs(p, b)).unwrap();
    let client = if parallel.strategy == Strategy::Single {
        client()
    } else {
        testkit::cpu_client(4)
    };
    let mut l = Learner::new(client, programs, &specs, &cfg, params, 3).unwrap();
    if policy.lora.is_some() {
        let values: Vec<Vec<f32>> = base.tensors.iter().map(|t| t.to_f32_vec()).collect();
        l.set_frozen(&values).unwrap();
    }
    l
}

/// Two groups of four rows with fixed responses, old log-probs and advantages.
fn micro_batch(policy: &DecoderPolicy) -> MicroBatchHost {
    let prompts: [&[u32]; 2] = [&[1, 5, 6], &[1, 9]];
    let responses: [&[u32]; ROWS] = [
        &[3, 4],
        &[7],
        &[3, 2],
        &[11, 12],
        &[8, 8],
        &[2],
        &[13, 1],
        &[5, 6],
    ];
    let rows: Vec<(&[u32], &[u32])> = (0..ROWS).map(|r| (prompts[r / GROUP], responses[r])).collect();
    let packed = policy.pack(&rows).unwrap();
    let mut rng = Rng::new(9);
    let old: Vec<f32> = (0..ROWS * 2).map(|_| rng.uniform(-3.0, -1.5) as f32).collect();
    let adv: Vec<f32> = (0..ROWS * 2).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    MicroBatchHost {
        old_log_probs: old,
        advantages: adv,
        norm: mini_batch_normalizer(&packed.response_mask, 2),
        response_mask: packed.response_mask.clone(),
        inputs: packed.inputs(false),
        ..Default::default()
    }
}

fn merged(base: &ModelWeights, adapter: &LoraAdapter) -> ModelWeights {
    adapter.merge_into(client(), 0, base).unwrap()
}

/// `x [n, k] · y [k, m]` on the host.
fn matmul(x: &[f32], y: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * m];
    for i in 0..n {
        for j in 0..m {
            out[i * m + j] = (0..k).map(|t| x[i * k + t] * y[t * m + j]).sum();
        }
    }
    out
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = x[r * cols + c];
        }
    }
    out
}

fn diff(after: &[f32], before: &[f32]) -> Vec<f32> {
    after.iter().zip(before).map(|(a, b)| a - b).collect()
}

#[test]
fn a_lora_step_is_the_full_gradient_projected_onto_the_adapters() {
    let config = config();
    let base = random_init(&config, 1);
    let adapter = adapter(&config);
    let merged = merged(&base, &adapter);

    let full_policy = policy(&config, None);
    let start: Vec<Vec<f32>> = merged.tensors.iter().map(|t| t.to_f32_vec()).collect();
    let mut full = learner(&full_policy, &start, &base, DType::F32);
    let mb = full.upload_micro_batch(0, &micro_batch(&full_policy)).unwrap();
    assert!(full.step(&[mb], EPS).unwrap().update_applied);
    let full_after = full.state().unwrap().params;

    let lora_policy = policy(&config, Some(lora()));
    let start: Vec<Vec<f32>> = adapter.tensors.iter().map(|t| t.to_f32_vec()).collect();
    let mut lora_learner = learner(&lora_policy, &start, &base, DType::F32);
    let mb = lora_learner
        .upload_micro_batch(0, &micro_batch(&lora_policy))
        .unwrap();
    assert!(lora_learner.step(&[mb], EPS).unwrap().update_applied);
    let lora_after = lora_learner.state().unwrap().params;
    assert_eq!(lora_after.len(), adapter.tensors.len());

    let s = lora().scale() as f32;
    let r = lora().rank;
    for (k, spec) in lora_table(&config, &lora()).iter().enumerate() {
        let w = base.tensors.iter().position(|t| t.name == spec.base).unwrap();
        let (o, i) = (spec.b.shape[0], spec.a.shape[1]);
        let dw = diff(&full_after[w], &start_of(&merged, &spec.base));
        let (a, b) = (&start[2 * k], &start[2 * k + 1]);
        let da = diff(&lora_after[2 * k], a);
        let db = diff(&lora_after[2 * k + 1], b);
        // ΔA = s·Bᵀ·ΔW [r, in]; ΔB = s·ΔW·Aᵀ [out, r].
        let want_da: Vec<f32> = matmul(&transpose(b, o, r), &dw, r, o, i)
            .iter()
            .map(|x| s * x)
            .collect();
        let want_db: Vec<f32> = matmul(&dw, &transpose(a, r, i), o, i, r)
            .iter()
            .map(|x| s * x)
            .collect();
        for (what, got, want) in [("A", &da, &want_da), ("B", &db, &want_db)] {
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(scale > 1e-4, "{} {what}: no update", spec.base);
            let err = got.iter().zip(want).fold(0f32, |m, (g, w)| m.max((g - w).abs()));
            assert!(
                err <= 2e-3 * scale,
                "{} {what}: LoRA step differs from the projected full step by {err} (largest {scale})",
                spec.base
            );
        }
    }
}

fn start_of(weights: &ModelWeights, name: &str) -> Vec<f32> {
    weights.get(name).unwrap().to_f32_vec()
}

#[test]
fn the_reference_is_the_base_without_adapters() {
    let config = config();
    let base = random_init(&config, 2);
    let adapter = adapter(&config);
    let full_policy = policy(&config, None);
    let lora_policy = policy(&config, Some(lora()));
    let inputs = micro_batch(&lora_policy).inputs;

    let params: Vec<Vec<f32>> = adapter.tensors.iter().map(|t| t.to_f32_vec()).collect();
    let mut l = learner(&lora_policy, &params, &base, DType::F32);
    let zeros: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    l.set_reference(&zeros).unwrap();
    let reference = l.log_probs(&inputs, true).unwrap();
    let current = l.log_probs(&inputs, false).unwrap();

    let of = |weights: &ModelWeights| {
        let values: Vec<Vec<f32>> = weights.tensors.iter().map(|t| t.to_f32_vec()).collect();
        learner(&full_policy, &values, &base, DType::F32)
            .log_probs(&inputs, false)
            .unwrap()
    };
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
    assert!(close(&reference, &of(&base)), "reference {reference:?}");
    assert!(
        close(&current, &of(&merged(&base, &adapter))),
        "current {current:?}"
    );
    assert!(!close(&current, &reference), "the adapter changed nothing");

    // A learner with frozen tensors refuses to run before they are set.
    let cfg_params: Vec<Vec<f32>> = params.clone();
    let mut unset = {
        let cfg = StepConfig {
            loss: PolicyLossConfig::default(),
            optim: OptimConfig::default(),
            compute_dtype: DType::F32,
            micro_batch_size: ROWS as i64,
            response_len: 2,
            parallel: Default::default(),
            frozen: lora_policy.frozen_specs(),
            value_loss: None,
        };
        let specs = lora_policy.param_specs();
        let programs = build_train_programs(&cfg, &specs, &lora_policy.input_specs(), |p, b| {
            lora_policy.log_probs(p, b)
        })
        .unwrap();
        Learner::new(client(), programs, &specs, &cfg, &cfg_params, 3).unwrap()
    };
    let e = unset.log_probs(&inputs, false).unwrap_err().to_string();
    assert!(e.contains("frozen tensors (Learner::set_frozen)"), "{e}");
}

#[test]
fn bf16_keeps_the_base_in_bf16_and_trains_only_the_adapters() {
    let config = config();
    let base = random_init(&config, 5);
    let adapter = adapter(&config);
    let lora_policy = policy(&config, Some(lora()));
    let params: Vec<Vec<f32>> = adapter.tensors.iter().map(|t| t.to_f32_vec()).collect();
    let mut f32_learner = learner(&lora_policy, &params, &base, DType::F32);
    let mut bf16_learner = learner(&lora_policy, &params, &base, DType::BF16);
    let mb = micro_batch(&lora_policy);
    let (a, b) = (
        f32_learner.log_probs(&mb.inputs, false).unwrap(),
        bf16_learner.log_probs(&mb.inputs, false).unwrap(),
    );
    let worst = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        worst > 0.0 && worst < 0.05,
        "bf16 vs f32 log-probs differ by {worst}"
    );
    let up = bf16_learner.upload_micro_batch(0, &mb).unwrap();
    assert!(bf16_learner.step(&[up], 1e-3).unwrap().update_applied);
    let state = bf16_learner.state().unwrap();
    assert_eq!(state.params.len(), adapter.tensors.len());
    assert_ne!(state.params, params, "the adapters did not move");
}

#[test]
fn a_lora_learner_over_dp_fsdp_and_tensor_parallel_meshes_matches_one_device() {
    lora_learners_match_one_device(&config(), &lora());
    // The Qwen3-MoE fixture's architecture (experts in layers 0 and 2, layer 1 dense) with
    // adapters on its stacked experts, split by expert with them over the model axis.
    let moe = support::tiny_qwen3_moe();
    let experts = LoraConfig {
        targets: vec![
            Target::Q,
            Target::Down,
            Target::ExpertsGateUp,
            Target::ExpertsDown,
        ],
        ..lora()
    };
    lora_learners_match_one_device(&moe, &experts);
}

fn lora_learners_match_one_device(config: &ModelConfig, lora: &LoraConfig) {
    let config = config.clone();
    let base = random_init(&config, 6);
    let adapter = adapter_of(&config, lora);
    let params: Vec<Vec<f32>> = adapter.tensors.iter().map(|t| t.to_f32_vec()).collect();
    let train = |l: &mut Learner, policy: &DecoderPolicy| {
        let inputs = micro_batch(policy).inputs;
        for _ in 0..3 {
            let mb = l.upload_micro_batch(0, &micro_batch(policy)).unwrap();
            assert!(l.step(&[mb], 1e-2).unwrap().update_applied);
        }
        (l.state().unwrap().params, l.log_probs(&inputs, false).unwrap())
    };
    let one = policy(&config, Some(lora.clone()));
    let (want, want_lp) = train(&mut learner(&one, &params, &base, DType::F32), &one);
    assert_ne!(want, params, "the adapters moved");

    let tp = |devices, tensor_parallel| Parallelism {
        tensor_parallel,
        ..Parallelism::new(Strategy::Fsdp, devices)
    };
    for parallel in [
        Parallelism::new(Strategy::Dp, 2),
        Parallelism::new(Strategy::Fsdp, 2),
        Parallelism::new(Strategy::Fsdp, 4),
        tp(2, 2),
        tp(4, 2),
    ] {
        let blocks = parallel.data_devices(ROWS as i64).unwrap();
        let p = policy_in_blocks(&config, Some(lora.clone()), blocks);
        let (got, got_lp) = train(&mut learner_over(&p, &params, &base, DType::F32, parallel), &p);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                err < 1e-5,
                "{} {parallel:?}: adapter tensor {i} differs by {err}",
                config.family
            );
        }
        let err = got_lp
            .iter()
            .zip(&want_lp)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err < 1e-5, "{parallel:?}: log-probs differ by {err}");
    }
}

/// Adapters on the stacked experts are merged where each layer computes: a scanned,
/// rematerialised learner (one layer's merged experts at a time) trains as the plain one.
#[test]
fn expert_adapters_in_a_scanned_rematerialised_learner_train_as_in_a_plain_one() {
    let mut config = support::tiny_qwen3_moe();
    config.moe.as_mut().unwrap().mlp_only_layers.clear();
    let lora = LoraConfig {
        targets: vec![Target::V, Target::ExpertsGateUp, Target::ExpertsDown],
        ..lora()
    };
    let base = random_init(&config, 6);
    let adapter = adapter_of(&config, &lora);
    let params: Vec<Vec<f32>> = adapter.tensors.iter().map(|t| t.to_f32_vec()).collect();
    let train = |policy: &DecoderPolicy| {
        let mut l = learner(policy, &params, &base, DType::F32);
        for _ in 0..3 {
            let mb = l.upload_micro_batch(0, &micro_batch(policy)).unwrap();
            assert!(l.step(&[mb], 1e-2).unwrap().update_applied);
        }
        let lp = l.log_probs(&micro_batch(policy).inputs, false).unwrap();
        (l.state().unwrap().params, lp)
    };
    let plain = policy(&config, Some(lora.clone()));
    let (want, want_lp) = train(&plain);
    assert_ne!(want, params, "the adapters moved");
    let scanned = DecoderPolicy {
        scan: true,
        remat: true,
        ..plain
    };
    let (got, got_lp) = train(&scanned);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err < 1e-5, "adapter tensor {i} differs by {err}");
    }
    let err = got_lp
        .iter()
        .zip(&want_lp)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err < 1e-5, "log-probs differ by {err}");
}
