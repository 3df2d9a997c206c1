//! `grpo export`: writes a learner checkpoint as a Hugging Face checkpoint directory
//! (safetensors, `config.json`, tokenizer files with the chat template) that transformers
//! loads, through `trainer::export`. A LoRA run's checkpoint (its adapter config recorded in
//! `state.json`) exports as a PEFT adapter, or with `--merged` as the merged model.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use trainer::checkpoint::latest_checkpoint;
use trainer::export::{export_checkpoint, ExportOptions};

/// Arguments of `grpo export`.
#[derive(clap::Args, Debug)]
#[command(
    about = "Export a training checkpoint as a Hugging Face model directory",
    long_about = "Export a training checkpoint as a Hugging Face model directory that transformers \
                  loads: model.safetensors with the trained parameters (f32, or bf16 with \
                  --dtype bf16), config.json, tokenizer.json and tokenizer_config.json with the \
                  chat template of the model the run started from. The checkpoint's checksums \
                  are verified first, and every tensor is checked by name and shape against the \
                  model's parameter table. A LoRA run's checkpoint exports as a PEFT adapter \
                  (adapter_config.json, adapter_model.safetensors) that PEFT loads on the base \
                  model, or with --merged as the merged model.",
    after_help = "Examples:\n  \
                  grpo export runs/gsm8k/checkpoints/step_200 --output exported/gsm8k-step200\n  \
                  grpo export runs/gsm8k --output exported/latest --dtype bf16\n  \
                  grpo export runs/gsm8k-lora --output exported/lora-adapter\n  \
                  grpo export runs/gsm8k-lora --output exported/lora-merged --merged\n  \
                  grpo export runs/gsm8k/checkpoints/step_50 --output out --model models/SmolLM2-135M-Instruct.Q4_1.gguf"
)]
pub struct ExportArgs {
    /// A checkpoint directory (`OUTPUT/checkpoints/step_N`), or a run's output directory to
    /// export its newest complete checkpoint. Example: `runs/gsm8k/checkpoints/step_200`.
    #[arg(value_name = "CHECKPOINT")]
    checkpoint: PathBuf,
    /// The Hugging Face model directory to write (replaced if it exists). Example:
    /// `--output exported/step200`.
    #[arg(long, value_name = "DIR")]
    output: PathBuf,
    /// The model the run trained (a .gguf file or a Hugging Face model directory), for the
    /// config and tokenizer. Default: the `model_path` recorded in the checkpoint's state.json.
    /// Example: `--model models/SmolLM2-135M-Instruct.Q4_1.gguf`.
    #[arg(long, value_name = "PATH")]
    model: Option<PathBuf>,
    /// Element type of the exported weights. Example: `--dtype bf16`.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
    /// For a LoRA run (`actor.lora_rank`): write the base model with the adapters merged in
    /// (a Hugging Face model) instead of the PEFT adapter. Example: `--merged`.
    #[arg(long)]
    merged: bool,
}

/// The checkpoint directory `path` names: itself when it holds a `manifest.json`, else the
/// newest complete checkpoint of the run whose output directory it is.
fn resolve_checkpoint(path: &Path) -> anyhow::Result<PathBuf> {
    if path.join("manifest.json").is_file() || !path.join("checkpoints").is_dir() {
        return Ok(path.to_path_buf());
    }
    latest_checkpoint(path)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{}: no complete checkpoint (a step_N directory with manifest.json) under {}; \
                 pass a checkpoint directory",
                path.display(),
                path.join("checkpoints").display()
            )
        })
}

/// Runs `grpo export`.
pub fn run(args: ExportArgs) -> anyhow::Result<ExitCode> {
    let checkpoint = resolve_checkpoint(&args.checkpoint)?;
    let options = ExportOptions {
        model: args.model,
        // clap lets only f32 and bf16 through.
        dtype: args.dtype.parse()?,
        merged: args.merged,
    };
    // The export errors carry their causes in their messages; print them once.
    let summary = export_checkpoint(&checkpoint, &args.output, &options)
        .map_err(|e| anyhow::anyhow!("grpo export failed: {e}"))?;
    println!(
        "exported step {} of {} ({} tensors, {} parameters, {}) to {}: {}",
        summary.step,
        checkpoint.display(),
        summary.tensors,
        summary.parameters,
        args.dtype,
        summary.output.display(),
        summary.files.join(", ")
    );
    println!("model config and tokenizer from {}", summary.model.display());
    Ok(ExitCode::SUCCESS)
}
