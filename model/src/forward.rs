//! The decoder forward pass as graph functions on the compute core (`xla::graph`): one code path
//! for every family, switched by the [`ModelConfig`] (QKV bias, RMSNorm on q and k per head,
//! tied or untied head, RoPE scaling through [`ModelConfig::rope_inv_freq_of`], Gemma's `1 + w`
//! norms, sandwich norms, GeGLU and scaled embeddings), with grouped-query attention, RoPE,
//! RMSNorm and a gated MLP or a mixture of experts ([`crate::moe`]).
//!
//! Layers differ only in their attention kind ([`AttentionKind`]: Gemma 3's sliding and global
//! layers, with their own RoPE): each pass builds the RoPE tables and masks once per kind
//! (`ByKind`) and a layer reads its kind's, a scanned body over both kinds selecting by a
//! scanned flag.
//!
//! Parameters are graph arguments named by their Hugging Face names, in
//! [`crate::param_table`] order, with Hugging Face shapes (`[out_features, in_features]` for
//! projections). They may be f32 or bf16/f16: element-wise work (norms, RoPE, softmax, residual
//! stream) is always f32; a narrower weight only makes its matrix product take narrow operands
//! with an f32 result.
//!
//! The functions here build the bodies of the compiled programs in [`crate::programs`]:
//! - [`prefill_graph`]: prompts padded to a length bucket, keys and values written into chosen
//!   slots of a KV cache laid out `[slots, kv_heads, max_len, head_dim]` per layer, logits of
//!   each prompt's last real token;
//! - [`decode_graph`]: one token for every slot at per-slot positions, reading and updating the
//!   cache, logits `[slots, vocab]`;
//! - [`logprobs_graph`]: per-token log-probabilities at a temperature and per-token entropy over
//!   padded sequences, computed through the output head in chunks of positions so the full
//!   `[tokens, vocab]` logits never exist at once; differentiable with respect to the
//!   parameters;
//! - [`full_logits_graph`]: every position's logits, for parity tests and small inputs.
//!
//! KV-cache invariant: in every slot, positions at or past the slot's current length hold
//! zeros. A fresh cache is zeros, prefill writes the whole `max_len` row of a slot (zeros past
//! the prompt), and decode writes each new key/value at its position with a scatter over the
//! cache's (slot, position) axes, an in-place write of one `[kv_heads, head_dim]` row per slot.
//! How decode writes is a [`KvWrite`]: that row scatter, or on TPU a masked rewrite of the
//! attended cache ([`KvWrite::for_plugin`]).
//!
//! The learner's forwards run each prompt once for the group of responses that follows it
//! ([`logprobs_graph_shared_prompts`], [`SharedPrompts`]), or each row whole
//! ([`logprobs_graph_span`]). In the differentiable forwards each layer is a rematerialised
//! region with [`DecoderParams::remat`], or all layers are one `Graph::scan` over their stacked
//! weights with [`DecoderParams::scan`]; `DecoderParams::run_layers` is the one place that
//! chooses, and `DecoderParams::run_routed_layers` the one place a forward's mixture-of-experts
//! routing is collected or replayed, layer by layer or through the scan.
//! [`DecoderParams::with_adapters`] applies LoRA adapters beside the weights
//! (`x·Wᵀ + s·(x·Aᵀ)·Bᵀ` in every adapted projection) instead of merging them.

use xla::graph::{DotDims, Graph, Tensor};
use xla::runtime::PluginKind;
use xla::DType;

use crate::config::{Activation, AttentionKind, ModelConfig};
use crate::moe::Routing;
use crate::params::{param_table, ParamLayout};

/// Value used for masked attention scores (finite, so a fully masked row gives a uniform
/// distribution instead of NaN; such rows are padding and their outputs are discarded).
const MASKED_SCORE: f64 = -1.0e30;

/// Full-sequence attention from this many positions on runs its queries in two causal halves
/// (see `self_attention`).
pub const CAUSAL_HALVES_FROM: i64 = 256;

/// Default number of positions per chunk of the output head in [`logprobs_graph`].
pub const DEFAULT_HEAD_CHUNK: i64 = 128;

/// The traced parameters of one decoder layer.
#[derive(Clone, Debug)]
pub struct LayerParams {
    /// `input_layernorm.weight` `[hidden]`.
    pub input_norm: Tensor,
    /// `self_attn.q_proj.weight` `[heads*head_dim, hidden]`.
    pub q_proj: Tensor,
    /// `self_attn.q_proj.bias` (Qwen2 / `attention_bias`).
    pub q_bias: Option<Tensor>,
    /// `self_attn.k_proj.weight` `[kv_heads*head_dim, hidden]`.
    pub k_proj: Tensor,
    /// `self_attn.k_proj.bias`.
    pub k_bias: Option<Tensor>,
    /// `self_attn.v_proj.weight` `[kv_heads*head_dim, hidden]`.
    pub v_proj: Tensor,
    /// `self_attn.v_proj.bias`.
    pub v_bias: Option<Tensor>,
    /// `self_attn.o_proj.weight` `[hidden, heads*head_dim]`.
    pub o_proj: Tensor,
    /// `self_attn.o_proj.bias` (Llama with `attention_bias`).
    pub o_bias: Option<Tensor>,
    /// `self_attn.q_norm.weight` `[head_dim]` (Qwen3).
    pub q_norm: Option<Tensor>,
    /// `self_attn.k_norm.weight` `[head_dim]` (Qwen3).
    pub k_norm: Option<Tensor>,
    /// `post_attention_layernorm.weight` `[hidden]`: the MLP's input norm, or with
    /// [`ModelConfig::sandwich_norms`] the attention output's.
    pub post_norm: Tensor,
    /// `pre_feedforward_layernorm.weight` `[hidden]` (Gemma): the MLP's input norm.
    pub pre_ffn_norm: Option<Tensor>,
    /// `post_feedforward_layernorm.weight` `[hidden]` (Gemma): the MLP output's norm.
    pub post_ffn_norm: Option<Tensor>,
    /// The MLP: dense SwiGLU, or a mixture of experts.
    pub mlp: Mlp,
    /// LoRA adapters applied beside the projections ([`DecoderParams::with_adapters`]).
    pub adapters: LayerAdapters,
    /// Which attention the layer runs.
    pub attention: LayerAttention,
}

/// Which attention a traced layer runs.
#[derive(Clone, Debug)]
pub enum LayerAttention {
    /// One kind, known when the layer is traced.
    Kind(AttentionKind),
    /// The body of a scan over layers of both kinds: a scanned i32 scalar, 1 in sliding
    /// layers, that selects between the two kinds' tables.
    Scanned(Tensor),
}

/// What a routed forward pass is given about its positions (all dimensions of the hidden
/// states but the last): which are real tokens (`valid`, 0/1) and, to replay a recorded
/// routing, each position's experts in every mixture-of-experts layer (`replay`, `[.., Lm, k]`).
#[derive(Clone, Copy)]
pub struct Routed<'a> {
    pub valid: &'a Tensor,
    pub replay: Option<&'a Tensor>,
}

/// A decoder layer's MLP.
#[derive(Clone, Debug)]
pub enum Mlp {
    /// SwiGLU: `mlp.gate_proj.weight`, `mlp.up_proj.weight` `[ffn, hidden]` and
    /// `mlp.down_proj.weight` `[hidden, ffn]`.
    Dense {
        gate_proj: Tensor,
        up_proj: Tensor,
        down_proj: Tensor,
    },
    /// A mixture of experts ([`crate::moe`]).
    Experts(crate::moe::Experts),
}

impl Mlp {
    fn tensors(&self) -> [&Tensor; 3] {
        match self {
            Mlp::Dense {
                gate_proj,
                up_proj,
                down_proj,
            } => [gate_proj, up_proj, down_proj],
            Mlp::Experts(e) => [&e.router, &e.gate_up, &e.down],
        }
    }

    fn with_tensors(&self, [a, b, c]: [Tensor; 3]) -> Mlp {
        match self {
            Mlp::Dense { .. } => Mlp::Dense {
                gate_proj: a,
                up_proj: b,
                down_proj: c,
            },
            Mlp::Experts(e) => Mlp::Experts(crate::moe::Experts {
                router: a,
                gate_up: b,
                down: c,
                lowering: e.lowering,
            }),
        }
    }
}

/// A LoRA adapter applied beside its frozen weight `W [out, in]`: the projection is
/// `x·Wᵀ + s·(x·Aᵀ)·Bᵀ`, the function of the merged weight `W + s·B·A`
/// ([`crate::lora::merged_weight`]) without forming it, in f32.
#[derive(Clone, Debug)]
pub struct Adapter {
    /// `A [r, in]`.
    pub a: Tensor,
    /// `B [out, r]`.
    pub b: Tensor,
    /// `s`: `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA).
    pub scale: f64,
}

/// The adapters of one decoder layer, by projection (none by default).
#[derive(Clone, Debug, Default)]
pub struct LayerAdapters {
    pub q: Option<Adapter>,
    pub k: Option<Adapter>,
    pub v: Option<Adapter>,
    pub o: Option<Adapter>,
    pub gate: Option<Adapter>,
    pub up: Option<Adapter>,
    pub down: Option<Adapter>,
    /// On the stacked experts (`A [r·E, in]`, `B [out, r·E]`, [`crate::lora`]), merged into
    /// them where the layer computes, so a scanned or rematerialised layer holds one layer's
    /// merged experts at a time.
    pub experts_gate_up: Option<Adapter>,
    pub experts_down: Option<Adapter>,
}

impl LayerAdapters {
    fn slot(&mut self, target: crate::lora::Target) -> &mut Option<Adapter> {
        use crate::lora::Target;
        match target {
            Target::Q => &mut self.q,
            Target::K => &mut self.k,
            Target::V => &mut self.v,
            Target::O => &mut self.o,
            Target::Gate => &mut self.gate,
            Target::Up => &mut self.up,
            Target::Down => &mut self.down,
            Target::ExpertsGateUp => &mut self.experts_gate_up,
            Target::ExpertsDown => &mut self.experts_down,
        }
    }

    /// Every adapter slot, in [`crate::lora::Target`] order.
    fn all(&self) -> [&Option<Adapter>; 9] {
        [
            &self.q,
            &self.k,
            &self.v,
            &self.o,
            &self.gate,
            &self.up,
            &self.down,
            &self.experts_gate_up,
            &self.experts_down,
        ]
    }

    /// `experts` with this layer's expert adapters merged in: expert `e` computes with
    /// `W[e] + s·B_e·A_e`.
    fn adapted_experts(&self, experts: &crate::moe::Experts) -> crate::moe::Experts {
        let merge = |w: &Tensor, ad: &Option<Adapter>| match ad {
            Some(ad) => crate::lora::merged_weight(w, &ad.a, &ad.b, ad.scale),
            None => w.clone(),
        };
        crate::moe::Experts {
            gate_up: merge(&experts.gate_up, &self.experts_gate_up),
            down: merge(&experts.down, &self.experts_down),
            ..experts.clone()
        }
    }
}

/// All traced parameters of a decoder, with the config that shapes them.
#[derive(Clone, Debug)]
pub struct DecoderParams {
    /// The model configuration.
    pub config: ModelConfig,
    /// `model.embed_tokens.weight` `[vocab, hidden]`.
    pub embed: Tensor,
    /// The layers, in order.
    pub layers: Vec<LayerParams>,
    /// `model.norm.weight` `[hidden]`.
    pub final_norm: Tensor,
    /// `lm_head.weight` `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<Tensor>,
    /// Every parameter in [`crate::param_table`] order (the program argument order).
    pub all: Vec<Tensor>,
    /// Trace each decoder layer of the differentiable forwards as a rematerialised region
    /// ([`Graph::checkpoint`]): the backward pass recomputes a layer's activations instead of
    /// keeping them (`model.enable_gradient_checkpointing`). Off by [`DecoderParams::from_tensors`].
    pub remat: bool,
    /// Trace the layers of the differentiable forwards once, as a loop over their stacked
    /// parameters ([`Graph::scan`], `model.scan_layers`), instead of once per layer: compile
    /// time stops growing with depth. The backward pass then recomputes each layer from its
    /// input, as with [`DecoderParams::remat`]. Off by [`DecoderParams::from_tensors`].
    pub scan: bool,
}

impl DecoderParams {
    /// Declares every parameter of `config` as a program argument of `g` (named by its Hugging
    /// Face name, in [`crate::param_table`] order) with element type `dtype`.
    pub fn declare(g: &Graph, config: &ModelConfig, dtype: DType) -> DecoderParams {
        DecoderParams::declare_laid_out(g, config, dtype, &ParamLayout::default())
    }

    /// [`DecoderParams::declare`] with each parameter laid out over the graph's mesh by
    /// `layout` (tensor parallelism, FSDP); whole where it splits nothing.
    pub fn declare_laid_out(
        g: &Graph,
        config: &ModelConfig,
        dtype: DType,
        layout: &ParamLayout,
    ) -> DecoderParams {
        let tensors: Vec<Tensor> = param_table(config)
            .iter()
            .map(|spec| match layout.sharding(spec) {
                Some(s) => g.parameter_sharded(&spec.name, dtype, &spec.dims(), s),
                None => g.parameter(&spec.name, dtype, &spec.dims()),
            })
            .collect();
        DecoderParams::from_tensors(config, &tensors).expect("declared tensors follow the parameter table")
    }

    /// Groups `tensors` (one per [`crate::param_table`] entry, in that order) into a
    /// [`DecoderParams`]; e.g. the argument list handed to `value_and_grad`'s closure.
    /// Fails with the name and shapes when a tensor is missing or wrongly shaped.
    pub fn from_tensors(config: &ModelConfig, tensors: &[Tensor]) -> Result<DecoderParams, String> {
        let table = param_table(config);
        if tensors.len() != table.len() {
            return Err(format!(
                "the {} parameter table has {} tensors, {} were given",
                config.family,
                table.len(),
                tensors.len()
            ));
        }
        let mut by_name = std::collections::HashMap::new();
        for (spec, t) in table.iter().zip(tensors) {
            let dims: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
            if t.dims() != dims.as_slice() {
                return Err(format!(
                    "parameter `{}` has shape {:?}, expected {:?}",
                    spec.name,
                    t.dims(),
                    dims
                ));
            }
            by_name.insert(spec.name.clone(), t.clone());
        }
        let take = |name: &str| by_name.get(name).cloned();
        let need = |name: &str| {
            take(name).ok_or_else(|| format!("parameter `{name}` is not in the parameter table"))
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            layers.push(LayerParams {
                input_norm: need(&p("input_layernorm.weight"))?,
                q_proj: need(&p("self_attn.q_proj.weight"))?,
                q_bias: take(&p("self_attn.q_proj.bias")),
                k_proj: need(&p("self_attn.k_proj.weight"))?,
                k_bias: take(&p("self_attn.k_proj.bias")),
                v_proj: need(&p("self_attn.v_proj.weight"))?,
                v_bias: take(&p("self_attn.v_proj.bias")),
                o_proj: need(&p("self_attn.o_proj.weight"))?,
                o_bias: take(&p("self_attn.o_proj.bias")),
                q_norm: take(&p("self_attn.q_norm.weight")),
                k_norm: take(&p("self_attn.k_norm.weight")),
                post_norm: need(&p("post_attention_layernorm.weight"))?,
                pre_ffn_norm: take(&p("pre_feedforward_layernorm.weight")),
                post_ffn_norm: take(&p("post_feedforward_layernorm.weight")),
                attention: LayerAttention::Kind(config.attention_kind(l)),
                mlp: if config.is_moe_layer(l) {
                    Mlp::Experts(crate::moe::Experts {
                        router: need(&p("mlp.gate.weight"))?,
                        gate_up: need(&p("mlp.experts.gate_up_proj"))?,
                        down: need(&p("mlp.experts.down_proj"))?,
                        lowering: Default::default(),
                    })
                } else {
                    Mlp::Dense {
                        gate_proj: need(&p("mlp.gate_proj.weight"))?,
                        up_proj: need(&p("mlp.up_proj.weight"))?,
                        down_proj: need(&p("mlp.down_proj.weight"))?,
                    }
                },
                adapters: LayerAdapters::default(),
            });
        }
        Ok(DecoderParams {
            config: config.clone(),
            embed: need("model.embed_tokens.weight")?,
            layers,
            final_norm: need("model.norm.weight")?,
            lm_head: take("lm_head.weight"),
            all: tensors.to_vec(),
            remat: false,
            scan: false,
        })
    }

    /// These parameters with every mixture-of-experts layer dispatching by `lowering`
    /// ([`crate::moe::MoeLowering`]; [`crate::moe::MoeLowering::Dense`] as declared).
    pub fn with_moe_lowering(mut self, lowering: crate::moe::MoeLowering) -> DecoderParams {
        for layer in &mut self.layers {
            if let Mlp::Experts(e) = &mut layer.mlp {
                e.lowering = lowering;
            }
        }
        self
    }

    /// These parameters with `lora`'s adapters applied beside their projections: `adapters`
    /// are `A`, `B` of each adapted projection in [`crate::lora::lora_param_table`] order
    /// (program arguments after the base's; [`DecoderParams::all`] lists them after it). The
    /// forward passes then compute `x·Wᵀ + s·(x·Aᵀ)·Bᵀ` where the merged form would compute
    /// `x·(W + s·B·A)ᵀ`: the same function, without a merged copy of the weights. Stacked
    /// experts' adapters are merged into the experts where each layer computes (applied beside
    /// them, every expert's adapter would run for every token of the dense dispatch).
    pub fn with_adapters(
        mut self,
        lora: &crate::lora::LoraConfig,
        adapters: &[Tensor],
    ) -> Result<DecoderParams, String> {
        let specs = crate::lora::lora_param_table(&self.config, lora);
        if adapters.len() != specs.len() {
            return Err(format!(
                "the adapters' table has {} tensors, {} were given",
                specs.len(),
                adapters.len()
            ));
        }
        for (spec, t) in specs.iter().zip(adapters) {
            if t.dims() != spec.dims().as_slice() {
                return Err(format!(
                    "adapter `{}` has shape {:?}, expected {:?}",
                    spec.name,
                    t.dims(),
                    spec.dims()
                ));
            }
        }
        let table = crate::lora::lora_table(&self.config, lora);
        for (spec, pair) in table.iter().zip(adapters.chunks_exact(2)) {
            *self.layers[spec.layer].adapters.slot(spec.target) = Some(Adapter {
                a: pair[0].clone(),
                b: pair[1].clone(),
                scale: lora.scale(),
            });
        }
        self.all.extend(adapters.iter().cloned());
        Ok(self)
    }

    /// The output projection `[vocab, hidden]` (the embedding when tied).
    pub fn head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Runs `layer` (one decoder layer's trace) as a rematerialised region when
    /// [`DecoderParams::remat`] is on, else as it is.
    fn layer<R>(&self, layer: impl FnOnce() -> R) -> R {
        if self.remat {
            self.graph().checkpoint(layer)
        } else {
            layer()
        }
    }

    /// The hidden states after every layer, each computed by `layer_fn(layer, h)`: one traced
    /// layer per layer (rematerialised with [`DecoderParams::remat`]), or one scanned over the
    /// layers' stacked parameters with [`DecoderParams::scan`].
    fn run_layers(&self, h: Tensor, layer_fn: impl Fn(&LayerParams, &Tensor) -> Tensor) -> Tensor {
        self.run_routed_layers(h, None, |layer, h, _| (layer_fn(layer, h), None))
            .0
    }

    /// [`DecoderParams::run_layers`] for layers that may route: `layer_fn(layer, h, replay)`
    /// also returns a mixture-of-experts layer's [`Routing`]; with `routed` its
    /// [`crate::moe::Routes`] over the positions of `h` (all but its last dimension) come back,
    /// and its `replay` choices (`[.., Lm, k]`) are handed to the MoE layers, one `[.., k]` each.
    fn run_routed_layers(
        &self,
        h: Tensor,
        routed: Option<Routed>,
        layer_fn: impl Fn(&LayerParams, &Tensor, Option<&Tensor>) -> (Tensor, Option<Routing>),
    ) -> (Tensor, Option<crate::moe::Routes>) {
        let lead: Vec<i64> = h.dims()[..h.rank() - 1].to_vec();
        let k = self.config.moe.as_ref().map_or(0, |m| m.experts_per_token as i64);
        let moe_layers: Vec<usize> = (0..self.layers.len())
            .filter(|&l| self.config.is_moe_layer(l))
            .collect();
        let routed = routed.filter(|_| !moe_layers.is_empty());
        let valid = routed
            .as_ref()
            .map(|r| r.valid.convert_if_needed(DType::F32).reshape(&[-1]));
        let sums = |routing: &Routing| crate::moe::layer_sums(routing, valid.as_ref().expect("routed"));
        let mut with_k = lead.clone();
        with_k.push(k);
        let replay_of = |j: usize| {
            routed
                .as_ref()
                .and_then(|r| r.replay)
                .map(|r| r.slice_axis(lead.len(), j as i64, j as i64 + 1).reshape(&with_k))
        };
        // Per MoE layer: chosen [.., k], tokens per expert [E], probability sums [E], entropy [].
        let mut reports: Vec<[Tensor; 4]> = Vec::new();
        let h = if !self.scan {
            let mut h = h;
            for (l, layer) in self.layers.iter().enumerate() {
                let j = moe_layers.iter().position(|&m| m == l);
                let replay = j.and_then(replay_of);
                let (next, report) = self.layer(|| {
                    let (next, routing) = layer_fn(layer, &h, replay.as_ref());
                    let report = routing.filter(|_| routed.is_some()).map(|r| {
                        let (t, p, e) = sums(&r);
                        [r.chosen, t, p, e]
                    });
                    (next, report)
                });
                reports.extend(report);
                h = next;
            }
            h
        } else {
            assert!(
                moe_layers.is_empty() || moe_layers.len() == self.layers.len(),
                "one scanned layer body needs every layer alike (all dense or all mixtures of experts)"
            );
            let per_layer: Vec<Vec<Tensor>> = self.layers.iter().map(LayerParams::tensors).collect();
            let mut stacked: Vec<Tensor> = (0..per_layer[0].len())
                .map(|j| {
                    let rows: Vec<Tensor> = per_layer
                        .iter()
                        .map(|ts| {
                            let mut dims = vec![1];
                            dims.extend_from_slice(ts[j].dims());
                            ts[j].reshape(&dims)
                        })
                        .collect();
                    Tensor::concat(&rows.iter().collect::<Vec<_>>(), 0)
                })
                .collect();
            let n_params = stacked.len();
            // The replayed choices scanned with the layers: [.., Lm, k] -> [Lm, .., k].
            let replay = routed.as_ref().and_then(|r| r.replay).map(|r| {
                let rank = r.rank();
                let mut perm = vec![rank - 2];
                perm.extend(0..rank - 2);
                perm.push(rank - 1);
                r.transpose(&perm)
            });
            let has_replay = replay.is_some();
            stacked.extend(replay);
            // Layers of both attention kinds (Gemma 3): each layer's kind scanned beside it.
            let kinds = self.config.attention_kinds().len() > 1;
            if kinds {
                let flags: Vec<f64> = (0..self.layers.len())
                    .map(|l| f64::from(self.config.attention_kind(l) == AttentionKind::Sliding))
                    .collect();
                stacked.push(
                    self.graph()
                        .constant_f64(&flags, DType::I32, &[flags.len() as i64]),
                );
            }
            let (carry, ys) = self.graph().scan(&[h], &stacked, false, |h, slices| {
                let mut layer = self.layers[0].with_tensors(&slices[..n_params]);
                let mut rest = slices[n_params..].iter();
                let replay = if has_replay { rest.next() } else { None };
                if kinds {
                    let flag = rest.next().expect("the kinds are scanned");
                    layer.attention = LayerAttention::Scanned(flag.clone());
                }
                let (next, routing) = layer_fn(&layer, &h[0], replay);
                let ys = match routing.filter(|_| routed.is_some()) {
                    Some(r) => {
                        let (t, p, e) = sums(&r);
                        // A differentiable scan's outputs are floats: the expert ids go out as
                        // f32 (exact up to 2^24) and come back as i32 below.
                        vec![r.chosen.convert(DType::F32).stop_gradient(), t, p, e]
                    }
                    None => Vec::new(),
                };
                (vec![next], ys)
            });
            if let [chosen, t, p, e] = ys.as_slice() {
                // [Lm, .., k] -> one [.., k] per layer, as the unrolled layers give them.
                for j in 0..moe_layers.len() as i64 {
                    let row = |x: &Tensor| {
                        let dims = x.dims()[1..].to_vec();
                        x.slice_axis(0, j, j + 1).reshape(&dims)
                    };
                    reports.push([row(chosen).convert(DType::I32), row(t), row(p), row(e)]);
                }
            }
            carry.into_iter().next().expect("one carried value")
        };
        if reports.is_empty() {
            return (h, None);
        }
        let stack = |i: usize, axis: usize| {
            let parts: Vec<Tensor> = reports.iter().map(|r| r[i].keep_axis(axis)).collect();
            Tensor::concat(&parts.iter().collect::<Vec<_>>(), axis)
        };
        let routes = crate::moe::Routes {
            chosen: stack(0, lead.len()),
            tokens_per_expert: stack(1, 0),
            prob_sum: stack(2, 0),
            entropy_sum: stack(3, 0),
        };
        (h, Some(routes))
    }

    fn graph(&self) -> &Graph {
        self.embed.graph()
    }
}

impl LayerParams {
    /// Every tensor of the layer in a fixed order (the optional ones and adapters where set).
    fn tensors(&self) -> Vec<Tensor> {
        let adapters = self.adapters.all();
        [
            Some(&self.input_norm),
            Some(&self.q_proj),
            self.q_bias.as_ref(),
            Some(&self.k_proj),
            self.k_bias.as_ref(),
            Some(&self.v_proj),
            self.v_bias.as_ref(),
            Some(&self.o_proj),
            self.o_bias.as_ref(),
            self.q_norm.as_ref(),
            self.k_norm.as_ref(),
            Some(&self.post_norm),
            self.pre_ffn_norm.as_ref(),
            self.post_ffn_norm.as_ref(),
        ]
        .into_iter()
        .flatten()
        .chain(self.mlp.tensors())
        .cloned()
        .chain(
            adapters
                .into_iter()
                .flatten()
                .flat_map(|ad| [ad.a.clone(), ad.b.clone()]),
        )
        .collect()
    }

    /// A layer shaped like this one whose tensors are `ts`, in [`LayerParams::tensors`] order.
    fn with_tensors(&self, ts: &[Tensor]) -> LayerParams {
        let mut it = ts.iter().cloned();
        let mut next = || it.next().expect("one tensor per field");
        let input_norm = next();
        let q_proj = next();
        let q_bias = self.q_bias.as_ref().map(|_| next());
        let k_proj = next();
        let k_bias = self.k_bias.as_ref().map(|_| next());
        let v_proj = next();
        let v_bias = self.v_bias.as_ref().map(|_| next());
        let o_proj = next();
        let o_bias = self.o_bias.as_ref().map(|_| next());
        let q_norm = self.q_norm.as_ref().map(|_| next());
        let k_norm = self.k_norm.as_ref().map(|_| next());
        let post_norm = next();
        let pre_ffn_norm = self.pre_ffn_norm.as_ref().map(|_| next());
        let post_ffn_norm = self.post_ffn_norm.as_ref().map(|_| next());
        let mlp = self.mlp.with_tensors([next(), next(), next()]);
        let a = &self.adapters;
        let mut adapter = |o: &Option<Adapter>| {
            o.as_ref().map(|ad| Adapter {
                a: next(),
                b: next(),
                scale: ad.scale,
            })
        };
        let adapters = LayerAdapters {
            q: adapter(&a.q),
            k: adapter(&a.k),
            v: adapter(&a.v),
            o: adapter(&a.o),
            gate: adapter(&a.gate),
            up: adapter(&a.up),
            down: adapter(&a.down),
            experts_gate_up: adapter(&a.experts_gate_up),
            experts_down: adapter(&a.experts_down),
        };
        LayerParams {
            input_norm,
            q_proj,
            q_bias,
            k_proj,
            k_bias,
            v_proj,
            v_bias,
            o_proj,
            o_bias,
            q_norm,
            k_norm,
            post_norm,
            pre_ffn_norm,
            post_ffn_norm,
            mlp,
            adapters,
            attention: self.attention.clone(),
        }
    }
}

fn linear_bias(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let y = x.linear(w);
    match b {
        Some(b) => &y + &b.convert_if_needed(DType::F32),
        None => y,
    }
}

/// A projection with its bias and, when it has one, its LoRA adapter applied beside it
/// (`+ s·(x·Aᵀ)·Bᵀ`, in f32).
fn project(x: &Tensor, w: &Tensor, b: Option<&Tensor>, adapter: Option<&Adapter>) -> Tensor {
    let y = linear_bias(x, w, b);
    match adapter {
        Some(ad) => {
            let delta = x.linear(&ad.a).linear(&ad.b);
            &y + &(&delta * &delta.scalar_like(ad.scale))
        }
        None => y,
    }
}

/// The model's RMSNorm of `x` with scale `w`, in f32: `x̂ · w`, or `x̂ · (1 + w)` with
/// [`ModelConfig::norm_unit_offset`] (Gemma).
fn rms_norm(config: &ModelConfig, x: &Tensor, w: &Tensor) -> Tensor {
    let w = w.convert_if_needed(DType::F32);
    let w = if config.norm_unit_offset { &w + 1.0 } else { w };
    x.rms_norm(&w, config.rms_norm_eps)
}

/// Token embeddings as f32: `[...]` integer ids -> `[..., hidden]`; with
/// [`ModelConfig::scale_embeddings`] multiplied by `sqrt(hidden)` in the table's type first,
/// as Gemma's scaled embedding rounds it.
fn embed(p: &DecoderParams, tokens: &Tensor) -> Tensor {
    let rows = p.embed.take(&tokens.convert_if_needed(DType::I32), 0);
    let rows = if p.config.scale_embeddings {
        let scale = (p.config.hidden_size as f64).sqrt();
        &rows * &rows.scalar_like(scale)
    } else {
        rows
    };
    rows.convert_if_needed(DType::F32)
}

/// RoPE `cos` and `sin` of layers of attention `kind` ([`ModelConfig::rope_inv_freq_of`]), of
/// shape `positions.dims ++ [head_dim]` (the "rotate half" layout: the angles repeated
/// twice), computed in f32 as transformers does.
pub fn rope_tables(config: &ModelConfig, kind: AttentionKind, positions: &Tensor) -> (Tensor, Tensor) {
    let g = positions.graph();
    let inv: Vec<f64> = config
        .rope_inv_freq_of(kind)
        .iter()
        .map(|&f| f as f32 as f64)
        .collect();
    let half = inv.len() as i64;
    let inv = g.constant_f64(&inv, DType::F32, &[half]);
    let pos = positions.convert_if_needed(DType::F32);
    let rank = pos.rank();
    let mut dims = pos.dims().to_vec();
    dims.push(half);
    let angles = &pos.keep_axis(rank).broadcast_to(&dims) * &inv.broadcast_to(&dims);
    let emb = Tensor::concat(&[&angles, &angles], rank);
    // Materialised once: left free, XLA fuses the cosine and sine into every layer's rotation,
    // forward and backward, recomputing them ~100 times per pass.
    let tables = g.optimization_barrier(&[&emb.cos(), &emb.sin()]);
    (tables[0].clone(), tables[1].clone())
}

/// What attention reads that depends on a layer's [`AttentionKind`] (RoPE tables, masks):
/// `N` tensors for each kind the model's layers use, built once per pass.
struct ByKind<const N: usize> {
    full: Option<[Tensor; N]>,
    sliding: Option<[Tensor; N]>,
}

impl<const N: usize> ByKind<N> {
    /// `build(kind)` for each kind among `config`'s layers.
    fn new(config: &ModelConfig, build: impl Fn(AttentionKind) -> [Tensor; N]) -> Self {
        let kinds = config.attention_kinds();
        let of = |k| kinds.contains(&k).then(|| build(k));
        ByKind {
            full: of(AttentionKind::Full),
            sliding: of(AttentionKind::Sliding),
        }
    }

    /// The tensors of `layer`'s kind; in a scanned body over both kinds, each selected by the
    /// layer's scanned flag.
    fn of(&self, layer: &LayerParams) -> [Tensor; N] {
        let pick = |kind| {
            match kind {
                AttentionKind::Full => self.full.as_ref(),
                AttentionKind::Sliding => self.sliding.as_ref(),
            }
            .expect("tables are built for every kind the layers use")
            .clone()
        };
        match &layer.attention {
            LayerAttention::Kind(kind) => pick(*kind),
            LayerAttention::Scanned(flag) => {
                let (sliding, full) = (pick(AttentionKind::Sliding), pick(AttentionKind::Full));
                let is_sliding = flag.ne(&flag.zeros_like());
                std::array::from_fn(|i| {
                    is_sliding
                        .broadcast_to(full[i].dims())
                        .select(&sliding[i], &full[i])
                })
            }
        }
    }
}

/// The layer's MLP: SwiGLU `down(silu(gate(x)) * up(x))` (GeGLU with
/// [`Activation::GeluTanh`]), or its mixture of experts (routed by
/// its router, or by `replay` `[.., k]`, and then its [`Routing`] too).
fn mlp(
    config: &ModelConfig,
    layer: &LayerParams,
    x: &Tensor,
    replay: Option<&Tensor>,
) -> (Tensor, Option<Routing>) {
    match &layer.mlp {
        Mlp::Dense {
            gate_proj,
            up_proj,
            down_proj,
        } => {
            let ad = &layer.adapters;
            let gate = project(x, gate_proj, None, ad.gate.as_ref());
            let gate = match config.activation {
                Activation::Silu => gate.silu(),
                Activation::GeluTanh => gate.gelu_tanh(),
            };
            let up = project(x, up_proj, None, ad.up.as_ref());
            (project(&(&gate * &up), down_proj, None, ad.down.as_ref()), None)
        }
        Mlp::Experts(experts) => {
            let moe = config.moe.as_ref().expect("an experts layer has a MoE config");
            let experts = layer.adapters.adapted_experts(experts);
            let (y, routing) = crate::moe::moe_mlp(moe, &experts, x, replay);
            (y, Some(routing))
        }
    }
}

/// q, k, v of a batch of positions `x [..., hidden]`: q `[..., heads, head_dim]`, k and v
/// `[..., kv_heads, head_dim]`; q and k normed per head (Qwen3) and rotated by `cos`/`sin`
/// (shaped `[..., head_dim]`, broadcast over heads).
fn qkv(
    config: &ModelConfig,
    layer: &LayerParams,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> (Tensor, Tensor, Tensor) {
    let hd = config.head_dim as i64;
    let heads = config.num_attention_heads as i64;
    let kvh = config.num_key_value_heads as i64;
    let lead = x.dims()[..x.rank() - 1].to_vec();
    let shaped = |t: Tensor, n: i64| {
        let mut d = lead.clone();
        d.extend([n, hd]);
        t.reshape(&d)
    };
    let ad = &layer.adapters;
    let mut q = shaped(
        project(x, &layer.q_proj, layer.q_bias.as_ref(), ad.q.as_ref()),
        heads,
    );
    let mut k = shaped(
        project(x, &layer.k_proj, layer.k_bias.as_ref(), ad.k.as_ref()),
        kvh,
    );
    let v = shaped(
        project(x, &layer.v_proj, layer.v_bias.as_ref(), ad.v.as_ref()),
        kvh,
    );
    if let Some(w) = &layer.q_norm {
        q = rms_norm(config, &q, w);
    }
    if let Some(w) = &layer.k_norm {
        k = rms_norm(config, &k, w);
    }
    let axis = cos.rank() - 1;
    let cos_h = cos.keep_axis(axis);
    let sin_h = sin.keep_axis(axis);
    (q.rope(&cos_h, &sin_h), k.rope(&cos_h, &sin_h), v)
}

/// A matrix product inside attention: f32 operands give an f32 result; narrow (bf16/f16)
/// operands give an f32 result too (the fast path of XLA CPU, and f32 accumulation).
fn attention_dot(a: &Tensor, b: &Tensor, dims: DotDims) -> Tensor {
    if a.dtype() == DType::F32 {
        a.dot_general(b, dims, None)
    } else {
        a.dot_general(b, dims, Some(DType::F32))
    }
}

/// Attention scores per (batch, KV head): the last axis of `q` (queries grouped under their
/// KV head, e.g. `[B, kvh, G, T, hd]`) against the last axis of `k` (`[B, kvh, S, hd]`):
/// `[B, kvh, G, T, S]`.
fn grouped_scores(q: &Tensor, k: &Tensor) -> Tensor {
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![q.rank() - 1],
        rhs_contract: vec![k.rank() - 1],
    };
    attention_dot(q, k, dims)
}

/// Attention outputs per (batch, KV head): probabilities over keys on their last axis (e.g.
/// `[B, kvh, G, T, S]`) times values `[B, kvh, S, hd]`: `[B, kvh, G, T, hd]`.
fn grouped_values(probs: &Tensor, v: &Tensor) -> Tensor {
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![probs.rank() - 1],
        rhs_contract: vec![2],
    };
    attention_dot(probs, v, dims)
}

/// The rest of a decoder layer after attention: output projection and residual, then the
/// post-attention norm, the MLP and its residual (with [`ModelConfig::sandwich_norms`], the
/// attention's and the MLP's outputs normed before their residuals).
fn finish_layer(config: &ModelConfig, layer: &LayerParams, h: &Tensor, attn: &Tensor) -> Tensor {
    finish_routed_layer(config, layer, h, attn, None).0
}

/// [`finish_layer`] in an inference pass, adding a mixture-of-experts layer's chosen experts
/// `[.., k]` to `chosen` (what the rollout records for routing replay).
fn finish_layer_recording(
    config: &ModelConfig,
    layer: &LayerParams,
    h: &Tensor,
    attn: &Tensor,
    chosen: &mut Vec<Tensor>,
) -> Tensor {
    let (h, routing) = finish_routed_layer(config, layer, h, attn, None);
    chosen.extend(routing.map(|r| r.chosen));
    h
}

/// The experts an inference pass chose, `[.., Lm, k]` i32, from each mixture-of-experts
/// layer's `[.., k]` in layer order; `None` for a dense model.
fn stack_choices(chosen: Vec<Tensor>) -> Option<Tensor> {
    let rank = chosen.first()?.rank();
    let parts: Vec<Tensor> = chosen.iter().map(|c| c.keep_axis(rank - 1)).collect();
    Some(Tensor::concat(&parts.iter().collect::<Vec<_>>(), rank - 1))
}

/// [`finish_layer`] with a mixture-of-experts MLP's replayed choices and its [`Routing`].
fn finish_routed_layer(
    config: &ModelConfig,
    layer: &LayerParams,
    h: &Tensor,
    attn: &Tensor,
    replay: Option<&Tensor>,
) -> (Tensor, Option<Routing>) {
    let out = project(
        attn,
        &layer.o_proj,
        layer.o_bias.as_ref(),
        layer.adapters.o.as_ref(),
    );
    if let (Some(pre), Some(post)) = (&layer.pre_ffn_norm, &layer.post_ffn_norm) {
        // Gemma's sandwich: each sublayer's output normed before its residual add.
        let h = h + &rms_norm(config, &out, &layer.post_norm);
        let (y, routing) = mlp(config, layer, &rms_norm(config, &h, pre), replay);
        return (&h + &rms_norm(config, &y, post), routing);
    }
    let h = h + &out;
    let normed = rms_norm(config, &h, &layer.post_norm);
    let (y, routing) = mlp(config, layer, &normed, replay);
    (&h + &y, routing)
}

/// Attention of a full sequence over itself.
///
/// `x [B, T, hidden]`, `cos`/`sin` `[B, T, head_dim]`, `allowed [B, 1, 1, T, T]` (bool: query
/// t may attend key s). Returns the heads' outputs `[B, T, heads * head_dim]` (before the output
/// projection, which [`finish_layer`] applies) and the keys and values `[B, kv_heads, T,
/// head_dim]` (the cache layout).
///
/// Long sequences run in causal halves ([`causal_attend`]), which skips the quarter of the
/// scores above the diagonal; finer blocks gained less (BENCHMARKS.md, "Learner").
fn self_attention(
    config: &ModelConfig,
    layer: &LayerParams,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    allowed: &Tensor,
) -> (Tensor, Tensor, Tensor) {
    let (q, k, v) = qkv(config, layer, x, cos, sin);
    let k = k.transpose(&[0, 2, 1, 3]);
    let v = v.transpose(&[0, 2, 1, 3]);
    let out = causal_attend(config, layer, &q, &k, &v, allowed);
    (out, k, v)
}

/// [`attend`] of a sequence over itself, where `allowed` is causal in column order (a query
/// never sees a later column; padding anywhere). From [`CAUSAL_HALVES_FROM`] positions the
/// first half of the queries runs over the first half of the keys only, so the quarter of the
/// scores above the diagonal is never computed.
fn causal_attend(
    config: &ModelConfig,
    layer: &LayerParams,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    allowed: &Tensor,
) -> Tensor {
    let t = q.dims()[1];
    if t < CAUSAL_HALVES_FROM || t % 2 != 0 {
        return attend(config, layer, q, k, v, allowed);
    }
    let half = t / 2;
    let early = attend(
        config,
        layer,
        &q.slice_axis(1, 0, half),
        &k.slice_axis(2, 0, half),
        &v.slice_axis(2, 0, half),
        &allowed.slice_axis(3, 0, half).slice_axis(4, 0, half),
    );
    let late = attend(
        config,
        layer,
        &q.slice_axis(1, half, t),
        k,
        v,
        &allowed.slice_axis(3, half, t),
    );
    Tensor::concat(&[&early, &late], 1)
}

/// Grouped-query attention of queries `q [B, T, heads, head_dim]` over keys and values
/// `[B, kv_heads, S, head_dim]` where `allowed [B, 1, 1, T, S]` (bool) says so. Returns the
/// heads' outputs `[B, T, heads * head_dim]`.
///
/// With narrow (bf16/f16) projection weights the score and value products take operands of
/// that type with f32 results (scores and softmax stay f32).
fn attend(
    config: &ModelConfig,
    layer: &LayerParams,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    allowed: &Tensor,
) -> Tensor {
    let (b, t) = (q.dims()[0], q.dims()[1]);
    let hd = config.head_dim as i64;
    let kvh = config.num_key_value_heads as i64;
    let groups = (config.num_attention_heads / config.num_key_value_heads) as i64;
    // q [B, T, H, hd] -> [B, H, T, hd] -> [B, kvh, G, T, hd] (query head h uses kv head h / G).
    let q = q.transpose(&[0, 2, 1, 3]).reshape(&[b, kvh, groups, t, hd]);
    let operand = layer.q_proj.dtype();
    let scores = grouped_scores(&q.convert_if_needed(operand), &k.convert_if_needed(operand))
        * config.attention_scale();
    let masked = allowed.select(&scores, &scores.scalar_like(MASKED_SCORE));
    let probs = masked.softmax(-1).convert_if_needed(operand);
    // [B, kvh, G, T, S] x [B, kvh, S, hd] -> [B, kvh, G, T, hd]
    grouped_values(&probs, &v.convert_if_needed(operand))
        .transpose(&[0, 3, 1, 2, 4])
        .reshape(&[b, t, kvh * groups * hd])
}

/// `allowed` and, with a sliding `window` (a sliding layer's), the key among the
/// query's last `window` positions (itself included: `q - k < window`), as transformers'
/// sliding-window mask.
fn and_within(allowed: Tensor, q_pos: &Tensor, k_pos: &Tensor, window: Option<usize>) -> Tensor {
    match window {
        Some(w) => allowed.and(&within(q_pos, k_pos, w)),
        None => allowed,
    }
}

/// The key at `k_pos` among the last `window` positions of the query at `q_pos`.
fn within(q_pos: &Tensor, k_pos: &Tensor, window: usize) -> Tensor {
    (q_pos - k_pos).lt(&q_pos.full_like(window as f64))
}

/// Positions from a `[B, T]` 0/1 mask: the number of real tokens before each one
/// (`cumsum(mask) - 1`, at least 0), so left padding and right padding both give real tokens
/// positions 0, 1, 2, ...
fn positions_from_mask(mask: &Tensor) -> Tensor {
    let m = mask.convert_if_needed(DType::I32);
    let pos = &m.cumsum(1, false) - &m.scalar_like(1.0);
    pos.max(&pos.scalar_like(0.0))
}

/// `allowed [B, 1, 1, T, T]`: causal, the key a real token and, with a sliding `window`, among
/// the query's last `window` positions. A row's real tokens are contiguous (left or right
/// padding), so column distances are position distances.
fn causal_padding_mask(mask: &Tensor, window: Option<usize>) -> Tensor {
    let g = mask.graph();
    let (b, t) = (mask.dims()[0], mask.dims()[1]);
    let q_idx = g.iota(DType::I32, &[t, t], 0);
    let k_idx = g.iota(DType::I32, &[t, t], 1);
    let causal = and_within(k_idx.le(&q_idx), &q_idx, &k_idx, window).reshape(&[1, t, t]);
    let key_real = mask
        .convert_if_needed(DType::I32)
        .ne(&g.zeros(DType::I32, &[b, t]))
        .reshape(&[b, 1, t]);
    causal
        .broadcast_to(&[b, t, t])
        .and(&key_real.broadcast_to(&[b, t, t]))
        .reshape(&[b, 1, 1, t, t])
}

/// Runs every layer over full sequences: the final hidden states (before the final norm)
/// `[B, T, hidden]`.
fn trunk(p: &DecoderParams, tokens: &Tensor, mask: &Tensor) -> Tensor {
    let config = &p.config;
    let tables = sequence_tables(config, mask);
    p.run_layers(embed(p, tokens), |layer, h| {
        let [cos, sin, allowed] = tables.of(layer);
        let normed = rms_norm(config, h, &layer.input_norm);
        let (attn, _, _) = self_attention(config, layer, &normed, &cos, &sin, &allowed);
        finish_layer(config, layer, h, &attn)
    })
}

/// Each layer kind's RoPE tables and mask (`[cos, sin, allowed]`) over full sequences with a
/// 0/1 `mask [B, T]`.
fn sequence_tables(config: &ModelConfig, mask: &Tensor) -> ByKind<3> {
    let positions = positions_from_mask(mask);
    ByKind::new(config, |kind| {
        let (cos, sin) = rope_tables(config, kind, &positions);
        [cos, sin, causal_padding_mask(mask, config.window_of(kind))]
    })
}

/// [`trunk`] with its [`crate::moe::Routes`] over `[B, T]` (valid where `mask` is set) and,
/// given `replay [B, T, Lm, k]`, those experts used.
fn trunk_routed(
    p: &DecoderParams,
    tokens: &Tensor,
    mask: &Tensor,
    replay: Option<&Tensor>,
) -> (Tensor, Option<crate::moe::Routes>) {
    let config = &p.config;
    let tables = sequence_tables(config, mask);
    let routed = Some(Routed { valid: mask, replay });
    p.run_routed_layers(embed(p, tokens), routed, |layer, h, replay| {
        let [cos, sin, allowed] = tables.of(layer);
        let normed = rms_norm(config, h, &layer.input_norm);
        let (attn, _, _) = self_attention(config, layer, &normed, &cos, &sin, &allowed);
        finish_routed_layer(config, layer, h, &attn, replay)
    })
}

/// [`trunk`], also returning each layer's keys and values `[B, kv_heads, T, head_dim]` and
/// the experts chosen `[B, T, Lm, k]` (for prefill; always one traced layer per layer).
fn trunk_with_kv(
    p: &DecoderParams,
    tokens: &Tensor,
    mask: &Tensor,
) -> (Tensor, Vec<(Tensor, Tensor)>, Option<Tensor>) {
    let config = &p.config;
    let tables = sequence_tables(config, mask);
    let mut h = embed(p, tokens);
    let mut kvs = Vec::with_capacity(p.layers.len());
    let mut chosen = Vec::new();
    for layer in &p.layers {
        let [cos, sin, allowed] = tables.of(layer);
        let normed = rms_norm(config, &h, &layer.input_norm);
        let (attn, k, v) = self_attention(config, layer, &normed, &cos, &sin, &allowed);
        h = finish_layer_recording(config, layer, &h, &attn, &mut chosen);
        kvs.push((k, v));
    }
    (h, kvs, stack_choices(chosen))
}

/// Every position's logits `[B, T, vocab]` (f32) for `tokens [B, T]` with a 0/1 `mask [B, T]`
/// (padding anywhere; real tokens get positions 0, 1, ... in order). Materialises the full
/// logits: meant for parity tests and short inputs.
pub fn full_logits_graph(p: &DecoderParams, tokens: &Tensor, mask: &Tensor) -> Tensor {
    hidden_states_graph(p, tokens, mask).linear(p.head())
}

/// Every position's final hidden state `[B, T, hidden]` (after the final norm, what the output
/// head reads) for `tokens [B, T]` with a 0/1 `mask [B, T]`, as in [`full_logits_graph`].
pub fn hidden_states_graph(p: &DecoderParams, tokens: &Tensor, mask: &Tensor) -> Tensor {
    let h = trunk(p, tokens, mask);
    rms_norm(&p.config, &h, &p.final_norm)
}

/// Per-token log-probabilities and entropies over padded sequences.
///
/// `tokens [B, T]` integer ids, `mask [B, T]` 0/1 (1 = real token; causal attention over real
/// tokens only), `temperature` an f32 scalar: logits are divided by it before the softmax.
/// Returns `(logprobs, entropy)`, both `[B, T]` f32 and aligned with the tokens: entry `t` is
/// `log p(tokens[t] | tokens[<t])` and the entropy of that predicted distribution. Entries
/// whose token or predecessor is padding, and entry 0, are 0.
///
/// Differentiable with respect to the parameters; the output head runs over chunks of
/// [`DEFAULT_HEAD_CHUNK`] positions (see [`logprobs_graph_chunked`]).
pub fn logprobs_graph(
    g: &Graph,
    p: &DecoderParams,
    tokens: &Tensor,
    mask: &Tensor,
    temperature: &Tensor,
) -> (Tensor, Tensor) {
    logprobs_graph_chunked(g, p, tokens, mask, temperature, DEFAULT_HEAD_CHUNK)
}

/// [`logprobs_graph`] with the output head applied to `chunk` positions at a time, so at most
/// `[B, chunk, vocab]` logits exist at once.
pub fn logprobs_graph_chunked(
    g: &Graph,
    p: &DecoderParams,
    tokens: &Tensor,
    mask: &Tensor,
    temperature: &Tensor,
    chunk: i64,
) -> (Tensor, Tensor) {
    let (b, t) = (tokens.dims()[0], tokens.dims()[1]);
    let h = trunk(p, tokens, mask);
    let h = rms_norm(&p.config, &h, &p.final_norm);
    let zero_col = g.zeros(DType::F32, &[b, 1]);
    if t < 2 {
        let z = g.zeros(DType::F32, &[b, t]);
        return (z.clone(), z);
    }
    // Position i (0..T-1) predicts token i+1.
    let ids = tokens.convert_if_needed(DType::I32);
    let (lp, ent) = head_log_probs(
        g,
        p,
        &h.slice_axis(1, 0, t - 1),
        &ids.slice_axis(1, 1, t),
        temperature,
        chunk,
    );
    let lp = Tensor::concat(&[&zero_col, &lp], 1);
    let ent = Tensor::concat(&[&zero_col, &ent], 1);
    // Valid where the token and its predecessor are real.
    let m = mask.convert_if_needed(DType::F32);
    let prev = Tensor::concat(&[&zero_col, &m.slice_axis(1, 0, t - 1)], 1);
    let valid = &m * &prev;
    (&lp * &valid, &ent * &valid)
}

/// The output head over normed hidden states `h [B, S, D]`, `chunk` positions at a time:
/// `log_softmax(logits / T)` of `targets [B, S]` and the entropies, both `[B, S]`.
fn head_log_probs(
    g: &Graph,
    p: &DecoderParams,
    h: &Tensor,
    targets: &Tensor,
    temperature: &Tensor,
    chunk: i64,
) -> (Tensor, Tensor) {
    let inv_temp = temperature.convert_if_needed(DType::F32).reshape(&[]);
    let inv_temp = &g.scalar(1.0, DType::F32) / &inv_temp;
    let (span, chunk) = (h.dims()[1], chunk.max(1));
    let mut lp_parts = Vec::new();
    let mut ent_parts = Vec::new();
    let mut start = 0;
    while start < span {
        let end = (start + chunk).min(span);
        let logits = h.slice_axis(1, start, end).linear(p.head());
        let logits = &logits * &inv_temp.broadcast_to(logits.dims());
        lp_parts.push(logits.token_log_probs(&targets.slice_axis(1, start, end)));
        ent_parts.push(logits.entropy());
        start = end;
    }
    let join = |v: &Vec<Tensor>| {
        let refs: Vec<&Tensor> = v.iter().collect();
        if refs.len() == 1 {
            refs[0].clone()
        } else {
            Tensor::concat(&refs, 1)
        }
    };
    (join(&lp_parts), join(&ent_parts))
}

/// [`logprobs_graph`] restricted to columns `from..T` (`1 <= from < T`): `[B, T - from]`
/// log-probs and entropies, with the output head applied only to the positions that predict
/// those columns. A training row's response starts at a fixed column, so this skips the head
/// over the prompt (a fifth of a small model's forward and backward FLOPs per prompt token).
pub fn logprobs_graph_span(
    g: &Graph,
    p: &DecoderParams,
    tokens: &Tensor,
    mask: &Tensor,
    temperature: &Tensor,
    from: i64,
) -> (Tensor, Tensor) {
    let (lp, ent, _) = logprobs_graph_span_routed(g, p, tokens, mask, temperature, from, None);
    (lp, ent)
}

/// [`logprobs_graph_span`] of a mixture-of-experts model, with its [`crate::moe::Routes`]
/// over `[B, T]` and, given `replay [B, T, Lm, k]`, those experts used
/// ([`span_hidden_routed`]).
pub fn logprobs_graph_span_routed(
    g: &Graph,
    p: &DecoderParams,
    tokens: &Tensor,
    mask: &Tensor,
    temperature: &Tensor,
    from: i64,
    replay: Option<&Tensor>,
) -> (Tensor, Tensor, Option<crate::moe::Routes>) {
    let (h, valid, routes) = span_hidden_routed(p, tokens, mask, from, replay);
    let ids = tokens.convert_if_needed(DType::I32);
    let t = tokens.dims()[1];
    let (lp, ent) = head_log_probs(
        g,
        p,
        &h,
        &ids.slice_axis(1, from, t),
        temperature,
        DEFAULT_HEAD_CHUNK,
    );
    (&lp * &valid, &ent * &valid, routes)
}

/// The final hidden states (after the final norm) that predict columns `from..T` of `tokens
/// [B, T]` (`1 <= from < T`), `[B, T - from, hidden]`, and where those columns are valid
/// (`[B, T - from]` f32: the token and its predecessor real): what [`logprobs_graph_span`]'s
/// head reads, and what a value head reads for the same columns.
pub fn span_hidden_graph(p: &DecoderParams, tokens: &Tensor, mask: &Tensor, from: i64) -> (Tensor, Tensor) {
    let t = tokens.dims()[1];
    assert!(from >= 1 && from < t, "span start {from} must be in 1..{t}");
    span_head_input(p, &trunk(p, tokens, mask), mask, from)
}

/// [`span_hidden_graph`] of a mixture-of-experts model, with its [`crate::moe::Routes`] over
/// `[B, T]` (valid where `mask` is set) and, given `replay [B, T, Lm, k]`, those experts used.
pub fn span_hidden_routed(
    p: &DecoderParams,
    tokens: &Tensor,
    mask: &Tensor,
    from: i64,
    replay: Option<&Tensor>,
) -> (Tensor, Tensor, Option<crate::moe::Routes>) {
    let t = tokens.dims()[1];
    assert!(from >= 1 && from < t, "span start {from} must be in 1..{t}");
    let (h, routes) = trunk_routed(p, tokens, mask, replay);
    let (h, valid) = span_head_input(p, &h, mask, from);
    (h, valid, routes)
}

/// The normed hidden states of trunk output `h [B, T, hidden]` that predict columns `from..T`,
/// and where those columns are valid.
fn span_head_input(p: &DecoderParams, h: &Tensor, mask: &Tensor, from: i64) -> (Tensor, Tensor) {
    let t = mask.dims()[1];
    // Position i predicts token i + 1: positions from-1 .. t-1 predict columns from .. t.
    let h = rms_norm(&p.config, &h.slice_axis(1, from - 1, t - 1), &p.final_norm);
    let m = mask.convert_if_needed(DType::F32);
    let valid = &m.slice_axis(1, from, t) * &m.slice_axis(1, from - 1, t - 1);
    (h, valid)
}

/// Prompts shared by groups of rows, for [`logprobs_graph_shared_prompts`].
///
/// `prompts [U, P]` and `prompt_mask [U, P]`: `U` prompts, left-padded (each has at least one
/// real token, so column `P - 1` is its last token). `responses [B, L]` and `response_mask
/// [B, L]`: `B` responses, right-padded. `prompt_index [B]` (i32): the prompt each response
/// follows. Rows and prompts are cut into `blocks` equal blocks, and a response may only
/// follow a prompt of its own block: `prompt_index` counts from the start of the block (in
/// `0..U / blocks`). With the blocks split over devices every product stays on its device.
pub struct SharedPrompts<'a> {
    pub prompts: &'a Tensor,
    pub prompt_mask: &'a Tensor,
    pub responses: &'a Tensor,
    pub response_mask: &'a Tensor,
    pub prompt_index: &'a Tensor,
    pub blocks: i64,
    /// A mixture-of-experts model's experts to replay: the prompts' `[U, P, Lm, k]` and the
    /// responses' `[B, L, Lm, k]` ([`shared_prompts_routed`]).
    pub replay: Option<(&'a Tensor, &'a Tensor)>,
}

impl<'a> SharedPrompts<'a> {
    /// From the five inputs in field order: prompts, prompt mask, responses, response mask,
    /// prompt index.
    pub fn from_inputs(inputs: &'a [Tensor], blocks: i64) -> SharedPrompts<'a> {
        let [prompts, prompt_mask, responses, response_mask, prompt_index] = inputs else {
            panic!("shared prompts take 5 inputs, got {}", inputs.len());
        };
        SharedPrompts {
            prompts,
            prompt_mask,
            responses,
            response_mask,
            prompt_index,
            blocks,
            replay: None,
        }
    }
}

/// The per-token log-probabilities and entropies of `B` responses, `[B, L]` each, where groups
/// of responses follow the same prompt (GRPO's `n` samples per prompt): each prompt runs
/// through the decoder once and its responses attend to its keys and values, instead of every
/// row carrying its own copy of the prompt. Entry `[b, j]` equals column `P + j` of
/// [`logprobs_graph_span`] over the row `prompt ++ response` (same positions, same masking):
/// the response's position `j` is the prompt's real length plus `j`, and response column 0 is
/// predicted from the prompt's last position. The gradient of a shared prompt is the sum over
/// its responses (the rows are picked by a one-hot product, whose transpose adds them up).
///
/// `temperature` is an f32 scalar (logits are divided by it). Entries past a response's end
/// are 0.
pub fn logprobs_graph_shared_prompts(
    g: &Graph,
    p: &DecoderParams,
    batch: &SharedPrompts,
    temperature: &Tensor,
) -> (Tensor, Tensor) {
    let (lp, ent, _) = logprobs_graph_shared_prompts_routed(g, p, batch, temperature);
    (lp, ent)
}

/// [`logprobs_graph_shared_prompts`] of a mixture-of-experts model, with its routing
/// ([`shared_prompts_routed`]).
pub fn logprobs_graph_shared_prompts_routed(
    g: &Graph,
    p: &DecoderParams,
    batch: &SharedPrompts,
    temperature: &Tensor,
) -> (Tensor, Tensor, Option<crate::moe::Routes>) {
    let (h, valid, routes) = shared_prompts_routed(g, p, batch);
    let ids = batch.responses.convert_if_needed(DType::I32);
    let (lp, ent) = head_log_probs(g, p, &h, &ids, temperature, DEFAULT_HEAD_CHUNK);
    (&lp * &valid, &ent * &valid, routes)
}

/// The final hidden states (after the final norm) that predict each response column of
/// `batch`, `[B, L, hidden]`, and where the columns are valid (`[B, L]` f32), as
/// [`logprobs_graph_shared_prompts`] computes them: what its head reads, and what a value head
/// reads for the same columns.
pub fn shared_prompts_hidden_graph(g: &Graph, p: &DecoderParams, batch: &SharedPrompts) -> (Tensor, Tensor) {
    let (h, valid, _) = shared_prompts_inner(g, p, batch, false);
    (h, valid)
}

/// [`shared_prompts_hidden_graph`] of a mixture-of-experts model with its routing: the
/// [`crate::moe::Routes`] over the prompts' `U * P` positions then the responses' `B * L`
/// (valid where the masks are set; `chosen` is `[U * P + B * L, Lm, k]`), replaying
/// `batch.replay` when given.
pub fn shared_prompts_routed(
    g: &Graph,
    p: &DecoderParams,
    batch: &SharedPrompts,
) -> (Tensor, Tensor, Option<crate::moe::Routes>) {
    shared_prompts_inner(g, p, batch, true)
}

fn shared_prompts_inner(
    g: &Graph,
    p: &DecoderParams,
    batch: &SharedPrompts,
    routed: bool,
) -> (Tensor, Tensor, Option<crate::moe::Routes>) {
    let config = &p.config;
    let (u, pl) = (batch.prompts.dims()[0], batch.prompts.dims()[1]);
    let (b, l) = (batch.responses.dims()[0], batch.responses.dims()[1]);
    let blocks = batch.blocks;
    assert!(
        blocks >= 1 && u % blocks == 0 && b % blocks == 0,
        "{u} prompts and {b} rows must split into {blocks} blocks"
    );
    assert!(
        pl >= 1 && l >= 1,
        "prompts and responses need at least one column"
    );
    let (slots, rows) = (u / blocks, b / blocks);
    // one_hot[s, r, i] = 1 when row r of block s follows prompt i of that block.
    let index = batch
        .prompt_index
        .convert_if_needed(DType::I32)
        .reshape(&[blocks, rows, 1])
        .broadcast_to(&[blocks, rows, slots]);
    let one_hot = index
        .eq(&g.iota(DType::I32, &[blocks, rows, slots], 2))
        .select(&g.scalar(1.0, DType::F32), &g.scalar(0.0, DType::F32));
    // x [U, ...] -> [B, ...]: each row's prompt's entry (exact: a product with 0s and one 1).
    let per_row = |x: &Tensor| -> Tensor {
        let rest = x.dims()[1..].to_vec();
        let flat: i64 = rest.iter().product();
        let dims = DotDims {
            lhs_batch: vec![0],
            rhs_batch: vec![0],
            lhs_contract: vec![2],
            rhs_contract: vec![1],
        };
        let picked = one_hot.dot_general(
            &x.convert_if_needed(DType::F32).reshape(&[blocks, slots, flat]),
            dims,
            None,
        );
        let mut out = vec![b];
        out.extend(rest);
        picked.reshape(&out).convert_if_needed(x.dtype())
    };

    // Prompts: causal self-attention over their real tokens, positions 0, 1, ...
    let prompt_mask = batch.prompt_mask.convert_if_needed(DType::I32);
    let prompt_pos = positions_from_mask(&prompt_mask);
    // Responses: position = the prompt's real length + column; keys are the prompt's real
    // tokens, then the response's own real tokens up to the query (causal).
    let prompt_real = prompt_mask.ne(&prompt_mask.zeros_like());
    let real_f = prompt_real.select(&g.scalar(1.0, DType::F32), &g.scalar(0.0, DType::F32));
    let prompt_len = per_row(&real_f.reduce_sum(&[1])).convert(DType::I32);
    let r_pos = &prompt_len.reshape(&[b, 1]).broadcast_to(&[b, l]) + &g.iota(DType::I32, &[b, l], 1);
    let response_mask = batch.response_mask.convert_if_needed(DType::I32);
    let prompt_keys = per_row(&real_f)
        .ne(&g.zeros(DType::F32, &[b, pl]))
        .reshape(&[b, 1, pl])
        .broadcast_to(&[b, l, pl]);
    // Response column j (position len + j) and prompt column i (position i - (P - len)) are
    // j + P - i positions apart, whatever the prompt's length.
    let response_allowed = |window: Option<usize>| {
        let prompt_keys = match window {
            Some(w) => {
                let q = &g.iota(DType::I32, &[l, pl], 0) + &g.full(pl as f64, DType::I32, &[l, pl]);
                let near = within(&q, &g.iota(DType::I32, &[l, pl], 1), w);
                prompt_keys.and(&near.reshape(&[1, l, pl]).broadcast_to(&[b, l, pl]))
            }
            None => prompt_keys.clone(),
        };
        let own_keys = causal_padding_mask(&response_mask, window).reshape(&[b, l, l]);
        Tensor::concat(&[&prompt_keys, &own_keys], 2).reshape(&[b, 1, 1, l, pl + l])
    };

    // Prompt and response positions go through the projections and the MLP as one list of
    // `U * P + B * L` positions (larger matrix products); only attention sees them apart.
    let (np, nr) = (u * pl, b * l);
    let hd = config.head_dim as i64;
    let flat = |x: &Tensor, n: i64| {
        let mut d = vec![n];
        d.extend_from_slice(&x.dims()[2..]);
        x.reshape(&d)
    };
    let both =
        |prompt: &Tensor, response: &Tensor| Tensor::concat(&[&flat(prompt, np), &flat(response, nr)], 0);
    // Per layer kind: [cos, sin] over both lists, the prompts' mask and the responses'.
    let tables = ByKind::new(config, |kind| {
        let (p_cos, p_sin) = rope_tables(config, kind, &prompt_pos);
        let (r_cos, r_sin) = rope_tables(config, kind, &r_pos);
        let window = config.window_of(kind);
        [
            both(&p_cos, &r_cos),
            both(&p_sin, &r_sin),
            causal_padding_mask(&prompt_mask, window),
            response_allowed(window),
        ]
    });
    // `[N, heads, hd]` -> the prompts' `[U, P, heads, hd]` or the responses' `[B, L, heads, hd]`.
    let prompts_of = |x: &Tensor| x.slice_axis(0, 0, np).reshape(&[u, pl, x.dims()[1], hd]);
    let responses_of = |x: &Tensor| x.slice_axis(0, np, np + nr).reshape(&[b, l, x.dims()[1], hd]);
    let valid_positions = both(
        &prompt_mask.reshape(&[u, pl, 1]),
        &response_mask.reshape(&[b, l, 1]),
    )
    .reshape(&[-1]);
    let replay = batch.replay.map(|(prompts, responses)| both(prompts, responses));
    let routing = routed.then_some(Routed {
        valid: &valid_positions,
        replay: replay.as_ref(),
    });
    let (h, routes) = p.run_routed_layers(
        both(&embed(p, batch.prompts), &embed(p, batch.responses)),
        routing,
        |layer, h, replay| {
            let [cos, sin, p_allowed, r_allowed] = tables.of(layer);
            let normed = rms_norm(config, h, &layer.input_norm);
            let (q, k, v) = qkv(config, layer, &normed, &cos, &sin);
            // Prompts over themselves; responses over their prompt's keys, then their own.
            let k_p = prompts_of(&k).transpose(&[0, 2, 1, 3]);
            let v_p = prompts_of(&v).transpose(&[0, 2, 1, 3]);
            let attn_p = causal_attend(config, layer, &prompts_of(&q), &k_p, &v_p, &p_allowed);
            let k_r = Tensor::concat(&[&per_row(&k_p), &responses_of(&k).transpose(&[0, 2, 1, 3])], 2);
            let v_r = Tensor::concat(&[&per_row(&v_p), &responses_of(&v).transpose(&[0, 2, 1, 3])], 2);
            let attn_r = attend(config, layer, &responses_of(&q), &k_r, &v_r, &r_allowed);
            finish_routed_layer(config, layer, h, &both(&attn_p, &attn_r), replay)
        },
    );
    let h_p = h
        .slice_axis(0, 0, np)
        .reshape(&[u, pl, config.hidden_size as i64]);
    let h_r = h
        .slice_axis(0, np, np + nr)
        .reshape(&[b, l, config.hidden_size as i64]);
    // Column j is predicted by the position before it: the prompt's last one for j = 0.
    let last_prompt = per_row(&h_p.slice_axis(1, pl - 1, pl));
    let h = if l > 1 {
        Tensor::concat(&[&last_prompt, &h_r.slice_axis(1, 0, l - 1)], 1)
    } else {
        last_prompt
    };
    let h = rms_norm(config, &h, &p.final_norm);
    // Valid where the token and its predecessor are real (a prompt's last token always is).
    let m = batch.response_mask.convert_if_needed(DType::F32);
    let valid = if l > 1 {
        &m * &Tensor::concat(
            &[&g.full(1.0, DType::F32, &[b, 1]), &m.slice_axis(1, 0, l - 1)],
            1,
        )
    } else {
        m
    };
    (h, valid, routes)
}

/// Prefill: runs prompts `tokens [B, T]` (right-padded; `lengths [B]` real lengths, each at
/// least 1 and at most T) and writes their keys and values into KV-cache slots `slots [B]`.
///
/// `cache` holds `2 * layers` tensors (layer 0 K, layer 0 V, layer 1 K, ...), each
/// `[num_slots, kv_heads, max_len, head_dim]` with `max_len >= T`. Each prompt's whole slot row
/// is rewritten: its keys and values at positions `< length`, zeros after. Rows are written in
/// batch order, so a repeated slot id ends up holding the last row that names it (pad a batch
/// with copies of a real row to leave other slots untouched).
///
/// Returns the logits of each prompt's last real token `[B, vocab]` and the updated cache.
pub fn prefill_graph(
    p: &DecoderParams,
    tokens: &Tensor,
    lengths: &Tensor,
    slots: &Tensor,
    cache: &[Tensor],
) -> (Tensor, Vec<Tensor>) {
    let g = p.graph();
    let b = tokens.dims()[0];
    let t = tokens.dims()[1];
    let slots = slots.convert_if_needed(DType::I32);
    let (logits, kvs, _) = prefill_kv_graph(p, tokens, lengths);
    let zero = g.scalar(0.0, DType::F32);
    let zero_i = g.scalar(0.0, DType::I32);
    let mut out_cache = Vec::with_capacity(cache.len());
    for (layer, (k, v)) in kvs.iter().enumerate() {
        for (which, new) in [(0usize, k), (1usize, v)] {
            let mut c = cache[2 * layer + which].clone();
            let max_len = c.dims()[2];
            let new = new.convert_if_needed(c.dtype());
            let padded = new.pad(
                &zero.convert_if_needed(c.dtype()),
                &[0, 0, 0, 0],
                &[0, 0, max_len - t, 0],
                &[0, 0, 0, 0],
            );
            for row in 0..b {
                let slot = slots.slice_axis(0, row, row + 1).reshape(&[]);
                let update = padded.slice_axis(0, row, row + 1);
                c = c.dynamic_update_slice(&update, &[&slot, &zero_i, &zero_i, &zero_i]);
            }
            out_cache.push(c);
        }
    }
    (logits, out_cache)
}

/// The work of [`prefill_graph`] without the cache write: runs prompts `tokens [B, T]`
/// (right-padded; `lengths [B]` real lengths) and returns the logits of each prompt's last
/// real token `[B, vocab]` and each layer's keys and values `[B, kv_heads, T, head_dim]`
/// (f32; zeros at padding positions), for programs that lay the cache out themselves, and a
/// mixture-of-experts model's chosen experts `[B, T, Lm, k]` (i32).
pub fn prefill_kv_graph(
    p: &DecoderParams,
    tokens: &Tensor,
    lengths: &Tensor,
) -> (Tensor, Vec<(Tensor, Tensor)>, Option<Tensor>) {
    let g = p.graph();
    let config = &p.config;
    let (b, t) = (tokens.dims()[0], tokens.dims()[1]);
    let lengths = lengths.convert_if_needed(DType::I32);
    let real = g
        .iota(DType::I32, &[b, t], 1)
        .lt(&lengths.reshape(&[b, 1]).broadcast_to(&[b, t]));
    let mask = real.convert(DType::I32);
    let (h, kvs, chosen) = trunk_with_kv(p, tokens, &mask);

    // Last real position of each prompt: row b*T + length-1 of [B*T, hidden].
    let hidden = config.hidden_size as i64;
    let last = &(&g.iota(DType::I32, &[b], 0) * (t as f64)) + &(&lengths - &lengths.scalar_like(1.0));
    let h_last = h.reshape(&[b * t, hidden]).take(&last, 0);
    let h_last = rms_norm(config, &h_last, &p.final_norm);
    let logits = h_last.linear(p.head());

    let real_kv = real.reshape(&[b, 1, t, 1]);
    let kvs = kvs
        .into_iter()
        .map(|(k, v)| {
            let keep = |x: Tensor| real_kv.select(&x, &x.zeros_like());
            (keep(k), keep(v))
        })
        .collect();
    (logits, kvs, chosen)
}

/// How a decode step writes each slot's new key and value into the KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvWrite {
    /// A scatter of each slot's `[kv_heads, head_dim]` row to (slot, position) of the 4-D
    /// cache, in the cache's own layout (no reshaped view that would make the compiler
    /// relayout the cache around the write): the [`decode_graph`] default.
    #[default]
    Scatter,
    /// Every attended position rewritten: the new row where the position is the slot's, the
    /// old value elsewhere (a select over the attended cache). A pass over the attended
    /// cache per step, but in the layout attention reads it in; on TPU, which lays out a
    /// cache whose head dimension is under 128 lanes with positions minor, a row scatter
    /// makes the compiler relayout the whole cache around it (BENCHMARKS.md, "Where the
    /// decode step's bytes go").
    Masked,
    /// One `dynamic_update_slice` of `[1, kv_heads, 1, head_dim]` per slot (in place when
    /// the cache is donated). Inactive slots rewrite position 0 of their row with what it
    /// holds, so they stay unchanged.
    UpdateSlice,
    /// No write: the cache comes back unchanged and the new token attends only to the cached
    /// positions before it plus itself. Only for measuring what the write costs; the result
    /// is not a usable cache.
    Skip,
}

impl KvWrite {
    /// The write that suits a target: [`KvWrite::Masked`] on TPU (whose cache layout a row
    /// scatter fights), [`KvWrite::Scatter`] elsewhere (an in-place row write).
    pub fn for_plugin(kind: PluginKind) -> KvWrite {
        match kind {
            PluginKind::Tpu => KvWrite::Masked,
            PluginKind::Cpu | PluginKind::Cuda => KvWrite::Scatter,
        }
    }
}

/// How a decode step computes attention scores and outputs over the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodeAttention {
    /// Batched matrix products over (slot, KV head): `[G, hd] x [hd, L]` and `[G, L] x [L, hd]`.
    #[default]
    Dot,
    /// Broadcast multiplies with reductions (no matrix products): one fused pass over the
    /// keys and one over the values.
    MultiplyReduce,
    /// Batched matrix products with the cache as the left operand (`[L, hd] x [hd, G]`,
    /// then a small transpose of the scores), so the cache is read in place and only the
    /// query side is packed.
    KeysLeft,
}

/// A decode step over part of the cache's slots (a slot bucket): the cache's slots are
/// `groups` blocks of `local` (the engine's slot groups, one per device group), and the step
/// runs the first `rows` of each, its slot j being block `j / rows`, row `j % rows`. New keys
/// and values are scattered into the whole cache in place and attention reads those rows,
/// so the step costs what its rows cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotBucket {
    pub groups: usize,
    pub local: usize,
    pub rows: usize,
}

impl SlotBucket {
    /// `[groups, local, ...]`: cache tensor `t` with its slots split by block.
    pub fn view(&self, t: &Tensor) -> Tensor {
        let mut dims = vec![self.groups as i64, self.local as i64];
        dims.extend_from_slice(&t.dims()[1..]);
        t.reshape(&dims)
    }

    /// The bucket's rows of cache tensor `t`, `[groups * rows, ...]`.
    pub fn slice(&self, t: &Tensor) -> Tensor {
        let mut dims = t.dims().to_vec();
        dims[0] = (self.groups * self.rows) as i64;
        self.view(t).slice_axis(1, 0, self.rows as i64).reshape(&dims)
    }

    /// Cache tensor `t` with the bucket's rows replaced by `rows` (shaped as
    /// [`SlotBucket::slice`] gives them).
    pub fn write_back(&self, t: &Tensor, rows: &Tensor) -> Tensor {
        let view = self.view(t);
        let mut dims = view.dims().to_vec();
        dims[1] = self.rows as i64;
        let zero = t.graph().scalar(0.0, DType::I32);
        let at: Vec<&Tensor> = dims.iter().map(|_| &zero).collect();
        view.dynamic_update_slice(&rows.reshape(&dims), &at)
            .reshape(t.dims())
    }

    /// [`SlotBucket::slice`] as the step's attention reads it: behind an optimization barrier,
    /// so the products read the rows as they read a whole cache, whatever the bucket, and
    /// give each row the same bits.
    fn read(&self, t: &Tensor) -> Tensor {
        let rows = self.slice(t);
        t.graph().optimization_barrier(&[&rows]).remove(0)
    }
}

/// Variants of [`decode_graph`] ([`decode_graph_with`], [`decode_hidden_graph`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Attend over cache positions `0..attend_len` only (a cache-length bucket); `None` (or a
    /// value at or above the cache length) attends over the whole cache. Every active slot's
    /// position must be below it: keys at or past it are never read (the new key and value
    /// are still written at their position).
    pub attend_len: Option<i64>,
    /// How the new keys and values are written.
    pub kv_write: KvWrite,
    /// How attention is computed.
    pub attention: DecodeAttention,
    /// Run the step on a slot bucket of the cache (with [`KvWrite::Scatter`] only); `None`:
    /// on every slot.
    pub bucket: Option<SlotBucket>,
}

/// Decode: one token for every slot of the cache. `tokens [S]` and `positions [S]` (S = the
/// cache's slot count): slot s takes token `tokens[s]` at position `positions[s]`, attends to
/// its cached positions `0..=positions[s]`, and its key and value are written at that
/// position. A slot with a negative position is inactive: nothing is written (its logits are
/// meaningless).
///
/// Returns logits `[S, vocab]` and the updated cache (same layout as [`prefill_graph`]).
pub fn decode_graph(
    p: &DecoderParams,
    tokens: &Tensor,
    positions: &Tensor,
    cache: &[Tensor],
) -> (Tensor, Vec<Tensor>) {
    decode_graph_with(p, tokens, positions, cache, DecodeOptions::default())
}

/// [`decode_graph`] with a choice of attended cache length and cache write.
pub fn decode_graph_with(
    p: &DecoderParams,
    tokens: &Tensor,
    positions: &Tensor,
    cache: &[Tensor],
    options: DecodeOptions,
) -> (Tensor, Vec<Tensor>) {
    let (h, out_cache, _) = decode_hidden_graph(p, tokens, positions, cache, options);
    (h.linear(p.head()), out_cache)
}

/// [`decode_graph_with`] without the output head: the final-normed hidden states
/// `[S, hidden]` (f32) and the updated cache, for programs that apply the head themselves
/// (fused with sampling, or in another precision), and a mixture-of-experts model's chosen
/// experts `[S, Lm, k]` (i32).
pub fn decode_hidden_graph(
    p: &DecoderParams,
    tokens: &Tensor,
    positions: &Tensor,
    cache: &[Tensor],
    options: DecodeOptions,
) -> (Tensor, Vec<Tensor>, Option<Tensor>) {
    assert!(
        options.bucket.is_none() || options.kv_write == KvWrite::Scatter,
        "a slot bucket is written by a scatter, not {:?}",
        options.kv_write
    );
    let g = p.graph();
    let config = &p.config;
    let s = tokens.dims()[0];
    let hd = config.head_dim as i64;
    let kvh = config.num_key_value_heads as i64;
    let heads = config.num_attention_heads as i64;
    let groups = heads / kvh;
    let max_len = cache[0].dims()[2];
    let window = options.attend_len.map_or(max_len, |w| w.clamp(1, max_len));
    let positions = positions.convert_if_needed(DType::I32);
    let active = positions.ge(&positions.zeros_like());
    let pos_clamped = positions.max(&positions.zeros_like());

    // Each slot's new row at its position; inactive slots point past the end: no write.
    let beyond = g.full(max_len as f64, DType::I32, &[s]);
    let rows = matches!(options.kv_write, KvWrite::Scatter | KvWrite::Masked).then(|| {
        RowWrite::new(
            options.kv_write,
            &active.select(&pos_clamped, &beyond),
            max_len,
            options.bucket,
        )
    });
    // allowed [S, 1, 1, W]: key position <= the slot's position (< when the write is
    // skipped: the new key is then scored separately).
    let key_pos = g.iota(DType::I32, &[s, window], 1);
    let pos_w = pos_clamped.reshape(&[s, 1]).broadcast_to(&[s, window]);
    let causal = if options.kv_write == KvWrite::Skip {
        key_pos.lt(&pos_w)
    } else {
        key_pos.le(&pos_w)
    };
    // Per layer kind: [cos, sin, allowed [S, 1, 1, W]].
    let tables = ByKind::new(config, |kind| {
        let (cos, sin) = rope_tables(config, kind, &pos_clamped);
        let allowed = and_within(causal.clone(), &pos_w, &key_pos, config.window_of(kind));
        [cos, sin, allowed.reshape(&[s, 1, 1, window])]
    });
    let zero_i = g.scalar(0.0, DType::I32);
    // Per-slot write position for UpdateSlice: inactive slots rewrite position 0 with its
    // current value.
    let write_pos: Vec<Tensor> = (0..s)
        .map(|i| pos_clamped.slice_axis(0, i, i + 1).reshape(&[]))
        .collect();
    let slot_ids: Vec<Tensor> = (0..s).map(|i| g.scalar(i as f64, DType::I32)).collect();
    let active_rows = active.reshape(&[s, 1, 1, 1]).broadcast_to(&[s, kvh, 1, hd]);

    let mut h = embed(p, tokens);
    let mut out_cache = Vec::with_capacity(cache.len());
    let mut chosen = Vec::new();
    for (l, layer) in p.layers.iter().enumerate() {
        let [cos, sin, allowed] = tables.of(layer);
        let normed = rms_norm(config, &h, &layer.input_norm);
        let (q, k, v) = qkv(config, layer, &normed, &cos, &sin);
        let mut kv_out = Vec::with_capacity(2);
        for (which, new) in [(0usize, &k), (1usize, &v)] {
            let c = &cache[2 * l + which];
            let updated = match options.kv_write {
                KvWrite::Scatter | KvWrite::Masked => {
                    rows.as_ref().expect("built for this write").apply(c, new)
                }
                KvWrite::UpdateSlice => {
                    // rows [S, kvh, 1, hd]; inactive slots keep position 0's value.
                    let rows = new.reshape(&[s, kvh, 1, hd]).convert_if_needed(c.dtype());
                    let at_zero = c.slice_axis(2, 0, 1);
                    let rows = active_rows.select(&rows, &at_zero);
                    let mut c = c.clone();
                    for i in 0..s as usize {
                        let row = rows.slice_axis(0, i as i64, i as i64 + 1);
                        c = c.dynamic_update_slice(&row, &[&slot_ids[i], &zero_i, &write_pos[i], &zero_i]);
                    }
                    c
                }
                KvWrite::Skip => c.clone(),
            };
            kv_out.push(updated);
        }
        let windowed = |c: &Tensor| {
            let c = &match options.bucket {
                Some(b) => b.read(c),
                None => c.clone(),
            };
            if window < max_len {
                c.slice_axis(2, 0, window)
            } else {
                c.clone()
            }
        };
        // The products take the cache's type as operands (f32 results): a bf16 cache is read
        // as it is, as the trainer's attention reads bf16 keys and values.
        let operand = cache[0].dtype();
        let (kc, vc) = (windowed(&kv_out[0]), windowed(&kv_out[1]));
        let q = q.reshape(&[s, kvh, groups, hd]);
        let scale = config.attention_scale();
        let scores = match options.attention {
            // [S, kvh, G, hd] x [S, kvh, W, hd] -> [S, kvh, G, W]
            DecodeAttention::Dot => grouped_scores(&q.convert_if_needed(operand), &kc),
            DecodeAttention::KeysLeft => {
                grouped_scores(&kc, &q.convert_if_needed(operand)).transpose(&[0, 1, 3, 2])
            }
            DecodeAttention::MultiplyReduce => {
                let full = [s, kvh, groups, window, hd];
                let qb = q.reshape(&[s, kvh, groups, 1, hd]).broadcast_to(&full);
                let kb = kc
                    .convert_if_needed(DType::F32)
                    .reshape(&[s, kvh, 1, window, hd])
                    .broadcast_to(&full);
                (&qb * &kb).reduce_sum(&[4])
            }
        } * scale;
        let masked = allowed.select(&scores, &scores.scalar_like(MASKED_SCORE));
        let pv = |probs: &Tensor| match options.attention {
            // [S, kvh, G, W] x [S, kvh, W, hd] -> [S, kvh, G, hd]
            DecodeAttention::Dot | DecodeAttention::KeysLeft => {
                grouped_values(&probs.convert_if_needed(operand), &vc)
            }
            DecodeAttention::MultiplyReduce => {
                let w = probs.dims()[3];
                let full = [s, kvh, groups, w, hd];
                let pb = probs.reshape(&[s, kvh, groups, w, 1]).broadcast_to(&full);
                let vb = vc
                    .convert_if_needed(DType::F32)
                    .reshape(&[s, kvh, 1, w, hd])
                    .broadcast_to(&full);
                (&pb * &vb).reduce_sum(&[3])
            }
        };
        let attn = if options.kv_write == KvWrite::Skip {
            // The new key scored on its own, softmax over [cached, new].
            let k_new = k.reshape(&[s, kvh, 1, hd]).broadcast_to(&[s, kvh, groups, hd]);
            let v_new = v.reshape(&[s, kvh, 1, hd]).broadcast_to(&[s, kvh, groups, hd]);
            let self_score = (&q * &k_new).reduce_sum(&[3]).reshape(&[s, kvh, groups, 1]) * scale;
            let all = Tensor::concat(&[&masked, &self_score], 3).softmax(-1);
            let cached = pv(&all.slice_axis(3, 0, window));
            let own = all
                .slice_axis(3, window, window + 1)
                .broadcast_to(&[s, kvh, groups, hd]);
            &cached + &(&own * &v_new)
        } else {
            pv(&masked.softmax(-1))
        };
        h = finish_layer_recording(config, layer, &h, &attn.reshape(&[s, heads * hd]), &mut chosen);
        out_cache.extend(kv_out);
    }
    (
        rms_norm(config, &h, &p.final_norm),
        out_cache,
        stack_choices(chosen),
    )
}

/// Where and how a decode step writes each slot's new row into one cache tensor
/// `[S, kvh, L, hd]` ([`KvWrite::Scatter`] or [`KvWrite::Masked`]), worked out once per step
/// (and chunk) and applied to the keys and values of every layer.
struct RowWrite {
    /// The (slot, position) coordinates of the rows: `[S, 2]`, or `[groups, rows, 3]` of
    /// (block, row, position) into the `[groups, local, ...]` view of a slot bucket.
    points: Tensor,
    /// For [`KvWrite::Masked`]: `[S, 1, L, 1]`, true at each slot's position.
    at_position: Option<Tensor>,
    bucket: Option<SlotBucket>,
}

impl RowWrite {
    /// Slot s writes at `positions[s]` of a tensor of `len` positions; a position outside
    /// `0..len` writes nothing. With a `bucket`, slot s is that bucket's slot s of the cache.
    ///
    /// # Panics
    ///
    /// On [`KvWrite::UpdateSlice`] or [`KvWrite::Skip`], which [`decode_hidden_graph`] writes
    /// itself, and on a bucket with [`KvWrite::Masked`].
    fn new(write: KvWrite, positions: &Tensor, len: i64, bucket: Option<SlotBucket>) -> RowWrite {
        let g = positions.graph();
        let s = positions.dims()[0];
        let column = positions.reshape(&[s, 1]);
        let points = match bucket {
            None => Tensor::concat(&[&g.iota(DType::I32, &[s, 1], 0), &column], 1),
            // Iotas along the block and row dimensions: the partitioner reads them as each
            // device's own rows.
            Some(b) => {
                let dims = [b.groups as i64, b.rows as i64, 1];
                Tensor::concat(
                    &[
                        &g.iota(DType::I32, &dims, 0),
                        &g.iota(DType::I32, &dims, 1),
                        &column.reshape(&dims),
                    ],
                    2,
                )
            }
        };
        let at_position = match write {
            KvWrite::Scatter => None,
            KvWrite::Masked if bucket.is_none() => Some(
                g.iota(DType::I32, &[s, len], 1)
                    .eq(&column.broadcast_to(&[s, len]))
                    .reshape(&[s, 1, len, 1]),
            ),
            _ => {
                panic!(
                    "a row write is a scatter or a masked rewrite of every slot, not {write:?} on {bucket:?}"
                )
            }
        };
        RowWrite {
            points,
            at_position,
            bucket,
        }
    }

    /// `cache` with slot s's row of `new [S, kvh * hd]` written.
    fn apply(&self, cache: &Tensor, new: &Tensor) -> Tensor {
        let dims = cache.dims().to_vec();
        let (kvh, hd) = (dims[1], dims[3]);
        let s = new.dims()[0];
        match (&self.at_position, self.bucket) {
            (None, None) => cache.scatter_at(
                &self.points,
                &new.reshape(&[s, kvh, hd]).convert_if_needed(cache.dtype()),
                &[0, 2],
            ),
            (None, Some(b)) => {
                let rows = new
                    .reshape(&[b.groups as i64, b.rows as i64, kvh, hd])
                    .convert_if_needed(cache.dtype());
                b.view(cache)
                    .scatter_at(&self.points, &rows, &[0, 1, 3])
                    .reshape(&dims)
            }
            (Some(at), _) => {
                let rows = new.reshape(&[s, kvh, 1, hd]).convert_if_needed(cache.dtype());
                at.broadcast_to(&dims).select(&rows.broadcast_to(&dims), cache)
            }
        }
    }
}

/// [`decode_hidden_graph`] over a KV cache split along positions into chunks of equal
/// length: `cache` holds, for each layer, its key chunks then its value chunks (layer 0 K
/// chunk 0..C, layer 0 V chunk 0..C, layer 1 ...), each `[S, kv_heads, chunk, head_dim]`,
/// chunk `c` holding positions `c * chunk ..`. Only the first `attend_chunks` chunks are read
/// and written: every active slot's position must be below `attend_chunks * chunk`, and the
/// later chunks come back unchanged (in place when donated), so a step costs what the
/// filled part of the cache costs, not the whole cache. New keys and values are scattered
/// to (slot, position) of their chunk by `write` ([`KvWrite::Scatter`] or
/// [`KvWrite::Masked`]), as in [`decode_graph`]. With a `bucket` the step runs that slot
/// bucket of the cache ([`SlotBucket`]).
///
/// # Panics
///
/// On [`KvWrite::UpdateSlice`] or [`KvWrite::Skip`], which only the unchunked step has, and
/// on a bucket with [`KvWrite::Masked`].
///
/// Returns the final-normed hidden states `[S, hidden]`, the updated chunks (same order) and a
/// mixture-of-experts model's chosen experts `[S, Lm, k]` (i32).
pub fn decode_hidden_graph_chunked(
    p: &DecoderParams,
    tokens: &Tensor,
    positions: &Tensor,
    cache: &[Tensor],
    attend_chunks: usize,
    write: KvWrite,
    bucket: Option<SlotBucket>,
) -> (Tensor, Vec<Tensor>, Option<Tensor>) {
    let g = p.graph();
    let config = &p.config;
    let layers = p.layers.len();
    let per_layer = cache.len() / layers.max(1);
    let chunks = per_layer / 2;
    let attend = attend_chunks.clamp(1, chunks.max(1));
    let s = tokens.dims()[0];
    let hd = config.head_dim as i64;
    let kvh = config.num_key_value_heads as i64;
    let heads = config.num_attention_heads as i64;
    let groups = heads / kvh;
    let chunk = cache[0].dims()[2];
    let window = attend as i64 * chunk;
    let positions = positions.convert_if_needed(DType::I32);
    let active = positions.ge(&positions.zeros_like());
    let pos_clamped = positions.max(&positions.zeros_like());

    // Each slot's new row at its position within its chunk, per attended chunk; slots that
    // are inactive or whose position is in another chunk point past the chunk's end: no write.
    let beyond = g.full(chunk as f64, DType::I32, &[s]);
    let rows: Vec<RowWrite> = (0..attend as i64)
        .map(|c| {
            let start = g.full((c * chunk) as f64, DType::I32, &[s]);
            let local = &pos_clamped - &start;
            let inside = local.ge(&local.zeros_like()).and(&local.lt(&beyond)).and(&active);
            RowWrite::new(write, &inside.select(&local, &beyond), chunk, bucket)
        })
        .collect();
    let key_pos = g.iota(DType::I32, &[s, window], 1);
    let pos_w = pos_clamped.reshape(&[s, 1]).broadcast_to(&[s, window]);
    let tables = ByKind::new(config, |kind| {
        let (cos, sin) = rope_tables(config, kind, &pos_clamped);
        let allowed = and_within(key_pos.le(&pos_w), &pos_w, &key_pos, config.window_of(kind));
        [cos, sin, allowed.reshape(&[s, 1, 1, window])]
    });
    let scale = config.attention_scale();

    let mut h = embed(p, tokens);
    let mut out_cache = cache.to_vec();
    let mut chosen = Vec::new();
    for (l, layer) in p.layers.iter().enumerate() {
        let [cos, sin, allowed] = tables.of(layer);
        let normed = rms_norm(config, &h, &layer.input_norm);
        let (q, k, v) = qkv(config, layer, &normed, &cos, &sin);
        for (which, new) in [(0usize, &k), (1usize, &v)] {
            for (c, rows) in rows.iter().enumerate() {
                let at = l * per_layer + which * chunks + c;
                out_cache[at] = rows.apply(&cache[at], new);
            }
        }
        // Operands of the cache's type, f32 results (as in `decode_hidden_graph`).
        let operand = cache[0].dtype();
        let read = |t: &Tensor| match bucket {
            Some(b) => b.read(t),
            None => t.clone(),
        };
        let keys = |c: usize| read(&out_cache[l * per_layer + c]);
        let values = |c: usize| read(&out_cache[l * per_layer + chunks + c]);
        let q = q.reshape(&[s, kvh, groups, hd]).convert_if_needed(operand);
        // [S, kvh, G, hd] x [S, kvh, chunk, hd] -> [S, kvh, G, chunk], per chunk.
        let scores: Vec<Tensor> = (0..attend).map(|c| grouped_scores(&q, &keys(c))).collect();
        let scores = if attend == 1 {
            scores[0].clone()
        } else {
            Tensor::concat(&scores.iter().collect::<Vec<_>>(), 3)
        } * scale;
        let masked = allowed.select(&scores, &scores.scalar_like(MASKED_SCORE));
        let probs = masked.softmax(-1).convert_if_needed(operand);
        // [S, kvh, G, chunk] x [S, kvh, chunk, hd] -> [S, kvh, G, hd], summed over chunks.
        let mut attn: Option<Tensor> = None;
        for c in 0..attend {
            let pc = if attend == 1 {
                probs.clone()
            } else {
                probs.slice_axis(3, c as i64 * chunk, (c as i64 + 1) * chunk)
            };
            let part = grouped_values(&pc, &values(c));
            attn = Some(match attn {
                Some(a) => &a + &part,
                None => part,
            });
        }
        let attn = attn.expect("at least one chunk").reshape(&[s, heads * hd]);
        h = finish_layer_recording(config, layer, &h, &attn, &mut chosen);
    }
    (
        rms_norm(config, &h, &p.final_norm),
        out_cache,
        stack_choices(chosen),
    )
}

/// Extend: writes `tokens [K]` into one slot of a KV cache laid out as
/// [`decode_hidden_graph_chunked`] reads it (chunks of positions; one chunk when unchunked),
/// at positions `start..start + length` (`place [3]` = slot, start, length; the rows from
/// `length` on are padding). Each token attends to the slot's cached positions `0..start`
/// and causally to the tokens before it: a prefill that continues a slot instead of starting
/// one, for a multi-turn sample's environment tokens. The keys and values are computed as a
/// prefill computes them (one pass over the `K` tokens), not one decode row per token.
///
/// No logits come out: the caller leaves a turn's last environment token to the next decode
/// step, which samples from it. Padding rows and positions past the cache write nothing (a
/// scatter drops them), so a bucket may run past the cache's end.
///
/// Returns the updated cache (same order; the new rows scattered in place and the slot's row
/// read whole, so a run costs one slot's row per layer besides the tokens' own work) and a
/// mixture-of-experts model's chosen experts `[K, Lm, k]` (i32).
pub fn extend_graph(
    p: &DecoderParams,
    tokens: &Tensor,
    place: &Tensor,
    cache: &[Tensor],
) -> (Vec<Tensor>, Option<Tensor>) {
    let g = p.graph();
    let config = &p.config;
    let per_layer = cache.len() / p.layers.len().max(1);
    let chunks = per_layer / 2;
    let chunk = cache[0].dims()[2];
    let span = chunks as i64 * chunk;
    let k_len = tokens.dims()[0];
    let hd = config.head_dim as i64;
    let heads = config.num_attention_heads as i64;
    let place = place.convert_if_needed(DType::I32);
    let at = |i: i64| place.slice_axis(0, i, i + 1);
    let (slot, start, length) = (at(0), at(1), at(2));
    let offsets = g.iota(DType::I32, &[k_len], 0);
    let positions = &start.broadcast_to(&[k_len]) + &offsets;

    // allowed [1, 1, 1, K, span]: the slot's positions up to and including the query's own
    // (the cache holds the new rows by the time attention reads it).
    let key_pos = g.iota(DType::I32, &[k_len, span], 1);
    let query_pos = positions.reshape(&[k_len, 1]).broadcast_to(&[k_len, span]);
    let tables = ByKind::new(config, |kind| {
        let (cos, sin) = rope_tables(config, kind, &positions);
        let allowed = and_within(
            key_pos.le(&query_pos),
            &query_pos,
            &key_pos,
            config.window_of(kind),
        );
        [cos, sin, allowed.reshape(&[1, 1, 1, k_len, span])]
    });

    // Per chunk, the (slot, position in the chunk) each real row is written at; padding rows
    // and rows of other chunks point past the chunk: dropped.
    let real = offsets.lt(&length.broadcast_to(&[k_len]));
    let beyond = g.full(chunk as f64, DType::I32, &[k_len]);
    let slots = slot.broadcast_to(&[k_len]).reshape(&[k_len, 1]);
    let points: Vec<Tensor> = (0..chunks as i64)
        .map(|c| {
            let local = &positions - &g.full((c * chunk) as f64, DType::I32, &[k_len]);
            let inside = local.ge(&local.zeros_like()).and(&local.lt(&beyond)).and(&real);
            let local = inside.select(&local, &beyond).reshape(&[k_len, 1]);
            Tensor::concat(&[&slots, &local], 1)
        })
        .collect();

    let mut h = embed(p, tokens);
    let mut out_cache = cache.to_vec();
    let mut chosen = Vec::new();
    for (l, layer) in p.layers.iter().enumerate() {
        let [cos, sin, allowed] = tables.of(layer);
        let normed = rms_norm(config, &h, &layer.input_norm);
        let (q, k, v) = qkv(config, layer, &normed, &cos, &sin);
        let mut keys_values = Vec::with_capacity(2);
        for (which, new) in [(0usize, &k), (1usize, &v)] {
            let first = l * per_layer + which * chunks;
            let new = new.convert_if_needed(cache[first].dtype());
            // Written first and read back, as a decode step does: reading the cache before
            // writing it would make the compiler copy the whole cache to keep the old one.
            for (c, points) in points.iter().enumerate() {
                out_cache[first + c] = cache[first + c].scatter_at(points, &new, &[0, 2]);
            }
            // The slot's row [1, kvh, span, hd].
            let row: Vec<Tensor> = (0..chunks).map(|c| out_cache[first + c].take(&slot, 0)).collect();
            keys_values.push(Tensor::concat(&row.iter().collect::<Vec<_>>(), 2));
        }
        let attn = attend(
            config,
            layer,
            &q.reshape(&[1, k_len, heads, hd]),
            &keys_values[0],
            &keys_values[1],
            &allowed,
        );
        h = finish_layer_recording(
            config,
            layer,
            &h,
            &attn.reshape(&[k_len, heads * hd]),
            &mut chosen,
        );
    }
    (out_cache, stack_choices(chosen))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Family;

    fn tiny(family: Family) -> ModelConfig {
        ModelConfig {
            family,
            hidden_size: 16,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 4,
            intermediate_size: 24,
            vocab_size: 32,
            rope_theta: 10000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: family != Family::Qwen2,
            attention_bias: family == Family::Qwen2,
            o_proj_bias: false,
            qk_norm: family == Family::Qwen3,
            max_position_embeddings: 64,
            bos_token_id: None,
            eos_token_ids: vec![],
            pad_token_id: None,
            initializer_range: 0.1,
            // No experts, window or Gemma settings: tiny_llama's.
            ..ModelConfig::tiny_llama()
        }
    }

    #[test]
    fn declared_parameters_follow_the_table_and_the_family_switches() {
        for family in [Family::Llama, Family::Qwen2, Family::Qwen3] {
            let config = tiny(family);
            let g = Graph::new("p");
            let p = DecoderParams::declare(&g, &config, DType::F32);
            assert_eq!(p.all.len(), param_table(&config).len());
            assert_eq!(p.layers.len(), 2);
            assert_eq!(p.layers[0].q_bias.is_some(), family == Family::Qwen2);
            assert_eq!(p.layers[1].k_norm.is_some(), family == Family::Qwen3);
            assert_eq!(p.lm_head.is_some(), family == Family::Qwen2);
            assert_eq!(p.head().dims(), &[32, 16]);
        }
    }

    #[test]
    fn wrong_parameter_shapes_are_named() {
        let config = tiny(Family::Llama);
        let g = Graph::new("p");
        let mut ts: Vec<Tensor> = param_table(&config)
            .iter()
            .map(|s| {
                let d: Vec<i64> = s.shape.iter().map(|&x| x as i64).collect();
                g.parameter(&s.name, DType::F32, &d)
            })
            .collect();
        ts[1] = g.parameter("bad", DType::F32, &[3]);
        let err = DecoderParams::from_tensors(&config, &ts).unwrap_err();
        assert!(
            err.contains("model.layers.0.input_layernorm.weight") && err.contains("[3]"),
            "{err}"
        );
        let err = DecoderParams::from_tensors(&config, &ts[..3]).unwrap_err();
        assert!(err.contains("3 were given"), "{err}");
    }

    #[test]
    fn graphs_trace_without_shape_errors() {
        for family in [Family::Llama, Family::Qwen2, Family::Qwen3] {
            let config = tiny(family);
            let g = Graph::new("t");
            let p = DecoderParams::declare(&g, &config, DType::F32);
            let tokens = g.parameter("tokens", DType::I32, &[2, 5]);
            let mask = g.parameter("mask", DType::I32, &[2, 5]);
            let temp = g.parameter("temperature", DType::F32, &[]);
            let (lp, ent) = logprobs_graph_chunked(&g, &p, &tokens, &mask, &temp, 3);
            assert_eq!(lp.dims(), &[2, 5]);
            assert_eq!(ent.dims(), &[2, 5]);
            let logits = full_logits_graph(&p, &tokens, &mask);
            assert_eq!(logits.dims(), &[2, 5, 32]);
            let cache: Vec<Tensor> = (0..4)
                .map(|i| g.parameter(&format!("kv{i}"), DType::F32, &[3, 2, 8, 4]))
                .collect();
            let lengths = g.parameter("lengths", DType::I32, &[2]);
            let slots = g.parameter("slots", DType::I32, &[2]);
            let (pl, pc) = prefill_graph(&p, &tokens, &lengths, &slots, &cache);
            assert_eq!(pl.dims(), &[2, 32]);
            assert_eq!(pc[3].dims(), &[3, 2, 8, 4]);
            let dt = g.parameter("dt", DType::I32, &[3]);
            let dp = g.parameter("dp", DType::I32, &[3]);
            let (dl, dc) = decode_graph(&p, &dt, &dp, &cache);
            assert_eq!(dl.dims(), &[3, 32]);
            assert_eq!(dc.len(), 4);
            let et = g.parameter("et", DType::I32, &[4]);
            let place = g.parameter("place", DType::I32, &[3]);
            let (ec, chosen) = extend_graph(&p, &et, &place, &cache);
            assert!(chosen.is_none(), "a dense model chooses no experts");
            assert_eq!(ec.len(), 4);
            assert_eq!(ec[1].dims(), &[3, 2, 8, 4]);
            g.check().unwrap();
        }
    }

    /// With bf16 projection weights the attention's score and value products take bf16
    /// operands and give f32 results (the fast XLA CPU path); with f32 weights they stay f32.
    #[test]
    fn attention_products_follow_the_weight_type() {
        for (dtype, operand) in [(DType::BF16, "bf16"), (DType::F32, "f32")] {
            let config = tiny(Family::Llama);
            let g = Graph::new("attention");
            let p = DecoderParams::declare(&g, &config, dtype);
            let x = g.parameter("x", DType::F32, &[1, 6, 16]);
            let mask = g.parameter("mask", DType::I32, &[1, 6]);
            let (cos, sin) = rope_tables(&config, AttentionKind::Full, &positions_from_mask(&mask));
            let allowed = causal_padding_mask(&mask, None);
            let (out, _, _) = self_attention(&config, &p.layers[0], &x, &cos, &sin, &allowed);
            let mlir = g.build(&[&out]).unwrap().mlir().to_string();
            // Scores: [1, kvh 2, G 2, 6, 6] from q [.., hd 4] and k [1, 2, 6, 4].
            let want = format!("tensor<1x2x6x4x{operand}>) -> tensor<1x2x2x6x6xf32>");
            assert!(mlir.contains(&want), "{operand}: no score product: {mlir}");
            let narrow_to_f32 = mlir
                .lines()
                .filter(|l| {
                    l.contains("dot_general")
                        && l.contains("xbf16>")
                        && l.contains("-> tensor<")
                        && l.trim_end().ends_with("xf32>")
                })
                .count();
            let all_dots = mlir.lines().filter(|l| l.contains("dot_general")).count();
            if dtype == DType::BF16 {
                assert_eq!(narrow_to_f32, all_dots, "{mlir}");
            } else {
                assert_eq!(narrow_to_f32, 0, "{mlir}");
            }
        }
    }
}
