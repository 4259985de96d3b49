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

#[cfg(test)]
mod tests {
    use super::*;

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
