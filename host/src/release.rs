//! Gives memory freed by clears, overwrites and spills back to the OS.
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
//!
//! **A byte trigger.** Time alone does not bound what the arenas keep: a
//! freed frame is reused only by a thread allocating from the same arena,
//! and the tasks that receive frames move between `stowd`'s threads. With
//! spilling, every put past the bound frees about what it stores; in a
//! run where the receiving and the freeing arenas drifted apart, `stowd`
//! grew by each put's 2 MiB, 48 MiB over the spill bound of 128 MiB
//! within the second the trimmer waited (measured: 158 MiB resident
//! where the same run otherwise peaked at 110 MiB, one run in four on a
//! loaded machine). So once [`trim_past`] has set a trigger (`stowd` sets
//! a sixteenth of its units' memory bound), frees that reach it are
//! trimmed at once, still on this thread.

use std::sync::atomic::{AtomicU64, Ordering};
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
/// The least byte trigger [`trim_past`] sets.
pub const MIN_TRIGGER: u64 = 4 << 20;

/// Freed bytes that start a trim at once (0: none; see [`trim_past`]).
static TRIGGER: AtomicU64 = AtomicU64::new(0);
/// Trims so far.
static TRIMS: AtomicU64 = AtomicU64::new(0);

/// Trims as soon as `bytes` have been freed since the last trim (at least
/// [`MIN_TRIGGER`]), without waiting for [`QUIET`] or [`MAX_INTERVAL`]; 0
/// takes the trigger away. One for the process: the last call sets it.
pub fn trim_past(bytes: u64) {
    let bytes = if bytes == 0 {
        0
    } else {
        bytes.max(MIN_TRIGGER)
    };
    TRIGGER.store(bytes, Ordering::Relaxed);
}

/// Whether `pending` freed bytes reach the trigger.
fn triggered(pending: u64) -> bool {
    let trigger = TRIGGER.load(Ordering::Relaxed);
    trigger > 0 && pending >= trigger
}

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
        if since_free >= QUIET || last_trim.elapsed() >= MAX_INTERVAL || triggered(pending.bytes) {
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
    TRIMS.fetch_add(1, Ordering::Relaxed);
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
        let crossed = !triggered(pending.bytes) && triggered(pending.bytes.saturating_add(bytes));
        pending.bytes = pending.bytes.saturating_add(bytes);
        pending.last_free = Some(Instant::now());
        // Woken only when frees start or reach the trigger: while they go
        // on, the thread wakes by its own timeout and sees `last_free`
        // moved. (Woken on every free, it cost each overwriting put two
        // context switches: on the CPU of a small put's client, 30 % of
        // stowd's samples were this thread waking to wait again.)
        if idle || crossed {
            wake.notify_one();
        }
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// Frees that go on without a pause are trimmed by time at most once
    /// a [`MAX_INTERVAL`]; past the trigger they are trimmed as they come.
    #[test]
    fn frees_past_the_trigger_are_trimmed_without_waiting_for_a_pause() {
        // Other tests' nodes set the trigger to a sixteenth of their
        // bound: each free here is past any of theirs.
        const FREE: u64 = 4 << 30;
        trim_past(FREE);
        let before = TRIMS.load(Ordering::Relaxed);
        let started = Instant::now();
        while started.elapsed() < MAX_INTERVAL / 2 {
            note_freed(FREE);
            std::thread::sleep(Duration::from_millis(5));
        }
        let trims = TRIMS.load(Ordering::Relaxed) - before;
        assert!(
            trims >= 3,
            "{trims} trims in {:?} of frees past the trigger",
            MAX_INTERVAL / 2
        );
    }
}
