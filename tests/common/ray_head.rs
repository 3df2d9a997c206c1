//! A real, private Ray head for tests: `ray start --head --block` on 127.0.0.1 with ports of its
//! own, its own temp dir, and declared CPU, GPU and custom (e.g. `TPU`) capacity so that jobs
//! asking for accelerators are placed without real devices. Dropping it (also while a test
//! panics) kills every process it started: raylet, GCS, dashboard and its modules, agents, job
//! supervisors and the jobs' entrypoints. They are found, not by name (other Ray clusters on the
//! machine are left alone; no `ray stop`), but as: the processes with a marker in their
//! environment (every Ray process and job inherits the head's environment; those that rename
//! themselves with setproctitle lose it), those whose command line names the head's temp dir,
//! and all descendants of these. They are frozen (SIGSTOP) until the set is closed under
//! "child of", then killed (SIGKILL), so none can fork away in between.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The environment variable whose value marks the processes of one head (value: the head's temp
/// dir, unique per head).
pub const MARKER_VAR: &str = "GRPO_TEST_RAY_HEAD";

/// How long a head may take to answer its Jobs API before the test fails.
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// Ports handed out by this process, so that two heads started at once never share one.
static TAKEN_PORTS: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A running Ray head (see the module comment).
pub struct RayHead {
    child: Option<Child>,
    temp: Option<tempfile::TempDir>,
    marker: String,
    dashboard_port: u16,
    gcs_port: u16,
    startup: Duration,
}

impl RayHead {
    /// Starts a head with `num_cpus` CPUs, `num_gpus` GPUs (declared; no device is needed) and
    /// `custom_resources` (e.g. `&[("TPU", 4.0)]`), and waits until its Jobs API answers and the
    /// node reports its resources. Panics, with what to do, when `ray` is not installed or the
    /// head does not come up (the head's log tail is in the message).
    pub fn start(num_cpus: u32, num_gpus: u32, custom_resources: &[(&str, f64)]) -> RayHead {
        let began = Instant::now();
        let ray = ray_executable();
        // Ray puts unix sockets under the temp dir; keep the path short (sun_path is 108 bytes).
        let temp = tempfile::Builder::new()
            .prefix("rayh-")
            .tempdir_in("/tmp")
            .expect("create a temp dir for the Ray head");
        let marker = temp.path().display().to_string();
        let ports = free_ports(11);
        let [gcs, dashboard, client, agent_http, agent_grpc, runtime_env, node_manager, object_manager, metrics, autoscaler_metrics, dashboard_metrics] =
            ports[..]
        else {
            unreachable!("eleven ports")
        };
        let resources = serde_json::Value::Object(
            custom_resources
                .iter()
                .map(|(name, amount)| (name.to_string(), serde_json::json!(amount)))
                .collect(),
        )
        .to_string();
        let log_path = temp.path().join("ray-start.log");
        let log = std::fs::File::create(&log_path).expect("create the Ray head's log");
        let mut command = Command::new(&ray);
        command
            .args(["start", "--head", "--block", "--disable-usage-stats"])
            .args(["--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1"])
            .args(["--include-dashboard", "true", "--include-log-monitor", "false"])
            .arg(format!("--port={gcs}"))
            .arg(format!("--dashboard-port={dashboard}"))
            .arg(format!("--ray-client-server-port={client}"))
            .arg(format!("--dashboard-agent-listen-port={agent_http}"))
            .arg(format!("--dashboard-agent-grpc-port={agent_grpc}"))
            .arg(format!("--runtime-env-agent-port={runtime_env}"))
            .arg(format!("--node-manager-port={node_manager}"))
            .arg(format!("--object-manager-port={object_manager}"))
            .arg(format!("--metrics-export-port={metrics}"))
            // Workers (job supervisors) bind ports the OS picks.
            .args(["--min-worker-port=0", "--max-worker-port=0"])
            .arg(format!("--num-cpus={num_cpus}"))
            .arg(format!("--num-gpus={num_gpus}"))
            .arg(format!("--resources={resources}"))
            .arg("--object-store-memory=100000000")
            .arg(format!("--temp-dir={marker}"))
            .env(MARKER_VAR, &marker)
            .env("RAY_USAGE_STATS_ENABLED", "0")
            // Prometheus ports of the autoscaler monitor and the dashboard (fixed 44217 / 44227
            // otherwise, which two heads would share).
            .env("AUTOSCALER_METRIC_PORT", autoscaler_metrics.to_string())
            .env("DASHBOARD_METRIC_PORT", dashboard_metrics.to_string())
            .env("RAY_DISABLE_DOCKER_CPU_WARNING", "1")
            .current_dir(temp.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup the log"))
            .stderr(log);
        let child = command.spawn().unwrap_or_else(|e| {
            panic!(
                "cannot run `{}`: {e}; scripts/test.sh installs Ray",
                ray.display()
            )
        });
        let mut head = RayHead {
            child: Some(child),
            temp: Some(temp),
            marker,
            dashboard_port: dashboard,
            gcs_port: gcs,
            startup: Duration::ZERO,
        };
        head.wait_until_ready(&log_path, began);
        head.startup = began.elapsed();
        head
    }

    /// The dashboard / Jobs API address, `http://127.0.0.1:PORT`.
    pub fn address(&self) -> String {
        format!("http://127.0.0.1:{}", self.dashboard_port)
    }

    /// The GCS address, `127.0.0.1:PORT` (what `ray start --address` of another node takes).
    pub fn gcs_address(&self) -> String {
        format!("127.0.0.1:{}", self.gcs_port)
    }

    /// The head's own temp dir (Ray's `--temp-dir`; sessions and logs are under it).
    pub fn temp_dir(&self) -> &Path {
        self.temp.as_ref().expect("the head is running").path()
    }

    /// How long `start` took, from spawning `ray start` to a Jobs API that answers.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// The pids of the live processes this head started (the `ray start` process included).
    pub fn processes(&self) -> Vec<u32> {
        let mut roots = marked_processes(&self.marker);
        roots.extend(processes_mentioning(&self.marker));
        if let Some(child) = &self.child {
            roots.push(child.id());
        }
        let table = process_table();
        let mut all: Vec<u32> = with_descendants(&roots, &table)
            .into_iter()
            .filter(|p| super::process_alive(*p))
            .collect();
        all.sort_unstable();
        all
    }

    /// Kills every process of the head and removes its temp dir; returns the pids that were
    /// still alive afterwards (empty when all went). Called by `drop`; safe to call twice.
    pub fn shutdown(&mut self) -> Vec<u32> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut frozen: HashSet<u32> = HashSet::new();
            // Freeze, then look again for children forked before the freeze, until closed.
            loop {
                let found: Vec<u32> = self
                    .processes()
                    .into_iter()
                    .filter(|p| !frozen.contains(p))
                    .collect();
                if found.is_empty() {
                    break;
                }
                signal(&found, "STOP");
                frozen.extend(found);
            }
            if frozen.is_empty() || Instant::now() > deadline {
                break;
            }
            let pids: Vec<u32> = frozen.into_iter().collect();
            signal(&pids, "KILL");
            if let Some(child) = self.child.as_mut() {
                let _ = child.wait();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let left = self.processes();
        if let Some(temp) = self.temp.take() {
            // Whatever cannot be removed stays in /tmp, harmless.
            let _ = temp.close();
        }
        left
    }

    /// Polls the Jobs API and the node listing until the node is alive with its resources.
    fn wait_until_ready(&mut self, log_path: &Path, began: Instant) {
        let port = self.dashboard_port;
        loop {
            let jobs = http_get(port, "/api/jobs/");
            let nodes = http_get(port, "/api/v0/nodes?limit=10");
            let ready = matches!(&jobs, Some((200, _)))
                && matches!(&nodes, Some((200, body)) if body.contains("\"state\": \"ALIVE\"") && body.contains("\"CPU\""));
            if ready {
                return;
            }
            let exited = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || began.elapsed() > START_TIMEOUT {
                let log = std::fs::read_to_string(log_path).unwrap_or_default();
                let tail: Vec<&str> = log
                    .lines()
                    .rev()
                    .take(40)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                let why = match exited {
                    Some(status) => format!("`ray start` exited with {status}"),
                    None => format!("its Jobs API did not answer within {START_TIMEOUT:?}"),
                };
                self.shutdown();
                panic!(
                    "the test's Ray head did not start: {why} (it needs Ray with its dashboard, \
                     `ray[default]==2.60.0`: scripts/test.sh installs it); its log ends with:\n{}",
                    tail.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for RayHead {
    fn drop(&mut self) {
        let left = self.shutdown();
        if !left.is_empty() && !std::thread::panicking() {
            panic!("Ray head processes survived the shutdown: {left:?}");
        }
    }
}

/// `$RAY`, else the checkout's `.venv/bin/ray` (where scripts/test.sh installs it), else `ray`
/// on PATH, checked to run; panics saying to run scripts/test.sh otherwise.
fn ray_executable() -> PathBuf {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/ray");
    check_ray(std::env::var_os("RAY").map(PathBuf::from).unwrap_or_else(|| {
        if venv.is_file() {
            venv
        } else {
            PathBuf::from("ray")
        }
    }))
}

/// `ray` if `ray --version` runs; panics saying to run scripts/test.sh otherwise.
pub fn check_ray(ray: PathBuf) -> PathBuf {
    let works = Command::new(&ray)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        works,
        "`{}` is not installed or does not run: the Ray tests need Ray with its dashboard; run \
         scripts/test.sh (it installs `ray[default]==2.60.0`)",
        ray.display()
    );
    ray
}

/// `count` distinct free TCP ports, never handed out before by this process.
fn free_ports(count: usize) -> Vec<u16> {
    let mut taken = TAKEN_PORTS.lock().unwrap_or_else(|e| e.into_inner());
    let taken = taken.get_or_insert_with(HashSet::new);
    // Hold every listener until all are chosen so the OS gives distinct ports.
    let mut listeners = Vec::new();
    let mut ports = Vec::new();
    while ports.len() < count {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        let port = listener.local_addr().unwrap().port();
        listeners.push(listener);
        if taken.insert(port) {
            ports.push(port);
        }
    }
    ports
}

/// A plain HTTP/1.0 GET on 127.0.0.1:`port`: the status and body, or None when nothing answers.
fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((status, body))
}

/// The live (not zombie) processes whose `/proc/PID/FILE` contents satisfy `matches`.
fn live_processes_where(file: &str, matches: impl Fn(&[u8]) -> bool) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_string_lossy().parse::<u32>().ok()?;
            let contents = std::fs::read(entry.path().join(file)).ok()?;
            (matches(&contents) && super::process_alive(pid)).then_some(pid)
        })
        .collect()
}

/// The live (not zombie) processes whose environment has `MARKER_VAR=marker`.
pub fn marked_processes(marker: &str) -> Vec<u32> {
    let needle = format!("{MARKER_VAR}={marker}");
    live_processes_where("environ", |environ| {
        environ.split(|b| *b == 0).any(|var| var == needle.as_bytes())
    })
}

/// The live processes whose command line mentions `text`.
pub fn processes_mentioning(text: &str) -> Vec<u32> {
    live_processes_where("cmdline", |cmdline| {
        String::from_utf8_lossy(cmdline).contains(text)
    })
}

/// Every process's parent: (pid, ppid) from /proc/PID/stat.
fn process_table() -> Vec<(u32, u32)> {
    let mut table = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return table;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok());
        if let Some(ppid) = ppid {
            table.push((pid, ppid));
        }
    }
    table
}

/// `roots` and every process descending from one of them.
fn with_descendants(roots: &[u32], table: &[(u32, u32)]) -> HashSet<u32> {
    let mut all: HashSet<u32> = roots.iter().copied().collect();
    loop {
        let before = all.len();
        for (pid, ppid) in table {
            if all.contains(ppid) {
                all.insert(*pid);
            }
        }
        if all.len() == before {
            return all;
        }
    }
}

/// Sends signal `name` to every pid in `pids` with one kill(1).
fn signal(pids: &[u32], name: &str) {
    if pids.is_empty() {
        return;
    }
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .args(pids.iter().map(|p| p.to_string()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}
