//! The Ray Jobs client (`actors::launcher::ray::jobs`) against a real local Ray head (`common::ray_head`):
//! the cluster reports the declared CPU/GPU/TPU, a job asking for CPU and TPU runs and Ray's
//! record shows what it asked, a long job stopped mid-run ends and its process is gone, a job
//! asking for more than the cluster has stays PENDING, delete works, and when the head is
//! dropped (here: by a panic) none of its processes remain.

mod common;

use actors::launcher::ray::jobs::{JobRequest, JobStatus, RayJobs};
use common::ray_head::{check_ray, marked_processes, processes_mentioning, RayHead, MARKER_VAR};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

fn request(id: &str, entrypoint: &str, cpus: f64, gpus: f64, resources: &[(&str, f64)]) -> JobRequest {
    JobRequest {
        submission_id: id.to_string(),
        entrypoint: entrypoint.to_string(),
        entrypoint_num_cpus: cpus,
        entrypoint_num_gpus: gpus,
        entrypoint_resources: resources.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        runtime_env: None,
        metadata: BTreeMap::from([("test".to_string(), "ray_jobs".to_string())]),
    }
}

/// Polls the job until `done(status)` holds; panics with the job's record after `within`.
async fn wait_for(
    client: &RayJobs,
    id: &str,
    within: Duration,
    done: impl Fn(JobStatus) -> bool,
) -> actors::launcher::ray::jobs::JobInfo {
    let started = Instant::now();
    loop {
        let info = client.info(id).await.expect("job info");
        if done(info.status) {
            return info;
        }
        assert!(
            started.elapsed() < within,
            "job {id} still {info:?} after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Reads a pid a job wrote to `path`, waiting for it to appear.
fn read_pid(path: &Path, within: Duration) -> u32 {
    let started = Instant::now();
    loop {
        if let Some(pid) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return pid;
        }
        assert!(
            started.elapsed() < within,
            "{} not written within {within:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The socket inodes listening on TCP `port` (from /proc/net/tcp and tcp6).
fn listeners(port: u16) -> Vec<String> {
    let hex = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .flat_map(|file| {
            let table = std::fs::read_to_string(file).unwrap_or_default();
            table
                .lines()
                .skip(1)
                .filter_map(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    // local_address is field 1, state field 3 (0A = LISTEN), inode field 9.
                    (fields.len() > 9 && fields[1].ends_with(&hex) && fields[3] == "0A")
                        .then(|| fields[9].to_string())
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

fn listening(port: u16) -> bool {
    !listeners(port).is_empty()
}

/// Every process id this user can see now.
fn all_processes() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// The processes holding a listener on `port` that already existed in `earlier`. A port the
/// head freed may be taken at once by any other process on the machine (another test's
/// ephemeral port); only a holder that lived while the head ran is a leak.
fn old_holders(port: u16, earlier: &[u32]) -> Vec<u32> {
    let sockets: Vec<String> = listeners(port)
        .iter()
        .map(|inode| format!("socket:[{inode}]"))
        .collect();
    if sockets.is_empty() {
        return Vec::new();
    }
    earlier
        .iter()
        .copied()
        .filter(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
                fds.filter_map(Result::ok).any(|fd| {
                    std::fs::read_link(fd.path())
                        .is_ok_and(|target| sockets.iter().any(|s| target.as_os_str() == s.as_str()))
                })
            })
        })
        .collect()
}

#[test]
fn ray_jobs_run_stop_pend_and_leave_nothing_behind() {
    let head = RayHead::start(4, 2, &[("TPU", 4.0)]);
    eprintln!("the Ray head answered after {:?}", head.startup_time());
    let address = head.address();
    let dashboard_port: u16 = address.rsplit(':').next().unwrap().parse().unwrap();
    let gcs_port: u16 = head.gcs_address().rsplit(':').next().unwrap().parse().unwrap();
    let work = head.temp_dir().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let temp_dir = head.temp_dir().display().to_string();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = RayJobs::new(&address).unwrap();

    let running_pid = runtime.block_on(async {
        // The cluster reports what the head declared.
        let version = client.version().await.unwrap();
        assert_eq!(version.ray_version, "2.60.0");
        let resources = actors::launcher::ray::jobs::total_resources(&client.nodes().await.unwrap());
        assert_eq!(
            (resources["CPU"], resources["GPU"], resources["TPU"]),
            (4.0, 2.0, 4.0)
        );
        let nodes = client.nodes().await.unwrap();
        assert_eq!(nodes.len(), 1);
        let node_id = nodes[0].node_id.clone();

        // A job asking for 1 CPU, half a GPU and 1 TPU runs and succeeds; Ray's records show it
        // was placed on the node with exactly those resources reserved.
        let id = "grpo-test-rollout-0-a1";
        let submitted = client
            .submit(&request(
                id,
                "echo placed-on-$(hostname); echo TPU-job-ran",
                1.0,
                0.5,
                &[("TPU", 1.0)],
            ))
            .await
            .unwrap();
        assert_eq!(submitted, id);
        let done = wait_for(&client, id, Duration::from_secs(30), JobStatus::is_terminal).await;
        assert_eq!(done.status, JobStatus::Succeeded, "{done:?}");
        assert_eq!(done.driver_exit_code, Some(0));
        assert_eq!(done.driver_node_id.as_deref(), Some(node_id.as_str()));
        assert_eq!(done.metadata["test"], "ray_jobs");
        assert!(client.logs(id).await.unwrap().contains("TPU-job-ran\n"));
        let supervisor = client
            .supervisor(id)
            .await
            .unwrap()
            .expect("the job's supervisor actor");
        assert_eq!(
            supervisor.required_resources,
            BTreeMap::from([
                ("CPU".to_string(), 1.0),
                ("GPU".to_string(), 0.5),
                ("TPU".to_string(), 1.0)
            ])
        );
        assert_eq!(supervisor.node_id.as_deref(), Some(node_id.as_str()));

        // A second submission under the same id is refused, naming the id.
        let again = client
            .submit(&request(id, "true", 0.0, 0.0, &[]))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            again.contains("Job with submission_id grpo-test-rollout-0-a1 already exists"),
            "{again}"
        );

        // A long job stopped mid-run reaches STOPPED and its process is gone.
        let pid_file = work.join("long.pid");
        let long = "grpo-test-learner-0-a1";
        client
            .submit(&request(
                long,
                &format!("echo $$ > {} && exec sleep 120", pid_file.display()),
                1.0,
                0.0,
                &[("TPU", 2.0)],
            ))
            .await
            .unwrap();
        wait_for(&client, long, Duration::from_secs(30), |s| {
            s == JobStatus::Running
        })
        .await;
        let long_pid = read_pid(&pid_file, Duration::from_secs(10));
        assert!(common::process_alive(long_pid));
        assert!(client.stop(long).await.unwrap());
        let stopped = wait_for(&client, long, Duration::from_secs(15), JobStatus::is_terminal).await;
        assert_eq!(stopped.status, JobStatus::Stopped);
        let gone_by = Instant::now() + Duration::from_secs(10);
        while common::process_alive(long_pid) {
            assert!(
                Instant::now() < gone_by,
                "the stopped job's process {long_pid} is still alive"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // Stopping again is harmless (Ray answers whether the supervisor was still there).
        client.stop(long).await.unwrap();
        assert_eq!(client.info(long).await.unwrap().status, JobStatus::Stopped);

        // A job asking for more TPU than the cluster has stays PENDING: Ray keeps its supervisor
        // waiting for a node (it would fail only after RAY_JOB_START_TIMEOUT_SECONDS, 900 s).
        let pending = "grpo-test-reward-0-a1";
        client
            .submit(&request(pending, "echo never", 1.0, 0.0, &[("TPU", 8.0)]))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let info = client.info(pending).await.unwrap();
        assert_eq!(info.status, JobStatus::Pending, "{info:?}");
        assert!(info.message.unwrap().contains("waiting for resources"));
        let waiting = client
            .supervisor(pending)
            .await
            .unwrap()
            .expect("a supervisor waiting for a node");
        assert_eq!(waiting.state, "PENDING_CREATION");
        assert_eq!(waiting.required_resources["TPU"], 8.0);
        // Ray cannot delete a job that has not ended, and says so.
        let refused = client.delete(pending).await.unwrap_err().to_string();
        assert!(refused.contains("non-terminal state PENDING"), "{refused}");
        assert!(refused.contains("stop the job and wait"), "{refused}");

        // Delete removes a finished job's record.
        assert!(client.delete(id).await.unwrap());
        assert!(client.info(id).await.unwrap_err().is_not_found());
        let listed: Vec<String> = client
            .list()
            .await
            .unwrap()
            .into_iter()
            .filter_map(|j| j.submission_id)
            .collect();
        assert!(
            listed.contains(&long.to_string()) && listed.contains(&pending.to_string()),
            "{listed:?}"
        );
        assert!(!listed.contains(&id.to_string()), "{listed:?}");

        // One more job left running when the head goes away.
        let orphan_file = work.join("orphan.pid");
        client
            .submit(&request(
                "grpo-test-orphan",
                &format!("echo $$ > {} && exec sleep 120", orphan_file.display()),
                0.5,
                0.0,
                &[],
            ))
            .await
            .unwrap();
        wait_for(&client, "grpo-test-orphan", Duration::from_secs(30), |s| {
            s == JobStatus::Running
        })
        .await;
        read_pid(&orphan_file, Duration::from_secs(10))
    });

    // The head's processes carry its marker; the job's entrypoint among them.
    let marker = temp_dir.clone();
    let before = head.processes();
    assert!(
        before.contains(&running_pid),
        "the running job {running_pid} is one of the head's processes {before:?}"
    );
    assert!(before.len() >= 5, "{before:?}");
    let needle = format!("{MARKER_VAR}={marker}");
    let environ = std::fs::read(format!("/proc/{running_pid}/environ")).unwrap();
    assert!(environ.split(|b| *b == 0).any(|v| v == needle.as_bytes()));
    assert!(listening(dashboard_port) && listening(gcs_port));

    // Dropped during a panic: everything goes.
    eprintln!("(the panic below is deliberate: the head must go with a failing test)");
    let alive_with_head = all_processes();
    for port in [dashboard_port, gcs_port] {
        // The holder lookup below sees the head's own listeners.
        assert!(
            !old_holders(port, &alive_with_head).is_empty(),
            "no holder found for {port}"
        );
    }
    let started = Instant::now();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _head = head;
        panic!("a test failing while its Ray head runs");
    }));
    assert!(result.is_err());
    eprintln!("the Ray head was gone after {:?}", started.elapsed());
    assert_eq!(
        marked_processes(&marker),
        Vec::<u32>::new(),
        "processes of the head survived"
    );
    assert_eq!(
        processes_mentioning(&temp_dir),
        Vec::<u32>::new(),
        "processes naming the temp dir survived"
    );
    assert_eq!(
        processes_mentioning(&format!(":{gcs_port}")),
        Vec::<u32>::new(),
        "processes naming the GCS port survived"
    );
    assert!(
        !common::process_alive(running_pid),
        "the running job's process survived"
    );
    for (port, what) in [(dashboard_port, "dashboard"), (gcs_port, "GCS")] {
        let holders = old_holders(port, &alive_with_head);
        assert!(
            holders.is_empty(),
            "the {what} port {port} is still held by {holders:?}"
        );
    }
    assert!(!Path::new(&temp_dir).exists(), "the head's temp dir is left");
    let error = runtime.block_on(client.version()).unwrap_err();
    assert!(error.is_unreachable(), "{error}");
}

#[test]
fn a_missing_ray_fails_the_test_saying_what_to_do() {
    let missing = std::panic::catch_unwind(|| check_ray("/nonexistent/bin/ray".into())).unwrap_err();
    let message = missing
        .downcast_ref::<String>()
        .expect("a formatted panic message");
    assert_eq!(
        message,
        "`/nonexistent/bin/ray` is not installed or does not run: the Ray tests need Ray with its \
         dashboard; run scripts/test.sh (it installs `ray[default]==2.60.0`)"
    );
}
