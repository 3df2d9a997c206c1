//! Every advantage estimator (GAE included), policy loss and the critic's value loss against
//! VeRL's own function on the same inputs:
//! `fixtures/verl_algorithms.json` holds VeRL's outputs, made by
//! `fixtures/make_verl_algorithms.py` (VeRL commit recorded in the fixture).
//!
//! Tolerances: the estimators take their token rewards as f32 (as the learner holds them), so
//! they agree to 1e-5 relative; the losses run in f64 here and agree to 1e-8 (VeRL's
//! `token-mean` divides by the raw token count, grpo by `count + 1e-8`).

mod support;

use serde_json::Value;
use support::{assert_close, eval, In};
use trainer::advantage::compute_advantages;
use trainer::config::ValueLossConfig;
use trainer::config::{AdvantageConfig, AdvantageEstimator, LossAggMode, PolicyLossConfig, PolicyLossMode};
use trainer::loss::{policy_loss, value_loss, Normalizer};

const VERL_COMMIT: &str = "b178a3cd56f58b2d502255daba591e92833930a7";

fn fixture() -> Value {
    let v: Value =
        serde_json::from_str(include_str!("fixtures/verl_algorithms.json")).expect("fixture parses");
    assert_eq!(v["verl_commit"], VERL_COMMIT);
    v
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn name<T: serde::de::DeserializeOwned>(v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{v}: {e}"))
}

#[test]
fn every_estimator_matches_verls() {
    let f = fixture();
    let mut seen = std::collections::BTreeSet::new();
    for (k, case) in f["estimators"].as_array().unwrap().iter().enumerate() {
        let estimator: AdvantageEstimator = name(&case["estimator"]);
        seen.insert(case["estimator"].as_str().unwrap().to_string());
        let cfg = AdvantageConfig {
            estimator,
            norm_adv_by_std_in_grpo: case["norm_adv_by_std_in_grpo"].as_bool().unwrap(),
            gamma: case["gamma"].as_f64().unwrap(),
            lam: case.get("lam").and_then(Value::as_f64).unwrap_or(1.0),
        };
        let rewards: Vec<f32> = floats(&case["token_level_rewards"])
            .iter()
            .map(|x| *x as f32)
            .collect();
        let mask: Vec<f32> = floats(&case["response_mask"]).iter().map(|x| *x as f32).collect();
        let index: Vec<u64> = case["index"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let l = mask.len() / index.len();
        let baselines = (!case["reward_baselines"].is_null()).then(|| floats(&case["reward_baselines"]));
        let values: Option<Vec<f32>> = case
            .get("values")
            .map(|v| floats(v).iter().map(|x| *x as f32).collect());
        let got = compute_advantages(
            &cfg,
            &rewards,
            &mask,
            l,
            &index,
            baselines.as_deref(),
            values.as_deref(),
        )
        .unwrap();
        let what = format!("case {k} ({})", case["estimator"]);
        assert_close(
            &format!("{what} advantages"),
            &got.advantages,
            &floats(&case["advantages"]),
            1e-5,
        );
        assert_close(
            &format!("{what} returns"),
            &got.returns,
            &floats(&case["returns"]),
            1e-5,
        );
    }
    let want = [
        "gae",
        "gpg",
        "grpo",
        "grpo_passk",
        "opo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "rloo",
    ];
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), want);
}

#[test]
fn every_policy_loss_matches_verls() {
    let f = fixture();
    let mut seen = std::collections::BTreeSet::new();
    for (k, case) in f["losses"].as_array().unwrap().iter().enumerate() {
        let mode: PolicyLossMode = name(&case["loss_mode"]);
        seen.insert(case["loss_mode"].as_str().unwrap().to_string());
        let agg: LossAggMode = name(&case["loss_agg_mode"]);
        let knobs = &case["policy_loss"];
        let num = |v: &Value| v.as_f64().unwrap();
        let cfg = PolicyLossConfig {
            loss_mode: mode,
            loss_agg_mode: agg,
            clip_ratio_low: num(&case["clip_ratio_low"]),
            clip_ratio_high: num(&case["clip_ratio_high"]),
            tau_pos: num(&case["tau_pos"]),
            tau_neg: num(&case["tau_neg"]),
            clip_cov_ratio: num(&knobs["clip_cov_ratio"]),
            clip_cov_lb: num(&knobs["clip_cov_lb"]),
            clip_cov_ub: num(&knobs["clip_cov_ub"]),
            kl_cov_ratio: num(&knobs["kl_cov_ratio"]),
            ppo_kl_coef: num(&knobs["ppo_kl_coef"]),
            ..Default::default()
        };
        let mask = floats(&case["response_mask"]);
        let rows = 12i64;
        let dims = [rows, mask.len() as i64 / rows];
        let (old, lp, adv) = (
            floats(&case["old_log_prob"]),
            floats(&case["log_prob"]),
            floats(&case["advantages"]),
        );
        let weights = (!case["rollout_is_weights"].is_null()).then(|| floats(&case["rollout_is_weights"]));
        let mut inputs = vec![
            In::F64(&old, &dims),
            In::F64(&lp, &dims),
            In::F64(&adv, &dims),
            In::F64(&mask, &dims),
        ];
        if let Some(w) = &weights {
            inputs.push(In::F64(w, &dims));
        }
        let out = eval(&inputs, |_, t| {
            let norm = Normalizer::local(&t[3]);
            let p = policy_loss(&cfg, &t[0], &t[1], &t[2], &t[3], &norm, t.get(4));
            vec![p.pg_loss, p.pg_clipfrac, p.pg_clipfrac_lower, p.ppo_kl]
        });
        let what = format!("case {k} ({mode:?}, {agg:?}, weights: {})", weights.is_some());
        assert_close(
            &format!("{what} pg_loss"),
            &out[0],
            &[num(&case["pg_loss"])],
            1e-8,
        );
        for (i, metric) in ["pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"].iter().enumerate() {
            if let Some(want) = case["metrics"].get(*metric) {
                assert_close(&format!("{what} {metric}"), &out[i + 1], &[num(want)], 1e-8);
            }
        }
    }
    let want = [
        "cispo", "clip_cov", "geo_mean", "gpg", "kl_cov", "sapo", "vanilla",
    ];
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), want);
}

#[test]
fn the_value_loss_matches_verls() {
    let f = fixture();
    let cases = f["value_losses"].as_array().unwrap();
    let mut modes = std::collections::BTreeSet::new();
    for (k, case) in cases.iter().enumerate() {
        let agg: LossAggMode = name(&case["loss_agg_mode"]);
        modes.insert(case["loss_agg_mode"].as_str().unwrap().to_string());
        let cfg = ValueLossConfig {
            cliprange_value: case["cliprange_value"].as_f64().unwrap(),
            loss_agg_mode: agg,
        };
        let mask = floats(&case["response_mask"]);
        let rows = 12i64;
        let dims = [rows, mask.len() as i64 / rows];
        let (vpreds, values, returns) = (
            floats(&case["vpreds"]),
            floats(&case["values"]),
            floats(&case["returns"]),
        );
        let inputs = [
            In::F64(&vpreds, &dims),
            In::F64(&values, &dims),
            In::F64(&returns, &dims),
            In::F64(&mask, &dims),
        ];
        let out = eval(&inputs, |_, t| {
            let v = value_loss(&cfg, &t[0], &t[1], &t[2], &t[3], &Normalizer::local(&t[3]));
            vec![v.vf_loss, v.vf_clipfrac]
        });
        let what = format!("case {k} ({agg:?}, cliprange_value {})", cfg.cliprange_value);
        let want = |key: &str| [case[key].as_f64().unwrap()];
        assert_close(&format!("{what} vf_loss"), &out[0], &want("vf_loss"), 1e-8);
        assert_close(
            &format!("{what} vf_clipfrac"),
            &out[1],
            &want("vf_clipfrac"),
            1e-8,
        );
    }
    assert_eq!(modes.len(), 4, "every aggregation mode is covered");
}
