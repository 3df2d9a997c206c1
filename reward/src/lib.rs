//! Scoring for `grpo`: everything that turns a generated response into a reward.
//!
//! - [`scorer`]: the [`Scorer`] interface (one [`Sample`] in, one [`Score`] out) and its errors;
//! - rule-based scorers with VeRL's behaviour: [`gsm8k`], [`math`] (`math_reward`),
//!   [`math_dapo`], the project's synthetic [`arithmetic`] task, [`format`](mod@format) rewards;
//! - [`turn_scores`]: the reward an interaction gave a multi-turn episode;
//! - [`combine`]: weighted sums of scorers; [`overlong`]: DAPO's overlong-response penalty;
//! - [`external`]: scorers written in any language (a JSON-lines child process, an HTTP endpoint);
//! - [`registry`]: the [`RewardFunction`] that picks a scorer by `data_source` (VeRL's names, a
//!   default, recipe overrides) and applies the overlong penalty;
//! - [`config`]: the recipe's `reward:` section ([`RewardConfig`]); scorers that run a model
//!   (`reward_model`) are built by the caller through [`ModelScorers`];
//! - [`pool`]: the [`RewardPool`] scoring samples in parallel as they arrive, turning panics,
//!   crashes, hangs and garbage into a score of 0 plus a counted error.
//!
//! The crate stands alone: no dependency on the compute core, model or data crates.

#![deny(missing_docs)]

pub mod arithmetic;
pub mod combine;
pub mod config;
pub mod external;
pub mod format;
pub mod gsm8k;
pub mod math;
pub mod math_dapo;
pub mod overlong;
pub mod pool;
pub mod registry;
pub mod scorer;
pub mod turn_scores;

pub use config::{
    ConfigError, JudgeSpec, ModelDType, ModelScorerError, ModelScorers, RewardConfig, RewardModelSpec,
    RmTruncation, ScorerSpec, Verdict,
};
pub use pool::{PoolMetrics, PoolOptions, RewardPool, ScoredSample, SubmitError};
pub use registry::RewardFunction;
pub use scorer::{Sample, Score, ScoreError, Scorer};
