#![allow(non_upper_case_globals)]
//! PJRT plugins: where to find them (explicit path, environment variable, installed Python
//! package), loading them once per process (`libloading`), checking the C API version, the
//! environment libtpu needs, preloading the CUDA libraries, and the checked calls into the
//! plugin's `PJRT_Api` function table (never past its `struct_size`).

use super::site::{plugin_site_dirs, PROJECT_VENV};
use std::collections::HashMap;
use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use super::error::{Error, PjrtErrorCode, Result};
use super::sys::*;

/// The oldest PJRT C API (major, minor) this crate works with: the version of the committed
/// header (`xla/pjrt_c_api/pjrt_c_api.h`) the bindings were generated from.
pub const MIN_PJRT_API_VERSION: (i32, i32) = (0, 81);

/// A zero-initialised PJRT argument struct with `struct_size` set to the header's
/// `<T>_STRUCT_SIZE` (as the C macros do).
macro_rules! args {
    ($t:ident, $s:ident) => {{
        // SAFETY: PJRT argument structs are plain C data (pointers, integers, Option<fn>):
        // all-zero is a valid value of each of them.
        let mut a: $t = unsafe { std::mem::zeroed() };
        a.struct_size = $s as usize;
        a
    }};
}
pub(crate) use args;

/// Calls a `PJRT_Api` function of a [`Plugin`] with an argument struct; refuses functions past the
/// plugin's `struct_size` or null, and turns a returned `PJRT_Error` into [`Error::Pjrt`].
macro_rules! pjrt_call {
    ($plugin:expr, $func:ident, $args:expr) => {{
        let plugin: &$crate::runtime::plugin::Plugin = $plugin;
        match plugin.function_in_table(
            std::mem::offset_of!($crate::runtime::sys::PJRT_Api, $func),
            stringify!($func),
        ) {
            Err(e) => Err(e),
            Ok(()) => match plugin.api().$func {
                None => Err(plugin.missing_function(stringify!($func))),
                // SAFETY: the function exists in the plugin's table; the argument struct is
                // initialised with its header struct_size and valid pointers by the caller.
                Some(func) => plugin.check(unsafe { func($args) }, stringify!($func)),
            },
        }
    }};
}
pub(crate) use pjrt_call;

/// The kinds of PJRT plugin `grpo` knows how to find.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PluginKind {
    /// XLA CPU (`lammps-jax-pjrt-cpu`).
    Cpu,
    /// XLA CUDA (`jax-cuda13-pjrt`).
    Cuda,
    /// Cloud TPU (`libtpu`).
    Tpu,
}

impl PluginKind {
    /// All kinds, in the order `grpo devices` lists them.
    pub const ALL: [PluginKind; 3] = [PluginKind::Cpu, PluginKind::Cuda, PluginKind::Tpu];

    /// `cpu`, `cuda` or `tpu`.
    pub fn name(self) -> &'static str {
        match self {
            PluginKind::Cpu => "cpu",
            PluginKind::Cuda => "cuda",
            PluginKind::Tpu => "tpu",
        }
    }

    /// Parses `cpu`, `cuda` (or `gpu`) and `tpu`.
    pub fn parse(name: &str) -> Option<PluginKind> {
        match name.to_ascii_lowercase().as_str() {
            "cpu" => Some(PluginKind::Cpu),
            "cuda" | "gpu" => Some(PluginKind::Cuda),
            "tpu" => Some(PluginKind::Tpu),
            _ => None,
        }
    }

    /// The environment variable holding an explicit plugin path.
    pub fn env_var(self) -> &'static str {
        match self {
            PluginKind::Cpu => "GRPO_PJRT_CPU",
            PluginKind::Cuda => "GRPO_PJRT_CUDA",
            PluginKind::Tpu => "GRPO_PJRT_TPU",
        }
    }

    /// The PyPI package that ships the plugin.
    pub fn package(self) -> &'static str {
        match self {
            PluginKind::Cpu => "lammps-jax-pjrt-cpu",
            PluginKind::Cuda => "jax-cuda13-pjrt",
            PluginKind::Tpu => "libtpu",
        }
    }

    /// The exact command that installs the plugin.
    pub fn pip_command(self) -> &'static str {
        match self {
            PluginKind::Cpu => "pip install --no-deps lammps-jax-pjrt-cpu==0.11.2",
            PluginKind::Cuda => "pip install jax-cuda13-pjrt 'jax-cuda13-plugin[with-cuda]'",
            PluginKind::Tpu => "pip install libtpu",
        }
    }

    /// The plugin file relative to a `site-packages` directory.
    pub fn relative_path(self) -> &'static str {
        match self {
            PluginKind::Cpu => "lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so",
            PluginKind::Cuda => "jax_plugins/xla_cuda13/xla_cuda_plugin.so",
            PluginKind::Tpu => "libtpu/libtpu.so",
        }
    }

    /// Whether this kind's chips compute bf16 products natively, and why in words: on the CPU
    /// it depends on the host's instructions ([`HostCpu::bf16_support`]); TPUs and NVIDIA GPUs
    /// (tensor cores) do.
    pub fn bf16_support(self) -> (bool, String) {
        match self {
            PluginKind::Cpu => super::HostCpu::get().bf16_support(),
            PluginKind::Cuda => (
                true,
                "NVIDIA GPUs compute bf16 natively (tensor cores)".to_string(),
            ),
            PluginKind::Tpu => (true, "TPUs compute bf16 natively".to_string()),
        }
    }

    fn file_name(self) -> &'static str {
        Path::new(self.relative_path())
            .file_name()
            .and_then(|f| f.to_str())
            .unwrap_or("plugin.so")
    }
}

impl std::fmt::Display for PluginKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Looks for a plugin of `kind` in the given `site-packages` directories.
pub fn find_in_site_dirs(kind: PluginKind, dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter()
        .map(|d| d.join(kind.relative_path()))
        .find(|p| p.is_file())
}

/// Finds the plugin file for `kind`: `explicit` first, then the environment variable
/// (`GRPO_PJRT_CPU`, ...), then the installed Python packages.
pub fn locate_plugin(kind: PluginKind, explicit: Option<&Path>) -> Result<PathBuf> {
    locate_plugin_with(
        kind,
        explicit,
        std::env::var_os(kind.env_var()),
        plugin_site_dirs(),
    )
}

/// [`locate_plugin`] with the environment value and search directories given (for tests).
pub fn locate_plugin_with(
    kind: PluginKind,
    explicit: Option<&Path>,
    env_value: Option<std::ffi::OsString>,
    site_dirs: &[PathBuf],
) -> Result<PathBuf> {
    if let Some(path) = explicit {
        return if path.is_file() {
            Ok(path.to_path_buf())
        } else {
            Err(Error::PluginPathMissing {
                path: path.to_path_buf(),
                origin: "given explicitly".to_string(),
            })
        };
    }
    if let Some(value) = env_value.filter(|v| !v.is_empty()) {
        let path = PathBuf::from(value);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(Error::PluginPathMissing {
                path,
                origin: format!("from ${}", kind.env_var()),
            })
        };
    }
    find_in_site_dirs(kind, site_dirs).ok_or_else(|| Error::PluginNotFound {
        kind: kind.name(),
        env_var: kind.env_var(),
        file_name: kind.file_name(),
        package: kind.package(),
        pip_command: kind.pip_command(),
        searched: if site_dirs.is_empty() {
            format!(
                "${} unset; no {PROJECT_VENV} and no python3 site-packages found",
                kind.env_var()
            )
        } else {
            format!(
                "${} unset; {}",
                kind.env_var(),
                site_dirs
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        },
    })
}

/// A loaded PJRT plugin: the library stays loaded for the life of the process.
pub struct Plugin {
    kind: PluginKind,
    path: PathBuf,
    api: *const PJRT_Api,
    version: (i32, i32),
    struct_size: usize,
    build_identity: String,
    _library: libloading::Library,
}

// SAFETY: the PJRT C API is thread-safe; the table pointer is immutable after GetPjrtApi.
unsafe impl Send for Plugin {}
// SAFETY: as above.
unsafe impl Sync for Plugin {}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("kind", &self.kind)
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

/// Checks a plugin's PJRT C API version against [`MIN_PJRT_API_VERSION`].
pub fn check_api_version(
    kind: PluginKind,
    path: &Path,
    major: i32,
    minor: i32,
    minimum: (i32, i32),
) -> Result<()> {
    if major > minimum.0 {
        return Err(Error::PluginLoad {
            path: path.to_path_buf(),
            reason: format!(
                "it implements PJRT C API {major}.{minor}, a newer major version than the {}.{} this build of grpo \
                 speaks; use a plugin with C API major version {}",
                minimum.0, minimum.1, minimum.0
            ),
        });
    }
    if (major, minor) < minimum {
        return Err(Error::PluginTooOld {
            path: path.to_path_buf(),
            major,
            minor,
            min_major: minimum.0,
            min_minor: minimum.1,
            package: kind.package(),
        });
    }
    Ok(())
}

/// What to do when libtpu's `PJRT_Plugin_Initialize` fails with `message`.
fn tpu_init_hint(message: &str) -> String {
    let allow_multiple = std::env::var("ALLOW_MULTIPLE_LIBTPU_LOAD").unwrap_or_default();
    if message.contains("lockfile") || message.contains("already in use") {
        format!(
            "Another process holds libtpu's lock file /tmp/libtpu_lockfile (`lsof /tmp/libtpu_lockfile` \
             shows which) and ALLOW_MULTIPLE_LIBTPU_LOAD={allow_multiple:?} forbids a second load: set \
             ALLOW_MULTIPLE_LIBTPU_LOAD=1 (grpo sets it when it is unset; deviceless compilation needs \
             no exclusive TPU) or stop that process; delete the lock file only when no process holds it"
        )
    } else {
        format!(
            "Check libtpu's environment (LIBTPU_INIT_ARGS={:?}, TPU_SKIP_MDS_QUERY, \
             ALLOW_MULTIPLE_LIBTPU_LOAD={allow_multiple:?}) and reinstall libtpu (`pip install libtpu==0.0.52`)",
            std::env::var("LIBTPU_INIT_ARGS").unwrap_or_default()
        )
    }
}

/// Whether this host has TPU device files: `/dev/accel*` (v4, v5e, v6e) or `/dev/vfio/`
/// (v5p and later), which libtpu opens to find its chips.
fn tpu_devices_present() -> bool {
    let accel = std::fs::read_dir("/dev").is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("accel"))
    });
    accel || Path::new("/dev/vfio").exists()
}

/// Runs `f` with the process's standard error (file descriptor 2) sent to a temporary file,
/// and returns what was written there, for libraries that print to it directly. Anything
/// else the process writes to stderr meanwhile is captured too. Where the redirection cannot
/// be set up, `f` runs with stderr as it is and nothing is captured.
pub(super) fn capturing_stderr<R>(f: impl FnOnce() -> R) -> (R, String) {
    #[cfg(unix)]
    {
        use std::io::{Read, Seek, Write};
        use std::os::fd::AsRawFd;
        // One redirection at a time: two threads interleaving theirs would leave descriptor 2
        // pointing at the other's temporary file.
        static REDIRECTING: Mutex<()> = Mutex::new(());
        let _one_at_a_time = REDIRECTING.lock().unwrap_or_else(|e| e.into_inner());
        let Ok(mut file) = tempfile::tempfile() else {
            return (f(), String::new());
        };
        let _ = std::io::stderr().flush();
        // SAFETY: dup/dup2/close on descriptor 2 and on descriptors this function owns.
        let saved = unsafe { libc::dup(2) };
        if saved < 0 {
            return (f(), String::new());
        }
        // SAFETY: as above.
        if unsafe { libc::dup2(file.as_raw_fd(), 2) } < 0 {
            unsafe { libc::close(saved) };
            return (f(), String::new());
        }
        let result = f();
        let _ = std::io::stderr().flush();
        // SAFETY: as above; restores the original stderr.
        unsafe {
            libc::dup2(saved, 2);
            libc::close(saved);
        }
        let mut bytes = Vec::new();
        if file.rewind().is_ok() {
            let _ = file.read_to_end(&mut bytes);
        }
        (result, String::from_utf8_lossy(&bytes).into_owned())
    }
    #[cfg(not(unix))]
    {
        (f(), String::new())
    }
}

/// Hands on what a plugin printed to stderr (captured with [`capturing_stderr`]): its
/// informational lines (absl's `I` level and its notice that logging is not initialised) go to
/// the log at info (`-v`), anything else back to stderr.
pub(super) fn relay_plugin_stderr(printed: &str) {
    for line in printed.lines().filter(|l| !l.trim().is_empty()) {
        if is_informational_log_line(line) {
            tracing::info!("PJRT plugin: {line}");
        } else {
            eprintln!("{line}");
        }
    }
}

/// `I0000 00:00:1796159729.898200   10794 file.cc:74] ...` (absl's info level) or absl's
/// `WARNING: All log messages before absl::InitializeLog() is called are written to STDERR`.
fn is_informational_log_line(line: &str) -> bool {
    let b = line.as_bytes();
    let absl_info = b.len() > 5 && b[0] == b'I' && b[1..5].iter().all(u8::is_ascii_digit) && b[5] == b' ';
    absl_info || line.starts_with("WARNING: All log messages before absl::InitializeLog() is called")
}

fn loaded_plugins() -> &'static Mutex<HashMap<PathBuf, Arc<Plugin>>> {
    static LOADED: OnceLock<Mutex<HashMap<PathBuf, Arc<Plugin>>>> = OnceLock::new();
    LOADED.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Plugin {
    /// Finds ([`locate_plugin`]) and loads the plugin of `kind`.
    pub fn discover(kind: PluginKind, explicit: Option<&Path>) -> Result<Arc<Plugin>> {
        let path = locate_plugin(kind, explicit)?;
        Plugin::load(kind, &path)
    }

    /// Loads the plugin at `path` once per process (later calls return the same plugin),
    /// checks its version and calls `PJRT_Plugin_Initialize`.
    pub fn load(kind: PluginKind, path: &Path) -> Result<Arc<Plugin>> {
        let canonical = std::fs::canonicalize(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut loaded = loaded_plugins()
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if let Some(plugin) = loaded.get(&canonical) {
            return Ok(plugin.clone());
        }
        let plugin = Arc::new(Plugin::open(kind, &canonical)?);
        loaded.insert(canonical, plugin.clone());
        Ok(plugin)
    }

    fn open(kind: PluginKind, path: &Path) -> Result<Plugin> {
        match kind {
            PluginKind::Tpu => {
                for var in ["TPU_SKIP_MDS_QUERY", "ALLOW_MULTIPLE_LIBTPU_LOAD"] {
                    if std::env::var_os(var).is_none() {
                        std::env::set_var(var, "1");
                    }
                }
            }
            PluginKind::Cuda => super::cuda::preload_cuda_libraries(path),
            PluginKind::Cpu => {}
        }
        // libtpu on a host without TPU devices (deviceless compilation) prints warnings about
        // the missing accelerator straight to the process's stderr while it loads; they say
        // nothing a user of deviceless compilation can act on, so they go to the log (`-v`).
        // With LIBTPU_INIT_ARGS set nothing is hidden: an unknown flag there makes libtpu print
        // why and exit the process.
        let quiet = kind == PluginKind::Tpu
            && !tpu_devices_present()
            && std::env::var_os("LIBTPU_INIT_ARGS").is_none();
        if !quiet {
            return Plugin::open_library(kind, path);
        }
        let (plugin, printed) = capturing_stderr(|| Plugin::open_library(kind, path));
        if !printed.trim().is_empty() {
            tracing::info!(
                "libtpu printed while loading on this host without TPU devices:\n{}",
                printed.trim_end()
            );
        }
        plugin
    }

    /// Loads the library, checks its API version and initializes it.
    fn open_library(kind: PluginKind, path: &Path) -> Result<Plugin> {
        let load_err = |reason: String| Error::PluginLoad {
            path: path.to_path_buf(),
            reason,
        };
        // SAFETY: loading a PJRT plugin runs its initialisers; these are trusted libraries.
        let library =
            unsafe { libloading::Library::new(path) }.map_err(|e| load_err(format!("dlopen failed: {e}")))?;
        if kind == PluginKind::Cpu {
            match super::host_blocks::install(path) {
                Ok(slots) => {
                    tracing::debug!("CPU plugin: large host allocations cached ({slots} import slots)")
                }
                Err(why) => tracing::info!("CPU plugin: large host allocations not cached: {why}"),
            }
        }
        // SAFETY: GetPjrtApi has this signature in every PJRT plugin.
        let get_api: libloading::Symbol<unsafe extern "C" fn() -> *const PJRT_Api> =
            unsafe { library.get(b"GetPjrtApi\0") }
                .map_err(|e| load_err(format!("it has no GetPjrtApi symbol ({e}); is it a PJRT plugin?")))?;
        // SAFETY: as above.
        let api = unsafe { get_api() };
        if api.is_null() {
            return Err(load_err("GetPjrtApi returned null".to_string()));
        }
        // SAFETY: non-null pointer to the plugin's static function table.
        let table = unsafe { &*api };
        let header_size =
            std::mem::offset_of!(PJRT_Api, pjrt_api_version) + std::mem::size_of::<PJRT_Api_Version>();
        if table.struct_size < header_size {
            return Err(load_err(format!(
                "its PJRT_Api struct_size {} is too small to hold a version",
                table.struct_size
            )));
        }
        let version = (
            table.pjrt_api_version.major_version,
            table.pjrt_api_version.minor_version,
        );
        check_api_version(kind, path, version.0, version.1, MIN_PJRT_API_VERSION)?;
        let build_identity = plugin_build_identity(path, version);
        let plugin = Plugin {
            kind,
            path: path.to_path_buf(),
            api,
            version,
            struct_size: table.struct_size,
            build_identity,
            _library: library,
        };
        let mut init = args!(
            PJRT_Plugin_Initialize_Args,
            PJRT_Plugin_Initialize_Args_STRUCT_SIZE
        );
        if kind == PluginKind::Tpu {
            if let Some(flags) = std::env::var_os("LIBTPU_INIT_ARGS") {
                // libtpu exits the process (status 1) on an unknown flag; say what it parsed.
                tracing::info!(
                    "initializing libtpu with LIBTPU_INIT_ARGS={}; an unknown flag there makes libtpu \
                     exit the process with `ERROR: Unknown command line flag`",
                    flags.to_string_lossy()
                );
            }
        }
        if let Err(e) = pjrt_call!(&plugin, PJRT_Plugin_Initialize, &mut init) {
            let message = e.pjrt_message().unwrap_or_default().trim().to_string();
            return Err(match kind {
                PluginKind::Tpu => Error::TpuInit {
                    path: path.to_path_buf(),
                    hint: tpu_init_hint(&message),
                    message: if message.is_empty() {
                        e.to_string()
                    } else {
                        message.trim_end_matches('.').to_string()
                    },
                },
                _ => e,
            });
        }
        tracing::debug!(
            "loaded PJRT plugin {} (C API {}.{})",
            path.display(),
            version.0,
            version.1
        );
        Ok(plugin)
    }

    /// Which kind of plugin this is.
    pub fn kind(&self) -> PluginKind {
        self.kind
    }

    /// The plugin file (canonical path).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The PJRT C API version the plugin implements, `(major, minor)`.
    pub fn api_version(&self) -> (i32, i32) {
        self.version
    }

    /// The plugin's `PJRT_Api.struct_size`.
    pub fn api_struct_size(&self) -> usize {
        self.struct_size
    }

    /// Identifies this build of the plugin (path, size, modification time, C API version); part
    /// of the on-disk executable cache key.
    pub fn build_identity(&self) -> &str {
        &self.build_identity
    }

    /// The plugin's raw `PJRT_Api` table, for code that calls the C API directly (the runtime
    /// benchmark compares the crate against bare calls). Valid for the life of the process.
    pub fn raw_api(&self) -> *const PJRT_Api {
        self.api
    }

    /// The raw function table.
    pub(crate) fn api(&self) -> &PJRT_Api {
        // SAFETY: checked non-null at load; static in the plugin, which is never unloaded.
        unsafe { &*self.api }
    }

    /// Ok when the function at `offset` lies inside the plugin's table.
    pub(crate) fn function_in_table(&self, offset: usize, function: &'static str) -> Result<()> {
        if offset + std::mem::size_of::<usize>() > self.struct_size {
            Err(self.missing_function(function))
        } else {
            Ok(())
        }
    }

    pub(crate) fn missing_function(&self, function: &'static str) -> Error {
        Error::MissingFunction {
            path: self.path.clone(),
            function,
            major: self.version.0,
            minor: self.version.1,
            struct_size: self.struct_size,
        }
    }

    /// Converts a returned `PJRT_Error` (null is success) into a `Result`, destroying it.
    pub(crate) fn check(&self, error: *mut PJRT_Error, function: &'static str) -> Result<()> {
        if error.is_null() {
            return Ok(());
        }
        let table = self.api();
        let mut message = String::new();
        let mut code = PjrtErrorCode(2);
        if let Some(get_message) = table.PJRT_Error_Message {
            let mut m = args!(PJRT_Error_Message_Args, PJRT_Error_Message_Args_STRUCT_SIZE);
            m.error = error;
            // SAFETY: valid error object from the plugin.
            unsafe { get_message(&mut m) };
            // SAFETY: the plugin returns a pointer/length pair valid until the error is destroyed.
            message = unsafe { string_from(m.message, m.message_size) };
        }
        if let Some(get_code) = table.PJRT_Error_GetCode {
            let mut c = args!(PJRT_Error_GetCode_Args, PJRT_Error_GetCode_Args_STRUCT_SIZE);
            c.error = error;
            // SAFETY: valid error object.
            if unsafe { get_code(&mut c) }.is_null() {
                code = PjrtErrorCode(c.code);
            }
        }
        if let Some(destroy) = table.PJRT_Error_Destroy {
            let mut d = args!(PJRT_Error_Destroy_Args, PJRT_Error_Destroy_Args_STRUCT_SIZE);
            d.error = error;
            // SAFETY: valid error object, destroyed once.
            unsafe { destroy(&mut d) };
        }
        Err(Error::Pjrt {
            function,
            code,
            message,
        })
    }

    /// Waits for an event, then destroys it; the event's error becomes the result.
    pub(crate) fn await_event(&self, event: *mut PJRT_Event) -> Result<()> {
        if event.is_null() {
            return Ok(());
        }
        let mut a = args!(PJRT_Event_Await_Args, PJRT_Event_Await_Args_STRUCT_SIZE);
        a.event = event;
        let result = pjrt_call!(self, PJRT_Event_Await, &mut a);
        self.destroy_event(event);
        result
    }

    pub(crate) fn destroy_event(&self, event: *mut PJRT_Event) {
        let mut d = args!(PJRT_Event_Destroy_Args, PJRT_Event_Destroy_Args_STRUCT_SIZE);
        d.event = event;
        if let Err(e) = pjrt_call!(self, PJRT_Event_Destroy, &mut d) {
            tracing::warn!("{e}");
        }
    }

    /// The plugin's attributes (`xla_version`, `stablehlo_current_version`, ...) as text.
    pub fn attributes(&self) -> Vec<(String, String)> {
        let mut a = args!(
            PJRT_Plugin_Attributes_Args,
            PJRT_Plugin_Attributes_Args_STRUCT_SIZE
        );
        if pjrt_call!(self, PJRT_Plugin_Attributes, &mut a).is_err() || a.attributes.is_null() {
            return Vec::new();
        }
        // SAFETY: the plugin returns an array of num_attributes named values it owns.
        let values = unsafe { std::slice::from_raw_parts(a.attributes, a.num_attributes) };
        values
            .iter()
            .map(|v| {
                let (name, value) = named_value(v);
                (name, value.to_string())
            })
            .collect()
    }
}

/// Path, size, modification time and C API version of a plugin file.
fn plugin_build_identity(path: &Path, version: (i32, i32)) -> String {
    let (size, mtime) = match std::fs::metadata(path) {
        Ok(meta) => {
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            (meta.len(), mtime)
        }
        Err(_) => (0, 0),
    };
    format!(
        "{} size={size} mtime={mtime} pjrt={}.{}",
        path.display(),
        version.0,
        version.1
    )
}

/// Copies a (pointer, length) string from the plugin.
///
/// # Safety
/// `ptr` must be null or valid for `len` bytes.
pub(crate) unsafe fn string_from(ptr: *const c_char, len: usize) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    String::from_utf8_lossy(std::slice::from_raw_parts(ptr as *const u8, len)).into_owned()
}

/// A decoded `PJRT_NamedValue`.
#[derive(Clone, Debug, PartialEq)]
pub enum NamedValue {
    /// A string.
    Str(String),
    /// An integer.
    Int(i64),
    /// A list of integers.
    IntList(Vec<i64>),
    /// A float.
    Float(f32),
    /// A boolean.
    Bool(bool),
    /// A type this crate does not decode.
    Other(u32),
}

impl NamedValue {
    /// The value as a float, when it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            NamedValue::Int(i) => Some(*i as f64),
            NamedValue::Float(f) => Some(*f as f64),
            _ => None,
        }
    }
}

impl std::fmt::Display for NamedValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NamedValue::Str(s) => f.write_str(s),
            NamedValue::Int(i) => write!(f, "{i}"),
            NamedValue::IntList(l) => write!(f, "{l:?}"),
            NamedValue::Float(x) => write!(f, "{x}"),
            NamedValue::Bool(b) => write!(f, "{b}"),
            NamedValue::Other(t) => write!(f, "<type {t}>"),
        }
    }
}

/// Decodes a `PJRT_NamedValue` owned by the plugin.
pub(crate) fn named_value(v: &PJRT_NamedValue) -> (String, NamedValue) {
    // SAFETY: name/value pointers come from the plugin and are valid for the given sizes; the
    // union member read matches `type_`.
    unsafe {
        let name = string_from(v.name, v.name_size);
        let value = match v.type_ {
            PJRT_NamedValue_Type_PJRT_NamedValue_kString => {
                NamedValue::Str(string_from(v.__bindgen_anon_1.string_value, v.value_size))
            }
            PJRT_NamedValue_Type_PJRT_NamedValue_kInt64 => NamedValue::Int(v.__bindgen_anon_1.int64_value),
            PJRT_NamedValue_Type_PJRT_NamedValue_kInt64List => {
                let p = v.__bindgen_anon_1.int64_array_value;
                if p.is_null() {
                    NamedValue::IntList(Vec::new())
                } else {
                    NamedValue::IntList(std::slice::from_raw_parts(p, v.value_size).to_vec())
                }
            }
            PJRT_NamedValue_Type_PJRT_NamedValue_kFloat => NamedValue::Float(v.__bindgen_anon_1.float_value),
            PJRT_NamedValue_Type_PJRT_NamedValue_kBool => NamedValue::Bool(v.__bindgen_anon_1.bool_value),
            other => NamedValue::Other(other),
        };
        (name, value)
    }
}

/// Owned option values for `PJRT_NamedValue` arrays (client and topology create options).
#[derive(Clone, Debug, PartialEq)]
pub enum OptionValue {
    /// `kInt64`.
    Int(i64),
    /// `kInt64List`.
    IntList(Vec<i64>),
    /// `kBool`.
    Bool(bool),
    /// `kFloat`.
    Float(f32),
    /// `kString`.
    Str(String),
}

/// `PJRT_NamedValue`s that borrow from a list of `(name, value)` pairs.
pub(crate) struct NamedValues<'a> {
    pub values: Vec<PJRT_NamedValue>,
    _options: std::marker::PhantomData<&'a [(String, OptionValue)]>,
}

impl<'a> NamedValues<'a> {
    pub fn new(options: &'a [(String, OptionValue)]) -> NamedValues<'a> {
        let values = options
            .iter()
            .map(|(name, value)| {
                let mut nv = args!(PJRT_NamedValue, PJRT_NamedValue_STRUCT_SIZE);
                nv.name = name.as_ptr() as *const c_char;
                nv.name_size = name.len();
                nv.value_size = 1;
                match value {
                    OptionValue::Int(x) => {
                        nv.type_ = PJRT_NamedValue_Type_PJRT_NamedValue_kInt64;
                        nv.__bindgen_anon_1.int64_value = *x;
                    }
                    OptionValue::IntList(list) => {
                        nv.type_ = PJRT_NamedValue_Type_PJRT_NamedValue_kInt64List;
                        nv.__bindgen_anon_1.int64_array_value = list.as_ptr();
                        nv.value_size = list.len();
                    }
                    OptionValue::Bool(x) => {
                        nv.type_ = PJRT_NamedValue_Type_PJRT_NamedValue_kBool;
                        nv.__bindgen_anon_1.bool_value = *x;
                    }
                    OptionValue::Float(x) => {
                        nv.type_ = PJRT_NamedValue_Type_PJRT_NamedValue_kFloat;
                        nv.__bindgen_anon_1.float_value = *x;
                    }
                    OptionValue::Str(s) => {
                        nv.type_ = PJRT_NamedValue_Type_PJRT_NamedValue_kString;
                        nv.__bindgen_anon_1.string_value = s.as_ptr() as *const c_char;
                        nv.value_size = s.len();
                    }
                }
                nv
            })
            .collect();
        NamedValues {
            values,
            _options: std::marker::PhantomData,
        }
    }

    pub fn as_ptr(&self) -> *const PJRT_NamedValue {
        if self.values.is_empty() {
            std::ptr::null()
        } else {
            self.values.as_ptr()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file behind descriptor 2, as (device, inode).
    #[cfg(unix)]
    fn stderr_identity() -> (u64, u64) {
        // SAFETY: fstat into a zeroed struct this function owns.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::fstat(2, &mut st) }, 0);
        (st.st_dev as u64, st.st_ino as u64)
    }

    #[cfg(unix)]
    #[test]
    fn what_a_library_prints_to_stderr_is_captured_and_stderr_is_restored() {
        let before = stderr_identity();
        let (value, printed) = capturing_stderr(|| {
            let message = b"WARNING: could not determine TPU accelerator type\n";
            // SAFETY: writing a byte slice this test owns to descriptor 2.
            unsafe { libc::write(2, message.as_ptr().cast(), message.len()) };
            7
        });
        assert_eq!(value, 7);
        // Other tests' plugins may print to descriptor 2 meanwhile, so only look for ours.
        assert!(
            printed.contains("WARNING: could not determine TPU accelerator type\n"),
            "{printed:?}"
        );
        assert_eq!(stderr_identity(), before, "stderr is not the original file again");
    }

    #[test]
    fn tpu_init_hints_say_what_to_do() {
        let locked = tpu_init_hint(
            "Internal error when accessing libtpu multi-process lockfile. Run \"$ sudo rm /tmp/libtpu_lockfile\".",
        );
        assert!(
            locked.contains("Another process holds libtpu's lock file"),
            "{locked}"
        );
        assert!(locked.contains("set ALLOW_MULTIPLE_LIBTPU_LOAD=1"), "{locked}");
        let other = tpu_init_hint("INTERNAL: something else");
        assert!(other.contains("LIBTPU_INIT_ARGS="), "{other}");
        assert!(other.contains("`pip install libtpu==0.0.52`"), "{other}");
        assert!(!other.contains("lock file"), "{other}");
    }

    #[test]
    fn too_old_plugin_names_its_version_and_the_minimum() {
        let err = check_api_version(PluginKind::Cpu, Path::new("/x/old.so"), 0, 54, (0, 81)).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::PluginTooOld { minor: 54, .. }));
        assert!(text.contains("PJRT C API 0.54"), "{text}");
        assert!(text.contains("0.81"), "{text}");
        assert!(text.contains("pip install -U lammps-jax-pjrt-cpu"), "{text}");
        assert!(check_api_version(PluginKind::Cpu, Path::new("/x"), 0, 81, (0, 81)).is_ok());
        assert!(check_api_version(PluginKind::Cpu, Path::new("/x"), 0, 117, (0, 81)).is_ok());
        let major = check_api_version(PluginKind::Tpu, Path::new("/x"), 1, 0, (0, 81)).unwrap_err();
        assert!(major.to_string().contains("newer major version"), "{major}");
    }

    #[test]
    fn the_minimum_is_the_committed_header_version() {
        assert_eq!(MIN_PJRT_API_VERSION, (0, PJRT_API_MINOR as i32));
        assert_eq!(PJRT_API_MAJOR, 0);
    }

    #[test]
    fn missing_plugin_error_has_the_pip_command() {
        let err = locate_plugin_with(PluginKind::Cpu, None, None, &[]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("`pip install --no-deps lammps-jax-pjrt-cpu==0.11.2`"),
            "{text}"
        );
        assert!(text.contains("GRPO_PJRT_CPU"), "{text}");
        let dir = std::env::temp_dir();
        let err = locate_plugin_with(PluginKind::Tpu, None, None, std::slice::from_ref(&dir)).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("`pip install libtpu`"), "{text}");
        assert!(text.contains(&dir.display().to_string()), "{text}");
        let err = locate_plugin_with(PluginKind::Cuda, None, None, &[]).unwrap_err();
        assert!(err.to_string().contains("jax-cuda13-pjrt"), "{err}");
    }

    #[test]
    fn explicit_and_env_paths_come_first_and_must_exist() {
        let err = locate_plugin_with(
            PluginKind::Cpu,
            Some(Path::new("/nonexistent/plugin.so")),
            None,
            &[],
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("/nonexistent/plugin.so (given explicitly) does not exist"),
            "{err}"
        );
        let err = locate_plugin_with(PluginKind::Tpu, None, Some("/nonexistent/libtpu.so".into()), &[])
            .unwrap_err();
        assert!(err.to_string().contains("from $GRPO_PJRT_TPU"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let site = dir.path().join("site-packages");
        let plugin = site.join(PluginKind::Cpu.relative_path());
        std::fs::create_dir_all(plugin.parent().unwrap()).unwrap();
        std::fs::write(&plugin, b"not really a plugin").unwrap();
        let found = locate_plugin_with(PluginKind::Cpu, None, None, std::slice::from_ref(&site)).unwrap();
        assert_eq!(found, plugin);
        // The explicit path wins over the installed package.
        let other = dir.path().join("mine.so");
        std::fs::write(&other, b"x").unwrap();
        let found = locate_plugin_with(PluginKind::Cpu, Some(&other), None, &[site]).unwrap();
        assert_eq!(found, other);
    }

    #[test]
    fn a_file_that_is_not_a_plugin_is_a_clear_load_error() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("fake_plugin.so");
        std::fs::write(&fake, b"definitely not ELF").unwrap();
        let err = Plugin::load(PluginKind::Cpu, &fake).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("cannot load PJRT plugin"), "{text}");
        assert!(text.contains("fake_plugin.so"), "{text}");
    }

    #[test]
    fn the_project_environment_holds_the_cpu_plugin() {
        // `scripts/setup.sh` (which `scripts/test.sh` runs) installs it there.
        let venv = super::super::site::nearest_venv(Path::new(env!("CARGO_MANIFEST_DIR")))
            .expect("the checkout's .venv: run scripts/setup.sh");
        let site = super::super::site::venv_site_dirs(&venv);
        let found = find_in_site_dirs(PluginKind::Cpu, &site).expect("lammps-jax-pjrt-cpu in .venv");
        assert!(found.ends_with("lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so"));
        // The project's environment is searched first, wherever python3 points.
        assert_eq!(&plugin_site_dirs()[..site.len()], &site[..]);
    }

    #[test]
    fn only_informational_plugin_lines_leave_stderr() {
        assert!(is_informational_log_line(
            "I0000 00:00:1796159729.898200   10794 pjrt_c_api_cpu_internal.cc:74] cpu_device_count set via create_options: 1"
        ));
        assert!(is_informational_log_line(
            "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
        ));
        assert!(!is_informational_log_line("W0000 00:00:1.0 1 x.cc:1] a warning"));
        assert!(!is_informational_log_line("E0000 00:00:1.0 1 x.cc:1] an error"));
        assert!(!is_informational_log_line("I'm not a log line"));
        assert!(!is_informational_log_line("I000"));
    }

    #[test]
    fn a_plugin_is_loaded_once_per_process() {
        let first = Plugin::discover(PluginKind::Cpu, None).unwrap();
        // Through another spelling of the same path.
        let dotted = first
            .path()
            .parent()
            .unwrap()
            .join(".")
            .join(first.path().file_name().unwrap());
        let second = Plugin::load(PluginKind::Cpu, &dotted).unwrap();
        assert!(Arc::ptr_eq(&first, &second));
        let (major, minor) = first.api_version();
        assert!((major, minor) >= MIN_PJRT_API_VERSION);
        assert!(first.api_struct_size() >= std::mem::offset_of!(PJRT_Api, PJRT_Compile));
        assert!(first.build_identity().contains(&format!("pjrt={major}.{minor}")));
        assert!(first
            .attributes()
            .iter()
            .any(|(k, _)| k == "xla_version" || k.starts_with("stablehlo")));
    }

    #[test]
    fn a_table_too_short_for_a_function_is_refused() {
        let plugin = Plugin::discover(PluginKind::Cpu, None).unwrap();
        let last = std::mem::offset_of!(PJRT_Api, PJRT_LoadedExecutable_GetDeviceAssignment);
        // Within the real table.
        assert!(plugin.function_in_table(last, "x").is_ok());
        // A table that ends before the function.
        let short = Plugin {
            kind: PluginKind::Cpu,
            path: plugin.path.clone(),
            api: plugin.api,
            version: (0, 30),
            struct_size: std::mem::offset_of!(PJRT_Api, PJRT_Compile),
            build_identity: String::new(),
            // SAFETY: re-opening an already loaded library only bumps its reference count.
            _library: unsafe { libloading::Library::new(&plugin.path) }.unwrap(),
        };
        let mut a = args!(PJRT_Compile_Args, PJRT_Compile_Args_STRUCT_SIZE);
        let err = pjrt_call!(&short, PJRT_Compile, &mut a).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("has no PJRT_Compile"), "{text}");
        assert!(text.contains("C API 0.30"), "{text}");
        std::mem::forget(short);
    }
}
