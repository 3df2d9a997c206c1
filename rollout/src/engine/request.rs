//! What goes into an engine and what comes out: its configuration, requests, samples,
//! outputs and counters.

use crate::error::RolloutError;
use crate::sampling::{SamplerKind, SamplingParams};
use model::forward::KvWrite;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// Static sizes of an engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// KV-cache slots: the most sequences decoded at once (`rollout.max_num_seqs`).
    pub max_num_seqs: usize,
    /// Positions per slot: the longest prompt + response.
    pub max_model_len: usize,
    /// Prompt length buckets for prefill (ascending; a prefill covers the prompt without its
    /// last token); the longest must be at least `max_model_len - 2`. Empty: 16, 32, 64, ... and `max_model_len`.
    pub prefill_buckets: Vec<usize>,
    /// End-of-sequence ids that stop every sample (the tokenizer's / chat template's EOS).
    pub eos_token_ids: Vec<u32>,
    /// Device the weights and the cache live on, for weights on one device (weights with a
    /// replica per device put the engine on devices `0..N`).
    pub device: usize,
    /// Positions per KV-cache chunk: a decode step reads only the chunks up to the longest
    /// active sequence (chunk counts rounded up to powers of two, one compiled step each).
    /// 0 = automatic: one chunk (the whole cache, one decode program) below 1024 positions,
    /// chunks of 256 from there; `max_model_len` or more = one chunk.
    pub kv_chunk: usize,
    /// Most prompts (groups) prefilled in one program run (a second program shape, compiled
    /// on first use, for batches of this size). 1, the default, prefills each group alone,
    /// which keeps every request's tokens independent of its batch-mates (see the module
    /// docs); more saves prefill time at the cost of that reproducibility.
    pub prefill_batch: usize,
    /// The on-device sampler.
    pub sampler: SamplerKind,
    /// How decode writes each new key and value into the cache; `None`: the one that suits
    /// the engine's plugin ([`KvWrite::for_plugin`]).
    pub kv_write: Option<KvWrite>,
    /// Devices of the tensor-parallel axis (`rollout.tensor_model_parallel_size`): the weights
    /// are split over them in the Megatron layout and the KV cache by KV heads; the engine's
    /// devices form `devices / tensor_parallel` slot groups. The weights must be laid out for
    /// it ([`crate::EngineWeights::tensor_parallel`]).
    pub tensor_parallel: usize,
    /// Decode only the slots that hold live samples: the engine compacts them into the
    /// lowest rows of each slot group (moving cache rows on the device) and runs the decode
    /// step compiled for the smallest slot bucket holding them
    /// ([`crate::plan::ProgramPlan::slot_buckets`]), so a step costs what the live samples
    /// cost. A sample's tokens do not depend on the bucket. Off: every step runs every slot.
    pub compact_slots: bool,
    /// LoRA adapters the programs apply beside the weights (`x·Wᵀ + s·(x·Aᵀ)·Bᵀ`, no merged
    /// copy): the engine's weights are then the model's table followed by the adapters' (f32,
    /// [`model::lora::lora_param_table`]). `None`: the weights alone (a LoRA run's merged ones).
    pub adapters: Option<model::LoraConfig>,
    /// Record, for every token a sample feeds through a mixture-of-experts model, the experts
    /// each MoE layer chose ([`Sample::routes`]; `rollout.enable_rollout_routing_replay`), for
    /// the learner to replay. Off: no sample carries routes. Ignored for a dense model.
    pub record_routes: bool,
    /// How a mixture-of-experts model dispatches to its experts (`model.moe_dispatch`; the
    /// ragged dot's lowering follows the engine's plugin, [`model::moe::MoeLowering::on`]).
    pub moe_lowering: model::moe::MoeLowering,
}

impl EngineConfig {
    /// `max_num_seqs` slots of `max_model_len` positions, default buckets, no EOS ids, device 0.
    pub fn new(max_num_seqs: usize, max_model_len: usize) -> EngineConfig {
        EngineConfig {
            max_num_seqs,
            max_model_len,
            prefill_buckets: Vec::new(),
            eos_token_ids: Vec::new(),
            device: 0,
            kv_chunk: 0,
            prefill_batch: 1,
            sampler: SamplerKind::default(),
            kv_write: None,
            tensor_parallel: 1,
            compact_slots: true,
            adapters: None,
            record_routes: false,
            moe_lowering: model::moe::MoeLowering::Dense,
        }
    }

    /// The chunk length the cache is split into (see [`EngineConfig::kv_chunk`]).
    pub fn effective_kv_chunk(&self) -> usize {
        match self.kv_chunk {
            0 if self.max_model_len < 1024 => self.max_model_len,
            0 => 256,
            c => c.min(self.max_model_len),
        }
    }

    /// The prompt-length buckets prefill compiles for: `prefill_buckets` when set, else 16, 32,
    /// 64, ... below `max_model_len`, then `max_model_len`.
    pub fn buckets(&self) -> Vec<usize> {
        if !self.prefill_buckets.is_empty() {
            return self.prefill_buckets.clone();
        }
        let mut b = Vec::new();
        let mut len = 16;
        while len < self.max_model_len {
            b.push(len);
            len *= 2;
        }
        b.push(self.max_model_len);
        b
    }
}

/// One generation request: `n` samples of a prompt.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// Caller's id, echoed in every sample and rejection.
    pub id: u64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Samples to draw (the GRPO group size); the prompt is prefilled once for all of them.
    pub n: usize,
    /// Seed: sample `i`'s token `j` is drawn with key `(seed, i, j)`.
    pub seed: u64,
    /// Sampling parameters and stop rules. `max_new_tokens` bounds the whole response of a
    /// multi-turn sample, environment tokens included.
    pub params: SamplingParams,
    /// Multi-turn episodes: each model turn that ends with a stop token parks its sample
    /// (its KV cache kept) and comes out of [`crate::Engine::take_turns`]; the environment
    /// answers with [`crate::Engine::resume`]. `None`: one response per sample.
    pub multi_turn: Option<Episode>,
}

/// A multi-turn request: its budget per turn, and the dataset row its episodes start from.
#[derive(Clone, Debug, PartialEq)]
pub struct Episode {
    /// Most tokens one model turn may generate; a longer turn ends the sample, truncated
    /// ([`FinishReason::MaxTurnTokens`]).
    pub max_turn_tokens: usize,
    /// The row's columns as JSON (`extra_info` among them), for the environment: the tools'
    /// per-row arguments (VeRL's `extra_info.tools_kwargs`), an environment's reset. The engine
    /// does not read it.
    pub row: std::sync::Arc<serde_json::Value>,
}

/// Why a sample stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token id was sampled (it is the last response id).
    Eos(u32),
    /// A stop string appeared in the decoded text.
    StopString(String),
    /// `max_new_tokens` tokens were generated.
    MaxNewTokens,
    /// Prompt + response reached `max_model_len` tokens.
    MaxModelLen,
    /// A model turn of a multi-turn sample reached [`Episode::max_turn_tokens`].
    MaxTurnTokens,
}

impl FinishReason {
    /// Stopped by a length limit rather than by the model: the response is cut short.
    pub fn is_truncated(&self) -> bool {
        matches!(
            self,
            FinishReason::MaxNewTokens | FinishReason::MaxModelLen | FinishReason::MaxTurnTokens
        )
    }
}

impl std::fmt::Display for FinishReason {
    /// vLLM's names: `stop` (EOS / stop token or stop string) or `length` (a length limit),
    /// with the detail in parentheses.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FinishReason::Eos(id) => write!(f, "stop (token {id})"),
            FinishReason::StopString(s) => write!(f, "stop (string {s:?})"),
            FinishReason::MaxNewTokens => write!(f, "length (max_new_tokens)"),
            FinishReason::MaxModelLen => write!(f, "length (max_model_len)"),
            FinishReason::MaxTurnTokens => write!(f, "length (max_turn_tokens)"),
        }
    }
}

/// The most experts a model may have for routing replay: [`Sample::routes`] holds each
/// expert id in a byte.
pub const MAX_RECORDED_EXPERTS: usize = 256;

/// One finished sample.
#[derive(Clone, Debug)]
pub struct Sample {
    /// The request's id.
    pub request_id: u64,
    /// Index within the request's group (`0..n`).
    pub sample_index: usize,
    /// The prompt ids.
    pub prompt_ids: Vec<u32>,
    /// Generated ids (including a final EOS / stop token).
    pub response_ids: Vec<u32>,
    /// Decoded response (special tokens skipped; cut before a stop string); empty when the
    /// engine has no tokenizer.
    pub text: String,
    /// Log-probability of each response id under `log_softmax(logits / T)` (T = 1 when greedy).
    pub logprobs: Vec<f32>,
    /// Why it stopped.
    pub finish_reason: FinishReason,
    /// Version of the weights that produced every token of it.
    pub weight_version: u64,
    /// How many times a weight update restarted it.
    pub restarts: u32,
    /// The response positions the environment wrote (tool results, user turns), in order:
    /// context for the model, never sampled (their log-probs are 0) and never trained. Empty
    /// for a single-turn sample.
    pub env_spans: Vec<Range<usize>>,
    /// What happened over the sample's turns.
    pub episode: EpisodeStats,
    /// Routing replay ([`EngineConfig::record_routes`]): the experts every mixture-of-experts
    /// layer chose for each position the engine fed through the model, in order (the prompt,
    /// then the response but for its last token, which is never fed), row-major
    /// `[positions, moe_layers, experts_per_token]` in each layer's top-k order. Empty when not
    /// recorded.
    pub routes: Vec<u8>,
}

impl Sample {
    /// Per response token: 1 for a token the model sampled, 0 for one the environment wrote
    /// (VeRL's `response_mask` of a multi-turn sample).
    pub fn model_token_mask(&self) -> Vec<bool> {
        let mut mask = vec![true; self.response_ids.len()];
        for span in &self.env_spans {
            mask[span.clone()].fill(false);
        }
        mask
    }
}

/// The turns of a sample and what its environment did in them (all but `turns` zero for a
/// single-turn sample).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EpisodeStats {
    /// Model turns (1 for a single-turn sample).
    pub turns: u32,
    /// Tool calls the environment ran.
    pub tool_calls: u32,
    /// Tool calls that failed: malformed, unknown tool, bad arguments, a crash.
    pub tool_errors: u32,
    /// Tool calls stopped by their time limit.
    pub tool_timeouts: u32,
    /// Wall time in the environment between turns.
    pub env_time: Duration,
    /// Turns an interaction (a simulated user, VeRL's `interaction`) answered.
    pub user_turns: u32,
    /// The rewards the interaction gave, in order (VeRL's `turn_scores`).
    pub turn_scores: Vec<f64>,
}

impl EpisodeStats {
    /// Adds another part's counts and time (`turns` too).
    pub fn add(&mut self, other: &EpisodeStats) {
        self.turns += other.turns;
        self.tool_calls += other.tool_calls;
        self.tool_errors += other.tool_errors;
        self.tool_timeouts += other.tool_timeouts;
        self.env_time += other.env_time;
        self.user_turns += other.user_turns;
        self.turn_scores.extend_from_slice(&other.turn_scores);
    }
}

/// Which parked turn: a sample of a request, in one run of it (a weight update restarts the
/// sample's whole episode, and an answer to an earlier run is stale).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TurnId {
    pub request_id: u64,
    pub sample_index: usize,
    pub restarts: u32,
}

/// A model turn of a multi-turn sample that ended with a stop token: the sample waits, its
/// KV cache kept, for [`crate::Engine::resume`].
#[derive(Clone, Debug)]
pub struct Turn {
    pub id: TurnId,
    pub request: Arc<GenerationRequest>,
    /// The response so far, model and environment tokens.
    pub response: Vec<u32>,
    /// This turn's tokens within `response` (its stop token last).
    pub turn: Range<usize>,
    /// The log-probability of each of this turn's tokens, as sampled.
    pub logprobs: Vec<f32>,
    /// What ended the turn: a stop token, or a budget where the environment asked for those
    /// turns too ([`crate::TurnHandler::parks_cut_turns`]).
    pub reason: FinishReason,
    /// Model turns so far, this one included.
    pub turns: u32,
    /// Interaction (user) turns so far.
    pub user_turns: u32,
}

/// The environment's answer to a parked turn.
#[derive(Clone, Debug)]
pub enum Resume {
    /// Append these tokens (rendered once, never re-encoded from text) to the response and
    /// let the model take the next turn. If they leave no room for one more model token
    /// under `max_new_tokens` or `max_model_len`, the sample ends there, truncated, without them.
    Continue { tokens: Vec<u32>, stats: EpisodeStats },
    /// The episode is over: the sample finishes with its last turn's stop reason.
    Finish { stats: EpisodeStats },
}

/// What the engine streams back.
#[derive(Debug)]
pub enum EngineOutput {
    /// A finished sample.
    Sample(Sample),
    /// A request that was not served (the error names it); the others go on.
    Rejected(RolloutError),
}

/// Counters of program runs, tokens and time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Prompts prefilled (+ fanned out): one per admitted group.
    pub prefill_runs: usize,
    /// Prefill program runs (each covers up to [`EngineConfig::prefill_batch`] groups).
    pub prefill_batches: usize,
    /// Wall time in prefill program runs (inputs uploaded, program run).
    pub prefill_time: std::time::Duration,
    /// Wall time in decode program runs (inputs uploaded, program run, tokens and
    /// log-probs read back); the rest of [`Engine::step`] is host bookkeeping.
    pub decode_time: std::time::Duration,
    /// Wall time in [`Engine::step`] altogether.
    pub step_time: std::time::Duration,
    /// Decode steps run.
    pub decode_steps: usize,
    /// Tokens generated (all samples).
    pub generated_tokens: usize,
    /// Samples restarted by weight updates.
    pub restarted_samples: usize,
    /// Slot rows the decode steps ran, padding rows included: `generated_tokens /
    /// decode_rows` is the share of decode work that produced tokens.
    pub decode_rows: usize,
    /// Cache rows moved to compact live samples into a smaller slot bucket.
    pub moved_rows: usize,
    /// Environment tokens written into resumed samples' caches (multi-turn).
    pub env_tokens: usize,
    /// Extend runs that wrote them: one per resumed turn.
    pub extend_runs: usize,
    /// Wall time in extend runs (compiling aside: inputs uploaded, programs run).
    pub extend_time: std::time::Duration,
}
