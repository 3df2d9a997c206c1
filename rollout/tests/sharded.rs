//! The rollout engine split over 1, 2 and 4 CPU devices (data parallel over its KV-cache
//! slots) and the on-device weight handoff, with a tiny random Llama:
//!
//! - the same requests (greedy, plain sampling, top-k/top-p, groups sharing a prefill, more
//!   requests than slots, a chunked cache with batched prefill) give the same tokens on 1, 2
//!   and 4 devices, and log-probs equal within 1e-5;
//! - `max_num_seqs` that does not divide by the devices is refused by name;
//! - the handoff from a learner-like layout (replicated, or split on the first dimension that
//!   divides by 4, f32) to replicated f32 or bf16 replicas runs on the devices: no host
//!   transfer, values equal to the host's conversion, and a replicated same-dtype layout is
//!   shared in place; an engine on those replicas generates the single-device tokens.

mod common;

use common::{generate, request, sampled};

use std::sync::Arc;

use model::{param_table, random_init, ModelConfig, ModelWeights};
use rollout::{
    handoff, upload_weights, Engine, EngineConfig, EngineWeights, GenerationRequest, Sample, SamplingParams,
    SourceParams,
};
use xla::graph::{Mesh, Sharding};
use xla::runtime::{Buffer, Client};

fn client() -> &'static Client {
    testkit::cpu_client(4)
}
use xla::DType;

/// Replicas of `weights` in `dtype` on devices `0..devices`.
fn replicas(weights: &ModelWeights, dtype: DType, devices: usize) -> EngineWeights {
    replicas_on(client(), weights, dtype, devices)
}

fn replicas_on(client: &Client, weights: &ModelWeights, dtype: DType, devices: usize) -> EngineWeights {
    EngineWeights::replicated(
        (0..devices)
            .map(|d| Arc::from(upload_weights(client, weights, dtype, d).unwrap()))
            .collect(),
    )
}

/// More samples (4 + 3 + 2 + 1 + 4 + 2 = 16) than the 8 slots, so slots are freed and
/// retaken; greedy, plain sampling and top-k/top-p; prompts of 2 to 12 tokens.
fn requests() -> Vec<GenerationRequest> {
    vec![
        request(1, &[3, 7, 1, 9, 4], 4, 11, sampled(1.0, 0, 1.0, 9)),
        request(2, &[12, 30, 2], 3, 12, SamplingParams::greedy(7)),
        request(
            3,
            &[5, 5, 6, 1, 0, 8, 2, 9, 14, 3, 3, 7],
            2,
            13,
            sampled(0.8, 5, 0.9, 11),
        ),
        request(4, &[20, 21], 1, 14, sampled(1.3, 0, 0.7, 6)),
        request(5, &[1, 2, 3, 4, 5, 6, 7], 4, 15, sampled(1.0, 0, 1.0, 12)),
        request(6, &[9, 8, 7, 6], 2, 16, SamplingParams::greedy(10)),
    ]
}

fn assert_same_samples(got: &[Sample], expected: &[Sample], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: sample count");
    for (g, e) in got.iter().zip(expected) {
        let at = format!("{what}: request {} sample {}", e.request_id, e.sample_index);
        assert_eq!(
            (g.request_id, g.sample_index),
            (e.request_id, e.sample_index),
            "{at}"
        );
        assert_eq!(g.response_ids, e.response_ids, "{at}: tokens");
        assert_eq!(g.finish_reason, e.finish_reason, "{at}: finish reason");
        for (i, (a, b)) in g.logprobs.iter().zip(&e.logprobs).enumerate() {
            assert!((a - b).abs() <= 1e-5, "{at}: log-prob {i}: {a} vs {b}");
        }
    }
}

#[test]
fn one_two_and_four_devices_give_the_same_tokens() {
    let weights = random_init(&ModelConfig::tiny_llama(), 21);
    let config = &weights.config;
    for (kv_chunk, prefill_batch) in [(0, 1), (8, 2)] {
        let make = |devices: usize| {
            let mut settings = EngineConfig::new(8, 32);
            settings.kv_chunk = kv_chunk;
            settings.prefill_batch = prefill_batch;
            Engine::new(
                client(),
                config,
                replicas(&weights, DType::F32, devices),
                3,
                settings,
                None,
            )
            .unwrap()
        };
        let mut one = make(1);
        assert_eq!(one.devices(), 1);
        let expected = generate(&mut one, &requests());
        assert_eq!(expected.len(), 16);
        assert!(
            expected.iter().any(|s| s.response_ids.len() > 8),
            "long enough to read several cache chunks"
        );
        for devices in [2, 4] {
            let mut engine = make(devices);
            assert_eq!(engine.devices(), devices);
            assert_eq!(engine.kv_cache_bytes(), one.kv_cache_bytes());
            let got = generate(&mut engine, &requests());
            let what = format!("{devices} devices, kv_chunk {kv_chunk}, prefill_batch {prefill_batch}");
            assert_same_samples(&got, &expected, &what);
            assert!(got.iter().all(|s| s.weight_version == 3));
            assert_eq!(
                engine.stats().prefill_runs,
                one.stats().prefill_runs,
                "{what}: one prefill per group"
            );
        }
    }
}

#[test]
fn hot_swap_on_several_devices_follows_the_new_weights() {
    let (w1, w2) = (
        random_init(&ModelConfig::tiny_llama(), 31),
        random_init(&ModelConfig::tiny_llama(), 32),
    );
    let config = &w1.config;
    let reqs = [request(1, &[4, 9, 2], 2, 5, sampled(1.0, 0, 1.0, 6))];
    let expected = {
        let mut one = Engine::new(
            client(),
            config,
            replicas(&w2, DType::F32, 1),
            7,
            EngineConfig::new(4, 16),
            None,
        )
        .unwrap();
        generate(&mut one, &reqs)
    };
    let mut engine = Engine::new(
        client(),
        config,
        replicas(&w1, DType::F32, 2),
        6,
        EngineConfig::new(4, 16),
        None,
    )
    .unwrap();
    engine.update_weights(7, replicas(&w2, DType::F32, 2)).unwrap();
    let got = generate(&mut engine, &reqs);
    assert_same_samples(&got, &expected, "after the swap");
    assert!(got.iter().all(|s| s.weight_version == 7));
    // Replicas for another device count are refused by name.
    let err = engine
        .update_weights(8, replicas(&w2, DType::F32, 1))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("replicas for 1 device(s) were given; the engine runs on 2 ([0, 1])"),
        "{err}"
    );
}

#[test]
fn slots_that_do_not_split_over_the_devices_are_refused() {
    let weights = random_init(&ModelConfig::tiny_llama(), 2);
    let err = Engine::new(
        client(),
        &weights.config,
        replicas(&weights, DType::F32, 4),
        0,
        EngineConfig::new(6, 16),
        None,
    )
    .err()
    .expect("6 slots do not split over 4 devices")
    .to_string();
    assert!(
        err.contains("rollout.max_num_seqs = 6 must divide by the 4 devices the rollout runs on"),
        "{err}"
    );
    assert!(err.contains("use a multiple of 4"), "{err}");
}

/// The learner's `fsdp` rule: split each tensor on its first dimension that divides by the
/// mesh, whole when none does.
fn fsdp_sharding(dims: &[i64], devices: usize) -> Option<Sharding> {
    dims.iter()
        .position(|d| d % devices as i64 == 0)
        .map(|dim| Sharding::split(dims.len(), dim, "data"))
}

/// Device `d`'s block of `values` (shape `dims`) split as `sharding` says over `devices`.
fn shard(
    values: &[f32],
    dims: &[i64],
    sharding: Option<&Sharding>,
    devices: usize,
    d: usize,
) -> (Vec<f32>, Vec<i64>) {
    let Some(dim) = sharding.and_then(|s| s.dims().iter().position(|a| !a.is_empty())) else {
        return (values.to_vec(), dims.to_vec());
    };
    let outer: i64 = dims[..dim].iter().product();
    let inner: i64 = dims[dim + 1..].iter().product();
    let chunk = dims[dim] as usize / devices;
    let mut local = dims.to_vec();
    local[dim] /= devices as i64;
    let mut out = Vec::new();
    for o in 0..outer as usize {
        let start = (o * dims[dim] as usize + d * chunk) * inner as usize;
        out.extend_from_slice(&values[start..start + chunk * inner as usize]);
    }
    (out, local)
}

/// f32 parameters laid out over `devices` as a `dp` (`split` off) or `fsdp` learner would.
fn learner_layout(client: &Client, weights: &ModelWeights, devices: usize, split: bool) -> SourceParams {
    let table = param_table(&weights.config);
    let dims: Vec<Vec<i64>> = table
        .iter()
        .map(|s| s.shape.iter().map(|&d| d as i64).collect())
        .collect();
    let shardings: Vec<Option<Sharding>> = dims
        .iter()
        .map(|d| if split { fsdp_sharding(d, devices) } else { None })
        .collect();
    let per_device = (0..devices)
        .map(|d| {
            let buffers: Vec<Buffer> = table
                .iter()
                .zip(&dims)
                .zip(&shardings)
                .map(|((spec, dims), sharding)| {
                    let values = weights.get(&spec.name).unwrap().to_f32_vec();
                    let (part, local) = shard(&values, dims, sharding.as_ref(), devices, d);
                    client.buffer_from_host(&part, &local, d).unwrap()
                })
                .collect();
            Arc::from(buffers)
        })
        .collect();
    SourceParams {
        mesh: (devices > 1).then(|| Mesh::new(&[("data", devices)])),
        per_device,
        shardings,
        dims,
    }
}

#[test]
fn the_handoff_gathers_and_converts_on_the_devices() {
    // A client of its own: its transfer counters see this test's work only.
    let own = Client::cpu(4).unwrap();
    let client = &own;
    let weights = random_init(&ModelConfig::tiny_llama(), 41);
    let table = param_table(&weights.config);
    let host: Vec<Vec<f32>> = table
        .iter()
        .map(|s| weights.get(&s.name).unwrap().to_f32_vec())
        .collect();

    // fsdp over 4 devices, f32 masters -> bf16 replicas: every parameter of this model splits.
    let fsdp = learner_layout(client, &weights, 4, true);
    assert!(fsdp.shardings.iter().all(|s| s.is_some()));
    let before = client.transfer_stats();
    let bf16 = handoff(client, &fsdp, DType::BF16, false).unwrap();
    let moved = client.transfer_stats().since(&before);
    assert_eq!(
        (moved.host_transfers(), moved.host_bytes(), moved.device_to_device),
        (0, 0, 0),
        "{moved:?}"
    );
    assert_eq!(bf16.devices(), 4);
    for d in 0..4 {
        for (i, (b, values)) in bf16.replica(d).iter().zip(&host).enumerate() {
            assert_eq!(b.device(), d);
            assert_eq!(b.dims(), fsdp.dims[i].as_slice());
            let got = b.to_host::<half::bf16>().unwrap();
            let want: Vec<half::bf16> = values.iter().map(|&v| half::bf16::from_f32(v)).collect();
            assert_eq!(got, want, "device {d} parameter {} ({})", i, table[i].name);
        }
    }
    // fsdp -> f32: the gathered masters, bit for bit.
    let f32s = handoff(client, &fsdp, DType::F32, false).unwrap();
    for d in [0, 3] {
        for (b, values) in f32s.replica(d).iter().zip(&host) {
            assert_eq!(&b.to_host::<f32>().unwrap(), values);
        }
    }

    // dp, same dtype: shared in place, no program, no copy; `fresh` makes new buffers.
    let dp = learner_layout(client, &weights, 2, false);
    let before = client.transfer_stats();
    let shared = handoff(client, &dp, DType::F32, false).unwrap();
    let copied = handoff(client, &dp, DType::F32, true).unwrap();
    let moved = client.transfer_stats().since(&before);
    assert_eq!(
        (moved.host_transfers(), moved.device_to_device),
        (0, 0),
        "{moved:?}"
    );
    for d in 0..2 {
        assert!(Arc::ptr_eq(shared.replica(d), &dp.per_device[d]));
        assert!(!Arc::ptr_eq(copied.replica(d), &dp.per_device[d]));
        assert_eq!(copied.replica(d)[0].to_host::<f32>().unwrap(), host[0]);
    }

    // One device, f32 -> bf16: a single-device convert.
    let single = SourceParams::single(Arc::from(
        upload_weights(client, &weights, DType::F32, 0).unwrap(),
    ));
    let before = client.transfer_stats();
    let one = handoff(client, &single, DType::BF16, false).unwrap();
    assert_eq!(client.transfer_stats().since(&before).host_transfers(), 0);
    assert_eq!(one.devices(), 1);
    assert_eq!(one[0].dtype(), DType::BF16);

    // An engine over the gathered bf16 replicas generates what a single-device engine on
    // bf16 weights uploaded from the host generates.
    let reqs = [
        request(1, &[3, 7, 1, 9], 2, 9, sampled(1.0, 0, 1.0, 6)),
        request(2, &[2, 2, 8], 2, 0, SamplingParams::greedy(6)),
    ];
    let mut expected = Engine::new(
        client,
        &weights.config,
        replicas_on(client, &weights, DType::BF16, 1),
        0,
        EngineConfig::new(4, 16),
        None,
    )
    .unwrap();
    let expected = generate(&mut expected, &reqs);
    let mut engine = Engine::new(client, &weights.config, bf16, 0, EngineConfig::new(4, 16), None).unwrap();
    assert_same_samples(&generate(&mut engine, &reqs), &expected, "bf16 from the handoff");
}

#[test]
fn a_layout_that_does_not_fit_its_mesh_is_refused() {
    let weights = random_init(&ModelConfig::tiny_llama(), 3);
    let mut layout = learner_layout(client(), &weights, 2, true);
    layout.mesh = Some(Mesh::new(&[("data", 4)]));
    let err = handoff(client(), &layout, DType::F32, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("2 devices of parameters need a mesh of 2 devices"),
        "{err}"
    );
}
