//! Policy-loss terms (and the critic's value loss) as graph functions over `[batch, response_len]` tensors of one float type
//! (f32 in training, f64 in gradient checks): log-probs, old log-probs, advantages and the
//! response mask (1 on response tokens, 0 on padding). Formulas follow VeRL's
//! `verl/trainer/ppo/core_algos.py`; each function cites the function it matches.
//!
//! Aggregation takes a [`Normalizer`] so that a micro-batch's loss is exactly its share of the
//! mini-batch loss: the token count and sequence count of the whole mini-batch are runtime
//! scalars, and summing the micro-batch losses gives the mini-batch loss (see
//! [`agg_loss`]). Every metric is aggregated the same way, so metrics add up too.

use xla::graph::{random, Tensor};
use xla::DType;

use crate::config::{KlPenalty, LossAggMode, PolicyLossConfig, PolicyLossMode, ValueLossConfig};

/// VeRL's `masked_mean` denominator guard: `sum(x * mask) / (sum(mask) + 1e-8)`.
pub const MASKED_MEAN_EPS: f64 = 1e-8;

/// The denominators of the aggregation, as scalars of the loss dtype: the number of response
/// tokens (`sum(mask)`) and the number of sequences of the whole mini-batch.
#[derive(Clone, Debug)]
pub struct Normalizer {
    /// `sum(response_mask)` over the mini-batch.
    pub tokens: Tensor,
    /// Number of sequences in the mini-batch.
    pub seqs: Tensor,
    /// The `L` of `seq-mean-token-sum-norm`: the response length rows are padded to at most
    /// (`data.max_response_length`). `None` takes the loss matrix's width; a learner that runs
    /// rows padded to a shorter length bucket sets the full length here, so the loss does not
    /// depend on the bucket.
    pub response_len: Option<f64>,
}

impl Normalizer {
    /// The normaliser of a batch that is the whole mini-batch: computed from its own mask.
    pub fn local(mask: &Tensor) -> Normalizer {
        let seqs = mask.dim(0) as f64;
        Normalizer {
            tokens: mask.sum_all(),
            seqs: mask.graph().scalar(seqs, mask.dtype()),
            response_len: None,
        }
    }
}

/// `x * mask` where the mask is non-zero and 0 elsewhere, so padding holding inf/NaN cannot
/// leak into sums (VeRL's newer `masked_sum` does the same with `torch.where`).
pub fn masked(x: &Tensor, mask: &Tensor) -> Tensor {
    mask.ne(&mask.zeros_like()).select(&(x * mask), &x.zeros_like())
}

/// `sum(x * mask) / (tokens + 1e-8)`: VeRL `masked_mean` over all tokens, normalised by the
/// mini-batch token count.
pub fn masked_token_mean(x: &Tensor, mask: &Tensor, norm: &Normalizer) -> Tensor {
    masked(x, mask).sum_all() / (&norm.tokens + MASKED_MEAN_EPS)
}

/// VeRL `agg_loss(loss_mat, loss_mask, loss_agg_mode)` (core_algos.py), for a micro-batch of a
/// mini-batch of `norm.tokens` tokens and `norm.seqs` sequences; `L` is the padded response
/// length (`norm.response_len`, else `loss_mask.shape[-1]`):
///
/// - `token-mean`: `sum(l * m) / (tokens + 1e-8)`;
/// - `seq-mean-token-sum`: `sum_i sum_t(l * m) / seqs`;
/// - `seq-mean-token-mean`: `sum_i [sum_t(l * m) / sum_t(m)] / seqs`; VeRL divides by the raw
///   `sum_t(m)`, which makes an empty response (all-zero mask row) 0/0 = NaN and poisons the
///   whole loss; here the row count is clamped to at least 1, so an empty response adds 0
///   (and still counts as a sequence);
/// - `seq-mean-token-sum-norm`: `sum_i sum_t(l * m) / L`. VeRL's normaliser is the constant
///   `L` only (no division by the number of sequences; Dr. GRPO's `MAX_TOKENS`).
///
/// With `norm` = [`Normalizer::local`] this is exactly VeRL's value on that batch; VeRL's own
/// micro-batching instead divides each micro-batch's mean by the number of micro-batches, which
/// is only the same when every micro-batch has the same token count.
pub fn agg_loss(loss_mat: &Tensor, mask: &Tensor, mode: LossAggMode, norm: &Normalizer) -> Tensor {
    match mode {
        LossAggMode::TokenMean => masked_token_mean(loss_mat, mask, norm),
        LossAggMode::SeqMeanTokenSum => masked(loss_mat, mask).sum_all() / &norm.seqs,
        LossAggMode::SeqMeanTokenMean => {
            let row_sum = masked(loss_mat, mask).sum_axis(-1, false);
            let row_count = mask.sum_axis(-1, false).max(&mask.scalar_like(1.0));
            (row_sum / row_count).sum_all() / &norm.seqs
        }
        LossAggMode::SeqMeanTokenSumNorm => {
            let max_response_length = norm.response_len.unwrap_or(loss_mat.dim(-1) as f64);
            masked(loss_mat, mask).sum_all() * (1.0 / max_response_length)
        }
    }
}

/// The per-token KL estimate, VeRL `kl_penalty(logprob, ref_logprob, kl_penalty)`
/// (core_algos.py, after Schulman's "Approximating KL divergence"):
///
/// - `k1`/`kl`: `lp - ref`;
/// - `abs`: `|lp - ref|`;
/// - `k2`/`mse`: `0.5 (lp - ref)^2`;
/// - `k3`/`low_var_kl`: `clamp(exp(x) - x - 1, -10, 10)` with `x = clamp(ref - lp, -20, 20)`.
pub fn kl_penalty(log_prob: &Tensor, ref_log_prob: &Tensor, kind: KlPenalty) -> Tensor {
    match kind {
        KlPenalty::K1 => log_prob - ref_log_prob,
        KlPenalty::Abs => (log_prob - ref_log_prob).abs(),
        KlPenalty::K2 => {
            let d = log_prob - ref_log_prob;
            (&d * &d) * 0.5
        }
        KlPenalty::K3 => {
            let x = (ref_log_prob - log_prob).clamp_scalar(-20.0, 20.0);
            ((x.exp() - &x) - 1.0).clamp_scalar(-10.0, 10.0)
        }
    }
}

/// The policy-gradient loss and its metrics (each a scalar, already aggregated over the
/// micro-batch with the mini-batch normaliser).
#[derive(Clone, Debug)]
pub struct PolicyLoss {
    /// The aggregated surrogate loss.
    pub pg_loss: Tensor,
    /// Fraction of tokens where the clipped term was chosen (`pg_losses2 > pg_losses1`).
    pub pg_clipfrac: Tensor,
    /// Fraction of tokens where the dual clip bound (`clip_ratio_c`) was active.
    pub pg_clipfrac_lower: Tensor,
    /// `masked_mean(old_lp - lp)`: the approximate KL to the old policy.
    pub ppo_kl: Tensor,
}

/// PPO's clipped surrogate with dual clip, VeRL `compute_policy_loss_vanilla` (core_algos.py):
///
/// ```text
/// nkl   = clamp(lp - old_lp, -20, 20);  ratio = exp(nkl);  ppo_kl = masked_mean(-nkl)
/// l1    = -A * ratio
/// l2    = -A * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
/// c1    = max(l1, l2);                   pg_clipfrac = masked_mean(l2 > l1)
/// l3    = -A * clip_ratio_c
/// c2    = min(l3, c1);                   pg_clipfrac_lower = masked_mean((c1 > l3) & (A < 0))
/// pg    = where(A < 0, c2, c1) [* rollout IS weights];   pg_loss = agg_loss(pg)
/// ```
#[allow(clippy::too_many_arguments)]
pub fn policy_loss_vanilla(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
    norm: &Normalizer,
    is_weights: Option<&Tensor>,
) -> PolicyLoss {
    let negative_approx_kl = (log_prob - old_log_prob).clamp_scalar(-20.0, 20.0);
    let ratio = negative_approx_kl.exp();
    let ppo_kl = masked_token_mean(&negative_approx_kl.neg(), mask, norm);
    let neg_adv = advantages.neg();
    let pg_losses1 = &neg_adv * &ratio;
    let pg_losses2 = &neg_adv * &ratio.clamp_scalar(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high);
    let clip_pg_losses1 = pg_losses1.max(&pg_losses2);
    let dtype = mask.dtype();
    let pg_clipfrac = masked_token_mean(&pg_losses2.gt(&pg_losses1).convert(dtype), mask, norm);
    let pg_losses3 = &neg_adv * cfg.clip_ratio_c;
    let clip_pg_losses2 = pg_losses3.min(&clip_pg_losses1);
    let negative = advantages.lt(&advantages.zeros_like());
    let lower = clip_pg_losses1.gt(&pg_losses3).and(&negative).convert(dtype);
    let pg_clipfrac_lower = masked_token_mean(&lower, mask, norm);
    let pg_losses = weighted(negative.select(&clip_pg_losses2, &clip_pg_losses1), is_weights);
    let pg_loss = agg_loss(&pg_losses, mask, cfg.loss_agg_mode, norm);
    PolicyLoss {
        pg_loss,
        pg_clipfrac,
        pg_clipfrac_lower,
        ppo_kl,
    }
}

/// GSPO's sequence-level ratio, VeRL `compute_policy_loss_gspo` (core_algos.py;
/// arXiv:2507.18071):
///
/// ```text
/// nkl     = lp - old_lp
/// s_i     = sum_t(nkl * m) / max(sum_t(m), 1)                      (per sequence)
/// log r   = min(lp - sg(lp) + sg(s_i), 10);  r = exp(log r)        (value s_i, gradient of lp)
/// pg      = max(-A r, -A clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) [* IS weights]
/// pg_loss = agg_loss(pg, "seq-mean-token-mean")    (always, whatever loss_agg_mode says)
/// ```
/// `pg_clipfrac = masked_mean(l2 > l1)`, `pg_clipfrac_lower = 0`, `ppo_kl = masked_mean(-nkl)`.
pub fn policy_loss_gspo(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
    norm: &Normalizer,
    is_weights: Option<&Tensor>,
) -> PolicyLoss {
    let negative_approx_kl = log_prob - old_log_prob;
    let seq_lengths = mask.sum_axis(-1, true).max(&mask.scalar_like(1.0));
    let nkl_seq = masked(&negative_approx_kl, mask).sum_axis(-1, true) / seq_lengths;
    let log_ratio = (log_prob - &log_prob.stop_gradient()) + nkl_seq.stop_gradient();
    let ratio = log_ratio.min(&log_ratio.scalar_like(10.0)).exp();
    let neg_adv = advantages.neg();
    let pg_losses1 = &neg_adv * &ratio;
    let pg_losses2 = &neg_adv * &ratio.clamp_scalar(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high);
    let pg_losses = weighted(pg_losses1.max(&pg_losses2), is_weights);
    let pg_loss = agg_loss(&pg_losses, mask, LossAggMode::SeqMeanTokenMean, norm);
    let dtype = mask.dtype();
    let pg_clipfrac = masked_token_mean(&pg_losses2.gt(&pg_losses1).convert(dtype), mask, norm);
    let ppo_kl = masked_token_mean(&negative_approx_kl.neg(), mask, norm);
    let pg_clipfrac_lower = mask.graph().scalar(0.0, dtype);
    PolicyLoss {
        pg_loss,
        pg_clipfrac,
        pg_clipfrac_lower,
        ppo_kl,
    }
}

/// The policy loss when the surrogate reports no clipping: fractions 0, `ppo_kl` as given.
fn unclipped(pg_loss: Tensor, ppo_kl: Tensor, mask: &Tensor) -> PolicyLoss {
    let zero = mask.graph().scalar(0.0, mask.dtype());
    PolicyLoss {
        pg_loss,
        pg_clipfrac: zero.clone(),
        pg_clipfrac_lower: zero,
        ppo_kl,
    }
}

/// `pg_losses * w` when rollout importance weights are given.
fn weighted(pg_losses: Tensor, is_weights: Option<&Tensor>) -> Tensor {
    match is_weights {
        Some(w) => pg_losses * w,
        None => pg_losses,
    }
}

/// SAPO's soft gate, VeRL `compute_policy_loss_sapo` (core_algos.py; arXiv:2511.20347):
///
/// ```text
/// nkl  = clamp(lp - old_lp, -20, 20);  r = exp(nkl)
/// tau  = tau_pos where A > 0 else tau_neg
/// f(r) = sigmoid(tau (r - 1)) * 4 / tau              (slope 1 at r = 1, flat far from it)
/// pg   = -f(r) A [* IS weights];  pg_loss = agg_loss(pg, "seq-mean-token-mean")  (always)
/// ```
/// No clip fractions (0); `ppo_kl = masked_mean(-nkl)`.
pub fn policy_loss_sapo(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
    norm: &Normalizer,
    is_weights: Option<&Tensor>,
) -> PolicyLoss {
    let nkl = (log_prob - old_log_prob).clamp_scalar(-20.0, 20.0);
    let ratio = nkl.exp();
    let positive = advantages.gt(&advantages.zeros_like());
    let tau = positive.select(
        &advantages.full_like(cfg.tau_pos),
        &advantages.full_like(cfg.tau_neg),
    );
    let gate = (&tau * &(&ratio - 1.0)).logistic() * 4.0 / &tau;
    let pg_losses = weighted((&gate * advantages).neg(), is_weights);
    let pg_loss = agg_loss(&pg_losses, mask, LossAggMode::SeqMeanTokenMean, norm);
    unclipped(pg_loss, masked_token_mean(&nkl.neg(), mask, norm), mask)
}

/// GPG's plain policy gradient, VeRL `compute_policy_loss_gpg` (core_algos.py;
/// arXiv:2504.02546): `pg = -lp A [* IS weights]`, `pg_loss = agg_loss(pg)`. VeRL reports no
/// metrics for it; here the clip fractions are 0 and `ppo_kl = masked_mean(old_lp - lp)`.
pub fn policy_loss_gpg(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
    norm: &Normalizer,
    is_weights: Option<&Tensor>,
) -> PolicyLoss {
    let pg_losses = weighted((log_prob * advantages).neg(), is_weights);
    let pg_loss = agg_loss(&pg_losses, mask, cfg.loss_agg_mode, norm);
    unclipped(
        pg_loss,
        masked_token_mean(&(old_log_prob - log_prob), mask, norm),
        mask,
    )
}

/// CISPO, VeRL `compute_policy_loss_cispo` (core_algos.py; arXiv:2506.13585): the clipped
/// ratio is a gradient-stopped weight on REINFORCE's `A lp`, so no token loses its gradient:
///
/// ```text
/// nkl = clamp(lp - old_lp, -20, 20);  r = exp(nkl);  r_c = clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)
/// pg  = -sg(r_c) A lp [* IS weights];  pg_loss = agg_loss(pg)
/// ```
/// `pg_clipfrac = masked_mean(r != r_c)`, `pg_clipfrac_lower = 0`, `ppo_kl = masked_mean(-nkl)`.
pub fn policy_loss_cispo(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
    norm: &Normalizer,
    is_weights: Option<&Tensor>,
) -> PolicyLoss {
    let nkl = (log_prob - old_log_prob).clamp_scalar(-20.0, 20.0);
    let ratio = nkl.exp();
    let clipped = ratio.clamp_scalar(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high);
    let pg_losses = weighted(
        (clipped.stop_gradient() * advantages * log_prob).neg(),
        is_weights,
    );
    let pg_loss = agg_loss(&pg_losses, mask, cfg.loss_agg_mode, norm);
    let mut out = unclipped(pg_loss, masked_token_mean(&nkl.neg(), mask, norm), mask);
    out.pg_clipfrac = masked_token_mean(&ratio.ne(&clipped).convert(mask.dtype()), mask, norm);
    out
}

/// GMPO's geometric-mean ratio, VeRL `compute_policy_loss_geo_mean` (core_algos.py;
/// arXiv:2507.20673), per sequence `i` with `n_i = sum_t(m)`:
///
/// ```text
/// nkl   = lp - old_lp;  s = sign(A);  c = clamp(nkl, -clip_ratio_low, clip_ratio_high)
/// nkl'  = s * min(s nkl, s c)                                 (clip on the side A pushes)
/// r_i   = exp(sum_t(nkl' m) / (n_i + 1e-8));  A_i = sum_t(A m) / (n_i + 1e-8)
/// pg_i  = -A_i r_i [* exp(sum_t(log(w + 1e-10) m) / (n_i + 1e-8))]
/// pg_loss = mean_i(pg_i)          (over the mini-batch's sequences; loss_agg_mode unused)
/// ```
/// `pg_clipfrac = masked_mean((nkl != c) & A > 0)`, `pg_clipfrac_lower` the same for `A < 0`,
/// `ppo_kl = masked_mean(-nkl)`.
pub fn policy_loss_geo_mean(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
    norm: &Normalizer,
    is_weights: Option<&Tensor>,
) -> PolicyLoss {
    let nkl = log_prob - old_log_prob;
    let sign = advantages.sign();
    let nkl_clamp = nkl.clamp_scalar(-cfg.clip_ratio_low, cfg.clip_ratio_high);
    let nkl_min = &sign * &(&sign * &nkl).min(&(&sign * &nkl_clamp));
    let n = mask.sum_axis(-1, false) + 1e-8;
    let ratio = (masked(&nkl_min, mask).sum_axis(-1, false) / &n).exp();
    let advantage = masked(advantages, mask).sum_axis(-1, false) / &n;
    let mut pg_losses = (advantage * ratio).neg();
    if let Some(w) = is_weights {
        let log_w = (w + 1e-10).log();
        pg_losses = pg_losses * (masked(&log_w, mask).sum_axis(-1, false) / &n).exp();
    }
    let pg_loss = pg_losses.sum_all() / &norm.seqs;
    let dtype = mask.dtype();
    let clipped = nkl.ne(&nkl_clamp);
    let zero = advantages.zeros_like();
    let frac = |side: Tensor| masked_token_mean(&clipped.and(&side).convert(dtype), mask, norm);
    PolicyLoss {
        pg_loss,
        pg_clipfrac: frac(advantages.gt(&zero)),
        pg_clipfrac_lower: frac(advantages.lt(&zero)),
        ppo_kl: masked_token_mean(&nkl.neg(), mask, norm),
    }
}

/// The `k` highest `score`s among the `eligible` entries of a `[batch, response_len]` tensor,
/// as a boolean mask; `k` is a run-time scalar of `score`'s dtype (fewer are chosen when fewer
/// are eligible). Ties go to the earlier position (a stable sort), so exactly
/// `min(k, #eligible)` entries are chosen.
fn top_k_mask(score: &Tensor, eligible: &Tensor, k: &Tensor) -> Tensor {
    let dims = score.dims().to_vec();
    let n: i64 = dims.iter().product();
    let g = score.graph();
    let lowest = score.full_like(f64::NEG_INFINITY);
    let flat = eligible.select(score, &lowest).stop_gradient().reshape(&[n]);
    let (_, order) = flat.sort(true);
    let position = g.iota(score.dtype(), &[n], 0);
    let rank = flat.zeros_like().scatter(&order, &position, 0).reshape(&dims);
    rank.lt(k).and(eligible)
}

/// The mean of `x` over the entries `mask` marks (plain, as VeRL's `.mean()` of the selected
/// values), 0 when none is marked.
fn mean_where(x: &Tensor, mask: &Tensor) -> Tensor {
    masked(x, mask).sum_all() / mask.sum_all().max(&mask.scalar_like(1.0))
}

/// KL-Cov, VeRL `compute_policy_loss_kl_cov` (core_algos.py; arXiv:2505.22617): the
/// unclipped ratio, with a KL penalty on the tokens whose advantage and log-prob covary most:
///
/// ```text
/// nkl  = lp - old_lp;  r = exp(nkl)
/// cov  = (A - mean(A)) (sg(lp) - mean(sg(lp)))           (means over the micro-batch's tokens)
/// K    = the max(1, floor(kl_cov_ratio * #tokens)) tokens of highest cov
/// pg   = -A r + [t in K] ppo_kl_coef |nkl|   [* IS weights];   pg_loss = agg_loss(pg)
/// ```
/// `ppo_kl = masked_mean(|nkl|)` (as VeRL reports it); no clip fractions (0).
pub fn policy_loss_kl_cov(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
    norm: &Normalizer,
    is_weights: Option<&Tensor>,
) -> PolicyLoss {
    let nkl = log_prob - old_log_prob;
    let abs_kl = nkl.abs();
    let pg_losses1 = (advantages * &nkl.exp()).neg();
    let valid = mask.ne(&mask.zeros_like());
    let lp = log_prob.stop_gradient();
    let cov = (advantages - &mean_where(advantages, mask)) * (&lp - &mean_where(&lp, mask));
    let tokens = mask.sum_all();
    let k = (&tokens * cfg.kl_cov_ratio).floor().max(&tokens.scalar_like(1.0));
    let penalised = top_k_mask(&cov, &valid, &k);
    let pg_losses = penalised.select(&(&pg_losses1 + &(&abs_kl * cfg.ppo_kl_coef)), &pg_losses1);
    let pg_losses = weighted(pg_losses, is_weights);
    let pg_loss = agg_loss(&pg_losses, mask, cfg.loss_agg_mode, norm);
    unclipped(pg_loss, masked_token_mean(&abs_kl, mask, norm), mask)
}

/// Clip-Cov, VeRL `compute_policy_loss_clip_cov` (core_algos.py; arXiv:2505.22617): PPO's clip
/// (no dual clip, no ratio clamp), and a few tokens whose covariance lies in `(lb, ub)` lose
/// their gradient entirely:
///
/// ```text
/// r    = exp(lp - old_lp);  l1 = -A r;  l2 = -A clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)
/// cov  = (A - masked_mean(A)) (lp - masked_mean(sg(lp)))
/// C    = tokens with clip_cov_lb < cov < clip_cov_ub that the clip has not already clipped
/// D    = min(|C|, max(1, floor(clip_cov_ratio * #tokens))) tokens of C drawn at random
/// pg   = max(l1, l2) * [t not in D]  [* IS weights];   pg_loss = agg_loss(pg)
/// ```
/// `pg_clipfrac = masked_mean(t in D)`, `ppo_kl = masked_mean(old_lp - lp)`. VeRL draws `D`
/// with `torch.randperm`; here the draw is a Threefry stream keyed by the micro-batch's old
/// log-probs, so it is as random but a rerun (or a resumed run) draws the same tokens.
pub fn policy_loss_clip_cov(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
    norm: &Normalizer,
    is_weights: Option<&Tensor>,
) -> PolicyLoss {
    let nkl = log_prob - old_log_prob;
    let ratio = nkl.exp();
    let pg_losses1 = (advantages * &ratio).neg();
    let pg_losses2 =
        (advantages * &ratio.clamp_scalar(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)).neg();
    let valid = mask.ne(&mask.zeros_like());
    let clip_by_origin = pg_losses2.gt(&pg_losses1).and(&valid);
    let lp = log_prob.stop_gradient();
    // VeRL's masked_mean over this micro-batch alone.
    let local = Normalizer::local(mask);
    let cov = (advantages - &masked_token_mean(advantages, mask, &local))
        * (&lp - &masked_token_mean(&lp, mask, &local));
    let candidate = cov
        .gt(&cov.scalar_like(cfg.clip_cov_lb))
        .and(&cov.lt(&cov.scalar_like(cfg.clip_cov_ub)))
        .and(&valid)
        .and(&clip_by_origin.not());
    let tokens = mask.sum_all();
    let clip_num = (&tokens * cfg.clip_cov_ratio)
        .floor()
        .max(&tokens.scalar_like(1.0));
    let draw = clip_cov_draw(old_log_prob, mask);
    let dropped = top_k_mask(&draw, &candidate, &clip_num);
    let dtype = mask.dtype();
    let corr = dropped.not().convert(dtype);
    let pg_losses = weighted(pg_losses1.max(&pg_losses2) * &corr, is_weights);
    let pg_loss = agg_loss(&pg_losses, mask, cfg.loss_agg_mode, norm);
    unclipped(pg_loss, masked_token_mean(&nkl.neg(), mask, norm), mask).with_clipfrac(masked_token_mean(
        &dropped.convert(dtype),
        mask,
        norm,
    ))
}

/// Uniform `[0, 1)` numbers, one per token, from a Threefry key folded with the wrapping sum
/// of the micro-batch's old log-probs' f32 bits: fresh for every micro-batch, the same on a
/// rerun, and the same however the rows are split over devices (an integer sum is exact in
/// any order, where a float sum is not).
fn clip_cov_draw(old_log_prob: &Tensor, mask: &Tensor) -> Tensor {
    let g = mask.graph();
    let bits = old_log_prob
        .stop_gradient()
        .convert(DType::F32)
        .bitcast(DType::U32);
    let data = mask
        .ne(&mask.zeros_like())
        .select(&bits, &bits.zeros_like())
        .sum_all();
    let key = random::fold_in(&random::key_from_seed(g, CLIP_COV_SEED), &data);
    random::uniform(&key, mask.dims(), mask.dtype())
}

/// The seed of clip-cov's draws (any constant: the randomness comes from the data folded in).
const CLIP_COV_SEED: u32 = 0x05ee_dc0f;

impl PolicyLoss {
    fn with_clipfrac(mut self, pg_clipfrac: Tensor) -> PolicyLoss {
        self.pg_clipfrac = pg_clipfrac;
        self
    }
}

/// The per-micro-batch inputs of the loss, all `[batch, response_len]` of the loss dtype
/// except the normaliser scalars.
#[derive(Clone, Debug)]
pub struct LossInputs {
    /// The current policy's per-token log-probs (differentiable).
    pub log_probs: Tensor,
    /// The current policy's per-token entropy, when the policy computes it.
    pub entropy: Option<Tensor>,
    /// The log-probs of the policy that generated the batch, recomputed by the learner.
    pub old_log_probs: Tensor,
    /// Per-token advantages (0 on padding).
    pub advantages: Tensor,
    /// 1 on response tokens, 0 on padding and masked-out (truncated) responses.
    pub response_mask: Tensor,
    /// The frozen reference model's log-probs (needed when `use_kl_loss`).
    pub ref_log_probs: Option<Tensor>,
    /// Per-token rollout importance weights (gradient-free inputs; see
    /// [`crate::rollout_correction`]), when the loss applies them.
    pub rollout_is_weights: Option<Tensor>,
    /// The mini-batch denominators.
    pub norm: Normalizer,
}

/// The actor's total loss and every metric (scalars; each already the micro-batch's share of
/// the mini-batch value).
#[derive(Clone, Debug)]
pub struct ActorLoss {
    /// `pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss`: what is differentiated.
    pub loss: Tensor,
    /// The policy-gradient terms.
    pub policy: PolicyLoss,
    /// `agg_loss(kl_penalty(lp, ref_lp))`, 0 when KL is not in the loss.
    pub kl_loss: Tensor,
    /// `agg_loss(entropy)`, 0 when the policy gives no entropy.
    pub entropy: Tensor,
}

/// The critic's clipped value loss and its metrics (scalars; each the micro-batch's share of
/// the mini-batch value).
#[derive(Clone, Debug)]
pub struct ValueLoss {
    /// `vf_loss`: what is differentiated.
    pub vf_loss: Tensor,
    /// The share of tokens whose clipped term is the larger one.
    pub vf_clipfrac: Tensor,
    /// The mean prediction over the response tokens.
    pub vpred_mean: Tensor,
}

/// PPO's clipped value loss, VeRL `compute_value_loss` (core_algos.py, after TRL's PPO
/// trainer), for predictions `vpreds`, the values `values` the critic gave when the batch was
/// made and the GAE returns `returns`:
///
/// ```text
/// vclip   = clamp(vpreds, values - cliprange_value, values + cliprange_value)
/// vf_loss = 0.5 · agg_loss(max((vpreds - returns)², (vclip - returns)²))
/// ```
/// `vf_clipfrac = masked_mean((vclip - returns)² > (vpreds - returns)²)`, `vpred_mean =
/// masked_mean(vpreds)`.
pub fn value_loss(
    cfg: &ValueLossConfig,
    vpreds: &Tensor,
    values: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    norm: &Normalizer,
) -> ValueLoss {
    let c = cfg.cliprange_value;
    let clipped = vpreds.min(&(values + c)).max(&(values - c));
    let d1 = vpreds - returns;
    let d2 = &clipped - returns;
    let losses1 = &d1 * &d1;
    let losses2 = &d2 * &d2;
    let vf_loss = agg_loss(&losses1.max(&losses2), mask, cfg.loss_agg_mode, norm) * 0.5;
    let vf_clipfrac = masked_token_mean(&losses2.gt(&losses1).convert(mask.dtype()), mask, norm);
    ValueLoss {
        vf_loss,
        vf_clipfrac,
        vpred_mean: masked_token_mean(vpreds, mask, norm),
    }
}

/// The configured surrogate (one `match` on `actor.policy_loss.loss_mode`, VeRL's
/// `get_policy_loss_fn`), with optional rollout importance weights on its token losses.
pub fn policy_loss(
    cfg: &PolicyLossConfig,
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    norm: &Normalizer,
    is_weights: Option<&Tensor>,
) -> PolicyLoss {
    let surrogate = match cfg.loss_mode {
        PolicyLossMode::Vanilla => policy_loss_vanilla,
        PolicyLossMode::Gspo => policy_loss_gspo,
        PolicyLossMode::Sapo => policy_loss_sapo,
        PolicyLossMode::Gpg => policy_loss_gpg,
        PolicyLossMode::ClipCov => policy_loss_clip_cov,
        PolicyLossMode::KlCov => policy_loss_kl_cov,
        PolicyLossMode::GeoMean => policy_loss_geo_mean,
        PolicyLossMode::Cispo => policy_loss_cispo,
    };
    surrogate(old_log_prob, log_prob, advantages, mask, cfg, norm, is_weights)
}

/// The actor loss as VeRL's `dp_actor.update_policy` assembles it: the configured policy loss
/// (one `match` on `loss_mode`), minus `entropy_coeff` times the aggregated entropy, plus
/// `kl_loss_coef` times the aggregated KL to the reference policy when `use_kl_loss`. Missing
/// inputs the config asks for are a configuration error caught by the step builder; here they
/// simply leave the term out.
pub fn actor_loss(cfg: &PolicyLossConfig, inputs: &LossInputs) -> ActorLoss {
    let LossInputs {
        log_probs,
        old_log_probs,
        advantages,
        response_mask: mask,
        norm,
        ..
    } = inputs;
    let is_weights = inputs.rollout_is_weights.as_ref().map(Tensor::stop_gradient);
    let policy = policy_loss(
        cfg,
        old_log_probs,
        log_probs,
        advantages,
        mask,
        norm,
        is_weights.as_ref(),
    );
    let zero = mask.graph().scalar(0.0, mask.dtype());
    let mut loss = policy.pg_loss.clone();
    let entropy = match &inputs.entropy {
        Some(e) => {
            let agg = agg_loss(e, mask, cfg.loss_agg_mode, norm);
            if cfg.entropy_coeff != 0.0 {
                loss = loss - &agg * cfg.entropy_coeff;
            }
            agg
        }
        None => zero.clone(),
    };
    let kl_loss = match (&inputs.ref_log_probs, cfg.use_kl_loss) {
        (Some(r), true) => {
            let kld = kl_penalty(log_probs, r, cfg.kl_loss_type);
            let agg = agg_loss(&kld, mask, cfg.loss_agg_mode, norm);
            loss = loss + &agg * cfg.kl_loss_coef;
            agg
        }
        _ => zero,
    };
    ActorLoss {
        loss,
        policy,
        kl_loss,
        entropy,
    }
}
