//! What a compiled program runs, read from its optimized HLO module
//! (`PJRT_Executable_OptimizedProgram` gives a serialized `xla.HloModuleProto`): its collectives
//! ([`collectives`]) and each top-level operation with the bytes it moves and the flops of its
//! products ([`operations`], `grpo compile --explain`).
//!
//! Only the fields needed are declared; prost skips the rest. Field numbers are those of
//! `xla/service/hlo.proto` and `xla/xla_data.proto`.

use std::collections::BTreeMap;

use prost::Message;

use super::error::{Error, Result};

#[derive(Clone, PartialEq, Message)]
struct HloModuleProtoWithConfig {
    #[prost(message, optional, tag = "1")]
    hlo_module: Option<HloModuleProto>,
}

#[derive(Clone, PartialEq, Message)]
struct HloModuleProto {
    #[prost(message, repeated, tag = "3")]
    computations: Vec<HloComputationProto>,
    #[prost(int64, tag = "6")]
    entry_computation_id: i64,
}

#[derive(Clone, PartialEq, Message)]
struct HloComputationProto {
    #[prost(message, repeated, tag = "2")]
    instructions: Vec<HloInstructionProto>,
    #[prost(int64, tag = "5")]
    id: i64,
}

#[derive(Clone, PartialEq, Message)]
struct HloInstructionProto {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    opcode: String,
    #[prost(message, optional, tag = "3")]
    shape: Option<ShapeProto>,
    #[prost(string, tag = "11")]
    fusion_kind: String,
    #[prost(message, optional, tag = "16")]
    convolution_dimension_numbers: Option<ConvolutionDimensionNumbers>,
    #[prost(message, optional, tag = "30")]
    dot_dimension_numbers: Option<DotDimensionNumbers>,
    #[prost(int64, tag = "35")]
    id: i64,
    #[prost(int64, repeated, tag = "36")]
    operand_ids: Vec<i64>,
    #[prost(int64, repeated, tag = "38")]
    called_computation_ids: Vec<i64>,
}

#[derive(Clone, PartialEq, Message)]
struct ConvolutionDimensionNumbers {
    #[prost(int64, tag = "4")]
    kernel_output_feature_dimension: i64,
}

#[derive(Clone, PartialEq, Message)]
struct DotDimensionNumbers {
    #[prost(int64, repeated, tag = "1")]
    lhs_contracting_dimensions: Vec<i64>,
}

#[derive(Clone, PartialEq, Message)]
struct ShapeProto {
    #[prost(int32, tag = "2")]
    element_type: i32,
    #[prost(int64, repeated, tag = "3")]
    dimensions: Vec<i64>,
    #[prost(message, repeated, tag = "4")]
    tuple_shapes: Vec<ShapeProto>,
}

impl ShapeProto {
    /// Bytes of an array shape; of a tuple, its largest element (an async collective's
    /// `-start` returns its operands and results together).
    fn bytes(&self) -> u64 {
        if !self.tuple_shapes.is_empty() {
            return self.tuple_shapes.iter().map(ShapeProto::bytes).max().unwrap_or(0);
        }
        self.element_bytes() * self.elements()
    }

    /// Bytes of an array shape, or of every element of a tuple.
    fn total_bytes(&self) -> u64 {
        match self.tuple_shapes.is_empty() {
            true => self.element_bytes() * self.elements(),
            false => self.tuple_shapes.iter().map(ShapeProto::total_bytes).sum(),
        }
    }

    fn elements(&self) -> u64 {
        self.dimensions.iter().map(|&d| d.max(0) as u64).product()
    }

    /// xla.PrimitiveType's size in bytes.
    fn element_bytes(&self) -> u64 {
        match self.element_type {
            1 | 2 | 6 | 19..=28 => 1, // PRED, S8, U8, the f8 and 4-bit kinds (rounded up)
            3 | 7 | 10 | 16 => 2,     // S16, U16, F16, BF16
            4 | 8 | 11 => 4,          // S32, U32, F32
            5 | 9 | 12 | 15 => 8,     // S64, U64, F64, C64
            18 => 16,                 // C128
            _ => 0,                   // TUPLE, TOKEN, OPAQUE
        }
    }

    /// As HLO text writes it: `bf16[8,512]`, a tuple as `(f32[2], s32[])`.
    fn text(&self) -> String {
        if !self.tuple_shapes.is_empty() {
            let parts: Vec<String> = self.tuple_shapes.iter().map(ShapeProto::text).collect();
            return format!("({})", parts.join(", "));
        }
        let kind = match self.element_type {
            1 => "pred",
            2 => "s8",
            3 => "s16",
            4 => "s32",
            5 => "s64",
            6 => "u8",
            7 => "u16",
            8 => "u32",
            9 => "u64",
            10 => "f16",
            11 => "f32",
            12 => "f64",
            16 => "bf16",
            _ => "?",
        };
        let dims: Vec<String> = self.dimensions.iter().map(i64::to_string).collect();
        format!("{kind}[{}]", dims.join(","))
    }
}

/// The collectives of one kind in a program: how many run per execution and the bytes of their
/// results on one device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CollectiveCount {
    /// Operations (an async pair counts once).
    pub count: u64,
    /// Bytes of their results per device (an all-reduce's reduced tensor, an all-gather's
    /// gathered one, a reduce-scatter's shard).
    pub bytes: u64,
}

fn decode(program: &str, format: &str, module: &[u8]) -> Result<HloModuleProto> {
    let failed = |message: String| Error::OptimizedHlo {
        program: program.to_string(),
        message,
    };
    match format {
        "hlo" => {
            HloModuleProto::decode(module).map_err(|e| failed(format!("not an xla.HloModuleProto: {e}")))
        }
        "hlo_with_config" => Ok(HloModuleProtoWithConfig::decode(module)
            .map_err(|e| failed(format!("not an xla.HloModuleProtoWithConfig: {e}")))?
            .hlo_module
            .unwrap_or_default()),
        other => Err(failed(format!(
            "format `{other}`, expected `hlo` or `hlo_with_config`"
        ))),
    }
}

/// Collectives by kind (`all-reduce`, `all-gather`, `reduce-scatter`, `all-to-all`,
/// `collective-permute`), counted over every computation of the module, fused ones included.
/// Loops are counted once.
pub fn collectives(
    program: &str,
    format: &str,
    module: &[u8],
) -> Result<BTreeMap<&'static str, CollectiveCount>> {
    let module = decode(program, format, module)?;
    let mut out: BTreeMap<&'static str, CollectiveCount> = BTreeMap::new();
    for instruction in module.computations.iter().flat_map(|c| &c.instructions) {
        let Some(kind) = collective_kind(&instruction.opcode) else {
            continue;
        };
        let entry = out.entry(kind).or_default();
        entry.count += 1;
        entry.bytes += instruction.shape.as_ref().map_or(0, ShapeProto::bytes);
    }
    Ok(out)
}

/// One operation a program runs (a fusion, a product, a copy, a collective, ...): what it reads
/// and writes and the flops of the products in it, per device and per run.
#[derive(Clone, Debug, PartialEq)]
pub struct OpCost {
    /// Its name in the optimized module (`fusion.12`, `copy.3`).
    pub name: String,
    /// Its opcode; for a fusion, its kind and the operations inside that move or compute the
    /// most (`fusion kLoop: convert, multiply`).
    pub what: String,
    /// Its result shape.
    pub shape: String,
    /// Bytes of its operands and results: what it reads from and writes to memory, at most
    /// (XLA's cost model may count less where it knows an operand is read in part).
    pub bytes: u64,
    /// 2 x multiply-adds of the dot products in it.
    pub flops: u64,
    /// Inside a loop's body: counted once here, run once per iteration.
    pub in_loop: bool,
}

/// The operations of the entry computation and of the loops it runs, in program order (what
/// a device executes; fused computations are described by their fusion). Parameters, constants,
/// tuples and bitcasts move nothing and are left out.
pub fn operations(program: &str, format: &str, module: &[u8]) -> Result<Vec<OpCost>> {
    let module = decode(program, format, module)?;
    let computations: BTreeMap<i64, &HloComputationProto> =
        module.computations.iter().map(|c| (c.id, c)).collect();
    let mut out = Vec::new();
    let entry = module
        .computations
        .iter()
        .find(|c| c.id == module.entry_computation_id)
        .or(module.computations.last());
    if let Some(entry) = entry {
        walk(entry, &computations, false, &mut out);
    }
    Ok(out)
}

fn walk(
    computation: &HloComputationProto,
    computations: &BTreeMap<i64, &HloComputationProto>,
    in_loop: bool,
    out: &mut Vec<OpCost>,
) {
    let by_id: BTreeMap<i64, &HloInstructionProto> =
        computation.instructions.iter().map(|i| (i.id, i)).collect();
    for i in &computation.instructions {
        match i.opcode.as_str() {
            "parameter" | "constant" | "get-tuple-element" | "tuple" | "bitcast" | "after-all"
            | "partition-id" | "replica-id" | "iota" => {}
            "while" | "conditional" | "call" => {
                for id in &i.called_computation_ids {
                    if let Some(c) = computations.get(id) {
                        walk(c, computations, in_loop || i.opcode == "while", out);
                    }
                }
            }
            // An async pair's later halves: counted at its start.
            opcode if opcode.ends_with("-done") || opcode.ends_with("-update") => {}
            opcode => {
                let shape = |id: &i64| by_id.get(id).and_then(|o| o.shape.as_ref());
                let operands: u64 = i
                    .operand_ids
                    .iter()
                    .filter_map(shape)
                    .map(ShapeProto::total_bytes)
                    .sum();
                let result = match (&i.shape, opcode.ends_with("-start")) {
                    // A start returns its operands beside its result (and a context): the
                    // result is the second element.
                    (Some(s), true) if s.tuple_shapes.len() >= 2 => s.tuple_shapes[1].total_bytes(),
                    (Some(s), _) => s.total_bytes(),
                    (None, _) => 0,
                };
                let called: Vec<&HloComputationProto> = i
                    .called_computation_ids
                    .iter()
                    .filter_map(|id| computations.get(id).copied())
                    .collect();
                let what = match (opcode, called.first()) {
                    ("fusion", Some(c)) => format!("fusion {}: {}", i.fusion_kind, fused_ops(c).join(", ")),
                    (_, Some(c)) if opcode.ends_with("-start") => {
                        format!("{opcode}: {}", fused_ops(c).join(", "))
                    }
                    _ => opcode.to_string(),
                };
                let flops = product_flops(i, &by_id)
                    + called
                        .iter()
                        .map(|c| computation_flops(c, computations))
                        .sum::<u64>();
                // A fusion that updates a slice of one of its operands in place reads and
                // writes that slice, not the whole buffer.
                let in_place: u64 = match opcode {
                    "fusion" => called.first().map_or(0, |c| in_place_savings(c)),
                    _ => 0,
                };
                out.push(OpCost {
                    name: i.name.clone(),
                    what,
                    shape: i.shape.as_ref().map(ShapeProto::text).unwrap_or_default(),
                    bytes: (operands + result).saturating_sub(in_place),
                    flops,
                    in_loop,
                });
            }
        }
    }
}

/// What a fused computation's in-place slice updates do not move: for each
/// `dynamic-update-slice` of one of its parameters, the whole buffer read and written, where
/// only the slice is written.
fn in_place_savings(c: &HloComputationProto) -> u64 {
    let by_id = instructions_by_id(c);
    let find = |id: i64| by_id.get(&id).copied();
    c.instructions
        .iter()
        .filter(|i| i.opcode == "dynamic-update-slice")
        .filter_map(|i| {
            let buffer = find(*i.operand_ids.first()?)?;
            let update = find(*i.operand_ids.get(1)?)?;
            if buffer.opcode != "parameter" {
                return None;
            }
            let (b, u) = (
                buffer.shape.as_ref()?.total_bytes(),
                update.shape.as_ref()?.total_bytes(),
            );
            Some((2 * b).saturating_sub(u))
        })
        .sum()
}

/// A computation's instructions by id (operands are named by id).
fn instructions_by_id(c: &HloComputationProto) -> BTreeMap<i64, &HloInstructionProto> {
    c.instructions.iter().map(|i| (i.id, i)).collect()
}

/// The flops of the products in `c` and in what it calls (a fusion nested in a fusion).
fn computation_flops(c: &HloComputationProto, computations: &BTreeMap<i64, &HloComputationProto>) -> u64 {
    let by_id = instructions_by_id(c);
    c.instructions
        .iter()
        .map(|i| {
            product_flops(i, &by_id)
                + i.called_computation_ids
                    .iter()
                    .filter_map(|id| computations.get(id))
                    .map(|inner| computation_flops(inner, computations))
                    .sum::<u64>()
        })
        .sum()
}

/// The operations inside a fused computation that say what it does, heaviest kinds first
/// (products, reductions, gathers and scatters, then the rest), each once.
fn fused_ops(c: &HloComputationProto) -> Vec<String> {
    let quiet = [
        "parameter",
        "constant",
        "bitcast",
        "get-tuple-element",
        "tuple",
        "broadcast",
        "reshape",
    ];
    let rank = |op: &str| match op {
        "dot" | "convolution" | "ragged-dot" => 0,
        "reduce"
        | "reduce-window"
        | "scatter"
        | "gather"
        | "dynamic-slice"
        | "dynamic-update-slice"
        | "sort" => 1,
        "transpose" | "copy" | "concatenate" | "pad" | "slice" => 2,
        _ => 3,
    };
    let mut ops: Vec<&str> = Vec::new();
    for op in c.instructions.iter().map(|i| i.opcode.as_str()) {
        if !quiet.contains(&op) && !ops.contains(&op) {
            ops.push(op);
        }
    }
    if ops.is_empty() {
        // Only data movement (a broadcast, a reshape): name that.
        ops.extend(
            c.instructions
                .iter()
                .map(|i| i.opcode.as_str())
                .filter(|op| *op != "parameter")
                .take(1),
        );
    }
    ops.sort_by_key(|op| rank(op));
    ops.into_iter().take(4).map(String::from).collect()
}

/// 2 x multiply-adds of a product: for a `dot`, the result's elements times the left operand's
/// contracted size; for a `convolution` (TPU's form of most products), the result's elements
/// times the kernel's elements per output feature.
fn product_flops(i: &HloInstructionProto, by_id: &BTreeMap<i64, &HloInstructionProto>) -> u64 {
    let operand = |k: usize| {
        i.operand_ids
            .get(k)
            .and_then(|id| by_id.get(id))
            .and_then(|o| o.shape.as_ref())
    };
    let Some(result) = i.shape.as_ref() else {
        return 0;
    };
    let per_element = match i.opcode.as_str() {
        "dot" => match (operand(0), i.dot_dimension_numbers.as_ref()) {
            (Some(lhs), Some(dims)) => dims
                .lhs_contracting_dimensions
                .iter()
                .filter_map(|&d| lhs.dimensions.get(d as usize))
                .map(|&n| n.max(0) as u64)
                .product(),
            _ => 0,
        },
        "convolution" => match (operand(1), i.convolution_dimension_numbers.as_ref()) {
            (Some(kernel), Some(dims)) => {
                let out = kernel
                    .dimensions
                    .get(dims.kernel_output_feature_dimension as usize)
                    .map_or(1, |&n| n.max(1) as u64);
                kernel.elements() / out
            }
            _ => 0,
        },
        _ => 0,
    };
    2 * result.elements() * per_element
}

/// The kind of a collective opcode (its synchronous form or the `-start` of its async pair).
fn collective_kind(opcode: &str) -> Option<&'static str> {
    let base = opcode.strip_suffix("-start").unwrap_or(opcode);
    [
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "collective-permute",
    ]
    .into_iter()
    .find(|k| *k == base)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instruction(opcode: &str, shape: ShapeProto) -> HloInstructionProto {
        HloInstructionProto {
            opcode: opcode.into(),
            shape: Some(shape),
            ..Default::default()
        }
    }

    fn array(element_type: i32, dimensions: &[i64]) -> ShapeProto {
        ShapeProto {
            element_type,
            dimensions: dimensions.to_vec(),
            tuple_shapes: Vec::new(),
        }
    }

    #[test]
    fn counts_sync_and_async_collectives_by_kind_with_their_result_bytes() {
        let module = HloModuleProto {
            computations: vec![
                HloComputationProto {
                    instructions: vec![
                        instruction("parameter", array(11, &[8, 8])),
                        instruction("all-reduce", array(11, &[8, 8])),
                        instruction(
                            "all-gather-start",
                            ShapeProto {
                                element_type: 13,
                                dimensions: vec![],
                                tuple_shapes: vec![array(16, &[4, 8]), array(16, &[16, 8])],
                            },
                        ),
                        instruction("all-gather-done", array(16, &[16, 8])),
                    ],
                    id: 1,
                },
                // A fused computation's collective counts too.
                HloComputationProto {
                    instructions: vec![instruction("reduce-scatter", array(16, &[2, 8]))],
                    id: 2,
                },
            ],
            entry_computation_id: 1,
        };
        let got = collectives("p", "hlo", &module.encode_to_vec()).unwrap();
        assert_eq!(got["all-reduce"], CollectiveCount { count: 1, bytes: 256 });
        assert_eq!(got["all-gather"], CollectiveCount { count: 1, bytes: 256 });
        assert_eq!(got["reduce-scatter"], CollectiveCount { count: 1, bytes: 32 });
        assert_eq!(got.len(), 3);
        assert!(collectives("p", "hlo", b"\xff\xff").is_err());
        let wrapped = HloModuleProtoWithConfig {
            hlo_module: Some(module),
        };
        assert_eq!(
            collectives("p", "hlo_with_config", &wrapped.encode_to_vec()).unwrap(),
            got
        );
        assert!(collectives("p", "mlir", b"")
            .unwrap_err()
            .to_string()
            .contains("format `mlir`"));
    }

    /// An instruction `name` (id `id`) with operands `operands` and called computations `calls`.
    fn op(
        name: &str,
        id: i64,
        opcode: &str,
        shape: ShapeProto,
        operands: &[i64],
        calls: &[i64],
    ) -> HloInstructionProto {
        HloInstructionProto {
            name: name.into(),
            id,
            operand_ids: operands.to_vec(),
            called_computation_ids: calls.to_vec(),
            ..instruction(opcode, shape)
        }
    }

    #[test]
    fn operations_are_the_entrys_and_its_loops_with_their_bytes_and_products() {
        let mut dot = op("dot.1", 13, "dot", array(11, &[8, 32]), &[11, 12], &[]);
        dot.dot_dimension_numbers = Some(DotDimensionNumbers {
            lhs_contracting_dimensions: vec![1],
        });
        let fused = HloComputationProto {
            id: 10,
            instructions: vec![
                op("p0", 11, "parameter", array(16, &[8, 64]), &[], &[]),
                op("p1", 12, "parameter", array(16, &[64, 32]), &[], &[]),
                dot,
                op("convert.1", 14, "convert", array(16, &[8, 32]), &[13], &[]),
            ],
        };
        let body = HloComputationProto {
            id: 20,
            instructions: vec![
                op("p", 21, "parameter", array(11, &[1024]), &[], &[]),
                op("copy.1", 22, "copy", array(11, &[1024]), &[21], &[]),
            ],
        };
        let mut fusion = op("fusion.1", 3, "fusion", array(16, &[8, 32]), &[1, 2], &[10]);
        fusion.fusion_kind = "kOutput".into();
        let entry = HloComputationProto {
            id: 1,
            instructions: vec![
                op("x", 1, "parameter", array(16, &[8, 64]), &[], &[]),
                op("w", 2, "parameter", array(16, &[64, 32]), &[], &[]),
                fusion,
                op("while.1", 4, "while", array(11, &[1024]), &[], &[20]),
            ],
        };
        let module = HloModuleProto {
            computations: vec![fused, body, entry],
            entry_computation_id: 1,
        };
        let got = operations("p", "hlo", &module.encode_to_vec()).unwrap();
        assert_eq!(
            got,
            vec![
                OpCost {
                    name: "fusion.1".into(),
                    what: "fusion kOutput: dot, convert".into(),
                    shape: "bf16[8,32]".into(),
                    bytes: (8 * 64 + 64 * 32 + 8 * 32) * 2,
                    flops: 2 * 8 * 32 * 64,
                    in_loop: false,
                },
                OpCost {
                    name: "copy.1".into(),
                    what: "copy".into(),
                    shape: "f32[1024]".into(),
                    bytes: 2 * 1024 * 4,
                    flops: 0,
                    in_loop: true,
                },
            ]
        );
    }

    #[test]
    fn a_convolution_counts_its_products_and_an_async_pair_counts_once() {
        let mut conv = op(
            "convolution.1",
            3,
            "convolution",
            array(16, &[8, 32]),
            &[1, 2],
            &[],
        );
        conv.convolution_dimension_numbers = Some(ConvolutionDimensionNumbers {
            kernel_output_feature_dimension: 1,
        });
        let gathered = ShapeProto {
            element_type: 0,
            dimensions: vec![],
            tuple_shapes: vec![array(16, &[8, 32]), array(16, &[64, 32])],
        };
        let entry = HloComputationProto {
            id: 1,
            instructions: vec![
                op("x", 1, "parameter", array(16, &[8, 64]), &[], &[]),
                op("w", 2, "parameter", array(16, &[64, 32]), &[], &[]),
                conv,
                op("all-gather-start.1", 4, "all-gather-start", gathered, &[3], &[]),
                op(
                    "all-gather-done.1",
                    5,
                    "all-gather-done",
                    array(16, &[64, 32]),
                    &[4],
                    &[],
                ),
            ],
        };
        let module = HloModuleProto {
            computations: vec![entry],
            entry_computation_id: 1,
        };
        let got = operations("p", "hlo", &module.encode_to_vec()).unwrap();
        let summary: Vec<(&str, u64, u64)> =
            got.iter().map(|o| (o.name.as_str(), o.bytes, o.flops)).collect();
        assert_eq!(
            summary,
            [
                ("convolution.1", (8 * 64 + 64 * 32 + 8 * 32) * 2, 2 * 8 * 32 * 64),
                ("all-gather-start.1", (8 * 32 + 64 * 32) * 2, 0),
            ]
        );
    }

    #[test]
    fn an_in_place_slice_update_moves_its_slice() {
        let fused = HloComputationProto {
            id: 10,
            instructions: vec![
                op("buffer", 11, "parameter", array(11, &[32, 1024]), &[], &[]),
                op("row", 12, "parameter", array(11, &[1, 1024]), &[], &[]),
                op("at", 13, "parameter", array(4, &[]), &[], &[]),
                op(
                    "dus",
                    14,
                    "dynamic-update-slice",
                    array(11, &[32, 1024]),
                    &[11, 12, 13, 13],
                    &[],
                ),
            ],
        };
        let entry = HloComputationProto {
            id: 1,
            instructions: vec![
                op("b", 1, "parameter", array(11, &[32, 1024]), &[], &[]),
                op("r", 2, "parameter", array(11, &[1, 1024]), &[], &[]),
                op("i", 3, "parameter", array(4, &[]), &[], &[]),
                op("fusion.1", 4, "fusion", array(11, &[32, 1024]), &[1, 2, 3], &[10]),
            ],
        };
        let module = HloModuleProto {
            computations: vec![fused, entry],
            entry_computation_id: 1,
        };
        let got = operations("p", "hlo", &module.encode_to_vec()).unwrap();
        // The row read, the index, and the row written.
        assert_eq!(got[0].bytes, 1024 * 4 + 4 + 1024 * 4);
    }
}
