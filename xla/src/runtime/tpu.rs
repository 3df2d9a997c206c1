//! Deviceless TPU compilation: compiles a StableHLO program with libtpu for a named topology
//! (`v5e:2x2`, `v6e:2x4`, `v5p:2x2x1`, `tpu7x:2x2x1`, ...) on a machine with no TPU, and reports
//! the compiled memory use and cost, or that the program does not fit in HBM (with the sizes).

use std::collections::BTreeMap;
use std::ffi::c_char;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::error::{Error, Result};
use super::executable::{compile_options_proto, CompileOptions};
use super::executable::{
    cost_analysis_of, destroy_unloaded, memory_stats_of, optimized_program_of, program_name, CostAnalysis,
    MemoryStats,
};
use super::hlo::{collectives, operations, CollectiveCount, OpCost};
use super::plugin::{args, pjrt_call, string_from, NamedValues, OptionValue, Plugin, PluginKind};
use super::sys::*;

const GIB: u64 = 1 << 30;

/// Topologies known to compile with libtpu 0.0.52, for listings and examples.
pub const KNOWN_TOPOLOGIES: [&str; 16] = [
    "v5e:1x1",
    "v5e:2x2",
    "v5e:2x4",
    "v5e:4x4",
    "v5e:16x16",
    "v6e:1x1",
    "v6e:2x2",
    "v6e:2x4",
    "v6e:4x4",
    "v6e:16x16",
    "v5p:1x1x1",
    "v5p:2x2x1",
    "v5p:2x2x2",
    "v5p:4x4x4",
    "v4:2x2x1",
    "tpu7x:2x2x1",
];

/// A TPU generation: its name in topology strings, its HBM and its published peak rates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TpuGeneration {
    /// The name used in topology strings (`v5e`).
    pub name: &'static str,
    /// HBM per chip in bytes.
    pub hbm_bytes_per_chip: u64,
    /// Peak dense bf16 floating-point operations per second of one chip.
    pub peak_bf16_flops_per_chip: f64,
    /// HBM bandwidth of one chip in bytes per second.
    pub hbm_bandwidth_bytes_per_chip: f64,
}

impl TpuGeneration {
    /// A roofline estimate of a program's run time on one device of a chip split into
    /// `devices_per_chip` devices: the larger of `flops / peak` and `bytes / bandwidth`, with
    /// the chip's peak and bandwidth shared evenly between its devices.
    pub fn roofline_seconds(&self, flops: f64, bytes_accessed: f64, devices_per_chip: usize) -> f64 {
        let share = devices_per_chip.max(1) as f64;
        let compute = flops / (self.peak_bf16_flops_per_chip / share);
        let memory = bytes_accessed / (self.hbm_bandwidth_bytes_per_chip / share);
        compute.max(memory)
    }
}

const TFLOPS: f64 = 1e12;
const GBPS: f64 = 1e9;

/// The generations this crate knows. HBM: libtpu reports slightly less as available (v5e:
/// 15.75 GiB of 16, v6e: 31.25 GiB of 32). Peak bf16 FLOP/s and HBM bandwidth per chip are
/// Google's published figures, from the Cloud TPU system-architecture pages
/// (cloud.google.com/tpu/docs/v2, /v3, /v4, /v5e, /v5p, /v6e, /tpu7x):
/// v2 45 TFLOP/s, 600 GB/s; v3 123 TFLOP/s, 900 GB/s; v4 275 TFLOP/s, 1200 GB/s;
/// v5e 197 TFLOP/s, 819 GB/s; v5p 459 TFLOP/s, 2765 GB/s; v6e (Trillium) 918 TFLOP/s,
/// 1640 GB/s; tpu7x (Ironwood) 2307 TFLOP/s, 7380 GB/s.
pub const TPU_GENERATIONS: [TpuGeneration; 7] = [
    TpuGeneration {
        name: "v5e",
        hbm_bytes_per_chip: 16 * GIB,
        peak_bf16_flops_per_chip: 197.0 * TFLOPS,
        hbm_bandwidth_bytes_per_chip: 819.0 * GBPS,
    },
    TpuGeneration {
        name: "v6e",
        hbm_bytes_per_chip: 32 * GIB,
        peak_bf16_flops_per_chip: 918.0 * TFLOPS,
        hbm_bandwidth_bytes_per_chip: 1640.0 * GBPS,
    },
    TpuGeneration {
        name: "v5p",
        hbm_bytes_per_chip: 95 * GIB,
        peak_bf16_flops_per_chip: 459.0 * TFLOPS,
        hbm_bandwidth_bytes_per_chip: 2765.0 * GBPS,
    },
    TpuGeneration {
        name: "v4",
        hbm_bytes_per_chip: 32 * GIB,
        peak_bf16_flops_per_chip: 275.0 * TFLOPS,
        hbm_bandwidth_bytes_per_chip: 1200.0 * GBPS,
    },
    TpuGeneration {
        name: "tpu7x",
        hbm_bytes_per_chip: 192 * GIB,
        peak_bf16_flops_per_chip: 2307.0 * TFLOPS,
        hbm_bandwidth_bytes_per_chip: 7380.0 * GBPS,
    },
    TpuGeneration {
        name: "v3",
        hbm_bytes_per_chip: 32 * GIB,
        peak_bf16_flops_per_chip: 123.0 * TFLOPS,
        hbm_bandwidth_bytes_per_chip: 900.0 * GBPS,
    },
    TpuGeneration {
        name: "v2",
        hbm_bytes_per_chip: 16 * GIB,
        peak_bf16_flops_per_chip: 45.0 * TFLOPS,
        hbm_bandwidth_bytes_per_chip: 600.0 * GBPS,
    },
];

/// A parsed topology name: `GEN:AxB[xC][_twisted|_untwisted]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyName {
    /// The generation as written (`v5e`).
    pub generation: String,
    /// The chip grid (`[2, 2]`).
    pub dims: Vec<i64>,
}

impl TopologyName {
    /// Parses a name with the rule libtpu applies:
    /// `^([a-zA-Z0-9_ ]+)[=_:]([0-9x]+)(_twisted|_untwisted)?$`.
    pub fn parse(topology: &str) -> Result<TopologyName> {
        let bad = |message: &str| Error::BadTopology {
            topology: topology.to_string(),
            message: message.to_string(),
            examples: example_topologies(),
        };
        let core = topology
            .strip_suffix("_untwisted")
            .or_else(|| topology.strip_suffix("_twisted"))
            .unwrap_or(topology);
        let split = core
            .rfind([':', '=', '_'])
            .ok_or_else(|| bad("expected GENERATION:CHIPS, for example v5e:2x2"))?;
        let (generation, grid) = (&core[..split], &core[split + 1..]);
        if generation.is_empty()
            || !generation
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ' ')
        {
            return Err(bad(
                "the generation before ':' must be letters and digits, like v5e",
            ));
        }
        let dims: Option<Vec<i64>> = grid
            .split('x')
            .map(|d| d.parse::<i64>().ok().filter(|d| *d > 0))
            .collect();
        let dims = dims.filter(|d| !d.is_empty() && d.len() <= 3).ok_or_else(|| {
            bad("the chip grid after ':' must be 2 or 3 positive numbers joined by 'x', like 2x2 or 2x2x1")
        })?;
        Ok(TopologyName {
            generation: generation.to_string(),
            dims,
        })
    }

    /// The number of chips.
    pub fn num_chips(&self) -> u64 {
        self.dims.iter().product::<i64>() as u64
    }

    /// The generation, when known.
    pub fn known_generation(&self) -> Option<TpuGeneration> {
        TPU_GENERATIONS
            .iter()
            .copied()
            .find(|g| g.name.eq_ignore_ascii_case(&self.generation))
    }
}

fn example_topologies() -> String {
    KNOWN_TOPOLOGIES.join(", ")
}

/// Options for `PJRT_TopologyDescription_Create`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopologyOptions {
    /// Chips per host, e.g. `[1, 1, 1]` for a single chip (set automatically for topologies
    /// smaller than one 2x2x1 host).
    pub chips_per_host_bounds: Option<[i64; 3]>,
    /// Wrap-around links per dimension (0/1).
    pub wrap: Option<[i64; 3]>,
    /// Chip configuration, e.g. `megacore` on v4.
    pub chip_config_name: Option<String>,
    /// Number of slices (multi-slice).
    pub num_slices: Option<i64>,
}

impl TopologyOptions {
    fn to_named(&self, name: &TopologyName) -> Vec<(String, OptionValue)> {
        let mut out = Vec::new();
        let bounds = self.chips_per_host_bounds.or_else(|| {
            // Smaller than the default host (2x2x1): the host is the whole topology.
            let mut d = [1i64; 3];
            for (i, v) in name.dims.iter().enumerate() {
                d[i] = *v;
            }
            (name.num_chips() < 4 && d[0] <= 2 && d[1] <= 2 && d[2] == 1).then_some(d)
        });
        if let Some(b) = bounds {
            out.push((
                "chips_per_host_bounds".to_string(),
                OptionValue::IntList(b.to_vec()),
            ));
        }
        if let Some(w) = self.wrap {
            out.push(("wrap".to_string(), OptionValue::IntList(w.to_vec())));
        }
        if let Some(c) = &self.chip_config_name {
            out.push(("chip_config_name".to_string(), OptionValue::Str(c.clone())));
        }
        if let Some(n) = self.num_slices {
            out.push(("num_slices".to_string(), OptionValue::Int(n)));
        }
        out
    }
}

/// What libtpu says a topology is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyInfo {
    /// The name it was created from.
    pub name: String,
    /// The device kind (`TPU v5 lite`).
    pub device_kind: String,
    /// Devices (v4 and tpu7x have 2 per chip).
    pub num_devices: usize,
    /// Chips.
    pub num_chips: u64,
    /// HBM per chip in bytes, when the generation is known.
    pub hbm_bytes_per_chip: Option<u64>,
    /// libtpu's platform version.
    pub platform_version: String,
}

impl TopologyInfo {
    /// HBM per device (per chip divided by devices per chip).
    pub fn hbm_bytes_per_device(&self) -> Option<u64> {
        let per_chip_devices = (self.num_devices as u64 / self.num_chips.max(1)).max(1);
        self.hbm_bytes_per_chip.map(|h| h / per_chip_devices)
    }
}

/// A program that needs more HBM than a device has, as libtpu reported it.
#[derive(Clone, Debug, PartialEq)]
pub struct HbmShortfall {
    /// Bytes the program needs (of what `what` names).
    pub required_bytes: u64,
    /// Bytes libtpu says are available per device.
    pub available_bytes: u64,
    /// What needed the memory (`HLO temporaries`, ...).
    pub what: String,
    /// libtpu's message.
    pub message: String,
}

/// Whether a program fits.
#[derive(Clone, Debug, PartialEq)]
pub enum TpuCompileOutcome {
    /// It compiled: per-device memory use and cost.
    Fits {
        /// Compiled memory statistics.
        memory: MemoryStats,
        /// Cost analysis (flops, bytes accessed).
        cost: CostAnalysis,
        /// The collectives the partitioned program runs, by kind, from its optimized HLO.
        collectives: BTreeMap<&'static str, CollectiveCount>,
        /// Each operation it runs with its bytes and flops (`grpo compile --explain`).
        operations: Vec<OpCost>,
    },
    /// It does not fit in HBM.
    DoesNotFit(HbmShortfall),
}

/// The result of a deviceless compile.
#[derive(Clone, Debug, PartialEq)]
pub struct TpuCompileReport {
    /// The program's name.
    pub program: String,
    /// The topology.
    pub topology: TopologyInfo,
    /// Seconds spent in `PJRT_Compile`.
    pub compile_seconds: f64,
    /// Fits (with stats) or does not fit (with sizes).
    pub outcome: TpuCompileOutcome,
}

impl TpuCompileReport {
    /// True when the program compiled within HBM.
    pub fn fits(&self) -> bool {
        matches!(self.outcome, TpuCompileOutcome::Fits { .. })
    }
}

/// Parses sizes like `32.00G`, `512.5M`, `1.2K`, `100B`, `3.5GiB` into bytes.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().ok()?;
    let scale = match unit.trim().trim_end_matches("iB").trim_end_matches('B') {
        "" => 1.0,
        "K" | "k" => 1024.0,
        "M" => 1024.0 * 1024.0,
        "G" => GIB as f64,
        "T" => GIB as f64 * 1024.0,
        _ => return None,
    };
    Some((value * scale).round() as u64)
}

/// Reads an out-of-HBM message (`... required for HLO temporaries (32.00G) exceeds available
/// HBM (15.75G)`), or `None` when the message is about something else.
pub fn parse_hbm_shortfall(message: &str) -> Option<HbmShortfall> {
    let lower = message.to_ascii_lowercase();
    if !(lower.contains("out of memory") || lower.contains("resource_exhausted")) || !lower.contains("hbm") {
        return None;
    }
    let sizes: Vec<(usize, u64)> = message
        .match_indices('(')
        .filter_map(|(i, _)| {
            let end = message[i + 1..].find(')')? + i + 1;
            parse_size(&message[i + 1..end]).map(|s| (i, s))
        })
        .collect();
    let available_pos = lower.find("available")?;
    let (avail_at, available) = sizes.iter().copied().find(|(i, _)| *i > available_pos)?;
    let (req_at, required) = sizes.iter().copied().rfind(|(i, _)| *i < avail_at)?;
    let what = message[..req_at]
        .rsplit("required for ")
        .next()
        .filter(|w| w.len() < 80 && !w.contains('\n') && w.len() < req_at)
        .map(|w| w.trim().to_string())
        .unwrap_or_else(|| "the program".to_string());
    Some(HbmShortfall {
        required_bytes: required,
        available_bytes: available,
        what,
        message: message.trim().to_string(),
    })
}

/// A libtpu topology description (destroyed on drop).
struct Topology<'p> {
    plugin: &'p Plugin,
    raw: *mut PJRT_TopologyDescription,
}

impl Drop for Topology<'_> {
    fn drop(&mut self) {
        let mut d = args!(
            PJRT_TopologyDescription_Destroy_Args,
            PJRT_TopologyDescription_Destroy_Args_STRUCT_SIZE
        );
        d.topology = self.raw;
        if let Err(e) = pjrt_call!(self.plugin, PJRT_TopologyDescription_Destroy, &mut d) {
            tracing::warn!("{e}");
        }
    }
}

fn create_topology<'p>(
    plugin: &'p Plugin,
    topology: &str,
    options: &TopologyOptions,
) -> Result<(Topology<'p>, TopologyInfo)> {
    let name = TopologyName::parse(topology)?;
    let named_options = options.to_named(&name);
    let named = NamedValues::new(&named_options);
    let mut create = args!(
        PJRT_TopologyDescription_Create_Args,
        PJRT_TopologyDescription_Create_Args_STRUCT_SIZE
    );
    create.topology_name = topology.as_ptr() as *const c_char;
    create.topology_name_size = topology.len();
    create.create_options = named.as_ptr();
    create.num_options = named.values.len();
    pjrt_call!(plugin, PJRT_TopologyDescription_Create, &mut create).map_err(|e| Error::BadTopology {
        topology: topology.to_string(),
        message: format!(
            "libtpu rejected it with options {named_options:?}: {}",
            e.pjrt_message().unwrap_or_default().trim()
        ),
        examples: example_topologies(),
    })?;
    let topo = Topology {
        plugin,
        raw: create.topology,
    };
    let mut version = args!(
        PJRT_TopologyDescription_PlatformVersion_Args,
        PJRT_TopologyDescription_PlatformVersion_Args_STRUCT_SIZE
    );
    version.topology = topo.raw;
    pjrt_call!(plugin, PJRT_TopologyDescription_PlatformVersion, &mut version)?;
    let mut devices = args!(
        PJRT_TopologyDescription_GetDeviceDescriptions_Args,
        PJRT_TopologyDescription_GetDeviceDescriptions_Args_STRUCT_SIZE
    );
    devices.topology = topo.raw;
    pjrt_call!(
        plugin,
        PJRT_TopologyDescription_GetDeviceDescriptions,
        &mut devices
    )?;
    let mut device_kind = String::new();
    if devices.num_descriptions > 0 {
        // SAFETY: num_descriptions pointers owned by the topology.
        let first = unsafe { *devices.descriptions };
        let mut kind = args!(
            PJRT_DeviceDescription_Kind_Args,
            PJRT_DeviceDescription_Kind_Args_STRUCT_SIZE
        );
        kind.device_description = first;
        pjrt_call!(plugin, PJRT_DeviceDescription_Kind, &mut kind)?;
        // SAFETY: owned by the description.
        device_kind = unsafe { string_from(kind.device_kind, kind.device_kind_size) };
    }
    let info = TopologyInfo {
        name: topology.to_string(),
        device_kind,
        num_devices: devices.num_descriptions,
        num_chips: name.num_chips() * options.num_slices.unwrap_or(1).max(1) as u64,
        hbm_bytes_per_chip: name.known_generation().map(|g| g.hbm_bytes_per_chip),
        // SAFETY: owned by the topology.
        platform_version: unsafe { string_from(version.platform_version, version.platform_version_size) },
    };
    Ok((topo, info))
}

/// Loads libtpu (`$GRPO_PJRT_TPU` or the `libtpu` Python package).
pub fn load_libtpu(path: Option<&Path>) -> Result<Arc<Plugin>> {
    Plugin::discover(PluginKind::Tpu, path)
}

/// Describes a topology without compiling anything.
pub fn describe_topology(plugin: &Plugin, topology: &str, options: &TopologyOptions) -> Result<TopologyInfo> {
    create_topology(plugin, topology, options).map(|(_, info)| info)
}

/// Compiles `mlir` for `topology` with the installed libtpu (see [`compile_for_topology_with`]).
pub fn compile_for_topology(
    mlir: &str,
    topology: &str,
    options: &CompileOptions,
) -> Result<TpuCompileReport> {
    let plugin = load_libtpu(None)?;
    compile_for_topology_with(&plugin, mlir, topology, &TopologyOptions::default(), options)
}

/// Compiles `mlir` for `topology` without a TPU: `Fits` with the compiled memory stats and cost
/// analysis, or `DoesNotFit` with the sizes libtpu reports when the program exceeds HBM.
pub fn compile_for_topology_with(
    plugin: &Plugin,
    mlir: &str,
    topology: &str,
    topology_options: &TopologyOptions,
    options: &CompileOptions,
) -> Result<TpuCompileReport> {
    let (topo, info) = create_topology(plugin, topology, topology_options)?;
    let program_name = program_name(mlir);
    if options.partitions() > info.num_devices {
        return Err(Error::Compile {
            program: program_name,
            message: format!(
                "it is partitioned over {} devices but topology {topology} has {}",
                options.partitions(),
                info.num_devices
            ),
        });
    }
    let proto = compile_options_proto(options, false);
    let format = "mlir";
    let mut program = args!(PJRT_Program, PJRT_Program_STRUCT_SIZE);
    program.code = mlir.as_ptr() as *mut c_char;
    program.code_size = mlir.len();
    program.format = format.as_ptr() as *const c_char;
    program.format_size = format.len();
    let mut compile = args!(PJRT_Compile_Args, PJRT_Compile_Args_STRUCT_SIZE);
    compile.topology = topo.raw;
    compile.program = &program;
    compile.compile_options = proto.as_ptr() as *const c_char;
    compile.compile_options_size = proto.len();
    compile.client = std::ptr::null_mut();
    let started = Instant::now();
    let compiled = pjrt_call!(plugin, PJRT_Compile, &mut compile);
    let compile_seconds = started.elapsed().as_secs_f64();
    let outcome = match compiled {
        Err(e) => {
            let message = e.pjrt_message().unwrap_or_default().to_string();
            match parse_hbm_shortfall(&message) {
                Some(shortfall) => TpuCompileOutcome::DoesNotFit(shortfall),
                None => {
                    return Err(Error::Compile {
                        program: program_name,
                        message: format!("for TPU topology {topology}: {message}"),
                    })
                }
            }
        }
        Ok(()) => {
            let exe = compile.executable;
            let stats = memory_stats_of(plugin, exe);
            let cost = cost_analysis_of(plugin, exe);
            let hlo = optimized_program_of(plugin, exe);
            destroy_unloaded(plugin, exe);
            let (format, module) = hlo?;
            TpuCompileOutcome::Fits {
                memory: stats?,
                cost: cost?,
                collectives: collectives(&program_name, &format, &module)?,
                operations: operations(&program_name, &format, &module)?,
            }
        }
    };
    Ok(TpuCompileReport {
        program: program_name,
        topology: info,
        compile_seconds,
        outcome,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_topology_names_like_libtpu() {
        let t = TopologyName::parse("v5e:2x2").unwrap();
        assert_eq!(
            (t.generation.as_str(), t.dims.as_slice(), t.num_chips()),
            ("v5e", &[2, 2][..], 4)
        );
        assert_eq!(TopologyName::parse("v5p:2x2x1").unwrap().dims, vec![2, 2, 1]);
        assert_eq!(
            TopologyName::parse("tpu7x:2x2x1_twisted").unwrap().generation,
            "tpu7x"
        );
        assert_eq!(
            TopologyName::parse("TPU v5 lite:2x2").unwrap().generation,
            "TPU v5 lite"
        );
        for bad in ["v5p-8", "v5e", "2x2", "v5e:2xx2", "v5e:0x2", ":2x2"] {
            let err = TopologyName::parse(bad).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(&format!("`{bad}` is not valid")), "{text}");
            assert!(text.contains("v5e:2x2"), "examples listed: {text}");
        }
    }

    #[test]
    fn single_chip_topologies_get_one_chip_hosts() {
        let one = TopologyName::parse("v5e:1x1").unwrap();
        let named = TopologyOptions::default().to_named(&one);
        assert_eq!(
            named,
            vec![(
                "chips_per_host_bounds".to_string(),
                OptionValue::IntList(vec![1, 1, 1])
            )]
        );
        let four = TopologyName::parse("v5e:2x2").unwrap();
        assert!(TopologyOptions::default().to_named(&four).is_empty());
        let explicit = TopologyOptions {
            chips_per_host_bounds: Some([2, 2, 1]),
            num_slices: Some(2),
            ..Default::default()
        };
        assert_eq!(explicit.to_named(&one).len(), 2);
    }

    #[test]
    fn hbm_table() {
        let gib = |t: &str| {
            TopologyName::parse(t)
                .unwrap()
                .known_generation()
                .unwrap()
                .hbm_bytes_per_chip
                / GIB
        };
        assert_eq!(gib("v5e:2x2"), 16);
        assert_eq!(gib("v6e:2x2"), 32);
        assert_eq!(gib("v5p:2x2x1"), 95);
        assert_eq!(gib("v4:2x2x1"), 32);
        assert_eq!(gib("tpu7x:2x2x1"), 192);
        assert!(TopologyName::parse("v9z:2x2")
            .unwrap()
            .known_generation()
            .is_none());
    }

    #[test]
    fn roofline_takes_the_slower_of_compute_and_memory() {
        let v6e = TopologyName::parse("v6e:2x2")
            .unwrap()
            .known_generation()
            .unwrap();
        // 918 TFLOP/s: 9.18e12 flops take 10 ms; 1 MB at 1640 GB/s is far less.
        let t = v6e.roofline_seconds(9.18e12, 1e6, 1);
        assert!((t - 0.01).abs() < 1e-12, "{t}");
        // 16.4 GB at 1640 GB/s take 10 ms; 1 Mflop is far less.
        let t = v6e.roofline_seconds(1e6, 16.4e9, 1);
        assert!((t - 0.01).abs() < 1e-12, "{t}");
        // Two devices per chip (tpu7x) each get half the chip.
        let tpu7x = TopologyName::parse("tpu7x:2x2x1")
            .unwrap()
            .known_generation()
            .unwrap();
        let one = tpu7x.roofline_seconds(2.307e15, 0.0, 1);
        let half = tpu7x.roofline_seconds(2.307e15, 0.0, 2);
        assert!(
            (one - 1.0).abs() < 1e-12 && (half - 2.0).abs() < 1e-12,
            "{one} {half}"
        );
    }

    #[test]
    fn parses_out_of_hbm_messages() {
        let m = "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (32.00G) exceeds available HBM (15.75G).";
        let s = parse_hbm_shortfall(m).unwrap();
        assert_eq!(s.required_bytes, 32 * GIB);
        assert_eq!(s.available_bytes, (15.75 * GIB as f64) as u64);
        assert_eq!(s.what, "HLO temporaries");
        assert!(parse_hbm_shortfall("INVALID_ARGUMENT: bad shape (3)").is_none());
        assert_eq!(parse_size("512.5M"), Some(537_395_200));
        assert_eq!(parse_size("100B"), Some(100));
        assert_eq!(parse_size("2GiB"), Some(2 * GIB));
        assert_eq!(parse_size("abc"), None);
    }
}
