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
    assert_exported_and_trained(
        &whole,
        &dir.path().join("exported"),
        &model,
        &[
            "model.layers.0.mlp.gate.weight",
            "model.layers.1.mlp.experts.gate_up_proj",
            "model.layers.1.mlp.experts.down_proj",
        ],
    );

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

/// Routing replay with a bf16 rollout and an f32 learner (VeRL's usual split), whose
/// forwards round differently: recorded but not replayed, the learner's own experts differ from
/// the rollout's for some tokens; under R3 every learner pass uses the rollout's (measured: 0
/// tokens differ) and the rollout/learner log-prob gap shrinks; under R2 the update replays the
/// old-log-prob pass's. Rollout and learner worker processes carry the routes over gRPC and
/// train as the in-process run does.
#[test]
fn rollout_routing_replay_makes_the_learner_use_the_rollouts_experts() {
    let moe = TinyMoe::new();
    let run = |name: &str, extra: &[&str]| {
        let mut settings = vec!["actor.param_dtype=f32", "rollout.dtype=bf16"];
        settings.extend_from_slice(extra);
        moe.run(name, 2, &settings)
    };
    let series = |out: &Path, key: &str| metric_series(&metrics(out), key);
    let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len() as f64;

    // In f32 on both sides the rollout records exactly the experts the learner chooses, position
    // for position.
    let same = run(
        "recorded_f32",
        &["rollout.enable_rollout_routing_replay=true", "rollout.dtype=f32"],
    );
    assert_eq!(
        series(&same, "rollout_corr/router_token_mismatch"),
        vec![0.0, 0.0]
    );
    assert!(series(&same, "rollout/log_prob_diff_mean")
        .iter()
        .all(|d| *d < 1e-5));

    let free = run("recorded", &["rollout.enable_rollout_routing_replay=true"]);
    let own = series(&free, "rollout_corr/router_token_mismatch");
    assert!(own.iter().all(|f| *f > 0.0 && *f < 1.0), "{own:?}");
    let decisions = series(&free, "rollout_corr/router_decision_mismatch");
    assert!(
        decisions.iter().zip(&own).all(|(d, t)| d > &0.0 && d <= t),
        "{decisions:?}"
    );

    let r3 = run("r3", &["actor.router_replay.mode=R3"]);
    assert_eq!(series(&r3, "rollout_corr/router_token_mismatch"), vec![0.0, 0.0]);
    let (kl_free, kl_r3) = (
        mean(series(&free, "rollout_corr/k3_kl")),
        mean(series(&r3, "rollout_corr/k3_kl")),
    );
    assert!(
        kl_r3 < kl_free,
        "R3's rollout/learner KL {kl_r3} vs {kl_free} without"
    );

    // R2: the old-log-prob pass chooses, the update replays; the rollout's routes, recorded
    // here, still measure the learner's own choice.
    let r2 = run(
        "r2",
        &[
            "actor.router_replay.mode=R2",
            "rollout.enable_rollout_routing_replay=true",
        ],
    );
    assert_eq!(
        series(&r2, "rollout_corr/router_token_mismatch")[0],
        own[0],
        "step 1 starts from the same weights"
    );

    let remote = run(
        "r3_workers",
        &[
            "actor.router_replay.mode=R3",
            "cluster.rollout_workers=1",
            "cluster.learner_workers=1",
        ],
    );
    assert_same_training(&r3, &remote, "R3 with rollout and learner workers");
}

/// `model.moe_dispatch: grouped` (tokens sorted by expert through a grouped product; on the
/// CPU plugin the ragged dot's masked form) trains as the dense dispatch does: in f32 the same
/// first step to rounding; in bf16 the same samples, the learner's numbers those of experts
/// computed in f32 (the CPU plugin refuses the masked form's bf16 products), within 10%.
#[test]
fn grouped_dispatch_trains_as_the_dense_one() {
    let moe = TinyMoe::new();
    let run = |name: &str, extra: &[&str]| metrics(&moe.run(name, 1, extra));
    for dtype in ["f32", "bf16"] {
        let dtypes = [
            format!("actor.param_dtype={dtype}"),
            format!("rollout.dtype={dtype}"),
        ];
        let with = |dispatch: &str| {
            let mut extra: Vec<&str> = dtypes.iter().map(String::as_str).collect();
            let key = format!("model.moe_dispatch={dispatch}");
            extra.push(&key);
            run(&format!("{dispatch}-{dtype}"), &extra)
        };
        let (dense, grouped) = (with("dense"), with("grouped"));
        assert_eq!(
            dense[&1]["critic/score/mean"], grouped[&1]["critic/score/mean"],
            "{dtype}: the same samples"
        );
        for key in [
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/router_aux_loss",
            "actor/entropy",
        ] {
            let (a, b) = (
                dense[&1][key].as_f64().unwrap(),
                grouped[&1][key].as_f64().unwrap(),
            );
            let tolerance = if dtype == "f32" { 1e-4 } else { 0.1 };
            assert!(
                (a - b).abs() <= tolerance * a.abs().max(1.0),
                "{dtype} {key}: dense {a}, grouped {b}"
            );
        }
    }
}

/// A tiny Qwen3-MoE with SmolLM2's tokenizer and the arithmetic task in a temporary folder:
/// [`TinyMoe::run`] trains it.
struct TinyMoe {
    dir: tempfile::TempDir,
    model: std::path::PathBuf,
    train: std::path::PathBuf,
    val: std::path::PathBuf,
}

impl TinyMoe {
    fn new() -> TinyMoe {
        let dir = tempfile::tempdir().unwrap();
        let model = testkit::tiny_moe_chat_model(dir.path());
        let train = arithmetic(dir.path(), "train", 1, 64);
        let val = arithmetic(dir.path(), "val", 2, 4);
        TinyMoe {
            dir,
            model,
            train,
            val,
        }
    }

    /// Trains `steps` steps into the folder `name` with each `key=value` of `settings` set;
    /// returns the folder.
    fn run(&self, name: &str, steps: usize, settings: &[&str]) -> std::path::PathBuf {
        let out = self.dir.path().join(name);
        let recipe = format!("{name}.yaml");
        let (model, train, val) = (&self.model, &self.train, &self.val);
        let r = tiny_recipe(self.dir.path(), &recipe, model, train, val, &out, steps, "");
        let mut args = vec!["run", r.to_str().unwrap(), "--quiet"];
        for s in settings {
            args.extend(["--set", s]);
        }
        let o = run_grpo(&args);
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        out
    }
}

/// LoRA on the stacked experts (`actor.target_parameters`, PEFT's per-expert pairs) beside the
/// attention's: only the adapters train (B leaves zero), a rollout worker is sent only them and
/// trains as the in-process run does, and the export is a PEFT adapter naming the experts (its
/// merge changes the experts and the adapted attention, nothing else).
#[test]
fn lora_on_the_experts_trains_them_and_exports_a_peft_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let model = testkit::tiny_moe_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 64);
    let val = arithmetic(dir.path(), "val", 2, 4);
    let r = tiny_recipe(
        dir.path(),
        "moe.yaml",
        &model,
        &train,
        &val,
        &dir.path().join("unused"),
        4,
        "",
    );
    let run = |out: &Path, extra: &[&str]| {
        let output = format!("trainer.output_dir={}", out.display());
        let mut args = vec![
            "run",
            r.to_str().unwrap(),
            "--quiet",
            "--set",
            "trainer.total_training_steps=2",
            "--set",
            &output,
            "--set",
            "actor.lora_rank=4",
            "--set",
            "actor.lora_alpha=8",
            "--set",
            "actor.optim.lr=1e-2",
            // One optimizer step per step, so step 1's KL is taken before any update.
            "--set",
            "actor.ppo_mini_batch_size=4",
            "--set",
            "actor.target_modules=[q_proj]",
            "--set",
            "actor.target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]",
        ];
        args.extend_from_slice(extra);
        let o = run_grpo(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let whole = dir.path().join("whole");
    run(&whole, &[]);
    let m = metrics(&whole);
    assert_eq!(m[&1]["actor/kl"], 0.0, "B starts at zero: the policy is the base");
    assert!(m[&2]["actor/kl"].as_f64().unwrap() > 0.0, "{}", m[&2]);
    let workers = dir.path().join("workers");
    run(&workers, &["--set", "cluster.rollout_workers=1"]);
    assert_same_training(&whole, &workers, "a rollout worker sent only the adapters");

    let adapter_dir = dir.path().join("adapter");
    let merged_dir = dir.path().join("merged");
    for (to, merged) in [(&adapter_dir, false), (&merged_dir, true)] {
        let mut args = vec![
            "export",
            whole.to_str().unwrap(),
            "--output",
            to.to_str().unwrap(),
        ];
        if merged {
            args.push("--merged");
        }
        let o = run_grpo(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(adapter_dir.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["target_modules"], serde_json::json!(["q_proj"]));
    assert_eq!(
        config["target_parameters"],
        serde_json::json!(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    );
    let base = model::safetensors_io::load_hf_checkpoint(&model).unwrap();
    let adapter = model::LoraAdapter::load_peft(&adapter_dir, &base.config).unwrap();
    let experts = base.config.moe.as_ref().unwrap().num_experts;
    for t in &adapter.tensors {
        if t.name.contains("mlp.experts.") && t.name.ends_with("lora_B.weight") {
            assert_eq!(t.shape[1], 4 * experts, "{}: B is [out, r*E]", t.name);
            assert!(t.to_f32_vec().iter().any(|&b| b != 0.0), "{} never moved", t.name);
        }
    }
    let merged = model::safetensors_io::load_hf_checkpoint(&merged_dir).unwrap();
    let get = |w: &model::ModelWeights, n: &str| w.get(n).unwrap().to_f32_vec();
    for name in [
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
        "model.layers.0.self_attn.q_proj.weight",
    ] {
        assert_ne!(get(&merged, name), get(&base, name), "{name} has an adapter");
    }
    for name in [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ] {
        assert_eq!(get(&merged, name), get(&base, name), "{name} has none");
    }
}
