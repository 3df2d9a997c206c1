//! `grpo`: reinforcement-learning post-training (GRPO) for language models on CPU, GPU and TPU.
//!
//! The command line only parses arguments and reports errors; each subcommand lives in
//! `commands/` and calls into the library crates.

mod commands;
#[cfg(test)]
mod docs_check;
#[cfg(test)]
#[allow(dead_code)] // Block::at is for tests/guides.rs, which includes the file too
mod guide_blocks;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "grpo",
    version,
    about = "GRPO post-training for language models, on CPU, GPU and TPU through PJRT",
    long_about = "GRPO post-training for language models, on CPU, GPU and TPU through PJRT.\n\n\
                  Start with `grpo run recipes/quickstart.yaml`; every recipe key is documented in \
                  recipes/README.md."
)]
struct Cli {
    /// More logging (-v info, -vv debug, -vvv trace). RUST_LOG overrides it.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Run(commands::run::RunArgs),
    Devices(commands::devices::DevicesArgs),
    Preprocess(commands::preprocess::PreprocessArgs),
    Generate(commands::generate::GenerateArgs),
    Serve(commands::serve::ServeArgs),
    Worker(commands::worker::WorkerArgs),
    Export(commands::export::ExportArgs),
    Plot(commands::plot::PlotArgs),
    Compile(commands::compile::CompileArgs),
    Verl(commands::verl::VerlArgs),
}

fn main() -> std::process::ExitCode {
    // XLA CPU takes its per-call temporaries from malloc; with glibc's huge-page tunable they
    // arrive in 2 MiB pages instead of fresh 4 KiB faults on every call (BENCHMARKS.md,
    // "Learner"). This re-executes grpo once with the tunable set (same pid); where it cannot,
    // grpo carries on. `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` opts out.
    let _ = trainer::memory::reexec_with_huge_page_malloc();
    let cli = Cli::parse();
    quiet_plugins(cli.verbose);
    init_logging(cli.verbose);
    let result = match cli.command {
        Command::Run(args) => commands::run::run(args),
        Command::Devices(args) => commands::devices::run(args),
        Command::Preprocess(args) => commands::preprocess::run(args),
        Command::Generate(args) => commands::generate::run(args),
        Command::Serve(args) => commands::serve::run(args),
        Command::Worker(args) => commands::worker::run(args),
        Command::Export(args) => commands::export::run(args),
        Command::Plot(args) => commands::plot::run(args),
        Command::Compile(args) => commands::compile::run(args),
        Command::Verl(args) => commands::verl::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", error_text(&err));
            std::process::ExitCode::from(2)
        }
    }
}

/// The PJRT plugins log through absl, and their warnings say nothing a user can act on (Shardy
/// notes on every multi-device compile that the module carries sdy shardings). Quiet by default
/// like the rest of `grpo`, errors still shown; `-v`, or TF_CPP_MIN_LOG_LEVEL set by hand, shows
/// them. Set before any plugin loads or thread starts; worker processes inherit it.
fn quiet_plugins(verbose: u8) {
    if verbose == 0 && std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "2");
    }
}

/// An error and its causes on one line, each said once: many errors already quote their cause
/// in their own message (`cannot write X: <the OS error>`), and the chain would repeat it.
fn error_text(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

#[cfg(test)]
mod tests {
    use super::error_text;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot write out.parquet: {source}; check that its folder is writable")]
    struct Quoting {
        source: std::io::Error,
    }

    #[test]
    fn each_cause_is_said_once() {
        let os = std::io::Error::from(std::io::ErrorKind::NotFound);
        let os_text = os.to_string();
        let err = anyhow::Error::new(Quoting { source: os }).context("grpo preprocess failed");
        assert_eq!(
            error_text(&err),
            format!("grpo preprocess failed: cannot write out.parquet: {os_text}; check that its folder is writable")
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_text(&plain), "outer: inner");
    }
}
