//! The collectives a compiled program runs, read from its optimized HLO module
//! (`PJRT_Executable_OptimizedProgram` gives a serialized `xla.HloModuleProto`).
//!
//! Only the fields needed are declared (an instruction's opcode and result shape); prost skips
//! the rest. Field numbers are those of `xla/service/hlo.proto` and `xla/xla_data.proto`.

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
}

#[derive(Clone, PartialEq, Message)]
struct HloComputationProto {
    #[prost(message, repeated, tag = "2")]
    instructions: Vec<HloInstructionProto>,
}

#[derive(Clone, PartialEq, Message)]
struct HloInstructionProto {
    #[prost(string, tag = "2")]
    opcode: String,
    #[prost(message, optional, tag = "3")]
    shape: Option<ShapeProto>,
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
        // xla.PrimitiveType numbers.
        let size = match self.element_type {
            1 | 2 | 6 | 19..=28 => 1, // PRED, S8, U8, the f8 and 4-bit kinds (rounded up)
            3 | 7 | 10 | 16 => 2,     // S16, U16, F16, BF16
            4 | 8 | 11 => 4,          // S32, U32, F32
            5 | 9 | 12 | 15 => 8,     // S64, U64, F64, C64
            18 => 16,                 // C128
            _ => 0,                   // TUPLE, TOKEN, OPAQUE
        };
        size * self.dimensions.iter().map(|&d| d.max(0) as u64).product::<u64>()
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

/// Collectives by kind (`all-reduce`, `all-gather`, `reduce-scatter`, `all-to-all`,
/// `collective-permute`), counted over every computation of the module, fused ones included.
/// Loops are counted once (the programs here have none: every layer is unrolled).
pub fn collectives(
    program: &str,
    format: &str,
    module: &[u8],
) -> Result<BTreeMap<&'static str, CollectiveCount>> {
    let failed = |message: String| Error::OptimizedHlo {
        program: program.to_string(),
        message,
    };
    let module = match format {
        "hlo" => {
            HloModuleProto::decode(module).map_err(|e| failed(format!("not an xla.HloModuleProto: {e}")))?
        }
        "hlo_with_config" => HloModuleProtoWithConfig::decode(module)
            .map_err(|e| failed(format!("not an xla.HloModuleProtoWithConfig: {e}")))?
            .hlo_module
            .unwrap_or_default(),
        other => {
            return Err(failed(format!(
                "format `{other}`, expected `hlo` or `hlo_with_config`"
            )))
        }
    };
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
                },
                // A fused computation's collective counts too.
                HloComputationProto {
                    instructions: vec![instruction("reduce-scatter", array(16, &[2, 8]))],
                },
            ],
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
}
