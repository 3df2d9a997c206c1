//! Errors of the rollout engine: per-request rejections (the engine keeps serving the other
//! requests) and engine-level failures (graph, compile, run, weights).

use xla::graph::GraphError;

/// What went wrong in the rollout engine.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    /// A request that cannot be served; only that request is rejected.
    #[error("request {request_id} rejected: {problem}")]
    Rejected {
        /// The request's id.
        request_id: u64,
        /// What is wrong and what is allowed.
        problem: String,
    },
    /// Tracing or emitting a program failed.
    #[error("building the `{program}` program: {source}")]
    Graph {
        /// Which program.
        program: String,
        /// The graph error.
        #[source]
        source: GraphError,
    },
    /// The PJRT runtime refused a transfer, compile or execution.
    #[error("{action}: {source}")]
    Runtime {
        /// What was being done.
        action: String,
        /// The runtime error.
        #[source]
        source: xla::runtime::Error,
    },
    /// Weights handed to the engine do not fit the model's parameter table.
    #[error("weights for version {version}: parameter {index} (`{name}`): {problem}")]
    Weights {
        /// The weight version being installed.
        version: u64,
        /// Position in the parameter table.
        index: usize,
        /// Hugging Face tensor name.
        name: String,
        /// What is wrong (expected vs found).
        problem: String,
    },
    /// Engine configuration that cannot work.
    #[error("rollout engine configuration: {0}")]
    Config(String),
    /// The KV cache was consumed by a run that then failed.
    #[error("the KV cache was lost when a program that donated it failed; create a new engine")]
    CacheLost,
    /// The engine thread is gone (it stopped after an error or was shut down).
    #[error("the rollout engine thread has stopped: {0}")]
    Stopped(String),
}

impl RolloutError {
    pub(crate) fn runtime(action: impl Into<String>, source: xla::runtime::Error) -> RolloutError {
        RolloutError::Runtime {
            action: action.into(),
            source,
        }
    }
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, RolloutError>;
