//! Dequantisation of every supported ggml type against values computed independently by the
//! `gguf` Python package (`model/scripts/make_quant_fixtures.py`): two blocks of each type.

mod common;

use model::GgmlType;

fn type_of(name: &str) -> GgmlType {
    match name {
        "F16" => GgmlType::F16,
        "BF16" => GgmlType::BF16,
        "Q8_0" => GgmlType::Q8_0,
        "Q4_0" => GgmlType::Q4_0,
        "Q4_1" => GgmlType::Q4_1,
        "Q4_K" => GgmlType::Q4K,
        "Q5_K" => GgmlType::Q5K,
        "Q6_K" => GgmlType::Q6K,
        other => panic!("fixture has unknown type {other}"),
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn blocks_match_gguf_py() {
    let fixture = common::fixture_json("gguf_dequant.json");
    let blocks = fixture["blocks"].as_array().unwrap();
    let mut seen = Vec::new();
    for case in blocks {
        let name = case["type"].as_str().unwrap();
        let ggml = type_of(name);
        let bytes = hex(case["bytes_hex"].as_str().unwrap());
        let expected: Vec<f32> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let (block_values, block_bytes) = ggml.block_layout().unwrap();
        assert_eq!(
            bytes.len() / block_bytes * block_values,
            expected.len(),
            "{name}: layout"
        );
        let mut got = vec![f32::NAN; expected.len()];
        ggml.dequantize(&bytes, &mut got);
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert!(
                (g - e).abs() <= 1e-6 * e.abs().max(1e-3),
                "{name} value {i}: got {g}, gguf-py {e}"
            );
        }
        seen.push(name.to_string());
    }
    assert_eq!(
        seen,
        ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
    );
}
