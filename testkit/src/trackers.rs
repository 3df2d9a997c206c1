//! The experiment trackers' real counterparts for tests: the Python that has TensorBoard,
//! MLflow and wandb (the checkout's `.venv`, where scripts/test.sh installs them, or
//! `$GRPO_TEST_PYTHON`), a local `mlflow server`, and readers that parse what TensorBoard and
//! wandb were given with their own code (`testkit/readers/`).

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The Python with `tensorboard`, `mlflow` and `wandb`; a test fails, saying how to get them,
/// when it has not.
pub fn python() -> PathBuf {
    let path = std::env::var_os("GRPO_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::repo_root().join(".venv/bin/python"));
    let ok = Command::new(&path)
        .args(["-c", "import tensorboard, mlflow, wandb"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{} cannot import tensorboard, mlflow and wandb: run scripts/test.sh (it installs them \
         into the checkout's .venv) or set GRPO_TEST_PYTHON",
        path.display()
    );
    path
}

fn read(script: &str, arg: &Path) -> serde_json::Value {
    let script = crate::repo_root().join("testkit/readers").join(script);
    let out = Command::new(python()).arg(script).arg(arg).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The scalars of a TensorBoard log directory, `{tag: [[step, value], ...]}`, as TensorBoard's
/// own loader sees them (non-finite values as null).
pub fn read_tensorboard(dir: &Path) -> serde_json::Value {
    read("read_tensorboard.py", dir)
}

/// What an offline wandb run file holds: `{"run", "config", "history", "exit_code"}`.
pub fn read_wandb(file: &Path) -> serde_json::Value {
    read("read_wandb.py", file)
}

/// A local `mlflow server` (SQLite store, artifacts served through it under `dir/artifacts`)
/// on a free port, in its own process group, which is killed on drop (the server's workers
/// with it).
pub struct MlflowServer {
    child: Child,
    pub uri: String,
}

impl MlflowServer {
    pub fn start(dir: &Path) -> MlflowServer {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(python())
            .args(["-m", "mlflow", "server", "--host", "127.0.0.1", "--workers", "1"])
            .args(["--port", &port.to_string()])
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", dir.join("mlflow.db").display()))
            // Artifacts through the server's proxy, as a remote server serves them.
            .arg("--artifacts-destination")
            .arg(dir.join("artifacts"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        let server = MlflowServer {
            child,
            uri: format!("http://127.0.0.1:{port}"),
        };
        let started = Instant::now();
        while ureq::get(&format!("{}/health", server.uri)).call().is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "mlflow server did not start"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
        server
    }

    /// GET `/api/2.0/mlflow/{method}` with `query`, as JSON.
    pub fn get(&self, method: &str, query: &[(&str, &str)]) -> serde_json::Value {
        let mut request = ureq::get(&format!("{}/api/2.0/mlflow/{method}", self.uri));
        for (k, v) in query {
            request = request.query(*k, *v);
        }
        let text = request.call().unwrap().body_mut().read_to_string().unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// A metric's history in a run, `(step, value)` in step order.
    pub fn history(&self, run_id: &str, key: &str) -> Vec<(u64, serde_json::Value)> {
        let answer = self.get("metrics/get-history", &[("run_id", run_id), ("metric_key", key)]);
        let mut points: Vec<(u64, serde_json::Value)> = answer["metrics"]
            .as_array()
            .unwrap_or_else(|| panic!("no history of {key}: {answer}"))
            .iter()
            .map(|m| (m["step"].as_u64().unwrap_or(0), m["value"].clone()))
            .collect();
        points.sort_by_key(|p| p.0);
        points
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.wait();
    }
}
