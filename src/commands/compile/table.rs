//! The printed table: one row per program with its memory, fit, cost and roofline time, and
//! the step-time estimate; the collectives per step and the learner's MFU estimate; `--explain`'s
//! operations by bytes moved.

#[allow(unused_imports)]
use super::*;

/// `1.23 GiB`, `456.0 MiB`, `12.0 KiB`.
pub(super) fn bytes(n: u64) -> String {
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

pub(super) fn seconds_text(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}

/// Seconds of one training step by role, when every program has an estimate.
pub(super) fn step_estimate(measured: &[(PlannedRow, Measured)]) -> Option<(f64, f64)> {
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

pub(super) fn table(target: &Target, measured: &[(PlannedRow, Measured)]) -> String {
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

pub(super) fn selected(row: &PlannedRow, only: &[regex::Regex], step_only: bool) -> bool {
    (!step_only || row.runs_per_step > 0.0)
        && (only.is_empty() || only.iter().any(|o| o.is_match(&row.label)))
}

/// Collectives a training step runs on each device, by role and kind: each program's count and
/// result bytes times its runs per step.
pub(super) fn step_collectives(
    measured: &[(PlannedRow, Measured)],
) -> BTreeMap<(Role, &'static str), CollectiveCount> {
    let mut out: BTreeMap<(Role, &'static str), CollectiveCount> = BTreeMap::new();
    for (row, m) in measured {
        for (kind, c) in &m.collectives {
            let e = out.entry((row.role, kind)).or_default();
            e.count += (c.count as f64 * row.runs_per_step).round() as u64;
            e.bytes += (c.bytes as f64 * row.runs_per_step).round() as u64;
        }
    }
    out
}

pub(super) fn collectives_text(collectives: &BTreeMap<(Role, &'static str), CollectiveCount>) -> String {
    let mut text =
        String::from("collectives per step on each device (from the optimized HLO; result bytes):");
    for role in [Role::Rollout, Role::Learner] {
        let parts: Vec<String> = collectives
            .iter()
            .filter(|((r, _), _)| *r == role)
            .map(|((_, kind), c)| format!("{kind} {} ({})", c.count, bytes(c.bytes)))
            .collect();
        if !parts.is_empty() {
            let _ = write!(text, " {}: {};", role.name(), parts.join(", "));
        }
    }
    text.pop();
    text
}

/// Chips the learner's programs run on.
pub(super) fn learner_chips(target: &Target, plan: &Plan, measured: &[(PlannedRow, Measured)]) -> usize {
    let partitions = measured
        .iter()
        .filter(|(r, _)| r.role == Role::Learner)
        .map(|(r, _)| plan.programs[r.program].num_partitions())
        .max()
        .unwrap_or(1);
    partitions.div_ceil(target.devices_per_chip().max(1))
}

/// The learner's model-FLOPs utilisation, an estimate from the cost model: 6 x parameters x
/// tokens trained per step / (the learner's roofline seconds per step x chips x peak bf16
/// FLOP/s per chip). `None` off TPU (no published peak) or without learner time.
pub(super) fn learner_mfu(
    target: &Target,
    plan: &Plan,
    measured: &[(PlannedRow, Measured)],
    parameters: usize,
    learner_seconds: f64,
) -> Option<f64> {
    let Target::Tpu {
        generation: Some(g), ..
    } = target
    else {
        return None;
    };
    if learner_seconds <= 0.0 {
        return None;
    }
    let chips = learner_chips(target, plan, measured) as f64;
    Some(
        6.0 * parameters as f64 * plan.trained_tokens_per_step
            / (learner_seconds * chips * g.peak_bf16_flops_per_chip),
    )
}

/// `--explain`'s printout for program `name`: its operations by bytes moved, the largest first
/// (at most 25, the rest summed), each with its share of all the bytes, its flops and its
/// arithmetic intensity (flops per byte: below the chip's ridge point an operation is bound by
/// memory). The products' flops are counted from their shapes as compiled (padding included),
/// beside the cost analysis's total `cost_flops`, which counts them its own way.
pub(super) fn explain_text(name: &str, ops: &[OpCost], cost_flops: Option<f64>) -> String {
    let total_bytes: u64 = ops.iter().map(|o| o.bytes).sum();
    let total_flops: u64 = ops.iter().map(|o| o.flops).sum();
    let mut out = format!(
        "where the bytes go in {name} (from the optimized program; per device and run; an \
         operation inside a loop is counted once, marked *): {} operations, {} moved, {:.1} GFLOP \
         in products{}\n",
        ops.len(),
        bytes(total_bytes),
        total_flops as f64 / 1e9,
        cost_flops
            .map(|f| format!(" (the cost analysis: {:.1} GFLOP in all)", f / 1e9))
            .unwrap_or_default()
    );
    // By kind first: a fusion by the operation that leads it, anything else by its opcode.
    let mut kinds: BTreeMap<String, (u64, u64, usize)> = BTreeMap::new();
    for o in ops {
        let kind = match o.what.split_once(": ") {
            Some((head, inner)) if head.starts_with("fusion") => {
                format!("fusion: {}", inner.split(", ").next().unwrap_or_default())
            }
            Some((head, _)) => head.to_string(),
            None => o.what.clone(),
        };
        let k = kinds.entry(kind).or_default();
        k.0 += o.bytes;
        k.1 += o.flops;
        k.2 += 1;
    }
    let mut kinds: Vec<(String, (u64, u64, usize))> = kinds.into_iter().collect();
    kinds.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(&b.0)));
    out.push_str(&format!(
        "  by kind:\n  {:>6}  {:>10}  {:>9}  {:>6}  {}\n",
        "share", "bytes", "GFLOP", "count", "kind"
    ));
    for (kind, (b, f, n)) in kinds.iter().take(12) {
        out.push_str(&format!(
            "  {:>5.1}%  {:>10}  {:>9.2}  {:>6}  {kind}\n",
            100.0 * *b as f64 / total_bytes.max(1) as f64,
            bytes(*b),
            *f as f64 / 1e9,
            n
        ));
    }
    out.push_str("  the largest operations:\n");
    let mut sorted: Vec<&OpCost> = ops.iter().collect();
    sorted.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.name.cmp(&b.name)));
    let share = |b: u64| 100.0 * b as f64 / total_bytes.max(1) as f64;
    out.push_str(&format!(
        "  {:>6}  {:>10}  {:>9}  {:>8}  {:<32}  {:<24}  {}\n",
        "share", "bytes", "GFLOP", "flop/B", "operation", "shape", "what"
    ));
    for o in sorted.iter().take(25) {
        out.push_str(&format!(
            "  {:>5.1}%  {:>10}  {:>9.2}  {:>8.1}  {:<32}  {:<24}  {}\n",
            share(o.bytes),
            bytes(o.bytes),
            o.flops as f64 / 1e9,
            o.flops as f64 / o.bytes.max(1) as f64,
            format!("{}{}", o.name, if o.in_loop { "*" } else { "" }),
            o.shape,
            o.what
        ));
    }
    if sorted.len() > 25 {
        let rest: u64 = sorted[25..].iter().map(|o| o.bytes).sum();
        out.push_str(&format!(
            "  {:>5.1}%  {:>10}  the other {} operations\n",
            share(rest),
            bytes(rest),
            sorted.len() - 25
        ));
    }
    out
}
