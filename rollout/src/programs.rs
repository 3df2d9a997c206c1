//! The engine's compiled programs, composed from `model::forward`'s graph functions:
//! - [`PrefillFanout`]: prefill one prompt into a KV-cache slot and copy that slot's whole row
//!   (every layer's keys and values) into up to `width - 1` more slots, on the device, in the
//!   same program: group prefix sharing, one prefill per group;
//! - [`DecodeSample`]: one decode step for every slot fused with the per-slot sampler
//!   ([`crate::sampling::sample_graph`]): only the sampled token ids and their log-probs come
//!   back to the host.
//!
//! Argument order: the parameters ([`model::param_table`] order), the KV cache (layer 0 K,
//! layer 0 V, ...; donated to the cache results), then the inputs.

use model::forward::{decode_graph, prefill_graph, DecoderParams};
use model::ModelConfig;
use xla::graph::{BuildOptions, Graph, Tensor};
use xla::runtime::{Buffer, Client, Executable};
use xla::DType;

use crate::error::{Result, RolloutError};
use crate::sampling::{sample_graph, SamplerInputs};

/// Static shape of the KV cache: `2 * layers` f32 tensors `[slots, kv_heads, max_len, head_dim]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheShape {
    /// Number of slots (`max_num_seqs`).
    pub slots: usize,
    /// Positions per slot (the maximum model length: prompt + response).
    pub max_len: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Decoder layers.
    pub layers: usize,
}

impl CacheShape {
    /// The cache shape for `config` with `slots` x `max_len`.
    pub fn new(config: &ModelConfig, slots: usize, max_len: usize) -> CacheShape {
        CacheShape {
            slots,
            max_len,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            layers: config.num_hidden_layers,
        }
    }

    /// Dimensions of one K or V tensor.
    pub fn dims(&self) -> [i64; 4] {
        [
            self.slots as i64,
            self.kv_heads as i64,
            self.max_len as i64,
            self.head_dim as i64,
        ]
    }

    /// Total bytes of the cache (f32).
    pub fn bytes(&self) -> usize {
        2 * self.layers * self.slots * self.kv_heads * self.max_len * self.head_dim * 4
    }

    fn declare(&self, g: &Graph) -> Vec<Tensor> {
        let dims = self.dims();
        (0..self.layers)
            .flat_map(|l| {
                [
                    g.parameter(&format!("cache.{l}.k"), DType::F32, &dims),
                    g.parameter(&format!("cache.{l}.v"), DType::F32, &dims),
                ]
            })
            .collect()
    }

    /// A zero cache on `device`.
    pub fn allocate(&self, client: &Client, device: usize) -> Result<Vec<Buffer>> {
        let zeros = vec![0f32; self.slots * self.kv_heads * self.max_len * self.head_dim];
        (0..2 * self.layers)
            .map(|_| {
                client
                    .buffer_from_host(&zeros, &self.dims(), device)
                    .map_err(|e| RolloutError::runtime("allocating the KV cache", e))
            })
            .collect()
    }
}

fn donate_cache(first_arg: usize, first_result: usize, n: usize) -> BuildOptions {
    let pairs: Vec<(usize, usize)> = (0..n).map(|i| (first_arg + i, first_result + i)).collect();
    BuildOptions::donating(&pairs)
}

fn compile(
    client: &Client,
    g: &Graph,
    outs: &[&Tensor],
    options: &BuildOptions,
    name: &str,
) -> Result<Executable> {
    let program = g
        .build_with(outs, options)
        .map_err(|source| RolloutError::Graph {
            program: name.to_string(),
            source,
        })?;
    program
        .compile(client)
        .map_err(|e| RolloutError::runtime(format!("compiling {name}"), e))
}

/// Runs `exe` on `weights ++ cache ++ inputs`; the cache is donated and replaced by results
/// `first_cache_result..`; returns the results before them.
pub(crate) fn run_donating(
    exe: &Executable,
    weights: &[Buffer],
    cache: &mut Vec<Buffer>,
    inputs: &[&Buffer],
    first_cache_result: usize,
    what: &str,
) -> Result<Vec<Buffer>> {
    if cache.is_empty() {
        return Err(RolloutError::CacheLost);
    }
    let old = std::mem::take(cache);
    let mut args: Vec<&Buffer> = weights.iter().collect();
    args.extend(old.iter());
    args.extend_from_slice(inputs);
    let mut out = exe
        .execute(&args)
        .map_err(|e| RolloutError::runtime(format!("running {what}"), e))?;
    *cache = out.split_off(first_cache_result);
    Ok(out)
}

/// Prefill of one prompt of up to `len` tokens into slot `dst[0]`, fanned out to `dst[1..width]`.
pub struct PrefillFanout {
    exe: Executable,
    /// Padded prompt length (the bucket).
    pub len: usize,
    /// Number of destination slots.
    pub width: usize,
}

impl PrefillFanout {
    /// Traces and compiles the program for weights of `dtype`.
    pub fn compile(
        client: &Client,
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        len: usize,
        width: usize,
    ) -> Result<PrefillFanout> {
        let name = format!(
            "rollout_prefill_{len}_fanout{width}_cache{}x{}",
            cache.slots, cache.max_len
        );
        let g = Graph::new(&name);
        let p = DecoderParams::declare(&g, config, dtype);
        let kv = cache.declare(&g);
        let tokens = g.parameter("tokens", DType::I32, &[1, len as i64]);
        let length = g.parameter("length", DType::I32, &[1]);
        let dst = g.parameter("dst", DType::I32, &[width as i64]);
        let first = dst.slice_axis(0, 0, 1);
        let (_, filled) = prefill_graph(&p, &tokens, &length, &first, &kv);
        let zero = g.scalar(0.0, DType::I32);
        let src = first.reshape(&[]);
        let row_dims = [
            1,
            cache.kv_heads as i64,
            cache.max_len as i64,
            cache.head_dim as i64,
        ];
        let out: Vec<Tensor> = filled
            .iter()
            .map(|c| {
                if width == 1 {
                    return c.clone();
                }
                let row = c.dynamic_slice(&[&src, &zero, &zero, &zero], &row_dims);
                let mut c = c.clone();
                for k in 1..width as i64 {
                    let slot = dst.slice_axis(0, k, k + 1).reshape(&[]);
                    c = c.dynamic_update_slice(&row, &[&slot, &zero, &zero, &zero]);
                }
                c
            })
            .collect();
        let outs: Vec<&Tensor> = out.iter().collect();
        let exe = compile(client, &g, &outs, &donate_cache(p.all.len(), 0, kv.len()), &name)?;
        Ok(PrefillFanout { exe, len, width })
    }

    /// Runs on `tokens` (1 to `len` ids; 0 ids writes an all-zero row) into `slots` (1 to
    /// `width`; padded with the first slot, which rewrites it with the same values).
    pub fn run(
        &self,
        client: &Client,
        device: usize,
        weights: &[Buffer],
        cache: &mut Vec<Buffer>,
        tokens: &[u32],
        slots: &[usize],
    ) -> Result<()> {
        let what = format!("prefill[{}] fan-out {}", self.len, self.width);
        assert!(tokens.len() <= self.len && !slots.is_empty() && slots.len() <= self.width);
        let mut ids = vec![0i32; self.len];
        for (i, &t) in tokens.iter().enumerate() {
            ids[i] = t as i32;
        }
        let dst: Vec<i32> = (0..self.width)
            .map(|k| slots[if k < slots.len() { k } else { 0 }] as i32)
            .collect();
        let up = |v: &[i32], dims: &[i64], n: &str| {
            client
                .buffer_from_host(v, dims, device)
                .map_err(|e| RolloutError::runtime(format!("uploading {n} for {what}"), e))
        };
        let tb = up(&ids, &[1, self.len as i64], "tokens")?;
        let lb = up(&[tokens.len() as i32], &[1], "length")?;
        let db = up(&dst, &[self.width as i64], "slots")?;
        run_donating(&self.exe, weights, cache, &[&tb, &lb, &db], 0, &what)?;
        Ok(())
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
    /// Threefry key words, `2 * slots`.
    pub keys: Vec<u32>,
}

/// One decode step for all slots with the sampler fused in.
pub struct DecodeSample {
    exe: Executable,
    slots: usize,
    /// Whether this variant applies top-k / top-p (sorts the vocabulary).
    pub truncate: bool,
}

impl DecodeSample {
    /// Traces and compiles the program for weights of `dtype`.
    pub fn compile(
        client: &Client,
        config: &ModelConfig,
        dtype: DType,
        cache: &CacheShape,
        truncate: bool,
    ) -> Result<DecodeSample> {
        let kind = if truncate { "topk_topp" } else { "plain" };
        let name = format!("rollout_decode_{kind}_cache{}x{}", cache.slots, cache.max_len);
        let g = Graph::new(&name);
        let p = DecoderParams::declare(&g, config, dtype);
        let kv = cache.declare(&g);
        let s = cache.slots as i64;
        let tokens = g.parameter("tokens", DType::I32, &[s]);
        let positions = g.parameter("positions", DType::I32, &[s]);
        let temperature = g.parameter("temperature", DType::F32, &[s]);
        let top_k = g.parameter("top_k", DType::I32, &[s]);
        let top_p = g.parameter("top_p", DType::F32, &[s]);
        let keys = g.parameter("keys", DType::U32, &[s, 2]);
        let (logits, new_cache) = decode_graph(&p, &tokens, &positions, &kv);
        let inputs = SamplerInputs {
            temperature: &temperature,
            top_k: &top_k,
            top_p: &top_p,
            keys: &keys,
        };
        let (next, logprobs) = sample_graph(&logits, &inputs, truncate);
        let mut outs = vec![&next, &logprobs];
        outs.extend(new_cache.iter());
        let exe = compile(client, &g, &outs, &donate_cache(p.all.len(), 2, kv.len()), &name)?;
        Ok(DecodeSample {
            exe,
            slots: cache.slots,
            truncate,
        })
    }

    /// Runs one step; returns each slot's sampled token and its log-probability.
    pub fn run(
        &self,
        client: &Client,
        device: usize,
        weights: &[Buffer],
        cache: &mut Vec<Buffer>,
        inputs: &DecodeInputs,
    ) -> Result<(Vec<i32>, Vec<f32>)> {
        let what = if self.truncate {
            "decode (top-k/top-p)"
        } else {
            "decode"
        };
        let s = self.slots as i64;
        let err = |n: &str| {
            let n = n.to_string();
            move |e| RolloutError::runtime(format!("uploading {n} for {what}"), e)
        };
        let tb = client
            .buffer_from_host(&inputs.tokens, &[s], device)
            .map_err(err("tokens"))?;
        let pb = client
            .buffer_from_host(&inputs.positions, &[s], device)
            .map_err(err("positions"))?;
        let temp = client
            .buffer_from_host(&inputs.temperature, &[s], device)
            .map_err(err("temperatures"))?;
        let kb = client
            .buffer_from_host(&inputs.top_k, &[s], device)
            .map_err(err("top_k"))?;
        let ppb = client
            .buffer_from_host(&inputs.top_p, &[s], device)
            .map_err(err("top_p"))?;
        let keys = client
            .buffer_from_host(&inputs.keys, &[s, 2], device)
            .map_err(err("keys"))?;
        let out = run_donating(
            &self.exe,
            weights,
            cache,
            &[&tb, &pb, &temp, &kb, &ppb, &keys],
            2,
            what,
        )?;
        let next = out[0]
            .to_host::<i32>()
            .map_err(|e| RolloutError::runtime(format!("reading {what} tokens"), e))?;
        let lp = out[1]
            .to_host::<f32>()
            .map_err(|e| RolloutError::runtime(format!("reading {what} log-probs"), e))?;
        Ok((next, lp))
    }
}
