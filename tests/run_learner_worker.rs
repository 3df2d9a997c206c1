//! The learner role in a worker process (`cluster.learner_workers: 1`): a run with every role in
//! its own process trains exactly as the run in one process (its weights passing through the
//! orchestrator to the rollout worker as host bytes, never through a device), writes the same
//! checkpoints from the state it fetches over gRPC, resumes by sending a checkpoint's state to a
//! fresh learner worker, stops with an error naming the learner worker when it dies, and the
//! worker refuses callers without the run's token.

mod common;

use actors::auth::Token;
use actors::proto;
use actors::roles::learner::{LearnerRole, RemoteLearner};
use actors::roles::RoleError;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// The shared tiny recipe (`common::tiny_recipe`, 3 steps) as `dir/NAME.yaml`, writing to
/// `dir/NAME`.
fn recipe(dir: &Path, name: &str, model: &Path, train: &Path, val: &Path, extra: &str) -> (PathBuf, PathBuf) {
    let output = dir.join(name);
    let path = tiny_recipe(dir, &format!("{name}.yaml"), model, train, val, &output, 3, extra);
    (path, output)
}

/// `grpo run RECIPE --quiet ARGS...`, which must succeed; returns its stderr.
fn run(recipe: &Path, args: &[&str]) -> String {
    let o = grpo()
        .arg("run")
        .arg(recipe)
        .arg("--quiet")
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{stderr}");
    stderr
}

/// The raw `metrics.jsonl` lines of `steps` (none while the file does not exist yet).
fn lines(output: &Path, steps: &[u64]) -> Vec<String> {
    std::fs::read_to_string(output.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| steps.iter().any(|s| l.starts_with(&format!("{{\"step\":{s},"))))
        .map(str::to_string)
        .collect()
}

const KEYS: [&str; 9] = [
    "critic/score/mean",
    "critic/score/std",
    "response_length/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/kl",
    "actor/lr",
    "weights/version",
];

#[test]
fn a_learner_worker_trains_checkpoints_and_resumes_like_the_in_process_learner() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 64);
    let val = arithmetic(dir.path(), "val", 2, 4);
    let (r_local, local) = recipe(dir.path(), "local", &model, &train, &val, "");
    let (r_remote, remote) = recipe(
        dir.path(),
        "remote",
        &model,
        &train,
        &val,
        "cluster:\n  learner_workers: 1\n  rollout_workers: 1\n  reward_workers: 1\n",
    );
    run(&r_local, &[]);
    run(&r_remote, &[]);
    assert!(
        remote.join("logs/learner-0.log").is_file(),
        "no learner worker was started"
    );

    // Same samples, same updates: every metric matches the in-process run's, step by step.
    let (a, b) = (metrics(&local), metrics(&remote));
    assert_eq!(a.keys().collect::<Vec<_>>(), vec![&0, &1, &2, &3]);
    let (rewards, pg_loss) = (
        metric_series(&a, "critic/score/std"),
        metric_series(&a, "actor/pg_loss"),
    );
    assert!(
        rewards.iter().all(|s| *s > 0.0) && pg_loss.iter().all(|l| *l != 0.0),
        "the rewards should vary within a step and drive the update: {rewards:?} {pg_loss:?} {:?}; \
         responses: {}",
        metric_series(&a, "critic/score/mean"),
        std::fs::read_to_string(local.join("validation/step_0.jsonl")).unwrap_or_default()
    );
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for key in KEYS {
        assert_eq!(
            metric_series(&a, key),
            metric_series(&b, key),
            "{key}: in process vs learner worker"
        );
    }
    for step in [0, 2, 3] {
        assert_eq!(a[&step][VAL_CORE], b[&step][VAL_CORE], "step {step}");
    }
    assert_eq!(prompts_seen(&local), prompts_seen(&remote));
    // The learner worker's weights stream on to the rollout worker from host memory: the
    // orchestrator's own client never uploads or reads them.
    for step in [1, 2, 3] {
        for key in ["weights/host_transfers", "weights/host_transfer_bytes"] {
            assert_eq!(b[&step][key], 0.0, "step {step}: {key}");
        }
    }

    // The checkpoint written from the state fetched over gRPC is the in-process one, byte for
    // byte (parameters and AdamW moments).
    for step in ["step_2", "step_3"] {
        for file in ["params.safetensors", "optimizer.safetensors"] {
            let read = |out: &Path| {
                std::fs::read(out.join("checkpoints").join(step).join(file))
                    .unwrap_or_else(|e| panic!("{step}/{file} in {}: {e}", out.display()))
            };
            assert!(read(&local) == read(&remote), "{step}/{file} differs");
        }
    }

    // Resume: without the step-3 checkpoint the next run starts from step 2, sending its state
    // to a new learner worker, and computes step 3 exactly again.
    let step_3 = remote.join("checkpoints/step_3");
    std::fs::remove_dir_all(&step_3).unwrap();
    let before = lines(&remote, &[1, 2]);
    run(&r_remote, &[]);
    assert_eq!(lines(&remote, &[1, 2]), before, "steps 1-2 were not run again");
    let c = metrics(&remote);
    for key in KEYS {
        assert_eq!(
            metric_series(&a, key),
            metric_series(&c, key),
            "{key}: in process vs resumed learner worker"
        );
    }
    assert_eq!(a[&3][VAL_CORE], c[&3][VAL_CORE]);
    assert!(step_3.is_dir(), "the resumed run saves step 3 again");
    for role in ["learner", "rollout", "reward"] {
        assert!(
            run_worker_pids(&remote, role).is_empty(),
            "a {role} worker outlived the run"
        );
    }

    // One-step off-policy: step k+1 is generated while the learner worker updates step k.
    let off_policy = |recipe: &Path, name: &str| {
        let out = dir.path().join(name);
        let set_out = out.display().to_string();
        run(
            recipe,
            &[
                "--set",
                "trainer.off_policy_steps=1",
                "--set",
                "trainer.total_training_steps=2",
                "--output",
                &set_out,
            ],
        );
        metrics(&out)
    };
    let (a, b) = (
        off_policy(&r_local, "local-off-policy"),
        off_policy(&r_remote, "remote-off-policy"),
    );
    assert_eq!(b.keys().collect::<Vec<_>>(), vec![&0, &1, &2]);
    for key in KEYS {
        assert_eq!(
            metric_series(&a, key),
            metric_series(&b, key),
            "{key}: off-policy, in process vs learner worker"
        );
    }
    assert_eq!(metric_series(&b, "weights/version_lag"), vec![0.0, 1.0]);

    // A learner worker killed mid-run stops the run with an error that names it and says how
    // to go on.
    let (r_killed, killed) = recipe(
        dir.path(),
        "killed",
        &model,
        &train,
        &val,
        "cluster:\n  learner_workers: 1\n",
    );
    let mut child = grpo()
        .arg("run")
        .arg(&r_killed)
        .arg("--quiet")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while lines(&killed, &[1]).is_empty() {
        assert!(t.elapsed().as_secs() < 300, "no step 1 after 300 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pids = run_worker_pids(&killed, "learner");
    assert_eq!(pids.len(), 1, "learner workers: {pids:?}");
    assert!(std::process::Command::new("kill")
        .args(["-9", &pids[0].to_string()])
        .status()
        .unwrap()
        .success());
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "the run went on without its learner: {stderr}"
    );
    let log = killed.join("logs").join("learner-0.log");
    for part in [
        format!("learner worker 0 (pid {}, log {})", pids[0], log.display()),
        "The run stops here; run `grpo run` again with the same recipe and it resumes".to_string(),
    ] {
        assert!(stderr.contains(&part), "missing {part:?} in: {stderr}");
    }
    eprintln!("the run's error when its learner worker died:\n{stderr}");
}

#[test]
fn a_learner_worker_refuses_callers_without_the_runs_token() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 8);
    let val = arithmetic(dir.path(), "val", 2, 4);
    let (recipe, _) = recipe(dir.path(), "r", &model, &train, &val, "");
    let token = Token::generate();
    let token_file = dir.path().join("token");
    token.write(&token_file).unwrap();
    let mut worker = WorkerProcess::start(&mut common::worker("learner", &recipe, &token_file));
    let address = worker.loopback_address();

    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let specs = Vec::new();
        let timeout = Duration::from_secs(10);
        // Another run's token: refused.
        let intruder = RemoteLearner::with_timeout(
            &address,
            &Token::generate(),
            None,
            timeout,
            specs.clone(),
            specs.clone(),
        )
        .unwrap();
        match intruder.update(Vec::new()).await {
            Err(RoleError::Refused { role, message, .. }) => {
                assert_eq!(role, "learner");
                assert!(message.starts_with("wrong token"), "{message}");
            }
            Err(other) => panic!("expected a refusal, got {other}"),
            Ok(_) => panic!("an intruder's update was accepted"),
        }
        common::assert_wrong_token(intruder.state().await.map(|_| "the learner's state"));
        // No token at all: refused.
        let mut anonymous = proto::learner_client::LearnerClient::connect(address.clone())
            .await
            .unwrap();
        common::assert_missing_token(
            anonymous
                .update(proto::LearnerUpdateRequest { rows: vec![] })
                .await
                .map(|_| ()),
        );
        // The run's token gets through to the learner, which has not been started yet.
        let owner =
            RemoteLearner::with_timeout(&address, &token, None, timeout, specs.clone(), specs).unwrap();
        match owner.update(Vec::new()).await {
            Err(RoleError::Refused { message, .. }) => assert_eq!(
                message,
                "this learner worker has not been started: call Start first"
            ),
            Err(other) => panic!("expected a refusal, got {other}"),
            Ok(_) => panic!("an update before Start was accepted"),
        }
    });
}
