//! Host-side advantage estimation over small arrays: one outcome score per sample plus a group
//! id per sample (the prompt the sample answers). Also the in-reward KL penalty, dynamic
//! sampling (`algorithm.filter_groups`) and masking of truncated responses.
//!
//! Token-level arrays are row-major `[batch, response_len]` slices of `f32`; the response mask
//! holds 1 for a response token and 0 for padding. Arithmetic is done in `f64`.

use std::collections::HashMap;
use std::hash::Hash;

use crate::config::{AdvantageConfig, AdvantageEstimator, KlControl, KlPenalty};
use crate::{Result, TrainerError};

/// VeRL's `epsilon` in the GRPO denominator.
pub const GRPO_EPSILON: f64 = 1e-6;

fn check_len(what: &str, expected: usize, got: usize, unit: &'static str) -> Result<()> {
    if expected != got {
        return Err(TrainerError::Length {
            what: what.to_string(),
            expected,
            got,
            unit,
        });
    }
    Ok(())
}

/// Sample indices of each group, groups in order of first appearance.
fn groups_of<K: Eq + Hash>(group_ids: &[K]) -> Vec<Vec<usize>> {
    let mut order: HashMap<&K, usize> = HashMap::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, k) in group_ids.iter().enumerate() {
        let g = *order.entry(k).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push(i);
    }
    groups
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// The mean score of a group's members.
fn group_mean(scores: &[f64], members: &[usize]) -> f64 {
    members.iter().map(|&i| scores[i]).sum::<f64>() / members.len() as f64
}

/// `torch.std`: the unbiased (n - 1) standard deviation; needs `v.len() >= 2`.
fn unbiased_std(v: &[f64]) -> f64 {
    let m = mean(v);
    (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() as f64 - 1.0)).sqrt()
}

/// GRPO's outcome advantage, VeRL `compute_grpo_outcome_advantage` (core_algos.py):
///
/// `A_i = (r_i - mean_g) / (std_g + epsilon)` with `std_g` the unbiased (n - 1) standard
/// deviation of the group's scores (`torch.std`), or `A_i = r_i - mean_g` when
/// `norm_adv_by_std_in_grpo` is false (Dr. GRPO, arXiv:2503.20783).
///
/// A group of one gets mean 0 and std 1, exactly as VeRL does, so its advantage is
/// `r / (1 + epsilon)` (or `r` for Dr. GRPO), *not* 0. A group whose rewards are all equal
/// gets 0.
pub fn grpo_outcome_advantage<K: Eq + Hash>(
    scores: &[f64],
    group_ids: &[K],
    epsilon: f64,
    norm_adv_by_std_in_grpo: bool,
) -> Result<Vec<f64>> {
    check_len("group ids", scores.len(), group_ids.len(), "sample")?;
    let mut adv = vec![0.0; scores.len()];
    for members in groups_of(group_ids) {
        let s: Vec<f64> = members.iter().map(|&i| scores[i]).collect();
        let (m, sd) = if s.len() == 1 {
            (0.0, 1.0)
        } else {
            (mean(&s), unbiased_std(&s))
        };
        for &i in &members {
            adv[i] = if norm_adv_by_std_in_grpo {
                (scores[i] - m) / (sd + epsilon)
            } else {
                scores[i] - m
            };
        }
    }
    Ok(adv)
}

/// RLOO's leave-one-out advantage, VeRL `compute_rloo_outcome_advantage` (core_algos.py):
///
/// for a group of `n > 1`, `A_i = r_i * n / (n - 1) - mean_g * n / (n - 1)`, which equals
/// `r_i - mean_{j != i} r_j`; a group of one keeps its raw score (VeRL leaves it unchanged).
pub fn rloo_outcome_advantage<K: Eq + Hash>(scores: &[f64], group_ids: &[K]) -> Result<Vec<f64>> {
    check_len("group ids", scores.len(), group_ids.len(), "sample")?;
    let mut adv = scores.to_vec();
    for members in groups_of(group_ids) {
        let n = members.len() as f64;
        if members.len() > 1 {
            let m = group_mean(scores, &members);
            for &i in &members {
                adv[i] = scores[i] * n / (n - 1.0) - m * n / (n - 1.0);
            }
        }
    }
    Ok(adv)
}

/// OPO's length-weighted baseline, VeRL `compute_opo_outcome_advantage` (core_algos.py;
/// arXiv:2505.23585): for a group of `n > 1`,
///
/// `A_i = r_i - sum_j(|o_j| r_j) / sum_j(|o_j|)`, `|o_j|` the response's token count;
///
/// a group of one keeps its raw score (baseline 0, as VeRL). A group whose responses are all
/// empty has baseline 0/0: VeRL's NaN is replaced by the plain group mean here.
pub fn opo_outcome_advantage<K: Eq + Hash>(
    scores: &[f64],
    lengths: &[f64],
    group_ids: &[K],
) -> Result<Vec<f64>> {
    check_len("group ids", scores.len(), group_ids.len(), "sample")?;
    check_len("response lengths", scores.len(), lengths.len(), "sample")?;
    let mut adv = scores.to_vec();
    for members in groups_of(group_ids) {
        if members.len() > 1 {
            let total: f64 = members.iter().map(|&i| lengths[i]).sum();
            let baseline = if total > 0.0 {
                members.iter().map(|&i| lengths[i] * scores[i]).sum::<f64>() / total
            } else {
                group_mean(scores, &members)
            };
            for &i in &members {
                adv[i] = scores[i] - baseline;
            }
        }
    }
    Ok(adv)
}

/// GPG's advantage, VeRL `compute_gpg_outcome_advantage` (core_algos.py; arXiv:2504.02546):
///
/// `A_i = alpha (r_i - mean_g) / f_norm` with `alpha = B / max(#{i : r_i != 0}, 1)` over the
/// whole batch of `B` samples and `f_norm = 1`; a group of one has mean 0.
pub fn gpg_outcome_advantage<K: Eq + Hash>(scores: &[f64], group_ids: &[K]) -> Result<Vec<f64>> {
    check_len("group ids", scores.len(), group_ids.len(), "sample")?;
    let nonzero = scores.iter().filter(|r| **r != 0.0).count().max(1);
    let alpha = scores.len() as f64 / nonzero as f64;
    let f_norm = 1.0;
    let mut adv = vec![0.0; scores.len()];
    for members in groups_of(group_ids) {
        let m = if members.len() == 1 {
            0.0
        } else {
            group_mean(scores, &members)
        };
        for &i in &members {
            adv[i] = alpha * (scores[i] - m) / f_norm;
        }
    }
    Ok(adv)
}

/// Pass@k training's advantage, VeRL `compute_grpo_passk_outcome_advantage` (core_algos.py;
/// arXiv:2503.19595): in each group only the best response gets a non-zero advantage,
///
/// `A_best = (r_max - r_second) / (std_g + epsilon)` (or `r_max - r_second` without
/// `norm_adv_by_std_in_grpo`), `std_g` the unbiased standard deviation; ties go to the first.
///
/// VeRL raises on a group of one; `rollout.n >= 2` is checked when the recipe is loaded, and a
/// group left with one sample (its others dropped as non-finite) gets 0 here.
pub fn grpo_passk_outcome_advantage<K: Eq + Hash>(
    scores: &[f64],
    group_ids: &[K],
    epsilon: f64,
    norm_adv_by_std_in_grpo: bool,
) -> Result<Vec<f64>> {
    check_len("group ids", scores.len(), group_ids.len(), "sample")?;
    let mut adv = vec![0.0; scores.len()];
    for members in groups_of(group_ids) {
        if members.len() < 2 {
            continue;
        }
        let mut order = members.clone();
        // Stable: among equal scores the first keeps its place.
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        let margin = scores[order[0]] - scores[order[1]];
        adv[order[0]] = if norm_adv_by_std_in_grpo {
            let s: Vec<f64> = members.iter().map(|&i| scores[i]).collect();
            margin / (unbiased_std(&s) + epsilon)
        } else {
            margin
        };
    }
    Ok(adv)
}

/// VeRL `masked_whiten` (verl/utils/torch_functional.py) in place: with
/// `mu = sum(x m) / (sum(m) + 1e-8)` and the unbiased `var = sum((x - mu)^2 m) / (sum(m) +
/// 1e-8) * n / (n - 1)`, `x <- (x - mu) / sqrt(var + 1e-8)` on every entry (the caller masks
/// afterwards). VeRL raises when fewer than two entries are unmasked; here the values become
/// 0, as no baseline can be formed.
fn masked_whiten(values: &mut [f64], mask: &[f32]) {
    let n: f64 = mask.iter().map(|m| *m as f64).sum();
    if n < 2.0 {
        values.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    let masked_mean = |v: &dyn Fn(usize) -> f64| {
        (0..values.len())
            .filter(|&t| mask[t] != 0.0)
            .map(|t| v(t) * mask[t] as f64)
            .sum::<f64>()
            / (n + 1e-8)
    };
    let mu = masked_mean(&|t| values[t]);
    let var = masked_mean(&|t| (values[t] - mu) * (values[t] - mu)) * n / (n - 1.0);
    let scale = 1.0 / (var + 1e-8).sqrt();
    values.iter_mut().for_each(|v| *v = (*v - mu) * scale);
}

/// Generalized advantage estimation, VeRL `compute_gae_advantage_return` (core_algos.py;
/// Schulman et al., arXiv:1506.02438), from the last position back with `V_{t+1}` and `Â_{t+1}`
/// those of the next token the model wrote (positions with mask 0 (padding, a multi-turn
/// sample's environment tokens) are skipped: they carry both through unchanged):
///
/// ```text
/// δ_t = r_t + γ V_{t+1} - V_t
/// Â_t = δ_t + γ λ Â_{t+1}
/// returns = Â + V;   A = masked_whiten(Â, m)
/// ```
/// `values` are the critic's `[batch, response_len]` predictions (0 on padding, as VeRL's
/// `compute_values` masks them). Returns `(advantages, returns)`, row-major; as in VeRL the
/// whitened advantages are not masked again (the loss mask does that).
pub fn gae_advantage_return(
    token_level_rewards: &[f32],
    values: &[f32],
    response_mask: &[f32],
    response_len: usize,
    gamma: f64,
    lam: f64,
) -> Result<(Vec<f64>, Vec<f64>)> {
    check_len("critic values", token_level_rewards.len(), values.len(), "token")?;
    check_len(
        "response mask",
        token_level_rewards.len(),
        response_mask.len(),
        "token",
    )?;
    let l = response_len.max(1);
    let mut adv = vec![0.0f64; token_level_rewards.len()];
    for b in 0..token_level_rewards.len() / l {
        let (mut next_value, mut last) = (0.0f64, 0.0f64);
        for t in (b * l..(b + 1) * l).rev() {
            let (v, m) = (values[t] as f64, response_mask[t] as f64);
            let delta = token_level_rewards[t] as f64 + gamma * next_value - v;
            let here = delta + gamma * lam * last;
            next_value = v * m + (1.0 - m) * next_value;
            last = here * m + (1.0 - m) * last;
            adv[t] = last;
        }
    }
    let returns: Vec<f64> = adv.iter().zip(values).map(|(a, v)| a + *v as f64).collect();
    masked_whiten(&mut adv, response_mask);
    Ok((adv, returns))
}

/// REINFORCE++'s advantage, VeRL `compute_reinforce_plus_plus_outcome_advantage`
/// (core_algos.py; arXiv:2501.03262): discounted returns that restart after the response,
///
/// `G_t = r_t + gamma G_{t+1} m_t` (from the last position back), then
/// `A = masked_whiten(G, m) * m` over every token of the batch.
///
/// Returns `(advantages, returns)`, row-major `[batch, response_len]`.
pub fn reinforce_plus_plus_advantage(
    token_level_rewards: &[f32],
    response_mask: &[f32],
    response_len: usize,
    gamma: f64,
) -> Result<(Vec<f64>, Vec<f64>)> {
    check_len(
        "response mask",
        token_level_rewards.len(),
        response_mask.len(),
        "token",
    )?;
    let l = response_len.max(1);
    let mut returns = vec![0.0f64; token_level_rewards.len()];
    for (b, row) in token_level_rewards.chunks(l).enumerate() {
        let mut running = 0.0f64;
        for t in (0..row.len()).rev() {
            running = row[t] as f64 + gamma * running;
            returns[b * l + t] = running;
            running *= response_mask[b * l + t] as f64;
        }
    }
    let mut adv = returns.clone();
    masked_whiten(&mut adv, response_mask);
    for (a, m) in adv.iter_mut().zip(response_mask) {
        *a *= *m as f64;
    }
    Ok((adv, returns))
}

/// REINFORCE++ with a group baseline, VeRL
/// `compute_reinforce_plus_plus_baseline_outcome_advantage` (core_algos.py;
/// arXiv:2501.03262):
///
/// `a_i = r_i - mean_g` (mean 0 for a group of one), broadcast over the response, then
/// `A = masked_whiten(a m, m) * m` over every token of the batch.
pub fn reinforce_plus_plus_baseline_advantage<K: Eq + Hash>(
    scores: &[f64],
    group_ids: &[K],
    response_mask: &[f32],
    response_len: usize,
) -> Result<Vec<f64>> {
    check_len("group ids", scores.len(), group_ids.len(), "sample")?;
    check_len(
        "response mask",
        scores.len() * response_len,
        response_mask.len(),
        "token",
    )?;
    let mut centred = scores.to_vec();
    for members in groups_of(group_ids) {
        if members.len() > 1 {
            let m = group_mean(scores, &members);
            for &i in &members {
                centred[i] = scores[i] - m;
            }
        }
    }
    let mut adv: Vec<f64> = response_mask
        .iter()
        .enumerate()
        .map(|(t, m)| centred[t / response_len] * *m as f64)
        .collect();
    masked_whiten(&mut adv, response_mask);
    for (a, m) in adv.iter_mut().zip(response_mask) {
        *a *= *m as f64;
    }
    Ok(adv)
}

/// ReMax's advantage, VeRL `compute_remax_outcome_advantage` (core_algos.py;
/// arXiv:2310.10505): the return to go less the reward `b` of the prompt's greedy response,
///
/// `G_t = sum_{s >= t} r_s m_s`, `A_t = G_t - b m_t`.
///
/// Returns `(advantages, returns)`, row-major `[batch, response_len]`.
pub fn remax_advantage(
    token_level_rewards: &[f32],
    response_mask: &[f32],
    response_len: usize,
    reward_baselines: &[f64],
) -> Result<(Vec<f64>, Vec<f64>)> {
    check_len(
        "response mask",
        token_level_rewards.len(),
        response_mask.len(),
        "token",
    )?;
    check_len(
        "reward baselines",
        token_level_rewards.len() / response_len.max(1),
        reward_baselines.len(),
        "sample",
    )?;
    let l = response_len.max(1);
    let mut returns = vec![0.0f64; token_level_rewards.len()];
    let mut adv = vec![0.0f64; token_level_rewards.len()];
    for (b, baseline) in reward_baselines.iter().enumerate() {
        let mut running = 0.0;
        for t in (b * l..(b + 1) * l).rev() {
            let m = response_mask[t] as f64;
            running += token_level_rewards[t] as f64 * m;
            returns[t] = running;
            adv[t] = running - baseline * m;
        }
    }
    Ok((adv, returns))
}

/// A batch's advantages and returns, row-major `[batch, response_len]`, 0 on padding.
#[derive(Clone, Debug, PartialEq)]
pub struct Advantages {
    pub advantages: Vec<f64>,
    /// What VeRL reports as `critic/returns/*`: the advantages themselves for the outcome
    /// estimators, the discounted returns for `reinforce_plus_plus`, and for `gae` the
    /// critic's regression targets.
    pub returns: Vec<f64>,
}

/// The advantages of the configured estimator (one `match`), as VeRL's `compute_advantage`
/// (ray_trainer.py) calls it: from the token-level rewards (the outcome reward on each
/// response's last token, less any in-reward KL), the response mask and each sample's group
/// (the prompt it answers); `remax` also needs each sample's reward baseline, the reward of its
/// prompt's greedy response; `gae` the critic's values of each response token.
pub fn compute_advantages<K: Eq + Hash>(
    cfg: &AdvantageConfig,
    token_level_rewards: &[f32],
    response_mask: &[f32],
    response_len: usize,
    group_ids: &[K],
    reward_baselines: Option<&[f64]>,
    values: Option<&[f32]>,
) -> Result<Advantages> {
    check_len(
        "response mask",
        group_ids.len() * response_len,
        response_mask.len(),
        "token",
    )?;
    check_len(
        "token-level rewards",
        response_mask.len(),
        token_level_rewards.len(),
        "token",
    )?;
    let scores = sequence_scores(token_level_rewards, response_len);
    let per_sample = match cfg.estimator {
        AdvantageEstimator::Grpo => {
            grpo_outcome_advantage(&scores, group_ids, GRPO_EPSILON, cfg.norm_adv_by_std_in_grpo)?
        }
        AdvantageEstimator::Rloo => rloo_outcome_advantage(&scores, group_ids)?,
        AdvantageEstimator::Opo => {
            let lengths: Vec<f64> = response_mask
                .chunks(response_len.max(1))
                .map(|row| row.iter().map(|m| *m as f64).sum())
                .collect();
            opo_outcome_advantage(&scores, &lengths, group_ids)?
        }
        AdvantageEstimator::Gpg => gpg_outcome_advantage(&scores, group_ids)?,
        AdvantageEstimator::GrpoPassk => {
            grpo_passk_outcome_advantage(&scores, group_ids, GRPO_EPSILON, cfg.norm_adv_by_std_in_grpo)?
        }
        AdvantageEstimator::ReinforcePlusPlus => {
            let (advantages, returns) =
                reinforce_plus_plus_advantage(token_level_rewards, response_mask, response_len, cfg.gamma)?;
            return Ok(Advantages { advantages, returns });
        }
        AdvantageEstimator::Remax => {
            let baselines = reward_baselines.ok_or_else(|| TrainerError::Config {
                key: "algorithm.adv_estimator",
                value: "remax".into(),
                message: "needs each sample's greedy reward baseline, which this batch lacks".into(),
            })?;
            let (advantages, returns) =
                remax_advantage(token_level_rewards, response_mask, response_len, baselines)?;
            return Ok(Advantages { advantages, returns });
        }
        AdvantageEstimator::Gae => {
            let values = values.ok_or_else(|| TrainerError::Config {
                key: "algorithm.adv_estimator",
                value: "gae".into(),
                message: "needs the critic's values of every response token, which this batch lacks".into(),
            })?;
            let (advantages, returns) = gae_advantage_return(
                token_level_rewards,
                values,
                response_mask,
                response_len,
                cfg.gamma,
                cfg.lam,
            )?;
            return Ok(Advantages { advantages, returns });
        }
        AdvantageEstimator::ReinforcePlusPlusBaseline => {
            let advantages =
                reinforce_plus_plus_baseline_advantage(&scores, group_ids, response_mask, response_len)?;
            return Ok(Advantages {
                returns: advantages.clone(),
                advantages,
            });
        }
    };
    let advantages: Vec<f64> = response_mask
        .iter()
        .enumerate()
        .map(|(t, m)| per_sample[t / response_len] * *m as f64)
        .collect();
    Ok(Advantages {
        returns: advantages.clone(),
        advantages,
    })
}

/// `A.unsqueeze(-1) * response_mask`: each sample's advantage on each of its response tokens,
/// 0 on padding; row-major `[batch, response_len]`.
pub fn broadcast_over_response(
    advantages: &[f64],
    response_mask: &[f32],
    response_len: usize,
) -> Result<Vec<f32>> {
    check_len(
        "response mask",
        advantages.len() * response_len,
        response_mask.len(),
        "token",
    )?;
    Ok(response_mask
        .iter()
        .enumerate()
        .map(|(t, m)| (advantages[t / response_len] * *m as f64) as f32)
        .collect())
}

/// Token-level scores with each sample's outcome reward on its last response token (where
/// VeRL's reward manager puts it) and 0 elsewhere. An empty response gets no reward.
pub fn outcome_token_scores(rewards: &[f64], response_mask: &[f32], response_len: usize) -> Result<Vec<f32>> {
    check_len(
        "response mask",
        rewards.len() * response_len,
        response_mask.len(),
        "token",
    )?;
    let mut out = vec![0.0f32; response_mask.len()];
    for (b, r) in rewards.iter().enumerate() {
        let row = &response_mask[b * response_len..(b + 1) * response_len];
        if let Some(last) = row.iter().rposition(|m| *m != 0.0) {
            out[b * response_len + last] = *r as f32;
        }
    }
    Ok(out)
}

/// Row sums of a `[batch, response_len]` token-level reward array (VeRL
/// `token_level_rewards.sum(dim=-1)`).
pub fn sequence_scores(token_level_rewards: &[f32], response_len: usize) -> Vec<f64> {
    token_level_rewards
        .chunks(response_len.max(1))
        .map(|row| row.iter().map(|x| *x as f64).sum())
        .collect()
}

/// One token's KL estimate, VeRL `kl_penalty` (core_algos.py), on the host in `f64`:
/// `k1 = lp - ref`; `abs = |lp - ref|`; `k2 = 0.5 (lp - ref)^2`;
/// `k3 = clamp(exp(d) - d - 1, -10, 10)` with `d = clamp(ref - lp, -20, 20)`.
pub fn kl_penalty_value(kind: KlPenalty, log_prob: f64, ref_log_prob: f64) -> f64 {
    match kind {
        KlPenalty::K1 => log_prob - ref_log_prob,
        KlPenalty::Abs => (log_prob - ref_log_prob).abs(),
        KlPenalty::K2 => 0.5 * (log_prob - ref_log_prob).powi(2),
        KlPenalty::K3 => {
            let d = (ref_log_prob - log_prob).clamp(-20.0, 20.0);
            (d.exp() - d - 1.0).clamp(-10.0, 10.0)
        }
    }
}

/// The in-reward KL penalty (`algorithm.use_kl_in_reward`), VeRL `apply_kl_penalty`
/// (ray_trainer.py): `kld = kl_penalty(old_lp, ref_lp) * mask`,
/// `token_level_rewards = token_level_scores - kl_coef * kld`. Returns the rewards and the
/// reported `actor/reward_kl_penalty` metric, the batch mean of each row's masked-mean `kld`
/// (`masked_mean(kld, mask, axis=-1).mean()`, denominators `+ 1e-8` as VeRL's `masked_mean`).
pub fn apply_kl_in_reward(
    token_level_scores: &[f32],
    old_log_probs: &[f32],
    ref_log_probs: &[f32],
    response_mask: &[f32],
    response_len: usize,
    kind: KlPenalty,
    kl_coef: f64,
) -> Result<(Vec<f32>, f64)> {
    let n = token_level_scores.len();
    check_len("old log-probs", n, old_log_probs.len(), "token")?;
    check_len("reference log-probs", n, ref_log_probs.len(), "token")?;
    check_len("response mask", n, response_mask.len(), "token")?;
    let mut rewards = vec![0.0f32; n];
    let mut row_means = Vec::new();
    for (b, row) in response_mask.chunks(response_len.max(1)).enumerate() {
        let (mut s, mut cnt) = (0.0, 0.0);
        for (j, m) in row.iter().enumerate() {
            let t = b * response_len + j;
            let m = *m as f64;
            let kld = if m != 0.0 {
                kl_penalty_value(kind, old_log_probs[t] as f64, ref_log_probs[t] as f64) * m
            } else {
                0.0
            };
            rewards[t] = (token_level_scores[t] as f64 - kl_coef * kld) as f32;
            s += kld;
            cnt += m;
        }
        row_means.push(s / (cnt + 1e-8));
    }
    let current_kl = if row_means.is_empty() {
        0.0
    } else {
        mean(&row_means)
    };
    Ok((rewards, current_kl))
}

/// The in-reward KL coefficient over a run (`algorithm.kl_ctrl`, VeRL's `FixedKLController` /
/// `AdaptiveKLController`); its value is part of a checkpoint, so a resumed run goes on as one
/// that never stopped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KlController {
    pub control: KlControl,
    /// The coefficient the next step's penalty uses.
    pub value: f64,
}

impl KlController {
    /// After a step whose mean KL was `current_kl` over `n_steps` sequences (VeRL passes the
    /// batch size): `e = clip(current_kl / target_kl - 1, -0.2, 0.2)`,
    /// `value <- value * (1 + e * n_steps / horizon)`; a fixed controller keeps its value.
    pub fn update(&mut self, current_kl: f64, n_steps: usize) {
        if let KlControl::Adaptive { target_kl, horizon } = self.control {
            let error = (current_kl / target_kl - 1.0).clamp(-0.2, 0.2);
            self.value *= 1.0 + error * n_steps as f64 / horizon;
        }
    }
}

/// Dynamic sampling (`algorithm.filter_groups`, DAPO; VeRL `ray_trainer.py` /
/// `recipe/dapo`): the indices of the samples to keep, dropping every group whose metric
/// (usually the outcome reward) has zero variance, since all its advantages are 0. A group of
/// one is kept, as DAPO keeps it. Order is preserved.
pub fn filter_groups<K: Eq + Hash>(metric: &[f64], group_ids: &[K]) -> Result<Vec<usize>> {
    check_len("group ids", metric.len(), group_ids.len(), "sample")?;
    let mut keep = vec![false; metric.len()];
    for members in groups_of(group_ids) {
        let first = metric[members[0]];
        let varies = members.iter().any(|&i| metric[i] != first);
        if varies || members.len() == 1 {
            for &i in &members {
                keep[i] = true;
            }
        }
    }
    Ok((0..metric.len()).filter(|&i| keep[i]).collect())
}

/// Masks truncated responses out of the loss (DAPO's overlong filtering): zeroes the response
/// mask row of every sample whose `truncated` flag is set (it hit `max_response_length`
/// without a stop token). Returns how many rows were masked.
pub fn mask_truncated(response_mask: &mut [f32], response_len: usize, truncated: &[bool]) -> Result<usize> {
    check_len(
        "response mask",
        truncated.len() * response_len,
        response_mask.len(),
        "token",
    )?;
    let mut n = 0;
    for (row, t) in response_mask.chunks_mut(response_len.max(1)).zip(truncated) {
        if *t {
            row.iter_mut().for_each(|m| *m = 0.0);
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!((a - b).abs() <= tol, "element {i}: got {a}, want {b}");
        }
    }

    /// VeRL's `AdaptiveKLController` itself, run on fixed inputs by
    /// `tests/fixtures/make_verl_kl_controller.py` (VeRL commit in the fixture).
    #[test]
    fn adaptive_kl_controller_matches_verls() {
        let fixture: serde_json::Value =
            serde_json::from_str(include_str!("../tests/fixtures/verl_kl_controller.json")).unwrap();
        assert_eq!(fixture["verl_commit"], "b178a3cd56f58b2d502255daba591e92833930a7");
        let num = |v: &serde_json::Value| v.as_f64().unwrap();
        for case in fixture["cases"].as_array().unwrap() {
            let mut c = KlController {
                control: KlControl::Adaptive {
                    target_kl: num(&case["target_kl"]),
                    horizon: num(&case["horizon"]),
                },
                value: num(&case["init_kl_coef"]),
            };
            let n = case["n_steps"].as_u64().unwrap() as usize;
            let mut got = Vec::new();
            for kl in case["current_kl"].as_array().unwrap() {
                c.update(num(kl), n);
                got.push(c.value);
            }
            let want: Vec<f64> = case["values_after"].as_array().unwrap().iter().map(num).collect();
            close(&got, &want, 1e-15);
        }
        let mut fixed = KlController {
            control: KlControl::Fixed,
            value: 0.3,
        };
        fixed.update(5.0, 100);
        assert_eq!(fixed.value, 0.3);
    }

    #[test]
    fn grpo_matches_a_hand_computation() {
        // group "a": [1, 0, 1, 0] -> mean 0.5, unbiased std sqrt(1/3) = 0.5773502691896258
        // group "b": [2, 2] (all equal) -> 0
        // group "c": [3] (group of one) -> mean 0, std 1 -> 3 / (1 + 1e-6)
        let scores = [1.0, 0.0, 2.0, 1.0, 3.0, 0.0, 2.0];
        let ids = ["a", "a", "b", "a", "c", "a", "b"];
        let adv = grpo_outcome_advantage(&scores, &ids, 1e-6, true).unwrap();
        let a = 0.5 / (0.5773502691896258 + 1e-6);
        close(&adv, &[a, -a, 0.0, a, 3.0 / 1.000001, -a, 0.0], 1e-12);
        // Dr. GRPO: mean only.
        let adv = grpo_outcome_advantage(&scores, &ids, 1e-6, false).unwrap();
        close(&adv, &[0.5, -0.5, 0.0, 0.5, 3.0, -0.5, 0.0], 1e-12);
        // Integer group ids work the same.
        let adv = grpo_outcome_advantage(&[0.0, 3.0, 6.0], &[7u64, 7, 7], 1e-6, true).unwrap();
        // mean 3, std 3 -> [-1, 0, 1] / (1 + 1e-6 / 3)
        close(&adv, &[-3.0 / 3.000001, 0.0, 3.0 / 3.000001], 1e-12);
    }

    #[test]
    fn rloo_matches_a_hand_computation() {
        // group "a": [1, 0, 2] -> A_i = r_i - mean of the others: [1 - 1, 0 - 1.5, 2 - 0.5]
        // group "b": [5] -> unchanged.
        // Through compute_advantages, on one-token responses.
        let cfg = AdvantageConfig {
            estimator: AdvantageEstimator::Rloo,
            ..Default::default()
        };
        let adv = compute_advantages(
            &cfg,
            &[1.0, 0.0, 5.0, 2.0],
            &[1.0; 4],
            1,
            &["a", "a", "b", "a"],
            None,
            None,
        )
        .unwrap();
        close(&adv.advantages, &[0.0, -1.5, 5.0, 1.5], 1e-12);
        assert_eq!(adv.returns, adv.advantages);
        let adv = rloo_outcome_advantage(&[4.0, 4.0], &[1, 1]).unwrap();
        close(&adv, &[0.0, 0.0], 1e-12);
    }

    /// The cases VeRL raises on or divides 0 by 0 in, which a run must survive.
    #[test]
    fn degenerate_groups_get_zero_not_nan() {
        // pass@k: a group of one (its others dropped) gets 0; VeRL raises.
        let adv = grpo_passk_outcome_advantage(&[1.0, 0.0, 3.0], &[1, 1, 2], 1e-6, true).unwrap();
        close(&adv, &[1.0 / (0.5f64.sqrt() + 1e-6), 0.0, 0.0], 1e-12);
        // OPO: a group of empty responses uses the plain mean.
        let adv = opo_outcome_advantage(&[1.0, 0.0], &[0.0, 0.0], &[1, 1]).unwrap();
        close(&adv, &[0.5, -0.5], 1e-12);
        // Whitening over fewer than two tokens: 0.
        let cfg = AdvantageConfig {
            estimator: AdvantageEstimator::ReinforcePlusPlus,
            ..Default::default()
        };
        let adv = compute_advantages(&cfg, &[2.0, 0.0], &[1.0, 0.0], 2, &[1], None, None).unwrap();
        assert_eq!(adv.advantages, vec![0.0, 0.0]);
        assert_eq!(adv.returns, vec![2.0, 0.0]);
        // GPG: all rewards zero leaves alpha = B / 1.
        let adv = gpg_outcome_advantage(&[0.0, 0.0, 0.0], &[1, 1, 2]).unwrap();
        close(&adv, &[0.0, 0.0, 0.0], 1e-12);
    }

    /// REINFORCE++'s returns restart after each response and are discounted by gamma.
    #[test]
    fn reinforce_plus_plus_returns_are_discounted_within_a_response() {
        // two rows of length 3: [1, 0, 2 | pad] lengths 2 and 3
        let rewards = [1.0, 0.5, 9.0, 0.0, 0.0, 2.0];
        let mask = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0];
        let (_, returns) = reinforce_plus_plus_advantage(&rewards, &mask, 3, 0.5).unwrap();
        // row 0: G_2 = 9 (padding), G_1 = 0.5 + 0.5 * 9 * 0 (reset after the mask ends) = 0.5,
        //        G_0 = 1 + 0.5 * 0.5 = 1.25; row 1: [0.5, 1, 2]
        close(&returns, &[1.25, 0.5, 9.0, 0.5, 1.0, 2.0], 1e-12);
    }

    #[test]
    fn advantages_broadcast_over_the_response_mask() {
        let mask = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let out = broadcast_over_response(&[2.0, -1.0, 7.0], &mask, 3).unwrap();
        assert_eq!(out, vec![2.0, 2.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        let err = broadcast_over_response(&[2.0], &mask, 3).unwrap_err().to_string();
        assert_eq!(
            err,
            "response mask: expected 3 values, got 9; pass one value per token"
        );
        let err = grpo_outcome_advantage(&[1.0, 2.0], &[1], 1e-6, true)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "group ids: expected 2 values, got 1; pass one value per sample"
        );
    }

    #[test]
    fn outcome_scores_sit_on_the_last_response_token() {
        let mask = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let s = outcome_token_scores(&[3.0, 4.0], &mask, 3).unwrap();
        assert_eq!(s, vec![0.0, 3.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(sequence_scores(&s, 3), vec![3.0, 0.0]);
    }

    #[test]
    fn kl_estimators_match_hand_values() {
        // lp = -1, ref = -1.5: d = lp - ref = 0.5
        assert!((kl_penalty_value(KlPenalty::K1, -1.0, -1.5) - 0.5).abs() < 1e-15);
        assert!((kl_penalty_value(KlPenalty::Abs, -1.5, -1.0) - 0.5).abs() < 1e-15);
        assert!((kl_penalty_value(KlPenalty::K2, -1.0, -1.5) - 0.125).abs() < 1e-15);
        // k3: x = ref - lp = -0.5: exp(-0.5) + 0.5 - 1 = 0.10653065971263342
        assert!((kl_penalty_value(KlPenalty::K3, -1.0, -1.5) - 0.10653065971263342).abs() < 1e-15);
        // clamps: ref - lp = 30 -> 20 -> exp(20) - 21 -> clamped to 10
        assert_eq!(kl_penalty_value(KlPenalty::K3, -31.0, -1.0), 10.0);
        // ref - lp = -30 -> -20 -> exp(-20) + 19 -> clamped to 10
        assert_eq!(kl_penalty_value(KlPenalty::K3, -1.0, -31.0), 10.0);
    }

    #[test]
    fn kl_in_reward_subtracts_the_masked_penalty() {
        // two samples, len 2; second has one token.
        let scores = [0.0, 1.0, 2.0, 0.0];
        let old = [-1.0, -2.0, -0.5, -9.0];
        let refl = [-1.5, -1.0, -0.5, 0.0];
        let mask = [1.0, 1.0, 1.0, 0.0];
        let (r, kl) = apply_kl_in_reward(&scores, &old, &refl, &mask, 2, KlPenalty::K1, 0.1).unwrap();
        // kld = [0.5, -1.0, 0, (masked) 0]
        let want = [0.0 - 0.05, 1.0 + 0.1, 2.0, 0.0];
        for (a, b) in r.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{r:?}");
        }
        // row means: (0.5 - 1) / 2 = -0.25 and 0 / 1 = 0 -> mean -0.125
        assert!((kl + 0.125).abs() < 1e-7, "{kl}");
    }

    #[test]
    fn filter_groups_drops_zero_variance_groups_and_keeps_singletons() {
        let acc = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0];
        let ids = ["a", "a", "b", "b", "c", "c", "d"];
        assert_eq!(filter_groups(&acc, &ids).unwrap(), vec![2, 3, 6]);
        assert_eq!(filter_groups(&[1.0, 1.0], &[0, 0]).unwrap(), Vec::<usize>::new());
    }

    #[test]
    fn truncated_responses_are_masked_out() {
        let mut mask = vec![1.0, 1.0, 1.0, 1.0, 1.0, 0.0];
        assert_eq!(mask_truncated(&mut mask, 3, &[true, false]).unwrap(), 1);
        assert_eq!(mask, vec![0.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
    }
}
