//! A bounded pool of large receive buffers.
//!
//! Over tcp a large frame is received into its own allocation, and that
//! allocation then *is* the stored data: rows are `Bytes` slices of it. Once
//! the last row is cleared the allocation used to be freed, and glibc gives
//! a large chunk straight back to the OS (`munmap`), so the next put of the
//! same size faulted every page in afresh. Faulting fresh pages runs at
//! about 1.4 GB/s on the machine this was measured on, copying into
//! resident pages at 4 to 11 GB/s: under the usual put, get, clear cycle
//! the page faults bounded a tcp put.
//!
//! Here a large frame's buffer is a `Vec<u8>` owned by a [`Bytes`] (see
//! [`ReceivePool::wrap`]); when the last `Bytes` that refers to it is
//! dropped, the `Vec` comes back to the pool instead of being freed, and
//! the next frame that fits is read into it. A buffer is only ever in the
//! pool after every `Bytes` of it has gone, so a reused buffer can never be
//! seen through an older frame.
//!
//! Bounds:
//! - at most `max_bytes` (capacity) sit in the pool; a buffer coming back
//!   past that pushes the oldest ones out (they are freed), one larger than
//!   the whole cap is freed at once;
//! - a buffer unused for [`ReceivePool::idle`] is freed by a sweeper thread
//!   (followed by a `malloc_trim`, see [`ReceivePool::release_idle`]), so an
//!   idle `stowd` gives its memory back;
//! - a buffer is never allocated because a peer declared a size: the pool
//!   only hands out buffers frames already filled. A frame that finds none
//!   that fits grows its own `Vec` with the bytes that arrive, as before.
//!
//! The pooled `Vec`s are live allocations, so `stowd`'s `malloc_trim`
//! thread (see `store.rs`) cannot release them: it only returns free
//! memory. The pool is what returns them, after the idle time.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;

/// Frames at least this large are received into poolable buffers; smaller
/// ones keep their exact-size `BytesMut`.
///
/// 1 MiB: at the measured 1.4 GB/s a fresh 1 MiB costs ~0.7 ms of page
/// faults against the pool's one uncontended lock, so everything above it
/// gains; below it frames are many (one pooled `Vec` per small frame would
/// fill the pool with buffers that rarely fit again) and glibc serves them
/// from its heap, where freed memory is reused anyway.
pub const MIN_POOLED: usize = 1 << 20;

/// A buffer unused this long is freed (the default of `[limits]
/// receive_pool_idle_secs`).
pub const IDLE: Duration = Duration::from_secs(30);

/// The most a pooled buffer may exceed the frame it is given to: an eighth
/// of the frame. The slack is memory a stored frame pins without the
/// store's byte count seeing it, so it stays small (12.5 % at worst); the
/// workloads the pool is for (a training loop putting the same batch shape
/// step after step) fit exactly, and a varying batch size within an eighth
/// still finds its buffer.
fn fits(len: usize) -> std::ops::RangeInclusive<usize> {
    len..=len.saturating_add(len / 8)
}

/// A bounded pool of large receive buffers; one per process (see
/// [`ReceivePool::shared`]), shared by every connection.
#[derive(Debug)]
pub struct ReceivePool {
    max_bytes: usize,
    idle: Duration,
    inner: Mutex<Inner>,
    counters: PoolCounters,
}

/// What a pool did, for the metrics: frames of at least [`MIN_POOLED`]
/// bytes that found a buffer (`hits`) or were received into fresh memory
/// (`misses`), and bytes of buffers freed because the pool was full or
/// they sat idle (`freed_bytes`).
#[derive(Debug, Default)]
pub struct PoolCounters {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub freed_bytes: AtomicU64,
}

impl PoolCounters {
    fn add(&self, other: &PoolCounters) {
        for (a, b) in [
            (&self.hits, &other.hits),
            (&self.misses, &other.misses),
            (&self.freed_bytes, &other.freed_bytes),
        ] {
            a.fetch_add(b.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// Free buffers by (capacity, !sequence): the smallest that fits comes
    /// first, and of equal ones the most recently returned.
    free: BTreeMap<(usize, u64), Free>,
    /// Capacity of all of `free`.
    bytes: usize,
    /// Counts buffers returned.
    seq: u64,
}

#[derive(Debug)]
struct Free {
    buf: Vec<u8>,
    since: Instant,
}

impl ReceivePool {
    /// A pool holding at most `max_bytes`, freeing buffers unused for
    /// `idle`. No sweeper runs: call [`ReceivePool::release_idle`], or use
    /// [`ReceivePool::shared`].
    pub fn new(max_bytes: usize, idle: Duration) -> Arc<ReceivePool> {
        Arc::new(ReceivePool {
            max_bytes,
            idle,
            inner: Mutex::new(Inner::default()),
            counters: PoolCounters::default(),
        })
    }

    /// The pool of this process for a cap of `max_bytes` and an idle time
    /// (`None` when the cap is 0: no pooling). Every listener served with
    /// the same settings shares it (`stowd` serves all its listeners with
    /// one), with a sweeper thread that frees idle buffers and ends when
    /// the pool is dropped (when the last server using it stops).
    pub fn shared(max_bytes: usize, idle: Duration) -> Option<Arc<ReceivePool>> {
        if max_bytes == 0 {
            return None;
        }
        let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        shared.retain(|w| w.strong_count() > 0);
        if let Some(pool) = shared
            .iter()
            .filter_map(Weak::upgrade)
            .find(|p| p.max_bytes == max_bytes && p.idle == idle)
        {
            return Some(pool);
        }
        let pool = ReceivePool::new(max_bytes, idle);
        let weak = Arc::downgrade(&pool);
        let tick = (idle / 4).max(Duration::from_millis(100));
        let spawned = std::thread::Builder::new()
            .name("stowd-rxpool".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(tick);
                    let Some(pool) = weak.upgrade() else { return };
                    pool.release_idle(Instant::now());
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no receive-pool sweeper thread: idle receive buffers are not released");
        }
        shared.push(Arc::downgrade(&pool));
        Some(pool)
    }

    /// Bytes (capacity) in the pools [`ReceivePool::shared`] made, for the
    /// metrics.
    pub fn shared_bytes() -> usize {
        let shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        shared
            .iter()
            .filter_map(Weak::upgrade)
            .map(|p| p.pooled_bytes())
            .sum()
    }

    /// Hits, misses and bytes freed of the pools [`ReceivePool::shared`]
    /// made, summed, for the metrics.
    pub fn shared_counters() -> PoolCounters {
        let shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        let sum = PoolCounters::default();
        for pool in shared.iter().filter_map(Weak::upgrade) {
            sum.add(&pool.counters);
        }
        sum
    }

    /// This pool's hits, misses and bytes freed.
    pub fn counters(&self) -> &PoolCounters {
        &self.counters
    }

    /// Most bytes pooled.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Idle time after which a pooled buffer is freed.
    pub fn idle(&self) -> Duration {
        self.idle
    }

    /// Bytes (capacity) now in the pool.
    pub fn pooled_bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Buffers now in the pool.
    pub fn pooled_buffers(&self) -> usize {
        self.lock().free.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An empty buffer of capacity between `len` and `len + len / 8`, if
    /// the pool has one: the smallest such.
    pub fn take(&self, len: usize) -> Option<Vec<u8>> {
        if len < MIN_POOLED {
            return None;
        }
        let range = fits(len);
        let mut inner = self.lock();
        let Some((&key, _)) = inner
            .free
            .range((*range.start(), 0)..=(*range.end(), u64::MAX))
            .next()
        else {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        self.counters.hits.fetch_add(1, Ordering::Relaxed);
        let free = inner.free.remove(&key).expect("key just found");
        inner.bytes -= free.buf.capacity();
        Some(free.buf)
    }

    /// Takes `buf` back. Past the cap, the oldest buffers are freed (after
    /// the lock is released); a buffer too small to be pooled, or larger
    /// than the whole cap, is freed at once.
    pub fn give(&self, mut buf: Vec<u8>) {
        let cap = buf.capacity();
        if cap < MIN_POOLED || cap > self.max_bytes {
            return;
        }
        buf.clear();
        let mut evicted = Vec::new();
        {
            let mut inner = self.lock();
            while inner.bytes + cap > self.max_bytes {
                // The oldest: the one returned first.
                let Some(key) = inner
                    .free
                    .iter()
                    .min_by_key(|(_, f)| f.since)
                    .map(|(k, _)| *k)
                else {
                    break;
                };
                let old = inner.free.remove(&key).expect("key just found");
                inner.bytes -= old.buf.capacity();
                self.counters
                    .freed_bytes
                    .fetch_add(old.buf.capacity() as u64, Ordering::Relaxed);
                evicted.push(old.buf);
            }
            inner.seq += 1;
            let key = (cap, !inner.seq);
            inner.bytes += cap;
            inner.free.insert(
                key,
                Free {
                    buf,
                    since: Instant::now(),
                },
            );
        }
        drop(evicted);
    }

    /// Frees the buffers unused since before `now - idle`; then, if any
    /// were, asks glibc to return free memory (a buffer below its mmap
    /// threshold, which rises up to 32 MiB, lives in the heap, where a
    /// free alone does not give it back). Returns the bytes freed.
    pub fn release_idle(&self, now: Instant) -> usize {
        let mut released = Vec::new();
        {
            let mut inner = self.lock();
            let idle = self.idle;
            let old: Vec<(usize, u64)> = inner
                .free
                .iter()
                .filter(|(_, f)| now.saturating_duration_since(f.since) >= idle)
                .map(|(k, _)| *k)
                .collect();
            for key in old {
                let f = inner.free.remove(&key).expect("key just listed");
                inner.bytes -= f.buf.capacity();
                released.push(f.buf);
            }
        }
        let bytes: usize = released.iter().map(|b| b.capacity()).sum();
        drop(released);
        self.counters
            .freed_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        if bytes > 0 {
            trim();
        }
        bytes
    }

    /// `buf` (filled) as `Bytes`; it comes back to `pool` when the last
    /// `Bytes` referring to it is dropped.
    pub fn wrap(pool: &Arc<ReceivePool>, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Pooled {
            buf,
            pool: Arc::downgrade(pool),
        })
    }
}

/// The pools [`ReceivePool::shared`] made (in `stowd`, one).
static SHARED: Mutex<Vec<Weak<ReceivePool>>> = Mutex::new(Vec::new());

/// A frame's buffer; back to its pool when the last `Bytes` goes.
struct Pooled {
    buf: Vec<u8>,
    pool: Weak<ReceivePool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give(std::mem::take(&mut self.buf));
        }
    }
}

/// Gives freed heap back to the kernel (glibc's `malloc_trim(0)`, as
/// declared by `libc`; nothing elsewhere).
fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own arenas, under their locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn filled(len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len);
        v.resize(len, 7);
        v
    }

    #[test]
    fn a_returned_buffer_is_taken_by_a_frame_it_fits_and_only_by_one() {
        let pool = ReceivePool::new(64 * MIB, IDLE);
        let frame = ReceivePool::wrap(&pool, filled(4 * MIB));
        let ptr = frame.as_ptr();
        drop(frame);
        assert_eq!(pool.pooled_bytes(), 4 * MIB);
        // Too large a buffer for a small frame, too small for a larger one.
        assert!(pool.take(3 * MIB).is_none());
        assert!(pool.take(4 * MIB + 1).is_none());
        let got = pool.take(4 * MIB - 4 * MIB / 9).expect("within an eighth");
        assert_eq!(got.as_ptr(), ptr);
        assert!(got.is_empty());
        assert_eq!(pool.pooled_bytes(), 0);
        assert!(pool.take(4 * MIB).is_none(), "handed out once");
        // Small frames never use the pool.
        pool.give(Vec::with_capacity(MIB));
        assert!(pool.take(MIB - 1).is_none());
    }

    #[test]
    fn the_cap_is_respected_and_the_oldest_buffers_go_first() {
        let pool = ReceivePool::new(10 * MIB, IDLE);
        let a = ReceivePool::wrap(&pool, filled(4 * MIB));
        let b = ReceivePool::wrap(&pool, filled(4 * MIB));
        let c = ReceivePool::wrap(&pool, filled(3 * MIB));
        let big = ReceivePool::wrap(&pool, filled(11 * MIB));
        let (pa, pb, pc) = (a.as_ptr(), b.as_ptr(), c.as_ptr());
        drop(a);
        drop(b);
        assert_eq!(pool.pooled_bytes(), 8 * MIB);
        // 11 MiB could not fit even alone: freed, and nothing pushed out.
        drop(big);
        assert_eq!(pool.pooled_bytes(), 8 * MIB);
        // 3 more MiB would be 11: the oldest (a) makes room.
        drop(c);
        assert_eq!(pool.pooled_bytes(), 7 * MIB);
        assert_eq!(pool.pooled_buffers(), 2);
        let (c, b) = (pool.take(3 * MIB).unwrap(), pool.take(4 * MIB).unwrap());
        assert_eq!((c.as_ptr(), b.as_ptr()), (pc, pb));
        assert!(pool.take(4 * MIB).is_none(), "a ({pa:?}) was freed");
    }

    #[test]
    fn a_buffer_comes_back_only_when_its_last_slice_is_dropped() {
        let pool = ReceivePool::new(64 * MIB, IDLE);
        let frame = ReceivePool::wrap(&pool, filled(2 * MIB));
        let row = frame.slice(100..200);
        let clone = frame.clone();
        drop(frame);
        drop(clone);
        assert_eq!(pool.pooled_bytes(), 0, "a row still refers to it");
        assert!(pool.take(2 * MIB).is_none());
        assert_eq!(&row[..], &[7u8; 100][..]);
        drop(row);
        assert_eq!(pool.pooled_bytes(), 2 * MIB);
    }

    #[test]
    fn idle_buffers_are_freed_after_the_idle_time() {
        let pool = ReceivePool::new(64 * MIB, Duration::from_secs(5));
        drop(ReceivePool::wrap(&pool, filled(2 * MIB)));
        let start = Instant::now();
        assert_eq!(pool.release_idle(start), 0, "just returned");
        drop(ReceivePool::wrap(&pool, filled(3 * MIB)));
        let later = Instant::now() + Duration::from_secs(5);
        // Both are 5 s old by then; a sweep before that keeps them.
        assert_eq!(pool.release_idle(start + Duration::from_secs(4)), 0);
        assert_eq!(pool.pooled_buffers(), 2);
        assert_eq!(pool.release_idle(later), 5 * MIB);
        assert_eq!(pool.pooled_bytes(), 0);
        assert_eq!(pool.pooled_buffers(), 0);
    }

    #[test]
    fn a_pool_gone_frees_returning_buffers() {
        let pool = ReceivePool::new(64 * MIB, IDLE);
        let frame = ReceivePool::wrap(&pool, filled(2 * MIB));
        drop(pool);
        assert_eq!(frame.len(), 2 * MIB);
        drop(frame);
    }

    #[test]
    fn the_shared_pool_is_one_per_setting_and_none_when_off() {
        assert!(ReceivePool::shared(0, IDLE).is_none());
        let a = ReceivePool::shared(123 * MIB, IDLE).unwrap();
        let b = ReceivePool::shared(123 * MIB, IDLE).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.idle(), IDLE);
        let c = ReceivePool::shared(123 * MIB, Duration::from_secs(5)).unwrap();
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(c.idle(), Duration::from_secs(5));
        drop(ReceivePool::wrap(&a, filled(2 * MIB)));
        assert!(ReceivePool::shared_bytes() >= 2 * MIB);
    }
}
