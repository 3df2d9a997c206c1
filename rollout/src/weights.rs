//! The rollout's parameters on its devices, and the on-device handoff that turns parameters
//! laid out by another program (the learner's, replicated or sharded, in its dtype) into them.
//!
//! An engine over `N` devices runs its programs SPMD on a mesh of `N / tp` slot groups x `tp`
//! tensor-parallel devices ([`crate::layout::CacheShape::mesh`]); each device holds every
//! parameter in the Megatron layout ([`model::ParamLayout`] with no FSDP axis): whole when `tp`
//! is 1 (one replica per device), its tensor-parallel shard otherwise ([`EngineWeights`]). A
//! learner in the same process lays its parameters out its own way on the same devices:
//! whole replicas under `dp`, data-axis shards under `fsdp`, model-axis shards under tensor
//! parallelism, f32 masters where the rollout may want bf16. [`handoff`] bridges the two with
//! one compiled program per pair of layouts, built on a mesh refining both
//! ([`xla::graph::Mesh::common_refinement`]), whose arguments carry the learner's shardings and
//! whose results carry the rollout's, in the rollout's dtype: XLA inserts the collectives and
//! converts, each device ends with its rollout shard, and the weights never pass through the
//! host nor gather whole onto one device. When the layouts already agree (same splits, same
//! dtype) the learner's buffers are used in place, with no program and no copy.

use std::sync::Arc;

use xla::graph::{Graph, Mesh, Sharding, Tensor};
use xla::runtime::{Buffer, Client};
use xla::DType;

use crate::error::{Result, RolloutError};
use crate::layout::{rollout_layout, rollout_mesh};
use model::lora::{lora_param_table, MergeLayout, MergeProgram};
use model::{param_table, HostTensor, LoraConfig, LoraForm, ModelConfig, ModelWeights, ParamSpec};

/// The rollout's parameters: each device's buffers of the whole parameter table, in device
/// order (one entry for a single-device engine), laid out by the rollout's tensor-parallel
/// size; for an engine that applies LoRA adapters beside its weights
/// ([`crate::EngineConfig::adapters`]), also each device's adapters, a second segment the
/// programs take after the weights, so a new adapter version replaces them alone. Cheap to
/// clone.
#[derive(Clone, Debug)]
pub struct EngineWeights {
    per_device: Vec<Arc<[Buffer]>>,
    /// `adapters[d]`: device `d`'s adapters (f32, [`lora_param_table`] order); empty when the
    /// engine applies none.
    adapters: Vec<Arc<[Buffer]>>,
    tensor_parallel: usize,
}

impl EngineWeights {
    /// Replicas of the same whole parameters, `replicas[d]` on the engine's `d`-th device.
    pub fn replicated(replicas: Vec<Arc<[Buffer]>>) -> EngineWeights {
        EngineWeights::laid_out(replicas, 1)
    }

    /// Device `d`'s buffers `per_device[d]`, split over a tensor-parallel axis of
    /// `tensor_parallel` devices by [`rollout_layout`] (1: whole replicas).
    pub fn laid_out(per_device: Vec<Arc<[Buffer]>>, tensor_parallel: usize) -> EngineWeights {
        EngineWeights {
            per_device,
            adapters: Vec::new(),
            tensor_parallel: tensor_parallel.max(1),
        }
    }

    /// Adapters alone (device `d`'s `adapters[d]`, laid out like the weights they go with), for
    /// [`crate::Engine::update_weights`] of an engine applying adapters: it keeps the weights
    /// it holds and takes these beside them.
    pub fn adapters_only(adapters: Vec<Arc<[Buffer]>>, tensor_parallel: usize) -> EngineWeights {
        EngineWeights {
            per_device: Vec::new(),
            adapters,
            tensor_parallel: tensor_parallel.max(1),
        }
    }

    /// These weights with `adapters` beside them (device `d`'s `adapters[d]`), replacing any.
    pub fn with_adapters(&self, adapters: Vec<Arc<[Buffer]>>) -> EngineWeights {
        EngineWeights {
            adapters,
            ..self.clone()
        }
    }

    /// Devices the weights are on.
    pub fn devices(&self) -> usize {
        self.per_device.len().max(self.adapters.len())
    }

    /// The tensor-parallel size of the layout (1: every device holds every parameter whole).
    pub fn tensor_parallel(&self) -> usize {
        self.tensor_parallel
    }

    /// The buffers on the engine's `d`-th device (the weights, without adapters).
    pub fn device(&self, d: usize) -> &Arc<[Buffer]> {
        &self.per_device[d]
    }

    /// Every device's buffers, in device order (the weights, without adapters).
    pub fn per_device(&self) -> &[Arc<[Buffer]>] {
        &self.per_device
    }

    /// Every device's adapters, in device order (empty without adapters).
    pub fn adapters(&self) -> &[Arc<[Buffer]>] {
        &self.adapters
    }

    /// Whether these hold no weights, only adapters ([`EngineWeights::adapters_only`]).
    pub fn is_adapters_only(&self) -> bool {
        self.per_device.is_empty() && !self.adapters.is_empty()
    }

    /// Every device's program arguments: its weights, then its adapters.
    pub fn args(&self) -> Vec<Vec<&Buffer>> {
        (0..self.devices())
            .map(|d| {
                let weights = self.per_device.get(d).into_iter().flat_map(|w| w.iter());
                weights
                    .chain(self.adapters.get(d).into_iter().flat_map(|a| a.iter()))
                    .collect()
            })
            .collect()
    }

    /// The whole parameters on the first device, when the layout splits nothing and no
    /// adapters are applied beside them (what a weight stream to a rollout worker reads);
    /// `None` otherwise.
    pub fn whole(&self) -> Option<&[Buffer]> {
        (self.tensor_parallel == 1 && self.adapters.is_empty())
            .then(|| self.per_device.first().map(|r| &r[..]).unwrap_or(&[]))
    }
}

impl From<Arc<[Buffer]>> for EngineWeights {
    fn from(params: Arc<[Buffer]>) -> EngineWeights {
        EngineWeights::replicated(vec![params])
    }
}

impl From<Vec<Buffer>> for EngineWeights {
    fn from(params: Vec<Buffer>) -> EngineWeights {
        EngineWeights::from(Arc::<[Buffer]>::from(params))
    }
}

/// Parameters as another program laid them out on devices `0..N` of a client: each device's
/// buffers (whole tensors or shards) and, per parameter, how it is split over `mesh` (`None`:
/// whole on every device). A single-device layout has one entry in `per_device`, no mesh and
/// no splits.
#[derive(Clone, Debug)]
pub struct SourceParams {
    /// The mesh the layout refers to (`None` for one device).
    pub mesh: Option<Mesh>,
    /// `per_device[d][i]`: device `d`'s buffer of parameter `i`.
    pub per_device: Vec<Arc<[Buffer]>>,
    /// `shardings[i]`: how parameter `i` is split (`None` = whole on every device).
    pub shardings: Vec<Option<Sharding>>,
    /// The parameter table the buffers follow (global shapes, tensor-parallel splits).
    pub specs: Vec<ParamSpec>,
}

impl SourceParams {
    /// Whole parameters on one device, following `specs`.
    pub fn single(params: Arc<[Buffer]>, specs: Vec<ParamSpec>) -> SourceParams {
        let shardings = params.iter().map(|_| None).collect();
        SourceParams {
            mesh: None,
            per_device: vec![params],
            shardings,
            specs,
        }
    }

    /// Devices the parameters are on.
    pub fn devices(&self) -> usize {
        self.per_device.len()
    }

    fn check(&self) -> Result<()> {
        let n = self.devices();
        let bad = |problem: String| Err(RolloutError::Config(format!("weight handoff: {problem}")));
        if n == 0 {
            return bad("no devices were given".into());
        }
        if n > 1 && self.mesh.as_ref().map(Mesh::num_devices) != Some(n) {
            return bad(format!(
                "{n} devices of parameters need a mesh of {n} devices, got {:?}",
                self.mesh
            ));
        }
        let count = self.specs.len();
        if self.shardings.len() != count {
            return bad(format!(
                "{} shardings for {count} parameters",
                self.shardings.len()
            ));
        }
        for (d, params) in self.per_device.iter().enumerate() {
            if params.len() != count {
                return bad(format!(
                    "device {d} holds {} parameters, expected {count}",
                    params.len()
                ));
            }
            if n > 1 {
                if let Some((i, b)) = params.iter().enumerate().find(|(_, b)| b.device() != d) {
                    return bad(format!(
                        "parameter {i} of device {d}'s list is on device {}",
                        b.device()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The rollout's weights in `dtype` on every device of `source`, laid out for a rollout with
/// tensor-parallel size `tensor_parallel` over those devices ([`rollout_layout`]), from
/// parameters laid out as `source` describes (`specs`: the parameter table they follow),
/// without passing through the host:
///
/// - the same layout and already in `dtype`, with `fresh` off: `source`'s own buffers, shared;
/// - otherwise: one compiled program (SPMD over a mesh refining the source's and the
///   rollout's) whose arguments carry the source's shardings and whose results carry the
///   rollout's, in `dtype`; XLA gathers, slices and converts on the devices. Its results are
///   new buffers, so `fresh` (used when the source's owner will donate or overwrite its
///   buffers while the rollout still reads them) costs one device copy of the weights.
///
/// Refuses a tensor-parallel size that does not divide the devices, or whose mesh does not
/// nest with the source's (e.g. 6 devices as data 2 x model 3 to model 2).
pub fn handoff(
    client: &Client,
    source: &SourceParams,
    dtype: DType,
    tensor_parallel: usize,
    fresh: bool,
) -> Result<EngineWeights> {
    source.check()?;
    let plan = HandoffPlan::new(source, tensor_parallel)?;
    let same_dtype = source.per_device[0].iter().all(|b| b.dtype() == dtype);
    if plan.in_place && same_dtype && !fresh {
        return Ok(EngineWeights::laid_out(
            source.per_device.clone(),
            tensor_parallel,
        ));
    }
    let program = plan.program(source, dtype)?;
    let exe = program
        .compile(client)
        .map_err(|e| RolloutError::runtime(format!("compiling {}", program.name()), e))?;
    let what = format!("running {}", program.name());
    let outputs = if source.devices() == 1 {
        let args: Vec<&Buffer> = source.per_device[0].iter().collect();
        vec![exe.execute(&args).map_err(|e| RolloutError::runtime(what, e))?]
    } else {
        let args: Vec<Vec<&Buffer>> = source.per_device.iter().map(|p| p.iter().collect()).collect();
        exe.execute_spmd(&args)
            .map_err(|e| RolloutError::runtime(what, e))?
    };
    Ok(EngineWeights::laid_out(
        outputs.into_iter().map(Arc::from).collect(),
        tensor_parallel,
    ))
}

/// The handoff of one pair of layouts: the mesh its program runs on and both layouts on it.
struct HandoffPlan {
    mesh: Option<Mesh>,
    from: Vec<Option<Sharding>>,
    to: Vec<Option<Sharding>>,
    /// The source already holds exactly the rollout's layout.
    in_place: bool,
}

impl HandoffPlan {
    fn new(source: &SourceParams, tensor_parallel: usize) -> Result<HandoffPlan> {
        let n = source.devices();
        let tp = tensor_parallel.max(1);
        let specs = &source.specs;
        if !n.is_multiple_of(tp) {
            return Err(RolloutError::Config(format!(
                "rollout.tensor_model_parallel_size = {tp} must divide the {n} devices the \
                 in-process rollout shares with the learner"
            )));
        }
        let target_mesh = rollout_mesh(n, tp);
        let layout = rollout_layout(tp);
        let target: Vec<Option<Sharding>> = specs.iter().map(|s| layout.sharding(s)).collect();
        let (mesh, from, to) = match (&source.mesh, &target_mesh) {
            (_, None) => (source.mesh.clone(), source.shardings.clone(), target),
            (None, Some(_)) => unreachable!("one source device means no rollout mesh"),
            (Some(src), Some(dst)) => {
                let r = src.common_refinement(dst).ok_or_else(|| {
                    RolloutError::Config(format!(
                        "weight handoff: the learner's mesh {:?} and the rollout's {:?} over the \
                         same {n} devices do not nest (their axes cut the devices at places that \
                         are not multiples of each other): pick rollout.tensor_model_parallel_size \
                         a divisor or a multiple of actor.tensor_model_parallel_size",
                        src.axes(),
                        dst.axes()
                    ))
                })?;
                let from = source
                    .shardings
                    .iter()
                    .map(|s| s.as_ref().map(|s| r.first(s)))
                    .collect();
                let to = target.iter().map(|s| s.as_ref().map(|s| r.second(s))).collect();
                (Some(r.mesh), from, to)
            }
        };
        let whole = |s: &Option<Sharding>| s.as_ref().is_none_or(Sharding::is_replicated);
        let in_place = from
            .iter()
            .zip(&to)
            .all(|(a, b)| a == b || (whole(a) && whole(b)));
        Ok(HandoffPlan {
            mesh,
            from,
            to,
            in_place,
        })
    }

    /// The program: arguments with the source's dtypes, global shapes and shardings; results
    /// the same tensors in `dtype` with the rollout's shardings.
    fn program(&self, source: &SourceParams, dtype: DType) -> Result<xla::graph::Program> {
        let n = source.devices();
        let split = |v: &[Option<Sharding>]| v.iter().filter(|s| s.is_some()).count();
        let name = format!(
            "rollout_weight_handoff_{}params_{}split_to_{}split_{}_on{n}",
            source.specs.len(),
            split(&self.from),
            split(&self.to),
            dtype.mlir()
        );
        let g = Graph::new(&name);
        if let Some(mesh) = self.mesh.as_ref().filter(|_| n > 1) {
            g.set_mesh(mesh.clone());
        }
        let outs: Vec<Tensor> = source.per_device[0]
            .iter()
            .zip(&source.specs)
            .zip(&self.from)
            .enumerate()
            .map(|(i, ((b, spec), sharding))| {
                let name = format!("param.{i}");
                let t = match sharding {
                    Some(s) if n > 1 => g.parameter_sharded(&name, b.dtype(), &spec.dims(), s.clone()),
                    _ => g.parameter(&name, b.dtype(), &spec.dims()),
                };
                // Results are new buffers even where nothing changes: arguments are not donated.
                t.convert_if_needed(dtype)
            })
            .collect();
        let refs: Vec<&Tensor> = outs.iter().collect();
        let options = xla::graph::BuildOptions {
            donate: Vec::new(),
            result_shardings: self
                .to
                .iter()
                .enumerate()
                .filter_map(|(i, s)| s.clone().filter(|_| n > 1).map(|s| (i, s)))
                .collect(),
        };
        g.build_with(&refs, &options)
            .map_err(|source| RolloutError::Graph {
                program: name.clone(),
                source,
            })
    }
}

/// An engine that is sent LoRA adapters instead of weights (a rollout worker of a LoRA run):
/// the frozen base in the engine's layout and how each version's adapters become the engine's
/// weights on its devices. In the merged form ([`LoraForm::Merged`]) a compiled merge
/// `W + s·B·A` over the engine's devices (each device merging its own shards under tensor
/// parallelism) makes new weights beside the base; in the applied form the engine applies the
/// adapters beside the base it already holds ([`crate::EngineConfig::adapters`]), so an update
/// is an upload. Only the adapters cross the network.
pub struct AdapterInstall {
    /// The compiled merge (the merged form only).
    merge: Option<MergeProgram>,
    base: EngineWeights,
    /// The adapters' table ([`lora_param_table`]), sent and uploaded in f32.
    specs: Vec<ParamSpec>,
    /// The engine's devices on the client, in mesh order.
    devices: Vec<usize>,
}

impl AdapterInstall {
    /// `lora` adapters installed in `form` beside `base` (a `config` model's weights in
    /// `dtype`, laid out for an engine on `devices` of `client`).
    pub fn new(
        client: &Client,
        config: &ModelConfig,
        lora: &LoraConfig,
        form: LoraForm,
        dtype: DType,
        base: EngineWeights,
        devices: &[usize],
    ) -> Result<AdapterInstall> {
        let specs = lora_param_table(config, lora);
        let tp = base.tensor_parallel();
        let merge = match form {
            LoraForm::Applied => None,
            LoraForm::Merged => {
                let layout = rollout_mesh(base.devices(), tp).map(|mesh| {
                    let l = rollout_layout(tp);
                    MergeLayout {
                        mesh,
                        adapters: specs.iter().map(|s| l.sharding(s)).collect(),
                        base: param_table(config).iter().map(|s| l.sharding(s)).collect(),
                    }
                });
                let program = MergeProgram::compile_over(client, config, lora, dtype, layout.as_ref())
                    .map_err(|e| RolloutError::Config(format!("compiling the LoRA merge: {e}")))?;
                Some(program)
            }
        };
        Ok(AdapterInstall {
            merge,
            base,
            specs,
            devices: devices.to_vec(),
        })
    }

    /// The adapters' table, in the order updates send them (each tensor f32).
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Uploads adapter `index` (its whole f32 little-endian bytes) to the engine's devices,
    /// each device its part.
    fn upload(&self, client: &Client, index: usize, bytes: &[u8]) -> xla::runtime::Result<Vec<Buffer>> {
        upload_parameter(client, &self.specs[index], DType::F32, bytes, &self.devices)
    }

    /// The engine's weights for the adapters `per_device[d]` (device `d`'s buffers, in
    /// [`AdapterInstall::specs`] order): the merged weights, or the base with these adapters.
    pub fn install(&self, per_device: Vec<Vec<Buffer>>) -> Result<EngineWeights> {
        let Some(merge) = &self.merge else {
            return Ok(self
                .base
                .with_adapters(per_device.into_iter().map(Arc::from).collect()));
        };
        let failed = |e: model::ProgramError| RolloutError::Config(format!("the LoRA merge: {e}"));
        let merged = match per_device.as_slice() {
            [one] => vec![merge.run(one, self.base.device(0)).map_err(failed)?],
            many => {
                let adapters: Vec<&[Buffer]> = many.iter().map(|d| &d[..]).collect();
                let base: Vec<&[Buffer]> = self.base.per_device().iter().map(|d| &d[..]).collect();
                merge.run_spmd(&adapters, &base).map_err(failed)?
            }
        };
        Ok(EngineWeights::laid_out(
            merged.into_iter().map(Arc::from).collect(),
            self.base.tensor_parallel(),
        ))
    }

    /// The engine's weights for adapters held on the host (f32, in [`AdapterInstall::specs`]
    /// order), e.g. those a run starts from.
    pub fn install_host(&self, client: &Client, adapters: &[HostTensor]) -> Result<EngineWeights> {
        let mut per_device: Vec<Vec<Buffer>> = self.devices.iter().map(|_| Vec::new()).collect();
        for (index, t) in adapters.iter().enumerate() {
            let parts = self
                .upload(client, index, &t.bytes)
                .map_err(|e| RolloutError::runtime(format!("uploading adapter `{}`", t.name), e))?;
            for (d, part) in parts.into_iter().enumerate() {
                per_device[d].push(part);
            }
        }
        self.install(per_device)
    }
}

/// Uploads `weights` (every [`param_table`] tensor) to `device` as `dtype` (F32 or BF16).
pub fn upload_weights(
    client: &Client,
    weights: &ModelWeights,
    dtype: DType,
    device: usize,
) -> Result<Vec<Buffer>> {
    Ok(upload_laid_out(client, weights, dtype, &[device], 1)?.swap_remove(0))
}

/// Uploads `weights` as `dtype` (F32 or BF16) for an engine on `devices` (one, or devices
/// `0..N` of the client) with tensor-parallel size `tensor_parallel`: each device gets its
/// part of [`rollout_layout`].
pub fn upload_weights_on(
    client: &Client,
    weights: &ModelWeights,
    dtype: DType,
    devices: &[usize],
    tensor_parallel: usize,
) -> Result<EngineWeights> {
    let per_device = upload_laid_out(client, weights, dtype, devices, tensor_parallel)?;
    Ok(EngineWeights::laid_out(
        per_device.into_iter().map(Arc::from).collect(),
        tensor_parallel,
    ))
}

/// Uploads one whole parameter, `bytes` of `dtype` in `spec`'s shape, to an engine's
/// `devices` (one per tensor-parallel device) in the rollout's layout: each device its part
/// ([`rollout_layout`] on [`rollout_mesh`]); on one device the bytes as they are. For weights
/// that arrive as host tensors (a learner worker's, a weight stream's chunks).
pub fn upload_parameter(
    client: &Client,
    spec: &ParamSpec,
    dtype: DType,
    bytes: &[u8],
    devices: &[usize],
) -> xla::runtime::Result<Vec<Buffer>> {
    let dims = spec.dims();
    if let [device] = devices {
        return Ok(vec![client.buffer_from_bytes(bytes, dtype, &dims, *device)?]);
    }
    let tp = devices.len();
    let whole = model::HostTensor {
        name: spec.name.clone(),
        dtype,
        shape: spec.shape.clone(),
        bytes: bytes.to_vec(),
    };
    let (mesh, sharding) = (rollout_mesh(tp, tp), rollout_layout(tp).sharding(spec));
    devices
        .iter()
        .enumerate()
        .map(|(d, &device)| {
            let part = whole.shard(sharding.as_ref(), mesh.as_ref(), d);
            let local: Vec<i64> = part.shape.iter().map(|&n| n as i64).collect();
            client.buffer_from_bytes(&part.bytes, dtype, &local, device)
        })
        .collect()
}

fn upload_laid_out(
    client: &Client,
    weights: &ModelWeights,
    dtype: DType,
    devices: &[usize],
    tensor_parallel: usize,
) -> Result<Vec<Vec<Buffer>>> {
    let table = param_table(&weights.config);
    let bad = |name: &str, problem: String| RolloutError::Weights {
        version: 0,
        index: table.iter().position(|s| s.name == name).unwrap_or(0),
        name: name.to_string(),
        problem,
    };
    if !matches!(dtype, DType::F32 | DType::BF16) {
        let first = table.first().map_or("", |s| s.name.as_str());
        return Err(bad(
            first,
            format!("weights can be f32 or bf16 on the device, not {dtype}"),
        ));
    }
    let tp = tensor_parallel.max(1);
    if !devices.len().is_multiple_of(tp) {
        return Err(RolloutError::Config(format!(
            "rollout.tensor_model_parallel_size = {tp} must divide the {} devices of the engine",
            devices.len()
        )));
    }
    let mesh = rollout_mesh(devices.len(), tp);
    model::programs::upload_params_on(
        client,
        weights,
        dtype,
        devices,
        mesh.as_ref(),
        &rollout_layout(tp),
    )
    .map_err(|e| match e {
        model::ProgramError::Weights { name, problem } => bad(&name, problem),
        model::ProgramError::Runtime { action, source } => RolloutError::runtime(action, source),
        other => RolloutError::Config(other.to_string()),
    })
}

/// Checks every device's buffers of `weights` against the parameter table (followed by the
/// `adapters`' table, f32, when the engine applies adapters), the rollout's layout
/// ([`rollout_layout`] on [`rollout_mesh`]) and its device in `devices`; returns the weights'
/// dtype.
pub(crate) fn check_layout(
    config: &ModelConfig,
    adapters: Option<&LoraConfig>,
    weights: &EngineWeights,
    dtype: Option<DType>,
    devices: &[usize],
    version: u64,
) -> Result<DType> {
    let mut table = param_table(config);
    let base = table.len();
    if let Some(lora) = adapters {
        table.extend(lora_param_table(config, lora));
    }
    let first = table.first().map(|s| s.name.clone()).unwrap_or_default();
    if weights.devices() != devices.len() {
        return Err(RolloutError::Weights {
            version,
            index: 0,
            name: first,
            problem: format!(
                "weights for {} device(s) were given; the engine runs on {} ({devices:?})",
                weights.devices(),
                devices.len()
            ),
        });
    }
    let tp = weights.tensor_parallel();
    if !devices.len().is_multiple_of(tp) {
        return Err(RolloutError::Weights {
            version,
            index: 0,
            name: first,
            problem: format!(
                "laid out for a tensor-parallel size of {tp}, which does not divide the engine's {} devices",
                devices.len()
            ),
        });
    }
    let mesh = rollout_mesh(devices.len(), tp);
    let layout = rollout_layout(tp);
    let local: Vec<Vec<i64>> = table
        .iter()
        .map(|spec| match (layout.sharding(spec), &mesh) {
            (Some(s), Some(m)) => s.local_dims(&spec.dims(), m),
            _ => spec.dims(),
        })
        .collect();
    let mut want = dtype;
    for (buffers, &device) in weights.args().iter().zip(devices) {
        want = Some(check_weights(
            &table, base, &local, buffers, want, device, version,
        )?);
    }
    Ok(want.unwrap_or(DType::F32))
}

/// One device's buffers against the table: the first `base` (the weights) all of one dtype
/// (`dtype`, or the first buffer's), the rest (adapters) f32.
#[allow(clippy::too_many_arguments)]
fn check_weights(
    table: &[ParamSpec],
    base: usize,
    local: &[Vec<i64>],
    weights: &[&Buffer],
    dtype: Option<DType>,
    device: usize,
    version: u64,
) -> Result<DType> {
    if weights.len() != table.len() {
        return Err(RolloutError::Weights {
            version,
            index: weights.len().min(table.len()),
            name: table
                .get(weights.len())
                .map(|s| s.name.clone())
                .unwrap_or_default(),
            problem: format!(
                "the parameter table has {} tensors, {} buffers were given",
                table.len(),
                weights.len()
            ),
        });
    }
    let want = dtype.unwrap_or_else(|| weights.first().map(|b| b.dtype()).unwrap_or(DType::F32));
    for (index, ((spec, dims), b)) in table.iter().zip(local).zip(weights).enumerate() {
        let problem = if b.dims() != dims.as_slice() {
            let whole = if *dims == spec.dims() {
                String::new()
            } else {
                format!(" (this device's tensor-parallel part of {:?})", spec.dims())
            };
            Some(format!("expected shape {dims:?}{whole}, found {:?}", b.dims()))
        } else if index < base && b.dtype() != want {
            Some(format!(
                "expected {want} (the compiled programs' weight type; a different type needs a new engine), found {}",
                b.dtype()
            ))
        } else if index >= base && b.dtype() != DType::F32 {
            Some(format!("an adapter must be f32, found {}", b.dtype()))
        } else if b.device() != device {
            Some(format!(
                "on device {}, the engine runs on device {device}",
                b.device()
            ))
        } else if b.is_donated() {
            Some("the buffer was donated to another program and no longer holds data".to_string())
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(RolloutError::Weights {
                version,
                index,
                name: spec.name.clone(),
                problem,
            });
        }
    }
    Ok(want)
}
