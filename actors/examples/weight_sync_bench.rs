//! Weight sync benchmark: SmolLM2-135M's parameters pushed to a rollout worker in another
//! process over loopback gRPC, in three cases: f32 device buffers (as an f32 learner holds
//! them) into an f32 worker; the same f32 buffers into a bf16 worker (converted on the way);
//! bf16 device buffers into a bf16 worker (what `grpo run` sends a bf16 rollout: the learner's
//! weights are converted on the device first, `rollout::handoff`). Prints the median time of
//! several pushes and the rate in GB/s of weight bytes delivered in the worker's dtype.
//!
//! ```text
//! cargo run --release -p actors --example weight_sync_bench -- \
//!     [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--pushes 5]
//! ```
//!
//! The worker is this program started again with `--serve DTYPE MODEL TOKEN_FILE`: it loads the
//! same model, builds a rollout engine over it and serves it as `grpo worker --role rollout`
//! does, printing `listening on ADDRESS` once bound.

use actors::auth::Token;
use actors::roles::rollout::{LocalRollout, RemoteRollout, RolloutRole, RolloutService, WeightUpdate};
use actors::worker::Worker;
use model::programs::HostModel;
use rollout::{upload_weights, Engine, EngineConfig};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;
use xla::runtime::Client;
use xla::DType;

type Error = Box<dyn std::error::Error>;

fn parse_dtype(name: &str) -> Result<DType, Error> {
    Ok(name.parse()?)
}

/// The worker side: serve `model` as a rollout worker with weights in `dtype`.
fn serve(dtype: DType, model: &Path, token_file: &Path) -> Result<(), Error> {
    let token = Token::read(token_file)?;
    let host = HostModel::load(model)?;
    let client = Client::cpu(1)?;
    let weights = upload_weights(&client, &host.weights, dtype, 0)?;
    let engine = Engine::new(
        &client,
        &host.weights.config,
        weights,
        0,
        EngineConfig::new(2, 32),
        None,
    )?;
    let service = RolloutService::new(
        LocalRollout::new(engine),
        client,
        &host.weights.config,
        dtype,
        0,
        1,
    );
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let worker = Worker::bind_rollout("127.0.0.1:0".parse()?, token, service).await?;
        println!("listening on {}", worker.local_addr()?);
        std::io::stdout().flush()?;
        worker.serve(std::future::pending()).await?;
        Ok(())
    })
}

/// The worker process; killed when the benchmark ends.
struct WorkerProcess {
    child: Child,
    address: String,
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_worker(dtype: DType, model: &Path, token_file: &Path) -> Result<WorkerProcess, Error> {
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--serve")
        .arg(dtype.to_string())
        .arg(model)
        .arg(token_file)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    let address = line
        .trim()
        .strip_prefix("listening on ")
        .ok_or_else(|| format!("the worker said {line:?} instead of `listening on ADDRESS`"))?
        .to_string();
    Ok(WorkerProcess {
        child,
        address: format!("http://{address}"),
    })
}

/// CPU seconds (user + system) process `pid` has used so far, from `/proc/PID/stat`.
fn cpu_seconds(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return f64::NAN;
    };
    // Fields after the command name: state is field 3, utime 14, stime 15.
    let after = &stat[stat.rfind(')').map_or(0, |i| i + 2)..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 =
        fields[11].parse::<f64>().unwrap_or(f64::NAN) + fields[12].parse::<f64>().unwrap_or(f64::NAN);
    // SAFETY: sysconf has no preconditions.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--serve") {
        let [_, dtype, model, token_file] = args.as_slice() else {
            return Err("usage: --serve DTYPE MODEL TOKEN_FILE".into());
        };
        return serve(parse_dtype(dtype)?, Path::new(model), Path::new(token_file));
    }
    let mut model = PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut pushes = 5usize;
    let mut rest = args.iter();
    while let Some(a) = rest.next() {
        match a.as_str() {
            "--model" => model = rest.next().ok_or("--model needs a path")?.into(),
            "--pushes" => pushes = rest.next().ok_or("--pushes needs a count")?.parse()?,
            other => return Err(format!("unknown argument {other:?} (use --model PATH, --pushes N)").into()),
        }
    }
    if !model.exists() {
        return Err(format!(
            "{} is missing: fetch it with model/scripts/fetch_assets.sh",
            model.display()
        )
        .into());
    }

    let dir = std::env::temp_dir().join(format!("weight_sync_bench.{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let token = Token::generate();
    let token_file = dir.join("token");
    token.write(&token_file)?;

    // The learner's side: its parameters on its device, f32 and bf16.
    let host = HostModel::load(&model)?;
    let client = Client::cpu(1)?;
    let on_device = |dtype| -> Result<std::sync::Arc<[xla::runtime::Buffer]>, Error> {
        Ok(upload_weights(&client, &host.weights, dtype, 0)?.into())
    };
    let (params_f32, params_bf16) = (on_device(DType::F32)?, on_device(DType::BF16)?);
    let elements: usize = params_f32
        .iter()
        .map(|b| b.dims().iter().product::<i64>() as usize)
        .sum();
    println!(
        "{}: {} tensors, {:.1} M parameters; {} timed pushes after one warm-up",
        model.display(),
        params_f32.len(),
        elements as f64 / 1e6,
        pushes
    );

    let runtime = tokio::runtime::Runtime::new()?;
    for (source, dtype) in [
        (&params_f32, DType::F32),
        (&params_f32, DType::BF16),
        (&params_bf16, DType::BF16),
    ] {
        let params = source.clone();
        let from = source[0].dtype();
        let worker = start_worker(dtype, &model, &token_file)?;
        let bytes = (elements * dtype.size_bytes()) as f64;
        let worker_pid = worker.child.id().to_string();
        let seconds = runtime.block_on(async {
            let remote = RemoteRollout::new(&worker.address, &token, None)?;
            remote.refresh().await?;
            let mut seconds = Vec::new();
            let mut cpu = (0.0, 0.0);
            for version in 1..=pushes as u64 + 1 {
                if version == 2 {
                    cpu = (cpu_seconds("self"), cpu_seconds(&worker_pid));
                }
                let started = Instant::now();
                remote
                    .update_weights(WeightUpdate {
                        version,
                        params: params.clone().into(),
                    })
                    .await?;
                if version > 1 {
                    seconds.push(started.elapsed().as_secs_f64());
                }
            }
            let cpu = (
                (cpu_seconds("self") - cpu.0) / pushes as f64,
                (cpu_seconds(&worker_pid) - cpu.1) / pushes as f64,
            );
            assert_eq!(remote.refresh().await?, pushes as u64 + 1);
            Ok::<_, Error>((seconds, cpu))
        })?;
        let (seconds, (client_cpu, worker_cpu)) = seconds;
        let m = median(seconds.clone());
        println!(
            "{from:>4} buffers -> {dtype:>4} worker: {:.1} MB per push, median {:.3} s (min {:.3}, max {:.3}) = {:.2} GB/s",
            bytes / 1e6,
            m,
            seconds.iter().cloned().fold(f64::INFINITY, f64::min),
            seconds.iter().cloned().fold(0.0, f64::max),
            bytes / m / 1e9
        );
        println!(
            "      CPU per push: sender {client_cpu:.3} s, worker {worker_cpu:.3} s \
             (with a core each and no other load: ~{:.2} GB/s)",
            bytes / client_cpu.max(worker_cpu) / 1e9
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
