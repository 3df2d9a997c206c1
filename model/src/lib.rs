//! The model families `grpo` trains (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3; see
//! [`config`]). On the host: configurations from
//! Hugging Face `config.json` or GGUF metadata, the parameter table of each family, weights from
//! safetensors (single or sharded) and GGUF (dequantised, llama.cpp's Q/K permutation undone),
//! random initialisation, Hugging Face checkpoint export, tokenizers (`tokenizer.json` or built
//! from a GGUF vocabulary) and chat templates rendered with `minijinja`. As compute: the
//! decoder as graph functions ([`forward`]: prefill, decode over a KV cache, log-probs and
//! entropies; [`moe`] for mixture-of-experts layers) and those compiled on a device
//! ([`programs`]); LoRA adapters in PEFT's format ([`lora`]); sequence classifiers and value
//! models (the trunk with a `score` head, [`classifier`]), reading the host tensors
//! ([`HostTensor`]) by their Hugging Face names.
//!
//! The crate knows nothing of training or of sampling policy: the learner (`trainer`) and the
//! rollout engine (`rollout`) both build on these graph functions.

pub mod chat;
pub mod classifier;
pub mod config;
pub mod error;
pub mod forward;
pub mod gguf;
pub mod init;
pub mod lora;
pub mod moe;
pub mod params;
pub mod programs;
pub mod quants;
pub mod safetensors_io;
pub mod tensor;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use classifier::{ClassifierConfig, ClassifierWeights, DeviceClassifier};
pub use config::{Activation, AttentionKind, Family, ModelConfig, MoeConfig, RopeScaling};
pub use error::{ModelError, ProgramError};
pub use gguf::{GgmlType, GgufFile, GgufValue};
pub use init::random_init;
pub use lora::{LoraAdapter, LoraConfig, LoraForm, Target, TargetModules, TargetParameters};
pub use params::{param_table, ModelSplit, ParamKind, ParamLayout, ParamSpec, MODEL_AXIS};
pub use safetensors_io::{load_safetensors, save_hf_checkpoint, ModelWeights};
pub use tensor::HostTensor;
pub use tokenizer::{write_gguf_tokenizer_files, ModelTokenizer};
