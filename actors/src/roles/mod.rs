//! The roles a run is made of. Each is a trait with an in-process implementation (the fast path
//! on one machine) and a gRPC client implementation (a worker elsewhere); the orchestrator
//! drives both through the same trait.

pub mod learner;
pub mod reward;
pub mod rollout;

use std::future::Future;
use std::pin::Pin;

/// The roles of a run, each of which a worker process can serve (spelled `rollout`, `reward`, `learner` in recipes and on the
/// command line).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Reward,
    Rollout,
    Learner,
}

impl Role {
    /// The role's name, as `--role` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Role::Reward => "reward",
            Role::Rollout => "rollout",
            Role::Learner => "learner",
        }
    }

    /// The role named `name` (`rollout`, `reward` or `learner`), if it is one.
    pub fn from_name(name: &str) -> Option<Role> {
        [Role::Rollout, Role::Reward, Role::Learner]
            .into_iter()
            .find(|r| r.name() == name)
    }
}

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
