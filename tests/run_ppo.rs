//! PPO end to end (`algorithm.adv_estimator: gae`): a tiny run trains a critic beside the
//! policy, holds the actor still for `trainer.critic_warmup` steps, reports VeRL's critic
//! metrics, checkpoints the critic with the policy, and a run stopped at a checkpoint and
//! resumed trains exactly as one that went straight through, the critic included, whether the
//! learner runs in the orchestrator or in a learner worker process (the critic's state crossing
//! gRPC both ways).

mod common;

use common::{metric_series, metrics, run_grpo, tiny_inputs, tiny_recipe};
use std::path::{Path, PathBuf};

const PPO: &str = "algorithm:\n  adv_estimator: gae\n  lam: 0.95\n\
                   critic:\n  optim:\n    lr: 1.0e-3\n  cliprange_value: 0.5\n  ppo_micro_batch_size: 8\n";

/// The tiny model, training and validation sets.
type Inputs = (PathBuf, PathBuf, PathBuf);

fn run(
    dir: &Path,
    (model, train, val): &Inputs,
    out: &Path,
    steps: u64,
    extra: &[&str],
) -> std::process::Output {
    let r = tiny_recipe(dir, "ppo.yaml", model, train, val, out, 4, PPO);
    let total = format!("trainer.total_training_steps={steps}");
    let mut args = vec![
        "run",
        r.to_str().unwrap(),
        "--quiet",
        "--set",
        &total,
        "--set",
        "trainer.critic_warmup=2",
        "--set",
        "actor.use_kl_loss=false",
    ];
    args.extend_from_slice(extra);
    run_grpo(&args)
}

/// The f32 values of a checkpoint file's tensors, by name.
fn tensors(dir: &Path, file: &str) -> Vec<(String, Vec<f32>)> {
    let ck = trainer::checkpoint::load_checkpoint(dir).unwrap();
    let mut t: Vec<(String, Vec<f32>)> = ck
        .tensors
        .get(file)
        .unwrap_or_else(|| panic!("{} has no {file}", dir.display()))
        .iter()
        .map(|t| (t.name.clone(), t.to_f32_vec()))
        .collect();
    t.sort_by(|a, b| a.0.cmp(&b.0));
    t
}

#[test]
fn a_tiny_ppo_run_trains_a_critic_checkpoints_it_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = tiny_inputs(dir.path(), 64, 4);
    let whole = dir.path().join("whole");
    let o = run(dir.path(), &inputs, &whole, 4, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = metrics(&whole);
    for key in [
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
        "critic/values/mean",
        "critic/values/max",
        "critic/values/min",
        "critic/vf_explained_var",
        "critic/returns/mean",
        "critic/advantages/mean",
        "timing_s/values",
        "timing_s/update_critic",
    ] {
        let v = metric_series(&m, key);
        assert_eq!(v.len(), 4, "{key} at every step: {v:?}");
        assert!(v.iter().all(|x| x.is_finite()), "{key} = {v:?}");
    }
    for lr in metric_series(&m, "critic/lr") {
        assert!(
            (lr - 1.0e-3).abs() < 1e-9,
            "critic.optim.lr is 1e-3, the critic ran at {lr}"
        );
    }
    // trainer.critic_warmup = 2: step 1 trains only the critic (VeRL's `critic_warmup <=
    // global_steps`), steps 2 to 4 the actor too.
    let skipped: Vec<u64> = (1..=4)
        .filter(|s| m[s].get("actor/update_skipped").is_some())
        .collect();
    let trained: Vec<u64> = (1..=4).filter(|s| m[s].get("actor/pg_loss").is_some()).collect();
    assert_eq!((skipped, trained), (vec![1], vec![2, 3, 4]));
    // GAE's advantages are whitened over the batch's tokens.
    for mean in metric_series(&m, "critic/advantages/mean") {
        assert!(mean.abs() < 1e-5, "whitened advantages have mean {mean}");
    }

    let last = whole.join("checkpoints/step_4");
    let critic = tensors(&last, "critic_params");
    assert!(critic.iter().any(|(n, _)| n == "score.weight"));
    assert!(critic.iter().any(|(n, _)| n == "score.bias"));
    assert!(
        !critic.iter().any(|(n, _)| n == "lm_head.weight"),
        "a value model has no output head"
    );
    assert!(tensors(&last, "critic_optimizer")
        .iter()
        .any(|(n, _)| n == "adam_m.score.weight"));

    // Stopped at the step-2 checkpoint and run again to step 4, in this process and with the
    // learner in a worker process.
    for (name, extra) in [
        ("resumed", &[][..]),
        ("worker", &["--set", "cluster.learner_workers=1"][..]),
    ] {
        let resumed = dir.path().join(name);
        for steps in [2, 4] {
            let o = run(dir.path(), &inputs, &resumed, steps, extra);
            assert!(
                o.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        let r = metrics(&resumed);
        assert_eq!(m.keys().collect::<Vec<_>>(), r.keys().collect::<Vec<_>>());
        for key in [
            "critic/score/mean",
            "response_length/mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "critic/vf_loss",
            "critic/values/mean",
            "critic/grad_norm",
            "critic/advantages/max",
        ] {
            let at = |m: &std::collections::BTreeMap<u64, serde_json::Value>| -> Vec<Option<f64>> {
                m.values().map(|v| v.get(key).and_then(|x| x.as_f64())).collect()
            };
            assert_eq!(at(&m), at(&r), "{key}: {name}, stopped at step 2 and resumed");
        }
        let resumed_last = resumed.join("checkpoints/step_4");
        assert!(
            tensors(&last, "critic_params") == tensors(&resumed_last, "critic_params"),
            "{name}"
        );
        assert!(
            tensors(&last, "critic_optimizer") == tensors(&resumed_last, "critic_optimizer"),
            "{name}"
        );
        assert!(
            tensors(&last, "params") == tensors(&resumed_last, "params"),
            "{name}"
        );
    }
}

#[test]
fn critic_keys_without_gae_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 8, 2);
    let out = dir.path().join("out");
    let r = tiny_recipe(dir.path(), "r.yaml", &model, &train, &val, &out, 1, PPO);
    let o = run_grpo(&[
        "run",
        r.to_str().unwrap(),
        "--set",
        "algorithm.adv_estimator=grpo",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("`critic.optim` = (set): is read only with algorithm.adv_estimator: gae"),
        "{err}"
    );
    assert!(!out.exists(), "a refused recipe did no work");
}

/// A LoRA policy (adapters on a frozen base) beside a critic that trains every weight of its
/// own copy of the trunk: the critic starts from the base model, not from the adapters.
#[test]
fn a_lora_policy_trains_beside_a_full_critic() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = tiny_inputs(dir.path(), 16, 2);
    let out = dir.path().join("lora");
    let o = run(
        dir.path(),
        &inputs,
        &out,
        2,
        &["--set", "actor.lora_rank=4", "--set", "trainer.critic_warmup=0"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = metrics(&out);
    for key in ["actor/pg_loss", "critic/vf_loss", "critic/grad_norm"] {
        let v = metric_series(&m, key);
        assert_eq!(v.len(), 2, "{key}: {v:?}");
        assert!(v.iter().all(|x| x.is_finite() && *x != 0.0), "{key}: {v:?}");
    }
    let last = out.join("checkpoints/step_2");
    let params = tensors(&last, "params");
    assert!(
        params.iter().all(|(n, _)| n.contains("lora_")),
        "the policy's state is its adapters"
    );
    let critic = tensors(&last, "critic_params");
    assert!(
        critic.iter().any(|(n, _)| n == "model.embed_tokens.weight"),
        "the critic trains its trunk"
    );
}

/// `critic.model.path` names another model: the critic is its trunk (here wider and deeper
/// than the policy) with a fresh head; a model of another vocabulary is refused before any
/// work, naming the key.
#[test]
fn the_critic_may_start_from_another_model_of_the_same_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = tiny_inputs(dir.path(), 16, 2);
    let policy_config = model::ModelConfig::from_hf_file(&inputs.0.join("config.json")).unwrap();
    let tokenizer_files: Vec<PathBuf> = ["tokenizer.json", "tokenizer_config.json"]
        .iter()
        .map(|f| inputs.0.join(f))
        .filter(|p| p.is_file())
        .collect();
    let tokenizer_refs: Vec<&Path> = tokenizer_files.iter().map(|p| p.as_path()).collect();
    let other = |name: &str, vocab: usize| {
        let mut config = policy_config.clone();
        config.hidden_size = 48;
        config.num_hidden_layers = 3;
        config.intermediate_size = 96;
        config.head_dim = 12;
        config.vocab_size = vocab;
        let path = dir.path().join(name);
        model::save_hf_checkpoint(&path, &model::random_init(&config, 11), &tokenizer_refs).unwrap();
        path
    };
    let critic = other("critic-model", policy_config.vocab_size);
    let out = dir.path().join("out");
    let path = format!("critic.model.path={}", critic.display());
    let o = run(dir.path(), &inputs, &out, 2, &["--set", &path]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let head = tensors(&out.join("checkpoints/step_2"), "critic_params")
        .into_iter()
        .find(|(n, _)| n == "score.weight")
        .unwrap();
    assert_eq!(head.1.len(), 48, "the critic is the other model's trunk");

    let wrong = other("wrong-vocabulary", policy_config.vocab_size + 1);
    let path = format!("critic.model.path={}", wrong.display());
    let o = run(
        dir.path(),
        &inputs,
        &dir.path().join("wrong"),
        2,
        &["--set", &path],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("critic.model.path") && err.contains("same tokenizer"),
        "{err}"
    );
}
