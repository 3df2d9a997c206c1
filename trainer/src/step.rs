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
//! also return the new bf16 weights for the `logprobs`/rollout programs.
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

use std::sync::Arc;
use xla::graph::{grad, BuildOptions, Graph, Program, Sharding, Tensor};
use xla::runtime::{Buffer, Client, Executable};
use xla::{DType, NativeType};

use crate::checkpoint::{Checkpoint, CheckpointError, HostTensor};
use crate::config::{OptimConfig, Parallelism, PolicyLossConfig, Strategy};
use crate::loss::{actor_loss, ActorLoss, LossInputs, Normalizer};
use crate::optim::{clip_by_global_norm, global_grad_norm, AdamW};
use crate::sharding::{gather_host, split_host, LearnerMesh};
use crate::{Result, TrainerError};

/// A trainable parameter: name (for messages and checkpoints) and shape; stored as f32.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// Name, e.g. `model.layers.0.mlp.up_proj.weight`.
    pub name: String,
    /// Dimensions.
    pub dims: Vec<i64>,
}

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
    /// Per-token log-probs of the response tokens (any float type; converted to f32).
    pub log_probs: Tensor,
    /// Per-token entropy of the policy's distribution, needed for the entropy bonus and metric.
    pub entropy: Option<Tensor>,
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
}

/// Names of the entries of the metrics vector every update program returns (f32).
pub const METRIC_NAMES: [&str; 10] = [
    "loss",
    "pg_loss",
    "pg_clipfrac",
    "pg_clipfrac_lower",
    "ppo_kl",
    "kl_loss",
    "entropy",
    "grad_norm",
    "update_applied",
    "lr",
];

/// How many leading metrics are sums over micro-batches (the loss terms).
pub const NUM_SUMMED_METRICS: usize = 7;

/// The argument and result positions of the three programs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepLayout {
    /// Number of parameter tensors `P`.
    pub num_params: usize,
    /// Names of the per-micro-batch loss inputs in argument order: `old_log_probs`,
    /// `advantages`, `response_mask`, then `ref_log_probs` (with `use_kl_loss`),
    /// `rollout_log_probs` (with `rollout_is_threshold`), then the scalars `norm_tokens`,
    /// `norm_seqs`.
    pub loss_inputs: Vec<&'static str>,
    /// The policy's batch inputs, after the loss inputs.
    pub batch_inputs: Vec<InputSpec>,
    /// Whether the update programs also return bf16 parameters (after the metrics).
    pub bf16_outputs: bool,
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

/// The learner's programs and their layout.
#[derive(Clone, Debug)]
pub struct TrainPrograms {
    /// Forward + loss + backward + clip + AdamW, one micro-batch = the mini-batch.
    pub train_step: Program,
    /// Forward + backward of one micro-batch into donated accumulators.
    pub accumulate: Program,
    /// Clip + AdamW from the accumulators; returns them zeroed.
    pub apply: Program,
    /// Forward only: the policy's per-token log-probs of one micro-batch (the old log-probs
    /// before an update, and the reference model's with frozen parameters).
    pub log_probs: Program,
    /// `fsdp` over several devices only: programs that all-gather the sharded parameters into
    /// whole ones on every device (one per dtype the learner hands out: f32, and the compute
    /// dtype when it differs), for [`Learner::shared_params`].
    pub gather_params: Vec<Program>,
    /// The mesh and tensor layouts the programs were built with (every program's
    /// [`Program::mesh`] is `mesh.mesh()`; its partition count is `mesh.devices()`).
    pub mesh: LearnerMesh,
    /// Argument/result positions.
    pub layout: StepLayout,
}

fn graph_err(program: &'static str) -> impl Fn(xla::graph::GraphError) -> TrainerError {
    move |source| TrainerError::Graph { program, source }
}

/// The declared loss inputs of one micro-batch, as traced tensors.
struct LossArgs {
    old: Tensor,
    adv: Tensor,
    mask: Tensor,
    reference: Option<Tensor>,
    rollout: Option<Tensor>,
    tokens: Tensor,
    seqs: Tensor,
}

fn loss_input_names(cfg: &PolicyLossConfig) -> Vec<&'static str> {
    let mut names = vec!["old_log_probs", "advantages", "response_mask"];
    if cfg.use_kl_loss {
        names.push("ref_log_probs");
    }
    if cfg.rollout_is_threshold.is_some() {
        names.push("rollout_log_probs");
    }
    names.extend(["norm_tokens", "norm_seqs"]);
    names
}

/// Declares a program argument, laid out by `sharding` when the graph has a mesh.
fn declare(g: &Graph, name: &str, dtype: DType, dims: &[i64], sharding: Option<Sharding>) -> Tensor {
    match sharding {
        Some(s) => g.parameter_sharded(name, dtype, dims, s),
        None => g.parameter(name, dtype, dims),
    }
}

/// A fresh graph on the learner's mesh (no mesh for single-device programs).
fn new_graph(name: &str, mesh: &LearnerMesh) -> Graph {
    let g = Graph::new(name);
    if let Some(m) = mesh.mesh() {
        g.set_mesh(m);
    }
    g
}

fn declare_loss_args(g: &Graph, cfg: &StepConfig, response_len: i64, mesh: &LearnerMesh) -> LossArgs {
    let bl = [cfg.micro_batch_size, response_len];
    let rows = |name: &str| declare(g, name, DType::F32, &bl, mesh.batch_sharding(2));
    let old = rows("old_log_probs");
    let adv = rows("advantages");
    let mask = rows("response_mask");
    let reference = cfg.loss.use_kl_loss.then(|| rows("ref_log_probs"));
    let rollout = cfg.loss.rollout_is_threshold.map(|_| rows("rollout_log_probs"));
    let tokens = g.parameter("norm_tokens", DType::F32, &[]);
    let seqs = g.parameter("norm_seqs", DType::F32, &[]);
    LossArgs {
        old,
        adv,
        mask,
        reference,
        rollout,
        tokens,
        seqs,
    }
}

fn declare_params(g: &Graph, specs: &[ParamSpec], prefix: &str, mesh: &LearnerMesh) -> Vec<Tensor> {
    declare_params_as(g, specs, prefix, DType::F32, mesh)
}

fn declare_params_as(
    g: &Graph,
    specs: &[ParamSpec],
    prefix: &str,
    dtype: DType,
    mesh: &LearnerMesh,
) -> Vec<Tensor> {
    specs
        .iter()
        .map(|p| {
            declare(
                g,
                &format!("{prefix}{}", p.name),
                dtype,
                &p.dims,
                mesh.param_sharding(&p.dims),
            )
        })
        .collect()
}

/// `(result index, sharding)` for the split parameter-shaped results `first..first + P`
/// (parameters, moments, accumulators, compute copies) of an `fsdp` program.
fn param_result_shardings(specs: &[ParamSpec], first: usize, mesh: &LearnerMesh) -> Vec<(usize, Sharding)> {
    specs
        .iter()
        .enumerate()
        .filter_map(|(i, p)| mesh.param_sharding(&p.dims).map(|s| (first + i, s)))
        .collect()
}

fn build_options(donate: &[(usize, usize)], result_shardings: Vec<(usize, Sharding)>) -> BuildOptions {
    BuildOptions {
        donate: donate.to_vec(),
        result_shardings,
    }
}

/// Traces the policy and the actor loss on `masters` and returns the loss terms and the
/// gradients with respect to the f32 masters.
fn trace_loss_and_grads<F>(
    cfg: &StepConfig,
    masters: &[Tensor],
    args: &LossArgs,
    batch: &[Tensor],
    policy: &F,
) -> std::result::Result<(ActorLoss, Vec<Tensor>), xla::graph::GraphError>
where
    F: Fn(&[Tensor], &[Tensor]) -> PolicyOutput,
{
    let compute: Vec<Tensor> = masters
        .iter()
        .map(|p| p.convert_if_needed(cfg.compute_dtype))
        .collect();
    let out = policy(&compute, batch);
    let inputs = LossInputs {
        log_probs: out.log_probs.convert_if_needed(DType::F32),
        entropy: out.entropy.map(|e| e.convert_if_needed(DType::F32)),
        old_log_probs: args.old.clone(),
        advantages: args.adv.clone(),
        response_mask: args.mask.clone(),
        ref_log_probs: args.reference.clone(),
        rollout_log_probs: args.rollout.clone(),
        norm: Normalizer {
            tokens: args.tokens.clone(),
            seqs: args.seqs.clone(),
            response_len: Some(cfg.response_len as f64),
        },
    };
    let loss = actor_loss(&cfg.loss, &inputs);
    let refs: Vec<&Tensor> = masters.iter().collect();
    let grads = grad(&loss.loss, &refs)?;
    Ok((loss, grads))
}

fn scalar1(t: &Tensor) -> Tensor {
    t.convert_if_needed(DType::F32).reshape(&[1])
}

/// The update shared by `train_step` and `apply`: guard, clip, AdamW, select. `terms` are the
/// summed metrics (loss first). Returns the results in layout order.
#[allow(clippy::too_many_arguments)]
fn trace_update(
    cfg: &StepConfig,
    masters: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    step: &Tensor,
    lr: &Tensor,
    grads: &[Tensor],
    terms: &[Tensor],
) -> Vec<Tensor> {
    let norm = global_grad_norm(grads);
    let finite = terms[0].is_finite().and(&norm.is_finite());
    let grads = match cfg.optim.grad_clip {
        Some(max_norm) => clip_by_global_norm(grads, &norm, max_norm),
        None => grads.to_vec(),
    };
    let next_step = step + &step.scalar_like(1.0);
    let t = next_step.convert(DType::F32);
    let adamw = AdamW::from_config(&cfg.optim);
    let mut new_p = Vec::new();
    let mut new_m = Vec::new();
    let mut new_v = Vec::new();
    for i in 0..masters.len() {
        let (p2, m2, v2) = adamw.update(&masters[i], &grads[i], &m[i], &v[i], &t, lr);
        new_p.push(finite.select(&p2, &masters[i]));
        new_m.push(finite.select(&m2, &m[i]));
        new_v.push(finite.select(&v2, &v[i]));
    }
    let new_step = finite.select(&next_step, step);
    let mut metric_parts: Vec<Tensor> = terms.iter().map(scalar1).collect();
    metric_parts.push(scalar1(&norm));
    metric_parts.push(scalar1(&finite.convert(DType::F32)));
    metric_parts.push(scalar1(lr));
    let refs: Vec<&Tensor> = metric_parts.iter().collect();
    let metrics = Tensor::concat(&refs, 0);
    let mut results = new_p.clone();
    results.extend(new_m);
    results.extend(new_v);
    results.push(new_step);
    results.push(metrics);
    if cfg.compute_dtype != DType::F32 {
        results.extend(new_p.iter().map(|p| p.convert(cfg.compute_dtype)));
    }
    results
}

fn loss_terms(loss: &ActorLoss) -> Vec<Tensor> {
    vec![
        loss.loss.clone(),
        loss.policy.pg_loss.clone(),
        loss.policy.pg_clipfrac.clone(),
        loss.policy.pg_clipfrac_lower.clone(),
        loss.policy.ppo_kl.clone(),
        loss.kl_loss.clone(),
        loss.entropy.clone(),
    ]
}

fn batch_args(g: &Graph, inputs: &[InputSpec], mesh: &LearnerMesh) -> Vec<Tensor> {
    inputs
        .iter()
        .map(|s| declare(g, &s.name, s.dtype, &s.dims, mesh.batch_sharding(s.dims.len())))
        .collect()
}

/// The programs that depend on the batch shape (one length bucket): `train_step`,
/// `accumulate` and `log_probs` for micro-batches of `cfg.micro_batch_size` rows with
/// `response_len` response columns and the policy inputs `batch_inputs`. `apply` and the
/// parameter gathers do not depend on the shape; [`TrainPrograms`] holds them once.
#[derive(Clone, Debug)]
pub struct ShapePrograms {
    /// Forward + loss + backward + clip + AdamW, one micro-batch = the mini-batch.
    pub train_step: Program,
    /// Forward + backward of one micro-batch into donated accumulators.
    pub accumulate: Program,
    /// Forward only: per-token log-probs `[micro_batch_size, response_len]`.
    pub log_probs: Program,
    /// Response columns of this shape.
    pub response_len: i64,
    /// The policy's batch inputs of this shape.
    pub batch_inputs: Vec<InputSpec>,
    /// The loss inputs (as [`StepLayout::loss_inputs`]).
    pub loss_inputs: Vec<&'static str>,
    /// Devices the programs are partitioned over.
    pub partitions: usize,
}

/// Checks what every program of the learner relies on and returns the mesh.
fn check_step_config(cfg: &StepConfig, params: &[ParamSpec], inputs: &[InputSpec]) -> Result<LearnerMesh> {
    cfg.loss.validate()?;
    cfg.optim.validate()?;
    if !matches!(cfg.compute_dtype, DType::F32 | DType::BF16) {
        return Err(TrainerError::Config {
            key: "actor.param_dtype",
            value: cfg.compute_dtype.to_string(),
            message: "parameters are computed in f32 or bf16".to_string(),
        });
    }
    if params.is_empty() {
        return Err(TrainerError::Config {
            key: "model",
            value: "0 parameters".to_string(),
            message: "the policy needs at least one trainable parameter".to_string(),
        });
    }
    let mesh = LearnerMesh::new(&cfg.parallel, cfg.micro_batch_size)?;
    let devices = mesh.devices() as i64;
    for input in inputs {
        if devices > 1 && input.dims.first().is_none_or(|&rows| rows % devices != 0) {
            return Err(TrainerError::Config {
                key: "actor.strategy",
                value: cfg.parallel.strategy.name().to_string(),
                message: format!(
                    "the policy input {} has shape {:?}; splitting rows over the mesh needs every \
                     input's first dimension to divide by the {devices} devices",
                    input.name, input.dims
                ),
            });
        }
    }
    Ok(mesh)
}

/// Builds the shape-dependent programs ([`ShapePrograms`]) for micro-batches whose policy
/// inputs are `inputs` and whose per-token tensors have `response_len` columns (a length
/// bucket at most `cfg.response_len`), for the policy function `policy(params, batch)` as in
/// [`build_train_programs`]. Register them with [`Learner::add_shape`].
pub fn build_shape_programs<F>(
    cfg: &StepConfig,
    params: &[ParamSpec],
    inputs: &[InputSpec],
    response_len: i64,
    policy: F,
) -> Result<ShapePrograms>
where
    F: Fn(&[Tensor], &[Tensor]) -> PolicyOutput,
{
    let mesh = check_step_config(cfg, params, inputs)?;
    if response_len < 1 || response_len > cfg.response_len {
        return Err(TrainerError::Config {
            key: "data.max_response_length",
            value: cfg.response_len.to_string(),
            message: format!(
                "a length bucket of {response_len} response columns is outside 1..={}; buckets \
                 never exceed the configured response length",
                cfg.response_len
            ),
        });
    }
    let n = params.len();
    let bf16 = cfg.compute_dtype != DType::F32;

    // ---- train_step ----
    let g = new_graph("train_step", &mesh);
    let masters = declare_params(&g, params, "", &mesh);
    let m = declare_params(&g, params, "adam_m.", &mesh);
    let v = declare_params(&g, params, "adam_v.", &mesh);
    let step = g.parameter("step", DType::I32, &[]);
    let lr = g.parameter("lr", DType::F32, &[]);
    let args = declare_loss_args(&g, cfg, response_len, &mesh);
    let batch = batch_args(&g, inputs, &mesh);
    let (loss, grads) =
        trace_loss_and_grads(cfg, &masters, &args, &batch, &policy).map_err(graph_err("train_step"))?;
    let results = trace_update(cfg, &masters, &m, &v, &step, &lr, &grads, &loss_terms(&loss));
    let refs: Vec<&Tensor> = results.iter().collect();
    let donate: Vec<(usize, usize)> = (0..=3 * n).map(|i| (i, i)).collect();
    let mut shardings: Vec<(usize, Sharding)> = (0..3)
        .flat_map(|group| param_result_shardings(params, group * n, &mesh))
        .collect();
    if bf16 {
        shardings.extend(param_result_shardings(params, 3 * n + 2, &mesh));
    }
    let train_step = g
        .build_with(&refs, &build_options(&donate, shardings))
        .map_err(graph_err("train_step"))?;

    // ---- accumulate ----
    let g = new_graph("accumulate", &mesh);
    let acc = declare_params(&g, params, "grad_acc.", &mesh);
    let metric_acc = g.parameter("metric_acc", DType::F32, &[NUM_SUMMED_METRICS as i64]);
    let masters = declare_params(&g, params, "", &mesh);
    let args = declare_loss_args(&g, cfg, response_len, &mesh);
    let batch = batch_args(&g, inputs, &mesh);
    let (loss, grads) =
        trace_loss_and_grads(cfg, &masters, &args, &batch, &policy).map_err(graph_err("accumulate"))?;
    let mut results: Vec<Tensor> = acc.iter().zip(&grads).map(|(a, g)| a + g).collect();
    let terms: Vec<Tensor> = loss_terms(&loss).iter().map(scalar1).collect();
    let term_refs: Vec<&Tensor> = terms.iter().collect();
    results.push(&metric_acc + &Tensor::concat(&term_refs, 0));
    let refs: Vec<&Tensor> = results.iter().collect();
    let donate: Vec<(usize, usize)> = (0..=n).map(|i| (i, i)).collect();
    let accumulate = g
        .build_with(
            &refs,
            &build_options(&donate, param_result_shardings(params, 0, &mesh)),
        )
        .map_err(graph_err("accumulate"))?;

    // ---- log_probs ----
    let g = new_graph("log_probs", &mesh);
    let masters = declare_params(&g, params, "", &mesh);
    let batch = batch_args(&g, inputs, &mesh);
    let compute: Vec<Tensor> = masters
        .iter()
        .map(|p| p.convert_if_needed(cfg.compute_dtype))
        .collect();
    let lp = policy(&compute, &batch).log_probs.convert_if_needed(DType::F32);
    let log_probs = g.build(&[&lp]).map_err(graph_err("log_probs"))?;

    Ok(ShapePrograms {
        train_step,
        accumulate,
        log_probs,
        response_len,
        batch_inputs: inputs.to_vec(),
        loss_inputs: loss_input_names(&cfg.loss),
        partitions: mesh.devices(),
    })
}

/// Builds `train_step`, `accumulate` and `apply` for the policy function `policy(params,
/// batch)`, which receives the parameters in `cfg.compute_dtype` (in `params` order) and the
/// batch tensors (in `inputs` order) and returns `[micro_batch_size, response_len]` log-probs
/// (and entropy). Validates the configuration first. The shape-dependent programs are those of
/// the full shape (`cfg.response_len` response columns); programs for shorter length buckets
/// come from [`build_shape_programs`].
pub fn build_train_programs<F>(
    cfg: &StepConfig,
    params: &[ParamSpec],
    inputs: &[InputSpec],
    policy: F,
) -> Result<TrainPrograms>
where
    F: Fn(&[Tensor], &[Tensor]) -> PolicyOutput,
{
    let shape = build_shape_programs(cfg, params, inputs, cfg.response_len, &policy)?;
    let mesh = LearnerMesh::new(&cfg.parallel, cfg.micro_batch_size)?;
    let n = params.len();
    let layout = StepLayout {
        num_params: n,
        loss_inputs: shape.loss_inputs.clone(),
        batch_inputs: inputs.to_vec(),
        bf16_outputs: cfg.compute_dtype != DType::F32,
    };
    let bf16 = layout.bf16_outputs;
    let ShapePrograms {
        train_step,
        accumulate,
        log_probs,
        ..
    } = shape;

    // ---- apply ----
    let g = new_graph("apply", &mesh);
    let masters = declare_params(&g, params, "", &mesh);
    let m = declare_params(&g, params, "adam_m.", &mesh);
    let v = declare_params(&g, params, "adam_v.", &mesh);
    let step = g.parameter("step", DType::I32, &[]);
    let lr = g.parameter("lr", DType::F32, &[]);
    let acc = declare_params(&g, params, "grad_acc.", &mesh);
    let metric_acc = g.parameter("metric_acc", DType::F32, &[NUM_SUMMED_METRICS as i64]);
    let terms: Vec<Tensor> = (0..NUM_SUMMED_METRICS as i64)
        .map(|i| metric_acc.slice_axis(0, i, i + 1).reshape(&[]))
        .collect();
    let mut results = trace_update(cfg, &masters, &m, &v, &step, &lr, &acc, &terms);
    let first_zero = results.len();
    results.extend(acc.iter().map(|a| a.zeros_like()));
    results.push(metric_acc.zeros_like());
    let refs: Vec<&Tensor> = results.iter().collect();
    let mut donate: Vec<(usize, usize)> = (0..=3 * n).map(|i| (i, i)).collect();
    for i in 0..=n {
        donate.push((3 * n + 2 + i, first_zero + i));
    }
    let mut shardings: Vec<(usize, Sharding)> = (0..3)
        .flat_map(|group| param_result_shardings(params, group * n, &mesh))
        .collect();
    if bf16 {
        shardings.extend(param_result_shardings(params, 3 * n + 2, &mesh));
    }
    shardings.extend(param_result_shardings(params, first_zero, &mesh));
    let apply = g
        .build_with(&refs, &build_options(&donate, shardings))
        .map_err(graph_err("apply"))?;

    // ---- gather_params (fsdp over several devices) ----
    let mut gather_params = Vec::new();
    if mesh.strategy() == Strategy::Fsdp && mesh.devices() > 1 {
        let mut dtypes = vec![DType::F32];
        if bf16 {
            dtypes.push(cfg.compute_dtype);
        }
        for dtype in dtypes {
            let g = new_graph("gather_params", &mesh);
            let shards = declare_params_as(&g, params, "", dtype, &mesh);
            // The results are replicated (the default on a mesh): the partitioner all-gathers.
            let whole: Vec<Tensor> = shards.iter().map(|t| t.convert_if_needed(dtype)).collect();
            let refs: Vec<&Tensor> = whole.iter().collect();
            gather_params.push(g.build(&refs).map_err(graph_err("gather_params"))?);
        }
    }

    Ok(TrainPrograms {
        train_step,
        accumulate,
        apply,
        log_probs,
        gather_params,
        mesh,
        layout,
    })
}

/// A micro-batch's device buffers in layout order: the loss inputs
/// ([`StepLayout::loss_inputs`]) then the policy's batch inputs, for each device of the
/// learner (device `d`'s rows under `dp` and `fsdp`).
pub struct MicroBatch {
    /// `per_device[d]`: device `d`'s buffers.
    pub per_device: Vec<Vec<Buffer>>,
    /// The [`Learner`] shape (length bucket) the buffers were uploaded for: 0 is the full
    /// shape of [`build_train_programs`], others come from [`Learner::add_shape`].
    pub shape: usize,
}

/// The shape-dependent programs of a [`Learner`] shape.
#[derive(Clone, Copy, Debug)]
enum ShapeProgram {
    TrainStep,
    Accumulate,
    LogProbs,
}

/// A batch input on the host.
#[derive(Clone, Debug, PartialEq)]
pub enum HostArray {
    /// f32 values, row-major.
    F32(Vec<f32>),
    /// i32 values (token ids, positions), row-major.
    I32(Vec<i32>),
}

impl HostArray {
    /// A buffer of shape `dims` on device `device` holding these values.
    pub fn to_device(&self, client: &Client, dims: &[i64], device: usize) -> xla::runtime::Result<Buffer> {
        match self {
            HostArray::F32(v) => client.buffer_from_host(v, dims, device),
            HostArray::I32(v) => client.buffer_from_host(v, dims, device),
        }
    }
}

/// A micro-batch on the host, `[micro_batch_size, response_len]` row-major arrays.
#[derive(Clone, Debug, Default)]
pub struct MicroBatchHost {
    /// Old policy log-probs.
    pub old_log_probs: Vec<f32>,
    /// Per-token advantages.
    pub advantages: Vec<f32>,
    /// Response mask (1/0).
    pub response_mask: Vec<f32>,
    /// Reference log-probs (required with `use_kl_loss`).
    pub ref_log_probs: Option<Vec<f32>>,
    /// Rollout log-probs (required with `rollout_is_threshold`).
    pub rollout_log_probs: Option<Vec<f32>>,
    /// The mini-batch normaliser, from [`mini_batch_normalizer`].
    pub norm: (f32, f32),
    /// The policy's batch inputs in [`StepLayout::batch_inputs`] order.
    pub inputs: Vec<HostArray>,
}

/// `(tokens, seqs)` of a mini-batch: the response-mask sum and the number of rows, the
/// denominators every micro-batch of that mini-batch must use.
pub fn mini_batch_normalizer(response_mask: &[f32], response_len: usize) -> (f32, f32) {
    let tokens: f64 = response_mask.iter().map(|m| *m as f64).sum();
    (tokens as f32, (response_mask.len() / response_len.max(1)) as f32)
}

/// What one optimizer step reported (read back from the metrics vector).
#[derive(Clone, Debug, PartialEq)]
pub struct StepMetrics {
    /// The optimizer step this was (0-based count of attempted updates).
    pub step: u64,
    /// `METRIC_NAMES[i]` -> value.
    pub values: Vec<(&'static str, f64)>,
    /// Whether the parameters moved (false when a term was not finite).
    pub update_applied: bool,
    /// The terms that were not finite (`pg_loss`, `kl_loss`, `entropy`, `grad_norm`, `loss`).
    pub nonfinite_terms: Vec<&'static str>,
}

impl StepMetrics {
    /// The value of metric `name`.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.values.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }
}

/// Counts consecutive skipped updates and turns too many into an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NonFiniteGuard {
    /// How many skipped updates in a row stop the run.
    pub max_consecutive: u32,
    /// Skipped updates in a row so far.
    pub consecutive: u32,
}

impl NonFiniteGuard {
    /// A guard that stops after `max_consecutive` skipped updates in a row (at least 1).
    pub fn new(max_consecutive: u32) -> NonFiniteGuard {
        NonFiniteGuard {
            max_consecutive: max_consecutive.max(1),
            consecutive: 0,
        }
    }

    /// Records one step's outcome.
    pub fn observe(&mut self, metrics: &StepMetrics) -> Result<()> {
        if metrics.update_applied {
            self.consecutive = 0;
            return Ok(());
        }
        self.consecutive += 1;
        if self.consecutive >= self.max_consecutive {
            return Err(TrainerError::NonFinite {
                step: metrics.step,
                consecutive: self.consecutive,
                limit: self.max_consecutive,
                terms: metrics.nonfinite_terms.join(", "),
            });
        }
        Ok(())
    }
}

fn rt(what: impl Into<String>) -> impl FnOnce(xla::runtime::Error) -> TrainerError {
    let what = what.into();
    move |source| TrainerError::Runtime { what, source }
}

/// The learner's device state and compiled programs: parameters, Adam moments, step count,
/// accumulators. Buffers stay on the device between steps; only the metrics vector is read.
///
/// Under `dp` and `fsdp` every device of the mesh holds its own buffers (whole replicas or
/// shards, as [`TrainPrograms::mesh`] lays them out) and every program runs SPMD over devices
/// `0..N`; [`Learner::state`] gathers them back into whole host arrays, so checkpoints do not
/// depend on the strategy.
pub struct Learner {
    client: Client,
    programs: TrainPrograms,
    /// The layout of each parameter (also of its moments and accumulator).
    param_shardings: Vec<Option<Sharding>>,
    param_dims: Vec<Vec<i64>>,
    micro_batch_size: i64,
    /// The batch shapes (length buckets) the learner runs: 0 is the full shape of its
    /// [`TrainPrograms`], the others were added with [`Learner::add_shape`].
    shapes: Vec<ShapeSlot>,
    apply: Option<Executable>,
    /// Every program load (compile or executable-cache hit), in order.
    compiles: Vec<CompileRecord>,
    gather: Vec<Option<Executable>>,
    /// Frozen reference parameters (f32), when set: `[device][parameter]`.
    reference: Option<Vec<Vec<Buffer>>>,
    /// `[device][parameter]`. Device 0's are shared (not copied) with a rollout engine on that
    /// device; each step donates them and replaces them with the updated ones.
    params: Vec<Arc<[Buffer]>>,
    m: Vec<Vec<Buffer>>,
    v: Vec<Vec<Buffer>>,
    step: Vec<Buffer>,
    grad_acc: Vec<Vec<Buffer>>,
    metric_acc: Vec<Buffer>,
    compute_params: Option<Vec<Arc<[Buffer]>>>,
    /// `fsdp` over several devices: the whole parameters on device 0, gathered by the first
    /// [`Learner::shared_params`] after an update (`None` until then).
    gathered: Option<Arc<[Buffer]>>,
    guard: NonFiniteGuard,
    attempted_steps: u64,
}

/// The programs of one batch shape and their executables, compiled on first use.
struct ShapeSlot {
    programs: ShapePrograms,
    train_step: Option<Executable>,
    accumulate: Option<Executable>,
    log_probs: Option<Executable>,
}

impl ShapeSlot {
    fn new(programs: ShapePrograms) -> ShapeSlot {
        ShapeSlot {
            programs,
            train_step: None,
            accumulate: None,
            log_probs: None,
        }
    }
}

/// One program the learner loaded: compiled, or taken from the client's executable cache
/// (in memory or on disk; see `xla::runtime::ExecutableCache`).
#[derive(Clone, Debug, PartialEq)]
pub struct CompileRecord {
    /// `train_step`, `accumulate`, `apply`, `log_probs` or `gather_params`.
    pub program: String,
    /// The learner shape it belongs to (`None` for the shape-independent `apply` and
    /// `gather_params`).
    pub shape: Option<usize>,
    /// Wall time of the load, in seconds.
    pub seconds: f64,
}

/// Uploads a whole host array as one buffer per device: device `d`'s shard under `sharding`
/// (the whole array when replicated).
fn upload_split<T: NativeType>(
    client: &Client,
    values: &[T],
    dims: &[i64],
    sharding: Option<&Sharding>,
    devices: usize,
    what: &str,
) -> Result<Vec<Buffer>> {
    (0..devices)
        .map(|d| {
            let (shard, local) = split_host(values, dims, sharding, devices, d);
            client
                .buffer_from_host(&shard, &local, d)
                .map_err(rt(format!("uploading {what} to device {d}")))
        })
        .collect()
}

/// `per_tensor[t][d]` to `[d][t]`.
fn by_device(per_tensor: Vec<Vec<Buffer>>, devices: usize) -> Vec<Vec<Buffer>> {
    let mut out: Vec<Vec<Buffer>> = (0..devices)
        .map(|_| Vec::with_capacity(per_tensor.len()))
        .collect();
    for tensor in per_tensor {
        for (d, b) in tensor.into_iter().enumerate() {
            out[d].push(b);
        }
    }
    out
}

/// Runs `exe` on one device or SPMD over `args.len()` devices; returns `outputs[d][i]`.
fn run(exe: &Executable, args: &[Vec<&Buffer>], what: &str) -> Result<Vec<Vec<Buffer>>> {
    if args.len() == 1 {
        Ok(vec![exe
            .execute(&args[0])
            .map_err(rt(format!("running {what}")))?])
    } else {
        exe.execute_spmd(args).map_err(rt(format!("running {what}")))
    }
}

/// The learner's state on the host (for checkpoints): parameters and Adam moments as f32
/// arrays in [`ParamSpec`] order, and the AdamW step count.
#[derive(Clone, Debug, PartialEq)]
pub struct LearnerState {
    /// Master parameters.
    pub params: Vec<Vec<f32>>,
    /// First moments.
    pub m: Vec<Vec<f32>>,
    /// Second moments.
    pub v: Vec<Vec<f32>>,
    /// Completed AdamW updates (the bias-correction `t`).
    pub adam_step: i32,
}

impl LearnerState {
    /// The state before the first update: `params` with zero AdamW moments.
    pub fn fresh(params: Vec<Vec<f32>>) -> LearnerState {
        let zeros: Vec<Vec<f32>> = params.iter().map(|v| vec![0.0; v.len()]).collect();
        LearnerState {
            params,
            m: zeros.clone(),
            v: zeros,
            adam_step: 0,
        }
    }

    /// The checkpoint tensor files of this state: `params` (the f32 master weights under their
    /// [`ParamSpec`] names) and `optimizer` (`adam_m.NAME`, `adam_v.NAME` and `adam_step`, an
    /// f32 `[1]` tensor, exact up to 2^24 steps). Pass them to
    /// [`crate::checkpoint::save_checkpoint`].
    pub fn to_tensor_files(&self, specs: &[ParamSpec]) -> Vec<(&'static str, Vec<HostTensor>)> {
        let dims = |p: &ParamSpec| p.dims.iter().map(|d| *d as usize).collect::<Vec<_>>();
        let params = specs
            .iter()
            .zip(&self.params)
            .map(|(p, v)| HostTensor::from_f32(&p.name, &dims(p), v))
            .collect();
        let mut opt: Vec<HostTensor> = Vec::new();
        for (p, (m, v)) in specs.iter().zip(self.m.iter().zip(&self.v)) {
            opt.push(HostTensor::from_f32(&format!("adam_m.{}", p.name), &dims(p), m));
            opt.push(HostTensor::from_f32(&format!("adam_v.{}", p.name), &dims(p), v));
        }
        opt.push(HostTensor::from_f32("adam_step", &[1], &[self.adam_step as f32]));
        vec![("params", params), ("optimizer", opt)]
    }

    /// Reads the state [`LearnerState::to_tensor_files`] saved, checking every tensor's
    /// presence and shape against `specs`.
    pub fn from_checkpoint(
        ck: &Checkpoint,
        specs: &[ParamSpec],
    ) -> std::result::Result<LearnerState, CheckpointError> {
        let get = |stem: &str, name: &str, dims: &[i64]| -> std::result::Result<Vec<f32>, CheckpointError> {
            let path = ck.dir.join(format!("{stem}.safetensors"));
            let t = ck.tensor(stem, name).ok_or_else(|| CheckpointError::Format {
                path: path.clone(),
                message: format!("tensor {name} is missing; the checkpoint was saved for another model"),
            })?;
            let want: Vec<usize> = dims.iter().map(|d| *d as usize).collect();
            if t.dims != want {
                return Err(CheckpointError::Format {
                    path,
                    message: format!(
                        "tensor {name} has shape {:?}; this model expects {want:?}",
                        t.dims
                    ),
                });
            }
            Ok(t.to_f32())
        };
        let mut state = LearnerState {
            params: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            adam_step: 0,
        };
        for p in specs {
            state.params.push(get("params", &p.name, &p.dims)?);
            state
                .m
                .push(get("optimizer", &format!("adam_m.{}", p.name), &p.dims)?);
            state
                .v
                .push(get("optimizer", &format!("adam_v.{}", p.name), &p.dims)?);
        }
        state.adam_step = get("optimizer", "adam_step", &[1])?[0] as i32;
        Ok(state)
    }
}

impl Learner {
    /// Uploads the initial f32 parameters (in [`ParamSpec`] order) with zero optimizer state.
    /// Programs compile on first use.
    pub fn new(
        client: &Client,
        programs: TrainPrograms,
        params: &[ParamSpec],
        cfg: &StepConfig,
        initial: &[Vec<f32>],
        max_consecutive_nonfinite: u32,
    ) -> Result<Learner> {
        let state = LearnerState::fresh(initial.to_vec());
        Learner::from_state(client, programs, params, cfg, &state, max_consecutive_nonfinite)
    }

    /// Uploads a saved state (whole host arrays, whatever strategy saved them), split or
    /// replicated over the devices of the programs' mesh.
    pub fn from_state(
        client: &Client,
        programs: TrainPrograms,
        params: &[ParamSpec],
        cfg: &StepConfig,
        state: &LearnerState,
        max_consecutive_nonfinite: u32,
    ) -> Result<Learner> {
        let devices = programs.mesh.devices();
        if client.num_devices() < devices {
            return Err(TrainerError::Config {
                key: "actor.mesh",
                value: devices.to_string(),
                message: format!(
                    "the learner's client has {} device(s); lower actor.mesh, or on CPU open more \
                     devices with cluster.cpu_device_count",
                    client.num_devices()
                ),
            });
        }
        let param_shardings: Vec<Option<Sharding>> = params
            .iter()
            .map(|p| programs.mesh.param_sharding(&p.dims))
            .collect();
        let upload = |what: &str, values: &[Vec<f32>]| -> Result<Vec<Vec<Buffer>>> {
            if values.len() != params.len() {
                return Err(TrainerError::Length {
                    what: what.to_string(),
                    expected: params.len(),
                    got: values.len(),
                    unit: "parameter",
                });
            }
            let mut per_tensor = Vec::with_capacity(params.len());
            for ((p, v), sharding) in params.iter().zip(values).zip(&param_shardings) {
                let n = p.dims.iter().product::<i64>() as usize;
                if v.len() != n {
                    return Err(TrainerError::Length {
                        what: format!("{what} {}", p.name),
                        expected: n,
                        got: v.len(),
                        unit: "element",
                    });
                }
                per_tensor.push(upload_split(
                    client,
                    v,
                    &p.dims,
                    sharding.as_ref(),
                    devices,
                    &format!("{what} {}", p.name),
                )?);
            }
            Ok(by_device(per_tensor, devices))
        };
        let zeros: Vec<Vec<f32>> = params
            .iter()
            .map(|p| vec![0.0; p.dims.iter().product::<i64>() as usize])
            .collect();
        let replicated = |values: &[f32], dims: &[i64], what: &str| -> Result<Vec<Buffer>> {
            upload_split(client, values, dims, None, devices, what)
        };
        let uploaded_params: Vec<Arc<[Buffer]>> = upload("parameter", &state.params)?
            .into_iter()
            .map(Arc::from)
            .collect();
        let m = upload("adam_m", &state.m)?;
        let v = upload("adam_v", &state.v)?;
        let grad_acc = upload("grad_acc", &zeros)?;
        Ok(Learner {
            client: client.clone(),
            param_shardings,
            param_dims: params.iter().map(|p| p.dims.clone()).collect(),
            micro_batch_size: cfg.micro_batch_size,
            shapes: vec![ShapeSlot::new(ShapePrograms {
                train_step: programs.train_step.clone(),
                accumulate: programs.accumulate.clone(),
                log_probs: programs.log_probs.clone(),
                response_len: cfg.response_len,
                batch_inputs: programs.layout.batch_inputs.clone(),
                loss_inputs: programs.layout.loss_inputs.clone(),
                partitions: devices,
            })],
            apply: None,
            compiles: Vec::new(),
            gather: programs.gather_params.iter().map(|_| None).collect(),
            reference: None,
            params: uploaded_params,
            m,
            v,
            step: upload_split(client, &[state.adam_step], &[], None, devices, "the step count")?,
            grad_acc,
            metric_acc: replicated(
                &[0.0f32; NUM_SUMMED_METRICS],
                &[NUM_SUMMED_METRICS as i64],
                "the metric accumulator",
            )?,
            compute_params: None,
            gathered: None,
            guard: NonFiniteGuard::new(max_consecutive_nonfinite),
            attempted_steps: 0,
            programs,
        })
    }

    /// The program layout.
    pub fn layout(&self) -> &StepLayout {
        &self.programs.layout
    }

    /// The mesh and tensor layouts the learner runs with.
    pub fn mesh(&self) -> &LearnerMesh {
        &self.programs.mesh
    }

    /// Devices the learner's buffers and programs span (1 for `single`).
    pub fn devices(&self) -> usize {
        self.params.len()
    }

    /// The current f32 master parameters on device 0 (for the `logprobs` program when
    /// computing in f32). Under `fsdp` over several devices these are device 0's shards; see
    /// [`Learner::shared_params`] for whole ones.
    pub fn params(&self) -> &[Buffer] {
        &self.params[0]
    }

    /// Device `device`'s f32 master parameter buffers (whole replicas, or its shards under
    /// `fsdp`), e.g. to measure the per-device parameter memory. Panics if `device` is not
    /// below [`Learner::devices`].
    pub fn device_params(&self, device: usize) -> &[Buffer] {
        &self.params[device]
    }

    /// Every device's f32 master parameter buffers, `[device][parameter]` (whole replicas, or
    /// shards laid out as [`Learner::mesh`] says under `fsdp`), shared, not copied: the next
    /// [`Learner::step`] donates them, so take new ones after each step. For an on-device
    /// handoff to a rollout engine on the same devices.
    pub fn shared_device_params(&self) -> Vec<Arc<[Buffer]>> {
        self.params.clone()
    }

    /// The bf16 parameters from the last update on device 0 (None before the first update or
    /// in f32); shards under `fsdp` over several devices.
    pub fn compute_params(&self) -> Option<&[Buffer]> {
        self.compute_params.as_ref().map(|p| &*p[0])
    }

    /// The parameters a rollout engine on device 0 generates with: the bf16 copies after a
    /// bf16 update, the f32 masters otherwise, whole, in [`ParamSpec`] order.
    ///
    /// `single` and `dp`: device 0's own buffers, shared, not copied; the next
    /// [`Learner::step`] donates them, so hand the engine the new ones after each step.
    /// `fsdp` over several devices: whole copies on device 0, all-gathered from the shards by
    /// the `gather_params` program on the first call after an update and kept until the next
    /// update (device 0 then holds one whole copy besides its shards; the next step does not
    /// donate it). A rollout on the learner's own devices reads the shards in place instead
    /// (`rollout::handoff`) and never asks, so its steps gather nothing.
    pub fn shared_params(&mut self) -> Result<Arc<[Buffer]>> {
        if !self.programs.gather_params.is_empty() {
            return match &self.gathered {
                Some(whole) => Ok(whole.clone()),
                None => self.gather_shared(),
            };
        }
        Ok(match &self.compute_params {
            Some(p) => p[0].clone(),
            None => self.params[0].clone(),
        })
    }

    /// Under `fsdp` over several devices, all-gathers the parameters `shared_params` hands out
    /// into whole buffers on device 0, keeps them until the next update and returns them.
    fn gather_shared(&mut self) -> Result<Arc<[Buffer]>> {
        let (source, dtype) = match &self.compute_params {
            Some(p) => (p, self.programs.layout.bf16_outputs),
            None => (&self.params, false),
        };
        // gather_params[0] takes f32, gather_params[1] the compute dtype.
        let which = usize::from(dtype);
        let program = &self.programs.gather_params[which];
        Self::exe(
            &mut self.gather[which],
            program,
            &self.client,
            &mut self.compiles,
            None,
        )?;
        let args: Vec<Vec<&Buffer>> = source.iter().map(|p| p.iter().collect()).collect();
        let mut out = run(
            self.gather[which].as_ref().expect("compiled"),
            &args,
            "gather_params",
        )?;
        let whole: Arc<[Buffer]> = out.swap_remove(0).into();
        self.gathered = Some(whole.clone());
        Ok(whole)
    }

    /// Attempted optimizer steps so far.
    pub fn attempted_steps(&self) -> u64 {
        self.attempted_steps
    }

    /// Uploads frozen reference parameters (f32, in [`ParamSpec`] order, the shapes the
    /// learner was built with) for [`Learner::log_probs`] with `reference: true`, laid out
    /// like the trained parameters.
    pub fn set_reference(&mut self, values: &[Vec<f32>]) -> Result<()> {
        if values.len() != self.param_dims.len() {
            return Err(TrainerError::Length {
                what: "reference parameters".to_string(),
                expected: self.param_dims.len(),
                got: values.len(),
                unit: "parameter",
            });
        }
        let devices = self.devices();
        let mut per_tensor = Vec::with_capacity(values.len());
        for (i, (v, dims)) in values.iter().zip(&self.param_dims).enumerate() {
            let n = dims.iter().product::<i64>() as usize;
            if v.len() != n {
                return Err(TrainerError::Length {
                    what: format!("reference parameter {i}"),
                    expected: n,
                    got: v.len(),
                    unit: "element",
                });
            }
            per_tensor.push(upload_split(
                &self.client,
                v,
                dims,
                self.param_shardings[i].as_ref(),
                devices,
                "the reference parameters",
            )?);
        }
        self.reference = Some(by_device(per_tensor, devices));
        Ok(())
    }

    /// Uploads one policy input (checked against its spec), rows split over the mesh.
    fn upload_input(
        &self,
        spec: &InputSpec,
        arr: &HostArray,
    ) -> std::result::Result<Vec<Buffer>, Option<TrainerError>> {
        let n = spec.dims.iter().product::<i64>() as usize;
        let devices = self.devices();
        let sharding = self.programs.mesh.batch_sharding(spec.dims.len());
        let what = format!("input {}", spec.name);
        match (spec.dtype, arr) {
            (DType::F32, HostArray::F32(v)) if v.len() == n => {
                upload_split(&self.client, v, &spec.dims, sharding.as_ref(), devices, &what).map_err(Some)
            }
            (DType::I32, HostArray::I32(v)) if v.len() == n => {
                upload_split(&self.client, v, &spec.dims, sharding.as_ref(), devices, &what).map_err(Some)
            }
            _ => Err(None),
        }
    }

    /// The per-token log-probs `[micro_batch_size * response_len]` of one micro-batch's
    /// policy inputs (in [`StepLayout::batch_inputs`] order) under the current parameters, or
    /// under the reference parameters when `reference` (see [`Learner::set_reference`]).
    /// Nothing is updated. The full shape (0); see [`Learner::log_probs_in`].
    pub fn log_probs(&mut self, inputs: &[HostArray], reference: bool) -> Result<Vec<f32>> {
        self.log_probs_in(0, inputs, reference)
    }

    /// [`Learner::log_probs`] for inputs of shape `shape` (from [`Learner::add_shape`]): the
    /// result has that shape's `micro_batch_size * response_len` values.
    pub fn log_probs_in(&mut self, shape: usize, inputs: &[HostArray], reference: bool) -> Result<Vec<f32>> {
        let err = |message: String| TrainerError::Batch { index: 0, message };
        self.check_shape(shape, 0)?;
        let specs = self.shapes[shape].programs.batch_inputs.clone();
        if inputs.len() != specs.len() {
            return Err(err(format!(
                "{} policy inputs given; the policy takes {}",
                inputs.len(),
                specs.len()
            )));
        }
        let mut batch = Vec::with_capacity(specs.len());
        for (spec, arr) in specs.iter().zip(inputs) {
            match self.upload_input(spec, arr) {
                Ok(b) => batch.push(b),
                Err(Some(e)) => return Err(e),
                Err(None) => {
                    return Err(err(format!(
                        "input {} does not match {}{:?}",
                        spec.name, spec.dtype, spec.dims
                    )))
                }
            }
        }
        let batch = by_device(batch, self.devices());
        self.compile_shape(shape, ShapeProgram::LogProbs)?;
        let params: Vec<&[Buffer]> = if reference {
            self.reference
                .as_ref()
                .ok_or_else(|| {
                    err("reference log-probs were asked for but no reference parameters were set".to_string())
                })?
                .iter()
                .map(|p| p.as_slice())
                .collect()
        } else {
            self.params.iter().map(|p| &**p).collect()
        };
        let args: Vec<Vec<&Buffer>> = params
            .iter()
            .zip(&batch)
            .map(|(p, b)| p.iter().chain(b.iter()).collect())
            .collect();
        let exe = self.shapes[shape].log_probs.as_ref().expect("compiled");
        let out = run(exe, &args, "log_probs")?;
        // The result is replicated: device 0 holds all rows.
        out[0][0].to_host::<f32>().map_err(rt("reading log_probs"))
    }

    /// Uploads a host micro-batch, checking every array against the layout; its rows are split
    /// over the devices of the mesh. The full shape (0); see [`Learner::upload_micro_batch_in`].
    pub fn upload_micro_batch(&self, index: usize, mb: &MicroBatchHost) -> Result<MicroBatch> {
        self.upload_micro_batch_in(0, index, mb)
    }

    /// [`Learner::upload_micro_batch`] for shape `shape` (from [`Learner::add_shape`]): the
    /// per-token arrays have that shape's `response_len` columns and the policy inputs its
    /// dimensions.
    pub fn upload_micro_batch_in(
        &self,
        shape: usize,
        index: usize,
        mb: &MicroBatchHost,
    ) -> Result<MicroBatch> {
        self.check_shape(shape, index)?;
        let response_len = self.shapes[shape].programs.response_len;
        let n_tok = (self.micro_batch_size * response_len) as usize;
        let bl = [self.micro_batch_size, response_len];
        let devices = self.devices();
        let rows = self.programs.mesh.batch_sharding(2);
        let err = |message: String| TrainerError::Batch { index, message };
        let mut per_tensor: Vec<Vec<Buffer>> = Vec::new();
        let push_bl = |name: &str, v: Option<&Vec<f32>>, out: &mut Vec<Vec<Buffer>>| -> Result<()> {
            let v = v.ok_or_else(|| {
                err(format!(
                    "{name} is required by this configuration but was not given"
                ))
            })?;
            if v.len() != n_tok {
                return Err(err(format!(
                    "{name} has {} values; expected {} ({} x {})",
                    v.len(),
                    n_tok,
                    bl[0],
                    bl[1]
                )));
            }
            out.push(upload_split(&self.client, v, &bl, rows.as_ref(), devices, name)?);
            Ok(())
        };
        for name in &self.programs.layout.loss_inputs {
            match *name {
                "old_log_probs" => push_bl(name, Some(&mb.old_log_probs), &mut per_tensor)?,
                "advantages" => push_bl(name, Some(&mb.advantages), &mut per_tensor)?,
                "response_mask" => push_bl(name, Some(&mb.response_mask), &mut per_tensor)?,
                "ref_log_probs" => push_bl(name, mb.ref_log_probs.as_ref(), &mut per_tensor)?,
                "rollout_log_probs" => push_bl(name, mb.rollout_log_probs.as_ref(), &mut per_tensor)?,
                "norm_tokens" => per_tensor.push(upload_split(
                    &self.client,
                    &[mb.norm.0],
                    &[],
                    None,
                    devices,
                    name,
                )?),
                _ => per_tensor.push(upload_split(
                    &self.client,
                    &[mb.norm.1],
                    &[],
                    None,
                    devices,
                    name,
                )?),
            }
        }
        let specs = &self.shapes[shape].programs.batch_inputs;
        if mb.inputs.len() != specs.len() {
            return Err(err(format!(
                "{} batch inputs given; the policy takes {} ({})",
                mb.inputs.len(),
                specs.len(),
                specs
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        for (spec, arr) in specs.iter().zip(&mb.inputs) {
            match self.upload_input(spec, arr) {
                Ok(b) => per_tensor.push(b),
                Err(Some(e)) => return Err(e),
                Err(None) => {
                    let n = spec.dims.iter().product::<i64>() as usize;
                    let (kind, len) = match arr {
                        HostArray::F32(v) => ("f32", v.len()),
                        HostArray::I32(v) => ("i32", v.len()),
                    };
                    return Err(err(format!(
                        "input {} is {kind} with {len} values; expected {}{:?} ({n} values)",
                        spec.name, spec.dtype, spec.dims
                    )));
                }
            }
        }
        Ok(MicroBatch {
            per_device: by_device(per_tensor, devices),
            shape,
        })
    }

    fn check_shape(&self, shape: usize, index: usize) -> Result<()> {
        if shape >= self.shapes.len() {
            return Err(TrainerError::Batch {
                index,
                message: format!(
                    "shape {shape} was never added to this learner (it has {}); register its \
                     programs with Learner::add_shape first",
                    self.shapes.len()
                ),
            });
        }
        Ok(())
    }

    /// Loads `program` into `slot` unless it is there (through the client's executable cache,
    /// so a shape seen by an earlier learner or run is not compiled again) and records it.
    fn exe(
        slot: &mut Option<Executable>,
        program: &Program,
        client: &Client,
        compiles: &mut Vec<CompileRecord>,
        shape: Option<usize>,
    ) -> Result<()> {
        if slot.is_none() {
            let started = std::time::Instant::now();
            *slot = Some(
                program
                    .compile(client)
                    .map_err(rt(format!("compiling {}", program.name())))?,
            );
            compiles.push(CompileRecord {
                program: program.name().to_string(),
                shape,
                seconds: started.elapsed().as_secs_f64(),
            });
        }
        Ok(())
    }

    fn compile_shape(&mut self, shape: usize, which: ShapeProgram) -> Result<()> {
        let slot = &mut self.shapes[shape];
        let (exe, program) = match which {
            ShapeProgram::TrainStep => (&mut slot.train_step, &slot.programs.train_step),
            ShapeProgram::Accumulate => (&mut slot.accumulate, &slot.programs.accumulate),
            ShapeProgram::LogProbs => (&mut slot.log_probs, &slot.programs.log_probs),
        };
        Self::exe(exe, program, &self.client, &mut self.compiles, Some(shape))
    }

    /// Registers the programs of another batch shape (a length bucket, from
    /// [`build_shape_programs`] with this learner's configuration and parameter table) and
    /// returns its shape index for [`Learner::log_probs_in`] and
    /// [`Learner::upload_micro_batch_in`]. The parameters, optimizer state, accumulators and
    /// the `apply` program are shared by all shapes; the shape's programs compile on first use.
    pub fn add_shape(&mut self, programs: ShapePrograms) -> Result<usize> {
        let layout = &self.programs.layout;
        let mismatch = |message: String| TrainerError::Config {
            key: "actor.length_bucket",
            value: format!("{} response columns", programs.response_len),
            message,
        };
        if programs.loss_inputs != layout.loss_inputs {
            return Err(mismatch(format!(
                "the shape's programs take the loss inputs {:?}; this learner's take {:?} (build \
                 them with the learner's StepConfig)",
                programs.loss_inputs, layout.loss_inputs
            )));
        }
        if programs.partitions != self.devices() {
            return Err(mismatch(format!(
                "the shape's programs span {} device(s); this learner runs on {}",
                programs.partitions,
                self.devices()
            )));
        }
        let same_inputs = programs.batch_inputs.len() == layout.batch_inputs.len()
            && programs
                .batch_inputs
                .iter()
                .zip(&layout.batch_inputs)
                .all(|(a, b)| a.dtype == b.dtype && a.dims.len() == b.dims.len());
        if !same_inputs {
            return Err(mismatch(format!(
                "the shape's policy inputs {:?} do not match this learner's {:?} in number, type \
                 or rank",
                programs.batch_inputs, layout.batch_inputs
            )));
        }
        self.shapes.push(ShapeSlot::new(programs));
        Ok(self.shapes.len() - 1)
    }

    /// Shapes registered so far (1 + the [`Learner::add_shape`] calls).
    pub fn num_shapes(&self) -> usize {
        self.shapes.len()
    }

    /// The response columns of shape `shape`, if registered.
    pub fn shape_response_len(&self, shape: usize) -> Option<i64> {
        self.shapes.get(shape).map(|s| s.programs.response_len)
    }

    /// Every program this learner loaded so far (compiled or from the executable cache), in
    /// order; each program of each shape appears at most once.
    pub fn compile_log(&self) -> &[CompileRecord] {
        &self.compiles
    }

    /// One optimizer step over a mini-batch given as micro-batches (all normalised with the
    /// mini-batch's [`mini_batch_normalizer`]) at learning rate `lr`: one micro-batch runs the
    /// fused `train_step`; several run `accumulate` for each and then `apply`. Returns the
    /// metrics; a skipped (non-finite) update is reported in them and becomes an error once
    /// the guard's limit of skipped updates in a row is reached.
    pub fn step(&mut self, micro_batches: &[MicroBatch], lr: f64) -> Result<StepMetrics> {
        let layout = self.programs.layout.clone();
        let n = layout.num_params;
        let devices = self.devices();
        for (i, mb) in micro_batches.iter().enumerate() {
            let message = if mb.shape >= self.shapes.len() {
                Some(format!(
                    "uploaded for shape {}, which this learner does not have ({} shapes)",
                    mb.shape,
                    self.shapes.len()
                ))
            } else if mb.per_device.len() != devices {
                Some(format!(
                    "uploaded for {} device(s); this learner runs on {devices}",
                    mb.per_device.len()
                ))
            } else if mb.per_device[0].len() != layout.micro_batch_args() {
                Some(format!(
                    "{} buffers; the programs take {}",
                    mb.per_device[0].len(),
                    layout.micro_batch_args()
                ))
            } else {
                None
            };
            if let Some(message) = message {
                return Err(TrainerError::Batch { index: i, message });
            }
        }
        let lr_buf = upload_split(
            &self.client,
            &[lr as f32],
            &[],
            None,
            devices,
            "the learning rate",
        )?;
        let outputs: Vec<Vec<Buffer>> = match micro_batches {
            [] => {
                return Err(TrainerError::Batch {
                    index: 0,
                    message: "a step needs at least one micro-batch".to_string(),
                })
            }
            [only] => {
                self.compile_shape(only.shape, ShapeProgram::TrainStep)?;
                let args: Vec<Vec<&Buffer>> = (0..devices)
                    .map(|d| {
                        let mut args: Vec<&Buffer> = Vec::new();
                        args.extend(self.params[d].iter());
                        args.extend(self.m[d].iter());
                        args.extend(self.v[d].iter());
                        args.push(&self.step[d]);
                        args.push(&lr_buf[d]);
                        args.extend(only.per_device[d].iter());
                        args
                    })
                    .collect();
                let exe = self.shapes[only.shape].train_step.as_ref().expect("compiled");
                run(exe, &args, "train_step")?
            }
            many => {
                for mb in many {
                    self.compile_shape(mb.shape, ShapeProgram::Accumulate)?;
                }
                Self::exe(
                    &mut self.apply,
                    &self.programs.apply,
                    &self.client,
                    &mut self.compiles,
                    None,
                )?;
                for mb in many {
                    let args: Vec<Vec<&Buffer>> = (0..devices)
                        .map(|d| {
                            let mut args: Vec<&Buffer> = Vec::new();
                            args.extend(self.grad_acc[d].iter());
                            args.push(&self.metric_acc[d]);
                            args.extend(self.params[d].iter());
                            args.extend(mb.per_device[d].iter());
                            args
                        })
                        .collect();
                    let exe = self.shapes[mb.shape].accumulate.as_ref().expect("compiled");
                    let out = run(exe, &args, "accumulate")?;
                    drop(args);
                    self.metric_acc.clear();
                    self.grad_acc.clear();
                    for mut o in out {
                        self.metric_acc.push(o.pop().expect("metric accumulator"));
                        self.grad_acc.push(o);
                    }
                }
                let args: Vec<Vec<&Buffer>> = (0..devices)
                    .map(|d| {
                        let mut args: Vec<&Buffer> = Vec::new();
                        args.extend(self.params[d].iter());
                        args.extend(self.m[d].iter());
                        args.extend(self.v[d].iter());
                        args.push(&self.step[d]);
                        args.push(&lr_buf[d]);
                        args.extend(self.grad_acc[d].iter());
                        args.push(&self.metric_acc[d]);
                        args
                    })
                    .collect();
                let out = run(self.apply.as_ref().expect("compiled"), &args, "apply")?;
                drop(args);
                self.metric_acc.clear();
                self.grad_acc.clear();
                let mut updates = Vec::with_capacity(devices);
                for mut o in out {
                    self.metric_acc.push(o.pop().expect("zeroed metric accumulator"));
                    self.grad_acc.push(o.split_off(o.len() - n));
                    updates.push(o);
                }
                updates
            }
        };
        self.params.clear();
        self.m.clear();
        self.v.clear();
        self.step.clear();
        let mut compute = Vec::new();
        let mut metrics_buf = None;
        for (d, o) in outputs.into_iter().enumerate() {
            let mut out = o.into_iter();
            self.params.push(out.by_ref().take(n).collect::<Vec<_>>().into());
            self.m.push(out.by_ref().take(n).collect());
            self.v.push(out.by_ref().take(n).collect());
            self.step.push(out.next().expect("step count"));
            let metrics = out.next().expect("metrics");
            if d == 0 {
                metrics_buf = Some(metrics);
            }
            if layout.bf16_outputs {
                compute.push(Arc::from(out.take(n).collect::<Vec<_>>()));
            }
        }
        if layout.bf16_outputs {
            self.compute_params = Some(compute);
        }
        // A whole copy gathered for the old parameters is stale; the next request gathers anew.
        self.gathered = None;
        let raw = metrics_buf
            .expect("device 0's outputs")
            .to_host::<f32>()
            .map_err(rt("reading the step metrics"))?;
        let values: Vec<(&'static str, f64)> = METRIC_NAMES
            .iter()
            .zip(&raw)
            .map(|(n, v)| (*n, *v as f64))
            .collect();
        let update_applied = raw[8] != 0.0;
        let nonfinite_terms = ["loss", "pg_loss", "kl_loss", "entropy", "grad_norm"]
            .into_iter()
            .filter(|name| values.iter().any(|(n, v)| n == name && !v.is_finite()))
            .collect();
        let metrics = StepMetrics {
            step: self.attempted_steps,
            values,
            update_applied,
            nonfinite_terms,
        };
        self.attempted_steps += 1;
        self.guard.observe(&metrics)?;
        Ok(metrics)
    }

    /// Copies parameters, Adam moments and the step count to the host (for a checkpoint),
    /// gathering shards into whole arrays: the state is the same whatever the strategy.
    pub fn state(&self) -> Result<LearnerState> {
        let read = |what: &str, per_device: Vec<&[Buffer]>| -> Result<Vec<Vec<f32>>> {
            (0..self.param_dims.len())
                .map(|i| {
                    let sharding = self.param_shardings[i].as_ref();
                    let holders = if sharding.is_some() { per_device.len() } else { 1 };
                    let shards = per_device[..holders]
                        .iter()
                        .map(|bufs| bufs[i].to_host::<f32>().map_err(rt(format!("reading {what}"))))
                        .collect::<Result<Vec<_>>>()?;
                    Ok(gather_host(shards, &self.param_dims[i], sharding))
                })
                .collect()
        };
        let step = self.step[0]
            .to_host::<i32>()
            .map_err(rt("reading the step count"))?;
        Ok(LearnerState {
            params: read("parameters", self.params.iter().map(|p| &**p).collect())?,
            m: read("adam_m", self.m.iter().map(|p| p.as_slice()).collect())?,
            v: read("adam_v", self.v.iter().map(|p| p.as_slice()).collect())?,
            adam_step: step[0],
        })
    }
}
