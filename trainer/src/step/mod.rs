//! The fused update programs and the host driver that owns their device buffers.
//!
//! [`build_train_programs`] traces three programs around a caller-supplied policy function
//! (parameters and batch tensors in, per-token log-probs and optionally entropy out):
//!
//! - `train_step`: forward, [`crate::loss::actor_loss`], backward, global-norm clipping and
//!   AdamW in ONE program, for a mini-batch that is a single micro-batch;
//! - `accumulate`: forward and backward of one micro-batch, adding its gradients and metrics
//!   into donated accumulators;
//! - `apply`: clipping and AdamW from the accumulated gradients; it hands the accumulators back
//!   zeroed (donated, so no new allocation per step).
//!
//! Gradient accumulation uses the `accumulate` + `apply` pair rather than one program with the
//! micro-batch loop unrolled: the unrolled program grows (and its compile time with it) with the
//! number of micro-batches, a different count per recipe or per step would mean another
//! compile, and XLA may schedule several unrolled forwards at once, raising peak memory, while
//! a micro-batch is the unit that must fit. Exactness is kept by normalising each micro-batch's
//! loss with the mini-batch's token and sequence counts (runtime scalars), so the sum of the
//! micro-batch gradients is the mini-batch gradient.
//!
//! Parameters, both Adam moments and the step count are donated and come back updated. The
//! numerical guard lives in the programs: when the loss or the pre-clip gradient norm is not
//! finite, every output selects the old parameters and state (nothing leaves the device) and the
//! metrics report `update_applied = 0`; [`Learner`] counts such steps and stops after the
//! configured number in a row with [`TrainerError::NonFinite`].
//!
//! Parameters are f32 master weights; with `compute_dtype = BF16` the policy receives bf16
//! copies (the gradient flows back through the conversion into f32) and the update programs
//! also return the new bf16 weights for the `logprobs`/rollout programs. Frozen tensors
//! ([`StepConfig::frozen`], a LoRA policy's base weights) are read by the programs after the
//! batch inputs, held in the compute type with no master copy, gradient or optimizer state
//! ([`Learner::set_frozen`]).
//!
//! Length buckets ([`crate::bucket`]): [`build_shape_programs`] builds `train_step`,
//! `accumulate` and `log_probs` for another batch shape (fewer prompt and response columns);
//! [`Learner::add_shape`] registers them beside the full shape of [`build_train_programs`].
//! All shapes share the parameters, optimizer state, accumulators and `apply`, so one
//! optimizer step may accumulate micro-batches of several shapes; each program compiles on
//! first use through the client's executable cache and is listed in [`Learner::compile_log`].
//!
//! [`StepConfig::parallel`] chooses the device layout ([`crate::sharding`]): `single` builds
//! single-device programs; `dp` and `fsdp` over `N > 1` devices build the same programs as
//! SPMD programs on a one-axis mesh (micro-batch rows split; parameters, moments and
//! accumulators replicated under `dp`, split under `fsdp`), with result shardings equal to the
//! argument shardings so donation still reuses each device's buffers. XLA's partitioner inserts
//! the collectives (gradient all-reduce, or parameter all-gather and gradient reduce-scatter),
//! so the step stays one program per device. [`Learner`] keeps one set of buffers per device
//! and runs every program with `execute_spmd`.

mod learner;
mod programs;

pub use learner::{
    mini_batch_normalizer, CompileRecord, HostArray, Learner, LearnerState, MicroBatch, MicroBatchHost,
    NonFiniteGuard, StepMetrics, UsedRoutes, CRITIC_STATE_FILES, POLICY_STATE_FILES,
};
pub use programs::{build_shape_programs, build_train_programs, ShapePrograms, TrainPrograms};

/// The name prefix of the frozen tensors' arguments ([`StepConfig::frozen`]) in the learner's
/// programs (`grpo compile` counts their bytes by it).
pub const FROZEN_PREFIX: &str = "frozen.";

use crate::config::{OptimConfig, Parallelism, PolicyLossConfig, ValueLossConfig};
use model::ParamSpec;
use xla::graph::Tensor;
use xla::DType;

/// A batch input of the policy function (token ids, positions, attention layout...), with the
/// micro-batch shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputSpec {
    /// Name, for messages.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Dimensions of one micro-batch.
    pub dims: Vec<i64>,
}

/// What the policy function returns: `[batch, response_len]` tensors.
#[derive(Clone, Debug)]
pub struct PolicyOutput {
    /// Per-token log-probs of the response tokens (any float type; converted to f32); for a
    /// value model ([`StepConfig::value_loss`]) its per-token values.
    pub log_probs: Tensor,
    /// Per-token entropy of the policy's distribution, needed for the entropy bonus and metric.
    pub entropy: Option<Tensor>,
    /// A mixture-of-experts policy's routing of this micro-batch.
    pub router: Option<RouterTerms>,
    /// With routing replay, the experts the pass used at each position, as the batch lays
    /// out the routes to replay (prompts, then responses; i32): what the log-probs program
    /// returns after the log-probs.
    pub chosen: Option<[Tensor; 2]>,
}

/// What a mixture-of-experts policy's routing adds to a micro-batch's loss and metrics
/// (scalars over the micro-batch's valid positions, prompts and responses).
#[derive(Clone, Debug)]
pub struct RouterTerms {
    /// The load-balancing loss ([`model::moe::load_balancing_loss`]), before
    /// `actor.router_aux_loss_coef`.
    pub aux_loss: Tensor,
    /// The router's entropy per valid position and MoE layer (nats).
    pub entropy: Tensor,
    /// Each MoE layer's busiest expert's tokens over the mean expert's (1: balanced), averaged
    /// over the layers.
    pub load_max: Tensor,
}

impl RouterTerms {
    /// The terms of `routes`, over `valid_positions` (a scalar count).
    pub fn of(
        config: &model::ModelConfig,
        routes: &model::moe::Routes,
        valid_positions: &Tensor,
    ) -> RouterTerms {
        let moe = config
            .moe
            .as_ref()
            .expect("routes come from a mixture-of-experts model");
        let layers = routes.entropy_sum.dims()[0] as f64;
        let count = valid_positions.convert_if_needed(DType::F32);
        let positions = (&count * &count.scalar_like(layers)).max(&count.scalar_like(1.0));
        let tokens = &routes.tokens_per_expert;
        let busiest = tokens.max_axis(1, false);
        let mean = (&tokens.sum_axis(1, false) * &tokens.scalar_like(1.0 / moe.num_experts as f64))
            .max(&tokens.scalar_like(1e-30));
        RouterTerms {
            aux_loss: model::moe::load_balancing_loss(moe, routes, &count),
            entropy: &routes.entropy_sum.sum_all() / &positions,
            load_max: &(&busiest / &mean).sum_all() * &count.scalar_like(1.0 / layers),
        }
    }
}

/// Everything the programs bake in.
#[derive(Clone, Debug)]
pub struct StepConfig {
    /// The loss side (`actor.*`).
    pub loss: PolicyLossConfig,
    /// The optimizer side (`actor.optim.*`, `actor.grad_clip`); the learning rate itself is
    /// passed per step.
    pub optim: OptimConfig,
    /// F32, or BF16 for bf16 weights in the forward pass with f32 master weights.
    pub compute_dtype: DType,
    /// Sequences per micro-batch (`actor.ppo_micro_batch_size`).
    pub micro_batch_size: i64,
    /// The response length rows are padded to at most (`data.max_response_length`): the
    /// response columns of [`build_train_programs`]' programs and the `L` that
    /// `seq-mean-token-sum-norm` divides by. Programs for a shorter length bucket
    /// ([`build_shape_programs`]) keep this `L` in the loss, so the bucket does not change it.
    pub response_len: i64,
    /// `actor.strategy` and `actor.mesh`: single device, data parallel or fully sharded over
    /// devices `0..mesh` of the learner's client (see [`crate::sharding`]). The mesh must be
    /// resolved (a number) for `dp` and `fsdp` before [`build_train_programs`].
    pub parallel: Parallelism,
    /// Tensors the policy reads but nothing trains (a LoRA policy's base weights), held in
    /// `compute_dtype` with no master copy, gradient or optimizer state
    /// ([`Learner::set_frozen`]). `train_step`, `accumulate` and `log_probs` take them after
    /// the batch inputs, and the policy function receives them after the trainable parameters.
    /// Empty for a full fine-tune.
    pub frozen: Vec<ParamSpec>,
    /// `Some` for a value model's programs (VeRL's critic): the model function's per-token
    /// output is its value prediction, the loss [`crate::loss::value_loss`] against the
    /// micro-batch's `returns`, clipped around its `values` (`loss` is then not read, and the
    /// metrics are [`VALUE_METRIC_NAMES`]).
    pub value_loss: Option<ValueLossConfig>,
}

impl StepConfig {
    /// The names of the metrics vector's entries for these programs.
    /// `routed`: the policy is a mixture of experts (its router slots are reported).
    pub fn metric_names(&self, routed: bool) -> [&'static str; NUM_METRICS] {
        let mut names = match self.value_loss {
            Some(_) => VALUE_METRIC_NAMES,
            None => METRIC_NAMES,
        };
        if !routed {
            names[ROUTER_METRICS].fill("");
        }
        names
    }
}

/// Length of the metrics vector.
pub const NUM_METRICS: usize = 13;

/// Names of the entries of the metrics vector every update program returns (f32).
pub const METRIC_NAMES: [&str; NUM_METRICS] = [
    "loss",
    "pg_loss",
    "pg_clipfrac",
    "pg_clipfrac_lower",
    "ppo_kl",
    "kl_loss",
    "entropy",
    "router_aux_loss",
    "router_entropy",
    "router_load_max",
    "grad_norm",
    "update_applied",
    "lr",
];

/// The slots of a mixture-of-experts policy's [`RouterTerms`] (`""` for a dense one).
const ROUTER_METRICS: std::ops::Range<usize> = 7..10;

/// The metrics vector of a value model's programs: the same layout, `""` for the summed slots
/// it leaves 0 (not reported).
pub const VALUE_METRIC_NAMES: [&str; NUM_METRICS] = [
    "loss",
    "vf_loss",
    "vf_clipfrac",
    "vpred_mean",
    "",
    "",
    "",
    "",
    "",
    "",
    "grad_norm",
    "update_applied",
    "lr",
];

/// How many leading metrics are sums over micro-batches (the loss terms).
pub const NUM_SUMMED_METRICS: usize = 10;

/// The argument and result positions of the three programs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepLayout {
    /// Number of parameter tensors `P`.
    pub num_params: usize,
    /// The names of the metrics vector's entries ([`StepConfig::metric_names`]).
    pub metric_names: [&'static str; NUM_METRICS],
    /// Names of the per-micro-batch loss inputs in argument order: `old_log_probs`,
    /// `advantages`, `response_mask`, then `ref_log_probs` (with `use_kl_loss`),
    /// `rollout_is_weights` (with `rollout_is_weights`), then the scalars `norm_tokens`,
    /// `norm_seqs`; a value model's: `values`, `returns`, `response_mask`, `norm_tokens`,
    /// `norm_seqs`.
    pub loss_inputs: Vec<&'static str>,
    /// The policy's batch inputs, after the loss inputs.
    pub batch_inputs: Vec<InputSpec>,
    /// Whether the update programs also return bf16 parameters (after the metrics).
    pub bf16_outputs: bool,
    /// Number of frozen tensors ([`StepConfig::frozen`]), the last arguments of `train_step`,
    /// `accumulate` and `log_probs`.
    pub num_frozen: usize,
}

impl StepLayout {
    /// `train_step` and `apply` arguments start with params `[0, P)`, first moments
    /// `[P, 2P)`, second moments `[2P, 3P)`, the i32 step count at `3P` and the f32 learning
    /// rate at `3P + 1`; results start with the same `3P + 1` updated tensors, then the metrics
    /// vector at `3P + 1`, then (bf16) `P` compute-dtype parameters.
    pub fn metrics_result(&self) -> usize {
        3 * self.num_params + 1
    }

    /// Index of the first micro-batch argument of `train_step` (loss inputs, then batch
    /// inputs).
    pub fn train_step_batch_start(&self) -> usize {
        3 * self.num_params + 2
    }

    /// Index of the first micro-batch argument of `accumulate` (after `P` gradient
    /// accumulators, the metric accumulator and `P` parameters).
    pub fn accumulate_batch_start(&self) -> usize {
        2 * self.num_params + 1
    }

    /// Number of micro-batch arguments.
    pub fn micro_batch_args(&self) -> usize {
        self.loss_inputs.len() + self.batch_inputs.len()
    }
}
