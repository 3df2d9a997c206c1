//! Reverse-mode automatic differentiation over the recorded graph.
//!
//! The gradient is traced into the same graph: walking the nodes from the outputs back to the
//! requested inputs, each primitive's VJP rule (in `ops.rs`) turns result cotangents into
//! operand cotangents, which are summed where a value is used more than once. Only nodes that
//! both depend on a requested input and lead to an output are visited. Integer and boolean
//! values carry no gradient; asking for one is an error.
//!
//! A rematerialised region ([`Graph::checkpoint`]) is recomputed when the walk first reaches
//! one of its nodes: its nodes are traced again from its inputs (passed, with the cotangents
//! held for its values at that point, through one optimization barrier), and the VJP rules of
//! its nodes read the recomputed values. Cotangents stay keyed by the original values.

use std::collections::HashMap;
use std::ops::Range;
use std::panic::Location;

use crate::graph::builder::{Graph, Node, Tensor};
use crate::graph::ops::Op;
use crate::graph::value::ValueRef;
use crate::graph::GraphError;

fn grad_error(message: String, loc: &'static Location<'static>) -> GraphError {
    GraphError::Grad {
        message,
        location: loc.to_string(),
    }
}

fn common_graph(ts: &[&Tensor], loc: &'static Location<'static>) -> Result<Graph, GraphError> {
    let first = ts
        .first()
        .ok_or_else(|| grad_error("nothing to differentiate".to_string(), loc))?;
    let g = first.graph().clone();
    if ts.iter().any(|t| !t.graph().same(&g)) {
        return Err(grad_error("tensors from different graphs".to_string(), loc));
    }
    g.check()?;
    Ok(g)
}

/// Vector-Jacobian product: the cotangents of `wrt` given cotangents for `outputs` (one each,
/// same types). Inputs that do not influence the outputs get zeros.
#[track_caller]
pub fn vjp(outputs: &[&Tensor], cotangents: &[&Tensor], wrt: &[&Tensor]) -> Result<Vec<Tensor>, GraphError> {
    let loc = Location::caller();
    let all: Vec<&Tensor> = outputs.iter().chain(cotangents).chain(wrt).copied().collect();
    let graph = common_graph(&all, loc)?;
    if outputs.len() != cotangents.len() {
        return Err(grad_error(
            format!("{} outputs but {} cotangents", outputs.len(), cotangents.len()),
            loc,
        ));
    }
    for (i, (o, c)) in outputs.iter().zip(cotangents).enumerate() {
        if o.ty() != c.ty() {
            return Err(grad_error(
                format!("cotangent {i} is {} but output {i} is {}", c.ty(), o.ty()),
                loc,
            ));
        }
        if !o.dtype().is_float() {
            return Err(grad_error(
                format!(
                    "output {i} is {}: only floating-point outputs have gradients",
                    o.ty()
                ),
                loc,
            ));
        }
    }
    for (i, w) in wrt.iter().enumerate() {
        if !w.dtype().is_float() {
            return Err(grad_error(
                format!(
                    "input {i} ({}) is not floating point: integer and boolean values carry no gradient",
                    w.ty()
                ),
                loc,
            ));
        }
    }

    let (n, nodes, regions) = {
        let inner = graph.inner.borrow();
        (inner.nodes.len(), inner.nodes.clone(), inner.remat.clone())
    };
    let region_of = |id: usize| regions.iter().position(|r| r.contains(&id));
    // Region index -> (original value -> recomputed value), filled on first use.
    let mut recomputed: HashMap<usize, HashMap<ValueRef, ValueRef>> = HashMap::new();
    // Which nodes depend (differentiably) on a requested input.
    let mut depends = vec![false; n];
    for w in wrt {
        depends[w.value.node] = true;
    }
    let start = wrt.iter().map(|w| w.value.node).min().unwrap_or(n);
    for id in start..n {
        if !depends[id]
            && nodes[id].op.is_differentiable()
            && nodes[id].inputs.iter().any(|v| depends[v.node])
        {
            depends[id] = true;
        }
    }

    let mut cts: HashMap<ValueRef, Tensor> = HashMap::new();
    let accumulate = |cts: &mut HashMap<ValueRef, Tensor>, v: ValueRef, t: Tensor| {
        let sum = match cts.remove(&v) {
            Some(prev) => &prev + &t,
            None => t,
        };
        cts.insert(v, sum);
    };
    for (o, c) in outputs.iter().zip(cotangents) {
        accumulate(&mut cts, o.value, (*c).clone());
    }
    let wanted: Vec<ValueRef> = wrt.iter().map(|w| w.value).collect();

    let end = outputs.iter().map(|o| o.value.node + 1).max().unwrap_or(0);
    for id in (start..end).rev() {
        if !depends[id] || !nodes[id].op.is_differentiable() {
            continue;
        }
        let node = &nodes[id];
        let refs: Vec<ValueRef> = (0..node.outputs.len())
            .map(|output| ValueRef { node: id, output })
            .collect();
        if refs.iter().all(|r| !cts.contains_key(r)) {
            continue;
        }
        let remap = region_of(id).map(|r| {
            &*recomputed
                .entry(r)
                .or_insert_with(|| recompute(&graph, &nodes, regions[r].clone(), &cts, loc))
        });
        let value = |v: ValueRef| graph.tensor(remap.and_then(|m| m.get(&v)).copied().unwrap_or(v));
        let ys: Vec<Tensor> = refs.iter().map(|r| value(*r)).collect();
        // A requested value keeps its cotangent; others hand theirs on and drop it.
        let gs: Vec<Tensor> = refs
            .iter()
            .zip(&ys)
            .map(|(r, y)| {
                let c = if wanted.contains(r) {
                    cts.get(r).cloned()
                } else {
                    cts.remove(r)
                };
                c.unwrap_or_else(|| y.zeros_like())
            })
            .collect();
        let xs: Vec<Tensor> = node.inputs.iter().map(|v| value(*v)).collect();
        let contributions = node.op.vjp(&xs, &ys, &gs);
        for ((x, original), c) in xs.iter().zip(&node.inputs).zip(contributions) {
            let Some(c) = c else { continue };
            if !depends[original.node] || !x.dtype().is_float() {
                continue;
            }
            if c.ty() != x.ty() {
                return Err(grad_error(
                    format!(
                        "internal: the VJP of {} gave a {} cotangent for a {} operand",
                        node.op.name(),
                        c.ty(),
                        x.ty()
                    ),
                    loc,
                ));
            }
            accumulate(&mut cts, *original, c);
        }
    }
    graph.check()?;
    Ok(wrt
        .iter()
        .map(|w| cts.get(&w.value).cloned().unwrap_or_else(|| w.zeros_like()))
        .collect())
}

/// Traces the nodes of `region` again and returns original value -> recomputed value. The
/// region's inputs from earlier nodes and parameters (not constants and iotas, which are
/// reused as they are) enter through one optimization barrier together with the
/// cotangents `cts` holds for the region's values, which orders the recomputation after the
/// backward pass has reached the region.
fn recompute(
    graph: &Graph,
    nodes: &[Node],
    region: Range<usize>,
    cts: &HashMap<ValueRef, Tensor>,
    loc: &'static Location<'static>,
) -> HashMap<ValueRef, ValueRef> {
    let mut inputs: Vec<ValueRef> = Vec::new();
    for node in &nodes[region.clone()] {
        for v in &node.inputs {
            let constant =
                nodes[v.node].inputs.is_empty() && !matches!(nodes[v.node].op, Op::Parameter { .. });
            if !region.contains(&v.node) && !constant && !inputs.contains(v) {
                inputs.push(*v);
            }
        }
    }
    let mut held: Vec<&Tensor> = cts
        .iter()
        .filter(|(v, _)| region.contains(&v.node))
        .map(|(_, t)| t)
        .collect();
    held.sort_by_key(|t| t.value);
    let originals: Vec<Tensor> = inputs.iter().map(|v| graph.tensor(*v)).collect();
    let mut barrier_in: Vec<&Tensor> = originals.iter().collect();
    barrier_in.extend(held);
    let through = graph.optimization_barrier(&barrier_in);
    let mut map: HashMap<ValueRef, ValueRef> =
        inputs.iter().zip(&through).map(|(v, t)| (*v, t.value)).collect();
    for id in region {
        graph.replay(id, &nodes[id], &mut map, loc);
    }
    map
}

impl Graph {
    /// Traces `node` (recorded as `id`) again on its operands renamed by `map` (others kept)
    /// and maps its results to the new values. Constants and iotas (no operands) are not
    /// traced again: the originals serve.
    pub(crate) fn replay(
        &self,
        id: usize,
        node: &Node,
        map: &mut HashMap<ValueRef, ValueRef>,
        loc: &'static Location<'static>,
    ) {
        if node.inputs.is_empty() {
            return;
        }
        let args: Vec<Tensor> = node
            .inputs
            .iter()
            .map(|v| self.tensor(map.get(v).copied().unwrap_or(*v)))
            .collect();
        let arg_refs: Vec<&Tensor> = args.iter().collect();
        let outs = match &node.op {
            // Built directly (variadic), as `Graph::optimization_barrier` does.
            Op::OptimizationBarrier => self.optimization_barrier(&arg_refs),
            op => self.add(op.clone(), &arg_refs, loc),
        };
        for (output, t) in outs.iter().enumerate() {
            map.insert(ValueRef { node: id, output }, t.value);
        }
    }
}

/// The gradient of a scalar floating-point `loss` with respect to each of `wrt`.
#[track_caller]
pub fn grad(loss: &Tensor, wrt: &[&Tensor]) -> Result<Vec<Tensor>, GraphError> {
    let loc = Location::caller();
    if loss.rank() != 0 {
        return Err(grad_error(
            format!("the loss must be a scalar, got {}", loss.ty()),
            loc,
        ));
    }
    let seed = loss.ones_like();
    vjp(&[loss], &[&seed], wrt)
}

/// Calls `f(args)` to trace a scalar loss and returns it with its gradient with respect to
/// `args[i]` for each `i` in `wrt` (in that order).
#[track_caller]
pub fn value_and_grad<F>(f: F, args: &[Tensor], wrt: &[usize]) -> Result<(Tensor, Vec<Tensor>), GraphError>
where
    F: FnOnce(&[Tensor]) -> Tensor,
{
    let loc = Location::caller();
    let mut targets = Vec::with_capacity(wrt.len());
    for &i in wrt {
        match args.get(i) {
            Some(t) => targets.push(t),
            None => {
                return Err(grad_error(
                    format!("wrt index {i} is out of range for {} arguments", args.len()),
                    loc,
                ))
            }
        }
    }
    let loss = f(args);
    let loss_loc = loc;
    if loss.rank() != 0 {
        return Err(grad_error(
            format!("the loss must be a scalar, got {}", loss.ty()),
            loss_loc,
        ));
    }
    let seed = loss.ones_like();
    let grads = vjp(&[&loss], &[&seed], &targets)?;
    Ok((loss, grads))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    #[test]
    fn integer_inputs_are_refused_with_a_clear_message() {
        let g = Graph::new("t");
        let x = g.parameter("x", DType::F32, &[3]);
        let i = g.parameter("i", DType::I32, &[3]);
        let loss = (&x * &i.convert(DType::F32)).sum_all();
        let err = grad(&loss, &[&i]).unwrap_err().to_string();
        assert!(
            err.contains("integer and boolean values carry no gradient"),
            "{err}"
        );
        assert!(err.contains("i32[3]"), "{err}");
        let err = grad(&x, &[&x]).unwrap_err().to_string();
        assert!(err.contains("the loss must be a scalar, got f32[3]"), "{err}");
    }

    #[test]
    fn unused_inputs_get_zero_and_shared_values_accumulate() {
        let g = Graph::new("t");
        let x = g.parameter("x", DType::F32, &[3]);
        let y = g.parameter("y", DType::F32, &[3]);
        let loss = (&x * &x).sum_all();
        let gr = grad(&loss, &[&x, &y]).unwrap();
        assert_eq!(gr[0].dims(), &[3]);
        assert_eq!(gr[1].dims(), &[3]);
        let (l, gs) = value_and_grad(|a| (&a[0] * 3.0).sum_all(), &[x.clone(), y], &[0]).unwrap();
        assert_eq!(l.rank(), 0);
        assert_eq!(gs.len(), 1);
    }
}
