//! StableHLO emission: a [`Program`] is the MLIR text of `func.func public @main` in a
//! `module`, with argument attributes for donation (`tf.aliasing_output`) and Shardy shardings,
//! the argument/result types, and a stable fingerprint (sha256 of the text: the same graph
//! always gives the same text).
//!
//! Only nodes that lead to a result are emitted, in the order they were recorded; a node that
//! repeats an earlier one (same primitive, same operands) reuses its value.

use std::collections::{HashMap, HashSet};
use std::fmt::Write;
use std::ops::Range;

use sha2::{Digest, Sha256};

use crate::graph::builder::{Graph, Node, Tensor};
use crate::graph::ops::ScanBody;
use crate::graph::ops::{Literal, Op};
use crate::graph::sharding::{Mesh, Sharding};
use crate::graph::value::{TensorType, ValueRef};
use crate::graph::GraphError;

/// How to build a program beyond its results: donated arguments and result shardings.
#[derive(Clone, Debug, Default)]
pub struct BuildOptions {
    /// `(argument index, result index)`: the argument's buffer is donated and reused for that
    /// result (same type required). Parameters and optimizer state in a train step.
    pub donate: Vec<(usize, usize)>,
    /// Shardings of results (by index) in an SPMD program; others are replicated.
    pub result_shardings: Vec<(usize, Sharding)>,
}

impl BuildOptions {
    /// Donates each `(argument index, result index)` pair.
    pub fn donating(pairs: &[(usize, usize)]) -> BuildOptions {
        BuildOptions {
            donate: pairs.to_vec(),
            ..Default::default()
        }
    }
}

/// A compiled-ready StableHLO program.
#[derive(Clone, Debug)]
pub struct Program {
    name: String,
    mlir: String,
    arg_names: Vec<String>,
    arg_types: Vec<TensorType>,
    arg_shardings: Vec<Option<Sharding>>,
    result_types: Vec<TensorType>,
    result_shardings: Vec<Option<Sharding>>,
    donated_args: Vec<usize>,
    mesh: Option<Mesh>,
    fingerprint: String,
}

impl Program {
    /// The module name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The StableHLO module text.
    pub fn mlir(&self) -> &str {
        &self.mlir
    }

    /// sha256 of the text, in hex.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Argument names, as given to [`Graph::parameter`].
    pub fn arg_names(&self) -> &[String] {
        &self.arg_names
    }

    /// Argument types (global shapes for sharded arguments).
    pub fn arg_types(&self) -> &[TensorType] {
        &self.arg_types
    }

    /// Result types (global shapes).
    pub fn result_types(&self) -> &[TensorType] {
        &self.result_types
    }

    /// Argument shardings (`None` in a single-device program).
    pub fn arg_shardings(&self) -> &[Option<Sharding>] {
        &self.arg_shardings
    }

    /// Result shardings (`None` in a single-device program).
    pub fn result_shardings(&self) -> &[Option<Sharding>] {
        &self.result_shardings
    }

    /// Indices of donated arguments, ascending.
    pub fn donated_args(&self) -> &[usize] {
        &self.donated_args
    }

    /// 1, or the mesh size of an SPMD program.
    pub fn num_partitions(&self) -> usize {
        self.mesh.as_ref().map(|m| m.num_devices()).unwrap_or(1)
    }

    /// The mesh of an SPMD program.
    pub fn mesh(&self) -> Option<&Mesh> {
        self.mesh.as_ref()
    }

    /// The shape one device passes for argument `i` (its shard; the whole shape when
    /// replicated or single-device).
    pub fn local_arg_dims(&self, i: usize) -> Vec<i64> {
        local(
            &self.arg_types[i],
            self.arg_shardings[i].as_ref(),
            self.mesh.as_ref(),
        )
    }

    /// The shape one device receives for result `i`.
    pub fn local_result_dims(&self, i: usize) -> Vec<i64> {
        local(
            &self.result_types[i],
            self.result_shardings[i].as_ref(),
            self.mesh.as_ref(),
        )
    }

    /// Compile options for the runtime: partitions and donated arguments.
    pub fn compile_options(&self) -> crate::runtime::CompileOptions {
        crate::runtime::CompileOptions {
            num_partitions: self.num_partitions(),
            donated_args: self.donated_args.clone(),
        }
    }

    /// Compiles the program on `client` with [`Program::compile_options`].
    pub fn compile(
        &self,
        client: &crate::runtime::Client,
    ) -> crate::runtime::Result<crate::runtime::Executable> {
        client.compile(&self.mlir, &self.compile_options())
    }
}

fn local(ty: &TensorType, s: Option<&Sharding>, mesh: Option<&Mesh>) -> Vec<i64> {
    match (s, mesh) {
        (Some(s), Some(m)) => s.local_dims(&ty.dims, m),
        _ => ty.dims.clone(),
    }
}

fn build_error(message: String) -> GraphError {
    GraphError::Build(message)
}

/// Writes nodes as StableHLO statements, numbering values in emission order.
struct Emitter<'a> {
    program: &'a str,
    nodes: &'a [Node],
    mesh: Option<&'a Mesh>,
    /// Every value some node or result reads (a scan's unread outputs are not accumulated).
    used: HashSet<ValueRef>,
    counter: usize,
}

/// The names visible in one region: the function's body or a scan's loop body, which sees
/// outer values only through its block arguments (constants it re-emits).
#[derive(Default)]
struct Scope {
    names: HashMap<ValueRef, String>,
    /// Statements already emitted here, by primitive and operands (emitted once).
    emitted: HashMap<String, Vec<String>>,
    in_body: bool,
}

impl Emitter<'_> {
    fn fresh(&mut self) -> String {
        let k = self.counter;
        self.counter += 1;
        format!("%v{k}")
    }

    fn internal(&self, message: String) -> GraphError {
        build_error(format!("{}: internal: {message}", self.program))
    }

    /// Node ids that lead to `roots`, in recording order; within a scan body only its own nodes.
    fn live(&self, roots: impl Iterator<Item = ValueRef>, within: Option<&Range<usize>>) -> Vec<usize> {
        let mut live = HashSet::new();
        let mut stack: Vec<usize> = roots.map(|v| v.node).collect();
        while let Some(id) = stack.pop() {
            if within.is_some_and(|r| !r.contains(&id)) || !live.insert(id) {
                continue;
            }
            stack.extend(self.nodes[id].inputs.iter().map(|v| v.node));
        }
        let mut ids: Vec<usize> = live.into_iter().collect();
        ids.sort_unstable();
        ids
    }

    /// The name of `v` in `scope`; a loop body emits an outer constant where it is first read.
    fn value(
        &mut self,
        scope: &mut Scope,
        v: ValueRef,
        out: &mut String,
        indent: &str,
    ) -> Result<String, GraphError> {
        if !scope.names.contains_key(&v) {
            if !(scope.in_body && ScanBody::is_constant(&self.nodes[v.node].op)) {
                return Err(self.internal(format!("value %{}#{} is used out of its scope", v.node, v.output)));
            }
            self.node(scope, v.node, out, indent)?;
        }
        Ok(scope.names[&v].clone())
    }

    fn node(
        &mut self,
        scope: &mut Scope,
        id: usize,
        out: &mut String,
        indent: &str,
    ) -> Result<(), GraphError> {
        let node = &self.nodes[id];
        if scope.names.contains_key(&ValueRef { node: id, output: 0 }) {
            return Ok(());
        }
        match &node.op {
            Op::StopGradient => {
                let name = self.value(scope, node.inputs[0], out, indent)?;
                scope.names.insert(ValueRef { node: id, output: 0 }, name);
                return Ok(());
            }
            Op::Poison => return Err(self.internal("a failed op reached emission".to_string())),
            Op::Parameter { .. } | Op::LoopArg { .. } => {
                return Err(self.internal(format!("argument node {id} has no name in this scope")))
            }
            Op::ShardingConstraint(s) => {
                let ty = &self.nodes[node.inputs[0].node].outputs[node.inputs[0].output];
                let checked = match self.mesh {
                    Some(m) => s.validate(&ty.dims, m),
                    None => Err("the graph has no mesh (Graph::set_mesh)".to_string()),
                };
                checked.map_err(|e| {
                    build_error(format!("{}: sharding constraint on {ty}: {e}", self.program))
                })?;
            }
            Op::Scan(body) => return self.scan(scope, id, body, out, indent),
            _ => {}
        }
        let ins: Vec<String> = node
            .inputs
            .iter()
            .map(|v| self.value(scope, *v, out, indent))
            .collect::<Result<_, _>>()?;
        let in_tys: Vec<&TensorType> = node
            .inputs
            .iter()
            .map(|v| &self.nodes[v.node].outputs[v.output])
            .collect();
        let cse_key = format!("{:?}|{}", node.op, ins.join(","));
        let these = match scope.emitted.get(&cse_key) {
            Some(existing) => existing.clone(),
            None => {
                let v = self.fresh();
                let (result, these) = if node.outputs.len() == 1 {
                    (v.clone(), vec![v])
                } else {
                    (
                        format!("{v}:{}", node.outputs.len()),
                        (0..node.outputs.len()).map(|j| format!("{v}#{j}")).collect(),
                    )
                };
                let text = node.op.lower(&result, &ins, &in_tys, &node.outputs);
                let _ = writeln!(out, "{indent}{}", text.replace("\n  ", &format!("\n{indent}")));
                scope.emitted.insert(cse_key, these.clone());
                these
            }
        };
        for (output, name) in these.into_iter().enumerate() {
            scope.names.insert(ValueRef { node: id, output }, name);
        }
        Ok(())
    }

    /// A statement of `op` (single result) on named operands; returns the result's name.
    fn stmt(
        &mut self,
        op: Op,
        ins: &[(&str, &TensorType)],
        result: &TensorType,
        out: &mut String,
        indent: &str,
    ) -> String {
        let v = self.fresh();
        let names: Vec<String> = ins.iter().map(|(n, _)| n.to_string()).collect();
        let tys: Vec<&TensorType> = ins.iter().map(|(_, t)| *t).collect();
        let _ = writeln!(
            out,
            "{indent}{}",
            op.lower(&v, &names, &tys, std::slice::from_ref(result))
        );
        v
    }

    /// A scan as `stablehlo.while` over `[i, carry, accumulated outputs, inputs, captures]`.
    fn scan(
        &mut self,
        scope: &mut Scope,
        id: usize,
        body: &ScanBody,
        out: &mut String,
        indent: &str,
    ) -> Result<(), GraphError> {
        let node = &self.nodes[id];
        let ins: Vec<String> = node
            .inputs
            .iter()
            .map(|v| self.value(scope, *v, out, indent))
            .collect::<Result<_, _>>()?;
        let in_tys: Vec<TensorType> = node
            .inputs
            .iter()
            .map(|v| self.nodes[v.node].outputs[v.output].clone())
            .collect();
        let (nc, nx) = (body.carry, body.inputs);
        let ny = body.num_ys();
        let i32t = TensorType::new(crate::DType::I32, &[]);
        let int = |v: i64| Op::Constant {
            literal: Literal::splat(v as f64, crate::DType::I32),
            dims: vec![],
        };
        // Stacked results that something reads: the outputs (`nc..nc+ny`), the saved carries.
        let accumulated: Vec<usize> = (nc..nc + ny + nc)
            .filter(|&o| self.used.contains(&ValueRef { node: id, output: o }))
            .collect();
        let mut operands = vec![self.stmt(int(0), &[], &i32t, out, indent)];
        let mut types = vec![i32t.clone()];
        operands.extend(ins[..nc].iter().cloned());
        types.extend(in_tys[..nc].iter().cloned());
        for &o in &accumulated {
            let ty = &node.outputs[o];
            let zero = Op::Constant {
                literal: Literal::splat(0.0, ty.dtype),
                dims: ty.dims.clone(),
            };
            operands.push(self.stmt(zero, &[], ty, out, indent));
            types.push(ty.clone());
        }
        operands.extend(ins[nc..].iter().cloned());
        types.extend(in_tys[nc..].iter().cloned());
        let acc0 = 1 + nc;
        let xs0 = acc0 + accumulated.len();
        let caps0 = xs0 + nx;

        let w = self.fresh();
        let all_tys = types.iter().map(|t| t.mlir()).collect::<Vec<_>>().join(", ");
        let args = |prefix: &str| {
            types
                .iter()
                .enumerate()
                .map(|(j, t)| format!("{w}{prefix}{j}: {}", t.mlir()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let inner = format!("{indent}  ");
        let mut text = String::new();
        let _ = writeln!(
            text,
            "{indent}{w}:{} = \"stablehlo.while\"({}) ({{",
            types.len(),
            operands.join(", ")
        );
        let _ = writeln!(text, "{indent}^bb0({}):", args("_c"));
        let limit = self.stmt(int(body.length), &[], &i32t, &mut text, &inner);
        let more = self.fresh();
        let _ = writeln!(
            text,
            "{inner}{more} = stablehlo.compare LT, {w}_c0, {limit}, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>"
        );
        let _ = writeln!(text, "{inner}\"stablehlo.return\"({more}) : (tensor<i1>) -> ()");
        let _ = writeln!(text, "{indent}}}, {{");
        let _ = writeln!(text, "{indent}^bb0({}):", args("_b"));
        let arg = |j: usize| format!("{w}_b{j}");

        let mut local = Scope {
            in_body: true,
            ..Scope::default()
        };
        let i = arg(0);
        let index = if body.reverse {
            let last = self.stmt(int(body.length - 1), &[], &i32t, &mut text, &inner);
            self.stmt(
                Op::Binary(crate::graph::BinaryOp::Sub),
                &[(&last, &i32t), (&i, &i32t)],
                &i32t,
                &mut text,
                &inner,
            )
        } else {
            i.clone()
        };
        let zero = self.stmt(int(0), &[], &i32t, &mut text, &inner);
        let at = |rank: usize| -> Vec<(String, TensorType)> {
            let mut v = vec![(index.clone(), i32t.clone())];
            v.extend((1..rank).map(|_| (zero.clone(), i32t.clone())));
            v
        };
        for j in 0..nc {
            local.names.insert(
                ValueRef {
                    node: body.nodes.start + j,
                    output: 0,
                },
                arg(1 + j),
            );
        }
        for j in 0..nx {
            let stack = &types[xs0 + j];
            let mut sizes = stack.dims.clone();
            sizes[0] = 1;
            let one = TensorType::new(stack.dtype, &sizes);
            let mut operands = vec![(arg(xs0 + j), stack.clone())];
            operands.extend(at(stack.rank()));
            let refs: Vec<(&str, &TensorType)> = operands.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let slice = self.stmt(Op::DynamicSlice { sizes }, &refs, &one, &mut text, &inner);
            let ty = TensorType::new(stack.dtype, &stack.dims[1..]);
            let x = self.stmt(
                Op::Reshape {
                    dims: ty.dims.clone(),
                },
                &[(&slice, &one)],
                &ty,
                &mut text,
                &inner,
            );
            local.names.insert(
                ValueRef {
                    node: body.nodes.start + nc + j,
                    output: 0,
                },
                x,
            );
        }
        for (k, c) in body.captures.iter().enumerate() {
            local.names.insert(*c, arg(caps0 + k));
        }
        for id in self.live(body.results.iter().copied(), Some(&body.nodes)) {
            self.node(&mut local, id, &mut text, &inner)?;
        }
        let results: Vec<String> = body
            .results
            .iter()
            .map(|v| self.value(&mut local, *v, &mut text, &inner))
            .collect::<Result<_, _>>()?;
        let one = self.stmt(int(1), &[], &i32t, &mut text, &inner);
        let mut next = vec![self.stmt(
            Op::Binary(crate::graph::BinaryOp::Add),
            &[(&i, &i32t), (&one, &i32t)],
            &i32t,
            &mut text,
            &inner,
        )];
        next.extend(results[..nc].iter().cloned());
        for (a, &o) in accumulated.iter().enumerate() {
            // An output of this iteration, or the carry it started from.
            let (value, vty) = if o < nc + ny {
                (
                    results[o].clone(),
                    self.nodes[body.results[o].node].outputs[body.results[o].output].clone(),
                )
            } else {
                (arg(1 + o - nc - ny), types[1 + o - nc - ny].clone())
            };
            let acc_ty = &types[acc0 + a];
            let mut dims = vty.dims.clone();
            dims.insert(0, 1);
            let row_ty = TensorType::new(vty.dtype, &dims);
            let row = self.stmt(
                Op::Reshape { dims },
                &[(&value, &vty)],
                &row_ty,
                &mut text,
                &inner,
            );
            let mut operands = vec![(arg(acc0 + a), acc_ty.clone()), (row, row_ty)];
            operands.extend(at(acc_ty.rank()));
            let refs: Vec<(&str, &TensorType)> = operands.iter().map(|(n, t)| (n.as_str(), t)).collect();
            next.push(self.stmt(Op::DynamicUpdateSlice, &refs, acc_ty, &mut text, &inner));
        }
        next.extend((xs0..types.len()).map(arg));
        let _ = writeln!(
            text,
            "{inner}\"stablehlo.return\"({}) : ({all_tys}) -> ()",
            next.join(", ")
        );
        let _ = writeln!(text, "{indent}}}) : ({all_tys}) -> ({all_tys})");
        out.push_str(&text);

        for o in 0..node.outputs.len() {
            let j = if o < nc {
                Some(1 + o)
            } else {
                accumulated.iter().position(|&a| a == o).map(|a| acc0 + a)
            };
            if let Some(j) = j {
                scope
                    .names
                    .insert(ValueRef { node: id, output: o }, format!("{w}#{j}"));
            }
        }
        Ok(())
    }
}

impl Graph {
    /// Emits the program computing `outputs` (results in this order) from the parameters.
    pub fn build(&self, outputs: &[&Tensor]) -> Result<Program, GraphError> {
        self.build_with(outputs, &BuildOptions::default())
    }

    /// [`Graph::build`] with donation and result shardings.
    pub fn build_with(&self, outputs: &[&Tensor], options: &BuildOptions) -> Result<Program, GraphError> {
        self.check()?;
        let name = self.name();
        for (i, o) in outputs.iter().enumerate() {
            if !o.graph().same(self) {
                return Err(build_error(format!(
                    "{name}: result {i} was traced in graph {:?}",
                    o.graph().name()
                )));
            }
        }
        let inner = self.inner.borrow();
        let nodes = &inner.nodes;
        let params = &inner.params;
        let mesh = inner.mesh.clone();

        // Donation checks.
        let mut aliasing: Vec<Option<usize>> = vec![None; params.len()];
        let mut result_taken = vec![false; outputs.len()];
        for &(a, r) in &options.donate {
            let p = params.get(a).ok_or_else(|| {
                build_error(format!(
                    "{name}: donated argument {a} does not exist ({} arguments)",
                    params.len()
                ))
            })?;
            let o = outputs.get(r).ok_or_else(|| {
                build_error(format!(
                    "{name}: donation target result {r} does not exist ({} results)",
                    outputs.len()
                ))
            })?;
            let at = &nodes[p.node].outputs[0];
            if at != o.ty() {
                return Err(build_error(format!(
                    "{name}: argument {a} ({:?}, {at}) cannot be donated to result {r} of type {}",
                    p.name,
                    o.ty()
                )));
            }
            if aliasing[a].is_some() || result_taken[r] {
                return Err(build_error(format!(
                    "{name}: argument {a} or result {r} is donated twice"
                )));
            }
            aliasing[a] = Some(r);
            result_taken[r] = true;
        }

        // Sharding checks.
        let mut result_shardings: Vec<Option<Sharding>> = vec![None; outputs.len()];
        for (r, s) in &options.result_shardings {
            let o = outputs.get(*r).ok_or_else(|| {
                build_error(format!("{name}: sharding for result {r}, which does not exist"))
            })?;
            let m = mesh.as_ref().ok_or_else(|| {
                build_error(format!(
                    "{name}: result {r} has a sharding but the graph has no mesh (Graph::set_mesh)"
                ))
            })?;
            s.validate(o.dims(), m)
                .map_err(|e| build_error(format!("{name}: result {r}: {e}")))?;
            result_shardings[*r] = Some(s.clone());
        }
        let mut arg_shardings = Vec::new();
        for p in params.iter() {
            let ty = &nodes[p.node].outputs[0];
            match (&p.sharding, &mesh) {
                (Some(s), Some(m)) => s
                    .validate(&ty.dims, m)
                    .map_err(|e| build_error(format!("{name}: argument {:?}: {e}", p.name)))?,
                (Some(_), None) => {
                    return Err(build_error(format!(
                        "{name}: argument {:?} has a sharding but the graph has no mesh (Graph::set_mesh)",
                        p.name
                    )))
                }
                _ => {}
            }
            arg_shardings.push(p.sharding.clone());
        }
        if mesh.is_some() {
            for (i, s) in arg_shardings.iter_mut().enumerate() {
                if s.is_none() {
                    *s = Some(Sharding::replicated(nodes[params[i].node].outputs[0].rank()));
                }
            }
            for (i, s) in result_shardings.iter_mut().enumerate() {
                if s.is_none() {
                    *s = Some(Sharding::replicated(outputs[i].rank()));
                }
            }
        }

        let mut emitter = Emitter {
            program: &name,
            nodes,
            mesh: mesh.as_ref(),
            used: nodes
                .iter()
                .flat_map(|n| n.inputs.iter().copied())
                .chain(outputs.iter().map(|o| o.value))
                .collect(),
            counter: 0,
        };
        let mut top = Scope::default();
        for (index, p) in params.iter().enumerate() {
            top.names.insert(
                ValueRef {
                    node: p.node,
                    output: 0,
                },
                format!("%arg{index}"),
            );
        }
        let mut body = String::new();
        let live = emitter.live(outputs.iter().map(|o| o.value), None);
        for id in live {
            emitter.node(&mut top, id, &mut body, "    ")?;
        }
        let ret_names: Vec<String> = outputs
            .iter()
            .map(|o| emitter.value(&mut top, o.value, &mut body, "    "))
            .collect::<Result<_, _>>()?;

        // Signature.
        let mut sig = Vec::new();
        let mut arg_types = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let ty = nodes[p.node].outputs[0].clone();
            let mut attrs = Vec::new();
            if let Some(r) = aliasing[i] {
                attrs.push(format!("tf.aliasing_output = {r} : i32"));
            }
            if let Some(s) = &arg_shardings[i] {
                attrs.push(format!("sdy.sharding = {}", s.mlir_attr()));
            }
            let attrs = if attrs.is_empty() {
                String::new()
            } else {
                format!(" {{{}}}", attrs.join(", "))
            };
            sig.push(format!("%arg{i}: {}{attrs}", ty.mlir()));
            arg_types.push(ty);
        }
        let result_types: Vec<TensorType> = outputs.iter().map(|o| o.ty().clone()).collect();
        let results: Vec<String> = result_types
            .iter()
            .zip(&result_shardings)
            .map(|(t, s)| match s {
                Some(s) => format!("{} {{sdy.sharding = {}}}", t.mlir(), s.mlir_attr()),
                None => t.mlir(),
            })
            .collect();
        let result_sig = if results.len() == 1 && result_shardings[0].is_none() {
            results[0].clone()
        } else {
            format!("({})", results.join(", "))
        };
        let ret_tys: Vec<String> = result_types.iter().map(|t| t.mlir()).collect();

        let mut text = String::new();
        match &mesh {
            Some(m) => {
                let _ = writeln!(
                    text,
                    "module @{name} attributes {{mhlo.num_partitions = {} : i32, mhlo.num_replicas = 1 : i32}} {{",
                    m.num_devices()
                );
                let _ = writeln!(text, "  {}", m.mlir());
            }
            None => {
                let _ = writeln!(text, "module @{name} {{");
            }
        }
        let _ = writeln!(
            text,
            "  func.func public @main({}) -> {result_sig} {{",
            sig.join(", ")
        );
        text.push_str(&body);
        if ret_names.is_empty() {
            let _ = writeln!(text, "    return");
        } else {
            let _ = writeln!(
                text,
                "    return {} : {}",
                ret_names.join(", "),
                ret_tys.join(", ")
            );
        }
        text.push_str("  }\n}\n");

        let fingerprint = Sha256::digest(text.as_bytes())
            .iter()
            .fold(String::new(), |mut s, b| {
                let _ = write!(s, "{b:02x}");
                s
            });
        let mut donated_args: Vec<usize> = options.donate.iter().map(|(a, _)| *a).collect();
        donated_args.sort_unstable();
        Ok(Program {
            name,
            mlir: text,
            arg_names: params.iter().map(|p| p.name.clone()).collect(),
            arg_types,
            arg_shardings,
            result_types,
            result_shardings,
            donated_args,
            mesh,
            fingerprint,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn train_like() -> Program {
        let g = Graph::new("train_step");
        let x = g.parameter("x", DType::F32, &[256, 128]);
        let w = g.parameter("w", DType::F32, &[128, 64]);
        let y = g.parameter("y", DType::F32, &[256, 64]);
        let lr = g.parameter("lr", DType::F32, &[]);
        let diff = &x.matmul(&w) - &y;
        let loss = (&diff * &diff).sum_all();
        let gw = crate::graph::grad(&loss, &[&w]).unwrap().remove(0);
        let w_new = &w - &(&lr.broadcast_to(w.dims()) * &gw);
        g.build_with(&[&w_new, &loss], &BuildOptions::donating(&[(1, 0)]))
            .unwrap()
    }

    #[test]
    fn golden_train_step_text() {
        let p = train_like();
        let want = r#"module @train_step {
  func.func public @main(%arg0: tensor<256x128xf32>, %arg1: tensor<128x64xf32> {tf.aliasing_output = 0 : i32}, %arg2: tensor<256x64xf32>, %arg3: tensor<f32>) -> (tensor<128x64xf32>, tensor<f32>) {
    %v0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : (tensor<256x128xf32>, tensor<128x64xf32>) -> tensor<256x64xf32>
    %v1 = stablehlo.subtract %v0, %arg2 : tensor<256x64xf32>
    %v2 = stablehlo.multiply %v1, %v1 : tensor<256x64xf32>
    %v3_init = stablehlo.constant dense<0.0> : tensor<f32>
    %v3 = stablehlo.reduce(%v2 init: %v3_init) applies stablehlo.add across dimensions = [0, 1] : (tensor<256x64xf32>, tensor<f32>) -> tensor<f32>
    %v4 = stablehlo.add %v1, %v1 : tensor<256x64xf32>
    %v5 = stablehlo.dot_general %arg0, %v4, contracting_dims = [0] x [0], precision = [HIGHEST, HIGHEST] : (tensor<256x128xf32>, tensor<256x64xf32>) -> tensor<128x64xf32>
    %v6 = stablehlo.broadcast_in_dim %arg3, dims = [] : (tensor<f32>) -> tensor<128x64xf32>
    %v7 = stablehlo.multiply %v6, %v5 : tensor<128x64xf32>
    %v8 = stablehlo.subtract %arg1, %v7 : tensor<128x64xf32>
    return %v8, %v3 : tensor<128x64xf32>, tensor<f32>
  }
}
"#;
        assert_eq!(p.mlir(), want, "got:\n{}", p.mlir());
        assert_eq!(p.donated_args(), &[1]);
        assert_eq!(p.fingerprint().len(), 64);
        assert_eq!(train_like().fingerprint(), p.fingerprint());
    }

    #[test]
    fn repeated_subexpressions_are_emitted_once() {
        let g = Graph::new("cse");
        let x = g.parameter("x", DType::F32, &[3]);
        let a = x.exp();
        let b = x.exp();
        let p = g.build(&[&(&a + &b)]).unwrap();
        assert_eq!(
            p.mlir().matches("stablehlo.exponential").count(),
            1,
            "{}",
            p.mlir()
        );
        assert!(p.mlir().contains("stablehlo.add %v0, %v0"), "{}", p.mlir());
    }

    #[test]
    fn sharding_constraint_needs_a_mesh() {
        let g = Graph::new("c");
        let a = g.parameter("a", DType::F32, &[4, 2]);
        let b = a.with_sharding(Sharding::split(2, 0, "data"));
        let err = g.build(&[&b]).unwrap_err().to_string();
        assert!(
            err.contains("sharding constraint on f32[4, 2]: the graph has no mesh"),
            "{err}"
        );
        g.set_mesh(Mesh::new(&[("data", 3)]));
        let err = g.build(&[&b]).unwrap_err().to_string();
        assert!(err.contains("does not split evenly 3 ways"), "{err}");
    }

    #[test]
    fn donation_type_mismatch_is_an_error() {
        let g = Graph::new("d");
        let a = g.parameter("a", DType::F32, &[4]);
        let s = a.sum_all();
        let err = g
            .build_with(&[&s], &BuildOptions::donating(&[(0, 0)]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("argument 0 (\"a\", f32[4]) cannot be donated to result 0 of type f32[]"),
            "{err}"
        );
    }

    #[test]
    fn spmd_text_has_mesh_and_shardings() {
        let g = Graph::new("dp");
        g.set_mesh(Mesh::new(&[("data", 4)]));
        let x = g.parameter_sharded("x", DType::F32, &[8, 3], Sharding::split(2, 0, "data"));
        let w = g.parameter("w", DType::F32, &[3, 2]);
        let loss = x.matmul(&w).sum_all();
        let p = g.build(&[&loss]).unwrap();
        let t = p.mlir();
        assert!(t.starts_with("module @dp attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {\n  sdy.mesh @mesh = <[\"data\"=4]>\n"), "{t}");
        assert!(
            t.contains("%arg0: tensor<8x3xf32> {sdy.sharding = #sdy.sharding<@mesh, [{\"data\"}, {}]>}"),
            "{t}"
        );
        assert!(
            t.contains("%arg1: tensor<3x2xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}"),
            "{t}"
        );
        assert!(
            t.contains("-> (tensor<f32> {sdy.sharding = #sdy.sharding<@mesh, []>})"),
            "{t}"
        );
        assert_eq!(p.num_partitions(), 4);
        assert_eq!(p.local_arg_dims(0), vec![2, 3]);
    }
}
