//! The routing of the tiny Qwen3-MoE fixtures (`model/scripts/make_tiny_moe.py`) through the
//! learner's routed forward ([`model::forward::span_hidden_routed`]): the experts chosen are
//! transformers' own, the load-balancing loss is transformers' `load_balancing_loss_func`,
//! replaying the model's own choice changes nothing and replaying another changes the output,
//! scanned and rematerialised layers route alike, and under a replayed choice the router's
//! gradient matches finite differences (the function is smooth there).

use std::path::PathBuf;
use testkit::client;

use model::forward::{span_hidden_routed, DecoderParams};
use model::moe::load_balancing_loss;
use model::programs::DeviceModel;
use model::safetensors_io::load_hf_checkpoint;
use model::ModelWeights;
use xla::graph::{value_and_grad, Graph, Tensor};
use xla::runtime::{Buffer, Executable};
use xla::DType;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/tiny")
        .join(name)
}

fn gguf_weights() -> ModelWeights {
    let gguf = model::GgufFile::open(&fixture("qwen3_moe_gguf").join("model-f32.gguf")).unwrap();
    let config = model::ModelConfig::from_gguf(&gguf).unwrap();
    gguf.load_weights(&config).unwrap()
}

/// One reference sequence: input ids, logits `[T * vocab]`, experts `[Lm, T, k]`, aux loss.
type Reference = (Vec<i32>, Vec<f32>, Vec<i32>, f32);

/// Every reference sequence of fixture `name`.
fn reference(name: &str) -> Vec<Reference> {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ints = |n: &str| -> Vec<i32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let floats = |n: &str| -> Vec<f32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    (0..3)
        .map(|i| {
            (
                ints(&format!("input_ids_{i}")),
                floats(&format!("logits_{i}")),
                ints(&format!("experts_{i}")),
                floats(&format!("aux_loss_{i}"))[0],
            )
        })
        .collect()
}

/// A compiled routed forward over one sequence of `t` tokens: outputs the logits of positions
/// `0..t-1` `[1, t-1, vocab]`, the chosen experts `[1, t, Lm, k]` and the load-balancing loss;
/// with `replay`, takes the experts `[1, t, Lm, k]` as its last argument.
fn routed_forward(weights: &ModelWeights, t: usize, replay: bool, scan_remat: bool) -> Executable {
    let config = &weights.config;
    let moe = config.moe.as_ref().unwrap();
    let lm = config.moe_layers() as i64;
    let g = Graph::new("routed");
    let mut p = DecoderParams::declare(&g, config, DType::F32);
    p.scan = scan_remat;
    p.remat = scan_remat;
    let tokens = g.parameter("tokens", DType::I32, &[1, t as i64]);
    let mask = g.parameter("mask", DType::I32, &[1, t as i64]);
    let replayed = replay.then(|| {
        g.parameter(
            "replay",
            DType::I32,
            &[1, t as i64, lm, moe.experts_per_token as i64],
        )
    });
    let (h, _, routes) = span_hidden_routed(&p, &tokens, &mask, 1, replayed.as_ref());
    let routes = routes.expect("a MoE model routes");
    let logits = h.linear(p.head());
    let count = mask.convert(DType::F32).sum_all();
    let aux = load_balancing_loss(moe, &routes, &count);
    g.build(&[&logits, &routes.chosen, &aux])
        .unwrap()
        .compile(client())
        .unwrap()
}

fn run(
    exe: &Executable,
    model: &DeviceModel,
    ids: &[i32],
    replay: Option<&[i32]>,
    lm: i64,
    k: i64,
) -> (Vec<f32>, Vec<i32>, f32) {
    let t = ids.len() as i64;
    let tokens = client().buffer_from_host(ids, &[1, t], 0).unwrap();
    let mask = client()
        .buffer_from_host(&vec![1i32; ids.len()], &[1, t], 0)
        .unwrap();
    let replay = replay.map(|r| client().buffer_from_host(r, &[1, t, lm, k], 0).unwrap());
    let mut args: Vec<&Buffer> = model.weights().iter().collect();
    args.extend([&tokens, &mask]);
    args.extend(replay.as_ref());
    let out = exe.execute(&args).unwrap();
    (
        out[0].to_host::<f32>().unwrap(),
        out[1].to_host::<i32>().unwrap(),
        out[2].to_host::<f32>().unwrap()[0],
    )
}

/// `[Lm, T, k]` (the reference's layout) as `[T, Lm, k]` (the routed forward's).
fn positions_first(experts: &[i32], lm: usize, t: usize, k: usize) -> Vec<i32> {
    let mut out = vec![0; experts.len()];
    for l in 0..lm {
        for p in 0..t {
            for j in 0..k {
                out[(p * lm + l) * k + j] = experts[(l * t + p) * k + j];
            }
        }
    }
    out
}

#[test]
fn routes_and_load_balancing_loss_are_transformers_and_replay_is_exact() {
    for name in ["qwen3_moe", "qwen3_moe_legacy"] {
        let weights = load_hf_checkpoint(&fixture(name)).unwrap();
        let config = &weights.config;
        let (k, vocab) = (config.moe.as_ref().unwrap().experts_per_token, config.vocab_size);
        let lm = config.moe_layers();
        let model = DeviceModel::upload(client(), &weights, DType::F32, 0).unwrap();
        for (ids, logits, experts, aux) in reference(name).into_iter().filter(|r| r.0.len() > 1) {
            let t = ids.len();
            let (got_logits, chosen, got_aux) = run(
                &routed_forward(&weights, t, false, false),
                &model,
                &ids,
                None,
                lm as i64,
                k as i64,
            );
            assert_eq!(
                chosen,
                positions_first(&experts, lm, t, k),
                "{name}: experts chosen"
            );
            assert!(
                (got_aux - aux).abs() < 1e-5,
                "{name}: load-balancing loss {got_aux} vs {aux}"
            );
            let worst = got_logits
                .iter()
                .zip(&logits[..(t - 1) * vocab])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-5, "{name}: logits {worst} off");

            // Replaying its own choice: the same numbers, to the bit.
            let replaying = routed_forward(&weights, t, true, false);
            let (again, echoed, again_aux) =
                run(&replaying, &model, &ids, Some(&chosen), lm as i64, k as i64);
            assert_eq!(
                (again, &echoed, again_aux),
                (got_logits.clone(), &chosen, got_aux),
                "{name}"
            );
            // Replaying another (each expert moved one along): different outputs.
            let other: Vec<i32> = chosen.iter().map(|e| (e + 1) % 8).collect();
            let (moved, echoed, _) = run(&replaying, &model, &ids, Some(&other), lm as i64, k as i64);
            assert_eq!(echoed, other, "{name}: the replayed experts are the ones used");
            assert_ne!(moved, got_logits, "{name}: another routing changes the logits");
        }
    }
}

#[test]
fn scanned_and_rematerialised_layers_route_and_replay_alike() {
    let weights = gguf_weights(); // every layer sparse: one scanned body
    let model = DeviceModel::upload(client(), &weights, DType::F32, 0).unwrap();
    let (ids, ..) = reference("qwen3_moe_gguf").swap_remove(1);
    let t = ids.len();
    let unrolled = run(
        &routed_forward(&weights, t, false, false),
        &model,
        &ids,
        None,
        2,
        2,
    );
    let scanned = run(
        &routed_forward(&weights, t, false, true),
        &model,
        &ids,
        None,
        2,
        2,
    );
    assert_eq!(scanned.1, unrolled.1, "experts chosen");
    let worst = scanned
        .0
        .iter()
        .zip(&unrolled.0)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-5 && (scanned.2 - unrolled.2).abs() < 1e-6, "{worst}");
    let other: Vec<i32> = unrolled.1.iter().map(|e| (e + 3) % 8).collect();
    let a = run(
        &routed_forward(&weights, t, true, false),
        &model,
        &ids,
        Some(&other),
        2,
        2,
    );
    let b = run(
        &routed_forward(&weights, t, true, true),
        &model,
        &ids,
        Some(&other),
        2,
        2,
    );
    assert_eq!((&a.1, &b.1), (&other, &other));
    let worst =
        a.0.iter()
            .zip(&b.0)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
    assert!(worst < 1e-5, "replayed through the scan: {worst}");
}

/// Under a replayed routing the output is a smooth function of the router (through the
/// renormalised weights of the replayed experts): its gradient, and the load-balancing loss's,
/// match central differences, through rematerialised layers too.
#[test]
fn router_gradients_under_replay_match_finite_differences() {
    use rand::{Rng, SeedableRng};
    let weights = gguf_weights();
    let config = weights.config.clone();
    let model = DeviceModel::upload(client(), &weights, DType::F32, 0).unwrap();
    let (ids, ..) = reference("qwen3_moe_gguf").swap_remove(0);
    let t = ids.len() as i64;
    let table = model::param_table(&config);
    let router = table
        .iter()
        .position(|s| s.name == "model.layers.1.mlp.gate.weight")
        .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let replay: Vec<i32> = (0..t * 2 * 2).map(|_| rng.random_range(0..8)).collect();
    let build = |with_grad: bool| {
        let g = Graph::new("replayed_loss");
        let p = DecoderParams::declare(&g, &config, DType::F32);
        let tokens = g.parameter("tokens", DType::I32, &[1, t]);
        let mask = g.parameter("mask", DType::I32, &[1, t]);
        let replayed = g.parameter("replay", DType::I32, &[1, t, 2, 2]);
        let loss_of = |args: &[Tensor]| {
            let mut p = DecoderParams::from_tensors(&config, args).unwrap();
            p.remat = true;
            let (h, _, routes) = span_hidden_routed(&p, &tokens, &mask, 1, Some(&replayed));
            let logits = h.linear(p.head());
            let aux = load_balancing_loss(
                config.moe.as_ref().unwrap(),
                &routes.unwrap(),
                &mask.convert(DType::F32).sum_all(),
            );
            &(&logits * &logits).mean_all() + &aux
        };
        let program = if with_grad {
            let (loss, grads) = value_and_grad(loss_of, &p.all, &[router]).unwrap();
            g.build(&[&loss, &grads[0]]).unwrap()
        } else {
            g.build(&[&loss_of(&p.all)]).unwrap()
        };
        program.compile(client()).unwrap()
    };
    let (grad_exe, loss_exe) = (build(true), build(false));
    let tb = client().buffer_from_host(&ids, &[1, t], 0).unwrap();
    let mb = client()
        .buffer_from_host(&vec![1i32; t as usize], &[1, t], 0)
        .unwrap();
    let rb = client().buffer_from_host(&replay, &[1, t, 2, 2], 0).unwrap();
    let exec = |exe: &Executable, router_buffer: Option<&Buffer>| {
        let mut args: Vec<&Buffer> = model.weights().iter().collect();
        if let Some(b) = router_buffer {
            args[router] = b;
        }
        args.extend([&tb, &mb, &rb]);
        exe.execute(&args).unwrap()
    };
    let out = exec(&grad_exe, None);
    let grad = out[1].to_host::<f32>().unwrap();
    let base = weights.tensors[router].to_f32_vec();
    let mut dir: Vec<f64> = (0..base.len()).map(|_| rng.random::<f64>() - 0.5).collect();
    let norm = dir.iter().map(|x| x * x).sum::<f64>().sqrt();
    dir.iter_mut().for_each(|x| *x /= norm);
    let analytic: f64 = grad.iter().zip(&dir).map(|(g, d)| *g as f64 * d).sum();
    let h = 0.05;
    let at = |sign: f64| {
        let moved: Vec<f32> = base
            .iter()
            .zip(&dir)
            .map(|(w, d)| (*w as f64 + sign * h * d) as f32)
            .collect();
        let b = client().buffer_from_host(&moved, &[8, 64], 0).unwrap();
        exec(&loss_exe, Some(&b))[0].to_host::<f32>().unwrap()[0] as f64
    };
    let numeric = (at(1.0) - at(-1.0)) / (2.0 * h);
    assert!(analytic.abs() > 1e-4, "the router reaches the loss: {analytic}");
    assert!(
        (analytic - numeric).abs() <= 1e-2 * analytic.abs().max(numeric.abs()) + 1e-4,
        "{analytic} vs {numeric}"
    );
}

/// The two dispatches of `model::moe`: the grouped one (tokens sorted by expert through a
/// grouped product, here its masked form, which the CPU plugin runs) gives the dense one's
/// logits, routes and gradients of every parameter, own routing and replayed, both layouts'
/// fixtures (one with a dense layer).
#[test]
fn grouped_and_dense_dispatch_give_the_same_values_and_gradients() {
    use model::moe::MoeLowering;
    for name in ["qwen3_moe", "qwen3_moe_legacy"] {
        let weights = load_hf_checkpoint(&fixture(name)).unwrap();
        let config = weights.config.clone();
        let model = DeviceModel::upload(client(), &weights, DType::F32, 0).unwrap();
        let (ids, ..) = reference(name).into_iter().max_by_key(|r| r.0.len()).unwrap();
        let t = ids.len() as i64;
        let (lm, k) = (
            config.moe_layers() as i64,
            config.moe.as_ref().unwrap().experts_per_token as i64,
        );
        let run_with = |lowering: MoeLowering, replay: Option<&[i32]>| {
            let g = Graph::new("dispatch");
            let p = DecoderParams::declare(&g, &config, DType::F32);
            let tokens = g.parameter("tokens", DType::I32, &[1, t]);
            let mask = g.parameter("mask", DType::I32, &[1, t]);
            let replayed = replay.map(|_| g.parameter("replay", DType::I32, &[1, t, lm, k]));
            let forward = |args: &[Tensor]| {
                let p = DecoderParams::from_tensors(&config, args)
                    .unwrap()
                    .with_moe_lowering(lowering);
                let (h, _, routes) = span_hidden_routed(&p, &tokens, &mask, 1, replayed.as_ref());
                (h.linear(p.head()), routes.unwrap().chosen)
            };
            let (logits, chosen) = forward(&p.all);
            let loss = |args: &[Tensor]| {
                let (l, _) = forward(args);
                (&l * &l.sin()).mean_all()
            };
            let wrt: Vec<usize> = (0..p.all.len()).collect();
            let (_, grads) = value_and_grad(loss, &p.all, &wrt).unwrap();
            let mut outs = vec![&logits, &chosen];
            outs.extend(grads.iter());
            let exe = g.build(&outs).unwrap().compile(client()).unwrap();
            let tb = client().buffer_from_host(&ids, &[1, t], 0).unwrap();
            let mb = client()
                .buffer_from_host(&vec![1i32; t as usize], &[1, t], 0)
                .unwrap();
            let rb = replay.map(|r| client().buffer_from_host(r, &[1, t, lm, k], 0).unwrap());
            let mut args: Vec<&Buffer> = model.weights().iter().collect();
            args.extend([&tb, &mb]);
            args.extend(rb.as_ref());
            let out = exe.execute(&args).unwrap();
            let floats: Vec<Vec<f32>> = std::iter::once(&out[0])
                .chain(&out[2..])
                .map(|b| b.to_host::<f32>().unwrap())
                .collect();
            (floats, out[1].to_host::<i32>().unwrap())
        };
        let other: Vec<i32> = (0..t * lm * k).map(|i| ((i * 3 + i / k) % 8) as i32).collect();
        for replay in [None, Some(other.as_slice())] {
            let (dense, dense_routes) = run_with(MoeLowering::Dense, replay);
            let (grouped, grouped_routes) = run_with(MoeLowering::Grouped { native: false }, replay);
            assert_eq!(grouped_routes, dense_routes, "{name}: routes");
            for (i, (a, b)) in grouped.iter().zip(&dense).enumerate() {
                let scale = b.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
                let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                assert!(
                    worst <= 1e-5 * scale.max(1.0),
                    "{name}, replay {}: output {i} differs by {worst} (scale {scale})",
                    replay.is_some()
                );
            }
        }
    }
}
