//! The sharded learner on 1, 2 and 4 CPU devices with a tiny random-weight Llama policy:
//!
//! - three training steps under `dp` and `fsdp` over 2 and 4 devices end with the same
//!   parameters, Adam moments and metrics as the single-device learner, within rounding
//!   (the partitioner sums gradients in another order);
//! - under `fsdp` the parameter bytes one device holds fall as 1/N (every dimension of this
//!   model divides by 4), under `dp` they stay whole;
//! - gradient accumulation over micro-batches under `dp` equals one fused step on the whole
//!   mini-batch on one device;
//! - `log_probs` (current and reference parameters) and `shared_params` (device 0's replica
//!   under `dp`, all-gathered under `fsdp`) agree with the single-device learner;
//! - a micro-batch that does not split over the mesh, prompt slots that do not, and a mesh
//!   larger than the client, are refused by name;
//! - PPO's critic (a value model and its clipped value loss) under `dp` and `fsdp` over 2
//!   devices gives the single-device values and, after three steps, state.
//!
//! - tensor parallelism (`actor.tensor_model_parallel_size`) for tiny Llama, Qwen2 and Qwen3
//!   models: TP=2, TP=4 (more devices than KV heads) and FSDP=2 x TP=2, with and without
//!   rematerialisation and with scanned layers, give the single-device log-probs (1e-5), metrics and, after three
//!   on-policy steps, parameters and Adam moments (1e-5), and device 0 holds its shards only.
//!
//! Pairs of consecutive rows share a prompt, packed once per block of rows (one block per
//! data device), so the shared-prompt policy is checked under every strategy too.

mod support;

use model::{random_init, ModelConfig};
use testkit::TinyLlama;
use trainer::config::{OptimConfig, Parallelism, PolicyLossConfig, PolicyLossMode, Strategy};
use trainer::policy::DecoderPolicy;
use trainer::step::{
    build_train_programs, mini_batch_normalizer, Learner, LearnerState, MicroBatchHost, StepConfig,
};
use xla::runtime::Client;
use xla::DType;

/// Rows of the mini-batch.
const ROWS: usize = 8;
const PROMPT: usize = 3;
const RESPONSE: usize = 3;
const VOCAB: u64 = 8;
const STEPS: usize = 3;
/// Rows per prompt.
const GROUP: usize = 2;

/// Parameters and moments after 3 steps may differ by this much (absolute, on values of order
/// 0.02-1) from the single-device learner: f32 sums in another order, ~1e-7 relative, grown by
/// Adam's normalisation where a gradient is tiny.
const STATE_TOL: f32 = 1e-5;
/// Metrics (loss, grad norm, ...) and log-probs: relative tolerance, absolute below 0.1 (a
/// term like `ppo_kl` is a difference of nearly equal log-probs, rounding-sized on policy).
const METRIC_TOL: f64 = 1e-5;

fn client4() -> &'static Client {
    testkit::cpu_client(4)
}

fn tiny_llama() -> ModelConfig {
    TinyLlama {
        vocab: VOCAB as usize,
        ..TinyLlama::default()
    }
    .config()
}

/// Pairs of consecutive rows share a prompt; the rows and prompts of a micro-batch split into
/// one block per device.
fn policy(micro_batch_size: usize, blocks: usize) -> DecoderPolicy {
    policy_of(&tiny_llama(), micro_batch_size, blocks)
}

fn policy_of(config: &ModelConfig, micro_batch_size: usize, blocks: usize) -> DecoderPolicy {
    DecoderPolicy {
        config: config.clone(),
        prompt_len: PROMPT,
        response_len: RESPONSE,
        micro_batch_size,
        temperature: 1.0,
        group_size: GROUP,
        blocks,
        remat: false,
        scan: false,
        lora: None,
        lora_form: Default::default(),
        head: Default::default(),
        route_inputs: false,
        moe_lowering: Default::default(),
    }
}

fn step_cfg(micro_batch_size: usize, parallel: Parallelism) -> StepConfig {
    step_cfg_as(micro_batch_size, parallel, DType::F32)
}

fn step_cfg_as(micro_batch_size: usize, parallel: Parallelism, compute_dtype: DType) -> StepConfig {
    StepConfig {
        loss: PolicyLossConfig {
            use_kl_loss: true,
            kl_loss_coef: 0.1,
            entropy_coeff: 0.01,
            ..Default::default()
        },
        optim: OptimConfig {
            lr: 0.01,
            grad_clip: Some(1.0),
            weight_decay: 0.01,
            ..Default::default()
        },
        compute_dtype,
        micro_batch_size: micro_batch_size as i64,
        response_len: RESPONSE as i64,
        parallel,
        frozen: Vec::new(),
        value_loss: None,
    }
}

/// The mini-batch on the host: rows in pairs with one prompt, prompts and responses of
/// different lengths.
#[derive(Clone)]
struct Batch {
    rows: Vec<(Vec<u32>, Vec<u32>)>,
    response_mask: Vec<f32>,
    advantages: Vec<f32>,
    old: Vec<f32>,
    reference: Vec<f32>,
}

fn batch(seed: u64) -> Batch {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        state >> 33
    };
    let mut rows: Vec<(Vec<u32>, Vec<u32>)> = Vec::new();
    let mut response_mask = vec![0f32; ROWS * RESPONSE];
    for r in 0..ROWS {
        let prompt = if r % GROUP == 0 {
            (0..1 + (r / GROUP) % PROMPT)
                .map(|_| (next() % VOCAB) as u32)
                .collect()
        } else {
            rows[r - 1].0.clone()
        };
        let response_len = 1 + (r / 2 + r % 2) % RESPONSE;
        rows.push((
            prompt,
            (0..response_len).map(|_| (next() % VOCAB) as u32).collect(),
        ));
        for j in 0..response_len {
            response_mask[r * RESPONSE + j] = 1.0;
        }
    }
    let signed = |x: u64| (x % 2001) as f32 / 1000.0 - 1.0;
    let advantages = (0..ROWS * RESPONSE)
        .map(|i| signed(next()) * response_mask[i])
        .collect();
    let old = (0..ROWS * RESPONSE)
        .map(|_| -2.0 + 0.3 * signed(next()))
        .collect();
    let reference = (0..ROWS * RESPONSE)
        .map(|_| -2.1 + 0.3 * signed(next()))
        .collect();
    Batch {
        rows,
        response_mask,
        advantages,
        old,
        reference,
    }
}

/// Rows `[start, start + rows)` packed for a learner on `blocks` devices, normalised by the
/// whole mini-batch.
fn micro(b: &Batch, start: usize, rows: usize, blocks: usize) -> MicroBatchHost {
    let (a, e) = (start * RESPONSE, (start + rows) * RESPONSE);
    let pairs: Vec<(&[u32], &[u32])> = b.rows[start..start + rows]
        .iter()
        .map(|(p, r)| (&p[..], &r[..]))
        .collect();
    let packed = policy(rows, blocks).pack(&pairs).unwrap();
    MicroBatchHost {
        old_log_probs: b.old[a..e].to_vec(),
        advantages: b.advantages[a..e].to_vec(),
        response_mask: b.response_mask[a..e].to_vec(),
        ref_log_probs: Some(b.reference[a..e].to_vec()),
        rollout_is_weights: None,
        norm: mini_batch_normalizer(&b.response_mask, RESPONSE),
        inputs: packed.inputs(false),
        values: None,
        returns: None,
    }
}

fn initial() -> Vec<Vec<f32>> {
    initial_of(&tiny_llama())
}

fn initial_of(config: &ModelConfig) -> Vec<Vec<f32>> {
    random_init(config, 7)
        .tensors
        .iter()
        .map(|t| t.to_f32_vec())
        .collect()
}

fn learner(micro_batch_size: usize, parallel: Parallelism) -> Learner {
    learner_as(micro_batch_size, parallel, DType::F32)
}

fn learner_as(micro_batch_size: usize, parallel: Parallelism, compute_dtype: DType) -> Learner {
    learner_of(
        &tiny_llama(),
        micro_batch_size,
        parallel,
        compute_dtype,
        Layers::Plain,
    )
}

/// A learner of a `config` model laid out by `parallel` (one block of rows per data device),
/// its layers traced as `layers` says.
fn learner_of(
    config: &ModelConfig,
    micro_batch_size: usize,
    parallel: Parallelism,
    compute_dtype: DType,
    layers: Layers,
) -> Learner {
    let cfg = step_cfg_as(micro_batch_size, parallel, compute_dtype);
    learner_with(config, cfg, layers)
}

/// How a learner's decoder layers are traced.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layers {
    /// One trace per layer.
    Plain,
    /// Recomputed in the backward pass (`model.enable_gradient_checkpointing`).
    Remat,
    /// One loop over the stacked layers (`model.scan_layers`).
    Scan,
}

/// A learner of a `config` model with the step configuration `cfg`.
fn learner_with(config: &ModelConfig, cfg: StepConfig, layers: Layers) -> Learner {
    let (micro_batch_size, parallel) = (cfg.micro_batch_size as usize, cfg.parallel);
    let mut p = policy_of(
        config,
        micro_batch_size,
        parallel.data_devices(micro_batch_size as i64).unwrap(),
    );
    p.remat = layers == Layers::Remat;
    p.scan = layers == Layers::Scan;
    let specs = p.param_specs();
    let programs = build_train_programs(&cfg, &specs, &p.input_specs(), |w, b| p.log_probs(w, b))
        .unwrap_or_else(|e| panic!("{parallel:?}: {e}"));
    let mut l = Learner::new(client4(), programs, &specs, &cfg, &initial_of(config), 3).unwrap();
    l.set_reference(&initial_of(config)).unwrap();
    l
}

/// `STEPS` steps of `micro_batches` micro-batches each over batches 0, 1, 2; returns the final
/// state and every step's metrics.
/// Each step's metrics, by name.
type StepMetrics = Vec<Vec<(&'static str, f64)>>;

fn train(l: &mut Learner, micro_batches: usize) -> (LearnerState, StepMetrics) {
    let rows = ROWS / micro_batches;
    let mut metrics = Vec::new();
    for step in 0..STEPS {
        let b = batch(step as u64 + 1);
        let mbs: Vec<_> = (0..micro_batches)
            .map(|i| {
                l.upload_micro_batch(i, &micro(&b, i * rows, rows, l.mesh().data_devices()))
                    .unwrap()
            })
            .collect();
        let m = l.step(&mbs, 0.01).unwrap();
        assert!(m.update_applied, "step {step}: {m:?}");
        metrics.push(m.values);
    }
    (l.state().unwrap(), metrics)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn assert_same_state(what: &str, got: &LearnerState, want: &LearnerState) {
    assert_eq!(got.adam_step, want.adam_step, "{what}: adam step");
    let mut worst = 0f32;
    for (group, (g, w)) in [(&got.params, &want.params), (&got.m, &want.m), (&got.v, &want.v)]
        .into_iter()
        .enumerate()
    {
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            let d = max_diff(a, b);
            worst = worst.max(d);

            assert!(
                d <= STATE_TOL,
                "{what}: {} {i} differs by {d} (tolerance {STATE_TOL})",
                ["parameter", "adam_m", "adam_v"][group]
            );
        }
    }
    eprintln!("{what}: largest state difference {worst:e}");
}

fn assert_same_metrics(what: &str, got: &[Vec<(&str, f64)>], want: &[Vec<(&str, f64)>]) {
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        for ((name, a), (_, b)) in g.iter().zip(w) {
            assert!(
                (a - b).abs() <= METRIC_TOL * b.abs().max(0.1),
                "{what} step {step}: {name} {a} vs single-device {b}"
            );
        }
    }
}

fn param_bytes(l: &Learner, device: usize) -> usize {
    l.device_params(device)
        .iter()
        .map(|b| b.dims().iter().product::<i64>() as usize * b.dtype().size_bytes())
        .sum()
}

#[test]
fn dp_and_fsdp_on_2_and_4_devices_match_one_device_and_fsdp_memory_falls_as_1_over_n() {
    let mut single = learner(ROWS, Parallelism::default());
    let probe = |blocks| micro(&batch(9), 0, ROWS, blocks).inputs;
    let lp_single = single.log_probs(&probe(1), false).unwrap();
    let (want, want_metrics) = train(&mut single, 1);
    let full_bytes = param_bytes(&single, 0);
    let lp_after = single.log_probs(&probe(1), false).unwrap();
    let lp_reference = single.log_probs(&probe(1), true).unwrap();
    assert_eq!(
        lp_single, lp_reference,
        "the reference stays at the initial weights"
    );
    assert!(
        max_diff(&lp_single, &lp_after) > 1e-4,
        "training moved the log-probs"
    );
    let whole: Vec<Vec<f32>> = single
        .shared_params()
        .unwrap()
        .iter()
        .map(|b| b.to_host::<f32>().unwrap())
        .collect();
    assert_eq!(whole, want.params, "single: shared_params are the masters");

    for strategy in [Strategy::Dp, Strategy::Fsdp] {
        for devices in [2usize, 4] {
            let what = format!("{} over {devices}", strategy.name());
            let mut l = learner(ROWS, Parallelism::new(strategy, devices));
            assert_eq!(l.devices(), devices, "{what}");
            assert_eq!(
                single.layout().num_params,
                l.layout().num_params,
                "{what}: same parameter table"
            );
            // The programs carry the mesh the partition count is read from.
            let lp = l.log_probs(&probe(devices), false).unwrap();
            assert!(
                max_diff(&lp, &lp_single) <= 1e-5,
                "{what}: log_probs before training"
            );
            let (got, metrics) = train(&mut l, 1);
            assert_same_state(&what, &got, &want);
            assert_same_metrics(&what, &metrics, &want_metrics);
            let lp = l.log_probs(&probe(devices), false).unwrap();
            assert!(
                max_diff(&lp, &lp_after) <= 1e-4,
                "{what}: log_probs after training"
            );
            let lp = l.log_probs(&probe(devices), true).unwrap();
            assert!(
                max_diff(&lp, &lp_reference) <= 1e-5,
                "{what}: reference log_probs"
            );

            // Per-device parameter memory.
            let bytes: Vec<usize> = (0..devices).map(|d| param_bytes(&l, d)).collect();
            let expect = match strategy {
                Strategy::Fsdp => full_bytes / devices,
                _ => full_bytes,
            };
            assert_eq!(bytes, vec![expect; devices], "{what}: parameter bytes per device");
            eprintln!(
                "{what}: {} parameter bytes per device (1 device: {full_bytes})",
                bytes[0]
            );

            // What a rollout engine on device 0 reads: whole parameters there.
            let shared = l.shared_params().unwrap();
            assert!(shared.iter().all(|b| b.device() == 0), "{what}");
            let shared: Vec<Vec<f32>> = shared.iter().map(|b| b.to_host::<f32>().unwrap()).collect();
            assert_eq!(
                shared, got.params,
                "{what}: shared_params are the whole parameters"
            );
        }
    }
}

/// PPO's critic (a value model: the trunk and a value head, the clipped value loss) laid out
/// by `parallel`, from the tiny model's trunk and a seeded head.
fn critic_learner(parallel: Parallelism) -> Learner {
    let config = tiny_llama();
    let mut cfg = step_cfg(ROWS, parallel);
    cfg.value_loss = Some(trainer::config::ValueLossConfig::default());
    let mut p = policy_of(&config, ROWS, parallel.data_devices(ROWS as i64).unwrap());
    p.head = trainer::policy::Head::Value;
    let specs = p.param_specs();
    let programs = build_train_programs(&cfg, &specs, &p.input_specs(), |w, b| p.forward(w, b))
        .unwrap_or_else(|e| panic!("{parallel:?}: {e}"));
    let initial: Vec<Vec<f32>> = model::classifier::value_model_init(&random_init(&config, 7), 9)
        .unwrap()
        .iter()
        .map(|t| t.to_f32_vec())
        .collect();
    Learner::new(client4(), programs, &specs, &cfg, &initial, 3).unwrap()
}

#[test]
fn a_critic_under_dp_and_fsdp_matches_one_device() {
    let train_critic = |l: &mut Learner| {
        let blocks = l.mesh().data_devices();
        let mut values = Vec::new();
        for step in 0..STEPS {
            let b = batch(step as u64 + 1);
            // Old values and returns from the batch's arrays (any numbers the loss clips).
            let mut host = micro(&b, 0, ROWS, blocks);
            host.values = Some(b.old.iter().map(|v| v + 2.0).collect());
            host.returns = Some(b.advantages.clone());
            values.push(l.log_probs(&host.inputs, false).unwrap());
            let mb = l.upload_micro_batch(0, &host).unwrap();
            let m = l.step(&[mb], 0.01).unwrap();
            assert!(m.update_applied, "step {step}: {m:?}");
            assert!(m.get("vf_loss").is_some_and(f64::is_finite), "{m:?}");
        }
        (l.state().unwrap(), values)
    };
    let (want, want_values) = train_critic(&mut critic_learner(Parallelism::default()));
    for strategy in [Strategy::Dp, Strategy::Fsdp] {
        let what = format!("critic, {} over 2", strategy.name());
        let (got, values) = train_critic(&mut critic_learner(Parallelism::new(strategy, 2)));
        assert_same_state(&what, &got, &want);
        for (step, (a, b)) in values.iter().zip(&want_values).enumerate() {
            assert!(max_diff(a, b) <= 1e-4, "{what}: values before step {step}");
        }
    }
}

/// The covariance losses pick tokens across the whole micro-batch (a sort over every row):
/// split over 2 devices under `fsdp` they pick the same tokens as one device.
#[test]
fn covariance_losses_under_fsdp_match_one_device() {
    for mode in [PolicyLossMode::KlCov, PolicyLossMode::ClipCov] {
        let cfg = |parallel| {
            let mut c = step_cfg(ROWS, parallel);
            c.loss.loss_mode = mode;
            c.loss.kl_cov_ratio = 0.3;
            c.loss.clip_cov_ratio = 0.3;
            c.loss.clip_cov_lb = -10.0;
            c.loss.clip_cov_ub = 10.0;
            c
        };
        let (want, want_metrics) = train(
            &mut learner_with(&tiny_llama(), cfg(Parallelism::default()), Layers::Plain),
            1,
        );
        let (got, metrics) = train(
            &mut learner_with(
                &tiny_llama(),
                cfg(Parallelism::new(Strategy::Fsdp, 2)),
                Layers::Plain,
            ),
            1,
        );
        let what = format!("{mode:?} under fsdp over 2");
        if mode == PolicyLossMode::ClipCov {
            let dropped = want_metrics[0]
                .iter()
                .find(|(k, _)| *k == "pg_clipfrac")
                .unwrap()
                .1;
            assert!(dropped > 0.0, "{what}: no token dropped: pick other data");
        }
        assert_same_state(&what, &got, &want);
        assert_same_metrics(&what, &metrics, &want_metrics);
    }
}

#[test]
fn micro_batch_accumulation_under_dp_equals_one_fused_step_on_one_device() {
    let mut fused = learner(ROWS, Parallelism::default());
    let (want, want_metrics) = train(&mut fused, 1);
    // 4 micro-batches of 2 rows, one row per device.
    let mut dp = learner(ROWS / 4, Parallelism::new(Strategy::Dp, 2));
    let (got, metrics) = train(&mut dp, 4);
    assert_same_state("dp over 2, 4 micro-batches", &got, &want);
    assert_same_metrics("dp over 2, 4 micro-batches", &metrics, &want_metrics);
    // A checkpoint of the dp learner restores into an fsdp one and continues identically.
    let p = policy(ROWS / 4, 2);
    let cfg = step_cfg(ROWS / 4, Parallelism::new(Strategy::Fsdp, 2));
    let programs =
        build_train_programs(&cfg, &p.param_specs(), &p.input_specs(), |w, b| p.log_probs(w, b)).unwrap();
    let restored = Learner::from_state(client4(), programs, &p.param_specs(), &cfg, &got, 3).unwrap();
    assert_eq!(
        restored.state().unwrap(),
        got,
        "state survives a change of strategy exactly"
    );
}

#[test]
fn a_micro_batch_that_does_not_split_and_a_mesh_larger_than_the_client_are_refused() {
    let p = policy(6, 4);
    let cfg = step_cfg(6, Parallelism::new(Strategy::Fsdp, 4));
    let err = build_train_programs(&cfg, &p.param_specs(), &p.input_specs(), |w, b| p.log_probs(w, b))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("actor.ppo_micro_batch_size = 6: must divide by actor.mesh (4)"),
        "{err}"
    );
    let p = policy(8, 4);
    let cfg = step_cfg(8, Parallelism::new(Strategy::Fsdp, 4));
    let programs =
        build_train_programs(&cfg, &p.param_specs(), &p.input_specs(), |w, b| p.log_probs(w, b)).unwrap();
    let embed = programs.train_step.arg_shardings()[0]
        .clone()
        .expect("a mesh sharding");
    assert_eq!(
        embed.dims()[0],
        vec!["data".to_string()],
        "fsdp splits the embedding's rows"
    );
    assert_eq!(programs.train_step.local_arg_dims(0), vec![2, 16]);
    assert_eq!(programs.gather_params.len(), 1);
    let cfg = step_cfg(8, Parallelism::new(Strategy::Dp, 8));
    // The policy's prompt blocks must follow the mesh: 4 prompt slots do not split over 8.
    let err = build_train_programs(&cfg, &p.param_specs(), &p.input_specs(), |w, b| p.log_probs(w, b))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the policy input prompts has shape [4, 3]") && err.contains("divide by the 8 devices"),
        "{err}"
    );
    let p = policy(8, 8);
    let programs =
        build_train_programs(&cfg, &p.param_specs(), &p.input_specs(), |w, b| p.log_probs(w, b)).unwrap();
    assert_eq!(programs.train_step.num_partitions(), 8);
    assert!(
        programs.gather_params.is_empty(),
        "dp hands out device 0's replica"
    );
    assert_eq!(
        programs.train_step.arg_shardings()[0]
            .as_ref()
            .map(|s| s.is_replicated()),
        Some(true),
        "dp replicates the parameters"
    );
    assert_eq!(programs.train_step.mesh().map(|m| m.num_devices()), Some(8));
    let err = Learner::new(client4(), programs, &p.param_specs(), &cfg, &initial(), 3)
        .err()
        .expect("8 devices on a 4-device client")
        .to_string();
    assert_eq!(
        err,
        "config: actor.mesh = 8: the learner's client has 4 device(s); lower actor.mesh, or on CPU \
         open more devices with cluster.cpu_device_count"
    );
}

#[test]
fn fsdp_in_bf16_hands_a_rollout_engine_whole_bf16_weights_on_device_0() {
    let read = |l: &mut Learner| -> Vec<Vec<f32>> {
        l.shared_params()
            .unwrap()
            .iter()
            .map(|b| {
                assert_eq!((b.dtype(), b.device()), (DType::BF16, 0));
                b.to_host::<half::bf16>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_f32())
                    .collect()
            })
            .collect()
    };
    let mut single = learner_as(ROWS, Parallelism::default(), DType::BF16);
    let mut fsdp = learner_as(ROWS, Parallelism::new(Strategy::Fsdp, 2), DType::BF16);
    // Before the first update both hand out the f32 masters.
    assert!(fsdp
        .shared_params()
        .unwrap()
        .iter()
        .all(|b| b.dtype() == DType::F32 && b.device() == 0));
    let b = batch(1);
    let m = single.upload_micro_batch(0, &micro(&b, 0, ROWS, 1)).unwrap();
    single.step(&[m], 0.01).unwrap();
    let m = fsdp.upload_micro_batch(0, &micro(&b, 0, ROWS, 2)).unwrap();
    fsdp.step(&[m], 0.01).unwrap();
    // The step gathers nothing (a rollout on the learner's devices reads the shards); the
    // whole copy is gathered when asked for.
    let gathers = |l: &Learner| {
        l.compile_log()
            .iter()
            .filter(|r| r.program.starts_with("gather_params"))
            .count()
    };
    assert_eq!(
        gathers(&fsdp),
        1,
        "the f32 gather, for the request before the step"
    );
    let (want, got) = (read(&mut single), read(&mut fsdp));
    assert_eq!(gathers(&fsdp), 2, "the bf16 gather, for the request after it");
    for (i, (a, w)) in got.iter().zip(&want).enumerate() {
        // One bf16 ulp at these magnitudes (< 4) is at most 2^-6.
        assert!(max_diff(a, w) <= 1.0 / 64.0, "bf16 parameter {i}");
    }
    // The f32 masters: the bf16 forward and backward round the gradients (~2^-8 relative, so
    // the moments differ by that much), but the first AdamW step moves each weight by about
    // lr * sign(gradient), so the masters agree as closely as in f32.
    let (a, w) = (fsdp.state().unwrap(), single.state().unwrap());
    let worst = a
        .params
        .iter()
        .zip(&w.params)
        .map(|(x, y)| max_diff(x, y))
        .fold(0.0, f32::max);
    eprintln!("fsdp over 2, bf16 compute: largest master difference {worst:e}");
    assert!(worst <= STATE_TOL, "bf16 masters differ by {worst}");
}

/// The tiny Llama of the tests above with 4 heads (2 KV heads), and the Qwen2 (q/k/v biases,
/// tied head), Qwen3 (q/k norms, untied head) and Gemma 3 (four norms, GeGLU, sliding and
/// global layers) fixtures: 4 heads, 2 KV heads each, so TP=2 splits both and TP=4 splits the
/// query heads and replicates the KV heads.
fn tensor_parallel_configs() -> Vec<ModelConfig> {
    let fixture = |family: &str| {
        let path = format!(
            "{}/../model/fixtures/tiny/{family}/config.json",
            env!("CARGO_MANIFEST_DIR")
        );
        ModelConfig::from_hf_file(std::path::Path::new(&path)).unwrap()
    };
    let llama = TinyLlama {
        vocab: 16,
        hidden: 32,
        intermediate: 48,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        max_positions: 16,
        initializer_range: 0.1,
    }
    .config();
    vec![
        llama,
        fixture("qwen2"),
        fixture("qwen3"),
        fixture("mistral_window"),
        fixture("gemma3"),
    ]
}

/// The learning rate of the tensor-parallel comparisons, realistic for RL post-training
/// (VeRL's GRPO recipes use 1e-6). Adam's normalisation turns the rounding of a gradient
/// element near zero into a parameter move of up to the learning rate, in any two summation
/// orders (the plain data-parallel learner shows the same on these models: 1e-3 after three
/// steps at 1e-2), so the comparison uses a rate at which such moves stay below the tolerance.
const TP_LR: f64 = 1e-5;

/// `STEPS` on-policy steps of a single-device learner: each step's old log-probs are the
/// policy's own before the step and the reference log-probs the reference model's, as in a
/// GRPO run (the probability ratios start at 1, so the gradients are those of a real update,
/// not of the saturated clipping the synthetic batches above exercise). Returns the batches
/// (for another learner to replay), the final state and the metrics.
fn train_on_policy(l: &mut Learner) -> (Vec<Batch>, LearnerState, StepMetrics) {
    let mut batches = Vec::new();
    let mut metrics = Vec::new();
    for step in 0..STEPS {
        let mut b = batch(step as u64 + 1);
        let inputs = micro(&b, 0, ROWS, 1).inputs;
        b.old = l.log_probs(&inputs, false).unwrap();
        b.reference = l.log_probs(&inputs, true).unwrap();
        let mb = l.upload_micro_batch(0, &micro(&b, 0, ROWS, 1)).unwrap();
        metrics.push(l.step(&[mb], TP_LR).unwrap().values);
        batches.push(b);
    }
    (batches, l.state().unwrap(), metrics)
}

/// [`train_on_policy`]'s batches replayed by another learner.
fn replay(l: &mut Learner, batches: &[Batch]) -> (LearnerState, StepMetrics) {
    let blocks = l.mesh().data_devices();
    let metrics = batches
        .iter()
        .map(|b| {
            let mb = l.upload_micro_batch(0, &micro(b, 0, ROWS, blocks)).unwrap();
            l.step(&[mb], TP_LR).unwrap().values
        })
        .collect();
    (l.state().unwrap(), metrics)
}

#[test]
fn tensor_parallel_learners_match_one_device_for_llama_qwen2_qwen3_mistral_and_gemma3() {
    for config in tensor_parallel_configs() {
        let family = config.family;
        let mut single = learner_of(&config, ROWS, Parallelism::default(), DType::F32, Layers::Plain);
        let probe = |blocks| micro(&batch(9), 0, ROWS, blocks).inputs;
        let lp_single = single.log_probs(&probe(1), false).unwrap();
        let (batches, want, want_metrics) = train_on_policy(&mut single);
        let lp_after = single.log_probs(&probe(1), false).unwrap();
        let full_bytes = param_bytes(&single, 0);
        // TP=2 alone, TP=4 (more devices than KV heads: replicated), FSDP=2 x TP=2, and the
        // same with every layer recomputed in the backward pass, and scanned.
        for (strategy, mesh, tp, layers) in [
            (Strategy::Dp, 2, 2, Layers::Plain),
            (Strategy::Dp, 4, 4, Layers::Plain),
            (Strategy::Fsdp, 4, 2, Layers::Plain),
            (Strategy::Fsdp, 4, 2, Layers::Remat),
            (Strategy::Fsdp, 4, 2, Layers::Scan),
        ] {
            let what = format!(
                "{family} {} over {mesh}, tensor parallel {tp}, layers {layers:?}",
                strategy.name(),
            );
            let parallel = Parallelism::new(strategy, mesh).with_tensor_parallel(tp);
            let mut l = learner_of(&config, ROWS, parallel, DType::F32, layers);
            let data = mesh / tp;
            assert_eq!((l.devices(), l.mesh().data_devices()), (mesh, data), "{what}");
            let lp = l.log_probs(&probe(data), false).unwrap();
            assert!(
                max_diff(&lp, &lp_single) <= 1e-5,
                "{what}: log_probs before training"
            );
            let (got, metrics) = replay(&mut l, &batches);
            assert_same_state(&what, &got, &want);
            assert_same_metrics(&what, &metrics, &want_metrics);
            let lp = l.log_probs(&probe(data), false).unwrap();
            assert!(
                max_diff(&lp, &lp_after) <= 1e-5,
                "{what}: log_probs after training"
            );
            // Device 0 holds its shards: the projections, embedding and head split over the
            // model axis.
            let bytes = param_bytes(&l, 0);
            assert!(
                bytes * 3 < full_bytes * 2,
                "{what}: {bytes} parameter bytes on device 0 of {full_bytes}"
            );
            // Whole parameters for a weight stream, gathered onto device 0.
            let whole: Vec<Vec<f32>> = l
                .shared_params()
                .unwrap()
                .iter()
                .map(|b| b.to_host::<f32>().unwrap())
                .collect();
            assert_eq!(
                whole, got.params,
                "{what}: shared_params are the whole parameters"
            );
        }
    }
}

/// A mixture-of-experts policy (the Qwen3-MoE fixture with every layer sparse, so the scanned
/// body fits every layer) under the meshes a dense one runs on: FSDP splits the stacked experts
/// by expert (each device stores whole experts), tensor parallelism splits the attention and
/// the experts, by expert, over the model axis (each device computes its experts for every
/// token). Log-probs, states after training and metrics (the router's included) match one
/// device's, and no device holds every parameter.
#[test]
fn mixture_of_experts_learners_over_fsdp_and_tensor_parallel_match_one_device() {
    let mut config = support::tiny_qwen3_moe();
    config.moe.as_mut().unwrap().mlp_only_layers.clear();
    let mut single = learner_of(&config, ROWS, Parallelism::default(), DType::F32, Layers::Plain);
    let probe = |blocks| micro(&batch(9), 0, ROWS, blocks).inputs;
    let lp_single = single.log_probs(&probe(1), false).unwrap();
    let (batches, want, want_metrics) = train_on_policy(&mut single);
    let routed = |step: &Vec<(&str, f64)>| step.iter().any(|(n, v)| *n == "router_aux_loss" && *v > 0.0);
    assert!(want_metrics.iter().all(routed), "{want_metrics:?}");
    let full_bytes = param_bytes(&single, 0);
    for (strategy, mesh, tp, layers) in [
        (Strategy::Fsdp, 2, 1, Layers::Plain),
        (Strategy::Dp, 2, 2, Layers::Plain),
        (Strategy::Fsdp, 4, 2, Layers::Remat),
        (Strategy::Fsdp, 4, 2, Layers::Scan),
    ] {
        let what = format!(
            "qwen3_moe {} over {mesh}, tensor parallel {tp}, layers {layers:?}",
            strategy.name()
        );
        let parallel = Parallelism::new(strategy, mesh).with_tensor_parallel(tp);
        let mut l = learner_of(&config, ROWS, parallel, DType::F32, layers);
        let data = mesh / tp;
        let lp = l.log_probs(&probe(data), false).unwrap();
        assert!(
            max_diff(&lp, &lp_single) <= 1e-5,
            "{what}: log_probs before training"
        );
        let (got, metrics) = replay(&mut l, &batches);
        assert_same_state(&what, &got, &want);
        assert_same_metrics(&what, &metrics, &want_metrics);
        if strategy == Strategy::Fsdp || tp > 1 {
            let bytes = param_bytes(&l, 0);
            assert!(
                bytes * 3 < full_bytes * 2,
                "{what}: {bytes} parameter bytes on device 0 of {full_bytes}"
            );
        }
    }
}
