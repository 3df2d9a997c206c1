//! The chaos soak: a `grpo run` with two rollout workers, a reward worker and a learner worker,
//! each behind a loopback proxy (`tests/fixtures/proxied_worker.py`), while a seeded controller
//! injects faults at random moments: SIGKILL of a rollout or reward worker, of the learner
//! worker and of the orchestrator; SIGSTOP of a worker and of the orchestrator for longer than
//! the health-check deadline; a connection cut or stalled by a worker's proxy; and a full disk
//! while a checkpoint is written (the orchestrator restarted under a file-size limit,
//! RLIMIT_FSIZE, so its checkpoint write fails as a full disk's does). Whenever the run stops on
//! a fault it is started again with the same command, as a user would.
//!
//! At the end the trained parameters and optimizer state are bit-identical to an undisturbed
//! run's, `metrics.jsonl` and `prompts.jsonl` hold every step exactly once (with the undisturbed
//! run's values), no process of the run is left, and a report lists the faults injected, what
//! each cost in time and the soak's overhead.
//!
//! The tests run seeds 1 to 5 on a tiny dense model, then seed 1 on a tiny mixture-of-experts
//! model; more on demand, e.g. `GRPO_CHAOS_SEEDS=1-50 cargo test --test chaos -- --nocapture`
//! (`GRPO_CHAOS_MOE_SEEDS` picks the mixture-of-experts seeds alike).
//! `GRPO_CHAOS_SEEDS` picks the seeds (`5`: seeds 1 to 5, the default; `7-9`; `3,11`),
//! `GRPO_CHAOS_FAULTS` the faults per seed (default 8: each kind once, in a seeded order, then
//! seeded picks), `GRPO_CHAOS_REPORT` a file for the report as JSON. A failing seed replays with
//! `GRPO_CHAOS_SEEDS=N`: the faults, targets and delays are the seed's; only where in a step they
//! land depends on timing.

mod common;

use common::*;
use rand::prelude::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Steps per run: room for the eight faults of a seed, each injected after the run recovered
/// from the one before and at a random moment up to 1.5 s later; a fault still pending when the
/// run ends fails the seed.
const STEPS: u64 = 60;
/// `cluster.worker_timeout_s`: a worker silent this long is dead.
const TIMEOUT_S: u64 = 2;
/// How long a freeze or a stalled connection lasts: past the deadline.
const FREEZE: Duration = Duration::from_secs(TIMEOUT_S + 1);
/// The file-size limit of a "full disk": above any metrics or log file of the run, below a
/// checkpoint's parameters (6 MiB for the tiny model).
const DISK_LIMIT: u64 = 1 << 20;
const SEED_DEADLINE: Duration = Duration::from_secs(900);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    KillWorker,
    FreezeWorker,
    KillLearner,
    KillOrchestrator,
    FreezeOrchestrator,
    CutConnection,
    StallConnection,
    DiskFull,
}

const KINDS: [Fault; 8] = [
    Fault::KillWorker,
    Fault::FreezeWorker,
    Fault::KillLearner,
    Fault::KillOrchestrator,
    Fault::FreezeOrchestrator,
    Fault::CutConnection,
    Fault::StallConnection,
    Fault::DiskFull,
];

impl Fault {
    /// Whether the fault picks a worker process or its proxy (rather than the orchestrator).
    fn targets_workers(self) -> bool {
        !matches!(
            self,
            Fault::KillOrchestrator | Fault::FreezeOrchestrator | Fault::DiskFull
        )
    }

    fn name(self) -> &'static str {
        match self {
            Fault::KillWorker => "kill -9 rollout/reward worker",
            Fault::FreezeWorker => "freeze rollout/reward worker",
            Fault::KillLearner => "kill -9 learner worker",
            Fault::KillOrchestrator => "kill -9 orchestrator",
            Fault::FreezeOrchestrator => "freeze orchestrator",
            Fault::CutConnection => "cut connections",
            Fault::StallConnection => "stall connections",
            Fault::DiskFull => "disk full at checkpoint",
        }
    }
}

/// One injected fault and what it cost.
struct Injected {
    fault: Fault,
    target: String,
    /// Seconds since the soak's start.
    at_s: f64,
    /// The newest step in `metrics.jsonl` when it was injected.
    at_step: u64,
    /// Seconds from the fault until the run had trained a step past `at_step`.
    recovered_s: f64,
}

struct SeedReport {
    seed: u64,
    faults: Vec<Injected>,
    starts: usize,
    steps: u64,
    wall_s: f64,
}

/// The run under test: the orchestrator of the current start, and where its logs go.
struct Soak {
    recipe: PathBuf,
    output: PathBuf,
    logs: PathBuf,
    child: Option<Child>,
    starts: usize,
    /// Processes this soak froze: thawed and killed however the test ends.
    frozen: Vec<u32>,
}

impl Drop for Soak {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            send_signal(c.id(), "CONT");
            let _ = c.kill();
            let _ = c.wait();
        }
        for &pid in &self.frozen {
            if process_alive(pid) {
                send_signal(pid, "CONT");
                send_signal(pid, "KILL");
            }
        }
    }
}

impl Soak {
    fn log(&self, start: usize) -> PathBuf {
        self.logs.join(format!("orchestrator-{start}.log"))
    }

    /// Starts `grpo run` again (a resume once a checkpoint exists); with `file_limit` the
    /// orchestrator and its workers cannot write a file past that many bytes.
    fn start(&mut self, file_limit: Option<u64>) {
        assert!(self.child.is_none());
        self.starts += 1;
        let log = std::fs::File::create(self.log(self.starts)).unwrap();
        let mut command = grpo();
        command
            .arg("run")
            .arg(&self.recipe)
            .args(run_args())
            .arg("--worker-program")
            .arg(wrapper())
            .env("GRPO_CHAOS_BINARY", env!("CARGO_BIN_EXE_grpo"))
            .env("GRPO_CHAOS_STALL_S", FREEZE.as_secs_f64().to_string())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(limit) = file_limit {
            limit_file_size(&mut command, limit);
        }
        self.child = Some(command.spawn().unwrap());
    }

    fn orchestrator(&self) -> u32 {
        self.child.as_ref().expect("a run is going").id()
    }

    /// The run's exit status if it has ended.
    fn ended(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut()?.try_wait().unwrap()?;
        self.child = None;
        Some(status)
    }

    /// What every process of the run is doing, for a soak that stopped making progress: each
    /// one's scheduler state and kernel wait channel, and every thread's stack from gdb where
    /// gdb is installed. Also written to the logs directory.
    fn stuck_report(&self) -> String {
        let mut pids: Vec<(u32, String)> = self
            .child
            .iter()
            .map(|c| (c.id(), "orchestrator".to_string()))
            .collect();
        pids.extend(
            run_processes(&self.output)
                .into_iter()
                .map(|(pid, role, proxy)| (pid, if proxy { format!("{role} proxy") } else { role })),
        );
        let mut report = String::new();
        for (pid, what) in pids {
            let state = std::fs::read_to_string(format!("/proc/{pid}/status"))
                .unwrap_or_default()
                .lines()
                .find(|l| l.starts_with("State:"))
                .unwrap_or("State: gone")
                .to_string();
            let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
            report += &format!("== {what} pid {pid}: {state}, waiting in {wchan:?}\n");
            if let Ok(o) = Command::new("gdb")
                .args(["-batch", "-p", &pid.to_string(), "-ex", "thread apply all bt 30"])
                .output()
            {
                report += &String::from_utf8_lossy(&o.stdout);
            }
        }
        let path = self.logs.join("stuck.txt");
        let _ = std::fs::write(&path, &report);
        format!(
            "stacks in {}; the orchestrator's log:\n{}",
            path.display(),
            self.stderr()
        )
    }

    /// Whether the run has ended (or none is going), leaving the exit status for [`Soak::ended`].
    fn has_ended(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|c| c.try_wait().unwrap().is_some())
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.log(self.starts)).unwrap_or_default()
    }

    /// Kills the orchestrator and waits until every process of the run is gone (its workers
    /// die with it).
    fn kill(&mut self) {
        let mut c = self.child.take().expect("a run is going");
        let _ = c.kill();
        c.wait().unwrap();
        let t = Instant::now();
        while !run_processes(&self.output).is_empty() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "processes outlived their orchestrator: {:?}",
                run_processes(&self.output)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A run that stopped on an injected fault is started again; one that stopped otherwise
    /// fails the test.
    fn restart_after_exit(&mut self, status: std::process::ExitStatus) {
        let stderr = self.stderr();
        let expected = ["learner worker", "saving the checkpoint of step"]
            .iter()
            .any(|m| stderr.contains(m));
        assert!(
            !status.success() && expected,
            "the run stopped unexpectedly ({status}): {stderr}"
        );
        self.start(None);
    }
}

fn run_args() -> [&'static str; 7] {
    [
        "--set",
        "trainer.save_freq=3",
        "--set",
        "trainer.test_freq=10",
        "--set",
        "trainer.max_checkpoints_to_keep=2",
        "--quiet",
    ]
}

fn wrapper() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/proxied_worker.py")
}

/// Sets RLIMIT_FSIZE for the child and ignores SIGXFSZ, so a write past `limit` fails with
/// EFBIG instead of killing the process (both are inherited by its workers).
fn limit_file_size(command: &mut Command, limit: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let r = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The processes of the run writing to `output`: (pid, role, whether it is the proxy wrapper).
fn run_processes(output: &Path) -> Vec<(u32, String, bool)> {
    let recipe = output.join("recipe.yaml").to_string_lossy().into_owned();
    let mut found = Vec::new();
    for (pid, args) in processes() {
        if !args.contains(&recipe) || !process_alive(pid) {
            continue;
        }
        let Some(role) = args
            .iter()
            .position(|a| a == "--role")
            .and_then(|i| args.get(i + 1))
        else {
            continue;
        };
        let proxy = args.iter().any(|a| a.ends_with("proxied_worker.py"));
        found.push((pid, role.clone(), proxy));
    }
    found.sort();
    found
}

/// The live worker processes (or, with `proxy`, their proxies) of `roles`, frozen ones left out.
fn workers(soak: &Soak, roles: &[&str], proxy: bool) -> Vec<(u32, String)> {
    run_processes(&soak.output)
        .into_iter()
        .filter(|(pid, role, p)| *p == proxy && roles.contains(&role.as_str()) && !soak.frozen.contains(pid))
        .map(|(pid, role, _)| (pid, role))
        .collect()
}

/// The newest step `metrics.jsonl` holds (0 when none).
fn newest_step(output: &Path) -> u64 {
    step_lines(output).into_iter().max().unwrap_or(0)
}

/// The step of every step line of `OUTPUT/FILE`, in file order (run headers skipped).
fn steps_in(output: &Path, file: &str) -> Vec<u64> {
    std::fs::read_to_string(output.join(file))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["step"].as_u64())
        .collect()
}

fn step_lines(output: &Path) -> Vec<u64> {
    steps_in(output, "metrics.jsonl")
}

/// Injects `fault` into `soak`; returns what it hit.
fn inject(soak: &mut Soak, fault: Fault, rng: &mut StdRng) -> String {
    let out = soak.output.clone();
    let pick = |rng: &mut StdRng, list: Vec<(u32, String)>, what: &str| -> (u32, String) {
        assert!(!list.is_empty(), "no {what} to fault: {:?}", run_processes(&out));
        list[rng.random_range(0..list.len())].clone()
    };
    match fault {
        Fault::KillWorker => {
            let (pid, role) = pick(rng, workers(soak, &["rollout", "reward"], false), "worker");
            send_signal(pid, "KILL");
            format!("{role} worker pid {pid}")
        }
        Fault::FreezeWorker => {
            let (pid, role) = pick(rng, workers(soak, &["rollout", "reward"], false), "worker");
            send_signal(pid, "STOP");
            soak.frozen.push(pid);
            format!("{role} worker pid {pid}")
        }
        Fault::KillLearner => {
            let (pid, _) = pick(rng, workers(soak, &["learner"], false), "learner worker");
            send_signal(pid, "KILL");
            format!("learner worker pid {pid}")
        }
        Fault::KillOrchestrator => {
            let pid = soak.orchestrator();
            soak.kill();
            soak.start(None);
            format!("orchestrator pid {pid}")
        }
        Fault::FreezeOrchestrator => {
            let pid = soak.orchestrator();
            send_signal(pid, "STOP");
            std::thread::sleep(FREEZE);
            send_signal(pid, "CONT");
            format!("orchestrator pid {pid}")
        }
        Fault::CutConnection | Fault::StallConnection => {
            let all = ["rollout", "reward", "learner"];
            let (pid, role) = pick(rng, workers(soak, &all, true), "proxy");
            send_signal(
                pid,
                if fault == Fault::CutConnection {
                    "USR1"
                } else {
                    "USR2"
                },
            );
            format!("{role} worker's connections (proxy pid {pid})")
        }
        Fault::DiskFull => {
            let pid = soak.orchestrator();
            soak.kill();
            soak.start(Some(DISK_LIMIT));
            let limited = soak.orchestrator();
            let t = Instant::now();
            let status = loop {
                if let Some(s) = soak.ended() {
                    break s;
                }
                assert!(
                    t.elapsed() < Duration::from_secs(300),
                    "the full disk went unnoticed"
                );
                std::thread::sleep(Duration::from_millis(20));
            };
            let stderr = soak.stderr();
            assert!(
                !status.success()
                    && stderr.contains("saving the checkpoint of step")
                    && stderr.contains("File too large")
                    && stderr.contains("run `grpo run` again with the same recipe: it resumes from"),
                "{status}: {stderr}"
            );
            let checkpoints = std::fs::read_dir(out.join("checkpoints")).unwrap();
            let names: Vec<String> = checkpoints
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            let partial = format!("-{limited}");
            assert!(
                !names.iter().any(|n| n.ends_with(&partial)),
                "the failed save left {names:?}"
            );
            soak.start(None);
            format!("orchestrator pid {pid}, restarted under a {DISK_LIMIT}-byte file limit")
        }
    }
}

fn soak_seed(seed: u64, dir: &Path, recipe: &Path, faults: usize) -> SeedReport {
    let output = dir.join(format!("seed-{seed}"));
    let recipe_text = std::fs::read_to_string(recipe)
        .unwrap()
        .replace("CHAOS_OUTPUT", &output.to_string_lossy());
    let recipe = dir.join(format!("seed-{seed}.yaml"));
    std::fs::write(&recipe, recipe_text).unwrap();
    let logs = dir.join(format!("seed-{seed}-logs"));
    std::fs::create_dir_all(&logs).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut schedule: Vec<Fault> = KINDS.to_vec();
    schedule.shuffle(&mut rng);
    while schedule.len() < faults {
        schedule.push(KINDS[rng.random_range(0..KINDS.len())]);
    }
    schedule.truncate(faults);

    let started = Instant::now();
    let mut soak = Soak {
        recipe,
        output: output.clone(),
        logs,
        child: None,
        starts: 0,
        frozen: Vec::new(),
    };
    soak.start(None);
    let mut injected: Vec<Injected> = Vec::new();
    let mut pending = std::collections::VecDeque::from(schedule);
    let mut last_step = 0;
    loop {
        if started.elapsed() >= SEED_DEADLINE {
            panic!("seed {seed}: past {SEED_DEADLINE:?}\n{}", soak.stuck_report());
        }
        if let Some(status) = soak.ended() {
            if status.success() {
                break;
            }
            soak.restart_after_exit(status);
            continue;
        }
        let step = newest_step(&output);
        if let Some(last) = injected.last_mut() {
            if last.recovered_s < 0.0 && step > last.at_step {
                last.recovered_s = started.elapsed().as_secs_f64() - last.at_s;
            }
        }
        // The next fault once the run made progress since the last one, at a random moment of
        // a step. One aimed at a worker or its connections also waits until all four are up; one
        // aimed at the orchestrator does not (a replacement can take longer to start than the
        // rest of the run on a loaded machine, and being mid-replacement is a state worth hitting).
        let needs_workers = pending.front().is_some_and(|f| f.targets_workers());
        let ready = step > last_step
            && injected.last().is_none_or(|l| l.recovered_s >= 0.0)
            && (!needs_workers || workers(&soak, &["rollout", "reward", "learner"], false).len() == 4);
        if ready && step < STEPS {
            if let Some(fault) = pending.pop_front() {
                std::thread::sleep(Duration::from_millis(rng.random_range(0..1500)));
                // Not `ended()`: that takes the exit status, and the loop's next turn must see
                // it to restart the run or finish (taking it here left the soak waiting forever).
                if soak.has_ended() {
                    pending.push_front(fault);
                    continue;
                }
                let at_s = started.elapsed().as_secs_f64();
                let at_step = newest_step(&output);
                let target = inject(&mut soak, fault, &mut rng);
                eprintln!(
                    "seed {seed} {at_s:7.1}s step {at_step:2}: {} ({target})",
                    fault.name()
                );
                injected.push(Injected {
                    fault,
                    target,
                    at_s,
                    at_step,
                    recovered_s: -1.0,
                });
                last_step = at_step;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let wall_s = started.elapsed().as_secs_f64();
    if let Some(last) = injected.last_mut() {
        if last.recovered_s < 0.0 {
            last.recovered_s = wall_s - last.at_s;
        }
    }
    assert!(
        pending.is_empty(),
        "seed {seed}: the run ended before {pending:?}"
    );
    // No process of the run is left, frozen ones included.
    let t = Instant::now();
    while !run_processes(&output).is_empty() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(run_processes(&output), vec![], "seed {seed}: left over");
    for &pid in &soak.frozen {
        assert!(
            !process_alive(pid),
            "seed {seed}: frozen worker {pid} is still there"
        );
    }
    SeedReport {
        seed,
        steps: newest_step(&output),
        starts: soak.starts,
        faults: injected,
        wall_s,
    }
}

/// The seeds `GRPO_CHAOS_SEEDS` names.
fn seeds() -> Vec<u64> {
    seeds_of("GRPO_CHAOS_SEEDS", "5")
}

/// The seeds `GRPO_CHAOS_MOE_SEEDS` names, for the mixture-of-experts model.
fn moe_seeds() -> Vec<u64> {
    seeds_of("GRPO_CHAOS_MOE_SEEDS", "1")
}

/// The seeds environment variable `var` names (`default` when unset).
fn seeds_of(var: &str, default: &str) -> Vec<u64> {
    let spec = std::env::var(var).unwrap_or_else(|_| default.into());
    let bad = || panic!("{var}={spec}: want N (seeds 1 to N), A-B or a list A,B,C");
    if let Some((a, b)) = spec.split_once('-') {
        let (a, b): (u64, u64) = (
            a.parse().unwrap_or_else(|_| bad()),
            b.parse().unwrap_or_else(|_| bad()),
        );
        (a..=b).collect()
    } else if spec.contains(',') {
        spec.split(',')
            .map(|s| s.trim().parse().unwrap_or_else(|_| bad()))
            .collect()
    } else {
        (1..=spec.parse::<u64>().unwrap_or_else(|_| bad())).collect()
    }
}

/// Asserts that the chaos run in `b` trained exactly as the undisturbed run in `a`: every step
/// once in `metrics.jsonl` and `prompts.jsonl`, the same metrics and prompts, and the final
/// checkpoint's parameters and optimizer state equal bit for bit.
fn assert_identical(a: &Path, b: &Path, what: &str) {
    let steps: Vec<u64> = (0..=STEPS).collect();
    let mut lines = step_lines(b);
    lines.sort();
    assert_eq!(lines, steps, "{what}: steps in metrics.jsonl");
    let mut prompts = steps_in(b, "prompts.jsonl");
    prompts.sort();
    assert_eq!(prompts, steps[1..].to_vec(), "{what}: steps in prompts.jsonl");
    assert_same_training(a, b, what);
    let last = format!("checkpoints/step_{STEPS}");
    for file in ["params.safetensors", "optimizer.safetensors"] {
        let (x, y) = (
            std::fs::read(a.join(&last).join(file)).unwrap(),
            std::fs::read(b.join(&last).join(file)).unwrap(),
        );
        assert!(x == y, "{what}: {file} differs from the undisturbed run's");
    }
}

/// The soak's directory, kept (and named on stderr) when the test fails, with every run's
/// output and the orchestrator's and workers' logs of each start.
struct KeptOnFailure(Option<tempfile::TempDir>);

impl KeptOnFailure {
    fn path(&self) -> &Path {
        self.0.as_ref().unwrap().path()
    }
}

impl Drop for KeptOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let kept = self.0.take().unwrap().keep();
            eprintln!("the soak's runs and logs are kept in {}", kept.display());
        }
    }
}

#[test]
fn a_run_under_random_faults_trains_exactly_as_an_undisturbed_one() {
    let dir = KeptOnFailure(Some(tempfile::tempdir().unwrap()));
    let dense = dir.path().join("dense");
    std::fs::create_dir_all(&dense).unwrap();
    let model = tiny_chat_model(&dense);
    soak(&dense, &model, &seeds(), "", "");
    // A mixture-of-experts policy, its router and experts trained and checkpointed through the
    // same faults (`GRPO_CHAOS_MOE_SEEDS`, default 1), replaying the rollout's routes (R3): the
    // routes ride with the samples through worker restarts and resumes.
    let moe = dir.path().join("moe");
    std::fs::create_dir_all(&moe).unwrap();
    let model = testkit::tiny_moe_chat_model(&moe);
    let r3 = "  router_replay:\n    mode: R3\n";
    soak(&moe, &model, &moe_seeds(), "mixture of experts with R3, ", r3);
}

/// An undisturbed run of `model` in `dir`, then a soak of each seed, each trained exactly as
/// the undisturbed run; prints the report (`what` names the model in it). `actor` adds keys to
/// the recipe's `actor` section.
fn soak(dir: &Path, model: &Path, seeds: &[u64], what: &str, actor: &str) {
    let train = arithmetic(dir, "train", 1, 256);
    let val = arithmetic(dir, "val", 2, 4);
    let cluster = format!(
        "cluster:\n  rollout_workers: 2\n  reward_workers: 1\n  learner_workers: 1\n  worker_timeout_s: {TIMEOUT_S}\n"
    );
    let template = tiny_recipe(
        dir,
        "chaos.yaml",
        model,
        &train,
        &val,
        Path::new("CHAOS_OUTPUT"),
        STEPS as usize,
        &cluster,
    );
    let text = std::fs::read_to_string(&template).unwrap();
    std::fs::write(
        &template,
        text.replacen("actor:\n", &format!("actor:\n{actor}"), 1),
    )
    .unwrap();

    // The undisturbed run: the same recipe, workers and arguments, no proxies, no faults.
    let reference = dir.join("reference");
    let r_ref = dir.join("reference.yaml");
    std::fs::write(
        &r_ref,
        std::fs::read_to_string(&template)
            .unwrap()
            .replace("CHAOS_OUTPUT", &reference.to_string_lossy()),
    )
    .unwrap();
    let t = Instant::now();
    let o = grpo().arg("run").arg(&r_ref).args(run_args()).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let reference_s = t.elapsed().as_secs_f64();

    let faults: usize = std::env::var("GRPO_CHAOS_FAULTS")
        .map(|f| f.parse().expect("GRPO_CHAOS_FAULTS: a count"))
        .unwrap_or(KINDS.len());
    let mut reports = Vec::new();
    for &seed in seeds {
        let report = soak_seed(seed, dir, &template, faults);
        assert_identical(
            &reference,
            &dir.join(format!("seed-{seed}")),
            &format!("{what}seed {seed}"),
        );
        eprintln!(
            "{what}seed {seed}: identical to the undisturbed run, {} starts, {:.1} s",
            report.starts, report.wall_s
        );
        reports.push(report);
        // Each seed's output is checked; keep the disk small over a long soak.
        for name in [format!("seed-{seed}"), format!("seed-{seed}-logs")] {
            let _ = std::fs::remove_dir_all(dir.join(name));
        }
    }
    print_report(&reports, reference_s);
}

/// The report: per seed, faults, restarts, wall time and overhead against the undisturbed run;
/// per fault kind, how many and the mean time to the next trained step. Also written as JSON to
/// `GRPO_CHAOS_REPORT` when set.
fn print_report(reports: &[SeedReport], reference_s: f64) {
    eprintln!("\nchaos soak: {STEPS} steps per seed; undisturbed run {reference_s:.1} s");
    eprintln!("seed  faults  starts  steps  identical  wall s  overhead s  per fault s");
    for r in reports {
        let overhead = r.wall_s - reference_s;
        eprintln!(
            "{:4}  {:6}  {:6}  {:5}  {:>9}  {:6.1}  {:10.1}  {:11.1}",
            r.seed,
            r.faults.len(),
            r.starts,
            r.steps,
            "yes",
            r.wall_s,
            overhead,
            overhead / r.faults.len().max(1) as f64
        );
    }
    let mut by_kind: std::collections::BTreeMap<Fault, Vec<f64>> = Default::default();
    for f in reports.iter().flat_map(|r| &r.faults) {
        by_kind.entry(f.fault).or_default().push(f.recovered_s);
    }
    eprintln!("\nfault                          count  to next step: mean s  max s");
    for (kind, times) in &by_kind {
        eprintln!(
            "{:30} {:5}  {:20.1}  {:5.1}",
            kind.name(),
            times.len(),
            times.iter().sum::<f64>() / times.len() as f64,
            times.iter().cloned().fold(0.0, f64::max)
        );
    }
    if let Ok(path) = std::env::var("GRPO_CHAOS_REPORT") {
        let json = serde_json::json!({
            "steps": STEPS,
            "reference_s": reference_s,
            "seeds": reports.iter().map(|r| serde_json::json!({
                "seed": r.seed,
                "starts": r.starts,
                "steps": r.steps,
                "wall_s": r.wall_s,
                "identical": true,
                "faults": r.faults.iter().map(|f| serde_json::json!({
                    "fault": f.fault.name(),
                    "target": f.target,
                    "at_s": f.at_s,
                    "at_step": f.at_step,
                    "to_next_step_s": f.recovered_s,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        });
        std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    }
}
