//! External scorers against real processes and a real HTTP server: a python3 JSON-lines child
//! (`fixtures/json_lines_scorer.py`) and a small HTTP server on 127.0.0.1 started on a thread by
//! the test. Both are driven through the reward pool, including a scorer that hangs (time limit,
//! score 0, error counted, pool continues) and one that crashes (restarted, later requests
//! succeed). Time limits are short (but allow for a loaded 2-core CI machine: a fresh python3
//! process's start-up counts against the first request) so the file runs in about 4 seconds.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reward::external::command::CommandScorer;
use reward::external::http::HttpScorer;
use reward::{PoolOptions, RewardConfig, RewardFunction, RewardPool, Sample, ScoredSample};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/json_lines_scorer.py");

fn sample(id: u64, data_source: &str, response: &str, truth: &str) -> Sample {
    Sample {
        id,
        data_source: data_source.to_string(),
        prompt: serde_json::Value::Null,
        response: response.to_string(),
        ground_truth: truth.to_string(),
        extra: serde_json::json!({"split": "test"}),
        response_length: response.len(),
        truncated: false,
    }
}

/// Submits `samples` and waits for exactly that many results (sorted by id).
fn run_phase(pool: &RewardPool, samples: Vec<Sample>) -> Vec<ScoredSample> {
    let count = samples.len();
    for sample in samples {
        pool.submit(sample).unwrap();
    }
    let mut results: Vec<ScoredSample> = (0..count)
        .map(|_| {
            pool.recv_timeout(Duration::from_secs(10))
                .expect("a result within 10 s")
        })
        .collect();
    results.sort_by_key(|r| r.id);
    results
}

fn error_of(result: &ScoredSample) -> &str {
    result
        .error
        .as_deref()
        .unwrap_or_else(|| panic!("sample {} has no error: {result:?}", result.id))
}

#[test]
fn json_lines_child_process_survives_crashes_hangs_and_garbage() {
    let scorer = Arc::new(CommandScorer::new(
        "py_lines",
        vec!["python3".into(), FIXTURE.into()],
        Duration::from_millis(2500),
        4,
    ));
    let reward = RewardFunction::new().with_data_source("ext", scorer.clone());
    let pool = RewardPool::new(
        Arc::new(reward),
        PoolOptions {
            num_workers: 4,
            time_limit: Duration::from_secs(5),
            log_first_errors: 3,
        },
    );

    // Normal answers, several in flight at once.
    let first = run_phase(
        &pool,
        (0..4)
            .map(|id| sample(id, "ext", &format!(" {id} "), &id.to_string()))
            .collect(),
    );
    assert!(
        first.iter().all(|r| r.score == 1.0 && r.error.is_none()),
        "{first:?}"
    );
    assert_eq!(first[2].extras["length"], 3.0);
    let first_pid = first[0].extras["pid"];
    assert!(first.iter().all(|r| r.extras["pid"] == first_pid));
    assert_eq!(scorer.starts(), 1);

    // Answers out of order are matched by id.
    let pair = run_phase(
        &pool,
        vec![
            sample(10, "ext", "PAIR_a", "PAIR_a"),
            sample(11, "ext", "PAIR_b", "x"),
        ],
    );
    assert_eq!((pair[0].score, pair[1].score), (1.0, 0.0), "{pair:?}");

    // A crash fails its sample with the exit status and stderr; the next request restarts it.
    let crashed = run_phase(&pool, vec![sample(20, "ext", "CRASH", "")]);
    assert_eq!(crashed[0].score, 0.0);
    let message = error_of(&crashed[0]);
    assert!(
        message.contains("exit status: 3") && message.contains("scorer crashing on purpose"),
        "{message}"
    );
    let after_crash = run_phase(
        &pool,
        vec![sample(21, "ext", "5", "5"), sample(22, "ext", "6", "6")],
    );
    assert!(after_crash.iter().all(|r| r.score == 1.0), "{after_crash:?}");
    assert_ne!(after_crash[0].extras["pid"], first_pid);
    assert_eq!(scorer.starts(), 2);

    // A hang hits the scorer's time limit; the stuck process is replaced.
    let started = Instant::now();
    let hung = run_phase(&pool, vec![sample(30, "ext", "HANG", "")]);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(2500) && waited < Duration::from_secs(6),
        "{waited:?}"
    );
    assert_eq!(hung[0].score, 0.0);
    assert!(
        error_of(&hung[0]).contains("did not finish sample 30 within 2.5s"),
        "{}",
        error_of(&hung[0])
    );
    let after_hang = run_phase(&pool, vec![sample(31, "ext", "7", "7")]);
    assert_eq!(after_hang[0].score, 1.0, "{after_hang:?}");
    assert_eq!(scorer.starts(), 3);

    // Garbage breaks the protocol (restart); a bad answer or a reported error fails one sample.
    let garbage = run_phase(&pool, vec![sample(40, "ext", "GARBAGE", "")]);
    assert!(
        error_of(&garbage[0]).contains("not a JSON object with a numeric `id` (this is not json)"),
        "{garbage:?}"
    );
    let bad = run_phase(
        &pool,
        vec![
            sample(41, "ext", "BAD_SCORE", ""),
            sample(42, "ext", "REPORT_ERROR", ""),
        ],
    );
    assert!(
        error_of(&bad[0]).contains("`score` must be a number, got \"high\""),
        "{bad:?}"
    );
    assert!(
        error_of(&bad[1]).contains("the scorer reported an error: cannot judge this one"),
        "{bad:?}"
    );
    let last = run_phase(&pool, vec![sample(43, "ext", "8", "8")]);
    assert_eq!(last[0].score, 1.0);
    assert_eq!(scorer.starts(), 4);

    let metrics = pool.metrics();
    assert_eq!(
        (metrics.submitted, metrics.completed, metrics.errors),
        (15, 15, 5)
    );
    let kinds: Vec<(&str, u64)> = metrics
        .errors_by_kind
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(kinds, [("external", 4), ("timeout", 1)]);
    assert_eq!(
        metrics.workers_abandoned, 0,
        "the scorer's own limit fired, not the pool's"
    );
}

#[test]
fn command_scorer_from_the_recipe_section() {
    let yaml = format!(
        "data_sources: {{ext: judge}}\nscorers:\n  judge: {{kind: command, command: [python3, {FIXTURE:?}], timeout_s: 2, max_in_flight: 2}}\n"
    );
    let config: RewardConfig = serde_yaml::from_str(&yaml).unwrap();
    let reward = config.build(None).unwrap();
    let score = reward.score(&sample(1, "ext", "42", "42")).unwrap();
    assert_eq!(score.value, 1.0);
    let missing = RewardConfig {
        data_sources: [("ext".to_string(), "judge".to_string())].into(),
        scorers: [(
            "judge".to_string(),
            serde_yaml::from_str("{kind: command, command: [/nonexistent/scorer-binary]}").unwrap(),
        )]
        .into(),
        ..RewardConfig::default()
    };
    let error = missing
        .build(None)
        .unwrap()
        .score(&sample(2, "ext", "1", "1"))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("could not start [\"/nonexistent/scorer-binary\"]")
            && error.contains("reward.scorers.judge.command"),
        "{error}"
    );
}

/// A small HTTP/1.1 server on 127.0.0.1 that scores like the Python fixture, with behaviours
/// selected by the response text: `HANG` (answers after 6 s), `DROP` (closes the connection
/// without answering), `ERROR500`, `GARBAGE`, `NUMBER` (a bare `0.25`). Each normal request
/// takes 40 ms; the server records the most requests it ever had in progress at once.
struct TestServer {
    url: String,
    max_concurrent: Arc<AtomicUsize>,
}

fn start_server() -> TestServer {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/score", listener.local_addr().unwrap());
    let current = Arc::new(AtomicUsize::new(0));
    let max_concurrent = Arc::new(AtomicUsize::new(0));
    let max_seen = max_concurrent.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let (current, max_seen) = (current.clone(), max_seen.clone());
            std::thread::spawn(move || handle(stream, &current, &max_seen));
        }
    });
    TestServer { url, max_concurrent }
}

fn handle(stream: TcpStream, current: &AtomicUsize, max_seen: &AtomicUsize) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut content_length = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        if line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                content_length = value.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0; content_length];
    reader.read_exact(&mut body).unwrap();
    let request: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let response = request["response"].as_str().unwrap().to_string();
    let in_progress = current.fetch_add(1, Ordering::SeqCst) + 1;
    max_seen.fetch_max(in_progress, Ordering::SeqCst);
    let (status, text) = match response.as_str() {
        "HANG" => {
            std::thread::sleep(Duration::from_secs(6));
            ("200 OK", "1.0".to_string())
        }
        "DROP" => {
            current.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        "ERROR500" => ("500 Internal Server Error", "internal oops".to_string()),
        "GARBAGE" => ("200 OK", "<html>not json".to_string()),
        "NUMBER" => ("200 OK", "0.25".to_string()),
        _ => {
            std::thread::sleep(Duration::from_millis(40));
            let correct = response.trim() == request["ground_truth"].as_str().unwrap();
            let answer = serde_json::json!({"score": if correct { 1.0 } else { 0.0 }, "extras": {"sample_id": request["sample_id"]}});
            ("200 OK", answer.to_string())
        }
    };
    current.fetch_sub(1, Ordering::SeqCst);
    let mut stream = stream;
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
        text.len()
    );
}

#[test]
fn http_endpoint_with_hangs_drops_and_bad_answers() {
    let server = start_server();
    let scorer = Arc::new(HttpScorer::new(
        "judge",
        &server.url,
        Duration::from_millis(1500),
        2,
    ));
    let reward = RewardFunction::new().with_data_source("web", scorer);
    let pool = RewardPool::new(
        Arc::new(reward),
        PoolOptions {
            num_workers: 6,
            time_limit: Duration::from_secs(5),
            log_first_errors: 5,
        },
    );

    // Eight normal requests from six workers: never more than two in flight.
    let truth = |id: u64| {
        if id.is_multiple_of(2) {
            id.to_string()
        } else {
            "wrong".to_string()
        }
    };
    let normal = run_phase(
        &pool,
        (0..8)
            .map(|id| sample(id, "web", &id.to_string(), &truth(id)))
            .collect(),
    );
    let scores: Vec<f64> = normal.iter().map(|r| r.score).collect();
    assert_eq!(scores, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]);
    assert!(
        normal
            .iter()
            .all(|r| r.error.is_none() && r.extras["sample_id"] == r.id as f64),
        "{normal:?}"
    );
    assert_eq!(server.max_concurrent.load(Ordering::SeqCst), 2);

    // A hang times out at 1.5 s; a normal request submitted with it still succeeds.
    let started = Instant::now();
    let mixed = run_phase(
        &pool,
        vec![sample(20, "web", "HANG", ""), sample(21, "web", "3", "3")],
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert_eq!((mixed[0].score, mixed[1].score), (0.0, 1.0), "{mixed:?}");
    assert!(
        error_of(&mixed[0]).contains("did not finish sample 20 within 1.5s"),
        "{mixed:?}"
    );

    // A dropped connection, an HTTP error and garbage fail their samples; later requests work.
    let failures = run_phase(
        &pool,
        vec![
            sample(30, "web", "DROP", ""),
            sample(31, "web", "ERROR500", ""),
            sample(32, "web", "GARBAGE", ""),
            sample(33, "web", "NUMBER", ""),
        ],
    );
    assert!(
        error_of(&failures[0]).contains(&format!("POST {} failed", server.url)),
        "{failures:?}"
    );
    assert!(
        error_of(&failures[1]).contains("answered HTTP 500 Internal Server Error: internal oops"),
        "{failures:?}"
    );
    assert!(
        error_of(&failures[2]).contains("the answer is not JSON"),
        "{failures:?}"
    );
    assert_eq!((failures[3].score, failures[3].error.as_ref()), (0.25, None));
    let after = run_phase(&pool, vec![sample(40, "web", "9", "9")]);
    assert_eq!(after[0].score, 1.0);

    let metrics = pool.metrics();
    assert_eq!((metrics.submitted, metrics.errors), (15, 4));
    let kinds: Vec<(&str, u64)> = metrics
        .errors_by_kind
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(kinds, [("external", 3), ("timeout", 1)]);
}

#[test]
fn unreachable_endpoint_is_an_error_naming_the_url() {
    // Bind then drop a listener to get a port nobody listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/score");
    let scorer = HttpScorer::new("judge", &url, Duration::from_millis(500), 1);
    let error = reward::Scorer::score(&scorer, &sample(1, "web", "1", "1")).unwrap_err();
    assert_eq!(error.kind(), "external");
    assert!(
        error.to_string().contains(&format!("POST {url} failed")),
        "{error}"
    );
}
