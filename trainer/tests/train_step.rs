//! The update programs end to end on the CPU plugin with a tiny policy: accumulation over 4
//! micro-batches equals one fused step on the whole mini-batch; every step equals a plain Rust
//! clip + AdamW reference applied to the loss gradient; the numerical guard skips a NaN update
//! on the device and stops after N in a row; bf16 compute weights come back with the f32
//! masters.

mod support;

use model::{ParamKind, ParamSpec};
use support::{client, tiny_policy, Rng};
use trainer::advantage::{broadcast_over_response, grpo_outcome_advantage, GRPO_EPSILON};
use trainer::config::{KlPenalty, LossAggMode, OptimConfig, PolicyLossConfig};
use trainer::loss::{actor_loss, LossInputs, Normalizer};
use trainer::step::{
    build_train_programs, mini_batch_normalizer, HostArray, InputSpec, Learner, MicroBatchHost, PolicyOutput,
    StepConfig,
};
use trainer::TrainerError;
use xla::graph::{grad, Graph, Tensor};
use xla::runtime::Buffer;
use xla::DType;

const V: i64 = 5;
const H: i64 = 3;
const L: i64 = 4;
const MINI: i64 = 8;

fn param_specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("emb", vec![V as usize, H as usize], ParamKind::Matrix),
        ParamSpec::new("out", vec![H as usize, V as usize], ParamKind::Matrix),
    ]
}

fn input_specs(rows: i64) -> Vec<InputSpec> {
    vec![
        InputSpec {
            name: "ids".into(),
            dtype: DType::I32,
            dims: vec![rows, L],
        },
        InputSpec {
            name: "targets".into(),
            dtype: DType::I32,
            dims: vec![rows, L],
        },
    ]
}

fn policy(params: &[Tensor], batch: &[Tensor]) -> PolicyOutput {
    let (lp, ent) = tiny_policy(params, batch);
    PolicyOutput {
        log_probs: lp,
        entropy: Some(ent),
        router: None,
        chosen: None,
    }
}

fn loss_cfg(mode: LossAggMode) -> PolicyLossConfig {
    PolicyLossConfig {
        clip_ratio_low: 0.2,
        clip_ratio_high: 0.28,
        loss_agg_mode: mode,
        use_kl_loss: true,
        kl_loss_coef: 0.05,
        kl_loss_type: KlPenalty::K3,
        entropy_coeff: 0.01,
        rollout_is_weights: true,
        ..Default::default()
    }
}

fn step_cfg(loss: PolicyLossConfig, grad_clip: Option<f64>, rows: i64, dtype: DType) -> StepConfig {
    StepConfig {
        loss,
        optim: OptimConfig {
            lr: 0.05,
            weight_decay: 0.1,
            grad_clip,
            betas: [0.9, 0.99],
            ..Default::default()
        },
        compute_dtype: dtype,
        micro_batch_size: rows,
        response_len: L,
        parallel: Default::default(),
        frozen: Vec::new(),
        value_loss: None,
    }
}

/// A whole mini-batch on the host (8 rows), with GRPO advantages from rewards in two groups.
struct Data {
    params: Vec<Vec<f32>>,
    ids: Vec<i32>,
    targets: Vec<i32>,
    old: Vec<f32>,
    adv: Vec<f32>,
    mask: Vec<f32>,
    reference: Vec<f32>,
    is_weights: Vec<f32>,
}

fn data(seed: u64) -> Data {
    let mut rng = Rng::new(seed);
    let n = (MINI * L) as usize;
    let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
    let params = vec![
        f(rng.vec((V * H) as usize, -1.0, 1.0)),
        f(rng.vec((H * V) as usize, -1.0, 1.0)),
    ];
    let ids = (0..n).map(|_| rng.below(V as u64) as i32).collect();
    let targets = (0..n).map(|_| rng.below(V as u64) as i32).collect();
    let old = f(rng.vec(n, -3.0, -0.7));
    let lengths = [4usize, 1, 3, 0, 2, 4, 3, 1];
    let mask: Vec<f32> = (0..n)
        .map(|t| {
            if (t % L as usize) < lengths[t / L as usize] {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    let rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0];
    let adv = grpo_outcome_advantage(&rewards, &[0, 0, 0, 0, 1, 1, 1, 1], GRPO_EPSILON, true).unwrap();
    let adv = broadcast_over_response(&adv, &mask, L as usize).unwrap();
    let reference = f(rng.vec(n, -2.5, -1.0));
    // Token importance weights against a rollout policy off by up to 0.8 nats, truncated at 2.
    let is_weights = old
        .iter()
        .map(|o: &f32| (o - (o + rng.uniform(-0.8, 0.8) as f32)).exp().min(2.0))
        .collect();
    Data {
        params,
        ids,
        targets,
        old,
        adv,
        mask,
        reference,
        is_weights,
    }
}

/// Rows `[start, start + rows)` of the mini-batch, normalised by the whole mini-batch.
fn micro(d: &Data, start: usize, rows: usize) -> MicroBatchHost {
    let (a, b) = (start * L as usize, (start + rows) * L as usize);
    MicroBatchHost {
        old_log_probs: d.old[a..b].to_vec(),
        advantages: d.adv[a..b].to_vec(),
        response_mask: d.mask[a..b].to_vec(),
        ref_log_probs: Some(d.reference[a..b].to_vec()),
        rollout_is_weights: Some(d.is_weights[a..b].to_vec()),
        norm: mini_batch_normalizer(&d.mask, L as usize),
        inputs: vec![
            HostArray::I32(d.ids[a..b].to_vec()),
            HostArray::I32(d.targets[a..b].to_vec()),
        ],
        values: None,
        returns: None,
    }
}

fn learner(cfg: &StepConfig, d: &Data, max_nonfinite: u32) -> Learner {
    let programs =
        build_train_programs(cfg, &param_specs(), &input_specs(cfg.micro_batch_size), policy).unwrap();
    Learner::new(client(), programs, &param_specs(), cfg, &d.params, max_nonfinite).unwrap()
}

fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (*a as f64 - b).abs() <= tol * b.abs().max(1e-2),
            "{what}: element {i}: got {a}, want {b}"
        );
    }
}

#[test]
fn four_micro_batches_equal_one_fused_step() {
    for mode in [LossAggMode::TokenMean, LossAggMode::SeqMeanTokenMean] {
        let d = data(11);
        let mut whole = learner(&step_cfg(loss_cfg(mode), Some(1.0), MINI, DType::F32), &d, 3);
        let mut split = learner(&step_cfg(loss_cfg(mode), Some(1.0), 2, DType::F32), &d, 3);
        for step in 0..2 {
            let mb = whole.upload_micro_batch(0, &micro(&d, 0, MINI as usize)).unwrap();
            let a = whole.step(&[mb], 0.05).unwrap();
            let mbs: Vec<_> = (0..4)
                .map(|i| split.upload_micro_batch(i, &micro(&d, 2 * i, 2)).unwrap())
                .collect();
            let b = split.step(&mbs, 0.05).unwrap();
            assert!(a.update_applied && b.update_applied);
            for name in [
                "loss",
                "pg_loss",
                "pg_clipfrac",
                "pg_clipfrac_lower",
                "ppo_kl",
                "kl_loss",
                "entropy",
                "grad_norm",
                "lr",
            ] {
                let (x, y) = (a.get(name).unwrap(), b.get(name).unwrap());
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1e-3),
                    "{mode:?} step {step}: {name}: fused {x}, accumulated {y}"
                );
            }
            let (sa, sb) = (whole.state().unwrap(), split.state().unwrap());
            assert_eq!((sa.adam_step, sb.adam_step), (step + 1, step + 1));
            for (p, (x, y)) in sa.params.iter().zip(&sb.params).enumerate() {
                let want: Vec<f64> = x.iter().map(|v| *v as f64).collect();
                assert_close(&format!("{mode:?} step {step} param {p}"), y, &want, 1e-5);
            }
            eprintln!(
                "{mode:?} step {step}: loss {:.6} grad_norm {:.6} clipfrac {:.3}",
                a.get("loss").unwrap(),
                a.get("grad_norm").unwrap(),
                a.get("pg_clipfrac").unwrap()
            );
        }
    }
}

/// The gradient of the same actor loss at `params`, from a separately built program.
fn loss_gradient(cfg: &PolicyLossConfig, d: &Data, params: &[Vec<f32>]) -> Vec<Vec<f64>> {
    let g = Graph::new("reference_grad");
    let emb = g.parameter("emb", DType::F32, &[V, H]);
    let out = g.parameter("out", DType::F32, &[H, V]);
    let bl = [MINI, L];
    let ids = g.parameter("ids", DType::I32, &bl);
    let targets = g.parameter("targets", DType::I32, &bl);
    let names = ["old", "adv", "mask", "ref", "is_weights"];
    let t: Vec<Tensor> = names.iter().map(|n| g.parameter(n, DType::F32, &bl)).collect();
    let (lp, ent) = tiny_policy(&[emb.clone(), out.clone()], &[ids, targets]);
    let inputs = LossInputs {
        log_probs: lp,
        entropy: Some(ent),
        old_log_probs: t[0].clone(),
        advantages: t[1].clone(),
        response_mask: t[2].clone(),
        ref_log_probs: Some(t[3].clone()),
        rollout_is_weights: Some(t[4].clone()),
        norm: Normalizer::local(&t[2]),
    };
    let loss = actor_loss(cfg, &inputs);
    let grads = grad(&loss.loss, &[&emb, &out]).unwrap();
    let program = g.build(&[&grads[0], &grads[1]]).unwrap();
    let c = client();
    let bufs: Vec<Buffer> = vec![
        c.buffer_from_host(&params[0], &[V, H], 0).unwrap(),
        c.buffer_from_host(&params[1], &[H, V], 0).unwrap(),
        c.buffer_from_host(&d.ids, &bl, 0).unwrap(),
        c.buffer_from_host(&d.targets, &bl, 0).unwrap(),
        c.buffer_from_host(&d.old, &bl, 0).unwrap(),
        c.buffer_from_host(&d.adv, &bl, 0).unwrap(),
        c.buffer_from_host(&d.mask, &bl, 0).unwrap(),
        c.buffer_from_host(&d.reference, &bl, 0).unwrap(),
        c.buffer_from_host(&d.is_weights, &bl, 0).unwrap(),
    ];
    let args: Vec<&Buffer> = bufs.iter().collect();
    let out = program.compile(c).unwrap().execute(&args).unwrap();
    out.iter()
        .map(|b| {
            b.to_host::<f32>()
                .unwrap()
                .into_iter()
                .map(|x| x as f64)
                .collect()
        })
        .collect()
}

#[test]
fn every_step_equals_a_plain_rust_clip_and_adamw_reference() {
    let d = data(5);
    let loss = loss_cfg(LossAggMode::TokenMean);
    let max_norm = 0.05; // small enough that every step clips
    let cfg = step_cfg(loss.clone(), Some(max_norm), MINI, DType::F32);
    let mut l = learner(&cfg, &d, 3);
    let o = &cfg.optim;
    let (b1, b2, eps, wd) = (o.betas[0], o.betas[1], o.eps, o.weight_decay);
    let lrs = [0.05, 0.03, 0.01, 0.02];
    for (step, lr) in lrs.iter().enumerate() {
        let before = l.state().unwrap();
        let g = loss_gradient(&loss, &d, &before.params);
        // plain Rust: global norm, clip_grad_norm_, torch AdamW
        let norm = g.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        let t = (before.adam_step + 1) as f64;
        let mb = l.upload_micro_batch(0, &micro(&d, 0, MINI as usize)).unwrap();
        let metrics = l.step(&[mb], *lr).unwrap();
        let after = l.state().unwrap();
        assert!(
            (metrics.get("grad_norm").unwrap() - norm).abs() <= 1e-4 * norm,
            "step {step}: reported pre-clip norm {:?} vs {norm}",
            metrics.get("grad_norm")
        );
        assert!(
            norm > max_norm,
            "step {step}: norm {norm} does not exercise clipping"
        );
        assert_eq!(after.adam_step, step as i32 + 1);
        for (p, gp) in g.iter().enumerate() {
            let (mut want_p, mut want_m, mut want_v) = (Vec::new(), Vec::new(), Vec::new());
            for (i, gi) in gp.iter().enumerate() {
                let gi = gi * coef;
                let m = b1 * before.m[p][i] as f64 + (1.0 - b1) * gi;
                let v = b2 * before.v[p][i] as f64 + (1.0 - b2) * gi * gi;
                let decayed = before.params[p][i] as f64 * (1.0 - lr * wd);
                let denom = v.sqrt() / (1.0 - b2.powf(t)).sqrt() + eps;
                want_p.push(decayed - lr / (1.0 - b1.powf(t)) * m / denom);
                want_m.push(m);
                want_v.push(v);
            }
            // relative 1e-4 (f32 program vs f64 reference, gradients from two programs)
            let rel = |what: &str, got: &[f32], want: &[f64], floor: f64| {
                for (i, (a, b)) in got.iter().zip(want).enumerate() {
                    let err = (*a as f64 - b).abs();
                    assert!(
                        err <= 1e-4 * b.abs() + floor,
                        "step {step} {what} {p}[{i}]: got {a}, want {b}"
                    );
                }
            };
            rel("param", &after.params[p], &want_p, 1e-7);
            rel("adam_m", &after.m[p], &want_m, 1e-10);
            rel("adam_v", &after.v[p], &want_v, 1e-14);
        }
    }
}

#[test]
fn a_nan_batch_skips_the_update_and_repeated_ones_stop_the_run() {
    let d = data(3);
    let cfg = step_cfg(loss_cfg(LossAggMode::TokenMean), Some(1.0), MINI, DType::F32);
    let mut l = learner(&cfg, &d, 2);
    let mut bad = micro(&d, 0, MINI as usize);
    bad.advantages[0] = f32::NAN; // row 0 token 0 is a response token
    let good = micro(&d, 0, MINI as usize);

    let before = l.state().unwrap();
    let m = l.step(&[l.upload_micro_batch(0, &bad).unwrap()], 0.05).unwrap();
    assert!(!m.update_applied);
    assert!(
        m.nonfinite_terms.contains(&"pg_loss") && m.nonfinite_terms.contains(&"grad_norm"),
        "{:?}",
        m.nonfinite_terms
    );
    assert!(
        !m.nonfinite_terms.contains(&"kl_loss") && !m.nonfinite_terms.contains(&"entropy"),
        "{:?}",
        m.nonfinite_terms
    );
    assert_eq!(
        l.state().unwrap(),
        before,
        "parameters or optimizer state changed on a skipped update"
    );

    let m = l.step(&[l.upload_micro_batch(0, &good).unwrap()], 0.05).unwrap();
    assert!(m.update_applied);
    assert_ne!(l.state().unwrap().params, before.params);

    let m = l.step(&[l.upload_micro_batch(0, &bad).unwrap()], 0.05).unwrap();
    assert!(!m.update_applied);
    let err = l
        .step(&[l.upload_micro_batch(0, &bad).unwrap()], 0.05)
        .unwrap_err();
    assert!(
        matches!(
            err,
            TrainerError::NonFinite {
                step: 3,
                consecutive: 2,
                limit: 2,
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.starts_with("step 3: the update was skipped 2 times in a row (limit 2)")
            && msg.contains("pg_loss"),
        "{msg}"
    );

    // the accumulation path guards the same way: one NaN micro-batch out of two
    let cfg2 = step_cfg(loss_cfg(LossAggMode::TokenMean), Some(1.0), 4, DType::F32);
    let mut l2 = learner(&cfg2, &d, 5);
    let before = l2.state().unwrap();
    let mut first = micro(&d, 0, 4);
    first.advantages[0] = f32::NAN;
    let mbs = vec![
        l2.upload_micro_batch(0, &first).unwrap(),
        l2.upload_micro_batch(1, &micro(&d, 4, 4)).unwrap(),
    ];
    let m = l2.step(&mbs, 0.05).unwrap();
    assert!(!m.update_applied && m.nonfinite_terms.contains(&"pg_loss"));
    assert_eq!(l2.state().unwrap(), before);
    // and the accumulators were reset: a clean step afterwards matches a fresh learner's
    let mbs = vec![
        l2.upload_micro_batch(0, &micro(&d, 0, 4)).unwrap(),
        l2.upload_micro_batch(1, &micro(&d, 4, 4)).unwrap(),
    ];
    let after_skip = l2.step(&mbs, 0.05).unwrap();
    let mut fresh = learner(&cfg2, &d, 5);
    let mbs = vec![
        fresh.upload_micro_batch(0, &micro(&d, 0, 4)).unwrap(),
        fresh.upload_micro_batch(1, &micro(&d, 4, 4)).unwrap(),
    ];
    let clean = fresh.step(&mbs, 0.05).unwrap();
    assert_eq!(after_skip.values, clean.values);
    assert_eq!(l2.state().unwrap(), fresh.state().unwrap());
}

#[test]
fn bf16_compute_weights_come_back_with_f32_masters() {
    let d = data(9);
    let cfg = step_cfg(loss_cfg(LossAggMode::TokenMean), Some(1.0), MINI, DType::BF16);
    let mut l = learner(&cfg, &d, 3);
    assert!(l.compute_params().is_none());
    let m = l
        .step(
            &[l.upload_micro_batch(0, &micro(&d, 0, MINI as usize)).unwrap()],
            0.05,
        )
        .unwrap();
    assert!(m.update_applied && m.get("loss").unwrap().is_finite());
    let masters = l.state().unwrap().params;
    let bf = l.compute_params().expect("bf16 parameters after an update");
    for (p, b) in masters.iter().zip(bf) {
        assert_eq!(b.dtype(), DType::BF16);
        let got = b.to_host::<half::bf16>().unwrap();
        let want: Vec<half::bf16> = p.iter().map(|x| half::bf16::from_f32(*x)).collect();
        assert_eq!(got, want);
    }
    assert_ne!(masters, d.params);
}

#[test]
fn mismatched_micro_batches_are_refused_by_name() {
    let d = data(1);
    let cfg = step_cfg(loss_cfg(LossAggMode::TokenMean), Some(1.0), MINI, DType::F32);
    let l = learner(&cfg, &d, 3);
    let mut mb = micro(&d, 0, MINI as usize);
    mb.rollout_is_weights = None;
    let err = l.upload_micro_batch(2, &mb).err().unwrap().to_string();
    assert_eq!(
        err,
        "micro-batch 2: rollout_is_weights is required by this configuration but was not given"
    );
    let mut mb = micro(&d, 0, MINI as usize);
    mb.inputs[1] = HostArray::I32(vec![0; 3]);
    let err = l.upload_micro_batch(0, &mb).err().unwrap().to_string();
    assert_eq!(
        err,
        "micro-batch 0: input targets is i32 with 3 values; expected i32[8, 4] (32 values)"
    );
    let bad = PolicyLossConfig {
        clip_ratio_c: 0.5,
        ..loss_cfg(LossAggMode::TokenMean)
    };
    let err = build_train_programs(
        &step_cfg(bad, None, 2, DType::F32),
        &param_specs(),
        &input_specs(2),
        policy,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("actor.clip_ratio_c"), "{err}");
}

#[test]
fn resuming_from_a_checkpoint_continues_identically() {
    use trainer::checkpoint::{latest_checkpoint, load_checkpoint, save_checkpoint, TrainerState};
    use trainer::step::LearnerState;
    let d = data(21);
    let cfg = step_cfg(loss_cfg(LossAggMode::TokenMean), Some(1.0), MINI, DType::F32);
    let batches: Vec<MicroBatchHost> = (0..4).map(|s| micro(&data(100 + s), 0, MINI as usize)).collect();
    let lrs = [0.05, 0.04, 0.03, 0.02];
    let out = tempfile::tempdir().unwrap();

    let mut a = learner(&cfg, &d, 3);
    let mut metrics_a = Vec::new();
    for (s, (mb, lr)) in batches.iter().zip(lrs).enumerate() {
        metrics_a.push(a.step(&[a.upload_micro_batch(0, mb).unwrap()], lr).unwrap());
        if s == 1 {
            let state = TrainerState {
                step: 2,
                weight_version: 2,
                rng_state: serde_json::json!({"seed": 1}),
                sampler_position: serde_json::json!({"index": 16}),
                extra: serde_json::Value::Null,
            };
            save_checkpoint(
                out.path(),
                &state,
                &a.state().unwrap().to_tensor_files(&param_specs()),
                Some(1),
            )
            .unwrap();
        }
    }

    let dir = latest_checkpoint(out.path()).unwrap().expect("a checkpoint");
    let ck = load_checkpoint(&dir).unwrap();
    assert_eq!(ck.state.step, 2);
    let restored = LearnerState::from_checkpoint(&ck, &param_specs()).unwrap();
    assert_eq!(restored.adam_step, 2);
    let programs = build_train_programs(&cfg, &param_specs(), &input_specs(MINI), policy).unwrap();
    let mut b = Learner::from_state(client(), programs, &param_specs(), &cfg, &restored, 3).unwrap();
    for (s, (mb, lr)) in batches.iter().zip(lrs).enumerate().skip(2) {
        let m = b.step(&[b.upload_micro_batch(0, mb).unwrap()], lr).unwrap();
        assert_eq!(
            m.values, metrics_a[s].values,
            "step {s} metrics differ after resume"
        );
    }
    assert_eq!(b.state().unwrap(), a.state().unwrap());

    // a checkpoint for another model is refused by tensor name
    let other = vec![ParamSpec::new(
        "lm_head",
        vec![H as usize, V as usize],
        ParamKind::Matrix,
    )];
    let err = LearnerState::from_checkpoint(&ck, &other)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("params.safetensors: tensor lm_head is missing"),
        "{err}"
    );
}
