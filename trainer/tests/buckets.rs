//! Length buckets change the padding, not the update: a tiny random-weight Llama policy trained
//! for two steps with micro-batches padded to buckets of 4 columns ends with the same metrics,
//! parameters and Adam moments as the same learner padding every row to the full `P + L`, within
//! f32 rounding. Step 1 accumulates four micro-batches of different buckets into one AdamW step
//! (`accumulate` + `apply`), step 2 is a single micro-batch (`train_step`); the old and reference
//! log-probs come from the bucketed `log_probs` programs. Checked with the KL loss, entropy bonus
//! and rollout importance sampling on (`token-mean`), with `seq-mean-token-sum-norm` (whose
//! normaliser is the full `L`, not the bucket's), and with the bucketed learner data parallel
//! over 2 devices.

use model::{random_init, ModelConfig};
use testkit::TinyLlama;
use trainer::bucket::{BucketedLearner, PackedMicroBatch};
use trainer::config::{LossAggMode, OptimConfig, Parallelism, PolicyLossConfig, Strategy};
use trainer::policy::DecoderPolicy;
use trainer::step::{
    build_shape_programs, mini_batch_normalizer, LearnerState, MicroBatchHost, StepConfig, StepMetrics,
};
use xla::runtime::Client;
use xla::DType;

const PROMPT: usize = 12;
const RESPONSE: usize = 10;
const MICRO: usize = 2;
const VOCAB: u64 = 11;
const BUCKET: usize = 4;

fn client() -> &'static Client {
    testkit::cpu_client(2)
}

fn tiny_llama() -> ModelConfig {
    TinyLlama {
        vocab: VOCAB as usize,
        max_positions: 32,
        ..TinyLlama::default()
    }
    .config()
}

fn policy() -> DecoderPolicy {
    DecoderPolicy {
        config: tiny_llama(),
        prompt_len: PROMPT,
        response_len: RESPONSE,
        micro_batch_size: MICRO,
        temperature: 0.9,
        group_size: 1,
        blocks: 1,
        remat: false,
        scan: false,
        lora: None,
        lora_form: Default::default(),
        head: Default::default(),
        route_inputs: false,
        moe_lowering: Default::default(),
    }
}

fn step_cfg(loss: PolicyLossConfig, parallel: Parallelism) -> StepConfig {
    StepConfig {
        loss,
        optim: OptimConfig {
            lr: 0.01,
            grad_clip: Some(1.0),
            weight_decay: 0.01,
            ..Default::default()
        },
        compute_dtype: DType::F32,
        micro_batch_size: MICRO as i64,
        response_len: RESPONSE as i64,
        parallel,
        frozen: Vec::new(),
        value_loss: None,
    }
}

/// One sample: prompt, response, rollout importance weights, advantage.
struct Sample {
    prompt: Vec<u32>,
    response: Vec<u32>,
    is_weights: Vec<f32>,
    advantage: f32,
}

/// Rows in micro-batches of 2 whose buckets differ: (longest prompt, longest response) per
/// micro-batch (3, 2) -> 4+4, (7, 5) -> 8+8, (12, 10) -> 12+10 (the full shape), (5, 0) -> 8+4
/// with an empty response.
fn samples() -> Vec<Sample> {
    let lens = [(3, 2), (2, 1), (7, 5), (6, 3), (12, 10), (9, 4), (5, 0), (4, 0)];
    let mut state = 7u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        state >> 33
    };
    lens.iter()
        .enumerate()
        .map(|(i, &(p, r))| Sample {
            prompt: (0..p).map(|_| 1 + (next() % (VOCAB - 1)) as u32).collect(),
            response: (0..r).map(|_| (next() % VOCAB) as u32).collect(),
            is_weights: (0..r).map(|_| 0.2 + (next() % 100) as f32 / 50.0).collect(),
            advantage: if i % 3 == 0 { 0.8 } else { -0.6 + 0.1 * i as f32 },
        })
        .collect()
}

fn initial() -> Vec<Vec<f32>> {
    random_init(&tiny_llama(), 11)
        .tensors
        .iter()
        .map(|t| t.to_f32_vec())
        .collect()
}

fn learner(loss: PolicyLossConfig, parallel: Parallelism, multiple: usize) -> BucketedLearner {
    let init = initial();
    let state = LearnerState::fresh(init.clone());
    let policy = DecoderPolicy {
        blocks: parallel.devices(MICRO as i64).unwrap(),
        remat: false,
        scan: false,
        ..policy()
    };
    let mut l =
        BucketedLearner::from_state(client(), policy, step_cfg(loss, parallel), &state, multiple, 3).unwrap();
    l.learner_mut().set_reference(&init).unwrap();
    l
}

/// `[rows, L]` per-token values of `rows`, zero past each response.
fn per_token(rows: &[&Sample], f: impl Fn(&Sample, usize) -> f32) -> Vec<f32> {
    let mut out = vec![0.0; rows.len() * RESPONSE];
    for (i, s) in rows.iter().enumerate() {
        for j in 0..s.response.len() {
            out[i * RESPONSE + j] = f(s, j);
        }
    }
    out
}

/// One optimizer step over `rows` in micro-batches of 2; returns the metrics and the old
/// log-probs the learner computed.
fn step(l: &mut BucketedLearner, rows: &[&Sample]) -> (StepMetrics, Vec<f32>) {
    let packed: Vec<PackedMicroBatch> = rows
        .chunks(MICRO)
        .map(|c| {
            let pairs: Vec<(&[u32], &[u32])> = c.iter().map(|s| (&s.prompt[..], &s.response[..])).collect();
            l.pack(&pairs).unwrap()
        })
        .collect();
    let mut old = Vec::new();
    let mut reference = Vec::new();
    for p in &packed {
        old.extend(l.log_probs(p, false).unwrap());
        reference.extend(l.log_probs(p, true).unwrap());
    }
    let mask = per_token(rows, |_, _| 1.0);
    let norm = mini_batch_normalizer(&mask, RESPONSE);
    let micro: Vec<_> = packed
        .iter()
        .enumerate()
        .map(|(k, p)| {
            let r = k * MICRO..(k + 1) * MICRO;
            let cols = r.start * RESPONSE..r.end * RESPONSE;
            let chunk = &rows[r];
            let host = MicroBatchHost {
                old_log_probs: old[cols.clone()].to_vec(),
                advantages: per_token(chunk, |s, _| s.advantage),
                response_mask: mask[cols.clone()].to_vec(),
                ref_log_probs: Some(reference[cols].to_vec()),
                rollout_is_weights: Some(per_token(chunk, |s, j| s.is_weights[j])),
                norm,
                inputs: Vec::new(),
                values: None,
                returns: None,
            };
            l.upload(k, p, &host).unwrap()
        })
        .collect();
    (l.step(&micro, 0.01).unwrap(), old)
}

fn close(what: &str, a: f64, b: f64, tol: f64) {
    assert!(
        (a - b).abs() <= tol * (1.0 + a.abs().max(b.abs())),
        "{what}: bucketed {a} vs full length {b}"
    );
}

fn same_update(loss: PolicyLossConfig, parallel: Parallelism) {
    let all = samples();
    let rows: Vec<&Sample> = all.iter().collect();
    let mut full = learner(loss.clone(), Parallelism::default(), 0);
    let mut bucketed = learner(loss, parallel, BUCKET);
    // Step 1: four micro-batches of four buckets accumulated; step 2: one micro-batch.
    for (k, batch) in [&rows[..], &rows[2..4]].into_iter().enumerate() {
        let (m_full, old_full) = step(&mut full, batch);
        let (m_bucketed, old_bucketed) = step(&mut bucketed, batch);
        for (i, (a, b)) in old_bucketed.iter().zip(&old_full).enumerate() {
            close(&format!("step {k} old log-prob {i}"), *a as f64, *b as f64, 1e-5);
        }
        assert!(m_full.update_applied && m_bucketed.update_applied, "step {k}");
        for name in [
            "loss",
            "pg_loss",
            "kl_loss",
            "entropy",
            "ppo_kl",
            "pg_clipfrac",
            "grad_norm",
        ] {
            close(
                &format!("step {k} {name}"),
                m_bucketed.get(name).unwrap(),
                m_full.get(name).unwrap(),
                1e-5,
            );
        }
        assert!(
            m_full.get("grad_norm").unwrap() > 1e-3,
            "step {k}: the update must move something"
        );
    }
    let (a, b) = (
        bucketed.learner().state().unwrap(),
        full.learner().state().unwrap(),
    );
    assert_eq!(a.adam_step, 2);
    assert_eq!(b.adam_step, 2);
    let init = initial();
    let mut moved = 0.0f32;
    for (what, xs, ys) in [
        ("params", &a.params, &b.params),
        ("adam_m", &a.m, &b.m),
        ("adam_v", &a.v, &b.v),
    ] {
        for (t, (x, y)) in xs.iter().zip(ys).enumerate() {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                assert!(
                    (p - q).abs() <= 1e-5 * (1.0 + q.abs()),
                    "{what} tensor {t} element {i}: bucketed {p} vs full length {q}"
                );
            }
        }
    }
    for (x, y) in b.params.iter().zip(&init) {
        for (p, q) in x.iter().zip(y) {
            moved = moved.max((p - q).abs());
        }
    }
    assert!(moved > 1e-3, "the parameters must move (max change {moved})");

    // The bucketed learner ran four shapes (the full one included), each program loaded once.
    assert_eq!(
        bucketed.shapes(),
        vec![(4, 4), (8, 4), (8, 8), (PROMPT, RESPONSE)],
        "bucket shapes"
    );
    assert_eq!(full.shapes(), vec![(PROMPT, RESPONSE)]);
    let log = bucketed.learner().compile_log();
    for (i, r) in log.iter().enumerate() {
        assert!(
            !log[..i]
                .iter()
                .any(|s| s.program == r.program && s.shape == r.shape),
            "{} of shape {:?} was loaded twice: {log:?}",
            r.program,
            r.shape
        );
    }
    // log_probs and accumulate for the four shapes, apply once, train_step for step 2's shape.
    let count = |name: &str| log.iter().filter(|r| r.program == name).count();
    assert_eq!(
        (
            count("log_probs"),
            count("accumulate"),
            count("apply"),
            count("train_step")
        ),
        (4, 4, 1, 1),
        "{log:?}"
    );
}

/// KL loss, entropy bonus and rollout importance weights on.
fn full_loss() -> PolicyLossConfig {
    PolicyLossConfig {
        use_kl_loss: true,
        kl_loss_coef: 0.1,
        entropy_coeff: 0.01,
        rollout_is_weights: true,
        ..Default::default()
    }
}

#[test]
fn bucketed_update_equals_full_length_update() {
    same_update(full_loss(), Parallelism::default());
}

#[test]
fn bucketed_update_keeps_the_full_length_in_seq_mean_token_sum_norm() {
    same_update(
        PolicyLossConfig {
            loss_agg_mode: LossAggMode::SeqMeanTokenSumNorm,
            ..Default::default()
        },
        Parallelism::default(),
    );
}

#[test]
fn bucketed_data_parallel_update_equals_single_device_full_length() {
    // The same loss as the single-device test, so the full-length programs come from the
    // client's executable cache.
    same_update(full_loss(), Parallelism::new(Strategy::Dp, 2));
}

#[test]
fn a_micro_batch_packed_elsewhere_is_refused() {
    let all = samples();
    let mut l = learner(PolicyLossConfig::default(), Parallelism::default(), BUCKET);
    let short = l.pack(&[(&all[0].prompt[..], &all[0].response[..])]).unwrap();
    assert_eq!((short.prompt_len, short.response_len, short.width()), (4, 4, 8));
    // Per-token arrays of a longer response than the bucket holds.
    let host = MicroBatchHost {
        old_log_probs: vec![0.0; MICRO * RESPONSE],
        advantages: vec![0.0; MICRO * RESPONSE],
        response_mask: vec![1.0; MICRO * RESPONSE],
        rollout_is_weights: Some(vec![1.0; MICRO * RESPONSE]),
        norm: (1.0, 1.0),
        ..Default::default()
    };
    let err = l.upload(0, &short, &host).err().unwrap().to_string();
    assert!(err.contains("response_mask has tokens past column 4"), "{err}");
    let host = MicroBatchHost {
        old_log_probs: vec![0.0; 3],
        ..host
    };
    let err = l.upload(0, &short, &host).err().unwrap().to_string();
    assert!(
        err.contains("old_log_probs has 3 values; expected 2 x 10"),
        "{err}"
    );
}

#[test]
fn shapes_built_for_another_configuration_are_refused() {
    let mut l = learner(PolicyLossConfig::default(), Parallelism::default(), BUCKET);
    let short = policy().with_lengths(4, 4);
    let build = |loss: PolicyLossConfig, parallel: Parallelism, response_len: i64| {
        let p = short.clone();
        build_shape_programs(
            &step_cfg(loss, parallel),
            &short.param_specs(),
            &short.input_specs(),
            response_len,
            move |w, b| p.log_probs(w, b),
        )
    };
    let kl = PolicyLossConfig {
        use_kl_loss: true,
        ..Default::default()
    };
    let err = l
        .learner_mut()
        .add_shape(build(kl, Parallelism::default(), 4).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("take the loss inputs") && err.contains("ref_log_probs"),
        "{err}"
    );
    let err = l
        .learner_mut()
        .add_shape(build(PolicyLossConfig::default(), Parallelism::new(Strategy::Dp, 2), 4).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("span 2 device(s); this learner runs on 1"), "{err}");
    let err = build(
        PolicyLossConfig::default(),
        Parallelism::default(),
        RESPONSE as i64 + 1,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("outside 1..=10"), "{err}");
    assert_eq!(l.learner().num_shapes(), 1);
    let ok = l
        .learner_mut()
        .add_shape(build(PolicyLossConfig::default(), Parallelism::default(), 4).unwrap())
        .unwrap();
    assert_eq!((ok, l.learner().shape_response_len(ok)), (1, Some(4)));
}

#[test]
fn a_policy_whose_blocks_do_not_follow_the_mesh_is_refused() {
    let state = LearnerState::fresh(initial());
    let err = BucketedLearner::from_state(
        client(),
        policy(),
        step_cfg(PolicyLossConfig::default(), Parallelism::new(Strategy::Dp, 2)),
        &state,
        BUCKET,
        3,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("packs its rows in 1 blocks but the learner splits them over 2 devices"),
        "{err}"
    );
}
