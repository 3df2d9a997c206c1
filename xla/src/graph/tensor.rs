//! The user-facing tensor API: methods and operator overloads that record primitives.
//!
//! Binary element-wise methods and operators broadcast NumPy-style (shapes aligned on the
//! right, size-1 dimensions stretch); everything else is explicit. Each method carries
//! `#[track_caller]`, so a shape error names the line of model code that made it.
//!
//! Gathers and scatters index one axis ([`Tensor::take`], [`Tensor::scatter`]) or several at
//! once ([`Tensor::take_at`], [`Tensor::scatter_at`]).

use std::ops;
use std::panic::Location;

use crate::dtype::DType;
use crate::graph::builder::{Graph, Tensor};
use crate::graph::ops::{BinaryOp, Comparison, DotDims, Op, ReduceKind, UnaryOp};
use crate::graph::sharding::Sharding;

macro_rules! unary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self) -> Tensor {
                    self.graph.add1(Op::Unary(UnaryOp::$op), &[self], Location::caller())
                }
            )*
        }
    };
}

unary_methods! {
    /// `-x`.
    neg => Neg;
    /// `e^x`.
    exp => Exp;
    /// Natural logarithm.
    log => Log;
    /// `log(1 + x)`, accurate near 0.
    log1p => Log1p;
    /// Hyperbolic tangent.
    tanh => Tanh;
    /// `1 / (1 + e^-x)`.
    logistic => Logistic;
    /// Square root.
    sqrt => Sqrt;
    /// `1 / sqrt(x)`.
    rsqrt => Rsqrt;
    /// Absolute value.
    abs => Abs;
    /// -1, 0 or 1 (zero gradient).
    sign => Sign;
    /// Sine.
    sin => Sin;
    /// Cosine.
    cos => Cos;
    /// Round toward negative infinity (zero gradient).
    floor => Floor;
    /// True where the element is neither infinite nor NaN.
    is_finite => IsFinite;
    /// Logical (bool) or bitwise (integer) not.
    not => Not;
}

macro_rules! binary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self, other: &Tensor) -> Tensor {
                    self.binary(BinaryOp::$op, other, Location::caller())
                }
            )*
        }
    };
}

binary_methods! {
    /// Element-wise sum (broadcasting).
    add => Add;
    /// Element-wise difference (broadcasting).
    sub => Sub;
    /// Element-wise product (broadcasting).
    mul => Mul;
    /// Element-wise quotient (broadcasting; integer division truncates).
    div => Div;
    /// `self ^ other` element-wise (floats).
    pow => Pow;
    /// Element-wise maximum (ties split the gradient evenly).
    max => Max;
    /// Element-wise minimum (ties split the gradient evenly).
    min => Min;
    /// Remainder with the sign of the dividend (C `fmod`).
    rem => Rem;
    /// Logical/bitwise and.
    and => And;
    /// Logical/bitwise or.
    or => Or;
    /// Logical/bitwise exclusive or.
    xor => Xor;
    /// Integer shift left.
    shift_left => ShiftLeft;
    /// Integer logical shift right.
    shift_right_logical => ShiftRightLogical;
}

macro_rules! compare_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self, other: &Tensor) -> Tensor {
                    let loc = Location::caller();
                    let (a, b) = self.broadcast_pair(other, "compare", loc);
                    self.graph.add1(Op::Compare(Comparison::$op), &[&a, &b], loc)
                }
            )*
        }
    };
}

compare_methods! {
    /// `self == other` (bool, broadcasting).
    eq => Eq;
    /// `self != other`.
    ne => Ne;
    /// `self < other`.
    lt => Lt;
    /// `self <= other`.
    le => Le;
    /// `self > other`.
    gt => Gt;
    /// `self >= other`.
    ge => Ge;
}

/// The NumPy broadcast of two shapes, or None when they are incompatible.
pub(crate) fn broadcast_shapes(a: &[i64], b: &[i64]) -> Option<Vec<i64>> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
        let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return None;
        };
    }
    Some(out)
}

impl Tensor {
    fn broadcast_pair(&self, other: &Tensor, op: &str, loc: &'static Location<'static>) -> (Tensor, Tensor) {
        if self.dims() == other.dims() {
            return (self.clone(), other.clone());
        }
        match broadcast_shapes(self.dims(), other.dims()) {
            Some(shape) => (self.broadcast_at(&shape, loc), other.broadcast_at(&shape, loc)),
            None => {
                self.graph.op_error(
                    op,
                    format!("shapes {} and {} do not broadcast together", self.ty, other.ty),
                    loc,
                );
                (self.clone(), self.clone())
            }
        }
    }

    pub(crate) fn binary(&self, op: BinaryOp, other: &Tensor, loc: &'static Location<'static>) -> Tensor {
        let (a, b) = self.broadcast_pair(other, Op::Binary(op).name(), loc);
        // Identities that autodiff produces a lot of (x * 1, x + 0): keep the text lean.
        if a.ty == b.ty && a.graph.same(&b.graph) {
            let (sa, sb) = (a.graph.splat_value(&a), a.graph.splat_value(&b));
            match op {
                BinaryOp::Mul if sa == Some(1.0) => return b,
                BinaryOp::Mul | BinaryOp::Div if sb == Some(1.0) => return a,
                BinaryOp::Add if sa == Some(0.0) => return b,
                BinaryOp::Add | BinaryOp::Sub if sb == Some(0.0) => return a,
                _ => {}
            }
        }
        self.graph.add1(Op::Binary(op), &[&a, &b], loc)
    }

    fn broadcast_at(&self, dims: &[i64], loc: &'static Location<'static>) -> Tensor {
        if self.dims() == dims {
            return self.clone();
        }
        if self.rank() > dims.len() {
            self.graph.op_error(
                "broadcast_to",
                format!("cannot broadcast {} to {dims:?}", self.ty),
                loc,
            );
            return self.clone();
        }
        if let Some(v) = self.graph.splat_value(self) {
            if broadcast_shapes(self.dims(), dims).as_deref() == Some(dims) {
                return self.graph.full(v, self.dtype(), dims);
            }
        }
        let offset = dims.len() - self.rank();
        let mapping: Vec<usize> = (offset..dims.len()).collect();
        self.graph.add1(
            Op::BroadcastInDim {
                dims: dims.to_vec(),
                mapping,
            },
            &[self],
            loc,
        )
    }

    /// A scalar constant of this tensor's element type.
    #[track_caller]
    pub fn scalar_like(&self, value: f64) -> Tensor {
        self.graph.full(value, self.dtype(), &[])
    }

    /// A constant with this tensor's type, every element `value`.
    #[track_caller]
    pub fn full_like(&self, value: f64) -> Tensor {
        self.graph.full(value, self.dtype(), self.dims())
    }

    /// Zeros of this tensor's type.
    #[track_caller]
    pub fn zeros_like(&self) -> Tensor {
        self.full_like(0.0)
    }

    /// Ones of this tensor's type.
    #[track_caller]
    pub fn ones_like(&self) -> Tensor {
        self.full_like(1.0)
    }

    /// `pred ? on_true : on_false` element-wise; `self` is the bool predicate. Branches and
    /// predicate broadcast to a common shape.
    #[track_caller]
    pub fn select(&self, on_true: &Tensor, on_false: &Tensor) -> Tensor {
        let loc = Location::caller();
        let shape = broadcast_shapes(on_true.dims(), on_false.dims())
            .and_then(|s| broadcast_shapes(&s, self.dims()))
            .unwrap_or_else(|| on_true.dims().to_vec());
        let t = on_true.broadcast_at(&shape, loc);
        let f = on_false.broadcast_at(&shape, loc);
        let p = if self.rank() == 0 {
            self.clone()
        } else {
            self.broadcast_at(&shape, loc)
        };
        self.graph.add1(Op::Select, &[&p, &t, &f], loc)
    }

    /// Limits every element to `[lo, hi]` (scalars or this tensor's shape).
    #[track_caller]
    pub fn clamp(&self, lo: &Tensor, hi: &Tensor) -> Tensor {
        self.graph.add1(Op::Clamp, &[lo, self, hi], Location::caller())
    }

    /// Limits every element to `[lo, hi]` given as numbers.
    #[track_caller]
    pub fn clamp_scalar(&self, lo: f64, hi: f64) -> Tensor {
        let loc = Location::caller();
        let l = self.graph.full(lo, self.dtype(), &[]);
        let h = self.graph.full(hi, self.dtype(), &[]);
        self.graph.add1(Op::Clamp, &[&l, self, &h], loc)
    }

    /// Converts the element type (rounding to nearest even for narrower floats).
    #[track_caller]
    pub fn convert(&self, to: DType) -> Tensor {
        self.graph.add1(Op::Convert { to }, &[self], Location::caller())
    }

    /// [`Tensor::convert`] unless the type already matches.
    #[track_caller]
    pub fn convert_if_needed(&self, to: DType) -> Tensor {
        if self.dtype() == to {
            self.clone()
        } else {
            self.convert(to)
        }
    }

    /// Reinterprets the bits as another element type of the same width (e.g. u32 -> f32).
    #[track_caller]
    pub fn bitcast(&self, to: DType) -> Tensor {
        self.graph
            .add1(Op::BitcastConvert { to }, &[self], Location::caller())
    }

    /// `broadcast_in_dim`: operand dimension `i` becomes result dimension `mapping[i]`
    /// (strictly increasing); other result dimensions are new.
    #[track_caller]
    pub fn broadcast_in_dim(&self, dims: &[i64], mapping: &[usize]) -> Tensor {
        if self.dims() == dims && mapping.iter().enumerate().all(|(i, m)| i == *m) {
            return self.clone();
        }
        let op = Op::BroadcastInDim {
            dims: dims.to_vec(),
            mapping: mapping.to_vec(),
        };
        if let Some(v) = self.graph.splat_value(self) {
            if op.infer(&[&self.ty]).is_ok() {
                return self.graph.full(v, self.dtype(), dims);
            }
        }
        self.graph.add1(
            Op::BroadcastInDim {
                dims: dims.to_vec(),
                mapping: mapping.to_vec(),
            },
            &[self],
            Location::caller(),
        )
    }

    /// NumPy-style broadcast to `dims` (aligned on the right).
    #[track_caller]
    pub fn broadcast_to(&self, dims: &[i64]) -> Tensor {
        self.broadcast_at(dims, Location::caller())
    }

    /// Same elements, new shape (row-major). One dimension may be `-1`: it is inferred from
    /// the element count.
    #[track_caller]
    pub fn reshape(&self, dims: &[i64]) -> Tensor {
        let mut dims = dims.to_vec();
        if let Some(pos) = dims.iter().position(|d| *d == -1) {
            let known: i64 = dims.iter().filter(|d| **d != -1).product();
            if known > 0 && self.num_elements() % known == 0 {
                dims[pos] = self.num_elements() / known;
            }
        }
        if self.dims() == dims.as_slice() {
            return self.clone();
        }
        self.graph.add1(Op::Reshape { dims }, &[self], Location::caller())
    }

    /// Result dimension `i` is operand dimension `perm[i]`.
    #[track_caller]
    pub fn transpose(&self, perm: &[usize]) -> Tensor {
        self.graph
            .add1(Op::Transpose { perm: perm.to_vec() }, &[self], Location::caller())
    }

    /// [`Tensor::transpose`] unless `perm` is the identity.
    #[track_caller]
    pub fn transpose_if_needed(&self, perm: &[usize]) -> Tensor {
        if perm.iter().enumerate().all(|(i, p)| i == *p) && perm.len() == self.rank() {
            self.clone()
        } else {
            self.transpose(perm)
        }
    }

    /// Swaps the last two dimensions.
    #[track_caller]
    pub fn t(&self) -> Tensor {
        let r = self.rank();
        let mut perm: Vec<usize> = (0..r).collect();
        if r >= 2 {
            perm.swap(r - 1, r - 2);
        }
        self.transpose(&perm)
    }

    /// A strided static slice `[start, limit)` step `stride` in each dimension.
    #[track_caller]
    pub fn slice(&self, start: &[i64], limit: &[i64], stride: &[i64]) -> Tensor {
        self.graph.add1(
            Op::Slice {
                start: start.to_vec(),
                limit: limit.to_vec(),
                stride: stride.to_vec(),
            },
            &[self],
            Location::caller(),
        )
    }

    /// `[start, end)` along one axis, everything along the others.
    #[track_caller]
    pub fn slice_axis(&self, axis: usize, start: i64, end: i64) -> Tensor {
        let r = self.rank();
        let mut s = vec![0; r];
        let mut l = self.dims().to_vec();
        if axis < r {
            s[axis] = start;
            l[axis] = end;
        }
        self.graph.add1(
            Op::Slice {
                start: s,
                limit: l,
                stride: vec![1; r],
            },
            &[self],
            Location::caller(),
        )
    }

    /// A slice of static `sizes` at run-time start indices (scalar integers, clamped so the
    /// slice fits).
    #[track_caller]
    pub fn dynamic_slice(&self, start: &[&Tensor], sizes: &[i64]) -> Tensor {
        let mut ins = vec![self];
        ins.extend_from_slice(start);
        self.graph.add1(
            Op::DynamicSlice {
                sizes: sizes.to_vec(),
            },
            &ins,
            Location::caller(),
        )
    }

    /// This tensor with `update` written at run-time start indices (clamped so it fits).
    #[track_caller]
    pub fn dynamic_update_slice(&self, update: &Tensor, start: &[&Tensor]) -> Tensor {
        let mut ins = vec![self, update];
        ins.extend_from_slice(start);
        self.graph.add1(Op::DynamicUpdateSlice, &ins, Location::caller())
    }

    /// Joins tensors along `axis`.
    ///
    /// # Panics
    /// With an empty `parts` (there is no graph to record the error in).
    #[track_caller]
    pub fn concat(parts: &[&Tensor], axis: usize) -> Tensor {
        let loc = Location::caller();
        match parts.first() {
            Some(first) => first.graph.add1(Op::Concatenate { dim: axis }, parts, loc),
            None => panic!("Tensor::concat needs at least one tensor ({loc})"),
        }
    }

    /// Pads with `value` (a scalar tensor): `low`/`high` elements at the edges and `interior`
    /// between neighbours, per dimension.
    #[track_caller]
    pub fn pad(&self, value: &Tensor, low: &[i64], high: &[i64], interior: &[i64]) -> Tensor {
        self.graph.add1(
            Op::Pad {
                low: low.to_vec(),
                high: high.to_vec(),
                interior: interior.to_vec(),
            },
            &[self, value],
            Location::caller(),
        )
    }

    /// General batched matrix product; `preferred` is the result element type (default: the
    /// operands'), e.g. bf16 operands with f32 results.
    #[track_caller]
    pub fn dot_general(&self, rhs: &Tensor, dims: DotDims, preferred: Option<DType>) -> Tensor {
        let result = preferred.unwrap_or(self.dtype());
        self.graph
            .add1(Op::DotGeneral { dims, result }, &[self, rhs], Location::caller())
    }

    /// Grouped matrix product: `self` `[M, K]` is consecutive groups of `group_sizes[g]` rows
    /// (`[G]`, i32), `rhs` `[G, K, N]` a matrix per group; each row times its group's matrix,
    /// `[M, N]` (rows past the groups' total are zeros). `native` lowers it to XLA's ragged dot
    /// (TPU, GPU), else to a masked dense product any plugin runs (the `RaggedDot` primitive of
    /// `ops.rs`). `preferred` is the result element type (default: the operands').
    #[track_caller]
    pub fn ragged_dot(
        &self,
        rhs: &Tensor,
        group_sizes: &Tensor,
        native: bool,
        preferred: Option<DType>,
    ) -> Tensor {
        self.ragged(rhs, group_sizes, (false, native), preferred, Location::caller())
    }

    /// The per-group form of [`Tensor::ragged_dot`] (its gradient with respect to the
    /// matrices): `self` `[M, K]` and `rhs` `[M, N]` in the same groups of rows; per group the
    /// sum of `self[m]ᵀ rhs[m]` over its rows, `[G, K, N]`.
    #[track_caller]
    pub fn ragged_dot_per_group(
        &self,
        rhs: &Tensor,
        group_sizes: &Tensor,
        native: bool,
        preferred: Option<DType>,
    ) -> Tensor {
        self.ragged(rhs, group_sizes, (true, native), preferred, Location::caller())
    }

    fn ragged(
        &self,
        rhs: &Tensor,
        group_sizes: &Tensor,
        (per_group, native): (bool, bool),
        preferred: Option<DType>,
        at: &'static Location<'static>,
    ) -> Tensor {
        let result = preferred.unwrap_or(self.dtype());
        let op = Op::RaggedDot {
            per_group,
            native,
            result,
        };
        self.graph.add1(op, &[self, rhs, group_sizes], at)
    }

    /// Matrix product over the last dimension of `self` and the first of `rhs` when `rhs` is
    /// a matrix (`[..., k] x [k, n]`), or a batched product when both have rank r >= 3 and
    /// equal leading dimensions (`[b.., m, k] x [b.., k, n]`).
    #[track_caller]
    pub fn matmul(&self, rhs: &Tensor) -> Tensor {
        let loc = Location::caller();
        let (lr, rr) = (self.rank(), rhs.rank());
        let dims = if rr == 2 && lr >= 1 {
            DotDims {
                lhs_contract: vec![lr - 1],
                rhs_contract: vec![0],
                ..Default::default()
            }
        } else if lr == rr && lr >= 3 {
            DotDims {
                lhs_batch: (0..lr - 2).collect(),
                rhs_batch: (0..lr - 2).collect(),
                lhs_contract: vec![lr - 1],
                rhs_contract: vec![lr - 2],
            }
        } else {
            self.graph.op_error(
                "matmul",
                format!("cannot multiply {} by {}", self.ty, rhs.ty),
                loc,
            );
            return self.clone();
        };
        self.graph.add1(
            Op::DotGeneral {
                dims,
                result: self.dtype(),
            },
            &[self, rhs],
            loc,
        )
    }

    fn reduce(&self, kind: ReduceKind, dims: &[usize], loc: &'static Location<'static>) -> Tensor {
        if dims.is_empty() {
            return self.clone();
        }
        self.graph.add1(
            Op::Reduce {
                kind,
                dims: dims.to_vec(),
            },
            &[self],
            loc,
        )
    }

    /// Sum over the given dimensions (removed from the shape).
    #[track_caller]
    pub fn reduce_sum(&self, dims: &[usize]) -> Tensor {
        self.reduce(ReduceKind::Sum, dims, Location::caller())
    }

    /// Maximum over the given dimensions.
    #[track_caller]
    pub fn reduce_max(&self, dims: &[usize]) -> Tensor {
        self.reduce(ReduceKind::Max, dims, Location::caller())
    }

    /// Minimum over the given dimensions.
    #[track_caller]
    pub fn reduce_min(&self, dims: &[usize]) -> Tensor {
        self.reduce(ReduceKind::Min, dims, Location::caller())
    }

    /// Sum of all elements (a scalar).
    #[track_caller]
    pub fn sum_all(&self) -> Tensor {
        let dims: Vec<usize> = (0..self.rank()).collect();
        self.reduce(ReduceKind::Sum, &dims, Location::caller())
    }

    /// Mean of all elements (a scalar).
    #[track_caller]
    pub fn mean_all(&self) -> Tensor {
        let n = self.num_elements().max(1) as f64;
        let dims: Vec<usize> = (0..self.rank()).collect();
        let s = self.reduce(ReduceKind::Sum, &dims, Location::caller());
        &s * (1.0 / n)
    }

    /// Sum along one axis (negative counts from the end), keeping it as size 1 when `keep`.
    #[track_caller]
    pub fn sum_axis(&self, axis: i64, keep: bool) -> Tensor {
        let loc = Location::caller();
        let a = self.axis("sum_axis", axis);
        let r = self.reduce(ReduceKind::Sum, &[a], loc);
        if keep {
            r.keep_axis(a)
        } else {
            r
        }
    }

    /// Maximum along one axis, keeping it as size 1 when `keep`.
    #[track_caller]
    pub fn max_axis(&self, axis: i64, keep: bool) -> Tensor {
        let loc = Location::caller();
        let a = self.axis("max_axis", axis);
        let r = self.reduce(ReduceKind::Max, &[a], loc);
        if keep {
            r.keep_axis(a)
        } else {
            r
        }
    }

    /// Mean along one axis, keeping it as size 1 when `keep`.
    #[track_caller]
    pub fn mean_axis(&self, axis: i64, keep: bool) -> Tensor {
        let n = self.dim(axis) as f64;
        &self.sum_axis(axis, keep) * (1.0 / n)
    }

    /// Removes the size-1 dimension `axis` (negative counts from the end; a reshape).
    #[track_caller]
    pub fn squeeze(&self, axis: i64) -> Tensor {
        let a = self.axis("squeeze", axis);
        let mut d = self.dims().to_vec();
        if d.get(a) != Some(&1) {
            self.graph.op_error(
                "squeeze",
                format!("dimension {axis} of {} is not 1", self.ty),
                Location::caller(),
            );
            return self.clone();
        }
        d.remove(a);
        self.reshape(&d)
    }

    /// `x * x`.
    #[track_caller]
    pub fn square(&self) -> Tensor {
        self.binary(BinaryOp::Mul, self, Location::caller())
    }

    /// Re-inserts a size-1 dimension at `axis` (a reshape).
    #[track_caller]
    pub fn keep_axis(&self, axis: usize) -> Tensor {
        let mut d = self.dims().to_vec();
        d.insert(axis.min(d.len()), 1);
        self.reshape(&d)
    }

    /// The first index of the maximum along `axis` (i32). NaN elements are not handled.
    #[track_caller]
    pub fn argmax(&self, axis: i64) -> Tensor {
        let a = self.axis("argmax", axis);
        let m = self.stop_gradient().max_axis(a as i64, true);
        let hit = self.eq(&m);
        let idx = self.graph.iota(DType::I32, self.dims(), a);
        let miss = self.graph.full(self.dim(a as i64) as f64, DType::I32, &[]);
        hit.select(&idx, &miss).reduce_min(&[a])
    }

    /// Rows along `axis` picked by integer `indices`: result shape
    /// `self[..axis] ++ indices ++ self[axis+1..]` (embedding lookup: `table.take(&ids, 0)`).
    /// Out-of-range indices are clamped.
    #[track_caller]
    pub fn take(&self, indices: &Tensor, axis: usize) -> Tensor {
        self.take_at(indices, &[axis])
    }

    /// Elements picked by coordinates along several `axes` (strictly increasing): `indices`
    /// is `[batch.., axes.len()]` (or just `[batch..]` for one axis), and the result is
    /// `self[..axes[0]] ++ batch ++ (the later dimensions not in axes)`. For a KV cache
    /// `[S, kv_heads, L, hd]`, `indices [S, 2]` of (slot, position) and `axes = [0, 2]` pick
    /// `[S, kv_heads, hd]`. Out-of-range coordinates are clamped.
    #[track_caller]
    pub fn take_at(&self, indices: &Tensor, axes: &[usize]) -> Tensor {
        self.graph.add1(
            Op::Take { axes: axes.to_vec() },
            &[self, indices],
            Location::caller(),
        )
    }

    /// Adds `updates` (shaped like `self.take(indices, axis)`) into the rows `indices` name;
    /// repeated indices accumulate, out-of-range ones are dropped.
    #[track_caller]
    pub fn scatter_add(&self, indices: &Tensor, updates: &Tensor, axis: usize) -> Tensor {
        self.scatter_add_at(indices, updates, &[axis])
    }

    /// [`Tensor::scatter_add`] with coordinates along several axes, as in [`Tensor::take_at`].
    #[track_caller]
    pub fn scatter_add_at(&self, indices: &Tensor, updates: &Tensor, axes: &[usize]) -> Tensor {
        self.graph.add1(
            Op::ScatterAdd { axes: axes.to_vec() },
            &[self, indices, updates],
            Location::caller(),
        )
    }

    /// Writes `updates` (shaped like `self.take(indices, axis)`) over the rows `indices` name;
    /// with repeated indices one update wins (its gradient assumes unique indices);
    /// out-of-range ones are dropped.
    #[track_caller]
    pub fn scatter(&self, indices: &Tensor, updates: &Tensor, axis: usize) -> Tensor {
        self.scatter_at(indices, updates, &[axis])
    }

    /// [`Tensor::scatter`] with coordinates along several axes, as in [`Tensor::take_at`]:
    /// writing each slot's new key `[S, kv_heads, hd]` into a cache `[S, kv_heads, L, hd]` at
    /// (slot, position) touches only those rows, in the cache's own layout.
    #[track_caller]
    pub fn scatter_at(&self, indices: &Tensor, updates: &Tensor, axes: &[usize]) -> Tensor {
        self.graph.add1(
            Op::ScatterSet { axes: axes.to_vec() },
            &[self, indices, updates],
            Location::caller(),
        )
    }

    /// `out[..., i] = self[..., indices[..., i]]` along the last axis, where `indices` has this
    /// tensor's shape except possibly the last dimension (e.g. token log-probs from
    /// `[b, t, vocab]` log-probs and `[b, t, 1]` targets). Implemented as a flat gather.
    #[track_caller]
    pub fn take_along_last_axis(&self, indices: &Tensor) -> Tensor {
        let dims = self.dims().to_vec();
        let r = dims.len();
        if r == 0 || indices.rank() != r || indices.dims()[..r - 1] != dims[..r - 1] {
            self.graph.op_error(
                "take_along_last_axis",
                format!(
                    "indices {} do not match operand {} outside the last axis",
                    indices.ty, self.ty
                ),
                Location::caller(),
            );
            return self.clone();
        }
        let n = dims[r - 1];
        let rows: i64 = dims[..r - 1].iter().product();
        let k = indices.dims()[r - 1];
        let idx = indices.convert_if_needed(DType::I32).reshape(&[rows, k]);
        let base = &self.graph.iota(DType::I32, &[rows, k], 0) * (n as f64);
        let flat = (&idx + &base).reshape(&[rows * k]);
        self.reshape(&[rows * n]).take(&flat, 0).reshape(indices.dims())
    }

    /// Inclusive running sum along `axis` (from the end when `reverse`).
    #[track_caller]
    pub fn cumsum(&self, axis: i64, reverse: bool) -> Tensor {
        let dim = self.axis("cumsum", axis);
        self.graph
            .add1(Op::Cumsum { dim, reverse }, &[self], Location::caller())
    }

    /// Stable sort along the last axis; returns the sorted values and the i32 positions they
    /// came from.
    #[track_caller]
    pub fn sort(&self, descending: bool) -> (Tensor, Tensor) {
        let mut out = self
            .graph
            .add(Op::Sort { descending }, &[self], Location::caller());
        let idx = out.pop().unwrap_or_else(|| self.clone());
        let vals = out.pop().unwrap_or_else(|| self.clone());
        (vals, idx)
    }

    /// The `k` largest values along the last axis, in descending order, with their i32
    /// positions.
    #[track_caller]
    pub fn top_k(&self, k: i64) -> (Tensor, Tensor) {
        let (v, i) = self.sort(true);
        let last = self.rank().saturating_sub(1);
        (v.slice_axis(last, 0, k), i.slice_axis(last, 0, k))
    }

    /// Identity whose gradient is zero.
    #[track_caller]
    pub fn stop_gradient(&self) -> Tensor {
        self.graph.add1(Op::StopGradient, &[self], Location::caller())
    }

    /// Pins this tensor's layout over the mesh (`sdy.sharding_constraint`).
    #[track_caller]
    pub fn with_sharding(&self, sharding: Sharding) -> Tensor {
        self.graph
            .add1(Op::ShardingConstraint(sharding), &[self], Location::caller())
    }
}

impl Graph {
    /// Passes the tensors through an `optimization_barrier`: XLA will not move computation
    /// across it (e.g. to force a recompute in the backward pass).
    #[track_caller]
    pub fn optimization_barrier(&self, tensors: &[&Tensor]) -> Vec<Tensor> {
        let loc = Location::caller();
        for t in tensors {
            if !t.graph.same(self) {
                self.op_error(
                    "optimization_barrier",
                    "operands from another graph".to_string(),
                    loc,
                );
                return tensors.iter().map(|t| (*t).clone()).collect();
            }
        }
        let outs = tensors.iter().map(|t| t.ty.clone()).collect();
        self.push_node(
            Op::OptimizationBarrier,
            tensors.iter().map(|t| t.value).collect(),
            outs,
        )
    }
}

// ---- operator overloading -------------------------------------------------------------

macro_rules! binop_impls {
    ($trait:ident, $method:ident, $op:ident) => {
        impl ops::$trait<&Tensor> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> Tensor {
                self.binary(BinaryOp::$op, rhs, Location::caller())
            }
        }
        impl ops::$trait<Tensor> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> Tensor {
                self.binary(BinaryOp::$op, &rhs, Location::caller())
            }
        }
        impl ops::$trait<&Tensor> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> Tensor {
                self.binary(BinaryOp::$op, rhs, Location::caller())
            }
        }
        impl ops::$trait<Tensor> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> Tensor {
                self.binary(BinaryOp::$op, &rhs, Location::caller())
            }
        }
        impl ops::$trait<f64> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: f64) -> Tensor {
                let c = self.graph.full(rhs, self.dtype(), self.dims());
                self.binary(BinaryOp::$op, &c, Location::caller())
            }
        }
        impl ops::$trait<f64> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: f64) -> Tensor {
                let c = self.graph.full(rhs, self.dtype(), self.dims());
                self.binary(BinaryOp::$op, &c, Location::caller())
            }
        }
        impl ops::$trait<&Tensor> for f64 {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> Tensor {
                let c = rhs.graph.full(self, rhs.dtype(), rhs.dims());
                c.binary(BinaryOp::$op, rhs, Location::caller())
            }
        }
        impl ops::$trait<Tensor> for f64 {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> Tensor {
                let c = rhs.graph.full(self, rhs.dtype(), rhs.dims());
                c.binary(BinaryOp::$op, &rhs, Location::caller())
            }
        }
    };
}

binop_impls!(Add, add, Add);
binop_impls!(Sub, sub, Sub);
binop_impls!(Mul, mul, Mul);
binop_impls!(Div, div, Div);

impl ops::Neg for &Tensor {
    type Output = Tensor;
    #[track_caller]
    fn neg(self) -> Tensor {
        self.graph
            .add1(Op::Unary(UnaryOp::Neg), &[self], Location::caller())
    }
}

impl ops::Neg for Tensor {
    type Output = Tensor;
    #[track_caller]
    fn neg(self) -> Tensor {
        self.graph
            .add1(Op::Unary(UnaryOp::Neg), &[&self], Location::caller())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numpy_broadcasting_rules() {
        assert_eq!(broadcast_shapes(&[2, 3], &[3]), Some(vec![2, 3]));
        assert_eq!(broadcast_shapes(&[2, 1], &[1, 4]), Some(vec![2, 4]));
        assert_eq!(broadcast_shapes(&[], &[5]), Some(vec![5]));
        assert_eq!(broadcast_shapes(&[2, 3], &[4]), None);
    }

    #[test]
    fn errors_name_op_shapes_and_caller_line() {
        let g = Graph::new("t");
        let a = g.parameter("a", DType::F32, &[2, 3]);
        let b = g.parameter("b", DType::F32, &[4, 5]);
        let line = line!() + 1;
        let c = a.matmul(&b);
        let _ = c.exp();
        let err = g.check().unwrap_err().to_string();
        assert!(err.contains("dot_general"), "{err}");
        assert!(err.contains("f32[2, 3]") && err.contains("f32[4, 5]"), "{err}");
        assert!(err.contains(&format!("tensor.rs:{line}")), "{err}");
        let g = Graph::new("t2");
        let a = g.parameter("a", DType::F32, &[2, 3]);
        let b = g.parameter("b", DType::F32, &[4]);
        let _ = &a + &b;
        let err = g.check().unwrap_err().to_string();
        assert!(
            err.contains("add: shapes f32[2, 3] and f32[4] do not broadcast together"),
            "{err}"
        );
        let g = Graph::new("t3");
        let a = g.parameter("a", DType::F32, &[2]);
        let i = g.parameter("i", DType::I32, &[2]);
        let _ = &a * &i;
        let err = g.check().unwrap_err().to_string();
        assert!(err.contains("mul: element types differ (f32 vs i32)"), "{err}");
    }

    #[test]
    fn reshape_infers_one_dimension() {
        let g = Graph::new("t");
        let a = g.parameter("a", DType::F32, &[2, 3, 4]);
        assert_eq!(a.reshape(&[-1, 4]).dims(), &[6, 4]);
        assert_eq!(a.reshape(&[2, -1]).dims(), &[2, 12]);
        assert_eq!(a.slice_axis(0, 0, 1).squeeze(0).dims(), &[3, 4]);
        let _ = a.reshape(&[5, -1]);
        let err = g.check().unwrap_err().to_string();
        assert!(
            err.contains("reshape: cannot reshape 24 elements into [5, -1]"),
            "{err}"
        );
    }

    #[test]
    fn splat_constants_are_shared() {
        let g = Graph::new("t");
        let a = g.parameter("a", DType::F32, &[2]);
        let n = g.num_nodes();
        let _ = &a * 2.0;
        let _ = &a * 2.0;
        // one splat constant shaped like `a`, two multiplies
        assert_eq!(g.num_nodes(), n + 3);
    }
}
