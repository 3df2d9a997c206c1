//! Checkpoints under `OUTPUT/checkpoints/step_N/`: named f32, bf16 or f16 tensors ([`model::HostTensor`]) in safetensors files
//! (parameters, optimizer state), `state.json` (step, RNG state, data-sampler position, weight
//! version and whatever else the caller passes) and `manifest.json` with the size and sha256 of
//! every file.
//!
//! A save writes everything into `checkpoints/.tmp-step_N-PID/`, fsyncs each file and the
//! directory, then renames it to `step_N` and fsyncs `checkpoints/`; a crash leaves either the
//! previous checkpoints untouched plus a `.tmp-*` directory (ignored, and removed by the next
//! save) or the complete new one. The manifest is written last, so a `step_N` without a
//! manifest is never taken for a checkpoint. Loading verifies every file's size and checksum.
//!
//! The caller names the tensor files: the policy's `params` and `optimizer`, and with PPO's
//! critic `critic_params` and `critic_optimizer` beside them
//! ([`crate::step::CRITIC_STATE_FILES`]). A save that fails (a full disk) removes its partial
//! files and leaves the previous checkpoints as they were.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use model::HostTensor;
use safetensors::tensor::Dtype as StDtype;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use xla::DType;

/// What went wrong saving, finding or loading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A filesystem operation failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done (`writing`, `renaming`, ...).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A file listed in the manifest is shorter or longer than recorded.
    #[error("{path}: the file has {got} bytes but the manifest records {expected}; the checkpoint is truncated or damaged, load an older one")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Size in the manifest.
        expected: u64,
        /// Size on disk.
        got: u64,
    },
    /// A file's sha256 differs from the manifest's.
    #[error("{path}: sha256 is {got} but the manifest records {expected}; the file is corrupted, load an older checkpoint")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// Checksum in the manifest.
        expected: String,
        /// Checksum of the file.
        got: String,
    },
    /// The manifest, state or a tensor file cannot be parsed, or is inconsistent.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// No complete checkpoint exists.
    #[error(
        "no complete checkpoint under {dir} (a complete one is a step_N directory with a manifest.json)"
    )]
    NoCheckpoint {
        /// The checkpoints directory.
        dir: PathBuf,
    },
    /// A tensor handed to `save` is inconsistent.
    #[error("tensor {name}: {message}")]
    Tensor {
        /// Tensor name.
        name: String,
        /// What is wrong.
        message: String,
    },
}

type Result<T> = std::result::Result<T, CheckpointError>;

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    move |source| CheckpointError::Io { action, path, source }
}

/// The JSON side of a checkpoint (`state.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// The global step the checkpoint was taken after.
    pub step: u64,
    /// The weight version pushed to rollout workers.
    pub weight_version: u64,
    /// The RNG state (opaque to this module).
    pub rng_state: serde_json::Value,
    /// The data sampler's position (opaque to this module).
    pub sampler_position: serde_json::Value,
    /// Anything else the caller wants back (metrics history, config hash, ...).
    #[serde(default)]
    pub extra: serde_json::Value,
}

/// One file's entry in `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Size in bytes.
    pub bytes: u64,
    /// sha256 in hex.
    pub sha256: String,
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version (1).
    pub format: u32,
    /// The checkpoint's step.
    pub step: u64,
    /// File name -> size and checksum.
    pub files: BTreeMap<String, ManifestEntry>,
}

/// A loaded, verified checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    /// Its directory.
    pub dir: PathBuf,
    /// `state.json`.
    pub state: TrainerState,
    /// Tensor file stem (`params`, `optimizer`, ...) -> tensors sorted by name.
    pub tensors: BTreeMap<String, Vec<HostTensor>>,
}

/// `OUTPUT/checkpoints`.
pub fn checkpoints_dir(output: &Path) -> PathBuf {
    output.join("checkpoints")
}

fn step_dir_name(step: u64) -> String {
    format!("step_{step}")
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(io("creating", path))?;
    f.write_all(bytes).map_err(io("writing", path))?;
    f.sync_all().map_err(io("syncing", path))
}

fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing directory", path))
}

fn serialize_tensors(tensors: &[HostTensor]) -> Result<Vec<u8>> {
    if let Some((t, message)) = tensors.iter().find_map(|t| t.problem().map(|m| (t, m))) {
        return Err(CheckpointError::Tensor {
            name: t.name.clone(),
            message,
        });
    }
    safetensors::serialize(tensors.iter().map(|t| (t.name.clone(), t)), None).map_err(|e| {
        CheckpointError::Tensor {
            name: "(all)".to_string(),
            message: e.to_string(),
        }
    })
}

/// Saves a checkpoint as `OUTPUT/checkpoints/step_{state.step}/` atomically: tensor files
/// `{stem}.safetensors` for each `(stem, tensors)` group, `state.json`, and `manifest.json`
/// last, in a temporary directory renamed into place. Then keeps only the newest
/// `max_to_keep` complete checkpoints (`None` keeps all) and removes leftover temporary
/// directories. Returns the checkpoint's directory.
pub fn save_checkpoint(
    output: &Path,
    state: &TrainerState,
    tensor_files: &[(&str, Vec<HostTensor>)],
    max_to_keep: Option<usize>,
) -> Result<PathBuf> {
    let root = checkpoints_dir(output);
    fs::create_dir_all(&root).map_err(io("creating", &root))?;
    let final_dir = root.join(step_dir_name(state.step));
    let tmp = root.join(format!(
        ".tmp-{}-{}",
        step_dir_name(state.step),
        std::process::id()
    ));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io("removing", &tmp))?;
    }
    fs::create_dir(&tmp).map_err(io("creating", &tmp))?;

    // A failed write (a full disk) must not leave its partial files taking space.
    if let Err(e) = write_contents(&tmp, state, tensor_files) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }

    if final_dir.exists() {
        // Re-saving a step: move the old one aside first so the rename cannot fail half-way.
        let old = root.join(format!(
            ".old-{}-{}",
            step_dir_name(state.step),
            std::process::id()
        ));
        fs::rename(&final_dir, &old).map_err(io("renaming", &final_dir))?;
        fs::remove_dir_all(&old).map_err(io("removing", &old))?;
    }
    fs::rename(&tmp, &final_dir).map_err(io("renaming", &tmp))?;
    sync_dir(&root)?;

    remove_temporaries(&root)?;
    if let Some(keep) = max_to_keep {
        let complete = list_complete(&root)?;
        let excess = complete.len().saturating_sub(keep.max(1));
        for (_, dir) in complete.into_iter().take(excess) {
            fs::remove_dir_all(&dir).map_err(io("pruning", &dir))?;
        }
    }
    Ok(final_dir)
}

/// Writes a checkpoint's files into `dir`: the tensor files, `state.json`, and `manifest.json`
/// last, each synced, then the directory.
fn write_contents(dir: &Path, state: &TrainerState, tensor_files: &[(&str, Vec<HostTensor>)]) -> Result<()> {
    let mut files = BTreeMap::new();
    let mut put = |name: String, bytes: Vec<u8>| -> Result<()> {
        let path = dir.join(&name);
        write_synced(&path, &bytes)?;
        files.insert(
            name,
            ManifestEntry {
                bytes: bytes.len() as u64,
                sha256: sha256_hex(&bytes),
            },
        );
        Ok(())
    };
    for (stem, tensors) in tensor_files {
        put(format!("{stem}.safetensors"), serialize_tensors(tensors)?)?;
    }
    let state_json = serde_json::to_vec_pretty(state).map_err(|e| CheckpointError::Format {
        path: dir.join("state.json"),
        message: e.to_string(),
    })?;
    put("state.json".to_string(), state_json)?;
    let manifest = Manifest {
        format: 1,
        step: state.step,
        files,
    };
    let manifest_json = serde_json::to_vec_pretty(&manifest).map_err(|e| CheckpointError::Format {
        path: dir.join("manifest.json"),
        message: e.to_string(),
    })?;
    write_synced(&dir.join("manifest.json"), &manifest_json)?;
    sync_dir(dir)
}

fn remove_temporaries(root: &Path) -> Result<()> {
    for entry in fs::read_dir(root).map_err(io("listing", root))? {
        let entry = entry.map_err(io("listing", root))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if name.starts_with(".tmp-") || name.starts_with(".old-") {
            fs::remove_dir_all(entry.path()).map_err(io("removing", &entry.path()))?;
        }
    }
    Ok(())
}

/// Complete checkpoints (a `step_N` directory holding `manifest.json`), oldest first.
fn list_complete(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    if !root.exists() {
        return Ok(out);
    }
    for entry in fs::read_dir(root).map_err(io("listing", root))? {
        let entry = entry.map_err(io("listing", root))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if let Some(n) = name.strip_prefix("step_").and_then(|s| s.parse::<u64>().ok()) {
            if entry.path().join("manifest.json").is_file() {
                out.push((n, entry.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The newest complete checkpoint under `OUTPUT/checkpoints` (temporary directories and
/// `step_N` directories without a manifest are skipped), if any. Its files are verified by
/// [`load_checkpoint`].
pub fn latest_checkpoint(output: &Path) -> Result<Option<PathBuf>> {
    Ok(list_complete(&checkpoints_dir(output))?.pop().map(|(_, p)| p))
}

/// Loads and verifies a checkpoint directory: every manifest entry must exist with the
/// recorded size and sha256, then the tensor files and `state.json` are parsed.
pub fn load_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let manifest_path = dir.join("manifest.json");
    let text = fs::read(&manifest_path).map_err(io("reading", &manifest_path))?;
    let manifest: Manifest = serde_json::from_slice(&text).map_err(|e| CheckpointError::Format {
        path: manifest_path.clone(),
        message: format!("not a valid manifest: {e}"),
    })?;
    let mut contents = BTreeMap::new();
    for (name, entry) in &manifest.files {
        let path = dir.join(name);
        let bytes = fs::read(&path).map_err(io("reading", &path))?;
        if bytes.len() as u64 != entry.bytes {
            return Err(CheckpointError::Truncated {
                path,
                expected: entry.bytes,
                got: bytes.len() as u64,
            });
        }
        let got = sha256_hex(&bytes);
        if got != entry.sha256 {
            return Err(CheckpointError::Checksum {
                path,
                expected: entry.sha256.clone(),
                got,
            });
        }
        contents.insert(name.clone(), bytes);
    }
    let state_path = dir.join("state.json");
    let state_bytes = contents
        .get("state.json")
        .ok_or_else(|| CheckpointError::Format {
            path: manifest_path.clone(),
            message: "the manifest does not list state.json".to_string(),
        })?;
    let state: TrainerState = serde_json::from_slice(state_bytes).map_err(|e| CheckpointError::Format {
        path: state_path,
        message: e.to_string(),
    })?;
    let mut tensors = BTreeMap::new();
    for (name, bytes) in &contents {
        let Some(stem) = name.strip_suffix(".safetensors") else {
            continue;
        };
        let path = dir.join(name);
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| CheckpointError::Format {
            path: path.clone(),
            message: e.to_string(),
        })?;
        // safetensors reorders tensors on write (by alignment, then name): hand them back
        // sorted by name, a stable order independent of the writer.
        let mut list = Vec::new();
        for (tname, view) in st.tensors() {
            let dtype = match view.dtype() {
                StDtype::F32 => DType::F32,
                StDtype::BF16 => DType::BF16,
                StDtype::F16 => DType::F16,
                other => {
                    return Err(CheckpointError::Format {
                        path: path.clone(),
                        message: format!(
                            "tensor {tname} has dtype {other:?}; checkpoints hold f32, bf16 or f16"
                        ),
                    })
                }
            };
            let tensor =
                HostTensor::from_le_bytes(&tname, dtype, view.shape().to_vec(), view.data().to_vec())
                    .ok_or_else(|| CheckpointError::Format {
                        path: path.clone(),
                        message: format!(
                            "tensor {tname}: {} bytes for shape {:?}",
                            view.data().len(),
                            view.shape()
                        ),
                    })?;
            list.push(tensor);
        }
        list.sort_by(|a, b| a.name.cmp(&b.name));
        tensors.insert(stem.to_string(), list);
    }
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        state,
        tensors,
    })
}

impl Checkpoint {
    /// The tensor `name` of file `stem`.
    pub fn tensor(&self, stem: &str, name: &str) -> Option<&HostTensor> {
        self.tensors.get(stem)?.iter().find(|t| t.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: u64) -> TrainerState {
        TrainerState {
            step,
            weight_version: step + 100,
            rng_state: serde_json::json!({"seed": 7, "counter": step * 3}),
            sampler_position: serde_json::json!({"epoch": 1, "index": 42}),
            extra: serde_json::json!({"note": "test"}),
        }
    }

    fn tensors(step: u64) -> Vec<(&'static str, Vec<HostTensor>)> {
        let s = step as f32;
        vec![
            (
                "params",
                vec![
                    HostTensor::from_f32("w", vec![2, 3], &[1.0 + s, 2.0, 3.0, -4.0, 5.5, 6.25]),
                    HostTensor::from_f32_as("emb", vec![2], &[0.5, -1.25], DType::BF16),
                ],
            ),
            (
                "optimizer",
                vec![
                    HostTensor::from_f32("adam_m.w", vec![2, 3], &[0.1; 6]),
                    HostTensor::from_f32("step", vec![1], &[s]),
                ],
            ),
        ]
    }

    #[test]
    fn round_trip_keeps_tensors_and_state() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_checkpoint(tmp.path(), &state(3), &tensors(3), None).unwrap();
        assert_eq!(dir, tmp.path().join("checkpoints/step_3"));
        assert_eq!(latest_checkpoint(tmp.path()).unwrap(), Some(dir.clone()));
        let ck = load_checkpoint(&dir).unwrap();
        assert_eq!(ck.state, state(3));
        assert_eq!(
            ck.tensor("params", "w").unwrap().to_f32_vec(),
            vec![4.0, 2.0, 3.0, -4.0, 5.5, 6.25]
        );
        let emb = ck.tensor("params", "emb").unwrap();
        assert_eq!(
            (emb.dtype, emb.shape.clone(), emb.to_f32_vec()),
            (DType::BF16, vec![2], vec![0.5, -1.25])
        );
        assert_eq!(ck.tensor("optimizer", "step").unwrap().to_f32_vec(), vec![3.0]);
        let manifest: Manifest =
            serde_json::from_slice(&fs::read(dir.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(
            manifest.files.keys().cloned().collect::<Vec<_>>(),
            vec!["optimizer.safetensors", "params.safetensors", "state.json"]
        );
    }

    #[test]
    fn truncated_and_corrupted_files_are_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_checkpoint(tmp.path(), &state(1), &tensors(1), None).unwrap();
        let file = dir.join("params.safetensors");
        let bytes = fs::read(&file).unwrap();
        fs::write(&file, &bytes[..bytes.len() - 5]).unwrap();
        let err = load_checkpoint(&dir).unwrap_err().to_string();
        assert!(
            err.contains("params.safetensors")
                && err.contains("truncated")
                && err.contains(&format!("records {}", bytes.len())),
            "{err}"
        );
        // same length, one flipped byte
        let mut bad = bytes.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0x40;
        fs::write(&file, &bad).unwrap();
        let err = load_checkpoint(&dir).unwrap_err().to_string();
        assert!(
            err.contains("params.safetensors: sha256 is") && err.contains("the file is corrupted"),
            "{err}"
        );
        // a state.json edited by hand is refused too
        fs::write(&file, &bytes).unwrap();
        let sj = dir.join("state.json");
        let mut s = fs::read(&sj).unwrap();
        s[5] = b' ';
        fs::write(&sj, &s).unwrap();
        let err = load_checkpoint(&dir).unwrap_err().to_string();
        assert!(err.contains("state.json: sha256"), "{err}");
    }

    #[test]
    fn interrupted_save_leaves_the_previous_checkpoint_usable() {
        let tmp = tempfile::tempdir().unwrap();
        let good = save_checkpoint(tmp.path(), &state(2), &tensors(2), None).unwrap();
        let root = checkpoints_dir(tmp.path());
        // a crash mid-save: a temporary directory with a partial file, and a step directory
        // that never got its manifest
        fs::create_dir(root.join(".tmp-step_3-999")).unwrap();
        fs::write(root.join(".tmp-step_3-999/params.safetensors"), b"partial").unwrap();
        fs::create_dir(root.join("step_4")).unwrap();
        fs::write(root.join("step_4/params.safetensors"), b"partial").unwrap();
        assert_eq!(latest_checkpoint(tmp.path()).unwrap(), Some(good.clone()));
        let ck = load_checkpoint(&good).unwrap();
        assert_eq!(ck.state.step, 2);
        // the next save cleans the temporary directory up
        save_checkpoint(tmp.path(), &state(5), &tensors(5), None).unwrap();
        assert!(!root.join(".tmp-step_3-999").exists());
        assert_eq!(latest_checkpoint(tmp.path()).unwrap(), Some(root.join("step_5")));
    }

    #[test]
    fn a_failed_save_removes_its_partial_files_and_keeps_the_previous_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let good = save_checkpoint(tmp.path(), &state(2), &tensors(2), None).unwrap();
        // The parameters are written, then the optimizer's file fails (as a full disk would).
        let mut broken = tensors(3);
        broken[1].1[0].bytes.truncate(3);
        let err = save_checkpoint(tmp.path(), &state(3), &broken, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("adam_m.w"), "{err}");
        let root = checkpoints_dir(tmp.path());
        let left: Vec<_> = fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, vec!["step_2"]);
        assert_eq!(latest_checkpoint(tmp.path()).unwrap(), Some(good));
    }

    #[test]
    fn keeps_only_the_newest_n() {
        let tmp = tempfile::tempdir().unwrap();
        for step in [1, 2, 10, 3] {
            save_checkpoint(tmp.path(), &state(step), &tensors(step), Some(2)).unwrap();
        }
        let root = checkpoints_dir(tmp.path());
        let mut names: Vec<String> = fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        names.sort();
        assert_eq!(names, vec!["step_10", "step_3"]);
        assert_eq!(latest_checkpoint(tmp.path()).unwrap(), Some(root.join("step_10")));
        // re-saving an existing step replaces it
        save_checkpoint(tmp.path(), &state(10), &tensors(11), Some(2)).unwrap();
        let ck = load_checkpoint(&root.join("step_10")).unwrap();
        assert_eq!(ck.tensor("params", "w").unwrap().to_f32_vec()[0], 12.0);
        let err = load_checkpoint(&root.join("step_1")).unwrap_err().to_string();
        assert!(err.contains("step_1/manifest.json"), "{err}");
    }
}
