//! The compute core of `grpo`: everything numeric runs through this crate.
//!
//! - [`runtime`]: PJRT plugins loaded at run time (CPU, CUDA, TPU), clients, devices, buffers,
//!   executables, the executable cache and deviceless TPU compilation.
//! - [`graph`]: a tracing graph builder over tensors with static shapes, reverse-mode autodiff
//!   (one VJP rule beside each primitive) and StableHLO emission.
//!
//! Both sides meet at StableHLO text: the graph emits it, the runtime compiles it.

pub mod dtype;
pub mod graph;
pub mod runtime;

pub use dtype::{DType, NativeType};
