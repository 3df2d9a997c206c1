//! Where a run starts (the newest complete checkpoint, or fresh) and the checkpoint it saves on
//! its schedule. Checkpoints are written by the orchestrator whatever runs the learner: it reads
//! the learner's state and writes it atomically with the sampler's position and the clocks.

use super::{io, RunError};
use crate::recipe::{Recipe, ResumeMode};
use model::ParamSpec;
use std::path::{Path, PathBuf};
use trainer::checkpoint::{latest_checkpoint, load_checkpoint, save_checkpoint, TrainerState};
use trainer::step::LearnerState;
use trainer::update::UpdateClocks;

/// The keys under which a checkpoint records the optimizer-step clock and the in-reward KL
/// coefficient.
const OPTIMIZER_STEPS_KEY: &str = "optimizer_steps";
const KL_COEF_KEY: &str = "kl_coef";

/// The point a run starts from.
pub(crate) struct Start {
    /// The checkpoint resumed from (`None`: a new run).
    pub checkpoint: Option<PathBuf>,
    /// The learner's state in that checkpoint.
    pub state: Option<LearnerState>,
    /// The last step done (0 for a new run).
    pub step: u64,
    /// The weight version at that step.
    pub version: u64,
    /// Optimizer steps taken (the learning-rate schedule's clock) and the KL coefficient.
    pub clocks: UpdateClocks,
}

/// Finds where the run in `output` starts (`trainer.resume_mode`), restores `sampler` to the
/// checkpoint's position, and cuts `metrics.jsonl` and `prompts.jsonl` back to the checkpoint's
/// step (a new run starts them afresh).
pub(crate) fn resume(
    recipe: &Recipe,
    output: &Path,
    specs: &[ParamSpec],
    sampler: &mut data::Sampler,
) -> Result<Start, RunError> {
    let checkpoint = match recipe.trainer.resume_mode {
        ResumeMode::Auto => latest_checkpoint(output)?,
        ResumeMode::Disable => None,
        ResumeMode::ResumePath => recipe.trainer.resume_from_path.as_ref().map(PathBuf::from),
    };
    let start = match checkpoint {
        Some(dir) => {
            let ck = load_checkpoint(&dir)?;
            let state = LearnerState::from_checkpoint(&ck, specs)?;
            let position: data::SamplerState = serde_json::from_value(ck.state.sampler_position.clone())
                .map_err(|e| RunError::Other(format!("{}: bad sampler position: {e}", dir.display())))?;
            sampler.restore(position)?;
            let clocks = UpdateClocks {
                optimizer_steps: ck
                    .state
                    .extra
                    .get(OPTIMIZER_STEPS_KEY)
                    .and_then(|v| v.as_u64())
                    .unwrap_or(0),
                kl_coef: ck.state.extra.get(KL_COEF_KEY).and_then(|v| v.as_f64()),
            };
            tracing::info!("resuming from {} (step {})", dir.display(), ck.state.step);
            Start {
                checkpoint: Some(dir),
                state: Some(state),
                step: ck.state.step,
                version: ck.state.weight_version,
                clocks,
            }
        }
        None => Start {
            checkpoint: None,
            state: None,
            step: 0,
            version: 0,
            clocks: UpdateClocks::default(),
        },
    };
    for name in ["metrics.jsonl", "prompts.jsonl"] {
        let path = output.join(name);
        if start.checkpoint.is_some() {
            truncate_jsonl(&path, start.step)?;
        } else if path.exists() {
            std::fs::remove_file(&path).map_err(io("removing", &path))?;
        }
    }
    Ok(start)
}

/// Rewrites `path` keeping only the run headers and the JSON lines whose `step` is at most
/// `last_step` (what a resumed run must not see twice). A missing file is fine.
fn truncate_jsonl(path: &Path, last_step: u64) -> Result<(), RunError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| match v.get("step") {
                Some(s) => s.as_u64().is_some_and(|s| s <= last_step),
                None => v.get("run").is_some(),
            })
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, kept).map_err(io("writing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io("replacing", path))
}

/// What a checkpoint after a step records besides the learner's state.
pub(crate) struct Clocks {
    pub step: u64,
    pub weight_version: u64,
    pub update: UpdateClocks,
    /// The sampler's position for the next step's batch.
    pub sampler: data::SamplerState,
}

/// Writes `OUTPUT/checkpoints/step_N/` (atomically; the oldest beyond
/// `trainer.max_checkpoints_to_keep` removed) and returns its path.
pub(crate) fn save(
    recipe: &Recipe,
    output: &Path,
    specs: &[ParamSpec],
    learner: LearnerState,
    clocks: Clocks,
) -> Result<PathBuf, RunError> {
    let state = TrainerState {
        step: clocks.step,
        weight_version: clocks.weight_version,
        rng_state: serde_json::json!({ "seed": recipe.trainer.seed }),
        sampler_position: serde_json::to_value(clocks.sampler).map_err(|e| RunError::Other(e.to_string()))?,
        extra: serde_json::json!({
            trainer::export::MODEL_PATH_KEY: recipe.model.path,
            OPTIMIZER_STEPS_KEY: clocks.update.optimizer_steps,
            KL_COEF_KEY: clocks.update.kl_coef,
        }),
    };
    let files = learner.to_tensor_files(specs);
    drop(learner);
    Ok(save_checkpoint(
        output,
        &state,
        &files,
        recipe.trainer.max_checkpoints_to_keep,
    )?)
}
