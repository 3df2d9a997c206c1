//! `trainer.logger` in whole runs: the same VeRL-named metrics reach `metrics.jsonl`,
//! TensorBoard (read back by its own loader), a local MLflow server and an offline wandb run,
//! and a resumed run continues the same tracker runs.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use testkit::trackers::{python, read_tensorboard, read_wandb, MlflowServer};

fn run_with_trackers(recipe: &Path, home: &Path, mlflow: &str, set: &[&str]) -> String {
    let mut command = grpo();
    command.args(["run", recipe.to_str().unwrap(), "--quiet"]);
    for s in set {
        command.args(["--set", s]);
    }
    let out = command
        .env("MLFLOW_TRACKING_URI", mlflow)
        .env("WANDB_MODE", "offline")
        .env("GRPO_PYTHON", python())
        .env("HOME", home)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}");
    stderr
}

fn wandb_run_file(output: &Path, id: &str) -> PathBuf {
    let runs: Vec<PathBuf> = std::fs::read_dir(output.join("wandb"))
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
    // A resumed run writes a second directory for the same run id.
    let file = runs
        .iter()
        .map(|r| r.join(format!("run-{id}.wandb")))
        .filter(|f| f.is_file())
        .max()
        .unwrap_or_else(|| panic!("no offline run of {id} in {runs:?}"));
    file
}

#[test]
fn every_tracker_gets_the_runs_verl_named_metrics_and_a_resume_continues_them() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 16, 8);
    let server = MlflowServer::start(dir.path());
    let out = dir.path().join("out");
    let recipe = tiny_recipe(
        dir.path(),
        "tracked.yaml",
        &model,
        &train,
        &val,
        &out,
        3,
        "  logger: [console, file, tensorboard, mlflow, wandb]\n  project_name: grpo-e2e\n  experiment_name: tiny\n  \
         log_val_generations: 2\n",
    );
    let stderr = run_with_trackers(&recipe, dir.path(), &server.uri, &[]);
    assert!(!stderr.contains("logger"), "a tracker complained: {stderr}");
    let m = metrics(&out);
    assert_eq!(m.keys().copied().collect::<Vec<_>>(), [0, 1, 2, 3]);
    let keys = [
        "critic/score/mean",
        "critic/advantages/max",
        "actor/pg_loss",
        "response_length/mean",
        "timing_s/gen",
        "perf/throughput",
    ];

    // TensorBoard: every step's metrics, as TensorBoard loads them.
    let tb = read_tensorboard(&out.join("tensorboard"));
    for key in keys {
        let points: Vec<(u64, f64)> = tb[key]
            .as_array()
            .unwrap_or_else(|| panic!("TensorBoard has no {key}"))
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
            .collect();
        let want: Vec<(u64, f64)> = (1..=3).map(|s| (s, m[&s][key].as_f64().unwrap())).collect();
        assert_eq!(points.len(), 3, "{key}: {points:?}");
        for ((step, got), (want_step, want)) in points.iter().zip(&want) {
            assert_eq!(step, want_step);
            assert_eq!(*got as f32, *want as f32, "{key} at step {step}");
        }
    }
    let val_steps: Vec<u64> = tb[VAL_CORE]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect();
    assert_eq!(val_steps, [0, 2, 3]);
    // Two validation generations at each validation, real responses with their scores.
    let validation = |step: u64| -> Vec<serde_json::Value> {
        std::fs::read_to_string(out.join(format!("validation/step_{step}.jsonl")))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let texts = tb["text"]["val/generations"].as_array().unwrap();
    assert_eq!(
        texts.iter().map(|t| t[0].as_u64().unwrap()).collect::<Vec<_>>(),
        [0, 2, 3]
    );
    let markdown = texts[1][1].as_str().unwrap();
    assert_eq!(markdown.matches("### Sample").count(), 2, "{markdown}");
    assert!(validation(2)
        .iter()
        .any(|v| markdown.contains(&format!("**Output:** {}\n", v["response"].as_str().unwrap()))));

    // MLflow: the run of this output directory, every metric at every step, the recipe as
    // parameters, finished.
    let ids: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tracking.json")).unwrap()).unwrap();
    let run_id = ids["mlflow_run_id"].as_str().unwrap().to_string();
    let run = server.get("runs/get", &[("run_id", &run_id)])["run"].clone();
    assert_eq!(run["info"]["status"], "FINISHED");
    assert_eq!(run["info"]["run_name"], "tiny");
    let params = run["data"]["params"].as_array().unwrap();
    assert!(params
        .iter()
        .any(|p| p["key"] == "trainer/project_name" && p["value"] == "grpo-e2e"));
    for key in keys {
        let history = server.history(&run_id, key);
        let want: Vec<(u64, serde_json::Value)> = (1..=3).map(|s| (s, m[&s][key].clone())).collect();
        assert_eq!(history, want, "{key}");
    }
    let val = server.history(&run_id, &VAL_CORE.replace('@', "_at_"));
    assert_eq!(val.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 2, 3]);
    let artifacts = server.get("artifacts/list", &[("run_id", &run_id)]);
    let names: Vec<&str> = artifacts["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["val_step0.json", "val_step2.json", "val_step3.json"]);
    let stored: Vec<serde_json::Value> = serde_json::from_slice(
        &std::fs::read(
            dir.path()
                .join("artifacts")
                .join(run["info"]["experiment_id"].as_str().unwrap())
                .join(&run_id)
                .join("artifacts/val_step2.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(stored.len(), 2);
    for g in &stored {
        assert!(
            validation(2)
                .iter()
                .any(|v| v["response"] == g["output"] && v["score"] == g["score"]),
            "{g} is not a validation response of step 2"
        );
    }

    // wandb: the offline run holds every step.
    let wandb_id = ids["wandb_run_id"].as_str().unwrap().to_string();
    let wandb = read_wandb(&wandb_run_file(&out, &wandb_id));
    assert_eq!(wandb["run"]["project"], "grpo-e2e");
    assert_eq!(wandb["config"]["trainer"]["experiment_name"], "tiny");
    let rows = wandb["history"].as_array().unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| r["_step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    for row in &rows[1..] {
        let step = row["_step"].as_u64().unwrap();
        assert_eq!(row["critic/score/mean"], m[&step]["critic/score/mean"]);
    }
    assert_eq!(rows[2]["val/generations/_type"], "table-file");
    assert_eq!(rows[2]["val/generations/nrows"], 2, "a row per validation so far");

    // Resumed from the checkpoint of step 3 for one more step: the same MLflow and wandb runs.
    run_with_trackers(
        &recipe,
        dir.path(),
        &server.uri,
        &["trainer.total_training_steps=4"],
    );
    let ids: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tracking.json")).unwrap()).unwrap();
    assert_eq!(ids["mlflow_run_id"], run_id.as_str());
    assert_eq!(ids["wandb_run_id"], wandb_id.as_str());
    let m = metrics(&out);
    let score = server.history(&run_id, "critic/score/mean");
    assert_eq!(score.last().unwrap(), &(4, m[&4]["critic/score/mean"].clone()));
    assert_eq!(score.len(), 4);
    let tb = read_tensorboard(&out.join("tensorboard"));
    let steps: Vec<u64> = tb["critic/score/mean"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4]);
    let resumed = read_wandb(&wandb_run_file(&out, &wandb_id));
    let steps: Vec<u64> = resumed["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["_step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [4]);
}

#[test]
fn without_file_and_console_a_run_writes_no_metrics_file_and_no_step_lines() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 8, 4);
    let out = dir.path().join("out");
    let recipe = tiny_recipe(
        dir.path(),
        "quiet.yaml",
        &model,
        &train,
        &val,
        &out,
        1,
        "  logger: tensorboard\n",
    );
    let o = grpo().args(["run", recipe.to_str().unwrap()]).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(!out.join("metrics.jsonl").exists());
    assert!(!stderr.contains("step 1/1"), "{stderr}");
    let tb = read_tensorboard(&out.join("tensorboard"));
    assert_eq!(tb["critic/score/mean"].as_array().unwrap().len(), 1);
}
