//! `data`: what goes into a run. Reads training and validation prompts from Parquet files in
//! VeRL's schema (or TRL's prompt-only form), streaming row groups so datasets larger than
//! memory work; filters and truncates prompts by token count through a tokenizer the caller
//! supplies ([`PromptTokenizer`]); samples seeded, resumable batches ([`Sampler`]); and
//! preprocesses raw tasks (GSM8K, synthetic arithmetic) into VeRL-schema Parquet
//! ([`preprocess`]).
//!
//! The crate stands alone: it depends on neither the compute core nor the model crate.
//!
//! ```no_run
//! use data::{DataConfig, PromptDataset, Split};
//!
//! let config: DataConfig = serde_yaml::from_str("train_files: train.parquet\ntrain_batch_size: 8").unwrap();
//! let dataset = PromptDataset::open(&config, Split::Train, None)?;
//! let mut sampler = dataset.train_sampler(&config)?;
//! let batch = sampler.next_batch();
//! for example in dataset.read(&batch.positions)? {
//!     println!("{:?} -> {:?}", example.prompt, example.ground_truth_text());
//! }
//! # Ok::<(), data::DataError>(())
//! ```

mod columns;
pub mod config;
pub mod dataset;
pub mod error;
pub mod example;
pub mod parquet_dataset;
pub mod preprocess;
pub mod rng;
pub mod sampler;
pub mod tokenize;

/// `serde_json`, whose `Value` carries the scorer's columns in [`Example::columns`].
pub use serde_json;

pub use config::{DataConfig, DataFiles};
pub use dataset::{OpenReport, PromptDataset, Split};
pub use error::{DataError, Result, TokenizeError};
pub use example::{Example, Message, Prompt};
pub use parquet_dataset::{ColumnNames, ParquetDataset, RowGroupInfo};
pub use sampler::{Batch, Sampler, SamplerState};
pub use tokenize::{PromptTokenizer, Truncation};
