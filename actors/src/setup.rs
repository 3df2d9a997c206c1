//! Turning a recipe into live compute objects, shared by the orchestrator and the workers so
//! both build exactly the same thing: the PJRT client of `cluster.device` and the rollout
//! engine of the `rollout` section.

use crate::prepare::Prepared;
use crate::recipe::{DTypeName, DeviceKind, Recipe};
use rollout::{Engine, EngineConfig};
use std::path::Path;
use xla::runtime::{Buffer, CacheConfig, Client, ClientOptions, OptionValue, PluginKind};
use xla::DType;

/// The client for `cluster.device` (plugin from `cluster.plugin_path` or discovered). On CPU it
/// opens [`Recipe::cpu_devices`] devices: `cluster.cpu_device_count`, or `actor.mesh` when a
/// `dp`/`fsdp` learner asks for more.
pub fn open_client(recipe: &Recipe) -> xla::runtime::Result<Client> {
    let c = &recipe.cluster;
    let kind = match c.device {
        DeviceKind::Cpu => PluginKind::Cpu,
        DeviceKind::Cuda => PluginKind::Cuda,
        DeviceKind::Tpu => PluginKind::Tpu,
    };
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

/// A recipe dtype as the compute dtype.
pub fn dtype(name: DTypeName) -> DType {
    match name {
        DTypeName::F32 => DType::F32,
        DTypeName::Bf16 => DType::BF16,
    }
}

/// The engine settings of the `rollout` section: `rollout.max_num_seqs` KV slots of
/// `max_prompt_length + max_response_length` tokens, stopping on the model's end tokens.
pub fn engine_config(recipe: &Recipe, stop_token_ids: &[u32]) -> EngineConfig {
    let len = recipe.data.max_prompt_length + recipe.data.max_response_length;
    let mut settings = EngineConfig::new(recipe.rollout.max_num_seqs, len);
    settings.eos_token_ids = stop_token_ids.to_vec();
    settings
}

/// The rollout engine of a prepared run over `weights` (in `rollout.dtype`) at `version`.
/// Weights with a replica on each of devices `0..N` (an in-process rollout colocated with a
/// `dp`/`fsdp` learner over `N` devices, see [`rollout::handoff`]) make an engine split over
/// those devices, data parallel over its slots; `rollout.max_num_seqs` must divide by `N`.
pub fn build_engine(
    recipe: &Recipe,
    prepared: &Prepared,
    client: &Client,
    weights: impl Into<rollout::EngineWeights>,
    version: u64,
) -> rollout::Result<Engine> {
    Engine::new(
        client,
        &prepared.model.weights.config,
        weights,
        version,
        engine_config(recipe, &prepared.stop_token_ids),
        Some(prepared.tokenizer.tokenizer.clone()),
    )
}

/// Uploads the prepared model's weights in `rollout.dtype` for a rollout engine.
pub fn upload_rollout_weights(
    recipe: &Recipe,
    prepared: &Prepared,
    client: &Client,
) -> rollout::Result<Vec<Buffer>> {
    rollout::upload_weights(client, &prepared.model.weights, dtype(recipe.rollout.dtype), 0)
}
