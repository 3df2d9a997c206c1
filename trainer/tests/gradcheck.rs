//! The gradient of the full GRPO actor loss (PPO clip with clip-higher and dual clip,
//! truncated importance weights, k3 KL to a reference, entropy bonus, seq-mean-token-mean
//! aggregation), and of the same loss with every other surrogate, through a tiny
//! embedding/tanh/projection policy, against central finite differences in f64; and the
//! critic's clipped value loss through a tiny embedding/tanh/value-head model.

mod support;

use support::{client, tiny_policy, Rng};
use trainer::config::ValueLossConfig;
use trainer::config::{KlPenalty, LossAggMode, PolicyLossConfig, PolicyLossMode};
use trainer::loss::{actor_loss, value_loss, LossInputs, Normalizer};
use xla::graph::{grad, Graph, Tensor};
use xla::runtime::Buffer;
use xla::DType;

const V: i64 = 5;
const H: i64 = 3;
const B: i64 = 3;
const L: i64 = 4;

fn loss_graph(with_grad: bool, cfg: &PolicyLossConfig) -> xla::graph::Program {
    let g = Graph::new(if with_grad { "grpo_loss_grad" } else { "grpo_loss" });
    let emb = g.parameter("emb", DType::F64, &[V, H]);
    let out = g.parameter("out", DType::F64, &[H, V]);
    let ids = g.parameter("ids", DType::I32, &[B, L]);
    let targets = g.parameter("targets", DType::I32, &[B, L]);
    let bl = [B, L];
    let old = g.parameter("old", DType::F64, &bl);
    let adv = g.parameter("adv", DType::F64, &bl);
    let mask = g.parameter("mask", DType::F64, &bl);
    let reference = g.parameter("ref", DType::F64, &bl);
    let is_weights = g.parameter("is_weights", DType::F64, &bl);
    let (lp, ent) = tiny_policy(&[emb.clone(), out.clone()], &[ids, targets]);
    let inputs = LossInputs {
        log_probs: lp,
        entropy: Some(ent),
        old_log_probs: old,
        advantages: adv,
        response_mask: mask.clone(),
        ref_log_probs: Some(reference),
        rollout_is_weights: Some(is_weights),
        norm: Normalizer::local(&mask),
    };
    let loss = actor_loss(cfg, &inputs);
    let mut outs: Vec<Tensor> = vec![
        loss.loss.clone(),
        loss.policy.pg_clipfrac.clone(),
        loss.policy.pg_clipfrac_lower.clone(),
    ];
    if with_grad {
        outs.extend(grad(&loss.loss, &[&emb, &out]).unwrap());
    }
    let refs: Vec<&Tensor> = outs.iter().collect();
    g.build(&refs).unwrap()
}

fn full_loss(mode: PolicyLossMode) -> PolicyLossConfig {
    PolicyLossConfig {
        loss_mode: mode,
        clip_ratio_low: 0.2,
        clip_ratio_high: 0.28,
        clip_ratio_c: 3.0,
        loss_agg_mode: LossAggMode::SeqMeanTokenMean,
        use_kl_loss: true,
        kl_loss_coef: 0.1,
        kl_loss_type: KlPenalty::K3,
        entropy_coeff: 0.01,
        rollout_is_weights: true,
        // shares large enough that this small batch has penalised / dropped tokens
        kl_cov_ratio: 0.2,
        ppo_kl_coef: 0.5,
        clip_cov_ratio: 0.2,
        clip_cov_lb: -5.0,
        clip_cov_ub: 5.0,
        ..Default::default()
    }
}

#[test]
fn grpo_loss_gradient_matches_finite_differences() {
    let res = check_gradient(&full_loss(PolicyLossMode::Vanilla));
    // the data really exercises both clips: some tokens clipped, some under dual clip
    assert!(res[1][0] > 0.0, "no token was clipped: pick other data");
    assert!(
        res[2][0] > 0.0,
        "no token was under the dual clip: pick other data"
    );
}

/// Every other surrogate through the same policy and loss terms. GSPO and CISPO are left out:
/// their gradients are by design not the derivative of their value (a stop-gradient inside the
/// value), so finite differences cannot check them; `loss_values.rs` checks their gradients
/// against the closed forms.
#[test]
fn every_policy_loss_gradient_matches_finite_differences() {
    for mode in [
        PolicyLossMode::Sapo,
        PolicyLossMode::Gpg,
        PolicyLossMode::ClipCov,
        PolicyLossMode::KlCov,
        PolicyLossMode::GeoMean,
    ] {
        eprintln!("{mode:?}");
        let res = check_gradient(&full_loss(mode));
        if matches!(mode, PolicyLossMode::ClipCov | PolicyLossMode::GeoMean) {
            assert!(
                res[1][0] > 0.0,
                "{mode:?}: nothing clipped or dropped: pick other data"
            );
        }
    }
}

/// Runs the loss with its gradient and checks the gradient against central differences;
/// returns the outputs (loss, clip fractions, gradients).
fn check_gradient(cfg: &PolicyLossConfig) -> Vec<Vec<f64>> {
    let mut rng = Rng::new(7);
    let n = (B * L) as usize;
    let mut emb = rng.vec((V * H) as usize, -1.0, 1.0);
    let mut out = rng.vec((H * V) as usize, -1.0, 1.0);
    let ids: Vec<i32> = (0..n).map(|_| rng.below(V as u64) as i32).collect();
    let targets: Vec<i32> = (0..n).map(|_| rng.below(V as u64) as i32).collect();
    // old log-probs spread so that ratios fall inside and beyond both clips
    let mut old = rng.vec(n, -3.0, -0.7);
    // row 1 has a negative advantage: make its first tokens far less likely under the old
    // policy (ratio > clip_ratio_c = 3) so the dual clip is active there
    old[L as usize] = -5.0;
    old[L as usize + 1] = -4.5;
    let adv: Vec<f64> = (0..n).map(|i| [1.3, -0.8, 0.5][i / L as usize]).collect();
    let mask = vec![1., 1., 1., 1., 1., 1., 0., 0., 1., 1., 1., 0.];
    let reference = rng.vec(n, -2.5, -1.0);
    // Truncated token importance weights against a rollout policy off by up to 0.6 nats.
    let is_weights: Vec<f64> = old
        .iter()
        .map(|o| (o - (o + rng.uniform(-0.6, 0.6))).exp().min(1.5))
        .collect();

    let c = client();
    let up = |v: &[f64], d: &[i64]| c.buffer_from_host(v, d, 0).unwrap();
    let fixed: Vec<Buffer> = vec![
        c.buffer_from_host(&ids, &[B, L], 0).unwrap(),
        c.buffer_from_host(&targets, &[B, L], 0).unwrap(),
        up(&old, &[B, L]),
        up(&adv, &[B, L]),
        up(&mask, &[B, L]),
        up(&reference, &[B, L]),
        up(&is_weights, &[B, L]),
    ];
    let with_grad = loss_graph(true, cfg).compile(c).unwrap();
    let loss_only = loss_graph(false, cfg).compile(c).unwrap();
    let run = |exe: &xla::runtime::Executable, emb: &[f64], out: &[f64]| -> Vec<Vec<f64>> {
        let e = up(emb, &[V, H]);
        let o = up(out, &[H, V]);
        let mut args: Vec<&Buffer> = vec![&e, &o];
        args.extend(fixed.iter());
        exe.execute(&args)
            .unwrap()
            .iter()
            .map(|b| b.to_host::<f64>().unwrap())
            .collect()
    };
    let res = run(&with_grad, &emb, &out);
    eprintln!(
        "loss {} clipfrac {} clipfrac_lower {}",
        res[0][0], res[1][0], res[2][0]
    );
    let (g_emb, g_out) = (res[3].clone(), res[4].clone());
    let eps = 1e-6;
    let mut max_err: f64 = 0.0;
    let mut max_g: f64 = 0.0;
    for which in 0..2 {
        let len = if which == 0 { emb.len() } else { out.len() };
        for i in 0..len {
            let fd = {
                let p = if which == 0 { &mut emb } else { &mut out };
                let orig = p[i];
                p[i] = orig + eps;
                let plus = run(&loss_only, &emb, &out)[0][0];
                let p = if which == 0 { &mut emb } else { &mut out };
                p[i] = orig - eps;
                let minus = run(&loss_only, &emb, &out)[0][0];
                let p = if which == 0 { &mut emb } else { &mut out };
                p[i] = orig;
                (plus - minus) / (2.0 * eps)
            };
            let ad = if which == 0 { g_emb[i] } else { g_out[i] };
            max_err = max_err.max((ad - fd).abs());
            max_g = max_g.max(fd.abs());
            assert!(
                (ad - fd).abs() <= 1e-7 + 1e-6 * fd.abs(),
                "param {which} element {i}: autodiff {ad}, finite difference {fd}"
            );
        }
    }
    eprintln!("max |ad - fd| = {max_err:e}, max |fd| = {max_g}");
    assert!(max_g > 1e-3, "the gradient is trivially small");
    res
}

fn value_loss_graph(with_grad: bool, cfg: &ValueLossConfig) -> xla::graph::Program {
    let g = Graph::new(if with_grad {
        "value_loss_grad"
    } else {
        "value_loss"
    });
    let emb = g.parameter("emb", DType::F64, &[V, H]);
    let head = g.parameter("head", DType::F64, &[H, 1]);
    let ids = g.parameter("ids", DType::I32, &[B, L]);
    let bl = [B, L];
    let values = g.parameter("values", DType::F64, &bl);
    let returns = g.parameter("returns", DType::F64, &bl);
    let mask = g.parameter("mask", DType::F64, &bl);
    let vpreds = emb.take(&ids, 0).tanh().matmul(&head).reshape(&bl);
    let loss = value_loss(cfg, &vpreds, &values, &returns, &mask, &Normalizer::local(&mask));
    let mut outs = vec![loss.vf_loss.clone(), loss.vf_clipfrac.clone()];
    if with_grad {
        outs.extend(grad(&loss.vf_loss, &[&emb, &head]).unwrap());
    }
    let refs: Vec<&Tensor> = outs.iter().collect();
    g.build(&refs).unwrap()
}

/// The clipped value loss in every aggregation mode, with some predictions beyond the clip
/// (where the clipped term, constant in the parameters, takes over) and some inside.
#[test]
fn value_loss_gradient_matches_finite_differences() {
    for agg in [
        LossAggMode::TokenMean,
        LossAggMode::SeqMeanTokenSum,
        LossAggMode::SeqMeanTokenMean,
        LossAggMode::SeqMeanTokenSumNorm,
    ] {
        let cfg = ValueLossConfig {
            cliprange_value: 0.2,
            loss_agg_mode: agg,
        };
        let mut rng = Rng::new(11);
        let n = (B * L) as usize;
        let mut params = [
            rng.vec((V * H) as usize, -1.0, 1.0),
            rng.vec(H as usize, -1.0, 1.0),
        ];
        let ids: Vec<i32> = (0..n).map(|_| rng.below(V as u64) as i32).collect();
        let values = rng.vec(n, -1.0, 1.0);
        let returns = rng.vec(n, -1.5, 1.5);
        let mask = vec![1., 1., 1., 1., 1., 1., 0., 0., 1., 1., 1., 0.];
        let c = client();
        let up = |v: &[f64], d: &[i64]| c.buffer_from_host(v, d, 0).unwrap();
        let fixed = [
            c.buffer_from_host(&ids, &[B, L], 0).unwrap(),
            up(&values, &[B, L]),
            up(&returns, &[B, L]),
            up(&mask, &[B, L]),
        ];
        let with_grad = value_loss_graph(true, &cfg).compile(c).unwrap();
        let loss_only = value_loss_graph(false, &cfg).compile(c).unwrap();
        let run = |exe: &xla::runtime::Executable, p: &[Vec<f64>; 2]| -> Vec<Vec<f64>> {
            let (e, h) = (up(&p[0], &[V, H]), up(&p[1], &[H, 1]));
            let mut args: Vec<&Buffer> = vec![&e, &h];
            args.extend(fixed.iter());
            exe.execute(&args)
                .unwrap()
                .iter()
                .map(|b| b.to_host::<f64>().unwrap())
                .collect()
        };
        let res = run(&with_grad, &params);
        let clipfrac = res[1][0];
        assert!(
            clipfrac > 0.0 && clipfrac < 1.0,
            "{agg:?}: clip fraction {clipfrac}: the data must clip some tokens and not others"
        );
        let eps = 1e-6;
        let mut max_g: f64 = 0.0;
        for which in 0..2 {
            for i in 0..params[which].len() {
                let orig = params[which][i];
                params[which][i] = orig + eps;
                let plus = run(&loss_only, &params)[0][0];
                params[which][i] = orig - eps;
                let minus = run(&loss_only, &params)[0][0];
                params[which][i] = orig;
                let fd = (plus - minus) / (2.0 * eps);
                let ad = res[2 + which][i];
                max_g = max_g.max(fd.abs());
                assert!(
                    (ad - fd).abs() <= 1e-7 + 1e-6 * fd.abs(),
                    "{agg:?}: param {which} element {i}: autodiff {ad}, finite difference {fd}"
                );
            }
        }
        assert!(max_g > 1e-3, "{agg:?}: the gradient is trivially small");
    }
}
