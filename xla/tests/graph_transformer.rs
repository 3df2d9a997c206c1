//! A tiny Llama-style decoder layer (embedding, RMSNorm, RoPE attention with a causal mask,
//! SwiGLU MLP, tied output head, next-token cross-entropy) written with the graph API, its
//! gradient with respect to every parameter, and a finite-difference check of sampled
//! gradient elements in f64. This is the shape of code the model crate builds on.

mod graph_support;

use graph_support::{compile, read, rng, uniform, upload};
use rand::Rng;
use xla::graph::{grad, DotDims, Graph, Tensor};
use xla::DType;

const B: i64 = 2;
const T: i64 = 5;
const V: i64 = 11;
const D: i64 = 8;
const H: i64 = 2;
const HD: i64 = D / H;
const F: i64 = 12;

/// Parameter names and shapes.
fn param_specs() -> Vec<(&'static str, Vec<i64>)> {
    vec![
        ("embed", vec![V, D]),
        ("norm1", vec![D]),
        ("wq", vec![D, D]),
        ("wk", vec![D, D]),
        ("wv", vec![D, D]),
        ("wo", vec![D, D]),
        ("norm2", vec![D]),
        ("w_gate", vec![D, F]),
        ("w_up", vec![D, F]),
        ("w_down", vec![F, D]),
        ("norm_final", vec![D]),
    ]
}

/// The program arguments: token ids, then the parameters.
fn with_ids<'a>(
    ids: &'a xla::runtime::Buffer,
    bufs: &'a [xla::runtime::Buffer],
) -> Vec<&'a xla::runtime::Buffer> {
    let mut a = vec![ids];
    a.extend(bufs.iter());
    a
}

/// `[B, T, D] -> [B, H, T, HD]`
fn heads(x: &Tensor) -> Tensor {
    x.reshape(&[B, T, H, HD]).transpose(&[0, 2, 1, 3])
}

fn decoder_loss(g: &Graph, ids: &Tensor, p: &[Tensor]) -> Tensor {
    let dtype = p[0].dtype();
    let h = p[0].take(ids, 0);
    // RoPE tables from positions and inverse frequencies.
    let pos = g.iota(dtype, &[T, HD / 2], 0);
    let inv_freq: Vec<f64> = (0..HD / 2)
        .map(|i| 10000f64.powf(-2.0 * i as f64 / HD as f64))
        .collect();
    let angles = &pos * &g.constant_f64(&inv_freq, dtype, &[HD / 2]);
    let angles = Tensor::concat(&[&angles, &angles], 1);
    let (cos, sin) = (angles.cos(), angles.sin());

    let n1 = h.rms_norm(&p[1], 1e-5);
    let q = heads(&n1.matmul(&p[2])).rope(&cos, &sin);
    let k = heads(&n1.matmul(&p[3])).rope(&cos, &sin);
    let v = heads(&n1.matmul(&p[4]));
    let batch = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        ..Default::default()
    };
    let scores = &q.dot_general(
        &k,
        DotDims {
            lhs_contract: vec![3],
            rhs_contract: vec![3],
            ..batch.clone()
        },
        None,
    ) * (1.0 / (HD as f64).sqrt());
    let causal = g.iota(DType::I32, &[T, T], 0).ge(&g.iota(DType::I32, &[T, T], 1));
    let masked = causal.select(&scores, &scores.full_like(-1e9));
    let probs = masked.softmax(-1);
    let attn = probs.dot_general(
        &v,
        DotDims {
            lhs_contract: vec![3],
            rhs_contract: vec![2],
            ..batch
        },
        None,
    );
    let h2 = &h + &attn.transpose(&[0, 2, 1, 3]).reshape(&[B, T, D]).matmul(&p[5]);

    let n2 = h2.rms_norm(&p[6], 1e-5);
    let mlp = (&n2.matmul(&p[7]).silu() * &n2.matmul(&p[8])).matmul(&p[9]);
    let h3 = &h2 + &mlp;
    // Tied head: contract with the embedding's model dimension directly (no `.t()`, so no
    // transpose forward or backward).
    let head = DotDims {
        lhs_contract: vec![2],
        rhs_contract: vec![1],
        ..Default::default()
    };
    let logits = h3.rms_norm(&p[10], 1e-5).dot_general(&p[0], head, None);
    let inputs = logits.slice_axis(1, 0, T - 1);
    let targets = ids.slice_axis(1, 1, T);
    inputs.cross_entropy(&targets).mean_all()
}

#[test]
fn decoder_layer_gradients_match_finite_differences() {
    let g = Graph::new("decoder_layer");
    let ids = g.parameter("ids", DType::I32, &[B, T]);
    let params: Vec<Tensor> = param_specs()
        .iter()
        .map(|(name, dims)| g.parameter(name, DType::F64, dims))
        .collect();
    let loss = decoder_loss(&g, &ids, &params);
    let grads = grad(&loss, &params.iter().collect::<Vec<_>>()).unwrap();
    let mut outs = vec![&loss];
    outs.extend(grads.iter());
    let program = g.build(&outs).unwrap();
    let text = program.mlir();
    // The projections and attention products need no transposes in the backward pass: the
    // only transposes are the explicit head (un)splits, forward and backward.
    assert_eq!(
        text.matches("stablehlo.transpose").count(),
        3 + 3 + 1 + 1,
        "{text}"
    );
    let exe = compile(&program);
    let loss_exe = compile(&g.build(&[&loss]).unwrap());

    let mut r = rng("decoder");
    let id_values: Vec<i32> = (0..B * T).map(|_| r.random_range(0..V as i32)).collect();
    let values: Vec<Vec<f64>> = param_specs()
        .iter()
        .map(|(name, dims)| {
            let n = dims.iter().product::<i64>() as usize;
            if name.starts_with("norm") {
                uniform(&mut r, n, 0.8, 1.2)
            } else {
                uniform(&mut r, n, -0.5, 0.5)
            }
        })
        .collect();
    let id_buf = upload(&id_values, &[B, T]);
    let mut bufs: Vec<_> = values
        .iter()
        .zip(param_specs())
        .map(|(v, (_, d))| upload(v, &d))
        .collect();
    let out = exe.execute(&with_ids(&id_buf, &bufs)).unwrap();
    let loss_value = read::<f64>(&out[0])[0];
    assert!(loss_value.is_finite() && loss_value > 0.0, "loss {loss_value}");
    let eps = 1e-5;
    for (k, (name, dims)) in param_specs().iter().enumerate() {
        let ad = read::<f64>(&out[1 + k]);
        let scale = ad.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
        for _ in 0..3 {
            let e = r.random_range(0..ad.len());
            let mut eval = |delta: f64| {
                let mut v = values[k].clone();
                v[e] += delta;
                bufs[k] = upload(&v, dims);
                let l = read::<f64>(&loss_exe.execute(&with_ids(&id_buf, &bufs)).unwrap()[0])[0];
                bufs[k] = upload(&values[k], dims);
                l
            };
            let fd = (eval(eps) - eval(-eps)) / (2.0 * eps);
            assert!(
                (ad[e] - fd).abs() <= 1e-5 * scale.max(fd.abs()),
                "{name}[{e}]: autodiff {} vs finite difference {fd}",
                ad[e]
            );
        }
    }
}
