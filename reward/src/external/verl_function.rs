//! VeRL's `custom_reward_function`: the user's Python reward file, unchanged, in a pool of
//! Python processes (`verl_function.py`, run by `$GRPO_PYTHON`, else `python3`) that call it
//! with VeRL's signature and speak the JSON-lines protocol of [`super::command`], so each
//! process has its time limit, crash restart and error counting. A `naive` process takes one
//! request at a time: a request goes to a free process (waiting, within the time limit, while
//! none is), so a process that hangs holds up only its own request until it is killed and
//! replaced, and one that crashes fails only its own. A `batch` process takes every request
//! waiting and shares its fate with them; requests go to the least busy one.

use std::process::Command;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::command::CommandScorer;
use crate::scorer::{Sample, Score, ScoreError, Scorer};

const RUNNER: &str = include_str!("verl_function.py");

/// How VeRL's reward manager calls the function (`reward_model.reward_manager` in VeRL).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardManager {
    /// One call per response: `compute_score(data_source=, solution_str=, ground_truth=,
    /// extra_info=, **reward_kwargs)`.
    #[default]
    Naive,
    /// Lists of the responses waiting: `compute_score(data_sources=, solution_strs=,
    /// ground_truths=, extra_infos=, **reward_kwargs)` returning one result each.
    Batch,
}

impl RewardManager {
    fn name(self) -> &'static str {
        match self {
            RewardManager::Naive => "naive",
            RewardManager::Batch => "batch",
        }
    }
}

/// The Python that runs reward functions: `$GRPO_PYTHON`, else `python3` (the active virtual
/// environment's when one is active).
pub fn python() -> String {
    std::env::var("GRPO_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// A VeRL reward function served by `workers` Python processes.
pub struct VerlFunctionScorer {
    name: String,
    processes: Vec<CommandScorer>,
    /// Requests each process has in hand, at most `per_process`; `freed` wakes a waiting one.
    loads: Mutex<Vec<usize>>,
    freed: Condvar,
    per_process: usize,
    timeout: Duration,
}

impl VerlFunctionScorer {
    /// The command line of one process.
    fn command(
        path: &str,
        function: &str,
        kwargs: &serde_json::Value,
        manager: RewardManager,
    ) -> Vec<String> {
        vec![
            python(),
            "-u".into(),
            "-c".into(),
            RUNNER.into(),
            path.into(),
            function.into(),
            kwargs.to_string(),
            manager.name().into(),
        ]
    }

    /// Loads the function once, in a Python process that then exits, and says what went wrong
    /// (a missing file, an import error with its traceback, no such function) or nothing.
    pub fn check(path: &str, function: &str, manager: RewardManager) -> Result<(), String> {
        let command = Self::command(path, function, &serde_json::json!({}), manager);
        let out = Command::new(&command[0])
            .args(&command[1..])
            .arg("--check")
            .output()
            .map_err(|e| {
                format!(
                    "cannot start {} (set GRPO_PYTHON to the Python your reward file needs): {e}",
                    command[0]
                )
            })?;
        if out.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.trim().lines().last().unwrap_or("").to_string();
        Err(format!(
            "{last} (loading `{function}` from {path} with {})",
            command[0]
        ))
    }

    /// `workers` processes of `function` from `path`, each request limited to `timeout`.
    pub fn new(
        name: &str,
        path: &str,
        function: &str,
        kwargs: &serde_json::Value,
        manager: RewardManager,
        workers: usize,
        timeout: Duration,
    ) -> Self {
        let command = Self::command(path, function, kwargs, manager);
        let per_process = match manager {
            RewardManager::Naive => 1,
            RewardManager::Batch => 256,
        };
        let workers = workers.max(1);
        let processes = (0..workers)
            .map(|_| {
                CommandScorer::with_key(
                    name,
                    "reward.custom_reward_function (the Python is $GRPO_PYTHON, else python3)",
                    command.clone(),
                    timeout,
                    per_process,
                )
            })
            .collect();
        Self {
            name: name.to_string(),
            processes,
            loads: Mutex::new(vec![0; workers]),
            freed: Condvar::new(),
            per_process,
            timeout,
        }
    }

    /// The least busy process with room for a request, waiting until `deadline` for one.
    fn acquire(&self, deadline: Instant) -> Option<usize> {
        let mut loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let free = (0..loads.len())
                .filter(|&i| loads[i] < self.per_process)
                .min_by_key(|&i| loads[i]);
            if let Some(i) = free {
                loads[i] += 1;
                return Some(i);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            loads = self
                .freed
                .wait_timeout(loads, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn release(&self, process: usize) {
        self.loads.lock().unwrap_or_else(|p| p.into_inner())[process] -= 1;
        self.freed.notify_one();
    }
}

impl Scorer for VerlFunctionScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let process = self
            .acquire(Instant::now() + self.timeout)
            .ok_or_else(|| ScoreError::TimedOut {
                scorer: self.name.clone(),
                sample_id: sample.id,
                limit: self.timeout,
            })?;
        // Released however the call ends.
        struct Held<'a>(&'a VerlFunctionScorer, usize);
        impl Drop for Held<'_> {
            fn drop(&mut self) {
                self.0.release(self.1);
            }
        }
        let _held = Held(self, process);
        self.processes[process].score(sample)
    }
}
