//! The buffers a plain `get` receives into (and a same-node get gathers
//! scattered rows into), reused: a result's buffer comes back here when
//! Python lets go of the last array over it, and the next get of a size it
//! fits takes it, already resident.
//!
//! Why: a get into fresh memory is bound by the kernel handing out pages
//! (zeroing them, and for huge pages compacting memory first), not by the
//! socket. On a 2-vCPU benchmark machine a 2 GiB get through the core ran
//! at 0.44-2.56 GB/s into fresh buffers against 3.4-3.9 into a reused one;
//! on another, 1 GiB at a median of 2.33-2.79 GB/s fresh (0.76 at worst)
//! against 3.01-3.02 reused (`bench/get_reuse.py`; `docs/benchmarks.md`,
//! "Reused get buffers"). A training loop gets
//! the same shapes every step, so the buffer of step k is the one step k+1
//! needs.
//!
//! Bounds: only buffers of at least [`MIN_POOLED`] bytes are kept, at most
//! `STOWAGE_RECEIVE_POOL_BYTES` in all (read on each use; default an
//! eighth of physical memory, at most 4 GiB; 0 keeps nothing), and a buffer
//! nobody took for [`IDLE`] is freed at the next get or release. A buffer is
//! given to a get only if it is at most twice the size asked, so a small get
//! never pins a large buffer. Every byte a get hands out was written by that
//! get's reply (the buffer is covered by its places exactly), so nothing of
//! an earlier result shows through.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Smallest buffer worth keeping: below this, the allocator's own reuse is
/// as good.
pub const MIN_POOLED: usize = 1 << 20;

/// How long a buffer may wait for a get before it is freed.
pub const IDLE: Duration = Duration::from_secs(10);

struct Pool {
    /// (buffer, when it came back); every buffer's `len` bytes are written.
    free: Vec<(Vec<u8>, Instant)>,
    bytes: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    free: Vec::new(),
    bytes: 0,
});

/// `STOWAGE_RECEIVE_POOL_BYTES`, or an eighth of physical memory (at most
/// 4 GiB).
fn cap() -> usize {
    if let Some(v) = std::env::var_os("STOWAGE_RECEIVE_POOL_BYTES") {
        return v.to_str().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
    }
    // SAFETY: sysconf only reads system configuration.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let total = (pages.max(0) as usize).saturating_mul(page.max(0) as usize);
    (total / 8).min(4 << 30)
}

impl Pool {
    fn expire(&mut self, now: Instant) {
        let bytes = &mut self.bytes;
        self.free.retain(|(b, since)| {
            let keep = now.duration_since(*since) < IDLE;
            if !keep {
                *bytes -= b.len();
            }
            keep
        });
    }
}

/// A buffer of `len` bytes to receive into: a pooled one that fits (the
/// smallest of at most twice `len`), else a fresh zeroed one (with `fresh`
/// called on it, e.g. to ask for huge pages).
pub fn take(len: usize, fresh: impl FnOnce(&[u8])) -> Vec<u8> {
    if len >= MIN_POOLED {
        let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
        pool.expire(Instant::now());
        let best = (pool.free.iter().enumerate())
            .filter(|(_, (b, _))| b.len() >= len && b.len() / 2 <= len)
            .min_by_key(|(_, (b, _))| b.len())
            .map(|(i, _)| i);
        if let Some(i) = best {
            let (mut buf, _) = pool.free.swap_remove(i);
            pool.bytes -= buf.len();
            buf.truncate(len);
            return buf;
        }
    }
    let buf = if len >= MIN_POOLED {
        // Zeroed by calloc: fresh pages from the kernel, not written here.
        vec![0u8; len]
    } else {
        // A small one from glibc's per-thread cache, then zeroed (a zeroed
        // allocation is served past that cache).
        #[expect(clippy::slow_vector_initialization, reason = "not a zeroed allocation")]
        let mut buf = Vec::with_capacity(len);
        buf.resize(len, 0u8);
        buf
    };
    fresh(&buf);
    buf
}

/// Takes back a buffer Python no longer uses, if it is worth keeping and
/// fits under the cap.
pub fn give(buf: Vec<u8>) {
    if buf.len() < MIN_POOLED {
        return;
    }
    let cap = cap();
    let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    pool.expire(now);
    if pool.bytes + buf.len() <= cap {
        pool.bytes += buf.len();
        pool.free.push((buf, now));
    }
}

/// Frees every pooled buffer now; the bytes they held.
pub fn release() -> usize {
    let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
    let bytes = pool.bytes;
    pool.free.clear();
    pool.bytes = 0;
    bytes
}

/// With `STOWAGE_HUGE_PAGES=1`, asks for transparent huge pages under a
/// large fresh buffer (`MADV_HUGEPAGE`); by default it does not.
///
/// Why off: on the benchmark machine (a Firecracker VM whose free memory
/// goes back to the host) a fresh 1 GiB get through the core ran at
/// 0.10-0.13 GB/s with the hint when the process started after a few idle
/// seconds, against 1.36-1.69 without: huge pages then come from memory
/// the host took back and must fault in again. Only back to back, in
/// memory just freed, did the hint win (2.0-3.8 GB/s against 0.74-1.68),
/// and there the receive pool ([`pool`]) hands out a resident buffer
/// anyway (docs/benchmarks.md, "Huge pages for fresh get buffers").
pub fn huge_pages(buf: &[u8]) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| std::env::var_os("STOWAGE_HUGE_PAGES").is_some_and(|v| v == "1")) {
        return;
    }
    const HUGE: usize = 2 << 20;
    let start = (buf.as_ptr() as usize).next_multiple_of(HUGE);
    let end = (buf.as_ptr() as usize + buf.len()) / HUGE * HUGE;
    if end > start {
        // SAFETY: the range lies inside `buf`'s allocation; MADV_HUGEPAGE
        // changes how its pages are backed, never their contents.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}
