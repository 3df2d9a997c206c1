//! The roles of a run, put together from the recipe: the worker processes (local launcher or
//! Ray), the learner (in this process or a learner worker), the rollout and reward workers as
//! one [`Fleet`], and the supervisor that replaces failed workers. The step loop sees only
//! [`Assembly`].

use super::dialer::Dialer;
use super::fleet::Fleet;
use super::{io, supervisor, RunError, RunOptions};
use crate::auth::Token;
use crate::launcher::ray::RaySpec;
use crate::launcher::{LaunchSpec, Launcher, LocalLauncher, RayLauncher, WorkerInfo};
use crate::prepare::Prepared;
use crate::recipe::Recipe;
use crate::roles::learner::{
    self, LearnerRole, LearnerStates, LearnerWeights, LocalLearner, RemoteLearner, Synced,
};
use crate::roles::reward::{LocalReward, RewardDeadline, RewardRole};
use crate::roles::rollout::{LocalRollout, RolloutRole, UpdateParams, WeightUpdate};
use crate::roles::{Role, RoleError};
use crate::setup;
use model::ParamSpec;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use trainer::update::{Row, UpdateClocks, UpdateReport};
use xla::runtime::{Client, TransferStats};
use xla::DType;

/// The live roles of a run.
pub(crate) struct Assembly {
    pub fleet: Arc<Fleet>,
    pub learner: LearnerHandle,
    /// The rollout's compute type, which weight updates are sent in.
    rollout_dtype: DType,
    /// Who takes the weight updates: the in-process engine or rollout workers.
    rollout_at: WeightsFor,
    /// What the updates carry: the model's weights, or with LoRA and rollout workers the
    /// adapters alone.
    synced: Synced,
    launcher: Option<Arc<Launcher>>,
    supervisor: Option<tokio::task::JoinHandle<()>>,
}

/// The learner role, in this process or a learner worker, whose failed calls become the run's
/// error.
pub(crate) struct LearnerHandle {
    role: Arc<dyn LearnerRole>,
    /// The learner worker process, when the learner is not in this process.
    worker: Option<WorkerInfo>,
    /// The model's parameter table (what an in-process engine is uploaded).
    model_specs: Arc<[ParamSpec]>,
    /// The trainable parameters' table (with LoRA the adapters').
    specs: Arc<[ParamSpec]>,
}

impl LearnerHandle {
    /// A failed learner call as the run's error: for a learner worker, which worker and where
    /// the next `grpo run` resumes (`last_checkpoint`).
    fn failed(&self, error: RoleError, last_checkpoint: Option<&Path>) -> RunError {
        match &self.worker {
            Some(w) => learner_worker_failed(w, error, last_checkpoint),
            None => RunError::Role(error),
        }
    }

    /// One GRPO update.
    pub async fn update(
        &self,
        rows: Vec<Row>,
        last_checkpoint: Option<&Path>,
    ) -> Result<UpdateReport, RunError> {
        let result = self.role.update(rows).await;
        result.map_err(|e| self.failed(e, last_checkpoint))
    }

    /// The learner's state (the critic's with it), for a checkpoint.
    pub async fn state(&self, last_checkpoint: Option<&Path>) -> Result<LearnerStates, RunError> {
        let result = self.role.state().await;
        result.map_err(|e| self.failed(e, last_checkpoint))
    }

    /// Optimizer steps taken and the in-reward KL coefficient.
    pub fn clocks(&self) -> UpdateClocks {
        self.role.clocks()
    }

    /// The current weights (`what`), for a rollout in `dtype` (f32 for adapters; see
    /// [`rollout_weights`]).
    async fn weights(
        &self,
        client: &Client,
        version: u64,
        (what, dtype): (Synced, DType),
        to: WeightsFor,
        last_checkpoint: Option<&Path>,
    ) -> Result<UpdateParams, RunError> {
        let current = self.role.weights(version, dtype, what).await;
        let current = current.map_err(|e| self.failed(e, last_checkpoint))?;
        let specs = match what {
            Synced::Model => &self.model_specs,
            Synced::Adapters => &self.specs,
        };
        let weights = rollout_weights(current, specs, client, dtype, to)?;
        Ok(match (what, weights) {
            // An in-process engine applying adapters keeps its base and takes these beside it.
            (Synced::Adapters, UpdateParams::Device(w)) if to != WeightsFor::Workers => UpdateParams::Device(
                rollout::EngineWeights::adapters_only(w.per_device().to_vec(), w.tensor_parallel()),
            ),
            (_, weights) => weights,
        })
    }
}

impl Assembly {
    /// Starts the worker processes the recipe asks for and builds every role; the rollout
    /// side holds the learner's weights of `start.version` when it returns. The learner starts
    /// from `start`'s state (or the model's weights) at its optimizer-step clock.
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        recipe: &Recipe,
        options: &RunOptions,
        output: &Path,
        prepared: &mut Prepared,
        client: &Client,
        specs: &[ParamSpec],
        critic_specs: Option<&[ParamSpec]>,
        start: &mut super::checkpoint::Start,
        total_optimizer_steps: u64,
    ) -> Result<Assembly, RunError> {
        let cluster = &recipe.cluster;
        let timeout = Duration::from_secs_f64(cluster.worker_timeout_s);
        let pool = setup::reward_pool(recipe).map_err(|e| RunError::Other(format!("reward: {e}")))?;
        let dialer = Dialer {
            token: Token::generate(),
            tls: cluster.tls.clone(),
            timeout,
            reward_deadline: RewardDeadline::new(timeout, &pool),
        };
        let launcher = start_workers(recipe, options, output, &dialer.token)
            .await?
            .map(Arc::new);
        let workers = |role: Role| -> Vec<WorkerInfo> {
            match &launcher {
                Some(l) if cluster.worker_count(role) > 0 => l.workers(role),
                _ => Vec::new(),
            }
        };

        let learner_worker = match cluster.worker_count(Role::Learner) {
            0 => None,
            _ => Some(
                workers(Role::Learner)
                    .first()
                    .cloned()
                    .ok_or_else(|| RunError::Other("the launcher started no learner worker".into()))?,
            ),
        };
        let rollout_dtype = setup::rollout_dtype(recipe);
        let rollout_tp = recipe.rollout.tensor_model_parallel_size;
        // With LoRA in the applied form an in-process engine holds the frozen base itself and
        // is handed only the adapters, which it applies beside it.
        let applied_here = cluster.worker_count(Role::Rollout) == 0
            && matches!(setup::lora_form(recipe), Some((model::LoraForm::Applied, _)));
        let (role, base) = match &learner_worker {
            Some(w) => {
                let base =
                    match applied_here {
                        true => Some(prepared.upload_rollout_weights(recipe, client).map_err(|e| {
                            RunError::Other(format!("uploading the rollout's LoRA base: {e}"))
                        })?),
                        false => None,
                    };
                let role = remote_learner(
                    w,
                    &dialer,
                    prepared,
                    specs,
                    critic_specs,
                    start,
                    total_optimizer_steps,
                );
                (role.await?, base)
            }
            None => {
                let local = local_learner(recipe, prepared, client, start, total_optimizer_steps)?;
                let base = match applied_here {
                    // The learner's own frozen buffers where the layouts agree (no copy).
                    true => Some(
                        rollout::handoff(client, &local.base_source()?, rollout_dtype, rollout_tp, false)
                            .map_err(|e| {
                                RunError::Other(format!("handing the LoRA base to the rollout: {e}"))
                            })?,
                    ),
                    false => None,
                };
                (Arc::new(local) as Arc<dyn LearnerRole>, base)
            }
        };
        let learner = LearnerHandle {
            role,
            worker: learner_worker,
            model_specs: model::param_table(&prepared.model.weights.config).into(),
            specs: specs.into(),
        };

        // With one-step off-policy the in-process engine generates while the learner updates,
        // so it needs buffers of its own.
        let in_process = WeightsFor::Engine {
            copy: recipe.trainer.off_policy_steps > 0,
            tensor_parallel: rollout_tp,
        };
        let rollout_at = match cluster.worker_count(Role::Rollout) {
            0 => in_process,
            _ => WeightsFor::Workers,
        };
        // A LoRA run's rollout workers hold the base and are sent only the adapters, and so
        // is an in-process engine applying them.
        let synced = match (rollout_at, recipe.actor.lora_rank) {
            (WeightsFor::Workers, 1..) => Synced::Adapters,
            _ if base.is_some() => Synced::Adapters,
            _ => Synced::Model,
        };
        let rollouts: Vec<Arc<dyn RolloutRole>> = match workers(Role::Rollout).as_slice() {
            [] => {
                let sent = (synced, synced_dtype(synced, rollout_dtype));
                let last = start.checkpoint.as_deref();
                let weights = learner
                    .weights(client, start.version, sent, in_process, last)
                    .await?;
                let UpdateParams::Device(weights) = weights else {
                    unreachable!("weights for an in-process engine are on its devices")
                };
                let weights = match &base {
                    Some(base) => base.with_adapters(weights.adapters().to_vec()),
                    None => weights,
                };
                let engine = prepared.rollout_engine(recipe, client, weights, start.version)?;
                vec![Arc::new(LocalRollout::with_environment(
                    engine,
                    prepared.environment.clone(),
                ))]
            }
            remote => remote
                .iter()
                .map(|w| dialer.rollout(&w.address))
                .collect::<Result<_, _>>()?,
        };
        let rewards: Vec<Arc<dyn RewardRole>> = match workers(Role::Reward).as_slice() {
            [] => vec![Arc::new(LocalReward::new(
                Arc::new(prepared.reward.clone()),
                pool,
            ))],
            remote => remote
                .iter()
                .map(|w| dialer.reward(&w.address))
                .collect::<Result<_, _>>()?,
        };
        let fleet = Arc::new(Fleet::new(
            rollouts,
            rewards,
            LaunchSpec::DEFAULT_START_TIMEOUT + timeout,
        ));
        let mut assembly = Assembly {
            fleet,
            learner,
            rollout_dtype,
            rollout_at,
            synced,
            launcher,
            supervisor: None,
        };
        if rollout_at == WeightsFor::Workers {
            // Workers load the model themselves; from here on they take the learner's versions.
            assembly
                .push_weights(client, start.version, start.checkpoint.as_deref())
                .await?;
        }
        // Replace workers that fail, in the background: the others carry on meanwhile.
        assembly.supervisor = assembly
            .launcher
            .clone()
            .map(|launcher| supervisor::spawn(launcher, assembly.fleet.clone(), dialer));
        Ok(assembly)
    }

    /// Sends the learner's current weights (with LoRA and rollout workers its adapters),
    /// stamped `version`, to the rollout side (see [`rollout_weights`]), and returns what that
    /// took.
    pub async fn push_weights(
        &self,
        client: &Client,
        version: u64,
        last_checkpoint: Option<&Path>,
    ) -> Result<SyncCost, RunError> {
        // Nothing else runs on the client during the sync, so this counts its transfers.
        let before = client.transfer_stats();
        let dtype = synced_dtype(self.synced, self.rollout_dtype);
        let params = self
            .learner
            .weights(
                client,
                version,
                (self.synced, dtype),
                self.rollout_at,
                last_checkpoint,
            )
            .await?;
        let sent_bytes = self
            .fleet
            .update_weights(WeightUpdate { version, params })
            .await?;
        Ok(SyncCost {
            host: client.transfer_stats().since(&before),
            sent_bytes,
        })
    }

    /// Stops the supervisor and every worker process.
    pub async fn shutdown(self) {
        if let Some(task) = self.supervisor {
            task.abort();
        }
        if let Some(l) = self.launcher {
            l.shutdown(Duration::from_secs(2)).await;
        }
    }
}

/// The program each worker process runs: `--worker-program`, else with Ray `cluster.ray.binary`
/// (a path every node has), else this `grpo` binary.
fn worker_program(
    cluster: &crate::recipe::ClusterSection,
    options: &RunOptions,
) -> Result<PathBuf, RunError> {
    let binary = cluster.ray.as_ref().and_then(|r| r.binary.as_ref());
    Ok(match (&options.worker_program, binary) {
        (Some(p), _) => p.clone(),
        (None, Some(binary)) if cluster.launcher == crate::recipe::Launcher::Ray => PathBuf::from(binary),
        (None, _) => std::env::current_exe().map_err(io("locating", Path::new("the grpo executable")))?,
    })
}

/// The learner worker `worker` as the learner role, started from `start`'s state (the policy's
/// and the critic's) at its optimizer-step clock. The worker loads the model itself, so this
/// process drops its host copy of the weights.
async fn remote_learner(
    worker: &WorkerInfo,
    dialer: &Dialer,
    prepared: &mut Prepared,
    specs: &[ParamSpec],
    critic_specs: Option<&[ParamSpec]>,
    start: &mut super::checkpoint::Start,
    total_optimizer_steps: u64,
) -> Result<Arc<dyn LearnerRole>, RunError> {
    prepared.model.weights.tensors = Vec::new();
    let mut remote = RemoteLearner::with_timeout(
        &worker.address,
        &dialer.token,
        dialer.tls.as_ref(),
        dialer.timeout,
        specs.to_vec(),
        model::param_table(&prepared.model.weights.config),
    )?;
    if let Some(critic_specs) = critic_specs {
        remote = remote.with_critic(critic_specs.to_vec());
    }
    let critic = start.critic_state.take();
    let resume = start.state.take().map(|policy| LearnerStates { policy, critic });
    remote
        .start(resume, start.clocks, total_optimizer_steps)
        .await
        .map_err(|e| learner_worker_failed(worker, e, start.checkpoint.as_deref()))?;
    Ok(Arc::new(remote))
}

/// The learner in this process, started from `start`'s state or the model's weights. The host
/// copy of the weights moves into it (the rollout shares the learner's device buffers), so the
/// model is held once on the host.
fn local_learner(
    recipe: &Recipe,
    prepared: &mut Prepared,
    client: &Client,
    start: &mut super::checkpoint::Start,
    total_optimizer_steps: u64,
) -> Result<LocalLearner, RunError> {
    let initial = learner::initial_weights(recipe, &mut prepared.model.weights)?;
    Ok(LocalLearner::start(
        client,
        recipe,
        &prepared.model.weights.config,
        initial,
        start.state.take(),
        start.critic_state.take(),
        start.clocks,
        total_optimizer_steps,
    )?)
}

/// Starts the worker processes the recipe asks for (none: every role runs in this process),
/// after writing the token they authenticate with.
async fn start_workers(
    recipe: &Recipe,
    options: &RunOptions,
    output: &Path,
    token: &Token,
) -> Result<Option<Launcher>, RunError> {
    let cluster = &recipe.cluster;
    let roles = [Role::Rollout, Role::Reward, Role::Learner];
    if roles.iter().all(|&role| cluster.worker_count(role) == 0) {
        return Ok(None);
    }
    let token_file = output.join("worker.token");
    token
        .write(&token_file)
        .map_err(|e| RunError::Other(format!("writing the workers' token: {e}")))?;
    let program = worker_program(cluster, options)?;
    let recipe_path = output.join("recipe.yaml");
    let spec = LaunchSpec::from_cluster(cluster, program, recipe_path, token_file, output);
    let counts = format!(
        "{} rollout, {} reward and {} learner worker process(es)",
        cluster.worker_count(Role::Rollout),
        cluster.worker_count(Role::Reward),
        cluster.worker_count(Role::Learner),
    );
    let launcher = match cluster.launcher {
        crate::recipe::Launcher::Local => {
            super::progress_note(
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
            super::progress_note(
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
                super::progress_note(options, &format!("  {line}"));
            }
            Launcher::Ray(launcher)
        }
    };
    Ok(Some(launcher))
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
        resume: super::resume_point(last_checkpoint),
    }
}

/// What a weight sync took.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SyncCost {
    /// The host copies on this process's client.
    pub host: TransferStats,
    /// Bytes of tensor data sent over the network to rollout workers, all together.
    pub sent_bytes: u64,
}

/// The type weight updates carrying `synced` are sent in: the rollout's for the model's
/// weights, f32 for adapters.
fn synced_dtype(synced: Synced, rollout_dtype: DType) -> DType {
    match synced {
        Synced::Model => rollout_dtype,
        Synced::Adapters => DType::F32,
    }
}

/// Who takes a run's weight updates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WeightsFor {
    /// The rollout engine in this process, laid out for its `tensor_parallel` size; `copy`
    /// asks for buffers of its own, not the learner's.
    Engine { copy: bool, tensor_parallel: usize },
    /// Rollout worker processes, which are streamed host bytes.
    Workers,
}

/// Weights for the rollout side in `dtype`. From a learner in this process: its buffers turned
/// into one replica per learner device on the devices ([`rollout::handoff`]: used in place when
/// already replicated in `dtype` and no copy is asked for, else gathered and converted by a
/// compiled program, never through the host); rollout workers stream the first replica. From
/// a learner worker: the streamed host tensors, passed on as they are to rollout workers, or
/// uploaded to this process's devices for its engine (each device its part under tensor
/// parallelism).
fn rollout_weights(
    weights: LearnerWeights,
    specs: &[ParamSpec],
    client: &Client,
    dtype: DType,
    to: WeightsFor,
) -> Result<UpdateParams, RunError> {
    let rt = |e: xla::runtime::Error| RunError::Other(format!("preparing rollout weights: {e}"));
    let (copy, tensor_parallel) = match to {
        WeightsFor::Engine {
            copy,
            tensor_parallel,
        } => (copy, tensor_parallel),
        // Workers are streamed whole tensors from this process's first device.
        WeightsFor::Workers => (false, 1),
    };
    match weights {
        LearnerWeights::Shared(source) => rollout::handoff(client, &source, dtype, tensor_parallel, copy)
            .map(UpdateParams::Device)
            .map_err(|e| RunError::Other(format!("handing the learner's weights to the rollout: {e}"))),
        LearnerWeights::Host(tensors) => {
            if let Some(t) = tensors.iter().find(|t| t.dtype != dtype) {
                return Err(RunError::Other(format!(
                    "the learner sent tensor `{}` as {}, the rollout needs {dtype}",
                    t.name, t.dtype
                )));
            }
            if to == WeightsFor::Workers {
                return Ok(UpdateParams::Host(tensors.into()));
            }
            let tp = tensor_parallel.max(1);
            let devices: Vec<usize> = (0..tp).collect();
            let mut per_device: Vec<Vec<xla::runtime::Buffer>> = devices.iter().map(|_| Vec::new()).collect();
            for (t, spec) in tensors.iter().zip(specs) {
                let parts = rollout::upload_parameter(client, spec, dtype, &t.bytes, &devices).map_err(rt)?;
                for (d, part) in parts.into_iter().enumerate() {
                    per_device[d].push(part);
                }
            }
            let per_device: Vec<Arc<[xla::runtime::Buffer]>> =
                per_device.into_iter().map(Arc::from).collect();
            Ok(UpdateParams::Device(rollout::EngineWeights::laid_out(
                per_device, tp,
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Workers run `--worker-program`, else on Ray `cluster.ray.binary`, else this binary.
    #[test]
    fn workers_run_the_program_asked_for() {
        let recipe = |cluster: &str| {
            crate::recipe::load_recipe_str(
                &format!("model: {{path: m}}\ndata: {{train_files: t.parquet}}\ncluster: {cluster}\n"),
                "r.yaml",
            )
            .unwrap()
            .cluster
        };
        let options = |program: Option<&str>| RunOptions {
            quiet: true,
            worker_program: program.map(PathBuf::from),
        };
        let ray = recipe("{launcher: ray, ray: {address: 'http://h:8265', binary: /shared/grpo}}");
        let here = std::env::current_exe().unwrap();
        assert_eq!(
            worker_program(&ray, &options(None)).unwrap(),
            PathBuf::from("/shared/grpo")
        );
        assert_eq!(
            worker_program(&ray, &options(Some("wrap.sh"))).unwrap(),
            PathBuf::from("wrap.sh")
        );
        assert_eq!(
            worker_program(&recipe("{rollout_workers: 1}"), &options(None)).unwrap(),
            here
        );
        let ray_without = recipe("{launcher: ray, ray: {address: 'http://h:8265'}}");
        assert_eq!(worker_program(&ray_without, &options(None)).unwrap(), here);
    }
}
