//! A reward worker as a real process over loopback gRPC: it scores exactly as the in-process
//! role does, and refuses callers without the run's token.

mod common;

use actors::auth::Token;
use actors::proto;
use actors::roles::reward::{LocalReward, RemoteReward, RewardRole};
use common::WorkerProcess;
use reward::{RewardConfig, Sample};
use std::sync::Arc;

fn start_worker(token_file: &std::path::Path) -> (WorkerProcess, String) {
    let mut worker = WorkerProcess::start(&mut common::worker(
        "reward",
        "recipes/quickstart.yaml",
        token_file,
    ));
    let address = worker.loopback_address();
    (worker, address)
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
            prompt: serde_json::Value::Null,
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
    let (_worker, address) = start_worker(&token_file);

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

        let remote = RemoteReward::new(&address, &token, None).unwrap();
        let got = remote.score(samples()).await.unwrap();
        assert_eq!(got, expected);

        // A caller holding another run's token is refused, and so is one without a token.
        let intruder = RemoteReward::new(&address, &Token::generate(), None).unwrap();
        common::assert_wrong_token(intruder.score(samples()).await);
        let mut anonymous = proto::reward_client::RewardClient::connect(address.clone())
            .await
            .unwrap();
        common::assert_missing_token(anonymous.score(proto::ScoreRequest { samples: vec![] }).await);
    });
}
