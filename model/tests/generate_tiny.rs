//! The generation loop on the tiny Llama fixture: greedy continuations equal step-by-step
//! argmax over full-sequence logits (prefill + decode agree with a from-scratch forward at every
//! step); sampling is reproducible by seed; stop tokens end the continuation.

use std::path::PathBuf;
use testkit::client;

use model::programs::{generate, DeviceModel, FullLogitsProgram, GenerateOptions, Generator, HostModel};
use model::safetensors_io::load_hf_checkpoint;
use xla::DType;

fn tiny_llama() -> DeviceModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/llama");
    let weights = load_hf_checkpoint(&dir).expect("tiny checkpoint");
    DeviceModel::upload(client(), &weights, DType::F32, 0).unwrap()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn greedy_generation_equals_argmax_of_full_forward() {
    let model = tiny_llama();
    let vocab = model.config().vocab_size;
    let prompt = [1u32, 17, 250, 3, 99];
    let new = 10;
    let options = GenerateOptions {
        max_new_tokens: new,
        temperature: 0.0,
        seed: 0,
        stop_tokens: vec![],
    };
    let got = generate(&model, &prompt, &options).unwrap();
    assert_eq!(got.len(), new);

    let total = prompt.len() + new;
    let full = FullLogitsProgram::compile(&model, 1, total).unwrap();
    let mut seq: Vec<u32> = prompt.to_vec();
    for _ in 0..new {
        let mut tokens = seq.clone();
        tokens.resize(total, 0);
        let mut mask = vec![1i32; seq.len()];
        mask.resize(total, 0);
        let logits = full.run(&model, &tokens, &mask).unwrap();
        let last = seq.len() - 1;
        seq.push(argmax(&logits[last * vocab..(last + 1) * vocab]));
    }
    assert_eq!(got, seq[prompt.len()..].to_vec());
}

#[test]
fn sampling_follows_the_seed_and_stop_tokens_end_it() {
    let model = tiny_llama();
    let generator = Generator::new(&model, 8, 40).unwrap();
    let prompt = [1u32, 5, 6, 7];
    let opts = |seed| GenerateOptions {
        max_new_tokens: 30,
        temperature: 1.5,
        seed,
        stop_tokens: vec![],
    };
    let a = generator.generate(&model, &prompt, &opts(1)).unwrap();
    let b = generator.generate(&model, &prompt, &opts(1)).unwrap();
    let c = generator.generate(&model, &prompt, &opts(2)).unwrap();
    assert_eq!(a, b, "same seed, same continuation");
    assert_ne!(
        a, c,
        "different seeds should differ over 30 tokens of a 384-token vocabulary"
    );
    assert_eq!(a.len(), 30);
    // Stopping at the token sampled at step 5 leaves the first 5.
    let stop = a[5];
    let first = a.iter().position(|&t| t == stop).unwrap();
    let mut o = opts(1);
    o.stop_tokens = vec![stop];
    assert_eq!(
        generator.generate(&model, &prompt, &o).unwrap(),
        a[..first].to_vec()
    );
    let err = generator.generate(&model, &[1; 9], &o).unwrap_err().to_string();
    assert!(
        err.contains("the prompt has 9 tokens; this generator takes 1 to 8"),
        "{err}"
    );
}

#[test]
fn a_path_that_is_not_a_model_is_named() {
    let err = HostModel::load(std::path::Path::new("/nonexistent/model.bin"))
        .err()
        .expect("not a model")
        .to_string();
    assert!(
        err.contains("/nonexistent/model.bin is not a model: expected a .gguf file"),
        "{err}"
    );
}
