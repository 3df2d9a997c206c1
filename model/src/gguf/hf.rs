//! llama.cpp's layout mapped onto Hugging Face's: tensor names, the Q/K row permutation of
//! the Llama architecture, and the whole model's weights loaded under HF names.

use super::{GgufFile, GgufTensorInfo};
use crate::config::{Family, ModelConfig};
use crate::error::{ModelError, Result};
use crate::params::param_table;
use crate::safetensors_io::ModelWeights;
use crate::tensor::HostTensor;
use std::collections::HashMap;

/// Maps a GGUF tensor name onto its Hugging Face name.
pub fn hf_name(gguf_name: &str) -> Option<String> {
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
    let hf = match kind {
        "attn_norm" => "input_layernorm",
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
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

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
    /// errors), with llama.cpp's Q/K permutation undone for the Llama architecture. Tensors are
    /// dequantised on all available cores.
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
            let Some(name) = hf_name(&info.name) else {
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
        for (name, info) in &by_hf {
            if !table_names.contains(name.as_str()) {
                return Err(ModelError::UnexpectedTensor {
                    name: format!("{name} (GGUF {})", info.name),
                    found: info.hf_shape(),
                    origin: origin.clone(),
                    family: config.family.to_string(),
                });
            }
        }
        let mut jobs = Vec::with_capacity(table.len());
        for spec in &table {
            let info = by_hf.get(&spec.name).ok_or_else(|| ModelError::MissingTensor {
                name: spec.name.clone(),
                expected: spec.shape.clone(),
                origin: origin.clone(),
            })?;
            if info.hf_shape() != spec.shape {
                return Err(ModelError::ShapeMismatch {
                    name: format!("{} (GGUF {})", spec.name, info.name),
                    expected: spec.shape.clone(),
                    found: info.hf_shape(),
                    origin: origin.clone(),
                });
            }
            self.check_supported(info)?;
            let permute_heads = if config.family == Family::Llama {
                match info.name.split('.').nth(2) {
                    Some("attn_q") => Some(config.num_attention_heads),
                    Some("attn_k") => Some(config.num_key_value_heads),
                    _ => None,
                }
            } else {
                None
            };
            jobs.push((spec, *info, permute_heads));
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
                            .map(|(spec, info, permute_heads)| {
                                let bytes = self.tensor_bytes(info)?;
                                let mut values = vec![0f32; info.numel() as usize];
                                info.ggml_type.dequantize(bytes, &mut values);
                                if let Some(heads) = permute_heads {
                                    let row_len = if spec.shape.len() == 2 { spec.shape[1] } else { 1 };
                                    values = unpermute_rows(&values, *heads, row_len);
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
