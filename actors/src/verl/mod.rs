//! `grpo verl`: a VeRL command line (`python3 -m verl.trainer.main_ppo KEY=VALUE...`) made into a
//! grpo recipe.
//!
//! The config is built as VeRL builds it ([`compose`]: the defaults of the VeRL release the
//! command line follows and of its `model_engine` ([`version`]), a `--config-name` file or
//! VeRL's own config of that name, Hydra overrides ([`hydra`])), then every leaf is looked up in
//! one [`table`]: mapped keys go to their recipe keys (VeRL's defaults included, so an unset key
//! means what it means in VeRL), rules turn VeRL's per-GPU sizes and each engine's parallel
//! sizes ([`engine`]) into grpo's devices and micro-batches, keys with no effect here give a
//! note when set away from VeRL's default, and unsupported ones an error. The recipe is then
//! checked as any recipe is, and an error names the VeRL key behind it.
//!
//! The size rule is [`SIZE_RULE`].

mod compose;
mod engine;
mod hydra;
pub mod table;
pub mod version;

pub use hydra::{Op, Override};

use crate::recipe::{bare_message, set_path, validate, Recipe};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use table::How;

/// How VeRL's per-GPU sizes become grpo's devices and micro-batches (printed by `--keys`).
pub const SIZE_RULE: &str = "VeRL's devices are `trainer.nnodes` x `trainer.n_gpus_per_node` \
(one host: `nnodes` must be 1) of kind `trainer.device` (cuda, cpu or tpu). More than one device \
shards the learner over them (`actor.strategy: fsdp`, `actor.mesh`); on cpu the CPU client opens \
that many devices (`cluster.cpu_device_count`). The engine's tensor-parallel size (Megatron's \
`tensor_model_parallel_size`, TorchTitan's `tensor_parallel_size`) becomes \
`actor.tensor_model_parallel_size`, and the data devices are the devices over it. grpo neither \
pipelines nor splits a sequence over devices: pipeline stages and context / Ulysses sizes give \
their devices to FSDP instead (a note says so); expert-parallel sizes above 1 are refused (grpo \
does not split experts over devices yet). grpo's `actor.ppo_micro_batch_size` counts the sequences of one \
pass over all data devices, so it is VeRL's `ppo_micro_batch_size_per_gpu` x data devices, \
lowered to the largest per-device count that divides each data device's share of the \
mini-batch (`ppo_mini_batch_size` x `rollout.n` / data devices; a note says so). With \
`use_dynamic_bsz`, the per-device count is `ppo_max_token_len_per_gpu` / (`max_prompt_length` + \
`max_response_length`), the most whole sequences that token budget holds (grpo pads each \
micro-batch to length buckets instead of packing). `rollout.max_num_seqs` is capped at one \
step's sequences (`train_batch_size` x `rollout.n`).";

/// What `grpo verl` was given.
#[derive(Debug, Default, Clone)]
pub struct VerlInput {
    /// Hydra overrides, in order.
    pub overrides: Vec<String>,
    /// `--config-path`: the directory of `--config-name`.
    pub config_path: Option<PathBuf>,
    /// `--config-name`: a YAML file (without `.yaml`) composed over VeRL's defaults, or one
    /// of VeRL's own configs.
    pub config_name: Option<String>,
    /// `--verl-version`: the release whose config layout the command line follows; None
    /// detects it from the keys.
    pub verl_version: Option<String>,
}

/// The recipe a VeRL command line makes, and the notes about keys that change nothing here.
#[derive(Debug)]
pub struct Translation {
    pub recipe: Recipe,
    pub notes: Vec<String>,
    /// `trainer.device` was left at VeRL's default (`cuda`): on a machine without the CUDA
    /// plugin, `grpo verl` names `trainer.device=cpu` (or `tpu`) as the fix.
    pub device_is_verls_default: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum VerlError {
    #[error("{raw}: {message}")]
    BadOverride { raw: String, message: String },
    #[error(
        "{raw}: `{key}` is not a key of VeRL's config{layout} (VeRL's Hydra would refuse it too: \
         Key '{key}' is not in struct){}; a key VeRL reads without listing it is added with \
         `+{key}=...`",
        suggestion.as_ref().map(|s| format!("; did you mean `{s}`?")).unwrap_or_default()
    )]
    UnknownKey {
        raw: String,
        key: String,
        suggestion: Option<String>,
        /// ` as of RELEASES, model_engine=ENGINE`: the config it was checked against.
        layout: String,
    },
    #[error("{file}: {message}")]
    ConfigFile { file: String, message: String },
    #[error("`{key}` = {value}: {message}")]
    Interpolation {
        key: String,
        value: String,
        message: String,
    },
    #[error("{}", render_unsupported(.0))]
    Unsupported(Vec<(String, String)>),
    #[error("{origin}: {message}")]
    Value { origin: String, message: String },
    #[error("the recipe made from these VeRL keys breaks a rule:\n{}", .0.join("\n"))]
    Rules(Vec<String>),
}

fn render_unsupported(items: &[(String, String)]) -> String {
    let mut out = format!(
        "{} VeRL setting{} grpo cannot honour:",
        items.len(),
        if items.len() == 1 { "" } else { "s" }
    );
    for (what, why) in items {
        out.push_str(&format!("\n  {what}: not supported: {why}"));
    }
    out
}

/// The recipe key a mapped VeRL key goes to, and the VeRL keys behind each recipe key (for
/// errors).
struct Builder {
    tree: serde_yaml::Value,
    origin: BTreeMap<String, String>,
}

impl Builder {
    fn set(&mut self, recipe_key: &str, value: Value, origin: String) -> Result<(), VerlError> {
        let yaml = serde_yaml::to_value(&value).expect("json values are yaml values");
        set_path(&mut self.tree, recipe_key, yaml).map_err(|message| VerlError::Value {
            origin: origin.clone(),
            message,
        })?;
        self.origin.insert(recipe_key.to_string(), origin);
        Ok(())
    }

    fn origin_of(&self, recipe_key: &str) -> String {
        let mut key = recipe_key;
        loop {
            if let Some(o) = self.origin.get(key) {
                return format!("{o} (recipe key `{recipe_key}`)");
            }
            match key.rfind(['.', '[']) {
                Some(cut) => key = &key[..cut],
                None => return format!("recipe key `{recipe_key}`"),
            }
        }
    }
}

/// Builds the config as VeRL would and makes it a recipe.
pub fn translate(input: &VerlInput) -> Result<Translation, VerlError> {
    let composed = compose::compose(input)?;
    let mut t = Translator {
        config: composed.config,
        version: composed.version,
        engine: composed.engine,
        notes: composed.notes,
        unsupported: Vec::new(),
        b: Builder {
            tree: serde_yaml::Value::Mapping(Default::default()),
            origin: BTreeMap::new(),
        },
    };
    t.classify()?;
    t.map_keys()?;
    // Every unsupported setting is reported at once, before a rule's error about sizes.
    let rules = t.rules();
    if !t.unsupported.is_empty() {
        return Err(VerlError::Unsupported(t.unsupported));
    }
    rules?;
    let recipe: Recipe = serde_path_to_error::deserialize(t.b.tree.clone()).map_err(|e| {
        let path = e.path().to_string();
        VerlError::Value {
            origin: t.b.origin_of(&path),
            message: bare_message(&e.into_inner().to_string()),
        }
    })?;
    let violations = validate(&recipe, "", "grpo verl", &[]);
    if !violations.is_empty() {
        return Err(VerlError::Rules(
            violations
                .iter()
                .map(|v| {
                    format!(
                        "  {}: `{}` = {}: {}",
                        t.b.origin_of(&v.key),
                        v.key,
                        v.value,
                        v.rule
                    )
                })
                .collect(),
        ));
    }
    let mut seen = std::collections::HashSet::new();
    let notes = t.notes.into_iter().filter(|n| seen.insert(n.clone())).collect();
    Ok(Translation {
        recipe,
        notes,
        device_is_verls_default: !t.config.origin.contains_key("trainer.device"),
    })
}

struct Translator {
    config: hydra::Config,
    version: &'static version::VerlVersion,
    /// VeRL's `model_engine`: dp (FSDP), megatron, veomni or torchtitan.
    engine: &'static str,
    notes: Vec<String>,
    unsupported: Vec<(String, String)>,
    b: Builder,
}

impl Translator {
    /// Where a key's value came from, for messages: the override or file entry, or VeRL's
    /// default.
    fn origin(&self, key: &str) -> String {
        match self.config.origin.get(key) {
            Some(o)
                if o.starts_with(key)
                    || o.starts_with(&format!("+{key}"))
                    || o.starts_with(&format!("++{key}")) =>
            {
                format!("`{o}`")
            }
            Some(o) => format!("`{key}` (from {o})"),
            None => format!("`{key}` (VeRL's default)"),
        }
    }

    fn get(&self, key: &str) -> Result<Value, VerlError> {
        Ok(self.config.get(key)?.unwrap_or(Value::Null))
    }

    /// Notes for keys with no effect, errors for unsupported ones, each when set away from
    /// VeRL's default.
    fn classify(&mut self) -> Result<(), VerlError> {
        for (key, value) in &self.config.values {
            let origin = self.config.origin.get(key).cloned().unwrap_or(key.clone());
            let Some(entry) = table::entry(key) else {
                // Hydra takes `+key` / `++key` for a key VeRL's config lacks; VeRL's code reads
                // such a key or not, and grpo knows of no reader.
                if origin.starts_with('+') && !self.config.defaults.contains_key(key) {
                    self.notes.push(format!(
                        "{origin} has no effect in grpo: it adds a key VeRL's config does not                          have ({}), and grpo knows of no VeRL code that reads it",
                        self.version.describe()
                    ));
                    continue;
                }
                return Err(VerlError::Value {
                    origin: format!("`{origin}`"),
                    message: format!(
                        "`{key}` is not a key grpo verl knows VeRL to read, so it cannot say what \
                         it would do; `grpo verl --keys` lists them"
                    ),
                });
            };
            let changed = self.config.defaults.get(key) != Some(value);
            if !changed {
                continue;
            }
            let shown = match self.config.origin.get(key) {
                // A key VeRL 0.7.1 moved (compose): named as the user wrote it.
                Some(o) if !o.contains(": ") && !o.trim_start_matches('+').starts_with(key.as_str()) => {
                    format!("{o} (read as {key})")
                }
                _ => format!("{key}={}", compact(value)),
            };
            match entry.how {
                How::NoEffect(why) => self.notes.push(format!("{shown} has no effect in grpo: {why}")),
                How::Unsupported(why) => self.unsupported.push((shown, why.to_string())),
                How::Map(_) | How::Rule(_) => {}
            }
        }
        Ok(())
    }

    /// Every `Map` key, VeRL's default or the user's value, to its recipe key.
    fn map_keys(&mut self) -> Result<(), VerlError> {
        for entry in table::TABLE {
            let How::Map(to) = entry.how else { continue };
            // A key of another engine or layout than this command line's.
            if !self.config.values.contains_key(entry.key) {
                continue;
            }
            let mut value = self.get(entry.key)?;
            if PATH_KEYS.contains(&entry.key) {
                value = expand_home(value);
            }
            let origin = self.origin(entry.key);
            self.b.set(to, value, origin)?;
        }
        Ok(())
    }

    fn rules(&mut self) -> Result<(), VerlError> {
        self.multimodal();
        self.chat_template_kwargs()?;
        self.optimizer()?;
        self.megatron_lora()?;
        self.dtypes()?;
        self.sizes()?;
        self.sampling()?;
        self.reward()?;
        self.kl_in_reward()?;
        self.router_replay()?;
        self.owned_knobs()?;
        self.critic()?;
        self.trainer()?;
        Ok(())
    }

    /// PPO's critic (`algorithm.adv_estimator=gae`, VeRL's `need_critic`): `critic.*` to the
    /// recipe's `critic` section. Without gae VeRL builds no critic and its keys change nothing
    /// (notes for the ones set, from `classify` and here).
    fn critic(&mut self) -> Result<(), VerlError> {
        let gae = self.get("algorithm.adv_estimator")? == json!("gae");
        let enable = self.get("critic.enable")?;
        if enable == json!(!gae) {
            self.unsupported.push((
                format!("critic.enable={}", compact(&enable)),
                if gae {
                    "GAE reads the critic's values; leave it null (VeRL trains a critic exactly for gae)"
                } else {
                    "grpo trains a critic only for algorithm.adv_estimator=gae, the one estimator \
                     that reads it; leave it null"
                }
                .into(),
            ));
        }
        if !gae {
            let rules = table::TABLE
                .iter()
                .filter(|e| e.key.starts_with("critic.") && e.key != "critic.enable")
                .filter(|e| matches!(e.how, How::Rule(_)));
            for key in rules.map(|e| e.key) {
                let value = self.get(key)?;
                // Set by the user (several defaults are interpolations of the actor's keys).
                if self.config.origin.contains_key(key) && self.config.defaults.get(key) != Some(&value) {
                    self.notes.push(format!(
                        "{key}={} has no effect: VeRL builds a critic only with algorithm.adv_estimator=gae",
                        compact(&value)
                    ));
                }
            }
            return Ok(());
        }
        for (key, to) in CRITIC_KEYS {
            let from = format!("critic.{key}");
            if !self.config.values.contains_key(&from) {
                continue;
            }
            let value = self.get(&from)?;
            let o = self.origin(&from);
            self.b.set(to, value, o)?;
        }
        self.schedule_and_clip("critic", "critic")?;
        if self.config.origin.contains_key("critic.model.path") {
            let path = expand_home(self.get("critic.model.path")?);
            let o = self.origin("critic.model.path");
            self.b.set("critic.model.path", path, o)?;
        } else {
            self.notes.push(
                "critic.model.path is VeRL's placeholder default: the critic starts from the actor's \
                 model (actor_rollout_ref.model.path)"
                    .into(),
            );
        }
        self.critic_micro_batch()
    }

    /// The critic's sequences per pass, by the actor's size rule: per device (or from the token
    /// budget with `use_dynamic_bsz`) times the devices, fitted to divide each device's share of
    /// a mini-batch; null keeps the actor's.
    fn critic_micro_batch(&mut self) -> Result<(), VerlError> {
        let devices = self.data_devices()?;
        let n = self
            .get("actor_rollout_ref.rollout.n")?
            .as_u64()
            .unwrap_or(1)
            .max(1);
        let mini = self.get("critic.ppo_mini_batch_size")?.as_u64().unwrap_or(1);
        self.micro_batch_rule(
            "critic",
            mini * n / devices,
            devices,
            "critic.ppo_micro_batch_size",
        )?;
        Ok(())
    }

    /// `algorithm.kl_penalty` and `algorithm.kl_ctrl`, which VeRL reads only with
    /// `use_kl_in_reward` (and grpo's recipe refuses without it).
    /// Keys read only by one estimator or loss: mapped when their owner is chosen, else a note
    /// when set (VeRL ignores them then; a grpo recipe would refuse them).
    fn owned_knobs(&mut self) -> Result<(), VerlError> {
        for (key, to, owner_key, owners) in OWNED_KNOBS {
            let owner = self.get(owner_key)?;
            let chosen = owners.split('|').any(|o| owner == json!(o));
            let mut value = self.get(key)?;
            if PATH_KEYS.contains(key) {
                value = expand_home(value);
            }
            if chosen {
                let o = self.origin(key);
                self.b.set(to, value, o)?;
            } else if self.config.defaults.get(*key) != Some(&value) {
                self.notes.push(format!(
                    "{key}={} has no effect: VeRL reads it only with {owner_key}={}",
                    compact(&value),
                    owners.replace('|', " or ")
                ));
            }
        }
        Ok(())
    }

    /// `actor.router_replay.mode` from VeRL's key or its engine's own, which VeRL's MoE scripts
    /// set (`megatron.router_replay.mode`, `veomni.router_replay.mode`): the one set away from
    /// `disabled`; two set to different modes are refused.
    fn router_replay(&mut self) -> Result<(), VerlError> {
        let mut chosen: Option<(&str, Value)> = None;
        for key in [
            "actor_rollout_ref.actor.router_replay.mode",
            "actor_rollout_ref.actor.megatron.router_replay.mode",
            "actor_rollout_ref.actor.veomni.router_replay.mode",
        ] {
            if !self.config.values.contains_key(key) {
                continue;
            }
            let value = self.get(key)?;
            if value == json!("disabled") || value.is_null() {
                continue;
            }
            match &chosen {
                Some((first, mode)) if *mode != value => self.unsupported.push((
                    format!("{key}={}", compact(&value)),
                    format!("{first} sets {}; set one router replay mode", compact(mode)),
                )),
                Some(_) => {}
                None => chosen = Some((key, value)),
            }
        }
        if let Some((key, value)) = chosen {
            let origin = self.origin(key);
            self.b.set("actor.router_replay.mode", value, origin)?;
        }
        Ok(())
    }

    fn kl_in_reward(&mut self) -> Result<(), VerlError> {
        let keys = [
            "algorithm.kl_penalty",
            "algorithm.kl_ctrl.type",
            "algorithm.kl_ctrl.target_kl",
            "algorithm.kl_ctrl.horizon",
        ];
        if self.get("algorithm.use_kl_in_reward")? != json!(true) {
            for key in keys {
                let value = &self.config.values[key];
                if self.config.defaults.get(key) != Some(value) {
                    self.notes.push(format!(
                        "{key}={} has no effect: VeRL reads it only with algorithm.use_kl_in_reward=True",
                        compact(value)
                    ));
                }
            }
            return Ok(());
        }
        let penalty = self.get("algorithm.kl_penalty")?;
        match penalty.as_str().map(|p| p.trim_end_matches('+')) {
            Some(p @ ("kl" | "k1" | "abs" | "mse" | "k2" | "low_var_kl" | "k3")) => {
                let o = self.origin("algorithm.kl_penalty");
                self.b.set("algorithm.kl_penalty", json!(p), o)?;
            }
            _ => self.unsupported.push((
                format!("algorithm.kl_penalty={}", compact(&penalty)),
                "grpo's KL estimators are kl (k1), abs, mse (k2) and low_var_kl (k3); `full` needs \
                 the whole vocabulary's log-probs, which grpo does not keep"
                    .into(),
            )),
        }
        let kind = self.get("algorithm.kl_ctrl.type")?;
        let ctrl = match kind.as_str() {
            Some("fixed") => json!({ "type": "fixed" }),
            Some("adaptive") => json!({
                "type": "adaptive",
                "target_kl": self.get("algorithm.kl_ctrl.target_kl")?,
                "horizon": self.get("algorithm.kl_ctrl.horizon")?,
            }),
            _ => {
                self.unsupported.push((
                    format!("algorithm.kl_ctrl.type={}", compact(&kind)),
                    "VeRL's KL controllers are fixed and adaptive".into(),
                ));
                return Ok(());
            }
        };
        let o = self.origin("algorithm.kl_ctrl.type");
        self.b.set("algorithm.kl_ctrl", ctrl, o)
    }

    /// `SECTION.optim`'s warmup and schedule and the gradient clip of one of VeRL's optimizers
    /// (`section` the actor's or the critic's) to `to.optim.*` and `to.grad_clip`:
    /// `lr_warmup_steps` when set (not -1), else `lr_warmup_steps_ratio` x the optimizer steps of
    /// the run; the schedule by [`Translator::schedule`]; the clip from `optim.clip_grad` (VeRL's
    /// newer engine) or `grad_clip` (its older), whichever is set away from their shared
    /// default 1.0.
    fn schedule_and_clip(&mut self, section: &str, to: &str) -> Result<(), VerlError> {
        let key = |k: &str| format!("{section}.{k}");
        let steps = self.get(&key("optim.lr_warmup_steps"))?.as_i64().unwrap_or(-1);
        let ratio = self
            .get(&key("optim.lr_warmup_steps_ratio"))?
            .as_f64()
            .unwrap_or(0.0);
        if steps >= 0 {
            let o = self.origin(&key("optim.lr_warmup_steps"));
            self.b
                .set(&format!("{to}.optim.lr_warmup_steps"), json!(steps), o)?;
        } else if ratio > 0.0 {
            let Some(total) = self.get("trainer.total_training_steps")?.as_u64() else {
                return Err(VerlError::Value {
                    origin: self.origin(&key("optim.lr_warmup_steps_ratio")),
                    message: format!(
                        "a warmup ratio needs the run's length before the data is read: set \
                         trainer.total_training_steps, or {section}.optim.lr_warmup_steps"
                    ),
                });
            };
            let batch = self.get("data.train_batch_size")?.as_u64().unwrap_or(1);
            let mini = self
                .get(&key("ppo_mini_batch_size"))?
                .as_u64()
                .unwrap_or(1)
                .max(1);
            let epochs = self.get(&key("ppo_epochs"))?.as_u64().unwrap_or(1);
            let optimizer_steps = total * batch.div_ceil(mini) * epochs;
            let warmup = (ratio * optimizer_steps as f64) as u64;
            let o = self.origin(&key("optim.lr_warmup_steps_ratio"));
            self.b
                .set(&format!("{to}.optim.lr_warmup_steps"), json!(warmup), o)?;
        }
        self.schedule(section, to)?;
        let clip_grad = self.get(&key("optim.clip_grad"))?;
        let grad_clip = self.get(&key("grad_clip"))?;
        let (value, from) = match (clip_grad.as_f64(), grad_clip.as_f64()) {
            (Some(c), Some(g)) if c != 1.0 && g != 1.0 && c != g => {
                return Err(VerlError::Value {
                    origin: self.origin(&key("optim.clip_grad")),
                    message: format!("it and `{section}.grad_clip` = {g} disagree; set one of them"),
                })
            }
            (Some(c), _) if c != 1.0 => (c, key("optim.clip_grad")),
            (_, Some(g)) => (g, key("grad_clip")),
            _ => (1.0, key("grad_clip")),
        };
        let o = self.origin(&from);
        self.b.set(&format!("{to}.grad_clip"), json!(value), o)
    }

    /// The ratio's clip bounds, for the losses that read them (VeRL's sapo, gpg and kl_cov clip
    /// nothing, and the dual clip `clip_ratio_c` is vanilla's): `clip_ratio_low` /
    /// `clip_ratio_high`, VeRL's `clip_ratio` where one is null. Set for a loss that does not
    /// read them, a note (a grpo recipe refuses them there).
    fn clips(&mut self) -> Result<(), VerlError> {
        let a = "actor_rollout_ref.actor";
        let mode = self.get(LOSS_MODE)?;
        let mode = mode.as_str().unwrap_or("vanilla");
        let clips = !matches!(mode, "sapo" | "gpg" | "kl_cov");
        let changed = |t: &Self, k: &str| t.config.values.get(k) != t.config.defaults.get(k);
        let clip_ratio = format!("{a}.clip_ratio");
        let mut clip_ratio_read = false;
        for side in ["low", "high"] {
            let key = format!("{a}.clip_ratio_{side}");
            let value = self.get(&key)?;
            let from = if value.is_null() {
                clip_ratio_read = true;
                clip_ratio.clone()
            } else {
                key
            };
            if clips {
                let value = self.get(&from)?;
                let o = self.origin(&from);
                self.b.set(&format!("actor.clip_ratio_{side}"), value, o)?;
            } else if changed(self, &from) {
                self.notes.push(format!(
                    "{from}={} has no effect: VeRL's {mode} loss does not clip the ratio",
                    compact(&self.get(&from)?)
                ));
            }
        }
        if clips && !clip_ratio_read && changed(self, &clip_ratio) {
            self.notes.push(format!(
                "{clip_ratio}={} has no effect: VeRL reads it only where clip_ratio_low or \
                 clip_ratio_high is null, and both are set (VeRL's defaults are 0.2); set those",
                compact(&self.get(&clip_ratio)?)
            ));
        }
        let key = format!("{a}.clip_ratio_c");
        let value = self.get(&key)?;
        if mode == "vanilla" {
            let o = self.origin(&key);
            self.b.set("actor.clip_ratio_c", value, o)?;
        } else if changed(self, &key) {
            self.notes.push(format!(
                "{key}={} has no effect: VeRL reads it only with {LOSS_MODE}=vanilla (PPO's dual clip)",
                compact(&value)
            ));
        }
        Ok(())
    }

    /// The schedule after warmup, in the engine's words ([`engine::Schedule`]): `constant` or
    /// `cosine` (FSDP's `warmup_style`, its older name, when set), down to a floor given as a
    /// fraction of `lr` or as a learning rate.
    fn schedule(&mut self, section: &str, to: &str) -> Result<(), VerlError> {
        let schedule = &engine::engine(self.engine).schedule;
        let key = |k: &str| format!("{section}.optim.{k}");
        let mut kind_key = key(schedule.kind);
        if self.engine == "dp" && !self.get(&key("warmup_style"))?.is_null() {
            kind_key = key("warmup_style");
        }
        let kind = self.get(&kind_key)?;
        let ours = match kind.as_str() {
            Some("constant") => "constant",
            Some("cosine") => "cosine",
            _ => {
                self.unsupported.push((
                    format!("{kind_key}={}", compact(&kind)),
                    "grpo's learning-rate schedules are constant and cosine (VeRL's \
                     get_cosine_schedule_with_warmup) after a linear warmup"
                        .into(),
                ));
                return Ok(());
            }
        };
        let o = self.origin(&kind_key);
        self.b
            .set(&format!("{to}.optim.lr_scheduler_type"), json!(ours), o)?;
        let (floor_key, ratio) = match schedule.floor {
            engine::Floor::Ratio(k) => (key(k), self.get(&key(k))?.as_f64().unwrap_or(0.0)),
            engine::Floor::Absolute(k) => {
                let lr = self.get(&key("lr"))?.as_f64().unwrap_or(0.0);
                let floor = self.get(&key(k))?.as_f64().unwrap_or(0.0);
                (key(k), if lr > 0.0 { floor / lr } else { 0.0 })
            }
        };
        let o = self.origin(&floor_key);
        self.b.set(&format!("{to}.optim.min_lr_ratio"), json!(ratio), o)
    }

    fn optimizer(&mut self) -> Result<(), VerlError> {
        let a = "actor_rollout_ref.actor";
        self.schedule_and_clip(a, "actor")?;
        self.clips()?;
        let strategy = self.get(&format!("{a}.strategy"))?;
        let expected: &[&str] = match self.engine {
            // fsdp_turbo is FSDP2 with fused kernels and a sharding plan: the same
            // computation.
            "dp" => &["fsdp", "fsdp2", "fsdp_turbo"],
            other => &[other],
        };
        if !strategy.as_str().is_some_and(|s| expected.contains(&s)) {
            self.unsupported.push((
                format!("{a}.strategy={}", compact(&strategy)),
                format!(
                    "with model_engine={} VeRL's actor strategy is {}; grpo's learner shards \
                     like FSDP, with tensor parallelism from the engine's size keys",
                    self.engine,
                    expected.join(" or ")
                ),
            ));
        }
        Ok(())
    }

    /// A script that names its images', video's or audio's column (even as VeRL's default
    /// `images`) trains on them; grpo's models are text-only, so it is refused rather than run
    /// on the text alone.
    fn multimodal(&mut self) {
        for key in MULTIMODAL_KEYS {
            if let Some(origin) = self.config.origin.get(*key) {
                self.unsupported.push((
                    format!("{key}={}", compact(&self.config.values[*key])),
                    format!(
                        "vision, video and audio input is not in grpo: it trains text-only \
                         models, and would drop what `{origin}` names from every prompt"
                    ),
                ));
            }
        }
    }

    /// `data.apply_chat_template_kwargs.NAME` (added with `+`) to the recipe's map of the same
    /// name.
    fn chat_template_kwargs(&mut self) -> Result<(), VerlError> {
        let section = "data.apply_chat_template_kwargs";
        let prefix = format!("{section}.");
        let keys: Vec<String> = self
            .config
            .values
            .keys()
            .filter(|k| k.starts_with(&prefix))
            .cloned()
            .collect();
        for key in keys {
            let value = self.get(&key)?;
            let o = self.origin(&key);
            self.b.set(&key, value, o)?;
        }
        Ok(())
    }

    /// Megatron-Bridge's LoRA (`actor_rollout_ref.model.lora.*`, read by VeRL's Megatron
    /// engine) to grpo's, its module names to the Hugging Face projections they are.
    fn megatron_lora(&mut self) -> Result<(), VerlError> {
        let m = "actor_rollout_ref.model.lora";
        let rank = self.get(&format!("{m}.rank"))?.as_u64().unwrap_or(0);
        if rank == 0 {
            return Ok(());
        }
        if self.engine != "megatron" {
            self.notes.push(format!(
                "{m}.rank={rank} has no effect: VeRL's Megatron engine reads it; with \
                 model_engine={} LoRA is `actor_rollout_ref.model.lora_rank`",
                self.engine
            ));
            return Ok(());
        }
        let o = self.origin(&format!("{m}.rank"));
        self.b.set("actor.lora_rank", json!(rank), o)?;
        let alpha = self.get(&format!("{m}.alpha"))?;
        let o = self.origin(&format!("{m}.alpha"));
        self.b.set("actor.lora_alpha", alpha, o)?;
        let targets = self.get(&format!("{m}.target_modules"))?;
        let mut ours = Vec::new();
        for t in targets.as_array().into_iter().flatten() {
            let names: &[&str] = match t.as_str() {
                Some("linear_qkv") => &["q_proj", "k_proj", "v_proj"],
                Some("linear_proj") => &["o_proj"],
                Some("linear_fc1") => &["gate_proj", "up_proj"],
                Some("linear_fc2") => &["down_proj"],
                _ => {
                    self.unsupported.push((
                        format!("{m}.target_modules={}", compact(&targets)),
                        format!(
                            "{t} is not one of Megatron's linear_qkv, linear_proj, linear_fc1, \
                             linear_fc2, the layers grpo's LoRA adapts"
                        ),
                    ));
                    return Ok(());
                }
            };
            ours.extend(names.iter().map(|n| json!(n)));
        }
        let o = self.origin(&format!("{m}.target_modules"));
        self.b.set("actor.target_modules", Value::Array(ours), o)?;
        let adapter = expand_home(self.get(&format!("{m}.adapter_path"))?);
        if !adapter.is_null() {
            let o = self.origin(&format!("{m}.adapter_path"));
            self.b.set("model.lora_adapter_path", adapter, o)?;
        }
        Ok(())
    }

    fn dtypes(&mut self) -> Result<(), VerlError> {
        let actor = match engine::engine(self.engine).dtype {
            engine::Dtype::Name(k) | engine::Dtype::MixedPrecision(k) => {
                format!("actor_rollout_ref.actor.{k}")
            }
        };
        for (verl, recipe) in [
            (actor.as_str(), "actor.param_dtype"),
            ("actor_rollout_ref.rollout.dtype", "rollout.dtype"),
        ] {
            let value = self.get(verl)?;
            let ours = match (value.as_str(), value.as_bool()) {
                (Some("bfloat16" | "bf16"), _) | (_, Some(true)) => "auto",
                (Some("float32" | "fp32"), _) | (_, Some(false)) => "f32",
                _ => {
                    self.unsupported.push((
                        format!("{verl}={}", compact(&value)),
                        "grpo computes in bf16 or f32 (bfloat16, float32)".into(),
                    ));
                    continue;
                }
            };
            let o = self.origin(verl);
            self.b.set(recipe, json!(ours), o)?;
        }
        Ok(())
    }

    fn sizes(&mut self) -> Result<(), VerlError> {
        let a = "actor_rollout_ref.actor";
        let nnodes = self.get("trainer.nnodes")?.as_u64().unwrap_or(1);
        if nnodes != 1 {
            self.unsupported.push((
                format!("trainer.nnodes={nnodes}"),
                "a learner spanning several hosts (one program over every host's devices) is \
                 not in grpo yet (docs/multihost.md); on one host set trainer.nnodes=1, or spread \
                 rollout and reward workers over hosts with a recipe's `cluster.launcher: ray` \
                 and `cluster.pools` (recipes/README.md)"
                    .into(),
            ));
            return Ok(());
        }
        let devices = self.get("trainer.n_gpus_per_node")?.as_u64().unwrap_or(1).max(1);
        let device = self.get("trainer.device")?;
        let kind = match device.as_str() {
            Some("cuda" | "gpu") => "cuda",
            Some("cpu") => "cpu",
            Some("tpu") => "tpu",
            _ => {
                self.unsupported.push((
                    format!("trainer.device={}", compact(&device)),
                    "grpo runs on cuda, tpu and cpu".into(),
                ));
                return Ok(());
            }
        };
        let device_origin = self.origin("trainer.device");
        let gpus_origin = self.origin("trainer.n_gpus_per_node");
        self.b.set("cluster.device", json!(kind), device_origin)?;
        if kind == "cpu" {
            self.b
                .set("cluster.cpu_device_count", json!(devices), gpus_origin.clone())?;
        }
        if devices > 1 {
            self.b.set("actor.strategy", json!("fsdp"), gpus_origin.clone())?;
            self.b.set("actor.mesh", json!(devices), gpus_origin.clone())?;
        }
        self.engine_sizes(devices)?;
        let data = self.data_devices()?;
        let tp = self
            .get("actor_rollout_ref.rollout.tensor_model_parallel_size")?
            .as_u64()
            .unwrap_or(1);
        if tp > devices {
            return Err(VerlError::Value {
                origin: self.origin("actor_rollout_ref.rollout.tensor_model_parallel_size"),
                message: format!(
                    "{tp} devices per rollout engine, but the run has {devices} \
                     (trainer.n_gpus_per_node x trainer.nnodes); VeRL refuses this too"
                ),
            });
        }
        let n = self
            .get("actor_rollout_ref.rollout.n")?
            .as_u64()
            .unwrap_or(1)
            .max(1);
        let mini = self
            .get(&format!("{a}.ppo_mini_batch_size"))?
            .as_u64()
            .unwrap_or(1);
        let seqs = mini * n;
        if !seqs.is_multiple_of(data) {
            return Err(VerlError::Value {
                origin: self.origin(&format!("{a}.ppo_mini_batch_size")),
                message: format!(
                    "a mini-batch of {mini} prompts x {n} responses = {seqs} sequences does not \
                     split evenly over {data} data devices (trainer.n_gpus_per_node over the \
                     tensor-parallel size); VeRL refuses this too"
                ),
            });
        }
        if !self.micro_batch_rule(a, seqs / data, data, "actor.ppo_micro_batch_size")? {
            return Err(VerlError::Value {
                origin: format!("`{a}.ppo_micro_batch_size_per_gpu`"),
                message: "unset: set it (or use_dynamic_bsz=True with ppo_max_token_len_per_gpu); \
                          VeRL requires it too"
                    .into(),
            });
        }
        Ok(())
    }

    /// The engine's parallel sizes on grpo's mesh: tensor parallelism as it is; pipeline
    /// stages, sequence splits and expert parallelism (which grpo does not have as such) become
    /// FSDP over the same devices, with a note: a mixture of experts' experts are split by
    /// expert over the tensor-parallel devices and by width over the FSDP ones, so each device
    /// stores as small a share as an expert-parallel split whose size divides the devices.
    fn engine_sizes(&mut self, devices: u64) -> Result<(), VerlError> {
        let eng = engine::engine(self.engine);
        let a = "actor_rollout_ref.actor";
        let strategy = self.get(&format!("{a}.strategy"))?;
        let reads = |k: &str| eng.reads(k, strategy.as_str().unwrap_or_default());
        if let Some(key) = self.tensor_key()? {
            let tp = self.size(&key)?;
            if !devices.is_multiple_of(tp) {
                return Err(VerlError::Value {
                    origin: self.origin(&key),
                    message: format!(
                        "{tp} tensor-parallel devices do not divide the run's {devices} \
                         (trainer.n_gpus_per_node); VeRL refuses this too"
                    ),
                });
            }
            if tp > 1 {
                let o = self.origin(&key);
                self.b.set("actor.tensor_model_parallel_size", json!(tp), o)?;
            }
        }
        let tp = self.tensor_parallel()?;
        let layout = format!(
            "the learner's {devices} devices are FSDP over {} x tensor parallelism over {tp}",
            devices / tp
        );
        for k in eng.pipeline.iter().filter(|k| reads(k)) {
            let key = format!("{a}.{k}");
            let size = self.size(&key)?;
            if size > 1 {
                self.notes.push(format!(
                    "{key}={size}: grpo does not pipeline (split the layers into stages); \
                     {layout}, every layer sharded over them and gathered when it runs"
                ));
            }
        }
        for k in eng.sequence.iter().filter(|k| reads(k)) {
            let key = format!("{a}.{k}");
            let size = self.size(&key)?;
            if size > 1 {
                self.notes.push(format!(
                    "{key}={size}: grpo does not split a sequence over devices; {layout}, each \
                     data device holding whole sequences"
                ));
            }
        }
        for k in eng.expert.iter().filter(|k| reads(k)) {
            let key = format!("{a}.{k}");
            let size = self.size(&key)?;
            if size <= 1 {
                continue;
            }
            if !devices.is_multiple_of(size) {
                self.unsupported.push((
                    format!("{key}={size}"),
                    format!(
                        "{size} expert-parallel devices do not divide the run's {devices} \
                         (trainer.n_gpus_per_node); VeRL refuses this too"
                    ),
                ));
                continue;
            }
            self.notes.push(format!(
                "{key}={size}: grpo does not exchange tokens between devices for the experts; \
                 {layout}: each MoE layer's experts are split by expert over the tensor-parallel \
                 devices and by width over the FSDP ones, every device storing 1/{devices} of them \
                 (an expert-parallel split over {size} stores 1/{size}), and a layer's experts are \
                 gathered over the FSDP devices when it runs, as every FSDP parameter is \
                 (docs/moe.md, \"Over several devices\")"
            ));
        }
        self.rollout_expert_parallel()
    }

    /// `rollout.expert_parallel_size` (vLLM's experts split over that many devices of an
    /// engine): grpo's rollout splits them by expert over its tensor-parallel devices, so a size
    /// that divides `rollout.tensor_model_parallel_size` is kept with a note (each device
    /// holding as few experts or fewer) and a larger one is refused.
    fn rollout_expert_parallel(&mut self) -> Result<(), VerlError> {
        let key = "actor_rollout_ref.rollout.expert_parallel_size";
        if !self.config.values.contains_key(key) {
            return Ok(());
        }
        let ep = self.size(key)?;
        let tp = self.size("actor_rollout_ref.rollout.tensor_model_parallel_size")?;
        if ep <= 1 {
            return Ok(());
        }
        if tp.is_multiple_of(ep) {
            self.notes.push(format!(
                "{key}={ep}: grpo's rollout splits each MoE layer's experts by expert over its \
                 {tp} tensor-parallel devices (rollout.tensor_model_parallel_size), each holding \
                 1/{tp} of them (an expert-parallel split over {ep} holds 1/{ep}), and sums the \
                 experts' partial outputs over those devices instead of exchanging tokens"
            ));
        } else {
            self.unsupported.push((
                format!("{key}={ep}"),
                format!(
                    "grpo's rollout splits the experts over its tensor-parallel devices only \
                     (actor_rollout_ref.rollout.tensor_model_parallel_size={tp}), which {ep} must \
                     divide; raise the tensor-parallel size to a multiple of {ep}, or set this to 1"
                ),
            ));
        }
        Ok(())
    }

    /// A parallel size: a number, or 1 when null (VeRL's unset).
    fn size(&self, key: &str) -> Result<u64, VerlError> {
        let value = self.get(key)?;
        match value {
            Value::Null => Ok(1),
            other => other
                .as_u64()
                .filter(|n| *n >= 1)
                .ok_or_else(|| VerlError::Value {
                    origin: self.origin(key),
                    message: format!("{other} is not a device count (1 or more)"),
                }),
        }
    }

    /// The key of the engine's tensor-parallel size, where it has one VeRL reads.
    fn tensor_key(&self) -> Result<Option<String>, VerlError> {
        let eng = engine::engine(self.engine);
        let strategy = self.get("actor_rollout_ref.actor.strategy")?;
        Ok(eng
            .tensor
            .filter(|k| eng.reads(k, strategy.as_str().unwrap_or_default()))
            .map(|k| format!("actor_rollout_ref.actor.{k}")))
    }

    /// The engine's tensor-parallel size (1 where it has none).
    fn tensor_parallel(&self) -> Result<u64, VerlError> {
        match self.tensor_key()? {
            Some(key) => self.size(&key),
            None => Ok(1),
        }
    }

    /// The devices a mini-batch is split over: all of them over the tensor-parallel size.
    fn data_devices(&self) -> Result<u64, VerlError> {
        let devices = self.get("trainer.n_gpus_per_node")?.as_u64().unwrap_or(1).max(1);
        Ok((devices / self.tensor_parallel()?).max(1))
    }

    /// The size rule's sequences per pass of `section` (the actor's or the critic's) to the
    /// recipe key `to`: per device from `use_dynamic_bsz`'s token budget over the longest row,
    /// or `ppo_micro_batch_size_per_gpu`, or the older global `ppo_micro_batch_size` over the
    /// devices; fitted down to divide each device's `share` of a mini-batch; times the devices.
    /// False when none of them is set.
    fn micro_batch_rule(
        &mut self,
        section: &str,
        share: u64,
        devices: u64,
        to: &str,
    ) -> Result<bool, VerlError> {
        let key = |k: &str| format!("{section}.{k}");
        let dynamic = self.get(&key("use_dynamic_bsz"))?.as_bool().unwrap_or(false);
        let (per_device, from) = if dynamic {
            let tokens = self
                .get(&key("ppo_max_token_len_per_gpu"))?
                .as_u64()
                .unwrap_or(16384);
            let len = self.get("data.max_prompt_length")?.as_u64().unwrap_or(512)
                + self.get("data.max_response_length")?.as_u64().unwrap_or(512);
            ((tokens / len.max(1)).max(1), key("ppo_max_token_len_per_gpu"))
        } else if let Some(m) = self.get(&key("ppo_micro_batch_size_per_gpu"))?.as_u64() {
            (m.max(1), key("ppo_micro_batch_size_per_gpu"))
        } else if let Some(m) = self.get(&key("ppo_micro_batch_size"))?.as_u64() {
            ((m / devices).max(1), key("ppo_micro_batch_size"))
        } else {
            return Ok(false);
        };
        let share = share.max(1);
        let fitted = (1..=per_device.min(share))
            .rev()
            .find(|d| share.is_multiple_of(*d))
            .unwrap_or(1);
        if fitted != per_device {
            self.notes.push(format!(
                "size rule: {per_device} sequences per device per pass (from {from}) made {fitted}, \
                 the most that divides each device's {share} sequences of a mini-batch"
            ));
        }
        let o = self.origin(&from);
        self.b.set(to, json!(fitted * devices), o)?;
        Ok(true)
    }

    fn sampling(&mut self) -> Result<(), VerlError> {
        let r = "actor_rollout_ref.rollout";
        if self.get(&format!("{r}.do_sample"))? == json!(false) {
            let o = self.origin(&format!("{r}.do_sample"));
            self.b.set("rollout.temperature", json!(0.0), o)?;
        }
        let step = self.get("data.train_batch_size")?.as_u64().unwrap_or(1)
            * self.get(&format!("{r}.n"))?.as_u64().unwrap_or(1);
        let max = self.get(&format!("{r}.max_num_seqs"))?.as_u64().unwrap_or(256);
        let o = self.origin(&format!("{r}.max_num_seqs"));
        self.b
            .set("rollout.max_num_seqs", json!(max.min(step).max(1)), o)?;
        Ok(())
    }

    /// The reward manager and custom reward function, from wherever this layout keeps them
    /// ([`RewardKeys`]). `naive` and `batch` are grpo's managers; `dapo` is `naive` plus the
    /// overlong penalty of its `reward_kwargs.overlong_buffer_cfg`, which becomes
    /// `reward.overlong_buffer`.
    fn reward(&mut self) -> Result<(), VerlError> {
        let k = if self.version.has_reward_section() {
            RewardKeys::SECTION
        } else {
            RewardKeys::TOP_LEVEL
        };
        if self.get(k.rm_enable)? == json!(true) {
            return self.reward_model(&k);
        }
        let manager = self.get(k.manager)?;
        let manager_origin = self.origin(k.manager);
        let ours = match manager.as_str() {
            Some(m @ ("naive" | "batch")) => m,
            Some("dapo") => {
                self.overlong_buffer(k.manager_kwargs)?;
                "naive"
            }
            _ => {
                self.unsupported.push((
                    format!("{}={}", k.manager, compact(&manager)),
                    "grpo's reward managers are naive, batch and dapo (naive with DAPO's overlong \
                     penalty); VeRL's prime and others are not in grpo"
                        .into(),
                ));
                "naive"
            }
        };
        let path = expand_home(self.get(k.path)?);
        if path.is_null() {
            if manager != json!("naive")
                && manager != json!("dapo")
                && self.config.values.get(k.manager) != self.config.defaults.get(k.manager)
            {
                self.notes.push(format!(
                    "{}={} has no effect without {}: grpo's built-in scorers serve VeRL's data \
                     sources",
                    k.manager,
                    compact(&manager),
                    k.path
                ));
            }
            return Ok(());
        }
        let name = self.get(k.name)?;
        let mut kwargs = serde_json::Map::new();
        let prefix = format!("{}.", k.function_kwargs);
        for key in self.config.values.keys().filter(|key| key.starts_with(&prefix)) {
            kwargs.insert(key[prefix.len()..].to_string(), self.get(key)?);
        }
        let origin = format!("{} with {manager_origin}", self.origin(k.path));
        self.b.set(
            "reward.custom_reward_function",
            json!({ "path": path, "name": name, "reward_kwargs": kwargs, "reward_manager": ours }),
            origin,
        )?;
        Ok(())
    }

    /// VeRL's reward-model worker: a `*ForSequenceClassification` checkpoint whose score is every
    /// sample's reward (VeRL uses it for every data source when no custom function is given,
    /// and 0.7.0 returned its scores even with one), as grpo's `reward_model` scorer and
    /// `reward.scorer`. VeRL 0.7.1's custom function beside it reaches the model through VeRL's
    /// router, which grpo does not have.
    fn reward_model(&mut self, k: &RewardKeys) -> Result<(), VerlError> {
        let path = expand_home(self.get(k.rm_path)?);
        if path.is_null() {
            return Err(VerlError::Value {
                origin: self.origin(k.rm_path),
                message: format!("{} needs the reward model's checkpoint here", k.rm_enable),
            });
        }
        let custom = self.get(k.path)?;
        if !custom.is_null() {
            if self.version.has_reward_section() {
                self.unsupported.push((
                    format!("{}={}", k.path, compact(&custom)),
                    format!(
                        "a custom reward function beside VeRL's reward model ({}) calls it \
                         through VeRL's reward router, which grpo does not have; in a grpo recipe \
                         weigh a `reward_model` scorer with rule scorers (`kind: weighted`)",
                        k.rm_enable
                    ),
                ));
                return Ok(());
            }
            self.notes.push(format!(
                "{}={} has no effect: with {}, VeRL 0.7.0 returns the reward model's scores",
                k.path,
                compact(&custom),
                k.rm_enable
            ));
        }
        let manager = self.get(k.manager)?;
        if !matches!(manager.as_str(), Some("naive" | "batch")) {
            self.unsupported.push((
                format!("{}={}", k.manager, compact(&manager)),
                "VeRL's reward model scores the samples itself; its other reward managers \
                 beside it are not translated"
                    .into(),
            ));
            return Ok(());
        }
        let mut scorer = json!({ "kind": "reward_model", "path": path });
        let max_length = if self.version.has_reward_section() {
            let len = |t: &Self, k: &str| t.get(&format!("reward.reward_model.rollout.{k}"));
            match (
                len(self, "prompt_length")?.as_u64(),
                len(self, "response_length")?.as_u64(),
            ) {
                (Some(p), Some(r)) => Some(p + r),
                _ => None,
            }
        } else {
            self.get("reward_model.max_length")?.as_u64()
        };
        if let Some(m) = max_length {
            scorer["max_length"] = json!(m);
        }
        let o = format!("{} with {}", self.origin(k.rm_enable), self.origin(k.rm_path));
        self.b
            .set("reward.scorers.verl_reward_model", scorer, o.clone())?;
        self.b.set("reward.scorer", json!("verl_reward_model"), o)
    }

    /// DAPO's `overlong_buffer_cfg` and `max_resp_len` (under `kwargs`, the reward manager's
    /// keyword arguments) to `reward.overlong_buffer`.
    fn overlong_buffer(&mut self, kwargs: &str) -> Result<(), VerlError> {
        let cfg = format!("{kwargs}.overlong_buffer_cfg");
        let get = |t: &Self, k: &str| t.get(&format!("{cfg}.{k}"));
        if get(self, "enable")?.as_bool() != Some(true) {
            return Ok(());
        }
        let max = self.get(&format!("{kwargs}.max_resp_len"))?;
        let buffer = json!({
            "enable": true,
            "len": get(self, "len")?,
            "penalty_factor": get(self, "penalty_factor")?.as_f64().unwrap_or(1.0),
            "log": get(self, "log")?.as_bool().unwrap_or(false),
            "max_response_length": max,
        });
        let o = self.origin(&format!("{cfg}.enable"));
        self.b.set("reward.overlong_buffer", buffer, o)
    }

    fn trainer(&mut self) -> Result<(), VerlError> {
        let logger = self.get("trainer.logger")?;
        let mut names: Vec<Value> = match logger {
            Value::Array(list) => list,
            Value::Null => Vec::new(),
            one => vec![one],
        };
        if !names.contains(&json!("file")) {
            names.push(json!("file"));
        }
        let o = self.origin("trainer.logger");
        self.b.set("trainer.logger", Value::Array(names), o)?;
        let seed = self.get("data.seed")?;
        if !seed.is_null() {
            let o = self.origin("data.seed");
            self.b.set("data.seed", seed, o)?;
        }
        let tokenizer = self.get("data.tokenizer")?;
        if !tokenizer.is_null() && self.get("actor_rollout_ref.model.tokenizer_path")?.is_null() {
            let o = self.origin("data.tokenizer");
            self.b.set("model.tokenizer", expand_home(tokenizer), o)?;
        }
        Ok(())
    }
}

/// Where a layout keeps its reward manager and custom reward function.
struct RewardKeys {
    manager: &'static str,
    path: &'static str,
    name: &'static str,
    /// The section of the keyword arguments passed to the custom reward function.
    function_kwargs: &'static str,
    /// The section of the reward manager's keyword arguments (DAPO's overlong buffer).
    manager_kwargs: &'static str,
    /// Whether VeRL's reward-model worker scores the samples, and its checkpoint.
    rm_enable: &'static str,
    rm_path: &'static str,
}

impl RewardKeys {
    /// VeRL 0.7.1 and later (`reward.*`).
    const SECTION: RewardKeys = RewardKeys {
        manager: "reward.reward_manager.name",
        path: "reward.custom_reward_function.path",
        name: "reward.custom_reward_function.name",
        function_kwargs: "reward.custom_reward_function.reward_kwargs",
        manager_kwargs: "reward.reward_kwargs",
        rm_enable: "reward.reward_model.enable",
        rm_path: "reward.reward_model.model_path",
    };
    /// VeRL 0.7.0 and earlier.
    const TOP_LEVEL: RewardKeys = RewardKeys {
        manager: "reward_manager.name",
        path: "custom_reward_function.path",
        name: "custom_reward_function.name",
        function_kwargs: "custom_reward_function.reward_kwargs",
        manager_kwargs: "reward_model.reward_kwargs",
        rm_enable: "reward_model.enable",
        rm_path: "reward_model.model.path",
    };
}

/// `(critic.KEY, recipe key)`: the critic's keys that go over as they are with gae.
const CRITIC_KEYS: &[(&str, &str)] = &[
    ("optim.lr", "critic.optim.lr"),
    ("optim.betas", "critic.optim.betas"),
    ("optim.weight_decay", "critic.optim.weight_decay"),
    ("cliprange_value", "critic.cliprange_value"),
    ("loss_agg_mode", "critic.loss_agg_mode"),
    ("ppo_mini_batch_size", "critic.ppo_mini_batch_size"),
    ("ppo_epochs", "critic.ppo_epochs"),
    (
        "model.enable_gradient_checkpointing",
        "critic.model.enable_gradient_checkpointing",
    ),
];

/// `(VeRL key, recipe key, the key choosing its owner, the owners separated by `|`)`: the
/// knobs of one estimator or loss (see `Translator::owned_knobs`).
const OWNED_KNOBS: &[(&str, &str, &str, &str)] = &[
    (
        "trainer.resume_from_path",
        "trainer.resume_from_path",
        "trainer.resume_mode",
        "resume_path",
    ),
    (
        "algorithm.gamma",
        "algorithm.gamma",
        "algorithm.adv_estimator",
        "reinforce_plus_plus|gae",
    ),
    ("algorithm.lam", "algorithm.lam", "algorithm.adv_estimator", "gae"),
    (
        "trainer.critic_warmup",
        "trainer.critic_warmup",
        "algorithm.adv_estimator",
        "gae",
    ),
    (
        "actor_rollout_ref.actor.tau_pos",
        "actor.tau_pos",
        LOSS_MODE,
        "sapo",
    ),
    (
        "actor_rollout_ref.actor.tau_neg",
        "actor.tau_neg",
        LOSS_MODE,
        "sapo",
    ),
    (
        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
        "actor.policy_loss.clip_cov_ratio",
        LOSS_MODE,
        "clip_cov",
    ),
    (
        "actor_rollout_ref.actor.policy_loss.clip_cov_lb",
        "actor.policy_loss.clip_cov_lb",
        LOSS_MODE,
        "clip_cov",
    ),
    (
        "actor_rollout_ref.actor.policy_loss.clip_cov_ub",
        "actor.policy_loss.clip_cov_ub",
        LOSS_MODE,
        "clip_cov",
    ),
    (
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio",
        "actor.policy_loss.kl_cov_ratio",
        LOSS_MODE,
        "kl_cov",
    ),
    (
        "actor_rollout_ref.actor.policy_loss.ppo_kl_coef",
        "actor.policy_loss.ppo_kl_coef",
        LOSS_MODE,
        "kl_cov",
    ),
];

const LOSS_MODE: &str = "actor_rollout_ref.actor.policy_loss.loss_mode";

/// The data keys that say a dataset has images, video or audio ([`Translator::multimodal`]).
const MULTIMODAL_KEYS: &[&str] = &[
    "data.image_key",
    "data.video_key",
    "data.audio_key",
    "data.image_patch_size",
    "data.mm_processor_kwargs",
];

/// VeRL keys holding paths, where `~/` means the home directory as in VeRL.
const PATH_KEYS: &[&str] = &[
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "data.train_files",
    "data.val_files",
    "trainer.default_local_dir",
    "trainer.resume_from_path",
];

fn expand_home(value: Value) -> Value {
    let home = std::env::var("HOME").unwrap_or_default();
    let one = |s: &str| match s.strip_prefix("~/") {
        Some(rest) if !home.is_empty() => format!("{home}/{rest}"),
        _ => s.to_string(),
    };
    match value {
        Value::String(s) => Value::String(one(&s)),
        Value::Array(list) => Value::Array(
            list.into_iter()
                .map(|v| match v {
                    Value::String(s) => Value::String(one(&s)),
                    other => other,
                })
                .collect(),
        ),
        other => other,
    }
}

/// A value as a user would write it on the command line.
fn compact(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests;
