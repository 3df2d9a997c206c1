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

use super::{health_check, log_tail, LaunchError, LaunchSpec, WorkerInfo};
use crate::auth::Token;
use crate::proto;
use crate::roles::Role;
use crate::transport;
use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

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
        let error = match health_check(&self.token, &info, channel, timeout).await {
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
            let error = match health_check(&self.token, &info, channel.clone(), attempt).await {
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
    use super::super::LOG_TAIL_LINES;
    use super::*;
    use std::path::Path;

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
