//! Whether the run fits and what to change when it does not: per-program and per-device
//! memory budgets turned into advice that names recipe keys (the rollout's tensor-parallel
//! size among them). What one device holds over the run is counted here: with LoRA the
//! adapters' masters and AdamW state, the frozen base in the compute type, and the rollout's
//! merged copy, or in the applied form only its f32 adapters beside the shared base.

#[allow(unused_imports)]
use super::*;
use actors::recipe::LoraFormName;

/// Bytes of the learner's state: f32 master parameters, both AdamW moments, the gradient sums
/// when micro-batches accumulate, and the compute-dtype copy for bf16, of what it trains; with
/// LoRA also the frozen base in the compute type.
pub(super) fn learner_state_bytes(
    recipe: &Recipe,
    config: &ModelConfig,
    num_parameters: u64,
    accumulating: bool,
) -> u64 {
    let f32_copies = 3 + u64::from(accumulating);
    let bf16 = recipe.actor.param_dtype == DTypeName::Bf16;
    let (trained, frozen) = learner_parameters(recipe, config, num_parameters);
    trained * (4 * f32_copies + if bf16 { 2 } else { 0 }) + frozen * if bf16 { 2 } else { 4 }
}

/// Parameters the learner trains and those it holds frozen, for a model of `model`
/// parameters: with LoRA the adapters and the whole model, else the model and none.
pub(super) fn learner_parameters(recipe: &Recipe, config: &ModelConfig, model: u64) -> (u64, u64) {
    match recipe.actor.lora() {
        Some(lora) => {
            let adapters = model::lora::lora_param_table(config, &lora)
                .iter()
                .map(|s| s.numel() as u64)
                .sum();
            (adapters, model)
        }
        None => (model, 0),
    }
}

/// The device set the advice is for: memory per device, devices, TPU generation.
pub(super) struct Budget {
    pub(super) memory_per_device: u64,
    pub(super) devices: usize,
    pub(super) generation: Option<String>,
}

impl Budget {
    pub(super) fn of(target: &Target) -> Option<Budget> {
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
pub(super) fn advice(
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
        let state = learner_state_bytes(recipe, &plan.config, num_parameters, accumulating);
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
                "the learner's state (f32 parameters, AdamW moments{}{}{}) is {}{}, more than the {} a device has \
                 room for beside activations: set `actor.strategy: fsdp` and `actor.mesh: {mesh}` to shard it",
                if accumulating { ", gradient sums" } else { "" },
                if recipe.actor.param_dtype == DTypeName::Bf16 { ", bf16 copy" } else { "" },
                if recipe.actor.lora_rank > 0 { ", the frozen base" } else { "" },
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
            if recipe.actor.lora_rank == 0 {
                text.push_str(
                    "; or train LoRA adapters (`actor.lora_rank: 32`): the base then stays frozen in \
                     `actor.param_dtype` with no f32 masters, gradients or AdamW moments",
                );
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
        let (devices, slots) = (plan.rollout.cache.devices, plan.rollout.cache.local_slots());
        let cache = plan.rollout.cache.bytes_per_device() as u64;
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
        // A larger tensor-parallel split shrinks the weights on each device (the KV cache a
        // device holds stays: fewer slot groups, each slot split over more devices).
        let now = recipe.rollout.tensor_model_parallel_size.max(1);
        let share_now = rollout_weight_share(&plan.config, now);
        let split = (now + 1..=devices)
            .filter(|&tp| devices.is_multiple_of(tp))
            .filter(|&tp| recipe.rollout.max_num_seqs.is_multiple_of(devices / tp))
            .find(|&tp| {
                let weights = m.param_bytes as f64 * rollout_weight_share(&plan.config, tp) / share_now;
                other as f64 - m.param_bytes as f64 + weights + cache as f64 <= head_room as f64
            });
        if let Some(tp) = split {
            let _ = write!(
                text,
                "set `rollout.tensor_model_parallel_size: {tp}` (now {now}: the weights split over {tp} devices), or "
            );
        }
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

/// One device over a whole run when the learner and the rollout engine share the learner's
/// devices (`cluster.rollout_workers: 0`): the buffers that stay (the learner's parameters and
/// optimizer state, the KV cache, the rollout's own weights when it cannot use the learner's)
/// plus the largest temporaries (activations) of any one program. Every device of the mesh
/// holds the same share.
#[derive(Clone, Debug)]
pub(super) struct DeviceTotal {
    /// f32 master parameters and, for a bf16 learner, their bf16 copy.
    pub(super) learner_params: u64,
    /// AdamW's two moments and the gradient sums when micro-batches accumulate.
    pub(super) optimizer: u64,
    /// The frozen tensors (with LoRA the base model, in the compute type).
    pub(super) frozen: u64,
    /// PPO's critic's parameters and optimizer state, as the learner's.
    pub(super) critic: u64,
    pub(super) kv_cache: u64,
    pub(super) rollout_weights: u64,
    pub(super) largest: String,
    pub(super) largest_temporaries: u64,
    pub(super) total: u64,
    pub(super) memory: u64,
}

impl DeviceTotal {
    pub(super) fn fits(&self) -> bool {
        self.total <= self.memory
    }

    pub(super) fn learner_state(&self) -> u64 {
        self.learner_params + self.optimizer + self.frozen + self.critic
    }

    pub(super) fn describe(&self) -> String {
        format!(
            "each device over the run (learner and rollout share it): parameters {} + optimizer state {}{}{} + KV \
             cache {}{} + the largest temporaries ({}, {}) = {} of {}: {}",
            bytes(self.learner_params),
            bytes(self.optimizer),
            if self.frozen > 0 {
                format!(" + frozen base {}", bytes(self.frozen))
            } else {
                String::new()
            },
            if self.critic > 0 {
                format!(" + critic and its optimizer state {}", bytes(self.critic))
            } else {
                String::new()
            },
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

pub(super) fn device_total(
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
    // What one device holds (a shard under FSDP): from a compiled learner program, else from
    // the learner's layout.
    // The policy's programs (the critic's hold the critic's parameters).
    let learner_max = |of: fn(&Measured) -> u64, layout: u64| {
        measured
            .iter()
            .filter(|(r, _)| r.role == Role::Learner && !r.label.starts_with("critic"))
            .map(|(_, m)| of(m))
            .max()
            .unwrap_or(layout)
    };
    let masters = learner_max(|m| m.param_bytes, plan.master_bytes_per_device);
    let bf16 = recipe.actor.param_dtype == DTypeName::Bf16;
    let learner_params = masters + if bf16 { masters / 2 } else { 0 };
    let optimizer = masters * (2 + u64::from(accumulating));
    let frozen = learner_max(|m| m.frozen_bytes, plan.frozen_bytes_per_device);
    let critic_masters = plan.critic_bytes_per_device;
    let critic = critic_masters * (3 + u64::from(accumulating)) + if bf16 { critic_masters / 2 } else { 0 };
    let rollout_weights = rollout_resident_bytes(recipe, &plan.config, num_parameters);
    let (largest, largest_temporaries) = measured
        .iter()
        .map(|(r, m)| (r.label.clone(), m.peak_bytes.saturating_sub(m.argument_bytes)))
        .max_by_key(|(_, t)| *t)?;
    let kv_cache = plan.rollout.cache.bytes_per_device() as u64;
    Some(DeviceTotal {
        learner_params,
        optimizer,
        frozen,
        critic,
        kv_cache,
        rollout_weights,
        largest,
        largest_temporaries,
        total: learner_params
            + optimizer
            + frozen
            + critic
            + kv_cache
            + rollout_weights
            + largest_temporaries,
        memory,
    })
}

/// Whether the in-process rollout decodes from the learner's own compute-dtype buffers (the
/// handoff uses them in place): same element type, the same layout on the devices (replicas or
/// tensor-parallel splits, not FSDP shards), and either a full fine-tune with no off-policy
/// copy or LoRA in the applied form (the engine holds the learner's frozen base, which no
/// update changes; only the adapters beside it are handed over, or copied off-policy). LoRA
/// in the merged form decodes from the merged weights, a copy.
pub(super) fn rollout_shares_learner_buffers(recipe: &Recipe) -> bool {
    let parallel = recipe.actor.parallelism(&recipe.cluster);
    let fsdp = parallel.strategy == Strategy::Fsdp && parallel.mesh.unwrap_or(1) > 1;
    let shared = match actors::setup::lora_form(recipe) {
        None => recipe.trainer.off_policy_steps == 0,
        Some((model::LoraForm::Applied, _)) => true,
        Some((model::LoraForm::Merged, _)) => false,
    };
    recipe.rollout.dtype == recipe.actor.param_dtype
        && shared
        && !fsdp
        && parallel.tensor_parallel.max(1) == recipe.rollout.tensor_model_parallel_size.max(1)
}

/// Bytes an in-process rollout holds on one device beside the learner: its weights unless it
/// shares the learner's buffers, and any LoRA adapters it applies.
fn rollout_resident_bytes(recipe: &Recipe, config: &ModelConfig, num_parameters: u64) -> u64 {
    let tp = recipe.rollout.tensor_model_parallel_size;
    let weights = if rollout_shares_learner_buffers(recipe) {
        0
    } else {
        rollout_weight_bytes(recipe, config, num_parameters, tp)
    };
    weights + rollout_adapter_bytes(recipe, config, tp)
}

/// Bytes of the LoRA adapters an in-process rollout applies beside its weights on one device
/// (f32, split with their base over the rollout's `tp` devices); 0 in the merged form.
pub(super) fn rollout_adapter_bytes(recipe: &Recipe, config: &ModelConfig, tp: usize) -> u64 {
    let Some(lora) = recipe.actor.lora().filter(|_| {
        matches!(
            actors::setup::lora_form(recipe),
            Some((model::LoraForm::Applied, _))
        )
    }) else {
        return 0;
    };
    let tp = tp.max(1);
    model::lora::lora_param_table(config, &lora)
        .iter()
        .map(|p| match p.tensor_parallel_dim(tp) {
            Some(_) => p.numel() / tp,
            None => p.numel(),
        } as u64 * 4)
        .sum()
}

/// Bytes of the rollout's weights on one device: the model in `rollout.dtype`, times the share
/// of its elements one device holds when the rollout splits it over `tp` devices.
pub(super) fn rollout_weight_bytes(
    recipe: &Recipe,
    config: &ModelConfig,
    num_parameters: u64,
    tp: usize,
) -> u64 {
    let element = if recipe.rollout.dtype == DTypeName::Bf16 {
        2
    } else {
        4
    };
    (num_parameters as f64 * element as f64 * rollout_weight_share(config, tp.max(1))) as u64
}

/// The share of a model's elements one device holds when the rollout splits it over `tp`
/// devices in the Megatron layout (parts whose heads do not divide stay whole).
pub(super) fn rollout_weight_share(config: &ModelConfig, tp: usize) -> f64 {
    let table = model::param_table(config);
    let total: usize = table.iter().map(|p| p.numel()).sum();
    let local: usize = table
        .iter()
        .map(|p| match p.tensor_parallel_dim(tp) {
            Some(_) => p.numel() / tp,
            None => p.numel(),
        })
        .sum();
    local as f64 / total.max(1) as f64
}

/// The smallest rollout tensor-parallel size, of those the recipe's layout allows, with which
/// one device's total fits: the rollout's weights shrink by the split; the KV cache a device
/// holds does not change (fewer slot groups, each holding more slots, each slot split over
/// the model axis), nor does the learner's state.
pub(super) fn fitting_rollout_tensor_parallel(
    recipe: &Recipe,
    config: &ModelConfig,
    num_parameters: u64,
    total: &DeviceTotal,
) -> Option<usize> {
    let devices = recipe.rollout_devices();
    let now = recipe.rollout.tensor_model_parallel_size.max(1);
    let others = total.total - total.rollout_weights;
    let learner_tp = recipe.actor.tensor_model_parallel_size.max(1);
    (1..=devices)
        .filter(|&tp| {
            tp > now
                && devices.is_multiple_of(tp)
                && (tp.is_multiple_of(learner_tp) || learner_tp.is_multiple_of(tp))
        })
        .filter(|&tp| recipe.rollout.max_num_seqs.is_multiple_of(devices / tp))
        .find(|&tp| {
            let weights = rollout_weight_bytes(recipe, config, num_parameters, tp);
            others + weights <= (total.memory as f64 * 0.95) as u64
        })
}

/// Advice when the programs fit one by one but not together on the shared device.
pub(super) fn device_total_advice(
    recipe: &Recipe,
    config: &ModelConfig,
    num_parameters: u64,
    total: &DeviceTotal,
) -> String {
    let tensor_parallel = fitting_rollout_tensor_parallel(recipe, config, num_parameters, total);
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
    if recipe.actor.lora_rank > 0 {
        let mut applied = recipe.clone();
        applied.actor.lora_form = LoraFormName::Applied;
        let held = rollout_resident_bytes(&applied, config, num_parameters);
        if held < total.rollout_weights && total.total - total.rollout_weights + held <= room {
            let _ = write!(
                text,
                "set `actor.lora_form: applied` (the rollout then applies the adapters beside the learner's \
                 frozen base: {} a device instead of {} for a merged copy), or ",
                bytes(held),
                bytes(total.rollout_weights)
            );
        }
    }
    if let Some(tp) = tensor_parallel {
        let _ = write!(
            text,
            "set `rollout.tensor_model_parallel_size: {tp}` (now {}; the rollout's weights {} a device instead of \
             {}), or ",
            recipe.rollout.tensor_model_parallel_size,
            bytes(rollout_weight_bytes(recipe, config, num_parameters, tp)),
            bytes(total.rollout_weights)
        );
    }
    let _ = write!(
        text,
        "lower `rollout.max_num_seqs` (the KV cache, now {} slots), or set `actor.strategy: fsdp`, or run the \
         rollout in worker processes on other devices (`cluster.rollout_workers`)",
        recipe.rollout.max_num_seqs
    );
    text
}
