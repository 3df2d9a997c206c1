//! How the orchestrator reaches its worker processes, for the assembly that starts them and
//! the supervisor that replaces them.

use crate::auth::Token;
use crate::recipe::TlsSection;
use crate::roles::reward::{RemoteReward, RewardDeadline, RewardRole};
use crate::roles::rollout::{RemoteRollout, RolloutRole};
use crate::roles::RoleError;
use std::sync::Arc;
use std::time::Duration;

/// How this process reaches the run's worker processes: the run's token, TLS, and the
/// deadlines of calls.
#[derive(Clone)]
pub(crate) struct Dialer {
    pub(super) token: Token,
    pub(super) tls: Option<TlsSection>,
    pub(super) timeout: Duration,
    pub(super) reward_deadline: RewardDeadline,
}

impl Dialer {
    pub fn rollout(&self, address: &str) -> Result<Arc<dyn RolloutRole>, RoleError> {
        let r = RemoteRollout::with_timeout(address, &self.token, self.tls.as_ref(), self.timeout)?;
        Ok(Arc::new(r))
    }

    pub fn reward(&self, address: &str) -> Result<Arc<dyn RewardRole>, RoleError> {
        let r = RemoteReward::with_deadline(address, &self.token, self.tls.as_ref(), self.reward_deadline)?;
        Ok(Arc::new(r))
    }
}
