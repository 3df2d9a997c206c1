//! A discriminative reward model (`reward.scorers.NAME: {kind: reward_model, ...}`): a
//! `*ForSequenceClassification` checkpoint ([`model::classifier`]) scores the row's prompt and
//! the response, rendered as a conversation by the reward model's own chat template and
//! tokenizer (as VeRL's reward-model worker re-renders them when the tokenizers differ), read
//! at the conversation's last token.

use std::path::PathBuf;
use std::sync::OnceLock;

use model::classifier::{ClassifierConfig, ClassifierWeights};
use model::{ChatMessage, ChatTemplate, ModelTokenizer};
use reward::{RewardModelSpec, RmTruncation, Sample, Score, ScoreError, Scorer};
use xla::DType;

use super::{compute_dtype, model_error, prompt_messages, ClassifierThread};
use crate::recipe::Recipe;

pub(super) struct RewardModelScorer {
    name: String,
    path: PathBuf,
    tokenizer: ModelTokenizer,
    template: ChatTemplate,
    max_length: usize,
    truncation: RmTruncation,
    micro_batch_size: usize,
    dtype: DType,
    recipe: Recipe,
    /// The model on its device thread, once started (or why it could not start).
    device: OnceLock<Result<ClassifierThread, String>>,
}

impl RewardModelScorer {
    /// Reads what scoring needs from the checkpoint directory but its weights: the config (one
    /// label), the tokenizer and the chat template; errors name the file and what to do. With
    /// `load_now` the model also goes onto its device now.
    pub(super) fn open(
        name: &str,
        spec: &RewardModelSpec,
        recipe: &Recipe,
        load_now: bool,
    ) -> Result<RewardModelScorer, String> {
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
        let template =
            ChatTemplate::from_tokenizer_config(&path.join("tokenizer_config.json")).map_err(|e| {
                format!(
                    "{e}: a reward model reads the conversation rendered by the chat template it was \
                 trained with, from its tokenizer_config.json"
                )
            })?;
        let scorer = RewardModelScorer {
            name: name.to_string(),
            path,
            tokenizer,
            template,
            max_length: spec.max_length,
            truncation: spec.truncation,
            micro_batch_size: spec.micro_batch_size,
            dtype: compute_dtype(spec.dtype, recipe),
            recipe: recipe.clone(),
            device: OnceLock::new(),
        };
        if load_now {
            scorer.device()?;
        }
        Ok(scorer)
    }

    /// The model's device thread, started (weights loaded and uploaded) the first time.
    fn device(&self) -> Result<&ClassifierThread, String> {
        self.device
            .get_or_init(|| {
                let weights = ClassifierWeights::load(&self.path).map_err(|e| e.to_string())?;
                ClassifierThread::start(
                    &self.name,
                    weights,
                    &self.recipe,
                    self.dtype,
                    self.micro_batch_size,
                )
                .map_err(|e| format!("reward model {}: {e}", self.path.display()))
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The token ids the model reads for `sample`: the prompt's messages and the response as
    /// the assistant's, rendered by the model's chat template, cut to `max_length` as
    /// `truncation` says.
    fn conversation(&self, sample: &Sample) -> Result<Vec<u32>, String> {
        let mut messages = prompt_messages(&sample.prompt)?;
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
        let failed = model_error(&self.name, sample);
        let ids = self.conversation(sample).map_err(failed)?;
        let logits = self.device().map_err(failed)?.score(ids).map_err(failed)?;
        Ok(Score::new(logits[0] as f64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::classifier::DeviceClassifier;
    use reward::{ModelDType, ModelScorers};
    use serde_json::{json, Value};

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
            dtype: ModelDType::F32,
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
        let scorer = crate::scorers::RecipeScorers {
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
                false,
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

        let scorer = RewardModelScorer::open("rm", &spec(&path), &recipe, false).unwrap();
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
        let open = |p: &std::path::Path| {
            RewardModelScorer::open("rm", &spec(p), &recipe, false)
                .err()
                .unwrap()
        };
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
