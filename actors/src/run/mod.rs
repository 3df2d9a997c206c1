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

pub mod fleet;
pub mod metrics;

use crate::auth::Token;
use crate::launcher::ray::RaySpec;
use crate::launcher::{LaunchSpec, Launcher, LocalLauncher, RayLauncher, WorkerInfo};
use crate::prepare::{prepare, PrepareError, Prepared};
use crate::recipe::{Recipe, ResumeMode};
use crate::roles::learner::{
    self as learner, LearnerError, LearnerRole, LearnerWeights, LocalLearner, RemoteLearner, Row,
};
use crate::roles::reward::{LocalReward, RemoteReward, RewardRole};
use crate::roles::rollout::{LocalRollout, RemoteRollout, RolloutRole, WeightUpdate};
use crate::roles::Role;
use crate::roles::RoleError;
use crate::setup;
use fleet::{Fleet, PromptMeta, Scored};
use metrics::{mean_std, Metrics, MetricsLog, Progress};
use rollout::{FinishReason, GenerationRequest, SamplingParams};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use trainer::checkpoint::{latest_checkpoint, load_checkpoint, save_checkpoint, TrainerState};
use trainer::step::LearnerState;
use xla::runtime::Client;
use xla::DType;

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
    Learner(#[from] LearnerError),
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

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RunError + 'a {
    move |source| RunError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// How `grpo run` was asked to behave beyond the recipe.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// No progress display (logs and metrics only).
    pub quiet: bool,
    /// The `grpo` executable worker processes are started from (default: this executable).
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
fn progress_note(options: &RunOptions, line: &str) {
    if !options.quiet {
        eprintln!("{line}");
    }
}

/// The key under which a checkpoint records the optimizer-step clock.
const OPTIMIZER_STEPS_KEY: &str = "optimizer_steps";

/// Trains as `recipe` says. Blocks the calling thread until the run ends.
pub fn train(recipe: &Recipe, options: &RunOptions) -> Result<RunSummary, RunError> {
    // Decided once, here: the workers read the resolved recipe the run writes.
    let (recipe, dtype_choices) = setup::resolve_auto_dtypes(recipe);
    for line in setup::DTypeChoice::lines(&dtype_choices) {
        eprintln!("{line}");
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
    })
}

/// Request ids: training prompt `i` of step `s` is `s << 24 | i`; validation requests set bit 62.
fn request_id(step: u64, i: usize) -> u64 {
    (step << 24) | i as u64
}
const VALIDATION_ID: u64 = 1 << 62;

/// The seed of a request: a mix of the run's seed and the request id (SplitMix64), so every
/// prompt's samples are reproducible wherever and whenever they are generated.
fn request_seed(seed: u64, id: u64) -> u64 {
    let mut z = seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The sampling settings of the recipe's training (or, with `validation`, validation) requests.
pub fn sampling_params(recipe: &Recipe, validation: bool) -> SamplingParams {
    let r = &recipe.rollout;
    let (temperature, top_k, top_p) = if !validation {
        (r.temperature, r.top_k, r.top_p)
    } else if r.val_kwargs.do_sample {
        (r.val_kwargs.temperature, r.val_kwargs.top_k, r.val_kwargs.top_p)
    } else {
        (0.0, -1, 1.0)
    };
    SamplingParams {
        temperature: temperature as f32,
        top_k: if top_k <= 0 { 0 } else { top_k as usize },
        top_p: top_p as f32,
        max_new_tokens: recipe.data.max_response_length,
        stop_token_ids: Vec::new(),
        stop_strings: r.stop.clone(),
    }
}

/// The prompts of one step, ready to send.
struct StepPrompts {
    requests: Vec<GenerationRequest>,
    metas: HashMap<u64, PromptMeta>,
    /// Dataset row indices, in batch order (for `prompts.jsonl`).
    indices: Vec<u64>,
    prompt_tokens: usize,
}

fn build_prompts(
    recipe: &Recipe,
    prepared: &Prepared,
    dataset: &data::PromptDataset,
    positions: &[u64],
    id_base: impl Fn(usize) -> u64,
    validation: bool,
) -> Result<StepPrompts, RunError> {
    let examples = dataset.read(positions)?;
    let n = if validation {
        recipe.rollout.val_kwargs.n
    } else {
        recipe.rollout.n
    };
    let params = sampling_params(recipe, validation);
    let mut out = StepPrompts {
        requests: Vec::with_capacity(examples.len()),
        metas: HashMap::new(),
        indices: Vec::with_capacity(examples.len()),
        prompt_tokens: 0,
    };
    for (i, ex) in examples.iter().enumerate() {
        let prompt = dataset.encode_prompt(ex, &prepared.tokenizer)?;
        let id = id_base(i);
        out.prompt_tokens += prompt.len() * n;
        out.requests.push(GenerationRequest {
            id,
            prompt,
            n,
            seed: request_seed(recipe.trainer.seed, id),
            params: params.clone(),
        });
        out.metas.insert(
            id,
            PromptMeta {
                data_source: ex.data_source.clone().unwrap_or_default(),
                ground_truth: ex.ground_truth_text().unwrap_or_default(),
                extra: serde_json::Value::Object(ex.columns.clone()),
            },
        );
        out.indices.push(ex.index);
    }
    Ok(out)
}

/// Weights for a rollout engine in `dtype`. From a learner in this process: its buffers
/// turned into one replica per learner device on the devices ([`rollout::handoff`]: used in
/// place when already replicated in `dtype` and `copy` is off, else gathered and converted by
/// a compiled program, never through the host; `copy` asks for buffers of the rollout's own).
/// From a learner worker: the streamed tensors uploaded to this process's device 0 (where the
/// rollout engine lives).
fn rollout_weights(
    weights: LearnerWeights,
    client: &Client,
    dtype: DType,
    copy: bool,
) -> Result<rollout::EngineWeights, RunError> {
    let rt = |e: xla::runtime::Error| RunError::Other(format!("preparing rollout weights: {e}"));
    match weights {
        LearnerWeights::Shared(source) => rollout::handoff(client, &source, dtype, copy)
            .map_err(|e| RunError::Other(format!("handing the learner's weights to the rollout: {e}"))),
        LearnerWeights::Host(tensors) => tensors
            .iter()
            .map(|t| {
                if t.dtype != dtype {
                    return Err(RunError::Other(format!(
                        "the learner sent tensor `{}` as {}, the rollout needs {dtype}",
                        t.name, t.dtype
                    )));
                }
                let dims: Vec<i64> = t.dims.iter().map(|d| *d as i64).collect();
                client.buffer_from_bytes(&t.bytes, dtype, &dims, 0).map_err(rt)
            })
            .collect::<Result<Vec<_>, _>>()
            .map(rollout::EngineWeights::from),
    }
}

/// Rewrites `path` keeping only the run headers and the JSON lines whose `step` is at most
/// `last_step` (what a resumed run must not see twice). A missing file is fine.
fn truncate_jsonl(path: &Path, last_step: u64) -> Result<(), RunError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    // Steps after `last_step` go; run headers (no `step`) stay.
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| match v.get("step") {
                Some(s) => s.as_u64().is_some_and(|s| s <= last_step),
                None => v.get("run").is_some(),
            })
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, kept).map_err(io("writing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io("replacing", path))
}

fn append_line(path: &Path, value: &serde_json::Value) -> Result<(), RunError> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io("opening", path))?;
    writeln!(f, "{value}").map_err(io("writing", path))
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
    let client = setup::open_client(recipe).map_err(RunError::Client)?;

    // Schedule.
    let mut sampler = prepared.train.train_sampler(&recipe.data)?;
    let total_steps = match recipe.trainer.total_training_steps {
        Some(s) => s as u64,
        None => recipe.trainer.total_epochs as u64 * sampler.batches_per_epoch(),
    };
    let minis_per_step = recipe
        .data
        .train_batch_size
        .div_ceil(recipe.actor.ppo_mini_batch_size.max(1)) as u64;
    let total_optimizer_steps = total_steps * minis_per_step * recipe.actor.ppo_epochs as u64;

    // The parameter table: the order of every weight stream and checkpoint.
    let specs = learner::param_specs(recipe, &config);

    // Resume from the newest complete checkpoint, or start fresh.
    let checkpoint = match recipe.trainer.resume_mode {
        ResumeMode::Auto => latest_checkpoint(&output)?,
        ResumeMode::Disable => None,
    };
    let (resume, start_step, mut version, optimizer_steps) = match &checkpoint {
        Some(dir) => {
            let ck = load_checkpoint(dir)?;
            let state = LearnerState::from_checkpoint(&ck, &specs)?;
            let position: data::SamplerState = serde_json::from_value(ck.state.sampler_position.clone())
                .map_err(|e| RunError::Other(format!("{}: bad sampler position: {e}", dir.display())))?;
            sampler.restore(position)?;
            let opt = ck
                .state
                .extra
                .get(OPTIMIZER_STEPS_KEY)
                .and_then(|v| v.as_u64())
                .unwrap_or(0);
            tracing::info!("resuming from {} (step {})", dir.display(), ck.state.step);
            (Some(state), ck.state.step, ck.state.weight_version, opt)
        }
        None => (None, 0, 0, 0),
    };
    // A resumed run keeps the history up to its checkpoint; a new run starts it afresh.
    for name in ["metrics.jsonl", "prompts.jsonl"] {
        let path = output.join(name);
        if checkpoint.is_some() {
            truncate_jsonl(&path, start_step)?;
        } else if path.exists() {
            std::fs::remove_file(&path).map_err(io("removing", &path))?;
        }
    }
    if start_step >= total_steps {
        return Ok(RunSummary {
            output,
            resumed_from: start_step,
            steps: start_step,
            last_checkpoint: checkpoint,
        });
    }

    let off_policy = recipe.trainer.off_policy_steps > 0;
    let rollout_dtype = setup::rollout_dtype(recipe);

    // The roles: in this process, or worker processes started by the local launcher.
    let cluster = &recipe.cluster;
    let tls = cluster.tls.as_ref();
    let timeout = std::time::Duration::from_secs_f64(cluster.worker_timeout_s);
    let reward_pool = recipe
        .reward
        .pool_options()
        .map_err(|e| RunError::Other(format!("reward: {e}")))?;
    let reward_deadline = crate::roles::reward::RewardDeadline::new(timeout, &reward_pool);
    let token = Token::generate();
    let launcher = if [Role::Rollout, Role::Reward, Role::Learner]
        .into_iter()
        .any(|role| worker_count(cluster, role) > 0)
    {
        let token_file = output.join("worker.token");
        token
            .write(&token_file)
            .map_err(|e| RunError::Other(format!("writing the workers' token: {e}")))?;
        let program = match (
            &options.worker_program,
            cluster.ray.as_ref().and_then(|r| r.binary.as_ref()),
        ) {
            (Some(p), _) => p.clone(),
            (None, Some(binary)) if cluster.launcher == crate::recipe::Launcher::Ray => PathBuf::from(binary),
            (None, _) => std::env::current_exe().map_err(io("locating", Path::new("the grpo executable")))?,
        };
        let spec = LaunchSpec::from_cluster(cluster, program, recipe_path.clone(), token_file, &output);
        let counts = format!(
            "{} rollout, {} reward and {} learner worker process(es)",
            worker_count(cluster, Role::Rollout),
            worker_count(cluster, Role::Reward),
            worker_count(cluster, Role::Learner),
        );
        let launcher = match cluster.launcher {
            crate::recipe::Launcher::Local => {
                progress_note(
                    options,
                    &format!("starting {counts} (logs in {})", spec.log_dir.display()),
                );
                Launcher::Local(
                    LocalLauncher::start(spec)
                        .await
                        .map_err(|e| RunError::Other(e.to_string()))?,
                )
            }
            crate::recipe::Launcher::Ray => {
                // Ray runs the jobs elsewhere: every path they are given is absolute.
                let absolute = |p: &Path| std::path::absolute(p).map_err(io("resolving", p));
                let spec = LaunchSpec {
                    recipe: absolute(&spec.recipe)?,
                    token_file: absolute(&spec.token_file)?,
                    log_dir: absolute(&spec.log_dir)?,
                    ..spec
                };
                let workdir =
                    std::env::current_dir().map_err(io("reading", Path::new("the working directory")))?;
                let ray = RaySpec::from_cluster(cluster, workdir)
                    .ok_or_else(|| RunError::Other("`cluster.launcher: ray` needs `cluster.ray`".into()))?;
                progress_note(
                    options,
                    &format!(
                        "submitting {counts} as Ray jobs to {} (logs copied to {})",
                        ray.ray.address,
                        spec.log_dir.display()
                    ),
                );
                let launcher = RayLauncher::start(spec, ray)
                    .await
                    .map_err(|e| RunError::Other(e.to_string()))?;
                for line in launcher.placements() {
                    progress_note(options, &format!("  {line}"));
                }
                Launcher::Ray(launcher)
            }
        };
        Some(Arc::new(launcher))
    } else {
        None
    };

    // The learner (with the reference model): in this process, or the learner worker, which is
    // sent the checkpoint's state when the run resumes.
    let learner_worker: Option<WorkerInfo> = match &launcher {
        Some(l) if worker_count(cluster, Role::Learner) > 0 => Some(
            l.workers(Role::Learner)
                .first()
                .cloned()
                .ok_or_else(|| RunError::Other("the launcher started no learner worker".into()))?,
        ),
        _ => None,
    };
    // Errors of a learner worker name it and say where the next run resumes.
    let learner_error = |error: RoleError, last_checkpoint: Option<&Path>| -> RunError {
        match &learner_worker {
            Some(w) => learner_worker_failed(w, error, last_checkpoint),
            None => RunError::Role(error),
        }
    };
    let learner: Arc<dyn LearnerRole> = match &learner_worker {
        Some(w) => {
            // The worker loads the model itself; this process needs no host copy of it.
            prepared.model.weights.tensors = Vec::new();
            let remote = RemoteLearner::with_timeout(&w.address, &token, tls, timeout, specs.clone())?;
            remote
                .start(resume, optimizer_steps, total_optimizer_steps)
                .await
                .map_err(|e| learner_error(e, checkpoint.as_deref()))?;
            Arc::new(remote)
        }
        None => {
            // The host copy of the weights moves into the learner (the rollout shares the
            // learner's device buffers), so the model is held once on the host.
            let initial = learner::initial_params(&specs, &mut prepared.model.weights)?;
            Arc::new(LocalLearner::start(
                &client,
                recipe,
                &config,
                initial,
                resume,
                optimizer_steps,
                total_optimizer_steps,
            )?)
        }
    };
    let prepared = prepared;
    let remote_rollout = |address: &str| -> Result<Arc<dyn RolloutRole>, RoleError> {
        Ok(Arc::new(RemoteRollout::with_timeout(
            address, &token, tls, timeout,
        )?))
    };
    let remote_reward = |address: &str| -> Result<Arc<dyn RewardRole>, RoleError> {
        Ok(Arc::new(RemoteReward::with_deadline(
            address,
            &token,
            tls,
            reward_deadline,
        )?))
    };
    let rollouts: Vec<Arc<dyn RolloutRole>> = match &launcher {
        Some(l) if worker_count(cluster, Role::Rollout) > 0 => l
            .workers(Role::Rollout)
            .iter()
            .map(|w| remote_rollout(&w.address))
            .collect::<Result<_, _>>()?,
        _ => {
            let current = learner
                .weights(version, rollout_dtype)
                .await
                .map_err(|e| learner_error(e, checkpoint.as_deref()))?;
            let weights = rollout_weights(current, &client, rollout_dtype, off_policy)?;
            let engine = setup::build_engine(recipe, &prepared, &client, weights, version)?;
            vec![Arc::new(LocalRollout::new(engine))]
        }
    };
    let rewards: Vec<Arc<dyn RewardRole>> = match &launcher {
        Some(l) if worker_count(cluster, Role::Reward) > 0 => l
            .workers(Role::Reward)
            .iter()
            .map(|w| remote_reward(&w.address))
            .collect::<Result<_, _>>()?,
        _ => {
            let options = recipe
                .reward
                .pool_options()
                .map_err(|e| RunError::Other(format!("reward: {e}")))?;
            let function = recipe
                .reward
                .build(Some(recipe.data.max_response_length))
                .map_err(|e| RunError::Other(format!("reward: {e}")))?;
            vec![Arc::new(LocalReward::new(Arc::new(function), options))]
        }
    };
    let fleet = Arc::new(Fleet::new(
        rollouts,
        rewards,
        LaunchSpec::DEFAULT_START_TIMEOUT + timeout,
    ));
    if worker_count(cluster, Role::Rollout) > 0 {
        // Workers load the model themselves; from here on they take the learner's versions.
        let current = learner
            .weights(version, rollout_dtype)
            .await
            .map_err(|e| learner_error(e, checkpoint.as_deref()))?;
        let params = rollout_weights(current, &client, rollout_dtype, false)?;
        fleet.update_weights(WeightUpdate { version, params }).await?;
    }
    // Replace workers that fail, in the background: the others carry on meanwhile.
    let replacer = launcher.clone().map(|launcher| {
        let fleet = fleet.clone();
        let token = token.clone();
        let tls = cluster.tls.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                // A Ray job that ended is a dead worker even before a call to it fails.
                for (role, index) in launcher.ended_jobs().await {
                    match role {
                        Role::Rollout => fleet.rollout_failed(index),
                        Role::Reward => fleet.reward_failed(index),
                        Role::Learner => {} // its next call fails and stops the run
                    }
                }
                for (role, index) in fleet.take_dead() {
                    let (launcher, fleet, token, tls) =
                        (launcher.clone(), fleet.clone(), token.clone(), tls.clone());
                    tokio::spawn(async move {
                        tracing::warn!("starting a replacement for {} worker {index}", role.name());
                        let result = async {
                            let w = launcher.restart(role, index).await.map_err(|e| e.to_string())?;
                            match role {
                                Role::Rollout => {
                                    let r = RemoteRollout::with_timeout(
                                        &w.address,
                                        &token,
                                        tls.as_ref(),
                                        timeout,
                                    )
                                    .map_err(|e| e.to_string())?;
                                    fleet
                                        .replace_rollout(index, Arc::new(r))
                                        .await
                                        .map_err(|e| e.to_string())
                                }
                                Role::Reward => {
                                    let r = RemoteReward::with_deadline(
                                        &w.address,
                                        &token,
                                        tls.as_ref(),
                                        reward_deadline,
                                    )
                                    .map_err(|e| e.to_string())?;
                                    fleet.replace_reward(index, Arc::new(r));
                                    Ok(())
                                }
                                Role::Learner => {
                                    Err("a learner worker is not replaced during a run".to_string())
                                }
                            }
                        }
                        .await;
                        match result {
                            Ok(()) => tracing::warn!("{} worker {index} replaced", role.name()),
                            Err(e) => {
                                tracing::error!("replacing {} worker {index} failed: {e}", role.name());
                                fleet.replacement_failed(role, index);
                            }
                        }
                    });
                }
            }
        })
    });

    let steps = async {
        let mut log = MetricsLog::open(&output).map_err(io("opening", &output.join("metrics.jsonl")))?;
        log.write_header(run_header(recipe, dtype_choices, start_step))
            .map_err(io("writing", log.path()))?;
        let prompts_log = output.join("prompts.jsonl");
        let progress = Progress::new(start_step, total_steps, options.quiet);
        tracing::info!("ready in {:.1}s", started.elapsed().as_secs_f64());

        let validation_due = |step: u64| -> bool {
            prepared.validation.is_some()
                && ((step == 0 && recipe.trainer.val_before_train)
                    || (recipe.trainer.test_freq > 0 && step.is_multiple_of(recipe.trainer.test_freq as u64))
                    || (step == total_steps && recipe.trainer.test_freq > 0))
        };
        if start_step == 0 && validation_due(0) {
            progress.phase("validating");
            let v = validate(recipe, &prepared, &fleet, 0, &output).await?;
            progress.note(&format!(
                "validation before training: accuracy {:.3}",
                v["val/accuracy"]
            ));
            log.write(0, &v).map_err(io("writing", log.path()))?;
        }

        let mut last_checkpoint = checkpoint.clone();
        // With one-step off-policy, the next step's samples are generated while this step updates;
        // they wait here for the next step.
        let mut ready: Option<Generated> = None;
        let mut sampler_before_prefetch;

        for step in start_step + 1..=total_steps {
            let step_started = Instant::now();
            let mut m = Metrics::new();
            progress.phase("generating");
            // 1-3: prompts -> samples -> rewards.
            let generated = match ready.take() {
                Some(g) => g,
                None => {
                    let batch = sampler.next_batch();
                    let prompts = build_prompts(
                        recipe,
                        &prepared,
                        &prepared.train,
                        &batch.positions,
                        |i| request_id(step, i),
                        false,
                    )?;
                    generate(fleet.clone(), prompts, batch.epoch).await?
                }
            };
            append_line(
                &prompts_log,
                &serde_json::json!({"step": step, "epoch": generated.epoch, "indices": generated.indices}),
            )?;
            // A checkpoint after this step resumes with the next batch drawn again.
            sampler_before_prefetch = sampler.state();
            let prefetch = if off_policy && step < total_steps {
                let batch = sampler.next_batch();
                let prompts = build_prompts(
                    recipe,
                    &prepared,
                    &prepared.train,
                    &batch.positions,
                    |i| request_id(step + 1, i),
                    false,
                )?;
                Some(tokio::spawn(generate(fleet.clone(), prompts, batch.epoch)))
            } else {
                None
            };

            // 4: the update.
            progress.phase("updating");
            let rows: Vec<Row> = generated
                .scored
                .iter()
                .map(|s| Row {
                    group: s.sample.request_id,
                    prompt: s.sample.prompt_ids.clone(),
                    response: s.sample.response_ids.clone(),
                    rollout_log_probs: s.sample.logprobs.clone(),
                    score: s.score.score,
                    truncated: matches!(
                        s.sample.finish_reason,
                        FinishReason::MaxNewTokens | FinishReason::MaxModelLen
                    ),
                })
                .collect();
            let t = Instant::now();
            let report = learner
                .update(rows)
                .await
                .map_err(|e| learner_error(e, last_checkpoint.as_deref()))?;
            let update_s = t.elapsed().as_secs_f64();
            let lag: Vec<f64> = generated
                .scored
                .iter()
                .map(|s| version.saturating_sub(s.sample.weight_version) as f64)
                .collect();
            version += 1;

            // 5: the new weights to the rollout workers (after the prefetched generation, so
            // that every sample of a step comes from one version).
            if let Some(handle) = prefetch {
                ready = Some(
                    handle
                        .await
                        .map_err(|e| RunError::Other(format!("generation task: {e}")))??,
                );
            }
            progress.phase("syncing weights");
            let t = Instant::now();
            // Nothing else runs on the client during the sync, so this counts its transfers.
            let transfers_before = client.transfer_stats();
            let current = learner
                .weights(version, rollout_dtype)
                .await
                .map_err(|e| learner_error(e, last_checkpoint.as_deref()))?;
            let params = rollout_weights(current, &client, rollout_dtype, off_policy)?;
            fleet.update_weights(WeightUpdate { version, params }).await?;
            let sync_s = t.elapsed().as_secs_f64();
            let sync_transfers = client.transfer_stats().since(&transfers_before);

            // Metrics.
            let scores: Vec<f64> = generated.scored.iter().map(|s| s.score.score).collect();
            let (mean, std) = mean_std(&scores);
            m.insert("batch/samples".into(), scores.len() as f64);
            m.insert("reward/mean".into(), mean);
            m.insert("reward/std".into(), std);
            m.insert(
                "reward/max".into(),
                scores.iter().cloned().fold(f64::NAN, f64::max),
            );
            m.insert(
                "reward/min".into(),
                scores.iter().cloned().fold(f64::NAN, f64::min),
            );
            m.insert(
                "reward/errors".into(),
                generated
                    .scored
                    .iter()
                    .filter(|s| s.score.error.is_some())
                    .count() as f64,
            );
            let mut extras: HashMap<&str, Vec<f64>> = HashMap::new();
            for s in &generated.scored {
                for (k, v) in &s.score.extras {
                    extras.entry(k.as_str()).or_default().push(*v);
                }
            }
            for (k, v) in extras {
                m.insert(format!("reward/extra/{k}"), mean_std(&v).0);
            }
            let lengths: Vec<f64> = generated
                .scored
                .iter()
                .map(|s| s.sample.response_ids.len() as f64)
                .collect();
            m.insert("response_length/mean".into(), mean_std(&lengths).0);
            m.insert(
                "response_length/max".into(),
                lengths.iter().cloned().fold(0.0, f64::max),
            );
            m.insert(
                "response_length/clip_ratio".into(),
                generated
                    .scored
                    .iter()
                    .filter(|s| {
                        !matches!(
                            s.sample.finish_reason,
                            FinishReason::Eos(_) | FinishReason::StopString(_)
                        )
                    })
                    .count() as f64
                    / scores.len().max(1) as f64,
            );
            m.insert(
                "prompt_length/mean".into(),
                generated.prompt_tokens as f64 / scores.len().max(1) as f64,
            );
            m.extend(report.metrics.clone());
            m.insert("timing_s/gen".into(), generated.gen_s);
            m.insert("timing_s/reward".into(), generated.reward_tail_s);
            m.insert("timing_s/update".into(), update_s);
            m.insert("timing_s/sync".into(), sync_s);
            let gen_tokens: usize = lengths.iter().map(|l| *l as usize).sum();
            m.insert(
                "perf/gen_tokens_per_s".into(),
                gen_tokens as f64 / generated.gen_s.max(1e-9),
            );
            m.insert(
                "perf/train_tokens_per_s".into(),
                report.processed_tokens as f64 / update_s.max(1e-9),
            );
            m.insert("weights/version".into(), version as f64);
            m.insert("weights/version_lag".into(), mean_std(&lag).0);
            m.insert(
                "weights/host_transfers".into(),
                sync_transfers.host_transfers() as f64,
            );
            m.insert(
                "weights/host_transfer_bytes".into(),
                sync_transfers.host_bytes() as f64,
            );
            m.insert(
                "workers/rollout_failures".into(),
                generated.rollout_failures as f64,
            );
            m.insert("workers/reward_failures".into(), generated.reward_failures as f64);
            m.insert("workers/reissued_requests".into(), generated.reissued as f64);
            m.insert("workers/failures_total".into(), fleet.failures() as f64);
            m.insert("workers/replaced_total".into(), fleet.replaced() as f64);
            m.insert("data/epoch".into(), generated.epoch as f64);

            // Validation and checkpoints on their schedules.
            if validation_due(step) {
                progress.phase("validating");
                let t = Instant::now();
                let v = validate(recipe, &prepared, &fleet, step, &output).await?;
                m.extend(v);
                m.insert("timing_s/validation".into(), t.elapsed().as_secs_f64());
            }
            // As VeRL: every save_freq steps and after the last one; never when save_freq <= 0.
            let save_due = recipe.trainer.save_freq > 0
                && (step.is_multiple_of(recipe.trainer.save_freq as u64) || step == total_steps);
            let step_s = step_started.elapsed().as_secs_f64();
            m.insert("timing_s/step".into(), step_s);
            // What the controller itself spent: the step minus the work it waited for.
            let work: f64 = [
                "timing_s/gen",
                "timing_s/reward",
                "timing_s/update",
                "timing_s/sync",
                "timing_s/validation",
            ]
            .iter()
            .filter_map(|k| m.get(*k))
            .sum();
            m.insert(
                "perf/orchestration_overhead_frac".into(),
                ((step_s - work) / step_s).max(0.0),
            );
            // The step's line goes out before its checkpoint: a checkpoint on disk always has
            // its metrics line, so a resume never leaves a hole in metrics.jsonl.
            log.write(step, &m).map_err(io("writing", log.path()))?;
            progress.step_done(step, &m);
            if save_due {
                progress.phase("saving a checkpoint");
                let t = Instant::now();
                let learner_state = learner
                    .state()
                    .await
                    .map_err(|e| learner_error(e, last_checkpoint.as_deref()))?;
                let state = TrainerState {
                    step,
                    weight_version: version,
                    rng_state: serde_json::json!({ "seed": recipe.trainer.seed }),
                    sampler_position: serde_json::to_value(sampler_before_prefetch)
                        .map_err(|e| RunError::Other(e.to_string()))?,
                    extra: serde_json::json!({
                        trainer::export::MODEL_PATH_KEY: recipe.model.path,
                        OPTIMIZER_STEPS_KEY: learner.optimizer_steps(),
                    }),
                };
                let files = learner_state.to_tensor_files(&specs);
                drop(learner_state);
                let dir = save_checkpoint(&output, &state, &files, recipe.trainer.max_checkpoints_to_keep)?;
                tracing::info!("saved {} in {:.1}s", dir.display(), t.elapsed().as_secs_f64());
                last_checkpoint = Some(dir);
            }
        }
        progress.finish();
        Ok::<_, RunError>(last_checkpoint)
    };
    let result = tokio::select! {
        r = steps => r,
        _ = tokio::signal::ctrl_c() => Err(RunError::Other(
            "interrupted (Ctrl-C); the newest checkpoint is where `grpo run` resumes".into(),
        )),
    };
    // Stop the workers whatever happened (dropping the launcher kills any that remain).
    if let Some(task) = replacer {
        task.abort();
    }
    if let Some(l) = launcher {
        l.shutdown(std::time::Duration::from_secs(2)).await;
    }
    let last_checkpoint = result?;
    Ok(RunSummary {
        output,
        resumed_from: start_step,
        steps: total_steps,
        last_checkpoint,
    })
}

/// Worker processes of `role` the recipe asks for: `cluster.*_workers` with the local launcher,
/// the pools' workers with Ray (0: the role runs in this process).
fn worker_count(cluster: &crate::recipe::ClusterSection, role: Role) -> usize {
    match cluster.launcher {
        crate::recipe::Launcher::Local => match role {
            Role::Rollout => cluster.rollout_workers,
            Role::Reward => cluster.reward_workers,
            Role::Learner => cluster.learner_workers,
        },
        crate::recipe::Launcher::Ray => cluster.pool_worker_count(role),
    }
}

/// The error of a failed call to the learner worker `worker`: which worker, why, and where the
/// next `grpo run` resumes (`last_checkpoint`).
fn learner_worker_failed(worker: &WorkerInfo, error: RoleError, last_checkpoint: Option<&Path>) -> RunError {
    RunError::LearnerWorker {
        worker: format!(
            "learner worker {} (pid {}, log {})",
            worker.index,
            worker.pid,
            worker.log.display()
        ),
        error,
        resume: match last_checkpoint {
            Some(dir) => format!("from its newest checkpoint, {}", dir.display()),
            None => "from the start (no checkpoint was saved yet)".to_string(),
        },
    }
}

/// A step's samples with their scores, in (request id, sample index) order.
pub(crate) struct Generated {
    pub scored: Vec<Scored>,
    pub indices: Vec<u64>,
    pub epoch: u64,
    pub prompt_tokens: usize,
    /// From the first request sent to the last sample received.
    pub gen_s: f64,
    /// Scoring time after the last sample arrived (the part not hidden behind generation).
    pub reward_tail_s: f64,
    pub rollout_failures: usize,
    pub reward_failures: usize,
    pub reissued: usize,
}

async fn generate(fleet: Arc<Fleet>, prompts: StepPrompts, epoch: u64) -> Result<Generated, RunError> {
    let outcome = fleet.generate_and_score(prompts.requests, prompts.metas).await?;
    Ok(Generated {
        scored: outcome.scored,
        indices: prompts.indices,
        epoch,
        prompt_tokens: prompts.prompt_tokens,
        gen_s: outcome.gen_s,
        reward_tail_s: outcome.reward_tail_s,
        rollout_failures: outcome.rollout_failures,
        reward_failures: outcome.reward_failures,
        reissued: outcome.reissued,
    })
}

/// Generates for every validation prompt (`rollout.val_kwargs`) and scores: `val/accuracy` is
/// the mean of the scorers' `acc` where they report one, else of the reward. Every response
/// with its score goes to `OUTPUT/validation/step_N.jsonl`.
async fn validate(
    recipe: &Recipe,
    prepared: &Prepared,
    fleet: &Arc<Fleet>,
    step: u64,
    output: &Path,
) -> Result<Metrics, RunError> {
    let dataset = prepared
        .validation
        .as_ref()
        .expect("validation is due only with val_files");
    // In batches of `data.val_batch_size` prompts (the whole set by default), in the order
    // `data.validation_shuffle` gives. A request's id, and so its seed, is its row's position,
    // so neither changes what is sampled.
    let mut sampler = dataset.validation_sampler(&recipe.data)?;
    let mut scored = Vec::new();
    let mut rows: HashMap<u64, u64> = HashMap::new();
    for _ in 0..sampler.batches_per_epoch() {
        let batch = sampler.next_batch();
        let prompts = build_prompts(
            recipe,
            prepared,
            dataset,
            &batch.positions,
            |i| VALIDATION_ID | (step << 24) | batch.positions[i],
            true,
        )?;
        rows.extend(prompts.requests.iter().map(|r| r.id).zip(prompts.indices));
        let visit: HashMap<u64, usize> = prompts
            .requests
            .iter()
            .enumerate()
            .map(|(k, r)| (r.id, k))
            .collect();
        let mut outcome = fleet.generate_and_score(prompts.requests, prompts.metas).await?;
        // The file lists the rows in the order they were visited.
        outcome
            .scored
            .sort_by_key(|s| (visit[&s.sample.request_id], s.sample.sample_index));
        scored.extend(outcome.scored);
    }
    let acc: Vec<f64> = scored
        .iter()
        .map(|s| s.score.extras.get("acc").copied().unwrap_or(s.score.score))
        .collect();
    let rewards: Vec<f64> = scored.iter().map(|s| s.score.score).collect();
    let lengths: Vec<f64> = scored
        .iter()
        .map(|s| s.sample.response_ids.len() as f64)
        .collect();
    let dir = output.join("validation");
    std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
    let path = dir.join(format!("step_{step}.jsonl"));
    let lines: String = scored
        .iter()
        .map(|s| {
            let line = serde_json::json!({
                "row": rows[&s.sample.request_id],
                "sample": s.sample.sample_index,
                "response": s.sample.text,
                "score": s.score.score,
                "extras": s.score.extras,
                "error": s.score.error,
            });
            format!("{line}\n")
        })
        .collect();
    std::fs::write(&path, lines).map_err(io("writing", &path))?;
    let mut m = Metrics::new();
    m.insert("val/accuracy".into(), mean_std(&acc).0);
    m.insert("val/reward/mean".into(), mean_std(&rewards).0);
    m.insert("val/response_length/mean".into(), mean_std(&lengths).0);
    m.insert("val/samples".into(), acc.len() as f64);
    Ok(m)
}
