//! How the orchestrator and its workers connect: plain TCP, or TLS (rustls with the ring
//! provider) when the recipe has a `cluster.tls` section.
//!
//! Both ends are built here so they always agree: [`server_builder`] gives a worker's
//! [`Server`] (presenting `cluster.tls.cert` / `cluster.tls.key`), [`channel`] gives the
//! orchestrator's lazily connecting [`Channel`] to a worker (trusting `cluster.tls.ca`, checking
//! the certificate is issued for `cluster.tls.domain`). With `cluster.tls.mutual` the servers
//! also require a client certificate signed by `cluster.tls.ca`, and the clients present
//! `cluster.tls.cert`: the cluster's processes share one identity, and a process without it
//! cannot call any of them. Certificate files are read when these are called, so a wrong path
//! fails at start-up with the recipe key and the path in the message.

use crate::recipe::TlsSection;
use std::path::Path;
use std::time::Duration;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

/// How long a client waits for a TCP (and TLS) connection to a worker before giving up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a server or a client connection could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A certificate or key file named in the recipe could not be read.
    #[error("cannot read `{key}` ({path}): {source}; fix the path in the recipe's `cluster.tls` section")]
    ReadPem {
        key: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A file was read but does not hold what the key says (no PEM block of the right kind).
    #[error("`{key}` ({path}) holds no PEM {expected}; give a PEM file (`-----BEGIN {expected}-----`)")]
    NotPem {
        key: &'static str,
        path: String,
        expected: &'static str,
    },
    /// rustls refused the certificates or key (wrong format, key does not match, ...).
    #[error("cannot set up TLS with `cluster.tls` (cert {cert}, key {key}, ca {ca}): {message}")]
    Tls {
        cert: String,
        key: String,
        ca: String,
        message: String,
    },
    /// The worker address is not a valid URI.
    #[error("bad worker address `{address}`: {message}; expected HOST:PORT, e.g. 127.0.0.1:7001")]
    BadAddress { address: String, message: String },
}

/// The builder of a worker's gRPC server: with TLS when `tls` is given (the worker presents
/// `cluster.tls.cert` with the key `cluster.tls.key`, and with `cluster.tls.mutual` requires a
/// client certificate signed by `cluster.tls.ca`), plain TCP otherwise. Add services to it and
/// serve as with [`Server::builder`].
pub fn server_builder(tls: Option<&TlsSection>) -> Result<Server, TransportError> {
    let server = Server::builder();
    let Some(tls) = tls else {
        return Ok(server);
    };
    let mut config = ServerTlsConfig::new().identity(identity(tls)?);
    if tls.mutual {
        let ca = read_pem("cluster.tls.ca", &tls.ca, &["CERTIFICATE"])?;
        config = config.client_ca_root(Certificate::from_pem(ca));
    }
    server.tls_config(config).map_err(|e| tls_error(tls, &e))
}

/// `cluster.tls.cert` with its key `cluster.tls.key`.
fn identity(tls: &TlsSection) -> Result<Identity, TransportError> {
    let cert = read_pem("cluster.tls.cert", &tls.cert, &["CERTIFICATE"])?;
    let key = read_pem(
        "cluster.tls.key",
        &tls.key,
        &["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"],
    )?;
    Ok(Identity::from_pem(cert, key))
}

/// The connections `listener` accepts, each with Nagle's algorithm off: the server builder's
/// `tcp_nodelay` applies only to listeners it binds itself, and a reply written as several
/// HTTP/2 frames would otherwise wait out the client's delayed ACK (40 ms a call).
pub fn incoming(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|accepted| {
        let stream = accepted?;
        stream.set_nodelay(true)?;
        Ok(stream)
    })
}

/// The scheme-qualified URI of a worker: `https://` with TLS, `http://` without. `address` may be
/// `HOST:PORT` or already carry a scheme (which is replaced to match `tls`).
pub fn worker_uri(address: &str, tls: Option<&TlsSection>) -> String {
    let bare = address
        .strip_prefix("http://")
        .or_else(|| address.strip_prefix("https://"))
        .unwrap_or(address);
    let scheme = if tls.is_some() { "https" } else { "http" };
    format!("{scheme}://{bare}")
}

/// The endpoint of a worker at `address` (`HOST:PORT`, or with a scheme), connect timeout
/// [`CONNECT_TIMEOUT`], TLS when `tls` is given: the worker must present a certificate signed by
/// `cluster.tls.ca` and issued for `cluster.tls.domain` (and with `cluster.tls.mutual` the
/// client presents `cluster.tls.cert`). Use it to tune the connection further;
/// [`channel`] is the usual entry point.
pub fn endpoint(address: &str, tls: Option<&TlsSection>) -> Result<Endpoint, TransportError> {
    let uri = worker_uri(address, tls);
    let endpoint = Endpoint::from_shared(uri.clone())
        .map_err(|e| TransportError::BadAddress {
            address: address.to_string(),
            message: error_chain(&e),
        })?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true);
    let Some(tls) = tls else {
        return Ok(endpoint);
    };
    let ca = read_pem("cluster.tls.ca", &tls.ca, &["CERTIFICATE"])?;
    let mut config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name(tls.domain.clone());
    if tls.mutual {
        config = config.identity(identity(tls)?);
    }
    endpoint.tls_config(config).map_err(|e| tls_error(tls, &e))
}

/// A channel to the worker at `address`; it connects on first use (and reconnects after a
/// failure), so creating it never waits. Call it inside a tokio runtime (the channel's
/// background task is spawned there). See [`endpoint`] for what `tls` does.
pub fn channel(address: &str, tls: Option<&TlsSection>) -> Result<Channel, TransportError> {
    Ok(endpoint(address, tls)?.connect_lazy())
}

/// `endpoint` set up to notice a worker that stops answering (a crashed host, a frozen
/// process) within about `timeout` (`cluster.worker_timeout_s`): connecting may take at most
/// `timeout`, and an HTTP/2 ping goes out every `timeout / 4` (at least every 250 ms), also while
/// no call is in flight; a ping left unanswered for `timeout` closes the connection, failing every
/// call on it with `UNAVAILABLE`, so its work can go elsewhere.
pub fn keep_alive(endpoint: Endpoint, timeout: Duration) -> Endpoint {
    endpoint
        .connect_timeout(timeout)
        .http2_keep_alive_interval(keep_alive_interval(timeout))
        .keep_alive_timeout(timeout)
        .keep_alive_while_idle(true)
}

/// How often [`keep_alive`] pings a worker that may stop answering after `timeout`.
pub fn keep_alive_interval(timeout: Duration) -> Duration {
    (timeout / 4).max(Duration::from_millis(250))
}

/// Read a PEM file named by recipe key `key`, checking it holds one of the `expected` blocks.
fn read_pem(key: &'static str, path: &str, expected: &[&'static str]) -> Result<Vec<u8>, TransportError> {
    let bytes = std::fs::read(Path::new(path)).map_err(|source| TransportError::ReadPem {
        key,
        path: path.to_string(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    if !expected
        .iter()
        .any(|kind| text.contains(&format!("-----BEGIN {kind}-----")))
    {
        return Err(TransportError::NotPem {
            key,
            path: path.to_string(),
            expected: expected[0],
        });
    }
    Ok(bytes)
}

fn tls_error(tls: &TlsSection, error: &tonic::transport::Error) -> TransportError {
    TransportError::Tls {
        cert: tls.cert.clone(),
        key: tls.key.clone(),
        ca: tls.ca.clone(),
        message: error_chain(error),
    }
}

/// An error with its sources, `outer: inner: innermost` (tonic's own message is terse).
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = s.source();
    }
    message
}

/// `status` with the causes of a transport failure appended to its message (tonic says only
/// "http2 error"; the cause says e.g. "keep-alive timed out" or "connection refused").
pub(crate) fn explain_status(status: tonic::Status) -> tonic::Status {
    let mut message = status.message().to_string();
    let mut source = std::error::Error::source(&status);
    while let Some(s) = source {
        let text = s.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = s.source();
    }
    if message == status.message() {
        return status;
    }
    tonic::Status::new(status.code(), message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Token;
    use crate::proto;
    use crate::roles::reward::{LocalReward, RemoteReward, RewardRole, RewardService};
    use crate::roles::RoleError;
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    use reward::{RewardConfig, Sample};
    use std::sync::Arc;

    /// A CA and a worker certificate for `localhost` signed by it, written as PEM files.
    struct Pki {
        _dir: tempfile::TempDir,
        tls: TlsSection,
    }

    fn make_pki() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf_key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .signed_by(&leaf_key, &issuer)
            .unwrap();
        let path = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(path("ca.pem"), ca_cert.pem()).unwrap();
        std::fs::write(path("worker.pem"), leaf.pem()).unwrap();
        std::fs::write(path("worker.key"), leaf_key.serialize_pem()).unwrap();
        let tls = TlsSection {
            cert: path("worker.pem"),
            key: path("worker.key"),
            ca: path("ca.pem"),
            domain: "localhost".into(),
            mutual: false,
        };
        Pki { _dir: dir, tls }
    }

    fn samples() -> Vec<Sample> {
        ["#### 42", "<answer>41</answer>", "no idea"]
            .iter()
            .enumerate()
            .map(|(i, a)| Sample {
                id: i as u64,
                data_source: "grpo/arithmetic".into(),
                prompt: serde_json::Value::Null,
                response: a.to_string(),
                ground_truth: "42".into(),
                extra: serde_json::Value::Null,
                response_length: 4,
                truncated: false,
            })
            .collect()
    }

    /// Serve the reward role on a free loopback port with `tls`; returns its `HOST:PORT`.
    async fn serve_reward(tls: Option<&TlsSection>, token: &Token) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let config = RewardConfig::default();
        let local = Arc::new(LocalReward::new(
            Arc::new(config.build(Some(48)).unwrap()),
            config.pool_options().unwrap(),
        ));
        let router =
            server_builder(tls)
                .unwrap()
                .add_service(tonic::service::interceptor::InterceptedService::new(
                    proto::reward_server::RewardServer::new(RewardService { local }),
                    token.interceptor(),
                ));
        tokio::spawn(router.serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)));
        address
    }

    #[tokio::test]
    async fn reward_round_trip_over_tls_and_clients_without_the_ca_are_refused() {
        let pki = make_pki();
        let token = Token::generate();
        let address = serve_reward(Some(&pki.tls), &token).await;

        let remote = RemoteReward::new(&address, &token, Some(&pki.tls)).unwrap();
        let scores: Vec<f64> = remote
            .score(samples())
            .await
            .unwrap()
            .iter()
            .map(|s| s.score)
            .collect();
        assert_eq!(scores, vec![1.0, 0.0, 0.0]);

        // A client trusting another CA does not accept the worker's certificate.
        let other = make_pki();
        let stranger_tls = TlsSection {
            ca: other.tls.ca.clone(),
            ..pki.tls.clone()
        };
        let stranger = RemoteReward::new(&address, &token, Some(&stranger_tls)).unwrap();
        match stranger.score(samples()).await {
            Err(RoleError::Unavailable { .. }) => {}
            other => panic!("a client without the CA must not connect, got {other:?}"),
        }
        // A client expecting another name does not accept it either.
        let wrong_name = TlsSection {
            domain: "worker.example".into(),
            ..pki.tls.clone()
        };
        let client = RemoteReward::new(&address, &token, Some(&wrong_name)).unwrap();
        assert!(matches!(
            client.score(samples()).await,
            Err(RoleError::Unavailable { .. })
        ));
        // Nor does plain text reach a TLS worker.
        let plain = RemoteReward::new(&address, &token, None).unwrap();
        assert!(matches!(
            plain.score(samples()).await,
            Err(RoleError::Unavailable { .. })
        ));
        // And over TLS the token is still checked.
        let intruder = RemoteReward::new(&address, &Token::generate(), Some(&pki.tls)).unwrap();
        match intruder.score(samples()).await {
            Err(RoleError::Refused { message, .. }) => {
                assert!(message.starts_with("wrong token"), "{message}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn mutual_tls_workers_refuse_clients_without_the_clusters_certificate() {
        let pki = make_pki();
        let mutual = TlsSection {
            mutual: true,
            ..pki.tls.clone()
        };
        let token = Token::generate();
        let address = serve_reward(Some(&mutual), &token).await;
        let member = RemoteReward::new(&address, &token, Some(&mutual)).unwrap();
        assert_eq!(member.score(samples()).await.unwrap().len(), 3);
        // Trusting the worker is not enough: a client must present a certificate...
        let anonymous = RemoteReward::new(&address, &token, Some(&pki.tls)).unwrap();
        assert!(
            matches!(
                anonymous.score(samples()).await,
                Err(RoleError::Unavailable { .. })
            ),
            "a client without a certificate must be refused"
        );
        // ... signed by the cluster's CA.
        let other = make_pki();
        let outsider = TlsSection {
            cert: other.tls.cert.clone(),
            key: other.tls.key.clone(),
            ..mutual.clone()
        };
        let outsider = RemoteReward::new(&address, &token, Some(&outsider)).unwrap();
        assert!(
            matches!(
                outsider.score(samples()).await,
                Err(RoleError::Unavailable { .. })
            ),
            "a client certificate from another CA must be refused"
        );
    }

    #[tokio::test]
    async fn plain_tcp_round_trip_without_tls() {
        let token = Token::generate();
        let address = serve_reward(None, &token).await;
        let remote = RemoteReward::new(&format!("http://{address}"), &token, None).unwrap();
        assert_eq!(remote.score(samples()).await.unwrap().len(), 3);
    }

    #[test]
    fn missing_or_wrong_files_name_the_recipe_key_and_the_path() {
        let pki = make_pki();
        let missing = TlsSection {
            cert: "/nonexistent/worker.pem".into(),
            ..pki.tls.clone()
        };
        let message = server_builder(Some(&missing)).unwrap_err().to_string();
        assert!(
            message.starts_with("cannot read `cluster.tls.cert` (/nonexistent/worker.pem): "),
            "{message}"
        );

        let no_ca = TlsSection {
            ca: "/nonexistent/ca.pem".into(),
            ..pki.tls.clone()
        };
        let message = channel("127.0.0.1:1", Some(&no_ca)).unwrap_err().to_string();
        assert!(
            message.starts_with("cannot read `cluster.tls.ca` (/nonexistent/ca.pem): "),
            "{message}"
        );

        // The key where the certificate should be: read, but not a certificate.
        let swapped = TlsSection {
            cert: pki.tls.key.clone(),
            ..pki.tls.clone()
        };
        let message = server_builder(Some(&swapped)).unwrap_err().to_string();
        assert_eq!(
            message,
            format!(
                "`cluster.tls.cert` ({}) holds no PEM CERTIFICATE; give a PEM file \
                 (`-----BEGIN CERTIFICATE-----`)",
                pki.tls.key
            )
        );

        // A key that does not belong to the certificate is refused by rustls up front.
        let other = make_pki();
        let mismatched = TlsSection {
            key: other.tls.key.clone(),
            ..pki.tls.clone()
        };
        let message = server_builder(Some(&mismatched)).unwrap_err().to_string();
        assert!(
            message.starts_with("cannot set up TLS with `cluster.tls`"),
            "{message}"
        );
    }

    #[test]
    fn uris_follow_the_tls_setting() {
        let pki = make_pki();
        assert_eq!(worker_uri("127.0.0.1:7001", None), "http://127.0.0.1:7001");
        assert_eq!(
            worker_uri("http://127.0.0.1:7001", Some(&pki.tls)),
            "https://127.0.0.1:7001"
        );
        assert_eq!(worker_uri("https://[::1]:7001", None), "http://[::1]:7001");
        let message = endpoint("bad host:7001", None).unwrap_err().to_string();
        assert!(
            message.starts_with("bad worker address `bad host:7001`"),
            "{message}"
        );
    }
}
