//! Everything a run sets up before its first step, from the recipe: the model on the host
//! (config, weights, tokenizer, chat template), the datasets opened with that tokenizer, and
//! the reward function checked against the datasets' data sources. Any mistake here stops the
//! run before a program is compiled.

use crate::recipe::Recipe;
use data::{Prompt, PromptDataset, PromptTokenizer, Split, TokenizeError};
use model::programs::HostModel;
use model::{ChatMessage, ChatTemplate, ModelTokenizer};
use reward::RewardFunction;
use rollout::{Engine, TurnHandler};
use std::path::Path;
use std::sync::Arc;
use xla::runtime::Client;

/// What preparing a run can stop on.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("model.path {path}: {message}")]
    Model { path: String, message: String },
    #[error("model.tokenizer {path}: {message}")]
    Tokenizer { path: String, message: String },
    #[error("model.chat_template {path}: {message}")]
    ChatTemplate { path: String, message: String },
    #[error("data.apply_chat_template_kwargs: {message}")]
    ChatTemplateKwargs { message: String },
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error("reward: {0}")]
    Reward(String),
    #[error("{0}")]
    MultiTurn(String),
    #[error("{0}")]
    ModelFeature(String),
}

/// Renders chat prompts with the model's template and tokenizes them, as rollout will.
pub struct ChatTokenizer {
    pub tokenizer: ModelTokenizer,
    pub template: Option<ChatTemplate>,
    /// The template's `tools` variable: the schemas of `rollout.multi_turn.tools`, which
    /// templates with tool support describe to the model in the prompt.
    pub tools: serde_json::Map<String, serde_json::Value>,
}

impl PromptTokenizer for ChatTokenizer {
    fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>, TokenizeError> {
        match prompt {
            // Plain-text prompts are used as they are, as TRL does.
            Prompt::Text(text) => Ok(self.tokenizer.encode(text, true)?),
            Prompt::Messages(messages) => {
                let template = self.template.as_ref().ok_or(
                    "the model has no chat template for these chat prompts: set `model.chat_template` \
                     to a Jinja template file, or use plain-text prompts",
                )?;
                let messages: Vec<ChatMessage> = messages
                    .iter()
                    .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
                    .collect();
                let messages = serde_json::to_value(messages).expect("messages serialise");
                let text = template.render_with(&messages, true, &self.tools)?;
                // The template writes the special tokens itself.
                Ok(self.tokenizer.encode(&text, false)?)
            }
        }
    }
}

/// The run's chat template: `model.chat_template`'s file (with the special tokens of the
/// model's own template), else the model's own; with `data.apply_chat_template_kwargs` passed to
/// every render.
fn chat_template(recipe: &Recipe, own: Option<ChatTemplate>) -> Result<Option<ChatTemplate>, PrepareError> {
    let template = match &recipe.model.chat_template {
        None => own,
        Some(p) => {
            let err = |message: String| PrepareError::ChatTemplate {
                path: p.clone(),
                message,
            };
            let source = std::fs::read_to_string(p).map_err(|e| err(e.to_string()))?;
            let token = |f: fn(&ChatTemplate) -> &Option<String>| own.as_ref().and_then(|t| f(t).clone());
            Some(
                ChatTemplate::new(
                    &source,
                    p,
                    token(|t| &t.bos_token),
                    token(|t| &t.eos_token),
                    token(|t| &t.pad_token),
                )
                .map_err(|e| err(e.to_string()))?,
            )
        }
    };
    let kwargs = &recipe.data.apply_chat_template_kwargs;
    match template {
        Some(t) if !kwargs.is_empty() => {
            t.with_variables(kwargs.clone())
                .map(Some)
                .map_err(|e| PrepareError::ChatTemplateKwargs {
                    message: e.to_string(),
                })
        }
        None if !kwargs.is_empty() => Err(PrepareError::ChatTemplateKwargs {
            message: "the model has no chat template to pass them to; set `model.chat_template` \
                      to a Jinja template file that reads them"
                .into(),
        }),
        t => Ok(t),
    }
}

/// The recipe's model-side settings that this model's architecture cannot honour: a LoRA target
/// no layer has (PEFT refuses it alike), a router setting without experts, and one scanned
/// layer body over layers that differ.
fn check_model_features(recipe: &Recipe, config: &model::ModelConfig) -> Result<(), String> {
    if let Some(lora) = recipe.actor.lora() {
        let table = model::lora::lora_table(config, &lora);
        if let Some(t) = lora
            .targets
            .iter()
            .find(|t| !table.iter().any(|s| s.target == **t))
        {
            return Err(if t.is_experts() {
                format!(
                    "actor.target_parameters: `{}` names no parameter of this {} model: it has no \
                     mixture-of-experts layer; adapt its projections with actor.target_modules",
                    t.module(),
                    config.family
                )
            } else {
                format!(
                    "actor.target_modules: `{}` names no module of this {} model: its mixture-of-experts \
                     layers keep their experts as stacked tensors, not linear modules; adapt them with \
                     actor.target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]",
                    t.module(),
                    config.family
                )
            });
        }
    }
    if config.moe.is_none() {
        // The settings only a mixture of experts reads, each as set and what it does.
        let a = &recipe.actor;
        let moe_only = [
            (
                a.router_aux_loss_coef != 0.0,
                format!("actor.router_aux_loss_coef: {}", a.router_aux_loss_coef),
                "weighs a mixture-of-experts model's load-balancing loss",
            ),
            (
                a.router_replay.mode != trainer::config::RouterReplay::Disabled,
                format!("actor.router_replay.mode: {:?}", a.router_replay.mode),
                "replays a mixture-of-experts model's expert choices",
            ),
            (
                recipe.model.moe_dispatch != crate::recipe::MoeDispatch::Dense,
                "model.moe_dispatch: grouped".to_string(),
                "dispatches a mixture-of-experts model's tokens to its experts",
            ),
            (
                recipe.rollout.enable_rollout_routing_replay == Some(true),
                "rollout.enable_rollout_routing_replay: true".to_string(),
                "records a mixture-of-experts model's expert choices",
            ),
        ];
        if let Some((_, setting, what)) = moe_only.into_iter().find(|(set, ..)| *set) {
            return Err(format!(
                "{setting} {what}, and this {} model has no experts; remove it",
                config.family
            ));
        }
    }
    if let Some(moe) = config.moe.as_ref() {
        if recipe.rollout.records_routes(&recipe.actor) && moe.num_experts > rollout::MAX_RECORDED_EXPERTS {
            return Err(format!(
                "rollout.enable_rollout_routing_replay: routes are recorded one byte per expert id, \
                 and this model has {} experts (at most {}); turn routing replay off",
                moe.num_experts,
                rollout::MAX_RECORDED_EXPERTS
            ));
        }
    }
    let moe_layers = config.moe_layers();
    if recipe.model.scan_layers && moe_layers > 0 && moe_layers < config.num_hidden_layers {
        return Err(format!(
            "model.scan_layers: {moe_layers} of this model's {} layers are mixtures of experts and the \
                 rest dense (mlp_only_layers / decoder_sparse_step), so no one scanned layer body runs them \
                 all; set model.scan_layers: false",
            config.num_hidden_layers
        ));
    }
    Ok(())
}

/// A run, ready for its first step.
pub struct Prepared {
    /// The model; its chat template has moved into `tokenizer`.
    pub model: HostModel,
    pub tokenizer: ChatTokenizer,
    /// Token ids that end a response: the model's EOS ids and its chat template's end token.
    pub stop_token_ids: Vec<u32>,
    pub train: PromptDataset,
    pub validation: Option<PromptDataset>,
    pub reward: RewardFunction,
    /// What answers the model's turns with `rollout.multi_turn`.
    pub environment: Option<Arc<dyn TurnHandler>>,
}

impl Prepared {
    /// The rollout engine of this run over `weights` (in `rollout.dtype`) at `version`.
    /// Weights on each of devices `0..N` (an in-process rollout colocated with a `dp`/`fsdp`
    /// learner over `N` devices, see [`rollout::handoff`], or a tensor-parallel engine) make an
    /// engine split over those devices: `N / rollout.tensor_model_parallel_size` slot groups
    /// (which must divide `rollout.max_num_seqs`) of that many tensor-parallel devices.
    pub fn rollout_engine(
        &self,
        recipe: &Recipe,
        client: &Client,
        weights: impl Into<rollout::EngineWeights>,
        version: u64,
    ) -> rollout::Result<Engine> {
        Engine::new(
            client,
            &self.model.weights.config,
            weights,
            version,
            crate::setup::engine_config(recipe, &self.stop_token_ids),
            Some(self.tokenizer.tokenizer.clone()),
        )
    }

    /// Uploads the model's weights in `rollout.dtype` for a rollout engine of its own (a
    /// rollout worker): on device 0, or split over devices `0..tp` with tensor parallelism.
    pub fn upload_rollout_weights(
        &self,
        recipe: &Recipe,
        client: &Client,
    ) -> rollout::Result<rollout::EngineWeights> {
        let tp = recipe.rollout.tensor_model_parallel_size.max(1);
        let devices: Vec<usize> = (0..tp).collect();
        rollout::upload_weights_on(
            client,
            &self.model.weights,
            crate::setup::rollout_dtype(recipe),
            &devices,
            tp,
        )
    }
}

/// The model of `model.path` (with `model.random_init` its weights drawn afresh from
/// `trainer.seed`), checked for the features the recipe needs, and its tokenizer:
/// `model.tokenizer`'s, or the model's own, checked to fit the model's vocabulary.
pub fn load_model(recipe: &Recipe) -> Result<(HostModel, ModelTokenizer), PrepareError> {
    let path = Path::new(&recipe.model.path);
    let mut model = HostModel::load(path).map_err(|e| PrepareError::Model {
        path: recipe.model.path.clone(),
        message: e.to_string(),
    })?;
    if recipe.model.random_init {
        model.weights = model::random_init(&model.weights.config, recipe.trainer.seed);
    }
    check_model_features(recipe, &model.weights.config).map_err(PrepareError::ModelFeature)?;
    let tokenizer = match &recipe.model.tokenizer {
        None => model.tokenizer.clone(),
        Some(p) => {
            let file = if Path::new(p).is_dir() {
                Path::new(p).join("tokenizer.json")
            } else {
                p.into()
            };
            ModelTokenizer::from_file(&file).map_err(|e| PrepareError::Tokenizer {
                path: p.clone(),
                message: e.to_string(),
            })?
        }
    };
    tokenizer
        .check_fits(&model.weights.config)
        .map_err(|e| PrepareError::Tokenizer {
            path: recipe
                .model
                .tokenizer
                .clone()
                .unwrap_or_else(|| recipe.model.path.clone()),
            message: e.to_string(),
        })?;
    Ok((model, tokenizer))
}

/// Load the model, open the datasets, build and check the reward function.
pub fn prepare(recipe: &Recipe) -> Result<Prepared, PrepareError> {
    let (mut model, tokenizer) = load_model(recipe)?;
    let stop_token_ids = model.stop_tokens();
    // The template moves into the tokenizer that renders prompts with it.
    let template = chat_template(recipe, model.chat_template.take())?;
    let mut tools = serde_json::Map::new();
    let environment =
        crate::setup::environment(recipe, &tokenizer, template.as_ref()).map_err(PrepareError::MultiTurn)?;
    if let Some(env) = environment.as_ref().filter(|e| !e.schemas.is_empty()) {
        tools.insert(
            "tools".into(),
            env.schemas.iter().map(agent::ToolSchema::to_json).collect(),
        );
    }
    let tokenizer = ChatTokenizer {
        tokenizer,
        template,
        tools,
    };
    let train = PromptDataset::open(&recipe.data, Split::Train, Some(&tokenizer))?;
    let validation = if recipe.data.val_files.0.is_empty() {
        None
    } else {
        Some(PromptDataset::open(
            &recipe.data,
            Split::Validation,
            Some(&tokenizer),
        )?)
    };
    let scores_here = recipe.cluster.worker_count(crate::roles::Role::Reward) == 0;
    let reward = crate::setup::reward_function(recipe, scores_here)
        .map_err(|e| PrepareError::Reward(e.to_string()))?;
    Ok(Prepared {
        model,
        tokenizer,
        stop_token_ids,
        train,
        validation,
        reward,
        environment: environment.map(|env| env.handler),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3's template, with `enable_thinking: false` from the recipe, renders the empty
    /// thinking block after the generation prompt; a variable the template does not read, or
    /// kwargs without a template, are refused.
    #[test]
    fn chat_template_kwargs_reach_every_render() {
        let qwen3 =
            ChatTemplate::from_tokenizer_config(&testkit::asset("qwen3/tokenizer_config.json")).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("qwen3.jinja");
        std::fs::write(&file, qwen3.source()).unwrap();
        let recipe = |kwargs: &str| {
            crate::recipe::load_recipe_str(
                &format!(
                    "model:\n  path: m\n  chat_template: {}\ndata:\n  train_files: t.parquet\n  \
                     apply_chat_template_kwargs: {kwargs}\n",
                    file.display()
                ),
                "r.yaml",
            )
            .unwrap()
        };
        let messages = serde_json::json!([{"role": "user", "content": "2+2?"}]);
        let render = |r: &Recipe| {
            chat_template(r, None)
                .unwrap()
                .unwrap()
                .render_with(&messages, true, &serde_json::Map::new())
                .unwrap()
        };
        let thinking = render(&recipe("{}"));
        let not = render(&recipe("{enable_thinking: false}"));
        assert!(!thinking.contains("<think>"), "{thinking}");
        assert!(
            not.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
            "{not}"
        );
        let err = chat_template(&recipe("{enable_thinkin: false}"), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("data.apply_chat_template_kwargs: ")
                && err.contains("does not read the variable `enable_thinkin`")
                && err.contains("`enable_thinking`"),
            "{err}"
        );
        let mut bare = recipe("{enable_thinking: false}");
        bare.model.chat_template = None;
        let err = chat_template(&bare, None).unwrap_err().to_string();
        assert!(err.contains("the model has no chat template"), "{err}");
    }

    /// `model.random_init` replaces the checkpoint's weights by ones drawn from `trainer.seed`;
    /// `model.tokenizer` replaces the model's tokenizer.
    #[test]
    fn the_model_and_its_tokenizer_are_loaded_as_the_recipe_says() {
        let dir = tempfile::tempdir().unwrap();
        let path = testkit::tiny_chat_model(dir.path());
        let recipe = |model: &str, trainer: &str| {
            crate::recipe::load_recipe_str(
                &format!(
                    "model:\n  path: {}\n{model}data:\n  train_files: t.parquet\ntrainer:\n  seed: {trainer}\n",
                    path.display()
                ),
                "r.yaml",
            )
            .unwrap()
        };
        let weights = |r: &Recipe| -> Vec<Vec<u8>> {
            let (model, _) = load_model(r).unwrap();
            model.weights.tensors.into_iter().map(|t| t.bytes).collect()
        };
        let saved = weights(&recipe("", "1"));
        let drawn = weights(&recipe("  random_init: true\n", "1"));
        assert_ne!(drawn, saved);
        assert_eq!(weights(&recipe("  random_init: true\n", "1")), drawn);
        assert_ne!(weights(&recipe("  random_init: true\n", "2")), drawn);

        // The same tokenizer lowercasing its input: it encodes "HELLO" as the model's does "hello".
        let own = dir.path().join("tokenizer-files-tiny-smollm2/tokenizer.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&own).unwrap()).unwrap();
        json["normalizer"] = serde_json::json!({"type": "Lowercase"});
        let other = dir.path().join("other-tokenizer.json");
        std::fs::write(&other, json.to_string()).unwrap();
        let encode = |r: &Recipe, text: &str| load_model(r).unwrap().1.encode(text, false).unwrap();
        let with = recipe(&format!("  tokenizer: {}\n", other.display()), "1");
        let lower = encode(&recipe("", "1"), "hello");
        assert_ne!(encode(&recipe("", "1"), "HELLO"), lower);
        assert_eq!(encode(&with, "HELLO"), lower);
    }
}

#[cfg(test)]
mod model_feature_tests {
    use super::*;

    fn recipe(extra: &str) -> Recipe {
        crate::recipe::load_recipe_str(
            &format!("model:\n  path: m\ndata:\n  train_files: t.parquet\n{extra}"),
            "r.yaml",
        )
        .unwrap()
    }

    fn fixture(name: &str) -> model::ModelConfig {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../model/fixtures/tiny")
            .join(name)
            .join("config.json");
        model::ModelConfig::from_hf_file(&path).unwrap()
    }

    /// What a dense model cannot honour is named with the key and what to do; the same keys
    /// pass on a mixture of experts, except one scanned body over mixed layers.
    #[test]
    fn router_settings_need_experts_and_scans_need_alike_layers() {
        let (dense, moe) = (fixture("qwen3"), fixture("qwen3_moe"));
        for (extra, key) in [
            (
                "actor:\n  router_replay:\n    mode: R3\n",
                "actor.router_replay.mode: R3",
            ),
            (
                "actor:\n  router_replay:\n    mode: R2\n",
                "actor.router_replay.mode: R2",
            ),
            (
                "rollout:\n  enable_rollout_routing_replay: true\n",
                "rollout.enable_rollout_routing_replay: true",
            ),
            (
                "actor:\n  router_aux_loss_coef: 0.01\n",
                "actor.router_aux_loss_coef: 0.01",
            ),
        ] {
            let e = check_model_features(&recipe(extra), &dense).unwrap_err();
            assert!(
                e.starts_with(key) && e.contains("has no experts; remove it"),
                "{e}"
            );
            check_model_features(&recipe(extra), &moe).unwrap();
        }
        let scanned = crate::recipe::load_recipe_str(
            "model:\n  path: m\n  scan_layers: true\ndata:\n  train_files: t.parquet\n",
            "r.yaml",
        )
        .unwrap();
        let e = check_model_features(&scanned, &moe);
        assert!(e.unwrap_err().contains("set model.scan_layers: false"));
        let grouped = crate::recipe::load_recipe_str(
            "model:\n  path: m\n  moe_dispatch: grouped\ndata:\n  train_files: t.parquet\n",
            "r.yaml",
        )
        .unwrap();
        check_model_features(&grouped, &moe).unwrap();
        let e = check_model_features(&grouped, &dense).unwrap_err();
        assert!(
            e.starts_with("model.moe_dispatch: grouped") && e.contains("no experts"),
            "{e}"
        );
    }

    /// LoRA targets must name something of the model, as PEFT requires: the experts on a model
    /// with experts, the MLP's modules on one with a dense MLP.
    #[test]
    fn lora_targets_name_what_the_model_has() {
        let (dense, moe) = (fixture("qwen3"), fixture("qwen3_moe"));
        let experts = recipe("actor:\n  lora_rank: 4\n  target_modules: [q_proj]\n  target_parameters: [mlp.experts.down_proj]\n");
        check_model_features(&experts, &moe).unwrap();
        let e = check_model_features(&experts, &dense).unwrap_err();
        assert!(
            e.starts_with("actor.target_parameters: `mlp.experts.down_proj` names no parameter")
                && e.contains("no mixture-of-experts layer"),
            "{e}"
        );
        // The fixture's layer 1 is dense, so its MLP names a module; not on an all-sparse model.
        let mlp = recipe("actor:\n  lora_rank: 4\n  target_modules: [up_proj]\n");
        check_model_features(&mlp, &moe).unwrap();
        let mut sparse = moe.clone();
        sparse.moe.as_mut().unwrap().mlp_only_layers.clear();
        let e = check_model_features(&mlp, &sparse).unwrap_err();
        assert!(
            e.contains("actor.target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]"),
            "{e}"
        );
    }
}
