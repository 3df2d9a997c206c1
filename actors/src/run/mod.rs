//! The single controller of a training run (`grpo run`).
//!
//! One step: take `data.train_batch_size` prompts from the sampler -> the rollout workers
//! generate `rollout.n` samples each, streaming them back as they finish -> each sample goes
//! to a reward worker as soon as it arrives (scoring overlaps generation) -> the learner
//! computes advantages and updates -> the new weights reach the rollout workers (shared
//! buffers in this process, a checksummed stream to remote workers) -> metrics, validation and
//! checkpoints on their schedules.
//!
//! Everything that decides *what* is computed is a pure function of the recipe and the step
//! number (prompt order from the seeded sampler, one seed per request), so a resumed run and
//! a run whose workers live in other processes see the same prompts and draw the same tokens.
//!
//! [`assembly`] builds the roles from the recipe, [`supervisor`] replaces failed workers,
//! [`step`] runs one step, [`metrics`] turns its outcome into `metrics.jsonl`, [`checkpoint`]
//! resumes and saves, [`validate`] validates; [`fit`] below is the loop.

mod assembly;
mod checkpoint;
mod dialer;
pub mod fleet;
pub mod metrics;
mod progress;
mod prompts;
mod step;
mod step_metrics;
mod supervisor;
mod val_metrics;
mod validate;

use crate::prepare::{prepare, PrepareError, Prepared};
use crate::recipe::Recipe;
use crate::roles::RoleError;
use crate::setup;
use assembly::Assembly;
use checkpoint::Clocks;
use metrics::{Metrics, MetricsLog};
use progress::Progress;
use tracking::{Logger, Tracker};

/// How long the trackers may take to send their last steps and close their runs.
const TRACKERS_FINISH_WITHIN: std::time::Duration = std::time::Duration::from_secs(120);

/// Ends the trackers' runs as finished and says which lost steps.
fn finish_trackers(tracker: Tracker) {
    for problem in tracker.finish(true, TRACKERS_FINISH_WITHIN).problems() {
        eprintln!("trainer.logger: {problem}");
    }
}
use std::path::{Path, PathBuf};
use std::time::Instant;
use step::StepRunner;

/// Why a run stopped early.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Prepare(#[from] PrepareError),
    #[error("creating the PJRT client for cluster.device: {0}")]
    Client(xla::runtime::Error),
    #[error("rollout: {0}")]
    Rollout(#[from] rollout::RolloutError),
    #[error(transparent)]
    Role(#[from] RoleError),
    #[error("learner: {0}")]
    Learner(#[from] trainer::update::UpdateError),
    /// The learner worker process failed or stopped answering: the run cannot go on without it.
    #[error(
        "{worker} failed: {error}. The run stops here; run `grpo run` again with the same recipe \
         and it resumes {resume}"
    )]
    LearnerWorker {
        /// Which worker: index, pid and log file.
        worker: String,
        error: RoleError,
        /// Where the next `grpo run` starts from.
        resume: String,
    },
    #[error(transparent)]
    Checkpoint(#[from] trainer::checkpoint::CheckpointError),
    /// Writing a checkpoint failed (a full disk, a file-size limit, a read-only directory).
    #[error(
        "saving the checkpoint of step {step} failed: {error}. Its partial files were removed \
         and the run stops here; free space under {checkpoints} (or fix what the error names), \
         then run `grpo run` again with the same recipe: it resumes {resume}"
    )]
    Save {
        step: u64,
        error: trainer::checkpoint::CheckpointError,
        checkpoints: String,
        /// Where the next `grpo run` starts from.
        resume: String,
    },
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Other(String),
}

pub(crate) fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RunError + 'a {
    move |source| RunError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Where a `grpo run` after a failure resumes, for error messages: from `last_checkpoint`, or
/// from the start.
pub(crate) fn resume_point(last_checkpoint: Option<&Path>) -> String {
    match last_checkpoint {
        Some(dir) => format!("from its newest checkpoint, {}", dir.display()),
        None => "from the start (no checkpoint was saved yet)".to_string(),
    }
}

/// How `grpo run` was asked to behave beyond the recipe.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// No progress display (logs and metrics only).
    pub quiet: bool,
    /// The program worker processes are started as (default: this executable; `grpo run
    /// --worker-program`).
    pub worker_program: Option<PathBuf>,
}

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct RunSummary {
    pub output: PathBuf,
    /// The step the run started after (0 for a new run, the checkpoint's step on resume).
    pub resumed_from: u64,
    pub steps: u64,
    pub last_checkpoint: Option<PathBuf>,
}

/// A line on stderr unless quiet (before the progress display exists).
pub(crate) fn progress_note(options: &RunOptions, line: &str) {
    if !options.quiet {
        eprintln!("{line}");
    }
}

/// Trains as `recipe` says. Blocks the calling thread until the run ends.
pub fn train(recipe: &Recipe, options: &RunOptions) -> Result<RunSummary, RunError> {
    // Decided once, here: the workers read the resolved recipe the run writes.
    let (recipe, dtype_choices) = setup::resolve_auto_dtypes(recipe);
    for line in setup::DTypeChoice::lines(&dtype_choices) {
        eprintln!("{line}");
    }
    if recipe.rollout_devices() > 1 || recipe.actor.parallelism(&recipe.cluster).mesh.unwrap_or(1) > 1 {
        eprintln!("layout: {}", recipe.layout_text());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .build()
        .map_err(|e| RunError::Other(format!("starting the async runtime: {e}")))?;
    runtime.block_on(train_async(&recipe, &dtype_choices, options))
}

/// The first line a run (or a resumed run) writes to `metrics.jsonl`: what it runs on and in
/// which compute types, and why where `auto` chose.
fn run_header(recipe: &Recipe, dtype_choices: &[setup::DTypeChoice], start_step: u64) -> serde_json::Value {
    let name = |d: xla::DType| d.to_string();
    serde_json::json!({
        "grpo_version": env!("CARGO_PKG_VERSION"),
        "start_step": start_step,
        "rollout_device": setup::rollout_device(recipe).name(),
        "learner_device": setup::learner_device(recipe).name(),
        "rollout_dtype": name(setup::rollout_dtype(recipe)),
        "actor_param_dtype": name(setup::actor_dtype(recipe)),
        "dtype_auto": setup::DTypeChoice::lines(dtype_choices),
        "host_cpu": xla::runtime::HostCpu::get().name,
        "layout": recipe.layout_text(),
    })
}

async fn train_async(
    recipe: &Recipe,
    dtype_choices: &[setup::DTypeChoice],
    options: &RunOptions,
) -> Result<RunSummary, RunError> {
    let output = PathBuf::from(&recipe.trainer.output_dir);
    std::fs::create_dir_all(&output).map_err(io("creating the output directory", &output))?;
    let recipe_path = output.join("recipe.yaml");
    std::fs::write(&recipe_path, recipe.to_yaml()).map_err(io("writing", &recipe_path))?;
    crate::launcher::check_device_plugins(&recipe.cluster).map_err(|e| RunError::Other(e.to_string()))?;
    setup::tracking(recipe, &output, 0)
        .check()
        .map_err(|e| RunError::Other(format!("trainer.logger: {e}")))?;

    let started = Instant::now();
    let mut prepared = prepare(recipe)?;
    let config = prepared.model.weights.config.clone();
    tracing::info!(
        "model {} ({}, {:.1}M parameters), {} training prompts",
        recipe.model.path,
        config.family,
        config.num_parameters() as f64 / 1e6,
        prepared.train.len()
    );
    if let Some((_, Some(why))) = setup::lora_form(recipe) {
        eprintln!("{why}");
    }
    let client = setup::open_client(recipe).map_err(RunError::Client)?;
    let mut sampler = prepared.train.train_sampler(&recipe.data)?;
    let total_steps = match recipe.trainer.total_training_steps {
        Some(s) => s as u64,
        None => recipe.trainer.total_epochs as u64 * sampler.batches_per_epoch(),
    };
    // The parameter table: the order of every weight stream and checkpoint.
    let specs = setup::policy(recipe, &config).param_specs();
    let critic_specs = setup::critic_model_config(recipe, &config)
        .map_err(RunError::Other)?
        .map(|c| setup::critic(recipe, &c).param_specs());
    let mut start = checkpoint::resume(recipe, &output, &specs, critic_specs.as_deref(), &mut sampler)?;
    let resumed_from = start.step;
    let summary = |last_checkpoint| RunSummary {
        output: output.clone(),
        resumed_from,
        steps: total_steps.max(resumed_from),
        last_checkpoint,
    };
    if start.step >= total_steps && !recipe.trainer.val_only {
        return Ok(summary(start.checkpoint.clone()));
    }
    let total_optimizer_steps = setup::batch_plan(recipe).total_optimizer_steps(total_steps);
    let assembly = Assembly::start(
        recipe,
        options,
        &output,
        &mut prepared,
        &client,
        &specs,
        critic_specs.as_deref(),
        &mut start,
        total_optimizer_steps,
    )
    .await?;
    let start_step = start.step;
    let steps = StepRunner {
        recipe,
        prepared: &prepared,
        client: &client,
        assembly: &assembly,
        sampler,
        total_steps,
        version: start.version,
        last_checkpoint: start.checkpoint.clone(),
        ready: None,
        prompts_log: output.join("prompts.jsonl"),
    };
    let header = run_header(recipe, dtype_choices, start_step);
    tracing::info!("ready in {:.1}s", started.elapsed().as_secs_f64());
    let run = Run {
        recipe,
        prepared: &prepared,
        output: &output,
        specs: &specs,
        critic_specs: critic_specs.as_deref(),
    };
    let result = tokio::select! {
        r = run.fit(steps, start_step, header, options) => r,
        _ = tokio::signal::ctrl_c() => Err(RunError::Other(
            "interrupted (Ctrl-C); the newest checkpoint is where `grpo run` resumes".into(),
        )),
    };
    // Stop the workers whatever happened (dropping the launcher kills any that remain).
    assembly.shutdown().await;
    Ok(summary(result?))
}

/// What the step loop reads.
struct Run<'a> {
    recipe: &'a Recipe,
    prepared: &'a Prepared,
    output: &'a Path,
    specs: &'a [model::ParamSpec],
    /// PPO's critic's parameter table.
    critic_specs: Option<&'a [model::ParamSpec]>,
}

impl Run<'_> {
    /// The step loop (VeRL's `fit()`): validate before training, then each step, its metrics,
    /// validation and checkpoint on their schedules. Returns the newest checkpoint.
    async fn fit(
        &self,
        mut steps: StepRunner<'_>,
        start_step: u64,
        header: serde_json::Value,
        options: &RunOptions,
    ) -> Result<Option<PathBuf>, RunError> {
        let loggers = &self.recipe.trainer.logger;
        let mut log = match loggers.contains(&Logger::File) {
            true => Some(
                MetricsLog::open(self.output).map_err(io("opening", &self.output.join("metrics.jsonl")))?,
            ),
            false => None,
        };
        let mut write = |step: Option<u64>, m: &Metrics| -> Result<(), RunError> {
            let Some(log) = log.as_mut() else { return Ok(()) };
            match step {
                Some(step) => log.write(step, m),
                None => log.write_header(header.clone()),
            }
            .map_err(io("writing", log.path()))
        };
        write(None, &Metrics::new())?;
        let tracker = Tracker::start(setup::tracking(self.recipe, self.output, start_step));
        let limits = step_metrics::MetricLimits {
            max_prompt_length: self.recipe.data.max_prompt_length,
            devices: self.recipe.devices_in_use(),
            multi_turn: self.recipe.rollout.multi_turn.enable,
        };
        let total_steps = steps.total_steps;
        let console = loggers.contains(&Logger::Console);
        let progress = Progress::new(start_step, total_steps, options.quiet, console);
        if self.recipe.trainer.val_only {
            // VeRL's `val_only`: the policy as it starts (fresh, or the resumed checkpoint's).
            progress.phase("validating");
            let v = self.validate(&steps, start_step, &tracker).await?;
            progress.note(&format!(
                "validation at step {start_step} (trainer.val_only): {}",
                val_metrics::core_means(&v)
            ));
            write(Some(start_step), &v)?;
            tracker.log(start_step, &v);
            progress.finish();
            finish_trackers(tracker);
            return Ok(steps.last_checkpoint);
        }
        if start_step == 0 && self.validation_due(0, total_steps) {
            progress.phase("validating");
            let v = self.validate(&steps, 0, &tracker).await?;
            progress.note(&format!(
                "validation before training: {}",
                val_metrics::core_means(&v)
            ));
            write(Some(0), &v)?;
            tracker.log(0, &v);
        }
        for step in start_step + 1..=total_steps {
            let started = Instant::now();
            let outcome = steps.step(step, &progress).await?;
            let mut m = step_metrics::step_metrics(&outcome, step, limits);
            if self.validation_due(step, total_steps) {
                progress.phase("validating");
                let t = Instant::now();
                m.extend(self.validate(&steps, step, &tracker).await?);
                m.insert("timing_s/testing".into(), t.elapsed().as_secs_f64());
            }
            step_metrics::add_step_time(&mut m, started.elapsed().as_secs_f64());
            // The step's line goes out before its checkpoint: a checkpoint on disk always has
            // its metrics line, so a resume never leaves a hole in metrics.jsonl.
            write(Some(step), &m)?;
            tracker.log(step, &m);
            progress.step_done(step, &m);
            if self.save_due(step, total_steps) {
                progress.phase("saving a checkpoint");
                let t = Instant::now();
                let states = steps.learner().state(steps.last_checkpoint.as_deref()).await?;
                let (state, critic) = match (self.critic_specs, states.critic) {
                    (Some(specs), Some(critic)) => (states.policy, Some((specs, critic))),
                    (None, None) => (states.policy, None),
                    (want, _) => {
                        return Err(RunError::Other(format!(
                            "the learner {} a critic but the recipe {} one",
                            if want.is_some() { "holds no" } else { "holds" },
                            if want.is_some() { "needs" } else { "has no use for" }
                        )))
                    }
                };
                let clocks = Clocks {
                    step,
                    weight_version: outcome.version,
                    update: steps.learner().clocks(),
                    sampler: outcome.sampler,
                };
                let dir = checkpoint::save(self.recipe, self.output, self.specs, state, critic, clocks)
                    .map_err(|e| match e {
                        RunError::Checkpoint(error) => RunError::Save {
                            step,
                            error,
                            checkpoints: self.output.join("checkpoints").display().to_string(),
                            resume: resume_point(steps.last_checkpoint.as_deref()),
                        },
                        other => other,
                    })?;
                tracing::info!("saved {} in {:.1}s", dir.display(), t.elapsed().as_secs_f64());
                steps.last_checkpoint = Some(dir);
            }
        }
        progress.finish();
        finish_trackers(tracker);
        Ok(steps.last_checkpoint)
    }

    /// Validates at `step`; the generations `trainer.log_val_generations` asks for go to the
    /// trackers, the metrics are returned.
    async fn validate(
        &self,
        steps: &StepRunner<'_>,
        step: u64,
        tracker: &Tracker,
    ) -> Result<Metrics, RunError> {
        let v = validate::validate(self.recipe, self.prepared, &steps.fleet(), step, self.output).await?;
        if !v.generations.is_empty() {
            tracker.log_generations(step, v.generations);
        }
        Ok(v.metrics)
    }

    /// Validation before training (`trainer.val_before_train`), every `trainer.test_freq`
    /// steps and after the last one; only with validation files.
    fn validation_due(&self, step: u64, total_steps: u64) -> bool {
        let t = &self.recipe.trainer;
        self.prepared.validation.is_some()
            && ((step == 0 && t.val_before_train)
                || (step > 0 && t.test_freq > 0 && step.is_multiple_of(t.test_freq as u64))
                || (step == total_steps && t.test_freq > 0))
    }

    /// As VeRL: every `trainer.save_freq` steps and after the last one; never when
    /// `save_freq <= 0`.
    fn save_due(&self, step: u64, total_steps: u64) -> bool {
        let freq = self.recipe.trainer.save_freq;
        freq > 0 && (step.is_multiple_of(freq as u64) || step == total_steps)
    }
}
