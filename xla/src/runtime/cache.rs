//! The executable cache: in memory by program fingerprint (sha256 of the StableHLO text and the
//! compile options), and on disk through PJRT serialize / deserialize-and-load, keyed by that
//! fingerprint + the plugin build (path, size, mtime, C API version) + the platform and device
//! count + the host CPU features. A corrupt, stale or foreign entry is logged, ignored and
//! replaced; writes are atomic (temporary file + rename).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use sha2::{Digest, Sha256};

use super::error::Result;
use super::executable::Executable;
use super::handle::ClientHandle;

/// The environment variable that sets the on-disk cache folder, or `off` to disable it.
pub const CACHE_ENV_VAR: &str = "GRPO_EXECUTABLE_CACHE";

const MAGIC: &[u8; 9] = b"GRPOPJRT\x01";
const ENTRY_SUFFIX: &str = "pjrtexe";

/// Where compiled executables are kept on disk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CacheConfig {
    /// `$XDG_CACHE_HOME/grpo/executables`, else `~/.cache/grpo/executables`.
    #[default]
    Default,
    /// This folder.
    Dir(PathBuf),
    /// Memory only.
    Disabled,
}

impl CacheConfig {
    /// From `$GRPO_EXECUTABLE_CACHE`: unset is [`CacheConfig::Default`], `off` (or `0`, `none`,
    /// `false`) disables the disk cache, anything else is a folder.
    pub fn from_env() -> CacheConfig {
        match std::env::var_os(CACHE_ENV_VAR) {
            None => CacheConfig::Default,
            Some(v) if v.is_empty() => CacheConfig::Default,
            Some(v) => match v.to_string_lossy().to_ascii_lowercase().as_str() {
                "off" | "0" | "none" | "false" => CacheConfig::Disabled,
                _ => CacheConfig::Dir(PathBuf::from(v)),
            },
        }
    }

    /// The folder this setting means, if any.
    pub fn resolve(&self) -> Option<PathBuf> {
        match self {
            CacheConfig::Default => default_cache_dir(),
            CacheConfig::Dir(d) => Some(d.clone()),
            CacheConfig::Disabled => None,
        }
    }
}

/// `$XDG_CACHE_HOME/grpo/executables`, else `$HOME/.cache/grpo/executables`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("grpo").join("executables"))
}

/// sha256 (hex) of the program text and the serialized compile options.
pub fn program_fingerprint(mlir: &str, compile_options_proto: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update((mlir.len() as u64).to_le_bytes());
    h.update(mlir.as_bytes());
    h.update(compile_options_proto);
    hex(&h.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 (hex, 16 chars) of the host CPU's feature flags (`/proc/cpuinfo`), or `unknown`.
pub fn host_cpu_features() -> &'static str {
    static FEATURES: OnceLock<String> = OnceLock::new();
    FEATURES.get_or_init(|| {
        let flags = &super::HostCpu::get().flags;
        if flags.is_empty() {
            "unknown".to_string()
        } else {
            hex(&Sha256::digest(flags.join(" ").as_bytes()))[..16].to_string()
        }
    })
}

/// Counters of what the cache did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Compiles answered from memory.
    pub memory_hits: u64,
    /// Compiles answered by loading a serialized executable from disk.
    pub disk_hits: u64,
    /// Real compiles.
    pub misses: u64,
    /// Disk entries found corrupt, stale or foreign (and replaced).
    pub rejected: u64,
    /// Entries written to disk.
    pub writes: u64,
}

/// A client's executable cache.
pub struct ExecutableCache {
    memory: Mutex<HashMap<String, Executable>>,
    dir: Option<PathBuf>,
    memory_hits: AtomicU64,
    disk_hits: AtomicU64,
    misses: AtomicU64,
    rejected: AtomicU64,
    writes: AtomicU64,
    last_rejection: Mutex<Option<String>>,
}

impl std::fmt::Debug for ExecutableCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutableCache")
            .field("dir", &self.dir)
            .field("stats", &self.stats())
            .finish()
    }
}

impl ExecutableCache {
    pub(crate) fn new(config: &CacheConfig) -> ExecutableCache {
        ExecutableCache {
            memory: Mutex::new(HashMap::new()),
            dir: config.resolve(),
            memory_hits: AtomicU64::new(0),
            disk_hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            last_rejection: Mutex::new(None),
        }
    }

    /// The on-disk folder, when the disk cache is on.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// What the cache has done so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            memory_hits: self.memory_hits.load(Ordering::Relaxed),
            disk_hits: self.disk_hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
        }
    }

    /// Why the last disk entry was rejected.
    pub fn last_rejection(&self) -> Option<String> {
        self.last_rejection
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Forgets the in-memory executables (the disk cache stays).
    pub fn clear_memory(&self) {
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    pub(crate) fn memory_get(&self, fingerprint: &str) -> Option<Executable> {
        let hit = self
            .memory
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(fingerprint)
            .cloned();
        if hit.is_some() {
            self.memory_hits.fetch_add(1, Ordering::Relaxed);
        }
        hit
    }

    pub(crate) fn memory_insert(&self, fingerprint: &str, executable: &Executable) {
        self.memory
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(fingerprint.to_string(), executable.clone());
    }

    /// The full key of a disk entry: everything that must match for a serialized executable
    /// to be valid here.
    pub(crate) fn entry_key(client: &ClientHandle, fingerprint: &str) -> String {
        format!(
            "program={fingerprint}\nplugin={}\nplatform={} {}\ndevices={}\ncpu={}\n",
            client.plugin.build_identity(),
            client.platform_name,
            client.platform_version,
            client.devices.len(),
            host_cpu_features()
        )
    }

    /// The file of the disk entry for `fingerprint` on `client`.
    pub(crate) fn entry_path(&self, client: &ClientHandle, fingerprint: &str) -> Option<PathBuf> {
        let key = Self::entry_key(client, fingerprint);
        let name = hex(&Sha256::digest(key.as_bytes()));
        self.dir
            .as_ref()
            .map(|d| d.join(format!("{name}.{ENTRY_SUFFIX}")))
    }

    fn reject(&self, path: &Path, reason: String) {
        tracing::warn!(
            "ignoring executable cache entry {}: {reason}; it will be replaced",
            path.display()
        );
        self.rejected.fetch_add(1, Ordering::Relaxed);
        *self.last_rejection.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(format!("{}: {reason}", path.display()));
        let _ = std::fs::remove_file(path);
    }

    /// Loads the executable for `fingerprint` from disk, its payload made an executable by
    /// `deserialize`; `None` (and a counted miss) when there is none or it is unusable.
    pub(crate) fn disk_load(
        &self,
        client: &ClientHandle,
        fingerprint: &str,
        deserialize: impl FnOnce(&[u8]) -> Result<Executable>,
    ) -> Option<Executable> {
        let Some(path) = self.entry_path(client, fingerprint) else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) => {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!("cannot read executable cache entry {}: {e}", path.display());
                }
                self.misses.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        let key = Self::entry_key(client, fingerprint);
        let loaded = decode_entry(&bytes, &key)
            .and_then(|payload| deserialize(payload).map_err(|e| format!("the plugin cannot load it ({e})")));
        match loaded {
            Ok(executable) => {
                self.disk_hits.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("loaded {} from {}", executable.name(), path.display());
                Some(executable)
            }
            Err(reason) => {
                self.reject(&path, reason);
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Writes the executable to disk (atomically); failures are logged, never fatal.
    pub(crate) fn disk_store(&self, client: &ClientHandle, fingerprint: &str, executable: &Executable) {
        let Some(path) = self.entry_path(client, fingerprint) else {
            return;
        };
        let payload = match executable.serialize() {
            Ok(p) if !p.is_empty() => p,
            Ok(_) => return,
            Err(e) => {
                tracing::debug!("not caching {}: cannot serialize: {e}", executable.name());
                return;
            }
        };
        let key = Self::entry_key(client, fingerprint);
        match write_atomically(&path, &encode_entry(&key, &payload)) {
            Ok(()) => {
                self.writes.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(
                "cannot write executable cache entry {}: {e} (set {CACHE_ENV_VAR}=off to disable the disk cache)",
                path.display()
            ),
        }
    }
}

/// `MAGIC | u32 key length | key | u64 payload length | sha256(payload) | payload`.
fn encode_entry(key: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + key.len() + 64);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(payload));
    out.extend_from_slice(payload);
    out
}

/// Checks an entry and returns its payload, or why it is unusable.
fn decode_entry<'a>(bytes: &'a [u8], expected_key: &str) -> std::result::Result<&'a [u8], String> {
    let rest = bytes
        .strip_prefix(MAGIC.as_slice())
        .ok_or("it is not a grpo executable cache entry (bad magic)")?;
    let (len, rest) = split_u32(rest).ok_or("it is truncated (no key length)")?;
    if rest.len() < len as usize {
        return Err("it is truncated (key)".to_string());
    }
    let (key, rest) = rest.split_at(len as usize);
    if key != expected_key.as_bytes() {
        return Err(format!(
            "it was written for another program, plugin build or host ({:?})",
            String::from_utf8_lossy(key)
        ));
    }
    let (len, rest) = split_u64(rest).ok_or("it is truncated (no payload length)")?;
    if rest.len() < 32 {
        return Err("it is truncated (no checksum)".to_string());
    }
    let (checksum, payload) = rest.split_at(32);
    if payload.len() as u64 != len {
        return Err(format!(
            "it is truncated or padded (payload {} bytes, header says {len})",
            payload.len()
        ));
    }
    if Sha256::digest(payload).as_slice() != checksum {
        return Err("its checksum does not match (corrupt)".to_string());
    }
    Ok(payload)
}

fn split_u32(b: &[u8]) -> Option<(u32, &[u8])> {
    let (head, rest) = b.split_at_checked(4)?;
    Some((u32::from_le_bytes(head.try_into().ok()?), rest))
}

fn split_u64(b: &[u8]) -> Option<(u64, &[u8])> {
    let (head, rest) = b.split_at_checked(8)?;
    Some((u64::from_le_bytes(head.try_into().ok()?), rest))
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!(
        ".{}.{}.{nanos}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("entry"),
        std::process::id()
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        // No fsync: an entry torn by a crash fails its checksum and is replaced.
        f.write_all(bytes)?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_reject_damage() {
        let entry = encode_entry("key-a", b"payload bytes");
        assert_eq!(decode_entry(&entry, "key-a").unwrap(), b"payload bytes");
        let foreign = decode_entry(&entry, "key-b").unwrap_err();
        assert!(foreign.contains("another program"), "{foreign}");
        let mut corrupt = entry.clone();
        *corrupt.last_mut().unwrap() ^= 0xff;
        assert!(decode_entry(&corrupt, "key-a").unwrap_err().contains("checksum"));
        let truncated = &entry[..entry.len() - 3];
        assert!(decode_entry(truncated, "key-a")
            .unwrap_err()
            .contains("truncated"));
        assert!(decode_entry(b"garbage", "key-a")
            .unwrap_err()
            .contains("bad magic"));
        assert!(decode_entry(&entry[..12], "key-a")
            .unwrap_err()
            .contains("truncated"));
    }

    #[test]
    fn fingerprint_depends_on_text_and_options() {
        let a = program_fingerprint("module {}", &[1]);
        assert_eq!(a.len(), 64);
        assert_eq!(a, program_fingerprint("module {}", &[1]));
        assert_ne!(a, program_fingerprint("module {} ", &[1]));
        assert_ne!(a, program_fingerprint("module {}", &[2]));
    }

    #[test]
    fn cache_dir_settings() {
        assert_eq!(CacheConfig::Disabled.resolve(), None);
        assert_eq!(
            CacheConfig::Dir("/tmp/x".into()).resolve(),
            Some(PathBuf::from("/tmp/x"))
        );
        let default = CacheConfig::Default.resolve().unwrap();
        assert!(default.ends_with("grpo/executables"), "{default:?}");
    }

    #[test]
    fn cpu_features_are_hashed_flags() {
        let f = host_cpu_features();
        assert!(f == "unknown" || (f.len() == 16 && f.chars().all(|c| c.is_ascii_hexdigit())));
    }

    #[test]
    fn atomic_write_replaces_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("e.pjrtexe");
        write_atomically(&path, b"one").unwrap();
        write_atomically(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let leftovers = std::fs::read_dir(path.parent().unwrap()).unwrap().count();
        assert_eq!(leftovers, 1);
    }
}
