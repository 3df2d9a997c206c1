//! VeRL's validation metrics (`process_validation_metrics` and `_val_metrics_update` of
//! `verl/trainer/ppo/`), computed the same way so that a VeRL user's dashboards read the same
//! numbers.
//!
//! Each validation sample has a data source, the prompt it answers (`uid`), its variables
//! (`reward`, the score, and each named extra of its scorer, such as `acc`) and optionally the
//! answer it predicted (`pred`). Per data source, variable and prompt, over the prompt's
//! `N = rollout.val_kwargs.n` responses:
//!
//! - `mean@N` and `std@N` (population standard deviation, as `np.std`);
//! - for n in 2, 4, 8, ... < N and N: `best@n` and `worst@n`, the mean and standard deviation
//!   over 1000 bootstrap draws (n responses with replacement) of the draw's maximum and minimum;
//!   with predictions also `maj@n`, the value of the first response whose prediction won the
//!   draw's majority vote;
//!
//! each averaged over the prompts. The bootstrap draws are numpy's: its legacy `RandomState`
//! seeded with 42 before every bootstrap (MT19937, indices by masked rejection sampling), so the
//! numbers equal VeRL's exactly, not only in expectation.
//!
//! Names: `val-core/{data_source}/{var}/{metric}` for the core variable (`acc` when the scorer
//! reports one, else `reward`) and its `mean`, `maj` and `best` metrics at the largest N;
//! `val-aux/...` for the rest.

use super::metrics::Metrics;
use rand_mt::Mt;
use std::collections::BTreeMap;

/// Bootstrap draws per metric, and the seed numpy is given before each (VeRL's values).
const BOOTSTRAPS: usize = 1000;
const SEED: u32 = 42;

/// One scored validation response.
#[derive(Clone, Debug)]
pub(crate) struct ValSample {
    pub data_source: String,
    /// The prompt it answers (its dataset row).
    pub uid: u64,
    /// `reward` and the scorer's extras.
    pub vars: BTreeMap<String, f64>,
    /// The answer the scorer extracted, for majority votes.
    pub pred: Option<String>,
}

/// VeRL's validation metrics of `samples`, by VeRL's names.
pub(crate) fn validation_metrics(samples: &[ValSample]) -> Metrics {
    // data source -> uid -> the uid's samples, in order.
    let mut grouped: BTreeMap<&str, Vec<(u64, Vec<&ValSample>)>> = BTreeMap::new();
    for s in samples {
        let uids = grouped.entry(&s.data_source).or_default();
        match uids.iter_mut().find(|(uid, _)| *uid == s.uid) {
            Some((_, group)) => group.push(s),
            None => uids.push((s.uid, vec![s])),
        }
    }
    let mut out = Metrics::new();
    for (data_source, uids) in grouped {
        // var -> metric -> one value per uid.
        let mut per_var: BTreeMap<String, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
        for (_, group) in &uids {
            let mut names: Vec<&String> = group.iter().flat_map(|s| s.vars.keys()).collect();
            names.sort();
            names.dedup();
            for name in names {
                let values: Vec<f64> = group.iter().filter_map(|s| s.vars.get(name).copied()).collect();
                let preds: Option<Vec<&str>> = group
                    .iter()
                    .filter(|s| s.vars.contains_key(name))
                    .map(|s| s.pred.as_deref())
                    .collect();
                for (metric, value) in prompt_metrics(&values, preds.as_deref()) {
                    per_var
                        .entry(name.clone())
                        .or_default()
                        .entry(metric)
                        .or_default()
                        .push(value);
                }
            }
        }
        let core = if per_var.contains_key("acc") {
            "acc"
        } else {
            "reward"
        };
        for (var, metrics) in per_var {
            let n_max = metrics.keys().filter_map(|m| metric_n(m)).max().unwrap_or(1);
            for (metric, values) in metrics {
                let is_core = var == core
                    && ["mean", "maj", "best"].iter().any(|p| metric.starts_with(p))
                    && metric.contains(&format!("@{n_max}"));
                let section = if is_core { "val-core" } else { "val-aux" };
                out.insert(format!("{section}/{data_source}/{var}/{metric}"), mean(&values));
            }
        }
    }
    out
}

/// The headline of a validation: each data source's core mean (`openai/gsm8k acc mean@4
/// 0.531`), for the progress lines.
pub(crate) fn core_means(m: &Metrics) -> String {
    m.iter()
        .filter_map(|(name, value)| {
            let rest = name.strip_prefix("val-core/")?;
            let (path, metric) = rest.rsplit_once('/')?;
            metric.starts_with("mean@").then(|| {
                let (source, var) = path.rsplit_once('/').unwrap_or(("", path));
                format!("{source} {var} {metric} {value:.3}")
            })
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The `n` of a metric's name (`best@4/mean` -> 4).
fn metric_n(metric: &str) -> Option<usize> {
    metric.rsplit('@').next()?.split('/').next()?.parse().ok()
}

/// One prompt's metrics of one variable over its responses.
fn prompt_metrics(values: &[f64], preds: Option<&[&str]>) -> Vec<(String, f64)> {
    let n = values.len();
    if n == 0 {
        return Vec::new();
    }
    let mut out = vec![(format!("mean@{n}"), mean(values))];
    if n == 1 {
        return out;
    }
    out.push((format!("std@{n}"), std(values)));
    for k in bootstrap_sizes(n) {
        let draws = bootstrap_indices(n, k);
        let reduce = |f: &dyn Fn(&[usize]) -> f64| -> (f64, f64) {
            let results: Vec<f64> = draws.chunks(k).map(f).collect();
            (mean(&results), std(&results))
        };
        let (best_mean, best_std) =
            reduce(&|draw| draw.iter().map(|&i| values[i]).fold(f64::NEG_INFINITY, f64::max));
        let (worst_mean, worst_std) =
            reduce(&|draw| draw.iter().map(|&i| values[i]).fold(f64::INFINITY, f64::min));
        out.push((format!("best@{k}/mean"), best_mean));
        out.push((format!("best@{k}/std"), best_std));
        out.push((format!("worst@{k}/mean"), worst_mean));
        out.push((format!("worst@{k}/std"), worst_std));
        if let Some(preds) = preds {
            let (maj_mean, maj_std) = reduce(&|draw| majority_value(draw, values, preds));
            out.push((format!("maj@{k}/mean"), maj_mean));
            out.push((format!("maj@{k}/std"), maj_std));
        }
    }
    out
}

/// 2, 4, 8, ... below `n`, then `n` (VeRL's `gen_ns`).
fn bootstrap_sizes(n: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = std::iter::successors(Some(2), |k| Some(k * 2))
        .take_while(|&k| k < n)
        .collect();
    sizes.push(n);
    sizes
}

/// The value of the first response (in draw order) whose prediction got the most votes; ties
/// go to the prediction seen first (Python's `max` over an insertion-ordered dict).
fn majority_value(draw: &[usize], values: &[f64], preds: &[&str]) -> f64 {
    let mut votes: Vec<(&str, usize, f64)> = Vec::new();
    for &i in draw {
        match votes.iter_mut().find(|(p, _, _)| *p == preds[i]) {
            Some(vote) => vote.1 += 1,
            None => votes.push((preds[i], 1, values[i])),
        }
    }
    let most = votes.iter().map(|v| v.1).max().unwrap_or(0);
    votes
        .iter()
        .find(|v| v.1 == most)
        .map(|v| v.2)
        .unwrap_or(f64::NAN)
}

/// The validation generations VeRL logs (`_maybe_log_val_generations`): `(input, output,
/// score)` of every response sorted by input, shuffled as `np.random.RandomState(42).shuffle`
/// shuffles a list, the first `count` of them.
pub(crate) fn generations_to_log<T: Clone>(mut samples: Vec<(String, T)>, count: usize) -> Vec<(String, T)> {
    samples.sort_by(|a, b| a.0.cmp(&b.0));
    // numpy's legacy shuffle: for i from n-1 down to 1, swap i with an index in 0..=i drawn by
    // masked rejection from MT19937's 32-bit outputs.
    let mut mt = Mt::new(SEED);
    for i in (1..samples.len()).rev() {
        let mask = u32::MAX >> (i as u32).leading_zeros();
        let j = loop {
            let v = mt.next_u32() & mask;
            if v as usize <= i {
                break v as usize;
            }
        };
        samples.swap(i, j);
    }
    samples.truncate(count);
    samples
}

/// numpy's `np.random.seed(42); np.random.choice(n, size=(1000, k), replace=True)`, flattened
/// row by row: legacy `randint` draws each index from MT19937's 32-bit outputs, masked to the
/// smallest all-ones mask covering `n - 1` and redrawn while above it.
fn bootstrap_indices(n: usize, k: usize) -> Vec<usize> {
    let count = BOOTSTRAPS * k;
    let range = (n - 1) as u32;
    if range == 0 {
        return vec![0; count];
    }
    let mask = u32::MAX >> range.leading_zeros();
    let mut mt = Mt::new(SEED);
    (0..count)
        .map(|_| loop {
            let v = mt.next_u32() & mask;
            if v <= range {
                break v as usize;
            }
        })
        .collect()
}

/// `np.mean` (sums in order; the difference from numpy's pairwise sum is in the last bits).
fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

/// `np.std`: the population standard deviation.
fn std(values: &[f64]) -> f64 {
    let m = mean(values);
    (values.iter().map(|v| (v - m).powi(2)).sum::<f64>() / values.len() as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// VeRL's own functions on fixed samples (`tests/fixtures/make_verl_val_metrics.py`, which
    /// records the VeRL commit): every metric and name equal, to the last bits numpy's pairwise
    /// sums may differ in.
    #[test]
    fn every_validation_metric_equals_verls() {
        #[derive(serde::Deserialize)]
        struct Fixture {
            verl_commit: String,
            samples: Vec<Sample>,
            expected: BTreeMap<String, f64>,
        }
        #[derive(serde::Deserialize)]
        struct Sample {
            data_source: String,
            uid: u64,
            vars: BTreeMap<String, f64>,
            pred: Option<String>,
        }
        let fixture: Fixture =
            serde_json::from_str(include_str!("../../tests/fixtures/verl_val_metrics.json")).unwrap();
        assert_eq!(fixture.verl_commit, "b178a3cd56f58b2d502255daba591e92833930a7");
        let samples: Vec<ValSample> = fixture
            .samples
            .into_iter()
            .map(|s| ValSample {
                data_source: s.data_source,
                uid: s.uid,
                vars: s.vars,
                pred: s.pred,
            })
            .collect();
        let ours = validation_metrics(&samples);
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            fixture.expected.keys().collect::<Vec<_>>()
        );
        for (name, want) in &fixture.expected {
            let got = ours[name];
            assert!(
                (got - want).abs() <= 1e-12 * want.abs().max(1.0),
                "{name}: {got} vs VeRL {want}"
            );
        }
    }

    #[test]
    fn bootstrap_draws_are_numpys() {
        // np.random.seed(42); np.random.choice(5, size=(1000, 3))[:2] == [[3, 4, 2], [4, 4, 1]]
        // (numpy 2.x, legacy RandomState).
        assert_eq!(&bootstrap_indices(5, 3)[..6], &[3, 4, 2, 4, 4, 1]);
        assert_eq!(bootstrap_indices(1, 2), vec![0; 2000]);
    }

    #[test]
    fn logged_generations_are_the_ones_verl_picks() {
        // np.random.RandomState(42).shuffle(list(range(n))) for n = 10, 3, 7 (numpy 2.x).
        for (n, want) in [
            (10, vec![8, 1, 5, 0, 7, 2, 9, 4, 3, 6]),
            (3, vec![0, 1, 2]),
            (7, vec![0, 1, 5, 2, 4, 3, 6]),
        ] {
            let samples: Vec<(String, usize)> = (0..n).map(|i| (format!("{i:02}"), i)).collect();
            let picked: Vec<usize> = generations_to_log(samples, n).into_iter().map(|s| s.1).collect();
            assert_eq!(picked, want);
        }
        let samples = vec![("b".to_string(), 0), ("a".to_string(), 1), ("c".to_string(), 2)];
        assert_eq!(generations_to_log(samples, 2).len(), 2);
    }

    #[test]
    fn sizes_double_up_to_n() {
        assert_eq!(bootstrap_sizes(2), vec![2]);
        assert_eq!(bootstrap_sizes(5), vec![2, 4, 5]);
        assert_eq!(bootstrap_sizes(8), vec![2, 4, 8]);
    }

    #[test]
    fn majority_ties_go_to_the_first_prediction_seen() {
        let values = [1.0, 0.0, 0.5, 0.25];
        let preds = ["a", "b", "b", "a"];
        assert_eq!(majority_value(&[0, 1, 2, 3], &values, &preds), 1.0);
        assert_eq!(majority_value(&[1, 0, 3, 2], &values, &preds), 0.0);
        assert_eq!(majority_value(&[2, 1, 0], &values, &preds), 0.5);
    }

    #[test]
    fn one_response_per_prompt_gives_mean_at_1_under_the_core_variable() {
        let sample = |uid, acc: f64| ValSample {
            data_source: "openai/gsm8k".into(),
            uid,
            vars: [("reward".to_string(), acc), ("acc".to_string(), acc)].into(),
            pred: None,
        };
        let m = validation_metrics(&[sample(0, 1.0), sample(1, 0.0), sample(2, 1.0)]);
        assert_eq!(m.len(), 2, "{m:?}");
        assert!((m["val-core/openai/gsm8k/acc/mean@1"] - 2.0 / 3.0).abs() < 1e-15);
        assert!((m["val-aux/openai/gsm8k/reward/mean@1"] - 2.0 / 3.0).abs() < 1e-15);
    }
}
