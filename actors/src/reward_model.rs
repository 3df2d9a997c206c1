//! Reward models as scorers (`reward.scorers.NAME: {kind: reward_model, ...}`): a
//! `*ForSequenceClassification` checkpoint ([`model::classifier`]) scores the row's prompt and
//! the response, rendered as a conversation by the reward model's own chat template and
//! tokenizer (as VeRL's reward-model worker re-renders them when the tokenizers differ), read
//! at the conversation's last token.
//!
//! The reward pool calls a scorer from several threads, one sample each; a scorer's samples go
//! to one device thread, which scores whatever has arrived (up to `micro_batch_size`) in one
//! program run. The device thread owns the weights: it is started by [`RewardModels`] when the
//! reward role runs in this process (`load_now`), otherwise by the first sample.

use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex, OnceLock};

use model::classifier::{ClassifierConfig, ClassifierWeights, DeviceClassifier};
use model::{ChatMessage, ChatTemplate, ModelTokenizer};
use reward::{RewardModelSpec, RmDType, RmTruncation, Sample, Score, ScoreError, Scorer};
use serde_json::Value;
use xla::DType;

use crate::recipe::{DTypeName, Recipe};

/// Builds the `reward_model` scorers of a recipe (see [`reward::ModelScorers`]).
pub struct RewardModels<'a> {
    /// The recipe: its `cluster` says which device the models run on.
    pub recipe: &'a Recipe,
    /// Load each model onto its device now (the reward role runs in this process), rather than
    /// when the first sample arrives.
    pub load_now: bool,
}

impl reward::ModelScorers for RewardModels<'_> {
    fn reward_model(&self, name: &str, spec: &RewardModelSpec) -> Result<Arc<dyn Scorer>, String> {
        let scorer = RewardModelScorer::open(name, spec, self.recipe)?;
        if self.load_now {
            scorer.device()?;
        }
        Ok(Arc::new(scorer))
    }
}

/// One conversation to score and where its score goes.
type Job = (Vec<u32>, mpsc::Sender<Result<f32, String>>);

struct RewardModelScorer {
    name: String,
    path: PathBuf,
    tokenizer: ModelTokenizer,
    template: ChatTemplate,
    max_length: usize,
    truncation: RmTruncation,
    micro_batch_size: usize,
    dtype: DType,
    recipe: Recipe,
    /// The device thread's queue, once started (or why it could not start).
    device: OnceLock<Result<Mutex<mpsc::Sender<Job>>, String>>,
}

impl RewardModelScorer {
    /// Reads what scoring needs from the checkpoint directory but its weights: the config (one
    /// label), the tokenizer and the chat template; errors name the file and what to do.
    fn open(name: &str, spec: &RewardModelSpec, recipe: &Recipe) -> Result<RewardModelScorer, String> {
        let path = PathBuf::from(&spec.path);
        if !path.is_dir() {
            return Err(format!(
                "{} is not a directory: give the reward model's checkpoint directory (config.json, \
                 *.safetensors, tokenizer.json, tokenizer_config.json)",
                path.display()
            ));
        }
        let config = ClassifierConfig::from_hf_file(&path.join("config.json")).map_err(|e| e.to_string())?;
        if config.num_labels != 1 {
            return Err(format!(
                "{} has {} labels; a reward model scores with one (`id2label` of length 1)",
                path.display(),
                config.num_labels
            ));
        }
        let tokenizer = ModelTokenizer::from_file(&path.join("tokenizer.json")).map_err(|e| e.to_string())?;
        tokenizer.check_fits(&config.trunk).map_err(|e| e.to_string())?;
        let template_file = path.join("tokenizer_config.json");
        let template = ChatTemplate::from_tokenizer_config(&template_file).map_err(|e| {
            format!(
                "{e}: a reward model reads the conversation rendered by the chat template it was \
                 trained with, from its tokenizer_config.json"
            )
        })?;
        let dtype = match spec.dtype {
            RmDType::F32 => DTypeName::F32,
            RmDType::Bf16 => DTypeName::Bf16,
            RmDType::Auto => DTypeName::Auto,
        };
        Ok(RewardModelScorer {
            name: name.to_string(),
            path,
            tokenizer,
            template,
            max_length: spec.max_length,
            truncation: spec.truncation,
            micro_batch_size: spec.micro_batch_size,
            dtype: crate::setup::compute_dtype(dtype, recipe.cluster.device).0,
            recipe: recipe.clone(),
            device: OnceLock::new(),
        })
    }

    /// The device thread's queue, starting the thread (weights loaded and uploaded) the first
    /// time.
    fn device(&self) -> Result<&Mutex<mpsc::Sender<Job>>, String> {
        self.device
            .get_or_init(|| self.start().map(Mutex::new))
            .as_ref()
            .map_err(Clone::clone)
    }

    fn start(&self) -> Result<mpsc::Sender<Job>, String> {
        let at = |e: &dyn std::fmt::Display| format!("reward model {}: {e}", self.path.display());
        let weights = ClassifierWeights::load(&self.path).map_err(|e| at(&e))?;
        let client = crate::setup::open_client(&self.recipe).map_err(|e| at(&e))?;
        let mut classifier =
            DeviceClassifier::upload(&client, &weights, self.dtype, 0).map_err(|e| at(&e))?;
        drop(weights);
        let (tx, rx) = mpsc::channel::<Job>();
        let micro_batch = self.micro_batch_size;
        std::thread::Builder::new()
            .name(format!("reward-model-{}", self.name))
            .spawn(move || {
                // Ends when the scorer, and with it the queue's sender, is dropped.
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
                                let _ = reply.send(Ok(score[0]));
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
            .map_err(|e| at(&e))?;
        tracing::info!(
            "reward model `{}` ({}) on {} in {}",
            self.name,
            self.path.display(),
            client.platform_name(),
            self.dtype
        );
        Ok(tx)
    }

    /// The token ids the model reads for `sample`: the prompt's messages (a string prompt as
    /// one user message) and the response as the assistant's, rendered by the model's chat
    /// template, cut to `max_length` as `truncation` says.
    fn conversation(&self, sample: &Sample) -> Result<Vec<u32>, String> {
        let mut messages = match &sample.prompt {
            Value::String(text) => vec![ChatMessage::new("user", text.clone())],
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
                .collect::<Result<_, _>>()?,
            Value::Null => return Err("the sample carries no prompt, which a reward model reads".into()),
            other => {
                return Err(format!(
                    "the prompt is neither chat messages nor a string: {other}"
                ))
            }
        };
        messages.push(ChatMessage::new("assistant", sample.response.clone()));
        let text = self
            .template
            .render(&messages, false)
            .map_err(|e| e.to_string())?;
        let mut ids = self.tokenizer.encode(&text, false).map_err(|e| e.to_string())?;
        if ids.len() > self.max_length {
            match self.truncation {
                RmTruncation::Right => ids.truncate(self.max_length),
                RmTruncation::Left => {
                    ids.drain(..ids.len() - self.max_length);
                }
                RmTruncation::Error => {
                    return Err(format!(
                        "the conversation is {} tokens, over `max_length` {} (`truncation: error`)",
                        ids.len(),
                        self.max_length
                    ))
                }
            }
        }
        Ok(ids)
    }
}

impl Scorer for RewardModelScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let failed = |message: String| ScoreError::Model {
            scorer: self.name.clone(),
            sample_id: sample.id,
            message,
        };
        let ids = self.conversation(sample).map_err(failed)?;
        let (reply, answer) = mpsc::channel();
        self.device()
            .map_err(failed)?
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send((ids, reply))
            .map_err(|_| failed("the reward model's device thread has stopped".into()))?;
        let value = answer
            .recv()
            .map_err(|_| failed("the reward model's device thread has stopped".into()))?
            .map_err(failed)?;
        Ok(Score::new(value as f64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reward::ModelScorers;
    use serde_json::json;

    fn recipe() -> Recipe {
        crate::recipe::load_recipe_str(
            "model:\n  path: m.gguf\ndata:\n  train_files: t.parquet\n",
            "r.yaml",
        )
        .unwrap()
    }

    fn spec(path: &std::path::Path) -> RewardModelSpec {
        RewardModelSpec {
            path: path.display().to_string(),
            max_length: 512,
            truncation: RmTruncation::Right,
            micro_batch_size: 4,
            dtype: RmDType::F32,
        }
    }

    fn sample(id: u64, prompt: Value, response: &str) -> Sample {
        Sample {
            id,
            data_source: "test".into(),
            prompt,
            response: response.into(),
            ground_truth: String::new(),
            extra: Value::Null,
            response_length: 1,
            truncated: false,
        }
    }

    fn user(text: &str) -> Value {
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}])
    }

    /// Scores from the pool's threads (batched on the device thread) equal the classifier's own
    /// scores of the conversations rendered by the reward model's template, one at a time.
    #[test]
    fn scores_are_the_classifier_s_on_the_rendered_conversation() {
        let dir = tempfile::tempdir().unwrap();
        let path = testkit::tiny_reward_model(dir.path(), 11);
        let recipe = recipe();
        let scorer = RewardModels {
            recipe: &recipe,
            load_now: true,
        }
        .reward_model("rm", &spec(&path))
        .unwrap();
        let samples: Vec<Sample> = (0..8u64)
            .map(|i| {
                sample(
                    i,
                    user(&format!("What is {i} + 3?")),
                    &format!("It is {}.", i + 3),
                )
            })
            .collect();
        let scores: Vec<f64> = std::thread::scope(|s| {
            let handles: Vec<_> = samples
                .iter()
                .map(|x| s.spawn(|| scorer.score(x).unwrap().value))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let template = ChatTemplate::from_tokenizer_config(&path.join("tokenizer_config.json")).unwrap();
        let tokenizer = ModelTokenizer::from_file(&path.join("tokenizer.json")).unwrap();
        let weights = ClassifierWeights::load(&path).unwrap();
        let mut direct = DeviceClassifier::upload(testkit::cpu_client(1), &weights, DType::F32, 0).unwrap();
        for (x, got) in samples.iter().zip(&scores) {
            let messages = vec![
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", x.prompt[1]["content"].as_str().unwrap()),
                ChatMessage::new("assistant", x.response.clone()),
            ];
            let ids = tokenizer
                .encode(&template.render(&messages, false).unwrap(), false)
                .unwrap();
            let expected = direct.score(&[ids]).unwrap()[0][0] as f64;
            assert!(
                (got - expected).abs() < 1e-5,
                "sample {}: {got} vs {expected}",
                x.id
            );
        }
        assert!(scores.windows(2).any(|w| w[0] != w[1]), "{scores:?}");
        // A string prompt is the user's message.
        let plain = scorer
            .score(&sample(9, json!("What is 1 + 3?"), "4"))
            .unwrap()
            .value;
        let as_messages = scorer
            .score(&sample(
                10,
                json!([{"role": "user", "content": "What is 1 + 3?"}]),
                "4",
            ))
            .unwrap()
            .value;
        assert_eq!(plain, as_messages);
    }

    #[test]
    fn long_conversations_are_cut_as_truncation_says_and_bad_prompts_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = testkit::tiny_reward_model(dir.path(), 11);
        let recipe = recipe();
        let long = sample(1, user("Count."), &"one two three ".repeat(40));
        let ids = |truncation, max_length| {
            let scorer = RewardModelScorer::open(
                "rm",
                &RewardModelSpec {
                    truncation,
                    max_length,
                    ..spec(&path)
                },
                &recipe,
            )
            .unwrap();
            scorer.conversation(&long)
        };
        let whole = ids(RmTruncation::Right, 4096).unwrap();
        assert!(whole.len() > 100);
        assert_eq!(ids(RmTruncation::Right, 50).unwrap(), whole[..50]);
        assert_eq!(ids(RmTruncation::Left, 50).unwrap(), whole[whole.len() - 50..]);
        let e = ids(RmTruncation::Error, 50).unwrap_err();
        assert!(
            e.contains(&format!("is {} tokens, over `max_length` 50", whole.len())),
            "{e}"
        );

        let scorer = RewardModelScorer::open("rm", &spec(&path), &recipe).unwrap();
        let e = scorer.score(&sample(2, Value::Null, "x")).unwrap_err();
        assert_eq!(e.kind(), "model");
        assert!(
            e.to_string()
                .contains("reward model `rm` failed on sample 2: the sample carries no prompt"),
            "{e}"
        );
        let e = scorer
            .score(&sample(3, json!([{"role": "user"}]), "x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("prompt message 0 is not {role, content}"), "{e}");
    }

    #[test]
    fn a_checkpoint_that_is_not_a_reward_model_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = testkit::tiny_reward_model(dir.path(), 11);
        let recipe = recipe();
        let open = |p: &std::path::Path| RewardModelScorer::open("rm", &spec(p), &recipe).err().unwrap();
        let e = open(&dir.path().join("tiny-smollm2"));
        assert!(e.contains("LlamaForCausalLM is not a sequence classifier"), "{e}");
        let e = open(&dir.path().join("absent"));
        assert!(e.contains("absent is not a directory"), "{e}");
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(path.join("config.json")).unwrap()).unwrap();
        config["id2label"] = json!({"0": "bad", "1": "good"});
        std::fs::write(path.join("config.json"), config.to_string()).unwrap();
        let e = open(&path);
        assert!(e.contains("has 2 labels; a reward model scores with one"), "{e}");
    }
}
