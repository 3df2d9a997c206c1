//! `grpo run` on a tiny random Qwen3-MoE with SmolLM2's tokenizer: the whole loop trains its
//! router and experts, and a resumed run, and one with its rollout and learner in worker
//! processes, train identically.

mod common;

use common::*;
use std::path::Path;

#[test]
fn a_tiny_moe_trains_resumes_exactly_and_runs_in_worker_processes() {
    let dir = tempfile::tempdir().unwrap();
    let model = testkit::tiny_moe_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 64);
    let val = arithmetic(dir.path(), "val", 2, 4);
    let run = |out: &Path, steps: u64, extra: &[&str]| {
        let r = tiny_recipe(dir.path(), "moe.yaml", &model, &train, &val, out, 4, "");
        let total = format!("trainer.total_training_steps={steps}");
        let mut args = vec!["run", r.to_str().unwrap(), "--quiet", "--set", &total];
        args.extend_from_slice(extra);
        let o = run_grpo(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let whole = dir.path().join("whole");
    run(&whole, 4, &[]);
    let m = metrics(&whole);
    assert_eq!(m.keys().copied().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
    assert!(metric_series(&m, "actor/grad_norm").iter().all(|g| *g > 0.0));
    // The router's metrics: its entropy within (0, ln 4] nats for 4 experts, the busiest
    // expert's load at least the mean's, and the load-balancing loss at least its balanced
    // value k = 2 (Switch Transformer's E * sum f P with f summing to k).
    for step in 1..=4 {
        let get = |key: &str| {
            m[&step][key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key} at step {step}"))
        };
        let entropy = get("actor/router_entropy");
        assert!(entropy > 0.0 && entropy <= 4f64.ln() + 1e-6, "{entropy}");
        assert!(get("actor/router_load_max") >= 1.0);
        assert!(
            get("actor/router_aux_loss") >= 2.0 - 1e-4,
            "{}",
            get("actor/router_aux_loss")
        );
    }
    // With a coefficient the load-balancing loss enters the loss, and so the update.
    let weighted = dir.path().join("weighted");
    run(&weighted, 1, &["--set", "actor.router_aux_loss_coef=0.5"]);
    let w = metrics(&weighted);
    let (a, b) = (&m[&1], &w[&1]);
    let loss = |x: &serde_json::Value| {
        x["actor/pg_loss"].as_f64().unwrap() + 0.5 * x["actor/router_aux_loss"].as_f64().unwrap()
    };
    assert_ne!(
        a["actor/grad_norm"], b["actor/grad_norm"],
        "the loss's gradient changed"
    );
    assert!((b["actor/loss"].as_f64().unwrap() - loss(b)).abs() < 1e-4, "{b}");

    // The router and every expert moved; exported, the model loads as a Qwen3-MoE again.
    let exported = dir.path().join("exported");
    let o = run_grpo(&[
        "export",
        whole.to_str().unwrap(),
        "--output",
        exported.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let before = model::safetensors_io::load_hf_checkpoint(&model).unwrap();
    let after = model::safetensors_io::load_hf_checkpoint(&exported).unwrap();
    assert_eq!(after.config.moe, before.config.moe);
    for name in [
        "model.layers.0.mlp.gate.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
    ] {
        let (b, a) = (
            before.get(name).unwrap().to_f32_vec(),
            after.get(name).unwrap().to_f32_vec(),
        );
        assert!(b.iter().zip(&a).any(|(x, y)| x != y), "{name} did not train");
    }

    // bf16 compute (what `auto` chooses on a CPU with bf16 instructions): the experts' products
    // and their gradients in the form the CPU plugin runs.
    let bf16 = dir.path().join("bf16");
    run(
        &bf16,
        1,
        &["--set", "actor.param_dtype=bf16", "--set", "rollout.dtype=bf16"],
    );
    assert!(metrics(&bf16)[&1]["actor/grad_norm"].as_f64().unwrap() > 0.0);

    let resumed = dir.path().join("resumed");
    run(&resumed, 2, &[]);
    run(&resumed, 4, &[]);
    assert_same_training(&whole, &resumed, "stopped at step 2 and resumed");
    let workers = dir.path().join("workers");
    let remote = [
        "--set",
        "cluster.rollout_workers=1",
        "--set",
        "cluster.learner_workers=1",
    ];
    run(&workers, 2, &remote);
    run(&workers, 4, &remote);
    assert_same_training(
        &whole,
        &workers,
        "rollout and learner workers, stopped and resumed",
    );
}
