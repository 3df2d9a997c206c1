//! `grpo run` with worker processes that freeze mid-run (`kill -STOP`: the process exists, the
//! kernel still accepts its connections, but nothing answers). The orchestrator must notice
//! within seconds (`cluster.worker_timeout_s`), re-issue the frozen worker's unfinished work to
//! the others, kill it and start a replacement, and finish every step with all its samples,
//! none lost or counted twice, on the same prompts as an uninterrupted in-process run.

mod common;

use common::*;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Processes this test froze or started: thawed and killed however the test ends, so a failing
/// assertion leaves nothing behind.
#[derive(Default)]
struct Cleanup {
    frozen: Vec<u32>,
    run: Option<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut run) = self.run.take() {
            let _ = run.kill();
            let _ = run.wait();
        }
        for &pid in &self.frozen {
            if process_alive(pid) {
                send_signal(pid, "CONT");
                send_signal(pid, "KILL");
            }
        }
    }
}

#[test]
fn frozen_rollout_and_reward_workers_are_replaced_and_the_steps_complete() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 64);
    let val = arithmetic(dir.path(), "val", 2, 4);
    let steps = 4;
    let local = dir.path().join("local");
    let frozen = dir.path().join("frozen");
    let r_local = tiny_recipe(dir.path(), "local.yaml", &model, &train, &val, &local, steps, "");
    // Two of each, so the others carry the work while a replacement starts; a frozen worker
    // counts as dead after 2 s without an answer.
    let r_frozen = tiny_recipe(
        dir.path(),
        "frozen.yaml",
        &model,
        &train,
        &val,
        &frozen,
        steps,
        "cluster:\n  rollout_workers: 2\n  reward_workers: 2\n  worker_timeout_s: 2\n",
    );
    let o = grpo().arg("run").arg(&r_local).arg("--quiet").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let mut cleanup = Cleanup::default();
    let run = cleanup.run.insert(
        grpo()
            .arg("run")
            .arg(&r_frozen)
            .arg("--quiet")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for_step(&frozen, 1, run, Duration::from_secs(300));
    let rollout = run_worker_pids(&frozen, "rollout");
    let reward = run_worker_pids(&frozen, "reward");
    assert_eq!(
        (rollout.len(), reward.len()),
        (2, 2),
        "workers: {rollout:?} {reward:?}"
    );
    let stopped = [rollout[0], reward[0]];
    cleanup.frozen.extend(stopped);
    let stopped_at = Instant::now();
    for pid in stopped {
        assert!(send_signal(pid, "STOP"), "kill -STOP {pid}");
    }

    // The run must end on its own; the guard kills it if an assertion below fails first.
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(status) = run.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the run did not finish within 300 s of the freeze"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let after_freeze = stopped_at.elapsed();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut run.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{stderr}");
    eprintln!("the run ended {after_freeze:?} after the freeze; its log:\n{stderr}");

    // Every step trained on all 16 samples of its 4 prompts, exactly once each, and on the same
    // prompts as the uninterrupted in-process run.
    let m = metrics(&frozen);
    assert_eq!(metric_series(&m, "batch/samples"), vec![16.0; steps], "{stderr}");
    assert_eq!(prompts_seen(&local), prompts_seen(&frozen));
    // Both freezes were noticed, counted, and the workers replaced.
    eprintln!(
        "failures {:?}, replaced {:?}, step times {:?}",
        metric_series(&m, "workers/failures_total"),
        metric_series(&m, "workers/replaced_total"),
        metric_series(&m, "timing_s/step")
    );
    let last = |key: &str| metric_series(&m, key).last().copied().unwrap_or(0.0);
    assert!(
        last("workers/failures_total") >= 2.0,
        "both freezes count: {stderr}"
    );
    // Both were replaced (the run may end before the slower replacement, a rollout worker
    // compiling its programs, is in; the metrics count those put in).
    for role in ["rollout", "reward"] {
        assert!(
            stderr.contains(&format!("starting a replacement for {role} worker 0")),
            "{role}: {stderr}"
        );
    }
    assert!(last("workers/replaced_total") >= 1.0, "{stderr}");
    // Noticed within seconds: no step waited anywhere near the 70 s call deadline of the
    // reward client or a stalled stream.
    let slowest = metric_series(&m, "timing_s/step").into_iter().fold(0.0, f64::max);
    assert!(
        slowest < 45.0,
        "a step took {slowest:.1} s ({after_freeze:?} from the freeze to the end): {stderr}"
    );
    // The frozen processes were killed when their replacements started, and no worker
    // outlives the run.
    for pid in stopped {
        assert!(!process_alive(pid), "frozen worker {pid} is still there");
    }
    assert!(run_worker_pids(&frozen, "rollout").is_empty());
    assert!(run_worker_pids(&frozen, "reward").is_empty());
}

/// A rollout worker that acknowledges a weight update without installing it (VeRL #7495, TRL
/// #5312: the sampler keeps the old weights and the run trains on their samples as if they were
/// new). The worker reports the checksum of the weights it samples with, the orchestrator
/// compares it with what it sent, and the run stops naming the worker: for full weights and
/// for a LoRA run's adapters alike.
#[test]
fn a_rollout_worker_that_skips_a_weight_install_stops_the_run_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 64, 4);
    let lora: &[&str] = &["--set", "actor.lora_rank=4", "--set", "actor.optim.lr=0.05"];
    for (name, sets) in [("full", &[][..]), ("lora", lora)] {
        let out = dir.path().join(name);
        let r = tiny_recipe(
            dir.path(),
            &format!("{name}.yaml"),
            &model,
            &train,
            &val,
            &out,
            3,
            "cluster:\n  rollout_workers: 1\n",
        );
        let o = grpo()
            .args(["run", r.to_str().unwrap(), "--quiet"])
            .args(sets)
            .env("GRPO_FAULT_SKIP_WEIGHT_INSTALL", "2")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{name}: {err}");
        assert!(
            err.contains("acknowledged weight version 2 but reports version 2 with checksum")
                && err.contains("it does not sample with them"),
            "{name}: {err}"
        );
        assert!(err.contains("rollout worker http://127.0.0.1:"), "{name}: {err}");
        // Step 2's update never reached the sampler: the step stops at its weight sync, before
        // its metrics, and step 3 never runs.
        assert_eq!(
            metrics(&out).keys().copied().collect::<Vec<_>>(),
            vec![0, 1],
            "{name}"
        );
    }
}
