//! `grpo worker`: serve one role of a run to an orchestrator over gRPC.

use actors::auth::Token;
use actors::recipe::load_recipe;
use actors::roles::reward::LocalReward;
use actors::worker::Worker;
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Clone, Copy, ValueEnum)]
pub enum RoleArg {
    /// Score responses with the recipe's `reward:` scorers.
    Reward,
}

#[derive(Args)]
#[command(
    about = "Serve one role of a run (started by `grpo run`; rarely by hand)",
    long_about = "Serve one role of a run to its orchestrator over gRPC.\n\n\
        `grpo run` starts its workers itself as the recipe's `cluster` section says. The worker \
        prints `listening on ADDRESS` once it accepts calls, and refuses every call that does \
        not carry the run's token.",
    after_help = "Example:\n  \
        grpo worker --role reward --recipe recipes/quickstart.yaml --listen 127.0.0.1:0 --token-file run.token"
)]
pub struct WorkerArgs {
    /// The role to serve.
    #[arg(long, value_enum)]
    pub role: RoleArg,

    /// The run's recipe (the worker builds its role from it), e.g. `recipes/quickstart.yaml`.
    #[arg(long)]
    pub recipe: PathBuf,

    /// Recipe overrides, as for `grpo run`; repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,

    /// Address to listen on; port 0 picks a free port. Loopback unless you mean otherwise,
    /// e.g. `--listen 0.0.0.0:7001` to accept calls from other hosts.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,

    /// File holding the run's token (one line); calls without it are refused.
    #[arg(long, value_name = "FILE")]
    pub token_file: PathBuf,
}

pub fn run(args: WorkerArgs) -> Result<ExitCode> {
    let token = Token::read(&args.token_file)?;
    let recipe = load_recipe(&args.recipe, &args.overrides)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let worker = match args.role {
            RoleArg::Reward => {
                let function = recipe
                    .reward
                    .build(Some(recipe.data.max_response_length))
                    .context("building the reward scorers")?;
                let local = LocalReward::new(Arc::new(function), recipe.reward.pool_options()?);
                Worker::bind_reward(args.listen, token, local)
                    .await
                    .with_context(|| format!("cannot listen on {}", args.listen))?
            }
        };
        let address = worker.local_addr()?;
        println!("listening on {address}");
        std::io::stdout().flush()?;
        worker.serve(shutdown_signal()).await?;
        Ok(ExitCode::SUCCESS)
    })
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install a SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
