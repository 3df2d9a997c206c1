//! Learning: a tiny policy trained with GRPO on a task with a verifiable answer (given a
//! context token `c`, answer `(2c + 1) mod V`) raises its mean reward, deterministically for a
//! fixed seed. The loop is the whole learner path on the CPU plugin: sampling from the current
//! device parameters, rewards, GRPO advantages, dynamic sampling (zero-variance groups masked
//! out), one fused `train_step` per mini-batch.

mod support;

use model::{ParamKind, ParamSpec};
use support::{client, tiny_policy, Rng};
use trainer::advantage::{broadcast_over_response, filter_groups, grpo_outcome_advantage, GRPO_EPSILON};
use trainer::config::{OptimConfig, PolicyLossConfig};
use trainer::step::{
    build_train_programs, mini_batch_normalizer, HostArray, InputSpec, Learner, MicroBatchHost, PolicyOutput,
    StepConfig,
};
use xla::graph::Graph;
use xla::DType;

const V: i64 = 6;
const H: i64 = 8;
const PROMPTS: usize = 4;
const GROUP: usize = 4;
const ROWS: i64 = (PROMPTS * GROUP) as i64;

fn answer(c: i32) -> i32 {
    (2 * c + 1) % V as i32
}

/// Mean reward of each step of a seeded run of `steps` GRPO steps.
fn train(seed: u64, steps: usize) -> Vec<f64> {
    let specs = vec![
        ParamSpec::new("emb", vec![V as usize, H as usize], ParamKind::Matrix),
        ParamSpec::new("out", vec![H as usize, V as usize], ParamKind::Matrix),
    ];
    let inputs = vec![
        InputSpec {
            name: "ids".into(),
            dtype: DType::I32,
            dims: vec![ROWS, 1],
        },
        InputSpec {
            name: "targets".into(),
            dtype: DType::I32,
            dims: vec![ROWS, 1],
        },
    ];
    let cfg = StepConfig {
        loss: PolicyLossConfig::default(),
        optim: OptimConfig {
            lr: 0.05,
            grad_clip: Some(1.0),
            ..Default::default()
        },
        compute_dtype: DType::F32,
        micro_batch_size: ROWS,
        response_len: 1,
        parallel: Default::default(),
        frozen: Vec::new(),
        value_loss: None,
    };
    let programs = build_train_programs(&cfg, &specs, &inputs, |p, b| {
        let (lp, ent) = tiny_policy(p, b);
        PolicyOutput {
            log_probs: lp,
            entropy: Some(ent),
            router: None,
            chosen: None,
        }
    })
    .unwrap();
    let mut rng = Rng::new(seed);
    let init: Vec<Vec<f32>> = specs
        .iter()
        .map(|s| {
            rng.vec(s.numel(), -0.5, 0.5)
                .into_iter()
                .map(|x| x as f32)
                .collect()
        })
        .collect();
    let mut learner = Learner::new(client(), programs, &specs, &cfg, &init, 3).unwrap();

    // the sampling program reads the learner's parameters where they are, on the device
    let g = Graph::new("next_token_log_probs");
    let emb = g.parameter("emb", DType::F32, &[V, H]);
    let out = g.parameter("out", DType::F32, &[H, V]);
    let ids = g.parameter("ids", DType::I32, &[ROWS, 1]);
    let logp = emb.take(&ids, 0).tanh().matmul(&out).log_softmax(-1);
    let sampler = g.build(&[&logp]).unwrap().compile(client()).unwrap();

    let mut mean_rewards = Vec::new();
    for _ in 0..steps {
        let contexts: Vec<i32> = (0..PROMPTS).map(|_| rng.below(V as u64) as i32).collect();
        let ids: Vec<i32> = contexts
            .iter()
            .flat_map(|c| std::iter::repeat_n(*c, GROUP))
            .collect();
        let ids_buf = client().buffer_from_host(&ids, &[ROWS, 1], 0).unwrap();
        let params = learner.params();
        let logp = sampler.execute(&[&params[0], &params[1], &ids_buf]).unwrap()[0]
            .to_host::<f32>()
            .unwrap();
        let (mut tokens, mut old, mut rewards) = (Vec::new(), Vec::new(), Vec::new());
        for (row, c) in ids.iter().enumerate() {
            let dist = &logp[row * V as usize..(row + 1) * V as usize];
            let u = rng.uniform(0.0, 1.0);
            let mut acc = 0.0;
            let mut tok = V as usize - 1;
            for (k, lp) in dist.iter().enumerate() {
                acc += (*lp as f64).exp();
                if u < acc {
                    tok = k;
                    break;
                }
            }
            tokens.push(tok as i32);
            old.push(dist[tok]);
            rewards.push(if tok as i32 == answer(*c) { 1.0 } else { 0.0 });
        }
        mean_rewards.push(rewards.iter().sum::<f64>() / rewards.len() as f64);
        let groups: Vec<usize> = (0..ROWS as usize).map(|i| i / GROUP).collect();
        let kept = filter_groups(&rewards, &groups).unwrap();
        let mask: Vec<f32> = (0..ROWS as usize)
            .map(|i| if kept.contains(&i) { 1.0 } else { 0.0 })
            .collect();
        let adv = grpo_outcome_advantage(&rewards, &groups, GRPO_EPSILON, true).unwrap();
        let adv = broadcast_over_response(&adv, &mask, 1).unwrap();
        let mb = MicroBatchHost {
            old_log_probs: old,
            advantages: adv,
            norm: mini_batch_normalizer(&mask, 1),
            response_mask: mask,
            inputs: vec![HostArray::I32(ids), HostArray::I32(tokens)],
            ..Default::default()
        };
        let mb = learner.upload_micro_batch(0, &mb).unwrap();
        let m = learner.step(&[mb], 0.05).unwrap();
        assert!(m.update_applied);
    }
    mean_rewards
}

#[test]
fn grpo_raises_the_mean_reward_deterministically() {
    let steps = 60;
    let run = train(2024, steps);
    let again = train(2024, steps);
    assert_eq!(run, again, "the same seed gave a different run");
    let first: f64 = run[..10].iter().sum::<f64>() / 10.0;
    let last: f64 = run[steps - 10..].iter().sum::<f64>() / 10.0;
    eprintln!("mean reward: first 10 steps {first:.3}, last 10 steps {last:.3}");
    assert!(first < 0.4, "the task is too easy at the start: {first}");
    assert!(
        last > first + 0.4,
        "mean reward did not rise enough: {first} -> {last}\n{run:?}"
    );
}
