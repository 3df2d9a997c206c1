//! The Python executor against code that misbehaves: hangs, crashes, floods its output, eats
//! memory, and tries to leave its sandbox (files, network, processes, signals).

use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use agent::{Python, PythonSettings, Tool, ToolError};
use serde_json::json;

fn python() -> &'static Python {
    static PYTHON: OnceLock<Python> = OnceLock::new();
    PYTHON.get_or_init(|| {
        Python::new(PythonSettings {
            interpreter: PathBuf::from("python3"),
            timeout: Duration::from_secs(3),
            memory_mb: 256,
            max_processes: 4,
        })
        .unwrap_or_else(|e| panic!("the sandboxed executor must work on this machine: {e}"))
    })
}

fn call(code: &str) -> Result<String, ToolError> {
    python().call(&json!({ "code": code }))
}

fn failure(code: &str) -> String {
    match call(code) {
        Err(ToolError::Failed(message)) => message,
        other => panic!("expected a failure for {code:?}, got {other:?}"),
    }
}

#[test]
fn runs_code_and_returns_what_it_prints() {
    assert_eq!(
        call("print(2 ** 100)").unwrap(),
        "1267650600228229401496703205376\n"
    );
    assert_eq!(call("x = 1").unwrap(), "(the code printed nothing)");
    let text = call("import sys, math\nprint(math.comb(30, 15))\nprint('warn', file=sys.stderr)").unwrap();
    assert_eq!(text, "155117520\nwarn\n");
    // Threads still work: only new processes are refused.
    let threads = "import threading\nr = []\nt = threading.Thread(target=lambda: r.append(7))\nt.start(); t.join()\nprint(r)";
    assert_eq!(call(threads).unwrap(), "[7]\n");
}

#[test]
fn errors_come_back_as_the_traceback_and_exit_status() {
    let message = failure("print('before')\n1 / 0");
    assert!(
        message.starts_with("the code exited with status 1; it printed:\nbefore\n"),
        "{message}"
    );
    assert!(message.contains("ZeroDivisionError"), "{message}");
    assert!(failure("def f(:\n  pass").contains("SyntaxError"));
    assert!(failure("import sys; sys.exit(3)").contains("status 3"));
    assert!(matches!(
        python().call(&json!({"code": 5})),
        Err(ToolError::BadArguments(_))
    ));
}

#[test]
fn a_hang_is_stopped_at_the_time_limit() {
    for code in ["while True: pass", "import time\ntime.sleep(60)"] {
        let started = Instant::now();
        assert_eq!(
            call(code),
            Err(ToolError::TimedOut(Duration::from_secs(3))),
            "{code}"
        );
        let took = started.elapsed();
        assert!(took < Duration::from_secs(5), "{code} took {took:?}");
    }
}

#[test]
fn floods_of_output_are_cut_and_garbage_is_text() {
    let text = call("import sys\nsys.stdout.write('x' * 5_000_000)").unwrap();
    assert!(text.len() < 1_100_000, "{}", text.len());
    assert!(text.ends_with(&format!(
        "...({} more bytes of output dropped)",
        5_000_000 - (1 << 20)
    )));
    let text = call("import sys\nsys.stdout.buffer.write(bytes(range(256)))").unwrap();
    assert!(text.contains('\u{fffd}'));
}

#[test]
fn memory_beyond_the_limit_fails_inside_the_code() {
    let message = failure("x = bytearray(1024 ** 3)");
    assert!(message.contains("MemoryError"), "{message}");
}

#[test]
fn files_outside_the_sandbox_folder_cannot_be_read_or_written() {
    let outside = tempfile::tempdir().unwrap();
    let secret = outside.path().join("secret.txt");
    std::fs::File::create(&secret)
        .unwrap()
        .write_all(b"hidden")
        .unwrap();
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    for path in [
        secret.to_str().unwrap(),
        manifest,
        "/etc/hostname",
        "/proc/self/environ",
    ] {
        let message = failure(&format!("print(open({path:?}).read())"));
        assert!(message.contains("PermissionError"), "{path}: {message}");
    }
    let message = failure(&format!(
        "open({:?}, 'w').write('x')",
        outside.path().join("new.txt").to_str().unwrap()
    ));
    assert!(message.contains("PermissionError"), "{message}");
    assert!(failure("import os\nprint(os.listdir('/'))").contains("PermissionError"));
    assert!(!outside.path().join("new.txt").exists());
    // Its own folder is writable, and a new call does not see the last call's files.
    assert_eq!(
        call("open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())").unwrap(),
        "kept\n"
    );
    assert_eq!(
        call("import os\nprint(sorted(os.listdir('.')))").unwrap(),
        "['main.py']\n"
    );
}

#[test]
fn no_network_no_processes_no_signals() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let connect = format!(
        "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    );
    let message = failure(&connect);
    assert!(message.contains("PermissionError"), "{message}");
    for family in ["AF_INET6", "AF_UNIX", "AF_NETLINK", "AF_PACKET"] {
        let message = failure(&format!("import socket\nsocket.socket(socket.{family})"));
        assert!(message.contains("PermissionError"), "{family}: {message}");
    }
    let message = failure("import subprocess\nsubprocess.run(['true'])");
    assert!(message.contains("PermissionError"), "{message}");
    assert!(failure("import os\nos.fork()").contains("PermissionError"));
    let parent = std::process::id();
    let message = failure(&format!("import os, signal\nos.kill({parent}, signal.SIGTERM)"));
    assert!(message.contains("PermissionError"), "{message}");
}

#[test]
fn calls_beyond_the_process_limit_wait_for_a_slot() {
    let started = Instant::now();
    let runs: Vec<_> = (0..8)
        .map(|k| std::thread::spawn(move || call(&format!("import time\ntime.sleep(0.3)\nprint({k})"))))
        .collect();
    for (k, run) in runs.into_iter().enumerate() {
        assert_eq!(run.join().unwrap().unwrap(), format!("{k}\n"));
    }
    // Four at a time: two rounds of 0.3 s at least.
    assert!(
        started.elapsed() >= Duration::from_millis(600),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_missing_interpreter_and_bad_limits_are_set_up_errors() {
    let settings = |interpreter: &str, memory_mb| PythonSettings {
        interpreter: PathBuf::from(interpreter),
        timeout: Duration::from_secs(2),
        memory_mb,
        max_processes: 1,
    };
    let message = Python::new(settings("/no/such/python3", 256))
        .err()
        .unwrap()
        .to_string();
    assert!(
        message.contains("\"/no/such/python3\" is not usable: it did not start"),
        "{message}"
    );
    let message = Python::new(settings("python3", 16)).err().unwrap().to_string();
    assert!(message.contains("at least 64"), "{message}");
}
