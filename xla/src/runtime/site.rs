//! Where PJRT plugins are looked for: the `site-packages` folders of the project's environment,
//! the active one and `python3`'s, found once per process.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The folder `scripts/setup.sh` installs the plugins into: a Python virtual environment the
/// project owns, at the root of the checkout.
pub const PROJECT_VENV: &str = ".venv";

/// The `site-packages` directories searched for plugins, in order, read once per process:
///
/// 1. the project's environment, [`PROJECT_VENV`] in the working directory or the nearest
///    folder above it that has one, else above the `grpo` executable (`target/release/grpo`
///    of a checkout);
/// 2. the active virtual environment (`$VIRTUAL_ENV`);
/// 3. the site-packages of `python3` (or `$GRPO_PYTHON`), as that interpreter reports them.
///
/// The first two are read from the file system, so which `python3` is first on `PATH` only
/// adds to the list.
pub fn plugin_site_dirs() -> &'static [PathBuf] {
    static DIRS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    DIRS.get_or_init(|| {
        let mut dirs: Vec<PathBuf> = Vec::new();
        let mut add = |found: Vec<PathBuf>| {
            for d in found {
                if !dirs.contains(&d) {
                    dirs.push(d);
                }
            }
        };
        let starts = [
            std::env::current_dir().ok(),
            std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().map(Path::to_path_buf)),
        ];
        if let Some(venv) = starts.iter().flatten().find_map(|s| nearest_venv(s)) {
            add(venv_site_dirs(&venv));
        }
        if let Some(active) = std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()) {
            add(venv_site_dirs(Path::new(&active)));
        }
        add(python_site_dirs());
        dirs
    })
}

/// [`PROJECT_VENV`] in `start` or the nearest folder above it.
pub(super) fn nearest_venv(start: &Path) -> Option<PathBuf> {
    start
        .ancestors()
        .map(|a| a.join(PROJECT_VENV))
        .find(|v| v.join("pyvenv.cfg").is_file())
}

/// A virtual environment's `lib/pythonX.Y/site-packages` folders.
pub fn venv_site_dirs(venv: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for lib in ["lib", "lib64"] {
        let Ok(entries) = std::fs::read_dir(venv.join(lib)) else {
            continue;
        };
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
            .map(|e| e.path().join("site-packages"))
            .filter(|p| p.is_dir())
            .collect();
        found.sort();
        for d in found {
            let d = d.canonicalize().unwrap_or(d);
            if !dirs.contains(&d) {
                dirs.push(d);
            }
        }
    }
    dirs
}

/// The `site-packages` directories of `python3` (or `$GRPO_PYTHON`), asked without importing
/// any plugin package. Empty when Python is not available.
fn python_site_dirs() -> Vec<PathBuf> {
    let python = std::env::var("GRPO_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = "import site, sys\n\
                  dirs = list(getattr(site, 'getsitepackages', lambda: [])())\n\
                  dirs.append(site.getusersitepackages())\n\
                  dirs += [p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))]\n\
                  print('\\n'.join(dirs))";
    let output = std::process::Command::new(&python).args(["-c", script]).output();
    let mut dirs: Vec<PathBuf> = Vec::new();
    match output {
        Ok(out) if out.status.success() => {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let p = PathBuf::from(line.trim());
                if !line.trim().is_empty() && p.is_dir() && !dirs.contains(&p) {
                    dirs.push(p);
                }
            }
        }
        Ok(out) => tracing::debug!(
            "{python} could not list its site-packages: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => tracing::debug!("cannot run {python} to find PJRT plugins: {e}"),
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_virtual_environment_lists_its_site_packages() {
        let dir = tempfile::tempdir().unwrap();
        let site = dir.path().join("lib/python3.11/site-packages");
        std::fs::create_dir_all(&site).unwrap();
        std::fs::create_dir_all(dir.path().join("lib/not-python")).unwrap();
        assert_eq!(venv_site_dirs(dir.path()), [site.canonicalize().unwrap()]);
        assert!(venv_site_dirs(&dir.path().join("missing")).is_empty());
        // Found from a folder below the one holding it.
        let project = dir.path().join("project");
        std::fs::create_dir_all(project.join(".venv")).unwrap();
        std::fs::write(project.join(".venv/pyvenv.cfg"), "home = /usr/bin\n").unwrap();
        std::fs::create_dir_all(project.join("target/release")).unwrap();
        assert_eq!(
            nearest_venv(&project.join("target/release")),
            Some(project.join(".venv"))
        );
        assert_eq!(nearest_venv(dir.path()), None);
    }
}
