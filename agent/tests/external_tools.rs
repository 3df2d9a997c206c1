//! User tools against a real program (`fixtures/tools.py`), as a JSON-lines child process and as
//! an HTTP server: results, reported errors, and a program that hangs, crashes, writes garbage
//! or answers megabytes. Each failure is a `ToolError` for that call; the next call works.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use agent::external::Transport;
use agent::{ExternalTool, Tool, ToolError, ToolSchema};
use serde_json::json;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tools.py");

fn schema(name: &str) -> ToolSchema {
    ToolSchema {
        name: name.into(),
        description: "A test tool.".into(),
        parameters: json!({"type": "object", "properties": {"text": {"type": "string"}}}),
    }
}

fn command_tool(name: &str, timeout: Duration) -> ExternalTool {
    ExternalTool::command(
        schema(name),
        "tools[0].config.command",
        vec!["python3".into(), FIXTURE.into()],
        timeout,
        4,
    )
}

fn starts(tool: &ExternalTool) -> u64 {
    match tool.transport() {
        Transport::Command(process) => process.starts(),
        Transport::Http(_) => panic!("not a command"),
    }
}

#[test]
fn a_json_lines_tool_survives_hangs_crashes_and_garbage() {
    let echo = command_tool("echo", Duration::from_secs(5));
    assert_eq!(echo.call(&json!({"text": "hello"})).unwrap(), "hello");
    assert_eq!(echo.call(&json!({"text": "again"})).unwrap(), "again");
    assert_eq!(starts(&echo), 1, "one process serves every call");

    let hang = command_tool("hang", Duration::from_millis(1500));
    let started = Instant::now();
    assert_eq!(
        hang.call(&json!({})),
        Err(ToolError::TimedOut(Duration::from_millis(1500)))
    );
    assert!(started.elapsed() < Duration::from_secs(3));

    let crash = command_tool("crash", Duration::from_secs(5));
    let message = crash.call(&json!({})).unwrap_err().to_string();
    assert!(
        message.starts_with("the tool's program failed: the process exited"),
        "{message}"
    );
    assert!(message.contains("dying on purpose"), "{message}");
    let _ = crash.call(&json!({}));
    assert_eq!(
        starts(&crash),
        2,
        "a crashed program is started again for the next call"
    );

    let garbage = command_tool("garbage", Duration::from_secs(5));
    let message = garbage.call(&json!({})).unwrap_err().to_string();
    assert!(
        message.contains("not a JSON object with a numeric `id`"),
        "{message}"
    );

    let huge = command_tool("huge", Duration::from_secs(10));
    assert_eq!(huge.call(&json!({})).unwrap().len(), 5_000_000);

    let error = command_tool("error", Duration::from_secs(5));
    assert_eq!(
        error.call(&json!({})),
        Err(ToolError::Failed("no such city".into()))
    );
    let bare = command_tool("bare", Duration::from_secs(5));
    assert!(bare
        .call(&json!({}))
        .unwrap_err()
        .to_string()
        .contains("without a `result`"));

    let missing = ExternalTool::command(
        schema("echo"),
        "tools[3].config.command",
        vec!["/no/such/program".into()],
        Duration::from_secs(1),
        1,
    );
    let message = missing.call(&json!({})).unwrap_err().to_string();
    assert!(message.contains("check `tools[3].config.command`"), "{message}");
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn http_server() -> (Server, String) {
    let folder = tempfile::tempdir().unwrap();
    let port_file: PathBuf = folder.path().join("port");
    let child = Command::new("python3")
        .args([FIXTURE, "--http", port_file.to_str().unwrap()])
        .spawn()
        .expect("python3 starts");
    let server = Server(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(port) = std::fs::read_to_string(&port_file) {
            if !port.is_empty() {
                return (server, format!("http://127.0.0.1:{port}/tools"));
            }
        }
        assert!(Instant::now() < deadline, "the HTTP fixture did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_http_tool_reports_hangs_errors_and_garbage() {
    let (_server, url) = http_server();
    let tool = |name: &str, timeout| ExternalTool::http(schema(name), &url, timeout, 2);
    assert_eq!(
        tool("echo", Duration::from_secs(5))
            .call(&json!({"text": "hi"}))
            .unwrap(),
        "hi"
    );
    assert_eq!(
        tool("hang", Duration::from_millis(800)).call(&json!({})),
        Err(ToolError::TimedOut(Duration::from_millis(800)))
    );
    let message = tool("crash", Duration::from_secs(5))
        .call(&json!({}))
        .unwrap_err()
        .to_string();
    assert!(message.contains("answered HTTP 500"), "{message}");
    let message = tool("garbage", Duration::from_secs(5))
        .call(&json!({}))
        .unwrap_err()
        .to_string();
    assert!(message.contains("the answer is not JSON"), "{message}");
    assert_eq!(
        tool("error", Duration::from_secs(5)).call(&json!({})),
        Err(ToolError::Failed("no such city".into()))
    );
    // The endpoint still answers after all that.
    assert_eq!(
        tool("echo", Duration::from_secs(5))
            .call(&json!({"text": "ok"}))
            .unwrap(),
        "ok"
    );
    let message = ExternalTool::http(
        schema("echo"),
        "http://127.0.0.1:9/none",
        Duration::from_secs(2),
        1,
    )
    .call(&json!({}))
    .unwrap_err()
    .to_string();
    assert!(
        message.contains("POST http://127.0.0.1:9/none failed"),
        "{message}"
    );
}
