//! The policy the learner trains: a decoder from the `model` crate, seen through the per-token
//! log-probabilities of its responses.
//!
//! A training row is one prompt followed by one response, packed into `P + L` columns: the
//! prompt left-padded to `P = prompt_len`, the response right-padded to `L = response_len`.
//! Positions come from the attention mask, so left padding does not shift them, and response
//! token `j` always sits in column `P + j`. The policy's output column `j` is
//! `log p(response[j] | prompt, response[<j])` at the sampling temperature, exactly the
//! quantity the rollout reports for the same token.

use crate::step::{InputSpec, ParamSpec, PolicyOutput};
use model::forward::{logprobs_graph_span, DecoderParams};
use model::{param_table, ModelConfig};
use xla::graph::Tensor;
use xla::DType;

/// A decoder policy with static training shapes.
#[derive(Clone, Debug)]
pub struct DecoderPolicy {
    pub config: ModelConfig,
    /// Prompt columns `P` (prompts are left-padded to it).
    pub prompt_len: usize,
    /// Response columns `L` (responses are right-padded to it).
    pub response_len: usize,
    /// Rows per forward/backward pass.
    pub micro_batch_size: usize,
    /// The sampling temperature the log-probs are taken at (logits / T).
    pub temperature: f32,
}

/// One micro-batch of rows packed for [`DecoderPolicy`]: `tokens` and `mask` are
/// `[rows, P + L]`, `response_mask` is `[rows, L]`.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedRows {
    pub tokens: Vec<i32>,
    pub mask: Vec<i32>,
    pub response_mask: Vec<f32>,
}

/// A row that does not fit the policy's shapes.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("row {row}: the prompt has {len} tokens, more than the {max} the learner was built for (data.max_prompt_length)")]
    PromptTooLong { row: usize, len: usize, max: usize },
    #[error("row {row}: the response has {len} tokens, more than the {max} the learner was built for (data.max_response_length)")]
    ResponseTooLong { row: usize, len: usize, max: usize },
    #[error("row {row}: the prompt is empty; a response needs at least one token to follow")]
    EmptyPrompt { row: usize },
}

impl DecoderPolicy {
    fn width(&self) -> usize {
        self.prompt_len + self.response_len
    }

    /// This policy with `prompt_len` prompt and `response_len` response columns (a length
    /// bucket; see [`crate::bucket`]): the same model, micro-batch and temperature.
    pub fn with_lengths(&self, prompt_len: usize, response_len: usize) -> DecoderPolicy {
        DecoderPolicy {
            prompt_len,
            response_len,
            ..self.clone()
        }
    }

    /// The trainable parameters, in the model's parameter-table order (Hugging Face names).
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        param_table(&self.config)
            .into_iter()
            .map(|s| ParamSpec {
                name: s.name,
                dims: s.shape.iter().map(|&d| d as i64).collect(),
            })
            .collect()
    }

    /// The batch inputs: `tokens` and `mask`, both i32 `[micro_batch_size, P + L]`.
    pub fn input_specs(&self) -> Vec<InputSpec> {
        let dims = vec![self.micro_batch_size as i64, self.width() as i64];
        vec![
            InputSpec {
                name: "tokens".into(),
                dtype: DType::I32,
                dims: dims.clone(),
            },
            InputSpec {
                name: "mask".into(),
                dtype: DType::I32,
                dims,
            },
        ]
    }

    /// The policy function for [`crate::step::build_train_programs`]: per-token log-probs
    /// and entropies of the response columns, `[micro_batch_size, L]`.
    pub fn log_probs(&self, params: &[Tensor], batch: &[Tensor]) -> PolicyOutput {
        let (tokens, mask) = (&batch[0], &batch[1]);
        let g = tokens.graph();
        let p =
            DecoderParams::from_tensors(&self.config, params).expect("parameters follow the parameter table");
        let temperature = g.scalar(self.temperature as f64, DType::F32);
        // The head runs only over the positions that predict response tokens.
        let (lp, ent) = logprobs_graph_span(g, &p, tokens, mask, &temperature, self.prompt_len as i64);
        PolicyOutput {
            log_probs: lp,
            entropy: Some(ent),
        }
    }

    /// Pack `(prompt, response)` rows. Rows past the end of `rows` (up to `micro_batch_size`)
    /// are filled with padding whose response mask is 0, so they contribute nothing.
    pub fn pack(&self, rows: &[(&[u32], &[u32])]) -> Result<PackedRows, PackError> {
        let (p, l, w) = (self.prompt_len, self.response_len, self.width());
        let n = self.micro_batch_size.max(rows.len());
        let mut out = PackedRows {
            tokens: vec![0; n * w],
            mask: vec![0; n * w],
            response_mask: vec![0.0; n * l],
        };
        for (row, (prompt, response)) in rows.iter().enumerate() {
            if prompt.is_empty() {
                return Err(PackError::EmptyPrompt { row });
            }
            if prompt.len() > p {
                return Err(PackError::PromptTooLong {
                    row,
                    len: prompt.len(),
                    max: p,
                });
            }
            if response.len() > l {
                return Err(PackError::ResponseTooLong {
                    row,
                    len: response.len(),
                    max: l,
                });
            }
            let base = row * w;
            for (i, &t) in prompt.iter().enumerate() {
                let col = p - prompt.len() + i;
                out.tokens[base + col] = t as i32;
                out.mask[base + col] = 1;
            }
            for (j, &t) in response.iter().enumerate() {
                out.tokens[base + p + j] = t as i32;
                out.mask[base + p + j] = 1;
                out.response_mask[row * l + j] = 1.0;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> DecoderPolicy {
        let config = ModelConfig::from_hf_json(
            &serde_json::json!({
                "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 16,
                "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true
            }),
            "test",
        )
        .unwrap();
        DecoderPolicy {
            config,
            prompt_len: 3,
            response_len: 2,
            micro_batch_size: 3,
            temperature: 1.0,
        }
    }

    #[test]
    fn rows_are_packed_prompt_left_response_right() {
        let p = policy();
        let packed = p.pack(&[(&[5, 6], &[7]), (&[1, 2, 3], &[4, 9])]).unwrap();
        assert_eq!(packed.tokens, vec![0, 5, 6, 7, 0, 1, 2, 3, 4, 9, 0, 0, 0, 0, 0]);
        assert_eq!(packed.mask, vec![0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]);
        assert_eq!(packed.response_mask, vec![1.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn rows_that_do_not_fit_are_named() {
        let p = policy();
        let e = p
            .pack(&[(&[1], &[2]), (&[1, 2, 3, 4], &[5])])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("row 1: the prompt has 4 tokens, more than the 3"),
            "{e}"
        );
        let e = p.pack(&[(&[1], &[2, 3, 4])]).unwrap_err().to_string();
        assert!(e.contains("response has 3 tokens"), "{e}");
        assert!(p
            .pack(&[(&[], &[2])])
            .unwrap_err()
            .to_string()
            .contains("prompt is empty"));
    }
}
