//! Writes the end-to-end tests' tiny chat model (SmolLM2's tokenizer and chat template on a
//! 2-layer, 32-wide Llama with random weights) as a Hugging Face directory `DIR/tiny-smollm2`,
//! for checks outside `cargo test` (`scripts/gpu-check.sh`).
//!
//! ```text
//! cargo run -p testkit --example tiny_chat_model -- DIR
//! ```

fn main() {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: tiny_chat_model DIR");
        std::process::exit(2);
    };
    let model = testkit::tiny_chat_model(std::path::Path::new(&dir));
    println!("{}", model.display());
}
