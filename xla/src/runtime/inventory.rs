//! What PJRT plugins and devices this host has: finds each plugin, loads it, creates a client and
//! lists its devices; for libtpu without a chip, lists the topologies it can compile for. This is
//! what `grpo devices` prints.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::client::{Client, ClientOptions};
use super::error::Error;
use super::handle::DeviceInfo;
use super::plugin::{locate_plugin, Plugin, PluginKind};
use super::tpu::{describe_topology, TopologyInfo, TopologyOptions, KNOWN_TOPOLOGIES};
use super::CacheConfig;

/// Devices of one kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceGroup {
    /// The device kind.
    pub kind: String,
    /// How many.
    pub count: usize,
    /// Memory per device in bytes, when the plugin reports it.
    pub memory_bytes: Option<u64>,
}

/// What happened when a plugin was probed.
#[derive(Debug)]
pub enum PluginStatus {
    /// Not found (the error has the install command).
    NotFound(Error),
    /// Found but it did not load.
    LoadFailed(Error),
    /// Loaded, and a client was created.
    Devices {
        /// The platform name and version.
        platform: String,
        /// The devices, grouped by kind.
        groups: Vec<DeviceGroup>,
    },
    /// Loaded, but no client: for TPU, only deviceless compilation is available.
    NoClient {
        /// Why the client could not be created.
        error: Error,
        /// Topologies libtpu can compile for (TPU only).
        topologies: Vec<TopologyInfo>,
    },
}

/// One plugin's entry in the listing.
#[derive(Debug)]
pub struct PluginReport {
    /// The kind probed.
    pub kind: PluginKind,
    /// The plugin file, when found.
    pub path: Option<PathBuf>,
    /// Its PJRT C API version, when loaded.
    pub api_version: Option<(i32, i32)>,
    /// What was found.
    pub status: PluginStatus,
}

impl PluginReport {
    /// True when a plugin file was found and loaded.
    pub fn loaded(&self) -> bool {
        self.api_version.is_some()
    }
}

/// Groups devices by kind, keeping first-seen order.
pub fn group_devices(devices: &[DeviceInfo]) -> Vec<DeviceGroup> {
    let mut groups: Vec<DeviceGroup> = Vec::new();
    for d in devices {
        let memory = d.memory.as_ref().and_then(|m| m.bytes_limit);
        match groups.iter_mut().find(|g| g.kind == d.kind) {
            Some(g) => g.count += 1,
            None => groups.push(DeviceGroup {
                kind: d.kind.clone(),
                count: 1,
                memory_bytes: memory,
            }),
        }
    }
    groups
}

/// Finds, loads and lists the plugin of `kind` (`path` overrides the search).
pub fn probe_plugin(kind: PluginKind, path: Option<&Path>) -> PluginReport {
    let located = match locate_plugin(kind, path) {
        Ok(p) => p,
        Err(e) => {
            return PluginReport {
                kind,
                path: None,
                api_version: None,
                status: PluginStatus::NotFound(e),
            }
        }
    };
    let plugin = match Plugin::load(kind, &located) {
        Ok(p) => p,
        Err(e) => {
            return PluginReport {
                kind,
                path: Some(located),
                api_version: None,
                status: PluginStatus::LoadFailed(e),
            }
        }
    };
    let options = ClientOptions {
        create_options: Vec::new(),
        cache: CacheConfig::Disabled,
    };
    let status = match Client::from_plugin(plugin.clone(), options) {
        Ok(client) => PluginStatus::Devices {
            platform: format!("{} {}", client.platform_name(), client.platform_version())
                .trim()
                .to_string(),
            groups: group_devices(client.devices()),
        },
        Err(error) => {
            let topologies = if kind == PluginKind::Tpu {
                KNOWN_TOPOLOGIES
                    .iter()
                    .filter_map(|t| describe_topology(&plugin, t, &TopologyOptions::default()).ok())
                    .collect()
            } else {
                Vec::new()
            };
            PluginStatus::NoClient { error, topologies }
        }
    };
    PluginReport {
        kind,
        path: Some(plugin.path().to_path_buf()),
        api_version: Some(plugin.api_version()),
        status,
    }
}

fn gib(bytes: u64) -> String {
    let g = bytes as f64 / (1u64 << 30) as f64;
    if (g - g.round()).abs() < 0.01 {
        format!("{g:.0} GiB")
    } else {
        format!("{g:.2} GiB")
    }
}

impl std::fmt::Display for PluginReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = String::new();
        match (&self.path, self.api_version) {
            (Some(path), Some((major, minor))) => {
                let _ = writeln!(
                    out,
                    "{}: {} (PJRT C API {major}.{minor})",
                    self.kind,
                    path.display()
                );
            }
            (Some(path), None) => {
                let _ = writeln!(out, "{}: {}", self.kind, path.display());
            }
            (None, _) => {
                let _ = writeln!(out, "{}: not found", self.kind);
            }
        }
        match &self.status {
            PluginStatus::NotFound(e) | PluginStatus::LoadFailed(e) => {
                let _ = writeln!(out, "  {e}");
            }
            PluginStatus::Devices { platform, groups } => {
                let total: usize = groups.iter().map(|g| g.count).sum();
                let _ = writeln!(out, "  platform {platform}, {total} device(s):");
                for g in groups {
                    let memory = match g.memory_bytes {
                        Some(b) => format!("{} each", gib(b)),
                        None => "memory not reported by the plugin".to_string(),
                    };
                    let _ = writeln!(out, "    {} x {} ({memory})", g.count, g.kind);
                }
                if self.kind == PluginKind::Cpu {
                    let _ = writeln!(
                        out,
                        "  (CPU devices are virtual: their number is the client option cpu_device_count)"
                    );
                }
            }
            PluginStatus::NoClient { error, topologies } => {
                let _ = writeln!(out, "  no client: {error}");
                if self.kind == PluginKind::Tpu {
                    let _ = writeln!(
                        out,
                        "  No TPU chip here: only deviceless compilation is available, for these topologies:"
                    );
                    for t in topologies {
                        let hbm = t
                            .hbm_bytes_per_chip
                            .map(|h| format!(", {} HBM per chip", gib(h)))
                            .unwrap_or_default();
                        let _ = writeln!(
                            out,
                            "    {:<12} {} chip(s), {} x {}{hbm}",
                            t.name, t.num_chips, t.num_devices, t.device_kind
                        );
                    }
                }
            }
        }
        f.write_str(&out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::DeviceMemory;

    #[test]
    fn cpu_plugin_lists_its_devices() {
        let report = probe_plugin(PluginKind::Cpu, None);
        assert!(report.loaded(), "{report}");
        let text = report.to_string();
        assert!(text.starts_with("cpu: /"), "{text}");
        assert!(text.contains("(PJRT C API 0."), "{text}");
        assert!(text.contains("device(s):"), "{text}");
        let PluginStatus::Devices { groups, .. } = &report.status else {
            panic!("{text}")
        };
        assert!(groups.iter().map(|g| g.count).sum::<usize>() >= 1);
    }

    #[test]
    fn missing_plugin_entry_has_the_install_command() {
        let report = probe_plugin(
            PluginKind::Cuda,
            Some(Path::new("/nonexistent/xla_cuda_plugin.so")),
        );
        let text = report.to_string();
        assert!(text.starts_with("cuda: not found"), "{text}");
        assert!(text.contains("/nonexistent/xla_cuda_plugin.so"), "{text}");
    }

    #[test]
    fn tpu_without_a_chip_lists_compile_targets() {
        if std::env::var("GRPO_SKIP_TPU_TESTS").is_ok_and(|v| v == "1") {
            eprintln!("SKIPPED tpu_without_a_chip_lists_compile_targets: GRPO_SKIP_TPU_TESTS=1");
            return;
        }
        let report = probe_plugin(PluginKind::Tpu, None);
        let text = report.to_string();
        assert!(
            report.loaded(),
            "libtpu must be installed (`pip install libtpu`): {text}"
        );
        assert!(
            text.contains("only deviceless compilation is available"),
            "{text}"
        );
        assert!(
            text.contains("v5e:2x2      4 chip(s), 4 x TPU v5 lite, 16 GiB HBM per chip"),
            "{text}"
        );
        assert!(text.contains("tpu7x:2x2x1  4 chip(s), 8 x"), "{text}");
    }

    #[test]
    fn groups_by_kind_with_memory() {
        let d = |index: usize, kind: &str, limit: Option<u64>| DeviceInfo {
            index,
            id: index as i32,
            kind: kind.to_string(),
            description: String::new(),
            memory: limit.map(|l| DeviceMemory {
                bytes_limit: Some(l),
                bytes_in_use: 0,
            }),
        };
        let groups = group_devices(&[
            d(0, "H100", Some(80 << 30)),
            d(1, "H100", Some(80 << 30)),
            d(2, "cpu", None),
        ]);
        assert_eq!(groups.len(), 2);
        assert_eq!((groups[0].count, groups[0].memory_bytes), (2, Some(80 << 30)));
        assert_eq!(gib(80 << 30), "80 GiB");
        assert_eq!(gib((15.75 * (1u64 << 30) as f64) as u64), "15.75 GiB");
    }
}
