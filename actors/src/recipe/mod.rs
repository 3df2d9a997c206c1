//! The recipe: one YAML file that says everything about a run.
//!
//! Sections and key names follow VeRL wherever VeRL has a name for the same thing
//! (`data.train_batch_size`, `rollout.n`, `actor.clip_ratio_low`, ...), so a VeRL config ports
//! over by moving keys, not by translating them. Every struct denies unknown fields; loading
//! ([`load`]) turns serde's errors into messages that name the file, line, column, the full
//! dotted key and the closest valid key, and [`validate`] checks ranges and cross-key rules
//! before any work starts. Every key is documented in `recipes/README.md`; a test keeps the
//! two in step.
//!
//! A section's types come from its crate where one exists (`data::DataConfig`,
//! `reward::RewardConfig`, the learner's enums from `trainer::config`), and keys that become a
//! trainer config take their defaults from `trainer::config`'s `Default`, so the two cannot
//! differ. `crate::setup` turns sections into the crates' configurations
//! (`setup::update_config`, `setup::engine_config`, ...), through a section's own method where
//! validation must run the same conversion ([`ActorSection::policy_loss`]).

mod load;
mod locate;
mod validate;

pub use load::{apply_overrides, load_recipe, load_recipe_str, RecipeError};
pub(crate) use load::{bare_message, closest, set_path};
pub(crate) use validate::validate;
pub use validate::Violation;

use serde::{Deserialize, Serialize};
// The algorithm choices are the trainer's own enums, with VeRL's names.
pub use trainer::config::{
    AdvantageEstimator, KlControl, KlPenalty, LossAggMode, LrSchedule, PolicyLossMode,
};
pub use trainer::rollout_correction::IsLevel;

/// A whole recipe, as read from YAML with defaults filled in.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub model: ModelSection,
    /// `data:` prompts (the `data` crate owns this section).
    pub data: data::DataConfig,
    #[serde(default)]
    pub rollout: RolloutSection,
    /// `reward:` how responses are scored (the `reward` crate owns this section).
    #[serde(default)]
    pub reward: reward::RewardConfig,
    #[serde(default)]
    pub algorithm: AlgorithmSection,
    #[serde(default)]
    pub actor: ActorSection,
    /// `critic:` PPO's value model (read with `algorithm.adv_estimator: gae`).
    #[serde(default)]
    pub critic: CriticSection,
    #[serde(default)]
    pub trainer: TrainerSection,
    #[serde(default)]
    pub cluster: ClusterSection,
}

/// `model:` the policy to train.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// A Hugging Face model directory (config.json, safetensors, tokenizer.json) or a `.gguf` file.
    pub path: String,
    /// A `tokenizer.json` (or a directory holding one) to use instead of the model's own.
    #[serde(default)]
    pub tokenizer: Option<String>,
    /// A Jinja chat template to use instead of the model's own.
    #[serde(default)]
    pub chat_template: Option<String>,
    /// Ignore the checkpoint's weights and initialise randomly from its config with
    /// `trainer.seed` (for tests and for compile-only checks of architectures not at hand).
    #[serde(default)]
    pub random_init: bool,
    /// Recompute each decoder layer's activations in the learner's backward pass instead of
    /// keeping them (VeRL's `actor_rollout_ref.model.enable_gradient_checkpointing`): a second
    /// forward pass of every layer for the memory of all but one layer's activations.
    /// `grpo compile` reports both sides.
    #[serde(default)]
    pub enable_gradient_checkpointing: bool,
    /// Trace the learner's decoder layers once, as a loop over their stacked weights
    /// (`stablehlo.while`; MaxText's `scan_layers`), instead of once per layer: the programs
    /// compile in a time that does not grow with depth. The backward pass then recomputes each
    /// layer from its input, as `enable_gradient_checkpointing` does, and each step stacks the
    /// layers' weights once (a copy). The rollout's programs stay one trace per layer.
    #[serde(default)]
    pub scan_layers: bool,
    /// How a mixture-of-experts model's tokens reach their experts: `dense` (every token
    /// through every expert, the zero combine weights dropping the others) or `grouped` (each
    /// token's chosen experts only, sorted by expert through XLA's ragged dot). docs/moe.md.
    #[serde(default)]
    pub moe_dispatch: MoeDispatch,
    /// A PEFT LoRA adapter directory (`adapter_config.json`, `adapter_model.safetensors`) to
    /// continue training from (VeRL's `lora_adapter_path`): with `actor.lora_rank` set to the
    /// adapter's `r`, its `lora_alpha`, `target_modules` and `target_parameters` must match the
    /// recipe's.
    #[serde(default)]
    pub lora_adapter_path: Option<String>,
}

/// `rollout:` how responses are generated.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RolloutSection {
    /// Responses per prompt (the GRPO group size).
    #[serde(default = "default_n")]
    pub n: usize,
    /// Sampling temperature; 0 is greedy.
    #[serde(default = "default_one")]
    pub temperature: f64,
    /// Keep only the k most likely tokens; -1 keeps all.
    #[serde(default = "default_minus_one")]
    pub top_k: i64,
    /// Keep the smallest set of tokens whose probability reaches p; 1.0 keeps all.
    #[serde(default = "default_one")]
    pub top_p: f64,
    /// Keep only tokens at least this likely relative to the most likely one (vLLM's min-p,
    /// before top-p); 0 keeps all.
    #[serde(default)]
    pub min_p: f64,
    /// Sequences decoded at once (KV-cache slots).
    #[serde(default = "default_max_num_seqs")]
    pub max_num_seqs: usize,
    /// Strings that end a response (besides the model's EOS tokens).
    #[serde(default)]
    pub stop: Vec<String>,
    /// Element type of the rollout's weights and KV cache.
    #[serde(default = "default_rollout_dtype")]
    pub dtype: DTypeName,
    /// Devices one rollout engine splits the model over (VeRL's
    /// `rollout.tensor_model_parallel_size`): weights in the Megatron layout and the KV cache
    /// by KV heads over this many devices; an engine's devices form `devices / this` slot
    /// groups.
    #[serde(default = "default_one_usize")]
    pub tensor_model_parallel_size: usize,
    /// Sampling for validation.
    #[serde(default)]
    pub val_kwargs: ValKwargs,
    /// Tool-using episodes of several model turns.
    #[serde(default)]
    pub multi_turn: MultiTurnSection,
    /// Record the experts a mixture-of-experts model chose for every token the rollout fed
    /// (VeRL's `rollout.enable_rollout_routing_replay`): what `actor.router_replay.mode: R3`
    /// replays, and what the `rollout_corr/router_*_mismatch` metrics compare the learner's
    /// experts with. Unset: on exactly under R3.
    #[serde(default)]
    pub enable_rollout_routing_replay: Option<bool>,
}

impl RolloutSection {
    /// Whether the rollout records routes ([`RolloutSection::enable_rollout_routing_replay`]).
    pub fn records_routes(&self, actor: &ActorSection) -> bool {
        self.enable_rollout_routing_replay
            .unwrap_or(actor.router_replay.mode == trainer::config::RouterReplay::R3)
    }
}

/// `rollout.multi_turn`: tool-using episodes, VeRL's `actor_rollout_ref.rollout.multi_turn`
/// keys where VeRL has them. After each model turn that ends with an end-of-turn token, the
/// tool calls in it are run and their results appended as tool messages rendered by the chat
/// template; the model then takes the next turn in the same sample.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MultiTurnSection {
    /// Run episodes instead of one response per sample.
    #[serde(default)]
    pub enable: bool,
    /// Most model turns per sample; none: as many as the response budget holds.
    #[serde(default)]
    pub max_assistant_turns: Option<u32>,
    /// Most interaction replies per sample; none: as many as the response budget holds.
    #[serde(default)]
    pub max_user_turns: Option<u32>,
    /// An interaction config file (VeRL's key and layout: `interaction:` entries with `name`,
    /// `class_name`, `config`): programs that answer the model's turns without tool calls as a
    /// user would (`agent::interaction`).
    #[serde(default)]
    pub interaction_config_path: Option<std::path::PathBuf>,
    /// Most tokens one model turn may generate (a longer turn ends the sample, truncated);
    /// none: `data.max_response_length`.
    #[serde(default)]
    pub max_turn_tokens: Option<usize>,
    /// The model's tool-call format: `hermes` (Qwen2.5, Qwen3, Hermes) or `llama3`.
    #[serde(default = "default_call_format")]
    pub format: agent::CallFormat,
    /// Built-in tools the model may call: `calculator`, `python` (the sandboxed executor with
    /// its defaults: `python3`, 1024 MiB, `tool_timeout_s`).
    #[serde(default)]
    pub tools: Vec<BuiltinTool>,
    /// A tool config file (VeRL's key and layout: `tools:` entries with `class_name`, `config`,
    /// `tool_schema`): built-ins with settings, user tools as a JSON-lines command or an HTTP
    /// endpoint (`agent::config`). Its tools join `tools`.
    #[serde(default)]
    pub tool_config_path: Option<std::path::PathBuf>,
    /// Most tool calls run per turn; further calls get an error observation.
    #[serde(default = "default_one_usize")]
    pub max_parallel_calls: usize,
    /// Most characters of one tool response the model sees.
    #[serde(default = "default_max_tool_response_length")]
    pub max_tool_response_length: usize,
    /// Which part of a longer tool response is kept: `left`, `middle` or `right`.
    #[serde(default = "default_truncate_side")]
    pub tool_response_truncate_side: rollout::environment::TruncateSide,
    /// Time limit of one tool call, in seconds (a tool file's entry may set its own).
    #[serde(default = "default_tool_timeout_s")]
    pub tool_timeout_s: f64,
    /// The user's agent program, which drives each episode through an OpenAI-compatible
    /// endpoint and runs its own tools (`rollout::agent_program`); instead of grpo's tools.
    #[serde(default)]
    pub agent: Option<AgentProgramSection>,
}

/// `rollout.multi_turn.agent`: an agent program started once per episode with
/// `OPENAI_BASE_URL` pointing at the episode's endpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AgentProgramSection {
    /// The program and its arguments, e.g. `[python3, agents/solve.py]`.
    pub command: Vec<String>,
    /// Wall-clock limit of one episode's program, in seconds.
    #[serde(default = "default_agent_timeout_s")]
    pub timeout_s: f64,
    /// A file of the tools' schemas (a YAML or JSON list of OpenAI function tools): the row's
    /// prompt is rendered with them, and the program must send them as `tools`.
    #[serde(default)]
    pub tool_schemas: Option<std::path::PathBuf>,
}

fn default_agent_timeout_s() -> f64 {
    600.0
}

impl Default for MultiTurnSection {
    fn default() -> Self {
        MultiTurnSection {
            enable: false,
            max_assistant_turns: None,
            max_user_turns: None,
            interaction_config_path: None,
            max_turn_tokens: None,
            format: default_call_format(),
            tools: Vec::new(),
            tool_config_path: None,
            max_parallel_calls: 1,
            max_tool_response_length: default_max_tool_response_length(),
            tool_response_truncate_side: default_truncate_side(),
            tool_timeout_s: default_tool_timeout_s(),
            agent: None,
        }
    }
}

/// The tools built into grpo.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum BuiltinTool {
    /// Exact arithmetic on integers of any size and fractions (`agent::Calculator`).
    Calculator,
    /// Python code run in a sandboxed child process (`agent::Python`).
    Python,
}

fn default_call_format() -> agent::CallFormat {
    agent::CallFormat::Hermes
}
fn default_max_tool_response_length() -> usize {
    256
}
fn default_truncate_side() -> rollout::environment::TruncateSide {
    rollout::environment::TruncateSide::Middle
}
fn default_tool_timeout_s() -> f64 {
    30.0
}

/// `rollout.val_kwargs`: sampling used for validation.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ValKwargs {
    /// Responses per validation prompt.
    #[serde(default = "default_one_usize")]
    pub n: usize,
    /// Sample (true) or decode greedily (false).
    #[serde(default)]
    pub do_sample: bool,
    /// Temperature when sampling.
    #[serde(default = "default_one")]
    pub temperature: f64,
    /// Top-k when sampling; -1 keeps all.
    #[serde(default = "default_minus_one")]
    pub top_k: i64,
    /// Top-p when sampling.
    #[serde(default = "default_one")]
    pub top_p: f64,
    /// Min-p when sampling (0 keeps all).
    #[serde(default)]
    pub min_p: f64,
}

/// Element types a recipe can name.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DTypeName {
    F32,
    Bf16,
    /// `bf16` where the role's device computes bf16 natively, `f32` elsewhere; decided when the
    /// run starts (`setup::resolve_auto_dtypes`).
    Auto,
}

/// `algorithm:` advantages and reward shaping.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AlgorithmSection {
    /// How advantages are computed from the rewards of a group.
    #[serde(default = "default_adv_estimator")]
    pub adv_estimator: AdvantageEstimator,
    /// Divide GRPO advantages by the group's standard deviation (false: Dr. GRPO).
    #[serde(default = "default_true")]
    pub norm_adv_by_std_in_grpo: bool,
    /// Discount of `reinforce_plus_plus`'s and `gae`'s token returns.
    #[serde(default = "default_gamma")]
    pub gamma: f64,
    /// GAE's λ (`adv_estimator: gae`): 1 the Monte Carlo return, 0 the critic's one-step
    /// bootstrap.
    #[serde(default = "default_lam")]
    pub lam: f64,
    /// Subtract `kl_coef` x KL(policy || reference) from the token rewards.
    #[serde(default)]
    pub use_kl_in_reward: bool,
    /// Weight of the in-reward KL penalty.
    #[serde(default = "default_kl_coef")]
    pub kl_coef: f64,
    /// Estimator of the in-reward KL penalty.
    #[serde(default = "default_kl_penalty")]
    pub kl_penalty: KlPenalty,
    /// How the in-reward coefficient moves: `{type: fixed}` or
    /// `{type: adaptive, target_kl, horizon}`.
    #[serde(default = "default_kl_ctrl")]
    pub kl_ctrl: KlControl,
    /// DAPO's dynamic sampling: keep only groups whose metric varies, generating more
    /// prompts until the step is full.
    #[serde(default)]
    pub filter_groups: FilterGroupsSection,
    /// Leave truncated responses out of the loss (DAPO's overlong filtering).
    #[serde(default)]
    pub mask_truncated_responses: bool,
    /// Importance weights and rejection sampling for the gap between the rollout's and the
    /// learner's probabilities (VeRL's `algorithm.rollout_correction`).
    #[serde(default)]
    pub rollout_correction: RolloutCorrectionSection,
}

/// `algorithm.filter_groups` (DAPO's dynamic sampling, VeRL's `FilterGroupsConfig`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct FilterGroupsSection {
    /// Fill each step with `data.train_batch_size` prompts whose samples' metric varies,
    /// generating rounds of `data.gen_batch_size` prompts until it is full.
    #[serde(default)]
    pub enable: bool,
    /// What must vary within a group: `seq_reward` (the reward), `seq_final_reward` (the
    /// reward less the in-reward KL), or a named extra of the scorer (`acc`, `score`, ...).
    #[serde(default)]
    pub metric: Option<String>,
    /// Rounds of generation a step may take before the run stops; 0 or less is no limit.
    #[serde(default)]
    pub max_num_gen_batches: i64,
}

/// `algorithm.rollout_correction`, VeRL's keys (`bypass_mode` is `actor.use_rollout_log_probs`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RolloutCorrectionSection {
    /// `token` or `sequence` importance weights on the policy loss; empty applies none.
    #[serde(default)]
    pub rollout_is: Option<IsLevel>,
    /// Weights are truncated at this.
    #[serde(default = "default_rollout_is_threshold")]
    pub rollout_is_threshold: f64,
    /// Divide the truncated weights by their batch mean.
    #[serde(default)]
    pub rollout_is_batch_normalize: bool,
    /// Rejection criteria, separated by commas, all of which must pass (`token_k1`,
    /// `seq_mean_k3`, ...); empty rejects nothing.
    #[serde(default)]
    pub rollout_rs: Option<String>,
    /// One threshold for all criteria or one per criterion, separated by commas.
    #[serde(default, deserialize_with = "number_or_text")]
    pub rollout_rs_threshold: Option<String>,
}

impl RolloutCorrectionSection {
    /// The trainer's [`trainer::rollout_correction::RolloutCorrection`]; recipe validation has
    /// already parsed `rollout_rs`, so an error here is a bug.
    pub fn correction(&self) -> trainer::rollout_correction::RolloutCorrection {
        trainer::rollout_correction::RolloutCorrection {
            rollout_is: self.rollout_is,
            rollout_is_threshold: self.rollout_is_threshold,
            rollout_is_batch_normalize: self.rollout_is_batch_normalize,
            rollout_rs: self.rejection().expect("validated"),
        }
    }

    /// `rollout_rs` with its thresholds, parsed.
    pub fn rejection(&self) -> Result<Vec<trainer::rollout_correction::RsCriterion>, String> {
        match &self.rollout_rs {
            None => Ok(Vec::new()),
            Some(options) => trainer::rollout_correction::parse_rejection(
                options,
                self.rollout_rs_threshold.as_deref().unwrap_or_default(),
            ),
        }
    }
}

/// A YAML number or string, kept as its text (VeRL's `rollout_rs_threshold` is either).
fn number_or_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let v: Option<serde_yaml::Value> = Option::deserialize(d)?;
    match v {
        None | Some(serde_yaml::Value::Null) => Ok(None),
        Some(serde_yaml::Value::Number(n)) => Ok(Some(n.to_string())),
        Some(serde_yaml::Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(serde::de::Error::custom(format!(
            "expected a number or a string such as \"0.5_2.0,0.01\", got {other:?}"
        ))),
    }
}

/// `actor:` the policy update.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ActorSection {
    /// How the learner uses several devices.
    #[serde(default)]
    pub strategy: Strategy,
    /// Devices of the learner's mesh under `dp` and `fsdp` (devices `0..mesh` of its
    /// client); empty means all devices of its client (see [`ActorSection::parallelism`]).
    #[serde(default)]
    pub mesh: Option<usize>,
    /// Devices of the learner mesh's tensor-parallel axis (VeRL's
    /// `tensor_model_parallel_size`): the mesh is `mesh / this` data devices x this many model
    /// devices, parameters split over the model axis in the Megatron layout.
    #[serde(default = "default_one_usize")]
    pub tensor_model_parallel_size: usize,
    #[serde(default)]
    pub optim: OptimSection,
    /// Prompts per optimizer step (times `rollout.n` sequences).
    #[serde(default = "default_ppo_mini_batch_size")]
    pub ppo_mini_batch_size: usize,
    /// Sequences per forward/backward pass; gradients accumulate over a mini-batch.
    #[serde(default = "default_ppo_micro_batch_size")]
    pub ppo_micro_batch_size: usize,
    /// Passes over each batch of rollouts.
    #[serde(default = "default_one_usize")]
    pub ppo_epochs: usize,
    /// Lower clip of the probability ratio: ratio >= 1 - clip_ratio_low.
    #[serde(default = "default_clip_ratio_low")]
    pub clip_ratio_low: f64,
    /// Upper clip of the probability ratio: ratio <= 1 + clip_ratio_high (DAPO's clip-higher).
    #[serde(default = "default_clip_ratio_high")]
    pub clip_ratio_high: f64,
    /// Dual-clip bound for negative advantages (must exceed 1).
    #[serde(default = "default_clip_ratio_c")]
    pub clip_ratio_c: f64,
    #[serde(default)]
    pub policy_loss: PolicyLossSection,
    /// How token losses are averaged into one number.
    #[serde(default = "default_loss_agg_mode")]
    pub loss_agg_mode: LossAggMode,
    /// Add a KL(policy || reference) term to the loss.
    #[serde(default)]
    pub use_kl_loss: bool,
    /// Weight of the KL loss.
    #[serde(default = "default_kl_loss_coef")]
    pub kl_loss_coef: f64,
    /// Estimator of the KL loss.
    #[serde(default = "default_kl_loss_type")]
    pub kl_loss_type: KlPenalty,
    /// Weight of the entropy bonus (subtracted from the loss).
    #[serde(default)]
    pub entropy_coeff: f64,
    /// Weight of a mixture-of-experts policy's load-balancing loss (transformers'
    /// `router_aux_loss_coef`, whose value in the model's config is not read): 0, as VeRL's RL
    /// recipes set it, reports the loss (`actor/router_aux_loss`) without training on it.
    #[serde(default)]
    pub router_aux_loss_coef: f64,
    /// Routing replay of a mixture-of-experts policy (VeRL's `actor.router_replay`).
    #[serde(default)]
    pub router_replay: RouterReplaySection,
    /// SAPO's gate temperature for tokens with a positive advantage (`policy_loss.loss_mode:
    /// sapo`).
    #[serde(default = "default_tau_pos")]
    pub tau_pos: f64,
    /// SAPO's gate temperature for the other tokens.
    #[serde(default = "default_tau_neg")]
    pub tau_neg: f64,
    /// Clip the global gradient norm to this value.
    #[serde(default = "default_grad_clip")]
    pub grad_clip: f64,
    /// Element type of the parameters the forward pass reads (bf16 keeps f32 master weights).
    #[serde(default = "default_actor_dtype")]
    pub param_dtype: DTypeName,
    /// Use the rollout's log-probs as the old log-probs instead of recomputing them.
    #[serde(default)]
    pub use_rollout_log_probs: bool,
    /// Stop the run after this many updates in a row skipped for a non-finite loss or gradient.
    #[serde(default = "default_max_nonfinite")]
    pub max_consecutive_nonfinite: usize,
    /// Length buckets of the learner: each micro-batch is padded to its longest prompt and its
    /// longest response, each rounded up to a multiple of this many columns (capped at the
    /// maximum lengths); 0 pads every row to the full prompt + response length
    /// (see `trainer::bucket`).
    #[serde(default = "default_length_bucket")]
    pub length_bucket: usize,
    /// LoRA rank (VeRL's `lora_rank`): above 0 the learner trains rank-r adapters on the
    /// projections `target_modules` names and keeps the base weights frozen in their compute
    /// type; 0 trains every weight.
    #[serde(default)]
    pub lora_rank: usize,
    /// LoRA's alpha: the adapters' update is scaled by `lora_alpha / lora_rank`.
    #[serde(default = "default_lora_alpha")]
    pub lora_alpha: f64,
    /// The projections that carry adapters: `all-linear` (q, k, v, o, gate, up and down) or a
    /// list of them (`[q_proj, v_proj]`, or `[]` with only `target_parameters`).
    #[serde(default)]
    pub target_modules: model::TargetModules,
    /// The stacked parameters that carry adapters, as PEFT's and VeRL's `target_parameters`
    /// name them: a mixture of experts' `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`
    /// (every expert its own rank-r pair). None by default.
    #[serde(default)]
    pub target_parameters: model::TargetParameters,
    /// How the learner and the rollout compute with the adapters: `merged` (the rollout
    /// samples from `W + s·B·A`, merged on the devices after each update), `applied` (the
    /// adapters beside the frozen weights in every pass, no merged copy) or `auto` (decided
    /// for the rollout's device, `setup::lora_form`).
    #[serde(default)]
    pub lora_form: LoraFormName,
}

/// `actor.lora_form` as a recipe names it: a [`model::LoraForm`] or `auto`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LoraFormName {
    /// The form measured faster per step on the rollout's kind of device
    /// (`setup::lora_form`).
    #[default]
    Auto,
    Merged,
    Applied,
}

/// `actor.strategy`: the trainer's own enum (`single`, `dp`, `fsdp`; `single` by default).
pub use trainer::config::Strategy;

impl ActorSection {
    /// The adapters `actor.lora_rank` asks for (`None` at rank 0: a full fine-tune).
    pub fn lora(&self) -> Option<model::LoraConfig> {
        (self.lora_rank > 0).then(|| model::LoraConfig {
            rank: self.lora_rank,
            alpha: self.lora_alpha,
            targets: {
                let mut t = self.target_modules.0.clone();
                t.extend(&self.target_parameters.0);
                t.sort();
                t
            },
            use_rslora: false,
        })
    }

    /// `actor.strategy` and `actor.mesh` as the learner's [`trainer::config::Parallelism`],
    /// with an unset mesh filled in where the recipe alone determines the learner client's
    /// devices: on CPU, all [`Recipe::cpu_devices`]. On CUDA and TPU the mesh must be set for
    /// `dp` and `fsdp` (validation says so), since the device count is known only once the
    /// client opens.
    pub fn parallelism(&self, cluster: &ClusterSection) -> trainer::config::Parallelism {
        let mut mesh = self.mesh;
        if mesh.is_none() && self.strategy != Strategy::Single && cluster.device == DeviceKind::Cpu {
            mesh = Some(cluster.cpu_device_count);
        }
        trainer::config::Parallelism {
            strategy: self.strategy,
            mesh,
            tensor_parallel: self.tensor_model_parallel_size,
        }
    }
}

impl ActorSection {
    /// The loss keys of `actor` (and the rollout-IS key of `algorithm`) as the trainer's
    /// [`trainer::config::PolicyLossConfig`], whose checks recipe validation runs.
    pub fn policy_loss(&self, algorithm: &AlgorithmSection) -> trainer::config::PolicyLossConfig {
        trainer::config::PolicyLossConfig {
            loss_mode: self.policy_loss.loss_mode,
            clip_ratio_low: self.clip_ratio_low,
            clip_ratio_high: self.clip_ratio_high,
            clip_ratio_c: self.clip_ratio_c,
            loss_agg_mode: self.loss_agg_mode,
            use_kl_loss: self.use_kl_loss,
            kl_loss_coef: self.kl_loss_coef,
            kl_loss_type: self.kl_loss_type,
            entropy_coeff: self.entropy_coeff,
            rollout_is_weights: algorithm.rollout_correction.rollout_is.is_some(),
            tau_pos: self.tau_pos,
            tau_neg: self.tau_neg,
            clip_cov_ratio: self.policy_loss.clip_cov_ratio,
            clip_cov_lb: self.policy_loss.clip_cov_lb,
            clip_cov_ub: self.policy_loss.clip_cov_ub,
            kl_cov_ratio: self.policy_loss.kl_cov_ratio,
            ppo_kl_coef: self.policy_loss.ppo_kl_coef,
            router_aux_loss_coef: self.router_aux_loss_coef,
        }
    }

    /// `actor.optim` and `actor.grad_clip` as the trainer's [`trainer::config::OptimConfig`],
    /// with a learning-rate schedule `total_optimizer_steps` long.
    pub fn optim_config(&self, total_optimizer_steps: u64) -> trainer::config::OptimConfig {
        let o = &self.optim;
        trainer::config::OptimConfig {
            lr: o.lr,
            betas: o.betas,
            eps: o.eps,
            weight_decay: o.weight_decay,
            grad_clip: (self.grad_clip > 0.0).then_some(self.grad_clip),
            lr_warmup_steps: o.lr_warmup_steps as u64,
            warmup_style: o.lr_scheduler_type,
            min_lr_ratio: o.min_lr_ratio,
            num_cycles: 0.5,
            total_training_steps: total_optimizer_steps,
        }
    }
}

impl Recipe {
    /// Devices the CPU client opens: `cluster.cpu_device_count`, raised to `actor.mesh` when
    /// the learner is sharded over more devices than that (`dp`, `fsdp`) and to
    /// `rollout.tensor_model_parallel_size` when one engine needs more.
    pub fn cpu_devices(&self) -> usize {
        let learner = match (self.actor.strategy, self.actor.mesh) {
            (Strategy::Dp | Strategy::Fsdp, Some(mesh)) => mesh,
            _ => 1,
        };
        self.cluster
            .cpu_device_count
            .max(learner)
            .max(self.rollout.tensor_model_parallel_size)
    }

    /// Whether the rollout engine runs in the orchestrator's process on the learner's devices
    /// (no rollout or learner workers), sharing its parameter buffers.
    pub fn rollout_colocated(&self) -> bool {
        self.cluster.rollout_workers == 0 && self.cluster.learner_workers == 0
    }

    /// The devices a run computes on (VeRL's `n_gpus` in `perf/throughput`): the learner's
    /// (its mesh, or 1), and the rollout workers' beside them when the rollout does not share the
    /// learner's devices.
    pub fn devices_in_use(&self) -> usize {
        let learner = self.actor.parallelism(&self.cluster).mesh.unwrap_or(1).max(1);
        if self.rollout_colocated() {
            learner
        } else {
            learner + self.cluster.rollout_workers * self.rollout_devices()
        }
    }

    /// Devices one rollout engine runs on: the learner's mesh when the rollout is colocated
    /// with a learner split over several devices (`dp`, `fsdp`; the engine splits its
    /// KV-cache slots over the slot groups and the model over the tensor-parallel devices),
    /// else `rollout.tensor_model_parallel_size` (1 without tensor parallelism).
    pub fn rollout_devices(&self) -> usize {
        match self.actor.parallelism(&self.cluster).mesh {
            Some(m) if m > 1 && self.rollout_colocated() => m,
            _ => self.rollout.tensor_model_parallel_size.max(1),
        }
    }

    /// The learner's and the rollout's meshes by axis, in words, for the run's first lines
    /// and `grpo compile`: `learner fsdp over 4 devices: data 2 x model 2; rollout in process
    /// on 4 device(s): 2 slot group(s) x model 2, 16 slots each`.
    pub fn layout_text(&self) -> String {
        let parallel = self.actor.parallelism(&self.cluster);
        let tp = parallel.tensor_parallel.max(1);
        let learner = match (parallel.strategy, parallel.mesh) {
            (Strategy::Single, _) => "learner on 1 device".to_string(),
            (s, Some(mesh)) => format!(
                "learner {} over {mesh} devices: data {} x model {tp}",
                if s == Strategy::Fsdp { "fsdp" } else { "dp" },
                mesh / tp
            ),
            (s, None) => format!(
                "learner {} over all devices of its client: data x model {tp}",
                if s == Strategy::Fsdp { "fsdp" } else { "dp" }
            ),
        };
        let devices = self.rollout_devices();
        let rtp = self.rollout.tensor_model_parallel_size.max(1);
        let groups = (devices / rtp).max(1);
        format!(
            "{learner}; rollout {} on {devices} device(s): {groups} slot group(s) x model {rtp}, {} slots each",
            if self.rollout_colocated() { "in process" } else { "per worker" },
            self.rollout.max_num_seqs / groups
        )
    }
}

/// `critic:` PPO's value model (VeRL's `critic.*`): a copy of the policy's trunk (or
/// `model.path`'s) with a value head, trained towards GAE's returns with its own optimizer and
/// mini-batches. Read only with `algorithm.adv_estimator: gae`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CriticSection {
    /// The critic's model.
    #[serde(default)]
    pub model: CriticModelSection,
    /// AdamW and its schedule for the critic (the keys and defaults of `actor.optim`).
    #[serde(default)]
    pub optim: OptimSection,
    /// Clip the critic's global gradient norm to this value (null: `actor.grad_clip`).
    #[serde(default)]
    pub grad_clip: Option<f64>,
    /// How far a value prediction may move from the batch's value before the clipped term
    /// takes over.
    #[serde(default = "default_cliprange_value")]
    pub cliprange_value: f64,
    /// How token value losses are averaged (null: `actor.loss_agg_mode`).
    #[serde(default)]
    pub loss_agg_mode: Option<LossAggMode>,
    /// Prompts per critic optimizer step (null: `actor.ppo_mini_batch_size`).
    #[serde(default)]
    pub ppo_mini_batch_size: Option<usize>,
    /// Samples per critic forward/backward pass (null: `actor.ppo_micro_batch_size`).
    #[serde(default)]
    pub ppo_micro_batch_size: Option<usize>,
    /// Passes over each step's samples (null: `actor.ppo_epochs`).
    #[serde(default)]
    pub ppo_epochs: Option<usize>,
}

/// `critic.model`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct CriticModelSection {
    /// The model whose trunk the critic starts from (a Hugging Face directory or GGUF file with
    /// the policy's vocabulary; null: `model.path`). Its value head starts fresh.
    #[serde(default)]
    pub path: Option<String>,
    /// Recompute each layer in the critic's backward pass (null:
    /// `model.enable_gradient_checkpointing`).
    #[serde(default)]
    pub enable_gradient_checkpointing: Option<bool>,
}

/// `actor.optim`: AdamW and its schedule.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OptimSection {
    /// Peak learning rate.
    #[serde(default = "default_lr")]
    pub lr: f64,
    /// Adam's (beta1, beta2).
    #[serde(default = "default_betas")]
    pub betas: [f64; 2],
    /// Adam's epsilon.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Decoupled weight decay.
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f64,
    /// Steps of linear warmup from 0 to `lr`.
    #[serde(default)]
    pub lr_warmup_steps: usize,
    /// Schedule after warmup.
    #[serde(default = "default_lr_schedule")]
    pub lr_scheduler_type: LrSchedule,
    /// Cosine schedule's final learning rate as a fraction of `lr`.
    #[serde(default)]
    pub min_lr_ratio: f64,
}

/// `model.moe_dispatch`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MoeDispatch {
    #[default]
    Dense,
    Grouped,
}

impl MoeDispatch {
    /// The model crate's lowering (its ragged dot's form is chosen per plugin later).
    pub fn lowering(self) -> model::moe::MoeLowering {
        match self {
            MoeDispatch::Dense => model::moe::MoeLowering::Dense,
            MoeDispatch::Grouped => model::moe::MoeLowering::Grouped { native: false },
        }
    }
}

/// `actor.router_replay`: which experts the learner's passes use (docs/moe.md, "Routing
/// replay").
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RouterReplaySection {
    /// `disabled` (each pass routes by its own router), `R2` (the update replays the
    /// old-log-prob pass's experts) or `R3` (every pass replays the rollout's).
    #[serde(default)]
    pub mode: trainer::config::RouterReplay,
}

/// `actor.policy_loss`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PolicyLossSection {
    /// The surrogate: `vanilla` (PPO clip), `gspo`, `sapo`, `gpg`, `clip_cov`, `kl_cov`,
    /// `geo_mean` or `cispo`.
    #[serde(default = "default_loss_mode")]
    pub loss_mode: PolicyLossMode,
    /// `clip_cov`: the share of a micro-batch's tokens whose gradient is dropped.
    #[serde(default = "default_clip_cov_ratio")]
    pub clip_cov_ratio: f64,
    /// `clip_cov`: only tokens whose covariance exceeds this are dropped.
    #[serde(default = "default_clip_cov_lb")]
    pub clip_cov_lb: f64,
    /// `clip_cov`: ... and is below this.
    #[serde(default = "default_clip_cov_ub")]
    pub clip_cov_ub: f64,
    /// `kl_cov`: the share of a micro-batch's tokens that get the KL penalty.
    #[serde(default = "default_kl_cov_ratio")]
    pub kl_cov_ratio: f64,
    /// `kl_cov`: the penalty's weight.
    #[serde(default = "default_ppo_kl_coef")]
    pub ppo_kl_coef: f64,
}

/// `trainer:` the run as a whole.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainerSection {
    /// Passes over the training set.
    #[serde(default = "default_one_usize")]
    pub total_epochs: usize,
    /// Stop after this many steps (empty: run `total_epochs`).
    #[serde(default)]
    pub total_training_steps: Option<usize>,
    /// Save a checkpoint every this many steps; -1 never (the last step is always saved
    /// when positive).
    #[serde(default = "default_minus_one")]
    pub save_freq: i64,
    /// Validate every this many steps; -1 never.
    #[serde(default = "default_minus_one")]
    pub test_freq: i64,
    /// Validate once before the first step.
    #[serde(default = "default_true")]
    pub val_before_train: bool,
    /// Checkpoints kept on disk (oldest removed first); empty keeps all.
    #[serde(default)]
    pub max_checkpoints_to_keep: Option<usize>,
    /// `auto` continues from the newest complete checkpoint in the output directory,
    /// `resume_path` from `resume_from_path`, `disable` starts afresh.
    #[serde(default)]
    pub resume_mode: ResumeMode,
    /// The checkpoint directory (`OUTPUT/checkpoints/step_N`) `resume_mode: resume_path`
    /// continues from; it may belong to another run's output.
    #[serde(default)]
    pub resume_from_path: Option<String>,
    /// Resume even when the recipe changed keys that change what the run trains (listed in a
    /// warning); otherwise such a resume is refused (see `run::checkpoint`).
    #[serde(default)]
    pub allow_recipe_change_on_resume: bool,
    /// Validate once (before training, or at the resumed checkpoint) and stop.
    #[serde(default)]
    pub val_only: bool,
    /// Validation generations shown in the trackers at each validation (VeRL's choice of them).
    #[serde(default)]
    pub log_val_generations: usize,
    /// Where each step's training samples are written, `DIR/{step}.jsonl` (VeRL's key and
    /// fields, with the token ids grpo trained on).
    #[serde(default)]
    pub rollout_data_dir: Option<std::path::PathBuf>,
    /// 1 overlaps generation of step k+1 with the update of step k.
    #[serde(default)]
    pub off_policy_steps: usize,
    /// PPO (`algorithm.adv_estimator: gae`): the first steps in which only the critic trains;
    /// the actor trains from step `critic_warmup` on (VeRL's rule).
    #[serde(default)]
    pub critic_warmup: u64,
    /// Where checkpoints, metrics and plots go (`--output` overrides).
    #[serde(default = "default_output_dir")]
    pub output_dir: String,
    /// Seed of sampling, initialisation and everything else random.
    #[serde(default)]
    pub seed: u64,
    /// Where each step's metrics go (VeRL's names): `console`, `file`, `tensorboard`, `mlflow`,
    /// `wandb`; one name or a list.
    #[serde(default = "default_loggers", deserialize_with = "one_or_more_loggers")]
    pub logger: Vec<tracking::Logger>,
    /// The project in the trackers (MLflow's experiment, wandb's project).
    #[serde(default = "default_project_name")]
    pub project_name: String,
    /// The run's name in the trackers; null: the output directory's name.
    #[serde(default)]
    pub experiment_name: Option<String>,
}

fn default_loggers() -> Vec<tracking::Logger> {
    vec![tracking::Logger::Console, tracking::Logger::File]
}

fn default_project_name() -> String {
    "grpo".into()
}

/// `trainer.logger: console` or `trainer.logger: [console, wandb]`, as VeRL takes both.
fn one_or_more_loggers<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<tracking::Logger>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMore {
        One(String),
        More(Vec<String>),
    }
    let names = match OneOrMore::deserialize(d)
        .map_err(|_| serde::de::Error::custom("expected a logger name or a list of them"))?
    {
        OneOrMore::One(name) => vec![name],
        OneOrMore::More(names) => names,
    };
    names
        .iter()
        .map(|name| {
            serde_yaml::from_value(serde_yaml::Value::String(name.clone())).map_err(|_| {
                serde::de::Error::custom(format!(
                    "unknown logger `{name}`; the loggers are console, file, tensorboard, mlflow and wandb"
                ))
            })
        })
        .collect()
}

/// `trainer.resume_mode`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    #[default]
    Auto,
    Disable,
    ResumePath,
}

/// `cluster:` where the roles run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// Default device kind for every role.
    #[serde(default)]
    pub device: DeviceKind,
    /// Path of the PJRT plugin to use instead of discovering it.
    #[serde(default)]
    pub plugin_path: Option<String>,
    /// Devices the CPU plugin exposes (its `cpu_device_count`).
    #[serde(default = "default_one_usize")]
    pub cpu_device_count: usize,
    /// How worker processes are started: `local` on this host by the orchestrator, `ray` as jobs
    /// of an existing Ray cluster (`cluster.ray`, `cluster.pools`).
    #[serde(default)]
    pub launcher: Launcher,
    /// Rollout worker processes to start; 0 runs rollout in the orchestrator's process.
    #[serde(default)]
    pub rollout_workers: usize,
    /// Reward worker processes to start; 0 scores in the orchestrator's process.
    #[serde(default)]
    pub reward_workers: usize,
    /// Device kind of the rollout worker processes; null means `cluster.device`.
    #[serde(default)]
    pub rollout_device: Option<DeviceKind>,
    /// Device kind of the learner worker processes; null means `cluster.device`.
    #[serde(default)]
    pub learner_device: Option<DeviceKind>,
    /// Learner worker processes: 0 trains in the orchestrator's process, 1 in a worker process
    /// (which also holds the reference model).
    #[serde(default)]
    pub learner_workers: usize,
    /// Host address workers listen on (loopback unless you mean otherwise).
    #[serde(default = "default_bind_host")]
    pub bind_host: String,
    /// Seconds a worker may take to answer a health check before it counts as dead.
    #[serde(default = "default_worker_timeout_s")]
    pub worker_timeout_s: f64,
    /// TLS for worker connections; null means plain TCP.
    #[serde(default)]
    pub tls: Option<TlsSection>,
    /// The Ray cluster that places the workers (`cluster.launcher: ray` only).
    #[serde(default)]
    pub ray: Option<RaySection>,
    /// Pools of Ray workers: device kind, resources per worker, worker count and roles
    /// (`cluster.launcher: ray` only). Every role needs a pool: each runs as Ray jobs.
    #[serde(default)]
    pub pools: Vec<PoolSection>,
}

/// `cluster.launcher`: how worker processes are started.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum Launcher {
    /// `grpo worker` processes on this host, started and stopped by the orchestrator.
    #[default]
    Local,
    /// Ray jobs submitted to an existing Ray cluster (`cluster.ray`), placed by `cluster.pools`.
    Ray,
}

impl Launcher {
    /// `local` or `ray`, as recipes spell it.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Local => "local",
            Launcher::Ray => "ray",
        }
    }
}

/// `cluster.ray`: the Ray cluster the workers are submitted to as jobs.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RaySection {
    /// The Ray dashboard / Job Submission API address, e.g. `http://127.0.0.1:8265`.
    pub address: String,
    /// The address workers dial back to register: the orchestrator binds its registry there
    /// and advertises it, so it must be reachable from the Ray nodes.
    #[serde(default = "default_bind_host")]
    pub orchestrator_host: String,
    /// Path of the `grpo` binary on the nodes; null means this binary's own path (a shared path).
    #[serde(default)]
    pub binary: Option<String>,
    /// Ray's `runtime_env` for the worker jobs, passed verbatim (any map).
    #[serde(default)]
    pub runtime_env: Option<serde_json::Map<String, serde_json::Value>>,
    /// Times a worker job that failed or disappeared is resubmitted before the run fails.
    #[serde(default = "default_max_resubmits")]
    pub max_resubmits: usize,
    /// Seconds between polls of the workers' job status.
    #[serde(default = "default_one")]
    pub poll_interval_s: f64,
}

/// One entry of `cluster.pools`: `workers` Ray jobs for each role it lists, each asking Ray for
/// `num_cpus`, `num_gpus` and `resources`, each opening a `device` client.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PoolSection {
    /// The pool's name (unique; letters, digits, `-`, `_`, `.`).
    pub name: String,
    /// The device kind its workers open.
    #[serde(default)]
    pub device: PoolDevice,
    /// The roles it serves; `workers` workers for each.
    pub roles: Vec<crate::roles::Role>,
    /// Workers per listed role.
    #[serde(default = "default_one_usize")]
    pub workers: usize,
    /// CPUs each worker asks Ray for (`entrypoint_num_cpus`).
    #[serde(default = "default_one")]
    pub num_cpus: f64,
    /// GPUs each worker asks Ray for (`entrypoint_num_gpus`).
    #[serde(default)]
    pub num_gpus: f64,
    /// Other Ray resources each worker asks for (`entrypoint_resources`), e.g. `{TPU: 4}`.
    #[serde(default)]
    pub resources: std::collections::BTreeMap<String, f64>,
}

/// `cluster.pools[].device`: `cpu`, `gpu` (the CUDA plugin; `cuda` is accepted too) or `tpu`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum PoolDevice {
    #[default]
    Cpu,
    #[serde(alias = "cuda")]
    Gpu,
    Tpu,
}

impl PoolDevice {
    /// The device kind (PJRT plugin) the pool's workers open.
    pub fn kind(self) -> DeviceKind {
        match self {
            PoolDevice::Cpu => DeviceKind::Cpu,
            PoolDevice::Gpu => DeviceKind::Cuda,
            PoolDevice::Tpu => DeviceKind::Tpu,
        }
    }

    /// `cpu`, `gpu` or `tpu`, as pools spell it.
    pub fn name(self) -> &'static str {
        match self {
            PoolDevice::Cpu => "cpu",
            PoolDevice::Gpu => "gpu",
            PoolDevice::Tpu => "tpu",
        }
    }
}

/// One worker the pools ask for: which pool, which role, and its index among all workers of
/// that role (counting up across pools). See [`ClusterSection::pool_workers`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolWorker<'a> {
    /// The pool it belongs to.
    pub pool: &'a PoolSection,
    /// The role it serves.
    pub role: crate::roles::Role,
    /// Its index among the workers of `role`, over all pools.
    pub index: usize,
}

impl PoolWorker<'_> {
    /// The worker id of its `attempt`-th submission (1 for the first): `ROLE-INDEX-aATTEMPT`,
    /// e.g. `rollout-0-a1`; unique per submission.
    pub fn worker_id(&self, attempt: usize) -> String {
        format!("{}-{}-a{attempt}", self.role.name(), self.index)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    /// PEM certificate chain the workers present.
    pub cert: String,
    /// PEM private key of that certificate.
    pub key: String,
    /// PEM CA certificate the orchestrator trusts for the workers.
    pub ca: String,
    /// The name the certificate is issued for (checked by the client).
    #[serde(default = "default_tls_domain")]
    pub domain: String,
    /// Mutual TLS: every server (workers, the Ray registry) also requires its clients to
    /// present a certificate signed by `ca`, and every client presents `cert`.
    #[serde(default)]
    pub mutual: bool,
}

impl ClusterSection {
    /// The device kind rollout worker processes run on: `cluster.rollout_device`, else
    /// `cluster.device`.
    pub fn rollout_device_kind(&self) -> DeviceKind {
        self.rollout_device.unwrap_or(self.device)
    }

    /// The device kind learner worker processes run on: `cluster.learner_device`, else
    /// `cluster.device`.
    pub fn learner_device_kind(&self) -> DeviceKind {
        self.learner_device.unwrap_or(self.device)
    }

    /// `cluster.plugin_path` when it applies to `kind`: it names the plugin of `cluster.device`,
    /// so a role on another kind discovers its own.
    pub fn plugin_path_for(&self, kind: DeviceKind) -> Option<&str> {
        (kind == self.device)
            .then_some(self.plugin_path.as_deref())
            .flatten()
    }

    /// Worker processes of `role` the recipe asks for: `cluster.*_workers` with the local
    /// launcher, the pools' workers with Ray (0: the role runs in the orchestrator's process).
    pub fn worker_count(&self, role: crate::roles::Role) -> usize {
        use crate::roles::Role;
        match self.launcher {
            Launcher::Local => match role {
                Role::Rollout => self.rollout_workers,
                Role::Reward => self.reward_workers,
                Role::Learner => self.learner_workers,
            },
            Launcher::Ray => self.pool_worker_count(role),
        }
    }

    /// Workers of `role` over all `cluster.pools` (0: the role runs in the orchestrator's
    /// process).
    pub fn pool_worker_count(&self, role: crate::roles::Role) -> usize {
        self.pools
            .iter()
            .filter(|p| p.roles.contains(&role))
            .map(|p| p.workers)
            .sum()
    }

    /// Every worker `cluster.pools` asks for, in a stable order: pools in recipe order, within a
    /// pool its roles in the order listed, `workers` of each; `index` counts up per role across
    /// pools (a rollout pool of 2 then one of 1 give rollout 0, 1, 2).
    pub fn pool_workers(&self) -> Vec<PoolWorker<'_>> {
        let mut next_index: std::collections::HashMap<crate::roles::Role, usize> = Default::default();
        let mut out = Vec::new();
        for pool in &self.pools {
            for &role in &pool.roles {
                for _ in 0..pool.workers {
                    let index = next_index.entry(role).or_insert(0);
                    out.push(PoolWorker {
                        pool,
                        role,
                        index: *index,
                    });
                    *index += 1;
                }
            }
        }
        out
    }

    /// The pool named `name`, if the recipe has one.
    pub fn pool(&self, name: &str) -> Option<&PoolSection> {
        self.pools.iter().find(|p| p.name == name)
    }
}

/// Device kinds, one per PJRT plugin.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
    Tpu,
}

impl DeviceKind {
    /// `cpu`, `cuda` or `tpu`, as recipes spell it.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Tpu => "tpu",
        }
    }

    /// The PJRT plugin that drives this kind of device.
    pub fn plugin(self) -> xla::runtime::PluginKind {
        match self {
            DeviceKind::Cpu => xla::runtime::PluginKind::Cpu,
            DeviceKind::Cuda => xla::runtime::PluginKind::Cuda,
            DeviceKind::Tpu => xla::runtime::PluginKind::Tpu,
        }
    }
}

fn default_adv_estimator() -> AdvantageEstimator {
    AdvantageEstimator::Grpo
}
// The keys that become the trainer's loss and optimizer configs default to the trainer's own
// defaults, so the two cannot drift apart.
fn loss_defaults() -> trainer::config::PolicyLossConfig {
    trainer::config::PolicyLossConfig::default()
}
fn optim_defaults() -> trainer::config::OptimConfig {
    trainer::config::OptimConfig::default()
}
fn default_lr_schedule() -> LrSchedule {
    optim_defaults().warmup_style
}
fn default_loss_mode() -> PolicyLossMode {
    loss_defaults().loss_mode
}
fn default_loss_agg_mode() -> LossAggMode {
    loss_defaults().loss_agg_mode
}
fn default_kl_loss_type() -> KlPenalty {
    loss_defaults().kl_loss_type
}
fn default_clip_ratio_low() -> f64 {
    loss_defaults().clip_ratio_low
}
fn default_clip_ratio_high() -> f64 {
    loss_defaults().clip_ratio_high
}
fn default_clip_ratio_c() -> f64 {
    loss_defaults().clip_ratio_c
}
fn default_kl_loss_coef() -> f64 {
    loss_defaults().kl_loss_coef
}
pub(crate) fn default_lora_alpha() -> f64 {
    16.0
}
fn default_tau_pos() -> f64 {
    loss_defaults().tau_pos
}
fn default_tau_neg() -> f64 {
    loss_defaults().tau_neg
}
fn default_clip_cov_ratio() -> f64 {
    loss_defaults().clip_cov_ratio
}
fn default_clip_cov_lb() -> f64 {
    loss_defaults().clip_cov_lb
}
fn default_clip_cov_ub() -> f64 {
    loss_defaults().clip_cov_ub
}
fn default_kl_cov_ratio() -> f64 {
    loss_defaults().kl_cov_ratio
}
fn default_ppo_kl_coef() -> f64 {
    loss_defaults().ppo_kl_coef
}
fn default_rollout_is_threshold() -> f64 {
    trainer::rollout_correction::RolloutCorrection::default().rollout_is_threshold
}
fn default_gamma() -> f64 {
    trainer::config::AdvantageConfig::default().gamma
}
fn default_lam() -> f64 {
    trainer::config::AdvantageConfig::default().lam
}
fn default_cliprange_value() -> f64 {
    trainer::config::ValueLossConfig::default().cliprange_value
}
fn default_lr() -> f64 {
    optim_defaults().lr
}
fn default_betas() -> [f64; 2] {
    optim_defaults().betas
}
fn default_eps() -> f64 {
    optim_defaults().eps
}
fn default_weight_decay() -> f64 {
    optim_defaults().weight_decay
}
fn default_grad_clip() -> f64 {
    optim_defaults().grad_clip.unwrap_or(0.0)
}
fn default_true() -> bool {
    true
}
fn default_one() -> f64 {
    1.0
}
fn default_one_usize() -> usize {
    1
}
fn default_minus_one() -> i64 {
    -1
}
fn default_n() -> usize {
    4
}
fn default_max_num_seqs() -> usize {
    64
}
fn default_rollout_dtype() -> DTypeName {
    DTypeName::F32
}
fn default_actor_dtype() -> DTypeName {
    DTypeName::F32
}
fn default_kl_penalty() -> KlPenalty {
    KlPenalty::K1
}

fn default_kl_ctrl() -> KlControl {
    KlControl::Fixed
}

fn default_kl_coef() -> f64 {
    0.001
}
fn default_ppo_mini_batch_size() -> usize {
    8
}
fn default_ppo_micro_batch_size() -> usize {
    4
}
fn default_max_nonfinite() -> usize {
    3
}
fn default_length_bucket() -> usize {
    16
}
fn default_bind_host() -> String {
    "127.0.0.1".into()
}
fn default_max_resubmits() -> usize {
    3
}
fn default_worker_timeout_s() -> f64 {
    10.0
}
fn default_tls_domain() -> String {
    "localhost".into()
}
fn default_output_dir() -> String {
    "outputs".into()
}

macro_rules! default_from_serde {
    ($($t:ty),*) => {$(
        impl Default for $t {
            /// Every key at its documented default.
            fn default() -> Self {
                serde_yaml::from_str("{}").expect("all keys of this section have defaults")
            }
        }
    )*};
}
default_from_serde!(
    RolloutSection,
    ValKwargs,
    AlgorithmSection,
    RolloutCorrectionSection,
    ActorSection,
    CriticSection,
    OptimSection,
    PolicyLossSection,
    TrainerSection,
    ClusterSection
);

impl Recipe {
    /// Every dotted key the recipe types accept (sections and leaves), in order.
    /// Maps keyed by user data (such as `reward.scorers`) are listed as the map's own key.
    pub fn all_keys() -> Vec<String> {
        // Optional sections are filled in so that their keys are listed too.
        let example = load_recipe_str(
            "model: {path: m}\ndata: {train_files: t.parquet}\ncluster: {tls: {cert: c, key: k, ca: a}, \
             ray: {address: a}, pools: [{name: p, roles: [rollout]}]}\n\
             reward: {custom_reward_function: {path: r.py}}\nalgorithm: {kl_ctrl: {type: adaptive}}\n\
             rollout: {multi_turn: {agent: {command: [a]}}}\n",
            "<keys>",
        )
        .expect("a minimal recipe loads");
        let value = serde_yaml::to_value(&example).expect("recipes serialize");
        let mut keys = Vec::new();
        collect_keys(&value, "", &mut keys);
        keys
    }

    /// The resolved recipe as YAML (defaults filled in), as `--print-config` shows it.
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).expect("recipes serialize")
    }
}

/// Collects the dotted keys under `value`; the keys of a list's entries are listed once, as
/// `list[].key` (e.g. `cluster.pools[].name`).
fn collect_keys(value: &serde_yaml::Value, prefix: &str, out: &mut Vec<String>) {
    if let serde_yaml::Value::Sequence(items) = value {
        if let Some(first) = items.first() {
            collect_keys(first, &format!("{prefix}[]"), out);
        }
    }
    if let serde_yaml::Value::Mapping(map) = value {
        for (k, v) in map {
            let key = k.as_str().unwrap_or_default();
            let path = if prefix.is_empty() {
                key.to_string()
            } else {
                format!("{prefix}.{key}")
            };
            out.push(path.clone());
            // Maps whose keys are user data (data sources, scorer names) are documented as one key.
            if !matches!(
                path.as_str(),
                "reward.scorers"
                    | "reward.data_sources"
                    | "cluster.ray.runtime_env"
                    | "cluster.pools[].resources"
            ) {
                collect_keys(v, &path, out);
            }
        }
    }
}
