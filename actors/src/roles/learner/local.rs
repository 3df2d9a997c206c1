//! The learner role in this process: a lock around [`trainer::update::GrpoUpdate`] (the
//! update algorithm and the device learner), with its parameter buffers shared with an
//! in-process rollout engine.

use super::{LearnerRole, LearnerWeights};
use crate::recipe::Recipe;
use crate::roles::{BoxFuture, RoleError};
use crate::setup;
use model::ParamSpec;
use std::sync::{Arc, Mutex};
use trainer::step::LearnerState;
use trainer::update::{GrpoUpdate, Row, UpdateClocks, UpdateError, UpdateReport};
use xla::runtime::{Buffer, Client};

/// Takes the model's tensors out of `weights` (they are not needed twice on the host) and returns
/// them as f32 in the order of `specs`: the initial weights of a new run, and the frozen
/// reference.
pub fn initial_params(
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

/// The learner role in this process. Its parameter buffers are shared with an in-process
/// rollout engine (no copy); updates run on a blocking thread, one at a time.
pub struct LocalLearner {
    update: Arc<Mutex<GrpoUpdate>>,
    /// The update's clocks, readable while an update runs.
    clocks: Arc<Mutex<UpdateClocks>>,
    specs: Vec<ParamSpec>,
}

impl LocalLearner {
    /// The learner of a run as the orchestrator and a learner worker both build it (see
    /// [`GrpoUpdate::start`]): from `initial` (the model's weights in parameter-table order, see
    /// [`initial_params`]) or the checkpoint state `resume` with its `clocks`, in a schedule of
    /// `total_optimizer_steps`.
    pub fn start(
        client: &Client,
        recipe: &Recipe,
        config: &model::ModelConfig,
        initial: Vec<Vec<f32>>,
        resume: Option<LearnerState>,
        clocks: UpdateClocks,
        total_optimizer_steps: u64,
    ) -> Result<LocalLearner, UpdateError> {
        let policy = setup::policy(recipe, config);
        let specs = policy.param_specs();
        let update = GrpoUpdate::start(
            client,
            policy,
            setup::update_config(recipe, total_optimizer_steps),
            initial,
            resume,
            clocks,
        )?;
        Ok(LocalLearner {
            specs,
            clocks: Arc::new(Mutex::new(update.clocks())),
            update: Arc::new(Mutex::new(update)),
        })
    }

    /// The parameters for a rollout engine on the same device (shared, not copied).
    pub fn shared_params(&self) -> Result<Arc<[Buffer]>, UpdateError> {
        Ok(lock(&self.update).learner_mut().learner_mut().shared_params()?)
    }

    /// The parameters with their layout, for a rollout engine on the learner's devices
    /// (shared, not copied): on one device [`LocalLearner::shared_params`]; over a mesh of
    /// `N > 1` every device's f32 masters, split as the learner's mesh splits them.
    pub fn rollout_source(&self) -> Result<rollout::SourceParams, UpdateError> {
        let mut update = lock(&self.update);
        let learner = update.learner_mut().learner_mut();
        let mesh = learner.mesh();
        if learner.devices() <= 1 {
            return Ok(rollout::SourceParams::single(
                learner.shared_params()?,
                self.specs.clone(),
            ));
        }
        Ok(rollout::SourceParams {
            mesh: mesh.mesh(),
            per_device: learner.shared_device_params(),
            shardings: self.specs.iter().map(|p| mesh.param_sharding(p)).collect(),
            specs: self.specs.clone(),
        })
    }

    /// The learner's state (parameters, AdamW moments, step count) read to the host.
    pub fn read_state(&self) -> Result<LearnerState, UpdateError> {
        Ok(lock(&self.update).learner().learner().state()?)
    }
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

    fn weights(&self, _version: u64, _dtype: xla::DType) -> BoxFuture<'_, Result<LearnerWeights, RoleError>> {
        Box::pin(async move { Ok(LearnerWeights::Shared(self.rollout_source().map_err(role_error)?)) })
    }

    fn state(&self) -> BoxFuture<'_, Result<LearnerState, RoleError>> {
        let update = self.update.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || lock(&update).learner().learner().state())
                .await
                .map_err(|e| RoleError::Invalid(format!("learner: the state reader failed: {e}")))?
                .map_err(|e| role_error(e.into()))
        })
    }

    fn clocks(&self) -> UpdateClocks {
        *lock(&self.clocks)
    }

    fn location(&self) -> String {
        "in-process".into()
    }
}
