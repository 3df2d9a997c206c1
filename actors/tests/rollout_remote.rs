//! The rollout role over gRPC, with a real tonic server on loopback in this process and tiny
//! random Llamas on the CPU plugin: a remote worker generates exactly what an in-process
//! engine with the same weights and seeds does, takes streamed weight updates (f32 and, through
//! conversion, bf16), refuses corrupt or short updates and foreign tokens while keeping its
//! weights, reports a dead worker as unavailable, and a worker that missed an update is
//! brought up to date before it generates again.

use actors::auth::Token;
use actors::proto;
use actors::roles::rollout::{LocalRollout, RemoteRollout, RolloutRole, RolloutService, WeightUpdate};
use actors::roles::RoleError;
use actors::worker::Worker;
use model::{param_table, random_init, ModelConfig, ModelWeights};
use rollout::{upload_weights, Engine, EngineConfig, GenerationRequest, Sample, SamplingParams};
use std::net::SocketAddr;
use testkit::client;
use xla::runtime::Buffer;
use xla::DType;

fn buffers(weights: &ModelWeights, dtype: DType) -> Vec<Buffer> {
    upload_weights(client(), weights, dtype, 0).unwrap()
}

fn engine(weights: &ModelWeights, dtype: DType, version: u64) -> Engine {
    Engine::new(
        client(),
        &weights.config,
        buffers(weights, dtype),
        version,
        EngineConfig::new(4, 64),
        None,
    )
    .unwrap()
}

/// A worker served by its own runtime, so "killing" it drops its connections at once.
struct TestWorker {
    runtime: Option<tokio::runtime::Runtime>,
    address: String,
    port: u16,
}

impl TestWorker {
    fn start(weights: &ModelWeights, dtype: DType, token: &Token, port: u16) -> TestWorker {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let service = RolloutService::new(
            LocalRollout::new(engine(weights, dtype, 0)),
            client().clone(),
            &weights.config,
            dtype,
            0,
            1,
        );
        let listen: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        // A killed worker's port frees up a moment after its runtime is told to stop.
        let mut service = Some(service);
        let worker = runtime.block_on(async {
            for _ in 0..100 {
                match tokio::net::TcpListener::bind(listen).await {
                    Ok(probe) => drop(probe),
                    Err(_) => {
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                }
                return Worker::bind_rollout(listen, token.clone(), service.take().unwrap())
                    .await
                    .unwrap();
            }
            panic!("{listen} stayed busy")
        });
        let address = worker.local_addr().unwrap();
        runtime.spawn(worker.serve(std::future::pending()));
        TestWorker {
            runtime: Some(runtime),
            address: format!("http://{address}"),
            port: address.port(),
        }
    }

    fn kill(&mut self) {
        if let Some(r) = self.runtime.take() {
            r.shutdown_background();
        }
    }
}

impl Drop for TestWorker {
    fn drop(&mut self) {
        self.kill();
    }
}

fn requests(first_id: u64) -> Vec<GenerationRequest> {
    vec![
        GenerationRequest {
            id: first_id,
            prompt: vec![3, 7, 1, 9, 4],
            n: 1,
            seed: 0,
            params: SamplingParams::greedy(12),
            multi_turn: None,
        },
        GenerationRequest {
            id: first_id + 1,
            prompt: vec![12, 30, 2],
            n: 3,
            seed: 42,
            params: SamplingParams {
                temperature: 1.0,
                max_new_tokens: 9,
                ..Default::default()
            },
            multi_turn: None,
        },
    ]
}

/// The samples of one `generate` call, by (request id, sample index).
async fn generate(
    role: &dyn RolloutRole,
    requests: Vec<GenerationRequest>,
) -> Result<Vec<Sample>, RoleError> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let result = role.generate(requests, tx).await;
    let mut samples = Vec::new();
    while let Ok(s) = rx.try_recv() {
        samples.push(s);
    }
    samples.sort_by_key(|s| (s.request_id, s.sample_index));
    result.map(|_| samples)
}

fn same(a: &[Sample], b: &[Sample]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(format!("{x:?}"), format!("{y:?}"));
    }
}

/// Every tensor of `weights` as f32 chunks of at most `piece` bytes, as a client would send them.
fn chunks(weights: &ModelWeights, version: u64, piece: usize) -> Vec<proto::WeightChunk> {
    let table = param_table(&weights.config);
    let mut out = Vec::new();
    for (index, spec) in table.iter().enumerate() {
        let bytes: Vec<u8> = weights
            .get(&spec.name)
            .unwrap()
            .to_f32_vec()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        for (k, data) in bytes.chunks(piece).enumerate() {
            out.push(proto::WeightChunk {
                version,
                tensor_count: table.len() as u32,
                tensor_index: index as u32,
                tensor_name: spec.name.clone(),
                dtype: "f32".into(),
                dims: spec.shape.iter().map(|&d| d as i64).collect(),
                offset: (k * piece) as u64,
                crc32: crc32fast::hash(data),
                data: data.to_vec().into(),
            });
        }
    }
    out
}

async fn raw_update(
    address: &str,
    token: &Token,
    chunks: Vec<proto::WeightChunk>,
) -> Result<proto::UpdateWeightsReply, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(address.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = proto::rollout_client::RolloutClient::with_interceptor(channel, token.attach());
    client
        .update_weights(tokio_stream::iter(chunks))
        .await
        .map(|r| r.into_inner())
}

#[test]
fn remote_rollout_matches_local_takes_weights_and_refuses_bad_updates() {
    let token = Token::generate();
    let a = random_init(&ModelConfig::tiny_llama(), 1);
    let b = random_init(&ModelConfig::tiny_llama(), 2);
    let worker = TestWorker::start(&a, DType::F32, &token, 0);
    let local_a = LocalRollout::new(engine(&a, DType::F32, 0));
    let local_b = LocalRollout::new(engine(&b, DType::F32, 1));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let remote = RemoteRollout::new(&worker.address, &token, None).unwrap();
        assert_eq!(remote.refresh().await.unwrap(), 0);
        assert_eq!(remote.location(), worker.address);

        let expected = generate(&local_a, requests(1)).await.unwrap();
        assert_eq!(expected.len(), 4);
        let got = generate(&remote, requests(1)).await.unwrap();
        same(&got, &expected);
        assert!(got.iter().all(|s| s.weight_version == 0));

        // New weights: the worker now generates what an engine over them does.
        let update = WeightUpdate {
            version: 1,
            params: buffers(&b, DType::F32).into(),
        };
        let sent = remote.update_weights(update).await.unwrap();
        let model_bytes: usize = param_table(&b.config).iter().map(|p| p.numel() * 4).sum();
        assert_eq!(sent, model_bytes as u64, "the bytes of tensor data sent");
        assert_eq!(remote.weight_version(), 1);
        let expected_b = generate(&local_b, requests(10)).await.unwrap();
        let got = generate(&remote, requests(10)).await.unwrap();
        same(&got, &expected_b);
        assert!(got.iter().all(|s| s.weight_version == 1));
        assert_ne!(
            format!("{:?}", expected_b[0].response_ids),
            format!("{:?}", expected[0].response_ids),
            "the two random models should answer differently"
        );

        // A chunk corrupted in transit: the whole update is refused, version 1 stays.
        let mut bad = chunks(&a, 2, 1000);
        let victim = bad.len() / 2;
        let mut corrupted = bad[victim].data.to_vec();
        corrupted[17] ^= 0x01;
        bad[victim].data = corrupted.into();
        let status = raw_update(&worker.address, &token, bad).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::DataLoss);
        assert!(
            status
                .message()
                .starts_with("weight update to version 2 refused, version 1 stays: tensor")
                && status.message().contains("fails its CRC-32 check"),
            "{}",
            status.message()
        );
        // A stream that stops early: refused, version 1 stays.
        let mut short = chunks(&a, 2, 1000);
        short.truncate(short.len() - 1);
        let status = raw_update(&worker.address, &token, short).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::DataLoss);
        assert!(
            status.message().contains("the stream ended with")
                && status.message().contains("version 1 stays"),
            "{}",
            status.message()
        );
        assert_eq!(remote.refresh().await.unwrap(), 1);
        same(&generate(&remote, requests(10)).await.unwrap(), &expected_b);

        // A whole, good stream sent in small pieces is taken.
        let reply = raw_update(&worker.address, &token, chunks(&a, 3, 1000))
            .await
            .unwrap();
        assert_eq!(reply.version, 3);
        assert_eq!(remote.refresh().await.unwrap(), 3);

        // Buffers of another model are refused before anything is sent.
        let mut wide = ModelConfig::tiny_llama();
        wide.hidden_size = 40;
        wide.head_dim = 10;
        let other = WeightUpdate {
            version: 4,
            params: buffers(&random_init(&wide, 1), DType::F32).into(),
        };
        match remote.update_weights(other).await {
            Err(RoleError::Invalid(m)) => assert!(
                m.starts_with("weight update 4: tensor 0 `model.embed_tokens.weight` has shape [32, 40]"),
                "{m}"
            ),
            other => panic!("expected a refusal, got {other:?}"),
        }

        // Callers with another run's token get nothing.
        let intruder = RemoteRollout::new(&worker.address, &Token::generate(), None).unwrap();
        for result in [
            generate(&intruder, requests(20)).await.map(|_| ()),
            intruder
                .update_weights(WeightUpdate {
                    version: 9,
                    params: buffers(&b, DType::F32).into(),
                })
                .await
                .map(drop),
        ] {
            match result {
                Err(RoleError::Refused { message, .. }) => {
                    assert!(message.starts_with("wrong token"), "{message}")
                }
                other => panic!("expected a refusal, got {other:?}"),
            }
        }
        assert_eq!(remote.refresh().await.unwrap(), 3);
    });
}

#[test]
fn a_bf16_worker_takes_f32_weights_converted_on_the_way() {
    let token = Token::generate();
    let a = random_init(&ModelConfig::tiny_llama(), 3);
    let b = random_init(&ModelConfig::tiny_llama(), 4);
    let worker = TestWorker::start(&a, DType::BF16, &token, 0);
    let local_b = LocalRollout::new(engine(&b, DType::BF16, 5));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let remote = RemoteRollout::new(&worker.address, &token, None).unwrap();
        remote
            .update_weights(WeightUpdate {
                version: 5,
                params: buffers(&b, DType::F32).into(),
            })
            .await
            .unwrap();
        let expected = generate(&local_b, requests(1)).await.unwrap();
        let got = generate(&remote, requests(1)).await.unwrap();
        same(&got, &expected);
        assert!(got.iter().all(|s| s.weight_version == 5));
    });
}

#[test]
fn a_dead_worker_is_unavailable_and_its_replacement_is_brought_up_to_date() {
    let token = Token::generate();
    let a = random_init(&ModelConfig::tiny_llama(), 5);
    let b = random_init(&ModelConfig::tiny_llama(), 6);
    let mut worker = TestWorker::start(&a, DType::F32, &token, 0);
    let local_b = LocalRollout::new(engine(&b, DType::F32, 7));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let remote = runtime.block_on(async { RemoteRollout::new(&worker.address, &token, None).unwrap() });
    runtime.block_on(async {
        remote
            .update_weights(WeightUpdate {
                version: 7,
                params: buffers(&b, DType::F32).into(),
            })
            .await
            .unwrap();

        // Plenty of work: 24 groups of 2 samples x 60 tokens on 4 slots.
        let long: Vec<GenerationRequest> = (0..24)
            .map(|i| GenerationRequest {
                id: 100 + i,
                prompt: vec![1, 2, 3],
                n: 2,
                seed: i,
                params: SamplingParams {
                    temperature: 1.0,
                    max_new_tokens: 60,
                    ..Default::default()
                },
                multi_turn: None,
            })
            .collect();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let call = remote.generate(long, tx);
        tokio::pin!(call);
        let first = tokio::select! {
            s = rx.recv() => s.expect("a first sample"),
            r = &mut call => panic!("the call ended before a sample arrived: {r:?}"),
        };
        assert_eq!(first.weight_version, 7);
        worker.kill();
        match call.await {
            Err(RoleError::Unavailable { role, address, .. }) => {
                assert_eq!(role, "rollout");
                assert_eq!(address, worker.address);
            }
            other => panic!("expected the worker to be unavailable, got {other:?}"),
        }
        let mut delivered = 1;
        while rx.try_recv().is_ok() {
            delivered += 1;
        }
        assert!(delivered < 48, "the kill came too late to test anything");
    });

    // A replacement on the same address starts with the recipe's weights (version 0); the
    // client sends it version 7 before it generates.
    let replacement = TestWorker::start(&a, DType::F32, &token, worker.port);
    assert_eq!(replacement.address, worker.address);
    runtime.block_on(async {
        let expected = generate(&local_b, requests(1)).await.unwrap();
        let got = generate(&remote, requests(1)).await.unwrap();
        same(&got, &expected);
        assert!(got.iter().all(|s| s.weight_version == 7));
        assert_eq!(remote.refresh().await.unwrap(), 7);
    });
}
