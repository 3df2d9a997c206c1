//! The real SmolLM2-135M-Instruct GGUF (fetched by `model/scripts/fetch_assets.sh`): header and
//! config, the parameter table against the file's 134,515,008 parameters, dequantised and
//! un-permuted tensors against the `gguf` Python package, and a truncated copy.

mod common;

use model::gguf::GgufFile;
use model::{param_table, Family, ModelConfig};

#[test]
fn config_and_parameter_table_from_gguf() {
    let gguf = GgufFile::open(&testkit::smollm2_gguf()).unwrap();
    assert_eq!(gguf.version, 3);
    assert_eq!(gguf.tensor_infos().len(), 272);
    let c = ModelConfig::from_gguf(&gguf).unwrap();
    assert_eq!(c.family, Family::Llama);
    assert_eq!(
        (c.hidden_size, c.num_hidden_layers, c.intermediate_size),
        (576, 30, 1536)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (9, 3, 64)
    );
    assert_eq!((c.vocab_size, c.max_position_embeddings), (49152, 8192));
    assert_eq!(c.rope_theta, 100000.0);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-12);
    assert!(c.tie_word_embeddings && !c.attention_bias && !c.qk_norm && c.rope_scaling.is_none());
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone(), c.pad_token_id),
        (Some(1), vec![2], Some(2))
    );
    let file_params: u64 = gguf.tensor_infos().iter().map(|t| t.numel()).sum();
    assert_eq!(file_params, 134_515_008);
    assert_eq!(c.num_parameters(), 134_515_008);
    assert_eq!(param_table(&c).len(), 272);
}

#[test]
fn weights_match_gguf_py_dequantisation() {
    let gguf = GgufFile::open(&testkit::smollm2_gguf()).unwrap();
    let config = ModelConfig::from_gguf(&gguf).unwrap();
    let start = std::time::Instant::now();
    let weights = gguf.load_weights(&config).unwrap();
    eprintln!(
        "dequantised {} parameters in {:?}",
        weights.num_parameters(),
        start.elapsed()
    );
    assert_eq!(weights.num_parameters(), 134_515_008);
    let fixture = common::fixture_json("gguf_dequant.json");
    for case in fixture["smollm2"].as_array().unwrap() {
        let name = case["hf_name"].as_str().unwrap();
        let tensor = weights.get(name).unwrap();
        let shape: Vec<usize> = case["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(tensor.shape, shape, "{name}");
        let values = tensor.to_f32_vec();
        let row_len = *shape.last().unwrap();
        for (row, expected) in case["rows"].as_object().unwrap() {
            let row: usize = row.parse().unwrap();
            let got = &values[row * row_len..(row + 1) * row_len];
            let expected: Vec<f32> = expected
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            assert_eq!(got.len(), expected.len());
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert!(
                    (g - e).abs() <= 1e-6 * e.abs().max(1e-3),
                    "{name} row {row} col {i}: got {g}, gguf-py {e}"
                );
            }
        }
        let sum: f64 = values.iter().map(|&v| v as f64).sum();
        let expected_sum = case["sum"].as_f64().unwrap();
        assert!(
            (sum - expected_sum).abs() <= 1e-6 * expected_sum.abs().max(1.0),
            "{name}: sum {sum} vs {expected_sum}"
        );
    }
}

#[test]
fn truncated_copy_is_a_clear_error() {
    let bytes = std::fs::read(testkit::smollm2_gguf()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("truncated.gguf");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let e = GgufFile::open(&path).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "{} is not a valid GGUF file (corrupt or truncated?): tensor `",
            path.display()
        )),
        "{e}"
    );
    assert!(
        e.contains("but the file has 49181216 bytes: the file is truncated"),
        "{e}"
    );
    // Cut inside the vocabulary (metadata).
    std::fs::write(&path, &bytes[..100_000]).unwrap();
    let e = GgufFile::open(&path).unwrap_err().to_string();
    assert!(e.contains("the length of array `tokenizer.ggml.tokens` at byte 1099 is 49152, more than the 98893 bytes left in the file allow"), "{e}");
}
