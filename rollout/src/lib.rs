//! The rollout engine of `grpo`: generation for GRPO with continuous batching over a fixed
//! number of KV-cache slots, group prefix sharing (one prefill per prompt, copied on the device
//! into its `n` slots), on-device seeded sampling (temperature, top-k, top-p, greedy) fused into
//! the decode step, stop rules (EOS ids, stop strings, `max_new_tokens`), per-token log-probs,
//! and weight hot-swap between steps without recompiling.
//!
//! - [`engine`]: requests, samples, scheduling, hot-swap, the streaming thread handle;
//! - [`programs`]: the compiled prefill + fan-out and decode + sample programs;
//! - [`sampling`]: sampling parameters, Threefry keys, the traced sampler and its host
//!   reference distribution;
//! - [`weights`]: the engine's per-device weight replicas and the on-device handoff from a
//!   learner's layout (replicated or sharded, any dtype) to them; for a LoRA run, adapters
//!   beside the weights ([`EngineWeights::adapters_only`]) or merged into a base a worker holds
//!   ([`AdapterInstall`]);
//! - [`layout`]: where an engine's tensors live: the slot-group x model mesh, the parameters'
//!   Megatron layout on it, the KV cache's shape and sharding;
//! - [`plan`]: which programs an engine compiles for a request shape and cache length, shared
//!   with `grpo compile`;
//! - [`environment`]: multi-turn tool use ([`environment::ToolEnvironment`]), the
//!   [`TurnHandler`] that answers a parked model turn; [`agent_program`]: the user's agent
//!   program as that handler, through [`openai`], OpenAI's HTTP API as the engine speaks it
//!   (shared with `grpo serve`).
//!
//! The crate does not depend on the learner (`trainer`): a weight update arrives as device
//! buffers ([`EngineWeights`]), or as another program's layout to hand off ([`SourceParams`]).

pub mod agent_program;
pub mod engine;
pub mod environment;
pub mod error;
pub mod layout;
pub mod openai;
pub mod plan;
pub mod programs;
pub mod sampling;
pub mod weights;

pub use engine::{
    Engine, EngineConfig, EngineControl, EngineHandle, EngineOutput, EngineStats, Episode, EpisodeStats,
    FinishReason, GenerationRequest, Resume, Resumer, Sample, Turn, TurnHandler, TurnId,
    MAX_RECORDED_EXPERTS,
};
pub use error::{Result, RolloutError};
pub use layout::rollout_layout;
pub use sampling::SamplingParams;
pub use weights::{
    handoff, upload_parameter, upload_weights, upload_weights_on, AdapterInstall, EngineWeights, SourceParams,
};
