//! The trackers against the real things: TensorBoard's own event reader, a local `mlflow
//! server`, and wandb's offline run files (`testkit::trackers`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use testkit::trackers::{python, read_tensorboard, read_wandb, MlflowServer};
use tracking::{Generation, Logger, Metrics, Tracker, TrackingConfig};

fn generations() -> Vec<Generation> {
    vec![
        Generation {
            input: "What is 2+3?".into(),
            output: "5".into(),
            score: 1.0,
        },
        Generation {
            input: "What is 7-9?".into(),
            output: "-1".into(),
            score: 0.0,
        },
    ]
}

fn config(loggers: &[Logger], output: &Path, env: &[(&str, &str)]) -> TrackingConfig {
    TrackingConfig {
        loggers: loggers.to_vec(),
        project: "grpo-tests".into(),
        experiment: "tiny run".into(),
        output: output.to_path_buf(),
        resume: false,
        start_step: 0,
        params: serde_json::json!({"trainer": {"logger": ["console", "mlflow"], "seed": 7}, "actor": {"optim": {"lr": 1e-6}}}),
        env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
    }
}

fn step_metrics(step: u64) -> Metrics {
    let mut m = Metrics::new();
    m.insert("critic/score/mean".into(), 0.25 * step as f64);
    m.insert("actor/pg_loss".into(), -0.5 + step as f64 / 8.0);
    m.insert("val-core/gsm8k/acc/mean@4".into(), 0.125);
    m.insert("actor/kl".into(), f64::NAN);
    m
}

#[test]
fn tensorboard_reads_back_every_step_once_across_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let tb = dir.path().join("tb");
    let env = [("TENSORBOARD_DIR", tb.to_str().unwrap())];
    let first = Tracker::start(config(&[Logger::Console, Logger::Tensorboard], dir.path(), &env));
    for step in 1..=3 {
        if step == 2 {
            first.log_generations(step, generations());
        }
        first.log(step, &step_metrics(step));
    }
    let report = first.finish(true, Duration::from_secs(30));
    assert_eq!(report.trackers, vec![(Logger::Tensorboard, 3, 0, None)]);
    // Resumed from the checkpoint of step 2: step 3 again, with other values, then step 4.
    std::thread::sleep(Duration::from_millis(1100));
    let mut resumed = config(&[Logger::Tensorboard], dir.path(), &env);
    resumed.resume = true;
    resumed.start_step = 2;
    let second = Tracker::start(resumed);
    for step in 3..=4 {
        let mut m = step_metrics(step);
        m.insert("critic/score/mean".into(), 10.0 + step as f64);
        second.log(step, &m);
    }
    second.finish(true, Duration::from_secs(30));

    let scalars = read_tensorboard(&tb);
    let series = |tag: &str| -> Vec<(u64, f64)> {
        scalars[tag]
            .as_array()
            .unwrap_or_else(|| panic!("no {tag} in {scalars}"))
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
            .collect()
    };
    assert_eq!(
        series("critic/score/mean"),
        vec![(1, 0.25), (2, 0.5), (3, 13.0), (4, 14.0)]
    );
    assert_eq!(
        series("val-core/gsm8k/acc/mean@4"),
        vec![(1, 0.125), (2, 0.125), (3, 0.125), (4, 0.125)]
    );
    assert_eq!(series("actor/pg_loss")[0], (1, -0.375));
    assert!(scalars["actor/kl"][0][1].is_null() || scalars["actor/kl"][0][1].as_f64().is_none());
    // The generations as VeRL's markdown in TensorBoard's text tab.
    let text = &scalars["text"]["val/generations"];
    assert_eq!(text[0][0], 2);
    let markdown = text[0][1].as_str().unwrap();
    assert!(
        markdown.starts_with("**Generation Results - Step 2**")
            && markdown.contains("### Sample 2\n**Input:** What is 7-9?\n\n**Output:** -1\n\n**Score:** 0"),
        "{markdown}"
    );
}

fn run_ids(output: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(output.join("tracking.json")).unwrap()).unwrap()
}

#[test]
fn an_mlflow_server_receives_every_metric_and_a_resume_continues_its_run() {
    let dir = tempfile::tempdir().unwrap();
    let server = MlflowServer::start(dir.path());
    let output = dir.path().join("out");
    std::fs::create_dir_all(&output).unwrap();
    let server_uri = server.uri.clone();
    let env = [("MLFLOW_TRACKING_URI", server_uri.as_str())];
    let tracker = Tracker::start(config(&[Logger::Mlflow], &output, &env));
    for step in 1..=2 {
        tracker.log(step, &step_metrics(step));
    }
    tracker.log_generations(2, generations());
    assert_eq!(
        tracker.finish(true, Duration::from_secs(60)).trackers,
        vec![(Logger::Mlflow, 2, 0, None)]
    );
    let run_id = run_ids(&output)["mlflow_run_id"].as_str().unwrap().to_string();

    let run = server.get("runs/get", &[("run_id", &run_id)])["run"].clone();
    assert_eq!(run["info"]["status"], "FINISHED");
    assert_eq!(run["info"]["run_name"], "tiny run");
    let experiment = server.get(
        "experiments/get",
        &[("experiment_id", run["info"]["experiment_id"].as_str().unwrap())],
    );
    assert_eq!(experiment["experiment"]["name"], "grpo-tests");
    let params: BTreeMap<String, String> = run["data"]["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["key"].as_str().unwrap().into(),
                p["value"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(params["trainer/seed"], "7");
    assert_eq!(params["trainer/logger/1"], "mlflow");
    assert_eq!(params["actor/optim/lr"], "1e-6");
    let score = server.history(&run_id, "critic/score/mean");
    assert_eq!(score, vec![(1, 0.25.into()), (2, 0.5.into())]);
    assert_eq!(server.history(&run_id, "val-core/gsm8k/acc/mean_at_4").len(), 2);
    assert_eq!(server.history(&run_id, "actor/kl")[0].1, "NaN");
    // The generations as VeRL's artifact, through the server's artifact proxy.
    let listed = server.get("artifacts/list", &[("run_id", &run_id)]);
    assert_eq!(listed["files"][0]["path"], "val_step2.json", "{listed}");
    let stored = dir
        .path()
        .join("artifacts")
        .join(run["info"]["experiment_id"].as_str().unwrap())
        .join(&run_id)
        .join("artifacts/val_step2.json");
    let stored: serde_json::Value = serde_json::from_slice(&std::fs::read(stored).unwrap()).unwrap();
    assert_eq!(stored, serde_json::to_value(generations()).unwrap());

    // A resume logs into the same run, which runs again and finishes again.
    let mut resumed = config(&[Logger::Mlflow], &output, &env);
    resumed.resume = true;
    resumed.start_step = 2;
    let tracker = Tracker::start(resumed);
    tracker.log(3, &step_metrics(3));
    tracker.finish(false, Duration::from_secs(60));
    assert_eq!(run_ids(&output)["mlflow_run_id"], run_id.as_str());
    assert_eq!(server.history(&run_id, "critic/score/mean").len(), 3);
    let run = server.get("runs/get", &[("run_id", &run_id)])["run"].clone();
    assert_eq!(run["info"]["status"], "FAILED");

    // The server gone: the tracker warns and counts, and logging never blocks the caller.
    drop(server);
    let tracker = Tracker::start(config(&[Logger::Mlflow], &output, &env));
    let started = Instant::now();
    tracker.log(1, &step_metrics(1));
    assert!(started.elapsed() < Duration::from_millis(100));
    let report = tracker.finish(true, Duration::from_secs(60));
    assert_eq!(report.trackers, vec![], "a tracker that cannot start is left out");
    assert_eq!(report.not_started.len(), 1);
    assert!(
        report.not_started[0].1.contains(&server_uri),
        "{:?}",
        report.not_started
    );
}

#[test]
fn a_new_run_in_its_own_output_directory_replaces_the_previous_curves() {
    let dir = tempfile::tempdir().unwrap();
    let old = Tracker::start(config(&[Logger::Tensorboard], dir.path(), &[]));
    for step in 1..=3 {
        old.log(step, &step_metrics(step));
    }
    old.finish(true, Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(1100));
    let new = Tracker::start(config(&[Logger::Tensorboard], dir.path(), &[]));
    let mut m = step_metrics(1);
    m.insert("critic/score/mean".into(), 7.0);
    new.log(1, &m);
    new.finish(true, Duration::from_secs(30));
    let scalars = read_tensorboard(&dir.path().join("tensorboard"));
    assert_eq!(scalars["critic/score/mean"], serde_json::json!([[1, 7.0]]));
}

#[test]
fn mlflow_needs_an_http_tracking_uri_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let unset = config(&[Logger::Mlflow], dir.path(), &[]);
    assert!(unset.check().unwrap_err().contains("needs MLFLOW_TRACKING_URI"));
    let file = config(
        &[Logger::Mlflow],
        dir.path(),
        &[("MLFLOW_TRACKING_URI", "sqlite:///x.db")],
    );
    let error = file.check().unwrap_err();
    assert!(
        error.contains("http:// or https://") && error.contains("mlflow server"),
        "{error}"
    );
}

#[test]
fn wandb_offline_runs_hold_every_step_and_wandb_sync_accepts_them() {
    let dir = tempfile::tempdir().unwrap();
    let python = python();
    let env = [
        ("WANDB_MODE", "offline"),
        ("GRPO_PYTHON", python.to_str().unwrap()),
        ("HOME", dir.path().to_str().unwrap()),
    ];
    let tracker = Tracker::start(config(&[Logger::File, Logger::Wandb], dir.path(), &env));
    for step in 1..=3 {
        if step == 2 {
            tracker.log_generations(step, generations());
        }
        tracker.log(step, &step_metrics(step));
    }
    assert_eq!(
        tracker.finish(true, Duration::from_secs(120)).trackers,
        vec![(Logger::Wandb, 3, 0, None)]
    );
    let id = run_ids(dir.path())["wandb_run_id"].as_str().unwrap().to_string();
    let runs: Vec<PathBuf> = std::fs::read_dir(dir.path().join("wandb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("offline-run-")
        })
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let file = runs[0].join(format!("run-{id}.wandb"));
    let run = read_wandb(&file);
    assert_eq!(run["run"]["project"], "grpo-tests");
    assert_eq!(run["run"]["name"], "tiny run");
    assert_eq!(run["config"]["trainer"]["seed"], 7);
    assert_eq!(run["exit_code"], 0);
    let rows = run["history"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{rows:?}");
    for (row, step) in rows.iter().zip(1..) {
        assert_eq!(row["_step"], step);
        assert_eq!(row["critic/score/mean"], 0.25 * step as f64);
        assert_eq!(row["val-core/gsm8k/acc/mean@4"], 0.125);
    }
    // VeRL's `val/generations` table at step 2: step, then input, output and score per sample.
    // (wandb stores a logged table's fields under the table's key: `val/generations/_type`, ...)
    assert_eq!(rows[1]["val/generations/_type"], "table-file", "{}", rows[1]);
    let path = rows[1]["val/generations/path"].as_str().unwrap();
    let table: serde_json::Value =
        serde_json::from_slice(&std::fs::read(runs[0].join("files").join(path)).unwrap()).unwrap();
    assert_eq!(
        table["columns"],
        serde_json::json!(["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"])
    );
    assert_eq!(
        table["data"],
        serde_json::json!([[2, "What is 2+3?", "5", 1.0, "What is 7-9?", "-1", 0.0]])
    );

    // wandb's own command accepts the run for syncing.
    let sync = Command::new(python.with_file_name("wandb"))
        .args(["sync", "--dry-run"])
        .arg(&runs[0])
        .env("HOME", dir.path())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&sync.stderr).to_string() + &String::from_utf8_lossy(&sync.stdout);
    assert!(
        sync.status.success() && said.contains("Would sync 1 run"),
        "{said}"
    );
}

#[test]
fn a_python_without_wandb_leaves_the_logger_out_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    // A Python that is not the test environment's: its own, isolated from site-packages.
    let script = dir.path().join("python");
    std::fs::write(
        &script,
        format!("#!/bin/sh\nexec {} -I -S \"$@\"\n", python().display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let env = [("GRPO_PYTHON", script.to_str().unwrap())];
    let tracker = Tracker::start(config(&[Logger::Wandb, Logger::Tensorboard], dir.path(), &env));
    tracker.log(1, &step_metrics(1));
    let report = tracker.finish(true, Duration::from_secs(60));
    // TensorBoard goes on alone.
    assert_eq!(report.trackers, vec![(Logger::Tensorboard, 1, 0, None)]);
    let (logger, reason) = &report.not_started[0];
    assert_eq!(*logger, Logger::Wandb);
    assert!(
        reason.contains("cannot import wandb") && reason.contains("pip install wandb"),
        "{reason}"
    );
}
