//! Tool use for multi-turn rollouts, the part that is pure text and JSON:
//!
//! - [`call`]: tool calls parsed out of a model's turn in the model's own format ([`CallFormat`]:
//!   Hermes, which Qwen2.5 and Qwen3 use, and Llama 3.1's JSON calls), with one readable
//!   [`CallError`] per malformed call so the rollout can show the model what it got wrong;
//! - [`schema`]: [`ToolSchema`], a tool's description in the OpenAI function form that chat
//!   templates (`apply_chat_template(tools=...)`) and VeRL's tool config files use;
//! - [`tool`]: the [`Tool`] interface, its errors ([`ToolError`]) and the [`Toolbox`] that finds
//!   a call's tool by name and keeps a panicking tool from taking the rollout down;
//! - [`calculator`]: the built-in [`Calculator`], exact arithmetic on integers of any size;
//! - [`external`]: user tools in any language, a JSON-lines child process or an HTTP endpoint;
//! - [`interaction`]: an environment answering the model's turns as a user would (VeRL's
//!   interactions), over the same transports;
//! - [`config`]: tool and interaction config files (VeRL's `tool_config_path`,
//!   `interaction_config_path`) read into [`ToolSpec`]s and `InteractionSpec`s;
//! - [`python`]: the built-in Python executor, code run in a child process that [`sandbox`]
//!   confines (Linux only: Landlock, seccomp and resource limits).
//!
//! Generation, tokenization and the turn loop live in the rollout; this crate has no dependency
//! on the compute core or the model, so it builds and tests in seconds.

#![deny(missing_docs)]

pub mod calculator;
pub mod call;
pub mod config;
pub mod external;
pub mod interaction;
#[cfg(target_os = "linux")]
pub mod python;
#[cfg(target_os = "linux")]
pub mod sandbox;
pub mod schema;
pub mod tool;

pub use calculator::Calculator;
pub use call::{CallError, CallFormat, Parsed, ToolCall};
pub use config::{ToolFileError, ToolSpec};
pub use external::ExternalTool;
pub use interaction::{EnvTurn, Environment, Interaction, Reply};
#[cfg(target_os = "linux")]
pub use python::{Python, PythonError, PythonSettings};
pub use schema::{SchemaError, ToolSchema};
pub use tool::{CallContext, DuplicateTool, Tool, ToolError, Toolbox};
