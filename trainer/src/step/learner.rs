//! The host driver of the update programs: [`Learner`] owns the parameter, optimizer and
//! accumulator buffers on its devices, uploads micro-batches and runs the programs.

use std::sync::Arc;
use xla::graph::{assemble_host, shard_host, Mesh, Program, Sharding};
use xla::runtime::{Buffer, Client, Executable};
use xla::{DType, NativeType};

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::sharding::LearnerMesh;
use crate::{Result, TrainerError};
use model::{HostTensor, ParamSpec};

use super::programs::{ShapePrograms, TrainPrograms};
use super::{InputSpec, StepConfig, StepLayout, NUM_SUMMED_METRICS};

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
    /// Rollout importance weights (required with `rollout_is_weights`; see
    /// [`crate::rollout_correction`]).
    pub rollout_is_weights: Option<Vec<f32>>,
    /// A value model's values when the batch was made (required by a value model's programs;
    /// the policy's arrays are then empty).
    pub values: Option<Vec<f32>>,
    /// A value model's regression targets, GAE's returns (required with `values`).
    pub returns: Option<Vec<f32>>,
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
    /// Metric name ([`StepConfig::metric_names`]) -> value.
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

/// The experts a log-probs pass of a policy that replays routes used, as its batch lays out the
/// routes (`[U, P, Lm, k]` for the prompts, `[micro_batch_size, L, Lm, k]` for the responses).
pub type UsedRoutes = [Vec<i32>; 2];

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
    /// The mesh of the programs (`None` on one device).
    mesh: Option<Mesh>,
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
    /// [`StepConfig::frozen`] and the element type they are held in.
    frozen_specs: Vec<ParamSpec>,
    frozen_dtype: DType,
    /// The frozen tensors, `[device][tensor]` (empty per device until [`Learner::set_frozen`]);
    /// shared, since no program donates them.
    frozen: Vec<Arc<[Buffer]>>,
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

/// Uploads a whole host array as one buffer per device of `mesh` (one device without): device
/// `d`'s shard under `sharding` (the whole array when replicated).
fn upload_split<T: NativeType>(
    client: &Client,
    values: &[T],
    dims: &[i64],
    sharding: Option<&Sharding>,
    mesh: Option<&Mesh>,
    what: &str,
) -> Result<Vec<Buffer>> {
    (0..mesh.map_or(1, Mesh::num_devices))
        .map(|d| {
            let (shard, local) = shard_host(values, dims, sharding, mesh, d);
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

/// The checkpoint files of the policy's learner state (parameters, optimizer).
pub const POLICY_STATE_FILES: [&str; 2] = ["params", "optimizer"];
/// The checkpoint files of PPO's critic's state.
pub const CRITIC_STATE_FILES: [&str; 2] = ["critic_params", "critic_optimizer"];

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
        self.to_tensor_files_as(specs, POLICY_STATE_FILES)
    }

    /// [`LearnerState::to_tensor_files`] under the file stems `files` (parameters, optimizer):
    /// a second learner of a run (PPO's critic, [`CRITIC_STATE_FILES`]) beside the policy's.
    pub fn to_tensor_files_as(
        &self,
        specs: &[ParamSpec],
        files: [&'static str; 2],
    ) -> Vec<(&'static str, Vec<HostTensor>)> {
        let params = specs
            .iter()
            .zip(&self.params)
            .map(|(p, v)| HostTensor::from_f32(&p.name, p.shape.clone(), v))
            .collect();
        let mut opt: Vec<HostTensor> = Vec::new();
        for (p, (m, v)) in specs.iter().zip(self.m.iter().zip(&self.v)) {
            opt.push(HostTensor::from_f32(
                format!("adam_m.{}", p.name),
                p.shape.clone(),
                m,
            ));
            opt.push(HostTensor::from_f32(
                format!("adam_v.{}", p.name),
                p.shape.clone(),
                v,
            ));
        }
        opt.push(HostTensor::from_f32(
            "adam_step",
            vec![1],
            &[self.adam_step as f32],
        ));
        vec![(files[0], params), (files[1], opt)]
    }

    /// Reads the state [`LearnerState::to_tensor_files`] saved, checking every tensor's
    /// presence and shape against `specs`.
    pub fn from_checkpoint(
        ck: &Checkpoint,
        specs: &[ParamSpec],
    ) -> std::result::Result<LearnerState, CheckpointError> {
        Self::from_checkpoint_as(ck, specs, POLICY_STATE_FILES)
    }

    /// [`LearnerState::from_checkpoint`] from the file stems `files`.
    pub fn from_checkpoint_as(
        ck: &Checkpoint,
        specs: &[ParamSpec],
        files: [&'static str; 2],
    ) -> std::result::Result<LearnerState, CheckpointError> {
        let [params_file, optimizer_file] = files;
        let get =
            |stem: &str, name: &str, want: &[usize]| -> std::result::Result<Vec<f32>, CheckpointError> {
                let path = ck.dir.join(format!("{stem}.safetensors"));
                let t = ck.tensor(stem, name).ok_or_else(|| CheckpointError::Format {
                    path: path.clone(),
                    message: format!("tensor {name} is missing; the checkpoint was saved for another model"),
                })?;
                if t.shape != want {
                    return Err(CheckpointError::Format {
                        path,
                        message: format!(
                            "tensor {name} has shape {:?}; this model expects {want:?}",
                            t.shape
                        ),
                    });
                }
                Ok(t.to_f32_vec())
            };
        let mut state = LearnerState {
            params: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            adam_step: 0,
        };
        for p in specs {
            state.params.push(get(params_file, &p.name, &p.shape)?);
            state
                .m
                .push(get(optimizer_file, &format!("adam_m.{}", p.name), &p.shape)?);
            state
                .v
                .push(get(optimizer_file, &format!("adam_v.{}", p.name), &p.shape)?);
        }
        state.adam_step = get(optimizer_file, "adam_step", &[1])?[0] as i32;
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
        let mesh = programs.mesh.mesh();
        let param_shardings: Vec<Option<Sharding>> =
            params.iter().map(|p| programs.mesh.param_sharding(p)).collect();
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
                let n = p.numel();
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
                    &p.dims(),
                    sharding.as_ref(),
                    mesh.as_ref(),
                    &format!("{what} {}", p.name),
                )?);
            }
            Ok(by_device(per_tensor, devices))
        };
        let zeros: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.numel()]).collect();
        let replicated = |values: &[f32], dims: &[i64], what: &str| -> Result<Vec<Buffer>> {
            upload_split(client, values, dims, None, mesh.as_ref(), what)
        };
        let uploaded_params: Vec<Arc<[Buffer]>> = upload("parameter", &state.params)?
            .into_iter()
            .map(Arc::from)
            .collect();
        let m = upload("adam_m", &state.m)?;
        let v = upload("adam_v", &state.v)?;
        let grad_acc = upload("grad_acc", &zeros)?;
        let step = upload_split(
            client,
            &[state.adam_step],
            &[],
            None,
            mesh.as_ref(),
            "the step count",
        )?;
        let metric_acc = replicated(
            &[0.0f32; NUM_SUMMED_METRICS],
            &[NUM_SUMMED_METRICS as i64],
            "the metric accumulator",
        )?;
        Ok(Learner {
            client: client.clone(),
            mesh,
            param_shardings,
            param_dims: params.iter().map(ParamSpec::dims).collect(),
            micro_batch_size: cfg.micro_batch_size,
            shapes: vec![ShapeSlot::new(ShapePrograms {
                train_step: programs.train_step.clone(),
                accumulate: programs.accumulate.clone(),
                log_probs: programs.log_probs.clone(),
                routed: programs.layout.metric_names.contains(&"router_aux_loss"),
                response_len: cfg.response_len,
                batch_inputs: programs.layout.batch_inputs.clone(),
                loss_inputs: programs.layout.loss_inputs.clone(),
                partitions: devices,
            })],
            apply: None,
            compiles: Vec::new(),
            gather: programs.gather_params.iter().map(|_| None).collect(),
            reference: None,
            frozen_specs: cfg.frozen.clone(),
            frozen_dtype: cfg.compute_dtype,
            frozen: (0..devices).map(|_| Arc::from(Vec::new())).collect(),
            params: uploaded_params,
            m,
            v,
            step,
            grad_acc,
            metric_acc,
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
                self.mesh.as_ref(),
                "the reference parameters",
            )?);
        }
        self.reference = Some(by_device(per_tensor, devices));
        Ok(())
    }

    /// Uploads the frozen tensors ([`StepConfig::frozen`], in that order, f32 values held in
    /// the compute type), laid out over the mesh as parameters of their shapes are. Every
    /// program of a learner with frozen tensors needs them.
    pub fn set_frozen(&mut self, values: &[Vec<f32>]) -> Result<()> {
        if values.len() != self.frozen_specs.len() {
            return Err(TrainerError::Length {
                what: "frozen tensors".to_string(),
                expected: self.frozen_specs.len(),
                got: values.len(),
                unit: "tensor",
            });
        }
        let mut per_tensor = Vec::with_capacity(values.len());
        for (spec, v) in self.frozen_specs.iter().zip(values) {
            if v.len() != spec.numel() {
                return Err(TrainerError::Length {
                    what: format!("frozen tensor {}", spec.name),
                    expected: spec.numel(),
                    got: v.len(),
                    unit: "element",
                });
            }
            let sharding = self.programs.mesh.param_sharding(spec);
            let what = format!("frozen tensor {}", spec.name);
            let (client, mesh, dims) = (&self.client, self.mesh.as_ref(), spec.dims());
            per_tensor.push(match self.frozen_dtype {
                DType::BF16 => {
                    let narrow: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    upload_split(client, &narrow, &dims, sharding.as_ref(), mesh, &what)?
                }
                _ => upload_split(client, v, &dims, sharding.as_ref(), mesh, &what)?,
            });
        }
        self.frozen = by_device(per_tensor, self.devices())
            .into_iter()
            .map(Arc::from)
            .collect();
        Ok(())
    }

    /// The frozen tensors of device `d` ([`StepConfig::frozen`]), or an error when they were
    /// never set.
    pub fn frozen_params(&self, d: usize) -> Result<&[Buffer]> {
        let set = self.frozen.get(d).map_or(0, |f| f.len());
        if set != self.frozen_specs.len() {
            return Err(TrainerError::Length {
                what: "frozen tensors (Learner::set_frozen)".to_string(),
                expected: self.frozen_specs.len(),
                got: set,
                unit: "tensor",
            });
        }
        Ok(&self.frozen[d])
    }

    /// Every device's frozen tensors, `[device][tensor]`, shared, not copied (no program
    /// donates them): for a rollout engine on the same devices that applies adapters beside
    /// them.
    pub fn shared_frozen_params(&self) -> Result<Vec<Arc<[Buffer]>>> {
        (0..self.devices()).try_for_each(|d| self.frozen_params(d).map(|_| ()))?;
        Ok(self.frozen.clone())
    }

    /// Uploads one policy input (checked against its spec), rows split over the mesh.
    fn upload_input(
        &self,
        spec: &InputSpec,
        arr: &HostArray,
    ) -> std::result::Result<Vec<Buffer>, Option<TrainerError>> {
        let n = spec.dims.iter().product::<i64>() as usize;
        let sharding = self.programs.mesh.batch_sharding(spec.dims.len());
        let what = format!("input {}", spec.name);
        match (spec.dtype, arr) {
            (DType::F32, HostArray::F32(v)) if v.len() == n => upload_split(
                &self.client,
                v,
                &spec.dims,
                sharding.as_ref(),
                self.mesh.as_ref(),
                &what,
            )
            .map_err(Some),
            (DType::I32, HostArray::I32(v)) if v.len() == n => upload_split(
                &self.client,
                v,
                &spec.dims,
                sharding.as_ref(),
                self.mesh.as_ref(),
                &what,
            )
            .map_err(Some),
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
        Ok(self.log_probs_routed_in(shape, inputs, reference)?.0)
    }

    /// [`Learner::log_probs_in`] with, for a policy that replays routes, the experts the pass
    /// used ([`crate::step::PolicyOutput::chosen`]: the prompts' and the responses', i32).
    pub fn log_probs_routed_in(
        &mut self,
        shape: usize,
        inputs: &[HostArray],
        reference: bool,
    ) -> Result<(Vec<f32>, Option<UsedRoutes>)> {
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
            .enumerate()
            .map(|(d, (p, b))| Ok(p.iter().chain(b.iter()).chain(self.frozen_params(d)?).collect()))
            .collect::<Result<_>>()?;
        let exe = self.shapes[shape].log_probs.as_ref().expect("compiled");
        let out = run(exe, &args, "log_probs")?;
        // The results are replicated: device 0 holds all rows.
        let lp = out[0][0].to_host::<f32>().map_err(rt("reading log_probs"))?;
        let chosen = match &out[0][1..] {
            [prompts, responses] => Some([
                prompts
                    .to_host::<i32>()
                    .map_err(rt("reading the prompts' routes"))?,
                responses
                    .to_host::<i32>()
                    .map_err(rt("reading the responses' routes"))?,
            ]),
            _ => None,
        };
        Ok((lp, chosen))
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
            out.push(upload_split(
                &self.client,
                v,
                &bl,
                rows.as_ref(),
                self.mesh.as_ref(),
                name,
            )?);
            Ok(())
        };
        for name in &self.programs.layout.loss_inputs {
            match *name {
                "old_log_probs" => push_bl(name, Some(&mb.old_log_probs), &mut per_tensor)?,
                "advantages" => push_bl(name, Some(&mb.advantages), &mut per_tensor)?,
                "response_mask" => push_bl(name, Some(&mb.response_mask), &mut per_tensor)?,
                "ref_log_probs" => push_bl(name, mb.ref_log_probs.as_ref(), &mut per_tensor)?,
                "rollout_is_weights" => push_bl(name, mb.rollout_is_weights.as_ref(), &mut per_tensor)?,
                "values" => push_bl(name, mb.values.as_ref(), &mut per_tensor)?,
                "returns" => push_bl(name, mb.returns.as_ref(), &mut per_tensor)?,
                "norm_tokens" => per_tensor.push(upload_split(
                    &self.client,
                    &[mb.norm.0],
                    &[],
                    None,
                    self.mesh.as_ref(),
                    name,
                )?),
                _ => per_tensor.push(upload_split(
                    &self.client,
                    &[mb.norm.1],
                    &[],
                    None,
                    self.mesh.as_ref(),
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
            self.mesh.as_ref(),
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
                        args.extend(self.frozen_params(d)?);
                        Ok(args)
                    })
                    .collect::<Result<_>>()?;
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
                            args.extend(self.frozen_params(d)?);
                            Ok(args)
                        })
                        .collect::<Result<_>>()?;
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
        let values: Vec<(&'static str, f64)> = layout
            .metric_names
            .iter()
            .zip(&raw)
            .filter(|(n, _)| !n.is_empty())
            .map(|(n, v)| (*n, *v as f64))
            .collect();
        let update_applied = raw[NUM_SUMMED_METRICS + 1] != 0.0;
        let nonfinite_terms = ["loss", "pg_loss", "vf_loss", "kl_loss", "entropy", "grad_norm"]
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
                    assemble_host(
                        &self.param_dims[i],
                        self.param_shardings[i].as_ref(),
                        self.mesh.as_ref(),
                        |d| {
                            per_device[d][i]
                                .to_host::<f32>()
                                .map_err(rt(format!("reading {what}")))
                        },
                    )
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
