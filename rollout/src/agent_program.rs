//! Agent programs trained through an OpenAI-compatible endpoint: the [`TurnHandler`] of a
//! run whose episodes are driven by the user's own agent code, written for any framework that
//! calls `/v1/chat/completions` or `/v1/completions`; only its base URL changes.
//!
//! An episode is a multi-turn sample of the engine. Its first model turn is sampled from the
//! row's prompt as any sample's is; when it parks, the episode's program starts, with
//! `OPENAI_BASE_URL` naming the episode (`http://127.0.0.1:PORT/episodes/ID/v1`),
//! `OPENAI_API_KEY` the endpoint's key, and on its standard input one JSON line: `episode`,
//! `messages` (the row's prompt), `tools` (the schemas the prompt was rendered with),
//! `prompt_token_ids` (the prompt as the model reads it) and `row` (the row's other columns). Each call of the program is one model turn:
//!
//! - the first call must render to the row's prompt, token for token, and is answered with
//!   the turn already sampled;
//! - every later call must repeat the conversation so far (its messages, then the assistant
//!   messages as they were returned) and add messages after it (tool results, a user turn).
//!   Only those are rendered by the chat template, from just after the model's end-of-turn
//!   token, and written into the sample's KV cache as environment tokens; the model then
//!   samples the next turn in the same slot. A text completion must send the ids so far
//!   (`prompt_token_ids` + `token_ids` of the answers) with new ids after them.
//!
//! So the sample the learner trains is exactly the token ids the program was served: no turn
//! is decoded and encoded again, and what the program added is context with loss mask 0. The
//! recipe's sampling settings apply to every call (a group's samples must come from one
//! policy); a request's own `temperature`, `max_tokens`... are not used.
//!
//! The episode ends when the program exits, or is killed at its time limit with its process
//! group; its last stdout line may be `{"reward": x}`, the sample's turn score. The engine
//! parks turns cut by a budget too ([`TurnHandler::parks_cut_turns`]), answered with
//! `finish_reason: "length"`, so the program's exit is what finishes every sample and its
//! reward always reaches it. A call past `max_assistant_turns` or the response budget is
//! refused and the turn stays parked; so is a call that breaks the protocol, counted as a tool
//! error, as a failing program is (a time-out as a tool time-out). The run goes on. A weight
//! update that restarts an episode kills its program and starts a new one for the new run.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use model::{ChatTemplate, ModelTokenizer};
use serde_json::{json, Value};
use tokio::sync::oneshot;

use crate::engine::{EpisodeStats, FinishReason, Resume, Resumer, Sample, Turn, TurnHandler, TurnId};
use crate::environment::TurnRenderer;
use crate::openai::{self, bad, ApiError};

/// How a run's agent programs are started and bounded.
#[derive(Clone, Debug)]
pub struct AgentSettings {
    /// The program and its arguments, started once per episode.
    pub command: Vec<String>,
    /// Wall-clock limit of one episode's program.
    pub timeout: Duration,
    /// The model's tool-call format, for the `tool_calls` of chat answers.
    pub format: agent::CallFormat,
    /// Most model turns per episode; a call past them is refused and the episode ends.
    pub max_assistant_turns: u32,
    /// The tools' schemas the row's prompt is rendered with (the `tools` the program must send).
    pub tools: Vec<agent::ToolSchema>,
}

/// The endpoint and the running programs; cheap to clone.
#[derive(Clone)]
pub struct AgentPrograms {
    inner: Arc<Inner>,
}

struct Inner {
    settings: AgentSettings,
    template: ChatTemplate,
    tokenizer: ModelTokenizer,
    renderer: TurnRenderer,
    /// `settings.tools` as the template and the programs receive them; null without tools.
    tools: Value,
    /// The template's end-of-turn token, which closes a turn cut by its budget.
    end_of_turn: Option<u32>,
    key: String,
    base_url: String,
    episodes: Mutex<HashMap<(u64, usize), EpisodeState>>,
}

/// A model turn as the program is answered with it.
#[derive(Clone, Debug)]
struct Served {
    /// The ids before the turn (prompt, earlier turns, environment tokens).
    before: Vec<u32>,
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    truncated: bool,
}

/// What a waiting call gets.
enum Next {
    Turn(Served),
    Gone(String),
}

struct Parked {
    turn: Turn,
    resumer: Resumer,
    since: Instant,
}

struct EpisodeState {
    restarts: u32,
    /// The program's process (group) id, once started.
    pid: Option<u32>,
    /// The turn waiting for the program's next call.
    parked: Option<Parked>,
    /// The call waiting for the next turn.
    waiter: Option<oneshot::Sender<Next>>,
    /// Calls answered so far.
    calls: usize,
    /// A chat episode's conversation so far, answers included.
    history: Option<Vec<Value>>,
    /// Every id so far: prompt, turns, environment tokens.
    ids: Vec<u32>,
    /// The sample has finished; calls are refused.
    done: bool,
    /// The program exited while a call of it was being answered: the next turn finishes the
    /// sample with `pending`.
    exited: bool,
    pending: EpisodeStats,
}

impl EpisodeState {
    /// Ends a run whose state was taken out of the table: its program is killed (the thread
    /// watching it finds no state and counts nothing), and the call waiting for a turn gets
    /// `why`.
    fn end(self, why: &str) {
        if let Some(pid) = self.pid {
            kill_group(pid);
        }
        if let Some(waiter) = self.waiter {
            let _ = waiter.send(Next::Gone(why.into()));
        }
    }
}

impl AgentPrograms {
    /// Starts the endpoint on a free loopback port.
    pub fn start(
        settings: AgentSettings,
        template: ChatTemplate,
        tokenizer: ModelTokenizer,
    ) -> std::io::Result<AgentPrograms> {
        let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
        listener.set_nonblocking(true)?;
        let base_url = format!("http://{}", listener.local_addr()?);
        let mut key = [0u8; 16];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut key)?;
        let tools = if settings.tools.is_empty() {
            Value::Null
        } else {
            settings.tools.iter().map(agent::ToolSchema::to_json).collect()
        };
        let inner = Arc::new(Inner {
            renderer: TurnRenderer::new(template.clone(), tokenizer.clone(), &settings.tools),
            end_of_turn: template
                .eos_token
                .as_deref()
                .and_then(|t| tokenizer.token_to_id(t)),
            settings,
            template,
            tokenizer,
            tools,
            key: key.iter().map(|b| format!("{b:02x}")).collect(),
            base_url,
            episodes: Mutex::default(),
        });
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("agent-endpoint")
            .enable_all()
            .build()?;
        let app = Router::new()
            .route("/episodes/{episode}/v1/models", get(models))
            .route("/episodes/{episode}/v1/chat/completions", post(chat_completions))
            .route("/episodes/{episode}/v1/completions", post(completions))
            .with_state(inner.clone());
        std::thread::Builder::new()
            .name("agent-endpoint".into())
            .spawn(move || {
                runtime.block_on(async move {
                    match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => {
                            if let Err(e) = axum::serve(listener, app).await {
                                tracing::error!("the agent endpoint stopped: {e}");
                            }
                        }
                        Err(e) => tracing::error!("the agent endpoint could not start: {e}"),
                    }
                })
            })?;
        Ok(AgentPrograms { inner })
    }

    /// Where the endpoint listens (`http://127.0.0.1:PORT`).
    pub fn base_url(&self) -> &str {
        &self.inner.base_url
    }
}

/// The episode's name in its URL: request, sample, restarts.
fn episode_name(id: &TurnId) -> String {
    format!("{}-{}-{}", id.request_id, id.sample_index, id.restarts)
}

/// An episode's place in the table (request, sample) and its run (restarts).
type EpisodeKey = ((u64, usize), u32);

/// The key of the episode a URL names.
fn episode_key(name: &str) -> Result<EpisodeKey, ApiError> {
    parse_episode(name)
        .map(|(request, sample, restarts)| ((request, sample), restarts))
        .ok_or_else(|| bad(format!("{name:?} names no episode")))
}

fn parse_episode(name: &str) -> Option<(u64, usize, u32)> {
    let mut parts = name.split('-');
    let ids = (
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
    );
    parts.next().is_none().then_some(ids)
}

fn lock(inner: &Inner) -> std::sync::MutexGuard<'_, HashMap<(u64, usize), EpisodeState>> {
    inner.episodes.lock().unwrap_or_else(|p| p.into_inner())
}

fn kill_group(pid: u32) {
    // SAFETY: a plain system call on a process group the program was started in.
    unsafe {
        libc::kill(-(pid as i32), libc::SIGKILL);
    }
}

impl Served {
    fn of_turn(turn: &Turn) -> Served {
        let mut before = turn.request.prompt.clone();
        before.extend_from_slice(&turn.response[..turn.turn.start]);
        Served {
            before,
            ids: turn.response[turn.turn.clone()].to_vec(),
            logprobs: turn.logprobs.clone(),
            truncated: turn.reason.is_truncated(),
        }
    }
}

impl TurnHandler for AgentPrograms {
    fn on_turn(&self, turn: Turn, resumer: Resumer) {
        let key = (turn.id.request_id, turn.id.sample_index);
        let mut episodes = lock(&self.inner);
        let current = episodes.get(&key).is_some_and(|e| e.restarts == turn.id.restarts);
        if turn.turns == 1 {
            if let Some(old) = episodes.remove(&key) {
                old.end("a weight update restarted this episode");
            }
            let mut ids = turn.request.prompt.clone();
            ids.extend_from_slice(&turn.response);
            let id = turn.id;
            let row = turn.request.multi_turn.as_ref().map(|e| e.row.clone());
            let prompt = turn.request.prompt.clone();
            episodes.insert(
                key,
                EpisodeState {
                    restarts: turn.id.restarts,
                    pid: None,
                    parked: Some(Parked {
                        turn,
                        resumer,
                        since: Instant::now(),
                    }),
                    waiter: None,
                    calls: 0,
                    history: None,
                    ids,
                    done: false,
                    exited: false,
                    pending: EpisodeStats::default(),
                },
            );
            drop(episodes);
            let inner = self.inner.clone();
            let row = row.unwrap_or_default();
            std::thread::Builder::new()
                .name("agent-program".into())
                .spawn(move || run_program(&inner, id, &row, &prompt))
                .expect("spawning an agent program's thread");
            return;
        }
        let Some(state) = episodes.get_mut(&key).filter(|_| current) else {
            // Its program is gone (the state went with it): the sample ends here.
            resumer.resume(
                turn.id,
                Resume::Finish {
                    stats: EpisodeStats::default(),
                },
            );
            return;
        };
        if state.exited {
            let stats = std::mem::take(&mut state.pending);
            episodes.remove(&key);
            resumer.resume(turn.id, Resume::Finish { stats });
            return;
        }
        state.ids = turn.request.prompt.clone();
        state.ids.extend_from_slice(&turn.response);
        let served = Served::of_turn(&turn);
        state.parked = Some(Parked {
            turn,
            resumer,
            since: Instant::now(),
        });
        if let Some(waiter) = state.waiter.take() {
            let _ = waiter.send(Next::Turn(served));
        }
    }

    fn parks_cut_turns(&self) -> bool {
        true
    }

    /// Kills the run's program at once (its waiting call gets 409): no turn of it will come.
    fn on_abandoned(&self, id: TurnId) {
        let key = (id.request_id, id.sample_index);
        let mut episodes = lock(&self.inner);
        if episodes.get(&key).is_some_and(|e| e.restarts == id.restarts) {
            let state = episodes.remove(&key).expect("checked above");
            drop(episodes);
            state.end("the engine dropped this episode's sample (a weight update restarted it, or an answer was refused)");
        }
    }

    fn on_finished(&self, sample: &Sample) {
        let key = (sample.request_id, sample.sample_index);
        let mut episodes = lock(&self.inner);
        let Some(state) = episodes.get_mut(&key).filter(|e| e.restarts == sample.restarts) else {
            return;
        };
        state.done = true;
        state.parked = None;
        if state.exited {
            episodes.remove(&key);
            return;
        }
        let Some(waiter) = state.waiter.take() else {
            return;
        };
        if sample.prompt_ids.len() + sample.response_ids.len() < state.ids.len() {
            let _ = waiter.send(Next::Gone(
                "its token budget (max_new_tokens, max_model_len) has no room for the new messages and \
                 one more model token: the sample ends before them"
                    .into(),
            ));
            return;
        }
        {
            // The turn the waiting call asked for, cut by a budget: the tokens after the last
            // environment span.
            let start = sample.env_spans.last().map_or(0, |s| s.end);
            let mut before = sample.prompt_ids.clone();
            before.extend_from_slice(&sample.response_ids[..start]);
            let _ = waiter.send(Next::Turn(Served {
                before,
                ids: sample.response_ids[start..].to_vec(),
                logprobs: sample.logprobs[start..].to_vec(),
                truncated: sample.finish_reason.is_truncated(),
            }));
        }
    }
}

/// Runs an episode's program to its end and finishes the episode's sample with what it did.
fn run_program(inner: &Inner, id: TurnId, row: &Value, prompt: &[u32]) {
    let key = (id.request_id, id.sample_index);
    let name = episode_name(&id);
    let settings = &inner.settings;
    let mut row_columns = row.clone();
    let messages = row_columns
        .as_object_mut()
        .and_then(|r| r.remove("prompt"))
        .unwrap_or(Value::Null);
    let input = json!({"episode": name, "messages": messages, "tools": inner.tools,
                       "prompt_token_ids": prompt, "row": row_columns});
    let mut stats = EpisodeStats::default();
    let mut reward = None;
    let started = Command::new(&settings.command[0])
        .args(&settings.command[1..])
        .env(
            "OPENAI_BASE_URL",
            format!("{}/episodes/{name}/v1", inner.base_url),
        )
        .env("OPENAI_API_KEY", &inner.key)
        .env("GRPO_EPISODE", &name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn();
    match started {
        Err(e) => {
            tracing::warn!(
                "episode {name}: starting the agent program {:?}: {e}",
                settings.command[0]
            );
            stats.tool_errors += 1;
        }
        Ok(mut child) => {
            let pid = child.id();
            {
                let mut episodes = lock(inner);
                match episodes.get_mut(&key).filter(|e| e.restarts == id.restarts) {
                    Some(state) => state.pid = Some(pid),
                    None => {
                        // Restarted before the program started.
                        kill_group(pid);
                        let _ = child.wait();
                        return;
                    }
                }
            }
            let mut stdin = child.stdin.take().expect("piped");
            let line = input.to_string() + "\n";
            let writer = std::thread::spawn(move || {
                let _ = stdin.write_all(line.as_bytes());
            });
            let out = tail_reader(child.stdout.take().expect("piped"));
            let err = tail_reader(child.stderr.take().expect("piped"));
            let deadline = Instant::now() + settings.timeout;
            let status = loop {
                match child.try_wait() {
                    Ok(Some(status)) => break Some(status),
                    Ok(None) if Instant::now() >= deadline => break None,
                    Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                    Err(_) => break None,
                }
            };
            // Whatever the program left running goes with it.
            kill_group(pid);
            let _ = child.wait();
            let _ = writer.join();
            let stdout = out.join().unwrap_or_default();
            let stderr = err.join().unwrap_or_default();
            match status {
                None => {
                    tracing::warn!(
                        "episode {name}: the agent program ran past its {:?} limit and was killed",
                        settings.timeout
                    );
                    stats.tool_timeouts += 1;
                }
                Some(status) if !status.success() => {
                    tracing::warn!(
                        "episode {name}: the agent program failed ({status}): {}",
                        stderr.trim_end()
                    );
                    stats.tool_errors += 1;
                }
                Some(_) => {}
            }
            let last = stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
            if let Ok(Value::Object(answer)) = serde_json::from_str::<Value>(last) {
                match answer.get("reward").map(|r| r.as_f64().filter(|x| x.is_finite())) {
                    Some(Some(x)) => reward = Some(x),
                    Some(None) => {
                        tracing::warn!(
                            "episode {name}: the agent program's reward {last} is not a finite number"
                        );
                        stats.tool_errors += 1;
                    }
                    None => {}
                }
            }
        }
    }
    stats.turn_scores.extend(reward);
    let mut episodes = lock(inner);
    let Some(state) = episodes.get_mut(&key).filter(|e| e.restarts == id.restarts) else {
        return;
    };
    if let Some(parked) = state.parked.take() {
        stats.add(&state.pending);
        episodes.remove(&key);
        parked.resumer.resume(parked.turn.id, Resume::Finish { stats });
    } else if state.done {
        episodes.remove(&key);
    } else {
        // A call of the program was being answered when it exited; the next turn ends it.
        state.exited = true;
        state.waiter = None;
        state.pending.add(&stats);
    }
}

/// Reads a stream to its end on a thread, keeping its last 64 KiB as text.
fn tail_reader(mut stream: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        const KEEP: usize = 64 << 10;
        let mut kept = Vec::new();
        let mut buffer = [0u8; 8192];
        while let Ok(n) = stream.read(&mut buffer) {
            if n == 0 {
                break;
            }
            kept.extend_from_slice(&buffer[..n]);
            if kept.len() > 2 * KEEP {
                kept.drain(..kept.len() - KEEP);
            }
        }
        if kept.len() > KEEP {
            kept.drain(..kept.len() - KEEP);
        }
        String::from_utf8_lossy(&kept).into_owned()
    })
}

/// Why a call is not served.
enum Refusal {
    /// It does not extend its episode as the protocol says (a tool error).
    Protocol(String),
    /// The episode has no room for another turn.
    Budget(String),
}

/// What a call sent, in the form its episode is checked against.
enum CallPrompt<'a> {
    Chat {
        messages: &'a [Value],
        tools: Option<&'a Value>,
    },
    Ids(Vec<u32>),
}

/// Whether a message the program sent back is the one the conversation had: the same role,
/// content (null and "" alike) and tool calls (arguments compared as JSON values).
fn same_message(sent: &Value, had: &Value) -> bool {
    let role = |m: &Value| m.get("role").cloned();
    let content = |m: &Value| match m.get("content") {
        None | Some(Value::Null) => Value::String(String::new()),
        Some(c) => c.clone(),
    };
    let calls = |m: &Value| -> Vec<(Value, Value)> {
        m.get("tool_calls")
            .and_then(Value::as_array)
            .map(|calls| {
                calls
                    .iter()
                    .map(|c| {
                        let f = c.get("function").unwrap_or(c);
                        let arguments = match f.get("arguments") {
                            Some(Value::String(s)) => {
                                serde_json::from_str(s).unwrap_or(Value::String(s.clone()))
                            }
                            Some(v) => v.clone(),
                            None => Value::Null,
                        };
                        (f.get("name").cloned().unwrap_or(Value::Null), arguments)
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    role(sent) == role(had) && content(sent) == content(had) && calls(sent) == calls(had)
}

/// Where two id sequences first differ, shown as text around it.
fn first_difference(tokenizer: &ModelTokenizer, sent: &[u32], had: &[u32]) -> String {
    let at = sent.iter().zip(had).take_while(|(a, b)| a == b).count();
    let show = |ids: &[u32]| {
        let text = tokenizer
            .decode(&ids[at.min(ids.len())..(at + 8).min(ids.len())], false)
            .unwrap_or_default();
        format!("{text:?}")
    };
    format!(
        "they differ at token {at} ({} tokens sent, {} expected): sent {} where the episode has {}",
        sent.len(),
        had.len(),
        show(sent),
        show(had)
    )
}

impl Inner {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        openai::authorize(Some(&self.key), headers)
    }

    /// Adds the assistant message a chat call was answered with to its episode's conversation,
    /// which the next call must repeat.
    fn record_answer(&self, (key, restarts): EpisodeKey, message: &Value) {
        let mut episodes = lock(self);
        if let Some(history) = episodes
            .get_mut(&key)
            .filter(|e| e.restarts == restarts)
            .and_then(|e| e.history.as_mut())
        {
            history.push(message.clone());
        }
    }

    /// Serves one call of an episode: checks it extends the episode, hands its new tokens to
    /// the engine and waits for the next turn. A call that cannot be served (it breaks the
    /// protocol, or the episode's budget is spent) is refused and the turn stays parked: the
    /// episode ends when the program exits, with its reward. A protocol error counts as a tool
    /// error.
    async fn call(
        &self,
        episode: &str,
        (key, restarts): EpisodeKey,
        prompt: CallPrompt<'_>,
    ) -> Result<Served, ApiError> {
        let receiver = {
            let mut episodes = lock(self);
            let state = episodes
                .get_mut(&key)
                .filter(|e| e.restarts == restarts && !e.exited)
                .ok_or_else(|| {
                    ApiError(
                        StatusCode::NOT_FOUND,
                        format!(
                            "episode {episode} is not running (it ended, or a weight update restarted it)"
                        ),
                    )
                })?;
            if state.done {
                return Err(bad(format!(
                    "episode {episode} is over: its sample reached max_model_len"
                )));
            }
            let Some(parked) = state.parked.as_ref() else {
                return Err(ApiError(
                    StatusCode::CONFLICT,
                    format!("episode {episode} is already answering a call; an episode's calls come one at a time"),
                ));
            };
            let first = state.calls == 0;
            let had = state.history.as_ref().map_or(0, Vec::len);
            let new_tokens = match self.check(state, parked, &prompt, first) {
                Ok(tokens) => tokens,
                Err(Refusal::Protocol(message)) => {
                    tracing::warn!("episode {episode}: {message}");
                    state.pending.tool_errors += 1;
                    return Err(bad(message));
                }
                Err(Refusal::Budget(message)) => return Err(bad(format!("episode {episode}: {message}"))),
            };
            state.calls += 1;
            if let CallPrompt::Chat { messages, .. } = &prompt {
                state.history = Some(messages.to_vec());
            }
            if first {
                return Ok(Served::of_turn(&parked.turn));
            }
            let parked = state.parked.take().expect("checked above");
            let mut stats = EpisodeStats {
                env_time: parked.since.elapsed(),
                ..Default::default()
            };
            if let CallPrompt::Chat { messages, .. } = &prompt {
                for m in &messages[had..] {
                    match m.get("role").and_then(Value::as_str) {
                        Some("tool") => stats.tool_calls += 1,
                        Some("user") => stats.user_turns += 1,
                        _ => {}
                    }
                }
            }
            state.ids.extend_from_slice(&new_tokens);
            let (tx, rx) = oneshot::channel();
            state.waiter = Some(tx);
            parked.resumer.resume(
                parked.turn.id,
                Resume::Continue {
                    tokens: new_tokens,
                    stats,
                },
            );
            rx
        };
        match receiver.await {
            Ok(Next::Turn(served)) => Ok(served),
            Ok(Next::Gone(why)) => Err(ApiError(
                StatusCode::CONFLICT,
                format!("episode {episode}: {why}"),
            )),
            Err(_) => Err(ApiError(
                StatusCode::CONFLICT,
                format!("episode {episode} ended while its call waited"),
            )),
        }
    }

    /// Whether a call may extend its episode: the environment tokens it adds, or why not.
    fn check(
        &self,
        state: &EpisodeState,
        parked: &Parked,
        prompt: &CallPrompt<'_>,
        first: bool,
    ) -> Result<Vec<u32>, Refusal> {
        let tokens = self
            .new_tokens(state, parked, prompt, first)
            .map_err(Refusal::Protocol)?;
        if first {
            return Ok(tokens);
        }
        let turn = &parked.turn;
        if matches!(
            turn.reason,
            FinishReason::MaxNewTokens | FinishReason::MaxModelLen
        ) {
            return Err(Refusal::Budget(
                "the sample's response budget (data.max_response_length) is spent: the episode ends when the \
                 program exits"
                    .into(),
            ));
        }
        if turn.turns >= self.settings.max_assistant_turns {
            return Err(Refusal::Budget(format!(
                "the episode has had its {} model turns (rollout.multi_turn.max_assistant_turns): it ends \
                 when the program exits",
                self.settings.max_assistant_turns
            )));
        }
        if turn.response.len() + tokens.len() >= turn.request.params.max_new_tokens {
            return Err(Refusal::Budget(format!(
                "the {} new tokens leave no room for a model turn in the sample's response budget \
                 (data.max_response_length, {} tokens, {} used): the episode ends when the program exits",
                tokens.len(),
                turn.request.params.max_new_tokens,
                turn.response.len()
            )));
        }
        Ok(tokens)
    }

    /// The environment tokens a call adds to its episode (none for the first call), or why
    /// it does not extend the episode.
    fn new_tokens(
        &self,
        state: &EpisodeState,
        parked: &Parked,
        prompt: &CallPrompt<'_>,
        first: bool,
    ) -> Result<Vec<u32>, String> {
        let request_prompt = &parked.turn.request.prompt;
        match prompt {
            CallPrompt::Chat { messages, tools } => {
                if first {
                    let sent = tools.filter(|t| t.as_array().is_none_or(|a| !a.is_empty()));
                    if sent.cloned().unwrap_or(Value::Null) != self.tools {
                        return Err(format!(
                            "the first call's `tools` are not the ones the row's prompt was rendered with \
                             (rollout.multi_turn.agent.tool_schemas): send the `tools` given on standard \
                             input ({})",
                            self.tools
                        ));
                    }
                    let ids = openai::chat_prompt(&self.template, &self.tokenizer, messages, *tools)
                        .map_err(|e| e.1)?;
                    if &ids != request_prompt {
                        return Err(format!(
                            "the first call's messages do not render to the row's prompt; an agent program \
                             starts from the `messages` given on standard input: {}",
                            first_difference(&self.tokenizer, &ids, request_prompt)
                        ));
                    }
                    return Ok(Vec::new());
                }
                let Some(history) = &state.history else {
                    return Err(
                        "an episode's calls must all be chat completions or all text completions".into(),
                    );
                };
                if messages.len() <= history.len() {
                    return Err(format!(
                        "the call sends {} messages; the conversation already has {} (with the last answer), \
                         and a call must add at least one after them",
                        messages.len(),
                        history.len()
                    ));
                }
                if let Some(k) = (0..history.len()).find(|&k| !same_message(&messages[k], &history[k])) {
                    return Err(format!(
                        "message {k} is not the conversation's message {k} ({} sent, {} expected): a \
                         program trained through grpo extends its conversation, sending the assistant's \
                         answers back as they came",
                        messages[k], history[k]
                    ));
                }
                let new = &messages[history.len()..];
                if new
                    .iter()
                    .any(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
                {
                    return Err(
                        "the messages after the conversation include an assistant message; only the model \
                                writes those, by being called"
                            .into(),
                    );
                }
                let turn = &parked.turn;
                match turn.reason {
                    FinishReason::Eos(stop) => self.renderer.env_tokens(stop, new),
                    // A turn cut by its budget: the template's end of turn closes it first.
                    _ => {
                        let end = self.end_of_turn.ok_or(
                            "the model's turn was cut by max_turn_tokens, and the chat template names no \
                             end-of-turn token to close it with",
                        )?;
                        let mut tokens = vec![end];
                        tokens.extend(self.renderer.env_tokens(end, new)?);
                        Ok(tokens)
                    }
                }
            }
            CallPrompt::Ids(ids) => {
                if first {
                    if ids != request_prompt {
                        return Err(format!(
                            "the first call's prompt is not the row's prompt: {}",
                            first_difference(&self.tokenizer, ids, request_prompt)
                        ));
                    }
                    return Ok(Vec::new());
                }
                if state.history.is_some() {
                    return Err(
                        "an episode's calls must all be chat completions or all text completions".into(),
                    );
                }
                if ids.len() <= state.ids.len() || ids[..state.ids.len()] != state.ids[..] {
                    return Err(format!(
                        "the prompt does not extend the episode's ids (send `prompt_token_ids` + `token_ids` of \
                         the last answer, then new ids): {}",
                        first_difference(&self.tokenizer, ids, &state.ids)
                    ));
                }
                Ok(ids[state.ids.len()..].to_vec())
            }
        }
    }
}

async fn models(
    State(inner): State<Arc<Inner>>,
    Path(_): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    inner.authorize(&headers)?;
    Ok(Json(
        json!({"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "grpo"}]}),
    ))
}

/// Refuses what a trained episode cannot honour: several choices, streaming.
fn check_options(body: &Value) -> Result<(), ApiError> {
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        return Err(bad("`stream: true` is not served; ask without streaming"));
    }
    if body.get("n").and_then(Value::as_u64).is_some_and(|n| n != 1) {
        return Err(bad(
            "an episode's call returns one choice (`n: 1`): its samples are the run's episodes",
        ));
    }
    Ok(())
}

async fn chat_completions(
    State(inner): State<Arc<Inner>>,
    Path(episode): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Result<Json<Value>, ApiError> {
    inner.authorize(&headers)?;
    check_options(&body)?;
    let (messages, tools) = openai::chat_messages(&body)?;
    let key = episode_key(&episode)?;
    let served = inner
        .call(&episode, key, CallPrompt::Chat { messages, tools })
        .await?;
    let text = inner.tokenizer.decode(&served.ids, true).unwrap_or_default();
    let message = openai::assistant_message(
        inner.settings.format,
        tools.is_some(),
        &text,
        &episode,
        served.truncated,
    );
    inner.record_answer(key, &message.0);
    let logprobs = openai::wants_logprobs(&body).then_some(served.logprobs.as_slice());
    let choice = openai::chat_choice(&inner.tokenizer, 0, message, &served.ids, logprobs);
    Ok(Json(openai::completion(
        "chat.completion",
        &format!("chatcmpl-{episode}"),
        "policy",
        vec![choice],
        &served.before,
        served.ids.len(),
    )))
}

async fn completions(
    State(inner): State<Arc<Inner>>,
    Path(episode): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Result<Json<Value>, ApiError> {
    inner.authorize(&headers)?;
    check_options(&body)?;
    let prompt = openai::completion_prompt(&inner.tokenizer, &body)?;
    let served = inner
        .call(&episode, episode_key(&episode)?, CallPrompt::Ids(prompt))
        .await?;
    let text = inner.tokenizer.decode(&served.ids, true).unwrap_or_default();
    let logprobs = openai::wants_logprobs(&body).then_some(served.logprobs.as_slice());
    let choice = openai::text_choice(
        &inner.tokenizer,
        0,
        &text,
        served.truncated,
        &served.ids,
        logprobs,
    );
    Ok(Json(openai::completion(
        "text_completion",
        &format!("cmpl-{episode}"),
        "policy",
        vec![choice],
        &served.before,
        served.ids.len(),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn episode_names_round_trip_and_nothing_else_parses() {
        let id = TurnId {
            request_id: 1 << 24 | 3,
            sample_index: 2,
            restarts: 1,
        };
        assert_eq!(parse_episode(&episode_name(&id)), Some((1 << 24 | 3, 2, 1)));
        for bad in ["", "1-2", "1-2-3-4", "a-2-3", "1--3", "-1-2-3"] {
            assert_eq!(parse_episode(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_returned_message_matches_with_null_content_and_re_serialised_arguments() {
        let returned = json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "calculator", "arguments": "{\"expression\": \"2 * 3\", \"digits\": 4}"}}]});
        // Clients drop null content, keep arguments as objects or re-serialise them.
        let echoed = json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "calculator", "arguments": {"digits": 4, "expression": "2 * 3"}}}]});
        assert!(same_message(&echoed, &returned));
        let other_call = json!({"role": "assistant", "tool_calls": [
            {"function": {"name": "calculator", "arguments": "{\"expression\": \"2 * 4\", \"digits\": 4}"}}]});
        assert!(!same_message(&other_call, &returned));
        let user = json!({"role": "user", "content": "hi"});
        assert!(same_message(&user, &user.clone()));
        assert!(!same_message(&json!({"role": "user", "content": "hi!"}), &user));
        assert!(!same_message(&json!({"role": "system", "content": "hi"}), &user));
    }
}
