//! Memory files allocated ahead of time: a new segment's pages cost an
//! allocation (`fallocate`, 2.5-4.9 GB/s on the development VM) that a put
//! otherwise waits for. Cleared segments are never reused (see the parent
//! module), so instead a background thread allocates, while the store is
//! idle, fresh memory files of the sizes recent leases and exports asked
//! for; the next lease or export of such a size takes one ready. The
//! filler allocates once the store has been quiet for [`QUIET`] after a
//! segment is complete (a lease put, an export written), not when one is
//! taken: allocating beside the copy into it slowed 2 GiB puts from
//! 4.1-4.5 GB/s to 1.1-1.8 GB/s on the 2-core VM. A lease of a size being
//! allocated waits for that file rather than allocate a second beside it.
//!
//! Safety: a file here has never left `stowd` (no descriptor of it was
//! ever sent), so nobody else can map it, and its pages are the kernel's
//! fresh zeroed pages. At most `cap` bytes are kept; a file unused for
//! `idle` is freed.

use std::collections::VecDeque;
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Sizes under this are allocated on demand: their pages are few.
pub const MIN_PREALLOC: u64 = 1 << 20;

/// How many recent sizes the filler works from.
const RECENT: usize = 16;

/// The filler allocates only after the store has been quiet this long (no
/// lease, put, export or same-node get), so that it does not take the CPU
/// and memory bandwidth a request in progress needs: right after a put,
/// it made the same-node gets that followed 20-25% slower on the 2-core VM.
const QUIET: Duration = Duration::from_millis(20);

struct Ready {
    file: File,
    len: u64,
    since: Instant,
}

#[derive(Default)]
struct State {
    ready: Vec<Ready>,
    /// Sizes asked for recently, newest last: the filler allocates the
    /// next of each that is not ready.
    wanted: VecDeque<u64>,
    /// When a request last used the store.
    last_activity: Option<Instant>,
    /// The size the filler is allocating now, if any.
    allocating: Option<u64>,
    stop: bool,
}

/// A pool of allocated, never-shared memory files.
pub struct Prealloc {
    cap: u64,
    idle: Duration,
    state: Mutex<State>,
    wake: Condvar,
    /// Signalled when the filler finishes a file.
    done: Condvar,
    /// Bytes ready.
    bytes: AtomicU64,
    /// Leases and exports served from the pool.
    pub(super) hits: AtomicU64,
}

impl Prealloc {
    /// A pool of at most `cap` bytes (0: none), with its filler thread.
    pub fn start(cap: u64, idle: Duration) -> Arc<Prealloc> {
        let pool = Arc::new(Prealloc {
            cap,
            idle,
            state: Mutex::default(),
            wake: Condvar::new(),
            done: Condvar::new(),
            bytes: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        });
        if cap > 0 {
            let filler = pool.clone();
            let spawned = std::thread::Builder::new()
                .name("stowd-prealloc".into())
                .spawn(move || filler.fill());
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "no preallocation thread: segments are allocated on demand");
            }
        }
        pool
    }

    /// A ready file of exactly `len` bytes, if one of about that size is
    /// there (a larger one is cut down); notes `len` as wanted again.
    pub fn take(&self, len: u64) -> Option<File> {
        if self.cap == 0 || len < MIN_PREALLOC {
            return None;
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.wanted.push_back(len);
        if state.wanted.len() > RECENT {
            state.wanted.pop_front();
        }
        let fits = |r: u64| r >= len && r - len <= len / 4;
        let taken = loop {
            // The smallest that fits, at most a quarter larger.
            let best = state
                .ready
                .iter()
                .enumerate()
                .filter(|(_, r)| fits(r.len))
                .min_by_key(|(_, r)| r.len)
                .map(|(i, _)| i);
            if let Some(i) = best {
                break Some(state.ready.swap_remove(i));
            }
            // One is being allocated: wait for it rather than allocate a
            // second beside it (both would compete for the same memory
            // bandwidth, and the work is the same).
            if state.stop || !state.allocating.is_some_and(fits) {
                break None;
            }
            state = self
                .done
                .wait_timeout(state, Duration::from_secs(10))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        };
        drop(state);
        // (No wake-up here: the filler starts when the segment is done,
        // `kick`, not while the put copies into it.)
        let r = taken?;
        self.bytes.fetch_sub(r.len, Ordering::Relaxed);
        // Shrinking frees the pages past `len`.
        if r.file.set_len(len).is_err() {
            return None;
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(r.file)
    }

    /// Notes that a request used the store now (the filler waits for a
    /// quiet spell), and wakes the filler: a lease was put or an export
    /// written, so what it allocates next does not compete with that copy.
    pub fn touch(&self) {
        if self.cap > 0 {
            self.state
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .last_activity = Some(Instant::now());
            self.wake.notify_one();
        }
    }

    /// Bytes ready now.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Stops the filler and frees what is ready.
    pub fn stop(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.stop = true;
        state.ready.clear();
        self.bytes.store(0, Ordering::Relaxed);
        drop(state);
        self.wake.notify_all();
        self.done.notify_all();
    }

    /// The filler: allocates wanted sizes that are not ready, within the
    /// cap; frees files idle too long.
    fn fill(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if state.stop {
                return;
            }
            let now = Instant::now();
            let idle = self.idle;
            let before = state.ready.len();
            state.ready.retain(|r| now.duration_since(r.since) < idle);
            if state.ready.len() != before {
                let kept: u64 = state.ready.iter().map(|r| r.len).sum();
                self.bytes.store(kept, Ordering::Relaxed);
            }
            let next = state.wanted.iter().rev().copied().find(|&len| {
                !state
                    .ready
                    .iter()
                    .any(|r| r.len >= len && r.len - len <= len / 4)
            });
            let Some(len) = next.filter(|&len| self.bytes() + len <= self.cap) else {
                state = self
                    .wake
                    .wait_timeout(state, idle.max(Duration::from_millis(100)))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                continue;
            };
            let quiet = state
                .last_activity
                .map_or(Duration::MAX, |t| now.saturating_duration_since(t));
            if quiet < QUIET {
                state = self
                    .wake
                    .wait_timeout(state, QUIET - quiet)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                continue;
            }
            // Allocate without the lock: takes go on meanwhile.
            state.allocating = Some(len);
            drop(state);
            let file = super::memfd(len).and_then(|f| super::allocate(&f, len).map(|()| f));
            state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            state.allocating = None;
            match file {
                Ok(file) if !state.stop => {
                    self.bytes.fetch_add(len, Ordering::Relaxed);
                    state.ready.push(Ready {
                        file,
                        len,
                        since: Instant::now(),
                    });
                }
                Ok(_) => {}
                Err(e) => {
                    // Out of memory, most likely: stop wanting it for now.
                    tracing::debug!(error = %e, len, "preallocation failed");
                    state.wanted.retain(|&w| w != len);
                }
            }
            self.done.notify_all();
        }
    }
}

impl Drop for Prealloc {
    fn drop(&mut self) {
        self.stop();
    }
}
