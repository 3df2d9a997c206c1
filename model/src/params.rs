//! The parameter table of each family: every tensor's Hugging Face name and shape, derived from
//! the config. Loading checks files against it, random initialisation creates it, export writes it.
//!
//! Each entry ([`ParamSpec`]) also carries its Megatron split ([`ModelSplit`]: which dimension
//! the `model` mesh axis cuts, in whole heads where it cuts heads). [`ParamLayout`] is the one
//! place a tensor's sharding over a data x model mesh is decided, for the learner (which
//! trains this same table) and the rollout alike.

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
    /// An RMSNorm scale stored as its offset from one (Gemma's `1 + w`): zeros.
    NormOffset,
}

/// Where the Megatron tensor-parallel layout splits a parameter over the `model` mesh axis:
/// dimension `dim`, in whole `unit`s (a head's `head_dim` rows for attention projections, one
/// row or column elsewhere).
///
/// Column-parallel (split by output, dimension 0): q, k and v projections and their biases
/// (by heads), gate and up projections (by FFN columns). Row-parallel (split by input,
/// dimension 1): the o projection (by heads) and the down projection, whose partial products
/// XLA sums across the axis. Vocabulary-parallel (dimension 0): the embedding and the output
/// head. Norm scales and the o projection's bias stay whole on every device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSplit {
    /// The split dimension.
    pub dim: usize,
    /// The split must keep these many consecutive entries of `dim` together.
    pub unit: usize,
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
    /// Its split under tensor parallelism (`None`: whole on every device of the `model` axis).
    pub model_split: Option<ModelSplit>,
}

impl ParamSpec {
    /// A parameter named `name` of this shape and kind, not split by tensor parallelism.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, kind: ParamKind) -> Self {
        ParamSpec {
            name: name.into(),
            shape,
            kind,
            model_split: None,
        }
    }

    /// This parameter, split over the `model` axis on `dim` in whole `unit`s.
    pub fn split_by_model(mut self, dim: usize, unit: usize) -> Self {
        self.model_split = Some(ModelSplit { dim, unit });
        self
    }

    /// The dimension a tensor-parallel axis of `tp` devices splits, when it divides into `tp`
    /// equal parts of whole units (heads); `None` when `tp` is 1, the parameter is not split
    /// by the layout, or its units do not divide by `tp` (then every device of the axis holds
    /// it whole and computes what it feeds redundantly: vLLM's rule for KV heads fewer than
    /// the TP size, applied to any head count).
    pub fn tensor_parallel_dim(&self, tp: usize) -> Option<usize> {
        let split = self.model_split?;
        let units = self.shape.get(split.dim)? / split.unit.max(1);
        (tp > 1 && units > 0 && units.is_multiple_of(tp)).then_some(split.dim)
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

/// The name of the tensor-parallel mesh axis, in the learner's and the rollout's meshes alike.
pub const MODEL_AXIS: &str = "model";

/// How parameters are laid out on a mesh: split over the tensor-parallel axis
/// ([`MODEL_AXIS`]) by their [`ModelSplit`], and under FSDP also over a data axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ParamLayout<'a> {
    /// The FSDP axis and its size: each parameter also split along its first dimension,
    /// other than the tensor-parallel one, that divides by the size (whole when none does).
    pub fsdp: Option<(&'a str, usize)>,
    /// The tensor-parallel axis size (1: none).
    pub tensor_parallel: usize,
}

impl ParamLayout<'_> {
    /// The layout of `spec` (and of every tensor of its shape that goes with it: optimizer
    /// moments, gradient sums, compute copies); `None` when it is whole on every device.
    pub fn sharding(&self, spec: &ParamSpec) -> Option<xla::graph::Sharding> {
        let dims = spec.dims();
        let tp_dim = spec.tensor_parallel_dim(self.tensor_parallel);
        let fsdp_dim = self.fsdp.filter(|(_, n)| *n > 1).and_then(|(axis, n)| {
            dims.iter()
                .enumerate()
                .position(|(d, &len)| Some(d) != tp_dim && len > 0 && len % n as i64 == 0)
                .map(|d| (axis, d))
        });
        if tp_dim.is_none() && fsdp_dim.is_none() {
            return None;
        }
        let mut s = xla::graph::Sharding::replicated(dims.len());
        if let Some((axis, d)) = fsdp_dim {
            s = s.and_split(d, axis);
        }
        if let Some(d) = tp_dim {
            s = s.and_split(d, MODEL_AXIS);
        }
        Some(s)
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
    let hd = config.head_dim;
    let norm = if config.norm_unit_offset {
        NormOffset
    } else {
        NormScale
    };
    let mut table = vec![
        ParamSpec::new("model.embed_tokens.weight", vec![config.vocab_size, h], Matrix).split_by_model(0, 1),
    ];
    for layer in 0..config.num_hidden_layers {
        let p = |suffix: &str| format!("model.layers.{layer}.{suffix}");
        table.push(ParamSpec::new(p("input_layernorm.weight"), vec![h], norm));
        for (proj, out) in [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)] {
            table.push(
                ParamSpec::new(p(&format!("self_attn.{proj}.weight")), vec![out, h], Matrix)
                    .split_by_model(0, hd),
            );
            if config.attention_bias {
                table.push(
                    ParamSpec::new(p(&format!("self_attn.{proj}.bias")), vec![out], Bias)
                        .split_by_model(0, hd),
                );
            }
        }
        table
            .push(ParamSpec::new(p("self_attn.o_proj.weight"), vec![h, q_out], Matrix).split_by_model(1, hd));
        if config.o_proj_bias {
            table.push(ParamSpec::new(p("self_attn.o_proj.bias"), vec![h], Bias));
        }
        if config.qk_norm {
            table.push(ParamSpec::new(p("self_attn.q_norm.weight"), vec![hd], norm));
            table.push(ParamSpec::new(p("self_attn.k_norm.weight"), vec![hd], norm));
        }
        table.push(ParamSpec::new(
            p("post_attention_layernorm.weight"),
            vec![h],
            norm,
        ));
        if config.sandwich_norms {
            table.push(ParamSpec::new(
                p("pre_feedforward_layernorm.weight"),
                vec![h],
                norm,
            ));
            table.push(ParamSpec::new(
                p("post_feedforward_layernorm.weight"),
                vec![h],
                norm,
            ));
        }
        match config.moe.as_ref().filter(|m| m.is_sparse(layer)) {
            // Stacked experts (transformers 5's layout), split by expert over the `model` axis:
            // each device of a tensor-parallel group computes its share of the experts for
            // every token, the up projection column-parallel and the down projection
            // row-parallel (its partial sums reduced over the axis), so no device holds or
            // runs them all; FSDP then splits each expert's next dimension. The router is
            // whole everywhere.
            Some(m) => {
                let (e, f) = (m.num_experts, m.expert_intermediate_size);
                table.push(ParamSpec::new(p("mlp.gate.weight"), vec![e, h], Matrix));
                table.push(
                    ParamSpec::new(p("mlp.experts.gate_up_proj"), vec![e, 2 * f, h], Matrix)
                        .split_by_model(0, 1),
                );
                table.push(
                    ParamSpec::new(p("mlp.experts.down_proj"), vec![e, h, f], Matrix).split_by_model(0, 1),
                );
            }
            None => {
                table.push(
                    ParamSpec::new(p("mlp.gate_proj.weight"), vec![ffn, h], Matrix).split_by_model(0, 1),
                );
                table
                    .push(ParamSpec::new(p("mlp.up_proj.weight"), vec![ffn, h], Matrix).split_by_model(0, 1));
                table.push(
                    ParamSpec::new(p("mlp.down_proj.weight"), vec![h, ffn], Matrix).split_by_model(1, 1),
                );
            }
        }
    }
    table.push(ParamSpec::new("model.norm.weight", vec![h], norm));
    if !config.tie_word_embeddings {
        table.push(ParamSpec::new("lm_head.weight", vec![config.vocab_size, h], Matrix).split_by_model(0, 1));
    }
    table
}

impl ModelConfig {
    /// Total number of parameters (the sum over [`crate::param_table`]).
    pub fn num_parameters(&self) -> usize {
        param_table(self).iter().map(|p| p.numel()).sum()
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
            // No experts, window or Gemma settings: tiny_llama's.
            ..ModelConfig::tiny_llama()
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

    #[test]
    fn megatron_layout_splits_by_heads_and_columns_and_replicates_what_does_not_divide() {
        use xla::graph::Sharding;
        let c = smollm2_config(); // 9 heads, 3 KV heads, FFN 1536, vocab 49152
        let t = param_table(&c);
        let get = |name: &str| t.iter().find(|p| p.name == name).unwrap().clone();
        let tp2 = ParamLayout {
            fsdp: None,
            tensor_parallel: 2,
        };
        // 9 query heads do not split 2 ways: q and o stay whole; the MLP and vocabulary split.
        assert_eq!(tp2.sharding(&get("model.layers.0.self_attn.q_proj.weight")), None);
        assert_eq!(tp2.sharding(&get("model.layers.0.self_attn.o_proj.weight")), None);
        assert_eq!(
            tp2.sharding(&get("model.layers.0.mlp.gate_proj.weight")),
            Some(Sharding::split(2, 0, MODEL_AXIS))
        );
        assert_eq!(
            tp2.sharding(&get("model.layers.0.mlp.down_proj.weight")),
            Some(Sharding::split(2, 1, MODEL_AXIS))
        );
        assert_eq!(
            tp2.sharding(&get("model.embed_tokens.weight")),
            Some(Sharding::split(2, 0, MODEL_AXIS))
        );
        assert_eq!(tp2.sharding(&get("model.norm.weight")), None);
        // 3 ways: 9 query heads and 3 KV heads split, by whole heads.
        let tp3 = ParamLayout {
            fsdp: None,
            tensor_parallel: 3,
        };
        assert_eq!(
            tp3.sharding(&get("model.layers.0.self_attn.k_proj.weight")),
            Some(Sharding::split(2, 0, MODEL_AXIS))
        );
        assert_eq!(
            tp3.sharding(&get("model.layers.0.self_attn.o_proj.weight")),
            Some(Sharding::split(2, 1, MODEL_AXIS))
        );
        // FSDP takes the first other dimension that divides: [ffn, hidden] is split by model
        // on the FFN and by data on the hidden dimension; norms by data alone.
        let both = ParamLayout {
            fsdp: Some(("data", 2)),
            tensor_parallel: 2,
        };
        assert_eq!(
            both.sharding(&get("model.layers.0.mlp.up_proj.weight")),
            Some(Sharding::split(2, 1, "data").and_split(0, MODEL_AXIS))
        );
        assert_eq!(
            both.sharding(&get("model.norm.weight")),
            Some(Sharding::split(1, 0, "data"))
        );
        // q stays whole over model (9 heads) but FSDP splits its first dimension.
        assert_eq!(
            both.sharding(&get("model.layers.0.self_attn.q_proj.weight")),
            Some(Sharding::split(2, 0, "data"))
        );
        assert_eq!(ParamLayout::default().sharding(&get("model.norm.weight")), None);
    }
}
