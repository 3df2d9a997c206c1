//! The `data` section of a recipe: VeRL's key names, types and defaults where VeRL has them.

use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{DataError, Result};
use crate::tokenize::Truncation;

/// One Parquet file or a list of them (VeRL accepts both forms for `train_files`/`val_files`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
#[serde(transparent)]
pub struct DataFiles(pub Vec<PathBuf>);

impl<'de> Deserialize<'de> for DataFiles {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged, expecting = "a file path or a list of file paths")]
        enum OneOrMany {
            One(PathBuf),
            Many(Vec<PathBuf>),
        }
        Ok(match OneOrMany::deserialize(deserializer)? {
            OneOrMany::One(path) => DataFiles(vec![path]),
            OneOrMany::Many(paths) => DataFiles(paths),
        })
    }
}

impl<P: Into<PathBuf>> FromIterator<P> for DataFiles {
    fn from_iter<I: IntoIterator<Item = P>>(paths: I) -> Self {
        DataFiles(paths.into_iter().map(Into::into).collect())
    }
}

/// The recipe's `data` section. Every key is optional (defaults below); unknown keys are errors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "snake_case")]
pub struct DataConfig {
    /// Training Parquet file(s), in VeRL's schema or TRL's prompt-only form.
    pub train_files: DataFiles,
    /// Validation Parquet file(s); empty means no validation.
    pub val_files: DataFiles,
    /// The column holding the prompt: a list of `{role, content}` messages or a string.
    pub prompt_key: String,
    /// The column whose value selects the scorer (VeRL: `reward_fn_key`).
    pub reward_fn_key: String,
    /// Maximum prompt length in tokens (chat template included).
    pub max_prompt_length: usize,
    /// Maximum response length in tokens; read by rollout, kept here under VeRL's name.
    pub max_response_length: usize,
    /// Prompts per training step (before `rollout.n` responses each).
    pub train_batch_size: usize,
    /// Prompts per generation round when `algorithm.filter_groups` refills the step (DAPO's
    /// dynamic sampling); `None` (VeRL's default) is `train_batch_size`.
    pub gen_batch_size: Option<usize>,
    /// Prompts per validation batch; `None` (VeRL's `null`) means the whole validation set.
    pub val_batch_size: Option<usize>,
    /// Shuffle the training set each epoch.
    pub shuffle: bool,
    /// Seed of the shuffle (VeRL's `null` falls back to 1; so does ours).
    pub seed: u64,
    /// Shuffle the validation set.
    pub validation_shuffle: bool,
    /// Drop the last incomplete training batch of each epoch (VeRL always does).
    pub drop_last: bool,
    /// Drop rows whose prompt is longer than `max_prompt_length` tokens when the dataset is
    /// opened (the count dropped is reported).
    pub filter_overlong_prompts: bool,
    /// What to do with a prompt longer than `max_prompt_length`: `error`, `left`, `right` or
    /// `middle`.
    pub truncation: Truncation,
    /// Use at most this many training rows, a seeded random subset; -1 means all.
    pub train_max_samples: i64,
    /// Use at most this many validation rows, a seeded random subset; -1 means all.
    pub val_max_samples: i64,
    /// Variables passed to the chat template with every prompt and turn it renders, as
    /// transformers' `apply_chat_template(**kwargs)` takes them (Qwen3's `enable_thinking`).
    pub apply_chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            train_files: DataFiles::default(),
            val_files: DataFiles::default(),
            prompt_key: "prompt".into(),
            reward_fn_key: "data_source".into(),
            max_prompt_length: 512,
            max_response_length: 512,
            train_batch_size: 1024,
            gen_batch_size: None,
            val_batch_size: None,
            shuffle: true,
            seed: 1,
            validation_shuffle: false,
            drop_last: true,
            filter_overlong_prompts: false,
            truncation: Truncation::Error,
            train_max_samples: -1,
            val_max_samples: -1,
            apply_chat_template_kwargs: serde_json::Map::new(),
        }
    }
}

impl DataConfig {
    /// Checks the values that serde cannot (positive sizes, `-1` or a positive sample cap).
    pub fn validate(&self) -> Result<()> {
        let positive = |option: &str, value: usize| {
            if value == 0 {
                Err(DataError::InvalidOption {
                    option: format!("data.{option}"),
                    problem: "must be at least 1".into(),
                })
            } else {
                Ok(())
            }
        };
        positive("max_prompt_length", self.max_prompt_length)?;
        positive("train_batch_size", self.train_batch_size)?;
        if let Some(size) = self.gen_batch_size {
            positive("gen_batch_size", size)?;
        }
        if let Some(size) = self.val_batch_size {
            positive("val_batch_size", size)?;
        }
        for (option, value) in [
            ("train_max_samples", self.train_max_samples),
            ("val_max_samples", self.val_max_samples),
        ] {
            if value == 0 || value < -1 {
                return Err(DataError::InvalidOption {
                    option: format!("data.{option}"),
                    problem: format!("is {value}; use -1 for all rows or a positive count"),
                });
            }
        }
        if self.prompt_key.is_empty() {
            return Err(DataError::InvalidOption {
                option: "data.prompt_key".into(),
                problem: "is empty; name the prompt column (VeRL's default is `prompt`)".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_verl_data_section() {
        let yaml = "
train_files: ~/data/gsm8k/train.parquet
val_files: [a.parquet, b.parquet]
prompt_key: question
max_prompt_length: 256
train_batch_size: 64
filter_overlong_prompts: true
truncation: left
seed: 7
val_batch_size: null
";
        let config: DataConfig = serde_yaml::from_str(yaml).unwrap();
        assert_eq!(
            config.train_files,
            DataFiles(vec!["~/data/gsm8k/train.parquet".into()])
        );
        assert_eq!(
            config.val_files,
            DataFiles(vec!["a.parquet".into(), "b.parquet".into()])
        );
        assert_eq!(config.prompt_key, "question");
        assert_eq!(config.max_prompt_length, 256);
        assert_eq!(config.train_batch_size, 64);
        assert!(config.filter_overlong_prompts);
        assert_eq!(config.truncation, Truncation::Left);
        assert_eq!(config.seed, 7);
        assert_eq!(config.val_batch_size, None);
        assert!(config.shuffle && config.drop_last);
        assert_eq!(config.reward_fn_key, "data_source");
        config.validate().unwrap();
    }

    #[test]
    fn rejects_unknown_keys_and_bad_values() {
        let error = serde_yaml::from_str::<DataConfig>("max_prompt_lenght: 5").unwrap_err();
        assert!(
            error.to_string().contains("unknown field `max_prompt_lenght`"),
            "{error}"
        );
        let error = serde_yaml::from_str::<DataConfig>("truncation: top").unwrap_err();
        assert!(error.to_string().contains("unknown variant `top`"), "{error}");
        let config = DataConfig {
            train_max_samples: 0,
            ..DataConfig::default()
        };
        assert_eq!(
            config.validate().unwrap_err().to_string(),
            "invalid option `data.train_max_samples`: is 0; use -1 for all rows or a positive count"
        );
        let config = DataConfig {
            train_batch_size: 0,
            ..DataConfig::default()
        };
        assert_eq!(
            config.validate().unwrap_err().to_string(),
            "invalid option `data.train_batch_size`: must be at least 1"
        );
    }

    #[test]
    fn round_trips_through_yaml() {
        let config = DataConfig {
            train_files: ["t.parquet"].into_iter().collect(),
            ..DataConfig::default()
        };
        let text = serde_yaml::to_string(&config).unwrap();
        assert_eq!(serde_yaml::from_str::<DataConfig>(&text).unwrap(), config);
    }
}
