//! Shared helpers for the trainer's integration tests: one CPU client per test binary, a way to
//! evaluate a traced function on host arrays, a tiny hand-made policy and a seeded generator.
#![allow(dead_code)]

pub use testkit::client;
use xla::graph::{Graph, Tensor};
use xla::runtime::Buffer;
use xla::DType;

/// A host input of [`eval`].
pub enum In<'a> {
    /// f64 values and dims.
    F64(&'a [f64], &'a [i64]),
    /// f32 values and dims.
    F32(&'a [f32], &'a [i64]),
    /// i32 values and dims.
    I32(&'a [i32], &'a [i64]),
}

/// Declares one parameter per input, calls `f`, compiles and runs the program, and returns
/// every output converted to f64.
pub fn eval(inputs: &[In], f: impl FnOnce(&Graph, &[Tensor]) -> Vec<Tensor>) -> Vec<Vec<f64>> {
    let g = Graph::new("test");
    let mut bufs: Vec<Buffer> = Vec::new();
    let mut params = Vec::new();
    for (i, input) in inputs.iter().enumerate() {
        let name = format!("in{i}");
        let (t, b) = match input {
            In::F64(v, d) => (
                g.parameter(&name, DType::F64, d),
                client().buffer_from_host(v, d, 0),
            ),
            In::F32(v, d) => (
                g.parameter(&name, DType::F32, d),
                client().buffer_from_host(v, d, 0),
            ),
            In::I32(v, d) => (
                g.parameter(&name, DType::I32, d),
                client().buffer_from_host(v, d, 0),
            ),
        };
        params.push(t);
        bufs.push(b.expect("upload"));
    }
    let outs = f(&g, &params);
    let refs: Vec<&Tensor> = outs.iter().collect();
    let program = g.build(&refs).unwrap_or_else(|e| panic!("build: {e}"));
    let exe = program
        .compile(client())
        .unwrap_or_else(|e| panic!("compile: {e}\n{}", program.mlir()));
    let args: Vec<&Buffer> = bufs.iter().collect();
    let results = exe.execute(&args).expect("execute");
    results
        .iter()
        .zip(&outs)
        .map(|(b, t)| match t.dtype() {
            DType::F64 => b.to_host::<f64>().unwrap(),
            DType::F32 => b
                .to_host::<f32>()
                .unwrap()
                .into_iter()
                .map(|x| x as f64)
                .collect(),
            other => panic!("eval: output of type {other}"),
        })
        .collect()
}

/// Asserts `|a - b| <= tol * max(1, |b|)` element-wise, naming the first offender.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: lengths differ: {got:?} vs {want:?}"
    );
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "{what}: element {i}: got {a}, want {b} (tolerance {tol})\n got {got:?}\nwant {want:?}"
        );
    }
}

/// A small deterministic generator (SplitMix64) so tests need no `rand` dependency.
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }

    /// `n` uniforms.
    pub fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    /// Uniform integer in `[0, n)`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// The tiny policy of the tests: token embeddings `emb [vocab, hidden]`, `tanh`, an output
/// projection `out [hidden, vocab]`; inputs are the context token ids `[batch, len]` and the
/// response tokens `[batch, len]` (i32). Returns per-token log-probs and entropy.
pub fn tiny_policy(params: &[Tensor], batch: &[Tensor]) -> (Tensor, Tensor) {
    let (emb, out) = (&params[0], &params[1]);
    let hidden = emb.take(&batch[0], 0).tanh();
    let logits = hidden
        .matmul(out)
        .convert_if_needed(if out.dtype() == DType::BF16 {
            DType::F32
        } else {
            out.dtype()
        });
    (logits.token_log_probs(&batch[1]), logits.entropy())
}

/// The tiny Llama of the update tests: a 23-token vocabulary, 32 positions.
pub fn tiny_llama() -> model::ModelConfig {
    testkit::TinyLlama {
        vocab: 23,
        max_positions: 32,
        ..testkit::TinyLlama::default()
    }
    .config()
}

/// The tiny Qwen3-MoE fixture's architecture (`model/fixtures/tiny/qwen3_moe`: 8 experts, top 2,
/// layers 0 and 2 sparse, layer 1 dense).
pub fn tiny_qwen3_moe() -> model::ModelConfig {
    let path = format!(
        "{}/../model/fixtures/tiny/qwen3_moe/config.json",
        env!("CARGO_MANIFEST_DIR")
    );
    model::ModelConfig::from_hf_file(std::path::Path::new(&path)).unwrap()
}
