//! The gRPC server side of the rollout role: a [`LocalRollout`] in the worker process, plus
//! the assembly of streamed weight updates into device buffers.
//!
//! A weight update is checked chunk by chunk (version, tensor index and name, dtype, dims,
//! offset, CRC-32) against the worker's own parameter table; each tensor is uploaded to the
//! device on a blocking thread as soon as its last chunk arrived, while later chunks keep
//! coming. The engine gets the new buffers only once every tensor arrived whole: any problem
//! refuses the whole update and the previous version stays in place. Chunks arrive without a
//! copy (`WeightChunk.data` is `Bytes`); a tensor sent in several chunks is assembled in the host
//! buffer the previous update used for it, a tensor sent whole is uploaded from the message.

use super::wire::{self, parse_dtype, request_from_proto, sample_to_proto, WeightDigest};
use super::{LocalRollout, RolloutRole, WeightUpdate};
use crate::proto;
use crate::roles::RoleError;
use bytes::Bytes;
use model::{param_table, ModelConfig};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tonic::{Request, Response, Status};
use xla::runtime::{Buffer, Client};
use xla::DType;

/// Why a weight update stream was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ChunkError {
    #[error("the stream held no chunks")]
    Empty,
    #[error("a chunk of version {found} arrived in the stream of version {expected}")]
    MixedVersions { expected: u64, found: u64 },
    #[error("the update has {found} tensors, this worker's model has {expected} (a different model?)")]
    TensorCount { expected: usize, found: usize },
    #[error("tensor {index}: this worker's parameter {index} is `{expected}`, the chunk is for `{found}`")]
    Name {
        index: usize,
        expected: String,
        found: String,
    },
    #[error("tensor {index} `{name}`: dtype {found:?}, this worker keeps its weights as {expected}")]
    DType {
        index: usize,
        name: String,
        expected: DType,
        found: String,
    },
    #[error("tensor {index} `{name}`: shape {found:?}, this worker's model has {expected:?}")]
    Dims {
        index: usize,
        name: String,
        expected: Vec<i64>,
        found: Vec<i64>,
    },
    #[error(
        "tensor {index} `{name}`: a chunk starts at byte {offset}, the next expected byte is \
         {expected} (chunks of a tensor must arrive in order, once)"
    )]
    Offset {
        index: usize,
        name: String,
        offset: u64,
        expected: u64,
    },
    #[error("tensor {index} `{name}`: a chunk ends at byte {end}, past the tensor's {size} bytes")]
    Overflow {
        index: usize,
        name: String,
        end: u64,
        size: u64,
    },
    #[error(
        "tensor {index} `{name}`: the chunk at byte {offset} fails its CRC-32 check (sent \
         {sent:08x}, received data has {computed:08x}): corrupted in transit"
    )]
    Checksum {
        index: usize,
        name: String,
        offset: u64,
        sent: u32,
        computed: u32,
    },
    #[error(
        "the stream ended with {complete} of {total} tensors complete (first missing: tensor \
         {missing} `{name}`)"
    )]
    Incomplete {
        complete: usize,
        total: usize,
        missing: usize,
        name: String,
    },
}

impl ChunkError {
    /// Corruption and truncation are data loss; the rest are requests this worker cannot take.
    pub(crate) fn code(&self) -> tonic::Code {
        match self {
            ChunkError::Checksum { .. } | ChunkError::Incomplete { .. } | ChunkError::Empty => {
                tonic::Code::DataLoss
            }
            _ => tonic::Code::InvalidArgument,
        }
    }
}

/// The environment variable of the skipped-install fault (a version number).
pub const SKIP_INSTALL_ENV: &str = "GRPO_FAULT_SKIP_WEIGHT_INSTALL";

/// One tensor of an update being received.
enum Slot {
    Waiting,
    Filling(Vec<u8>),
    Complete,
}

/// Puts the chunks of one weight update together, checking each against the worker's
/// parameter table.
pub(crate) struct Assembly<'a> {
    /// (name, dims, bytes) of every parameter.
    table: &'a [(String, Vec<i64>, u64)],
    dtype: DType,
    version: Option<u64>,
    slots: Vec<Slot>,
    complete: usize,
    bytes: u64,
    /// The digest of the chunks taken so far.
    digest: WeightDigest,
    /// Host buffers of an earlier update, by tensor, to assemble into without fresh pages.
    spare: Vec<Option<Vec<u8>>>,
}

impl<'a> Assembly<'a> {
    pub(crate) fn new(table: &'a [(String, Vec<i64>, u64)], dtype: DType) -> Assembly<'a> {
        Assembly {
            table,
            dtype,
            version: None,
            slots: table.iter().map(|_| Slot::Waiting).collect(),
            complete: 0,
            bytes: 0,
            digest: WeightDigest::default(),
            spare: Vec::new(),
        }
    }

    /// Assemble into these host buffers (by tensor index, e.g. those of the previous update)
    /// instead of allocating: writing into fresh pages costs a page fault per 4 KiB.
    pub(crate) fn reusing(mut self, spare: Vec<Option<Vec<u8>>>) -> Assembly<'a> {
        self.spare = spare;
        self
    }

    /// Takes one chunk; returns the tensor's index and bytes when this chunk completed it.
    pub(crate) fn add(&mut self, chunk: proto::WeightChunk) -> Result<Option<(usize, Bytes)>, ChunkError> {
        match self.version {
            None => self.version = Some(chunk.version),
            Some(v) if v != chunk.version => {
                return Err(ChunkError::MixedVersions {
                    expected: v,
                    found: chunk.version,
                })
            }
            Some(_) => {}
        }
        let index = chunk.tensor_index as usize;
        if chunk.tensor_count as usize != self.table.len() || index >= self.table.len() {
            return Err(ChunkError::TensorCount {
                expected: self.table.len(),
                found: (chunk.tensor_count as usize).max(index + 1),
            });
        }
        let (name, dims, size) = &self.table[index];
        if chunk.tensor_name != *name {
            return Err(ChunkError::Name {
                index,
                expected: name.clone(),
                found: chunk.tensor_name,
            });
        }
        if parse_dtype(&chunk.dtype) != Some(self.dtype) {
            return Err(ChunkError::DType {
                index,
                name: name.clone(),
                expected: self.dtype,
                found: chunk.dtype,
            });
        }
        if chunk.dims != *dims {
            return Err(ChunkError::Dims {
                index,
                name: name.clone(),
                expected: dims.clone(),
                found: chunk.dims,
            });
        }
        let received = match &self.slots[index] {
            Slot::Waiting => 0,
            Slot::Filling(b) => b.len() as u64,
            Slot::Complete => *size,
        };
        if chunk.offset != received || matches!(self.slots[index], Slot::Complete) {
            return Err(ChunkError::Offset {
                index,
                name: name.clone(),
                offset: chunk.offset,
                expected: received,
            });
        }
        let end = chunk.offset + chunk.data.len() as u64;
        if end > *size {
            return Err(ChunkError::Overflow {
                index,
                name: name.clone(),
                end,
                size: *size,
            });
        }
        let computed = crc32fast::hash(&chunk.data);
        if computed != chunk.crc32 {
            return Err(ChunkError::Checksum {
                index,
                name: name.clone(),
                offset: chunk.offset,
                sent: chunk.crc32,
                computed,
            });
        }
        self.bytes += chunk.data.len() as u64;
        self.digest.add(&chunk);
        let bytes = match std::mem::replace(&mut self.slots[index], Slot::Waiting) {
            // A tensor sent whole in one chunk is uploaded from the received message itself.
            Slot::Waiting if end == *size => {
                self.slots[index] = Slot::Complete;
                self.complete += 1;
                return Ok(Some((index, chunk.data)));
            }
            // The one copy on this side: the chunks of a tensor into one host buffer.
            Slot::Waiting => {
                let mut b = self
                    .spare
                    .get_mut(index)
                    .and_then(Option::take)
                    .unwrap_or_default();
                b.clear();
                b.reserve_exact(*size as usize);
                b.extend_from_slice(&chunk.data);
                b
            }
            Slot::Filling(mut b) => {
                b.extend_from_slice(&chunk.data);
                b
            }
            Slot::Complete => unreachable!("refused above"),
        };
        if end == *size {
            self.slots[index] = Slot::Complete;
            self.complete += 1;
            Ok(Some((index, bytes.into())))
        } else {
            self.slots[index] = Slot::Filling(bytes);
            Ok(None)
        }
    }

    /// The digest of the stream so far (the whole update's after [`Assembly::finish`]).
    pub(crate) fn digest(&self) -> u32 {
        self.digest.value()
    }

    /// The update's version once every tensor is complete.
    pub(crate) fn finish(&self) -> Result<u64, ChunkError> {
        let version = self.version.ok_or(ChunkError::Empty)?;
        if let Some(missing) = self.slots.iter().position(|s| !matches!(s, Slot::Complete)) {
            return Err(ChunkError::Incomplete {
                complete: self.complete,
                total: self.table.len(),
                missing,
                name: self.table[missing].0.clone(),
            });
        }
        Ok(version)
    }
}

/// The server side of the rollout role in a worker process.
pub struct RolloutService {
    local: Arc<LocalRollout>,
    client: Client,
    device: usize,
    /// The engine's tensor-parallel size: each tensor is uploaded to devices `0..tp` as its
    /// parts (1: whole, to `device`).
    tensor_parallel: usize,
    /// The parameter table (the tensor-parallel layout of each tensor).
    specs: Vec<model::ParamSpec>,
    dtype: DType,
    /// (name, dims, bytes) of every parameter, in parameter-table order.
    table: Vec<(String, Vec<i64>, u64)>,
    /// One weight update at a time; holds the host buffers the last update was assembled in,
    /// by tensor index, for the next one to reuse.
    updating: tokio::sync::Mutex<Vec<Option<Vec<u8>>>>,
    /// Samples asked for and not yet sent back.
    in_flight: Arc<AtomicU64>,
    /// The digest of the weights the engine samples with (0: those it loaded at start).
    installed_digest: std::sync::atomic::AtomicU32,
    /// Test fault: the update to this version is acknowledged but not installed
    /// (`GRPO_FAULT_SKIP_WEIGHT_INSTALL`), to show the orchestrator catches it.
    skip_install: Option<u64>,
    /// With LoRA: updates carry the adapters (the table and dtype above are theirs), merged
    /// into the base the worker holds or applied beside it.
    adapters: Option<Arc<rollout::AdapterInstall>>,
}

impl RolloutService {
    /// The largest gRPC message the worker takes or sends.
    pub const MAX_MESSAGE_BYTES: usize = wire::MAX_MESSAGE_BYTES;
    /// HTTP/2 flow-control window per stream (large, so weights stream at memory speed).
    pub const STREAM_WINDOW_BYTES: u32 = wire::STREAM_WINDOW_BYTES;
    /// HTTP/2 flow-control window per connection.
    pub const CONNECTION_WINDOW_BYTES: u32 = wire::CONNECTION_WINDOW_BYTES;
    /// Largest HTTP/2 frame.
    pub const MAX_FRAME_BYTES: u32 = wire::MAX_FRAME_BYTES;

    /// Serves `local`, an engine over a `config` model with weights of `dtype` on `device` of
    /// `client` (on devices `0..tensor_parallel` when its tensor-parallel size is more than 1);
    /// weight updates are uploaded there, each device its part.
    pub fn new(
        local: LocalRollout,
        client: Client,
        config: &ModelConfig,
        dtype: DType,
        device: usize,
        tensor_parallel: usize,
    ) -> RolloutService {
        let specs = param_table(config);
        let table = weight_table(&specs, dtype);
        RolloutService {
            local: Arc::new(local),
            client,
            device,
            tensor_parallel: tensor_parallel.max(1),
            specs,
            dtype,
            table,
            updating: tokio::sync::Mutex::new(Vec::new()),
            in_flight: Arc::default(),
            installed_digest: Default::default(),
            skip_install: std::env::var(SKIP_INSTALL_ENV).ok().and_then(|v| v.parse().ok()),
            adapters: None,
        }
    }

    /// A LoRA run's worker: updates carry `install`'s adapters in f32 (the engine keeps the
    /// merged weights, or applies the adapters beside its base), so only the adapters cross
    /// the network.
    pub fn with_adapters(mut self, install: rollout::AdapterInstall) -> RolloutService {
        self.specs = install.specs().to_vec();
        self.dtype = DType::F32;
        self.table = weight_table(&self.specs, self.dtype);
        self.adapters = Some(Arc::new(install));
        self
    }

    /// Samples asked for and not yet sent back.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// The weight version the engine generates with.
    pub fn weight_version(&self) -> u64 {
        self.local.weight_version()
    }

    async fn receive_update(
        &self,
        mut stream: tonic::Streaming<proto::WeightChunk>,
    ) -> Result<proto::UpdateWeightsReply, Status> {
        let mut spare = self.updating.lock().await;
        let before = self.local.weight_version();
        let refuse = |e: ChunkError, version: Option<u64>| {
            let version = version.map_or_else(|| "?".to_string(), |v| v.to_string());
            Status::new(
                e.code(),
                format!("weight update to version {version} refused, version {before} stays: {e}"),
            )
        };
        let mut assembly = Assembly::new(&self.table, self.dtype).reusing(std::mem::take(&mut *spare));
        let mut uploads = Vec::with_capacity(self.table.len());
        while let Some(chunk) = stream.message().await? {
            let completed = assembly.add(chunk).map_err(|e| refuse(e, assembly.version))?;
            if let Some((index, bytes)) = completed {
                let (client, dtype) = (self.client.clone(), self.dtype);
                let devices: Vec<usize> = match self.tensor_parallel {
                    1 => vec![self.device],
                    tp => (0..tp).collect(),
                };
                let spec = self.specs[index].clone();
                uploads.push((
                    index,
                    tokio::task::spawn_blocking(move || {
                        let buffers = rollout::upload_parameter(&client, &spec, dtype, &bytes, &devices)
                            .map_err(|e| format!("uploading tensor {index} `{}`: {e}", spec.name))?;
                        // A tensor assembled from several chunks is this worker's own buffer:
                        // keep it for the next update (one sent whole is the message's).
                        Ok::<_, String>((buffers, bytes.try_into_mut().ok().map(Vec::from)))
                    }),
                ));
            }
        }
        let version = assembly.finish().map_err(|e| refuse(e, assembly.version))?;
        let mut buffers: Vec<Option<Vec<Buffer>>> = (0..self.table.len()).map(|_| None).collect();
        let mut reusable: Vec<Option<Vec<u8>>> = (0..self.table.len()).map(|_| None).collect();
        for (index, upload) in uploads {
            let (buffer, host) = upload
                .await
                .map_err(|e| Status::internal(format!("an upload thread failed: {e}")))?
                .map_err(|e| {
                    Status::internal(format!(
                        "weight update to version {version} failed, version {before} stays: {e}"
                    ))
                })?;
            buffers[index] = Some(buffer);
            reusable[index] = host;
        }
        *spare = reusable;
        let mut per_device: Vec<Vec<Buffer>> = (0..self.tensor_parallel).map(|_| Vec::new()).collect();
        for parts in buffers {
            for (d, b) in parts
                .expect("finish() checked every tensor")
                .into_iter()
                .enumerate()
            {
                per_device[d].push(b);
            }
        }
        let params = match &self.adapters {
            None => rollout::EngineWeights::laid_out(
                per_device.into_iter().map(Arc::from).collect(),
                self.tensor_parallel,
            ),
            Some(install) => {
                let install = install.clone();
                tokio::task::spawn_blocking(move || install.install(per_device))
                    .await
                    .map_err(|e| Status::internal(format!("the LoRA install thread failed: {e}")))?
                    .map_err(|e| {
                        Status::internal(format!(
                            "weight update to version {version} failed, version {before} stays: {e}"
                        ))
                    })?
            }
        };
        if self.skip_install == Some(version) {
            tracing::warn!(
                version,
                "GRPO_FAULT_SKIP_WEIGHT_INSTALL: acknowledging without installing"
            );
        } else {
            self.local
                .update_weights(WeightUpdate {
                    version,
                    params: params.into(),
                })
                .await
                .map_err(|e| role_error_to_status(e, "installing the weights"))?;
            self.installed_digest.store(assembly.digest(), Ordering::SeqCst);
            tracing::info!(version, bytes = assembly.bytes, "installed streamed weights");
        }
        Ok(proto::UpdateWeightsReply {
            version,
            bytes: assembly.bytes,
            checksum: self.installed_digest.load(Ordering::SeqCst),
        })
    }
}

/// (name, dims, bytes) of every tensor of `specs` in `dtype`: what an update must hold.
fn weight_table(specs: &[model::ParamSpec], dtype: DType) -> Vec<(String, Vec<i64>, u64)> {
    specs
        .iter()
        .map(|spec| {
            let bytes = spec.numel() * dtype.size_bytes();
            (spec.name.clone(), spec.dims(), bytes as u64)
        })
        .collect()
}

fn role_error_to_status(e: RoleError, doing: &str) -> Status {
    match e {
        RoleError::Unavailable { message, .. } => Status::unavailable(format!("{doing}: {message}")),
        RoleError::Refused { message, .. } => Status::failed_precondition(format!("{doing}: {message}")),
        RoleError::Invalid(message) => Status::invalid_argument(format!("{doing}: {message}")),
    }
}

/// Subtracts the samples a call never sent from the in-flight count, however the call ends.
struct InFlight {
    counter: Arc<AtomicU64>,
    remaining: u64,
}

impl InFlight {
    fn sent_one(&mut self) {
        if self.remaining > 0 {
            self.remaining -= 1;
            self.counter.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.remaining, Ordering::SeqCst);
    }
}

type SampleStream = tokio_stream::wrappers::ReceiverStream<Result<proto::GeneratedSample, Status>>;

#[tonic::async_trait]
impl proto::rollout_server::Rollout for RolloutService {
    type GenerateStream = SampleStream;

    async fn generate(
        &self,
        request: Request<proto::GenerateRequest>,
    ) -> Result<Response<SampleStream>, Status> {
        let request = request.into_inner();
        let version = self.local.weight_version();
        if version < request.min_weight_version {
            return Err(Status::failed_precondition(format!(
                "this worker has weight version {version}, the call needs version {} or newer: \
                 send the weights with UpdateWeights first",
                request.min_weight_version
            )));
        }
        let requests = request
            .requests
            .into_iter()
            .map(request_from_proto)
            .collect::<Result<Vec<_>, _>>()
            .map_err(Status::invalid_argument)?;
        let total: u64 = requests.iter().map(|r| r.n as u64).sum();
        self.in_flight.fetch_add(total, Ordering::SeqCst);
        let mut in_flight = InFlight {
            counter: self.in_flight.clone(),
            remaining: total,
        };
        let (out, stream) = tokio::sync::mpsc::channel(64);
        let local = self.local.clone();
        tokio::spawn(async move {
            let (samples, mut finished_samples) = tokio::sync::mpsc::unbounded_channel();
            let generation = local.generate(requests, samples);
            tokio::pin!(generation);
            // Samples are sent before the call resolves, so once it has, the rest are queued.
            let result = loop {
                tokio::select! {
                    biased;
                    sample = finished_samples.recv() => match sample {
                        Some(s) => {
                            in_flight.sent_one();
                            if out.send(Ok(sample_to_proto(s))).await.is_err() {
                                return; // the caller went away
                            }
                        }
                        None => break (&mut generation).await,
                    },
                    result = &mut generation => break result,
                }
            };
            while let Ok(s) = finished_samples.try_recv() {
                in_flight.sent_one();
                if out.send(Ok(sample_to_proto(s))).await.is_err() {
                    return;
                }
            }
            if let Err(e) = result {
                let _ = out.send(Err(role_error_to_status(e, "generating"))).await;
            }
        });
        Ok(Response::new(SampleStream::new(stream)))
    }

    async fn update_weights(
        &self,
        request: Request<tonic::Streaming<proto::WeightChunk>>,
    ) -> Result<Response<proto::UpdateWeightsReply>, Status> {
        self.receive_update(request.into_inner()).await.map(Response::new)
    }

    async fn weight_version(
        &self,
        _: Request<proto::WeightVersionRequest>,
    ) -> Result<Response<proto::WeightVersionReply>, Status> {
        Ok(Response::new(proto::WeightVersionReply {
            version: self.local.weight_version(),
            dtype: self.dtype.to_string(),
            tensors: self
                .table
                .iter()
                .map(|(name, dims, _)| proto::TensorSpec {
                    name: name.clone(),
                    dims: dims.clone(),
                })
                .collect(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Vec<(String, Vec<i64>, u64)> {
        vec![
            ("a.weight".into(), vec![2, 3], 24),
            ("b.weight".into(), vec![4], 16),
        ]
    }

    fn chunk(index: u32, offset: u64, data: Vec<u8>) -> proto::WeightChunk {
        let data = Bytes::from(data);
        let t = table();
        let (name, dims, _) = &t[index as usize];
        proto::WeightChunk {
            version: 5,
            tensor_count: 2,
            tensor_index: index,
            tensor_name: name.clone(),
            dtype: "f32".into(),
            dims: dims.clone(),
            offset,
            crc32: crc32fast::hash(&data),
            data,
        }
    }

    #[test]
    fn chunks_assemble_into_whole_tensors() {
        let t = table();
        let mut a = Assembly::new(&t, DType::F32);
        let bytes: Vec<u8> = (0..24).collect();
        assert_eq!(a.add(chunk(0, 0, bytes[..10].to_vec())).unwrap(), None);
        assert_eq!(
            a.add(chunk(0, 10, bytes[10..].to_vec())).unwrap(),
            Some((0, Bytes::from(bytes.clone())))
        );
        assert_eq!(
            a.finish().unwrap_err().to_string(),
            "the stream ended with 1 of 2 tensors complete (first missing: tensor 1 `b.weight`)"
        );
        let whole = chunk(1, 0, vec![7; 16]);
        let sent = whole.data.as_ptr();
        let (index, received) = a.add(whole).unwrap().unwrap();
        assert_eq!((index, received.as_ref()), (1, [7u8; 16].as_slice()));
        // A tensor in one chunk is not copied on its way to the device.
        assert_eq!(received.as_ptr(), sent);
        assert_eq!(a.finish().unwrap(), 5);
        assert_eq!(a.bytes, 40);
    }

    #[test]
    fn tensors_are_assembled_in_the_buffers_of_the_last_update() {
        let t = table();
        let spare = vec![Some(vec![9u8; 24]), None];
        let reused = spare[0].as_ref().unwrap().as_ptr();
        let mut a = Assembly::new(&t, DType::F32).reusing(spare);
        let bytes: Vec<u8> = (0..24).collect();
        assert_eq!(a.add(chunk(0, 0, bytes[..8].to_vec())).unwrap(), None);
        let (index, whole) = a.add(chunk(0, 8, bytes[8..].to_vec())).unwrap().unwrap();
        assert_eq!((index, whole.as_ref()), (0, bytes.as_slice()));
        assert_eq!(whole.as_ptr(), reused, "assembled in the spare buffer");
        // Once uploaded, the worker owns it again for the next update.
        let back = Vec::from(whole.try_into_mut().unwrap());
        assert_eq!(back.as_ptr(), reused);
    }

    #[test]
    fn bad_chunks_are_refused_with_what_was_wrong() {
        let t = table();
        let refused = |chunks: Vec<proto::WeightChunk>| {
            let mut a = Assembly::new(&t, DType::F32);
            for c in chunks {
                if let Err(e) = a.add(c) {
                    return e.to_string();
                }
            }
            panic!("every chunk was taken")
        };
        let mut corrupt = chunk(1, 0, vec![1; 16]);
        let mut data = corrupt.data.to_vec();
        data[3] ^= 0x10;
        corrupt.data = data.into();
        let e = refused(vec![corrupt]);
        assert!(
            e.starts_with("tensor 1 `b.weight`: the chunk at byte 0 fails its CRC-32 check"),
            "{e}"
        );
        assert_eq!(
            refused(vec![chunk(0, 0, vec![0; 8]), chunk(0, 16, vec![0; 8])]),
            "tensor 0 `a.weight`: a chunk starts at byte 16, the next expected byte is 8 \
             (chunks of a tensor must arrive in order, once)"
        );
        assert_eq!(
            refused(vec![chunk(1, 0, vec![0; 16]), chunk(1, 0, vec![0; 16])]),
            "tensor 1 `b.weight`: a chunk starts at byte 0, the next expected byte is 16 \
             (chunks of a tensor must arrive in order, once)"
        );
        assert_eq!(
            refused(vec![chunk(1, 0, vec![0; 20])]),
            "tensor 1 `b.weight`: a chunk ends at byte 20, past the tensor's 16 bytes"
        );
        let mut shape = chunk(0, 0, vec![0; 24]);
        shape.dims = vec![3, 2];
        assert_eq!(
            refused(vec![shape]),
            "tensor 0 `a.weight`: shape [3, 2], this worker's model has [2, 3]"
        );
        let mut dtype = chunk(0, 0, vec![0; 12]);
        dtype.dtype = "bf16".into();
        assert_eq!(
            refused(vec![dtype]),
            "tensor 0 `a.weight`: dtype \"bf16\", this worker keeps its weights as f32"
        );
        let mut name = chunk(0, 0, vec![0; 24]);
        name.tensor_name = "c.weight".into();
        assert_eq!(
            refused(vec![name]),
            "tensor 0: this worker's parameter 0 is `a.weight`, the chunk is for `c.weight`"
        );
        let mut count = chunk(0, 0, vec![0; 24]);
        count.tensor_count = 3;
        assert_eq!(
            refused(vec![count]),
            "the update has 3 tensors, this worker's model has 2 (a different model?)"
        );
        let mut other_version = chunk(1, 0, vec![0; 16]);
        other_version.version = 6;
        assert_eq!(
            refused(vec![chunk(0, 0, vec![0; 24]), other_version]),
            "a chunk of version 6 arrived in the stream of version 5"
        );
        assert_eq!(
            Assembly::new(&t, DType::F32).finish().unwrap_err(),
            ChunkError::Empty
        );
    }
}
