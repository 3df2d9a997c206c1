use super::table::{self, How, ADDED_KEYS, TABLE};
use super::*;
use trainer::config::AdvantageEstimator;

/// What every test command line starts with: VeRL's GRPO scripts set these (VeRL's own
/// defaults are GAE on 8 GPUs).
const BASE: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
];

fn translate_with(extra: &[&str]) -> Result<Translation, VerlError> {
    let overrides = BASE.iter().chain(extra).map(|s| s.to_string()).collect();
    translate(&VerlInput {
        overrides,
        ..Default::default()
    })
}

fn recipe_value(recipe: &Recipe, key: &str) -> serde_yaml::Value {
    let mut node = serde_yaml::to_value(recipe).unwrap();
    for part in key.split('.') {
        node = node.get(part).cloned().unwrap_or(serde_yaml::Value::Null);
    }
    node
}

#[test]
fn the_table_covers_every_verl_key_and_no_other() {
    let defaults = hydra::defaults();
    assert_eq!(defaults.len(), 507, "verl_defaults.tsv lost or gained keys");
    for key in defaults.keys() {
        let entry = table::entry(key).unwrap_or_else(|| panic!("no table entry for VeRL's `{key}`"));
        assert!(
            !ADDED_KEYS.contains(&entry.key),
            "`{key}` is VeRL's, not an added key"
        );
    }
    for e in TABLE {
        let covers = defaults.keys().any(|k| match e.key.strip_suffix(".*") {
            Some(section) => table::within(k, section),
            None => k == e.key,
        });
        assert_eq!(
            covers,
            !ADDED_KEYS.contains(&e.key),
            "table entry `{}` names no key of VeRL's config (or an added key names one)",
            e.key
        );
        assert_eq!(
            TABLE.iter().filter(|o| o.key == e.key).count(),
            1,
            "`{}` twice",
            e.key
        );
    }
}

#[test]
fn mapped_keys_reach_their_recipe_keys() {
    let t = translate_with(&[]).unwrap();
    let config = {
        let mut c = hydra::Config::new();
        for raw in BASE {
            c.apply(&Override::parse(raw).unwrap()).unwrap();
        }
        c
    };
    for e in TABLE {
        let How::Map(to) = e.how else { continue };
        let verl = config.get(e.key).unwrap().unwrap();
        let verl = if PATH_KEYS.contains(&e.key) {
            expand_home(verl)
        } else {
            verl
        };
        let ours = recipe_value(&t.recipe, to);
        let ours = serde_json::to_value(&ours).unwrap();
        // Numbers compare as numbers (1 and 1.0), one-or-many as the list.
        let same = match (&verl, &ours) {
            // `all-linear` names the seven projections the recipe lists.
            _ if to == "actor.target_modules" => {
                serde_json::from_value::<model::TargetModules>(verl.clone()).unwrap()
                    == serde_json::from_value::<model::TargetModules>(ours.clone()).unwrap()
            }
            (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
            (Value::String(a), Value::Array(b)) => b == &vec![json!(a)],
            (a, b) => a == b,
        };
        assert!(same, "`{}` = {verl} became `{to}` = {ours}", e.key);
    }
}

#[test]
fn verl_defaults_become_the_recipe() {
    let r = translate_with(&[]).unwrap().recipe;
    assert_eq!(r.actor.optim.lr, 1e-6);
    assert_eq!(r.actor.optim.weight_decay, 0.01);
    assert_eq!(r.data.train_batch_size, 1024);
    assert_eq!(r.data.max_response_length, 512);
    assert_eq!(r.actor.ppo_mini_batch_size, 256);
    assert_eq!(r.rollout.n, 1);
    assert_eq!(r.rollout.val_kwargs.temperature, 0.0);
    assert_eq!(r.trainer.total_epochs, 30);
    assert_eq!(r.trainer.project_name, "verl_examples");
    assert_eq!(r.trainer.output_dir, "checkpoints/verl_examples/gsm8k");
    assert_eq!(
        r.trainer.logger,
        [
            tracking::Logger::Console,
            tracking::Logger::Wandb,
            tracking::Logger::File
        ]
    );
    assert!(r.model.enable_gradient_checkpointing);
    assert_eq!(r.rollout.dtype, crate::recipe::DTypeName::Auto);
    assert_eq!(r.actor.ppo_micro_batch_size, 8);
    assert_eq!(r.rollout.max_num_seqs, 256);
}

#[test]
fn the_size_rule() {
    let r = translate_with(&[
        "trainer.n_gpus_per_node=4",
        "trainer.device=cpu",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=6",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    ])
    .unwrap();
    // 4 x 6 = 24 sequences, 6 per device; 4 per device does not divide 6, so 3.
    assert_eq!(r.recipe.actor.ppo_micro_batch_size, 12);
    assert_eq!(r.recipe.actor.mesh, Some(4));
    assert_eq!(r.recipe.actor.strategy, crate::recipe::Strategy::Fsdp);
    assert_eq!(r.recipe.cluster.cpu_device_count, 4);
    assert_eq!(r.recipe.rollout.max_num_seqs, 48);
    assert!(r.notes.iter().any(|n| n.contains("made 3")), "{:?}", r.notes);
    let dynamic = translate_with(&[
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2500",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
    ])
    .unwrap();
    // 2500 tokens / (512 + 512) = 2 sequences.
    assert_eq!(dynamic.recipe.actor.ppo_micro_batch_size, 2);
    let err = translate_with(&[
        "trainer.n_gpus_per_node=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("does not split evenly over 3 devices"), "{err}");
}

#[test]
fn errors_name_the_key_and_the_way_out() {
    let err = |extra: &[&str]| translate_with(extra).unwrap_err().to_string();
    assert_eq!(
        err(&["actor_rollout_ref.actor.optim.lr_rate=1e-6"]),
        "actor_rollout_ref.actor.optim.lr_rate=1e-6: `actor_rollout_ref.actor.optim.lr_rate` is not \
         a key of VeRL's config (VeRL's Hydra would refuse it too: Key \
         'actor_rollout_ref.actor.optim.lr_rate' is not in struct); did you mean \
         `actor_rollout_ref.actor.optim.lr`?; a key VeRL reads without listing it is added with \
         `+actor_rollout_ref.actor.optim.lr_rate=...`"
    );
    assert_eq!(
        err(&[
            "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=3",
            "reward_model.enable=True"
        ]),
        "2 VeRL settings grpo cannot honour:\n  actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=3: \
         not supported: grpo's multi-turn rollouts run the tools of `rollout.multi_turn.tools` and \
         `rollout.multi_turn.tool_config_path` (built-ins, JSON-lines commands, HTTP endpoints) and the \
         interactions of `rollout.multi_turn.interaction_config_path`, or your own agent program \
         through an OpenAI-compatible endpoint (`rollout.multi_turn.agent`); VeRL's Python agent loop \
         classes and repeated rollouts are not in grpo\n  reward_model.enable=true: not \
         supported: VeRL's reward-model worker is not translated: in a grpo recipe, define the \
         model as a scorer (`reward.scorers.NAME: {kind: reward_model, path: ...}`) and name it in \
         `reward.data_sources` or `reward.default`, alone or weighted with rule scorers \
         (recipes/README.md, `reward`)"
    );
    assert_eq!(
        err(&["actor_rollout_ref.actor.kl_loss_type=k9"]),
        "`actor_rollout_ref.actor.kl_loss_type=k9` (recipe key `actor.kl_loss_type`): unknown \
         variant `k9`, expected one of `k1`, `kl`, `abs`, `k2`, `mse`, `k3`, `low_var_kl`"
    );
    assert!(err(&["trainer.logger=console,wandb"]).contains("sweep over"));
    assert!(err(&["+trainer.my_key=1"]).contains("not a key grpo verl knows VeRL to read"));
}

#[test]
fn gae_brings_the_critic_over() {
    // VeRL's defaults are PPO: GAE with a critic.
    let t = translate(&VerlInput {
        overrides: BASE[1..].iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    })
    .unwrap();
    let r = &t.recipe;
    assert_eq!(r.algorithm.adv_estimator, AdvantageEstimator::Gae);
    assert_eq!(r.critic.optim.lr, 1e-5, "VeRL's critic learning rate");
    assert_eq!(r.critic.optim.weight_decay, 0.01);
    assert_eq!(r.critic.cliprange_value, 0.5);
    assert_eq!(r.critic.grad_clip, Some(1.0));
    assert_eq!(r.critic.model.path, None);
    assert!(t
        .notes
        .iter()
        .any(|n| n.contains("critic.model.path is VeRL's placeholder")));

    let t = translate(&VerlInput {
        overrides: [
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "algorithm.lam=0.95",
            "algorithm.gamma=0.99",
            "trainer.critic_warmup=3",
            "critic.optim.lr=2e-5",
            "critic.optim.clip_grad=0.5",
            "critic.ppo_micro_batch_size_per_gpu=4",
            "critic.ppo_epochs=2",
            "critic.cliprange_value=0.2",
            "critic.model.path=/models/critic",
            "critic.model.enable_gradient_checkpointing=False",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        ..Default::default()
    })
    .unwrap();
    let r = &t.recipe;
    assert_eq!((r.algorithm.lam, r.algorithm.gamma), (0.95, 0.99));
    assert_eq!(r.trainer.critic_warmup, 3);
    assert_eq!(r.critic.optim.lr, 2e-5);
    assert_eq!(r.critic.grad_clip, Some(0.5));
    assert_eq!(r.critic.ppo_micro_batch_size, Some(8), "4 per device x 2 devices");
    assert_eq!(r.critic.ppo_epochs, Some(2));
    assert_eq!(r.critic.cliprange_value, 0.2);
    assert_eq!(r.critic.model.path.as_deref(), Some("/models/critic"));
    assert_eq!(r.critic.model.enable_gradient_checkpointing, Some(false));

    // Without gae VeRL builds no critic: its keys are notes, and forcing one on is refused.
    let t = translate_with(&["critic.optim.lr=3e-5", "algorithm.lam=0.9"]).unwrap();
    assert_eq!(t.recipe.critic, crate::recipe::CriticSection::default());
    assert!(
        t.notes
            .iter()
            .any(|n| n.starts_with("critic.optim.lr=0.00003 has no effect")),
        "{:?}",
        t.notes
    );
    assert_eq!(
        t.notes.iter().filter(|n| n.starts_with("critic.")).count(),
        1,
        "{:?}",
        t.notes
    );
    assert!(
        t.notes
            .iter()
            .any(|n| n.starts_with("algorithm.lam=0.9 has no effect")),
        "{:?}",
        t.notes
    );
    let err = translate_with(&["critic.enable=True"]).unwrap_err().to_string();
    assert!(err.contains("critic.enable=true"), "{err}");
}

#[test]
fn keys_without_effect_give_notes() {
    let t = translate_with(&[
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.model.use_remove_padding=True",
    ])
    .unwrap();
    assert!(t
        .notes
        .iter()
        .any(|n| n.starts_with("actor_rollout_ref.rollout.name=vllm has no effect")));
    assert!(t
        .notes
        .iter()
        .any(|n| n.contains("gpu_memory_utilization=0.6 has no effect in grpo: it sizes vLLM's KV cache")));
    // Set to VeRL's own default: nothing to say.
    assert!(
        !t.notes.iter().any(|n| n.contains("use_remove_padding")),
        "{:?}",
        t.notes
    );
}

#[test]
fn estimator_and_loss_knobs_follow_their_owner() {
    let t = translate_with(&[
        "algorithm.adv_estimator=reinforce_plus_plus",
        "algorithm.gamma=0.95",
        "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.01",
        "actor_rollout_ref.actor.tau_pos=2",
    ])
    .unwrap();
    assert_eq!(t.recipe.algorithm.gamma, 0.95);
    assert_eq!(t.recipe.actor.policy_loss.kl_cov_ratio, 0.01);
    assert_eq!(
        t.recipe.actor.tau_pos, 1.0,
        "sapo's knob stays at its default under kl_cov"
    );
    assert!(
        t.notes.iter().any(|n| n
            == "actor_rollout_ref.actor.tau_pos=2 has no effect: VeRL reads it only with \
                actor_rollout_ref.actor.policy_loss.loss_mode=sapo"),
        "{:?}",
        t.notes
    );
    let t = translate_with(&[
        "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
        "actor_rollout_ref.actor.tau_neg=2",
    ])
    .unwrap();
    assert_eq!(t.recipe.actor.tau_neg, 2.0);
}

#[test]
fn rollout_correction_keys_map_one_to_one() {
    let t = translate_with(&[
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=3.0",
        "algorithm.rollout_correction.rollout_is_batch_normalize=True",
        "algorithm.rollout_correction.rollout_rs='token_k1,seq_mean_k3'",
        "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0,0.01'",
    ])
    .unwrap();
    let rc = &t.recipe.algorithm.rollout_correction;
    assert_eq!(rc.rollout_is, Some(crate::recipe::IsLevel::Sequence));
    assert_eq!(rc.rollout_is_threshold, 3.0);
    assert!(rc.rollout_is_batch_normalize);
    assert_eq!(rc.rollout_rs.as_deref(), Some("token_k1,seq_mean_k3"));
    assert_eq!(rc.rollout_rs_threshold.as_deref(), Some("0.5_2.0,0.01"));
    assert_eq!(rc.rejection().unwrap().len(), 2);
    // A numeric threshold, as VeRL also takes it.
    let t = translate_with(&[
        "algorithm.rollout_correction.rollout_rs=seq_max_k2",
        "algorithm.rollout_correction.rollout_rs_threshold=0.3",
    ])
    .unwrap();
    assert_eq!(
        t.recipe
            .algorithm
            .rollout_correction
            .rollout_rs_threshold
            .as_deref(),
        Some("0.3")
    );
    let err = translate_with(&["algorithm.rollout_correction.loss_type=reinforce"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("`reinforce` loss type is not in grpo"), "{err}");
}

#[test]
fn reward_functions_and_config_files() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("mine.yaml"),
        "defaults:\n  - ppo_trainer\n  - _self_\nhydra:\n  searchpath: [pkg://verl/trainer/config]\n\
         data:\n  train_batch_size: 16\nactor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 8\nreward_manager:\n  name: batch\n",
    )
    .unwrap();
    let t = translate(&VerlInput {
        overrides: BASE
            .iter()
            .map(|s| s.to_string())
            .chain([
                "custom_reward_function.path=~/score.py".to_string(),
                "+custom_reward_function.reward_kwargs.scale=2".to_string(),
            ])
            .collect(),
        config_path: Some(dir.path().to_path_buf()),
        config_name: Some("mine".into()),
    })
    .unwrap();
    assert_eq!(t.recipe.data.train_batch_size, 16);
    let f = t.recipe.reward.custom_reward_function.unwrap();
    assert_eq!(f.path, format!("{}/score.py", std::env::var("HOME").unwrap()));
    assert_eq!(f.name, "compute_score");
    assert_eq!(f.reward_kwargs["scale"], json!(2));
    std::fs::write(
        dir.path().join("megatron.yaml"),
        "defaults:\n  - override actor_rollout_ref/actor: megatron_actor\n",
    )
    .unwrap();
    let err = translate(&VerlInput {
        overrides: Vec::new(),
        config_path: Some(dir.path().to_path_buf()),
        config_name: Some("megatron".into()),
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("composes VeRL's `ppo_trainer` config only"), "{err}");
}

#[test]
fn the_markdown_table_is_the_shipped_doc() {
    let doc = include_str!("../../../docs/verl-keys.md");
    assert!(
        doc.contains(&table::markdown()),
        "docs/verl-keys.md is out of date: regenerate it with `grpo verl --keys`"
    );
}

#[test]
fn kl_in_the_reward() {
    let r = translate_with(&[
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_penalty=k3+",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=500",
    ])
    .unwrap()
    .recipe;
    assert_eq!(r.algorithm.kl_penalty, crate::recipe::KlPenalty::K3);
    assert_eq!(
        r.algorithm.kl_ctrl,
        crate::recipe::KlControl::Adaptive {
            target_kl: 0.1,
            horizon: 500.0
        }
    );
    // Without the KL in the reward VeRL reads neither; grpo says so.
    let t = translate_with(&["algorithm.kl_ctrl.type=adaptive"]).unwrap();
    assert_eq!(t.recipe.algorithm.kl_ctrl, crate::recipe::KlControl::Fixed);
    assert!(
        t.notes
            .iter()
            .any(|n| n.starts_with("algorithm.kl_ctrl.type=adaptive has no effect")),
        "{:?}",
        t.notes
    );
    let err = translate_with(&["algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=full"]).unwrap_err();
    assert!(
        err.to_string()
            .contains("algorithm.kl_penalty=full: not supported"),
        "{err}"
    );
}
