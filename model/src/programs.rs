//! The decoder's compiled programs and a small host-side API around them: weights uploaded once
//! into device buffers ([`DeviceModel`]), a donated KV cache ([`KvCache`]), and the programs
//! `prefill` ([`PrefillProgram`]), `decode` ([`DecodeProgram`]), `logprobs`
//! ([`LogprobsProgram`]) and `full_logits` ([`FullLogitsProgram`], for parity tests), each
//! compiled once for static shapes. [`generate`] runs a prefill + decode loop for one prompt
//! with greedy or seeded host-side sampling, and [`HostModel`] loads a model directory or a
//! `.gguf` file with its tokenizer and chat template.
//!
//! Program argument order: the parameters (in [`crate::param_table`] order), then the KV cache
//! when the program has one (layer 0 K, layer 0 V, layer 1 K, ...), then the inputs. The cache
//! arguments are donated to the cache results.
//!
//! [`upload_params`] is the one upload of a parameter table to a device.

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use xla::graph::{shard_host, BuildOptions, Graph, GraphError, Mesh, Program};
use xla::runtime::{Buffer, Client, Executable};
use xla::DType;

use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::{runtime, ProgramError, ProgramResult as Result};
use crate::forward::{
    decode_graph, full_logits_graph, logprobs_graph_chunked, prefill_graph, DecoderParams, DEFAULT_HEAD_CHUNK,
};
use crate::gguf::GgufFile;
use crate::params::{param_table, ParamLayout, ParamSpec};
use crate::safetensors_io::ModelWeights;
use crate::tokenizer::ModelTokenizer;

fn graph_err(program: &str) -> impl FnOnce(GraphError) -> ProgramError + '_ {
    move |source| ProgramError::Graph {
        program: program.to_string(),
        source,
    }
}

fn input(program: &str, problem: String) -> ProgramError {
    ProgramError::Input {
        program: program.to_string(),
        problem,
    }
}

/// Uploads `weights` (every [`param_table`] tensor) to `device` as `dtype`, in table order.
pub fn upload_params(
    client: &Client,
    weights: &ModelWeights,
    dtype: DType,
    device: usize,
) -> Result<Vec<Buffer>> {
    Ok(upload_params_on(client, weights, dtype, &[device], None, &ParamLayout::default())?.remove(0))
}

/// Uploads `weights` as `dtype` to the devices of `mesh` (`devices[i]` is the mesh's `i`-th
/// device; one device without a mesh), each parameter laid out by `layout`: every device gets
/// its shard ([`xla::graph::shard_host`]). Returns `[device][parameter]` in table order.
pub fn upload_params_on(
    client: &Client,
    weights: &ModelWeights,
    dtype: DType,
    devices: &[usize],
    mesh: Option<&Mesh>,
    layout: &ParamLayout,
) -> Result<Vec<Vec<Buffer>>> {
    let table = param_table(&weights.config);
    upload_table_on(
        client,
        &table,
        |name| weights.get(name),
        dtype,
        devices,
        mesh,
        layout,
    )
}

/// Uploads `tensors` (one per entry of `table`, in order) to `device` as `dtype`.
pub(crate) fn upload_tensors(
    client: &Client,
    table: &[ParamSpec],
    tensors: &[crate::HostTensor],
    dtype: DType,
    device: usize,
) -> Result<Vec<Buffer>> {
    let by_name: std::collections::HashMap<&str, &crate::HostTensor> =
        tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let lookup = |name: &str| by_name.get(name).copied();
    Ok(upload_table_on(
        client,
        table,
        lookup,
        dtype,
        &[device],
        None,
        &ParamLayout::default(),
    )?
    .remove(0))
}

/// [`upload_params_on`] for the tensors of any `table`, found by name with `lookup`.
fn upload_table_on<'a>(
    client: &Client,
    table: &[ParamSpec],
    lookup: impl Fn(&str) -> Option<&'a crate::HostTensor>,
    dtype: DType,
    devices: &[usize],
    mesh: Option<&Mesh>,
    layout: &ParamLayout,
) -> Result<Vec<Vec<Buffer>>> {
    let mut out: Vec<Vec<Buffer>> = devices.iter().map(|_| Vec::new()).collect();
    for spec in table {
        let t = lookup(&spec.name).ok_or_else(|| ProgramError::Weights {
            name: spec.name.clone(),
            problem: format!("missing (expected shape {:?})", spec.shape),
        })?;
        if t.shape != spec.shape {
            return Err(ProgramError::Weights {
                name: spec.name.clone(),
                problem: format!("expected shape {:?}, found {:?}", spec.shape, t.shape),
            });
        }
        let dims = spec.dims();
        let sharding = layout.sharding(spec);
        let values = t.to_f32_vec();
        let action = format!("uploading `{}`", spec.name);
        fn put<T: xla::NativeType>(
            client: &Client,
            values: &[T],
            dims: &[i64],
            sharding: Option<&xla::graph::Sharding>,
            mesh: Option<&Mesh>,
            devices: &[usize],
            out: &mut [Vec<Buffer>],
        ) -> xla::runtime::Result<()> {
            for (d, &device) in devices.iter().enumerate() {
                let (part, local) = shard_host(values, dims, sharding, mesh, d);
                out[d].push(client.buffer_from_host(&part, &local, device)?);
            }
            Ok(())
        }
        let s = sharding.as_ref();
        match dtype {
            DType::F32 => put(client, &values, &dims, s, mesh, devices, &mut out),
            DType::BF16 => {
                let v: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
                put(client, &v, &dims, s, mesh, devices, &mut out)
            }
            DType::F16 => {
                let v: Vec<half::f16> = values.iter().map(|&x| half::f16::from_f32(x)).collect();
                put(client, &v, &dims, s, mesh, devices, &mut out)
            }
            other => {
                return Err(ProgramError::Weights {
                    name: spec.name.clone(),
                    problem: format!("weights can be f32, bf16 or f16 on the device, not {other}"),
                })
            }
        }
        .map_err(runtime(action))?;
    }
    Ok(out)
}

/// Model weights on one device, in [`crate::param_table`] order.
pub struct DeviceModel {
    client: Client,
    config: ModelConfig,
    dtype: DType,
    device: usize,
    weights: Vec<Buffer>,
}

impl DeviceModel {
    /// Uploads `weights` to `device` of `client` as `dtype` (see [`upload_params`]).
    pub fn upload(
        client: &Client,
        weights: &ModelWeights,
        dtype: DType,
        device: usize,
    ) -> Result<DeviceModel> {
        let config = &weights.config;
        let buffers = upload_params(client, weights, dtype, device)?;
        Ok(DeviceModel {
            client: client.clone(),
            config: config.clone(),
            dtype,
            device,
            weights: buffers,
        })
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The client the weights live on.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The weight element type on the device.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The weight buffers, in [`crate::param_table`] order.
    pub fn weights(&self) -> &[Buffer] {
        &self.weights
    }

    fn compile(&self, program: &Program, what: &str) -> Result<Executable> {
        program
            .compile(&self.client)
            .map_err(runtime(format!("compiling {what}")))
    }

    fn upload_i32(&self, values: &[i32], dims: &[i64], what: &str) -> Result<Buffer> {
        self.client
            .buffer_from_host(values, dims, self.device)
            .map_err(runtime(format!("uploading {what}")))
    }
}

/// The KV cache: per layer K and V buffers of shape `[slots, kv_heads, max_len, head_dim]` in
/// f32, donated into prefill and decode and replaced by their results.
pub struct KvCache {
    buffers: Vec<Buffer>,
    num_slots: usize,
    max_len: usize,
}

impl KvCache {
    /// A zero cache with `num_slots` slots of `max_len` positions for `model`.
    pub fn new(model: &DeviceModel, num_slots: usize, max_len: usize) -> Result<KvCache> {
        let c = &model.config;
        let dims = [
            num_slots as i64,
            c.num_key_value_heads as i64,
            max_len as i64,
            c.head_dim as i64,
        ];
        let zeros = vec![0f32; num_slots * c.num_key_value_heads * max_len * c.head_dim];
        let buffers = (0..2 * c.num_hidden_layers)
            .map(|_| {
                model
                    .client
                    .buffer_from_host(&zeros, &dims, model.device)
                    .map_err(runtime("allocating the KV cache"))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            buffers,
            num_slots,
            max_len,
        })
    }

    /// Number of slots.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Positions per slot.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The buffers (layer 0 K, layer 0 V, ...); empty after a failed donating run.
    pub fn buffers(&self) -> &[Buffer] {
        &self.buffers
    }

    /// Runs `exe` with `weights ++ cache ++ inputs`, replaces the cache with results
    /// `1..=2L` and returns result 0.
    fn run_donating(
        &mut self,
        exe: &Executable,
        weights: &[Buffer],
        inputs: &[&Buffer],
        what: &str,
    ) -> Result<Buffer> {
        if self.buffers.is_empty() {
            return Err(ProgramError::CacheLost);
        }
        let cache = std::mem::take(&mut self.buffers);
        let mut args: Vec<&Buffer> = weights.iter().collect();
        args.extend(cache.iter());
        args.extend_from_slice(inputs);
        let mut out = exe.execute(&args).map_err(runtime(format!("running {what}")))?;
        let first = out.remove(0);
        self.buffers = out;
        Ok(first)
    }
}

/// A graph with every parameter of `config` declared in `dtype`, for building a program.
fn start_graph(name: &str, config: &ModelConfig, dtype: DType) -> (Graph, DecoderParams) {
    let g = Graph::new(name);
    let p = DecoderParams::declare(&g, config, dtype);
    (g, p)
}

fn cache_params(g: &Graph, c: &ModelConfig, num_slots: usize, max_len: usize) -> Vec<xla::graph::Tensor> {
    let dims = [
        num_slots as i64,
        c.num_key_value_heads as i64,
        max_len as i64,
        c.head_dim as i64,
    ];
    (0..c.num_hidden_layers)
        .flat_map(|l| {
            [
                g.parameter(&format!("cache.{l}.k"), DType::F32, &dims),
                g.parameter(&format!("cache.{l}.v"), DType::F32, &dims),
            ]
        })
        .collect()
}

/// Donates cache argument `first_arg + i` to result `1 + i`.
fn cache_donation(first_arg: usize, n: usize) -> BuildOptions {
    let pairs: Vec<(usize, usize)> = (0..n).map(|i| (first_arg + i, 1 + i)).collect();
    BuildOptions::donating(&pairs)
}

/// One prompt for [`PrefillProgram::run`]: its tokens and the cache slot to write.
#[derive(Clone, Debug)]
pub struct PrefillRequest<'a> {
    /// KV-cache slot to fill.
    pub slot: usize,
    /// Prompt token ids (at least one, at most the program's length).
    pub tokens: &'a [u32],
}

/// `prefill` compiled for a batch of `batch` prompts padded to `len` tokens, into a cache of
/// `num_slots` x `max_len`.
pub struct PrefillProgram {
    exe: Executable,
    batch: usize,
    len: usize,
    num_slots: usize,
    max_len: usize,
    vocab: usize,
}

impl PrefillProgram {
    /// Traces the program for a model of `config` with weights of `dtype`, without compiling
    /// it (see [`PrefillProgram::compile`]).
    pub fn build(
        config: &ModelConfig,
        dtype: DType,
        batch: usize,
        len: usize,
        num_slots: usize,
        max_len: usize,
    ) -> Result<Program> {
        let name = format!("prefill_{batch}x{len}_cache{num_slots}x{max_len}");
        if len > max_len || batch == 0 || len == 0 {
            return Err(input(
                &name,
                format!("a batch of {batch} prompts of {len} tokens needs 0 < len <= max_len ({max_len})"),
            ));
        }
        let (g, p) = start_graph(&name, config, dtype);
        let cache = cache_params(&g, config, num_slots, max_len);
        let tokens = g.parameter("tokens", DType::I32, &[batch as i64, len as i64]);
        let lengths = g.parameter("lengths", DType::I32, &[batch as i64]);
        let slots = g.parameter("slots", DType::I32, &[batch as i64]);
        let (logits, new_cache) = prefill_graph(&p, &tokens, &lengths, &slots, &cache);
        let mut outs = vec![&logits];
        outs.extend(new_cache.iter());
        g.build_with(&outs, &cache_donation(p.all.len(), cache.len()))
            .map_err(graph_err(&name))
    }

    /// Traces and compiles the program.
    pub fn compile(
        model: &DeviceModel,
        batch: usize,
        len: usize,
        num_slots: usize,
        max_len: usize,
    ) -> Result<PrefillProgram> {
        let program = PrefillProgram::build(&model.config, model.dtype, batch, len, num_slots, max_len)?;
        Ok(PrefillProgram {
            exe: model.compile(&program, program.name())?,
            batch,
            len,
            num_slots,
            max_len,
            vocab: model.config.vocab_size,
        })
    }

    /// Prompts per call.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The padded prompt length (the longest prompt it takes).
    pub fn prompt_len(&self) -> usize {
        self.len
    }

    /// Runs up to `batch` prompts, writing each into its slot, and returns each prompt's
    /// last-token logits (`vocab` values per prompt, in request order). A partial batch is
    /// padded with copies of the first request, which rewrite that slot with the same values.
    pub fn run(
        &self,
        model: &DeviceModel,
        cache: &mut KvCache,
        requests: &[PrefillRequest<'_>],
    ) -> Result<Vec<Vec<f32>>> {
        let what = format!("prefill[{}x{}]", self.batch, self.len);
        if cache.num_slots != self.num_slots || cache.max_len != self.max_len {
            return Err(input(
                &what,
                format!(
                    "compiled for a cache of {} slots x {} positions, given {} x {}",
                    self.num_slots, self.max_len, cache.num_slots, cache.max_len
                ),
            ));
        }
        if requests.is_empty() || requests.len() > self.batch {
            return Err(input(
                &what,
                format!("takes 1 to {} prompts, given {}", self.batch, requests.len()),
            ));
        }
        let mut tokens = vec![0i32; self.batch * self.len];
        let mut lengths = vec![0i32; self.batch];
        let mut slots = vec![0i32; self.batch];
        for row in 0..self.batch {
            let r = &requests[if row < requests.len() { row } else { 0 }];
            if r.tokens.is_empty() || r.tokens.len() > self.len {
                return Err(input(
                    &what,
                    format!(
                        "prompt {row} has {} tokens; this program takes 1 to {} (compile a longer bucket)",
                        r.tokens.len(),
                        self.len
                    ),
                ));
            }
            if r.slot >= self.num_slots {
                return Err(input(
                    &what,
                    format!(
                        "slot {} is out of range (cache has {} slots)",
                        r.slot, self.num_slots
                    ),
                ));
            }
            check_vocab(&what, r.tokens, self.vocab)?;
            for (i, &t) in r.tokens.iter().enumerate() {
                tokens[row * self.len + i] = t as i32;
            }
            lengths[row] = r.tokens.len() as i32;
            slots[row] = r.slot as i32;
        }
        let tb = model.upload_i32(&tokens, &[self.batch as i64, self.len as i64], "tokens")?;
        let lb = model.upload_i32(&lengths, &[self.batch as i64], "lengths")?;
        let sb = model.upload_i32(&slots, &[self.batch as i64], "slots")?;
        let logits = cache.run_donating(&self.exe, &model.weights, &[&tb, &lb, &sb], &what)?;
        let flat = logits
            .to_host::<f32>()
            .map_err(runtime(format!("reading {what} logits")))?;
        Ok(flat
            .chunks(self.vocab)
            .take(requests.len())
            .map(|c| c.to_vec())
            .collect())
    }
}

fn check_vocab(what: &str, tokens: &[u32], vocab: usize) -> Result<()> {
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(input(
            what,
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        ));
    }
    Ok(())
}

/// `decode` compiled for a cache of `num_slots` x `max_len`: one token for every slot.
pub struct DecodeProgram {
    exe: Executable,
    num_slots: usize,
    max_len: usize,
    vocab: usize,
}

impl DecodeProgram {
    /// Traces the program for a model of `config` with weights of `dtype`, without compiling
    /// it (see [`DecodeProgram::compile`]).
    pub fn build(config: &ModelConfig, dtype: DType, num_slots: usize, max_len: usize) -> Result<Program> {
        let name = format!("decode_cache{num_slots}x{max_len}");
        let (g, p) = start_graph(&name, config, dtype);
        let cache = cache_params(&g, config, num_slots, max_len);
        let tokens = g.parameter("tokens", DType::I32, &[num_slots as i64]);
        let positions = g.parameter("positions", DType::I32, &[num_slots as i64]);
        let (logits, new_cache) = decode_graph(&p, &tokens, &positions, &cache);
        let mut outs = vec![&logits];
        outs.extend(new_cache.iter());
        g.build_with(&outs, &cache_donation(p.all.len(), cache.len()))
            .map_err(graph_err(&name))
    }

    /// Traces and compiles the program.
    pub fn compile(model: &DeviceModel, num_slots: usize, max_len: usize) -> Result<DecodeProgram> {
        let program = DecodeProgram::build(&model.config, model.dtype, num_slots, max_len)?;
        Ok(DecodeProgram {
            exe: model.compile(&program, program.name())?,
            num_slots,
            max_len,
            vocab: model.config.vocab_size,
        })
    }

    /// One step: `steps[s]` is `Some((token, position))` for an active slot `s` (the token is
    /// placed at `position`, which must be the slot's current length) or `None` for an idle
    /// slot. Returns logits `[num_slots * vocab]` (rows of idle slots are meaningless).
    pub fn run(
        &self,
        model: &DeviceModel,
        cache: &mut KvCache,
        steps: &[Option<(u32, usize)>],
    ) -> Result<Vec<f32>> {
        let what = format!("decode[{}x{}]", self.num_slots, self.max_len);
        if cache.num_slots != self.num_slots || cache.max_len != self.max_len {
            return Err(input(
                &what,
                format!(
                    "compiled for a cache of {} slots x {} positions, given {} x {}",
                    self.num_slots, self.max_len, cache.num_slots, cache.max_len
                ),
            ));
        }
        if steps.len() != self.num_slots {
            return Err(input(
                &what,
                format!(
                    "takes one entry per slot ({}), given {}",
                    self.num_slots,
                    steps.len()
                ),
            ));
        }
        let mut tokens = vec![0i32; self.num_slots];
        let mut positions = vec![-1i32; self.num_slots];
        for (s, step) in steps.iter().enumerate() {
            if let Some((t, p)) = *step {
                if p >= self.max_len {
                    return Err(input(
                        &what,
                        format!("slot {s}: position {p} is past the cache length {}", self.max_len),
                    ));
                }
                check_vocab(&what, &[t], self.vocab)?;
                tokens[s] = t as i32;
                positions[s] = p as i32;
            }
        }
        let n = self.num_slots as i64;
        let tb = model.upload_i32(&tokens, &[n], "tokens")?;
        let pb = model.upload_i32(&positions, &[n], "positions")?;
        let logits = cache.run_donating(&self.exe, &model.weights, &[&tb, &pb], &what)?;
        logits
            .to_host::<f32>()
            .map_err(runtime(format!("reading {what} logits")))
    }
}

/// `logprobs` compiled for `batch` sequences of `len` tokens: per-token log-probabilities at a
/// temperature and per-token entropies (see [`crate::forward::logprobs_graph`]).
pub struct LogprobsProgram {
    exe: Executable,
    batch: usize,
    len: usize,
    vocab: usize,
}

impl LogprobsProgram {
    /// Traces and compiles the program (output head over chunks of
    /// [`crate::forward::DEFAULT_HEAD_CHUNK`] positions).
    pub fn compile(model: &DeviceModel, batch: usize, len: usize) -> Result<LogprobsProgram> {
        Self::compile_chunked(model, batch, len, DEFAULT_HEAD_CHUNK as usize)
    }

    /// Traces the program of [`LogprobsProgram::compile_chunked`] for a model of `config` with
    /// weights of `dtype`, without compiling it.
    pub fn build(
        config: &ModelConfig,
        dtype: DType,
        batch: usize,
        len: usize,
        chunk: usize,
    ) -> Result<Program> {
        let name = format!("logprobs_{batch}x{len}_chunk{chunk}");
        let (g, p) = start_graph(&name, config, dtype);
        let tokens = g.parameter("tokens", DType::I32, &[batch as i64, len as i64]);
        let mask = g.parameter("mask", DType::I32, &[batch as i64, len as i64]);
        let temperature = g.parameter("temperature", DType::F32, &[]);
        let (lp, ent) = logprobs_graph_chunked(&g, &p, &tokens, &mask, &temperature, chunk as i64);
        g.build(&[&lp, &ent]).map_err(graph_err(&name))
    }

    /// [`LogprobsProgram::compile`] with the output head applied to `chunk` positions at a time.
    pub fn compile_chunked(
        model: &DeviceModel,
        batch: usize,
        len: usize,
        chunk: usize,
    ) -> Result<LogprobsProgram> {
        let program = LogprobsProgram::build(&model.config, model.dtype, batch, len, chunk)?;
        Ok(LogprobsProgram {
            exe: model.compile(&program, program.name())?,
            batch,
            len,
            vocab: model.config.vocab_size,
        })
    }

    /// Runs on `tokens` and `mask` (`batch * len` each, row-major; mask 1 for real tokens) at
    /// `temperature` (> 0). Returns `(logprobs, entropy)`, each `batch * len`.
    pub fn run(
        &self,
        model: &DeviceModel,
        tokens: &[u32],
        mask: &[i32],
        temperature: f32,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let what = format!("logprobs[{}x{}]", self.batch, self.len);
        let n = self.batch * self.len;
        if tokens.len() != n || mask.len() != n {
            return Err(input(
                &what,
                format!(
                    "needs {n} tokens and mask entries, given {} and {}",
                    tokens.len(),
                    mask.len()
                ),
            ));
        }
        if temperature <= 0.0 || !temperature.is_finite() {
            return Err(input(
                &what,
                format!("temperature must be > 0, given {temperature}"),
            ));
        }
        check_vocab(&what, tokens, self.vocab)?;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let dims = [self.batch as i64, self.len as i64];
        let tb = model.upload_i32(&ids, &dims, "tokens")?;
        let mb = model.upload_i32(mask, &dims, "mask")?;
        let temp = model
            .client
            .buffer_from_host(&[temperature], &[], model.device)
            .map_err(runtime("uploading the temperature"))?;
        let mut args: Vec<&Buffer> = model.weights.iter().collect();
        args.extend([&tb, &mb, &temp]);
        let out = self
            .exe
            .execute(&args)
            .map_err(runtime(format!("running {what}")))?;
        let lp = out[0]
            .to_host::<f32>()
            .map_err(runtime(format!("reading {what}")))?;
        let ent = out[1]
            .to_host::<f32>()
            .map_err(runtime(format!("reading {what}")))?;
        Ok((lp, ent))
    }
}

/// Every position's logits for `batch` sequences of `len` tokens (materialises
/// `[batch, len, vocab]`: for parity tests and short inputs).
pub struct FullLogitsProgram {
    exe: Executable,
    batch: usize,
    len: usize,
    vocab: usize,
}

impl FullLogitsProgram {
    /// Traces the program for a model of `config` with weights of `dtype`, without compiling
    /// it (see [`FullLogitsProgram::compile`]).
    pub fn build(config: &ModelConfig, dtype: DType, batch: usize, len: usize) -> Result<Program> {
        let name = format!("full_logits_{batch}x{len}");
        let (g, p) = start_graph(&name, config, dtype);
        let tokens = g.parameter("tokens", DType::I32, &[batch as i64, len as i64]);
        let mask = g.parameter("mask", DType::I32, &[batch as i64, len as i64]);
        let logits = full_logits_graph(&p, &tokens, &mask);
        g.build(&[&logits]).map_err(graph_err(&name))
    }

    /// Traces and compiles the program.
    pub fn compile(model: &DeviceModel, batch: usize, len: usize) -> Result<FullLogitsProgram> {
        let program = FullLogitsProgram::build(&model.config, model.dtype, batch, len)?;
        Ok(FullLogitsProgram {
            exe: model.compile(&program, program.name())?,
            batch,
            len,
            vocab: model.config.vocab_size,
        })
    }

    /// Logits `[batch * len * vocab]` for `tokens` with `mask` (both `batch * len`).
    pub fn run(&self, model: &DeviceModel, tokens: &[u32], mask: &[i32]) -> Result<Vec<f32>> {
        let what = format!("full_logits[{}x{}]", self.batch, self.len);
        let n = self.batch * self.len;
        if tokens.len() != n || mask.len() != n {
            return Err(input(
                &what,
                format!(
                    "needs {n} tokens and mask entries, given {} and {}",
                    tokens.len(),
                    mask.len()
                ),
            ));
        }
        check_vocab(&what, tokens, self.vocab)?;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let dims = [self.batch as i64, self.len as i64];
        let tb = model.upload_i32(&ids, &dims, "tokens")?;
        let mb = model.upload_i32(mask, &dims, "mask")?;
        let mut args: Vec<&Buffer> = model.weights.iter().collect();
        args.extend([&tb, &mb]);
        let out = self
            .exe
            .execute(&args)
            .map_err(runtime(format!("running {what}")))?;
        out[0]
            .to_host::<f32>()
            .map_err(runtime(format!("reading {what}")))
    }
}

/// The smallest multiple of `step` that is at least `n` (length buckets).
pub fn bucket(n: usize, step: usize) -> usize {
    n.div_ceil(step.max(1)).max(1) * step.max(1)
}

/// How [`generate`] picks tokens and when it stops.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// 0 for greedy (deterministic); otherwise sample from `softmax(logits / temperature)`.
    pub temperature: f32,
    /// Seed of the host-side sampler.
    pub seed: u64,
    /// Tokens that end the continuation (not included in the result).
    pub stop_tokens: Vec<u32>,
}

/// Picks the next token from `logits`: the first maximum when `temperature` is 0, otherwise a
/// sample from `softmax(logits / temperature)` drawn with `rng`.
pub fn pick_token(logits: &[f32], temperature: f32, rng: &mut impl Rng) -> u32 {
    if temperature <= 0.0 {
        let mut best = 0;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = i;
            }
        }
        return best as u32;
    }
    let inv = 1.0 / temperature as f64;
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let weights: Vec<f64> = logits.iter().map(|&v| ((v as f64 - max) * inv).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    (logits.len() - 1) as u32
}

/// A single-sequence generator: `prefill` (one prompt of up to `prompt_len` tokens) and
/// `decode` compiled once for a one-slot cache of `max_len` positions, reusable across prompts.
pub struct Generator {
    prefill: PrefillProgram,
    decode: DecodeProgram,
    prompt_len: usize,
    max_len: usize,
}

impl Generator {
    /// Compiles the two programs for prompts of up to `prompt_len` tokens and sequences of up
    /// to `max_len` tokens (prompt + continuation).
    pub fn new(model: &DeviceModel, prompt_len: usize, max_len: usize) -> Result<Generator> {
        Ok(Generator {
            prefill: PrefillProgram::compile(model, 1, prompt_len, 1, max_len)?,
            decode: DecodeProgram::compile(model, 1, max_len)?,
            prompt_len,
            max_len,
        })
    }

    /// Generates a continuation of `prompt` (token ids) until a stop token, `max_new_tokens`
    /// or the end of the cache. Returns the new token ids (without the stop token).
    pub fn generate(
        &self,
        model: &DeviceModel,
        prompt: &[u32],
        options: &GenerateOptions,
    ) -> Result<Vec<u32>> {
        if prompt.is_empty() || prompt.len() > self.prompt_len {
            return Err(input(
                "generate",
                format!(
                    "the prompt has {} tokens; this generator takes 1 to {}",
                    prompt.len(),
                    self.prompt_len
                ),
            ));
        }
        if options.max_new_tokens == 0 {
            return Ok(Vec::new());
        }
        let mut cache = KvCache::new(model, 1, self.max_len)?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(options.seed);
        let logits = self.prefill.run(
            model,
            &mut cache,
            &[PrefillRequest {
                slot: 0,
                tokens: prompt,
            }],
        )?;
        let mut next = pick_token(&logits[0], options.temperature, &mut rng);
        let mut out = Vec::new();
        let mut position = prompt.len();
        loop {
            if options.stop_tokens.contains(&next) {
                break;
            }
            out.push(next);
            if out.len() >= options.max_new_tokens || position >= self.max_len {
                break;
            }
            let logits = self.decode.run(model, &mut cache, &[Some((next, position))])?;
            position += 1;
            next = pick_token(&logits, options.temperature, &mut rng);
        }
        Ok(out)
    }
}

/// Generates a continuation of `prompt` (token ids) on one slot: compiles a [`Generator`] with
/// the prompt padded to a 32-token bucket and room for `max_new_tokens`, then runs it.
pub fn generate(model: &DeviceModel, prompt: &[u32], options: &GenerateOptions) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(input("generate", "the prompt has no tokens".to_string()));
    }
    let len = bucket(prompt.len(), 32);
    let max_len = bucket(prompt.len() + options.max_new_tokens, 32).max(len);
    Generator::new(model, len, max_len)?.generate(model, prompt, options)
}

/// A model loaded on the host for generation: weights, tokenizer and chat template.
pub struct HostModel {
    /// Where it was loaded from.
    pub path: PathBuf,
    /// Config and weights.
    pub weights: ModelWeights,
    /// The tokenizer.
    pub tokenizer: ModelTokenizer,
    /// The chat template, when the model has one.
    pub chat_template: Option<ChatTemplate>,
}

impl HostModel {
    /// Loads a `.gguf` file (weights dequantised, tokenizer and chat template from its
    /// metadata) or a Hugging Face model directory (`config.json`, safetensors,
    /// `tokenizer.json`, and the chat template from `tokenizer_config.json` when present).
    pub fn load(path: &Path) -> Result<HostModel> {
        let text = ModelText::load(path)?;
        let weights = text.load_weights()?;
        Ok(HostModel {
            path: text.path,
            weights,
            tokenizer: text.tokenizer,
            chat_template: text.chat_template,
        })
    }

    /// Token ids that end a continuation: the config's EOS tokens and the chat template's EOS
    /// token.
    pub fn stop_tokens(&self) -> Vec<u32> {
        stop_tokens(&self.weights.config, &self.tokenizer, self.chat_template.as_ref())
    }
}

/// What [`HostModel::load`] reads but the weights: the config, the tokenizer and the chat
/// template, for work that renders and tokenizes (a judge's prompts) before or without the
/// weights.
pub struct ModelText {
    /// Where it was loaded from.
    pub path: PathBuf,
    /// The configuration.
    pub config: ModelConfig,
    /// The tokenizer.
    pub tokenizer: ModelTokenizer,
    /// The chat template, when the model has one.
    pub chat_template: Option<ChatTemplate>,
}

impl ModelText {
    /// Reads a `.gguf` file's metadata or a model directory's `config.json`, `tokenizer.json`
    /// and `tokenizer_config.json` (see [`HostModel::load`]).
    pub fn load(path: &Path) -> Result<ModelText> {
        if is_gguf(path) {
            let gguf = GgufFile::open(path)?;
            return Ok(ModelText {
                path: path.to_path_buf(),
                config: ModelConfig::from_gguf(&gguf)?,
                tokenizer: ModelTokenizer::from_gguf(&gguf)?,
                chat_template: ChatTemplate::from_gguf(&gguf).ok(),
            });
        }
        if !path.is_dir() {
            return Err(ProgramError::NotAModel {
                path: path.to_path_buf(),
            });
        }
        let tc = path.join("tokenizer_config.json");
        Ok(ModelText {
            path: path.to_path_buf(),
            config: ModelConfig::from_hf_file(&path.join("config.json"))?,
            tokenizer: ModelTokenizer::from_file(&path.join("tokenizer.json"))?,
            chat_template: if tc.is_file() {
                ChatTemplate::from_tokenizer_config(&tc).ok()
            } else {
                None
            },
        })
    }

    /// The model's weights (dequantised from a GGUF file, or its safetensors).
    pub fn load_weights(&self) -> Result<ModelWeights> {
        if is_gguf(&self.path) {
            Ok(GgufFile::open(&self.path)?.load_weights(&self.config)?)
        } else {
            Ok(crate::safetensors_io::load_safetensors(&self.path, &self.config)?)
        }
    }

    /// See [`HostModel::stop_tokens`].
    pub fn stop_tokens(&self) -> Vec<u32> {
        stop_tokens(&self.config, &self.tokenizer, self.chat_template.as_ref())
    }
}

fn is_gguf(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

fn stop_tokens(
    config: &ModelConfig,
    tokenizer: &ModelTokenizer,
    template: Option<&ChatTemplate>,
) -> Vec<u32> {
    let mut stops = config.eos_token_ids.clone();
    if let Some(eos) = template
        .and_then(|c| c.eos_token.as_deref())
        .and_then(|t| tokenizer.token_to_id(t))
    {
        if !stops.contains(&eos) {
            stops.push(eos);
        }
    }
    stops
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up() {
        assert_eq!(bucket(1, 32), 32);
        assert_eq!(bucket(32, 32), 32);
        assert_eq!(bucket(33, 32), 64);
        assert_eq!(bucket(0, 16), 16);
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_sampling_follows_the_seed() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        assert_eq!(pick_token(&[0.1, 3.0, 3.0, -1.0], 0.0, &mut rng), 1);
        // A near-certain token is always sampled.
        assert_eq!(pick_token(&[0.0, 50.0, 0.0], 1.0, &mut rng), 1);
        // Same seed, same draws; frequencies follow the softmax.
        let logits = [0.0f32, (3.0f32).ln()];
        let draw = |seed| {
            let mut r = rand::rngs::StdRng::seed_from_u64(seed);
            (0..4000)
                .map(|_| pick_token(&logits, 1.0, &mut r))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        let ones = draw(7).iter().filter(|&&t| t == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
    }

    fn tiny_config() -> ModelConfig {
        ModelConfig::from_hf_file(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/tiny/qwen2/config.json"
        )))
        .unwrap()
    }

    #[test]
    fn programs_are_built_from_the_config_alone() {
        let c = tiny_config();
        let params = param_table(&c).len();
        let layers = c.num_hidden_layers;
        let prefill = PrefillProgram::build(&c, DType::BF16, 2, 8, 4, 16).unwrap();
        assert_eq!(prefill.name(), "prefill_2x8_cache4x16");
        // Weights, K and V per layer, then tokens, lengths, slots; the cache is donated.
        assert_eq!(prefill.arg_names().len(), params + 2 * layers + 3);
        assert_eq!(prefill.arg_names()[params], "cache.0.k");
        assert_eq!(
            prefill.donated_args(),
            (params..params + 2 * layers).collect::<Vec<_>>()
        );
        assert_eq!(prefill.result_types().len(), 1 + 2 * layers);
        assert_eq!(
            prefill.arg_types()[params].dims,
            vec![4, c.num_key_value_heads as i64, 16, c.head_dim as i64]
        );
        let decode = DecodeProgram::build(&c, DType::F32, 4, 16).unwrap();
        assert_eq!(decode.name(), "decode_cache4x16");
        assert_eq!(decode.arg_names().len(), params + 2 * layers + 2);
        let logprobs = LogprobsProgram::build(&c, DType::F32, 2, 8, 4).unwrap();
        assert_eq!(logprobs.name(), "logprobs_2x8_chunk4");
        assert_eq!(logprobs.result_types()[0].dims, vec![2, 8]);
        assert!(logprobs.donated_args().is_empty());
        let full = FullLogitsProgram::build(&c, DType::F32, 2, 8).unwrap();
        assert_eq!(full.result_types()[0].dims, vec![2, 8, c.vocab_size as i64]);
        // The same shapes trace to the same text; a different weight type does not.
        assert_eq!(
            PrefillProgram::build(&c, DType::BF16, 2, 8, 4, 16)
                .unwrap()
                .fingerprint(),
            prefill.fingerprint()
        );
        assert_ne!(
            PrefillProgram::build(&c, DType::F32, 2, 8, 4, 16)
                .unwrap()
                .fingerprint(),
            prefill.fingerprint()
        );
        let err = PrefillProgram::build(&c, DType::F32, 1, 32, 4, 16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs 0 < len <= max_len (16)"), "{err}");
    }
}
