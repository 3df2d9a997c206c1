//! Every parser of outside input, fed mutated copies of valid inputs: recipes (YAML and `--set`
//! values), `config.json`, `tokenizer.json`, safetensors model files, GGUF headers, Parquet
//! datasets, checkpoints, a model's tool calls with the calculator's expressions in them, tool
//! config files, the replies of external scorers, user tools and interactions (over HTTP and
//! from a JSON-lines program), and the gRPC messages of every method a rollout, reward or
//! learner worker and the orchestrator's registry serve (raw bytes, sent with the run's token
//! to real worker processes, which must answer each and stay healthy). Each must answer with
//! `Ok` or a clear error: a panic, or an input that takes seconds, fails the test with the
//! target, the seed and the file to keep.
//!
//! The budget is `GRPO_FUZZ_ITERS` inputs per target (1000 by default, as CI runs it; raise it to
//! search longer). The seeds are the valid inputs the test builds (the tiny model, its Parquet
//! data, a checkpoint) and the committed recipes; inputs that once failed are kept in
//! `tests/fixtures/fuzz/<target>/` and replayed first, every run.

mod common;

use common::*;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// SplitMix64: the mutations' randomness, seeded per target so a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Values that break length fields and counts.
const INTERESTING: [u64; 8] = [0, 1, 0x7f, 0xff, 0xffff_ffff, 1 << 31, 1 << 63, u64::MAX];

/// Text fragments that break YAML and JSON.
const TOKENS: [&str; 16] = [
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    "\"",
    "\n",
    "- ",
    "&a ",
    "*a",
    "!!binary ",
    "1e999",
    "null",
    "-1",
    "\u{feff}",
];

/// One random edit of `bytes`; `region` limits offset-based edits to the first bytes (a file's
/// header), where they matter.
fn mutate(rng: &mut Rng, bytes: &mut Vec<u8>, region: usize, text: bool) {
    let span = region.min(bytes.len()).max(1);
    match rng.below(if text { 7 } else { 6 }) {
        0 => {
            let i = rng.below(span);
            if let Some(b) = bytes.get_mut(i) {
                *b ^= 1 << rng.below(8);
            }
        }
        1 => {
            let i = rng.below(span);
            if let Some(b) = bytes.get_mut(i) {
                *b = INTERESTING[rng.below(INTERESTING.len())] as u8;
            }
        }
        2 => {
            let i = rng.below(span);
            let v = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
            for (k, b) in v.iter().enumerate() {
                if let Some(slot) = bytes.get_mut(i + k) {
                    *slot = *b;
                }
            }
        }
        3 => {
            let cut = rng.below(bytes.len() + 1);
            bytes.truncate(cut);
        }
        4 => {
            let (a, b) = (rng.below(span), rng.below(span));
            let (a, b) = (a.min(b), a.max(b).min(bytes.len()));
            let slice = bytes[a..b].to_vec();
            let at = rng.below(bytes.len() + 1);
            bytes.splice(at..at, slice);
        }
        5 => {
            let (a, b) = (rng.below(span), rng.below(span));
            let (a, b) = (a.min(b), a.max(b).min(bytes.len()));
            bytes.drain(a..b);
        }
        _ => {
            let at = rng.below(bytes.len() + 1);
            let t = TOKENS[rng.below(TOKENS.len())].as_bytes();
            bytes.splice(at..at, t.iter().copied());
        }
    }
}

fn iterations() -> usize {
    std::env::var("GRPO_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// The kept failing inputs of `target`.
fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fuzz")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

/// Feeds `target` its corpus, then `iterations()` mutants of `seeds` (1 to 4 edits each, in
/// the first `region` bytes), through `parse`, which writes the input where the parser reads it
/// and parses; every outcome but a panic or a slow parse passes. Returns how many inputs were
/// refused with an error (so a target whose mutants all parse is noticed).
fn fuzz(
    target: &str,
    seed: u64,
    seeds: &[Vec<u8>],
    region: usize,
    text: bool,
    parse: impl FnMut(&[u8]) -> Result<(), String>,
) -> usize {
    fuzz_n(target, seed, seeds, (region, text), iterations(), parse)
}

/// [`fuzz`] with `count` mutants instead of `iterations()`, for a target whose inputs are
/// slow (each one a process restart).
fn fuzz_n(
    target: &str,
    seed: u64,
    seeds: &[Vec<u8>],
    (region, text): (usize, bool),
    count: usize,
    mut parse: impl FnMut(&[u8]) -> Result<(), String>,
) -> usize {
    let mut rng = Rng(seed);
    let started = Instant::now();
    let keep = std::env::temp_dir().join(format!("grpo-fuzz-{target}.bin"));
    let mut refused = 0;
    let mut run = |input: &[u8], what: &str| {
        let t = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| parse(input)));
        let took = t.elapsed();
        let fail = |why: String| {
            std::fs::write(&keep, input).unwrap();
            panic!(
                "fuzz target `{target}` ({what}): {why}; the input is in {} (copy it into \
                 tests/fixtures/fuzz/{target}/ once fixed)",
                keep.display()
            );
        };
        match outcome {
            Err(p) => fail(format!(
                "panicked: {}",
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            )),
            Ok(_) if took > Duration::from_secs(5) => fail(format!("took {took:?}")),
            Ok(Err(_)) => refused += 1,
            Ok(Ok(())) => {}
        }
    };
    for (i, input) in corpus(target).iter().enumerate() {
        run(input, &format!("corpus file {i}"));
    }
    for i in 0..count {
        let mut input = seeds[i % seeds.len()].clone();
        for _ in 0..1 + rng.below(4) {
            mutate(&mut rng, &mut input, region, text);
        }
        run(&input, &format!("seed {seed}, input {i}"));
    }
    eprintln!(
        "{target}: {count} inputs in {:.1} s, {refused} refused with an error",
        started.elapsed().as_secs_f64()
    );
    refused
}

#[test]
fn recipes_and_set_values() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes");
    let seeds: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    assert!(!seeds.is_empty());
    let refused = fuzz("recipe", 1, &seeds, usize::MAX, true, |input| {
        let text = String::from_utf8_lossy(input);
        actors::recipe::load_recipe_str(&text, "fuzz.yaml")
            .map(drop)
            .map_err(|e| e.to_string())
    });
    assert!(refused > 0);
    let sets: Vec<Vec<u8>> = [
        "actor.optim.lr=1e-6",
        "algorithm.kl_ctrl={type: adaptive, target_kl: 0.1}",
        "rollout.stop=[\"</answer>\", \"\\n\"]",
        "cluster.pools=[{name: a, roles: [rollout]}]",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    let base = std::fs::read(dir.join("quickstart.yaml")).unwrap();
    let file = std::env::temp_dir().join(format!("grpo-fuzz-set-{}.yaml", std::process::id()));
    std::fs::write(&file, &base).unwrap();
    fuzz("set", 2, &sets, usize::MAX, true, |input| {
        let set = String::from_utf8_lossy(input).to_string();
        actors::recipe::load_recipe(&file, &[set])
            .map(drop)
            .map_err(|e| e.to_string())
    });
}

#[test]
fn model_files_config_tokenizer_and_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_chat_model(dir.path());
    let config = std::fs::read(model.join("config.json")).unwrap();
    fuzz("config_json", 3, &[config], usize::MAX, true, |input| {
        let v: serde_json::Value = serde_json::from_slice(input).map_err(|e| e.to_string())?;
        model::ModelConfig::from_hf_json(&v, "fuzz")
            .map(drop)
            .map_err(|e| e.to_string())
    });
    let tokenizer = std::fs::read(model.join("tokenizer.json")).unwrap();
    fuzz("tokenizer_json", 4, &[tokenizer], 4096, true, |input| {
        model::ModelTokenizer::from_json_bytes(input, "fuzz")
            .map(drop)
            .map_err(|e| e.to_string())
    });
    // The safetensors header (its length, then JSON) and the first tensors.
    let weights = model.join("model.safetensors");
    let original = std::fs::read(&weights).unwrap();
    let copy = dir.path().join("copy");
    std::fs::create_dir_all(&copy).unwrap();
    for f in std::fs::read_dir(&model).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, copy.join(f.file_name().unwrap())).unwrap();
        }
    }
    let refused = fuzz("safetensors", 5, &[original], 4096, false, |input| {
        std::fs::write(copy.join("model.safetensors"), input).unwrap();
        model::safetensors_io::load_hf_checkpoint(&copy)
            .map(drop)
            .map_err(|e| e.to_string())
    });
    assert!(refused > 0);
}

#[test]
fn gguf_headers() {
    // The header, metadata (vocabulary included) and tensor table of the SmolLM2 GGUF: the
    // tensor data is cut, so a parse that gets that far must say so.
    let path = testkit::smollm2_gguf();
    let bytes = std::fs::read(&path).unwrap();
    let head = bytes[..bytes.len().min(3 << 20)].to_vec();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fuzz.gguf");
    let refused = fuzz("gguf", 6, &[head], 64 << 10, false, |input| {
        std::fs::write(&file, input).unwrap();
        let g = model::GgufFile::open(&file).map_err(|e| e.to_string())?;
        model::ModelConfig::from_gguf(&g).map_err(|e| e.to_string())?;
        model::ModelTokenizer::from_gguf(&g)
            .map(drop)
            .map_err(|e| e.to_string())
    });
    assert!(refused > 0);
}

#[test]
fn parquet_datasets() {
    let dir = tempfile::tempdir().unwrap();
    let train = arithmetic(dir.path(), "train", 1, 16);
    let original = std::fs::read(&train).unwrap();
    let file = dir.path().join("fuzz.parquet");
    let len = original.len();
    // Parquet keeps its metadata at the end: mutate the whole (small) file.
    let refused = fuzz("parquet", 7, &[original], len, false, |input| {
        std::fs::write(&file, input).unwrap();
        let d = data::parquet_dataset::ParquetDataset::open(std::slice::from_ref(&file), Default::default())
            .map_err(|e| e.to_string())?;
        d.read(&(0..d.len()).collect::<Vec<_>>())
            .map(drop)
            .map_err(|e| e.to_string())
    });
    assert!(refused > 0);
}

#[test]
fn checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let state = trainer::checkpoint::TrainerState {
        step: 3,
        weight_version: 3,
        rng_state: serde_json::json!({"seed": 1}),
        sampler_position: serde_json::json!({"epoch": 0, "offset": 4}),
        extra: serde_json::json!({}),
    };
    let tensors = vec![
        model::HostTensor::from_f32("a", vec![2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        model::HostTensor::from_f32("b", vec![4], &[0.5; 4]),
    ];
    let saved =
        trainer::checkpoint::save_checkpoint(dir.path(), &state, &[("params", tensors)], None).unwrap();
    let mut names: Vec<PathBuf> = std::fs::read_dir(&saved)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    names.sort();
    let originals: Vec<Vec<u8>> = names.iter().map(|p| std::fs::read(p).unwrap()).collect();
    // Each file of the checkpoint in turn (the manifest and the tensor files).
    let mut which = 0usize;
    let refused = fuzz("checkpoint", 8, &originals, 4096, false, |input| {
        for (p, o) in names.iter().zip(&originals) {
            std::fs::write(p, o).unwrap();
        }
        let target = &names[which % names.len()];
        which += 1;
        std::fs::write(target, input).unwrap();
        trainer::checkpoint::load_checkpoint(&saved)
            .map(drop)
            .map_err(|e| e.to_string())
    });
    assert!(refused > 0);
}

#[test]
fn tool_calls_and_calculator_expressions() {
    use agent::{Calculator, CallFormat, Tool};
    let seeds: Vec<Vec<u8>> = [
        "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"98765432123 * 123456789\"}}\n</tool_call>",
        "Let me compute.<tool_call>{\"name\": \"calculator\", \"arguments\": \"{\\\"expression\\\": \\\"(1 + 2) ** 10 // 7 % 5\\\"}\"}</tool_call> then <tool_call>{\"name\": \"x\"}</tool_call>",
        "<|python_tag|>{\"name\": \"calculator\", \"parameters\": {\"expression\": \"-2 ** 2 + 7 / 3 - 1.5e3\"}}; {\"name\": \"calculator\", \"parameters\": {\"expression\": \"9 ** 9 ** 2\"}}",
        "{\"name\": \"calculator\", \"arguments\": {\"expression\": \"((((1))))*2_000 ÷ 4 × 3 − 1\"}}",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    let refused = fuzz("tool_call", 6, &seeds, usize::MAX, true, |input| {
        let text = String::from_utf8_lossy(input);
        let mut errors = Vec::new();
        for format in [CallFormat::Hermes, CallFormat::Llama3] {
            let parsed = format.parse(&text);
            errors.extend(parsed.errors.iter().map(|e| e.to_string()));
            for call in &parsed.calls {
                if let Err(e) = Calculator.call(&call.arguments) {
                    errors.push(e.to_string());
                }
            }
        }
        match errors.first() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    });
    assert!(refused > 0);
}

#[test]
fn tool_config_files() {
    let seeds: Vec<Vec<u8>> = [
        "tools:\n  - class_name: python\n    config: {type: native, memory_limit_mb: 512, default_timeout: 5, interpreter: python3}\n    tool_schema: {type: function, function: {name: code_interpreter, description: Runs code., parameters: {type: object, properties: {code: {type: string}}, required: [code]}}}\n",
        "tools:\n  - class_name: command\n    config: {command: [python3, t.py], timeout: 2, max_in_flight: 3}\n    tool_schema: {type: function, function: {name: search, description: Finds., parameters: {type: object, properties: {q: {type: string}}}}}\n  - class_name: http\n    config: {url: 'http://127.0.0.1:9/t'}\n    tool_schema: {type: function, function: {name: look, description: Looks., parameters: {type: object}}}\n  - class_name: calculator\n",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    let refused = fuzz("tool_config", 7, &seeds, usize::MAX, true, |input| {
        agent::config::parse(&String::from_utf8_lossy(input)).map(|_| ())
    });
    assert!(refused > 0);
}

/// `template` with every `ID` replaced by `id`: a reply that answers the request it is for.
fn answering(template: &[u8], id: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(template.len());
    let mut rest = template;
    while !rest.is_empty() {
        if rest.starts_with(b"ID") {
            out.extend_from_slice(id.as_bytes());
            rest = &rest[2..];
        } else {
            out.push(rest[0]);
            rest = &rest[1..];
        }
    }
    out
}

/// A loopback HTTP endpoint that answers every `POST` with the reply `template` holds (its
/// `ID`s replaced by the request's `id`), over kept-alive connections, as a scorer, tool or
/// interaction endpoint would. Returns its URL.
fn replying_endpoint(template: std::sync::Arc<std::sync::Mutex<Vec<u8>>>) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let template = template.clone();
            std::thread::spawn(move || {
                let _ = stream.set_nodelay(true);
                let mut writer = stream.try_clone().unwrap();
                let mut reader = BufReader::new(stream);
                loop {
                    let mut length = 0;
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let line = line.trim_end();
                        if line.is_empty() {
                            break;
                        }
                        if let Some((name, value)) = line.split_once(':') {
                            if name.eq_ignore_ascii_case("content-length") {
                                length = value.trim().parse().unwrap_or(0);
                            }
                        }
                    }
                    let mut body = vec![0; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    let id = serde_json::from_slice::<serde_json::Value>(&body)
                        .ok()
                        .and_then(|v| v.get("id").cloned())
                        .unwrap_or_default()
                        .to_string();
                    let reply = answering(&template.lock().unwrap(), &id);
                    // One write: a head and a body sent apart wait out delayed ACKs.
                    let mut answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        reply.len()
                    )
                    .into_bytes();
                    answer.extend_from_slice(&reply);
                    if writer.write_all(&answer).is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

/// The replies of external scorers, user tools and interactions, over HTTP and over a
/// JSON-lines process: each mutant is what the endpoint or the program answers, so the
/// transport (status, framing, ids, a process broken by a bad line and restarted) and the
/// reading of the answer both see it.
#[test]
fn external_replies() {
    use agent::{EnvTurn, Environment, ExternalTool, Interaction, Tool, ToolSchema};
    use reward::Scorer;
    use std::sync::{Arc, Mutex};
    let strings = |seeds: &[&str]| -> Vec<Vec<u8>> { seeds.iter().map(|s| s.as_bytes().to_vec()).collect() };
    let sample = |response: String| reward::Sample {
        id: 1,
        data_source: "fuzz".into(),
        prompt: serde_json::Value::Null,
        response,
        ground_truth: "42".into(),
        extra: serde_json::json!({"index": 0}),
        response_length: 3,
        truncated: false,
    };
    let template = Arc::new(Mutex::new(Vec::new()));
    let url = replying_endpoint(template.clone());
    let timeout = Duration::from_secs(2);

    let scores = strings(&[
        r#"{"id": ID, "score": 0.5, "extras": {"acc": true, "length": 3}}"#,
        r#"{"id": ID, "error": "the judge is down"}"#,
        r#"{"id": ID, "score": false, "extras": null}"#,
    ]);
    let scorer = reward::external::http::HttpScorer::new("fuzz", &url, timeout, 2);
    let refused = fuzz("scorer_reply_http", 8, &scores, usize::MAX, true, |input| {
        *template.lock().unwrap() = input.to_vec();
        scorer
            .score(&sample(String::new()))
            .map(drop)
            .map_err(|e| e.to_string())
    });
    assert!(refused > 0);

    let schema = ToolSchema {
        name: "search".into(),
        description: "Finds.".into(),
        parameters: serde_json::json!({"type": "object"}),
    };
    let tool = ExternalTool::http(schema, &url, timeout, 2);
    let results = strings(&[
        r#"{"id": ID, "result": "Paris is the capital of France."}"#,
        r#"{"id": ID, "result": {"rows": [1, 2, 3]}}"#,
        r#"{"id": ID, "error": "no such page"}"#,
        r#""a bare string""#,
    ]);
    let refused = fuzz("tool_reply_http", 9, &results, usize::MAX, true, |input| {
        *template.lock().unwrap() = input.to_vec();
        tool.call(&serde_json::json!({"q": "capital of France"}))
            .map(drop)
            .map_err(|e| e.to_string())
    });
    assert!(refused > 0);

    let interaction = Interaction::http("fuzz", &url, timeout, 2);
    let replies = strings(&[
        r#"{"id": ID, "content": "Lower.", "done": false, "reward": 0.0}"#,
        r#"{"id": ID, "content": "Right!", "done": true, "reward": true}"#,
        r#"{"id": ID, "content": "", "done": null}"#,
    ]);
    let refused = fuzz(
        "interaction_reply_http",
        10,
        &replies,
        usize::MAX,
        true,
        |input| {
            *template.lock().unwrap() = input.to_vec();
            let turn = EnvTurn {
                episode: "fuzz-1-0-0",
                user_turns: 1,
                text: "I guess 50.",
                kwargs: &serde_json::Value::Null,
            };
            interaction.step(&turn).map(drop).map_err(|e| e.to_string())
        },
    );
    assert!(refused > 0);

    // A scorer program that answers each request with the text of its `response`, `ID`s
    // replaced by the request's id: the mutants become its stdout lines (newlines included).
    let echo = "import json, sys\n\
                for line in sys.stdin:\n    \
                    r = json.loads(line)\n    \
                    sys.stdout.write(r['response'].replace('ID', str(r['id'])) + '\\n')\n    \
                    sys.stdout.flush()\n";
    // -I -S: no site packages, so the restarts after each broken line are quick.
    let program = ["python3", "-I", "-S", "-u", "-c", echo]
        .map(String::from)
        .to_vec();
    let scorer =
        reward::external::command::CommandScorer::new("fuzz", program, Duration::from_millis(500), 1);
    // A tenth of the budget: most mutants break the protocol, and each restarts the program.
    let count = iterations().div_ceil(10);
    let refused = fuzz_n(
        "scorer_reply_process",
        11,
        &scores,
        (usize::MAX, true),
        count,
        |input| {
            let reply = String::from_utf8_lossy(input).into_owned();
            scorer.score(&sample(reply)).map(drop).map_err(|e| e.to_string())
        },
    );
    assert!(refused > 0);
    eprintln!(
        "scorer_reply_process: the program was started {} times",
        scorer.starts()
    );
}

/// A gRPC codec of raw message bytes, so a call can carry any bytes as its message.
#[derive(Clone, Copy, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        let mut out = vec![0; bytes::Buf::remaining(src)];
        bytes::Buf::copy_to_slice(src, &mut out);
        Ok(Some(out))
    }
}

/// How a method takes and gives its messages.
#[derive(Clone, Copy)]
enum Shape {
    Unary,
    ServerStream,
    ClientStream,
}

/// Calls `path` on `channel` with the run's `token` and `message` as the request's bytes (the
/// one message of a client stream), reading every reply. The worker's answer, whatever it is,
/// is `Ok` or `Err(status)`; a dropped connection panics (the worker may have died).
async fn raw_call(
    channel: tonic::transport::Channel,
    token: &actors::auth::Token,
    (path, shape): (&'static str, Shape),
    message: Vec<u8>,
) -> Result<(), String> {
    use tonic::service::Interceptor;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .unwrap_or_else(|e| panic!("{path}: the worker is gone: {e}"));
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    let (metadata, extensions, ()) = token.attach().call(tonic::Request::new(())).unwrap().into_parts();
    let request = tonic::Request::from_parts(metadata, extensions, ());
    let outcome = match shape {
        Shape::Unary => grpc
            .unary(request.map(|()| message), path, RawCodec)
            .await
            .map(drop),
        Shape::ClientStream => grpc
            .client_streaming(
                request.map(|()| tokio_stream::iter(vec![message])),
                path,
                RawCodec,
            )
            .await
            .map(drop),
        Shape::ServerStream => match grpc
            .server_streaming(request.map(|()| message), path, RawCodec)
            .await
        {
            Ok(response) => {
                let mut stream = response.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(_)) => {}
                        Ok(None) => break Ok(()),
                        Err(status) => break Err(status),
                    }
                }
            }
            Err(status) => Err(status),
        },
    };
    match outcome {
        Ok(()) => Ok(()),
        Err(status) if status.code() == tonic::Code::Unavailable => {
            panic!("the worker dropped the call: {status:?}")
        }
        Err(status) => Err(format!("{:?}: {}", status.code(), status.message())),
    }
}

/// Every method a worker (rollout, reward, learner) and the orchestrator's registry serve,
/// called with the run's token and mutated copies of valid messages as raw bytes: each call is
/// answered (a reply or a status, within the harness's time limit), and every worker is alive
/// and healthy afterwards.
#[test]
fn worker_rpc_messages() {
    use actors::auth::Token;
    use actors::launcher::ray::registry::Registry;
    use actors::proto;
    use prost::Message;

    let dir = tempfile::tempdir().unwrap();
    let (model, train, val) = tiny_inputs(dir.path(), 8, 2);
    let recipe = tiny_recipe(
        dir.path(),
        "r.yaml",
        &model,
        &train,
        &val,
        &dir.path().join("out"),
        1,
        "",
    );
    let token = Token::generate();
    let token_file = dir.path().join("token");
    token.write(&token_file).unwrap();
    let start = |role: &str| {
        let mut w = WorkerProcess::start(&mut worker(role, &recipe, &token_file));
        let address = w.loopback_address();
        (w, address)
    };
    let mut workers = vec![start("rollout"), start("reward"), start("learner")];
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let registry = runtime
        .block_on(Registry::serve(
            "127.0.0.1",
            token.clone(),
            None,
            env!("CARGO_PKG_VERSION"),
        ))
        .unwrap();
    let channel = |address: &str| {
        runtime.block_on(async {
            tonic::transport::Channel::from_shared(address.to_string())
                .unwrap()
                .tcp_nodelay(true)
                .connect()
                .await
                .unwrap()
        })
    };
    // The rollout worker's parameter table, so weight chunks get past its first checks.
    let table = runtime.block_on(async {
        let mut c = proto::rollout_client::RolloutClient::with_interceptor(
            tonic::transport::Channel::from_shared(workers[0].1.clone())
                .unwrap()
                .connect()
                .await
                .unwrap(),
            token.attach(),
        );
        c.weight_version(proto::WeightVersionRequest {})
            .await
            .unwrap()
            .into_inner()
    });
    let first = table.tensors[0].clone();
    let chunk = |data: Vec<u8>, offset: u64| proto::WeightChunk {
        version: 2,
        tensor_count: table.tensors.len() as u32,
        tensor_index: 0,
        tensor_name: first.name.clone(),
        dtype: table.dtype.clone(),
        dims: first.dims.clone(),
        offset,
        crc32: crc32(&data),
        data: data.into(),
    };
    let generation = |max_turn_tokens: Option<u64>| proto::GenerationRequest {
        id: 1,
        prompt: vec![1, 2, 3],
        n: 2,
        seed: 3,
        params: Some(proto::SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            max_new_tokens: 4,
            stop_token_ids: vec![0],
            stop_strings: vec!["\n".into()],
        }),
        max_turn_tokens,
        episode_row: max_turn_tokens.map_or(String::new(), |_| "{\"extra_info\": {}}".into()),
    };
    let methods: Vec<(&str, &'static str, Shape, Vec<Vec<u8>>)> = vec![
        (
            "reward",
            "/grpo.v1.Worker/Health",
            Shape::Unary,
            vec![proto::HealthRequest {}.encode_to_vec()],
        ),
        (
            "reward",
            "/grpo.v1.Reward/Score",
            Shape::Unary,
            vec![proto::ScoreRequest {
                samples: vec![proto::RewardSample {
                    id: 1,
                    data_source: "grpo/arithmetic".into(),
                    prompt_json: "[{\"role\": \"user\", \"content\": \"6 x 7?\"}]".into(),
                    response: "<answer>42</answer>".into(),
                    ground_truth: "42".into(),
                    extra_json: "{\"index\": 0}".into(),
                    response_length: 5,
                    truncated: false,
                }],
            }
            .encode_to_vec()],
        ),
        ("rollout", "/grpo.v1.Rollout/Generate", Shape::ServerStream, {
            let edge = |edit: &dyn Fn(&mut proto::GenerationRequest)| {
                let mut r = generation(None);
                edit(&mut r);
                r
            };
            let sampling =
                |edit: &dyn Fn(&mut proto::SamplingParams)| edge(&|r| edit(r.params.as_mut().unwrap()));
            [
                vec![generation(None)],
                vec![generation(Some(2))],
                vec![edge(&|r| r.n = u64::MAX)],
                vec![edge(&|r| r.prompt = vec![u32::MAX, 0])],
                vec![edge(&|r| r.prompt.clear())],
                vec![edge(&|r| r.params = None)],
                vec![sampling(&|p| p.temperature = f32::NAN)],
                vec![sampling(&|p| p.top_p = -1.0)],
                vec![sampling(&|p| p.top_k = u64::MAX)],
                vec![sampling(&|p| p.max_new_tokens = u64::MAX)],
                vec![sampling(&|p| p.stop_strings = vec![String::new()])],
                vec![generation(None), generation(None)],
            ]
            .into_iter()
            .map(|requests| {
                proto::GenerateRequest {
                    requests,
                    min_weight_version: 0,
                }
                .encode_to_vec()
            })
            .collect()
        }),
        (
            "rollout",
            "/grpo.v1.Rollout/UpdateWeights",
            Shape::ClientStream,
            vec![
                chunk(vec![0; 64], 0).encode_to_vec(),
                chunk(vec![1; 8], u64::MAX - 4).encode_to_vec(),
            ],
        ),
        (
            "rollout",
            "/grpo.v1.Rollout/WeightVersion",
            Shape::Unary,
            vec![proto::WeightVersionRequest {}.encode_to_vec()],
        ),
        (
            "learner",
            "/grpo.v1.Learner/Start",
            Shape::ClientStream,
            vec![proto::LearnerStateMessage {
                counters: Some(proto::LearnerCounters {
                    adam_step: 0,
                    optimizer_steps: 0,
                    total_optimizer_steps: 4,
                    kl_coef: None,
                    critic_adam_step: 0,
                    critic_optimizer_steps: 0,
                    updates: 0,
                }),
                part: proto::StatePart::Params as i32,
                chunk: Some(chunk(vec![0; 64], 0)),
                critic: false,
            }
            .encode_to_vec()],
        ),
        ("learner", "/grpo.v1.Learner/Update", Shape::Unary, {
            let row = proto::LearnerRow {
                group: 1,
                prompt: vec![1, 2],
                response: vec![3, 4],
                rollout_log_probs: vec![-1.0, -2.0],
                score: 1.0,
                truncated: false,
                reward_baseline: None,
                env_spans: vec![0, 1],
                routes: Vec::new(),
            };
            let edge = |edit: &dyn Fn(&mut proto::LearnerRow)| {
                let mut r = row.clone();
                edit(&mut r);
                proto::LearnerUpdateRequest { rows: vec![r] }.encode_to_vec()
            };
            vec![
                edge(&|_| {}),
                edge(&|r| r.rollout_log_probs = vec![f32::NAN]),
                edge(&|r| r.env_spans = vec![3, 1, u64::MAX]),
                edge(&|r| r.score = f64::INFINITY),
                edge(&|r| r.response.clear()),
                edge(&|r| r.prompt = vec![u32::MAX]),
            ]
        }),
        (
            "learner",
            "/grpo.v1.Learner/Weights",
            Shape::ServerStream,
            vec![proto::LearnerWeightsRequest {
                version: 1,
                dtype: "f32".into(),
                adapters: false,
            }
            .encode_to_vec()],
        ),
        (
            "learner",
            "/grpo.v1.Learner/State",
            Shape::ServerStream,
            vec![proto::LearnerStateRequest {}.encode_to_vec()],
        ),
        (
            "registry",
            "/grpo.v1.Registry/Register",
            Shape::Unary,
            vec![proto::RegisterRequest {
                worker_id: "rollout-0-a1".into(),
                role: "rollout".into(),
                pool: "default".into(),
                address: "http://127.0.0.1:1".into(),
                devices: vec![proto::DeviceReport {
                    kind: "cpu".into(),
                    count: 1,
                    platform_name: "cpu".into(),
                    platform_version: "1".into(),
                }],
                grpo_version: env!("CARGO_PKG_VERSION").into(),
                hostname: "host".into(),
                pid: 1,
            }
            .encode_to_vec()],
        ),
        (
            "registry",
            "/grpo.v1.Registry/Heartbeat",
            Shape::Unary,
            vec![proto::HeartbeatRequest {
                worker_id: "rollout-0-a1".into(),
            }
            .encode_to_vec()],
        ),
    ];
    let address = |role: &str| match role {
        "rollout" => workers[0].1.clone(),
        "reward" => workers[1].1.clone(),
        "learner" => workers[2].1.clone(),
        _ => registry.address(),
    };
    for (i, (role, path, shape, seeds)) in methods.iter().enumerate() {
        let target = format!("rpc{}", path.replace('/', "_").replace("_grpo.v1.", "_"));
        let ch = channel(&address(role));
        // The seeds as they are first (edge values among them), then their mutants.
        for seed in seeds {
            let _ = runtime.block_on(raw_call(ch.clone(), &token, (path, *shape), seed.clone()));
        }
        let count = iterations().div_ceil(4);
        fuzz_n(
            &target,
            20 + i as u64,
            seeds,
            (usize::MAX, false),
            count,
            |input| runtime.block_on(raw_call(ch.clone(), &token, (path, *shape), input.to_vec())),
        );
    }
    for (w, address) in &mut workers {
        assert!(w.child.try_wait().unwrap().is_none(), "worker {address} exited");
        let ch = channel(address);
        runtime
            .block_on(raw_call(
                ch,
                &token,
                ("/grpo.v1.Worker/Health", Shape::Unary),
                Vec::new(),
            ))
            .unwrap_or_else(|e| panic!("worker {address} is unhealthy after the fuzzing: {e}"));
    }
}

/// CRC-32 (IEEE) of `data`, as the weight chunks carry it.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}
