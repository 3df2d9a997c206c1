//! Where each of VeRL's training engines (`model_engine`: dp for FSDP, megatron, veomni,
//! torchtitan) keeps the settings grpo maps onto its learner: the compute type, the parallel
//! sizes and the learning-rate schedule. Keys are relative to the actor's section
//! (`actor_rollout_ref.actor.`); the schedule's to `SECTION.optim.`, the actor's or the
//! critic's.

/// One engine's keys. Keys under `fsdp_config.turbo_config` are read only with
/// `strategy: fsdp_turbo` ([`Engine::reads`]).
pub struct Engine {
    pub name: &'static str,
    /// The compute type: a dtype name (`bfloat16`, `float32`), or VeOmni's `mixed_precision`
    /// (true: bf16 compute with f32 master weights).
    pub dtype: Dtype,
    /// Tensor-parallel devices.
    pub tensor: Option<&'static str>,
    /// Pipeline stages (and virtual stages), which grpo does not have.
    pub pipeline: &'static [&'static str],
    /// Devices a sequence is split over (context parallelism, Ulysses).
    pub sequence: &'static [&'static str],
    /// Devices the experts are split over, and tensor parallelism inside an expert.
    pub expert: &'static [&'static str],
    /// The learning-rate schedule's keys.
    pub schedule: Schedule,
}

pub enum Dtype {
    Name(&'static str),
    MixedPrecision(&'static str),
}

/// How an engine says which schedule follows the warmup and where it ends (`optim.` keys).
pub struct Schedule {
    /// The key naming the schedule; `constant` and `cosine` are grpo's.
    pub kind: &'static str,
    /// The floor of the cosine: a fraction of `lr`, or an absolute learning rate.
    pub floor: Floor,
}

pub enum Floor {
    Ratio(&'static str),
    Absolute(&'static str),
}

pub const ENGINES: &[Engine] = &[
    Engine {
        name: "dp",
        dtype: Dtype::Name("fsdp_config.dtype"),
        tensor: Some("fsdp_config.turbo_config.distributed.tensor_parallel_size"),
        pipeline: &[],
        sequence: &[
            "fsdp_config.ulysses_sequence_parallel_size",
            "ulysses_sequence_parallel_size",
            "fsdp_config.turbo_config.distributed.ulysses_parallel_size",
        ],
        expert: &["fsdp_config.turbo_config.distributed.expert_parallel_size"],
        schedule: Schedule {
            kind: "lr_scheduler_type",
            floor: Floor::Ratio("min_lr_ratio"),
        },
    },
    Engine {
        name: "megatron",
        dtype: Dtype::Name("megatron.dtype"),
        tensor: Some("megatron.tensor_model_parallel_size"),
        pipeline: &[
            "megatron.pipeline_model_parallel_size",
            "megatron.virtual_pipeline_model_parallel_size",
        ],
        sequence: &["megatron.context_parallel_size"],
        expert: &[
            "megatron.expert_model_parallel_size",
            "megatron.expert_tensor_parallel_size",
        ],
        schedule: Schedule {
            kind: "lr_decay_style",
            floor: Floor::Absolute("min_lr"),
        },
    },
    Engine {
        name: "veomni",
        dtype: Dtype::MixedPrecision("veomni.mixed_precision"),
        tensor: None,
        pipeline: &[],
        sequence: &["veomni.ulysses_parallel_size"],
        expert: &["veomni.expert_parallel_size"],
        schedule: Schedule {
            kind: "lr_scheduler_type",
            floor: Floor::Absolute("lr_min"),
        },
    },
    Engine {
        name: "torchtitan",
        dtype: Dtype::Name("torchtitan.dtype"),
        tensor: Some("torchtitan.tensor_parallel_size"),
        pipeline: &["torchtitan.pipeline_parallel_size"],
        sequence: &["torchtitan.context_parallel_size"],
        expert: &["torchtitan.expert_parallel_size"],
        schedule: Schedule {
            kind: "decay_type",
            floor: Floor::Ratio("min_lr_factor"),
        },
    },
];

impl Engine {
    /// Whether VeRL reads the size `key` under `strategy`.
    pub fn reads(&self, key: &str, strategy: &str) -> bool {
        !key.contains("turbo_config") || strategy == "fsdp_turbo"
    }
}

/// The engine named `name` (one of [`ENGINES`]).
pub fn engine(name: &str) -> &'static Engine {
    ENGINES
        .iter()
        .find(|e| e.name == name)
        .expect("compose chooses one of VeRL's engines")
}
