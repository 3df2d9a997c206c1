//! Random initialisation of a model from its config and a seed, as transformers does it:
//! matrices and embeddings from normal(0, initializer_range), biases zero, norm scales one.

use rand::{Rng, SeedableRng};

use crate::config::ModelConfig;
use crate::params::{param_table, ParamKind, ParamSpec};
use crate::safetensors_io::ModelWeights;
use crate::tensor::HostTensor;

/// Fills `out` with normal(0, std) samples (Box-Muller over the generator's uniforms).
fn fill_normal(rng: &mut impl Rng, std: f64, out: &mut [f32]) {
    let mut chunks = out.chunks_mut(2);
    for pair in &mut chunks {
        // u1 in (0, 1] so the logarithm is finite.
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let radius = (-2.0 * u1.ln()).sqrt() * std;
        let angle = 2.0 * std::f64::consts::PI * u2;
        pair[0] = (radius * angle.cos()) as f32;
        if pair.len() > 1 {
            pair[1] = (radius * angle.sin()) as f32;
        }
    }
}

/// Creates every parameter of `config` in f32; the same seed gives the same weights.
pub fn random_init(config: &ModelConfig, seed: u64) -> ModelWeights {
    ModelWeights {
        config: config.clone(),
        tensors: init_tensors(&param_table(config), config.initializer_range, seed),
    }
}

/// f32 tensors of `specs` initialised by kind (matrices from normal(0, `std`), biases and Gemma's
/// norm offsets zero, norm scales one); the same seed gives the same values.
pub fn init_tensors(specs: &[ParamSpec], std: f64, seed: u64) -> Vec<HostTensor> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    specs
        .iter()
        .map(|spec| {
            let mut values = vec![0f32; spec.numel()];
            match spec.kind {
                ParamKind::Matrix => fill_normal(&mut rng, std, &mut values),
                ParamKind::Bias | ParamKind::NormOffset => {}
                ParamKind::NormScale => values.fill(1.0),
            }
            HostTensor::from_f32(spec.name.clone(), spec.shape.clone(), &values)
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests_support {
    use crate::config::{Family, ModelConfig};

    /// A tiny Qwen2 config for unit tests.
    pub(crate) fn tiny_config() -> ModelConfig {
        ModelConfig {
            family: Family::Qwen2,
            hidden_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            intermediate_size: 128,
            vocab_size: 256,
            rope_theta: 10000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            attention_bias: true,
            o_proj_bias: false,
            qk_norm: false,
            max_position_embeddings: 128,
            bos_token_id: None,
            eos_token_ids: vec![1],
            pad_token_id: None,
            initializer_range: 0.05,
            // No experts, window or Gemma settings: tiny_llama's.
            ..ModelConfig::tiny_llama()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::tiny_config as tiny;
    use super::*;

    #[test]
    fn deterministic_with_the_right_statistics() {
        let c = tiny();
        let a = random_init(&c, 7);
        let b = random_init(&c, 7);
        let other = random_init(&c, 8);
        assert_eq!(a, b);
        assert_ne!(a.tensors[0], other.tensors[0]);
        let emb = a.get("model.embed_tokens.weight").unwrap().to_f32_vec();
        let n = emb.len() as f64;
        let mean = emb.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = emb.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        // 16384 samples: mean within ~4 standard errors, std within 3%.
        assert!(mean.abs() < 4.0 * 0.05 / n.sqrt(), "mean {mean}");
        assert!((var.sqrt() - 0.05).abs() < 0.0015, "std {}", var.sqrt());
        let norm = a
            .get("model.layers.1.input_layernorm.weight")
            .unwrap()
            .to_f32_vec();
        assert!(norm.iter().all(|&x| x == 1.0));
        let bias = a
            .get("model.layers.0.self_attn.q_proj.bias")
            .unwrap()
            .to_f32_vec();
        assert!(bias.iter().all(|&x| x == 0.0));
        assert_eq!(a.tensors.len(), crate::param_table(&c).len());
    }
}
