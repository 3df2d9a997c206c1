//! Experiment tracking: a run's metrics, step by step, to the trackers its users watch.
//!
//! `trainer.logger` lists them by VeRL's names ([`Logger`]). `console` (the progress lines) and
//! `file` (`OUTPUT/metrics.jsonl`) belong to the run itself; this crate holds the others:
//!
//! - [`tensorboard`]: event files written here, read by TensorBoard as its own;
//! - [`mlflow`]: an MLflow tracking server through its REST API;
//! - [`wandb`]: the user's installed `wandb` package in a child Python process, so its
//!   settings, offline mode and `wandb sync` work as they do for a Python trainer.
//!
//! A [`Tracker`] runs them on a thread of its own: logging a step never waits for a server. A
//! tracker that fails (server down, package missing) warns once and the run goes on; the
//! steps it could not log are counted and reported at the end.

pub mod mlflow;
pub mod tensorboard;
pub mod wandb;

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

/// One step's metrics, by name.
pub type Metrics = BTreeMap<String, f64>;

/// A name in `trainer.logger` (VeRL's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Logger {
    /// A line per step on stderr (the progress display).
    Console,
    /// `OUTPUT/metrics.jsonl`, one JSON object per step.
    File,
    /// TensorBoard event files (`$TENSORBOARD_DIR`, else `OUTPUT/tensorboard`).
    Tensorboard,
    /// An MLflow tracking server (`$MLFLOW_TRACKING_URI`, http or https).
    Mlflow,
    /// Weights & Biases through the `wandb` package of `$GRPO_PYTHON` (else `python3`).
    Wandb,
}

impl Logger {
    /// The trackers this crate runs (not `console` and `file`, which the run writes itself).
    pub fn is_tracker(self) -> bool {
        matches!(self, Logger::Tensorboard | Logger::Mlflow | Logger::Wandb)
    }

    pub fn name(self) -> &'static str {
        match self {
            Logger::Console => "console",
            Logger::File => "file",
            Logger::Tensorboard => "tensorboard",
            Logger::Mlflow => "mlflow",
            Logger::Wandb => "wandb",
        }
    }
}

/// What the trackers of a run need to know.
#[derive(Clone, Debug)]
pub struct TrackingConfig {
    /// `trainer.logger`; only the trackers among them are started.
    pub loggers: Vec<Logger>,
    /// `trainer.project_name`: MLflow's experiment, wandb's project.
    pub project: String,
    /// `trainer.experiment_name`: the run's name in every tracker.
    pub experiment: String,
    /// The run's output directory: default TensorBoard directory, wandb's directory, and
    /// `tracking.json` (the trackers' run ids, so a resumed run continues the same runs).
    pub output: PathBuf,
    /// Whether this start resumes a run from its checkpoint at `start_step`.
    pub resume: bool,
    /// The step the run starts after (0 for a fresh run).
    pub start_step: u64,
    /// The run's configuration (the recipe), logged as parameters (MLflow, flattened with `/`)
    /// and as wandb's config.
    pub params: serde_json::Value,
    /// The process environment the trackers read (`TENSORBOARD_DIR`, `MLFLOW_TRACKING_URI`,
    /// `MLFLOW_RUN_ID`, `MLFLOW_TRACKING_TOKEN`, `MLFLOW_TRACKING_USERNAME`/`PASSWORD`,
    /// `GRPO_PYTHON`, `WANDB_*` for the child).
    pub env: BTreeMap<String, String>,
}

impl TrackingConfig {
    fn var(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str).filter(|v| !v.is_empty())
    }

    /// What is wrong with the trackers' settings before anything starts (an MLflow URI that is
    /// not http(s)), as an error that says what to set.
    pub fn check(&self) -> Result<(), String> {
        if self.loggers.contains(&Logger::Mlflow) {
            mlflow::tracking_uri(self)?;
        }
        Ok(())
    }
}

/// One validation response shown in the trackers (`trainer.log_val_generations`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Generation {
    pub input: String,
    pub output: String,
    pub score: f64,
}

/// A tracker's side of logging.
pub trait Sink: Send {
    fn logger(&self) -> Logger;
    /// Logs one step's metrics.
    fn log(&mut self, step: u64, metrics: &Metrics) -> Result<(), String>;
    /// Logs validation generations at `step`, as VeRL's `ValidationGenerationsLogger` shows
    /// them in this tracker.
    fn log_generations(&mut self, step: u64, generations: &[Generation]) -> Result<(), String>;
    /// Ends the tracker's run (`ok`: the run succeeded).
    fn finish(&mut self, ok: bool) -> Result<(), String>;
}

enum Message {
    Log(u64, Metrics),
    Generations(u64, Vec<Generation>),
    Finish(bool),
}

/// What the trackers did, for the run's last words.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrackingReport {
    /// Per tracker: steps logged and steps lost (with the last error).
    pub trackers: Vec<(Logger, u64, u64, Option<String>)>,
    /// The trackers that could not start, and why.
    pub not_started: Vec<(Logger, String)>,
}

impl TrackingReport {
    /// One line per tracker that did not start or lost steps.
    pub fn problems(&self) -> Vec<String> {
        let not_started = self
            .not_started
            .iter()
            .map(|(logger, error)| format!("{}: not started ({error})", logger.name()));
        let lost =
            self.trackers
                .iter()
                .filter(|(_, _, lost, _)| *lost > 0)
                .map(|(logger, logged, lost, error)| {
                    format!(
                        "{}: {lost} of {} steps not logged (last error: {})",
                        logger.name(),
                        logged + lost,
                        error.as_deref().unwrap_or("unknown")
                    )
                });
        not_started.chain(lost).collect()
    }
}

/// The trackers of a run, on their own thread.
pub struct Tracker {
    sender: Option<mpsc::Sender<Message>>,
    thread: Option<std::thread::JoinHandle<TrackingReport>>,
}

impl Tracker {
    /// Starts the trackers `config.loggers` names. Never fails: a tracker that cannot start
    /// warns (once) and is left out.
    pub fn start(config: TrackingConfig) -> Tracker {
        if !config.loggers.iter().any(|l| l.is_tracker()) {
            return Tracker {
                sender: None,
                thread: None,
            };
        }
        let (sender, receiver) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tracking".into())
            .spawn(move || serve(config, receiver))
            .expect("spawning the tracking thread");
        Tracker {
            sender: Some(sender),
            thread: Some(thread),
        }
    }

    /// Queues a step's metrics for every tracker.
    pub fn log(&self, step: u64, metrics: &Metrics) {
        if let Some(sender) = &self.sender {
            let _ = sender.send(Message::Log(step, metrics.clone()));
        }
    }

    /// Queues validation generations for every tracker.
    pub fn log_generations(&self, step: u64, generations: Vec<Generation>) {
        if let Some(sender) = &self.sender {
            let _ = sender.send(Message::Generations(step, generations));
        }
    }

    /// Flushes and ends every tracker's run, waiting at most `within` for them.
    pub fn finish(mut self, ok: bool, within: Duration) -> TrackingReport {
        let (Some(sender), Some(thread)) = (self.sender.take(), self.thread.take()) else {
            return TrackingReport::default();
        };
        let _ = sender.send(Message::Finish(ok));
        drop(sender);
        let deadline = std::time::Instant::now() + within;
        while !thread.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if thread.is_finished() {
            thread.join().unwrap_or_default()
        } else {
            tracing::warn!("the trackers did not finish within {within:?}; their last steps may be missing");
            TrackingReport::default()
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        // A run that ends by an error: its trackers' runs end as failed.
        if let Some(sender) = self.sender.take() {
            let _ = sender.send(Message::Finish(false));
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct Slot {
    sink: Box<dyn Sink>,
    logged: u64,
    lost: u64,
    last_error: Option<String>,
}

impl Slot {
    fn record(&mut self, result: Result<(), String>) {
        match result {
            Ok(()) => self.logged += 1,
            Err(error) => {
                if self.last_error.is_none() {
                    tracing::warn!(
                        "{} logger: {error}; the run goes on, and steps it cannot log are counted",
                        self.sink.logger().name()
                    );
                }
                self.lost += 1;
                self.last_error = Some(error);
            }
        }
    }
}

fn serve(config: TrackingConfig, receiver: mpsc::Receiver<Message>) -> TrackingReport {
    let mut ids = RunIds::read(&config.output);
    let mut slots: Vec<Slot> = Vec::new();
    let mut report = TrackingReport::default();
    for logger in config.loggers.iter().copied().filter(|l| l.is_tracker()) {
        let started: Result<Box<dyn Sink>, String> = match logger {
            Logger::Tensorboard => tensorboard::TensorBoard::start(&config).map(|s| Box::new(s) as _),
            Logger::Mlflow => mlflow::Mlflow::start(&config, &mut ids).map(|s| Box::new(s) as _),
            Logger::Wandb => wandb::Wandb::start(&config, &mut ids).map(|s| Box::new(s) as _),
            Logger::Console | Logger::File => unreachable!("not a tracker"),
        };
        match started {
            Ok(sink) => slots.push(Slot {
                sink,
                logged: 0,
                lost: 0,
                last_error: None,
            }),
            Err(error) => {
                tracing::warn!(
                    "{} logger not started: {error}; the run goes on without it",
                    logger.name()
                );
                report.not_started.push((logger, error));
            }
        }
    }
    if let Err(error) = ids.write(&config.output) {
        tracing::warn!("cannot record the trackers' run ids: {error}; a resume starts new tracker runs");
    }
    let mut ok = false;
    for message in receiver {
        match message {
            Message::Log(step, metrics) => {
                for slot in &mut slots {
                    let result = slot.sink.log(step, &metrics);
                    slot.record(result);
                }
            }
            Message::Generations(step, generations) => {
                for slot in &mut slots {
                    if let Err(error) = slot.sink.log_generations(step, &generations) {
                        tracing::warn!(
                            "{} logger: validation generations: {error}",
                            slot.sink.logger().name()
                        );
                    }
                }
            }
            Message::Finish(success) => {
                ok = success;
                break;
            }
        }
    }
    for mut slot in slots {
        if let Err(error) = slot.sink.finish(ok) {
            tracing::warn!("{} logger: {error}", slot.sink.logger().name());
        }
        report
            .trackers
            .push((slot.sink.logger(), slot.logged, slot.lost, slot.last_error));
    }
    report
}

/// `OUTPUT/tracking.json`: the trackers' own run ids, so a resumed run logs into the same
/// MLflow run and the same wandb run.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RunIds {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlflow_run_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wandb_run_id: Option<String>,
}

impl RunIds {
    pub const FILE: &'static str = "tracking.json";

    fn read(output: &Path) -> RunIds {
        std::fs::read_to_string(output.join(Self::FILE))
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok())
            .unwrap_or_default()
    }

    fn write(&self, output: &Path) -> std::io::Result<()> {
        if *self == RunIds::default() {
            return Ok(());
        }
        let path = output.join(Self::FILE);
        let tmp = output.join(format!("{}.tmp", Self::FILE));
        std::fs::write(&tmp, serde_json::to_string_pretty(self).expect("serialisable"))?;
        std::fs::rename(tmp, path)
    }
}

/// `value` flattened to `a/b/c` keys with string values (MLflow's params; lists are indexed:
/// `logger/0`), as VeRL flattens its config for MLflow.
pub fn flatten(value: &serde_json::Value) -> Vec<(String, String)> {
    fn walk(prefix: &str, value: &serde_json::Value, out: &mut Vec<(String, String)>) {
        let key = |k: &str| {
            if prefix.is_empty() {
                k.to_string()
            } else {
                format!("{prefix}/{k}")
            }
        };
        match value {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    walk(&key(k), v, out);
                }
            }
            serde_json::Value::Array(items) => {
                out.push((key("list_len"), items.len().to_string()));
                for (i, v) in items.iter().enumerate() {
                    walk(&key(&i.to_string()), v, out);
                }
            }
            serde_json::Value::String(s) => out.push((prefix.to_string(), s.clone())),
            serde_json::Value::Null => out.push((prefix.to_string(), "None".into())),
            other => out.push((prefix.to_string(), other.to_string())),
        }
    }
    let mut out = Vec::new();
    walk("", value, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_flatten_as_verl_logs_them_to_mlflow() {
        let value = serde_json::json!({
            "trainer": {"logger": ["console", "mlflow"], "total_epochs": 2, "seed": null},
            "actor": {"optim": {"lr": 1e-6}},
        });
        let flat: BTreeMap<String, String> = flatten(&value).into_iter().collect();
        assert_eq!(flat["trainer/logger/list_len"], "2");
        assert_eq!(flat["trainer/logger/1"], "mlflow");
        assert_eq!(flat["trainer/total_epochs"], "2");
        assert_eq!(flat["trainer/seed"], "None");
        assert_eq!(flat["actor/optim/lr"], "1e-6");
    }

    #[test]
    fn run_ids_survive_a_restart_and_an_empty_set_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        RunIds::default().write(dir.path()).unwrap();
        assert!(!dir.path().join(RunIds::FILE).exists());
        let ids = RunIds {
            mlflow_run_id: Some("abc".into()),
            wandb_run_id: None,
        };
        ids.write(dir.path()).unwrap();
        assert_eq!(RunIds::read(dir.path()), ids);
    }

    #[test]
    fn lost_steps_are_reported_with_the_last_error() {
        let report = TrackingReport {
            trackers: vec![
                (Logger::Tensorboard, 5, 0, None),
                (Logger::Mlflow, 3, 2, Some("connection refused".into())),
            ],
            not_started: vec![(Logger::Wandb, "cannot import wandb".into())],
        };
        assert_eq!(
            report.problems(),
            vec![
                "wandb: not started (cannot import wandb)".to_string(),
                "mlflow: 2 of 5 steps not logged (last error: connection refused)".to_string()
            ]
        );
    }
}
