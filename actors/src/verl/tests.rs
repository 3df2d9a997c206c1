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
    let mut all = std::collections::BTreeSet::new();
    for v in version::VERSIONS {
        for engine in v.engines() {
            let defaults = v.defaults(engine).unwrap();
            assert!(
                defaults.len() > 500,
                "{} {engine}: {} keys",
                v.commit,
                defaults.len()
            );
            for key in defaults.keys() {
                let entry = table::entry(key)
                    .unwrap_or_else(|| panic!("no table entry for `{key}` (VeRL {} {engine})", v.commit));
                assert!(
                    !ADDED_KEYS.contains(&entry.key),
                    "`{key}` is VeRL's, not an added key"
                );
            }
            all.extend(defaults.into_keys());
        }
    }
    for e in TABLE {
        let covers = all.iter().any(|k| match e.key.strip_suffix(".*") {
            Some(section) => table::within(k, section),
            None => k == e.key,
        });
        assert_eq!(
            covers,
            !ADDED_KEYS.contains(&e.key),
            "table entry `{}` names no key of any VeRL config (or an added key names one)",
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

/// For every release and engine: each mapped key of its config, VeRL's default, reaches its
/// recipe key unchanged.
#[test]
fn mapped_keys_reach_their_recipe_keys() {
    for v in version::VERSIONS {
        for engine in v.engines() {
            let mut overrides: Vec<String> = BASE.iter().map(|s| s.to_string()).collect();
            overrides.push(format!("model_engine={engine}"));
            if engine == "torchtitan" {
                // TorchTitan's default schedule (linear decay) is not grpo's.
                overrides.push("actor_rollout_ref.actor.optim.decay_type=cosine".into());
            }
            if !v.has_reward_section() {
                overrides.retain(|o| !o.starts_with("model_engine"));
            }
            let input = VerlInput {
                overrides,
                config_name: (!v.has_reward_section() && engine == "megatron")
                    .then(|| "ppo_megatron_trainer".to_string()),
                verl_version: Some(v.commit.to_string()),
                ..Default::default()
            };
            let t = translate(&input).unwrap_or_else(|e| panic!("VeRL {} {engine}: {e}", &v.commit[..8]));
            let mut config = hydra::Config::new(v.defaults(engine).unwrap());
            for raw in BASE {
                config.apply(&Override::parse(raw).unwrap()).unwrap();
            }
            for e in TABLE {
                let How::Map(to) = e.how else { continue };
                let Some(verl) = config.get(e.key).unwrap() else {
                    continue;
                };
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
                assert!(
                    same,
                    "VeRL {} {engine}: `{}` = {verl} became `{to}` = {ours}",
                    &v.commit[..8],
                    e.key
                );
            }
        }
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
    assert!(err.contains("does not split evenly over 3 data devices"), "{err}");
}

#[test]
fn errors_name_the_key_and_the_way_out() {
    let err = |extra: &[&str]| translate_with(extra).unwrap_err().to_string();
    assert_eq!(
        err(&["actor_rollout_ref.actor.optim.lr_rate=1e-6"]),
        "actor_rollout_ref.actor.optim.lr_rate=1e-6: `actor_rollout_ref.actor.optim.lr_rate` is not \
         a key of VeRL's config as of VeRL 0.7.1 and later (config of 1dda039b, 2026-08-22), \
         model_engine=dp (VeRL's Hydra would refuse it too: Key \
         'actor_rollout_ref.actor.optim.lr_rate' is not in struct); did you mean \
         `actor_rollout_ref.actor.optim.lr`?; a key VeRL reads without listing it is added with \
         `+actor_rollout_ref.actor.optim.lr_rate=...`"
    );
    assert_eq!(
        err(&[
            "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=3",
            "sandbox_fusion.url=http://127.0.0.1:8080"
        ]),
        "2 VeRL settings grpo cannot honour:\n  actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=3: \
         not supported: grpo's multi-turn rollouts run the tools of `rollout.multi_turn.tools` and \
         `rollout.multi_turn.tool_config_path` (built-ins, JSON-lines commands, HTTP endpoints) and the \
         interactions of `rollout.multi_turn.interaction_config_path`, or your own agent program \
         through an OpenAI-compatible endpoint (`rollout.multi_turn.agent`); VeRL's Python agent loop \
         classes and repeated rollouts are not in grpo\n  sandbox_fusion.url=http://127.0.0.1:8080 \
         (read as reward.sandbox_fusion.url): not supported: code execution in a Sandbox Fusion \
         server is not in grpo; a `custom_reward_function` file can run the code itself"
    );
    assert_eq!(
        err(&["actor_rollout_ref.actor.kl_loss_type=k9"]),
        "`actor_rollout_ref.actor.kl_loss_type=k9` (recipe key `actor.kl_loss_type`): unknown \
         variant `k9`, expected one of `k1`, `kl`, `abs`, `k2`, `mse`, `k3`, `low_var_kl`"
    );
    assert!(err(&["trainer.logger=console,wandb"]).contains("sweep over"));
    // Hydra adds a key with `+`; VeRL's code may read it, grpo knows of no reader: a note.
    let added = translate_with(&["+trainer.my_key=1"]).unwrap();
    assert!(
        added
            .notes
            .iter()
            .any(|n| n.starts_with("+trainer.my_key=1 has no effect in grpo: it adds a key")),
        "{:?}",
        added.notes
    );
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
        verl_version: None,
    })
    .unwrap();
    assert_eq!(t.recipe.data.train_batch_size, 16);
    let f = t.recipe.reward.custom_reward_function.unwrap();
    assert_eq!(f.path, format!("{}/score.py", std::env::var("HOME").unwrap()));
    assert_eq!(f.name, "compute_score");
    assert_eq!(f.reward_kwargs["scale"], json!(2));
    // A file whose defaults choose VeRL's Megatron config composes it.
    std::fs::write(
        dir.path().join("mine_megatron.yaml"),
        "defaults:\n  - ppo_megatron_trainer\n  - _self_\n",
    )
    .unwrap();
    let t = translate(&VerlInput {
        overrides: BASE.iter().map(|s| s.to_string()).collect(),
        config_path: Some(dir.path().to_path_buf()),
        config_name: Some("mine_megatron".into()),
        verl_version: None,
    })
    .unwrap();
    assert!(
        t.notes.iter().any(|n| n.contains("model_engine=megatron")),
        "{:?}",
        t.notes
    );
    // A config group from another package is an engine grpo does not have.
    std::fs::write(
        dir.path().join("other.yaml"),
        "defaults:\n  - override actor@actor_rollout_ref.actor: mlite_actor\n",
    )
    .unwrap();
    let err = translate(&VerlInput {
        overrides: Vec::new(),
        config_path: Some(dir.path().to_path_buf()),
        config_name: Some("other".into()),
        verl_version: None,
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("not one of the configs VeRL ships"), "{err}");
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

#[test]
fn todays_reward_section_and_the_legacy_keys_it_replaced() {
    // VeRL 0.7.1's `reward` section.
    let t = translate_with(&[
        "reward.num_workers=4",
        "reward.custom_reward_function.path=/r/score.py",
        "reward.custom_reward_function.name=my_score",
        "+reward.custom_reward_function.reward_kwargs.scale=2",
        "reward.reward_manager.name=batch",
    ])
    .unwrap();
    assert!(
        t.notes.iter().any(|n| n.contains("read as VeRL 0.7.1 and later")),
        "{:?}",
        t.notes
    );
    let f = t.recipe.reward.custom_reward_function.unwrap();
    assert_eq!((f.path.as_str(), f.name.as_str()), ("/r/score.py", "my_score"));
    assert_eq!(f.reward_kwargs["scale"], json!(2));
    // The top-level keys 0.7.1 still lists, moved where its releases moved them; DAPO's manager
    // brings its overlong penalty.
    let t = translate_with(&[
        "custom_reward_function.path=/r/score.py",
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.max_resp_len=512",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=128",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
    ])
    .unwrap();
    assert!(
        t.notes
            .iter()
            .any(|n| n.contains("reward_model.reward_manager -> reward.reward_manager.name")),
        "{:?}",
        t.notes
    );
    let f = t.recipe.reward.custom_reward_function.clone().unwrap();
    assert_eq!(
        (f.path.as_str(), f.name.as_str()),
        ("/r/score.py", "compute_score")
    );
    let o = &t.recipe.reward.overlong_buffer;
    assert!(o.enable);
    assert_eq!(
        (o.len, o.penalty_factor, o.max_response_length),
        (128, 0.5, Some(512))
    );
    // The two layouts' own keys together are refused, naming one of each.
    let err = translate_with(&["reward_manager.name=batch", "reward.num_workers=2"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("mixes VeRL's layouts"), "{err}");
    assert!(
        err.contains("`reward_manager.name`") && err.contains("`reward.num_workers`"),
        "{err}"
    );
    // --verl-version names the layout a key is checked against.
    let err = translate(&VerlInput {
        overrides: BASE
            .iter()
            .chain(&["reward.num_workers=2"])
            .map(|s| s.to_string())
            .collect(),
        verl_version: Some("0.7.0".into()),
        ..Default::default()
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("as of VeRL 0.7.0 and earlier"), "{err}");
}

#[test]
fn clip_bounds_go_only_to_the_losses_that_clip() {
    // VeRL's Qwen3.5 GSPO scripts set the dual clip, which only vanilla reads.
    let t = translate_with(&[
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.clip_ratio_low=3e-4",
        "actor_rollout_ref.actor.clip_ratio_high=4e-4",
        "actor_rollout_ref.actor.clip_ratio_c=10.0",
    ])
    .unwrap();
    assert_eq!(
        (t.recipe.actor.clip_ratio_low, t.recipe.actor.clip_ratio_high),
        (3e-4, 4e-4)
    );
    assert_eq!(t.recipe.actor.clip_ratio_c, 3.0);
    assert!(
        t.notes
            .iter()
            .any(|n| n.starts_with("actor_rollout_ref.actor.clip_ratio_c=10.0 has no effect")),
        "{:?}",
        t.notes
    );
    let t = translate_with(&[
        "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
        "actor_rollout_ref.actor.clip_ratio_high=0.3",
    ])
    .unwrap();
    assert!(
        t.notes
            .iter()
            .any(|n| n.contains("clip_ratio_high=0.3 has no effect: VeRL's sapo loss does not clip")),
        "{:?}",
        t.notes
    );
    // `clip_ratio` fills only a null bound, and VeRL's are 0.2.
    let t = translate_with(&["actor_rollout_ref.actor.clip_ratio=0.3"]).unwrap();
    assert_eq!(t.recipe.actor.clip_ratio_high, 0.2);
    assert!(
        t.notes
            .iter()
            .any(|n| n.contains("clip_ratio=0.3 has no effect: VeRL reads it only where")),
        "{:?}",
        t.notes
    );
    let t = translate_with(&[
        "actor_rollout_ref.actor.clip_ratio=0.3",
        "actor_rollout_ref.actor.clip_ratio_high=null",
    ])
    .unwrap();
    assert_eq!(t.recipe.actor.clip_ratio_high, 0.3);
}

#[test]
fn verls_reward_model_scores_every_sample() {
    for (layout, rm) in [
        (
            None,
            [
                "reward.reward_model.enable=True",
                "reward.reward_model.model_path=/rm",
            ],
        ),
        (
            Some("0.7.0"),
            ["reward_model.enable=True", "reward_model.model.path=/rm"],
        ),
    ] {
        let t = translate(&VerlInput {
            overrides: BASE.iter().chain(&rm).map(|s| s.to_string()).collect(),
            verl_version: layout.map(String::from),
            ..Default::default()
        })
        .unwrap();
        let r = &t.recipe.reward;
        assert_eq!(r.scorer.as_deref(), Some("verl_reward_model"), "{layout:?}");
        match &r.scorers["verl_reward_model"] {
            reward::config::ScorerSpec::RewardModel(spec) => {
                assert_eq!(spec.path, "/rm");
                // VeRL 0.7.1 reads prompt and response of 2048 tokens each.
                if layout.is_none() {
                    assert_eq!(spec.max_length, 4096);
                }
            }
            other => panic!("{other:?}"),
        }
    }
    // VeRL 0.7.1's custom function beside the model calls it through VeRL's router.
    let err = translate_with(&[
        "reward.reward_model.enable=True",
        "reward.reward_model.model_path=/rm",
        "reward.custom_reward_function.path=/r.py",
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("through VeRL's reward router"), "{err}");
    let err = translate_with(&["reward.reward_model.enable=True"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs the reward model's checkpoint"), "{err}");
}

#[test]
fn chat_template_kwargs_come_over() {
    let r = translate_with(&["+data.apply_chat_template_kwargs.enable_thinking=False"])
        .unwrap()
        .recipe;
    assert_eq!(
        r.data.apply_chat_template_kwargs.get("enable_thinking"),
        Some(&json!(false))
    );
}

#[test]
fn megatron_sizes_on_grpos_mesh() {
    let eight = [
        "model_engine=megatron",
        "trainer.n_gpus_per_node=8",
        "trainer.device=cpu",
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.context_parallel_size=2",
    ];
    let t = translate_with(&eight).unwrap();
    let r = &t.recipe;
    assert_eq!(r.actor.tensor_model_parallel_size, 2);
    assert_eq!(r.actor.mesh, Some(8));
    // 4 data devices x the per-device 8 sequences (fitted to each device's 8 of 32).
    assert_eq!(r.actor.ppo_micro_batch_size, 32);
    for note in ["grpo does not pipeline", "grpo does not split a sequence"] {
        assert!(
            t.notes
                .iter()
                .any(|n| n.contains(note) && n.contains("FSDP over 4 x tensor parallelism over 2")),
            "{note}: {:?}",
            t.notes
        );
    }
    // Megatron's schedule words: cosine down to an absolute floor.
    let r = translate_with(&[
        "model_engine=megatron",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
        "actor_rollout_ref.actor.optim.min_lr=1e-6",
    ])
    .unwrap()
    .recipe;
    assert_eq!(
        r.actor.optim.lr_scheduler_type,
        trainer::config::LrSchedule::Cosine
    );
    assert!((r.actor.optim.min_lr_ratio - 0.1).abs() < 1e-12);
    // Expert parallelism: the experts split by expert over TP and by width over FSDP instead,
    // with a note; a size that does not divide the devices is refused, as VeRL refuses it.
    let mut moe = eight.to_vec();
    moe.push("actor_rollout_ref.actor.megatron.expert_model_parallel_size=4");
    moe.extend([
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
        "actor_rollout_ref.rollout.expert_parallel_size=2",
    ]);
    let t = translate_with(&moe).unwrap();
    for note in [
        "expert_model_parallel_size=4: grpo does not exchange tokens between devices for the experts; \
         the learner's 8 devices are FSDP over 4 x tensor parallelism over 2",
        "every device storing 1/8 of them (an expert-parallel split over 4 stores 1/4)",
        "rollout.expert_parallel_size=2: grpo's rollout splits each MoE layer's experts by expert over \
         its 4 tensor-parallel devices",
    ] {
        assert!(t.notes.iter().any(|n| n.contains(note)), "{note}: {:?}", t.notes);
    }
    let err = translate_with(&[
        "model_engine=megatron",
        "trainer.n_gpus_per_node=8",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=3",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.expert_parallel_size=4",
    ])
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("3 expert-parallel devices do not divide the run's 8"),
        "{err}"
    );
    assert!(
        err.contains("expert_parallel_size=4: not supported: grpo's rollout splits the experts over its tensor-parallel devices only"),
        "{err}"
    );
    // Router replay, as VeRL's MoE scripts set it: through the engine's own key.
    let r = translate_with(&[
        "model_engine=megatron",
        "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
    ])
    .unwrap()
    .recipe;
    assert_eq!(r.actor.router_replay.mode, trainer::config::RouterReplay::R3);
    assert_eq!(r.rollout.enable_rollout_routing_replay, Some(true));
    let err = translate_with(&[
        "model_engine=megatron",
        "actor_rollout_ref.actor.router_replay.mode=R2",
        "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("set one router replay mode"), "{err}");
    // VeRL's own Megatron config by name, without a file here.
    let t = translate(&VerlInput {
        overrides: BASE.iter().map(|s| s.to_string()).collect(),
        config_path: Some("config".into()),
        config_name: Some("ppo_megatron_trainer.yaml".into()),
        verl_version: None,
    })
    .unwrap();
    assert!(
        t.notes
            .iter()
            .any(|n| n.contains("VeRL's own `ppo_megatron_trainer` is composed")),
        "{:?}",
        t.notes
    );
    assert!(
        t.notes
            .iter()
            .any(|n| n.contains("model_engine=megatron (from `--config-name=")),
        "{:?}",
        t.notes
    );
}

#[test]
fn keys_hydra_accepts_and_verl_never_reads_pass_with_a_note() {
    let t = translate_with(&[
        "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "ray_kwargs.ray_init.runtime_env.py_executable=uv run",
        "hydra.run.dir=/tmp/outputs",
    ])
    .unwrap();
    for note in [
        "+actor_rollout_ref.rollout.enable_sleep_mode=False has no effect in grpo: it adds a key",
        "ray_kwargs.ray_init.runtime_env.py_executable=uv run has no effect in grpo",
        "hydra.run.dir=/tmp/outputs has no effect in grpo",
    ] {
        assert!(
            t.notes.iter().any(|n| n.starts_with(note)),
            "{note}: {:?}",
            t.notes
        );
    }
    // Without the `+`, Hydra refuses a key the config lacks, and so does grpo verl.
    let err = translate_with(&["actor_rollout_ref.rollout.enable_sleep_mode=False"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("is not a key of VeRL's config as of VeRL 0.7.1 and later"),
        "{err}"
    );
    let err = translate_with(&["data.train_batch_sise=8"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("did you mean `data.train_batch_size`"), "{err}");
}

#[test]
fn lora_on_stacked_experts_is_verls_added_target_parameters() {
    let t = translate_with(&[
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        "+actor_rollout_ref.model.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
    ])
    .unwrap();
    let lora = t.recipe.actor.lora().unwrap();
    assert_eq!(
        lora.targets,
        [
            model::Target::Q,
            model::Target::V,
            model::Target::ExpertsGateUp,
            model::Target::ExpertsDown
        ]
    );
    let e = translate_with(&[
        "actor_rollout_ref.model.lora_rank=8",
        "+actor_rollout_ref.model.target_parameters=[mlp.gate.weight]",
    ])
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("mlp.gate.weight") && e.contains("mlp.experts.down_proj"),
        "{e}"
    );
}
