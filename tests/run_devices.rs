//! Per-role device kinds: `cluster.rollout_device` / `cluster.learner_device` must name a device
//! kind whose PJRT plugin can be found, and `grpo run` says which key is wrong before it does any
//! work (no model loaded, no worker started, no metrics written).

mod common;

use common::*;

#[test]
fn a_rollout_device_without_its_plugin_stops_the_run_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // The model path does not exist: the run must stop on the device before it looks at it.
    let recipe = dir.path().join("r.yaml");
    std::fs::write(
        &recipe,
        format!(
            "model:\n  path: {}\ndata:\n  train_files: {}\n\
             trainer:\n  output_dir: {}\n\
             cluster:\n  rollout_workers: 1\n  rollout_device: cuda\n",
            dir.path().join("no-model").display(),
            dir.path().join("no-data.parquet").display(),
            out.display()
        ),
    )
    .unwrap();
    let missing = dir.path().join("no-cuda-plugin.so");
    let o = grpo()
        .arg("run")
        .arg(&recipe)
        .arg("--quiet")
        .env("GRPO_PJRT_CUDA", &missing)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "`cluster.rollout_device` = cuda: PJRT plugin {} (from $GRPO_PJRT_CUDA) does not exist",
            missing.display()
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("no-model"), "nothing was loaded: {stderr}");
    assert!(!out.join("metrics.jsonl").exists());
    assert!(!out.join("logs").exists(), "no worker was started");

    // In the orchestrator's process the key has no meaning, and the recipe says so.
    let o = grpo()
        .arg("run")
        .arg(&recipe)
        .args(["--set", "cluster.rollout_workers=0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("`cluster.rollout_device` = cuda: applies to rollout worker processes"),
        "{stderr}"
    );
}
