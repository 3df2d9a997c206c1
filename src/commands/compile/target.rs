//! The target the programs compile for (a TPU topology with libtpu, deviceless, or a local
//! plugin) and what each compiled program measures: memory per device, flops, bytes, sharding.

#[allow(unused_imports)]
use super::*;

/// Where the programs are compiled.
pub(super) enum Target {
    Tpu {
        plugin: Arc<Plugin>,
        topology: String,
        info: TopologyInfo,
        generation: Option<TpuGeneration>,
    },
    Local {
        client: Client,
        device: &'static str,
        /// Memory of one device, when known.
        memory_per_device: Option<u64>,
    },
}

/// What compiling one program gave.
#[derive(Clone, Debug)]
pub(super) struct Compiled {
    pub(super) memory: Option<MemoryStats>,
    pub(super) cost: Option<CostAnalysis>,
    /// Bytes needed and available when the compiler refused for lack of memory.
    pub(super) shortfall: Option<(u64, u64, String)>,
    pub(super) seconds: f64,
    /// The partitioned program's collectives by kind (TPU targets; empty elsewhere).
    pub(super) collectives: BTreeMap<&'static str, CollectiveCount>,
    /// Its operations with their bytes and flops (`--explain`; empty when it did not fit).
    pub(super) operations: Vec<OpCost>,
}

impl Target {
    pub(super) fn describe(&self) -> String {
        match self {
            Target::Tpu { info, .. } => format!(
                "TPU topology {} ({}, {} chips, {} devices, HBM {} per chip; libtpu {}, deviceless)",
                info.name,
                info.device_kind,
                info.num_chips,
                info.num_devices,
                info.hbm_bytes_per_chip
                    .map(bytes)
                    .unwrap_or_else(|| "unknown".into()),
                info.platform_version.lines().next().unwrap_or_default().trim()
            ),
            Target::Local { client, device, .. } => format!(
                "{device} ({}, {} device(s), {})",
                client.platform_name(),
                client.num_devices(),
                client.devices().first().map(|d| d.kind.as_str()).unwrap_or("?")
            ),
        }
    }

    pub(super) fn num_devices(&self) -> usize {
        match self {
            Target::Tpu { info, .. } => info.num_devices,
            Target::Local { client, .. } => client.num_devices(),
        }
    }

    pub(super) fn memory_per_device(&self) -> Option<u64> {
        match self {
            Target::Tpu { info, .. } => info.hbm_bytes_per_device(),
            Target::Local {
                memory_per_device, ..
            } => *memory_per_device,
        }
    }

    pub(super) fn devices_per_chip(&self) -> usize {
        match self {
            Target::Tpu { info, .. } => (info.num_devices as u64 / info.num_chips.max(1)).max(1) as usize,
            Target::Local { .. } => 1,
        }
    }

    pub(super) fn compile(&self, program: &Program) -> Result<Compiled, CompileError> {
        let started = Instant::now();
        match self {
            Target::Tpu { plugin, topology, .. } => {
                let report = compile_for_topology_with(
                    plugin,
                    program.mlir(),
                    topology,
                    &TopologyOptions::default(),
                    &program.compile_options(),
                )
                .map_err(|e| CompileError::Compile {
                    program: program.name().to_string(),
                    message: e.to_string(),
                })?;
                Ok(match report.outcome {
                    TpuCompileOutcome::Fits {
                        memory,
                        cost,
                        collectives,
                        operations,
                    } => Compiled {
                        memory: Some(memory),
                        cost: Some(cost),
                        shortfall: None,
                        seconds: report.compile_seconds,
                        collectives,
                        operations,
                    },
                    TpuCompileOutcome::DoesNotFit(s) => Compiled {
                        memory: None,
                        cost: None,
                        shortfall: Some((s.required_bytes, s.available_bytes, s.what)),
                        seconds: report.compile_seconds,
                        collectives: BTreeMap::new(),
                        operations: Vec::new(),
                    },
                })
            }
            Target::Local { client, .. } => {
                let exe = client
                    .compile_uncached(program.mlir(), &program.compile_options())
                    .map_err(|e| CompileError::Compile {
                        program: program.name().to_string(),
                        message: e.to_string(),
                    })?;
                Ok(Compiled {
                    memory: exe.memory_stats().ok(),
                    cost: exe.cost_analysis().ok(),
                    shortfall: None,
                    seconds: started.elapsed().as_secs_f64(),
                    collectives: BTreeMap::new(),
                    operations: exe.operations().unwrap_or_default(),
                })
            }
        }
    }

    /// Roofline seconds of one run, when the device's peak rates are known.
    pub(super) fn estimate_seconds(&self, cost: &CostAnalysis) -> Option<f64> {
        match self {
            Target::Tpu {
                generation: Some(g), ..
            } => Some(g.roofline_seconds(
                cost.flops.unwrap_or(0.0),
                cost.bytes_accessed.unwrap_or(0.0),
                self.devices_per_chip(),
            )),
            _ => None,
        }
    }
}

/// Total memory of this host, from /proc/meminfo.
pub(super) fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

pub(super) fn open_target(args: &CompileArgs, max_partitions: usize) -> Result<Target> {
    if let Some(topology) = &args.topology {
        let plugin = load_libtpu(None)?;
        let info = describe_topology(&plugin, topology, &TopologyOptions::default())?;
        let generation = TopologyName::parse(topology)?.known_generation();
        return Ok(Target::Tpu {
            plugin,
            topology: topology.clone(),
            info,
            generation,
        });
    }
    let (kind, device, create_options) = match args.device {
        Some(LocalDevice::Cuda) => (PluginKind::Cuda, "cuda", Vec::new()),
        _ => (
            PluginKind::Cpu,
            "cpu",
            vec![(
                "cpu_device_count".to_string(),
                OptionValue::Int(max_partitions.max(1) as i64),
            )],
        ),
    };
    let client = Client::new(
        kind,
        None,
        ClientOptions {
            create_options,
            cache: CacheConfig::Disabled,
        },
    )
    .map_err(|e| {
        let message = match &e {
            xla::runtime::Error::PluginNotFound { .. } => {
                format!("the {device} PJRT plugin is not installed: {e}")
            }
            _ => e.to_string(),
        };
        CompileError::Device { device, message }
    })?;
    let memory_per_device = client
        .devices()
        .first()
        .and_then(|d| d.memory.as_ref())
        .and_then(|m| m.bytes_limit)
        .or_else(|| (kind == PluginKind::Cpu).then(host_memory_bytes).flatten());
    Ok(Target::Local {
        client,
        device,
        memory_per_device,
    })
}

/// One program's figures, per device.
#[derive(Clone, Debug)]
pub(super) struct Measured {
    pub(super) sharding: String,
    pub(super) param_bytes: u64,
    /// Of the arguments, the learner's frozen tensors (`frozen.*`: with LoRA the base model).
    pub(super) frozen_bytes: u64,
    /// Arguments from the compiler's memory stats, else from the argument shapes.
    pub(super) argument_bytes: u64,
    pub(super) temp_bytes: Option<u64>,
    /// Peak (reported or estimated), or the compiler's required bytes when it refused.
    pub(super) peak_bytes: u64,
    pub(super) fits: bool,
    pub(super) flops: Option<f64>,
    pub(super) bytes_accessed: Option<f64>,
    pub(super) seconds: Option<f64>,
    pub(super) compile_seconds: f64,
    /// The compiler's own out-of-memory report.
    pub(super) shortfall: Option<String>,
    /// Collectives per run, by kind (see [`Compiled::collectives`]).
    pub(super) collectives: BTreeMap<&'static str, CollectiveCount>,
}

pub(super) fn sharding_of(program: &Program) -> String {
    match program.mesh() {
        None => "1 device".to_string(),
        Some(mesh) => {
            let axes: Vec<String> = mesh.axes().iter().map(|(n, s)| format!("{n}={s}")).collect();
            format!(
                "mesh {} ({} partitions)",
                axes.join(","),
                program.num_partitions()
            )
        }
    }
}

/// Bytes of the arguments one device holds: all of them, those that are trained parameters,
/// and the learner's frozen tensors.
pub(super) fn argument_bytes(program: &Program, param_names: &HashSet<String>) -> (u64, u64, u64) {
    let (mut all, mut params, mut frozen) = (0u64, 0u64, 0u64);
    for (i, (name, ty)) in program.arg_names().iter().zip(program.arg_types()).enumerate() {
        let elements: i64 = program.local_arg_dims(i).iter().product();
        let b = elements.max(0) as u64 * ty.dtype.size_bytes() as u64;
        all += b;
        if param_names.contains(name) {
            params += b;
        } else if name.starts_with(trainer::step::FROZEN_PREFIX) {
            frozen += b;
        }
    }
    (all, params, frozen)
}

pub(super) fn measure(
    program: &Program,
    compiled: &Compiled,
    target: &Target,
    param_names: &HashSet<String>,
) -> Measured {
    let (shape_args, param_bytes, frozen_bytes) = argument_bytes(program, param_names);
    let budget = target.memory_per_device();
    match (&compiled.memory, &compiled.shortfall) {
        (_, Some((required, available, what))) => Measured {
            sharding: sharding_of(program),
            param_bytes,
            frozen_bytes,
            argument_bytes: shape_args,
            temp_bytes: what.contains("temporar").then_some(*required),
            peak_bytes: if what.contains("temporar") {
                required + shape_args
            } else {
                *required
            },
            fits: false,
            flops: None,
            bytes_accessed: None,
            seconds: None,
            compile_seconds: compiled.seconds,
            collectives: BTreeMap::new(),
            shortfall: Some(format!(
                "the compiler reports {} needed for {what}, {} available",
                bytes(*required),
                bytes(*available)
            )),
        },
        (memory, None) => {
            let peak = memory
                .as_ref()
                .map(|m| m.peak_or_estimate().max(0) as u64)
                .unwrap_or(shape_args);
            let cost = compiled.cost.as_ref();
            Measured {
                sharding: sharding_of(program),
                param_bytes,
                frozen_bytes,
                argument_bytes: memory
                    .as_ref()
                    .map(|m| m.argument_bytes.max(0) as u64)
                    .unwrap_or(shape_args),
                temp_bytes: memory.as_ref().map(|m| m.temp_bytes.max(0) as u64),
                peak_bytes: peak,
                fits: budget.is_none_or(|b| peak <= b),
                flops: cost.and_then(|c| c.flops),
                bytes_accessed: cost.and_then(|c| c.bytes_accessed),
                seconds: cost.and_then(|c| target.estimate_seconds(c)),
                compile_seconds: compiled.seconds,
                shortfall: None,
                collectives: compiled.collectives.clone(),
            }
        }
    }
}

/// The smallest known topology of `generation` with at least `devices` devices.
pub(super) fn topology_with_devices(generation: &str, devices: usize) -> Option<&'static str> {
    KNOWN_TOPOLOGIES
        .iter()
        .filter_map(|t| {
            let name = TopologyName::parse(t).ok()?;
            let per_chip = if matches!(name.generation.as_str(), "v4" | "tpu7x") {
                2
            } else {
                1
            };
            let n = name.num_chips() as usize * per_chip;
            (name.generation == generation && n >= devices).then_some((n, *t))
        })
        .min()
        .map(|(_, t)| t)
}

/// What the recipe's way of tracing the decoder layers (rematerialised with
/// `model.enable_gradient_checkpointing`, scanned with `model.scan_layers`) does to the
/// learner's gradient program: the compiled program and the same program traced one layer at a
/// time keeping every activation.
pub(super) struct LayersEffect {
    pub(super) program: String,
    /// The keys that made the difference, e.g. `model.scan_layers`.
    pub(super) keys: Vec<&'static str>,
    pub(super) with: Measured,
    pub(super) without: Measured,
}

impl LayersEffect {
    /// One line: temporaries saved, flops added, compile time.
    pub(super) fn describe(&self) -> String {
        let temps = match (self.with.temp_bytes, self.without.temp_bytes) {
            (Some(w), Some(wo)) => format!(
                "temporaries {} per device ({} without: {})",
                bytes(w),
                bytes(wo),
                if wo >= w {
                    format!("{} saved", bytes(wo - w))
                } else {
                    format!("{} more", bytes(w - wo))
                }
            ),
            _ => "temporaries not reported".to_string(),
        };
        let flops = match (self.with.flops, self.without.flops) {
            (Some(w), Some(wo)) if wo > 0.0 => format!(
                "{:.1} GFLOP per run ({:.1} without: {:+.0}%)",
                w / 1e9,
                wo / 1e9,
                100.0 * (w / wo - 1.0)
            ),
            _ => "flops not reported".to_string(),
        };
        format!(
            "{} in {}: {temps}; {flops}; compiled in {:.1} s ({:.1} s without){}",
            self.keys.join(" and "),
            self.program,
            self.with.compile_seconds,
            self.without.compile_seconds,
            if self.without.fits {
                ""
            } else {
                "; without it the program does not fit"
            }
        )
    }
}
