//! `grpo compile` end to end: the TPU recipe's programs compiled deviceless by libtpu for
//! v6e:2x2, v5e:2x2, v5p:2x2x1 and tpu7x:2x2x1 (from the architecture in
//! recipes/configs/Qwen2.5-0.5B-Instruct/config.json, no weights), a deliberately oversized 7B
//! recipe reported as not fitting with advice, and the CPU plugin.
//!
//! A full table compiles 31 programs (over 20 minutes on this shared 2-core machine: the
//! learner's `train_step` and `accumulate` take several minutes each, the batched fan-out
//! prefill of the 512 bucket over 2), so CI compiles one program per topology: the learner's
//! largest (`accumulate`) on v6e:2x2, the decode step at the full cache on v5e:2x2, v5p:2x2x1 and
//! tpu7x:2x2x1, the Llama-3.1-8B recipe's tensor-parallel decode step on 8 devices of each chip
//! kind, and the oversized recipe's `accumulate` (refused quickly). BENCHMARKS.md records
//! the full tables. On the CPU plugin: the quickstart's `apply`, and its `train_step`
//! rematerialised and scanned, each beside one trace per layer keeping every activation.
//!
//! libtpu must be installed (scripts/setup.sh does it); set GRPO_SKIP_TPU_TESTS=1 to skip the
//! TPU tests explicitly.

use std::process::{Command, Output};

const TPU_RECIPE: &str = "recipes/gsm8k-qwen2.5-0.5b-tpu-v6e.yaml";

fn grpo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("grpo runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// False (with a note) when GRPO_SKIP_TPU_TESTS=1; panics with the install command when libtpu
/// is missing.
fn libtpu(test: &str) -> bool {
    if std::env::var("GRPO_SKIP_TPU_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("SKIPPED {test}: GRPO_SKIP_TPU_TESTS=1");
        return false;
    }
    if let Err(e) = xla::runtime::tpu::load_libtpu(None) {
        panic!("{test} needs libtpu: {e}\n(run scripts/setup.sh or `pip install libtpu`, or set GRPO_SKIP_TPU_TESTS=1)");
    }
    true
}

/// The rows of the table on stdout, as (program, cells).
fn table_rows(stdout: &str) -> Vec<(String, Vec<String>)> {
    let lines: Vec<&str> = stdout.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.starts_with("program "))
        .unwrap_or_else(|| panic!("no table header in:\n{stdout}"));
    lines[start + 2..]
        .iter()
        .take_while(|l| l.contains(" learner ") || l.contains(" rollout "))
        .map(|l| {
            // The program name may contain a space ("log_probs (reference)"); the role follows.
            let at = l.find(" learner ").or_else(|| l.find(" rollout ")).unwrap();
            let cells = l[at..].split("  ").map(str::trim).filter(|c| !c.is_empty());
            (l[..at].trim().to_string(), cells.map(String::from).collect())
        })
        .collect()
}

fn gib(cell: &str) -> f64 {
    let (n, unit) = cell.split_once(' ').unwrap_or_else(|| panic!("size {cell}"));
    let n: f64 = n.parse().unwrap();
    n * match unit {
        "GiB" => 1.0,
        "MiB" => 1.0 / 1024.0,
        "KiB" => 1.0 / (1024.0 * 1024.0),
        _ => 0.0,
    }
}

#[test]
fn help_teaches_the_topologies_and_what_it_reads() {
    let o = grpo(&["compile", "--help"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let help = text(&o.stdout);
    for needle in [
        "grpo compile recipes/gsm8k-qwen2.5-0.5b-tpu-v6e.yaml --topology v6e:2x2",
        "v5e:2x2",
        "v5p:2x2x1",
        "tpu7x:2x2x1",
        "config.json",
        "--device",
        "deviceless",
        "actor.ppo_micro_batch_size",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
    // One of --topology / --device is needed.
    let o = grpo(&["compile", TPU_RECIPE]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("--topology"), "{}", text(&o.stderr));
}

#[test]
fn a_missing_architecture_names_what_to_give() {
    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("r.yaml");
    std::fs::write(
        &recipe,
        "model:\n  path: models/NoSuchModel\ndata:\n  train_files: t.parquet\n",
    )
    .unwrap();
    let o = grpo(&["compile", recipe.to_str().unwrap(), "--device", "cpu"]);
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o.stderr);
    assert!(
        err.contains("model.path models/NoSuchModel: no model architecture found")
            && err.contains("--model-config")
            && err.contains("configs/NoSuchModel/config.json"),
        "{err}"
    );
}

#[test]
fn the_learners_largest_program_fits_v6e_2x2() {
    if !libtpu("the_learners_largest_program_fits_v6e_2x2") {
        return;
    }
    // The recipe's micro-batch of 32 rows does not fit a v6e chip; 8 fits alone but not beside
    // the KV cache and the learner's state on the chip they share (BENCHMARKS.md); 4 does.
    let o = grpo(&[
        "compile",
        TPU_RECIPE,
        "--topology",
        "v6e:2x2",
        "--set",
        "actor.ppo_micro_batch_size=4",
        "--only",
        "accumulate",
        "--explain",
        "accumulate",
    ]);
    let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("TPU topology v6e:2x2 (TPU v6 lite, 4 chips, 4 devices, HBM 32.00 GiB per chip"),
        "{stdout}"
    );
    assert!(stderr.contains("494.0M parameters"), "{stderr}");
    assert!(
        stderr.contains("[1/1] compiling accumulate (1 device)"),
        "{stderr}"
    );
    let rows = table_rows(&stdout);
    assert_eq!(rows.len(), 1, "{stdout}");
    let (name, cells) = &rows[0];
    assert_eq!(name, "accumulate");
    // role, sharding, runs/step, params, arguments, temporaries, peak, memory, fits, GFLOP, time
    assert_eq!(cells.len(), 11, "{cells:?}");
    assert_eq!(&cells[..3], ["learner", "1 device", "128"], "{stdout}");
    // f32 masters of 494M parameters; the arguments add the f32 gradient sums.
    assert!((gib(&cells[3]) - 1.84).abs() < 0.01, "{stdout}");
    assert!((gib(&cells[4]) - 2.0 * gib(&cells[3])).abs() < 0.01, "{stdout}");
    let peak = gib(&cells[6]);
    assert!(peak > gib(&cells[4]) && peak < 32.0, "{stdout}");
    assert_eq!(&cells[7..9], ["32.00 GiB", "yes"], "{stdout}");
    // Forward and backward of 4 rows of 1024 tokens: about 6 x 4096 tokens x 358M non-embedding
    // parameters, plus the tied head over the 512 response positions and attention.
    let flops = cells[9].parse::<f64>().unwrap() * 1e9;
    assert!(flops > 0.75e13 && flops < 3e13, "accumulate flops {flops:e}");
    assert!(cells[10].ends_with(" ms"), "{cells:?}");
    // --explain: the operations of the optimized program; their products' flops, counted from
    // the compiled shapes (padding included), near the cost analysis's count.
    let explained = stdout
        .lines()
        .find(|l| l.starts_with("where the bytes go in accumulate"))
        .unwrap_or_else(|| panic!("no --explain printout: {stdout}"));
    let products: f64 = explained
        .split(" GFLOP in products")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{explained}"));
    assert!(
        products * 1e9 > 0.7 * flops && products * 1e9 < 2.0 * flops,
        "{products} GFLOP in products of {flops:e}: {explained}"
    );
    assert!(
        stdout.contains("  share       bytes      GFLOP    flop/B  operation"),
        "{stdout}"
    );
    // With the learner's state (f32 masters and bf16 copy 2.76 GiB; 2 moments and gradient
    // sums 5.52 GiB) and the KV cache (bf16 with the recipe's bf16 rollout: 3 GiB) resident on
    // the same chip.
    assert!(
        stdout.contains(
            "each device over the run (learner and rollout share it): parameters 2.76 GiB + optimizer state \
             5.52 GiB + KV cache 3.00 GiB"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("everything fits"), "{stdout}");
    assert!(stdout.contains("estimated step time: needs every program (drop --only)"));
}

#[test]
fn the_decode_step_fits_v5e_v5p_and_tpu7x_with_a_time_estimate() {
    if !libtpu("the_decode_step_fits_v5e_v5p_and_tpu7x_with_a_time_estimate") {
        return;
    }
    let mut seconds = Vec::new();
    for (topology, memory_gib, devices) in [
        ("v5e:2x2", 16.0, 4),
        ("v5p:2x2x1", 95.0, 4),
        ("tpu7x:2x2x1", 96.0, 8),
    ] {
        let o = grpo(&[
            "compile",
            TPU_RECIPE,
            "--topology",
            topology,
            "--only",
            "attend4$",
            "--json",
        ]);
        let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
        assert_eq!(o.status.code(), Some(0), "{topology}: {stdout}\n{stderr}");
        let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        assert!(
            report["target"]
                .as_str()
                .unwrap()
                .contains(&format!("{devices} devices")),
            "{report}"
        );
        let programs = report["programs"].as_array().unwrap();
        assert_eq!(programs.len(), 1, "{report}");
        let p = &programs[0];
        assert_eq!(p["program"], "rollout_decode_plain_cache256x4x256_attend4");
        assert_eq!(p["sharding"], "1 device");
        assert_eq!(p["fits"], true, "{topology}: {p}");
        let memory = p["memory_per_device"].as_f64().unwrap() / (1u64 << 30) as f64;
        assert_eq!(memory, memory_gib, "{topology}");
        // bf16 weights (0.92 GiB) and the bf16 KV cache of 256 slots x 1024 positions (3 GiB).
        let arguments = p["argument_bytes"].as_f64().unwrap() / (1u64 << 30) as f64;
        assert!(arguments > 3.9 && arguments < 4.1, "{topology}: {p}");
        let peak = p["peak_bytes"].as_f64().unwrap() / (1u64 << 30) as f64;
        assert!(peak >= arguments && peak < memory, "{topology}: {p}");
        // 256 tokens through 494M parameters, 2 flops a multiply-add, plus attention.
        let flops = p["flops"].as_f64().unwrap();
        assert!(flops > 1.5e11 && flops < 1e12, "{topology}: {p}");
        // Decode is memory bound: the estimate is the bytes over the HBM bandwidth.
        let (bytes, t) = (
            p["bytes_accessed"].as_f64().unwrap(),
            p["estimated_seconds"].as_f64().unwrap(),
        );
        assert!(t > 0.0 && t < 0.5, "{topology}: {p}");
        // The masked cache write: 29-36 GB by libtpu's count (a row scatter, which makes the
        // compiler relayout the cache around it, 46-54 GB).
        assert!(
            bytes < 40e9,
            "{topology}: the cache write moves more than the masked rewrite: {p}"
        );
        seconds.push((topology, t, bytes));
        assert_eq!(report["fits"], true);
        assert!(report["advice"].as_array().unwrap().is_empty());
    }
    // v5e (819 GB/s) is slower than v5p (2765 GB/s) on the same program.
    assert!(seconds[0].1 > seconds[1].1, "{seconds:?}");
}

/// The decode step of the smallest slot bucket (8 of 256 slots: the tail of a step) next to the
/// step over every slot: libtpu's cost model gives it a fraction of the flops and fewer bytes.
#[test]
fn slot_buckets_are_compiled_with_their_decode_bytes() {
    if !libtpu("slot_buckets_are_compiled_with_their_decode_bytes") {
        return;
    }
    let o = grpo(&[
        "compile",
        TPU_RECIPE,
        "--topology",
        "v6e:2x2",
        "--only",
        "attend4(_rows8)?$",
        "--only",
        "move_slots",
        "--json",
    ]);
    let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let programs = report["programs"].as_array().unwrap();
    let get = |name: &str| {
        programs
            .iter()
            .find(|p| p["program"] == name)
            .unwrap_or_else(|| panic!("no {name} in {report}"))
    };
    let (small, full) = (
        get("rollout_decode_plain_cache256x4x256_attend4_rows8"),
        get("rollout_decode_plain_cache256x4x256_attend4"),
    );
    assert!(
        small["purpose"].as_str().unwrap().contains("8 of 256 slots"),
        "{small}"
    );
    let number = |p: &serde_json::Value, key: &str| p[key].as_f64().unwrap();
    assert!(
        number(small, "flops") * 16.0 < number(full, "flops"),
        "{small}\n{full}"
    );
    // Both read the weights (0.92 GiB); the full step also reads every slot's attended cache
    // (libtpu counts 20.4 GB against 34.6 GB: the cost model charges the bucket's write-back
    // into the donated cache, BENCHMARKS.md "Slot buckets").
    assert!(
        number(small, "bytes_accessed") * 1.5 < number(full, "bytes_accessed"),
        "{small}\n{full}"
    );
    assert!(number(small, "estimated_seconds") < number(full, "estimated_seconds"));
    get("rollout_move_slots_8_cache256x4x256");
}

const LLAMA_8B_RECIPE: &str = "recipes/gsm8k-llama3.1-8b-tpu-v6e-8.yaml";

/// An 8B program on every chip kind: the Llama-3.1-8B recipe's decode step, 2 slot groups x 4
/// tensor-parallel devices, compiled for 8 devices of v6e, v5e, v5p and tpu7x (the 32 layers
/// unrolled compile in about 20 s each here). The partitioned program sums the row-parallel
/// projections with all-reduces, and the weights it takes are a quarter of the model's.
#[test]
fn an_8b_decode_step_compiles_tensor_parallel_on_every_chip_kind() {
    if !libtpu("an_8b_decode_step_compiles_tensor_parallel_on_every_chip_kind") {
        return;
    }
    for topology in ["v6e:2x4", "v5e:2x4", "v5p:2x2x2", "tpu7x:2x2x1"] {
        let o = grpo(&[
            "compile",
            LLAMA_8B_RECIPE,
            "--topology",
            topology,
            "--only",
            "rollout_decode_plain_cache128x768_spmd8_tp4$",
            "--json",
        ]);
        let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
        let report: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!(
                "{topology}: {e}
{stdout}
{stderr}"
            )
        });
        let p = &report["programs"][0];
        assert_eq!(
            p["program"], "rollout_decode_plain_cache128x768_spmd8_tp4",
            "{topology}: {p}"
        );
        assert_eq!(
            p["sharding"], "mesh slots=2,model=4 (8 partitions)",
            "{topology}: {p}"
        );
        assert_eq!(p["fits"], true, "{topology}: {p}");
        // 8.03B parameters in bf16 over 4 devices: about 3.7 GiB each (the 8 KV heads split too).
        let params = p["param_bytes"].as_f64().unwrap() / (1u64 << 30) as f64;
        assert!(params > 3.6 && params < 4.0, "{topology}: {p}");
        let collectives = report["collectives_per_step"].as_array().unwrap();
        let all_reduce = collectives
            .iter()
            .find(|c| c["kind"] == "all-reduce")
            .unwrap_or_else(|| panic!("{topology}: no all-reduce in {collectives:?}"));
        // At least the attention output and the MLP output of each of the 32 layers, per step.
        let runs = p["runs_per_step"].as_f64().unwrap();
        assert!(
            all_reduce["count"].as_f64().unwrap() >= 64.0 * runs,
            "{topology}: {all_reduce}"
        );
        assert!(
            report["layout"]
                .as_str()
                .unwrap()
                .contains("2 slot group(s) x model 4"),
            "{topology}: {report}"
        );
    }
    // v6e: the whole run fits each chip beside the learner's FSDP shard.
    let o = grpo(&[
        "compile",
        LLAMA_8B_RECIPE,
        "--topology",
        "v6e:2x4",
        "--only",
        "rollout_decode_plain_cache128x768_spmd8_tp4$",
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    // Without the rollout's tensor parallelism the whole bf16 model (15 GiB) beside the
    // learner's shard does not fit a v6e chip: the advice names the key and the size.
    let o = grpo(&[
        "compile",
        LLAMA_8B_RECIPE,
        "--topology",
        "v6e:2x4",
        "--only",
        "rollout_decode_plain_cache128x768_spmd",
        "--set",
        "rollout.tensor_model_parallel_size=1",
    ]);
    let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("rollout weights 14.96 GiB"), "{stdout}");
    assert!(
        stdout.contains("set `rollout.tensor_model_parallel_size: 2` (now 1"),
        "{stdout}"
    );
    assert!(
        stderr.contains("every program fits alone, not all together"),
        "{stderr}"
    );
}

#[test]
fn an_oversized_7b_recipe_does_not_fit_v5e_and_says_what_to_change() {
    if !libtpu("an_oversized_7b_recipe_does_not_fit_v5e_and_says_what_to_change") {
        return;
    }
    let o = grpo(&[
        "compile",
        "tests/fixtures/compile/oversized-qwen2.5-7b.yaml",
        "--topology",
        "v5e:2x2",
        "--only",
        "accumulate",
    ]);
    let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("7615.6M parameters"), "{stderr}");
    let rows = table_rows(&stdout);
    assert_eq!(rows.len(), 1, "{stdout}");
    assert_eq!(rows[0].1[8], "NO", "{stdout}");
    assert!(gib(&rows[0].1[6]) > 100.0, "{stdout}");
    assert!(stdout.contains("does not fit:"), "{stdout}");
    // 7.6B parameters: f32 masters, 2 moments, gradient sums, bf16 copy = 128 GiB.
    assert!(
        stdout.contains("set `actor.strategy: fsdp`") && stdout.contains("e.g. --topology v5e:"),
        "{stdout}"
    );
    assert!(
        stdout.contains("at `actor.ppo_micro_batch_size: 128`")
            && stdout.contains("set `actor.ppo_micro_batch_size: 64`"),
        "{stdout}"
    );
    assert!(stderr.contains("error: 1 of 1 programs do not fit"), "{stderr}");
}

#[test]
fn cpu_device_compiles_the_quickstart_optimizer_step_with_memory_stats() {
    let o = grpo(&[
        "compile",
        "recipes/quickstart.yaml",
        "--device",
        "cpu",
        "--only",
        "apply",
        "--json",
        // Two micro-batches per mini-batch, so the step accumulates and then applies.
        "--set",
        "actor.ppo_micro_batch_size=16",
    ]);
    let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert!(report["target"].as_str().unwrap().starts_with("cpu"), "{report}");
    let p = &report["programs"][0];
    assert_eq!(p["program"], "apply");
    // f32 parameters of SmolLM2-135M; the arguments add both AdamW moments and the gradient sums.
    let params = p["param_bytes"].as_u64().unwrap();
    assert!(params > 134_400_000 * 4 && params < 134_600_000 * 4, "{p}");
    assert!(p["argument_bytes"].as_u64().unwrap() >= 4 * params, "{p}");
    assert_eq!(p["fits"], true);
    // No published peak for a CPU: no time estimate.
    assert!(p["estimated_seconds"].is_null(), "{p}");
}

/// A multi-turn recipe lists the extend programs that write environment tokens into a
/// sample's slot, one per bucket up to the response budget, and each updates the cache in
/// place: its temporaries are a sliver of the cache, not a copy of it.
#[test]
fn a_multi_turn_recipe_compiles_its_extend_programs_in_place() {
    let o = grpo(&[
        "compile",
        "recipes/arithmetic-tools-smollm2.yaml",
        "--device",
        "cpu",
        "--only",
        "rollout_extend",
        "--json",
    ]);
    let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let programs = report["programs"].as_array().unwrap();
    let names: Vec<&str> = programs.iter().map(|p| p["program"].as_str().unwrap()).collect();
    // 96 response tokens: buckets 8 to 128.
    assert_eq!(
        names,
        [8, 16, 32, 64, 128].map(|n| format!("rollout_extend_{n}_cache32x1x416")),
        "{stdout}"
    );
    for p in programs {
        let params = p["param_bytes"].as_u64().unwrap();
        let cache = p["argument_bytes"].as_u64().unwrap() - params;
        let temporaries = p["temp_bytes"].as_u64().unwrap();
        // `dtype: auto` is bf16 or f32 by host CPU: the cache's element size is the weights'.
        let element = params.div_ceil(134_600_000);
        // 32 slots x 416 positions x 30 layers x (k, v) x 3 KV heads x 64 lanes.
        assert!(cache >= 32 * 416 * 30 * 2 * 3 * 64 * element, "{p}");
        assert!(temporaries < cache / 32, "the cache is copied: {p}");
    }
}

/// With `model.enable_gradient_checkpointing` or `model.scan_layers` the learner's gradient
/// program is also compiled one trace per layer keeping every activation, and the report says
/// what the recipe's way saves and costs, compile time included.
#[test]
fn remat_and_scanned_layers_are_compiled_beside_the_plain_program_and_save_temporaries() {
    let train_step = |set: &[&str]| {
        let mut args = vec![
            "compile",
            "recipes/quickstart.yaml",
            "--device",
            "cpu",
            "--only",
            "train_step",
            "--json",
        ];
        args.extend_from_slice(set);
        grpo(&args)
    };
    for key in ["model.enable_gradient_checkpointing", "model.scan_layers"] {
        let set = format!("{key}=true");
        let o = train_step(&["--set", &set]);
        let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
        assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
        assert!(
            stderr.contains("with one trace per layer, keeping every activation, for comparison"),
            "{stderr}"
        );
        let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let layers = &report["layers"];
        assert_eq!(layers["program"], "train_step", "{report}");
        assert_eq!(layers["keys"], serde_json::json!([key]), "{report}");
        assert_eq!(
            layers["temp_bytes"], report["programs"][0]["temp_bytes"],
            "{report}"
        );
        assert!(layers["compile_seconds"].as_f64().unwrap() > 0.0, "{report}");
        assert!(
            layers["compile_seconds_without"].as_f64().unwrap() > 0.0,
            "{report}"
        );
        let (with, without) = (
            layers["temp_bytes"].as_u64().unwrap(),
            layers["temp_bytes_without"].as_u64().unwrap(),
        );
        // SmolLM2-135M, 32 rows of 48 + 16 tokens: remat 1.5 GB, 2.4 GB kept (measured); a
        // scan keeps one layer's activations too.
        assert!(with * 5 < without * 4, "{key}: {report}");
    }
    // Without either key nothing is compiled twice.
    let o = train_step(&[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let report: serde_json::Value = serde_json::from_str(&text(&o.stdout)).unwrap();
    assert!(report["layers"].is_null(), "{report}");
}

#[test]
fn cuda_device_without_its_plugin_is_a_clear_error() {
    if xla::runtime::locate_plugin(xla::runtime::PluginKind::Cuda, None).is_ok() {
        eprintln!("SKIPPED cuda_device_without_its_plugin_is_a_clear_error: the CUDA plugin is installed");
        return;
    }
    let o = grpo(&["compile", "recipes/quickstart.yaml", "--device", "cuda"]);
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o.stderr);
    assert!(
        err.contains("--device cuda: the cuda PJRT plugin is not installed")
            && err.contains("pip install jax-cuda"),
        "{err}"
    );
}

/// A tiny Qwen3-MoE (8 experts, top 2) compiles for v6e:2x2 under FSDP x TP (data 2 x model 2)
/// with either dispatch; libtpu expands the grouped one's ragged dots into masked products over
/// every group, so its `accumulate` counts about k = 2 times the dense one's FLOPs (docs/moe.md).
#[test]
fn a_mixture_of_experts_compiles_with_either_dispatch() {
    if !libtpu("a_mixture_of_experts_compiles_with_either_dispatch") {
        return;
    }
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/model/fixtures/tiny/qwen3_moe/config.json"
    );
    let gflop = |dispatch: &str| {
        let o = grpo(&[
            "compile",
            TPU_RECIPE,
            "--model-config",
            config,
            "--topology",
            "v6e:2x2",
            "--only",
            "accumulate",
            "--set",
            "actor.strategy=fsdp",
            "--set",
            "actor.mesh=4",
            "--set",
            "actor.tensor_model_parallel_size=2",
            "--set",
            "data.max_prompt_length=128",
            "--set",
            "data.max_response_length=128",
            "--set",
            "actor.ppo_micro_batch_size=8",
            "--set",
            &format!("model.moe_dispatch={dispatch}"),
        ]);
        let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
        assert_eq!(o.status.code(), Some(0), "{dispatch}: {stdout}\n{stderr}");
        assert!(
            stderr.contains("experts: 8 in each of 2 MoE layers, 2 per token; 4 per device in the learner"),
            "{stderr}"
        );
        let rows = table_rows(&stdout);
        let (_, cells) = rows.iter().find(|(n, _)| n == "accumulate").expect("accumulate");
        assert_eq!(cells[8], "yes", "{dispatch}: {stdout}");
        cells[9].parse::<f64>().unwrap()
    };
    let (dense, grouped) = (gflop("dense"), gflop("grouped"));
    assert!(
        grouped > 1.4 * dense && grouped < 2.5 * dense,
        "grouped {grouped} GFLOP, dense {dense}"
    );
}

/// Gemma 3 (the tiny fixture: sliding and global layers, two RoPEs): the decode step and the
/// learner's `accumulate` with its layers scanned (each layer's kind a scanned flag) compile
/// for a TPU and fit.
#[test]
fn gemma3_decode_and_scanned_learner_compile_for_tpu() {
    if !libtpu("gemma3_decode_and_scanned_learner_compile_for_tpu") {
        return;
    }
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/model/fixtures/tiny/gemma3/config.json"
    );
    let o = grpo(&[
        "compile",
        TPU_RECIPE,
        "--model-config",
        config,
        "--topology",
        "v6e:2x2",
        "--only",
        "accumulate|decode",
        "--set",
        "model.scan_layers=true",
        "--set",
        "data.max_prompt_length=64",
        "--set",
        "data.max_response_length=64",
    ]);
    let (stdout, stderr) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("(gemma3_text,") || stderr.contains("(gemma3_text,"),
        "{stderr}"
    );
    let rows = table_rows(&stdout);
    for want in ["accumulate", "rollout_decode"] {
        let (_, cells) = rows
            .iter()
            .find(|(n, _)| n.starts_with(want))
            .unwrap_or_else(|| panic!("no {want} row in {stdout}"));
        assert_eq!(cells[8], "yes", "{want}: {stdout}");
    }
}
