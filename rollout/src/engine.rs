//! The continuous-batching engine: requests (prompt ids, sampling parameters, group size `n`,
//! seed) wait in a FIFO queue; a request is admitted when `n` KV-cache slots are free, its
//! prompt is prefilled once (in a length bucket) and copied into its `n` slots on the device;
//! then one compiled decode-and-sample step advances every active slot (inactive slots are
//! masked). A finished sample frees its slot at once and the next waiting request takes it at
//! the next step.
//!
//! Each group is prefilled by its own program run by default. Requests waiting at the same
//! time with the same prefill program can be prefilled several at a time
//! ([`EngineConfig::prefill_batch`]), which saves ~9% of prefill CPU but gives a prompt's KV
//! entries last-bit differences that depend on its batch-mates: a sampled token near a CDF
//! boundary can then differ from the same request run alone, so it is off by default (the
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
//! Weight hot-swap ([`Engine::update_weights`]) happens between steps without recompiling.
//! Policy: samples in flight are **restarted** from their prompt on the new weights (their
//! partial tokens are dropped, their slots re-prefilled), so every sample is produced by
//! exactly one weight version, recorded in [`Sample::weight_version`]; [`Sample::restarts`]
//! says how many times a sample was restarted. Samples finished before the swap keep the old
//! version. A restarted sample draws the same keys, so it equals a fresh request on the new
//! weights with the same seed.
//!
//! Several devices: weights with one replica per device ([`EngineWeights`], devices `0..N`)
//! make an engine whose programs run SPMD over a one-axis mesh of those devices, data
//! parallel over the slots: the KV cache and every per-slot tensor are split into `N`
//! contiguous blocks of slots (`max_num_seqs` must divide by `N`), the parameters are
//! replicated. Scheduling, keys and stop rules are the same as on one device, and each slot's
//! arithmetic is the single-device program's, so the same requests give the same tokens.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use model::forward::DecodeOptions;
use model::{param_table, ModelConfig, ModelTokenizer, ModelWeights};
use xla::runtime::{Buffer, Client};
use xla::DType;

use crate::error::{Result, RolloutError};
use crate::programs::{CacheShape, DecodeInputs, DecodeSample, PrefillFanout};
use crate::sampling::{draw_key, SamplerKind, SamplingParams};
use crate::weights::EngineWeights;

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
    /// docs); more saves ~9% of prefill CPU at the cost of that reproducibility.
    pub prefill_batch: usize,
    /// The on-device sampler.
    pub sampler: SamplerKind,
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
    /// Sampling parameters and stop rules.
    pub params: SamplingParams,
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
        }
    }
}

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
}

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
    next_token: u32,
    position: usize,
    restarts: u32,
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
    buckets: Vec<usize>,
    cache_shape: CacheShape,
    /// `[device][tensor]`: each device's block of slots.
    cache: Vec<Vec<Buffer>>,
    tokenizer: Option<ModelTokenizer>,
    prefill: HashMap<(usize, usize, usize), PrefillFanout>,
    /// Decode steps by (top-k/top-p, cache chunks read).
    decode: HashMap<(bool, usize), DecodeSample>,
    waiting: VecDeque<Pending>,
    slots: Vec<Option<Active>>,
    stats: EngineStats,
}

/// Uploads `weights` (every [`param_table`] tensor) to `device` as `dtype` (F32 or BF16).
pub fn upload_weights(
    client: &Client,
    weights: &ModelWeights,
    dtype: DType,
    device: usize,
) -> Result<Vec<Buffer>> {
    param_table(&weights.config)
        .iter()
        .enumerate()
        .map(|(index, spec)| {
            let bad = |problem: String| RolloutError::Weights {
                version: 0,
                index,
                name: spec.name.clone(),
                problem,
            };
            let t = weights
                .get(&spec.name)
                .ok_or_else(|| bad("missing from the checkpoint".into()))?;
            if t.shape != spec.shape {
                return Err(bad(format!(
                    "expected shape {:?}, found {:?}",
                    spec.shape, t.shape
                )));
            }
            let dims: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
            let values = t.to_f32_vec();
            let action = format!("uploading `{}`", spec.name);
            match dtype {
                DType::F32 => client.buffer_from_host(&values, &dims, device),
                DType::BF16 => {
                    let v: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    client.buffer_from_host(&v, &dims, device)
                }
                other => {
                    return Err(bad(format!(
                        "weights can be f32 or bf16 on the device, not {other}"
                    )))
                }
            }
            .map_err(|e| RolloutError::runtime(action, e))
        })
        .collect()
}

/// Checks every replica of `weights` against the parameter table and its device in
/// `devices`; returns the weights' dtype.
fn check_replicas(
    config: &ModelConfig,
    weights: &EngineWeights,
    dtype: Option<DType>,
    devices: &[usize],
    version: u64,
) -> Result<DType> {
    if weights.devices() != devices.len() {
        return Err(RolloutError::Weights {
            version,
            index: 0,
            name: param_table(config)
                .first()
                .map(|s| s.name.clone())
                .unwrap_or_default(),
            problem: format!(
                "replicas for {} device(s) were given; the engine runs on {} ({devices:?})",
                weights.devices(),
                devices.len()
            ),
        });
    }
    let mut want = dtype;
    for (replica, &device) in weights.replicas().iter().zip(devices) {
        want = Some(check_weights(config, replica, want, device, version)?);
    }
    Ok(want.unwrap_or(DType::F32))
}

fn check_weights(
    config: &ModelConfig,
    weights: &[Buffer],
    dtype: Option<DType>,
    device: usize,
    version: u64,
) -> Result<DType> {
    let table = param_table(config);
    if weights.len() != table.len() {
        return Err(RolloutError::Weights {
            version,
            index: weights.len().min(table.len()),
            name: table
                .get(weights.len())
                .map(|s| s.name.clone())
                .unwrap_or_default(),
            problem: format!(
                "the parameter table has {} tensors, {} buffers were given",
                table.len(),
                weights.len()
            ),
        });
    }
    let want = dtype.unwrap_or_else(|| weights.first().map(|b| b.dtype()).unwrap_or(DType::F32));
    for (index, (spec, b)) in table.iter().zip(weights).enumerate() {
        let dims: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
        let problem = if b.dims() != dims.as_slice() {
            Some(format!("expected shape {:?}, found {:?}", dims, b.dims()))
        } else if b.dtype() != want {
            Some(format!(
                "expected {want} (the compiled programs' weight type; a different type needs a new engine), found {}",
                b.dtype()
            ))
        } else if b.device() != device {
            Some(format!(
                "on device {}, the engine runs on device {device}",
                b.device()
            ))
        } else if b.is_donated() {
            Some("the buffer was donated to another program and no longer holds data".to_string())
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(RolloutError::Weights {
                version,
                index,
                name: spec.name.clone(),
                problem,
            });
        }
    }
    Ok(want)
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
        let dtype = check_replicas(config, &weights, None, &devices, version)?;
        let cache_shape = CacheShape::chunked(
            config,
            settings.max_num_seqs,
            settings.max_model_len,
            settings.effective_kv_chunk(),
        )
        .on_devices(devices.len())
        .for_weights(dtype);
        cache_shape.check_devices()?;
        tracing::info!(
            devices = devices.len(),
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
            buckets,
            cache_shape,
            cache,
            tokenizer,
            prefill: HashMap::new(),
            decode: HashMap::new(),
            waiting: VecDeque::new(),
            stats: EngineStats::default(),
        };
        let all = engine.cache_shape.chunks();
        engine.ensure_decode(false, all)?;
        Ok(engine)
    }

    /// The KV-cache size in bytes (all devices together).
    pub fn kv_cache_bytes(&self) -> usize {
        self.cache_shape.bytes()
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

    /// Whether requests are waiting or samples are being decoded.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || self.slots.iter().any(|s| s.is_some())
    }

    /// Number of samples being decoded now.
    pub fn active_samples(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
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
    /// recompiling. Samples in flight are restarted on the new weights (see the module
    /// comment). Returns how many samples were restarted. The old buffers are dropped.
    pub fn update_weights(&mut self, version: u64, weights: impl Into<EngineWeights>) -> Result<usize> {
        let weights = weights.into();
        check_replicas(&self.config, &weights, Some(self.dtype), &self.devices, version)?;
        self.weights = weights;
        self.version = version;
        // Regroup in-flight samples by request, keeping slot order, and put them first.
        let mut groups: Vec<Pending> = Vec::new();
        for slot in self.slots.iter_mut() {
            if let Some(a) = slot.take() {
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

    /// The (bucket, fan-out width) of the prefill program for a prompt of `prompt_len` tokens
    /// shared by `n` samples.
    fn prefill_key(&self, prompt_len: usize, n: usize) -> (usize, usize) {
        let head = prompt_len.saturating_sub(1).max(1);
        let bucket = self
            .buckets
            .iter()
            .copied()
            .find(|&b| b >= head)
            .unwrap_or_else(|| *self.buckets.last().expect("at least one bucket"));
        (bucket, n.next_power_of_two().min(self.settings.max_num_seqs))
    }

    fn ensure_prefill(&mut self, bucket: usize, width: usize, batch: usize) -> Result<()> {
        if !self.prefill.contains_key(&(bucket, width, batch)) {
            let started = Instant::now();
            let p = PrefillFanout::compile_batched(
                &self.client,
                &self.config,
                self.dtype,
                &self.cache_shape,
                bucket,
                width,
                batch,
            )?;
            tracing::info!(
                bucket,
                width,
                batch,
                "compiled prefill in {:.2} s",
                started.elapsed().as_secs_f64()
            );
            self.prefill.insert((bucket, width, batch), p);
        }
        Ok(())
    }

    fn decode_chunks(&self, position: usize) -> usize {
        self.cache_shape.decode_chunks(position)
    }

    fn ensure_decode(&mut self, truncate: bool, chunks: usize) -> Result<()> {
        if !self.decode.contains_key(&(truncate, chunks)) {
            let started = Instant::now();
            let program = if self.cache_shape.chunks() == 1 {
                DecodeSample::compile_with(
                    &self.client,
                    &self.config,
                    self.dtype,
                    &self.cache_shape,
                    truncate,
                    DecodeOptions::default(),
                    self.settings.sampler,
                )?
            } else {
                DecodeSample::compile_chunked(
                    &self.client,
                    &self.config,
                    self.dtype,
                    &self.cache_shape,
                    truncate,
                    chunks,
                    self.settings.sampler,
                )?
            };
            tracing::info!(
                truncate,
                chunks,
                "compiled a decode step in {:.2} s",
                started.elapsed().as_secs_f64()
            );
            self.decode.insert((truncate, chunks), program);
        }
        Ok(())
    }

    /// Compiles up front what requests with prompts of `prompt_len` tokens in groups of `n`
    /// will need (their prefill bucket and fan-out width, single and batched; the decode steps
    /// for every cache length from the prompt's to the longest; the top-k/top-p variants when
    /// `truncating`), so the first such requests do not wait for a compile.
    pub fn precompile(&mut self, prompt_len: usize, n: usize, truncating: bool) -> Result<()> {
        let (bucket, width) = self.prefill_key(prompt_len, n.clamp(1, self.settings.max_num_seqs));
        self.ensure_prefill(bucket, width, 1)?;
        if self.settings.prefill_batch > 1 && self.settings.max_num_seqs >= 2 * width {
            self.ensure_prefill(bucket, width, self.prefill_batch_size(width))?;
        }
        let mut chunks = self.decode_chunks(prompt_len.saturating_sub(1));
        loop {
            self.ensure_decode(false, chunks)?;
            if truncating {
                self.ensure_decode(true, chunks)?;
            }
            if chunks >= self.cache_shape.chunks() {
                return Ok(());
            }
            chunks = self.decode_chunks(chunks * self.cache_shape.chunk);
        }
    }

    /// Groups per batched prefill run for groups of fan-out `width`.
    fn prefill_batch_size(&self, width: usize) -> usize {
        self.settings
            .prefill_batch
            .min(self.settings.max_num_seqs / width.max(1))
            .max(1)
    }

    /// Admits waiting requests in FIFO order while their groups fit in the free slots. Runs
    /// of consecutive groups with the same prefill program (bucket and fan-out width) are
    /// prefilled [`EngineConfig::prefill_batch`] at a time; the rest one at a time.
    fn admit(&mut self) -> Result<()> {
        loop {
            let free: Vec<usize> = (0..self.slots.len())
                .filter(|&s| self.slots[s].is_none())
                .collect();
            let Some(front) = self.waiting.front() else {
                return Ok(());
            };
            if front.sample_indices.len() > free.len() {
                return Ok(());
            }
            let key = self.prefill_key(front.request.prompt.len(), front.sample_indices.len());
            let batch = self.prefill_batch_size(key.1);
            let mut taken: Vec<Pending> = Vec::new();
            let mut used = 0;
            while taken.len() < batch {
                let Some(next) = self.waiting.front() else { break };
                let n = next.sample_indices.len();
                if used + n > free.len() || self.prefill_key(next.request.prompt.len(), n) != key {
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
            let (bucket, width) = key;
            let started = Instant::now();
            let replicas = self.weights.clone();
            let weights: Vec<&[Buffer]> = replicas.replicas().iter().map(|r| &r[..]).collect();
            if placed.len() == batch && batch > 1 {
                self.ensure_prefill(bucket, width, batch)?;
                let prompts: Vec<(&[u32], &[usize])> = placed
                    .iter()
                    .map(|(p, slots)| {
                        let prompt = &p.request.prompt;
                        (&prompt[..prompt.len() - 1], slots.as_slice())
                    })
                    .collect();
                self.prefill[&(bucket, width, batch)].run_batch_on(
                    &self.client,
                    &self.devices,
                    &weights,
                    &mut self.cache,
                    &prompts,
                )?;
                self.stats.prefill_batches += 1;
            } else {
                self.ensure_prefill(bucket, width, 1)?;
                for (p, slots) in &placed {
                    let prompt = &p.request.prompt;
                    self.prefill[&(bucket, width, 1)].run_batch_on(
                        &self.client,
                        &self.devices,
                        &weights,
                        &mut self.cache,
                        &[(&prompt[..prompt.len() - 1], slots.as_slice())],
                    )?;
                    self.stats.prefill_batches += 1;
                }
            }
            // Runs are asynchronous: wait for the cache so the time is the prefill's own.
            for last in self.cache.iter().filter_map(|c| c.last()) {
                last.block_until_ready()
                    .map_err(|e| RolloutError::runtime("waiting for a prefill", e))?;
            }
            self.stats.prefill_time += started.elapsed();
            for (pending, chosen) in placed {
                self.stats.prefill_runs += 1;
                let prompt = &pending.request.prompt;
                for (&slot, &sample_index) in chosen.iter().zip(&pending.sample_indices) {
                    self.slots[slot] = Some(Active {
                        request: pending.request.clone(),
                        sample_index,
                        response: Vec::new(),
                        logprobs: Vec::new(),
                        next_token: prompt[prompt.len() - 1],
                        position: prompt.len() - 1,
                        restarts: pending.restarts,
                    });
                }
            }
        }
    }

    /// One scheduling step: admits waiting requests into free slots (prefill + fan-out), runs
    /// one decode step over all active slots, and returns the samples that finished.
    pub fn step(&mut self) -> Result<Vec<Sample>> {
        let started = Instant::now();
        let result = self.step_inner();
        self.stats.step_time += started.elapsed();
        result
    }

    fn step_inner(&mut self) -> Result<Vec<Sample>> {
        self.admit()?;
        let s = self.settings.max_num_seqs;
        if self.slots.iter().all(|a| a.is_none()) {
            return Ok(Vec::new());
        }
        let mut inputs = DecodeInputs {
            tokens: vec![0; s],
            positions: vec![-1; s],
            temperature: vec![0.0; s],
            top_k: vec![0; s],
            top_p: vec![1.0; s],
            keys: vec![0; 2 * s],
        };
        let mut truncate = false;
        let mut highest = 0;
        for (i, a) in self.slots.iter().enumerate() {
            if let Some(a) = a {
                highest = highest.max(a.position);
                let p = &a.request.params;
                inputs.tokens[i] = a.next_token as i32;
                inputs.positions[i] = a.position as i32;
                inputs.temperature[i] = p.temperature;
                inputs.top_k[i] = p.top_k.min(i32::MAX as usize) as i32;
                inputs.top_p[i] = p.top_p;
                let key = draw_key(a.request.seed, a.sample_index as u32, a.response.len() as u32);
                inputs.keys[2 * i] = key[0];
                inputs.keys[2 * i + 1] = key[1];
                truncate |= p.needs_truncation();
            }
        }
        let chunks = self.decode_chunks(highest);
        self.ensure_decode(truncate, chunks)?;
        let program = &self.decode[&(truncate, chunks)];
        let started = Instant::now();
        let weights: Vec<&[Buffer]> = self.weights.replicas().iter().map(|r| &r[..]).collect();
        let (next, logprobs) =
            program.run_on(&self.client, &self.devices, &weights, &mut self.cache, &inputs)?;
        self.stats.decode_time += started.elapsed();
        self.stats.decode_steps += 1;
        let mut finished = Vec::new();
        for i in 0..s {
            let Some(a) = self.slots[i].as_mut() else { continue };
            let token = next[i] as u32;
            a.response.push(token);
            a.logprobs.push(logprobs[i]);
            self.stats.generated_tokens += 1;
            let p = &a.request.params;
            let mut text = None;
            let reason = if p.stop_token_ids.contains(&token) || self.settings.eos_token_ids.contains(&token)
            {
                Some(FinishReason::Eos(token))
            } else if let Some((stop, cut)) = find_stop_string(self.tokenizer.as_ref(), a) {
                text = Some(cut);
                Some(FinishReason::StopString(stop))
            } else if a.response.len() >= p.max_new_tokens {
                Some(FinishReason::MaxNewTokens)
            } else if a.request.prompt.len() + a.response.len() >= self.settings.max_model_len {
                Some(FinishReason::MaxModelLen)
            } else {
                None
            };
            match reason {
                None => {
                    a.next_token = token;
                    a.position += 1;
                }
                Some(finish_reason) => {
                    let a = self.slots[i].take().expect("slot is active");
                    let text = match text {
                        Some(t) => t,
                        None => self.decode_text(&a.response),
                    };
                    finished.push(Sample {
                        request_id: a.request.id,
                        sample_index: a.sample_index,
                        prompt_ids: a.request.prompt.clone(),
                        response_ids: a.response,
                        text,
                        logprobs: a.logprobs,
                        finish_reason,
                        weight_version: self.version,
                        restarts: a.restarts,
                    });
                }
            }
        }
        Ok(finished)
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

    /// Moves the engine to its own thread and returns a handle that feeds it requests and
    /// weight updates and streams back finished samples while it runs.
    pub fn spawn(self) -> EngineHandle {
        let (commands, command_rx) = channel::<Command>();
        let (output_tx, outputs) = channel::<EngineOutput>();
        let thread = std::thread::Builder::new()
            .name("rollout-engine".into())
            .spawn(move || serve(self, command_rx, output_tx))
            .expect("spawning the rollout engine thread");
        EngineHandle {
            commands,
            outputs,
            thread: Some(thread),
        }
    }
}

/// The response text of `ids` (special tokens skipped); empty without a tokenizer.
fn decode_text(tokenizer: Option<&ModelTokenizer>, ids: &[u32]) -> String {
    match tokenizer {
        Some(t) => t.decode(ids, true).unwrap_or_default(),
        None => String::new(),
    }
}

/// The first stop string in the response text of `a` and the text before it.
fn find_stop_string(tokenizer: Option<&ModelTokenizer>, a: &Active) -> Option<(String, String)> {
    if a.request.params.stop_strings.is_empty() {
        return None;
    }
    let text = decode_text(tokenizer, &a.response);
    a.request
        .params
        .stop_strings
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|at| (at, s)))
        .min_by_key(|(at, _)| *at)
        .map(|(at, s)| (s.clone(), text[..at].to_string()))
}

enum Command {
    Submit(GenerationRequest),
    SubmitAll(Vec<GenerationRequest>),
    UpdateWeights(u64, EngineWeights, Sender<Result<usize>>),
    Shutdown,
}

/// The engine thread: applies commands between steps, steps while there is work, sends every
/// finished sample and rejection. Returns the engine (or the error that stopped it).
fn serve(mut engine: Engine, commands: Receiver<Command>, outputs: Sender<EngineOutput>) -> Result<Engine> {
    loop {
        let mut batch = Vec::new();
        if engine.has_work() {
            batch.extend(commands.try_iter());
        } else {
            match commands.recv() {
                Ok(c) => batch.push(c),
                Err(_) => return Ok(engine),
            }
            batch.extend(commands.try_iter());
        }
        for c in batch {
            match c {
                Command::Submit(r) => {
                    if let Err(e) = engine.submit(r) {
                        let _ = outputs.send(EngineOutput::Rejected(e));
                    }
                }
                Command::SubmitAll(rs) => {
                    for r in rs {
                        if let Err(e) = engine.submit(r) {
                            let _ = outputs.send(EngineOutput::Rejected(e));
                        }
                    }
                }
                Command::UpdateWeights(v, w, reply) => {
                    let _ = reply.send(engine.update_weights(v, w));
                }
                Command::Shutdown => return Ok(engine),
            }
        }
        if engine.has_work() {
            for s in engine.step()? {
                let _ = outputs.send(EngineOutput::Sample(s));
            }
        }
    }
}

/// A running engine on its own thread (see [`Engine::spawn`]).
pub struct EngineHandle {
    commands: Sender<Command>,
    outputs: Receiver<EngineOutput>,
    thread: Option<JoinHandle<Result<Engine>>>,
}

/// The sending half of an [`EngineHandle`]: submits requests and weight updates from any
/// thread while another thread reads the outputs.
#[derive(Clone)]
pub struct EngineControl {
    commands: Sender<Command>,
}

impl EngineControl {
    /// Queues a request; its samples (or its rejection) arrive on [`EngineHandle::outputs`].
    pub fn submit(&self, request: GenerationRequest) -> Result<()> {
        self.commands
            .send(Command::Submit(request))
            .map_err(|_| RolloutError::Stopped("submit after the engine stopped".into()))
    }

    /// Queues several requests at once: the engine admits them together, in this order,
    /// before its next step, so which KV slot each sample gets (and with it the last bits of
    /// its arithmetic) does not depend on thread timing.
    pub fn submit_all(&self, requests: Vec<GenerationRequest>) -> Result<()> {
        self.commands
            .send(Command::SubmitAll(requests))
            .map_err(|_| RolloutError::Stopped("submit after the engine stopped".into()))
    }

    /// Installs new weights between two decode steps; waits until done and returns how many
    /// in-flight samples were restarted.
    pub fn update_weights(&self, version: u64, weights: impl Into<EngineWeights>) -> Result<usize> {
        let (tx, rx) = channel();
        self.commands
            .send(Command::UpdateWeights(version, weights.into(), tx))
            .map_err(|_| RolloutError::Stopped("update_weights after the engine stopped".into()))?;
        rx.recv()
            .map_err(|_| RolloutError::Stopped("the engine stopped before applying the weights".into()))?
    }
}

impl EngineHandle {
    /// A sending half for another thread (the engine keeps running until
    /// [`EngineHandle::shutdown`], even when every control is dropped).
    pub fn control(&self) -> EngineControl {
        EngineControl {
            commands: self.commands.clone(),
        }
    }

    /// Queues a request; its samples (or its rejection) arrive on [`EngineHandle::outputs`].
    pub fn submit(&self, request: GenerationRequest) -> Result<()> {
        self.commands
            .send(Command::Submit(request))
            .map_err(|_| RolloutError::Stopped("submit after the engine stopped".into()))
    }

    /// Installs new weights between two decode steps; waits until done and returns how many
    /// in-flight samples were restarted.
    pub fn update_weights(&self, version: u64, weights: impl Into<EngineWeights>) -> Result<usize> {
        let weights = weights.into();
        let (tx, rx) = channel();
        self.commands
            .send(Command::UpdateWeights(version, weights, tx))
            .map_err(|_| RolloutError::Stopped("update_weights after the engine stopped".into()))?;
        rx.recv()
            .map_err(|_| RolloutError::Stopped("the engine stopped before applying the weights".into()))?
    }

    /// The stream of finished samples and rejections (blocks in `recv` while generating).
    pub fn outputs(&self) -> &Receiver<EngineOutput> {
        &self.outputs
    }

    /// Stops the thread after the current step and returns the engine, or the error that
    /// stopped it earlier.
    pub fn shutdown(mut self) -> Result<Engine> {
        let _ = self.commands.send(Command::Shutdown);
        let thread = self.thread.take().expect("joined only here");
        thread
            .join()
            .map_err(|_| RolloutError::Stopped("the engine thread panicked".into()))?
    }
}
