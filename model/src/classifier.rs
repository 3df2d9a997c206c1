//! Sequence classifiers as transformers stores them (`LlamaForSequenceClassification`,
//! `Qwen2ForSequenceClassification`, `Qwen3ForSequenceClassification`): the decoder trunk
//! (`model.*`, no `lm_head`) and a linear head `score.weight [num_labels, hidden]` without a
//! bias, read at one position per sequence. A discriminative reward model (Skywork-Reward and
//! the like) is such a classifier with one label, its logit the reward.
//!
//! A value model (VeRL's PPO critic) is the per-token sibling, transformers'
//! `*ForTokenClassification` with one label: the trunk and `score.weight [1, hidden]` with
//! `score.bias [1]`, read at every position ([`value_model_param_table`], [`values_graph`]).
//!
//! The position is transformers' rule: the last token that is not `pad_token_id` (the last
//! token when the config has no pad id), so a sequence scores the same alone or padded in a
//! batch.
//!
//! [`DeviceClassifier`] is one on a device, scoring batches of token sequences (the reward
//! models and judges a run's reward role loads); [`value_model_init`] starts a value model.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;
use xla::graph::{Graph, Program, Tensor};
use xla::runtime::{Buffer, Client, Executable};
use xla::DType;

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::error::{runtime, ProgramError, ProgramResult as Result};
use crate::forward::{hidden_states_graph, DecoderParams};
use crate::params::{param_table, ParamKind, ParamSpec};
use crate::programs::{bucket, upload_tensors};
use crate::tensor::HostTensor;

/// The name of the classification head.
pub const SCORE_WEIGHT: &str = "score.weight";

/// The name of a value model's head bias (a token classifier's head has one).
pub const SCORE_BIAS: &str = "score.bias";

/// A value model's head: `score.weight [1, hidden]` (normal(0, initializer_range) when
/// initialised, as transformers does) and `score.bias [1]` (zero).
pub fn value_head_table(config: &ModelConfig) -> Vec<ParamSpec> {
    vec![
        ParamSpec::new(SCORE_WEIGHT, vec![1, config.hidden_size], ParamKind::Matrix),
        ParamSpec::new(SCORE_BIAS, vec![1], ParamKind::Bias),
    ]
}

/// A value model's parameter table: the trunk of `config` (no output head: a token classifier
/// has none) then [`value_head_table`].
pub fn value_model_param_table(config: &ModelConfig) -> Vec<ParamSpec> {
    let mut trunk = config.clone();
    trunk.tie_word_embeddings = true;
    let mut table = param_table(&trunk);
    table.extend(value_head_table(config));
    table
}

/// A value model's starting point, in [`value_model_param_table`] order: the trunk of
/// `weights` (its output head, if any, left out) and a new value head, as transformers
/// initialises a `*ForTokenClassification` head (`score.weight` from normal(0,
/// initializer_range) seeded by `seed`, `score.bias` zero). VeRL's critic starts so from the
/// policy's model.
pub fn value_model_init(
    weights: &crate::ModelWeights,
    seed: u64,
) -> std::result::Result<Vec<HostTensor>, ModelError> {
    let config = &weights.config;
    let head = value_head_table(config);
    let table = value_model_param_table(config);
    let mut out = Vec::with_capacity(table.len());
    for spec in &table[..table.len() - head.len()] {
        let t = weights.get(&spec.name).ok_or_else(|| ModelError::MissingTensor {
            name: spec.name.clone(),
            expected: spec.shape.clone(),
            origin: "the model a value model starts from".into(),
        })?;
        out.push(t.clone());
    }
    out.extend(crate::init::init_tensors(&head, config.initializer_range, seed));
    Ok(out)
}

/// A value model's values `[B, S]` (f32) from final hidden states `h [B, S, hidden]` (after
/// the final norm): `h · weightᵀ + bias` at every position.
pub fn values_graph(h: &Tensor, weight: &Tensor, bias: &Tensor) -> Tensor {
    let (b, s) = (h.dims()[0], h.dims()[1]);
    let v = h.linear(weight).convert_if_needed(DType::F32).reshape(&[b, s]);
    &v + &bias
        .convert_if_needed(DType::F32)
        .reshape(&[])
        .broadcast_to(&[b, s])
}

/// A sequence classifier's configuration: its trunk and how many labels its head scores.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassifierConfig {
    /// The decoder trunk (its head counted as tied: a classifier has no `lm_head`).
    pub trunk: ModelConfig,
    /// Rows of `score.weight`: `len(id2label)`, else `num_labels`, else transformers' default 2.
    pub num_labels: usize,
}

impl ClassifierConfig {
    /// Parses `config.json` of a `*ForSequenceClassification` checkpoint.
    pub fn from_hf_file(path: &Path) -> std::result::Result<ClassifierConfig, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io("reading", path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        ClassifierConfig::from_hf_json(&value, &path.display().to_string())
    }

    /// Parses a config's JSON value; `origin` names it in errors.
    pub fn from_hf_json(value: &Value, origin: &str) -> std::result::Result<ClassifierConfig, ModelError> {
        let architectures: Vec<&str> = value
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if !architectures
            .iter()
            .any(|a| a.ends_with("ForSequenceClassification"))
        {
            return Err(ModelError::Config {
                origin: origin.to_string(),
                key: "architectures".into(),
                problem: format!(
                    "{} is not a sequence classifier: a reward model's config names \
                     `LlamaForSequenceClassification`, `Qwen2ForSequenceClassification` or \
                     `Qwen3ForSequenceClassification` (a scalar `score` head on the decoder)",
                    if architectures.is_empty() {
                        "(none)".to_string()
                    } else {
                        architectures.join(", ")
                    }
                ),
            });
        }
        let mut trunk = ModelConfig::from_hf_json(value, origin)?;
        trunk.tie_word_embeddings = true;
        let labels = |key: &str| -> std::result::Result<Option<usize>, ModelError> {
            match value.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Object(map)) => Ok(Some(map.len())),
                Some(v) => v
                    .as_u64()
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| ModelError::Config {
                        origin: origin.to_string(),
                        key: key.to_string(),
                        problem: format!("expected a count or a label map, found {v}"),
                    }),
            }
        };
        let num_labels = labels("id2label")?.or(labels("num_labels")?).unwrap_or(2);
        if num_labels == 0 {
            return Err(ModelError::Config {
                origin: origin.to_string(),
                key: "id2label".into(),
                problem: "a classifier needs at least one label".into(),
            });
        }
        Ok(ClassifierConfig { trunk, num_labels })
    }

    /// The trunk's parameter table followed by `score.weight`: the checkpoint's tensors and the
    /// classifier program's parameter arguments, in order.
    pub fn param_table(&self) -> Vec<ParamSpec> {
        let mut table = param_table(&self.trunk);
        table.push(ParamSpec::new(
            SCORE_WEIGHT,
            vec![self.num_labels, self.trunk.hidden_size],
            ParamKind::Matrix,
        ));
        table
    }
}

/// A classifier's weights on the host, in [`ClassifierConfig::param_table`] order.
#[derive(Debug, Clone)]
pub struct ClassifierWeights {
    /// The configuration.
    pub config: ClassifierConfig,
    /// One tensor per table entry.
    pub tensors: Vec<HostTensor>,
}

impl ClassifierWeights {
    /// Loads a `*ForSequenceClassification` checkpoint directory (`config.json`, safetensors).
    pub fn load(dir: &Path) -> std::result::Result<ClassifierWeights, ModelError> {
        let config = ClassifierConfig::from_hf_file(&dir.join("config.json"))?;
        let tensors = crate::safetensors_io::load_table(dir, &config.trunk, &config.param_table())?;
        Ok(ClassifierWeights { config, tensors })
    }
}

impl ClassifierWeights {
    /// A classifier of `weights`' trunk (its `lm_head`, if any, dropped) and the head `score`
    /// (`[num_labels, hidden]`, named `score.weight`).
    pub fn with_head(
        weights: crate::ModelWeights,
        score: HostTensor,
    ) -> std::result::Result<ClassifierWeights, ModelError> {
        let hidden = weights.config.hidden_size;
        if score.name != SCORE_WEIGHT
            || score.shape.len() != 2
            || score.shape[1] != hidden
            || score.shape[0] == 0
        {
            return Err(ModelError::ShapeMismatch {
                name: score.name,
                expected: vec![score.shape.first().copied().unwrap_or(1).max(1), hidden],
                found: score.shape,
                origin: format!("a classifier head (named `{SCORE_WEIGHT}`)"),
            });
        }
        let mut trunk = weights.config;
        trunk.tie_word_embeddings = true;
        let config = ClassifierConfig {
            trunk,
            num_labels: score.shape[0],
        };
        let mut tensors: Vec<HostTensor> = weights
            .tensors
            .into_iter()
            .filter(|t| t.name != "lm_head.weight")
            .collect();
        tensors.push(score);
        Ok(ClassifierWeights { config, tensors })
    }

    /// Writes the classifier as transformers saves a `*ForSequenceClassification` checkpoint
    /// (`config.json` naming the architecture and the labels, `model.safetensors`), with a copy
    /// of each of `tokenizer_files`; atomically, as [`crate::save_hf_checkpoint`].
    pub fn save(&self, dir: &Path, tokenizer_files: &[&Path]) -> std::result::Result<(), ModelError> {
        let mut config = self.config.trunk.to_hf_json();
        let architecture = self
            .config
            .trunk
            .family
            .hf_architecture()
            .replace("ForCausalLM", "ForSequenceClassification");
        config["architectures"] = serde_json::json!([architecture]);
        let labels = 0..self.config.num_labels;
        config["id2label"] = labels
            .clone()
            .map(|i| (i.to_string(), Value::from(format!("LABEL_{i}"))))
            .collect();
        config["label2id"] = labels.map(|i| (format!("LABEL_{i}"), Value::from(i))).collect();
        crate::safetensors_io::save_checkpoint(dir, &self.tensors, config, tokenizer_files)
    }

    /// A causal language model read as a classifier over the tokens `labels`: its logits for
    /// them at each sequence's last token (the rows of its output head as `score.weight`; no
    /// pad rule: the last token is read whatever it is). What a judge's yes/no verdict is.
    pub fn from_lm_head(
        weights: crate::ModelWeights,
        labels: &[u32],
    ) -> std::result::Result<ClassifierWeights, ModelError> {
        let head_name = if weights.config.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        let head = weights.get(head_name).ok_or_else(|| ModelError::MissingTensor {
            name: head_name.into(),
            expected: vec![weights.config.vocab_size, weights.config.hidden_size],
            origin: "the model's weights".into(),
        })?;
        let row = weights.config.hidden_size * head.dtype.size_bytes();
        let mut bytes = Vec::with_capacity(labels.len() * row);
        for &label in labels {
            let start = label as usize * row;
            let Some(slice) = head.bytes.get(start..start + row) else {
                return Err(ModelError::Config {
                    origin: "the model's weights".into(),
                    key: "vocab_size".into(),
                    problem: format!(
                        "label token {label} is outside the vocabulary of {}",
                        weights.config.vocab_size
                    ),
                });
            };
            bytes.extend_from_slice(slice);
        }
        let score = HostTensor::from_le_bytes(
            SCORE_WEIGHT,
            head.dtype,
            vec![labels.len(), weights.config.hidden_size],
            bytes,
        )
        .expect("whole rows of a consistent tensor");
        let mut classifier = ClassifierWeights::with_head(weights, score)?;
        classifier.config.trunk.pad_token_id = None;
        Ok(classifier)
    }
}

/// The position transformers reads a sequence's score at: its last token other than `pad`
/// (the last token when there is no pad id; 0 when every token is `pad`).
pub fn score_position(ids: &[u32], pad: Option<u32>) -> usize {
    match pad {
        Some(pad) => ids.iter().rposition(|&t| t != pad).unwrap_or(0),
        None => ids.len().saturating_sub(1),
    }
}

/// The classifier's logits `[B, num_labels]` (f32) for `tokens [B, T]` with a 0/1 `mask [B, T]`
/// (right padding), each row read at `position [B]` (see [`score_position`]).
pub fn scores_graph(
    p: &DecoderParams,
    score: &Tensor,
    tokens: &Tensor,
    mask: &Tensor,
    position: &Tensor,
) -> Tensor {
    let h = hidden_states_graph(p, tokens, mask);
    let (b, t, hidden) = (h.dims()[0], h.dims()[1], h.dims()[2]);
    let rows = h.graph().iota(DType::I32, &[b], 0);
    let flat = &(&rows * (t as f64)) + &position.convert_if_needed(DType::I32);
    let picked = h.reshape(&[b * t, hidden]).take(&flat, 0);
    picked.linear(score)
}

/// A classifier on one device: its weights uploaded once, a program compiled per batch and
/// length bucket as inputs need it.
pub struct DeviceClassifier {
    client: Client,
    device: usize,
    dtype: DType,
    config: ClassifierConfig,
    weights: Vec<Buffer>,
    programs: HashMap<(usize, usize), Executable>,
}

impl DeviceClassifier {
    /// Uploads `weights` to `device` of `client` as `dtype`.
    pub fn upload(
        client: &Client,
        weights: &ClassifierWeights,
        dtype: DType,
        device: usize,
    ) -> Result<DeviceClassifier> {
        let table = weights.config.param_table();
        let buffers = upload_tensors(client, &table, &weights.tensors, dtype, device)?;
        Ok(DeviceClassifier {
            client: client.clone(),
            device,
            dtype,
            config: weights.config.clone(),
            weights: buffers,
            programs: HashMap::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ClassifierConfig {
        &self.config
    }

    /// Traces the program scoring `batch` sequences of `len` tokens, without compiling it.
    pub fn build(config: &ClassifierConfig, dtype: DType, batch: usize, len: usize) -> Result<Program> {
        let name = format!("classifier_scores_{batch}x{len}");
        let g = Graph::new(&name);
        let p = DecoderParams::declare(&g, &config.trunk, dtype);
        let score = g.parameter(
            SCORE_WEIGHT,
            dtype,
            &[config.num_labels as i64, config.trunk.hidden_size as i64],
        );
        let dims = [batch as i64, len as i64];
        let tokens = g.parameter("tokens", DType::I32, &dims);
        let mask = g.parameter("mask", DType::I32, &dims);
        let position = g.parameter("position", DType::I32, &[batch as i64]);
        let scores = scores_graph(&p, &score, &tokens, &mask, &position);
        g.build(&[&scores]).map_err(|source| ProgramError::Graph {
            program: name,
            source,
        })
    }

    /// Each sequence's logits (`num_labels` each). Sequences run in batches padded to a power
    /// of two rows and a power-of-two length of at least 32 tokens, one compiled program per
    /// such shape; an empty sequence or a token outside the vocabulary is an error.
    pub fn score(&mut self, sequences: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let vocab = self.config.trunk.vocab_size;
        for (i, s) in sequences.iter().enumerate() {
            let problem = if s.is_empty() {
                Some("has no tokens".to_string())
            } else {
                s.iter()
                    .find(|&&t| t as usize >= vocab)
                    .map(|t| format!("has token id {t}, outside the vocabulary of {vocab}"))
            };
            if let Some(problem) = problem {
                return Err(ProgramError::Input {
                    program: "classifier_scores".into(),
                    problem: format!("sequence {i} {problem}"),
                });
            }
        }
        if sequences.is_empty() {
            return Ok(Vec::new());
        }
        let batch = sequences.len().next_power_of_two();
        let longest = sequences.iter().map(Vec::len).max().unwrap_or(1);
        let len = bucket(longest, 32).next_power_of_two();
        let pad = self.config.trunk.pad_token_id;
        let (mut tokens, mut mask, mut position) = (
            vec![0i32; batch * len],
            vec![0i32; batch * len],
            vec![0i32; batch],
        );
        for row in 0..batch {
            // Rows past the sequences repeat the first one and are dropped.
            let s = &sequences[if row < sequences.len() { row } else { 0 }];
            for (j, &t) in s.iter().enumerate() {
                tokens[row * len + j] = t as i32;
                mask[row * len + j] = 1;
            }
            position[row] = score_position(s, pad) as i32;
        }
        let what = format!("classifier_scores[{batch}x{len}]");
        if !self.programs.contains_key(&(batch, len)) {
            let program = DeviceClassifier::build(&self.config, self.dtype, batch, len)?;
            let exe = program
                .compile(&self.client)
                .map_err(runtime(format!("compiling {what}")))?;
            self.programs.insert((batch, len), exe);
        }
        let upload = |values: &[i32], dims: &[i64], name: &str| {
            self.client
                .buffer_from_host(values, dims, self.device)
                .map_err(runtime(format!("uploading {name} for {what}")))
        };
        let tb = upload(&tokens, &[batch as i64, len as i64], "tokens")?;
        let mb = upload(&mask, &[batch as i64, len as i64], "mask")?;
        let pb = upload(&position, &[batch as i64], "positions")?;
        let mut args: Vec<&Buffer> = self.weights.iter().collect();
        args.extend([&tb, &mb, &pb]);
        let out = self.programs[&(batch, len)]
            .execute(&args)
            .map_err(runtime(format!("running {what}")))?;
        let logits = out[0]
            .to_host::<f32>()
            .map_err(runtime(format!("reading {what}")))?;
        Ok(logits
            .chunks_exact(self.config.num_labels)
            .take(sequences.len())
            .map(<[f32]>::to_vec)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config(extra: Value) -> std::result::Result<ClassifierConfig, ModelError> {
        let mut v = json!({
            "architectures": ["LlamaForSequenceClassification"], "model_type": "llama",
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
            "tie_word_embeddings": false, "pad_token_id": 0
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        ClassifierConfig::from_hf_json(&v, "config.json")
    }

    #[test]
    fn labels_come_from_id2label_then_num_labels_then_two() {
        assert_eq!(
            config(json!({"id2label": {"0": "LABEL_0"}})).unwrap().num_labels,
            1
        );
        assert_eq!(config(json!({"num_labels": 3})).unwrap().num_labels, 3);
        assert_eq!(config(json!({})).unwrap().num_labels, 2);
        let c = config(json!({"num_labels": 1})).unwrap();
        let table = c.param_table();
        assert!(c.trunk.tie_word_embeddings, "a classifier has no lm_head");
        assert!(!table.iter().any(|p| p.name == "lm_head.weight"));
        assert_eq!(table.last().unwrap().shape, vec![1, 64]);
    }

    #[test]
    fn a_causal_lm_is_refused_by_name() {
        let e = config(json!({"architectures": ["LlamaForCausalLM"]}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("LlamaForCausalLM is not a sequence classifier"), "{e}");
        assert!(config(json!({"num_labels": 0}))
            .unwrap_err()
            .to_string()
            .contains("at least one label"));
    }

    #[test]
    fn the_score_is_read_at_the_last_token_that_is_not_padding() {
        assert_eq!(score_position(&[5, 6, 7], Some(0)), 2);
        assert_eq!(score_position(&[5, 6, 0, 0], Some(0)), 1);
        assert_eq!(score_position(&[0, 0], Some(0)), 0);
        assert_eq!(score_position(&[5, 0, 0], None), 2);
    }
}
