//! The parameter table of each family: every tensor's Hugging Face name and shape, derived from
//! the config. Loading checks files against it, random initialisation creates it, export writes it.

use crate::config::ModelConfig;

/// What a parameter is, which decides how it is initialised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// A weight matrix or the embedding table: normal(0, initializer_range).
    Matrix,
    /// A projection bias: zeros.
    Bias,
    /// An RMSNorm scale: ones.
    NormScale,
}

/// One entry of the parameter table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// Hugging Face name.
    pub name: String,
    /// Shape in Hugging Face / PyTorch order (`[out_features, in_features]` for projections).
    pub shape: Vec<usize>,
    /// What kind of parameter it is.
    pub kind: ParamKind,
}

impl ParamSpec {
    /// A parameter named `name` of this shape and kind.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, kind: ParamKind) -> Self {
        ParamSpec {
            name: name.into(),
            shape,
            kind,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The shape as graph dimensions.
    pub fn dims(&self) -> Vec<i64> {
        self.shape.iter().map(|&d| d as i64).collect()
    }
}

/// Every parameter of the model, in a fixed order: embeddings, then each layer, then the final
/// norm and (when untied) the output head.
pub fn param_table(config: &ModelConfig) -> Vec<ParamSpec> {
    use ParamKind::*;
    let h = config.hidden_size;
    let q_out = config.num_attention_heads * config.head_dim;
    let kv_out = config.num_key_value_heads * config.head_dim;
    let ffn = config.intermediate_size;
    let mut table = vec![ParamSpec::new(
        "model.embed_tokens.weight",
        vec![config.vocab_size, h],
        Matrix,
    )];
    for layer in 0..config.num_hidden_layers {
        let p = |suffix: &str| format!("model.layers.{layer}.{suffix}");
        table.push(ParamSpec::new(p("input_layernorm.weight"), vec![h], NormScale));
        for (proj, out) in [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)] {
            table.push(ParamSpec::new(
                p(&format!("self_attn.{proj}.weight")),
                vec![out, h],
                Matrix,
            ));
            if config.attention_bias {
                table.push(ParamSpec::new(
                    p(&format!("self_attn.{proj}.bias")),
                    vec![out],
                    Bias,
                ));
            }
        }
        table.push(ParamSpec::new(
            p("self_attn.o_proj.weight"),
            vec![h, q_out],
            Matrix,
        ));
        if config.o_proj_bias {
            table.push(ParamSpec::new(p("self_attn.o_proj.bias"), vec![h], Bias));
        }
        if config.qk_norm {
            table.push(ParamSpec::new(
                p("self_attn.q_norm.weight"),
                vec![config.head_dim],
                NormScale,
            ));
            table.push(ParamSpec::new(
                p("self_attn.k_norm.weight"),
                vec![config.head_dim],
                NormScale,
            ));
        }
        table.push(ParamSpec::new(
            p("post_attention_layernorm.weight"),
            vec![h],
            NormScale,
        ));
        table.push(ParamSpec::new(p("mlp.gate_proj.weight"), vec![ffn, h], Matrix));
        table.push(ParamSpec::new(p("mlp.up_proj.weight"), vec![ffn, h], Matrix));
        table.push(ParamSpec::new(p("mlp.down_proj.weight"), vec![h, ffn], Matrix));
    }
    table.push(ParamSpec::new("model.norm.weight", vec![h], NormScale));
    if !config.tie_word_embeddings {
        table.push(ParamSpec::new(
            "lm_head.weight",
            vec![config.vocab_size, h],
            Matrix,
        ));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Family;

    pub(crate) fn smollm2_config() -> ModelConfig {
        ModelConfig {
            family: Family::Llama,
            hidden_size: 576,
            num_hidden_layers: 30,
            num_attention_heads: 9,
            num_key_value_heads: 3,
            head_dim: 64,
            intermediate_size: 1536,
            vocab_size: 49152,
            rope_theta: 100000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            attention_bias: false,
            o_proj_bias: false,
            qk_norm: false,
            max_position_embeddings: 8192,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            pad_token_id: Some(2),
            initializer_range: 0.02,
        }
    }

    #[test]
    fn smollm2_has_134_515_008_parameters() {
        let c = smollm2_config();
        let table = param_table(&c);
        assert_eq!(table.len(), 2 + 30 * 9);
        assert_eq!(c.num_parameters(), 134_515_008);
    }

    #[test]
    fn qwen_variants_add_bias_and_qk_norm() {
        let mut c = smollm2_config();
        c.family = Family::Qwen2;
        c.attention_bias = true;
        c.tie_word_embeddings = false;
        let t = param_table(&c);
        let names: Vec<&str> = t.iter().map(|p| p.name.as_str()).collect();
        assert!(names.contains(&"model.layers.3.self_attn.k_proj.bias"));
        assert!(!names.contains(&"model.layers.3.self_attn.o_proj.bias"));
        assert_eq!(names.last(), Some(&"lm_head.weight"));
        let kb = t
            .iter()
            .find(|p| p.name == "model.layers.0.self_attn.k_proj.bias")
            .unwrap();
        assert_eq!((kb.shape.clone(), kb.kind), (vec![192], ParamKind::Bias));
        c.family = Family::Qwen3;
        c.attention_bias = false;
        c.qk_norm = true;
        c.head_dim = 128;
        let t = param_table(&c);
        let q = t
            .iter()
            .find(|p| p.name == "model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        assert_eq!(q.shape, vec![9 * 128, 576]);
        let o = t
            .iter()
            .find(|p| p.name == "model.layers.0.self_attn.o_proj.weight")
            .unwrap();
        assert_eq!(o.shape, vec![576, 9 * 128]);
        let qn = t
            .iter()
            .find(|p| p.name == "model.layers.29.self_attn.q_norm.weight")
            .unwrap();
        assert_eq!((qn.shape.clone(), qn.kind), (vec![128], ParamKind::NormScale));
        assert!(!t.iter().any(|p| p.name.ends_with("q_proj.bias")));
    }
}
