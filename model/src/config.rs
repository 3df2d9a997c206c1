//! Model configurations of the supported decoder families (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
//! Gemma 3), parsed from a
//! Hugging Face `config.json` or from GGUF metadata, and written back as a `config.json`.
//!
//! A family is a [`ModelConfig`] of knobs (the attention kind of each layer with its own RoPE,
//! Gemma's `1 + w` norms and sandwich norms, the MLP's activation, scaled embeddings, a
//! mixture of experts, ...) that one forward pass reads, so a new family is a parser and a few
//! knobs, not a copy of the forward pass.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::error::{ModelError, Result};

/// The decoder families this crate implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// Llama 2/3 style (SmolLM2 is one): optional Llama 3 RoPE scaling.
    Llama,
    /// Qwen2 / Qwen2.5: bias on the q, k and v projections.
    Qwen2,
    /// Qwen3: RMSNorm over each head of q and k, no projection bias.
    Qwen3,
    /// Qwen3-MoE: Qwen3 attention; the MLP of most layers a mixture of experts ([`MoeConfig`]).
    Qwen3Moe,
    /// Mistral (`MistralForCausalLM`: Mistral 7B, Mistral Small, Devstral): Llama's layers
    /// without biases, an explicit `head_dim`, and an optional sliding attention window
    /// ([`ModelConfig::sliding_window`]).
    Mistral,
    /// Gemma 3 (`Gemma3ForCausalLM`, and the text model of `Gemma3ForConditionalGeneration`):
    /// Qwen3's attention with four norms per layer ([`ModelConfig::sandwich_norms`]) that scale
    /// by `1 + w` ([`ModelConfig::norm_unit_offset`]), a GeGLU MLP, scaled embeddings, a
    /// `query_pre_attn_scalar`, and sliding-window layers with their own RoPE base between the
    /// global ones ([`ModelConfig::layer_types`], [`ModelConfig::rope_local_theta`]).
    Gemma3,
}

/// Architecture names accepted, as listed in error messages.
pub const SUPPORTED_ARCHITECTURES: &str =
    "llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM), qwen3_moe (Qwen3MoeForCausalLM), gemma3_text (Gemma3ForCausalLM, or the text model of Gemma3ForConditionalGeneration)";

/// What a decoder layer's attention sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Every earlier position (transformers' `full_attention`).
    Full,
    /// The last [`ModelConfig::sliding_window`] positions (`sliding_attention`), with the
    /// sliding layers' RoPE ([`ModelConfig::rope_local_theta`]).
    Sliding,
}

impl AttentionKind {
    /// transformers' `layer_types` entry.
    pub fn hf_name(self) -> &'static str {
        match self {
            AttentionKind::Full => "full_attention",
            AttentionKind::Sliding => "sliding_attention",
        }
    }
}

/// The activation of the MLP's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    /// SiLU (SwiGLU): Llama, Mistral, Qwen.
    Silu,
    /// GELU with the tanh approximation (GeGLU, transformers' `gelu_pytorch_tanh`): Gemma.
    GeluTanh,
}

impl Activation {
    /// The transformers name (`hidden_act` / `hidden_activation`).
    pub fn hf_name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::GeluTanh => "gelu_pytorch_tanh",
        }
    }
}

impl Family {
    /// The Hugging Face `model_type` (also the GGUF `general.architecture`).
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Mistral => "mistral",
            Family::Gemma3 => "gemma3_text",
        }
    }

    /// The GGUF `general.architecture` (llama.cpp's name, where it differs from the `model_type`).
    pub fn gguf_architecture(self) -> &'static str {
        match self {
            Family::Qwen3Moe => "qwen3moe",
            Family::Gemma3 => "gemma3",
            other => other.model_type(),
        }
    }

    /// The Hugging Face `architectures` entry.
    pub fn hf_architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    /// Parses a `model_type`, `general.architecture` or `architectures` entry.
    pub fn from_name(name: &str) -> Option<Family> {
        match name {
            "llama" | "LlamaForCausalLM" => Some(Family::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Some(Family::Qwen2),
            "qwen3" | "Qwen3ForCausalLM" => Some(Family::Qwen3),
            "qwen3_moe" | "Qwen3MoeForCausalLM" | "qwen3moe" => Some(Family::Qwen3Moe),
            "mistral" | "MistralForCausalLM" => Some(Family::Mistral),
            // `gemma3` is the GGUF architecture; the multimodal `model_type` of the same name
            // is read through its `text_config` (`ModelConfig::from_hf_json`).
            "gemma3_text" | "Gemma3ForCausalLM" | "gemma3" => Some(Family::Gemma3),
            _ => None,
        }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor` (transformers' `linear`: Gemma 3's global layers).
    Linear {
        /// Division factor for every frequency.
        factor: f64,
    },
    /// Llama 3.1 style: low frequencies divided by `factor`, high kept, smooth in between.
    Llama3 {
        /// Division factor for low frequencies.
        factor: f64,
        /// Wavelength threshold factor for the low band.
        low_freq_factor: f64,
        /// Wavelength threshold factor for the high band.
        high_freq_factor: f64,
        /// Context length the model was originally trained with.
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// The inverse frequencies `1 / theta^(2i/head_dim)` for `i < head_dim/2`, scaled as
    /// transformers' `_compute_llama3_parameters` does.
    pub fn scale_inv_freq(&self, inv_freq: &mut [f64]) {
        match *self {
            RopeScaling::Linear { factor } => {
                for f in inv_freq.iter_mut() {
                    *f /= factor;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
    }
}

/// The mixture-of-experts MLP of a family that has one (Qwen3-MoE), as transformers'
/// `Qwen3MoeSparseMoeBlock` computes it: a router `Linear(hidden, num_experts)`, softmax in f32,
/// the top `experts_per_token`, renormalised to sum to one when `norm_topk_prob`, and that
/// weighted sum of SwiGLU experts of width `expert_intermediate_size`. Layers it leaves dense
/// keep the family's SwiGLU MLP of `intermediate_size`.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per MoE layer (`num_experts`; transformers 5 writes `num_local_experts`).
    pub num_experts: usize,
    /// Experts each token goes to (`num_experts_per_tok`, the k of top-k).
    pub experts_per_token: usize,
    /// Width of one expert's SwiGLU (`moe_intermediate_size`).
    pub expert_intermediate_size: usize,
    /// Renormalise the k chosen probabilities to sum to one (`norm_topk_prob`; transformers'
    /// config class defaults it off, every published Qwen3-MoE checkpoint sets it).
    pub norm_topk_prob: bool,
    /// Layers whose MLP is dense whatever the step (`mlp_only_layers`).
    pub mlp_only_layers: Vec<usize>,
    /// Every this-many-th layer is sparse (`decoder_sparse_step`: layer `i` when `(i + 1) % step == 0`).
    pub decoder_sparse_step: usize,
    /// Weight of the load-balancing loss in the learner's objective (`router_aux_loss_coef`);
    /// RL recipes set it 0, as VeRL does, and then it only reports.
    pub router_aux_loss_coef: f64,
}

impl MoeConfig {
    /// Whether layer `layer`'s MLP is a mixture of experts (transformers' rule).
    pub fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }
}

/// Everything the forward pass and the weight loaders need to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Decoder family.
    pub family: Family,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); divides `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Width of one head (Qwen3 may differ from `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Rows of the embedding table (and of the output head).
    pub vocab_size: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Optional RoPE scaling (Llama 3.1).
    pub rope_scaling: Option<RopeScaling>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Whether the output head shares the embedding table.
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections (always on for Qwen2).
    pub attention_bias: bool,
    /// Bias on the attention output projection (Llama with `attention_bias: true`).
    pub o_proj_bias: bool,
    /// RMSNorm over each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// Beginning-of-sequence token, if any.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (Llama 3 lists several); may be empty.
    pub eos_token_ids: Vec<u32>,
    /// Padding token, if any.
    pub pad_token_id: Option<u32>,
    /// Standard deviation of random initialisation.
    pub initializer_range: f64,
    /// The mixture-of-experts MLP (`None`: every layer dense).
    pub moe: Option<MoeConfig>,
    /// Mistral's attention window: each position attends to its last `sliding_window`
    /// positions (itself included), in every attention of the learner and the rollout (the
    /// masks of `forward.rs`; the KV cache keeps every position and masks the older ones), in
    /// the layers [`ModelConfig::layer_types`] makes sliding. `None`: full causal attention.
    pub sliding_window: Option<usize>,
    /// Each layer's attention (transformers' `layer_types`: Gemma 3's five sliding layers to one
    /// global). Empty: every layer alike, sliding when [`ModelConfig::sliding_window`] is set.
    pub layer_types: Vec<AttentionKind>,
    /// RoPE base of the sliding layers, unscaled (Gemma 3's `rope_local_base_freq`); `None`:
    /// every layer uses [`ModelConfig::rope_theta`] and [`ModelConfig::rope_scaling`].
    pub rope_local_theta: Option<f64>,
    /// RMSNorm scales by `1 + w` (Gemma: the weights are offsets from one, zeros at
    /// initialisation) instead of `w`.
    pub norm_unit_offset: bool,
    /// Gemma's four norms per layer: `post_attention_layernorm` normalises the attention's
    /// output before its residual add, `pre_feedforward_layernorm` the MLP's input and
    /// `post_feedforward_layernorm` its output (where Llama's `post_attention_layernorm` is
    /// the MLP's input norm).
    pub sandwich_norms: bool,
    /// The MLP gate's activation.
    pub activation: Activation,
    /// Token embeddings multiplied by `sqrt(hidden_size)`, rounded to the weights' type
    /// (Gemma's scaled word embedding).
    pub scale_embeddings: bool,
    /// Attention scores scaled by `query_pre_attn_scalar^-1/2` (Gemma) instead of
    /// `head_dim^-1/2`.
    pub query_pre_attn_scalar: Option<f64>,
}

/// Reads typed keys out of a JSON object, with errors naming the key and the file.
struct JsonKeys<'a> {
    object: &'a Map<String, Value>,
    origin: &'a str,
}

impl JsonKeys<'_> {
    fn error(&self, key: &str, problem: impl Into<String>) -> ModelError {
        ModelError::Config {
            origin: self.origin.to_string(),
            key: key.to_string(),
            problem: problem.into(),
        }
    }

    fn present(&self, key: &str) -> Option<&Value> {
        self.object.get(key).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.present(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| self.error(key, format!("expected a non-negative integer, found {v}"))),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?
            .ok_or_else(|| self.error(key, "missing; it is required for this architecture"))
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.present(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.error(key, format!("expected a number, found {v}"))),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.present(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.error(key, format!("expected true or false, found {v}"))),
        }
    }

    fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let bad = || self.error(key, "expected a token id or a list of token ids");
        match self.present(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().map(|x| x as u32).ok_or_else(bad))
                .collect(),
            Some(v) => v.as_u64().map(|x| vec![x as u32]).ok_or_else(bad),
        }
    }
}

fn parse_rope_scaling(keys: &JsonKeys<'_>, key: &str) -> Result<Option<RopeScaling>> {
    let Some(value) = keys.present(key) else {
        return Ok(None);
    };
    let Some(object) = value.as_object() else {
        return Err(keys.error(key, format!("expected an object or null, found {value}")));
    };
    let inner = JsonKeys {
        object,
        origin: keys.origin,
    };
    let kind = object
        .get("rope_type")
        .or_else(|| object.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: inner.f64_or("factor", 1.0)?,
        })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: inner.f64_or("factor", 8.0)?,
            low_freq_factor: inner.f64_or("low_freq_factor", 1.0)?,
            high_freq_factor: inner.f64_or("high_freq_factor", 4.0)?,
            original_max_position_embeddings: inner
                .usize_opt("original_max_position_embeddings")?
                .unwrap_or(8192),
        })),
        other => Err(keys.error(
            key,
            format!("RoPE scaling type `{other}` is not supported; supported: default, linear, llama3"),
        )),
    }
}

/// The [`MoeConfig`] keys of a Qwen3-MoE `config.json`, with transformers' defaults.
fn parse_moe(keys: &JsonKeys<'_>) -> Result<MoeConfig> {
    let num_experts = match keys.usize_opt("num_experts")? {
        Some(n) => n,
        None => keys.usize("num_local_experts").map_err(|_| {
            keys.error(
                "num_experts",
                "missing (nor is transformers 5's num_local_experts there)",
            )
        })?,
    };
    let mlp_only_layers = match keys.present("mlp_only_layers") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_u64().map(|x| x as usize))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| keys.error("mlp_only_layers", "expected a list of layer indices"))?,
        Some(v) => {
            return Err(keys.error(
                "mlp_only_layers",
                format!("expected a list of layer indices, found {v}"),
            ))
        }
    };
    let moe = MoeConfig {
        num_experts,
        experts_per_token: keys.usize("num_experts_per_tok")?,
        expert_intermediate_size: keys.usize("moe_intermediate_size")?,
        norm_topk_prob: keys.bool_or("norm_topk_prob", false)?,
        mlp_only_layers,
        decoder_sparse_step: keys.usize_opt("decoder_sparse_step")?.unwrap_or(1),
        router_aux_loss_coef: keys.f64_or("router_aux_loss_coef", 0.001)?,
    };
    if moe.experts_per_token == 0 || moe.experts_per_token > moe.num_experts {
        return Err(keys.error(
            "num_experts_per_tok",
            format!(
                "{} must be between 1 and num_experts ({})",
                moe.experts_per_token, moe.num_experts
            ),
        ));
    }
    if moe.num_experts > 256 {
        return Err(keys.error(
            "num_experts",
            format!(
                "{} experts: grpo records each token's experts in one byte, so at most 256",
                moe.num_experts
            ),
        ));
    }
    if moe.decoder_sparse_step == 0 {
        return Err(keys.error("decoder_sparse_step", "must be positive, found 0"));
    }
    if moe.expert_intermediate_size == 0 {
        return Err(keys.error("moe_intermediate_size", "must be positive, found 0"));
    }
    Ok(moe)
}

/// A [`RopeScaling`] as transformers' `rope_scaling` object (null for none).
fn rope_scaling_json(scaling: Option<&RopeScaling>) -> Value {
    match scaling {
        None => Value::Null,
        Some(RopeScaling::Linear { factor }) => json!({"rope_type": "linear", "factor": factor}),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
    }
}

/// transformers' `Gemma3TextConfig` defaults for the keys a checkpoint's config leaves out (the
/// text configs of the multimodal checkpoints name only what differs from them).
fn gemma3_defaults(object: &Map<String, Value>) -> Map<String, Value> {
    let mut merged = object.clone();
    let defaults = json!({
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "pad_token_id": 0,
        "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": true,
        "query_pre_attn_scalar": 256, "sliding_window": 4096,
    });
    for (k, v) in defaults.as_object().expect("object literal") {
        if !merged.contains_key(k) {
            merged.insert(k.clone(), v.clone());
        }
    }
    merged
}

/// The MLP activation: Gemma names it `hidden_activation` (GeGLU), the others `hidden_act`
/// (SwiGLU).
fn parse_activation(keys: &JsonKeys<'_>, family: Family) -> Result<Activation> {
    let (key, expected) = match family {
        Family::Gemma3 => ("hidden_activation", Activation::GeluTanh),
        _ => ("hidden_act", Activation::Silu),
    };
    let name = keys
        .present(key)
        .or_else(|| keys.present("hidden_act"))
        .and_then(Value::as_str)
        .unwrap_or(expected.hf_name());
    let found = match name {
        "silu" | "swish" => Activation::Silu,
        "gelu_pytorch_tanh" | "gelu_tanh" => Activation::GeluTanh,
        _ => {
            return Err(keys.error(
                key,
                format!(
                    "activation `{name}` is not supported; {family} uses {}",
                    expected.hf_name()
                ),
            ))
        }
    };
    if found != expected {
        return Err(keys.error(
            key,
            format!(
                "activation `{name}` is not {family}'s; it uses {}",
                expected.hf_name()
            ),
        ));
    }
    Ok(found)
}

/// RoPE base and scaling: transformers >= 5 writes `rope_parameters` holding both, earlier
/// versions `rope_theta` and `rope_scaling`.
fn parse_rope(keys: &JsonKeys<'_>) -> Result<(f64, Option<RopeScaling>)> {
    match keys.present("rope_parameters") {
        Some(rp) => {
            let rp = rp
                .as_object()
                .ok_or_else(|| keys.error("rope_parameters", "expected an object with rope_theta"))?;
            let inner = JsonKeys {
                object: rp,
                origin: keys.origin,
            };
            Ok((
                inner.f64_or("rope_theta", keys.f64_or("rope_theta", 10000.0)?)?,
                parse_rope_scaling(keys, "rope_parameters")?,
            ))
        }
        None => Ok((
            keys.f64_or("rope_theta", 10000.0)?,
            parse_rope_scaling(keys, "rope_scaling")?,
        )),
    }
}

/// Gemma 3's two RoPEs: the global layers' (`rope_theta`, default 1e6, with `rope_scaling`)
/// and the sliding layers' (`rope_local_base_freq`, default 1e4, unscaled), or transformers 5's
/// `rope_parameters` keyed by layer type.
fn gemma3_rope(keys: &JsonKeys<'_>) -> Result<(f64, Option<RopeScaling>, Option<f64>)> {
    let Some(rp) = keys.present("rope_parameters") else {
        return Ok((
            keys.f64_or("rope_theta", 1e6)?,
            parse_rope_scaling(keys, "rope_scaling")?,
            Some(keys.f64_or("rope_local_base_freq", 1e4)?),
        ));
    };
    let rp = rp.as_object().ok_or_else(|| {
        keys.error(
            "rope_parameters",
            "expected an object keyed by layer type (full_attention, sliding_attention)",
        )
    })?;
    let by_type = JsonKeys {
        object: rp,
        origin: keys.origin,
    };
    let theta = |kind: &str, default: f64| -> Result<f64> {
        match rp.get(kind).and_then(Value::as_object) {
            Some(o) => JsonKeys {
                object: o,
                origin: keys.origin,
            }
            .f64_or("rope_theta", default),
            None => Ok(default),
        }
    };
    if let Some(local) = parse_rope_scaling(&by_type, "sliding_attention")? {
        return Err(keys.error(
            "rope_parameters.sliding_attention",
            format!("{local:?}: the sliding layers' RoPE is unscaled in Gemma 3"),
        ));
    }
    Ok((
        theta("full_attention", keys.f64_or("rope_theta", 1e6)?)?,
        parse_rope_scaling(&by_type, "full_attention")?,
        Some(theta(
            "sliding_attention",
            keys.f64_or("rope_local_base_freq", 1e4)?,
        )?),
    ))
}

/// Gemma 3's `layer_types`, or the older `sliding_window_pattern` (default 6: every sixth
/// layer global) they are derived from.
fn parse_layer_types(keys: &JsonKeys<'_>, layers: usize) -> Result<Vec<AttentionKind>> {
    let Some(types) = keys.present("layer_types") else {
        let pattern = keys.usize_opt("sliding_window_pattern")?.unwrap_or(6).max(1);
        return Ok((0..layers)
            .map(|i| {
                if (i + 1).is_multiple_of(pattern) {
                    AttentionKind::Full
                } else {
                    AttentionKind::Sliding
                }
            })
            .collect());
    };
    let bad = |problem: String| keys.error("layer_types", problem);
    let items = types
        .as_array()
        .ok_or_else(|| bad(format!("expected a list, found {types}")))?;
    if items.len() != layers {
        return Err(bad(format!(
            "{} entries for {layers} layers (num_hidden_layers)",
            items.len()
        )));
    }
    items
        .iter()
        .map(|v| match v.as_str() {
            Some("full_attention") => Ok(AttentionKind::Full),
            Some("sliding_attention") => Ok(AttentionKind::Sliding),
            _ => Err(bad(format!(
                "`{v}` is not a layer type; expected full_attention or sliding_attention"
            ))),
        })
        .collect()
}

impl ModelConfig {
    /// A 2-layer Llama, 32 wide, with a 32-token vocabulary and 4 query / 2 key-value heads,
    /// whose random weights ([`crate::random_init`], `initializer_range` 0.4) spread the logits
    /// enough to make greedy choices clear: for tests and examples that need a real model
    /// shape in milliseconds.
    pub fn tiny_llama() -> ModelConfig {
        ModelConfig {
            family: Family::Llama,
            hidden_size: 32,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            intermediate_size: 64,
            vocab_size: 32,
            rope_theta: 10000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            attention_bias: false,
            o_proj_bias: false,
            qk_norm: false,
            max_position_embeddings: 64,
            bos_token_id: None,
            eos_token_ids: vec![],
            pad_token_id: None,
            initializer_range: 0.4,
            moe: None,
            sliding_window: None,
            layer_types: Vec::new(),
            rope_local_theta: None,
            norm_unit_offset: false,
            sandwich_norms: false,
            activation: Activation::Silu,
            scale_embeddings: false,
            query_pre_attn_scalar: None,
        }
    }

    /// Reads a Hugging Face `config.json` file.
    pub fn from_hf_file(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io("reading", path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_hf_json(&value, &path.display().to_string())
    }

    /// Parses a Hugging Face config (the JSON value of `config.json`); `origin` names it in errors.
    pub fn from_hf_json(value: &Value, origin: &str) -> Result<ModelConfig> {
        let Some(object) = value.as_object() else {
            return Err(ModelError::Config {
                origin: origin.to_string(),
                key: "(top level)".into(),
                problem: "expected a JSON object".into(),
            });
        };
        let keys = JsonKeys { object, origin };
        let model_type = object.get("model_type").and_then(Value::as_str);
        let architectures: Vec<&str> = object
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let family = model_type
            .and_then(Family::from_name)
            .or_else(|| architectures.iter().find_map(|a| Family::from_name(a)));
        let Some(family) = family else {
            let found = match (model_type, architectures.is_empty()) {
                (Some(t), true) => t.to_string(),
                (Some(t), false) => format!("{t} ({})", architectures.join(", ")),
                (None, false) => architectures.join(", "),
                (None, true) => "(no model_type or architectures key)".to_string(),
            };
            return Err(ModelError::UnsupportedArchitecture {
                found,
                origin: origin.to_string(),
                supported: SUPPORTED_ARCHITECTURES.to_string(),
            });
        };
        if family == Family::Gemma3 {
            if let Some(text) = keys.present("text_config") {
                // Gemma3ForConditionalGeneration: grpo trains its text model, whose config
                // this is (its weights under `language_model`; the vision tower is left out).
                let mut text = text.clone();
                if let Some(t) = text.as_object_mut() {
                    t.entry("model_type").or_insert_with(|| json!("gemma3_text"));
                    if let Some(tie) = keys.present("tie_word_embeddings") {
                        t.entry("tie_word_embeddings").or_insert_with(|| tie.clone());
                    }
                }
                return Self::from_hf_json(&text, &format!("{origin} (text_config)"));
            }
        }
        let with_defaults;
        let keys = if family == Family::Gemma3 {
            with_defaults = gemma3_defaults(object);
            JsonKeys {
                object: &with_defaults,
                origin,
            }
        } else {
            keys
        };
        let activation = parse_activation(&keys, family)?;
        if keys.bool_or("mlp_bias", false)? {
            return Err(keys.error("mlp_bias", "MLP bias is not supported"));
        }
        for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if let Some(v) = keys.present(key) {
                return Err(keys.error(
                    key,
                    format!("soft-capping ({v}) is not supported; Gemma 3 sets it null"),
                ));
            }
        }
        if keys.bool_or("use_bidirectional_attention", false)? {
            return Err(keys.error(
                "use_bidirectional_attention",
                "bidirectional attention (EmbeddingGemma) is not a causal language model",
            ));
        }
        let hidden_size = keys.usize("hidden_size")?;
        let num_attention_heads = keys.usize("num_attention_heads")?;
        let num_key_value_heads = keys
            .usize_opt("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        let head_dim = match keys.usize_opt("head_dim")? {
            Some(d) => d,
            None => {
                if num_attention_heads == 0 || hidden_size % num_attention_heads != 0 {
                    return Err(keys.error(
                        "head_dim",
                        "missing and hidden_size is not a multiple of num_attention_heads",
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        let (rope_theta, rope_scaling, rope_local_theta) = match family {
            Family::Gemma3 => gemma3_rope(&keys)?,
            _ => {
                let (theta, scaling) = parse_rope(&keys)?;
                (theta, scaling, None)
            }
        };
        let attention_bias_key = keys.bool_or("attention_bias", false)?;
        let (attention_bias, o_proj_bias, qk_norm) = match family {
            Family::Llama | Family::Mistral => (attention_bias_key, attention_bias_key, false),
            Family::Qwen2 => (true, false, false),
            Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3 => {
                (attention_bias_key, attention_bias_key, true)
            }
        };
        let num_hidden_layers = keys.usize("num_hidden_layers")?;
        let moe = match family {
            Family::Qwen3Moe => Some(parse_moe(&keys)?),
            _ => None,
        };
        let eos_token_ids = keys.token_ids("eos_token_id")?;
        let single_id = |key: &str| -> Result<Option<u32>> { Ok(keys.token_ids(key)?.first().copied()) };
        let config = ModelConfig {
            family,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            intermediate_size: keys.usize("intermediate_size")?,
            vocab_size: keys.usize("vocab_size")?,
            rope_theta,
            rope_scaling,
            rms_norm_eps: keys.f64_or("rms_norm_eps", 1e-6)?,
            tie_word_embeddings: keys.bool_or("tie_word_embeddings", false)?,
            attention_bias,
            o_proj_bias,
            qk_norm,
            max_position_embeddings: keys.usize_opt("max_position_embeddings")?.unwrap_or(2048),
            bos_token_id: single_id("bos_token_id")?,
            eos_token_ids,
            pad_token_id: single_id("pad_token_id")?,
            initializer_range: keys.f64_or("initializer_range", 0.02)?,
            moe,
            // Qwen's `sliding_window` is read only with `use_sliding_window`, which grpo's Qwen
            // families refuse by not reading it; Mistral's and Gemma's apply whenever set.
            sliding_window: match family {
                Family::Mistral | Family::Gemma3 => keys.usize_opt("sliding_window")?,
                _ => None,
            },
            layer_types: match family {
                Family::Gemma3 => parse_layer_types(&keys, num_hidden_layers)?,
                _ => Vec::new(),
            },
            rope_local_theta,
            norm_unit_offset: family == Family::Gemma3,
            sandwich_norms: family == Family::Gemma3,
            activation,
            scale_embeddings: family == Family::Gemma3,
            query_pre_attn_scalar: match family {
                Family::Gemma3 => Some(keys.f64_or("query_pre_attn_scalar", 256.0)?),
                _ => None,
            },
        };
        config.validate(origin)?;
        Ok(config)
    }

    /// Checks the sizes are consistent (heads divide, nothing zero).
    pub fn validate(&self, origin: &str) -> Result<()> {
        let err = |key: &str, problem: String| ModelError::Config {
            origin: origin.to_string(),
            key: key.to_string(),
            problem,
        };
        for (key, v) in [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return Err(err(key, "must be positive, found 0".into()));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(err(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(err(
                "head_dim",
                format!("{} is odd; RoPE needs an even head width", self.head_dim),
            ));
        }
        Ok(())
    }

    /// Whether layer `layer`'s MLP is a mixture of experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(layer))
    }

    /// How many layers are mixtures of experts (`Lm`, the layers a routing record covers).
    pub fn moe_layers(&self) -> usize {
        (0..self.num_hidden_layers)
            .filter(|&l| self.is_moe_layer(l))
            .count()
    }

    /// The first end-of-sequence token, if any.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_ids.first().copied()
    }

    /// The RoPE inverse frequencies (length `head_dim / 2`) of the global layers, with
    /// scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        self.rope_inv_freq_of(AttentionKind::Full)
    }

    /// The RoPE inverse frequencies of layers of attention `kind`: the sliding layers' own
    /// unscaled base where the model has one ([`ModelConfig::rope_local_theta`]).
    pub fn rope_inv_freq_of(&self, kind: AttentionKind) -> Vec<f64> {
        let (theta, scaling) = match (kind, self.rope_local_theta) {
            (AttentionKind::Sliding, Some(local)) => (local, None),
            _ => (self.rope_theta, self.rope_scaling.as_ref()),
        };
        let d = self.head_dim as f64;
        let mut inv: Vec<f64> = (0..self.head_dim / 2)
            .map(|i| 1.0 / theta.powf(2.0 * i as f64 / d))
            .collect();
        if let Some(s) = scaling {
            s.scale_inv_freq(&mut inv);
        }
        inv
    }

    /// Layer `layer`'s attention.
    pub fn attention_kind(&self, layer: usize) -> AttentionKind {
        match self.layer_types.get(layer) {
            Some(&kind) => kind,
            None if self.layer_types.is_empty() && self.sliding_window.is_some() => AttentionKind::Sliding,
            None => AttentionKind::Full,
        }
    }

    /// The attention kinds the layers use, in the order [`AttentionKind::Full`],
    /// [`AttentionKind::Sliding`] (one for most models, both for Gemma 3).
    pub fn attention_kinds(&self) -> Vec<AttentionKind> {
        [AttentionKind::Full, AttentionKind::Sliding]
            .into_iter()
            .filter(|&k| (0..self.num_hidden_layers).any(|l| self.attention_kind(l) == k))
            .collect()
    }

    /// The window of layers of attention `kind`: [`ModelConfig::sliding_window`] for sliding
    /// layers, none for global ones.
    pub fn window_of(&self, kind: AttentionKind) -> Option<usize> {
        match kind {
            AttentionKind::Sliding => self.sliding_window,
            AttentionKind::Full => None,
        }
    }

    /// The factor attention scores are multiplied by: `query_pre_attn_scalar^-1/2`, or
    /// `head_dim^-1/2`.
    pub fn attention_scale(&self) -> f64 {
        1.0 / self.query_pre_attn_scalar.unwrap_or(self.head_dim as f64).sqrt()
    }

    /// A Hugging Face `config.json` value that transformers loads as this model (f32 weights).
    pub fn to_hf_json(&self) -> Value {
        let ids = |v: &[u32]| -> Value {
            match v {
                [] => Value::Null,
                [one] => json!(one),
                many => json!(many),
            }
        };
        let mut c = json!({
            "architectures": [self.family.hf_architecture()],
            "model_type": self.family.model_type(),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "hidden_act": self.activation.hf_name(),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": ids(&self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
            "use_cache": true,
        });
        let object = c.as_object_mut().expect("object literal");
        match self.family {
            Family::Llama => {
                object.insert("attention_bias".into(), json!(self.attention_bias));
                object.insert("mlp_bias".into(), json!(false));
            }
            Family::Mistral => {
                object.insert("sliding_window".into(), json!(self.sliding_window));
            }
            Family::Qwen2 => {
                object.insert("use_sliding_window".into(), json!(false));
            }
            Family::Qwen3 | Family::Qwen3Moe => {
                object.insert("attention_bias".into(), json!(self.attention_bias));
                object.insert("use_sliding_window".into(), json!(false));
            }
            Family::Gemma3 => {
                object.insert("attention_bias".into(), json!(self.attention_bias));
                object.insert("hidden_activation".into(), json!(self.activation.hf_name()));
                // transformers 5 types it an integer and refuses `24.0`.
                let scalar = self.query_pre_attn_scalar.map(|v| match v.fract() == 0.0 {
                    true => json!(v as i64),
                    false => json!(v),
                });
                object.insert("query_pre_attn_scalar".into(), json!(scalar));
                object.insert("sliding_window".into(), json!(self.sliding_window));
                let types: Vec<&str> = (0..self.num_hidden_layers)
                    .map(|l| self.attention_kind(l).hf_name())
                    .collect();
                object.insert("layer_types".into(), json!(types));
                object.insert("final_logit_softcapping".into(), Value::Null);
                object.insert("attn_logit_softcapping".into(), Value::Null);
                let mut full = rope_scaling_json(self.rope_scaling.as_ref());
                if full.is_null() {
                    full = json!({"rope_type": "default"});
                }
                full["rope_theta"] = json!(self.rope_theta);
                object.insert(
                    "rope_parameters".into(),
                    json!({
                        "full_attention": full,
                        "sliding_attention": {
                            "rope_type": "default",
                            "rope_theta": self.rope_local_theta.unwrap_or(self.rope_theta),
                        },
                    }),
                );
                object.remove("rope_theta");
                return c;
            }
        }
        if let Some(m) = &self.moe {
            object.insert("num_experts".into(), json!(m.num_experts));
            object.insert("num_experts_per_tok".into(), json!(m.experts_per_token));
            object.insert("moe_intermediate_size".into(), json!(m.expert_intermediate_size));
            object.insert("norm_topk_prob".into(), json!(m.norm_topk_prob));
            object.insert("mlp_only_layers".into(), json!(m.mlp_only_layers));
            object.insert("decoder_sparse_step".into(), json!(m.decoder_sparse_step));
            object.insert("router_aux_loss_coef".into(), json!(m.router_aux_loss_coef));
        }
        let scaling = rope_scaling_json(self.rope_scaling.as_ref());
        object.insert("rope_scaling".into(), scaling);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen2_json() -> Value {
        json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
            "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "max_position_embeddings": 32768,
            "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu"
        })
    }

    #[test]
    fn parses_qwen2_config() {
        let c = ModelConfig::from_hf_json(&qwen2_json(), "qwen2.json").unwrap();
        assert_eq!(c.family, Family::Qwen2);
        assert_eq!(c.head_dim, 64);
        assert!(c.attention_bias && !c.o_proj_bias && !c.qk_norm && c.tie_word_embeddings);
        assert_eq!(c.eos_token_ids, vec![151645]);
        assert_eq!(c.pad_token_id, None);
        assert_eq!(c.rope_theta, 1e6);
        // Round trip through to_hf_json.
        let again = ModelConfig::from_hf_json(&c.to_hf_json(), "again").unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn parses_llama3_rope_scaling_and_eos_list() {
        let v = json!({
            "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "eos_token_id": [128001, 128008, 128009], "bos_token_id": 128000,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"}
        });
        let c = ModelConfig::from_hf_json(&v, "llama.json").unwrap();
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        assert_eq!(c.eos_token_id(), Some(128001));
        let Some(RopeScaling::Llama3 { factor, .. }) = c.rope_scaling else {
            panic!("expected llama3 scaling")
        };
        assert_eq!(factor, 32.0);
        // Scaled frequencies: the highest frequency is kept, the lowest divided by 32.
        let inv = c.rope_inv_freq();
        assert_eq!(inv[0], 1.0);
        let last_unscaled = 1.0 / 500000f64.powf(62.0 / 64.0);
        assert!((inv[31] - last_unscaled / 32.0).abs() < 1e-15);
        assert_eq!(ModelConfig::from_hf_json(&c.to_hf_json(), "x").unwrap(), c);
    }

    #[test]
    fn transformers5_rope_parameters_and_qwen3_head_dim() {
        let v = json!({
            "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "vocab_size": 300,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}
        });
        let c = ModelConfig::from_hf_json(&v, "q3.json").unwrap();
        assert_eq!((c.family, c.head_dim, c.rope_theta), (Family::Qwen3, 32, 1e6));
        assert!(c.qk_norm && !c.attention_bias && c.rope_scaling.is_none());
    }

    /// Gemma 3 1B's text config as transformers 4 wrote it: the global layer every sixth,
    /// `rope_local_base_freq`, no RoPE scaling.
    fn gemma3_1b_json() -> Value {
        json!({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
            "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000,
            "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512,
            "sliding_window_pattern": 6, "vocab_size": 262144, "bos_token_id": 2,
            "eos_token_id": [1, 106], "pad_token_id": 0, "final_logit_softcapping": null,
            "attn_logit_softcapping": null
        })
    }

    /// The exported config reads back as the same model, and types `query_pre_attn_scalar` as
    /// transformers 5 does (an integer: it refuses `256.0`).
    #[test]
    fn an_exported_gemma3_config_reads_back_and_keeps_transformers_types() {
        let c = ModelConfig::from_hf_json(&gemma3_1b_json(), "gemma-3-1b-it").unwrap();
        let exported = c.to_hf_json();
        assert_eq!(exported["query_pre_attn_scalar"], json!(256));
        assert!(exported["query_pre_attn_scalar"].is_u64());
        assert_eq!(ModelConfig::from_hf_json(&exported, "exported").unwrap(), c);
    }

    #[test]
    fn parses_gemma3_configs_old_new_and_multimodal() {
        let c = ModelConfig::from_hf_json(&gemma3_1b_json(), "gemma-3-1b-it").unwrap();
        assert_eq!(c.family, Family::Gemma3);
        assert!(c.qk_norm && c.norm_unit_offset && c.sandwich_norms && c.scale_embeddings);
        assert!(c.tie_word_embeddings && c.activation == Activation::GeluTanh);
        let global: Vec<usize> = (0..26)
            .filter(|&l| c.attention_kind(l) == AttentionKind::Full)
            .collect();
        assert_eq!(global, [5, 11, 17, 23]);
        assert_eq!(
            (c.sliding_window, c.query_pre_attn_scalar),
            (Some(512), Some(256.0))
        );
        assert_eq!(
            (c.rope_theta, c.rope_local_theta, c.rope_scaling.clone()),
            (1e6, Some(1e4), None)
        );
        assert_eq!(c.eos_token_ids, [1, 106]);
        // The sliding layers' RoPE at base 1e4, the global ones' at 1e6.
        assert_eq!(
            c.rope_inv_freq_of(AttentionKind::Sliding)[1],
            1.0 / 1e4f64.powf(2.0 / 256.0)
        );
        assert_eq!(c.rope_inv_freq()[1], 1.0 / 1e6f64.powf(2.0 / 256.0));
        assert_eq!(c.attention_scale(), 1.0 / 16.0);
        // Written as transformers 5 writes it (layer_types, rope_parameters by layer type), read back.
        let again = ModelConfig::from_hf_json(&c.to_hf_json(), "again").unwrap();
        assert_eq!(again, c);

        // Gemma 3 4B: Gemma3ForConditionalGeneration, its text config naming only what differs
        // from transformers' defaults; linear scaling of the global layers' RoPE.
        let v = json!({
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": {
                "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024
            },
            "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": [1, 106]
        });
        let c = ModelConfig::from_hf_json(&v, "gemma-3-4b-it").unwrap();
        assert_eq!(
            (
                c.vocab_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim
            ),
            (262208, 8, 4, 256)
        );
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 8.0 }));
        assert_eq!(c.rope_inv_freq()[1], 1.0 / 1e6f64.powf(2.0 / 256.0) / 8.0);
        assert_eq!(
            c.rope_inv_freq_of(AttentionKind::Sliding)[1],
            1.0 / 1e4f64.powf(2.0 / 256.0)
        );
        assert_eq!(ModelConfig::from_hf_json(&c.to_hf_json(), "again").unwrap(), c);

        // transformers 5's rope_parameters keyed by layer type.
        let mut v = gemma3_1b_json();
        let o = v.as_object_mut().unwrap();
        for k in [
            "rope_theta",
            "rope_local_base_freq",
            "rope_scaling",
            "sliding_window_pattern",
        ] {
            o.remove(k);
        }
        o.insert(
            "layer_types".into(),
            json!(["sliding_attention", "full_attention"]),
        );
        o.insert("num_hidden_layers".into(), json!(2));
        o.insert(
            "rope_parameters".into(),
            json!({"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}),
        );
        let c = ModelConfig::from_hf_json(&v, "t5").unwrap();
        assert_eq!(c.layer_types, [AttentionKind::Sliding, AttentionKind::Full]);
        assert_eq!((c.rope_theta, c.rope_local_theta), (5e5, Some(2e4)));
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 4.0 }));
    }

    #[test]
    fn gemma_settings_grpo_does_not_compute_are_refused_by_key() {
        let refused = |edit: &dyn Fn(&mut Map<String, Value>), key: &str, says: &str| {
            let mut v = gemma3_1b_json();
            edit(v.as_object_mut().unwrap());
            let e = ModelConfig::from_hf_json(&v, "c.json").unwrap_err().to_string();
            assert!(e.contains(&format!("key `{key}`")) && e.contains(says), "{e}");
        };
        refused(
            &|o| {
                o.insert("final_logit_softcapping".into(), json!(30.0));
            },
            "final_logit_softcapping",
            "soft-capping (30.0) is not supported",
        );
        refused(
            &|o| {
                o.insert("hidden_activation".into(), json!("silu"));
            },
            "hidden_activation",
            "activation `silu` is not gemma3_text's; it uses gelu_pytorch_tanh",
        );
        refused(
            &|o| {
                o.insert("layer_types".into(), json!(["full_attention"]));
            },
            "layer_types",
            "1 entries for 26 layers",
        );
        refused(
            &|o| {
                o.insert("use_bidirectional_attention".into(), json!(true));
            },
            "use_bidirectional_attention",
            "EmbeddingGemma",
        );
        refused(
            &|o| {
                o.insert("rope_scaling".into(), json!({"rope_type": "yarn", "factor": 2.0}));
            },
            "rope_scaling",
            "`yarn` is not supported",
        );
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let v = json!({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]});
        let e = ModelConfig::from_hf_json(&v, "m/config.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unsupported model architecture `gemma2 (Gemma2ForCausalLM)`"),
            "{e}"
        );
        assert!(
            e.contains("m/config.json") && e.contains("qwen3 (Qwen3ForCausalLM)"),
            "{e}"
        );
        // Gemma 2 (soft-capped attention) and PaliGemma are other architectures than Gemma 3.
        for (model_type, arch) in [
            ("gemma", "GemmaForCausalLM"),
            ("paligemma", "PaliGemmaForConditionalGeneration"),
        ] {
            let v = json!({"model_type": model_type, "architectures": [arch]});
            let e = ModelConfig::from_hf_json(&v, "c.json").unwrap_err().to_string();
            assert!(
                e.contains(&format!("`{model_type} ({arch})`"))
                    && e.contains("gemma3_text (Gemma3ForCausalLM"),
                "{e}"
            );
        }
    }

    #[test]
    fn bad_values_name_the_key() {
        let mut v = qwen2_json();
        v["num_key_value_heads"] = json!(3);
        let e = ModelConfig::from_hf_json(&v, "c.json").unwrap_err().to_string();
        assert_eq!(
            e,
            "config c.json: key `num_key_value_heads`: 3 does not divide num_attention_heads 14"
        );
        let mut v = qwen2_json();
        v.as_object_mut().unwrap().remove("hidden_size");
        let e = ModelConfig::from_hf_json(&v, "c.json").unwrap_err().to_string();
        assert!(e.contains("key `hidden_size`: missing"), "{e}");
        let mut v = qwen2_json();
        v["vocab_size"] = json!("big");
        let e = ModelConfig::from_hf_json(&v, "c.json").unwrap_err().to_string();
        assert!(
            e.contains("`vocab_size`: expected a non-negative integer, found \"big\""),
            "{e}"
        );
        let mut v = qwen2_json();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        let e = ModelConfig::from_hf_json(&v, "c.json").unwrap_err().to_string();
        assert!(e.contains("RoPE scaling type `yarn` is not supported"), "{e}");
    }
}
