//! Model configurations of the supported decoder families (Llama, Qwen2, Qwen3, Qwen3-MoE), parsed from a
//! Hugging Face `config.json` or from GGUF metadata, and written back as a `config.json`.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::error::{ModelError, Result};
use crate::gguf::{GgufFile, GgufValue};

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
}

/// Architecture names accepted, as listed in error messages.
pub const SUPPORTED_ARCHITECTURES: &str =
    "llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM), qwen3_moe (Qwen3MoeForCausalLM)";

impl Family {
    /// The Hugging Face `model_type` (also the GGUF `general.architecture`).
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Mistral => "mistral",
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
    /// masks of `forward.rs`; the KV cache keeps every position and masks the older ones).
    /// `None`: full causal attention.
    pub sliding_window: Option<usize>,
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
            format!("RoPE scaling type `{other}` is not supported; supported: default, llama3"),
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
        let act = object.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" {
            return Err(keys.error(
                "hidden_act",
                format!("activation `{act}` is not supported; only silu (SwiGLU) is"),
            ));
        }
        if keys.bool_or("mlp_bias", false)? {
            return Err(keys.error("mlp_bias", "MLP bias is not supported"));
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
        // transformers >= 5 writes `rope_parameters` holding rope_theta and the scaling.
        let (rope_theta, rope_scaling) = if keys.present("rope_parameters").is_some() {
            let rp = object["rope_parameters"]
                .as_object()
                .ok_or_else(|| keys.error("rope_parameters", "expected an object with rope_theta"))?;
            let inner = JsonKeys { object: rp, origin };
            (
                inner.f64_or("rope_theta", keys.f64_or("rope_theta", 10000.0)?)?,
                parse_rope_scaling(&keys, "rope_parameters")?,
            )
        } else {
            (
                keys.f64_or("rope_theta", 10000.0)?,
                parse_rope_scaling(&keys, "rope_scaling")?,
            )
        };
        let attention_bias_key = keys.bool_or("attention_bias", false)?;
        let (attention_bias, o_proj_bias, qk_norm) = match family {
            Family::Llama | Family::Mistral => (attention_bias_key, attention_bias_key, false),
            Family::Qwen2 => (true, false, false),
            Family::Qwen3 | Family::Qwen3Moe => (attention_bias_key, attention_bias_key, true),
        };
        let moe = match family {
            Family::Qwen3Moe => Some(parse_moe(&keys)?),
            _ => None,
        };
        let eos_token_ids = keys.token_ids("eos_token_id")?;
        let single_id = |key: &str| -> Result<Option<u32>> { Ok(keys.token_ids(key)?.first().copied()) };
        let config = ModelConfig {
            family,
            hidden_size,
            num_hidden_layers: keys.usize("num_hidden_layers")?,
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
            // families refuse by not reading it; Mistral's applies whenever it is set.
            sliding_window: match family {
                Family::Mistral => keys.usize_opt("sliding_window")?,
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

    /// Builds the config from GGUF metadata (`general.architecture`, `<arch>.*`,
    /// `tokenizer.ggml.*`). The output head is tied when the file has no `output.weight`.
    pub fn from_gguf(gguf: &GgufFile) -> Result<ModelConfig> {
        let path = gguf.path();
        let arch = gguf.metadata_str("general.architecture")?;
        let Some(family) = Family::from_name(arch) else {
            return Err(ModelError::UnsupportedArchitecture {
                found: arch.to_string(),
                origin: format!("{} (general.architecture)", path.display()),
                supported: SUPPORTED_ARCHITECTURES.to_string(),
            });
        };
        let key = |k: &str| format!("{arch}.{k}");
        if family != Family::Qwen3Moe
            && gguf
                .metadata(&key("expert_count"))
                .is_some_and(|v| v.as_u64() > Some(0))
        {
            return Err(ModelError::Config {
                origin: path.display().to_string(),
                key: key("expert_count"),
                problem: format!(
                    "a mixture-of-experts `{arch}` GGUF (Mixtral's layout) is not supported; grpo reads \
                     the mixture-of-experts architecture qwen3moe, and any supported one from its \
                     Hugging Face checkpoint"
                ),
            });
        }
        let hidden_size = gguf.metadata_usize(&key("embedding_length"))?;
        let num_attention_heads = gguf.metadata_usize(&key("attention.head_count"))?;
        let num_key_value_heads = match gguf.metadata(&key("attention.head_count_kv")) {
            Some(_) => gguf.metadata_usize(&key("attention.head_count_kv"))?,
            None => num_attention_heads,
        };
        let head_dim = match gguf.metadata(&key("attention.key_length")) {
            Some(_) => gguf.metadata_usize(&key("attention.key_length"))?,
            None => hidden_size / num_attention_heads.max(1),
        };
        let vocab_size = match gguf.metadata(&key("vocab_size")) {
            Some(_) => gguf.metadata_usize(&key("vocab_size"))?,
            None => match gguf.metadata("tokenizer.ggml.tokens") {
                Some(GgufValue::Array(tokens)) => tokens.len(),
                _ => match gguf.tensor_info("token_embd.weight") {
                    Some(info) => info.dims[1] as usize,
                    None => {
                        return Err(ModelError::GgufMetadata {
                            path: path.to_path_buf(),
                            key: key("vocab_size"),
                            problem: "missing, and there is no tokenizer.ggml.tokens or token_embd.weight to infer it from".into(),
                        })
                    }
                },
            },
        };
        let f64_key = |k: &str, default: f64| -> Result<f64> {
            match gguf.metadata(k) {
                None => Ok(default),
                Some(_) => gguf.metadata_f64(k),
            }
        };
        let id_key = |k: &str| -> Result<Option<u32>> {
            match gguf.metadata(k) {
                None => Ok(None),
                Some(_) => Ok(Some(gguf.metadata_usize(k)? as u32)),
            }
        };
        let has_bias = gguf.tensor_info("blk.0.attn_q.bias").is_some();
        // llama.cpp's qwen3moe: every layer sparse, the chosen weights renormalised.
        let moe = match family {
            Family::Qwen3Moe => {
                let experts = gguf.metadata_usize(&key("expert_count"))?;
                Some(MoeConfig {
                    num_experts: experts,
                    experts_per_token: gguf.metadata_usize(&key("expert_used_count"))?,
                    expert_intermediate_size: gguf.metadata_usize(&key("expert_feed_forward_length"))?,
                    norm_topk_prob: true,
                    mlp_only_layers: Vec::new(),
                    decoder_sparse_step: 1,
                    router_aux_loss_coef: 0.001,
                })
            }
            _ => None,
        };
        let config = ModelConfig {
            family,
            hidden_size,
            num_hidden_layers: gguf.metadata_usize(&key("block_count"))?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            intermediate_size: gguf.metadata_usize(&key("feed_forward_length"))?,
            vocab_size,
            rope_theta: f64_key(&key("rope.freq_base"), 10000.0)?,
            rope_scaling: None,
            rms_norm_eps: f64_key(&key("attention.layer_norm_rms_epsilon"), 1e-6)?,
            tie_word_embeddings: gguf.tensor_info("output.weight").is_none(),
            attention_bias: family == Family::Qwen2 || has_bias,
            o_proj_bias: gguf.tensor_info("blk.0.attn_output.bias").is_some(),
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe),
            max_position_embeddings: match gguf.metadata(&key("context_length")) {
                Some(_) => gguf.metadata_usize(&key("context_length"))?,
                None => 2048,
            },
            bos_token_id: id_key("tokenizer.ggml.bos_token_id")?,
            eos_token_ids: id_key("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
            pad_token_id: id_key("tokenizer.ggml.padding_token_id")?,
            initializer_range: 0.02,
            moe,
            sliding_window: None,
        };
        config.validate(&path.display().to_string())?;
        Ok(config)
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

    /// Total number of parameters (the sum over [`crate::param_table`]).
    pub fn num_parameters(&self) -> usize {
        crate::params::param_table(self).iter().map(|p| p.numel()).sum()
    }

    /// The parameters one token computes with: all of them, less the experts a token is not
    /// routed to (`num_experts - experts_per_token` of each MoE layer's experts). What a
    /// model-FLOPs count of a mixture of experts multiplies, as its "A3B" names it.
    pub fn active_parameters(&self) -> usize {
        let Some(m) = &self.moe else {
            return self.num_parameters();
        };
        let per_expert = 3 * self.hidden_size * m.expert_intermediate_size;
        let layers = (0..self.num_hidden_layers).filter(|&l| m.is_sparse(l)).count();
        self.num_parameters() - layers * (m.num_experts - m.experts_per_token) * per_expert
    }

    /// The RoPE inverse frequencies (length `head_dim / 2`), with scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        let mut inv: Vec<f64> = (0..self.head_dim / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d))
            .collect();
        if let Some(s) = &self.rope_scaling {
            s.scale_inv_freq(&mut inv);
        }
        inv
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
            "hidden_act": "silu",
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
        let scaling = match &self.rope_scaling {
            None => Value::Null,
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
        };
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
