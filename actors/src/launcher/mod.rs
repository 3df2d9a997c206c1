//! Worker processes of a run: how they are started, found, checked, replaced and stopped.
//!
//! Two launchers, chosen by `cluster.launcher`, give the orchestrator the same [`Launcher`]:
//! - [`local`]: processes on this host, forked by the orchestrator (`cluster.rollout_workers`,
//!   `reward_workers`, `learner_workers`);
//! - [`ray`]: Ray jobs placed by an existing Ray cluster into the recipe's `cluster.pools`; the
//!   workers dial back and register with the orchestrator's [`crate::registry`].
//!
//! Either way a worker is then called the same way (its [`WorkerInfo::address`], the run's
//! token) and checked with `Worker.Health` ([`health_check`]).

pub mod local;
pub mod ray;

pub use local::LocalLauncher;
pub use ray::RayLauncher;

use crate::auth::{Token, TokenError};
use crate::proto;
use crate::recipe::{ClusterSection, DeviceKind, TlsSection};
use crate::roles::Role;
use crate::transport::{self, TransportError};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;
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
        locate(kind.plugin(), cluster.plugin_path_for(kind).map(Path::new)).map_err(|e| {
            DevicePluginError {
                key,
                kind: kind.name(),
                message: e.to_string(),
            }
        })?;
    }
    Ok(())
}

/// The worker processes of a run, however they were started.
// One per run, behind an `Arc`: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum Launcher {
    Local(LocalLauncher),
    Ray(RayLauncher),
}

impl Launcher {
    /// The running workers of `role`, by index.
    pub fn workers(&self, role: Role) -> Vec<WorkerInfo> {
        match self {
            Launcher::Local(l) => l.workers(role),
            Launcher::Ray(l) => l.workers(role),
        }
    }

    /// Replace worker `index` of `role` (dead or not answering) and wait until the new one is
    /// healthy.
    pub async fn restart(&self, role: Role, index: usize) -> Result<WorkerInfo, LaunchError> {
        match self {
            Launcher::Local(l) => l.restart(role, index).await,
            Launcher::Ray(l) => l.restart(role, index).await,
        }
    }

    /// Workers found gone since the last call without a call to them failing: Ray jobs that
    /// ended (the local launcher's dead processes show up as failed calls instead).
    pub async fn ended_jobs(&self) -> Vec<(Role, usize)> {
        match self {
            Launcher::Local(_) => Vec::new(),
            Launcher::Ray(l) => l.ended_jobs().await,
        }
    }

    /// Stop every worker, giving each `grace` to finish; returns those that had to be killed.
    pub async fn shutdown(&self, grace: Duration) -> Vec<WorkerInfo> {
        match self {
            Launcher::Local(l) => l.shutdown(grace).await,
            Launcher::Ray(l) => l.shutdown(grace).await,
        }
    }
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
    Ray(#[from] ray::RayLaunchError),
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

/// One `Worker.Health` call to `info` over `channel` with the run's `token`, within `timeout`:
/// the reply, or why the worker counts as down ([`LaunchError::NotAnswering`],
/// [`LaunchError::Unhealthy`]) or as not the worker that was started ([`LaunchError::Foreign`]).
pub async fn health_check(
    token: &Token,
    info: &WorkerInfo,
    channel: Channel,
    timeout: Duration,
) -> Result<proto::HealthReply, LaunchError> {
    let role = info.role.name();
    let mut client = proto::worker_client::WorkerClient::with_interceptor(channel, token.attach());
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

/// The last lines written to `log` since `offset` (this start of the worker).
pub(crate) fn log_tail(log: &Path, offset: u64) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use xla::runtime::PluginKind;

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
}
