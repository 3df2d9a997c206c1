//! VeRL's config composed as Hydra composes it for `main_ppo`: the release whose layout the
//! command line follows ([`super::version`]), the training engine (`model_engine=...`, or the
//! one a `--config-name` composes), a config file, the overrides; then the reward keys VeRL 0.7.1
//! left at the top moved to its `reward` section, as its releases did.

use super::engine::ENGINES;
use super::hydra::{Config, ConfigFile, Override};
use super::version::{detect, VerlVersion};
use super::{VerlError, VerlInput};
use std::path::PathBuf;

/// VeRL's config for one command line, and what was chosen on the way (for notes).
pub struct Composed {
    pub config: Config,
    pub version: &'static VerlVersion,
    /// `dp` (FSDP), `megatron`, `veomni` or `torchtitan`.
    pub engine: &'static str,
    pub notes: Vec<String>,
}

/// The configs VeRL ships in its package that `--config-name` may name without a file here, and
/// the engine each composes.
const VERL_CONFIGS: &[(&str, &str)] = &[("ppo_trainer", "dp"), ("ppo_megatron_trainer", "megatron")];

/// The config groups of VeRL's `ppo_trainer` defaults list (a key without dots naming one, or
/// `group@package`, is a choice of a config file, not a value).
const GROUPS: &[&str] = &[
    "model_engine",
    "actor",
    "ref",
    "critic",
    "rollout",
    "data",
    "model",
    "reward",
    "reward_model",
    "reward_manager",
    "algorithm",
    "distillation",
    "transfer_queue",
    "engine",
    "optim",
    "profiler",
];

/// `(group@package, option)` entries of VeRL's own defaults lists that choose what grpo's
/// defaults already hold.
const STANDARD_CHOICES: &[(&str, &str)] = &[
    ("data@data", "legacy_data"),
    ("rollout@actor_rollout_ref.rollout", "rollout"),
    ("model@actor_rollout_ref.model", "hf_model"),
    ("model@critic.model", "hf_model"),
    ("reward@reward", "reward"),
    ("algorithm@algorithm.rollout_correction", "rollout_correction"),
    ("distillation@distillation", "distillation"),
    ("transfer_queue@transfer_queue", "transfer_queue"),
];

/// The groups whose option is `ENGINE_SUFFIX` (or `${model_engine}_SUFFIX`).
const ENGINE_GROUPS: &[(&str, &str)] = &[
    ("actor@actor_rollout_ref.actor", "actor"),
    ("ref@actor_rollout_ref.ref", "ref"),
    ("critic@critic", "critic"),
    ("reward_model@reward_model", "reward_loop"),
];

pub fn compose(input: &VerlInput) -> Result<Composed, VerlError> {
    let mut notes = Vec::new();
    let overrides = input
        .overrides
        .iter()
        .map(|raw| Override::parse(raw))
        .collect::<Result<Vec<_>, _>>()?;
    let mut engine = EngineChoice::default();
    let file = config_file(input, &mut engine, &mut notes)?;
    let mut rest = Vec::new();
    for o in overrides {
        if o.key == "hydra" || o.key.starts_with("hydra.") {
            notes.push(format!(
                "{} has no effect in grpo: a setting of Hydra itself (search path, output and \
                 logging directories), which grpo verl does not run",
                o.raw
            ));
        } else if o.key.contains('@') || GROUPS.contains(&o.key.as_str()) {
            let option = o.value.as_ref().and_then(|v| v.as_str()).unwrap_or_default();
            engine.choose(&o.key, Some(option), &o.raw)?;
        } else {
            rest.push(o);
        }
    }
    let (version, why) = match &input.verl_version {
        Some(text) => (
            VerlVersion::parse(text).map_err(|message| VerlError::Value {
                origin: format!("--verl-version={text}"),
                message,
            })?,
            format!("--verl-version={text}"),
        ),
        None => {
            let file_keys = file.iter().flat_map(|f| {
                let mut leaves = Vec::new();
                super::hydra::flatten("", &f.body, &mut leaves);
                leaves.into_iter().map(|(k, _)| k)
            });
            let keys: Vec<String> = rest
                .iter()
                .filter(|o| o.op != super::Op::Add)
                .map(|o| o.key.clone())
                .chain(file_keys)
                .collect();
            detect(keys.iter().map(String::as_str)).map_err(|message| VerlError::Value {
                origin: "the command line".into(),
                message,
            })?
        }
    };
    let (name, origin) = match engine.chosen {
        Some((name, origin)) => (name, format!("from `{origin}`")),
        None => ("dp", "VeRL's default".to_string()),
    };
    let Some(defaults) = version.defaults(name) else {
        return Err(VerlError::Value {
            origin: origin.clone(),
            message: format!(
                "{} has no model_engine `{name}`; its engines are {}",
                version.describe(),
                version.engines().collect::<Vec<_>>().join(", ")
            ),
        });
    };
    let engine = version.engines().find(|e| *e == name).expect("defaults found");
    // First: the notes below are read against it.
    notes.insert(
        0,
        format!(
            "read as {} ({why}); model_engine={engine} ({origin})",
            version.describe()
        ),
    );
    let mut config = Config::new(defaults);
    if let Some(f) = &file {
        config.merge(f);
    }
    for o in &rest {
        config.apply(o).map_err(|e| match e {
            VerlError::UnknownKey {
                raw, key, suggestion, ..
            } => VerlError::UnknownKey {
                raw,
                key,
                suggestion,
                layout: format!(" as of {}, model_engine={engine}", version.describe()),
            },
            other => other,
        })?;
    }
    if version.has_reward_section() {
        move_legacy_reward_keys(&mut config, &mut notes);
    }
    Ok(Composed {
        config,
        version,
        engine,
        notes,
    })
}

/// The engine a config file's defaults list or the command line's group overrides choose.
#[derive(Default)]
struct EngineChoice {
    /// The engine and what chose it.
    chosen: Option<(&'static str, String)>,
}

impl EngineChoice {
    fn set(&mut self, engine: &str, origin: &str) -> Result<(), VerlError> {
        let Some(known) = ENGINES.iter().map(|e| e.name).find(|e| *e == engine) else {
            return Err(VerlError::Value {
                origin: format!("`{origin}`"),
                message: format!(
                    "`{engine}` is not one of VeRL's training engines (model_engine: dp, \
                     megatron, veomni, torchtitan)"
                ),
            });
        };
        self.chosen = Some((known, origin.to_string()));
        Ok(())
    }

    /// One `defaults` entry or group override: `group` (or `group@package`) chooses `option`.
    fn choose(&mut self, group: &str, option: Option<&str>, origin: &str) -> Result<(), VerlError> {
        let engine_of = |suffix: &str| option.and_then(|o| o.strip_suffix(&format!("_{suffix}")));
        match (group, option) {
            ("model_engine", Some(engine)) => self.set(engine, origin),
            ("ppo_trainer" | "_self_" | "legacy_reward_impl" | "reward_manager@reward_manager", None) => {
                Ok(())
            }
            ("ppo_megatron_trainer", None) => self.set("megatron", origin),
            (g, Some(o)) if STANDARD_CHOICES.contains(&(g, o)) => Ok(()),
            _ => match ENGINE_GROUPS.iter().find(|(g, _)| *g == group) {
                Some((_, suffix)) => match engine_of(suffix) {
                    Some("${model_engine}") => Ok(()),
                    Some(engine)
                        if ENGINES.iter().any(|e| e.name == engine)
                            && self.chosen.as_ref().is_none_or(|(e, _)| *e == engine) =>
                    {
                        self.set(engine, origin)
                    }
                    _ => Err(self.unknown(group, option, origin)),
                },
                None => Err(self.unknown(group, option, origin)),
            },
        }
    }

    fn unknown(&self, group: &str, option: Option<&str>, origin: &str) -> VerlError {
        VerlError::Value {
            origin: format!("`{origin}`"),
            message: format!(
                "chooses `{group}`{}, which is not one of the configs VeRL ships (a config from \
                 another package on `hydra.searchpath` is a training engine or feature grpo does \
                 not have); grpo verl composes VeRL's own: model_engine=dp, megatron, veomni or \
                 torchtitan, --config-name=ppo_trainer or ppo_megatron_trainer",
                option.map(|o| format!(" = `{o}`")).unwrap_or_default()
            ),
        }
    }
}

/// The `--config-name` file, read when it exists; VeRL's own config of that name otherwise.
fn config_file(
    input: &VerlInput,
    engine: &mut EngineChoice,
    notes: &mut Vec<String>,
) -> Result<Option<ConfigFile>, VerlError> {
    let Some(name) = &input.config_name else {
        if let Some(dir) = &input.config_path {
            return Err(VerlError::ConfigFile {
                file: dir.display().to_string(),
                message: "--config-path names the directory of --config-name; give --config-name too".into(),
            });
        }
        return Ok(None);
    };
    let stem = name.strip_suffix(".yaml").unwrap_or(name);
    let dir = input.config_path.clone().unwrap_or_else(|| PathBuf::from("."));
    let path = dir.join(format!("{stem}.yaml"));
    if path.is_file() {
        let file = ConfigFile::read(&path)?;
        for (group, option) in &file.defaults {
            let origin = format!(
                "{}: defaults: {group}{}",
                file.file,
                option.as_ref().map(|o| format!(": {o}")).unwrap_or_default()
            );
            engine.choose(group, option.as_deref(), &origin)?;
        }
        return Ok(Some(file));
    }
    match VERL_CONFIGS.iter().find(|(n, _)| *n == stem) {
        Some((_, engine_name)) => {
            engine.set(engine_name, &format!("--config-name={name}"))?;
            notes.push(format!(
                "--config-name={name}: {} is not here, so VeRL's own `{stem}` is composed, as \
                 main_ppo finds it in VeRL's package",
                path.display()
            ));
            Ok(None)
        }
        None => Err(VerlError::ConfigFile {
            file: path.display().to_string(),
            message: format!(
                "no such file, and `{stem}` is not one of VeRL's own configs ({}); give \
                 --config-path the directory that holds it",
                VERL_CONFIGS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    }
}

/// VeRL 0.7.1 kept its earlier reward keys at the top (`legacy_reward_impl.yaml`) and its
/// releases moved the ones set to the `reward` section before training
/// (`migrate_legacy_reward_impl`); grpo does the same, so a script of either era means what it
/// meant. `(legacy key or section, where it goes)`; a leaf moves only when not null.
const LEGACY_REWARD_MOVES: &[(&str, &str)] = &[
    ("reward_model.num_workers", "reward.num_workers"),
    ("reward_model.reward_manager", "reward.reward_manager.name"),
    ("reward_model.reward_loop_source", "reward.reward_manager.source"),
    (
        "reward_model.reward_loop_module_path",
        "reward.reward_manager.module.path",
    ),
    (
        "reward_model.reward_loop_class_name",
        "reward.reward_manager.module.name",
    ),
    ("reward_model.enable", "reward.reward_model.enable"),
    (
        "reward_model.enable_resource_pool",
        "reward.reward_model.enable_resource_pool",
    ),
    (
        "reward_model.n_gpus_per_node",
        "reward.reward_model.n_gpus_per_node",
    ),
    ("reward_model.nnodes", "reward.reward_model.nnodes"),
    ("reward_model.model.path", "reward.reward_model.model_path"),
    ("reward_model.reward_kwargs", "reward.reward_kwargs"),
    ("reward_model.rollout", "reward.reward_model.rollout"),
    ("custom_reward_function", "reward.custom_reward_function"),
    ("sandbox_fusion", "reward.sandbox_fusion"),
];

fn move_legacy_reward_keys(config: &mut Config, notes: &mut Vec<String>) {
    let mut moved = Vec::new();
    for (from, to) in LEGACY_REWARD_MOVES {
        let leaves: Vec<String> = config
            .values
            .iter()
            .filter(|(k, v)| super::table::within(k, from) && !v.is_null())
            .map(|(k, _)| k.clone())
            .collect();
        for leaf in leaves {
            let target = format!("{to}{}", &leaf[from.len()..]);
            config.rename(&leaf, &target);
            moved.push(format!("{leaf} -> {target}"));
        }
    }
    for section in ["reward_model", "custom_reward_function", "sandbox_fusion"] {
        config.remove(section);
    }
    if !moved.is_empty() {
        notes.push(format!(
            "VeRL 0.7.1 moved these keys to its `reward` section, and grpo reads them there as \
             VeRL 0.7.1-0.8 did: {}",
            moved.join(", ")
        ));
    }
}
