//! The recipe's `reward:` section ([`RewardConfig`]) and how it becomes a [`RewardFunction`].
//!
//! ```yaml
//! reward:
//!   default: gsm8k_flexible            # scorer for data sources without an entry (none: error)
//!   data_sources:                      # data_source -> scorer name (adds to / overrides VeRL's)
//!     openai/gsm8k: gsm8k_and_format
//!   scorers:                           # named scorers; may shadow the built-in names
//!     think_format: {kind: format_tags, tags: [think, answer]}
//!     gsm8k_and_format:
//!       kind: weighted
//!       parts: [{scorer: gsm8k, weight: 0.9}, {scorer: think_format, weight: 0.1}]
//!     judge: {kind: http, url: "http://127.0.0.1:8000/score", timeout_s: 10, max_in_flight: 8}
//!     rm: {kind: reward_model, path: models/my-reward-model, max_length: 2048}
//!     judge_yes:
//!       kind: judge
//!       path: models/Qwen2.5-7B-Instruct
//!       instruction: "Question: {{ prompt }}\nAnswer: {{ response }}\nIs the answer right? Yes or No."
//!       verdict: {kind: probability, yes: "Yes", no: "No"}
//!   overlong_buffer: {enable: true, len: 512, penalty_factor: 1.0, log: true}
//!   # or, instead of data_sources and default, one scorer for every sample (VeRL with a
//!   # reward model scores every sample with it):
//!   # scorer: rm
//!   # or a reward file written for VeRL:
//!   # custom_reward_function: {path: my_reward.py, name: compute_score, reward_kwargs: {}}
//!   num_workers: 8
//!   time_limit_s: 30
//! ```
//!
//! Built-in scorer names (usable without a `scorers` entry): `gsm8k`, `gsm8k_flexible`, `math`,
//! `math_dapo`, `arithmetic`, `format_think_answer`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::arithmetic::ArithmeticScorer;
use crate::combine::{WeightedPart, WeightedScorer};
use crate::external::command::CommandScorer;
use crate::external::http::HttpScorer;
use crate::external::verl_function::{RewardManager, VerlFunctionScorer};
use crate::format::{RegexFormatScorer, TagFormatScorer};
use crate::gsm8k::{Gsm8kMethod, Gsm8kScorer};
use crate::math::MathScorer;
use crate::math_dapo::MathDapoScorer;
use crate::overlong::OverlongPenalty;
use crate::pool::PoolOptions;
use crate::registry::{RewardFunction, VERL_DATA_SOURCES, VERL_DATA_SOURCE_PREFIXES};
use crate::scorer::Scorer;

/// Names of the built-in scorers.
pub const BUILT_IN_SCORERS: [&str; 6] = [
    "gsm8k",
    "gsm8k_flexible",
    "math",
    "math_dapo",
    "arithmetic",
    "format_think_answer",
];

fn one() -> f64 {
    1.0
}
fn default_timeout_s() -> f64 {
    30.0
}
fn default_max_in_flight() -> usize {
    8
}
fn default_tags() -> Vec<String> {
    vec!["think".to_string(), "answer".to_string()]
}
fn default_num_workers() -> usize {
    4
}
fn default_time_limit_s() -> f64 {
    60.0
}
fn default_log_first_errors() -> usize {
    5
}

/// The recipe's `reward:` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardConfig {
    /// Scorer for data sources with no entry; without one, such samples are errors (score 0).
    #[serde(default)]
    pub default: Option<String>,
    /// `data_source` → scorer name; added to VeRL's table, overriding it where both name a source.
    #[serde(default)]
    pub data_sources: BTreeMap<String, String>,
    /// Named scorer definitions; a name may shadow a built-in scorer everywhere it is used.
    #[serde(default)]
    pub scorers: BTreeMap<String, ScorerSpec>,
    /// The one scorer of every sample, whatever its `data_source` (VeRL's table is not used);
    /// instead of `data_sources` and `default`.
    #[serde(default)]
    pub scorer: Option<String>,
    /// DAPO's overlong penalty.
    #[serde(default)]
    pub overlong_buffer: OverlongBufferConfig,
    /// Reward worker threads scoring in parallel.
    #[serde(default = "default_num_workers")]
    pub num_workers: usize,
    /// Time limit per sample in the pool, seconds (a backstop for in-process scorers; external
    /// scorers also have their own `timeout_s`).
    #[serde(default = "default_time_limit_s")]
    pub time_limit_s: f64,
    /// How many scoring errors are logged in full (all are counted).
    #[serde(default = "default_log_first_errors")]
    pub log_first_errors: usize,
    /// VeRL's `custom_reward_function`: a Python file's function scores every sample.
    #[serde(default)]
    pub custom_reward_function: Option<CustomRewardFunction>,
}

/// `reward.custom_reward_function`: a reward file written for VeRL, run unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomRewardFunction {
    /// The Python file (or `pkg://dotted.module`).
    pub path: String,
    /// The function in it.
    #[serde(default = "default_function_name")]
    pub name: String,
    /// Keyword arguments passed to every call.
    #[serde(default)]
    pub reward_kwargs: BTreeMap<String, serde_json::Value>,
    /// How it is called: `naive` (one response a call) or `batch` (lists), as VeRL's
    /// `reward_model.reward_manager`.
    #[serde(default)]
    pub reward_manager: RewardManager,
    /// Python processes calling it in parallel.
    #[serde(default = "default_num_workers")]
    pub workers: usize,
    /// Time limit per call, seconds; a process over it is killed and replaced.
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
}

fn default_function_name() -> String {
    "compute_score".into()
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self {
            default: None,
            data_sources: BTreeMap::new(),
            scorers: BTreeMap::new(),
            scorer: None,
            overlong_buffer: OverlongBufferConfig::default(),
            num_workers: default_num_workers(),
            time_limit_s: default_time_limit_s(),
            log_first_errors: default_log_first_errors(),
            custom_reward_function: None,
        }
    }
}

/// `reward.overlong_buffer`: DAPO's overlong penalty (VeRL's `overlong_buffer` keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverlongBufferConfig {
    /// Apply the penalty.
    #[serde(default)]
    pub enable: bool,
    /// Length of the penalised zone before the maximum response length, tokens.
    #[serde(default)]
    pub len: usize,
    /// Penalty at the maximum response length.
    #[serde(default = "one")]
    pub penalty_factor: f64,
    /// Add `overlong_reward` and `overlong` to each sample's extras.
    #[serde(default)]
    pub log: bool,
    /// Maximum response length, tokens; when absent the run passes `data.max_response_length`.
    #[serde(default)]
    pub max_response_length: Option<usize>,
}

impl Default for OverlongBufferConfig {
    fn default() -> Self {
        Self {
            enable: false,
            len: 0,
            penalty_factor: 1.0,
            log: false,
            max_response_length: None,
        }
    }
}

/// One named scorer definition in `reward.scorers`, selected by `kind`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ScorerSpec {
    /// VeRL's GSM8K scorer.
    Gsm8k {
        /// `strict` (last `#### N`) or `flexible` (last number).
        #[serde(default)]
        method: Gsm8kMethod,
        /// Reward for a found but wrong answer.
        #[serde(default)]
        format_score: f64,
        /// Reward for a correct answer.
        #[serde(default = "one")]
        score: f64,
    },
    /// VeRL's MATH scorer (`math_reward`).
    Math {},
    /// VeRL's DAPO math scorer (1 / -1).
    MathDapo {},
    /// The synthetic arithmetic task.
    Arithmetic {
        /// Reward for a well-formed but wrong answer.
        #[serde(default)]
        format_score: f64,
        /// Reward for a correct answer.
        #[serde(default = "one")]
        score: f64,
    },
    /// `score` when a regular expression matches the response.
    FormatRegex {
        /// The pattern (Rust `regex` syntax).
        pattern: String,
        /// Require the whole response to match.
        #[serde(default)]
        full_match: bool,
        /// Reward when it matches.
        #[serde(default = "one")]
        score: f64,
    },
    /// `score` when the response is exactly the given tag blocks in order.
    FormatTags {
        /// Tag names in order.
        #[serde(default = "default_tags")]
        tags: Vec<String>,
        /// Reward when the structure matches.
        #[serde(default = "one")]
        score: f64,
    },
    /// The rewards an interaction gave a multi-turn episode (`turn_scores`), reduced.
    TurnScores {
        /// `last`, `sum` or `max`.
        #[serde(default)]
        reduce: crate::turn_scores::TurnReduce,
    },
    /// A weighted sum of other scorers.
    Weighted {
        /// The parts.
        parts: Vec<WeightedPartSpec>,
    },
    /// A long-lived child process speaking JSON lines.
    Command {
        /// Executable and arguments, e.g. `[python3, score.py]`.
        command: Vec<String>,
        /// Time limit per request, seconds.
        #[serde(default = "default_timeout_s")]
        timeout_s: f64,
        /// Requests in flight at most.
        #[serde(default = "default_max_in_flight")]
        max_in_flight: usize,
    },
    /// A discriminative reward model: a `*ForSequenceClassification` checkpoint's score of the
    /// prompt and response, rendered by its own chat template, on a device of this process.
    RewardModel(RewardModelSpec),
    /// A generative judge: a chat model asked to grade the response, its reward the
    /// probability of its "yes" verdict or a number parsed from its greedy answer.
    Judge(JudgeSpec),
    /// An HTTP endpoint (POST JSON in, JSON out).
    Http {
        /// `http://host:port/path`.
        url: String,
        /// Time limit per request, seconds.
        #[serde(default = "default_timeout_s")]
        timeout_s: f64,
        /// Requests in flight at most.
        #[serde(default = "default_max_in_flight")]
        max_in_flight: usize,
    },
}

/// `kind: reward_model`: a discriminative reward model (VeRL's `reward_model.model.*`,
/// `max_length`, `micro_batch_size_per_gpu`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardModelSpec {
    /// The checkpoint directory: `config.json` naming a `*ForSequenceClassification`
    /// architecture with one label, its safetensors, `tokenizer.json` and
    /// `tokenizer_config.json` with the chat template the model was trained on.
    pub path: String,
    /// Most tokens of prompt and response the model reads; longer conversations are cut as
    /// `truncation` says.
    #[serde(default = "default_rm_max_length")]
    pub max_length: usize,
    /// `right` keeps the beginning (VeRL's default), `left` the end; `error` scores such a
    /// sample 0 with an error.
    #[serde(default)]
    pub truncation: RmTruncation,
    /// Conversations scored in one program run at most.
    #[serde(default = "default_rm_micro_batch")]
    pub micro_batch_size: usize,
    /// The compute type: `auto` (bf16 where the device computes it natively, else f32), `f32`
    /// or `bf16`.
    #[serde(default)]
    pub dtype: ModelDType,
}

fn default_rm_max_length() -> usize {
    4096
}
fn default_rm_micro_batch() -> usize {
    8
}

/// `reward_model` scorers' `truncation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RmTruncation {
    /// Keep the first `max_length` tokens.
    #[default]
    Right,
    /// Keep the last `max_length` tokens.
    Left,
    /// Score the sample 0 with an error.
    Error,
}

/// The compute type of a scorer that runs a model (`reward_model`, `judge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelDType {
    /// bf16 where the device computes it natively, else f32.
    #[default]
    Auto,
    /// f32.
    F32,
    /// bf16.
    Bf16,
}

/// `kind: judge`: a chat model asked, at temperature 0, to grade each response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeSpec {
    /// The judge: a `.gguf` file or a Hugging Face model directory with its tokenizer and chat
    /// template.
    pub path: String,
    /// The judge's user message, a Jinja template over `prompt` (the row's last user message,
    /// or its string prompt), `messages` (the row's chat messages), `response`,
    /// `ground_truth` and `extra` (the row's other columns).
    pub instruction: String,
    /// A system message put before it.
    #[serde(default)]
    pub system: Option<String>,
    /// How the reward comes out of the judge.
    pub verdict: Verdict,
    /// Most tokens of the rendered judge prompt; a longer one scores 0 with an error.
    #[serde(default = "default_rm_max_length")]
    pub max_length: usize,
    /// Judge prompts run together at most (a program's batch, or the engine's sequences).
    #[serde(default = "default_rm_micro_batch")]
    pub micro_batch_size: usize,
    /// The compute type.
    #[serde(default)]
    pub dtype: ModelDType,
}

/// How a `judge` scorer turns the judge's answer into a reward, selected by `kind` (internally
/// tagged, as the scorers are, so a recipe written back by the run reads the same).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Verdict {
    /// `P(yes) / (P(yes) + P(no))` of the judge's first answer token: `yes` and `no` must each
    /// be one token of its tokenizer.
    Probability {
        /// The approving answer, e.g. `"Yes"`.
        yes: String,
        /// The rejecting answer, e.g. `"No"`.
        no: String,
    },
    /// The judge answers greedily; the reward is `scale` times the number the first capture
    /// group of `pattern`'s last match holds (no match: 0 with an error).
    Parse {
        /// A regular expression with one capture group around the number, e.g.
        /// `'Score: (\d+(?:\.\d+)?)'`.
        pattern: String,
        /// Most tokens of the answer.
        #[serde(default = "default_judge_tokens")]
        max_new_tokens: usize,
        /// Multiplies the parsed number.
        #[serde(default = "one")]
        scale: f64,
    },
}

fn default_judge_tokens() -> usize {
    256
}

/// Why a model scorer could not be built: the scorer's key it is about (`path`,
/// `instruction`, ...) and what is wrong and what to do.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelScorerError {
    /// The key under `reward.scorers.NAME`.
    pub field: String,
    /// What is wrong and what to do.
    pub message: String,
}

impl ModelScorerError {
    /// An error about `field`.
    pub fn new(field: &str, message: impl Into<String>) -> ModelScorerError {
        ModelScorerError {
            field: field.to_string(),
            message: message.into(),
        }
    }
}

/// Builds the scorers that need a model on a device (`kind: reward_model`), which this crate,
/// having no compute, cannot: `grpo` passes one to [`RewardConfig::build_with`].
pub trait ModelScorers {
    /// The scorer `name` defined by `spec`; the error says what is wrong with the model.
    fn reward_model(&self, name: &str, spec: &RewardModelSpec) -> Result<Arc<dyn Scorer>, ModelScorerError>;

    /// The judge `name` defined by `spec` (already checked: limits, `pattern`, distinct
    /// verdicts); the error says what is wrong with the model.
    fn judge(&self, name: &str, spec: &JudgeSpec) -> Result<Arc<dyn Scorer>, ModelScorerError>;
}

/// No model scorers: a recipe defining one is refused.
struct NoModelScorers;

impl ModelScorers for NoModelScorers {
    fn reward_model(&self, _: &str, _: &RewardModelSpec) -> Result<Arc<dyn Scorer>, ModelScorerError> {
        Err(ModelScorerError::new(
            "path",
            "a reward model needs a device, which only `grpo run` and `grpo worker` open",
        ))
    }

    fn judge(&self, _: &str, _: &JudgeSpec) -> Result<Arc<dyn Scorer>, ModelScorerError> {
        Err(ModelScorerError::new(
            "path",
            "a judge needs a device, which only `grpo run` and `grpo worker` open",
        ))
    }
}

/// One part of a `weighted` scorer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightedPartSpec {
    /// Scorer name (built-in or defined in `reward.scorers`).
    pub scorer: String,
    /// Its weight.
    pub weight: f64,
}

/// A `reward:` section that cannot be turned into a reward function.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A scorer name that is neither built in nor defined.
    #[error("`{key}` names the scorer `{name}`, which is not defined{suggestion}; known scorers: {known}. Define it under `reward.scorers` or use a known name")]
    UnknownScorer {
        /// The key holding the name.
        key: String,
        /// The unknown name.
        name: String,
        /// ", did you mean `x`?" or empty.
        suggestion: String,
        /// Comma-separated known names.
        known: String,
    },
    /// Weighted scorers referring to each other in a loop.
    #[error("`reward.scorers` refer to each other in a loop: {chain}; break the loop")]
    ScorerCycle {
        /// The names along the loop.
        chain: String,
    },
    /// A value out of range or unusable.
    #[error("`{key}`: {message}")]
    InvalidValue {
        /// The key.
        key: String,
        /// What is wrong and what to do.
        message: String,
    },
}

impl RewardConfig {
    /// Pool settings from `num_workers`, `time_limit_s` and `log_first_errors`.
    pub fn pool_options(&self) -> Result<PoolOptions, ConfigError> {
        if self.num_workers == 0 {
            return Err(invalid("reward.num_workers", "must be at least 1"));
        }
        Ok(PoolOptions {
            num_workers: self.num_workers,
            time_limit: seconds("reward.time_limit_s", self.time_limit_s)?,
            log_first_errors: self.log_first_errors,
        })
    }

    /// Builds the reward function: VeRL's data-source table, then `data_sources`, `default`
    /// (or instead of those three `scorer` or `custom_reward_function`, for every data source) and the
    /// overlong penalty. `max_response_length` is the run's `data.max_response_length`, used
    /// by the penalty unless `overlong_buffer.max_response_length` is set. Each scorer is built
    /// once and shared (one child process per `command` scorer however many sources use it).
    pub fn build(&self, max_response_length: Option<usize>) -> Result<RewardFunction, ConfigError> {
        self.build_with(max_response_length, &NoModelScorers)
    }

    /// [`RewardConfig::build`], with `models` building the scorers that run a model.
    pub fn build_with(
        &self,
        max_response_length: Option<usize>,
        models: &dyn ModelScorers,
    ) -> Result<RewardFunction, ConfigError> {
        let mut builder = Builder {
            config: self,
            models,
            built: HashMap::new(),
            in_progress: Vec::new(),
        };
        let mut reward = match (&self.custom_reward_function, &self.scorer) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "reward.scorer",
                    "and `reward.custom_reward_function` each score every sample: keep one",
                ))
            }
            (Some(custom), None) => RewardFunction::new().with_default(self.custom_function(custom)?),
            (None, Some(name)) => {
                if !self.data_sources.is_empty() || self.default.is_some() {
                    return Err(invalid(
                        "reward.scorer",
                        "scores every sample, so `reward.data_sources` and `reward.default` must \
                         stay empty with it; to choose by data source, use those instead",
                    ));
                }
                RewardFunction::new().with_default(builder.scorer(name, "reward.scorer")?)
            }
            (None, None) => self.by_data_source(&mut builder)?,
        };
        // Scorers defined but not referenced are still checked.
        for name in self.scorers.keys() {
            builder.scorer(name, &format!("reward.scorers.{name}"))?;
        }
        let overlong = &self.overlong_buffer;
        if overlong.enable {
            if overlong.len == 0 {
                return Err(invalid(
                    "reward.overlong_buffer.len",
                    "must be at least 1 token when the penalty is enabled",
                ));
            }
            if !overlong.penalty_factor.is_finite() {
                return Err(invalid(
                    "reward.overlong_buffer.penalty_factor",
                    "must be a finite number",
                ));
            }
            let max_response_length =
                overlong
                    .max_response_length
                    .or(max_response_length)
                    .ok_or_else(|| {
                        invalid(
                            "reward.overlong_buffer.max_response_length",
                            "is needed for the overlong penalty: set it or `data.max_response_length`",
                        )
                    })?;
            if overlong.len > max_response_length {
                tracing::warn!(
                    "reward.overlong_buffer.len ({}) exceeds the maximum response length ({max_response_length}): \
                     every response will be penalised (as in VeRL); reduce the buffer",
                    overlong.len
                );
            }
            let penalty = OverlongPenalty {
                buffer_len: overlong.len,
                penalty_factor: overlong.penalty_factor,
                max_response_length,
            };
            reward = reward.with_overlong_penalty(penalty, overlong.log);
        }
        Ok(reward)
    }

    /// The scorers by data source: VeRL's table, then `data_sources`, then `default`.
    fn by_data_source(&self, builder: &mut Builder<'_>) -> Result<RewardFunction, ConfigError> {
        let mut reward = RewardFunction::new();
        let mut data_sources: BTreeMap<String, (String, String)> = BTreeMap::new();
        for (data_source, name) in VERL_DATA_SOURCES {
            data_sources.insert(
                data_source.to_string(),
                (name.to_string(), "reward (built-in VeRL table)".to_string()),
            );
        }
        for (data_source, name) in &self.data_sources {
            data_sources.insert(
                data_source.clone(),
                (name.clone(), format!("reward.data_sources.{data_source}")),
            );
        }
        for (data_source, (name, key)) in &data_sources {
            reward = reward.with_data_source(data_source, builder.scorer(name, key)?);
        }
        for (prefix, name) in VERL_DATA_SOURCE_PREFIXES {
            reward = reward.with_prefix(prefix, builder.scorer(name, "reward (built-in VeRL table)")?);
        }
        if let Some(name) = &self.default {
            reward = reward.with_default(builder.scorer(name, "reward.default")?);
        }
        Ok(reward)
    }

    /// `custom_reward_function`, loaded once here to report a missing file, an import error or a
    /// missing function before the run starts. It scores every data source, as in VeRL.
    fn custom_function(&self, custom: &CustomRewardFunction) -> Result<Arc<dyn Scorer>, ConfigError> {
        let key = |field: &str| format!("reward.custom_reward_function.{field}");
        if !self.data_sources.is_empty() || self.default.is_some() {
            return Err(invalid(
                "reward.custom_reward_function",
                "scores every data source (as VeRL's does), so `reward.data_sources` and \
                 `reward.default` must stay empty with it; dispatch on `data_source` inside the \
                 function instead",
            ));
        }
        if custom.workers == 0 {
            return Err(invalid(&key("workers"), "must be at least 1"));
        }
        let timeout = seconds(&key("timeout_s"), custom.timeout_s)?;
        VerlFunctionScorer::check(&custom.path, &custom.name, custom.reward_manager)
            .map_err(|message| invalid(&key("path"), &message))?;
        let kwargs = serde_json::Value::Object(custom.reward_kwargs.clone().into_iter().collect());
        Ok(Arc::new(VerlFunctionScorer::new(
            "custom_reward_function",
            &custom.path,
            &custom.name,
            &kwargs,
            custom.reward_manager,
            custom.workers,
            timeout,
        )))
    }
}

fn invalid(key: &str, message: &str) -> ConfigError {
    ConfigError::InvalidValue {
        key: key.to_string(),
        message: message.to_string(),
    }
}

fn seconds(key: &str, value: f64) -> Result<Duration, ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(invalid(
            key,
            &format!("must be a positive number of seconds, got {value}"),
        ))
    }
}

struct Builder<'a> {
    config: &'a RewardConfig,
    models: &'a dyn ModelScorers,
    built: HashMap<String, Arc<dyn Scorer>>,
    in_progress: Vec<String>,
}

impl Builder<'_> {
    fn scorer(&mut self, name: &str, key: &str) -> Result<Arc<dyn Scorer>, ConfigError> {
        if let Some(scorer) = self.built.get(name) {
            return Ok(scorer.clone());
        }
        if let Some(position) = self.in_progress.iter().position(|entry| entry == name) {
            let mut chain = self.in_progress[position..].to_vec();
            chain.push(name.to_string());
            return Err(ConfigError::ScorerCycle {
                chain: chain.join(" -> "),
            });
        }
        self.in_progress.push(name.to_string());
        let scorer = match self.config.scorers.get(name) {
            Some(spec) => self.build_spec(name, spec),
            None => built_in(name).ok_or_else(|| self.unknown(name, key)),
        };
        self.in_progress.pop();
        let scorer = scorer?;
        self.built.insert(name.to_string(), scorer.clone());
        Ok(scorer)
    }

    fn unknown(&self, name: &str, key: &str) -> ConfigError {
        let mut known: Vec<String> = BUILT_IN_SCORERS.iter().map(|s| s.to_string()).collect();
        known.extend(
            self.config
                .scorers
                .keys()
                .filter(|k| !BUILT_IN_SCORERS.contains(&k.as_str()))
                .cloned(),
        );
        let closest = known
            .iter()
            .map(|candidate| (strsim::damerau_levenshtein(name, candidate), candidate))
            .filter(|(distance, _)| *distance <= 3)
            .min();
        ConfigError::UnknownScorer {
            key: key.to_string(),
            name: name.to_string(),
            suggestion: closest
                .map(|(_, candidate)| format!(", did you mean `{candidate}`?"))
                .unwrap_or_default(),
            known: known.join(", "),
        }
    }

    fn build_spec(&mut self, name: &str, spec: &ScorerSpec) -> Result<Arc<dyn Scorer>, ConfigError> {
        let key = |field: &str| format!("reward.scorers.{name}.{field}");
        let scorer: Arc<dyn Scorer> = match spec {
            ScorerSpec::Gsm8k {
                method,
                format_score,
                score,
            } => {
                let mut scorer = Gsm8kScorer::new(name, *method);
                scorer.format_score = *format_score;
                scorer.score = *score;
                Arc::new(scorer)
            }
            ScorerSpec::Math {} => Arc::new(MathScorer::new(name)),
            ScorerSpec::MathDapo {} => Arc::new(MathDapoScorer::new(name)),
            ScorerSpec::TurnScores { reduce } => {
                Arc::new(crate::turn_scores::TurnScoresScorer::new(name, *reduce))
            }
            ScorerSpec::Arithmetic { format_score, score } => Arc::new(ArithmeticScorer {
                format_score: *format_score,
                score: *score,
            }),
            ScorerSpec::FormatRegex {
                pattern,
                full_match,
                score,
            } => Arc::new(
                RegexFormatScorer::new(name, pattern, *full_match, *score).map_err(|error| {
                    invalid(
                        &key("pattern"),
                        &format!("is not a valid regular expression: {error}"),
                    )
                })?,
            ),
            ScorerSpec::FormatTags { tags, score } => {
                let bad_tag = tags.iter().find(|tag| {
                    tag.is_empty() || tag.contains(['<', '>', '/']) || tag.contains(char::is_whitespace)
                });
                if tags.is_empty() || bad_tag.is_some() {
                    return Err(invalid(
                        &key("tags"),
                        "must be a non-empty list of tag names without `<`, `>`, `/` or spaces",
                    ));
                }
                Arc::new(
                    TagFormatScorer::new(name, tags, *score)
                        .map_err(|error| invalid(&key("tags"), &format!("cannot be compiled: {error}")))?,
                )
            }
            ScorerSpec::Weighted { parts } => {
                if parts.is_empty() {
                    return Err(invalid(
                        &key("parts"),
                        "must list at least one `{scorer, weight}`",
                    ));
                }
                let mut built = Vec::with_capacity(parts.len());
                for (index, part) in parts.iter().enumerate() {
                    if !part.weight.is_finite() {
                        return Err(invalid(
                            &key(&format!("parts[{index}].weight")),
                            "must be a finite number",
                        ));
                    }
                    let scorer = self.scorer(&part.scorer, &key(&format!("parts[{index}].scorer")))?;
                    built.push(WeightedPart {
                        scorer,
                        weight: part.weight,
                    });
                }
                Arc::new(WeightedScorer::new(name, built))
            }
            ScorerSpec::Command {
                command,
                timeout_s,
                max_in_flight,
            } => {
                if command.is_empty() || command[0].is_empty() {
                    return Err(invalid(
                        &key("command"),
                        "must list the executable and its arguments, e.g. [python3, score.py]",
                    ));
                }
                check_in_flight(&key("max_in_flight"), *max_in_flight)?;
                let timeout = self.external_timeout(&key("timeout_s"), *timeout_s)?;
                Arc::new(CommandScorer::new(name, command.clone(), timeout, *max_in_flight))
            }
            ScorerSpec::RewardModel(spec) => {
                if spec.max_length == 0 {
                    return Err(invalid(&key("max_length"), "must be at least 1 token"));
                }
                if spec.micro_batch_size == 0 {
                    return Err(invalid(&key("micro_batch_size"), "must be at least 1"));
                }
                self.models
                    .reward_model(name, spec)
                    .map_err(|e| invalid(&key(&e.field), &e.message))?
            }
            ScorerSpec::Judge(spec) => {
                if spec.max_length == 0 {
                    return Err(invalid(&key("max_length"), "must be at least 1 token"));
                }
                if spec.micro_batch_size == 0 {
                    return Err(invalid(&key("micro_batch_size"), "must be at least 1"));
                }
                match &spec.verdict {
                    Verdict::Probability { yes, no } => {
                        if yes.is_empty() || yes == no {
                            return Err(invalid(
                                &key("verdict"),
                                "`yes` and `no` must be two different, non-empty answers",
                            ));
                        }
                    }
                    Verdict::Parse {
                        pattern,
                        max_new_tokens,
                        scale,
                    } => {
                        let groups = regex::Regex::new(pattern)
                            .map_err(|e| {
                                invalid(
                                    &key("verdict.pattern"),
                                    &format!("is not a valid regular expression: {e}"),
                                )
                            })?
                            .captures_len();
                        if groups < 2 {
                            return Err(invalid(
                                &key("verdict.pattern"),
                                "needs a capture group around the number, e.g. 'Score: (\\d+)'",
                            ));
                        }
                        if *max_new_tokens == 0 {
                            return Err(invalid(&key("verdict.max_new_tokens"), "must be at least 1"));
                        }
                        if !scale.is_finite() {
                            return Err(invalid(&key("verdict.scale"), "must be a finite number"));
                        }
                    }
                }
                self.models
                    .judge(name, spec)
                    .map_err(|e| invalid(&key(&e.field), &e.message))?
            }
            ScorerSpec::Http {
                url,
                timeout_s,
                max_in_flight,
            } => {
                if !url.starts_with("http://") {
                    return Err(invalid(
                        &key("url"),
                        &format!("must start with `http://` (got {url:?}); https is not built in, put a local proxy in front"),
                    ));
                }
                check_in_flight(&key("max_in_flight"), *max_in_flight)?;
                let timeout = self.external_timeout(&key("timeout_s"), *timeout_s)?;
                Arc::new(HttpScorer::new(name, url, timeout, *max_in_flight))
            }
        };
        Ok(scorer)
    }
}

impl Builder<'_> {
    /// An external scorer's time limit; warns when the pool's own limit would cut it short.
    fn external_timeout(&self, key: &str, timeout_s: f64) -> Result<Duration, ConfigError> {
        let timeout = seconds(key, timeout_s)?;
        if timeout_s > self.config.time_limit_s {
            tracing::warn!(
                "`{key}` ({timeout_s} s) is longer than `reward.time_limit_s` ({} s): the pool's limit \
                 will fire first; raise `reward.time_limit_s`",
                self.config.time_limit_s
            );
        }
        Ok(timeout)
    }
}

fn check_in_flight(key: &str, value: usize) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(invalid(key, "must be at least 1"));
    }
    Ok(())
}

/// The built-in scorer called `name`, with its default parameters.
pub fn built_in(name: &str) -> Option<Arc<dyn Scorer>> {
    Some(match name {
        "gsm8k" => Arc::new(Gsm8kScorer::new(name, Gsm8kMethod::Strict)),
        "gsm8k_flexible" => Arc::new(Gsm8kScorer::new(name, Gsm8kMethod::Flexible)),
        "math" => Arc::new(MathScorer::new(name)),
        "math_dapo" => Arc::new(MathDapoScorer::new(name)),
        "arithmetic" => Arc::new(ArithmeticScorer::default()),
        "format_think_answer" => {
            Arc::new(TagFormatScorer::new(name, &default_tags(), 1.0).expect("built-in tag pattern compiles"))
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::Sample;

    fn parse(yaml: &str) -> Result<RewardConfig, serde_yaml::Error> {
        serde_yaml::from_str(yaml)
    }

    /// A `reward_model` scorer's keys and defaults; built by the caller's [`ModelScorers`]
    /// (here one that records what it was asked), refused without one, its limits checked first.
    #[test]
    fn reward_model_scorers_are_built_by_the_caller() {
        let c = parse(
            "scorers:\n  rm: {kind: reward_model, path: /models/rm}\n  \
             both: {kind: weighted, parts: [{scorer: rm, weight: 1.0}, {scorer: gsm8k, weight: 0.5}]}\n\
             default: both\n",
        )
        .unwrap();
        assert_eq!(
            c.scorers["rm"],
            ScorerSpec::RewardModel(RewardModelSpec {
                path: "/models/rm".into(),
                max_length: 4096,
                truncation: RmTruncation::Right,
                micro_batch_size: 8,
                dtype: ModelDType::Auto,
            })
        );
        let e = c.build(None).err().unwrap().to_string();
        assert!(
            e.starts_with("`reward.scorers.rm.path`: a reward model needs a device"),
            "{e}"
        );
        struct Constant(std::sync::Mutex<Vec<String>>);
        impl ModelScorers for Constant {
            fn reward_model(
                &self,
                name: &str,
                spec: &RewardModelSpec,
            ) -> Result<Arc<dyn Scorer>, ModelScorerError> {
                self.0.lock().unwrap().push(format!("{name} {}", spec.path));
                Ok(Arc::new(crate::scorer::FnScorer::new(name, |_: &Sample| {
                    Ok(crate::scorer::Score::new(-2.0))
                })))
            }

            fn judge(&self, name: &str, spec: &JudgeSpec) -> Result<Arc<dyn Scorer>, ModelScorerError> {
                self.0.lock().unwrap().push(format!("{name} {}", spec.path));
                Ok(Arc::new(crate::scorer::FnScorer::new(name, |_: &Sample| {
                    Ok(crate::scorer::Score::new(0.5))
                })))
            }
        }
        let models = Constant(Default::default());
        let reward = c.build_with(None, &models).unwrap();
        assert_eq!(
            *models.0.lock().unwrap(),
            vec!["rm /models/rm".to_string()],
            "built once"
        );
        let s = reward.score(&sample("anything", "#### 3", "3", 2)).unwrap();
        assert_eq!((s.value, s.extras["rm"], s.extras["gsm8k"]), (-1.5, -2.0, 1.0));
        for (yaml, message) in [
            (
                "max_length: 0",
                "`reward.scorers.rm.max_length`: must be at least 1 token",
            ),
            (
                "micro_batch_size: 0",
                "`reward.scorers.rm.micro_batch_size`: must be at least 1",
            ),
        ] {
            let c = parse(&format!(
                "scorers:\n  rm: {{kind: reward_model, path: x, {yaml}}}\n"
            ))
            .unwrap();
            assert_eq!(c.build_with(None, &models).err().unwrap().to_string(), message);
        }
        assert!(parse("scorers:\n  rm: {kind: reward_model, path: x, truncation: middle}\n").is_err());
        let judge = |verdict: &str| {
            parse(&format!(
                "scorers:\n  j: {{kind: judge, path: /models/j, instruction: 'Grade {{{{ response }}}}', verdict: {verdict}}}\n"
            ))
            .unwrap()
        };
        let c = judge("{kind: probability, yes: 'Yes', no: 'No'}");
        let ScorerSpec::Judge(spec) = &c.scorers["j"] else {
            panic!("{:?}", c.scorers["j"])
        };
        assert_eq!(
            (spec.max_length, spec.micro_batch_size, spec.system.clone()),
            (4096, 8, None)
        );
        assert_eq!(
            c.build(None).err().unwrap().to_string(),
            "`reward.scorers.j.path`: a judge needs a device, which only `grpo run` and `grpo worker` open"
        );
        c.build_with(None, &models).unwrap();
        let c = judge("{kind: parse, pattern: 'Score: (\\d+)'}");
        let ScorerSpec::Judge(spec) = &c.scorers["j"] else {
            unreachable!()
        };
        assert_eq!(
            spec.verdict,
            Verdict::Parse {
                pattern: "Score: (\\d+)".into(),
                max_new_tokens: 256,
                scale: 1.0
            }
        );
        for (verdict, message) in [
            (
                "{kind: probability, yes: 'A', no: 'A'}",
                "`reward.scorers.j.verdict`: `yes` and `no` must be two different",
            ),
            (
                "{kind: parse, pattern: 'Score: \\d+'}",
                "`reward.scorers.j.verdict.pattern`: needs a capture group",
            ),
            (
                "{kind: parse, pattern: '(', max_new_tokens: 3}",
                "`reward.scorers.j.verdict.pattern`: is not a valid regular expression",
            ),
            (
                "{kind: parse, pattern: '(\\d)', max_new_tokens: 0}",
                "`reward.scorers.j.verdict.max_new_tokens`: must be at least 1",
            ),
        ] {
            let e = judge(verdict)
                .build_with(None, &models)
                .err()
                .unwrap()
                .to_string();
            assert!(e.starts_with(message), "{verdict}: {e}");
        }
    }

    fn sample(data_source: &str, response: &str, truth: &str, length: usize) -> Sample {
        Sample {
            id: 1,
            data_source: data_source.into(),
            prompt: serde_json::Value::Null,
            response: response.into(),
            ground_truth: truth.into(),
            extra: serde_json::Value::Null,
            response_length: length,
            truncated: false,
        }
    }

    #[test]
    fn full_section_builds_and_scores() {
        let config = parse(
            r#"
default: gsm8k_flexible
data_sources:
  openai/gsm8k: combo
scorers:
  strict_half: {kind: gsm8k, format_score: 0.5}
  combo:
    kind: weighted
    parts: [{scorer: strict_half, weight: 0.9}, {scorer: format_think_answer, weight: 0.1}]
overlong_buffer: {enable: true, len: 10, penalty_factor: 2.0, log: true}
num_workers: 2
time_limit_s: 1.5
"#,
        )
        .unwrap();
        let reward = config.build(Some(100)).unwrap();
        let score = reward
            .score(&sample(
                "openai/gsm8k",
                "<think>x</think><answer>#### 4</answer>",
                "5",
                95,
            ))
            .unwrap();
        // 0.9 * 0.5 (format score) + 0.1 * 1 (tags) - 2 * 5/10 (overlong)
        assert!((score.value - (0.45 + 0.1 - 1.0)).abs() < 1e-12, "{score:?}");
        assert_eq!(score.extras["strict_half/format"], 1.0);
        let other = reward.score(&sample("my/dataset", "it is 12", "12", 10)).unwrap();
        assert_eq!(other.value, 1.0);
        let math = reward
            .score(&sample(
                "HuggingFaceH4/MATH-500",
                "\\boxed{\\dfrac{1}{2}}",
                "\\frac12",
                10,
            ))
            .unwrap();
        assert_eq!(math.value, 1.0);
        let options = config.pool_options().unwrap();
        assert_eq!(
            (options.num_workers, options.time_limit),
            (2, Duration::from_millis(1500))
        );
    }

    /// `scorer` scores every sample, VeRL's data sources and their prefixes too.
    #[test]
    fn one_scorer_for_every_sample() {
        let config = parse("scorer: arithmetic\n").unwrap();
        let reward = config.build(Some(100)).unwrap();
        for source in ["openai/gsm8k", "aime2024", "my/dataset"] {
            let score = reward.score(&sample(source, "12", "12", 3)).unwrap();
            assert_eq!(score.value, 1.0, "{source}");
        }
        // gsm8k's scorer would have wanted `#### 12`.
        let gsm8k = parse("{}").unwrap().build(Some(100)).unwrap();
        assert_eq!(
            gsm8k.score(&sample("openai/gsm8k", "12", "12", 3)).unwrap().value,
            0.0
        );
        for clash in [
            "scorer: arithmetic\ndefault: gsm8k\n",
            "scorer: arithmetic\ndata_sources: {a: gsm8k}\n",
        ] {
            let Err(err) = parse(clash).unwrap().build(Some(100)) else {
                panic!("{clash}: accepted")
            };
            let err = err.to_string();
            assert!(
                err.contains("reward.scorer") && err.contains("must stay empty"),
                "{err}"
            );
        }
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let error = parse("num_worker: 3").unwrap_err().to_string();
        assert!(error.contains("unknown field `num_worker`"), "{error}");
        let error = parse("scorers: {a: {kind: gsm8k, methd: strict}}")
            .unwrap_err()
            .to_string();
        assert!(error.contains("unknown field `methd`"), "{error}");
        let error = parse("scorers: {a: {kind: math, extra: 1}}")
            .unwrap_err()
            .to_string();
        assert!(error.contains("unknown field `extra`"), "{error}");
        let error = parse("scorers: {a: {kind: gsm9k}}").unwrap_err().to_string();
        assert!(error.contains("unknown variant `gsm9k`"), "{error}");
        let error = parse("overlong_buffer: {enable: true, length: 3}")
            .unwrap_err()
            .to_string();
        assert!(error.contains("unknown field `length`"), "{error}");
    }

    #[test]
    fn build_errors_name_the_key_and_the_fix() {
        let cases = [
            ("data_sources: {openai/gsm8k: gms8k}", "`reward.data_sources.openai/gsm8k` names the scorer `gms8k`, which is not defined, did you mean `gsm8k`?"),
            ("scorers: {a: {kind: weighted, parts: [{scorer: b, weight: 1}]}, b: {kind: weighted, parts: [{scorer: a, weight: 1}]}}", "loop: a -> b -> a"),
            ("scorers: {a: {kind: format_regex, pattern: '('}}", "`reward.scorers.a.pattern`: is not a valid regular expression"),
            ("scorers: {a: {kind: command, command: []}}", "`reward.scorers.a.command`: must list the executable"),
            ("scorers: {a: {kind: http, url: 'https://x'}}", "`reward.scorers.a.url`: must start with `http://`"),
            ("scorers: {a: {kind: http, url: 'http://x', timeout_s: 0}}", "`reward.scorers.a.timeout_s`: must be a positive number of seconds, got 0"),
            ("overlong_buffer: {enable: true, len: 4}", "`reward.overlong_buffer.max_response_length`: is needed"),
            ("overlong_buffer: {enable: true}", "`reward.overlong_buffer.len`: must be at least 1"),
        ];
        for (yaml, expected) in cases {
            let error = parse(yaml)
                .unwrap()
                .build(None)
                .err()
                .unwrap_or_else(|| panic!("{yaml} built"))
                .to_string();
            assert!(error.contains(expected), "{yaml}: {error}");
        }
        let error = RewardConfig {
            num_workers: 0,
            ..RewardConfig::default()
        }
        .pool_options()
        .unwrap_err();
        assert_eq!(error.to_string(), "`reward.num_workers`: must be at least 1");
    }

    #[test]
    fn defaults_follow_verl() {
        let config = parse("{}").unwrap();
        assert_eq!(config, RewardConfig::default());
        let reward = config.build(None).unwrap();
        assert!(reward.scorer_for("openai/gsm8k").is_some());
        assert!(reward.scorer_for("aime_2025").is_some());
        assert!(reward.scorer_for("grpo/arithmetic").is_some());
        assert!(reward.scorer_for("some/other").is_none());
        let spec: ScorerSpec = serde_yaml::from_str("{kind: command, command: [python3, s.py]}").unwrap();
        assert_eq!(
            spec,
            ScorerSpec::Command {
                command: vec!["python3".into(), "s.py".into()],
                timeout_s: 30.0,
                max_in_flight: 8
            }
        );
    }
}
