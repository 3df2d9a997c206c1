//! The PJRT runtime: loads PJRT plugins (XLA CPU, XLA CUDA, libtpu) at run time through the
//! committed C API bindings, and wraps them in safe RAII types: [`Plugin`], [`Client`] (devices,
//! host-to-device transfers, compilation), [`Buffer`] (device arrays, reading back, donation
//! tracking), [`Executable`] (asynchronous single-device and SPMD execution), the
//! [`ExecutableCache`] (memory and disk), and deviceless TPU compilation ([`tpu`]).
//!
//! Around them: where plugins are looked for (`site.rs`: the checkout's [`PROJECT_VENV`] that
//! `scripts/setup.sh` makes, the active virtual environment, then `python3`'s site-packages),
//! what the host CPU computes natively ([`HostCpu`], which a run's `dtype: auto` reads through
//! [`PluginKind::bf16_support`]), the plugins and devices of this host ([`inventory`]), the
//! collectives of a compiled program (`hlo.rs`, [`collectives`], for `grpo compile`), and the
//! CPU plugin's large host allocations kept for reuse ([`host_blocks`]).
//!
//! Programs arrive as StableHLO text from [`crate::graph`].

#[allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    clippy::all,
    missing_docs
)]
#[rustfmt::skip]
pub mod sys;

mod buffer;
mod cache;
mod client;
mod cuda;
mod error;
mod executable;
mod handle;
mod hlo;
pub mod host_blocks;
mod host_cpu;
pub mod inventory;
mod plugin;
mod site;
pub mod tpu;

pub use buffer::Buffer;
pub use cache::{
    default_cache_dir, host_cpu_features, program_fingerprint, CacheConfig, CacheStats, ExecutableCache,
    CACHE_ENV_VAR,
};
pub use client::{Client, ClientOptions};
pub use cuda::{cuda_libraries_in, CUDA_LIBRARY_ORDER};
pub use error::{Error, PjrtErrorCode, Result};
pub use executable::{
    compile_options_proto, parse_main_params, program_name, CompileOptions, CostAnalysis, Executable,
    MemoryStats, ParamType,
};
pub use handle::{DeviceInfo, DeviceMemory, TransferStats};
pub use hlo::{collectives, operations, CollectiveCount, OpCost};
pub use host_cpu::HostCpu;
pub use plugin::{
    check_api_version, find_in_site_dirs, locate_plugin, locate_plugin_with, NamedValue, OptionValue, Plugin,
    PluginKind, MIN_PJRT_API_VERSION,
};
pub use site::{plugin_site_dirs, venv_site_dirs, PROJECT_VENV};
pub use tpu::{
    compile_for_topology, compile_for_topology_with, HbmShortfall, TopologyInfo, TopologyOptions,
    TpuCompileOutcome, TpuCompileReport,
};
