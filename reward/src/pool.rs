//! The reward worker pool: scores samples in parallel as they arrive, so the orchestrator can
//! feed it while generation is still running.
//!
//! [`RewardPool::submit`] queues a sample; results come back in completion order through
//! [`RewardPool::recv`] / [`RewardPool::try_recv`] / [`RewardPool::recv_timeout`] as
//! [`ScoredSample`]s. Every submitted sample yields exactly one result. A scorer that fails —
//! returns an error, panics, returns a non-finite number, or runs past the pool's time limit —
//! gives its sample a score of 0 and an `error`; the error is counted by kind in
//! [`PoolMetrics`], the first few are logged with `tracing`, and the pool carries on.
//!
//! Time limit: a watchdog thread checks running samples; one that runs past the limit is
//! answered with a timeout error at once, and its worker thread (which cannot be interrupted
//! safely) is abandoned and replaced by a fresh one, so the pool keeps its width. The abandoned
//! thread exits when its scorer finally returns; its late result is discarded.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::registry::RewardFunction;
use crate::scorer::{Sample, Score, ScoreError};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Pool settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolOptions {
    /// Worker threads.
    pub num_workers: usize,
    /// Time limit per sample.
    pub time_limit: Duration,
    /// How many errors are logged in full.
    pub log_first_errors: usize,
}

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            num_workers: 4,
            time_limit: Duration::from_secs(60),
            log_first_errors: 5,
        }
    }
}

/// The result for one submitted sample.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredSample {
    /// The sample's id.
    pub id: u64,
    /// The reward (0 when `error` is set).
    pub score: f64,
    /// The scorer's named extras (empty when `error` is set).
    pub extras: BTreeMap<String, f64>,
    /// The answer the scorer extracted, if it reports one.
    pub pred: Option<String>,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

/// Counters of a pool's work so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolMetrics {
    /// Samples submitted.
    pub submitted: u64,
    /// Results produced (successes and errors).
    pub completed: u64,
    /// Results that are errors.
    pub errors: u64,
    /// Errors by kind (`timeout`, `panic`, `external`, `non_finite`, `no_scorer`, ...).
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Worker threads abandoned after a time-out (each is replaced by a fresh one while there
    /// is work left).
    pub workers_abandoned: u64,
}

/// Why a sample was not accepted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// The pool was closed.
    #[error("sample {sample_id} submitted after the reward pool was closed; submit before calling `close`")]
    Closed {
        /// The rejected sample's id.
        sample_id: u64,
    },
}

struct Job {
    sample: Sample,
    answered: Arc<AtomicBool>,
}

struct Running {
    sample_id: u64,
    scorer: String,
    started: Instant,
    answered: Arc<AtomicBool>,
    abandoned: Arc<AtomicBool>,
}

struct Shared {
    reward: Arc<RewardFunction>,
    options: PoolOptions,
    queue: Mutex<VecDeque<Job>>,
    job_ready: Condvar,
    closed: AtomicBool,
    running: Mutex<HashMap<u64, Running>>,
    results: Mutex<Sender<ScoredSample>>,
    metrics: Mutex<PoolMetrics>,
    errors_logged: AtomicUsize,
    next_worker: AtomicU64,
    live_workers: AtomicUsize,
}

impl Shared {
    /// Sends the one result of a sample, unless it was already answered.
    fn deliver(&self, sample_id: u64, answered: &AtomicBool, result: Result<Score, ScoreError>) {
        if answered.swap(true, Ordering::SeqCst) {
            return;
        }
        let scored = match result {
            Ok(score) => {
                lock(&self.metrics).completed += 1;
                ScoredSample {
                    id: sample_id,
                    score: score.value,
                    extras: score.extras,
                    pred: score.pred,
                    error: None,
                }
            }
            Err(error) => {
                {
                    let mut metrics = lock(&self.metrics);
                    metrics.completed += 1;
                    metrics.errors += 1;
                    *metrics
                        .errors_by_kind
                        .entry(error.kind().to_string())
                        .or_insert(0) += 1;
                }
                let logged = self.errors_logged.fetch_add(1, Ordering::Relaxed);
                if logged < self.options.log_first_errors {
                    tracing::warn!(
                        sample_id,
                        kind = error.kind(),
                        "reward error (sample scored 0): {error}"
                    );
                } else if logged == self.options.log_first_errors {
                    tracing::warn!("more reward errors: counted in the metrics, no longer logged");
                }
                ScoredSample {
                    id: sample_id,
                    score: 0.0,
                    extras: BTreeMap::new(),
                    pred: None,
                    error: Some(error.to_string()),
                }
            }
        };
        let _ = lock(&self.results).send(scored);
    }

    fn next_job(&self, abandoned: &AtomicBool) -> Option<Job> {
        let mut queue = lock(&self.queue);
        loop {
            if abandoned.load(Ordering::SeqCst) {
                return None;
            }
            if let Some(job) = queue.pop_front() {
                return Some(job);
            }
            if self.closed.load(Ordering::SeqCst) {
                return None;
            }
            queue = self
                .job_ready
                .wait(queue)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        text.to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "(a panic payload that is not a string)".to_string()
    }
}

fn spawn_worker(shared: Arc<Shared>) {
    let worker = shared.next_worker.fetch_add(1, Ordering::Relaxed);
    shared.live_workers.fetch_add(1, Ordering::SeqCst);
    let spawned = std::thread::Builder::new()
        .name(format!("reward-worker-{worker}"))
        .spawn({
            let shared = shared.clone();
            move || {
                let abandoned = Arc::new(AtomicBool::new(false));
                while let Some(job) = shared.next_job(&abandoned) {
                    let sample = job.sample;
                    let scorer = shared
                        .reward
                        .scorer_for(&sample.data_source)
                        .map(|s| s.name().to_string())
                        .unwrap_or_default();
                    lock(&shared.running).insert(
                        worker,
                        Running {
                            sample_id: sample.id,
                            scorer: scorer.clone(),
                            started: Instant::now(),
                            answered: job.answered.clone(),
                            abandoned: abandoned.clone(),
                        },
                    );
                    let result = catch_unwind(AssertUnwindSafe(|| shared.reward.score(&sample)))
                        .unwrap_or_else(|payload| {
                            Err(ScoreError::Panicked {
                                scorer,
                                sample_id: sample.id,
                                message: panic_message(payload.as_ref()),
                            })
                        });
                    lock(&shared.running).remove(&worker);
                    shared.deliver(sample.id, &job.answered, result);
                }
                if !abandoned.load(Ordering::SeqCst) {
                    shared.live_workers.fetch_sub(1, Ordering::SeqCst);
                }
            }
        });
    if let Err(error) = spawned {
        shared.live_workers.fetch_sub(1, Ordering::SeqCst);
        tracing::error!("could not start a reward worker thread: {error}");
    }
}

/// Answers samples that ran past the time limit and replaces their workers.
fn watchdog(shared: Arc<Shared>) {
    let period = (shared.options.time_limit / 10).clamp(Duration::from_millis(5), Duration::from_millis(100));
    loop {
        std::thread::sleep(period);
        let expired: Vec<Running> = {
            let mut running = lock(&shared.running);
            let workers: Vec<u64> = running
                .iter()
                .filter(|(_, entry)| entry.started.elapsed() > shared.options.time_limit)
                .map(|(worker, _)| *worker)
                .collect();
            workers
                .into_iter()
                .filter_map(|worker| running.remove(&worker))
                .collect()
        };
        for entry in expired {
            entry.abandoned.store(true, Ordering::SeqCst);
            shared.live_workers.fetch_sub(1, Ordering::SeqCst);
            let error = ScoreError::TimedOut {
                scorer: entry.scorer,
                sample_id: entry.sample_id,
                limit: shared.options.time_limit,
            };
            lock(&shared.metrics).workers_abandoned += 1;
            if !(shared.closed.load(Ordering::SeqCst) && lock(&shared.queue).is_empty()) {
                spawn_worker(shared.clone());
            }
            shared.deliver(entry.sample_id, &entry.answered, Err(error));
        }
        // Done when the pool is gone, or closed with every worker finished (a worker that has
        // taken the last job stays live until it delivers, so its time limit is still watched).
        let finished =
            shared.closed.load(Ordering::SeqCst) && shared.live_workers.load(Ordering::SeqCst) == 0;
        if Arc::strong_count(&shared) == 1 || finished {
            return;
        }
    }
}

/// A pool of reward workers (see the module documentation).
pub struct RewardPool {
    shared: Arc<Shared>,
    results: Mutex<Receiver<ScoredSample>>,
    received: AtomicU64,
}

impl RewardPool {
    /// Starts `options.num_workers` workers (at least 1) scoring with `reward`.
    pub fn new(reward: Arc<RewardFunction>, options: PoolOptions) -> Self {
        let (sender, receiver) = mpsc::channel();
        let shared = Arc::new(Shared {
            reward,
            options,
            queue: Mutex::new(VecDeque::new()),
            job_ready: Condvar::new(),
            closed: AtomicBool::new(false),
            running: Mutex::new(HashMap::new()),
            results: Mutex::new(sender),
            metrics: Mutex::new(PoolMetrics::default()),
            errors_logged: AtomicUsize::new(0),
            next_worker: AtomicU64::new(0),
            live_workers: AtomicUsize::new(0),
        });
        for _ in 0..options.num_workers.max(1) {
            spawn_worker(shared.clone());
        }
        let watchdog_shared = shared.clone();
        if let Err(error) = std::thread::Builder::new()
            .name("reward-watchdog".into())
            .spawn(move || watchdog(watchdog_shared))
        {
            tracing::error!(
                "could not start the reward watchdog thread; time limits are not enforced: {error}"
            );
        }
        Self {
            shared,
            results: Mutex::new(receiver),
            received: AtomicU64::new(0),
        }
    }

    /// Queues `sample` for scoring.
    pub fn submit(&self, sample: Sample) -> Result<(), SubmitError> {
        // Checked under the queue lock, so a sample is either queued before `close` or refused.
        let mut queue = lock(&self.shared.queue);
        if self.shared.closed.load(Ordering::SeqCst) {
            return Err(SubmitError::Closed { sample_id: sample.id });
        }
        lock(&self.shared.metrics).submitted += 1;
        queue.push_back(Job {
            sample,
            answered: Arc::new(AtomicBool::new(false)),
        });
        drop(queue);
        self.shared.job_ready.notify_one();
        Ok(())
    }

    /// Accepts no more samples; queued ones are still scored and delivered.
    pub fn close(&self) {
        let queue = lock(&self.shared.queue);
        self.shared.closed.store(true, Ordering::SeqCst);
        drop(queue);
        self.shared.job_ready.notify_all();
    }

    fn outstanding(&self) -> u64 {
        lock(&self.shared.metrics).submitted - self.received.load(Ordering::SeqCst)
    }

    fn note(&self, scored: ScoredSample) -> ScoredSample {
        self.received.fetch_add(1, Ordering::SeqCst);
        scored
    }

    /// The next result, blocking until one is ready. `None` once the pool is closed and every
    /// result has been received. (Do not call it with nothing outstanding on an open pool from
    /// the thread that submits: it would wait for a submission forever.)
    pub fn recv(&self) -> Option<ScoredSample> {
        if self.shared.closed.load(Ordering::SeqCst) && self.outstanding() == 0 {
            return None;
        }
        lock(&self.results).recv().ok().map(|scored| self.note(scored))
    }

    /// The next result if one is ready now.
    pub fn try_recv(&self) -> Option<ScoredSample> {
        lock(&self.results)
            .try_recv()
            .ok()
            .map(|scored| self.note(scored))
    }

    /// The next result, waiting at most `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Option<ScoredSample> {
        match lock(&self.results).recv_timeout(timeout) {
            Ok(scored) => Some(self.note(scored)),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => None,
        }
    }

    /// Submits `samples`, closes the pool and returns every result, sorted by sample id.
    pub fn score_all(
        &self,
        samples: impl IntoIterator<Item = Sample>,
    ) -> Result<Vec<ScoredSample>, SubmitError> {
        for sample in samples {
            self.submit(sample)?;
        }
        self.close();
        let mut results: Vec<ScoredSample> = std::iter::from_fn(|| self.recv()).collect();
        results.sort_by_key(|scored| scored.id);
        Ok(results)
    }

    /// Counters so far.
    pub fn metrics(&self) -> PoolMetrics {
        lock(&self.shared.metrics).clone()
    }

    /// Samples queued but not yet started.
    pub fn queued(&self) -> usize {
        lock(&self.shared.queue).len()
    }

    /// Worker threads currently serving the pool (abandoned ones not counted).
    pub fn live_workers(&self) -> usize {
        self.shared.live_workers.load(Ordering::SeqCst)
    }
}

impl Drop for RewardPool {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::{FnScorer, Scorer};

    fn sample(id: u64, response: &str) -> Sample {
        Sample {
            id,
            data_source: "test".into(),
            prompt: serde_json::Value::Null,
            response: response.into(),
            ground_truth: String::new(),
            extra: serde_json::Value::Null,
            response_length: 1,
            truncated: false,
        }
    }

    fn pool_with(scorer: impl Scorer + 'static, options: PoolOptions) -> RewardPool {
        let reward = RewardFunction::new().with_default(Arc::new(scorer));
        RewardPool::new(Arc::new(reward), options)
    }

    #[test]
    fn panics_hangs_and_garbage_score_zero_and_the_pool_continues() {
        let scorer = FnScorer::new("moody", |sample: &Sample| match sample.response.as_str() {
            "panic" => panic!("scorer bug on purpose"),
            "hang" => {
                std::thread::sleep(Duration::from_millis(4000));
                Ok(Score::new(5.0))
            }
            "nan" => Ok(Score::new(f64::NAN)),
            text => Ok(Score::new(text.len() as f64).with_extra("len", text.len() as f64)),
        });
        let options = PoolOptions {
            num_workers: 2,
            time_limit: Duration::from_millis(1000),
            log_first_errors: 2,
        };
        let pool = pool_with(scorer, options);
        let responses = ["a", "panic", "bb", "hang", "nan", "ccc", "hang", "dddd"];
        let started = Instant::now();
        let samples = responses
            .iter()
            .enumerate()
            .map(|(id, text)| sample(id as u64, text));
        let results = pool.score_all(samples).unwrap();
        assert!(
            started.elapsed() < Duration::from_millis(3500),
            "hung samples held the pool: {:?}",
            started.elapsed()
        );
        let scores: Vec<f64> = results.iter().map(|r| r.score).collect();
        assert_eq!(scores, [1.0, 0.0, 2.0, 0.0, 0.0, 3.0, 0.0, 4.0]);
        assert_eq!(results[2].extras["len"], 2.0);
        let panicked = results[1].error.as_deref().unwrap();
        assert!(
            panicked.contains("scorer `moody` panicked on sample 1: scorer bug on purpose"),
            "{panicked}"
        );
        assert!(results[3]
            .error
            .as_deref()
            .unwrap()
            .contains("did not finish sample 3 within 1s"));
        assert!(results[4]
            .error
            .as_deref()
            .unwrap()
            .contains("non-finite score NaN"));
        let metrics = pool.metrics();
        assert_eq!(
            (
                metrics.submitted,
                metrics.completed,
                metrics.errors,
                metrics.workers_abandoned
            ),
            (8, 8, 4, 2)
        );
        let kinds: Vec<(&str, u64)> = metrics
            .errors_by_kind
            .iter()
            .map(|(k, v)| (k.as_str(), *v))
            .collect();
        assert_eq!(kinds, [("non_finite", 1), ("panic", 1), ("timeout", 2)]);
        assert!(pool.recv().is_none());
        assert_eq!(
            pool.submit(sample(9, "x")),
            Err(SubmitError::Closed { sample_id: 9 })
        );
    }

    #[test]
    fn results_stream_while_samples_are_still_arriving() {
        let pool = pool_with(
            FnScorer::new("len", |s: &Sample| Ok(Score::new(s.response.len() as f64))),
            PoolOptions {
                num_workers: 3,
                ..PoolOptions::default()
            },
        );
        let mut seen = Vec::new();
        for id in 0..20_u64 {
            pool.submit(sample(id, &"x".repeat(id as usize))).unwrap();
            if id % 5 == 4 {
                while seen.len() < id as usize + 1 {
                    seen.push(
                        pool.recv_timeout(Duration::from_secs(5))
                            .expect("result within 5 s"),
                    );
                }
            }
        }
        assert_eq!(pool.live_workers(), 3);
        pool.close();
        assert!(pool.recv().is_none());
        seen.sort_by_key(|s| s.id);
        assert!(seen.iter().all(|s| s.score == s.id as f64 && s.error.is_none()));
        assert_eq!(pool.metrics().completed, 20);
        assert_eq!(pool.queued(), 0);
    }

    #[test]
    fn unknown_data_source_is_a_counted_error() {
        let pool = RewardPool::new(Arc::new(RewardFunction::new()), PoolOptions::default());
        let results = pool.score_all([sample(0, "x")]).unwrap();
        assert_eq!(results[0].score, 0.0);
        assert!(results[0]
            .error
            .as_deref()
            .unwrap()
            .contains("no scorer for data_source `test`"));
        assert_eq!(pool.metrics().errors_by_kind["no_scorer"], 1);
    }
}
