//! The roles a run is made of. Each is a trait with an in-process implementation (the fast path
//! on one machine) and a gRPC client implementation (a worker elsewhere); the orchestrator
//! drives both through the same trait.

pub mod learner;
pub mod reward;
pub mod rollout;

use std::future::Future;
use std::pin::Pin;

/// A boxed future, so role traits stay object-safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why a call to a role failed as a whole (as opposed to one sample failing inside it).
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    /// The worker could not be reached or stopped answering: its work should go elsewhere.
    #[error("{role} worker at {address} is unavailable: {message}")]
    Unavailable {
        role: &'static str,
        address: String,
        message: String,
    },
    /// The worker refused the call (wrong token, bad request): retrying elsewhere will not help.
    #[error("{role} worker at {address} refused the call: {message}")]
    Refused {
        role: &'static str,
        address: String,
        message: String,
    },
    /// The request itself is wrong.
    #[error("{0}")]
    Invalid(String),
}

/// Classify a failed gRPC call: transport trouble means "send the work elsewhere".
pub(crate) fn status_to_error(role: &'static str, address: &str, status: tonic::Status) -> RoleError {
    use tonic::Code::*;
    let message = status.message().to_string();
    let address = address.to_string();
    match status.code() {
        Unavailable | DeadlineExceeded | Cancelled | Aborted | Unknown | Internal | ResourceExhausted => {
            RoleError::Unavailable {
                role,
                address,
                message,
            }
        }
        _ => RoleError::Refused {
            role,
            address,
            message,
        },
    }
}
