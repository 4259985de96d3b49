//! What `stowd` asks of the operating system about itself: its resident
//! set size and giving freed heap back (`malloc_trim`). The one place that
//! reads `/proc` or calls into libc for these; a leaf module, importing
//! nothing from the crate.

/// Resident set size of this process in bytes (Linux), 0 if unknown.
///
/// `/proc/self/statm` counts pages; the page size is `sysconf(_SC_PAGESIZE)`
/// (4 KiB on x86-64, 16 or 64 KiB on some ARM kernels).
pub fn process_rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * page_size()
}

/// The kernel's page size in bytes.
pub fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the running system; no memory is
    // passed.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|s| *s > 0).unwrap_or(4096)
}

/// Hands freed memory at the top of glibc's heaps and in its arenas back to
/// the kernel (`malloc_trim(0)`); returns whether any was released. A
/// no-op returning false where the allocator is not glibc's.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn malloc_trim() -> bool {
    // SAFETY: malloc_trim only walks glibc's own arenas, under their locks.
    unsafe { libc::malloc_trim(0) != 0 }
}

/// Hands freed memory back to the kernel: nothing to do without glibc.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn malloc_trim() -> bool {
    false
}

/// Asks the scheduler for a short time slice for the calling thread
/// (Linux 6.12 and later, EEVDF: `sched_setattr` with `sched_runtime` for a
/// `SCHED_OTHER` thread; no privilege needed, and the thread keeps its
/// nice value). A thread with a shorter slice gets an earlier deadline, so
/// when it wakes it preempts a busy thread of equal priority sooner,
/// instead of waiting out that thread's slice; the CPU share stays the
/// same. The kernel clamps the slice to 0.1-100 ms. An error on older
/// kernels (which ignore or refuse the field) is for the caller to log.
#[cfg(target_os = "linux")]
pub fn request_slice(slice: std::time::Duration) -> std::io::Result<()> {
    /// `struct sched_attr`, `SCHED_ATTR_SIZE_VER1` (56 bytes).
    #[repr(C)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
        util_min: u32,
        util_max: u32,
    }
    // SAFETY: getpriority reads the calling thread's nice value (Linux
    // treats PRIO_PROCESS with who 0 as the calling thread); errno is
    // cleared first because -1 is also a valid nice value.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, 0)
    };
    if nice == -1 && std::io::Error::last_os_error().raw_os_error() != Some(0) {
        return Err(std::io::Error::last_os_error());
    }
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: libc::SCHED_OTHER as u32,
        flags: 0,
        nice,
        priority: 0,
        runtime: u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX),
        deadline: 0,
        period: 0,
        util_min: 0,
        util_max: 0,
    };
    // SAFETY: `attr` is a valid, initialised sched_attr of the size it
    // declares, alive for the call; pid 0 is the calling thread.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Asks for a short time slice: not available off Linux.
#[cfg(not(target_os = "linux"))]
pub fn request_slice(_slice: std::time::Duration) -> std::io::Result<()> {
    Err(std::io::ErrorKind::Unsupported.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_slice_is_granted_and_the_nice_value_kept() {
        // SAFETY: reads the calling thread's nice value.
        let nice_before = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        // On a thread of its own: the slice stays with the thread.
        std::thread::spawn(move || {
            request_slice(std::time::Duration::from_micros(100)).expect("sched_setattr");
            // SAFETY: reads the calling thread's nice value.
            let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            assert_eq!(nice, nice_before);
            // The slice is visible in the thread's scheduler statistics
            // where the kernel exposes them (`se.slice`, in ns).
            let sched = std::fs::read_to_string("/proc/thread-self/sched").unwrap_or_default();
            if let Some(line) = sched.lines().find(|l| l.starts_with("se.slice")) {
                let ns: f64 = line.split(':').nth(1).unwrap().trim().parse().unwrap();
                assert_eq!(ns as u64, 100_000, "{line}");
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn rss_is_a_whole_number_of_pages_and_counts_touched_memory() {
        let page = page_size();
        assert!(page.is_power_of_two() && page >= 4096, "page size {page}");
        let before = process_rss_bytes();
        assert!(before > 0 && before.is_multiple_of(page), "rss {before}");
        // Touch 64 MiB: all of it is resident now (other tests of this
        // binary may free memory meanwhile, so no difference is asserted).
        let block = vec![1u8; 64 << 20];
        let after = process_rss_bytes();
        assert!(
            after >= 64 << 20,
            "rss {before} -> {after} after touching 64 MiB"
        );
        assert_eq!(std::hint::black_box(&block)[block.len() - 1], 1);
        drop(block);
        malloc_trim();
    }
}
