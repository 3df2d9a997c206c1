//! llama.cpp's layout mapped onto Hugging Face's: tensor names, the Q/K row permutation of
//! the Llama architecture, and the whole model's weights loaded under HF names.

use super::{GgufFile, GgufTensorInfo};
use crate::config::{Family, ModelConfig};
use crate::error::{ModelError, Result};
use crate::params::param_table;
use crate::safetensors_io::ModelWeights;
use crate::tensor::HostTensor;
use std::collections::HashMap;

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
