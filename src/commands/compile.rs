//! `grpo compile`: compiles every program a recipe's run would use (the rollout's prefill
//! buckets and decode steps, the learner's `train_step`, `accumulate` + `apply`, `log_probs`
//! for the policy and the reference) for a TPU topology with libtpu and no TPU (deviceless), or
//! on the CPU / CUDA plugin present, and prints per program its sharding, memory per device,
//! whether it fits, its flops and a roofline time estimate, then the estimated step time.
//! Only the model's architecture is needed (config.json or GGUF metadata), never its weights.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use actors::recipe::{load_recipe, DTypeName, DeviceKind, Recipe};
use actors::roles::learner::{needs_reference, policy, step_config};
use actors::run::sampling_params;
use actors::setup::{engine_config, resolve_auto_dtypes_on, rollout_dtype};
use anyhow::Result;
use clap::{ArgGroup, Args, ValueEnum};
use model::forward::DecodeOptions;
use model::{GgufFile, ModelConfig};
use rollout::programs::{CacheShape, DecodeSample, PrefillFanout};
use trainer::step::build_train_programs;
use xla::graph::Program;
use xla::runtime::tpu::{
    compile_for_topology_with, describe_topology, load_libtpu, TopologyInfo, TopologyName, TopologyOptions,
    TpuCompileOutcome, TpuGeneration, KNOWN_TOPOLOGIES,
};
use xla::runtime::{
    CacheConfig, Client, ClientOptions, CostAnalysis, MemoryStats, OptionValue, Plugin, PluginKind,
};

#[derive(Args)]
#[command(
    about = "Compile every program of a recipe's run for a TPU topology (no TPU needed) or a local device, and report memory, fit and time",
    long_about = "Compile every program a recipe's run would use, without weights and without running \
        anything, and report whether it fits.\n\n\
        Programs: the rollout's prefill (each prompt-length bucket up to data.max_prompt_length, \
        for the training group size rollout.n and for validation) and decode \
        steps (one per KV-cache length), and the learner's train_step, accumulate + apply (when \
        actor.ppo_micro_batch_size splits a mini-batch), log_probs (the policy's old log-probs and, \
        with a KL term, the reference's).\n\n\
        With --topology, each is compiled by libtpu for that TPU slice on this machine (deviceless: \
        `pip install libtpu`, no TPU needed); with --device cpu|cuda, by that PJRT plugin.\n\n\
        The model: only its architecture is read, from model.path's config.json (or a .gguf \
        file's metadata); when model.path does not exist (no checkpoint here), from \
        configs/<last part of model.path>/config.json beside the recipe (recipes/configs/ ships \
        Qwen2.5-0.5B-Instruct), or from --model-config.\n\n\
        The table (stdout) gives per program: its sharding (mesh and partitions, or 1 device), \
        parameter / argument / temporary / peak bytes per device, the memory of a device (TPU HBM), \
        whether it fits, GFLOP per run, and a roofline time per run: max(flops / peak bf16 FLOP/s, \
        bytes accessed / HBM bandwidth) from the chip's published figures. Then the estimated time of \
        one training step: prefill and decode of the rollout batch (longest prompts, every response \
        at data.max_response_length) plus the learner's programs times their runs per step. When the \
        rollout runs in the orchestrator's process (cluster.rollout_workers: 0) it shares device 0 with \
        the learner, so the learner's state, the KV cache and the largest program's temporaries must fit \
        there together; that total is checked too. \
        Progress goes to stderr. Exit status 0 when everything fits, 1 when something does not \
        (with advice naming recipe keys), 2 on errors.",
    after_help = after_help()
)]
#[command(group(ArgGroup::new("target").required(true).args(["topology", "device"])))]
pub struct CompileArgs {
    /// The recipe file (YAML), for example `recipes/gsm8k-qwen2.5-0.5b-tpu-v6e.yaml`.
    pub recipe: PathBuf,

    /// TPU topology to compile for with libtpu, deviceless: GENERATION:CHIPS, e.g. v6e:2x2.
    #[arg(long, value_name = "NAME")]
    pub topology: Option<String>,

    /// Compile with a local PJRT plugin instead: cpu, or cuda (needs the CUDA plugin installed).
    #[arg(long, value_enum, value_name = "DEVICE")]
    pub device: Option<LocalDevice>,

    /// Override one recipe key, as KEY=VALUE with a dotted key; repeatable
    /// (`--set actor.ppo_micro_batch_size=8`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,

    /// The model's architecture: a config.json, a model directory holding one, or a .gguf file
    /// (instead of what model.path gives).
    #[arg(long, value_name = "PATH")]
    pub model_config: Option<PathBuf>,

    /// Compile only the programs whose name contains this text (repeatable), e.g.
    /// `--only train_step`. The step-time estimate needs every program, so it is left out.
    #[arg(long, value_name = "TEXT")]
    pub only: Vec<String>,

    /// Compile only the programs one training step runs (worst case: the longest prompts,
    /// every response at data.max_response_length): leaves out shorter prefill buckets,
    /// validation's programs and cache lengths a step never reaches. Much faster; the step-time
    /// estimate is the same.
    #[arg(long)]
    pub step_only: bool,

    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A local device kind for `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LocalDevice {
    /// The CPU plugin.
    Cpu,
    /// The CUDA plugin (`pip install jax-cuda12-pjrt`, or `$GRPO_PJRT_CUDA`).
    Cuda,
}

fn after_help() -> String {
    format!(
        "Examples:\n  \
         grpo compile recipes/gsm8k-qwen2.5-0.5b-tpu-v6e.yaml --topology v6e:2x2\n  \
         grpo compile recipes/gsm8k-qwen2.5-0.5b-tpu-v6e.yaml --topology v5e:2x2 --step-only --set actor.ppo_micro_batch_size=2\n  \
         grpo compile recipes/gsm8k-qwen2.5-0.5b-tpu-v6e.yaml --topology tpu7x:2x2x1 --only train_step --json\n  \
         grpo compile recipes/quickstart.yaml --device cpu\n  \
         grpo compile my.yaml --topology v5p:2x2x1 --model-config models/Qwen2.5-7B-Instruct/config.json\n\n\
         Known TPU topologies (libtpu {}): {}.\n\
         Single chips (v5e:1x1, v6e:1x1, v5p:1x1x1) work too; v4 and tpu7x have 2 devices per chip.",
        "0.0.52",
        KNOWN_TOPOLOGIES.join(", ")
    )
}

/// What `grpo compile` can stop on.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// No architecture could be found for the model.
    #[error(
        "model.path {model_path}: no model architecture found (tried {tried}); give one with \
         --model-config PATH (a config.json, a model directory or a .gguf file), or put the \
         model's config.json at {suggested}"
    )]
    NoModelConfig {
        model_path: String,
        tried: String,
        suggested: String,
    },
    /// The architecture file exists but could not be read.
    #[error("{path}: {message}")]
    ModelConfig { path: String, message: String },
    /// A program could not be traced.
    #[error("building the {role} programs: {message}")]
    Build { role: &'static str, message: String },
    /// `--only` matched nothing.
    #[error("--only {filters:?} matches none of the programs: {names}")]
    NothingSelected { filters: Vec<String>, names: String },
    /// The device plugin is missing or failed.
    #[error("--device {device}: {message}")]
    Device { device: &'static str, message: String },
    /// A program failed to compile (not for lack of memory).
    #[error("compiling {program}: {message}")]
    Compile { program: String, message: String },
}

/// Which half of a step a program belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Rollout,
    Learner,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Rollout => "rollout",
            Role::Learner => "learner",
        }
    }
}

/// One row of the report: a program (several rows may share one compiled program, as the
/// policy's and the reference's log-probs do) and how often a training step runs it.
#[derive(Clone, Debug)]
struct PlannedRow {
    role: Role,
    label: String,
    /// Index into the list of distinct programs.
    program: usize,
    /// Runs per training step (0 for programs only validation or shorter prompts use).
    runs_per_step: f64,
    /// What it is for, in words.
    purpose: String,
}

/// Every program of the run, deduplicated by fingerprint, and the rows that use them.
struct Plan {
    programs: Vec<Arc<Program>>,
    rows: Vec<PlannedRow>,
    /// Names of the model's parameters (to count parameter bytes among the arguments).
    param_names: HashSet<String>,
    /// The rollout's KV-cache shape (for advice).
    cache: CacheShape,
    /// Bytes of f32 master weights one learner device holds (its shards under `fsdp`), from
    /// the learner's layout: what the learner state is counted from when no compiled learner
    /// program says (`--only` without one).
    master_bytes_per_device: u64,
}

impl Plan {
    /// Every program a run of `recipe` compiles (rollout, then learner), traced, not compiled.
    fn for_recipe(recipe: &Recipe, config: &ModelConfig) -> Result<Plan, CompileError> {
        let settings = engine_config(recipe, &[]);
        let mut plan = Plan {
            programs: Vec::new(),
            rows: Vec::new(),
            param_names: model::param_table(config).into_iter().map(|s| s.name).collect(),
            cache: CacheShape::chunked(
                config,
                settings.max_num_seqs,
                settings.max_model_len,
                settings.effective_kv_chunk(),
            )
            .for_weights(rollout_dtype(recipe))
            .on_devices(recipe.rollout_devices()),
            master_bytes_per_device: master_bytes_per_device(recipe, config)?,
        };
        plan_rollout(&mut plan, recipe, config)?;
        plan_learner(&mut plan, recipe, config)?;
        Ok(plan)
    }

    fn add(&mut self, role: Role, label: String, program: Program, runs_per_step: f64, purpose: String) {
        let index = match self
            .programs
            .iter()
            .position(|p| p.fingerprint() == program.fingerprint())
        {
            Some(i) => i,
            None => {
                self.programs.push(Arc::new(program));
                self.programs.len() - 1
            }
        };
        // The same program for two purposes (e.g. training and validation prefill): one row,
        // runs added up.
        if let Some(row) = self
            .rows
            .iter_mut()
            .find(|r| r.program == index && r.label == label)
        {
            row.runs_per_step += runs_per_step;
            row.purpose = format!("{}; {}", row.purpose, purpose);
            return;
        }
        self.rows.push(PlannedRow {
            role,
            label,
            program: index,
            runs_per_step,
            purpose,
        });
    }
}

/// The rollout's programs: for the training groups (`rollout.n`) and, when the recipe has
/// validation files, for the validation groups (`rollout.val_kwargs.n`).
fn plan_rollout(plan: &mut Plan, recipe: &Recipe, config: &ModelConfig) -> Result<(), CompileError> {
    let settings = engine_config(recipe, &[]);
    let weights = rollout_dtype(recipe);
    let cache = plan.cache.clone();
    let buckets = settings.buckets();
    let slots = settings.max_num_seqs;
    let r = &recipe.rollout;
    let err = |e: rollout::RolloutError| CompileError::Build {
        role: "rollout",
        message: e.to_string(),
    };
    let mut sets = vec![(
        "train",
        r.n,
        recipe.data.train_batch_size,
        sampling_params(recipe, false).needs_truncation(),
    )];
    if !recipe.data.val_files.0.is_empty() {
        let v = &r.val_kwargs;
        sets.push((
            "validation",
            v.n,
            0,
            sampling_params(recipe, true).needs_truncation(),
        ));
    }
    let prompt = recipe.data.max_prompt_length;
    for &(what, n, groups, truncating) in &sets {
        // A prefill covers the prompt without its last token; the longest prompt picks the
        // longest bucket used, every shorter bucket may be used by shorter prompts.
        let head = prompt.saturating_sub(1).max(1);
        let top = buckets
            .iter()
            .copied()
            .find(|&b| b >= head)
            .unwrap_or(*buckets.last().expect("at least one bucket"));
        let width = n.clamp(1, slots).next_power_of_two().min(slots);
        let batched = if settings.prefill_batch > 1 && slots >= 2 * width {
            Some(settings.prefill_batch.min(slots / width).max(1))
        } else {
            None
        };
        for &bucket in buckets.iter().filter(|&&b| b <= top) {
            let longest = bucket == top;
            let single_runs = match batched {
                Some(b) => groups % b,
                None => groups,
            };
            let mut variants = vec![(1usize, if longest { single_runs } else { 0 })];
            if let Some(b) = batched {
                variants.push((b, if longest { groups / b } else { 0 }));
            }
            for (batch, runs) in variants {
                let program =
                    PrefillFanout::build(config, weights, &cache, bucket, width, batch).map_err(err)?;
                let label = program.name().to_string();
                plan.add(
                    Role::Rollout,
                    label,
                    program,
                    runs as f64,
                    format!(
                        "{what} prefill: {batch} prompt(s) of <= {bucket} tokens, fan-out to {width} slots"
                    ),
                );
            }
        }
        // Decode: every chunk count a sequence passes through; a step's runs are counted for
        // the worst case (longest prompts, every response at max_response_length).
        let samples = groups * n;
        let waves = samples.div_ceil(slots) as f64;
        let mut runs: BTreeMap<usize, f64> = BTreeMap::new();
        for j in 0..recipe.data.max_response_length {
            *runs
                .entry(cache.decode_chunks(prompt.saturating_sub(1) + j))
                .or_default() += waves;
        }
        let mut chunks = 1;
        loop {
            let program = if cache.chunks() == 1 {
                DecodeSample::build_with(
                    config,
                    weights,
                    &cache,
                    truncating,
                    DecodeOptions::default(),
                    settings.sampler,
                )
            } else {
                DecodeSample::build_chunked(config, weights, &cache, truncating, chunks, settings.sampler)
            }
            .map_err(err)?;
            let label = program.name().to_string();
            let attended = (chunks * cache.chunk).min(cache.max_len);
            plan.add(
                Role::Rollout,
                label,
                program,
                runs.get(&chunks).copied().unwrap_or(0.0),
                format!("{what} decode: {slots} slots reading <= {attended} cached positions"),
            );
            if chunks >= cache.chunks() {
                break;
            }
            chunks = (chunks * 2).min(cache.chunks());
        }
    }
    Ok(())
}

/// The learner's programs and their runs per step (see `actors::roles::learner`).
fn plan_learner(plan: &mut Plan, recipe: &Recipe, config: &ModelConfig) -> Result<(), CompileError> {
    let a = &recipe.actor;
    let policy = policy(recipe, config);
    let minis = recipe
        .data
        .train_batch_size
        .div_ceil(a.ppo_mini_batch_size.max(1)) as u64;
    let total_steps = recipe.trainer.total_training_steps.unwrap_or(1).max(1) as u64;
    let cfg = step_config(recipe, total_steps * minis * a.ppo_epochs.max(1) as u64);
    let specs = policy.param_specs();
    let p = policy.clone();
    let programs = build_train_programs(&cfg, &specs, &policy.input_specs(), move |params, batch| {
        p.log_probs(params, batch)
    })
    .map_err(|e| CompileError::Build {
        role: "learner",
        message: e.to_string(),
    })?;
    let rows = recipe.data.train_batch_size * recipe.rollout.n;
    let micro = a.ppo_micro_batch_size.max(1);
    let mini = (a.ppo_mini_batch_size * recipe.rollout.n).max(1);
    let epochs = a.ppo_epochs.max(1) as f64;
    let mini_batches = rows.div_ceil(mini) as f64;
    let micro_per_mini = mini.min(rows).div_ceil(micro);
    let accumulating = micro_per_mini > 1;
    let micro_batches = rows.div_ceil(micro) as f64;
    let purpose_mb = format!(
        "{micro} responses of {} tokens after {} prompts of {}",
        policy.response_len,
        policy.prompt_slots(),
        policy.prompt_len
    );
    plan.add(
        Role::Learner,
        "train_step".into(),
        programs.train_step,
        if accumulating { 0.0 } else { mini_batches * epochs },
        format!(
            "forward, backward and AdamW on one micro-batch ({purpose_mb}) when it is the whole mini-batch"
        ),
    );
    if accumulating {
        plan.add(
            Role::Learner,
            "accumulate".into(),
            programs.accumulate,
            mini_batches * micro_per_mini as f64 * epochs,
            format!("forward and backward of one micro-batch ({purpose_mb}) into the gradient sums"),
        );
        plan.add(
            Role::Learner,
            "apply".into(),
            programs.apply,
            mini_batches * epochs,
            "clip and AdamW from the gradient sums, once per mini-batch".into(),
        );
    }
    let reference = needs_reference(recipe);
    if !a.use_rollout_log_probs {
        plan.add(
            Role::Learner,
            "log_probs".into(),
            programs.log_probs.clone(),
            micro_batches,
            format!("the policy's old log-probs ({purpose_mb})"),
        );
    }
    if reference {
        plan.add(
            Role::Learner,
            "log_probs (reference)".into(),
            programs.log_probs,
            micro_batches,
            format!("the reference model's log-probs for the KL term ({purpose_mb})"),
        );
    }
    Ok(())
}

/// Bytes of f32 master weights one learner device holds: each parameter whole, or its share
/// where the learner's mesh splits it (`fsdp`).
fn master_bytes_per_device(recipe: &Recipe, config: &ModelConfig) -> Result<u64, CompileError> {
    let a = &recipe.actor;
    let mesh =
        trainer::sharding::LearnerMesh::new(&a.parallelism(&recipe.cluster), a.ppo_micro_batch_size as i64)
            .map_err(|e| CompileError::Build {
            role: "learner",
            message: e.to_string(),
        })?;
    Ok(model::param_table(config)
        .iter()
        .map(|spec| {
            let dims: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
            let shards = if mesh.param_sharding(&dims).is_some() {
                mesh.devices()
            } else {
                1
            };
            4 * spec.numel() as u64 / shards as u64
        })
        .sum())
}

/// The model's architecture, from `--model-config`, `model.path`, or the configs folder beside
/// the recipe.
fn model_config(
    recipe: &Recipe,
    recipe_path: &Path,
    explicit: Option<&Path>,
) -> Result<(ModelConfig, String), CompileError> {
    let read = |path: &Path| -> Result<ModelConfig, CompileError> {
        let failed = |message: String| CompileError::ModelConfig {
            path: path.display().to_string(),
            message,
        };
        if path.is_dir() {
            return ModelConfig::from_hf_file(&path.join("config.json")).map_err(|e| failed(e.to_string()));
        }
        if path.extension().is_some_and(|e| e == "gguf") {
            let gguf = GgufFile::open(path).map_err(|e| failed(e.to_string()))?;
            return ModelConfig::from_gguf(&gguf).map_err(|e| failed(e.to_string()));
        }
        ModelConfig::from_hf_file(path).map_err(|e| failed(e.to_string()))
    };
    if let Some(path) = explicit {
        return Ok((read(path)?, path.display().to_string()));
    }
    let model_path = Path::new(&recipe.model.path);
    let mut tried = Vec::new();
    let in_dir = model_path.join("config.json");
    if in_dir.is_file() {
        return Ok((read(&in_dir)?, in_dir.display().to_string()));
    }
    tried.push(in_dir.display().to_string());
    if model_path.is_file() {
        return Ok((read(model_path)?, model_path.display().to_string()));
    }
    let name = model_path
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_default();
    let beside = recipe_path
        .parent()
        .unwrap_or(Path::new("."))
        .join("configs")
        .join(&name)
        .join("config.json");
    if beside.is_file() {
        return Ok((read(&beside)?, beside.display().to_string()));
    }
    tried.push(beside.display().to_string());
    Err(CompileError::NoModelConfig {
        model_path: recipe.model.path.clone(),
        tried: tried.join(", "),
        suggested: beside.display().to_string(),
    })
}

/// Where the programs are compiled.
enum Target {
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
struct Compiled {
    memory: Option<MemoryStats>,
    cost: Option<CostAnalysis>,
    /// Bytes needed and available when the compiler refused for lack of memory.
    shortfall: Option<(u64, u64, String)>,
    seconds: f64,
}

impl Target {
    fn describe(&self) -> String {
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

    fn num_devices(&self) -> usize {
        match self {
            Target::Tpu { info, .. } => info.num_devices,
            Target::Local { client, .. } => client.num_devices(),
        }
    }

    fn memory_per_device(&self) -> Option<u64> {
        match self {
            Target::Tpu { info, .. } => info.hbm_bytes_per_device(),
            Target::Local {
                memory_per_device, ..
            } => *memory_per_device,
        }
    }

    fn devices_per_chip(&self) -> usize {
        match self {
            Target::Tpu { info, .. } => (info.num_devices as u64 / info.num_chips.max(1)).max(1) as usize,
            Target::Local { .. } => 1,
        }
    }

    fn compile(&self, program: &Program) -> Result<Compiled, CompileError> {
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
                    TpuCompileOutcome::Fits { memory, cost } => Compiled {
                        memory: Some(memory),
                        cost: Some(cost),
                        shortfall: None,
                        seconds: report.compile_seconds,
                    },
                    TpuCompileOutcome::DoesNotFit(s) => Compiled {
                        memory: None,
                        cost: None,
                        shortfall: Some((s.required_bytes, s.available_bytes, s.what)),
                        seconds: report.compile_seconds,
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
                })
            }
        }
    }

    /// Roofline seconds of one run, when the device's peak rates are known.
    fn estimate_seconds(&self, cost: &CostAnalysis) -> Option<f64> {
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
fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn open_target(args: &CompileArgs, max_partitions: usize) -> Result<Target> {
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
struct Measured {
    sharding: String,
    param_bytes: u64,
    /// Arguments from the compiler's memory stats, else from the argument shapes.
    argument_bytes: u64,
    temp_bytes: Option<u64>,
    /// Peak (reported or estimated), or the compiler's required bytes when it refused.
    peak_bytes: u64,
    fits: bool,
    flops: Option<f64>,
    bytes_accessed: Option<f64>,
    seconds: Option<f64>,
    compile_seconds: f64,
    /// The compiler's own out-of-memory report.
    shortfall: Option<String>,
}

fn sharding_of(program: &Program) -> String {
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

/// Bytes of the arguments one device holds: all of them, and those that are model parameters.
fn argument_bytes(program: &Program, param_names: &HashSet<String>) -> (u64, u64) {
    let (mut all, mut params) = (0u64, 0u64);
    for (i, (name, ty)) in program.arg_names().iter().zip(program.arg_types()).enumerate() {
        let elements: i64 = program.local_arg_dims(i).iter().product();
        let b = elements.max(0) as u64 * ty.dtype.size_bytes() as u64;
        all += b;
        if param_names.contains(name) {
            params += b;
        }
    }
    (all, params)
}

fn measure(
    program: &Program,
    compiled: &Compiled,
    target: &Target,
    param_names: &HashSet<String>,
) -> Measured {
    let (shape_args, param_bytes) = argument_bytes(program, param_names);
    let budget = target.memory_per_device();
    match (&compiled.memory, &compiled.shortfall) {
        (_, Some((required, available, what))) => Measured {
            sharding: sharding_of(program),
            param_bytes,
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
            }
        }
    }
}

/// `1.23 GiB`, `456.0 MiB`, `12.0 KiB`.
fn bytes(n: u64) -> String {
    let n = n as f64;
    const K: f64 = 1024.0;
    if n >= K * K * K {
        format!("{:.2} GiB", n / (K * K * K))
    } else if n >= K * K {
        format!("{:.1} MiB", n / (K * K))
    } else if n >= K {
        format!("{:.1} KiB", n / K)
    } else {
        format!("{n} B")
    }
}

fn seconds_text(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}

/// The smallest known topology of `generation` with at least `devices` devices.
fn topology_with_devices(generation: &str, devices: usize) -> Option<&'static str> {
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

/// Bytes of the learner's state on the device: f32 master parameters, both AdamW moments,
/// the gradient sums when micro-batches accumulate, and the compute-dtype copy for bf16.
fn learner_state_bytes(recipe: &Recipe, num_parameters: u64, accumulating: bool) -> u64 {
    let f32_copies = 3 + u64::from(accumulating);
    let bf16 = if recipe.actor.param_dtype == DTypeName::Bf16 {
        2
    } else {
        0
    };
    num_parameters * (4 * f32_copies + bf16)
}

/// The device set the advice is for: memory per device, devices, TPU generation.
struct Budget {
    memory_per_device: u64,
    devices: usize,
    generation: Option<String>,
}

impl Budget {
    fn of(target: &Target) -> Option<Budget> {
        Some(Budget {
            memory_per_device: target.memory_per_device()?,
            devices: target.num_devices(),
            generation: match target {
                Target::Tpu { info, .. } => TopologyName::parse(&info.name).ok().map(|n| n.generation),
                Target::Local { .. } => None,
            },
        })
    }
}

/// Advice for the rows that do not fit, naming the recipe keys to change.
fn advice(
    recipe: &Recipe,
    plan: &Plan,
    num_parameters: u64,
    measured: &[(PlannedRow, Measured)],
    budget: Option<Budget>,
) -> Vec<String> {
    let Some(Budget {
        memory_per_device: budget,
        devices,
        generation,
    }) = budget
    else {
        return Vec::new();
    };
    let head_room = (budget as f64 * 0.9) as u64;
    let mut out = Vec::new();
    let failing: Vec<&(PlannedRow, Measured)> = measured.iter().filter(|(_, m)| !m.fits).collect();
    let worst = |role: Role| {
        failing
            .iter()
            .filter(|(r, _)| r.role == role)
            .max_by_key(|(_, m)| m.peak_bytes)
            .map(|x| (&x.0, &x.1))
    };
    if let Some((row, m)) = worst(Role::Learner) {
        let micro = recipe.actor.ppo_micro_batch_size.max(1);
        let accumulating = plan.rows.iter().any(|r| r.label == "accumulate");
        let state = learner_state_bytes(recipe, num_parameters, accumulating);
        let partitions = plan.programs[row.program].num_partitions().max(1);
        // The state each device holds once it is sharded as far as it needs to be.
        let mut state_per_device = state / partitions as u64;
        // Devices the rows of a micro-batch are split over (more once FSDP is advised).
        let mut row_devices = partitions;
        if state_per_device > head_room / 2 {
            let needed = (state as f64 / (head_room as f64 / 2.0)).ceil() as usize;
            // A mesh of a power of two devices (micro-batches split evenly over it).
            let mesh = needed.next_power_of_two().max(devices);
            let mut text = format!(
                "the learner's state (f32 parameters, AdamW moments{}{}) is {}{}, more than the {} a device has \
                 room for beside activations: set `actor.strategy: fsdp` and `actor.mesh: {mesh}` to shard it",
                if accumulating { ", gradient sums" } else { "" },
                if recipe.actor.param_dtype == DTypeName::Bf16 { ", bf16 copy" } else { "" },
                bytes(state),
                if partitions > 1 {
                    format!(" ({} on each of {partitions} devices)", bytes(state_per_device))
                } else {
                    String::new()
                },
                bytes(head_room / 2),
            );
            if mesh <= devices {
                let _ = write!(
                    text,
                    " ({} each over this topology's {devices} devices)",
                    bytes(state / devices as u64)
                );
            } else {
                let _ = write!(
                    text,
                    " over at least {needed} devices ({} each over {mesh}): use more chips",
                    bytes(state / mesh as u64)
                );
                if let Some(t) = generation.as_deref().and_then(|g| topology_with_devices(g, mesh)) {
                    let _ = write!(text, ", e.g. --topology {t}");
                }
            }
            out.push(text);
            row_devices = mesh;
            state_per_device = state / row_devices as u64;
        }
        // Temporaries grow about linearly with the rows a device holds; the state does not.
        let temps = m.peak_bytes.saturating_sub(m.argument_bytes);
        let per_row = temps / micro.div_ceil(partitions) as u64;
        let temps_at = |rows: usize| per_row * rows.div_ceil(row_devices) as u64;
        let room = head_room.saturating_sub(state_per_device);
        if temps_at(micro) > room {
            let mut suggestion = micro;
            while suggestion > 1 && temps_at(suggestion) > room {
                suggestion /= 2;
            }
            if temps_at(suggestion) <= room && suggestion < micro {
                out.push(format!(
                    "{} needs {} of temporaries at `actor.ppo_micro_batch_size: {micro}` (about {} per row): set \
                     `actor.ppo_micro_batch_size: {suggestion}` to leave them {} beside the learner's state",
                    row.label,
                    bytes(temps),
                    bytes(per_row),
                    bytes(room)
                ));
            } else {
                out.push(format!(
                    "{} needs {} of temporaries at `actor.ppo_micro_batch_size: {micro}` (about {} per row), more \
                     than the {} left even with one row per device: shorten `data.max_prompt_length` / \
                     `data.max_response_length`, or use more chips with `actor.strategy: fsdp`",
                    row.label,
                    bytes(temps),
                    bytes(per_row),
                    bytes(room)
                ));
            }
        }
        if partitions == 1 && devices > 1 && out.iter().all(|a| !a.contains("actor.strategy")) {
            out.push(format!(
                "the learner's programs run on 1 of the {devices} devices: `actor.strategy: fsdp` with \
                 `actor.mesh: {devices}` would spread parameters and optimizer state over all of them"
            ));
        }
    }
    if let Some((row, m)) = worst(Role::Rollout) {
        // Per device: a rollout split over N devices holds 1/N of the slots on each.
        let (devices, slots) = (plan.cache.devices, plan.cache.local_slots());
        let cache = plan.cache.bytes_per_device() as u64;
        let per_slot = cache / slots.max(1) as u64;
        let other = m.peak_bytes.saturating_sub(cache);
        let fitting_slots = if other < head_room && per_slot > 0 {
            ((head_room - other) / per_slot) as usize
        } else {
            0
        };
        let on_each = if devices > 1 {
            format!(" on each of {devices} devices")
        } else {
            String::new()
        };
        let mut text = format!(
            "{} peaks at {} per device (weights {}, KV cache {} for {slots} slots{on_each}), more than the {} a device has: ",
            row.label,
            bytes(m.peak_bytes),
            bytes(m.param_bytes),
            bytes(cache),
            bytes(budget)
        );
        if fitting_slots >= 1 && fitting_slots < slots {
            let _ = write!(
                text,
                "set `rollout.max_num_seqs: {}` (now {})",
                (1usize << fitting_slots.ilog2()) * devices,
                recipe.rollout.max_num_seqs
            );
        } else {
            text.push_str("the weights leave no room for the KV cache: use a chip with more memory");
        }
        if recipe.rollout.dtype == DTypeName::F32 {
            text.push_str(", or `rollout.dtype: bf16` (halves the weights and the KV cache)");
        }
        text.push_str(", or shorter `data.max_prompt_length` / `data.max_response_length`");
        out.push(text);
    }
    out
}

/// The first device over a whole run when the learner and the rollout engine share it
/// (`cluster.rollout_workers: 0`): the buffers that stay (the learner's state, the KV cache,
/// the rollout's own weights when it cannot use the learner's) plus the largest temporaries of
/// any one program.
#[derive(Clone, Debug)]
struct DeviceTotal {
    learner_state: u64,
    kv_cache: u64,
    rollout_weights: u64,
    largest: String,
    largest_temporaries: u64,
    total: u64,
    memory: u64,
}

impl DeviceTotal {
    fn fits(&self) -> bool {
        self.total <= self.memory
    }

    fn describe(&self) -> String {
        format!(
            "device 0 over the run (learner and rollout share it): learner state {} + KV cache {}{} + the largest \
             temporaries ({}, {}) = {} of {}: {}",
            bytes(self.learner_state),
            bytes(self.kv_cache),
            if self.rollout_weights > 0 {
                format!(" + rollout weights {}", bytes(self.rollout_weights))
            } else {
                String::new()
            },
            self.largest,
            bytes(self.largest_temporaries),
            bytes(self.total),
            bytes(self.memory),
            if self.fits() { "fits" } else { "does NOT fit" }
        )
    }
}

fn device_total(
    recipe: &Recipe,
    plan: &Plan,
    num_parameters: u64,
    measured: &[(PlannedRow, Measured)],
    memory: Option<u64>,
) -> Option<DeviceTotal> {
    let memory = memory?;
    if recipe.cluster.rollout_workers > 0 || measured.iter().any(|(_, m)| m.shortfall.is_some()) {
        return None;
    }
    let accumulating = plan.rows.iter().any(|r| r.label == "accumulate");
    // The f32 masters one device holds (a shard under FSDP): from a compiled learner program,
    // else from the learner's layout.
    let masters = measured
        .iter()
        .filter(|(r, _)| r.role == Role::Learner)
        .map(|(_, m)| m.param_bytes)
        .max()
        .unwrap_or(plan.master_bytes_per_device);
    let sharded = masters < num_parameters * 4;
    let bf16 = recipe.actor.param_dtype == DTypeName::Bf16;
    let learner_state = masters * (3 + u64::from(accumulating)) + if bf16 { masters / 2 } else { 0 };
    let rollout_bytes = if recipe.rollout.dtype == DTypeName::Bf16 {
        2
    } else {
        4
    };
    let shared =
        recipe.rollout.dtype == recipe.actor.param_dtype && recipe.trainer.off_policy_steps == 0 && !sharded;
    let rollout_weights = if shared { 0 } else { num_parameters * rollout_bytes };
    let (largest, largest_temporaries) = measured
        .iter()
        .map(|(r, m)| (r.label.clone(), m.peak_bytes.saturating_sub(m.argument_bytes)))
        .max_by_key(|(_, t)| *t)?;
    let kv_cache = plan.cache.bytes_per_device() as u64;
    Some(DeviceTotal {
        learner_state,
        kv_cache,
        rollout_weights,
        largest,
        largest_temporaries,
        total: learner_state + kv_cache + rollout_weights + largest_temporaries,
        memory,
    })
}

/// Advice when the programs fit one by one but not together on the shared device.
fn device_total_advice(recipe: &Recipe, total: &DeviceTotal) -> String {
    let resident = total.total - total.largest_temporaries;
    let room = (total.memory as f64 * 0.95) as u64;
    let micro = recipe.actor.ppo_micro_batch_size.max(1);
    let mut text = format!("{}: ", total.describe());
    let learner_temps = !total.largest.starts_with("rollout_");
    if learner_temps && resident < room {
        let per_row = total.largest_temporaries / micro as u64;
        let mut m = micro;
        while m > 1 && per_row * m as u64 > room - resident {
            m /= 2;
        }
        if m < micro && per_row * m as u64 <= room - resident {
            let _ = write!(text, "set `actor.ppo_micro_batch_size: {m}` (now {micro}), or ");
        }
    }
    let _ = write!(
        text,
        "lower `rollout.max_num_seqs` (the KV cache, now {} slots), or set `actor.strategy: fsdp`, or run the \
         rollout in worker processes on other devices (`cluster.rollout_workers`)",
        recipe.rollout.max_num_seqs
    );
    text
}

/// Seconds of one training step by role, when every program has an estimate.
fn step_estimate(measured: &[(PlannedRow, Measured)]) -> Option<(f64, f64)> {
    let mut rollout = 0.0;
    let mut learner = 0.0;
    for (row, m) in measured {
        if row.runs_per_step == 0.0 {
            continue;
        }
        let t = m.seconds? * row.runs_per_step;
        match row.role {
            Role::Rollout => rollout += t,
            Role::Learner => learner += t,
        }
    }
    Some((rollout, learner))
}

fn table(target: &Target, measured: &[(PlannedRow, Measured)]) -> String {
    let memory = target
        .memory_per_device()
        .map(bytes)
        .unwrap_or_else(|| "?".into());
    let header = [
        "program",
        "role",
        "sharding",
        "runs/step",
        "params",
        "arguments",
        "temporaries",
        "peak",
        "memory/device",
        "fits",
        "GFLOP",
        "est. time",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for (row, m) in measured {
        rows.push(vec![
            row.label.clone(),
            row.role.name().to_string(),
            m.sharding.clone(),
            format!("{}", row.runs_per_step),
            bytes(m.param_bytes),
            bytes(m.argument_bytes),
            m.temp_bytes.map(bytes).unwrap_or_else(|| "-".into()),
            bytes(m.peak_bytes),
            memory.clone(),
            if m.fits { "yes" } else { "NO" }.to_string(),
            m.flops
                .map(|f| format!("{:.1}", f / 1e9))
                .unwrap_or_else(|| "-".into()),
            m.seconds.map(seconds_text).unwrap_or_else(|| "-".into()),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for (i, r) in rows.iter().enumerate() {
        let cells: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if c == 0 || c == 1 || c == 2 {
                    format!("{cell:<w$}", w = widths[c])
                } else {
                    format!("{cell:>w$}", w = widths[c])
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
        if i == 0 {
            out.push_str(&"-".repeat(widths.iter().sum::<usize>() + 2 * (widths.len() - 1)));
            out.push('\n');
        }
    }
    out
}

fn selected(row: &PlannedRow, only: &[String], step_only: bool) -> bool {
    (!step_only || row.runs_per_step > 0.0)
        && (only.is_empty() || only.iter().any(|o| row.label.contains(o.as_str())))
}

pub fn run(args: CompileArgs) -> Result<ExitCode> {
    let recipe = load_recipe(&args.recipe, &args.overrides)?;
    // `auto` compute types are decided for the target, not for this host.
    let target_kind = match (&args.topology, args.device) {
        (Some(_), _) => DeviceKind::Tpu,
        (None, Some(LocalDevice::Cuda)) => DeviceKind::Cuda,
        (None, _) => DeviceKind::Cpu,
    };
    let (recipe, choices) = resolve_auto_dtypes_on(&recipe, target_kind, target_kind);
    for line in actors::setup::DTypeChoice::lines(&choices) {
        eprintln!("{line}");
    }
    let (config, config_origin) = model_config(&recipe, &args.recipe, args.model_config.as_deref())?;
    eprintln!(
        "model: {} ({}, {:.1}M parameters, from {config_origin})",
        recipe.model.path,
        config.family,
        config.num_parameters() as f64 / 1e6
    );
    let started = Instant::now();
    let plan = Plan::for_recipe(&recipe, &config)?;
    eprintln!(
        "traced {} programs in {:.1} s",
        plan.programs.len(),
        started.elapsed().as_secs_f64()
    );
    let rows: Vec<PlannedRow> = plan
        .rows
        .iter()
        .filter(|r| selected(r, &args.only, args.step_only))
        .cloned()
        .collect();
    if rows.is_empty() {
        return Err(CompileError::NothingSelected {
            filters: args.only.clone(),
            names: plan
                .rows
                .iter()
                .map(|r| r.label.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }
        .into());
    }
    let max_partitions = rows
        .iter()
        .map(|r| plan.programs[r.program].num_partitions())
        .max()
        .unwrap_or(1);
    let target = open_target(&args, max_partitions)?;
    eprintln!("compiling for {}", target.describe());
    let mut compiled: BTreeMap<usize, Compiled> = BTreeMap::new();
    let distinct: Vec<usize> = {
        let mut seen = Vec::new();
        for r in &rows {
            if !seen.contains(&r.program) {
                seen.push(r.program);
            }
        }
        seen
    };
    for (k, &index) in distinct.iter().enumerate() {
        let program = &plan.programs[index];
        eprint!(
            "[{}/{}] compiling {} ({}) ... ",
            k + 1,
            distinct.len(),
            program.name(),
            sharding_of(program)
        );
        let c = target.compile(program)?;
        eprintln!(
            "{:.1} s{}",
            c.seconds,
            if c.shortfall.is_some() {
                ", does not fit"
            } else {
                ""
            }
        );
        compiled.insert(index, c);
    }
    let measured: Vec<(PlannedRow, Measured)> = rows
        .iter()
        .map(|r| {
            let m = measure(
                &plan.programs[r.program],
                &compiled[&r.program],
                &target,
                &plan.param_names,
            );
            (r.clone(), m)
        })
        .collect();
    let programs_fit = measured.iter().all(|(_, m)| m.fits);
    let complete = args.only.is_empty();
    let estimate = if complete { step_estimate(&measured) } else { None };
    let mut advice = advice(
        &recipe,
        &plan,
        config.num_parameters() as u64,
        &measured,
        Budget::of(&target),
    );
    let total = device_total(
        &recipe,
        &plan,
        config.num_parameters() as u64,
        &measured,
        target.memory_per_device(),
    );
    let together = total.as_ref().is_none_or(DeviceTotal::fits);
    if programs_fit && !together {
        advice.push(device_total_advice(&recipe, total.as_ref().expect("a total")));
    }
    let all_fit = programs_fit && together;
    if args.json {
        let rows_json: Vec<serde_json::Value> = measured
            .iter()
            .map(|(r, m)| {
                serde_json::json!({
                    "program": r.label,
                    "role": r.role.name(),
                    "purpose": r.purpose,
                    "sharding": m.sharding,
                    "partitions": plan.programs[r.program].num_partitions(),
                    "runs_per_step": r.runs_per_step,
                    "param_bytes": m.param_bytes,
                    "argument_bytes": m.argument_bytes,
                    "temp_bytes": m.temp_bytes,
                    "peak_bytes": m.peak_bytes,
                    "memory_per_device": target.memory_per_device(),
                    "fits": m.fits,
                    "compiler_message": m.shortfall,
                    "flops": m.flops,
                    "bytes_accessed": m.bytes_accessed,
                    "estimated_seconds": m.seconds,
                    "compile_seconds": m.compile_seconds,
                    "fingerprint": plan.programs[r.program].fingerprint(),
                })
            })
            .collect();
        let report = serde_json::json!({
            "recipe": args.recipe.display().to_string(),
            "target": target.describe(),
            "model_config": config_origin,
            "programs": rows_json,
            "fits": all_fit,
            "device_total": total.as_ref().map(|t| serde_json::json!({
                "learner_state_bytes": t.learner_state,
                "kv_cache_bytes": t.kv_cache,
                "rollout_weight_bytes": t.rollout_weights,
                "largest_temporaries_program": t.largest,
                "largest_temporary_bytes": t.largest_temporaries,
                "total_bytes": t.total,
                "memory_per_device": t.memory,
                "fits": t.fits(),
            })),
            "step_seconds": estimate.map(|(r, l)| serde_json::json!({"rollout": r, "learner": l, "total": r + l})),
            "advice": advice,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{}: {}", args.recipe.display(), target.describe());
        print!("{}", table(&target, &measured));
        for (r, m) in &measured {
            if let Some(s) = &m.shortfall {
                println!("{}: {s}", r.label);
            }
        }
        match estimate {
            Some((rollout, learner)) => println!(
                "estimated step time: {} (rollout {} + learner {}); roofline from the chip's peak bf16 FLOP/s and HBM \
                 bandwidth, longest prompts and every response at data.max_response_length",
                seconds_text(rollout + learner),
                seconds_text(rollout),
                seconds_text(learner)
            ),
            None if !complete => println!("estimated step time: needs every program (drop --only)"),
            None if !all_fit => println!("estimated step time: not available, some programs do not fit"),
            None => println!("estimated step time: not available (no published peak rates for this device)"),
        }
        if let Some(t) = &total {
            println!("{}", t.describe());
        }
        if all_fit {
            println!("everything fits");
        } else {
            println!("does not fit:");
            for a in &advice {
                println!("  - {a}");
            }
        }
    }
    if !all_fit {
        let failing = measured.iter().filter(|(_, m)| !m.fits).count();
        if failing > 0 {
            eprintln!(
                "error: {failing} of {} programs do not fit{}",
                measured.len(),
                advice.first().map(|a| format!(": {a}")).unwrap_or_default()
            );
        } else {
            eprintln!(
                "error: every program fits alone, not all together: {}",
                advice.last().cloned().unwrap_or_default()
            );
        }
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL_DATA: &str =
        "data:\n  train_files: t.parquet\n  train_batch_size: 4\n  max_prompt_length: 40\n  max_response_length: 24\n";

    /// A recipe with `sections` after its model section.
    fn recipe(sections: &str) -> Recipe {
        let text = format!("model:\n  path: models/none\n{sections}");
        actors::recipe::load_recipe_str(&text, "test.yaml").unwrap()
    }

    fn tiny() -> ModelConfig {
        ModelConfig::from_hf_file(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/model/fixtures/tiny/qwen2/config.json"
        )))
        .unwrap()
    }

    fn plan_for(r: &Recipe) -> Plan {
        Plan::for_recipe(r, &tiny()).unwrap()
    }

    /// The labels of `plan`'s rows that start with `prefix`, in plan order.
    fn labels<'a>(plan: &'a Plan, prefix: &str) -> Vec<&'a str> {
        plan.rows
            .iter()
            .filter(|x| x.label.starts_with(prefix))
            .map(|x| x.label.as_str())
            .collect()
    }

    #[test]
    fn plans_the_programs_a_run_compiles_with_their_runs_per_step() {
        // 4 prompts x n=4 = 16 rows; mini-batch 2 prompts = 8 rows; micro-batch 4 rows.
        let r = recipe(&format!(
            "{SMALL_DATA}rollout:\n  n: 4\n  max_num_seqs: 16\nactor:\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 4\n  use_kl_loss: true\n"
        ));
        let plan = plan_for(&r);
        let runs = |label: &str| {
            plan.rows
                .iter()
                .find(|x| x.label == label)
                .unwrap_or_else(|| {
                    panic!(
                        "{label} in {:?}",
                        plan.rows.iter().map(|x| &x.label).collect::<Vec<_>>()
                    )
                })
                .runs_per_step
        };
        // Buckets 16, 32, 64 (max_model_len 64); a prompt of 40 tokens prefills 39 in bucket 64;
        // width 4, each group prefilled alone (the engine's default `prefill_batch` of 1).
        let prefill = labels(&plan, "rollout_prefill");
        assert_eq!(
            prefill,
            [
                "rollout_prefill_16x1_fanout4_cache16x1x64",
                "rollout_prefill_32x1_fanout4_cache16x1x64",
                "rollout_prefill_64x1_fanout4_cache16x1x64",
            ]
        );
        // The longest bucket runs once per group (4 groups of 4 samples); the others not at all.
        assert_eq!(runs("rollout_prefill_64x1_fanout4_cache16x1x64"), 4.0);
        assert_eq!(runs("rollout_prefill_32x1_fanout4_cache16x1x64"), 0.0);
        // One decode program (an unchunked cache), one run per response token in 1 wave.
        assert_eq!(runs("rollout_decode_plain_cache16x64"), 24.0);
        // 2 mini-batches of 2 micro-batches: accumulate 4x, apply 2x; log-probs 4 micro-batches
        // each for the policy and the reference, which share one program.
        assert_eq!(runs("train_step"), 0.0);
        assert_eq!(runs("accumulate"), 4.0);
        assert_eq!(runs("apply"), 2.0);
        assert_eq!(runs("log_probs"), 4.0);
        assert_eq!(runs("log_probs (reference)"), 4.0);
        let lp = plan.rows.iter().find(|x| x.label == "log_probs").unwrap().program;
        let reference = plan
            .rows
            .iter()
            .find(|x| x.label == "log_probs (reference)")
            .unwrap()
            .program;
        assert_eq!(lp, reference);
        assert_eq!(plan.programs.len(), 3 + 1 + 4);
    }

    #[test]
    fn a_chunked_cache_has_one_decode_program_per_power_of_two_chunk_count() {
        // 1024 + 1024 positions: chunks of 256, 8 chunks; decode programs for 1, 2, 4, 8.
        let r = recipe("data:\n  train_files: t.parquet\n  max_prompt_length: 1024\n  max_response_length: 1024\n  train_batch_size: 2\nrollout:\n  n: 2\n  max_num_seqs: 4\n  top_k: 5\n");
        let plan = plan_for(&r);
        let decode: Vec<(&str, f64)> = plan
            .rows
            .iter()
            .filter(|x| x.label.starts_with("rollout_decode"))
            .map(|x| (x.label.as_str(), x.runs_per_step))
            .collect();
        // Positions 1023..2046: chunks 4 (1023), 5-8 (the rest) -> programs 4 and 8.
        assert_eq!(
            decode,
            [
                ("rollout_decode_topk_topp_cache4x8x256_attend1", 0.0),
                ("rollout_decode_topk_topp_cache4x8x256_attend2", 0.0),
                ("rollout_decode_topk_topp_cache4x8x256_attend4", 1.0),
                ("rollout_decode_topk_topp_cache4x8x256_attend8", 1023.0),
            ]
        );
        // Mini-batch (256 prompts by default, capped at the 4 rows) = one micro-batch: train_step.
        assert!(plan
            .rows
            .iter()
            .any(|x| x.label == "train_step" && x.runs_per_step == 1.0));
        assert!(!plan.rows.iter().any(|x| x.label == "accumulate"));
    }

    #[test]
    fn a_rollout_colocated_with_a_sharded_learner_is_planned_over_its_devices() {
        let sections = format!(
            "{SMALL_DATA}rollout:\n  n: 4\n  max_num_seqs: 16\n  dtype: bf16\nactor:\n  strategy: fsdp\n  mesh: 4\n  param_dtype: bf16\n"
        );
        let plan = plan_for(&recipe(&sections));
        assert_eq!((plan.cache.devices, plan.cache.local_slots()), (4, 4));
        assert_eq!(plan.cache.bytes_per_device() * 4, plan.cache.bytes());
        let rollout = labels(&plan, "rollout_");
        assert!(!rollout.is_empty());
        assert!(rollout.iter().all(|l| l.ends_with("_spmd4")), "{rollout:?}");
        // With rollout workers the rollout runs elsewhere, on one device each.
        let apart = plan_for(&recipe(&format!("{sections}cluster:\n  rollout_workers: 1\n")));
        assert_eq!(apart.cache.devices, 1);
        assert!(labels(&apart, "rollout_").iter().all(|l| !l.contains("spmd")));
    }

    #[test]
    fn model_config_is_found_beside_the_recipe_or_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let recipe_path = dir.path().join("r.yaml");
        let r = recipe(SMALL_DATA);
        let err = model_config(&r, &recipe_path, None).unwrap_err().to_string();
        assert!(
            err.contains("model.path models/none: no model architecture found"),
            "{err}"
        );
        assert!(err.contains("--model-config"), "{err}");
        let beside = dir.path().join("configs/none");
        std::fs::create_dir_all(&beside).unwrap();
        std::fs::copy(
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/model/fixtures/tiny/qwen2/config.json"
            ),
            beside.join("config.json"),
        )
        .unwrap();
        let (config, origin) = model_config(&r, &recipe_path, None).unwrap();
        assert_eq!(config, tiny());
        assert!(origin.ends_with("configs/none/config.json"), "{origin}");
    }

    fn failing(label: &str, role: Role, program: usize, peak: u64, arguments: u64) -> (PlannedRow, Measured) {
        (
            PlannedRow {
                role,
                label: label.into(),
                program,
                runs_per_step: 1.0,
                purpose: String::new(),
            },
            Measured {
                sharding: "1 device".into(),
                param_bytes: arguments / 2,
                argument_bytes: arguments,
                temp_bytes: Some(peak - arguments),
                peak_bytes: peak,
                fits: false,
                flops: None,
                bytes_accessed: None,
                seconds: None,
                compile_seconds: 1.0,
                shortfall: None,
            },
        )
    }

    #[test]
    fn advice_names_the_keys_the_numbers_point_to() {
        const GIB: u64 = 1 << 30;
        let r = recipe(&format!(
            "{SMALL_DATA}rollout:\n  n: 4\n  max_num_seqs: 16\nactor:\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 4\n"
        ));
        let plan = plan_for(&r);
        let acc = plan
            .rows
            .iter()
            .find(|x| x.label == "accumulate")
            .unwrap()
            .program;
        let v5e = || {
            Some(Budget {
                memory_per_device: 16 * GIB,
                devices: 4,
                generation: Some("v5e".into()),
            })
        };
        // A small model whose temporaries are too big: a smaller micro-batch (40 GiB of
        // temporaries at 4 rows = 10 GiB a row; 14.4 GiB of head room -> 1 row).
        let small = [failing("accumulate", Role::Learner, acc, 41 * GIB, GIB)];
        let a = advice(&r, &plan, 100_000_000, &small, v5e());
        assert_eq!(a.len(), 2, "{a:?}");
        assert!(a[0].contains("set `actor.ppo_micro_batch_size: 1`"), "{a:?}");
        assert!(a[0].contains("at `actor.ppo_micro_batch_size: 4`"), "{a:?}");
        assert!(
            a[1].contains("run on 1 of the 4 devices: `actor.strategy: fsdp` with `actor.mesh: 4`"),
            "{a:?}"
        );
        // 7.6B parameters: 4 f32 copies = 113 GiB of state: FSDP over at least 16 devices of
        // 7.2 GiB room each, i.e. v5e:4x4.
        let big = [failing("accumulate", Role::Learner, acc, 80 * GIB, 56 * GIB)];
        let a = advice(&r, &plan, 7_615_616_512, &big, v5e());
        assert!(a[0].contains("set `actor.strategy: fsdp`"), "{a:?}");
        assert!(
            a[0].contains(
                "`actor.mesh: 16` to shard it over at least 16 devices (7.09 GiB each over 16): use more chips, \
                 e.g. --topology v5e:4x4"
            ),
            "{a:?}"
        );
        // The rollout: fewer slots.
        let cache = plan.cache.bytes_per_device() as u64;
        let rollout = [failing(
            "rollout_decode",
            Role::Rollout,
            0,
            15 * GIB + cache,
            15 * GIB,
        )];
        let a = advice(&r, &plan, 100_000_000, &rollout, v5e());
        assert!(
            a[0].contains("the weights leave no room for the KV cache"),
            "{a:?}"
        );
        assert!(advice(&r, &plan, 1, &small, None).is_empty());
    }

    #[test]
    fn without_a_learner_program_the_learner_state_is_counted_from_its_layout() {
        const GIB: u64 = 1 << 30;
        let with = |actor: &str| {
            recipe(&format!(
                "{SMALL_DATA}rollout:\n  n: 4\n  max_num_seqs: 16\n  dtype: bf16\nactor:\n{actor}  param_dtype: bf16\n"
            ))
        };
        let whole = 4 * tiny().num_parameters() as u64;
        // Every dimension of the tiny Qwen2 (vocabulary 384, hidden 64, KV 32, MLP 128)
        // divides by 4, so under fsdp over 4 devices each holds a quarter of every tensor.
        for (actor, masters) in [
            ("", whole),
            ("  strategy: dp\n  mesh: 4\n", whole),
            ("  strategy: fsdp\n  mesh: 4\n", whole / 4),
        ] {
            let r = with(actor);
            let plan = plan_for(&r);
            assert_eq!(plan.master_bytes_per_device, masters, "{actor}");
            // `--only` a rollout program: the learner state still follows the layout.
            let rollout = plan.rows.iter().find(|x| x.role == Role::Rollout).unwrap();
            let mut row = failing(&rollout.label, Role::Rollout, rollout.program, GIB, GIB / 2);
            row.1.fits = true;
            let t = device_total(&r, &plan, whole / 4, &[row], Some(16 * GIB)).unwrap();
            // Masters, 2 moments, gradient sums when micro-batches accumulate, the bf16 copy.
            let sums = u64::from(plan.rows.iter().any(|x| x.label == "accumulate"));
            assert_eq!(t.learner_state, masters * (3 + sums) + masters / 2, "{actor}");
        }
    }

    #[test]
    fn programs_that_fit_alone_may_not_fit_beside_the_runs_resident_buffers() {
        const GIB: u64 = 1 << 30;
        let r = recipe(&format!(
            "{SMALL_DATA}rollout:\n  n: 4\n  max_num_seqs: 16\n  dtype: bf16\nactor:\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 4\n  param_dtype: bf16\n"
        ));
        let plan = plan_for(&r);
        let acc = plan
            .rows
            .iter()
            .find(|x| x.label == "accumulate")
            .unwrap()
            .program;
        // 1 GiB of f32 masters (268M parameters), 10 GiB of temporaries.
        let mut row = failing("accumulate", Role::Learner, acc, 12 * GIB, 2 * GIB);
        row.1.param_bytes = GIB;
        row.1.fits = true;
        let measured = [row];
        let params = GIB / 4;
        let t = device_total(&r, &plan, params, &measured, Some(16 * GIB)).unwrap();
        // Masters, 2 moments, gradient sums and the bf16 copy the rollout shares.
        assert_eq!(t.learner_state, 4 * GIB + GIB / 2);
        assert_eq!(t.rollout_weights, 0);
        assert_eq!(t.kv_cache, plan.cache.bytes_per_device() as u64);
        assert_eq!(t.largest_temporaries, 10 * GIB);
        assert_eq!(t.total, 14 * GIB + GIB / 2 + t.kv_cache);
        assert!(t.fits(), "{}", t.describe());
        let t = device_total(&r, &plan, params, &measured, Some(14 * GIB)).unwrap();
        assert!(!t.fits());
        assert!(
            t.describe().ends_with("of 14.00 GiB: does NOT fit"),
            "{}",
            t.describe()
        );
        // 2.5 GiB a row; 13.3 GiB - 4.5 GiB resident leaves room for 2 rows.
        let advice = device_total_advice(&r, &t);
        assert!(
            advice.contains("set `actor.ppo_micro_batch_size: 2` (now 4)"),
            "{advice}"
        );
        assert!(advice.contains("`cluster.rollout_workers`"), "{advice}");
        // An f32 rollout beside a bf16 learner holds its own copy of the weights.
        let f32_rollout = recipe(&format!(
            "{SMALL_DATA}rollout:\n  n: 4\n  max_num_seqs: 16\n  dtype: f32\nactor:\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 4\n  param_dtype: bf16\n"
        ));
        let t = device_total(&f32_rollout, &plan, params, &measured, Some(16 * GIB)).unwrap();
        assert_eq!(t.rollout_weights, GIB);
        // Rollout in worker processes: nothing shared.
        let workers = r.clone();
        let mut workers = workers;
        workers.cluster.rollout_workers = 1;
        assert!(device_total(&workers, &plan, params, &measured, Some(16 * GIB)).is_none());
    }

    #[test]
    fn smallest_topology_with_enough_devices() {
        assert_eq!(topology_with_devices("v5e", 5), Some("v5e:2x4"));
        assert_eq!(topology_with_devices("v5e", 4), Some("v5e:2x2"));
        assert_eq!(topology_with_devices("tpu7x", 8), Some("tpu7x:2x2x1"));
        assert_eq!(topology_with_devices("v6e", 100_000), None);
    }

    #[test]
    fn sizes_and_times_read_well() {
        assert_eq!(bytes(3 << 30), "3.00 GiB");
        assert_eq!(bytes(1536 << 10), "1.5 MiB");
        assert_eq!(bytes(100), "100 B");
        assert_eq!(seconds_text(0.0123), "12.30 ms");
        assert_eq!(seconds_text(2.5), "2.50 s");
        assert_eq!(seconds_text(4e-5), "40.0 us");
    }
}
