//! `grpo run` with `cluster.tls` (mutual): the launched rollout and reward workers serve TLS
//! with the recipe's certificate and require it of their clients, the orchestrator (its health
//! checks, weight pushes, generate and score calls) dials them over https trusting the recipe's
//! CA and presenting the certificate, and the run computes exactly what the same run over plain
//! TCP computes. Such a worker refuses a plain-text client and a client without the
//! certificate.

mod common;

use actors::auth::Token;
use actors::recipe::TlsSection;
use actors::roles::reward::{RemoteReward, RewardRole};
use actors::roles::RoleError;
use common::*;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use std::path::Path;

/// A CA and a certificate for `localhost` signed by it, as PEM files in `dir`.
fn make_pki(dir: &Path) -> TlsSection {
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
    let path = |name: &str| dir.join(name).display().to_string();
    std::fs::write(path("ca.pem"), ca_cert.pem()).unwrap();
    std::fs::write(path("worker.pem"), leaf.pem()).unwrap();
    std::fs::write(path("worker.key"), leaf_key.serialize_pem()).unwrap();
    TlsSection {
        cert: path("worker.pem"),
        key: path("worker.key"),
        ca: path("ca.pem"),
        domain: "localhost".into(),
        mutual: false,
    }
}

fn tls_yaml(tls: &TlsSection) -> String {
    format!(
        "  tls:\n    cert: {}\n    key: {}\n    ca: {}\n    domain: {}\n    mutual: {}\n",
        tls.cert, tls.key, tls.ca, tls.domain, tls.mutual
    )
}

fn reward_sample() -> reward::Sample {
    reward::Sample {
        id: 0,
        data_source: "grpo/arithmetic".into(),
        prompt: serde_json::Value::Null,
        response: "<answer>42</answer>".into(),
        ground_truth: "42".into(),
        extra: serde_json::Value::Null,
        response_length: 5,
        truncated: false,
    }
}

#[test]
fn a_run_over_mutual_tls_matches_the_plain_run_and_its_workers_refuse_strangers() {
    let dir = tempfile::tempdir().unwrap();
    let tls = TlsSection {
        mutual: true,
        ..make_pki(dir.path())
    };
    let model = tiny_chat_model(dir.path());
    let train = arithmetic(dir.path(), "train", 1, 64);
    let val = arithmetic(dir.path(), "val", 2, 4);
    let workers = "cluster:\n  rollout_workers: 1\n  reward_workers: 1\n";
    let plain = dir.path().join("plain");
    let secure = dir.path().join("tls");
    let r_plain = tiny_recipe(dir.path(), "plain.yaml", &model, &train, &val, &plain, 2, workers);
    let r_tls = tiny_recipe(
        dir.path(),
        "tls.yaml",
        &model,
        &train,
        &val,
        &secure,
        2,
        &format!("{workers}{}", tls_yaml(&tls)),
    );
    for r in [&r_plain, &r_tls] {
        let o = grpo().arg("run").arg(r).arg("--quiet").output().unwrap();
        assert!(
            o.status.success(),
            "{}: {}",
            r.display(),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    assert_same_training(&plain, &secure, "plain vs TLS");
    for out in [&plain, &secure] {
        assert!(run_worker_pids(out, "rollout").is_empty() && run_worker_pids(out, "reward").is_empty());
    }

    // A reward worker of the TLS recipe, started as the launcher starts it.
    let token_file = dir.path().join("token");
    let token = Token::generate();
    token.write(&token_file).unwrap();
    let mut worker = WorkerProcess::start(&mut common::worker("reward", &r_tls, &token_file));
    let line = worker.line();
    let address = line
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("the worker said {line:?}"))
        .to_string();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let secure = RemoteReward::new(&address, &token, Some(&tls)).unwrap();
        let scored = secure.score(vec![reward_sample()]).await.unwrap();
        assert_eq!(scored.len(), 1);
        // Plain text never reaches the service: the TLS handshake fails first.
        let plain = RemoteReward::new(&address, &token, None).unwrap();
        match plain.score(vec![reward_sample()]).await {
            Err(RoleError::Unavailable { address: a, .. }) => {
                assert_eq!(a, format!("http://{address}"))
            }
            other => panic!("a plain-text client must be refused, got {other:?}"),
        }
        // Nor does a client that trusts the worker but presents no certificate.
        let anonymous = TlsSection {
            mutual: false,
            ..tls.clone()
        };
        let anonymous = RemoteReward::new(&address, &token, Some(&anonymous)).unwrap();
        assert!(
            matches!(
                anonymous.score(vec![reward_sample()]).await,
                Err(RoleError::Unavailable { .. })
            ),
            "a client without the certificate must be refused"
        );
    });
}
