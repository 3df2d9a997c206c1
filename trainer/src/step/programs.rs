//! Tracing the update programs: `train_step`, `accumulate`, `apply` and `log_probs`, for the
//! full batch shape and for each length bucket.

use xla::graph::{grad, BuildOptions, Graph, Program, Sharding, Tensor};
use xla::DType;

use crate::loss::{actor_loss, value_loss, ActorLoss, LossInputs, Normalizer};
use crate::optim::{clip_by_global_norm, global_grad_norm, AdamW};
use crate::sharding::LearnerMesh;
use crate::{Result, TrainerError};

use super::{InputSpec, PolicyOutput, StepConfig, StepLayout, NUM_SUMMED_METRICS};
use model::ParamSpec;

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
    /// Split parameters only (`fsdp` or tensor parallelism over several devices): programs that
    /// all-gather the sharded parameters into whole ones on every device (one per dtype the learner hands out: f32, and the compute
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

/// The declared loss inputs of one micro-batch, as traced tensors (a value model's `values`
/// in `old` and `returns` in `adv`).
struct LossArgs {
    old: Tensor,
    adv: Tensor,
    mask: Tensor,
    reference: Option<Tensor>,
    is_weights: Option<Tensor>,
    tokens: Tensor,
    seqs: Tensor,
}

fn loss_input_names(step: &StepConfig) -> Vec<&'static str> {
    if step.value_loss.is_some() {
        return vec!["values", "returns", "response_mask", "norm_tokens", "norm_seqs"];
    }
    let cfg = &step.loss;
    let mut names = vec!["old_log_probs", "advantages", "response_mask"];
    if cfg.use_kl_loss {
        names.push("ref_log_probs");
    }
    if cfg.rollout_is_weights {
        names.push("rollout_is_weights");
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
    let names = loss_input_names(cfg);
    let old = rows(names[0]);
    let adv = rows(names[1]);
    let mask = rows("response_mask");
    let reference = names.contains(&"ref_log_probs").then(|| rows("ref_log_probs"));
    let is_weights = names
        .contains(&"rollout_is_weights")
        .then(|| rows("rollout_is_weights"));
    let tokens = g.parameter("norm_tokens", DType::F32, &[]);
    let seqs = g.parameter("norm_seqs", DType::F32, &[]);
    LossArgs {
        old,
        adv,
        mask,
        reference,
        is_weights,
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
                &p.dims(),
                mesh.param_sharding(p),
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
        .filter_map(|(i, p)| mesh.param_sharding(p).map(|s| (first + i, s)))
        .collect()
}

fn build_options(donate: &[(usize, usize)], result_shardings: Vec<(usize, Sharding)>) -> BuildOptions {
    BuildOptions {
        donate: donate.to_vec(),
        result_shardings,
    }
}

/// What [`trace_loss_and_grads`] traced: the summed metric terms (the loss first,
/// [`StepConfig::metric_names`] order), the gradients with respect to the f32 masters, and
/// whether the policy routes (a mixture of experts: its router slots are reported).
struct TracedLoss {
    terms: Vec<Tensor>,
    grads: Vec<Tensor>,
    routed: bool,
}

/// Traces the model function and its loss (the actor loss, or a value model's value loss) on
/// `masters`. A mixture-of-experts policy adds `actor.router_aux_loss_coef` times its
/// load-balancing loss; its router terms are weighted by the micro-batch's share of the
/// mini-batch's rows, so the micro-batches' sum is the mini-batch's mean, as the loss is.
fn trace_loss_and_grads<F>(
    cfg: &StepConfig,
    masters: &[Tensor],
    frozen: &[Tensor],
    args: &LossArgs,
    batch: &[Tensor],
    policy: &F,
) -> std::result::Result<TracedLoss, xla::graph::GraphError>
where
    F: Fn(&[Tensor], &[Tensor]) -> PolicyOutput,
{
    let out = policy(&policy_params(cfg, masters, frozen), batch);
    let router = out.router.clone();
    let norm = Normalizer {
        tokens: args.tokens.clone(),
        seqs: args.seqs.clone(),
        response_len: Some(cfg.response_len as f64),
    };
    let terms = match &cfg.value_loss {
        Some(value_cfg) => {
            let vpreds = out.log_probs.convert_if_needed(DType::F32);
            let v = value_loss(value_cfg, &vpreds, &args.old, &args.adv, &args.mask, &norm);
            let zero = v.vf_loss.zeros_like();
            vec![
                v.vf_loss.clone(),
                v.vf_loss,
                v.vf_clipfrac,
                v.vpred_mean,
                zero.clone(),
                zero.clone(),
                zero,
            ]
        }
        None => {
            let inputs = LossInputs {
                log_probs: out.log_probs.convert_if_needed(DType::F32),
                entropy: out.entropy.map(|e| e.convert_if_needed(DType::F32)),
                old_log_probs: args.old.clone(),
                advantages: args.adv.clone(),
                response_mask: args.mask.clone(),
                ref_log_probs: args.reference.clone(),
                rollout_is_weights: args.is_weights.clone(),
                norm,
            };
            loss_terms(&actor_loss(&cfg.loss, &inputs))
        }
    };
    let mut terms = terms;
    let routed = router.is_some();
    match router {
        Some(r) => {
            let rows = args
                .mask
                .sum_axis(1, false)
                .gt(&args.mask.zeros_like().sum_axis(1, false));
            let rows = rows.convert(DType::F32).sum_all();
            let share = &rows / &args.seqs.convert_if_needed(DType::F32);
            let weighted = |t: &Tensor| t * &share;
            let aux = weighted(&r.aux_loss);
            let coef = cfg.loss.router_aux_loss_coef;
            if coef != 0.0 {
                terms[0] = &terms[0] + &(&aux * &aux.scalar_like(coef));
            }
            terms.extend([aux, weighted(&r.entropy), weighted(&r.load_max)]);
        }
        None => {
            let zero = terms[0].zeros_like();
            terms.extend([zero.clone(), zero.clone(), zero]);
        }
    }
    let refs: Vec<&Tensor> = masters.iter().collect();
    let grads = grad(&terms[0], &refs)?;
    Ok(TracedLoss { terms, grads, routed })
}

/// What the policy function receives as its parameters: the trainable ones in the compute
/// type, then the frozen ones.
fn policy_params(cfg: &StepConfig, masters: &[Tensor], frozen: &[Tensor]) -> Vec<Tensor> {
    masters
        .iter()
        .map(|p| p.convert_if_needed(cfg.compute_dtype))
        .chain(frozen.iter().cloned())
        .collect()
}

/// Declares the frozen tensors, after the batch inputs.
fn declare_frozen(g: &Graph, cfg: &StepConfig, mesh: &LearnerMesh) -> Vec<Tensor> {
    declare_params_as(g, &cfg.frozen, super::FROZEN_PREFIX, cfg.compute_dtype, mesh)
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
    /// The policy routes (a mixture of experts): the metrics' router slots are reported.
    pub routed: bool,
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
    match &cfg.value_loss {
        Some(value) => value.validate()?,
        None => cfg.loss.validate()?,
    }
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
    let devices = mesh.data_devices() as i64;
    for input in inputs {
        if devices > 1 && input.dims.first().is_none_or(|&rows| rows % devices != 0) {
            return Err(TrainerError::Config {
                key: "actor.strategy",
                value: cfg.parallel.strategy.name().to_string(),
                message: format!(
                    "the policy input {} has shape {:?}; splitting rows over the mesh needs every \
                     input's first dimension to divide by the {devices} devices of its data axis",
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
    let frozen = declare_frozen(&g, cfg, &mesh);
    let TracedLoss { terms, grads, routed } =
        trace_loss_and_grads(cfg, &masters, &frozen, &args, &batch, &policy)
            .map_err(graph_err("train_step"))?;
    let results = trace_update(cfg, &masters, &m, &v, &step, &lr, &grads, &terms);
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
    let frozen = declare_frozen(&g, cfg, &mesh);
    let TracedLoss { terms, grads, .. } =
        trace_loss_and_grads(cfg, &masters, &frozen, &args, &batch, &policy)
            .map_err(graph_err("accumulate"))?;
    let mut results: Vec<Tensor> = acc.iter().zip(&grads).map(|(a, g)| a + g).collect();
    let terms: Vec<Tensor> = terms.iter().map(scalar1).collect();
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
    let frozen = declare_frozen(&g, cfg, &mesh);
    let out = policy(&policy_params(cfg, &masters, &frozen), &batch);
    let lp = out.log_probs.convert_if_needed(DType::F32);
    // With routing replay, the experts the pass used follow the log-probs.
    let results: Vec<&Tensor> = std::iter::once(&lp).chain(out.chosen.iter().flatten()).collect();
    let log_probs = g.build(&results).map_err(graph_err("log_probs"))?;

    Ok(ShapePrograms {
        train_step,
        accumulate,
        log_probs,
        routed,
        response_len,
        batch_inputs: inputs.to_vec(),
        loss_inputs: loss_input_names(cfg),
        partitions: mesh.devices(),
    })
}

/// Builds `train_step`, `accumulate` and `apply` for the policy function `policy(params,
/// batch)`, which receives the parameters in `cfg.compute_dtype` (in `params` order, then the
/// frozen tensors of `cfg.frozen`) and the
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
        metric_names: cfg.metric_names(shape.routed),
        loss_inputs: shape.loss_inputs.clone(),
        batch_inputs: inputs.to_vec(),
        bf16_outputs: cfg.compute_dtype != DType::F32,
        num_frozen: cfg.frozen.len(),
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

    // ---- gather_params (parameters split by fsdp or tensor parallelism) ----
    let mut gather_params = Vec::new();
    if mesh.splits_params() {
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
