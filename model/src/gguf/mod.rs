//! GGUF files (llama.cpp's format): header, metadata of every value type, tensor infos, and
//! weights dequantised to f32 (this module, the container), mapped onto Hugging Face names with
//! llama.cpp's Q/K row permutation undone for the Llama architecture ([`hf`]). The file is memory-mapped; every offset is
//! bounds-checked so a truncated or corrupt file gives an error, never a crash.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{ModelError, Result};
use crate::quants;

mod hf;

pub use hf::{hf_name, unpermute_rows};

/// A metadata value (GGUF value types 0..=12).
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7.
    Bool(bool),
    /// Type 8 (UTF-8; invalid bytes are replaced).
    String(String),
    /// Type 9: a typed array.
    Array(Vec<GgufValue>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            GgufValue::I8(v) => Some(v as f64),
            GgufValue::I16(v) => Some(v as f64),
            GgufValue::I32(v) => Some(v as f64),
            GgufValue::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a string slice, if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// A short name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::F32(_) => "f32",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F64(_) => "f64",
        }
    }
}

/// ggml tensor types (the ids of `enum ggml_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 0
    F32,
    /// 1
    F16,
    /// 2
    Q4_0,
    /// 3
    Q4_1,
    /// 8
    Q8_0,
    /// 12
    Q4K,
    /// 13
    Q5K,
    /// 14
    Q6K,
    /// 30
    BF16,
    /// Any other id (known to ggml or not): not supported here.
    Other(u32),
}

const SUPPORTED_GGML_TYPES: &str = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K";

impl GgmlType {
    /// From the id stored in the file.
    pub fn from_id(id: u32) -> GgmlType {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            other => GgmlType::Other(other),
        }
    }

    /// ggml's name of the type.
    pub fn name(self) -> String {
        let known = match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::BF16 => "BF16",
            GgmlType::Other(id) => {
                let name = match id {
                    6 => "Q5_0",
                    7 => "Q5_1",
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    15 => "Q8_K",
                    16 => "IQ2_XXS",
                    17 => "IQ2_XS",
                    18 => "IQ3_XXS",
                    19 => "IQ1_S",
                    20 => "IQ4_NL",
                    21 => "IQ3_S",
                    22 => "IQ2_S",
                    23 => "IQ4_XS",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    29 => "IQ1_M",
                    34 => "TQ1_0",
                    35 => "TQ2_0",
                    39 => "MXFP4",
                    _ => return format!("unknown ggml type id {id}"),
                };
                return format!("{name} (ggml type id {id})");
            }
        };
        known.to_string()
    }

    /// `(values per block, bytes per block)`, or `None` for an unsupported type.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        match self {
            GgmlType::F32 => Some((1, 4)),
            GgmlType::F16 | GgmlType::BF16 => Some((1, 2)),
            GgmlType::Q4_0 => Some((32, 18)),
            GgmlType::Q4_1 => Some((32, 20)),
            GgmlType::Q8_0 => Some((32, 34)),
            GgmlType::Q4K => Some((256, 144)),
            GgmlType::Q5K => Some((256, 176)),
            GgmlType::Q6K => Some((256, 210)),
            GgmlType::Other(_) => None,
        }
    }

    /// Dequantises `bytes` (whole blocks) into `out`; `out.len()` values.
    pub fn dequantize(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            GgmlType::F32 => quants::dequant_f32(bytes, out),
            GgmlType::F16 => quants::dequant_f16(bytes, out),
            GgmlType::BF16 => quants::dequant_bf16(bytes, out),
            GgmlType::Q4_0 => quants::dequant_q4_0(bytes, out),
            GgmlType::Q4_1 => quants::dequant_q4_1(bytes, out),
            GgmlType::Q8_0 => quants::dequant_q8_0(bytes, out),
            GgmlType::Q4K => quants::dequant_q4_k(bytes, out),
            GgmlType::Q5K => quants::dequant_q5_k(bytes, out),
            GgmlType::Q6K => quants::dequant_q6_k(bytes, out),
            GgmlType::Other(_) => unreachable!("unsupported types are rejected before dequantising"),
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    /// GGUF name (`blk.0.attn_q.weight`).
    pub name: String,
    /// ggml dimensions, innermost first (`[in_features, out_features]` for a matrix).
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Shape in row-major (PyTorch / Hugging Face) order: the ggml dims reversed.
    pub fn hf_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An opened, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    /// Format version (2 or 3).
    pub version: u32,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_start: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Bounds-checked little-endian reader over the mapped bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn corrupt(&self, detail: String) -> ModelError {
        ModelError::CorruptGguf {
            path: self.path.to_path_buf(),
            detail,
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.corrupt(format!(
                "unexpected end of file at byte {} while reading {what} ({n} bytes needed, file is {} bytes): the file is truncated",
                self.pos,
                self.bytes.len()
            ))),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("length checked"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length that must fit in the rest of the file (at `min_bytes_each` bytes per item).
    fn count(&mut self, what: &str, min_bytes_each: usize) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let remaining = (self.bytes.len() - self.pos) as u64;
        if n.saturating_mul(min_bytes_each as u64) > remaining {
            return Err(self.corrupt(format!(
                "{what} at byte {at} is {n}, more than the {remaining} bytes left in the file allow: the file is corrupt or truncated"
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(what, 1)?;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }

    fn value(&mut self, type_id: u32, key: &str, depth: usize) -> Result<GgufValue> {
        let what = format!("the value of `{key}`");
        Ok(match type_id {
            0 => GgufValue::U8(self.array::<1>(&what)?[0]),
            1 => GgufValue::I8(self.array::<1>(&what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => GgufValue::U32(self.u32(&what)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => GgufValue::Bool(self.array::<1>(&what)?[0] != 0),
            8 => GgufValue::String(self.string(&what)?),
            9 if depth == 0 => {
                let element_type = self.u32(&what)?;
                let min_size = match element_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    _ => 8,
                };
                let n = self.count(&format!("the length of array `{key}`"), min_size)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(element_type, key, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(&what)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(&what)?)),
            other => {
                return Err(self.corrupt(format!(
                    "metadata key `{key}` has value type {other} at byte {}, which is not a GGUF value type (0..=12, arrays not nested): the file is corrupt",
                    self.pos
                )))
            }
        })
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file (header, metadata, tensor infos); checks that every tensor's
    /// data lies inside the file and that its row length is whole blocks.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).map_err(|e| ModelError::io("opening", path, e))?;
        // SAFETY: the map is read-only; the file is not expected to change while open (the same
        // assumption every mmap-based model loader makes).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io("mapping", path, e))?;
        let mut c = Cursor {
            bytes: &mmap,
            pos: 0,
            path,
        };
        let magic = c.take(4, "the magic number")?;
        if magic != b"GGUF" {
            return Err(c.corrupt(format!(
                "the file starts with {magic:?}, not the GGUF magic \"GGUF\""
            )));
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(c.corrupt(format!(
                "GGUF version {version} is not supported (supported: 2, 3)"
            )));
        }
        let n_tensors = c.count("the tensor count", 8 + 4 + 8 + 4)?;
        let n_kv = c.count("the metadata count", 8 + 4 + 1)?;
        let mut metadata = Vec::with_capacity(n_kv);
        for _ in 0..n_kv {
            let key = c.string("a metadata key")?;
            let type_id = c.u32(&format!("the type of `{key}`"))?;
            let value = c.value(type_id, &key, 0)?;
            metadata.push((key, value));
        }
        let metadata_index: HashMap<String, usize> = metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("a tensor name")?;
            let n_dims = c.u32(&format!("the rank of tensor `{name}`"))?;
            if n_dims == 0 || n_dims > 4 {
                return Err(c.corrupt(format!(
                    "tensor `{name}` has rank {n_dims}; GGUF tensors have rank 1..=4"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&format!("the dimensions of tensor `{name}`"))?);
            }
            let ggml_type = GgmlType::from_id(c.u32(&format!("the type of tensor `{name}`"))?);
            let offset = c.u64(&format!("the data offset of tensor `{name}`"))?;
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let alignment = match metadata_index.get("general.alignment") {
            Some(&i) => metadata[i]
                .1
                .as_u64()
                .filter(|a| *a > 0)
                .ok_or_else(|| c.corrupt("general.alignment is not a positive integer".to_string()))?
                as usize,
            None => 32,
        };
        let data_start = c.pos.div_ceil(alignment) * alignment;
        let file_len = mmap.len();
        for t in &tensors {
            let Some((block_values, block_bytes)) = t.ggml_type.block_layout() else {
                continue; // reported when the tensor is read
            };
            if t.dims[0] % block_values as u64 != 0 {
                return Err(c.corrupt(format!(
                    "tensor `{}` ({}) has rows of {} values, not a multiple of the block size {block_values}",
                    t.name,
                    t.ggml_type.name(),
                    t.dims[0]
                )));
            }
            let bytes = t
                .numel()
                .checked_div(block_values as u64)
                .and_then(|blocks| blocks.checked_mul(block_bytes as u64));
            let start = (data_start as u64).checked_add(t.offset);
            let end = start.zip(bytes).and_then(|(s, b)| s.checked_add(b));
            match (start, end) {
                (Some(_), Some(end)) if end <= file_len as u64 => {}
                (start, end) => {
                    return Err(c.corrupt(format!(
                        "tensor `{}` ({}, dims {:?}) needs bytes {}..{} but the file has {file_len} bytes: the file is truncated",
                        t.name,
                        t.ggml_type.name(),
                        t.dims,
                        start.map_or("overflow".to_string(), |s| s.to_string()),
                        end.map_or("overflow".to_string(), |e| e.to_string()),
                    )))
                }
            }
        }
        let tensor_index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            version,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            data_start,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// All metadata, in file order.
    pub fn metadata_entries(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// One metadata value.
    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn metadata_error(&self, key: &str, problem: String) -> ModelError {
        ModelError::GgufMetadata {
            path: self.path.clone(),
            key: key.to_string(),
            problem,
        }
    }

    fn required(&self, key: &str) -> Result<&GgufValue> {
        self.metadata(key)
            .ok_or_else(|| self.metadata_error(key, "missing".into()))
    }

    /// A required string value.
    pub fn metadata_str(&self, key: &str) -> Result<&str> {
        let v = self.required(key)?;
        v.as_str()
            .ok_or_else(|| self.metadata_error(key, format!("expected a string, found {}", v.type_name())))
    }

    /// A required non-negative integer value (any integer width).
    pub fn metadata_usize(&self, key: &str) -> Result<usize> {
        let v = self.required(key)?;
        v.as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| self.metadata_error(key, format!("expected a non-negative integer, found {v:?}")))
    }

    /// A required numeric value.
    pub fn metadata_f64(&self, key: &str) -> Result<f64> {
        let v = self.required(key)?;
        v.as_f64()
            .ok_or_else(|| self.metadata_error(key, format!("expected a number, found {}", v.type_name())))
    }

    /// A required array of strings.
    pub fn metadata_strings(&self, key: &str) -> Result<Vec<&str>> {
        match self.required(key)? {
            GgufValue::Array(items) => items
                .iter()
                .map(|v| {
                    v.as_str().ok_or_else(|| {
                        self.metadata_error(
                            key,
                            format!("expected an array of strings, found a {} element", v.type_name()),
                        )
                    })
                })
                .collect(),
            v => Err(self.metadata_error(key, format!("expected an array, found {}", v.type_name()))),
        }
    }

    /// A required array of integers.
    pub fn metadata_ints(&self, key: &str) -> Result<Vec<i64>> {
        match self.required(key)? {
            GgufValue::Array(items) => items
                .iter()
                .map(|v| {
                    v.as_f64()
                        .filter(|x| x.fract() == 0.0)
                        .map(|x| x as i64)
                        .ok_or_else(|| {
                            self.metadata_error(
                                key,
                                format!("expected an array of integers, found a {} element", v.type_name()),
                            )
                        })
                })
                .collect(),
            v => Err(self.metadata_error(key, format!("expected an array, found {}", v.type_name()))),
        }
    }

    /// All tensor infos, in file order.
    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// One tensor's info by GGUF name.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (bounds were checked when the file was opened).
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> Result<&[u8]> {
        let (block_values, block_bytes) = self.check_supported(info)?;
        let start = self.data_start + info.offset as usize;
        let len = info.numel() as usize / block_values * block_bytes;
        Ok(&self.mmap[start..start + len])
    }

    fn check_supported(&self, info: &GgufTensorInfo) -> Result<(usize, usize)> {
        info.ggml_type
            .block_layout()
            .ok_or_else(|| ModelError::UnsupportedDType {
                name: info.name.clone(),
                dtype: info.ggml_type.name(),
                origin: self.path.display().to_string(),
                supported: SUPPORTED_GGML_TYPES.to_string(),
            })
    }

    /// Dequantises one tensor to f32 values in ggml order (rows of `dims[0]` values).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.tensor_info(name).ok_or_else(|| ModelError::MissingTensor {
            name: name.to_string(),
            expected: vec![],
            origin: self.path.display().to_string(),
        })?;
        let bytes = self.tensor_bytes(info)?;
        let mut out = vec![0f32; info.numel() as usize];
        info.ggml_type.dequantize(bytes, &mut out);
        Ok(out)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::{Family, ModelConfig};
    use crate::safetensors_io::ModelWeights;
    use crate::tensor::HostTensor;

    /// Writes a GGUF v3 file from metadata and (name, dims, type id, raw bytes) tensors.
    pub(crate) fn write_gguf(
        path: &Path,
        metadata: &[(&str, u32, Vec<u8>)],
        tensors: &[(&str, Vec<u64>, u32, Vec<u8>)],
    ) {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((metadata.len() as u64).to_le_bytes());
        let string = |s: &str| -> Vec<u8> {
            let mut v = (s.len() as u64).to_le_bytes().to_vec();
            v.extend(s.as_bytes());
            v
        };
        for (key, type_id, value) in metadata {
            out.extend(string(key));
            out.extend(type_id.to_le_bytes());
            out.extend(value);
        }
        let mut offset = 0u64;
        let mut blobs = Vec::new();
        for (name, dims, type_id, bytes) in tensors {
            out.extend(string(name));
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(type_id.to_le_bytes());
            out.extend(offset.to_le_bytes());
            let mut blob = bytes.clone();
            blob.resize(bytes.len().div_ceil(32) * 32, 0);
            offset += blob.len() as u64;
            blobs.push(blob);
        }
        out.resize(out.len().div_ceil(32) * 32, 0);
        for b in blobs {
            out.extend(b);
        }
        std::fs::write(path, out).unwrap();
    }

    pub(crate) fn gguf_string(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend(s.as_bytes());
        v
    }

    #[test]
    fn reads_every_value_type_and_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let mut array = 8u32.to_le_bytes().to_vec(); // array of strings
        array.extend(2u64.to_le_bytes());
        array.extend(gguf_string("a"));
        array.extend(gguf_string("bé"));
        let mut int_array = 5u32.to_le_bytes().to_vec();
        int_array.extend(3u64.to_le_bytes());
        for v in [1i32, -2, 3] {
            int_array.extend(v.to_le_bytes());
        }
        let metadata = vec![
            ("u8", 0, vec![200]),
            ("i8", 1, vec![0xFF]),
            ("u16", 2, 60000u16.to_le_bytes().to_vec()),
            ("i16", 3, (-300i16).to_le_bytes().to_vec()),
            ("u32", 4, 7u32.to_le_bytes().to_vec()),
            ("i32", 5, (-7i32).to_le_bytes().to_vec()),
            ("f32", 6, 1.5f32.to_le_bytes().to_vec()),
            ("bool", 7, vec![1]),
            ("str", 8, gguf_string("hello")),
            ("arr", 9, array),
            ("ints", 9, int_array),
            ("u64", 10, (1u64 << 40).to_le_bytes().to_vec()),
            ("i64", 11, (-5i64).to_le_bytes().to_vec()),
            ("f64", 12, 0.25f64.to_le_bytes().to_vec()),
        ];
        let f32_bytes: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let bf16_bytes: Vec<u8> = [0.5f32, -1.0]
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect();
        write_gguf(
            &path,
            &metadata,
            &[
                ("m", vec![3, 2], 0, f32_bytes),
                ("b", vec![2], 30, bf16_bytes),
                ("q", vec![32], 7, vec![0u8; 24]), // Q5_1: not supported
            ],
        );
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.metadata("u8"), Some(&GgufValue::U8(200)));
        assert_eq!(g.metadata("i8"), Some(&GgufValue::I8(-1)));
        assert_eq!(g.metadata("u16"), Some(&GgufValue::U16(60000)));
        assert_eq!(g.metadata("i16"), Some(&GgufValue::I16(-300)));
        assert_eq!(g.metadata_usize("u32").unwrap(), 7);
        assert_eq!(g.metadata("i32"), Some(&GgufValue::I32(-7)));
        assert_eq!(g.metadata_f64("f32").unwrap(), 1.5);
        assert_eq!(g.metadata("bool"), Some(&GgufValue::Bool(true)));
        assert_eq!(g.metadata_str("str").unwrap(), "hello");
        assert_eq!(g.metadata_strings("arr").unwrap(), vec!["a", "bé"]);
        assert_eq!(g.metadata_ints("ints").unwrap(), vec![1, -2, 3]);
        assert_eq!(g.metadata_usize("u64").unwrap(), 1 << 40);
        assert_eq!(g.metadata("i64"), Some(&GgufValue::I64(-5)));
        assert_eq!(g.metadata_f64("f64").unwrap(), 0.25);
        let e = g.metadata_usize("i32").unwrap_err().to_string();
        assert!(
            e.contains("metadata key `i32`: expected a non-negative integer, found I32(-7)"),
            "{e}"
        );
        let e = g.metadata_str("nope").unwrap_err().to_string();
        assert!(e.ends_with("metadata key `nope`: missing"), "{e}");
        assert_eq!(g.tensor_info("m").unwrap().hf_shape(), vec![2, 3]);
        assert_eq!(g.tensor_f32("m").unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(g.tensor_f32("b").unwrap(), vec![0.5, -1.0]);
        let e = g.tensor_f32("q").unwrap_err().to_string();
        assert!(
            e.contains("tensor `q`")
                && e.contains(
                    "has type Q5_1 (ggml type id 7), which is not supported; supported: F32, F16, BF16"
                ),
            "{e}"
        );
    }

    #[test]
    fn truncated_and_corrupt_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let data: Vec<u8> = (0..64u32).flat_map(|x| (x as f32).to_le_bytes()).collect();
        write_gguf(
            &path,
            &[("general.architecture", 8, gguf_string("llama"))],
            &[("w", vec![8, 8], 0, data)],
        );
        let full = std::fs::read(&path).unwrap();
        // Cut inside the tensor data.
        std::fs::write(&path, &full[..full.len() - 10]).unwrap();
        let e = GgufFile::open(&path).unwrap_err().to_string();
        assert!(
            e.contains("tensor `w` (F32, dims [8, 8]) needs bytes") && e.contains("the file is truncated"),
            "{e}"
        );
        // Cut inside the metadata.
        std::fs::write(&path, &full[..30]).unwrap();
        let e = GgufFile::open(&path).unwrap_err().to_string();
        assert!(
            e.contains("not a valid GGUF file") && e.contains("truncated"),
            "{e}"
        );
        // Wrong magic.
        std::fs::write(&path, b"GGML\x03\0\0\0").unwrap();
        let e = GgufFile::open(&path).unwrap_err().to_string();
        assert!(e.contains("not the GGUF magic"), "{e}");
        // A huge string length is caught before allocating.
        let mut bad = full.clone();
        bad[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&path, &bad).unwrap();
        let e = GgufFile::open(&path).unwrap_err().to_string();
        assert!(
            e.contains("a metadata key at byte 24 is 18446744073709551615"),
            "{e}"
        );
    }

    /// llama.cpp's permutation of q/k rows (convert_hf_to_gguf.py `permute`): HF row
    /// `h*hd + j*hd/2 + i` goes to row `h*hd + 2*i + j`.
    fn permute_rows(values: &[f32], n_heads: usize, row_len: usize) -> Vec<f32> {
        let head_dim = values.len() / row_len / n_heads;
        let half = head_dim / 2;
        let mut out = vec![0f32; values.len()];
        for h in 0..n_heads {
            for j in 0..2 {
                for i in 0..half {
                    let src = h * head_dim + j * half + i;
                    let dst = h * head_dim + 2 * i + j;
                    out[dst * row_len..(dst + 1) * row_len]
                        .copy_from_slice(&values[src * row_len..(src + 1) * row_len]);
                }
            }
        }
        out
    }

    fn gguf_name(hf: &str) -> String {
        let table = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ];
        if let Some((_, g)) = table.iter().find(|(h, _)| *h == hf) {
            return g.to_string();
        }
        let rest = hf.strip_prefix("model.layers.").unwrap();
        let (layer, rest) = rest.split_once('.').unwrap();
        let (kind, suffix) = rest.rsplit_once('.').unwrap();
        let kind = match kind {
            "input_layernorm" => "attn_norm",
            "post_attention_layernorm" => "ffn_norm",
            "self_attn.q_proj" => "attn_q",
            "self_attn.k_proj" => "attn_k",
            "self_attn.v_proj" => "attn_v",
            "self_attn.o_proj" => "attn_output",
            "self_attn.q_norm" => "attn_q_norm",
            "self_attn.k_norm" => "attn_k_norm",
            "mlp.gate_proj" => "ffn_gate",
            "mlp.up_proj" => "ffn_up",
            "mlp.down_proj" => "ffn_down",
            other => panic!("{other}"),
        };
        format!("blk.{layer}.{kind}.{suffix}")
    }

    /// Writes `weights` as an F32 GGUF the way llama.cpp's converter would (q/k permuted for llama).
    fn write_model_gguf(path: &Path, weights: &ModelWeights) {
        let c = &weights.config;
        let arch = c.family.model_type();
        let u32v = |v: usize| (v as u32).to_le_bytes().to_vec();
        let f32v = |v: f64| (v as f32).to_le_bytes().to_vec();
        const U32: u32 = 4;
        const F32: u32 = 6;
        let per_arch: [(&str, u32, Vec<u8>); 10] = [
            ("block_count", U32, u32v(c.num_hidden_layers)),
            ("embedding_length", U32, u32v(c.hidden_size)),
            ("feed_forward_length", U32, u32v(c.intermediate_size)),
            ("attention.head_count", U32, u32v(c.num_attention_heads)),
            ("attention.head_count_kv", U32, u32v(c.num_key_value_heads)),
            ("attention.key_length", U32, u32v(c.head_dim)),
            ("rope.freq_base", F32, f32v(c.rope_theta)),
            ("attention.layer_norm_rms_epsilon", F32, f32v(c.rms_norm_eps)),
            ("context_length", U32, u32v(c.max_position_embeddings)),
            ("vocab_size", U32, u32v(c.vocab_size)),
        ];
        let keys: Vec<String> = per_arch.iter().map(|(k, _, _)| format!("{arch}.{k}")).collect();
        let mut metadata: Vec<(&str, u32, Vec<u8>)> = vec![
            ("general.architecture", 8, gguf_string(arch)),
            ("tokenizer.ggml.bos_token_id", U32, u32v(0)),
            ("tokenizer.ggml.eos_token_id", U32, u32v(1)),
        ];
        metadata.extend(
            keys.iter()
                .zip(per_arch)
                .map(|(key, (_, type_id, value))| (key.as_str(), type_id, value)),
        );
        let tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = weights
            .tensors
            .iter()
            .map(|t| {
                let mut values = t.to_f32_vec();
                let name = gguf_name(&t.name);
                if c.family == Family::Llama {
                    let row_len = if t.shape.len() == 2 { t.shape[1] } else { 1 };
                    if name.contains("attn_q.") {
                        values = permute_rows(&values, c.num_attention_heads, row_len);
                    } else if name.contains("attn_k.") {
                        values = permute_rows(&values, c.num_key_value_heads, row_len);
                    }
                }
                let dims = t.shape.iter().rev().map(|&d| d as u64).collect();
                (
                    name,
                    dims,
                    0,
                    values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                )
            })
            .collect();
        let tensor_refs: Vec<(&str, Vec<u64>, u32, Vec<u8>)> = tensors
            .iter()
            .map(|(n, d, t, b)| (n.as_str(), d.clone(), *t, b.clone()))
            .collect();
        write_gguf(path, &metadata, &tensor_refs);
    }

    #[test]
    fn model_gguf_round_trip_for_every_family() {
        use crate::init::tests_support::tiny_config;
        let dir = tempfile::tempdir().unwrap();
        for (family, tied) in [
            (Family::Llama, false),
            (Family::Qwen2, true),
            (Family::Qwen3, false),
        ] {
            let mut config = tiny_config();
            config.family = family;
            config.tie_word_embeddings = tied;
            config.attention_bias = family == Family::Qwen2;
            config.qk_norm = family == Family::Qwen3;
            config.head_dim = if family == Family::Qwen3 { 32 } else { 16 };
            config.bos_token_id = Some(0);
            config.eos_token_ids = vec![1];
            config.initializer_range = 0.02;
            config.rms_norm_eps = 1e-6;
            config.rope_theta = 10000.0;
            let mut weights = crate::init::random_init(&config, 11);
            // Non-trivial biases and norms, so a mix-up cannot pass.
            for t in weights.tensors.iter_mut().filter(|t| {
                !t.name.ends_with("proj.weight")
                    && !t.name.contains("embed")
                    && !t.name.starts_with("lm_head")
            }) {
                let n = t.numel();
                *t = HostTensor::from_f32(
                    t.name.clone(),
                    t.shape.clone(),
                    &(0..n).map(|i| 0.5 + i as f32 * 0.01).collect::<Vec<_>>(),
                );
            }
            let path = dir.path().join(format!("{family}.gguf"));
            write_model_gguf(&path, &weights);
            let gguf = GgufFile::open(&path).unwrap();
            let parsed = ModelConfig::from_gguf(&gguf).unwrap();
            assert_eq!(parsed.family, family);
            assert_eq!(parsed.tie_word_embeddings, tied);
            assert_eq!(
                (parsed.attention_bias, parsed.qk_norm, parsed.head_dim),
                (config.attention_bias, config.qk_norm, config.head_dim)
            );
            assert_eq!(
                (parsed.bos_token_id, parsed.eos_token_ids.clone()),
                (Some(0), vec![1])
            );
            let loaded = gguf.load_weights(&parsed).unwrap();
            assert_eq!(loaded.tensors, weights.tensors, "{family}");
        }
    }

    #[test]
    fn model_gguf_errors() {
        use crate::init::tests_support::tiny_config;
        let dir = tempfile::tempdir().unwrap();
        let mut config = tiny_config();
        config.family = Family::Llama;
        config.attention_bias = false;
        let weights = crate::init::random_init(&config, 1);
        let path = dir.path().join("m.gguf");
        write_model_gguf(&path, &weights);
        let gguf = GgufFile::open(&path).unwrap();
        let parsed = ModelConfig::from_gguf(&gguf).unwrap();
        // A config that expects QKV bias: the bias tensors are missing.
        let mut with_bias = parsed.clone();
        with_bias.attention_bias = true;
        let e = gguf.load_weights(&with_bias).unwrap_err().to_string();
        assert!(
            e.starts_with(
                "tensor `model.layers.0.self_attn.q_proj.bias` (expected shape [64]) is missing from"
            ),
            "{e}"
        );
        // A config with a wider MLP: shapes differ.
        let mut wider = parsed.clone();
        wider.intermediate_size = 256;
        let e = gguf.load_weights(&wider).unwrap_err().to_string();
        assert!(
            e.contains("tensor `model.layers.0.mlp.gate_proj.weight (GGUF blk.0.ffn_gate.weight)`")
                && e.contains("has shape [128, 64], expected [256, 64] from the config"),
            "{e}"
        );
        // An architecture this crate does not implement.
        write_gguf(&path, &[("general.architecture", 8, gguf_string("gemma2"))], &[]);
        let e = ModelConfig::from_gguf(&GgufFile::open(&path).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("unsupported model architecture `gemma2` in")
                && e.contains("(general.architecture); supported: llama (LlamaForCausalLM)"),
            "{e}"
        );
        // A tensor this crate does not map.
        write_gguf(
            &path,
            &[],
            &[("blk.0.ffn_shexp.weight", vec![8], 0, vec![0u8; 32])],
        );
        let e = GgufFile::open(&path)
            .unwrap()
            .load_weights(&parsed)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("unexpected tensor `blk.0.ffn_shexp.weight` (shape [8])"),
            "{e}"
        );
        // A router in a dense model's file: named by both names.
        write_gguf(
            &path,
            &[],
            &[("blk.0.ffn_gate_inp.weight", vec![8], 0, vec![0u8; 32])],
        );
        let e = GgufFile::open(&path)
            .unwrap()
            .load_weights(&parsed)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "unexpected tensor `model.layers.0.mlp.gate.weight (GGUF blk.0.ffn_gate_inp.weight)`"
            ),
            "{e}"
        );
        // Mixtral's layout: a llama GGUF with experts.
        write_gguf(
            &path,
            &[
                ("general.architecture", 8, gguf_string("llama")),
                ("llama.expert_count", 4, 8u32.to_le_bytes().to_vec()),
            ],
            &[],
        );
        let e = ModelConfig::from_gguf(&GgufFile::open(&path).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("key `llama.expert_count`: a mixture-of-experts `llama` GGUF (Mixtral's layout) is not supported"), "{e}");
        // Llama 3.1 RoPE factors stored as a tensor.
        write_gguf(&path, &[], &[("rope_freqs.weight", vec![8], 0, vec![0u8; 32])]);
        let e = GgufFile::open(&path)
            .unwrap()
            .load_weights(&parsed)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tensor rope_freqs.weight (Llama 3.1 RoPE scaling factors) is not supported"),
            "{e}"
        );
    }

    #[test]
    fn names_and_unpermute() {
        assert_eq!(
            hf_name(Family::Llama, "blk.12.ffn_down.weight").unwrap(),
            "model.layers.12.mlp.down_proj.weight"
        );
        assert_eq!(
            hf_name(Family::Llama, "blk.0.attn_k_norm.weight").unwrap(),
            "model.layers.0.self_attn.k_norm.weight"
        );
        assert_eq!(
            hf_name(Family::Llama, "blk.0.attn_q.bias").unwrap(),
            "model.layers.0.self_attn.q_proj.bias"
        );
        assert_eq!(hf_name(Family::Llama, "rope_freqs.weight"), None);
        assert_eq!(hf_name(Family::Llama, "blk.x.attn_q.weight"), None);
        // llama.cpp's `ffn_norm` is the MLP's input norm: Llama's post-attention norm, Gemma's
        // pre-feedforward one; Gemma's own post-attention and post-feedforward norms.
        assert_eq!(
            hf_name(Family::Llama, "blk.3.ffn_norm.weight").unwrap(),
            "model.layers.3.post_attention_layernorm.weight"
        );
        for (gguf, hf) in [
            ("ffn_norm", "pre_feedforward_layernorm"),
            ("post_attention_norm", "post_attention_layernorm"),
            ("post_ffw_norm", "post_feedforward_layernorm"),
        ] {
            assert_eq!(
                hf_name(Family::Gemma3, &format!("blk.3.{gguf}.weight")).unwrap(),
                format!("model.layers.3.{hf}.weight")
            );
        }
        assert_eq!(hf_name(Family::Llama, "blk.3.post_ffw_norm.weight"), None);
        // 1 head, head_dim 4, rows of 1: llama.cpp rows [a0 b0 a1 b1] -> HF [a0 a1 b0 b1].
        assert_eq!(
            unpermute_rows(&[0.0, 10.0, 1.0, 11.0], 1, 1),
            vec![0.0, 1.0, 10.0, 11.0]
        );
        // 2 heads of head_dim 2 with rows of 2 values: nothing moves when head_dim is 2.
        let v: Vec<f32> = (0..8).map(|x| x as f32).collect();
        assert_eq!(unpermute_rows(&v, 2, 2), v);
    }
}
