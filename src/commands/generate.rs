//! `grpo generate`: loads a model (a Hugging Face directory or a `.gguf` file) with its
//! tokenizer and chat template and continues prompts with the rollout engine (continuous
//! batching, one prefill per prompt shared by its `--n` samples, sampling on the device).
//! Temperature 0 is greedy and deterministic; otherwise each prompt's samples come from the
//! seed, whatever else is in the batch.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use model::programs::HostModel;
use model::{ChatMessage, LoraAdapter};
use rollout::{Engine, EngineConfig, GenerationRequest, SamplingParams};
use xla::runtime::{Client, ClientOptions, PluginKind};
use xla::DType;

/// Arguments of `grpo generate`.
#[derive(clap::Args, Debug)]
#[command(
    about = "Continue prompts with a model (HF directory or .gguf) on the CPU, a GPU or a TPU",
    long_about = "Continue prompts with a model and print the continuations.\n\n\
                  The model is a Hugging Face directory (config.json, *.safetensors, tokenizer.json, \
                  optionally tokenizer_config.json with a chat template) or a .gguf file (weights \
                  dequantised to f32; tokenizer and chat template from its metadata). Prompts come \
                  from --prompt or from --prompts-file: a text file with one prompt per line, or a \
                  Parquet file in VeRL's schema (its chat messages are always rendered with the chat \
                  template). One --prompt with --n 1 prints the continuation as text; otherwise each \
                  sample is one JSON line on stdout. --device picks the PJRT plugin (found as \
                  `grpo devices` finds it) and --dtype the type of the weights and the KV cache.",
    after_help = "Examples:\n  \
                  grpo generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf --chat \\\n      \
                  --prompt \"What is the capital of France?\" --temperature 0\n  \
                  grpo generate --model ./my-hf-model --prompts-file prompts.txt --n 4 \\\n      \
                  --max-new-tokens 64 --temperature 0.8 --seed 7 > samples.jsonl\n  \
                  grpo generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\\n      \
                  --prompts-file datasets/arithmetic/val.parquet --n 2 --temperature 1\n  \
                  grpo generate --model ./Qwen2.5-0.5B-Instruct --adapter ./my-lora --chat \\\n      \
                  --prompt \"What is 13 + 11?\"\n  \
                  grpo generate --model ./Qwen2.5-0.5B-Instruct --device cuda --dtype bf16 \\\n      \
                  --prompts-file prompts.txt --max-num-seqs 64 > samples.jsonl"
)]
pub struct GenerateArgs {
    /// A Hugging Face model directory or a .gguf file. Example:
    /// `--model models/SmolLM2-135M-Instruct.Q4_1.gguf`.
    #[arg(long, value_name = "PATH")]
    pub model: PathBuf,

    /// A LoRA adapter to generate with: PEFT's directory (adapter_config.json and
    /// adapter_model.safetensors) made for this base model, merged into its weights on load.
    /// Example: `--adapter ./my-lora`.
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,

    /// The text to continue (with --chat: the user message). Example:
    /// `--prompt "What is the capital of France?"`.
    #[arg(
        long,
        value_name = "TEXT",
        required_unless_present = "prompts_file",
        conflicts_with = "prompts_file"
    )]
    pub prompt: Option<String>,

    /// Prompts to continue: a text file (one prompt per line) or a Parquet file in VeRL's schema
    /// (`.parquet`). Example: `--prompts-file prompts.txt`.
    #[arg(long, value_name = "FILE")]
    pub prompts_file: Option<PathBuf>,

    /// Samples per prompt. Example: `--n 4`.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub n: usize,

    /// Render each text prompt as a user message with the model's chat template (and the
    /// generation prompt) before tokenizing. Example: `--chat`.
    #[arg(long)]
    pub chat: bool,

    /// Most tokens to generate per sample. Example: `--max-new-tokens 64`.
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub max_new_tokens: usize,

    /// Sampling temperature: 0 picks the most likely token every step (greedy, deterministic);
    /// higher values sample more freely. Example: `--temperature 0.7`.
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    pub temperature: f32,

    /// Keep only the k most likely tokens; 0 keeps all. Example: `--top-k 50`.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub top_k: usize,

    /// Keep the smallest set of tokens whose probability reaches p. Example: `--top-p 0.9`.
    #[arg(long, value_name = "P", default_value_t = 1.0)]
    pub top_p: f32,

    /// Keep only tokens at least this likely relative to the most likely one (vLLM's min-p,
    /// before top-p); 0 keeps all. Example: `--min-p 0.05`.
    #[arg(long, value_name = "P", default_value_t = 0.0)]
    pub min_p: f32,

    /// Seed of the sampler; prompt i uses seed + i. Example: `--seed 42`.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,

    /// Sequences decoded at once (KV-cache slots). Example: `--max-num-seqs 32`.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub max_num_seqs: usize,

    /// The device to generate on: cpu, cuda (or gpu) or tpu; its first device is used.
    /// Example: `--device cuda`.
    #[arg(long, value_name = "KIND", default_value = "cpu", value_parser = ["cpu", "cuda", "gpu", "tpu"])]
    pub device: String,

    /// Type of the weights and the KV cache: f32 or bf16. Example: `--dtype bf16`.
    #[arg(long, value_name = "DTYPE", default_value = "f32", value_parser = ["f32", "bf16"])]
    pub dtype: String,
}

/// Token ids of each prompt, rendered and tokenized as the model expects.
fn prompt_ids(args: &GenerateArgs, host: &HostModel) -> anyhow::Result<Vec<Vec<u32>>> {
    let render = |messages: &[ChatMessage]| -> anyhow::Result<Vec<u32>> {
        let template = host.chat_template.as_ref().with_context(|| {
            format!(
                "model {} has no chat template (tokenizer_config.json `chat_template` or GGUF \
                 `tokenizer.chat_template`); use text prompts without --chat",
                args.model.display()
            )
        })?;
        let text = template
            .render(messages, true)
            .context("rendering the chat template")?;
        // The template writes the special tokens it wants.
        Ok(host.tokenizer.encode(&text, false)?)
    };
    let text = |t: &str| -> anyhow::Result<Vec<u32>> {
        if args.chat {
            render(&[ChatMessage::new("user", t)])
        } else {
            Ok(host.tokenizer.encode(t, true)?)
        }
    };
    let Some(file) = &args.prompts_file else {
        return Ok(vec![text(args.prompt.as_deref().unwrap_or_default())?]);
    };
    if file
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
    {
        return parquet_prompts(file, &render, &text);
    }
    let lines = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let prompts: Vec<Vec<u32>> = lines
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(text)
        .collect::<anyhow::Result<_>>()?;
    if prompts.is_empty() {
        bail!(
            "{} holds no prompts (one prompt per non-empty line)",
            file.display()
        );
    }
    Ok(prompts)
}

fn parquet_prompts(
    file: &Path,
    render: &dyn Fn(&[ChatMessage]) -> anyhow::Result<Vec<u32>>,
    text: &dyn Fn(&str) -> anyhow::Result<Vec<u32>>,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let config = data::DataConfig {
        train_files: data::DataFiles(vec![file.to_path_buf()]),
        ..Default::default()
    };
    let dataset = data::PromptDataset::open(&config, data::Split::Train, None)?;
    let positions: Vec<u64> = (0..dataset.len()).collect();
    dataset
        .read(&positions)?
        .iter()
        .map(|example| match &example.prompt {
            data::Prompt::Messages(m) => render(
                &m.iter()
                    .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
                    .collect::<Vec<_>>(),
            ),
            data::Prompt::Text(t) => text(t),
        })
        .collect()
}

/// Loads the model, generates and prints the continuations on stdout (timing on stderr).
pub fn run(args: GenerateArgs) -> anyhow::Result<ExitCode> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!(
            "--temperature must be a number >= 0 (0 = greedy), got {}",
            args.temperature
        );
    }
    if args.n == 0 || args.n > args.max_num_seqs {
        bail!(
            "--n must be between 1 and --max-num-seqs ({}), got {}",
            args.max_num_seqs,
            args.n
        );
    }
    let started = Instant::now();
    let mut host =
        HostModel::load(&args.model).with_context(|| format!("loading model {}", args.model.display()))?;
    let prompts = prompt_ids(&args, &host)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let kind = PluginKind::parse(&args.device).expect("clap checked --device");
    let dtype = if args.dtype == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    let client = match kind {
        PluginKind::Cpu => Client::cpu(1),
        _ => Client::new(kind, None, ClientOptions::default()),
    }
    .with_context(|| {
        format!(
            "creating the {} PJRT client (`grpo devices --plugin {}` says what is missing)",
            args.device, args.device
        )
    })?;
    if let Some(dir) = &args.adapter {
        let adapter = LoraAdapter::load_peft(dir, &host.weights.config)
            .with_context(|| format!("loading the adapter for {}", args.model.display()))?;
        host.weights = adapter.merge_into(&client, 0, &host.weights)?;
    }
    let weights = rollout::upload_weights(&client, &host.weights, dtype, 0)?;
    let mut settings = EngineConfig::new(args.max_num_seqs, longest + args.max_new_tokens + 1);
    settings.eos_token_ids = host.stop_tokens();
    let mut engine = Engine::new(
        &client,
        &host.weights.config,
        weights,
        0,
        settings,
        Some(host.tokenizer.clone()),
    )?;
    tracing::info!(
        "loaded {} ({} parameters, {} prompts) in {:.1}s",
        args.model.display(),
        host.weights.num_parameters(),
        prompts.len(),
        started.elapsed().as_secs_f64()
    );
    let json = args.prompts_file.is_some() || args.n > 1;
    let mut out = std::io::stdout().lock();
    for (i, prompt) in prompts.into_iter().enumerate() {
        let request = GenerationRequest {
            id: i as u64,
            prompt,
            n: args.n,
            seed: args.seed + i as u64,
            params: SamplingParams {
                temperature: args.temperature,
                top_k: args.top_k,
                top_p: args.top_p,
                min_p: args.min_p,
                max_new_tokens: args.max_new_tokens,
                ..Default::default()
            },
            multi_turn: None,
        };
        if let Err(e) = engine.submit(request) {
            if !json {
                return Err(e.into());
            }
            writeln!(
                out,
                "{}",
                serde_json::json!({"prompt_index": i, "error": e.to_string()})
            )?;
        }
    }
    let t0 = Instant::now();
    let mut generated = 0;
    while engine.has_work() {
        for s in engine.step()? {
            generated += s.response_ids.len();
            if json {
                let line = serde_json::json!({
                    "prompt_index": s.request_id,
                    "sample_index": s.sample_index,
                    "text": s.text,
                    "response_ids": s.response_ids,
                    "logprobs": s.logprobs,
                    "finish_reason": s.finish_reason.to_string(),
                    "weight_version": s.weight_version,
                });
                writeln!(out, "{line}")?;
            } else {
                writeln!(out, "{}", s.text)?;
            }
        }
    }
    eprintln!(
        "[{generated} new tokens in {:.2}s, including compilation]",
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(model: &str, temperature: f32) -> GenerateArgs {
        GenerateArgs {
            model: PathBuf::from(model),
            adapter: None,
            prompt: Some("hi".to_string()),
            prompts_file: None,
            n: 1,
            chat: false,
            max_new_tokens: 4,
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            max_num_seqs: 4,
            device: "cpu".to_string(),
            dtype: "f32".to_string(),
        }
    }

    #[test]
    fn bad_arguments_and_missing_model_are_reported() {
        let err = run(args("models/none.gguf", -1.0)).unwrap_err().to_string();
        assert!(
            err.contains("--temperature must be a number >= 0 (0 = greedy), got -1"),
            "{err}"
        );
        let err = run(GenerateArgs {
            n: 9,
            ..args("models/none.gguf", 0.0)
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--n must be between 1 and --max-num-seqs (4), got 9"),
            "{err}"
        );
        let err = format!("{:#}", run(args("/nonexistent/dir", 0.0)).unwrap_err());
        assert!(err.contains("loading model /nonexistent/dir"), "{err}");
        assert!(err.contains("is not a model: expected a .gguf file"), "{err}");
    }
}
