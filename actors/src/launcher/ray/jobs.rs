//! A client for a Ray cluster's dashboard: the Job Submission REST API (`/api/jobs/`), the
//! cluster's nodes and their resources (`/api/v0/nodes`), and the actors that supervise
//! submitted jobs (`/api/v0/actors`). The `ray` launcher submits each worker as a Ray job with it.
//!
//! Endpoints and JSON are those of Ray 2.60 (`dashboard/modules/job/job_head.py`, `common.py`,
//! `pydantic_models.py`, and the state API), recorded from a real head in
//! `actors/tests/fixtures/ray/`. Behaviour of Ray worth knowing, measured on 2.60:
//! - a job whose entrypoint resources no node can give stays `PENDING` (message "Job has not
//!   started yet. It may be waiting for resources ...") until `RAY_JOB_START_TIMEOUT_SECONDS`
//!   (900 s by default, read by the head) and then turns `FAILED`;
//! - `stop` answers `{"stopped": true}` for a `PENDING` job but the job stays `PENDING` (the stop
//!   only reaches the job's supervisor once it is scheduled), and `delete` refuses a job that is
//!   not in a terminal state (HTTP 500, "non-terminal state");
//! - `GET /api/jobs/{id}` does not return the `entrypoint_*` resources of the job: Ray's record of
//!   what a job asked for is its supervisor actor's `required_resources` ([`RayJobs::supervisor`]).
//!
//! Every request opens its own HTTP/1.1 connection and drives it inside the calling task (nothing
//! is spawned, nothing is pooled), so one [`RayJobs`] may be used from any tokio runtime, also
//! one made just to stop jobs while another is shutting down. Only `http://` is spoken.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// How long one request may take (connect, send, read the whole answer) by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// What to tell a user whose dashboard does not answer.
const START_HINT: &str = "is the Ray dashboard running? start it with \
    `ray start --head --dashboard-host 0.0.0.0` (the Jobs API listens on port 8265 by default) \
    and check `cluster.ray.address`";

/// Why a call to the Ray dashboard failed.
#[derive(Debug, thiserror::Error)]
pub enum RayJobsError {
    /// The address is not `http://HOST:PORT`.
    #[error(
        "Ray address `{address}` is not usable: {reason}; give the dashboard's Jobs API address \
         as http://HOST:PORT, e.g. http://127.0.0.1:8265"
    )]
    InvalidAddress { address: String, reason: String },
    /// An `https://` address: this client speaks plain HTTP only.
    #[error(
        "Ray address `{address}` uses https, which grpo's Ray client does not speak; reach the \
         dashboard over plain http (inside the cluster network, e.g. \
         http://RAYCLUSTER-head-svc:8265, or through `kubectl port-forward svc/RAYCLUSTER-head-svc \
         8265:8265` and http://127.0.0.1:8265)"
    )]
    HttpsUnsupported { address: String },
    /// No TCP connection, or the connection broke before an answer came.
    #[error("cannot reach the Ray dashboard at {address} ({method} {endpoint}): {reason}; {START_HINT}")]
    Connect {
        address: String,
        method: &'static str,
        endpoint: String,
        reason: String,
    },
    /// No complete answer within the timeout.
    #[error(
        "the Ray dashboard at {address} did not answer {method} {endpoint} within {seconds} s; \
         the head may be overloaded or starting: retry, or {START_HINT}"
    )]
    Timeout {
        address: String,
        method: &'static str,
        endpoint: String,
        seconds: f64,
    },
    /// The server at the address is not a Ray dashboard (checked by [`RayJobs::version`]).
    #[error(
        "{address} does not look like a Ray dashboard: GET {endpoint} answered {answer}; point \
         `cluster.ray.address` at the head's dashboard (port 8265 by default, not the GCS port \
         6379 nor the Ray Client port 10001)"
    )]
    NotRay {
        address: String,
        endpoint: String,
        answer: String,
    },
    /// The job does not exist (HTTP 404): never submitted, or deleted.
    #[error(
        "the Ray cluster at {address} has no job `{id}` ({method} {endpoint} answered 404: \
         {excerpt}); it was never submitted there or has been deleted"
    )]
    JobNotFound {
        address: String,
        id: String,
        method: &'static str,
        endpoint: String,
        excerpt: String,
    },
    /// Any other answer than 2xx.
    #[error(
        "the Ray dashboard at {address} answered {method} {endpoint} with HTTP {status}: {excerpt}{hint}"
    )]
    Status {
        address: String,
        method: &'static str,
        endpoint: String,
        status: u16,
        /// The telling part of the body (for a Python traceback: its last error line).
        excerpt: String,
        /// What to do, starting with "; " (empty when there is nothing specific to say).
        hint: String,
    },
    /// A 2xx answer that is not the JSON this client knows.
    #[error(
        "cannot read the Ray dashboard's answer to {method} {endpoint} at {address}: {reason}; \
         the answer starts with: {excerpt} (grpo's Ray client was written against Ray 2.60)"
    )]
    Parse {
        address: String,
        method: &'static str,
        endpoint: String,
        reason: String,
        excerpt: String,
    },
}

impl RayJobsError {
    /// Whether Ray said the job does not exist (HTTP 404).
    pub fn is_not_found(&self) -> bool {
        matches!(self, RayJobsError::JobNotFound { .. })
    }

    /// Whether the dashboard could not be reached or did not answer in time (the cluster may be
    /// fine; the request may be retried).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, RayJobsError::Connect { .. } | RayJobsError::Timeout { .. })
    }
}

/// The state of a Ray job (`JobStatus` in Ray's `dashboard/modules/job/common.py`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum JobStatus {
    /// Not started yet: waiting for a node with the entrypoint resources free, or for its
    /// runtime_env to be set up.
    Pending,
    /// The entrypoint is running.
    Running,
    /// Stopped on request (terminal).
    Stopped,
    /// The entrypoint exited with status 0 (terminal).
    Succeeded,
    /// The entrypoint exited with another status, or the job could not be started (terminal).
    Failed,
}

impl JobStatus {
    /// Whether the job can no longer change state (`STOPPED`, `SUCCEEDED`, `FAILED`).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobStatus::Stopped | JobStatus::Succeeded | JobStatus::Failed
        )
    }

    /// Ray's name of the state: `PENDING`, `RUNNING`, ...
    pub fn name(self) -> &'static str {
        match self {
            JobStatus::Pending => "PENDING",
            JobStatus::Running => "RUNNING",
            JobStatus::Stopped => "STOPPED",
            JobStatus::Succeeded => "SUCCEEDED",
            JobStatus::Failed => "FAILED",
        }
    }
}

impl std::fmt::Display for JobStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a job came to Ray: submitted through the Jobs API, or a driver script that called
/// `ray.init()` itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum JobType {
    /// Submitted through the Jobs API (has a `submission_id`).
    Submission,
    /// A driver connected on its own.
    Driver,
}

/// The Ray driver of a job: only present once the entrypoint itself calls `ray.init()` (a
/// `grpo worker` does not, so its jobs have none).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DriverInfo {
    /// The Ray job id of the driver (hex).
    pub id: String,
    /// The IP address of the node the driver runs on.
    pub node_ip_address: String,
    /// The driver's process id (Ray sends it as a string).
    pub pid: String,
}

/// One job as `GET /api/jobs/{id}` and `GET /api/jobs/` report it (`JobDetails` in Ray's
/// `pydantic_models.py`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobInfo {
    /// Submitted through the Jobs API or a self-connected driver.
    #[serde(rename = "type")]
    pub job_type: JobType,
    /// The id given at submission (absent for driver jobs).
    #[serde(default)]
    pub submission_id: Option<String>,
    /// Ray's internal job id (hex), once a driver runs.
    #[serde(default)]
    pub job_id: Option<String>,
    /// Where the job is.
    pub status: JobStatus,
    /// The shell command the job runs.
    pub entrypoint: String,
    /// Ray's words on the status (for a failed entrypoint: the exit code and the log's tail).
    #[serde(default)]
    pub message: Option<String>,
    /// Why it failed, in Ray's terms (`JOB_ENTRYPOINT_COMMAND_ERROR`,
    /// `JOB_SUPERVISOR_ACTOR_START_TIMEOUT`, ...).
    #[serde(default)]
    pub error_type: Option<String>,
    /// When the job was submitted, Unix time in ms.
    #[serde(default)]
    pub start_time: Option<u64>,
    /// When it reached a terminal status, Unix time in ms.
    #[serde(default)]
    pub end_time: Option<u64>,
    /// The metadata given at submission.
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: BTreeMap<String, String>,
    /// The runtime_env given at submission.
    #[serde(default)]
    pub runtime_env: Option<serde_json::Value>,
    /// The driver, when the entrypoint connected to Ray itself.
    #[serde(default)]
    pub driver_info: Option<DriverInfo>,
    /// The HTTP address of the Ray agent on the node the entrypoint runs on, once placed.
    #[serde(default)]
    pub driver_agent_http_address: Option<String>,
    /// The id of the node the entrypoint runs on, once placed.
    #[serde(default)]
    pub driver_node_id: Option<String>,
    /// The entrypoint's exit status, once it exited by itself.
    #[serde(default)]
    pub driver_exit_code: Option<i64>,
}

/// What to submit: one entrypoint and the resources Ray must reserve for it on one node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobRequest {
    /// The job's id, unique in the cluster (Ray refuses a second job with the same id).
    pub submission_id: String,
    /// The shell command to run (Ray runs it with `/bin/sh -c` in the job's working directory).
    pub entrypoint: String,
    /// CPUs to reserve (`entrypoint_num_cpus`).
    pub entrypoint_num_cpus: f64,
    /// GPUs to reserve (`entrypoint_num_gpus`).
    pub entrypoint_num_gpus: f64,
    /// Other resources to reserve (`entrypoint_resources`), e.g. `{"TPU": 4}`.
    pub entrypoint_resources: BTreeMap<String, f64>,
    /// Ray's runtime_env for the job (working_dir, env_vars, ...), passed verbatim.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime_env: Option<serde_json::Value>,
    /// Labels shown with the job.
    pub metadata: BTreeMap<String, String>,
}

impl JobRequest {
    /// Everything the job asks a node for, in Ray's resource names: `CPU` and `GPU` (when
    /// above 0) and the other resources.
    pub fn resources(&self) -> BTreeMap<String, f64> {
        let mut all = self.entrypoint_resources.clone();
        if self.entrypoint_num_cpus > 0.0 {
            all.insert("CPU".to_string(), self.entrypoint_num_cpus);
        }
        if self.entrypoint_num_gpus > 0.0 {
            all.insert("GPU".to_string(), self.entrypoint_num_gpus);
        }
        all
    }
}

/// The answer of `GET /api/version`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct RayVersion {
    /// The version of the Jobs API (`"4"` on Ray 2.60).
    pub version: String,
    /// The Ray release, e.g. `2.60.0`.
    pub ray_version: String,
    /// The commit Ray was built from.
    #[serde(default)]
    pub ray_commit: Option<String>,
    /// The cluster's session name (changes when the head restarts).
    #[serde(default)]
    pub session_name: Option<String>,
}

/// One node of the cluster as the state API lists it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct RayNode {
    /// The node's id (hex).
    pub node_id: String,
    /// Its IP address.
    pub node_ip: String,
    /// Whether it is the head node.
    #[serde(default)]
    pub is_head_node: bool,
    /// `ALIVE` or `DEAD`.
    pub state: String,
    /// Every resource it offers and how much: `CPU`, `GPU`, `TPU`, `memory` and
    /// `object_store_memory` (bytes), custom resources, and `node:IP`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub resources_total: BTreeMap<String, f64>,
    /// The node's labels (`ray.io/node-id`, accelerator labels, ...).
    #[serde(default, deserialize_with = "null_as_default")]
    pub labels: BTreeMap<String, String>,
}

impl RayNode {
    /// Whether the node is up.
    pub fn is_alive(&self) -> bool {
        self.state == "ALIVE"
    }

    /// Whether the node has, in total, at least what `resources` asks for (a job can only ever
    /// run on a node for which this holds).
    pub fn could_fit(&self, resources: &BTreeMap<String, f64>) -> bool {
        resources.iter().all(|(name, amount)| {
            *amount <= 0.0
                || self
                    .resources_total
                    .get(name)
                    .is_some_and(|total| total >= amount)
        })
    }
}

/// The actor that runs a submitted job's entrypoint: Ray's own record of where the job was
/// placed and what it reserved.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct JobSupervisor {
    /// The actor's id (hex).
    pub actor_id: String,
    /// `PENDING_CREATION` (no node found yet), `ALIVE`, `RESTARTING` or `DEAD`.
    pub state: String,
    /// The node it runs (or ran) on; absent until placed.
    #[serde(default)]
    pub node_id: Option<String>,
    /// The supervisor's process id (0 until placed); the entrypoint is its child.
    #[serde(default)]
    pub pid: u32,
    /// The resources reserved for the job: the submission's `entrypoint_num_cpus` as `CPU`,
    /// `entrypoint_num_gpus` as `GPU`, and the `entrypoint_resources`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub required_resources: BTreeMap<String, f64>,
    /// Why it died, when dead (Ray's `death_cause` object).
    #[serde(default)]
    pub death_cause: Option<serde_json::Value>,
}

/// A client of one Ray cluster's dashboard. Cheap to clone.
#[derive(Clone, Debug)]
pub struct RayJobs {
    /// The address as given (for messages).
    address: String,
    /// Host to connect to (no brackets around an IPv6 address).
    host: String,
    port: u16,
    /// The `Host` header value.
    authority: String,
    /// Path prefix of a dashboard behind a proxy (`""` or `/prefix`).
    base_path: String,
    timeout: Duration,
}

impl RayJobs {
    /// A client of the dashboard at `address`: `http://HOST:PORT` (a path prefix is kept for a
    /// dashboard behind a proxy; `HOST:PORT` alone means http). Nothing is contacted yet.
    pub fn new(address: &str) -> Result<RayJobs, RayJobsError> {
        let invalid = |reason: &str| RayJobsError::InvalidAddress {
            address: address.to_string(),
            reason: reason.to_string(),
        };
        let trimmed = address.trim();
        if trimmed.is_empty() {
            return Err(invalid("it is empty"));
        }
        let rest = if let Some(rest) = trimmed.strip_prefix("http://") {
            rest
        } else if trimmed.starts_with("https://") {
            return Err(RayJobsError::HttpsUnsupported {
                address: address.to_string(),
            });
        } else if trimmed.starts_with("ray://") {
            return Err(invalid(
                "ray:// is the Ray Client address (port 10001), not the Jobs API of the dashboard",
            ));
        } else if trimmed.contains("://") {
            return Err(invalid("only the http:// scheme is supported"));
        } else {
            trimmed
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(invalid("it has no host"));
        }
        if authority.contains('@') {
            return Err(invalid("user information (`user@`) is not supported"));
        }
        if path.contains('?') || path.contains('#') {
            return Err(invalid("it must not carry a query or fragment"));
        }
        let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
            let Some((host, after)) = bracketed.split_once(']') else {
                return Err(invalid("an IPv6 address needs its closing `]`"));
            };
            let port = match after.strip_prefix(':') {
                Some(p) => Some(p),
                None if after.is_empty() => None,
                None => return Err(invalid("unexpected text after the IPv6 address")),
            };
            (host.to_string(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host.to_string(), Some(port)),
                None => (authority.to_string(), None),
            }
        };
        if host.is_empty() {
            return Err(invalid("it has no host"));
        }
        let port = match port {
            None => 80,
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| invalid(&format!("`{p}` is not a port number (1-65535)")))?,
        };
        Ok(RayJobs {
            address: format!("http://{authority}{path}"),
            host,
            port,
            authority: authority.to_string(),
            base_path: path.to_string(),
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// The same client with another per-request timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> RayJobs {
        self.timeout = timeout;
        self
    }

    /// The dashboard's address, normalised (`http://HOST:PORT[/prefix]`).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The Ray version of the cluster (`GET /api/version`); fails with
    /// [`RayJobsError::NotRay`] when the server at the address is not a Ray dashboard.
    pub async fn version(&self) -> Result<RayVersion, RayJobsError> {
        let endpoint = "/api/version";
        let answer = self.request(Method::GET, endpoint, None).await;
        let not_ray = |answer: String| RayJobsError::NotRay {
            address: self.address.clone(),
            endpoint: endpoint.to_string(),
            answer,
        };
        let (status, body) = answer?;
        if !status.is_success() {
            return Err(not_ray(format!("HTTP {}: {}", status.as_u16(), excerpt(&body))));
        }
        serde_json::from_slice::<RayVersion>(&body)
            .map_err(|_| not_ray(format!("HTTP 200 with {}", excerpt(&body))))
    }

    /// The cluster's nodes, alive and dead (`GET /api/v0/nodes`).
    pub async fn nodes(&self) -> Result<Vec<RayNode>, RayJobsError> {
        let endpoint = "/api/v0/nodes?limit=10000&detail=1";
        let body = self.expect_ok(Method::GET, endpoint, None, None).await?;
        let listing: StateListing<RayNode> = self.parse(Method::GET, endpoint, &body)?;
        listing.into_result(self, endpoint)
    }

    /// Submits a job (`POST /api/jobs/`) and returns its submission id.
    pub async fn submit(&self, request: &JobRequest) -> Result<String, RayJobsError> {
        let endpoint = "/api/jobs/";
        let payload = serde_json::to_vec(request).expect("a JobRequest serialises");
        let body = self
            .expect_ok(
                Method::POST,
                endpoint,
                Some(payload),
                Some(&request.submission_id),
            )
            .await?;
        #[derive(Deserialize)]
        struct Submitted {
            submission_id: String,
        }
        let submitted: Submitted = self.parse(Method::POST, endpoint, &body)?;
        Ok(submitted.submission_id)
    }

    /// The job's current record (`GET /api/jobs/{id}`); [`RayJobsError::JobNotFound`] when Ray
    /// has no such job.
    pub async fn info(&self, id: &str) -> Result<JobInfo, RayJobsError> {
        let endpoint = format!("/api/jobs/{}", escape(id));
        let body = self.expect_ok(Method::GET, &endpoint, None, Some(id)).await?;
        self.parse(Method::GET, &endpoint, &body)
    }

    /// Asks Ray to stop the job (`POST /api/jobs/{id}/stop`): Ray signals the entrypoint
    /// (SIGTERM, then SIGKILL) and the job turns `STOPPED` shortly after. Returns whether Ray
    /// found a supervisor to tell (false for a job already terminal). A `PENDING` job stays
    /// `PENDING` until it is placed (see the module's notes).
    pub async fn stop(&self, id: &str) -> Result<bool, RayJobsError> {
        let endpoint = format!("/api/jobs/{}/stop", escape(id));
        let body = self.expect_ok(Method::POST, &endpoint, None, Some(id)).await?;
        #[derive(Deserialize)]
        struct Stopped {
            stopped: bool,
        }
        Ok(self.parse::<Stopped>(Method::POST, &endpoint, &body)?.stopped)
    }

    /// Deletes a terminal job's record and logs (`DELETE /api/jobs/{id}`). Ray refuses to
    /// delete a job that is still `PENDING` or `RUNNING` (stop it and wait first).
    pub async fn delete(&self, id: &str) -> Result<bool, RayJobsError> {
        let endpoint = format!("/api/jobs/{}", escape(id));
        let body = self.expect_ok(Method::DELETE, &endpoint, None, Some(id)).await?;
        #[derive(Deserialize)]
        struct Deleted {
            deleted: bool,
        }
        Ok(self.parse::<Deleted>(Method::DELETE, &endpoint, &body)?.deleted)
    }

    /// Everything the job's entrypoint wrote so far, stdout and stderr interleaved, with Ray's
    /// own lines (`GET /api/jobs/{id}/logs`); empty before the job is placed.
    pub async fn logs(&self, id: &str) -> Result<String, RayJobsError> {
        let endpoint = format!("/api/jobs/{}/logs", escape(id));
        let body = self.expect_ok(Method::GET, &endpoint, None, Some(id)).await?;
        #[derive(Deserialize)]
        struct Logs {
            logs: String,
        }
        Ok(self.parse::<Logs>(Method::GET, &endpoint, &body)?.logs)
    }

    /// Every job the cluster knows, submitted ones first, then driver jobs (`GET /api/jobs/`).
    pub async fn list(&self) -> Result<Vec<JobInfo>, RayJobsError> {
        let endpoint = "/api/jobs/";
        let body = self.expect_ok(Method::GET, endpoint, None, None).await?;
        self.parse(Method::GET, endpoint, &body)
    }

    /// The supervisor actor of the submitted job `id` (`GET /api/v0/actors` filtered by its
    /// name `_ray_internal_job_actor_ID`): where Ray placed the job and the resources it
    /// reserved. `None` when Ray has no such actor (not submitted, or forgotten).
    pub async fn supervisor(&self, id: &str) -> Result<Option<JobSupervisor>, RayJobsError> {
        let endpoint = format!(
            "/api/v0/actors?detail=1&limit=100&filter_keys=name&filter_predicates=%3D&filter_values={}",
            escape(&format!("_ray_internal_job_actor_{id}"))
        );
        let body = self.expect_ok(Method::GET, &endpoint, None, None).await?;
        let listing: StateListing<JobSupervisor> = self.parse(Method::GET, &endpoint, &body)?;
        // The newest record last: an id is only ever used once, but be safe.
        Ok(listing.into_result(self, &endpoint)?.pop())
    }

    /// Sends a request whose answer must be 2xx and returns the body. `job` names the job the
    /// endpoint is about, so that a 404 becomes [`RayJobsError::JobNotFound`].
    async fn expect_ok(
        &self,
        method: Method,
        endpoint: &str,
        payload: Option<Vec<u8>>,
        job: Option<&str>,
    ) -> Result<Bytes, RayJobsError> {
        let (status, body) = self.request(method.clone(), endpoint, payload).await?;
        if status.is_success() {
            return Ok(body);
        }
        let method = method_name(&method);
        let excerpt = excerpt(&body);
        if status == StatusCode::NOT_FOUND {
            if let Some(id) = job.filter(|_| String::from_utf8_lossy(&body).contains("does not exist")) {
                return Err(RayJobsError::JobNotFound {
                    address: self.address.clone(),
                    id: id.to_string(),
                    method,
                    endpoint: endpoint.to_string(),
                    excerpt,
                });
            }
        }
        let hint = hint_for(status, &excerpt);
        Err(RayJobsError::Status {
            address: self.address.clone(),
            method,
            endpoint: endpoint.to_string(),
            status: status.as_u16(),
            excerpt,
            hint,
        })
    }

    /// One request on a fresh connection: the status and the whole body.
    async fn request(
        &self,
        method: Method,
        endpoint: &str,
        payload: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), RayJobsError> {
        let name = method_name(&method);
        let exchange = self.exchange(method, endpoint, payload);
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(reason)) => Err(RayJobsError::Connect {
                address: self.address.clone(),
                method: name,
                endpoint: endpoint.to_string(),
                reason,
            }),
            Err(_) => Err(RayJobsError::Timeout {
                address: self.address.clone(),
                method: name,
                endpoint: endpoint.to_string(),
                seconds: self.timeout.as_secs_f64(),
            }),
        }
    }

    /// Connects, sends, reads; errors as text for [`RayJobsError::Connect`].
    async fn exchange(
        &self,
        method: Method,
        endpoint: &str,
        payload: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), String> {
        let stream = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("cannot connect to {}:{}: {e}", self.host, self.port))?;
        let _ = stream.set_nodelay(true);
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| format!("HTTP handshake failed: {e}"))?;
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{}{endpoint}", self.base_path))
            .header(hyper::header::HOST, &self.authority)
            .header(hyper::header::ACCEPT, "application/json")
            .header(
                hyper::header::USER_AGENT,
                concat!("grpo/", env!("CARGO_PKG_VERSION")),
            );
        if payload.is_some() {
            builder = builder.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        let request = builder
            .body(Full::new(Bytes::from(payload.unwrap_or_default())))
            .map_err(|e| format!("cannot build the request: {e}"))?;
        let exchange = async {
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| format!("the request failed: {e}"))?;
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("reading the answer failed: {e}"))?
                .to_bytes();
            Ok::<_, String>((status, body))
        };
        tokio::pin!(exchange);
        tokio::pin!(connection);
        // Drive the connection here until the answer is read, then drop it.
        tokio::select! {
            answer = &mut exchange => answer,
            closed = &mut connection => {
                closed.map_err(|e| format!("the connection failed: {e}"))?;
                // Closed cleanly: the exchange has its answer or fails on its own.
                exchange.await
            }
        }
    }

    /// Parses a 2xx body as `T`.
    fn parse<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        endpoint: &str,
        body: &[u8],
    ) -> Result<T, RayJobsError> {
        serde_json::from_slice(body).map_err(|e| RayJobsError::Parse {
            address: self.address.clone(),
            method: method_name(&method),
            endpoint: endpoint.to_string(),
            reason: e.to_string(),
            excerpt: excerpt(body),
        })
    }
}

/// The sum of every resource over the alive nodes.
pub fn total_resources(nodes: &[RayNode]) -> BTreeMap<String, f64> {
    let mut total = BTreeMap::new();
    for node in nodes.iter().filter(|n| n.is_alive()) {
        for (name, amount) in &node.resources_total {
            *total.entry(name.clone()).or_insert(0.0) += amount;
        }
    }
    total
}

/// Resources for people: `CPU 4, GPU 2, TPU 4, memory 16.1 GiB, object_store_memory 6.9 GiB`,
/// without the per-node `node:IP` entries.
pub fn format_resources(resources: &BTreeMap<String, f64>) -> String {
    let mut parts = Vec::new();
    for (name, amount) in resources {
        if name.starts_with("node:") {
            continue;
        }
        let shown = if name == "memory" || name == "object_store_memory" {
            format!("{:.1} GiB", amount / (1u64 << 30) as f64)
        } else if amount.fract() == 0.0 {
            format!("{amount:.0}")
        } else {
            format!("{amount}")
        };
        parts.push(format!("{name} {shown}"));
    }
    if parts.is_empty() {
        "nothing".to_string()
    } else {
        parts.join(", ")
    }
}

/// The envelope of Ray's state API answers: `{"result": bool, "msg": str, "data": {"result":
/// {"result": [...], ...}}}`.
#[derive(Deserialize)]
struct StateListing<T> {
    result: bool,
    #[serde(default)]
    msg: String,
    #[serde(default = "Option::default")]
    data: Option<StateData<T>>,
}

#[derive(Deserialize)]
struct StateData<T> {
    result: StateResult<T>,
}

#[derive(Deserialize)]
struct StateResult<T> {
    result: Vec<T>,
}

impl<T> StateListing<T> {
    fn into_result(self, client: &RayJobs, endpoint: &str) -> Result<Vec<T>, RayJobsError> {
        match (self.result, self.data) {
            (true, Some(data)) => Ok(data.result.result),
            (_, _) => Err(RayJobsError::Status {
                address: client.address.clone(),
                method: "GET",
                endpoint: endpoint.to_string(),
                status: 200,
                excerpt: format!("the state API reported failure: {}", self.msg),
                hint: "; the head's dashboard may still be starting: retry in a few seconds".to_string(),
            }),
        }
    }
}

/// `null` (as Ray writes an absent map) read as the empty value.
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// The method's name with a static lifetime, for messages.
fn method_name(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::DELETE => "DELETE",
        Method::PUT => "PUT",
        _ => "HTTP",
    }
}

/// Percent-encodes everything but RFC 3986 unreserved characters, for a path segment or a query
/// value.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The telling part of an error body, at most 300 characters on one line: for a Python
/// traceback (Ray answers many errors with one), its last `SomethingError: ...` line; otherwise
/// the start of the body.
fn excerpt(body: &[u8]) -> String {
    const LIMIT: usize = 300;
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        return "(an empty body)".to_string();
    }
    let chosen = if text.contains("Traceback (most recent call last)") {
        text.lines()
            .rev()
            .map(str::trim)
            .find(|line| {
                line.split_once(": ").is_some_and(|(kind, _)| {
                    !kind.contains(' ') && (kind.ends_with("Error") || kind.ends_with("Exception"))
                })
            })
            .unwrap_or(text)
            .to_string()
    } else {
        text.split_whitespace().collect::<Vec<_>>().join(" ")
    };
    if chosen.chars().count() > LIMIT {
        let cut: String = chosen.chars().take(LIMIT).collect();
        format!("{cut}...")
    } else {
        chosen
    }
}

/// What to do about a failed request, from its status and Ray's words.
fn hint_for(status: StatusCode, excerpt: &str) -> String {
    if excerpt.contains("already exists") {
        "; every job needs a new submission_id (delete the old job or use another id)".to_string()
    } else if excerpt.contains("non-terminal state") {
        "; stop the job and wait until it is STOPPED, SUCCEEDED or FAILED before deleting it".to_string()
    } else if status == StatusCode::NOT_FOUND {
        "; this server has no such endpoint: is it a Ray dashboard of Ray >= 2.9?".to_string()
    } else if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
        "; the dashboard requires authentication (Ray token auth), which grpo's Ray client does \
         not send: reach the dashboard without authentication from the orchestrator's network"
            .to_string()
    } else if status.is_server_error() && excerpt.contains("No available agent") {
        "; the head's job agent is not up yet: retry in a few seconds".to_string()
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> Vec<u8> {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/ray")
            .join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// One canned answer of the fake dashboard: for requests whose first line starts with
    /// `prefix` (e.g. `GET /api/jobs/x `), answer `status` with `body`.
    struct Route {
        prefix: &'static str,
        status: u16,
        body: Vec<u8>,
    }

    /// A fake dashboard on 127.0.0.1 (a thread with blocking sockets) answering `routes` with
    /// Ray's recorded answers (404 for anything else); returns its address and the requests
    /// (head and body) it got.
    fn serve(routes: Vec<Route>) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else {
                    return;
                };
                let mut data = Vec::new();
                let mut buffer = [0u8; 4096];
                // Read the head, then a body of Content-Length bytes.
                let request = loop {
                    let n = stream.read(&mut buffer).unwrap_or(0);
                    if n == 0 {
                        break String::from_utf8_lossy(&data).into_owned();
                    }
                    data.extend_from_slice(&buffer[..n]);
                    let text = String::from_utf8_lossy(&data).into_owned();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text[..end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length: ")
                                    .map(|v| v.trim().parse::<usize>().unwrap())
                            })
                            .unwrap_or(0);
                        if data.len() >= end + 4 + length {
                            break text;
                        }
                    }
                };
                log.lock().unwrap().push(request.clone());
                let route = routes.iter().find(|r| request.starts_with(r.prefix));
                let (status, body) = match route {
                    Some(r) => (r.status, r.body.clone()),
                    None => (404, b"404: Not Found".to_vec()),
                };
                let head = format!(
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(&body);
            }
        });
        (address, seen)
    }

    #[test]
    fn parses_the_recorded_job_records_of_ray_2_60() {
        let succeeded: JobInfo = serde_json::from_slice(&fixture("job_succeeded.json")).unwrap();
        assert_eq!(succeeded.status, JobStatus::Succeeded);
        assert_eq!(succeeded.job_type, JobType::Submission);
        assert_eq!(succeeded.submission_id.as_deref(), Some("grpo-t-rollout-0-a1"));
        assert_eq!(succeeded.entrypoint, "echo hello-from-ray; sleep 1");
        assert_eq!(succeeded.message.as_deref(), Some("Job finished successfully."));
        assert_eq!(succeeded.start_time, Some(1796050899565));
        assert_eq!(succeeded.end_time, Some(1796050902298));
        assert_eq!(succeeded.driver_exit_code, Some(0));
        assert_eq!(succeeded.metadata["grpo_role"], "rollout");
        assert_eq!(succeeded.runtime_env.as_ref().unwrap()["env_vars"]["X"], "1");
        assert_eq!(
            succeeded.driver_node_id.as_deref(),
            Some("8d4edcf87b4d6ae498b40ccda119c7ef83baa42f0d40c1407a1c8a2e")
        );
        assert_eq!(
            succeeded.driver_agent_http_address.as_deref(),
            Some("http://192.0.2.2:52365")
        );
        assert!(succeeded.driver_info.is_none());
        assert!(succeeded.status.is_terminal());

        let failed: JobInfo = serde_json::from_slice(&fixture("job_failed.json")).unwrap();
        assert_eq!(failed.status, JobStatus::Failed);
        assert_eq!(failed.error_type.as_deref(), Some("JOB_ENTRYPOINT_COMMAND_ERROR"));
        assert_eq!(failed.driver_exit_code, Some(3));
        assert!(failed
            .message
            .unwrap()
            .starts_with("Job entrypoint command failed with exit code 3"));
        assert!(failed.metadata.is_empty(), "null metadata reads as empty");

        let pending: JobInfo = serde_json::from_slice(&fixture("job_pending.json")).unwrap();
        assert_eq!(pending.status, JobStatus::Pending);
        assert!(!pending.status.is_terminal());
        assert_eq!(pending.end_time, None);
        assert!(pending.driver_node_id.is_none());
        assert!(pending.message.unwrap().contains("waiting for resources"));

        let stopped: JobInfo = serde_json::from_slice(&fixture("job_stopped.json")).unwrap();
        assert_eq!(stopped.status, JobStatus::Stopped);
        assert_eq!(stopped.driver_exit_code, None);

        let list: Vec<JobInfo> = serde_json::from_slice(&fixture("jobs_list.json")).unwrap();
        assert_eq!(list.len(), 4);
        let statuses: Vec<JobStatus> = list.iter().map(|j| j.status).collect();
        assert!(statuses.contains(&JobStatus::Succeeded) && statuses.contains(&JobStatus::Failed));
    }

    #[test]
    fn parses_nodes_and_sums_the_cluster_resources() {
        let listing: StateListing<RayNode> = serde_json::from_slice(&fixture("nodes.json")).unwrap();
        let client = RayJobs::new("http://127.0.0.1:8265").unwrap();
        let mut nodes = listing.into_result(&client, "/api/v0/nodes").unwrap();
        assert_eq!(nodes.len(), 1);
        assert!(nodes[0].is_alive() && nodes[0].is_head_node);
        let total = total_resources(&nodes);
        assert_eq!(total["CPU"], 4.0);
        assert_eq!(total["GPU"], 2.0);
        assert_eq!(total["TPU"], 4.0);
        assert_eq!(total["memory"], 17330323047.0);
        assert_eq!(
            format_resources(&total),
            "CPU 4, GPU 2, TPU 4, memory 16.1 GiB, object_store_memory 6.9 GiB"
        );
        // A second node, dead, does not count; a second alive one adds up.
        let mut dead = nodes[0].clone();
        dead.state = "DEAD".to_string();
        let mut other = nodes[0].clone();
        other.resources_total = BTreeMap::from([("TPU".to_string(), 8.0), ("CPU".to_string(), 0.5)]);
        nodes.extend([dead, other]);
        let total = total_resources(&nodes);
        assert_eq!(total["TPU"], 12.0);
        assert_eq!(total["CPU"], 4.5);
        let ask = |cpu: f64, gpu: f64, extra: &[(&str, f64)]| JobRequest {
            submission_id: "x".into(),
            entrypoint: "true".into(),
            entrypoint_num_cpus: cpu,
            entrypoint_num_gpus: gpu,
            entrypoint_resources: extra.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            runtime_env: None,
            metadata: BTreeMap::new(),
        };
        let request = ask(1.0, 0.0, &[("TPU", 8.0)]);
        assert_eq!(
            request.resources(),
            BTreeMap::from([("CPU".to_string(), 1.0), ("TPU".to_string(), 8.0)])
        );
        assert!(!nodes[0].could_fit(&request.resources()), "the head has 4 TPU");
        assert!(!nodes[2].could_fit(&request.resources()), "the other has 0.5 CPU");
        assert!(nodes[0].could_fit(&ask(4.0, 2.0, &[("TPU", 4.0)]).resources()));
        assert!(!nodes[0].could_fit(&ask(1.0, 0.0, &[("GPU_TYPE_A100", 1.0)]).resources()));
    }

    #[test]
    fn parses_the_supervisor_actor_with_the_reserved_resources() {
        let listing: StateListing<JobSupervisor> =
            serde_json::from_slice(&fixture("supervisor_actor.json")).unwrap();
        let client = RayJobs::new("http://127.0.0.1:8265").unwrap();
        let actors = listing.into_result(&client, "/api/v0/actors").unwrap();
        assert_eq!(actors.len(), 1);
        let supervisor = &actors[0];
        assert_eq!(supervisor.state, "DEAD");
        assert_eq!(supervisor.pid, 7224);
        assert_eq!(
            supervisor.required_resources,
            BTreeMap::from([
                ("CPU".to_string(), 1.0),
                ("GPU".to_string(), 0.5),
                ("TPU".to_string(), 1.0)
            ])
        );
        assert!(supervisor.death_cause.is_some());
    }

    #[test]
    fn a_job_request_serialises_as_ray_expects() {
        let request = JobRequest {
            submission_id: "grpo-ab12-rollout-0-a1".into(),
            entrypoint: "grpo worker --role rollout".into(),
            entrypoint_num_cpus: 1.0,
            entrypoint_num_gpus: 0.0,
            entrypoint_resources: BTreeMap::from([("TPU".to_string(), 4.0)]),
            runtime_env: None,
            metadata: BTreeMap::from([("role".to_string(), "rollout".to_string())]),
        };
        let json: serde_json::Value = serde_json::to_value(&request).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "submission_id": "grpo-ab12-rollout-0-a1",
                "entrypoint": "grpo worker --role rollout",
                "entrypoint_num_cpus": 1.0,
                "entrypoint_num_gpus": 0.0,
                "entrypoint_resources": {"TPU": 4.0},
                "metadata": {"role": "rollout"},
            })
        );
    }

    #[test]
    fn addresses_are_checked() {
        let ok = RayJobs::new("http://127.0.0.1:8265/").unwrap();
        assert_eq!(
            (ok.host.as_str(), ok.port, ok.address()),
            ("127.0.0.1", 8265, "http://127.0.0.1:8265")
        );
        let bare = RayJobs::new("head.example:8265").unwrap();
        assert_eq!((bare.host.as_str(), bare.port), ("head.example", 8265));
        let v6 = RayJobs::new("http://[::1]:9000/ray/").unwrap();
        assert_eq!(
            (v6.host.as_str(), v6.port, v6.base_path.as_str()),
            ("::1", 9000, "/ray")
        );
        assert_eq!(RayJobs::new("http://head").unwrap().port, 80);

        let https = RayJobs::new("https://ray.example:8265").unwrap_err().to_string();
        assert!(
            https.starts_with("Ray address `https://ray.example:8265` uses https"),
            "{https}"
        );
        assert!(https.contains("kubectl port-forward"), "{https}");
        let client = RayJobs::new("ray://head:10001").unwrap_err().to_string();
        assert!(client.contains("ray:// is the Ray Client address"), "{client}");
        let port = RayJobs::new("http://head:99999").unwrap_err().to_string();
        assert_eq!(
            port,
            "Ray address `http://head:99999` is not usable: `99999` is not a port number (1-65535); \
             give the dashboard's Jobs API address as http://HOST:PORT, e.g. http://127.0.0.1:8265"
        );
        assert!(RayJobs::new("").unwrap_err().to_string().contains("it is empty"));
        assert!(RayJobs::new("http://:8265")
            .unwrap_err()
            .to_string()
            .contains("no host"));
    }

    #[test]
    fn error_bodies_are_cut_to_what_matters() {
        assert_eq!(
            excerpt(&fixture("submit_duplicate_500.txt")),
            "ValueError: Job with submission_id run2 already exists. Please use a different submission_id."
        );
        assert_eq!(
            excerpt(&fixture("submit_bad_400.txt")),
            "TypeError: entrypoint_num_cpus must be a number, got <class 'str'>"
        );
        assert_eq!(
            excerpt(&fixture("delete_running_500.txt")),
            "RuntimeError: Attempted to delete job 'grpo-r1-reward-0-a1', but it is in a non-terminal \
             state PENDING."
        );
        assert_eq!(excerpt(b"  "), "(an empty body)");
        let long = "x".repeat(400);
        assert_eq!(excerpt(long.as_bytes()).len(), 303);
        assert_eq!(escape("grpo-ab_1.x"), "grpo-ab_1.x");
        assert_eq!(escape("a b/c=d"), "a%20b%2Fc%3Dd");
    }

    #[test]
    fn talks_to_a_dashboard_answering_as_ray_2_60_does() {
        runtime().block_on(async {
            let routes = vec![
                Route { prefix: "GET /api/version ", status: 200, body: fixture("version.json") },
                Route { prefix: "GET /api/v0/nodes?", status: 200, body: fixture("nodes.json") },
                Route { prefix: "POST /api/jobs/ ", status: 200, body: fixture("submit.json") },
                Route { prefix: "GET /api/jobs/grpo-t-rollout-0-a1 ", status: 200, body: fixture("job_succeeded.json") },
                Route { prefix: "GET /api/jobs/grpo-t-rollout-0-a1/logs ", status: 200, body: fixture("logs.json") },
                Route { prefix: "GET /api/jobs/ ", status: 200, body: fixture("jobs_list.json") },
                Route { prefix: "POST /api/jobs/run2/stop ", status: 200, body: fixture("stop.json") },
                Route { prefix: "DELETE /api/jobs/grpo-r1-reward-0-a1 ", status: 500, body: fixture("delete_running_500.txt") },
                Route { prefix: "DELETE /api/jobs/done ", status: 200, body: fixture("delete.json") },
                Route { prefix: "GET /api/jobs/nope ", status: 404, body: fixture("job_missing_404.txt") },
                Route { prefix: "GET /api/v0/actors?", status: 200, body: fixture("supervisor_actor.json") },
            ];
            let (address, seen) = serve(routes);
            let client = RayJobs::new(&address).unwrap();
            let version = client.version().await.unwrap();
            assert_eq!((version.version.as_str(), version.ray_version.as_str()), ("4", "2.60.0"));
            assert_eq!(total_resources(&client.nodes().await.unwrap())["TPU"], 4.0);
            let request = JobRequest {
                submission_id: "grpo-r1-reward-0-a1".into(),
                entrypoint: "python3 -c \"print(1)\"".into(),
                entrypoint_num_cpus: 1.0,
                entrypoint_num_gpus: 0.0,
                entrypoint_resources: BTreeMap::from([("TPU".to_string(), 1.0)]),
                runtime_env: Some(serde_json::json!({"env_vars": {"A": "b"}})),
                metadata: BTreeMap::new(),
            };
            assert_eq!(client.submit(&request).await.unwrap(), "grpo-r1-reward-0-a1");
            let info = client.info("grpo-t-rollout-0-a1").await.unwrap();
            assert_eq!(info.status, JobStatus::Succeeded);
            assert!(client.logs("grpo-t-rollout-0-a1").await.unwrap().contains("hello-from-ray\n"));
            assert_eq!(client.list().await.unwrap().len(), 4);
            assert!(client.stop("run2").await.unwrap());
            assert!(client.delete("done").await.unwrap());
            let supervisor = client.supervisor("grpo-t-rollout-0-a1").await.unwrap().unwrap();
            assert_eq!(supervisor.required_resources["TPU"], 1.0);

            let missing = client.info("nope").await.unwrap_err();
            assert!(missing.is_not_found());
            assert_eq!(
                missing.to_string(),
                format!(
                    "the Ray cluster at {address} has no job `nope` (GET /api/jobs/nope answered 404: \
                     Job nope does not exist); it was never submitted there or has been deleted"
                )
            );
            let running = client.delete("grpo-r1-reward-0-a1").await.unwrap_err();
            assert!(!running.is_not_found());
            assert_eq!(
                running.to_string(),
                format!(
                    "the Ray dashboard at {address} answered DELETE /api/jobs/grpo-r1-reward-0-a1 with \
                     HTTP 500: RuntimeError: Attempted to delete job 'grpo-r1-reward-0-a1', but it is in \
                     a non-terminal state PENDING.; stop the job and wait until it is STOPPED, SUCCEEDED or FAILED before \
                     deleting it"
                )
            );

            let requests = seen.lock().unwrap().clone();
            let submit = requests.iter().find(|r| r.starts_with("POST /api/jobs/ ")).unwrap();
            let host = address.strip_prefix("http://").unwrap();
            assert!(submit.contains(&format!("host: {host}\r\n")), "{submit}");
            assert!(submit.contains("content-type: application/json\r\n"), "{submit}");
            let body: serde_json::Value = serde_json::from_str(submit.split("\r\n\r\n").nth(1).unwrap()).unwrap();
            assert_eq!(body["entrypoint_resources"]["TPU"], 1.0);
            assert_eq!(body["runtime_env"]["env_vars"]["A"], "b");
            let actors = requests.iter().find(|r| r.starts_with("GET /api/v0/actors?")).unwrap();
            assert!(
                actors.contains("filter_values=_ray_internal_job_actor_grpo-t-rollout-0-a1 "),
                "{actors}"
            );
        });
    }

    #[test]
    fn a_server_that_is_not_ray_is_named_as_such() {
        runtime().block_on(async {
            let (address, _) = serve(vec![Route {
                prefix: "GET /api/version ",
                status: 200,
                body: b"<html>hello</html>".to_vec(),
            }]);
            let error = RayJobs::new(&address).unwrap().version().await.unwrap_err();
            assert_eq!(
                error.to_string(),
                format!(
                    "{address} does not look like a Ray dashboard: GET /api/version answered HTTP 200 \
                     with <html>hello</html>; point `cluster.ray.address` at the head's dashboard \
                     (port 8265 by default, not the GCS port 6379 nor the Ray Client port 10001)"
                )
            );
            let (address, _) = serve(vec![]);
            let error = RayJobs::new(&address).unwrap().version().await.unwrap_err();
            assert!(
                error.to_string().contains("answered HTTP 404: 404: Not Found"),
                "{error}"
            );
        });
    }

    #[test]
    fn an_unreachable_or_silent_dashboard_says_what_to_do() {
        runtime().block_on(async {
            // A port nobody listens on: bind, note it, close.
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let error = RayJobs::new(&format!("http://127.0.0.1:{port}"))
                .unwrap()
                .info("grpo-x")
                .await
                .unwrap_err();
            assert!(error.is_unreachable());
            let text = error.to_string();
            assert!(
                text.starts_with(&format!(
                    "cannot reach the Ray dashboard at http://127.0.0.1:{port} (GET /api/jobs/grpo-x): \
                     cannot connect to 127.0.0.1:{port}:"
                )),
                "{text}"
            );
            assert!(text.ends_with(&format!("; {START_HINT}")), "{text}");
            assert!(
                text.contains("ray start --head --dashboard-host 0.0.0.0"),
                "{text}"
            );

            // Accepts but never answers.
            let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let address = format!("http://{}", silent.local_addr().unwrap());
            let error = RayJobs::new(&address)
                .unwrap()
                .with_timeout(Duration::from_millis(200))
                .list()
                .await
                .unwrap_err();
            assert!(error.is_unreachable());
            assert!(
                error.to_string().starts_with(&format!(
                    "the Ray dashboard at {address} did not answer GET /api/jobs/ within 0.2 s"
                )),
                "{error}"
            );
            drop(silent);
        });
    }
}
