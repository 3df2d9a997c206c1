//! `grpo devices`: lists the PJRT plugins found on this host (kind, path, PJRT C API version) and
//! their devices (kind, count, memory where the plugin reports it); for libtpu with no TPU chip,
//! says that only deviceless compilation is available and lists the topologies it compiles for.

use std::path::PathBuf;
use std::process::ExitCode;

use xla::runtime::inventory::probe_plugin;
use xla::runtime::PluginKind;

/// Arguments of `grpo devices`.
#[derive(clap::Args, Debug)]
#[command(
    about = "List the PJRT plugins (cpu, cuda, tpu) found on this host and their devices",
    long_about = "List the PJRT plugins found on this host and their devices.\n\n\
                  Each plugin is looked for in this order: --path, then the environment variable \
                  (GRPO_PJRT_CPU, GRPO_PJRT_CUDA, GRPO_PJRT_TPU), then the Python packages \
                  that ship them (lammps-jax-pjrt-cpu, jax-cuda13-pjrt, libtpu) in the checkout's \
                  .venv (made by scripts/setup.sh), in the active virtual environment \
                  ($VIRTUAL_ENV) and in python3's site-packages. For each one found it \
                  prints the file, its PJRT C API version and its devices; when one is missing it \
                  prints the pip command that installs it. libtpu on a host without a TPU can \
                  still compile programs for a named topology (deviceless); those topologies are \
                  listed.",
    after_help = "Examples:\n  grpo devices\n  grpo devices --plugin tpu\n  \
                  grpo devices --plugin cpu --path ./pjrt_c_api_cpu_plugin.so"
)]
pub struct DevicesArgs {
    /// Only this plugin: cpu, cuda (or gpu) or tpu. Example: `grpo devices --plugin tpu`.
    #[arg(long, value_name = "KIND", value_parser = ["cpu", "cuda", "gpu", "tpu"])]
    pub plugin: Option<String>,

    /// Load the plugin from this file instead of searching (needs --plugin). Example:
    /// `grpo devices --plugin cuda --path /opt/pjrt/xla_cuda_plugin.so`.
    #[arg(long, value_name = "PLUGIN.so", requires = "plugin")]
    pub path: Option<PathBuf>,
}

/// Prints the listing. Fails when a plugin asked for with --plugin cannot be found or loaded;
/// without --plugin, fails only when no plugin at all was found.
pub fn run(args: DevicesArgs) -> anyhow::Result<ExitCode> {
    let kinds: Vec<PluginKind> = match &args.plugin {
        Some(name) => vec![PluginKind::parse(name)
            .ok_or_else(|| anyhow::anyhow!("unknown plugin kind `{name}`: use cpu, cuda or tpu"))?],
        None => PluginKind::ALL.to_vec(),
    };
    let mut any_loaded = false;
    for kind in &kinds {
        let report = probe_plugin(*kind, args.path.as_deref());
        print!("{report}");
        any_loaded |= report.loaded();
    }
    if !any_loaded {
        anyhow::bail!(
            "no PJRT plugin {} could be loaded (see above for what to install)",
            args.plugin
                .as_deref()
                .map(|k| format!("for {k}"))
                .unwrap_or_default()
        );
    }
    Ok(ExitCode::SUCCESS)
}
