//! `grpo worker --connect`: a real worker process registers with an orchestrator's registry,
//! answers at the address it reported, is refused (exit 2) when its grpo version differs, and
//! exits by itself (exit 3) once the registry is gone.

mod common;

use actors::auth::Token;
use actors::launcher::ray::registry::{self, Registry, RegistryServer};
use actors::proto;
use actors::roles::Role;
use common::WorkerProcess;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// `grpo worker --role reward --connect ORCH` listening on every interface, with a worker
/// timeout of 0.5 s (so it gives a silent orchestrator the minimum 5 s).
fn start_connected_worker(
    token_file: &std::path::Path,
    orchestrator: &str,
    worker_id: &str,
) -> WorkerProcess {
    let mut command = common::worker("reward", "recipes/quickstart.yaml", token_file);
    command
        .args([
            "--set",
            "cluster.worker_timeout_s=0.5",
            "--listen",
            "0.0.0.0:0",
            "--connect",
            orchestrator,
            "--worker-id",
            worker_id,
            "--pool",
            "cpu-reward",
        ])
        .stderr(Stdio::piped());
    WorkerProcess::start(&mut command)
}

async fn serve_registry(token: &Token, version: &str) -> RegistryServer {
    Registry::serve("127.0.0.1", token.clone(), None, version)
        .await
        .expect("serve the registry")
}

#[test]
fn a_connected_worker_registers_answers_and_exits_when_its_orchestrator_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let token = Token::generate();
    let token_file = dir.path().join("token");
    token.write(&token_file).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let server = runtime.block_on(serve_registry(&token, env!("CARGO_PKG_VERSION")));
    let orchestrator = server.address();
    let mut worker = start_connected_worker(&token_file, &orchestrator, "reward-0-a1");

    let listening = worker.line();
    let port = listening
        .strip_prefix("listening on 0.0.0.0:")
        .unwrap_or_else(|| panic!("worker said {listening:?}"))
        .to_string();
    assert_eq!(
        worker.line(),
        format!("registered with {orchestrator} as reward-0-a1")
    );

    let registration = runtime
        .block_on(server.wait_for("reward-0-a1", Duration::from_secs(5)))
        .unwrap();
    // On 0.0.0.0 it reports the interface that routes to the orchestrator: loopback here.
    assert_eq!(registration.address, format!("http://127.0.0.1:{port}"));
    assert_eq!(registration.role, Role::Reward);
    assert_eq!(registration.pool, "cpu-reward");
    assert_eq!(registration.pid, worker.child.id());
    assert_eq!(registration.hostname, registry::hostname());
    assert_eq!(registration.grpo_version, env!("CARGO_PKG_VERSION"));
    assert!(registration.devices.is_empty(), "{:?}", registration.devices);

    // The reported address answers Worker.Health with the run's token, and only with it.
    runtime.block_on(async {
        let channel = actors::transport::channel(&registration.address, None).unwrap();
        let mut client =
            proto::worker_client::WorkerClient::with_interceptor(channel.clone(), token.attach());
        let health = client.health(proto::HealthRequest {}).await.unwrap().into_inner();
        assert_eq!(health.role, "reward");
        assert_eq!(health.version, env!("CARGO_PKG_VERSION"));
        let mut intruder =
            proto::worker_client::WorkerClient::with_interceptor(channel, Token::generate().attach());
        let status = intruder.health(proto::HealthRequest {}).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
    });

    // Its heartbeats (one a second) keep it alive while the registry answers...
    let watching = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    while server.since_heard("reward-0-a1").unwrap() >= watching.elapsed() {
        assert!(
            watching.elapsed() < Duration::from_secs(15),
            "no heartbeat in {:?}",
            watching.elapsed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        worker.child.try_wait().unwrap().is_none(),
        "the worker exited early"
    );

    // ... and once the registry is gone it exits by itself, with status 3, after the deadline.
    let deadline = registry::heartbeat_deadline(0.5);
    assert_eq!(deadline, Duration::from_secs(5));
    drop(server);
    let gone = Instant::now();
    let (status, stderr) = worker
        .exit_within(deadline + Duration::from_secs(10))
        .expect("the worker outlived its orchestrator");
    let waited = gone.elapsed();
    assert_eq!(status.code(), Some(3), "stderr: {stderr}");
    // Its last answered heartbeat came at most a second or so (more on a loaded machine)
    // before the registry went away.
    assert!(
        waited >= deadline / 2,
        "exited {waited:?} after the registry went away: too early"
    );
    assert!(
        stderr.contains(&format!(
            "error: the orchestrator at {orchestrator} has not answered for "
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("it is gone, so worker reward-0-a1 exits"),
        "{stderr}"
    );
}

#[test]
fn a_worker_of_another_grpo_version_is_refused_with_exit_status_2() {
    let dir = tempfile::tempdir().unwrap();
    let token = Token::generate();
    let token_file = dir.path().join("token");
    token.write(&token_file).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let server = runtime.block_on(serve_registry(&token, "99.0.0"));
    let mut worker = start_connected_worker(&token_file, &server.address(), "reward-1-a1");
    let (status, stderr) = worker
        .exit_within(Duration::from_secs(60))
        .expect("a refused worker exits");
    assert_eq!(status.code(), Some(2), "stderr: {stderr}");
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        stderr.contains(&format!(
            "refused worker reward-1-a1: worker reward-1-a1 runs grpo {version} but the \
             orchestrator runs grpo 99.0.0; every node must run the orchestrator's own grpo build"
        )),
        "{stderr}"
    );
    assert!(stderr.contains("docs/ray.md"), "{stderr}");
    let refused = runtime
        .block_on(server.wait_for("reward-1-a1", Duration::from_secs(1)))
        .unwrap_err()
        .to_string();
    assert!(
        refused.starts_with("worker reward-1-a1 tried to register and was refused"),
        "{refused}"
    );
}

#[test]
fn worker_id_and_pool_go_with_connect() {
    // A reward worker given `extra` on top of the common arguments: refused as a usage error
    // (exit 2) naming `wanted`.
    let refused_without = |extra: &[&str], wanted: &[&str]| {
        let out = common::worker("reward", "recipes/quickstart.yaml", "token")
            .args(extra)
            .output()
            .expect("run grpo");
        assert_eq!(out.status.code(), Some(2), "{extra:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        for w in wanted {
            assert!(stderr.contains(w), "{extra:?}: {stderr}");
        }
    };
    refused_without(
        &["--connect", "http://127.0.0.1:1"],
        &["--worker-id <ID>", "--pool <NAME>"],
    );
    refused_without(&["--pool", "cpu"], &["--connect <ORCHESTRATOR_ADDRESS>"]);

    let help = common::run_grpo(&["worker", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("--worker-id rollout-0-a1 --pool tpu-rollout --set cluster.device=tpu"),
        "{help}"
    );
}
