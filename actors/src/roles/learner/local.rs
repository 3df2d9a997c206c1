//! The learner role in this process: from scored samples to an optimizer update, on this
//! process's device, with the reference model beside the policy.
//!
//! VeRL's order within `fit()`: recompute the old log-probs with the current policy (unless
//! the rollout's are trusted), the reference log-probs when a KL term needs them, the KL
//! penalty in the reward (optional), the advantages per prompt group, then `ppo_epochs`
//! passes over mini-batches of `ppo_mini_batch_size * rollout.n` samples, one optimizer step
//! each, accumulating `ppo_micro_batch_size` rows at a time on the device.

use super::{LearnerRole, LearnerWeights};
use crate::recipe::Recipe;
use crate::roles::{BoxFuture, RoleError};
use crate::setup::actor_dtype;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use trainer::advantage::{
    apply_kl_in_reward, broadcast_over_response, compute_advantages, filter_groups, mask_truncated,
    outcome_token_scores, sequence_scores,
};
use trainer::bucket::{BucketedLearner, PackedMicroBatch};
use trainer::config::{KlPenalty, OptimConfig, PolicyLossConfig};
use trainer::optim::learning_rate;
use trainer::policy::DecoderPolicy;
use trainer::step::{mini_batch_normalizer, LearnerState, MicroBatchHost, ParamSpec, StepConfig};
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
    /// Prompt + response columns through forward and backward: rows times the width of their
    /// micro-batch's length bucket (`actor.length_bucket`), padding included.
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

/// Whether a run with this recipe needs the reference model's log-probs.
pub fn needs_reference(recipe: &Recipe) -> bool {
    recipe.actor.use_kl_loss || recipe.algorithm.use_kl_in_reward
}

/// The policy of a recipe over a model of `config`: how rows are packed (each prompt's
/// `rollout.n` samples share it; one block of rows per learner device) and what the parameter
/// table is.
pub fn policy(recipe: &Recipe, config: &model::ModelConfig) -> DecoderPolicy {
    let micro_batch_size = recipe.actor.ppo_micro_batch_size;
    DecoderPolicy {
        config: config.clone(),
        prompt_len: recipe.data.max_prompt_length,
        response_len: recipe.data.max_response_length,
        micro_batch_size,
        temperature: recipe.rollout.temperature as f32,
        group_size: recipe.rollout.n.max(1),
        blocks: recipe
            .actor
            .parallelism(&recipe.cluster)
            .devices(micro_batch_size as i64)
            .unwrap_or(1),
    }
}

/// The learner's parameter table for a recipe over a model of `config` (the order of every
/// weight stream and checkpoint).
pub fn param_specs(recipe: &Recipe, config: &model::ModelConfig) -> Vec<ParamSpec> {
    policy(recipe, config).param_specs()
}

/// Takes the model's tensors out of `weights` (they are not needed twice on the host) and returns
/// them as f32 in the order of `specs`: the initial weights of a new run, and the frozen
/// reference.
pub fn initial_params(
    specs: &[ParamSpec],
    weights: &mut model::ModelWeights,
) -> std::result::Result<Vec<Vec<f32>>, LearnerError> {
    let mut by_name: std::collections::HashMap<String, model::HostTensor> =
        std::mem::take(&mut weights.tensors)
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
    specs
        .iter()
        .map(|s| {
            by_name.remove(&s.name).map(|t| t.to_f32_vec()).ok_or_else(|| {
                LearnerError::Batch(format!(
                    "the model has no tensor `{}`, which the policy's parameter table needs",
                    s.name
                ))
            })
        })
        .collect()
}

/// The device learner, its policy shapes and the recipe's knobs (what [`LocalLearner`] locks).
struct Core {
    learner: BucketedLearner,
    policy: DecoderPolicy,
    /// Entries of the learner's compile log already logged.
    compiles_logged: usize,
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
        compute_dtype: actor_dtype(recipe),
        parallel: a.parallelism(&recipe.cluster),
        micro_batch_size: a.ppo_micro_batch_size as i64,
        response_len: recipe.data.max_response_length as i64,
    }
}

impl Core {
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
    ) -> Result<Core> {
        let policy = policy(recipe, config);
        let cfg = step_config(recipe, total_optimizer_steps);
        let specs = policy.param_specs();
        let optim = cfg.optim.clone();
        let mut learner = BucketedLearner::from_state(
            client,
            policy.clone(),
            cfg,
            state,
            recipe.actor.length_bucket,
            recipe.actor.max_consecutive_nonfinite as u32,
        )?;
        if let Some(r) = reference {
            learner.learner_mut().set_reference(r)?;
        }
        Ok(Core {
            learner,
            policy,
            compiles_logged: 0,
            specs,
            optim,
            recipe: recipe.clone(),
            optimizer_steps,
        })
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

        // Pack every row once, at its micro-batch's length bucket; micro-batch k holds rows
        // [k*mb, (k+1)*mb). Mini-batches are whole micro-batches (mb divides the mini-batch), so
        // the update reuses these packings.
        let mut packed: Vec<PackedMicroBatch> = Vec::new();
        for chunk in rows.chunks(mb) {
            let pairs: Vec<(&[u32], &[u32])> = chunk
                .iter()
                .map(|x| (x.prompt.as_slice(), x.response.as_slice()))
                .collect();
            packed.push(self.learner.pack(&pairs)?);
        }
        let mut response_mask = vec![0.0f32; n_rows * l];
        for (i, x) in rows.iter().enumerate() {
            response_mask[i * l..i * l + x.response.len()].fill(1.0);
        }

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
            for (k, p) in packed.iter().enumerate() {
                let lp = self.learner.log_probs(p, false)?;
                let real = (n_rows - k * mb).min(mb);
                all.extend_from_slice(&lp[..real * l]);
            }
            all
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
        let ref_lp = if needs_reference(r) {
            let mut all = Vec::with_capacity(n_rows * l);
            for (k, p) in packed.iter().enumerate() {
                let lp = self.learner.log_probs(p, true)?;
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
                    // The packing of these rows from above (micro-batches align with
                    // mini-batches), else a fresh one.
                    let fresh;
                    let p = match packed.get(s / mb) {
                        Some(p) if s % mb == 0 && p.rows == e - s => p,
                        _ => {
                            let pairs: Vec<(&[u32], &[u32])> = rows[s..e]
                                .iter()
                                .map(|x| (x.prompt.as_slice(), x.response.as_slice()))
                                .collect();
                            fresh = self.learner.pack(&pairs)?;
                            &fresh
                        }
                    };
                    let host = MicroBatchHost {
                        old_log_probs: pad(slice(&old_lp, s..e)),
                        advantages: pad(slice(&adv_tokens, s..e)),
                        response_mask: pad(slice(&loss_mask, s..e)),
                        ref_log_probs: ref_lp.as_ref().map(|v| pad(slice(v, s..e))),
                        rollout_log_probs: Some(pad(slice(&rollout_lp, s..e))),
                        norm,
                        inputs: Vec::new(),
                    };
                    micro.push(self.learner.upload(micro.len(), p, &host)?);
                    report.processed_tokens += (e - s) * p.width();
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
        self.log_compiles();
        Ok(report)
    }

    /// Logs the learner programs loaded since the last call (one per length bucket and
    /// program, compiled or from the executable cache) and how many there are.
    fn log_compiles(&mut self) {
        let learner = self.learner.learner();
        let log = learner.compile_log();
        if log.len() == self.compiles_logged {
            return;
        }
        let shapes = self.learner.shapes();
        let buckets = self.learner.buckets();
        for record in &log[self.compiles_logged..] {
            let shape = record
                .shape
                .and_then(|s| self.learner.shape_columns(s))
                .map_or("any".to_string(), |(p, l)| format!("{p}+{l}"));
            tracing::info!(
                "learner: loaded {} for length bucket {shape} in {:.1} s",
                record.program,
                record.seconds
            );
        }
        tracing::info!(
            "learner: {} programs loaded for {} length buckets (at most {} with actor.length_bucket = {}): {}",
            log.len(),
            shapes.len(),
            buckets.max_shapes(),
            buckets.multiple,
            shapes
                .iter()
                .map(|(p, l)| format!("{p}+{l}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        self.compiles_logged = log.len();
    }
}

/// The learner role in this process. Its parameter buffers are shared with an in-process
/// rollout engine (no copy); updates run on a blocking thread, one at a time.
pub struct LocalLearner {
    core: Arc<Mutex<Core>>,
    /// Optimizer steps so far, readable while an update runs.
    optimizer_steps: Arc<AtomicU64>,
    specs: Vec<ParamSpec>,
}

impl LocalLearner {
    /// Builds the programs and uploads `state` (the model's weights with zero optimizer state
    /// for a new run, or a checkpoint's). `reference` are the frozen initial weights, needed
    /// when a KL term is on ([`needs_reference`]). `optimizer_steps` is the schedule's clock at
    /// `state`; `total_optimizer_steps` its length.
    pub fn new(
        client: &Client,
        recipe: &Recipe,
        config: &model::ModelConfig,
        state: &LearnerState,
        reference: Option<&[Vec<f32>]>,
        optimizer_steps: u64,
        total_optimizer_steps: u64,
    ) -> Result<LocalLearner> {
        let core = Core::new(
            client,
            recipe,
            config,
            state,
            reference,
            optimizer_steps,
            total_optimizer_steps,
        )?;
        Ok(LocalLearner {
            specs: core.specs.clone(),
            core: Arc::new(Mutex::new(core)),
            optimizer_steps: Arc::new(AtomicU64::new(optimizer_steps)),
        })
    }

    /// The learner of a run as the orchestrator and a learner worker both build it: from
    /// `initial` (the model's weights in [`param_specs`] order, see [`initial_params`]) with zero
    /// optimizer state when `resume` is `None`, else from a checkpoint's state; `initial` is the
    /// frozen reference when the recipe needs one.
    pub fn start(
        client: &Client,
        recipe: &Recipe,
        config: &model::ModelConfig,
        initial: Vec<Vec<f32>>,
        resume: Option<LearnerState>,
        optimizer_steps: u64,
        total_optimizer_steps: u64,
    ) -> Result<LocalLearner> {
        let needs_reference = needs_reference(recipe);
        let (state, reference) = match resume {
            Some(state) => (state, needs_reference.then_some(initial)),
            None => {
                // Without a reference the initial weights move into the state, not copied.
                let (params, reference) = if needs_reference {
                    (initial.clone(), Some(initial))
                } else {
                    (initial, None)
                };
                (LearnerState::fresh(params), reference)
            }
        };
        LocalLearner::new(
            client,
            recipe,
            config,
            &state,
            reference.as_deref(),
            optimizer_steps,
            total_optimizer_steps,
        )
    }

    /// The parameter table.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// The parameters for a rollout engine on the same device (shared, not copied).
    pub fn shared_params(&self) -> Result<Arc<[Buffer]>> {
        Ok(lock(&self.core).learner.learner_mut().shared_params()?)
    }

    /// The parameters with their layout, for a rollout engine on the learner's devices
    /// (shared, not copied): on one device [`LocalLearner::shared_params`]; over a mesh of
    /// `N > 1` every device's f32 masters, split as the learner's mesh splits them.
    pub fn rollout_source(&self) -> Result<rollout::SourceParams> {
        let mut core = lock(&self.core);
        let learner = core.learner.learner_mut();
        let mesh = learner.mesh();
        if learner.devices() <= 1 {
            return Ok(rollout::SourceParams::single(learner.shared_params()?));
        }
        Ok(rollout::SourceParams {
            mesh: mesh.mesh(),
            per_device: learner.shared_device_params(),
            shardings: self.specs.iter().map(|p| mesh.param_sharding(&p.dims)).collect(),
            dims: self.specs.iter().map(|p| p.dims.clone()).collect(),
        })
    }

    /// The learner's state (parameters, AdamW moments, step count) read to the host.
    pub fn read_state(&self) -> Result<LearnerState> {
        Ok(lock(&self.core).learner.learner().state()?)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A learner error as a role error (its message kept).
pub(crate) fn role_error(e: LearnerError) -> RoleError {
    RoleError::Invalid(format!("learner: {e}"))
}

impl LearnerRole for LocalLearner {
    fn update(&self, rows: Vec<Row>) -> BoxFuture<'_, std::result::Result<UpdateReport, RoleError>> {
        let (core, steps) = (self.core.clone(), self.optimizer_steps.clone());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let mut core = lock(&core);
                let report = core.update(&rows);
                steps.store(core.optimizer_steps, Ordering::SeqCst);
                report
            })
            .await
            .map_err(|e| RoleError::Invalid(format!("learner: the update thread failed: {e}")))?
            .map_err(role_error)
        })
    }

    fn weights(
        &self,
        _version: u64,
        _dtype: xla::DType,
    ) -> BoxFuture<'_, std::result::Result<LearnerWeights, RoleError>> {
        Box::pin(async move { Ok(LearnerWeights::Shared(self.rollout_source().map_err(role_error)?)) })
    }

    fn state(&self) -> BoxFuture<'_, std::result::Result<LearnerState, RoleError>> {
        let core = self.core.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || lock(&core).learner.learner().state())
                .await
                .map_err(|e| RoleError::Invalid(format!("learner: the state reader failed: {e}")))?
                .map_err(|e| role_error(e.into()))
        })
    }

    fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps.load(Ordering::SeqCst)
    }

    fn location(&self) -> String {
        "in-process".into()
    }
}
