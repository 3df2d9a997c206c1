//! The reverse-mode rule of every primitive: one match over [`Op`], written with the traced
//! tensor API, so gradients are themselves differentiable. [`crate::graph::autodiff`] walks a
//! graph backwards and asks each node's primitive for its operands' cotangents here.

use crate::dtype::DType;
use crate::graph::builder::Tensor;
use crate::graph::ops::*;

impl Op {
    /// The reverse-mode rule: given the operands `x`, the results `y` and a cotangent for each
    /// result `g`, the cotangent contribution for each operand (`None` = zero / not
    /// differentiable). Written with the traced tensor API, so gradients are themselves
    /// differentiable.
    pub(crate) fn vjp(&self, x: &[Tensor], y: &[Tensor], g: &[Tensor]) -> Vec<Option<Tensor>> {
        let g0 = &g[0];
        let y0 = &y[0];
        let none = |n: usize| vec![None; n];
        match self {
            Op::Unary(u) => {
                let a = &x[0];
                let d = match u {
                    UnaryOp::Neg => g0.neg(),
                    UnaryOp::Exp => g0 * y0,
                    UnaryOp::Log => g0 / a,
                    UnaryOp::Log1p => g0 / &(a + 1.0),
                    UnaryOp::Tanh => g0 * &(1.0 - &(y0 * y0)),
                    UnaryOp::Logistic => g0 * &(y0 * &(1.0 - y0)),
                    UnaryOp::Sqrt => &(g0 * 0.5) / y0,
                    UnaryOp::Rsqrt => &(g0 * -0.5) * &(y0 / a),
                    UnaryOp::Abs => g0 * &a.sign(),
                    UnaryOp::Sin => g0 * &a.cos(),
                    UnaryOp::Cos => (g0 * &a.sin()).neg(),
                    UnaryOp::Sign | UnaryOp::Floor | UnaryOp::IsFinite | UnaryOp::Not => return none(1),
                };
                vec![Some(d)]
            }
            Op::Binary(b) => {
                let (a, c) = (&x[0], &x[1]);
                match b {
                    BinaryOp::Add => vec![Some(g0.clone()), Some(g0.clone())],
                    BinaryOp::Sub => vec![Some(g0.clone()), Some(g0.neg())],
                    BinaryOp::Mul => vec![Some(g0 * c), Some(g0 * a)],
                    BinaryOp::Div => vec![Some(g0 / c), Some((&(g0 * y0) / c).neg())],
                    BinaryOp::Pow => {
                        let da = &(g0 * c) * &a.pow(&(c - 1.0));
                        let positive = a.gt(&a.zeros_like());
                        let safe_log = positive.select(a, &a.ones_like()).log();
                        let db = &(g0 * y0) * &safe_log;
                        vec![Some(da), Some(db)]
                    }
                    BinaryOp::Max | BinaryOp::Min => {
                        let wins = if *b == BinaryOp::Max { a.gt(c) } else { a.lt(c) };
                        let share = &wins.convert(a.dtype()) + &(&a.eq(c).convert(a.dtype()) * 0.5);
                        let da = g0 * &share;
                        let db = g0 - &da;
                        vec![Some(da), Some(db)]
                    }
                    BinaryOp::Rem => {
                        let q = a / c;
                        let trunc = &q.sign() * &q.abs().floor();
                        vec![Some(g0.clone()), Some((g0 * &trunc).neg())]
                    }
                    _ => none(2),
                }
            }
            Op::Select => {
                let (p, a) = (&x[0], &x[1]);
                let zero = a.zeros_like();
                vec![None, Some(p.select(g0, &zero)), Some(p.select(&zero, g0))]
            }
            Op::Clamp => {
                let (lo, a, hi) = (&x[0], &x[1], &x[2]);
                let lo_b = lo.broadcast_to(a.dims());
                let hi_b = hi.broadcast_to(a.dims());
                let zero = a.zeros_like();
                let inside = a.ge(&lo_b).and(&a.le(&hi_b));
                let to_bound = |mask: Tensor, bound: &Tensor| {
                    let d = mask.select(g0, &zero);
                    if bound.rank() == 0 {
                        sum_to_scalar(&d)
                    } else {
                        d
                    }
                };
                vec![
                    Some(to_bound(a.lt(&lo_b), lo)),
                    Some(inside.select(g0, &zero)),
                    Some(to_bound(a.gt(&hi_b), hi)),
                ]
            }
            Op::Convert { .. } => {
                if x[0].dtype().is_float() && y0.dtype().is_float() {
                    vec![Some(g0.convert(x[0].dtype()))]
                } else {
                    none(1)
                }
            }
            Op::BroadcastInDim { dims, mapping } => {
                let a = &x[0];
                let summed: Vec<usize> = (0..dims.len())
                    .filter(|d| match mapping.iter().position(|m| m == d) {
                        None => true,
                        Some(i) => a.dims()[i] == 1 && dims[*d] != 1,
                    })
                    .collect();
                let r = if summed.is_empty() {
                    g0.clone()
                } else {
                    g0.reduce_sum(&summed)
                };
                vec![Some(r.reshape(a.dims()))]
            }
            Op::Reshape { .. } => vec![Some(g0.reshape(x[0].dims()))],
            Op::Transpose { perm } => {
                let mut inv = vec![0usize; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inv[p] = i;
                }
                vec![Some(g0.transpose(&inv))]
            }
            Op::Slice {
                start,
                limit: _,
                stride,
            } => {
                let a = &x[0];
                let n = g0.dims();
                let interior: Vec<i64> = stride.iter().map(|s| s - 1).collect();
                let high: Vec<i64> = (0..a.rank())
                    .map(|d| {
                        if n[d] == 0 {
                            a.dims()[d] - start[d]
                        } else {
                            a.dims()[d] - 1 - (start[d] + (n[d] - 1) * stride[d])
                        }
                    })
                    .collect();
                let zero = g0.graph().scalar(0.0, g0.dtype());
                vec![Some(g0.pad(&zero, start, &high, &interior))]
            }
            Op::DynamicSlice { .. } => {
                let mut out = vec![Some(
                    x[0].zeros_like()
                        .dynamic_update_slice(g0, &x[1..].iter().collect::<Vec<_>>()),
                )];
                out.extend(std::iter::repeat_n(None, x.len() - 1));
                out
            }
            Op::DynamicUpdateSlice => {
                let idx: Vec<&Tensor> = x[2..].iter().collect();
                let u = &x[1];
                let mut out = vec![
                    Some(g0.dynamic_update_slice(&u.zeros_like(), &idx)),
                    Some(g0.dynamic_slice(&idx, u.dims())),
                ];
                out.extend(std::iter::repeat_n(None, idx.len()));
                out
            }
            Op::Concatenate { dim } => {
                let mut at = 0;
                x.iter()
                    .map(|t| {
                        let n = t.dims()[*dim];
                        let s = g0.slice_axis(*dim, at, at + n);
                        at += n;
                        Some(s)
                    })
                    .collect()
            }
            Op::Pad { low, high, interior } => {
                let a = &x[0];
                let ga = if a.num_elements() == 0 {
                    a.zeros_like()
                } else {
                    let limit: Vec<i64> = (0..a.rank())
                        .map(|d| low[d] + (a.dims()[d] - 1) * (interior[d] + 1) + 1)
                        .collect();
                    let stride: Vec<i64> = interior.iter().map(|i| i + 1).collect();
                    g0.slice(low, &limit, &stride)
                };
                // Summed over the padded positions themselves (a 0/1 mask), not as the total
                // minus the operand's part, which cancels catastrophically in bf16.
                let padded = a.zeros_like().pad(&x[1].ones_like(), low, high, interior);
                let gv = sum_to_scalar(&(g0 * &padded));
                vec![Some(ga), Some(gv)]
            }
            Op::DotGeneral { dims, .. } => {
                let (l, r) = (&x[0], &x[1]);
                if !l.dtype().is_float() {
                    return none(2);
                }
                vec![
                    Some(dot_transpose_lhs(dims, l, r, g0)),
                    Some(dot_transpose_rhs(dims, l, r, g0)),
                ]
            }
            Op::Reduce { kind, dims } => {
                let a = &x[0];
                let kept: Vec<usize> = (0..a.rank()).filter(|d| !dims.contains(d)).collect();
                let gb = g0.broadcast_in_dim(a.dims(), &kept);
                match kind {
                    ReduceKind::Sum => vec![Some(gb)],
                    ReduceKind::Max | ReduceKind::Min => {
                        if !a.dtype().is_float() {
                            return none(1);
                        }
                        let mask = a.eq(&y0.broadcast_in_dim(a.dims(), &kept)).convert(a.dtype());
                        let count = mask.reduce_sum(dims).broadcast_in_dim(a.dims(), &kept);
                        vec![Some(&(&gb * &mask) / &count)]
                    }
                }
            }
            Op::Take { axes } => vec![Some(x[0].zeros_like().scatter_add_at(&x[1], g0, axes)), None],
            Op::ScatterAdd { axes } => vec![Some(g0.clone()), None, Some(g0.take_at(&x[1], axes))],
            Op::ScatterSet { axes } => vec![
                Some(g0.scatter_at(&x[1], &x[2].zeros_like(), axes)),
                None,
                Some(g0.take_at(&x[1], axes)),
            ],
            Op::Cumsum { dim, reverse } => vec![Some(g0.cumsum(*dim as i64, !*reverse))],
            Op::Sort { .. } => vec![Some(scatter_last_axis(g0, &y[1]))],
            Op::RaggedDot {
                per_group, native, ..
            } => {
                let (l, r, gs) = (&x[0], &x[1], &x[2]);
                let g0 = g0.convert_if_needed(l.dtype());
                let swap = |t: &Tensor| t.transpose(&[0, 2, 1]);
                let rd = |a: &Tensor, b: &Tensor, per_group: bool, to: DType| {
                    a.graph().add1(
                        Op::RaggedDot {
                            per_group,
                            native: *native,
                            result: to,
                        },
                        &[a, b, gs],
                        std::panic::Location::caller(),
                    )
                };
                if *per_group {
                    // y[g] = sum over g's rows of l[m]ᵀ r[m]: dl[m] = r[m] y'[g]ᵀ, dr[m] = l[m] y'[g].
                    vec![
                        Some(rd(r, &swap(&g0), false, l.dtype())),
                        Some(rd(l, &g0, false, r.dtype())),
                        None,
                    ]
                } else {
                    // y[m] = l[m] r[g]: dl[m] = y'[m] r[g]ᵀ, dr[g] = sum over g's rows of l[m]ᵀ y'[m].
                    vec![
                        Some(rd(&g0, &swap(r), false, l.dtype())),
                        Some(rd(l, &g0, true, r.dtype())),
                        None,
                    ]
                }
            }
            Op::OptimizationBarrier => g.iter().map(|t| Some(t.clone())).collect(),
            Op::Scan(body) => crate::graph::scan::vjp(body, x, y, g),
            Op::ShardingConstraint(_) => vec![Some(g0.clone())],
            Op::Parameter { .. }
            | Op::LoopArg { .. }
            | Op::Constant { .. }
            | Op::Iota { .. }
            | Op::Compare(_)
            | Op::BitcastConvert { .. }
            | Op::StopGradient
            | Op::Poison => none(x.len()),
        }
    }
}

/// The sum of every element of a cotangent bound for a scalar operand, accumulated in f32
/// when the type is narrower (one term per element: a bf16 running sum loses the small ones).
fn sum_to_scalar(t: &Tensor) -> Tensor {
    let wide = match t.dtype() {
        DType::BF16 | DType::F16 => DType::F32,
        other => other,
    };
    t.convert_if_needed(wide).sum_all().convert_if_needed(t.dtype())
}

/// `out[..., idx[..., i]] = g[..., i]` for a permutation `idx` along the last axis (the
/// transpose of a sort).
fn scatter_last_axis(g: &Tensor, idx: &Tensor) -> Tensor {
    let dims = g.dims().to_vec();
    let n = *dims.last().unwrap_or(&1);
    let rows: i64 = dims[..dims.len().saturating_sub(1)].iter().product();
    let total = rows * n;
    let graph = g.graph();
    let row_base = &graph.iota(DType::I32, &[rows, n], 0) * (n as f64);
    let flat_idx = (&idx.reshape(&[rows, n]) + &row_base).reshape(&[total]);
    let zeros = graph.zeros(g.dtype(), &[total]);
    zeros
        .scatter_add(&flat_idx, &g.reshape(&[total]), 0)
        .reshape(&dims)
}

/// A gradient dot: operands already share a type (bf16 operands with f32 results stay on
/// XLA CPU's fast path), accumulated in `acc`, cast to the primal's type `want`.
fn grad_dot(a: &Tensor, b: &Tensor, dims: DotDims, acc: DType, want: DType) -> Tensor {
    a.dot_general(b, dims, Some(acc)).convert_if_needed(want)
}

fn sorted_rank(v: &[usize], x: usize) -> usize {
    v.iter().filter(|&&y| y < x).count()
}

/// The cotangent of one operand `x` of a `dot_general` whose other operand is `p`:
/// `xb`/`xc`/`xf` are x's batch, contracting and free dimensions, `pb`/`pc`/`pf` p's, and `gx`
/// / `gp` the positions of x's and p's free dimensions in the cotangent `g`. Either
/// `dot_general(g, p)` or `dot_general(p, g)` gives x's dimensions in some order; the one whose
/// order is already x's is chosen, so `x @ w`, attention scores and the like need no transpose.
#[allow(clippy::too_many_arguments)]
fn dot_operand_cotangent(
    x: &Tensor,
    p: &Tensor,
    g: &Tensor,
    xb: &[usize],
    xc: &[usize],
    pb: &[usize],
    pc: &[usize],
    pf: &[usize],
    gx: &[usize],
    gp: &[usize],
) -> Tensor {
    let nb = xb.len();
    let xf_len = gx.len();
    let mut g_first = vec![0usize; x.rank()];
    let mut p_first = vec![0usize; x.rank()];
    for (i, &b) in xb.iter().enumerate() {
        g_first[b] = i;
        p_first[b] = i;
    }
    let xf = DotDims::free(x.rank(), xb, xc);
    for (j, &f) in xf.iter().enumerate() {
        g_first[f] = nb + j;
        p_first[f] = nb + xc.len() + j;
    }
    for (k, &c) in xc.iter().enumerate() {
        g_first[c] = nb + xf_len + sorted_rank(pc, pc[k]);
        p_first[c] = nb + sorted_rank(pc, pc[k]);
    }
    let identity = |perm: &[usize]| perm.iter().enumerate().all(|(i, v)| i == *v);
    let gc = g.convert_if_needed(p.dtype());
    let gbatch: Vec<usize> = (0..nb).collect();
    if identity(&p_first) && !identity(&g_first) {
        let d = DotDims {
            lhs_batch: pb.to_vec(),
            rhs_batch: gbatch,
            lhs_contract: pf.to_vec(),
            rhs_contract: gp.to_vec(),
        };
        grad_dot(p, &gc, d, g.dtype(), x.dtype())
    } else {
        let d = DotDims {
            lhs_batch: gbatch,
            rhs_batch: pb.to_vec(),
            lhs_contract: gp.to_vec(),
            rhs_contract: pf.to_vec(),
        };
        grad_dot(&gc, p, d, g.dtype(), x.dtype()).transpose_if_needed(&g_first)
    }
}

/// Cotangent of the lhs of `dot_general(l, r)`.
fn dot_transpose_lhs(dims: &DotDims, l: &Tensor, r: &Tensor, g: &Tensor) -> Tensor {
    let nb = dims.lhs_batch.len();
    let lf = DotDims::free(l.rank(), &dims.lhs_batch, &dims.lhs_contract);
    let rf = DotDims::free(r.rank(), &dims.rhs_batch, &dims.rhs_contract);
    let gx: Vec<usize> = (nb..nb + lf.len()).collect();
    let gp: Vec<usize> = (nb + lf.len()..nb + lf.len() + rf.len()).collect();
    dot_operand_cotangent(
        l,
        r,
        g,
        &dims.lhs_batch,
        &dims.lhs_contract,
        &dims.rhs_batch,
        &dims.rhs_contract,
        &rf,
        &gx,
        &gp,
    )
}

/// Cotangent of the rhs of `dot_general(l, r)`.
fn dot_transpose_rhs(dims: &DotDims, l: &Tensor, r: &Tensor, g: &Tensor) -> Tensor {
    let nb = dims.lhs_batch.len();
    let lf = DotDims::free(l.rank(), &dims.lhs_batch, &dims.lhs_contract);
    let rf = DotDims::free(r.rank(), &dims.rhs_batch, &dims.rhs_contract);
    let gp: Vec<usize> = (nb..nb + lf.len()).collect();
    let gx: Vec<usize> = (nb + lf.len()..nb + lf.len() + rf.len()).collect();
    dot_operand_cotangent(
        r,
        l,
        g,
        &dims.rhs_batch,
        &dims.rhs_contract,
        &dims.lhs_batch,
        &dims.lhs_contract,
        &lf,
        &gx,
        &gp,
    )
}
