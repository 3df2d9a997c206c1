//! `grpo worker`: serve one role of a run to an orchestrator over gRPC.

use actors::auth::Token;
use actors::recipe::load_recipe;
use actors::roles::learner::LearnerService;
use actors::roles::reward::LocalReward;
use actors::roles::rollout::{LocalRollout, RolloutService};
use actors::setup;
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
    /// Generate responses with the recipe's model and `rollout:` settings on `cluster.device`;
    /// takes new weights from the orchestrator.
    Rollout,
    /// Train: the recipe's `actor:` updates (and the reference model) on `cluster.device`,
    /// started from the recipe's model or from the checkpoint state the orchestrator sends.
    Learner,
}

#[derive(Args)]
#[command(
    about = "Serve one role of a run (started by `grpo run`; rarely by hand)",
    long_about = "Serve one role of a run to its orchestrator over gRPC.\n\n\
        `grpo run` starts its workers itself as the recipe's `cluster` section says. The worker \
        prints `listening on ADDRESS` once it accepts calls, and refuses every call that does \
        not carry the run's token.",
    after_help = "Example:\n  \
        grpo worker --role reward --recipe recipes/quickstart.yaml --listen 127.0.0.1:0 --token-file run.token\n  \
        grpo worker --role rollout --recipe recipes/quickstart.yaml --token-file run.token\n  \
        grpo worker --role learner --recipe recipes/quickstart.yaml --token-file run.token"
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
    // The rollout engine is built (weights uploaded, decode step compiled) before serving.
    let rollout = match args.role {
        RoleArg::Rollout => Some(rollout_service(&recipe)?),
        RoleArg::Reward | RoleArg::Learner => None,
    };
    // The learner loads the model before serving; it compiles its programs when started.
    let learner = match args.role {
        RoleArg::Learner => Some(learner_service(&recipe)?),
        RoleArg::Reward | RoleArg::Rollout => None,
    };
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
            RoleArg::Rollout => {
                let service = rollout.expect("built above for the rollout role");
                Worker::bind_rollout(args.listen, token, service)
                    .await
                    .with_context(|| format!("cannot listen on {}", args.listen))?
            }
            RoleArg::Learner => {
                let service = learner.expect("built above for the learner role");
                Worker::bind_learner(args.listen, token, service)
                    .await
                    .with_context(|| format!("cannot listen on {}", args.listen))?
            }
        };
        let worker = worker
            .with_tls(recipe.cluster.tls.as_ref())
            .context("setting up TLS for the worker")?;
        let address = worker.local_addr()?;
        println!("listening on {address}");
        std::io::stdout().flush()?;
        worker.serve(shutdown_signal()).await?;
        Ok(ExitCode::SUCCESS)
    })
}

/// The rollout role of `recipe`, built exactly as the orchestrator builds its in-process one:
/// the prepared model's weights in `rollout.dtype` on `cluster.device`, version 0.
fn rollout_service(recipe: &actors::recipe::Recipe) -> Result<RolloutService> {
    let prepared = actors::prepare::prepare(recipe).context("preparing the run")?;
    let client = setup::open_client(recipe)
        .with_context(|| format!("opening the {:?} device", recipe.cluster.device))?;
    let weights =
        setup::upload_rollout_weights(recipe, &prepared, &client).context("uploading the rollout weights")?;
    let engine =
        setup::build_engine(recipe, &prepared, &client, weights, 0).context("building the rollout engine")?;
    Ok(RolloutService::new(
        LocalRollout::new(engine),
        client,
        &prepared.model.weights.config,
        setup::dtype(recipe.rollout.dtype),
        0,
    ))
}

/// The learner role of `recipe`: the prepared model's weights (the start of a new run and the
/// reference model) on `cluster.device`; the learner is built when the orchestrator starts it.
fn learner_service(recipe: &actors::recipe::Recipe) -> Result<LearnerService> {
    let mut prepared = actors::prepare::prepare(recipe).context("preparing the run")?;
    let client = setup::open_client(recipe)
        .with_context(|| format!("opening the {:?} device", recipe.cluster.device))?;
    let config = prepared.model.weights.config.clone();
    LearnerService::new(client, recipe, &config, &mut prepared.model.weights)
        .context("reading the model's weights for the learner")
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
