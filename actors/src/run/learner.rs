//! The learner side of a step in this process: from scored samples to an optimizer update.
//!
//! VeRL's order within `fit()`: recompute the old log-probs with the current policy (unless
//! the rollout's are trusted), the reference log-probs when a KL term needs them, the KL
//! penalty in the reward (optional), the advantages per prompt group, then `ppo_epochs`
//! passes over mini-batches of `ppo_mini_batch_size * rollout.n` samples, one optimizer step
//! each, accumulating `ppo_micro_batch_size` rows at a time on the device.

use crate::recipe::Recipe;
use crate::setup::dtype;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use trainer::advantage::{
    apply_kl_in_reward, broadcast_over_response, compute_advantages, filter_groups, mask_truncated,
    outcome_token_scores, sequence_scores,
};
use trainer::checkpoint::HostTensor;
use trainer::config::{KlPenalty, OptimConfig, PolicyLossConfig};
use trainer::optim::learning_rate;
use trainer::policy::DecoderPolicy;
use trainer::step::{
    build_train_programs, mini_batch_normalizer, HostArray, Learner, LearnerState, MicroBatchHost, ParamSpec,
    StepConfig,
};
use xla::runtime::{Buffer, Client};

/// One scored sample, as the learner needs it.
#[derive(Clone, Debug)]
pub struct Row {
    /// The prompt's group (its request id): advantages are normalised within a group.
    pub group: u64,
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
    /// The rollout's log-prob of each response token.
    pub rollout_log_probs: Vec<f32>,
    /// The outcome reward.
    pub score: f64,
    /// Stopped by the length limit rather than a stop token.
    pub truncated: bool,
}

/// What one update did: metrics by name (VeRL's names) and the tokens it trained on.
#[derive(Clone, Debug, Default)]
pub struct UpdateReport {
    pub metrics: BTreeMap<String, f64>,
    /// Response tokens in the loss, times passes over them (`ppo_epochs`).
    pub trained_tokens: usize,
    /// Prompt + response tokens through forward and backward.
    pub processed_tokens: usize,
    /// Optimizer steps taken.
    pub optimizer_steps: u64,
}

/// Errors of the learner side.
#[derive(Debug, thiserror::Error)]
pub enum LearnerError {
    #[error(transparent)]
    Trainer(#[from] trainer::TrainerError),
    #[error(transparent)]
    Pack(#[from] trainer::policy::PackError),
    #[error("{0}")]
    Batch(String),
}

type Result<T> = std::result::Result<T, LearnerError>;

/// The learner of a run: the device learner, its policy shapes and the recipe's knobs.
pub struct LocalLearner {
    learner: Learner,
    policy: DecoderPolicy,
    specs: Vec<ParamSpec>,
    optim: OptimConfig,
    recipe: Recipe,
    /// Optimizer steps so far (the learning-rate schedule's clock).
    optimizer_steps: u64,
}

/// The step configuration of a recipe.
pub fn step_config(recipe: &Recipe, total_optimizer_steps: u64) -> StepConfig {
    let a = &recipe.actor;
    StepConfig {
        loss: PolicyLossConfig {
            loss_mode: a.policy_loss.loss_mode,
            clip_ratio_low: a.clip_ratio_low,
            clip_ratio_high: a.clip_ratio_high,
            clip_ratio_c: a.clip_ratio_c,
            loss_agg_mode: a.loss_agg_mode,
            use_kl_loss: a.use_kl_loss,
            kl_loss_coef: a.kl_loss_coef,
            kl_loss_type: a.kl_loss_type,
            entropy_coeff: a.entropy_coeff,
            rollout_is_threshold: recipe.algorithm.rollout_is_threshold,
            rollout_is_veto_threshold: None,
        },
        optim: OptimConfig {
            lr: a.optim.lr,
            betas: a.optim.betas,
            eps: a.optim.eps,
            weight_decay: a.optim.weight_decay,
            grad_clip: (a.grad_clip > 0.0).then_some(a.grad_clip),
            lr_warmup_steps: a.optim.lr_warmup_steps as u64,
            warmup_style: a.optim.lr_scheduler_type,
            min_lr_ratio: a.optim.min_lr_ratio,
            num_cycles: 0.5,
            total_training_steps: total_optimizer_steps,
        },
        compute_dtype: dtype(a.param_dtype),
        micro_batch_size: a.ppo_micro_batch_size as i64,
        response_len: recipe.data.max_response_length as i64,
    }
}

impl LocalLearner {
    /// Builds the programs and uploads `state` (the model's weights with zero optimizer state
    /// for a new run, or a checkpoint's). `reference` are the frozen initial weights, needed
    /// when a KL term is on. `optimizer_steps` is the schedule's clock at `state`.
    pub fn new(
        client: &Client,
        recipe: &Recipe,
        config: &model::ModelConfig,
        state: &LearnerState,
        reference: Option<&[Vec<f32>]>,
        optimizer_steps: u64,
        total_optimizer_steps: u64,
    ) -> Result<LocalLearner> {
        let policy = DecoderPolicy {
            config: config.clone(),
            prompt_len: recipe.data.max_prompt_length,
            response_len: recipe.data.max_response_length,
            micro_batch_size: recipe.actor.ppo_micro_batch_size,
            temperature: recipe.rollout.temperature as f32,
        };
        let cfg = step_config(recipe, total_optimizer_steps);
        let specs = policy.param_specs();
        let p = policy.clone();
        let programs = build_train_programs(&cfg, &specs, &policy.input_specs(), move |params, batch| {
            p.log_probs(params, batch)
        })?;
        let mut learner = Learner::from_state(
            client,
            programs,
            &specs,
            &cfg,
            state,
            recipe.actor.max_consecutive_nonfinite as u32,
        )?;
        if let Some(r) = reference {
            learner.set_reference(r)?;
        }
        Ok(LocalLearner {
            learner,
            policy,
            specs,
            optim: cfg.optim,
            recipe: recipe.clone(),
            optimizer_steps,
        })
    }

    /// Whether a run with this recipe needs the reference model's log-probs.
    pub fn needs_reference(recipe: &Recipe) -> bool {
        recipe.actor.use_kl_loss || recipe.algorithm.use_kl_in_reward
    }

    /// The parameter table.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// The parameters for a rollout engine on the same device (shared, not copied).
    pub fn shared_params(&self) -> Arc<[Buffer]> {
        self.learner.shared_params()
    }

    /// Optimizer steps so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps
    }

    /// The checkpoint tensor files of the learner's state.
    pub fn tensor_files(&self) -> Result<Vec<(&'static str, Vec<HostTensor>)>> {
        Ok(self.learner.state()?.to_tensor_files(&self.specs))
    }

    /// One GRPO update from the scored samples of a step.
    pub fn update(&mut self, rows: &[Row]) -> Result<UpdateReport> {
        let r = &self.recipe;
        let l = self.policy.response_len;
        let mut report = UpdateReport::default();
        let m = &mut report.metrics;
        if rows.is_empty() {
            return Err(LearnerError::Batch("no samples to train on".into()));
        }
        // Dynamic sampling: drop groups whose rewards all agree (their advantages are 0).
        let groups: Vec<u64> = rows.iter().map(|x| x.group).collect();
        let scores: Vec<f64> = rows.iter().map(|x| x.score).collect();
        let keep: Vec<usize> = if r.algorithm.filter_groups {
            filter_groups(&scores, &groups)?
        } else {
            (0..rows.len()).collect()
        };
        m.insert("batch/kept_samples".into(), keep.len() as f64);
        if keep.is_empty() {
            m.insert("actor/update_skipped".into(), 1.0);
            return Ok(report);
        }
        let rows: Vec<&Row> = keep.iter().map(|&i| &rows[i]).collect();
        let n_rows = rows.len();
        let mb = self.policy.micro_batch_size;

        // Pack every row once; micro-batch k holds rows [k*mb, (k+1)*mb).
        let mut packed = Vec::new();
        for chunk in rows.chunks(mb) {
            let pairs: Vec<(&[u32], &[u32])> = chunk
                .iter()
                .map(|x| (x.prompt.as_slice(), x.response.as_slice()))
                .collect();
            packed.push(self.policy.pack(&pairs)?);
        }
        let mut response_mask: Vec<f32> = Vec::with_capacity(n_rows * l);
        for (k, p) in packed.iter().enumerate() {
            let real = (n_rows - k * mb).min(mb);
            response_mask.extend_from_slice(&p.response_mask[..real * l]);
        }
        let inputs = |k: usize| -> Vec<HostArray> {
            vec![
                HostArray::I32(packed[k].tokens.clone()),
                HostArray::I32(packed[k].mask.clone()),
            ]
        };
        let per_row = |all: Vec<f32>| -> Vec<f32> { all };

        // Rollout log-probs, padded to L.
        let mut rollout_lp = vec![0.0f32; n_rows * l];
        for (i, x) in rows.iter().enumerate() {
            rollout_lp[i * l..i * l + x.rollout_log_probs.len()].copy_from_slice(&x.rollout_log_probs);
        }
        // Old log-probs: recomputed with the current policy unless the rollout's are trusted.
        let t = Instant::now();
        let old_lp = if r.actor.use_rollout_log_probs {
            rollout_lp.clone()
        } else {
            let mut all = Vec::with_capacity(n_rows * l);
            for k in 0..packed.len() {
                let lp = self.learner.log_probs(&inputs(k), false)?;
                let real = (n_rows - k * mb).min(mb);
                all.extend_from_slice(&lp[..real * l]);
            }
            per_row(all)
        };
        m.insert("timing_s/old_log_prob".into(), t.elapsed().as_secs_f64());
        // How far the trainer's and the rollout's probabilities are apart (same weights).
        let (mut diff, mut cnt) = (0.0f64, 0.0f64);
        for i in 0..n_rows * l {
            if response_mask[i] != 0.0 {
                diff += (old_lp[i] - rollout_lp[i]).abs() as f64;
                cnt += 1.0;
            }
        }
        m.insert("rollout/log_prob_diff_mean".into(), diff / cnt.max(1.0));
        let t = Instant::now();
        let ref_lp = if Self::needs_reference(r) {
            let mut all = Vec::with_capacity(n_rows * l);
            for k in 0..packed.len() {
                let lp = self.learner.log_probs(&inputs(k), true)?;
                let real = (n_rows - k * mb).min(mb);
                all.extend_from_slice(&lp[..real * l]);
            }
            Some(all)
        } else {
            None
        };
        if ref_lp.is_some() {
            m.insert("timing_s/ref".into(), t.elapsed().as_secs_f64());
        }

        // Rewards -> (KL in reward) -> advantages.
        let kept_scores: Vec<f64> = rows.iter().map(|x| x.score).collect();
        let kept_groups: Vec<u64> = rows.iter().map(|x| x.group).collect();
        let mut token_scores = outcome_token_scores(&kept_scores, &response_mask, l)?;
        if r.algorithm.use_kl_in_reward {
            let (rewards, kl) = apply_kl_in_reward(
                &token_scores,
                &old_lp,
                ref_lp.as_ref().expect("reference log-probs"),
                &response_mask,
                l,
                KlPenalty::K1,
                r.algorithm.kl_coef,
            )?;
            token_scores = rewards;
            m.insert("actor/reward_kl_penalty".into(), kl);
        }
        let seq = sequence_scores(&token_scores, l);
        let adv = compute_advantages(
            r.algorithm.adv_estimator,
            &seq,
            &kept_groups,
            r.algorithm.norm_adv_by_std_in_grpo,
        )?;
        let mut loss_mask = response_mask.clone();
        if r.algorithm.mask_truncated_responses {
            let truncated: Vec<bool> = rows.iter().map(|x| x.truncated).collect();
            let masked = mask_truncated(&mut loss_mask, l, &truncated)?;
            m.insert("batch/masked_truncated".into(), masked as f64);
        }
        let adv_tokens = broadcast_over_response(&adv, &loss_mask, l)?;
        let nonzero = adv.iter().filter(|a| a.abs() > 0.0).count();
        m.insert(
            "critic/advantages/nonzero_frac".into(),
            nonzero as f64 / n_rows as f64,
        );

        // Mini-batches of ppo_mini_batch_size prompts (times n samples), ppo_epochs passes.
        let t = Instant::now();
        let mini = (r.actor.ppo_mini_batch_size * r.rollout.n).max(1);
        let mut sums: BTreeMap<&'static str, f64> = BTreeMap::new();
        let mut steps = 0u64;
        let slice = |v: &[f32], rows: std::ops::Range<usize>| v[rows.start * l..rows.end * l].to_vec();
        for _epoch in 0..r.actor.ppo_epochs.max(1) {
            let mut start = 0;
            while start < n_rows {
                let end = (start + mini).min(n_rows);
                let norm = mini_batch_normalizer(&loss_mask[start * l..end * l], l);
                let mut micro = Vec::new();
                let mut s = start;
                while s < end {
                    let e = (s + mb).min(end);
                    let pad = |v: Vec<f32>| {
                        let mut v = v;
                        v.resize(mb * l, 0.0);
                        v
                    };
                    let pairs: Vec<(&[u32], &[u32])> = rows[s..e]
                        .iter()
                        .map(|x| (x.prompt.as_slice(), x.response.as_slice()))
                        .collect();
                    let p = self.policy.pack(&pairs)?;
                    let host = MicroBatchHost {
                        old_log_probs: pad(slice(&old_lp, s..e)),
                        advantages: pad(slice(&adv_tokens, s..e)),
                        response_mask: pad(slice(&loss_mask, s..e)),
                        ref_log_probs: ref_lp.as_ref().map(|v| pad(slice(v, s..e))),
                        rollout_log_probs: Some(pad(slice(&rollout_lp, s..e))),
                        norm,
                        inputs: vec![HostArray::I32(p.tokens), HostArray::I32(p.mask)],
                    };
                    micro.push(self.learner.upload_micro_batch(micro.len(), &host)?);
                    report.processed_tokens += (e - s) * (self.policy.prompt_len + l);
                    s = e;
                }
                let lr = learning_rate(&self.optim, self.optimizer_steps);
                let metrics = self.learner.step(&micro, lr)?;
                self.optimizer_steps += 1;
                steps += 1;
                for (name, v) in &metrics.values {
                    *sums.entry(name).or_default() += v;
                }
                report.trained_tokens += norm.0 as usize;
                start = end;
            }
        }
        m.insert("timing_s/update_actor".into(), t.elapsed().as_secs_f64());
        for (name, sum) in sums {
            let v = sum / steps.max(1) as f64;
            let key = match name {
                "update_applied" => "actor/update_applied_frac".to_string(),
                other => format!("actor/{other}"),
            };
            m.insert(key, v);
        }
        let kl = if r.actor.use_kl_loss {
            m.get("actor/kl_loss").copied()
        } else {
            m.get("actor/ppo_kl").copied()
        };
        if let Some(kl) = kl {
            m.insert("actor/kl".into(), kl);
        }
        report.optimizer_steps = steps;
        Ok(report)
    }
}
