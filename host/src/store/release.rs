//! Gives memory freed by clears and overwrites back to the OS.
//!
//! glibc's malloc keeps freed chunks in its arenas (one per thread that
//! allocated, up to 8 per core) and returns a page to the OS only when the
//! free space sits at the top of an arena's heap above the trim threshold,
//! which rises with every large free. Rows are slices of the frames they
//! arrived in, so frames are freed in whatever order their last rows are
//! cleared: under a steady put/clear load the arenas end up full of free
//! holes, and after everything is cleared `stowd` still held 5 to 10 times
//! the bytes it ever stored (measured: 390 MiB resident for 46 MiB of rows,
//! 48 MiB at start, unchanged after the final clear; `malloc_trim(0)` brought
//! it back to 53 MiB). So a background thread calls `malloc_trim(0)` (which
//! also releases free pages in the middle of the arenas) once frees have
//! stopped for [`QUIET`], or every [`MAX_INTERVAL`] while they go on, and
//! once more [`FOLLOW_UP`] later. Frees only note a byte count; the trim
//! never runs on a request's path (it does hold each arena's lock while it
//! walks it: 1 to 90 ms measured on a 400 MiB debug-build heap).

#[cfg(all(target_os = "linux", target_env = "gnu"))]
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;
#[cfg(all(target_os = "linux", target_env = "gnu"))]
use std::time::Instant;

/// Trim this long after the last free.
pub const QUIET: Duration = Duration::from_millis(200);
/// Trim at least this often while frees go on.
pub const MAX_INTERVAL: Duration = Duration::from_secs(1);
/// And once more this long after the last trim.
pub const FOLLOW_UP: Duration = Duration::from_secs(2);

#[cfg(all(target_os = "linux", target_env = "gnu"))]
struct Pending {
    bytes: u64,
    last_free: Option<Instant>,
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trimmer() -> &'static (Mutex<Pending>, Condvar) {
    static TRIMMER: OnceLock<(Mutex<Pending>, Condvar)> = OnceLock::new();
    TRIMMER.get_or_init(|| {
        let spawned = std::thread::Builder::new().name("stowd-trim".into()).spawn(run);
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no memory-release thread: freed memory stays with the allocator");
        }
        (Mutex::new(Pending { bytes: 0, last_free: None }), Condvar::new())
    })
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn run() {
    let (lock, wake) = trimmer();
    let mut last_trim = Instant::now();
    // One more trim FOLLOW_UP after the frees stopped, for what was
    // freed meanwhile off the store (reply buffers, connections).
    let mut follow_up: Option<Instant> = None;
    let mut pending = lock.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if pending.bytes == 0 {
            match follow_up {
                None => pending = wake.wait(pending).unwrap_or_else(|p| p.into_inner()),
                Some(at) if Instant::now() < at => {
                    pending = wake
                        .wait_timeout(pending, at - Instant::now())
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                Some(_) => {
                    follow_up = None;
                    drop(pending);
                    trim(0);
                    last_trim = Instant::now();
                    pending = lock.lock().unwrap_or_else(|p| p.into_inner());
                }
            }
            continue;
        }
        let since_free = pending.last_free.map(|t| t.elapsed()).unwrap_or(QUIET);
        if since_free >= QUIET || last_trim.elapsed() >= MAX_INTERVAL {
            let bytes = std::mem::take(&mut pending.bytes);
            drop(pending);
            trim(bytes);
            last_trim = Instant::now();
            follow_up = Some(last_trim + FOLLOW_UP);
            pending = lock.lock().unwrap_or_else(|p| p.into_inner());
        } else {
            let wait = (QUIET - since_free).min(MAX_INTERVAL.saturating_sub(last_trim.elapsed()));
            pending = wake
                .wait_timeout(pending, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim(freed: u64) {
    let started = Instant::now();
    crate::sys::malloc_trim();
    tracing::trace!(
        freed,
        took_us = started.elapsed().as_micros() as u64,
        "malloc_trim"
    );
}

/// Notes that `bytes` of stored rows were dropped.
pub fn note_freed(bytes: u64) {
    if bytes == 0 {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let (lock, wake) = trimmer();
        let mut pending = lock.lock().unwrap_or_else(|p| p.into_inner());
        let idle = pending.bytes == 0;
        pending.bytes += bytes;
        pending.last_free = Some(Instant::now());
        // Woken only when frees start: while they go on, the thread wakes
        // by its own timeout and sees `last_free` moved. (Woken on every
        // free, it cost each overwriting put two context switches: on the
        // CPU of a small put's client, 30 % of stowd's samples were this
        // thread waking to wait again.)
        if idle {
            wake.notify_one();
        }
    }
}
