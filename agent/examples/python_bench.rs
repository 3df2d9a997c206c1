//! What the Python executor's sandbox costs per call: the same code run by the executor
//! (a fresh folder, Landlock, seccomp, rlimits) and by a bare `python3 -I -B -c` child, in the
//! same process, alternating, medians of N calls each.
//!
//!     cargo run -p agent --example python_bench -- [N]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use agent::{Python, PythonSettings, Tool};
use serde_json::json;

const CODE: &str = "import math\nprint(sum(math.isqrt(i) for i in range(10000)))";

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(40);
    let python = Python::new(PythonSettings {
        interpreter: PathBuf::from("python3"),
        timeout: Duration::from_secs(10),
        memory_mb: 1024,
        max_processes: 1,
    })
    .expect("the sandboxed executor starts");
    let expected = "661650\n";
    let (mut sandboxed, mut bare) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let started = Instant::now();
        let out = python.call(&json!({ "code": CODE })).unwrap();
        sandboxed.push(started.elapsed());
        assert_eq!(out, expected);
        let started = Instant::now();
        let out = Command::new(python.executable())
            .args(["-I", "-B", "-c", CODE])
            .output()
            .unwrap();
        bare.push(started.elapsed());
        assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    }
    let (s, b) = (median(sandboxed), median(bare));
    println!(
        "python executor, {n} calls each, medians: sandboxed {:.1} ms, bare python3 {:.1} ms, ratio {:.2}",
        s.as_secs_f64() * 1e3,
        b.as_secs_f64() * 1e3,
        s.as_secs_f64() / b.as_secs_f64()
    );
}
