//! The continuous-batching engine: requests (prompt ids, sampling parameters, group size `n`,
//! seed) wait in a FIFO queue; a request is admitted when `n` KV-cache slots are free, its
//! prompt is prefilled once (in a length bucket) and copied into its `n` slots on the device;
//! then one compiled decode-and-sample step advances every active slot (inactive slots are
//! masked). A finished sample frees its slot at once and the next waiting request takes it at
//! the next step.
//!
//! Each group is prefilled by its own program run by default. Requests waiting at the same
//! time with the same prefill program can be prefilled several at a time
//! ([`EngineConfig::prefill_batch`]), which saves prefill time (BENCHMARKS.md) but gives a
//! prompt's KV entries last-bit differences that depend on its batch-mates: a sampled token
//! near a CDF boundary can then differ from the same request run alone, so it is off by default (the
//! same request, seed and weights give the same tokens whatever else is in the batch, and a
//! run gives the same samples however its prompts are split over rollout workers). The KV cache can be split along positions into
//! chunks ([`EngineConfig::kv_chunk`]); a decode step then reads only the chunks that hold
//! the active sequences' positions (one compiled step per power-of-two chunk count), so short
//! sequences in a long cache do not pay for the whole cache.
//!
//! The prefill covers the prompt without its last token; the last prompt token is the first
//! decode input of every sample, so every token (including the first) is drawn by the same
//! fused on-device sampler with its own Threefry key `(seed, sample index, token index)`.
//!
//! Multi-turn samples ([`GenerationRequest::multi_turn`]) park at the end of each model turn
//! with their slot kept ([`Engine::take_turns`]); the environment's answer
//! ([`Engine::resume`]) is written into the slot after the positions it holds by one extend
//! run ([`EnvExtend`]: the tokens' keys and values in one pass, attending to the slot's cache),
//! and the model samples its next turn from the last of them in the next decode step. Earlier
//! turns are never prefilled again.
//!
//! Weight hot-swap ([`Engine::update_weights`]) happens between steps without recompiling.
//! Policy: samples in flight are **restarted** from their prompt on the new weights (their
//! partial tokens are dropped, their slots re-prefilled), so every sample is produced by
//! exactly one weight version, recorded in [`Sample::weight_version`]; [`Sample::restarts`]
//! says how many times a sample was restarted. Samples finished before the swap keep the old
//! version. A restarted sample draws the same keys, so it equals a fresh request on the new
//! weights with the same seed.
//!
//! Slot buckets ([`EngineConfig::compact_slots`], on by default): decode steps are compiled
//! for the first 8, 16, 32, ... slots of each slot group as well as for all of them, and each
//! step runs the smallest that holds the live samples. Admission fills the lowest free slots
//! (spreading a group's samples over the slot groups), and when finished samples leave holes
//! that keep the live ones in a larger bucket than their count needs, the live samples above
//! the smaller bucket are moved down into the holes: their cache rows are copied on the
//! device ([`SlotMoves`]). A sample's keys name its request, sample and token, never its
//! slot, and the engine keeps only the buckets whose rows compute the full step's bits (a
//! probe when the engine is built), so a sample's tokens and log-probs do not depend on the
//! bucket it ran in, nor on how a step's requests were split over rollout workers; a step's
//! cost follows the samples still generating instead of `max_num_seqs`.
//!
//! Several devices: weights on devices `0..N` ([`EngineWeights`]) make an engine whose
//! programs run SPMD over a mesh of those devices: data parallel over the slots, which are
//! split into `N / tp` contiguous blocks (`max_num_seqs` must divide by that), and tensor
//! parallel over `tp` devices per block ([`EngineConfig::tensor_parallel`]: weights in the
//! Megatron layout, the KV cache split by KV heads; `tp` = 1, the default, replicates the
//! weights). Scheduling, keys and stop rules are the same as on one device, and each slot's
//! arithmetic is the single-device program's, so the same requests give the same tokens.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use model::{ModelConfig, ModelTokenizer};
use xla::runtime::{Buffer, Client};
use xla::DType;

use crate::error::{Result, RolloutError};
use crate::plan::{DecodeKey, PrefillKey, ProgramPlan};
use crate::programs::{DecodeInputs, DecodeSample, EnvExtend, PrefillFanout, SlotMoves, MOVES_PER_RUN};
use crate::sampling::draw_key;
use crate::weights::{check_layout, EngineWeights};

mod handle;
pub(crate) mod request;

pub use handle::{EngineControl, EngineHandle};
pub use handle::{Resumer, TurnHandler};
pub use request::{
    EngineConfig, EngineOutput, EngineStats, Episode, EpisodeStats, FinishReason, GenerationRequest, Resume,
    Sample, Turn, TurnId, MAX_RECORDED_EXPERTS,
};

/// Decode steps of the probe that checks each slot bucket against the full step.
const PROBE_STEPS: usize = 4;

struct Pending {
    request: Arc<GenerationRequest>,
    sample_indices: Vec<usize>,
    restarts: u32,
}

struct Active {
    request: Arc<GenerationRequest>,
    sample_index: usize,
    response: Vec<u32>,
    logprobs: Vec<f32>,
    /// The input of the sample's next decode row, at `position` (not yet in the cache).
    next_token: u32,
    position: usize,
    restarts: u32,
    /// Multi-turn: where the current model turn starts in `response`.
    turn_start: usize,
    /// Multi-turn: waiting for the environment's [`Resume`]; its rows are not decoded.
    parked: Option<FinishReason>,
    /// Environment tokens not yet in the cache: the next step writes them, after
    /// `next_token`, by one extend run, and the last becomes `next_token`.
    feed: Vec<u32>,
    env_spans: Vec<std::ops::Range<usize>>,
    episode: EpisodeStats,
    /// Routing replay: the experts chosen for each position fed so far ([`Sample::routes`]).
    routes: Vec<u8>,
}

impl Active {
    fn id(&self) -> TurnId {
        TurnId {
            request_id: self.request.id,
            sample_index: self.sample_index,
            restarts: self.restarts,
        }
    }

    /// Whether the next decode step runs this sample's row.
    fn decoding(&self) -> bool {
        self.parked.is_none()
    }
}

/// The rollout engine (single-threaded core; see [`Engine::spawn`] for the streaming handle).
pub struct Engine {
    client: Client,
    config: ModelConfig,
    dtype: DType,
    /// Shared with whoever else holds them (the learner, on the same devices): never copied.
    weights: EngineWeights,
    /// The devices the engine runs on: `[settings.device]`, or `0..N` over `N`.
    devices: Vec<usize>,
    version: u64,
    settings: EngineConfig,
    /// The cache shape and which program each request shape and cache length runs.
    plan: ProgramPlan,
    /// `[device][tensor]`: each device's block of slots.
    cache: Vec<Vec<Buffer>>,
    tokenizer: Option<ModelTokenizer>,
    prefill: HashMap<PrefillKey, PrefillFanout>,
    decode: HashMap<DecodeKey, DecodeSample>,
    /// Extend programs by token bucket, compiled on first use.
    extend: HashMap<usize, EnvExtend>,
    /// Compiled by [`Engine::precompile`] or on the first compaction.
    moves: Option<SlotMoves>,
    waiting: VecDeque<Pending>,
    slots: Vec<Option<Active>>,
    /// Turns parked since the last [`Engine::take_turns`].
    turns: Vec<Turn>,
    /// Samples finished outside a decode step (by [`Engine::resume`]), returned by the next step.
    done: Vec<Sample>,
    /// Multi-turn runs ended without a sample since the last [`Engine::take_abandoned`].
    abandoned: Vec<TurnId>,
    stats: EngineStats,
    /// Multi-turn turns cut by a budget park too, for the environment to end
    /// ([`TurnHandler::parks_cut_turns`]).
    park_cut_turns: bool,
}

impl Engine {
    /// Creates an engine over `weights` (device buffers in [`param_table`] order, used in
    /// place) at `version`: allocates the KV cache (its size is logged) and compiles the decode
    /// step. Prefill programs are compiled on first use per (bucket, group width). Weights
    /// with a replica on each of devices `0..N` make an engine split over those devices
    /// (see the module comment).
    pub fn new(
        client: &Client,
        config: &ModelConfig,
        weights: impl Into<EngineWeights>,
        version: u64,
        settings: EngineConfig,
        tokenizer: Option<ModelTokenizer>,
    ) -> Result<Engine> {
        if settings.max_num_seqs == 0 || settings.max_model_len < 2 {
            return Err(RolloutError::Config(format!(
                "max_num_seqs must be >= 1 and max_model_len >= 2, got {} and {}",
                settings.max_num_seqs, settings.max_model_len
            )));
        }
        let buckets = settings.buckets();
        if buckets.windows(2).any(|w| w[0] >= w[1])
            || buckets.last().copied().unwrap_or(0) + 2 < settings.max_model_len
            || buckets.last().copied().unwrap_or(0) > settings.max_model_len
        {
            return Err(RolloutError::Config(format!(
                "prefill buckets {buckets:?} must be ascending, the longest between max_model_len - 2 and max_model_len ({})",
                settings.max_model_len
            )));
        }
        let weights = weights.into();
        let devices: Vec<usize> = match weights.devices() {
            0 => return Err(RolloutError::Config("the weights have no device replica".into())),
            1 => vec![settings.device],
            n => (0..n).collect(),
        };
        if devices.len() > client.num_devices() {
            return Err(RolloutError::Config(format!(
                "weights for {} devices, the client has {}",
                devices.len(),
                client.num_devices()
            )));
        }
        if weights.tensor_parallel() != settings.tensor_parallel.max(1) {
            return Err(RolloutError::Config(format!(
                "the weights are laid out for a tensor-parallel size of {}, the engine is configured \
                 for {} (rollout.tensor_model_parallel_size)",
                weights.tensor_parallel(),
                settings.tensor_parallel.max(1)
            )));
        }
        let dtype = check_layout(
            config,
            settings.adapters.as_ref(),
            &weights,
            None,
            &devices,
            version,
        )?;
        if let Some(moe) = config.moe.as_ref().filter(|_| settings.record_routes) {
            if moe.num_experts > MAX_RECORDED_EXPERTS {
                return Err(RolloutError::Config(format!(
                    "routing replay records each expert id in a byte, and this model has {} experts \
                     (at most {MAX_RECORDED_EXPERTS}); turn rollout.enable_rollout_routing_replay off",
                    moe.num_experts
                )));
            }
        }
        let plan = ProgramPlan::new(config, &settings, devices.len(), dtype, client.plugin().kind());
        let cache_shape = &plan.cache;
        cache_shape.check_devices()?;
        tracing::info!(
            devices = devices.len(),
            tensor_parallel = cache_shape.tensor_parallel,
            slots = settings.max_num_seqs,
            max_model_len = settings.max_model_len,
            layers = config.num_hidden_layers,
            kv_heads = config.num_key_value_heads,
            head_dim = config.head_dim,
            chunks = cache_shape.chunks(),
            chunk = cache_shape.chunk,
            "rollout KV cache: {:.1} MiB ({}), {:.1} MiB per device",
            cache_shape.bytes() as f64 / (1024.0 * 1024.0),
            cache_shape.dtype,
            cache_shape.bytes_per_device() as f64 / (1024.0 * 1024.0)
        );
        let cache = cache_shape.allocate_on(client, &devices)?;
        let mut engine = Engine {
            client: client.clone(),
            config: config.clone(),
            dtype,
            weights,
            devices,
            version,
            slots: (0..settings.max_num_seqs).map(|_| None).collect(),
            settings,
            plan,
            cache,
            tokenizer,
            prefill: HashMap::new(),
            decode: HashMap::new(),
            extend: HashMap::new(),
            moves: None,
            waiting: VecDeque::new(),
            turns: Vec::new(),
            done: Vec::new(),
            abandoned: Vec::new(),
            stats: EngineStats::default(),
            park_cut_turns: false,
        };
        let all = DecodeKey {
            truncate: false,
            chunks: engine.plan.cache.chunks(),
            rows: engine.plan.cache.local_slots(),
        };
        engine.ensure_decode(all)?;
        engine.check_slot_buckets()?;
        Ok(engine)
    }

    /// Keeps the slot buckets whose decode steps give, row for row, the tokens and log-prob
    /// bits of the steps over every slot, and drops the others (see
    /// [`crate::plan::MIN_SLOT_BUCKET`]): a library may take over an operation above a size
    /// (XLA CPU hands large element-wise and reduce fusions to YNNPACK, which rounds
    /// otherwise), so a small bucket can round differently from the full step. For every
    /// decode chunk count, a probe of [`PROBE_STEPS`] steps: every row a different token at
    /// the last positions those chunks hold, sampled at temperature 1 with its own keys, so
    /// attention reads every chunk and sums over every position (the fresh cache's zero keys
    /// before the probe's own give as many equal, non-zero weights). Only before the first
    /// request: a sample writes each position before it attends to it, so what the probe
    /// leaves in the cache is never read.
    fn check_slot_buckets(&mut self) -> Result<()> {
        let full = self.plan.cache.local_slots();
        let groups = self.plan.cache.slot_groups();
        for chunks in self.plan.decode_chunk_counts(0) {
            // The buckets still kept: one dropped at a smaller chunk count is not probed again.
            let buckets: Vec<usize> = self
                .plan
                .slot_buckets()
                .iter()
                .copied()
                .filter(|&b| b < full)
                .collect();
            if buckets.is_empty() {
                break;
            }
            let reference = self.probe(full, chunks)?;
            for rows in buckets {
                let got = self.probe(rows, chunks)?;
                let same = got.iter().zip(&reference).all(|(got, reference)| {
                    (0..groups).all(|g| got[g * rows..(g + 1) * rows] == reference[g * full..g * full + rows])
                });
                if !same {
                    tracing::debug!(
                        rows,
                        chunks,
                        "slot bucket dropped: its step's last bits differ from the full step's"
                    );
                    self.plan.drop_slot_bucket(rows);
                    self.decode.retain(|k, _| k.rows != rows);
                }
            }
        }
        Ok(())
    }

    /// The (token, log-prob bits) of every row of each step of [`Engine::check_slot_buckets`]'s
    /// probe in the slot bucket of `rows` rows, reading `chunks` cache chunks.
    fn probe(&mut self, rows: usize, chunks: usize) -> Result<Vec<Vec<(i32, u32)>>> {
        let s = self.plan.cache.slot_groups() * rows;
        let key = DecodeKey {
            truncate: false,
            chunks,
            rows,
        };
        self.ensure_decode(key)?;
        let end = (chunks * self.plan.cache.chunk).min(self.plan.cache.max_len);
        let first = end.saturating_sub(PROBE_STEPS);
        let vocab = self.config.vocab_size;
        let mut tokens: Vec<i32> = (0..s).map(|i| ((i % rows * 7919 + 13) % vocab) as i32).collect();
        let mut steps = Vec::new();
        for step in 0..PROBE_STEPS.min(end) {
            let inputs = DecodeInputs {
                tokens: tokens.clone(),
                positions: vec![(first + step) as i32; s],
                temperature: vec![1.0; s],
                top_k: vec![0; s],
                top_p: vec![1.0; s],
                min_p: vec![0.0; s],
                keys: (0..s)
                    .flat_map(|i| draw_key(0x5eed, (i % rows) as u32, step as u32))
                    .collect(),
            };
            let weights = self.weights.args();
            let out =
                self.decode[&key].run_on(&self.client, &self.devices, &weights, &mut self.cache, &inputs)?;
            steps.push(
                out.tokens
                    .iter()
                    .copied()
                    .zip(out.logprobs.iter().map(|l| l.to_bits()))
                    .collect(),
            );
            tokens = out.tokens;
        }
        Ok(steps)
    }

    /// The KV-cache size in bytes (all devices together).
    pub fn kv_cache_bytes(&self) -> usize {
        self.plan.cache.bytes()
    }

    /// Devices the engine runs on (its slots are split over them).
    pub fn devices(&self) -> usize {
        self.devices.len()
    }

    /// The weights the engine generates with.
    pub fn weights(&self) -> &EngineWeights {
        &self.weights
    }

    /// The current weight version.
    pub fn weight_version(&self) -> u64 {
        self.version
    }

    /// Program-run and token counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Whether a step has something to do: requests waiting, samples being decoded, or
    /// samples finished by [`Engine::resume`] to return. Samples parked for their environment
    /// alone are not work: only a `resume` moves them.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.done.is_empty() || self.slots.iter().flatten().any(Active::decoding)
    }

    /// Number of samples holding a slot now (parked ones included).
    pub fn active_samples(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Number of multi-turn samples waiting for their environment.
    pub fn parked_samples(&self) -> usize {
        self.slots.iter().flatten().filter(|a| !a.decoding()).count()
    }

    /// Park multi-turn turns cut by a budget too (`MaxTurnTokens`, `MaxNewTokens`,
    /// `MaxModelLen`), so the environment ends every episode itself.
    pub fn set_park_cut_turns(&mut self, park: bool) {
        self.park_cut_turns = park;
    }

    /// The model turns that parked since the last call, for the environment to answer.
    pub fn take_turns(&mut self) -> Vec<Turn> {
        std::mem::take(&mut self.turns)
    }

    /// The multi-turn runs ended since the last call without finishing a sample: restarted by
    /// a weight update (a new run of the episode follows, with `restarts` one higher), or
    /// dropped over a refused [`Engine::resume`]. Their environment learns that no turn or
    /// sample of theirs will come ([`TurnHandler::on_abandoned`]).
    pub fn take_abandoned(&mut self) -> Vec<TurnId> {
        std::mem::take(&mut self.abandoned)
    }

    /// The environment's answer to a parked turn: continue the sample with its tokens (written
    /// into the sample's cache by the next step's extend run, so earlier turns are never
    /// prefilled again) or finish it. Returns false for a turn that is no longer parked (its sample was
    /// restarted by a weight update since; the answer is stale and dropped). Tokens outside
    /// the vocabulary drop the sample and are an error naming its request.
    pub fn resume(&mut self, id: TurnId, resume: Resume) -> Result<bool> {
        let Some(slot) = self
            .slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|a| a.id() == id && !a.decoding()))
        else {
            return Ok(false);
        };
        let a = self.slots[slot].as_mut().expect("found above");
        let (tokens, stats) = match resume {
            Resume::Continue { tokens, stats } => (tokens, stats),
            Resume::Finish { stats } => {
                a.episode.add(&stats);
                let reason = a.parked.take().expect("parked");
                self.finish(slot, reason, None);
                return Ok(true);
            }
        };
        a.episode.add(&stats);
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            self.slots[slot] = None;
            self.abandoned.push(id);
            return Err(RolloutError::Rejected {
                request_id: id.request_id,
                problem: format!(
                    "environment token id {bad} is outside the vocabulary (size {})",
                    self.config.vocab_size
                ),
            });
        }
        let len = a.response.len() + tokens.len();
        let limit = if tokens.is_empty() {
            Some(a.parked.take().expect("parked"))
        } else if len >= a.request.params.max_new_tokens {
            Some(FinishReason::MaxNewTokens)
        } else if a.request.prompt.len() + len >= self.settings.max_model_len {
            Some(FinishReason::MaxModelLen)
        } else {
            None
        };
        if let Some(reason) = limit {
            self.finish(slot, reason, None);
            return Ok(true);
        }
        a.parked = None;
        a.env_spans.push(a.response.len()..len);
        a.logprobs.resize(len, 0.0);
        a.response.extend_from_slice(&tokens);
        a.feed.extend(tokens);
        a.turn_start = len;
        Ok(true)
    }

    /// Frees `slot` and queues its sample for the next step's output.
    fn finish(&mut self, slot: usize, finish_reason: FinishReason, text: Option<String>) {
        let a = self.slots[slot].take().expect("slot is active");
        let text = text.unwrap_or_else(|| self.decode_text(&a.response));
        let episode = a.episode;
        self.done.push(Sample {
            request_id: a.request.id,
            sample_index: a.sample_index,
            prompt_ids: a.request.prompt.clone(),
            response_ids: a.response,
            text,
            logprobs: a.logprobs,
            finish_reason,
            weight_version: self.version,
            restarts: a.restarts,
            env_spans: a.env_spans,
            episode,
            routes: a.routes,
        });
    }

    /// Queues a request. A request that can never be served (empty or too long prompt, `n`
    /// of 0 or more than `max_num_seqs`, bad sampling parameters, token ids outside the
    /// vocabulary) is rejected here with an error naming it; the engine state is unchanged.
    pub fn submit(&mut self, request: GenerationRequest) -> Result<()> {
        let reject = |problem: String| RolloutError::Rejected {
            request_id: request.id,
            problem,
        };
        if request.prompt.is_empty() {
            return Err(reject("the prompt has no tokens".into()));
        }
        if request.prompt.len() >= self.settings.max_model_len {
            return Err(reject(format!(
                "the prompt has {} tokens; the maximum model length {} leaves no room for a response (raise rollout max_model_len or shorten the prompt)",
                request.prompt.len(),
                self.settings.max_model_len
            )));
        }
        if request.n == 0 || request.n > self.settings.max_num_seqs {
            return Err(reject(format!(
                "n = {} samples; must be 1 to max_num_seqs ({})",
                request.n, self.settings.max_num_seqs
            )));
        }
        if let Some(&bad) = request
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(reject(format!(
                "prompt token id {bad} is outside the vocabulary (size {})",
                self.config.vocab_size
            )));
        }
        request.params.validate().map_err(&reject)?;
        if !request.params.stop_strings.is_empty() && self.tokenizer.is_none() {
            return Err(reject(
                "stop strings need a tokenizer; this engine has none".into(),
            ));
        }
        let n = request.n;
        self.waiting.push_back(Pending {
            request: Arc::new(request),
            sample_indices: (0..n).collect(),
            restarts: 0,
        });
        Ok(())
    }

    /// Installs new weights (device buffers in [`param_table`] order, same dtype, shapes and
    /// devices; used in place, not copied) as `version`, between steps and without
    /// recompiling. An engine applying adapters may be given adapters alone
    /// ([`EngineWeights::adapters_only`]): it keeps its weights and takes those beside them.
    /// Samples in flight are restarted on the new weights (see the module comment). Returns
    /// how many samples were restarted. The old buffers are dropped.
    pub fn update_weights(&mut self, version: u64, weights: impl Into<EngineWeights>) -> Result<usize> {
        let mut weights = weights.into();
        if weights.tensor_parallel() != self.plan.cache.tensor_parallel {
            return Err(RolloutError::Config(format!(
                "weight update {version}: laid out for a tensor-parallel size of {}, the engine runs {}",
                weights.tensor_parallel(),
                self.plan.cache.tensor_parallel
            )));
        }
        if weights.is_adapters_only() && self.settings.adapters.is_some() {
            weights = self.weights.with_adapters(weights.adapters().to_vec());
        }
        check_layout(
            &self.config,
            self.settings.adapters.as_ref(),
            &weights,
            Some(self.dtype),
            &self.devices,
            version,
        )?;
        self.weights = weights;
        self.version = version;
        // Regroup in-flight samples by request, keeping slot order, and put them first.
        let mut groups: Vec<Pending> = Vec::new();
        for slot in self.slots.iter_mut() {
            if let Some(a) = slot.take() {
                if a.request.multi_turn.is_some() {
                    self.abandoned.push(a.id());
                }
                match groups.iter_mut().find(|g| Arc::ptr_eq(&g.request, &a.request)) {
                    Some(g) => g.sample_indices.push(a.sample_index),
                    None => groups.push(Pending {
                        request: a.request,
                        sample_indices: vec![a.sample_index],
                        restarts: a.restarts + 1,
                    }),
                }
            }
        }
        let restarted = groups.iter().map(|g| g.sample_indices.len()).sum();
        self.stats.restarted_samples += restarted;
        for g in groups.into_iter().rev() {
            self.waiting.push_front(g);
        }
        tracing::info!(version, restarted, "rollout weights updated");
        Ok(restarted)
    }

    fn ensure_prefill(&mut self, key: PrefillKey) -> Result<()> {
        if !self.prefill.contains_key(&key) {
            let started = Instant::now();
            let p = PrefillFanout::compile_batched(
                &self.client,
                &self.config,
                self.dtype,
                &self.plan.cache,
                key.bucket,
                key.width,
                key.batch,
            )?;
            tracing::info!(
                bucket = key.bucket,
                width = key.width,
                batch = key.batch,
                "compiled prefill in {:.2} s",
                started.elapsed().as_secs_f64()
            );
            self.prefill.insert(key, p);
        }
        Ok(())
    }

    fn ensure_decode(&mut self, key: DecodeKey) -> Result<()> {
        if !self.decode.contains_key(&key) {
            let started = Instant::now();
            let program = DecodeSample::compile_step(
                &self.client,
                &self.config,
                self.dtype,
                &self.plan.cache,
                key,
                self.settings.sampler,
            )?;
            tracing::info!(
                truncate = key.truncate,
                chunks = key.chunks,
                rows = key.rows,
                "compiled a decode step in {:.2} s",
                started.elapsed().as_secs_f64()
            );
            self.decode.insert(key, program);
        }
        Ok(())
    }

    /// Compiles up front what requests with prompts of `prompt_len` tokens in groups of `n`
    /// will need ([`ProgramPlan::request_programs`]), so the first such requests do not wait
    /// for a compile.
    pub fn precompile(&mut self, prompt_len: usize, n: usize, truncating: bool) -> Result<()> {
        let (prefills, decodes) = self.plan.request_programs(prompt_len, n, truncating);
        for key in prefills {
            self.ensure_prefill(key)?;
        }
        for key in decodes {
            self.ensure_decode(key)?;
        }
        self.ensure_moves()
    }

    fn ensure_extend(&mut self, len: usize) -> Result<()> {
        if !self.extend.contains_key(&len) {
            let started = Instant::now();
            let program = EnvExtend::compile(&self.client, &self.config, self.dtype, &self.plan.cache, len)?;
            tracing::info!(
                len,
                "compiled an extend program in {:.2} s",
                started.elapsed().as_secs_f64()
            );
            self.extend.insert(len, program);
        }
        Ok(())
    }

    /// Writes each resumed sample's environment tokens into its slot: `next_token` (the
    /// end of the model's turn, not yet in the cache) and all but the last environment token,
    /// in one extend run; the last is the input of the sample's next decode row.
    fn extend_resumed(&mut self) -> Result<()> {
        let runs = self.stats.extend_runs;
        let mut spent = std::time::Duration::ZERO;
        for slot in 0..self.slots.len() {
            let Some(a) = self.slots[slot].as_mut().filter(|a| !a.feed.is_empty()) else {
                continue;
            };
            let feed = std::mem::take(&mut a.feed);
            let (&last, before) = feed.split_last().expect("checked non-empty");
            let mut tokens = Vec::with_capacity(feed.len());
            tokens.push(a.next_token);
            tokens.extend_from_slice(before);
            let start = a.position;
            a.next_token = last;
            a.position += tokens.len();
            let len = self.plan.extend_bucket(tokens.len());
            self.ensure_extend(len)?;
            let started = Instant::now();
            let weights = self.weights.args();
            let routes = self.extend[&len].run_on(
                &self.client,
                &self.devices,
                &weights,
                &mut self.cache,
                &tokens,
                (slot, start),
            )?;
            if let (Some(routes), Some(a)) = (routes, self.slots[slot].as_mut()) {
                a.routes.extend(routes);
            }
            spent += started.elapsed();
            self.stats.extend_runs += 1;
            self.stats.env_tokens += tokens.len();
        }
        if self.stats.extend_runs > runs {
            let started = Instant::now();
            // Runs are asynchronous: wait for the cache so the time is the extends' own.
            for last in self.cache.iter().filter_map(|c| c.last()) {
                last.block_until_ready()
                    .map_err(|e| RolloutError::runtime("waiting for an extend", e))?;
            }
            self.stats.extend_time += spent + started.elapsed();
        }
        Ok(())
    }

    /// Compiles the slot moves when the engine has more than one slot bucket.
    fn ensure_moves(&mut self) -> Result<()> {
        if self.moves.is_none() && self.plan.slot_buckets().len() > 1 {
            let started = Instant::now();
            self.moves = Some(SlotMoves::compile(&self.client, &self.plan.cache, MOVES_PER_RUN)?);
            tracing::info!(
                "compiled the slot moves in {:.2} s",
                started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }

    /// Admits waiting requests in FIFO order while their groups fit in the free slots. Runs
    /// of consecutive groups with the same prefill program (bucket and fan-out width) are
    /// prefilled [`EngineConfig::prefill_batch`] at a time; the rest one at a time.
    fn admit(&mut self) -> Result<()> {
        loop {
            let free = self.free_slots();
            let Some(front) = self.waiting.front() else {
                return Ok(());
            };
            if front.sample_indices.len() > free.len() {
                return Ok(());
            }
            let key = self
                .plan
                .prefill(front.request.prompt.len(), front.sample_indices.len(), 1);
            let batch = self.plan.prefill_batch(key.width);
            let mut taken: Vec<Pending> = Vec::new();
            let mut used = 0;
            while taken.len() < batch {
                let Some(next) = self.waiting.front() else { break };
                let n = next.sample_indices.len();
                if used + n > free.len() || self.plan.prefill(next.request.prompt.len(), n, 1) != key {
                    break;
                }
                used += n;
                taken.push(self.waiting.pop_front().expect("checked non-empty"));
            }
            let mut offset = 0;
            let placed: Vec<(Pending, Vec<usize>)> = taken
                .into_iter()
                .map(|p| {
                    let slots = free[offset..offset + p.sample_indices.len()].to_vec();
                    offset += slots.len();
                    (p, slots)
                })
                .collect();
            let started = Instant::now();
            let held = self.weights.clone();
            let weights = held.args();
            let mut prompt_routes: Vec<Option<Vec<u8>>> = Vec::new();
            if placed.len() == batch && batch > 1 {
                let key = PrefillKey { batch, ..key };
                self.ensure_prefill(key)?;
                let prompts: Vec<(&[u32], &[usize])> = placed
                    .iter()
                    .map(|(p, slots)| {
                        let prompt = &p.request.prompt;
                        (&prompt[..prompt.len() - 1], slots.as_slice())
                    })
                    .collect();
                let routes = self.prefill[&key].run_batch_on(
                    &self.client,
                    &self.devices,
                    &weights,
                    &mut self.cache,
                    &prompts,
                )?;
                prompt_routes = match routes {
                    Some(r) => r.into_iter().map(Some).collect(),
                    None => vec![None; placed.len()],
                };
                self.stats.prefill_batches += 1;
            } else {
                self.ensure_prefill(key)?;
                for (p, slots) in &placed {
                    let prompt = &p.request.prompt;
                    let routes = self.prefill[&key].run_batch_on(
                        &self.client,
                        &self.devices,
                        &weights,
                        &mut self.cache,
                        &[(&prompt[..prompt.len() - 1], slots.as_slice())],
                    )?;
                    prompt_routes.push(routes.and_then(|r| r.into_iter().next()));
                    self.stats.prefill_batches += 1;
                }
            }
            // Runs are asynchronous: wait for the cache so the time is the prefill's own.
            for last in self.cache.iter().filter_map(|c| c.last()) {
                last.block_until_ready()
                    .map_err(|e| RolloutError::runtime("waiting for a prefill", e))?;
            }
            self.stats.prefill_time += started.elapsed();
            for ((pending, chosen), routes) in placed.into_iter().zip(prompt_routes) {
                self.stats.prefill_runs += 1;
                let prompt = &pending.request.prompt;
                let routes = routes.unwrap_or_default();
                for (&slot, &sample_index) in chosen.iter().zip(&pending.sample_indices) {
                    self.slots[slot] = Some(Active {
                        request: pending.request.clone(),
                        sample_index,
                        response: Vec::new(),
                        logprobs: Vec::new(),
                        next_token: prompt[prompt.len() - 1],
                        position: prompt.len() - 1,
                        restarts: pending.restarts,
                        turn_start: 0,
                        parked: None,
                        feed: Vec::new(),
                        env_spans: Vec::new(),
                        episode: EpisodeStats::default(),
                        routes: routes.clone(),
                    });
                }
            }
        }
    }

    /// The free slots in the order admission takes them: each next one the lowest free row of
    /// the slot group with the fewest samples (live or taken before it), so samples spread
    /// over the groups and stay in the lowest rows (the smallest slot buckets).
    fn free_slots(&self) -> Vec<usize> {
        let local = self.plan.cache.local_slots();
        let groups = self.plan.cache.slot_groups();
        let mut free: Vec<VecDeque<usize>> = (0..groups)
            .map(|g| {
                (g * local..(g + 1) * local)
                    .filter(|&s| self.slots[s].is_none())
                    .collect()
            })
            .collect();
        let mut load: Vec<usize> = free.iter().map(|f| local - f.len()).collect();
        let mut order = Vec::new();
        while let Some(g) = (0..groups)
            .filter(|&g| !free[g].is_empty())
            .min_by_key(|&g| load[g])
        {
            order.push(free[g].pop_front().expect("checked non-empty"));
            load[g] += 1;
        }
        order
    }

    /// Moves live samples down into free lower rows when that lets a smaller slot bucket hold
    /// them (see the module comment); returns the bucket the next decode step runs.
    fn compact(&mut self) -> Result<usize> {
        let local = self.plan.cache.local_slots();
        let groups = self.plan.cache.slot_groups();
        let live = |g: usize| (g * local..(g + 1) * local).filter(|&s| self.slots[s].is_some());
        let highest = (0..groups)
            .filter_map(|g| live(g).next_back().map(|s| s - g * local + 1))
            .max()
            .unwrap_or(1);
        let needed = self.plan.slot_bucket(highest);
        let most = (0..groups).map(|g| live(g).count()).max().unwrap_or(1);
        let target = self.plan.slot_bucket(most);
        if target >= needed {
            return Ok(needed);
        }
        // Per group: live rows at or above the target into free rows below it, lowest first.
        let moves: Vec<Vec<(usize, usize)>> = (0..groups)
            .map(|g| {
                let row = |s: usize| s - g * local;
                let movers = live(g).map(row).filter(|&r| r >= target);
                let holes = (0..target).filter(|&r| self.slots[g * local + r].is_none());
                movers.zip(holes).collect()
            })
            .collect();
        self.ensure_moves()?;
        let program = self.moves.as_ref().expect("compiled above");
        let rounds = moves
            .iter()
            .map(Vec::len)
            .max()
            .unwrap_or(0)
            .div_ceil(MOVES_PER_RUN);
        for round in 0..rounds {
            let part: Vec<Vec<(usize, usize)>> = moves
                .iter()
                .map(|m| {
                    m.iter()
                        .skip(round * MOVES_PER_RUN)
                        .take(MOVES_PER_RUN)
                        .copied()
                        .collect()
                })
                .collect();
            program.run_on(&self.client, &self.devices, &mut self.cache, &part)?;
        }
        for (g, pairs) in moves.iter().enumerate() {
            for &(from, to) in pairs {
                self.slots[g * local + to] = self.slots[g * local + from].take();
                self.stats.moved_rows += 1;
            }
        }
        Ok(target)
    }

    /// One scheduling step: admits waiting requests into free slots (prefill + fan-out), runs
    /// one decode step over the active slots' bucket, and returns the samples that finished.
    pub fn step(&mut self) -> Result<Vec<Sample>> {
        let started = Instant::now();
        let result = self.step_inner();
        self.stats.step_time += started.elapsed();
        result
    }

    fn step_inner(&mut self) -> Result<Vec<Sample>> {
        self.admit()?;
        self.extend_resumed()?;
        if !self.slots.iter().flatten().any(Active::decoding) {
            return Ok(std::mem::take(&mut self.done));
        }
        let rows = self.compact()?;
        // Row j of the step is row j % rows of slot group j / rows.
        let local = self.plan.cache.local_slots();
        let order: Vec<usize> = (0..self.plan.cache.slot_groups())
            .flat_map(|g| g * local..g * local + rows)
            .collect();
        let s = order.len();
        let mut inputs = DecodeInputs {
            tokens: vec![0; s],
            positions: vec![-1; s],
            temperature: vec![0.0; s],
            top_k: vec![0; s],
            top_p: vec![1.0; s],
            min_p: vec![0.0; s],
            keys: vec![0; 2 * s],
        };
        let mut truncate = false;
        let mut highest = 0;
        for (i, &slot) in order.iter().enumerate() {
            if let Some(a) = self.slots[slot].as_ref().filter(|a| a.decoding()) {
                highest = highest.max(a.position);
                let p = &a.request.params;
                inputs.tokens[i] = a.next_token as i32;
                inputs.positions[i] = a.position as i32;
                inputs.temperature[i] = p.temperature;
                inputs.top_k[i] = p.top_k.min(i32::MAX as usize) as i32;
                inputs.top_p[i] = p.top_p;
                inputs.min_p[i] = p.min_p;
                let key = draw_key(a.request.seed, a.sample_index as u32, a.response.len() as u32);
                inputs.keys[2 * i] = key[0];
                inputs.keys[2 * i + 1] = key[1];
                truncate |= p.needs_truncation();
            }
        }
        let key = DecodeKey {
            truncate,
            chunks: self.plan.decode_chunks(highest),
            rows,
        };
        self.ensure_decode(key)?;
        let program = &self.decode[&key];
        let started = Instant::now();
        let weights = self.weights.args();
        let out = program.run_on(&self.client, &self.devices, &weights, &mut self.cache, &inputs)?;
        let (next, logprobs) = (&out.tokens, &out.logprobs);
        let per_row = out.routes.as_ref().map_or(0, |r| r.len() / s.max(1));
        self.stats.decode_time += started.elapsed();
        self.stats.decode_steps += 1;
        self.stats.decode_rows += s;
        for (j, &i) in order.iter().enumerate() {
            let Some(a) = self.slots[i].as_mut().filter(|a| a.decoding()) else {
                continue;
            };
            if let Some(routes) = &out.routes {
                // The experts of the row's input token, at `a.position`.
                a.routes
                    .extend_from_slice(&routes[j * per_row..(j + 1) * per_row]);
            }
            let token = next[j] as u32;
            a.response.push(token);
            a.logprobs.push(logprobs[j]);
            self.stats.generated_tokens += 1;
            let p = &a.request.params;
            let mut text = None;
            let stopped = p.stop_token_ids.contains(&token) || self.settings.eos_token_ids.contains(&token);
            let reason = if stopped {
                Some(FinishReason::Eos(token))
            } else if let Some((stop, cut)) = find_stop_string(self.tokenizer.as_ref(), a) {
                text = Some(cut);
                Some(FinishReason::StopString(stop))
            } else if a.response.len() >= p.max_new_tokens {
                Some(FinishReason::MaxNewTokens)
            } else if a.request.prompt.len() + a.response.len() >= self.settings.max_model_len {
                Some(FinishReason::MaxModelLen)
            } else if a
                .request
                .multi_turn
                .as_ref()
                .is_some_and(|t| a.response.len() - a.turn_start >= t.max_turn_tokens)
            {
                Some(FinishReason::MaxTurnTokens)
            } else {
                None
            };
            a.next_token = token;
            a.position += 1;
            match reason {
                None => {}
                // A multi-turn sample's turn ended by the model (or by a budget, when the
                // environment ends episodes itself): the environment decides.
                Some(reason)
                    if a.request.multi_turn.is_some()
                        && (stopped || (self.park_cut_turns && text.is_none())) =>
                {
                    a.parked = Some(reason.clone());
                    a.episode.turns += 1;
                    self.turns.push(Turn {
                        id: a.id(),
                        request: a.request.clone(),
                        response: a.response.clone(),
                        turn: a.turn_start..a.response.len(),
                        logprobs: a.logprobs[a.turn_start..].to_vec(),
                        reason,
                        turns: a.episode.turns,
                        user_turns: a.episode.user_turns,
                    });
                }
                Some(reason) => {
                    a.episode.turns += 1;
                    self.finish(i, reason, text);
                }
            }
        }
        Ok(std::mem::take(&mut self.done))
    }

    fn decode_text(&self, ids: &[u32]) -> String {
        decode_text(self.tokenizer.as_ref(), ids)
    }

    /// Steps until no request is waiting or active; returns every finished sample in order.
    pub fn run_to_completion(&mut self) -> Result<Vec<Sample>> {
        let mut all = Vec::new();
        while self.has_work() {
            all.extend(self.step()?);
        }
        Ok(all)
    }
}

/// The response text of `ids` (special tokens skipped); empty without a tokenizer.
fn decode_text(tokenizer: Option<&ModelTokenizer>, ids: &[u32]) -> String {
    match tokenizer {
        Some(t) => t.decode(ids, true).unwrap_or_default(),
        None => String::new(),
    }
}

/// The first stop string in the text of `a`'s current turn (its whole response when single
/// turn) and the response text before it.
fn find_stop_string(tokenizer: Option<&ModelTokenizer>, a: &Active) -> Option<(String, String)> {
    if a.request.params.stop_strings.is_empty() {
        return None;
    }
    let text = decode_text(tokenizer, &a.response[a.turn_start..]);
    let (at, stop) = a
        .request
        .params
        .stop_strings
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|at| (at, s)))
        .min_by_key(|(at, _)| *at)?;
    let before = match a.turn_start {
        0 => String::new(),
        t => decode_text(tokenizer, &a.response[..t]),
    };
    Some((stop.clone(), before + &text[..at]))
}
