//! Benchmark of the learner's update phase (forward, backward, clipping, AdamW) on
//! SmolLM2-135M-Instruct against the same update in plain PyTorch + transformers on the CPU,
//! in the same run, alternating one update of each so that machine load hits both alike.
//!
//! ```text
//! cargo run --release -p trainer --example update_bench -- \
//!     [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--rows 8] [--prompt-len 64] \
//!     [--response-len 448] [--micro-batch 8] [--rounds 3] [--dtype f32|bf16|f32,bf16] \
//!     [--peer-dtype f32|bf16|f32,bf16] [--peer-threads N] [--peer-micro-batch M] [--no-peer] \
//!     [--prompt-lens A-B] [--response-lens A-B] [--length-bucket N,M,...] [--group N]
//! ```
//!
//! `--group N` gives consecutive rows in groups of `N` one prompt, as GRPO samples them (`N`
//! = `rollout.n`): the learner packs each group's prompt once (`DecoderPolicy::group_size`),
//! the peer gets every row whole, as TRL's `GRPOTrainer` trains them. The default, 1, gives
//! every row its own prompt.
//!
//! `--prompt-lens` / `--response-lens` give the rows real lengths between A and B tokens
//! (row `r` gets `A + (7 r mod (B - A + 1))`), left/right-padded to `--prompt-len` /
//! `--response-len` as the learner packs them (needs `--no-peer`: the torch peer takes rows
//! without padding). `--length-bucket` lists the `actor.length_bucket` values to run, one
//! learner each per dtype (`trainer::bucket::BucketedLearner`; 0 = every row at the full
//! length, the default); every round runs one update of each, so bucketed and full-length
//! updates alternate under the same load. Tokens/s count the full `P + L` columns per row
//! whatever the bucket (the work a full-length learner would do).
//!
//! `--dtype` lists our compute types (one learner each, f32 master weights; `bf16` = bf16
//! parameters and matmul operands with f32 results); `--peer-dtype` lists the peer's (one torch
//! process each; `bf16` = `torch.autocast` to bf16 around the forward). Every round runs one
//! update of each, in that order.
//!
//! The program re-executes itself once with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (see
//! `trainer::memory`); `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` measures without huge pages.
//!
//! One update is one GRPO optimizer step over `rows` sequences of `prompt-len + response-len`
//! tokens (no padding): `Learner::step` with the decoder policy (f32 master weights, VeRL's
//! default loss: PPO clip 0.2/0.2, dual clip 3, token-mean; AdamW lr 1e-6, weight decay 0.01,
//! gradient clipping at 1.0). The old log-probs are the policy's own (computed by a forward
//! program before the first update), the advantages are GRPO's over one group of `rows`.
//! The peer (`trainer/scripts/update_bench_torch.py`) loads the same weights (exported to a
//! Hugging Face directory) and the same batch, and runs one update per `step` line on its stdin.
//!
//! Model FLOPs utilisation: `flops = 6 * N * tokens + 12 * layers * heads * head_dim * T *
//! tokens` (PaLM's formula: the parameter matmuls forward and backward plus the attention
//! score and value matmuls, non-causal, over sequences of `T` tokens; `N` counts the tied
//! embedding once, as the output head), divided by the update time and by the f32 GEMM rate
//! (2048^3 matmul through the same plugin) measured in each round of the same run.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use model::forward::DecoderParams;
use model::programs::HostModel;
use trainer::advantage::{broadcast_over_response, grpo_outcome_advantage, GRPO_EPSILON};
use trainer::bucket::BucketedLearner;
use trainer::config::{OptimConfig, PolicyLossConfig};
use trainer::policy::DecoderPolicy;
use trainer::step::{mini_batch_normalizer, LearnerState, MicroBatchHost, StepConfig};
use xla::graph::Graph;
use xla::runtime::{Client, Executable};
use xla::DType;

struct Args {
    model: PathBuf,
    rows: usize,
    prompt_len: usize,
    response_len: usize,
    micro_batch: usize,
    rounds: usize,
    dtypes: Vec<DType>,
    peer_dtypes: Vec<String>,
    peer: bool,
    peer_threads: usize,
    peer_micro_batch: usize,
    prompt_lens: Option<(usize, usize)>,
    response_lens: Option<(usize, usize)>,
    length_buckets: Vec<usize>,
    group: usize,
}

fn parse_range(flag: &str, v: &str) -> (usize, usize) {
    let (a, b) = v
        .split_once('-')
        .unwrap_or_else(|| panic!("{flag} takes A-B, not {v}"));
    let (a, b): (usize, usize) = (
        a.parse()
            .unwrap_or_else(|_| panic!("{flag} A-B: {a} is not a number")),
        b.parse()
            .unwrap_or_else(|_| panic!("{flag} A-B: {b} is not a number")),
    );
    assert!(a <= b, "{flag} A-B needs A <= B");
    (a, b)
}

fn parse_args() -> Args {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut a = Args {
        model: root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        rows: 8,
        prompt_len: 64,
        response_len: 448,
        micro_batch: 8,
        rounds: 3,
        dtypes: vec![DType::F32],
        peer_dtypes: vec!["f32".to_string()],
        peer: true,
        peer_threads: cores,
        peer_micro_batch: 0,
        prompt_lens: None,
        response_lens: None,
        length_buckets: vec![0],
        group: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = PathBuf::from(value()),
            "--rows" => a.rows = value().parse().expect("--rows N"),
            "--prompt-len" => a.prompt_len = value().parse().expect("--prompt-len N"),
            "--response-len" => a.response_len = value().parse().expect("--response-len N"),
            "--micro-batch" => a.micro_batch = value().parse().expect("--micro-batch N"),
            "--rounds" => a.rounds = value().parse().expect("--rounds N"),
            "--peer-threads" => a.peer_threads = value().parse().expect("--peer-threads N"),
            "--peer-micro-batch" => a.peer_micro_batch = value().parse().expect("--peer-micro-batch N"),
            "--no-peer" => a.peer = false,
            "--group" => a.group = value().parse().expect("--group N"),
            "--prompt-lens" => a.prompt_lens = Some(parse_range("--prompt-lens", &value())),
            "--response-lens" => a.response_lens = Some(parse_range("--response-lens", &value())),
            "--length-bucket" => {
                a.length_buckets = value()
                    .split(',')
                    .map(|b| b.parse().expect("--length-bucket N[,M...]"))
                    .collect()
            }
            "--dtype" => {
                a.dtypes = value()
                    .split(',')
                    .map(|d| d.parse().unwrap_or_else(|e| panic!("--dtype: {e}")))
                    .collect()
            }
            "--peer-dtype" => {
                a.peer_dtypes = value().split(',').map(str::to_string).collect();
                for d in &a.peer_dtypes {
                    assert!(
                        d == "f32" || d == "bf16",
                        "--peer-dtype takes f32, bf16 or a comma list of them, not {d}"
                    );
                }
            }
            other => panic!(
                "unknown option {other}; options: --model PATH --rows N --prompt-len N \
                 --response-len N --micro-batch N --rounds N --dtype f32|bf16|f32,bf16 \
                 --peer-dtype f32|bf16|f32,bf16 --peer-threads N --peer-micro-batch N --no-peer \
                 --prompt-lens A-B --response-lens A-B --length-bucket N[,M...] --group N"
            ),
        }
    }
    assert!(a.group >= 1, "--group N needs N >= 1");
    assert!(
        a.micro_batch > 0 && a.rows.is_multiple_of(a.micro_batch),
        "--micro-batch {} must divide --rows {}",
        a.micro_batch,
        a.rows
    );
    assert!(
        !(a.peer && (a.prompt_lens.is_some() || a.response_lens.is_some())),
        "--prompt-lens and --response-lens need --no-peer (the torch peer takes unpadded rows)"
    );
    for (flag, range, max) in [
        ("--prompt-lens", a.prompt_lens, a.prompt_len),
        ("--response-lens", a.response_lens, a.response_len),
    ] {
        if let Some((lo, hi)) = range {
            assert!(lo >= 1 && hi <= max, "{flag} {lo}-{hi} must lie in 1..={max}");
        }
    }
    if a.peer_micro_batch == 0 {
        a.peer_micro_batch = a.micro_batch;
    }
    a
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).expect("finite times"));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_string())
}

/// An f32 `n x n x n` matmul through the plugin.
struct Gemm {
    exe: Executable,
    a: xla::runtime::Buffer,
    b: xla::runtime::Buffer,
    flops: f64,
}

impl Gemm {
    fn new(client: &Client, n: i64) -> Gemm {
        let g = Graph::new("gemm");
        let a = g.parameter("a", DType::F32, &[n, n]);
        let b = g.parameter("b", DType::F32, &[n, n]);
        let exe = g.build(&[&a.matmul(&b)]).unwrap().compile(client).unwrap();
        let values: Vec<f32> = (0..n * n)
            .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let a = client.buffer_from_host(&values, &[n, n], 0).unwrap();
        let b = client.buffer_from_host(&values, &[n, n], 0).unwrap();
        let gemm = Gemm {
            exe,
            a,
            b,
            flops: 2.0 * (n as f64).powi(3),
        };
        gemm.seconds(); // warm-up
        gemm
    }

    fn seconds(&self) -> f64 {
        let t = Instant::now();
        let out = self.exe.execute(&[&self.a, &self.b]).unwrap();
        out[0].block_until_ready().unwrap();
        t.elapsed().as_secs_f64()
    }

    /// Best-of-3 GFLOP/s (the least disturbed of three back-to-back runs).
    fn rate(&self) -> f64 {
        let best = (0..3).map(|_| self.seconds()).fold(f64::MAX, f64::min);
        self.flops / best
    }
}

/// The torch peer, one update per `step` request.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn start(
        model_dir: &std::path::Path,
        batch: &std::path::Path,
        threads: usize,
        micro_batch: usize,
        dtype: &str,
    ) -> Peer {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/update_bench_torch.py");
        let mut child = Command::new("python3")
            .arg(&script)
            .arg(model_dir)
            .arg(batch)
            .args(["--threads", &threads.to_string()])
            .args(["--micro-batch", &micro_batch.to_string()])
            .args(["--dtype", dtype])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("running python3 trainer/scripts/update_bench_torch.py");
        let stdin = child.stdin.take().expect("peer stdin");
        let stdout = BufReader::new(child.stdout.take().expect("peer stdout"));
        let mut peer = Peer { child, stdin, stdout };
        loop {
            let line = peer.line();
            if line == "ready" {
                break;
            }
            println!("{line}");
        }
        peer
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .expect("reading the peer's output");
        assert!(n > 0, "the torch peer exited early (see its error above)");
        line.trim().to_string()
    }

    fn step(&mut self) -> serde_json::Value {
        writeln!(self.stdin, "step").expect("writing to the peer");
        self.stdin.flush().expect("writing to the peer");
        let v: serde_json::Value =
            serde_json::from_str(&self.line()).expect("the peer prints one JSON line per step");
        assert!(v.get("error").is_none(), "peer: {v}");
        v
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

fn main() {
    // Large per-call temporaries in huge pages (re-executes this program once with
    // GLIBC_TUNABLES=glibc.malloc.hugetlb=1; GLIBC_TUNABLES=glibc.malloc.hugetlb=0 opts out).
    let huge_pages = match trainer::memory::reexec_with_huge_page_malloc() {
        Ok(never) => match never {},
        Err(reason) => reason,
    };
    println!(
        "malloc: GLIBC_TUNABLES={} ({huge_pages})",
        std::env::var("GLIBC_TUNABLES").unwrap_or_default()
    );
    let args = parse_args();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("load average at start: {} ({cores} cores)", load_average());
    let host = HostModel::load(&args.model).expect("loading the model");
    let config = host.weights.config.clone();
    let (p_len, r_len, rows, mb) = (args.prompt_len, args.response_len, args.rows, args.micro_batch);
    let width = p_len + r_len;

    // Rows: a fixed text, tokenized, each row a different window of exactly P + L tokens.
    let text = "The history of mathematics spans many centuries and cultures. Early counting systems \
                grew into arithmetic, geometry and algebra, and scholars in Babylon, Egypt, Greece, \
                India, China and the Islamic world each added methods for solving equations, \
                measuring land, predicting the motion of the stars and keeping accounts. ";
    let ids = host.tokenizer.encode(&text.repeat(40), false).unwrap();
    assert!(ids.len() >= width + 13 * rows, "the benchmark text is too short");
    // With --group N, rows of one group take their first row's prompt.
    let row_ids: Vec<Vec<u32>> = (0..rows)
        .map(|r| {
            let leader = r - r % args.group;
            let mut row = ids[13 * leader..13 * leader + p_len].to_vec();
            row.extend_from_slice(&ids[13 * r + p_len..13 * r + width]);
            row
        })
        .collect();
    // Each row's real (prompt, response) lengths: the full ones unless ranges were given.
    let pick = |range: Option<(usize, usize)>, full: usize, r: usize| {
        range.map_or(full, |(lo, hi)| lo + (7 * r) % (hi - lo + 1))
    };
    let row_lens: Vec<(usize, usize)> = (0..rows)
        .map(|r| {
            (
                pick(args.prompt_lens, p_len, r - r % args.group),
                pick(args.response_lens, r_len, r),
            )
        })
        .collect();
    let real_tokens: usize = row_lens.iter().map(|(p, r)| p + r).sum();
    println!(
        "rows: {rows} x {width} columns, {real_tokens} real tokens ({:.1} % padding)",
        100.0 * (1.0 - real_tokens as f64 / (rows * width) as f64)
    );

    let client = Client::cpu(1).expect("CPU plugin");
    let gemm = Gemm::new(&client, 2048);
    println!(
        "GEMM f32 2048^3 through the plugin: {:.1} GFLOP/s (before compiling)",
        gemm.rate() / 1e9
    );

    // Old log-probs: the policy's own, from a forward program run micro-batch by micro-batch
    // (the same rows per run as the update, so peak memory stays that of one micro-batch).
    let policy = DecoderPolicy {
        config: config.clone(),
        prompt_len: p_len,
        response_len: r_len,
        micro_batch_size: mb,
        temperature: 1.0,
        group_size: args.group,
        blocks: 1,
        remat: false,
        scan: false,
        lora: None,
        lora_form: Default::default(),
        head: Default::default(),
        route_inputs: false,
        moe_lowering: Default::default(),
    };
    let rows_ref: Vec<(&[u32], &[u32])> = row_ids
        .iter()
        .zip(&row_lens)
        .map(|(r, &(pl, rl))| (&r[p_len - pl..p_len], &r[p_len..p_len + rl]))
        .collect();
    let packed: Vec<_> = rows_ref.chunks(mb).map(|c| policy.pack(c).unwrap()).collect();
    let response_mask: Vec<f32> = packed.iter().flat_map(|p| p.response_mask.clone()).collect();
    let init: Vec<Vec<f32>> = host.weights.tensors.iter().map(|t| t.to_f32_vec()).collect();
    let n_params: usize = init.iter().map(Vec::len).sum();
    let t = Instant::now();
    let old_log_probs = {
        let g = Graph::new("old_log_probs");
        let p = DecoderParams::declare(&g, &config, DType::F32);
        let specs = policy.input_specs();
        let inputs: Vec<_> = specs
            .iter()
            .map(|s| g.parameter(&s.name, s.dtype, &s.dims))
            .collect();
        let out = policy.log_probs(&p.all, &inputs);
        let exe = g.build(&[&out.log_probs]).unwrap().compile(&client).unwrap();
        let compile_s = t.elapsed().as_secs_f64();
        let weights: Vec<xla::runtime::Buffer> = init
            .iter()
            .zip(policy.param_specs())
            .map(|(v, s)| client.buffer_from_host(v, &s.dims(), 0).unwrap())
            .collect();
        let t = Instant::now();
        let mut lp = Vec::new();
        for chunk in &packed {
            let inputs: Vec<xla::runtime::Buffer> = chunk
                .inputs(false)
                .iter()
                .zip(&specs)
                .map(|(a, s)| a.to_device(&client, &s.dims, 0).unwrap())
                .collect();
            let mut a: Vec<&xla::runtime::Buffer> = weights.iter().collect();
            a.extend(inputs.iter());
            lp.extend(exe.execute(&a).unwrap()[0].to_host::<f32>().unwrap());
        }
        println!(
            "forward only (log-probs of {rows} rows in runs of {mb}, no gradient): compile {compile_s:.1} s, run {:.2} s",
            t.elapsed().as_secs_f64()
        );
        lp
    };

    // GRPO advantages over one group of `rows` with a fixed reward pattern.
    let rewards: Vec<f64> = (0..rows).map(|r| ((r * 5 + 3) % 3 == 0) as u8 as f64).collect();
    let groups = vec![0usize; rows];
    let adv = grpo_outcome_advantage(&rewards, &groups, GRPO_EPSILON, true).unwrap();
    let advantages = broadcast_over_response(&adv, &response_mask, r_len).unwrap();
    let norm = mini_batch_normalizer(&response_mask, r_len);

    let optim = OptimConfig::default();
    let loss = PolicyLossConfig::default();
    let host_micro_batches: Vec<MicroBatchHost> = (0..rows / mb)
        .map(|i| {
            let (rs, re) = (i * mb, (i + 1) * mb);
            MicroBatchHost {
                old_log_probs: old_log_probs_for(&old_log_probs, rs, re, r_len),
                advantages: advantages[rs * r_len..re * r_len].to_vec(),
                response_mask: response_mask[rs * r_len..re * r_len].to_vec(),
                norm,
                ..Default::default()
            }
        })
        .collect();
    let state = LearnerState::fresh(init);
    // One learner per compute type and length bucket, each with its uploaded micro-batches.
    let mut ours: Vec<(String, BucketedLearner, Vec<_>)> = Vec::new();
    for &dtype in &args.dtypes {
        for &bucket in &args.length_buckets {
            let cfg = StepConfig {
                loss: loss.clone(),
                optim: optim.clone(),
                compute_dtype: dtype,
                micro_batch_size: mb as i64,
                response_len: r_len as i64,
                parallel: Default::default(),
                frozen: Vec::new(),
                value_loss: None,
            };
            let name = match (args.length_buckets.len(), bucket) {
                (1, 0) => format!("ours {dtype}"),
                (_, 0) => format!("ours {dtype} full"),
                _ => format!("ours {dtype} bucket {bucket}"),
            };
            let t = Instant::now();
            let mut learner =
                BucketedLearner::from_state(&client, policy.clone(), cfg, &state, bucket, 3).unwrap();
            let mut uploaded = Vec::new();
            for (i, h) in host_micro_batches.iter().enumerate() {
                let p = learner.pack(&rows_ref[i * mb..(i + 1) * mb]).unwrap();
                uploaded.push(learner.upload(i, &p, h).unwrap());
            }
            println!(
                "{name}: trace {:.1} s; shapes (prompt+response columns) {:?}",
                t.elapsed().as_secs_f64(),
                learner.shapes()
            );
            ours.push((name, learner, uploaded));
        }
    }

    // The peers: same weights as a Hugging Face directory, same batch as JSON.
    let dir = std::env::temp_dir().join(format!("update-bench-{}", std::process::id()));
    let mut peers: Vec<(String, Peer)> = Vec::new();
    if args.peer {
        std::fs::create_dir_all(&dir).unwrap();
        model::save_hf_checkpoint(&dir.join("model"), &host.weights, &[]).unwrap();
        let chunk = |v: &[f32]| v.chunks(r_len).map(<[f32]>::to_vec).collect::<Vec<_>>();
        let batch = serde_json::json!({
            "tokens": row_ids,
            "prompt_len": p_len,
            "response_len": r_len,
            "old_log_probs": chunk(&old_log_probs_for(&old_log_probs, 0, rows, r_len)),
            "advantages": chunk(&advantages),
            "response_mask": chunk(&response_mask),
            "temperature": 1.0,
            "lr": optim.lr,
            "betas": optim.betas,
            "eps": optim.eps,
            "weight_decay": optim.weight_decay,
            "grad_clip": optim.grad_clip.expect("the default clips"),
            "clip_ratio_low": loss.clip_ratio_low,
            "clip_ratio_high": loss.clip_ratio_high,
            "clip_ratio_c": loss.clip_ratio_c,
        });
        let batch_file = dir.join("batch.json");
        std::fs::write(&batch_file, batch.to_string()).unwrap();
        for dtype in &args.peer_dtypes {
            let peer = Peer::start(
                &dir.join("model"),
                &batch_file,
                args.peer_threads,
                args.peer_micro_batch,
                dtype,
            );
            peers.push((format!("torch {dtype}"), peer));
        }
    }

    // Warm-up update on every side (compiles ours); its metrics check that all sides compute
    // the same update.
    let mut firsts: Vec<(String, Vec<(&'static str, f64)>)> = Vec::new();
    for (name, learner, mbs) in ours.iter_mut() {
        let t = Instant::now();
        let first = learner.step(mbs, optim.lr).unwrap();
        println!(
            "{name}: first update (compile + run) {:.1} s; metrics {}",
            t.elapsed().as_secs_f64(),
            fmt_metrics(&first.values)
        );
        firsts.push((name.clone(), first.values.clone()));
    }
    for (name, peer) in peers.iter_mut() {
        let m = peer.step();
        println!(
            "{name}: first update {:.1} s; metrics {m}",
            m["seconds"].as_f64().unwrap()
        );
        for (ours_name, values) in &firsts {
            for key in ["pg_loss", "ppo_kl", "entropy", "grad_norm"] {
                let a = values
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map_or(f64::NAN, |(_, v)| *v);
                let b = m[key].as_f64().unwrap();
                println!(
                    "agreement {key}: {ours_name} {a:.6e} {name} {b:.6e} (|diff| {:.2e})",
                    (a - b).abs()
                );
            }
        }
    }

    let mut times: Vec<Vec<f64>> = vec![Vec::new(); ours.len() + peers.len()];
    let mut rates = Vec::new();
    for round in 0..args.rounds {
        rates.push(gemm.rate());
        let mut line = format!("round {round}: GEMM {:.1} GFLOP/s", rates[round] / 1e9);
        for (i, (name, learner, mbs)) in ours.iter_mut().enumerate() {
            let t = Instant::now();
            let m = learner.step(mbs, optim.lr).unwrap();
            times[i].push(t.elapsed().as_secs_f64());
            assert!(
                m.update_applied,
                "round {round}: {name}: the update was skipped: {:?}",
                m.values
            );
            line += &format!(", {name} {:.2} s", times[i][round]);
        }
        for (j, (name, peer)) in peers.iter_mut().enumerate() {
            let pm = peer.step();
            let i = ours.len() + j;
            times[i].push(pm["seconds"].as_f64().unwrap());
            line += &format!(", {name} {:.2} s", times[i][round]);
        }
        println!("{line}; load average {}", load_average());
    }
    let names: Vec<String> = ours
        .iter()
        .map(|(n, _, _)| n.clone())
        .chain(peers.iter().map(|(n, _)| n.clone()))
        .collect();
    drop(peers);
    let _ = std::fs::remove_dir_all(&dir);

    let tokens = (rows * width) as f64;
    let layers = config.num_hidden_layers as f64;
    let attn_width = (config.num_attention_heads * config.head_dim) as f64;
    let flops = 6.0 * n_params as f64 * tokens + 12.0 * layers * attn_width * width as f64 * tokens;
    let rate = median(&rates);
    println!(
        "setup: {rows} rows x ({p_len} prompt + {r_len} response) tokens, micro-batch {mb}, f32 master weights, \
         {n_params} parameters; flops per update = 6 N tokens + 12 layers d_attn T tokens = {:.3} TFLOP",
        flops / 1e12
    );
    println!("GEMM f32 2048^3 median over rounds: {:.1} GFLOP/s", rate / 1e9);
    let medians: Vec<f64> = times.iter().map(|t| median(t)).collect();
    for (name, t) in names.iter().zip(&medians) {
        println!(
            "{name}: median update {t:.2} s = {:.1} tokens/s, {:.1} GFLOP/s model flops, MFU {:.1}% of the measured f32 GEMM rate",
            tokens / t,
            flops / t / 1e9,
            100.0 * flops / t / rate
        );
    }
    for (i, name) in names.iter().enumerate().take(ours.len()) {
        for (j, peer_name) in names.iter().enumerate().skip(ours.len()) {
            println!(
                "ratio: {name} / {peer_name} tokens/s = {:.2}x",
                medians[j] / medians[i]
            );
        }
    }
    println!("load average at end: {}", load_average());
    if xla::runtime::host_blocks::installed() {
        println!("CPU plugin block cache: {:?}", xla::runtime::host_blocks::stats());
    }
}

/// Rows `[start, end)` of the `[rows, L]` old log-probs.
fn old_log_probs_for(all: &[f32], start: usize, end: usize, r_len: usize) -> Vec<f32> {
    all[start * r_len..end * r_len].to_vec()
}

fn fmt_metrics(values: &[(&'static str, f64)]) -> String {
    values
        .iter()
        .map(|(k, v)| format!("{k}={v:.4e}"))
        .collect::<Vec<_>>()
        .join(" ")
}
