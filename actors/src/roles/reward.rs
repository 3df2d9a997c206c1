//! The reward role: score batches of responses.
//!
//! [`LocalReward`] runs a [`reward::RewardPool`] in this process; [`RemoteReward`] calls a
//! `grpo worker --role reward` over gRPC; [`RewardService`] is the server side of that call.

use super::{BoxFuture, RoleError};
use crate::proto;
use reward::{PoolOptions, RewardFunction, RewardPool, Sample, ScoredSample};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
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

/// How long a call to a reward worker may take before the worker counts as hung.
///
/// Two guards: the connection pings the worker every `worker_timeout / 4` and gives up on it
/// when a ping goes unanswered for `worker_timeout` (a frozen or vanished process is noticed in
/// about that time, whatever the call), and every call has a deadline of `worker_timeout` plus
/// the time the worker's pool may legitimately need: `time_limit` per sample, `scorers` samples
/// at a time, for every sample this client has in flight there (its own batch and the others
/// still waiting).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RewardDeadline {
    /// `cluster.worker_timeout_s`.
    pub worker_timeout: Duration,
    /// `reward.time_limit_s`: the pool turns a sample that takes longer into a counted 0.
    pub time_limit: Duration,
    /// `reward.num_workers`: samples the worker's pool scores at once.
    pub scorers: usize,
}

impl RewardDeadline {
    /// From `cluster.worker_timeout_s` and the reward pool's options.
    pub fn new(worker_timeout: Duration, pool: &PoolOptions) -> RewardDeadline {
        RewardDeadline {
            worker_timeout,
            time_limit: pool.time_limit,
            scorers: pool.num_workers.max(1),
        }
    }

    /// The deadline of a call while `in_flight` samples (this call's included) are with the
    /// worker.
    pub fn for_samples(&self, in_flight: usize) -> Duration {
        let rounds = in_flight.div_ceil(self.scorers).max(1) as u32;
        self.worker_timeout + self.time_limit.saturating_mul(rounds)
    }
}

impl Default for RewardDeadline {
    /// A 10 s worker timeout and the reward pool's defaults.
    fn default() -> RewardDeadline {
        RewardDeadline::new(Duration::from_secs(10), &PoolOptions::default())
    }
}

/// The reward role in a worker process, reached over gRPC.
pub struct RemoteReward {
    address: String,
    client: proto::reward_client::RewardClient<
        tonic::service::interceptor::InterceptedService<tonic::transport::Channel, crate::auth::Attach>,
    >,
    deadline: RewardDeadline,
    /// Samples sent to the worker and not yet answered, over all calls.
    in_flight: Arc<AtomicUsize>,
}

impl RemoteReward {
    /// A client for the worker at `address` (`127.0.0.1:PORT`, with or without `http://`);
    /// connects lazily, over TLS when `tls` (the recipe's `cluster.tls`) is given. A worker that
    /// stops answering for 10 s is unavailable (see [`RewardDeadline::default`]).
    pub fn new(
        address: &str,
        token: &crate::auth::Token,
        tls: Option<&crate::recipe::TlsSection>,
    ) -> Result<RemoteReward, RoleError> {
        RemoteReward::with_deadline(address, token, tls, RewardDeadline::default())
    }

    /// As [`RemoteReward::new`], noticing a hung worker as `deadline` says (build it from
    /// `cluster.worker_timeout_s` and the reward pool's options).
    pub fn with_deadline(
        address: &str,
        token: &crate::auth::Token,
        tls: Option<&crate::recipe::TlsSection>,
        deadline: RewardDeadline,
    ) -> Result<RemoteReward, RoleError> {
        let endpoint =
            crate::transport::endpoint(address, tls).map_err(|e| RoleError::Invalid(e.to_string()))?;
        let channel = crate::transport::keep_alive(endpoint, deadline.worker_timeout).connect_lazy();
        let client = proto::reward_client::RewardClient::with_interceptor(channel, token.attach())
            .max_decoding_message_size(256 << 20);
        Ok(RemoteReward {
            address: crate::transport::worker_uri(address, tls),
            client,
            deadline,
            in_flight: Arc::default(),
        })
    }
}

/// Takes a call's samples off the in-flight count however the call ends.
struct InFlight<'a>(&'a AtomicUsize, usize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::SeqCst);
    }
}

impl RewardRole for RemoteReward {
    fn score(&self, samples: Vec<Sample>) -> BoxFuture<'_, Result<Vec<ScoredSample>, RoleError>> {
        Box::pin(async move {
            let count = samples.len();
            let in_flight = self.in_flight.fetch_add(count, Ordering::SeqCst) + count;
            let _counted = InFlight(&self.in_flight, count);
            let deadline = self.deadline.for_samples(in_flight);
            let request = proto::ScoreRequest {
                samples: samples.iter().map(to_proto).collect(),
            };
            // Past the deadline the call is dropped, which resets its stream: the worker stops
            // working on it too.
            let mut client = self.client.clone();
            let call = client.score(request);
            let reply = match tokio::time::timeout(deadline, call).await {
                Ok(reply) => reply.map_err(|status| {
                    super::status_to_error("reward", &self.address, crate::transport::explain_status(status))
                })?,
                Err(_) => {
                    return Err(RoleError::Unavailable {
                        role: "reward",
                        address: self.address.clone(),
                        message: format!(
                            "no answer to a call scoring {count} samples within {:.1} s \
                             (`cluster.worker_timeout_s` {:.1} s plus `reward.time_limit_s` \
                             {:.1} s for each {} of the {in_flight} samples in flight there)",
                            deadline.as_secs_f64(),
                            self.deadline.worker_timeout.as_secs_f64(),
                            self.deadline.time_limit.as_secs_f64(),
                            self.deadline.scorers,
                        ),
                    })
                }
            };
            let results: Vec<ScoredSample> = reply.into_inner().results.into_iter().map(from_proto).collect();
            if results.len() != count {
                return Err(RoleError::Invalid(format!(
                    "the reward worker at {} answered {} results for {count} samples",
                    self.address,
                    results.len()
                )));
            }
            Ok(results)
        })
    }
}

fn to_proto(s: &Sample) -> proto::RewardSample {
    proto::RewardSample {
        id: s.id,
        data_source: s.data_source.clone(),
        prompt_json: if s.prompt.is_null() {
            String::new()
        } else {
            s.prompt.to_string()
        },
        response: s.response.clone(),
        ground_truth: s.ground_truth.clone(),
        extra_json: s.extra.to_string(),
        response_length: s.response_length as u64,
        truncated: s.truncated,
    }
}

fn sample_from_proto(s: proto::RewardSample) -> Result<Sample, tonic::Status> {
    let json = |text: &str, field: &str| {
        if text.is_empty() {
            Ok(serde_json::Value::Null)
        } else {
            serde_json::from_str(text).map_err(|e| {
                tonic::Status::invalid_argument(format!("sample {}: {field} is not JSON: {e}", s.id))
            })
        }
    };
    let extra = json(&s.extra_json, "extra_json")?;
    let prompt = json(&s.prompt_json, "prompt_json")?;
    Ok(Sample {
        id: s.id,
        data_source: s.data_source,
        prompt,
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
        pred: (!s.pred.is_empty()).then_some(s.pred),
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
                pred: r.pred.unwrap_or_default(),
            })
            .collect();
        Ok(tonic::Response::new(proto::ScoreReply { results }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Token;
    use std::time::Instant;

    fn samples(count: usize) -> Vec<Sample> {
        (0..count as u64)
            .map(|id| Sample {
                id,
                data_source: "grpo/arithmetic".into(),
                prompt: serde_json::Value::Null,
                response: "#### 42".into(),
                ground_truth: "42".into(),
                extra: serde_json::Value::Null,
                response_length: 3,
                truncated: false,
            })
            .collect()
    }

    #[test]
    fn the_deadline_grows_with_the_samples_in_flight() {
        let deadline = RewardDeadline::new(
            Duration::from_secs(2),
            &PoolOptions {
                num_workers: 4,
                time_limit: Duration::from_secs(3),
                log_first_errors: 0,
            },
        );
        assert_eq!(deadline.for_samples(0), Duration::from_secs(5));
        assert_eq!(deadline.for_samples(4), Duration::from_secs(5));
        assert_eq!(deadline.for_samples(5), Duration::from_secs(8));
        assert_eq!(deadline.for_samples(16), Duration::from_secs(14));
        assert_eq!(RewardDeadline::default().for_samples(1), Duration::from_secs(70));
    }

    /// A worker whose process is frozen: the kernel still accepts connections for it, but
    /// nothing reads or answers.
    #[tokio::test]
    async fn a_frozen_worker_is_unavailable_within_its_timeout() {
        let frozen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = frozen.local_addr().unwrap().to_string();
        let deadline = RewardDeadline {
            worker_timeout: Duration::from_millis(600),
            time_limit: Duration::from_secs(60),
            scorers: 1,
        };
        let remote = RemoteReward::with_deadline(&address, &Token::generate(), None, deadline).unwrap();
        let started = Instant::now();
        let error = remote.score(samples(2)).await.unwrap_err();
        let waited = started.elapsed();
        assert!(
            matches!(error, RoleError::Unavailable { role: "reward", .. }),
            "{error:?}"
        );
        assert!(error.to_string().contains("keep-alive timed out"), "{error}");
        // The keep-alive ping gives up after 0.6 s, long before the 120.6 s call deadline.
        assert!(
            waited >= Duration::from_millis(600) && waited < Duration::from_secs(5),
            "noticed after {waited:?}: {error}"
        );
        assert_eq!(remote.in_flight.load(Ordering::SeqCst), 0);
    }

    /// A worker that answers pings but never finishes scoring.
    struct Stuck;

    #[tonic::async_trait]
    impl proto::reward_server::Reward for Stuck {
        async fn score(
            &self,
            _: tonic::Request<proto::ScoreRequest>,
        ) -> Result<tonic::Response<proto::ScoreReply>, tonic::Status> {
            std::future::pending().await
        }
    }

    #[tokio::test]
    async fn a_call_past_its_deadline_is_unavailable_with_the_arithmetic() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(proto::reward_server::RewardServer::new(Stuck))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let deadline = RewardDeadline {
            worker_timeout: Duration::from_millis(300),
            time_limit: Duration::from_millis(100),
            scorers: 2,
        };
        let remote = RemoteReward::with_deadline(&address, &Token::generate(), None, deadline).unwrap();
        let started = Instant::now();
        let error = remote.score(samples(3)).await.unwrap_err().to_string();
        assert!(started.elapsed() < Duration::from_secs(3), "{error}");
        assert_eq!(
            error,
            format!(
                "reward worker at http://{address} is unavailable: no answer to a call scoring 3 \
                 samples within 0.5 s (`cluster.worker_timeout_s` 0.3 s plus `reward.time_limit_s` \
                 0.1 s for each 2 of the 3 samples in flight there)"
            )
        );
        assert_eq!(remote.in_flight.load(Ordering::SeqCst), 0);
    }
}
