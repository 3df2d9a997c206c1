//! Where an engine's tensors live: the mesh of slot groups x the model axis
//! ([`rollout_mesh`]), the parameters' layout on it ([`rollout_layout`]: Megatron splits over
//! [`model::MODEL_AXIS`], whole over the slot groups), and the KV cache's static shape and
//! sharding ([`CacheShape`]), by which every program declares its arguments.

use model::forward::{DecoderParams, KvWrite, SlotBucket};
use model::{ModelConfig, ParamLayout, MODEL_AXIS};
use xla::graph::{Graph, Mesh, Sharding, Tensor};
use xla::runtime::{Buffer, Client};
use xla::DType;

use crate::error::{Result, RolloutError};

/// Static shape of the KV cache: for each layer, its key tensors then its value tensors, each
/// `[slots, kv_heads, chunk, head_dim]` of [`CacheShape::dtype`]; the positions of a slot are split into
/// [`CacheShape::chunks`] chunks of `chunk` positions (one chunk of `max_len` positions when
/// unchunked), so a decode step can read only the chunks that hold filled positions.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheShape {
    /// Number of slots (`max_num_seqs`).
    pub slots: usize,
    /// Positions per slot (the maximum model length: prompt + response).
    pub max_len: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Positions per cache tensor (`max_len` when unchunked).
    pub chunk: usize,
    /// Devices the engine runs on (1: a single-device engine).
    pub devices: usize,
    /// Devices of the tensor-parallel axis (1: none); the slots are split over the
    /// `devices / tensor_parallel` slot groups.
    pub tensor_parallel: usize,
    /// Element type of the keys and values: f32, or bf16 with bf16 weights (the engine's
    /// choice, [`CacheShape::for_weights`]). A narrow cache is read by attention products with
    /// narrow operands and f32 results, as the trainer computes attention with narrow weights.
    pub dtype: DType,
    /// How decode writes new keys and values: [`KvWrite::Scatter`] (the default) or
    /// [`KvWrite::Masked`] ([`crate::plan::ProgramPlan::new`] picks by plugin).
    pub write: KvWrite,
    /// LoRA adapters every program applies beside the weights (their tensors, f32, follow the
    /// weights among the arguments; see [`crate::EngineConfig::adapters`]).
    pub adapters: Option<model::LoraConfig>,
    /// The prefill, decode and extend programs also return the experts each mixture-of-experts
    /// layer chose for every position they feed (u8, `[.., moe_layers, k]`), before the cache
    /// ([`crate::EngineConfig::record_routes`]). Only for a mixture-of-experts model.
    pub record_routes: bool,
    /// How a mixture-of-experts model's layers dispatch to their experts (the engine's
    /// [`crate::EngineConfig::moe_lowering`] on its plugin).
    pub moe_lowering: model::moe::MoeLowering,
}

/// The name of the mesh axis an engine over several devices splits its slots along.
pub const SLOT_AXIS: &str = "slots";

/// The mesh of an engine over `devices` devices with tensor-parallel size `tp`: `None` on one
/// device, [`SLOT_AXIS`] alone without tensor parallelism, else slot groups x [`MODEL_AXIS`].
pub fn rollout_mesh(devices: usize, tp: usize) -> Option<Mesh> {
    let tp = tp.max(1);
    match (devices, tp) {
        (0 | 1, _) => None,
        (n, 1) => Some(Mesh::new(&[(SLOT_AXIS, n)])),
        (n, tp) => Some(Mesh::new(&[(SLOT_AXIS, n / tp), (MODEL_AXIS, tp)])),
    }
}

impl CacheShape {
    /// The cache shape for `config` with `slots` x `max_len`, one tensor per layer for keys
    /// and one for values.
    pub fn new(config: &ModelConfig, slots: usize, max_len: usize) -> CacheShape {
        CacheShape::chunked(config, slots, max_len, max_len)
    }

    /// The cache shape with each slot's positions split into chunks of `chunk` positions
    /// (the last chunk padded when `chunk` does not divide `max_len`; 0 or at least
    /// `max_len` means one chunk).
    pub fn chunked(config: &ModelConfig, slots: usize, max_len: usize, chunk: usize) -> CacheShape {
        CacheShape {
            slots,
            max_len,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            layers: config.num_hidden_layers,
            chunk: if chunk == 0 || chunk >= max_len {
                max_len
            } else {
                chunk
            },
            devices: 1,
            tensor_parallel: 1,
            dtype: DType::F32,
            write: KvWrite::Scatter,
            adapters: None,
            record_routes: false,
            moe_lowering: model::moe::MoeLowering::Dense,
        }
    }

    /// This shape with the cache type that goes with weights of `weights`: bf16 keys and
    /// values for bf16 weights (half the bytes a decode step reads), f32 otherwise. The
    /// trainer rounds keys and values to the weights' narrow type before its attention
    /// products too, so the rollout's log-probs keep tracking the trainer's.
    pub fn for_weights(mut self, weights: DType) -> CacheShape {
        self.dtype = match weights {
            DType::BF16 => DType::BF16,
            _ => DType::F32,
        };
        self
    }

    /// This shape split over `devices` devices (see the module comment); `slots` must divide
    /// by the slot groups ([`CacheShape::check_devices`]).
    pub fn on_devices(mut self, devices: usize) -> CacheShape {
        self.devices = devices.max(1);
        self
    }

    /// This shape with a tensor-parallel axis of `tp` devices (which must divide the devices).
    pub fn with_tensor_parallel(mut self, tp: usize) -> CacheShape {
        self.tensor_parallel = tp.max(1);
        self
    }

    /// Errors unless the tensor-parallel size divides the devices and the slots split evenly
    /// over the slot groups.
    pub fn check_devices(&self) -> Result<()> {
        let tp = self.tensor_parallel;
        if !self.devices.is_multiple_of(tp) {
            return Err(RolloutError::Config(format!(
                "rollout.tensor_model_parallel_size = {tp} must divide the {} devices the rollout \
                 runs on",
                self.devices
            )));
        }
        let groups = self.slot_groups();
        if groups > 1 && !self.slots.is_multiple_of(groups) {
            let over = if tp > 1 {
                format!(
                    "the {groups} slot groups of the {} devices the rollout runs on ({tp} tensor-parallel devices each)",
                    self.devices
                )
            } else {
                format!("the {} devices the rollout runs on", self.devices)
            };
            return Err(RolloutError::Config(format!(
                "rollout.max_num_seqs = {} must divide by {over} (the KV-cache slots are split \
                 evenly over them): use a multiple of {groups}",
                self.slots
            )));
        }
        Ok(())
    }

    /// The mesh of the programs (`None` on one device).
    pub fn mesh(&self) -> Option<Mesh> {
        rollout_mesh(self.devices, self.tensor_parallel)
    }

    /// The slot groups: devices that hold different slots (`devices / tensor_parallel`).
    pub fn slot_groups(&self) -> usize {
        (self.devices / self.tensor_parallel.max(1)).max(1)
    }

    /// How a per-slot tensor of rank `rank` (slots first) is laid out: split on the slots
    /// over several slot groups, `None` when there is one.
    pub fn slot_sharding(&self, rank: usize) -> Option<Sharding> {
        (self.slot_groups() > 1).then(|| Sharding::split(rank, 0, SLOT_AXIS))
    }

    /// Whether the KV heads split over the tensor-parallel axis (they must divide by it).
    pub fn splits_kv_heads(&self) -> bool {
        self.tensor_parallel > 1 && self.kv_heads.is_multiple_of(self.tensor_parallel)
    }

    /// How each cache tensor `[slots, kv_heads, chunk, head_dim]` is laid out: slots over the
    /// slot groups, KV heads over the model axis when they divide by it.
    pub fn kv_sharding(&self) -> Option<Sharding> {
        let mut s = self.slot_sharding(4).unwrap_or_else(|| Sharding::replicated(4));
        if self.splits_kv_heads() {
            s = s.and_split(1, MODEL_AXIS);
        }
        (!s.is_replicated()).then_some(s)
    }

    /// Slots each device holds.
    pub fn local_slots(&self) -> usize {
        self.slots / self.slot_groups()
    }

    /// KV heads each device holds.
    pub fn local_kv_heads(&self) -> usize {
        if self.splits_kv_heads() {
            self.kv_heads / self.tensor_parallel
        } else {
            self.kv_heads
        }
    }

    /// A graph named `name` on this shape's mesh (none on one device).
    pub(crate) fn graph(&self, name: &str) -> Graph {
        let g = Graph::new(name);
        if let Some(mesh) = self.mesh() {
            g.set_mesh(mesh);
        }
        g
    }

    /// The parameters, laid out for this shape's tensor-parallel size: the weights in
    /// `dtype`, then any adapters applied beside them, in f32 (each split with its weight).
    pub(crate) fn declare_params(&self, g: &Graph, config: &ModelConfig, dtype: DType) -> DecoderParams {
        let layout = rollout_layout(self.tensor_parallel);
        let p =
            DecoderParams::declare_laid_out(g, config, dtype, &layout).with_moe_lowering(self.moe_lowering);
        let Some(lora) = &self.adapters else {
            return p;
        };
        let adapters: Vec<Tensor> = model::lora::lora_param_table(config, lora)
            .iter()
            .map(|spec| match layout.sharding(spec) {
                Some(s) => g.parameter_sharded(&spec.name, DType::F32, &spec.dims(), s),
                None => g.parameter(&spec.name, DType::F32, &spec.dims()),
            })
            .collect();
        p.with_adapters(lora, &adapters)
            .expect("declared adapters follow the adapters' table")
    }

    /// A per-slot program argument (slots first), split on the slots over several slot groups.
    pub(crate) fn slot_parameter(&self, g: &Graph, name: &str, dtype: DType, dims: &[i64]) -> Tensor {
        match self.slot_sharding(dims.len()) {
            Some(s) => g.parameter_sharded(name, dtype, dims, s),
            None => g.parameter(name, dtype, dims),
        }
    }

    /// The first `rows` slots of each slot group, as a [`SlotBucket`] of this cache.
    pub(crate) fn bucket(&self, rows: usize) -> SlotBucket {
        SlotBucket {
            groups: self.slot_groups(),
            local: self.local_slots(),
            rows,
        }
    }

    /// Number of chunks per slot.
    pub fn chunks(&self) -> usize {
        self.max_len.div_ceil(self.chunk)
    }

    /// The cache chunks the decode program reads when the highest active position is
    /// `position`: the chunks holding positions `0..=position`, rounded up to a power of two
    /// (or all of them). One decode program is compiled per such count.
    pub fn decode_chunks(&self, position: usize) -> usize {
        self.chunks_for(position).next_power_of_two().min(self.chunks())
    }

    /// The chunks a step must read when the highest position written or attended is
    /// `position`.
    pub fn chunks_for(&self, position: usize) -> usize {
        (position / self.chunk + 1).min(self.chunks())
    }

    /// Dimensions of one K or V tensor (one chunk).
    pub fn dims(&self) -> [i64; 4] {
        [
            self.slots as i64,
            self.kv_heads as i64,
            self.chunk as i64,
            self.head_dim as i64,
        ]
    }

    /// Total bytes of the cache, over all devices.
    pub fn bytes(&self) -> usize {
        2 * self.layers
            * self.slots
            * self.kv_heads
            * self.chunks()
            * self.chunk
            * self.head_dim
            * self.dtype.size_bytes()
    }

    /// Bytes of the cache one device holds.
    pub fn bytes_per_device(&self) -> usize {
        self.bytes() / self.slot_groups() * self.local_kv_heads() / self.kv_heads.max(1)
    }

    /// Declares the cache tensors as arguments of `g`: for each layer its key chunks, then
    /// its value chunks.
    pub fn declare(&self, g: &Graph) -> Vec<Tensor> {
        let dims = self.dims();
        let chunks = self.chunks();
        let name = |l: usize, which: &str, c: usize| {
            if chunks == 1 {
                format!("cache.{l}.{which}")
            } else {
                format!("cache.{l}.{which}.{c}")
            }
        };
        (0..self.layers)
            .flat_map(|l| {
                ["k", "v"]
                    .into_iter()
                    .flat_map(move |which| (0..chunks).map(move |c| (l, which, c)))
            })
            .map(|(l, which, c)| match self.kv_sharding() {
                Some(s) => g.parameter_sharded(&name(l, which, c), self.dtype, &dims, s),
                None => g.parameter(&name(l, which, c), self.dtype, &dims),
            })
            .collect()
    }

    /// A zero cache on `device` (a single-device shape).
    pub fn allocate(&self, client: &Client, device: usize) -> Result<Vec<Buffer>> {
        Ok(self.allocate_on(client, &[device])?.remove(0))
    }

    /// A zero cache, `[device][tensor]`: each of `devices` (one per [`CacheShape::devices`])
    /// holds its block of slots (and of KV heads, see [`CacheShape::kv_sharding`]).
    pub fn allocate_on(&self, client: &Client, devices: &[usize]) -> Result<Vec<Vec<Buffer>>> {
        let (local, heads) = (self.local_slots(), self.local_kv_heads());
        // All-zero bytes are 0.0 in f32 and in bf16 alike.
        let zeros = vec![0u8; local * heads * self.chunk * self.head_dim * self.dtype.size_bytes()];
        let mut dims = self.dims();
        dims[0] = local as i64;
        dims[1] = heads as i64;
        devices
            .iter()
            .map(|&device| {
                (0..2 * self.layers * self.chunks())
                    .map(|_| {
                        client
                            .buffer_from_bytes(&zeros, self.dtype, &dims, device)
                            .map_err(|e| {
                                RolloutError::runtime(
                                    format!("allocating the KV cache on device {device}"),
                                    e,
                                )
                            })
                    })
                    .collect()
            })
            .collect()
    }
}

/// The rollout's parameter layout on a tensor-parallel axis of `tensor_parallel` devices:
/// Megatron splits over [`model::MODEL_AXIS`], whole over the slot groups.
pub fn rollout_layout(tensor_parallel: usize) -> ParamLayout<'static> {
    ParamLayout {
        fsdp: None,
        tensor_parallel,
    }
}
