//! What `stowd` asks of the operating system about itself: its resident
//! set size, giving freed heap back (`malloc_trim`), when it started, the
//! size of a file system (`statvfs`), and that no other process of its
//! user may read or write its memory ([`forbid_same_user_access`]). The
//! one place that reads `/proc` or calls into libc for these; a leaf
//! module, importing nothing from the crate.

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

/// Size in bytes of the file system holding `path` (`statvfs`: blocks
/// times fragment size), `None` if it cannot be read.
pub fn fs_size(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path alive for the call; statvfs
    // writes the whole struct on success, and it is read only then.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    // u64 here; narrower on 32-bit targets.
    #[allow(clippy::useless_conversion)]
    let (blocks, frsize) = (u64::from(st.f_blocks), u64::from(st.f_frsize));
    Some(blocks.saturating_mul(frsize))
}

/// The machine's memory, `MemTotal` (`/proc/meminfo`); `None` if it cannot
/// be read. (Also the most `memfd` segments can take.)
pub fn mem_total() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// The memory this process may use: the machine's `MemTotal`, or its
/// cgroup's limit when lower (v2 `memory.max`, v1
/// `memory.limit_in_bytes`), and which it is.
pub fn memory_limit() -> (Option<u64>, &'static str) {
    let total = mem_total();
    let cgroup = cgroup_memory_limit();
    match (total, cgroup) {
        (Some(t), Some(c)) if c < t => (Some(c), "the cgroup's memory limit"),
        (Some(t), _) => (Some(t), "MemTotal"),
        (None, c) => (c, "the cgroup's memory limit"),
    }
}

/// The memory limit of this process's cgroup, if one is set and readable.
fn cgroup_memory_limit() -> Option<u64> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut candidates = Vec::new();
    for line in groups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        if controllers.is_empty() {
            candidates.push(format!("/sys/fs/cgroup/{path}/memory.max"));
            candidates.push("/sys/fs/cgroup/memory.max".into());
        } else if controllers.split(',').any(|c| c == "memory") {
            candidates.push(format!(
                "/sys/fs/cgroup/memory/{path}/memory.limit_in_bytes"
            ));
            candidates.push("/sys/fs/cgroup/memory/memory.limit_in_bytes".into());
        }
    }
    candidates.iter().find_map(|p| {
        let text = std::fs::read_to_string(p).ok()?;
        // "max" (v2) or a page-rounded i64::MAX (v1): no limit.
        text.trim().parse::<u64>().ok().filter(|&n| n < (1 << 60))
    })
}

/// Raises the soft limit on open descriptors to the hard limit: each live
/// same-node segment and each lease keeps one open. Logs, and goes on, if
/// it cannot. Returns the soft limit now in force (`None`: unlimited).
pub fn raise_nofile() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => {
                tracing::debug!(nofile = ?raised.current, "raised the open-descriptor limit");
                limit = raised;
            }
            Err(e) => tracing::debug!(error = %e, "could not raise the open-descriptor limit"),
        }
    }
    limit.current
}

/// Makes this process non-dumpable (`prctl(PR_SET_DUMPABLE, 0)`), as
/// OpenSSH and gpg-agent do: from then on only root (`CAP_SYS_PTRACE`) may
/// ptrace it or open its `/proc/<pid>/mem`, `fd/`, `maps`, `environ`, and
/// those files belong to root. Without it any process of the same user
/// could rewrite stored rows through `/proc/<pid>/mem`. The process itself
/// keeps its `/proc/self` (the kernel lets a thread group into its own
/// entries). It writes no core dump on a crash (unless the
/// `fs.suid_dumpable` sysctl says otherwise), and a debugger, `perf` or a
/// profiler must attach as root. An `execve` makes a process dumpable
/// again, so only the process that calls this is covered.
pub fn forbid_same_user_access() -> std::io::Result<()> {
    use rustix::process::{DumpableBehavior, set_dumpable_behavior};
    set_dumpable_behavior(DumpableBehavior::NotDumpable)?;
    Ok(())
}

/// When this process started (Linux: `/proc/self/stat` field 22, ticks
/// since boot, against `/proc/uptime`), to about 10 ms; `None` if unknown.
pub fn process_start() -> Option<std::time::SystemTime> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Field 2 (the command) may hold spaces: count from the last ')'.
    let after = &stat[stat.rfind(')')? + 1..];
    let ticks: u64 = after.split_whitespace().nth(19)?.parse().ok()?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    // SAFETY: sysconf reads a constant of the running system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = u64::try_from(hz).ok().filter(|h| *h > 0)?;
    let age = uptime - ticks as f64 / hz as f64;
    std::time::SystemTime::now().checked_sub(std::time::Duration::from_secs_f64(age.max(0.0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_size_of_a_file_system_is_known() {
        let tmp = fs_size(&std::env::temp_dir()).expect("statvfs");
        assert!(tmp > 1 << 20, "{tmp}");
        assert_eq!(fs_size(std::path::Path::new("/no/such/dir")), None);
    }

    #[test]
    fn the_process_started_before_now_and_after_boot() {
        let started = process_start().expect("process start");
        let now = std::time::SystemTime::now();
        let age = now.duration_since(started).expect("started in the past");
        // The test binary has run for less than an hour.
        assert!(age < std::time::Duration::from_secs(3600), "{age:?}");
        // A file made now is newer than the process.
        let f = std::env::temp_dir().join(format!("sys-start-{}", std::process::id()));
        std::fs::write(&f, b"x").unwrap();
        let m = std::fs::metadata(&f).unwrap().modified().unwrap();
        let _ = std::fs::remove_file(&f);
        // tmpfs times are coarse (a few ms) and the start is known to 10 ms.
        let margin = std::time::Duration::from_millis(100);
        assert!(m + margin > started, "{m:?} vs {started:?}");
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
