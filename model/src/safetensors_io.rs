//! Hugging Face checkpoints: loading safetensors weights (one file or shards listed in
//! `model.safetensors.index.json`; f32, bf16 or f16) onto the parameter table, and saving a
//! checkpoint directory (safetensors + `config.json` + tokenizer files) atomically.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors, View};
use serde_json::Value;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::params::param_table;
use crate::tensor::HostTensor;
use xla::DType;

/// A model's parameters in parameter-table order, with the config they belong to.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelWeights {
    /// The model's configuration.
    pub config: ModelConfig,
    /// One tensor per entry of [`crate::param_table`], in that order.
    pub tensors: Vec<HostTensor>,
}

impl ModelWeights {
    /// The tensor with this Hugging Face name.
    pub fn get(&self, name: &str) -> Option<&HostTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Total number of parameters.
    pub fn num_parameters(&self) -> usize {
        self.tensors.iter().map(HostTensor::numel).sum()
    }

    /// A copy with every tensor converted to `dtype`.
    pub fn to_dtype(&self, dtype: DType) -> ModelWeights {
        ModelWeights {
            config: self.config.clone(),
            tensors: self.tensors.iter().map(|t| t.to_dtype(dtype)).collect(),
        }
    }
}

impl View for &HostTensor {
    fn dtype(&self) -> Dtype {
        match self.dtype {
            DType::F32 => Dtype::F32,
            DType::BF16 => Dtype::BF16,
            DType::F16 => Dtype::F16,
            other => unreachable!("a host tensor is never {other}"),
        }
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Name of the single-file weights in a checkpoint directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// Name of the shard index in a sharded checkpoint directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

fn map_file(path: &Path) -> Result<Mmap> {
    let file = std::fs::File::open(path).map_err(|e| ModelError::io("opening", path, e))?;
    // SAFETY: read-only map of a file not expected to change while loading.
    unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io("mapping", path, e))
}

/// The safetensors files of a checkpoint: `path` is a `.safetensors` file, or a directory with
/// `model.safetensors.index.json` (sharded) or `model.safetensors`.
pub fn weight_files(path: &Path) -> Result<Vec<PathBuf>> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let index = path.join(INDEX_FILE);
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io("reading", &index, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: index.clone(),
            source,
        })?;
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| ModelError::Config {
                origin: index.display().to_string(),
                key: "weight_map".into(),
                problem: "missing or not an object of tensor name -> shard file".into(),
            })?;
        let mut shards: Vec<PathBuf> = Vec::new();
        for (name, shard) in map {
            let shard = shard.as_str().ok_or_else(|| ModelError::Config {
                origin: index.display().to_string(),
                key: format!("weight_map.{name}"),
                problem: format!("expected a shard file name, found {shard}"),
            })?;
            let shard = path.join(shard);
            if !shards.contains(&shard) {
                shards.push(shard);
            }
        }
        shards.sort();
        return Ok(shards);
    }
    let single = path.join(WEIGHTS_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(ModelError::io(
        "finding weights in",
        path,
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("neither {INDEX_FILE} nor {WEIGHTS_FILE} is there"),
        ),
    ))
}

/// Every tensor of one safetensors file by name (f32, bf16 or f16; another type is an error
/// naming the tensor).
pub fn read_safetensors(file: &Path) -> Result<HashMap<String, HostTensor>> {
    let origin = file.display().to_string();
    let mmap = map_file(file)?;
    let st = SafeTensors::deserialize(&mmap).map_err(|e| ModelError::CorruptSafetensors {
        path: file.to_path_buf(),
        detail: e.to_string(),
    })?;
    let mut out = HashMap::new();
    for name in st.names() {
        let view = st.tensor(name).map_err(|e| ModelError::CorruptSafetensors {
            path: file.to_path_buf(),
            detail: format!("tensor `{name}`: {e}"),
        })?;
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::BF16 => DType::BF16,
            Dtype::F16 => DType::F16,
            other => {
                return Err(ModelError::UnsupportedDType {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                    origin,
                    supported: "F32, BF16, F16".into(),
                })
            }
        };
        let tensor = HostTensor::from_le_bytes(name, dtype, view.shape().to_vec(), view.data().to_vec())
            .ok_or_else(|| ModelError::CorruptSafetensors {
                path: file.to_path_buf(),
                detail: format!("tensor `{name}` has the wrong number of bytes"),
            })?;
        out.insert(name.to_string(), tensor);
    }
    Ok(out)
}

/// Loads the safetensors weights at `path` (file or checkpoint directory) for `config`.
///
/// Every tensor of the parameter table must be present with its exact shape; any other tensor
/// is an error, except `lm_head.weight` in a tied model and `rotary_emb.inv_freq` buffers,
/// which transformers also ignores. Experts load from either layout: transformers 5's stacked
/// tensors or the published checkpoints' per-expert ones, stacked here. Tensors keep their element type (f32, bf16 or f16).
pub fn load_safetensors(path: &Path, config: &ModelConfig) -> Result<ModelWeights> {
    let table = param_table(config);
    Ok(ModelWeights {
        config: config.clone(),
        tensors: load_table(path, config, &table)?,
    })
}

/// The tensors of `table` from the safetensors weights at `path`, in table order, with
/// [`load_safetensors`]' checks (`config` names the family in errors and says whether the
/// head is tied).
pub(crate) fn load_table(
    path: &Path,
    config: &ModelConfig,
    table: &[crate::ParamSpec],
) -> Result<Vec<HostTensor>> {
    let files = weight_files(path)?;
    let expected: HashMap<&str, &[usize]> = table
        .iter()
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    let mut found: HashMap<String, HostTensor> = HashMap::new();
    let mut per_expert: HashMap<String, HostTensor> = HashMap::new();
    for file in &files {
        let origin = file.display().to_string();
        let mut tensors: Vec<(String, HostTensor)> = read_safetensors(file)?.into_iter().collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, mut tensor) in tensors {
            let Some(name) = text_model_name(config, name) else {
                continue;
            };
            tensor.name.clone_from(&name);
            if crate::moe::is_per_expert_tensor(config, &name) {
                per_expert.insert(name, tensor);
                continue;
            }
            let Some(expected_shape) = expected.get(name.as_str()) else {
                let ignorable = name.ends_with("rotary_emb.inv_freq")
                    || (name == "lm_head.weight" && config.tie_word_embeddings);
                if ignorable {
                    continue;
                }
                return Err(ModelError::UnexpectedTensor {
                    name,
                    found: tensor.shape,
                    origin,
                    family: config.family.to_string(),
                });
            };
            if tensor.shape != *expected_shape {
                return Err(ModelError::ShapeMismatch {
                    name,
                    expected: expected_shape.to_vec(),
                    found: tensor.shape,
                    origin,
                });
            }
            found.insert(name, tensor);
        }
    }
    let origin = if files.len() == 1 {
        files[0].display().to_string()
    } else {
        format!("{} ({} shards)", path.display(), files.len())
    };
    crate::moe::stack_per_expert(config, per_expert, &mut found, &origin)?;
    take_by_table(&mut found, table, &origin)
}

/// A checkpoint tensor's name in the parameter table: a multimodal Gemma 3 checkpoint
/// (`Gemma3ForConditionalGeneration`) keeps its text model under `language_model`
/// (transformers 4: `language_model.model.*`; 5: `model.language_model.*`), which grpo reads
/// as `model.*`, and its vision tower and projector, which grpo leaves out (`None`).
fn text_model_name(config: &ModelConfig, name: String) -> Option<String> {
    if config.family != crate::config::Family::Gemma3 {
        return Some(name);
    }
    let vision = [
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    ];
    if vision.iter().any(|p| name.starts_with(p)) {
        return None;
    }
    for (prefix, to) in [
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ] {
        if let Some(rest) = name.strip_prefix(prefix) {
            return Some(format!("{to}{rest}"));
        }
    }
    Some(name)
}

/// Takes the tensors of `table` out of `found`, in table order: a missing one or one of another
/// shape is an error naming it and `origin`. What is left in `found` is the caller's to judge.
pub(crate) fn take_by_table(
    found: &mut HashMap<String, HostTensor>,
    table: &[crate::ParamSpec],
    origin: &str,
) -> Result<Vec<HostTensor>> {
    table
        .iter()
        .map(|spec| {
            let t = found
                .remove(&spec.name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: spec.name.clone(),
                    expected: spec.shape.clone(),
                    origin: origin.to_string(),
                })?;
            if t.shape != spec.shape {
                return Err(ModelError::ShapeMismatch {
                    name: spec.name.clone(),
                    expected: spec.shape.clone(),
                    found: t.shape,
                    origin: origin.to_string(),
                });
            }
            Ok(t)
        })
        .collect()
}

/// Loads a Hugging Face checkpoint directory: `config.json` and its safetensors weights.
pub fn load_hf_checkpoint(dir: &Path) -> Result<ModelWeights> {
    let config = ModelConfig::from_hf_file(&dir.join("config.json"))?;
    load_safetensors(dir, &config)
}

/// Writes `weights` as a Hugging Face checkpoint directory `dir`: `model.safetensors` (tensors
/// in their element type, `format: pt` metadata), `config.json`, and a copy of each file in
/// `tokenizer_files` (e.g. `tokenizer.json`, `tokenizer_config.json`) under its file name.
///
/// The directory is built beside `dir` under a temporary name and renamed into place, so a
/// reader never sees a half-written checkpoint; an existing `dir` is replaced.
pub fn save_hf_checkpoint(dir: &Path, weights: &ModelWeights, tokenizer_files: &[&Path]) -> Result<()> {
    save_checkpoint(
        dir,
        &weights.tensors,
        weights.config.to_hf_json(),
        tokenizer_files,
    )
}

/// [`save_hf_checkpoint`] for any tensors, with `config_json` as the config (its
/// `torch_dtype` set from the tensors).
pub(crate) fn save_checkpoint(
    dir: &Path,
    tensors: &[HostTensor],
    mut config_json: Value,
    tokenizer_files: &[&Path],
) -> Result<()> {
    write_dir_atomically(dir, |staging| {
        write_safetensors(&staging.join(WEIGHTS_FILE), tensors)?;
        let config_path = staging.join("config.json");
        let dtype = tensors.first().map(|t| t.dtype).unwrap_or(DType::F32);
        config_json["torch_dtype"] = Value::from(match dtype {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            other => unreachable!("a host tensor is never {other}"),
        });
        let text = serde_json::to_string_pretty(&config_json).expect("JSON values serialise");
        std::fs::write(&config_path, text + "\n").map_err(|e| ModelError::io("writing", &config_path, e))?;
        let mut seen = HashSet::new();
        for file in tokenizer_files {
            let name = file.file_name().ok_or_else(|| {
                ModelError::io(
                    "copying",
                    *file,
                    std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file path"),
                )
            })?;
            if !seen.insert(name.to_os_string()) {
                continue;
            }
            std::fs::copy(file, staging.join(name)).map_err(|e| ModelError::io("copying", *file, e))?;
        }
        Ok(())
    })
}

/// Writes `tensors` as one safetensors file in their element types, with PyTorch's
/// `format: pt` metadata (which transformers and PEFT expect).
pub fn write_safetensors(path: &Path, tensors: &[HostTensor]) -> Result<()> {
    let by_name: BTreeMap<&str, &HostTensor> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(by_name, Some(metadata), path)
        .map_err(|e| ModelError::io("writing", path, std::io::Error::other(e.to_string())))
}

/// Makes the directory `dir` by `fill`ing a staging directory beside it and renaming that into
/// place, so a reader never sees a half-written one; an existing `dir` is replaced. The result
/// is readable by all (0755 / 0644), like any model directory.
pub fn write_dir_atomically(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| ModelError::io("creating", &parent, e))?;
    let stem = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    let staging = tempfile::Builder::new()
        .prefix(&format!(".{stem}.partial-"))
        .tempdir_in(&parent)
        .map_err(|e| ModelError::io("creating a temporary directory in", &parent, e))?;
    fill(staging.path())?;
    let staged = staging.keep();
    // The staging directory and safetensors' output are private (0700 / 0600).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let set = |path: &Path, mode: u32| {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
                .map_err(|e| ModelError::io("setting permissions of", path, e))
        };
        set(&staged, 0o755)?;
        for entry in std::fs::read_dir(&staged).map_err(|e| ModelError::io("listing", &staged, e))? {
            let entry = entry.map_err(|e| ModelError::io("listing", &staged, e))?;
            set(&entry.path(), 0o644)?;
        }
    }
    let mut old = None;
    if dir.exists() {
        let backup = parent.join(format!(".{stem}.old-{}", std::process::id()));
        std::fs::rename(dir, &backup).map_err(|e| ModelError::io("moving aside", dir, e))?;
        old = Some(backup);
    }
    if let Err(e) = std::fs::rename(&staged, dir) {
        if let Some(backup) = &old {
            let _ = std::fs::rename(backup, dir);
        }
        let _ = std::fs::remove_dir_all(&staged);
        return Err(ModelError::io("renaming the finished directory to", dir, e));
    }
    if let Some(backup) = old {
        std::fs::remove_dir_all(&backup).map_err(|e| ModelError::io("removing", &backup, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Family;
    use crate::init::random_init;

    pub(crate) fn tiny(family: Family, tied: bool) -> ModelConfig {
        ModelConfig {
            family,
            hidden_size: 16,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 4,
            intermediate_size: 24,
            vocab_size: 40,
            rope_theta: 10000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: tied,
            attention_bias: family == Family::Qwen2,
            o_proj_bias: false,
            qk_norm: family == Family::Qwen3,
            max_position_embeddings: 64,
            bos_token_id: Some(0),
            eos_token_ids: vec![1],
            pad_token_id: None,
            initializer_range: 0.02,
            // No experts, window or Gemma settings: tiny_llama's.
            ..ModelConfig::tiny_llama()
        }
    }

    fn write(path: &Path, tensors: &[HostTensor]) {
        let map: BTreeMap<&str, &HostTensor> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        safetensors::serialize_to_file(map, None, path).unwrap();
    }

    #[test]
    fn round_trip_in_every_dtype() {
        let dir = tempfile::tempdir().unwrap();
        for (family, tied) in [
            (Family::Llama, false),
            (Family::Qwen2, true),
            (Family::Qwen3, false),
        ] {
            let config = tiny(family, tied);
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let weights = random_init(&config, 3).to_dtype(dtype);
                let out = dir.path().join(format!("{family}-{dtype}"));
                save_hf_checkpoint(&out, &weights, &[]).unwrap();
                let back = load_hf_checkpoint(&out).unwrap();
                assert_eq!(back, weights, "{family} {dtype}");
                // Saving again over the same directory replaces it.
                save_hf_checkpoint(&out, &back, &[]).unwrap();
                assert_eq!(load_hf_checkpoint(&out).unwrap(), weights);
            }
        }
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn sharded_checkpoint_loads() {
        let dir = tempfile::tempdir().unwrap();
        let config = tiny(Family::Llama, false);
        let weights = random_init(&config, 5);
        let (first, second) = weights.tensors.split_at(7);
        write(&dir.path().join("model-00001-of-00002.safetensors"), first);
        write(&dir.path().join("model-00002-of-00002.safetensors"), second);
        let mut map = serde_json::Map::new();
        for (part, file) in [
            (first, "model-00001-of-00002.safetensors"),
            (second, "model-00002-of-00002.safetensors"),
        ] {
            for t in part {
                map.insert(t.name.clone(), Value::from(file));
            }
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(dir.path().join(INDEX_FILE), index.to_string()).unwrap();
        let back = load_safetensors(dir.path(), &config).unwrap();
        assert_eq!(back, weights);
    }

    #[test]
    fn missing_unexpected_and_misshapen_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let config = tiny(Family::Qwen2, false);
        let weights = random_init(&config, 1);
        let path = dir.path().join("w.safetensors");

        let without: Vec<HostTensor> = weights
            .tensors
            .iter()
            .filter(|t| t.name != "model.layers.1.self_attn.k_proj.bias")
            .cloned()
            .collect();
        write(&path, &without);
        let e = load_safetensors(&path, &config).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "tensor `model.layers.1.self_attn.k_proj.bias` (expected shape [8]) is missing from {}",
                path.display()
            )
        );

        let mut extra = weights.tensors.clone();
        extra.push(HostTensor::from_f32(
            "model.layers.0.mlp.extra.weight",
            vec![2],
            &[0.0, 1.0],
        ));
        write(&path, &extra);
        let e = load_safetensors(&path, &config).unwrap_err().to_string();
        assert!(
            e.starts_with("unexpected tensor `model.layers.0.mlp.extra.weight` (shape [2]) in"),
            "{e}"
        );
        assert!(e.contains("the qwen2 parameter table"), "{e}");

        let mut wrong = weights.tensors.clone();
        let i = wrong
            .iter()
            .position(|t| t.name == "model.layers.0.mlp.up_proj.weight")
            .unwrap();
        wrong[i] = HostTensor::from_f32("model.layers.0.mlp.up_proj.weight", vec![16, 24], &[0.0; 384]);
        write(&path, &wrong);
        let e = load_safetensors(&path, &config).unwrap_err().to_string();
        assert_eq!(e, format!("tensor `model.layers.0.mlp.up_proj.weight` in {} has shape [16, 24], expected [24, 16] from the config", path.display()));

        // Wrong element type.
        let mut ints = weights.tensors.clone();
        ints.retain(|t| t.name != "model.norm.weight");
        let map: BTreeMap<&str, &HostTensor> = ints.iter().map(|t| (t.name.as_str(), t)).collect();
        let norm_bytes = vec![0u8; 16 * 8];
        let norm = safetensors::tensor::TensorView::new(Dtype::F64, vec![16], &norm_bytes).unwrap();
        let mut all: Vec<(String, safetensors::tensor::TensorView<'_>)> = map
            .iter()
            .map(|(n, t)| {
                let bytes: &[u8] = &t.bytes;
                let dtype = View::dtype(t);
                (
                    n.to_string(),
                    safetensors::tensor::TensorView::new(dtype, t.shape.clone(), bytes).unwrap(),
                )
            })
            .collect();
        all.push(("model.norm.weight".into(), norm));
        safetensors::serialize_to_file(all, None, &path).unwrap();
        let e = load_safetensors(&path, &config).unwrap_err().to_string();
        assert!(
            e.contains("tensor `model.norm.weight`")
                && e.contains("has type F64, which is not supported; supported: F32, BF16, F16"),
            "{e}"
        );
    }

    #[test]
    fn truncated_and_corrupt_files() {
        let dir = tempfile::tempdir().unwrap();
        let config = tiny(Family::Llama, true);
        let out = dir.path().join("ckpt");
        save_hf_checkpoint(&out, &random_init(&config, 2), &[]).unwrap();
        let file = out.join(WEIGHTS_FILE);
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
        let e = load_safetensors(&out, &config).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{} is not a valid safetensors file (corrupt or truncated?)",
                file.display()
            )),
            "{e}"
        );
        std::fs::write(&file, &bytes[..5]).unwrap();
        let e = load_safetensors(&out, &config).unwrap_err().to_string();
        assert!(e.contains("not a valid safetensors file"), "{e}");
        let mut garbage = bytes.clone();
        garbage[8..16].copy_from_slice(b"nonsense");
        std::fs::write(&file, &garbage).unwrap();
        let e = load_safetensors(&out, &config).unwrap_err().to_string();
        assert!(e.contains("not a valid safetensors file"), "{e}");
        let e = load_safetensors(&dir.path().join("nowhere"), &config)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("neither model.safetensors.index.json nor model.safetensors is there"),
            "{e}"
        );
    }
}
