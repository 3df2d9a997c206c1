//! Host tensors: a name, a float element type ([`DType`] f32, bf16 or f16), a row-major shape
//! and the values as little-endian bytes, the layout safetensors files, checkpoints and the
//! weight stream share, so a tensor moves between them without a conversion.

use half::{bf16, f16};
use xla::DType;

/// A named tensor in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Hugging Face parameter name, e.g. `model.layers.0.self_attn.q_proj.weight` (or a
    /// checkpoint's own name, such as `adam_m.NAME`); unique within its file.
    pub name: String,
    /// F32, BF16 or F16.
    pub dtype: DType,
    /// Row-major shape (Hugging Face / PyTorch order: `[out_features, in_features]`).
    pub shape: Vec<usize>,
    /// `product(shape) * dtype.size_bytes()` little-endian bytes.
    pub bytes: Vec<u8>,
}

impl HostTensor {
    /// Why this tensor is inconsistent (its fields are public): an element type other than f32,
    /// bf16 or f16, or a byte count that does not match the shape.
    pub fn problem(&self) -> Option<String> {
        let expected = self.shape.iter().product::<usize>() * self.dtype.size_bytes();
        if !matches!(self.dtype, DType::F32 | DType::BF16 | DType::F16) {
            Some(format!(
                "a host tensor holds f32, bf16 or f16 values, not {}",
                self.dtype
            ))
        } else if self.bytes.len() != expected {
            Some(format!(
                "{} bytes of {} for shape {:?}, which needs {expected}",
                self.bytes.len(),
                self.dtype,
                self.shape
            ))
        } else {
            None
        }
    }

    /// A tensor of f32 values; panics if `values.len()` is not the product of `shape`.
    pub fn from_f32(name: impl Into<String>, shape: Vec<usize>, values: &[f32]) -> Self {
        HostTensor::from_f32_as(name, shape, values, DType::F32)
    }

    /// A tensor of `dtype` from f32 values (round to nearest even when narrowing); panics if
    /// `values.len()` is not the product of `shape`, or `dtype` is not f32, bf16 or f16.
    pub fn from_f32_as(name: impl Into<String>, shape: Vec<usize>, values: &[f32], dtype: DType) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            values.len(),
            "shape {shape:?} does not match {} values",
            values.len()
        );
        let bytes = match dtype {
            DType::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            DType::BF16 => values
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
            DType::F16 => values
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
            other => panic!("a host tensor holds f32, bf16 or f16 values, not {other}"),
        };
        HostTensor {
            name: name.into(),
            dtype,
            shape,
            bytes,
        }
    }

    /// A tensor from its little-endian bytes; `None` if the byte count does not match the shape
    /// or `dtype` is not f32, bf16 or f16.
    pub fn from_le_bytes(
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    ) -> Option<Self> {
        let tensor = HostTensor {
            name: name.into(),
            dtype,
            shape,
            bytes,
        };
        tensor.problem().is_none().then_some(tensor)
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.bytes.len() / self.dtype.size_bytes()
    }

    /// The values converted to f32 (bf16 and f16 widen exactly).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self.dtype {
            DType::BF16 => self
                .bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::F16 => self
                .bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => self
                .bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        }
    }

    /// A copy converted to `dtype` (round to nearest even when narrowing). Panics unless
    /// `dtype` is f32, bf16 or f16, the types a host tensor holds.
    pub fn to_dtype(&self, dtype: DType) -> HostTensor {
        if dtype == self.dtype {
            return self.clone();
        }
        HostTensor::from_f32_as(self.name.clone(), self.shape.clone(), &self.to_f32_vec(), dtype)
    }

    /// Device `device`'s part of this tensor laid out by `sharding` on `mesh` (the whole tensor
    /// when either is `None`), as a tensor of the same name and type: its bytes are those of
    /// [`xla::graph::shard_host`]'s block.
    pub fn shard(
        &self,
        sharding: Option<&xla::graph::Sharding>,
        mesh: Option<&xla::graph::Mesh>,
        device: usize,
    ) -> HostTensor {
        let dims: Vec<i64> = self.shape.iter().map(|&d| d as i64).collect();
        fn part<const N: usize>(
            bytes: &[u8],
            dims: &[i64],
            sharding: Option<&xla::graph::Sharding>,
            mesh: Option<&xla::graph::Mesh>,
            device: usize,
        ) -> (Vec<u8>, Vec<i64>) {
            let elems: Vec<[u8; N]> = bytes
                .chunks_exact(N)
                .map(|c| c.try_into().expect("chunks of N"))
                .collect();
            let (p, local) = xla::graph::shard_host(&elems, dims, sharding, mesh, device);
            (p.concat(), local)
        }
        let (bytes, local) = match self.dtype.size_bytes() {
            1 => part::<1>(&self.bytes, &dims, sharding, mesh, device),
            2 => part::<2>(&self.bytes, &dims, sharding, mesh, device),
            4 => part::<4>(&self.bytes, &dims, sharding, mesh, device),
            8 => part::<8>(&self.bytes, &dims, sharding, mesh, device),
            n => unreachable!("no element type of {n} bytes"),
        };
        HostTensor {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: local.iter().map(|&d| d as usize).collect(),
            bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_round_trip_and_conversion() {
        let t = HostTensor::from_f32("w", vec![2, 2], &[1.0, -2.5, 3.140625, 0.0]);
        let back = HostTensor::from_le_bytes("w", DType::F32, vec![2, 2], t.bytes.clone());
        assert_eq!(back.as_ref(), Some(&t));
        assert_eq!(t.numel(), 4);
        let b = t.to_dtype(DType::BF16);
        assert_eq!((b.dtype, b.bytes.len(), b.numel()), (DType::BF16, 8, 4));
        // 3.140625 is exactly representable in bf16; the others too.
        assert_eq!(b.to_f32_vec(), vec![1.0, -2.5, 3.140625, 0.0]);
        let h = t.to_dtype(DType::F16);
        let hb = HostTensor::from_le_bytes("w", DType::F16, vec![2, 2], h.bytes.clone()).unwrap();
        assert_eq!(hb, h);
        assert_eq!(h.to_f32_vec(), t.to_f32_vec());
        assert!(HostTensor::from_le_bytes("w", DType::F32, vec![3], vec![0u8; 8]).is_none());
        assert!(HostTensor::from_le_bytes("w", DType::I32, vec![2], vec![0u8; 8]).is_none());
        // bf16 rounding: 1 + 2^-9 rounds to 1 (nearest even), 1 + 3*2^-9 rounds up.
        let r = HostTensor::from_f32_as("r", vec![2], &[1.0 + 1.0 / 512.0, 1.0 + 3.0 / 512.0], DType::BF16);
        assert_eq!(r.to_f32_vec(), vec![1.0, 1.0 + 1.0 / 64.0 * 0.5]);
    }
}
