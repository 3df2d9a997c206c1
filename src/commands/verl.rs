//! `grpo verl`: run a VeRL command line (`python3 -m verl.trainer.main_ppo KEY=VALUE...`) as it is.

use actors::verl::{table, translate, VerlInput, SIZE_RULE, VERL_COMMIT};
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
#[command(
    about = "Run a VeRL command line: the overrides `python3 -m verl.trainer.main_ppo` takes",
    long_about = "Run a VeRL command line: the overrides `python3 -m verl.trainer.main_ppo` takes.\n\n\
        The config is built as VeRL builds it (VeRL's defaults, a --config-name file, Hydra \
        overrides: key=value, +key=value, ++key=value, ~key) and made a grpo recipe. Keys that \
        change nothing here are named in notes; keys of features grpo does not have are errors. \
        `--keys` prints what grpo does with each of VeRL's keys; `--print-recipe` the recipe made, \
        to keep and run with `grpo run`.",
    after_help = "Examples:\n  \
        grpo verl algorithm.adv_estimator=grpo data.train_files=$HOME/data/gsm8k/train.parquet \\\n    \
        actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct trainer.logger='[\"console\",\"wandb\"]'\n  \
        grpo verl --config-path=configs --config-name=my_grpo trainer.total_epochs=2\n  \
        grpo verl ... --print-recipe > my.yaml && grpo run my.yaml\n  \
        grpo verl --keys"
)]
pub struct VerlArgs {
    /// The directory of --config-name (Hydra's --config-path).
    #[arg(long = "config-path", value_name = "DIR")]
    pub config_path: Option<PathBuf>,

    /// A VeRL config file in --config-path (without .yaml), composed over VeRL's defaults.
    #[arg(long = "config-name", value_name = "NAME")]
    pub config_name: Option<String>,

    /// Print the grpo recipe made from the command line and exit.
    #[arg(long)]
    pub print_recipe: bool,

    /// Print, as Markdown, what grpo does with every key of VeRL's config and exit.
    #[arg(long)]
    pub keys: bool,

    /// No progress bar; one line per step still goes to stderr.
    #[arg(long, short)]
    pub quiet: bool,

    /// Hydra overrides, as given to `python3 -m verl.trainer.main_ppo`.
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

pub fn run(args: VerlArgs) -> Result<ExitCode> {
    if args.keys {
        println!("What `grpo verl` does with each key of VeRL's trainer config");
        println!("(`verl/trainer/config/_generated_ppo_trainer.yaml` at volcengine/verl {VERL_COMMIT}).");
        println!("A section ending in `.*` covers every key under it that has no row of its own.");
        println!(
            "Keys left at VeRL's defaults take VeRL's values; a key with no effect gives a note, and an"
        );
        println!("unsupported one an error, only when set to something else.\n");
        println!("**The size rule.** {SIZE_RULE}\n");
        print!("{}", table::markdown());
        return Ok(ExitCode::SUCCESS);
    }
    let t = translate(&VerlInput {
        overrides: args.overrides,
        config_path: args.config_path,
        config_name: args.config_name,
    })?;
    for note in &t.notes {
        eprintln!("note: {note}");
    }
    if args.print_recipe {
        print!("{}", t.recipe.to_yaml());
        return Ok(ExitCode::SUCCESS);
    }
    let options = actors::run::RunOptions {
        quiet: args.quiet,
        worker_program: None,
    };
    super::run::train(&t.recipe, &options)
}
