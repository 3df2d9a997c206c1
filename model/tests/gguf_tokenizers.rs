//! GGUF tokenizers of the Llama 3 (`llama-bpe`) and Qwen2 (`qwen2`) pre-tokenizer types: a GGUF
//! holding the vocabulary, merges and special tokens of the real Llama 3 / Qwen3 `tokenizer.json`
//! (as llama.cpp's converter writes them) must give the ids transformers gives on the original.

mod common;

use std::path::Path;

use model::gguf::GgufFile;
use model::ModelTokenizer;
use serde_json::Value;

fn gguf_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Writes a tensor-less GGUF with the tokenizer metadata of `tokenizer_json`.
fn write_tokenizer_gguf(tokenizer_json: &Path, pre: &str, add_bos: bool, out_path: &Path) {
    let json: Value = serde_json::from_str(&std::fs::read_to_string(tokenizer_json).unwrap()).unwrap();
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let added = json["added_tokens"].as_array().unwrap();
    let size = vocab.len() + added.len();
    let mut tokens = vec![String::new(); size];
    let mut types = vec![1i32; size];
    for (token, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = token.clone();
    }
    for a in added {
        let id = a["id"].as_u64().unwrap() as usize;
        tokens[id] = a["content"].as_str().unwrap().to_string();
        // llama.cpp: special added tokens are CONTROL (3), the others USER_DEFINED (4).
        types[id] = if a["special"].as_bool().unwrap() { 3 } else { 4 };
    }
    assert!(tokens.iter().all(|t| !t.is_empty()), "ids are contiguous");
    let merges: Vec<String> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Value::String(s) => s.clone(),
            Value::Array(pair) => format!("{} {}", pair[0].as_str().unwrap(), pair[1].as_str().unwrap()),
            other => panic!("merge {other}"),
        })
        .collect();
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend(6u64.to_le_bytes());
    let mut kv = |key: &str, type_id: u32, value: &dyn Fn(&mut Vec<u8>)| {
        gguf_string(&mut out, key);
        out.extend(type_id.to_le_bytes());
        value(&mut out);
    };
    kv("tokenizer.ggml.model", 8, &|o| gguf_string(o, "gpt2"));
    kv("tokenizer.ggml.pre", 8, &|o| gguf_string(o, pre));
    kv("tokenizer.ggml.tokens", 9, &|o| {
        o.extend(8u32.to_le_bytes());
        o.extend((tokens.len() as u64).to_le_bytes());
        tokens.iter().for_each(|t| gguf_string(o, t));
    });
    kv("tokenizer.ggml.token_type", 9, &|o| {
        o.extend(5u32.to_le_bytes());
        o.extend((types.len() as u64).to_le_bytes());
        types.iter().for_each(|t| o.extend(t.to_le_bytes()));
    });
    kv("tokenizer.ggml.merges", 9, &|o| {
        o.extend(8u32.to_le_bytes());
        o.extend((merges.len() as u64).to_le_bytes());
        merges.iter().for_each(|m| gguf_string(o, m));
    });
    kv("tokenizer.ggml.add_bos_token", 7, &|o| o.push(add_bos as u8));
    std::fs::write(out_path, out).unwrap();
}

fn check(tokenizer: &ModelTokenizer, key: &str) {
    let strings = common::fixture_json("tokenizer_strings.json")["strings"].clone();
    let expected = common::fixture_json("tokenizer_ids.json")["ids"][key].clone();
    for (s, want) in strings
        .as_array()
        .unwrap()
        .iter()
        .zip(expected.as_array().unwrap())
    {
        let want: Vec<u32> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            tokenizer.encode(s.as_str().unwrap(), false).unwrap(),
            want,
            "{key}: {s}"
        );
    }
}

#[test]
fn llama3_and_qwen3_vocabularies_from_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llama3.gguf");
    write_tokenizer_gguf(
        &testkit::asset("llama3/tokenizer.json"),
        "llama-bpe",
        false,
        &path,
    );
    let llama3 = ModelTokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    check(&llama3, "llama3");
    assert_eq!(llama3.vocab_size(), 128_256);

    let path = dir.path().join("qwen3.gguf");
    write_tokenizer_gguf(&testkit::asset("qwen3/tokenizer.json"), "qwen2", false, &path);
    let qwen3 = ModelTokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    check(&qwen3, "qwen3");
    assert_eq!(qwen3.vocab_size(), 151_669);
}
