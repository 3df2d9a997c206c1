//! The `local` launcher: worker processes on this host, started, health-checked, restarted and
//! stopped by the orchestrator.
//!
//! Each worker is `PROGRAM worker --role ROLE --recipe RECIPE --listen BIND_HOST:0 --token-file
//! FILE`. The launcher reads `listening on ADDRESS` from the worker's stdout, then calls
//! `Worker.Health` with the run's token until the worker answers with the role it was started
//! for. A worker's stderr (and anything else it prints on stdout) goes to `LOG_DIR/ROLE-INDEX.log`;
//! when a worker fails to start, the error quotes the last lines it logged.
//!
//! No worker outlives the orchestrator:
//! - [`LocalLauncher::shutdown`] asks every worker to stop (SIGTERM), then kills the stragglers;
//! - dropping the [`LocalLauncher`] (an error unwinding, the end of `main`) kills and reaps every
//!   worker;
//! - on Linux each worker is started with `PR_SET_PDEATHSIG = SIGKILL`, so the kernel kills it
//!   when the orchestrator dies for any reason, SIGKILL included. The death signal fires when the
//!   *thread* that forked the worker ends, so all workers are forked by one thread the launcher
//!   owns for its whole life (never a short-lived tokio blocking thread).
//!
//! Workers run in their own process group, so a Ctrl-C in the terminal reaches only the
//! orchestrator, which stops them in order (and if it does not, the death signal does).

use crate::auth::{Token, TokenError};
use crate::proto;
use crate::recipe::{ClusterSection, DeviceKind, TlsSection};
use crate::transport::{self, TransportError};
use crate::worker::Role;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use xla::runtime::PluginKind;

/// Lines of a worker's log quoted in an error about it.
const LOG_TAIL_LINES: usize = 20;

/// What to start and how.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    /// The `grpo` binary (`std::env::current_exe()` in `grpo run`).
    pub program: PathBuf,
    /// The run's resolved recipe file (overrides already applied); every worker builds its role
    /// from it.
    pub recipe: PathBuf,
    /// The file holding the run's token (see [`Token::write`]).
    pub token_file: PathBuf,
    /// The address workers listen on (`cluster.bind_host`); each picks a free port.
    pub bind_host: String,
    /// `cluster.tls`: workers serve TLS and the launcher's health checks use it.
    pub tls: Option<TlsSection>,
    /// Where `ROLE-INDEX.log` files go (e.g. `OUTPUT/logs`); created if missing.
    pub log_dir: PathBuf,
    /// How many workers of each role.
    pub workers: Vec<(Role, usize)>,
    /// Recipe overrides (`KEY=VALUE`, passed as `--set KEY=VALUE`) for the workers of a role,
    /// e.g. `cluster.device=cuda` for rollout workers on their own device kind.
    pub overrides: Vec<(Role, Vec<String>)>,
    /// How long a worker may take from start to answering its first health check.
    pub start_timeout: Duration,
    /// How long a health check may take before the worker counts as not answering
    /// (`cluster.worker_timeout_s`).
    pub health_timeout: Duration,
}

impl LaunchSpec {
    /// Default for [`LaunchSpec::start_timeout`]: generous, because a rollout worker may load and
    /// compile a model before it listens; a worker that crashes is noticed at once regardless.
    pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(300);

    /// The spec for a run from its recipe's `cluster` section: `rollout_workers` rollout,
    /// `reward_workers` reward and `learner_workers` learner workers, logs under `OUTPUT_DIR/logs`;
    /// rollout and learner workers run on `cluster.rollout_device` / `cluster.learner_device`
    /// (see [`device_overrides`]).
    pub fn from_cluster(
        cluster: &ClusterSection,
        program: PathBuf,
        recipe: PathBuf,
        token_file: PathBuf,
        output_dir: &Path,
    ) -> LaunchSpec {
        LaunchSpec {
            program,
            recipe,
            token_file,
            bind_host: cluster.bind_host.clone(),
            tls: cluster.tls.clone(),
            log_dir: output_dir.join("logs"),
            workers: vec![
                (Role::Rollout, cluster.rollout_workers),
                (Role::Reward, cluster.reward_workers),
                (Role::Learner, cluster.learner_workers),
            ],
            overrides: vec![
                (
                    Role::Rollout,
                    device_overrides(cluster, cluster.rollout_device_kind()),
                ),
                (
                    Role::Learner,
                    device_overrides(cluster, cluster.learner_device_kind()),
                ),
            ],
            start_timeout: Self::DEFAULT_START_TIMEOUT,
            health_timeout: Duration::from_secs_f64(cluster.worker_timeout_s.max(0.001)),
        }
    }
}

/// The `--set` overrides that make a worker open a `kind` device: none when `kind` is
/// `cluster.device`; otherwise `cluster.device=KIND`, the per-role device keys cleared (in the
/// worker's own recipe every role is on its device, so that recipe stays valid), and
/// `cluster.plugin_path=` (null) when a plugin path is set, since it names `cluster.device`'s
/// plugin (the worker discovers its own).
pub fn device_overrides(cluster: &ClusterSection, kind: DeviceKind) -> Vec<String> {
    if kind == cluster.device {
        return Vec::new();
    }
    let mut overrides = vec![
        format!("cluster.device={}", kind.name()),
        "cluster.rollout_device=".to_string(),
        "cluster.learner_device=".to_string(),
    ];
    if cluster.plugin_path.is_some() {
        overrides.push("cluster.plugin_path=".to_string());
    }
    overrides
}

/// A device kind the run needs whose PJRT plugin cannot be found.
#[derive(Debug, thiserror::Error)]
#[error("`{key}` = {kind}: {message}")]
pub struct DevicePluginError {
    /// The recipe key that asks for the device kind.
    pub key: &'static str,
    pub kind: &'static str,
    /// Why the plugin was not found and how to install it.
    pub message: String,
}

/// Checks, before any work, that the PJRT plugin of every device kind the run uses can be
/// found: `cluster.device` (the orchestrator's), and `cluster.rollout_device` /
/// `cluster.learner_device` when that role runs in worker processes. Only locates the files;
/// loading them is left to the processes that use them.
pub fn check_device_plugins(cluster: &ClusterSection) -> Result<(), DevicePluginError> {
    check_device_plugins_with(cluster, xla::runtime::locate_plugin)
}

/// [`check_device_plugins`] with the plugin search given (for tests).
pub fn check_device_plugins_with(
    cluster: &ClusterSection,
    locate: impl Fn(PluginKind, Option<&Path>) -> xla::runtime::Result<PathBuf>,
) -> Result<(), DevicePluginError> {
    let mut needed = vec![("cluster.device", cluster.device)];
    if cluster.rollout_workers > 0 {
        needed.push(("cluster.rollout_device", cluster.rollout_device_kind()));
    }
    if cluster.learner_workers > 0 {
        needed.push(("cluster.learner_device", cluster.learner_device_kind()));
    }
    for (key, kind) in needed {
        if key != "cluster.device" && kind == cluster.device {
            continue; // checked as `cluster.device`
        }
        let plugin = match kind {
            DeviceKind::Cpu => PluginKind::Cpu,
            DeviceKind::Cuda => PluginKind::Cuda,
            DeviceKind::Tpu => PluginKind::Tpu,
        };
        locate(plugin, cluster.plugin_path_for(kind).map(Path::new)).map_err(|e| DevicePluginError {
            key,
            kind: kind.name(),
            message: e.to_string(),
        })?;
    }
    Ok(())
}

/// One running worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerInfo {
    pub role: Role,
    /// 0-based among the workers of its role.
    pub index: usize,
    /// Where to call it: `http://HOST:PORT`, or `https://HOST:PORT` with TLS (give it to
    /// [`transport::channel`] or the roles' `Remote*::new`).
    pub address: String,
    /// The process id.
    pub pid: u32,
    /// Its log file.
    pub log: PathBuf,
}

/// Why a worker could not be started, or failed a health check.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("cannot write the worker log {path}: {source}")]
    Log {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start {role} worker {index} (`{program}`): {source}")]
    Spawn {
        role: &'static str,
        index: usize,
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{role} worker {index} did not print `listening on ADDRESS` within {waited_s} s; \
         last lines of {log}:\n{tail}"
    )]
    NoAddress {
        role: &'static str,
        index: usize,
        waited_s: f64,
        log: String,
        tail: String,
    },
    #[error("{role} worker {index} printed {line:?} where `listening on HOST:PORT` was expected")]
    BadAddress {
        role: &'static str,
        index: usize,
        line: String,
    },
    /// The worker process is gone.
    #[error("{role} worker {index} (pid {pid}) exited ({status}); last lines of {log}:\n{tail}")]
    Exited {
        role: &'static str,
        index: usize,
        pid: u32,
        status: String,
        log: String,
        tail: String,
    },
    /// The worker did not answer a health check in time (hung, overloaded or gone).
    #[error("{role} worker {index} at {address} did not answer a health check within {timeout_s} s")]
    NotAnswering {
        role: &'static str,
        index: usize,
        address: String,
        timeout_s: f64,
    },
    /// The health check failed (connection refused or reset, TLS refused, ...).
    #[error("{role} worker {index} at {address} failed its health check: {message}")]
    Unhealthy {
        role: &'static str,
        index: usize,
        address: String,
        message: String,
    },
    /// Something else answers there: another role, or a worker of another run.
    #[error("{role} worker {index} at {address} is not the worker that was started: {message}")]
    Foreign {
        role: &'static str,
        index: usize,
        address: String,
        message: String,
    },
    #[error("there is no {role} worker {index} (this launcher runs {count} {role} workers)")]
    UnknownWorker {
        role: &'static str,
        index: usize,
        count: usize,
    },
    #[error(
        "{role} worker {index} did not become healthy within {waited_s} s: {message}; \
         last lines of {log}:\n{tail}"
    )]
    NeverHealthy {
        role: &'static str,
        index: usize,
        waited_s: f64,
        message: String,
        log: String,
        tail: String,
    },
}

impl LaunchError {
    /// Whether this says the worker is dead or not answering (restart it) rather than that the
    /// launch itself is misconfigured.
    pub fn worker_is_down(&self) -> bool {
        matches!(
            self,
            LaunchError::Exited { .. } | LaunchError::NotAnswering { .. } | LaunchError::Unhealthy { .. }
        )
    }
}

/// A child process that is killed and reaped when dropped, however the owner goes away.
struct ChildGuard(Child);

impl ChildGuard {
    fn pid(&self) -> u32 {
        self.0.id()
    }

    /// The exit status if it has exited (and is now reaped).
    fn exited(&mut self) -> Option<ExitStatus> {
        self.0.try_wait().ok().flatten()
    }

    /// Send SIGKILL without waiting (no-op once reaped).
    fn kill(&mut self) {
        let _ = self.0.kill();
    }

    fn kill_and_reap(&mut self) -> Option<ExitStatus> {
        self.kill();
        self.0.wait().ok()
    }

    /// Ask the worker to stop (SIGTERM); it finishes serving and exits.
    fn terminate(&mut self) {
        if self.exited().is_some() {
            return;
        }
        #[cfg(unix)]
        // SAFETY: kill(2) with a pid of our own unreaped child (checked just above), so the pid
        // cannot have been reused by another process.
        unsafe {
            libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM);
        }
        #[cfg(not(unix))]
        self.kill();
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill_and_reap();
    }
}

/// The one thread that forks every worker (see the module docs for why).
struct Spawner {
    requests: Mutex<mpsc::Sender<SpawnRequest>>,
}

type SpawnRequest = (Command, mpsc::SyncSender<std::io::Result<Child>>);

impl Spawner {
    fn new() -> Spawner {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("worker-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("start the worker-spawner thread");
        Spawner {
            requests: Mutex::new(tx),
        }
    }

    fn spawn(&self, command: Command) -> std::io::Result<Child> {
        let (tx, rx) = mpsc::sync_channel(1);
        let sent = self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send((command, tx));
        let gone = || std::io::Error::other("the worker-spawner thread is gone");
        sent.map_err(|_| gone())?;
        rx.recv().map_err(|_| gone())?
    }
}

/// A worker between spawn and its first good health check.
struct Starting {
    role: Role,
    index: usize,
    child: ChildGuard,
    log: PathBuf,
    /// Where this start's part of the log begins.
    log_offset: u64,
    /// The first stdout line (None: stdout closed first).
    first_line: tokio::sync::oneshot::Receiver<Option<String>>,
    started: Instant,
}

struct Running {
    info: WorkerInfo,
    child: ChildGuard,
    channel: Channel,
    log_offset: u64,
}

/// Worker processes on this host. See the module docs.
pub struct LocalLauncher {
    spec: LaunchSpec,
    token: Token,
    running: Mutex<Vec<Running>>,
    spawner: Spawner,
}

impl LocalLauncher {
    /// Start every worker of `spec` (all at once) and wait until each answers its health check.
    /// On any failure the workers already started are stopped and the error says which worker
    /// failed and why.
    pub async fn start(spec: LaunchSpec) -> Result<LocalLauncher, LaunchError> {
        let token = Token::read(&spec.token_file)?;
        std::fs::create_dir_all(&spec.log_dir).map_err(|source| LaunchError::Log {
            path: spec.log_dir.display().to_string(),
            source,
        })?;
        let launcher = LocalLauncher {
            token,
            running: Mutex::new(Vec::new()),
            spawner: Spawner::new(),
            spec,
        };
        let mut starting = Vec::new();
        for &(role, count) in &launcher.spec.workers {
            for index in 0..count {
                starting.push(launcher.spawn(role, index)?);
            }
        }
        // They boot in parallel; waiting in turn costs the slowest one's time, not the sum.
        for worker in starting {
            let running = launcher.until_healthy(worker).await?;
            tracing::info!(
                role = running.info.role.name(),
                index = running.info.index,
                pid = running.info.pid,
                address = %running.info.address,
                "worker started"
            );
            launcher.lock().push(running);
        }
        Ok(launcher)
    }

    /// The spec it was started with.
    pub fn spec(&self) -> &LaunchSpec {
        &self.spec
    }

    /// The running workers of `role`, by index.
    pub fn workers(&self, role: Role) -> Vec<WorkerInfo> {
        let mut workers: Vec<WorkerInfo> = self
            .lock()
            .iter()
            .filter(|r| r.info.role == role)
            .map(|r| r.info.clone())
            .collect();
        workers.sort_by_key(|w| w.index);
        workers
    }

    /// Every running worker.
    pub fn all_workers(&self) -> Vec<WorkerInfo> {
        self.lock().iter().map(|r| r.info.clone()).collect()
    }

    /// Check one worker: its process is alive and `Worker.Health` answers within `timeout`
    /// (normally [`LaunchSpec::health_timeout`]) with the right role. A failed check takes at
    /// most `timeout` plus 0.2 s (to tell a dead process from a hung one). Errors for which
    /// [`LaunchError::worker_is_down`] holds mean: re-issue its work and [`restart`](Self::restart) it.
    pub async fn check(
        &self,
        role: Role,
        index: usize,
        timeout: Duration,
    ) -> Result<proto::HealthReply, LaunchError> {
        let (info, channel) = {
            let mut running = self.lock();
            let worker = running
                .iter_mut()
                .find(|r| r.info.role == role && r.info.index == index)
                .ok_or_else(|| self.unknown(role, index))?;
            if let Some(status) = worker.child.exited() {
                return Err(LaunchError::Exited {
                    role: role.name(),
                    index,
                    pid: worker.info.pid,
                    status: status.to_string(),
                    log: worker.info.log.display().to_string(),
                    tail: log_tail(&worker.info.log, worker.log_offset),
                });
            }
            (worker.info.clone(), worker.channel.clone())
        };
        let error = match self.health(&info, channel, timeout).await {
            Ok(reply) => return Ok(reply),
            Err(e @ (LaunchError::Unhealthy { .. } | LaunchError::NotAnswering { .. })) => e,
            Err(e) => return Err(e),
        };
        // A killed worker's connections break a moment before the kernel has it ready to reap:
        // say how it ended when that is what happened.
        let exited = {
            let deadline = Instant::now() + Duration::from_millis(200);
            loop {
                let status = self
                    .lock()
                    .iter_mut()
                    .find(|r| r.info.pid == info.pid)
                    .and_then(|r| r.child.exited().map(|s| (s, r.log_offset)));
                if status.is_some() || Instant::now() >= deadline {
                    break status;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        match exited {
            Some((status, log_offset)) => Err(LaunchError::Exited {
                role: role.name(),
                index,
                pid: info.pid,
                status: status.to_string(),
                log: info.log.display().to_string(),
                tail: log_tail(&info.log, log_offset),
            }),
            None => Err(error),
        }
    }

    /// Replace a worker: kill the old process if it is still there, start a new one on a fresh
    /// port, and wait until it is healthy. Returns the new worker (new address and pid).
    pub async fn restart(&self, role: Role, index: usize) -> Result<WorkerInfo, LaunchError> {
        if index >= self.count(role) {
            return Err(self.unknown(role, index));
        }
        // None when the slot is empty because its last restart failed: just start it again.
        let old = {
            let mut running = self.lock();
            let position = running
                .iter()
                .position(|r| r.info.role == role && r.info.index == index);
            position.map(|p| running.remove(p))
        };
        if let Some(mut old) = old {
            let status = old.child.kill_and_reap();
            tracing::warn!(
                role = role.name(),
                index,
                pid = old.info.pid,
                status = ?status,
                "restarting worker"
            );
        }
        let starting = self.spawn(role, index)?;
        let running = self.until_healthy(starting).await?;
        let info = running.info.clone();
        let mut slots = self.lock();
        // Two restarts of one slot at once: keep the newest, drop (kill) the other.
        slots.retain(|r| !(r.info.role == role && r.info.index == index));
        slots.push(running);
        tracing::info!(role = role.name(), index, pid = info.pid, address = %info.address, "worker restarted");
        Ok(info)
    }

    /// Stop every worker: SIGTERM, then SIGKILL for those still running after `grace`. Returns
    /// the workers that had to be killed.
    pub async fn shutdown(&self, grace: Duration) -> Vec<WorkerInfo> {
        let mut workers = std::mem::take(&mut *self.lock());
        for worker in &mut workers {
            worker.child.terminate();
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && workers.iter_mut().any(|w| w.child.exited().is_none()) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut killed = Vec::new();
        for worker in &mut workers {
            if worker.child.exited().is_none() {
                tracing::warn!(
                    role = worker.info.role.name(),
                    index = worker.info.index,
                    pid = worker.info.pid,
                    "worker did not stop within {grace:?}; killing it"
                );
                worker.child.kill_and_reap();
                killed.push(worker.info.clone());
            }
        }
        killed
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Running>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(&self, role: Role) -> usize {
        self.spec
            .workers
            .iter()
            .filter(|(r, _)| *r == role)
            .map(|(_, n)| n)
            .sum()
    }

    fn unknown(&self, role: Role, index: usize) -> LaunchError {
        LaunchError::UnknownWorker {
            role: role.name(),
            index,
            count: self.count(role),
        }
    }

    /// Fork one worker and start reading its stdout.
    fn spawn(&self, role: Role, index: usize) -> Result<Starting, LaunchError> {
        let spec = &self.spec;
        let log = spec.log_dir.join(format!("{}-{index}.log", role.name()));
        let log_error = |source| LaunchError::Log {
            path: log.display().to_string(),
            source,
        };
        let mut log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(log_error)?;
        let log_offset = log_file.seek(SeekFrom::End(0)).map_err(log_error)?;
        let listen = listen_address(&spec.bind_host);
        writeln!(
            log_file,
            "--- grpo worker --role {} (worker {index}) --listen {listen}",
            role.name()
        )
        .map_err(log_error)?;

        let mut command = Command::new(&spec.program);
        command
            .arg("worker")
            .args(["--role", role.name()])
            .arg("--recipe")
            .arg(&spec.recipe)
            .args(["--listen", &listen])
            .arg("--token-file")
            .arg(&spec.token_file)
            .args(
                spec.overrides
                    .iter()
                    .filter(|(r, _)| *r == role)
                    .flat_map(|(_, sets)| sets.iter().flat_map(|set| ["--set", set.as_str()])),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file.try_clone().map_err(log_error)?);
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        die_with_parent(&mut command);
        let mut child = self.spawner.spawn(command).map_err(|source| LaunchError::Spawn {
            role: role.name(),
            index,
            program: spec.program.display().to_string(),
            source,
        })?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let child = ChildGuard(child);
        let (tx, first_line) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name(format!("{}-{index}-stdout", role.name()))
            .spawn(move || forward_stdout(stdout, tx, log_file))
            .map_err(|source| LaunchError::Spawn {
                role: role.name(),
                index,
                program: "a thread reading the worker's stdout".into(),
                source,
            })?;
        Ok(Starting {
            role,
            index,
            child,
            log,
            log_offset,
            first_line,
            started: Instant::now(),
        })
    }

    /// Wait for `listening on ADDRESS`, then for a good health check, within the start timeout.
    async fn until_healthy(&self, mut worker: Starting) -> Result<Running, LaunchError> {
        let (role, index) = (worker.role.name(), worker.index);
        let deadline = worker.started + self.spec.start_timeout;
        let log = worker.log.display().to_string();
        let tail = |w: &Starting| log_tail(&w.log, w.log_offset);
        let remaining = deadline.saturating_duration_since(Instant::now());
        let line = match tokio::time::timeout(remaining, &mut worker.first_line).await {
            Ok(Ok(Some(line))) => line,
            Ok(_) => {
                // Stdout closed: the worker is exiting. Give it a moment to be reaped.
                let pid = worker.child.pid();
                let status = wait_exit(&mut worker.child, Duration::from_secs(2))
                    .await
                    .map_or_else(|| "stdout closed".to_string(), |s| s.to_string());
                return Err(LaunchError::Exited {
                    role,
                    index,
                    pid,
                    status,
                    log,
                    tail: tail(&worker),
                });
            }
            Err(_) => {
                worker.child.kill_and_reap();
                return Err(LaunchError::NoAddress {
                    role,
                    index,
                    waited_s: self.spec.start_timeout.as_secs_f64(),
                    log,
                    tail: tail(&worker),
                });
            }
        };
        let address = parse_listening(&line).ok_or_else(|| LaunchError::BadAddress {
            role,
            index,
            line: line.clone(),
        })?;
        let info = WorkerInfo {
            role: worker.role,
            index,
            address: transport::worker_uri(&address.to_string(), self.spec.tls.as_ref()),
            pid: worker.child.pid(),
            log: worker.log.clone(),
        };
        let channel = transport::channel(&info.address, self.spec.tls.as_ref())?;
        loop {
            if let Some(status) = worker.child.exited() {
                return Err(LaunchError::Exited {
                    role,
                    index,
                    pid: info.pid,
                    status: status.to_string(),
                    log,
                    tail: tail(&worker),
                });
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            let attempt = self.spec.health_timeout.min(remaining);
            let error = match self.health(&info, channel.clone(), attempt).await {
                Ok(_) => {
                    return Ok(Running {
                        info,
                        child: worker.child,
                        channel,
                        log_offset: worker.log_offset,
                    })
                }
                Err(e @ LaunchError::Foreign { .. }) => return Err(e),
                Err(e) => e,
            };
            if Instant::now() + Duration::from_millis(50) >= deadline {
                worker.child.kill_and_reap();
                return Err(LaunchError::NeverHealthy {
                    role,
                    index,
                    waited_s: self.spec.start_timeout.as_secs_f64(),
                    message: error.to_string(),
                    log,
                    tail: tail(&worker),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn health(
        &self,
        info: &WorkerInfo,
        channel: Channel,
        timeout: Duration,
    ) -> Result<proto::HealthReply, LaunchError> {
        let role = info.role.name();
        let mut client = proto::worker_client::WorkerClient::with_interceptor(channel, self.token.attach());
        let reply = match tokio::time::timeout(timeout, client.health(proto::HealthRequest {})).await {
            Err(_) => {
                return Err(LaunchError::NotAnswering {
                    role,
                    index: info.index,
                    address: info.address.clone(),
                    timeout_s: timeout.as_secs_f64(),
                })
            }
            Ok(Err(status)) if status.code() == tonic::Code::Unauthenticated => {
                return Err(LaunchError::Foreign {
                    role,
                    index: info.index,
                    address: info.address.clone(),
                    message: status.message().to_string(),
                })
            }
            Ok(Err(status)) => {
                let message = match std::error::Error::source(&status) {
                    Some(source) => transport::error_chain(source),
                    None => status.message().to_string(),
                };
                return Err(LaunchError::Unhealthy {
                    role,
                    index: info.index,
                    address: info.address.clone(),
                    message,
                });
            }
            Ok(Ok(reply)) => reply.into_inner(),
        };
        if reply.role != role {
            return Err(LaunchError::Foreign {
                role,
                index: info.index,
                address: info.address.clone(),
                message: format!("it serves the {} role", reply.role),
            });
        }
        Ok(reply)
    }
}

impl Drop for LocalLauncher {
    /// Kill every worker at once, then reap them all.
    fn drop(&mut self) {
        let mut workers = std::mem::take(&mut *self.lock());
        for worker in &mut workers {
            worker.child.kill();
        }
        drop(workers);
    }
}

/// `HOST:0`, bracketing IPv6 hosts.
fn listen_address(bind_host: &str) -> String {
    if bind_host.contains(':') && !bind_host.starts_with('[') {
        format!("[{bind_host}]:0")
    } else {
        format!("{bind_host}:0")
    }
}

/// The address in `listening on ADDRESS`, with an unspecified host (0.0.0.0, ::) replaced by
/// loopback: that is where this host reaches it.
fn parse_listening(line: &str) -> Option<SocketAddr> {
    let mut address: SocketAddr = line.trim().strip_prefix("listening on ")?.parse().ok()?;
    if address.ip().is_unspecified() {
        address.set_ip(match address.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    Some(address)
}

/// Hand the first stdout line to the launcher, then copy the rest into the log.
fn forward_stdout(
    stdout: ChildStdout,
    first: tokio::sync::oneshot::Sender<Option<String>>,
    mut log: std::fs::File,
) {
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    let got = matches!(reader.read_line(&mut line), Ok(n) if n > 0);
    let _ = first.send(got.then(|| line.trim_end().to_string()));
    if got {
        let _ = std::io::copy(&mut reader, &mut log);
    }
}

async fn wait_exit(child: &mut ChildGuard, within: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.exited() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The last lines written to `log` since `offset` (this start of the worker).
fn log_tail(log: &Path, offset: u64) -> String {
    let mut text = String::new();
    let read = std::fs::File::open(log).and_then(|mut f| {
        f.seek(SeekFrom::Start(offset))?;
        f.read_to_string(&mut text)
    });
    if let Err(e) = read {
        return format!("  (cannot read the log: {e})");
    }
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
    if tail.is_empty() {
        return "  (nothing)".into();
    }
    tail.iter()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Linux: have the kernel SIGKILL the worker when the thread that forked it dies (the
/// launcher's spawner thread lives as long as the launcher, and dies with the orchestrator, even
/// on SIGKILL). Also refuse to start if the orchestrator already died between fork and prctl.
#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec; it only calls prctl(2) and
    // getppid(2), which are async-signal-safe, and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Elsewhere there is no parent-death signal: workers are stopped by [`LocalLauncher::shutdown`]
/// and by dropping the launcher.
#[cfg(not(target_os = "linux"))]
fn die_with_parent(_: &mut Command) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_lines_parse_and_unspecified_hosts_become_loopback() {
        assert_eq!(
            parse_listening("listening on 127.0.0.1:4567\n"),
            Some("127.0.0.1:4567".parse().unwrap())
        );
        assert_eq!(
            parse_listening("listening on 0.0.0.0:80"),
            Some("127.0.0.1:80".parse().unwrap())
        );
        assert_eq!(
            parse_listening("listening on [::]:80"),
            Some("[::1]:80".parse().unwrap())
        );
        assert_eq!(parse_listening("loading the model"), None);
        assert_eq!(parse_listening("listening on somewhere"), None);
        assert_eq!(listen_address("127.0.0.1"), "127.0.0.1:0");
        assert_eq!(listen_address("::1"), "[::1]:0");
        assert_eq!(listen_address("[::1]"), "[::1]:0");
    }

    #[test]
    fn log_tails_show_only_this_start() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("reward-0.log");
        std::fs::write(&log, "old run\n").unwrap();
        let offset = std::fs::metadata(&log).unwrap().len();
        let mut text = String::from("old run\n");
        for i in 0..30 {
            text.push_str(&format!("line {i}\n"));
        }
        std::fs::write(&log, text).unwrap();
        let tail = log_tail(&log, offset);
        assert_eq!(tail.lines().count(), LOG_TAIL_LINES);
        assert!(tail.starts_with("  line 10\n"), "{tail}");
        assert!(tail.ends_with("  line 29"), "{tail}");
        assert_eq!(log_tail(&log, 1 << 20), "  (nothing)");
    }

    fn cluster(yaml: &str) -> ClusterSection {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn workers_on_another_device_kind_get_it_as_overrides() {
        let c = cluster("rollout_workers: 1\nrollout_device: cuda\nplugin_path: /opt/cpu.so\n");
        assert_eq!(
            device_overrides(&c, c.rollout_device_kind()),
            vec![
                "cluster.device=cuda",
                "cluster.rollout_device=",
                "cluster.learner_device=",
                "cluster.plugin_path="
            ]
        );
        assert_eq!(
            device_overrides(&c, c.learner_device_kind()),
            Vec::<String>::new()
        );
        let c = cluster("device: tpu\nlearner_workers: 1\nlearner_device: cpu\n");
        let learner = device_overrides(&c, c.learner_device_kind());
        assert_eq!(
            learner,
            vec![
                "cluster.device=cpu",
                "cluster.rollout_device=",
                "cluster.learner_device="
            ]
        );
        // The worker's recipe with these overrides is valid and puts it on its device.
        let text = "model: {path: m}\ndata: {train_files: t.parquet}\n\
                    cluster: {device: tpu, learner_workers: 1, learner_device: cpu}\n";
        let base = crate::recipe::load_recipe_str(text, "r.yaml").unwrap();
        let worker = crate::recipe::apply_overrides(&base, &learner, "r.yaml").unwrap();
        assert_eq!(worker.cluster.device, DeviceKind::Cpu);
        assert_eq!(worker.cluster.learner_device_kind(), DeviceKind::Cpu);
        assert_eq!(c.rollout_device_kind(), DeviceKind::Tpu);
        let spec = LaunchSpec::from_cluster(&c, "grpo".into(), "r.yaml".into(), "t".into(), Path::new("o"));
        assert_eq!(
            spec.overrides,
            vec![(Role::Rollout, vec![]), (Role::Learner, learner)]
        );
    }

    #[test]
    fn a_missing_device_plugin_names_the_key_that_asks_for_it() {
        let site = tempfile::tempdir().unwrap();
        let cpu = site.path().join(PluginKind::Cpu.relative_path());
        std::fs::create_dir_all(cpu.parent().unwrap()).unwrap();
        std::fs::write(&cpu, b"").unwrap();
        let sites = vec![site.path().to_path_buf()];
        // Only the CPU plugin is installed.
        let locate = |kind: PluginKind, explicit: Option<&Path>| {
            xla::runtime::locate_plugin_with(kind, explicit, None, &sites)
        };
        check_device_plugins_with(&cluster("rollout_workers: 2\n"), locate).unwrap();
        // Rollout in the orchestrator's process: its device key is not used.
        check_device_plugins_with(&cluster("rollout_device: cpu\n"), locate).unwrap();
        let error = check_device_plugins_with(&cluster("rollout_workers: 1\nrollout_device: cuda\n"), locate)
            .unwrap_err();
        assert_eq!((error.key, error.kind), ("cluster.rollout_device", "cuda"));
        let message = error.to_string();
        assert!(
            message.starts_with("`cluster.rollout_device` = cuda: "),
            "{message}"
        );
        assert!(
            message.contains("jax-cuda13-pjrt"),
            "says what to install: {message}"
        );
        let error = check_device_plugins_with(&cluster("learner_workers: 1\nlearner_device: tpu\n"), locate)
            .unwrap_err();
        assert_eq!((error.key, error.kind), ("cluster.learner_device", "tpu"));
        let error = check_device_plugins_with(&cluster("device: tpu\n"), locate).unwrap_err();
        assert_eq!(error.key, "cluster.device");
        // `cluster.plugin_path` names `cluster.device`'s plugin; a missing one is reported there.
        let error = check_device_plugins_with(
            &cluster("plugin_path: /nonexistent/cpu.so\nrollout_workers: 1\nrollout_device: cpu\n"),
            locate,
        )
        .unwrap_err();
        assert_eq!(error.key, "cluster.device");
        assert!(error.message.contains("/nonexistent/cpu.so"), "{}", error.message);
    }

    /// A launch of one reward worker whose program is the shell script `script` (a stand-in
    /// for `grpo` that misbehaves in a chosen way), with a fresh token, in `dir`.
    fn fake_worker_spec(dir: &Path, script: &str, recipe: &str) -> LaunchSpec {
        let token_file = dir.join("token");
        Token::generate().write(&token_file).unwrap();
        let program = dir.join("fake-grpo");
        std::fs::write(&program, script).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        LaunchSpec {
            program,
            recipe: recipe.into(),
            token_file,
            bind_host: "127.0.0.1".into(),
            tls: None,
            log_dir: dir.join("logs"),
            workers: vec![(Role::Reward, 1)],
            overrides: Vec::new(),
            start_timeout: Duration::from_secs(20),
            health_timeout: Duration::from_secs(1),
        }
    }

    #[tokio::test]
    async fn overrides_reach_the_workers_of_their_role() {
        let dir = tempfile::tempdir().unwrap();
        // A "worker" that prints its arguments and exits: the error quotes its log.
        let base = fake_worker_spec(dir.path(), "#!/bin/sh\necho \"args: $*\" >&2\nexit 1\n", "r.yaml");
        let spec = |role: Role| LaunchSpec {
            workers: vec![(role, 1)],
            overrides: vec![(
                Role::Rollout,
                vec!["cluster.device=cuda".into(), "cluster.plugin_path=".into()],
            )],
            ..base.clone()
        };
        let token = base.token_file.display();
        let message = LocalLauncher::start(spec(Role::Rollout))
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(
            message.ends_with(&format!(
                "  args: worker --role rollout --recipe r.yaml --listen 127.0.0.1:0 --token-file \
                 {token} --set cluster.device=cuda --set cluster.plugin_path="
            )),
            "{message}"
        );
        let message = LocalLauncher::start(spec(Role::Reward))
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(
            message.ends_with(&format!(
                "  args: worker --role reward --recipe r.yaml --listen 127.0.0.1:0 --token-file {token}"
            )),
            "{message}"
        );
    }

    #[tokio::test]
    async fn a_worker_that_dies_at_start_is_reported_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        // A "worker" that complains on stderr and exits 3: the error quotes it.
        let spec = fake_worker_spec(
            dir.path(),
            "#!/bin/sh\necho \"no such recipe: $5\" >&2\nexit 3\n",
            "missing.yaml",
        );
        let error = LocalLauncher::start(spec).await.err().expect("start must fail");
        let message = error.to_string();
        assert!(error.worker_is_down(), "{message}");
        assert!(message.starts_with("reward worker 0 (pid "), "{message}");
        assert!(message.contains("exited (exit status: 3)"), "{message}");
        assert!(message.ends_with("  no such recipe: missing.yaml"), "{message}");
        assert!(message.contains("--- grpo worker --role reward (worker 0) --listen 127.0.0.1:0"));
    }

    #[tokio::test]
    async fn a_worker_that_never_listens_times_out_and_is_killed() {
        let dir = tempfile::tempdir().unwrap();
        let spec = LaunchSpec {
            start_timeout: Duration::from_millis(500),
            ..fake_worker_spec(
                dir.path(),
                "#!/bin/sh\necho loading >&2\nexec sleep 30\n",
                "r.yaml",
            )
        };
        let started = Instant::now();
        let message = LocalLauncher::start(spec).await.err().unwrap().to_string();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(
            message.starts_with("reward worker 0 did not print `listening on ADDRESS` within 0.5 s"),
            "{message}"
        );
        assert!(message.ends_with("\n  loading"), "{message}");
    }
}
