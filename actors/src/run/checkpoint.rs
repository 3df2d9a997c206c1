//! Where a run starts (the newest complete checkpoint, or fresh) and the checkpoint it saves on
//! its schedule. Checkpoints are written by the orchestrator whatever runs the learner: it reads
//! the learner's state and writes it atomically with the sampler's position and the clocks.
//!
//! A checkpoint holds the recipe it was saved under; a resume refuses a change to what the run
//! trains (`RESUME_MAY_CHANGE` lists the keys that may change). A save that fails (a full
//! disk) stops the run with [`RunError::Save`], naming where the next `grpo run` resumes.

use super::{io, RunError};
use crate::recipe::{Recipe, ResumeMode};
use model::ParamSpec;
use std::path::{Path, PathBuf};
use trainer::checkpoint::{latest_checkpoint, load_checkpoint, save_checkpoint, TrainerState};
use trainer::step::{LearnerState, CRITIC_STATE_FILES};
use trainer::update::UpdateClocks;

/// The keys under which a checkpoint records the optimizer-step clock and the in-reward KL
/// coefficient.
const OPTIMIZER_STEPS_KEY: &str = "optimizer_steps";
const KL_COEF_KEY: &str = "kl_coef";
/// ... and PPO's critic's optimizer-step clock.
const CRITIC_OPTIMIZER_STEPS_KEY: &str = "critic_optimizer_steps";
/// The key under which a checkpoint records the recipe it was saved under (defaults resolved).
const RECIPE_KEY: &str = "recipe";

/// The recipe keys (or sections, by prefix) a resume may change: they decide how long the run
/// goes, where its workers run, what it validates and logs, or lay out the same computation
/// differently (equal up to rounding). Any other change would make the resumed run another
/// run than the one checkpointed.
const RESUME_MAY_CHANGE: &[&str] = &[
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.max_checkpoints_to_keep",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.allow_recipe_change_on_resume",
    "trainer.val_only",
    "trainer.output_dir",
    "trainer.log_val_generations",
    "trainer.logger",
    "trainer.project_name",
    "trainer.experiment_name",
    "cluster",
    "data.val_files",
    "data.val_batch_size",
    "data.validation_shuffle",
    "data.val_max_samples",
    "rollout.val_kwargs",
    "reward.num_workers",
    "reward.time_limit_s",
    "reward.log_first_errors",
    "reward.custom_reward_function.workers",
    "reward.custom_reward_function.timeout_s",
    "actor.strategy",
    "actor.mesh",
    "actor.tensor_model_parallel_size",
    "actor.ppo_micro_batch_size",
    "actor.length_bucket",
    "actor.max_consecutive_nonfinite",
    "rollout.max_num_seqs",
    "rollout.tensor_model_parallel_size",
    "model.enable_gradient_checkpointing",
    "model.scan_layers",
    "model.moe_dispatch",
];

/// The point a run starts from.
pub(crate) struct Start {
    /// The checkpoint resumed from (`None`: a new run).
    pub checkpoint: Option<PathBuf>,
    /// The learner's state in that checkpoint.
    pub state: Option<LearnerState>,
    /// PPO's critic's state in that checkpoint.
    pub critic_state: Option<LearnerState>,
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
    critic_specs: Option<&[ParamSpec]>,
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
            match ck.state.extra.get(RECIPE_KEY) {
                Some(saved) => check_recipe_change(saved, recipe, &dir)?,
                None => tracing::info!(
                    "{} holds no recipe (saved by an older grpo): the recipe is not compared",
                    dir.display()
                ),
            }
            let state = LearnerState::from_checkpoint(&ck, specs)?;
            let critic_state = critic_specs
                .map(|specs| LearnerState::from_checkpoint_as(&ck, specs, CRITIC_STATE_FILES))
                .transpose()?;
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
                critic_optimizer_steps: ck
                    .state
                    .extra
                    .get(CRITIC_OPTIMIZER_STEPS_KEY)
                    .and_then(|v| v.as_u64())
                    .unwrap_or(0),
                // One update per step.
                updates: ck.state.step,
            };
            tracing::info!("resuming from {} (step {})", dir.display(), ck.state.step);
            Start {
                checkpoint: Some(dir),
                state: Some(state),
                critic_state,
                step: ck.state.step,
                version: ck.state.weight_version,
                clocks,
            }
        }
        None => Start {
            checkpoint: None,
            state: None,
            critic_state: None,
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

/// The rule of a resume with a changed recipe: changes to [`RESUME_MAY_CHANGE`] keys are listed
/// in a note; any other change is refused, naming each key with its old and new value, unless
/// `trainer.allow_recipe_change_on_resume` (then a warning lists them).
fn check_recipe_change(saved: &serde_json::Value, recipe: &Recipe, dir: &Path) -> Result<(), RunError> {
    let now = serde_json::to_value(recipe).map_err(|e| RunError::Other(e.to_string()))?;
    let (mut old, mut new) = (Vec::new(), Vec::new());
    leaves(saved, "", &mut old);
    leaves(&now, "", &mut new);
    let old: std::collections::BTreeMap<String, serde_json::Value> = old.into_iter().collect();
    let new: std::collections::BTreeMap<String, serde_json::Value> = new.into_iter().collect();
    let absent = serde_json::Value::String("(absent)".into());
    let mut free = Vec::new();
    let mut binding = Vec::new();
    for key in old.keys().chain(new.keys().filter(|k| !old.contains_key(*k))) {
        let (a, b) = (old.get(key).unwrap_or(&absent), new.get(key).unwrap_or(&absent));
        if a == b {
            continue;
        }
        let line = format!("{key}: {} -> {}", compact(a), compact(b));
        let may = RESUME_MAY_CHANGE
            .iter()
            .any(|k| key == k || key.starts_with(&format!("{k}.")) || key.starts_with(&format!("{k}[")));
        if may {
            free.push(line);
        } else {
            binding.push(line);
        }
    }
    if !free.is_empty() {
        tracing::info!(
            "resuming from {} with changed run-control keys: {}",
            dir.display(),
            free.join("; ")
        );
    }
    if binding.is_empty() {
        return Ok(());
    }
    if recipe.trainer.allow_recipe_change_on_resume {
        tracing::warn!(
            "resuming from {} with a changed recipe (trainer.allow_recipe_change_on_resume): {}",
            dir.display(),
            binding.join("; ")
        );
        return Ok(());
    }
    Err(RunError::Other(format!(
        "resuming from {}: the recipe differs from the one the checkpoint was saved under, in keys \
         that change what the run trains:\n  {}\nA resumed run continues the checkpointed run, so \
         put them back; or start a new run (trainer.resume_mode=disable, or another \
         trainer.output_dir); or set trainer.allow_recipe_change_on_resume=true to continue with \
         the new values. A resume may change only the run-control keys (steps, epochs, \
         frequencies, logging), cluster.*, the validation keys and the layout keys listed under \
         trainer.allow_recipe_change_on_resume in recipes/README.md.",
        dir.display(),
        binding.join("\n  ")
    )))
}

/// The dotted leaves of a JSON value (`a.b.c`); lists are leaves.
fn leaves(v: &serde_json::Value, prefix: &str, out: &mut Vec<(String, serde_json::Value)>) {
    match v {
        serde_json::Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(v, &key, out);
            }
        }
        _ => out.push((prefix.to_string(), v.clone())),
    }
}

fn compact(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
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
    critic: Option<(&[ParamSpec], LearnerState)>,
    clocks: Clocks,
) -> Result<PathBuf, RunError> {
    let state = TrainerState {
        step: clocks.step,
        weight_version: clocks.weight_version,
        rng_state: serde_json::json!({ "seed": recipe.trainer.seed }),
        sampler_position: serde_json::to_value(clocks.sampler).map_err(|e| RunError::Other(e.to_string()))?,
        extra: serde_json::json!({
            trainer::export::MODEL_PATH_KEY: recipe.model.path,
            trainer::export::LORA_KEY: recipe.actor.lora().map(|l| l.to_peft_json(&recipe.model.path)),
            OPTIMIZER_STEPS_KEY: clocks.update.optimizer_steps,
            KL_COEF_KEY: clocks.update.kl_coef,
            CRITIC_OPTIMIZER_STEPS_KEY: clocks.update.critic_optimizer_steps,
            RECIPE_KEY: serde_json::to_value(recipe).map_err(|e| RunError::Other(e.to_string()))?,
        }),
    };
    let mut files = learner.to_tensor_files(specs);
    drop(learner);
    if let Some((specs, state)) = critic {
        files.extend(state.to_tensor_files_as(specs, CRITIC_STATE_FILES));
    }
    Ok(save_checkpoint(
        output,
        &state,
        &files,
        recipe.trainer.max_checkpoints_to_keep,
    )?)
}
