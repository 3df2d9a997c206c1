//! Where the time of one rollout decode step goes: compiles variants of the decode program
//! for the real model and times them in alternating rounds (so machine load hits all of them
//! alike), reporting the median per variant.
//!
//!     cargo run --release -p rollout --example decode_profile -- \
//!         [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--seqs 64] [--max-len 384] \
//!         [--position 120] [--rounds 7] [--dtype f32|bf16] [--kv-dtype auto|f32] \
//!         [--variants engine,argmax,skip-write,...]
//!
//! Variants: `engine` (the engine's decode + sampler: scattered write, attention over the
//! whole cache), `argmax` (no sampler: the head's argmax), `no-head` (no output head and no
//! sampler), `skip-write` (no cache write), `update-slice` (the write as one
//! dynamic_update_slice per slot), `attend-N` (attention over the first N positions), `mulred`
//! (attention by multiply + reduce instead of batched dots), `keys-left` (the cache as the
//! left operand of the attention products), `gumbel` (the Gumbel-max sampler); join them
//! with `+`. `chunks-K`: the step over a cache in chunks of `--chunk` positions reading the
//! first K chunks; `prefill-B`: one prefill run of B prompts of `--prompt-len` tokens.

use std::path::PathBuf;
use std::time::Instant;

use model::forward::{
    decode_graph_with, decode_hidden_graph, DecodeAttention, DecodeOptions, DecoderParams, KvWrite,
};
use model::programs::HostModel;
use rollout::layout::CacheShape;
use rollout::programs::{run_donating, DecodeInputs, DecodeSample, PrefillFanout};
use rollout::sampling::SamplerKind;
use rollout::upload_weights;
use xla::graph::{BuildOptions, DotDims, Graph, Tensor};
use xla::runtime::{Buffer, Client, Executable};
use xla::DType;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

/// CPU time of every thread of this process so far (seconds, from
/// `/proc/self/task/*/schedstat`): the work done, whatever the machine's load.
fn cpu_seconds() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .sum::<f64>()
        * 1e-9
}

enum Variant {
    Sampled(DecodeSample),
    Raw(Executable),
    /// A decode step over the chunked cache.
    Chunked(DecodeSample),
    /// A prefill of this many prompts of `--prompt-len` tokens (time per run).
    Prefill(PrefillFanout),
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model_path = PathBuf::from(arg(&args, "--model", "models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let seqs: usize = arg(&args, "--seqs", "64").parse().unwrap();
    let max_len: usize = arg(&args, "--max-len", "384").parse().unwrap();
    let position: i32 = arg(&args, "--position", "120").parse().unwrap();
    let rounds: usize = arg(&args, "--rounds", "7").parse().unwrap();
    let dtype: DType = arg(&args, "--dtype", "f32")
        .parse()
        .unwrap_or_else(|e| panic!("--dtype: {e}"));
    let names: Vec<String> = arg(
        &args,
        "--variants",
        "engine,argmax,no-head,skip-write,update-slice,attend-256,attend-128",
    )
    .split(',')
    .map(str::to_string)
    .collect();

    let host = HostModel::load(&model_path).expect("loading the model");
    let config = host.weights.config.clone();
    let client = Client::cpu(1).expect("CPU plugin");
    let weights = upload_weights(&client, &host.weights, dtype, 0).unwrap();
    // The engine's cache type for these weights, or f32 with `--kv-dtype f32`.
    let cache_type = |mut shape: CacheShape| {
        shape = shape.for_weights(dtype);
        if arg(&args, "--kv-dtype", "auto") == "f32" {
            shape.dtype = DType::F32;
        }
        shape
    };
    let shape = cache_type(CacheShape::new(&config, seqs, max_len));
    println!(
        "KV cache: {} ({:.0} MiB)",
        shape.dtype,
        shape.bytes() as f64 / (1 << 20) as f64
    );
    let mut cache = shape.allocate(&client, 0).unwrap();
    let chunk: usize = arg(&args, "--chunk", "64").parse().unwrap();
    let prompt_len: usize = arg(&args, "--prompt-len", "127").parse().unwrap();
    let chunked_shape = cache_type(CacheShape::chunked(&config, seqs, max_len, chunk));
    let mut chunked_cache = chunked_shape.allocate(&client, 0).unwrap();

    let s = seqs as i64;
    let raw = |name: &str, head: bool| -> Executable {
        let g = Graph::new(&format!("profile_{}", name.replace('-', "_")));
        let p = DecoderParams::declare(&g, &config, dtype);
        let kv = shape.declare(&g);
        let tokens = g.parameter("tokens", DType::I32, &[s]);
        let positions = g.parameter("positions", DType::I32, &[s]);
        let (out, new_cache) = if name == "gemms" {
            // The trunk's matrix products alone (no norms, attention, RoPE or cache work).
            let mut h = p.embed.take(&tokens, 0).convert_if_needed(DType::F32);
            for layer in &p.layers {
                let q = h.linear(&layer.q_proj);
                let k = h.linear(&layer.k_proj);
                let v = h.linear(&layer.v_proj);
                let kv = Tensor::concat(&[&k, &v, &k], 1);
                let a = (&q + &kv).linear(&layer.o_proj);
                let model::forward::Mlp::Dense {
                    gate_proj,
                    up_proj,
                    down_proj,
                } = &layer.mlp
                else {
                    panic!("the profile's GEMM breakdown is of dense models");
                };
                let gate = a.linear(gate_proj);
                let up = a.linear(up_proj);
                h = &h + &(&gate * &up).linear(down_proj);
            }
            (h.reduce_sum(&[1]), kv.clone())
        } else if name == "attn-nt" || name == "attn-nn" {
            // The attention products alone, every layer over its whole cache: `nt` as the
            // decode step has them (keys [L, hd], contracted on their minor dimension), `nn`
            // with the keys read as if stored transposed ([hd, L]: the same bytes reshaped, so
            // the values are meaningless but the work is that of a transposed key layout).
            let (kvh, hd) = (config.num_key_value_heads as i64, config.head_dim as i64);
            let groups = (config.num_attention_heads / config.num_key_value_heads) as i64;
            let l = max_len as i64;
            let operand = kv[0].dtype();
            let h = p.embed.take(&tokens, 0).convert_if_needed(DType::F32);
            let q = h
                .linear(&p.layers[0].q_proj)
                .reshape(&[s, kvh, groups, hd])
                .convert_if_needed(operand);
            let mut acc: Option<Tensor> = None;
            for layer in 0..config.num_hidden_layers {
                let (k, v) = (&kv[2 * layer], &kv[2 * layer + 1]);
                // Keys [S, kvh, L, hd] contracted on hd (axis 3), or read as [S, kvh, hd, L] (axis 2).
                let (keys, key_axis) = if name == "attn-nt" {
                    (k.clone(), 3)
                } else {
                    (k.reshape(&[s, kvh, hd, l]), 2)
                };
                let scores = q.dot_general(
                    &keys,
                    DotDims {
                        lhs_batch: vec![0, 1],
                        rhs_batch: vec![0, 1],
                        lhs_contract: vec![3],
                        rhs_contract: vec![key_axis],
                    },
                    Some(DType::F32),
                );
                let probs = scores.softmax(-1).convert_if_needed(operand);
                let out = probs.dot_general(
                    v,
                    DotDims {
                        lhs_batch: vec![0, 1],
                        rhs_batch: vec![0, 1],
                        lhs_contract: vec![3],
                        rhs_contract: vec![2],
                    },
                    Some(DType::F32),
                );
                acc = Some(match acc {
                    Some(a) => &a + &out,
                    None => out,
                });
            }
            (acc.unwrap().reduce_sum(&[1, 2, 3]), kv.clone())
        } else if name == "head-t" {
            // The head as W [V, hidden] x h^T: logits transposed [V, S].
            let (h, c, _) = decode_hidden_graph(&p, &tokens, &positions, &kv, DecodeOptions::default());
            let logits_t = p.head().dot_general(
                &h.convert_if_needed(p.head().dtype()),
                DotDims {
                    lhs_contract: vec![1],
                    rhs_contract: vec![1],
                    ..Default::default()
                },
                Some(DType::F32),
            );
            (logits_t.argmax(0), c)
        } else if head {
            let (logits, c) = decode_graph_with(&p, &tokens, &positions, &kv, DecodeOptions::default());
            (logits.argmax(-1), c)
        } else {
            let (h, c, _) = decode_hidden_graph(&p, &tokens, &positions, &kv, DecodeOptions::default());
            (h.reduce_sum(&[1]), c)
        };
        let mut outs = vec![&out];
        outs.extend(new_cache.iter());
        let pairs: Vec<(usize, usize)> = (0..kv.len()).map(|i| (p.all.len() + i, 1 + i)).collect();
        g.build_with(&outs, &BuildOptions::donating(&pairs))
            .unwrap()
            .compile(&client)
            .unwrap()
    };
    let mut variants: Vec<(String, Variant)> = Vec::new();
    for name in &names {
        let t = Instant::now();
        let v = match name.as_str() {
            "argmax" => Variant::Raw(raw(name, true)),
            "gemms" | "head-t" | "attn-nt" | "attn-nn" => Variant::Raw(raw(name, false)),
            c if c.starts_with("chunks-") => Variant::Chunked(
                DecodeSample::compile_chunked(
                    &client,
                    &config,
                    dtype,
                    &chunked_shape,
                    false,
                    c["chunks-".len()..].parse().unwrap(),
                    SamplerKind::default(),
                )
                .unwrap(),
            ),
            b if b.starts_with("prefill-") => Variant::Prefill(
                PrefillFanout::compile_batched(
                    &client,
                    &config,
                    dtype,
                    &chunked_shape,
                    prompt_len,
                    1,
                    b["prefill-".len()..].parse().unwrap(),
                )
                .unwrap(),
            ),
            "no-head" => Variant::Raw(raw(name, false)),
            other => {
                let mut options = DecodeOptions::default();
                let mut sampler = SamplerKind::default();
                for part in other.split('+') {
                    match part {
                        "engine" => {}
                        "skip-write" => options.kv_write = KvWrite::Skip,
                        "update-slice" => options.kv_write = KvWrite::UpdateSlice,
                        "mulred" => options.attention = DecodeAttention::MultiplyReduce,
                        "keys-left" => options.attention = DecodeAttention::KeysLeft,
                        "gumbel" => sampler = SamplerKind::GumbelMax,
                        a if a.starts_with("attend-") => {
                            options.attend_len = Some(a["attend-".len()..].parse().unwrap())
                        }
                        unknown => panic!("unknown variant {unknown}"),
                    }
                }
                Variant::Sampled(
                    DecodeSample::compile_with(&client, &config, dtype, &shape, false, options, sampler)
                        .unwrap(),
                )
            }
        };
        println!("compiled {name} in {:.1} s", t.elapsed().as_secs_f64());
        variants.push((name.clone(), v));
    }

    let inputs = DecodeInputs {
        tokens: (0..seqs as i32).map(|i| 100 + i).collect(),
        positions: vec![position; seqs],
        temperature: vec![1.0; seqs],
        top_k: vec![0; seqs],
        top_p: vec![1.0; seqs],
        min_p: vec![0.0; seqs],
        keys: (0..2 * seqs as u32).collect(),
    };
    let tb = client.buffer_from_host(&inputs.tokens, &[s], 0).unwrap();
    let pb = client.buffer_from_host(&inputs.positions, &[s], 0).unwrap();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..rounds + 1 {
        for (i, (_, v)) in variants.iter().enumerate() {
            let t = Instant::now();
            let c = cpu_seconds();
            match v {
                Variant::Sampled(d) => {
                    d.run(&client, 0, &weights, &mut cache, &inputs).unwrap();
                }
                Variant::Chunked(d) => {
                    d.run(&client, 0, &weights, &mut chunked_cache, &inputs).unwrap();
                }
                Variant::Prefill(p) => {
                    let ids: Vec<u32> = (0..prompt_len as u32).map(|i| 100 + i).collect();
                    let slots: Vec<[usize; 1]> = (0..p.batch).map(|b| [b]).collect();
                    let prompts: Vec<(&[u32], &[usize])> =
                        slots.iter().map(|s| (ids.as_slice(), s.as_slice())).collect();
                    p.run_batch(&client, 0, &weights, &mut chunked_cache, &prompts)
                        .unwrap();
                    chunked_cache[0].block_until_ready().unwrap();
                }
                Variant::Raw(exe) => {
                    let out: Vec<Buffer> =
                        run_donating(exe, &weights, &mut cache, &[&tb, &pb], 1, "profile").unwrap();
                    out[0].block_until_ready().unwrap();
                }
            }
            if round > 0 {
                times[i].push(t.elapsed().as_secs_f64());
                cpu[i].push(cpu_seconds() - c);
            }
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "{seqs} slots x {max_len} positions, every slot at position {position}, {rounds} alternating rounds, load {}",
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    for (((name, _), mut t), mut c) in variants.iter().zip(times).zip(cpu) {
        t.sort_by(|a, b| a.partial_cmp(b).unwrap());
        c.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "{name:>14}: wall median {:7.1} ms  min {:7.1} ms | CPU median {:7.1} ms  min {:7.1} ms",
            t[t.len() / 2] * 1e3,
            t[0] * 1e3,
            c[c.len() / 2] * 1e3,
            c[0] * 1e3
        );
    }
}
