//! `grpo run`: train a policy as a recipe says.

use actors::recipe::load_recipe;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
#[command(
    about = "Train a policy with GRPO as a recipe describes",
    long_about = "Train a policy with GRPO as a recipe describes.\n\n\
        The recipe is a YAML file; every key is documented in recipes/README.md and has a \
        default except `model.path` and `data.train_files`. Relative paths in it are read from \
        the current directory.",
    after_help = "Examples:\n  \
        grpo run recipes/quickstart.yaml\n  \
        grpo run recipes/quickstart.yaml --set rollout.n=8 --set actor.optim.lr=2e-6\n  \
        grpo run recipes/gsm8k-smollm2.yaml --output runs/gsm8k --print-config"
)]
pub struct RunArgs {
    /// The recipe file (YAML), for example `recipes/quickstart.yaml`.
    pub recipe: PathBuf,

    /// Override one recipe key, as KEY=VALUE with a dotted key; repeatable.
    /// The value is read as YAML: `--set rollout.n=8`, `--set data.val_files=[a.parquet,b.parquet]`,
    /// `--set model.tokenizer=` (empty: unset).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,

    /// Directory for checkpoints, metrics and plots (overrides `trainer.output_dir`),
    /// for example `--output runs/try1`.
    #[arg(long, value_name = "DIR")]
    pub output: Option<PathBuf>,

    /// Print the fully resolved recipe (defaults filled in, overrides applied) as YAML and exit.
    #[arg(long)]
    pub print_config: bool,

    /// No progress bar; one line per step still goes to stderr.
    #[arg(long, short)]
    pub quiet: bool,

    /// Start each worker process as PROGRAM instead of this `grpo` binary: a wrapper such as a
    /// script running `numactl ... grpo "$@"` or a profiler. It gets the worker's arguments
    /// (`worker --role ROLE ...`) and must print the worker's `listening on ADDRESS` line.
    #[arg(long, value_name = "PROGRAM")]
    pub worker_program: Option<PathBuf>,
}

pub fn run(args: RunArgs) -> Result<ExitCode> {
    let mut overrides = args.overrides.clone();
    if let Some(dir) = &args.output {
        overrides.push(format!(
            "trainer.output_dir={}",
            yaml_string(&dir.display().to_string())
        ));
    }
    let recipe = load_recipe(&args.recipe, &overrides)?;
    if args.print_config {
        print!("{}", recipe.to_yaml());
        return Ok(ExitCode::SUCCESS);
    }
    let options = actors::run::RunOptions {
        quiet: args.quiet,
        worker_program: args.worker_program.clone(),
    };
    train(&recipe, &options)
}

/// Trains and says where the results went (shared with `grpo verl`).
pub fn train(recipe: &actors::recipe::Recipe, options: &actors::run::RunOptions) -> Result<ExitCode> {
    let summary = actors::run::train(recipe, options)?;
    let output = summary.output.display();
    if summary.resumed_from >= summary.steps {
        eprintln!(
            "{output} already holds step {} of {}: nothing to do (set trainer.total_training_steps \
             higher to train further, or trainer.resume_mode: disable to start over)",
            summary.resumed_from, summary.steps
        );
    } else {
        eprintln!("trained to step {} in {output}", summary.steps);
    }
    if let Some(ck) = &summary.last_checkpoint {
        eprintln!(
            "checkpoint: {} (export it with `grpo export {output}`)",
            ck.display()
        );
    }
    eprintln!("metrics: {output}/metrics.jsonl (charts: `grpo plot {output}`)");
    Ok(ExitCode::SUCCESS)
}

/// Quote a string for YAML so that paths with `:` or `#` stay one scalar.
fn yaml_string(s: &str) -> String {
    serde_yaml::to_string(s)
        .expect("strings serialize")
        .trim_end()
        .to_string()
}
