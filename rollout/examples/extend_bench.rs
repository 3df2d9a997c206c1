//! Multi-turn: what writing a turn's environment tokens into a sample's KV cache costs, by
//! the number of tokens. In the same run and engine, an extend run (the tokens' keys and
//! values in one pass) against the decode steps that writing them one row per token would
//! take (each step decoding every live sample, as the engine's steps do).
//!
//!     cargo run --release -p rollout --example extend_bench -- \
//!         [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--samples 8] [--turns 4] \
//!         [--env 16,64,256] [--dtype f32|bf16]
//!
//! `--samples` episodes of one 64-token prompt run turns of one sampled token each (a turn
//! cut by its 1-token budget parks, as an agent program's do); every turn is answered with
//! `N` environment tokens, for each `N` of `--env`. Printed per `N`: the mean extend run,
//! the mean decode step over all the samples, and two ratios of the row path's time to the
//! extend runs': for one resumed sample (`N` decode steps against one extend run) and for
//! all the samples resumed at once, as a group's turns end together (`N` decode steps
//! against one extend run per sample).

use std::sync::Arc;
use std::time::Duration;

use model::programs::HostModel;
use rollout::{
    upload_weights, Engine, EngineConfig, Episode, EpisodeStats, GenerationRequest, Resume, SamplingParams,
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
    let model_path = arg(&args, "--model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let samples: usize = arg(&args, "--samples", "8").parse().unwrap();
    let turns: u32 = arg(&args, "--turns", "4").parse().unwrap();
    let envs: Vec<usize> = arg(&args, "--env", "16,64,256")
        .split(',')
        .map(|n| n.parse().unwrap())
        .collect();
    let dtype = match arg(&args, "--dtype", "f32").as_str() {
        "bf16" => DType::BF16,
        _ => DType::F32,
    };
    let host = HostModel::load(std::path::Path::new(&model_path)).expect("loading the model");
    let config = host.weights.config.clone();
    let prompt: Vec<u32> = host
        .tokenizer
        .encode(
            &"Tools answer in several turns, and the answers are long. ".repeat(16),
            false,
        )
        .unwrap()[..64]
        .to_vec();
    let client = Client::cpu(1).expect("CPU plugin");
    let weights: Arc<[xla::runtime::Buffer]> =
        upload_weights(&client, &host.weights, dtype, 0).unwrap().into();
    let answer: Vec<u32> = prompt
        .iter()
        .copied()
        .cycle()
        .take(*envs.iter().max().unwrap())
        .collect();

    println!("{model_path} ({dtype}), {samples} samples, {turns} turns of 1 token, 64-token prompt");
    println!(
        "| environment tokens N | extend run | decode step ({samples} samples) | one sample: N steps / 1 extend | {samples} samples: N steps / {samples} extends |"
    );
    println!("|---|---|---|---|---|");
    for &n in &envs {
        let max_len = 64 + (turns as usize) * (n + 1) + 8;
        let mut engine = Engine::new(
            &client,
            &config,
            weights.clone(),
            0,
            EngineConfig::new(samples, max_len),
            None,
        )
        .unwrap();
        engine.set_park_cut_turns(true);
        let request = GenerationRequest {
            id: 1,
            prompt: prompt.clone(),
            n: samples,
            seed: 1,
            params: SamplingParams {
                temperature: 1.0,
                max_new_tokens: max_len - 64,
                ..Default::default()
            },
            multi_turn: Some(Episode {
                max_turn_tokens: 1,
                row: Arc::new(serde_json::Value::Null),
            }),
        };
        // A first episode compiles the programs; the second is measured.
        let mut measured = (Duration::ZERO, 0, Duration::ZERO, 0);
        for round in 0..2 {
            let before = engine.stats().clone();
            engine
                .submit(GenerationRequest {
                    id: round,
                    ..request.clone()
                })
                .unwrap();
            while engine.has_work() || engine.parked_samples() > 0 {
                engine.step().unwrap();
                for turn in engine.take_turns() {
                    let resume = if turn.turns >= turns {
                        Resume::Finish {
                            stats: EpisodeStats::default(),
                        }
                    } else {
                        Resume::Continue {
                            tokens: answer[..n].to_vec(),
                            stats: EpisodeStats::default(),
                        }
                    };
                    engine.resume(turn.id, resume).unwrap();
                }
            }
            let after = engine.stats();
            measured = (
                after.extend_time - before.extend_time,
                after.extend_runs - before.extend_runs,
                after.decode_time - before.decode_time,
                after.decode_steps - before.decode_steps,
            );
        }
        let (extend_time, runs, decode_time, steps) = measured;
        let extend = extend_time.as_secs_f64() / runs.max(1) as f64;
        let step = decode_time.as_secs_f64() / steps.max(1) as f64;
        println!(
            "| {n} | {:.1} ms | {:.1} ms | {:.1} | {:.1} |",
            extend * 1e3,
            step * 1e3,
            n as f64 * step / extend,
            n as f64 * step / (samples as f64 * extend)
        );
    }
}
