//! The rollout role in a worker process (`grpo worker --role rollout`), reached over gRPC.
//!
//! [`RemoteRollout`] streams each finished sample back as the worker finishes it, and sends new
//! weights as a client-streaming call of CRC-32-checked chunks in the worker's dtype. Reading
//! the device buffers to the host, converting and checksumming runs on a blocking thread that
//! feeds a small bounded queue, so it overlaps with sending and with the worker's own uploads.
//! Each tensor is read to the host once, into the host buffer of the previous push
//! ([`HostCopies`]); chunks in the same dtype are `Bytes` slices of it, not copies. An update of
//! host tensors (from a learner worker) is chunked from its bytes, never touching a device.
//!
//! It keeps the newest [`WeightUpdate`] it was given: every `generate` call tells the worker
//! the version it needs, and a worker that is behind (a replacement started after the last
//! update, or one whose last update failed) is refused until it has been sent those weights,
//! which this client does before asking again.

use super::wire::{
    parse_dtype, request_to_proto, sample_from_proto, WeightDigest, CHUNK_BYTES, CONNECTION_WINDOW_BYTES,
    MAX_MESSAGE_BYTES, STREAM_WINDOW_BYTES,
};
use super::{RolloutRole, UpdateParams, WeightUpdate};
use crate::auth::{Attach, Token};
use crate::proto;
use crate::recipe::TlsSection;
use crate::roles::{status_to_error, BoxFuture, RoleError};
use bytes::Bytes;
use model::HostTensor;
use rollout::{GenerationRequest, Sample};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use xla::runtime::Buffer;
use xla::DType;

/// Chunks read ahead of the network.
const CHUNKS_IN_FLIGHT: usize = 8;
/// How long a worker may leave an HTTP/2 ping unanswered (or a connection attempt hang)
/// before it counts as unavailable, unless [`RemoteRollout::with_timeout`] says otherwise.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

type RolloutClient = proto::rollout_client::RolloutClient<InterceptedService<Channel, Attach>>;

/// What the worker said about its weights.
#[derive(Clone, Debug)]
struct WorkerWeights {
    dtype: DType,
    /// (name, dims) of every tensor, in parameter-table order.
    tensors: Vec<(String, Vec<i64>)>,
}

/// The rollout role in a worker process, reached over gRPC.
pub struct RemoteRollout {
    address: String,
    client: RolloutClient,
    /// The version the worker last reported or accepted.
    version: AtomicU64,
    /// The worker's dtype and parameter table, asked once.
    layout: Mutex<Option<WorkerWeights>>,
    /// The newest weights this client was given: a worker that is behind gets them.
    latest: Mutex<Option<WeightUpdate>>,
    /// One weight push at a time; holds the host buffers the last push read the device
    /// buffers into, by tensor index, for the next push to reuse.
    pushing: tokio::sync::Mutex<Vec<Option<Vec<u8>>>>,
}

impl RemoteRollout {
    /// A client for the worker at `address` (`127.0.0.1:PORT`, with or without `http://`);
    /// connects lazily (call it inside a tokio runtime), over TLS when `tls` (the recipe's
    /// `cluster.tls`) is given. A worker that does not answer within 10 s (connecting, or an
    /// HTTP/2 ping while a call waits) is unavailable.
    pub fn new(address: &str, token: &Token, tls: Option<&TlsSection>) -> Result<RemoteRollout, RoleError> {
        RemoteRollout::with_timeout(address, token, tls, DEFAULT_TIMEOUT)
    }

    /// As [`RemoteRollout::new`], with the recipe's `cluster.worker_timeout_s`.
    pub fn with_timeout(
        address: &str,
        token: &Token,
        tls: Option<&TlsSection>,
        timeout: Duration,
    ) -> Result<RemoteRollout, RoleError> {
        let endpoint =
            crate::transport::endpoint(address, tls).map_err(|e| RoleError::Invalid(e.to_string()))?;
        let channel = crate::transport::keep_alive(endpoint, timeout)
            .initial_stream_window_size(STREAM_WINDOW_BYTES)
            .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
            .connect_lazy();
        Ok(RemoteRollout::over(
            &crate::transport::worker_uri(address, tls),
            channel,
            token,
        ))
    }

    /// A client over an already configured channel (e.g. a TLS one).
    pub fn over(address: &str, channel: Channel, token: &Token) -> RemoteRollout {
        let client = proto::rollout_client::RolloutClient::with_interceptor(channel, token.attach())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        RemoteRollout {
            address: address.to_string(),
            client,
            version: AtomicU64::new(0),
            layout: Mutex::new(None),
            latest: Mutex::new(None),
            pushing: tokio::sync::Mutex::new(Vec::new()),
        }
    }

    /// Asks the worker which weight version it has (and remembers its dtype and parameter
    /// table); [`RolloutRole::weight_version`] reports it from then on.
    pub async fn refresh(&self) -> Result<u64, RoleError> {
        let reply = self
            .client
            .clone()
            .weight_version(proto::WeightVersionRequest {})
            .await
            .map_err(|s| self.error(s))?
            .into_inner();
        let dtype = parse_dtype(&reply.dtype).ok_or_else(|| {
            RoleError::Invalid(format!(
                "the rollout worker at {} keeps its weights as {:?}; this client sends f32 or bf16",
                self.address, reply.dtype
            ))
        })?;
        *lock(&self.layout) = Some(WorkerWeights {
            dtype,
            tensors: reply.tensors.into_iter().map(|t| (t.name, t.dims)).collect(),
        });
        self.version.store(reply.version, Ordering::SeqCst);
        Ok(reply.version)
    }

    fn error(&self, status: tonic::Status) -> RoleError {
        status_to_error("rollout", &self.address, crate::transport::explain_status(status))
    }

    fn latest_version(&self) -> u64 {
        lock(&self.latest).as_ref().map_or(0, |u| u.version)
    }

    /// Streams `update` to the worker and waits until it installed it; returns the bytes of
    /// tensor data it took.
    async fn push(&self, update: &WeightUpdate) -> Result<u64, RoleError> {
        let mut spare = self.pushing.lock().await;
        if lock(&self.layout).is_none() {
            self.refresh().await?;
        }
        let layout = lock(&self.layout).clone().expect("refreshed above");
        let params = update.params.clone();
        let source = ChunkSource::of(&params).ok_or_else(|| {
            RoleError::Invalid(format!(
                "weight update {}: the weights are split for tensor parallelism on this process's \
                 devices; a rollout worker is streamed whole tensors (hand it replicated weights)",
                update.version
            ))
        })?;
        check_layout(&layout, &source, update.version, &self.address)?;

        let (chunks, stream) = tokio::sync::mpsc::channel(CHUNKS_IN_FLIGHT);
        let (version, dtype) = (update.version, layout.dtype);
        let tensors = layout.tensors;
        let mut host = HostCopies::reusing(std::mem::take(&mut *spare));
        let producer = tokio::task::spawn_blocking(move || {
            let source = ChunkSource::of(&params).expect("whole tensors, checked before the stream");
            let sent = send_chunks_from(version, &source, &tensors, dtype, &mut host, |chunk| {
                chunks.blocking_send(chunk).is_ok()
            });
            (sent, host)
        });
        let reply = self
            .client
            .clone()
            .update_weights(tokio_stream::wrappers::ReceiverStream::new(stream))
            .await;
        let (produced, host) = producer
            .await
            .map_err(|e| RoleError::Invalid(format!("the weight reader thread failed: {e}")))?;
        // Every chunk has been sent (or dropped) by now, so the host copies are ours again.
        *spare = host.reclaim();
        // A buffer that could not be read ends the stream early; that is the error to report,
        // not the worker's refusal of the short stream.
        let digest = produced?;
        let reply = reply.map_err(|s| self.error(s))?.into_inner();
        if reply.version != version || reply.checksum != digest {
            return Err(RoleError::Invalid(format!(
                "rollout worker {} acknowledged weight version {} but reports version {} with checksum \
                 {:08x} where the weights sent have {digest:08x}: it does not sample with them, so \
                 its samples would be trained as version {version}'s; stopping (VeRL #7495, TRL \
                 #5312: updates that never reach the sampler)",
                self.address, version, reply.version, reply.checksum
            )));
        }
        self.version.store(reply.version, Ordering::SeqCst);
        tracing::debug!(
            version = reply.version,
            bytes = reply.bytes,
            worker = %self.address,
            "rollout worker took new weights"
        );
        Ok(reply.bytes)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The buffers must match the worker's parameter table before anything is sent.
fn check_layout(
    layout: &WorkerWeights,
    params: &ChunkSource,
    version: u64,
    address: &str,
) -> Result<(), RoleError> {
    if params.len() != layout.tensors.len() {
        return Err(RoleError::Invalid(format!(
            "weight update {version} has {} tensors, the rollout worker at {address} has {} \
             (a different model?)",
            params.len(),
            layout.tensors.len()
        )));
    }
    for (index, (name, dims)) in layout.tensors.iter().enumerate() {
        if params.dims(index) != *dims {
            return Err(RoleError::Invalid(format!(
                "weight update {version}: tensor {index} `{name}` has shape {:?}, the rollout \
                 worker at {address} expects {dims:?}",
                params.dims(index)
            )));
        }
        if conversion(params.dtype(index), layout.dtype).is_none() {
            return Err(RoleError::Invalid(format!(
                "weight update {version}: tensor {index} `{name}` is {}, which cannot be sent \
                 as the worker's {} (f32 and bf16 convert to each other)",
                params.dtype(index),
                layout.dtype
            )));
        }
    }
    Ok(())
}

/// How tensor bytes of `from` become bytes of `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Conversion {
    Same,
    F32ToBf16,
    Bf16ToF32,
}

fn conversion(from: DType, to: DType) -> Option<Conversion> {
    match (from, to) {
        (a, b) if a == b => Some(Conversion::Same),
        (DType::F32, DType::BF16) => Some(Conversion::F32ToBf16),
        (DType::BF16, DType::F32) => Some(Conversion::Bf16ToF32),
        _ => None,
    }
}

/// Elements `range` of `source` (little-endian bytes of `from`), as bytes of the target type:
/// a slice of `source` (no copy) when the types agree, converted otherwise.
fn convert_range(source: &Bytes, how: Conversion, from: DType, range: std::ops::Range<usize>) -> Bytes {
    let size = from.size_bytes();
    let (start, end) = (range.start * size, range.end * size);
    match how {
        Conversion::Same => source.slice(start..end),
        Conversion::F32ToBf16 => {
            let bytes = &source[start..end];
            // half::bf16::from_f32 bit for bit (round to nearest even, NaN kept quiet), in a
            // loop the compiler vectorises.
            let mut out = vec![0u8; bytes.len() / 2];
            for (o, c) in out.chunks_exact_mut(2).zip(bytes.chunks_exact(4)) {
                let x = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                let bits = if x & 0x7fff_ffff > 0x7f80_0000 {
                    (x >> 16) as u16 | 0x0040
                } else {
                    (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16
                };
                o.copy_from_slice(&bits.to_le_bytes());
            }
            out.into()
        }
        Conversion::Bf16ToF32 => {
            let bytes = &source[start..end];
            let mut out = Vec::with_capacity(bytes.len() * 2);
            for c in bytes.chunks_exact(2) {
                let x = half::bf16::from_le_bytes([c[0], c[1]]);
                out.extend_from_slice(&x.to_f32().to_le_bytes());
            }
            out.into()
        }
    }
}

/// Reads every buffer to the host, converts it to `dtype`, cuts it into checksummed chunks of
/// about [`CHUNK_BYTES`] and hands them to `send` in order. Stops quietly when `send` returns
/// false (the call ended; its status says why).
pub(crate) fn send_chunks(
    version: u64,
    params: &[Buffer],
    tensors: &[(String, Vec<i64>)],
    dtype: DType,
    send: impl FnMut(proto::WeightChunk) -> bool,
) -> Result<u32, RoleError> {
    let source = ChunkSource::Device(params);
    send_chunks_from(version, &source, tensors, dtype, &mut HostCopies::default(), send)
}

/// The tensors a weight stream reads: device buffers, or host tensors already in memory.
pub(crate) enum ChunkSource<'a> {
    Device(&'a [Buffer]),
    Host(&'a Arc<[HostTensor]>),
}

/// Tensor `.1` of a host update, as the owner of the `Bytes` its chunks are sliced from.
struct HostBytes(Arc<[HostTensor]>, usize);

impl AsRef<[u8]> for HostBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0[self.1].bytes
    }
}

impl<'a> ChunkSource<'a> {
    /// The tensors of a weight update (a device update streams its first replica); `None`
    /// for device weights laid out for tensor parallelism, whose devices hold only parts.
    pub(crate) fn of(params: &'a UpdateParams) -> Option<ChunkSource<'a>> {
        match params {
            UpdateParams::Device(weights) => weights.whole().map(ChunkSource::Device),
            UpdateParams::Host(tensors) => Some(ChunkSource::Host(tensors)),
        }
    }

    fn len(&self) -> usize {
        match self {
            ChunkSource::Device(b) => b.len(),
            ChunkSource::Host(t) => t.len(),
        }
    }

    fn dims(&self, index: usize) -> Vec<i64> {
        match self {
            ChunkSource::Device(b) => b[index].dims().to_vec(),
            ChunkSource::Host(t) => t[index].shape.iter().map(|&d| d as i64).collect(),
        }
    }

    fn dtype(&self, index: usize) -> DType {
        match self {
            ChunkSource::Device(b) => b[index].dtype(),
            ChunkSource::Host(t) => t[index].dtype,
        }
    }

    /// Tensor `index`'s bytes on the host: a device buffer read into `host`'s copies, or a
    /// host tensor's own bytes (shared, not copied).
    fn bytes(&self, index: usize, host: &mut HostCopies) -> xla::runtime::Result<Bytes> {
        match self {
            ChunkSource::Device(b) => host.read(index, &b[index]),
            ChunkSource::Host(t) => Ok(Bytes::from_owner(HostBytes(Arc::clone(t), index))),
        }
    }
}

/// The host copies of a weight update's tensors. Reading a device buffer into memory that was
/// used before costs a plain copy; into fresh memory it also costs a page fault per 4 KiB,
/// about as much again, so a client keeps the copies of one push for the next.
#[derive(Default)]
pub(crate) struct HostCopies {
    /// Buffers to read into, by tensor index.
    spare: Vec<Option<Vec<u8>>>,
    /// The copies made, by tensor index, shared with the chunks sliced from them.
    made: Vec<Option<Bytes>>,
}

impl HostCopies {
    /// Reads into `spare` (by tensor index) where it has a buffer.
    pub(crate) fn reusing(spare: Vec<Option<Vec<u8>>>) -> HostCopies {
        HostCopies {
            spare,
            made: Vec::new(),
        }
    }

    /// The host copy of tensor `index`: its bytes, read from the device.
    fn read(&mut self, index: usize, buffer: &Buffer) -> xla::runtime::Result<Bytes> {
        let size = buffer.element_count() * buffer.dtype().size_bytes();
        let mut host = self
            .spare
            .get_mut(index)
            .and_then(Option::take)
            .unwrap_or_default();
        // Only a new or grown buffer gets fresh (zeroed) memory.
        host.resize(size, 0);
        read_into(buffer, &mut host)?;
        let bytes = Bytes::from(host);
        if self.made.len() <= index {
            self.made.resize(index + 1, None);
        }
        self.made[index] = Some(bytes.clone());
        Ok(bytes)
    }

    /// The copies back as buffers to read into next time; a copy some chunk still holds is
    /// left to it.
    pub(crate) fn reclaim(self) -> Vec<Option<Vec<u8>>> {
        self.made
            .into_iter()
            .map(|copy| copy.and_then(|b| b.try_into_mut().ok()).map(Vec::from))
            .collect()
    }
}

/// Copies `buffer` to `host` (exactly its size in bytes) without an intermediate buffer.
fn read_into(buffer: &Buffer, host: &mut [u8]) -> xla::runtime::Result<()> {
    match buffer.dtype() {
        DType::F32 => {
            // SAFETY: every bit pattern is a valid f32; align_to_mut leaves out any bytes that
            // are not aligned for it (none for a heap buffer), which the fallback below covers.
            let (head, values, tail) = unsafe { host.align_to_mut::<f32>() };
            if head.is_empty() && tail.is_empty() {
                return buffer.to_host_into(values);
            }
        }
        DType::BF16 => {
            // SAFETY: as above, for bf16.
            let (head, values, tail) = unsafe { host.align_to_mut::<half::bf16>() };
            if head.is_empty() && tail.is_empty() {
                return buffer.to_host_into(values);
            }
        }
        _ => {}
    }
    host.copy_from_slice(&buffer.to_bytes()?);
    Ok(())
}

/// [`send_chunks`] from `params`, reading device buffers into `host`. Returns the stream's
/// digest ([`WeightDigest`]), which the worker reports back once it installed the update.
pub(crate) fn send_chunks_from(
    version: u64,
    params: &ChunkSource,
    tensors: &[(String, Vec<i64>)],
    dtype: DType,
    host: &mut HostCopies,
    mut send: impl FnMut(proto::WeightChunk) -> bool,
) -> Result<u32, RoleError> {
    let per_chunk = (CHUNK_BYTES / dtype.size_bytes()).max(1);
    let mut digest = WeightDigest::default();
    for (index, (name, dims)) in tensors.iter().enumerate() {
        let from = params.dtype(index);
        let how = conversion(from, dtype).expect("checked by check_layout");
        // The one device-to-host copy; chunks of the same dtype are slices of it.
        let source = params.bytes(index, host).map_err(|e| {
            RoleError::Invalid(format!(
                "weight update {version}: cannot read tensor {index} `{name}` to the host: {e}"
            ))
        })?;
        let elements = source.len() / from.size_bytes();
        let mut start = 0;
        loop {
            let end = (start + per_chunk).min(elements);
            let data = convert_range(&source, how, from, start..end);
            let chunk = proto::WeightChunk {
                version,
                tensor_count: tensors.len() as u32,
                tensor_index: index as u32,
                tensor_name: name.clone(),
                dtype: dtype.to_string(),
                dims: dims.clone(),
                offset: (start * dtype.size_bytes()) as u64,
                crc32: crc32fast::hash(&data),
                data,
            };
            digest.add(&chunk);
            if !send(chunk) {
                return Ok(digest.value());
            }
            start = end;
            if start >= elements {
                break;
            }
        }
    }
    Ok(digest.value())
}

impl RolloutRole for RemoteRollout {
    fn generate(
        &self,
        requests: Vec<GenerationRequest>,
        samples: UnboundedSender<Sample>,
    ) -> BoxFuture<'_, Result<(), RoleError>> {
        Box::pin(async move {
            let request = proto::GenerateRequest {
                requests: requests.iter().map(request_to_proto).collect(),
                min_weight_version: self.latest_version(),
            };
            let mut brought_up_to_date = false;
            let mut stream = loop {
                match self.client.clone().generate(request.clone()).await {
                    Ok(reply) => break reply.into_inner(),
                    Err(status)
                        if status.code() == tonic::Code::FailedPrecondition && !brought_up_to_date =>
                    {
                        let Some(update) = lock(&self.latest).clone() else {
                            return Err(self.error(status));
                        };
                        tracing::info!(
                            worker = %self.address,
                            version = update.version,
                            "the rollout worker is behind ({}); sending it the newest weights",
                            status.message()
                        );
                        self.push(&update).await?;
                        brought_up_to_date = true;
                    }
                    Err(status) => return Err(self.error(status)),
                }
            };
            while let Some(message) = stream.message().await.map_err(|s| self.error(s))? {
                let sample = sample_from_proto(message).map_err(|e| {
                    RoleError::Invalid(format!("the rollout worker at {} sent {e}", self.address))
                })?;
                self.version.fetch_max(sample.weight_version, Ordering::SeqCst);
                // The caller may have stopped listening; the call still runs to its end.
                let _ = samples.send(sample);
            }
            Ok(())
        })
    }

    fn update_weights(&self, update: WeightUpdate) -> BoxFuture<'_, Result<u64, RoleError>> {
        Box::pin(async move {
            {
                let mut latest = lock(&self.latest);
                if latest.as_ref().is_none_or(|l| l.version <= update.version) {
                    *latest = Some(update.clone());
                }
            }
            self.push(&update).await
        })
    }

    fn weight_version(&self) -> u64 {
        self.version.load(Ordering::SeqCst)
    }

    fn location(&self) -> String {
        self.address.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushes_read_into_the_host_copies_of_the_last_push() {
        let client = xla::runtime::Client::cpu(1).unwrap();
        let values: Vec<f32> = (0..3000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let halves: Vec<half::bf16> = values.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let params = vec![
            client.buffer_from_host(&values, &[3000], 0).unwrap(),
            client.buffer_from_host(&halves, &[1000, 3], 0).unwrap(),
        ];
        let tensors = vec![("a".to_string(), vec![3000]), ("b".to_string(), vec![1000, 3])];
        let push = |host: &mut HostCopies| {
            let mut received: Vec<Vec<u8>> = vec![Vec::new(), Vec::new()];
            send_chunks_from(
                3,
                &ChunkSource::Device(&params),
                &tensors,
                DType::F32,
                host,
                |c| {
                    assert_eq!(c.crc32, crc32fast::hash(&c.data));
                    assert_eq!(c.offset as usize, received[c.tensor_index as usize].len());
                    received[c.tensor_index as usize].extend_from_slice(&c.data);
                    true
                },
            )
            .unwrap();
            received
        };
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let widened: Vec<u8> = halves.iter().flat_map(|v| v.to_f32().to_le_bytes()).collect();
        let mut first = HostCopies::default();
        assert_eq!(push(&mut first), vec![f32_bytes.clone(), widened.clone()]);
        let spare = first.reclaim();
        assert_eq!(
            spare.iter().map(|s| s.as_ref().map(Vec::len)).collect::<Vec<_>>(),
            [Some(12000), Some(6000)]
        );
        let reused = spare[0].as_ref().unwrap().as_ptr();
        let mut second = HostCopies::reusing(spare);
        assert_eq!(push(&mut second), vec![f32_bytes, widened]);
        assert_eq!(
            second.reclaim()[0].as_ref().unwrap().as_ptr(),
            reused,
            "read into the same memory"
        );
    }

    #[test]
    fn conversions_round_like_half_and_cover_the_range() {
        let mut values = vec![1.0f32, -2.5, 5.3, 1e-3, 65504.0, -0.0];
        // Ties, NaN, infinities, the largest finite value, subnormals, and random bit patterns
        // all convert as half does.
        let odd: Vec<f32> = [
            0x3f80_8000u32,
            0x3f81_8000,
            0x7fc0_0001,
            0x7f80_0001,
            0x7f80_0000,
            0xff80_0000,
            0x7f7f_ffff,
            0x0000_0001,
        ]
        .iter()
        .map(|&b| f32::from_bits(b))
        .chain((0..1000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))))
        .collect();
        let odd_bytes: Vec<u8> = odd.iter().flat_map(|v| v.to_le_bytes()).collect();
        let odd_bytes = Bytes::from(odd_bytes);
        let converted = convert_range(&odd_bytes, Conversion::F32ToBf16, DType::F32, 0..odd.len());
        let by_half: Vec<u8> = odd
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        assert_eq!(converted, by_half);
        values.truncate(6);
        let bytes: Bytes = values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>()
            .into();
        let bf = convert_range(&bytes, Conversion::F32ToBf16, DType::F32, 1..5);
        let expected: Vec<u8> = values[1..5]
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        assert_eq!(bf, expected);
        let back = convert_range(&bf, Conversion::Bf16ToF32, DType::BF16, 0..4);
        let back: Vec<f32> = back
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(back, vec![-2.5, 5.3125, 0.0009994507, 65536.0]);
        assert_eq!(
            convert_range(&bytes, Conversion::Same, DType::F32, 5..6),
            (-0.0f32).to_le_bytes().as_slice()
        );
        // Same-dtype chunks share the tensor's host copy instead of copying it.
        let slice = convert_range(&bytes, Conversion::Same, DType::F32, 2..4);
        assert_eq!(slice.as_ptr(), bytes[8..].as_ptr());
        assert_eq!(conversion(DType::F32, DType::F16), None);
        assert_eq!(parse_dtype("bf16"), Some(DType::BF16));
        assert_eq!(parse_dtype("f16"), None);
    }
}
