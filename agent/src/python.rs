//! The built-in Python executor: runs the model's code with the machine's Python 3 in a child
//! process confined by [`Sandbox`] (no network, no child processes, no files outside a fresh
//! folder of its own, CPU, memory and file-size limits; see [`crate::sandbox`] for how), and
//! answers with what it printed.
//!
//! Each call gets a new empty folder (its working directory, `HOME` and `TMPDIR`), deleted
//! afterwards, so calls share nothing. The interpreter runs isolated (`-I`: no user site
//! packages, no `PYTHON*` variables) with an empty environment, but keeps its own site-packages:
//! install `sympy` or `numpy` into the interpreter the recipe names and the code can import them.
//! Output beyond [`MAX_CAPTURE_BYTES`] per stream is read and dropped, so a print loop cannot
//! fill the rollout's memory; the environment's `max_tool_response_length` cuts what the model
//! sees.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use external::InFlightLimit;
use serde_json::{json, Value};

use crate::sandbox::{Limits, Sandbox, SandboxError};
use crate::schema::ToolSchema;
use crate::tool::{Tool, ToolError};

/// Bytes of stdout (and of stderr) kept per call.
pub const MAX_CAPTURE_BYTES: usize = 1 << 20;

/// How the executor runs code.
#[derive(Clone, Debug, PartialEq)]
pub struct PythonSettings {
    /// The interpreter: a path, or a name looked up on `PATH` (`python3`).
    pub interpreter: PathBuf,
    /// Wall-clock limit of one run (the CPU limit is the same number of seconds).
    pub timeout: Duration,
    /// Address-space limit of the process, in MiB.
    pub memory_mb: u64,
    /// Most runs at once; further calls wait for a free one (within their time limit).
    pub max_processes: usize,
}

/// Why the executor cannot start.
#[derive(Debug, thiserror::Error)]
pub enum PythonError {
    /// The interpreter did not start or did not answer as Python 3.
    #[error("the Python interpreter {interpreter:?} is not usable: {why}")]
    Interpreter {
        /// The configured interpreter.
        interpreter: PathBuf,
        /// What went wrong.
        why: String,
    },
    /// The sandbox is not available here.
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// The sandboxed interpreter failed the self-test (`print(6 * 7)`).
    #[error(
        "the sandboxed Python interpreter {executable:?} failed its self-test: {why}; if it needs files \
         outside its installation prefix, the system's /usr and /lib, point the recipe at an \
         interpreter that does not (a venv made from a plain CPython)"
    )]
    SelfTest {
        /// The interpreter's real path.
        executable: PathBuf,
        /// What the self-test printed or why it failed.
        why: String,
    },
    /// The settings are out of range.
    #[error("{0}")]
    Settings(String),
}

/// What a run printed and how it ended.
#[derive(Clone, Debug)]
pub struct Run {
    /// Standard output (lossy UTF-8), at most [`MAX_CAPTURE_BYTES`].
    pub stdout: String,
    /// Standard error, likewise.
    pub stderr: String,
    /// Bytes printed beyond the capture limit, on both streams together.
    pub dropped_bytes: u64,
    /// How the process ended; `None` when it was killed at the time limit.
    pub status: Option<ExitStatus>,
}

/// The executor (see the module documentation).
pub struct Python {
    executable: PathBuf,
    sandbox: Sandbox,
    settings: PythonSettings,
    running: InFlightLimit,
}

/// The system folders the interpreter may read besides its own prefix: shared libraries,
/// locales, and the loader's cache.
const SYSTEM_PATHS: &[&str] = &["/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache"];

/// What the interpreter is asked, unconfined, once: where it lives.
const QUERY: &str = "import json, sys\n\
print(json.dumps({'version': sys.version_info[0], 'executable': sys.executable, \
'prefixes': [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]}))";

impl Python {
    /// An executor for `settings`: asks the interpreter where it is installed, sets up the
    /// sandbox over that and the system's libraries, and runs a self-test inside it, so a
    /// machine where the sandbox cannot work fails here, at set-up, with the reason.
    pub fn new(settings: PythonSettings) -> Result<Python, PythonError> {
        if settings.memory_mb < 64 {
            return Err(PythonError::Settings(format!(
                "the Python tool's memory limit is {} MiB; the interpreter alone needs about 30, give it \
                 at least 64",
                settings.memory_mb
            )));
        }
        if settings.timeout < Duration::from_millis(100) {
            return Err(PythonError::Settings(format!(
                "the Python tool's time limit {:?} is too short to start an interpreter; give it at least \
                 0.1 s",
                settings.timeout
            )));
        }
        let interpreter_error = |why: String| PythonError::Interpreter {
            interpreter: settings.interpreter.clone(),
            why,
        };
        let output = Command::new(&settings.interpreter)
            .args(["-I", "-c", QUERY])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| interpreter_error(format!("it did not start ({e})")))?;
        let answer: Value = serde_json::from_slice(&output.stdout).map_err(|_| {
            interpreter_error(format!(
                "asked where it is installed, it printed {:?} and {:?}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ))
        })?;
        if answer["version"] != 3 {
            return Err(interpreter_error("it is not Python 3".into()));
        }
        let executable = PathBuf::from(answer["executable"].as_str().unwrap_or_default());
        let mut read_only: Vec<PathBuf> = SYSTEM_PATHS.iter().map(PathBuf::from).collect();
        for prefix in answer["prefixes"].as_array().into_iter().flatten() {
            read_only.push(PathBuf::from(prefix.as_str().unwrap_or("/nonexistent")));
        }
        if let Some(folder) = std::fs::canonicalize(&executable)
            .ok()
            .and_then(|real| real.parent().map(Path::to_path_buf))
        {
            read_only.push(folder);
        }
        let seconds = settings.timeout.as_secs_f64().ceil() as u64;
        let sandbox = Sandbox::new(
            read_only,
            Limits {
                cpu_seconds: seconds.max(1),
                memory_bytes: settings.memory_mb << 20,
                file_bytes: 64 << 20,
                open_files: 256,
            },
        )?;
        let python = Python {
            executable: executable.clone(),
            sandbox,
            running: InFlightLimit::new(settings.max_processes),
            settings,
        };
        let self_test = |why: String| PythonError::SelfTest {
            executable: executable.clone(),
            why,
        };
        match python.run("print(6 * 7)") {
            Ok(run) if run.status.is_some_and(|s| s.success()) && run.stdout.trim() == "42" => Ok(python),
            Ok(run) => Err(self_test(format!(
                "it printed {:?} and {:?} and ended with {:?}",
                run.stdout, run.stderr, run.status
            ))),
            Err(e) => Err(self_test(e.to_string())),
        }
    }

    /// The interpreter's real path.
    pub fn executable(&self) -> &Path {
        &self.executable
    }

    /// The sandbox the runs are confined by.
    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }

    /// Runs `code` in a fresh folder and returns what it printed. `Err` when it could not run or
    /// ran past the time limit.
    pub fn run(&self, code: &str) -> Result<Run, ToolError> {
        let deadline = Instant::now() + self.settings.timeout;
        let _slot = self
            .running
            .acquire_until(deadline)
            .ok_or(ToolError::TimedOut(self.settings.timeout))?;
        let failed = |what: &str, e: &dyn std::fmt::Display| ToolError::Failed(format!("{what}: {e}"));
        let folder = tempfile::Builder::new()
            .prefix("grpo-python-")
            .tempdir()
            .map_err(|e| failed("could not make the sandbox folder", &e))?;
        let script = folder.path().join("main.py");
        std::fs::write(&script, code).map_err(|e| failed("could not write the code", &e))?;
        let mut command = Command::new(&self.executable);
        command
            .args(["-I", "-B", "main.py"])
            .current_dir(folder.path())
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", folder.path())
            .env("TMPDIR", folder.path())
            .env("LANG", "C.UTF-8")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        self.sandbox
            .confine(&mut command, folder.path())
            .map_err(|e| failed("could not confine the interpreter", &e))?;
        let mut child = command
            .spawn()
            .map_err(|e| failed("could not start the interpreter", &e))?;
        let stdout = capture(child.stdout.take().expect("stdout is piped"));
        let stderr = capture(child.stderr.take().expect("stderr is piped"));
        let status = loop {
            if let Some(status) = child
                .try_wait()
                .map_err(|e| failed("waiting for the interpreter", &e))?
            {
                break Some(status);
            }
            if Instant::now() >= deadline {
                // The process group: its own and anything it managed to start.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        let (stdout, out_dropped) = stdout.join().unwrap_or_default();
        let (stderr, err_dropped) = stderr.join().unwrap_or_default();
        if status.is_none() {
            return Err(ToolError::TimedOut(self.settings.timeout));
        }
        Ok(Run {
            stdout,
            stderr,
            dropped_bytes: out_dropped + err_dropped,
            status,
        })
    }
}

/// Reads `stream` to its end on a thread, keeping the first [`MAX_CAPTURE_BYTES`]; returns the
/// text and how many bytes were dropped.
fn capture(mut stream: impl Read + Send + 'static) -> std::thread::JoinHandle<(String, u64)> {
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let mut dropped = 0u64;
        let mut buffer = [0u8; 8192];
        while let Ok(n) = stream.read(&mut buffer) {
            if n == 0 {
                break;
            }
            let room = MAX_CAPTURE_BYTES - kept.len();
            kept.extend_from_slice(&buffer[..n.min(room)]);
            dropped += n.saturating_sub(room) as u64;
        }
        (String::from_utf8_lossy(&kept).into_owned(), dropped)
    })
}

impl Run {
    /// The observation the model reads: what the code printed (stdout, then stderr), and how it
    /// ended when that was not a clean exit.
    fn observation(&self, limits: &PythonSettings) -> Result<String, ToolError> {
        let mut text = self.stdout.clone();
        if !self.stderr.is_empty() {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&self.stderr);
        }
        if self.dropped_bytes > 0 {
            text.push_str(&format!(
                "\n...({} more bytes of output dropped)",
                self.dropped_bytes
            ));
        }
        let status = self.status.expect("a finished run has a status");
        if status.success() {
            return Ok(if text.is_empty() {
                "(the code printed nothing)".into()
            } else {
                text
            });
        }
        use std::os::unix::process::ExitStatusExt;
        let ending = match (status.code(), status.signal()) {
            (Some(code), _) => format!("the code exited with status {code}"),
            (None, Some(libc::SIGXCPU | libc::SIGKILL)) => format!(
                "the code used more than {} s of CPU time and was stopped",
                limits.timeout.as_secs_f64().ceil()
            ),
            (None, Some(signal)) => format!("the code was killed by signal {signal}"),
            (None, None) => "the code ended abnormally".into(),
        };
        Err(ToolError::Failed(if text.is_empty() {
            ending
        } else {
            format!("{ending}; it printed:\n{text}")
        }))
    }
}

impl Tool for Python {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "python".into(),
            description: format!(
                "Runs Python 3 code and returns what it prints (use print). Each call starts fresh: no \
                 variables or files carry over. No network, no subprocesses; {} s and {} MiB at most.",
                self.settings.timeout.as_secs_f64(),
                self.settings.memory_mb
            ),
            parameters: json!({
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "The Python code to run."}
                },
                "required": ["code"]
            }),
        }
    }

    fn time_limit(&self) -> Option<Duration> {
        Some(self.settings.timeout)
    }

    fn call(&self, arguments: &Value) -> Result<String, ToolError> {
        let code = arguments
            .get("code")
            .and_then(Value::as_str)
            .ok_or_else(|| ToolError::BadArguments("`code` must be a string of Python code".into()))?;
        self.run(code)?.observation(&self.settings)
    }
}
