//! Rollout correction (VeRL's `algorithm.rollout_correction`, `rollout_corr_helper.py`): the
//! rollout engine samples with its own numerics (another kernel, another dtype, or older
//! weights), so the learner's probability of a sampled token differs from the sampler's. From
//! the learner's old log-probs and the rollout's, once per batch on the host:
//!
//! - **importance weights** `w = pi_old / pi_rollout` per token or per sequence, truncated at
//!   `rollout_is_threshold` and optionally renormalised to mean 1 over the batch; the policy
//!   loss multiplies each token's loss by its weight;
//! - **rejection sampling**: tokens or whole sequences whose divergence estimate is out of
//!   bounds leave the response mask (so advantages and the loss skip them);
//! - **mismatch metrics** (`rollout_corr/*`: KL, perplexities, chi-squared, weight statistics),
//!   reported every step whatever is enabled.
//!
//! Arrays are row-major `[batch, response_len]` `f32`; arithmetic is `f64`. Every formula is
//! VeRL's, checked on fixed inputs in `tests/verl_rollout_correction.rs`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Result, TrainerError};

/// Log-ratios are clamped to `[-20, 20]` before `exp` (VeRL's `SAFETY_BOUND`).
pub const SAFETY_BOUND: f64 = 20.0;

/// `rollout_is`: what one importance weight covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum IsLevel {
    /// `w_t = pi_old(y_t) / pi_rollout(y_t)` per token (biased, low variance).
    #[serde(rename = "token")]
    Token,
    /// `w = prod_t w_t` for the whole response, on each of its tokens (unbiased, high variance).
    #[serde(rename = "sequence")]
    Sequence,
}

/// The divergence estimate a rejection criterion thresholds, from `r = log(pi_old / pi_rollout)`
/// clamped to `[-20, 20]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Divergence {
    /// `-r`, kept within `[log lower, log upper]`.
    K1,
    /// `r^2 / 2`, kept below `upper`.
    K2,
    /// `exp(r) - 1 - r`, kept below `upper`.
    K3,
}

/// Where a rejection criterion's statistic lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RsLevel {
    /// Each token on its own (`token_k*`).
    Token,
    /// The sum over the response (`seq_sum_k*`).
    SeqSum,
    /// The mean over the response (`seq_mean_k*`).
    SeqMean,
    /// The largest token value of the response (`seq_max_k2`, `seq_max_k3`).
    SeqMax,
}

/// One `rollout_rs` option with its bounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RsCriterion {
    pub level: RsLevel,
    pub divergence: Divergence,
    /// The lower probability-ratio bound (`K1` only).
    pub lower: Option<f64>,
    /// The upper bound: a probability ratio for `K1`, the divergence for `K2`/`K3`.
    pub upper: f64,
}

impl RsCriterion {
    /// VeRL's option name, such as `seq_mean_k3`.
    pub fn name(&self) -> String {
        let level = match self.level {
            RsLevel::Token => "token",
            RsLevel::SeqSum => "seq_sum",
            RsLevel::SeqMean => "seq_mean",
            RsLevel::SeqMax => "seq_max",
        };
        let k = match self.divergence {
            Divergence::K1 => "k1",
            Divergence::K2 => "k2",
            Divergence::K3 => "k3",
        };
        format!("{level}_{k}")
    }
}

/// The names `rollout_rs` accepts (VeRL's `SUPPORTED_ROLLOUT_RS_OPTIONS`).
pub const RS_OPTIONS: &[&str] = &[
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
];

/// Parses VeRL's `rollout_rs` (options separated by commas, all of which must pass) and
/// `rollout_rs_threshold` (one threshold for all options or one per option, separated by
/// commas; a `k1` option takes `lower_upper` ratio bounds or one upper bound `u`, meaning
/// `1/u_u`). The error names the offending part.
pub fn parse_rejection(options: &str, thresholds: &str) -> std::result::Result<Vec<RsCriterion>, String> {
    let mut names: Vec<&str> = Vec::new();
    for o in options.split(',').map(str::trim).filter(|o| !o.is_empty()) {
        if !RS_OPTIONS.contains(&o) {
            return Err(format!(
                "unknown option `{o}`; the options are {}",
                RS_OPTIONS.join(", ")
            ));
        }
        if !names.contains(&o) {
            names.push(o);
        }
    }
    if names.is_empty() {
        return Err("no option given".into());
    }
    let mut specs: Vec<&str> = thresholds
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if specs.is_empty() {
        return Err("rollout_rs_threshold is required with rollout_rs".into());
    }
    if specs.len() == 1 {
        specs = vec![specs[0]; names.len()];
    } else if specs.len() != names.len() {
        return Err(format!(
            "rollout_rs_threshold has {} thresholds for {} options: give one for all or one per option",
            specs.len(),
            names.len()
        ));
    }
    let positive = |s: &str, option: &str| -> std::result::Result<f64, String> {
        match s.parse::<f64>() {
            Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
            _ => Err(format!("threshold `{s}` of `{option}` must be a positive number")),
        }
    };
    names
        .iter()
        .zip(specs)
        .map(|(name, spec)| {
            let (level, k) = name.rsplit_once('_').expect("option names hold an underscore");
            let level = match level {
                "token" => RsLevel::Token,
                "seq_sum" => RsLevel::SeqSum,
                "seq_mean" => RsLevel::SeqMean,
                _ => RsLevel::SeqMax,
            };
            let divergence = match k {
                "k1" => Divergence::K1,
                "k2" => Divergence::K2,
                _ => Divergence::K3,
            };
            let (lower, upper) = if divergence == Divergence::K1 {
                match spec.split_once('_') {
                    Some((lo, up)) => (Some(positive(lo, name)?), positive(up, name)?),
                    None => {
                        let up = positive(spec, name)?;
                        (Some(1.0 / up), up)
                    }
                }
            } else {
                if spec.contains('_') {
                    return Err(format!(
                        "`{name}` takes one upper bound, not `{spec}` (lower_upper is for k1 options)"
                    ));
                }
                (None, positive(spec, name)?)
            };
            Ok(RsCriterion {
                level,
                divergence,
                lower,
                upper,
            })
        })
        .collect()
}

/// VeRL's `algorithm.rollout_correction` (`bypass_mode` is `actor.use_rollout_log_probs`).
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutCorrection {
    /// `rollout_is`: importance weights per token or per sequence; `None` applies none.
    pub rollout_is: Option<IsLevel>,
    /// `rollout_is_threshold`: weights are truncated at this (and the statistics count weights
    /// beyond it and below its inverse).
    pub rollout_is_threshold: f64,
    /// `rollout_is_batch_normalize`: divide the truncated weights by their batch mean.
    pub rollout_is_batch_normalize: bool,
    /// `rollout_rs` with `rollout_rs_threshold`: every criterion must pass; empty rejects
    /// nothing.
    pub rollout_rs: Vec<RsCriterion>,
}

impl Default for RolloutCorrection {
    fn default() -> Self {
        RolloutCorrection {
            rollout_is: None,
            rollout_is_threshold: 2.0,
            rollout_is_batch_normalize: false,
            rollout_rs: Vec::new(),
        }
    }
}

/// What the correction gives a batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Corrected {
    /// The importance weight of every token (0 on padding), when `rollout_is` is set.
    pub weights: Option<Vec<f32>>,
    /// The response mask with rejected tokens removed.
    pub response_mask: Vec<f32>,
    /// `rollout_corr/*` metrics.
    pub metrics: BTreeMap<String, f64>,
}

/// `[batch, L]` arrays as rows of `f64`, with each row's mask.
struct Rows {
    l: usize,
    mask: Vec<f64>,
}

impl Rows {
    fn rows(&self) -> usize {
        self.mask.len() / self.l.max(1)
    }
    fn valid(&self, t: usize) -> bool {
        self.mask[t] != 0.0
    }
    /// VeRL `masked_sum(x, mask)` over all tokens.
    fn sum(&self, x: &[f64]) -> f64 {
        (0..x.len())
            .filter(|&t| self.valid(t))
            .map(|t| x[t] * self.mask[t])
            .sum()
    }
    fn count(&self) -> f64 {
        self.mask.iter().sum()
    }
    /// VeRL `masked_mean(x, mask)`: `sum(x m) / (sum(m) + 1e-8)`.
    fn mean(&self, x: &[f64]) -> f64 {
        self.sum(x) / (self.count() + 1e-8)
    }
    /// The same per row (`axis=-1`).
    fn row_sums(&self, x: &[f64]) -> Vec<f64> {
        (0..self.rows())
            .map(|b| self.sum_range(x, b * self.l..(b + 1) * self.l))
            .collect()
    }
    fn sum_range(&self, x: &[f64], r: std::ops::Range<usize>) -> f64 {
        r.filter(|&t| self.valid(t)).map(|t| x[t] * self.mask[t]).sum()
    }
    fn row_counts(&self) -> Vec<f64> {
        self.mask.chunks(self.l.max(1)).map(|r| r.iter().sum()).collect()
    }
    fn row_means(&self, x: &[f64]) -> Vec<f64> {
        self.row_sums(x)
            .iter()
            .zip(self.row_counts())
            .map(|(s, n)| s / (n + 1e-8))
            .collect()
    }
    /// Max and min over the valid tokens.
    fn max_min(&self, x: &[f64]) -> (f64, f64) {
        (0..x.len())
            .filter(|&t| self.valid(t))
            .fold((f64::NEG_INFINITY, f64::INFINITY), |(hi, lo), t| {
                (hi.max(x[t]), lo.min(x[t]))
            })
    }
    /// `masked_mean(x > bound)` and the like.
    fn fraction(&self, x: &[f64], test: impl Fn(f64) -> bool) -> f64 {
        let hits: Vec<f64> = x.iter().map(|v| test(*v) as u8 as f64).collect();
        self.mean(&hits)
    }
    /// `sqrt(max(masked_mean(c^2) - masked_mean(c)^2, 0))` of `x` clamped to `[lo, hi]`; 0 for
    /// fewer than two valid tokens.
    fn clamped_std(&self, x: &[f64], lo: f64, hi: f64) -> f64 {
        if self.count() <= 1.0 {
            return 0.0;
        }
        let c: Vec<f64> = x.iter().map(|v| v.clamp(lo, hi)).collect();
        let sq: Vec<f64> = c.iter().map(|v| v * v).collect();
        let m = self.mean(&c);
        (self.mean(&sq) - m * m).max(0.0).sqrt()
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// `torch.std` (unbiased); 0 for fewer than two values, as VeRL writes it.
fn std(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return 0.0;
    }
    let m = mean(v);
    (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() as f64 - 1.0)).sqrt()
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// VeRL `compute_rollout_correction_and_rejection_mask` on a batch: importance weights (when
/// `rollout_is`), the rejection mask (when `rollout_rs`) and every metric, named
/// `rollout_corr/*` as VeRL logs them. The mismatch metrics (`kl`, `k3_kl`, perplexities,
/// `chi2_*`) are always computed; the weight statistics use `rollout_is_threshold` even when
/// no weight is applied, so the mismatch can be watched before it is corrected.
///
/// A batch without a response token (VeRL raises) gets no weights, no rejection and no
/// metrics.
pub fn correct(
    cfg: &RolloutCorrection,
    old_log_probs: &[f32],
    rollout_log_probs: &[f32],
    response_mask: &[f32],
    response_len: usize,
) -> Result<Corrected> {
    let n = response_mask.len();
    for (what, got) in [
        ("old log-probs", old_log_probs.len()),
        ("rollout log-probs", rollout_log_probs.len()),
    ] {
        if got != n {
            return Err(TrainerError::Length {
                what: what.into(),
                expected: n,
                got,
                unit: "token",
            });
        }
    }
    let rows = Rows {
        l: response_len.max(1),
        mask: response_mask.iter().map(|m| *m as f64).collect(),
    };
    if rows.count() == 0.0 {
        return Ok(Corrected {
            weights: cfg.rollout_is.map(|_| vec![0.0; n]),
            response_mask: response_mask.to_vec(),
            metrics: BTreeMap::new(),
        });
    }
    let old: Vec<f64> = old_log_probs.iter().map(|x| *x as f64).collect();
    let rollout: Vec<f64> = rollout_log_probs.iter().map(|x| *x as f64).collect();
    let log_ratio: Vec<f64> = old.iter().zip(&rollout).map(|(o, r)| o - r).collect();
    let mut metrics = BTreeMap::new();
    let (weights, is_metrics) = importance_weights(cfg, &log_ratio, &rows);
    metrics.extend(is_metrics);
    let mut keep = vec![1.0f64; n];
    if !cfg.rollout_rs.is_empty() {
        let (k, rs_metrics) = rejection(&cfg.rollout_rs, &log_ratio, &rows);
        keep = k;
        metrics.extend(rs_metrics);
    }
    metrics.extend(mismatch_metrics(&old, &rollout, &log_ratio, &rows));
    Ok(Corrected {
        weights: cfg
            .rollout_is
            .map(|_| weights.iter().map(|w| *w as f32).collect()),
        response_mask: rows.mask.iter().zip(&keep).map(|(m, k)| (m * k) as f32).collect(),
        metrics: metrics
            .into_iter()
            .map(|(k, v)| (format!("rollout_corr/{k}"), v))
            .collect(),
    })
}

/// VeRL `compute_rollout_correction_weights` with `compute_is_metrics`: the truncated (and
/// optionally batch-normalised) weights and their statistics, taken before truncation.
fn importance_weights(
    cfg: &RolloutCorrection,
    log_ratio: &[f64],
    rows: &Rows,
) -> (Vec<f64>, BTreeMap<String, f64>) {
    let level = cfg.rollout_is.unwrap_or(IsLevel::Token);
    let threshold = cfg.rollout_is_threshold;
    let lower = 1.0 / threshold;
    let l = rows.l;
    let mut m = BTreeMap::new();
    let mut w: Vec<f64> = match level {
        IsLevel::Token => log_ratio
            .iter()
            .enumerate()
            .map(|(t, r)| r.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp() * rows.mask[t])
            .collect(),
        IsLevel::Sequence => {
            let sums = rows.row_sums(log_ratio);
            (0..log_ratio.len())
                .map(|t| sums[t / l].clamp(-SAFETY_BOUND, SAFETY_BOUND).exp() * rows.mask[t])
                .collect()
        }
    };
    match level {
        IsLevel::Sequence => {
            // Per row, empty rows included (their sum is 0).
            let sums = rows.row_sums(log_ratio);
            m.insert("rollout_is_max".into(), max(&sums).min(SAFETY_BOUND).exp());
            m.insert("rollout_is_min".into(), min(&sums).exp());
            m.insert("rollout_is_mean".into(), rows.mean(&w));
            let frac = |test: &dyn Fn(f64) -> bool| {
                mean(&sums.iter().map(|s| test(*s) as u8 as f64).collect::<Vec<_>>())
            };
            m.insert(
                "rollout_is_ratio_fraction_high".into(),
                frac(&|s| s > threshold.ln()),
            );
            m.insert("rollout_is_ratio_fraction_low".into(), frac(&|s| s < lower.ln()));
        }
        IsLevel::Token => {
            m.insert("rollout_is_mean".into(), rows.mean(&w));
            m.insert(
                "rollout_is_ratio_fraction_high".into(),
                rows.fraction(&w, |v| v > threshold),
            );
            m.insert(
                "rollout_is_ratio_fraction_low".into(),
                rows.fraction(&w, |v| v < lower),
            );
            let (hi, lo) = rows.max_min(&w);
            m.insert("rollout_is_max".into(), hi);
            m.insert("rollout_is_min".into(), lo);
        }
    }
    m.insert("rollout_is_std".into(), rows.clamped_std(&w, lower, threshold));
    let clamped: Vec<f64> = w.iter().map(|v| v.clamp(lower, threshold)).collect();
    let mean_c = rows.mean(&clamped);
    let normalized_sq: Vec<f64> = clamped.iter().map(|v| (v / (mean_c + 1e-8)).powi(2)).collect();
    m.insert(
        "rollout_is_eff_sample_size".into(),
        1.0 / rows.mean(&normalized_sq),
    );
    let seq = rows.row_means(&w);
    m.insert("rollout_is_seq_mean".into(), mean(&seq));
    m.insert("rollout_is_seq_std".into(), std(&seq));
    m.insert("rollout_is_seq_max".into(), max(&seq));
    m.insert("rollout_is_seq_min".into(), min(&seq));
    m.insert(
        "rollout_is_seq_max_deviation".into(),
        max(&seq.iter().map(|s| (s - 1.0).abs()).collect::<Vec<_>>()),
    );
    let frac =
        |test: &dyn Fn(f64) -> bool| mean(&seq.iter().map(|s| test(*s) as u8 as f64).collect::<Vec<_>>());
    m.insert("rollout_is_seq_fraction_high".into(), frac(&|s| s > threshold));
    m.insert("rollout_is_seq_fraction_low".into(), frac(&|s| s < lower));

    for v in &mut w {
        *v = v.min(threshold);
    }
    if cfg.rollout_is_batch_normalize {
        let batch_mean = match level {
            IsLevel::Token => rows.mean(&w),
            IsLevel::Sequence => {
                let seq = rows.row_means(&w);
                let seq_mask: Vec<f64> = rows
                    .row_counts()
                    .iter()
                    .map(|n| (*n > 0.0) as u8 as f64)
                    .collect();
                let s: f64 = seq.iter().zip(&seq_mask).map(|(a, b)| a * b).sum();
                s / seq_mask.iter().sum::<f64>().max(1e-8)
            }
        };
        if batch_mean > 1e-8 {
            for v in &mut w {
                *v /= batch_mean;
            }
            m.insert("rollout_is_batch_norm_factor".into(), batch_mean);
        } else {
            m.insert("rollout_is_batch_norm_factor".into(), 1.0);
        }
    }
    (w, m)
}

/// VeRL `compute_rollout_rejection_mask` with `compute_rs_metrics`: the product of every
/// criterion's keep mask, and each criterion's statistics.
fn rejection(criteria: &[RsCriterion], log_ratio: &[f64], rows: &Rows) -> (Vec<f64>, BTreeMap<String, f64>) {
    let (l, n) = (rows.l, log_ratio.len());
    let safe: Vec<f64> = log_ratio
        .iter()
        .map(|r| r.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        .collect();
    let divergence = |d: Divergence| -> Vec<f64> {
        safe.iter()
            .map(|r| match d {
                Divergence::K1 => -r,
                Divergence::K2 => 0.5 * r * r,
                Divergence::K3 => r.exp() - 1.0 - r,
            })
            .collect()
    };
    let seq_valid: Vec<bool> = rows.row_counts().iter().map(|c| *c > 0.0).collect();
    let mut combined = vec![1.0f64; n];
    let mut m = BTreeMap::new();
    for c in criteria {
        let k = divergence(c.divergence);
        let is_k1 = c.divergence == Divergence::K1;
        let (lower_log, upper_log) = (c.lower.map(f64::ln), c.upper.ln());
        let passes = |v: f64| match lower_log {
            Some(lo) => v >= lo && v <= upper_log,
            None => v <= c.upper,
        };
        let seq_stat: Option<Vec<f64>> = match c.level {
            RsLevel::Token => None,
            RsLevel::SeqSum => Some(rows.row_sums(&k)),
            RsLevel::SeqMean => Some(rows.row_means(&k)),
            RsLevel::SeqMax => Some(
                (0..rows.rows())
                    .map(|b| {
                        let m = (b * l..(b + 1) * l)
                            .filter(|&t| rows.valid(t))
                            .map(|t| k[t])
                            .fold(f64::NEG_INFINITY, f64::max);
                        if m == f64::NEG_INFINITY {
                            0.0
                        } else {
                            m
                        }
                    })
                    .collect(),
            ),
        };
        let (per_token, keep): (Vec<f64>, Vec<bool>) = match &seq_stat {
            None => (k.clone(), k.iter().map(|v| passes(*v)).collect()),
            Some(s) => (
                (0..n).map(|t| s[t / l]).collect(),
                (0..n).map(|t| passes(s[t / l])).collect(),
            ),
        };
        let upper = if is_k1 { upper_log } else { c.upper };
        let lower = if is_k1 { lower_log.unwrap_or(0.0) } else { 0.0 };
        let name = format!("rollout_rs_{}", c.name());
        rs_metrics(
            &name,
            &per_token,
            seq_stat.as_deref(),
            &seq_valid,
            rows,
            upper,
            lower,
            is_k1,
            &mut m,
        );
        let rejected: Vec<f64> = keep.iter().map(|k| (!k) as u8 as f64).collect();
        m.insert(format!("{name}_masked_fraction"), rows.mean(&rejected));
        let valid_rows = seq_valid.iter().filter(|v| **v).count();
        let seq_masked = (0..rows.rows())
            .filter(|&b| seq_valid[b] && (b * l..(b + 1) * l).any(|t| !keep[t] && rows.valid(t)))
            .count();
        m.insert(
            format!("{name}_seq_masked_fraction"),
            if valid_rows > 0 {
                seq_masked as f64 / valid_rows as f64
            } else {
                0.0
            },
        );
        for (c, k) in combined.iter_mut().zip(&keep) {
            *c *= *k as u8 as f64;
        }
    }
    let rejected: Vec<f64> = combined.iter().map(|c| 1.0 - c).collect();
    m.insert("rollout_rs_masked_fraction".into(), rows.mean(&rejected));
    let seq_has_masked = (0..rows.rows())
        .filter(|&b| (b * l..(b + 1) * l).any(|t| rows.valid(t) && combined[t] <= 0.5))
        .count();
    m.insert(
        "rollout_rs_seq_masked_fraction".into(),
        seq_has_masked as f64 / rows.rows().max(1) as f64,
    );
    (combined, m)
}

/// VeRL `compute_rs_metrics` for one criterion: `per_token` is the statistic on each token
/// (a sequence's value repeated on its tokens for sequence criteria), `per_seq` the sequence
/// values when the criterion is one.
#[allow(clippy::too_many_arguments)]
fn rs_metrics(
    prefix: &str,
    per_token: &[f64],
    per_seq: Option<&[f64]>,
    seq_valid: &[bool],
    rows: &Rows,
    upper: f64,
    lower: f64,
    apply_lower: bool,
    m: &mut BTreeMap<String, f64>,
) {
    let seq_values = per_seq
        .map(<[f64]>::to_vec)
        .unwrap_or_else(|| rows.row_means(per_token));
    let valid: Vec<f64> = seq_values
        .iter()
        .zip(seq_valid)
        .filter(|(_, v)| **v)
        .map(|(s, _)| *s)
        .collect();
    let sequence = per_seq.is_some() && !valid.is_empty();
    m.insert(format!("{prefix}_mean"), rows.mean(per_token));
    let (hi, lo) = if sequence {
        (max(&valid), min(&valid))
    } else {
        rows.max_min(per_token)
    };
    m.insert(format!("{prefix}_max"), hi);
    m.insert(format!("{prefix}_min"), lo);
    let frac = |v: &[f64], test: &dyn Fn(f64) -> bool| {
        mean(&v.iter().map(|s| test(*s) as u8 as f64).collect::<Vec<_>>())
    };
    let (high, low) = if sequence {
        (
            frac(&valid, &|s| s > upper),
            if apply_lower {
                frac(&valid, &|s| s < lower)
            } else {
                0.0
            },
        )
    } else {
        (
            rows.fraction(per_token, |v| v > upper),
            if apply_lower {
                rows.fraction(per_token, |v| v < lower)
            } else {
                0.0
            },
        )
    };
    m.insert(format!("{prefix}_fraction_high"), high);
    m.insert(format!("{prefix}_fraction_low"), low);
    let clamp_min = if apply_lower { lower } else { 0.0 };
    m.insert(
        format!("{prefix}_std"),
        rows.clamped_std(per_token, clamp_min, upper),
    );
    if valid.is_empty() {
        for k in [
            "seq_mean",
            "seq_std",
            "seq_max",
            "seq_min",
            "seq_max_deviation",
            "seq_fraction_high",
            "seq_fraction_low",
        ] {
            m.insert(format!("{prefix}_{k}"), 0.0);
        }
        return;
    }
    m.insert(format!("{prefix}_seq_mean"), mean(&valid));
    m.insert(format!("{prefix}_seq_std"), std(&valid));
    m.insert(format!("{prefix}_seq_max"), max(&valid));
    m.insert(format!("{prefix}_seq_min"), min(&valid));
    m.insert(
        format!("{prefix}_seq_max_deviation"),
        max(&valid.iter().map(|v| v.abs()).collect::<Vec<_>>()),
    );
    m.insert(
        format!("{prefix}_seq_fraction_high"),
        frac(&valid, &|s| s > upper),
    );
    if apply_lower {
        m.insert(format!("{prefix}_seq_fraction_low"), frac(&valid, &|s| s < lower));
    }
}

/// VeRL `compute_offpolicy_metrics`: how far the sampler and the learner disagree.
fn mismatch_metrics(old: &[f64], rollout: &[f64], log_ratio: &[f64], rows: &Rows) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    let train_mean = rows.row_means(old);
    let rollout_mean = rows.row_means(rollout);
    let ppl = |v: &[f64]| mean(&v.iter().map(|x| (-x).exp()).collect::<Vec<_>>());
    let log_ppl = |v: &[f64]| mean(&v.iter().map(|x| -x).collect::<Vec<_>>());
    m.insert("training_ppl".into(), ppl(&train_mean));
    m.insert("training_log_ppl".into(), log_ppl(&train_mean));
    let minus: Vec<f64> = log_ratio.iter().map(|r| -r).collect();
    m.insert("kl".into(), rows.mean(&minus));
    let k3: Vec<f64> = log_ratio.iter().map(|r| r.exp() - r - 1.0).collect();
    m.insert("k3_kl".into(), rows.mean(&k3));
    m.insert("rollout_ppl".into(), ppl(&rollout_mean));
    m.insert("rollout_log_ppl".into(), log_ppl(&rollout_mean));
    let diff: Vec<f64> = rollout_mean.iter().zip(&train_mean).map(|(r, t)| r - t).collect();
    m.insert("log_ppl_diff".into(), mean(&diff));
    m.insert(
        "log_ppl_abs_diff".into(),
        mean(&diff.iter().map(|d| d.abs()).collect::<Vec<_>>()),
    );
    m.insert("log_ppl_diff_max".into(), max(&diff));
    m.insert("log_ppl_diff_min".into(), min(&diff));
    m.insert(
        "ppl_ratio".into(),
        mean(&diff.iter().map(|d| d.exp()).collect::<Vec<_>>()),
    );
    let rho_sq: Vec<f64> = log_ratio
        .iter()
        .map(|r| (2.0 * r.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp())
        .collect();
    m.insert("chi2_token".into(), rows.mean(&rho_sq) - 1.0);
    let seq_sq: Vec<f64> = rows
        .row_sums(log_ratio)
        .iter()
        .map(|s| (2.0 * s.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp())
        .collect();
    m.insert("chi2_seq".into(), mean(&seq_sq) - 1.0);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejection_options_parse_as_verl_reads_them() {
        let c = parse_rejection("token_k1, seq_mean_k3,token_k1", "0.5_2.0,0.01").unwrap();
        assert_eq!(c.len(), 2, "duplicates count once");
        assert_eq!(
            (c[0].name(), c[0].lower, c[0].upper),
            ("token_k1".into(), Some(0.5), 2.0)
        );
        assert_eq!(
            (c[1].name(), c[1].lower, c[1].upper),
            ("seq_mean_k3".into(), None, 0.01)
        );
        // One threshold for all; a single k1 bound u means [1/u, u].
        let c = parse_rejection("seq_sum_k1,token_k2", "4").unwrap();
        assert_eq!((c[0].lower, c[0].upper), (Some(0.25), 4.0));
        assert_eq!((c[1].lower, c[1].upper), (None, 4.0));
        for (options, thresholds, want) in [
            ("seq_max_k1", "2", "unknown option `seq_max_k1`"),
            ("token_k1,token_k2,seq_sum_k3", "1,2", "3 options"),
            ("token_k3", "0.5_2", "takes one upper bound"),
            ("token_k2", "-1", "must be a positive number"),
            ("token_k2", "", "required"),
            (" , ", "1", "no option"),
        ] {
            let err = parse_rejection(options, thresholds).unwrap_err();
            assert!(err.contains(want), "{options} / {thresholds}: {err}");
        }
    }

    #[test]
    fn a_batch_without_response_tokens_is_left_alone() {
        let cfg = RolloutCorrection {
            rollout_is: Some(IsLevel::Token),
            ..Default::default()
        };
        let out = correct(&cfg, &[-1.0, -2.0], &[-1.5, -2.0], &[0.0, 0.0], 2).unwrap();
        assert_eq!(out.weights, Some(vec![0.0, 0.0]));
        assert_eq!(out.response_mask, vec![0.0, 0.0]);
        assert!(out.metrics.is_empty());
    }
}
