//! PPO's critic in the update (`algorithm.adv_estimator: gae`): the value model reads each
//! response column's value at the position that predicts that column's token (checked against
//! the whole row run through the trunk), the critic learns GAE's returns over a few updates, and
//! `trainer.critic_warmup` holds the actor still while only the critic trains.

mod support;

use model::classifier::{value_model_init, value_model_param_table, values_graph};
use model::forward::{hidden_states_graph, DecoderParams};
use model::{random_init, HostTensor};
use support::{eval, tiny_llama, In};
use trainer::config::{
    AdvantageConfig, AdvantageEstimator, KlControl, KlPenalty, OptimConfig, Parallelism, PolicyLossConfig,
    ValueLossConfig,
};
use trainer::policy::{DecoderPolicy, Head};
use trainer::rollout_correction::RolloutCorrection;
use trainer::step::{LearnerState, StepConfig};
use trainer::update::{BatchPlan, CriticConfig, CriticStart, GrpoUpdate, Row, UpdateClocks, UpdateConfig};
use xla::DType;

const PROMPT: usize = 6;
const RESPONSE: usize = 8;
const GROUP: usize = 2;
const MICRO: usize = 4;

fn model(head: Head) -> DecoderPolicy {
    DecoderPolicy {
        config: tiny_llama(),
        prompt_len: PROMPT,
        response_len: RESPONSE,
        micro_batch_size: MICRO,
        temperature: 1.0,
        group_size: GROUP,
        blocks: 1,
        remat: false,
        scan: false,
        lora: None,
        lora_form: Default::default(),
        head,
        route_inputs: false,
        moe_lowering: Default::default(),
    }
}

/// The critic's starting tensors, its head's bias moved off zero so that the check sees it.
fn critic_tensors() -> Vec<HostTensor> {
    let mut t = value_model_init(&random_init(&tiny_llama(), 5), 9).unwrap();
    let bias = t.last_mut().unwrap();
    *bias = HostTensor::from_f32(bias.name.clone(), bias.shape.clone(), &[0.3]);
    t
}

/// Two groups of two, responses of different lengths, prompts of different lengths.
fn rows() -> Vec<Row> {
    let responses: [&[u32]; 4] = [
        &[3, 4, 5, 2],
        &[6, 5, 7, 8, 9, 2],
        &[7, 2],
        &[8, 8, 8, 4, 5, 6, 7, 2],
    ];
    let prompts: [&[u32]; 2] = [&[1, 2, 3, 4], &[5, 6, 7, 8, 9, 10]];
    (0..4)
        .map(|i| Row {
            group: (i / GROUP) as u64,
            prompt: prompts[i / GROUP].to_vec(),
            response: responses[i].to_vec(),
            rollout_log_probs: vec![-1.0; responses[i].len()],
            score: [1.0, 0.0, 0.0, 1.0][i],
            reward_baseline: None,
            truncated: false,
            env_spans: Vec::new(),
            routes: Vec::new(),
        })
        .collect()
}

#[test]
fn values_are_read_where_each_response_token_is_predicted() {
    let tensors = critic_tensors();
    let specs = value_model_param_table(&tiny_llama());
    let values: Vec<Vec<f32>> = tensors.iter().map(|t| t.to_f32_vec()).collect();
    let dims: Vec<Vec<i64>> = specs.iter().map(|s| s.dims()).collect();
    let rows = rows();
    for shared in [true, false] {
        let critic = if shared {
            model(Head::Value)
        } else {
            model(Head::Value).unshared()
        };
        let pairs: Vec<(&[u32], &[u32])> = rows.iter().map(|r| (&r.prompt[..], &r.response[..])).collect();
        let packed = critic.pack(&pairs).unwrap();
        let host = packed.inputs(false);
        let input_dims: Vec<Vec<i64>> = critic.input_specs().iter().map(|s| s.dims.clone()).collect();
        let ints: Vec<&[i32]> = host
            .iter()
            .map(|a| match a {
                trainer::step::HostArray::I32(v) => v.as_slice(),
                trainer::step::HostArray::F32(_) => unreachable!("the value model's inputs are ids"),
            })
            .collect();
        let mut inputs: Vec<In> = values.iter().zip(&dims).map(|(v, d)| In::F32(v, d)).collect();
        inputs.extend(ints.iter().zip(&input_dims).map(|(v, d)| In::I32(v, d)));
        let n = specs.len();
        let got = eval(&inputs, |_, t| vec![critic.forward(&t[..n], &t[n..]).log_probs]).remove(0);

        for (i, row) in rows.iter().enumerate() {
            // The whole row through the trunk: the value of response column j sits at position
            // len(prompt) - 1 + j, the one whose output predicts that token.
            let ids: Vec<i32> = row
                .prompt
                .iter()
                .chain(&row.response)
                .map(|&t| t as i32)
                .collect();
            let mask = vec![1i32; ids.len()];
            let d = [1, ids.len() as i64];
            let mut inputs: Vec<In> = values.iter().zip(&dims).map(|(v, d)| In::F32(v, d)).collect();
            inputs.push(In::I32(&ids, &d));
            inputs.push(In::I32(&mask, &d));
            let whole = eval(&inputs, |_, t| {
                let mut trunk = tiny_llama();
                trunk.tie_word_embeddings = true;
                let p = DecoderParams::from_tensors(&trunk, &t[..n - 2]).unwrap();
                let h = hidden_states_graph(&p, &t[n], &t[n + 1]);
                vec![values_graph(&h, &t[n - 2], &t[n - 1])]
            })
            .remove(0);
            for j in 0..RESPONSE {
                let want = if j < row.response.len() {
                    whole[row.prompt.len() - 1 + j]
                } else {
                    0.0
                };
                let have = got[i * RESPONSE + j];
                assert!(
                    (have - want).abs() < 1e-5,
                    "shared prompts {shared}: row {i} column {j}: {have} vs the whole row's {want}"
                );
            }
        }
    }
}

fn step_config(value_loss: Option<ValueLossConfig>, lr: f64) -> StepConfig {
    StepConfig {
        loss: PolicyLossConfig::default(),
        optim: OptimConfig {
            lr,
            ..Default::default()
        },
        compute_dtype: DType::F32,
        micro_batch_size: MICRO as i64,
        response_len: RESPONSE as i64,
        parallel: Parallelism::default(),
        frozen: Vec::new(),
        value_loss,
    }
}

fn ppo(warmup: u64) -> GrpoUpdate {
    let batches = BatchPlan {
        prompts_per_step: 2,
        group_size: GROUP,
        mini_batch_prompts: 2,
        micro_batch_size: MICRO,
        epochs: 1,
    };
    let config = UpdateConfig {
        step: step_config(None, 0.01),
        batches,
        advantage: AdvantageConfig {
            estimator: AdvantageEstimator::Gae,
            ..Default::default()
        },
        use_kl_in_reward: false,
        kl_coef: 0.0,
        kl_penalty: KlPenalty::K1,
        kl_ctrl: KlControl::Fixed,
        mask_truncated_responses: false,
        use_rollout_log_probs: false,
        rollout_correction: RolloutCorrection::default(),
        length_bucket: 0,
        max_consecutive_nonfinite: 3,
        critic: Some(CriticConfig {
            step: step_config(Some(ValueLossConfig::default()), 0.02),
            batches,
            warmup,
        }),
        router_replay: Default::default(),
    };
    let initial: Vec<Vec<f32>> = random_init(&tiny_llama(), 5)
        .tensors
        .iter()
        .map(|t| t.to_f32_vec())
        .collect();
    let critic = CriticStart {
        model: model(Head::Value),
        state: LearnerState::fresh(critic_tensors().iter().map(|t| t.to_f32_vec()).collect()),
    };
    GrpoUpdate::start(
        testkit::cpu_client(1),
        model(Head::LogProbs),
        config,
        initial,
        Vec::new(),
        None,
        UpdateClocks::default(),
        Some(critic),
    )
    .unwrap()
}

fn actor_params(u: &mut GrpoUpdate) -> Vec<Vec<f32>> {
    u.learner_mut().learner_mut().state().unwrap().params
}

fn critic_params(u: &GrpoUpdate) -> Vec<Vec<f32>> {
    u.critic().unwrap().learner().state().unwrap().params
}

#[test]
fn the_critic_learns_the_returns() {
    let mut u = ppo(0);
    let rows = rows();
    let mut reports = Vec::new();
    for _ in 0..12 {
        reports.push(u.update(&rows).unwrap().metrics);
    }
    let metric = |k: usize, name: &str| {
        *reports[k]
            .get(name)
            .unwrap_or_else(|| panic!("update {k} reports no {name}: {:?}", reports[k].keys()))
    };
    let (first, last) = (metric(0, "critic/vf_loss"), metric(11, "critic/vf_loss"));
    eprintln!(
        "vf_loss {first} -> {last}; explained variance {} -> {}",
        metric(0, "critic/vf_explained_var"),
        metric(11, "critic/vf_explained_var")
    );
    assert!(
        last < first / 4.0,
        "the value loss fell only from {first} to {last}"
    );
    assert!(metric(11, "critic/vf_explained_var") > metric(0, "critic/vf_explained_var"));
    for name in [
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
        "critic/values/mean",
        "critic/values/max",
        "critic/values/min",
        "critic/returns/mean",
        "timing_s/values",
        "timing_s/update_critic",
        "actor/pg_loss",
    ] {
        metric(11, name);
    }
    // With gamma = lam = 1 the returns are each sample's reward on every one of its tokens.
    assert!((metric(0, "critic/returns/max") - 1.0).abs() < 1e-6);
    assert!(metric(0, "critic/returns/min").abs() < 1e-6);
    let clocks = u.clocks();
    assert_eq!(
        (
            clocks.updates,
            clocks.critic_optimizer_steps,
            clocks.optimizer_steps
        ),
        (12, 12, 12)
    );
}

#[test]
fn the_actor_waits_for_the_critic_warmup() {
    let mut u = ppo(3);
    let rows = rows();
    let (actor0, critic0) = (actor_params(&mut u), critic_params(&u));
    for update in 1..=2 {
        let report = u.update(&rows).unwrap();
        assert_eq!(
            report.metrics.get("actor/update_skipped"),
            Some(&1.0),
            "update {update}"
        );
        assert!(!report.metrics.contains_key("actor/pg_loss"));
        assert!(report.metrics.contains_key("critic/vf_loss"));
    }
    assert!(
        actor_params(&mut u) == actor0,
        "the actor moved during the warm-up"
    );
    assert!(
        critic_params(&u) != critic0,
        "the critic did not train during the warm-up"
    );
    let report = u.update(&rows).unwrap();
    assert!(report.metrics.contains_key("actor/pg_loss"));
    assert!(
        actor_params(&mut u) != actor0,
        "the actor did not train after the warm-up"
    );
    assert_eq!(u.clocks().optimizer_steps, 1);
    assert_eq!(u.clocks().critic_optimizer_steps, 3);
}
