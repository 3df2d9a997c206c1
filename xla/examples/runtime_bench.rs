//! Runtime benchmark: the crate against a bare PJRT C API call sequence of the same program in the
//! same process (ratios, not absolute times).
//!
//! - GEMM 2048x2048x2048 in f32 and bf16: GFLOP/s through `xla::runtime` vs bare calls.
//! - Per-call overhead of a tiny program with inputs on the device (execute + wait + free).
//! - Compile: fresh vs from the in-memory cache vs from the on-disk cache (fresh client).
//!
//! ```sh
//! cargo run --release -p xla --example runtime_bench -- [--plugin cpu|cuda|tpu] [--n 2048]
//!     [--iters 10] [--calls 20000] [--devices 1]
//! ```

use std::ffi::c_char;
use std::ptr::null_mut;
use std::time::Instant;

use half::bf16;
use xla::runtime::sys::*;
use xla::runtime::{CacheConfig, Client, ClientOptions, CompileOptions, OptionValue, Plugin, PluginKind};

/// An n x n GEMM in `ty`; f32 at HIGHEST precision, as the graph emits f32 products (without
/// it the CUDA plugin computes in TF32).
fn gemm(n: usize, ty: &str) -> String {
    let precision = if ty == "f32" { "HIGHEST" } else { "DEFAULT" };
    format!(
        r#"module @gemm_{n}_{ty} {{
  func.func public @main(%a: tensor<{n}x{n}x{ty}>, %b: tensor<{n}x{n}x{ty}>) -> tensor<{n}x{n}x{ty}> {{
    %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0], precision = [{precision}, {precision}] : (tensor<{n}x{n}x{ty}>, tensor<{n}x{n}x{ty}>) -> tensor<{n}x{n}x{ty}>
    return %0 : tensor<{n}x{n}x{ty}>
  }}
}}"#
    )
}

const ADD4: &str = r#"module @add4 {
  func.func public @main(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.add %a, %b : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}"#;

fn mlp_step(batch: usize, din: usize, dh: usize) -> String {
    format!(
        r#"module @mlp_step {{
  func.func public @main(%w1: tensor<{din}x{dh}xf32> {{tf.aliasing_output = 0 : i32}}, %w2: tensor<{dh}x1xf32> {{tf.aliasing_output = 1 : i32}}, %x: tensor<{batch}x{din}xf32>, %y: tensor<{batch}x1xf32>) -> (tensor<{din}x{dh}xf32>, tensor<{dh}x1xf32>, tensor<f32>) {{
    %h0 = stablehlo.dot_general %x, %w1, contracting_dims = [1] x [0] : (tensor<{batch}x{din}xf32>, tensor<{din}x{dh}xf32>) -> tensor<{batch}x{dh}xf32>
    %h = stablehlo.tanh %h0 : tensor<{batch}x{dh}xf32>
    %p = stablehlo.dot_general %h, %w2, contracting_dims = [1] x [0] : (tensor<{batch}x{dh}xf32>, tensor<{dh}x1xf32>) -> tensor<{batch}x1xf32>
    %d = stablehlo.subtract %p, %y : tensor<{batch}x1xf32>
    %sq = stablehlo.multiply %d, %d : tensor<{batch}x1xf32>
    %z = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %loss = stablehlo.reduce(%sq init: %z) applies stablehlo.add across dimensions = [0, 1] : (tensor<{batch}x1xf32>, tensor<f32>) -> tensor<f32>
    %two = stablehlo.constant dense<2.000000e+00> : tensor<{batch}x1xf32>
    %gp = stablehlo.multiply %two, %d : tensor<{batch}x1xf32>
    %gw2 = stablehlo.dot_general %h, %gp, contracting_dims = [0] x [0] : (tensor<{batch}x{dh}xf32>, tensor<{batch}x1xf32>) -> tensor<{dh}x1xf32>
    %gh = stablehlo.dot_general %gp, %w2, contracting_dims = [1] x [1] : (tensor<{batch}x1xf32>, tensor<{dh}x1xf32>) -> tensor<{batch}x{dh}xf32>
    %one = stablehlo.constant dense<1.000000e+00> : tensor<{batch}x{dh}xf32>
    %h2 = stablehlo.multiply %h, %h : tensor<{batch}x{dh}xf32>
    %dt = stablehlo.subtract %one, %h2 : tensor<{batch}x{dh}xf32>
    %gh0 = stablehlo.multiply %gh, %dt : tensor<{batch}x{dh}xf32>
    %gw1 = stablehlo.dot_general %x, %gh0, contracting_dims = [0] x [0] : (tensor<{batch}x{din}xf32>, tensor<{batch}x{dh}xf32>) -> tensor<{din}x{dh}xf32>
    %lr1 = stablehlo.constant dense<1.000000e-03> : tensor<{din}x{dh}xf32>
    %lr2 = stablehlo.constant dense<1.000000e-03> : tensor<{dh}x1xf32>
    %u1 = stablehlo.multiply %lr1, %gw1 : tensor<{din}x{dh}xf32>
    %u2 = stablehlo.multiply %lr2, %gw2 : tensor<{dh}x1xf32>
    %w1n = stablehlo.subtract %w1, %u1 : tensor<{din}x{dh}xf32>
    %w2n = stablehlo.subtract %w2, %u2 : tensor<{dh}x1xf32>
    return %w1n, %w2n, %loss : tensor<{din}x{dh}xf32>, tensor<{dh}x1xf32>, tensor<f32>
  }}
}}"#
    )
}

// ---------------------------------------------------------------------------------------------
// Bare PJRT: the same work with direct C API calls, no wrapper.
// ---------------------------------------------------------------------------------------------

macro_rules! zeroed_args {
    ($t:ident, $s:ident) => {{
        // SAFETY: PJRT argument structs are plain C data.
        let mut a: $t = unsafe { std::mem::zeroed() };
        a.struct_size = $s as usize;
        a
    }};
}

struct Bare {
    api: &'static PJRT_Api,
    client: *mut PJRT_Client,
    device: *mut PJRT_Device,
}

impl Bare {
    fn check(&self, err: *mut PJRT_Error, what: &str) {
        if err.is_null() {
            return;
        }
        let mut m = zeroed_args!(PJRT_Error_Message_Args, PJRT_Error_Message_Args_STRUCT_SIZE);
        m.error = err;
        // SAFETY: valid error; message valid until destroy.
        let msg = unsafe {
            (self.api.PJRT_Error_Message.unwrap())(&mut m);
            String::from_utf8_lossy(std::slice::from_raw_parts(m.message as *const u8, m.message_size))
                .into_owned()
        };
        panic!("bare {what} failed: {msg}");
    }

    fn new(plugin: &Plugin, devices: i64) -> Bare {
        // SAFETY: the table lives as long as the process (plugins are never unloaded).
        let api: &'static PJRT_Api = unsafe { &*plugin.raw_api() };
        let name = "cpu_device_count";
        let mut nv = zeroed_args!(PJRT_NamedValue, PJRT_NamedValue_STRUCT_SIZE);
        nv.name = name.as_ptr() as *const c_char;
        nv.name_size = name.len();
        nv.type_ = PJRT_NamedValue_Type_PJRT_NamedValue_kInt64;
        nv.__bindgen_anon_1.int64_value = devices;
        nv.value_size = 1;
        let mut c = zeroed_args!(PJRT_Client_Create_Args, PJRT_Client_Create_Args_STRUCT_SIZE);
        if plugin.kind() == PluginKind::Cpu {
            c.create_options = &nv;
            c.num_options = 1;
        }
        let mut bare = Bare {
            api,
            client: null_mut(),
            device: null_mut(),
        };
        // SAFETY: valid args.
        bare.check(
            unsafe { (api.PJRT_Client_Create.unwrap())(&mut c) },
            "Client_Create",
        );
        bare.client = c.client;
        let mut d = zeroed_args!(
            PJRT_Client_AddressableDevices_Args,
            PJRT_Client_AddressableDevices_Args_STRUCT_SIZE
        );
        d.client = bare.client;
        // SAFETY: valid args; device array owned by the client.
        unsafe {
            bare.check(
                (api.PJRT_Client_AddressableDevices.unwrap())(&mut d),
                "AddressableDevices",
            );
            bare.device = *d.addressable_devices;
        }
        bare
    }

    fn compile(&self, mlir: &str, options: &[u8]) -> *mut PJRT_LoadedExecutable {
        let fmt = "mlir";
        let mut p = zeroed_args!(PJRT_Program, PJRT_Program_STRUCT_SIZE);
        p.code = mlir.as_ptr() as *mut c_char;
        p.code_size = mlir.len();
        p.format = fmt.as_ptr() as *const c_char;
        p.format_size = fmt.len();
        let mut c = zeroed_args!(PJRT_Client_Compile_Args, PJRT_Client_Compile_Args_STRUCT_SIZE);
        c.client = self.client;
        c.program = &p;
        c.compile_options = options.as_ptr() as *const c_char;
        c.compile_options_size = options.len();
        // SAFETY: valid args.
        self.check(
            unsafe { (self.api.PJRT_Client_Compile.unwrap())(&mut c) },
            "Compile",
        );
        c.executable
    }

    fn upload(&self, bytes: &[u8], ty: PJRT_Buffer_Type, dims: &[i64]) -> *mut PJRT_Buffer {
        let mut b = zeroed_args!(
            PJRT_Client_BufferFromHostBuffer_Args,
            PJRT_Client_BufferFromHostBuffer_Args_STRUCT_SIZE
        );
        b.client = self.client;
        b.data = bytes.as_ptr() as *const std::ffi::c_void;
        b.type_ = ty;
        b.dims = dims.as_ptr();
        b.num_dims = dims.len();
        b.host_buffer_semantics = PJRT_HostBufferSemantics_PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
        b.device = self.device;
        // SAFETY: valid args.
        self.check(
            unsafe { (self.api.PJRT_Client_BufferFromHostBuffer.unwrap())(&mut b) },
            "BufferFromHost",
        );
        self.await_event(b.done_with_host_buffer);
        b.buffer
    }

    fn await_event(&self, ev: *mut PJRT_Event) {
        if ev.is_null() {
            return;
        }
        let mut a = zeroed_args!(PJRT_Event_Await_Args, PJRT_Event_Await_Args_STRUCT_SIZE);
        a.event = ev;
        let mut d = zeroed_args!(PJRT_Event_Destroy_Args, PJRT_Event_Destroy_Args_STRUCT_SIZE);
        d.event = ev;
        // SAFETY: valid event, destroyed once.
        unsafe {
            self.check((self.api.PJRT_Event_Await.unwrap())(&mut a), "Event_Await");
            (self.api.PJRT_Event_Destroy.unwrap())(&mut d);
        }
    }

    fn destroy_buffer(&self, b: *mut PJRT_Buffer) {
        let mut d = zeroed_args!(PJRT_Buffer_Destroy_Args, PJRT_Buffer_Destroy_Args_STRUCT_SIZE);
        d.buffer = b;
        // SAFETY: valid buffer, destroyed once.
        unsafe { (self.api.PJRT_Buffer_Destroy.unwrap())(&mut d) };
    }

    /// Execute with one output, wait for completion, free the output.
    fn run_once(&self, exe: *mut PJRT_LoadedExecutable, args: &[*mut PJRT_Buffer]) {
        let mut opts = zeroed_args!(PJRT_ExecuteOptions, PJRT_ExecuteOptions_STRUCT_SIZE);
        let lists = [args.as_ptr()];
        let mut out: [*mut PJRT_Buffer; 1] = [null_mut()];
        let out_lists = [out.as_mut_ptr()];
        let mut events: [*mut PJRT_Event; 1] = [null_mut()];
        let mut e = zeroed_args!(
            PJRT_LoadedExecutable_Execute_Args,
            PJRT_LoadedExecutable_Execute_Args_STRUCT_SIZE
        );
        e.executable = exe;
        e.options = &mut opts;
        e.argument_lists = lists.as_ptr();
        e.num_devices = 1;
        e.num_args = args.len();
        e.output_lists = out_lists.as_ptr();
        e.device_complete_events = events.as_mut_ptr();
        // The programs are compiled portable (as the crate does), so name the device.
        e.execute_device = self.device;
        // SAFETY: valid args.
        self.check(
            unsafe { (self.api.PJRT_LoadedExecutable_Execute.unwrap())(&mut e) },
            "Execute",
        );
        self.await_event(events[0]);
        self.destroy_buffer(out[0]);
    }

    fn destroy_executable(&self, exe: *mut PJRT_LoadedExecutable) {
        let mut d = zeroed_args!(
            PJRT_LoadedExecutable_Destroy_Args,
            PJRT_LoadedExecutable_Destroy_Args_STRUCT_SIZE
        );
        d.executable = exe;
        // SAFETY: valid executable, destroyed once.
        unsafe { (self.api.PJRT_LoadedExecutable_Destroy.unwrap())(&mut d) };
    }
}

impl Drop for Bare {
    fn drop(&mut self) {
        let mut d = zeroed_args!(PJRT_Client_Destroy_Args, PJRT_Client_Destroy_Args_STRUCT_SIZE);
        d.client = self.client;
        // SAFETY: valid client, destroyed once.
        unsafe { (self.api.PJRT_Client_Destroy.unwrap())(&mut d) };
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain numeric data.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

struct Args {
    plugin: PluginKind,
    n: usize,
    iters: usize,
    calls: usize,
    devices: i64,
}

fn parse_args() -> Args {
    let mut a = Args {
        plugin: PluginKind::Cpu,
        n: 2048,
        iters: 10,
        calls: 20000,
        devices: 1,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let value = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--plugin" => a.plugin = PluginKind::parse(&value).expect("--plugin cpu|cuda|tpu"),
            "--n" => a.n = value.parse().expect("--n N"),
            "--iters" => a.iters = value.parse().expect("--iters N"),
            "--calls" => a.calls = value.parse().expect("--calls N"),
            "--devices" => a.devices = value.parse().expect("--devices N"),
            other => panic!("unknown flag {other}; see the doc comment of examples/runtime_bench.rs"),
        }
        i += 2;
    }
    a
}

fn main() {
    let args = parse_args();
    let plugin = Plugin::discover(args.plugin, None).unwrap_or_else(|e| panic!("{e}"));
    let create_options = if args.plugin == PluginKind::Cpu {
        vec![("cpu_device_count".to_string(), OptionValue::Int(args.devices))]
    } else {
        Vec::new()
    };
    let client = Client::from_plugin(
        plugin.clone(),
        ClientOptions {
            create_options: create_options.clone(),
            cache: CacheConfig::Disabled,
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let bare = Bare::new(&plugin, args.devices);
    let (major, minor) = plugin.api_version();
    println!(
        "plugin {} (PJRT C API {major}.{minor}), platform {} {}, device 0: {}",
        plugin.path().display(),
        client.platform_name(),
        client.platform_version(),
        client.devices()[0].kind
    );
    let n = args.n;
    let flops = 2.0 * (n as f64).powi(3);
    let single = CompileOptions::default();
    let options_proto = xla::runtime::compile_options_proto(&single, true);

    // ---------------- GEMM ----------------
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let a32: Vec<f32> = (0..n * n).map(|_| next()).collect();
    let b32: Vec<f32> = (0..n * n).map(|_| next()).collect();
    let a16: Vec<bf16> = a32.iter().map(|x| bf16::from_f32(*x)).collect();
    let b16: Vec<bf16> = b32.iter().map(|x| bf16::from_f32(*x)).collect();
    let dims = [n as i64, n as i64];
    for (ty, pjrt_ty) in [
        ("f32", PJRT_Buffer_Type_PJRT_Buffer_Type_F32),
        ("bf16", PJRT_Buffer_Type_PJRT_Buffer_Type_BF16),
    ] {
        let mlir = gemm(n, ty);
        let exe = client.compile(&mlir, &single).unwrap();
        let (ca, cb) = if ty == "f32" {
            (
                client.buffer_from_host(&a32, &dims, 0).unwrap(),
                client.buffer_from_host(&b32, &dims, 0).unwrap(),
            )
        } else {
            (
                client.buffer_from_host(&a16, &dims, 0).unwrap(),
                client.buffer_from_host(&b16, &dims, 0).unwrap(),
            )
        };
        let bare_exe = bare.compile(&mlir, &options_proto);
        let (ba, bb) = if ty == "f32" {
            (
                bare.upload(as_bytes(&a32), pjrt_ty, &dims),
                bare.upload(as_bytes(&b32), pjrt_ty, &dims),
            )
        } else {
            (
                bare.upload(as_bytes(&a16), pjrt_ty, &dims),
                bare.upload(as_bytes(&b16), pjrt_ty, &dims),
            )
        };
        // Check the crate's numbers on one entry.
        let out = exe.execute(&[&ca, &cb]).unwrap();
        let c00 = if ty == "f32" {
            out[0].to_host::<f32>().unwrap()[0] as f64
        } else {
            out[0].to_host::<bf16>().unwrap()[0].to_f64()
        };
        let want: f64 = (0..n)
            .map(|k| {
                if ty == "f32" {
                    a32[k] as f64 * b32[k * n] as f64
                } else {
                    a16[k].to_f64() * b16[k * n].to_f64()
                }
            })
            .sum();
        let tolerance = if ty == "f32" {
            1e-3
        } else {
            0.1 * want.abs().max(1.0)
        };
        assert!((c00 - want).abs() < tolerance, "{ty} C[0,0] = {c00}, want {want}");
        drop(out);
        // Warm up both, then alternate to share any drift.
        for _ in 0..2 {
            exe.execute(&[&ca, &cb]).unwrap()[0].block_until_ready().unwrap();
            bare.run_once(bare_exe, &[ba, bb]);
        }
        let (mut crate_t, mut bare_t) = (Vec::new(), Vec::new());
        for _ in 0..args.iters {
            let t = Instant::now();
            let out = exe.execute(&[&ca, &cb]).unwrap();
            out[0].block_until_ready().unwrap();
            drop(out);
            crate_t.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            bare.run_once(bare_exe, &[ba, bb]);
            bare_t.push(t.elapsed().as_secs_f64());
        }
        let (cm, bm) = (median(&mut crate_t), median(&mut bare_t));
        println!(
            "GEMM {ty} {n}^3: crate {:.1} GFLOP/s, bare PJRT {:.1} GFLOP/s, crate/bare {:.3} (median of {})",
            flops / cm / 1e9,
            flops / bm / 1e9,
            bm / cm,
            args.iters
        );
        bare.destroy_buffer(ba);
        bare.destroy_buffer(bb);
        bare.destroy_executable(bare_exe);
    }

    // ---------------- per-call overhead ----------------
    let exe = client.compile(ADD4, &single).unwrap();
    let x = client.buffer_from_host(&[1f32, 2., 3., 4.], &[4], 0).unwrap();
    let y = client.buffer_from_host(&[10f32, 20., 30., 40.], &[4], 0).unwrap();
    assert_eq!(
        exe.execute(&[&x, &y]).unwrap()[0].to_host::<f32>().unwrap(),
        vec![11., 22., 33., 44.]
    );
    let bare_exe = bare.compile(ADD4, &options_proto);
    let four = [1f32, 2., 3., 4.];
    let bx = bare.upload(as_bytes(&four), PJRT_Buffer_Type_PJRT_Buffer_Type_F32, &[4]);
    let by = bare.upload(as_bytes(&four), PJRT_Buffer_Type_PJRT_Buffer_Type_F32, &[4]);
    for _ in 0..1000 {
        exe.execute(&[&x, &y]).unwrap()[0].block_until_ready().unwrap();
        bare.run_once(bare_exe, &[bx, by]);
    }
    let (mut crate_t, mut bare_t) = (Vec::with_capacity(args.calls), Vec::with_capacity(args.calls));
    for _ in 0..args.calls {
        let t = Instant::now();
        let out = exe.execute(&[&x, &y]).unwrap();
        out[0].block_until_ready().unwrap();
        drop(out);
        crate_t.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        bare.run_once(bare_exe, &[bx, by]);
        bare_t.push(t.elapsed().as_secs_f64() * 1e6);
    }
    println!(
        "per-call overhead (tiny program, inputs on device, execute + wait + free): crate {:.2} us, bare PJRT {:.2} us (median of {})",
        median(&mut crate_t),
        median(&mut bare_t),
        args.calls
    );
    bare.destroy_buffer(bx);
    bare.destroy_buffer(by);
    bare.destroy_executable(bare_exe);

    // ---------------- compile: fresh vs cached ----------------
    let mlir = mlp_step(256, 512, 1024);
    let options = CompileOptions {
        num_partitions: 1,
        donated_args: vec![0, 1],
    };
    let cache_dir = std::env::temp_dir().join(format!("grpo-runtime-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache_dir);
    let cached_client = |dir: &std::path::Path| {
        Client::from_plugin(
            plugin.clone(),
            ClientOptions {
                create_options: create_options.clone(),
                cache: CacheConfig::Dir(dir.to_path_buf()),
            },
        )
        .unwrap()
    };
    let mut fresh = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        drop(client.compile_uncached(&mlir, &options).unwrap());
        fresh.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let first = cached_client(&cache_dir);
    let t = Instant::now();
    first.compile(&mlir, &options).unwrap();
    let compile_and_store = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    first.compile(&mlir, &options).unwrap();
    let memory_hit = t.elapsed().as_secs_f64() * 1e6;
    let mut disk = Vec::new();
    for _ in 0..3 {
        let second = cached_client(&cache_dir);
        let t = Instant::now();
        second.compile(&mlir, &options).unwrap();
        disk.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(second.cache().stats().disk_hits, 1);
    }
    println!(
        "compile mlp_step (256x512x1024 train step): fresh {:.1} ms, fresh + write to disk cache {:.1} ms, \
         disk cache hit (new client) {:.2} ms, memory cache hit {:.1} us",
        median(&mut fresh),
        compile_and_store,
        median(&mut disk),
        memory_hit
    );
    let _ = std::fs::remove_dir_all(&cache_dir);
}
