//! Helpers shared by the end-to-end tests: the real SmolLM2 tokenizer and chat template on a
//! tiny random-weight decoder (so a whole training loop runs in seconds), and datasets made by
//! `grpo preprocess`.
#![allow(dead_code)]

pub mod ray_head;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// The tiny runs' validation score: VeRL's core metric of the arithmetic data source (the
/// tiny recipe's scorer reports no `acc`, so the core variable is `reward`), one response per
/// problem.
pub const VAL_CORE: &str = "val-core/grpo/arithmetic/reward/mean@1";

/// The `grpo` binary under test.
pub fn grpo() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_grpo"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

/// `grpo worker --role ROLE --recipe RECIPE --token-file TOKEN_FILE`, ready for more arguments.
pub fn worker(
    role: &str,
    recipe: impl AsRef<std::ffi::OsStr>,
    token_file: impl AsRef<std::ffi::OsStr>,
) -> Command {
    let mut c = grpo();
    c.args(["worker", "--role", role, "--recipe"])
        .arg(recipe)
        .arg("--token-file")
        .arg(token_file);
    c
}

/// Runs `grpo args...` and returns its output.
pub fn run_grpo(args: &[&str]) -> Output {
    grpo().args(args).output().expect("run grpo")
}

pub use testkit::tiny_chat_model;

/// `grpo export RUN --output DEST` of a run that trained `model`: the export loads with the
/// model's config, and each of `trained` (tensor names) differs from the model's.
pub fn assert_exported_and_trained(run: &Path, dest: &Path, model: &Path, trained: &[&str]) {
    let o = run_grpo(&[
        "export",
        run.to_str().unwrap(),
        "--output",
        dest.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let before = model::safetensors_io::load_hf_checkpoint(model).unwrap();
    let after = model::safetensors_io::load_hf_checkpoint(dest).unwrap();
    assert_eq!(after.config, before.config);
    for name in trained {
        let (b, a) = (
            before.get(name).unwrap().to_f32_vec(),
            after.get(name).unwrap().to_f32_vec(),
        );
        assert!(b.iter().zip(&a).any(|(x, y)| x != y), "{name} did not train");
    }
}

/// What a tiny run trains on, in `dir`: [`tiny_chat_model`], `train_rows` arithmetic problems
/// (seed 1) and `val_rows` held out (seed 2).
pub fn tiny_inputs(dir: &Path, train_rows: usize, val_rows: usize) -> (PathBuf, PathBuf, PathBuf) {
    (
        tiny_chat_model(dir),
        arithmetic(dir, "train", 1, train_rows),
        arithmetic(dir, "val", 2, val_rows),
    )
}

/// `grpo preprocess arithmetic` into `dir/NAME.parquet`.
pub fn arithmetic(dir: &Path, name: &str, seed: u64, count: usize) -> PathBuf {
    arithmetic_with(dir, name, seed, count, &[])
}

/// `grpo preprocess arithmetic` with `options` (`--max-value`, `--answer-format`, ...) into
/// `dir/NAME.parquet`.
pub fn arithmetic_with(dir: &Path, name: &str, seed: u64, count: usize, options: &[&str]) -> PathBuf {
    let path = dir.join(format!("{name}.parquet"));
    let (seed, count) = (seed.to_string(), count.to_string());
    let mut args = vec![
        "preprocess",
        "arithmetic",
        "--seed",
        &seed,
        "--count",
        &count,
        "--output",
        path.to_str().unwrap(),
    ];
    args.extend_from_slice(options);
    let out = run_grpo(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    path
}

/// Reads `OUTPUT/metrics.jsonl`'s steps, the later line winning for a repeated step.
pub fn metrics(output: &Path) -> std::collections::BTreeMap<u64, serde_json::Value> {
    metric_lines(output)
        .into_iter()
        .filter(|v| v.get("run").is_none())
        .map(|v| (v["step"].as_u64().expect("step"), v))
        .collect()
}

/// The run headers of `OUTPUT/metrics.jsonl` (`{"run": {...}}`, one per start or resume).
pub fn run_headers(output: &Path) -> Vec<serde_json::Value> {
    metric_lines(output)
        .into_iter()
        .filter_map(|v| v.get("run").cloned())
        .collect()
}

fn metric_lines(output: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(output.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        .collect()
}

/// Reads `OUTPUT/prompts.jsonl`: the dataset rows each step trained on.
pub fn prompts_seen(output: &Path) -> std::collections::BTreeMap<u64, Vec<u64>> {
    let text = std::fs::read_to_string(output.join("prompts.jsonl")).expect("prompts.jsonl");
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        .map(|v| {
            let ids = v["indices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            (v["step"].as_u64().unwrap(), ids)
        })
        .collect()
}

/// A recipe for the tiny model written as `dir/name`: 4 prompts x 4 samples per step, short
/// responses, a KL loss (so the reference model is used), validation and checkpoints every 2
/// steps, plus `extra` YAML appended (whole sections). The reward is 1 for a response that does
/// not start with white space: about half of the random model's samples, so advantages are not
/// all zero and comparisons of runs exercise the policy-gradient term (the arithmetic scorer
/// gives this model 0 everywhere).
#[allow(clippy::too_many_arguments)]
pub fn tiny_recipe(
    dir: &Path,
    name: &str,
    model: &Path,
    train: &Path,
    val: &Path,
    output: &Path,
    steps: usize,
    extra: &str,
) -> PathBuf {
    let text = format!(
        "model:\n  path: {model}\n\
         data:\n  train_files: {train}\n  val_files: {val}\n  train_batch_size: 4\n  max_prompt_length: 96\n  max_response_length: 12\n\
         rollout:\n  n: 4\n  max_num_seqs: 16\n\
         reward:\n  scorers:\n    starts_with_a_word: {{kind: format_regex, pattern: '^\\S'}}\n  data_sources:\n    grpo/arithmetic: starts_with_a_word\n\
         actor:\n  optim:\n    lr: 1.0e-3\n  ppo_mini_batch_size: 2\n  ppo_micro_batch_size: 4\n  use_kl_loss: true\n\
         trainer:\n  total_training_steps: {steps}\n  test_freq: 2\n  save_freq: 2\n  output_dir: {output}\n  seed: 3\n{extra}",
        model = model.display(),
        train = train.display(),
        val = val.display(),
        output = output.display(),
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// The values of `key` at every training step (step 0, the validation before training, left
/// out).
pub fn metric_series(m: &std::collections::BTreeMap<u64, serde_json::Value>, key: &str) -> Vec<f64> {
    m.iter()
        .filter(|(s, _)| **s > 0)
        .map(|(_, v)| v[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {v}")))
        .collect()
}

/// Every process with its command line, as (pid, arguments).
pub fn processes() -> Vec<(u32, Vec<String>)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        found.push((pid, args));
    }
    found
}

/// The pids of the worker processes of `role` of the run writing to `output` (their command
/// line names the run's resolved recipe `OUTPUT/recipe.yaml`).
pub fn run_worker_pids(output: &Path, role: &str) -> Vec<u32> {
    let recipe = output.join("recipe.yaml");
    processes()
        .into_iter()
        .filter(|(_, args)| {
            let has = |s: &str| args.iter().any(|a| a == s);
            has("worker") && has(role) && has(&recipe.to_string_lossy())
        })
        .map(|(pid, _)| pid)
        .collect()
}

/// Whether process `pid` exists and is not a zombie.
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(stat) => {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            !(state.starts_with('Z') || state.starts_with('X'))
        }
    }
}

/// Sends signal `name` (`STOP`, `CONT`, `KILL`, ...) to `pid` with kill(1); whether it was sent.
pub fn send_signal(pid: u32, name: &str) -> bool {
    Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Waits until `OUTPUT/metrics.jsonl` has a line for `step`, while `child` (the run) is still
/// running; panics after `within`.
pub fn wait_for_step(output: &Path, step: u64, child: &mut std::process::Child, within: std::time::Duration) {
    let started = std::time::Instant::now();
    let prefix = format!("{{\"step\":{step},");
    loop {
        let done = std::fs::read_to_string(output.join("metrics.jsonl"))
            .map(|s| s.lines().any(|l| l.starts_with(&prefix)))
            .unwrap_or(false);
        if done {
            return;
        }
        assert!(started.elapsed() < within, "no step {step} after {within:?}");
        if child.try_wait().unwrap().is_some() {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
            }
            panic!("the run ended before step {step}: {stderr}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The bytes of the trained parameters in the checkpoint `dir` as f32 (with LoRA the
/// adapters: what a sync to a rollout worker sends).
pub fn checkpoint_param_bytes(dir: &Path) -> usize {
    let ck = trainer::checkpoint::load_checkpoint(dir).unwrap();
    ck.tensors["params"]
        .iter()
        .map(|t| t.to_f32_vec().len() * 4)
        .sum()
}

/// Asserts that two runs, written to `a` and `b`, trained alike: the same steps in
/// `metrics.jsonl`, equal per-step rewards, lengths, losses, gradient norms, entropies, KL and
/// sample counts, equal validation accuracy before training, and the same prompts seen.
/// `what` names the comparison in failure messages.
pub fn assert_same_training(a: &Path, b: &Path, what: &str) {
    let (ma, mb) = (metrics(a), metrics(b));
    assert_eq!(
        ma.keys().collect::<Vec<_>>(),
        mb.keys().collect::<Vec<_>>(),
        "{what}: steps"
    );
    for key in [
        "critic/score/mean",
        "critic/score/std",
        "response_length/mean",
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/entropy",
        "actor/kl",
        "batch/samples",
    ] {
        assert_eq!(metric_series(&ma, key), metric_series(&mb, key), "{key}: {what}");
    }
    assert_eq!(ma[&0][VAL_CORE], mb[&0][VAL_CORE], "{VAL_CORE}: {what}");
    assert_eq!(prompts_seen(a), prompts_seen(b), "prompts: {what}");
}

/// Asserts that a worker refused a caller with another run's token (the role's error).
pub fn assert_wrong_token<T: std::fmt::Debug>(result: Result<T, actors::roles::RoleError>) {
    match result {
        Err(actors::roles::RoleError::Refused { message, .. }) => {
            assert!(message.starts_with("wrong token"), "{message}")
        }
        other => panic!("expected a refusal for the wrong token, got {other:?}"),
    }
}

/// Asserts that a worker refused a call made without any token (the raw gRPC status).
pub fn assert_missing_token<T: std::fmt::Debug>(result: Result<T, tonic::Status>) {
    let status = result.expect_err("a call without a token was accepted");
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(
        status.message().starts_with("missing token"),
        "{}",
        status.message()
    );
}

/// A `grpo worker` process a test started; killed when the test ends, pass or fail.
pub struct WorkerProcess {
    pub child: std::process::Child,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl WorkerProcess {
    /// Starts `command` (a `grpo worker ...`) with its stdout piped to the test.
    pub fn start(command: &mut Command) -> WorkerProcess {
        let mut child = command
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start grpo worker");
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        WorkerProcess { child, stdout }
    }

    /// The next line the worker prints on stdout (empty at end of output).
    pub fn line(&mut self) -> String {
        use std::io::BufRead;
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim_end().to_string()
    }

    /// Reads the worker's first line, `listening on 127.0.0.1:PORT` (a worker binds loopback
    /// unless told otherwise), and returns `http://127.0.0.1:PORT`.
    pub fn loopback_address(&mut self) -> String {
        let line = self.line();
        let address = line
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("the worker said {line:?}"));
        assert!(
            address.starts_with("127.0.0.1:"),
            "binds loopback by default: {address}"
        );
        format!("http://{address}")
    }

    /// Waits up to `within` for the process to exit; its status and its stderr (piped by the
    /// caller's command).
    pub fn exit_within(&mut self, within: Duration) -> Option<(std::process::ExitStatus, String)> {
        use std::io::Read;
        let started = std::time::Instant::now();
        while started.elapsed() < within {
            if let Some(status) = self.child.try_wait().unwrap() {
                let mut stderr = String::new();
                if let Some(mut pipe) = self.child.stderr.take() {
                    pipe.read_to_string(&mut stderr).unwrap();
                }
                return Some((status, stderr));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}
