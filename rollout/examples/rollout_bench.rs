//! Rollout throughput benchmark: the engine against Hugging Face transformers `generate`
//! (PyTorch CPU, batched) in the same run, on the same prompts and settings.
//!
//!     cargo run --release -p rollout --example rollout_bench -- \
//!         [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--seqs 64] [--prompt-len 128] \
//!         [--new-tokens 256] [--dtype f32|bf16] [--group N] [--no-peer] [--baseline] [--kv-chunk N] \
//!         [--spread] [--slots N]
//!
//! `--group N` (default 1) shapes the work as GRPO does: `seqs / N` distinct prompts with N
//! samples each. The engine prefills each prompt once and copies its KV entries into the N slots
//! (group prefix sharing); the peer passes `num_return_sequences=N` to `generate`, which is how a
//! transformers user (and TRL's `GRPOTrainer` without vLLM) asks for N samples of a prompt.
//!
//! `--baseline` also runs the engine configured as before the speed work (whole cache read
//! every step, one prefill per prompt, Gumbel-max sampler) in the same run; `--kv-chunk`
//! sets the engine's KV-cache chunk (0 = automatic).
//!
//! `--spread` gives the groups GSM8K-like response lengths instead of all `new_tokens`: group
//! i stops at `new_tokens` times the i-th of ten quantiles (0.12 to 1.0, a long tail), and the
//! engine also runs with every slot decoded every step (`compact_slots: false`, the engine
//! before slot buckets) in the same run. transformers cannot end a row early without EOS, so
//! (as TRL's `GRPOTrainer` does with real EOS) it runs the batch to the longest group's
//! length; its rate counts only the tokens the groups asked for.
//!
//! `--slots N` gives the engine N KV-cache slots (`max_num_seqs`, default `--seqs`): a recipe's
//! `max_num_seqs` is often far above the sequences of a step (`recipes/gsm8k-smollm2.yaml`:
//! 128 slots for 2 prompts x 4 samples).
//!
//! Without `--spread` all sequences sample at temperature 1 with no top-k/top-p and ignore
//! EOS, so both sides generate exactly `seqs * new_tokens` tokens. The decode step time is compared with the
//! memory-bandwidth bound: (weight bytes + KV-cache bytes) / bandwidth, the bandwidth measured
//! with a reduction over a 512 MiB buffer through the same plugin.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use model::programs::HostModel;
use rollout::sampling::SamplerKind;
use rollout::{upload_weights, Engine, EngineConfig, GenerationRequest, Sample, SamplingParams};
use xla::graph::Graph;
use xla::runtime::Buffer;
use xla::runtime::Client;
use xla::DType;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn measure_bandwidth(client: &Client) -> f64 {
    let n: i64 = 128 << 20; // 128 Mi f32 = 512 MiB
    let g = Graph::new("bandwidth");
    let x = g.parameter("x", DType::F32, &[n]);
    let s = x.reduce_sum(&[0]);
    let exe = g.build(&[&s]).unwrap().compile(client).unwrap();
    let data = vec![1.0f32; n as usize];
    let buf = client.buffer_from_host(&data, &[n], 0).unwrap();
    drop(data);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let out = exe.execute(&[&buf]).unwrap();
        out[0].to_host::<f32>().unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    (n * 4) as f64 / best
}

/// Median time of the fused sampler alone (temperature, no truncation) on `[slots, vocab]`
/// logits: the share of a decode step spent drawing tokens.
fn measure_sampler(client: &Client, slots: usize, vocab: usize, kind: SamplerKind) -> f64 {
    use rollout::sampling::{sample_graph_with, SamplerInputs};
    let (s, v) = (slots as i64, vocab as i64);
    let g = Graph::new("sampler");
    let logits = g.parameter("logits", DType::F32, &[s, v]);
    let temperature = g.parameter("temperature", DType::F32, &[s]);
    let top_k = g.parameter("top_k", DType::I32, &[s]);
    let top_p = g.parameter("top_p", DType::F32, &[s]);
    let min_p = g.parameter("min_p", DType::F32, &[s]);
    let keys = g.parameter("keys", DType::U32, &[s, 2]);
    let inputs = SamplerInputs {
        temperature: &temperature,
        top_k: &top_k,
        top_p: &top_p,
        min_p: &min_p,
        keys: &keys,
    };
    let (tokens, logprobs) = sample_graph_with(&logits, &inputs, false, kind);
    let exe = g.build(&[&tokens, &logprobs]).unwrap().compile(client).unwrap();
    let values: Vec<f32> = (0..slots * vocab)
        .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
        .collect();
    let lb = client.buffer_from_host(&values, &[s, v], 0).unwrap();
    let tb = client.buffer_from_host(&vec![1.0f32; slots], &[s], 0).unwrap();
    let kb = client.buffer_from_host(&vec![0i32; slots], &[s], 0).unwrap();
    let pb = client.buffer_from_host(&vec![1.0f32; slots], &[s], 0).unwrap();
    let mb = client.buffer_from_host(&vec![0.0f32; slots], &[s], 0).unwrap();
    let keys: Vec<u32> = (0..2 * slots as u32).collect();
    let keyb = client.buffer_from_host(&keys, &[s, 2], 0).unwrap();
    let mut times: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            let out = exe.execute(&[&lb, &tb, &kb, &pb, &mb, &keyb]).unwrap();
            out[0].to_host::<i32>().unwrap();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    times[3]
}

/// CPU time of every thread of this process so far (seconds, from
/// `/proc/self/task/*/schedstat`).
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

/// CPU time of this process's waited-for children (seconds; `/proc/self/stat` cutime +
/// cstime, in clock ticks of 1/100 s).
fn children_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    // After the command name: state is field 3, so cutime (16) and cstime (17) are 13 and 14.
    let tick = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(13) + tick(14)) / 100.0
}

fn main() {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let args: Vec<String> = std::env::args().collect();
    let model_path = PathBuf::from(arg(&args, "--model", "models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let seqs: usize = arg(&args, "--seqs", "64").parse().unwrap();
    let prompt_len: usize = arg(&args, "--prompt-len", "128").parse().unwrap();
    let new_tokens: usize = arg(&args, "--new-tokens", "256").parse().unwrap();
    let dtype: DType = arg(&args, "--dtype", "f32")
        .parse()
        .unwrap_or_else(|e| panic!("--dtype: {e}"));
    let run_peer = !args.iter().any(|a| a == "--no-peer");
    let group: usize = arg(&args, "--group", "1").parse().unwrap();
    assert!(
        group >= 1 && seqs.is_multiple_of(group),
        "--group must divide --seqs ({seqs})"
    );

    let spread = args.iter().any(|a| a == "--spread");
    let slots: usize = arg(&args, "--slots", &seqs.to_string()).parse().unwrap();
    let host = HostModel::load(&model_path).expect("loading the model");
    let config = host.weights.config.clone();
    // Prompts: a fixed text, tokenized and cut/rotated to exactly `prompt_len` tokens each.
    let text = "The history of mathematics spans many centuries and cultures. Early counting systems \
                grew into arithmetic, geometry and algebra, and scholars in Babylon, Egypt, Greece, \
                India, China and the Islamic world each added methods for solving equations, \
                measuring land, predicting the motion of the stars and keeping accounts. ";
    let ids = host.tokenizer.encode(&text.repeat(8), false).unwrap();
    let prompts: Vec<Vec<u32>> = (0..seqs / group)
        .map(|i| ids[i % 17..i % 17 + prompt_len].to_vec())
        .collect();

    let client = Client::cpu(1).expect("CPU plugin");
    let bandwidth = measure_bandwidth(&client);
    let weights: std::sync::Arc<[Buffer]> = upload_weights(&client, &host.weights, dtype, 0).unwrap().into();
    let weight_bytes: usize = weights
        .iter()
        .map(|b| b.element_count() * b.dtype().size_bytes())
        .sum();
    let max_len = prompt_len + new_tokens;
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: new_tokens,
        ..Default::default()
    };
    // The engine as configured by default, then (with --baseline) the engine as it was before
    // the speed work: the whole cache read every step, one prefill per prompt, the Gumbel-max
    // sampler. Same weights, prompts and seeds.
    const QUANTILES: [f64; 10] = [0.12, 0.18, 0.22, 0.27, 0.32, 0.38, 0.45, 0.55, 0.7, 1.0];
    let lengths: Vec<usize> = (0..prompts.len())
        .map(|i| {
            if spread {
                ((new_tokens as f64 * QUANTILES[i % QUANTILES.len()]).round() as usize).max(1)
            } else {
                new_tokens
            }
        })
        .collect();
    let asked: usize = lengths.iter().map(|l| l * group).sum();
    let mut configs = vec![("engine", EngineConfig::new(slots, max_len))];
    if spread {
        let mut every_slot = EngineConfig::new(slots, max_len);
        every_slot.compact_slots = false;
        configs.push(("every-slot", every_slot));
    }
    if args.iter().any(|a| a == "--baseline") {
        let mut old = EngineConfig::new(slots, max_len);
        old.kv_chunk = max_len;
        old.prefill_batch = 1;
        old.sampler = SamplerKind::GumbelMax;
        configs.push(("baseline", old));
    }
    if let Some(chunk) = args.iter().position(|a| a == "--kv-chunk") {
        configs[0].1.kv_chunk = args[chunk + 1].parse().unwrap();
    }
    let mut rates = Vec::new();
    for (label, mut settings) in configs {
        settings.prefill_buckets = vec![prompt_len, max_len];
        let t = Instant::now();
        let mut engine = Engine::new(&client, &config, weights.clone(), 0, settings, None).unwrap();
        let compile_decode = t.elapsed().as_secs_f64();
        let t = Instant::now();
        engine.precompile(prompt_len, group, false).unwrap();
        let compile_prefill = t.elapsed().as_secs_f64();
        for (i, p) in prompts.iter().enumerate() {
            engine
                .submit(GenerationRequest {
                    id: i as u64,
                    prompt: p.clone(),
                    n: group,
                    seed: i as u64,
                    params: SamplingParams {
                        max_new_tokens: lengths[i],
                        ..params.clone()
                    },
                    multi_turn: None,
                })
                .unwrap();
        }
        // The first step prefills every prompt and decodes once; the steps after it are pure
        // decode steps. Compiling happened above and is not timed.
        let start = Instant::now();
        let cpu_start = cpu_seconds();
        let mut step_times = Vec::new();
        let mut samples: Vec<Sample> = Vec::new();
        // Decode step times by the slot rows the step ran (its bucket).
        let mut by_rows: std::collections::BTreeMap<usize, Vec<f64>> = Default::default();
        while engine.has_work() {
            let t = Instant::now();
            let rows = engine.stats().decode_rows;
            samples.extend(engine.step().unwrap());
            step_times.push(t.elapsed().as_secs_f64());
            by_rows
                .entry(engine.stats().decode_rows - rows)
                .or_default()
                .push(t.elapsed().as_secs_f64());
        }
        let total = start.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu_start;
        let generated: usize = samples.iter().map(|s| s.response_ids.len()).sum();
        let mut decode: Vec<f64> = step_times[1..].to_vec();
        decode.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let median_step = decode[decode.len() / 2];
        let first_step = step_times[0];
        let decode_total: f64 = step_times[1..].iter().sum();
        let cache_bytes = engine.kv_cache_bytes();
        let bound = (weight_bytes + cache_bytes) as f64 / bandwidth;
        let stats = engine.stats().clone();
        let n_prompts = prompts.len();
        println!("{label}: {seqs} sequences ({n_prompts} prompts x {group} samples) x {prompt_len} prompt tokens, {new_tokens} new tokens, temperature 1, {dtype:?} weights, {slots} slots");
        println!("{label}: compile decode {compile_decode:.1} s, prefill + other decode steps {compile_prefill:.1} s (not timed); first step ({n_prompts} prefills + 1 decode) {first_step:.1} s");
        println!("{label}: {generated} tokens in {total:.1} s wall (prefill + decode) = {:.1} tok/s; decode-only {:.1} tok/s; CPU time {cpu:.1} s = {:.1} tokens per CPU-second", generated as f64 / total, (generated - seqs) as f64 / decode_total, generated as f64 / cpu);
        println!(
            "{label}: decode step median {:.1} ms over {} steps; {} slot rows run for {} tokens ({:.0}% of the rows made a token), {} cache rows moved",
            median_step * 1e3,
            decode.len(),
            stats.decode_rows,
            stats.generated_tokens,
            100.0 * stats.generated_tokens as f64 / stats.decode_rows.max(1) as f64,
            stats.moved_rows
        );
        let buckets: Vec<String> = by_rows
            .iter_mut()
            .map(|(rows, times)| {
                times.sort_by(|a, b| a.partial_cmp(b).unwrap());
                format!(
                    "{rows} rows: {} steps, median {:.1} ms",
                    times.len(),
                    times[times.len() / 2] * 1e3
                )
            })
            .collect();
        println!("{label}: steps by slot rows run: {}", buckets.join("; "));
        println!(
            "{label}: time in prefill programs {:.1} s ({} runs for {} prompts), in decode programs {:.1} s, host bookkeeping {:.3} s ({:.2} ms per step)",
            stats.prefill_time.as_secs_f64(),
            stats.prefill_batches,
            stats.prefill_runs,
            stats.decode_time.as_secs_f64(),
            (stats.step_time - stats.prefill_time - stats.decode_time).as_secs_f64(),
            (stats.step_time - stats.prefill_time - stats.decode_time).as_secs_f64() * 1e3
                / stats.decode_steps.max(1) as f64
        );
        println!(
            "{label}: bound: weights {:.0} MiB + KV cache {:.0} MiB read per step at {:.1} GB/s measured = {:.1} ms; step / bound = {:.2}",
            weight_bytes as f64 / 1048576.0,
            cache_bytes as f64 / 1048576.0,
            bandwidth / 1e9,
            bound * 1e3,
            median_step / bound
        );
        rates.push((label, generated as f64 / total));
    }
    for kind in [SamplerKind::InverseCdf, SamplerKind::GumbelMax] {
        let sampler = measure_sampler(&client, seqs, config.vocab_size, kind);
        println!(
            "sampler alone ({seqs} x {} logits, {kind:?}, with the log-softmax normaliser): {:.1} ms",
            config.vocab_size,
            sampler * 1e3,
        );
    }
    if rates.len() == 2 {
        println!(
            "ratio: engine {:.1} tok/s / {} engine {:.1} tok/s = {:.2}x",
            rates[0].1,
            rates[1].0,
            rates[1].1,
            rates[0].1 / rates[1].1
        );
    }
    let engine_tps = rates[0].1;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average after the engine runs: {}", load.trim());

    if run_peer {
        let dir = std::env::temp_dir().join(format!("rollout-bench-hf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        model::save_hf_checkpoint(&dir.join("model"), &host.weights, &[]).unwrap();
        let prompts_file = dir.join("prompts.json");
        std::fs::write(&prompts_file, serde_json::to_string(&prompts).unwrap()).unwrap();
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/hf_generate_peer.py");
        let out = Command::new("python3")
            .arg(&script)
            .arg(dir.join("model"))
            .arg(&prompts_file)
            .arg(lengths.iter().max().copied().unwrap_or(new_tokens).to_string())
            .env("ROLLOUT_PEER_GROUP", group.to_string())
            .output()
            .expect("running python3");
        let children_cpu = children_cpu_seconds();
        println!(
            "peer: CPU time {children_cpu:.1} s (includes loading the model; torch's threads spin while waiting)"
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        print!("{stdout}");
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        let value = |name: &str| {
            let line = stdout.lines().find(|l| l.starts_with(name))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        };
        if let (Some(peer), Some(seconds)) = (value("peer_tokens_per_s"), value("peer_seconds")) {
            // With --spread the peer generated every row to the longest length; count only
            // the tokens the groups asked for.
            let peer = if spread { asked as f64 / seconds } else { peer };
            if spread {
                println!("peer: {asked} of its tokens asked for in {seconds:.1} s = {peer:.1} tok/s");
            }
            println!(
                "ratio: engine {engine_tps:.1} tok/s / transformers {peer:.1} tok/s = {:.2}x",
                engine_tps / peer
            );
            if let Some((label, base)) = rates.get(1) {
                println!(
                    "ratio: {label} engine {base:.1} tok/s / transformers {peer:.1} tok/s = {:.2}x",
                    base / peer
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
