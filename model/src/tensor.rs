//! Host tensors: a name, a float element type ([`DType`] f32, bf16 or f16), a row-major shape
//! and the values.

use half::{bf16, f16};
use xla::DType;

/// The values of a [`HostTensor`], in row-major order.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values.
    BF16(Vec<bf16>),
    /// f16 values.
    F16(Vec<f16>),
}

/// A named tensor in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Hugging Face parameter name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Row-major shape (Hugging Face / PyTorch order: `[out_features, in_features]`).
    pub shape: Vec<usize>,
    /// The values.
    pub data: TensorData,
}

impl HostTensor {
    /// A tensor of f32 values; panics if `values.len()` is not the product of `shape`.
    pub fn from_f32(name: impl Into<String>, shape: Vec<usize>, values: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            values.len(),
            "shape {shape:?} does not match {} values",
            values.len()
        );
        HostTensor {
            name: name.into(),
            shape,
            data: TensorData::F32(values),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match &self.data {
            TensorData::F32(_) => DType::F32,
            TensorData::BF16(_) => DType::BF16,
            TensorData::F16(_) => DType::F16,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        match &self.data {
            TensorData::F32(v) => v.len(),
            TensorData::BF16(v) => v.len(),
            TensorData::F16(v) => v.len(),
        }
    }

    /// The values converted to f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            TensorData::F32(v) => v.clone(),
            TensorData::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            TensorData::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// A copy converted to `dtype` (round to nearest even when narrowing). Panics unless
    /// `dtype` is f32, bf16 or f16, the types a host tensor holds.
    pub fn to_dtype(&self, dtype: DType) -> HostTensor {
        if dtype == self.dtype() {
            return self.clone();
        }
        let values = self.to_f32_vec();
        let data = match dtype {
            DType::F32 => TensorData::F32(values),
            DType::BF16 => TensorData::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => TensorData::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            other => panic!("a host tensor holds f32, bf16 or f16 values, not {other}"),
        };
        HostTensor {
            name: self.name.clone(),
            shape: self.shape.clone(),
            data,
        }
    }

    /// The values as little-endian bytes (the safetensors layout).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match &self.data {
            TensorData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            TensorData::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            TensorData::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// Builds a tensor from little-endian bytes; `None` if the byte count does not match or
    /// `dtype` is not f32, bf16 or f16.
    pub fn from_le_bytes(
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<usize>,
        bytes: &[u8],
    ) -> Option<Self> {
        let numel: usize = shape.iter().product();
        if bytes.len() != numel * dtype.size_bytes() {
            return None;
        }
        let data = match dtype {
            DType::F32 => TensorData::F32(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            DType::BF16 => TensorData::BF16(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                    .collect(),
            ),
            DType::F16 => TensorData::F16(
                bytes
                    .chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]))
                    .collect(),
            ),
            _ => return None,
        };
        Some(HostTensor {
            name: name.into(),
            shape,
            data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_round_trip_and_conversion() {
        let t = HostTensor::from_f32("w", vec![2, 2], vec![1.0, -2.5, 3.140625, 0.0]);
        let back = HostTensor::from_le_bytes("w", DType::F32, vec![2, 2], &t.to_le_bytes());
        assert_eq!(back.as_ref(), Some(&t));
        let b = t.to_dtype(DType::BF16);
        assert_eq!(b.dtype(), DType::BF16);
        // 3.140625 is exactly representable in bf16; the others too.
        assert_eq!(b.to_f32_vec(), vec![1.0, -2.5, 3.140625, 0.0]);
        let h = t.to_dtype(DType::F16);
        let hb = HostTensor::from_le_bytes("w", DType::F16, vec![2, 2], &h.to_le_bytes()).unwrap();
        assert_eq!(hb, h);
        assert!(HostTensor::from_le_bytes("w", DType::F32, vec![3], &[0u8; 8]).is_none());
        // bf16 rounding: 1 + 2^-9 rounds to 1 (nearest even), 1 + 3*2^-9 rounds up.
        let r = HostTensor::from_f32("r", vec![2], vec![1.0 + 1.0 / 512.0, 1.0 + 3.0 / 512.0])
            .to_dtype(DType::BF16)
            .to_f32_vec();
        assert_eq!(r, vec![1.0, 1.0 + 1.0 / 64.0 * 0.5]);
    }
}
