//! Scorers that run a model, which the `reward` crate (no compute) leaves to this one:
//! [`reward_model`], a discriminative reward model (`kind: reward_model`), and [`judge`], a chat
//! model asked to grade the response (`kind: judge`). Both read the row's prompt and the
//! response, run on `cluster.device` in the reward role's process, and batch the reward pool's
//! concurrent samples.

mod judge;
mod reward_model;

use std::sync::{mpsc, Arc, Mutex};

use model::classifier::{ClassifierWeights, DeviceClassifier};
use model::ChatMessage;
use reward::{JudgeSpec, ModelDType, ModelScorerError, RewardModelSpec, Sample, ScoreError, Scorer};
use serde_json::Value;
use xla::DType;

use crate::recipe::{DTypeName, Recipe};

/// Builds a recipe's model scorers (see [`reward::ModelScorers`]).
pub struct RecipeScorers<'a> {
    /// The recipe: its `cluster` says which device the models run on.
    pub recipe: &'a Recipe,
    /// Load each model onto its device now (the reward role runs in this process), rather than
    /// when the first sample arrives.
    pub load_now: bool,
}

impl reward::ModelScorers for RecipeScorers<'_> {
    fn reward_model(&self, name: &str, spec: &RewardModelSpec) -> Result<Arc<dyn Scorer>, ModelScorerError> {
        let scorer = reward_model::RewardModelScorer::open(name, spec, self.recipe, self.load_now)
            .map_err(|message| ModelScorerError::new("path", message))?;
        Ok(Arc::new(scorer))
    }

    fn judge(&self, name: &str, spec: &JudgeSpec) -> Result<Arc<dyn Scorer>, ModelScorerError> {
        Ok(Arc::new(judge::JudgeScorer::open(
            name,
            spec,
            self.recipe,
            self.load_now,
        )?))
    }
}

/// A scorer's `dtype` on the recipe's device.
fn compute_dtype(dtype: ModelDType, recipe: &Recipe) -> DType {
    let name = match dtype {
        ModelDType::F32 => DTypeName::F32,
        ModelDType::Bf16 => DTypeName::Bf16,
        ModelDType::Auto => DTypeName::Auto,
    };
    crate::setup::device::compute_dtype(name, recipe.cluster.device).0
}

/// The row's prompt as chat messages: its messages, or a string prompt as the user's message.
fn prompt_messages(prompt: &Value) -> Result<Vec<ChatMessage>, String> {
    match prompt {
        Value::String(text) => Ok(vec![ChatMessage::new("user", text.clone())]),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, m)| {
                match (
                    m.get("role").and_then(Value::as_str),
                    m.get("content").and_then(Value::as_str),
                ) {
                    (Some(role), Some(content)) => Ok(ChatMessage::new(role, content)),
                    _ => Err(format!(
                        "prompt message {i} is not {{role, content}} with string values: {m}"
                    )),
                }
            })
            .collect(),
        Value::Null => Err("the sample carries no prompt, which a model scorer reads".into()),
        other => Err(format!(
            "the prompt is neither chat messages nor a string: {other}"
        )),
    }
}

/// The error of a model scorer `scorer` on `sample`, from what went wrong.
fn model_error<'a>(scorer: &'a str, sample: &'a Sample) -> impl Fn(String) -> ScoreError + Copy + 'a {
    move |message| ScoreError::Model {
        scorer: scorer.to_string(),
        sample_id: sample.id,
        message,
    }
}

/// One sequence to score and where its logits go.
type Job = (Vec<u32>, mpsc::Sender<Result<Vec<f32>, String>>);

/// A classifier on its own thread: the weights live there, and it scores whatever sequences
/// have arrived (up to a micro-batch) in one program run.
struct ClassifierThread {
    queue: Mutex<mpsc::Sender<Job>>,
}

impl ClassifierThread {
    /// Uploads `weights` to device 0 of the recipe's client as `dtype` and starts the thread
    /// (named after the scorer), which ends when this is dropped.
    fn start(
        name: &str,
        weights: ClassifierWeights,
        recipe: &Recipe,
        dtype: DType,
        micro_batch: usize,
    ) -> Result<ClassifierThread, String> {
        let client = crate::setup::device::open_client(recipe).map_err(|e| e.to_string())?;
        let mut classifier =
            DeviceClassifier::upload(&client, &weights, dtype, 0).map_err(|e| e.to_string())?;
        drop(weights);
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(format!("scorer-{name}"))
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut jobs = vec![first];
                    while jobs.len() < micro_batch {
                        match rx.try_recv() {
                            Ok(job) => jobs.push(job),
                            Err(_) => break,
                        }
                    }
                    let sequences: Vec<Vec<u32>> = jobs.iter().map(|(ids, _)| ids.clone()).collect();
                    match classifier.score(&sequences) {
                        Ok(scores) => {
                            for ((_, reply), score) in jobs.into_iter().zip(scores) {
                                let _ = reply.send(Ok(score));
                            }
                        }
                        Err(e) => {
                            for (_, reply) in jobs {
                                let _ = reply.send(Err(e.to_string()));
                            }
                        }
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        tracing::info!("scorer `{name}` on {} in {dtype}", client.platform_name());
        Ok(ClassifierThread {
            queue: Mutex::new(tx),
        })
    }

    /// The logits of `ids` (waits for the device thread).
    fn score(&self, ids: Vec<u32>) -> Result<Vec<f32>, String> {
        let (reply, answer) = mpsc::channel();
        let stopped = || "the scorer's device thread has stopped".to_string();
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send((ids, reply))
            .map_err(|_| stopped())?;
        answer.recv().map_err(|_| stopped())?
    }
}
