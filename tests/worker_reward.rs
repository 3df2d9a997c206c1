//! A reward worker as a real process over loopback gRPC: it scores exactly as the in-process
//! role does, and refuses callers without the run's token.

mod common;

use actors::auth::Token;
use actors::proto;
use actors::roles::reward::{LocalReward, RemoteReward, RewardRole};
use reward::{RewardConfig, Sample};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

/// The worker process; killed when the test ends, pass or fail.
struct WorkerProcess {
    child: Child,
    address: String,
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_worker(token_file: &std::path::Path) -> WorkerProcess {
    let mut child = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args([
            "worker",
            "--role",
            "reward",
            "--recipe",
            "recipes/quickstart.yaml",
            "--token-file",
        ])
        .arg(token_file)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("start grpo worker");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let address = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("worker said {line:?}"));
    assert!(
        address.starts_with("127.0.0.1:"),
        "binds loopback by default: {address}"
    );
    WorkerProcess {
        address: format!("http://{address}"),
        child,
    }
}

fn samples() -> Vec<Sample> {
    let answers = [
        "#### 42",
        "<answer>41</answer>",
        "no idea",
        "#### 4,2",
        "<answer> 42. </answer>",
    ];
    answers
        .iter()
        .enumerate()
        .map(|(i, a)| Sample {
            id: i as u64,
            data_source: if i % 2 == 0 {
                "grpo/arithmetic"
            } else {
                "openai/gsm8k"
            }
            .into(),
            response: a.to_string(),
            ground_truth: "42".into(),
            extra: serde_json::json!({"index": i}),
            response_length: 8,
            truncated: false,
        })
        .collect()
}

#[test]
fn remote_reward_scores_like_local_and_checks_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let token = Token::generate();
    let token_file = dir.path().join("token");
    token.write(&token_file).unwrap();
    let worker = start_worker(&token_file);

    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let config = RewardConfig::default();
        let local = LocalReward::new(
            Arc::new(config.build(Some(48)).unwrap()),
            config.pool_options().unwrap(),
        );
        let expected = local.score(samples()).await.unwrap();
        assert_eq!(
            expected.iter().map(|s| s.score).collect::<Vec<_>>(),
            vec![1.0, 0.0, 0.0, 1.0, 1.0]
        );

        let remote = RemoteReward::new(&worker.address, &token, None).unwrap();
        let got = remote.score(samples()).await.unwrap();
        assert_eq!(got, expected);

        // A caller holding another run's token is refused, and so is one without a token.
        let intruder = RemoteReward::new(&worker.address, &Token::generate(), None).unwrap();
        common::assert_wrong_token(intruder.score(samples()).await);
        let mut anonymous = proto::reward_client::RewardClient::connect(worker.address.clone())
            .await
            .unwrap();
        common::assert_missing_token(anonymous.score(proto::ScoreRequest { samples: vec![] }).await);
    });
}
