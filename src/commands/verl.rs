//! `grpo verl`: run a VeRL command line (`python3 -m verl.trainer.main_ppo KEY=VALUE...`) as it is.

use actors::verl::{table, translate, version::VERSIONS, VerlInput, SIZE_RULE};
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
#[command(
    about = "Run a VeRL command line: the overrides `python3 -m verl.trainer.main_ppo` takes",
    long_about = "Run a VeRL command line: the overrides `python3 -m verl.trainer.main_ppo` takes.\n\n\
        The config is built as VeRL builds it (VeRL's defaults for the release and \
        `model_engine` the command line is written for, a --config-name file or VeRL's own \
        config of that name, Hydra overrides: key=value, +key=value, ++key=value, ~key) and made \
        a grpo recipe. Scripts of VeRL 0.7.0 and earlier (`reward_model.*`, `reward_manager.*`) \
        and of 0.7.1 and later (`reward.*`, `model_engine=megatron`) both translate; a note says \
        which layout was read. Keys that change nothing here are named in notes; keys of \
        features grpo does not have are errors. `--keys` prints what grpo does with each of \
        VeRL's keys; `--print-recipe` the recipe made, to keep and run with `grpo run`.",
    after_help = "Examples:\n  \
        grpo verl algorithm.adv_estimator=grpo data.train_files=$HOME/data/gsm8k/train.parquet \\\n    \
        actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct trainer.logger='[\"console\",\"wandb\"]'\n  \
        grpo verl --config-path=configs --config-name=my_grpo trainer.total_epochs=2\n  \
        grpo verl model_engine=megatron actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 ...\n  \
        grpo verl --verl-version 0.7.0 reward_model.reward_manager=dapo ...\n  \
        grpo verl ... --print-recipe > my.yaml && grpo run my.yaml\n  \
        sed 's/^LAUNCH=(python3)/LAUNCH=(grpo verl)/' run_qwen3_8b_fsdp.sh | bash   # VeRL's script, its python3 renamed\n  \
        grpo verl --keys"
)]
pub struct VerlArgs {
    /// The directory of --config-name (Hydra's --config-path).
    #[arg(long = "config-path", value_name = "DIR")]
    pub config_path: Option<PathBuf>,

    /// A VeRL config file in --config-path (without .yaml), composed over VeRL's defaults.
    #[arg(long = "config-name", value_name = "NAME")]
    pub config_name: Option<String>,

    /// The VeRL release the command line is written for (0.7.0, 0.9.1, ...; default: told
    /// from its keys, else the newest layout).
    #[arg(long = "verl-version", value_name = "RELEASE")]
    pub verl_version: Option<String>,

    /// `-m verl.trainer.main_ppo`, as a script passes it to python3: accepted, so that a script
    /// whose `python3` (or `LAUNCH`) became `grpo verl` runs unchanged otherwise.
    #[arg(short = 'm', value_name = "MODULE")]
    pub module: Option<String>,

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
    if let Some(module) = args.module.as_deref().filter(|m| *m != "verl.trainer.main_ppo") {
        anyhow::bail!(
            "-m {module}: grpo verl runs what `python3 -m verl.trainer.main_ppo` runs; {module} is \
             another of VeRL's entry points, which grpo does not have"
        );
    }
    if args.keys {
        println!("What `grpo verl` does with each key of VeRL's trainer config");
        println!("(`verl/trainer/config/_generated_ppo*_trainer.yaml`, every `model_engine`), for:");
        for v in VERSIONS {
            println!("- {}: VeRL {} ({})", v.releases, v.commit, v.date);
        }
        println!();
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
        verl_version: args.verl_version,
    })?;
    for note in &t.notes {
        eprintln!("note: {note}");
    }
    let no_device = t.device_is_verls_default.then(missing_cuda).flatten();
    if args.print_recipe {
        if let Some(why) = no_device {
            eprintln!("note: {why}");
        }
        print!("{}", t.recipe.to_yaml());
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(why) = no_device {
        anyhow::bail!(why);
    }
    let options = actors::run::RunOptions {
        quiet: args.quiet,
        worker_program: None,
    };
    super::run::train(&t.recipe, &options)
}

/// Why a command line that leaves `trainer.device` at VeRL's default (`cuda`) cannot run here,
/// naming the device this machine has; None when the CUDA plugin is here. `grpo verl` does not
/// move such a run to another device by itself: VeRL's scripts size their batches and parallel
/// sizes for their GPUs, and the command line (and the recipe it makes, which a resume checks)
/// should say what runs.
fn missing_cuda() -> Option<String> {
    use xla::runtime::{locate_plugin, PluginKind};
    locate_plugin(PluginKind::Cuda, None).err()?;
    let here = |k| locate_plugin(k, None).is_ok();
    let mut fix = if here(PluginKind::Cpu) {
        "add `trainer.device=cpu` to the command line to run it on this machine's CPU".to_string()
    } else {
        "add `trainer.device=cpu` to the command line (after `scripts/setup.sh`, which installs the \
         CPU plugin) to run it on this machine's CPU"
            .to_string()
    };
    if here(PluginKind::Tpu) {
        fix.push_str(" (`trainer.device=tpu` on a TPU VM)");
    }
    Some(format!(
        "`trainer.device` is VeRL's default, cuda, and this machine has no CUDA plugin: {fix}, or \
         install the CUDA plugin: {}",
        PluginKind::Cuda.pip_command()
    ))
}
