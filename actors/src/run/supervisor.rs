//! The supervisor: a background task that notices dead rollout and reward workers (a failed
//! call, or a Ray job that ended) and starts a replacement for each, while the fleet's other
//! workers carry the step. A learner worker is not replaced: its next call fails and stops the
//! run, which resumes from the newest checkpoint.

use super::dialer::Dialer;
use super::fleet::Fleet;
use crate::launcher::Launcher;
use crate::roles::Role;
use std::sync::Arc;
use std::time::Duration;

/// How often the supervisor looks for dead workers.
const POLL: Duration = Duration::from_millis(200);

/// Starts the supervisor of `fleet`'s workers, started by `launcher`.
pub(crate) fn spawn(
    launcher: Arc<Launcher>,
    fleet: Arc<Fleet>,
    dialer: Dialer,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(POLL).await;
            // A Ray job that ended is a dead worker even before a call to it fails.
            for (role, index) in launcher.ended_jobs().await {
                match role {
                    Role::Rollout => fleet.rollout_failed(index),
                    Role::Reward => fleet.reward_failed(index),
                    Role::Learner => {} // its next call fails and stops the run
                }
            }
            for (role, index) in fleet.take_dead() {
                let (launcher, fleet, dialer) = (launcher.clone(), fleet.clone(), dialer.clone());
                tokio::spawn(async move {
                    tracing::warn!("starting a replacement for {} worker {index}", role.name());
                    match replace(&launcher, &fleet, &dialer, role, index).await {
                        Ok(()) => tracing::warn!("{} worker {index} replaced", role.name()),
                        Err(e) => {
                            tracing::error!("replacing {} worker {index} failed: {e}", role.name());
                            fleet.replacement_failed(role, index);
                        }
                    }
                });
            }
        }
    })
}

/// Restarts worker `index` of `role` and puts it back into the fleet.
async fn replace(
    launcher: &Launcher,
    fleet: &Fleet,
    dialer: &Dialer,
    role: Role,
    index: usize,
) -> Result<(), String> {
    let w = launcher.restart(role, index).await.map_err(|e| e.to_string())?;
    match role {
        Role::Rollout => {
            let r = dialer.rollout(&w.address).map_err(|e| e.to_string())?;
            fleet.replace_rollout(index, r).await.map_err(|e| e.to_string())
        }
        Role::Reward => {
            fleet.replace_reward(index, dialer.reward(&w.address).map_err(|e| e.to_string())?);
            Ok(())
        }
        Role::Learner => Err("a learner worker is not replaced during a run".to_string()),
    }
}
