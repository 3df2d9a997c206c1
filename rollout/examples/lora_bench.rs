//! LoRA in the rollout, the two forms in the same run: the merged weights `W + s·B·A` (a merge
//! on the device per weight version, then plain decode steps) against the adapters applied in
//! the programs (`EngineConfig::adapters`: no merge, `x·Wᵀ + s·(x·Aᵀ)·Bᵀ` in every step).
//!
//!     cargo run --release -p rollout --example lora_bench -- \
//!         [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--rank 32] [--dtype f32|bf16] \
//!         [--seqs 32] [--group 8] [--prompt-len 64] [--new-tokens 4,16,64] [--rounds 3]
//!
//! Adapters on every projection (`all-linear`). Each round installs a fresh weight version as
//! a rollout worker does (`rollout::AdapterInstall`: the f32 adapters uploaded, then merged
//! into the base or set beside it) and generates `seqs` samples (`seqs / group` prompts,
//! `group` samples each, temperature 1, no stop tokens, so exactly `seqs * new_tokens`
//! tokens). Prints, per response length, the median round of each form: the install, the
//! generation and both together.

use std::path::PathBuf;
use std::time::Instant;

use model::lora::{LoraAdapter, LoraConfig, Target};
use model::programs::HostModel;
use model::LoraForm;
use rollout::{upload_weights, AdapterInstall, Engine, EngineConfig, GenerationRequest, SamplingParams};
use xla::runtime::Client;
use xla::DType;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// A version's adapters: PEFT's initialisation with `B` away from zero.
fn adapter(config: &model::ModelConfig, lora: &LoraConfig, version: u64) -> LoraAdapter {
    let mut a = LoraAdapter::init(config, lora, version);
    for (i, t) in a.tensors.iter_mut().enumerate().filter(|(i, _)| i % 2 == 1) {
        let values: Vec<f32> = (0..t.numel())
            .map(|k| ((k * 7 + i + version as usize) % 17) as f32 * 1e-3 - 8e-3)
            .collect();
        *t = model::HostTensor::from_f32(t.name.clone(), t.shape.clone(), &values);
    }
    a
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model_path = PathBuf::from(arg(&args, "--model", "models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let rank: usize = arg(&args, "--rank", "32").parse().unwrap();
    let dtype: DType = arg(&args, "--dtype", "f32")
        .parse()
        .unwrap_or_else(|e| panic!("--dtype: {e}"));
    let seqs: usize = arg(&args, "--seqs", "32").parse().unwrap();
    let group: usize = arg(&args, "--group", "8").parse().unwrap();
    let prompt_len: usize = arg(&args, "--prompt-len", "64").parse().unwrap();
    let lengths: Vec<usize> = arg(&args, "--new-tokens", "4,16,64")
        .split(',')
        .map(|n| n.parse().unwrap())
        .collect();
    let rounds: usize = arg(&args, "--rounds", "3").parse().unwrap();
    assert!(
        group >= 1 && seqs.is_multiple_of(group),
        "--group must divide --seqs"
    );

    let host = HostModel::load(&model_path).expect("loading the model");
    let config = host.weights.config.clone();
    let lora = LoraConfig {
        rank,
        alpha: rank as f64,
        targets: Target::ALL.to_vec(),
        use_rslora: false,
    };
    let text = "The history of mathematics spans many centuries and cultures. Early counting systems \
                grew into arithmetic, geometry and algebra, and scholars in Babylon, Egypt, Greece, \
                India, China and the Islamic world each added methods for solving equations. ";
    let ids = host.tokenizer.encode(&text.repeat(8), false).unwrap();
    let requests = |round: usize, new_tokens: usize| -> Vec<GenerationRequest> {
        (0..seqs / group)
            .map(|i| GenerationRequest {
                id: (round * 1000 + i) as u64,
                prompt: ids[i % 17..i % 17 + prompt_len].to_vec(),
                n: group,
                seed: (round * 1000 + i) as u64,
                params: SamplingParams {
                    temperature: 1.0,
                    max_new_tokens: new_tokens,
                    ..Default::default()
                },
                multi_turn: None,
            })
            .collect()
    };

    let client = Client::cpu(1).expect("CPU plugin");
    let adapter_bytes: usize = adapter(&config, &lora, 0)
        .tensors
        .iter()
        .map(|t| t.bytes.len())
        .sum();
    println!(
        "{} layers, hidden {}, LoRA rank {rank} on every projection: {:.1} MB of f32 adapters; \
         weights {dtype}; {seqs} samples ({} prompts x {group}) after {prompt_len}-token prompts; \
         median of {rounds} rounds",
        config.num_hidden_layers,
        config.hidden_size,
        adapter_bytes as f64 / 1e6,
        seqs / group,
    );
    println!("new tokens  form     install s  generate s  install + generate s");
    for &new_tokens in &lengths {
        let mut totals = Vec::new();
        for form in [LoraForm::Merged, LoraForm::Applied] {
            let mut settings = EngineConfig::new(seqs, prompt_len + new_tokens);
            settings.adapters = (form == LoraForm::Applied).then(|| lora.clone());
            let base = upload_weights(&client, &host.weights, dtype, 0).unwrap();
            let install =
                AdapterInstall::new(&client, &config, &lora, form, dtype, base.into(), &[0]).unwrap();
            let version = |v: u64| {
                let t = Instant::now();
                let weights = install
                    .install_host(&client, &adapter(&config, &lora, v).tensors)
                    .unwrap();
                for b in weights.args().concat() {
                    b.block_until_ready().unwrap();
                }
                (weights, t.elapsed().as_secs_f64())
            };
            let mut engine = Engine::new(&client, &config, version(0).0, 0, settings, None).unwrap();
            let (mut installs, mut gens) = (Vec::new(), Vec::new());
            for round in 0..=rounds {
                let (weights, s) = version(round as u64 + 1);
                engine.update_weights(round as u64 + 1, weights).unwrap();
                let t = Instant::now();
                for r in requests(round, new_tokens) {
                    engine.submit(r).unwrap();
                }
                let samples = engine.run_to_completion().unwrap();
                assert!(samples.iter().all(|s| s.response_ids.len() == new_tokens));
                // Round 0 compiles and warms up.
                if round > 0 {
                    installs.push(s);
                    gens.push(t.elapsed().as_secs_f64());
                }
            }
            let (i, g) = (median(installs), median(gens));
            let name = if form == LoraForm::Merged {
                "merged"
            } else {
                "applied"
            };
            println!("{new_tokens:10}  {name:7}  {i:9.4}  {g:10.3}  {:20.3}", i + g);
            totals.push(i + g);
        }
        println!("{new_tokens:10}  applied / merged: {:.3}", totals[1] / totals[0]);
    }
}
