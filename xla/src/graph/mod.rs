//! The tracing graph builder: traced [`Tensor`]s with static shapes and dtypes, the primitives
//! (each with its shape rule and StableHLO lowering in `ops.rs`, its VJP rule in `backprop.rs`), reverse-mode
//! autodiff ([`grad`], [`value_and_grad`], [`vjp`]), composites (softmax, RMSNorm, RoPE,
//! cross-entropy, ...), counter-based random numbers, SPMD shardings and emission of a
//! [`Program`] (StableHLO text with a stable fingerprint) for the runtime to compile.
//!
//! Errors: ops never panic on bad shapes or dtypes; the first error (op, operand shapes,
//! caller's file:line) is kept in the graph and returned by [`Graph::check`] /
//! [`Graph::build`].
//!
//! Notes for model code (what keeps XLA CPU fast):
//! - Keep element-wise work in f32; for large products pass bf16 operands with
//!   `dot_general(.., Some(DType::F32))`. The gradient products keep bf16 operands and f32
//!   accumulation, the fast path on XLA CPU.
//! - f32 means f32 on every device: products of f32 operands are emitted with
//!   `precision = HIGHEST` (with DEFAULT the CUDA plugin computes them in TF32 and a TPU in one
//!   bf16 pass); products of narrower operands keep DEFAULT.
//! - Gradients of `dot_general` are emitted without transposes whenever one operand order gives
//!   the operand's layout (projections `[b, t, d] x [d, e]`, attention `q k^T`, `p v`); store
//!   a KV cache as `[slot, kv_head, pos, head_dim]`.
//! - Do not materialise `[tokens, vocab]` log-softmax for the loss: `token_log_probs` gathers
//!   the target logit and subtracts `logsumexp`; chunk long sequences through the head.
//! - `&x * 2.0` emits one splat constant (identical splats are shared); `x * 1`, `x + 0` are
//!   folded; repeated subexpressions are emitted once; `stop_gradient` emits nothing.
//! - Per-slot KV-cache writes: flatten the rows and use [`Tensor::scatter`] (replace).
//!
//! ```
//! use xla::graph::{Graph, grad};
//! use xla::DType;
//! let g = Graph::new("example");
//! let x = g.parameter("x", DType::F32, &[4, 3]);
//! let w = g.parameter("w", DType::F32, &[3, 2]);
//! let loss = x.matmul(&w).tanh().sum_all();
//! let dw = grad(&loss, &[&w]).unwrap().remove(0);
//! let program = g.build(&[&loss, &dw]).unwrap();
//! assert!(program.mlir().contains("stablehlo.dot_general"));
//! ```

mod autodiff;
mod backprop;
mod builder;
mod composite;
mod emit;
pub mod ops;
pub mod random;
mod scan;
mod sharding;
mod tensor;
mod value;

pub use autodiff::{grad, value_and_grad, vjp};
pub use builder::{Graph, Tensor};
pub use emit::{BuildOptions, Program};
pub use ops::ScanBody;
pub use ops::{BinaryOp, Comparison, DotDims, ReduceKind, UnaryOp};
pub use sharding::{assemble_host, holders, shard_host, Mesh, Refinement, Sharding};
pub use value::TensorType;

/// What went wrong while tracing, differentiating or emitting a graph.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    /// A primitive was applied to operands its shape/dtype rule rejects.
    #[error("{location}: {op}: {message}")]
    Op {
        /// The op that failed (e.g. `dot_general`).
        op: String,
        /// What is wrong, with the operand shapes.
        message: String,
        /// The source location of the call that added it.
        location: String,
    },
    /// A gradient request that cannot be honoured.
    #[error("{location}: gradient: {message}")]
    Grad {
        /// What is wrong.
        message: String,
        /// The source location of the request.
        location: String,
    },
    /// The program cannot be emitted as requested (donation, sharding).
    #[error("build: {0}")]
    Build(String),
}
