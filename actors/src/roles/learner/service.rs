//! The gRPC server side of the learner role: a [`LocalLearner`] in the worker process, built
//! when the orchestrator calls `Start` (from the recipe's model, or from the checkpoint state it
//! streams), then updated, read for weights and read for checkpoints.

use super::local::{initial_weights, role_error, InitialWeights, LocalLearner};
use super::remote::{
    chunk_table, report_to_proto, row_from_proto, states_chunks, StateReceiver, MAX_MESSAGE_BYTES,
};
use super::LearnerRole;
use crate::proto;
use crate::recipe::Recipe;
use crate::roles::rollout::send_chunks;
use crate::roles::RoleError;
use model::ParamSpec;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tonic::{Request, Response, Status};
use trainer::update::UpdateClocks;
use xla::runtime::Client;
use xla::DType;

/// Messages queued ahead of the network on the streams this worker sends.
const MESSAGES_IN_FLIGHT: usize = 8;

/// The server side of the learner role in a worker process.
pub struct LearnerService {
    client: Client,
    recipe: Recipe,
    config: model::ModelConfig,
    specs: Vec<ParamSpec>,
    /// With PPO, the critic's parameter table.
    critic_specs: Option<Vec<ParamSpec>>,
    /// A new run's start (and the reference).
    initial: InitialWeights,
    learner: Mutex<Option<Arc<LocalLearner>>>,
    /// Updates in progress (0 or 1), for the health check.
    in_flight: AtomicU64,
}

impl LearnerService {
    /// The largest gRPC message the worker takes or sends.
    pub const MAX_MESSAGE_BYTES: usize = MAX_MESSAGE_BYTES;

    /// Serves the learner of `recipe` on `client`'s device, for a model of `config` whose
    /// weights are `weights` (taken out: the worker keeps them once, in parameter-table order).
    /// The learner itself is built by the first `Start` call.
    pub fn new(
        client: Client,
        recipe: &Recipe,
        config: &model::ModelConfig,
        weights: &mut model::ModelWeights,
    ) -> Result<LearnerService, trainer::update::UpdateError> {
        let specs = crate::setup::policy(recipe, config).param_specs();
        let critic_specs = crate::setup::critic_model_config(recipe, config)
            .map_err(trainer::update::UpdateError::Batch)?
            .map(|c| crate::setup::critic(recipe, &c).param_specs());
        let initial = initial_weights(recipe, weights)?;
        Ok(LearnerService {
            client,
            recipe: recipe.clone(),
            config: config.clone(),
            specs,
            critic_specs,
            initial,
            learner: Mutex::new(None),
            in_flight: AtomicU64::new(0),
        })
    }

    /// Updates in progress.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::SeqCst)
    }

    fn learner(&self) -> Result<Arc<LocalLearner>, Status> {
        self.learner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| {
                Status::failed_precondition("this learner worker has not been started: call Start first")
            })
    }

    fn status(&self, optimizer_steps: u64) -> proto::LearnerStatus {
        proto::LearnerStatus {
            optimizer_steps,
            tensors: self
                .specs
                .iter()
                .map(|s| proto::TensorSpec {
                    name: s.name.clone(),
                    dims: s.dims(),
                })
                .collect(),
        }
    }
}

fn to_status(e: RoleError) -> Status {
    match e {
        RoleError::Unavailable { message, .. } => Status::unavailable(message),
        RoleError::Refused { message, .. } => Status::failed_precondition(message),
        RoleError::Invalid(message) => Status::invalid_argument(message),
    }
}

/// Subtracts one from the in-flight count however the call ends.
struct Busy<'a>(&'a AtomicU64);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

type ChunkStream = tokio_stream::wrappers::ReceiverStream<Result<proto::WeightChunk, Status>>;
type StateStream = tokio_stream::wrappers::ReceiverStream<Result<proto::LearnerStateMessage, Status>>;

#[tonic::async_trait]
impl proto::learner_server::Learner for Arc<LearnerService> {
    async fn start(
        &self,
        request: Request<tonic::Streaming<proto::LearnerStateMessage>>,
    ) -> Result<Response<proto::LearnerStatus>, Status> {
        let mut stream = request.into_inner();
        let table = chunk_table(&self.specs, DType::F32);
        let critic_table = self.critic_specs.as_deref().map(|s| chunk_table(s, DType::F32));
        let mut receiver = StateReceiver::new(&table, critic_table.as_deref());
        while let Some(message) = stream.message().await? {
            receiver.add(message).map_err(|e| {
                Status::invalid_argument(format!("the learner state stream was refused: {e}"))
            })?;
        }
        let (counters, resume, critic_resume) = receiver
            .finish()
            .map_err(|e| Status::data_loss(format!("the learner state stream was refused: {e}")))?;
        let service = self.clone();
        let learner = tokio::task::spawn_blocking(move || {
            LocalLearner::start(
                &service.client,
                &service.recipe,
                &service.config,
                service.initial.clone(),
                resume,
                critic_resume,
                UpdateClocks {
                    optimizer_steps: counters.optimizer_steps,
                    kl_coef: counters.kl_coef,
                    critic_optimizer_steps: counters.critic_optimizer_steps,
                    updates: counters.updates,
                },
                counters.total_optimizer_steps,
            )
        })
        .await
        .map_err(|e| Status::internal(format!("the learner build thread failed: {e}")))?
        .map_err(|e| Status::failed_precondition(format!("building the learner: {e}")))?;
        let steps = learner.clocks().optimizer_steps;
        *self.learner.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(learner));
        tracing::info!(optimizer_steps = steps, "learner started");
        Ok(Response::new(self.status(steps)))
    }

    async fn update(
        &self,
        request: Request<proto::LearnerUpdateRequest>,
    ) -> Result<Response<proto::LearnerUpdateReply>, Status> {
        let learner = self.learner()?;
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let _busy = Busy(&self.in_flight);
        let rows = request
            .into_inner()
            .rows
            .into_iter()
            .map(row_from_proto)
            .collect();
        let report = learner.update(rows).await.map_err(to_status)?;
        Ok(Response::new(report_to_proto(report, learner.clocks())))
    }

    type WeightsStream = ChunkStream;

    async fn weights(
        &self,
        request: Request<proto::LearnerWeightsRequest>,
    ) -> Result<Response<ChunkStream>, Status> {
        let request = request.into_inner();
        let dtype = crate::roles::rollout::parse_dtype(&request.dtype).ok_or_else(|| {
            Status::invalid_argument(format!(
                "weights asked for as {:?}; this learner sends f32 or bf16",
                request.dtype
            ))
        })?;
        let learner = self.learner()?;
        let lora = self.recipe.actor.lora_rank > 0;
        let (params, specs) = if lora || request.adapters {
            // The merged weights or the adapters, whole on the first device.
            let source = if request.adapters {
                learner.adapter_source()
            } else {
                learner.rollout_source()
            }
            .map_err(|e| to_status(role_error(e)))?;
            let whole = match source.devices() {
                1 => source.per_device[0].clone(),
                _ => rollout::handoff(&self.client, &source, dtype, 1, false)
                    .map_err(|e| Status::internal(format!("gathering the weights to send: {e}")))?
                    .device(0)
                    .clone(),
            };
            (whole, source.specs)
        } else {
            let params = learner.shared_params().map_err(|e| to_status(role_error(e)))?;
            (params, self.specs.clone())
        };
        if let Some((index, b)) = params
            .iter()
            .enumerate()
            .find(|(_, b)| !matches!(b.dtype(), DType::F32 | DType::BF16))
        {
            return Err(Status::failed_precondition(format!(
                "parameter {index} `{}` is {}; only f32 and bf16 weights can be streamed",
                specs[index].name,
                b.dtype()
            )));
        }
        let tensors: Vec<(String, Vec<i64>)> = specs.iter().map(|s| (s.name.clone(), s.dims())).collect();
        let (out, stream) = tokio::sync::mpsc::channel(MESSAGES_IN_FLIGHT);
        tokio::task::spawn_blocking(move || {
            let sent = send_chunks(request.version, &params, &tensors, dtype, |chunk| {
                out.blocking_send(Ok(chunk)).is_ok()
            });
            if let Err(e) = sent {
                let _ = out.blocking_send(Err(to_status(e)));
            }
        });
        Ok(Response::new(ChunkStream::new(stream)))
    }

    type StateStream = StateStream;

    async fn state(&self, _: Request<proto::LearnerStateRequest>) -> Result<Response<StateStream>, Status> {
        let learner = self.learner()?;
        let (specs, critic_specs) = (self.specs.clone(), self.critic_specs.clone());
        let (out, stream) = tokio::sync::mpsc::channel(MESSAGES_IN_FLIGHT);
        tokio::task::spawn_blocking(move || {
            let states = match learner.read_state() {
                Ok(s) => s,
                Err(e) => {
                    let _ =
                        out.blocking_send(Err(Status::internal(format!("reading the learner state: {e}"))));
                    return;
                }
            };
            let clocks = learner.clocks();
            let steps = clocks.optimizer_steps;
            let first = proto::LearnerStateMessage {
                counters: Some(proto::LearnerCounters {
                    adam_step: states.policy.adam_step,
                    optimizer_steps: steps,
                    total_optimizer_steps: 0,
                    kl_coef: clocks.kl_coef,
                    critic_adam_step: states.critic.as_ref().map_or(0, |c| c.adam_step),
                    critic_optimizer_steps: clocks.critic_optimizer_steps,
                    updates: clocks.updates,
                }),
                ..Default::default()
            };
            if out.blocking_send(Ok(first)).is_err() {
                return;
            }
            states_chunks(steps, &specs, critic_specs.as_deref(), &states, |m| {
                out.blocking_send(Ok(m)).is_ok()
            });
        });
        Ok(Response::new(StateStream::new(stream)))
    }
}
