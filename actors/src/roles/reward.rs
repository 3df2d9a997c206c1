//! The reward role: score batches of responses.
//!
//! [`LocalReward`] runs a [`reward::RewardPool`] in this process; [`RemoteReward`] calls a
//! `grpo worker --role reward` over gRPC; [`RewardService`] is the server side of that call.

use super::{BoxFuture, RoleError};
use crate::proto;
use reward::{PoolOptions, RewardFunction, RewardPool, Sample, ScoredSample};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// Scores batches of samples. Every sample of a batch gets exactly one result.
pub trait RewardRole: Send + Sync {
    fn score(&self, samples: Vec<Sample>) -> BoxFuture<'_, Result<Vec<ScoredSample>, RoleError>>;
}

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<ScoredSample>>>>;

/// The reward role in this process: a worker pool plus a thread that hands each result to the
/// call waiting for it, so several batches can be in flight at once.
pub struct LocalReward {
    pool: Arc<RewardPool>,
    waiters: Waiters,
}

impl LocalReward {
    pub fn new(function: Arc<RewardFunction>, options: PoolOptions) -> LocalReward {
        let pool = Arc::new(RewardPool::new(function, options));
        let waiters: Waiters = Arc::default();
        let (p, w) = (Arc::downgrade(&pool), waiters.clone());
        std::thread::Builder::new()
            .name("reward-dispatch".into())
            .spawn(move || loop {
                let Some(pool) = p.upgrade() else { return };
                let Some(scored) = pool.recv_timeout(std::time::Duration::from_millis(200)) else {
                    continue;
                };
                let waiter = w.lock().unwrap_or_else(|e| e.into_inner()).remove(&scored.id);
                if let Some(tx) = waiter {
                    let _ = tx.send(scored);
                }
            })
            .expect("spawn the reward dispatcher");
        LocalReward { pool, waiters }
    }

    /// Samples being scored or waiting to be.
    pub fn in_flight(&self) -> usize {
        self.waiters.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The pool's counters (errors by kind, ...).
    pub fn metrics(&self) -> reward::PoolMetrics {
        self.pool.metrics()
    }
}

impl RewardRole for LocalReward {
    fn score(&self, samples: Vec<Sample>) -> BoxFuture<'_, Result<Vec<ScoredSample>, RoleError>> {
        Box::pin(async move {
            let mut receivers = Vec::with_capacity(samples.len());
            {
                let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
                for s in &samples {
                    if waiters.contains_key(&s.id) {
                        return Err(RoleError::Invalid(format!(
                            "sample id {} is already being scored; ids must be unique",
                            s.id
                        )));
                    }
                }
                for s in &samples {
                    let (tx, rx) = oneshot::channel();
                    waiters.insert(s.id, tx);
                    receivers.push(rx);
                }
            }
            for s in samples {
                let id = s.id;
                if let Err(e) = self.pool.submit(s) {
                    self.waiters.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                    return Err(RoleError::Invalid(e.to_string()));
                }
            }
            let mut results = Vec::with_capacity(receivers.len());
            for rx in receivers {
                results.push(
                    rx.await
                        .map_err(|_| RoleError::Invalid("the reward pool shut down".into()))?,
                );
            }
            Ok(results)
        })
    }
}

/// The reward role in a worker process, reached over gRPC.
pub struct RemoteReward {
    address: String,
    client: proto::reward_client::RewardClient<
        tonic::service::interceptor::InterceptedService<tonic::transport::Channel, crate::auth::Attach>,
    >,
}

impl RemoteReward {
    /// A client for the worker at `address` (`127.0.0.1:PORT`, with or without `http://`);
    /// connects lazily, over TLS when `tls` (the recipe's `cluster.tls`) is given.
    pub fn new(
        address: &str,
        token: &crate::auth::Token,
        tls: Option<&crate::recipe::TlsSection>,
    ) -> Result<RemoteReward, RoleError> {
        let channel =
            crate::transport::channel(address, tls).map_err(|e| RoleError::Invalid(e.to_string()))?;
        let client = proto::reward_client::RewardClient::with_interceptor(channel, token.attach())
            .max_decoding_message_size(256 << 20);
        Ok(RemoteReward {
            address: address.to_string(),
            client,
        })
    }
}

impl RewardRole for RemoteReward {
    fn score(&self, samples: Vec<Sample>) -> BoxFuture<'_, Result<Vec<ScoredSample>, RoleError>> {
        Box::pin(async move {
            let request = proto::ScoreRequest {
                samples: samples.iter().map(to_proto).collect(),
            };
            let reply = self
                .client
                .clone()
                .score(request)
                .await
                .map_err(|status| super::status_to_error("reward", &self.address, status))?;
            Ok(reply.into_inner().results.into_iter().map(from_proto).collect())
        })
    }
}

fn to_proto(s: &Sample) -> proto::RewardSample {
    proto::RewardSample {
        id: s.id,
        data_source: s.data_source.clone(),
        response: s.response.clone(),
        ground_truth: s.ground_truth.clone(),
        extra_json: s.extra.to_string(),
        response_length: s.response_length as u64,
        truncated: s.truncated,
    }
}

fn sample_from_proto(s: proto::RewardSample) -> Result<Sample, tonic::Status> {
    let extra = if s.extra_json.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_str(&s.extra_json).map_err(|e| {
            tonic::Status::invalid_argument(format!("sample {}: extra_json is not JSON: {e}", s.id))
        })?
    };
    Ok(Sample {
        id: s.id,
        data_source: s.data_source,
        response: s.response,
        ground_truth: s.ground_truth,
        extra,
        response_length: s.response_length as usize,
        truncated: s.truncated,
    })
}

fn from_proto(s: proto::ScoredSample) -> ScoredSample {
    ScoredSample {
        id: s.id,
        score: s.score,
        extras: s.extras.into_iter().collect(),
        error: (!s.error.is_empty()).then_some(s.error),
    }
}

/// The gRPC server side of the reward role.
pub struct RewardService {
    pub local: Arc<LocalReward>,
}

#[tonic::async_trait]
impl proto::reward_server::Reward for RewardService {
    async fn score(
        &self,
        request: tonic::Request<proto::ScoreRequest>,
    ) -> Result<tonic::Response<proto::ScoreReply>, tonic::Status> {
        let samples = request
            .into_inner()
            .samples
            .into_iter()
            .map(sample_from_proto)
            .collect::<Result<Vec<_>, _>>()?;
        let results = self
            .local
            .score(samples)
            .await
            .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
        let results = results
            .into_iter()
            .map(|r| proto::ScoredSample {
                id: r.id,
                score: r.score,
                extras: r.extras.into_iter().collect(),
                error: r.error.unwrap_or_default(),
            })
            .collect();
        Ok(tonic::Response::new(proto::ScoreReply { results }))
    }
}
