//! The worker registry of the `ray` launcher: where workers placed by a cluster scheduler say
//! where they run, and how they notice that their orchestrator is gone.
//!
//! Under `cluster.launcher: ray` only Ray knows which node runs a worker, so the flow is reversed
//! from the local launcher: the orchestrator serves `Registry` ([`Registry::serve`], on
//! `cluster.ray.orchestrator_host`, port 0) and each `grpo worker --connect ORCH` dials it once
//! its own gRPC server is bound ([`register`]), giving its callable address, devices, grpo
//! version, host and pid. The orchestrator waits for a given worker id ([`RegistryServer::
//! wait_for`]) and then calls the worker as usual. A worker whose grpo version differs from the
//! orchestrator's is refused with both versions in the message.
//!
//! A registered worker then sends a heartbeat every second ([`heartbeat`]); when the orchestrator
//! has not answered for [`heartbeat_deadline`] (`max(3 x cluster.worker_timeout_s, 5 s)`), or no
//! longer knows the worker, the heartbeat returns and the worker exits: no orphan jobs when the
//! orchestrator is killed. Every call carries the run's token, checked as by the workers.

use crate::auth::Token;
use crate::proto;
use crate::proto::registry_client::RegistryClient;
use crate::proto::registry_server::RegistryServer as RegistryGrpcServer;
use crate::recipe::TlsSection;
use crate::roles::Role;
use crate::transport::{self, error_chain, explain_status, TransportError};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

/// How often a registered worker tells the orchestrator it is alive.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// The shortest time a worker waits for a silent orchestrator before exiting.
pub const MIN_HEARTBEAT_DEADLINE: Duration = Duration::from_secs(5);

/// How long [`register`] keeps trying to reach the orchestrator before giving up.
pub const REGISTER_PATIENCE: Duration = Duration::from_secs(30);

/// Where the binary must come from when versions differ (docs/ray.md explains both ways).
const BINARY_HINT: &str = "every node must run the orchestrator's own grpo build: point \
    `cluster.ray.binary` at a copy on a path all nodes share, or ship it with \
    `cluster.ray.runtime_env` (see docs/ray.md)";

/// How long a worker waits for an orchestrator that stopped answering before it exits:
/// `3 x cluster.worker_timeout_s`, at least [`MIN_HEARTBEAT_DEADLINE`].
pub fn heartbeat_deadline(worker_timeout_s: f64) -> Duration {
    let scaled = if worker_timeout_s.is_finite() && worker_timeout_s > 0.0 {
        Duration::from_secs_f64(3.0 * worker_timeout_s)
    } else {
        Duration::ZERO
    };
    scaled.max(MIN_HEARTBEAT_DEADLINE)
}

/// Devices of one kind that a worker's PJRT client opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// The device kind as PJRT reports it (`cpu`, `NVIDIA H100 80GB HBM3`, `TPU v6 lite`, ...).
    pub kind: String,
    /// How many of that kind.
    pub count: u32,
    /// The client's platform: `cpu`, `cuda` or `tpu`.
    pub platform_name: String,
    /// The plugin's version string.
    pub platform_version: String,
}

/// The devices of `client`, grouped by kind (first-seen order).
pub fn devices_of(client: &xla::runtime::Client) -> Vec<Device> {
    xla::runtime::inventory::group_devices(client.devices())
        .into_iter()
        .map(|group| Device {
            kind: group.kind,
            count: u32::try_from(group.count).unwrap_or(u32::MAX),
            platform_name: client.platform_name().to_string(),
            platform_version: client.platform_version().to_string(),
        })
        .collect()
}

/// What a worker says about itself when it registers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// Unique per submission: `ROLE-INDEX-aATTEMPT`, e.g. `rollout-0-a1`.
    pub worker_id: String,
    /// The role it serves.
    pub role: Role,
    /// The `cluster.pools` entry it was started for.
    pub pool: String,
    /// Where the orchestrator calls it: `http[s]://HOST:PORT`.
    pub address: String,
    /// What its PJRT client opened; empty for reward workers.
    pub devices: Vec<Device>,
    /// The worker binary's grpo version.
    pub grpo_version: String,
    /// The host it runs on.
    pub hostname: String,
    /// Its process id on that host.
    pub pid: u32,
}

impl Registration {
    /// The devices in a few words, e.g. `4 x TPU v6 lite (tpu 0.54)`, or `no device`.
    pub fn devices_text(&self) -> String {
        if self.devices.is_empty() {
            return "no device".into();
        }
        self.devices
            .iter()
            .map(|d| {
                let version = if d.platform_version.is_empty() {
                    String::new()
                } else {
                    format!(" {}", d.platform_version)
                };
                format!("{} x {} ({}{version})", d.count, d.kind, d.platform_name)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn to_proto(&self) -> proto::RegisterRequest {
        proto::RegisterRequest {
            worker_id: self.worker_id.clone(),
            role: self.role.name().into(),
            pool: self.pool.clone(),
            address: self.address.clone(),
            devices: self
                .devices
                .iter()
                .map(|d| proto::DeviceReport {
                    kind: d.kind.clone(),
                    count: d.count,
                    platform_name: d.platform_name.clone(),
                    platform_version: d.platform_version.clone(),
                })
                .collect(),
            grpo_version: self.grpo_version.clone(),
            hostname: self.hostname.clone(),
            pid: self.pid,
        }
    }
}

/// What went wrong serving the registry, registering with it, or waiting for a worker.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The orchestrator could not bind its registry.
    #[error(
        "cannot serve the worker registry on {host}: {source}; `cluster.ray.orchestrator_host` \
         must be an address of this host"
    )]
    Bind {
        host: String,
        #[source]
        source: std::io::Error,
    },
    /// TLS files or an address could not be used.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// [`RegistryServer::wait_for`] ran out of time.
    #[error(
        "worker {worker_id} did not register within {waited_s} s (registered so far: {registered}); \
         is its job running, and can its node reach {address}?"
    )]
    NotRegistered {
        worker_id: String,
        waited_s: f64,
        registered: String,
        address: String,
    },
    /// [`RegistryServer::wait_for`]: the worker did register, and was refused.
    #[error("worker {worker_id} tried to register and was refused: {reason}")]
    WasRefused { worker_id: String, reason: String },
    /// [`register`]: the orchestrator said no.
    #[error("the orchestrator at {orchestrator} refused worker {worker_id}: {reason}")]
    Refused {
        orchestrator: String,
        worker_id: String,
        reason: String,
    },
    /// [`register`]: the orchestrator did not answer.
    #[error(
        "cannot reach the orchestrator at {orchestrator} to register worker {worker_id} (tried for \
         {waited_s} s): {message}"
    )]
    Unreachable {
        orchestrator: String,
        worker_id: String,
        waited_s: f64,
        message: String,
    },
    /// The `--connect` address is not `http[s]://HOST:PORT`.
    #[error(
        "bad orchestrator address `{address}`: {message}; expected http://HOST:PORT as `grpo run` passes it"
    )]
    BadAddress { address: String, message: String },
}

/// The orchestrator's side: see [`Registry::serve`].
pub struct Registry;

impl Registry {
    /// Serve the registry on `bind_host` (an IP or name of this host; IPv6 with or without
    /// brackets), port 0, behind `token`, over TLS when `tls` is given (the orchestrator then
    /// presents `cluster.tls.cert`, as workers do). Workers whose grpo version is not
    /// `expected_version` are refused. Call inside a tokio runtime; the server stops when the
    /// returned [`RegistryServer`] is dropped.
    pub async fn serve(
        bind_host: &str,
        token: Token,
        tls: Option<&TlsSection>,
        expected_version: &str,
    ) -> Result<RegistryServer, RegistryError> {
        let host = bind_host.trim_start_matches('[').trim_end_matches(']');
        let bind_error = |source| RegistryError::Bind {
            host: bind_host.to_string(),
            source,
        };
        let listener = TcpListener::bind((host, 0)).await.map_err(bind_error)?;
        let port = listener.local_addr().map_err(bind_error)?.port();
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let address = transport::worker_uri(&authority, tls);
        let (changed, _) = watch::channel(());
        let state = Arc::new(State {
            expected_version: expected_version.to_string(),
            inner: Mutex::new(Inner::default()),
            changed,
        });
        let service = RegistryService { state: state.clone() };
        let router = transport::server_builder(tls)?
            .add_service(RegistryGrpcServer::with_interceptor(service, token.interceptor()));
        let (stop, stopped) = oneshot::channel::<()>();
        let incoming = transport::incoming(listener);
        let served_at = address.clone();
        tokio::spawn(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            if let Err(e) = router.serve_with_incoming_shutdown(incoming, shutdown).await {
                tracing::warn!("the worker registry at {served_at} stopped: {}", error_chain(&e));
            }
        });
        tracing::info!("worker registry listening on {address}");
        Ok(RegistryServer {
            address,
            state,
            _stop: stop,
        })
    }
}

/// A serving registry (see [`Registry::serve`]); dropping it stops the server, so registered
/// workers stop hearing from it and exit after their [`heartbeat_deadline`].
pub struct RegistryServer {
    address: String,
    state: Arc<State>,
    /// Dropping it ends the server (graceful: connections are told to go away).
    _stop: oneshot::Sender<()>,
}

impl RegistryServer {
    /// The address workers dial (`--connect`): `http://HOST:PORT`, `https://` with TLS.
    pub fn address(&self) -> String {
        self.address.clone()
    }

    /// Wait until worker `worker_id` has registered, for at most `timeout`. Fails at once if it
    /// tried and was refused (the reason says why), and after `timeout` with the ids registered
    /// so far.
    pub async fn wait_for(&self, worker_id: &str, timeout: Duration) -> Result<Registration, RegistryError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changed = self.state.changed.subscribe();
        loop {
            {
                let inner = self.state.lock();
                if let Some(entry) = inner.registered.get(worker_id) {
                    return Ok(entry.registration.clone());
                }
                if let Some(reason) = inner.refused.get(worker_id) {
                    return Err(RegistryError::WasRefused {
                        worker_id: worker_id.to_string(),
                        reason: reason.clone(),
                    });
                }
            }
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                let registered = self.state.lock().registered.keys().cloned().collect::<Vec<_>>();
                return Err(RegistryError::NotRegistered {
                    worker_id: worker_id.to_string(),
                    waited_s: timeout.as_secs_f64(),
                    registered: if registered.is_empty() {
                        "none".into()
                    } else {
                        registered.join(", ")
                    },
                    address: self.address.clone(),
                });
            }
        }
    }

    /// Every registered worker, by worker id.
    pub fn registrations(&self) -> Vec<Registration> {
        self.state
            .lock()
            .registered
            .values()
            .map(|e| e.registration.clone())
            .collect()
    }

    /// Time since worker `worker_id` last registered or sent a heartbeat; `None` if it is not
    /// registered.
    pub fn since_heard(&self, worker_id: &str) -> Option<Duration> {
        self.state
            .lock()
            .registered
            .get(worker_id)
            .map(|e| e.last_heard.elapsed())
    }

    /// Retire `worker_id` (its job is being resubmitted under a new id): its registration is
    /// removed and returned, its heartbeats are answered "unknown" (so a stale worker that is
    /// still running exits), and the id cannot register again.
    pub fn forget(&self, worker_id: &str) -> Option<Registration> {
        let mut inner = self.state.lock();
        inner.refused.remove(worker_id);
        inner.retired.insert(worker_id.to_string());
        inner.registered.remove(worker_id).map(|e| e.registration)
    }
}

struct State {
    expected_version: String,
    inner: Mutex<Inner>,
    /// Ticks on every registration or refusal, for [`RegistryServer::wait_for`].
    changed: watch::Sender<()>,
}

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[derive(Default)]
struct Inner {
    registered: BTreeMap<String, Entry>,
    /// Worker ids that tried to register and were refused, with the reason.
    refused: BTreeMap<String, String>,
    /// Worker ids passed to [`RegistryServer::forget`].
    retired: BTreeSet<String>,
}

struct Entry {
    registration: Registration,
    last_heard: Instant,
}

struct RegistryService {
    state: Arc<State>,
}

impl RegistryService {
    /// The registration in `request`, or why it is refused.
    fn admit(
        &self,
        request: proto::RegisterRequest,
        peer: Option<SocketAddr>,
    ) -> Result<Registration, String> {
        let expected = &self.state.expected_version;
        let id = &request.worker_id;
        if id.is_empty() {
            return Err("the registration has no worker id (`--worker-id`)".into());
        }
        if request.grpo_version != *expected {
            return Err(format!(
                "worker {id} runs grpo {} but the orchestrator runs grpo {expected}; {BINARY_HINT}",
                request.grpo_version
            ));
        }
        let role = Role::from_name(&request.role).ok_or_else(|| {
            format!(
                "worker {id} names unknown role `{}`: expected `rollout`, `reward` or `learner`",
                request.role
            )
        })?;
        let address = callable_from_peer(&request.address, peer)
            .map_err(|message| format!("worker {id} gave address `{}`: {message}", request.address))?;
        let inner = self.state.lock();
        if inner.retired.contains(id) {
            return Err(format!(
                "worker id {id} was retired by the orchestrator (its job was resubmitted under a new \
                 id); this worker is stale and should exit"
            ));
        }
        if let Some(existing) = inner.registered.get(id) {
            let e = &existing.registration;
            if (e.hostname.as_str(), e.pid) != (request.hostname.as_str(), request.pid) {
                return Err(format!(
                    "worker id {id} is already registered by pid {} on {}",
                    e.pid, e.hostname
                ));
            }
        }
        Ok(Registration {
            worker_id: request.worker_id,
            role,
            pool: request.pool,
            address,
            devices: request
                .devices
                .into_iter()
                .map(|d| Device {
                    kind: d.kind,
                    count: d.count,
                    platform_name: d.platform_name,
                    platform_version: d.platform_version,
                })
                .collect(),
            grpo_version: request.grpo_version,
            hostname: request.hostname,
            pid: request.pid,
        })
    }
}

/// `address` as the worker gave it, with an unspecified host (`0.0.0.0`, `[::]`) replaced by the
/// IP its registration came from. It must be `http[s]://HOST:PORT`.
fn callable_from_peer(address: &str, peer: Option<SocketAddr>) -> Result<String, String> {
    let (scheme, authority) = address
        .split_once("://")
        .filter(|(s, _)| *s == "http" || *s == "https")
        .ok_or("expected http[s]://HOST:PORT")?;
    if let Ok(socket) = authority.parse::<SocketAddr>() {
        if socket.port() == 0 {
            return Err("port 0 cannot be called".into());
        }
        if socket.ip().is_unspecified() {
            let peer = peer.ok_or("an unspecified host, and the caller's address is unknown")?;
            return Ok(format!(
                "{scheme}://{}",
                SocketAddr::new(peer.ip(), socket.port())
            ));
        }
        return Ok(address.to_string());
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {
            Ok(address.to_string())
        }
        _ => Err("expected http[s]://HOST:PORT".into()),
    }
}

#[tonic::async_trait]
impl proto::registry_server::Registry for RegistryService {
    async fn register(
        &self,
        request: tonic::Request<proto::RegisterRequest>,
    ) -> Result<tonic::Response<proto::RegisterReply>, tonic::Status> {
        let peer = request.remote_addr();
        let request = request.into_inner();
        let id = request.worker_id.clone();
        let reply = match self.admit(request, peer) {
            Ok(registration) => {
                tracing::info!(
                    worker = %id,
                    role = registration.role.name(),
                    pool = %registration.pool,
                    address = %registration.address,
                    host = %registration.hostname,
                    pid = registration.pid,
                    devices = %registration.devices_text(),
                    "worker registered"
                );
                let mut inner = self.state.lock();
                inner.refused.remove(&id);
                inner.registered.insert(
                    id,
                    Entry {
                        registration,
                        last_heard: Instant::now(),
                    },
                );
                proto::RegisterReply {
                    accepted: true,
                    reason: String::new(),
                    orchestrator_version: self.state.expected_version.clone(),
                }
            }
            Err(reason) => {
                tracing::warn!("refused a worker registration: {reason}");
                self.state.lock().refused.insert(id, reason.clone());
                proto::RegisterReply {
                    accepted: false,
                    reason,
                    orchestrator_version: self.state.expected_version.clone(),
                }
            }
        };
        self.state.changed.send_replace(());
        Ok(tonic::Response::new(reply))
    }

    async fn heartbeat(
        &self,
        request: tonic::Request<proto::HeartbeatRequest>,
    ) -> Result<tonic::Response<proto::HeartbeatReply>, tonic::Status> {
        let id = request.into_inner().worker_id;
        let mut inner = self.state.lock();
        let known = match inner.registered.get_mut(&id) {
            Some(entry) => {
                entry.last_heard = Instant::now();
                true
            }
            None => false,
        };
        Ok(tonic::Response::new(proto::HeartbeatReply { known }))
    }
}

fn client(
    orchestrator: &str,
    token: &Token,
    tls: Option<&TlsSection>,
) -> Result<
    RegistryClient<
        tonic::service::interceptor::InterceptedService<tonic::transport::Channel, crate::auth::Attach>,
    >,
    RegistryError,
> {
    let channel = transport::channel(orchestrator, tls)?;
    Ok(RegistryClient::with_interceptor(channel, token.attach()))
}

/// The worker's side: announce `registration` to the orchestrator at `orchestrator` (its
/// `http[s]://HOST:PORT`), retrying while it cannot be reached, for [`REGISTER_PATIENCE`]. A
/// refusal (wrong grpo version, wrong token, ...) is [`RegistryError::Refused`] with the reason.
pub async fn register(
    orchestrator: &str,
    token: &Token,
    tls: Option<&TlsSection>,
    registration: &Registration,
) -> Result<(), RegistryError> {
    register_within(orchestrator, token, tls, registration, REGISTER_PATIENCE).await
}

/// [`register`], trying for at most `patience`.
pub async fn register_within(
    orchestrator: &str,
    token: &Token,
    tls: Option<&TlsSection>,
    registration: &Registration,
    patience: Duration,
) -> Result<(), RegistryError> {
    let mut client = client(orchestrator, token, tls)?;
    let started = Instant::now();
    let refused = |reason: String| RegistryError::Refused {
        orchestrator: orchestrator.to_string(),
        worker_id: registration.worker_id.clone(),
        reason,
    };
    loop {
        let remaining = patience.saturating_sub(started.elapsed());
        let attempt = tokio::time::timeout(
            remaining.max(Duration::from_millis(100)),
            client.register(registration.to_proto()),
        )
        .await;
        let message = match attempt {
            Ok(Ok(reply)) => {
                let reply = reply.into_inner();
                return if reply.accepted {
                    Ok(())
                } else {
                    Err(refused(reply.reason))
                };
            }
            Ok(Err(status))
                if matches!(
                    status.code(),
                    tonic::Code::Unauthenticated | tonic::Code::PermissionDenied | tonic::Code::Unimplemented
                ) =>
            {
                let hint = if status.code() == tonic::Code::Unimplemented {
                    " (it serves no worker registry: is it a `grpo run` with `cluster.launcher: ray`?)"
                } else {
                    ""
                };
                return Err(refused(format!("{}{hint}", status.message())));
            }
            Ok(Err(status)) => explain_status(status).message().to_string(),
            Err(_) => format!("no answer within {:.1} s", remaining.as_secs_f64()),
        };
        if started.elapsed() + Duration::from_millis(250) >= patience {
            return Err(RegistryError::Unreachable {
                orchestrator: orchestrator.to_string(),
                worker_id: registration.worker_id.clone(),
                waited_s: patience.as_secs_f64(),
                message,
            });
        }
        tracing::debug!("registering with {orchestrator}: {message}; retrying");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Why [`heartbeat`] returned: the worker should exit.
#[derive(Debug, thiserror::Error)]
pub enum HeartbeatEnd {
    /// No answer for the whole deadline.
    #[error(
        "the orchestrator at {orchestrator} has not answered for {silent_s:.1} s (the limit is \
         {deadline_s:.1} s, 3 x cluster.worker_timeout_s, at least 5 s): it is gone, so worker \
         {worker_id} exits; last error: {last_error}"
    )]
    Silent {
        orchestrator: String,
        worker_id: String,
        silent_s: f64,
        deadline_s: f64,
        last_error: String,
    },
    /// The orchestrator answers but no longer knows this worker.
    #[error(
        "the orchestrator at {orchestrator} no longer knows worker {worker_id} (it was retired, e.g. \
         its job was resubmitted under a new id), so it exits"
    )]
    Dismissed { orchestrator: String, worker_id: String },
    /// The connection could not even be set up.
    #[error(transparent)]
    Setup(#[from] RegistryError),
}

/// The worker's watch on its orchestrator: a heartbeat every [`HEARTBEAT_INTERVAL`] (more often
/// for deadlines under 4 s); returns when none has been answered for `give_up_after` (use
/// [`heartbeat_deadline`]) or the orchestrator no longer knows `worker_id`. It never returns
/// while the orchestrator answers.
pub async fn heartbeat(
    orchestrator: &str,
    token: &Token,
    tls: Option<&TlsSection>,
    worker_id: &str,
    give_up_after: Duration,
) -> HeartbeatEnd {
    let mut client = match client(orchestrator, token, tls) {
        Ok(c) => c,
        Err(e) => return e.into(),
    };
    let interval = HEARTBEAT_INTERVAL.min(give_up_after / 4);
    let mut last_answer = Instant::now();
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let remaining = give_up_after.saturating_sub(last_answer.elapsed());
        let call = client.heartbeat(proto::HeartbeatRequest {
            worker_id: worker_id.to_string(),
        });
        let error = match tokio::time::timeout(remaining.max(Duration::from_millis(50)), call).await {
            Ok(Ok(reply)) if reply.get_ref().known => {
                last_answer = Instant::now();
                continue;
            }
            Ok(Ok(_)) => {
                return HeartbeatEnd::Dismissed {
                    orchestrator: orchestrator.to_string(),
                    worker_id: worker_id.to_string(),
                }
            }
            Ok(Err(status)) => explain_status(status).message().to_string(),
            Err(_) => format!("no answer within {:.1} s", remaining.as_secs_f64()),
        };
        tracing::debug!("heartbeat to {orchestrator} failed: {error}");
        if last_answer.elapsed() >= give_up_after {
            return HeartbeatEnd::Silent {
                orchestrator: orchestrator.to_string(),
                worker_id: worker_id.to_string(),
                silent_s: last_answer.elapsed().as_secs_f64(),
                deadline_s: give_up_after.as_secs_f64(),
                last_error: error,
            };
        }
    }
}

/// The address the orchestrator at `orchestrator` can call a worker listening on `listening`
/// at: `http[s]://HOST:PORT` (`https` when `tls`). When it listens on every interface (`0.0.0.0`,
/// `[::]`), HOST is the IP of this host's interface that routes to the orchestrator (found with
/// a connected UDP socket; no packet is sent).
pub async fn callable_address(
    listening: SocketAddr,
    orchestrator: &str,
    tls: bool,
) -> Result<String, RegistryError> {
    let scheme = if tls { "https" } else { "http" };
    if !listening.ip().is_unspecified() {
        return Ok(format!("{scheme}://{listening}"));
    }
    let bad = |message: String| RegistryError::BadAddress {
        address: orchestrator.to_string(),
        message,
    };
    let authority = orchestrator
        .split_once("://")
        .map_or(orchestrator, |(_, rest)| rest)
        .split('/')
        .next()
        .unwrap_or_default();
    let target = tokio::net::lookup_host(authority)
        .await
        .map_err(|e| bad(format!("cannot resolve it: {e}")))?
        .next()
        .ok_or_else(|| bad("it resolves to no address".into()))?;
    let local: SocketAddr = match target {
        SocketAddr::V4(_) => (IpAddr::from([0u8; 4]), 0).into(),
        SocketAddr::V6(_) => (IpAddr::from([0u16; 8]), 0).into(),
    };
    let route = async {
        let socket = tokio::net::UdpSocket::bind(local).await?;
        socket.connect(target).await?;
        socket.local_addr()
    };
    let ip = route
        .await
        .map_err(|e| bad(format!("no route to it from this host: {e}")))?
        .ip();
    Ok(format!("{scheme}://{}", SocketAddr::new(ip, listening.port())))
}

/// This host's name (as `hostname` prints it), or `unknown-host`.
pub fn hostname() -> String {
    #[cfg(unix)]
    {
        let mut buffer = [0u8; 256];
        // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it on
        // success (the last byte stays 0 if the name is truncated).
        let ok = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len() - 1) } == 0;
        if ok {
            let end = buffer.iter().position(|b| *b == 0).unwrap_or(buffer.len());
            let name = String::from_utf8_lossy(&buffer[..end]).trim().to_string();
            if !name.is_empty() {
                return name;
            }
        }
    }
    std::env::var("HOSTNAME")
        .or_else(|_| std::env::var("COMPUTERNAME"))
        .unwrap_or_else(|_| "unknown-host".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration(id: &str, version: &str) -> Registration {
        Registration {
            worker_id: id.into(),
            role: Role::Rollout,
            pool: "tpu-rollout".into(),
            address: "http://10.1.2.3:7001".into(),
            devices: vec![Device {
                kind: "TPU v6 lite".into(),
                count: 4,
                platform_name: "tpu".into(),
                platform_version: "0.54".into(),
            }],
            grpo_version: version.into(),
            hostname: "node-a".into(),
            pid: 4242,
        }
    }

    const VERSION: &str = env!("CARGO_PKG_VERSION");

    /// A registry on loopback expecting [`VERSION`], with its fresh token.
    async fn serving() -> (Token, RegistryServer) {
        let token = Token::generate();
        let server = Registry::serve("127.0.0.1", token.clone(), None, VERSION)
            .await
            .unwrap();
        (token, server)
    }

    /// A registry serving, with worker `name` registered.
    async fn serving_with(name: &str) -> (Token, RegistryServer) {
        let (token, server) = serving().await;
        register(&server.address(), &token, None, &registration(name, VERSION))
            .await
            .unwrap();
        (token, server)
    }

    #[tokio::test]
    async fn a_worker_with_the_token_registers_and_is_waited_for() {
        let (token, server) = serving().await;
        assert!(
            server.address().starts_with("http://127.0.0.1:"),
            "{}",
            server.address()
        );
        let address = server.address();
        let sent = registration("rollout-0-a1", VERSION);
        let waiting = server.wait_for("rollout-0-a1", Duration::from_secs(10));
        let registering = register(&address, &token, None, &sent);
        let (got, registered) = tokio::join!(waiting, registering);
        registered.unwrap();
        let got = got.unwrap();
        assert_eq!(got, sent);
        assert_eq!(got.devices_text(), "4 x TPU v6 lite (tpu 0.54)");
        assert_eq!(server.registrations(), vec![sent.clone()]);
        assert!(server.since_heard("rollout-0-a1").unwrap() < Duration::from_secs(5));
        // Registering again from the same process is fine; from another one is not.
        register(&address, &token, None, &sent).await.unwrap();
        let impostor = Registration {
            pid: 1,
            ..sent.clone()
        };
        let message = register(&address, &token, None, &impostor)
            .await
            .unwrap_err()
            .to_string();
        assert_eq!(
            message,
            format!(
                "the orchestrator at {address} refused worker rollout-0-a1: worker id rollout-0-a1 \
                 is already registered by pid 4242 on node-a"
            )
        );
        // A retired id is refused, and no longer listed.
        assert_eq!(server.forget("rollout-0-a1"), Some(sent.clone()));
        assert!(server.registrations().is_empty());
        let message = register(&address, &token, None, &sent)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            message.ends_with(
                "worker id rollout-0-a1 was retired by the orchestrator (its job was resubmitted \
                 under a new id); this worker is stale and should exit"
            ),
            "{message}"
        );
    }

    #[tokio::test]
    async fn a_worker_listening_everywhere_is_called_at_the_address_it_came_from() {
        let (token, server) = serving().await;
        let sent = Registration {
            address: "http://0.0.0.0:7001".into(),
            role: Role::Reward,
            devices: vec![],
            ..registration("reward-3-a2", VERSION)
        };
        register(&server.address(), &token, None, &sent).await.unwrap();
        let got = server
            .wait_for("reward-3-a2", Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(got.address, "http://127.0.0.1:7001");
        assert_eq!(got.devices_text(), "no device");
    }

    #[tokio::test]
    async fn a_wrong_or_missing_token_is_refused() {
        let server = Registry::serve("127.0.0.1", Token::generate(), None, VERSION)
            .await
            .unwrap();
        let address = server.address();
        let message = register(
            &address,
            &Token::generate(),
            None,
            &registration("learner-0-a1", VERSION),
        )
        .await
        .unwrap_err()
        .to_string();
        assert_eq!(
            message,
            format!(
                "the orchestrator at {address} refused worker learner-0-a1: wrong token: this \
                 worker belongs to another run"
            )
        );
        let mut anonymous = RegistryClient::connect(address.clone()).await.unwrap();
        let status = anonymous
            .heartbeat(proto::HeartbeatRequest {
                worker_id: "learner-0-a1".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        assert!(
            status.message().starts_with("missing token"),
            "{}",
            status.message()
        );
        assert!(server.registrations().is_empty());
    }

    #[tokio::test]
    async fn another_grpo_version_is_refused_naming_both_versions() {
        let token = Token::generate();
        let server = Registry::serve("127.0.0.1", token.clone(), None, "1.2.0")
            .await
            .unwrap();
        let address = server.address();
        let older = registration("rollout-1-a1", "1.1.9");
        let worker = register(&address, &token, None, &older);
        let waiting = server.wait_for("rollout-1-a1", Duration::from_secs(10));
        let (worker, waiting) = tokio::join!(worker, waiting);
        let reason = "worker rollout-1-a1 runs grpo 1.1.9 but the orchestrator runs grpo 1.2.0; \
                      every node must run the orchestrator's own grpo build: point \
                      `cluster.ray.binary` at a copy on a path all nodes share, or ship it with \
                      `cluster.ray.runtime_env` (see docs/ray.md)";
        assert_eq!(
            worker.unwrap_err().to_string(),
            format!("the orchestrator at {address} refused worker rollout-1-a1: {reason}")
        );
        // The orchestrator waiting for that worker learns at once, with the same reason.
        assert_eq!(
            waiting.unwrap_err().to_string(),
            format!("worker rollout-1-a1 tried to register and was refused: {reason}")
        );
        let unknown_role = proto::RegisterRequest {
            role: "critic".into(),
            ..registration("critic-0-a1", "1.2.0").to_proto()
        };
        let mut raw =
            RegistryClient::with_interceptor(transport::channel(&address, None).unwrap(), token.attach());
        let reply = raw.register(unknown_role).await.unwrap().into_inner();
        assert!(!reply.accepted);
        assert_eq!(
            reply.reason,
            "worker critic-0-a1 names unknown role `critic`: expected `rollout`, `reward` or `learner`"
        );
        assert_eq!(reply.orchestrator_version, "1.2.0");
    }

    #[tokio::test]
    async fn waiting_for_a_worker_that_never_comes_says_who_and_how_long() {
        let (_token, server) = serving_with("reward-0-a1").await;
        let started = Instant::now();
        let message = server
            .wait_for("rollout-7-a3", Duration::from_millis(300))
            .await
            .unwrap_err()
            .to_string();
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert_eq!(
            message,
            format!(
                "worker rollout-7-a3 did not register within 0.3 s (registered so far: \
                 reward-0-a1); is its job running, and can its node reach {}?",
                server.address()
            )
        );
    }

    #[tokio::test]
    async fn the_heartbeat_gives_up_after_the_deadline_once_the_registry_is_gone() {
        let (token, server) = serving_with("rollout-0-a1").await;
        let address = server.address();
        let deadline = Duration::from_millis(1500);
        // While the registry answers, the heartbeat keeps going (and keeps the worker fresh).
        let beating = tokio::time::timeout(
            Duration::from_millis(2500),
            heartbeat(&address, &token, None, "rollout-0-a1", deadline),
        )
        .await;
        assert!(
            beating.is_err(),
            "the heartbeat returned while the registry answered: {beating:?}"
        );
        // Registered 2.5 s ago: only a heartbeat since makes this shorter.
        assert!(server.since_heard("rollout-0-a1").unwrap() < Duration::from_millis(2500));

        let watch = tokio::spawn({
            let (address, token) = (address.clone(), token.clone());
            async move {
                let started = Instant::now();
                let end = heartbeat(&address, &token, None, "rollout-0-a1", deadline).await;
                (end, started)
            }
        });
        tokio::time::sleep(Duration::from_millis(600)).await;
        let dropped = Instant::now();
        drop(server);
        let (end, started) = watch.await.unwrap();
        let gone_after = dropped.elapsed();
        // The last answer came shortly before the drop (a heartbeat every 375 ms; later ones on a
        // loaded machine), so the deadline runs out well after the drop, never before it.
        assert!(
            gone_after >= deadline / 3 && started.elapsed() >= deadline,
            "gave up too early: {gone_after:?}"
        );
        assert!(
            gone_after < deadline + Duration::from_secs(5),
            "gave up too late: {gone_after:?}"
        );
        let message = end.to_string();
        assert!(
            message.starts_with(&format!("the orchestrator at {address} has not answered for ")),
            "{message}"
        );
        assert!(
            message.contains(
                "(the limit is 1.5 s, 3 x cluster.worker_timeout_s, at least 5 s): it is gone, so \
                 worker rollout-0-a1 exits; last error: "
            ),
            "{message}"
        );
    }

    #[tokio::test]
    async fn a_retired_worker_is_dismissed_by_its_heartbeat() {
        let (token, server) = serving_with("reward-0-a1").await;
        let address = server.address();
        server.forget("reward-0-a1");
        let end = tokio::time::timeout(
            Duration::from_secs(5),
            heartbeat(&address, &token, None, "reward-0-a1", Duration::from_secs(5)),
        )
        .await
        .expect("a dismissed worker stops at its first heartbeat");
        assert_eq!(
            end.to_string(),
            format!(
                "the orchestrator at {address} no longer knows worker reward-0-a1 (it was retired, \
                 e.g. its job was resubmitted under a new id), so it exits"
            )
        );
    }

    #[tokio::test]
    async fn an_unreachable_orchestrator_is_reported_after_the_patience() {
        // A port that was just free: nothing listens there.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address = format!("http://127.0.0.1:{port}");
        let message = register_within(
            &address,
            &Token::generate(),
            None,
            &registration("rollout-0-a1", VERSION),
            Duration::from_millis(600),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(
            message.starts_with(&format!(
                "cannot reach the orchestrator at {address} to register worker rollout-0-a1 (tried \
                 for 0.6 s): "
            )),
            "{message}"
        );
    }

    #[tokio::test]
    async fn workers_listening_everywhere_report_the_interface_that_routes_to_the_orchestrator() {
        let listening: SocketAddr = "0.0.0.0:7001".parse().unwrap();
        assert_eq!(
            callable_address(listening, "http://127.0.0.1:9000", false)
                .await
                .unwrap(),
            "http://127.0.0.1:7001"
        );
        assert_eq!(
            callable_address("127.0.0.1:7002".parse().unwrap(), "http://10.0.0.1:9000", true)
                .await
                .unwrap(),
            "https://127.0.0.1:7002"
        );
        // No port: nothing to resolve (and no DNS query is made).
        let message = callable_address(listening, "http://127.0.0.1", false)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with("bad orchestrator address `http://127.0.0.1`: cannot resolve it: "),
            "{message}"
        );
        assert!(!hostname().is_empty());
    }

    #[test]
    fn unspecified_hosts_take_the_caller_ip_and_bad_addresses_are_refused() {
        let peer: SocketAddr = "10.0.0.9:55555".parse().unwrap();
        assert_eq!(
            callable_from_peer("http://[::]:7001", Some(peer)).unwrap(),
            "http://10.0.0.9:7001"
        );
        assert_eq!(
            callable_from_peer("https://node-a.internal:7001", Some(peer)).unwrap(),
            "https://node-a.internal:7001"
        );
        assert_eq!(
            callable_from_peer("10.0.0.9:7001", Some(peer)).unwrap_err(),
            "expected http[s]://HOST:PORT"
        );
        assert_eq!(
            callable_from_peer("http://10.0.0.9:0", Some(peer)).unwrap_err(),
            "port 0 cannot be called"
        );
    }

    #[test]
    fn devices_are_reported_by_kind_with_the_platform() {
        let client = xla::runtime::Client::cpu(2).unwrap();
        let devices = devices_of(&client);
        assert_eq!(devices.len(), 1, "{devices:?}");
        assert_eq!(devices[0].count, 2);
        assert_eq!(devices[0].platform_name, "cpu");
        assert_eq!(devices[0].platform_version, client.platform_version());
        assert_eq!(devices[0].kind, client.devices()[0].kind);
        let reported = Registration {
            devices,
            ..registration("rollout-0-a1", VERSION)
        };
        assert_eq!(
            reported.devices_text(),
            format!(
                "2 x {} (cpu {})",
                client.devices()[0].kind,
                client.platform_version()
            )
        );
    }

    #[test]
    fn the_heartbeat_deadline_is_three_worker_timeouts_and_at_least_five_seconds() {
        assert_eq!(heartbeat_deadline(10.0), Duration::from_secs(30));
        assert_eq!(heartbeat_deadline(0.5), Duration::from_secs(5));
        assert_eq!(heartbeat_deadline(2.0), Duration::from_secs(6));
    }
}
