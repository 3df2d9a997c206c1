//! The PJRT runtime against the real CPU plugin: transfers of every dtype, single-device and SPMD
//! execution, asynchronous outputs, donation, the executable cache, and bad input.

use std::sync::OnceLock;

use half::{bf16, f16};
use xla::runtime::{CacheConfig, Client, ClientOptions, CompileOptions, Error, OptionValue, PluginKind};
use xla::DType;

/// The plugin under test: `GRPO_TEST_PLUGIN=cuda` (scripts/gpu-check.sh) or the CPU plugin.
fn kind() -> PluginKind {
    std::env::var("GRPO_TEST_PLUGIN")
        .ok()
        .map(|k| PluginKind::parse(&k).expect("GRPO_TEST_PLUGIN must be cpu, cuda or tpu"))
        .unwrap_or(PluginKind::Cpu)
}

/// One client per test binary (4 devices on CPU), memory cache only.
fn client() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let create_options = match kind() {
            PluginKind::Cpu => vec![("cpu_device_count".into(), OptionValue::Int(4))],
            _ => vec![],
        };
        Client::new(
            kind(),
            None,
            ClientOptions {
                create_options,
                cache: CacheConfig::Disabled,
            },
        )
        .unwrap_or_else(|e| panic!("{e}"))
    })
}

/// The device to use where a test wants one other than 0 (0 with a single device).
fn other_device(n: usize) -> usize {
    n.min(client().num_devices() - 1)
}

/// False (with a note) when the client has fewer devices than a test needs; never on CPU.
fn has_devices(test: &str, needed: usize) -> bool {
    let have = client().num_devices();
    if have < needed {
        assert_ne!(kind(), PluginKind::Cpu);
        eprintln!(
            "SKIPPED {test}: needs {needed} devices, the {} client has {have}",
            kind()
        );
    }
    have >= needed
}

fn single() -> CompileOptions {
    CompileOptions::default()
}

const ADD: &str = r#"module @add {
  func.func public @main(%a: tensor<2x3xf32>, %b: tensor<2x3xf32>) -> tensor<2x3xf32> {
    %0 = stablehlo.add %a, %b : tensor<2x3xf32>
    return %0 : tensor<2x3xf32>
  }
}"#;

#[test]
fn cpu_client_has_the_requested_devices() {
    if kind() != PluginKind::Cpu {
        eprintln!("SKIPPED cpu_client_has_the_requested_devices: not the CPU plugin");
        return;
    }
    let c = Client::cpu(2).unwrap();
    assert_eq!(c.num_devices(), 2);
    assert_eq!(c.platform_name(), "cpu");
    let devices = c.devices();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[1].index, 1);
    assert!(!devices[0].kind.is_empty());
    assert_eq!(client().num_devices(), 4);
    let (major, minor) = c.plugin().api_version();
    assert!((major, minor) >= (0, 81), "{major}.{minor}");
}

#[test]
fn add_runs_and_returns_real_numbers() {
    let c = client();
    let exe = c.compile(ADD, &single()).unwrap();
    assert_eq!(exe.num_outputs(), 1);
    assert_eq!(exe.name(), "add");
    let a: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
    let b: Vec<f32> = (0..6).map(|i| (i * i) as f32).collect();
    let ba = c.buffer_from_host(&a, &[2, 3], 0).unwrap();
    let bb = c.buffer_from_host(&b, &[2, 3], 0).unwrap();
    let out = exe.execute(&[&ba, &bb]).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].dtype(), DType::F32);
    assert_eq!(out[0].dims(), &[2, 3]);
    assert_eq!(out[0].device(), 0);
    let got: Vec<f32> = out[0].to_host().unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(got, want);
    // The inputs stay usable (nothing donated).
    assert_eq!(ba.to_host::<f32>().unwrap(), a);
}

#[test]
fn executes_on_the_device_of_its_arguments() {
    let c = client();
    let exe = c.compile(ADD, &single()).unwrap();
    if !has_devices("executes_on_the_device_of_its_arguments", 4) {
        return;
    }
    for device in [1, 3] {
        let a = c
            .buffer_from_host(&[1f32, 2., 3., 4., 5., 6.], &[2, 3], device)
            .unwrap();
        let out = exe.execute(&[&a, &a]).unwrap();
        assert_eq!(out[0].device(), device);
        assert_eq!(out[0].to_host::<f32>().unwrap(), vec![2., 4., 6., 8., 10., 12.]);
    }
    let a = c.buffer_from_host(&[0f32; 6], &[2, 3], 0).unwrap();
    let b = c.buffer_from_host(&[0f32; 6], &[2, 3], 2).unwrap();
    let err = exe.execute(&[&a, &b]).unwrap_err();
    assert!(
        err.to_string()
            .contains("argument 1 is on device 2, expected device 0"),
        "{err}"
    );
}

fn roundtrip<T: xla::NativeType + PartialEq + std::fmt::Debug>(data: &[T], dims: &[i64]) {
    let c = client();
    let b = c.buffer_from_host(data, dims, other_device(1)).unwrap();
    assert_eq!(b.dtype(), T::DTYPE);
    assert_eq!(b.dims(), dims);
    assert_eq!(b.to_host::<T>().unwrap(), data);
    let bytes = b.to_bytes().unwrap();
    assert_eq!(bytes.len(), data.len() * T::DTYPE.size_bytes());
    let again = c.buffer_from_bytes(&bytes, T::DTYPE, dims, 0).unwrap();
    assert_eq!(again.to_host::<T>().unwrap(), data);
}

#[test]
fn every_dtype_round_trips_host_device_host() {
    roundtrip(&[1.5f64, -2.25, 1e300], &[3]);
    roundtrip(&[1.5f32, -2.25, 3e30, f32::MIN_POSITIVE], &[2, 2]);
    roundtrip(&[bf16::from_f32(1.5), bf16::from_f32(-3.0)], &[2]);
    roundtrip(&[f16::from_f32(0.5), f16::from_f32(-65504.0)], &[1, 2]);
    roundtrip(&[i64::MIN, 0, i64::MAX], &[3]);
    roundtrip(&[i32::MIN, -1, 7], &[3, 1]);
    roundtrip(&[u32::MAX, 0, 42], &[3]);
    roundtrip(&[0u8, 255, 17, 3], &[4]);
    roundtrip(&[true, false, true], &[3]);
    roundtrip(&[42.0f32], &[]);
    roundtrip::<f32>(&[], &[0, 3]);
}

#[test]
fn bf16_program_computes_in_bf16() {
    let c = client();
    let mlir = r#"module @mul_bf16 {
  func.func public @main(%a: tensor<4xbf16>, %b: tensor<4xbf16>) -> (tensor<4xbf16>, tensor<4xf32>) {
    %0 = stablehlo.multiply %a, %b : tensor<4xbf16>
    %1 = stablehlo.convert %0 : (tensor<4xbf16>) -> tensor<4xf32>
    return %0, %1 : tensor<4xbf16>, tensor<4xf32>
  }
}"#;
    let exe = c.compile(mlir, &single()).unwrap();
    let a: Vec<bf16> = [1.5f32, 2.0, -3.0, 0.25].map(bf16::from_f32).to_vec();
    let b: Vec<bf16> = [2.0f32, 2.5, 4.0, 8.0].map(bf16::from_f32).to_vec();
    let ba = c.buffer_from_host(&a, &[4], 0).unwrap();
    let bb = c.buffer_from_host(&b, &[4], 0).unwrap();
    let out = exe.execute(&[&ba, &bb]).unwrap();
    assert_eq!(out[0].dtype(), DType::BF16);
    assert_eq!(out[1].dtype(), DType::F32);
    let got: Vec<f32> = out[0]
        .to_host::<bf16>()
        .unwrap()
        .iter()
        .map(|x| x.to_f32())
        .collect();
    assert_eq!(got, vec![3.0, 5.0, -12.0, 2.0]);
    assert_eq!(out[1].to_host::<f32>().unwrap(), vec![3.0, 5.0, -12.0, 2.0]);
}

#[test]
fn integer_and_bool_programs() {
    let c = client();
    let mlir = r#"module @ints {
  func.func public @main(%a: tensor<3xi32>, %b: tensor<3xi32>, %k: tensor<3xui32>) -> (tensor<3xi1>, tensor<3xi64>, tensor<3xui8>) {
    %lt = stablehlo.compare LT, %a, %b, SIGNED : (tensor<3xi32>, tensor<3xi32>) -> tensor<3xi1>
    %w = stablehlo.convert %a : (tensor<3xi32>) -> tensor<3xi64>
    %big = stablehlo.constant dense<4294967296> : tensor<3xi64>
    %s = stablehlo.multiply %w, %big : tensor<3xi64>
    %m = stablehlo.constant dense<255> : tensor<3xui32>
    %r = stablehlo.and %k, %m : tensor<3xui32>
    %u = stablehlo.convert %r : (tensor<3xui32>) -> tensor<3xui8>
    return %lt, %s, %u : tensor<3xi1>, tensor<3xi64>, tensor<3xui8>
  }
}"#;
    let exe = c.compile(mlir, &single()).unwrap();
    let a = c.buffer_from_host(&[-5i32, 2, 9], &[3], 0).unwrap();
    let b = c.buffer_from_host(&[0i32, 2, 10], &[3], 0).unwrap();
    let k = c.buffer_from_host(&[0x1234u32, 0xffff_ffff, 7], &[3], 0).unwrap();
    let out = exe.execute(&[&a, &b, &k]).unwrap();
    assert_eq!(out[0].to_host::<bool>().unwrap(), vec![true, false, true]);
    assert_eq!(
        out[1].to_host::<i64>().unwrap(),
        vec![-5i64 << 32, 2i64 << 32, 9i64 << 32]
    );
    assert_eq!(out[2].to_host::<u8>().unwrap(), vec![0x34, 0xff, 7]);
}

const SCALE_DONATE: &str = r#"module @scale_in_place {
  func.func public @main(%w: tensor<1024xf32> {tf.aliasing_output = 0 : i32}, %s: tensor<f32>) -> tensor<1024xf32> {
    %sb = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<f32>) -> tensor<1024xf32>
    %0 = stablehlo.multiply %w, %sb : tensor<1024xf32>
    return %0 : tensor<1024xf32>
  }
}"#;

#[test]
fn donated_buffer_is_consumed_and_later_use_is_a_clear_error() {
    let c = client();
    let exe = c
        .compile(
            SCALE_DONATE,
            &CompileOptions {
                num_partitions: 1,
                donated_args: vec![0],
            },
        )
        .unwrap();
    let w: Vec<f32> = (0..1024).map(|i| i as f32).collect();
    let mut wb = c.buffer_from_host(&w, &[1024], 0).unwrap();
    let s = c.buffer_from_host(&[0.5f32], &[], 0).unwrap();
    for step in 1..=3 {
        let mut out = exe.execute(&[&wb, &s]).unwrap();
        assert!(wb.is_donated());
        // The plugin really consumed it (the output reuses its memory).
        out[0].block_until_ready().unwrap();
        assert!(wb.is_deleted_in_plugin().unwrap());
        let err = wb.to_host::<f32>().unwrap_err();
        assert!(matches!(err, Error::BufferDonated { argument: 0, .. }), "{err}");
        assert!(
            err.to_string()
                .contains("donated to `scale_in_place` (argument 0)"),
            "{err}"
        );
        let err = exe.execute(&[&wb, &s]).unwrap_err();
        assert!(
            err.to_string().contains("argument 0 of `scale_in_place`"),
            "{err}"
        );
        wb = out.pop().unwrap();
        let got = wb.to_host::<f32>().unwrap();
        let factor = 0.5f32.powi(step);
        assert_eq!(got[1000], 1000.0 * factor);
    }
    // The scalar was not donated.
    assert!(!s.is_donated());
    assert_eq!(s.to_host::<f32>().unwrap(), vec![0.5]);
}

#[test]
fn aliasing_without_declared_donation_keeps_the_input() {
    let c = client();
    let exe = c.compile(SCALE_DONATE, &single()).unwrap();
    let w = c.buffer_from_host(&vec![2f32; 1024], &[1024], 0).unwrap();
    let s = c.buffer_from_host(&[3f32], &[], 0).unwrap();
    let out = exe.execute(&[&w, &s]).unwrap();
    assert_eq!(out[0].to_host::<f32>().unwrap()[5], 6.0);
    assert!(!w.is_donated());
    assert!(
        !w.is_deleted_in_plugin().unwrap(),
        "not donated: marked non-donatable"
    );
    assert_eq!(w.to_host::<f32>().unwrap()[5], 2.0);
}

#[test]
fn execution_is_asynchronous_and_chains_on_device() {
    let c = client();
    let mlir = r#"module @chain {
  func.func public @main(%a: tensor<256x256xf32>) -> tensor<256x256xf32> {
    %0 = stablehlo.dot_general %a, %a, contracting_dims = [1] x [0] : (tensor<256x256xf32>, tensor<256x256xf32>) -> tensor<256x256xf32>
    %s = stablehlo.constant dense<3.906250e-03> : tensor<256x256xf32>
    %1 = stablehlo.multiply %0, %s : tensor<256x256xf32>
    return %1 : tensor<256x256xf32>
  }
}"#;
    let exe = c.compile(mlir, &single()).unwrap();
    // a = all ones; a@a/256 = all ones again, for any number of steps.
    let mut x = c
        .buffer_from_host(&vec![1f32; 256 * 256], &[256, 256], 0)
        .unwrap();
    for _ in 0..20 {
        x = exe.execute(&[&x]).unwrap().pop().unwrap();
    }
    x.block_until_ready().unwrap();
    let v = x.to_host::<f32>().unwrap();
    assert!(v.iter().all(|e| *e == 1.0), "{:?}", &v[..4]);
}

const SPMD_MUL: &str = r#"module @spmd_mul attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["x"=4]>
  func.func public @main(%a: tensor<8x2xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}, %w: tensor<2xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<8x2xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}, tensor<f32> {sdy.sharding = #sdy.sharding<@mesh, []>}) {
    %wb = stablehlo.broadcast_in_dim %w, dims = [1] : (tensor<2xf32>) -> tensor<8x2xf32>
    %p = stablehlo.multiply %a, %wb : tensor<8x2xf32>
    %z = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %s = stablehlo.reduce(%p init: %z) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x2xf32>, tensor<f32>) -> tensor<f32>
    return %p, %s : tensor<8x2xf32>, tensor<f32>
  }
}"#;

#[test]
fn spmd_program_runs_sharded_over_four_devices() {
    let c = client();
    if !has_devices("spmd_program_runs_sharded_over_four_devices", 4) {
        return;
    }
    let exe = c
        .compile(
            SPMD_MUL,
            &CompileOptions {
                num_partitions: 4,
                donated_args: vec![],
            },
        )
        .unwrap();
    assert_eq!(exe.num_partitions(), 4);
    let a: Vec<f32> = (0..16).map(|i| i as f32).collect();
    let w = [2f32, -1.0];
    let mut shards = Vec::new();
    let mut weights = Vec::new();
    for d in 0..4 {
        shards.push(c.buffer_from_host(&a[d * 4..d * 4 + 4], &[2, 2], d).unwrap());
        weights.push(c.buffer_from_host(&w, &[2], d).unwrap());
    }
    let args: Vec<Vec<&xla::runtime::Buffer>> = (0..4).map(|d| vec![&shards[d], &weights[d]]).collect();
    let out = exe.execute_spmd(&args).unwrap();
    assert_eq!(out.len(), 4);
    let total: f32 = a.chunks(2).map(|r| r[0] * 2.0 - r[1]).sum();
    for (d, outs) in out.iter().enumerate() {
        assert_eq!(outs[0].device(), d);
        assert_eq!(outs[0].dims(), &[2, 2], "local shard");
        let local = outs[0].to_host::<f32>().unwrap();
        let want: Vec<f32> = a[d * 4..d * 4 + 4]
            .chunks(2)
            .flat_map(|r| [r[0] * 2.0, -r[1]])
            .collect();
        assert_eq!(local, want);
        assert_eq!(outs[1].to_host::<f32>().unwrap(), vec![total], "all-reduced sum");
    }
    // Wrong number of device lists.
    let err = exe.execute_spmd(&args[..2]).unwrap_err();
    assert!(
        err.to_string()
            .contains("partitioned over 4 device(s) but execute_spmd got 2"),
        "{err}"
    );
    let err = exe.execute(&[&shards[0], &weights[0]]).unwrap_err();
    assert!(matches!(err, Error::WrongDeviceCount { .. }), "{err}");
}

#[test]
fn wrong_argument_count_and_shapes_are_clear_errors() {
    let c = client();
    let exe = c.compile(ADD, &single()).unwrap();
    let a = c.buffer_from_host(&[0f32; 6], &[2, 3], 0).unwrap();
    let err = exe.execute(&[&a]).unwrap_err();
    assert_eq!(err.to_string(), "program `add` takes 2 argument(s), got 1");
    let wrong = c.buffer_from_host(&[0f32; 6], &[3, 2], 0).unwrap();
    let err = exe.execute(&[&a, &wrong]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "program `add` argument 1: expected tensor<2x3xf32>, got tensor<3x2xf32>"
    );
    let ints = c.buffer_from_host(&[0i32; 6], &[2, 3], 0).unwrap();
    let err = exe.execute(&[&ints, &a]).unwrap_err();
    assert!(err.to_string().contains("got tensor<2x3xi32>"), "{err}");
}

#[test]
fn mismatched_shapes_in_a_program_fail_to_compile_with_the_plugin_message() {
    let c = client();
    let bad = r#"module @bad_shapes {
  func.func public @main(%a: tensor<2x3xf32>, %b: tensor<3x2xf32>) -> tensor<2x3xf32> {
    %0 = stablehlo.add %a, %b : (tensor<2x3xf32>, tensor<3x2xf32>) -> tensor<2x3xf32>
    return %0 : tensor<2x3xf32>
  }
}"#;
    let err = c.compile(bad, &single()).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::Compile { .. }), "{text}");
    assert!(
        text.starts_with("compiling program `bad_shapes` failed:"),
        "{text}"
    );
    assert!(text.len() > 60, "the plugin says why: {text}");
    let err = c.compile("this is not mlir", &single()).unwrap_err();
    assert!(
        err.to_string().contains("compiling program `main` failed"),
        "{err}"
    );
}

#[test]
fn bad_transfers_are_clear_errors() {
    let c = client();
    let err = c.buffer_from_host(&[1f32, 2.0, 3.0], &[2, 2], 0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "host data for a f32[2, 2] buffer must be 16 bytes (4 elements), got 12 bytes"
    );
    let err = c.buffer_from_host(&[1f32], &[1], 9).unwrap_err();
    let n = c.num_devices();
    assert!(
        err.to_string().contains(&format!(
            "device 9 does not exist: this {} client has {n} device(s)",
            c.platform_name()
        )),
        "{err}"
    );
    let b = c.buffer_from_host(&[1f32, 2.0], &[2], 0).unwrap();
    let err = b.to_host::<i32>().unwrap_err();
    assert_eq!(err.to_string(), "buffer holds f32[2], cannot read it as i32");
    let err = c.buffer_from_bytes(&[0, 2], DType::Bool, &[2], 0).unwrap_err();
    assert!(matches!(err, Error::HostDataSize { .. }), "{err}");
}

#[test]
fn copy_to_another_device() {
    let c = client();
    let b = c.buffer_from_host(&[1i64, 2, 3], &[3], 0).unwrap();
    let moved = b.copy_to_device(other_device(2)).unwrap();
    assert_eq!(moved.device(), other_device(2));
    assert_eq!(moved.to_host::<i64>().unwrap(), vec![1, 2, 3]);
}

#[test]
fn memory_stats_and_cost_analysis_on_cpu() {
    let c = client();
    let exe = c.compile(ADD, &single()).unwrap();
    let stats = exe.memory_stats().unwrap();
    assert_eq!(stats.argument_bytes, 2 * 6 * 4);
    assert_eq!(stats.output_bytes, 6 * 4);
    if kind() != PluginKind::Cpu {
        eprintln!("cost analysis on {}: {:?}", kind(), exe.cost_analysis());
        return;
    }
    // The CPU plugin has no cost analysis (libtpu has: see tests/runtime_tpu.rs).
    let err = exe.cost_analysis().unwrap_err();
    assert!(
        matches!(
            err,
            Error::Pjrt {
                code: xla::runtime::PjrtErrorCode(12),
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("PJRT_Executable_GetCostAnalysis failed (UNIMPLEMENTED (12))"),
        "{err}"
    );
}

#[test]
fn client_and_buffers_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Client>();
    check::<xla::runtime::Buffer>();
    check::<xla::runtime::Executable>();
    let c = client().clone();
    let exe = c.compile(ADD, &single()).unwrap();
    let handles: Vec<_> = (0..c.num_devices().min(4))
        .map(|t| {
            let c = c.clone();
            let exe = exe.clone();
            std::thread::spawn(move || {
                let a = c.buffer_from_host(&[t as f32; 6], &[2, 3], t).unwrap();
                exe.execute(&[&a, &a]).unwrap()[0].to_host::<f32>().unwrap()
            })
        })
        .collect();
    for (t, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap(), vec![2.0 * t as f32; 6]);
    }
}

#[test]
fn execute_returns_before_the_result_is_computed() {
    let c = client();
    // Big enough that computing takes far longer than dispatching, on CPU and on a GPU.
    let n = if kind() == PluginKind::Cpu { 1024 } else { 8192 };
    let mlir = format!(
        r#"module @gemm_async {{
  func.func public @main(%a: tensor<{n}x{n}xf32>) -> tensor<{n}x{n}xf32> {{
    %0 = stablehlo.dot_general %a, %a, contracting_dims = [1] x [0] : (tensor<{n}x{n}xf32>, tensor<{n}x{n}xf32>) -> tensor<{n}x{n}xf32>
    %1 = stablehlo.dot_general %0, %a, contracting_dims = [1] x [0] : (tensor<{n}x{n}xf32>, tensor<{n}x{n}xf32>) -> tensor<{n}x{n}xf32>
    return %1 : tensor<{n}x{n}xf32>
  }}
}}"#
    );
    let exe = c.compile(&mlir, &single()).unwrap();
    let a = c
        .buffer_from_host(&vec![0.5f32; n * n], &[n as i64, n as i64], 0)
        .unwrap();
    exe.execute(&[&a]).unwrap()[0].block_until_ready().unwrap();
    // Over a few tries (the machine may be busy), execute must return well before the value is
    // ready: 4 GFLOP take tens of milliseconds, dispatch takes microseconds.
    let mut ratios = Vec::new();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let out = exe.execute(&[&a]).unwrap();
        let dispatched = t.elapsed();
        out[0].block_until_ready().unwrap();
        let ready = t.elapsed();
        ratios.push(dispatched.as_secs_f64() / ready.as_secs_f64());
        assert_eq!(
            out[0].to_host::<f32>().unwrap()[7],
            0.25 * n as f32 * 0.5 * n as f32
        );
    }
    let best = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
    assert!(
        best < 0.25,
        "execute waited for the computation: dispatch/ready = {ratios:?}"
    );
}

#[test]
fn spmd_donation_consumes_every_shard() {
    let c = client();
    if !has_devices("spmd_donation_consumes_every_shard", 2) {
        return;
    }
    let mlir = r#"module @sharded_update attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["x"=2]>
  func.func public @main(%w: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>, tf.aliasing_output = 0 : i32}, %g: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>}) -> (tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>}) {
    %0 = stablehlo.subtract %w, %g : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}"#;
    let exe = c
        .compile(
            mlir,
            &CompileOptions {
                num_partitions: 2,
                donated_args: vec![0],
            },
        )
        .unwrap();
    let mut w: Vec<xla::runtime::Buffer> = (0..2)
        .map(|d| c.buffer_from_host(&[10f32 * (d + 1) as f32; 4], &[4], d).unwrap())
        .collect();
    let g: Vec<xla::runtime::Buffer> = (0..2)
        .map(|d| c.buffer_from_host(&[1f32; 4], &[4], d).unwrap())
        .collect();
    for step in 1..=2 {
        let args: Vec<Vec<&xla::runtime::Buffer>> = (0..2).map(|d| vec![&w[d], &g[d]]).collect();
        let out = exe.execute_spmd(&args).unwrap();
        for d in 0..2 {
            out[d][0].block_until_ready().unwrap();
            assert!(w[d].is_donated());
            assert!(
                w[d].is_deleted_in_plugin().unwrap(),
                "shard {d} consumed by the plugin"
            );
            assert!(matches!(
                w[d].to_bytes().unwrap_err(),
                Error::BufferDonated { argument: 0, .. }
            ));
            assert!(!g[d].is_donated());
        }
        w = out.into_iter().map(|mut o| o.pop().unwrap()).collect();
        for (d, shard) in w.iter().enumerate() {
            assert_eq!(
                shard.to_host::<f32>().unwrap(),
                vec![10.0 * (d + 1) as f32 - step as f32; 4]
            );
        }
    }
}
