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

use common::{
    answer, assert_identical, episode, generate, request, run_episodes, sampled, staggered_requests,
};

use std::sync::Arc;

use model::ParamLayout;
use model::{param_table, random_init, ModelConfig, ModelWeights, MODEL_AXIS};
use rollout::{
    handoff, upload_weights, upload_weights_on, Engine, EngineConfig, EngineWeights, GenerationRequest,
    Sample, SamplingParams, SourceParams,
};
use xla::graph::{shard_host, Mesh, Sharding};
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
        err.contains("weights for 1 device(s) were given; the engine runs on 2 ([0, 1])"),
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

/// f32 parameters laid out over `devices` as a `dp` (`split` off) or `fsdp` learner would.
fn learner_layout(client: &Client, weights: &ModelWeights, devices: usize, split: bool) -> SourceParams {
    let fsdp = split.then_some(("data", devices));
    let mesh = (devices > 1).then(|| Mesh::new(&[("data", devices)]));
    laid_out(
        client,
        weights,
        mesh,
        ParamLayout {
            fsdp,
            tensor_parallel: 1,
        },
    )
}

/// f32 parameters on the devices of `mesh` (one device without), laid out by `layout`.
fn laid_out(
    client: &Client,
    weights: &ModelWeights,
    mesh: Option<Mesh>,
    layout: ParamLayout,
) -> SourceParams {
    let table = param_table(&weights.config);
    let shardings: Vec<Option<Sharding>> = table.iter().map(|s| layout.sharding(s)).collect();
    let devices = mesh.as_ref().map_or(1, Mesh::num_devices);
    let per_device = (0..devices)
        .map(|d| {
            let buffers: Vec<Buffer> = table
                .iter()
                .zip(&shardings)
                .map(|(spec, sharding)| {
                    let values = weights.get(&spec.name).unwrap().to_f32_vec();
                    let (part, local) =
                        shard_host(&values, &spec.dims(), sharding.as_ref(), mesh.as_ref(), d);
                    client.buffer_from_host(&part, &local, d).unwrap()
                })
                .collect();
            Arc::from(buffers)
        })
        .collect();
    SourceParams {
        mesh,
        per_device,
        shardings,
        specs: table,
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
    let bf16 = handoff(client, &fsdp, DType::BF16, 1, false).unwrap();
    let moved = client.transfer_stats().since(&before);
    assert_eq!(
        (moved.host_transfers(), moved.host_bytes(), moved.device_to_device),
        (0, 0, 0),
        "{moved:?}"
    );
    assert_eq!(bf16.devices(), 4);
    for d in 0..4 {
        for (i, (b, values)) in bf16.device(d).iter().zip(&host).enumerate() {
            assert_eq!(b.device(), d);
            assert_eq!(b.dims(), fsdp.specs[i].dims().as_slice());
            let got = b.to_host::<half::bf16>().unwrap();
            let want: Vec<half::bf16> = values.iter().map(|&v| half::bf16::from_f32(v)).collect();
            assert_eq!(got, want, "device {d} parameter {} ({})", i, table[i].name);
        }
    }
    // fsdp -> f32: the gathered masters, bit for bit.
    let f32s = handoff(client, &fsdp, DType::F32, 1, false).unwrap();
    for d in [0, 3] {
        for (b, values) in f32s.device(d).iter().zip(&host) {
            assert_eq!(&b.to_host::<f32>().unwrap(), values);
        }
    }

    // dp, same dtype: shared in place, no program, no copy; `fresh` makes new buffers.
    let dp = learner_layout(client, &weights, 2, false);
    let before = client.transfer_stats();
    let shared = handoff(client, &dp, DType::F32, 1, false).unwrap();
    let copied = handoff(client, &dp, DType::F32, 1, true).unwrap();
    let moved = client.transfer_stats().since(&before);
    assert_eq!(
        (moved.host_transfers(), moved.device_to_device),
        (0, 0),
        "{moved:?}"
    );
    for d in 0..2 {
        assert!(Arc::ptr_eq(shared.device(d), &dp.per_device[d]));
        assert!(!Arc::ptr_eq(copied.device(d), &dp.per_device[d]));
        assert_eq!(copied.device(d)[0].to_host::<f32>().unwrap(), host[0]);
    }

    // One device, f32 -> bf16: a single-device convert.
    let single = SourceParams::single(
        Arc::from(upload_weights(client, &weights, DType::F32, 0).unwrap()),
        table.clone(),
    );
    let before = client.transfer_stats();
    let one = handoff(client, &single, DType::BF16, 1, false).unwrap();
    assert_eq!(client.transfer_stats().since(&before).host_transfers(), 0);
    assert_eq!(one.devices(), 1);
    assert_eq!(one.device(0)[0].dtype(), DType::BF16);

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
    let err = handoff(client(), &layout, DType::F32, 1, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("2 devices of parameters need a mesh of 2 devices"),
        "{err}"
    );
}

/// Models whose 4 query heads and 2 KV heads split 2 ways and (query heads only) 4 ways: a
/// tiny Llama, and the Qwen2 (q/k/v biases), Qwen3 (q/k norms, untied head) and Qwen3-MoE
/// fixtures.
fn tensor_parallel_configs() -> Vec<ModelConfig> {
    let fixture = |family: &str| {
        let path = format!(
            "{}/../model/fixtures/tiny/{family}/config.json",
            env!("CARGO_MANIFEST_DIR")
        );
        ModelConfig::from_hf_file(std::path::Path::new(&path)).unwrap()
    };
    let llama = testkit::TinyLlama {
        vocab: 64,
        hidden: 32,
        intermediate: 48,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        max_positions: 64,
        initializer_range: 0.2,
    }
    .config();
    // SmolLM2's shape of problem: heads that do not divide by the tensor-parallel size
    // (attention whole on every device) and an output head tied to the embedding.
    let mut odd_heads = testkit::TinyLlama {
        vocab: 64,
        hidden: 48,
        intermediate: 64,
        layers: 2,
        heads: 3,
        kv_heads: 3,
        max_positions: 64,
        initializer_range: 0.2,
    }
    .config();
    odd_heads.tie_word_embeddings = true;
    // Qwen3-MoE (8 experts, top 2, layer 1 dense): the experts split by expert over the model
    // axis, each device computing its share for every token.
    vec![
        llama,
        fixture("qwen2"),
        fixture("qwen3"),
        odd_heads,
        fixture("qwen3_moe"),
    ]
}

#[test]
fn slot_buckets_compact_within_each_slot_group_and_keep_every_bit() {
    let weights = random_init(&ModelConfig::tiny_llama(), 23);
    let make = |devices: usize, tp: usize, compact: bool| {
        let mut settings = EngineConfig::new(128, 64);
        settings.tensor_parallel = tp;
        settings.compact_slots = compact;
        Engine::new(
            client(),
            &weights.config,
            tensor_parallel(&weights, DType::F32, devices, tp),
            1,
            settings,
            None,
        )
        .unwrap()
    };
    let requests = staggered_requests();
    // 2 slot groups of 64 slots; 2 groups x tensor parallel 2. Split over 2 devices this
    // 64-wide model's products are 32 wide, where the CPU plugin's kernels for 8 and 16 rows
    // differ in the last bits from those for 32: the engine keeps no smaller bucket there
    // (`Engine::check_slot_buckets`) and must still give the same samples.
    for (devices, tp, compacts) in [(2, 1, true), (4, 2, false)] {
        let what = format!("{devices} devices, tensor parallel {tp}");
        let mut every_slot = make(devices, tp, false);
        let expected = generate(&mut every_slot, &requests);
        let mut engine = make(devices, tp, true);
        let got = generate(&mut engine, &requests);
        assert_identical(&got, &expected, &what);
        let (stats, full) = (engine.stats(), every_slot.stats());
        assert_eq!(stats.moved_rows > 0, compacts, "{what}: {stats:?}");
        assert_eq!(
            stats.decode_rows < full.decode_rows,
            compacts,
            "{what}: {stats:?}"
        );
    }
}

#[test]
fn multi_turn_episodes_continue_alike_over_slot_groups_and_tensor_parallel() {
    let config = tensor_parallel_configs().remove(0);
    let weights = random_init(&config, 27);
    // Turns end at 8 of the 64 tokens; each answer is 6 tokens, written by an extend run
    // into a cache of 8-position chunks, split by slots and by KV heads.
    let requests: Vec<GenerationRequest> = [(1, vec![4, 8, 15, 16]), (2, vec![9, 5])]
        .into_iter()
        .map(|(id, prompt)| {
            let mut r = episode(id, &prompt, 4, 24, 24);
            r.params.stop_token_ids = (0..8).collect();
            r
        })
        .collect();
    let make = |devices: usize, tp: usize| {
        let mut settings = EngineConfig::new(8, 32);
        settings.kv_chunk = 8;
        settings.tensor_parallel = tp;
        Engine::new(
            client(),
            &config,
            tensor_parallel(&weights, DType::F32, devices, tp),
            1,
            settings,
            None,
        )
        .unwrap()
    };
    let respond = |t: &rollout::Turn| answer(t, 3, 6);
    let expected = run_episodes(&mut make(1, 1), &requests, respond);
    let continued: usize = expected.iter().map(|s| s.env_spans.len()).sum();
    assert!(continued >= 3, "too few turns continued ({continued})");
    for (devices, tp) in [(2, 1), (2, 2), (4, 2)] {
        let what = format!("multi-turn on {devices} devices, tensor parallel {tp}");
        let mut engine = make(devices, tp);
        let got = run_episodes(&mut engine, &requests, respond);
        assert_same_samples(&got, &expected, &what);
        assert_eq!(engine.stats().extend_runs, continued, "{what}");
        for (g, e) in got.iter().zip(&expected) {
            assert_eq!(g.env_spans, e.env_spans, "{what}");
        }
    }
}

/// Weights of `weights` in `dtype` for an engine on devices `0..devices` with tensor-parallel
/// size `tp`.
fn tensor_parallel(weights: &ModelWeights, dtype: DType, devices: usize, tp: usize) -> EngineWeights {
    let on: Vec<usize> = (0..devices).collect();
    upload_weights_on(client(), weights, dtype, &on, tp).unwrap()
}

#[test]
fn tensor_parallel_engines_give_the_single_device_tokens_for_llama_qwen2_and_qwen3() {
    for config in tensor_parallel_configs() {
        let weights = random_init(&config, 21);
        for (kv_chunk, prefill_batch) in [(0, 1), (8, 2)] {
            let make = |devices: usize, tp: usize| {
                let mut settings = EngineConfig::new(8, 32);
                settings.kv_chunk = kv_chunk;
                settings.prefill_batch = prefill_batch;
                settings.tensor_parallel = tp;
                // Routing replay's records too, for the mixture of experts.
                settings.record_routes = true;
                Engine::new(
                    client(),
                    &config,
                    tensor_parallel(&weights, DType::F32, devices, tp),
                    3,
                    settings,
                    None,
                )
                .unwrap()
            };
            let mut one = make(1, 1);
            let expected = generate(&mut one, &requests());
            assert!(expected.iter().any(|s| s.response_ids.len() > 8));
            // TP=2, TP=4 (KV heads replicated: 2 of them), 2 slot groups x TP=2.
            for (devices, tp) in [(2, 2), (4, 4), (4, 2)] {
                let what = format!(
                    "{} on {devices} devices, tensor parallel {tp}, kv_chunk {kv_chunk}, prefill_batch {prefill_batch}",
                    config.family
                );
                let mut engine = make(devices, tp);
                assert_eq!(engine.devices(), devices, "{what}");
                let got = generate(&mut engine, &requests());
                assert_same_samples(&got, &expected, &what);
                for (g, e) in got.iter().zip(&expected) {
                    assert_eq!(g.routes, e.routes, "{what}: routes");
                    assert_eq!(e.routes.is_empty(), config.moe.is_none(), "{what}");
                }
            }
        }
    }
}

#[test]
fn the_handoff_reshards_a_tensor_parallel_learner_into_the_rollouts_layout_on_the_devices() {
    let own = Client::cpu(4).unwrap();
    let client = &own;
    // Qwen2, and Qwen3-MoE, whose stacked experts reshard with the rest.
    let configs = tensor_parallel_configs();
    for config in [&configs[1], &configs[4]] {
        handoff_reshards(client, config);
    }
    let weights = random_init(&configs[1], 43);
    // The same layout in the same dtype is used in place.
    let mesh = Mesh::new(&[("data", 2), (MODEL_AXIS, 2)]);
    let source = laid_out(
        client,
        &weights,
        Some(mesh),
        ParamLayout {
            fsdp: None,
            tensor_parallel: 2,
        },
    );
    let shared = handoff(client, &source, DType::F32, 2, false).unwrap();
    assert!((0..4).all(|d| Arc::ptr_eq(shared.device(d), &source.per_device[d])));
    // Meshes that do not nest are refused by name.
    let six = Client::cpu(6).unwrap();
    let source = laid_out(
        &six,
        &weights,
        Some(Mesh::new(&[("data", 3), (MODEL_AXIS, 2)])),
        ParamLayout {
            fsdp: None,
            tensor_parallel: 2,
        },
    );
    let err = handoff(&six, &source, DType::F32, 3, false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("do not nest"), "{err}");
}

/// The handoff of a learner's layouts (FSDP, TP, both) into rollout layouts of `config`'s
/// random weights, on the devices: the same tensors as uploading them in the rollout's layout,
/// and no host transfer.
fn handoff_reshards(client: &Client, config: &ModelConfig) {
    let weights = random_init(config, 43);
    let expected = |tp| upload_weights_on(client, &weights, DType::BF16, &[0, 1, 2, 3], tp).unwrap();
    let data_model = Mesh::new(&[("data", 2), (MODEL_AXIS, 2)]);
    let cases = [
        // FSDP=2 x TP=2 -> TP=2: gather over data, keep the model split.
        ("fsdp 2 x tp 2", Some(data_model.clone()), Some(("data", 2)), 2, 2),
        // FSDP=4 -> TP=2 (VeRL's common pairing): the meshes refine to 2 x 2.
        ("fsdp 4", Some(Mesh::new(&[("data", 4)])), Some(("data", 4)), 1, 2),
        // TP=2 -> TP=4 and back to whole replicas.
        ("dp 2 x tp 2", Some(data_model.clone()), None, 2, 4),
        ("dp 2 x tp 2", Some(data_model), None, 2, 1),
    ];
    for (what, mesh, fsdp, learner_tp, rollout_tp) in cases {
        let source = laid_out(
            client,
            &weights,
            mesh,
            ParamLayout {
                fsdp,
                tensor_parallel: learner_tp,
            },
        );
        let before = client.transfer_stats();
        let got = handoff(client, &source, DType::BF16, rollout_tp, false).unwrap();
        let moved = client.transfer_stats().since(&before);
        assert_eq!(
            (moved.host_transfers(), moved.host_bytes()),
            (0, 0),
            "{what} -> tp {rollout_tp}: {moved:?}"
        );
        assert_eq!(got.tensor_parallel(), rollout_tp);
        let want = expected(rollout_tp);
        for d in 0..4 {
            for (i, (g, w)) in got.device(d).iter().zip(want.device(d).iter()).enumerate() {
                assert_eq!(
                    (g.device(), g.dims()),
                    (d, w.dims()),
                    "{} {what}: device {d} parameter {i}",
                    config.family
                );
                assert_eq!(
                    g.to_host::<half::bf16>().unwrap(),
                    w.to_host::<half::bf16>().unwrap(),
                    "{} {what} -> tp {rollout_tp}: device {d} parameter {i}",
                    config.family
                );
            }
        }
    }
}

/// The real SmolLM2-135M (30 layers; 9 heads, so attention is whole on each device; the MLP and
/// the tied 49,152-word vocabulary split) on 2 slot groups x TP=2 against one device. Greedy
/// tokens are identical. Sampled tokens are identical except where a draw lands within rounding
/// of a boundary of the inverse CDF: the split sums round differently (log-probs differ by
/// ~1e-5 after 30 layers), which moves the boundaries between neighbouring tail tokens by about
/// as much, so a draw in the far tail may pick the neighbour. Every such divergence must be
/// between two tail tokens (probability < 1e-4 on both sides), and log-probs before it agree.
#[test]
fn smollm2_on_two_tensor_parallel_groups_gives_the_single_device_tokens_up_to_tail_draws() {
    let host = model::programs::HostModel::load(&testkit::smollm2_gguf()).unwrap();
    let prompts = [
        "What is 13 + 11? Reply with only the number.",
        "The capital of France is",
        "Once upon a time",
    ];
    let make = |devices: usize, tp: usize| {
        let mut settings = EngineConfig::new(16, 64);
        settings.eos_token_ids = host.stop_tokens();
        settings.tensor_parallel = tp;
        Engine::new(
            client(),
            &host.weights.config,
            tensor_parallel(&host.weights, DType::F32, devices, tp),
            3,
            settings,
            None,
        )
        .unwrap()
    };
    let mut reqs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let ids = host.tokenizer.encode(p, false).unwrap();
        let i = i as u64;
        reqs.push(request(2 * i + 1, &ids, 4, 40 + i, sampled(1.0, 0, 1.0, 24)));
        reqs.push(request(2 * i + 2, &ids, 1, 0, SamplingParams::greedy(24)));
    }
    let expected = generate(&mut make(1, 1), &reqs);
    let got = generate(&mut make(4, 2), &reqs);
    assert_eq!(got.len(), expected.len());
    let mut diverged = 0;
    for (g, e) in got.iter().zip(&expected) {
        let at = format!("request {} sample {}", e.request_id, e.sample_index);
        let first = g
            .response_ids
            .iter()
            .zip(&e.response_ids)
            .position(|(a, b)| a != b);
        let same = first.unwrap_or(g.response_ids.len().min(e.response_ids.len()));
        for k in 0..same {
            assert!(
                (g.logprobs[k] - e.logprobs[k]).abs() <= 1e-4,
                "{at}: log-prob {k}: {} vs {}",
                g.logprobs[k],
                e.logprobs[k]
            );
        }
        match first {
            None => assert_eq!(g.response_ids, e.response_ids, "{at}"),
            Some(k) => {
                diverged += 1;
                assert!(
                    e.request_id % 2 == 1,
                    "{at}: a greedy sample diverged at token {k}"
                );
                let tail = (1e-4f32).ln();
                assert!(
                    e.logprobs[k] < tail && g.logprobs[k] < tail,
                    "{at}: diverged at token {k} on a likely token: {} (log-prob {}) vs {} (log-prob {})",
                    e.response_ids[k],
                    e.logprobs[k],
                    g.response_ids[k],
                    g.logprobs[k]
                );
            }
        }
    }
    assert!(diverged <= 2, "{diverged} of 12 sampled responses diverged");
}

/// A LoRA rollout worker's merge over its tensor-parallel group: each device merges its own
/// shards of the base with its shards of the adapters, and ends with the shards of the merged
/// model (`LoraAdapter::merge_into` on one device, then laid out) within a rounding of f32 (the
/// partitioned program fuses `W + s·B·A` its own way); on one device the merge equals it bit
/// for bit.
#[test]
fn an_adapter_merge_over_a_tensor_parallel_group_gives_the_merged_models_shards() {
    use model::lora::{LoraAdapter, LoraConfig, Target};
    let config = ModelConfig::tiny_llama();
    let base = random_init(&config, 47);
    let lora = LoraConfig {
        rank: 2,
        alpha: 4.0,
        targets: vec![Target::Q, Target::V, Target::O, Target::Up, Target::Down],
        use_rslora: false,
    };
    let mut adapter = LoraAdapter::init(&config, &lora, 5);
    // B away from zero, so the merge changes the weights.
    for (i, t) in adapter.tensors.iter_mut().enumerate().filter(|(i, _)| i % 2 == 1) {
        let values: Vec<f32> = (0..t.numel())
            .map(|k| ((k * 7 + i) % 11) as f32 * 0.01 - 0.05)
            .collect();
        *t = model::HostTensor::from_f32(t.name.clone(), t.shape.clone(), &values);
    }
    let merged = adapter.merge_into(client(), 0, &base).unwrap();
    for tp in [1usize, 2] {
        let devices: Vec<usize> = (0..tp).collect();
        let base_weights = upload_weights_on(client(), &base, DType::F32, &devices, tp).unwrap();
        let install = rollout::AdapterInstall::new(
            client(),
            &config,
            &lora,
            model::LoraForm::Merged,
            DType::F32,
            base_weights,
            &devices,
        )
        .unwrap();
        let got = install.install_host(client(), &adapter.tensors).unwrap();
        let want = upload_weights_on(client(), &merged, DType::F32, &devices, tp).unwrap();
        assert_eq!(got.tensor_parallel(), tp);
        for d in 0..tp {
            for (i, (g, w)) in got.device(d).iter().zip(want.device(d).iter()).enumerate() {
                assert_eq!(g.dims(), w.dims(), "tp {tp}, device {d}, parameter {i}");
                let (g, w) = (g.to_host::<f32>().unwrap(), w.to_host::<f32>().unwrap());
                let worst = g
                    .iter()
                    .zip(&w)
                    .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                    .fold(0.0f32, f32::max);
                let bound = if tp == 1 { 0.0 } else { 2.0 * f32::EPSILON };
                assert!(
                    worst <= bound,
                    "tp {tp}, device {d}, parameter {i}: off by {worst:e}"
                );
            }
        }
    }
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert_ne!(merged.get(q).unwrap().bytes, base.get(q).unwrap().bytes);
}

/// An engine that applies LoRA adapters beside its weights (`EngineConfig::adapters`: the
/// weights, then the adapters in f32) generates what an engine over the merged weights does:
/// the same tokens and log-probs within 1e-5, on one device and over tensor-parallel groups
/// (the adapters split with their weights), and takes new adapters as a weight update.
#[test]
fn an_engine_applying_adapters_generates_what_the_merged_weights_do() {
    use model::lora::{lora_param_table, LoraAdapter, LoraConfig, Target};
    let config = tensor_parallel_configs().remove(0);
    let base = random_init(&config, 29);
    let lora = LoraConfig {
        rank: 2,
        alpha: 6.0,
        targets: Target::ALL.to_vec(),
        use_rslora: false,
    };
    let adapter = |seed: u64| {
        let mut a = LoraAdapter::init(&config, &lora, seed);
        for (i, t) in a.tensors.iter_mut().enumerate().filter(|(i, _)| i % 2 == 1) {
            let values: Vec<f32> = (0..t.numel())
                .map(|k| ((k * 5 + i + seed as usize) % 13) as f32 * 0.02 - 0.12)
                .collect();
            *t = model::HostTensor::from_f32(t.name.clone(), t.shape.clone(), &values);
        }
        a
    };
    let specs = lora_param_table(&config, &lora);
    // `adapter`'s tensors on `devices`, each device its part (a slot group's tp devices
    // split them as they split the weights).
    let adapter_parts = |adapter: &LoraAdapter, devices: usize, tp: usize| {
        let mut per_device: Vec<Vec<Buffer>> = (0..devices).map(|_| Vec::new()).collect();
        for group in 0..devices / tp {
            let on: Vec<usize> = (group * tp..(group + 1) * tp).collect();
            for (spec, t) in specs.iter().zip(&adapter.tensors) {
                let parts = rollout::upload_parameter(client(), spec, DType::F32, &t.bytes, &on).unwrap();
                for (i, part) in parts.into_iter().enumerate() {
                    per_device[group * tp + i].push(part);
                }
            }
        }
        per_device
            .into_iter()
            .map(Arc::from)
            .collect::<Vec<Arc<[Buffer]>>>()
    };
    let (first, second) = (adapter(3), adapter(4));
    for (devices, tp) in [(1, 1), (2, 2), (4, 2)] {
        let what = format!("{devices} devices, tensor parallel {tp}");
        let make = |weights: EngineWeights, applied: bool| {
            let mut settings = EngineConfig::new(8, 32);
            settings.tensor_parallel = tp;
            settings.adapters = applied.then(|| lora.clone());
            Engine::new(client(), &config, weights, 1, settings, None).unwrap()
        };
        let merged = |a: &LoraAdapter| {
            tensor_parallel(
                &a.merge_into(client(), 0, &base).unwrap(),
                DType::F32,
                devices,
                tp,
            )
        };
        let base_weights = tensor_parallel(&base, DType::F32, devices, tp);
        let mut engine = make(
            base_weights.with_adapters(adapter_parts(&first, devices, tp)),
            true,
        );
        let expected = generate(&mut make(merged(&first), false), &requests());
        assert_same_samples(&generate(&mut engine, &requests()), &expected, &what);
        // A new version's adapters alone: the engine keeps its base.
        let update = EngineWeights::adapters_only(adapter_parts(&second, devices, tp), tp);
        engine.update_weights(2, update).unwrap();
        let expected = generate(&mut make(merged(&second), false), &requests());
        assert_same_samples(
            &generate(&mut engine, &requests()),
            &expected,
            &format!("{what}, new adapters"),
        );
    }
}
