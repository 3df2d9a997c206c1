//! Serving one role in a worker process (`grpo worker`): the role's gRPC service plus the
//! `Worker` health service, both behind the run's token.

use crate::auth::Token;
use crate::proto;
use crate::recipe::TlsSection;
use crate::roles::learner::LearnerService;
use crate::roles::reward::{LocalReward, RewardService};
use crate::roles::rollout::RolloutService;
use crate::roles::Role;
use crate::transport::{server_builder, TransportError};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;

/// What a worker serves.
#[derive(Clone)]
enum Serving {
    Reward(Arc<LocalReward>),
    Rollout(Arc<RolloutService>),
    Learner(Arc<LearnerService>),
}

impl Serving {
    fn role(&self) -> Role {
        match self {
            Serving::Reward(_) => Role::Reward,
            Serving::Rollout(_) => Role::Rollout,
            Serving::Learner(_) => Role::Learner,
        }
    }
}

struct WorkerService {
    serving: Serving,
}

#[tonic::async_trait]
impl proto::worker_server::Worker for WorkerService {
    async fn health(
        &self,
        _: tonic::Request<proto::HealthRequest>,
    ) -> Result<tonic::Response<proto::HealthReply>, tonic::Status> {
        let in_flight = match &self.serving {
            Serving::Reward(r) => r.in_flight() as u64,
            Serving::Rollout(r) => r.in_flight(),
            Serving::Learner(l) => l.in_flight(),
        };
        Ok(tonic::Response::new(proto::HealthReply {
            role: self.serving.role().name().into(),
            version: env!("CARGO_PKG_VERSION").into(),
            in_flight,
        }))
    }
}

/// A bound worker, ready to serve (plain TCP unless [`Worker::with_tls`] says otherwise).
pub struct Worker {
    listener: TcpListener,
    token: Token,
    serving: Serving,
    server: tonic::transport::Server,
}

fn plain_server() -> tonic::transport::Server {
    server_builder(None).expect("plain TCP needs no certificates")
}

impl Worker {
    /// Bind a reward worker. Port 0 picks a free port; [`Worker::local_addr`] tells which.
    pub async fn bind_reward(
        listen: SocketAddr,
        token: Token,
        reward: LocalReward,
    ) -> std::io::Result<Worker> {
        Ok(Worker {
            listener: TcpListener::bind(listen).await?,
            token,
            serving: Serving::Reward(Arc::new(reward)),
            server: plain_server(),
        })
    }

    /// Bind a rollout worker. Port 0 picks a free port; [`Worker::local_addr`] tells which.
    pub async fn bind_rollout(
        listen: SocketAddr,
        token: Token,
        rollout: RolloutService,
    ) -> std::io::Result<Worker> {
        Ok(Worker {
            listener: TcpListener::bind(listen).await?,
            token,
            serving: Serving::Rollout(Arc::new(rollout)),
            server: plain_server(),
        })
    }

    /// Bind a learner worker. Port 0 picks a free port; [`Worker::local_addr`] tells which.
    pub async fn bind_learner(
        listen: SocketAddr,
        token: Token,
        learner: LearnerService,
    ) -> std::io::Result<Worker> {
        Ok(Worker {
            listener: TcpListener::bind(listen).await?,
            token,
            serving: Serving::Learner(Arc::new(learner)),
            server: plain_server(),
        })
    }

    /// Serve over TLS when `tls` (the recipe's `cluster.tls`) is given: the worker presents
    /// `cluster.tls.cert` with `cluster.tls.key`. The files are read now, so a wrong path fails
    /// before the worker says it is listening.
    pub fn with_tls(mut self, tls: Option<&TlsSection>) -> Result<Worker, TransportError> {
        self.server = server_builder(tls)?;
        Ok(self)
    }

    /// The role this worker serves.
    pub fn role(&self) -> Role {
        self.serving.role()
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serve until `shutdown` resolves.
    pub async fn serve(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        let check = self.token.interceptor();
        let health = WorkerService {
            serving: self.serving.clone(),
        };
        let incoming = crate::transport::incoming(self.listener);
        let mut server = self
            .server
            .initial_stream_window_size(RolloutService::STREAM_WINDOW_BYTES)
            .initial_connection_window_size(RolloutService::CONNECTION_WINDOW_BYTES)
            .max_frame_size(RolloutService::MAX_FRAME_BYTES);
        let router = server.add_service(proto::worker_server::WorkerServer::with_interceptor(
            health,
            check.clone(),
        ));
        let router = match self.serving {
            Serving::Reward(local) => {
                router.add_service(tonic::service::interceptor::InterceptedService::new(
                    proto::reward_server::RewardServer::new(RewardService { local })
                        .max_decoding_message_size(256 << 20),
                    check,
                ))
            }
            Serving::Rollout(service) => {
                router.add_service(tonic::service::interceptor::InterceptedService::new(
                    proto::rollout_server::RolloutServer::from_arc(service)
                        .max_decoding_message_size(RolloutService::MAX_MESSAGE_BYTES)
                        .max_encoding_message_size(RolloutService::MAX_MESSAGE_BYTES),
                    check,
                ))
            }
            Serving::Learner(service) => {
                router.add_service(tonic::service::interceptor::InterceptedService::new(
                    proto::learner_server::LearnerServer::new(service)
                        .max_decoding_message_size(LearnerService::MAX_MESSAGE_BYTES)
                        .max_encoding_message_size(LearnerService::MAX_MESSAGE_BYTES),
                    check,
                ))
            }
        };
        router.serve_with_incoming_shutdown(incoming, shutdown).await
    }
}
