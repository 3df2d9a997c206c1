//! The rollout role: generate the samples of a batch of requests, streaming each back as it
//! finishes, and take new weights when the learner has them.
//!
//! [`LocalRollout`] runs a [`rollout::Engine`] in this process and shares the learner's
//! parameter buffers (no copy); a remote implementation calls a `grpo worker --role rollout`
//! over gRPC and streams the weights to it. The orchestrator drives both through
//! [`RolloutRole`].
//!
//! A weight update's path: in process, `LocalRollout`'s [`RolloutRole::update_weights`] hands
//! the buffers to the engine's thread ([`rollout::EngineControl::update_weights`], then
//! [`rollout::Engine::update_weights`]). To a worker, [`RemoteRollout`] streams CRC-checked
//! chunks (from device buffers, or from the host tensors a learner worker sent, which pass
//! through the orchestrator without touching a device), and [`RolloutService`] assembles,
//! uploads and installs them into the worker's own `LocalRollout`, merging or setting LoRA
//! adapters first where the run sends only those ([`rollout::AdapterInstall`]). The worker
//! replies with the digest of the weights it then samples with (`wire.rs`, `WeightDigest`,
//! kept only once installed); a digest other than the one sent stops the step naming the
//! worker. `GRPO_FAULT_SKIP_WEIGHT_INSTALL=V` makes a worker acknowledge version V without
//! installing it, for the test that shows this check works.

mod local;
mod remote;
mod service;
mod wire;

pub use local::LocalRollout;
pub use remote::RemoteRollout;
pub use service::{ChunkError, RolloutService};
// The weight stream's chunking and assembly, reused by the learner role's streams.
pub(crate) use remote::send_chunks;
pub(crate) use service::Assembly;
pub(crate) use wire::{parse_dtype, CHUNK_BYTES};

use super::{BoxFuture, RoleError};
use model::HostTensor;
use rollout::{GenerationRequest, Sample};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;
use xla::runtime::Buffer;

/// A new version of the policy's parameters (in [`model::param_table`] order).
#[derive(Clone)]
pub struct WeightUpdate {
    /// The version: the number of optimizer steps that produced these weights.
    pub version: u64,
    pub params: UpdateParams,
}

/// Where a weight update's tensors are.
#[derive(Clone)]
pub enum UpdateParams {
    /// Device buffers shared with the learner: a replica per device of the rollout engine in
    /// this process (see [`rollout::EngineWeights`]); a remote rollout streams the first.
    Device(rollout::EngineWeights),
    /// Host tensors as a learner worker streamed them, in the rollout's dtype: a remote
    /// rollout streams them on as they are (no trip through a device); an in-process engine
    /// takes device buffers only.
    Host(Arc<[HostTensor]>),
}

impl From<rollout::EngineWeights> for UpdateParams {
    fn from(weights: rollout::EngineWeights) -> UpdateParams {
        UpdateParams::Device(weights)
    }
}

impl From<Arc<[Buffer]>> for UpdateParams {
    fn from(params: Arc<[Buffer]>) -> UpdateParams {
        UpdateParams::Device(params.into())
    }
}

impl From<Vec<Buffer>> for UpdateParams {
    fn from(params: Vec<Buffer>) -> UpdateParams {
        UpdateParams::Device(params.into())
    }
}

/// Generates samples. Every sample of every request is sent exactly once, tagged with the
/// weight version that produced it.
pub trait RolloutRole: Send + Sync {
    /// Generates all samples of `requests`, sending each to `samples` as it finishes; resolves
    /// once every one was sent. On an [`RoleError::Unavailable`] error some may not have been
    /// sent: the caller re-issues those elsewhere (request ids and seeds make the re-issued
    /// samples the same ones).
    fn generate(
        &self,
        requests: Vec<GenerationRequest>,
        samples: UnboundedSender<Sample>,
    ) -> BoxFuture<'_, Result<(), RoleError>>;

    /// Installs `update` before any further generation; samples in flight restart on it.
    /// Resolves to the bytes of tensor data sent over the network for it (0 in this process).
    fn update_weights(&self, update: WeightUpdate) -> BoxFuture<'_, Result<u64, RoleError>>;

    /// The weight version this worker generates with.
    fn weight_version(&self) -> u64;

    /// Where it runs, for logs ("in-process" or an address).
    fn location(&self) -> String;
}
