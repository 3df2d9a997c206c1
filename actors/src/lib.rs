//! The control plane of `grpo`: the recipe a run is described by, the roles a run is made of
//! (each in-process or behind gRPC), the run's token, and the worker process that serves a role.

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
