//! The committed tiny Llama / Qwen2 / Qwen3 / Mistral (and Qwen3-MoE) checkpoints made by transformers
//! (`model/scripts/make_tiny_models.py`): their configs parse, their tensors match the parameter
//! tables exactly, a direct evaluation of the loaded weights reproduces transformers' logits, and
//! load -> save -> load is the identity.

mod common;

use model::safetensors_io::load_hf_checkpoint;
use model::{save_hf_checkpoint, Family, RopeScaling};
use safetensors::SafeTensors;
use xla::DType;

#[test]
fn configs_parse_as_written_by_transformers() {
    for (dir, family) in common::TINY_MODELS {
        let w = load_hf_checkpoint(&common::fixtures_dir().join("tiny").join(dir)).unwrap();
        let c = &w.config;
        assert_eq!(c.family, family);
        assert_eq!(
            (
                c.hidden_size,
                c.num_hidden_layers,
                c.num_attention_heads,
                c.num_key_value_heads
            ),
            (64, 2, 4, 2)
        );
        assert_eq!((c.vocab_size, c.intermediate_size), (384, 128));
        assert_eq!(
            (c.bos_token_id, c.eos_token_ids.clone(), c.pad_token_id),
            (Some(1), vec![2], Some(0))
        );
        match family {
            Family::Llama => {
                assert!(!c.tie_word_embeddings && !c.attention_bias && !c.qk_norm);
                assert_eq!(c.rope_theta, 500000.0);
                assert_eq!(
                    c.rope_scaling,
                    Some(RopeScaling::Llama3 {
                        factor: 8.0,
                        low_freq_factor: 1.0,
                        high_freq_factor: 4.0,
                        original_max_position_embeddings: 32
                    })
                );
            }
            Family::Qwen2 => {
                assert!(c.tie_word_embeddings && c.attention_bias && !c.qk_norm && c.head_dim == 16)
            }
            Family::Qwen3 => {
                assert!(!c.tie_word_embeddings && !c.attention_bias && c.qk_norm && c.head_dim == 32)
            }
            Family::Mistral => {
                assert!(!c.tie_word_embeddings && !c.attention_bias && !c.qk_norm && c.head_dim == 32);
                assert_eq!((c.rope_theta, c.sliding_window), (1e6, None));
            }
            Family::Qwen3Moe | Family::Gemma3 => unreachable!("those fixtures have their own tests"),
        }
        assert!(w.tensors.iter().all(|t| t.dtype == DType::F32));
        assert_eq!(w.num_parameters(), c.num_parameters());
    }
}

#[test]
fn loaded_weights_reproduce_transformers_logits() {
    for (dir, _) in common::TINY_MODELS {
        let path = common::fixtures_dir().join("tiny").join(dir);
        let w = load_hf_checkpoint(&path).unwrap();
        let bytes = std::fs::read(path.join("reference.safetensors")).unwrap();
        let reference = SafeTensors::deserialize(&bytes).unwrap();
        for i in 0..3 {
            let ids: Vec<u32> = reference
                .tensor(&format!("input_ids_{i}"))
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
                .collect();
            let expected = reference.tensor(&format!("logits_{i}")).unwrap();
            assert_eq!(expected.shape(), &[ids.len(), 384]);
            let expected: Vec<f32> = expected
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let got = common::reference_logits(&w, &ids);
            let mut worst = 0f64;
            for (t, row) in got.iter().enumerate() {
                for (v, value) in row.iter().enumerate() {
                    worst = worst.max((value - expected[t * 384 + v] as f64).abs());
                }
            }
            assert!(worst < 1e-4, "{dir} sequence {i}: max |logit difference| {worst}");
        }
    }
}

#[test]
fn load_save_load_is_identity() {
    let out = tempfile::tempdir().unwrap();
    for (dir, _) in common::TINY_MODELS {
        let w = load_hf_checkpoint(&common::fixtures_dir().join("tiny").join(dir)).unwrap();
        let target = out.path().join(dir);
        save_hf_checkpoint(&target, &w, &[]).unwrap();
        let again = load_hf_checkpoint(&target).unwrap();
        assert_eq!(again, w, "{dir}");
        // bf16 export keeps the config and rounds the values.
        let bf16 = w.to_dtype(DType::BF16);
        save_hf_checkpoint(&target, &bf16, &[]).unwrap();
        assert_eq!(load_hf_checkpoint(&target).unwrap(), bf16);
    }
}

/// The Qwen3-MoE fixtures (`model/scripts/make_tiny_moe.py`): transformers 5's config keys
/// (`num_local_experts`), both expert layouts, and the bad checkpoints a user meets.
#[test]
fn qwen3_moe_configs_layouts_and_bad_checkpoints() {
    let dir = |name: &str| common::fixtures_dir().join("tiny").join(name);
    let stacked = load_hf_checkpoint(&dir("qwen3_moe")).unwrap();
    let c = &stacked.config;
    let m = c.moe.as_ref().expect("a MoE config");
    assert_eq!(c.family, Family::Qwen3Moe);
    assert_eq!(
        (
            m.num_experts,
            m.experts_per_token,
            m.expert_intermediate_size,
            m.norm_topk_prob
        ),
        (8, 2, 32, true)
    );
    assert_eq!(
        (0..3).map(|l| c.is_moe_layer(l)).collect::<Vec<_>>(),
        [true, false, true]
    );
    assert_eq!(stacked.num_parameters(), 241_280); // as transformers counts it
    let legacy = load_hf_checkpoint(&dir("qwen3_moe_legacy")).unwrap();
    let lc = &legacy.config;
    assert_eq!(
        (0..4).map(|l| lc.is_moe_layer(l)).collect::<Vec<_>>(),
        [false, true, false, true]
    );
    assert!(!lc.moe.as_ref().unwrap().norm_topk_prob && lc.tie_word_embeddings);
    assert_eq!(legacy.num_parameters(), 259_904);
    // Loaded per-expert, saved stacked (transformers 5's layout), loaded again: the same.
    let out = tempfile::tempdir().unwrap();
    save_hf_checkpoint(&out.path().join("m"), &legacy, &[]).unwrap();
    assert_eq!(load_hf_checkpoint(&out.path().join("m")).unwrap(), legacy);
    assert_eq!(
        model::ModelConfig::from_hf_json(&lc.to_hf_json(), "x").unwrap(),
        *lc
    );

    // A config whose expert count disagrees with the checkpoint: the stacked tensor is named.
    let bad = out.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::copy(
        dir("qwen3_moe").join("model.safetensors"),
        bad.join("model.safetensors"),
    )
    .unwrap();
    let mut json = c.to_hf_json();
    json["num_experts"] = 16.into();
    std::fs::write(bad.join("config.json"), json.to_string()).unwrap();
    let e = load_hf_checkpoint(&bad).unwrap_err().to_string();
    assert!(
        e.contains("tensor `model.layers.0.mlp.experts.down_proj`")
            && e.contains("[8, 64, 32], expected [16, 64, 32]"),
        "{e}"
    );
    // Per-expert: one expert's tensor missing, or an expert past the count.
    let mut json = lc.to_hf_json();
    std::fs::write(bad.join("config.json"), json.to_string()).unwrap();
    let mut tensors: Vec<_> =
        model::safetensors_io::read_safetensors(&dir("qwen3_moe_legacy").join("model.safetensors"))
            .unwrap()
            .into_values()
            .collect();
    tensors.retain(|t| t.name != "model.layers.3.mlp.experts.5.up_proj.weight");
    model::safetensors_io::write_safetensors(&bad.join("model.safetensors"), &tensors).unwrap();
    let e = load_hf_checkpoint(&bad).unwrap_err().to_string();
    assert!(
        e.contains(
            "tensor `model.layers.3.mlp.experts.5.up_proj.weight` (expected shape [32, 64]) is missing"
        ),
        "{e}"
    );
    let mut extra = tensors
        .iter()
        .find(|t| t.name == "model.layers.3.mlp.experts.5.down_proj.weight")
        .unwrap()
        .clone();
    extra.name = "model.layers.3.mlp.experts.8.down_proj.weight".into();
    tensors.push(extra);
    model::safetensors_io::write_safetensors(&bad.join("model.safetensors"), &tensors).unwrap();
    let e = load_hf_checkpoint(&bad).unwrap_err().to_string();
    assert!(
        e.contains("unexpected tensor `model.layers.3.mlp.experts.8.down_proj.weight`")
            && e.contains("qwen3_moe (8 experts)"),
        "{e}"
    );
    json["num_experts"] = 4.into();
    json["num_experts_per_tok"] = 5.into();
    let e = model::ModelConfig::from_hf_json(&json, "c.json")
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "config c.json: key `num_experts_per_tok`: 5 must be between 1 and num_experts (4)"
    );
}

/// The Gemma 3 fixture: saved and loaded back unchanged (its `1 + w` norm offsets, four norms
/// per layer and layer types kept), and the same text model read from a multimodal
/// `Gemma3ForConditionalGeneration` checkpoint in transformers 4's and 5's layouts, whose
/// vision tower grpo leaves out.
#[test]
fn gemma3_round_trips_and_loads_from_a_multimodal_checkpoint() {
    let w = load_hf_checkpoint(&common::fixtures_dir().join("tiny/gemma3")).unwrap();
    assert_eq!(w.config.family, Family::Gemma3);
    assert!(w.get("model.layers.1.pre_feedforward_layernorm.weight").is_some());
    let out = tempfile::tempdir().unwrap();
    save_hf_checkpoint(&out.path().join("saved"), &w, &[]).unwrap();
    assert_eq!(load_hf_checkpoint(&out.path().join("saved")).unwrap(), w);
    for (text_prefix, vision_prefix) in [
        ("language_model.model.", "vision_tower."),
        ("model.language_model.", "model.vision_tower."),
    ] {
        let dir = out.path().join(text_prefix.trim_end_matches('.'));
        std::fs::create_dir_all(&dir).unwrap();
        let mut text = w.config.to_hf_json();
        text.as_object_mut().unwrap().remove("architectures");
        let config = serde_json::json!({
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}
        });
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let mut tensors: Vec<model::HostTensor> = w
            .tensors
            .iter()
            .map(|t| {
                let mut t = t.clone();
                t.name = t.name.replacen("model.", text_prefix, 1);
                t
            })
            .collect();
        tensors.push(model::HostTensor::from_f32(
            format!("{vision_prefix}vision_model.post_layernorm.weight"),
            vec![4],
            &[1.0; 4],
        ));
        model::safetensors_io::write_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
        assert_eq!(load_hf_checkpoint(&dir).unwrap(), w, "{text_prefix}");
    }
}
