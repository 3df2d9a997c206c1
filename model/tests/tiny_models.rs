//! The committed tiny Llama / Qwen2 / Qwen3 checkpoints made by transformers
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
