//! A traced value seen statically: its type ([`TensorType`]) and which output of which node
//! it is ([`ValueRef`]). The primitives' shape rules read the one, the graph's nodes name
//! their inputs by the other.

use std::fmt;

use crate::dtype::DType;

/// The static type of a traced value: element type and dimensions.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first (empty for a scalar).
    pub dims: Vec<i64>,
}

impl TensorType {
    /// A type from an element type and dimensions.
    pub fn new(dtype: DType, dims: &[i64]) -> TensorType {
        TensorType {
            dtype,
            dims: dims.to_vec(),
        }
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// Number of elements (1 for a scalar).
    pub fn num_elements(&self) -> i64 {
        self.dims.iter().product()
    }

    /// The MLIR spelling, e.g. `tensor<4x8xf32>` or `tensor<f32>`.
    pub fn mlir(&self) -> String {
        let mut s = String::from("tensor<");
        for d in &self.dims {
            s.push_str(&d.to_string());
            s.push('x');
        }
        s.push_str(self.dtype.mlir());
        s.push('>');
        s
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:?}", self.dtype, self.dims)
    }
}

/// One output of one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ValueRef {
    pub node: usize,
    pub output: usize,
}
