//! The primitives. Each [`Op`] has, in this file, its shape/dtype rule ([`Op::infer`]) and its
//! StableHLO lowering ([`Op::lower`]), and in `backprop.rs` its reverse-mode rule (`Op::vjp`); these
//! are exhaustive matches, so a new primitive cannot be added without all of them. Tensor methods
//! in `tensor.rs` only build `Op`s; composites in `composite.rs` are written in terms of them.
//!
//! Adding a primitive: a variant of [`Op`]; its arms in `name`, `infer`, `lower`,
//! `is_differentiable` and `backprop.rs`'s `vjp` (the compiler points at each); a method in `tensor.rs`; if it
//! is differentiable, a sample in [`differentiable_primitive_names`] and a row in
//! `tests/graph_gradcheck.rs` (whose coverage test fails until the row exists).

use std::fmt::Write;
use std::ops::Range;

use crate::dtype::DType;
use crate::graph::sharding::Sharding;
use crate::graph::value::{TensorType, ValueRef};

/// Element-wise one-operand primitives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Log1p,
    Tanh,
    Logistic,
    Sqrt,
    Rsqrt,
    Abs,
    Sign,
    Sin,
    Cos,
    Floor,
    IsFinite,
    Not,
}

impl UnaryOp {
    /// Every unary primitive.
    pub const ALL: [UnaryOp; 15] = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Log1p,
        UnaryOp::Tanh,
        UnaryOp::Logistic,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Abs,
        UnaryOp::Sign,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Floor,
        UnaryOp::IsFinite,
        UnaryOp::Not,
    ];

    /// The StableHLO op name (without the dialect prefix).
    pub fn mlir_name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "negate",
            UnaryOp::Exp => "exponential",
            UnaryOp::Log => "log",
            UnaryOp::Log1p => "log_plus_one",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Logistic => "logistic",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Abs => "abs",
            UnaryOp::Sign => "sign",
            UnaryOp::Sin => "sine",
            UnaryOp::Cos => "cosine",
            UnaryOp::Floor => "floor",
            UnaryOp::IsFinite => "is_finite",
            UnaryOp::Not => "not",
        }
    }
}

/// Element-wise two-operand primitives (operands of one type and shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Max,
    Min,
    Rem,
    And,
    Or,
    Xor,
    ShiftLeft,
    ShiftRightLogical,
}

impl BinaryOp {
    /// Every binary primitive.
    pub const ALL: [BinaryOp; 13] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Rem,
        BinaryOp::And,
        BinaryOp::Or,
        BinaryOp::Xor,
        BinaryOp::ShiftLeft,
        BinaryOp::ShiftRightLogical,
    ];

    /// The StableHLO op name.
    pub fn mlir_name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "subtract",
            BinaryOp::Mul => "multiply",
            BinaryOp::Div => "divide",
            BinaryOp::Pow => "power",
            BinaryOp::Max => "maximum",
            BinaryOp::Min => "minimum",
            BinaryOp::Rem => "remainder",
            BinaryOp::And => "and",
            BinaryOp::Or => "or",
            BinaryOp::Xor => "xor",
            BinaryOp::ShiftLeft => "shift_left",
            BinaryOp::ShiftRightLogical => "shift_right_logical",
        }
    }
}

/// Comparison directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Comparison {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Comparison {
    fn mlir(self) -> &'static str {
        match self {
            Comparison::Eq => "EQ",
            Comparison::Ne => "NE",
            Comparison::Lt => "LT",
            Comparison::Le => "LE",
            Comparison::Gt => "GT",
            Comparison::Ge => "GE",
        }
    }
}

/// Reduction kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    Sum,
    Max,
    Min,
}

/// Dimension numbers of a `dot_general`: batch dimensions (paired, same sizes) and
/// contracting dimensions (paired, summed over). The result is
/// `batch dims ++ lhs free dims ++ rhs free dims`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct DotDims {
    pub lhs_batch: Vec<usize>,
    pub rhs_batch: Vec<usize>,
    pub lhs_contract: Vec<usize>,
    pub rhs_contract: Vec<usize>,
}

impl DotDims {
    /// Plain matrix product `[m, k] x [k, n]`.
    pub fn matmul() -> DotDims {
        DotDims {
            lhs_contract: vec![1],
            rhs_contract: vec![0],
            ..Default::default()
        }
    }

    pub(crate) fn free(rank: usize, batch: &[usize], contract: &[usize]) -> Vec<usize> {
        (0..rank)
            .filter(|d| !batch.contains(d) && !contract.contains(d))
            .collect()
    }
}

/// The values of a constant.
#[derive(Clone, Debug, PartialEq)]
pub enum LiteralValues {
    /// One value for every element.
    Splat(f64),
    /// Floating-point values, row-major.
    Floats(Vec<f64>),
    /// Integer or boolean values, row-major.
    Ints(Vec<i64>),
}

/// A constant's element type and values.
#[derive(Clone, Debug, PartialEq)]
pub struct Literal {
    pub dtype: DType,
    pub values: LiteralValues,
}

impl Literal {
    pub(crate) fn splat(value: f64, dtype: DType) -> Literal {
        Literal {
            dtype,
            values: LiteralValues::Splat(value),
        }
    }

    pub(crate) fn dense_f64(values: &[f64], dtype: DType) -> Literal {
        Literal {
            dtype,
            values: LiteralValues::Floats(values.to_vec()),
        }
    }

    pub(crate) fn dense_i64(values: &[i64], dtype: DType) -> Literal {
        Literal {
            dtype,
            values: LiteralValues::Ints(values.to_vec()),
        }
    }

    /// A hashable identity for splat deduplication.
    pub(crate) fn key(&self) -> String {
        match &self.values {
            LiteralValues::Splat(v) => format_element(*v, self.dtype),
            _ => format!("{:?}", self.values),
        }
    }

    fn len(&self) -> Option<usize> {
        match &self.values {
            LiteralValues::Splat(_) => None,
            LiteralValues::Floats(v) => Some(v.len()),
            LiteralValues::Ints(v) => Some(v.len()),
        }
    }

    /// `dense<...>` with nested brackets following `dims`.
    fn mlir(&self, dims: &[i64]) -> String {
        let elems: Vec<String> = match &self.values {
            LiteralValues::Splat(v) => return format!("dense<{}>", format_element(*v, self.dtype)),
            LiteralValues::Floats(v) => v.iter().map(|x| format_element(*x, self.dtype)).collect(),
            LiteralValues::Ints(v) => v.iter().map(|x| format_element(*x as f64, self.dtype)).collect(),
        };
        fn nest(elems: &[String], dims: &[i64], out: &mut String) {
            if dims.is_empty() {
                out.push_str(&elems[0]);
                return;
            }
            out.push('[');
            let inner: i64 = dims[1..].iter().product();
            for i in 0..dims[0] as usize {
                if i > 0 {
                    out.push_str(", ");
                }
                let lo = i * inner as usize;
                nest(&elems[lo..lo + inner as usize], &dims[1..], out);
            }
            out.push(']');
        }
        let mut s = String::from("dense<");
        nest(&elems, dims, &mut s);
        s.push('>');
        s
    }
}

/// Formats one element of a constant in MLIR syntax for `dtype`: floats as decimals that
/// round-trip exactly (hex bit patterns for infinities and NaN), integers in decimal, booleans
/// as `true`/`false`.
pub(crate) fn format_element(v: f64, dtype: DType) -> String {
    match dtype {
        DType::Bool => (if v != 0.0 { "true" } else { "false" }).to_string(),
        DType::I64 | DType::I32 | DType::U32 | DType::U8 => format!("{}", v as i64),
        DType::F64 | DType::F32 | DType::BF16 | DType::F16 => {
            if !v.is_finite() {
                return float_hex(v, dtype);
            }
            let s = match dtype {
                DType::F64 => format!("{v:?}"),
                DType::F32 => format!("{:?}", v as f32),
                DType::BF16 => format!("{:?}", half::bf16::from_f64(v).to_f32()),
                _ => format!("{:?}", half::f16::from_f64(v).to_f32()),
            };
            // MLIR float literals need a '.' before any exponent: "1e-7" -> "1.0e-7".
            match s.find('e') {
                Some(i) if !s[..i].contains('.') => format!("{}.0{}", &s[..i], &s[i..]),
                _ => s,
            }
        }
    }
}

fn float_hex(v: f64, dtype: DType) -> String {
    match dtype {
        DType::F64 => format!("0x{:016X}", v.to_bits()),
        DType::F32 => format!("0x{:08X}", (v as f32).to_bits()),
        DType::BF16 => format!("0x{:04X}", half::bf16::from_f64(v).to_bits()),
        _ => format!("0x{:04X}", half::f16::from_f64(v).to_bits()),
    }
}

/// A primitive with its static parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Program argument `index`.
    Parameter {
        index: usize,
    },
    /// A constant tensor.
    Constant {
        literal: Literal,
        dims: Vec<i64>,
    },
    /// `0, 1, 2, ...` along `dim`.
    Iota {
        dtype: DType,
        dims: Vec<i64>,
        dim: usize,
    },
    Unary(UnaryOp),
    Binary(BinaryOp),
    Compare(Comparison),
    /// `select(pred, on_true, on_false)`; `pred` is bool of the same shape, or a scalar.
    Select,
    /// `clamp(min, x, max)`; `min`/`max` are scalars or of `x`'s shape.
    Clamp,
    /// Element type conversion.
    Convert {
        to: DType,
    },
    /// Reinterpret the bits as another type of the same width.
    BitcastConvert {
        to: DType,
    },
    /// Operand dimension `i` becomes result dimension `mapping[i]` (sizes equal or 1).
    BroadcastInDim {
        dims: Vec<i64>,
        mapping: Vec<usize>,
    },
    Reshape {
        dims: Vec<i64>,
    },
    /// Result dimension `i` is operand dimension `perm[i]`.
    Transpose {
        perm: Vec<usize>,
    },
    Slice {
        start: Vec<i64>,
        limit: Vec<i64>,
        stride: Vec<i64>,
    },
    /// Inputs: operand, then one scalar integer start index per dimension.
    DynamicSlice {
        sizes: Vec<i64>,
    },
    /// Inputs: operand, update, then one scalar integer start index per dimension.
    DynamicUpdateSlice,
    Concatenate {
        dim: usize,
    },
    /// Inputs: operand and a scalar padding value. Pads are non-negative.
    Pad {
        low: Vec<i64>,
        high: Vec<i64>,
        interior: Vec<i64>,
    },
    /// Batched matrix product with the given result element type.
    DotGeneral {
        dims: DotDims,
        result: DType,
    },
    Reduce {
        kind: ReduceKind,
        dims: Vec<usize>,
    },
    /// Elements of the operand picked by integer indices along `axes` (strictly increasing).
    /// With one axis the indices' whole shape is the batch (`table.take(ids, 0)`); with k > 1
    /// axes their last dimension (of size k) holds one coordinate per axis. The result has
    /// shape `operand[..axes[0]] ++ batch ++ (the operand's later non-indexed dimensions)`.
    /// Out-of-range coordinates are clamped.
    Take {
        axes: Vec<usize>,
    },
    /// Inputs: operand, indices, updates (shaped as `Take`'s result); adds each update into the
    /// window of the operand its coordinates name. Out-of-range coordinates are dropped.
    ScatterAdd {
        axes: Vec<usize>,
    },
    /// Like `ScatterAdd`, but each update replaces its window (with repeated coordinates, one
    /// of the updates wins). Writing a KV-cache row per slot is a `ScatterSet` over the
    /// (slot, position) axes, in the cache's own layout.
    ScatterSet {
        axes: Vec<usize>,
    },
    /// Inclusive running sum along `dim` (from the end when `reverse`).
    Cumsum {
        dim: usize,
        reverse: bool,
    },
    /// Sort along the last dimension (stable). Outputs: sorted values and the i32 positions
    /// they came from.
    Sort {
        descending: bool,
    },
    /// A grouped matrix product over the rows of `lhs` `[M, K]`, taken as consecutive groups
    /// of `group_sizes[g]` rows (inputs: lhs, rhs, group sizes `[G]` i32). `per_group: false`:
    /// rhs `[G, K, N]` holds a matrix per group and row m is multiplied by its group's, result
    /// `[M, N]`. `per_group: true`: rhs `[M, N]`, and the result `[G, K, N]` sums
    /// `lhs[m]ᵀ rhs[m]` over each group's rows (the first form's gradient with respect to its
    /// matrices). Rows past the groups' total count in no group. `native`: lowered to XLA's
    /// `ragged-dot` (`chlo.ragged_dot`, which TPU and GPU compile as a grouped product and
    /// XLA:CPU refuses); else to a dense product over a `[G, M, K]` mask of the groups' rows
    /// (G times the FLOPs, what JAX lowers on the CPU).
    RaggedDot {
        per_group: bool,
        native: bool,
        result: DType,
    },
    /// Identity in the forward pass; no gradient flows through it.
    StopGradient,
    /// Identity that XLA may not move computation across.
    OptimizationBarrier,
    /// Identity that pins its operand's layout over the mesh.
    ShardingConstraint(Sharding),
    /// A loop over stacked values ([`crate::graph::Graph::scan`]); its body is recorded in the
    /// graph before it, described by [`ScanBody`].
    Scan(Box<ScanBody>),
    /// Argument `index` of a scan body (carry values, then the current slices).
    LoopArg {
        index: usize,
    },
    /// Placeholder result of a failed op (never emitted: the graph is in error).
    Poison,
}

/// What an [`Op::Scan`] node loops over. Its operands are the initial carry, the stacked
/// inputs and the captures, in that order; its results the final carry, the stacked outputs
/// and the stacked carry each iteration started from (read by the reverse-mode rule).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScanBody {
    /// The body's nodes: first `carry + inputs` [`Op::LoopArg`]s, then what the body traced.
    pub(crate) nodes: Range<usize>,
    /// Number of carried values.
    pub(crate) carry: usize,
    /// Number of stacked inputs (sliced along their leading axis, one slice per iteration).
    pub(crate) inputs: usize,
    /// The body's results: the next carry, then each iteration's outputs.
    pub(crate) results: Vec<ValueRef>,
    /// Values from before the body that it reads (bound to the trailing operands).
    pub(crate) captures: Vec<ValueRef>,
    /// Number of iterations (the stacked inputs' leading dimension).
    pub(crate) length: i64,
    /// Iterate from the last slice to the first.
    pub(crate) reverse: bool,
    /// The node's result types.
    pub(crate) outputs: Vec<TensorType>,
}

fn same_shape(a: &TensorType, b: &TensorType) -> bool {
    a.dims == b.dims
}

fn check_dims_in_range(dims: &[usize], rank: usize, what: &str) -> Result<(), String> {
    let mut seen = vec![false; rank];
    for &d in dims {
        if d >= rank {
            return Err(format!("{what} dimension {d} is out of range for rank {rank}"));
        }
        if seen[d] {
            return Err(format!("{what} dimension {d} is listed twice"));
        }
        seen[d] = true;
    }
    Ok(())
}

fn is_scalar_int(t: &TensorType) -> bool {
    t.dims.is_empty() && t.dtype.is_integer()
}

fn list(v: &[impl ToString]) -> String {
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

fn i64_array(v: &[i64]) -> String {
    if v.is_empty() {
        "array<i64>".to_string()
    } else {
        format!("array<i64: {}>", list(v))
    }
}

fn fn_type(ins: &[&TensorType], outs: &[TensorType]) -> String {
    let i: Vec<String> = ins.iter().map(|t| t.mlir()).collect();
    let o: Vec<String> = outs.iter().map(|t| t.mlir()).collect();
    if o.len() == 1 {
        format!("({}) -> {}", i.join(", "), o[0])
    } else {
        format!("({}) -> ({})", i.join(", "), o.join(", "))
    }
}

/// A scalar reduction region (`^bb0(a, b): return a <op> b`), with value names made unique by
/// `prefix`.
fn region(prefix: &str, body_op: &str, dtype: DType) -> String {
    let t = TensorType::new(dtype, &[]).mlir();
    format!(
        "({{\n    ^bb0(%{prefix}_a: {t}, %{prefix}_b: {t}):\n      %{prefix}_r = stablehlo.{body_op} %{prefix}_a, %{prefix}_b : {t}\n      stablehlo.return %{prefix}_r : {t}\n  }})"
    )
}

/// A scatter region that keeps the update (`^bb0(old, new): return new`).
fn replace_region(prefix: &str, dtype: DType) -> String {
    let t = TensorType::new(dtype, &[]).mlir();
    format!(
        "({{\n    ^bb0(%{prefix}_a: {t}, %{prefix}_b: {t}):\n      stablehlo.return %{prefix}_b : {t}\n  }})"
    )
}

fn reduce_init(kind: ReduceKind, dtype: DType) -> f64 {
    match (kind, dtype.is_float()) {
        (ReduceKind::Sum, _) => 0.0,
        (ReduceKind::Max, true) => f64::NEG_INFINITY,
        (ReduceKind::Min, true) => f64::INFINITY,
        (ReduceKind::Max, false) => match dtype {
            DType::I64 => i64::MIN as f64,
            DType::I32 => i32::MIN as f64,
            _ => 0.0,
        },
        (ReduceKind::Min, false) => match dtype {
            DType::I64 => i64::MAX as f64,
            DType::I32 => i32::MAX as f64,
            DType::U32 => u32::MAX as f64,
            DType::U8 => u8::MAX as f64,
            _ => 1.0,
        },
    }
}

/// How a `Take` or scatter indexes: the batch shape of its indices, the operand dimensions
/// its result keeps (window dimensions) and where they sit in the result, and the index
/// vector dimension StableHLO is told about.
struct Indexing {
    batch: Vec<i64>,
    /// Kept dimensions before the batch (those before the first indexed axis).
    before: usize,
    kept: Vec<usize>,
    offset: Vec<usize>,
    index_vector_dim: usize,
}

impl Indexing {
    /// Checks `axes` against the operand and indices and lays out the result.
    fn new(operand: &TensorType, indices: &TensorType, axes: &[usize]) -> Result<Self, String> {
        let rank = operand.rank();
        if axes.is_empty() || axes.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!("axes {axes:?} must be non-empty and strictly increasing"));
        }
        if let Some(&a) = axes.iter().find(|&&a| a >= rank) {
            return Err(format!("axis {a} is out of range for rank {rank}"));
        }
        if !indices.dtype.is_integer() {
            return Err(format!("indices must be integers, not {}", indices.dtype));
        }
        let (batch, index_vector_dim) = if axes.len() == 1 {
            (indices.dims.clone(), indices.rank())
        } else {
            match indices.dims.split_last() {
                Some((&k, batch)) if k == axes.len() as i64 => (batch.to_vec(), indices.rank() - 1),
                _ => {
                    return Err(format!(
                        "indices for {} axes need a last dimension of size {}, not {:?}",
                        axes.len(),
                        axes.len(),
                        indices.dims
                    ))
                }
            }
        };
        let kept: Vec<usize> = (0..rank).filter(|d| !axes.contains(d)).collect();
        let before = axes[0];
        let offset = (0..kept.len())
            .map(|i| if i < before { i } else { i + batch.len() })
            .collect();
        Ok(Self {
            batch,
            before,
            kept,
            offset,
            index_vector_dim,
        })
    }

    fn result_dims(&self, operand: &[i64]) -> Vec<i64> {
        let mut dims: Vec<i64> = self.kept.iter().map(|&d| operand[d]).collect();
        dims.splice(self.before..self.before, self.batch.iter().copied());
        dims
    }
}

impl Op {
    /// A short name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Parameter { .. } => "parameter",
            Op::Constant { .. } => "constant",
            Op::Iota { .. } => "iota",
            Op::Unary(u) => match u {
                UnaryOp::Neg => "neg",
                UnaryOp::Exp => "exp",
                UnaryOp::Log => "log",
                UnaryOp::Log1p => "log1p",
                UnaryOp::Tanh => "tanh",
                UnaryOp::Logistic => "logistic",
                UnaryOp::Sqrt => "sqrt",
                UnaryOp::Rsqrt => "rsqrt",
                UnaryOp::Abs => "abs",
                UnaryOp::Sign => "sign",
                UnaryOp::Sin => "sin",
                UnaryOp::Cos => "cos",
                UnaryOp::Floor => "floor",
                UnaryOp::IsFinite => "is_finite",
                UnaryOp::Not => "not",
            },
            Op::Binary(b) => match b {
                BinaryOp::Add => "add",
                BinaryOp::Sub => "sub",
                BinaryOp::Mul => "mul",
                BinaryOp::Div => "div",
                BinaryOp::Pow => "pow",
                BinaryOp::Max => "max",
                BinaryOp::Min => "min",
                BinaryOp::Rem => "rem",
                BinaryOp::And => "and",
                BinaryOp::Or => "or",
                BinaryOp::Xor => "xor",
                BinaryOp::ShiftLeft => "shift_left",
                BinaryOp::ShiftRightLogical => "shift_right_logical",
            },
            Op::Compare(_) => "compare",
            Op::Select => "select",
            Op::Clamp => "clamp",
            Op::Convert { .. } => "convert",
            Op::BitcastConvert { .. } => "bitcast_convert",
            Op::BroadcastInDim { .. } => "broadcast_in_dim",
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Slice { .. } => "slice",
            Op::DynamicSlice { .. } => "dynamic_slice",
            Op::DynamicUpdateSlice => "dynamic_update_slice",
            Op::Concatenate { .. } => "concatenate",
            Op::Pad { .. } => "pad",
            Op::DotGeneral { .. } => "dot_general",
            Op::Reduce {
                kind: ReduceKind::Sum,
                ..
            } => "reduce_sum",
            Op::Reduce {
                kind: ReduceKind::Max,
                ..
            } => "reduce_max",
            Op::Reduce {
                kind: ReduceKind::Min,
                ..
            } => "reduce_min",
            Op::Take { .. } => "take",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::ScatterSet { .. } => "scatter",
            Op::Cumsum { .. } => "cumsum",
            Op::Sort { .. } => "sort",
            Op::RaggedDot { .. } => "ragged_dot",
            Op::StopGradient => "stop_gradient",
            Op::OptimizationBarrier => "optimization_barrier",
            Op::ShardingConstraint(_) => "sharding_constraint",
            Op::Scan(_) => "scan",
            Op::LoopArg { .. } => "loop_arg",
            Op::Poison => "poison",
        }
    }

    /// Number of results (the optimization barrier has as many as operands; it is built
    /// directly, not through this count).
    pub(crate) fn num_outputs(&self) -> usize {
        match self {
            Op::Sort { .. } => 2,
            Op::Scan(body) => body.outputs.len(),
            _ => 1,
        }
    }

    /// A result type to use for the placeholder when the op fails, where the op fixes it.
    pub(crate) fn fallback_type(&self) -> Option<TensorType> {
        match self {
            Op::Constant { literal, dims } => Some(TensorType::new(literal.dtype, dims)),
            Op::Iota { dtype, dims, .. } => Some(TensorType::new(*dtype, dims)),
            Op::Reshape { dims } | Op::BroadcastInDim { dims, .. } => Some(TensorType::new(DType::F32, dims)),
            _ => None,
        }
    }

    /// The shape and dtype rule: result types from operand types, or a message saying what is
    /// wrong (the caller adds the op name, the operand shapes and the source location).
    pub(crate) fn infer(&self, ins: &[&TensorType]) -> Result<Vec<TensorType>, String> {
        let arity = |n: usize| -> Result<(), String> {
            if ins.len() != n {
                Err(format!("expects {n} operands, got {}", ins.len()))
            } else {
                Ok(())
            }
        };
        let one = |t: TensorType| Ok(vec![t]);
        match self {
            Op::Parameter { .. } | Op::LoopArg { .. } | Op::Poison => {
                Err("is not built through infer".to_string())
            }
            Op::Scan(body) => {
                let n = body.carry + body.inputs + body.captures.len();
                arity(n)?;
                let carry_ok = ins[..body.carry].iter().zip(&body.outputs).all(|(a, b)| *a == b);
                let inputs_ok = ins[body.carry..body.carry + body.inputs]
                    .iter()
                    .all(|t| t.dims.first() == Some(&body.length));
                if !carry_ok || !inputs_ok {
                    return Err("operands do not match the traced body".to_string());
                }
                Ok(body.outputs.clone())
            }
            Op::Constant { literal, dims } => {
                arity(0)?;
                if let Some(d) = dims.iter().find(|d| **d < 0) {
                    return Err(format!("negative dimension {d} in {dims:?}"));
                }
                let n: i64 = dims.iter().product();
                if let Some(len) = literal.len() {
                    if len as i64 != n {
                        return Err(format!("{len} values given for shape {dims:?} ({n} elements)"));
                    }
                }
                one(TensorType::new(literal.dtype, dims))
            }
            Op::Iota { dtype, dims, dim } => {
                arity(0)?;
                if *dim >= dims.len() {
                    return Err(format!("iota dimension {dim} is out of range for shape {dims:?}"));
                }
                if *dtype == DType::Bool {
                    return Err("iota of bool is not defined".to_string());
                }
                one(TensorType::new(*dtype, dims))
            }
            Op::Unary(u) => {
                arity(1)?;
                let t = ins[0];
                let ok = match u {
                    UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign => {
                        t.dtype.is_float() || t.dtype.is_signed_integer()
                    }
                    UnaryOp::Not => t.dtype == DType::Bool || t.dtype.is_integer(),
                    _ => t.dtype.is_float(),
                };
                if !ok {
                    return Err(format!("is not defined for element type {}", t.dtype));
                }
                let dtype = if *u == UnaryOp::IsFinite {
                    DType::Bool
                } else {
                    t.dtype
                };
                one(TensorType::new(dtype, &t.dims))
            }
            Op::Binary(b) => {
                arity(2)?;
                let (x, y) = (ins[0], ins[1]);
                if x.dtype != y.dtype {
                    return Err(format!(
                        "element types differ ({} vs {}); convert one first",
                        x.dtype, y.dtype
                    ));
                }
                if !same_shape(x, y) {
                    return Err(format!("shapes differ ({:?} vs {:?})", x.dims, y.dims));
                }
                let d = x.dtype;
                let ok = match b {
                    BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div | BinaryOp::Rem => {
                        d != DType::Bool
                    }
                    BinaryOp::Max | BinaryOp::Min => true,
                    BinaryOp::Pow => d.is_float(),
                    BinaryOp::And | BinaryOp::Or | BinaryOp::Xor => d == DType::Bool || d.is_integer(),
                    BinaryOp::ShiftLeft | BinaryOp::ShiftRightLogical => d.is_integer(),
                };
                if !ok {
                    return Err(format!("is not defined for element type {d}"));
                }
                one(x.clone())
            }
            Op::Compare(_) => {
                arity(2)?;
                if ins[0] != ins[1] {
                    return Err("operands must have the same type and shape".to_string());
                }
                one(TensorType::new(DType::Bool, &ins[0].dims))
            }
            Op::Select => {
                arity(3)?;
                let (p, a, b) = (ins[0], ins[1], ins[2]);
                if p.dtype != DType::Bool {
                    return Err(format!("predicate must be bool, not {}", p.dtype));
                }
                if a != b {
                    return Err("both branches must have the same type and shape".to_string());
                }
                if !p.dims.is_empty() && p.dims != a.dims {
                    return Err("predicate must be a scalar or have the branches' shape".to_string());
                }
                one(a.clone())
            }
            Op::Clamp => {
                arity(3)?;
                let (lo, x, hi) = (ins[0], ins[1], ins[2]);
                for (what, b) in [("min", lo), ("max", hi)] {
                    if b.dtype != x.dtype {
                        return Err(format!(
                            "{what} has element type {}, operand {}",
                            b.dtype, x.dtype
                        ));
                    }
                    if !b.dims.is_empty() && b.dims != x.dims {
                        return Err(format!("{what} must be a scalar or have the operand's shape"));
                    }
                }
                one(x.clone())
            }
            Op::Convert { to } => {
                arity(1)?;
                one(TensorType::new(*to, &ins[0].dims))
            }
            Op::BitcastConvert { to } => {
                arity(1)?;
                if to.size_bytes() != ins[0].dtype.size_bytes()
                    || *to == DType::Bool
                    || ins[0].dtype == DType::Bool
                {
                    return Err(format!(
                        "cannot reinterpret {} as {} (widths differ)",
                        ins[0].dtype, to
                    ));
                }
                one(TensorType::new(*to, &ins[0].dims))
            }
            Op::BroadcastInDim { dims, mapping } => {
                arity(1)?;
                let x = ins[0];
                if mapping.len() != x.rank() {
                    return Err(format!(
                        "mapping {mapping:?} has {} entries for rank {}",
                        mapping.len(),
                        x.rank()
                    ));
                }
                for (i, &m) in mapping.iter().enumerate() {
                    if m >= dims.len() {
                        return Err(format!(
                            "mapping {mapping:?} names dimension {m} of result shape {dims:?}"
                        ));
                    }
                    if i > 0 && mapping[i - 1] >= m {
                        return Err(format!("mapping {mapping:?} must be strictly increasing"));
                    }
                    if x.dims[i] != 1 && x.dims[i] != dims[m] {
                        return Err(format!(
                            "operand dimension {i} of size {} cannot broadcast to size {} (result shape {dims:?})",
                            x.dims[i], dims[m]
                        ));
                    }
                }
                one(TensorType::new(x.dtype, dims))
            }
            Op::Reshape { dims } => {
                arity(1)?;
                let n: i64 = dims.iter().product();
                if dims.iter().any(|d| *d < 0) || n != ins[0].num_elements() {
                    return Err(format!(
                        "cannot reshape {} elements into {dims:?} ({n} elements)",
                        ins[0].num_elements()
                    ));
                }
                one(TensorType::new(ins[0].dtype, dims))
            }
            Op::Transpose { perm } => {
                arity(1)?;
                let r = ins[0].rank();
                if perm.len() != r {
                    return Err(format!(
                        "permutation {perm:?} has {} entries for rank {r}",
                        perm.len()
                    ));
                }
                check_dims_in_range(perm, r, "permutation")?;
                one(TensorType::new(
                    ins[0].dtype,
                    &perm.iter().map(|&p| ins[0].dims[p]).collect::<Vec<_>>(),
                ))
            }
            Op::Slice { start, limit, stride } => {
                arity(1)?;
                let x = ins[0];
                if start.len() != x.rank() || limit.len() != x.rank() || stride.len() != x.rank() {
                    return Err(format!("start/limit/stride need {} entries each", x.rank()));
                }
                let mut out = Vec::new();
                for d in 0..x.rank() {
                    if start[d] < 0 || start[d] > limit[d] || limit[d] > x.dims[d] || stride[d] < 1 {
                        return Err(format!(
                            "dimension {d}: range {}..{} step {} does not fit size {}",
                            start[d], limit[d], stride[d], x.dims[d]
                        ));
                    }
                    out.push((limit[d] - start[d] + stride[d] - 1) / stride[d]);
                }
                one(TensorType::new(x.dtype, &out))
            }
            Op::DynamicSlice { sizes } => {
                let x = ins.first().ok_or("expects an operand")?;
                if ins.len() != 1 + x.rank() || sizes.len() != x.rank() {
                    return Err(format!("needs {} start indices and sizes", x.rank()));
                }
                if !ins[1..]
                    .iter()
                    .all(|t| is_scalar_int(t) && t.dtype == ins[1].dtype)
                {
                    return Err("start indices must be integer scalars of one type".to_string());
                }
                for (d, (&s, &n)) in sizes.iter().zip(&x.dims).enumerate() {
                    if s < 0 || s > n {
                        return Err(format!("size {s} of dimension {d} exceeds {n}"));
                    }
                }
                one(TensorType::new(x.dtype, sizes))
            }
            Op::DynamicUpdateSlice => {
                if ins.len() < 2 {
                    return Err("expects an operand and an update".to_string());
                }
                let (x, u) = (ins[0], ins[1]);
                if ins.len() != 2 + x.rank() {
                    return Err(format!("needs {} start indices", x.rank()));
                }
                if u.dtype != x.dtype
                    || u.rank() != x.rank()
                    || u.dims.iter().zip(&x.dims).any(|(a, b)| a > b)
                {
                    return Err("the update must have the operand's type and fit inside it".to_string());
                }
                if !ins[2..]
                    .iter()
                    .all(|t| is_scalar_int(t) && t.dtype == ins[2].dtype)
                {
                    return Err("start indices must be integer scalars of one type".to_string());
                }
                one(x.clone())
            }
            Op::Concatenate { dim } => {
                let x = ins.first().ok_or("needs at least one operand")?;
                if *dim >= x.rank() {
                    return Err(format!("dimension {dim} is out of range for rank {}", x.rank()));
                }
                let mut out = x.dims.clone();
                out[*dim] = 0;
                for t in ins {
                    if t.dtype != x.dtype || t.rank() != x.rank() {
                        return Err("operands must have one element type and rank".to_string());
                    }
                    for d in 0..x.rank() {
                        if d != *dim && t.dims[d] != x.dims[d] {
                            return Err(format!("operands differ in dimension {d}"));
                        }
                    }
                    out[*dim] += t.dims[*dim];
                }
                one(TensorType::new(x.dtype, &out))
            }
            Op::Pad { low, high, interior } => {
                arity(2)?;
                let (x, v) = (ins[0], ins[1]);
                if v.dtype != x.dtype || !v.dims.is_empty() {
                    return Err("the padding value must be a scalar of the operand's type".to_string());
                }
                if low.len() != x.rank() || high.len() != x.rank() || interior.len() != x.rank() {
                    return Err(format!("low/high/interior need {} entries each", x.rank()));
                }
                if low.iter().chain(high).chain(interior).any(|p| *p < 0) {
                    return Err("pads must be non-negative".to_string());
                }
                let out: Vec<i64> = (0..x.rank())
                    .map(|d| low[d] + high[d] + x.dims[d] + (x.dims[d] - 1).max(0) * interior[d])
                    .collect();
                one(TensorType::new(x.dtype, &out))
            }
            Op::DotGeneral { dims, result } => {
                arity(2)?;
                let (l, r) = (ins[0], ins[1]);
                if l.dtype != r.dtype {
                    return Err(format!(
                        "operand element types differ ({} vs {})",
                        l.dtype, r.dtype
                    ));
                }
                if l.dtype.is_float() != result.is_float() || l.dtype == DType::Bool {
                    return Err(format!("cannot produce {result} from {} operands", l.dtype));
                }
                if dims.lhs_batch.len() != dims.rhs_batch.len()
                    || dims.lhs_contract.len() != dims.rhs_contract.len()
                {
                    return Err("batch and contracting dimension lists must pair up".to_string());
                }
                let lall: Vec<usize> = dims.lhs_batch.iter().chain(&dims.lhs_contract).copied().collect();
                let rall: Vec<usize> = dims.rhs_batch.iter().chain(&dims.rhs_contract).copied().collect();
                check_dims_in_range(&lall, l.rank(), "lhs")?;
                check_dims_in_range(&rall, r.rank(), "rhs")?;
                for (a, b) in dims
                    .lhs_batch
                    .iter()
                    .zip(&dims.rhs_batch)
                    .chain(dims.lhs_contract.iter().zip(&dims.rhs_contract))
                {
                    if l.dims[*a] != r.dims[*b] {
                        return Err(format!(
                            "lhs dimension {a} (size {}) does not match rhs dimension {b} (size {})",
                            l.dims[*a], r.dims[*b]
                        ));
                    }
                }
                let mut out: Vec<i64> = dims.lhs_batch.iter().map(|&d| l.dims[d]).collect();
                out.extend(
                    DotDims::free(l.rank(), &dims.lhs_batch, &dims.lhs_contract)
                        .iter()
                        .map(|&d| l.dims[d]),
                );
                out.extend(
                    DotDims::free(r.rank(), &dims.rhs_batch, &dims.rhs_contract)
                        .iter()
                        .map(|&d| r.dims[d]),
                );
                one(TensorType::new(*result, &out))
            }
            Op::Reduce { kind, dims } => {
                arity(1)?;
                let x = ins[0];
                check_dims_in_range(dims, x.rank(), "reduced")?;
                if x.dtype == DType::Bool {
                    return Err(format!("{kind:?} of bool is not defined; convert first"));
                }
                let out: Vec<i64> = (0..x.rank())
                    .filter(|d| !dims.contains(d))
                    .map(|d| x.dims[d])
                    .collect();
                one(TensorType::new(x.dtype, &out))
            }
            Op::Take { axes } => {
                arity(2)?;
                let (x, idx) = (ins[0], ins[1]);
                let at = Indexing::new(x, idx, axes)?;
                one(TensorType::new(x.dtype, &at.result_dims(&x.dims)))
            }
            Op::ScatterAdd { axes } | Op::ScatterSet { axes } => {
                arity(3)?;
                let (x, idx, u) = (ins[0], ins[1], ins[2]);
                let want = Indexing::new(x, idx, axes)?.result_dims(&x.dims);
                if u.dtype != x.dtype || u.dims != want {
                    return Err(format!("updates must be {} {want:?}", x.dtype));
                }
                if x.dtype == DType::Bool && matches!(self, Op::ScatterAdd { .. }) {
                    return Err("scatter-add of bool is not defined".to_string());
                }
                one(x.clone())
            }
            Op::Cumsum { dim, .. } => {
                arity(1)?;
                if *dim >= ins[0].rank() || ins[0].dtype == DType::Bool {
                    return Err(format!("dimension {dim} out of range, or bool operand"));
                }
                one(ins[0].clone())
            }
            Op::RaggedDot {
                per_group, result, ..
            } => {
                arity(3)?;
                let (l, r, gs) = (ins[0], ins[1], ins[2]);
                if l.dtype != r.dtype || !l.dtype.is_float() || !result.is_float() {
                    return Err(format!(
                        "needs float operands of one element type and a float result, got {} and {} to {result}",
                        l.dtype, r.dtype
                    ));
                }
                if gs.rank() != 1 || gs.dtype != DType::I32 {
                    return Err(format!("group sizes must be i32 [G], got {gs}"));
                }
                if l.rank() != 2 {
                    return Err(format!("lhs must be [M, K], got {l}"));
                }
                let (m, k, g) = (l.dims[0], l.dims[1], gs.dims[0]);
                if *per_group {
                    if r.rank() != 2 || r.dims[0] != m {
                        return Err(format!("rhs must be [M = {m}, N], got {r}"));
                    }
                    one(TensorType::new(*result, &[g, k, r.dims[1]]))
                } else {
                    if r.rank() != 3 || r.dims[0] != g || r.dims[1] != k {
                        return Err(format!("rhs must be [G = {g}, K = {k}, N], got {r}"));
                    }
                    one(TensorType::new(*result, &[m, r.dims[2]]))
                }
            }
            Op::Sort { .. } => {
                arity(1)?;
                let x = ins[0];
                if x.rank() == 0 || x.dtype == DType::Bool {
                    return Err("needs a numeric operand of rank >= 1".to_string());
                }
                Ok(vec![x.clone(), TensorType::new(DType::I32, &x.dims)])
            }
            Op::StopGradient => {
                arity(1)?;
                one(ins[0].clone())
            }
            Op::OptimizationBarrier => Ok(ins.iter().map(|t| (*t).clone()).collect()),
            Op::ShardingConstraint(s) => {
                arity(1)?;
                if s.rank() != ins[0].rank() {
                    return Err(format!(
                        "sharding of rank {} for a rank-{} tensor",
                        s.rank(),
                        ins[0].rank()
                    ));
                }
                one(ins[0].clone())
            }
        }
    }

    /// The StableHLO text for one node: `out` is the result name (`%v7`, or `%v7:2` for two
    /// results), `ins` the operand names. Temporary values are named `<out>_<suffix>`.
    pub(crate) fn lower(
        &self,
        out: &str,
        ins: &[String],
        in_tys: &[&TensorType],
        out_tys: &[TensorType],
    ) -> String {
        let o = &out_tys[0];
        let base = out
            .trim_start_matches('%')
            .split(':')
            .next()
            .unwrap_or("t")
            .to_string();
        let generic = |name: &str, props: &str| {
            let props = if props.is_empty() {
                String::new()
            } else {
                format!(" <{{{props}}}>")
            };
            format!(
                "{out} = \"stablehlo.{name}\"({}){props} : {}",
                ins.join(", "),
                fn_type(in_tys, out_tys)
            )
        };
        match self {
            Op::Parameter { .. } | Op::Poison | Op::StopGradient | Op::LoopArg { .. } => String::new(),
            // Emitted with its body as a `stablehlo.while` by `emit.rs`.
            Op::Scan(_) => String::new(),
            Op::Constant { literal, dims } => {
                format!("{out} = stablehlo.constant {} : {}", literal.mlir(dims), o.mlir())
            }
            Op::Iota { dim, .. } => format!("{out} = stablehlo.iota dim = {dim} : {}", o.mlir()),
            Op::Unary(UnaryOp::IsFinite) => generic("is_finite", ""),
            Op::Unary(u) => format!("{out} = stablehlo.{} {} : {}", u.mlir_name(), ins[0], o.mlir()),
            Op::Binary(b) => format!(
                "{out} = stablehlo.{} {}, {} : {}",
                b.mlir_name(),
                ins[0],
                ins[1],
                o.mlir()
            ),
            Op::Compare(c) => {
                let ty = match in_tys[0].dtype {
                    d if d.is_float() => "FLOAT",
                    d if d.is_signed_integer() => "SIGNED",
                    _ => "UNSIGNED",
                };
                format!(
                    "{out} = stablehlo.compare {}, {}, {}, {ty} : {}",
                    c.mlir(),
                    ins[0],
                    ins[1],
                    fn_type(in_tys, out_tys)
                )
            }
            Op::Select => generic("select", ""),
            Op::Clamp => generic("clamp", ""),
            Op::Convert { .. } => format!(
                "{out} = stablehlo.convert {} : {}",
                ins[0],
                fn_type(in_tys, out_tys)
            ),
            Op::BitcastConvert { .. } => {
                format!(
                    "{out} = stablehlo.bitcast_convert {} : {}",
                    ins[0],
                    fn_type(in_tys, out_tys)
                )
            }
            Op::BroadcastInDim { mapping, .. } => format!(
                "{out} = stablehlo.broadcast_in_dim {}, dims = [{}] : {}",
                ins[0],
                list(mapping),
                fn_type(in_tys, out_tys)
            ),
            Op::Reshape { .. } => format!(
                "{out} = stablehlo.reshape {} : {}",
                ins[0],
                fn_type(in_tys, out_tys)
            ),
            Op::Transpose { perm } => format!(
                "{out} = stablehlo.transpose {}, dims = [{}] : {}",
                ins[0],
                list(perm),
                fn_type(in_tys, out_tys)
            ),
            Op::Slice { start, limit, stride } => generic(
                "slice",
                &format!(
                    "start_indices = {}, limit_indices = {}, strides = {}",
                    i64_array(start),
                    i64_array(limit),
                    i64_array(stride)
                ),
            ),
            Op::DynamicSlice { sizes } => {
                generic("dynamic_slice", &format!("slice_sizes = {}", i64_array(sizes)))
            }
            Op::DynamicUpdateSlice => generic("dynamic_update_slice", ""),
            Op::Concatenate { dim } => generic("concatenate", &format!("dimension = {dim} : i64")),
            Op::Pad { low, high, interior } => generic(
                "pad",
                &format!(
                    "edge_padding_low = {}, edge_padding_high = {}, interior_padding = {}",
                    i64_array(low),
                    i64_array(high),
                    i64_array(interior)
                ),
            ),
            Op::DotGeneral { dims, .. } => {
                let mut s = format!("{out} = stablehlo.dot_general {}, {}, ", ins[0], ins[1]);
                if !dims.lhs_batch.is_empty() {
                    let _ = write!(
                        s,
                        "batching_dims = [{}] x [{}], ",
                        list(&dims.lhs_batch),
                        list(&dims.rhs_batch)
                    );
                }
                let _ = write!(
                    s,
                    "contracting_dims = [{}] x [{}], ",
                    list(&dims.lhs_contract),
                    list(&dims.rhs_contract),
                );
                // f32 means f32 on every device: with DEFAULT precision the CUDA plugin rounds
                // f32 operands to TF32 and a TPU to one bf16 pass (the CPU computes f32 either
                // way). Narrower operands keep DEFAULT.
                let wide = in_tys.iter().all(|t| matches!(t.dtype, DType::F32 | DType::F64));
                let precision = if wide { "HIGHEST" } else { "DEFAULT" };
                let _ = write!(
                    s,
                    "precision = [{precision}, {precision}] : {}",
                    fn_type(in_tys, out_tys)
                );
                s
            }
            Op::Reduce { kind, dims } => {
                let dt = in_tys[0].dtype;
                let scalar = TensorType::new(dt, &[]);
                let body = match kind {
                    ReduceKind::Sum => "add",
                    ReduceKind::Max => "maximum",
                    ReduceKind::Min => "minimum",
                };
                format!(
                    "%{base}_init = stablehlo.constant dense<{}> : {}\n  {out} = stablehlo.reduce({} init: %{base}_init) applies stablehlo.{body} across dimensions = [{}] : ({}, {}) -> {}",
                    format_element(reduce_init(*kind, dt), dt),
                    scalar.mlir(),
                    ins[0],
                    list(dims),
                    in_tys[0].mlir(),
                    scalar.mlir(),
                    o.mlir()
                )
            }
            Op::Take { axes } => {
                let (x, idx) = (in_tys[0], in_tys[1]);
                let at = Indexing::new(x, idx, axes).expect("checked by infer");
                let mut sizes = x.dims.clone();
                for &a in axes {
                    sizes[a] = 1;
                }
                let offset_txt = if at.offset.is_empty() {
                    String::new()
                } else {
                    format!("offset_dims = [{}], ", list(&at.offset))
                };
                generic(
                    "gather",
                    &format!(
                        "dimension_numbers = #stablehlo.gather<{offset_txt}collapsed_slice_dims = [{}], start_index_map = [{}], index_vector_dim = {}>, indices_are_sorted = false, slice_sizes = {}",
                        list(axes),
                        list(axes),
                        at.index_vector_dim,
                        i64_array(&sizes)
                    ),
                )
            }
            Op::ScatterAdd { axes } | Op::ScatterSet { axes } => {
                let (x, idx) = (in_tys[0], in_tys[1]);
                let at = Indexing::new(x, idx, axes).expect("checked by infer");
                let window_txt = if at.offset.is_empty() {
                    String::new()
                } else {
                    format!("update_window_dims = [{}], ", list(&at.offset))
                };
                format!(
                    "{out} = \"stablehlo.scatter\"({}) <{{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<{window_txt}inserted_window_dims = [{}], scatter_dims_to_operand_dims = [{}], index_vector_dim = {}>, unique_indices = false}}> {} : {}",
                    ins.join(", "),
                    list(axes),
                    list(axes),
                    at.index_vector_dim,
                    if matches!(self, Op::ScatterSet { .. }) {
                        replace_region(&base, x.dtype)
                    } else {
                        region(&base, "add", x.dtype)
                    },
                    fn_type(in_tys, out_tys)
                )
            }
            Op::Cumsum { dim, reverse } => {
                let x = in_tys[0];
                let n = x.dims[*dim];
                let r = x.rank();
                let mut window = vec![1i64; r];
                window[*dim] = n.max(1);
                let pads: Vec<String> = (0..r)
                    .map(|d| {
                        if d != *dim {
                            "[0, 0]".to_string()
                        } else if *reverse {
                            format!("[0, {}]", (n - 1).max(0))
                        } else {
                            format!("[{}, 0]", (n - 1).max(0))
                        }
                    })
                    .collect();
                let scalar = TensorType::new(x.dtype, &[]);
                format!(
                    "%{base}_init = stablehlo.constant dense<{}> : {}\n  {out} = \"stablehlo.reduce_window\"({}, %{base}_init) <{{padding = dense<[{}]> : tensor<{r}x2xi64>, window_dimensions = {}, window_strides = {}}}> {} : ({}, {}) -> {}",
                    format_element(0.0, x.dtype),
                    scalar.mlir(),
                    ins[0],
                    pads.join(", "),
                    i64_array(&window),
                    i64_array(&vec![1; r]),
                    region(&base, "add", x.dtype),
                    x.mlir(),
                    scalar.mlir(),
                    o.mlir()
                )
            }
            Op::RaggedDot {
                per_group, native, ..
            } => {
                let wide = in_tys[..2]
                    .iter()
                    .all(|t| matches!(t.dtype, DType::F32 | DType::F64));
                let precision = if wide { "HIGHEST" } else { "DEFAULT" };
                if *native {
                    let dims = if *per_group {
                        "lhs_contracting_dimensions = [0], rhs_contracting_dimensions = [0], lhs_ragged_dimensions = [0]"
                    } else {
                        "lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [1], lhs_ragged_dimensions = [0], rhs_group_dimensions = [0]"
                    };
                    return format!(
                        "{out} = \"chlo.ragged_dot\"({}) <{{precision_config = [#chlo<precision {precision}>, #chlo<precision {precision}>], ragged_dot_dimension_numbers = #chlo.ragged_dot<{dims}>}}> : {}",
                        ins.join(", "),
                        fn_type(in_tys, out_tys)
                    );
                }
                // Each group's rows picked out of lhs by a [G, M] mask (starts <= m < ends, from
                // the sizes' inclusive running sum), one product over the groups.
                let (l, r, gs) = (in_tys[0], in_tys[1], in_tys[2]);
                let (m, k, g) = (l.dims[0], l.dims[1], gs.dims[0]);
                let t = l.dtype;
                let gi = TensorType::new(DType::I32, &[g]).mlir();
                let gmi = TensorType::new(DType::I32, &[g, m]).mlir();
                let gmb = TensorType::new(DType::Bool, &[g, m]).mlir();
                let gmkb = TensorType::new(DType::Bool, &[g, m, k]).mlir();
                let gmk = TensorType::new(t, &[g, m, k]).mlir();
                let i0 = TensorType::new(DType::I32, &[]).mlir();
                let contracting = if *per_group {
                    "[1] x [0]"
                } else {
                    "[0, 2] x [0, 1]"
                };
                [
                    format!("%{base}_zi = stablehlo.constant dense<0> : {i0}"),
                    format!(
                        "%{base}_ends = \"stablehlo.reduce_window\"({}, %{base}_zi) <{{padding = dense<[[{}, 0]]> : tensor<1x2xi64>, window_dimensions = array<i64: {g}>, window_strides = array<i64: 1>}}> {} : ({gi}, {i0}) -> {gi}",
                        ins[2],
                        (g - 1).max(0),
                        region(&format!("{base}_sum"), "add", DType::I32)
                    ),
                    format!("%{base}_starts = stablehlo.subtract %{base}_ends, {} : {gi}", ins[2]),
                    format!("%{base}_e = stablehlo.broadcast_in_dim %{base}_ends, dims = [0] : ({gi}) -> {gmi}"),
                    format!("%{base}_s = stablehlo.broadcast_in_dim %{base}_starts, dims = [0] : ({gi}) -> {gmi}"),
                    format!("%{base}_row = stablehlo.iota dim = 1 : {gmi}"),
                    format!("%{base}_ge = stablehlo.compare GE, %{base}_row, %{base}_s, SIGNED : ({gmi}, {gmi}) -> {gmb}"),
                    format!("%{base}_lt = stablehlo.compare LT, %{base}_row, %{base}_e, SIGNED : ({gmi}, {gmi}) -> {gmb}"),
                    format!("%{base}_in = stablehlo.and %{base}_ge, %{base}_lt : {gmb}"),
                    format!("%{base}_mask = stablehlo.broadcast_in_dim %{base}_in, dims = [0, 1] : ({gmb}) -> {gmkb}"),
                    format!("%{base}_lhs = stablehlo.broadcast_in_dim {}, dims = [1, 2] : ({}) -> {gmk}", ins[0], l.mlir()),
                    format!(
                        "%{base}_z = stablehlo.constant dense<{}> : {}",
                        format_element(0.0, t),
                        TensorType::new(t, &[]).mlir()
                    ),
                    format!("%{base}_zs = stablehlo.broadcast_in_dim %{base}_z, dims = [] : ({}) -> {gmk}", TensorType::new(t, &[]).mlir()),
                    format!("%{base}_picked = stablehlo.select %{base}_mask, %{base}_lhs, %{base}_zs : {gmkb}, {gmk}"),
                    format!(
                        "{out} = stablehlo.dot_general %{base}_picked, {}, contracting_dims = {contracting}, precision = [{precision}, {precision}] : ({gmk}, {}) -> {}",
                        ins[1],
                        r.mlir(),
                        o.mlir()
                    ),
                ]
                .join("\n  ")
            }
            Op::Sort { descending } => {
                let x = in_tys[0];
                let last = x.rank() - 1;
                let it = &out_tys[1];
                let st = TensorType::new(x.dtype, &[]).mlir();
                let si = TensorType::new(DType::I32, &[]).mlir();
                let ty = match x.dtype {
                    d if d.is_float() => "FLOAT",
                    d if d.is_signed_integer() => "SIGNED",
                    _ => "UNSIGNED",
                };
                let dir = if *descending { "GT" } else { "LT" };
                format!(
                    "%{base}_iota = stablehlo.iota dim = {last} : {}\n  {out} = \"stablehlo.sort\"({}, %{base}_iota) <{{dimension = {last} : i64, is_stable = true}}> ({{\n    ^bb0(%{base}_a: {st}, %{base}_b: {st}, %{base}_c: {si}, %{base}_d: {si}):\n      %{base}_p = stablehlo.compare {dir}, %{base}_a, %{base}_b, {ty} : ({st}, {st}) -> tensor<i1>\n      stablehlo.return %{base}_p : tensor<i1>\n  }}) : ({}, {}) -> ({}, {})",
                    it.mlir(),
                    ins[0],
                    x.mlir(),
                    it.mlir(),
                    x.mlir(),
                    it.mlir()
                )
            }
            Op::OptimizationBarrier => generic("optimization_barrier", ""),
            Op::ShardingConstraint(s) => {
                format!(
                    "{out} = sdy.sharding_constraint {} {} : {}",
                    ins[0],
                    s.mlir_body(),
                    o.mlir()
                )
            }
        }
    }

    /// Whether gradients flow through this primitive (to its floating-point operands).
    /// Primitives whose derivative is zero almost everywhere (sign, floor, comparisons) and
    /// integer/bool primitives return false.
    pub fn is_differentiable(&self) -> bool {
        match self {
            Op::Unary(u) => !matches!(
                u,
                UnaryOp::Sign | UnaryOp::Floor | UnaryOp::IsFinite | UnaryOp::Not
            ),
            Op::Binary(b) => matches!(
                b,
                BinaryOp::Add
                    | BinaryOp::Sub
                    | BinaryOp::Mul
                    | BinaryOp::Div
                    | BinaryOp::Pow
                    | BinaryOp::Max
                    | BinaryOp::Min
                    | BinaryOp::Rem
            ),
            Op::Select
            | Op::Clamp
            | Op::Convert { .. }
            | Op::BroadcastInDim { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::DynamicSlice { .. }
            | Op::DynamicUpdateSlice
            | Op::Concatenate { .. }
            | Op::Pad { .. }
            | Op::DotGeneral { .. }
            | Op::Reduce { .. }
            | Op::Take { .. }
            | Op::ScatterAdd { .. }
            | Op::ScatterSet { .. }
            | Op::Cumsum { .. }
            | Op::Sort { .. }
            | Op::RaggedDot { .. }
            | Op::OptimizationBarrier
            | Op::ShardingConstraint(_)
            | Op::Scan(_) => true,
            Op::Parameter { .. }
            | Op::LoopArg { .. }
            | Op::Constant { .. }
            | Op::Iota { .. }
            | Op::Compare(_)
            | Op::BitcastConvert { .. }
            | Op::StopGradient
            | Op::Poison => false,
        }
    }
}

/// Names of the primitives that carry gradients, one per differentiable `Op` variant (unary
/// and binary ops listed individually). The gradient-check table must have a row for each.
pub fn differentiable_primitive_names() -> Vec<&'static str> {
    let mut ops: Vec<Op> = UnaryOp::ALL.iter().map(|u| Op::Unary(*u)).collect();
    ops.extend(BinaryOp::ALL.iter().map(|b| Op::Binary(*b)));
    ops.extend([
        Op::Select,
        Op::Clamp,
        Op::Convert { to: DType::F32 },
        Op::BroadcastInDim {
            dims: vec![],
            mapping: vec![],
        },
        Op::Reshape { dims: vec![] },
        Op::Transpose { perm: vec![] },
        Op::Slice {
            start: vec![],
            limit: vec![],
            stride: vec![],
        },
        Op::DynamicSlice { sizes: vec![] },
        Op::DynamicUpdateSlice,
        Op::Concatenate { dim: 0 },
        Op::Pad {
            low: vec![],
            high: vec![],
            interior: vec![],
        },
        Op::DotGeneral {
            dims: DotDims::default(),
            result: DType::F32,
        },
        Op::Reduce {
            kind: ReduceKind::Sum,
            dims: vec![],
        },
        Op::Reduce {
            kind: ReduceKind::Max,
            dims: vec![],
        },
        Op::Reduce {
            kind: ReduceKind::Min,
            dims: vec![],
        },
        Op::Take { axes: vec![0] },
        Op::ScatterAdd { axes: vec![0] },
        Op::ScatterSet { axes: vec![0] },
        Op::Cumsum {
            dim: 0,
            reverse: false,
        },
        Op::Sort { descending: false },
        Op::RaggedDot {
            per_group: false,
            native: false,
            result: DType::F32,
        },
        Op::OptimizationBarrier,
        Op::ShardingConstraint(Sharding::replicated(0)),
        Op::Scan(Box::default()),
    ]);
    ops.into_iter()
        .filter(|o| o.is_differentiable())
        .map(|o| o.name())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_literals_are_valid_mlir() {
        assert_eq!(format_element(1.0, DType::F32), "1.0");
        assert_eq!(format_element(1e-7, DType::F64), "1.0e-7");
        assert_eq!(format_element(0.1, DType::F32), "0.1");
        assert_eq!(format_element(f64::NEG_INFINITY, DType::F32), "0xFF800000");
        assert_eq!(format_element(f64::INFINITY, DType::BF16), "0x7F80");
        assert_eq!(format_element(f64::INFINITY, DType::F64), "0x7FF0000000000000");
        assert_eq!(format_element(-3.0, DType::I32), "-3");
        assert_eq!(format_element(1.0, DType::Bool), "true");
    }

    #[test]
    fn dense_literals_nest_by_shape() {
        let l = Literal::dense_f64(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], DType::F32);
        assert_eq!(l.mlir(&[2, 3]), "dense<[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]>");
        assert_eq!(Literal::dense_i64(&[7], DType::I32).mlir(&[]), "dense<7>");
    }

    #[test]
    fn shape_rules_report_what_is_wrong() {
        let a = TensorType::new(DType::F32, &[2, 3]);
        let b = TensorType::new(DType::F32, &[4, 5]);
        let err = Op::DotGeneral {
            dims: DotDims::matmul(),
            result: DType::F32,
        }
        .infer(&[&a, &b])
        .unwrap_err();
        assert!(
            err.contains("lhs dimension 1 (size 3) does not match rhs dimension 0 (size 4)"),
            "{err}"
        );
        let i = TensorType::new(DType::I32, &[2, 3]);
        let err = Op::Unary(UnaryOp::Exp).infer(&[&i]).unwrap_err();
        assert!(err.contains("element type i32"), "{err}");
        let ok = Op::DotGeneral {
            dims: DotDims {
                lhs_batch: vec![0],
                rhs_batch: vec![0],
                lhs_contract: vec![2],
                rhs_contract: vec![1],
            },
            result: DType::F32,
        }
        .infer(&[
            &TensorType::new(DType::BF16, &[4, 2, 3]),
            &TensorType::new(DType::BF16, &[4, 3, 5]),
        ])
        .unwrap();
        assert_eq!(ok[0], TensorType::new(DType::F32, &[4, 2, 5]));
    }

    #[test]
    fn dot_gradients_need_no_transpose_for_common_layouts() {
        use crate::graph::{grad, Graph};
        let g = Graph::new("dots");
        // Projection: [b, t, d] x [d, e].
        let x = g.parameter("x", DType::F32, &[2, 3, 4]);
        let w = g.parameter("w", DType::F32, &[4, 5]);
        // Attention scores: [b, h, t, d] x [b, h, s, d] -> [b, h, t, s], and probs x values.
        let q = g.parameter("q", DType::F32, &[2, 2, 3, 4]);
        let k = g.parameter("k", DType::F32, &[2, 2, 5, 4]);
        let v = g.parameter("v", DType::F32, &[2, 2, 5, 4]);
        let batch = DotDims {
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 1],
            ..Default::default()
        };
        let scores = q.dot_general(
            &k,
            DotDims {
                lhs_contract: vec![3],
                rhs_contract: vec![3],
                ..batch.clone()
            },
            None,
        );
        let out = scores.dot_general(
            &v,
            DotDims {
                lhs_contract: vec![3],
                rhs_contract: vec![2],
                ..batch
            },
            None,
        );
        let loss = &x.matmul(&w).tanh().sum_all() + &out.sin().sum_all();
        let grads = grad(&loss, &[&x, &w, &q, &k, &v]).unwrap();
        let p = g.build(&grads.iter().collect::<Vec<_>>()).unwrap();
        assert!(!p.mlir().contains("transpose"), "{}", p.mlir());
        // Three forward products, two per operand pair backward.
        assert_eq!(p.mlir().matches("dot_general").count(), 3 + 6, "{}", p.mlir());
    }

    #[test]
    fn differentiable_list_covers_the_float_primitives() {
        let names = differentiable_primitive_names();
        for n in [
            "exp",
            "dot_general",
            "take",
            "scatter_add",
            "sort",
            "cumsum",
            "pad",
            "reduce_max",
        ] {
            assert!(names.contains(&n), "{n} missing from {names:?}");
        }
        assert!(!names.contains(&"sign") && !names.contains(&"and") && !names.contains(&"compare"));
    }
}
