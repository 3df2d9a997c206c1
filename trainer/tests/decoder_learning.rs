//! GRPO through a real (tiny, random-weight) Llama decoder: the learner's view of a sampled
//! token's log-probability equals the sampler's, and training raises the mean reward on a task
//! with a verifiable answer, deterministically for a fixed seed.
//!
//! Task: the prompt is `[BOS, c]`; the reward is 1 when the one-token response is
//! `answer(c)`, else 0. Sampling reads the learner's parameter buffers where they are.

mod support;

use model::forward::{full_logits_graph, DecoderParams};
use model::{random_init, ModelConfig};
use support::{client, Rng};
use testkit::TinyLlama;
use trainer::advantage::{broadcast_over_response, grpo_outcome_advantage, GRPO_EPSILON};
use trainer::config::{OptimConfig, PolicyLossConfig};
use trainer::policy::DecoderPolicy;
use trainer::step::{build_train_programs, mini_batch_normalizer, Learner, MicroBatchHost, StepConfig};
use xla::graph::Graph;
use xla::runtime::Executable;
use xla::DType;

const V: usize = 8;
const PROMPTS: usize = 4;
const GROUP: usize = 8;
const ROWS: usize = PROMPTS * GROUP;

fn answer(c: u32) -> u32 {
    2 + (2 * c + 1) % 6
}

fn tiny_llama() -> ModelConfig {
    TinyLlama {
        vocab: V,
        hidden: 32,
        intermediate: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        max_positions: 16,
        initializer_range: 0.02,
    }
    .config()
}

/// `[ROWS, V]` next-token log-probs after each 2-token prompt, from parameter buffers.
fn sampler(config: &ModelConfig) -> Executable {
    let g = Graph::new("sample_next");
    let p = DecoderParams::declare(&g, config, DType::F32);
    let tokens = g.parameter("tokens", DType::I32, &[ROWS as i64, 2]);
    let mask = g.parameter("mask", DType::I32, &[ROWS as i64, 2]);
    let logits = full_logits_graph(&p, &tokens, &mask);
    let last = logits.slice_axis(1, 1, 2).reshape(&[ROWS as i64, V as i64]);
    g.build(&[&last.log_softmax(-1)])
        .unwrap()
        .compile(client())
        .unwrap()
}

/// The learner's log-probs of the response column for packed rows, from parameter buffers.
fn learner_view(policy: &DecoderPolicy) -> Executable {
    let g = Graph::new("learner_view");
    let p = DecoderParams::declare(&g, &policy.config, DType::F32);
    let inputs: Vec<_> = policy
        .input_specs()
        .iter()
        .map(|s| g.parameter(&s.name, s.dtype, &s.dims))
        .collect();
    let out = policy.log_probs(&p.all, &inputs);
    g.build(&[&out.log_probs]).unwrap().compile(client()).unwrap()
}

/// Mean reward per step of a seeded GRPO run.
fn train(seed: u64, steps: usize, check_alignment: bool) -> Vec<f64> {
    let config = tiny_llama();
    let policy = DecoderPolicy {
        config: config.clone(),
        prompt_len: 2,
        response_len: 1,
        micro_batch_size: ROWS,
        temperature: 1.0,
        group_size: GROUP,
        blocks: 1,
        remat: false,
        scan: false,
        lora: None,
        lora_form: Default::default(),
        head: Default::default(),
        route_inputs: false,
        moe_lowering: Default::default(),
    };
    let specs = policy.param_specs();
    let cfg = StepConfig {
        loss: PolicyLossConfig::default(),
        optim: OptimConfig {
            lr: 0.01,
            grad_clip: Some(1.0),
            weight_decay: 0.0,
            ..Default::default()
        },
        compute_dtype: DType::F32,
        micro_batch_size: ROWS as i64,
        response_len: 1,
        parallel: Default::default(),
        frozen: Vec::new(),
        value_loss: None,
    };
    let programs =
        build_train_programs(&cfg, &specs, &policy.input_specs(), |p, b| policy.log_probs(p, b)).unwrap();
    let init: Vec<Vec<f32>> = random_init(&config, seed)
        .tensors
        .iter()
        .map(|t| t.to_f32_vec())
        .collect();
    let mut learner = Learner::new(client(), programs, &specs, &cfg, &init, 3).unwrap();
    let sample_next = sampler(&config);
    let view = check_alignment.then(|| learner_view(&policy));

    let mut rng = Rng::new(seed);
    let mut mean_rewards = Vec::new();
    for _ in 0..steps {
        let contexts: Vec<u32> = (0..PROMPTS).map(|_| 2 + rng.below(6) as u32).collect();
        let prompts: Vec<[u32; 2]> = contexts
            .iter()
            .flat_map(|&c| std::iter::repeat_n([1, c], GROUP))
            .collect();
        let tokens: Vec<i32> = prompts.iter().flat_map(|p| p.map(|t| t as i32)).collect();
        let tok = client().buffer_from_host(&tokens, &[ROWS as i64, 2], 0).unwrap();
        let ones = client()
            .buffer_from_host(&vec![1i32; ROWS * 2], &[ROWS as i64, 2], 0)
            .unwrap();
        let mut args: Vec<&xla::runtime::Buffer> = learner.params().iter().collect();
        args.extend([&tok, &ones]);
        let logp = sample_next.execute(&args).unwrap()[0].to_host::<f32>().unwrap();

        let (mut responses, mut old, mut rewards) = (Vec::new(), Vec::new(), Vec::new());
        for (row, prompt) in prompts.iter().enumerate() {
            let dist = &logp[row * V..(row + 1) * V];
            let u = rng.uniform(0.0, 1.0);
            let (mut acc, mut pick) = (0.0, V - 1);
            for (k, lp) in dist.iter().enumerate() {
                acc += (*lp as f64).exp();
                if u < acc {
                    pick = k;
                    break;
                }
            }
            responses.push([pick as u32]);
            old.push(dist[pick]);
            rewards.push(if pick as u32 == answer(prompt[1]) {
                1.0
            } else {
                0.0
            });
        }
        mean_rewards.push(rewards.iter().sum::<f64>() / ROWS as f64);

        let rows: Vec<(&[u32], &[u32])> = prompts
            .iter()
            .zip(&responses)
            .map(|(p, r)| (&p[..], &r[..]))
            .collect();
        let packed = policy.pack(&rows).unwrap();
        if let Some(view) = &view {
            let inputs: Vec<xla::runtime::Buffer> = packed
                .inputs(false)
                .iter()
                .zip(policy.input_specs())
                .map(|(a, s)| a.to_device(client(), &s.dims, 0).unwrap())
                .collect();
            let mut args: Vec<&xla::runtime::Buffer> = learner.params().iter().collect();
            args.extend(inputs.iter());
            let seen = view.execute(&args).unwrap()[0].to_host::<f32>().unwrap();
            for (a, b) in seen.iter().zip(&old) {
                assert!((a - b).abs() < 1e-5, "learner log-prob {a} vs sampler {b}");
            }
        }
        let groups: Vec<usize> = (0..ROWS).map(|i| i / GROUP).collect();
        let adv = grpo_outcome_advantage(&rewards, &groups, GRPO_EPSILON, true).unwrap();
        let adv = broadcast_over_response(&adv, &packed.response_mask, 1).unwrap();
        let mb = MicroBatchHost {
            old_log_probs: old,
            advantages: adv,
            norm: mini_batch_normalizer(&packed.response_mask, 1),
            response_mask: packed.response_mask.clone(),
            inputs: packed.inputs(false),
            ..Default::default()
        };
        let mb = learner.upload_micro_batch(0, &mb).unwrap();
        let m = learner.step(&[mb], 0.01).unwrap();
        assert!(m.update_applied);
    }
    mean_rewards
}

#[test]
fn learner_and_sampler_agree_on_log_probs() {
    train(7, 3, true);
}

#[test]
fn grpo_through_a_decoder_raises_the_mean_reward_deterministically() {
    let steps = 60;
    let run = train(11, steps, false);
    assert_eq!(run, train(11, steps, false), "the same seed gave a different run");
    let first = run[..8].iter().sum::<f64>() / 8.0;
    let last = run[steps - 8..].iter().sum::<f64>() / 8.0;
    eprintln!("mean reward: first 8 steps {first:.3}, last 8 steps {last:.3}");
    assert!(
        last > first + 0.3,
        "mean reward did not rise: {first:.3} -> {last:.3}\n{run:?}"
    );
}
