//! One GRPO update, from a step's scored samples to the parameters moving.
//!
//! VeRL's order within `fit()` (`verl/trainer/ppo/ray_trainer.py`): drop groups whose rewards
//! all agree when dynamic sampling is on, recompute the old log-probs with the current policy
//! (unless the rollout's are trusted), the reference log-probs when a KL term needs them, the KL
//! penalty in the reward (optional), the advantages per prompt group, then `ppo_epochs` passes
//! over mini-batches of `ppo_mini_batch_size * rollout.n` samples, one optimizer step each,
//! accumulating `ppo_micro_batch_size` rows at a time on the device.
//!
//! [`BatchPlan`] is the mini-batch arithmetic (how many optimizer steps a training step takes,
//! how many micro-batches a mini-batch holds), computed here once for the run loop, the update
//! and `grpo compile`. [`GrpoUpdate`] owns the device learner and runs the update.
//!
//! Where each part is: [`GrpoUpdate::update`] leaves out rows with a non-finite reward or
//! log-prob and packs the rest; `GrpoUpdate::token_arrays` turns rewards into advantages
//! (rollout correction, KL in the reward, then [`crate::advantage::compute_advantages`]); the
//! optimizer steps follow. A [`Row`]'s `env_spans` (the environment's tokens of a multi-turn
//! sample) are context with loss mask 0, so they count in no advantage, loss or normaliser.
//! The adaptive KL coefficient ([`crate::advantage::KlController`]) and the optimizer-step
//! clocks are [`UpdateClocks`], which the learner roles carry into checkpoints.
//!
//! PPO (`algorithm.adv_estimator: gae`) adds a critic, as VeRL's `fit()` runs it: a value model
//! ([`crate::policy::Head::Value`]) with its own parameters, optimizer and mini-batches
//! ([`CriticConfig`]). Its values of the batch are computed with the old log-probs, GAE turns
//! them and the rewards into advantages and returns, the critic then trains towards the
//! returns, and the actor only once `trainer.critic_warmup` steps have passed.

use crate::advantage::{
    apply_kl_in_reward, compute_advantages, mask_truncated, outcome_token_scores, sequence_scores,
    Advantages, KlController,
};
use crate::bucket::{BucketedLearner, PackedMicroBatch};
use crate::config::{AdvantageConfig, KlControl, KlPenalty, OptimConfig, RouterReplay};
use crate::optim::learning_rate;
use crate::policy::{DecoderPolicy, PackError};
use crate::rollout_correction::{correct, RolloutCorrection};
use crate::step::{mini_batch_normalizer, LearnerState, MicroBatchHost, StepConfig};
use crate::TrainerError;
use std::collections::BTreeMap;
use std::time::Instant;
use xla::runtime::Client;

/// Each row's routes in position order (`rollout::Sample::routes`'s layout).
type RowRoutes = Vec<Vec<u8>>;

/// One scored sample, as the update needs it.
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
    /// ReMax's baseline (`algorithm.adv_estimator: remax`): the reward of the prompt's greedy
    /// response, which the run generates beside the samples.
    pub reward_baseline: Option<f64>,
    /// Stopped by the length limit rather than a stop token.
    pub truncated: bool,
    /// The experts the rollout chose for each position it fed (`rollout::Sample::routes`);
    /// empty when not recorded.
    pub routes: Vec<u8>,
    /// The response positions the environment wrote in a multi-turn sample (tool results,
    /// user turns), ascending and disjoint: the model reads them but is not trained on them,
    /// and they count in no advantage, loss or normaliser. Empty for a single-turn sample.
    pub env_spans: Vec<std::ops::Range<usize>>,
}

impl Row {
    /// The loss mask of the row: 1 on the tokens the model sampled.
    fn model_token_mask(&self) -> Vec<f32> {
        let mut mask = vec![1.0; self.response.len()];
        for span in &self.env_spans {
            mask[span.clone()].fill(0.0);
        }
        mask
    }

    /// Why the row's environment spans are not ascending, disjoint, non-empty ranges of its
    /// response.
    fn check_env_spans(&self) -> std::result::Result<(), String> {
        let mut end = 0;
        for span in &self.env_spans {
            if span.start < end || span.end <= span.start || span.end > self.response.len() {
                return Err(format!(
                    "a row of group {} has environment span {span:?}: empty, out of order or past its {} response tokens",
                    self.group,
                    self.response.len()
                ));
            }
            end = span.end;
        }
        Ok(())
    }
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

/// Why an update failed.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    #[error(transparent)]
    Trainer(#[from] TrainerError),
    #[error(transparent)]
    Pack(#[from] PackError),
    #[error("{0}")]
    Batch(String),
}

type Result<T> = std::result::Result<T, UpdateError>;

/// The mini-batch arithmetic of a run (`data.train_batch_size`, `rollout.n`,
/// `actor.ppo_mini_batch_size`, `actor.ppo_micro_batch_size`, `actor.ppo_epochs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchPlan {
    /// Prompts per training step.
    pub prompts_per_step: usize,
    /// Samples per prompt (the group size).
    pub group_size: usize,
    /// Prompts per optimizer step.
    pub mini_batch_prompts: usize,
    /// Samples per forward/backward pass.
    pub micro_batch_size: usize,
    /// Passes over each step's samples.
    pub epochs: usize,
}

impl BatchPlan {
    /// Samples a training step trains on.
    pub fn samples_per_step(&self) -> usize {
        self.prompts_per_step * self.group_size
    }

    /// Samples per optimizer step.
    pub fn mini_batch_samples(&self) -> usize {
        (self.mini_batch_prompts * self.group_size).max(1)
    }

    /// Optimizer steps of one pass over a step's samples.
    pub fn mini_batches_per_step(&self) -> u64 {
        self.prompts_per_step.div_ceil(self.mini_batch_prompts.max(1)) as u64
    }

    /// Optimizer steps of one training step: every pass, every mini-batch.
    pub fn optimizer_steps_per_step(&self) -> u64 {
        self.mini_batches_per_step() * self.epochs.max(1) as u64
    }

    /// The learning-rate schedule's length for a run of `steps` training steps.
    pub fn total_optimizer_steps(&self, steps: u64) -> u64 {
        steps * self.optimizer_steps_per_step()
    }

    /// Micro-batches one mini-batch accumulates (1: the fused `train_step` alone).
    pub fn micro_batches_per_mini_batch(&self) -> usize {
        self.mini_batch_samples()
            .min(self.samples_per_step())
            .div_ceil(self.micro_batch_size.max(1))
    }

    /// Micro-batches of one pass over a step's samples (each a `log_probs` run).
    pub fn micro_batches_per_step(&self) -> usize {
        self.samples_per_step().div_ceil(self.micro_batch_size.max(1))
    }
}

/// The rows whose reward and rollout log-probs are all finite. A NaN or infinity there (a
/// sampler that overflowed, a scorer that slipped through) would make the whole update's loss
/// non-finite, so such a row is left out of the update (counted in `batch/nonfinite_samples`)
/// before any of its numbers reach advantages or the loss.
fn finite_rows(rows: &[Row]) -> Vec<usize> {
    let keep: Vec<usize> = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| r.score.is_finite() && r.rollout_log_probs.iter().all(|v| v.is_finite()))
        .map(|(i, _)| i)
        .collect();
    if keep.len() < rows.len() {
        tracing::warn!(
            left_out = rows.len() - keep.len(),
            "samples with a non-finite reward or rollout log-prob left out of the update"
        );
    }
    keep
}

/// What a learner's state does not hold but a resumed run needs: the learning-rate schedule's
/// clock and the in-reward KL coefficient (None without a KL penalty in the reward: the
/// recipe's `algorithm.kl_coef` then), and with a critic its schedule's clock and the updates
/// so far (`trainer.critic_warmup` counts them).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UpdateClocks {
    pub optimizer_steps: u64,
    pub kl_coef: Option<f64>,
    /// The critic's optimizer steps so far (0 without a critic).
    pub critic_optimizer_steps: u64,
    /// Updates (training steps) so far.
    pub updates: u64,
}

/// The critic of a PPO run (VeRL's `critic.*`): a value model trained beside the policy on the
/// same rows, with its own optimizer and mini-batches.
#[derive(Clone, Debug)]
pub struct CriticConfig {
    /// Its programs: the value loss ([`StepConfig::value_loss`] set), its optimizer
    /// (`critic.optim.*`, `critic.grad_clip`), compute type, micro-batch and mesh.
    pub step: StepConfig,
    /// Its mini-batch arithmetic (`critic.ppo_mini_batch_size`, `critic.ppo_micro_batch_size`,
    /// `critic.ppo_epochs`).
    pub batches: BatchPlan,
    /// `trainer.critic_warmup`: the actor trains from the update with this 1-based number on
    /// (VeRL's `critic_warmup <= global_steps`); before it only the critic does.
    pub warmup: u64,
}

/// Where a critic starts: its value model and its state (fresh: the trunk of the policy's
/// model with a new value head; or a checkpoint's).
pub struct CriticStart {
    /// The value model ([`crate::policy::Head::Value`]) with the critic's micro-batch.
    pub model: DecoderPolicy,
    pub state: LearnerState,
}

/// A running critic.
struct Critic {
    learner: BucketedLearner,
    config: CriticConfig,
    optimizer_steps: u64,
}

/// What an update does beyond one optimizer step: VeRL's `algorithm.*` keys and the actor keys
/// that shape the batch, with the step's own configuration.
#[derive(Clone, Debug)]
pub struct UpdateConfig {
    /// The loss, the optimizer and the program shapes of one optimizer step.
    pub step: StepConfig,
    pub batches: BatchPlan,
    /// `algorithm.adv_estimator` and its knobs.
    pub advantage: AdvantageConfig,
    /// `algorithm.use_kl_in_reward`: subtract `kl_coef` x KL(policy || reference) from the
    /// token rewards.
    pub use_kl_in_reward: bool,
    /// `algorithm.kl_coef`: the in-reward coefficient a run starts with.
    pub kl_coef: f64,
    /// `algorithm.kl_penalty`: the in-reward KL estimator.
    pub kl_penalty: KlPenalty,
    /// `algorithm.kl_ctrl`: fixed or adaptive coefficient.
    pub kl_ctrl: KlControl,
    /// `algorithm.mask_truncated_responses`: leave truncated responses out of the loss.
    pub mask_truncated_responses: bool,
    /// `actor.use_rollout_log_probs`: the rollout's log-probs are the old log-probs.
    pub use_rollout_log_probs: bool,
    /// `actor.router_replay.mode`: the experts the learner's passes use (a mixture-of-experts
    /// policy; its [`DecoderPolicy::route_inputs`] must be on for R2 and R3, and for the
    /// router-mismatch metrics of rows that carry the rollout's routes).
    pub router_replay: RouterReplay,
    /// `algorithm.rollout_correction`: importance weights and rejection sampling for the
    /// rollout/learner mismatch (its metrics are reported whatever it applies).
    pub rollout_correction: RolloutCorrection,
    /// `actor.length_bucket` (see [`crate::bucket`]).
    pub length_bucket: usize,
    /// `actor.max_consecutive_nonfinite`.
    pub max_consecutive_nonfinite: u32,
    /// The critic, for an estimator that needs one (`gae`).
    pub critic: Option<CriticConfig>,
}

impl UpdateConfig {
    /// Whether the update needs the reference model's log-probs (a KL loss or a KL reward).
    pub fn needs_reference(&self) -> bool {
        self.step.loss.use_kl_loss || self.use_kl_in_reward
    }
}

/// The learner of a run: the device programs and buffers of a [`DecoderPolicy`], and the
/// update algorithm around them.
pub struct GrpoUpdate {
    learner: BucketedLearner,
    config: UpdateConfig,
    /// Optimizer steps so far (the learning-rate schedule's clock).
    optimizer_steps: u64,
    /// The in-reward KL coefficient.
    kl_ctrl: KlController,
    /// Entries of the learner's compile log already logged.
    compiles_logged: usize,
    /// The critic, with `gae`.
    critic: Option<Critic>,
    /// Updates so far.
    updates: u64,
}

impl GrpoUpdate {
    /// Builds the programs and uploads the state a run starts from: `initial` (the policy's
    /// trainable parameters in its parameter-table order: the model's weights, or with LoRA
    /// the adapters) with zero optimizer state when `resume` is `None`, else the checkpoint's
    /// state, and `frozen` (with LoRA the base weights, [`DecoderPolicy::frozen_specs`]; else
    /// empty). The frozen reference, when [`UpdateConfig::needs_reference`], is `initial`, or
    /// with LoRA zero adapters: the base model, with no second copy. `clocks` are the
    /// schedule's clock and the in-reward KL coefficient at the state. `critic` is where the
    /// critic starts, exactly when `config.critic` is set.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        client: &Client,
        policy: DecoderPolicy,
        config: UpdateConfig,
        initial: Vec<Vec<f32>>,
        frozen: Vec<Vec<f32>>,
        resume: Option<LearnerState>,
        clocks: UpdateClocks,
        critic: Option<CriticStart>,
    ) -> Result<GrpoUpdate> {
        let needs_reference = config.needs_reference();
        let (state, reference) = match (resume, policy.base_params()) {
            (Some(state), base) => (state, needs_reference.then(|| base.unwrap_or(initial))),
            (None, Some(base)) => (LearnerState::fresh(initial), needs_reference.then_some(base)),
            (None, None) => {
                // Without a reference the initial weights move into the state, not copied.
                let (params, reference) = if needs_reference {
                    (initial.clone(), Some(initial))
                } else {
                    (initial, None)
                };
                (LearnerState::fresh(params), reference)
            }
        };
        let mut learner = BucketedLearner::from_state(
            client,
            policy,
            config.step.clone(),
            &state,
            config.length_bucket,
            config.max_consecutive_nonfinite,
        )?;
        if let Some(r) = &reference {
            learner.learner_mut().set_reference(r)?;
        }
        if !frozen.is_empty() {
            learner.learner_mut().set_frozen(&frozen)?;
        }
        let kl_ctrl = KlController {
            control: config.kl_ctrl,
            value: clocks.kl_coef.unwrap_or(config.kl_coef),
        };
        let critic = match (&config.critic, critic) {
            (None, None) => None,
            (Some(cfg), Some(start)) => Some(Critic {
                learner: BucketedLearner::from_state(
                    client,
                    start.model,
                    cfg.step.clone(),
                    &start.state,
                    config.length_bucket,
                    config.max_consecutive_nonfinite,
                )?,
                config: cfg.clone(),
                optimizer_steps: clocks.critic_optimizer_steps,
            }),
            (cfg, _) => {
                return Err(UpdateError::Batch(format!(
                    "the update {} a critic but {} given one",
                    if cfg.is_some() { "needs" } else { "has no use for" },
                    if cfg.is_some() { "was not" } else { "was" }
                )))
            }
        };
        Ok(GrpoUpdate {
            learner,
            config,
            optimizer_steps: clocks.optimizer_steps,
            kl_ctrl,
            compiles_logged: 0,
            critic,
            updates: clocks.updates,
        })
    }

    /// The critic's device learner, with `gae`.
    pub fn critic(&self) -> Option<&BucketedLearner> {
        self.critic.as_ref().map(|c| &c.learner)
    }

    /// The device learner (parameters, optimizer state, programs).
    pub fn learner(&self) -> &BucketedLearner {
        &self.learner
    }

    /// The device learner, mutably (to share its parameter buffers).
    pub fn learner_mut(&mut self) -> &mut BucketedLearner {
        &mut self.learner
    }

    /// Optimizer steps so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps
    }

    /// The clocks a checkpoint keeps: optimizer steps so far and, with a KL penalty in the
    /// reward, its coefficient for the next step.
    pub fn clocks(&self) -> UpdateClocks {
        UpdateClocks {
            optimizer_steps: self.optimizer_steps,
            kl_coef: self.config.use_kl_in_reward.then_some(self.kl_ctrl.value),
            critic_optimizer_steps: self.critic.as_ref().map_or(0, |c| c.optimizer_steps),
            updates: self.updates,
        }
    }

    /// One GRPO update from the scored samples of a step.
    pub fn update(&mut self, rows: &[Row]) -> Result<UpdateReport> {
        let mut report = UpdateReport::default();
        if rows.is_empty() {
            return Err(UpdateError::Batch("no samples to train on".into()));
        }
        for row in rows {
            row.check_env_spans().map_err(UpdateError::Batch)?;
        }
        let finite = finite_rows(rows);
        report.metrics.insert(
            "batch/nonfinite_samples".into(),
            (rows.len() - finite.len()) as f64,
        );
        let keep = finite;
        report
            .metrics
            .insert("batch/kept_samples".into(), keep.len() as f64);
        if keep.is_empty() {
            report.metrics.insert("actor/update_skipped".into(), 1.0);
            return Ok(report);
        }
        let rows: Vec<&Row> = keep.iter().map(|&i| &rows[i]).collect();
        let mb = self.learner.policy().micro_batch_size;

        // Routing replay: R3 replays the rollout's routes everywhere, R2 those of the
        // old-log-prob pass from the reference pass on.
        let mut replay: Option<Vec<Vec<u8>>> = None;
        if self.config.router_replay == RouterReplay::R3 {
            if let Some(i) = rows.iter().position(|r| r.routes.is_empty()) {
                return Err(UpdateError::Batch(format!(
                    "actor.router_replay.mode R3 replays the rollout's routes, and row {i} (group {})                      has none: the rollout must record them (rollout.enable_rollout_routing_replay)",
                    rows[i].group
                )));
            }
            replay = Some(rows.iter().map(|r| r.routes.clone()).collect());
        }
        // Pack every row once, at its micro-batch's length bucket; micro-batch k holds rows
        // [k*mb, (k+1)*mb). Mini-batches are whole micro-batches (mb divides the mini-batch), so
        // the optimizer steps reuse these packings.
        let pack_all = |learner: &BucketedLearner, replay: Option<&[Vec<u8>]>| {
            rows.chunks(mb)
                .enumerate()
                .map(|(k, chunk)| {
                    let routes = replay.map(|r| &r[k * mb..k * mb + chunk.len()]);
                    learner.pack_routed(&pairs(chunk), routes)
                })
                .collect::<std::result::Result<Vec<_>, _>>()
        };
        let mut packed = pack_all(&self.learner, replay.as_deref())?;
        let (old_lp, chosen) = self.old_log_probs(&rows, &packed, &mut report)?;
        if self.config.router_replay == RouterReplay::R2 {
            replay = chosen;
            packed = pack_all(&self.learner, replay.as_deref())?;
        }
        // The critic packs rows as the policy does (same lengths, groups and devices), so with
        // the same micro-batch it takes the policy's packings.
        let repacked = match &self.critic {
            Some(c) if c.learner.policy().micro_batch_size != mb => Some(
                rows.chunks(c.learner.policy().micro_batch_size)
                    .map(|chunk| c.learner.pack(&pairs(chunk)))
                    .collect::<std::result::Result<Vec<_>, _>>()?,
            ),
            _ => None,
        };
        let critic_packed = repacked.as_deref().unwrap_or(&packed);
        let batch = self.token_arrays(&rows, &packed, critic_packed, old_lp, &mut report)?;
        // VeRL's order: the critic, then the actor once the warm-up is over.
        self.update_critic(&rows, critic_packed, &batch, &mut report)?;
        let warmup = self.critic.as_ref().map_or(0, |c| c.config.warmup);
        if self.updates + 1 >= warmup {
            self.optimize(&rows, &packed, replay.as_deref(), &batch, &mut report)?;
        } else {
            report.metrics.insert("actor/update_skipped".into(), 1.0);
        }
        self.updates += 1;
        self.log_compiles();
        Ok(report)
    }

    /// `critic.ppo_epochs` passes over the critic's mini-batches towards the returns; its step
    /// metrics averaged over the steps go into `report` as `critic/*`.
    fn update_critic(
        &mut self,
        rows: &[&Row],
        packed: &[PackedMicroBatch],
        batch: &TokenArrays,
        report: &mut UpdateReport,
    ) -> Result<()> {
        let Some(critic) = self.critic.as_mut() else {
            return Ok(());
        };
        let (values, returns) = (
            batch.values.as_ref().expect("values with a critic"),
            batch.returns.as_ref().expect("returns with a critic"),
        );
        let t = Instant::now();
        // The report's token counts are the policy's.
        let passes = mini_batches(
            &mut critic.learner,
            &critic.config.batches,
            &critic.config.step.optim,
            &mut critic.optimizer_steps,
            rows,
            (packed, None),
            &batch.loss_mask,
            |slice| MicroBatchHost {
                response_mask: slice(&batch.loss_mask),
                values: Some(slice(values)),
                returns: Some(slice(returns)),
                ..Default::default()
            },
        )?;
        let m = &mut report.metrics;
        m.insert("timing_s/update_critic".into(), t.elapsed().as_secs_f64());
        for (name, sum) in passes.sums {
            let key = match name {
                // The critic's loss is its value loss, reported as `vf_loss`.
                "loss" => continue,
                "update_applied" => "critic/update_applied_frac".to_string(),
                other => format!("critic/{other}"),
            };
            m.insert(key, sum / passes.steps.max(1) as f64);
        }
        Ok(())
    }

    /// The old log-probs `[rows, L]` of `rows` packed as `packed` (`None` when the rollout's
    /// are used, `actor.use_rollout_log_probs`), and with routes as inputs each row's experts
    /// the pass used; their mismatch with the rollout's routes goes into `report`.
    fn old_log_probs(
        &mut self,
        rows: &[&Row],
        packed: &[PackedMicroBatch],
        report: &mut UpdateReport,
    ) -> Result<(Option<Vec<f32>>, Option<RowRoutes>)> {
        if self.config.use_rollout_log_probs {
            return Ok((None, None));
        }
        let t = Instant::now();
        let (l, mb) = (
            self.learner.policy().response_len,
            self.learner.policy().micro_batch_size,
        );
        let mut lp = Vec::with_capacity(rows.len() * l);
        let mut chosen: Option<Vec<Vec<u8>>> = None;
        for (k, p) in packed.iter().enumerate() {
            let (out, used) = self.learner.log_probs_routed(p, false)?;
            let real = &rows[k * mb..(k * mb + mb).min(rows.len())];
            lp.extend_from_slice(&out[..real.len() * l]);
            if let Some(used) = used {
                let routes = self.learner.unpack_routes(&pairs(real), p, &used);
                chosen.get_or_insert_with(Vec::new).extend(routes);
            }
        }
        let m = &mut report.metrics;
        m.insert("timing_s/old_log_prob".into(), t.elapsed().as_secs_f64());
        let config = &self.learner.policy().config;
        if let (Some(chosen), Some(moe)) = (&chosen, &config.moe) {
            let k = moe.experts_per_token;
            add_router_mismatch(m, rows, chosen, (config.moe_layers() * k, k));
        }
        Ok((Some(lp), chosen))
    }

    /// The `[rows, L]` arrays of the loss: old (`old_lp`, else the rollout's), reference and
    /// rollout log-probs, advantages per token and the loss mask, from rewards through the
    /// optional KL penalty.
    fn token_arrays(
        &mut self,
        rows: &[&Row],
        packed: &[PackedMicroBatch],
        critic_packed: &[PackedMicroBatch],
        old_lp: Option<Vec<f32>>,
        report: &mut UpdateReport,
    ) -> Result<TokenArrays> {
        let l = self.learner.policy().response_len;
        let n_rows = rows.len();
        let m = &mut report.metrics;
        let mut response_mask = vec![0.0f32; n_rows * l];
        let mut rollout_lp = vec![0.0f32; n_rows * l];
        for (i, x) in rows.iter().enumerate() {
            response_mask[i * l..i * l + x.response.len()].copy_from_slice(&x.model_token_mask());
            rollout_lp[i * l..i * l + x.rollout_log_probs.len()].copy_from_slice(&x.rollout_log_probs);
        }
        let old_lp = old_lp.unwrap_or_else(|| rollout_lp.clone());
        // How far the trainer's and the rollout's probabilities are apart (same weights).
        let (mut diff, mut cnt) = (0.0f64, 0.0f64);
        for i in 0..n_rows * l {
            if response_mask[i] != 0.0 {
                diff += (old_lp[i] - rollout_lp[i]).abs() as f64;
                cnt += 1.0;
            }
        }
        m.insert("rollout/log_prob_diff_mean".into(), diff / cnt.max(1.0));
        let ref_lp = if self.config.needs_reference() {
            let t = Instant::now();
            let lp = per_row(&mut self.learner, packed, n_rows, true)?;
            m.insert("timing_s/ref".into(), t.elapsed().as_secs_f64());
            Some(lp)
        } else {
            None
        };
        // The critic's values of the response tokens (0 elsewhere, as VeRL's compute_values).
        let values = if let Some(critic) = self.critic.as_mut() {
            let t = Instant::now();
            let mut v = per_row(&mut critic.learner, critic_packed, n_rows, false)?;
            for (v, m) in v.iter_mut().zip(&response_mask) {
                *v *= m;
            }
            report
                .metrics
                .insert("timing_s/values".into(), t.elapsed().as_secs_f64());
            Some(v)
        } else {
            None
        };
        let m = &mut report.metrics;

        // The rollout/learner mismatch: importance weights, rejected tokens, rollout_corr/*.
        let corrected = correct(
            &self.config.rollout_correction,
            &old_lp,
            &rollout_lp,
            &response_mask,
            l,
        )?;
        m.extend(corrected.metrics);

        // Rewards -> (KL in reward) -> advantages.
        let scores: Vec<f64> = rows.iter().map(|x| x.score).collect();
        let groups: Vec<u64> = rows.iter().map(|x| x.group).collect();
        let mut token_scores = outcome_token_scores(&scores, &response_mask, l)?;
        if self.config.use_kl_in_reward {
            let (rewards, kl) = apply_kl_in_reward(
                &token_scores,
                &old_lp,
                ref_lp.as_ref().expect("reference log-probs"),
                &response_mask,
                l,
                self.config.kl_penalty,
                self.kl_ctrl.value,
            )?;
            token_scores = rewards;
            m.insert("actor/reward_kl_penalty".into(), kl);
            m.insert("actor/reward_kl_penalty_coeff".into(), self.kl_ctrl.value);
            self.kl_ctrl.update(kl, n_rows);
        }
        // VeRL applies the rejection after the KL in the reward, before the advantages.
        let response_mask = corrected.response_mask;
        let baselines: Option<Vec<f64>> = rows.iter().map(|x| x.reward_baseline).collect();
        let adv = compute_advantages(
            &self.config.advantage,
            &token_scores,
            &response_mask,
            l,
            &groups,
            baselines.as_deref(),
            values.as_deref(),
        )?;
        add_critic_metrics(m, &sequence_scores(&token_scores, l), &adv, &response_mask);
        if let Some(v) = &values {
            add_value_metrics(m, v, &adv.returns, &response_mask);
        }
        let mut loss_mask = response_mask;
        if self.config.mask_truncated_responses {
            let truncated: Vec<bool> = rows.iter().map(|x| x.truncated).collect();
            let masked = mask_truncated(&mut loss_mask, l, &truncated)?;
            m.insert("batch/masked_truncated".into(), masked as f64);
        }
        let advantages: Vec<f32> = adv
            .advantages
            .iter()
            .zip(&loss_mask)
            .map(|(a, m)| (a * *m as f64) as f32)
            .collect();
        let nonzero = adv
            .advantages
            .chunks(l.max(1))
            .filter(|row| row.iter().any(|a| *a != 0.0))
            .count();
        m.insert(
            "critic/advantages/nonzero_frac".into(),
            nonzero as f64 / n_rows as f64,
        );
        Ok(TokenArrays {
            old_lp,
            ref_lp,
            is_weights: corrected.weights,
            advantages,
            loss_mask,
            returns: values
                .is_some()
                .then(|| adv.returns.iter().map(|r| *r as f32).collect()),
            values,
        })
    }

    /// `ppo_epochs` passes over mini-batches of the rows, one optimizer step each; the step
    /// metrics averaged over the steps go into `report` as `actor/*`.
    fn optimize(
        &mut self,
        rows: &[&Row],
        packed: &[PackedMicroBatch],
        replay: Option<&[Vec<u8>]>,
        batch: &TokenArrays,
        report: &mut UpdateReport,
    ) -> Result<()> {
        let t = Instant::now();
        let passes = mini_batches(
            &mut self.learner,
            &self.config.batches,
            &self.config.step.optim,
            &mut self.optimizer_steps,
            rows,
            (packed, replay),
            &batch.loss_mask,
            |slice| MicroBatchHost {
                old_log_probs: slice(&batch.old_lp),
                advantages: slice(&batch.advantages),
                response_mask: slice(&batch.loss_mask),
                ref_log_probs: batch.ref_lp.as_deref().map(slice),
                rollout_is_weights: batch.is_weights.as_deref().map(slice),
                ..Default::default()
            },
        )?;
        report.optimizer_steps = passes.steps;
        report.trained_tokens = passes.trained_tokens;
        report.processed_tokens = passes.processed_tokens;
        let m = &mut report.metrics;
        m.insert("timing_s/update_actor".into(), t.elapsed().as_secs_f64());
        for (name, sum) in passes.sums {
            let v = sum / passes.steps.max(1) as f64;
            let key = match name {
                "update_applied" => "actor/update_applied_frac".to_string(),
                other => format!("actor/{other}"),
            };
            m.insert(key, v);
        }
        let kl = if self.config.step.loss.use_kl_loss {
            m.get("actor/kl_loss").copied()
        } else {
            m.get("actor/ppo_kl").copied()
        };
        if let Some(kl) = kl {
            m.insert("actor/kl".into(), kl);
        }
        Ok(())
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

/// The `[rows, L]` host arrays of an update's loss.
struct TokenArrays {
    old_lp: Vec<f32>,
    ref_lp: Option<Vec<f32>>,
    /// The rollout importance weights, when the loss applies them.
    is_weights: Option<Vec<f32>>,
    advantages: Vec<f32>,
    loss_mask: Vec<f32>,
    /// With a critic: its values when the batch was made, and GAE's returns.
    values: Option<Vec<f32>>,
    returns: Option<Vec<f32>>,
}

/// What [`mini_batches`] did: each step metric summed over its optimizer steps, how many it
/// took, and the tokens it trained on and processed (as [`UpdateReport`] counts them).
#[derive(Default)]
struct Passes {
    sums: BTreeMap<&'static str, f64>,
    steps: u64,
    trained_tokens: usize,
    processed_tokens: usize,
}

/// `plan.epochs` passes over mini-batches of `rows` (the same loop for the actor and the
/// critic), one optimizer step of `learner` each at the learning rate of `optim`'s schedule at
/// `clock` (advanced per step); `host` builds a micro-batch's per-token arrays from a function
/// that cuts a `[rows, L]` array to the micro-batch's rows (padded to the micro-batch). The
/// rows come packed (with the routes to replay, if any, for a micro-batch packed afresh).
#[allow(clippy::too_many_arguments)]
fn mini_batches(
    learner: &mut BucketedLearner,
    plan: &BatchPlan,
    optim: &OptimConfig,
    clock: &mut u64,
    rows: &[&Row],
    (packed, replay): (&[PackedMicroBatch], Option<&[Vec<u8>]>),
    loss_mask: &[f32],
    host: impl Fn(&dyn Fn(&[f32]) -> Vec<f32>) -> MicroBatchHost,
) -> Result<Passes> {
    let l = learner.policy().response_len;
    let mb = learner.policy().micro_batch_size;
    let n_rows = rows.len();
    let mini = plan.mini_batch_samples();
    let mut out = Passes::default();
    for _epoch in 0..plan.epochs.max(1) {
        let mut start = 0;
        while start < n_rows {
            let end = (start + mini).min(n_rows);
            let norm = mini_batch_normalizer(&loss_mask[start * l..end * l], l);
            let mut micro = Vec::new();
            let mut s = start;
            while s < end {
                let e = (s + mb).min(end);
                // The packing of these rows from above (micro-batches align with
                // mini-batches), else a fresh one.
                let fresh;
                let p = match packed.get(s / mb) {
                    Some(p) if s % mb == 0 && p.rows == e - s => p,
                    _ => {
                        fresh = learner.pack_routed(&pairs(&rows[s..e]), replay.map(|r| &r[s..e]))?;
                        &fresh
                    }
                };
                let slice = |v: &[f32]| {
                    let mut v = v[s * l..e * l].to_vec();
                    v.resize(mb * l, 0.0);
                    v
                };
                let mut arrays = host(&slice);
                arrays.norm = norm;
                micro.push(learner.upload(micro.len(), p, &arrays)?);
                out.processed_tokens += (e - s) * p.width();
                s = e;
            }
            let lr = learning_rate(optim, *clock);
            let metrics = learner.step(&micro, lr)?;
            *clock += 1;
            out.steps += 1;
            for (name, v) in &metrics.values {
                *out.sums.entry(name).or_default() += v;
            }
            out.trained_tokens += norm.0 as usize;
            start = end;
        }
    }
    Ok(out)
}

/// The per-token outputs of `learner` (the policy's log-probs, or the reference's with
/// `reference`; a critic's values) for every packed micro-batch, the real rows of each in
/// order, `[rows, L]`.
fn per_row(
    learner: &mut BucketedLearner,
    packed: &[PackedMicroBatch],
    rows: usize,
    reference: bool,
) -> Result<Vec<f32>> {
    let (l, mb) = (learner.policy().response_len, learner.policy().micro_batch_size);
    let mut all = Vec::with_capacity(rows * l);
    for (k, p) in packed.iter().enumerate() {
        let out = learner.log_probs(p, reference)?;
        let real = (rows - k * mb).min(mb);
        all.extend_from_slice(&out[..real * l]);
    }
    Ok(all)
}

/// `rollout_corr/router_token_mismatch` and `rollout_corr/router_decision_mismatch`: over the
/// positions the rollout recorded routes for (`rows[i].routes`), the fraction whose experts in
/// at least one MoE layer differ from those the learner's pass used (`learner[i]`), and the
/// fraction of (position, layer) decisions that differ. A position has `per` experts, `k` per
/// layer, which compare as sets. No metric without recorded routes.
fn add_router_mismatch(
    m: &mut BTreeMap<String, f64>,
    rows: &[&Row],
    learner: &[Vec<u8>],
    (per, k): (usize, usize),
) {
    let set = |ids: &[u8]| {
        let mut v = ids.to_vec();
        v.sort_unstable();
        v
    };
    let (mut positions, mut tokens_off, mut decisions, mut decisions_off) = (0usize, 0usize, 0usize, 0usize);
    for (row, used) in rows.iter().zip(learner) {
        for (a, b) in row.routes.chunks(per).zip(used.chunks(per)) {
            let off = a
                .chunks(k)
                .zip(b.chunks(k))
                .filter(|(x, y)| set(x) != set(y))
                .count();
            positions += 1;
            tokens_off += (off > 0) as usize;
            decisions += per / k;
            decisions_off += off;
        }
    }
    if positions > 0 {
        m.insert(
            "rollout_corr/router_token_mismatch".into(),
            tokens_off as f64 / positions as f64,
        );
        m.insert(
            "rollout_corr/router_decision_mismatch".into(),
            decisions_off as f64 / decisions as f64,
        );
    }
}

fn pairs<'a>(rows: &[&'a Row]) -> Vec<(&'a [u32], &'a [u32])> {
    rows.iter()
        .map(|x| (x.prompt.as_slice(), x.response.as_slice()))
        .collect()
}

/// VeRL's `critic/*` metrics of a batch: each sequence's reward (its score, less the KL
/// penalty when that is in the reward) and the advantages over the response tokens. With these
/// outcome estimators VeRL's returns are the advantages, and it logs both.
fn add_critic_metrics(
    m: &mut BTreeMap<String, f64>,
    rewards: &[f64],
    adv: &Advantages,
    response_mask: &[f32],
) {
    let mut put = |name: &str, values: &mut dyn Iterator<Item = f64>| {
        let (mut sum, mut n) = (0.0, 0.0);
        let (mut max, mut min) = (f64::NEG_INFINITY, f64::INFINITY);
        for v in values {
            sum += v;
            n += 1.0;
            max = max.max(v);
            min = min.min(v);
        }
        if n > 0.0 {
            m.insert(format!("critic/{name}/mean"), sum / n);
            m.insert(format!("critic/{name}/max"), max);
            m.insert(format!("critic/{name}/min"), min);
        }
    };
    put("rewards", &mut rewards.iter().copied());
    // VeRL's `torch.masked_select(values, response_mask)`: every response token.
    let on_tokens = |v: &[f64]| {
        v.iter()
            .zip(response_mask)
            .filter(|(_, m)| **m != 0.0)
            .map(|(a, _)| *a)
            .collect::<Vec<f64>>()
    };
    put("advantages", &mut on_tokens(&adv.advantages).into_iter());
    put("returns", &mut on_tokens(&adv.returns).into_iter());
}

/// VeRL's critic metrics of a batch (`compute_data_metrics` with a critic): the values over
/// the response tokens, and how much of the returns' variance they explain,
/// `1 - var(returns - values) / (var(returns) + 1e-5)` (unbiased variances, as torch's).
fn add_value_metrics(m: &mut BTreeMap<String, f64>, values: &[f32], returns: &[f64], response_mask: &[f32]) {
    let on: Vec<(f64, f64)> = values
        .iter()
        .zip(returns)
        .zip(response_mask)
        .filter(|(_, m)| **m != 0.0)
        .map(|((v, r), _)| (*v as f64, *r))
        .collect();
    if on.is_empty() {
        return;
    }
    let n = on.len() as f64;
    let var = |x: &dyn Fn(&(f64, f64)) -> f64| {
        let mean = on.iter().map(x).sum::<f64>() / n;
        on.iter().map(|p| (x(p) - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)
    };
    m.insert(
        "critic/values/mean".into(),
        on.iter().map(|p| p.0).sum::<f64>() / n,
    );
    m.insert(
        "critic/values/max".into(),
        on.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max),
    );
    m.insert(
        "critic/values/min".into(),
        on.iter().map(|p| p.0).fold(f64::INFINITY, f64::min),
    );
    m.insert(
        "critic/vf_explained_var".into(),
        1.0 - var(&|p| p.1 - p.0) / (var(&|p| p.1) + 1e-5),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_with_a_non_finite_reward_or_log_prob_are_left_out() {
        let row = |score: f64, lp: f32| Row {
            group: 1,
            prompt: vec![1],
            response: vec![2, 3],
            rollout_log_probs: vec![-0.5, lp],
            score,
            reward_baseline: None,
            truncated: false,
            env_spans: Vec::new(),
            routes: Vec::new(),
        };
        let rows = [
            row(1.0, -0.1),
            row(f64::NAN, -0.1),
            row(0.0, f32::NEG_INFINITY),
            row(0.5, f32::NAN),
            row(0.0, -2.0),
        ];
        assert_eq!(finite_rows(&rows), [0, 4]);
    }

    fn plan(prompts: usize, n: usize, mini: usize, micro: usize, epochs: usize) -> BatchPlan {
        BatchPlan {
            prompts_per_step: prompts,
            group_size: n,
            mini_batch_prompts: mini,
            micro_batch_size: micro,
            epochs,
        }
    }

    #[test]
    fn batch_plan_counts_optimizer_steps_and_micro_batches() {
        // 8 prompts x 4 samples, mini-batches of 2 prompts (8 samples), micro-batches of 4.
        let p = plan(8, 4, 2, 4, 3);
        assert_eq!(p.samples_per_step(), 32);
        assert_eq!(p.mini_batch_samples(), 8);
        assert_eq!(p.mini_batches_per_step(), 4);
        assert_eq!(p.optimizer_steps_per_step(), 12);
        assert_eq!(p.total_optimizer_steps(5), 60);
        assert_eq!(p.micro_batches_per_mini_batch(), 2);
        assert_eq!(p.micro_batches_per_step(), 8);
        // One mini-batch as large as the step, one micro-batch: the fused step alone.
        let whole = plan(2, 2, 2, 4, 1);
        assert_eq!(whole.mini_batches_per_step(), 1);
        assert_eq!(whole.micro_batches_per_mini_batch(), 1);
    }
}
