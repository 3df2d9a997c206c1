//! Every RPC of every service `grpo` serves, called without the run's token: a rollout, a
//! reward and a learner worker process and the orchestrator's registry each refuse every method
//! (`Unauthenticated`, "missing token") before doing any of its work. The list of methods is
//! checked against `proto/grpo.proto`, so a method added later without a case here fails.
//! With the token, a request over a service's size limit is refused and the worker keeps
//! serving.

mod common;

use actors::auth::Token;
use actors::launcher::ray::registry::Registry;
use actors::proto;
use common::*;
use tonic::transport::Channel;

/// The `rpc` lines of the protocol, as `Service.Method`.
fn declared_methods() -> Vec<String> {
    let text = include_str!("../actors/proto/grpo.proto");
    let mut service = String::new();
    let mut out = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("service ") {
            service = rest.trim_end_matches(" {").trim().to_string();
        } else if let Some(rest) = line.strip_prefix("rpc ") {
            let method = rest.split('(').next().unwrap().trim();
            out.push(format!("{service}.{method}"));
        }
    }
    out.sort();
    out
}

async fn channel(address: &str) -> Channel {
    Channel::from_shared(address.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connecting to {address}: {e}"))
}

/// The call of a streaming-request method, with one empty message.
fn one<T: Send + 'static>(message: T) -> impl tonic::IntoStreamingRequest<Message = T> {
    tokio_stream::iter(vec![message])
}

#[test]
fn every_method_of_every_service_refuses_a_call_without_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 8, 2);
    let recipe = tiny_recipe(
        dir.path(),
        "r.yaml",
        &model,
        &train,
        &val,
        &dir.path().join("out"),
        1,
        "",
    );
    let token = Token::generate();
    let token_file = dir.path().join("token");
    token.write(&token_file).unwrap();
    let start = |role: &str| {
        let mut w = WorkerProcess::start(&mut worker(role, &recipe, &token_file));
        let address = w.loopback_address();
        (w, address)
    };
    let (_rollout, rollout) = start("rollout");
    let (_reward, reward) = start("reward");
    let (_learner, learner) = start("learner");

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let called = runtime.block_on(async {
        let registry = Registry::serve("127.0.0.1", token.clone(), None, env!("CARGO_PKG_VERSION"))
            .await
            .unwrap();
        let mut called = Vec::new();
        let mut check = |name: &str, result: Result<(), tonic::Status>| {
            assert_missing_token(result.map_err(|s| {
                assert_eq!(s.code(), tonic::Code::Unauthenticated, "{name}: {s:?}");
                s
            }));
            called.push(name.to_string());
        };

        for address in [&rollout, &reward, &learner] {
            let mut c = proto::worker_client::WorkerClient::new(channel(address).await);
            check("Worker.Health", c.health(proto::HealthRequest {}).await.map(drop));
        }

        let mut c = proto::reward_client::RewardClient::new(channel(&reward).await);
        check(
            "Reward.Score",
            c.score(proto::ScoreRequest::default()).await.map(drop),
        );

        let mut c = proto::rollout_client::RolloutClient::new(channel(&rollout).await);
        check(
            "Rollout.Generate",
            c.generate(proto::GenerateRequest::default()).await.map(drop),
        );
        check(
            "Rollout.UpdateWeights",
            c.update_weights(one(proto::WeightChunk::default()))
                .await
                .map(drop),
        );
        check(
            "Rollout.WeightVersion",
            c.weight_version(proto::WeightVersionRequest {}).await.map(drop),
        );

        let mut c = proto::learner_client::LearnerClient::new(channel(&learner).await);
        check(
            "Learner.Start",
            c.start(one(proto::LearnerStateMessage::default()))
                .await
                .map(drop),
        );
        check(
            "Learner.Update",
            c.update(proto::LearnerUpdateRequest::default()).await.map(drop),
        );
        check(
            "Learner.Weights",
            c.weights(proto::LearnerWeightsRequest::default()).await.map(drop),
        );
        check(
            "Learner.State",
            c.state(proto::LearnerStateRequest {}).await.map(drop),
        );

        let mut c = proto::registry_client::RegistryClient::new(channel(&registry.address()).await);
        check(
            "Registry.Register",
            c.register(proto::RegisterRequest::default()).await.map(drop),
        );
        check(
            "Registry.Heartbeat",
            c.heartbeat(proto::HeartbeatRequest::default()).await.map(drop),
        );
        assert!(
            registry.registrations().is_empty(),
            "an anonymous caller registered"
        );

        // With the token, a request larger than its service takes is refused before it is
        // decoded, and the worker goes on serving.
        let too_big = |what: &str, result: Result<(), tonic::Status>| {
            let status = result.expect_err(what);
            assert!(
                matches!(
                    status.code(),
                    tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
                ),
                "{what}: {status:?}"
            );
        };
        let mut c =
            proto::reward_client::RewardClient::with_interceptor(channel(&reward).await, token.attach());
        let huge = proto::ScoreRequest {
            samples: vec![proto::RewardSample {
                response: "x".repeat(257 << 20),
                ..Default::default()
            }],
        };
        too_big("Reward.Score of 257 MiB", c.score(huge).await.map(drop));
        let mut c =
            proto::rollout_client::RolloutClient::with_interceptor(channel(&rollout).await, token.attach());
        let huge = proto::GenerateRequest {
            requests: vec![proto::GenerationRequest {
                prompt: vec![u32::MAX; 17 << 20],
                n: 1,
                ..Default::default()
            }],
            min_weight_version: 0,
        };
        too_big("Rollout.Generate of 85 MiB", c.generate(huge).await.map(drop));
        let mut c =
            proto::learner_client::LearnerClient::with_interceptor(channel(&learner).await, token.attach());
        let huge = proto::LearnerUpdateRequest {
            rows: vec![proto::LearnerRow {
                rollout_log_probs: vec![0.0; 65 << 20],
                ..Default::default()
            }],
        };
        too_big("Learner.Update of 260 MiB", c.update(huge).await.map(drop));
        let mut c = proto::registry_client::RegistryClient::with_interceptor(
            channel(&registry.address()).await,
            token.attach(),
        );
        let huge = proto::RegisterRequest {
            worker_id: "w".repeat(5 << 20),
            ..Default::default()
        };
        too_big("Registry.Register of 5 MiB", c.register(huge).await.map(drop));
        for address in [&rollout, &reward, &learner] {
            let mut c =
                proto::worker_client::WorkerClient::with_interceptor(channel(address).await, token.attach());
            c.health(proto::HealthRequest {})
                .await
                .unwrap_or_else(|s| panic!("{address} stopped serving after an oversized request: {s:?}"));
        }
        called
    });
    let mut called: Vec<String> = called.into_iter().collect();
    called.sort();
    called.dedup();
    assert_eq!(called, declared_methods(), "every declared method is walked");
}
