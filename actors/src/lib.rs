//! The control plane of `grpo`: the recipe a run is described by, the roles a run is made of
//! (each in-process or behind gRPC), the run's token, and the worker process that serves a role.
//!
//! - [`recipe`]: the typed recipe, its loading errors, `--set` overrides and validation;
//! - [`setup`]: the one place a validated recipe becomes every crate's configuration and live
//!   objects, for the orchestrator, the workers and `grpo compile` alike; [`prepare`]: the
//!   model, tokenizer, datasets and reward function a run sets up before its first step;
//! - [`run`]: the single controller (`grpo run`): the step loop, its fleet of workers,
//!   metrics, validation and checkpoints;
//! - [`roles`]: rollout, reward and learner, each a trait with an in-process and a gRPC
//!   implementation, and the weight stream between them;
//! - [`scorers`]: the scorers that run a model (reward models, judges), which `reward` leaves
//!   to this crate;
//! - [`verl`]: `grpo verl`, a VeRL command line made a recipe;
//! - [`launcher`]: the worker processes of a run (local, or Ray jobs); [`transport`]: TCP or
//!   TLS; [`auth`]: the run's token; [`worker`]: `grpo worker`; [`proto`]: the wire protocol
//!   (`proto/grpo.proto`, compiled at build time with a vendored `protoc`).

pub mod auth;
pub mod launcher;
pub mod prepare;
pub mod proto;
pub mod recipe;
pub mod roles;
pub mod run;
pub mod scorers;
pub mod setup;
pub mod transport;
pub mod verl;
pub mod worker;
