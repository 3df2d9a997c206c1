//! Multi-turn rows in the GRPO update: the environment's tokens are context, never trained.
//! Rows whose responses end with an environment span are updated twice, once with those
//! environment tokens replaced by others: since nothing after them reads them, only their own
//! positions' targets differ, and the parameters after the update must be bit-identical (no
//! gradient reaches those targets). The same rows without the spans (the last tokens trained as
//! the model's) must move the parameters differently, so the check can fail. The update's
//! token counts count only the model's tokens.

mod support;

use model::random_init;
use support::tiny_llama;
use trainer::config::{AdvantageConfig, KlControl, KlPenalty, OptimConfig, Parallelism, PolicyLossConfig};
use trainer::policy::DecoderPolicy;
use trainer::rollout_correction::RolloutCorrection;
use trainer::step::StepConfig;
use trainer::update::{BatchPlan, GrpoUpdate, Row, UpdateClocks, UpdateConfig};
use xla::DType;

const PROMPT: usize = 6;
const RESPONSE: usize = 12;
const GROUP: usize = 2;

fn update() -> GrpoUpdate {
    let policy = DecoderPolicy {
        config: tiny_llama(),
        prompt_len: PROMPT,
        response_len: RESPONSE,
        micro_batch_size: 4,
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
    let config = UpdateConfig {
        step: StepConfig {
            loss: PolicyLossConfig::default(),
            optim: OptimConfig {
                lr: 0.05,
                ..Default::default()
            },
            compute_dtype: DType::F32,
            micro_batch_size: 4,
            response_len: RESPONSE as i64,
            parallel: Parallelism::default(),
            frozen: Vec::new(),
            value_loss: None,
        },
        batches: BatchPlan {
            prompts_per_step: 2,
            group_size: GROUP,
            mini_batch_prompts: 2,
            micro_batch_size: 4,
            epochs: 1,
        },
        advantage: AdvantageConfig::default(),
        use_kl_in_reward: false,
        kl_coef: 0.0,
        kl_penalty: KlPenalty::K1,
        kl_ctrl: KlControl::Fixed,
        mask_truncated_responses: false,
        use_rollout_log_probs: false,
        rollout_correction: RolloutCorrection::default(),
        length_bucket: 0,
        max_consecutive_nonfinite: 3,
        critic: None,
        router_replay: Default::default(),
    };
    let initial: Vec<Vec<f32>> = random_init(&tiny_llama(), 5)
        .tensors
        .iter()
        .map(|t| t.to_f32_vec())
        .collect();
    GrpoUpdate::start(
        testkit::cpu_client(1),
        policy,
        config,
        initial,
        Vec::new(),
        None,
        UpdateClocks::default(),
        None,
    )
    .unwrap()
}

/// Two groups of two: model turn, environment span, model turn, and a final environment span
/// `tail` (what a sample cut by its budget after a tool result would hold).
fn rows(tail: [u32; 3], spans: bool) -> Vec<Row> {
    let responses = [
        [3, 4, 5, 1, 9, 9, 7, 8, 2, 0, 0, 0],
        [6, 5, 1, 9, 9, 11, 12, 13, 2, 0, 0, 0],
        [7, 1, 9, 9, 4, 4, 2, 0, 0, 0, 0, 0],
        [8, 8, 8, 1, 9, 9, 5, 2, 0, 0, 0, 0],
    ];
    let lens = [9, 9, 7, 8];
    let env_start = [4, 3, 2, 4];
    (0..4)
        .map(|i| {
            let mut response = responses[i][..lens[i]].to_vec();
            let end = response.len();
            response.extend(tail);
            Row {
                group: (i / GROUP) as u64,
                prompt: vec![1 + i as u32, 2, 3, 4],
                rollout_log_probs: vec![-1.0; response.len()],
                response,
                score: [1.0, 0.0, 0.0, 1.0][i],
                reward_baseline: None,
                truncated: false,
                env_spans: if spans {
                    vec![env_start[i]..env_start[i] + 2, end..end + 3]
                } else {
                    Vec::new()
                },
                routes: Vec::new(),
            }
        })
        .collect()
}

fn trained(rows: &[Row]) -> (Vec<Vec<f32>>, trainer::update::UpdateReport) {
    let mut u = update();
    let report = u.update(rows).unwrap();
    let state = u.learner_mut().learner_mut().state().unwrap();
    (state.params, report)
}

#[test]
fn environment_tokens_get_no_gradient_and_count_in_no_loss() {
    let (a, report) = trained(&rows([14, 15, 16], true));
    let (b, _) = trained(&rows([20, 21, 22], true));
    assert!(a == b, "the environment's last tokens changed the update");

    let (c, _) = trained(&rows([14, 15, 16], false));
    let (d, plain) = trained(&rows([20, 21, 22], false));
    assert!(
        c != d,
        "trained as the model's, the last tokens must change the update"
    );
    assert!(a != c);

    // 9 + 9 + 7 + 8 response tokens before the tail; 2 environment tokens in each middle span.
    assert_eq!(report.trained_tokens, 33 - 8);
    assert_eq!(plain.trained_tokens, 33 + 12);
}

#[test]
fn environment_spans_outside_the_response_are_refused() {
    let mut bad = rows([14, 15, 16], true);
    bad[2].env_spans = vec![3..5, 4..6];
    let err = update().update(&bad).unwrap_err().to_string();
    assert!(
        err.contains("environment span 4..6") && err.contains("group 1"),
        "{err}"
    );
    bad[2].env_spans = vec![1..2, 8..20];
    let err = update().update(&bad).unwrap_err().to_string();
    assert!(err.contains("past its 10 response tokens"), "{err}");
}
