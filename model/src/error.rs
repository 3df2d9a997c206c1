//! The `model` crate's errors: reading models ([`ModelError`]) and building, compiling or running
//! their programs ([`ProgramError`]); every failure names the file, key, tensor or program
//! involved and says what to do about it.

use std::path::PathBuf;

use xla::graph::GraphError;

/// Errors from reading configs, weights, tokenizers and chat templates.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be opened, read, written or renamed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done ("reading", "writing", ...).
        action: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (config, index, tokenizer config) is not valid JSON.
    #[error("{path} is not valid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error (with line and column).
        #[source]
        source: serde_json::Error,
    },
    /// The config names an architecture this crate does not implement.
    #[error("unsupported model architecture `{found}` in {origin}; supported: {supported}")]
    UnsupportedArchitecture {
        /// The architecture found (`model_type` / `architectures` / `general.architecture`).
        found: String,
        /// Where it was found.
        origin: String,
        /// The supported architectures, comma separated.
        supported: String,
    },
    /// A config key is missing or has the wrong type or an invalid value.
    #[error("config {origin}: key `{key}`: {problem}")]
    Config {
        /// The config file or GGUF file.
        origin: String,
        /// The key.
        key: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("tensor `{name}` (expected shape {expected:?}) is missing from {origin}")]
    MissingTensor {
        /// Hugging Face name of the tensor.
        name: String,
        /// Its expected shape.
        expected: Vec<usize>,
        /// The checkpoint.
        origin: String,
    },
    /// The checkpoint holds a tensor the model does not have.
    #[error("unexpected tensor `{name}` (shape {found:?}) in {origin}: the {family} parameter table for this config has no such tensor; check the config matches the checkpoint")]
    UnexpectedTensor {
        /// Name of the tensor.
        name: String,
        /// Its shape in the file.
        found: Vec<usize>,
        /// The checkpoint.
        origin: String,
        /// The model family.
        family: String,
    },
    /// A tensor has a different shape than the config implies.
    #[error("tensor `{name}` in {origin} has shape {found:?}, expected {expected:?} from the config")]
    ShapeMismatch {
        /// Name of the tensor.
        name: String,
        /// Shape from the parameter table.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
        /// The checkpoint.
        origin: String,
    },
    /// A tensor's element type is not supported.
    #[error("tensor `{name}` in {origin} has type {dtype}, which is not supported; supported: {supported}")]
    UnsupportedDType {
        /// Name of the tensor.
        name: String,
        /// The type found.
        dtype: String,
        /// The checkpoint.
        origin: String,
        /// Supported types.
        supported: String,
    },
    /// A safetensors file is corrupt or truncated.
    #[error("{path} is not a valid safetensors file (corrupt or truncated?): {detail}")]
    CorruptSafetensors {
        /// The file.
        path: PathBuf,
        /// What the parser reported.
        detail: String,
    },
    /// A GGUF file is corrupt or truncated.
    #[error("{path} is not a valid GGUF file (corrupt or truncated?): {detail}")]
    CorruptGguf {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the byte offset.
        detail: String,
    },
    /// A GGUF metadata key is missing or has an unexpected type.
    #[error("GGUF {path}: metadata key `{key}`: {problem}")]
    GgufMetadata {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong.
        problem: String,
    },
    /// A GGUF file uses a feature this crate does not implement.
    #[error("GGUF {path}: {detail}")]
    UnsupportedGgufFeature {
        /// The file.
        path: PathBuf,
        /// What is not supported and what to do instead.
        detail: String,
    },
    /// A LoRA adapter's configuration asks for something this crate cannot honour.
    #[error("LoRA adapter {path}: {problem}")]
    Adapter {
        /// The adapter's directory or configuration file.
        path: PathBuf,
        /// What is wrong and what to do.
        problem: String,
    },
    /// A tokenizer could not be loaded or built.
    #[error("tokenizer {origin}: {detail}")]
    Tokenizer {
        /// The tokenizer file or GGUF.
        origin: String,
        /// What went wrong.
        detail: String,
    },
    /// The tokenizer has ids the model's embedding table cannot hold.
    #[error("tokenizer {origin} has {tokenizer_size} tokens (largest id {max_id}) but the model's vocab_size is {vocab_size}: the tokenizer does not belong to this model")]
    VocabMismatch {
        /// The tokenizer.
        origin: String,
        /// Tokens in the tokenizer (with added tokens).
        tokenizer_size: usize,
        /// Largest token id.
        max_id: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// A chat template is missing, does not compile or fails to render.
    #[error("chat template from {origin}: {detail}")]
    ChatTemplate {
        /// Where the template came from.
        origin: String,
        /// What went wrong.
        detail: String,
    },
}

impl ModelError {
    /// Shorthand for an [`ModelError::Io`] error.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;

/// What went wrong building, compiling or running a model program.
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    /// Tracing or emitting the graph failed (a bug or an unsupported configuration).
    #[error("building the `{program}` program: {source}")]
    Graph {
        /// Which program.
        program: String,
        /// The graph error (op, shapes, source line).
        #[source]
        source: GraphError,
    },
    /// The PJRT runtime refused a transfer, compile or execution.
    #[error("{action}: {source}")]
    Runtime {
        /// What was being done, e.g. "compiling prefill[1x32]".
        action: String,
        /// The runtime error.
        #[source]
        source: xla::runtime::Error,
    },
    /// The weights do not fit the model's parameter table.
    #[error("weight `{name}`: {problem}")]
    Weights {
        /// Hugging Face tensor name.
        name: String,
        /// What is wrong (missing, expected vs found shape).
        problem: String,
    },
    /// Inputs that do not fit the program's static shapes or the cache.
    #[error("{program}: {problem}")]
    Input {
        /// Which program.
        program: String,
        /// What is wrong and what is allowed.
        problem: String,
    },
    /// A KV cache whose buffers were consumed by a run that then failed.
    #[error(
        "the KV cache was lost when a program that donated it failed; create a new one with KvCache::new"
    )]
    CacheLost,
    /// The model path is neither a `.gguf` file nor a directory.
    #[error(
        "{path} is not a model: expected a .gguf file or a Hugging Face model directory \
         (config.json, *.safetensors, tokenizer.json)"
    )]
    NotAModel {
        /// The path given.
        path: PathBuf,
    },
    /// Loading the model files failed.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Result of building, compiling or running a program.
pub type ProgramResult<T> = std::result::Result<T, ProgramError>;

pub(crate) fn runtime(action: impl Into<String>) -> impl FnOnce(xla::runtime::Error) -> ProgramError {
    let action = action.into();
    move |source| ProgramError::Runtime { action, source }
}
