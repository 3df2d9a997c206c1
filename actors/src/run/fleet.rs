//! The workers of a run and how a step's work is spread over them: requests go to the live
//! rollout workers, each sample goes to a reward worker the moment it arrives, and the work of
//! a worker that fails is re-issued to the others. Samples are keyed by (request id, sample
//! index), so a re-issued request cannot produce a duplicate and a lost one is noticed.

use crate::roles::reward::RewardRole;
use crate::roles::rollout::{RolloutRole, WeightUpdate};
use crate::roles::Role;
use crate::roles::RoleError;
use rollout::{GenerationRequest, Sample};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::task::JoinSet;

/// What the reward function needs to know about a prompt besides the response.
#[derive(Clone, Debug)]
pub struct PromptMeta {
    pub data_source: String,
    /// The row's prompt: chat messages `[{role, content}]` or a string (for reward models).
    pub prompt: serde_json::Value,
    pub ground_truth: String,
    pub extra: serde_json::Value,
}

/// A sample and its score.
#[derive(Clone, Debug)]
pub struct Scored {
    pub sample: Sample,
    pub score: reward::ScoredSample,
    /// The row's `reward_model.ground_truth` (for `trainer.rollout_data_dir`).
    pub ground_truth: String,
}

/// A step's generation and scoring, with what it cost.
pub struct Outcome {
    /// In (request id, sample index) order.
    pub scored: Vec<Scored>,
    pub gen_s: f64,
    pub reward_tail_s: f64,
    pub rollout_failures: usize,
    pub reward_failures: usize,
    pub reissued: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Health {
    Alive,
    /// Failed; its work goes to the others.
    Dead,
    /// Failed, and a replacement is starting.
    Replacing,
}

struct Slot<T: ?Sized> {
    role: Arc<T>,
    health: Health,
}

/// The workers of one role, each with its health.
struct Slots<T: ?Sized>(Mutex<Vec<Slot<T>>>);

impl<T: ?Sized> Slots<T> {
    fn new(roles: Vec<Arc<T>>) -> Slots<T> {
        let slots = roles
            .into_iter()
            .map(|role| Slot {
                role,
                health: Health::Alive,
            })
            .collect();
        Slots(Mutex::new(slots))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Slot<T>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live workers with their slot index.
    fn live(&self) -> Vec<(usize, Arc<T>)> {
        self.lock()
            .iter()
            .enumerate()
            .filter(|(_, s)| s.health == Health::Alive)
            .map(|(i, s)| (i, s.role.clone()))
            .collect()
    }

    /// Moves slot `index` from `from` to `to`; whether it was in `from`.
    fn transition(&self, index: usize, from: Health, to: Health) -> bool {
        match self.lock().get_mut(index) {
            Some(s) if s.health == from => {
                s.health = to;
                true
            }
            _ => false,
        }
    }

    /// Moves every slot in `from` to `to` and returns their indices.
    fn transition_all(&self, from: Health, to: Health) -> Vec<usize> {
        let mut moved = Vec::new();
        for (i, s) in self.lock().iter_mut().enumerate() {
            if s.health == from {
                s.health = to;
                moved.push(i);
            }
        }
        moved
    }

    /// Puts a live `role` in slot `index`.
    fn replace(&self, index: usize, role: Arc<T>) {
        self.lock()[index] = Slot {
            role,
            health: Health::Alive,
        };
    }
}

/// The rollout and reward workers of a run.
pub struct Fleet {
    rollouts: Slots<dyn RolloutRole>,
    rewards: Slots<dyn RewardRole>,
    next_reward_id: AtomicU64,
    latest: Mutex<Option<WeightUpdate>>,
    /// How long work may wait for a live worker of its role.
    wait_for_workers: std::time::Duration,
    /// Replacement workers put in so far.
    replaced: AtomicU64,
    /// Workers found dead so far.
    failures: AtomicU64,
    /// Samples per second of each rollout slot's worker, smoothed over its recent generations.
    throughput: Mutex<HashMap<usize, f64>>,
}

type Key = (u64, usize);

/// Samples waiting to be scored: (reward id, sample key) pairs and the reward inputs.
type ScoreBatch = (Vec<(u64, Key)>, Vec<reward::Sample>);

fn key(s: &Sample) -> Key {
    (s.request_id, s.sample_index)
}

impl Fleet {
    /// The workers; work waits at most `wait_for_workers` for a live worker of its role.
    pub fn new(
        rollouts: Vec<Arc<dyn RolloutRole>>,
        rewards: Vec<Arc<dyn RewardRole>>,
        wait_for_workers: std::time::Duration,
    ) -> Fleet {
        Fleet {
            rollouts: Slots::new(rollouts),
            rewards: Slots::new(rewards),
            next_reward_id: AtomicU64::new(0),
            latest: Mutex::new(None),
            wait_for_workers,
            replaced: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            throughput: Mutex::new(HashMap::new()),
        }
    }

    fn live_rollouts(&self) -> Vec<(usize, Arc<dyn RolloutRole>)> {
        self.rollouts.live()
    }

    fn live_rewards(&self) -> Vec<(usize, Arc<dyn RewardRole>)> {
        self.rewards.live()
    }

    /// Marks a rollout worker dead (its work goes elsewhere until it is replaced).
    pub fn rollout_failed(&self, index: usize) {
        if self.rollouts.transition(index, Health::Alive, Health::Dead) {
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Marks a reward worker dead.
    pub fn reward_failed(&self, index: usize) {
        if self.rewards.transition(index, Health::Alive, Health::Dead) {
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Dead workers not yet being replaced, as (role, index); they are marked as being
    /// replaced, so each failure starts one replacement.
    pub fn take_dead(&self) -> Vec<(Role, usize)> {
        let rollouts = self.rollouts.transition_all(Health::Dead, Health::Replacing);
        let rewards = self.rewards.transition_all(Health::Dead, Health::Replacing);
        let tag = |role: Role| move |i: usize| (role, i);
        rollouts
            .into_iter()
            .map(tag(Role::Rollout))
            .chain(rewards.into_iter().map(tag(Role::Reward)))
            .collect()
    }

    /// Gives a slot whose replacement failed back to [`Fleet::take_dead`].
    pub fn replacement_failed(&self, role: Role, index: usize) {
        match role {
            Role::Rollout => self.rollouts.transition(index, Health::Replacing, Health::Dead),
            Role::Reward => self.rewards.transition(index, Health::Replacing, Health::Dead),
            Role::Learner => false, // not in the fleet
        };
    }

    /// Puts a replacement rollout worker in slot `index`, bringing it to the latest weights
    /// first.
    pub async fn replace_rollout(&self, index: usize, role: Arc<dyn RolloutRole>) -> Result<(), RoleError> {
        // A new worker (maybe on another node) is measured afresh.
        self.throughput
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&index);
        let version = |u: &Option<WeightUpdate>| u.as_ref().map(|u| u.version);
        let mut sent = None;
        loop {
            let latest = self.latest.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if version(&latest) != sent {
                sent = version(&latest);
                if let Some(update) = latest {
                    role.update_weights(update).await?;
                }
            }
            // An update published while this one streamed went only to the live workers:
            // send that too. `update_weights` publishes and lists the live workers under this
            // lock, so once the worker is live under it, it gets every later update.
            let latest = self.latest.lock().unwrap_or_else(|e| e.into_inner());
            if version(&latest) == sent {
                self.rollouts.replace(index, role);
                break;
            }
        }
        self.replaced.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Samples per second of each rollout slot measured so far (slots not yet measured absent).
    pub fn rollout_throughput(&self) -> HashMap<usize, f64> {
        self.throughput.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Folds one finished generation of `samples` in `took` into slot `index`'s throughput
    /// (an exponential average, half weight on the newest).
    fn record_throughput(&self, index: usize, samples: usize, took: std::time::Duration) {
        let rate = samples as f64 / took.as_secs_f64().max(1e-6);
        let mut throughput = self.throughput.lock().unwrap_or_else(|e| e.into_inner());
        let smoothed = throughput.get(&index).map_or(rate, |old| 0.5 * old + 0.5 * rate);
        throughput.insert(index, smoothed);
    }

    /// The share weights of `live` rollout workers: their measured throughput; a worker not yet
    /// measured counts as the mean of those that are (all equal when none is).
    fn share_weights(&self, live: &[(usize, Arc<dyn RolloutRole>)]) -> Vec<f64> {
        let throughput = self.throughput.lock().unwrap_or_else(|e| e.into_inner());
        let known: Vec<f64> = live
            .iter()
            .filter_map(|(i, _)| throughput.get(i).copied())
            .collect();
        let default = if known.is_empty() {
            1.0
        } else {
            known.iter().sum::<f64>() / known.len() as f64
        };
        live.iter()
            .map(|(i, _)| throughput.get(i).copied().unwrap_or(default))
            .collect()
    }

    /// Puts a replacement reward worker in slot `index`.
    pub fn replace_reward(&self, index: usize, role: Arc<dyn RewardRole>) {
        self.replaced.fetch_add(1, Ordering::Relaxed);
        self.rewards.replace(index, role);
    }

    /// Workers found dead so far.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Replacement workers put in so far.
    pub fn replaced(&self) -> u64 {
        self.replaced.load(Ordering::Relaxed)
    }

    /// Sends new weights to every live rollout worker (a failing worker is marked dead and
    /// will be brought up to date when it is replaced); returns the bytes of tensor data sent
    /// over the network, all workers together.
    pub async fn update_weights(&self, update: WeightUpdate) -> Result<u64, RoleError> {
        let live = {
            let mut latest = self.latest.lock().unwrap_or_else(|e| e.into_inner());
            *latest = Some(update.clone());
            self.live_rollouts()
        };
        let mut tasks = JoinSet::new();
        for (i, role) in live {
            let u = update.clone();
            tasks.spawn(async move { (i, role.update_weights(u).await) });
        }
        let mut sent = 0;
        while let Some(done) = tasks.join_next().await {
            let (i, result) = done.map_err(|e| RoleError::Invalid(format!("weight update task: {e}")))?;
            match result {
                Ok(bytes) => sent += bytes,
                Err(e @ RoleError::Unavailable { .. }) => {
                    tracing::warn!("{e}; the worker will be replaced");
                    self.rollout_failed(i);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(sent)
    }

    /// Generates every sample of `requests` and scores each as it arrives. Work of a worker
    /// that fails is re-issued to the live ones; while none is alive (a replacement is
    /// starting) the work waits, for at most `wait_for_workers`.
    pub async fn generate_and_score(
        &self,
        requests: Vec<GenerationRequest>,
        metas: HashMap<u64, PromptMeta>,
    ) -> Result<Outcome, RoleError> {
        let (tx, mut rx) = unbounded_channel::<Sample>();
        let mut round = Round::new(self, requests, metas);
        let mut gens: JoinSet<GenDone> = JoinSet::new();
        let mut scoring: JoinSet<ScoreDone> = JoinSet::new();
        let mut ticker = tokio::time::interval(std::time::Duration::from_millis(100));
        while !round.complete() {
            round.hand_out_generation(&mut gens, &tx);
            round.hand_out_scoring(&mut scoring);
            round.check_not_stalled()?;
            tokio::select! {
                Some(first) = rx.recv() => {
                    let mut batch = vec![first];
                    while let Ok(s) = rx.try_recv() {
                        batch.push(s);
                    }
                    round.received(batch);
                }
                Some(done) = gens.join_next(), if !gens.is_empty() => {
                    round.generation_ended(done.map_err(|e| RoleError::Invalid(format!("generation task: {e}")))?)?;
                }
                Some(done) = scoring.join_next(), if !scoring.is_empty() => {
                    round.scoring_ended(done.map_err(|e| RoleError::Invalid(format!("scoring task: {e}")))?)?;
                }
                _ = ticker.tick() => {}
            }
        }
        Ok(round.finish())
    }
}

/// A rollout worker's generation task ended: the worker, its request ids, and the samples it
/// made and how long that took.
type GenDone = (usize, Vec<u64>, Result<(usize, std::time::Duration), RoleError>);

/// A reward worker's scoring task ended: the worker, the batch it was given, its scores.
type ScoreDone = (
    usize,
    Vec<(u64, Key)>,
    Vec<reward::Sample>,
    Result<Vec<reward::ScoredSample>, RoleError>,
);

/// One [`Fleet::generate_and_score`]: the work waiting for a live worker, the samples and
/// scores back so far, and what failed.
struct Round<'a> {
    fleet: &'a Fleet,
    by_id: HashMap<u64, GenerationRequest>,
    metas: HashMap<u64, PromptMeta>,
    expected: usize,
    samples: BTreeMap<Key, Sample>,
    scores: HashMap<Key, reward::ScoredSample>,
    waiting_gen: Vec<GenerationRequest>,
    waiting_score: Vec<ScoreBatch>,
    stalled_since: Option<Instant>,
    next_reward: usize,
    started: Instant,
    gen_done_at: Option<Instant>,
    rollout_failures: usize,
    reward_failures: usize,
    reissued: usize,
}

impl<'a> Round<'a> {
    fn new(fleet: &'a Fleet, requests: Vec<GenerationRequest>, metas: HashMap<u64, PromptMeta>) -> Round<'a> {
        Round {
            fleet,
            by_id: requests.iter().map(|r| (r.id, r.clone())).collect(),
            metas,
            expected: requests.iter().map(|r| r.n).sum(),
            samples: BTreeMap::new(),
            scores: HashMap::new(),
            waiting_gen: requests,
            waiting_score: Vec::new(),
            stalled_since: None,
            next_reward: 0,
            started: Instant::now(),
            gen_done_at: None,
            rollout_failures: 0,
            reward_failures: 0,
            reissued: 0,
        }
    }

    /// Every sample arrived and was scored.
    fn complete(&self) -> bool {
        self.samples.len() >= self.expected && self.scores.len() >= self.expected
    }

    /// Hands the waiting requests to the live rollout workers, in contiguous shares (each
    /// worker prefills its own prompts) sized by their measured throughput.
    fn hand_out_generation(&mut self, gens: &mut JoinSet<GenDone>, tx: &UnboundedSender<Sample>) {
        if self.waiting_gen.is_empty() {
            return;
        }
        let live = self.fleet.live_rollouts();
        if live.is_empty() {
            return;
        }
        let mut reqs = std::mem::take(&mut self.waiting_gen).into_iter();
        let weights = self.fleet.share_weights(&live);
        for (count, (i, role)) in shares(reqs.len(), &weights).into_iter().zip(live) {
            let chunk: Vec<GenerationRequest> = reqs.by_ref().take(count).collect();
            if chunk.is_empty() {
                continue;
            }
            let ids = chunk.iter().map(|r| r.id).collect();
            let samples: usize = chunk.iter().map(|r| r.n).sum();
            let tx = tx.clone();
            gens.spawn(async move {
                let started = Instant::now();
                let result = role.generate(chunk, tx).await;
                (i, ids, result.map(|()| (samples, started.elapsed())))
            });
        }
    }

    /// Hands the waiting score batches to the live reward workers, in turn.
    fn hand_out_scoring(&mut self, scoring: &mut JoinSet<ScoreDone>) {
        if self.waiting_score.is_empty() {
            return;
        }
        let live = self.fleet.live_rewards();
        if live.is_empty() {
            return;
        }
        for (keys, batch) in std::mem::take(&mut self.waiting_score) {
            let (i, role) = live[self.next_reward % live.len()].clone();
            self.next_reward += 1;
            scoring.spawn(async move {
                let r = role.score(batch.clone()).await;
                (i, keys, batch, r)
            });
        }
    }

    /// Fails once work has waited longer than `wait_for_workers` for a live worker.
    fn check_not_stalled(&mut self) -> Result<(), RoleError> {
        if self.waiting_gen.is_empty() && self.waiting_score.is_empty() {
            self.stalled_since = None;
            return Ok(());
        }
        let since = *self.stalled_since.get_or_insert_with(Instant::now);
        if since.elapsed() <= self.fleet.wait_for_workers {
            return Ok(());
        }
        let role = if self.waiting_gen.is_empty() {
            "reward"
        } else {
            "rollout"
        };
        Err(RoleError::Invalid(format!(
            "no {role} worker has been alive for {:.0} s; see the worker logs",
            self.fleet.wait_for_workers.as_secs_f64()
        )))
    }

    /// Keeps the new samples of `batch` (a duplicate from a re-issued request, or a sample of
    /// no request of this round, is dropped) and queues them for scoring.
    fn received(&mut self, batch: Vec<Sample>) {
        let mut keys = Vec::new();
        let mut to_score = Vec::new();
        for s in batch {
            let k = key(&s);
            if self.samples.contains_key(&k) || !self.by_id.contains_key(&k.0) {
                continue;
            }
            let id = self.fleet.next_reward_id.fetch_add(1, Ordering::Relaxed);
            to_score.push(self.reward_sample(id, &s));
            keys.push((id, k));
            self.samples.insert(k, s);
        }
        if self.samples.len() == self.expected && self.gen_done_at.is_none() {
            self.gen_done_at = Some(Instant::now());
        }
        if !to_score.is_empty() {
            self.waiting_score.push((keys, to_score));
        }
    }

    /// What the reward function reads of sample `s` (reward id `id`): its prompt's row, and a
    /// multi-turn episode's turn scores as the row's `turn_scores` column.
    fn reward_sample(&self, id: u64, s: &Sample) -> reward::Sample {
        let meta = self.metas.get(&s.request_id).cloned().unwrap_or(PromptMeta {
            data_source: String::new(),
            prompt: serde_json::Value::Null,
            ground_truth: String::new(),
            extra: serde_json::Value::Null,
        });
        let mut extra = meta.extra;
        if !s.episode.turn_scores.is_empty() {
            if let serde_json::Value::Object(columns) = &mut extra {
                columns.insert("turn_scores".into(), serde_json::json!(s.episode.turn_scores));
            }
        }
        reward::Sample {
            id,
            data_source: meta.data_source,
            prompt: meta.prompt,
            response: s.text.clone(),
            ground_truth: meta.ground_truth,
            extra,
            response_length: s.response_ids.len(),
            truncated: s.finish_reason.is_truncated(),
        }
    }

    /// A generation task ended: its worker's throughput measured, or, when the worker is gone,
    /// its unfinished requests queued again. Samples it sent before failing may still be
    /// queued; re-issued copies of those are dropped as duplicates when they arrive.
    fn generation_ended(&mut self, (worker, ids, result): GenDone) -> Result<(), RoleError> {
        match result {
            Ok((count, took)) => self.fleet.record_throughput(worker, count, took),
            Err(e @ RoleError::Unavailable { .. }) => {
                tracing::warn!("{e}; re-issuing its unfinished requests");
                self.rollout_failures += 1;
                self.fleet.rollout_failed(worker);
                let again: Vec<GenerationRequest> = ids
                    .iter()
                    .filter(|id| (0..self.by_id[id].n).any(|j| !self.samples.contains_key(&(**id, j))))
                    .map(|id| self.by_id[id].clone())
                    .collect();
                self.reissued += again.len();
                self.waiting_gen.extend(again);
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// A scoring task ended: its scores kept, or, when the worker is gone, its batch queued
    /// again.
    fn scoring_ended(&mut self, (worker, keys, batch, result): ScoreDone) -> Result<(), RoleError> {
        match result {
            Ok(results) => {
                let by_reward_id: HashMap<u64, Key> = keys.into_iter().collect();
                for r in results {
                    if let Some(k) = by_reward_id.get(&r.id) {
                        self.scores.insert(*k, r);
                    }
                }
            }
            Err(e @ RoleError::Unavailable { .. }) => {
                tracing::warn!("{e}; re-scoring its samples elsewhere");
                self.reward_failures += 1;
                self.fleet.reward_failed(worker);
                self.waiting_score.push((keys, batch));
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// The scored samples in (request id, sample index) order, with the round's timings.
    fn finish(mut self) -> Outcome {
        let gen_end = self.gen_done_at.unwrap_or_else(Instant::now);
        let scored = std::mem::take(&mut self.samples)
            .into_iter()
            .map(|(k, sample)| Scored {
                score: self.scores.remove(&k).expect("every sample was scored"),
                ground_truth: self
                    .metas
                    .get(&k.0)
                    .map(|m| m.ground_truth.clone())
                    .unwrap_or_default(),
                sample,
            })
            .collect();
        Outcome {
            scored,
            gen_s: (gen_end - self.started).as_secs_f64(),
            reward_tail_s: gen_end.elapsed().as_secs_f64(),
            rollout_failures: self.rollout_failures,
            reward_failures: self.reward_failures,
            reissued: self.reissued,
        }
    }
}

/// Splits `total` requests over workers in proportion to `weights` (largest remainders get the
/// leftovers), giving every worker at least one while there are enough requests, so that each
/// keeps being measured.
fn shares(total: usize, weights: &[f64]) -> Vec<usize> {
    let n = weights.len();
    if n == 0 {
        return Vec::new();
    }
    let floor = usize::from(total >= n);
    let sum: f64 = weights.iter().map(|w| w.max(0.0)).sum();
    let rest = total - floor * n;
    let exact: Vec<f64> = weights
        .iter()
        .map(|w| {
            if sum > 0.0 {
                w.max(0.0) / sum * rest as f64
            } else {
                rest as f64 / n as f64
            }
        })
        .collect();
    let mut counts: Vec<usize> = exact.iter().map(|e| floor + e.floor() as usize).collect();
    let mut left = total - counts.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    for i in order.into_iter().cycle() {
        if left == 0 {
            break;
        }
        counts[i] += 1;
        left -= 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::roles::rollout::UpdateParams;
    use crate::roles::BoxFuture;

    /// A rollout worker that records the weight versions it installs; with `held`, its first
    /// install waits for `release` (a slow stream of weights).
    struct Installs {
        versions: Mutex<Vec<u64>>,
        held: Option<(tokio::sync::Notify, tokio::sync::Notify)>,
    }

    impl Installs {
        fn new(held: bool) -> Arc<Installs> {
            Arc::new(Installs {
                versions: Mutex::new(Vec::new()),
                held: held.then(|| (tokio::sync::Notify::new(), tokio::sync::Notify::new())),
            })
        }

        fn versions(&self) -> Vec<u64> {
            self.versions.lock().unwrap().clone()
        }
    }

    impl RolloutRole for Installs {
        fn generate(
            &self,
            _: Vec<GenerationRequest>,
            _: tokio::sync::mpsc::UnboundedSender<Sample>,
        ) -> BoxFuture<'_, Result<(), RoleError>> {
            Box::pin(async { Err(RoleError::Invalid("this test generates nothing".into())) })
        }

        fn update_weights(&self, update: WeightUpdate) -> BoxFuture<'_, Result<u64, RoleError>> {
            Box::pin(async move {
                if let (Some((started, release)), true) = (&self.held, self.versions().is_empty()) {
                    started.notify_one();
                    release.notified().await;
                }
                self.versions.lock().unwrap().push(update.version);
                Ok(0)
            })
        }

        fn weight_version(&self) -> u64 {
            self.versions().last().copied().unwrap_or(0)
        }

        fn location(&self) -> String {
            "test".into()
        }
    }

    fn update(version: u64) -> WeightUpdate {
        WeightUpdate {
            version,
            params: UpdateParams::Host(Vec::new().into()),
        }
    }

    /// A replacement that is still receiving version 1 when version 2 is published must get
    /// version 2 before it generates: otherwise it samples a step with the old weights.
    #[test]
    fn a_replacement_gets_the_update_published_while_it_was_being_brought_up_to_date() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (live, dead) = (Installs::new(false), Installs::new(false));
            let fleet = Arc::new(Fleet::new(
                vec![live.clone(), dead],
                Vec::new(),
                std::time::Duration::from_secs(1),
            ));
            fleet.update_weights(update(1)).await.unwrap();
            fleet.rollout_failed(1);
            assert_eq!(fleet.take_dead(), vec![(Role::Rollout, 1)]);
            let replacement = Installs::new(true);
            let replacing = tokio::spawn({
                let (fleet, replacement) = (fleet.clone(), replacement.clone());
                async move { fleet.replace_rollout(1, replacement).await }
            });
            let (started, release) = replacement.held.as_ref().unwrap();
            started.notified().await;
            fleet.update_weights(update(2)).await.unwrap();
            release.notify_one();
            replacing.await.unwrap().unwrap();
            assert_eq!(live.versions(), vec![1, 2]);
            assert_eq!(replacement.versions(), vec![1, 2]);
            assert_eq!(fleet.live_rollouts().len(), 2);
        });
    }

    #[test]
    fn requests_are_shared_in_proportion_to_throughput() {
        assert_eq!(shares(8, &[1.0, 1.0]), vec![4, 4]);
        assert_eq!(shares(7, &[1.0, 1.0]), vec![4, 3]);
        // A worker three times as fast gets three times the work (after one each).
        assert_eq!(shares(10, &[3.0, 1.0]), vec![7, 3]);
        assert_eq!(shares(16, &[30.0, 10.0]), vec![12, 4]);
        // Every worker keeps getting some work while there is enough to go round.
        assert_eq!(shares(3, &[100.0, 1.0, 1.0]), vec![1, 1, 1]);
        assert_eq!(shares(2, &[1.0, 5.0, 1.0]).iter().sum::<usize>(), 2);
        assert_eq!(shares(0, &[1.0, 1.0]), vec![0, 0]);
        assert_eq!(shares(5, &[0.0, 0.0]), vec![3, 2]);
        assert!(shares(5, &[]).is_empty());
        for total in 0..40 {
            assert_eq!(shares(total, &[2.5, 0.7, 1.1]).iter().sum::<usize>(), total);
        }
    }
}
