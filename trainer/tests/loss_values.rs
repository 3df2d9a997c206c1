//! Every loss aggregation mode, clipping rule, KL estimator and the rollout importance weights,
//! run through the CPU plugin and checked against hand computations that follow VeRL's
//! definitions (core_algos.py), including an empty response (all-zero mask row), ratios beyond
//! both clips and negative advantages under dual clip.

mod support;

use support::{assert_close, eval, In};
use trainer::config::{KlPenalty, LossAggMode, PolicyLossConfig, PolicyLossMode};
use trainer::loss::{
    actor_loss, agg_loss, kl_penalty, policy_loss, policy_loss_gspo, policy_loss_vanilla, LossInputs,
    Normalizer,
};
use xla::graph::grad;

const B: i64 = 3;
const L: i64 = 4;
const DIMS: [i64; 2] = [B, L];

/// The shared batch. `old = -1` everywhere; `lp = old + d` with
/// row 0 (A = +1, 3 tokens): d = [ln 1.5, ln 0.5, 0]          -> ratios 1.5 (beyond 1 + 0.28), 0.5 (beyond 1 - 0.2), 1
/// row 1 (A = -2, 2 tokens): d = [ln 5, ln 0.5, 30 (padding)] -> ratio 5 (dual clip at 3), 0.5
/// row 2: an empty response (mask all 0) holding garbage values.
fn batch() -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let old = vec![-1.0; 12];
    let d = [
        1.5f64.ln(),
        0.5f64.ln(),
        0.0,
        0.0,
        5f64.ln(),
        0.5f64.ln(),
        30.0,
        0.0,
        0.3,
        -0.2,
        0.0,
        0.0,
    ];
    let lp: Vec<f64> = old.iter().zip(d).map(|(o, d)| o + d).collect();
    let adv = vec![1.0, 1.0, 1.0, 0.0, -2.0, -2.0, -2.0, 0.0, 0.7, 0.7, 0.7, 0.7];
    let mask = vec![1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    (old, lp, adv, mask)
}

fn cfg(mode: LossAggMode) -> PolicyLossConfig {
    PolicyLossConfig {
        clip_ratio_low: 0.2,
        clip_ratio_high: 0.28,
        clip_ratio_c: 3.0,
        loss_agg_mode: mode,
        ..Default::default()
    }
}

// Per-token PPO losses of the batch, by hand:
// row 0 (A = 1):  t0: l1 = -1.5, l2 = -1.28 -> max -1.28 (clipped);  t1: l1 = -0.5, l2 = -0.8 -> -0.5;
//                 t2: l1 = l2 = -1 -> -1.
// row 1 (A = -2): t0: l1 = 10, l2 = 2.56, c1 = 10, l3 = 6 -> dual clip min(6, 10) = 6 (lower clip);
//                 t1: l1 = 1.0, l2 = 1.6 -> 1.6 (clipped), min(6, 1.6) = 1.6.
const ROW0: f64 = -1.28 - 0.5 - 1.0;
const ROW1: f64 = 6.0 + 1.6;
const TOKENS: f64 = 5.0;

#[test]
fn vanilla_ppo_loss_every_aggregation_mode_and_metrics() {
    let (old, lp, adv, mask) = batch();
    let want = [
        (LossAggMode::TokenMean, (ROW0 + ROW1) / (TOKENS + 1e-8)),
        (LossAggMode::SeqMeanTokenSum, (ROW0 + ROW1) / 3.0),
        // the empty row adds 0 (VeRL would give NaN: 0/0), and counts as a sequence
        (
            LossAggMode::SeqMeanTokenMean,
            (ROW0 / 3.0 + ROW1 / 2.0 + 0.0) / 3.0,
        ),
        // VeRL divides the token sum by the padded length L = 4 only
        (LossAggMode::SeqMeanTokenSumNorm, (ROW0 + ROW1) / 4.0),
    ];
    for (mode, pg) in want {
        let out = eval(
            &[
                In::F64(&old, &DIMS),
                In::F64(&lp, &DIMS),
                In::F64(&adv, &DIMS),
                In::F64(&mask, &DIMS),
            ],
            |_, x| {
                let norm = Normalizer::local(&x[3]);
                let p = policy_loss_vanilla(&x[0], &x[1], &x[2], &x[3], &cfg(mode), &norm, None);
                vec![p.pg_loss, p.pg_clipfrac, p.pg_clipfrac_lower, p.ppo_kl]
            },
        );
        let ppo_kl = -(1.5f64 * 0.5 * 1.0 * 5.0 * 0.5).ln() / (TOKENS + 1e-8);
        assert_close(
            &format!("{mode:?}"),
            &out.concat(),
            &[pg, 2.0 / (TOKENS + 1e-8), 1.0 / (TOKENS + 1e-8), ppo_kl],
            1e-12,
        );
    }
}

#[test]
fn agg_loss_with_a_mini_batch_normaliser_adds_up_over_micro_batches() {
    // Splitting the batch into rows {0} and {1, 2} with the whole batch's normaliser gives
    // shares that sum to the whole-batch value, for every mode.
    let (_, _, _, mask) = batch();
    let loss: Vec<f64> = (0..12).map(|i| i as f64 * 0.5 - 2.0).collect();
    for mode in [
        LossAggMode::TokenMean,
        LossAggMode::SeqMeanTokenSum,
        LossAggMode::SeqMeanTokenMean,
        LossAggMode::SeqMeanTokenSumNorm,
    ] {
        let whole = eval(&[In::F64(&loss, &DIMS), In::F64(&mask, &DIMS)], |_, x| {
            vec![agg_loss(&x[0], &x[1], mode, &Normalizer::local(&x[1]))]
        });
        let mut parts = 0.0;
        for (rows, start) in [(1i64, 0usize), (2, 4)] {
            let n = (rows * L) as usize;
            let d = [rows, L];
            let out = eval(
                &[
                    In::F64(&loss[start..start + n], &d),
                    In::F64(&mask[start..start + n], &d),
                ],
                |g, x| {
                    let norm = Normalizer {
                        tokens: g.scalar(TOKENS, xla::DType::F64),
                        seqs: g.scalar(3.0, xla::DType::F64),
                        response_len: None,
                    };
                    vec![agg_loss(&x[0], &x[1], mode, &norm)]
                },
            );
            parts += out[0][0];
        }
        assert_close(&format!("{mode:?} split"), &[parts], &whole[0], 1e-12);
    }
}

#[test]
fn gspo_uses_the_sequence_level_ratio() {
    let (old, lp, adv, mask) = batch();
    let out = eval(
        &[
            In::F64(&old, &DIMS),
            In::F64(&lp, &DIMS),
            In::F64(&adv, &DIMS),
            In::F64(&mask, &DIMS),
        ],
        |_, x| {
            let norm = Normalizer::local(&x[3]);
            let c = PolicyLossConfig {
                loss_mode: PolicyLossMode::Gspo,
                ..cfg(LossAggMode::TokenMean)
            };
            let p = policy_loss_gspo(&x[0], &x[1], &x[2], &x[3], &c, &norm, None);
            vec![p.pg_loss, p.pg_clipfrac, p.pg_clipfrac_lower, p.ppo_kl]
        },
    );
    // row 0: s = exp((ln 1.5 + ln 0.5 + 0) / 3) = 0.75^(1/3), inside [0.8, 1.28] -> -A s = -s
    // row 1: s = exp((ln 5 + ln 0.5) / 2) = sqrt(2.5) = 1.58 > 1.28, A = -2:
    //        max(2 s, 2 * 1.28) = 2 s (unclipped; GSPO has no dual clip)
    // row 2: empty -> 0. Always seq-mean-token-mean, whatever loss_agg_mode says.
    let s0 = 0.75f64.powf(1.0 / 3.0);
    let s1 = 2.5f64.sqrt();
    let pg = (-s0 + 2.0 * s1 + 0.0) / 3.0;
    let ppo_kl = -(1.5f64 * 0.5 * 5.0 * 0.5).ln() / (TOKENS + 1e-8);
    assert_close("gspo", &out.concat(), &[pg, 0.0, 0.0, ppo_kl], 1e-12);
}

/// GSPO's and CISPO's gradients are not the derivative of their values (each holds a
/// stop-gradient), so they are checked against their closed forms w.r.t. the log-probs.
#[test]
fn gspo_and_cispo_gradients_follow_their_closed_forms() {
    let (old, lp, adv, mask) = batch();
    let grads = |mode: PolicyLossMode| {
        eval(
            &[
                In::F64(&old, &DIMS),
                In::F64(&lp, &DIMS),
                In::F64(&adv, &DIMS),
                In::F64(&mask, &DIMS),
            ],
            |_, x| {
                let c = PolicyLossConfig {
                    loss_mode: mode,
                    ..cfg(LossAggMode::TokenMean)
                };
                let p = policy_loss(&c, &x[0], &x[1], &x[2], &x[3], &Normalizer::local(&x[3]), None);
                grad(&p.pg_loss, &[&x[1]]).unwrap()
            },
        )
        .remove(0)
    };
    // GSPO, seq-mean-token-mean over 3 sequences: d/dlp_t = -A_i s_i m_t / (n_i 3) where the
    // sequence ratio is unclipped (rows 0 and 1 above), 0 elsewhere.
    let s0 = 0.75f64.powf(1.0 / 3.0);
    let s1 = 2.5f64.sqrt();
    let (r0, r1) = (-s0 / (3.0 * 3.0), 2.0 * s1 / (2.0 * 3.0));
    let want = [r0, r0, r0, 0.0, r1, r1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    assert_close("gspo gradient", &grads(PolicyLossMode::Gspo), &want, 1e-12);
    // CISPO, token-mean: d/dlp_t = -clamp(r_t, 0.8, 1.28) A_t m_t / (tokens + 1e-8).
    let d = TOKENS + 1e-8;
    let ratios = [1.28, 0.8, 1.0, 0.0, 1.28, 0.8];
    let mut want = vec![0.0; 12];
    for (t, r) in ratios.iter().enumerate() {
        want[t] = -r * adv[t] * mask[t] / d;
    }
    assert_close("cispo gradient", &grads(PolicyLossMode::Cispo), &want, 1e-12);
}

#[test]
fn gspo_clips_the_sequence_ratio() {
    // one row, A = +1, token log-ratios [ln 2, ln 2]: s = 2 > 1.28 -> -1.28 per token, clipped.
    let old = [-1.0, -1.0];
    let lp = [-1.0 + 2f64.ln(), -1.0 + 2f64.ln()];
    let out = eval(
        &[
            In::F64(&old, &[1, 2]),
            In::F64(&lp, &[1, 2]),
            In::F64(&[1.0, 1.0], &[1, 2]),
            In::F64(&[1.0, 1.0], &[1, 2]),
        ],
        |_, x| {
            let p = policy_loss_gspo(
                &x[0],
                &x[1],
                &x[2],
                &x[3],
                &cfg(LossAggMode::TokenMean),
                &Normalizer::local(&x[3]),
                None,
            );
            vec![p.pg_loss, p.pg_clipfrac]
        },
    );
    assert_close("gspo clipped", &out.concat(), &[-1.28, 2.0 / (2.0 + 1e-8)], 1e-12);
}

/// The rollout importance weights (computed on the host, `trainer::rollout_correction`)
/// multiply each token's policy loss and carry no gradient.
#[test]
fn rollout_importance_weights_scale_token_losses_without_gradient() {
    let (old, lp, adv, mask) = batch();
    let weights = [2.0, 0.5, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    let out = eval(
        &[
            In::F64(&old, &DIMS),
            In::F64(&lp, &DIMS),
            In::F64(&adv, &DIMS),
            In::F64(&mask, &DIMS),
            In::F64(&weights, &DIMS),
        ],
        |_, x| {
            let inputs = LossInputs {
                log_probs: x[1].clone(),
                entropy: None,
                old_log_probs: x[0].clone(),
                advantages: x[2].clone(),
                response_mask: x[3].clone(),
                ref_log_probs: None,
                rollout_is_weights: Some(x[4].clone()),
                norm: Normalizer::local(&x[3]),
            };
            let l = actor_loss(&cfg(LossAggMode::TokenMean), &inputs);
            let g = grad(&l.loss, &[&x[4]]).unwrap().remove(0);
            vec![l.policy.pg_loss, g]
        },
    );
    let pg = (-1.28 * 2.0 - 0.5 * 0.5 - 1.0 + ROW1) / (TOKENS + 1e-8);
    assert_close("weighted pg", &out[0], &[pg], 1e-12);
    assert_close("weights' gradient", &out[1], &[0.0; 12], 0.0);
}

#[test]
fn kl_estimators_match_hand_values_with_clamps() {
    // pairs (lp, ref): d = lp - ref = [0.5, -1, 25 (clamp), -25 (clamp)]
    let lp = [-1.0, -2.0, -26.0, -1.0];
    let rf = [-1.5, -1.0, -1.0, -26.0];
    let d = [0.5, -1.0, -25.0, 25.0];
    let cases = [
        (KlPenalty::K1, d.to_vec()),
        (KlPenalty::Abs, d.iter().map(|x: &f64| x.abs()).collect()),
        (KlPenalty::K2, d.iter().map(|x| 0.5 * x * x).collect()),
        // k3: x = ref - lp: [-0.5 -> e^-0.5 - 0.5, 1 -> e - 2, 25 -> 20 -> clamp 10, -25 -> -20 -> e^-20 + 19 -> 10]
        (
            KlPenalty::K3,
            vec![(-0.5f64).exp() - 0.5, 1f64.exp() - 2.0, 10.0, 10.0],
        ),
    ];
    for (kind, want) in cases {
        let out = eval(&[In::F64(&lp, &[1, 4]), In::F64(&rf, &[1, 4])], |_, x| {
            vec![kl_penalty(&x[0], &x[1], kind)]
        });
        assert_close(&format!("{kind:?}"), &out[0], &want, 1e-12);
        let host: Vec<f64> = lp
            .iter()
            .zip(&rf)
            .map(|(a, b)| trainer::advantage::kl_penalty_value(kind, *a, *b))
            .collect();
        assert_close(&format!("{kind:?} host"), &host, &want, 1e-12);
    }
}

#[test]
fn actor_loss_adds_kl_and_subtracts_entropy() {
    let (old, lp, adv, mask) = batch();
    let rf: Vec<f64> = lp.iter().map(|x| x - 0.1).collect(); // k1 = 0.1 on every token
    let ent: Vec<f64> = (0..12).map(|i| 0.1 * i as f64).collect();
    let out = eval(
        &[
            In::F64(&old, &DIMS),
            In::F64(&lp, &DIMS),
            In::F64(&adv, &DIMS),
            In::F64(&mask, &DIMS),
            In::F64(&rf, &DIMS),
            In::F64(&ent, &DIMS),
        ],
        |_, x| {
            let c = PolicyLossConfig {
                use_kl_loss: true,
                kl_loss_type: KlPenalty::K1,
                kl_loss_coef: 0.5,
                entropy_coeff: 0.01,
                ..cfg(LossAggMode::TokenMean)
            };
            let inputs = LossInputs {
                log_probs: x[1].clone(),
                entropy: Some(x[5].clone()),
                old_log_probs: x[0].clone(),
                advantages: x[2].clone(),
                response_mask: x[3].clone(),
                ref_log_probs: Some(x[4].clone()),
                rollout_is_weights: None,
                norm: Normalizer::local(&x[3]),
            };
            let l = actor_loss(&c, &inputs);
            vec![l.loss, l.kl_loss, l.entropy]
        },
    );
    let n = TOKENS + 1e-8;
    let kl = 0.1 * 5.0 / n;
    let entropy = (0.0 + 0.1 + 0.2 + 0.4 + 0.5) / n; // tokens 0, 1, 2, 4, 5
    let pg = (ROW0 + ROW1) / n;
    assert_close(
        "actor loss",
        &out.concat(),
        &[pg - 0.01 * entropy + 0.5 * kl, kl, entropy],
        1e-12,
    );
}

/// With more candidate tokens than its share, clip-cov drops exactly
/// `max(1, floor(clip_cov_ratio * tokens))` of them, and the same ones on a rerun.
#[test]
fn clip_cov_drops_exactly_its_share_and_draws_reproducibly() {
    let (b, l) = (4i64, 50i64);
    let n = (b * l) as usize;
    let mut rng = support::Rng::new(3);
    let old = rng.vec(n, -3.0, -0.5);
    // ratios within [0.9, 1.1]: the clip leaves every token alone, so all are candidates
    let lp: Vec<f64> = old.iter().map(|o| o + rng.uniform(-0.1, 0.1)).collect();
    let adv = rng.vec(n, -1.0, 1.0);
    let mask: Vec<f64> = (0..n)
        .map(|t| if t % l as usize >= 45 { 0.0 } else { 1.0 })
        .collect();
    let dims = [b, l];
    let run = || {
        eval(
            &[
                In::F64(&old, &dims),
                In::F64(&lp, &dims),
                In::F64(&adv, &dims),
                In::F64(&mask, &dims),
            ],
            |_, x| {
                let c = PolicyLossConfig {
                    loss_mode: PolicyLossMode::ClipCov,
                    clip_ratio_low: 0.2,
                    clip_ratio_high: 0.2,
                    clip_cov_ratio: 0.1,
                    clip_cov_lb: -100.0,
                    clip_cov_ub: 100.0,
                    ..Default::default()
                };
                let p = policy_loss(&c, &x[0], &x[1], &x[2], &x[3], &Normalizer::local(&x[3]), None);
                vec![p.pg_loss, p.pg_clipfrac]
            },
        )
        .concat()
    };
    let first = run();
    let tokens = 4.0 * 45.0;
    let dropped = first[1] * (tokens + 1e-8);
    assert!(
        (dropped - 18.0).abs() < 1e-6,
        "dropped {dropped} tokens, want floor(0.1 * 180) = 18"
    );
    assert_eq!(run(), first, "a rerun draws other tokens");
}
