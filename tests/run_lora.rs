//! `grpo run` with LoRA (`actor.lora_rank`) on a tiny random-weight model with SmolLM2's
//! tokenizer: the learner trains only the adapters, the rollout samples from the merged
//! weights, the checkpoint holds the adapters under PEFT's names and resumes, `grpo export`
//! writes a PEFT adapter (or with `--merged` the merged model) that `grpo generate --adapter`
//! and the merged model answer alike with, and the keys are refused where they would do nothing.
//! With rollout and learner worker processes only the adapters cross the network and a worker
//! killed mid-run loses nothing (a worker that drops an adapter update: tests/run_faults.rs).

mod common;

use common::*;
use model::lora::LoraAdapter;
use model::safetensors_io::load_hf_checkpoint;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// The LoRA settings of these runs.
const LORA: [&str; 10] = [
    "--set",
    "actor.lora_rank=4",
    "--set",
    "actor.lora_alpha=8",
    "--set",
    "actor.target_modules=[q_proj, v_proj, down_proj]",
    "--set",
    "actor.optim.lr=0.05",
    // One optimizer step per step, so step 1's loss is taken before any update.
    "--set",
    "actor.ppo_mini_batch_size=4",
];

/// Kills the run (and, through it, its workers) if a test ends early.
struct KillOnDrop(Option<std::process::Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut run) = self.0.take() {
            let _ = run.kill();
            let _ = run.wait();
        }
    }
}

#[test]
fn a_lora_run_trains_the_adapters_exports_them_for_peft_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 64, 4);
    let out = dir.path().join("out");
    let r = tiny_recipe(dir.path(), "r.yaml", &model, &train, &val, &out, 2, "");
    let lora_args = LORA;
    let run = |steps: &str| {
        let mut args = vec!["run", r.to_str().unwrap(), "--quiet", "--set", steps];
        args.extend_from_slice(&lora_args);
        run_grpo(&args)
    };
    let o = run("trainer.total_training_steps=2");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = metrics(&out);
    // The adapters start at B = 0: the policy is the base, which is the KL reference.
    assert_eq!(m[&1]["actor/kl"], 0.0, "{}", m[&1]);
    assert!(m[&1]["actor/grad_norm"].as_f64().unwrap() > 0.0);
    assert_eq!(m[&2]["weights/version"], 2.0);

    // The checkpoint holds the adapters only, under PEFT's names, and resumes.
    let ck = trainer::checkpoint::load_checkpoint(&out.join("checkpoints/step_2")).unwrap();
    let names: Vec<&str> = ck.tensors["params"].iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names.len(), 2 * 3 * 2, "{names:?}");
    assert!(
        names
            .iter()
            .all(|n| n.starts_with("base_model.model.model.layers.")
                && (n.ends_with(".lora_A.weight") || n.ends_with(".lora_B.weight"))),
        "{names:?}"
    );
    let o = run("trainer.total_training_steps=3");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(metrics(&out)[&3]["weights/version"], 3.0);

    // The PEFT adapter, and the merged model.
    let adapter_dir = dir.path().join("adapter");
    let merged_dir = dir.path().join("merged");
    let export = |to: &std::path::Path, merged: bool| {
        let mut args = vec!["export", out.to_str().unwrap(), "--output", to.to_str().unwrap()];
        if merged {
            args.push("--merged");
        }
        let o = run_grpo(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    export(&adapter_dir, false);
    export(&merged_dir, true);
    let base = load_hf_checkpoint(&model).unwrap();
    let adapter = LoraAdapter::load_peft(&adapter_dir, &base.config).unwrap();
    assert_eq!((adapter.lora.rank, adapter.lora.alpha), (4, 8.0));
    assert!(
        adapter.tensors[1].to_f32_vec().iter().any(|&b| b != 0.0),
        "B never moved from zero"
    );
    let merged = load_hf_checkpoint(&merged_dir).unwrap();
    let get = |w: &model::ModelWeights, n: &str| w.get(n).unwrap().to_f32_vec();
    let (q, k) = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    );
    assert_ne!(
        get(&merged, q),
        get(&base, q),
        "the adapted q_proj did not change"
    );
    assert_eq!(
        get(&merged, k),
        get(&base, k),
        "k_proj has no adapter and must not change"
    );

    // Generating with the adapter on the base equals generating with the merged model.
    let generate = |model: &std::path::Path, adapter: Option<&std::path::Path>| {
        let mut c = grpo();
        c.args(["generate", "--prompt", "What is 2 + 3?", "--temperature", "0"])
            .args(["--max-new-tokens", "8", "--model"])
            .arg(model);
        if let Some(a) = adapter {
            c.arg("--adapter").arg(a);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        o.stdout
    };
    assert_eq!(generate(&model, Some(&adapter_dir)), generate(&merged_dir, None));

    // A new run continues from the exported adapter: its policy starts away from the base, so
    // step 1's KL to the reference (the base) is not 0. A different rank is refused.
    let again = dir.path().join("again");
    let mut args = vec![
        "run",
        r.to_str().unwrap(),
        "--quiet",
        "--set",
        "trainer.total_training_steps=1",
    ];
    let out_set = format!("trainer.output_dir={}", again.display());
    let path_set = format!("model.lora_adapter_path={}", adapter_dir.display());
    args.extend(["--set", &out_set, "--set", &path_set]);
    args.extend_from_slice(&lora_args);
    let o = run_grpo(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(metrics(&again)[&1]["actor/kl"].as_f64().unwrap() > 0.0);
    let refused_set = format!("trainer.output_dir={}", dir.path().join("refused").display());
    args.extend(["--set", &refused_set, "--set", "actor.lora_rank=8"]);
    let o = run_grpo(&args);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("holds an adapter of rank 4, alpha 8") && err.contains("the recipe asks for rank 8"),
        "{err}"
    );
}

/// Rollout workers of a LoRA run hold the base and are streamed only the adapters (f32), from
/// a learner worker through the orchestrator; kill -9 of one mid-run loses nothing, and the run
/// trains exactly as the same recipe in one process. So does a learner worker alone, which
/// streams the merged weights (or, in the applied form, the adapters) to the rollout in the
/// orchestrator. Both forms (`actor.lora_form`); the applied form trains as the merged one up
/// to rounding.
#[test]
fn lora_rollout_workers_are_sent_only_the_adapters_and_train_as_in_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 64, 4);
    let steps = 3;
    for form in ["merged", "applied"] {
        lora_workers_case(dir.path(), (&model, &train, &val), steps, form);
    }
    // Step 1 samples and updates from the same weights in both forms: the same samples, and
    // loss and gradient equal up to f32 rounding. (Later steps are not compared: AdamW's first
    // step moves every adapter entry by about the learning rate whatever its gradient's size,
    // so rounding-level differences in near-zero gradients become visible differences.)
    let (merged, applied) = (
        metrics(&dir.path().join("merged/local")),
        metrics(&dir.path().join("applied/local")),
    );
    for key in ["critic/score/mean", "response_length/mean", "batch/samples"] {
        assert_eq!(merged[&1][key], applied[&1][key], "{key}: merged vs applied");
    }
    for key in ["actor/pg_loss", "actor/grad_norm", "actor/entropy"] {
        let (m, a) = (
            merged[&1][key].as_f64().unwrap(),
            applied[&1][key].as_f64().unwrap(),
        );
        assert!(
            (m - a).abs() <= 1e-5 * m.abs().max(a.abs()).max(1e-3),
            "{key}: merged {m} vs applied {a}"
        );
    }
}

/// One form's part of the test above, in `dir/form/`.
fn lora_workers_case(
    dir: &std::path::Path,
    (model, train, val): (&std::path::Path, &std::path::Path, &std::path::Path),
    steps: usize,
    form: &str,
) {
    let dir = dir.join(form);
    std::fs::create_dir_all(&dir).unwrap();
    let form_set = format!("actor.lora_form={form}");
    let lora: Vec<&str> = LORA.iter().copied().chain(["--set", form_set.as_str()]).collect();
    let (local, remote) = (dir.join("local"), dir.join("remote"));
    let r_local = tiny_recipe(&dir, "local.yaml", model, train, val, &local, steps, "");
    let r_remote = tiny_recipe(
        &dir,
        "remote.yaml",
        model,
        train,
        val,
        &remote,
        steps,
        "cluster:\n  rollout_workers: 2\n  learner_workers: 1\n",
    );
    let learner_only = dir.join("learner_only");
    let r_learner_only = tiny_recipe(
        &dir,
        "learner_only.yaml",
        model,
        train,
        val,
        &learner_only,
        steps,
        "cluster:\n  learner_workers: 1\n",
    );
    for r in [&r_local, &r_learner_only] {
        let mut args = vec!["run", r.to_str().unwrap(), "--quiet"];
        args.extend_from_slice(&lora);
        let o = run_grpo(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert_same_training(
        &local,
        &learner_only,
        &format!("LoRA ({form}) in one process vs a learner worker"),
    );
    assert_eq!(
        metric_series(&metrics(&learner_only), "weights/sent_bytes"),
        vec![0.0; steps]
    );

    let mut run = KillOnDrop(Some(
        grpo()
            .args(["run", r_remote.to_str().unwrap(), "--quiet"])
            .args(&lora)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let child = run.0.as_mut().unwrap();
    wait_for_step(&remote, 1, child, Duration::from_secs(300));
    let rollouts = run_worker_pids(&remote, "rollout");
    assert_eq!(rollouts.len(), 2, "{rollouts:?}");
    assert!(send_signal(rollouts[0], "KILL"));
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the run did not finish within 300 s of the kill"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{stderr}");
    assert_same_training(
        &local,
        &remote,
        &format!("LoRA ({form}) in one process vs rollout and learner workers"),
    );

    // Every sync sent each live worker the adapters and nothing else: step 1's went to both.
    let adapter_bytes = checkpoint_param_bytes(&remote.join("checkpoints/step_2"));
    let m = metrics(&remote);
    let sent = metric_series(&m, "weights/sent_bytes");
    assert_eq!(sent[0], 2.0 * adapter_bytes as f64, "{sent:?}");
    for bytes in &sent {
        let workers = bytes / adapter_bytes as f64;
        assert!(
            workers >= 1.0 && workers.fract() == 0.0,
            "{sent:?}, adapters {adapter_bytes} B"
        );
    }
    let model_bytes: usize = load_hf_checkpoint(model)
        .unwrap()
        .tensors
        .iter()
        .map(|t| t.to_f32_vec().len() * 2)
        .sum();
    assert!(
        adapter_bytes * 20 < model_bytes,
        "adapters {adapter_bytes} B, model {model_bytes} B"
    );
    let failures = metric_series(&m, "workers/failures_total");
    eprintln!("{form}: bytes sent per sync {sent:?} (adapters {adapter_bytes} B, model {model_bytes} B), failures {failures:?}");
    assert!(
        failures.last().copied().unwrap_or(0.0) >= 1.0,
        "{failures:?}: {stderr}"
    );
}

#[test]
fn lora_keys_are_refused_where_they_would_do_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 8, 2);
    let out = dir.path().join("out");
    let r = tiny_recipe(dir.path(), "r.yaml", &model, &train, &val, &out, 1, "");
    let refused = |sets: &[&str], want: &str| {
        let mut args = vec!["run", r.to_str().unwrap(), "--quiet"];
        for s in sets {
            args.extend(["--set", s]);
        }
        let o = run_grpo(&args);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{sets:?}: {err}");
        assert!(!out.exists(), "a refused recipe wrote {}", out.display());
    };
    refused(
        &["actor.lora_alpha=32"],
        "`actor.lora_alpha` = 32: is read only with actor.lora_rank above 0",
    );
    refused(
        &["model.lora_adapter_path=/x"],
        "`model.lora_adapter_path` = /x: needs actor.lora_rank set to the adapter's r",
    );
    refused(
        &["actor.lora_rank=4", "actor.target_modules=[q_proj, lm_head]"],
        "`lm_head` is not a projection LoRA can adapt here",
    );
}
