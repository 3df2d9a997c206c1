//! The local launcher with real `grpo worker` processes: start, health checks, a worker killed
//! with SIGKILL or frozen with SIGSTOP detected within the timeout, restart on a new address,
//! graceful shutdown, and no worker left behind when the launcher is dropped or when the
//! orchestrator itself is killed with SIGKILL.

use actors::auth::Token;
use actors::launcher::{LaunchSpec, LocalLauncher};
use actors::roles::reward::{RemoteReward, RewardRole};
use actors::roles::Role;
use reward::Sample;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

fn spec(dir: &Path, reward_workers: usize) -> LaunchSpec {
    let token_file = dir.join("token");
    Token::generate().write(&token_file).unwrap();
    LaunchSpec {
        program: env!("CARGO_BIN_EXE_grpo").into(),
        recipe: Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/quickstart.yaml"),
        token_file,
        bind_host: "127.0.0.1".into(),
        tls: None,
        log_dir: dir.join("logs"),
        workers: vec![(Role::Reward, reward_workers)],
        overrides: Vec::new(),
        // Generous: the test machine may be busy; a crash is reported at once regardless.
        start_timeout: Duration::from_secs(120),
        health_timeout: HEALTH_TIMEOUT,
    }
}

/// Whether a process exists and is not a zombie.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(stat) => {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            !(state.starts_with('Z') || state.starts_with('X'))
        }
    }
}

fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} {pid}");
}

fn wait_until_gone(pid: u32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if !alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn sample() -> Sample {
    Sample {
        id: 7,
        data_source: "grpo/arithmetic".into(),
        prompt: serde_json::Value::Null,
        response: "#### 42".into(),
        ground_truth: "42".into(),
        extra: serde_json::Value::Null,
        response_length: 3,
        truncated: false,
    }
}

#[test]
fn workers_start_fail_detectably_restart_and_die_with_the_launcher() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), 2);
    let token = Token::read(&spec.token_file).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let launcher = LocalLauncher::start(spec).await.unwrap();
        let workers = launcher.workers(Role::Reward);
        assert_eq!(workers.iter().map(|w| w.index).collect::<Vec<_>>(), [0, 1]);
        assert_ne!(workers[0].address, workers[1].address);
        assert!(launcher.workers(Role::Rollout).is_empty());
        for w in &workers {
            assert!(w.address.starts_with("http://127.0.0.1:"), "{}", w.address);
            assert!(alive(w.pid));
            let reply = launcher
                .check(Role::Reward, w.index, HEALTH_TIMEOUT)
                .await
                .unwrap();
            assert_eq!(reply.role, "reward");
            // It really serves the role, with the run's token.
            let remote = RemoteReward::new(&w.address, &token, None).unwrap();
            assert_eq!(remote.score(vec![sample()]).await.unwrap()[0].score, 1.0);
        }

        // kill -9: the next check fails at once, saying how the worker ended.
        signal(workers[0].pid, "KILL");
        let started = Instant::now();
        let error = launcher
            .check(Role::Reward, 0, HEALTH_TIMEOUT)
            .await
            .expect_err("a killed worker must fail its check");
        assert!(started.elapsed() <= HEALTH_TIMEOUT, "{:?}", started.elapsed());
        assert!(error.worker_is_down(), "{error}");
        let message = error.to_string();
        assert!(
            message.starts_with(&format!(
                "reward worker 0 (pid {}) exited (signal: 9",
                workers[0].pid
            )),
            "{message}"
        );

        // A replacement, on a new port, healthy and serving.
        let replacement = launcher.restart(Role::Reward, 0).await.unwrap();
        assert_ne!(replacement.pid, workers[0].pid);
        assert_ne!(replacement.address, workers[0].address);
        assert_eq!(launcher.workers(Role::Reward)[0], replacement);
        launcher.check(Role::Reward, 0, HEALTH_TIMEOUT).await.unwrap();
        let remote = RemoteReward::new(&replacement.address, &token, None).unwrap();
        assert_eq!(remote.score(vec![sample()]).await.unwrap().len(), 1);
        let log = std::fs::read_to_string(&replacement.log).unwrap();
        assert_eq!(
            log.matches("--- grpo worker --role reward (worker 0)").count(),
            2,
            "{log}"
        );

        // A frozen worker (alive but not answering) fails its check within the timeout.
        signal(workers[1].pid, "STOP");
        let started = Instant::now();
        let error = launcher
            .check(Role::Reward, 1, Duration::from_millis(500))
            .await
            .expect_err("a stopped worker must fail its check");
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(500) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        assert!(error.worker_is_down());
        assert!(
            error
                .to_string()
                .ends_with("did not answer a health check within 0.5 s"),
            "{error}"
        );

        let message = launcher
            .check(Role::Reward, 2, HEALTH_TIMEOUT)
            .await
            .unwrap_err()
            .to_string();
        assert_eq!(
            message,
            "there is no reward worker 2 (this launcher runs 2 reward workers)"
        );

        // Dropping the launcher kills and reaps every worker, the frozen one included.
        let pids: Vec<u32> = launcher.all_workers().iter().map(|w| w.pid).collect();
        assert_eq!(pids.len(), 2);
        drop(launcher);
        for pid in pids {
            assert!(!alive(pid), "worker {pid} outlived the launcher");
        }
    });
}

#[test]
fn shutdown_stops_workers_gracefully() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let launcher = LocalLauncher::start(spec(dir.path(), 1)).await.unwrap();
        let pid = launcher.workers(Role::Reward)[0].pid;
        let killed = launcher.shutdown(Duration::from_secs(10)).await;
        assert!(killed.is_empty(), "the worker should stop on SIGTERM: {killed:?}");
        assert!(!alive(pid));
        assert!(launcher.all_workers().is_empty());
    });
}

const HELPER_DIR: &str = "GRPO_LAUNCHER_TEST_HELPER_DIR";

/// Not a test on its own: `orchestrator_killed_with_sigkill_leaves_no_worker` runs this test
/// binary again with only this function, as a stand-in orchestrator to kill.
#[test]
#[ignore = "a helper process, started by orchestrator_killed_with_sigkill_leaves_no_worker"]
fn stand_in_orchestrator() {
    let dir = std::env::var(HELPER_DIR).expect("started by the SIGKILL test");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let launcher = LocalLauncher::start(spec(Path::new(&dir), 1)).await.unwrap();
        println!("worker pid {}", launcher.workers(Role::Reward)[0].pid);
        tokio::time::sleep(Duration::from_secs(120)).await;
        drop(launcher);
    });
}

#[test]
fn orchestrator_killed_with_sigkill_leaves_no_worker() {
    let dir = tempfile::tempdir().unwrap();
    let mut orchestrator = Command::new(std::env::current_exe().unwrap())
        .args(["stand_in_orchestrator", "--exact", "--ignored", "--nocapture"])
        .env(HELPER_DIR, dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(orchestrator.stdout.take().unwrap());
    let worker_pid: u32 = stdout
        .lines()
        .map_while(Result::ok)
        .find_map(|line| line.strip_prefix("worker pid ").map(|p| p.parse().unwrap()))
        .expect("the stand-in orchestrator reports its worker");
    assert!(alive(worker_pid));
    orchestrator.kill().unwrap();
    orchestrator.wait().unwrap();
    let gone = wait_until_gone(worker_pid, Duration::from_secs(10));
    if !gone {
        signal(worker_pid, "KILL");
    }
    assert!(gone, "worker {worker_pid} outlived its orchestrator");
}
