//! Export of a learner checkpoint (`OUTPUT/checkpoints/step_N/`) as a Hugging Face checkpoint
//! directory that transformers loads: `model.safetensors` (f32 or bf16) with the trained
//! parameters, `config.json`, and the tokenizer files (`tokenizer.json`,
//! `tokenizer_config.json` with the chat template) of the model the run started from.
//!
//! The checkpoint is verified (sizes and sha256 of every file) before anything is read, and
//! every trained tensor is checked by name and shape against the parameter table of the source
//! model's config, so a checkpoint of another model is refused naming the first tensor that
//! does not fit. The output is written atomically by [`model::save_hf_checkpoint`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use model::lora::{lora_param_table, LoraAdapter, LoraConfig};
use model::{
    param_table, save_hf_checkpoint, GgufFile, HostTensor, ModelConfig, ModelError, ModelTokenizer,
    ModelWeights,
};

use crate::checkpoint::{load_checkpoint, Checkpoint, CheckpointError};

/// The key of `state.json`'s `extra` object that records the model a run trained.
pub const MODEL_PATH_KEY: &str = "model_path";

/// The key of `state.json`'s `extra` object that records a LoRA run's adapters (PEFT's
/// `adapter_config.json`); absent for a full fine-tune.
pub const LORA_KEY: &str = "lora";

/// The tensor file of a checkpoint that holds the policy's parameters.
pub const PARAMS_STEM: &str = "params";

/// Files of a Hugging Face model directory copied into the export when present, besides
/// `tokenizer.json` (which is required).
const OPTIONAL_TOKENIZER_FILES: &[&str] = &[
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
];

/// What went wrong exporting a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The checkpoint is missing, corrupt or unreadable.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] CheckpointError),
    /// No model was named and the checkpoint does not record one.
    #[error(
        "{state}: `extra.{MODEL_PATH_KEY}` is not set, so the model this checkpoint was trained \
         from is unknown; pass it with --model PATH (a .gguf file or a Hugging Face model directory)"
    )]
    NoModelPath {
        /// The checkpoint's `state.json`.
        state: PathBuf,
    },
    /// The source model (config, tokenizer, chat template) cannot be read.
    #[error("model {path}: {source}")]
    Model {
        /// The `.gguf` file or model directory.
        path: PathBuf,
        /// The model crate's error.
        #[source]
        source: ModelError,
    },
    /// The source model path is neither a `.gguf` file nor a directory with `config.json`.
    #[error("model {path}: not a .gguf file or a Hugging Face model directory (with config.json); pass the model the checkpoint was trained from with --model")]
    NotAModel {
        /// The path given.
        path: PathBuf,
    },
    /// A Hugging Face model directory without `tokenizer.json`.
    #[error("model {dir}: has no tokenizer.json, so the export would have no tokenizer; pass a model directory with tokenizer.json or the .gguf file the run used")]
    NoTokenizer {
        /// The model directory.
        dir: PathBuf,
    },
    /// The checkpoint holds no parameter file.
    #[error("{dir}: the checkpoint has no {PARAMS_STEM}.safetensors (files: {files}); it was not written by the learner")]
    NoParams {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The tensor files it has, comma-separated.
        files: String,
    },
    /// A parameter of the model is missing from the checkpoint.
    #[error("tensor `{name}` (shape {expected:?} in {model}) is missing from {file}; the checkpoint was trained from another model, pass the right one with --model")]
    MissingTensor {
        /// Hugging Face name.
        name: String,
        /// Its shape in the model's parameter table.
        expected: Vec<usize>,
        /// The checkpoint's parameter file.
        file: PathBuf,
        /// The source model.
        model: PathBuf,
    },
    /// A checkpoint tensor has another shape than the model's parameter.
    #[error("tensor `{name}` in {file} has shape {found:?}, but {model} expects {expected:?}; the checkpoint was trained from another model, pass the right one with --model")]
    ShapeMismatch {
        /// Hugging Face name.
        name: String,
        /// Shape in the checkpoint.
        found: Vec<usize>,
        /// Shape in the model's parameter table.
        expected: Vec<usize>,
        /// The checkpoint's parameter file.
        file: PathBuf,
        /// The source model.
        model: PathBuf,
    },
    /// The checkpoint holds a tensor the model does not have.
    #[error("tensor `{name}` (shape {found:?}) in {file} is not a parameter of {model}; the checkpoint was trained from another model, pass the right one with --model")]
    UnexpectedTensor {
        /// Name in the checkpoint.
        name: String,
        /// Shape in the checkpoint.
        found: Vec<usize>,
        /// The checkpoint's parameter file.
        file: PathBuf,
        /// The source model.
        model: PathBuf,
    },
    /// A trained parameter holds NaN or infinity.
    #[error("tensor `{name}` in {file}: element {index} is {value}; the run diverged before this checkpoint, export an earlier one")]
    NonFinite {
        /// Hugging Face name.
        name: String,
        /// Flat index of the first non-finite element.
        index: usize,
        /// The value.
        value: f32,
        /// The checkpoint's parameter file.
        file: PathBuf,
    },
    /// Writing the export failed.
    #[error("writing {output}: {source}")]
    Write {
        /// The output directory.
        output: PathBuf,
        /// The model crate's error.
        #[source]
        source: ModelError,
    },
    /// The checkpoint's recorded LoRA configuration cannot be read, or `--merged` was asked of
    /// a full fine-tune.
    #[error("{0}")]
    Lora(String),
    /// Merging the adapters into the base weights failed (the CPU plugin is needed).
    #[error("merging the adapters into {model}: {message}")]
    Merge {
        /// The base model.
        model: PathBuf,
        /// What failed.
        message: String,
    },
    /// A staging file for the tokenizer could not be written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// How to export.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportOptions {
    /// The model the checkpoint was trained from (a `.gguf` file or a Hugging Face model
    /// directory); `None` takes `extra.model_path` from the checkpoint's `state.json`.
    pub model: Option<PathBuf>,
    /// Element type of the exported weights (f32 or bf16; bf16 rounds to nearest even).
    pub dtype: xla::DType,
    /// For a LoRA checkpoint: write the merged model (`W + s·B·A`) as a Hugging Face model
    /// instead of the PEFT adapter.
    pub merged: bool,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            model: None,
            dtype: xla::DType::F32,
            merged: false,
        }
    }
}

/// What an export wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportSummary {
    /// The output directory.
    pub output: PathBuf,
    /// The checkpoint's step.
    pub step: u64,
    /// The source model used for config and tokenizer.
    pub model: PathBuf,
    /// Number of tensors written.
    pub tensors: usize,
    /// Number of parameters written.
    pub parameters: usize,
    /// File names in the output directory, sorted.
    pub files: Vec<String>,
}

/// The source model's side of an export: its config and the tokenizer files to copy.
struct SourceModel {
    config: ModelConfig,
    tokenizer_files: Vec<PathBuf>,
    /// Holds tokenizer files generated from a GGUF until the export is written.
    _staging: Option<StagingDir>,
}

/// A directory removed when dropped.
struct StagingDir(PathBuf);

impl Drop for StagingDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn model_err(path: &Path) -> impl FnOnce(ModelError) -> ExportError {
    let path = path.to_path_buf();
    move |source| ExportError::Model { path, source }
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ExportError {
    let path = path.to_path_buf();
    move |source| ExportError::Io { action, path, source }
}

impl SourceModel {
    /// Reads the config and tokenizer of `path`; `staging_parent` receives a temporary
    /// directory for tokenizer files generated from a GGUF.
    fn load(path: &Path, staging_parent: &Path) -> Result<SourceModel, ExportError> {
        let is_gguf = path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        if is_gguf {
            return Self::from_gguf(path, staging_parent);
        }
        if !path.join("config.json").is_file() {
            return Err(ExportError::NotAModel {
                path: path.to_path_buf(),
            });
        }
        let config = ModelConfig::from_hf_file(&path.join("config.json")).map_err(model_err(path))?;
        let tokenizer_json = path.join("tokenizer.json");
        if !tokenizer_json.is_file() {
            return Err(ExportError::NoTokenizer {
                dir: path.to_path_buf(),
            });
        }
        let tokenizer = ModelTokenizer::from_file(&tokenizer_json).map_err(model_err(path))?;
        tokenizer.check_fits(&config).map_err(model_err(path))?;
        let mut tokenizer_files = vec![tokenizer_json];
        tokenizer_files.extend(
            OPTIONAL_TOKENIZER_FILES
                .iter()
                .map(|name| path.join(name))
                .filter(|p| p.is_file()),
        );
        Ok(SourceModel {
            config,
            tokenizer_files,
            _staging: None,
        })
    }

    fn from_gguf(path: &Path, staging_parent: &Path) -> Result<SourceModel, ExportError> {
        let gguf = GgufFile::open(path).map_err(model_err(path))?;
        let config = ModelConfig::from_gguf(&gguf).map_err(model_err(path))?;
        std::fs::create_dir_all(staging_parent).map_err(io_err("creating", staging_parent))?;
        let staging = StagingDir(staging_parent.join(format!(".export-tokenizer-{}", std::process::id())));
        if staging.0.exists() {
            std::fs::remove_dir_all(&staging.0).map_err(io_err("removing", &staging.0))?;
        }
        std::fs::create_dir(&staging.0).map_err(io_err("creating", &staging.0))?;
        let tokenizer_files =
            model::write_gguf_tokenizer_files(&gguf, &config, &staging.0).map_err(model_err(path))?;
        Ok(SourceModel {
            config,
            tokenizer_files,
            _staging: Some(staging),
        })
    }
}

/// The model path recorded in a checkpoint's `state.json` (`extra.model_path`), if any.
pub fn recorded_model_path(checkpoint: &Checkpoint) -> Option<PathBuf> {
    checkpoint
        .state
        .extra
        .get(MODEL_PATH_KEY)
        .and_then(|v| v.as_str())
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
}

/// Matches the checkpoint's parameter tensors to the parameter table of `config`, in table
/// order: every parameter must be present with its shape, and no other tensor may be there.
/// Values are checked to be finite. `model` names the source model in errors.
pub fn trained_weights(
    checkpoint: &Checkpoint,
    config: &ModelConfig,
    model: &Path,
) -> Result<ModelWeights, ExportError> {
    Ok(ModelWeights {
        config: config.clone(),
        tensors: trained_tensors(checkpoint, &param_table(config), model)?,
    })
}

/// The LoRA configuration a checkpoint records (`extra.lora`), `None` for a full fine-tune.
pub fn recorded_lora(checkpoint: &Checkpoint) -> Result<Option<LoraConfig>, ExportError> {
    match checkpoint.state.extra.get(LORA_KEY) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(json) => LoraConfig::from_peft_json(json).map(Some).map_err(|e| {
            ExportError::Lora(format!(
                "{}: `extra.{LORA_KEY}`: {e}",
                checkpoint.dir.join("state.json").display()
            ))
        }),
    }
}

/// The checkpoint's parameter tensors matched to `table`, in table order: every entry must be
/// present with its shape and finite, and no other tensor may be there.
fn trained_tensors(
    checkpoint: &Checkpoint,
    table: &[model::ParamSpec],
    model: &Path,
) -> Result<Vec<HostTensor>, ExportError> {
    let file = checkpoint.dir.join(format!("{PARAMS_STEM}.safetensors"));
    let params = checkpoint
        .tensors
        .get(PARAMS_STEM)
        .ok_or_else(|| ExportError::NoParams {
            dir: checkpoint.dir.clone(),
            files: checkpoint
                .tensors
                .keys()
                .map(|s| format!("{s}.safetensors"))
                .collect::<Vec<_>>()
                .join(", "),
        })?;
    let mut by_name: BTreeMap<&str, &HostTensor> = params.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut tensors = Vec::with_capacity(table.len());
    for spec in table {
        let t = by_name
            .remove(spec.name.as_str())
            .ok_or_else(|| ExportError::MissingTensor {
                name: spec.name.clone(),
                expected: spec.shape.clone(),
                file: file.clone(),
                model: model.to_path_buf(),
            })?;
        if t.shape != spec.shape {
            return Err(ExportError::ShapeMismatch {
                name: spec.name.clone(),
                found: t.shape.clone(),
                expected: spec.shape.clone(),
                file: file.clone(),
                model: model.to_path_buf(),
            });
        }
        let values = t.to_f32_vec();
        if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(ExportError::NonFinite {
                name: spec.name.clone(),
                index,
                value,
                file: file.clone(),
            });
        }
        let tensor = HostTensor {
            name: spec.name.clone(),
            ..t.clone()
        };
        tensors.push(tensor);
    }
    if let Some((name, t)) = by_name.into_iter().next() {
        return Err(ExportError::UnexpectedTensor {
            name: name.to_string(),
            found: t.shape.clone(),
            file,
            model: model.to_path_buf(),
        });
    }
    Ok(tensors)
}

/// Exports the checkpoint directory `checkpoint_dir` (a `step_N` directory) as a Hugging Face
/// checkpoint in `output` (replaced atomically if it exists): the trained parameters in
/// `options.dtype`, the source model's `config.json`, and its tokenizer files.
pub fn export_checkpoint(
    checkpoint_dir: &Path,
    output: &Path,
    options: &ExportOptions,
) -> Result<ExportSummary, ExportError> {
    let checkpoint = load_checkpoint(checkpoint_dir)?;
    let model_path = match &options.model {
        Some(p) => p.clone(),
        None => recorded_model_path(&checkpoint).ok_or_else(|| ExportError::NoModelPath {
            state: checkpoint_dir.join("state.json"),
        })?,
    };
    let staging_parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let source = SourceModel::load(&model_path, &staging_parent)?;
    let lora = recorded_lora(&checkpoint)?;
    if lora.is_none() && options.merged {
        return Err(ExportError::Lora(format!(
            "{}: --merged applies to LoRA checkpoints; this run trained every weight, so the export is the model already",
            checkpoint_dir.display()
        )));
    }
    if let Some(lora) = lora.clone().filter(|_| !options.merged) {
        let tensors = trained_tensors(&checkpoint, &lora_param_table(&source.config, &lora), &model_path)?;
        let adapter = LoraAdapter { lora, tensors };
        adapter
            .save_peft(output, &model_path.display().to_string())
            .map_err(|source| ExportError::Write {
                output: output.to_path_buf(),
                source,
            })?;
        return summary(output, &checkpoint, model_path, &adapter.tensors);
    }
    let weights = match lora {
        Some(lora) => {
            let tensors =
                trained_tensors(&checkpoint, &lora_param_table(&source.config, &lora), &model_path)?;
            merged_weights(&model_path, LoraAdapter { lora, tensors })?
        }
        None => trained_weights(&checkpoint, &source.config, &model_path)?,
    }
    .to_dtype(options.dtype);
    let files: Vec<&Path> = source.tokenizer_files.iter().map(PathBuf::as_path).collect();
    save_hf_checkpoint(output, &weights, &files).map_err(|source| ExportError::Write {
        output: output.to_path_buf(),
        source,
    })?;
    summary(output, &checkpoint, model_path, &weights.tensors)
}

/// The base model's weights with the adapters merged in (on the CPU plugin).
fn merged_weights(model_path: &Path, adapter: LoraAdapter) -> Result<ModelWeights, ExportError> {
    let merge_err = |message: String| ExportError::Merge {
        model: model_path.to_path_buf(),
        message,
    };
    let base = model::programs::HostModel::load(model_path)
        .map_err(|e| merge_err(e.to_string()))?
        .weights;
    let client = xla::runtime::Client::cpu(1)
        .map_err(|e| merge_err(format!("the CPU plugin (run scripts/setup.sh): {e}")))?;
    adapter
        .merge_into(&client, 0, &base)
        .map_err(|e| merge_err(e.to_string()))
}

fn summary(
    output: &Path,
    checkpoint: &Checkpoint,
    model: PathBuf,
    tensors: &[HostTensor],
) -> Result<ExportSummary, ExportError> {
    let mut written: Vec<String> = std::fs::read_dir(output)
        .map_err(io_err("listing", output))?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    written.sort();
    Ok(ExportSummary {
        output: output.to_path_buf(),
        step: checkpoint.state.step,
        model,
        tensors: tensors.len(),
        parameters: tensors.iter().map(HostTensor::numel).sum(),
        files: written,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{save_checkpoint, TrainerState};

    /// A checkpoint holding the tiny config's parameters, value `i * 0.5 + first` at flat
    /// index `i`, with `edit` applied to the tensor list first.
    fn checkpoint_with(edit: impl FnOnce(&mut Vec<HostTensor>)) -> (tempfile::TempDir, Checkpoint) {
        let mut params: Vec<HostTensor> = param_table(&ModelConfig::tiny_llama())
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let values: Vec<f32> = (0..s.numel()).map(|i| i as f32 * 0.5 + k as f32).collect();
                HostTensor::from_f32(&s.name, s.shape.clone(), &values)
            })
            .collect();
        edit(&mut params);
        let tmp = tempfile::tempdir().unwrap();
        let state = TrainerState {
            step: 4,
            weight_version: 4,
            rng_state: serde_json::json!(null),
            sampler_position: serde_json::json!(null),
            extra: serde_json::json!({ "model_path": "models/x.gguf" }),
        };
        let dir = save_checkpoint(tmp.path(), &state, &[("params", params)], None).unwrap();
        let ck = load_checkpoint(&dir).unwrap();
        (tmp, ck)
    }

    #[test]
    fn parameters_follow_the_table_with_their_values() {
        let (_tmp, ck) = checkpoint_with(|_| {});
        let w = trained_weights(&ck, &ModelConfig::tiny_llama(), Path::new("m")).unwrap();
        let table = param_table(&ModelConfig::tiny_llama());
        assert_eq!(
            w.tensors.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
            table.iter().map(|s| s.name.clone()).collect::<Vec<_>>()
        );
        // the second table entry (input_layernorm of layer 0, shape [32]) holds 1.0 + 0.5 * i
        assert_eq!(w.tensors[1].name, "model.layers.0.input_layernorm.weight");
        assert_eq!(w.tensors[1].to_f32_vec()[..3], [1.0, 1.5, 2.0]);
        assert_eq!(recorded_model_path(&ck), Some(PathBuf::from("models/x.gguf")));
    }

    #[test]
    fn a_bf16_checkpoint_tensor_is_kept_bit_exact() {
        let (_tmp, ck) = checkpoint_with(|p| {
            p[0] =
                HostTensor::from_f32_as(p[0].name.clone(), vec![32, 32], &[0.1f32; 1024], xla::DType::BF16);
        });
        let w = trained_weights(&ck, &ModelConfig::tiny_llama(), Path::new("m")).unwrap();
        assert_eq!(w.tensors[0].dtype, xla::DType::BF16);
        assert_eq!(w.tensors[0].to_f32_vec()[0], half::bf16::from_f32(0.1).to_f32());
    }

    #[test]
    fn mismatches_are_refused_naming_the_tensor() {
        let (_tmp, ck) = checkpoint_with(|p| {
            p.retain(|t| t.name != "model.layers.0.mlp.up_proj.weight");
        });
        let err = trained_weights(&ck, &ModelConfig::tiny_llama(), Path::new("src.gguf"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "tensor `model.layers.0.mlp.up_proj.weight` (shape [64, 32] in src.gguf) is missing from"
            ) && err.contains("params.safetensors"),
            "{err}"
        );

        let (_tmp, ck) = checkpoint_with(|p| {
            let t = p.iter_mut().find(|t| t.name == "model.norm.weight").unwrap();
            *t = HostTensor::from_f32("model.norm.weight", vec![4], &[1.0; 4]);
        });
        let err = trained_weights(&ck, &ModelConfig::tiny_llama(), Path::new("m"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tensor `model.norm.weight`") && err.contains("has shape [4], but m expects [32]"),
            "{err}"
        );

        let (_tmp, ck) = checkpoint_with(|p| {
            p.push(HostTensor::from_f32("lm_head.weight", vec![32, 32], &[0.0; 1024]));
        });
        let err = trained_weights(&ck, &ModelConfig::tiny_llama(), Path::new("m"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tensor `lm_head.weight` (shape [32, 32])")
                && err.contains("is not a parameter of m"),
            "{err}"
        );

        let (_tmp, ck) = checkpoint_with(|p| {
            let mut values = vec![0.0f32; 32];
            values[3] = f32::NAN;
            let t = p.iter_mut().find(|t| t.name == "model.norm.weight").unwrap();
            *t = HostTensor::from_f32("model.norm.weight", vec![32], &values);
        });
        let err = trained_weights(&ck, &ModelConfig::tiny_llama(), Path::new("m"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tensor `model.norm.weight`") && err.contains("element 3 is NaN"),
            "{err}"
        );
    }

    #[test]
    fn a_checkpoint_without_a_model_path_asks_for_one() {
        let (_tmp, ck) = checkpoint_with(|_| {});
        let mut state = ck.state.clone();
        state.extra = serde_json::json!({});
        let tmp = tempfile::tempdir().unwrap();
        let params = ck.tensors["params"].clone();
        let dir = save_checkpoint(tmp.path(), &state, &[("params", params)], None).unwrap();
        let err = export_checkpoint(&dir, &tmp.path().join("out"), &ExportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("state.json: `extra.model_path` is not set") && err.contains("--model PATH"),
            "{err}"
        );
        let err = export_checkpoint(
            &dir,
            &tmp.path().join("out"),
            &ExportOptions {
                model: Some(tmp.path().join("nowhere")),
                dtype: xla::DType::F32,
                merged: false,
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("nowhere: not a .gguf file or a Hugging Face model directory"),
            "{err}"
        );
    }
}
