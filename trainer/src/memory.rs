//! How a learner process gets its memory from the C allocator.
//!
//! XLA CPU runs each train program with large temporary allocations taken from `malloc` at
//! every call. glibc maps allocations that large with `mmap` and unmaps them on `free`, so
//! every call faults in fresh 4 KiB pages. With glibc's `glibc.malloc.hugetlb=1` tunable,
//! `malloc` advises transparent huge pages for what it maps, and the same memory arrives in
//! 2 MiB pages (measured with `trainer/examples/update_bench.rs`: BENCHMARKS.md, "Learner").
//!
//! The CPU plugin's blocks of 16 MiB and more do not come from glibc: they are kept and reused
//! by `xla::runtime::host_blocks` (mapped with huge pages once, never faulted in again). The
//! tunable serves everything else glibc maps (buffers the host code and smaller plugin
//! allocations take).
//!
//! glibc reads tunables only when a process starts, so [`reexec_with_huge_page_malloc`]
//! re-executes the program once with the tunable added to `GLIBC_TUNABLES`; a program calls
//! it first thing in `main`, before any thread starts.

use std::ffi::OsString;

/// The glibc tunable that makes `malloc` advise transparent huge pages for the memory it maps.
pub const HUGE_PAGE_TUNABLE: &str = "glibc.malloc.hugetlb=1";

/// The kernel's transparent-huge-page mode file.
const THP_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// Whether a transparent-huge-page mode line (the contents of
/// `/sys/kernel/mm/transparent_hugepage/enabled`, e.g. `always [madvise] never`) lets a
/// process get huge pages by asking (`madvise` or `always` selected).
pub fn thp_mode_allows_advice(mode_line: &str) -> bool {
    mode_line.contains("[madvise]") || mode_line.contains("[always]")
}

/// `GLIBC_TUNABLES` with [`HUGE_PAGE_TUNABLE`] appended (tunables are `:`-separated), or
/// `None` when `current` already sets `glibc.malloc.hugetlb` to anything (an explicit choice,
/// e.g. `glibc.malloc.hugetlb=0` to opt out, is kept).
pub fn tunables_with_huge_pages(current: Option<&str>) -> Option<String> {
    match current {
        Some(c)
            if c.split(':')
                .any(|t| t.trim().starts_with("glibc.malloc.hugetlb=")) =>
        {
            None
        }
        Some(c) if !c.trim().is_empty() => Some(format!("{c}:{HUGE_PAGE_TUNABLE}")),
        _ => Some(HUGE_PAGE_TUNABLE.to_string()),
    }
}

/// Why [`reexec_with_huge_page_malloc`] returned instead of re-executing the program.
#[derive(Debug, thiserror::Error)]
pub enum HugePageError {
    /// `GLIBC_TUNABLES` already sets `glibc.malloc.hugetlb` (this is also the state after the
    /// re-execution).
    #[error("GLIBC_TUNABLES already sets glibc.malloc.hugetlb; nothing to do")]
    AlreadySet,
    /// The kernel gives no huge pages on request.
    #[error(
        "transparent huge pages are not available on request ({THP_ENABLED}: {0}); malloc keeps 4 KiB pages"
    )]
    Unavailable(String),
    /// Not a Linux glibc build: the tunable does not exist.
    #[error("malloc huge pages need Linux with glibc; this build has another C library")]
    NotGlibc,
    /// `exec` failed.
    #[error("re-executing {program} with GLIBC_TUNABLES={tunables} failed: {source}")]
    Exec {
        program: String,
        tunables: String,
        source: std::io::Error,
    },
}

/// Re-executes the running program (same executable, arguments and environment) with
/// [`HUGE_PAGE_TUNABLE`] added to `GLIBC_TUNABLES`, so that the C allocator backs XLA's large
/// per-call temporaries with transparent huge pages (see the module documentation).
///
/// Call it first in `main`, before any thread starts: on success it does not return. It
/// returns the reason it did nothing when the tunable is already set (which is the case in the
/// re-executed program, so there is no loop; set `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` to
/// opt out), when the kernel offers no huge pages on request, or off Linux glibc.
pub fn reexec_with_huge_page_malloc() -> Result<std::convert::Infallible, HugePageError> {
    if !cfg!(all(target_os = "linux", target_env = "gnu")) {
        return Err(HugePageError::NotGlibc);
    }
    let current = std::env::var("GLIBC_TUNABLES").ok();
    let Some(tunables) = tunables_with_huge_pages(current.as_deref()) else {
        return Err(HugePageError::AlreadySet);
    };
    let mode = std::fs::read_to_string(THP_ENABLED).unwrap_or_else(|e| format!("unreadable: {e}"));
    if !thp_mode_allows_advice(&mode) {
        return Err(HugePageError::Unavailable(mode.trim().to_string()));
    }
    let exec_err = |program: String, source| HugePageError::Exec {
        program,
        tunables: tunables.clone(),
        source,
    };
    let exe = std::env::current_exe().map_err(|e| exec_err("the current executable".into(), e))?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    exec(&exe, &args, &tunables).map_err(|e| exec_err(exe.display().to_string(), e))
}

#[cfg(unix)]
fn exec(
    exe: &std::path::Path,
    args: &[OsString],
    tunables: &str,
) -> std::io::Result<std::convert::Infallible> {
    use std::os::unix::process::CommandExt;
    Err(std::process::Command::new(exe)
        .args(args)
        .env("GLIBC_TUNABLES", tunables)
        .exec())
}

#[cfg(not(unix))]
fn exec(
    _exe: &std::path::Path,
    _args: &[OsString],
    _tunables: &str,
) -> std::io::Result<std::convert::Infallible> {
    Err(std::io::Error::other("exec needs a Unix system"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tunable_is_added_once_and_an_explicit_choice_is_kept() {
        assert_eq!(
            tunables_with_huge_pages(None).as_deref(),
            Some("glibc.malloc.hugetlb=1")
        );
        assert_eq!(
            tunables_with_huge_pages(Some("")).as_deref(),
            Some("glibc.malloc.hugetlb=1")
        );
        assert_eq!(
            tunables_with_huge_pages(Some("glibc.malloc.arena_max=2")).as_deref(),
            Some("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
        );
        assert_eq!(tunables_with_huge_pages(Some("glibc.malloc.hugetlb=1")), None);
        assert_eq!(
            tunables_with_huge_pages(Some("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0")),
            None
        );
    }

    #[test]
    fn thp_modes_are_read_from_the_kernel_line() {
        assert!(thp_mode_allows_advice("always [madvise] never\n"));
        assert!(thp_mode_allows_advice("[always] madvise never"));
        assert!(!thp_mode_allows_advice("always madvise [never]"));
        assert!(!thp_mode_allows_advice("unreadable: No such file or directory"));
    }

    #[test]
    fn errors_say_what_happened() {
        assert_eq!(
            HugePageError::Unavailable("always madvise [never]".into()).to_string(),
            "transparent huge pages are not available on request \
             (/sys/kernel/mm/transparent_hugepage/enabled: always madvise [never]); malloc keeps 4 KiB pages"
        );
    }
}
