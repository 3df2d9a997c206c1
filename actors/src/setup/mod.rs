//! A validated recipe turned into every crate's configuration and into live objects, in one
//! place, shared by the orchestrator, the workers and `grpo compile` so all build exactly the
//! same thing: the PJRT client of `cluster.device`, the rollout engine and the sampling
//! settings of the `rollout` section, the policy and the GRPO update of the `actor` and
//! `algorithm` sections, the reward function and its pool. [`device`]: the client and the
//! compute types (`auto` decided once per run for each role's device; the workers read the
//! decided recipe).

pub mod device;

pub use device::{
    actor_dtype, compute_dtype, learner_device, open_client, resolve_auto_dtypes, resolve_auto_dtypes_on,
    rollout_device, rollout_dtype, DTypeChoice,
};

use crate::recipe::{DeviceKind, LoraFormName, Recipe};
use model::{ChatTemplate, ModelTokenizer};
use rollout::{EngineConfig, SamplingParams};
use std::path::Path;
use trainer::policy::DecoderPolicy;
use trainer::step::StepConfig;
use trainer::update::{BatchPlan, CriticConfig, UpdateConfig};

/// The engine settings of the `rollout` section: `rollout.max_num_seqs` KV slots of
/// `max_prompt_length + max_response_length` tokens, stopping on the model's end tokens; with
/// LoRA in the applied form ([`lora_form`]) the adapters beside the weights.
pub fn engine_config(recipe: &Recipe, stop_token_ids: &[u32]) -> EngineConfig {
    let len = recipe.data.max_prompt_length + recipe.data.max_response_length;
    let mut settings = EngineConfig::new(recipe.rollout.max_num_seqs, len);
    settings.eos_token_ids = stop_token_ids.to_vec();
    settings.tensor_parallel = recipe.rollout.tensor_model_parallel_size.max(1);
    settings.record_routes = recipe.rollout.records_routes(&recipe.actor);
    settings.moe_lowering = recipe.model.moe_dispatch.lowering();
    settings.adapters = recipe
        .actor
        .lora()
        .filter(|_| matches!(lora_form(recipe), Some((model::LoraForm::Applied, _))));
    settings
}

/// The episode of a multi-turn request for the dataset row `row` (its columns as JSON), or
/// none when the run generates one response per sample (`rollout.multi_turn` off) or the row
/// asks for one (VeRL's `agent_name: single_turn_agent`). `Err` names an `agent_name` grpo has
/// no loop for.
pub fn episode(recipe: &Recipe, row: &serde_json::Value) -> Result<Option<rollout::Episode>, String> {
    let mt = &recipe.rollout.multi_turn;
    if !mt.enable {
        return Ok(None);
    }
    match row.get("agent_name") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::String(name)) if name == "tool_agent" => {}
        Some(serde_json::Value::String(name)) if name == "single_turn_agent" => return Ok(None),
        Some(other) => {
            return Err(format!(
                "column `agent_name` is {other}; grpo's agent loops are `tool_agent` (an episode with \
                 rollout.multi_turn's tools) and `single_turn_agent` (one response)"
            ))
        }
    }
    Ok(Some(rollout::Episode {
        max_turn_tokens: mt.max_turn_tokens.unwrap_or(recipe.data.max_response_length),
        row: std::sync::Arc::new(row.clone()),
    }))
}

/// The environment of a run's multi-turn requests and the tools' schemas its prompts are
/// rendered with.
pub struct RunEnvironment {
    pub handler: std::sync::Arc<dyn rollout::TurnHandler>,
    pub schemas: Vec<agent::ToolSchema>,
}

/// How `rollout.multi_turn.agent`'s programs are started and bounded, with the tool schemas
/// of its `tool_schemas` file; `None` without an agent program.
pub fn agent_settings(recipe: &Recipe) -> Result<Option<rollout::agent_program::AgentSettings>, String> {
    let mt = &recipe.rollout.multi_turn;
    let Some(program) = &mt.agent else {
        return Ok(None);
    };
    let tools = match &program.tool_schemas {
        None => Vec::new(),
        Some(path) => agent::config::load_schemas(path).map_err(|e| e.to_string())?,
    };
    Ok(Some(rollout::agent_program::AgentSettings {
        command: program.command.clone(),
        timeout: std::time::Duration::from_secs_f64(program.timeout_s),
        format: mt.format,
        max_assistant_turns: mt.max_assistant_turns.unwrap_or(u32::MAX),
        tools,
    }))
}

/// How the tool environment of `rollout.multi_turn` runs an episode.
pub fn tool_settings(recipe: &Recipe) -> rollout::environment::ToolSettings {
    let mt = &recipe.rollout.multi_turn;
    rollout::environment::ToolSettings {
        format: mt.format,
        max_assistant_turns: mt.max_assistant_turns.unwrap_or(u32::MAX),
        max_parallel_calls: mt.max_parallel_calls,
        max_user_turns: mt.max_user_turns.unwrap_or(u32::MAX),
        max_tool_response_length: mt.max_tool_response_length,
        truncate_side: mt.tool_response_truncate_side,
        tool_timeout: std::time::Duration::from_secs_f64(mt.tool_timeout_s),
    }
}

/// A tool of `rollout.multi_turn`, not yet started, and where it came from.
#[derive(Debug)]
pub struct ToolEntry {
    pub spec: agent::ToolSpec,
    /// The key its settings are named by in errors.
    pub key: String,
    /// For a tool of `tool_config_path`'s file: the file and entry, which its errors start with.
    pub file: Option<String>,
}

/// The tools of `rollout.multi_turn`, not yet started, each with where it came from (for its
/// errors): the built-in `tools`, then those of `tool_config_path`'s file.
pub fn tool_specs(recipe: &Recipe) -> Result<Vec<ToolEntry>, String> {
    let mt = &recipe.rollout.multi_turn;
    let mut specs = Vec::new();
    for (k, tool) in mt.tools.iter().enumerate() {
        let spec = match tool {
            crate::recipe::BuiltinTool::Calculator => agent::ToolSpec::Calculator { schema: None },
            crate::recipe::BuiltinTool::Python => agent::ToolSpec::Python {
                interpreter: "python3".into(),
                memory_mb: 1024,
                timeout: None,
                max_processes: None,
                schema: None,
            },
        };
        specs.push(ToolEntry {
            spec,
            key: format!("rollout.multi_turn.tools[{k}]"),
            file: None,
        });
    }
    if let Some(path) = &mt.tool_config_path {
        let loaded = agent::config::load(path).map_err(|e| e.to_string())?;
        for (k, spec) in loaded.into_iter().enumerate() {
            specs.push(ToolEntry {
                spec,
                key: format!("tools[{k}].config.command in {}", path.display()),
                file: Some(format!("{}: tools[{k}]", path.display())),
            });
        }
    }
    Ok(specs)
}

/// The environment that answers the run's multi-turn requests (`rollout.multi_turn`): grpo's
/// tools and interactions, or the user's agent program behind its endpoint; either renders
/// with the model's chat template and tokenizer. None without multi-turn.
pub fn environment(
    recipe: &Recipe,
    tokenizer: &ModelTokenizer,
    template: Option<&ChatTemplate>,
) -> Result<Option<RunEnvironment>, String> {
    let mt = &recipe.rollout.multi_turn;
    if !mt.enable {
        return Ok(None);
    }
    let template = template.cloned().ok_or(
        "rollout.multi_turn renders tool results with the model's chat template, and this model has \
         none: set model.chat_template to a Jinja template file",
    )?;
    if let Some(settings) = agent_settings(recipe)? {
        let schemas = settings.tools.clone();
        let programs = rollout::agent_program::AgentPrograms::start(settings, template, tokenizer.clone())
            .map_err(|e| format!("starting the agent programs' endpoint: {e}"))?;
        return Ok(Some(RunEnvironment {
            handler: std::sync::Arc::new(programs),
            schemas,
        }));
    }
    let settings = tool_settings(recipe);
    let mut tools = Vec::new();
    for entry in tool_specs(recipe)? {
        let tool = entry
            .spec
            .build(settings.tool_timeout, &entry.key)
            .map_err(|e| match &entry.file {
                Some(at) => format!("{at}: {e}"),
                None => e,
            })?;
        tools.push(tool);
    }
    let toolbox = agent::Toolbox::new(tools).map_err(|e| format!("rollout.multi_turn: {e}"))?;
    let interactions = match &mt.interaction_config_path {
        None => Vec::new(),
        Some(path) => agent::config::load_interactions(path)
            .map_err(|e| e.to_string())?
            .iter()
            .enumerate()
            .map(|(k, spec)| {
                std::sync::Arc::new(spec.build(
                    settings.tool_timeout,
                    &format!("interaction[{k}].config.command in {}", path.display()),
                )) as std::sync::Arc<dyn agent::Environment>
            })
            .collect(),
    };
    let tools = rollout::environment::ToolEnvironment::new(toolbox, settings, template, tokenizer.clone())
        .with_interactions(interactions);
    Ok(Some(RunEnvironment {
        schemas: tools.schemas(),
        handler: std::sync::Arc::new(tools),
    }))
}

/// The seed of request `id`: a mix of `trainer.seed` and the id (SplitMix64), so every prompt's
/// samples are reproducible wherever and whenever they are generated.
pub fn request_seed(recipe: &Recipe, id: u64) -> u64 {
    let mut z = recipe.trainer.seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The responses each prompt of a training (or, with `validation`, validation) step gets:
/// `rollout.n`, or `rollout.val_kwargs.n`.
pub fn samples_per_prompt(recipe: &Recipe, validation: bool) -> usize {
    match validation {
        true => recipe.rollout.val_kwargs.n,
        false => recipe.rollout.n,
    }
}

/// The sampling settings of the recipe's training (or, with `validation`, validation) requests.
pub fn sampling_params(recipe: &Recipe, validation: bool) -> SamplingParams {
    let r = &recipe.rollout;
    let v = &r.val_kwargs;
    let (temperature, top_k, top_p, min_p) = if !validation {
        (r.temperature, r.top_k, r.top_p, r.min_p)
    } else if v.do_sample {
        (v.temperature, v.top_k, v.top_p, v.min_p)
    } else {
        (0.0, -1, 1.0, 0.0)
    };
    SamplingParams {
        temperature: temperature as f32,
        top_k: if top_k <= 0 { 0 } else { top_k as usize },
        top_p: top_p as f32,
        min_p: min_p as f32,
        max_new_tokens: recipe.data.max_response_length,
        stop_token_ids: Vec::new(),
        stop_strings: r.stop.clone(),
    }
}

/// The reward function of the `reward` section, for responses of at most
/// `data.max_response_length` tokens. Its reward models (`kind: reward_model`) are loaded onto
/// `cluster.device` now with `load_now` (where the reward role runs), else on first use.
pub fn reward_function(
    recipe: &Recipe,
    load_now: bool,
) -> Result<reward::RewardFunction, reward::ConfigError> {
    let models = crate::scorers::RecipeScorers { recipe, load_now };
    recipe
        .reward
        .build_with(Some(recipe.data.max_response_length), &models)
}

/// The reward worker pool's settings (`reward.num_workers`, `reward.time_limit_s`).
pub fn reward_pool(recipe: &Recipe) -> Result<reward::PoolOptions, reward::ConfigError> {
    recipe.reward.pool_options()
}

/// The trackers of a run writing to `output` and starting after `start_step`
/// (`trainer.logger`, `project_name`, `experiment_name`); the recipe is their parameters, the
/// process environment their settings.
pub fn tracking(recipe: &Recipe, output: &std::path::Path, start_step: u64) -> tracking::TrackingConfig {
    let trainer = &recipe.trainer;
    let experiment = trainer.experiment_name.clone().unwrap_or_else(|| {
        let absolute = std::path::absolute(output).unwrap_or_else(|_| output.to_path_buf());
        absolute
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "grpo".into())
    });
    tracking::TrackingConfig {
        loggers: trainer.logger.clone(),
        project: trainer.project_name.clone(),
        experiment,
        output: output.to_path_buf(),
        resume: start_step > 0,
        start_step,
        params: serde_json::to_value(recipe).expect("recipes serialize"),
        env: std::env::vars().collect(),
    }
}

/// The policy of a recipe over a model of `config`: how rows are packed (each prompt's
/// `rollout.n` samples share it; one block of rows per learner device) and what the parameter
/// table is (the order of every weight stream and checkpoint).
pub fn policy(recipe: &Recipe, config: &model::ModelConfig) -> DecoderPolicy {
    let micro_batch_size = recipe.actor.ppo_micro_batch_size;
    DecoderPolicy {
        config: config.clone(),
        prompt_len: recipe.data.max_prompt_length,
        response_len: recipe.data.max_response_length,
        micro_batch_size,
        temperature: recipe.rollout.temperature as f32,
        group_size: recipe.rollout.n.max(1),
        blocks: recipe
            .actor
            .parallelism(&recipe.cluster)
            .data_devices(micro_batch_size as i64)
            .unwrap_or(1),
        remat: recipe.model.enable_gradient_checkpointing,
        scan: recipe.model.scan_layers,
        lora: recipe.actor.lora(),
        lora_form: lora_form(recipe).map(|(form, _)| form).unwrap_or_default(),
        head: trainer::policy::Head::LogProbs,
        // Routes go in to be replayed, or to compare the learner's experts with the rollout's.
        route_inputs: recipe.actor.router_replay.mode != trainer::config::RouterReplay::Disabled
            || recipe.rollout.records_routes(&recipe.actor),
        moe_lowering: recipe.model.moe_dispatch.lowering(),
    }
}

/// The form a LoRA run computes in (`actor.lora_form`, `auto` decided for the rollout's
/// device) and, where `auto` chose, why; `None` without LoRA. A function of the resolved recipe,
/// so every process of a run decides alike. `auto` keeps the form measured faster per step on
/// each kind of device (BENCHMARKS.md "LoRA in the rollout: merged or applied"): on CPU
/// `applied`, whose cheaper update (no gradient of whole merged weights) outweighs its dearer
/// decode steps; on TPU `merged`, which libtpu's cost model estimates faster in both the
/// rollout and the learner; on NVIDIA GPUs `merged`, not measured here (it costs nothing per
/// token).
pub fn lora_form(recipe: &Recipe) -> Option<(model::LoraForm, Option<String>)> {
    use model::LoraForm;
    recipe.actor.lora()?;
    Some(match recipe.actor.lora_form {
        LoraFormName::Merged => (LoraForm::Merged, None),
        LoraFormName::Applied => (LoraForm::Applied, None),
        LoraFormName::Auto => {
            let device = rollout_device(recipe);
            let (form, name, why) = match device {
                DeviceKind::Cpu => (
                    LoraForm::Applied,
                    "applied",
                    "on CPU its update costs less than its decode steps add",
                ),
                DeviceKind::Tpu => (
                    LoraForm::Merged,
                    "merged",
                    "on TPU libtpu's cost model estimates the merged form's rollout and learner both faster",
                ),
                DeviceKind::Cuda => (
                    LoraForm::Merged,
                    "merged",
                    "on an NVIDIA GPU merged weights cost nothing per token (the applied form is not measured there)",
                ),
            };
            (form, Some(format!("actor.lora_form: auto chose {name}: {why}")))
        }
    })
}

/// The mini-batch arithmetic of the recipe.
pub fn batch_plan(recipe: &Recipe) -> BatchPlan {
    let a = &recipe.actor;
    BatchPlan {
        prompts_per_step: recipe.data.train_batch_size,
        group_size: recipe.rollout.n,
        mini_batch_prompts: a.ppo_mini_batch_size,
        micro_batch_size: a.ppo_micro_batch_size,
        epochs: a.ppo_epochs,
    }
}

/// The GRPO update of the `actor` and `algorithm` sections for `policy` (what it reads without
/// training: [`DecoderPolicy::frozen_specs`]), its learning-rate schedule
/// `total_optimizer_steps` long.
pub fn update_config(recipe: &Recipe, policy: &DecoderPolicy, total_optimizer_steps: u64) -> UpdateConfig {
    let (a, alg) = (&recipe.actor, &recipe.algorithm);
    let step = StepConfig {
        loss: a.policy_loss(alg),
        optim: a.optim_config(total_optimizer_steps),
        compute_dtype: actor_dtype(recipe),
        parallel: a.parallelism(&recipe.cluster),
        micro_batch_size: a.ppo_micro_batch_size as i64,
        response_len: recipe.data.max_response_length as i64,
        frozen: policy.frozen_specs(),
        value_loss: None,
    };
    UpdateConfig {
        step,
        batches: batch_plan(recipe),
        advantage: trainer::config::AdvantageConfig {
            estimator: alg.adv_estimator,
            norm_adv_by_std_in_grpo: alg.norm_adv_by_std_in_grpo,
            gamma: alg.gamma,
            lam: alg.lam,
        },
        use_kl_in_reward: alg.use_kl_in_reward,
        kl_coef: alg.kl_coef,
        kl_penalty: alg.kl_penalty,
        kl_ctrl: alg.kl_ctrl,
        mask_truncated_responses: alg.mask_truncated_responses,
        use_rollout_log_probs: a.use_rollout_log_probs,
        router_replay: a.router_replay.mode,
        rollout_correction: alg.rollout_correction.correction(),
        length_bucket: a.length_bucket,
        max_consecutive_nonfinite: a.max_consecutive_nonfinite as u32,
        critic: critic_update(recipe, total_optimizer_steps),
    }
}

/// The model PPO's critic starts from (`critic.model.path`, else the policy's model), read
/// without its weights when it is another model: its configuration, which must share the
/// policy's vocabulary. `None` when the estimator needs no critic.
pub fn critic_model_config(
    recipe: &Recipe,
    policy_config: &model::ModelConfig,
) -> Result<Option<model::ModelConfig>, String> {
    if !recipe.algorithm.adv_estimator.needs_critic() {
        return Ok(None);
    }
    let Some(path) = critic_model_path(recipe) else {
        return Ok(Some(policy_config.clone()));
    };
    let text =
        model::programs::ModelText::load(Path::new(path)).map_err(|e| format!("critic.model.path: {e}"))?;
    if text.config.vocab_size != policy_config.vocab_size {
        return Err(format!(
            "critic.model.path {path} has a vocabulary of {} tokens and the policy {} of {}: the \
             critic reads the policy's token ids, so it needs a model of the same tokenizer",
            text.config.vocab_size, recipe.model.path, policy_config.vocab_size
        ));
    }
    Ok(Some(text.config))
}

/// `critic.model.path` when it names a model other than the policy's.
fn critic_model_path(recipe: &Recipe) -> Option<&str> {
    recipe
        .critic
        .model
        .path
        .as_deref()
        .filter(|p| *p != recipe.model.path)
}

/// The critic's starting tensors ([`model::classifier::value_model_init`]: the trunk of the
/// policy's model, `weights`, or of `critic.model.path`'s, and a value head seeded by
/// `trainer.seed`) as f32 in its parameter-table order. `None` without a critic.
pub fn critic_initial(
    recipe: &Recipe,
    weights: &model::ModelWeights,
) -> Result<Option<Vec<Vec<f32>>>, String> {
    if !recipe.algorithm.adv_estimator.needs_critic() {
        return Ok(None);
    }
    let other;
    let from = match critic_model_path(recipe) {
        Some(path) => {
            other = model::programs::HostModel::load(Path::new(path))
                .map_err(|e| format!("critic.model.path: {e}"))?
                .weights;
            &other
        }
        None => weights,
    };
    let tensors =
        model::classifier::value_model_init(from, recipe.trainer.seed).map_err(|e| format!("critic: {e}"))?;
    Ok(Some(tensors.iter().map(|t| t.to_f32_vec()).collect()))
}

/// PPO's critic over a model of `config` ([`critic_model_config`]): the policy's packing of
/// rows with the critic's micro-batch, a value head and no LoRA.
pub fn critic(recipe: &Recipe, config: &model::ModelConfig) -> DecoderPolicy {
    let c = &recipe.critic;
    let micro_batch_size = c
        .ppo_micro_batch_size
        .unwrap_or(recipe.actor.ppo_micro_batch_size);
    DecoderPolicy {
        micro_batch_size,
        blocks: recipe
            .actor
            .parallelism(&recipe.cluster)
            .data_devices(micro_batch_size as i64)
            .unwrap_or(1),
        remat: c
            .model
            .enable_gradient_checkpointing
            .unwrap_or(recipe.model.enable_gradient_checkpointing),
        lora: None,
        head: trainer::policy::Head::Value,
        ..policy(recipe, config)
    }
}

/// The critic's mini-batch arithmetic: `critic.ppo_*`, each defaulting to the actor's.
pub fn critic_batch_plan(recipe: &Recipe) -> BatchPlan {
    let c = &recipe.critic;
    let actor = batch_plan(recipe);
    BatchPlan {
        mini_batch_prompts: c.ppo_mini_batch_size.unwrap_or(actor.mini_batch_prompts),
        micro_batch_size: c.ppo_micro_batch_size.unwrap_or(actor.micro_batch_size),
        epochs: c.ppo_epochs.unwrap_or(actor.epochs),
        ..actor
    }
}

/// The critic's update (`critic.*`, `trainer.critic_warmup`) when the estimator needs one: its
/// schedule as long as the actor's in training steps (`total_optimizer_steps` is the actor's).
fn critic_update(recipe: &Recipe, total_optimizer_steps: u64) -> Option<CriticConfig> {
    if !recipe.algorithm.adv_estimator.needs_critic() {
        return None;
    }
    let (a, c) = (&recipe.actor, &recipe.critic);
    let batches = critic_batch_plan(recipe);
    let training_steps = total_optimizer_steps / batch_plan(recipe).optimizer_steps_per_step().max(1);
    let mut optim = crate::recipe::ActorSection {
        optim: c.optim.clone(),
        grad_clip: c.grad_clip.unwrap_or(a.grad_clip),
        ..a.clone()
    }
    .optim_config(batches.total_optimizer_steps(training_steps));
    optim.grad_clip = optim.grad_clip.filter(|g| *g > 0.0);
    Some(CriticConfig {
        step: StepConfig {
            loss: a.policy_loss(&recipe.algorithm),
            optim,
            compute_dtype: actor_dtype(recipe),
            parallel: a.parallelism(&recipe.cluster),
            micro_batch_size: batches.micro_batch_size as i64,
            response_len: recipe.data.max_response_length as i64,
            frozen: Vec::new(),
            value_loss: Some(trainer::config::ValueLossConfig {
                cliprange_value: c.cliprange_value,
                loss_agg_mode: c.loss_agg_mode.unwrap_or(a.loss_agg_mode),
            }),
        },
        batches,
        warmup: recipe.trainer.critic_warmup,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe::load_recipe_str;
    use serde_json::json;

    #[test]
    fn auto_picks_the_lora_form_measured_faster_on_the_rollouts_device() {
        let with = |device: &str, form: &str| {
            let text = format!(
                "model:\n  path: m\ndata:\n  train_files: t.parquet\ncluster:\n  device: {device}\n\
                 actor:\n  lora_rank: 4\n{form}"
            );
            load_recipe_str(&text, "r.yaml").unwrap()
        };
        let (form, why) = lora_form(&with("cpu", "")).unwrap();
        assert_eq!(form, model::LoraForm::Applied);
        assert!(why
            .unwrap()
            .starts_with("actor.lora_form: auto chose applied: on CPU"));
        for device in ["tpu", "cuda"] {
            assert_eq!(lora_form(&with(device, "")).unwrap().0, model::LoraForm::Merged);
        }
        // A named form is kept, with no reason to print; without LoRA there is none.
        let merged = with("cpu", "  lora_form: merged\n");
        assert_eq!(lora_form(&merged), Some((model::LoraForm::Merged, None)));
        let full = load_recipe_str("model:\n  path: m\ndata:\n  train_files: t.parquet\n", "r.yaml").unwrap();
        assert_eq!(lora_form(&full), None);
    }

    #[test]
    fn a_rows_agent_name_picks_an_episode_or_one_response() {
        let text = "model:\n  path: m\ndata:\n  train_files: t.parquet\n  max_response_length: 64\n\
                    rollout:\n  multi_turn:\n    enable: true\n    tools: [calculator]\n    max_turn_tokens: 16\n";
        let recipe = load_recipe_str(text, "r.yaml").unwrap();
        let row = json!({"agent_name": "tool_agent", "extra_info": {"tools_kwargs": {"calculator": {}}}});
        let tool_agent = episode(&recipe, &row).unwrap().unwrap();
        assert_eq!((tool_agent.max_turn_tokens, &*tool_agent.row), (16, &row));
        assert!(episode(&recipe, &json!({"prompt": "?"})).unwrap().is_some());
        assert!(episode(&recipe, &json!({"agent_name": "single_turn_agent"}))
            .unwrap()
            .is_none());
        let error = episode(&recipe, &json!({"agent_name": "react_agent"})).unwrap_err();
        assert!(
            error.contains("`agent_name` is \"react_agent\"") && error.contains("tool_agent"),
            "{error}"
        );
        let single =
            load_recipe_str("model:\n  path: m\ndata:\n  train_files: t.parquet\n", "r.yaml").unwrap();
        assert!(episode(&single, &row).unwrap().is_none());
    }
}
