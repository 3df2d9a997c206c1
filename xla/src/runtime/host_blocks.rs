//! Reuse of the XLA CPU plugin's large host allocations.
//!
//! XLA CPU takes every temporary of a program run as one allocation (gigabytes for a learner
//! pass) from `posix_memalign`, and frees it when the run ends. glibc maps allocations that
//! large with `mmap` and unmaps them on `free`, so each run faults the whole block in again and
//! the kernel zeroes every page of it (the cost is measured in BENCHMARKS.md, "Learner").
//!
//! This module keeps those blocks instead. When the CPU plugin is loaded, [`install`] points
//! the plugin's own imports of `posix_memalign`, `free` and `realloc` (its global offset table
//! entries, nothing else in the process) at the functions here:
//!
//! - a request of [`MIN_BLOCK`] bytes or more (alignment up to 2 MiB) gets the smallest idle
//!   block that holds it and is at most twice its size, or else a new anonymous mapping
//!   rounded up to 2 MiB and advised for transparent huge pages;
//! - `free` of one of these blocks marks it idle; anything else goes to the C library;
//! - idle blocks are kept up to twice the most bytes the plugin ever had in use in these blocks
//!   at once (room for each program's temporaries, which take differently sized blocks; never
//!   more than a small multiple of what the programs needed at their peak); beyond that the
//!   least recently freed are unmapped.
//!
//! A run's next program is often dispatched as the previous one finishes, a moment before that
//! one frees its temporaries. A request of [`WAIT_FROM`] bytes or more that a busy block could
//! serve therefore waits up to [`WAIT_FOR`] for a block to be freed before mapping a new one;
//! when the wait times out (the programs really need both at once, e.g. one per device), that
//! size never waits again.
//!
//! The blocks' memory is never handed back to the C library, only to the kernel, and only
//! plugin code sees it; programs never rely on fresh temporaries being zero. Setting
//! [`DISABLE_ENV`] to `0` before the plugin loads leaves the plugin's allocator alone.

use std::ffi::{c_int, c_void, CStr};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Requests from this size on are served from the cache.
pub const MIN_BLOCK: usize = 16 << 20;

/// Requests from this size on may wait for a busy block to be freed.
pub const WAIT_FROM: usize = 256 << 20;

/// How long such a request waits.
pub const WAIT_FOR: Duration = Duration::from_millis(50);

/// `GRPO_CPU_BLOCK_CACHE=0` (read when the CPU plugin loads) turns the cache off.
pub const DISABLE_ENV: &str = "GRPO_CPU_BLOCK_CACHE";

/// Blocks are whole 2 MiB (huge) pages.
const HUGE_PAGE: usize = 2 << 20;

/// What the cache has done since the process started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockStats {
    /// Blocks mapped fresh from the kernel.
    pub mapped: u64,
    /// Requests served by an idle block.
    pub reused: u64,
    /// Idle blocks unmapped to stay within the idle limit.
    pub unmapped: u64,
    /// Requests that waited for a busy block, and of those the ones that timed out.
    pub waits: u64,
    pub timeouts: u64,
    /// Bytes mapped now (busy and idle).
    pub held_bytes: usize,
    /// Bytes in use by the plugin now.
    pub busy_bytes: usize,
    /// The most bytes in use at once so far (twice this is the idle limit).
    pub peak_busy_bytes: usize,
}

#[derive(Debug)]
struct Block {
    addr: usize,
    len: usize,
    busy: bool,
    /// When it was last freed (a counter), for least-recently-freed eviction.
    freed_at: u64,
}

/// The blocks and the rules for handing them out; addresses are plain numbers here, so the
/// rules are testable without mapping anything.
#[derive(Debug)]
struct Pool {
    blocks: Vec<Block>,
    clock: u64,
    /// Request lengths whose wait timed out: they map at once from then on.
    concurrent: Vec<usize>,
    /// The counters of [`BlockStats`]; the byte totals are read off `blocks`.
    mapped: u64,
    reused: u64,
    unmapped: u64,
    waits: u64,
    timeouts: u64,
    peak_busy_bytes: usize,
}

impl Pool {
    const fn new() -> Pool {
        Pool {
            blocks: Vec::new(),
            clock: 0,
            concurrent: Vec::new(),
            mapped: 0,
            reused: 0,
            unmapped: 0,
            waits: 0,
            timeouts: 0,
            peak_busy_bytes: 0,
        }
    }

    fn bytes(&self, busy: bool) -> usize {
        self.blocks.iter().filter(|b| b.busy == busy).map(|b| b.len).sum()
    }

    fn stats(&self) -> BlockStats {
        let busy_bytes = self.bytes(true);
        BlockStats {
            mapped: self.mapped,
            reused: self.reused,
            unmapped: self.unmapped,
            waits: self.waits,
            timeouts: self.timeouts,
            held_bytes: busy_bytes + self.bytes(false),
            busy_bytes,
            peak_busy_bytes: self.peak_busy_bytes,
        }
    }

    /// The smallest idle block of `len` to `2 len` bytes, now busy (a small buffer that lives
    /// long must not pin a large block of touched pages).
    fn take_idle(&mut self, len: usize) -> Option<usize> {
        let best = self
            .blocks
            .iter_mut()
            .filter(|b| !b.busy && b.len >= len && b.len / 2 <= len)
            .min_by_key(|b| b.len)?;
        best.busy = true;
        let addr = best.addr;
        self.reused += 1;
        self.note_busy();
        Some(addr)
    }

    /// Whether a request of `len` bytes should wait for a busy block rather than map one.
    fn should_wait(&self, len: usize) -> bool {
        len >= WAIT_FROM
            && !self.concurrent.contains(&len)
            && self.blocks.iter().any(|b| b.busy && b.len >= len)
    }

    /// Records a freshly mapped busy block.
    fn add(&mut self, addr: usize, len: usize) {
        self.blocks.push(Block {
            addr,
            len,
            busy: true,
            freed_at: 0,
        });
        self.mapped += 1;
        self.note_busy();
    }

    fn note_busy(&mut self) {
        self.peak_busy_bytes = self.peak_busy_bytes.max(self.bytes(true));
    }

    /// The length of the busy block at `addr`, if it is one.
    fn busy_len(&self, addr: usize) -> Option<usize> {
        self.blocks
            .iter()
            .find(|b| b.busy && b.addr == addr)
            .map(|b| b.len)
    }

    /// Marks the busy block at `addr` idle and returns the idle blocks to unmap (least
    /// recently freed first) so that idle bytes stay within twice the peak of busy bytes; `None`
    /// when `addr` is not a busy block of the pool.
    fn release(&mut self, addr: usize) -> Option<Vec<(usize, usize)>> {
        self.clock += 1;
        let clock = self.clock;
        let block = self.blocks.iter_mut().find(|b| b.busy && b.addr == addr)?;
        block.busy = false;
        block.freed_at = clock;
        let mut idle = self.bytes(false);
        let mut evict = Vec::new();
        while idle > 2 * self.peak_busy_bytes {
            let oldest = self
                .blocks
                .iter()
                .enumerate()
                .filter(|(_, b)| !b.busy)
                .min_by_key(|(_, b)| b.freed_at)
                .map(|(i, _)| i)
                .expect("idle bytes come from idle blocks");
            let b = self.blocks.swap_remove(oldest);
            idle -= b.len;
            self.unmapped += 1;
            evict.push((b.addr, b.len));
        }
        Some(evict)
    }
}

static POOL: Mutex<Pool> = Mutex::new(Pool::new());
static FREED: Condvar = Condvar::new();
/// The address range the pool's blocks have ever occupied: a pointer outside it is not ours,
/// so most `free` calls never take the lock.
static LOW: AtomicUsize = AtomicUsize::new(usize::MAX);
static HIGH: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

fn pool() -> MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// The cache's counters (all zero when it is not installed).
pub fn stats() -> BlockStats {
    pool().stats()
}

/// Whether the CPU plugin's large allocations go through the cache in this process.
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Acquire)
}

fn maybe_ours(addr: usize) -> bool {
    addr >= LOW.load(Ordering::Acquire) && addr < HIGH.load(Ordering::Acquire)
}

/// Maps `len` bytes (a multiple of 2 MiB) at a 2 MiB boundary, advised for huge pages.
fn map_block(len: usize) -> Option<usize> {
    let span = len + HUGE_PAGE;
    // SAFETY: an anonymous private mapping; the parts outside the aligned block are unmapped.
    unsafe {
        let raw = libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if raw == libc::MAP_FAILED {
            return None;
        }
        let start = raw as usize;
        let addr = start.next_multiple_of(HUGE_PAGE);
        if addr > start {
            libc::munmap(raw, addr - start);
        }
        let tail = start + span - (addr + len);
        if tail > 0 {
            libc::munmap((addr + len) as *mut c_void, tail);
        }
        libc::madvise(addr as *mut c_void, len, libc::MADV_HUGEPAGE);
        LOW.fetch_min(addr, Ordering::AcqRel);
        HIGH.fetch_max(addr + len, Ordering::AcqRel);
        Some(addr)
    }
}

fn unmap(blocks: Vec<(usize, usize)>) {
    for (addr, len) in blocks {
        // SAFETY: the block was mapped by `map_block` and nothing uses it any more.
        unsafe { libc::munmap(addr as *mut c_void, len) };
    }
}

/// A block of at least `size` bytes, or `None` when the kernel has no memory for one.
fn acquire(size: usize) -> Option<usize> {
    let len = size.next_multiple_of(HUGE_PAGE);
    let mut pool = pool();
    let mut waited = false;
    loop {
        if let Some(addr) = pool.take_idle(len) {
            return Some(addr);
        }
        if waited || !pool.should_wait(len) {
            break;
        }
        waited = true;
        pool.waits += 1;
        let (guard, result) = FREED
            .wait_timeout(pool, WAIT_FOR)
            .unwrap_or_else(|poison| poison.into_inner());
        pool = guard;
        if result.timed_out() {
            pool.timeouts += 1;
            pool.concurrent.push(len);
        }
    }
    drop(pool);
    let addr = map_block(len)?;
    self::pool().add(addr, len);
    Some(addr)
}

/// Gives a block back; false when `addr` is not one of ours.
fn release(addr: usize) -> bool {
    if !maybe_ours(addr) {
        return false;
    }
    let Some(evict) = pool().release(addr) else {
        return false;
    };
    FREED.notify_all();
    unmap(evict);
    true
}

unsafe extern "C" fn cached_posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
    if size >= MIN_BLOCK && align.is_power_of_two() && align <= HUGE_PAGE {
        if let Some(addr) = acquire(size) {
            // SAFETY: the caller passes a valid out pointer, as posix_memalign requires.
            unsafe { *out = addr as *mut c_void };
            return 0;
        }
    }
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { libc::posix_memalign(out, align, size) }
}

unsafe extern "C" fn cached_free(ptr: *mut c_void) {
    if !ptr.is_null() && !release(ptr as usize) {
        // SAFETY: not one of ours, so it came from the C library.
        unsafe { libc::free(ptr) }
    }
}

unsafe extern "C" fn cached_realloc(ptr: *mut c_void, size: usize) -> *mut c_void {
    let owned = if ptr.is_null() || !maybe_ours(ptr as usize) {
        None
    } else {
        pool().busy_len(ptr as usize)
    };
    let Some(len) = owned else {
        // SAFETY: not one of ours, so it came from the C library.
        return unsafe { libc::realloc(ptr, size) };
    };
    if size == 0 {
        release(ptr as usize);
        return std::ptr::null_mut();
    }
    if size <= len {
        return ptr;
    }
    // SAFETY: a fresh C allocation of `size` > `len` bytes receives the block's `len` bytes.
    unsafe {
        let moved = libc::malloc(size);
        if moved.is_null() {
            return moved;
        }
        std::ptr::copy_nonoverlapping(ptr as *const u8, moved as *mut u8, len);
        release(ptr as usize);
        moved
    }
}

type PosixMemalign = unsafe extern "C" fn(*mut *mut c_void, usize, usize) -> c_int;
type Free = unsafe extern "C" fn(*mut c_void);
type Realloc = unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;

/// Why [`install`] left the plugin's allocator alone.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{DISABLE_ENV}=0")]
    Disabled,
    #[error("only x86_64 and aarch64 Linux are supported")]
    Unsupported,
    #[error("{0} is not a loaded shared object")]
    NotLoaded(String),
    #[error("its dynamic section lacks {0}")]
    Malformed(&'static str),
    #[error("it imports none of posix_memalign, free and realloc")]
    NoImports,
}

/// Points the loaded CPU plugin at `path` (the path it was loaded from) at the cache; returns
/// how many import slots it rewrote. Call it once, right after loading the plugin and before
/// creating a client (no plugin thread may be allocating while the slots change).
pub fn install(path: &Path) -> Result<usize, InstallError> {
    if std::env::var(DISABLE_ENV).is_ok_and(|v| v.trim() == "0") {
        return Err(InstallError::Disabled);
    }
    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let object = elf::find_loaded(path)?;
        // SAFETY: `object` describes a shared object the dynamic loader has mapped; the slots
        // written are its relocated import slots for these three functions, and the functions
        // written there have the C library's signatures.
        let patched = unsafe {
            elf::patch_imports(
                &object,
                &[
                    (c"posix_memalign", cached_posix_memalign as PosixMemalign as usize),
                    (c"free", cached_free as Free as usize),
                    (c"realloc", cached_realloc as Realloc as usize),
                ],
            )?
        };
        if patched == 0 {
            return Err(InstallError::NoImports);
        }
        INSTALLED.store(true, Ordering::Release);
        Ok(patched)
    }
    #[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
    {
        let _ = path;
        Err(InstallError::Unsupported)
    }
}

/// Just enough of the ELF dynamic-linking structures to rewrite a loaded object's import slots.
#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
mod elf {
    use super::{CStr, InstallError, Path};
    use std::ffi::c_void;
    use std::os::unix::ffi::OsStrExt;

    const DT_NULL: i64 = 0;
    const DT_PLTRELSZ: i64 = 2;
    const DT_STRTAB: i64 = 5;
    const DT_SYMTAB: i64 = 6;
    const DT_RELA: i64 = 7;
    const DT_RELASZ: i64 = 8;
    const DT_JMPREL: i64 = 23;

    #[cfg(target_arch = "x86_64")]
    const SLOT_TYPES: [u32; 3] = [1, 6, 7]; // R_X86_64_64, GLOB_DAT, JUMP_SLOT
    #[cfg(target_arch = "aarch64")]
    const SLOT_TYPES: [u32; 3] = [257, 1025, 1026]; // R_AARCH64_ABS64, GLOB_DAT, JUMP_SLOT

    #[repr(C)]
    struct Dyn {
        tag: i64,
        val: u64,
    }

    #[repr(C)]
    struct Rela {
        offset: u64,
        info: u64,
        addend: i64,
    }

    #[repr(C)]
    struct Sym {
        name: u32,
        info: u8,
        other: u8,
        shndx: u16,
        value: u64,
        size: u64,
    }

    /// A loaded object: its load bias, dynamic section and read-only-after-relocation range.
    pub(super) struct Loaded {
        base: usize,
        dynamic: usize,
        relro: Option<(usize, usize)>,
    }

    pub(super) fn find_loaded(path: &Path) -> Result<Loaded, InstallError> {
        struct Search<'a> {
            name: &'a [u8],
            found: Option<Loaded>,
        }
        unsafe extern "C" fn visit(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> i32 {
            // SAFETY: the loader passes valid entries; `data` is our `Search`.
            unsafe {
                let search = &mut *(data as *mut Search);
                let info = &*info;
                if info.dlpi_name.is_null() || CStr::from_ptr(info.dlpi_name).to_bytes() != search.name {
                    return 0;
                }
                let base = info.dlpi_addr as usize;
                let headers = std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize);
                let dynamic = headers
                    .iter()
                    .find(|h| h.p_type == libc::PT_DYNAMIC)
                    .map(|h| base + h.p_vaddr as usize);
                let relro = headers
                    .iter()
                    .find(|h| h.p_type == libc::PT_GNU_RELRO)
                    .map(|h| (base + h.p_vaddr as usize, base + (h.p_vaddr + h.p_memsz) as usize));
                if let Some(dynamic) = dynamic {
                    search.found = Some(Loaded { base, dynamic, relro });
                }
                1
            }
        }
        let mut search = Search {
            name: path.as_os_str().as_bytes(),
            found: None,
        };
        // SAFETY: `visit` only reads the entries and writes `search`.
        unsafe { libc::dl_iterate_phdr(Some(visit), &mut search as *mut Search as *mut c_void) };
        search
            .found
            .ok_or_else(|| InstallError::NotLoaded(path.display().to_string()))
    }

    /// Rewrites every import slot of `object` bound to one of `hooks`' names; returns how many.
    ///
    /// # Safety
    /// `object` must be a loaded object and each hook a function with the C signature of the
    /// symbol it replaces.
    pub(super) unsafe fn patch_imports(
        object: &Loaded,
        hooks: &[(&CStr, usize)],
    ) -> Result<usize, InstallError> {
        // Entries of the dynamic section are relocated in place by glibc on these targets; an
        // unrelocated one (a plain offset) is below the load bias.
        let absolute = |v: u64| {
            let v = v as usize;
            if v < object.base {
                object.base + v
            } else {
                v
            }
        };
        let (mut strtab, mut symtab) = (None, None);
        // (address, bytes) of the relocation tables: DT_RELA and the PLT's DT_JMPREL.
        let (mut rela, mut jmprel) = ((None, None), (None, None));
        // SAFETY (whole block): reads of the loaded object's dynamic-linking tables, which the
        // loader keeps mapped, and writes of its import slots.
        unsafe {
            let mut entry = object.dynamic as *const Dyn;
            while (*entry).tag != DT_NULL {
                let (tag, val) = ((*entry).tag, (*entry).val);
                match tag {
                    DT_STRTAB => strtab = Some(absolute(val)),
                    DT_SYMTAB => symtab = Some(absolute(val)),
                    DT_RELA => rela.0 = Some(absolute(val)),
                    DT_RELASZ => rela.1 = Some(val as usize),
                    DT_JMPREL => jmprel.0 = Some(absolute(val)),
                    DT_PLTRELSZ => jmprel.1 = Some(val as usize),
                    _ => {}
                }
                entry = entry.add(1);
            }
            let strtab = strtab.ok_or(InstallError::Malformed("DT_STRTAB"))?;
            let symtab = symtab.ok_or(InstallError::Malformed("DT_SYMTAB"))?;
            let mut patched = 0;
            for (start, bytes) in [rela, jmprel] {
                let (Some(start), Some(bytes)) = (start, bytes) else {
                    continue;
                };
                let relas =
                    std::slice::from_raw_parts(start as *const Rela, bytes / std::mem::size_of::<Rela>());
                for rela in relas {
                    let kind = (rela.info & 0xffff_ffff) as u32;
                    let index = (rela.info >> 32) as usize;
                    if index == 0
                        || !SLOT_TYPES.contains(&kind)
                        || (kind == SLOT_TYPES[0] && rela.addend != 0)
                    {
                        continue;
                    }
                    let sym = &*(symtab as *const Sym).add(index);
                    let name = CStr::from_ptr((strtab + sym.name as usize) as *const libc::c_char);
                    let Some(&(_, hook)) = hooks.iter().find(|(n, _)| *n == name) else {
                        continue;
                    };
                    write_slot(object, object.base + rela.offset as usize, hook);
                    patched += 1;
                }
            }
            Ok(patched)
        }
    }

    /// Writes `value` into the pointer-sized slot at `addr`, lifting the read-only protection
    /// of the relocated-data range for the write.
    unsafe fn write_slot(object: &Loaded, addr: usize, value: usize) {
        let page = 4096;
        let first = addr & !(page - 1);
        let read_only = object.relro.is_some_and(|(lo, hi)| addr >= lo && addr < hi);
        // SAFETY: `addr` is an import slot of a loaded object; its page stays mapped.
        unsafe {
            if read_only {
                libc::mprotect(first as *mut c_void, page, libc::PROT_READ | libc::PROT_WRITE);
            }
            std::ptr::write_volatile(addr as *mut usize, value);
            if read_only {
                libc::mprotect(first as *mut c_void, page, libc::PROT_READ);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: usize = 1 << 30;

    #[test]
    fn an_idle_block_serves_the_next_request_and_the_smallest_that_fits_is_taken() {
        let mut pool = Pool::new();
        pool.add(0x1000_0000, GB);
        pool.add(0x9000_0000, 2 * GB);
        assert_eq!(pool.release(0x1000_0000), Some(vec![]));
        assert_eq!(pool.release(0x9000_0000), Some(vec![]));
        assert_eq!(
            pool.take_idle(GB / 4),
            None,
            "a block more than twice the request is not used"
        );
        assert_eq!(pool.take_idle(GB), Some(0x1000_0000));
        assert_eq!(pool.take_idle(GB), Some(0x9000_0000));
        assert_eq!(pool.take_idle(GB), None);
        let stats = pool.stats();
        assert_eq!((stats.reused, stats.mapped), (2, 2));
        assert_eq!((stats.busy_bytes, stats.held_bytes), (3 * GB, 3 * GB));
        assert_eq!(stats.peak_busy_bytes, 3 * GB);
    }

    #[test]
    fn idle_blocks_stay_within_the_peak_in_use_and_the_oldest_go_first() {
        let mut pool = Pool::new();
        // One program at a time: 1 GB, 2 GB, then 4 GB; the peak in use is 4 GB.
        pool.add(0x1000_0000, GB);
        assert_eq!(pool.release(0x1000_0000), Some(vec![]));
        pool.add(0x5000_0000, 2 * GB);
        assert_eq!(pool.release(0x5000_0000), Some(vec![]));
        pool.add(0x9000_0000, 4 * GB);
        assert_eq!(pool.stats().peak_busy_bytes, 4 * GB);
        // 7 GB idle after it is freed, within 2 x 4 GB: all three stay.
        assert_eq!(pool.release(0x9000_0000), Some(vec![]));
        // A 6 GB program raises the peak to 6 GB; freeing it makes 13 GB idle against a limit
        // of 12 GB: the 1 GB block, freed first, is unmapped.
        pool.add(0xf000_0000, 6 * GB);
        assert_eq!(pool.release(0xf000_0000), Some(vec![(0x1000_0000, GB)]));
        assert_eq!(pool.stats().held_bytes, 12 * GB);
        assert_eq!(pool.stats().unmapped, 1);
        assert_eq!(pool.take_idle(3 * GB), Some(0x9000_0000));
    }

    #[test]
    fn unknown_and_already_free_addresses_are_not_the_pools() {
        let mut pool = Pool::new();
        pool.add(0x1000_0000, GB);
        assert_eq!(pool.release(0x2000_0000), None);
        assert_eq!(pool.busy_len(0x1000_0000), Some(GB));
        assert!(pool.release(0x1000_0000).is_some());
        assert_eq!(
            pool.release(0x1000_0000),
            None,
            "a double free is not taken as ours"
        );
        assert_eq!(pool.busy_len(0x1000_0000), None);
    }

    #[test]
    fn only_large_requests_that_a_busy_block_could_serve_wait_and_a_timed_out_size_never_again() {
        let mut pool = Pool::new();
        pool.add(0x1000_0000, GB);
        assert!(pool.should_wait(GB));
        assert!(!pool.should_wait(2 * GB), "no busy block is large enough");
        assert!(!pool.should_wait(WAIT_FROM / 2), "small requests map at once");
        pool.concurrent.push(GB);
        assert!(!pool.should_wait(GB));
    }

    #[test]
    fn blocks_are_mapped_on_huge_page_boundaries_and_returned() {
        let addr = map_block(4 * HUGE_PAGE).expect("mmap");
        assert_eq!(addr % HUGE_PAGE, 0);
        // SAFETY: the block is ours and 8 MiB long.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 7, 4 * HUGE_PAGE) };
        assert!(maybe_ours(addr) && maybe_ours(addr + 4 * HUGE_PAGE - 1));
        unmap(vec![(addr, 4 * HUGE_PAGE)]);
    }
}
