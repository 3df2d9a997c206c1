//! Shared helpers for the graph tests: one CPU client per test binary, host <-> device
//! helpers and a small seeded random source.
#![allow(dead_code)]

use std::sync::OnceLock;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use xla::graph::Program;
use xla::runtime::{Buffer, CacheConfig, Client, ClientOptions, OptionValue, PluginKind};
use xla::NativeType;

fn make_client(devices: usize) -> Client {
    Client::new(
        PluginKind::Cpu,
        None,
        ClientOptions {
            create_options: vec![("cpu_device_count".to_string(), OptionValue::Int(devices as i64))],
            cache: CacheConfig::Disabled,
        },
    )
    .unwrap_or_else(|e| panic!("cannot create a CPU client with {devices} devices: {e}"))
}

/// A single-device CPU client shared by the tests of one binary.
pub fn client() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| make_client(1))
}

/// A four-device CPU client.
pub fn client4() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| make_client(4))
}

/// Uploads `data` with `dims` to device 0 of `client()`.
pub fn upload<T: NativeType>(data: &[T], dims: &[i64]) -> Buffer {
    client().buffer_from_host(data, dims, 0).expect("upload")
}

/// Compiles (panicking with the program text on failure) and runs a single-device program.
pub fn run(program: &Program, args: &[&Buffer]) -> Vec<Buffer> {
    let exe = compile(program);
    exe.execute(args)
        .unwrap_or_else(|e| panic!("execute {}: {e}", program.name()))
}

/// Compiles on `client()`, showing the text when the plugin rejects it.
pub fn compile(program: &Program) -> xla::runtime::Executable {
    program
        .compile(client())
        .unwrap_or_else(|e| panic!("compile {} failed: {e}\n{}", program.name(), program.mlir()))
}

/// Reads a buffer back.
pub fn read<T: NativeType>(b: &Buffer) -> Vec<T> {
    b.to_host::<T>().expect("read back")
}

/// Seeded randomness (the seed is printed so a failure can be replayed with
/// `GRAPH_TEST_SEED`).
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("GRAPH_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_u64);
    eprintln!("{test}: seed {seed} (set GRAPH_TEST_SEED to change)");
    StdRng::seed_from_u64(seed)
}

/// `n` uniform values in `[lo, hi)`.
pub fn uniform(rng: &mut StdRng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// Asserts `|a - b| <= tol * max(1, |b|)` element-wise, naming the first offender.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "{what}: element {i}: got {a}, want {b} (tolerance {tol})"
        );
    }
}

// ---- a small MLP regression step with Adam, shared by the training and SPMD tests ----

use xla::graph::{grad, BuildOptions, Graph, Mesh, Sharding, Tensor};
use xla::DType;

/// Layer sizes of the test MLP: `IN -> HIDDEN (tanh) -> 1`.
pub const IN: i64 = 16;
pub const HIDDEN: i64 = 32;
/// Adam hyper-parameters.
pub const LR: f32 = 1e-2;
pub const BETA1: f32 = 0.9;
pub const BETA2: f32 = 0.999;
pub const ADAM_EPS: f32 = 1e-8;

/// Shapes of the four parameters `w1, b1, w2, b2`.
pub fn mlp_param_dims() -> [Vec<i64>; 4] {
    [vec![IN, HIDDEN], vec![HIDDEN], vec![HIDDEN, 1], vec![1]]
}

/// Layout of an MLP step over a mesh.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Layout {
    /// One device.
    Single,
    /// Batch split over `data`, parameters and optimizer state replicated.
    DataParallel,
    /// Batch split, and `w1` with its Adam state split on dim 0 (fully sharded).
    Fsdp,
}

/// One training step as ONE program: forward, backward and Adam update.
/// Arguments: `w1 b1 w2 b2, m(x4), v(x4), x [batch, IN], y [batch, 1], t (step, from 1)`.
/// Results: the 12 updated parameter/state tensors (arguments 0..12 donated to them), then the
/// loss (mean squared error).
pub fn mlp_step_program(batch: i64, layout: Layout, devices: usize) -> xla::graph::Program {
    let g = Graph::new(&format!("mlp_step_{layout:?}"));
    let dims = mlp_param_dims();
    let spmd = layout != Layout::Single;
    if spmd {
        g.set_mesh(Mesh::new(&[("data", devices)]));
    }
    let shard_of = |i: usize| -> Option<Sharding> {
        (layout == Layout::Fsdp && i == 0).then(|| Sharding::split(2, 0, "data"))
    };
    let mut state = Vec::new();
    for group in ["", "m_", "v_"] {
        for (i, d) in dims.iter().enumerate() {
            let name = format!("{group}p{i}");
            state.push(match shard_of(i) {
                Some(s) => g.parameter_sharded(&name, DType::F32, d, s),
                None => g.parameter(&name, DType::F32, d),
            });
        }
    }
    let (x, y) = if spmd {
        (
            g.parameter_sharded("x", DType::F32, &[batch, IN], Sharding::split(2, 0, "data")),
            g.parameter_sharded("y", DType::F32, &[batch, 1], Sharding::split(2, 0, "data")),
        )
    } else {
        (
            g.parameter("x", DType::F32, &[batch, IN]),
            g.parameter("y", DType::F32, &[batch, 1]),
        )
    };
    let t = g.parameter("t", DType::F32, &[]);
    let params: Vec<Tensor> = state[..4].to_vec();
    let mut hidden = (&x.matmul(&params[0]) + &params[1]).tanh();
    if spmd {
        hidden = hidden.with_sharding(Sharding::split(2, 0, "data"));
    }
    let pred = &hidden.matmul(&params[2]) + &params[3];
    let diff = &pred - &y;
    let loss = (&diff * &diff).mean_all();
    let grads = grad(&loss, &params.iter().collect::<Vec<_>>()).expect("gradients");
    let bc1 = 1.0 - &g.scalar(BETA1 as f64, DType::F32).pow(&t);
    let bc2 = 1.0 - &g.scalar(BETA2 as f64, DType::F32).pow(&t);
    let mut outs = vec![Tensor::clone(&loss); 12];
    for i in 0..4 {
        let (p, m, v, gr) = (&state[i], &state[4 + i], &state[8 + i], &grads[i]);
        let m2 = &(m * BETA1 as f64) + &(gr * (1.0 - BETA1 as f64));
        let v2 = &(v * BETA2 as f64) + &(&(gr * gr) * (1.0 - BETA2 as f64));
        let mhat = &m2 / &bc1;
        let vhat = &v2 / &bc2;
        let p2 = p - &(&(&mhat * LR as f64) / &(&vhat.sqrt() + ADAM_EPS as f64));
        outs[i] = p2;
        outs[4 + i] = m2;
        outs[8 + i] = v2;
    }
    outs.push(loss);
    let mut options = BuildOptions::donating(&(0..12).map(|i| (i, i)).collect::<Vec<_>>());
    // w1 and its Adam moments keep their sharding in the results.
    if let Some(s) = shard_of(0) {
        for r in [0usize, 4, 8] {
            options.result_shardings.push((r, s.clone()));
        }
    }
    g.build_with(&outs.iter().collect::<Vec<_>>(), &options)
        .expect("build the MLP step")
}

/// Deterministic data and initial parameters for the MLP tests: `(params, x, y)`.
pub fn mlp_problem(batch: usize) -> (Vec<Vec<f32>>, Vec<f32>, Vec<f32>) {
    let mut r = StdRng::seed_from_u64(7);
    let mut init = |n: usize, scale: f64| -> Vec<f32> {
        (0..n)
            .map(|_| (r.random_range(-1.0..1.0) * scale) as f32)
            .collect()
    };
    let params = vec![
        init((IN * HIDDEN) as usize, 1.0 / (IN as f64).sqrt()),
        init(HIDDEN as usize, 0.1),
        init(HIDDEN as usize, 1.0 / (HIDDEN as f64).sqrt()),
        init(1, 0.1),
    ];
    let a = init(IN as usize, 1.0);
    let x = init(batch * IN as usize, 1.0);
    let y: Vec<f32> = (0..batch)
        .map(|b| {
            let s: f32 = (0..IN as usize).map(|i| x[b * IN as usize + i] * a[i]).sum();
            s.sin() + 0.3 * s * s / IN as f32
        })
        .collect();
    (params, x, y)
}

/// Plain Rust f32 reference of one step of the same MLP and Adam; returns the loss before the
/// update.
pub fn mlp_reference_step(
    p: &mut [Vec<f32>],
    m: &mut [Vec<f32>],
    v: &mut [Vec<f32>],
    x: &[f32],
    y: &[f32],
    t: i32,
) -> f32 {
    let (inp, hid) = (IN as usize, HIDDEN as usize);
    let batch = y.len();
    let mut grads: Vec<Vec<f32>> = p.iter().map(|q| vec![0.0; q.len()]).collect();
    let mut loss = 0.0f32;
    for b in 0..batch {
        let xb = &x[b * inp..(b + 1) * inp];
        let h: Vec<f32> = (0..hid)
            .map(|j| ((0..inp).map(|i| xb[i] * p[0][i * hid + j]).sum::<f32>() + p[1][j]).tanh())
            .collect();
        let pred = (0..hid).map(|j| h[j] * p[2][j]).sum::<f32>() + p[3][0];
        let d = pred - y[b];
        loss += d * d;
        let gp = 2.0 * d / batch as f32;
        grads[3][0] += gp;
        for j in 0..hid {
            grads[2][j] += gp * h[j];
            let gh = gp * p[2][j] * (1.0 - h[j] * h[j]);
            grads[1][j] += gh;
            for i in 0..inp {
                grads[0][i * hid + j] += gh * xb[i];
            }
        }
    }
    let bc1 = 1.0 - BETA1.powi(t);
    let bc2 = 1.0 - BETA2.powi(t);
    for k in 0..4 {
        for e in 0..p[k].len() {
            let gr = grads[k][e];
            m[k][e] = BETA1 * m[k][e] + (1.0 - BETA1) * gr;
            v[k][e] = BETA2 * v[k][e] + (1.0 - BETA2) * gr * gr;
            let mhat = m[k][e] / bc1;
            let vhat = v[k][e] / bc2;
            p[k][e] -= LR * mhat / (vhat.sqrt() + ADAM_EPS);
        }
    }
    loss / batch as f32
}
