//! Gradient checks: for every differentiable primitive and composite, the reverse-mode
//! gradient against central finite differences, on random inputs with random small shapes.
//!
//! The table below has one row per check: the inputs it needs (float inputs are
//! differentiated, integer ones are indices) and the function. Each row's output `y` is turned
//! into a scalar `sum(y * w)` with a random weight tensor `w`, so every output element
//! matters. All rows are traced into ONE graph (one program for the gradients, one for the
//! losses the finite differences evaluate), to keep compile time small.
//!
//! Bounds:
//! - f64: finite differences in f64 with step `eps` (1e-5 unless the row says otherwise);
//!   `max|ad - fd| <= 1e-5 * max(max|fd|, 1e-3)` for each input (normwise relative error).
//! - f32: the same graph traced in f32; its gradients against the checked f64 gradients,
//!   `max|ad32 - ad64| <= 1e-4 * max(max|ad64|, 1e-3)` (f32 rounding through a few ops;
//!   the worst row measured ~2e-7).
//! - bf16: the same graph traced in bf16 (inputs rounded to bf16), against the f64 gradients,
//!   `max|ad16 - ad64| <= 6e-2 * max(max|ad64|, 1e-3)` (the worst row measured 2e-2 to 3.4e-2).
//!
//! `every_differentiable_primitive_has_a_row` fails when a differentiable primitive has no row.

mod graph_support;

use std::collections::BTreeSet;

use graph_support::{read, rng, upload};
use rand::rngs::StdRng;
use rand::Rng;
use xla::graph::{grad, ops, DotDims, Graph, Tensor};
use xla::runtime::Buffer;
use xla::DType;

/// One input of a row.
#[derive(Clone, Debug)]
enum In {
    /// A differentiable float input with values uniform in `[lo, hi)`.
    F(Vec<i64>, f64, f64),
    /// An i32 input with values in `[0, hi)` (indices).
    I(Vec<i64>, i32),
}

struct Row {
    name: &'static str,
    eps: f64,
    inputs: fn(&mut StdRng) -> Vec<In>,
    f: fn(&Graph, &[Tensor]) -> Tensor,
}

fn d(r: &mut StdRng) -> i64 {
    r.random_range(1..=4)
}

fn d2(r: &mut StdRng) -> i64 {
    r.random_range(2..=4)
}

macro_rules! row {
    ($name:expr, |$r:ident| $inputs:expr, |$g:ident, $x:ident| $f:expr) => {
        row!($name, 1e-5, |$r| $inputs, |$g, $x| $f)
    };
    ($name:expr, $eps:expr, |$r:ident| $inputs:expr, |$g:ident, $x:ident| $f:expr) => {
        Row {
            name: $name,
            eps: $eps,
            inputs: |$r: &mut StdRng| $inputs,
            f: |$g: &Graph, $x: &[Tensor]| {
                let _ = $g;
                $f
            },
        }
    };
}

fn table() -> Vec<Row> {
    use In::{F, I};
    vec![
        // ---- unary ----
        row!("neg", |r| vec![F(vec![d(r), d(r)], -2.0, 2.0)], |g, x| x[0].neg()),
        row!("exp", |r| vec![F(vec![d(r), d(r)], -2.0, 2.0)], |g, x| x[0].exp()),
        row!("log", |r| vec![F(vec![d(r)], 0.3, 3.0)], |g, x| x[0].log()),
        row!("log1p", |r| vec![F(vec![d(r)], -0.5, 3.0)], |g, x| x[0].log1p()),
        row!("tanh", |r| vec![F(vec![d(r), d(r)], -2.0, 2.0)], |g, x| x[0]
            .tanh()),
        row!("logistic", |r| vec![F(vec![d(r)], -3.0, 3.0)], |g, x| x[0]
            .logistic()),
        row!("sqrt", |r| vec![F(vec![d(r)], 0.3, 3.0)], |g, x| x[0].sqrt()),
        row!("rsqrt", |r| vec![F(vec![d(r)], 0.3, 3.0)], |g, x| x[0].rsqrt()),
        row!("abs", |r| vec![F(vec![d(r), d(r)], -2.0, 2.0)], |g, x| x[0].abs()),
        row!("sin", |r| vec![F(vec![d(r)], -3.0, 3.0)], |g, x| x[0].sin()),
        row!("cos", |r| vec![F(vec![d(r)], -3.0, 3.0)], |g, x| x[0].cos()),
        // ---- binary (broadcasting included) ----
        row!(
            "add",
            |r| {
                let a = d(r);
                vec![F(vec![d(r), a], -2.0, 2.0), F(vec![a], -2.0, 2.0)]
            },
            |g, x| &x[0] + &x[1]
        ),
        row!(
            "sub",
            |r| {
                let s = vec![d(r), d(r)];
                vec![F(s.clone(), -2.0, 2.0), F(s, -2.0, 2.0)]
            },
            |g, x| &x[0] - &x[1]
        ),
        row!(
            "mul",
            |r| {
                let s = vec![d(r), d(r)];
                vec![F(s.clone(), -2.0, 2.0), F(s, -2.0, 2.0)]
            },
            |g, x| &x[0] * &x[1]
        ),
        row!(
            "div",
            |r| {
                let s = vec![d(r)];
                vec![F(s.clone(), -2.0, 2.0), F(s, 0.5, 2.0)]
            },
            |g, x| &x[0] / &x[1]
        ),
        row!(
            "pow",
            |r| {
                let s = vec![d(r)];
                vec![F(s.clone(), 0.5, 2.0), F(s, -1.5, 1.5)]
            },
            |g, x| x[0].pow(&x[1])
        ),
        row!(
            "max",
            |r| {
                let s = vec![d(r), d(r)];
                vec![F(s.clone(), -2.0, 2.0), F(s, -2.0, 2.0)]
            },
            |g, x| x[0].max(&x[1])
        ),
        row!(
            "min",
            |r| {
                let s = vec![d(r), d(r)];
                vec![F(s.clone(), -2.0, 2.0), F(s, -2.0, 2.0)]
            },
            |g, x| x[0].min(&x[1])
        ),
        row!(
            "rem",
            |r| {
                let s = vec![d(r)];
                vec![F(s.clone(), 0.5, 3.0), F(s, 0.7, 1.3)]
            },
            |g, x| x[0].rem(&x[1])
        ),
        row!(
            "scalar operators",
            |r| vec![F(vec![d(r)], 0.5, 2.0)],
            |g, x| &(&(3.0 - &x[0]) * 2.0) / &(&x[0] + 1.0)
        ),
        // ---- select, clamp, convert ----
        row!(
            "select",
            |r| {
                let s = vec![d(r), d(r)];
                vec![F(s.clone(), -2.0, 2.0), F(s, -2.0, 2.0)]
            },
            |g, x| x[0].gt(&x[1]).select(&(&x[0] * 2.0), &(&x[1] * 3.0))
        ),
        row!(
            "clamp",
            |r| vec![
                F(vec![d(r), d(r)], -2.0, 2.0),
                F(vec![], -1.0, -0.5),
                F(vec![], 0.5, 1.0)
            ],
            |g, x| x[0].clamp(&x[1], &x[2])
        ),
        row!("convert", 0.1, |r| vec![F(vec![d(r)], -2.0, 2.0)], |g, x| {
            let other = if x[0].dtype() == DType::F64 {
                DType::F32
            } else {
                DType::F64
            };
            x[0].convert(other).convert(x[0].dtype())
        }),
        // ---- shape ----
        row!(
            "broadcast_in_dim",
            |r| vec![F(vec![d(r), 1], -2.0, 2.0)],
            |g, x| {
                let rows = x[0].dims()[0];
                x[0].broadcast_to(&[2, rows, 3])
            }
        ),
        row!(
            "broadcast_in_dim explicit",
            |r| vec![F(vec![d(r)], -2.0, 2.0)],
            |g, x| {
                let n = x[0].dims()[0];
                x[0].broadcast_in_dim(&[2, n, 3], &[1])
            }
        ),
        row!("reshape", |r| vec![F(vec![2, d(r), 3], -2.0, 2.0)], |g, x| {
            let n = x[0].num_elements();
            x[0].reshape(&[3, n / 3]).exp()
        }),
        row!(
            "transpose",
            |r| vec![F(vec![d(r), d(r), d(r)], -2.0, 2.0)],
            |g, x| x[0].transpose(&[2, 0, 1]).sin()
        ),
        row!(
            "slice",
            |r| vec![F(vec![d2(r) + 2, d2(r) + 3], -2.0, 2.0)],
            |g, x| {
                let (a, b) = (x[0].dims()[0], x[0].dims()[1]);
                x[0].slice(&[1, 0], &[a, b - 1], &[2, 3]).exp()
            }
        ),
        row!(
            "dynamic_slice",
            |r| vec![F(vec![4, d(r) + 2], -2.0, 2.0), I(vec![], 3), I(vec![], 3)],
            |g, x| x[0].dynamic_slice(&[&x[1], &x[2]], &[2, 2]).exp()
        ),
        row!(
            "dynamic_update_slice",
            |r| vec![
                F(vec![4, d(r) + 2], -2.0, 2.0),
                F(vec![2, 2], -2.0, 2.0),
                I(vec![], 3)
            ],
            |g, x| x[0].dynamic_update_slice(&x[1], &[&x[2], &x[2]]).sin()
        ),
        row!(
            "concatenate",
            |r| {
                let a = d(r);
                vec![F(vec![a, d(r)], -2.0, 2.0), F(vec![a, d(r)], -2.0, 2.0)]
            },
            |g, x| Tensor::concat(&[&x[0], &x[1].exp(), &x[0]], 1)
        ),
        row!(
            "pad",
            |r| vec![F(vec![d(r), d(r)], -2.0, 2.0), F(vec![], -1.0, 1.0)],
            |g, x| x[0].pad(&x[1], &[1, 0], &[0, 2], &[1, 2]).sin()
        ),
        row!(
            "iota and constants",
            |r| vec![F(vec![d(r), 3], -2.0, 2.0)],
            |g, x| {
                let rows = x[0].dims()[0];
                let i = g.iota(x[0].dtype(), &[rows, 3], 1);
                let c = g.constant_f64(&[0.5, -1.0, 2.0], x[0].dtype(), &[3]);
                &(&x[0] * &i) + &(&x[0] * &c)
            }
        ),
        // ---- dot_general ----
        row!(
            "matmul",
            |r| {
                let k = d(r);
                vec![F(vec![d(r), k], -1.0, 1.0), F(vec![k, d(r)], -1.0, 1.0)]
            },
            |g, x| x[0].matmul(&x[1])
        ),
        row!(
            "dot_general batched, contracting inner dims",
            |r| {
                let (b, k, m, n) = (d(r), d(r), d(r), d(r));
                vec![F(vec![b, k, m], -1.0, 1.0), F(vec![b, n, k], -1.0, 1.0)]
            },
            |g, x| x[0].dot_general(
                &x[1],
                DotDims {
                    lhs_batch: vec![0],
                    rhs_batch: vec![0],
                    lhs_contract: vec![1],
                    rhs_contract: vec![2]
                },
                None
            )
        ),
        row!(
            "dot_general two contracting dims, batch not leading",
            |r| {
                let (b, k1, k2, m) = (d(r), d(r), d(r), d(r));
                vec![F(vec![k1, b, m, k2], -1.0, 1.0), F(vec![k2, k1, b], -1.0, 1.0)]
            },
            |g, x| x[0].dot_general(
                &x[1],
                DotDims {
                    lhs_batch: vec![1],
                    rhs_batch: vec![2],
                    lhs_contract: vec![3, 0],
                    rhs_contract: vec![0, 1]
                },
                None
            )
        ),
        // ---- ragged_dot (the masked lowering the CPU plugin runs; the native one shares its
        // shape rule and gradient, and tests/ragged_dot.rs compiles it for a TPU) ----
        row!(
            "ragged_dot (a matrix per group of rows, one group empty, one row in none)",
            |r| {
                let k = d(r);
                vec![F(vec![8, k], -1.0, 1.0), F(vec![4, k, 3], -1.0, 1.0)]
            },
            |g, x| {
                let sizes = g.constant_i64(&[2, 0, 4, 1], DType::I32, &[4]);
                x[0].ragged_dot(&x[1], &sizes, false, None)
            }
        ),
        row!(
            "ragged_dot per group (the matrices' gradient form)",
            |r| vec![F(vec![6, d(r)], -1.0, 1.0), F(vec![6, 3], -1.0, 1.0)],
            |g, x| {
                let sizes = g.constant_i64(&[3, 1, 2], DType::I32, &[3]);
                x[0].ragged_dot_per_group(&x[1], &sizes, false, None)
            }
        ),
        // ---- reductions ----
        row!(
            "reduce_sum",
            |r| vec![F(vec![d(r), d(r), d(r)], -2.0, 2.0)],
            |g, x| x[0].reduce_sum(&[0, 2]).exp()
        ),
        row!("reduce_max", |r| vec![F(vec![d(r), d2(r)], -2.0, 2.0)], |g, x| x
            [0]
        .reduce_max(&[1])),
        row!("reduce_min", |r| vec![F(vec![d2(r), d(r)], -2.0, 2.0)], |g, x| x
            [0]
        .reduce_min(&[0])),
        // ---- gather / scatter / cumsum / sort ----
        row!(
            "take (embedding rows, repeated ids)",
            |r| vec![F(vec![4, d(r)], -2.0, 2.0), I(vec![2, 3], 4)],
            |g, x| x[0].take(&x[1], 0)
        ),
        row!(
            "take along axis 1",
            |r| vec![F(vec![d(r), 4], -2.0, 2.0), I(vec![5], 4)],
            |g, x| x[0].take(&x[1], 1)
        ),
        row!(
            "scatter_add",
            |r| {
                let c = d(r);
                vec![F(vec![4, c], -2.0, 2.0), I(vec![5], 4), F(vec![5, c], -2.0, 2.0)]
            },
            |g, x| x[0].scatter_add(&x[1], &x[2], 0).sin()
        ),
        row!(
            "scatter (replace, unique rows)",
            |r| {
                let c = d(r);
                vec![F(vec![5, c], -2.0, 2.0), F(vec![3, c], -2.0, 2.0)]
            },
            |g, x| {
                let rows = g.constant_i64(&[3, 0, 4], DType::I32, &[3]);
                x[0].scatter(&rows, &x[1], 0).sin()
            }
        ),
        row!("cumsum", |r| vec![F(vec![d(r), d2(r)], -2.0, 2.0)], |g, x| x[0]
            .cumsum(-1, false)
            .sin()),
        row!(
            "cumsum reverse",
            |r| vec![F(vec![d2(r), d(r)], -2.0, 2.0)],
            |g, x| x[0].cumsum(0, true).sin()
        ),
        row!("sort", |r| vec![F(vec![d(r), d2(r) + 1], -2.0, 2.0)], |g, x| x[0]
            .sort(true)
            .0),
        row!("top_k", |r| vec![F(vec![d(r), 5], -2.0, 2.0)], |g, x| x[0]
            .top_k(2)
            .0
            .exp()),
        row!(
            "optimization_barrier",
            |r| {
                let s = vec![d(r)];
                vec![F(s.clone(), -2.0, 2.0), F(s, -2.0, 2.0)]
            },
            |g, x| {
                let b = g.optimization_barrier(&[&x[0], &x[1]]);
                &b[0] * &b[1].exp()
            }
        ),
        row!(
            "scan",
            |r| {
                let (n, k) = (d(r), d(r));
                vec![
                    F(vec![n], -1.0, 1.0),
                    F(vec![3, n, n], -1.0, 1.0),
                    F(vec![k, n], -1.0, 1.0),
                ]
            },
            |g, x| {
                // A carry, stacked weights, a captured value and per-iteration outputs.
                let (carry, ys) = g.scan(&[x[0].clone()], &[x[1].clone()], false, |h, s| {
                    let next = (&s[0]
                        .matmul(&h[0].reshape(&[h[0].dims()[0], 1]))
                        .reshape(h[0].dims())
                        + &h[0])
                        .tanh();
                    let y = x[2].matmul(&next.reshape(&[next.dims()[0], 1]));
                    (vec![next], vec![y])
                });
                &carry[0].sum_all() + &ys[0].sin().sum_all()
            }
        ),
        // ---- composites ----
        row!("softmax", |r| vec![F(vec![d(r), d2(r)], -3.0, 3.0)], |g, x| x[0]
            .softmax(-1)),
        row!(
            "softmax axis 0",
            |r| vec![F(vec![d2(r), d(r)], -3.0, 3.0)],
            |g, x| x[0].softmax(0)
        ),
        row!(
            "log_softmax",
            |r| vec![F(vec![d(r), d2(r)], -3.0, 3.0)],
            |g, x| x[0].log_softmax(-1)
        ),
        row!("logsumexp", |r| vec![F(vec![d(r), d2(r)], -3.0, 3.0)], |g, x| x
            [0]
        .logsumexp(-1, false)),
        row!(
            "rms_norm",
            |r| {
                let n = d2(r);
                vec![F(vec![d(r), n], -2.0, 2.0), F(vec![n], 0.5, 1.5)]
            },
            |g, x| x[0].rms_norm(&x[1], 1e-5)
        ),
        row!("silu", |r| vec![F(vec![d(r), d(r)], -3.0, 3.0)], |g, x| x[0]
            .silu()),
        row!(
            "rope",
            |r| {
                let s = d(r);
                let h = 2 * d(r);
                vec![
                    F(vec![d(r), s, h], -2.0, 2.0),
                    F(vec![s, h], -1.0, 1.0),
                    F(vec![s, h], -1.0, 1.0),
                ]
            },
            |g, x| x[0].rope(&x[1], &x[2])
        ),
        row!(
            "token_log_probs",
            |r| vec![F(vec![d(r), d(r), 5], -3.0, 3.0)]
                .into_iter()
                .collect::<Vec<_>>(),
            |g, x| {
                let dims = x[0].dims();
                let t = g.iota(DType::I32, &dims[..2], 1);
                x[0].token_log_probs(&t.rem(&g.full(5.0, DType::I32, &dims[..2])))
            }
        ),
        row!(
            "cross_entropy with id inputs",
            |r| {
                let (b, t) = (d(r), d(r));
                vec![F(vec![b, t, 6], -3.0, 3.0), I(vec![b, t], 6)]
            },
            |g, x| x[0].cross_entropy(&x[1])
        ),
        row!("entropy", |r| vec![F(vec![d(r), d2(r)], -3.0, 3.0)], |g, x| x[0]
            .entropy()),
        row!(
            "mean and max_axis",
            |r| vec![F(vec![d(r), d2(r)], -2.0, 2.0)],
            |g, x| &x[0].mean_axis(1, true) * &x[0].max_axis(0, true)
        ),
        // ---- gather / scatter over several axes (last: rows added here do not change the
        // random draws of the rows above) ----
        row!(
            "take at axes 0 and 2 (points, repeated)",
            |r| vec![F(vec![3, d(r), 4], -2.0, 2.0), I(vec![5, 2], 3)],
            |g, x| x[0].take_at(&x[1], &[0, 2])
        ),
        row!(
            "scatter_add at axes 0 and 2 (repeated points)",
            |r| {
                let c = d(r);
                vec![
                    F(vec![3, c, 4], -2.0, 2.0),
                    I(vec![5, 2], 3),
                    F(vec![5, c], -2.0, 2.0),
                ]
            },
            |g, x| x[0].scatter_add_at(&x[1], &x[2], &[0, 2]).sin()
        ),
        row!(
            "scatter at axes 0 and 2 (KV-cache write, unique points)",
            |r| {
                let c = d(r);
                vec![F(vec![3, c, 4, 2], -2.0, 2.0), F(vec![3, c, 2], -2.0, 2.0)]
            },
            |g, x| {
                let at = g.constant_i64(&[0, 3, 1, 0, 2, 2], DType::I32, &[3, 2]);
                x[0].scatter_at(&at, &x[1], &[0, 2]).sin()
            }
        ),
    ]
}

/// Primitives with no row here, and where they are checked instead.
const CHECKED_ELSEWHERE: &[(&str, &str)] = &[(
    "sharding_constraint",
    "graph_spmd.rs: an SPMD train step with a constraint matches the single-device one",
)];

/// Host values for every input of every row.
struct Values {
    inputs: Vec<Vec<(In, Vec<f64>)>>,
    weights: Vec<Vec<f64>>,
}

struct Traced {
    graph: Graph,
    losses: Vec<Tensor>,
    grads: Vec<Vec<Tensor>>,
    /// Argument order: each row's inputs, then its weight.
    args: Vec<(usize, Option<usize>)>,
    ops_used: BTreeSet<&'static str>,
}

fn trace(rows: &[Row], shapes: &[Vec<In>], dtype: DType) -> Traced {
    let graph = Graph::new(&format!("gradcheck_{dtype}"));
    let mut losses = Vec::new();
    let mut grads = Vec::new();
    let mut args = Vec::new();
    let mut ops_used = BTreeSet::new();
    for (ri, (row, ins)) in rows.iter().zip(shapes).enumerate() {
        let params: Vec<Tensor> = ins
            .iter()
            .enumerate()
            .map(|(k, i)| {
                args.push((ri, Some(k)));
                match i {
                    In::F(dims, ..) => graph.parameter(&format!("{}:{k}", row.name), dtype, dims),
                    In::I(dims, _) => graph.parameter(&format!("{}:{k}", row.name), DType::I32, dims),
                }
            })
            .collect();
        let start = graph.num_nodes();
        let y = (row.f)(&graph, &params).convert_if_needed(dtype);
        ops_used.extend(graph.op_names(start..graph.num_nodes()));
        args.push((ri, None));
        let w = graph.parameter(&format!("{}:w", row.name), dtype, y.dims());
        let loss = (&y * &w).sum_all();
        let wrt: Vec<&Tensor> = params.iter().filter(|p| p.dtype().is_float()).collect();
        let gs = grad(&loss, &wrt).unwrap_or_else(|e| panic!("row {}: {e}", row.name));
        losses.push(loss);
        grads.push(gs);
    }
    graph.check().unwrap();
    Traced {
        graph,
        losses,
        grads,
        args,
        ops_used,
    }
}

/// `values` with every floating-point input and weight rounded to the nearest bf16.
fn rounded_to_bf16(values: &Values) -> Values {
    let round = |v: &[f64]| {
        v.iter()
            .map(|x| half::bf16::from_f64(*x).to_f64())
            .collect::<Vec<_>>()
    };
    Values {
        inputs: values
            .inputs
            .iter()
            .map(|row| {
                row.iter()
                    .map(|(i, v)| match i {
                        In::F(..) => (i.clone(), round(v)),
                        In::I(..) => (i.clone(), v.clone()),
                    })
                    .collect()
            })
            .collect(),
        weights: values.weights.iter().map(|w| round(w)).collect(),
    }
}

fn random_values(shapes: &[Vec<In>], traced: &Traced, r: &mut StdRng) -> Values {
    let mut inputs = Vec::new();
    let mut weights = Vec::new();
    for (ri, ins) in shapes.iter().enumerate() {
        let vals = ins
            .iter()
            .map(|i| {
                let v = match i {
                    In::F(dims, lo, hi) => {
                        graph_support::uniform(r, dims.iter().product::<i64>() as usize, *lo, *hi)
                    }
                    In::I(dims, hi) => (0..dims.iter().product::<i64>())
                        .map(|_| r.random_range(0..*hi) as f64)
                        .collect(),
                };
                (i.clone(), v)
            })
            .collect();
        inputs.push(vals);
        let wdims = traced
            .graph
            .parameters()
            .iter()
            .zip(&traced.args)
            .find(|(_, a)| a.0 == ri && a.1.is_none())
            .map(|(p, _)| p.num_elements())
            .unwrap();
        weights.push(graph_support::uniform(r, wdims as usize, -1.0, 1.0));
    }
    Values { inputs, weights }
}

/// Normwise relative bound for bf16 gradients against the f64 ones (bf16 keeps 8 significant
/// bits: inputs are rounded by ~0.4% and every op rounds again; the worst row measured
/// 3.4e-2).
const BF16_BOUND: f64 = 6e-2;

fn upload_as(dtype: DType, v: &[f64], dims: &[i64]) -> Buffer {
    match dtype {
        DType::BF16 => upload(
            &v.iter().map(|x| half::bf16::from_f64(*x)).collect::<Vec<_>>(),
            dims,
        ),
        DType::F64 => upload(v, dims),
        DType::F32 => upload(&v.iter().map(|x| *x as f32).collect::<Vec<_>>(), dims),
        DType::I32 => upload(&v.iter().map(|x| *x as i32).collect::<Vec<_>>(), dims),
        other => panic!("no upload for {other}"),
    }
}

fn read_f64(b: &Buffer) -> Vec<f64> {
    match b.dtype() {
        DType::F64 => read::<f64>(b),
        DType::F32 => read::<f32>(b).iter().map(|x| *x as f64).collect(),
        DType::BF16 => read::<half::bf16>(b).iter().map(|x| x.to_f64()).collect(),
        other => panic!("no read for {other}"),
    }
}

fn arg_buffers(traced: &Traced, values: &Values, dtype: DType) -> Vec<Buffer> {
    traced
        .args
        .iter()
        .map(|&(ri, k)| match k {
            Some(k) => {
                let (spec, v) = &values.inputs[ri][k];
                match spec {
                    In::F(dims, ..) => upload_as(dtype, v, dims),
                    In::I(dims, _) => upload_as(DType::I32, v, dims),
                }
            }
            None => {
                let w = &values.weights[ri];
                let dims = traced.graph.parameters()
                    [traced.args.iter().position(|a| *a == (ri, None)).unwrap()]
                .dims()
                .to_vec();
                upload_as(dtype, w, &dims)
            }
        })
        .collect()
}

/// Runs the gradient program: per row, the gradients of its float inputs (flattened).
fn ad_gradients(traced: &Traced, bufs: &[Buffer]) -> Vec<Vec<Vec<f64>>> {
    let mut outs: Vec<&Tensor> = Vec::new();
    for gs in &traced.grads {
        outs.extend(gs.iter());
    }
    let p = traced.graph.build(&outs).unwrap();
    let got = graph_support::run(&p, &bufs.iter().collect::<Vec<_>>());
    let mut it = got.iter();
    traced
        .grads
        .iter()
        .map(|gs| gs.iter().map(|_| read_f64(it.next().unwrap())).collect())
        .collect()
}

#[test]
fn every_differentiable_primitive_has_a_row() {
    let rows = table();
    let mut r = rng("coverage");
    let shapes: Vec<Vec<In>> = rows.iter().map(|row| (row.inputs)(&mut r)).collect();
    let traced = trace(&rows, &shapes, DType::F64);
    let missing: Vec<&str> = ops::differentiable_primitive_names()
        .into_iter()
        .filter(|n| !traced.ops_used.contains(n) && !CHECKED_ELSEWHERE.iter().any(|(m, _)| m == n))
        .collect();
    assert!(
        missing.is_empty(),
        "differentiable primitives without a gradient-check row: {missing:?}"
    );
}

#[test]
fn gradients_match_finite_differences_in_f64_and_hold_in_f32_and_bf16() {
    let rows = table();
    let mut r = rng("gradcheck");
    let shapes: Vec<Vec<In>> = rows.iter().map(|row| (row.inputs)(&mut r)).collect();
    let traced = trace(&rows, &shapes, DType::F64);
    let values = random_values(&shapes, &traced, &mut r);
    let mut bufs = arg_buffers(&traced, &values, DType::F64);
    let ad = ad_gradients(&traced, &bufs);

    // Loss program for the finite differences.
    let loss_refs: Vec<&Tensor> = traced.losses.iter().collect();
    let loss_prog = traced.graph.build(&loss_refs).unwrap();
    let exe = graph_support::compile(&loss_prog);
    let mut failures = Vec::new();
    let mut checked = 0usize;
    for (ri, row) in rows.iter().enumerate() {
        let mut gi = 0;
        for (k, (spec, v)) in values.inputs[ri].iter().enumerate() {
            let In::F(dims, ..) = spec else { continue };
            let arg = traced.args.iter().position(|a| *a == (ri, Some(k))).unwrap();
            let mut fd = vec![0.0; v.len()];
            for e in 0..v.len() {
                let mut eval = |delta: f64| {
                    let mut p = v.clone();
                    p[e] += delta;
                    bufs[arg] = upload(&p, dims);
                    let out = exe.execute(&bufs.iter().collect::<Vec<_>>()).unwrap();
                    read::<f64>(&out[ri])[0]
                };
                fd[e] = (eval(row.eps) - eval(-row.eps)) / (2.0 * row.eps);
            }
            bufs[arg] = upload(v, dims);
            let a = &ad[ri][gi];
            let scale = fd.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
            let err = a.iter().zip(&fd).fold(0.0f64, |m, (x, y)| m.max((x - y).abs())) / scale;
            checked += 1;
            if err > 1e-5 || err.is_nan() {
                failures.push(format!(
                    "{} input {k} {dims:?}: relative error {err:.2e}\n  ad {a:?}\n  fd {fd:?}",
                    row.name
                ));
            }
            gi += 1;
        }
    }
    eprintln!("f64: checked {checked} inputs of {} rows", rows.len());
    assert!(
        failures.is_empty(),
        "f64 gradient check failures:\n{}",
        failures.join("\n")
    );

    // f32: the same rows traced in f32 against the checked f64 gradients.
    let traced32 = trace(&rows, &shapes, DType::F32);
    let bufs32 = arg_buffers(&traced32, &values, DType::F32);
    let ad32 = ad_gradients(&traced32, &bufs32);
    let mut worst32 = (0.0f64, "");
    for (ri, row) in rows.iter().enumerate() {
        for (gi, (g32, g64)) in ad32[ri].iter().zip(&ad[ri]).enumerate() {
            let scale = g64.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
            let err = g32.iter().zip(g64).fold(0.0f64, |m, (x, y)| m.max((x - y).abs())) / scale;
            if err > worst32.0 {
                worst32 = (err, row.name);
            }
            if err > 1e-4 || err.is_nan() {
                failures.push(format!(
                    "{} gradient {gi}: f32 relative error {err:.2e}",
                    row.name
                ));
            }
        }
    }
    eprintln!("f32: worst relative error {:.2e} ({})", worst32.0, worst32.1);
    assert!(
        failures.is_empty(),
        "f32 gradient check failures:\n{}",
        failures.join("\n")
    );

    // bf16: the same rows traced in bf16 against the f64 gradients at the same inputs rounded
    // to bf16 (so that rounding an input across a clamp bound or a sort tie is not counted as
    // a gradient error).
    let traced16 = trace(&rows, &shapes, DType::BF16);
    let bufs16 = arg_buffers(&traced16, &values, DType::BF16);
    let ad16 = ad_gradients(&traced16, &bufs16);
    let ad_rounded = ad_gradients(
        &traced,
        &arg_buffers(&traced, &rounded_to_bf16(&values), DType::F64),
    );
    let mut worst = (0.0f64, "");
    for (ri, row) in rows.iter().enumerate() {
        for (gi, (g16, g64)) in ad16[ri].iter().zip(&ad_rounded[ri]).enumerate() {
            // A gradient summed from terms of order one keeps ~2^-9 of their size in bf16, so
            // one that cancels to near zero is compared absolutely, below 5e-2.
            let scale = g64.iter().fold(5e-2f64, |m, x| m.max(x.abs()));
            let err = g16.iter().zip(g64).fold(0.0f64, |m, (x, y)| m.max((x - y).abs())) / scale;
            if err > worst.0 {
                worst = (err, row.name);
            }
            if err > BF16_BOUND || err.is_nan() {
                failures.push(format!(
                    "{} gradient {gi}: bf16 relative error {err:.2e}",
                    row.name
                ));
            }
        }
    }
    eprintln!("bf16: worst relative error {:.2e} ({})", worst.0, worst.1);
    assert!(
        failures.is_empty(),
        "bf16 gradient check failures:\n{}",
        failures.join("\n")
    );
}

/// VJP rules are written with traced ops, so gradients can be differentiated again: a
/// Hessian-vector product against finite differences of the gradient.
#[test]
fn second_derivatives_match_finite_differences() {
    let g = Graph::new("hvp");
    let x = g.parameter("x", DType::F64, &[5]);
    let v = g.parameter("v", DType::F64, &[5]);
    let w = g.parameter("w", DType::F64, &[5, 5]);
    let y = x.reshape(&[1, 5]).matmul(&w).reshape(&[5]);
    let f = (&(&y.tanh() * &x) * &x).sum_all() + x.softmax(0).log().sum_all();
    let gx = grad(&f, &[&x]).unwrap().remove(0);
    let hv = grad(&(&gx * &v).sum_all(), &[&x]).unwrap().remove(0);
    let exe = graph_support::compile(&g.build(&[&gx, &hv]).unwrap());
    let mut r = rng("hvp");
    let xs = graph_support::uniform(&mut r, 5, -1.0, 1.0);
    let vs = graph_support::uniform(&mut r, 5, -1.0, 1.0);
    let ws = graph_support::uniform(&mut r, 25, -1.0, 1.0);
    let (bv, bw) = (upload(&vs, &[5]), upload(&ws, &[5, 5]));
    let eval = |delta: f64| {
        let p: Vec<f64> = xs.iter().zip(&vs).map(|(a, b)| a + delta * b).collect();
        let out = exe.execute(&[&upload(&p, &[5]), &bv, &bw]).unwrap();
        (read::<f64>(&out[0]), read::<f64>(&out[1]))
    };
    let eps = 1e-5;
    let (_, hv_ad) = eval(0.0);
    let (gp, _) = eval(eps);
    let (gm, _) = eval(-eps);
    let hv_fd: Vec<f64> = gp.iter().zip(&gm).map(|(a, b)| (a - b) / (2.0 * eps)).collect();
    let scale = hv_fd.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
    let err = hv_ad
        .iter()
        .zip(&hv_fd)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()))
        / scale;
    assert!(
        err <= 1e-5,
        "Hessian-vector product: relative error {err:.2e}\n ad {hv_ad:?}\n fd {hv_fd:?}"
    );
}
