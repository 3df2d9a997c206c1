//! A step's prompts as generation requests, and their samples back with scores. Every request's
//! id and seed are functions of the run's seed, the step and the prompt's place, so a resumed
//! run and a run whose workers live in other processes draw the same tokens.

use super::fleet::{Fleet, PromptMeta, Scored};
use super::RunError;
use crate::prepare::Prepared;
use crate::recipe::AdvantageEstimator;
use crate::recipe::Recipe;
use crate::setup;
use rollout::{GenerationRequest, SamplingParams};
use std::collections::HashMap;
use std::sync::Arc;

/// Request ids: training prompt `i` of step `s` is `s << 24 | i`.
pub(crate) fn request_id(step: u64, i: usize) -> u64 {
    (step << 24) | i as u64
}

/// Validation requests set bit 62: row `r` at step `s` is `VALIDATION_ID | s << 24 | r`.
pub(crate) const VALIDATION_ID: u64 = 1 << 62;

/// ReMax's greedy baseline request of training prompt `id` is `id | REMAX_BASELINE`.
pub(crate) const REMAX_BASELINE: u64 = 1 << 61;

/// The prompts of one step (or one validation batch), ready to send.
pub(crate) struct StepPrompts {
    pub requests: Vec<GenerationRequest>,
    pub metas: HashMap<u64, PromptMeta>,
    /// Dataset row indices, in batch order (for `prompts.jsonl`).
    pub indices: Vec<u64>,
}

/// The requests for the rows at `positions` of `dataset`: `rollout.n` samples each with the
/// training sampling settings, or `rollout.val_kwargs` with `validation`; request `i`'s id is
/// `id_base(i)`. For training with `algorithm.adv_estimator: remax` each prompt also gets one
/// greedy request, `id_base(i) | REMAX_BASELINE`, whose reward is the samples' baseline (VeRL
/// generates it with `do_sample=False`).
pub(crate) fn build_prompts(
    recipe: &Recipe,
    prepared: &Prepared,
    dataset: &data::PromptDataset,
    positions: &[u64],
    id_base: impl Fn(usize) -> u64,
    validation: bool,
) -> Result<StepPrompts, RunError> {
    let examples = dataset.read(positions)?;
    let n = setup::samples_per_prompt(recipe, validation);
    let params = setup::sampling_params(recipe, validation);
    let remax = !validation && recipe.algorithm.adv_estimator == AdvantageEstimator::Remax;
    let mut out = StepPrompts {
        requests: Vec::with_capacity(examples.len()),
        metas: HashMap::new(),
        indices: Vec::with_capacity(examples.len()),
    };
    for (i, ex) in examples.iter().enumerate() {
        let prompt = dataset.encode_prompt(ex, &prepared.tokenizer)?;
        let id = id_base(i);
        let meta = PromptMeta {
            data_source: ex.data_source.clone().unwrap_or_default(),
            prompt: match &ex.prompt {
                data::Prompt::Messages(messages) => messages
                    .iter()
                    .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                    .collect(),
                data::Prompt::Text(text) => serde_json::Value::String(text.clone()),
            },
            ground_truth: ex.ground_truth_text().unwrap_or_default(),
            extra: serde_json::Value::Object(ex.columns.clone()),
        };
        // An agent program starts from the row's prompt as messages (the request holds its ids).
        let row = match &recipe.rollout.multi_turn.agent {
            None => meta.extra.clone(),
            Some(_) => {
                let mut row = ex.columns.clone();
                row.insert("prompt".into(), meta.prompt.clone());
                serde_json::Value::Object(row)
            }
        };
        let episode = setup::episode(recipe, &row).map_err(|e| {
            let at = match dataset.parquet().locate(ex.index) {
                Ok((file, row)) => format!("{}, row {row}", file.display()),
                Err(_) => format!("row {}", ex.index),
            };
            RunError::Other(format!("{at}: {e}"))
        })?;
        if remax {
            out.requests.push(GenerationRequest {
                id: id | REMAX_BASELINE,
                prompt: prompt.clone(),
                n: 1,
                seed: setup::request_seed(recipe, id | REMAX_BASELINE),
                params: SamplingParams {
                    temperature: 0.0,
                    ..params.clone()
                },
                multi_turn: episode.clone(),
            });
            out.metas.insert(id | REMAX_BASELINE, meta.clone());
        }
        out.requests.push(GenerationRequest {
            id,
            prompt,
            n,
            seed: setup::request_seed(recipe, id),
            params: params.clone(),
            multi_turn: episode,
        });
        out.metas.insert(id, meta);
        out.indices.push(ex.index);
    }
    Ok(out)
}

/// A step's samples with their scores, in (request id, sample index) order.
pub(crate) struct Generated {
    pub scored: Vec<Scored>,
    pub indices: Vec<u64>,
    pub epoch: u64,
    /// From the first request sent to the last sample received.
    pub gen_s: f64,
    /// Scoring time after the last sample arrived (the part not hidden behind generation).
    pub reward_tail_s: f64,
    pub rollout_failures: usize,
    pub reward_failures: usize,
    pub reissued: usize,
    /// ReMax's baselines: each training request's greedy reward, by request id.
    pub baselines: HashMap<u64, f64>,
}

/// Generates and scores a training step's prompts over the fleet.
pub(crate) async fn generate(
    fleet: Arc<Fleet>,
    prompts: StepPrompts,
    epoch: u64,
) -> Result<Generated, RunError> {
    let outcome = fleet.generate_and_score(prompts.requests, prompts.metas).await?;
    let (greedy, scored): (Vec<Scored>, Vec<Scored>) = outcome
        .scored
        .into_iter()
        .partition(|s| s.sample.request_id & REMAX_BASELINE != 0);
    Ok(Generated {
        baselines: greedy
            .iter()
            .map(|s| (s.sample.request_id & !REMAX_BASELINE, s.score.score))
            .collect(),
        scored,
        indices: prompts.indices,
        epoch,
        gen_s: outcome.gen_s,
        reward_tail_s: outcome.reward_tail_s,
        rollout_failures: outcome.rollout_failures,
        reward_failures: outcome.reward_failures,
        reissued: outcome.reissued,
    })
}
