//! Benchmark of the compiled decoder programs on SmolLM2-135M-Instruct (GGUF, weights
//! dequantised to f32) on the CPU plugin: prefill tokens/s, single-sequence decode tokens/s and
//! batched decode tokens/s, optionally against Hugging Face transformers (PyTorch, CPU, f32) on
//! the same token ids in the same run (`--with-hf`, runs `bench_generate_hf.py` beside this
//! file and prints the ratios).
//!
//! ```text
//! cargo run --release -p model --example bench_generate -- \
//!     [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--prefill-batch 4] [--prefill-len 128] \
//!     [--decode-steps 32] [--decode-slots 16] [--dtype f32|bf16] [--with-hf [--hf-threads N]]
//! ```
//!
//! Token ids are `(17 + 7919 * row + 31 * col) % 49000 + 100` for prompt row `row`, column
//! `col`; the Python script uses the same formula.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use model::programs::{DecodeProgram, DeviceModel, KvCache, PrefillProgram, PrefillRequest};
use model::safetensors_io::ModelWeights;
use model::{GgufFile, ModelConfig};
use xla::runtime::Client;
use xla::DType;

struct Args {
    model: PathBuf,
    prefill_batch: usize,
    prefill_len: usize,
    decode_steps: usize,
    decode_slots: usize,
    with_hf: bool,
    dtype: DType,
    hf_threads: usize,
}

fn parse_args() -> Args {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut a = Args {
        model: root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        prefill_batch: 4,
        prefill_len: 128,
        decode_steps: 32,
        decode_slots: 16,
        with_hf: false,
        dtype: DType::F32,
        hf_threads: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = PathBuf::from(value()),
            "--prefill-batch" => a.prefill_batch = value().parse().expect("--prefill-batch N"),
            "--prefill-len" => a.prefill_len = value().parse().expect("--prefill-len N"),
            "--decode-steps" => a.decode_steps = value().parse().expect("--decode-steps N"),
            "--decode-slots" => a.decode_slots = value().parse().expect("--decode-slots N"),
            "--with-hf" => a.with_hf = true,
            "--hf-threads" => a.hf_threads = value().parse().expect("--hf-threads N"),
            "--dtype" => a.dtype = value().parse().unwrap_or_else(|e| panic!("--dtype: {e}")),
            other => panic!(
                "unknown option {other}; options: --model PATH --prefill-batch N --prefill-len N \
                 --decode-steps N --decode-slots N --dtype f32|bf16 --with-hf --hf-threads N"
            ),
        }
    }
    a
}

fn token(row: usize, col: usize) -> u32 {
    ((17 + 7919 * row + 31 * col) % 49000 + 100) as u32
}

/// Decode tokens/s with `slots` sequences, each first prefilled with 16 prompt tokens.
fn decode_rate(model: &DeviceModel, slots: usize, steps: usize) -> f64 {
    let max_len = 16 + steps + 1;
    let prefill = PrefillProgram::compile(model, 1, 16, slots, max_len).unwrap();
    let decode = DecodeProgram::compile(model, slots, max_len).unwrap();
    let mut cache = KvCache::new(model, slots, max_len).unwrap();
    for s in 0..slots {
        let prompt: Vec<u32> = (0..16).map(|c| token(s, c)).collect();
        prefill
            .run(
                model,
                &mut cache,
                &[PrefillRequest {
                    slot: s,
                    tokens: &prompt,
                }],
            )
            .unwrap();
    }
    // One warm-up step, then timed steps.
    let step = |cache: &mut KvCache, pos: usize| {
        let steps: Vec<Option<(u32, usize)>> = (0..slots).map(|s| Some((token(s, pos), pos))).collect();
        decode.run(model, cache, &steps).unwrap()
    };
    step(&mut cache, 16);
    let t = Instant::now();
    for i in 0..steps {
        step(&mut cache, 17 + i);
    }
    (slots * steps) as f64 / t.elapsed().as_secs_f64()
}

fn main() {
    let args = parse_args();
    let gguf = GgufFile::open(&args.model)
        .unwrap_or_else(|e| panic!("{e}\nfetch the model with scripts/setup.sh or pass --model PATH"));
    let config = ModelConfig::from_gguf(&gguf).unwrap();
    let weights: ModelWeights = gguf.load_weights(&config).unwrap();
    let client = Client::cpu(1).unwrap();
    let model = DeviceModel::upload(&client, &weights, args.dtype, 0).unwrap();

    let (b, t) = (args.prefill_batch, args.prefill_len);
    let prefill = PrefillProgram::compile(&model, b, t, b, t).unwrap();
    let mut cache = KvCache::new(&model, b, t).unwrap();
    let prompts: Vec<Vec<u32>> = (0..b).map(|r| (0..t).map(|c| token(r, c)).collect()).collect();
    let requests: Vec<PrefillRequest> = prompts
        .iter()
        .enumerate()
        .map(|(slot, p)| PrefillRequest { slot, tokens: p })
        .collect();
    prefill.run(&model, &mut cache, &requests).unwrap();
    let reps = 2;
    let start = Instant::now();
    for _ in 0..reps {
        prefill.run(&model, &mut cache, &requests).unwrap();
    }
    let prefill_rate = (reps * b * t) as f64 / start.elapsed().as_secs_f64();
    let single = decode_rate(&model, 1, args.decode_steps);
    let batched = decode_rate(&model, args.decode_slots, args.decode_steps);
    let w = args.dtype;
    println!("grpo (XLA CPU, {w} weights): prefill {b}x{t}: {prefill_rate:.1} tokens/s");
    println!("grpo (XLA CPU, {w} weights): decode 1 sequence: {single:.1} tokens/s");
    println!(
        "grpo (XLA CPU, {w} weights): decode {} sequences: {batched:.1} tokens/s",
        args.decode_slots
    );

    if args.with_hf {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/bench_generate_hf.py");
        let out = Command::new("python3")
            .arg(&script)
            .arg(&args.model)
            .args(["--prefill-batch", &b.to_string(), "--prefill-len", &t.to_string()])
            .args(["--decode-steps", &args.decode_steps.to_string()])
            .args(["--decode-slots", &args.decode_slots.to_string()])
            .args(["--threads", &args.hf_threads.to_string()])
            .output()
            .expect("run python3 bench_generate_hf.py");
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            panic!(
                "bench_generate_hf.py failed: {}\n{stdout}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        print!("{stdout}");
        let get = |key: &str| -> f64 {
            stdout
                .lines()
                .find_map(|l| l.strip_prefix(key).map(|v| v.trim().parse::<f64>().unwrap()))
                .unwrap_or_else(|| panic!("no `{key}` line in the Python output"))
        };
        let hf = [
            get("hf_prefill"),
            get("hf_decode_single"),
            get("hf_decode_batched"),
        ];
        let ours = [prefill_rate, single, batched];
        for (name, (o, h)) in ["prefill", "decode 1", "decode batched"]
            .iter()
            .zip(ours.iter().zip(hf))
        {
            println!("ratio grpo / transformers, {name}: {:.2}", o / h);
        }
    }
}
