//! Preloading the CUDA libraries of the `nvidia-*` Python wheels (RTLD_GLOBAL) before the XLA
//! CUDA plugin creates a client, as JAX's Python wrapper does: the plugin `dlopen`s them by
//! soname at run time and finds them only if they are already loaded.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// Library base names, in the order they are loaded (dependencies first).
pub const CUDA_LIBRARY_ORDER: [&str; 13] = [
    "libcudart",
    "libnvJitLink",
    "libnvrtc",
    "libcublasLt",
    "libcublas",
    "libcusparse",
    "libcufft",
    "libcusolver",
    "libcupti",
    "libcudnn",
    "libnccl",
    "libnvshmem_host",
    "libcuda_nvrtc_builtins",
];

/// The `nvidia/` folders to search: beside the plugin's `site-packages` and in every
/// `site-packages` searched for plugins ([`super::site::plugin_site_dirs`]).
fn nvidia_roots(plugin: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    // <site>/jax_plugins/xla_cuda13/xla_cuda_plugin.so -> <site>/nvidia
    if let Some(site) = plugin.parent().and_then(Path::parent).and_then(Path::parent) {
        roots.push(site.join("nvidia"));
    }
    for site in super::site::plugin_site_dirs() {
        let root = site.join("nvidia");
        if !roots.contains(&root) {
            roots.push(root);
        }
    }
    roots.into_iter().filter(|r| r.is_dir()).collect()
}

/// The CUDA libraries under the given `nvidia/` folders (`nvidia/*/lib/lib*.so*`), one per base
/// name in [`CUDA_LIBRARY_ORDER`], in that order.
pub fn cuda_libraries_in(roots: &[PathBuf]) -> Vec<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    for root in roots {
        let Ok(packages) = std::fs::read_dir(root) else {
            continue;
        };
        let mut package_dirs: Vec<PathBuf> = packages.flatten().map(|e| e.path()).collect();
        package_dirs.sort();
        for package in package_dirs {
            let Ok(files) = std::fs::read_dir(package.join("lib")) else {
                continue;
            };
            let mut files: Vec<PathBuf> = files.flatten().map(|e| e.path()).collect();
            files.sort();
            candidates.extend(files);
        }
    }
    CUDA_LIBRARY_ORDER
        .iter()
        .filter_map(|base| {
            let prefix = format!("{base}.so");
            candidates
                .iter()
                .find(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&prefix))
                })
                .cloned()
        })
        .collect()
}

/// The CUDA folder holding `nvvm/libdevice` (and `bin/ptxas`) among the `nvidia/` wheels:
/// `nvidia/cuda_nvcc` or `nvidia/cu13`.
pub fn cuda_data_dir_in(roots: &[PathBuf]) -> Option<PathBuf> {
    roots.iter().find_map(|root| {
        ["cuda_nvcc", "cu13"]
            .iter()
            .map(|p| root.join(p))
            .find(|dir| dir.join("nvvm").join("libdevice").is_dir())
    })
}

/// Adds `--xla_gpu_cuda_data_dir` to `XLA_FLAGS` (unless the user set it), so the plugin finds
/// libdevice and ptxas in the wheels.
fn set_cuda_data_dir(roots: &[PathBuf]) {
    let flags = std::env::var("XLA_FLAGS").unwrap_or_default();
    if flags.contains("xla_gpu_cuda_data_dir") {
        return;
    }
    if let Some(dir) = cuda_data_dir_in(roots) {
        let flags = format!("{flags} --xla_gpu_cuda_data_dir={}", dir.display());
        tracing::debug!("XLA_FLAGS={}", flags.trim());
        std::env::set_var("XLA_FLAGS", flags.trim());
    }
}

/// Loads the CUDA libraries found for the plugin at `plugin` with RTLD_GLOBAL, once per process.
/// Libraries that are missing or fail to load are logged; the plugin then reports what it lacks.
pub fn preload_cuda_libraries(plugin: &Path) {
    static LOADED: OnceLock<Mutex<Vec<libloading::os::unix::Library>>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| Mutex::new(Vec::new()));
    let mut loaded = loaded.lock().unwrap_or_else(|p| p.into_inner());
    if !loaded.is_empty() {
        return;
    }
    let roots = nvidia_roots(plugin);
    set_cuda_data_dir(&roots);
    let libraries = cuda_libraries_in(&roots);
    if libraries.is_empty() {
        tracing::warn!(
            "no CUDA libraries from the nvidia-* wheels found (searched {:?}); the CUDA plugin will \
             look for a system CUDA. Install them with `pip install 'jax-cuda13-plugin[with-cuda]'`",
            roots
        );
        return;
    }
    for library in libraries {
        // SAFETY: loading the vendor CUDA libraries runs their initialisers, as JAX does.
        let result = unsafe {
            libloading::os::unix::Library::open(
                Some(&library),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        };
        match result {
            Ok(handle) => {
                tracing::debug!("preloaded {}", library.display());
                loaded.push(handle);
            }
            Err(e) => tracing::warn!("could not preload {}: {e}", library.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_one_library_per_name_in_dependency_order() {
        let dir = tempfile::tempdir().unwrap();
        let nvidia = dir.path().join("nvidia");
        for (package, file) in [
            ("cublas", "libcublas.so.13"),
            ("cublas", "libcublasLt.so.13"),
            ("cuda_runtime", "libcudart.so.13"),
            ("cudnn", "libcudnn.so.9"),
            ("cudnn", "libcudnn_graph.so.9"),
            ("nccl", "libnccl.so.2"),
            ("cuda_runtime", "README.txt"),
        ] {
            let lib = nvidia.join(package).join("lib");
            std::fs::create_dir_all(&lib).unwrap();
            std::fs::write(lib.join(file), b"").unwrap();
        }
        let found: Vec<String> = cuda_libraries_in(std::slice::from_ref(&nvidia))
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(cuda_data_dir_in(std::slice::from_ref(&nvidia)), None);
        std::fs::create_dir_all(nvidia.join("cuda_nvcc/nvvm/libdevice")).unwrap();
        assert_eq!(
            cuda_data_dir_in(std::slice::from_ref(&nvidia)),
            Some(nvidia.join("cuda_nvcc"))
        );
        assert_eq!(
            found,
            [
                "libcudart.so.13",
                "libcublasLt.so.13",
                "libcublas.so.13",
                "libcudnn.so.9",
                "libnccl.so.2"
            ]
        );
    }
}
