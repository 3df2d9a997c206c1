//! The devices of a run: the client of `cluster.device`, each role's device, and `dtype: auto`
//! decided for it.

use crate::recipe::{DTypeName, DeviceKind, Recipe};
use std::path::Path;
use xla::runtime::{CacheConfig, Client, ClientOptions, OptionValue};
use xla::DType;

/// The client for `cluster.device` (plugin from `cluster.plugin_path` or discovered). On CPU it
/// opens [`Recipe::cpu_devices`] devices: `cluster.cpu_device_count`, or `actor.mesh` when a
/// `dp`/`fsdp` learner asks for more.
pub fn open_client(recipe: &Recipe) -> xla::runtime::Result<Client> {
    let c = &recipe.cluster;
    let kind = c.device.plugin();
    let create_options = match c.device {
        DeviceKind::Cpu => vec![(
            "cpu_device_count".to_string(),
            OptionValue::Int(recipe.cpu_devices() as i64),
        )],
        _ => Vec::new(),
    };
    Client::new(
        kind,
        c.plugin_path.as_deref().map(Path::new),
        ClientOptions {
            create_options,
            cache: CacheConfig::from_env(),
        },
    )
}

/// The device kind the rollout computes on: `cluster.rollout_device` for rollout worker
/// processes, else `cluster.device` (the rollout runs in the orchestrator).
pub fn rollout_device(recipe: &Recipe) -> DeviceKind {
    match recipe.cluster.rollout_workers {
        0 => recipe.cluster.device,
        _ => recipe.cluster.rollout_device_kind(),
    }
}

/// The device kind the learner computes on: `cluster.learner_device` for a learner worker
/// process, else `cluster.device`.
pub fn learner_device(recipe: &Recipe) -> DeviceKind {
    match recipe.cluster.learner_workers {
        0 => recipe.cluster.device,
        _ => recipe.cluster.learner_device_kind(),
    }
}

/// The rollout's compute type: `rollout.dtype`, `auto` decided for [`rollout_device`].
pub fn rollout_dtype(recipe: &Recipe) -> DType {
    compute_dtype(recipe.rollout.dtype, rollout_device(recipe)).0
}

/// The learner's compute type: `actor.param_dtype`, `auto` decided for [`learner_device`].
pub fn actor_dtype(recipe: &Recipe) -> DType {
    compute_dtype(recipe.actor.param_dtype, learner_device(recipe)).0
}

/// A recipe dtype on a kind of device as the compute dtype, with the reason `auto` chose it
/// (`None` when the recipe named the type).
pub fn compute_dtype(name: DTypeName, device: DeviceKind) -> (DType, Option<String>) {
    match name {
        DTypeName::F32 => (DType::F32, None),
        DTypeName::Bf16 => (DType::BF16, None),
        DTypeName::Auto => {
            let (native, why) = device.plugin().bf16_support();
            (if native { DType::BF16 } else { DType::F32 }, Some(why))
        }
    }
}

/// What `auto` became for one recipe key, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DTypeChoice {
    /// `rollout.dtype` or `actor.param_dtype`.
    pub key: &'static str,
    /// `f32` or `bf16`.
    pub dtype: DTypeName,
    /// The device's capability in words (`this CPU (AMD EPYC) has AVX512-BF16`).
    pub reason: String,
}

impl DTypeChoice {
    /// One line per distinct choice, keys that chose alike joined: `rollout.dtype and
    /// actor.param_dtype: auto chose f32: this CPU (AMD EPYC) has no bf16 instructions ...`.
    pub fn lines(choices: &[DTypeChoice]) -> Vec<String> {
        let mut groups: Vec<(Vec<&str>, &DTypeChoice)> = Vec::new();
        for c in choices {
            match groups
                .iter_mut()
                .find(|(_, g)| g.dtype == c.dtype && g.reason == c.reason)
            {
                Some((keys, _)) => keys.push(c.key),
                None => groups.push((vec![c.key], c)),
            }
        }
        groups
            .into_iter()
            .map(|(keys, c)| {
                let name = if c.dtype == DTypeName::Bf16 { "bf16" } else { "f32" };
                format!("{}: auto chose {name}: {}", keys.join(" and "), c.reason)
            })
            .collect()
    }
}

/// The recipe with every `auto` compute type made concrete for the device its role runs on
/// ([`rollout_device`], [`learner_device`]), and what was chosen. The orchestrator hands the
/// resolved recipe to its workers, so every process of a run computes in the same types
/// whichever host it lands on.
pub fn resolve_auto_dtypes(recipe: &Recipe) -> (Recipe, Vec<DTypeChoice>) {
    resolve_auto_dtypes_on(recipe, rollout_device(recipe), learner_device(recipe))
}

/// [`resolve_auto_dtypes`] for given devices (`grpo compile` decides for its target).
pub fn resolve_auto_dtypes_on(
    recipe: &Recipe,
    rollout: DeviceKind,
    learner: DeviceKind,
) -> (Recipe, Vec<DTypeChoice>) {
    let mut resolved = recipe.clone();
    let mut choices = Vec::new();
    let keys: [(&'static str, &mut DTypeName, DeviceKind); 2] = [
        ("rollout.dtype", &mut resolved.rollout.dtype, rollout),
        ("actor.param_dtype", &mut resolved.actor.param_dtype, learner),
    ];
    for (key, name, device) in keys {
        if let (dtype, Some(reason)) = compute_dtype(*name, device) {
            *name = if dtype == DType::BF16 {
                DTypeName::Bf16
            } else {
                DTypeName::F32
            };
            choices.push(DTypeChoice {
                key,
                dtype: *name,
                reason,
            });
        }
    }
    (resolved, choices)
}
