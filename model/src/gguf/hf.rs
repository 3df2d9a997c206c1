//! llama.cpp's layout mapped onto Hugging Face's: the metadata read as a [`ModelConfig`], tensor
//! names, the Q/K row permutation of the Llama architecture, and the whole model's weights
//! loaded under HF names.

use super::{GgufFile, GgufTensorInfo, GgufValue};
use crate::config::{
    Activation, AttentionKind, Family, ModelConfig, MoeConfig, RopeScaling, SUPPORTED_ARCHITECTURES,
};
use crate::error::{ModelError, Result};
use crate::params::param_table;
use crate::safetensors_io::ModelWeights;
use crate::tensor::HostTensor;
use std::collections::HashMap;

impl ModelConfig {
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
        let gemma = family == Family::Gemma3;
        if let Some(cap) = gguf.metadata(&key("final_logit_softcapping")) {
            return Err(ModelError::Config {
                origin: path.display().to_string(),
                key: key("final_logit_softcapping"),
                problem: format!("soft-capping ({cap:?}) is not supported; Gemma 3 has none"),
            });
        }
        let block_count = gguf.metadata_usize(&key("block_count"))?;
        // llama.cpp's gemma3: every sixth layer global unless the file says otherwise, the
        // sliding layers' RoPE base 1e4, attention scaled by the head width but for the 27B
        // (62 layers), whose query_pre_attn_scalar is hidden / heads.
        let layer_types = if gemma {
            let pattern = match gguf.metadata(&key("attention.sliding_window_pattern")) {
                Some(_) => gguf.metadata_usize(&key("attention.sliding_window_pattern"))?,
                None => 6,
            };
            (0..block_count)
                .map(|i| {
                    if (i + 1).is_multiple_of(pattern.max(1)) {
                        AttentionKind::Full
                    } else {
                        AttentionKind::Sliding
                    }
                })
                .collect()
        } else {
            Vec::new()
        };
        let rope_scaling = match gguf.metadata(&key("rope.scaling.type")) {
            Some(GgufValue::String(kind)) if kind == "linear" => Some(RopeScaling::Linear {
                factor: f64_key(&key("rope.scaling.factor"), 1.0)?,
            }),
            Some(GgufValue::String(kind)) if kind == "none" => None,
            Some(other) => {
                return Err(ModelError::Config {
                    origin: path.display().to_string(),
                    key: key("rope.scaling.type"),
                    problem: format!("RoPE scaling {other:?} is not supported from GGUF; supported: linear"),
                })
            }
            None => None,
        };
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
            num_hidden_layers: block_count,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            intermediate_size: gguf.metadata_usize(&key("feed_forward_length"))?,
            vocab_size,
            rope_theta: f64_key(&key("rope.freq_base"), 10000.0)?,
            rope_scaling,
            rms_norm_eps: f64_key(&key("attention.layer_norm_rms_epsilon"), 1e-6)?,
            tie_word_embeddings: gguf.tensor_info("output.weight").is_none(),
            attention_bias: family == Family::Qwen2 || has_bias,
            o_proj_bias: gguf.tensor_info("blk.0.attn_output.bias").is_some(),
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3),
            max_position_embeddings: match gguf.metadata(&key("context_length")) {
                Some(_) => gguf.metadata_usize(&key("context_length"))?,
                None => 2048,
            },
            bos_token_id: id_key("tokenizer.ggml.bos_token_id")?,
            eos_token_ids: id_key("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
            pad_token_id: id_key("tokenizer.ggml.padding_token_id")?,
            initializer_range: 0.02,
            moe,
            sliding_window: match gguf.metadata(&key("attention.sliding_window")) {
                Some(_) if matches!(family, Family::Gemma3 | Family::Mistral) => {
                    Some(gguf.metadata_usize(&key("attention.sliding_window"))?)
                }
                _ => None,
            },
            layer_types,
            rope_local_theta: gemma.then_some(1e4),
            norm_unit_offset: gemma,
            sandwich_norms: gemma,
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            scale_embeddings: gemma,
            query_pre_attn_scalar: gemma.then(|| {
                if block_count == 62 {
                    (hidden_size / num_attention_heads.max(1)) as f64
                } else {
                    head_dim as f64
                }
            }),
        };
        config.validate(&path.display().to_string())?;
        Ok(config)
    }
}

/// Maps a GGUF tensor name of a `family` model onto its Hugging Face name.
pub fn hf_name(family: Family, gguf_name: &str) -> Option<String> {
    match gguf_name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let mut parts = rest.splitn(3, '.');
    let (layer, kind, suffix) = (parts.next()?, parts.next()?, parts.next()?);
    layer.parse::<usize>().ok()?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let gemma = family == Family::Gemma3;
    let hf = match kind {
        "attn_norm" => "input_layernorm",
        // Gemma's four norms: llama.cpp's `ffn_norm` is the MLP's input norm in every family,
        // which Gemma calls `pre_feedforward_layernorm`.
        "ffn_norm" if gemma => "pre_feedforward_layernorm",
        "post_attention_norm" if gemma => "post_attention_layernorm",
        "post_ffw_norm" if gemma => "post_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "ffn_gate_inp" => "mlp.gate",
        // Stacked experts: down is the table's own tensor; gate and up are the two halves of
        // its `gate_up_proj` ([`GATE_EXPS`], [`UP_EXPS`]).
        "ffn_down_exps" if suffix == "weight" => {
            return Some(format!("model.layers.{layer}.mlp.experts.down_proj"))
        }
        "ffn_gate_exps" if suffix == "weight" => return Some(format!("model.layers.{layer}.{GATE_EXPS}")),
        "ffn_up_exps" if suffix == "weight" => return Some(format!("model.layers.{layer}.{UP_EXPS}")),
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// The name a GGUF `ffn_gate_exps` tensor goes by until it is stacked with `ffn_up_exps` into
/// the layer's `mlp.experts.gate_up_proj` (each expert's gate rows, then its up rows).
const GATE_EXPS: &str = "mlp.experts.gate_proj (GGUF ffn_gate_exps)";
/// The name a GGUF `ffn_up_exps` tensor goes by until it is stacked.
const UP_EXPS: &str = "mlp.experts.up_proj (GGUF ffn_up_exps)";

/// Undoes llama.cpp's RoPE row permutation of a q or k projection (rows `[n_heads * head_dim]`,
/// each row `row_len` values): llama.cpp row `h*hd + 2*i + j` is Hugging Face row
/// `h*hd + j*hd/2 + i`.
pub fn unpermute_rows(values: &[f32], n_heads: usize, row_len: usize) -> Vec<f32> {
    let rows = values.len() / row_len;
    let head_dim = rows / n_heads;
    let half = head_dim / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..n_heads {
        for i in 0..half {
            for j in 0..2 {
                let src = h * head_dim + 2 * i + j;
                let dst = h * head_dim + j * half + i;
                out[dst * row_len..(dst + 1) * row_len]
                    .copy_from_slice(&values[src * row_len..(src + 1) * row_len]);
            }
        }
    }
    out
}

impl GgufFile {
    /// Loads every tensor as an f32 [`HostTensor`] under its Hugging Face name, checked against
    /// the parameter table of `config` (missing, unexpected and wrongly shaped tensors are
    /// errors), with llama.cpp's Q/K permutation undone for the Llama architecture and the one
    /// its converter adds to Gemma's norm offsets taken off. Tensors are dequantised on all
    /// available cores.
    pub fn load_weights(&self, config: &ModelConfig) -> Result<ModelWeights> {
        let origin = self.path.display().to_string();
        let table = param_table(config);
        let mut by_hf: HashMap<String, &GgufTensorInfo> = HashMap::new();
        for info in &self.tensors {
            if info.name == "rope_freqs.weight" {
                return Err(ModelError::UnsupportedGgufFeature {
                    path: self.path.clone(),
                    detail: "tensor rope_freqs.weight (Llama 3.1 RoPE scaling factors) is not supported; \
                             load the model from its Hugging Face checkpoint, whose config.json has rope_scaling"
                        .into(),
                });
            }
            let Some(name) = hf_name(config.family, &info.name) else {
                return Err(ModelError::UnexpectedTensor {
                    name: info.name.clone(),
                    found: info.hf_shape(),
                    origin: origin.clone(),
                    family: config.family.to_string(),
                });
            };
            by_hf.insert(name, info);
        }
        let table_names: std::collections::HashSet<&str> = table.iter().map(|p| p.name.as_str()).collect();
        let stacked_half = |name: &str| {
            name.strip_suffix(GATE_EXPS)
                .or_else(|| name.strip_suffix(UP_EXPS))
                .is_some_and(|layer| {
                    table_names.contains(format!("{layer}mlp.experts.gate_up_proj").as_str())
                })
        };
        for (name, info) in &by_hf {
            if !table_names.contains(name.as_str()) && !stacked_half(name) {
                return Err(ModelError::UnexpectedTensor {
                    name: format!("{name} (GGUF {})", info.name),
                    found: info.hf_shape(),
                    origin: origin.clone(),
                    family: config.family.to_string(),
                });
            }
        }
        let mut jobs = Vec::with_capacity(table.len());
        let find = |name: &str, shape: &[usize]| -> Result<&GgufTensorInfo> {
            let info = by_hf.get(name).ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                expected: shape.to_vec(),
                origin: origin.clone(),
            })?;
            if info.hf_shape() != shape {
                return Err(ModelError::ShapeMismatch {
                    name: format!("{name} (GGUF {})", info.name),
                    expected: shape.to_vec(),
                    found: info.hf_shape(),
                    origin: origin.clone(),
                });
            }
            self.check_supported(info)?;
            Ok(info)
        };
        for spec in &table {
            let infos = match spec.name.strip_suffix("mlp.experts.gate_up_proj") {
                Some(layer) => {
                    let mut half = spec.shape.clone();
                    half[1] /= 2;
                    vec![
                        find(&format!("{layer}{GATE_EXPS}"), &half)?,
                        find(&format!("{layer}{UP_EXPS}"), &half)?,
                    ]
                }
                None => vec![find(&spec.name, &spec.shape)?],
            };
            let info = infos[0];
            let permute_heads = if config.family == Family::Llama {
                match info.name.split('.').nth(2) {
                    Some("attn_q") => Some(config.num_attention_heads),
                    Some("attn_k") => Some(config.num_key_value_heads),
                    _ => None,
                }
            } else {
                None
            };
            // llama.cpp stores Gemma's `1 + w` norms as their scale.
            let unit_offset = config.norm_unit_offset && spec.kind == crate::params::ParamKind::NormOffset;
            jobs.push((spec, infos, permute_heads, unit_offset));
        }
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(jobs.len().max(1));
        let chunk = jobs.len().div_ceil(threads).max(1);
        let results: Vec<Result<Vec<HostTensor>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = jobs
                .chunks(chunk)
                .map(|part| {
                    scope.spawn(move || {
                        part.iter()
                            .map(|(spec, infos, permute_heads, unit_offset)| {
                                let mut parts = Vec::with_capacity(infos.len());
                                for info in infos {
                                    let bytes = self.tensor_bytes(info)?;
                                    let mut part = vec![0f32; info.numel() as usize];
                                    info.ggml_type.dequantize(bytes, &mut part);
                                    parts.push(part);
                                }
                                // Stacked halves `[E, F, H]` each: expert e's gate rows, then its up rows.
                                let mut values = match parts.as_slice() {
                                    [one] => one.clone(),
                                    halves => {
                                        let per_expert = halves[0].len() / spec.shape[0];
                                        (0..spec.shape[0])
                                            .flat_map(|e| {
                                                halves.iter().flat_map(move |h| {
                                                    &h[e * per_expert..(e + 1) * per_expert]
                                                })
                                            })
                                            .copied()
                                            .collect()
                                    }
                                };
                                if let Some(heads) = permute_heads {
                                    let row_len = if spec.shape.len() == 2 { spec.shape[1] } else { 1 };
                                    values = unpermute_rows(&values, *heads, row_len);
                                }
                                if *unit_offset {
                                    values.iter_mut().for_each(|v| *v -= 1.0);
                                }
                                Ok(HostTensor::from_f32(
                                    spec.name.clone(),
                                    spec.shape.clone(),
                                    &values,
                                ))
                            })
                            .collect()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("dequantisation thread panicked"))
                .collect()
        });
        let mut tensors = Vec::with_capacity(table.len());
        for part in results {
            tensors.extend(part?);
        }
        Ok(ModelWeights {
            config: config.clone(),
            tensors,
        })
    }
}
