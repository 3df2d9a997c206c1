//! Every recipe key changes what a run does, or is refused where it would not: for each key of
//! [`Recipe::all_keys`], a value other than its default (in a context that puts the key's mode
//! on) either changes what the run builds from the recipe (the rollout engine's settings, the
//! sampling parameters, the policy, the GRPO update and its batch plan, PPO's critic, the
//! reward function's scores, the reward pool, the trackers, LoRA's form, the compute types, a
//! multi-turn episode), or is refused naming the key, or the key names the test that shows what
//! it changes (keys the run loop or a worker reads directly: schedules, paths, the cluster).
//!
//! A key that parses and changes nothing fails here: it is either made to do something, or
//! refused in the modes where it does nothing, as `actor.tau_pos` is outside `sapo`.

use actors::recipe::{load_recipe, Recipe};
use actors::setup;
use std::path::{Path, PathBuf};

/// The recipe every check starts from: the fewest keys a recipe needs.
const BASE: &str = "model: {path: m}\ndata: {train_files: t.parquet}\n";

/// How a key is shown to matter when the automatic check (its default flipped, incremented or
/// scaled, everything else at its default) cannot show it.
enum Evidence {
    /// Set the key to `value` (YAML) with `context` (`key=value` overrides, `;`-separated) also
    /// set: what the run builds must change, or the recipe be refused naming the key.
    Set {
        value: &'static str,
        context: &'static str,
    },
    /// `file` (from the workspace root) has `test fn`, which shows what the key changes.
    Test { file: &'static str, test: &'static str },
}
use Evidence::{Set, Test};

/// Contexts that turn a mode on.
const GAE: &str = "algorithm.adv_estimator=gae";
const LORA: &str = "actor.lora_rank=8";
const MULTI_TURN: &str = "rollout.multi_turn.enable=true;rollout.multi_turn.tools=[calculator]";
const SCORER: &str = "reward.scorers={answer: {kind: arithmetic, format_score: 0.5}}";
const OVERLONG: &str = "reward.overlong_buffer.enable=true;reward.overlong_buffer.len=64";
const REJECTION: &str = "algorithm.rollout_correction.rollout_rs=seq_mean_k3;algorithm.rollout_correction.rollout_rs_threshold=0.01";
const AGENT: &str = "rollout.multi_turn.enable=true;rollout.multi_turn.agent={command: [python3, a.py]}";
const ADAPTIVE_KL: &str = "algorithm.use_kl_in_reward=true;algorithm.kl_ctrl.type=adaptive";

/// Keys the automatic check cannot show, each with its evidence.
#[rustfmt::skip]
const EVIDENCE: &[(&str, Evidence)] = &[
    // The model and the rollout.
    ("model.moe_dispatch", Set { value: "grouped", context: "" }),
    ("rollout.dtype", Set { value: "bf16", context: "rollout.dtype=f32" }),
    ("rollout.stop", Set { value: "['END']", context: "" }),
    ("rollout.tensor_model_parallel_size", Set { value: "2", context: "actor.strategy=dp;actor.mesh=2" }),
    ("rollout.val_kwargs.temperature", Set { value: "0.5", context: "rollout.val_kwargs.do_sample=true" }),
    ("rollout.val_kwargs.top_k", Set { value: "5", context: "rollout.val_kwargs.do_sample=true" }),
    ("rollout.val_kwargs.top_p", Set { value: "0.5", context: "rollout.val_kwargs.do_sample=true" }),
    ("rollout.val_kwargs.min_p", Set { value: "0.1", context: "rollout.val_kwargs.do_sample=true" }),
    ("rollout.multi_turn.max_assistant_turns", Set { value: "2", context: MULTI_TURN }),
    ("rollout.multi_turn.max_parallel_calls", Set { value: "2", context: MULTI_TURN }),
    ("rollout.multi_turn.max_tool_response_length", Set { value: "512", context: MULTI_TURN }),
    ("rollout.multi_turn.tool_response_truncate_side", Set { value: "left", context: MULTI_TURN }),
    ("rollout.multi_turn.tool_timeout_s", Set { value: "15", context: MULTI_TURN }),
    ("rollout.multi_turn.max_turn_tokens", Set { value: "16", context: MULTI_TURN }),
    ("rollout.multi_turn.format", Set { value: "llama3", context: MULTI_TURN }),
    ("rollout.multi_turn.tools", Set { value: "[calculator, python]", context: MULTI_TURN }),
    // The reward.
    ("reward.default", Set { value: "answer", context: SCORER }),
    ("reward.data_sources", Set { value: "{openai/gsm8k: answer}", context: SCORER }),
    ("reward.scorers", Set { value: "{answer: {kind: arithmetic, format_score: 0.5}}", context: "reward.default=answer" }),
    ("reward.scorer", Set { value: "answer", context: SCORER }),
    ("reward.overlong_buffer.len", Set { value: "32", context: OVERLONG }),
    ("reward.overlong_buffer.penalty_factor", Set { value: "0.5", context: OVERLONG }),
    ("reward.overlong_buffer.log", Set { value: "true", context: OVERLONG }),
    ("reward.overlong_buffer.max_response_length", Set { value: "1000", context: OVERLONG }),
    // The algorithm.
    ("algorithm.adv_estimator", Set { value: "rloo", context: "" }),
    ("algorithm.gamma", Set { value: "0.5", context: "algorithm.adv_estimator=reinforce_plus_plus" }),
    ("algorithm.lam", Set { value: "0.5", context: GAE }),
    ("algorithm.kl_penalty", Set { value: "low_var_kl", context: "algorithm.use_kl_in_reward=true" }),
    ("algorithm.kl_ctrl.type", Set { value: "adaptive", context: "algorithm.use_kl_in_reward=true" }),
    ("algorithm.kl_ctrl.target_kl", Set { value: "0.5", context: ADAPTIVE_KL }),
    ("algorithm.kl_ctrl.horizon", Set { value: "100", context: ADAPTIVE_KL }),
    ("algorithm.rollout_correction.rollout_is", Set { value: "token", context: "" }),
    ("algorithm.rollout_correction.rollout_is_batch_normalize", Set { value: "true", context: "algorithm.rollout_correction.rollout_is=token" }),
    ("algorithm.rollout_correction.rollout_rs", Set { value: "seq_max_k3", context: REJECTION }),
    ("algorithm.rollout_correction.rollout_rs_threshold", Set { value: "0.5", context: REJECTION }),
    // The actor.
    ("actor.strategy", Set { value: "fsdp", context: "actor.mesh=2;actor.strategy=dp" }),
    ("actor.mesh", Set { value: "4", context: "actor.strategy=dp;actor.mesh=2" }),
    ("actor.tensor_model_parallel_size", Set { value: "2", context: "actor.strategy=dp;actor.mesh=2" }),
    ("actor.param_dtype", Set { value: "bf16", context: "actor.param_dtype=f32" }),
    ("actor.optim.betas", Set { value: "[0.8, 0.9]", context: "" }),
    ("actor.optim.lr_scheduler_type", Set { value: "cosine", context: "" }),
    ("actor.policy_loss.loss_mode", Set { value: "gspo", context: "" }),
    ("actor.policy_loss.clip_cov_ratio", Set { value: "0.0001", context: "actor.policy_loss.loss_mode=clip_cov" }),
    ("actor.policy_loss.clip_cov_lb", Set { value: "0.5", context: "actor.policy_loss.loss_mode=clip_cov" }),
    ("actor.policy_loss.clip_cov_ub", Set { value: "2.5", context: "actor.policy_loss.loss_mode=clip_cov" }),
    ("actor.policy_loss.kl_cov_ratio", Set { value: "0.0001", context: "actor.policy_loss.loss_mode=kl_cov" }),
    ("actor.policy_loss.ppo_kl_coef", Set { value: "0.05", context: "actor.policy_loss.loss_mode=kl_cov" }),
    ("actor.tau_pos", Set { value: "0.5", context: "actor.policy_loss.loss_mode=sapo" }),
    ("actor.tau_neg", Set { value: "0.5", context: "actor.policy_loss.loss_mode=sapo" }),
    ("actor.loss_agg_mode", Set { value: "seq-mean-token-sum", context: "" }),
    ("actor.kl_loss_type", Set { value: "k1", context: "actor.use_kl_loss=true" }),
    ("actor.lora_alpha", Set { value: "8", context: LORA }),
    ("actor.target_modules", Set { value: "[q_proj]", context: LORA }),
    ("actor.target_parameters", Test { file: "tests/run_moe.rs", test: "lora_on_the_experts_trains_them_and_exports_a_peft_adapter" }),
    ("actor.lora_form", Set { value: "applied", context: "actor.lora_rank=8;actor.lora_form=merged" }),
    // PPO's critic.
    ("critic.model.path", Set { value: "another-model", context: GAE }),
    ("critic.model.enable_gradient_checkpointing", Set { value: "true", context: GAE }),
    ("critic.optim.lr", Set { value: "0.001", context: GAE }),
    ("critic.optim.eps", Set { value: "0.001", context: GAE }),
    ("critic.optim.weight_decay", Set { value: "0.5", context: GAE }),
    ("critic.optim.lr_warmup_steps", Set { value: "3", context: GAE }),
    ("critic.optim.min_lr_ratio", Set { value: "0.5", context: "algorithm.adv_estimator=gae;critic.optim.lr_scheduler_type=cosine" }),
    ("critic.optim.betas", Set { value: "[0.8, 0.9]", context: GAE }),
    ("critic.optim.lr_scheduler_type", Set { value: "cosine", context: GAE }),
    ("critic.grad_clip", Set { value: "0.5", context: GAE }),
    ("critic.cliprange_value", Set { value: "0.25", context: GAE }),
    ("critic.loss_agg_mode", Set { value: "seq-mean-token-sum", context: GAE }),
    ("critic.ppo_mini_batch_size", Set { value: "2", context: GAE }),
    ("critic.ppo_micro_batch_size", Set { value: "1", context: GAE }),
    ("critic.ppo_epochs", Set { value: "2", context: GAE }),
    ("trainer.critic_warmup", Set { value: "2", context: GAE }),
    // Keys the run loop, the data loader, a worker or the launcher reads: the test that shows each.
    ("model.path", Test { file: "tests/run_gemma.rs", test: "a_tiny_gemma3_learns_resumes_exactly_and_exports" }),
    ("model.tokenizer", Test { file: "actors/src/prepare.rs", test: "the_model_and_its_tokenizer_are_loaded_as_the_recipe_says" }),
    ("model.random_init", Test { file: "actors/src/prepare.rs", test: "the_model_and_its_tokenizer_are_loaded_as_the_recipe_says" }),
    ("model.chat_template", Test { file: "actors/src/prepare.rs", test: "chat_template_kwargs_reach_every_render" }),
    ("model.lora_adapter_path", Test { file: "tests/run_lora.rs", test: "a_lora_run_trains_the_adapters_exports_them_for_peft_and_resumes" }),
    ("data.train_files", Test { file: "tests/run.rs", test: "a_resume_from_an_epoch_boundary_runs_the_next_epoch" }),
    ("data.val_files", Test { file: "tests/run.rs", test: "validation_in_shuffled_batches_scores_the_same_rows_alike" }),
    ("data.prompt_key", Test { file: "data/tests/datasets.rs", test: "reads_messages_from_a_configured_prompt_key" }),
    ("data.reward_fn_key", Test { file: "data/tests/datasets.rs", test: "reads_messages_from_a_configured_prompt_key" }),
    ("data.gen_batch_size", Test { file: "tests/run.rs", test: "dynamic_sampling_refills_the_step_and_stops_at_its_limit" }),
    ("data.val_batch_size", Test { file: "data/tests/datasets.rs", test: "validation_takes_its_subset_in_batches_of_its_size" }),
    ("data.val_max_samples", Test { file: "data/tests/datasets.rs", test: "validation_takes_its_subset_in_batches_of_its_size" }),
    ("data.shuffle", Test { file: "data/src/sampler.rs", test: "without_drop_last_the_short_batch_is_returned" }),
    ("data.seed", Test { file: "data/src/sampler.rs", test: "each_epoch_is_a_permutation_and_epochs_differ" }),
    ("data.validation_shuffle", Test { file: "tests/run.rs", test: "validation_in_shuffled_batches_scores_the_same_rows_alike" }),
    ("data.drop_last", Test { file: "data/src/sampler.rs", test: "without_drop_last_the_short_batch_is_returned" }),
    ("data.filter_overlong_prompts", Test { file: "data/tests/datasets.rs", test: "filters_overlong_prompts_and_truncates" }),
    ("data.truncation", Test { file: "data/tests/datasets.rs", test: "filters_overlong_prompts_and_truncates" }),
    ("data.train_max_samples", Test { file: "data/tests/datasets.rs", test: "max_samples_takes_a_seeded_subset" }),
    ("data.apply_chat_template_kwargs", Test { file: "actors/src/prepare.rs", test: "chat_template_kwargs_reach_every_render" }),
    ("rollout.multi_turn.enable", Test { file: "tests/run_multi_turn.rs", test: "episodes_run_in_process_and_in_a_rollout_worker_with_their_budgets_and_metrics" }),
    ("rollout.multi_turn.max_user_turns", Test { file: "tests/run_multi_turn.rs", test: "smollm2_episodes_get_an_interactions_replies_and_rewards_in_a_rollout_worker" }),
    ("rollout.multi_turn.interaction_config_path", Test { file: "tests/run_multi_turn.rs", test: "smollm2_episodes_get_an_interactions_replies_and_rewards_in_a_rollout_worker" }),
    ("rollout.multi_turn.tool_config_path", Test { file: "tests/run_multi_turn.rs", test: "tools_from_a_tool_config_file_run_in_process_and_in_a_rollout_worker" }),
    ("rollout.enable_rollout_routing_replay", Test { file: "tests/run_moe.rs", test: "rollout_routing_replay_makes_the_learner_use_the_rollouts_experts" }),
    ("actor.router_replay.mode", Test { file: "tests/run_moe.rs", test: "rollout_routing_replay_makes_the_learner_use_the_rollouts_experts" }),
    ("reward.custom_reward_function.path", Test { file: "tests/run.rs", test: "a_reward_file_written_for_verl_scores_the_run_and_its_extras_become_metrics" }),
    ("reward.custom_reward_function.name", Test { file: "reward/tests/verl_function.rs", test: "a_verl_reward_file_scores_as_it_does_in_python" }),
    ("reward.custom_reward_function.reward_kwargs", Test { file: "tests/run.rs", test: "a_reward_file_written_for_verl_scores_the_run_and_its_extras_become_metrics" }),
    ("reward.custom_reward_function.reward_manager", Test { file: "reward/tests/verl_function.rs", test: "a_verl_reward_file_scores_as_it_does_in_python" }),
    ("reward.custom_reward_function.workers", Test { file: "reward/tests/verl_function.rs", test: "workers_processes_serve_the_function_side_by_side" }),
    ("reward.custom_reward_function.timeout_s", Test { file: "reward/tests/verl_function.rs", test: "raising_hanging_crashing_and_garbage_cost_only_their_own_samples" }),
    ("algorithm.filter_groups.enable", Test { file: "tests/run.rs", test: "dynamic_sampling_refills_the_step_and_stops_at_its_limit" }),
    ("algorithm.filter_groups.metric", Test { file: "tests/run.rs", test: "dynamic_sampling_refills_the_step_and_stops_at_its_limit" }),
    ("algorithm.filter_groups.max_num_gen_batches", Test { file: "tests/run.rs", test: "dynamic_sampling_refills_the_step_and_stops_at_its_limit" }),
    ("trainer.total_epochs", Test { file: "tests/run.rs", test: "a_resume_from_an_epoch_boundary_runs_the_next_epoch" }),
    ("trainer.total_training_steps", Test { file: "tests/run.rs", test: "a_resume_with_a_changed_recipe_follows_the_stated_rule" }),
    ("trainer.save_freq", Test { file: "tests/run.rs", test: "a_tiny_run_trains_validates_checkpoints_and_resumes" }),
    ("trainer.test_freq", Test { file: "tests/run_tracking.rs", test: "every_tracker_gets_the_runs_verl_named_metrics_and_a_resume_continues_them" }),
    ("trainer.val_before_train", Test { file: "tests/verl.rs", test: "verls_own_grpo_scripts_run_and_train" }),
    ("trainer.max_checkpoints_to_keep", Test { file: "trainer/src/checkpoint.rs", test: "keeps_only_the_newest_n" }),
    ("trainer.resume_mode", Test { file: "tests/run.rs", test: "val_only_and_resume_path_work_as_in_verl" }),
    ("trainer.resume_from_path", Test { file: "tests/run.rs", test: "val_only_and_resume_path_work_as_in_verl" }),
    ("trainer.allow_recipe_change_on_resume", Test { file: "tests/run.rs", test: "a_resume_with_a_changed_recipe_follows_the_stated_rule" }),
    ("trainer.val_only", Test { file: "tests/run.rs", test: "val_only_and_resume_path_work_as_in_verl" }),
    ("trainer.log_val_generations", Test { file: "tests/run_tracking.rs", test: "every_tracker_gets_the_runs_verl_named_metrics_and_a_resume_continues_them" }),
    ("trainer.rollout_data_dir", Test { file: "tests/run_multi_turn.rs", test: "episodes_run_in_process_and_in_a_rollout_worker_with_their_budgets_and_metrics" }),
    ("trainer.off_policy_steps", Test { file: "tests/run.rs", test: "one_step_off_policy_overlaps_generation_with_the_update" }),
    ("trainer.output_dir", Test { file: "tests/run_lora.rs", test: "a_lora_run_trains_the_adapters_exports_them_for_peft_and_resumes" }),
    ("trainer.logger", Test { file: "tests/run_tracking.rs", test: "without_file_and_console_a_run_writes_no_metrics_file_and_no_step_lines" }),
    ("trainer.project_name", Test { file: "tests/run_tracking.rs", test: "every_tracker_gets_the_runs_verl_named_metrics_and_a_resume_continues_them" }),
    ("trainer.experiment_name", Test { file: "tests/run_tracking.rs", test: "every_tracker_gets_the_runs_verl_named_metrics_and_a_resume_continues_them" }),
    ("cluster.device", Test { file: "actors/src/launcher/mod.rs", test: "a_missing_device_plugin_names_the_key_that_asks_for_it" }),
    ("cluster.plugin_path", Test { file: "actors/src/launcher/mod.rs", test: "a_missing_device_plugin_names_the_key_that_asks_for_it" }),
    ("cluster.cpu_device_count", Test { file: "tests/run_colocated.rs", test: "dp_and_fsdp_on_four_devices_train_like_one_device_without_host_weight_copies" }),
    ("cluster.launcher", Test { file: "tests/run_ray.rs", test: "workers_run_as_ray_jobs_in_their_pools_and_a_stopped_job_is_resubmitted" }),
    ("cluster.rollout_workers", Test { file: "tests/run.rs", test: "rollout_and_reward_in_worker_processes_give_the_same_metrics_and_survive_kill_9" }),
    ("cluster.reward_workers", Test { file: "tests/run.rs", test: "rollout_and_reward_in_worker_processes_give_the_same_metrics_and_survive_kill_9" }),
    ("cluster.learner_workers", Test { file: "tests/run_learner_worker.rs", test: "a_learner_worker_trains_checkpoints_and_resumes_like_the_in_process_learner" }),
    ("cluster.rollout_device", Test { file: "actors/src/launcher/mod.rs", test: "workers_on_another_device_kind_get_it_as_overrides" }),
    ("cluster.learner_device", Test { file: "actors/src/launcher/mod.rs", test: "workers_on_another_device_kind_get_it_as_overrides" }),
    ("cluster.bind_host", Test { file: "actors/src/launcher/local.rs", test: "listening_lines_parse_and_unspecified_hosts_become_loopback" }),
    ("cluster.worker_timeout_s", Test { file: "tests/run_faults.rs", test: "frozen_rollout_and_reward_workers_are_replaced_and_the_steps_complete" }),
    ("cluster.tls.cert", Test { file: "actors/src/transport.rs", test: "mutual_tls_workers_refuse_clients_without_the_clusters_certificate" }),
    ("cluster.tls.key", Test { file: "actors/src/transport.rs", test: "mutual_tls_workers_refuse_clients_without_the_clusters_certificate" }),
    ("cluster.tls.ca", Test { file: "actors/src/transport.rs", test: "reward_round_trip_over_tls_and_clients_without_the_ca_are_refused" }),
    ("cluster.tls.domain", Test { file: "actors/src/transport.rs", test: "reward_round_trip_over_tls_and_clients_without_the_ca_are_refused" }),
    ("cluster.tls.mutual", Test { file: "tests/run_tls.rs", test: "a_run_over_mutual_tls_matches_the_plain_run_and_its_workers_refuse_strangers" }),
    ("cluster.ray.address", Test { file: "tests/run_ray.rs", test: "workers_run_as_ray_jobs_in_their_pools_and_a_stopped_job_is_resubmitted" }),
    ("cluster.pools[].name", Test { file: "tests/run_ray.rs", test: "workers_run_as_ray_jobs_in_their_pools_and_a_stopped_job_is_resubmitted" }),
    ("cluster.pools[].device", Test { file: "actors/src/launcher/ray/mod.rs", test: "a_pools_workers_open_its_device" }),
    ("cluster.pools[].roles", Test { file: "tests/run_ray.rs", test: "workers_run_as_ray_jobs_in_their_pools_and_a_stopped_job_is_resubmitted" }),
    ("cluster.pools[].workers", Test { file: "actors/src/recipe/validate.rs", test: "a_ray_cluster_with_pools_is_valid_and_lists_its_workers" }),
    ("cluster.pools[].num_gpus", Test { file: "tests/run_ray.rs", test: "workers_run_as_ray_jobs_in_their_pools_and_a_stopped_job_is_resubmitted" }),
    ("cluster.pools[].resources", Test { file: "tests/run_ray.rs", test: "workers_run_as_ray_jobs_in_their_pools_and_a_stopped_job_is_resubmitted" }),
    ("cluster.ray.binary", Test { file: "actors/src/run/assembly.rs", test: "workers_run_the_program_asked_for" }),
    ("cluster.ray.runtime_env", Test { file: "tests/run_ray.rs", test: "workers_run_as_ray_jobs_in_their_pools_and_a_stopped_job_is_resubmitted" }),
    ("cluster.ray.max_resubmits", Test { file: "tests/run_ray.rs", test: "workers_run_as_ray_jobs_in_their_pools_and_a_stopped_job_is_resubmitted" }),
    ("cluster.ray.orchestrator_host", Test { file: "actors/src/launcher/ray/registry.rs", test: "a_worker_with_the_token_registers_and_is_waited_for" }),
    ("cluster.pools[].num_cpus", Test { file: "tests/run_ray.rs", test: "workers_run_as_ray_jobs_in_their_pools_and_a_stopped_job_is_resubmitted" }),
    // An agent program's settings.
    ("rollout.multi_turn.agent.command", Set { value: "[python3, b.py]", context: AGENT }),
    ("rollout.multi_turn.agent.timeout_s", Set { value: "5", context: AGENT }),
    ("rollout.multi_turn.agent.tool_schemas", Set { value: "tests/fixtures/agent_tools.yaml", context: AGENT }),
    // Read where named, but no test shows the effect yet.
    ("cluster.ray.poll_interval_s", Test { file: "actors/src/launcher/ray/mod.rs", test: "job_polls_are_spaced_by_the_poll_interval" }),
];

/// What the run builds from `recipe`, as text: equal texts, equal runs (as far as the recipe's
/// conversion into the crates' configurations decides).
fn built(recipe: &Recipe) -> String {
    let config = model::ModelConfig::tiny_llama();
    let policy = setup::policy(recipe, &config);
    let row = serde_json::json!({
        "agent_name": "tool_agent",
        "extra_info": {"tools_kwargs": {}, "interaction_kwargs": {}},
    });
    let samples = [
        "12",
        "The answer is 12.",
        "#### 12",
        "\\boxed{12}",
        "13",
        "twelve",
    ];
    let scores: Vec<String> = match setup::reward_function(recipe, false) {
        Ok(reward) => ["grpo/arithmetic", "openai/gsm8k", "lighteval/MATH", "other"]
            .iter()
            .flat_map(|source| samples.iter().map(move |text| (source, text)))
            .map(|(source, text)| {
                let sample = reward::Sample {
                    id: 1,
                    data_source: source.to_string(),
                    prompt: serde_json::Value::Null,
                    response: text.to_string(),
                    ground_truth: "12".into(),
                    extra: serde_json::json!({}),
                    response_length: 1000,
                    truncated: false,
                };
                format!("{:?}", reward.score(&sample))
            })
            .collect(),
        Err(e) => vec![e.to_string()],
    };
    format!(
        "{:#?}",
        (
            (
                (
                    setup::samples_per_prompt(recipe, false),
                    setup::samples_per_prompt(recipe, true)
                ),
                [1, 1 << 40, 1 << 62].map(|id| setup::request_seed(recipe, id)),
            ),
            (
                setup::engine_config(recipe, &[2]),
                setup::sampling_params(recipe, false),
                setup::sampling_params(recipe, true),
            ),
            (
                setup::batch_plan(recipe),
                setup::update_config(recipe, &policy, 1000),
                &policy
            ),
            (setup::critic(recipe, &config), setup::critic_batch_plan(recipe)),
            setup::critic_model_config(recipe, &config),
            scores,
            setup::reward_pool(recipe).map_err(|e| e.to_string()),
            // The trackers' settings, not their parameters (the whole recipe, logged as is).
            {
                let t = setup::tracking(recipe, Path::new("out"), 0);
                (
                    t.loggers,
                    t.project,
                    t.experiment,
                    t.output,
                    t.resume,
                    t.start_step,
                )
            },
            setup::lora_form(recipe),
            (setup::actor_dtype(recipe), setup::rollout_dtype(recipe)),
            setup::episode(recipe, &row).map(|e| format!("{e:?}")),
            (
                setup::tool_settings(recipe),
                setup::tool_specs(recipe),
                setup::agent_settings(recipe)
            ),
        )
    )
}

/// The recipe made of [`BASE`] and `overrides`, loaded and validated as `grpo run` does.
fn load(overrides: &[String]) -> Result<Recipe, String> {
    static FILE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let file = FILE.get_or_init(|| {
        let file = std::env::temp_dir().join(format!("recipe-keys-{}.yaml", std::process::id()));
        std::fs::write(&file, BASE).unwrap();
        file
    });
    load_recipe(file, overrides).map_err(|e| e.to_string())
}

/// The value of dotted `key` in the resolved recipe (`None` for a list entry's key).
fn default_of(recipe: &Recipe, key: &str) -> Option<serde_yaml::Value> {
    let mut value = serde_yaml::to_value(recipe).unwrap();
    for part in key.split('.') {
        value = value.get(part)?.clone();
    }
    Some(value)
}

/// A value other than `default` of the same type, when one can be made without knowing the key.
fn other_value(default: &serde_yaml::Value) -> Option<String> {
    use serde_yaml::Value;
    match default {
        Value::Bool(b) => Some((!b).to_string()),
        Value::Number(n) if n.is_u64() || n.is_i64() => {
            let n = n.as_i64().unwrap();
            Some(if n <= 0 { 1 } else { n * 2 }.to_string())
        }
        Value::Number(n) => {
            let f = n.as_f64().unwrap();
            Some(if f == 0.0 { 0.1 } else { f * 0.5 }.to_string())
        }
        _ => None,
    }
}

/// How validation words a refusal of a key in a mode that does not read it.
const REFUSED_IN_MODE: &[&str] = &["is read only", "read only with", "does nothing", "has no effect"];

/// Whether `error` names `key` or a section holding it (`critic.optim` for `critic.optim.lr`).
fn names_key_or_section(error: &str, key: &str) -> bool {
    let parts: Vec<&str> = key.split('.').collect();
    (2..=parts.len()).any(|n| error.contains(&format!("`{}`", parts[..n].join("."))))
}

/// Whether setting `key` to `value` (with `context`) changes what the run builds or is refused
/// naming the key; `Err` says what happened instead.
fn matters(key: &str, value: &str, context: &[String]) -> Result<String, String> {
    let before = load(context).map_err(|e| format!("the context {context:?} is refused: {e}"))?;
    let mut overrides = context.to_vec();
    overrides.push(format!("{key}={value}"));
    match load(&overrides) {
        Err(e) if names_key_or_section(&e, key) && REFUSED_IN_MODE.iter().any(|w| e.contains(w)) => {
            Err(format!(
                "{key}={value} is refused in this context (it is read in another: give that context): {e}"
            ))
        }
        Err(e) => Err(format!("{key}={value} is refused for another reason: {e}")),
        Ok(after) if built(&after) != built(&before) => Ok("changes what the run builds".into()),
        Ok(_) => Err(format!("{key}={value} changes nothing the run builds")),
    }
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn every_recipe_key_changes_the_run_or_is_refused() {
    let base = load(&[]).unwrap();
    let keys = Recipe::all_keys();
    let mut inert = Vec::new();
    // A section's own key is checked through its fields.
    let sections: Vec<&String> = keys
        .iter()
        .filter(|k| {
            keys.iter()
                .any(|o| o.starts_with(&format!("{k}.")) || o.starts_with(&format!("{k}[].")))
        })
        .collect();
    for key in keys.iter().filter(|k| !sections.contains(k)) {
        let key = key.clone();
        let result = match EVIDENCE.iter().find(|(k, _)| *k == key).map(|(_, e)| e) {
            Some(Set { value, context }) => {
                let context: Vec<String> = context
                    .split(';')
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect();
                matters(&key, value, &context)
            }
            Some(Test { file, test }) => {
                let text = std::fs::read_to_string(workspace().join(file)).unwrap_or_default();
                match text.contains(&format!("fn {test}(")) {
                    true => Ok(format!("shown by {file}: {test}")),
                    false => Err(format!("{file} has no test `{test}`")),
                }
            }
            None => match default_of(&base, &key).as_ref().and_then(other_value) {
                Some(value) => matters(&key, &value, &[]),
                None => Err(format!(
                    "{key}: no evidence (its default is not a bool or a number)"
                )),
            },
        };
        match result {
            Ok(how) => println!("{key}: {how}"),
            Err(e) => inert.push(e),
        }
    }
    for (key, _) in EVIDENCE {
        assert!(
            Recipe::all_keys().iter().any(|k| k == key),
            "EVIDENCE lists `{key}`, not a recipe key"
        );
    }
    assert!(
        inert.is_empty(),
        "{} recipe keys not shown to matter (make the run read each, refuse it where it does \
         nothing, or give it evidence in EVIDENCE):\n{}",
        inert.len(),
        inert.join("\n")
    );
}
