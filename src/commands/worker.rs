//! `grpo worker`: serve one role of a run to an orchestrator over gRPC.

use actors::auth::Token;
use actors::launcher::ray::registry::{self, Registration, RegistryError};
use actors::recipe::load_recipe;
use actors::roles::learner::LearnerService;
use actors::roles::reward::LocalReward;
use actors::roles::rollout::{LocalRollout, RolloutService};
use actors::roles::Role;
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

impl RoleArg {
    fn role(self) -> Role {
        match self {
            RoleArg::Reward => Role::Reward,
            RoleArg::Rollout => Role::Rollout,
            RoleArg::Learner => Role::Learner,
        }
    }
}

/// Exit status when the orchestrator refuses the worker's registration (or it cannot be sent:
/// TLS files, the address).
const EXIT_REFUSED: u8 = 2;
/// Exit status when the orchestrator cannot be reached, stops answering, or retires the worker.
const EXIT_ORCHESTRATOR_GONE: u8 = 3;

#[derive(Args)]
#[command(
    about = "Serve one role of a run (started by `grpo run`; rarely by hand)",
    long_about = "Serve one role of a run to its orchestrator over gRPC.\n\n\
        `grpo run` starts its workers itself as the recipe's `cluster` section says. The worker \
        prints `listening on ADDRESS` once it accepts calls, and refuses every call that does \
        not carry the run's token.\n\n\
        With `--connect ORCHESTRATOR_ADDRESS` (how the `ray` launcher starts workers on nodes \
        only Ray knows), the worker then registers with that orchestrator: its worker id, role, \
        pool, the address to call it at (with `--listen 0.0.0.0:0`, the IP of its interface \
        that routes to the orchestrator), its devices, grpo version, host and pid. It prints \
        `registered with ORCHESTRATOR_ADDRESS as ID`, then sends a heartbeat every second. \
        Exit status 2: the orchestrator refused it (the reason is printed, e.g. another grpo \
        version). Exit status 3: the orchestrator could not be reached, stopped answering for \
        3 x cluster.worker_timeout_s (at least 5 s), or retired the worker; so no worker outlives \
        its run.",
    after_help = "Examples:\n  \
        grpo worker --role reward --recipe recipes/quickstart.yaml --listen 127.0.0.1:0 --token-file run.token\n  \
        grpo worker --role rollout --recipe recipes/quickstart.yaml --token-file run.token\n  \
        grpo worker --role learner --recipe recipes/quickstart.yaml --token-file run.token\n  \
        grpo worker --role rollout --recipe run/recipe.yaml --token-file run/token \\\n      \
        --listen 0.0.0.0:0 --connect http://10.0.0.5:41234 \\\n      \
        --worker-id rollout-0-a1 --pool tpu-rollout --set cluster.device=tpu"
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

    /// Register with the orchestrator at this address (`http[s]://HOST:PORT`, as `grpo run`
    /// passes it) once listening, then watch it with heartbeats and exit (status 3) when it is
    /// gone. Needs `--worker-id` and `--pool`.
    #[arg(long, value_name = "ORCHESTRATOR_ADDRESS", requires_all = ["worker_id", "pool"])]
    pub connect: Option<String>,

    /// This worker's id in the registration, unique per submission, e.g. `rollout-0-a1`
    /// (with `--connect`).
    #[arg(long, value_name = "ID", requires = "connect")]
    pub worker_id: Option<String>,

    /// The `cluster.pools` entry this worker was started for, e.g. `tpu-rollout` (with
    /// `--connect`).
    #[arg(long, value_name = "NAME", requires = "connect")]
    pub pool: Option<String>,
}

pub fn run(args: WorkerArgs) -> Result<ExitCode> {
    let token = Token::read(&args.token_file)?;
    let recipe = load_recipe(&args.recipe, &args.overrides)?;
    // The rollout engine is built (weights uploaded, decode step compiled) before serving.
    let mut devices = Vec::new();
    let rollout = match args.role {
        RoleArg::Rollout => Some(rollout_service(&recipe, &mut devices)?),
        RoleArg::Reward | RoleArg::Learner => None,
    };
    // The learner loads the model before serving; it compiles its programs when started.
    let learner = match args.role {
        RoleArg::Learner => Some(learner_service(&recipe, &mut devices)?),
        RoleArg::Reward | RoleArg::Rollout => None,
    };
    let registry_token = token.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let worker = match args.role {
            RoleArg::Reward => {
                let function =
                    setup::reward_function(&recipe, true).context("building the reward scorers")?;
                let local = LocalReward::new(Arc::new(function), setup::reward_pool(&recipe)?);
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
        let Some(orchestrator) = args.connect else {
            worker.serve(shutdown_signal()).await?;
            return Ok(ExitCode::SUCCESS);
        };
        // Serve first, so the orchestrator's first call after the registration is answered.
        let mut serving = tokio::spawn(worker.serve(shutdown_signal()));
        let tls = recipe.cluster.tls.as_ref();
        let registration = Registration {
            worker_id: args.worker_id.expect("clap requires --worker-id with --connect"),
            role: args.role.role(),
            pool: args.pool.expect("clap requires --pool with --connect"),
            address: registry::callable_address(address, &orchestrator, tls.is_some()).await?,
            devices,
            grpo_version: env!("CARGO_PKG_VERSION").into(),
            hostname: registry::hostname(),
            pid: std::process::id(),
        };
        match registry::register(&orchestrator, &registry_token, tls, &registration).await {
            Ok(()) => {}
            Err(e @ RegistryError::Unreachable { .. }) => {
                eprintln!("error: {e}");
                return Ok(ExitCode::from(EXIT_ORCHESTRATOR_GONE));
            }
            // Refused, or set up wrongly (TLS files, the address): the same again would fail too.
            Err(e) => {
                eprintln!("error: {e}");
                return Ok(ExitCode::from(EXIT_REFUSED));
            }
        }
        println!("registered with {orchestrator} as {}", registration.worker_id);
        std::io::stdout().flush()?;
        let deadline = registry::heartbeat_deadline(recipe.cluster.worker_timeout_s);
        let watch = registry::heartbeat(
            &orchestrator,
            &registry_token,
            tls,
            &registration.worker_id,
            deadline,
        );
        tokio::select! {
            served = &mut serving => {
                served.context("the worker's server task failed")??;
                Ok(ExitCode::SUCCESS)
            }
            end = watch => {
                eprintln!("error: {end}");
                Ok(ExitCode::from(EXIT_ORCHESTRATOR_GONE))
            }
        }
    })
}

/// The rollout role of `recipe`, built exactly as the orchestrator builds its in-process one:
/// the prepared model's weights in `rollout.dtype` on `cluster.device`, version 0.
/// The client's devices are written to `devices` (for the registration).
fn rollout_service(
    recipe: &actors::recipe::Recipe,
    devices: &mut Vec<registry::Device>,
) -> Result<RolloutService> {
    let prepared = actors::prepare::prepare(recipe).context("preparing the run")?;
    let client = setup::open_client(recipe)
        .with_context(|| format!("opening the {:?} device", recipe.cluster.device))?;
    *devices = registry::devices_of(&client);
    let weights = prepared
        .upload_rollout_weights(recipe, &client)
        .context("uploading the rollout weights")?;
    let config = &prepared.model.weights.config;
    // With LoRA the worker keeps the base and is sent adapters: it starts on the run's initial
    // adapters, as the learner does.
    let policy = setup::policy(recipe, config);
    let (weights, install) = match &policy.lora {
        None => (weights, None),
        Some(lora) => {
            let devices: Vec<usize> = (0..weights.devices()).collect();
            let install = rollout::AdapterInstall::new(
                &client,
                config,
                lora,
                policy.lora_form,
                setup::rollout_dtype(recipe),
                weights,
                &devices,
            )
            .context("preparing the LoRA adapters' install")?;
            let adapter = actors::roles::learner::initial_adapter(recipe, config, lora)?;
            let weights = install
                .install_host(&client, &adapter.tensors)
                .context("installing the initial LoRA adapters")?;
            (weights, Some(install))
        }
    };
    let engine = prepared
        .rollout_engine(recipe, &client, weights, 0)
        .context("building the rollout engine")?;
    let service = RolloutService::new(
        LocalRollout::with_environment(engine, prepared.environment.clone()),
        client,
        config,
        setup::rollout_dtype(recipe),
        0,
        recipe.rollout.tensor_model_parallel_size,
    );
    Ok(match install {
        Some(install) => service.with_adapters(install),
        None => service,
    })
}

/// The learner role of `recipe`: the prepared model's weights (the start of a new run and the
/// reference model) on `cluster.device`; the learner is built when the orchestrator starts it.
/// The client's devices are written to `devices` (for the registration).
fn learner_service(
    recipe: &actors::recipe::Recipe,
    devices: &mut Vec<registry::Device>,
) -> Result<LearnerService> {
    let mut prepared = actors::prepare::prepare(recipe).context("preparing the run")?;
    let client = setup::open_client(recipe)
        .with_context(|| format!("opening the {:?} device", recipe.cluster.device))?;
    *devices = registry::devices_of(&client);
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
