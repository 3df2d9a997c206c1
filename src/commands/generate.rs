//! `grpo generate`: loads a model (a Hugging Face directory or a `.gguf` file) with its
//! tokenizer and chat template, runs the compiled `prefill` and `decode` programs on the CPU
//! plugin and prints the continuation of one prompt. Temperature 0 is greedy and deterministic;
//! otherwise tokens are sampled on the host from the returned logits with the given seed.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use model::programs::{generate, DeviceModel, GenerateOptions, HostModel};
use model::ChatMessage;
use xla::runtime::Client;
use xla::DType;

/// Arguments of `grpo generate`.
#[derive(clap::Args, Debug)]
#[command(
    about = "Continue a prompt with a model (HF directory or .gguf) on the CPU",
    long_about = "Continue a prompt with a model and print the continuation.\n\n\
                  The model is a Hugging Face directory (config.json, *.safetensors, tokenizer.json, \
                  optionally tokenizer_config.json with a chat template) or a .gguf file (weights \
                  dequantised to f32; tokenizer and chat template from its metadata). The prompt is \
                  run by the compiled prefill program, then one decode step per new token, until \
                  an end-of-sequence token or --max-new-tokens.",
    after_help = "Examples:\n  \
                  grpo generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf --chat \\\n      \
                  --prompt \"What is the capital of France?\" --temperature 0\n  \
                  grpo generate --model ./my-hf-model --prompt \"Once upon a time\" \\\n      \
                  --max-new-tokens 64 --temperature 0.8 --seed 7"
)]
pub struct GenerateArgs {
    /// A Hugging Face model directory or a .gguf file. Example:
    /// `--model models/SmolLM2-135M-Instruct.Q4_1.gguf`.
    #[arg(long, value_name = "PATH")]
    pub model: PathBuf,

    /// The text to continue (with --chat: the user message). Example:
    /// `--prompt "What is the capital of France?"`.
    #[arg(long, value_name = "TEXT")]
    pub prompt: String,

    /// Render the prompt as a user message with the model's chat template (and the generation
    /// prompt) before tokenizing. Example: `--chat`.
    #[arg(long)]
    pub chat: bool,

    /// Most tokens to generate. Example: `--max-new-tokens 64`.
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub max_new_tokens: usize,

    /// Sampling temperature: 0 picks the most likely token every step (greedy, deterministic);
    /// higher values sample more freely. Example: `--temperature 0.7`.
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    pub temperature: f32,

    /// Seed of the sampler (used when --temperature > 0). Example: `--seed 42`.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
}

/// Loads the model, generates and prints the continuation on stdout (timing on stderr).
pub fn run(args: GenerateArgs) -> anyhow::Result<ExitCode> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        anyhow::bail!(
            "--temperature must be a number >= 0 (0 = greedy), got {}",
            args.temperature
        );
    }
    let started = Instant::now();
    let host =
        HostModel::load(&args.model).with_context(|| format!("loading model {}", args.model.display()))?;
    let text = if args.chat {
        let template = host.chat_template.as_ref().with_context(|| {
            format!(
                "--chat: model {} has no chat template (tokenizer_config.json `chat_template` or GGUF \
                 `tokenizer.chat_template`); run without --chat",
                args.model.display()
            )
        })?;
        template
            .render(&[ChatMessage::new("user", args.prompt.clone())], true)
            .context("rendering the chat template")?
    } else {
        args.prompt.clone()
    };
    // A chat template already writes the special tokens it wants.
    let prompt_ids = host
        .tokenizer
        .encode(&text, !args.chat)
        .context("tokenizing the prompt")?;
    let client = Client::cpu(1).context("creating the CPU PJRT client (run scripts/setup.sh)")?;
    let device_model = DeviceModel::upload(&client, &host.weights, DType::F32, 0)?;
    tracing::info!(
        "loaded {} ({} parameters, {} prompt tokens) in {:.1}s",
        args.model.display(),
        host.weights.num_parameters(),
        prompt_ids.len(),
        started.elapsed().as_secs_f64()
    );
    let options = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        seed: args.seed,
        stop_tokens: host.stop_tokens(),
    };
    let t0 = Instant::now();
    let ids = generate(&device_model, &prompt_ids, &options)?;
    let elapsed = t0.elapsed().as_secs_f64();
    let text = host
        .tokenizer
        .decode(&ids, true)
        .context("decoding the generated tokens")?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}")?;
    eprintln!(
        "[{} new tokens in {:.2}s, including compilation]",
        ids.len(),
        elapsed
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(model: &str, temperature: f32) -> GenerateArgs {
        GenerateArgs {
            model: PathBuf::from(model),
            prompt: "hi".to_string(),
            chat: false,
            max_new_tokens: 4,
            temperature,
            seed: 0,
        }
    }

    #[test]
    fn bad_temperature_and_missing_model_are_reported() {
        let err = run(args("models/none.gguf", -1.0)).unwrap_err().to_string();
        assert!(
            err.contains("--temperature must be a number >= 0 (0 = greedy), got -1"),
            "{err}"
        );
        let err = format!("{:#}", run(args("/nonexistent/dir", 0.0)).unwrap_err());
        assert!(err.contains("loading model /nonexistent/dir"), "{err}");
        assert!(err.contains("is not a model: expected a .gguf file"), "{err}");
    }
}
