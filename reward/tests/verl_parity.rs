//! Table-driven parity with VeRL's scorers.
//!
//! Every expected value in `fixtures/verl_expectations.json` was produced by running VeRL's own
//! Python functions — `gsm8k.compute_score` (strict and flexible, `format_score=0.1`),
//! `math_reward.compute_score` and `math_dapo.compute_score` from
//! `verl/utils/reward_score/` of volcengine/verl at commit
//! b178a3cd56f58b2d502255daba591e92833930a7 — with `fixtures/make_verl_expectations.py`
//! (which lists the inputs and says how to regenerate the file). The cases cover negative
//! numbers, decimals, thousands separators, several `####`, no answer, the 300-character window,
//! nested `\boxed`, `\frac` vs `/`, `\text{}` units, LaTeX spacing, `\left`/`\right`, degrees,
//! percentages, `\fbox`, and inputs on which VeRL's normalisation raises.

use reward::gsm8k::{self, Gsm8kMethod};
use reward::{math, math_dapo};

#[derive(serde::Deserialize)]
struct Expectations {
    verl_commit: String,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    scorer: String,
    response: String,
    ground_truth: String,
    expected: f64,
    #[serde(default)]
    pred: Option<String>,
}

fn expectations() -> Expectations {
    serde_json::from_str(include_str!("fixtures/verl_expectations.json")).expect("fixture parses")
}

#[test]
fn every_scorer_matches_verl_on_every_case() {
    let expectations = expectations();
    assert_eq!(
        expectations.verl_commit,
        "b178a3cd56f58b2d502255daba591e92833930a7"
    );
    let mut counts = std::collections::BTreeMap::new();
    let mut mismatches = Vec::new();
    for case in &expectations.cases {
        let (actual, prediction) = match case.scorer.as_str() {
            "gsm8k_strict" => (
                gsm8k::compute_score(&case.response, &case.ground_truth, Gsm8kMethod::Strict, 0.1, 1.0),
                None,
            ),
            "gsm8k_flexible" => (
                gsm8k::compute_score(
                    &case.response,
                    &case.ground_truth,
                    Gsm8kMethod::Flexible,
                    0.1,
                    1.0,
                ),
                None,
            ),
            "math" => (math::compute_score(&case.response, &case.ground_truth), None),
            "math_dapo" => {
                let (score, prediction) = math_dapo::compute_score(&case.response, &case.ground_truth);
                (score, Some(prediction))
            }
            other => panic!("fixture names an unknown scorer {other}"),
        };
        *counts.entry(case.scorer.clone()).or_insert(0) += 1;
        if actual != case.expected || prediction != case.pred {
            mismatches.push(format!(
                "{} {:?} vs {:?}: VeRL {} {:?}, ours {} {:?}",
                case.scorer, case.response, case.ground_truth, case.expected, case.pred, actual, prediction
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} mismatches:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    let counts: Vec<(&str, i32)> = counts.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(
        counts,
        [
            ("gsm8k_flexible", 28),
            ("gsm8k_strict", 28),
            ("math", 45),
            ("math_dapo", 15)
        ]
    );
}

#[test]
fn the_table_exercises_every_outcome() {
    // Guards against a regenerated fixture that silently lost its interesting cases.
    let expectations = expectations();
    for scorer in ["gsm8k_strict", "gsm8k_flexible"] {
        for outcome in [0.0, 0.1, 1.0] {
            assert!(
                expectations
                    .cases
                    .iter()
                    .any(|c| c.scorer == scorer && c.expected == outcome),
                "{scorer} has no case scoring {outcome}"
            );
        }
    }
    for (scorer, outcomes) in [("math", [0.0, 1.0]), ("math_dapo", [-1.0, 1.0])] {
        for outcome in outcomes {
            assert!(expectations
                .cases
                .iter()
                .any(|c| c.scorer == scorer && c.expected == outcome));
        }
    }
}
