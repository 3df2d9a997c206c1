//! `grpo run` with `cluster.launcher: ray` against a real Ray head on 127.0.0.1 (Ray from PyPI,
//! installed by `scripts/setup.sh`). The head advertises `TPU` and `GPU` capacity it does not
//! have (custom resources; the workers open CPU clients), so pools of every kind can be placed.
//!
//! One head serves four runs in turn:
//! 1. rollout in two pools (a TPU pool and a GPU pool), reward in a CPU pool, the learner in a
//!    GPU pool: the run trains exactly as the in-process run, `grpo run` says where each worker
//!    landed, and Ray's own job records show each job with its pool's resources;
//! 2. the same with rollout worker 0's Ray job stopped mid-run: the job is resubmitted, every
//!    step still has all its samples, none twice, on the same prompts;
//! 3. a pool asking for a resource the cluster lacks: the run fails before submitting anything,
//!    naming the resource and what the cluster has;
//! 4. LoRA in the pools of run 1: each sync sends the two rollout jobs the adapters alone, and
//!    the run trains exactly as LoRA in one process.
//!
//! The head and every job are gone afterwards, pass or fail (the fixture's `Drop`).

mod common;

use actors::launcher::ray::jobs::{JobStatus, RayJobs};
use common::ray_head::RayHead;
use common::*;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// The pools of runs 1 and 2, placed on the head's declared capacity (8 CPU, 2 GPU, 4 TPU), each
/// job with the recipe's runtime_env.
fn pools(address: &str) -> String {
    format!(
        "cluster:\n  launcher: ray\n  worker_timeout_s: 5\n  ray:\n    address: {address}\n    poll_interval_s: 0.5\n\
         \x20   runtime_env: {{env_vars: {{GRPO_RAY_TEST: placed}}}}\n  pools:\n\
         \x20   - {{name: tpu-rollout, device: cpu, roles: [rollout], workers: 1, num_cpus: 1, resources: {{TPU: 2}}}}\n\
         \x20   - {{name: gpu-rollout, device: cpu, roles: [rollout], workers: 1, num_cpus: 1, num_gpus: 1}}\n\
         \x20   - {{name: cpu-reward, device: cpu, roles: [reward], workers: 1, num_cpus: 2}}\n\
         \x20   - {{name: gpu-learner, device: cpu, roles: [learner], workers: 1, num_cpus: 1, num_gpus: 1}}\n"
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// This run's jobs as Ray records them: (submission id, record), ordered by id.
fn run_jobs(ray: &RayJobs, output: &Path) -> Vec<(String, actors::launcher::ray::jobs::JobInfo)> {
    let mut jobs: Vec<_> = runtime()
        .block_on(ray.list())
        .unwrap()
        .into_iter()
        .filter(|j| j.metadata.get("grpo_output").map(String::as_str) == Some(&output.display().to_string()))
        .map(|j| (j.submission_id.clone().unwrap_or_default(), j))
        .collect();
    jobs.sort_by(|a, b| a.0.cmp(&b.0));
    jobs
}

/// Runs `recipe` (writing to `output`) with `args`, stops rollout worker 0's Ray job once step 1
/// is done, and waits for the run to end: its status and stderr.
fn stop_rollout_0_after_step_1(
    ray: &RayJobs,
    recipe: &Path,
    output: &Path,
    args: &[&str],
) -> (std::process::ExitStatus, String) {
    let mut run = grpo()
        .arg("run")
        .arg(recipe)
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let guard = KillOnDrop(run.id());
    wait_for_step(output, 1, &mut run, Duration::from_secs(300));
    let victim = run_jobs(ray, output)
        .into_iter()
        .find(|(_, j)| j.metadata["role"] == "rollout" && j.metadata["index"] == "0")
        .map(|(id, _)| id)
        .expect("rollout worker 0's job");
    assert!(
        runtime().block_on(ray.stop(&victim)).unwrap(),
        "stopping {victim}"
    );
    let status = run.wait().unwrap();
    drop(guard);
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut run.stderr.take().unwrap(), &mut stderr).unwrap();
    (status, stderr)
}

#[test]
fn workers_run_as_ray_jobs_in_their_pools_and_a_stopped_job_is_resubmitted() {
    let head = RayHead::start(8, 2, &[("TPU", 4.0)]);
    let ray = RayJobs::new(&head.address()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 64);
    let val = arithmetic(dir.path(), "val", 2, 4);
    let steps = 3;

    // The reference: every role in this process.
    let local = dir.path().join("local");
    let r_local = tiny_recipe(dir.path(), "local.yaml", &model, &train, &val, &local, steps, "");
    let o = grpo().arg("run").arg(&r_local).arg("--quiet").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // 1. Every role a Ray job in its pool.
    let placed = dir.path().join("placed");
    let r_placed = tiny_recipe(
        dir.path(),
        "placed.yaml",
        &model,
        &train,
        &val,
        &placed,
        steps,
        &pools(&head.address()),
    );
    let started = Instant::now();
    let o = grpo().arg("run").arg(&r_placed).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    eprintln!("the Ray run took {:?}; its log:\n{stderr}", started.elapsed());
    assert_same_training(&local, &placed, "every role a Ray job vs in-process");
    for line in [
        "rollout worker 0 -> pool `tpu-rollout`",
        "rollout worker 1 -> pool `gpu-rollout`",
        "reward worker 0 -> pool `cpu-reward`",
        "learner worker 0 -> pool `gpu-learner`",
    ] {
        assert!(
            stderr.contains(line),
            "`grpo run` says where workers landed: {line}\n{stderr}"
        );
    }
    // Ray's records: one job per worker, each reserving its pool's resources (the job's
    // supervisor actor holds what Ray reserved), all stopped at the end.
    let jobs = run_jobs(&ray, &placed);
    let mut reserved: Vec<(String, String)> = jobs
        .iter()
        .map(|(id, j)| {
            let supervisor = runtime()
                .block_on(ray.supervisor(id))
                .unwrap()
                .unwrap_or_else(|| panic!("Ray has no supervisor for {id}"));
            (
                format!(
                    "{}-{} in {}",
                    j.metadata["role"], j.metadata["index"], j.metadata["pool"]
                ),
                format!("{:?}", supervisor.required_resources),
            )
        })
        .collect();
    reserved.sort();
    let expected = [
        ("learner-0 in gpu-learner", r#"{"CPU": 1.0, "GPU": 1.0}"#),
        ("reward-0 in cpu-reward", r#"{"CPU": 2.0}"#),
        ("rollout-0 in tpu-rollout", r#"{"CPU": 1.0, "TPU": 2.0}"#),
        ("rollout-1 in gpu-rollout", r#"{"CPU": 1.0, "GPU": 1.0}"#),
    ]
    .map(|(a, b)| (a.to_string(), b.to_string()));
    assert_eq!(reserved, expected, "Ray's job records: {jobs:#?}");
    for (id, job) in &jobs {
        let env = job
            .runtime_env
            .as_ref()
            .and_then(|e| e.pointer("/env_vars/GRPO_RAY_TEST"));
        assert_eq!(
            env,
            Some(&serde_json::json!("placed")),
            "{id}'s runtime_env: {job:#?}"
        );
        assert!(
            matches!(job.status, JobStatus::Stopped | JobStatus::Succeeded),
            "{id} is {:?} after the run",
            job.status
        );
    }

    // 2. Rollout worker 0's job stopped after step 1.
    let resubmitted = dir.path().join("resubmitted");
    let r_resubmitted = tiny_recipe(
        dir.path(),
        "resubmitted.yaml",
        &model,
        &train,
        &val,
        &resubmitted,
        steps,
        &pools(&head.address()),
    );
    let (status, stderr) = stop_rollout_0_after_step_1(&ray, &r_resubmitted, &resubmitted, &[]);
    assert!(status.success(), "{stderr}");
    eprintln!("the run whose rollout job was stopped; its log:\n{stderr}");
    let m = metrics(&resubmitted);
    assert_eq!(metric_series(&m, "batch/samples"), vec![16.0; steps], "{stderr}");
    assert_eq!(prompts_seen(&local), prompts_seen(&resubmitted), "{stderr}");
    let jobs = run_jobs(&ray, &resubmitted);
    let rollout0: Vec<&String> = jobs
        .iter()
        .filter(|(_, j)| j.metadata["role"] == "rollout" && j.metadata["index"] == "0")
        .map(|(id, _)| id)
        .collect();
    assert_eq!(
        rollout0.len(),
        2,
        "the stopped job and its resubmission: {jobs:#?}\n{stderr}"
    );
    assert!(rollout0[1].ends_with("rollout-0-a2"), "{rollout0:?}");
    assert!(stderr.contains("resubmitting"), "{stderr}");

    // 2b. The same with no resubmission allowed: the stopped job stays stopped, the run goes on
    // with the other rollout worker and says why the replacement failed.
    let capped = dir.path().join("capped");
    let r_capped = tiny_recipe(
        dir.path(),
        "capped.yaml",
        &model,
        &train,
        &val,
        &capped,
        steps,
        &pools(&head.address()),
    );
    let (status, stderr) = stop_rollout_0_after_step_1(
        &ray,
        &r_capped,
        &capped,
        &["--set", "cluster.ray.max_resubmits=0"],
    );
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("`cluster.ray.max_resubmits`"), "{stderr}");
    let rollout0 = run_jobs(&ray, &capped)
        .into_iter()
        .filter(|(_, j)| j.metadata["role"] == "rollout" && j.metadata["index"] == "0")
        .count();
    assert_eq!(rollout0, 1, "no resubmission: {stderr}");
    assert_eq!(prompts_seen(&local), prompts_seen(&capped), "{stderr}");

    // 3. A resource the cluster has never had: refused before any job is submitted.
    let refused = dir.path().join("refused");
    let r_refused = tiny_recipe(
        dir.path(),
        "refused.yaml",
        &model,
        &train,
        &val,
        &refused,
        steps,
        &format!(
            "cluster:\n  launcher: ray\n  ray:\n    address: {}\n  pools:\n\
             \x20   - {{name: cpu, device: cpu, roles: [rollout, learner]}}\n\
             \x20   - {{name: fpga-reward, device: cpu, roles: [reward], resources: {{FPGA: 1}}}}\n",
            head.address()
        ),
    );
    let o = grpo().arg("run").arg(&r_refused).arg("--quiet").output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(
        stderr.contains("pool `fpga-reward` asks for 1 FPGA per worker")
            && stderr.contains("has no `FPGA` resource")
            && stderr.contains("TPU 4"),
        "{stderr}"
    );
    assert!(run_jobs(&ray, &refused).is_empty(), "no job was submitted");
    assert!(!refused.join("metrics.jsonl").exists(), "no step ran");

    // 4. LoRA: the rollout jobs hold the base and are sent only the adapters, from the learner
    // job through this process, and the run trains as LoRA does in one process.
    let lora = [
        "--set",
        "actor.lora_rank=4",
        "--set",
        "actor.target_modules=[q_proj, v_proj]",
        "--set",
        "actor.optim.lr=0.05",
    ];
    let (lora_local, lora_placed) = (dir.path().join("lora-local"), dir.path().join("lora-placed"));
    for (name, out, cluster) in [
        ("lora-local.yaml", &lora_local, String::new()),
        ("lora-placed.yaml", &lora_placed, pools(&head.address())),
    ] {
        let r = tiny_recipe(dir.path(), name, &model, &train, &val, out, steps, &cluster);
        let o = grpo()
            .arg("run")
            .arg(&r)
            .arg("--quiet")
            .args(lora)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    assert_same_training(
        &lora_local,
        &lora_placed,
        "LoRA: every role a Ray job vs in-process",
    );
    let adapter_bytes = checkpoint_param_bytes(&lora_placed.join("checkpoints/step_2"));
    let sent = metric_series(&metrics(&lora_placed), "weights/sent_bytes");
    assert_eq!(
        sent,
        vec![2.0 * adapter_bytes as f64; steps],
        "two rollout jobs, the adapters each"
    );
}

/// Kills process `pid` if the test fails before it ends.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if process_alive(self.0) {
            send_signal(self.0, "KILL");
        }
    }
}
