//! Weights & Biases through the user's own `wandb` package: a child Python process
//! (`$GRPO_PYTHON`, else `python3`, which is the active virtual environment's when one is
//! active) runs `wandb_child.py`, fed one JSON line per step. Everything wandb reads from the
//! environment (`WANDB_API_KEY`, `WANDB_MODE=offline`, `WANDB_ENTITY`, `WANDB_DIR`, ...)
//! works as it does for a Python trainer, and an offline run is synced with `wandb sync` as
//! usual. The run's files go to `OUTPUT/wandb` (unless `WANDB_DIR` says otherwise); a resumed
//! run continues the same wandb run (`OUTPUT/tracking.json`), and wandb drops the steps it
//! already has (it keeps steps increasing).
//!
//! wandb's own messages are off unless `WANDB_SILENT` is set otherwise; what the child prints
//! goes to stderr.

use crate::{Generation, Logger, Metrics, RunIds, Sink, TrackingConfig};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const CHILD: &str = include_str!("wandb_child.py");

/// How long `wandb.init` and `wandb.finish` may take (online mode talks to the server).
const ANSWER_WITHIN: Duration = Duration::from_secs(180);

/// The wandb logger of a run.
pub struct Wandb {
    child: Child,
    stdin: ChildStdin,
    answers: mpsc::Receiver<String>,
    run_id: String,
    run_dir: String,
}

impl Wandb {
    pub fn start(config: &TrackingConfig, ids: &mut RunIds) -> Result<Wandb, String> {
        let python = config.var("GRPO_PYTHON").unwrap_or("python3").to_string();
        let mut command = Command::new(&python);
        command
            .args(["-u", "-c", CHILD])
            .envs(&config.env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if config.var("WANDB_SILENT").is_none() {
            command.env("WANDB_SILENT", "true");
        }
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start {python} (set GRPO_PYTHON to a Python with wandb): {e}"))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (sender, answers) = mpsc::channel();
        std::thread::Builder::new()
            .name("wandb-answers".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if sender.send(line).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| format!("cannot start a thread: {e}"))?;
        let mut wandb = Wandb {
            child,
            stdin,
            answers,
            run_id: String::new(),
            run_dir: String::new(),
        };
        let dir = config
            .var("WANDB_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| config.output.clone());
        let id = ids.wandb_run_id.clone().filter(|_| config.resume);
        let answer = wandb.request(json!({"init": {
            "project": config.project,
            "name": config.experiment,
            "id": id,
            "dir": dir,
            "config": config.params,
        }}));
        let answer = match answer {
            Ok(answer) => answer,
            Err(error) => {
                let _ = wandb.child.kill();
                let _ = wandb.child.wait();
                return Err(error);
            }
        };
        wandb.run_id = answer["id"].as_str().unwrap_or_default().to_string();
        wandb.run_dir = answer["dir"].as_str().unwrap_or_default().to_string();
        ids.wandb_run_id = Some(wandb.run_id.clone());
        Ok(wandb)
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The run's files (wandb's `run.dir`).
    pub fn run_dir(&self) -> &str {
        &self.run_dir
    }

    fn send(&mut self, message: &Value) -> Result<(), String> {
        let mut line = message.to_string();
        line.push('\n');
        self.stdin
            .write_all(line.as_bytes())
            .and_then(|()| self.stdin.flush())
            .map_err(|e| {
                let status = self.child.try_wait().ok().flatten();
                match status {
                    Some(status) => format!("the wandb process exited ({status})"),
                    None => format!("cannot write to the wandb process: {e}"),
                }
            })
    }

    fn request(&mut self, message: Value) -> Result<Value, String> {
        self.send(&message)?;
        let line = self.answers.recv_timeout(ANSWER_WITHIN).map_err(|e| match e {
            mpsc::RecvTimeoutError::Timeout => format!("wandb did not answer within {ANSWER_WITHIN:?}"),
            mpsc::RecvTimeoutError::Disconnected => "the wandb process exited without answering".to_string(),
        })?;
        let answer: Value =
            serde_json::from_str(&line).map_err(|e| format!("the wandb process answered {line:?} ({e})"))?;
        match answer["error"].as_str() {
            Some(error) => Err(error.to_string()),
            None => Ok(answer),
        }
    }
}

impl Sink for Wandb {
    fn logger(&self) -> Logger {
        Logger::Wandb
    }

    fn log(&mut self, step: u64, metrics: &Metrics) -> Result<(), String> {
        // JSON has no NaN: non-finite values go as null and come back as NaN.
        let metrics: serde_json::Map<String, Value> = metrics
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    serde_json::Number::from_f64(*v)
                        .map(Value::Number)
                        .unwrap_or(Value::Null),
                )
            })
            .collect();
        self.send(&json!({"log": {"step": step, "metrics": metrics}}))
    }

    /// VeRL's `val/generations` table: a row per validation (`step`, then `input_i`,
    /// `output_i`, `score_i` for each sample), the earlier rows kept.
    fn log_generations(&mut self, step: u64, generations: &[Generation]) -> Result<(), String> {
        self.send(&json!({"generations": {"step": step, "samples": generations}}))
    }

    fn finish(&mut self, ok: bool) -> Result<(), String> {
        let result = self.request(json!({"finish": {"exit_code": if ok { 0 } else { 1 }}}));
        let _ = self.child.wait();
        result.map(|_| ())
    }
}

impl Drop for Wandb {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
