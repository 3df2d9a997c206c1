//! Validation: every validation prompt generated with `rollout.val_kwargs` and scored, the
//! responses written to `OUTPUT/validation/step_N.jsonl`, and `trainer.log_val_generations`
//! of them sent to the trackers.

use super::fleet::Fleet;
use super::metrics::{mean_std, Metrics};
use super::prompts::{build_prompts, VALIDATION_ID};
use super::val_metrics::{generations_to_log, validation_metrics, ValSample};
use super::{io, RunError};
use crate::prepare::Prepared;
use crate::recipe::Recipe;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use tracking::Generation;

/// A validation's metrics, and the generations `trainer.log_val_generations` shows in the
/// trackers.
pub(crate) struct Validation {
    pub metrics: Metrics,
    pub generations: Vec<Generation>,
}

/// Generates for every validation prompt (`rollout.val_kwargs`) and scores: VeRL's validation
/// metrics per data source ([`validation_metrics`]), and grpo's `val/response_length/mean`,
/// `val/samples` and `val/reward_errors`. Every response with its score goes to
/// `OUTPUT/validation/step_N.jsonl`.
pub(crate) async fn validate(
    recipe: &Recipe,
    prepared: &Prepared,
    fleet: &Arc<Fleet>,
    step: u64,
    output: &Path,
) -> Result<Validation, RunError> {
    let dataset = prepared
        .validation
        .as_ref()
        .expect("validation is due only with val_files");
    // In batches of `data.val_batch_size` prompts (the whole set by default), in the order
    // `data.validation_shuffle` gives. A request's id, and so its seed, is its row's position,
    // so neither changes what is sampled.
    let mut sampler = dataset.validation_sampler(&recipe.data)?;
    let mut scored = Vec::new();
    let mut rows: HashMap<u64, u64> = HashMap::new();
    let mut sources: HashMap<u64, String> = HashMap::new();
    for _ in 0..sampler.batches_per_epoch() {
        let batch = sampler.next_batch();
        let prompts = build_prompts(
            recipe,
            prepared,
            dataset,
            &batch.positions,
            |i| VALIDATION_ID | (step << 24) | batch.positions[i],
            true,
        )?;
        rows.extend(prompts.requests.iter().map(|r| r.id).zip(prompts.indices));
        sources.extend(
            prompts
                .metas
                .iter()
                .map(|(id, meta)| (*id, meta.data_source.clone())),
        );
        let visit: HashMap<u64, usize> = prompts
            .requests
            .iter()
            .enumerate()
            .map(|(k, r)| (r.id, k))
            .collect();
        let mut outcome = fleet.generate_and_score(prompts.requests, prompts.metas).await?;
        // The file lists the rows in the order they were visited.
        outcome
            .scored
            .sort_by_key(|s| (visit[&s.sample.request_id], s.sample.sample_index));
        scored.extend(outcome.scored);
    }
    let lengths: Vec<f64> = scored
        .iter()
        .map(|s| s.sample.response_ids.len() as f64)
        .collect();
    let dir = output.join("validation");
    std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
    let path = dir.join(format!("step_{step}.jsonl"));
    let lines: String = scored
        .iter()
        .map(|s| {
            let line = serde_json::json!({
                "row": rows[&s.sample.request_id],
                "sample": s.sample.sample_index,
                "response": s.sample.text,
                "score": s.score.score,
                "extras": s.score.extras,
                "error": s.score.error,
            });
            format!("{line}\n")
        })
        .collect();
    std::fs::write(&path, lines).map_err(io("writing", &path))?;
    let samples: Vec<ValSample> = scored
        .iter()
        .map(|s| {
            let mut vars = s.score.extras.clone();
            vars.insert("reward".into(), s.score.score);
            let source = &sources[&s.sample.request_id];
            ValSample {
                // VeRL's name for rows without one.
                data_source: if source.is_empty() {
                    "unknown".into()
                } else {
                    source.clone()
                },
                uid: rows[&s.sample.request_id],
                vars,
                pred: s.score.pred.clone(),
            }
        })
        .collect();
    let mut m = validation_metrics(&samples);
    m.insert("val/response_length/mean".into(), mean_std(&lengths).0);
    m.insert("val/samples".into(), samples.len() as f64);
    let errors = scored.iter().filter(|s| s.score.error.is_some()).count();
    m.insert("val/reward_errors".into(), errors as f64);
    let count = recipe.trainer.log_val_generations;
    let generations = if count == 0 {
        Vec::new()
    } else {
        // VeRL's inputs: the prompts as the model saw them, special tokens left out.
        let inputs = scored
            .iter()
            .map(|s| {
                let input = prepared.tokenizer.tokenizer.decode(&s.sample.prompt_ids, true)?;
                Ok((input, (s.sample.text.clone(), s.score.score)))
            })
            .collect::<Result<Vec<_>, model::ModelError>>()
            .map_err(|e| RunError::Other(format!("decoding validation prompts: {e}")))?;
        generations_to_log(inputs, count)
            .into_iter()
            .map(|(input, (output, score))| Generation { input, output, score })
            .collect()
    };
    Ok(Validation {
        metrics: m,
        generations,
    })
}
