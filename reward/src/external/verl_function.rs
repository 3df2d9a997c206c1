//! VeRL's `custom_reward_function`: the user's Python reward file, unchanged, in a pool of
//! Python processes (`verl_function.py`, run by `$GRPO_PYTHON`, else `python3`) that call it
//! with VeRL's signature and speak the JSON-lines protocol of [`super::command`], so each
//! process has its time limit, crash restart and error counting. Each request goes to the
//! process with the fewest requests in hand, so a process that hangs holds up only its own
//! request until it is killed and replaced, and one that crashes fails only its own (a `naive`
//! process takes one request at a time; a `batch` one takes every request waiting, and shares
//! its fate with them).

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

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
    /// The processes, each with the number of requests it has in hand.
    members: Vec<(CommandScorer, AtomicUsize)>,
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
        let in_flight = match manager {
            RewardManager::Naive => 1,
            RewardManager::Batch => 256,
        };
        let members = (0..workers.max(1))
            .map(|_| {
                let process = CommandScorer::new(name, command.clone(), timeout, in_flight)
                    .with_key("reward.custom_reward_function (the Python is $GRPO_PYTHON, else python3)");
                (process, AtomicUsize::new(0))
            })
            .collect();
        Self {
            name: name.to_string(),
            members,
        }
    }
}

impl Scorer for VerlFunctionScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let (process, load) = self
            .members
            .iter()
            .min_by_key(|(_, load)| load.load(Ordering::Relaxed))
            .expect("at least one process");
        load.fetch_add(1, Ordering::Relaxed);
        let result = process.score(sample);
        load.fetch_sub(1, Ordering::Relaxed);
        result
    }
}
