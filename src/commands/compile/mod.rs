//! `grpo compile`: compiles every program a recipe's run would use (the rollout's prefill
//! buckets and decode steps, the learner's `train_step`, `accumulate` + `apply`, `log_probs`
//! for the policy and the reference) for a TPU topology with libtpu and no TPU (deviceless), or
//! on the CPU / CUDA plugin present, and prints per program its sharding, memory per device,
//! whether it fits, its flops and a roofline time estimate, then the estimated step time.
//! Only the model's architecture is needed (config.json or GGUF metadata), never its weights.
//!
//! `plan.rs` traces the programs from the same `ProgramPlan` and `BatchPlan` a run uses,
//! `target.rs` compiles and measures them, `advice.rs` says whether the run fits and what to
//! change, `table.rs` prints them (after the run's meshes by axis, `Recipe::layout_text`).
//! With `model.enable_gradient_checkpointing` or `model.scan_layers` the learner's gradient
//! program is also compiled without them, and the temporaries saved and the flops added are
//! reported.

mod advice;
mod plan;
mod table;
mod target;

use advice::*;
use plan::*;
use table::*;
use target::*;

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use actors::recipe::{load_recipe, DTypeName, DeviceKind, Recipe, Strategy};
use actors::setup::{
    batch_plan, engine_config, policy, resolve_auto_dtypes_on, rollout_dtype, sampling_params, update_config,
};
use anyhow::Result;
use clap::{ArgGroup, Args, ValueEnum};
use model::{GgufFile, ModelConfig};
use rollout::plan::{DecodeKey, PrefillKey, ProgramPlan};
use rollout::programs::{DecodeSample, EnvExtend, PrefillFanout, SlotMoves, MOVES_PER_RUN};
use trainer::policy::DecoderPolicy;
use trainer::step::build_train_programs;
use xla::graph::Program;
use xla::runtime::tpu::{
    compile_for_topology_with, describe_topology, load_libtpu, TopologyInfo, TopologyName, TopologyOptions,
    TpuCompileOutcome, TpuGeneration, KNOWN_TOPOLOGIES,
};
use xla::runtime::{
    CacheConfig, Client, ClientOptions, CollectiveCount, CostAnalysis, MemoryStats, OpCost, OptionValue,
    Plugin, PluginKind,
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
        with a KL term, the reference's); with algorithm.adv_estimator: gae also PPO's critic's \
        values and its train_step or accumulate + apply, its state counted in the device total.\n\n\
        With --topology, each is compiled by libtpu for that TPU slice on this machine (deviceless: \
        `pip install libtpu`, no TPU needed); with --device cpu|cuda, by that PJRT plugin.\n\n\
        The model: only its architecture is read, from model.path's config.json (or a .gguf \
        file's metadata); when model.path does not exist (no checkpoint here), from \
        configs/<last part of model.path>/config.json beside the recipe (recipes/configs/ ships \
        those of the shipped recipes' models, and of Qwen3-30B-A3B and Qwen3-235B-A22B), or from \
        --model-config.\n\n\
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

    /// Compile only the programs whose name matches this regular expression somewhere
    /// (repeatable), e.g. `--only train_step`, or `--only 'attend4$'` for the decode step
    /// without its slot buckets (`_rows8`, ...). The step-time estimate needs every program,
    /// so it is left out.
    #[arg(long, value_name = "REGEX", value_parser = parse_only)]
    pub only: Vec<regex::Regex>,

    /// Compile only the programs one training step runs (worst case: the longest prompts,
    /// every response at data.max_response_length): leaves out shorter prefill buckets,
    /// validation's programs and cache lengths a step never reaches. Much faster; the step-time
    /// estimate is the same.
    #[arg(long)]
    pub step_only: bool,

    /// Where the bytes go: for each compiled program whose name matches this regular
    /// expression (repeatable), its operations from the optimized program (fusions, products,
    /// copies, collectives) by bytes moved, with their flops and each one's share of the whole.
    #[arg(long, value_name = "REGEX", value_parser = parse_only)]
    pub explain: Vec<regex::Regex>,

    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A local device kind for `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LocalDevice {
    /// The CPU plugin.
    Cpu,
    /// The CUDA plugin (`pip install jax-cuda13-pjrt`, or `$GRPO_PJRT_CUDA`).
    Cuda,
}

fn after_help() -> String {
    format!(
        "Examples:\n  \
         grpo compile recipes/gsm8k-qwen2.5-0.5b-tpu-v6e.yaml --topology v6e:2x2\n  \
         grpo compile recipes/gsm8k-qwen2.5-0.5b-tpu-v6e.yaml --topology v5e:2x2 --step-only --set actor.ppo_micro_batch_size=2\n  \
         grpo compile recipes/gsm8k-qwen2.5-0.5b-tpu-v6e.yaml --topology tpu7x:2x2x1 --only train_step --json\n  \
         grpo compile recipes/gsm8k-qwen2.5-0.5b-tpu-v6e.yaml --topology v6e:2x2 --step-only --only accumulate --explain accumulate\n  \
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

/// An `--only` pattern.
fn parse_only(pattern: &str) -> Result<regex::Regex, String> {
    regex::Regex::new(pattern).map_err(|e| format!("not a regular expression: {e}"))
}

/// Which half of a step a program belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
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

/// A mixture-of-experts model's experts and how many each device holds in the learner's and
/// the rollout's layouts: split by expert over the tensor-parallel devices where the count
/// divides (`model::ParamLayout`), whole on each device otherwise.
fn experts_line(recipe: &Recipe, config: &ModelConfig) -> Option<String> {
    let moe = config.moe.as_ref()?;
    let spec = model::param_table(config)
        .into_iter()
        .find(|s| s.name.ends_with("mlp.experts.gate_up_proj"))?;
    let per_device = |tp: usize| {
        let tp = tp.max(1);
        match spec.tensor_parallel_dim(tp) {
            Some(_) => moe.num_experts / tp,
            None => moe.num_experts,
        }
    };
    let (learner, rollout) = (
        recipe.actor.tensor_model_parallel_size.max(1),
        recipe.rollout.tensor_model_parallel_size.max(1),
    );
    Some(format!(
        "experts: {} in each of {} MoE layers, {} per token; {} per device in the learner \
         (tensor-parallel {learner}), {} in the rollout (tensor-parallel {rollout})",
        moe.num_experts,
        config.moe_layers(),
        moe.experts_per_token,
        per_device(learner),
        per_device(rollout),
    ))
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
    let active = match config.moe {
        Some(_) => format!(", {:.1}M active", config.active_parameters() as f64 / 1e6),
        None => String::new(),
    };
    eprintln!(
        "model: {} ({}, {:.1}M parameters{active}, from {config_origin})",
        recipe.model.path,
        config.family,
        config.num_parameters() as f64 / 1e6
    );
    if let Some(line) = experts_line(&recipe, &config) {
        eprintln!("{line}");
    }
    if let Some((_, Some(why))) = actors::setup::lora_form(&recipe) {
        eprintln!("{why}");
    }
    let started = Instant::now();
    let plan = Plan::for_recipe(&recipe, &config, target_kind.plugin())?;
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
            filters: args.only.iter().map(|r| r.as_str().to_string()).collect(),
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
    let mut measured: Vec<(PlannedRow, Measured)> = rows
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
    let loop_estimates = add_loop_iterations(&plan, &mut measured, &target)?;
    let layers = match &plan.plain_layers {
        Some((label, program)) => match measured.iter().find(|(r, _)| &r.label == label) {
            Some((_, with)) => {
                eprint!(
                    "[+] compiling {} with one trace per layer, keeping every activation, for comparison ... ",
                    program.name()
                );
                let c = target.compile(program)?;
                eprintln!("{:.1} s", c.seconds);
                let without = measure(program, &c, &target, &plan.param_names);
                let keys = [
                    (
                        recipe.model.enable_gradient_checkpointing,
                        "model.enable_gradient_checkpointing",
                    ),
                    (recipe.model.scan_layers, "model.scan_layers"),
                ];
                Some(LayersEffect {
                    program: label.clone(),
                    keys: keys.iter().filter(|(on, _)| *on).map(|(_, k)| *k).collect(),
                    with: with.clone(),
                    without,
                })
            }
            None => None,
        },
        None => None,
    };
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
        advice.push(device_total_advice(
            &recipe,
            &config,
            config.num_parameters() as u64,
            total.as_ref().expect("a total"),
        ));
    }
    let all_fit = programs_fit && together;
    let collectives = step_collectives(&measured);
    let explained: Vec<(&str, &[OpCost], Option<f64>)> = distinct
        .iter()
        .map(|i| {
            let c = &compiled[i];
            (
                plan.programs[*i].name(),
                c.operations.as_slice(),
                c.cost.as_ref().and_then(|c| c.flops),
            )
        })
        .filter(|(name, _, _)| args.explain.iter().any(|r| r.is_match(name)))
        .collect();
    let mfu = estimate
        .and_then(|(_, learner)| learner_mfu(&target, &plan, &measured, config.active_parameters(), learner));
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
                "learner_state_bytes": t.learner_state(),
                "learner_param_bytes": t.learner_params,
                "optimizer_bytes": t.optimizer,
                "frozen_bytes": t.frozen,
                "kv_cache_bytes": t.kv_cache,
                "rollout_weight_bytes": t.rollout_weights,
                "largest_temporaries_program": t.largest,
                "largest_temporary_bytes": t.largest_temporaries,
                "total_bytes": t.total,
                "memory_per_device": t.memory,
                "fits": t.fits(),
            })),
            "step_seconds": estimate.map(|(r, l)| serde_json::json!({"rollout": r, "learner": l, "total": r + l})),
            "layout": recipe.layout_text(),
            "collectives_per_step": collectives.iter().map(|((role, kind), c)| serde_json::json!({
                "role": role.name(), "kind": kind, "count": c.count, "bytes_per_device": c.bytes,
            })).collect::<Vec<_>>(),
            "learner_mfu_estimate": mfu,
            "loop_estimates": loop_estimates,
            "layers": layers.as_ref().map(|e| serde_json::json!({
                "program": e.program,
                "keys": e.keys,
                "temp_bytes": e.with.temp_bytes,
                "temp_bytes_without": e.without.temp_bytes,
                "flops": e.with.flops,
                "flops_without": e.without.flops,
                "compile_seconds": e.with.compile_seconds,
                "compile_seconds_without": e.without.compile_seconds,
                "fits_without": e.without.fits,
            })),
            "advice": advice,
            "explain": explained.iter().map(|(name, ops, cost_flops)| serde_json::json!({
                "program": name,
                "cost_analysis_flops": cost_flops,
                "operations": ops.iter().map(|o| serde_json::json!({
                    "name": o.name, "what": o.what, "shape": o.shape, "bytes": o.bytes,
                    "flops": o.flops, "in_loop": o.in_loop,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
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
        if let Some(m) = mfu {
            println!(
                "learner model-FLOPs utilisation (estimate from the cost model): {:.1}% (6 x {:.2}B {}parameters x {:.0} \
                 tokens a step over the learner's roofline time on {} chips at their peak bf16 FLOP/s)",
                100.0 * m,
                config.active_parameters() as f64 / 1e9,
                if config.moe.is_some() { "active " } else { "" },
                plan.trained_tokens_per_step,
                learner_chips(&target, &plan, &measured)
            );
        }
        println!("layout: {}", recipe.layout_text());
        if !collectives.is_empty() {
            println!(
                "{}{}",
                collectives_text(&collectives),
                if complete {
                    ""
                } else {
                    " (the selected programs only)"
                }
            );
        }
        if let Some(t) = &total {
            println!("{}", t.describe());
        }
        if !loop_estimates.is_empty() {
            println!(
                "{} loop over the layers (model.scan_layers): XLA's cost analysis counts a loop's body once, so their GFLOP, time and collectives include the other {} layers' cost, measured as the difference of the same program traced for 2 and for 1 layer (estimates)",
                loop_estimates.join(", "),
                config.num_hidden_layers.saturating_sub(1)
            );
        }
        if let Some(e) = &layers {
            println!("{}", e.describe());
        }
        for (name, ops, cost_flops) in &explained {
            print!("{}", explain_text(name, ops, *cost_flops));
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

/// Adds to each scanned learner program's flops, bytes, roofline time and collectives the loop
/// iterations XLA's cost analysis leaves out (it counts a loop's body once): `layers - 1`
/// times one layer's cost, from the plan's 1- and 2-layer probes. Returns the rows corrected.
fn add_loop_iterations(
    plan: &Plan,
    measured: &mut [(PlannedRow, Measured)],
    target: &Target,
) -> Result<Vec<String>, CompileError> {
    let mut loop_estimates = Vec::new();
    for probe in &plan.layer_probes {
        if !measured.iter().any(|(r, _)| probe.labels.contains(&r.label)) {
            continue;
        }
        eprint!(
            "[+] compiling {} for 1 and 2 layers, one layer's cost for the scan's other iterations ... ",
            probe.labels[0]
        );
        let (one, two) = (target.compile(&probe.one)?, target.compile(&probe.two)?);
        eprintln!("{:.1} s", one.seconds + two.seconds);
        let extra = (probe.layers as f64 - 1.0).max(0.0);
        let delta = |f: fn(&xla::runtime::CostAnalysis) -> Option<f64>| match (&one.cost, &two.cost) {
            (Some(a), Some(b)) => Some((f(b).unwrap_or(0.0) - f(a).unwrap_or(0.0)).max(0.0) * extra),
            _ => None,
        };
        let (flops, bytes_accessed) = (delta(|c| c.flops), delta(|c| c.bytes_accessed));
        for (row, m) in measured
            .iter_mut()
            .filter(|(r, _)| probe.labels.contains(&r.label))
        {
            m.flops = m.flops.zip(flops).map(|(a, b)| a + b);
            m.bytes_accessed = m.bytes_accessed.zip(bytes_accessed).map(|(a, b)| a + b);
            m.seconds = target.estimate_seconds(&xla::runtime::CostAnalysis {
                flops: m.flops,
                bytes_accessed: m.bytes_accessed,
                transcendentals: None,
                properties: Vec::new(),
            });
            for (kind, c2) in &two.collectives {
                let c1 = one.collectives.get(kind).cloned().unwrap_or_default();
                let c = m.collectives.entry(*kind).or_default();
                c.count += (c2.count.saturating_sub(c1.count) as f64 * extra) as u64;
                c.bytes += (c2.bytes.saturating_sub(c1.bytes) as f64 * extra) as u64;
            }
            loop_estimates.push(row.label.clone());
        }
    }
    Ok(loop_estimates)
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

    /// The architectures `recipes/configs/` ships for `grpo compile` (no weights here): each
    /// parses, with the parameter count its model card gives.
    #[test]
    fn the_shipped_architectures_parse_with_their_published_sizes() {
        for (name, family, millions) in [
            ("Qwen2.5-0.5B-Instruct", "qwen2", 494),
            ("Qwen2.5-7B-Instruct", "qwen2", 7616),
            ("Llama-3.1-8B-Instruct", "llama", 8030),
            ("Qwen3-8B", "qwen3", 8191),
            ("Qwen3-30B-A3B", "qwen3_moe", 30532),
        ] {
            let path = format!(
                "{}/recipes/configs/{name}/config.json",
                env!("CARGO_MANIFEST_DIR")
            );
            let config =
                ModelConfig::from_hf_file(Path::new(&path)).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert_eq!(config.family.to_string(), family, "{name}");
            let got = (config.num_parameters() as f64 / 1e6).round() as u64;
            assert_eq!(got, millions, "{name}");
        }
        // The "A3B": 8 of its 128 experts per token.
        let path = format!(
            "{}/recipes/configs/Qwen3-30B-A3B/config.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let config = ModelConfig::from_hf_file(Path::new(&path)).unwrap();
        assert_eq!((config.active_parameters() as f64 / 1e6).round() as u64, 3353);
        // "3.3B activated"
        let mut r = recipe("data:\n  train_files: t.parquet\n");
        r.actor.tensor_model_parallel_size = 4;
        r.rollout.tensor_model_parallel_size = 3;
        assert_eq!(
            experts_line(&r, &config).unwrap(),
            "experts: 128 in each of 48 MoE layers, 8 per token; 32 per device in the learner \
             (tensor-parallel 4), 128 in the rollout (tensor-parallel 3)"
        );
        assert!(experts_line(&r, &tiny()).is_none());
        // Qwen3-235B-A22B: "235B total, 22B activated".
        let path = format!(
            "{}/recipes/configs/Qwen3-235B-A22B/config.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let config = ModelConfig::from_hf_file(Path::new(&path)).unwrap();
        assert_eq!((config.num_parameters() as f64 / 1e6).round() as u64, 235_094);
        assert_eq!((config.active_parameters() as f64 / 1e6).round() as u64, 22_191);
    }

    fn plan_for(r: &Recipe) -> Plan {
        Plan::for_recipe(r, &tiny(), PluginKind::Cpu).unwrap()
    }

    /// The labels of `plan`'s rows that start with `prefix`, in plan order.
    fn labels<'a>(plan: &'a Plan, prefix: &str) -> Vec<&'a str> {
        plan.rows
            .iter()
            .filter(|x| x.label.starts_with(prefix))
            .map(|x| x.label.as_str())
            .collect()
    }

    /// The runs per step of `plan`'s row `label`.
    fn runs_per_step(plan: &Plan, label: &str) -> f64 {
        plan.rows
            .iter()
            .find(|x| x.label == label)
            .unwrap_or_else(|| {
                panic!(
                    "no {label} row in {:?}",
                    plan.rows.iter().map(|x| &x.label).collect::<Vec<_>>()
                )
            })
            .runs_per_step
    }

    #[test]
    fn plans_the_programs_a_run_compiles_with_their_runs_per_step() {
        // 4 prompts x n=4 = 16 rows; mini-batch 2 prompts = 8 rows; micro-batch 4 rows.
        let r = recipe(&format!(
            "{SMALL_DATA}rollout:\n  n: 4\n  max_num_seqs: 16\nactor:\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 4\n  use_kl_loss: true\n"
        ));
        let plan = plan_for(&r);
        let runs = |label: &str| runs_per_step(&plan, label);
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
        // The 8-slot bucket, for a step's tail (runs counted for the worst case, so none), and
        // the slot moves that compact samples into it.
        assert_eq!(runs("rollout_decode_plain_cache16x64_rows8"), 0.0);
        assert_eq!(runs("rollout_move_slots_8_cache16x1x64"), 0.0);
        assert_eq!(plan.programs.len(), 3 + 2 + 4 + 1);
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
        assert_eq!(
            (plan.rollout.cache.devices, plan.rollout.cache.local_slots()),
            (4, 4)
        );
        assert_eq!(
            plan.rollout.cache.bytes_per_device() * 4,
            plan.rollout.cache.bytes()
        );
        let rollout = labels(&plan, "rollout_");
        assert!(!rollout.is_empty());
        assert!(rollout.iter().all(|l| l.ends_with("_spmd4")), "{rollout:?}");
        // With rollout workers the rollout runs elsewhere, on one device each.
        let apart = plan_for(&recipe(&format!("{sections}cluster:\n  rollout_workers: 1\n")));
        assert_eq!(apart.rollout.cache.devices, 1);
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

    /// `plan`'s first row of `role` (for the learner, its `accumulate`), measured as fitting with
    /// `peak` bytes of which `arguments` are arguments.
    fn fitting(plan: &Plan, role: Role, peak: u64, arguments: u64) -> (PlannedRow, Measured) {
        let planned = plan
            .rows
            .iter()
            .find(|x| x.role == role && (role == Role::Rollout || x.label == "accumulate"))
            .unwrap();
        let mut row = failing(&planned.label, role, planned.program, peak, arguments);
        row.1.fits = true;
        row
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
                frozen_bytes: 0,
                argument_bytes: arguments,
                temp_bytes: Some(peak - arguments),
                peak_bytes: peak,
                fits: false,
                flops: None,
                bytes_accessed: None,
                seconds: None,
                compile_seconds: 1.0,
                shortfall: None,
                collectives: BTreeMap::new(),
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
                 e.g. --topology v5e:4x4; or train LoRA adapters (`actor.lora_rank: 32`)"
            ),
            "{a:?}"
        );
        // The rollout: fewer slots.
        let cache = plan.rollout.cache.bytes_per_device() as u64;
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
    fn ppo_plans_the_critics_programs_and_counts_its_state() {
        const GIB: u64 = 1 << 30;
        let r = recipe(&format!(
            "{SMALL_DATA}rollout:\n  n: 4\n  max_num_seqs: 16\nalgorithm:\n  adv_estimator: gae\n\
             critic:\n  ppo_micro_batch_size: 2\n  ppo_epochs: 2\n"
        ));
        let plan = plan_for(&r);
        let runs = |label: &str| runs_per_step(&plan, label);
        // The critic's micro-batches of 2 over the step's samples, once for the values and twice
        // (two epochs) for its update, which accumulates over its mini-batches.
        let samples = (r.data.train_batch_size * r.rollout.n) as f64;
        assert_eq!(runs("critic values"), samples / 2.0);
        assert_eq!(runs("critic accumulate"), 2.0 * samples / 2.0);
        assert!(runs("critic apply") > 0.0);
        // The critic is the trunk and a value head: no output head of its own.
        let whole = 4 * tiny().num_parameters() as u64;
        let head = 4 * (tiny().hidden_size as u64 + 1);
        assert_eq!(
            plan.critic_bytes_per_device,
            whole + head
                - if tiny().tie_word_embeddings {
                    0
                } else {
                    4 * (tiny().vocab_size * tiny().hidden_size) as u64
                }
        );
        let row = fitting(&plan, Role::Rollout, GIB, GIB / 2);
        let t = device_total(&r, &plan, whole / 4, &[row], Some(16 * GIB)).unwrap();
        let sums = u64::from(plan.rows.iter().any(|x| x.label == "critic accumulate"));
        assert_eq!(t.critic, plan.critic_bytes_per_device * (3 + sums));
        assert!(
            t.describe().contains("critic and its optimizer state"),
            "{}",
            t.describe()
        );
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
            let row = fitting(&plan, Role::Rollout, GIB, GIB / 2);
            let t = device_total(&r, &plan, whole / 4, &[row], Some(16 * GIB)).unwrap();
            // Masters, 2 moments, gradient sums when micro-batches accumulate, the bf16 copy.
            let sums = u64::from(plan.rows.iter().any(|x| x.label == "accumulate"));
            assert_eq!(t.learner_state(), masters * (3 + sums) + masters / 2, "{actor}");
            assert_eq!(t.frozen, 0, "{actor}");
        }
        // LoRA: the learner's masters and AdamW state are the adapters'; the base is held
        // frozen in bf16, a quarter of it on each device under fsdp over 4.
        let r = with("  strategy: fsdp\n  mesh: 4\n  lora_rank: 4\n  lora_form: merged\n");
        let plan = plan_for(&r);
        assert_eq!(plan.frozen_bytes_per_device, whole / 2 / 4);
        let masters = plan.master_bytes_per_device;
        assert!(
            masters > 0 && masters < whole / 16,
            "adapters: {masters} of {whole}"
        );
        let row = fitting(&plan, Role::Rollout, GIB, GIB / 2);
        let t = device_total(&r, &plan, whole / 4, &[row], Some(16 * GIB)).unwrap();
        let sums = u64::from(plan.rows.iter().any(|x| x.label == "accumulate"));
        assert_eq!(t.frozen, whole / 8);
        assert_eq!(t.learner_state(), masters * (3 + sums) + masters / 2 + whole / 8);
        assert!(t.rollout_weights > 0, "the rollout decodes from a merged copy");
        assert!(
            t.describe()
                .contains(&format!("frozen base {}", bytes(whole / 8))),
            "{}",
            t.describe()
        );
        // In the applied form on one device the rollout holds the learner's frozen base (no
        // copy) and only the f32 adapters beside it.
        let total = |r: &Recipe| {
            let plan = plan_for(r);
            let row = fitting(&plan, Role::Rollout, GIB, GIB / 2);
            let t = device_total(r, &plan, whole / 4, &[row], Some(16 * GIB)).unwrap();
            (t, plan.master_bytes_per_device)
        };
        let (t, adapters) = total(&with("  lora_rank: 4\n  lora_form: applied\n"));
        assert_eq!(t.rollout_weights, adapters, "the adapters beside the shared base");
        let (t, _) = total(&with("  lora_rank: 4\n  lora_form: merged\n"));
        assert_eq!(t.rollout_weights, whole / 2, "the merged form's bf16 copy");
    }

    #[test]
    fn programs_that_fit_alone_may_not_fit_beside_the_runs_resident_buffers() {
        const GIB: u64 = 1 << 30;
        let r = recipe(&format!(
            "{SMALL_DATA}rollout:\n  n: 4\n  max_num_seqs: 16\n  dtype: bf16\nactor:\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 4\n  param_dtype: bf16\n"
        ));
        let plan = plan_for(&r);
        // 1 GiB of f32 masters (268M parameters), 10 GiB of temporaries.
        let mut row = fitting(&plan, Role::Learner, 12 * GIB, 2 * GIB);
        row.1.param_bytes = GIB;
        let measured = [row];
        let params = GIB / 4;
        let t = device_total(&r, &plan, params, &measured, Some(16 * GIB)).unwrap();
        // Masters, 2 moments, gradient sums and the bf16 copy the rollout shares.
        assert_eq!(t.learner_state(), 4 * GIB + GIB / 2);
        assert_eq!(t.rollout_weights, 0);
        assert_eq!(t.kv_cache, plan.rollout.cache.bytes_per_device() as u64);
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
        let advice = device_total_advice(&r, &plan.config, params, &t);
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
        // LoRA merged in process: the rollout's merged copy; when that copy is what does not
        // fit, the advice names the applied form, which holds only the adapters beside the
        // learner's frozen base.
        let lora = recipe(&format!(
            "{SMALL_DATA}rollout:\n  n: 4\n  max_num_seqs: 16\n  dtype: bf16\nactor:\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 4\n  param_dtype: bf16\n  lora_rank: 4\n  lora_form: merged\n"
        ));
        let lora_plan = plan_for(&lora);
        let mut row = fitting(&lora_plan, Role::Learner, 12 * GIB, 2 * GIB);
        row.1.param_bytes = lora_plan.master_bytes_per_device;
        let lora_measured = [row];
        // A model of 4 G parameters: an 8 GiB bf16 merged copy.
        let big = 4 * GIB;
        let t = device_total(&lora, &lora_plan, big, &lora_measured, Some(64 * GIB)).unwrap();
        assert_eq!(t.rollout_weights, 8 * GIB, "a bf16 merged copy");
        // Room (95 % of the memory) for everything but the merged copy, with 64 MiB to spare.
        let tight = ((t.total - t.rollout_weights + 64 * (1 << 20)) as f64 / 0.95) as u64;
        let t = device_total(&lora, &lora_plan, big, &lora_measured, Some(tight)).unwrap();
        assert!(!t.fits(), "{}", t.describe());
        let advice = device_total_advice(&lora, &lora_plan.config, big, &t);
        assert!(advice.contains("set `actor.lora_form: applied`"), "{advice}");
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
