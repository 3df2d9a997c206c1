//! A training or validation set as the trainer sees it: the recipe's Parquet files, minus the
//! prompts that `data.filter_overlong_prompts` drops and outside `data.*_max_samples`, addressed
//! by position `0..len()`, with samplers and prompt encoding under `data.truncation`.

use std::path::{Path, PathBuf};

use crate::config::{DataConfig, DataFiles};
use crate::error::{DataError, Result};
use crate::example::Example;
use crate::parquet_dataset::{ColumnNames, ParquetDataset};
use crate::rng::SplitMix64;
use crate::sampler::Sampler;
use crate::tokenize::{PromptTokenizer, Truncation};

/// Stream number of the `*_max_samples` subset (epochs use streams 0, 1, 2, ...).
const SUBSET_STREAM: u64 = u64::MAX;

/// What opening a dataset kept and dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenReport {
    /// Rows in the files.
    pub rows_in_files: u64,
    /// Rows dropped by `data.filter_overlong_prompts`.
    pub dropped_overlong: u64,
    /// Rows left out by `data.train_max_samples` / `data.val_max_samples`.
    pub dropped_by_max_samples: u64,
    /// Rows in the dataset.
    pub rows: u64,
}

/// A dataset of prompts (see the module documentation).
#[derive(Debug)]
pub struct PromptDataset {
    parquet: ParquetDataset,
    /// Global row index of each position, when rows were dropped; `None` means all rows.
    kept: Option<Vec<u64>>,
    report: OpenReport,
    max_prompt_length: usize,
    truncation: Truncation,
}

/// Which of the recipe's two datasets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// `data.train_files`.
    Train,
    /// `data.val_files`.
    Validation,
}

impl PromptDataset {
    /// Opens the training or validation set of `config`. The tokenizer is needed when
    /// `data.filter_overlong_prompts` is on (it counts every prompt's tokens once, streaming the
    /// prompt column only).
    pub fn open(config: &DataConfig, split: Split, tokenizer: Option<&dyn PromptTokenizer>) -> Result<Self> {
        config.validate()?;
        let (files, key, max_samples) = match split {
            Split::Train => (&config.train_files, "train_files", config.train_max_samples),
            Split::Validation => (&config.val_files, "val_files", config.val_max_samples),
        };
        Self::open_files(files, key, config, max_samples, tokenizer)
    }

    fn open_files(
        files: &DataFiles,
        key: &'static str,
        config: &DataConfig,
        max_samples: i64,
        tokenizer: Option<&dyn PromptTokenizer>,
    ) -> Result<Self> {
        if files.0.is_empty() {
            return Err(DataError::NoFiles { key });
        }
        let paths: Vec<PathBuf> = files.0.iter().map(|p| expand_home(p)).collect();
        let names = ColumnNames {
            prompt: config.prompt_key.clone(),
            data_source: config.reward_fn_key.clone(),
        };
        let parquet = ParquetDataset::open(&paths, names)?;
        let rows_in_files = parquet.len();
        let mut kept: Option<Vec<u64>> = None;
        let mut dropped_overlong = 0;
        if config.filter_overlong_prompts {
            let tokenizer = tokenizer.ok_or_else(|| DataError::InvalidOption {
                option: "data.filter_overlong_prompts".into(),
                problem: "is on but no tokenizer was given to count prompt tokens".into(),
            })?;
            let mut survivors = Vec::new();
            let column = config.prompt_key.clone();
            parquet.for_each_prompt(|index, path, row, prompt| {
                let tokens =
                    tokenizer
                        .count_prompt_tokens(&prompt)
                        .map_err(|source| DataError::Tokenize {
                            path: path.to_owned(),
                            row,
                            column: column.clone(),
                            source,
                        })?;
                if tokens <= config.max_prompt_length {
                    survivors.push(index);
                }
                Ok(())
            })?;
            dropped_overlong = rows_in_files - survivors.len() as u64;
            tracing::info!(
                dropped = dropped_overlong,
                kept = survivors.len(),
                max_prompt_length = config.max_prompt_length,
                "data.filter_overlong_prompts dropped prompts longer than max_prompt_length"
            );
            if survivors.is_empty() {
                return Err(DataError::Empty {
                    files: file_list(&paths),
                    detail: format!(
                        "all {rows_in_files} prompts are longer than data.max_prompt_length = {} \
                         tokens; raise it or turn data.filter_overlong_prompts off and set \
                         data.truncation",
                        config.max_prompt_length
                    ),
                });
            }
            kept = Some(survivors);
        }
        let available = kept.as_ref().map_or(rows_in_files, |k| k.len() as u64);
        let mut dropped_by_max_samples = 0;
        if max_samples > 0 && (max_samples as u64) < available {
            let mut rows: Vec<u64> = match kept.take() {
                Some(rows) => rows,
                None => (0..rows_in_files).collect(),
            };
            SplitMix64::for_stream(config.seed, SUBSET_STREAM).shuffle(&mut rows);
            rows.truncate(max_samples as usize);
            rows.sort_unstable();
            dropped_by_max_samples = available - rows.len() as u64;
            kept = Some(rows);
        }
        let rows = kept.as_ref().map_or(rows_in_files, |k| k.len() as u64);
        Ok(Self {
            parquet,
            kept,
            report: OpenReport {
                rows_in_files,
                dropped_overlong,
                dropped_by_max_samples,
                rows,
            },
            max_prompt_length: config.max_prompt_length,
            truncation: config.truncation,
        })
    }

    /// Number of prompts.
    pub fn len(&self) -> u64 {
        self.report.rows
    }

    /// Always false: opening fails on an empty dataset.
    pub fn is_empty(&self) -> bool {
        self.report.rows == 0
    }

    /// What opening kept and dropped.
    pub fn report(&self) -> &OpenReport {
        &self.report
    }

    /// The underlying files.
    pub fn parquet(&self) -> &ParquetDataset {
        &self.parquet
    }

    fn global_index(&self, position: u64) -> Result<u64> {
        match &self.kept {
            None if position < self.report.rows => Ok(position),
            Some(kept) if position < kept.len() as u64 => Ok(kept[position as usize]),
            _ => Err(DataError::IndexOutOfRange {
                index: position,
                len: self.report.rows,
            }),
        }
    }

    /// The prompts at `positions` (`0..len()`), in that order.
    pub fn read(&self, positions: &[u64]) -> Result<Vec<Example>> {
        let indices = positions
            .iter()
            .map(|&position| self.global_index(position))
            .collect::<Result<Vec<_>>>()?;
        self.parquet.read(&indices)
    }

    /// The token ids of `example`'s prompt, fitted into `data.max_prompt_length` according to
    /// `data.truncation`; `error` mode fails naming the file and row.
    pub fn encode_prompt(&self, example: &Example, tokenizer: &dyn PromptTokenizer) -> Result<Vec<u32>> {
        let column = || self.parquet.column_names().prompt.clone();
        let ids = tokenizer
            .encode_prompt(&example.prompt)
            .map_err(|source| DataError::Tokenize {
                path: example.file.to_path_buf(),
                row: example.row,
                column: column(),
                source,
            })?;
        self.truncation
            .apply(ids, self.max_prompt_length)
            .map_err(|tokens| DataError::PromptTooLong {
                path: example.file.to_path_buf(),
                row: example.row,
                column: column(),
                tokens,
                max: self.max_prompt_length,
            })
    }

    /// The training sampler: batches of `data.gen_batch_size` (else `data.train_batch_size`),
    /// `data.shuffle`, `data.seed`, `data.drop_last`.
    pub fn train_sampler(&self, config: &DataConfig) -> Result<Sampler> {
        Sampler::new(
            self.len(),
            config.gen_batch_size.unwrap_or(config.train_batch_size),
            config.shuffle,
            config.seed,
            config.drop_last,
        )
    }

    /// The validation sampler: `data.val_batch_size` (the whole set when null),
    /// `data.validation_shuffle`, never dropping rows.
    pub fn validation_sampler(&self, config: &DataConfig) -> Result<Sampler> {
        let batch = config
            .val_batch_size
            .unwrap_or(self.len() as usize)
            .min(self.len() as usize);
        Sampler::new(self.len(), batch, config.validation_shuffle, config.seed, false)
    }
}

fn file_list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Expands a leading `~/` to `$HOME` (VeRL's recipes use `~/data/...`).
fn expand_home(path: &Path) -> PathBuf {
    match (path.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => path.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_home() {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        if let Some(home) = home {
            assert_eq!(expand_home(Path::new("~/d/x.parquet")), home.join("d/x.parquet"));
        }
        assert_eq!(
            expand_home(Path::new("d/x.parquet")),
            PathBuf::from("d/x.parquet")
        );
    }
}
