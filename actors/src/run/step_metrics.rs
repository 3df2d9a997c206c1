//! A training step's outcome as its metrics, under VeRL's names where VeRL has one.

use super::metrics::{mean_std, Metrics};
use super::step::StepOutcome;
use rollout::FinishReason;
use std::collections::HashMap;

/// What a step's metrics are measured against: the recipe's prompt length limit and the devices the
/// run computes on (VeRL's `n_gpus` in `perf/throughput`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MetricLimits {
    pub max_prompt_length: usize,
    pub devices: usize,
    /// `rollout.multi_turn.enable`: the step reports its episodes (`multi_turn/*`).
    pub multi_turn: bool,
}

/// The `multi_turn/*` metrics of a step's samples: turns, tool calls and interaction replies
/// per sample, tool errors
/// and time-outs, the model's and the environment's tokens per sample, and the time in tools.
fn episode_metrics<'a>(m: &mut Metrics, samples: impl Iterator<Item = &'a rollout::Sample>) {
    let (mut turns, mut calls, mut model, mut env) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut user_turns = Vec::new();
    let (mut errors, mut timeouts, mut seconds) = (0.0, 0.0, 0.0);
    for s in samples {
        let e = &s.episode;
        turns.push(e.turns as f64);
        calls.push(e.tool_calls as f64);
        user_turns.push(e.user_turns as f64);
        let from_env: usize = s.env_spans.iter().map(|r| r.len()).sum();
        env.push(from_env as f64);
        model.push((s.response_ids.len() - from_env) as f64);
        errors += e.tool_errors as f64;
        timeouts += e.tool_timeouts as f64;
        seconds += e.env_time.as_secs_f64();
    }
    mean_max_min(m, "multi_turn/turns", &turns);
    mean_max_min(m, "multi_turn/tool_calls", &calls);
    mean_max_min(m, "multi_turn/user_turns", &user_turns);
    m.insert("multi_turn/tool_errors".into(), errors);
    m.insert("multi_turn/tool_timeouts".into(), timeouts);
    mean_max_min(m, "multi_turn/model_tokens", &model);
    mean_max_min(m, "multi_turn/env_tokens", &env);
    m.insert("timing_s/tools".into(), seconds);
}

/// Inserts `{prefix}/mean`, `/max` and `/min` of `values` (nothing when empty).
fn mean_max_min(m: &mut Metrics, prefix: &str, values: &[f64]) {
    if values.is_empty() {
        return;
    }
    m.insert(format!("{prefix}/mean"), mean_std(values).0);
    m.insert(
        format!("{prefix}/max"),
        values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    m.insert(
        format!("{prefix}/min"),
        values.iter().copied().fold(f64::INFINITY, f64::min),
    );
}

/// A training step's metrics under VeRL's names (`critic/score/*`, `response_length/*`,
/// `prompt_length/*`, `timing_s/*`, `timing_per_token_ms/*`, `perf/*`, `training/*`, and the
/// learner's `actor/*` and `critic/rewards|advantages|returns/*`), with grpo's own beside them
/// (`critic/score/std`, `reward/errors`, `reward/extra/*`, `weights/*`, `workers/*`, ...).
pub(crate) fn step_metrics(o: &StepOutcome, step: u64, limits: MetricLimits) -> Metrics {
    let g = &o.generated;
    let mut m = Metrics::new();
    let scores: Vec<f64> = g.scored.iter().map(|s| s.score.score).collect();
    let samples = scores.len().max(1) as f64;
    m.insert("batch/samples".into(), scores.len() as f64);
    if let Some(d) = &o.sampling {
        m.insert("train/num_gen_batches".into(), d.rounds as f64);
        m.insert("batch/generated_prompts".into(), d.generated_prompts as f64);
        m.insert("batch/prompts_with_signal".into(), d.prompts_with_signal as f64);
    }
    mean_max_min(&mut m, "critic/score", &scores);
    m.insert("critic/score/std".into(), mean_std(&scores).1);
    let errors = g.scored.iter().filter(|s| s.score.error.is_some()).count();
    m.insert("reward/errors".into(), errors as f64);
    let mut extras: HashMap<&str, Vec<f64>> = HashMap::new();
    for s in &g.scored {
        for (k, v) in &s.score.extras {
            extras.entry(k.as_str()).or_default().push(*v);
        }
    }
    for (k, v) in extras {
        m.insert(format!("reward/extra/{k}"), mean_std(&v).0);
    }
    let lengths: Vec<f64> = g
        .scored
        .iter()
        .map(|s| s.sample.response_ids.len() as f64)
        .collect();
    mean_max_min(&mut m, "response_length", &lengths);
    // A response cut by the length limit (VeRL counts length == max_response_length).
    let clipped = g
        .scored
        .iter()
        .filter(|s| {
            !matches!(
                s.sample.finish_reason,
                FinishReason::Eos(_) | FinishReason::StopString(_)
            )
        })
        .count();
    m.insert("response_length/clip_ratio".into(), clipped as f64 / samples);
    let prompt_lengths: Vec<f64> = g
        .scored
        .iter()
        .map(|s| s.sample.prompt_ids.len() as f64)
        .collect();
    mean_max_min(&mut m, "prompt_length", &prompt_lengths);
    let at_limit = prompt_lengths
        .iter()
        .filter(|&&l| l as usize >= limits.max_prompt_length)
        .count();
    m.insert("prompt_length/clip_ratio".into(), at_limit as f64 / samples);
    if limits.multi_turn {
        episode_metrics(&mut m, g.scored.iter().map(|s| &s.sample));
    }
    m.extend(o.report.metrics.clone());

    m.insert("timing_s/gen".into(), g.gen_s);
    m.insert("timing_s/reward".into(), g.reward_tail_s);
    m.insert("timing_s/update".into(), o.update_s);
    m.insert("timing_s/update_weights".into(), o.sync_s);
    let response_tokens: f64 = lengths.iter().sum();
    let all_tokens = response_tokens + prompt_lengths.iter().sum::<f64>();
    // VeRL's per-token times: generation per response token, the learner's passes per token
    // of prompt and response.
    let per_token = |seconds: f64, tokens: f64| seconds * 1000.0 / tokens.max(1.0);
    m.insert(
        "timing_per_token_ms/gen".into(),
        per_token(g.gen_s, response_tokens),
    );
    for name in ["ref", "values", "update_critic", "update_actor"] {
        if let Some(&seconds) = m.get(&format!("timing_s/{name}")) {
            m.insert(
                format!("timing_per_token_ms/{name}"),
                per_token(seconds, all_tokens),
            );
        }
    }
    m.insert("perf/total_num_tokens".into(), all_tokens);
    m.insert(
        "perf/gen_tokens_per_s".into(),
        response_tokens / g.gen_s.max(1e-9),
    );
    m.insert(
        "perf/train_tokens_per_s".into(),
        o.report.processed_tokens as f64 / o.update_s.max(1e-9),
    );
    m.insert("perf/devices".into(), limits.devices as f64);
    m.insert("weights/version".into(), o.version as f64);
    m.insert("weights/version_lag".into(), mean_std(&o.version_lag).0);
    m.insert(
        "weights/host_transfers".into(),
        o.sync.host.host_transfers() as f64,
    );
    m.insert(
        "weights/host_transfer_bytes".into(),
        o.sync.host.host_bytes() as f64,
    );
    m.insert("weights/sent_bytes".into(), o.sync.sent_bytes as f64);
    m.insert("workers/rollout_failures".into(), g.rollout_failures as f64);
    m.insert("workers/reward_failures".into(), g.reward_failures as f64);
    m.insert("workers/reissued_requests".into(), g.reissued as f64);
    m.insert("workers/failures_total".into(), o.failures_total as f64);
    m.insert("workers/replaced_total".into(), o.replaced_total as f64);
    m.insert("training/global_step".into(), step as f64);
    m.insert("training/epoch".into(), g.epoch as f64);
    m
}

/// Adds the step's wall time (`timing_s/step`, VeRL's `perf/time_per_step` and
/// `perf/throughput`: every prompt and response token of the step per second per device) and
/// the share of it the controller itself spent (the step minus the generation, scoring,
/// update, sync and validation it waited for).
pub(crate) fn add_step_time(m: &mut Metrics, step_s: f64) {
    m.insert("timing_s/step".into(), step_s);
    m.insert("perf/time_per_step".into(), step_s);
    if let (Some(&tokens), Some(&devices)) = (m.get("perf/total_num_tokens"), m.get("perf/devices")) {
        m.insert("perf/throughput".into(), tokens / (step_s * devices.max(1.0)));
    }
    let work: f64 = [
        "timing_s/gen",
        "timing_s/reward",
        "timing_s/update",
        "timing_s/update_weights",
        "timing_s/testing",
    ]
    .iter()
    .filter_map(|k| m.get(*k))
    .sum();
    m.insert(
        "perf/orchestration_overhead_frac".into(),
        ((step_s - work) / step_s).max(0.0),
    );
}
