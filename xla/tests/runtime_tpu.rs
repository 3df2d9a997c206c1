//! Deviceless TPU compilation with the installed libtpu (no TPU needed): a data-parallel training
//! step compiles for v5e, v6e and v5p and reports memory and flops; an oversized program is
//! reported as not fitting, with the sizes; bad topologies, a TPU client on a host without a
//! TPU and a libtpu that cannot initialize are clear errors.
//!
//! libtpu must be installed (`pip install libtpu`); set GRPO_SKIP_TPU_TESTS=1 to skip these
//! tests explicitly.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;

use xla::runtime::tpu::{describe_topology, load_libtpu, TopologyOptions, TpuCompileOutcome};
use xla::runtime::{compile_for_topology_with, Client, ClientOptions, CompileOptions, Error, Plugin};

/// libtpu, or `None` (with a note) when GRPO_SKIP_TPU_TESTS=1; panics with the install command
/// when it is missing.
fn libtpu(test: &str) -> Option<Arc<Plugin>> {
    if std::env::var("GRPO_SKIP_TPU_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("SKIPPED {test}: GRPO_SKIP_TPU_TESTS=1");
        return None;
    }
    match load_libtpu(None) {
        Ok(p) => Some(p),
        Err(e) => panic!(
            "{test} needs libtpu: {e}\n(install it with `pip install libtpu`, or set GRPO_SKIP_TPU_TESTS=1 to skip)"
        ),
    }
}

/// One data-parallel SGD step of a linear model with a squared loss over 4 devices: the batch is
/// sharded, the weights replicated and donated; the loss and gradient are all-reduced.
fn dp_train_step(batch: usize, din: usize, dout: usize) -> String {
    format!(
        r#"module @dp_train_step attributes {{mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32}} {{
  sdy.mesh @mesh = <["data"=4]>
  func.func public @main(%w: tensor<{din}x{dout}xf32> {{sdy.sharding = #sdy.sharding<@mesh, [{{}}, {{}}]>, tf.aliasing_output = 0 : i32}}, %x: tensor<{batch}x{din}xf32> {{sdy.sharding = #sdy.sharding<@mesh, [{{"data"}}, {{}}]>}}, %y: tensor<{batch}x{dout}xf32> {{sdy.sharding = #sdy.sharding<@mesh, [{{"data"}}, {{}}]>}}) -> (tensor<{din}x{dout}xf32> {{sdy.sharding = #sdy.sharding<@mesh, [{{}}, {{}}]>}}, tensor<f32> {{sdy.sharding = #sdy.sharding<@mesh, []>}}) {{
    %pred = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<{batch}x{din}xf32>, tensor<{din}x{dout}xf32>) -> tensor<{batch}x{dout}xf32>
    %act = stablehlo.tanh %pred : tensor<{batch}x{dout}xf32>
    %diff = stablehlo.subtract %act, %y : tensor<{batch}x{dout}xf32>
    %sq = stablehlo.multiply %diff, %diff : tensor<{batch}x{dout}xf32>
    %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %loss = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<{batch}x{dout}xf32>, tensor<f32>) -> tensor<f32>
    %one = stablehlo.constant dense<1.000000e+00> : tensor<{batch}x{dout}xf32>
    %t2 = stablehlo.multiply %act, %act : tensor<{batch}x{dout}xf32>
    %dact = stablehlo.subtract %one, %t2 : tensor<{batch}x{dout}xf32>
    %two = stablehlo.constant dense<2.000000e+00> : tensor<{batch}x{dout}xf32>
    %g0 = stablehlo.multiply %two, %diff : tensor<{batch}x{dout}xf32>
    %gout = stablehlo.multiply %g0, %dact : tensor<{batch}x{dout}xf32>
    %grad = stablehlo.dot_general %x, %gout, contracting_dims = [0] x [0] : (tensor<{batch}x{din}xf32>, tensor<{batch}x{dout}xf32>) -> tensor<{din}x{dout}xf32>
    %lr = stablehlo.constant dense<1.000000e-02> : tensor<{din}x{dout}xf32>
    %upd = stablehlo.multiply %lr, %grad : tensor<{din}x{dout}xf32>
    %wnew = stablehlo.subtract %w, %upd : tensor<{din}x{dout}xf32>
    return %wnew, %loss : tensor<{din}x{dout}xf32>, tensor<f32>
  }}
}}"#
    )
}

fn dp_options() -> CompileOptions {
    CompileOptions {
        num_partitions: 4,
        donated_args: vec![0],
    }
}

#[test]
fn training_step_compiles_for_v5e_v6e_v5p_with_memory_and_flops() {
    let Some(tpu) = libtpu("training_step_compiles_for_v5e_v6e_v5p_with_memory_and_flops") else {
        return;
    };
    let (batch, din, dout) = (256, 512, 128);
    let mlir = dp_train_step(batch, din, dout);
    for (topology, kind, hbm_gib) in [
        ("v5e:2x2", "TPU v5 lite", 16),
        ("v6e:2x2", "TPU v6 lite", 32),
        ("v5p:2x2x1", "TPU v5", 95),
    ] {
        let report =
            compile_for_topology_with(&tpu, &mlir, topology, &TopologyOptions::default(), &dp_options())
                .unwrap_or_else(|e| panic!("{topology}: {e}"));
        assert_eq!(report.program, "dp_train_step");
        assert_eq!(report.topology.num_devices, 4, "{topology}");
        assert_eq!(report.topology.device_kind, kind);
        assert_eq!(report.topology.hbm_bytes_per_chip, Some(hbm_gib << 30));
        let TpuCompileOutcome::Fits {
            memory,
            cost,
            collectives,
            operations,
        } = &report.outcome
        else {
            panic!("{topology}: {:?}", report.outcome)
        };
        // Data parallel: the gradient of w is summed over the devices, in f32 (it may be
        // split into pieces); nothing is gathered.
        let reduced = &collectives["all-reduce"];
        assert!(
            reduced.count >= 1 && reduced.bytes >= (din * dout * 4) as u64,
            "{topology}: {collectives:?}"
        );
        assert!(
            !collectives.contains_key("all-gather"),
            "{topology}: {collectives:?}"
        );
        // Its operations: the products' flops near what the cost analysis counts, and the
        // all-reduce among them.
        let flops: u64 = operations.iter().map(|o| o.flops).sum();
        assert!(
            flops as f64 > 0.5 * cost.flops.unwrap() && (flops as f64) < 2.0 * cost.flops.unwrap(),
            "{topology}: {flops} product flops, cost analysis {:?}: {operations:#?}",
            cost.flops
        );
        assert!(
            operations.iter().any(|o| o.what.contains("all-reduce")),
            "{topology}: {operations:#?}"
        );
        // Per device: w (replicated) + a quarter of x and y.
        let per_device_args = (din * dout + (batch / 4) * (din + dout)) * 4;
        assert_eq!(
            memory.argument_bytes as usize, per_device_args,
            "{topology}: {memory:?}"
        );
        // w and the loss; TPU pads the scalar to a tile (1 KiB on v5e).
        let out = memory.output_bytes as usize;
        assert!(
            out > din * dout * 4 && out <= din * dout * 4 + 4096,
            "{topology}: {memory:?}"
        );
        assert_eq!(
            memory.alias_bytes as usize,
            din * dout * 4,
            "w is donated: {memory:?}"
        );
        assert!(memory.generated_code_bytes > 0, "{memory:?}");
        assert!(memory.peak_or_estimate() >= memory.argument_bytes, "{memory:?}");
        // Two local matmuls of (batch/4) x din x dout, 2 flops per multiply-add.
        let matmul_flops = 2.0 * 2.0 * (batch / 4) as f64 * din as f64 * dout as f64;
        let flops = cost.flops.expect("flops reported");
        assert!(
            flops >= matmul_flops && flops < matmul_flops * 1.5,
            "{topology}: {flops} vs {matmul_flops}"
        );
        assert!(
            cost.bytes_accessed.unwrap() > per_device_args as f64 * 0.5,
            "{cost:?}"
        );
        eprintln!(
            "{topology}: compiled in {:.2}s, peak {} B, {flops:.3e} flops",
            report.compile_seconds,
            memory.peak_or_estimate()
        );
    }
}

#[test]
fn oversized_program_does_not_fit_and_says_how_much() {
    let Some(tpu) = libtpu("oversized_program_does_not_fit_and_says_how_much") else {
        return;
    };
    let n = 65536;
    let mlir = format!(
        r#"module @too_big {{
  func.func public @main(%a: tensor<{n}x{n}xf32>) -> tensor<{n}x{n}xf32> {{
    %s = stablehlo.sine %a : tensor<{n}x{n}xf32>
    %0 = stablehlo.dot_general %s, %a, contracting_dims = [1] x [0] : (tensor<{n}x{n}xf32>, tensor<{n}x{n}xf32>) -> tensor<{n}x{n}xf32>
    return %0 : tensor<{n}x{n}xf32>
  }}
}}"#
    );
    // Single chips: v5e:1x1 and v6e:1x1 need chips_per_host_bounds=[1,1,1], set automatically.
    for (topology, available_gib) in [("v5e:1x1", 15.75), ("v6e:1x1", 31.25)] {
        let report = compile_for_topology_with(
            &tpu,
            &mlir,
            topology,
            &TopologyOptions::default(),
            &CompileOptions::default(),
        )
        .unwrap();
        assert_eq!(report.topology.num_devices, 1);
        let TpuCompileOutcome::DoesNotFit(short) = &report.outcome else {
            panic!(
                "{topology}: a program with 32 GiB of temporaries fits? {:?}",
                report.outcome
            )
        };
        eprintln!("{topology}: {short:?}");
        assert!(short.required_bytes > short.available_bytes, "{short:?}");
        assert!(short.required_bytes >= 16 << 30, "{short:?}");
        // libtpu's available HBM agrees with the table (a little is reserved).
        let table = report.topology.hbm_bytes_per_chip.unwrap();
        assert!(
            short.available_bytes <= table && short.available_bytes as f64 > 0.9 * table as f64,
            "{short:?}"
        );
        // As libtpu prints it, to two decimals (0.0.52: v5e 15.75G, v6e 31.24G).
        let available = short.available_bytes as f64 / (1u64 << 30) as f64;
        assert!(
            (available - available_gib).abs() < 0.02,
            "{topology}: {available} GiB available"
        );
        assert!(short.message.contains("HBM"), "{}", short.message);
        assert!(!report.fits());
    }
}

#[test]
fn bad_topologies_are_clear_errors() {
    let Some(tpu) = libtpu("bad_topologies_are_clear_errors") else {
        return;
    };
    let err = describe_topology(&tpu, "v5p-8", &TopologyOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("TPU topology `v5p-8` is not valid"),
        "{err}"
    );
    // Well-formed but unknown to libtpu.
    let err = describe_topology(&tpu, "v7x:2x2x1", &TopologyOptions::default()).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::BadTopology { .. }), "{text}");
    assert!(text.contains("libtpu rejected it"), "{text}");
    assert!(text.contains("tpu7x:2x2x1"), "suggests valid names: {text}");
    let info = describe_topology(&tpu, "tpu7x:2x2x1", &TopologyOptions::default()).unwrap();
    assert_eq!((info.num_devices, info.num_chips), (8, 4));
    assert_eq!(info.hbm_bytes_per_device(), Some(96 << 30));
    // More partitions than devices.
    let err = compile_for_topology_with(
        &tpu,
        &dp_train_step(8, 4, 2),
        "v5e:1x1",
        &TopologyOptions::default(),
        &dp_options(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("partitioned over 4 devices but topology v5e:1x1 has 1"),
        "{err}"
    );
}

#[test]
fn libtpu_without_a_tpu_cannot_create_a_client() {
    let Some(tpu) = libtpu("libtpu_without_a_tpu_cannot_create_a_client") else {
        return;
    };
    let err = Client::from_plugin(tpu, ClientOptions::default()).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::ClientCreate { .. }), "{text}");
    assert!(text.contains("cannot create a tpu PJRT client"), "{text}");
    assert!(text.contains("only deviceless compilation"), "{text}");
}

/// Selects what a re-executed copy of this test binary does (see [`child_role`]).
const CHILD_ROLE_VAR: &str = "GRPO_TPU_INIT_TEST_ROLE";
/// Printed by a child before its result.
const CHILD_MARK: &str = "GRPO_TPU_INIT_CHILD:";

/// In a child process started by [`rerun_as_child`]: loads libtpu and prints the outcome after
/// [`CHILD_MARK`]. Role `hold` then keeps libtpu (and its lock file) until stdin closes. Returns
/// false in the test harness's own process.
fn child_role() -> bool {
    let Ok(role) = std::env::var(CHILD_ROLE_VAR) else {
        return false;
    };
    let outcome = match load_libtpu(None) {
        Ok(_) => "loaded".to_string(),
        Err(e @ Error::TpuInit { .. }) => format!("TpuInit {e}"),
        Err(e) => format!("other {e}"),
    };
    println!("{CHILD_MARK} {outcome}");
    std::io::stdout().flush().unwrap();
    if role == "hold" {
        // Block until the parent closes our stdin.
        std::io::stdin().lines().for_each(drop);
    }
    true
}

/// Re-runs test `test` of this binary in a child process with `role` and `env` set.
fn rerun_as_child(test: &str, role: &str, env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD_ROLE_VAR, role);
    for (key, value) in env {
        command.env(key, value);
    }
    command
}

/// The outcome a child printed after [`CHILD_MARK`] (libtest prints `test NAME ... ` before it on
/// the same line).
fn child_outcome(stdout: &str) -> Option<String> {
    stdout
        .lines()
        .find_map(|l| l.split_once(CHILD_MARK))
        .map(|(_, o)| o.trim().to_string())
}

#[test]
fn libtpu_locked_by_another_process_is_a_clear_init_error() {
    let test = "libtpu_locked_by_another_process_is_a_clear_init_error";
    if child_role() || libtpu(test).is_none() {
        return;
    }
    // libtpu treats "0" like unset: one process at a time, guarded by /tmp/libtpu_lockfile.
    let exclusive = [("ALLOW_MULTIPLE_LIBTPU_LOAD", "0")];
    let mut holder = rerun_as_child(test, "hold", &exclusive)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut holder_out = String::new();
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    let held = loop {
        match lines.next() {
            Some(line) => {
                let line = line.unwrap();
                holder_out.push_str(&line);
                holder_out.push('\n');
                if let Some(outcome) = child_outcome(&line) {
                    break outcome;
                }
            }
            None => panic!("the lock-holding child exited early: {holder_out}"),
        }
    };
    // Either it holds the lock now, or a process outside this test already did.
    assert!(
        held == "loaded" || held.contains("lockfile"),
        "lock holder: {held}"
    );
    let second = rerun_as_child(test, "load", &exclusive)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    drop(holder.stdin.take());
    holder.wait().unwrap();
    let stdout = String::from_utf8_lossy(&second.stdout);
    let outcome = child_outcome(&stdout).unwrap_or_else(|| {
        panic!(
            "second libtpu load printed no outcome ({}): {stdout}\n{}",
            second.status,
            String::from_utf8_lossy(&second.stderr)
        )
    });
    eprintln!("{outcome}");
    assert!(outcome.starts_with("TpuInit libtpu at "), "{outcome}");
    assert!(outcome.contains("could not initialize: "), "{outcome}");
    // libtpu's own message, then what to do, naming the variable.
    assert!(
        outcome.contains("Internal error when accessing libtpu multi-process lockfile"),
        "{outcome}"
    );
    assert!(
        outcome.contains("Another process holds libtpu's lock file /tmp/libtpu_lockfile"),
        "{outcome}"
    );
    assert!(
        outcome.contains("ALLOW_MULTIPLE_LIBTPU_LOAD=\"0\" forbids a second load"),
        "{outcome}"
    );
    assert!(outcome.contains("set ALLOW_MULTIPLE_LIBTPU_LOAD=1"), "{outcome}");
}

/// libtpu cannot report an unknown `LIBTPU_INIT_ARGS` flag as an error: it exits the process
/// inside `PJRT_Plugin_Initialize`. This pins that behaviour (documented on `Error::TpuInit`).
#[test]
fn unknown_libtpu_init_args_flag_exits_the_process() {
    let test = "unknown_libtpu_init_args_flag_exits_the_process";
    if child_role() || libtpu(test).is_none() {
        return;
    }
    let child = rerun_as_child(
        test,
        "load",
        &[("LIBTPU_INIT_ARGS", "--grpo_no_such_libtpu_flag=1")],
    )
    .stdin(Stdio::null())
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&child.stdout);
    let stderr = String::from_utf8_lossy(&child.stderr);
    assert_eq!(
        child_outcome(&stdout),
        None,
        "libtpu now returns instead of exiting; expect Error::TpuInit and update the docs"
    );
    assert_eq!(child.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("Unknown command line flag 'grpo_no_such_libtpu_flag'"),
        "{stderr}"
    );
}

/// A grouped product and its gradients (`Tensor::ragged_dot`), lowered natively to XLA's
/// ragged dot, compiles for a TPU. libtpu's cost analysis counts each ragged dot as if every
/// row met every group's matrix (the group sizes are run-time values), the FLOPs of the masked
/// dense lowering the CPU plugin runs: the native kernel's saving does not show in it.
#[test]
fn the_native_ragged_dot_compiles_for_a_tpu() {
    let Some(tpu) = libtpu("the_native_ragged_dot_compiles_for_a_tpu") else {
        return;
    };
    use xla::graph::{grad, Graph};
    use xla::DType;
    let (m, k, n, groups) = (512i64, 256i64, 512i64, 8i64);
    let flops = |native: bool| {
        let g = Graph::new("grouped");
        let x = g.parameter("x", DType::F32, &[m, k]);
        let w = g.parameter("w", DType::F32, &[groups, k, n]);
        let sizes = g.parameter("sizes", DType::I32, &[groups]);
        let y = x.ragged_dot(&w, &sizes, native, None);
        let loss = (&y * &y).sum_all();
        let grads = grad(&loss, &[&x, &w]).unwrap();
        let program = g.build(&[&loss, &grads[0], &grads[1]]).unwrap();
        if native {
            assert!(program.mlir().contains("chlo.ragged_dot"), "{}", program.mlir());
        }
        let report = compile_for_topology_with(
            &tpu,
            program.mlir(),
            "v5e:2x2",
            &TopologyOptions::default(),
            &CompileOptions::default(),
        )
        .unwrap_or_else(|e| panic!("native {native}: {e}"));
        let TpuCompileOutcome::Fits { cost, memory, .. } = &report.outcome else {
            panic!("native {native}: {:?}", report.outcome)
        };
        assert!(memory.peak_bytes > 0, "{memory:?}");
        cost.flops.expect("libtpu counts flops")
    };
    let (native, masked) = (flops(true), flops(false));
    // Forward and two gradients: 3 products of 2 m k n FLOPs, each counted G times.
    let counted = (3 * groups * 2 * m * k * n) as f64;
    for (what, f) in [("native", native), ("masked", masked)] {
        assert!(
            f >= counted && f < 1.05 * counted,
            "{what}: {f} against {counted}"
        );
    }
}
