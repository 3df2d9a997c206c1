//! Compiled programs: argument checks against the program's `@main` signature, asynchronous
//! single-device and SPMD execution, donation bookkeeping, serialization, and the compiled
//! memory statistics and cost analysis the plugin reports.

use std::ptr::{null, null_mut};
use std::sync::Arc;

use super::buffer::Buffer;
use super::error::{Error, Result};
use super::handle::ClientHandle;
use super::plugin::{args, named_value, pjrt_call, NamedValue, Plugin};
use super::sys::*;
use crate::DType;

/// How a program is compiled.
#[derive(Clone, Debug, Default)]
pub struct CompileOptions {
    /// 1 for a single-device program; N for an SPMD program partitioned over N devices
    /// (num_replicas=1, num_partitions=N, use_spmd_partitioning, use_shardy_partitioner).
    /// 0 is treated as 1.
    pub num_partitions: usize,
    /// Argument indices the program donates (`tf.aliasing_output`); the runtime marks those
    /// buffers consumed after execute so later use is a clear error, not a plugin crash.
    /// Arguments not listed here are never donated, even if the program aliases them.
    pub donated_args: Vec<usize>,
}

impl CompileOptions {
    /// `num_partitions` with 0 read as 1.
    pub fn partitions(&self) -> usize {
        self.num_partitions.max(1)
    }
}

/// Encodes the `xla.CompileOptionsProto` for `options` (field numbers from
/// `xla/pjrt/proto/compile_options.proto`):
/// `{executable_build_options(3): {device_ordinal(1)=-1, num_replicas(4)=1, num_partitions(5)=N,
///   [use_spmd_partitioning(6)=true, use_shardy_partitioner(19)=true when N > 1]},
///   compile_portable_executable(4)=portable}`.
/// A portable single-device executable runs on whichever device its arguments are on.
pub fn compile_options_proto(options: &CompileOptions, portable: bool) -> Vec<u8> {
    let partitions = options.partitions() as u64;
    let mut build = Vec::new();
    proto_varint_field(&mut build, 1, (-1i64) as u64);
    proto_varint_field(&mut build, 4, 1);
    proto_varint_field(&mut build, 5, partitions);
    if partitions > 1 {
        proto_varint_field(&mut build, 6, 1);
        proto_varint_field(&mut build, 19, 1);
    }
    let mut out = Vec::new();
    proto_bytes_field(&mut out, 3, &build);
    if portable && partitions == 1 {
        proto_varint_field(&mut out, 4, 1);
    }
    out
}

fn proto_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn proto_varint_field(out: &mut Vec<u8>, field: u32, value: u64) {
    proto_varint(out, (field as u64) << 3);
    proto_varint(out, value);
}

fn proto_bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    proto_varint(out, ((field as u64) << 3) | 2);
    proto_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// The type of one `@main` parameter, as written in the StableHLO text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamType {
    /// The element type, when it is one this crate knows.
    pub dtype: Option<DType>,
    /// The dimensions; `None` when a dimension is dynamic (`?`).
    pub dims: Option<Vec<i64>>,
    /// The tensor type as written (`4x8xf32`).
    pub text: String,
}

/// The name of a program: its `module @name`, else `main`.
pub fn program_name(mlir: &str) -> String {
    if let Some(rest) = mlir.split("module @").nth(1) {
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '.' || *c == '$' || *c == '-')
            .collect();
        if !name.is_empty() {
            return name;
        }
    }
    "main".to_string()
}

fn dtype_from_mlir(text: &str) -> Option<DType> {
    Some(match text {
        "f64" => DType::F64,
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "i64" | "si64" => DType::I64,
        "i32" | "si32" => DType::I32,
        "ui32" => DType::U32,
        "ui8" => DType::U8,
        "i1" => DType::Bool,
        _ => return None,
    })
}

/// Parses the parameters of `func.func ... @main(...)`. `None` when there is no `@main`.
pub fn parse_main_params(mlir: &str) -> Option<Vec<ParamType>> {
    let start = mlir.find("@main(")? + "@main(".len();
    let bytes = mlir.as_bytes();
    let mut depth = 0i32;
    let mut in_string = false;
    let mut pieces = Vec::new();
    let mut piece_start = start;
    let mut i = start;
    while i < bytes.len() {
        let c = bytes[i];
        if in_string {
            if c == b'\\' {
                i += 1;
            } else if c == b'"' {
                in_string = false;
            }
        } else {
            match c {
                b'"' => in_string = true,
                b'(' | b'<' | b'{' | b'[' => depth += 1,
                b'>' if i > 0 && bytes[i - 1] == b'-' => {}
                b')' | b'>' | b'}' | b']' => {
                    if depth == 0 && c == b')' {
                        pieces.push(&mlir[piece_start..i]);
                        break;
                    }
                    depth -= 1;
                }
                b',' if depth == 0 => {
                    pieces.push(&mlir[piece_start..i]);
                    piece_start = i + 1;
                }
                _ => {}
            }
        }
        i += 1;
    }
    let params = pieces
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .map(|piece| {
            let Some(t) = piece.find("tensor<") else {
                return ParamType {
                    dtype: None,
                    dims: None,
                    text: piece.trim().to_string(),
                };
            };
            let inner_start = t + "tensor<".len();
            let mut level = 1;
            let mut end = inner_start;
            for (k, ch) in piece[inner_start..].char_indices() {
                match ch {
                    '<' => level += 1,
                    '>' => {
                        level -= 1;
                        if level == 0 {
                            end = inner_start + k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let text = piece[inner_start..end].to_string();
            // Drop an encoding (`tensor<4xf32, #enc>`).
            let core = text.split(',').next().unwrap_or("").trim();
            let parts: Vec<&str> = core.split('x').collect();
            let (dim_parts, elem) = parts.split_at(parts.len() - 1);
            let dims: Option<Vec<i64>> = dim_parts.iter().map(|d| d.parse::<i64>().ok()).collect();
            ParamType {
                dtype: dtype_from_mlir(elem[0]),
                dims,
                text: core.to_string(),
            }
        })
        .collect();
    Some(params)
}

/// Compiled memory use of a program, per device, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Arguments.
    pub argument_bytes: i64,
    /// Outputs.
    pub output_bytes: i64,
    /// Outputs that alias (reuse) donated arguments.
    pub alias_bytes: i64,
    /// Temporaries.
    pub temp_bytes: i64,
    /// Generated code.
    pub generated_code_bytes: i64,
    /// Peak memory, when the plugin reports it (else -1).
    pub peak_bytes: i64,
}

impl MemoryStats {
    /// The peak the plugin reports, or arguments + outputs - aliases + temporaries + code.
    pub fn peak_or_estimate(&self) -> i64 {
        if self.peak_bytes > 0 {
            self.peak_bytes
        } else {
            self.argument_bytes + self.output_bytes - self.alias_bytes
                + self.temp_bytes
                + self.generated_code_bytes
        }
    }
}

/// The cost analysis of a compiled program (all properties, with the common ones pulled out).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CostAnalysis {
    /// Floating-point operations (`flops`).
    pub flops: Option<f64>,
    /// Bytes read and written (`bytes accessed`).
    pub bytes_accessed: Option<f64>,
    /// Transcendental operations.
    pub transcendentals: Option<f64>,
    /// Every property the plugin reported.
    pub properties: Vec<(String, f64)>,
}

/// Reads the memory stats of an unloaded executable.
pub(crate) fn memory_stats_of(plugin: &Plugin, exe: *mut PJRT_Executable) -> Result<MemoryStats> {
    let mut s = args!(
        PJRT_Executable_GetCompiledMemoryStats_Args,
        PJRT_Executable_GetCompiledMemoryStats_Args_STRUCT_SIZE
    );
    s.executable = exe;
    s.peak_memory_in_bytes = -1;
    pjrt_call!(plugin, PJRT_Executable_GetCompiledMemoryStats, &mut s)?;
    Ok(MemoryStats {
        argument_bytes: s.argument_size_in_bytes,
        output_bytes: s.output_size_in_bytes,
        alias_bytes: s.alias_size_in_bytes,
        temp_bytes: s.temp_size_in_bytes,
        generated_code_bytes: s.generated_code_size_in_bytes,
        peak_bytes: s.peak_memory_in_bytes,
    })
}

/// Reads the cost analysis of an unloaded executable.
pub(crate) fn cost_analysis_of(plugin: &Plugin, exe: *mut PJRT_Executable) -> Result<CostAnalysis> {
    let mut c = args!(
        PJRT_Executable_GetCostAnalysis_Args,
        PJRT_Executable_GetCostAnalysis_Args_STRUCT_SIZE
    );
    c.executable = exe;
    pjrt_call!(plugin, PJRT_Executable_GetCostAnalysis, &mut c)?;
    let mut analysis = CostAnalysis::default();
    if !c.properties.is_null() {
        // SAFETY: num_properties values owned by the executable.
        for v in unsafe { std::slice::from_raw_parts(c.properties, c.num_properties) } {
            let (name, value) = named_value(v);
            if let Some(x) = value.as_f64() {
                match name.as_str() {
                    "flops" => analysis.flops = Some(x),
                    "bytes accessed" => analysis.bytes_accessed = Some(x),
                    "transcendentals" => analysis.transcendentals = Some(x),
                    _ => {}
                }
                analysis.properties.push((name, x));
            } else if let NamedValue::Other(t) = value {
                tracing::debug!("cost property {name} has type {t}");
            }
        }
    }
    Ok(analysis)
}

/// The optimized HLO module of an unloaded executable and its format (`hlo`: a serialized
/// `xla.HloModuleProto`; `hlo_with_config`: one inside an `xla.HloModuleProtoWithConfig`),
/// read in the two calls PJRT asks for: the size, then the bytes.
pub(crate) fn optimized_program_of(plugin: &Plugin, exe: *mut PJRT_Executable) -> Result<(String, Vec<u8>)> {
    let mut program = PJRT_Program {
        struct_size: PJRT_Program_STRUCT_SIZE as usize,
        ..Default::default()
    };
    let mut o = args!(
        PJRT_Executable_OptimizedProgram_Args,
        PJRT_Executable_OptimizedProgram_Args_STRUCT_SIZE
    );
    o.executable = exe;
    o.program = &mut program;
    pjrt_call!(plugin, PJRT_Executable_OptimizedProgram, &mut o)?;
    let mut code = vec![0u8; program.code_size];
    program.code = code.as_mut_ptr() as *mut std::os::raw::c_char;
    o.program = &mut program;
    pjrt_call!(plugin, PJRT_Executable_OptimizedProgram, &mut o)?;
    code.truncate(program.code_size);
    // SAFETY: format_size bytes owned by the plugin.
    let format = unsafe { std::slice::from_raw_parts(program.format as *const u8, program.format_size) };
    Ok((String::from_utf8_lossy(format).into_owned(), code))
}

pub(crate) fn destroy_unloaded(plugin: &Plugin, exe: *mut PJRT_Executable) {
    let mut d = args!(
        PJRT_Executable_Destroy_Args,
        PJRT_Executable_Destroy_Args_STRUCT_SIZE
    );
    d.executable = exe;
    if let Err(e) = pjrt_call!(plugin, PJRT_Executable_Destroy, &mut d) {
        tracing::warn!("{e}");
    }
}

/// The shared part of an [`Executable`].
pub(crate) struct ExecutableInner {
    handle: Arc<ClientHandle>,
    raw: *mut PJRT_LoadedExecutable,
    name: String,
    num_outputs: usize,
    num_partitions: usize,
    params: Option<Vec<ParamType>>,
    donated: Vec<usize>,
}

// SAFETY: PJRT loaded executables are thread-safe.
unsafe impl Send for ExecutableInner {}
// SAFETY: as above.
unsafe impl Sync for ExecutableInner {}

impl Drop for ExecutableInner {
    fn drop(&mut self) {
        let mut d = args!(
            PJRT_LoadedExecutable_Destroy_Args,
            PJRT_LoadedExecutable_Destroy_Args_STRUCT_SIZE
        );
        d.executable = self.raw;
        if let Err(e) = pjrt_call!(&self.handle.plugin, PJRT_LoadedExecutable_Destroy, &mut d) {
            tracing::warn!("{e}");
        }
    }
}

impl ExecutableInner {
    pub(crate) fn wrap(
        handle: Arc<ClientHandle>,
        raw: *mut PJRT_LoadedExecutable,
        mlir: &str,
        options: &CompileOptions,
    ) -> Result<Arc<ExecutableInner>> {
        let mut inner = ExecutableInner {
            handle,
            raw,
            name: program_name(mlir),
            num_outputs: 0,
            num_partitions: options.partitions(),
            params: parse_main_params(mlir),
            donated: options.donated_args.clone(),
        };
        inner.donated.sort_unstable();
        inner.donated.dedup();
        let outputs = inner.with_unloaded(|plugin, exe| {
            let mut n = args!(
                PJRT_Executable_NumOutputs_Args,
                PJRT_Executable_NumOutputs_Args_STRUCT_SIZE
            );
            n.executable = exe;
            pjrt_call!(plugin, PJRT_Executable_NumOutputs, &mut n)?;
            Ok(n.num_outputs)
        })?;
        inner.num_outputs = outputs;
        Ok(Arc::new(inner))
    }

    /// Runs `f` on the unloaded `PJRT_Executable` of this loaded executable.
    fn with_unloaded<R>(&self, f: impl FnOnce(&Plugin, *mut PJRT_Executable) -> Result<R>) -> Result<R> {
        let plugin = &self.handle.plugin;
        let mut g = args!(
            PJRT_LoadedExecutable_GetExecutable_Args,
            PJRT_LoadedExecutable_GetExecutable_Args_STRUCT_SIZE
        );
        g.loaded_executable = self.raw;
        pjrt_call!(plugin, PJRT_LoadedExecutable_GetExecutable, &mut g)?;
        let result = f(plugin, g.executable);
        destroy_unloaded(plugin, g.executable);
        result
    }
}

/// A compiled program loaded on a client's devices. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct Executable {
    inner: Arc<ExecutableInner>,
}

impl std::fmt::Debug for Executable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executable")
            .field("name", &self.inner.name)
            .field("num_outputs", &self.inner.num_outputs)
            .field("num_partitions", &self.inner.num_partitions)
            .finish()
    }
}

impl Executable {
    pub(crate) fn from_inner(inner: Arc<ExecutableInner>) -> Executable {
        Executable { inner }
    }

    /// Whether two handles share one loaded executable (a cache hit returns the same one).
    pub fn same_as(&self, other: &Executable) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The program's name (`module @name`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The number of outputs (the result tuple flattened).
    pub fn num_outputs(&self) -> usize {
        self.inner.num_outputs
    }

    /// The number of devices an execution runs on (1, or N for SPMD).
    pub fn num_partitions(&self) -> usize {
        self.inner.num_partitions
    }

    /// The `@main` parameters, when the text could be parsed.
    pub fn params(&self) -> Option<&[ParamType]> {
        self.inner.params.as_deref()
    }

    /// Run on one device (the device of the arguments). Returns the outputs (the tuple
    /// flattened) without waiting for them to be computed; reading waits.
    pub fn execute(&self, args: &[&Buffer]) -> Result<Vec<Buffer>> {
        let inner = &*self.inner;
        if inner.num_partitions != 1 {
            return Err(Error::WrongDeviceCount {
                program: inner.name.clone(),
                expected: inner.num_partitions,
                got: 1,
                available: inner.handle.devices.len(),
            });
        }
        let device = args.first().map(|b| b.device()).unwrap_or(0);
        self.check_args(args, device, true)?;
        let mut outputs = self.launch(&[args], Some(device))?;
        Ok(outputs.pop().unwrap_or_default())
    }

    /// Run an SPMD program: `args[d]` are device d's (local shard) arguments.
    /// Returns `outputs[d][i]`.
    pub fn execute_spmd(&self, args: &[Vec<&Buffer>]) -> Result<Vec<Vec<Buffer>>> {
        let inner = &*self.inner;
        if args.len() != inner.num_partitions || args.len() > inner.handle.devices.len() {
            return Err(Error::WrongDeviceCount {
                program: inner.name.clone(),
                expected: inner.num_partitions,
                got: args.len(),
                available: inner.handle.devices.len(),
            });
        }
        for (device, list) in args.iter().enumerate() {
            // Shapes in @main are global; shards differ, so only count and dtype are checked.
            self.check_args(list, device, inner.num_partitions == 1)?;
        }
        let lists: Vec<&[&Buffer]> = args.iter().map(|l| l.as_slice()).collect();
        self.launch(&lists, None)
    }

    fn check_args(&self, args: &[&Buffer], device: usize, check_dims: bool) -> Result<()> {
        let inner = &*self.inner;
        if let Some(params) = &inner.params {
            if params.len() != args.len() {
                return Err(Error::WrongArgumentCount {
                    program: inner.name.clone(),
                    expected: params.len(),
                    got: args.len(),
                });
            }
        }
        for (index, arg) in args.iter().enumerate() {
            arg.ensure_live(&format!(
                "argument {index} of `{}` on device {device}",
                inner.name
            ))?;
            if !Arc::ptr_eq(arg.client_handle(), &inner.handle) {
                return Err(Error::Execute {
                    program: inner.name.clone(),
                    message: format!("argument {index} belongs to a different client"),
                });
            }
            if arg.device() != device {
                return Err(Error::ArgumentDevice {
                    program: inner.name.clone(),
                    index,
                    expected: device,
                    got: arg.device(),
                });
            }
            if let Some(param) = inner.params.as_ref().and_then(|p| p.get(index)) {
                let dtype_differs = param.dtype.is_some_and(|d| d != arg.dtype());
                let dims_differ = check_dims
                    && param
                        .dims
                        .as_ref()
                        .is_some_and(|dims| dims.as_slice() != arg.dims());
                if dtype_differs || dims_differ {
                    return Err(Error::ArgumentMismatch {
                        program: inner.name.clone(),
                        index,
                        expected: param.text.clone(),
                        got: tensor_text(arg.dtype(), arg.dims()),
                    });
                }
            }
        }
        Ok(())
    }

    /// Starts an execution over `lists.len()` devices and wraps the outputs; does not wait.
    fn launch(&self, lists: &[&[&Buffer]], device: Option<usize>) -> Result<Vec<Vec<Buffer>>> {
        let inner = &*self.inner;
        let handle = &inner.handle;
        let num_args = lists.first().map(|l| l.len()).unwrap_or(0);
        let arg_ptrs: Vec<Vec<*mut PJRT_Buffer>> = lists
            .iter()
            .map(|l| l.iter().map(|b| b.raw()).collect())
            .collect();
        let arg_lists: Vec<*const *mut PJRT_Buffer> = arg_ptrs.iter().map(|l| l.as_ptr()).collect();
        let mut outputs: Vec<Vec<*mut PJRT_Buffer>> = lists
            .iter()
            .map(|_| vec![null_mut(); inner.num_outputs])
            .collect();
        let output_lists: Vec<*mut *mut PJRT_Buffer> = outputs.iter_mut().map(|l| l.as_mut_ptr()).collect();
        // Arguments not declared donated are never donated.
        let non_donatable: Vec<i64> = (0..num_args as i64)
            .filter(|i| inner.donated.binary_search(&(*i as usize)).is_err())
            .collect();
        let mut options = args!(PJRT_ExecuteOptions, PJRT_ExecuteOptions_STRUCT_SIZE);
        options.non_donatable_input_indices = if non_donatable.is_empty() {
            null()
        } else {
            non_donatable.as_ptr()
        };
        options.num_non_donatable_input_indices = non_donatable.len();
        let mut execute = args!(
            PJRT_LoadedExecutable_Execute_Args,
            PJRT_LoadedExecutable_Execute_Args_STRUCT_SIZE
        );
        execute.executable = inner.raw;
        execute.options = &mut options;
        execute.argument_lists = arg_lists.as_ptr();
        execute.num_devices = lists.len();
        execute.num_args = num_args;
        execute.output_lists = output_lists.as_ptr();
        // No completion events: readers wait on each output's own readiness.
        execute.device_complete_events = null_mut();
        execute.execute_device = match device {
            Some(d) => handle.check_device(d)?,
            None => null_mut(),
        };
        pjrt_call!(&handle.plugin, PJRT_LoadedExecutable_Execute, &mut execute).map_err(|e| {
            Error::Execute {
                program: inner.name.clone(),
                message: e.pjrt_message().unwrap_or_default().to_string(),
            }
        })?;
        for list in lists {
            for &index in &inner.donated {
                if let Some(buffer) = list.get(index) {
                    buffer.mark_donated(&inner.name, index);
                }
            }
        }
        // Wrap every output (each wrapped buffer is freed on drop), then report the first failure.
        let mut result = Vec::with_capacity(lists.len());
        let mut first_error = None;
        for (d, list) in outputs.into_iter().enumerate() {
            let device = device.unwrap_or(d);
            let mut wrapped = Vec::with_capacity(list.len());
            for raw in list {
                match Buffer::from_output(handle.clone(), raw, device) {
                    Ok(b) => wrapped.push(b),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
            result.push(wrapped);
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(result)
    }

    /// Serializes the compiled program (for the on-disk cache); loads back with
    /// [`super::Client::deserialize`] on a client of the same plugin build.
    pub fn serialize(&self) -> Result<Vec<u8>> {
        self.inner.with_unloaded(|plugin, exe| {
            let mut s = args!(
                PJRT_Executable_Serialize_Args,
                PJRT_Executable_Serialize_Args_STRUCT_SIZE
            );
            s.executable = exe;
            pjrt_call!(plugin, PJRT_Executable_Serialize, &mut s)?;
            let bytes = if s.serialized_bytes.is_null() {
                Vec::new()
            } else {
                // SAFETY: serialized_bytes_size bytes owned by serialized_executable.
                unsafe {
                    std::slice::from_raw_parts(s.serialized_bytes as *const u8, s.serialized_bytes_size)
                }
                .to_vec()
            };
            if let Some(deleter) = s.serialized_executable_deleter {
                if !s.serialized_executable.is_null() {
                    // SAFETY: the plugin's deleter for the object it returned.
                    unsafe { deleter(s.serialized_executable) };
                }
            }
            Ok(bytes)
        })
    }

    /// Compiled memory use, per device.
    pub fn memory_stats(&self) -> Result<MemoryStats> {
        self.inner.with_unloaded(memory_stats_of)
    }

    /// The plugin's cost analysis (flops, bytes accessed, ...).
    pub fn cost_analysis(&self) -> Result<CostAnalysis> {
        self.inner.with_unloaded(cost_analysis_of)
    }

    /// Each operation of the optimized program with its bytes and flops
    /// ([`crate::runtime::operations`]).
    pub fn operations(&self) -> Result<Vec<super::hlo::OpCost>> {
        let (format, module) = self.inner.with_unloaded(optimized_program_of)?;
        super::hlo::operations(self.name(), &format, &module)
    }
}

fn tensor_text(dtype: DType, dims: &[i64]) -> String {
    let mut s = String::new();
    for d in dims {
        s.push_str(&d.to_string());
        s.push('x');
    }
    s.push_str(dtype.mlir());
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_main_params_with_attributes() {
        let mlir = r#"module @step attributes {mhlo.num_partitions = 2 : i32} {
  sdy.mesh @mesh = <["x"=2]>
  func.func public @main(%arg0: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>, tf.aliasing_output = 0 : i32}, %arg1: tensor<bf16>, %arg2: tensor<3xi1>, %k: tensor<2xui32>) -> (tensor<4x8xf32>, tensor<f32>) {
    return %arg0 : tensor<4x8xf32>
  }
}"#;
        assert_eq!(program_name(mlir), "step");
        let params = parse_main_params(mlir).unwrap();
        assert_eq!(params.len(), 4);
        assert_eq!(params[0].dtype, Some(DType::F32));
        assert_eq!(params[0].dims, Some(vec![4, 8]));
        assert_eq!(params[1].dims, Some(vec![]));
        assert_eq!(params[1].dtype, Some(DType::BF16));
        assert_eq!(params[2].dtype, Some(DType::Bool));
        assert_eq!(params[3].dtype, Some(DType::U32));
        assert_eq!(params[3].text, "2xui32");
        let none = parse_main_params("module { func.func @main() -> tensor<f32> { } }").unwrap();
        assert!(none.is_empty());
        assert!(parse_main_params("module {}").is_none());
        assert_eq!(program_name("module { }"), "main");
    }

    #[test]
    fn dynamic_dims_are_unchecked() {
        let p = parse_main_params("func.func @main(%a: tensor<?x4xf32>)").unwrap();
        assert_eq!(p[0].dims, None);
        assert_eq!(p[0].dtype, Some(DType::F32));
    }

    #[test]
    fn tensor_text_matches_mlir_spelling() {
        assert_eq!(tensor_text(DType::F32, &[2, 3]), "2x3xf32");
        assert_eq!(tensor_text(DType::U8, &[]), "ui8");
    }
}
