//! The `ray` launcher: every worker is a Ray job, placed by an existing Ray cluster into the
//! recipe's `cluster.pools`.
//!
//! The orchestrator does not know where Ray will run a job, so the workers dial back:
//! 1. before any work, the pools' resource requests are checked against the resources the
//!    cluster reports ([`check_pools`]); a pool asking for a resource the cluster has never had
//!    fails the run with the cluster's resources in the message;
//! 2. the orchestrator serves the [`Registry`] and submits one job per worker
//!    through Ray's Job Submission REST API ([`jobs`]) with the pool's
//!    `entrypoint_num_cpus`, `entrypoint_num_gpus` and `entrypoint_resources`. The entrypoint is
//!    `cd CWD && exec GRPO worker --role ROLE ... --connect REGISTRY --worker-id ID --pool POOL`:
//!    the binary, recipe, token file and the recipe's relative paths must be reachable at the
//!    same paths on the nodes (a shared path, or Ray's `runtime_env`; see docs/ray.md);
//! 3. the worker builds its role, listens, and registers its address, devices and version; from
//!    then on it is called exactly like a local worker (`Worker.Health`, the role services);
//! 4. job status is polled: a job that fails, is stopped or disappears, or a worker that stops
//!    answering, is resubmitted as a new job (attempt `a2`, `a3`, ... up to
//!    `cluster.ray.max_resubmits` times) while the fleet re-issues its unfinished work;
//! 5. every job is stopped when the run ends, fails or is interrupted, and its Ray log is copied
//!    to `OUTPUT/logs/ROLE-INDEX.log`. A worker whose orchestrator vanishes (SIGKILL) stops by
//!    itself when its heartbeat goes unanswered.

pub mod jobs;
pub mod registry;

use super::{health_check, log_tail, LaunchError, LaunchSpec, WorkerInfo};
use crate::auth::Token;
use crate::recipe::{ClusterSection, PoolSection, PoolWorker, RaySection};
use crate::roles::Role;
use crate::transport;
use jobs::{format_resources, total_resources, JobRequest, JobStatus, RayJobs, RayNode};
use registry::{Registration, Registry, RegistryError, RegistryServer};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Why a Ray launch failed (wrapped in [`LaunchError::Ray`]).
#[derive(Debug, thiserror::Error)]
pub enum RayLaunchError {
    #[error("the Ray cluster at {address}: {source}")]
    Jobs {
        address: String,
        #[source]
        source: jobs::RayJobsError,
    },
    #[error(
        "`cluster.pools` pool `{pool}` asks for {amount} {resource} per worker, but the Ray \
         cluster at {address} {has}; its live nodes have: {available}"
    )]
    MissingResource {
        pool: String,
        resource: String,
        amount: f64,
        address: String,
        /// "has no `TPU` resource" or "has no node with all of CPU 1, TPU 8 at once".
        has: String,
        available: String,
    },
    /// The registry could not be served, or refused a worker (another grpo version).
    #[error("worker registry: {0}")]
    Registry(String),
    #[error(
        "{role} worker {index} (pool `{pool}`, Ray job {job}) ended {status} before it \
         registered{message}; last lines of its log {log}:\n{tail}"
    )]
    EndedBeforeRegistering {
        role: &'static str,
        index: usize,
        pool: String,
        job: String,
        status: String,
        message: String,
        log: String,
        tail: String,
    },
    #[error(
        "{role} worker {index} (pool `{pool}`, Ray job {job}) did not register within {waited_s} s \
         (the job is {status}{hint})"
    )]
    NotRegistered {
        role: &'static str,
        index: usize,
        pool: String,
        job: String,
        status: String,
        hint: String,
        waited_s: f64,
    },
    #[error(
        "{role} worker {index} (pool `{pool}`) failed {attempts} times; `cluster.ray.max_resubmits` \
         ({max}) allows no more resubmissions; see {log}"
    )]
    GaveUp {
        role: &'static str,
        index: usize,
        pool: String,
        attempts: usize,
        max: usize,
        log: String,
    },
}

/// What the Ray launcher needs besides what every launcher needs ([`LaunchSpec`]).
#[derive(Clone, Debug)]
pub struct RaySpec {
    /// `cluster.ray`.
    pub ray: RaySection,
    /// One entry per worker: its role, its index among that role's workers, and its pool.
    pub workers: Vec<(Role, usize, PoolSection)>,
    /// The directory the workers run in (this process's working directory: the recipe's
    /// relative paths are relative to it).
    pub workdir: PathBuf,
}

impl RaySpec {
    /// The spec for a run from its recipe's `cluster` section; None unless it has a
    /// `cluster.ray` section (which validation requires with `launcher: ray`).
    pub fn from_cluster(cluster: &ClusterSection, workdir: PathBuf) -> Option<RaySpec> {
        Some(RaySpec {
            ray: cluster.ray.clone()?,
            workers: cluster
                .pool_workers()
                .into_iter()
                .map(|w| (w.role, w.index, w.pool.clone()))
                .collect(),
            workdir,
        })
    }

    /// `cluster.ray.poll_interval_s`: how often the jobs' statuses are asked for, both while a
    /// worker starts and while the run watches for ended jobs.
    pub fn poll_interval(&self) -> Duration {
        Duration::from_secs_f64(self.ray.poll_interval_s.max(0.05))
    }
}

/// Polls spaced by an interval. Each poll asks Ray for every watched job's status: a short
/// interval finds an ended job sooner and costs the Ray head more requests.
struct PollEvery {
    every: Duration,
    last: Mutex<Instant>,
}

impl PollEvery {
    /// The first poll is due `every` from now.
    fn new(every: Duration) -> PollEvery {
        PollEvery {
            every,
            last: Mutex::new(Instant::now()),
        }
    }

    /// Whether a poll is due now; when it is, the next is due `every` from now.
    fn due(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() < self.every {
            return false;
        }
        *last = Instant::now();
        true
    }
}

/// One worker slot: the job now serving it and what it registered.
struct Slot {
    role: Role,
    index: usize,
    pool: PoolSection,
    /// Submissions so far (1 after the first).
    attempts: usize,
    /// The Ray submission id of the current job.
    job: String,
    /// Set once the job's worker registered and answered its health check.
    running: Option<(WorkerInfo, Registration)>,
    /// The job's status was seen to be terminal (it is being or has been replaced).
    ended: bool,
}

impl Slot {
    fn worker_id(&self) -> String {
        PoolWorker {
            pool: &self.pool,
            role: self.role,
            index: self.index,
        }
        .worker_id(self.attempts)
    }
}

/// Worker processes as Ray jobs. See the module docs.
pub struct RayLauncher {
    spec: LaunchSpec,
    ray: RaySpec,
    jobs: RayJobs,
    registry: RegistryServer,
    token: Token,
    /// Distinguishes this run's jobs in the cluster: `grpo-RUN-ROLE-INDEX-aATTEMPT`.
    run_id: String,
    slots: Mutex<Vec<Slot>>,
    /// Set by [`shutdown`](Self::shutdown); dropping an unstopped launcher stops its jobs.
    stopped: std::sync::atomic::AtomicBool,
    job_polls: PollEvery,
}

impl RayLauncher {
    /// Check the pools against the cluster, serve the registry, submit every worker's job and
    /// wait until each has registered and answers its health check. On failure every job
    /// already submitted is stopped.
    pub async fn start(spec: LaunchSpec, ray: RaySpec) -> Result<RayLauncher, LaunchError> {
        let token = Token::read(&spec.token_file)?;
        std::fs::create_dir_all(&spec.log_dir).map_err(|source| LaunchError::Log {
            path: spec.log_dir.display().to_string(),
            source,
        })?;
        let address = ray.ray.address.clone();
        let jobs_error = |source| RayLaunchError::Jobs {
            address: address.clone(),
            source,
        };
        let jobs = RayJobs::new(&address).map_err(jobs_error)?;
        jobs.version().await.map_err(jobs_error)?;
        let nodes = jobs.nodes().await.map_err(jobs_error)?;
        check_pools(&address, ray.workers.iter().map(|(_, _, p)| p), &nodes)?;
        let registry = Registry::serve(
            &ray.ray.orchestrator_host,
            token.clone(),
            spec.tls.as_ref(),
            env!("CARGO_PKG_VERSION"),
        )
        .await
        .map_err(|e| RayLaunchError::Registry(format!("cannot serve it: {e}")))?;
        let run_id: String = {
            let bytes: [u8; 4] = rand::random();
            bytes.iter().map(|b| format!("{b:02x}")).collect()
        };
        let slots = ray
            .workers
            .iter()
            .map(|(role, index, pool)| Slot {
                role: *role,
                index: *index,
                pool: pool.clone(),
                attempts: 0,
                job: String::new(),
                running: None,
                ended: false,
            })
            .collect();
        let job_polls = PollEvery::new(ray.poll_interval());
        let launcher = RayLauncher {
            spec,
            ray,
            jobs,
            registry,
            token,
            run_id,
            slots: Mutex::new(slots),
            stopped: std::sync::atomic::AtomicBool::new(false),
            job_polls,
        };
        let keys: Vec<(Role, usize)> = launcher.lock().iter().map(|s| (s.role, s.index)).collect();
        let mut submitted = Vec::new();
        for &(role, index) in &keys {
            submitted.push(launcher.submit(role, index).await?);
        }
        // They boot in parallel; waiting in turn costs the slowest one's time, not the sum.
        for (role, index, worker_id, job) in submitted {
            let (info, registration) = launcher.until_healthy(role, index, &worker_id, &job).await?;
            tracing::info!(
                role = role.name(),
                index,
                address = %info.address,
                host = %registration.hostname,
                job = %job,
                "worker registered"
            );
            launcher.set_running(role, index, info, registration);
        }
        Ok(launcher)
    }

    /// The running workers of `role`, by index.
    pub fn workers(&self, role: Role) -> Vec<WorkerInfo> {
        let mut workers: Vec<WorkerInfo> = self
            .lock()
            .iter()
            .filter(|s| s.role == role)
            .filter_map(|s| s.running.as_ref().map(|(info, _)| info.clone()))
            .collect();
        workers.sort_by_key(|w| w.index);
        workers
    }

    /// Where each worker landed, one line per worker, for `grpo run` to print.
    pub fn placements(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter_map(|s| {
                let (info, reg) = s.running.as_ref()?;
                let devices = reg.devices_text();
                Some(format!(
                    "{} worker {} -> pool `{}`, host {} pid {}, {}, at {} (Ray job {})",
                    s.role.name(),
                    s.index,
                    s.pool.name,
                    reg.hostname,
                    reg.pid,
                    devices,
                    info.address,
                    s.job
                ))
            })
            .collect()
    }

    /// Workers whose Ray job has ended (failed, stopped, succeeded) or disappeared since the last
    /// call, found by polling the jobs at most every `cluster.ray.poll_interval_s`. The fleet
    /// treats them as dead: their work is re-issued and they are [`restart`](Self::restart)ed.
    pub async fn ended_jobs(&self) -> Vec<(Role, usize)> {
        if !self.job_polls.due() {
            return Vec::new();
        }
        let watched: Vec<(Role, usize, String)> = self
            .lock()
            .iter()
            .filter(|s| s.running.is_some() && !s.ended)
            .map(|s| (s.role, s.index, s.job.clone()))
            .collect();
        let mut ended = Vec::new();
        for (role, index, job) in watched {
            let gone = match self.jobs.info(&job).await {
                Ok(info) => info.status.is_terminal(),
                Err(e) if e.is_not_found() => true,
                Err(e) => {
                    tracing::warn!("cannot poll Ray job {job}: {e}");
                    false
                }
            };
            if gone {
                let mut slots = self.lock();
                if let Some(slot) = slots.iter_mut().find(|s| s.job == job) {
                    slot.ended = true;
                    tracing::warn!(role = role.name(), index, job = %job, "the worker's Ray job ended");
                    ended.push((role, index));
                }
            }
        }
        ended
    }

    /// Replace a worker: stop its job if it is still there, submit a new one (the next attempt)
    /// and wait until it registers and is healthy. Fails once the slot has been resubmitted
    /// `cluster.ray.max_resubmits` times.
    pub async fn restart(&self, role: Role, index: usize) -> Result<WorkerInfo, LaunchError> {
        let (old_job, old_id, attempts, pool) = {
            let mut slots = self.lock();
            let slot = slots
                .iter_mut()
                .find(|s| s.role == role && s.index == index)
                .ok_or_else(|| LaunchError::UnknownWorker {
                    role: role.name(),
                    index,
                    count: 0,
                })?;
            slot.running = None;
            (
                slot.job.clone(),
                slot.worker_id(),
                slot.attempts,
                slot.pool.name.clone(),
            )
        };
        if let Err(e) = self.jobs.stop(&old_job).await {
            if !e.is_not_found() {
                tracing::warn!("cannot stop Ray job {old_job}: {e}");
            }
        }
        self.registry.forget(&old_id);
        self.save_log(role, index, &old_job, attempts).await;
        let max = self.ray.ray.max_resubmits;
        if attempts > max {
            return Err(RayLaunchError::GaveUp {
                role: role.name(),
                index,
                pool,
                attempts,
                max,
                log: self.log_path(role, index).display().to_string(),
            }
            .into());
        }
        tracing::warn!(role = role.name(), index, old = %old_job, "resubmitting the worker's Ray job");
        let (_, _, worker_id, job) = self.submit(role, index).await?;
        let (info, registration) = self.until_healthy(role, index, &worker_id, &job).await?;
        tracing::info!(role = role.name(), index, job = %job, host = %registration.hostname, "worker resubmitted");
        self.set_running(role, index, info.clone(), registration);
        Ok(info)
    }

    /// Stop every job and copy its log to `LOG_DIR/ROLE-INDEX.log`. Returns the workers whose
    /// job had not ended `grace` after the stop request (Ray kills those itself).
    pub async fn shutdown(&self, grace: Duration) -> Vec<WorkerInfo> {
        self.stopped.store(true, std::sync::atomic::Ordering::SeqCst);
        let slots: Vec<(Role, usize, String, usize, Option<WorkerInfo>)> = self
            .lock()
            .iter()
            .filter(|s| !s.job.is_empty())
            .map(|s| {
                (
                    s.role,
                    s.index,
                    s.job.clone(),
                    s.attempts,
                    s.running.as_ref().map(|(i, _)| i.clone()),
                )
            })
            .collect();
        for (_, _, job, _, _) in &slots {
            if let Err(e) = self.jobs.stop(job).await {
                if !e.is_not_found() {
                    tracing::warn!("cannot stop Ray job {job}: {e}");
                }
            }
        }
        let deadline = Instant::now() + grace;
        let mut lingering = Vec::new();
        for (role, index, job, attempts, info) in slots {
            loop {
                let ended = match self.jobs.info(&job).await {
                    Ok(info) => info.status.is_terminal(),
                    Err(_) => true,
                };
                if ended {
                    break;
                }
                if Instant::now() >= deadline {
                    lingering.extend(info.clone());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            self.save_log(role, index, &job, attempts).await;
        }
        lingering
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_running(&self, role: Role, index: usize, info: WorkerInfo, registration: Registration) {
        if let Some(slot) = self
            .lock()
            .iter_mut()
            .find(|s| s.role == role && s.index == index)
        {
            slot.running = Some((info, registration));
            slot.ended = false;
        }
    }

    fn log_path(&self, role: Role, index: usize) -> PathBuf {
        self.spec.log_dir.join(format!("{}-{index}.log", role.name()))
    }

    /// Submit the next attempt of a slot's job. Returns (role, index, worker id, submission id).
    async fn submit(&self, role: Role, index: usize) -> Result<(Role, usize, String, String), LaunchError> {
        let (worker_id, job, pool) = {
            let mut slots = self.lock();
            let slot = slots
                .iter_mut()
                .find(|s| s.role == role && s.index == index)
                .expect("every slot is made at start");
            slot.attempts += 1;
            slot.job = format!("grpo-{}-{}", self.run_id, slot.worker_id());
            slot.ended = false;
            (slot.worker_id(), slot.job.clone(), slot.pool.clone())
        };
        let request = JobRequest {
            submission_id: job.clone(),
            entrypoint: self.entrypoint(role, &pool, &worker_id),
            entrypoint_num_cpus: pool.num_cpus,
            entrypoint_num_gpus: pool.num_gpus,
            entrypoint_resources: pool.resources.clone(),
            runtime_env: self.ray.ray.runtime_env.clone().map(serde_json::Value::Object),
            metadata: BTreeMap::from([
                ("grpo_run".to_string(), self.run_id.clone()),
                ("role".to_string(), role.name().to_string()),
                ("index".to_string(), index.to_string()),
                ("pool".to_string(), pool.name.clone()),
                (
                    "grpo_output".to_string(),
                    self.spec
                        .log_dir
                        .parent()
                        .unwrap_or(Path::new(""))
                        .display()
                        .to_string(),
                ),
            ]),
        };
        self.jobs
            .submit(&request)
            .await
            .map_err(|source| RayLaunchError::Jobs {
                address: self.ray.ray.address.clone(),
                source,
            })?;
        tracing::info!(role = role.name(), index, pool = %pool.name, job = %job, "submitted the worker's Ray job");
        Ok((role, index, worker_id, job))
    }

    /// `cd CWD && exec GRPO worker ...`, every part shell-quoted (Ray runs it with a shell).
    fn entrypoint(&self, role: Role, pool: &PoolSection, worker_id: &str) -> String {
        let mut args: Vec<String> = vec![
            self.spec.program.display().to_string(),
            "worker".into(),
            "--role".into(),
            role.name().into(),
            "--recipe".into(),
            self.spec.recipe.display().to_string(),
            "--token-file".into(),
            self.spec.token_file.display().to_string(),
            "--listen".into(),
            "0.0.0.0:0".into(),
            "--connect".into(),
            self.registry.address(),
            "--worker-id".into(),
            worker_id.into(),
            "--pool".into(),
            pool.name.clone(),
        ];
        for set in pool_overrides(pool) {
            args.push("--set".into());
            args.push(set);
        }
        format!(
            "cd {} && exec {}",
            shell_quote(&self.ray.workdir.display().to_string()),
            args.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" ")
        )
    }

    /// Wait until the job's worker registers (watching the job meanwhile), then until it
    /// answers its health check, within the start timeout.
    async fn until_healthy(
        &self,
        role: Role,
        index: usize,
        worker_id: &str,
        job: &str,
    ) -> Result<(WorkerInfo, Registration), LaunchError> {
        let started = Instant::now();
        let deadline = started + self.spec.start_timeout;
        let poll = self.ray.poll_interval();
        let pool = self.pool_name(role, index);
        let registration = loop {
            match self.registry.wait_for(worker_id, poll).await {
                Ok(registration) => break registration,
                Err(e @ RegistryError::WasRefused { .. }) => {
                    let _ = self.jobs.stop(job).await;
                    return Err(RayLaunchError::Registry(format!(
                        "{} worker {index} (pool `{pool}`, Ray job {job}): {e}",
                        role.name()
                    ))
                    .into());
                }
                Err(_) => {
                    let status = match self.jobs.info(job).await {
                        Ok(info) => info,
                        Err(source) => {
                            return Err(RayLaunchError::Jobs {
                                address: self.ray.ray.address.clone(),
                                source,
                            }
                            .into())
                        }
                    };
                    if status.status.is_terminal() {
                        let attempts = self.attempts(role, index);
                        let log = self.save_log(role, index, job, attempts).await;
                        return Err(RayLaunchError::EndedBeforeRegistering {
                            role: role.name(),
                            index,
                            pool,
                            job: job.to_string(),
                            status: status.status.name().to_string(),
                            message: status
                                .message
                                .filter(|m| !m.is_empty())
                                .map(|m| format!(" ({m})"))
                                .unwrap_or_default(),
                            log: log.0.display().to_string(),
                            tail: log_tail(&log.0, log.1),
                        }
                        .into());
                    }
                    if Instant::now() >= deadline {
                        let _ = self.jobs.stop(job).await;
                        let hint = if status.status == JobStatus::Pending {
                            "; Ray has not found a node with the pool's resources free".to_string()
                        } else {
                            String::new()
                        };
                        return Err(RayLaunchError::NotRegistered {
                            role: role.name(),
                            index,
                            pool,
                            job: job.to_string(),
                            status: status.status.name().to_string(),
                            hint,
                            waited_s: self.spec.start_timeout.as_secs_f64(),
                        }
                        .into());
                    }
                }
            }
        };
        let info = WorkerInfo {
            role,
            index,
            address: registration.address.clone(),
            pid: registration.pid,
            log: self.log_path(role, index),
        };
        let channel = transport::channel(&info.address, self.spec.tls.as_ref())?;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let attempt = self
                .spec
                .health_timeout
                .min(remaining)
                .max(Duration::from_millis(10));
            let error = match health_check(&self.token, &info, channel.clone(), attempt).await {
                Ok(_) => return Ok((info, registration)),
                Err(e @ LaunchError::Foreign { .. }) => return Err(e),
                Err(e) => e,
            };
            if Instant::now() + Duration::from_millis(50) >= deadline {
                return Err(LaunchError::NeverHealthy {
                    role: role.name(),
                    index,
                    waited_s: self.spec.start_timeout.as_secs_f64(),
                    message: error.to_string(),
                    log: format!("Ray job {job}"),
                    tail: String::new(),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn pool_name(&self, role: Role, index: usize) -> String {
        self.lock()
            .iter()
            .find(|s| s.role == role && s.index == index)
            .map(|s| s.pool.name.clone())
            .unwrap_or_default()
    }

    fn attempts(&self, role: Role, index: usize) -> usize {
        self.lock()
            .iter()
            .find(|s| s.role == role && s.index == index)
            .map_or(0, |s| s.attempts)
    }

    /// Append the Ray log of `job` to `LOG_DIR/ROLE-INDEX.log` under a header line. Returns the
    /// file and the offset where this job's part starts.
    async fn save_log(&self, role: Role, index: usize, job: &str, attempt: usize) -> (PathBuf, u64) {
        let path = self.log_path(role, index);
        let text = match self.jobs.logs(job).await {
            Ok(text) => text,
            Err(e) => format!("(cannot fetch the Ray job's log: {e})\n"),
        };
        let offset = append_log(&path, &format!("--- Ray job {job} (attempt {attempt})\n"), &text);
        (path, offset)
    }
}

impl Drop for RayLauncher {
    /// An unstopped launcher (an error unwinding) stops its jobs before it goes.
    fn drop(&mut self) {
        if self.stopped.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let jobs: Vec<String> = self
            .lock()
            .iter()
            .map(|s| s.job.clone())
            .filter(|j| !j.is_empty())
            .collect();
        let client = self.jobs.clone();
        // Its own thread and runtime: this may run inside (or outside) a tokio runtime.
        let stopper = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            runtime.block_on(async {
                for job in jobs {
                    let _ = tokio::time::timeout(Duration::from_secs(5), client.stop(&job)).await;
                }
            });
        });
        let _ = stopper.join();
    }
}

/// Checks that every pool's per-worker request can ever be met: each resource it asks for is one
/// the cluster reports, and one live node has all of it at once (Ray places a job on one node).
pub fn check_pools<'a>(
    address: &str,
    pools: impl IntoIterator<Item = &'a PoolSection>,
    nodes: &[RayNode],
) -> Result<(), RayLaunchError> {
    let totals = total_resources(nodes);
    for pool in pools {
        let mut asks = pool.resources.clone();
        for (name, amount) in [("CPU", pool.num_cpus), ("GPU", pool.num_gpus)] {
            asks.insert(name.to_string(), amount);
        }
        asks.retain(|_, amount| *amount > 0.0);
        if nodes.iter().any(|n| n.is_alive() && n.could_fit(&asks)) {
            continue;
        }
        // Name a resource the cluster lacks altogether, else the largest of the request.
        let (resource, amount) = asks
            .iter()
            .find(|(name, _)| !totals.contains_key(*name))
            .or_else(|| asks.iter().max_by(|a, b| a.1.total_cmp(b.1)))
            .map(|(name, amount)| (name.clone(), *amount))
            .expect("a request that no node fits asks for something");
        let has = match totals.get(&resource) {
            None => format!("has no `{resource}` resource"),
            Some(_) => format!("has no node with all of {} at once", format_resources(&asks)),
        };
        return Err(RayLaunchError::MissingResource {
            pool: pool.name.clone(),
            resource,
            amount,
            address: address.to_string(),
            has,
            available: nodes
                .iter()
                .filter(|n| n.is_alive())
                .map(|n| format!("[{}: {}]", n.node_ip, format_resources(&n.resources_total)))
                .collect::<Vec<_>>()
                .join(" "),
        });
    }
    Ok(())
}

/// The `--set` overrides that make a pool's worker open the pool's device kind, whatever
/// `cluster.device` says (the worker's own recipe then has every role on that device).
fn pool_overrides(pool: &PoolSection) -> Vec<String> {
    vec![
        format!("cluster.device={}", pool.device.kind().name()),
        "cluster.rollout_device=".to_string(),
        "cluster.learner_device=".to_string(),
        "cluster.plugin_path=".to_string(),
    ]
}

/// Append `header` and `text` to the log at `path`; returns the offset where `header` starts.
fn append_log(path: &Path, header: &str, text: &str) -> u64 {
    let result = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| {
            let offset = f.metadata()?.len();
            f.write_all(header.as_bytes())?;
            f.write_all(text.as_bytes())?;
            Ok(offset)
        });
    result.unwrap_or_else(|e| {
        tracing::warn!("cannot write {}: {e}", path.display());
        0
    })
}

/// `text` as one POSIX shell word.
fn shell_quote(text: &str) -> String {
    if !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@,+".contains(c))
    {
        return text.to_string();
    }
    format!("'{}'", text.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(yaml: &str) -> PoolSection {
        serde_yaml::from_str(yaml).unwrap()
    }

    /// A pool's worker opens the pool's device kind, whatever the recipe's devices say.
    #[test]
    fn a_pools_workers_open_its_device() {
        let tpu = pool_overrides(&pool("{name: t, device: tpu, roles: [rollout]}"));
        assert_eq!(tpu[0], "cluster.device=tpu");
        let cpu = pool_overrides(&pool("{name: c, roles: [reward]}"));
        assert_eq!(cpu[0], "cluster.device=cpu");
        assert_eq!(&tpu[1..], &cpu[1..]);
    }

    #[test]
    fn shell_words_survive_spaces_and_quotes() {
        assert_eq!(shell_quote("/opt/grpo/bin/grpo"), "/opt/grpo/bin/grpo");
        assert_eq!(shell_quote("cluster.device=cpu"), "cluster.device=cpu");
        assert_eq!(shell_quote("my run/recipe.yaml"), "'my run/recipe.yaml'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("cluster.plugin_path="), "cluster.plugin_path=");
    }

    /// `cluster.ray.poll_interval_s` spaces the polls for ended jobs.
    #[test]
    fn job_polls_are_spaced_by_the_poll_interval() {
        let cluster: ClusterSection = serde_yaml::from_str(
            "{launcher: ray, ray: {address: 'http://127.0.0.1:8265', poll_interval_s: 0.3}, \
             pools: [{name: a, roles: [rollout, reward, learner]}]}",
        )
        .unwrap();
        let spec = RaySpec::from_cluster(&cluster, PathBuf::from(".")).unwrap();
        assert_eq!(spec.poll_interval(), Duration::from_millis(300));
        let polls = PollEvery::new(spec.poll_interval());
        assert!(!polls.due(), "a poll right after the launch");
        std::thread::sleep(Duration::from_millis(320));
        assert!(polls.due());
        assert!(!polls.due(), "two polls within the interval");
        std::thread::sleep(Duration::from_millis(150));
        assert!(!polls.due(), "two polls within the interval");
        std::thread::sleep(Duration::from_millis(170));
        assert!(polls.due());
    }

    fn node(ip: &str, resources: &[(&str, f64)]) -> RayNode {
        RayNode {
            node_id: format!("id-{ip}"),
            node_ip: ip.to_string(),
            is_head_node: false,
            state: "ALIVE".to_string(),
            resources_total: resources.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            labels: BTreeMap::new(),
        }
    }

    #[test]
    fn pools_no_node_can_ever_take_are_refused_with_what_the_nodes_have() {
        // Two nodes with 4 TPU each: 8 in total, but never 8 on one node.
        let nodes = [
            node("10.0.0.1", &[("CPU", 8.0), ("TPU", 4.0), ("node:10.0.0.1", 1.0)]),
            node("10.0.0.2", &[("CPU", 8.0), ("TPU", 4.0), ("GPU", 2.0)]),
        ];
        let ok = pool("name: tpu\ndevice: tpu\nroles: [rollout]\nnum_cpus: 1\nresources: {TPU: 4}\n");
        let gpu = pool("name: gpu\ndevice: gpu\nroles: [learner]\nnum_gpus: 2\n");
        check_pools("http://h:8265", [&ok, &gpu], &nodes).unwrap();

        let fpga = pool("name: fpga\ndevice: cpu\nroles: [reward]\nresources: {FPGA: 1}\n");
        let e = check_pools("http://h:8265", [&ok, &fpga], &nodes)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "`cluster.pools` pool `fpga` asks for 1 FPGA per worker, but the Ray cluster at \
             http://h:8265 has no `FPGA` resource; its live nodes have: [10.0.0.1: CPU 8, TPU 4] \
             [10.0.0.2: CPU 8, GPU 2, TPU 4]"
        );
        let big = pool("name: big\ndevice: tpu\nroles: [rollout]\nresources: {TPU: 8}\n");
        let e = check_pools("http://h:8265", [&big], &nodes)
            .unwrap_err()
            .to_string();
        assert!(e.contains("asks for 8 TPU per worker"), "{e}");
        assert!(e.contains("has no node with all of CPU 1, TPU 8 at once"), "{e}");
        // A dead node does not count.
        let mut dead = node("10.0.0.3", &[("CPU", 8.0), ("TPU", 8.0)]);
        dead.state = "DEAD".to_string();
        assert!(check_pools("http://h:8265", [&big], &[dead]).is_err());
    }
}
