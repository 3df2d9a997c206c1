//! How far a rollout engine split over N CPU devices (data parallel over its slots) is from
//! the single-device engine on a real model: the same requests (greedy and sampled groups)
//! on 1 and N devices, then per device count: samples with identical tokens, where the
//! others first differ, and the largest log-prob difference over the tokens both share
//! before that point (the rounding of per-device matrix shapes, before any token differs).
//!
//!     cargo run --release -p rollout --example sharded_parity -- \
//!         [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--devices 2,4] [--dtype bf16] \
//!         [--slots 32] [--new 16] [--prompts 8] [--n 4] [--base-slots 32]
//!
//! `--show` prints every sample's tokens and both log-prob lists. `--base-slots` gives the single-device engine another slot count: with `--base-slots 8
//! --devices 1 --slots 32` it measures how far one device's own results move with the
//! number of slots (the matrix shapes), the baseline for the split engine's differences.

use std::path::PathBuf;
use std::sync::Arc;

use model::programs::HostModel;
use rollout::{
    upload_weights, Engine, EngineConfig, EngineWeights, GenerationRequest, Sample, SamplingParams,
};
use xla::runtime::Client;
use xla::DType;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = PathBuf::from(arg(&args, "--model", "models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let devices: Vec<usize> = arg(&args, "--devices", "2,4")
        .split(',')
        .map(|d| d.parse().expect("--devices: comma-separated counts"))
        .collect();
    let dtype: DType = arg(&args, "--dtype", "bf16")
        .parse()
        .unwrap_or_else(|e| panic!("--dtype: {e}"));
    let slots: usize = arg(&args, "--slots", "32").parse().unwrap();
    let new_tokens: usize = arg(&args, "--new", "16").parse().unwrap();
    let prompts: usize = arg(&args, "--prompts", "8").parse().unwrap();
    let n: usize = arg(&args, "--n", "4").parse().unwrap();
    let base_slots: usize = arg(&args, "--base-slots", &slots.to_string()).parse().unwrap();
    let most = devices.iter().copied().max().unwrap_or(1);
    let client = Client::cpu(most).expect("the CPU plugin");
    let host = HostModel::load(&path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    let stop = host.stop_tokens();
    // Greedy and sampled groups of arithmetic questions.
    let mut requests = Vec::new();
    for i in 0..prompts {
        let text = format!(
            "What is {} + {}? Reply with only the number.",
            3 + 7 * i,
            11 + 5 * i
        );
        let ids = host.tokenizer.encode(&text, true).unwrap();
        let params = |temperature: f32| SamplingParams {
            temperature,
            max_new_tokens: new_tokens,
            ..Default::default()
        };
        requests.push(GenerationRequest {
            id: 2 * i as u64,
            prompt: ids.clone(),
            n,
            seed: 100 + i as u64,
            params: params(1.0),
            multi_turn: None,
        });
        requests.push(GenerationRequest {
            id: 2 * i as u64 + 1,
            prompt: ids,
            n: 1,
            seed: 0,
            params: params(0.0),
            multi_turn: None,
        });
    }
    let run = |d: usize, slots: usize| -> Vec<Sample> {
        let weights = EngineWeights::replicated(
            (0..d)
                .map(|k| Arc::from(upload_weights(&client, &host.weights, dtype, k).unwrap()))
                .collect(),
        );
        let mut settings = EngineConfig::new(slots, 128);
        settings.eos_token_ids = stop.clone();
        let mut engine = Engine::new(&client, &host.weights.config, weights, 0, settings, None).unwrap();
        for r in &requests {
            engine.submit(r.clone()).unwrap();
        }
        let mut all = engine.run_to_completion().unwrap();
        all.sort_by_key(|s| (s.request_id, s.sample_index));
        all
    };
    let base = run(1, base_slots);
    println!(
        "{} samples ({} greedy), {dtype:?} weights, {slots} slots ({base_slots} on the single device), \
         up to {new_tokens} new tokens",
        base.len(),
        prompts
    );
    for &d in &devices {
        let got = run(d, slots);
        let mut same = 0;
        let mut first_diffs = Vec::new();
        let mut worst = 0f32;
        for (a, b) in base.iter().zip(&got) {
            if args.iter().any(|a| a == "--show") {
                println!(
                    "req {} #{}: tokens {:?}",
                    a.request_id, a.sample_index, a.response_ids
                );
                println!("  1 device  log-probs {:?}", a.logprobs);
                println!("  {d} devices log-probs {:?}", b.logprobs);
            }
            let common = a
                .response_ids
                .iter()
                .zip(&b.response_ids)
                .take_while(|(x, y)| x == y)
                .count();
            for k in 0..common {
                worst = worst.max((a.logprobs[k] - b.logprobs[k]).abs());
            }
            if a.response_ids == b.response_ids {
                same += 1;
            } else {
                first_diffs.push(format!(
                    "req {} #{} at token {common}",
                    a.request_id, a.sample_index
                ));
            }
        }
        println!(
            "{d} devices: {same}/{} samples identical; largest |log-prob difference| on shared tokens {worst:.2e}; \
             differing: {:?}",
            base.len(),
            first_diffs
        );
    }
}
