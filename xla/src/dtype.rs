//! Element types shared by the graph builder and the runtime.

use std::fmt;

/// The element type of a traced tensor or a device buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F64,
    F32,
    BF16,
    F16,
    I64,
    I32,
    U32,
    U8,
    Bool,
}

impl DType {
    /// Bytes per element on the host (a `bool` is one byte, as PJRT stores `PRED`).
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }

    /// The MLIR spelling used in StableHLO tensor types (`tensor<4x8xf32>`).
    pub fn mlir(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U32 => "ui32",
            DType::U8 => "ui8",
            DType::Bool => "i1",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::BF16 | DType::F16)
    }

    pub fn is_integer(self) -> bool {
        matches!(self, DType::I64 | DType::I32 | DType::U32 | DType::U8)
    }

    pub fn is_signed_integer(self) -> bool {
        matches!(self, DType::I64 | DType::I32)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U8 => "u8",
            DType::Bool => "bool",
        };
        f.write_str(name)
    }
}

impl DType {
    /// Every element type, in the order [`DType`] declares them.
    pub const ALL: [DType; 9] = [
        DType::F64,
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::I64,
        DType::I32,
        DType::U32,
        DType::U8,
        DType::Bool,
    ];
}

/// A name that is not a [`DType`]'s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownDType(pub String);

impl fmt::Display for UnknownDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = DType::ALL.iter().map(|d| d.to_string()).collect();
        write!(
            f,
            "unknown element type {:?}; use one of {}",
            self.0,
            names.join(", ")
        )
    }
}

impl std::error::Error for UnknownDType {}

/// The names [`DType`] displays as (`f32`, `bf16`, ...), in any case.
impl std::str::FromStr for DType {
    type Err = UnknownDType;

    fn from_str(s: &str) -> Result<DType, UnknownDType> {
        DType::ALL
            .into_iter()
            .find(|d| d.to_string().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownDType(s.to_string()))
    }
}

/// A host element type that can be copied to and from a device buffer as is.
///
/// # Safety
/// `DTYPE` must describe the exact in-memory layout of `Self`.
pub unsafe trait NativeType: Copy + Send + Sync + 'static {
    const DTYPE: DType;
}

unsafe impl NativeType for f64 {
    const DTYPE: DType = DType::F64;
}
unsafe impl NativeType for f32 {
    const DTYPE: DType = DType::F32;
}
unsafe impl NativeType for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
unsafe impl NativeType for half::f16 {
    const DTYPE: DType = DType::F16;
}
unsafe impl NativeType for i64 {
    const DTYPE: DType = DType::I64;
}
unsafe impl NativeType for i32 {
    const DTYPE: DType = DType::I32;
}
unsafe impl NativeType for u32 {
    const DTYPE: DType = DType::U32;
}
unsafe impl NativeType for u8 {
    const DTYPE: DType = DType::U8;
}
unsafe impl NativeType for bool {
    const DTYPE: DType = DType::Bool;
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_dtype_parses_from_its_display_name() {
        for d in super::DType::ALL {
            assert_eq!(d.to_string().parse::<super::DType>(), Ok(d));
            assert_eq!(d.to_string().to_uppercase().parse::<super::DType>(), Ok(d));
        }
        let err = "float32".parse::<super::DType>().unwrap_err().to_string();
        assert!(err.contains("\"float32\"") && err.contains("f32, bf16"), "{err}");
    }

    use super::*;

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::F32.size_bytes(), std::mem::size_of::<f32>());
        assert_eq!(DType::BF16.size_bytes(), std::mem::size_of::<half::bf16>());
        assert_eq!(DType::Bool.size_bytes(), std::mem::size_of::<bool>());
        assert_eq!(DType::I64.size_bytes(), std::mem::size_of::<i64>());
    }
}
