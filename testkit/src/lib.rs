//! What the integration tests of `model`, `trainer`, `rollout`, `actors` and `grpo` share: one
//! CPU PJRT client per device count for a test binary, tiny random-weight Llama configs, and
//! the real assets `scripts/setup.sh` and `scripts/test.sh` fetch (a missing asset fails the
//! test, saying how to fetch it). `xla`'s own tests keep theirs: this crate depends on `xla`.

pub mod trackers;

use model::ModelConfig;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use xla::runtime::Client;

/// The CPU client with `devices` devices, shared by the tests of one binary (the CPU plugin
/// from the checkout's `.venv`; run `scripts/setup.sh` first).
pub fn cpu_client(devices: usize) -> &'static Client {
    static CLIENTS: Mutex<BTreeMap<usize, &'static Client>> = Mutex::new(BTreeMap::new());
    let mut clients = CLIENTS.lock().unwrap_or_else(|e| e.into_inner());
    clients.entry(devices).or_insert_with(|| {
        let client = Client::cpu(devices).unwrap_or_else(|e| {
            panic!("cannot create a CPU PJRT client with {devices} device(s) (run scripts/setup.sh): {e}")
        });
        Box::leak(Box::new(client))
    })
}

/// The one-device CPU client.
pub fn client() -> &'static Client {
    cpu_client(1)
}

/// A tiny Llama (tied embeddings, BOS 1, EOS 0) whose sizes a test picks; the defaults are the
/// smallest shape the trainer's tests use.
#[derive(Clone, Copy, Debug)]
pub struct TinyLlama {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub max_positions: usize,
    /// The spread of [`model::random_init`]'s weights.
    pub initializer_range: f64,
}

impl Default for TinyLlama {
    fn default() -> TinyLlama {
        TinyLlama {
            vocab: 32,
            hidden: 16,
            intermediate: 32,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            max_positions: 16,
            initializer_range: 0.5,
        }
    }
}

impl TinyLlama {
    /// The model config, as `config.json` would give it.
    pub fn config(&self) -> ModelConfig {
        ModelConfig::from_hf_json(
            &serde_json::json!({
                "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "vocab_size": self.vocab, "hidden_size": self.hidden,
                "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "max_position_embeddings": self.max_positions, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "tie_word_embeddings": true,
                "initializer_range": self.initializer_range, "bos_token_id": 1, "eos_token_id": 0
            }),
            "tiny test config",
        )
        .expect("a valid tiny Llama config")
    }
}

/// The repository's root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A real test asset (the SmolLM2 GGUF, the Qwen3 and Llama 3 tokenizers) in
/// `$GRPO_TEST_ASSETS` or the repository's `models/`. Fails the test, saying how to fetch it,
/// when it is missing.
pub fn asset(file: &str) -> PathBuf {
    let dir = std::env::var_os("GRPO_TEST_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("models"));
    let path = dir.join(file);
    assert!(
        path.exists(),
        "test asset {} is missing: run scripts/test.sh (or scripts/setup.sh for the SmolLM2 GGUF, \
         model/scripts/fetch_assets.sh {} for the tokenizers), or set GRPO_TEST_ASSETS to a \
         directory that holds SmolLM2-135M-Instruct.Q4_1.gguf, qwen3/ and llama3/",
        path.display(),
        dir.display()
    );
    path
}

/// The weights of [`tiny_chat_model`]: SmolLM2's configuration (vocabulary, special tokens,
/// rope) on a 2-layer, 32-wide trunk, random (seed 7).
pub fn tiny_chat_weights() -> model::ModelWeights {
    let gguf = model::GgufFile::open(&smollm2_gguf()).expect("open the GGUF");
    let mut config = model::ModelConfig::from_gguf(&gguf).expect("GGUF config");
    config.hidden_size = 32;
    config.intermediate_size = 64;
    config.num_hidden_layers = 2;
    config.num_attention_heads = 4;
    config.num_key_value_heads = 2;
    config.head_dim = 8;
    config.initializer_range = 0.05;
    model::random_init(&config, 7)
}

/// A Hugging Face model directory `dir/tiny-smollm2`: SmolLM2's tokenizer and chat template on
/// [`tiny_chat_weights`].
pub fn tiny_chat_model(dir: &std::path::Path) -> PathBuf {
    save_chat_model(dir, "tiny-smollm2", &tiny_chat_weights(), None)
}

/// `weights` saved as the Hugging Face model directory `dir/name` with SmolLM2's tokenizer and
/// its chat template, or `chat_template` (Jinja) in its place.
fn save_chat_model(
    dir: &std::path::Path,
    name: &str,
    weights: &model::ModelWeights,
    chat_template: Option<&serde_json::Value>,
) -> PathBuf {
    let gguf = model::GgufFile::open(&smollm2_gguf()).expect("open the GGUF");
    let files_dir = dir.join(format!("tokenizer-files-{name}"));
    std::fs::create_dir_all(&files_dir).unwrap();
    let files =
        model::write_gguf_tokenizer_files(&gguf, &weights.config, &files_dir).expect("tokenizer files");
    if let Some(template) = chat_template {
        let path = files_dir.join("tokenizer_config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config["chat_template"] = template.clone();
        std::fs::write(&path, config.to_string()).unwrap();
    }
    let out = dir.join(name);
    let refs: Vec<&std::path::Path> = files.iter().map(|p| p.as_path()).collect();
    model::save_hf_checkpoint(&out, weights, &refs).expect("save the tiny model");
    out
}

/// A Hugging Face model directory `dir/tiny-smollm2-moe`: SmolLM2's tokenizer and chat template
/// on a 2-layer Qwen3-MoE trunk, 32 wide, of 4 experts (16 wide, top 2, renormalised), random
/// (seed 7).
pub fn tiny_moe_chat_model(dir: &std::path::Path) -> PathBuf {
    let mut config = tiny_chat_weights().config;
    config.family = model::Family::Qwen3Moe;
    config.qk_norm = true;
    config.moe = Some(model::MoeConfig {
        num_experts: 4,
        experts_per_token: 2,
        expert_intermediate_size: 16,
        norm_topk_prob: true,
        mlp_only_layers: Vec::new(),
        decoder_sparse_step: 1,
        router_aux_loss_coef: 0.0,
    });
    save_chat_model(dir, "tiny-smollm2-moe", &model::random_init(&config, 7), None)
}

/// A Hugging Face model directory `dir/tiny-smollm2-gemma3`: SmolLM2's tokenizer under Gemma 3's
/// chat template (no system role: a system message opens the first user turn), on a 2-layer
/// Gemma 3 trunk 32 wide (a sliding layer with a window of 16 positions, then a global one; GeGLU,
/// four norms per layer, scaled embeddings), random (seed 7).
pub fn tiny_gemma_chat_model(dir: &std::path::Path) -> PathBuf {
    let mut config = tiny_chat_weights().config;
    config.family = model::Family::Gemma3;
    config.qk_norm = true;
    config.norm_unit_offset = true;
    config.sandwich_norms = true;
    config.scale_embeddings = true;
    config.activation = model::Activation::GeluTanh;
    config.query_pre_attn_scalar = Some(8.0);
    config.sliding_window = Some(16);
    config.layer_types = vec![model::AttentionKind::Sliding, model::AttentionKind::Full];
    config.rope_local_theta = Some(1e4);
    config.tie_word_embeddings = true;
    // Gemma's template with SmolLM2's special tokens.
    let gemma = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/fixtures/tiny/gemma3/tokenizer_config.json");
    let gemma: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(gemma).unwrap()).unwrap();
    save_chat_model(
        dir,
        "tiny-smollm2-gemma3",
        &model::random_init(&config, 7),
        Some(&gemma["chat_template"]),
    )
}

/// A reward model directory `dir/tiny-rm` beside [`tiny_chat_model`]'s (written too when
/// absent): its trunk, SmolLM2's tokenizer and chat template, and a random one-label `score`
/// head (seed `seed`), saved as transformers saves a `LlamaForSequenceClassification`.
pub fn tiny_reward_model(dir: &std::path::Path, seed: u64) -> PathBuf {
    use rand::{Rng, SeedableRng};
    let policy = dir.join("tiny-smollm2");
    if !policy.is_dir() {
        tiny_chat_model(dir);
    }
    let weights = model::safetensors_io::load_hf_checkpoint(&policy).expect("the tiny chat model");
    let hidden = weights.config.hidden_size;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let score: Vec<f32> = (0..hidden).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let head = model::HostTensor::from_f32(model::classifier::SCORE_WEIGHT, vec![1, hidden], &score);
    let out = dir.join("tiny-rm");
    let files: Vec<PathBuf> = ["tokenizer.json", "tokenizer_config.json"]
        .iter()
        .map(|f| policy.join(f))
        .collect();
    let refs: Vec<&std::path::Path> = files.iter().map(|p| p.as_path()).collect();
    model::classifier::ClassifierWeights::with_head(weights, head)
        .and_then(|rm| rm.save(&out, &refs))
        .expect("save the tiny reward model");
    out
}

/// The SmolLM2-135M-Instruct GGUF that `scripts/setup.sh` fetches.
pub fn smollm2_gguf() -> PathBuf {
    asset(SMOLLM2_GGUF)
}

/// The SmolLM2 GGUF's file name.
pub const SMOLLM2_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
