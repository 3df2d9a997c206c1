//! The engine's compiled programs, composed from `model::forward`'s graph functions:
//! - [`PrefillFanout`]: prefill one prompt (or a batch of prompts) and write each prompt's
//!   cache row (every layer's keys and values) into its slot and up to `width - 1` more slots,
//!   on the device, in the same program: group prefix sharing, one prefill per group;
//! - [`EnvExtend`]: write a multi-turn sample's environment tokens into its slot after the
//!   positions it holds, in one pass (no logits: its next decode step samples);
//! - [`DecodeSample`]: one decode step for every slot fused with the per-slot sampler
//!   ([`crate::sampling::sample_graph`]): only the sampled token ids and their log-probs come
//!   back to the host.
//!
//! Argument order: the parameters ([`model::param_table`] order), the KV cache (see
//! [`CacheShape::declare`]; donated to the cache results), then the inputs.
//!
//! Over several devices: a cache shape on `N > 1` devices ([`CacheShape::on_devices`]) with
//! tensor-parallel size `tp` ([`CacheShape::with_tensor_parallel`]) builds every program SPMD
//! on the mesh [`SLOT_AXIS`]` = N / tp` x [`model::MODEL_AXIS`]` = tp` (devices `0..N`,
//! row-major; the slot axis alone when `tp` is 1, [`rollout_mesh`]). The KV cache and every
//! per-slot tensor (decode inputs, sampled tokens, log-probs) are split on their slot
//! dimension into contiguous blocks of `slots / (N / tp)`, one per slot group; the cache is
//! also split by KV heads over the model axis when they divide by `tp` (else each device of a
//! group holds all KV heads: vLLM's replication when the TP size exceeds the KV head count).
//! The parameters are laid out by [`crate::layout::rollout_layout`] (Megatron splits over the
//! model axis, whole over the slot groups); the per-prompt prefill inputs (tokens, lengths,
//! destination slots) are whole on every device. XLA inserts the collectives; each slot's
//! arithmetic is the single-device program's, so the tokens are the same.

use model::forward::{
    decode_hidden_graph, decode_hidden_graph_chunked, extend_graph, prefill_kv_graph, DecodeAttention,
    DecodeOptions, DecoderParams, KvWrite, SlotBucket,
};
use model::ModelConfig;
use xla::graph::{BuildOptions, Graph, Program, Tensor};
use xla::runtime::{Buffer, Client, Executable};
use xla::{DType, NativeType};

use crate::error::{Result, RolloutError};
use crate::layout::CacheShape;
use crate::plan::DecodeKey;
use crate::sampling::{sample_graph_with, SamplerInputs, SamplerKind};

/// Uploads `values` (row-major, shape `dims`) to every device of `devices`: split on dim 0
/// into `groups` contiguous blocks, one per slot group (consecutive devices of a group get
/// the same block), or whole on each when `groups` is 1.
pub fn upload_on<T: NativeType>(
    client: &Client,
    devices: &[usize],
    values: &[T],
    dims: &[i64],
    groups: usize,
    what: &str,
) -> Result<Vec<Buffer>> {
    let n = devices.len();
    let split = groups > 1 && !dims.is_empty();
    let mut local = dims.to_vec();
    let block = if split {
        local[0] /= groups as i64;
        values.len() / groups
    } else {
        values.len()
    };
    devices
        .iter()
        .enumerate()
        .map(|(d, &device)| {
            let part = if split {
                let g = d * groups / n;
                &values[g * block..(g + 1) * block]
            } else {
                values
            };
            client
                .buffer_from_host(part, &local, device)
                .map_err(|e| RolloutError::runtime(format!("uploading {what} to device {device}"), e))
        })
        .collect()
}

/// Reads a per-slot result back, `parts[d]` being device `d`'s block: the first device of
/// each of the `groups` slot groups, concatenated in order.
fn read_slots<T: NativeType>(parts: &[&Buffer], groups: usize, what: &str) -> Result<Vec<T>> {
    let per_group = (parts.len() / groups.max(1)).max(1);
    let mut out = Vec::new();
    for b in parts.iter().step_by(per_group) {
        out.extend(
            b.to_host::<T>()
                .map_err(|e| RolloutError::runtime(format!("reading {what}"), e))?,
        );
    }
    Ok(out)
}

fn donate_cache(first_arg: usize, first_result: usize, n: usize) -> BuildOptions {
    let pairs: Vec<(usize, usize)> = (0..n).map(|i| (first_arg + i, first_result + i)).collect();
    BuildOptions::donating(&pairs)
}

/// [`donate_cache`] with the layouts of results `0..first_result + n` on several devices: the
/// results before the cache are per-slot tensors of rank `r` where `before[i]` is `Some(r)`,
/// replicated where it is `None`; the cache's own layout after them.
fn donate_cache_on(cache: &CacheShape, first_arg: usize, before: &[Option<usize>], n: usize) -> BuildOptions {
    let mut options = donate_cache(first_arg, before.len(), n);
    options.result_shardings = before
        .iter()
        .enumerate()
        .filter_map(|(i, rank)| rank.and_then(|r| cache.slot_sharding(r)).map(|s| (i, s)))
        .collect();
    if let Some(kv) = cache.kv_sharding() {
        let first = before.len();
        options
            .result_shardings
            .extend((first..first + n).map(|i| (i, kv.clone())));
    }
    options
}

fn build(g: &Graph, outs: &[&Tensor], options: &BuildOptions, name: &str) -> Result<Program> {
    g.build_with(outs, options).map_err(|source| RolloutError::Graph {
        program: name.to_string(),
        source,
    })
}

fn compile(client: &Client, program: &Program) -> Result<Executable> {
    program
        .compile(client)
        .map_err(|e| RolloutError::runtime(format!("compiling {}", program.name()), e))
}

/// Runs `exe` on `weights ++ cache ++ inputs`; the cache is donated and replaced by results
/// `first_cache_result..`; returns the results before them.
pub fn run_donating(
    exe: &Executable,
    weights: &[Buffer],
    cache: &mut Vec<Buffer>,
    inputs: &[&Buffer],
    first_cache_result: usize,
    what: &str,
) -> Result<Vec<Buffer>> {
    let mut per_device = vec![std::mem::take(cache)];
    let inputs: Vec<Vec<&Buffer>> = vec![inputs.to_vec()];
    let result = run_donating_on(
        exe,
        &[weights.iter().collect()],
        &mut per_device,
        &inputs,
        first_cache_result,
        what,
    );
    *cache = per_device.pop().unwrap_or_default();
    Ok(result?.remove(0))
}

/// [`run_donating`] on one device or SPMD over several: `weights[d]`, `cache[d]` and
/// `inputs[d]` are device `d`'s; returns `results[d]`, the results before the cache.
pub fn run_donating_on(
    exe: &Executable,
    weights: &[Vec<&Buffer>],
    cache: &mut Vec<Vec<Buffer>>,
    inputs: &[Vec<&Buffer>],
    first_cache_result: usize,
    what: &str,
) -> Result<Vec<Vec<Buffer>>> {
    if cache.is_empty() || cache.iter().any(|c| c.is_empty()) {
        return Err(RolloutError::CacheLost);
    }
    let old = std::mem::take(cache);
    let args: Vec<Vec<&Buffer>> = (0..old.len())
        .map(|d| {
            let mut args: Vec<&Buffer> = weights[d].clone();
            args.extend(old[d].iter());
            args.extend_from_slice(&inputs[d]);
            args
        })
        .collect();
    let outputs = if args.len() == 1 {
        vec![exe
            .execute(&args[0])
            .map_err(|e| RolloutError::runtime(format!("running {what}"), e))?]
    } else {
        exe.execute_spmd(&args)
            .map_err(|e| RolloutError::runtime(format!("running {what}"), e))?
    };
    let mut results = Vec::with_capacity(outputs.len());
    for mut out in outputs {
        cache.push(out.split_off(first_cache_result));
        results.push(out);
    }
    Ok(results)
}

/// Prefill of `batch` prompts of up to `len` tokens each, prompt `b` into slot `dst[b][0]`
/// and fanned out to `dst[b][1..width]`: every chunk of each prompt's cache row is written
/// into each of its slots (positions past the prompt become zeros).
pub struct PrefillFanout {
    exe: Executable,
    /// Padded prompt length (the bucket).
    pub len: usize,
    /// Number of destination slots per prompt.
    pub width: usize,
    /// Prompts per run.
    pub batch: usize,
    /// `moe_layers * k` when the program returns the experts chosen ([`CacheShape::record_routes`]).
    routes: Option<usize>,
}

impl PrefillFanout {
    /// Traces and compiles the program for one prompt per run, weights of `dtype`.
    pub fn compile(
        client: &Client,
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        len: usize,
        width: usize,
    ) -> Result<PrefillFanout> {
        PrefillFanout::compile_batched(client, config, dtype, cache, len, width, 1)
    }

    /// Traces the program for `batch` prompts per run without compiling it (for
    /// [`PrefillFanout::compile_batched`] and for compiling elsewhere, e.g. deviceless for a
    /// TPU topology).
    pub fn build(
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        len: usize,
        width: usize,
        batch: usize,
    ) -> Result<Program> {
        let batch = batch.max(1);
        let name = format!(
            "rollout_prefill_{len}x{batch}_fanout{width}_cache{}x{}x{}{}",
            cache.slots,
            cache.chunks(),
            cache.chunk,
            spmd_suffix(cache)
        );
        let g = cache.graph(&name);
        let p = cache.declare_params(&g, config, dtype);
        let kv = cache.declare(&g);
        let (b, t) = (batch as i64, len as i64);
        let tokens = g.parameter("tokens", DType::I32, &[b, t]);
        let lengths = g.parameter("lengths", DType::I32, &[b]);
        let dst = g.parameter("dst", DType::I32, &[b, width as i64]);
        let (_, kvs, chosen) = prefill_kv_graph(&p, &tokens, &lengths);
        let routes = recorded(cache, chosen);
        let chunks = cache.chunks();
        let span = (chunks * cache.chunk) as i64;
        let zero = g.scalar(0.0, DType::I32);
        let zero_kv = g.scalar(0.0, cache.dtype);
        let slot = |row: i64, k: i64| {
            dst.slice_axis(0, row, row + 1)
                .slice_axis(1, k, k + 1)
                .reshape(&[])
        };
        let mut out = kv.clone();
        for (layer, (k, v)) in kvs.iter().enumerate() {
            for (which, new) in [(0usize, k), (1usize, v)] {
                // [B, kvh, T, hd] -> [B, kvh, chunks * chunk, hd], zeros past the prompt.
                let padded = new.convert_if_needed(cache.dtype).pad(
                    &zero_kv,
                    &[0, 0, 0, 0],
                    &[0, 0, span - t, 0],
                    &[0, 0, 0, 0],
                );
                for c in 0..chunks {
                    let at = layer * 2 * chunks + which * chunks + c;
                    let part = if chunks == 1 {
                        padded.clone()
                    } else {
                        let from = (c * cache.chunk) as i64;
                        padded.slice_axis(2, from, from + cache.chunk as i64)
                    };
                    let mut tensor = out[at].clone();
                    for row in 0..b {
                        let update = part.slice_axis(0, row, row + 1);
                        for k in 0..width as i64 {
                            tensor =
                                tensor.dynamic_update_slice(&update, &[&slot(row, k), &zero, &zero, &zero]);
                        }
                    }
                    out[at] = tensor;
                }
            }
        }
        let outs: Vec<&Tensor> = routes.iter().chain(&out).collect();
        let before: Vec<Option<usize>> = routes.iter().map(|_| None).collect();
        build(
            &g,
            &outs,
            &donate_cache_on(cache, p.all.len(), &before, kv.len()),
            &name,
        )
    }

    /// Traces and compiles the program for `batch` prompts per run.
    pub fn compile_batched(
        client: &Client,
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        len: usize,
        width: usize,
        batch: usize,
    ) -> Result<PrefillFanout> {
        let program = PrefillFanout::build(config, dtype, cache, len, width, batch)?;
        Ok(PrefillFanout {
            exe: compile(client, &program)?,
            len,
            width,
            batch: batch.max(1),
            routes: records_routes(config, cache),
        })
    }

    /// Runs 1 to `batch` prompts, each `(tokens, slots)`: `tokens` 1 to `len` ids (0 ids
    /// writes an all-zero row) into `slots` (1 to `width`; padded with the first slot, which
    /// rewrites it with the same values). A short batch is padded by repeating its first
    /// prompt (which rewrites its slots with the same values). With routes recorded
    /// ([`CacheShape::record_routes`]), returns each prompt's experts chosen for its tokens,
    /// `[tokens, moe_layers, k]` row-major.
    pub fn run_batch(
        &self,
        client: &Client,
        device: usize,
        weights: &[Buffer],
        cache: &mut Vec<Buffer>,
        prompts: &[(&[u32], &[usize])],
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let mut per_device = vec![std::mem::take(cache)];
        let result = self.run_batch_on(
            client,
            &[device],
            &[weights.iter().collect()],
            &mut per_device,
            prompts,
        );
        *cache = per_device.pop().unwrap_or_default();
        result
    }

    /// [`PrefillFanout::run_batch`] on `devices` (one, or the `0..N` of a program split over
    /// `N`), with `weights[d]` and `cache[d]` device `d`'s.
    pub fn run_batch_on(
        &self,
        client: &Client,
        devices: &[usize],
        weights: &[Vec<&Buffer>],
        cache: &mut Vec<Vec<Buffer>>,
        prompts: &[(&[u32], &[usize])],
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let what = format!("prefill[{}x{}] fan-out {}", self.len, self.batch, self.width);
        assert!(!prompts.is_empty() && prompts.len() <= self.batch);
        let mut ids = vec![0i32; self.batch * self.len];
        let mut lengths = vec![0i32; self.batch];
        let mut dst = vec![0i32; self.batch * self.width];
        for row in 0..self.batch {
            let (tokens, slots) = prompts[if row < prompts.len() { row } else { 0 }];
            assert!(tokens.len() <= self.len && !slots.is_empty() && slots.len() <= self.width);
            for (i, &t) in tokens.iter().enumerate() {
                ids[row * self.len + i] = t as i32;
            }
            lengths[row] = tokens.len() as i32;
            for k in 0..self.width {
                dst[row * self.width + k] = slots[if k < slots.len() { k } else { 0 }] as i32;
            }
        }
        let up = |v: &[i32], dims: &[i64], n: &str| {
            upload_on(client, devices, v, dims, 1, &format!("{n} for {what}"))
        };
        let (b, t, w) = (self.batch as i64, self.len as i64, self.width as i64);
        let tb = up(&ids, &[b, t], "tokens")?;
        let lb = up(&lengths, &[b], "lengths")?;
        let db = up(&dst, &[b, w], "slots")?;
        let inputs: Vec<Vec<&Buffer>> = (0..devices.len()).map(|d| vec![&tb[d], &lb[d], &db[d]]).collect();
        let first_cache = self.routes.map_or(0, |_| 1);
        let out = run_donating_on(&self.exe, weights, cache, &inputs, first_cache, &what)?;
        let Some(per_position) = self.routes else {
            return Ok(None);
        };
        let all = read_routes(&out[0][0], &what)?;
        let row = self.len * per_position;
        Ok(Some(
            prompts
                .iter()
                .enumerate()
                .map(|(b, (tokens, _))| all[b * row..b * row + tokens.len() * per_position].to_vec())
                .collect(),
        ))
    }
}

/// Extend: writes up to `len` tokens into one slot's cache row after the positions it holds,
/// in one pass ([`model::forward::extend_graph`]): a multi-turn sample's environment tokens,
/// between its turns. One program per token bucket (`len`), run once per sample and turn.
pub struct EnvExtend {
    exe: Executable,
    /// Padded token count (the bucket).
    pub len: usize,
    /// `moe_layers * k` when the program returns the experts chosen ([`CacheShape::record_routes`]).
    routes: Option<usize>,
}

impl EnvExtend {
    /// Traces the program for up to `len` tokens without compiling it (for
    /// [`EnvExtend::compile`] and for `grpo compile`).
    pub fn build(config: &ModelConfig, dtype: DType, cache: &CacheShape, len: usize) -> Result<Program> {
        let name = format!(
            "rollout_extend_{len}_cache{}x{}x{}{}",
            cache.slots,
            cache.chunks(),
            cache.chunk,
            spmd_suffix(cache)
        );
        let g = cache.graph(&name);
        let p = cache.declare_params(&g, config, dtype);
        let kv = cache.declare(&g);
        let tokens = g.parameter("tokens", DType::I32, &[len as i64]);
        let place = g.parameter("place", DType::I32, &[3]);
        let (out, chosen) = extend_graph(&p, &tokens, &place, &kv);
        let routes = recorded(cache, chosen);
        let outs: Vec<&Tensor> = routes.iter().chain(&out).collect();
        let before: Vec<Option<usize>> = routes.iter().map(|_| None).collect();
        build(
            &g,
            &outs,
            &donate_cache_on(cache, p.all.len(), &before, kv.len()),
            &name,
        )
    }

    /// Traces and compiles the program for up to `len` tokens.
    pub fn compile(
        client: &Client,
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        len: usize,
    ) -> Result<EnvExtend> {
        let program = EnvExtend::build(config, dtype, cache, len)?;
        Ok(EnvExtend {
            exe: compile(client, &program)?,
            len,
            routes: records_routes(config, cache),
        })
    }

    /// Writes `tokens` (1 to `len` ids) into slot `at.0` at positions `at.1..`, on `devices`
    /// (one, or the `0..N` of a program split over `N`) with `weights[d]` and `cache[d]`
    /// device `d`'s. With routes recorded ([`CacheShape::record_routes`]), returns the experts
    /// chosen for the tokens, `[tokens, moe_layers, k]` row-major.
    pub fn run_on(
        &self,
        client: &Client,
        devices: &[usize],
        weights: &[Vec<&Buffer>],
        cache: &mut Vec<Vec<Buffer>>,
        tokens: &[u32],
        at: (usize, usize),
    ) -> Result<Option<Vec<u8>>> {
        let (slot, start) = at;
        assert!(!tokens.is_empty() && tokens.len() <= self.len);
        let what = format!("extend[{}] of slot {slot}", self.len);
        let mut ids = vec![0i32; self.len];
        for (id, &t) in ids.iter_mut().zip(tokens) {
            *id = t as i32;
        }
        let place = [slot as i32, start as i32, tokens.len() as i32];
        let tb = upload_on(
            client,
            devices,
            &ids,
            &[self.len as i64],
            1,
            &format!("tokens for {what}"),
        )?;
        let pb = upload_on(client, devices, &place, &[3], 1, &format!("place for {what}"))?;
        let inputs: Vec<Vec<&Buffer>> = (0..devices.len()).map(|d| vec![&tb[d], &pb[d]]).collect();
        let first_cache = self.routes.map_or(0, |_| 1);
        let out = run_donating_on(&self.exe, weights, cache, &inputs, first_cache, &what)?;
        let Some(per_position) = self.routes else {
            return Ok(None);
        };
        let mut all = read_routes(&out[0][0], &what)?;
        all.truncate(tokens.len() * per_position);
        Ok(Some(all))
    }
}

/// Per-slot inputs of one decode step (each `slots` long).
#[derive(Clone, Debug, Default)]
pub struct DecodeInputs {
    /// Input token of each slot.
    pub tokens: Vec<i32>,
    /// Position of that token (-1 = inactive slot).
    pub positions: Vec<i32>,
    /// Temperature (0 = greedy).
    pub temperature: Vec<f32>,
    /// Top-k (0 = off).
    pub top_k: Vec<i32>,
    /// Top-p (1 = off).
    pub top_p: Vec<f32>,
    /// Min-p (0 = off).
    pub min_p: Vec<f32>,
    /// Threefry key words, `2 * slots`.
    pub keys: Vec<u32>,
}

/// One decode step for all slots with the sampler fused in.
pub struct DecodeSample {
    exe: Executable,
    slots: usize,
    /// Slot groups of the engine's mesh (per-slot tensors are split over them).
    groups: usize,
    /// Whether this variant applies top-k / top-p (sorts the vocabulary).
    pub truncate: bool,
    /// Cache chunks the step reads (every active position must be below
    /// `attend_chunks * chunk`); all of them for an unchunked cache.
    pub attend_chunks: usize,
    /// Whether the step returns each slot's experts chosen ([`CacheShape::record_routes`]).
    routes: bool,
}

impl DecodeSample {
    /// Traces and compiles the program for weights of `dtype`, attending over the whole
    /// cache.
    pub fn compile(
        client: &Client,
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        truncate: bool,
    ) -> Result<DecodeSample> {
        let key = DecodeKey {
            truncate,
            chunks: cache.chunks(),
            rows: cache.local_slots(),
        };
        DecodeSample::compile_step(client, config, dtype, cache, key, SamplerKind::default())
    }

    /// The decode step of `key` ([`crate::plan`]): over the whole cache in one tensor, or
    /// reading `key.chunks` of its chunks, for the first `key.rows` slots of each slot group.
    /// Traced, not compiled.
    pub fn build_step(
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        key: DecodeKey,
        sampler: SamplerKind,
    ) -> Result<Program> {
        let rows = key.rows.clamp(1, cache.local_slots());
        if cache.chunks() == 1 {
            let options = DecodeOptions {
                kv_write: cache.write,
                ..DecodeOptions::default()
            };
            DecodeSample::build_with(config, dtype, cache, key.truncate, options, sampler, rows)
        } else {
            DecodeSample::build_chunked(config, dtype, cache, key.truncate, key.chunks, sampler, rows)
        }
    }

    /// [`DecodeSample::build_step`], compiled.
    pub fn compile_step(
        client: &Client,
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        key: DecodeKey,
        sampler: SamplerKind,
    ) -> Result<DecodeSample> {
        let program = DecodeSample::build_step(config, dtype, cache, key, sampler)?;
        Ok(DecodeSample {
            exe: compile(client, &program)?,
            slots: cache.slot_groups() * key.rows.clamp(1, cache.local_slots()),
            groups: cache.slot_groups(),
            truncate: key.truncate,
            attend_chunks: key.chunks.clamp(1, cache.chunks()),
            routes: records_routes(config, cache).is_some(),
        })
    }

    /// Traces the program of [`DecodeSample::compile_with`] for the first `rows` slots of each
    /// slot group (all of them in [`DecodeSample::compile_with`]) without compiling it.
    pub fn build_with(
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        truncate: bool,
        options: DecodeOptions,
        sampler: SamplerKind,
        rows: usize,
    ) -> Result<Program> {
        if cache.chunks() != 1 {
            return Err(RolloutError::Config(format!(
                "DecodeSample::compile_with needs an unchunked cache, got {} chunks of {} positions; use compile_chunked",
                cache.chunks(),
                cache.chunk
            )));
        }
        let kind = if truncate { "topk_topp" } else { "plain" };
        let window = options
            .attend_len
            .map_or(String::new(), |w| format!("_attend{w}"));
        let write = match options.kv_write {
            KvWrite::Scatter | KvWrite::Masked => String::new(),
            other => format!("_{other:?}"),
        };
        let attention = match options.attention {
            DecodeAttention::Dot => String::new(),
            other => format!("_{other:?}"),
        };
        let gumbel = if sampler == SamplerKind::GumbelMax {
            "_gumbel"
        } else {
            ""
        };
        let name = format!(
            "rollout_decode_{kind}_cache{}x{}{window}{write}{attention}{gumbel}{}{}",
            cache.slots,
            cache.max_len,
            rows_suffix(cache, rows),
            spmd_suffix(cache)
        );
        decode_sample_program(
            &name,
            config,
            dtype,
            cache,
            (truncate, sampler),
            (rows, options.kv_write, |_| true),
            |p, tokens, positions, kv, bucket| {
                let (h, new_cache, chosen) =
                    decode_hidden_graph(p, tokens, positions, kv, DecodeOptions { bucket, ..options });
                (h.linear(p.head()), new_cache, chosen)
            },
        )
    }

    /// [`DecodeSample::compile`] with a choice of attended cache length, cache write and
    /// attention (see [`DecodeOptions`]) and of sampler.
    pub fn compile_with(
        client: &Client,
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        truncate: bool,
        options: DecodeOptions,
        sampler: SamplerKind,
    ) -> Result<DecodeSample> {
        let rows = cache.local_slots();
        let program = DecodeSample::build_with(config, dtype, cache, truncate, options, sampler, rows)?;
        Ok(DecodeSample {
            exe: compile(client, &program)?,
            slots: cache.slots,
            groups: cache.slot_groups(),
            truncate,
            attend_chunks: 1,
            routes: records_routes(config, cache).is_some(),
        })
    }

    /// The step over a chunked cache reading and writing only its first `attend_chunks`
    /// chunks (see [`model::forward::decode_hidden_graph_chunked`]); the later chunks pass
    /// through unchanged, for the first `rows` slots of each slot group. Traces the program
    /// without compiling it.
    pub fn build_chunked(
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        truncate: bool,
        attend_chunks: usize,
        sampler: SamplerKind,
        rows: usize,
    ) -> Result<Program> {
        let attend_chunks = attend_chunks.clamp(1, cache.chunks());
        let kind = if truncate { "topk_topp" } else { "plain" };
        let gumbel = if sampler == SamplerKind::GumbelMax {
            "_gumbel"
        } else {
            ""
        };
        let name = format!(
            "rollout_decode_{kind}_cache{}x{}x{}_attend{attend_chunks}{gumbel}{}{}",
            cache.slots,
            cache.chunks(),
            cache.chunk,
            rows_suffix(cache, rows),
            spmd_suffix(cache)
        );
        // Tensor i of the cache is chunk (i mod chunks) of its layer's keys or values.
        let chunks = cache.chunks();
        decode_sample_program(
            &name,
            config,
            dtype,
            cache,
            (truncate, sampler),
            (rows, cache.write, move |i: usize| i % chunks < attend_chunks),
            |p, tokens, positions, kv, bucket| {
                let (h, new_cache, chosen) =
                    decode_hidden_graph_chunked(p, tokens, positions, kv, attend_chunks, cache.write, bucket);
                (h.linear(p.head()), new_cache, chosen)
            },
        )
    }

    /// The step over a chunked cache reading and writing only its first `attend_chunks`
    /// chunks (see [`model::forward::decode_hidden_graph_chunked`]); the later chunks pass
    /// through unchanged.
    pub fn compile_chunked(
        client: &Client,
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        truncate: bool,
        attend_chunks: usize,
        sampler: SamplerKind,
    ) -> Result<DecodeSample> {
        let rows = cache.local_slots();
        let program =
            DecodeSample::build_chunked(config, dtype, cache, truncate, attend_chunks, sampler, rows)?;
        Ok(DecodeSample {
            exe: compile(client, &program)?,
            slots: cache.slots,
            groups: cache.slot_groups(),
            truncate,
            attend_chunks: attend_chunks.clamp(1, cache.chunks()),
            routes: records_routes(config, cache).is_some(),
        })
    }

    /// Runs one step; returns each slot's sampled token and its log-probability (and, with
    /// routes recorded, the experts chosen for its input token).
    pub fn run(
        &self,
        client: &Client,
        device: usize,
        weights: &[Buffer],
        cache: &mut Vec<Buffer>,
        inputs: &DecodeInputs,
    ) -> Result<DecodeOutput> {
        let mut per_device = vec![std::mem::take(cache)];
        let result = self.run_on(
            client,
            &[device],
            &[weights.iter().collect()],
            &mut per_device,
            inputs,
        );
        *cache = per_device.pop().unwrap_or_default();
        result
    }

    /// [`DecodeSample::run`] on `devices` (one, or the `0..N` of a program split over `N`),
    /// with `weights[d]` and `cache[d]` device `d`'s: each device gets its block of every
    /// per-slot input and returns its block of tokens and log-probs.
    pub fn run_on(
        &self,
        client: &Client,
        devices: &[usize],
        weights: &[Vec<&Buffer>],
        cache: &mut Vec<Vec<Buffer>>,
        inputs: &DecodeInputs,
    ) -> Result<DecodeOutput> {
        let what = if self.truncate {
            "decode (top-k/top-p)"
        } else {
            "decode"
        };
        let (s, groups) = (self.slots as i64, self.groups);
        let up_i =
            |v: &[i32], n: &str| upload_on(client, devices, v, &[s], groups, &format!("{n} for {what}"));
        let up_f =
            |v: &[f32], n: &str| upload_on(client, devices, v, &[s], groups, &format!("{n} for {what}"));
        let tb = up_i(&inputs.tokens, "tokens")?;
        let pb = up_i(&inputs.positions, "positions")?;
        let temp = up_f(&inputs.temperature, "temperatures")?;
        let kb = up_i(&inputs.top_k, "top_k")?;
        let ppb = up_f(&inputs.top_p, "top_p")?;
        let mpb = up_f(&inputs.min_p, "min_p")?;
        let keys = upload_on(
            client,
            devices,
            &inputs.keys,
            &[s, 2],
            groups,
            &format!("keys for {what}"),
        )?;
        let args: Vec<Vec<&Buffer>> = (0..devices.len())
            .map(|d| vec![&tb[d], &pb[d], &temp[d], &kb[d], &ppb[d], &mpb[d], &keys[d]])
            .collect();
        let out = run_donating_on(&self.exe, weights, cache, &args, 2 + self.routes as usize, what)?;
        let result = |i: usize| -> Vec<&Buffer> { out.iter().map(|o| &o[i]).collect() };
        Ok(DecodeOutput {
            tokens: read_slots::<i32>(&result(0), groups, &format!("{what} tokens"))?,
            logprobs: read_slots::<f32>(&result(1), groups, &format!("{what} log-probs"))?,
            routes: match self.routes {
                true => Some(read_slots::<u8>(&result(2), groups, &format!("{what} routes"))?),
                false => None,
            },
        })
    }
}

/// What one decode step gives back, per slot of the step.
#[derive(Clone, Debug)]
pub struct DecodeOutput {
    /// The sampled token.
    pub tokens: Vec<i32>,
    /// Its log-probability.
    pub logprobs: Vec<f32>,
    /// With routes recorded ([`CacheShape::record_routes`]): the experts every MoE layer chose
    /// for the slot's input token, `[slots, moe_layers, k]` row-major.
    pub routes: Option<Vec<u8>>,
}

/// `moe_layers * k`, the experts recorded per position, when `cache`'s programs record
/// routes of `config`'s mixture-of-experts layers.
fn records_routes(config: &ModelConfig, cache: &CacheShape) -> Option<usize> {
    let moe = config.moe.as_ref().filter(|_| cache.record_routes)?;
    Some(config.moe_layers() * moe.experts_per_token)
}

/// The experts chosen `[.., Lm, k]` as a program result (u8: ids up to 255), when `cache`'s
/// programs record routes.
fn recorded(cache: &CacheShape, chosen: Option<Tensor>) -> Option<Tensor> {
    chosen
        .filter(|_| cache.record_routes)
        .map(|c| c.convert(DType::U8))
}

/// Reads a replicated routes result (device 0's copy).
fn read_routes(buffer: &Buffer, what: &str) -> Result<Vec<u8>> {
    buffer
        .to_host::<u8>()
        .map_err(|e| RolloutError::runtime(format!("reading the routes of {what}"), e))
}

/// The program of one decode-and-sample step named `name`: parameters, the cache, the slots'
/// tokens, positions and sampling settings declared in the order [`DecodeSample::run`] passes
/// them; `step(params, tokens, positions, cache)` gives the logits and the new cache; the
/// sampler (`truncate`, `sampler`) picks each slot's token and its log-probability; the cache
/// is donated.
///
/// `(rows, write, attended)`: the step runs on the first `rows` slots of each slot group,
/// writing the cache by `write`. A scatter write on one slot group runs on the cache as a
/// [`SlotBucket`] (written in place, the rows read). Otherwise, with fewer rows than a group
/// holds, the cache tensors the step reads and writes (`attended(i)` for tensor i) are sliced
/// to those rows before it and written back after it, the others passing through untouched.
fn decode_sample_program(
    name: &str,
    config: &ModelConfig,
    dtype: DType,
    cache: &CacheShape,
    (truncate, sampler): (bool, SamplerKind),
    (rows, write, attended): (usize, KvWrite, impl Fn(usize) -> bool),
    step: impl FnOnce(
        &DecoderParams,
        &Tensor,
        &Tensor,
        &[Tensor],
        Option<SlotBucket>,
    ) -> (Tensor, Vec<Tensor>, Option<Tensor>),
) -> Result<Program> {
    let g = cache.graph(name);
    let p = cache.declare_params(&g, config, dtype);
    let kv = cache.declare(&g);
    let s = (cache.slot_groups() * rows) as i64;
    let tokens = cache.slot_parameter(&g, "tokens", DType::I32, &[s]);
    let positions = cache.slot_parameter(&g, "positions", DType::I32, &[s]);
    let temperature = cache.slot_parameter(&g, "temperature", DType::F32, &[s]);
    let top_k = cache.slot_parameter(&g, "top_k", DType::I32, &[s]);
    let top_p = cache.slot_parameter(&g, "top_p", DType::F32, &[s]);
    let min_p = cache.slot_parameter(&g, "min_p", DType::F32, &[s]);
    let keys = cache.slot_parameter(&g, "keys", DType::U32, &[s, 2]);
    let bucketed = rows < cache.local_slots();
    // In place on one slot group, every bucket alike (the full one too: its products then
    // take the bucket's code path, which keeps their bits equal). Over several groups the
    // partitioner gathers a bucket's scatter coordinates across devices, so there the rows
    // are sliced out and written back instead.
    let bucket = (write == KvWrite::Scatter && cache.slot_groups() == 1).then(|| cache.bucket(rows));
    let slice = |i: usize| bucketed && bucket.is_none() && attended(i);
    let sliced: Vec<Tensor> = kv
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if slice(i) {
                cache.bucket(rows).slice(t)
            } else {
                t.clone()
            }
        })
        .collect();
    let (logits, stepped, chosen) = step(&p, &tokens, &positions, &sliced, bucket);
    let routes = recorded(cache, chosen);
    let new_cache: Vec<Tensor> = stepped
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if slice(i) {
                cache.bucket(rows).write_back(&kv[i], t)
            } else {
                t.clone()
            }
        })
        .collect();
    let inputs = SamplerInputs {
        temperature: &temperature,
        top_k: &top_k,
        top_p: &top_p,
        min_p: &min_p,
        keys: &keys,
    };
    let (next, logprobs) = sample_graph_with(&logits, &inputs, truncate, sampler);
    let mut outs = vec![&next, &logprobs];
    let mut before = vec![Some(1), Some(1)];
    if let Some(r) = &routes {
        outs.push(r);
        before.push(Some(3));
    }
    outs.extend(new_cache.iter());
    build(
        &g,
        &outs,
        &donate_cache_on(cache, p.all.len(), &before, kv.len()),
        name,
    )
}

/// Row pairs the engine's [`SlotMoves`] program moves per slot group per run (more take
/// several runs).
pub const MOVES_PER_RUN: usize = 8;

/// Moves cache rows within slot groups, on the devices: up to `moves` (source, destination)
/// pairs of local rows per slot group per run, each copying the source slot's keys and values
/// of every layer and chunk over the destination's. The engine compacts live samples into
/// the lowest rows with it, so that a smaller slot bucket holds them.
pub struct SlotMoves {
    exe: Executable,
    /// Pairs per slot group per run.
    pub moves: usize,
    groups: usize,
}

impl SlotMoves {
    /// Traces the program for `moves` pairs per slot group without compiling it.
    pub fn build(cache: &CacheShape, moves: usize) -> Result<Program> {
        let name = format!(
            "rollout_move_slots_{moves}_cache{}x{}x{}{}",
            cache.slots,
            cache.chunks(),
            cache.chunk,
            spmd_suffix(cache)
        );
        let g = cache.graph(&name);
        let kv = cache.declare(&g);
        let groups = cache.slot_groups();
        let m = (groups * moves) as i64;
        let src = cache.slot_parameter(&g, "src", DType::I32, &[m]);
        let dst = cache.slot_parameter(&g, "dst", DType::I32, &[m]);
        // (group, local row) coordinates into the [groups, local slots, ...] view; the group
        // coordinate is an iota, which the partitioner reads as each device's own rows.
        let (gs, ms) = (groups as i64, moves as i64);
        let group = g.iota(DType::I32, &[gs, ms, 1], 0);
        let at = |rows: &Tensor| Tensor::concat(&[&group, &rows.reshape(&[gs, ms, 1])], 2);
        let (from, to) = (at(&src), at(&dst));
        let out: Vec<Tensor> = kv
            .iter()
            .map(|t| {
                let view = cache.bucket(cache.local_slots()).view(t);
                let moved = view.take_at(&from, &[0, 1]);
                view.scatter_at(&to, &moved, &[0, 1]).reshape(t.dims())
            })
            .collect();
        let outs: Vec<&Tensor> = out.iter().collect();
        build(&g, &outs, &donate_cache_on(cache, 0, &[], kv.len()), &name)
    }

    /// [`SlotMoves::build`], compiled.
    pub fn compile(client: &Client, cache: &CacheShape, moves: usize) -> Result<SlotMoves> {
        let program = SlotMoves::build(cache, moves)?;
        Ok(SlotMoves {
            exe: compile(client, &program)?,
            moves,
            groups: cache.slot_groups(),
        })
    }

    /// Applies `moves[g]`, slot group g's (source, destination) local rows (at most
    /// [`SlotMoves::moves`] each; destinations distinct and not sources), on `devices`
    /// with `cache[d]` device d's. A group's unused pairs move its first source (or row 0)
    /// onto itself.
    pub fn run_on(
        &self,
        client: &Client,
        devices: &[usize],
        cache: &mut Vec<Vec<Buffer>>,
        moves: &[Vec<(usize, usize)>],
    ) -> Result<()> {
        assert_eq!(moves.len(), self.groups);
        let mut src = Vec::with_capacity(self.groups * self.moves);
        let mut dst = Vec::with_capacity(self.groups * self.moves);
        for pairs in moves {
            assert!(pairs.len() <= self.moves);
            let idle = pairs.first().map_or(0, |&(from, _)| from);
            for k in 0..self.moves {
                let (from, to) = pairs.get(k).copied().unwrap_or((idle, idle));
                src.push(from as i32);
                dst.push(to as i32);
            }
        }
        let what = "slot moves";
        let m = [(self.groups * self.moves) as i64];
        let sb = upload_on(client, devices, &src, &m, self.groups, what)?;
        let db = upload_on(client, devices, &dst, &m, self.groups, what)?;
        let inputs: Vec<Vec<&Buffer>> = (0..devices.len()).map(|d| vec![&sb[d], &db[d]]).collect();
        let weights: Vec<Vec<&Buffer>> = vec![Vec::new(); devices.len()];
        run_donating_on(&self.exe, &weights, cache, &inputs, 0, what)?;
        Ok(())
    }
}

/// `_rows8` for a decode step over the first 8 slots of each slot group, empty over all.
fn rows_suffix(cache: &CacheShape, rows: usize) -> String {
    if rows < cache.local_slots() {
        format!("_rows{rows}")
    } else {
        String::new()
    }
}

/// `_spmd4` for a program split over 4 devices (`_spmd4_tp2` with tensor parallelism over 2
/// of them), empty on one; `_routes` after it when the program records routes.
fn spmd_suffix(cache: &CacheShape) -> String {
    let mut extra = String::new();
    if cache.record_routes {
        extra.push_str("_routes");
    }
    if let model::moe::MoeLowering::Grouped { .. } = cache.moe_lowering {
        extra.push_str("_grouped");
    }
    match (cache.devices, cache.tensor_parallel) {
        (0 | 1, _) => extra,
        (n, 1) => format!("_spmd{n}{extra}"),
        (n, tp) => format!("_spmd{n}_tp{tp}{extra}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunked_cache_covers_every_position_in_order() {
        let whole = CacheShape::new(&ModelConfig::tiny_llama(), 3, 20);
        assert_eq!((whole.chunks(), whole.chunk), (1, 20));
        assert_eq!(whole.bytes(), 2 * 2 * 3 * 2 * 20 * 8 * 4);
        // With bf16 weights the cache is bf16: half the bytes.
        assert_eq!(whole.clone().for_weights(DType::BF16).bytes() * 2, whole.bytes());
        assert_eq!(whole.clone().for_weights(DType::F32), whole);
        // 20 positions in chunks of 8: 3 chunks, the last padded to 24 positions.
        let chunked = CacheShape::chunked(&ModelConfig::tiny_llama(), 3, 20, 8);
        assert_eq!(chunked.chunks(), 3);
        assert_eq!(chunked.dims(), [3, 2, 8, 8]);
        assert_eq!(chunked.bytes(), 2 * 2 * 3 * 2 * 24 * 8 * 4);
        assert_eq!(
            [0, 7, 8, 15, 16, 19].map(|p| chunked.chunks_for(p)),
            [1, 1, 2, 2, 3, 3]
        );
        assert_eq!(
            CacheShape::chunked(&ModelConfig::tiny_llama(), 3, 20, 0).chunks(),
            1
        );
        assert_eq!(
            CacheShape::chunked(&ModelConfig::tiny_llama(), 3, 20, 64).chunks(),
            1
        );
        let names = |shape: &CacheShape| {
            let g = Graph::new("cache");
            let declared = shape.declare(&g);
            let outs: Vec<&Tensor> = declared.iter().collect();
            g.build(&outs).unwrap().arg_names().to_vec()
        };
        let chunk_names = names(&chunked);
        assert_eq!(chunk_names.len(), 12);
        assert_eq!(
            chunk_names[..4],
            ["cache.0.k.0", "cache.0.k.1", "cache.0.k.2", "cache.0.v.0"]
        );
        assert_eq!(chunk_names[11], "cache.1.v.2");
        assert_eq!(
            names(&whole),
            ["cache.0.k", "cache.0.v", "cache.1.k", "cache.1.v"]
        );
    }

    #[test]
    fn programs_are_built_without_a_client() {
        let c = ModelConfig::tiny_llama();
        let params = model::param_table(&c).len();
        let cache = CacheShape::chunked(&c, 4, 20, 8);
        let prefill = PrefillFanout::build(&c, DType::F32, &cache, 8, 2, 2).unwrap();
        assert_eq!(prefill.name(), "rollout_prefill_8x2_fanout2_cache4x3x8");
        // Weights, 2 layers x (K, V) x 3 chunks, then tokens, lengths, destination slots.
        assert_eq!(prefill.arg_names().len(), params + 12 + 3);
        assert_eq!(prefill.arg_types()[params + 12].dims, vec![2, 8]);
        assert_eq!(prefill.donated_args(), (params..params + 12).collect::<Vec<_>>());
        let decode =
            DecodeSample::build_chunked(&c, DType::BF16, &cache, false, 9, SamplerKind::default(), 4)
                .unwrap();
        // 9 attended chunks clamp to the 3 there are.
        assert_eq!(decode.name(), "rollout_decode_plain_cache4x3x8_attend3");
        assert_eq!(decode.result_types().len(), 2 + 12);
        assert_eq!(decode.result_types()[0].dims, vec![4]);
        let whole = CacheShape::new(&c, 4, 20);
        let top = DecodeSample::build_with(
            &c,
            DType::F32,
            &whole,
            true,
            DecodeOptions::default(),
            SamplerKind::default(),
            4,
        )
        .unwrap();
        assert_eq!(top.name(), "rollout_decode_topk_topp_cache4x20");
        let err = DecodeSample::build_with(
            &c,
            DType::F32,
            &cache,
            false,
            DecodeOptions::default(),
            SamplerKind::default(),
            4,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("needs an unchunked cache, got 3 chunks"), "{err}");
    }
}
