//! The runtime's error type: every failure of plugin discovery, loading, transfers, compilation,
//! execution, the executable cache and deviceless TPU compilation, with what went wrong, where,
//! and what to do about it.

use std::path::PathBuf;

use crate::DType;

/// Result of every fallible runtime call.
pub type Result<T> = std::result::Result<T, Error>;

/// What can go wrong in the PJRT runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No plugin file was found for a device kind.
    #[error(
        "no PJRT plugin for {kind} found: in a grpo checkout, `scripts/setup.sh` installs it \
         into .venv; elsewhere set {env_var}=/path/to/{file_name}, or install the Python \
         package that ships it into a virtual environment: `{pip_command}` (searched: {searched})"
    )]
    PluginNotFound {
        kind: &'static str,
        env_var: &'static str,
        file_name: &'static str,
        package: &'static str,
        pip_command: &'static str,
        searched: String,
    },

    /// An explicitly given plugin path does not exist.
    #[error("PJRT plugin {path} ({origin}) does not exist; fix the path or unset it to search the installed Python packages")]
    PluginPathMissing { path: PathBuf, origin: String },

    /// `dlopen` or `GetPjrtApi` failed.
    #[error("cannot load PJRT plugin {path}: {reason}")]
    PluginLoad { path: PathBuf, reason: String },

    /// The plugin implements an older PJRT C API than this crate needs.
    #[error(
        "PJRT plugin {path} implements PJRT C API {major}.{minor}, older than the {min_major}.{min_minor} \
         this build of grpo needs; install a newer plugin (for example `pip install -U {package}`)"
    )]
    PluginTooOld {
        path: PathBuf,
        major: i32,
        minor: i32,
        min_major: i32,
        min_minor: i32,
        package: &'static str,
    },

    /// The plugin's function table does not reach a function the runtime wanted to call.
    #[error(
        "PJRT plugin {path} (C API {major}.{minor}, PJRT_Api struct_size {struct_size}) has no {function}; \
         install a newer plugin"
    )]
    MissingFunction {
        path: PathBuf,
        function: &'static str,
        major: i32,
        minor: i32,
        struct_size: usize,
    },

    /// A PJRT call returned an error.
    #[error("{function} failed ({code}): {message}")]
    Pjrt {
        function: &'static str,
        code: PjrtErrorCode,
        message: String,
    },

    /// `PJRT_Client_Create` failed; `hint` says what to check.
    #[error("cannot create a {kind} PJRT client from {path}: {message}. {hint}")]
    ClientCreate {
        kind: String,
        path: PathBuf,
        message: String,
        hint: String,
    },

    /// A StableHLO program did not compile.
    #[error("compiling program `{program}` failed: {message}")]
    Compile { program: String, message: String },

    /// A device index outside the client's devices.
    #[error("device {device} does not exist: this {platform} client has {num_devices} device(s) (0..{num_devices})")]
    NoSuchDevice {
        device: usize,
        num_devices: usize,
        platform: String,
    },

    /// Host data does not match the declared dtype and dims.
    #[error(
        "host data for a {dtype}{dims:?} buffer must be {expected_bytes} bytes ({elements} elements), got {got_bytes} bytes"
    )]
    HostDataSize {
        dtype: DType,
        dims: Vec<i64>,
        elements: usize,
        expected_bytes: usize,
        got_bytes: usize,
    },

    /// A negative dimension.
    #[error("invalid buffer dims {dims:?}: every dimension must be >= 0")]
    BadDims { dims: Vec<i64> },

    /// The element type asked for does not match the buffer.
    #[error("buffer holds {actual}{dims:?}, cannot read it as {requested}")]
    DtypeMismatch {
        requested: DType,
        actual: DType,
        dims: Vec<i64>,
    },

    /// The plugin returned an element type that this crate has no `DType` for.
    #[error("{what} has PJRT element type {pjrt_type}, which grpo does not support")]
    UnsupportedElementType { what: String, pjrt_type: u32 },

    /// A buffer was used after it was donated to an execution.
    #[error(
        "{what}: buffer {dtype}{dims:?} on device {device} was donated to `{donated_to}` (argument {argument}) \
         and no longer exists; use that program's output instead"
    )]
    BufferDonated {
        what: String,
        dtype: DType,
        dims: Vec<i64>,
        device: usize,
        donated_to: String,
        argument: usize,
    },

    /// Wrong number of arguments passed to an executable.
    #[error("program `{program}` takes {expected} argument(s), got {got}")]
    WrongArgumentCount {
        program: String,
        expected: usize,
        got: usize,
    },

    /// An argument's dtype or dims differ from the program's parameter.
    #[error("program `{program}` argument {index}: expected tensor<{expected}>, got tensor<{got}>")]
    ArgumentMismatch {
        program: String,
        index: usize,
        expected: String,
        got: String,
    },

    /// An argument lives on a different device than the execution.
    #[error("program `{program}` argument {index} is on device {got}, expected device {expected}")]
    ArgumentDevice {
        program: String,
        index: usize,
        expected: usize,
        got: usize,
    },

    /// SPMD execution with the wrong number of per-device argument lists.
    #[error(
        "program `{program}` is partitioned over {expected} device(s) but execute_spmd got {got} argument list(s) \
         (the client has {available} device(s))"
    )]
    WrongDeviceCount {
        program: String,
        expected: usize,
        got: usize,
        available: usize,
    },

    /// Execution failed.
    #[error("executing program `{program}` failed: {message}")]
    Execute { program: String, message: String },

    /// Reading or writing the on-disk executable cache failed (not fatal for compile).
    #[error("executable cache {path}: {message}")]
    Cache { path: PathBuf, message: String },

    /// An I/O error with the file it concerns.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A TPU topology name libtpu does not accept.
    #[error("TPU topology `{topology}` is not valid: {message}. Use names such as {examples}")]
    BadTopology {
        topology: String,
        message: String,
        examples: String,
    },

    /// `PJRT_Plugin_Initialize` of libtpu returned an error (for example another process holds
    /// libtpu's lock file and `ALLOW_MULTIPLE_LIBTPU_LOAD` forbids a second load); `hint` says
    /// what to do. An unknown flag in `LIBTPU_INIT_ARGS` never arrives here: libtpu prints
    /// `ERROR: Unknown command line flag '...'` and exits the process with status 1.
    #[error("libtpu at {path} could not initialize: {message}. {hint}")]
    TpuInit {
        path: PathBuf,
        message: String,
        hint: String,
    },

    /// A compiled program's optimized HLO could not be read.
    #[error("cannot read the optimized HLO of program `{program}`: {message}")]
    OptimizedHlo { program: String, message: String },
}

/// PJRT error codes (absl status codes), as returned by `PJRT_Error_GetCode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PjrtErrorCode(pub u32);

impl PjrtErrorCode {
    /// The absl name of the code (`INVALID_ARGUMENT`, `RESOURCE_EXHAUSTED`, ...).
    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "OK",
            1 => "CANCELLED",
            2 => "UNKNOWN",
            3 => "INVALID_ARGUMENT",
            4 => "DEADLINE_EXCEEDED",
            5 => "NOT_FOUND",
            6 => "ALREADY_EXISTS",
            7 => "PERMISSION_DENIED",
            8 => "RESOURCE_EXHAUSTED",
            9 => "FAILED_PRECONDITION",
            10 => "ABORTED",
            11 => "OUT_OF_RANGE",
            12 => "UNIMPLEMENTED",
            13 => "INTERNAL",
            14 => "UNAVAILABLE",
            15 => "DATA_LOSS",
            16 => "UNAUTHENTICATED",
            _ => "UNRECOGNIZED",
        }
    }
}

impl std::fmt::Display for PjrtErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

impl Error {
    /// The PJRT message of a [`Error::Pjrt`], [`Error::Compile`] or [`Error::Execute`] error.
    pub fn pjrt_message(&self) -> Option<&str> {
        match self {
            Error::Pjrt { message, .. } | Error::Compile { message, .. } | Error::Execute { message, .. } => {
                Some(message)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_have_absl_names() {
        assert_eq!(PjrtErrorCode(3).to_string(), "INVALID_ARGUMENT (3)");
        assert_eq!(PjrtErrorCode(8).name(), "RESOURCE_EXHAUSTED");
        assert_eq!(PjrtErrorCode(99).name(), "UNRECOGNIZED");
    }

    #[test]
    fn donated_message_says_what_to_do() {
        let e = Error::BufferDonated {
            what: "to_host".into(),
            dtype: DType::F32,
            dims: vec![4],
            device: 0,
            donated_to: "step".into(),
            argument: 1,
        };
        let s = e.to_string();
        assert!(s.contains("donated to `step` (argument 1)"), "{s}");
        assert!(s.contains("use that program's output instead"), "{s}");
    }
}
