//! Rollout correction against VeRL's `compute_rollout_correction_and_rejection_mask` on the
//! same inputs (`fixtures/verl_rollout_correction.json`, made by
//! `fixtures/make_verl_rollout_correction.py`, VeRL commit recorded in it): token and sequence
//! importance weights, with and without batch normalisation, every rejection option alone and
//! chained, and every `rollout_corr/*` metric. The inputs are f32 (as the learner holds them)
//! and both sides compute in f64, except VeRL's fractions (`bool.float().mean()`, in f32): the
//! tolerance is 1e-7 relative.

use serde_json::Value;
use trainer::rollout_correction::{correct, parse_rejection, IsLevel, RolloutCorrection};

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn close(what: &str, got: f64, want: f64) {
    assert!(
        (got - want).abs() <= 1e-7 * want.abs().max(1.0),
        "{what}: got {got}, want {want}"
    );
}

#[test]
fn weights_rejection_and_metrics_match_verls() {
    let f: Value = serde_json::from_str(include_str!("fixtures/verl_rollout_correction.json")).unwrap();
    assert_eq!(f["verl_commit"], "b178a3cd56f58b2d502255daba591e92833930a7");
    let l = f["response_len"].as_u64().unwrap() as usize;
    let f32s = |v: &Value| floats(v).into_iter().map(|x| x as f32).collect::<Vec<f32>>();
    let (old, rollout, mask) = (
        f32s(&f["old_log_prob"]),
        f32s(&f["rollout_log_prob"]),
        f32s(&f["response_mask"]),
    );
    for (k, case) in f["cases"].as_array().unwrap().iter().enumerate() {
        let c = &case["config"];
        let cfg = RolloutCorrection {
            rollout_is: c
                .get("rollout_is")
                .map(|v| serde_json::from_value::<IsLevel>(v.clone()).unwrap()),
            rollout_is_threshold: c
                .get("rollout_is_threshold")
                .and_then(Value::as_f64)
                .unwrap_or(2.0),
            rollout_is_batch_normalize: c
                .get("rollout_is_batch_normalize")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            rollout_rs: match c.get("rollout_rs") {
                Some(o) => {
                    parse_rejection(o.as_str().unwrap(), c["rollout_rs_threshold"].as_str().unwrap()).unwrap()
                }
                None => Vec::new(),
            },
        };
        let what = format!("case {k} {c}");
        let got = correct(&cfg, &old, &rollout, &mask, l).unwrap();
        match (&got.weights, case["weights"].is_null()) {
            (Some(w), false) => {
                for (t, (a, b)) in w.iter().zip(floats(&case["weights"])).enumerate() {
                    // f32 weights: relative rounding
                    assert!(
                        ((*a as f64) - b).abs() <= 1e-6 * b.abs().max(1.0),
                        "{what}: weight {t}: got {a}, want {b}"
                    );
                }
            }
            (None, true) => {}
            (w, _) => panic!("{what}: weights {w:?} vs VeRL's {}", case["weights"]),
        }
        let want_mask: Vec<f32> = f32s(&case["response_mask"]);
        assert_eq!(got.response_mask, want_mask, "{what}: response mask");
        let want = case["metrics"].as_object().unwrap();
        for (name, v) in want {
            let ours = got
                .metrics
                .get(name)
                .unwrap_or_else(|| panic!("{what}: no `{name}` among {:?}", got.metrics.keys()));
            close(&format!("{what} {name}"), *ours, v.as_f64().unwrap());
        }
        // Beyond VeRL's: only the weight statistics, which grpo reports without `rollout_is`.
        for name in got.metrics.keys() {
            assert!(
                want.contains_key(name)
                    || (cfg.rollout_is.is_none() && name.starts_with("rollout_corr/rollout_is_")),
                "{what}: `{name}` is not VeRL's"
            );
        }
    }
}
