//! Converts a GGUF model into a Hugging Face checkpoint directory (safetensors + config.json +
//! tokenizer.json + tokenizer_config.json with the chat template), dequantising the weights.
//!
//! Usage: cargo run -p model --release --example gguf_to_hf -- MODEL.gguf OUT_DIR [f32|bf16]

use std::path::PathBuf;

use model::{save_hf_checkpoint, GgufFile, ModelConfig};
use xla::DType;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [gguf_path, out, rest @ ..] = args.as_slice() else {
        return Err("usage: gguf_to_hf MODEL.gguf OUT_DIR [f32|bf16]".into());
    };
    let dtype = match rest.first().map(String::as_str) {
        None | Some("f32") => DType::F32,
        Some("bf16") => DType::BF16,
        Some(other) => return Err(format!("unknown dtype `{other}`; use f32 or bf16").into()),
    };
    let gguf = GgufFile::open(&PathBuf::from(gguf_path))?;
    let config = ModelConfig::from_gguf(&gguf)?;
    let start = std::time::Instant::now();
    let weights = gguf.load_weights(&config)?.to_dtype(dtype);
    eprintln!(
        "dequantised {} parameters in {:.2?}",
        weights.num_parameters(),
        start.elapsed()
    );
    let staging = tempfile::tempdir()?;
    let files = model::write_gguf_tokenizer_files(&gguf, &config, staging.path())?;
    let file_refs: Vec<&std::path::Path> = files.iter().map(PathBuf::as_path).collect();
    save_hf_checkpoint(&PathBuf::from(out), &weights, &file_refs)?;
    eprintln!("wrote {out}");
    Ok(())
}
