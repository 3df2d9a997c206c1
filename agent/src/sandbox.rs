//! Confinement of an untrusted child process on Linux, with unprivileged kernel features only
//! (no root, no namespaces, no containers), so it works on a laptop, a GPU box and a TPU VM
//! alike. A [`Sandbox`] applies, between `fork` and `exec`:
//!
//! - **Landlock** (Linux 5.13+): the process may read and execute files beneath the paths it is
//!   given read-only (the interpreter and the system's libraries), and do anything beneath its one
//!   writable folder; every other path is refused (`EACCES`), whatever its permissions. Landlock
//!   also keeps it from ptracing processes outside the sandbox and, on Linux 6.12+ (ABI 6), from
//!   signalling them or reaching their abstract Unix sockets.
//! - **seccomp**: no sockets at all (`socket(2)` fails with `EPERM`, so no network, not even
//!   loopback), no new processes (`fork`, `vfork`, `clone` without `CLONE_THREAD`; `clone3` answers
//!   `ENOSYS` so threads fall back to `clone`), no signals to other processes, and none of the
//!   calls that reach beyond the process (`ptrace`, `io_uring`, `bpf`, `perf_event_open`,
//!   namespaces and mounts, keyrings, module loading, `process_vm_*`). Another architecture's
//!   system calls kill the process.
//! - **Resource limits**: CPU seconds, address space, size of a written file, open files, no core
//!   dumps; and a process group of its own so the caller can kill it whole.
//! - **No capabilities**: when the caller is root, the child drops every capability (bounding,
//!   ambient, effective, permitted and inheritable sets) but keeps its user id, so it can still
//!   reach an interpreter installed under a root-only home; Landlock does the path checks.
//!
//! Everything the child does after `fork` is a plain system call on data prepared before it, as
//! code between `fork` and `exec` of a multi-threaded program must be.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Why a sandbox cannot be set up on this machine.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The kernel has no Landlock (older than 5.13, or not enabled with `lsm=...,landlock`).
    #[error(
        "this kernel has no Landlock (Linux 5.13 or later with Landlock enabled is needed to confine \
         the tool's files: {0}); without it the tool would read and write anywhere the rollout can, \
         so it is refused rather than run unconfined"
    )]
    NoLandlock(io::Error),
    /// A path given to the sandbox could not be opened.
    #[error("the sandbox could not open {path}: {error}")]
    Path {
        /// The path.
        path: PathBuf,
        /// Why.
        error: io::Error,
    },
    /// A Landlock call failed.
    #[error("setting up the sandbox failed ({what}): {error}")]
    Landlock {
        /// Which call.
        what: &'static str,
        /// Why.
        error: io::Error,
    },
}

/// The resource limits of a sandboxed process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// CPU seconds (`RLIMIT_CPU`); the kernel kills the process past it.
    pub cpu_seconds: u64,
    /// Address space in bytes (`RLIMIT_AS`): allocations past it fail.
    pub memory_bytes: u64,
    /// Largest file it may write, in bytes (`RLIMIT_FSIZE`).
    pub file_bytes: u64,
    /// Most open file descriptors (`RLIMIT_NOFILE`).
    pub open_files: u64,
}

/// A confinement for child processes: what they may read, where they may write, and their
/// limits. Built once; [`Sandbox::confine`] applies it to each [`Command`].
#[derive(Debug)]
pub struct Sandbox {
    abi: u32,
    read_only: Vec<PathBuf>,
    limits: Limits,
    filter: Vec<libc::sock_filter>,
}

impl Sandbox {
    /// A sandbox whose processes may read and execute beneath `read_only` (paths that do not
    /// exist are skipped) and are held to `limits`. Fails when the kernel lacks Landlock.
    pub fn new(read_only: Vec<PathBuf>, limits: Limits) -> Result<Sandbox, SandboxError> {
        let abi = landlock::abi().map_err(SandboxError::NoLandlock)?;
        Ok(Sandbox {
            abi,
            read_only: read_only.into_iter().filter(|path| path.exists()).collect(),
            limits,
            filter: seccomp::filter(),
        })
    }

    /// The Landlock ABI version of this kernel (1 is Linux 5.13; 6, which also scopes signals
    /// and abstract Unix sockets, is Linux 6.12).
    pub fn landlock_abi(&self) -> u32 {
        self.abi
    }

    /// Makes `command`, when spawned, run confined with `writable` as the one folder it may write
    /// beneath. The Landlock rules are opened now, so a missing folder is an error here, not in
    /// the child.
    pub fn confine(&self, command: &mut Command, writable: &Path) -> Result<(), SandboxError> {
        let ruleset = landlock::ruleset(self.abi, &self.read_only, writable)?;
        let filter = self.filter.clone();
        let limits = self.limits;
        let root = unsafe { libc::geteuid() } == 0;
        command.process_group(0);
        // SAFETY: the closure runs in the child between fork and exec; it makes only system
        // calls, on the ruleset descriptor and the filter prepared above (no allocation, no
        // locks), and reports failure through errno, which fails the spawn.
        unsafe {
            command.pre_exec(move || {
                set_limits(&limits)?;
                if root {
                    drop_capabilities()?;
                }
                check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
                landlock::restrict_self(&ruleset)?;
                seccomp::install(&filter)
            });
        }
        Ok(())
    }
}

fn check(result: libc::c_int) -> io::Result<()> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn set_limits(limits: &Limits) -> io::Result<()> {
    let set = |resource, value: u64| {
        let limit = libc::rlimit {
            rlim_cur: value,
            rlim_max: value,
        };
        check(unsafe { libc::setrlimit(resource, &limit) })
    };
    // The hard CPU limit one second above the soft one: SIGXCPU first, then SIGKILL.
    let cpu = libc::rlimit {
        rlim_cur: limits.cpu_seconds,
        rlim_max: limits.cpu_seconds + 1,
    };
    check(unsafe { libc::setrlimit(libc::RLIMIT_CPU, &cpu) })?;
    set(libc::RLIMIT_AS, limits.memory_bytes)?;
    set(libc::RLIMIT_FSIZE, limits.file_bytes)?;
    set(libc::RLIMIT_NOFILE, limits.open_files)?;
    set(libc::RLIMIT_CORE, 0)
}

/// Empties every capability set of a root process, so exec grants none back.
fn drop_capabilities() -> io::Result<()> {
    // Drop from the bounding set until the kernel says the capability number is past its last.
    for cap in 0..64 {
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } < 0 {
            let error = io::Error::last_os_error();
            if error.raw_os_error() == Some(libc::EINVAL) {
                break;
            }
            return Err(error);
        }
    }
    check(unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) })?;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let data = [
        Data {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        },
        Data {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        },
    ];
    check(unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) } as libc::c_int)
}

/// Landlock through its three system calls (`landlock(7)`).
mod landlock {
    use super::*;

    const CREATE_RULESET_VERSION: u32 = 1;
    const RULE_PATH_BENEATH: libc::c_int = 1;

    const EXECUTE: u64 = 1 << 0;
    const READ_FILE: u64 = 1 << 2;
    const READ_DIR: u64 = 1 << 3;
    /// The rights a rule on a file (not a folder) may carry: execute, write, read, truncate and
    /// device ioctls.
    const FILE_RIGHTS: u64 = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15);
    const SCOPE_ABSTRACT_UNIX_SOCKET: u64 = 1 << 0;
    const SCOPE_SIGNAL: u64 = 1 << 1;

    #[repr(C)]
    struct RulesetAttr {
        handled_access_fs: u64,
        handled_access_net: u64,
        scoped: u64,
    }

    #[repr(C, packed)]
    struct PathBeneathAttr {
        allowed_access: u64,
        parent_fd: i32,
    }

    /// The kernel's Landlock ABI version.
    pub fn abi() -> io::Result<u32> {
        let version = unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                std::ptr::null::<RulesetAttr>(),
                0usize,
                CREATE_RULESET_VERSION,
            )
        };
        if version < 1 {
            Err(io::Error::last_os_error())
        } else {
            Ok(version as u32)
        }
    }

    /// Every filesystem right the kernel's ABI knows: handling a right is what denies it by
    /// default, so a right left out would stay allowed everywhere.
    fn handled_fs(abi: u32) -> u64 {
        let mut rights = (1 << 13) - 1;
        if abi >= 2 {
            rights |= 1 << 13; // refer: moving or linking a file into another folder
        }
        if abi >= 3 {
            rights |= 1 << 14; // truncate
        }
        if abi >= 5 {
            rights |= 1 << 15; // ioctl on devices
        }
        rights
    }

    /// A ruleset allowing read and execute beneath `read_only`, everything beneath `writable`.
    pub fn ruleset(abi: u32, read_only: &[PathBuf], writable: &Path) -> Result<OwnedFd, SandboxError> {
        let handled = handled_fs(abi);
        let attr = RulesetAttr {
            handled_access_fs: handled,
            handled_access_net: 0,
            scoped: if abi >= 6 {
                SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
            } else {
                0
            },
        };
        let fd = unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                &attr,
                std::mem::size_of::<RulesetAttr>(),
                0u32,
            )
        };
        if fd < 0 {
            return Err(SandboxError::Landlock {
                what: "landlock_create_ruleset",
                error: io::Error::last_os_error(),
            });
        }
        // SAFETY: the kernel just returned this descriptor, and nothing else owns it.
        let ruleset = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        for path in read_only {
            add_rule(&ruleset, path, EXECUTE | READ_FILE | READ_DIR)?;
        }
        add_rule(&ruleset, writable, handled)?;
        Ok(ruleset)
    }

    fn add_rule(ruleset: &OwnedFd, path: &Path, rights: u64) -> Result<(), SandboxError> {
        let path_error = |error| SandboxError::Path {
            path: path.to_path_buf(),
            error,
        };
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| path_error(io::Error::from(io::ErrorKind::InvalidInput)))?;
        let fd = unsafe { libc::open(c_path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(path_error(io::Error::last_os_error()));
        }
        // SAFETY: `open` just returned this descriptor.
        let parent = unsafe { OwnedFd::from_raw_fd(fd) };
        let is_dir = std::fs::metadata(path).map_err(path_error)?.is_dir();
        let attr = PathBeneathAttr {
            allowed_access: if is_dir { rights } else { rights & FILE_RIGHTS },
            parent_fd: parent.as_raw_fd(),
        };
        let result = unsafe {
            libc::syscall(
                libc::SYS_landlock_add_rule,
                ruleset.as_raw_fd(),
                RULE_PATH_BENEATH,
                &attr,
                0u32,
            )
        };
        if result < 0 {
            return Err(SandboxError::Landlock {
                what: "landlock_add_rule",
                error: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Enforces `ruleset` on the calling process (which must have `no_new_privs` set).
    pub fn restrict_self(ruleset: &OwnedFd) -> io::Result<()> {
        let result = unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset.as_raw_fd(), 0u32) };
        check(result as libc::c_int)
    }
}

/// The seccomp filter, a classic BPF program over `struct seccomp_data`.
mod seccomp {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    const AUDIT_ARCH: u32 = 0xC000_003E;
    #[cfg(target_arch = "aarch64")]
    const AUDIT_ARCH: u32 = 0xC000_00B7;

    /// Offsets into `struct seccomp_data`: the call number, the architecture, the first
    /// argument's low half (little-endian).
    const NR: u32 = 0;
    const ARCH: u32 = 4;
    const ARG0: u32 = 16;

    const LD_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const JGE: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
    const JSET: u16 = (libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K) as u16;
    const RET: u16 = (libc::BPF_RET | libc::BPF_K) as u16;

    /// Calls refused with `EPERM`.
    const DENIED: &[libc::c_long] = &[
        libc::SYS_socket,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_kill,
        libc::SYS_tkill,
        libc::SYS_tgkill,
        libc::SYS_rt_sigqueueinfo,
        libc::SYS_rt_tgsigqueueinfo,
        libc::SYS_pidfd_open,
        libc::SYS_pidfd_send_signal,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_kexec_load,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_fork,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_vfork,
    ];

    enum Target {
        Next,
        Allow,
        Deny,
        NoSys,
        Kill,
        CheckSocket,
        CheckClone,
    }

    /// One instruction with symbolic jump targets, resolved by [`filter`].
    struct Op {
        code: u16,
        k: u32,
        jt: Target,
        jf: Target,
    }

    fn op(code: u16, k: u32) -> Op {
        Op {
            code,
            k,
            jt: Target::Next,
            jf: Target::Next,
        }
    }

    fn jump(code: u16, k: u32, jt: Target, jf: Target) -> Op {
        Op { code, k, jt, jf }
    }

    /// The program: wrong architecture -> kill; a denied call -> `EPERM`; `clone3` -> `ENOSYS`;
    /// `clone` without `CLONE_THREAD` -> `EPERM`; anything else allowed.
    pub fn filter() -> Vec<libc::sock_filter> {
        let mut ops = vec![
            op(LD_ABS, ARCH),
            jump(JEQ, AUDIT_ARCH, Target::Next, Target::Kill),
            op(LD_ABS, NR),
        ];
        #[cfg(target_arch = "x86_64")]
        ops.push(jump(JGE, 0x4000_0000, Target::Kill, Target::Next)); // the x32 ABI's numbers
        #[cfg(not(target_arch = "x86_64"))]
        let _ = JGE;
        for &nr in DENIED {
            ops.push(jump(JEQ, nr as u32, Target::Deny, Target::Next));
        }
        ops.push(jump(JEQ, libc::SYS_clone3 as u32, Target::NoSys, Target::Next));
        ops.push(jump(
            JEQ,
            libc::SYS_clone as u32,
            Target::CheckClone,
            Target::Next,
        ));
        ops.push(jump(
            JEQ,
            libc::SYS_socketpair as u32,
            Target::CheckSocket,
            Target::Next,
        ));
        ops.push(op(RET, libc::SECCOMP_RET_ALLOW));
        // The argument checks, then the returns they and the dispatch above jump to: classic BPF
        // jumps only forward.
        // socketpair makes a connected pair of Unix sockets that reach nothing outside: allowed
        // for AF_UNIX only.
        let check_socket = ops.len();
        ops.push(op(LD_ABS, ARG0));
        ops.push(jump(JEQ, libc::AF_UNIX as u32, Target::Allow, Target::Deny));
        // clone's flags are its first argument on x86_64 and aarch64.
        let check_clone = ops.len();
        ops.push(op(LD_ABS, ARG0));
        ops.push(jump(JSET, libc::CLONE_THREAD as u32, Target::Allow, Target::Deny));
        let allow = ops.len();
        ops.push(op(RET, libc::SECCOMP_RET_ALLOW));
        let deny = ops.len();
        ops.push(op(RET, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32));
        let nosys = ops.len();
        ops.push(op(RET, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32));
        let kill = ops.len();
        ops.push(op(RET, libc::SECCOMP_RET_KILL_PROCESS));

        let resolve = |at: usize, target: &Target| -> u8 {
            let to = match target {
                Target::Next => at + 1,
                Target::Allow => allow,
                Target::Deny => deny,
                Target::NoSys => nosys,
                Target::Kill => kill,
                Target::CheckSocket => check_socket,
                Target::CheckClone => check_clone,
            };
            u8::try_from(to - at - 1).expect("seccomp jumps are short and forward")
        };
        ops.iter()
            .enumerate()
            .map(|(at, op)| libc::sock_filter {
                code: op.code,
                jt: resolve(at, &op.jt),
                jf: resolve(at, &op.jf),
                k: op.k,
            })
            .collect()
    }

    /// Installs `filter` on the calling thread (which must have `no_new_privs` set).
    pub fn install(filter: &[libc::sock_filter]) -> io::Result<()> {
        let program = libc::sock_fprog {
            len: filter.len() as u16,
            filter: filter.as_ptr() as *mut libc::sock_filter,
        };
        let result = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0u32,
                &program as *const libc::sock_fprog,
            )
        };
        check(result as libc::c_int)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn every_jump_lands_inside_the_program() {
            let program = filter();
            for (at, ins) in program.iter().enumerate() {
                if ins.code & 0x07 == libc::BPF_JMP as u16 {
                    assert!(at + 1 + (ins.jt as usize) < program.len());
                    assert!(at + 1 + (ins.jf as usize) < program.len());
                }
            }
        }
    }
}
