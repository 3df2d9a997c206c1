//! The learner role in a worker process (`grpo worker --role learner`), reached over gRPC.
//!
//! Weights come back as the rollout weight stream's CRC-32-checked [`proto::WeightChunk`]s in
//! the dtype asked for; the learner's state (f32 parameters and AdamW moments) travels in the
//! same chunks, each tagged with the part of the state it belongs to, after a first message with
//! the counters. The chunking and the checked assembly are the rollout stream's own
//! ([`crate::roles::rollout`]); the conversions between the learner's types and the protobuf
//! messages live here and the server side ([`super::LearnerService`]) uses them too.

use super::{LearnerRole, LearnerStates, LearnerWeights, Synced};
use crate::auth::{Attach, Token};
use crate::proto;
use crate::recipe::TlsSection;
use crate::roles::rollout::{Assembly, CHUNK_BYTES};
use crate::roles::{status_to_error, BoxFuture, RoleError};
use model::HostTensor;
use model::ParamSpec;
use std::sync::Mutex;
use std::time::Duration;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use trainer::step::LearnerState;
use trainer::update::{Row, UpdateClocks, UpdateReport};
use xla::DType;

/// The largest message either side accepts (a step's scored rows, or a chunk).
pub(crate) const MAX_MESSAGE_BYTES: usize = 256 << 20;
/// Chunks read ahead of the network.
const CHUNKS_IN_FLIGHT: usize = 8;

type LearnerClient = proto::learner_client::LearnerClient<InterceptedService<Channel, Attach>>;

/// The learner role in a worker process, reached over gRPC.
pub struct RemoteLearner {
    address: String,
    client: LearnerClient,
    /// The trainable parameters' table (with LoRA the adapters'): the state's.
    specs: Vec<ParamSpec>,
    /// The model's parameter table: the weights'.
    model_specs: Vec<ParamSpec>,
    /// With PPO, the critic's parameter table: its state's.
    critic_specs: Option<Vec<ParamSpec>>,
    clocks: Mutex<UpdateClocks>,
}

impl RemoteLearner {
    /// A client for the learner worker at `address` (`127.0.0.1:PORT`, with or without
    /// `http://`) whose policy trains the parameter table `specs` (with LoRA the adapters') of a
    /// model with the table `model_specs`; connects lazily (call it inside a
    /// tokio runtime), over TLS when `tls` (the recipe's `cluster.tls`) is given. A worker that
    /// does not answer an HTTP/2 ping (or a connection attempt) within `timeout` is unavailable;
    /// a long update that keeps answering pings is not.
    pub fn with_timeout(
        address: &str,
        token: &Token,
        tls: Option<&TlsSection>,
        timeout: Duration,
        specs: Vec<ParamSpec>,
        model_specs: Vec<ParamSpec>,
    ) -> Result<RemoteLearner, RoleError> {
        use crate::roles::rollout::RolloutService as R;
        let endpoint =
            crate::transport::endpoint(address, tls).map_err(|e| RoleError::Invalid(e.to_string()))?;
        let channel = crate::transport::keep_alive(endpoint, timeout)
            .initial_stream_window_size(R::STREAM_WINDOW_BYTES)
            .initial_connection_window_size(R::CONNECTION_WINDOW_BYTES)
            .connect_lazy();
        let client = proto::learner_client::LearnerClient::with_interceptor(channel, token.attach())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(RemoteLearner {
            address: crate::transport::worker_uri(address, tls),
            client,
            specs,
            model_specs,
            critic_specs: None,
            clocks: Mutex::new(UpdateClocks::default()),
        })
    }

    /// This client for a learner that trains PPO's critic of the parameter table `specs` too.
    pub fn with_critic(mut self, specs: Vec<ParamSpec>) -> RemoteLearner {
        self.critic_specs = Some(specs);
        self
    }

    fn error(&self, status: tonic::Status) -> RoleError {
        status_to_error("learner", &self.address, status)
    }

    fn bad_stream(&self, what: &str, e: impl std::fmt::Display) -> RoleError {
        RoleError::Invalid(format!(
            "the learner worker at {} sent a bad {what} stream: {e}",
            self.address
        ))
    }

    /// Builds the learner in the worker: from the recipe's model with zero optimizer state
    /// (`resume` is `None`), or from a checkpoint's state (the critic's too), which is streamed
    /// to it. `clocks` are the schedule's clock and the KL coefficient at that state,
    /// `total_optimizer_steps` the schedule's length. Resolves once the worker has compiled its
    /// programs and holds the state.
    pub async fn start(
        &self,
        resume: Option<LearnerStates>,
        clocks: UpdateClocks,
        total_optimizer_steps: u64,
    ) -> Result<(), RoleError> {
        let optimizer_steps = clocks.optimizer_steps;
        let counters = proto::LearnerCounters {
            adam_step: resume.as_ref().map_or(0, |s| s.policy.adam_step),
            optimizer_steps,
            total_optimizer_steps,
            kl_coef: clocks.kl_coef,
            critic_adam_step: resume
                .as_ref()
                .and_then(|s| s.critic.as_ref())
                .map_or(0, |c| c.adam_step),
            critic_optimizer_steps: clocks.critic_optimizer_steps,
            updates: clocks.updates,
        };
        let (messages, stream) = tokio::sync::mpsc::channel(CHUNKS_IN_FLIGHT);
        let (specs, critic_specs) = (self.specs.clone(), self.critic_specs.clone());
        let producer = tokio::task::spawn_blocking(move || {
            let first = proto::LearnerStateMessage {
                counters: Some(counters),
                ..Default::default()
            };
            if messages.blocking_send(first).is_err() {
                return;
            }
            if let Some(states) = resume {
                states_chunks(optimizer_steps, &specs, critic_specs.as_deref(), &states, |m| {
                    messages.blocking_send(m).is_ok()
                });
            }
        });
        let reply = self
            .client
            .clone()
            .start(tokio_stream::wrappers::ReceiverStream::new(stream))
            .await;
        producer
            .await
            .map_err(|e| RoleError::Invalid(format!("the learner state sender failed: {e}")))?;
        let status = reply.map_err(|s| self.error(s))?.into_inner();
        check_table(&self.specs, &status.tensors, &self.address)?;
        *self.lock_clocks() = UpdateClocks {
            optimizer_steps: status.optimizer_steps,
            ..clocks
        };
        Ok(())
    }

    fn lock_clocks(&self) -> std::sync::MutexGuard<'_, UpdateClocks> {
        self.clocks.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The worker's parameter table must be the orchestrator's.
fn check_table(specs: &[ParamSpec], tensors: &[proto::TensorSpec], address: &str) -> Result<(), RoleError> {
    if specs.len() != tensors.len() {
        return Err(RoleError::Invalid(format!(
            "the learner worker at {address} has {} parameters, this run's model has {} \
             (a different model?)",
            tensors.len(),
            specs.len()
        )));
    }
    for (index, (s, t)) in specs.iter().zip(tensors).enumerate() {
        if s.name != t.name || s.dims() != t.dims {
            return Err(RoleError::Invalid(format!(
                "the learner worker at {address} has parameter {index} `{}` {:?}, this run's \
                 model has `{}` {:?} (a different model?)",
                t.name, t.dims, s.name, s.shape
            )));
        }
    }
    Ok(())
}

/// `(name, dims, bytes)` of every parameter as `dtype`: what an [`Assembly`] checks chunks
/// against.
pub(crate) fn chunk_table(specs: &[ParamSpec], dtype: DType) -> Vec<(String, Vec<i64>, u64)> {
    specs
        .iter()
        .map(|s| {
            let bytes = (s.numel() * dtype.size_bytes()) as u64;
            (s.name.clone(), s.dims(), bytes)
        })
        .collect()
}

/// The parts of a learner state, in the order they are sent.
const PARTS: [proto::StatePart; 3] = [
    proto::StatePart::Params,
    proto::StatePart::AdamM,
    proto::StatePart::AdamV,
];

/// [`state_chunks`] of the policy's state, then of the critic's (tagged `critic`) when
/// `critic_specs` and the states have one. Returns false when `send` did.
pub(crate) fn states_chunks(
    version: u64,
    specs: &[ParamSpec],
    critic_specs: Option<&[ParamSpec]>,
    states: &LearnerStates,
    mut send: impl FnMut(proto::LearnerStateMessage) -> bool,
) -> bool {
    if !state_chunks(version, specs, &states.policy, false, &mut send) {
        return false;
    }
    match (critic_specs, &states.critic) {
        (Some(specs), Some(critic)) => state_chunks(version, specs, critic, true, send),
        _ => true,
    }
}

/// Cuts `state`'s parameters and moments into checksummed f32 chunks of about [`CHUNK_BYTES`],
/// stamped `version` (and tagged as the critic's with `critic`), and hands them to `send` in
/// order. Stops when `send` returns false (the call ended; its status says why), and returns
/// false then.
pub(crate) fn state_chunks(
    version: u64,
    specs: &[ParamSpec],
    state: &LearnerState,
    critic: bool,
    mut send: impl FnMut(proto::LearnerStateMessage) -> bool,
) -> bool {
    let per_chunk = CHUNK_BYTES / 4;
    for (part, values) in PARTS.into_iter().zip([&state.params, &state.m, &state.v]) {
        for (index, (spec, tensor)) in specs.iter().zip(values.iter()).enumerate() {
            let mut start = 0;
            loop {
                let end = (start + per_chunk).min(tensor.len());
                let data: Vec<u8> = tensor[start..end].iter().flat_map(|v| v.to_le_bytes()).collect();
                let chunk = proto::WeightChunk {
                    version,
                    tensor_count: specs.len() as u32,
                    tensor_index: index as u32,
                    tensor_name: spec.name.clone(),
                    dtype: DType::F32.to_string(),
                    dims: spec.dims(),
                    offset: (start * 4) as u64,
                    crc32: crc32fast::hash(&data),
                    data: data.into(),
                };
                let message = proto::LearnerStateMessage {
                    counters: None,
                    part: part as i32,
                    chunk: Some(chunk),
                    critic,
                };
                if !send(message) {
                    return false;
                }
                start = end;
                if start >= tensor.len() {
                    break;
                }
            }
        }
    }
    true
}

/// Puts a learner state stream back together, checking every chunk against the parameter
/// tables: the counters first, then any number of chunks of the three parts of the policy's
/// state and, with a critic table, of the critic's.
pub(crate) struct StateReceiver<'a> {
    counters: Option<proto::LearnerCounters>,
    policy: PartsAssembly<'a>,
    critic: Option<PartsAssembly<'a>>,
}

/// The three parts of one learner's state as they arrive.
struct PartsAssembly<'a> {
    parts: Vec<Assembly<'a>>,
    values: Vec<Vec<Option<Vec<f32>>>>,
    chunks: usize,
}

impl<'a> PartsAssembly<'a> {
    fn new(table: &'a [(String, Vec<i64>, u64)]) -> PartsAssembly<'a> {
        PartsAssembly {
            parts: PARTS.iter().map(|_| Assembly::new(table, DType::F32)).collect(),
            values: PARTS.iter().map(|_| vec![None; table.len()]).collect(),
            chunks: 0,
        }
    }

    fn add(&mut self, part: usize, chunk: proto::WeightChunk) -> Result<(), String> {
        self.chunks += 1;
        let name = PARTS[part].as_str_name();
        if let Some((index, bytes)) = self.parts[part].add(chunk).map_err(|e| format!("{name}: {e}"))? {
            let values = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            self.values[part][index] = Some(values);
        }
        Ok(())
    }

    /// The state, when any chunk arrived (every part must then be complete).
    fn finish(self, adam_step: i32, whose: &str) -> Result<Option<LearnerState>, String> {
        if self.chunks == 0 {
            return Ok(None);
        }
        for (part, assembly) in self.parts.iter().enumerate() {
            assembly
                .finish()
                .map_err(|e| format!("{whose}{}: {e}", PARTS[part].as_str_name()))?;
        }
        let mut parts = self.values.into_iter().map(|tensors| {
            tensors
                .into_iter()
                .map(|t| t.expect("finish() checked every tensor"))
                .collect()
        });
        let (params, m, v) = (
            parts.next().expect("three parts"),
            parts.next().expect("three parts"),
            parts.next().expect("three parts"),
        );
        Ok(Some(LearnerState {
            params,
            m,
            v,
            adam_step,
        }))
    }
}

impl<'a> StateReceiver<'a> {
    /// A receiver for states of the parameter table `table` (from [`chunk_table`] with f32),
    /// and of a critic's `critic` when the learner has one.
    pub(crate) fn new(
        table: &'a [(String, Vec<i64>, u64)],
        critic: Option<&'a [(String, Vec<i64>, u64)]>,
    ) -> StateReceiver<'a> {
        StateReceiver {
            counters: None,
            policy: PartsAssembly::new(table),
            critic: critic.map(PartsAssembly::new),
        }
    }

    /// Takes one message of the stream.
    pub(crate) fn add(&mut self, message: proto::LearnerStateMessage) -> Result<(), String> {
        if let Some(c) = message.counters {
            if self.counters.is_some() || self.policy.chunks > 0 {
                return Err("the counters must come once, in the first message".into());
            }
            self.counters = Some(c);
        }
        let Some(chunk) = message.chunk else {
            return Ok(());
        };
        if self.counters.is_none() {
            return Err("a chunk arrived before the counters".into());
        }
        let part = PARTS
            .iter()
            .position(|p| *p as i32 == message.part)
            .ok_or_else(|| format!("a chunk of an unknown part of the state ({})", message.part))?;
        match (message.critic, self.critic.as_mut()) {
            (false, _) => self.policy.add(part, chunk),
            (true, Some(critic)) => critic.add(part, chunk).map_err(|e| format!("critic {e}")),
            (true, None) => Err("a chunk of a critic's state, but this learner has no critic".into()),
        }
    }

    /// The counters, and the policy's and the critic's states when any of their chunks
    /// arrived (every part must then be complete).
    pub(crate) fn finish(
        self,
    ) -> Result<(proto::LearnerCounters, Option<LearnerState>, Option<LearnerState>), String> {
        let counters = self.counters.ok_or("the stream held no counters")?;
        let policy = self.policy.finish(counters.adam_step, "")?;
        let critic = match self.critic {
            Some(c) => c.finish(counters.critic_adam_step, "critic ")?,
            None => None,
        };
        Ok((counters, policy, critic))
    }
}

pub(crate) fn row_to_proto(r: &Row) -> proto::LearnerRow {
    proto::LearnerRow {
        group: r.group,
        prompt: r.prompt.clone(),
        response: r.response.clone(),
        rollout_log_probs: r.rollout_log_probs.clone(),
        score: r.score,
        truncated: r.truncated,
        reward_baseline: r.reward_baseline,
        env_spans: r
            .env_spans
            .iter()
            .flat_map(|s| [s.start as u64, s.end as u64])
            .collect(),
        routes: r.routes.clone(),
    }
}

pub(crate) fn row_from_proto(r: proto::LearnerRow) -> Row {
    Row {
        group: r.group,
        prompt: r.prompt,
        response: r.response,
        rollout_log_probs: r.rollout_log_probs,
        score: r.score,
        reward_baseline: r.reward_baseline,
        truncated: r.truncated,
        // An odd trailing bound becomes an empty span, which the update refuses with the
        // spans out of order or range.
        env_spans: r
            .env_spans
            .chunks(2)
            .map(|p| p[0] as usize..p[p.len() - 1] as usize)
            .collect(),
        routes: r.routes,
    }
}

pub(crate) fn report_to_proto(r: UpdateReport, clocks: UpdateClocks) -> proto::LearnerUpdateReply {
    proto::LearnerUpdateReply {
        metrics: r.metrics.into_iter().collect(),
        trained_tokens: r.trained_tokens as u64,
        processed_tokens: r.processed_tokens as u64,
        optimizer_steps: r.optimizer_steps,
        total_optimizer_steps: clocks.optimizer_steps,
        kl_coef: clocks.kl_coef,
        critic_optimizer_steps: clocks.critic_optimizer_steps,
        updates: clocks.updates,
    }
}

fn report_from_proto(r: proto::LearnerUpdateReply) -> UpdateReport {
    UpdateReport {
        metrics: r.metrics.into_iter().collect(),
        trained_tokens: r.trained_tokens as usize,
        processed_tokens: r.processed_tokens as usize,
        optimizer_steps: r.optimizer_steps,
    }
}

impl LearnerRole for RemoteLearner {
    fn update(&self, rows: Vec<Row>) -> BoxFuture<'_, Result<UpdateReport, RoleError>> {
        Box::pin(async move {
            let request = proto::LearnerUpdateRequest {
                rows: rows.iter().map(row_to_proto).collect(),
            };
            drop(rows);
            let reply = self
                .client
                .clone()
                .update(request)
                .await
                .map_err(|s| self.error(s))?
                .into_inner();
            *self.lock_clocks() = UpdateClocks {
                optimizer_steps: reply.total_optimizer_steps,
                kl_coef: reply.kl_coef,
                critic_optimizer_steps: reply.critic_optimizer_steps,
                updates: reply.updates,
            };
            Ok(report_from_proto(reply))
        })
    }

    fn weights(
        &self,
        version: u64,
        dtype: DType,
        what: Synced,
    ) -> BoxFuture<'_, Result<LearnerWeights, RoleError>> {
        Box::pin(async move {
            let request = proto::LearnerWeightsRequest {
                version,
                dtype: dtype.to_string(),
                adapters: what == Synced::Adapters,
            };
            let specs = match what {
                Synced::Model => &self.model_specs,
                Synced::Adapters => &self.specs,
            };
            let mut stream = self
                .client
                .clone()
                .weights(request)
                .await
                .map_err(|s| self.error(s))?
                .into_inner();
            let table = chunk_table(specs, dtype);
            let mut assembly = Assembly::new(&table, dtype);
            let mut tensors: Vec<Option<HostTensor>> = vec![None; table.len()];
            while let Some(chunk) = stream.message().await.map_err(|s| self.error(s))? {
                if let Some((index, bytes)) = assembly.add(chunk).map_err(|e| self.bad_stream("weight", e))? {
                    let spec = &specs[index];
                    tensors[index] = Some(HostTensor {
                        name: spec.name.clone(),
                        dtype,
                        shape: spec.shape.clone(),
                        bytes: Vec::from(bytes),
                    });
                }
            }
            let sent = assembly.finish().map_err(|e| self.bad_stream("weight", e))?;
            if sent != version {
                return Err(self.bad_stream(
                    "weight",
                    format!("version {sent} arrived where {version} was asked for"),
                ));
            }
            Ok(LearnerWeights::Host(
                tensors
                    .into_iter()
                    .map(|t| t.expect("finish() checked every tensor"))
                    .collect(),
            ))
        })
    }

    fn state(&self) -> BoxFuture<'_, Result<LearnerStates, RoleError>> {
        Box::pin(async move {
            let mut stream = self
                .client
                .clone()
                .state(proto::LearnerStateRequest {})
                .await
                .map_err(|s| self.error(s))?
                .into_inner();
            let table = chunk_table(&self.specs, DType::F32);
            let critic_table = self.critic_specs.as_deref().map(|s| chunk_table(s, DType::F32));
            let mut receiver = StateReceiver::new(&table, critic_table.as_deref());
            while let Some(message) = stream.message().await.map_err(|s| self.error(s))? {
                receiver.add(message).map_err(|e| self.bad_stream("state", e))?;
            }
            let (counters, policy, critic) = receiver.finish().map_err(|e| self.bad_stream("state", e))?;
            *self.lock_clocks() = UpdateClocks {
                optimizer_steps: counters.optimizer_steps,
                kl_coef: counters.kl_coef,
                critic_optimizer_steps: counters.critic_optimizer_steps,
                updates: counters.updates,
            };
            let policy = policy.ok_or_else(|| self.bad_stream("state", "the stream held no tensors"))?;
            if self.critic_specs.is_some() && critic.is_none() {
                return Err(self.bad_stream("state", "the stream held no critic state"));
            }
            Ok(LearnerStates { policy, critic })
        })
    }

    fn clocks(&self) -> UpdateClocks {
        *self.lock_clocks()
    }

    fn location(&self) -> String {
        self.address.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::ParamKind;

    fn specs() -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("a.weight", vec![2, 3], ParamKind::Matrix),
            ParamSpec::new("b.weight", vec![0], ParamKind::Bias),
            ParamSpec::new("c.weight", vec![CHUNK_BYTES / 4 + 5], ParamKind::NormScale),
        ]
    }

    fn state() -> LearnerState {
        let fill = |offset: f32| -> Vec<Vec<f32>> {
            specs()
                .iter()
                .map(|s| {
                    let n = s.numel();
                    (0..n).map(|i| offset + i as f32 * 0.25).collect()
                })
                .collect()
        };
        LearnerState {
            params: fill(1.0),
            m: fill(-3.0),
            v: fill(0.5),
            adam_step: 17,
        }
    }

    fn counters() -> proto::LearnerStateMessage {
        proto::LearnerStateMessage {
            counters: Some(proto::LearnerCounters {
                adam_step: 17,
                optimizer_steps: 9,
                total_optimizer_steps: 40,
                kl_coef: Some(0.0123),
                critic_adam_step: 5,
                critic_optimizer_steps: 6,
                updates: 3,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_state_survives_the_chunk_stream_exactly() {
        let specs = specs();
        let mut messages = vec![counters()];
        state_chunks(9, &specs, &state(), false, |m| {
            messages.push(m);
            true
        });
        // Three parts: a, b (empty: one empty chunk), c (two chunks).
        assert_eq!(messages.len(), 1 + 3 * 4);
        let table = chunk_table(&specs, DType::F32);
        let mut receiver = StateReceiver::new(&table, None);
        for m in messages {
            receiver.add(m).unwrap();
        }
        let (counters, back, critic) = receiver.finish().unwrap();
        assert!(critic.is_none());
        assert_eq!(
            (
                counters.optimizer_steps,
                counters.total_optimizer_steps,
                counters.kl_coef
            ),
            (9, 40, Some(0.0123))
        );
        let (back, want) = (back.unwrap(), state());
        assert_eq!(back.params, want.params);
        assert_eq!(back.m, want.m);
        assert_eq!(back.v, want.v);
        assert_eq!(back.adam_step, 17);
    }

    #[test]
    fn a_critic_state_travels_after_the_policy_state() {
        let (specs, critic_specs) = (specs(), specs()[..2].to_vec());
        let mut critic = state();
        critic.params.truncate(2);
        critic.m.truncate(2);
        critic.v.truncate(2);
        critic.adam_step = 5;
        let states = LearnerStates {
            policy: state(),
            critic: Some(critic.clone()),
        };
        let mut messages = vec![counters()];
        assert!(states_chunks(9, &specs, Some(&critic_specs), &states, |m| {
            messages.push(m);
            true
        }));
        assert_eq!(messages.iter().filter(|m| m.critic).count(), 3 * 2);
        let (table, critic_table) = (
            chunk_table(&specs, DType::F32),
            chunk_table(&critic_specs, DType::F32),
        );
        let mut receiver = StateReceiver::new(&table, Some(&critic_table));
        for m in messages.iter().cloned() {
            receiver.add(m).unwrap();
        }
        let (counters, policy, back) = receiver.finish().unwrap();
        assert_eq!((counters.critic_optimizer_steps, counters.updates), (6, 3));
        assert_eq!(policy.unwrap(), state());
        assert_eq!(back.unwrap(), critic);

        // A learner without a critic refuses a critic's chunks.
        let mut receiver = StateReceiver::new(&table, None);
        let e = messages
            .into_iter()
            .map(|m| receiver.add(m))
            .find_map(Result::err)
            .unwrap();
        assert_eq!(e, "a chunk of a critic's state, but this learner has no critic");
    }

    #[test]
    fn counters_alone_mean_a_fresh_start() {
        let table = chunk_table(&specs(), DType::F32);
        let mut receiver = StateReceiver::new(&table, None);
        receiver.add(counters()).unwrap();
        let (counters, state, critic) = receiver.finish().unwrap();
        assert_eq!(counters.adam_step, 17);
        assert!(state.is_none() && critic.is_none());
    }

    #[test]
    fn broken_state_streams_are_refused_with_the_part_and_tensor() {
        let specs = specs();
        let table = chunk_table(&specs, DType::F32);
        let mut chunks = Vec::new();
        state_chunks(9, &specs, &state(), false, |m| {
            chunks.push(m);
            true
        });

        // A flipped bit in the second moments.
        let mut receiver = StateReceiver::new(&table, None);
        receiver.add(counters()).unwrap();
        let mut corrupt = chunks[8].clone();
        let chunk = corrupt.chunk.as_mut().unwrap();
        let mut data = chunk.data.to_vec();
        data[2] ^= 1;
        chunk.data = data.into();
        for m in chunks[..8].iter().cloned() {
            receiver.add(m).unwrap();
        }
        let e = receiver.add(corrupt).unwrap_err();
        assert!(
            e.starts_with(
                "STATE_PART_ADAM_V: tensor 0 `a.weight`: the chunk at byte 0 fails its CRC-32 check"
            ),
            "{e}"
        );

        // A stream cut short: the first moments' last tensor never arrives whole.
        let mut receiver = StateReceiver::new(&table, None);
        receiver.add(counters()).unwrap();
        for m in chunks[..7].iter().cloned() {
            receiver.add(m).unwrap();
        }
        assert_eq!(
            receiver.finish().unwrap_err(),
            "STATE_PART_ADAM_M: the stream ended with 2 of 3 tensors complete (first missing: \
             tensor 2 `c.weight`)"
        );

        // Chunks before the counters, and no counters at all.
        let mut receiver = StateReceiver::new(&table, None);
        assert_eq!(
            receiver.add(chunks[0].clone()).unwrap_err(),
            "a chunk arrived before the counters"
        );
        assert_eq!(
            StateReceiver::new(&table, None).finish().unwrap_err(),
            "the stream held no counters"
        );
        let mut unknown = chunks[0].clone();
        unknown.part = 9;
        let mut receiver = StateReceiver::new(&table, None);
        receiver.add(counters()).unwrap();
        assert_eq!(
            receiver.add(unknown).unwrap_err(),
            "a chunk of an unknown part of the state (9)"
        );
    }

    #[test]
    fn rows_and_reports_survive_the_wire() {
        let row = Row {
            group: 5 << 24 | 3,
            prompt: vec![1, 2, 3],
            response: vec![7, 8, 9, 10],
            rollout_log_probs: vec![-0.25, 0.0, -1.5, 0.0],
            score: 0.75,
            reward_baseline: Some(0.5),
            truncated: true,
            env_spans: vec![1..2, 3..4],
            routes: Vec::new(),
        };
        assert_eq!(
            format!("{:?}", row_from_proto(row_to_proto(&row))),
            format!("{row:?}")
        );
        let mut report = UpdateReport::default();
        report.metrics.insert("actor/pg_loss".into(), -0.123456789012345);
        report.metrics.insert("actor/kl".into(), 1e-300);
        report.trained_tokens = 31;
        report.processed_tokens = 400;
        report.optimizer_steps = 2;
        let clocks = UpdateClocks {
            optimizer_steps: 12,
            kl_coef: Some(0.0123),
            ..UpdateClocks::default()
        };
        let reply = report_to_proto(report.clone(), clocks);
        assert_eq!((reply.total_optimizer_steps, reply.kl_coef), (12, Some(0.0123)));
        let back = report_from_proto(reply);
        assert_eq!(back.metrics, report.metrics);
        assert_eq!(
            (back.trained_tokens, back.processed_tokens, back.optimizer_steps),
            (31, 400, 2)
        );
    }
}
