//! The environment of tool-using multi-turn samples ([`ToolEnvironment`]): after each model
//! turn it parses the turn's tool calls in the model's own format, runs them (each under a
//! time limit, at most `max_parallel_calls` a turn, on a thread of their own so the engine
//! keeps decoding), and answers with the tool messages rendered by the chat template and
//! tokenized once ([`TurnRenderer`]). The model's own tokens are never decoded and encoded
//! again: its turn is decoded only to find the calls in it.
//!
//! A model turn without a tool call goes to the run's interaction, when it has one (a simulated
//! user, VeRL's `interaction`): its reply is the next user message, and it may end the episode
//! and give the turn a reward (the sample's `turn_scores`).
//!
//! A tool that fails, hangs past its limit, or a call the model wrote wrong becomes an
//! `Error: ...` observation the model reads in the next turn, and is counted in the sample's
//! [`EpisodeStats`]; the episode goes on. A hung in-process tool keeps its thread until it
//! returns (its answer is dropped); tools in child processes are killed at their limit.
//!
//! The request's [`crate::Episode`] carries its dataset row, from which the tools take their
//! per-row arguments (`tools_kwargs`) and the interaction its `interaction_kwargs`. The
//! renderer's tokens start just after the model's end-of-turn token, so whatever the template
//! writes between turns is kept.

use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent::{CallContext, CallFormat, EnvTurn, Environment, ToolCall, ToolError, ToolSchema, Toolbox};
use model::{ChatTemplate, ModelTokenizer};
use serde_json::{json, Value};

use crate::engine::{EpisodeStats, Resume, Resumer, Sample, Turn, TurnHandler, TurnId};

/// Which end of a long tool response survives VeRL's `tool_response_truncate_side`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TruncateSide {
    /// Keep the start.
    Left,
    /// Keep the start and the end.
    Middle,
    /// Keep the end.
    Right,
}

/// How a [`ToolEnvironment`] runs an episode (VeRL's `rollout.multi_turn` keys).
#[derive(Clone, Debug)]
pub struct ToolSettings {
    /// The model's tool-call format.
    pub format: CallFormat,
    /// Most model turns per sample; the episode ends after this many.
    pub max_assistant_turns: u32,
    /// Most tool calls run per turn; the rest get an error observation.
    pub max_parallel_calls: usize,
    /// Most characters of one tool response the model sees.
    pub max_tool_response_length: usize,
    pub truncate_side: TruncateSide,
    /// Most interaction replies per sample (VeRL's `max_user_turns`).
    pub max_user_turns: u32,
    /// Time limit of one call of an in-process tool (tools in child processes or behind HTTP
    /// carry their own, [`agent::Tool::time_limit`]).
    pub tool_timeout: Duration,
}

/// Renders what the environment says after a model turn as the chat template renders it,
/// from the end of the model's turn through the header of the next assistant turn, as ids.
#[derive(Clone)]
pub struct TurnRenderer {
    template: ChatTemplate,
    tokenizer: ModelTokenizer,
    /// The `tools` variable of the template (their schemas), when there are tools.
    extra: serde_json::Map<String, Value>,
}

impl TurnRenderer {
    /// A renderer with these tools' schemas passed to the template (`tools=`).
    pub fn new(template: ChatTemplate, tokenizer: ModelTokenizer, tools: &[ToolSchema]) -> TurnRenderer {
        let mut extra = serde_json::Map::new();
        if !tools.is_empty() {
            extra.insert("tools".into(), tools.iter().map(ToolSchema::to_json).collect());
        }
        TurnRenderer {
            template,
            tokenizer,
            extra,
        }
    }

    /// The tokens that follow a model turn ended by the token `stop` when `messages` (chat
    /// messages as JSON: tool results, a user turn) come next, through the next assistant
    /// header. The template renders a conversation whose assistant turn holds a marker, then
    /// `messages`; the tokens are what it writes after the marker and the model's end-of-turn
    /// token, so whatever the template puts between turns (the newline after `<|im_end|>`) is
    /// kept. Only what follows the turn is used: templates that render an earlier assistant
    /// turn differently once more messages follow it (Qwen3 drops its empty `<think>` block)
    /// do not matter, since the model's turn is already in the sample as the ids it sampled.
    pub fn env_tokens(&self, stop: u32, messages: &[Value]) -> Result<Vec<u32>, String> {
        const MARKER: &str = "GRPO-END-OF-MODEL-TURN";
        let stop_text = self
            .tokenizer
            .id_to_token(stop)
            .ok_or_else(|| format!("the turn's stop token {stop} is not in the tokenizer"))?;
        let mut conversation = vec![
            json!({"role": "user", "content": "?"}),
            json!({"role": "assistant", "content": MARKER}),
        ];
        conversation.extend_from_slice(messages);
        let text = self
            .template
            .render_with(&Value::Array(conversation), true, &self.extra)
            .map_err(|e| e.to_string())?;
        let end = text.find(&format!("{MARKER}{stop_text}")).ok_or_else(|| {
            format!(
                "the chat template does not end an assistant turn with {stop_text:?}, the turn's stop \
                     token, right after its content"
            )
        })? + MARKER.len()
            + stop_text.len();
        self.tokenizer
            .encode(&text[end..], false)
            .map_err(|e| e.to_string())
    }
}

/// The tools of an episode and how they run; the [`TurnHandler`] of a tool-using engine.
#[derive(Clone)]
pub struct ToolEnvironment {
    inner: Arc<Inner>,
}

struct Inner {
    /// Tells this environment's episodes from those of other workers and runs.
    instance: u64,
    toolbox: Toolbox,
    /// The environments (interactions) that answer turns without tool calls; a row picks one
    /// by `extra_info.interaction_kwargs.name`, the first by default.
    interactions: Vec<Arc<dyn Environment>>,
    settings: ToolSettings,
    renderer: TurnRenderer,
    tokenizer: ModelTokenizer,
}

impl ToolEnvironment {
    /// An environment running `toolbox`'s tools, rendering with `template` and `tokenizer`.
    pub fn new(
        toolbox: Toolbox,
        settings: ToolSettings,
        template: ChatTemplate,
        tokenizer: ModelTokenizer,
    ) -> ToolEnvironment {
        let renderer = TurnRenderer::new(template, tokenizer.clone(), &toolbox.schemas());
        ToolEnvironment {
            inner: Arc::new(Inner {
                instance: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |t| t.as_nanos() as u64)
                    ^ (u64::from(std::process::id()) << 32),
                toolbox,
                interactions: Vec::new(),
                settings,
                renderer,
                tokenizer,
            }),
        }
    }

    /// The environment with `interactions` (programs, [`agent::Interaction`], or environments
    /// written in Rust) answering the model's turns that call no tool.
    pub fn with_interactions(mut self, interactions: Vec<Arc<dyn Environment>>) -> ToolEnvironment {
        Arc::get_mut(&mut self.inner)
            .expect("interactions are added before the environment is shared")
            .interactions = interactions;
        self
    }

    /// The schemas of its tools, as the chat template receives them.
    pub fn schemas(&self) -> Vec<ToolSchema> {
        self.inner.toolbox.schemas()
    }

    /// Tells the interactions that run `id` of an episode is over (each drops what it kept
    /// for it, if any).
    fn close(&self, id: &TurnId) {
        if self.inner.interactions.is_empty() {
            return;
        }
        let episode = episode_id(self.inner.instance, id);
        for interaction in &self.inner.interactions {
            interaction.close(&episode);
        }
    }

    /// The answer to a parked turn (blocks while its tools run).
    pub fn answer(&self, turn: &Turn) -> Resume {
        let started = Instant::now();
        let mut stats = EpisodeStats::default();
        let resume = self.inner.answer(turn, &mut stats);
        stats.env_time = started.elapsed();
        match resume {
            Some(tokens) => Resume::Continue { tokens, stats },
            None => Resume::Finish { stats },
        }
    }
}

impl TurnHandler for ToolEnvironment {
    fn on_turn(&self, turn: Turn, resumer: Resumer) {
        let env = self.clone();
        std::thread::Builder::new()
            .name("rollout-tools".into())
            .spawn(move || resumer.resume(turn.id, env.answer(&turn)))
            .expect("spawning a tool thread");
    }

    /// Tells the interactions the episode is over (each drops what it kept for it, if any).
    fn on_finished(&self, sample: &Sample) {
        self.close(&TurnId {
            request_id: sample.request_id,
            sample_index: sample.sample_index,
            restarts: sample.restarts,
        });
    }

    /// As [`TurnHandler::on_finished`]: that run of the episode is over.
    fn on_abandoned(&self, id: TurnId) {
        self.close(&id);
    }
}

/// An episode's id: this environment's instance, then request, sample and restart (a request
/// redone by another worker after a failure gets new ids).
fn episode_id(instance: u64, id: &TurnId) -> String {
    format!(
        "{instance:x}-{}-{}-{}",
        id.request_id, id.sample_index, id.restarts
    )
}

/// The context of a call of `tool` in `turn`'s episode: the episode's id and the row's
/// `extra_info.tools_kwargs.<tool>`.
fn context(instance: u64, turn: &Turn, tool: &str) -> CallContext {
    CallContext {
        episode: episode_id(instance, &turn.id),
        kwargs: turn
            .request
            .multi_turn
            .as_ref()
            .and_then(|e| e.row.get("extra_info")?.get("tools_kwargs")?.get(tool).cloned())
            .unwrap_or(Value::Null),
    }
}

impl Inner {
    /// The environment's tokens after `turn`, or `None` when the episode ends there.
    fn answer(&self, turn: &Turn, stats: &mut EpisodeStats) -> Option<Vec<u32>> {
        if turn.turns >= self.settings.max_assistant_turns {
            return None;
        }
        let ids = &turn.response[turn.turn.clone()];
        let &stop = ids.last()?;
        let text = self.tokenizer.decode(ids, true).ok()?;
        let parsed = self.settings.format.parse(&text);
        if parsed.calls.is_empty() && parsed.errors.is_empty() {
            return self.interact(turn, stop, &text, stats);
        }
        let mut observations = Vec::new();
        for (k, call) in parsed.calls.iter().enumerate() {
            stats.tool_calls += 1;
            let result = if k < self.settings.max_parallel_calls {
                self.run(call, context(self.instance, turn, &call.name))
            } else {
                Err(ToolError::Failed(format!(
                    "at most {} tool calls run per turn; this one did not",
                    self.settings.max_parallel_calls
                )))
            };
            observations.push(match result {
                Ok(text) => text,
                Err(e) => {
                    match e {
                        ToolError::TimedOut(_) => stats.tool_timeouts += 1,
                        _ => stats.tool_errors += 1,
                    }
                    format!("Error: {e}")
                }
            });
        }
        for e in &parsed.errors {
            stats.tool_errors += 1;
            observations.push(format!("Error: {e}"));
        }
        let messages: Vec<Value> = observations
            .iter()
            .map(|o| json!({"role": "tool", "content": self.truncate(o)}))
            .collect();
        match self.renderer.env_tokens(stop, &messages) {
            Ok(tokens) => Some(tokens),
            Err(e) => {
                tracing::warn!(request = turn.id.request_id, "ending an episode: {e}");
                stats.tool_errors += 1;
                None
            }
        }
    }

    /// The reply of the row's interaction to a turn that called no tool, as tokens; `None`
    /// when the episode ends: no interaction, its reply limit reached, it says done, or it
    /// failed (counted as a tool error or time-out).
    fn interact(&self, turn: &Turn, stop: u32, text: &str, stats: &mut EpisodeStats) -> Option<Vec<u32>> {
        if self.interactions.is_empty() || turn.user_turns >= self.settings.max_user_turns {
            return None;
        }
        let kwargs = turn
            .request
            .multi_turn
            .as_ref()
            .and_then(|e| e.row.get("extra_info")?.get("interaction_kwargs").cloned())
            .unwrap_or(Value::Null);
        let interaction = match kwargs.get("name").and_then(Value::as_str) {
            None => &self.interactions[0],
            Some(name) => match self.interactions.iter().find(|i| i.name() == name) {
                Some(interaction) => interaction,
                None => {
                    tracing::warn!(
                        request = turn.id.request_id,
                        "ending an episode: its row names the interaction {name:?}, which the run does not have"
                    );
                    stats.tool_errors += 1;
                    return None;
                }
            },
        };
        let episode = episode_id(self.instance, &turn.id);
        let (interaction, name) = (interaction.clone(), interaction.name().to_string());
        let limit = interaction.time_limit();
        let row = turn.request.multi_turn.as_ref().map(|e| e.row.clone());
        let (user_turns, text) = (turn.user_turns, text.to_string());
        let step = move || {
            if user_turns == 0 {
                interaction.reset(&episode, row.as_deref().unwrap_or(&Value::Null))?;
            }
            interaction.step(&EnvTurn {
                episode: &episode,
                user_turns,
                text: &text,
                kwargs: &kwargs,
            })
        };
        match self.bounded(limit, step) {
            Ok(reply) => {
                stats.user_turns += 1;
                stats.turn_scores.extend(reply.reward);
                if reply.done {
                    return None;
                }
                let message = json!({"role": "user", "content": self.truncate(&reply.content)});
                match self.renderer.env_tokens(stop, &[message]) {
                    Ok(tokens) => Some(tokens),
                    Err(e) => {
                        tracing::warn!(request = turn.id.request_id, "ending an episode: {e}");
                        stats.tool_errors += 1;
                        None
                    }
                }
            }
            Err(e) => {
                tracing::warn!(
                    request = turn.id.request_id,
                    "ending an episode: interaction {name}: {e}"
                );
                match e {
                    ToolError::TimedOut(_) => stats.tool_timeouts += 1,
                    _ => stats.tool_errors += 1,
                }
                None
            }
        }
    }

    /// Runs one call under the time limit, on a thread of its own.
    fn run(&self, call: &ToolCall, context: CallContext) -> Result<String, ToolError> {
        let (toolbox, call) = (self.toolbox.clone(), call.clone());
        self.bounded(self.toolbox.time_limit(&call.name), move || {
            toolbox.call_in(&call, &context)
        })
    }

    /// Runs `work` on a thread of its own under a time limit: its own `limit` (given a moment
    /// past it to say it stopped itself), else the run's `tool_timeout_s`, at which in-process
    /// work is abandoned (its thread runs on; its answer is dropped).
    fn bounded<T: Send + 'static>(
        &self,
        own: Option<Duration>,
        work: impl FnOnce() -> Result<T, ToolError> + Send + 'static,
    ) -> Result<T, ToolError> {
        let (limit, wait) = match own {
            Some(own) => (own, own + Duration::from_secs(2)),
            None => (self.settings.tool_timeout, self.settings.tool_timeout),
        };
        let (tx, rx) = channel();
        std::thread::Builder::new()
            .name("rollout-tool-call".into())
            .spawn(move || {
                let _ = tx.send(work());
            })
            .map_err(|e| ToolError::Failed(format!("starting the tool: {e}")))?;
        rx.recv_timeout(wait).unwrap_or(Err(ToolError::TimedOut(limit)))
    }

    /// A tool response cut to `max_tool_response_length` characters on the configured side.
    fn truncate(&self, text: &str) -> String {
        let max = self.settings.max_tool_response_length;
        let chars: Vec<char> = text.chars().collect();
        if chars.len() <= max {
            return text.to_string();
        }
        let marker = "...(truncated)...";
        let keep: String = match self.settings.truncate_side {
            TruncateSide::Left => chars[..max].iter().collect::<String>() + marker,
            TruncateSide::Right => {
                String::from(marker) + &chars[chars.len() - max..].iter().collect::<String>()
            }
            TruncateSide::Middle => {
                let head = max / 2;
                chars[..head].iter().collect::<String>()
                    + marker
                    + &chars[chars.len() - (max - head)..].iter().collect::<String>()
            }
        };
        keep
    }
}
