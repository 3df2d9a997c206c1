//! The plan: every program a recipe's run uses, traced (not compiled), with its runs per step
//! and purpose; the rollout's from `rollout::plan::ProgramPlan`, the learner's from
//! `trainer::update::BatchPlan`, as the run itself builds them.

#[allow(unused_imports)]
use super::*;

/// One row of the report: a program (several rows may share one compiled program, as the
/// policy's and the reference's log-probs do) and how often a training step runs it.
#[derive(Clone, Debug)]
pub(super) struct PlannedRow {
    pub(super) role: Role,
    pub(super) label: String,
    /// Index into the list of distinct programs.
    pub(super) program: usize,
    /// Runs per training step (0 for programs only validation or shorter prompts use).
    pub(super) runs_per_step: f64,
    /// What it is for, in words.
    pub(super) purpose: String,
}

/// Every program of the run, deduplicated by fingerprint, and the rows that use them.
pub(super) struct Plan {
    pub(super) programs: Vec<Arc<Program>>,
    pub(super) rows: Vec<PlannedRow>,
    /// Names of the model's parameters (to count parameter bytes among the arguments).
    pub(super) param_names: HashSet<String>,
    /// The rollout's programs and its KV-cache shape (for advice).
    pub(super) rollout: ProgramPlan,
    /// Bytes of f32 master weights one learner device holds (its shards under `fsdp`), from
    /// the learner's layout: what the learner state is counted from when no compiled learner
    /// program says (`--only` without one).
    pub(super) master_bytes_per_device: u64,
    /// Likewise the frozen tensors' bytes (with LoRA the base model in the compute type).
    pub(super) frozen_bytes_per_device: u64,
    /// Likewise PPO's critic's f32 master weights (0 without a critic).
    pub(super) critic_bytes_per_device: u64,
    /// With `model.enable_gradient_checkpointing` or `model.scan_layers`: the label of the
    /// learner's gradient program (`train_step` or `accumulate`) and that program traced one
    /// layer at a time keeping every activation, compiled beside it to report what the recipe's
    /// way of tracing the layers saves and costs.
    pub(super) plain_layers: Option<(String, Program)>,
    /// With `model.scan_layers`: what one decoder layer costs in each scanned learner program.
    /// XLA's cost analysis (and the collectives read from the optimized HLO) count a loop's
    /// body once, so the report adds `layers - 1` more of this (an estimate).
    pub(super) layer_probes: Vec<LayerProbe>,
    /// The model's architecture.
    pub(super) config: ModelConfig,
    /// Tokens the learner's forward and backward passes process per step (prompts once per
    /// micro-batch, every response), for the model-FLOPs utilisation estimate.
    pub(super) trained_tokens_per_step: f64,
}

impl Plan {
    /// Every program a run of `recipe` compiles (rollout, then learner) on a `plugin`'s
    /// devices, traced, not compiled.
    pub(super) fn for_recipe(
        recipe: &Recipe,
        config: &ModelConfig,
        plugin: PluginKind,
    ) -> Result<Plan, CompileError> {
        let settings = engine_config(recipe, &[]);
        let mut plan = Plan {
            programs: Vec::new(),
            rows: Vec::new(),
            // The model's table (the rollout's weights) and what the learner trains (with LoRA
            // the adapters; the base is among the frozen arguments).
            param_names: model::param_table(config)
                .into_iter()
                .chain(policy(recipe, config).param_specs())
                .map(|s| s.name)
                .collect(),
            rollout: ProgramPlan::new(
                config,
                &settings,
                recipe.rollout_devices(),
                rollout_dtype(recipe),
                plugin,
            ),
            master_bytes_per_device: 0,
            frozen_bytes_per_device: 0,
            critic_bytes_per_device: 0,
            plain_layers: None,
            layer_probes: Vec::new(),
            config: config.clone(),
            trained_tokens_per_step: 0.0,
        };
        (
            plan.master_bytes_per_device,
            plan.frozen_bytes_per_device,
            plan.critic_bytes_per_device,
        ) = learner_bytes_per_device(recipe, config)?;
        plan_rollout(&mut plan, recipe, config)?;
        plan_learner(&mut plan, recipe, config, plugin)?;
        Ok(plan)
    }

    pub(super) fn add(
        &mut self,
        role: Role,
        label: String,
        program: Program,
        runs_per_step: f64,
        purpose: String,
    ) {
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
pub(super) fn plan_rollout(
    plan: &mut Plan,
    recipe: &Recipe,
    config: &ModelConfig,
) -> Result<(), CompileError> {
    let settings = engine_config(recipe, &[]);
    let weights = rollout_dtype(recipe);
    let programs = plan.rollout.clone();
    let cache = &programs.cache;
    let slots = cache.slots;
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
        // The longest prompt picks the longest bucket used, every shorter bucket may be used by
        // shorter prompts; a step's runs are counted for the worst case (every prompt longest).
        let longest = programs.prefill(prompt, n, 1);
        let batch = programs.prefill_batch(longest.width);
        for &bucket in programs.buckets().iter().filter(|&&b| b <= longest.bucket) {
            let top = bucket == longest.bucket;
            let mut variants = vec![(1, if batch > 1 { groups % batch } else { groups })];
            if batch > 1 {
                variants.push((batch, groups / batch));
            }
            for (batch, runs) in variants {
                let key = PrefillKey {
                    bucket,
                    batch,
                    ..longest
                };
                let program = PrefillFanout::build(config, weights, cache, key.bucket, key.width, key.batch)
                    .map_err(err)?;
                let label = program.name().to_string();
                plan.add(
                    Role::Rollout,
                    label,
                    program,
                    if top { runs as f64 } else { 0.0 },
                    format!(
                        "{what} prefill: {batch} prompt(s) of <= {bucket} tokens, fan-out to {} slots",
                        key.width
                    ),
                );
            }
        }
        // Decode: every chunk count a sequence passes through, in the slot bucket that holds a
        // wave of the step's samples; a step's runs are counted for the worst case (longest
        // prompts, every response at max_response_length). The other buckets are listed at
        // the largest chunk count, for their bytes (the tail of a step, when few samples are
        // still generating, runs them).
        let samples = groups * n;
        let waves = samples.div_ceil(slots) as f64;
        let step_rows = programs.slot_bucket(samples.clamp(1, slots).div_ceil(cache.slot_groups()));
        let mut runs: BTreeMap<usize, f64> = BTreeMap::new();
        for j in 0..recipe.data.max_response_length {
            *runs
                .entry(programs.decode_chunks(prompt.saturating_sub(1) + j))
                .or_default() += waves;
        }
        let counts = programs.decode_chunk_counts(0);
        let most = counts.last().copied().unwrap_or(1);
        for &chunks in &counts {
            for &rows in programs.slot_buckets() {
                if rows != step_rows && chunks != most {
                    continue;
                }
                let key = DecodeKey {
                    truncate: truncating,
                    chunks,
                    rows,
                };
                let program =
                    DecodeSample::build_step(config, weights, cache, key, settings.sampler).map_err(err)?;
                let label = program.name().to_string();
                let attended = (chunks * cache.chunk).min(cache.max_len);
                let run_slots = rows * cache.slot_groups();
                let (runs, bucket) = if rows == step_rows {
                    (runs.get(&chunks).copied().unwrap_or(0.0), String::new())
                } else {
                    (0.0, " (slot bucket for a step's tail)".to_string())
                };
                plan.add(
                    Role::Rollout,
                    label,
                    program,
                    runs,
                    format!("{what} decode: {run_slots} of {slots} slots reading <= {attended} cached positions{bucket}"),
                );
            }
        }
    }
    if r.multi_turn.enable {
        // One extend run per continued turn, of the bucket that holds the environment's
        // tokens; how many and how long is the environment's to say, so none is counted.
        for len in programs.extend_buckets(recipe.data.max_response_length) {
            let program = EnvExtend::build(config, weights, cache, len).map_err(err)?;
            let label = program.name().to_string();
            plan.add(
                Role::Rollout,
                label,
                program,
                0.0,
                format!("multi-turn: writes up to {len} environment tokens into a sample's slot"),
            );
        }
    }
    if programs.slot_buckets().len() > 1 {
        let program = SlotMoves::build(cache, MOVES_PER_RUN).map_err(err)?;
        let label = program.name().to_string();
        plan.add(
            Role::Rollout,
            label,
            program,
            0.0,
            format!("moves up to {MOVES_PER_RUN} live samples per slot group into a smaller slot bucket"),
        );
    }
    Ok(())
}

/// A scanned learner program's labels and the same program traced one layer at a time
/// (rematerialised, as the scan's backward pass recomputes) for a 1-layer and a 2-layer model:
/// their difference is one layer's cost.
pub(super) struct LayerProbe {
    pub(super) labels: Vec<String>,
    pub(super) one: Program,
    pub(super) two: Program,
    /// The model's layers: the loop runs this many times, its body is counted once.
    pub(super) layers: usize,
}

/// The learner's programs and their runs per step (see `actors::roles::learner`).
pub(super) fn plan_learner(
    plan: &mut Plan,
    recipe: &Recipe,
    config: &ModelConfig,
    plugin: PluginKind,
) -> Result<(), CompileError> {
    // As the learner builds it on the target's plugin (`BucketedLearner::from_state`).
    let policy = policy(recipe, config).for_plugin(plugin);
    let batches = batch_plan(recipe);
    let total_steps = recipe.trainer.total_training_steps.unwrap_or(1).max(1) as u64;
    let update = update_config(recipe, &policy, batches.total_optimizer_steps(total_steps));
    let specs = policy.param_specs();
    let build_with =
        |step: &trainer::step::StepConfig, specs: &[model::ParamSpec], policy: &DecoderPolicy| {
            let p = policy.clone();
            build_train_programs(step, specs, &policy.input_specs(), move |params, batch| {
                p.forward(params, batch)
            })
            .map_err(|e| CompileError::Build {
                role: "learner",
                message: e.to_string(),
            })
        };
    let build = |policy: &DecoderPolicy| build_with(&update.step, &specs, policy);
    let programs = build(&policy)?;
    let micro = batches.micro_batch_size.max(1);
    let epochs = batches.epochs.max(1) as f64;
    let mini_batches = batches.mini_batches_per_step() as f64;
    let micro_per_mini = batches.micro_batches_per_mini_batch();
    let accumulating = micro_per_mini > 1;
    if policy.remat || policy.scan {
        let plain = build(&DecoderPolicy {
            remat: false,
            scan: false,
            ..policy.clone()
        })?;
        plan.plain_layers = Some(if accumulating {
            ("accumulate".to_string(), plain.accumulate)
        } else {
            ("train_step".to_string(), plain.train_step)
        });
    }
    if policy.scan {
        let mut probes = Vec::new();
        for layers in [1, 2] {
            let mut shallow = DecoderPolicy {
                remat: true,
                scan: false,
                ..policy.clone()
            };
            shallow.config.num_hidden_layers = layers;
            let step = update_config(recipe, &shallow, 1).step;
            probes.push(build_with(&step, &shallow.param_specs(), &shallow)?);
        }
        let two = probes.pop().expect("two probes");
        let one = probes.pop().expect("two probes");
        let layers = policy.config.num_hidden_layers;
        let gradient = if accumulating { "accumulate" } else { "train_step" };
        plan.layer_probes.push(LayerProbe {
            labels: vec![gradient.to_string()],
            one: if accumulating {
                one.accumulate
            } else {
                one.train_step
            },
            two: if accumulating {
                two.accumulate
            } else {
                two.train_step
            },
            layers,
        });
        plan.layer_probes.push(LayerProbe {
            labels: vec!["log_probs".to_string(), "log_probs (reference)".to_string()],
            one: one.log_probs,
            two: two.log_probs,
            layers,
        });
    }
    let micro_batches = batches.micro_batches_per_step() as f64;
    plan.trained_tokens_per_step = mini_batches
        * micro_per_mini as f64
        * epochs
        * (policy.prompt_slots() * policy.prompt_len + micro * policy.response_len) as f64;
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
    let reference = update.needs_reference();
    if !update.use_rollout_log_probs {
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
    if let Some(critic) = &update.critic {
        let model = critic_model(recipe, config)?;
        let programs = build_with(&critic.step, &model.param_specs(), &model)?;
        let b = &critic.batches;
        let (mini_batches, epochs) = (b.mini_batches_per_step() as f64, b.epochs.max(1) as f64);
        let micro_per_mini = b.micro_batches_per_mini_batch();
        let purpose_mb = format!(
            "{} responses of {} tokens after {} prompts of {}",
            model.micro_batch_size,
            model.response_len,
            model.prompt_slots(),
            model.prompt_len
        );
        if micro_per_mini > 1 {
            plan.add(
                Role::Learner,
                "critic accumulate".into(),
                programs.accumulate,
                mini_batches * micro_per_mini as f64 * epochs,
                format!("PPO's critic: forward and backward of one micro-batch ({purpose_mb})"),
            );
            plan.add(
                Role::Learner,
                "critic apply".into(),
                programs.apply,
                mini_batches * epochs,
                "PPO's critic: clip and AdamW, once per mini-batch".into(),
            );
        } else {
            plan.add(
                Role::Learner,
                "critic train_step".into(),
                programs.train_step,
                mini_batches * epochs,
                format!("PPO's critic: forward, backward and AdamW on one micro-batch ({purpose_mb})"),
            );
        }
        plan.add(
            Role::Learner,
            "critic values".into(),
            programs.log_probs,
            b.micro_batches_per_step() as f64,
            format!("PPO's critic's values of the batch ({purpose_mb})"),
        );
    }
    Ok(())
}

/// PPO's critic's value model, over `critic.model.path`'s configuration when it names another
/// model.
fn critic_model(recipe: &Recipe, config: &ModelConfig) -> Result<DecoderPolicy, CompileError> {
    let critic_config = actors::setup::critic_model_config(recipe, config)
        .map_err(|message| CompileError::Build {
            role: "learner",
            message,
        })?
        .unwrap_or_else(|| config.clone());
    Ok(actors::setup::critic(recipe, &critic_config))
}

/// Bytes one learner device holds of the f32 master weights (what it trains), of the frozen
/// tensors (with LoRA the base, in the compute type) and of PPO's critic's f32 master weights:
/// each tensor whole, or its share where the learner's mesh splits it (`fsdp`, tensor
/// parallelism).
pub(super) fn learner_bytes_per_device(
    recipe: &Recipe,
    config: &ModelConfig,
) -> Result<(u64, u64, u64), CompileError> {
    let a = &recipe.actor;
    let mesh =
        trainer::sharding::LearnerMesh::new(&a.parallelism(&recipe.cluster), a.ppo_micro_batch_size as i64)
            .map_err(|e| CompileError::Build {
            role: "learner",
            message: e.to_string(),
        })?;
    let m = mesh.mesh();
    let local = |specs: &[model::ParamSpec], element: u64| -> u64 {
        specs
            .iter()
            .map(|spec| {
                let dims = spec.dims();
                let n: i64 = match (mesh.param_sharding(spec), &m) {
                    (Some(s), Some(m)) => s.local_dims(&dims, m).iter().product(),
                    _ => dims.iter().product(),
                };
                element * n as u64
            })
            .sum()
    };
    let p = policy(recipe, config);
    let compute = if a.param_dtype == DTypeName::Bf16 { 2 } else { 4 };
    let critic = match recipe.algorithm.adv_estimator.needs_critic() {
        true => local(&critic_model(recipe, config)?.param_specs(), 4),
        false => 0,
    };
    Ok((
        local(&p.param_specs(), 4),
        local(&p.frozen_specs(), compute),
        critic,
    ))
}

/// The model's architecture, from `--model-config`, `model.path`, or the configs folder beside
/// the recipe.
pub(super) fn model_config(
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
