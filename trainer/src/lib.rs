//! The GRPO learner: everything between "each sample has a reward" and "the parameters moved".
//!
//! - [`advantage`]: host-side advantage estimators (`grpo`, Dr. GRPO, `rloo`, `opo`, `gpg`,
//!   `grpo_passk`, REINFORCE++ with and without a baseline, ReMax, GAE over a critic's values),
//!   in-reward KL, the group
//!   filter of dynamic sampling (`filter_groups`, run by the orchestrator) and masking of
//!   truncated responses.
//! - [`rollout_correction`]: importance weights and rejection sampling for the gap between the
//!   rollout's and the learner's probabilities, with the `rollout_corr/*` mismatch metrics.
//! - [`loss`]: policy-loss terms as graph functions over [`xla::graph::Tensor`]s: the PPO
//!   clipped surrogate with dual clip, GSPO, SAPO, GPG, Clip-Cov, KL-Cov, GMPO and CISPO, the
//!   rollout importance weights on token losses, VeRL's loss aggregation modes, KL estimators
//!   and the entropy bonus; PPO's clipped value loss for the critic.
//! - [`optim`]: AdamW and global gradient-norm clipping as graph functions, the learning-rate
//!   schedule on the host.
//! - [`step`]: the fused `train_step` program builder (forward, loss, backward, clipping,
//!   AdamW, numerical guard), gradient accumulation (`accumulate` + `apply` programs) and the
//!   host driver [`step::Learner`] that owns the device buffers.
//! - [`sharding`]: the learner's SPMD layout (`single`, `dp`, `fsdp` over a `data` axis, times
//!   a `model` axis under tensor parallelism) and the host-side splitting and gathering of
//!   per-device shards.
//! - [`policy`]: the decoder model as the policy (or, with a value head, as PPO's critic): its
//!   parameters, batch layout and per-token log-probs (values) of responses.
//! - [`bucket`]: length buckets: each micro-batch runs padded to the smallest bucket holding its
//!   longest prompt and response ([`bucket::BucketedLearner`]), one set of programs per bucket.
//! - [`update`]: the GRPO update as a whole ([`update::GrpoUpdate`]): non-finite rows left
//!   out, old and reference log-probs, rollout correction, KL in the reward, advantages, then
//!   `ppo_epochs` passes of mini-batches of micro-batches, configured by
//!   [`update::UpdateConfig`]; [`update::BatchPlan`], the mini-batch arithmetic every caller
//!   shares.
//! - [`checkpoint`]: atomic, checksummed checkpoints under `OUTPUT/checkpoints/step_N/`.
//! - [`memory`]: transparent huge pages for the C allocator (re-executing the program with
//!   glibc's `glibc.malloc.hugetlb=1`), which cuts the page faults of XLA's per-call temporaries.
//!
//! Every formula follows VeRL (`verl/trainer/ppo/core_algos.py`, commit 012be9d9 unless a doc
//! comment says otherwise) and names its source in its doc comment.

pub mod advantage;
pub mod bucket;
pub mod checkpoint;
pub mod config;
pub mod export;
pub mod loss;
pub mod memory;
pub mod optim;
pub mod policy;
pub mod rollout_correction;
pub mod sharding;
pub mod step;
pub mod update;

pub use config::{
    AdvantageEstimator, KlPenalty, LossAggMode, LrSchedule, OptimConfig, PolicyLossConfig, PolicyLossMode,
};
pub use config::{Parallelism, Strategy};

/// What went wrong in the learner. Checkpoint errors have their own type,
/// [`checkpoint::CheckpointError`].
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// Two inputs that must describe the same samples disagree in length.
    #[error("{what}: expected {expected} values, got {got}; pass one value per {unit}")]
    Length {
        /// Which input.
        what: String,
        /// The length implied by the other inputs.
        expected: usize,
        /// The length passed.
        got: usize,
        /// What one value stands for (sample, token, ...).
        unit: &'static str,
    },
    /// A configuration value outside its valid range.
    #[error("config: {key} = {value}: {message}")]
    Config {
        /// The recipe key (VeRL's name).
        key: &'static str,
        /// The value given.
        value: String,
        /// Why it is refused and what would be accepted.
        message: String,
    },
    /// Tracing or emitting a program failed.
    #[error("building the {program} program: {source}")]
    Graph {
        /// Which program (`train_step`, `accumulate`, `apply`).
        program: &'static str,
        /// The graph builder's error (names the op, shapes and source line).
        #[source]
        source: xla::graph::GraphError,
    },
    /// The runtime refused to compile, upload, run or read back.
    #[error("{what}: {source}")]
    Runtime {
        /// What the learner was doing.
        what: String,
        /// The runtime's error.
        #[source]
        source: xla::runtime::Error,
    },
    /// A micro-batch does not match the program's inputs.
    #[error("micro-batch {index}: {message}")]
    Batch {
        /// Micro-batch number (0-based).
        index: usize,
        /// What is wrong (names the input).
        message: String,
    },
    /// Too many optimizer steps in a row were skipped because a term was not finite.
    #[error(
        "step {step}: the update was skipped {consecutive} times in a row (limit {limit}) because \
         these terms were not finite: {terms}; lower the learning rate, check the rewards and \
         log-probs of this batch, or raise trainer.max_consecutive_nonfinite"
    )]
    NonFinite {
        /// The optimizer step (0-based count of attempted updates) that hit the limit.
        step: u64,
        /// How many skipped updates in a row.
        consecutive: u32,
        /// The configured limit.
        limit: u32,
        /// The non-finite terms of the last step, comma-separated (`pg_loss`, `kl_loss`,
        /// `entropy`, `grad_norm`).
        terms: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, TrainerError>;
