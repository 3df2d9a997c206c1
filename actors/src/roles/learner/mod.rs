//! The learner role: turn a step's scored samples into an optimizer update, hand out the
//! current weights for the rollout, and give up its state for a checkpoint. The reference model
//! lives with the learner.
//!
//! [`LocalLearner`] trains on this process's device and shares its parameter buffers with an
//! in-process rollout engine (no copy); [`RemoteLearner`] calls a `grpo worker --role learner`
//! over gRPC, which streams the weights back in the rollout weight stream's checksummed chunks
//! and its state (parameters and AdamW moments) in the same chunks; [`LearnerService`] is that
//! worker's server side. The orchestrator drives both through [`LearnerRole`] and keeps owning
//! checkpoints: it reads the state from the learner and writes the checkpoint itself, and on
//! resume hands the checkpoint's state to the learner. With PPO's critic its state follows
//! the policy's in the same stream ([`LearnerStates`]).
//!
//! LoRA (`actor.lora_rank`): the adapters are the trainable parameters and the model's weights
//! the frozen ones ([`initial_weights`]). Learner and rollout compute in one form,
//! `setup::lora_form` (`actor.lora_form`). Merged: after each update the in-process learner
//! merges on its devices (`model::lora::MergeProgram`, one SPMD program over its mesh) and
//! hands the rollout the merged weights. Applied: the in-process engine holds the learner's
//! own frozen base (`LocalLearner::base_source`, handed off once) and each sync carries only
//! the adapters ([`Synced::Adapters`]). Rollout workers of a LoRA run hold the base
//! themselves and are streamed only the adapters, in f32.

mod local;
mod remote;
mod service;

pub use local::{initial_adapter, initial_weights, InitialWeights, LocalLearner};
pub use remote::RemoteLearner;
pub use service::LearnerService;

use super::{BoxFuture, RoleError};
use model::HostTensor;
use trainer::step::LearnerState;
use trainer::update::{Row, UpdateClocks, UpdateReport};
use xla::DType;

/// What a checkpoint holds of the learner: the policy's state and, with PPO
/// (`algorithm.adv_estimator: gae`), the critic's.
#[derive(Clone, Debug, PartialEq)]
pub struct LearnerStates {
    pub policy: LearnerState,
    pub critic: Option<LearnerState>,
}

/// The learner's current parameters, as the rollout side gets them.
pub enum LearnerWeights {
    /// The learner's own device buffers in this process (shared, not copied) with their
    /// layout: on one device its compute-dtype parameters; over a `dp`/`fsdp` mesh every
    /// device's f32 masters (replicas or shards). The caller turns them into its rollout
    /// engine's replicas on the same devices with [`rollout::handoff`] (on the devices).
    Shared(rollout::SourceParams),
    /// The parameters received from a learner worker, in parameter-table order, as host bytes
    /// of the dtype that was asked for.
    Host(Vec<HostTensor>),
}

/// What a weight sync carries to the rollout side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Synced {
    /// The model's weights, in the rollout's dtype (with LoRA the merged `W + s·B·A`).
    Model,
    /// With LoRA, the adapters alone, in f32: a rollout worker holds the frozen base itself
    /// and merges each version's adapters into it on its devices.
    Adapters,
}

/// The learner of a run. Calls come one at a time from the orchestrator's step loop.
pub trait LearnerRole: Send + Sync {
    /// One GRPO update (advantages, `ppo_epochs` passes of mini-batches, one optimizer step
    /// each) from the scored samples of a step; returns its metrics.
    fn update(&self, rows: Vec<Row>) -> BoxFuture<'_, Result<UpdateReport, RoleError>>;

    /// The current parameters (`what`: the model's weights or, with LoRA, the adapters). A
    /// learner in this process shares its own buffers; a learner worker streams them, stamped
    /// `version`, converted to `dtype` (the rollout's; f32 for adapters).
    fn weights(
        &self,
        version: u64,
        dtype: DType,
        what: Synced,
    ) -> BoxFuture<'_, Result<LearnerWeights, RoleError>>;

    /// The state a checkpoint holds: f32 parameters, AdamW moments and step count, of the
    /// policy and, with PPO, of the critic.
    fn state(&self) -> BoxFuture<'_, Result<LearnerStates, RoleError>>;

    /// Optimizer steps so far (the learning-rate schedule's clock) and the in-reward KL
    /// coefficient: what a checkpoint keeps besides the state.
    fn clocks(&self) -> UpdateClocks;

    /// Where it runs, for logs and errors ("in-process" or an address).
    fn location(&self) -> String;
}
