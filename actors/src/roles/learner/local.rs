//! The learner role in this process: a lock around [`trainer::update::GrpoUpdate`] (the
//! update algorithm and the device learner), with its parameter buffers shared with an
//! in-process rollout engine.

use super::{LearnerRole, LearnerStates, LearnerWeights, Synced};
use crate::recipe::Recipe;
use crate::roles::{BoxFuture, RoleError};
use crate::setup;
use model::lora::{MergeLayout, MergeProgram};
use model::ParamSpec;
use std::sync::{Arc, Mutex};
use trainer::step::LearnerState;
use trainer::update::{GrpoUpdate, Row, UpdateClocks, UpdateError, UpdateReport};
use xla::runtime::{Buffer, Client};

/// Takes the model's tensors out of `weights` (they are not needed twice on the host) and returns
/// them as f32 in the order of `specs`: the initial weights of a new run, and the frozen
/// reference.
fn initial_params(
    specs: &[ParamSpec],
    weights: &mut model::ModelWeights,
) -> Result<Vec<Vec<f32>>, UpdateError> {
    let mut by_name: std::collections::HashMap<String, model::HostTensor> =
        std::mem::take(&mut weights.tensors)
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
    specs
        .iter()
        .map(|s| {
            by_name.remove(&s.name).map(|t| t.to_f32_vec()).ok_or_else(|| {
                UpdateError::Batch(format!(
                    "the model has no tensor `{}`, which the policy's parameter table needs",
                    s.name
                ))
            })
        })
        .collect()
}

/// The starting point of a run's learner, from the model's weights (taken out of `weights`):
/// the trainable parameters and the frozen ones, as [`GrpoUpdate::start`] takes them. A full
/// fine-tune trains the weights and freezes nothing; LoRA trains adapters (PEFT's
/// initialisation seeded by `trainer.seed`, or `model.lora_adapter_path`'s) and freezes the
/// weights.
pub fn initial_weights(
    recipe: &Recipe,
    weights: &mut model::ModelWeights,
) -> Result<InitialWeights, UpdateError> {
    // PPO's critic copies the trunk before the policy's tensors move out.
    let critic = setup::critic_initial(recipe, weights).map_err(UpdateError::Batch)?;
    let policy = setup::policy(recipe, &weights.config);
    let Some(lora) = &policy.lora else {
        return Ok(InitialWeights {
            trainable: initial_params(&policy.param_specs(), weights)?,
            frozen: Vec::new(),
            critic,
        });
    };
    let adapter = initial_adapter(recipe, &weights.config, lora)?;
    Ok(InitialWeights {
        trainable: adapter.tensors.iter().map(|t| t.to_f32_vec()).collect(),
        frozen: initial_params(&policy.frozen_specs(), weights)?,
        critic,
    })
}

/// The adapters a new LoRA run starts from: `model.lora_adapter_path`'s (which must have the
/// recipe's rank, alpha and targets), or PEFT's initialisation seeded by `trainer.seed` (`A`
/// random, `B` zero). The learner and every rollout worker start from these same adapters.
pub fn initial_adapter(
    recipe: &Recipe,
    config: &model::ModelConfig,
    lora: &model::LoraConfig,
) -> Result<model::LoraAdapter, UpdateError> {
    let Some(dir) = &recipe.model.lora_adapter_path else {
        return Ok(model::LoraAdapter::init(config, lora, recipe.trainer.seed));
    };
    let adapter = model::LoraAdapter::load_peft(std::path::Path::new(dir), config)
        .map_err(|e| UpdateError::Batch(format!("model.lora_adapter_path: {e}")))?;
    if adapter.lora.use_rslora {
        return Err(UpdateError::Batch(format!(
            "model.lora_adapter_path {dir} is an rsLoRA adapter (`use_rslora: true`); \
             grpo's recipe trains with alpha / r scaling only, so it cannot continue it \
             (grpo generate --adapter reads it)"
        )));
    }
    if adapter.lora != *lora {
        let modules = |l: &model::LoraConfig| l.targets.iter().map(|t| t.module()).collect::<Vec<_>>();
        return Err(UpdateError::Batch(format!(
            "model.lora_adapter_path {dir} holds an adapter of rank {}, alpha {}, targets {:?}; \
             the recipe asks for rank {}, alpha {}, targets {:?}: set actor.lora_rank, \
             actor.lora_alpha and actor.target_modules to the adapter's",
            adapter.lora.rank,
            adapter.lora.alpha,
            modules(&adapter.lora),
            lora.rank,
            lora.alpha,
            modules(lora),
        )));
    }
    Ok(adapter)
}

/// Where a new run's learner starts (f32 values in the policy's table orders).
#[derive(Clone, Debug)]
pub struct InitialWeights {
    /// The trainable parameters: the model's weights, or with LoRA the adapters.
    pub trainable: Vec<Vec<f32>>,
    /// The frozen tensors: with LoRA the model's weights, else none.
    pub frozen: Vec<Vec<f32>>,
    /// PPO's critic's parameters (`setup::critic_initial`), when the estimator needs one.
    pub critic: Option<Vec<Vec<f32>>>,
}

/// The learner role in this process. Its parameter buffers are shared with an in-process
/// rollout engine (no copy); updates run on a blocking thread, one at a time. With LoRA the
/// engine samples from the merged weights `W + s·B·A`, computed on the device after each
/// update.
pub struct LocalLearner {
    update: Arc<Mutex<GrpoUpdate>>,
    /// The update's clocks, readable while an update runs.
    clocks: Arc<Mutex<UpdateClocks>>,
    /// The trainable parameters' table.
    specs: Vec<ParamSpec>,
    /// With LoRA: the frozen base's table and, in the merged form, the merge.
    lora: Option<LoraParts>,
}

/// What a LoRA learner needs besides the update to hand its weights on.
struct LoraParts {
    /// The model's parameter table (the frozen base's, and the merged weights').
    base_specs: Vec<ParamSpec>,
    /// The merge `W + s·B·A` over the learner's mesh; `None` in the applied form, whose
    /// rollout takes the base and the adapters apart.
    merge: Option<MergeProgram>,
}

impl LoraParts {
    fn merge(&self) -> Result<&MergeProgram, UpdateError> {
        self.merge.as_ref().ok_or_else(|| {
            UpdateError::Batch(
                "LoRA in the applied form (actor.lora_form) has no merged weights: the rollout \
                 takes the base and the adapters apart"
                    .into(),
            )
        })
    }
}

impl LocalLearner {
    /// The learner of a run as the orchestrator and a learner worker both build it (see
    /// [`GrpoUpdate::start`]): from `initial` (the policy's starting point, see
    /// [`initial_weights`]) or the checkpoint state `resume` with its `clocks`, in a schedule of
    /// `total_optimizer_steps`; PPO's critic from `initial.critic` or its checkpoint state
    /// `critic_resume`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        client: &Client,
        recipe: &Recipe,
        config: &model::ModelConfig,
        initial: InitialWeights,
        resume: Option<LearnerState>,
        critic_resume: Option<LearnerState>,
        clocks: UpdateClocks,
        total_optimizer_steps: u64,
    ) -> Result<LocalLearner, UpdateError> {
        let policy = setup::policy(recipe, config);
        let specs = policy.param_specs();
        let update_config = setup::update_config(recipe, &policy, total_optimizer_steps);
        let critic = match setup::critic_model_config(recipe, config).map_err(UpdateError::Batch)? {
            Some(critic_config) => {
                let state = match (critic_resume, initial.critic) {
                    (Some(state), _) => state,
                    (None, Some(params)) => LearnerState::fresh(params),
                    (None, None) => {
                        return Err(UpdateError::Batch(
                            "PPO's critic has neither a checkpoint state nor initial weights".into(),
                        ))
                    }
                };
                Some(trainer::update::CriticStart {
                    model: setup::critic(recipe, &critic_config),
                    state,
                })
            }
            None => None,
        };
        let lora = policy.lora.clone();
        let policy_form = policy.lora_form;
        let base_specs = policy.frozen_specs();
        let update = GrpoUpdate::start(
            client,
            policy,
            update_config,
            initial.trainable,
            initial.frozen,
            resume,
            clocks,
            critic,
        )?;
        let lora = match &lora {
            Some(_) if policy_form == model::LoraForm::Applied => Some(LoraParts {
                base_specs,
                merge: None,
            }),
            Some(lora) => {
                // Over the mesh the learner was built on, each device merging its own shards.
                let mesh = update.learner().learner().mesh();
                let layout = mesh.mesh().map(|m| MergeLayout {
                    mesh: m,
                    adapters: specs.iter().map(|p| mesh.param_sharding(p)).collect(),
                    base: base_specs.iter().map(|p| mesh.param_sharding(p)).collect(),
                });
                let dtype = setup::actor_dtype(recipe);
                let program = MergeProgram::compile_over(client, config, lora, dtype, layout.as_ref())
                    .map_err(lora_error)?;
                Some(LoraParts {
                    base_specs,
                    merge: Some(program),
                })
            }
            None => None,
        };
        Ok(LocalLearner {
            specs,
            lora,
            clocks: Arc::new(Mutex::new(update.clocks())),
            update: Arc::new(Mutex::new(update)),
        })
    }

    /// The parameters for a rollout engine on the same device (shared, not copied), in the
    /// model's parameter-table order; with LoRA the merged weights (a new copy).
    pub fn shared_params(&self) -> Result<Arc<[Buffer]>, UpdateError> {
        let mut update = lock(&self.update);
        let learner = update.learner_mut().learner_mut();
        match &self.lora {
            Some(_) if learner.devices() > 1 => Err(UpdateError::Batch(format!(
                "LoRA over {} devices: the merged weights are split over the learner's mesh; \
                 take them with rollout_source",
                learner.devices()
            ))),
            Some(lora) => merge_on_one_device(lora.merge()?, learner),
            None => Ok(learner.shared_params()?),
        }
    }

    /// The parameters with their layout, for a rollout engine on the learner's devices
    /// (shared, not copied): on one device [`LocalLearner::shared_params`]; over a mesh of
    /// `N > 1` every device's f32 masters, split as the learner's mesh splits them. With LoRA
    /// the merged weights (a new copy), split as the learner holds the base.
    pub fn rollout_source(&self) -> Result<rollout::SourceParams, UpdateError> {
        let mut update = lock(&self.update);
        let learner = update.learner_mut().learner_mut();
        if let Some(lora) = &self.lora {
            let (merge, model_specs) = (lora.merge()?, &lora.base_specs);
            if learner.devices() <= 1 {
                return Ok(rollout::SourceParams::single(
                    merge_on_one_device(merge, learner)?,
                    model_specs.clone(),
                ));
            }
            // The merged weights, split over the learner's mesh as the base is.
            let devices = learner.devices();
            let adapters: Vec<&[Buffer]> = (0..devices).map(|d| learner.device_params(d)).collect();
            let base = (0..devices)
                .map(|d| learner.frozen_params(d))
                .collect::<Result<Vec<_>, _>>()?;
            let merged = merge.run_spmd(&adapters, &base).map_err(lora_error)?;
            let merged = merged.into_iter().map(Arc::from).collect();
            return Ok(on_learner_mesh(learner, merged, model_specs));
        }
        if learner.devices() <= 1 {
            return Ok(rollout::SourceParams::single(
                learner.shared_params()?,
                self.specs.clone(),
            ));
        }
        Ok(on_learner_mesh(
            learner,
            learner.shared_device_params(),
            &self.specs,
        ))
    }

    /// With LoRA, the adapters' f32 masters with their layout over the learner's mesh (shared,
    /// not copied): what a rollout worker is sent, to merge into the base it holds.
    pub fn adapter_source(&self) -> Result<rollout::SourceParams, UpdateError> {
        if self.lora.is_none() {
            return Err(UpdateError::Batch(
                "only a LoRA learner (actor.lora_rank above 0) has adapters to send".into(),
            ));
        }
        let update = lock(&self.update);
        let learner = update.learner().learner();
        Ok(on_learner_mesh(
            learner,
            learner.shared_device_params(),
            &self.specs,
        ))
    }

    /// With LoRA, the frozen base weights with their layout over the learner's mesh (shared,
    /// not copied; they never change): what an in-process engine applying the adapters beside
    /// them holds.
    pub fn base_source(&self) -> Result<rollout::SourceParams, UpdateError> {
        let Some(LoraParts { base_specs, .. }) = &self.lora else {
            return Err(UpdateError::Batch(
                "only a LoRA learner (actor.lora_rank above 0) has a frozen base".into(),
            ));
        };
        let update = lock(&self.update);
        let learner = update.learner().learner();
        Ok(on_learner_mesh(
            learner,
            learner.shared_frozen_params()?,
            base_specs,
        ))
    }

    /// The learner's state (parameters, AdamW moments, step count) read to the host, the
    /// critic's with it.
    pub fn read_state(&self) -> Result<LearnerStates, UpdateError> {
        read_states(&lock(&self.update))
    }
}

/// The policy's and the critic's states read to the host.
fn read_states(update: &GrpoUpdate) -> Result<LearnerStates, UpdateError> {
    Ok(LearnerStates {
        policy: update.learner().learner().state()?,
        critic: update.critic().map(|c| c.learner().state()).transpose()?,
    })
}

/// Buffers on the learner's devices (`per_device[d]`, following `specs`) with the layout the
/// learner's mesh gives tensors of that table: what a handoff to the rollout reads.
fn on_learner_mesh(
    learner: &trainer::step::Learner,
    per_device: Vec<Arc<[Buffer]>>,
    specs: &[ParamSpec],
) -> rollout::SourceParams {
    let mesh = learner.mesh();
    rollout::SourceParams {
        mesh: mesh.mesh(),
        per_device,
        shardings: specs.iter().map(|p| mesh.param_sharding(p)).collect(),
        specs: specs.to_vec(),
    }
}

/// The merged weights of a one-device LoRA learner (a new copy).
fn merge_on_one_device(
    merge: &MergeProgram,
    learner: &trainer::step::Learner,
) -> Result<Arc<[Buffer]>, UpdateError> {
    let merged = merge
        .run(learner.device_params(0), learner.frozen_params(0)?)
        .map_err(lora_error)?;
    Ok(Arc::from(merged))
}

fn lora_error(e: model::ProgramError) -> UpdateError {
    UpdateError::Batch(format!("LoRA: {e}"))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An update error as a role error (its message kept).
pub(crate) fn role_error(e: UpdateError) -> RoleError {
    RoleError::Invalid(format!("learner: {e}"))
}

impl LearnerRole for LocalLearner {
    fn update(&self, rows: Vec<Row>) -> BoxFuture<'_, Result<UpdateReport, RoleError>> {
        let (update, clocks) = (self.update.clone(), self.clocks.clone());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let mut update = lock(&update);
                let report = update.update(&rows);
                *lock(&clocks) = update.clocks();
                report
            })
            .await
            .map_err(|e| RoleError::Invalid(format!("learner: the update thread failed: {e}")))?
            .map_err(role_error)
        })
    }

    fn weights(
        &self,
        _version: u64,
        _dtype: xla::DType,
        what: Synced,
    ) -> BoxFuture<'_, Result<LearnerWeights, RoleError>> {
        Box::pin(async move {
            let source = match what {
                Synced::Model => self.rollout_source(),
                Synced::Adapters => self.adapter_source(),
            };
            Ok(LearnerWeights::Shared(source.map_err(role_error)?))
        })
    }

    fn state(&self) -> BoxFuture<'_, Result<LearnerStates, RoleError>> {
        let update = self.update.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || read_states(&lock(&update)))
                .await
                .map_err(|e| RoleError::Invalid(format!("learner: the state reader failed: {e}")))?
                .map_err(role_error)
        })
    }

    fn clocks(&self) -> UpdateClocks {
        *lock(&self.clocks)
    }

    fn location(&self) -> String {
        "in-process".into()
    }
}
