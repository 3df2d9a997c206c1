//! The rollout's parameters on its devices, and the on-device handoff that turns parameters
//! laid out by another program (the learner's, replicated or sharded, in its dtype) into them.
//!
//! An engine over `N` devices holds one whole replica of every parameter on each device
//! ([`EngineWeights`]): its programs run SPMD over the slots, so every device needs all the
//! weights. A learner in the same process lays its parameters out its own way on the same
//! devices: whole replicas under `dp`, first-dimension shards under `fsdp`, f32 masters where
//! the rollout may want bf16. [`handoff`] bridges the two with one compiled program per layout
//! whose arguments carry the learner's shardings and whose results are replicated in the
//! rollout's dtype: XLA inserts the all-gathers and converts, so the weights never pass
//! through the host. When the layouts already agree (replicated, same dtype) the learner's
//! buffers are used in place, with no program and no copy.

use std::sync::Arc;

use xla::graph::{Graph, Mesh, Sharding, Tensor};
use xla::runtime::{Buffer, Client};
use xla::DType;

use crate::error::{Result, RolloutError};
use model::{param_table, ModelConfig, ModelWeights};

/// The rollout's parameters: one replica of the whole parameter table per device of the
/// engine, in device order (one entry for a single-device engine). Cheap to clone.
///
/// Dereferences to the first device's replica, which is all a single-device consumer (a
/// weight stream to a rollout worker) needs.
#[derive(Clone, Debug)]
pub struct EngineWeights {
    replicas: Vec<Arc<[Buffer]>>,
}

impl EngineWeights {
    /// Replicas of the same parameters, `replicas[d]` on the engine's `d`-th device.
    pub fn replicated(replicas: Vec<Arc<[Buffer]>>) -> EngineWeights {
        EngineWeights { replicas }
    }

    /// Devices the weights are on.
    pub fn devices(&self) -> usize {
        self.replicas.len()
    }

    /// The replica on the engine's `d`-th device.
    pub fn replica(&self, d: usize) -> &Arc<[Buffer]> {
        &self.replicas[d]
    }

    /// Every replica, in device order.
    pub fn replicas(&self) -> &[Arc<[Buffer]>] {
        &self.replicas
    }
}

impl std::ops::Deref for EngineWeights {
    type Target = [Buffer];

    fn deref(&self) -> &[Buffer] {
        self.replicas.first().map(|r| &r[..]).unwrap_or(&[])
    }
}

impl From<Arc<[Buffer]>> for EngineWeights {
    fn from(params: Arc<[Buffer]>) -> EngineWeights {
        EngineWeights {
            replicas: vec![params],
        }
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
    /// Global shapes, per parameter.
    pub dims: Vec<Vec<i64>>,
}

impl SourceParams {
    /// Whole parameters on one device (the shapes are the buffers' own).
    pub fn single(params: Arc<[Buffer]>) -> SourceParams {
        let dims = params.iter().map(|b| b.dims().to_vec()).collect();
        let shardings = params.iter().map(|_| None).collect();
        SourceParams {
            mesh: None,
            per_device: vec![params],
            shardings,
            dims,
        }
    }

    /// Devices the parameters are on.
    pub fn devices(&self) -> usize {
        self.per_device.len()
    }

    /// Whether every device holds every parameter whole.
    pub fn is_replicated(&self) -> bool {
        self.shardings
            .iter()
            .all(|s| s.as_ref().is_none_or(Sharding::is_replicated))
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
        let count = self.dims.len();
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

/// The rollout's weights in `dtype`, replicated on every device of `source`, from parameters
/// laid out as `source` describes, without passing through the host:
///
/// - replicated and already in `dtype`, with `fresh` off: `source`'s own buffers, shared;
/// - otherwise: one compiled program (SPMD over the source's mesh) whose arguments carry the
///   source's shardings and whose results are replicated in `dtype`; XLA gathers the shards
///   and converts on the devices. Its results are new buffers, so `fresh` (used when the
///   source's owner will donate or overwrite its buffers while the rollout still reads
///   them) costs one device copy of the weights.
pub fn handoff(client: &Client, source: &SourceParams, dtype: DType, fresh: bool) -> Result<EngineWeights> {
    source.check()?;
    let same_dtype = source.per_device[0].iter().all(|b| b.dtype() == dtype);
    if source.is_replicated() && same_dtype && !fresh {
        return Ok(EngineWeights::replicated(source.per_device.clone()));
    }
    let program = handoff_program(source, dtype)?;
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
    Ok(EngineWeights::replicated(
        outputs.into_iter().map(Arc::from).collect(),
    ))
}

/// The handoff program: arguments with the source's dtypes, global shapes and shardings;
/// results the same tensors, whole, in `dtype` (replicated: the default on a mesh).
fn handoff_program(source: &SourceParams, dtype: DType) -> Result<xla::graph::Program> {
    let n = source.devices();
    let gathered = source.shardings.iter().filter(|s| s.is_some()).count();
    let name = format!(
        "rollout_weight_handoff_{}params_{}split_to_{}_on{n}",
        source.dims.len(),
        gathered,
        dtype.mlir()
    );
    let g = Graph::new(&name);
    if let Some(mesh) = &source.mesh {
        if n > 1 {
            g.set_mesh(mesh.clone());
        }
    }
    let outs: Vec<Tensor> = source.per_device[0]
        .iter()
        .zip(&source.dims)
        .zip(&source.shardings)
        .enumerate()
        .map(|(i, ((b, dims), sharding))| {
            let name = format!("param.{i}");
            let t = match sharding {
                Some(s) if n > 1 => g.parameter_sharded(&name, b.dtype(), dims, s.clone()),
                _ => g.parameter(&name, b.dtype(), dims),
            };
            // Results are new buffers even where nothing changes: arguments are not donated.
            t.convert_if_needed(dtype)
        })
        .collect();
    let refs: Vec<&Tensor> = outs.iter().collect();
    g.build(&refs).map_err(|source| RolloutError::Graph {
        program: name.clone(),
        source,
    })
}

/// Uploads `weights` (every [`param_table`] tensor) to `device` as `dtype` (F32 or BF16).
pub fn upload_weights(
    client: &Client,
    weights: &ModelWeights,
    dtype: DType,
    device: usize,
) -> Result<Vec<Buffer>> {
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
    model::programs::upload_params(client, weights, dtype, device).map_err(|e| match e {
        model::programs::ProgramError::Weights { name, problem } => bad(&name, problem),
        model::programs::ProgramError::Runtime { action, source } => RolloutError::runtime(action, source),
        other => RolloutError::Config(other.to_string()),
    })
}

/// Checks every replica of `weights` against the parameter table and its device in
/// `devices`; returns the weights' dtype.
pub(crate) fn check_replicas(
    config: &ModelConfig,
    weights: &EngineWeights,
    dtype: Option<DType>,
    devices: &[usize],
    version: u64,
) -> Result<DType> {
    if weights.devices() != devices.len() {
        return Err(RolloutError::Weights {
            version,
            index: 0,
            name: param_table(config)
                .first()
                .map(|s| s.name.clone())
                .unwrap_or_default(),
            problem: format!(
                "replicas for {} device(s) were given; the engine runs on {} ({devices:?})",
                weights.devices(),
                devices.len()
            ),
        });
    }
    let mut want = dtype;
    for (replica, &device) in weights.replicas().iter().zip(devices) {
        want = Some(check_weights(config, replica, want, device, version)?);
    }
    Ok(want.unwrap_or(DType::F32))
}

fn check_weights(
    config: &ModelConfig,
    weights: &[Buffer],
    dtype: Option<DType>,
    device: usize,
    version: u64,
) -> Result<DType> {
    let table = param_table(config);
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
    for (index, (spec, b)) in table.iter().zip(weights).enumerate() {
        let dims: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
        let problem = if b.dims() != dims.as_slice() {
            Some(format!("expected shape {:?}, found {:?}", dims, b.dims()))
        } else if b.dtype() != want {
            Some(format!(
                "expected {want} (the compiled programs' weight type; a different type needs a new engine), found {}",
                b.dtype()
            ))
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
