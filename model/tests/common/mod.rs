//! Shared helpers of the integration tests: where the fixtures and the real assets are, and a
//! plain f64 host forward pass used to check loaded weights against transformers' logits.
#![allow(dead_code)]

use std::path::PathBuf;

use model::{Family, ModelWeights};

/// `model/fixtures/` (committed, small).
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// Reads a committed JSON fixture.
pub fn fixture_json(name: &str) -> serde_json::Value {
    let path = fixtures_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn rms_norm(x: &[f64], weight: &[f32], eps: f64) -> Vec<f64> {
    let mean_sq = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let scale = 1.0 / (mean_sq + eps).sqrt();
    x.iter().zip(weight).map(|(v, &w)| v * scale * w as f64).collect()
}

/// `W x (+ b)` for a row-major `[out, in]` matrix.
fn linear(w: &[f32], b: Option<&[f32]>, x: &[f64]) -> Vec<f64> {
    let n_in = x.len();
    (0..w.len() / n_in)
        .map(|o| {
            let row = &w[o * n_in..(o + 1) * n_in];
            let dot: f64 = row.iter().zip(x).map(|(&a, b)| a as f64 * b).sum();
            dot + b.map_or(0.0, |b| b[o] as f64)
        })
        .collect()
}

/// Applies RoPE (transformers' rotate_half layout) to each head of `x` at `pos`.
fn rope(x: &mut [f64], head_dim: usize, inv_freq: &[f64], pos: usize) {
    let half = head_dim / 2;
    for head in x.chunks_mut(head_dim) {
        for i in 0..half {
            let angle = pos as f64 * inv_freq[i];
            let (sin, cos) = angle.sin_cos();
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = b * cos + a * sin;
        }
    }
}

/// Prefill logits of every position (`[T][vocab]`) by a direct f64 evaluation of the decoder
/// as transformers defines it. Slow; for tiny models only.
pub fn reference_logits(w: &ModelWeights, ids: &[u32]) -> Vec<Vec<f64>> {
    let c = &w.config;
    let get = |name: &str| -> Vec<f32> {
        w.get(name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
            .to_f32_vec()
    };
    let opt = |name: &str| w.get(name).map(|t| t.to_f32_vec());
    let (h, hd, nh, nkv) = (
        c.hidden_size,
        c.head_dim,
        c.num_attention_heads,
        c.num_key_value_heads,
    );
    let inv_freq = c.rope_inv_freq();
    let embed = get("model.embed_tokens.weight");
    let mut xs: Vec<Vec<f64>> = ids
        .iter()
        .map(|&t| {
            embed[t as usize * h..(t as usize + 1) * h]
                .iter()
                .map(|&v| v as f64)
                .collect()
        })
        .collect();
    for layer in 0..c.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{layer}.{s}");
        let (wq, wk, wv, wo) = (
            get(&p("self_attn.q_proj.weight")),
            get(&p("self_attn.k_proj.weight")),
            get(&p("self_attn.v_proj.weight")),
            get(&p("self_attn.o_proj.weight")),
        );
        let (bq, bk, bv, bo) = (
            opt(&p("self_attn.q_proj.bias")),
            opt(&p("self_attn.k_proj.bias")),
            opt(&p("self_attn.v_proj.bias")),
            opt(&p("self_attn.o_proj.bias")),
        );
        let (qn, kn) = (
            opt(&p("self_attn.q_norm.weight")),
            opt(&p("self_attn.k_norm.weight")),
        );
        let ln1 = get(&p("input_layernorm.weight"));
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let hn = rms_norm(x, &ln1, c.rms_norm_eps);
            let mut q = linear(&wq, bq.as_deref(), &hn);
            let mut k = linear(&wk, bk.as_deref(), &hn);
            if let (Some(qn), Some(kn)) = (&qn, &kn) {
                q = q
                    .chunks(hd)
                    .flat_map(|head| rms_norm(head, qn, c.rms_norm_eps))
                    .collect();
                k = k
                    .chunks(hd)
                    .flat_map(|head| rms_norm(head, kn, c.rms_norm_eps))
                    .collect();
            }
            rope(&mut q, hd, &inv_freq, pos);
            rope(&mut k, hd, &inv_freq, pos);
            qs.push(q);
            ks.push(k);
            vs.push(linear(&wv, bv.as_deref(), &hn));
        }
        let group = nh / nkv;
        for t in 0..xs.len() {
            let mut attn = vec![0f64; nh * hd];
            for head in 0..nh {
                let kvh = head / group;
                let q = &qs[t][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=t)
                    .map(|s| {
                        q.iter()
                            .zip(&ks[s][kvh * hd..(kvh + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = exps.iter().sum();
                for (s, e) in exps.iter().enumerate() {
                    for d in 0..hd {
                        attn[head * hd + d] += e / total * vs[s][kvh * hd + d];
                    }
                }
            }
            let o = linear(&wo, bo.as_deref(), &attn);
            for (x, o) in xs[t].iter_mut().zip(o) {
                *x += o;
            }
        }
        let ln2 = get(&p("post_attention_layernorm.weight"));
        let (gate, up, down) = (
            get(&p("mlp.gate_proj.weight")),
            get(&p("mlp.up_proj.weight")),
            get(&p("mlp.down_proj.weight")),
        );
        for x in xs.iter_mut() {
            let hn = rms_norm(x, &ln2, c.rms_norm_eps);
            let g = linear(&gate, None, &hn);
            let u = linear(&up, None, &hn);
            let act: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            for (x, d) in x.iter_mut().zip(linear(&down, None, &act)) {
                *x += d;
            }
        }
    }
    let norm = get("model.norm.weight");
    let head = if c.tie_word_embeddings {
        embed
    } else {
        get("lm_head.weight")
    };
    xs.iter()
        .map(|x| linear(&head, None, &rms_norm(x, &norm, c.rms_norm_eps)))
        .collect()
}

/// The families of the committed tiny fixtures, by directory name.
pub const TINY_MODELS: [(&str, Family); 4] = [
    ("llama", Family::Llama),
    ("qwen2", Family::Qwen2),
    ("qwen3", Family::Qwen3),
    ("mistral", Family::Mistral),
];
