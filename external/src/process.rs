//! [`JsonLinesProcess`]: a long-lived child process speaking JSON lines: one request per line on
//! its stdin, one answer per line on its stdout, matched by `id` (answers may come back in any
//! order, so the program may work on several requests at once). Its stderr is kept (the last
//! 2 KB) for error messages.
//!
//! Failure handling:
//! - the process exits or crashes: every request waiting on it fails with the exit status and the
//!   tail of its stderr; the next request starts a new process;
//! - a request is not answered within the time limit: that request fails as timed out, and the
//!   process is presumed stuck, so it is killed (requests waiting on it fail) and restarted;
//! - it writes a line that is not a JSON object with a numeric `id`: the protocol is broken, so
//!   the process is killed and restarted; a line with a valid `id` goes to its request, whatever
//!   else it holds (the caller judges the answer);
//! - a write to its stdin fails (it has just died): the request is sent once more to a new
//!   process, since the old one never received it.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::{truncate, ExternalError, InFlightLimit};

/// How much of the child's stderr is kept for error messages.
const STDERR_TAIL_BYTES: usize = 2048;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

type AnswerSender = SyncSender<Result<Value, String>>;

/// One running child process and the requests waiting on it.
struct ChildProcess {
    child: Mutex<Child>,
    stdin: Mutex<Option<ChildStdin>>,
    pending: Mutex<HashMap<u64, AnswerSender>>,
    /// Why the process is no longer usable; set once.
    dead: Mutex<Option<String>>,
    stderr_tail: Arc<Mutex<Vec<u8>>>,
}

impl ChildProcess {
    fn death(&self) -> Option<String> {
        lock(&self.dead).clone()
    }

    /// Registers a request; `Err` with the reason if the process is already dead.
    fn register(&self, id: u64, sender: AnswerSender) -> Result<(), String> {
        let mut pending = lock(&self.pending);
        if let Some(reason) = self.death() {
            return Err(reason);
        }
        pending.insert(id, sender);
        Ok(())
    }

    fn write_line(&self, line: &str) -> std::io::Result<()> {
        let mut stdin = lock(&self.stdin);
        let stdin = stdin
            .as_mut()
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "stdin already closed"))?;
        stdin.write_all(line.as_bytes())?;
        stdin.flush()
    }

    /// Marks the process dead (the first reason wins), kills it and fails every waiting request.
    fn fail(&self, reason: String) {
        {
            let mut dead = lock(&self.dead);
            if dead.is_none() {
                *dead = Some(reason);
            }
        }
        let _ = lock(&self.child).kill();
        lock(&self.stdin).take();
        let reason = self.death().unwrap_or_default();
        let waiting: Vec<AnswerSender> = lock(&self.pending).drain().map(|(_, sender)| sender).collect();
        for sender in waiting {
            let _ = sender.send(Err(reason.clone()));
        }
    }

    fn stderr_tail(&self) -> String {
        let tail = lock(&self.stderr_tail);
        let text = String::from_utf8_lossy(&tail);
        let text = text.trim();
        if text.is_empty() {
            String::new()
        } else {
            format!("; its stderr ended with: {text}")
        }
    }
}

/// Reads answers from the child's stdout and hands them to the waiting requests.
fn read_answers(process: Arc<ChildProcess>, stdout: ChildStdout, stderr_done: mpsc::Receiver<()>) {
    for line in BufReader::new(stdout).lines() {
        let line = match line {
            Ok(line) => line,
            Err(error) => {
                process.fail(format!("reading its stdout failed: {error}"));
                break;
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<Value>(&line).ok();
        let id = parsed
            .as_ref()
            .and_then(|value| value.get("id"))
            .and_then(Value::as_u64);
        match (parsed, id) {
            (Some(answer), Some(id)) => {
                let sender = lock(&process.pending).remove(&id);
                match sender {
                    Some(sender) => {
                        let _ = sender.send(Ok(answer));
                    }
                    None => tracing::debug!(
                        id,
                        "an external program answered a request that already timed out"
                    ),
                }
            }
            _ => {
                process.fail(format!(
                    "it wrote a line that is not a JSON object with a numeric `id` ({}), so the protocol is broken; \
                     the process was killed and will be restarted",
                    truncate(&line)
                ));
                break;
            }
        }
    }
    // End of stdout: the process exited (or closed stdout); reap it and report why.
    let status = {
        let mut child = lock(&process.child);
        let _ = child.kill();
        child.wait()
    };
    let _ = stderr_done.recv_timeout(Duration::from_millis(200));
    let status = match status {
        Ok(status) => status.to_string(),
        Err(error) => format!("unknown status: {error}"),
    };
    process.fail(format!("the process exited ({status}){}", process.stderr_tail()));
}

fn keep_stderr_tail(mut stderr: impl Read, tail: Arc<Mutex<Vec<u8>>>, done: mpsc::Sender<()>) {
    let mut buffer = [0_u8; 1024];
    while let Ok(read) = stderr.read(&mut buffer) {
        if read == 0 {
            break;
        }
        let mut tail = lock(&tail);
        tail.extend_from_slice(&buffer[..read]);
        let excess = tail.len().saturating_sub(STDERR_TAIL_BYTES);
        tail.drain(..excess);
    }
    let _ = done.send(());
}

/// A long-lived child process answering JSON requests (see the module documentation).
pub struct JsonLinesProcess {
    /// Names its threads and log lines (`reward-judge`, `tool-search`).
    label: String,
    /// The recipe key that sets the command, for errors.
    key: String,
    program: Vec<String>,
    timeout: Duration,
    limit: InFlightLimit,
    current: Mutex<Option<Arc<ChildProcess>>>,
    next_request_id: AtomicU64,
    starts: AtomicU64,
}

impl JsonLinesProcess {
    /// A process running `program` (the executable and its arguments) when first needed, with a
    /// time limit per request and at most `max_in_flight` requests outstanding. `label` names
    /// its threads and log lines; `key` is the recipe key that sets the command, named when it
    /// cannot start.
    pub fn new(
        label: &str,
        key: &str,
        program: Vec<String>,
        timeout: Duration,
        max_in_flight: usize,
    ) -> Self {
        Self {
            label: label.to_string(),
            key: key.to_string(),
            program,
            timeout,
            limit: InFlightLimit::new(max_in_flight),
            current: Mutex::new(None),
            next_request_id: AtomicU64::new(0),
            starts: AtomicU64::new(0),
        }
    }

    /// How many processes have been started so far (1 + restarts, once running).
    pub fn starts(&self) -> u64 {
        self.starts.load(Ordering::Relaxed)
    }

    /// The time limit of one request.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn spawn(&self) -> Result<Arc<ChildProcess>, String> {
        let (executable, arguments) = self
            .program
            .split_first()
            .ok_or_else(|| format!("the command is empty; check `{}`", self.key))?;
        let mut child = Command::new(executable)
            .args(arguments)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|error| {
                format!(
                    "could not start {:?}: {error}; check `{}`",
                    self.program, self.key
                )
            })?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("stdout was piped");
        let stderr = child.stderr.take().expect("stderr was piped");
        let process = Arc::new(ChildProcess {
            child: Mutex::new(child),
            stdin: Mutex::new(stdin),
            pending: Mutex::new(HashMap::new()),
            dead: Mutex::new(None),
            stderr_tail: Arc::new(Mutex::new(Vec::new())),
        });
        let (stderr_done_sender, stderr_done) = mpsc::channel();
        let tail = process.stderr_tail.clone();
        std::thread::Builder::new()
            .name(format!("{}-stderr", self.label))
            .spawn(move || keep_stderr_tail(stderr, tail, stderr_done_sender))
            .map_err(|error| format!("could not start a thread: {error}"))?;
        let reader_process = process.clone();
        std::thread::Builder::new()
            .name(format!("{}-stdout", self.label))
            .spawn(move || read_answers(reader_process, stdout, stderr_done))
            .map_err(|error| format!("could not start a thread: {error}"))?;
        self.starts.fetch_add(1, Ordering::Relaxed);
        Ok(process)
    }

    /// The running process, starting a new one if there is none or the last one died.
    fn live_process(&self) -> Result<Arc<ChildProcess>, String> {
        let mut current = lock(&self.current);
        if let Some(process) = current.as_ref() {
            match process.death() {
                None => return Ok(process.clone()),
                Some(reason) => {
                    tracing::warn!(program = %self.label, "restarting {:?}: {reason}", self.program)
                }
            }
        }
        let process = self.spawn()?;
        *current = Some(process.clone());
        Ok(process)
    }

    /// Sends the request `request(id)` makes for a fresh `id` (which it must carry as its `id`
    /// field) and waits for the answer object with that `id`. `what` names the request in the
    /// time-out message (`sample 12`).
    pub fn call<R: Serialize>(&self, what: &str, request: impl Fn(u64) -> R) -> Result<Value, ExternalError> {
        let deadline = Instant::now() + self.timeout;
        let _slot = self
            .limit
            .acquire_until(deadline)
            .ok_or(ExternalError::TimedOut(self.timeout))?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let process = self.live_process().map_err(ExternalError::Failed)?;
            let id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
            let (sender, answer) = mpsc::sync_channel(1);
            let mut line = serde_json::to_string(&request(id))
                .map_err(|error| ExternalError::Failed(format!("could not encode the request: {error}")))?;
            line.push('\n');
            let delivered = process.register(id, sender).and_then(|()| {
                process.write_line(&line).map_err(|error| {
                    let reason = format!("writing to its stdin failed: {error}");
                    process.fail(reason.clone());
                    reason
                })
            });
            if let Err(reason) = delivered {
                // The request never reached a live process, so it is safe to send it again.
                if attempt < 2 {
                    continue;
                }
                return Err(ExternalError::Failed(reason));
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            return match answer.recv_timeout(remaining) {
                Ok(Ok(answer)) => Ok(answer),
                Ok(Err(message)) => Err(ExternalError::Failed(message)),
                Err(RecvTimeoutError::Timeout) => {
                    lock(&process.pending).remove(&id);
                    process.fail(format!(
                        "it did not answer request {id} ({what}) within {:?}, so it was killed and will be restarted",
                        self.timeout
                    ));
                    Err(ExternalError::TimedOut(self.timeout))
                }
                Err(RecvTimeoutError::Disconnected) => Err(ExternalError::Failed(
                    "the answer channel closed without an answer".to_string(),
                )),
            };
        }
    }
}

impl Drop for JsonLinesProcess {
    fn drop(&mut self) {
        if let Some(process) = lock(&self.current).take() {
            process.fail(format!("{} was shut down", self.label));
        }
    }
}
