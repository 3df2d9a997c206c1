//! How a decode step's KV-cache write costs on TPU, by libtpu's cost analysis (deviceless): a
//! 4-layer attention over 4 chunks of `bf16[256 slots, 2 KV heads, 256 positions, 64]` per
//! layer and K/V (the shipped Qwen2.5-0.5B recipe's shapes), with the new rows written by each
//! variant, the cache donated. Prints bytes accessed (and as a multiple of the cache's bytes)
//! and temporaries. BENCHMARKS.md ("Where the decode step's bytes go") records its results.
//!
//!     cargo run --release -p xla --example kv_write_probe -- v6e:2x2 skip scatter4d select dus
//!
//! Variants: `skip` (no write: attention alone), `scatter4d` (a scatter to (slot, position),
//! `Tensor::scatter_at`), `select` (the masked rewrite, `KvWrite::Masked`), `dus` (one
//! dynamic-update-slice at a column shared by every slot, into the first chunk only: what a
//! shared write column would cost); a `-slh` suffix lays the cache out `[S, L, kvh, hd]`, a
//! `-kt` one stores keys transposed `[S, kvh, hd, L]`. `PROBE_LK` / `PROBE_LV` pin the layout
//! of the key / value arguments and results (`mhlo.layout_mode`, e.g. `{3,2,1,0}`); without
//! them libtpu picks (positions minor for a 64-wide head).
use xla::graph::{BuildOptions, DotDims, Graph, Tensor};
use xla::runtime::tpu::{load_libtpu, TopologyOptions, TpuCompileOutcome};
use xla::runtime::{compile_for_topology_with, CompileOptions};
use xla::DType;

const S: i64 = 256;
const KVH: i64 = 2;
const G: i64 = 7;
const HD: i64 = 64;
const CH: i64 = 256;
const C: i64 = 4;
const LAYERS: usize = 4;

fn scores(q: &Tensor, k: &Tensor, layout_slh: bool) -> Tensor {
    // q [S, kvh, G, hd]; k [S, kvh, CH, hd] or [S, CH, kvh, hd]
    let dims = if layout_slh {
        DotDims {
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 2],
            lhs_contract: vec![3],
            rhs_contract: vec![3],
        }
    } else {
        DotDims {
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 1],
            lhs_contract: vec![3],
            rhs_contract: vec![3],
        }
    };
    q.dot_general(k, dims, Some(DType::F32))
}

fn values(p: &Tensor, v: &Tensor, layout_slh: bool) -> Tensor {
    // p [S, kvh, G, CH]
    let dims = if layout_slh {
        DotDims {
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 2],
            lhs_contract: vec![3],
            rhs_contract: vec![1],
        }
    } else {
        DotDims {
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 1],
            lhs_contract: vec![3],
            rhs_contract: vec![2],
        }
    };
    p.dot_general(v, dims, Some(DType::F32))
}

fn build(variant: &str) -> String {
    let g = Graph::new(&format!("probe_{}", variant.replace('-', "_")));
    let slh = variant.ends_with("slh");
    let kt = variant.contains("kt");
    let cdims: Vec<i64> = if slh {
        vec![S, CH, KVH, HD]
    } else {
        vec![S, KVH, CH, HD]
    };
    let kdims: Vec<i64> = if kt { vec![S, KVH, HD, CH] } else { cdims.clone() };
    let mut cache = Vec::new();
    for l in 0..LAYERS {
        for w in ["k", "v"] {
            for c in 0..C {
                let d = if w == "k" { &kdims } else { &cdims };
                cache.push(g.parameter(&format!("{w}{l}_{c}"), DType::BF16, d));
            }
        }
    }
    let q0 = g.parameter("q", DType::F32, &[S, KVH, G, HD]);
    let newkv = g.parameter("new", DType::F32, &[S, KVH, HD]);
    let pos = g.parameter("pos", DType::I32, &[S]);
    let col = g.parameter("col", DType::I32, &[]);
    let mut q = q0.clone();
    let mut out = cache.clone();
    for l in 0..LAYERS {
        let base = l * 2 * C as usize;
        let new = (&newkv + &q.reduce_sum(&[2]).scalar_like(0.0)).convert(DType::BF16);
        for w in 0..2usize {
            for c in 0..C {
                let at = base + w * C as usize + c as usize;
                let old = &cache[at];
                let start = g.full((c * CH) as f64, DType::I32, &[S]);
                let local = &pos - &start;
                let beyond = g.full(CH as f64, DType::I32, &[S]);
                let inside = local.ge(&local.zeros_like()).and(&local.lt(&beyond));
                let local = inside.select(&local, &beyond);
                out[at] = match variant {
                    v if v.starts_with("skip") => old.clone(),
                    "scatter4d" | "scatter4d-slh" | "scatter4d-kt" => {
                        let slots = g.iota(DType::I32, &[S, 1], 0);
                        let pts = Tensor::concat(&[&slots, &local.reshape(&[S, 1])], 1);
                        let axes: &[usize] = if slh {
                            &[0, 1]
                        } else if kt && w == 0 {
                            &[0, 3]
                        } else {
                            &[0, 2]
                        };
                        old.scatter_at(&pts, &new, axes)
                    }
                    "select" => {
                        let hit = g
                            .iota(DType::I32, &[S, KVH, CH, HD], 2)
                            .eq(&local.reshape(&[S, 1, 1, 1]).broadcast_to(&[S, KVH, CH, HD]));
                        let nb = new.reshape(&[S, KVH, 1, HD]).broadcast_to(&[S, KVH, CH, HD]);
                        hit.select(&nb, old)
                    }
                    "dus" => {
                        if c == 0 {
                            let z = g.scalar(0.0, DType::I32);
                            old.dynamic_update_slice(&new.reshape(&[S, KVH, 1, HD]), &[&z, &z, &col, &z])
                        } else {
                            old.clone()
                        }
                    }
                    _ => panic!("{variant}"),
                };
            }
        }
        let qb = q.convert(DType::BF16);
        let sc: Vec<Tensor> = (0..C as usize)
            .map(|c| {
                if kt {
                    let dims = DotDims {
                        lhs_batch: vec![0, 1],
                        rhs_batch: vec![0, 1],
                        lhs_contract: vec![3],
                        rhs_contract: vec![2],
                    };
                    qb.dot_general(&out[base + c], dims, Some(DType::F32))
                } else {
                    scores(&qb, &out[base + c], slh)
                }
            })
            .collect();
        let probs = Tensor::concat(&sc.iter().collect::<Vec<_>>(), 3)
            .softmax(-1)
            .convert(DType::BF16);
        let mut attn: Option<Tensor> = None;
        for c in 0..C {
            let pc = probs.slice_axis(3, c * CH, (c + 1) * CH);
            let part = values(&pc, &out[base + C as usize + c as usize], slh);
            attn = Some(match attn {
                Some(a) => &a + &part,
                None => part,
            });
        }
        q = attn.unwrap().tanh();
    }
    let mut outs: Vec<&Tensor> = out.iter().collect();
    outs.push(&q);
    let donate: Vec<(usize, usize)> = (0..cache.len()).map(|i| (i, i)).collect();
    g.build_with(&outs, &BuildOptions::donating(&donate))
        .unwrap()
        .mlir()
        .to_string()
}

/// Adds `mhlo.layout_mode` to the cache arguments and results: keys get `lk`, values `lv`.
fn patch_layouts(mlir: &str, lk: Option<&str>, lv: Option<&str>) -> String {
    let n = LAYERS * 2 * C as usize;
    let layout = |i: usize| {
        if (i / C as usize).is_multiple_of(2) {
            lk
        } else {
            lv
        }
    };
    let head = mlir.find("@main(").unwrap();
    let arrow = mlir[head..].find(") -> (").unwrap() + head;
    let body = mlir[arrow..].find(" {\n").unwrap() + arrow;
    let args = &mlir[head..arrow];
    let mut out_args = String::new();
    let mut rest = args;
    for i in 0..n {
        let tag = format!("%arg{i}: ");
        let at = rest.find(&tag).unwrap();
        let close = rest[at..].find('>').unwrap() + at + 1;
        out_args.push_str(&rest[..close]);
        if let Some(l) = layout(i) {
            if let Some(attrs) = rest[close..].strip_prefix(" {") {
                out_args.push_str(&format!(" {{mhlo.layout_mode = \"{l}\", "));
                rest = attrs;
                continue;
            }
            out_args.push_str(&format!(" {{mhlo.layout_mode = \"{l}\"}}"));
        }
        rest = &rest[close..];
    }
    out_args.push_str(rest);
    let results = &mlir[arrow + 6..body];
    let mut out_res = String::new();
    let mut rest = results;
    for i in 0..n {
        let at = rest.find("tensor<").unwrap();
        let close = rest[at..].find('>').unwrap() + at + 1;
        out_res.push_str(&rest[..close]);
        if let Some(l) = layout(i) {
            out_res.push_str(&format!(" {{mhlo.layout_mode = \"{l}\"}}"));
        }
        rest = &rest[close..];
    }
    out_res.push_str(rest);
    format!("{}{}) -> ({}{}", &mlir[..head], out_args, out_res, &mlir[body..])
}

fn main() {
    let topology = std::env::args().nth(1).unwrap_or("v6e:2x2".into());
    let tpu = load_libtpu(None).unwrap();
    let cache_bytes = (LAYERS as i64 * 2 * C * S * KVH * CH * HD * 2) as f64;
    for variant in std::env::args().skip(2) {
        let mut mlir = build(&variant);
        let lk = std::env::var("PROBE_LK").ok();
        let lv = std::env::var("PROBE_LV").ok();
        if lk.is_some() || lv.is_some() {
            mlir = patch_layouts(&mlir, lk.as_deref(), lv.as_deref());
        }
        let opts = CompileOptions {
            num_partitions: 1,
            donated_args: (0..LAYERS * 2 * C as usize).collect(),
        };
        let r =
            compile_for_topology_with(&tpu, &mlir, &topology, &TopologyOptions::default(), &opts).unwrap();
        match r.outcome {
            TpuCompileOutcome::Fits { memory, cost, .. } => println!(
                "{variant:14} bytes {:.2} GB = {:.2}x cache  temp {:.2} GB  {:.1}s",
                cost.bytes_accessed.unwrap_or(0.0) / 1e9,
                cost.bytes_accessed.unwrap_or(0.0) / cache_bytes,
                memory.temp_bytes as f64 / 1e9,
                r.compile_seconds
            ),
            o => println!("{variant}: {o:?}"),
        }
    }
}
