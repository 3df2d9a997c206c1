//! One training step: prompts -> samples with rewards -> the update -> the new weights to the
//! rollout workers. With `trainer.off_policy_steps: 1` the next step's samples are generated
//! (by the weights before this update) while this step updates. With
//! `algorithm.filter_groups` a step generates rounds of prompts until it holds
//! `data.train_batch_size` prompts whose samples differ (DAPO's dynamic sampling).

use super::assembly::{Assembly, LearnerHandle, SyncCost};
use super::progress::Progress;
use super::prompts::{build_prompts, generate, request_id, Generated};
use super::{io, RunError};
use crate::prepare::Prepared;
use crate::recipe::Recipe;
use std::path::{Path, PathBuf};
use std::time::Instant;
use trainer::update::{Row, UpdateReport};
use xla::runtime::Client;

/// What one step did, for its metrics and its checkpoint.
pub(crate) struct StepOutcome {
    pub generated: Generated,
    pub report: UpdateReport,
    /// The weight version after the update.
    pub version: u64,
    /// Per sample: versions between the weights that generated it and those it trained.
    pub version_lag: Vec<f64>,
    pub update_s: f64,
    pub sync_s: f64,
    /// The host copies and network bytes of the weight sync.
    pub sync: SyncCost,
    /// Worker failures and replacements since the run started.
    pub failures_total: u64,
    pub replaced_total: u64,
    /// The sampler's position for the next step's batch (before any prefetch), which a
    /// checkpoint after this step resumes from.
    pub sampler: data::SamplerState,
    /// What dynamic sampling took, with `algorithm.filter_groups`.
    pub sampling: Option<DynamicSampling>,
}

/// The rounds of one step's dynamic sampling (DAPO; VeRL's `train/num_gen_batches`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct DynamicSampling {
    /// Rounds of `data.gen_batch_size` prompts generated.
    pub rounds: u64,
    /// Prompts generated over the rounds.
    pub generated_prompts: usize,
    /// Of those, prompts whose samples' metric differs (before the step is cut to
    /// `data.train_batch_size`).
    pub prompts_with_signal: usize,
}

/// Runs the steps of a run in order.
pub(crate) struct StepRunner<'a> {
    pub recipe: &'a Recipe,
    pub prepared: &'a Prepared,
    pub client: &'a Client,
    pub assembly: &'a Assembly,
    pub sampler: data::Sampler,
    pub total_steps: u64,
    /// The current weight version (optimizer updates so far).
    pub version: u64,
    /// The newest checkpoint (where a failed run resumes).
    pub last_checkpoint: Option<PathBuf>,
    /// The next step's samples, generated while this step updated (one-step off-policy).
    pub ready: Option<Generated>,
    /// `OUTPUT/prompts.jsonl`: the dataset rows of each step.
    pub prompts_log: PathBuf,
}

impl StepRunner<'_> {
    /// The rollout and reward workers.
    pub fn fleet(&self) -> std::sync::Arc<super::fleet::Fleet> {
        self.assembly.fleet.clone()
    }

    /// The learner.
    pub fn learner(&self) -> &LearnerHandle {
        &self.assembly.learner
    }

    /// Runs training step `step`.
    pub async fn step(&mut self, step: u64, progress: &Progress) -> Result<StepOutcome, RunError> {
        let off_policy = self.recipe.trainer.off_policy_steps > 0;
        // 1-3: prompts -> samples -> rewards.
        progress.phase("generating");
        let mut generated = match self.ready.take() {
            Some(g) => g,
            None => self.generate(step).await?,
        };
        let mut line =
            serde_json::json!({"step": step, "epoch": generated.epoch, "indices": generated.indices});
        let sampling = if self.recipe.algorithm.filter_groups.enable {
            let (kept, sampling, all) = self.fill_with_signal(step, generated).await?;
            generated = kept;
            line = serde_json::json!({"step": step, "epoch": generated.epoch, "indices": generated.indices, "generated": all});
            Some(sampling)
        } else {
            None
        };
        append_line(&self.prompts_log, &line)?;
        if let Some(dir) = &self.recipe.trainer.rollout_data_dir {
            dump_rollouts(dir, step, &generated, &self.prepared.tokenizer.tokenizer)?;
        }
        // A checkpoint after this step resumes with the next batch drawn again.
        let sampler = self.sampler.state();
        let prefetch = if off_policy && step < self.total_steps {
            let (prompts, epoch) = self.next_prompts(step + 1)?;
            Some(tokio::spawn(generate(
                self.assembly.fleet.clone(),
                prompts,
                epoch,
            )))
        } else {
            None
        };

        // 4: the update, of samples from weights no older than the schedule allows.
        let samples = generated.scored.iter().map(|s| {
            (
                s.sample.request_id,
                s.sample.sample_index,
                s.sample.weight_version,
            )
        });
        let allowed = self.recipe.trainer.off_policy_steps as u64;
        check_weight_versions(samples, self.version, allowed).map_err(|e| {
            RunError::Other(format!(
                "step {step}: {e}; stopping before the update (the next grpo run resumes {})",
                super::resume_point(self.last_checkpoint.as_deref())
            ))
        })?;
        progress.phase("updating");
        let rows = generated
            .scored
            .iter()
            .map(|s| row(s, generated.baselines.get(&s.sample.request_id).copied()))
            .collect();
        let t = Instant::now();
        let report = self
            .assembly
            .learner
            .update(rows, self.last_checkpoint.as_deref())
            .await?;
        let update_s = t.elapsed().as_secs_f64();
        let version_lag = generated
            .scored
            .iter()
            .map(|s| self.version.saturating_sub(s.sample.weight_version) as f64)
            .collect();
        self.version += 1;

        // 5: the new weights to the rollout workers (after the prefetched generation, so that
        // every sample of a step comes from one version).
        if let Some(handle) = prefetch {
            let next = handle
                .await
                .map_err(|e| RunError::Other(format!("generation task: {e}")))??;
            self.ready = Some(next);
        }
        progress.phase("syncing weights");
        let t = Instant::now();
        let sync = self
            .assembly
            .push_weights(self.client, self.version, self.last_checkpoint.as_deref())
            .await?;
        Ok(StepOutcome {
            generated,
            report,
            version: self.version,
            version_lag,
            update_s,
            sync_s: t.elapsed().as_secs_f64(),
            sync,
            failures_total: self.assembly.fleet.failures(),
            replaced_total: self.assembly.fleet.replaced(),
            sampler,
            sampling,
        })
    }

    /// DAPO's dynamic sampling, as VeRL's DAPO trainer does it: keeps the prompts of `first`
    /// whose samples' `algorithm.filter_groups.metric` differs (a prompt with one sample is
    /// kept), generates further rounds of `data.gen_batch_size` prompts until
    /// `data.train_batch_size` are kept, and trains on the first that many. After
    /// `max_num_gen_batches` rounds (when positive) without a full step the run stops, as
    /// VeRL's does, with what to change. Returns the kept samples, the rounds' counts and the
    /// dataset rows of every prompt generated.
    async fn fill_with_signal(
        &mut self,
        step: u64,
        first: Generated,
    ) -> Result<(Generated, DynamicSampling, Vec<u64>), RunError> {
        let fg = &self.recipe.algorithm.filter_groups;
        let metric = fg.metric.clone().unwrap_or_default();
        let target = self.recipe.data.train_batch_size;
        let mut kept = Generated {
            scored: Vec::new(),
            indices: Vec::new(),
            baselines: Default::default(),
            ..first
        };
        let mut stats = DynamicSampling::default();
        let mut all = Vec::new();
        let mut round = first;
        loop {
            stats.rounds += 1;
            stats.generated_prompts += round.indices.len();
            all.extend_from_slice(&round.indices);
            let prompts = prompts_with_signal(&round, &metric)?;
            stats.prompts_with_signal += prompts.len();
            let by_prompt = group_by_prompt(std::mem::take(&mut round.scored));
            for (k, samples) in by_prompt.into_iter().enumerate() {
                if prompts.contains(&k) && kept.indices.len() < target {
                    kept.indices.push(round.indices[k]);
                    kept.scored.extend(samples);
                }
            }
            kept.epoch = round.epoch;
            kept.baselines.extend(round.baselines.drain());
            if stats.rounds > 1 {
                kept.gen_s += round.gen_s;
                kept.reward_tail_s += round.reward_tail_s;
                kept.rollout_failures += round.rollout_failures;
                kept.reward_failures += round.reward_failures;
                kept.reissued += round.reissued;
            }
            if kept.indices.len() >= target {
                return Ok((kept, stats, all));
            }
            let limit = fg.max_num_gen_batches;
            if limit > 0 && stats.rounds >= limit as u64 {
                return Err(RunError::Other(format!(
                    "step {step}: after {} rounds of generation (algorithm.filter_groups.max_num_gen_batches = {limit}) \
                     only {} of data.train_batch_size = {target} prompts had samples whose {metric} differs; \
                     the data may be too hard or too easy for the model. Check the rewards, raise \
                     max_num_gen_batches, or set it to 0 for no limit (VeRL stops here too)",
                    stats.rounds,
                    kept.indices.len()
                )));
            }
            let (prompts, epoch) = self.next_prompts_round(step, stats.rounds)?;
            round = generate(self.assembly.fleet.clone(), prompts, epoch).await?;
        }
    }

    /// The next batch of training prompts, as step `step`'s requests, and its epoch.
    fn next_prompts(&mut self, step: u64) -> Result<(super::prompts::StepPrompts, u64), RunError> {
        self.next_prompts_round(step, 0)
    }

    /// The same for round `round` of the step's dynamic sampling: its request ids follow the
    /// earlier rounds', so every round's samples draw their own random streams.
    fn next_prompts_round(
        &mut self,
        step: u64,
        round: u64,
    ) -> Result<(super::prompts::StepPrompts, u64), RunError> {
        let batch = self.sampler.next_batch();
        let first = round as usize * self.sampler_batch_size();
        let prompts = build_prompts(
            self.recipe,
            self.prepared,
            &self.prepared.train,
            &batch.positions,
            |i| request_id(step, first + i),
            false,
        )?;
        Ok((prompts, batch.epoch))
    }

    /// Prompts per sampler batch (`data.gen_batch_size`, else `data.train_batch_size`).
    fn sampler_batch_size(&self) -> usize {
        let d = &self.recipe.data;
        d.gen_batch_size.unwrap_or(d.train_batch_size)
    }

    async fn generate(&mut self, step: u64) -> Result<Generated, RunError> {
        let (prompts, epoch) = self.next_prompts(step)?;
        generate(self.assembly.fleet.clone(), prompts, epoch).await
    }
}

/// A round's samples per prompt, in request order (the samples of a request are adjacent and
/// requests are in id order, which is their order in the round).
fn group_by_prompt(scored: Vec<super::fleet::Scored>) -> Vec<Vec<super::fleet::Scored>> {
    let mut out: Vec<Vec<super::fleet::Scored>> = Vec::new();
    for s in scored {
        match out.last_mut() {
            Some(g) if g[0].sample.request_id == s.sample.request_id => g.push(s),
            _ => out.push(vec![s]),
        }
    }
    out
}

/// The positions (in request order) of a round's prompts whose samples' `metric` is not all
/// equal, or that have one sample (DAPO keeps those).
fn prompts_with_signal(round: &Generated, metric: &str) -> Result<Vec<usize>, RunError> {
    let mut values = Vec::with_capacity(round.scored.len());
    let mut prompt_of = Vec::with_capacity(round.scored.len());
    let mut k = 0usize;
    for (i, s) in round.scored.iter().enumerate() {
        if i > 0 && round.scored[i - 1].sample.request_id != s.sample.request_id {
            k += 1;
        }
        values.push(filter_metric(s, metric)?);
        prompt_of.push(k);
    }
    let keep = trainer::advantage::filter_groups(&values, &prompt_of)
        .map_err(|e| RunError::Other(format!("algorithm.filter_groups: {e}")))?;
    let mut prompts: Vec<usize> = keep.into_iter().map(|i| prompt_of[i]).collect();
    prompts.dedup();
    Ok(prompts)
}

/// A sample's value of `algorithm.filter_groups.metric`: the reward for `seq_reward` and
/// `seq_final_reward` (the same without a KL in the reward, which validation requires), else
/// the scorer's extra of that name (`score` is the reward where the scorer reports none). A
/// sample whose scorer failed counts with its reward, 0.
fn filter_metric(s: &super::fleet::Scored, metric: &str) -> Result<f64, RunError> {
    let score = &s.score;
    match metric {
        "seq_reward" | "seq_final_reward" => Ok(score.score),
        name => match score.extras.get(name) {
            Some(v) => Ok(*v),
            None if name == "score" || score.error.is_some() => Ok(score.score),
            None => Err(RunError::Other(format!(
                "algorithm.filter_groups.metric = {name}: the scorer reports no `{name}` for request {} \
                 (its extras: {}); use seq_reward, or a name it reports",
                s.sample.request_id,
                if score.extras.is_empty() {
                    "none".to_string()
                } else {
                    score.extras.keys().cloned().collect::<Vec<_>>().join(", ")
                }
            ))),
        },
    }
}

/// A scored sample as the learner's row, with its ReMax baseline when the run has one.
fn row(s: &super::fleet::Scored, reward_baseline: Option<f64>) -> Row {
    Row {
        group: s.sample.request_id,
        prompt: s.sample.prompt_ids.clone(),
        response: s.sample.response_ids.clone(),
        rollout_log_probs: s.sample.logprobs.clone(),
        score: s.score.score,
        reward_baseline,
        truncated: s.sample.finish_reason.is_truncated(),
        env_spans: s.sample.env_spans.clone(),
        routes: s.sample.routes.clone(),
    }
}

/// Writes the step's samples to `DIR/{step}.jsonl` as VeRL's `trainer.rollout_data_dir` does
/// (`input` and `output` decoded without special tokens, `gts`, `score`, `step`, the scorer's
/// extras), adding what grpo trained on: `response_ids`, the environment's spans of them
/// (`env_spans`, multi-turn), the sample's `turns` and `tool_calls`, its `finish_reason`
/// (`stop`, `length`, or `turn_length` for `rollout.multi_turn.max_turn_tokens`). Written
/// to a temporary file and renamed, so a file is whole or absent.
fn dump_rollouts(
    dir: &Path,
    step: u64,
    generated: &Generated,
    tokenizer: &model::ModelTokenizer,
) -> Result<(), RunError> {
    std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    let mut text = String::new();
    for s in &generated.scored {
        let decode = |ids: &[u32]| {
            tokenizer
                .decode(ids, true)
                .map_err(|e| RunError::Other(format!("decoding a sample for trainer.rollout_data_dir: {e}")))
        };
        let mut line = serde_json::json!({
            "input": decode(&s.sample.prompt_ids)?,
            "output": decode(&s.sample.response_ids)?,
            "gts": s.ground_truth,
            "score": s.score.score,
            "step": step,
            "response_ids": s.sample.response_ids,
            "env_spans": s.sample.env_spans.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
            "turns": s.sample.episode.turns,
            "tool_calls": s.sample.episode.tool_calls,
            "finish_reason": match s.sample.finish_reason {
                rollout::FinishReason::Eos(_) | rollout::FinishReason::StopString(_) => "stop",
                rollout::FinishReason::MaxNewTokens | rollout::FinishReason::MaxModelLen => "length",
                rollout::FinishReason::MaxTurnTokens => "turn_length",
            },
        });
        for (name, value) in &s.score.extras {
            line[name] = serde_json::json!(value);
        }
        text.push_str(&format!("{line}\n"));
    }
    let path = dir.join(format!("{step}.jsonl"));
    let tmp = dir.join(format!(".{step}.jsonl.tmp"));
    std::fs::write(&tmp, text).map_err(io("writing", &tmp))?;
    std::fs::rename(&tmp, &path).map_err(io("renaming", &path))
}

fn append_line(path: &Path, value: &serde_json::Value) -> Result<(), RunError> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io("opening", path))?;
    writeln!(f, "{value}").map_err(io("writing", path))
}

/// Every sample must come from weights at most `allowed` versions behind the learner's
/// `version` (0 on-policy, `trainer.off_policy_steps` otherwise) and none from the future. An
/// older one means a sampler kept weights it was sent a replacement for, and training on its
/// samples as if they were current is the silent failure of VeRL #7495 and TRL #5312; the
/// weight digests catch that at the sync, this catches whatever slips past them. Samples are
/// given as (request id, sample index, weight version).
fn check_weight_versions(
    samples: impl IntoIterator<Item = (u64, usize, u64)>,
    version: u64,
    allowed: u64,
) -> Result<(), String> {
    for (request, index, v) in samples {
        if v > version || version - v > allowed {
            return Err(format!(
                "sample {index} of request {request} was generated with weight version {v}, where \
                 the learner is at version {version} and trainer.off_policy_steps allows samples \
                 {allowed} version(s) behind: a sampler did not generate with the weights it was \
                 sent"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_weight_versions;

    #[test]
    fn samples_from_weights_older_than_the_schedule_allows_are_refused() {
        assert!(check_weight_versions([(1, 0, 4), (1, 1, 4)], 4, 0).is_ok());
        assert!(check_weight_versions([(1, 0, 3), (2, 0, 4)], 4, 1).is_ok());
        let e = check_weight_versions([(1, 0, 4), (7, 2, 3)], 4, 0).unwrap_err();
        assert!(
            e.starts_with("sample 2 of request 7 was generated with weight version 3, where the learner is at version 4"),
            "{e}"
        );
        assert!(check_weight_versions([(1, 0, 2)], 4, 1).is_err());
        assert!(
            check_weight_versions([(1, 0, 5)], 4, 1).is_err(),
            "a version from the future"
        );
    }
}
