//! Serving one role in a worker process (`grpo worker`).

use crate::auth::Token;
use crate::proto;
use crate::roles::reward::{LocalReward, RewardService};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;

/// The roles a worker can serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Reward,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Reward => "reward",
        }
    }
}

struct WorkerService {
    role: Role,
    reward: Option<Arc<LocalReward>>,
}

#[tonic::async_trait]
impl proto::worker_server::Worker for WorkerService {
    async fn health(
        &self,
        _: tonic::Request<proto::HealthRequest>,
    ) -> Result<tonic::Response<proto::HealthReply>, tonic::Status> {
        let in_flight = self.reward.as_ref().map_or(0, |r| r.in_flight() as u64);
        Ok(tonic::Response::new(proto::HealthReply {
            role: self.role.name().into(),
            version: env!("CARGO_PKG_VERSION").into(),
            in_flight,
        }))
    }
}

/// A bound worker, ready to serve.
pub struct Worker {
    listener: TcpListener,
    token: Token,
    reward: Arc<LocalReward>,
}

impl Worker {
    /// Bind a reward worker. Port 0 picks a free port; [`Worker::local_addr`] tells which.
    pub async fn bind_reward(
        listen: SocketAddr,
        token: Token,
        reward: LocalReward,
    ) -> std::io::Result<Worker> {
        let listener = TcpListener::bind(listen).await?;
        Ok(Worker {
            listener,
            token,
            reward: Arc::new(reward),
        })
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
            role: Role::Reward,
            reward: Some(self.reward.clone()),
        };
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(self.listener);
        tonic::transport::Server::builder()
            .add_service(proto::worker_server::WorkerServer::with_interceptor(
                health,
                check.clone(),
            ))
            .add_service(tonic::service::interceptor::InterceptedService::new(
                proto::reward_server::RewardServer::new(RewardService { local: self.reward })
                    .max_decoding_message_size(256 << 20),
                check,
            ))
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
    }
}
