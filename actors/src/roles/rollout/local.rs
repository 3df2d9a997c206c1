//! The rollout role in this process: a [`rollout::Engine`] on its own thread, plus a thread
//! that routes each finished sample to the call that asked for it.

use super::{RolloutRole, UpdateParams, WeightUpdate};
use crate::roles::{BoxFuture, RoleError};
use rollout::{Engine, EngineControl, EngineOutput, GenerationRequest, RolloutError, Sample, TurnHandler};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc::UnboundedSender, oneshot};

/// One `generate` call: where its samples go and how many are still to come.
struct Call {
    samples: UnboundedSender<Sample>,
    remaining: usize,
    done: Option<oneshot::Sender<Result<(), RoleError>>>,
}

impl Call {
    fn finish(&mut self, result: Result<(), RoleError>) {
        if let Some(done) = self.done.take() {
            let _ = done.send(result);
        }
    }
}

#[derive(Default)]
struct Routes {
    /// request id -> call id
    requests: HashMap<u64, u64>,
    calls: HashMap<u64, Call>,
    next_call: u64,
}

type SharedRoutes = Arc<Mutex<Routes>>;

fn lock(routes: &SharedRoutes) -> std::sync::MutexGuard<'_, Routes> {
    routes.lock().unwrap_or_else(|e| e.into_inner())
}

/// A rollout engine in this process. Weight updates share the learner's buffers.
pub struct LocalRollout {
    control: EngineControl,
    routes: SharedRoutes,
    version: AtomicU64,
}

impl LocalRollout {
    /// Starts `engine` on its own thread.
    pub fn new(engine: Engine) -> LocalRollout {
        LocalRollout::with_environment(engine, None)
    }

    /// Starts `engine` on its own thread with the environment that answers its multi-turn
    /// requests' turns.
    pub fn with_environment(engine: Engine, environment: Option<Arc<dyn TurnHandler>>) -> LocalRollout {
        let version = AtomicU64::new(engine.weight_version());
        let handle = engine.spawn_with(environment);
        let control = handle.control();
        let routes: SharedRoutes = Arc::default();
        let weak = Arc::downgrade(&routes);
        std::thread::Builder::new()
            .name("rollout-dispatch".into())
            .spawn(move || {
                let stopped = loop {
                    let output = match handle.outputs().recv_timeout(Duration::from_millis(200)) {
                        Ok(o) => o,
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                            if weak.strong_count() == 0 {
                                break None;
                            }
                            continue;
                        }
                        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                            break Some("the engine thread ended".to_string())
                        }
                    };
                    let Some(routes) = weak.upgrade() else { break None };
                    dispatch(&routes, output);
                };
                // The engine's own error says more than "disconnected".
                let result = handle.shutdown();
                if let (Some(routes), Some(why)) = (weak.upgrade(), stopped) {
                    let message = match result {
                        Err(e) => e.to_string(),
                        Ok(_) => why,
                    };
                    fail_all(&routes, &message);
                }
            })
            .expect("spawn the rollout dispatcher");
        LocalRollout {
            control,
            routes,
            version,
        }
    }
}

fn dispatch(routes: &SharedRoutes, output: EngineOutput) {
    let mut r = lock(routes);
    match output {
        EngineOutput::Sample(sample) => {
            let Some(&call_id) = r.requests.get(&sample.request_id) else {
                return; // a call that already failed
            };
            let call = r.calls.get_mut(&call_id).expect("routes stay consistent");
            let _ = call.samples.send(sample);
            call.remaining -= 1;
            if call.remaining == 0 {
                call.finish(Ok(()));
                r.calls.remove(&call_id);
                r.requests.retain(|_, c| *c != call_id);
            }
        }
        EngineOutput::Rejected(e) => {
            let request_id = match &e {
                RolloutError::Rejected { request_id, .. } => Some(*request_id),
                _ => None,
            };
            let call_id = request_id.and_then(|id| r.requests.get(&id).copied());
            match call_id {
                Some(call_id) => {
                    if let Some(mut call) = r.calls.remove(&call_id) {
                        call.finish(Err(RoleError::Invalid(e.to_string())));
                    }
                    r.requests.retain(|_, c| *c != call_id);
                }
                None => {
                    drop(r);
                    fail_all(routes, &e.to_string());
                }
            }
        }
    }
}

fn fail_all(routes: &SharedRoutes, message: &str) {
    let mut r = lock(routes);
    for (_, mut call) in r.calls.drain() {
        call.finish(Err(RoleError::Unavailable {
            role: "rollout",
            address: "in-process".into(),
            message: message.to_string(),
        }));
    }
    r.requests.clear();
}

impl RolloutRole for LocalRollout {
    fn generate(
        &self,
        requests: Vec<GenerationRequest>,
        samples: UnboundedSender<Sample>,
    ) -> BoxFuture<'_, Result<(), RoleError>> {
        Box::pin(async move {
            let total: usize = requests.iter().map(|r| r.n).sum();
            if total == 0 {
                return Ok(());
            }
            let (done, finished) = oneshot::channel();
            {
                let mut r = lock(&self.routes);
                if let Some(dup) = requests.iter().find(|q| r.requests.contains_key(&q.id)) {
                    return Err(RoleError::Invalid(format!(
                        "request id {} is already being generated; ids must be unique",
                        dup.id
                    )));
                }
                let call_id = r.next_call;
                r.next_call += 1;
                for q in &requests {
                    r.requests.insert(q.id, call_id);
                }
                r.calls.insert(
                    call_id,
                    Call {
                        samples,
                        remaining: total,
                        done: Some(done),
                    },
                );
            }
            // All at once, so the engine admits them in one deterministic order.
            if let Err(e) = self.control.submit_all(requests) {
                fail_all(&self.routes, &e.to_string());
            }
            finished.await.unwrap_or_else(|_| {
                Err(RoleError::Unavailable {
                    role: "rollout",
                    address: "in-process".into(),
                    message: "the rollout dispatcher stopped".into(),
                })
            })
        })
    }

    fn update_weights(&self, update: WeightUpdate) -> BoxFuture<'_, Result<u64, RoleError>> {
        Box::pin(async move {
            let control = self.control.clone();
            let version = update.version;
            let UpdateParams::Device(params) = update.params else {
                return Err(RoleError::Invalid(format!(
                    "weight update {version}: an in-process rollout takes device buffers, not host \
                     tensors; upload them to its devices first"
                )));
            };
            let result = tokio::task::spawn_blocking(move || control.update_weights(version, params))
                .await
                .map_err(|e| RoleError::Invalid(format!("weight update task failed: {e}")))?;
            result.map_err(|e| RoleError::Invalid(e.to_string()))?;
            self.version.store(version, Ordering::SeqCst);
            Ok(0)
        })
    }

    fn weight_version(&self) -> u64 {
        self.version.load(Ordering::SeqCst)
    }

    fn location(&self) -> String {
        "in-process".into()
    }
}
