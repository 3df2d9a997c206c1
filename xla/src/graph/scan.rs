//! Loops over the leading axis of stacked values ([`Graph::scan`], JAX's `lax.scan`), emitted
//! as one `stablehlo.while`: XLA compiles the body once however many iterations run, which is
//! what keeps a deep model's programs compiling in time independent of its depth.
//!
//! The body is traced once into the same graph, between placeholder nodes for its arguments
//! ([`Op::LoopArg`]) and the [`Op::Scan`] node that closes it; [`ScanBody`] records which nodes
//! those are. The body may read any earlier value of the graph: such captures become loop
//! operands passed through unchanged (constants and iotas are re-emitted inside instead).
//!
//! Reverse mode saves only what enters each iteration (the carry; the stacked inputs are kept
//! anyway) and the backward scan re-traces the body from it and differentiates that, JAX's
//! `scan` under a full `checkpoint` policy: activations cost one iteration's worth, at the
//! price of a second forward of the body.

use std::collections::HashMap;
use std::ops::Range;
use std::panic::Location;

use crate::graph::builder::{Graph, Node, Tensor};
use crate::graph::ops::Op;
use crate::graph::ops::ScanBody;
use crate::graph::value::{TensorType, ValueRef};

impl ScanBody {
    /// Number of per-iteration outputs.
    pub(crate) fn num_ys(&self) -> usize {
        self.results.len() - self.carry
    }

    /// Whether a node is a constant the body re-emits rather than captures.
    pub(crate) fn is_constant(op: &Op) -> bool {
        matches!(op, Op::Constant { .. } | Op::Iota { .. })
    }

    /// The ranges of scans nested directly or deeper in this body (their nodes belong to
    /// them, not to this body's own trace).
    pub(crate) fn nested(&self, nodes: &[Node]) -> Vec<Range<usize>> {
        nodes[self.nodes.clone()]
            .iter()
            .filter_map(|n| match &n.op {
                Op::Scan(b) => Some(b.nodes.clone()),
                _ => None,
            })
            .collect()
    }
}

fn stacked(length: i64, t: &TensorType) -> TensorType {
    let mut dims = vec![length];
    dims.extend_from_slice(&t.dims);
    TensorType::new(t.dtype, &dims)
}

impl Graph {
    /// A loop over the leading axis of `xs` (each `[n, ...]`, one `n` for all, at least one
    /// input): `body(carry, slices)` returns the next carry (same types as `init`) and this
    /// iteration's outputs. Returns the final carry and the outputs stacked `[n, ...]` in
    /// iteration order (index `i` holds slice `i`'s output also when `reverse`).
    ///
    /// The body may use values traced before the call. Differentiable with respect to `init`,
    /// `xs` and those captured values (see the module notes for what reverse mode keeps).
    #[track_caller]
    pub fn scan(
        &self,
        init: &[Tensor],
        xs: &[Tensor],
        reverse: bool,
        body: impl FnOnce(&[Tensor], &[Tensor]) -> (Vec<Tensor>, Vec<Tensor>),
    ) -> (Vec<Tensor>, Vec<Tensor>) {
        let loc = Location::caller();
        let fail = |g: &Graph, message: String| {
            g.op_error("scan", message, loc);
            let carry = init.iter().map(|t| t.zeros_like()).collect();
            (carry, Vec::new())
        };
        if init.iter().chain(xs).any(|t| !t.graph.same(self)) {
            return fail(self, "operands from another graph".to_string());
        }
        let Some(length) = xs.first().and_then(|x| x.dims().first().copied()) else {
            return fail(
                self,
                "needs at least one stacked input of rank 1 or more".to_string(),
            );
        };
        if let Some(x) = xs.iter().find(|x| x.dims().first() != Some(&length)) {
            return fail(
                self,
                format!("stacked inputs differ in length: {length} and {}", x.ty()),
            );
        }
        if length < 1 {
            return fail(self, "needs at least one iteration".to_string());
        }
        let start = self.num_nodes();
        let args: Vec<Tensor> = init
            .iter()
            .map(|t| t.ty.clone())
            .chain(xs.iter().map(|x| TensorType::new(x.dtype(), &x.dims()[1..])))
            .enumerate()
            .map(|(index, ty)| {
                self.push_node(Op::LoopArg { index }, Vec::new(), vec![ty])
                    .remove(0)
            })
            .collect();
        // Splat constants recorded inside the body live in its scope only.
        let outer_constants = std::mem::take(&mut self.inner.borrow_mut().const_cache);
        let (carry, ys) = body(&args[..init.len()], &args[init.len()..]);
        self.inner.borrow_mut().const_cache = outer_constants;
        let end = self.num_nodes();
        for (i, (c, t)) in carry.iter().zip(init).enumerate() {
            if c.ty() != t.ty() {
                return fail(
                    self,
                    format!(
                        "the body returns carry {i} as {}, it entered as {}",
                        c.ty(),
                        t.ty()
                    ),
                );
            }
        }
        if carry.len() != init.len() || carry.iter().chain(&ys).any(|t| !t.graph.same(self)) {
            return fail(
                self,
                format!(
                    "the body must return {} carried values of this graph, it returned {}",
                    init.len(),
                    carry.len()
                ),
            );
        }
        let results: Vec<ValueRef> = carry.iter().chain(&ys).map(|t| t.value).collect();
        let captures = {
            let g = self.inner.borrow();
            let mut captures: Vec<ValueRef> = Vec::new();
            let reads = g.nodes[start..end]
                .iter()
                .flat_map(|n| n.inputs.iter().copied())
                .chain(results.iter().copied());
            for v in reads {
                if v.node < start && !ScanBody::is_constant(&g.nodes[v.node].op) && !captures.contains(&v) {
                    captures.push(v);
                }
            }
            captures
        };
        let mut outputs: Vec<TensorType> = init.iter().map(|t| t.ty.clone()).collect();
        outputs.extend(ys.iter().map(|y| stacked(length, &y.ty)));
        outputs.extend(init.iter().map(|t| stacked(length, &t.ty)));
        let mut inputs: Vec<ValueRef> = init.iter().chain(xs).map(|t| t.value).collect();
        inputs.extend(captures.iter().copied());
        let body = ScanBody {
            nodes: start..end,
            carry: init.len(),
            inputs: xs.len(),
            results,
            captures,
            length,
            reverse,
            outputs: outputs.clone(),
        };
        let mut outs = self.push_node(Op::Scan(Box::new(body)), inputs, outputs);
        outs.truncate(init.len() + ys.len());
        let ys = outs.split_off(init.len());
        (outs, ys)
    }

    /// Traces `body`'s nodes again with its arguments and captures replaced by `args` (carry
    /// then slices) and `captures`; returns the body's results.
    pub(crate) fn retrace(&self, body: &ScanBody, args: &[Tensor], captures: &[Tensor]) -> Vec<Tensor> {
        let loc = Location::caller();
        let nodes = self.inner.borrow().nodes.clone();
        let mut map: HashMap<ValueRef, ValueRef> = HashMap::new();
        for (j, a) in args.iter().enumerate() {
            map.insert(
                ValueRef {
                    node: body.nodes.start + j,
                    output: 0,
                },
                a.value,
            );
        }
        for (c, t) in body.captures.iter().zip(captures) {
            map.insert(*c, t.value);
        }
        let nested = body.nested(&nodes);
        let first = body.nodes.start + body.carry + body.inputs;
        for (id, node) in nodes.iter().enumerate().take(body.nodes.end).skip(first) {
            if !nested.iter().any(|r| r.contains(&id)) {
                self.replay(id, node, &mut map, loc);
            }
        }
        body.results
            .iter()
            .map(|v| self.tensor(map.get(v).copied().unwrap_or(*v)))
            .collect()
    }
}

/// The reverse-mode rule of [`Op::Scan`]: a scan in the other direction whose body re-traces
/// the forward body from the saved carry and slices and differentiates it. Its carry holds
/// the carry's cotangent, the captures' accumulated cotangents and the captures themselves;
/// its outputs are the stacked inputs' cotangents.
pub(crate) fn vjp(body: &ScanBody, x: &[Tensor], y: &[Tensor], g: &[Tensor]) -> Vec<Option<Tensor>> {
    let graph = x[0].graph().clone();
    let (nc, nx, ny) = (body.carry, body.inputs, body.num_ys());
    let init = &x[..nc];
    let xs = &x[nc..nc + nx];
    let caps = &x[nc + nx..];
    let saved = &y[nc + ny..nc + ny + nc];
    let differentiable = |t: &Tensor| t.dtype().is_float();
    if !init.iter().chain(&y[nc..nc + ny]).all(differentiable) {
        graph.op_error(
            "scan",
            "only scans whose carry and outputs are all floating point are differentiable".to_string(),
            Location::caller(),
        );
        return vec![None; x.len()];
    }
    let float_caps: Vec<usize> = (0..caps.len()).filter(|&k| differentiable(&caps[k])).collect();
    let float_xs: Vec<usize> = (0..nx).filter(|&k| differentiable(&xs[k])).collect();
    let mut back_init: Vec<Tensor> = g[..nc].to_vec();
    back_init.extend(float_caps.iter().map(|&k| caps[k].zeros_like()));
    back_init.extend(caps.iter().cloned());
    let mut back_xs: Vec<Tensor> = saved.to_vec();
    back_xs.extend(xs.iter().cloned());
    back_xs.extend(g[nc..nc + ny].iter().cloned());
    let nfc = float_caps.len();
    let (carry, ys) = graph.scan(&back_init, &back_xs, !body.reverse, |c, s| {
        let (ct_carry, rest) = c.split_at(nc);
        let (acc, caps_in) = rest.split_at(nfc);
        let (carry_in, rest) = s.split_at(nc);
        let (slices, ct_ys) = rest.split_at(nx);
        let args: Vec<Tensor> = carry_in.iter().chain(slices).cloned().collect();
        let results = graph.retrace(body, &args, caps_in);
        let mut wrt: Vec<&Tensor> = carry_in.iter().collect();
        wrt.extend(float_xs.iter().map(|&k| &slices[k]));
        wrt.extend(float_caps.iter().map(|&k| &caps_in[k]));
        let outs: Vec<&Tensor> = results.iter().collect();
        let cts: Vec<&Tensor> = ct_carry.iter().chain(ct_ys).collect();
        let grads = match crate::graph::autodiff::vjp(&outs, &cts, &wrt) {
            Ok(grads) => grads,
            Err(e) => {
                graph.record_error(e);
                wrt.iter().map(|t| t.zeros_like()).collect()
            }
        };
        let (d_carry, rest) = grads.split_at(nc);
        let (d_xs, d_caps) = rest.split_at(float_xs.len());
        let mut next: Vec<Tensor> = d_carry.to_vec();
        next.extend(acc.iter().zip(d_caps).map(|(a, d)| a + d));
        next.extend(caps_in.iter().cloned());
        (next, d_xs.to_vec())
    });
    let mut out: Vec<Option<Tensor>> = carry[..nc].iter().cloned().map(Some).collect();
    let mut d_xs = ys.into_iter();
    out.extend((0..nx).map(|k| if float_xs.contains(&k) { d_xs.next() } else { None }));
    let mut d_caps = carry[nc..nc + nfc].iter().cloned();
    out.extend((0..caps.len()).map(|k| {
        if float_caps.contains(&k) {
            d_caps.next()
        } else {
            None
        }
    }));
    out
}
