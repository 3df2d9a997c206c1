//! The recording graph: nodes (one primitive each), traced [`Tensor`] handles, parameters,
//! constants and the first-error bookkeeping.
//!
//! Ops never panic on bad shapes or dtypes: the first error is recorded in the graph (naming the
//! op, the shapes and the caller's source location) and returned by [`Graph::build`] or
//! [`Graph::check`]. The tensor returned by a failed op is a placeholder so that tracing code can
//! continue without `?` on every line.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::panic::Location;
use std::rc::Rc;

use crate::dtype::DType;
use crate::graph::ops::{Literal, LiteralValues, Op};
use crate::graph::sharding::{Mesh, Sharding};
use crate::graph::value::{TensorType, ValueRef};
use crate::graph::GraphError;

/// A recorded primitive application.
#[derive(Clone, Debug)]
pub(crate) struct Node {
    pub op: Op,
    pub inputs: Vec<ValueRef>,
    pub outputs: Vec<TensorType>,
}

/// A program argument.
#[derive(Clone, Debug)]
pub(crate) struct ParamInfo {
    pub name: String,
    pub node: usize,
    pub sharding: Option<Sharding>,
}

pub(crate) struct GraphInner {
    pub name: String,
    pub nodes: Vec<Node>,
    pub params: Vec<ParamInfo>,
    pub error: Option<GraphError>,
    pub mesh: Option<Mesh>,
    /// Splat constants already recorded, so each distinct one appears once in the program.
    pub const_cache: HashMap<(DType, Vec<i64>, String), ValueRef>,
    /// Rematerialised regions ([`Graph::checkpoint`]): node ranges, in order, disjoint.
    pub remat: Vec<std::ops::Range<usize>>,
    /// True while a [`Graph::checkpoint`] closure runs (an inner one joins the outer region).
    pub in_checkpoint: bool,
}

/// A graph under construction. Cheap to clone (shared handle); used from one thread.
#[derive(Clone)]
pub struct Graph {
    pub(crate) inner: Rc<RefCell<GraphInner>>,
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = self.inner.borrow();
        write!(f, "Graph({:?}, {} nodes)", g.name, g.nodes.len())
    }
}

/// A traced value: a handle to one output of a node in a [`Graph`], with its static type.
#[derive(Clone)]
pub struct Tensor {
    pub(crate) graph: Graph,
    pub(crate) value: ValueRef,
    pub(crate) ty: TensorType,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor(%{}#{}: {})",
            self.value.node, self.value.output, self.ty
        )
    }
}

impl Graph {
    /// A new empty graph; `name` becomes the MLIR module name (non-identifier characters are
    /// replaced by `_`).
    pub fn new(name: &str) -> Graph {
        let mut clean: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        if clean.is_empty() || clean.starts_with(|c: char| c.is_ascii_digit()) {
            clean.insert(0, 'g');
        }
        Graph {
            inner: Rc::new(RefCell::new(GraphInner {
                name: clean,
                nodes: Vec::new(),
                params: Vec::new(),
                error: None,
                mesh: None,
                const_cache: HashMap::new(),
                remat: Vec::new(),
                in_checkpoint: false,
            })),
        }
    }

    /// The module name.
    pub fn name(&self) -> String {
        self.inner.borrow().name.clone()
    }

    pub(crate) fn same(&self, other: &Graph) -> bool {
        Rc::ptr_eq(&self.inner, &other.inner)
    }

    /// The first error recorded while tracing, if any.
    pub fn error(&self) -> Option<GraphError> {
        self.inner.borrow().error.clone()
    }

    /// `Ok` while no op has failed; otherwise the first error.
    pub fn check(&self) -> Result<(), GraphError> {
        match self.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Records `err` unless an earlier error is already recorded.
    pub(crate) fn record_error(&self, err: GraphError) {
        let mut g = self.inner.borrow_mut();
        if g.error.is_none() {
            g.error = Some(err);
        }
    }

    /// Records an op error at `loc`.
    pub(crate) fn op_error(&self, op: &str, message: String, loc: &'static Location<'static>) {
        self.record_error(GraphError::Op {
            op: op.to_string(),
            message,
            location: loc.to_string(),
        });
    }

    /// Number of nodes recorded so far.
    pub fn num_nodes(&self) -> usize {
        self.inner.borrow().nodes.len()
    }

    /// Traces `f` as a rematerialised region (JAX's `jax.checkpoint`): the backward pass
    /// ([`crate::graph::vjp`]) recomputes what `f` computes from the region's inputs instead of
    /// keeping those values alive from the forward pass, trading a second forward of the
    /// region for its activations' memory. The recomputation reads its inputs through an
    /// optimization barrier that also holds the region's incoming cotangents, so XLA neither
    /// merges it with the forward values nor hoists it before the backward pass reaches the
    /// region. A checkpoint inside another joins the outer region.
    pub fn checkpoint<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.inner.borrow().in_checkpoint {
            return f();
        }
        let start = {
            let mut g = self.inner.borrow_mut();
            g.in_checkpoint = true;
            g.nodes.len()
        };
        let out = f();
        let mut g = self.inner.borrow_mut();
        g.in_checkpoint = false;
        let end = g.nodes.len();
        if end > start {
            g.remat.push(start..end);
        }
        out
    }

    /// Declares the device mesh of an SPMD program. Parameters without an explicit sharding
    /// are then replicated.
    pub fn set_mesh(&self, mesh: Mesh) {
        self.inner.borrow_mut().mesh = Some(mesh);
    }

    /// The declared mesh, if any.
    pub fn mesh(&self) -> Option<Mesh> {
        self.inner.borrow().mesh.clone()
    }

    /// A program argument with the given name (for messages), element type and global shape.
    /// Arguments are numbered in the order they are declared.
    #[track_caller]
    pub fn parameter(&self, name: &str, dtype: DType, dims: &[i64]) -> Tensor {
        self.parameter_inner(name, dtype, dims, None, Location::caller())
    }

    /// A program argument laid out over the mesh (see [`Graph::set_mesh`]); `dims` is the
    /// global shape, each device passes its local shard.
    #[track_caller]
    pub fn parameter_sharded(&self, name: &str, dtype: DType, dims: &[i64], sharding: Sharding) -> Tensor {
        self.parameter_inner(name, dtype, dims, Some(sharding), Location::caller())
    }

    fn parameter_inner(
        &self,
        name: &str,
        dtype: DType,
        dims: &[i64],
        sharding: Option<Sharding>,
        loc: &'static Location<'static>,
    ) -> Tensor {
        if let Some(d) = dims.iter().find(|d| **d < 0) {
            self.op_error(
                "parameter",
                format!("{name:?} has a negative dimension {d} in {dims:?}"),
                loc,
            );
        }
        let index = self.inner.borrow().params.len();
        let ty = TensorType::new(dtype, &dims.iter().map(|d| (*d).max(0)).collect::<Vec<_>>());
        let t = self
            .push_node(Op::Parameter { index }, Vec::new(), vec![ty])
            .remove(0);
        self.inner.borrow_mut().params.push(ParamInfo {
            name: name.to_string(),
            node: t.value.node,
            sharding,
        });
        t
    }

    /// The declared parameters, in argument order.
    pub fn parameters(&self) -> Vec<Tensor> {
        let g = self.inner.borrow();
        g.params
            .iter()
            .map(|p| Tensor {
                graph: self.clone(),
                value: ValueRef {
                    node: p.node,
                    output: 0,
                },
                ty: g.nodes[p.node].outputs[0].clone(),
            })
            .collect()
    }

    /// Appends a node without checks and returns handles to its outputs.
    pub(crate) fn push_node(&self, op: Op, inputs: Vec<ValueRef>, outputs: Vec<TensorType>) -> Vec<Tensor> {
        let mut g = self.inner.borrow_mut();
        let node = g.nodes.len();
        let tys = outputs.clone();
        g.nodes.push(Node { op, inputs, outputs });
        drop(g);
        tys.into_iter()
            .enumerate()
            .map(|(output, ty)| Tensor {
                graph: self.clone(),
                value: ValueRef { node, output },
                ty,
            })
            .collect()
    }

    /// Adds a primitive after checking its shape/dtype rule. On failure the error is recorded
    /// and placeholder outputs are returned.
    pub(crate) fn add(&self, op: Op, inputs: &[&Tensor], loc: &'static Location<'static>) -> Vec<Tensor> {
        for t in inputs {
            if !t.graph.same(self) {
                self.op_error(
                    op.name(),
                    format!(
                        "operand {t:?} belongs to graph {:?}, not to {:?}",
                        t.graph.name(),
                        self.name()
                    ),
                    loc,
                );
                return self.poison(&op, inputs);
            }
        }
        let types: Vec<&TensorType> = inputs.iter().map(|t| &t.ty).collect();
        match op.infer(&types) {
            Ok(outputs) => self.push_node(op, inputs.iter().map(|t| t.value).collect(), outputs),
            Err(message) => {
                let shapes: Vec<String> = types.iter().map(|t| t.to_string()).collect();
                self.op_error(
                    op.name(),
                    format!("{message} (operands: {})", shapes.join(", ")),
                    loc,
                );
                self.poison(&op, inputs)
            }
        }
    }

    /// Like [`Graph::add`] for single-output primitives.
    pub(crate) fn add1(&self, op: Op, inputs: &[&Tensor], loc: &'static Location<'static>) -> Tensor {
        self.add(op, inputs, loc).remove(0)
    }

    fn poison(&self, op: &Op, inputs: &[&Tensor]) -> Vec<Tensor> {
        let ty = op
            .fallback_type()
            .or_else(|| inputs.first().map(|t| t.ty.clone()))
            .unwrap_or_else(|| TensorType::new(DType::F32, &[]));
        let n = op.num_outputs();
        self.push_node(Op::Poison, Vec::new(), vec![ty; n])
    }

    /// A constant of the given type with every element equal to `value` (emitted as one splat
    /// constant; identical splats are shared).
    #[track_caller]
    pub fn full(&self, value: f64, dtype: DType, dims: &[i64]) -> Tensor {
        let lit = Literal::splat(value, dtype);
        let key = (dtype, dims.to_vec(), lit.key());
        if let Some(v) = self.inner.borrow().const_cache.get(&key) {
            return Tensor {
                graph: self.clone(),
                value: *v,
                ty: TensorType::new(dtype, dims),
            };
        }
        let t = self.add1(
            Op::Constant {
                literal: lit,
                dims: dims.to_vec(),
            },
            &[],
            Location::caller(),
        );
        self.inner.borrow_mut().const_cache.insert(key, t.value);
        t
    }

    /// A scalar constant.
    #[track_caller]
    pub fn scalar(&self, value: f64, dtype: DType) -> Tensor {
        self.full(value, dtype, &[])
    }

    /// Zeros of the given type.
    #[track_caller]
    pub fn zeros(&self, dtype: DType, dims: &[i64]) -> Tensor {
        self.full(0.0, dtype, dims)
    }

    /// Ones of the given type.
    #[track_caller]
    pub fn ones(&self, dtype: DType, dims: &[i64]) -> Tensor {
        self.full(1.0, dtype, dims)
    }

    /// A small dense constant from f64 values (converted to `dtype`), row-major.
    #[track_caller]
    pub fn constant_f64(&self, values: &[f64], dtype: DType, dims: &[i64]) -> Tensor {
        self.add1(
            Op::Constant {
                literal: Literal::dense_f64(values, dtype),
                dims: dims.to_vec(),
            },
            &[],
            Location::caller(),
        )
    }

    /// A small dense integer constant (`dtype` an integer or bool type), row-major.
    #[track_caller]
    pub fn constant_i64(&self, values: &[i64], dtype: DType, dims: &[i64]) -> Tensor {
        self.add1(
            Op::Constant {
                literal: Literal::dense_i64(values, dtype),
                dims: dims.to_vec(),
            },
            &[],
            Location::caller(),
        )
    }

    /// `0, 1, 2, ...` along dimension `dim` of a tensor of the given type.
    #[track_caller]
    pub fn iota(&self, dtype: DType, dims: &[i64], dim: usize) -> Tensor {
        self.add1(
            Op::Iota {
                dtype,
                dims: dims.to_vec(),
                dim,
            },
            &[],
            Location::caller(),
        )
    }

    /// The names of the primitives recorded in nodes `range` (node numbers as counted by
    /// [`Graph::num_nodes`]); for introspection and coverage tests.
    pub fn op_names(&self, range: std::ops::Range<usize>) -> Vec<&'static str> {
        let g = self.inner.borrow();
        let end = range.end.min(g.nodes.len());
        g.nodes[range.start.min(end)..end]
            .iter()
            .map(|n| n.op.name())
            .collect()
    }

    /// The value of every element when `t` is a splat constant.
    pub(crate) fn splat_value(&self, t: &Tensor) -> Option<f64> {
        if !t.graph.same(self) {
            return None;
        }
        match &self.inner.borrow().nodes[t.value.node].op {
            Op::Constant {
                literal:
                    Literal {
                        values: LiteralValues::Splat(v),
                        ..
                    },
                ..
            } => Some(*v),
            _ => None,
        }
    }

    /// Handle for a value already in the graph.
    pub(crate) fn tensor(&self, value: ValueRef) -> Tensor {
        let ty = self.inner.borrow().nodes[value.node].outputs[value.output].clone();
        Tensor {
            graph: self.clone(),
            value,
            ty,
        }
    }
}

impl Tensor {
    /// The graph this tensor was traced in.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The static type.
    pub fn ty(&self) -> &TensorType {
        &self.ty
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }

    /// Dimensions.
    pub fn dims(&self) -> &[i64] {
        &self.ty.dims
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.ty.dims.len()
    }

    /// Number of elements.
    pub fn num_elements(&self) -> i64 {
        self.ty.num_elements()
    }

    /// Resolves a possibly negative axis (`-1` = last) against this tensor's rank. An axis out
    /// of range is recorded as an error naming `op`, and 0 is returned so tracing can go on.
    #[track_caller]
    pub fn axis(&self, op: &str, axis: i64) -> usize {
        let r = self.rank() as i64;
        let a = if axis < 0 { axis + r } else { axis };
        if a < 0 || a >= r {
            self.graph.op_error(
                op,
                format!("axis {axis} is out of range for shape {}", self.ty),
                Location::caller(),
            );
            0
        } else {
            a as usize
        }
    }

    /// The size of dimension `axis` (negative counts from the end); 1 (with a recorded error)
    /// when out of range.
    #[track_caller]
    pub fn dim(&self, axis: i64) -> i64 {
        let r = self.rank() as i64;
        let a = if axis < 0 { axis + r } else { axis };
        if a < 0 || a >= r {
            self.graph.op_error(
                "dim",
                format!("axis {axis} is out of range for shape {}", self.ty),
                Location::caller(),
            );
            1
        } else {
            self.ty.dims[a as usize]
        }
    }
}
