//! One training step: prompts -> samples with rewards -> the update -> the new weights to the
//! rollout workers. With `trainer.off_policy_steps: 1` the next step's samples are generated
//! (by the weights before this update) while this step updates.

use super::assembly::{Assembly, LearnerHandle};
use super::metrics::Progress;
use super::prompts::{build_prompts, generate, request_id, Generated};
use super::{io, RunError};
use crate::prepare::Prepared;
use crate::recipe::Recipe;
use rollout::FinishReason;
use std::path::{Path, PathBuf};
use std::time::Instant;
use trainer::update::{Row, UpdateReport};
use xla::runtime::{Client, TransferStats};

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
    /// The host copies of the weight sync.
    pub sync_transfers: TransferStats,
    /// Worker failures and replacements since the run started.
    pub failures_total: u64,
    pub replaced_total: u64,
    /// The sampler's position for the next step's batch (before any prefetch), which a
    /// checkpoint after this step resumes from.
    pub sampler: data::SamplerState,
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
        let generated = match self.ready.take() {
            Some(g) => g,
            None => self.generate(step).await?,
        };
        append_line(
            &self.prompts_log,
            &serde_json::json!({"step": step, "epoch": generated.epoch, "indices": generated.indices}),
        )?;
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

        // 4: the update.
        progress.phase("updating");
        let rows = generated.scored.iter().map(row).collect();
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
        let sync_transfers = self
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
            sync_transfers,
            failures_total: self.assembly.fleet.failures(),
            replaced_total: self.assembly.fleet.replaced(),
            sampler,
        })
    }

    /// The next batch of training prompts, as step `step`'s requests, and its epoch.
    fn next_prompts(&mut self, step: u64) -> Result<(super::prompts::StepPrompts, u64), RunError> {
        let batch = self.sampler.next_batch();
        let prompts = build_prompts(
            self.recipe,
            self.prepared,
            &self.prepared.train,
            &batch.positions,
            |i| request_id(step, i),
            false,
        )?;
        Ok((prompts, batch.epoch))
    }

    async fn generate(&mut self, step: u64) -> Result<Generated, RunError> {
        let (prompts, epoch) = self.next_prompts(step)?;
        generate(self.assembly.fleet.clone(), prompts, epoch).await
    }
}

/// A scored sample as the learner's row.
fn row(s: &super::fleet::Scored) -> Row {
    Row {
        group: s.sample.request_id,
        prompt: s.sample.prompt_ids.clone(),
        response: s.sample.response_ids.clone(),
        rollout_log_probs: s.sample.logprobs.clone(),
        score: s.score.score,
        truncated: matches!(
            s.sample.finish_reason,
            FinishReason::MaxNewTokens | FinishReason::MaxModelLen
        ),
    }
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
