//! StableHLO emission: a [`Program`] is the MLIR text of `func.func public @main` in a
//! `module`, with argument attributes for donation (`tf.aliasing_output`) and Shardy shardings,
//! the argument/result types, and a stable fingerprint (sha256 of the text: the same graph
//! always gives the same text).
//!
//! Only nodes that lead to a result are emitted, in the order they were recorded; a node that
//! repeats an earlier one (same primitive, same operands) reuses its value.

use std::collections::HashMap;
use std::fmt::Write;

use sha2::{Digest, Sha256};

use crate::graph::builder::{Graph, Tensor, TensorType, ValueRef};
use crate::graph::ops::Op;
use crate::graph::sharding::{Mesh, Sharding};
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

        // Live nodes.
        let mut live = vec![false; nodes.len()];
        let mut stack: Vec<usize> = outputs.iter().map(|o| o.value.node).collect();
        while let Some(id) = stack.pop() {
            if live[id] {
                continue;
            }
            live[id] = true;
            stack.extend(nodes[id].inputs.iter().map(|v| v.node));
        }

        // Value names.
        let mut names: Vec<Vec<String>> = vec![Vec::new(); nodes.len()];
        let name_of = |names: &Vec<Vec<String>>, v: &ValueRef| names[v.node][v.output].clone();
        let mut body = String::new();
        let mut counter = 0usize;
        let mut emitted: HashMap<String, Vec<String>> = HashMap::new();
        for (id, node) in nodes.iter().enumerate() {
            if !live[id] {
                continue;
            }
            match &node.op {
                Op::Parameter { index } => {
                    names[id] = vec![format!("%arg{index}")];
                    continue;
                }
                Op::StopGradient => {
                    names[id] = vec![name_of(&names, &node.inputs[0])];
                    continue;
                }
                Op::Poison => {
                    return Err(build_error(format!(
                        "{name}: internal: a failed op reached emission"
                    )))
                }
                Op::ShardingConstraint(s) => {
                    let ty = &nodes[node.inputs[0].node].outputs[node.inputs[0].output];
                    let checked = match &mesh {
                        Some(m) => s.validate(&ty.dims, m),
                        None => Err("the graph has no mesh (Graph::set_mesh)".to_string()),
                    };
                    checked.map_err(|e| build_error(format!("{name}: sharding constraint on {ty}: {e}")))?;
                }
                _ => {}
            }
            let ins: Vec<String> = node.inputs.iter().map(|v| name_of(&names, v)).collect();
            let in_tys: Vec<&TensorType> = node
                .inputs
                .iter()
                .map(|v| &nodes[v.node].outputs[v.output])
                .collect();
            // Common subexpressions (same primitive, same operands) are emitted once.
            let cse_key = format!("{:?}|{}", node.op, ins.join(","));
            if let Some(existing) = emitted.get(&cse_key) {
                names[id] = existing.clone();
                continue;
            }
            // Values are numbered in emission order, so dead nodes leave no gaps.
            let k = counter;
            counter += 1;
            let (out, these) = if node.outputs.len() == 1 {
                (format!("%v{k}"), vec![format!("%v{k}")])
            } else {
                (
                    format!("%v{k}:{}", node.outputs.len()),
                    (0..node.outputs.len()).map(|j| format!("%v{k}#{j}")).collect(),
                )
            };
            let text = node.op.lower(&out, &ins, &in_tys, &node.outputs);
            let _ = writeln!(body, "    {}", text.replace("\n  ", "\n    "));
            emitted.insert(cse_key, these.clone());
            names[id] = these;
        }

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
        let ret_names: Vec<String> = outputs.iter().map(|o| name_of(&names, &o.value)).collect();
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
