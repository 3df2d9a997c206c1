//! `grpo serve`: the rollout engine behind an OpenAI-compatible HTTP API
//! (`/v1/chat/completions`, `/v1/completions`, `/v1/models`), so an agent program written
//! against the OpenAI client runs on a `grpo` model by changing its base URL. Every answer also
//! carries what training needs and the OpenAI API leaves out: the exact prompt and completion
//! token ids (`prompt_token_ids`, `choices[].token_ids`) and, with `logprobs: true`, each
//! sampled token's log-probability as the engine computed it.
//!
//! Requests run concurrently through one engine (continuous batching). Chat requests are
//! rendered with the model's chat template (with `tools` passed to it), and with `tools` the
//! model's calls come back as `tool_calls`, parsed in `--tool-call-format`. Streaming is not
//! served (`stream: true` is refused).
//!
//! The HTTP server is axum's; the API's wire format (messages, errors, the key) is
//! `rollout::openai`'s, which the endpoint agent programs are trained through shares.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use model::programs::HostModel;
use model::{ChatTemplate, ModelTokenizer};
use rollout::openai::{self, bad, ApiError};
use rollout::{Engine, EngineConfig, EngineOutput, GenerationRequest, RolloutError, Sample, SamplingParams};
use serde_json::{json, Value};
use tokio::sync::oneshot;
use xla::runtime::{Client, ClientOptions, PluginKind};
use xla::DType;

/// Arguments of `grpo serve`.
#[derive(clap::Args, Debug)]
#[command(
    about = "Serve a model with an OpenAI-compatible API (chat completions, completions)",
    long_about = "Serve a model (HF directory or .gguf) over HTTP with OpenAI's API: POST \
                  /v1/chat/completions and /v1/completions, GET /v1/models. Answers add the prompt's \
                  and each completion's token ids (`prompt_token_ids`, `choices[].token_ids`), and \
                  with `logprobs: true` each token's log-probability. With --api-key (or \
                  GRPO_API_KEY) every request must send `Authorization: Bearer KEY`; serving on an \
                  address other than loopback needs a key. The first line on stdout is the address \
                  it listens on.",
    after_help = "Examples:\n  \
                  grpo serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --port 8000\n  \
                  OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=unused python my_agent.py\n  \
                  grpo serve --model ./Qwen2.5-0.5B-Instruct --device cuda --dtype bf16 \\\n      \
                  --host 0.0.0.0 --api-key \"$(cat key.txt)\" --max-num-seqs 64"
)]
pub struct ServeArgs {
    /// A Hugging Face model directory or a .gguf file.
    #[arg(long, value_name = "PATH")]
    pub model: PathBuf,

    /// The address to listen on. Example: `--host 0.0.0.0` (needs --api-key).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    pub host: String,

    /// The port; 0 picks a free one (printed on the first line). Example: `--port 8000`.
    #[arg(long, value_name = "PORT", default_value_t = 8000)]
    pub port: u16,

    /// The key clients send as `Authorization: Bearer KEY`; default: $GRPO_API_KEY, else none.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,

    /// Sequences decoded at once (KV-cache slots). Example: `--max-num-seqs 32`.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub max_num_seqs: usize,

    /// Most tokens of prompt plus completion. Example: `--max-model-len 4096`.
    #[arg(long, value_name = "N", default_value_t = 2048)]
    pub max_model_len: usize,

    /// How the model writes tool calls, to return them as `tool_calls`: hermes or llama3.
    #[arg(long, value_name = "FORMAT", default_value = "hermes", value_parser = ["hermes", "llama3"])]
    pub tool_call_format: String,

    /// The device: cpu, cuda (or gpu) or tpu; its first device is used.
    #[arg(long, value_name = "KIND", default_value = "cpu", value_parser = ["cpu", "cuda", "gpu", "tpu"])]
    pub device: String,

    /// Type of the weights and the KV cache: f32 or bf16.
    #[arg(long, value_name = "DTYPE", default_value = "f32", value_parser = ["f32", "bf16"])]
    pub dtype: String,
}

/// Requests waiting for their samples, by request id.
type Waiting = Arc<Mutex<HashMap<u64, (usize, Vec<Sample>, oneshot::Sender<Result<Vec<Sample>, String>>)>>>;

struct Server {
    name: String,
    api_key: Option<String>,
    tokenizer: ModelTokenizer,
    template: Option<ChatTemplate>,
    format: agent::CallFormat,
    max_model_len: usize,
    max_num_seqs: usize,
    engine: Mutex<rollout::EngineControl>,
    waiting: Waiting,
    next_id: AtomicU64,
}

/// Loads the model, starts the engine and serves until killed.
pub fn run(mut args: ServeArgs) -> anyhow::Result<ExitCode> {
    if args.api_key.is_none() {
        args.api_key = std::env::var("GRPO_API_KEY").ok().filter(|k| !k.is_empty());
    }
    let address: std::net::IpAddr = args
        .host
        .parse()
        .with_context(|| format!("--host {:?} is not an IP address", args.host))?;
    if !address.is_loopback() && args.api_key.is_none() {
        bail!(
            "--host {address} would serve the model to the network without a key; give --api-key (or \
             GRPO_API_KEY), or serve on 127.0.0.1"
        );
    }
    let host =
        HostModel::load(&args.model).with_context(|| format!("loading model {}", args.model.display()))?;
    let kind = PluginKind::parse(&args.device).expect("clap checked --device");
    let client = match kind {
        PluginKind::Cpu => Client::cpu(1),
        _ => Client::new(kind, None, ClientOptions::default()),
    }
    .with_context(|| format!("creating the {} PJRT client", args.device))?;
    let dtype = if args.dtype == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    let weights = rollout::upload_weights(&client, &host.weights, dtype, 0)?;
    let mut settings = EngineConfig::new(args.max_num_seqs, args.max_model_len);
    settings.eos_token_ids = host.stop_tokens();
    let engine = Engine::new(
        &client,
        &host.weights.config,
        weights,
        0,
        settings,
        Some(host.tokenizer.clone()),
    )?
    .spawn();
    let waiting: Waiting = Arc::default();
    let server = Arc::new(Server {
        name: args
            .model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into()),
        api_key: args.api_key.clone(),
        tokenizer: host.tokenizer.clone(),
        template: host.chat_template.clone(),
        format: if args.tool_call_format == "llama3" {
            agent::CallFormat::Llama3
        } else {
            agent::CallFormat::Hermes
        },
        max_model_len: args.max_model_len,
        max_num_seqs: args.max_num_seqs,
        engine: Mutex::new(engine.control()),
        waiting: waiting.clone(),
        next_id: AtomicU64::new(0),
    });
    // The engine's outputs, routed to the requests waiting for them.
    std::thread::Builder::new()
        .name("serve-outputs".into())
        .spawn(move || {
            while let Ok(output) = engine.outputs().recv() {
                let (id, result) = match output {
                    EngineOutput::Sample(s) => (s.request_id, Ok(s)),
                    EngineOutput::Rejected(RolloutError::Rejected { request_id, problem }) => {
                        (request_id, Err(problem))
                    }
                    EngineOutput::Rejected(e) => {
                        tracing::error!("the engine failed: {e}");
                        continue;
                    }
                };
                let mut waiting = waiting.lock().unwrap_or_else(|p| p.into_inner());
                let Some(entry) = waiting.get_mut(&id) else {
                    continue;
                };
                match result {
                    Ok(sample) => {
                        entry.1.push(sample);
                        if entry.1.len() == entry.0 {
                            let (_, mut samples, tx) = waiting.remove(&id).expect("present");
                            samples.sort_by_key(|s| s.sample_index);
                            let _ = tx.send(Ok(samples));
                        }
                    }
                    Err(problem) => {
                        let (_, _, tx) = waiting.remove(&id).expect("present");
                        let _ = tx.send(Err(problem));
                    }
                }
            }
        })?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let app = Router::new()
            .route("/v1/models", get(models))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/completions", post(completions))
            .with_state(server);
        let listener = tokio::net::TcpListener::bind(SocketAddr::new(address, args.port))
            .await
            .with_context(|| format!("listening on {address}:{}", args.port))?;
        println!("listening on http://{}", listener.local_addr()?);
        use std::io::Write;
        std::io::stdout().flush()?;
        axum::serve(listener, app).await.context("serving")?;
        Ok(ExitCode::SUCCESS)
    })
}

impl Server {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        openai::authorize(self.api_key.as_deref(), headers)
    }

    /// Generates `n` samples of `prompt` with the body's sampling settings.
    async fn generate(&self, prompt: Vec<u32>, body: &Value) -> Result<Vec<Sample>, ApiError> {
        if body.get("stream").and_then(Value::as_bool) == Some(true) {
            return Err(bad("`stream: true` is not served; ask without streaming"));
        }
        let number = |key: &str| body.get(key).filter(|v| !v.is_null());
        let n = match number("n") {
            None => 1,
            Some(v) => v
                .as_u64()
                .filter(|&n| n >= 1 && n as usize <= self.max_num_seqs)
                .ok_or_else(|| {
                    bad(format!(
                        "`n` must be an integer from 1 to {} (the server's --max-num-seqs)",
                        self.max_num_seqs
                    ))
                })? as usize,
        };
        let float = |key: &str, default: f32, ok: fn(f32) -> bool, rule: &str| -> Result<f32, ApiError> {
            match number(key) {
                None => Ok(default),
                Some(v) => v
                    .as_f64()
                    .map(|x| x as f32)
                    .filter(|&x| ok(x))
                    .ok_or_else(|| bad(format!("`{key}` must be {rule}"))),
            }
        };
        let temperature = float("temperature", 1.0, |t| t.is_finite() && t >= 0.0, "a number >= 0")?;
        let top_p = float("top_p", 1.0, |p| p > 0.0 && p <= 1.0, "a number in (0, 1]")?;
        // vLLM's extra sampling parameter.
        let min_p = float("min_p", 0.0, |p| (0.0..=1.0).contains(&p), "a number in [0, 1]")?;
        let top_k = match number("top_k") {
            None => 0,
            Some(v) => v
                .as_i64()
                .filter(|&k| k >= -1)
                .ok_or_else(|| bad("`top_k` must be an integer >= -1"))?
                .max(0) as usize,
        };
        let room = self.max_model_len.saturating_sub(prompt.len());
        if room == 0 {
            return Err(bad(format!(
                "the prompt is {} tokens; the server holds {} (--max-model-len) with the completion",
                prompt.len(),
                self.max_model_len
            )));
        }
        let max_tokens = match number("max_completion_tokens").or_else(|| number("max_tokens")) {
            None => room,
            Some(v) => v
                .as_u64()
                .filter(|&m| m >= 1)
                .ok_or_else(|| bad("`max_tokens` must be an integer >= 1"))? as usize,
        };
        if max_tokens > room {
            return Err(bad(format!(
                "the prompt ({} tokens) and max_tokens ({max_tokens}) exceed the server's --max-model-len ({})",
                prompt.len(),
                self.max_model_len
            )));
        }
        let stop_strings = match number("stop") {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("`stop` must be a string or a list of strings"))?,
            Some(_) => return Err(bad("`stop` must be a string or a list of strings")),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let seed = match number("seed") {
            None => id,
            Some(v) => v.as_u64().ok_or_else(|| bad("`seed` must be an integer >= 0"))?,
        };
        let request = GenerationRequest {
            id,
            prompt,
            n,
            seed,
            params: SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                max_new_tokens: max_tokens,
                stop_strings,
                ..Default::default()
            },
            multi_turn: None,
        };
        let (tx, rx) = oneshot::channel();
        self.waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, (n, Vec::new(), tx));
        let submitted = self
            .engine
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .submit(request);
        if let Err(e) = submitted {
            self.waiting.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            return Err(ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string()));
        }
        match rx.await {
            Ok(Ok(samples)) => Ok(samples),
            Ok(Err(problem)) => Err(bad(problem)),
            Err(_) => Err(ApiError(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the engine stopped".into(),
            )),
        }
    }

    fn completion_tokens(samples: &[Sample]) -> usize {
        samples.iter().map(|s| s.response_ids.len()).sum()
    }
}

async fn models(State(server): State<Arc<Server>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    server.authorize(&headers)?;
    Ok(Json(
        json!({"object": "list", "data": [{"id": server.name, "object": "model", "owned_by": "grpo"}]}),
    ))
}

async fn chat_completions(
    State(server): State<Arc<Server>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Result<Json<Value>, ApiError> {
    server.authorize(&headers)?;
    let template = server
        .template
        .as_ref()
        .ok_or_else(|| bad("this model has no chat template; use /v1/completions"))?;
    let (messages, tools) = openai::chat_messages(&body)?;
    let prompt = openai::chat_prompt(template, &server.tokenizer, messages, tools)?;
    let samples = server.generate(prompt.clone(), &body).await?;
    let want_logprobs = openai::wants_logprobs(&body);
    let choices: Vec<Value> = samples
        .iter()
        .map(|s| {
            let message = openai::assistant_message(
                server.format,
                tools.is_some(),
                &s.text,
                &format!("{}_{}", s.request_id, s.sample_index),
                s.finish_reason.is_truncated(),
            );
            let logprobs = want_logprobs.then_some(s.logprobs.as_slice());
            openai::chat_choice(
                &server.tokenizer,
                s.sample_index,
                message,
                &s.response_ids,
                logprobs,
            )
        })
        .collect();
    Ok(Json(openai::completion(
        "chat.completion",
        &format!("chatcmpl-{}", samples[0].request_id),
        &server.name,
        choices,
        &prompt,
        Server::completion_tokens(&samples),
    )))
}

async fn completions(
    State(server): State<Arc<Server>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Result<Json<Value>, ApiError> {
    server.authorize(&headers)?;
    let prompt = openai::completion_prompt(&server.tokenizer, &body)?;
    let samples = server.generate(prompt.clone(), &body).await?;
    let want_logprobs = openai::wants_logprobs(&body);
    let choices: Vec<Value> = samples
        .iter()
        .map(|s| {
            openai::text_choice(
                &server.tokenizer,
                s.sample_index,
                &s.text,
                s.finish_reason.is_truncated(),
                &s.response_ids,
                want_logprobs.then_some(s.logprobs.as_slice()),
            )
        })
        .collect();
    Ok(Json(openai::completion(
        "text_completion",
        &format!("cmpl-{}", samples[0].request_id),
        &server.name,
        choices,
        &prompt,
        Server::completion_tokens(&samples),
    )))
}
