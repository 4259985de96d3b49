//! A bounded pool of resident pages for large receive buffers.
//!
//! Over tcp a large frame is received into its own allocation, and that
//! allocation then *is* the stored data: rows are `Bytes` slices of it. Once
//! the last row is cleared the allocation used to be freed, and glibc gives
//! a large chunk straight back to the OS (`munmap`), so the next put of the
//! same size faulted every page in afresh. Faulting fresh pages runs at
//! about 1.4 GB/s on the machine this was measured on, copying into
//! resident pages at 4 to 11 GB/s: under the usual put, get, clear cycle
//! the page faults bounded a tcp put. On a VM whose freed memory goes back
//! to the host (free page reporting), a fresh page costs more still:
//! 0.1-1.5 GB/s here.
//!
//! So a large frame is received into [`Pages`], an anonymous mapping of its
//! own, wrapped in a [`Bytes`] (see [`ReceivePool::wrap`]); when the last
//! `Bytes` that refers to it is dropped, its pages come back to the pool
//! instead of being unmapped, and later frames are read into them. A
//! buffer is only ever in the pool after every `Bytes` of it has gone, so
//! reused pages can never be seen through an older frame.
//!
//! **Pages, not buffers of one size.** The pool used to hand a frame only a
//! whole buffer within an eighth of its size. Frames of another size then
//! found nothing: a `stowd` that received 64 MiB put messages from clients
//! and 16 MiB frames from a router `stowd` (one per unit) missed on almost
//! every frame, freed the other size's buffers past its cap, and faulted
//! every put into fresh memory (2 GiB puts alternating between the two, at
//! 8a9d00a: 1 pool hit in 165 frames, then 1 in 33; 0.45-0.73 GB/s and 2.6-5
//! s of the receiving stowd's CPU per put). Now the pool keeps page ranges,
//! and a frame takes pages regardless of how they were received:
//! - the smallest pooled range at least its size, split when what is left
//!   over is worth keeping (the rest goes back to the pool);
//! - else several ranges moved next to each other with `mremap`
//!   (`MREMAP_FIXED`), which moves page-table entries, not bytes, and
//!   faults nothing; what the pool cannot cover stays fresh memory.
//!
//! Hand-written on `libc` rather than on a mapping crate: `memmap2` (the
//! well-kept one) maps and grows anonymous memory, but cannot split a
//! mapping or move pages to a chosen address, which is the point here.
//!
//! Bounds:
//! - at most `max_bytes` sit in the pool; pages coming back past that push
//!   the oldest out (they are unmapped), a range larger than the whole cap
//!   is unmapped at once;
//! - pages unused for [`ReceivePool::idle`] are unmapped by a sweeper
//!   thread, so an idle `stowd` gives its memory back;
//! - a range of less than [`MIN_POOLED`] is never kept, so the pool holds
//!   at most `max_bytes / MIN_POOLED` mappings (2,048 for 2 GiB), and a
//!   frame is assembled from at most [`MAX_PIECES`] of them;
//! - pages are never mapped because a peer declared a size: a frame that
//!   finds nothing pooled grows its own mapping with the bytes that arrive
//!   (see [`Pages::grow`]); pooled pages it takes are memory the process
//!   already holds.

use std::collections::BTreeMap;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;

/// Frames at least this large are received into poolable [`Pages`];
/// smaller ones keep their exact-size `BytesMut`. Also the least a pooled
/// range may be.
///
/// 1 MiB: at the measured 1.4 GB/s a fresh 1 MiB costs ~0.7 ms of page
/// faults against the pool's one uncontended lock, so everything above it
/// gains; below it frames are many and glibc serves them from its heap,
/// where freed memory is reused anyway.
pub const MIN_POOLED: usize = 1 << 20;

/// The most pooled ranges one frame is assembled from: one `mremap` each,
/// and each a mapping of its own (the kernel does not merge moved ranges),
/// counted against `vm.max_map_count` (65,530 by default) for as long as
/// the frame is stored: 100 GiB stored in 64 MiB frames of 16 pieces each
/// is 25,600 mappings. What the pieces do not cover is fresh memory.
pub const MAX_PIECES: usize = 16;

/// A buffer unused this long is freed (the default of `[limits]
/// receive_pool_idle_secs`).
pub const IDLE: Duration = Duration::from_secs(30);

/// The size of a page, as the kernel reports it.
fn page() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf reads a constant of the system.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 { p as usize } else { 4096 }
    })
}

fn round_up(n: usize) -> usize {
    n.div_ceil(page()).saturating_mul(page())
}

/// Spare pages a frame may keep past its end rather than split them off:
/// less than an eighth of the frame, and less than [`MIN_POOLED`] (which
/// the pool would not keep anyway). The slack is memory a stored frame
/// pins without the store's byte count seeing it.
fn keeps(need: usize, spare: usize) -> bool {
    spare < MIN_POOLED && spare <= need / 8
}

/// An anonymous private mapping of `cap` bytes (whole pages), of which the
/// first `len` are filled: a large frame's buffer.
///
/// Its pages are zeros when fresh and an earlier frame's bytes when they
/// come from the pool; either way initialised, so the whole capacity can be
/// read into as a `&mut [u8]` ([`Pages::spare`]) while only `len` bytes are
/// ever shown ([`Pages::as_slice`]).
pub struct Pages {
    ptr: NonNull<u8>,
    cap: usize,
    len: usize,
}

// SAFETY: `Pages` owns its mapping outright, like a `Vec<u8>`.
unsafe impl Send for Pages {}
// SAFETY: shared access only reads.
unsafe impl Sync for Pages {}

impl std::fmt::Debug for Pages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pages")
            .field("cap", &self.cap)
            .field("len", &self.len)
            .finish()
    }
}

impl Pages {
    /// No pages.
    pub const fn empty() -> Pages {
        Pages {
            ptr: NonNull::dangling(),
            cap: 0,
            len: 0,
        }
    }

    /// A fresh mapping of at least `cap` bytes (nothing is faulted in).
    pub fn map(cap: usize) -> io::Result<Pages> {
        let cap = round_up(cap);
        if cap == 0 {
            return Ok(Pages::empty());
        }
        // SAFETY: a new anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                cap,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Pages {
            ptr: NonNull::new(p.cast()).expect("mmap returned a mapping"),
            cap,
            len: 0,
        })
    }

    /// `bytes` in pages of their own.
    pub fn copy_from(bytes: &[u8]) -> io::Result<Pages> {
        let mut p = Pages::map(bytes.len())?;
        p.spare()[..bytes.len()].copy_from_slice(bytes);
        p.len = bytes.len();
        Ok(p)
    }

    /// The mapping's first byte.
    #[cfg(test)]
    pub(crate) fn as_ptr_for_tests(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Bytes mapped.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Bytes filled.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Nothing filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The filled bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len <= cap` bytes of our mapping, all initialised.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The mapped bytes past the filled ones, to read into.
    pub fn spare(&mut self) -> &mut [u8] {
        // SAFETY: the mapping's bytes past `len`, initialised (zeros or
        // earlier bytes) and ours alone.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(self.len), self.cap - self.len)
        }
    }

    /// Counts `n` more bytes of [`Pages::spare`] as filled.
    pub fn filled(&mut self, n: usize) {
        assert!(n <= self.cap - self.len, "filled past the mapping");
        self.len += n;
    }

    /// Forgets the filled bytes (the pages stay).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Grows the mapping to at least `cap` bytes, moving it if it must
    /// (`mremap`: page-table entries move, the bytes are not copied).
    pub fn grow(&mut self, cap: usize) -> io::Result<()> {
        let cap = round_up(cap);
        if cap <= self.cap {
            return Ok(());
        }
        if self.cap == 0 {
            *self = Pages::map(cap)?;
            return Ok(());
        }
        // SAFETY: resizes our own mapping; on success the old address is
        // no longer ours and we keep only the new one.
        let p = unsafe {
            libc::mremap(
                self.ptr.as_ptr().cast(),
                self.cap,
                cap,
                libc::MREMAP_MAYMOVE,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        self.ptr = NonNull::new(p.cast()).expect("mremap returned a mapping");
        self.cap = cap;
        Ok(())
    }

    /// Splits the pages from `at` (a multiple of the page size, inside the
    /// mapping) into their own `Pages`, empty; `self` keeps the first `at`
    /// bytes of capacity (and at most `at` filled).
    fn split_off(&mut self, at: usize) -> Pages {
        debug_assert!(at.is_multiple_of(page()) && at > 0 && at < self.cap);
        // SAFETY: `at < cap`: inside our mapping.
        let tail = unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(at)) };
        let rest = Pages {
            ptr: tail,
            cap: self.cap - at,
            len: 0,
        };
        self.cap = at;
        self.len = self.len.min(at);
        rest
    }

    /// Moves these pages to `dst` (page-aligned, `cap` bytes that are part
    /// of `into`'s mapping), replacing what was mapped there. On failure
    /// the pages are unmapped (dropped).
    fn move_into(self, into: &Pages, at: usize) -> io::Result<()> {
        debug_assert!(at.is_multiple_of(page()) && at + self.cap <= into.cap);
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: both ranges are ours: ours whole, and a page-aligned part
        // of `into`'s mapping, which MREMAP_FIXED unmaps first. On success
        // our old range is no longer mapped, so `this` must not unmap it.
        let p = unsafe {
            libc::mremap(
                this.ptr.as_ptr().cast(),
                this.cap,
                this.cap,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                into.ptr.as_ptr().add(at).cast::<libc::c_void>(),
            )
        };
        if p == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            drop(std::mem::ManuallyDrop::into_inner(this));
            return Err(e);
        }
        Ok(())
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        if self.cap > 0 {
            // SAFETY: our own mapping, unmapped once.
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.cap);
            }
        }
    }
}

/// A bounded pool of resident pages; one per process (see
/// [`ReceivePool::shared`]), shared by every connection.
#[derive(Debug)]
pub struct ReceivePool {
    max_bytes: usize,
    idle: Duration,
    inner: Mutex<Inner>,
    counters: PoolCounters,
}

/// What a pool did, for the metrics: frames of at least [`MIN_POOLED`]
/// bytes whose pages all came from the pool (`hits`) or that needed fresh
/// memory for some or all of them (`misses`), and bytes of pages unmapped
/// because the pool was full or they sat idle (`freed_bytes`).
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
    /// Free ranges by (capacity, !sequence): the smallest that fits comes
    /// first, and of equal ones the most recently returned.
    free: BTreeMap<(usize, u64), Free>,
    /// Capacity of all of `free`.
    bytes: usize,
    /// Counts ranges returned.
    seq: u64,
}

#[derive(Debug)]
struct Free {
    pages: Pages,
    since: Instant,
}

impl Inner {
    fn insert(&mut self, pages: Pages, since: Instant) {
        self.seq += 1;
        self.bytes += pages.cap;
        self.free
            .insert((pages.cap, !self.seq), Free { pages, since });
    }

    /// Cuts `pages` down to `at` bytes: the rest goes back to the pool
    /// (with the `since` it had), or to `spare` (to be unmapped once the
    /// lock is released) when it is under [`MIN_POOLED`].
    fn split(&mut self, pages: &mut Pages, at: usize, since: Instant, spare: &mut Vec<Pages>) {
        let rest = pages.split_off(at);
        if rest.cap >= MIN_POOLED {
            self.insert(rest, since);
        } else {
            spare.push(rest);
        }
    }

    fn remove(&mut self, key: (usize, u64)) -> Free {
        let f = self.free.remove(&key).expect("key just found");
        self.bytes -= f.pages.cap;
        f
    }
}

impl ReceivePool {
    /// A pool holding at most `max_bytes`, freeing pages unused for
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
    /// one), with a sweeper thread that frees idle pages and ends when the
    /// pool is dropped (when the last server using it stops).
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

    /// Bytes in the pools [`ReceivePool::shared`] made, for the metrics.
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

    /// Idle time after which pooled pages are freed.
    pub fn idle(&self) -> Duration {
        self.idle
    }

    /// Bytes now in the pool.
    pub fn pooled_bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Ranges (mappings) now in the pool.
    pub fn pooled_buffers(&self) -> usize {
        self.lock().free.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Empty pages for a frame of `len` bytes, if the pool has any: the
    /// smallest pooled range of at least `len` (split when the rest is
    /// worth keeping), else up to [`MAX_PIECES`] ranges, largest first,
    /// moved into one mapping of `len` whose remainder, if the pool ran
    /// short, is fresh memory. `None` for a frame under [`MIN_POOLED`] or
    /// over the pool's cap, or when the pool is empty.
    pub fn take(&self, len: usize) -> Option<Pages> {
        let need = round_up(len);
        if len < MIN_POOLED || need > self.max_bytes {
            // Pages of a frame larger than the whole cap could never come
            // back: the pool keeps them for frames that can.
            if len >= MIN_POOLED {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
            }
            return None;
        }
        let mut pieces = Vec::new();
        let mut spare = Vec::new();
        {
            let mut inner = self.lock();
            if let Some(&key) = inner.free.range((need, 0)..).next().map(|(k, _)| k) {
                let Free { mut pages, since } = inner.remove(key);
                if !keeps(need, pages.cap - need) {
                    inner.split(&mut pages, need, since, &mut spare);
                }
                drop(inner);
                drop(spare);
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                return Some(pages);
            }
            // Nothing big enough alone: the largest ranges, together.
            let mut got = 0;
            while got < need && pieces.len() < MAX_PIECES {
                let Some(&key) = inner.free.keys().next_back() else {
                    break;
                };
                let Free { mut pages, since } = inner.remove(key);
                if pages.cap > need - got {
                    inner.split(&mut pages, need - got, since, &mut spare);
                }
                got += pages.cap;
                pieces.push(pages);
            }
        }
        drop(spare);
        if pieces.is_empty() {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let Ok(out) = Pages::map(need) else {
            // No mapping to move them into: back they go.
            for p in pieces {
                self.give(p);
            }
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let mut at = 0;
        let mut whole = true;
        for p in pieces {
            let cap = p.cap;
            // A piece that cannot move is unmapped; its part of `out`
            // stays fresh memory.
            whole &= p.move_into(&out, at).is_ok();
            at += cap;
        }
        let counter = if whole && at == need {
            &self.counters.hits
        } else {
            &self.counters.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Some(out)
    }

    /// Takes `pages` back. Past the cap, the oldest ranges are unmapped
    /// (after the lock is released); a range under [`MIN_POOLED`], or
    /// larger than the whole cap, is unmapped at once.
    pub fn give(&self, mut pages: Pages) {
        let cap = pages.cap;
        if cap < MIN_POOLED || cap > self.max_bytes {
            return;
        }
        pages.clear();
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
                let old = inner.remove(key);
                self.counters
                    .freed_bytes
                    .fetch_add(old.pages.cap as u64, Ordering::Relaxed);
                evicted.push(old.pages);
            }
            inner.insert(pages, Instant::now());
        }
        drop(evicted);
    }

    /// Unmaps the ranges unused since before `now - idle`. Returns the
    /// bytes freed.
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
                released.push(inner.remove(key).pages);
            }
        }
        let bytes: usize = released.iter().map(|p| p.cap).sum();
        drop(released);
        self.counters
            .freed_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        bytes
    }

    /// `pages` (filled) as `Bytes`; they come back to `pool` when the last
    /// `Bytes` referring to them is dropped.
    pub fn wrap(pool: &Arc<ReceivePool>, pages: Pages) -> Bytes {
        Bytes::from_owner(Pooled {
            pages,
            pool: Arc::downgrade(pool),
        })
    }
}

/// The pools [`ReceivePool::shared`] made (in `stowd`, one).
static SHARED: Mutex<Vec<Weak<ReceivePool>>> = Mutex::new(Vec::new());

/// A frame's pages; back to their pool when the last `Bytes` goes.
struct Pooled {
    pages: Pages,
    pool: Weak<ReceivePool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        self.pages.as_slice()
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give(std::mem::replace(&mut self.pages, Pages::empty()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn filled(len: usize) -> Pages {
        Pages::copy_from(&vec![7u8; len]).unwrap()
    }

    /// Whether every page of `p`'s mapping is resident (`mincore`).
    fn resident(p: &[u8]) -> bool {
        let pages = p.len().div_ceil(page());
        let mut v = vec![0u8; pages];
        // SAFETY: `p` starts a mapping of ours (page-aligned), `v` has a
        // byte per page.
        let rc = unsafe { libc::mincore(p.as_ptr() as *mut _, p.len(), v.as_mut_ptr()) };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        v.iter().all(|b| b & 1 == 1)
    }

    #[test]
    fn a_returned_range_is_taken_by_a_frame_it_fits_and_only_by_one() {
        let pool = ReceivePool::new(64 * MIB, IDLE);
        let frame = ReceivePool::wrap(&pool, filled(4 * MIB));
        let ptr = frame.as_ptr();
        drop(frame);
        assert_eq!(pool.pooled_bytes(), 4 * MIB);
        let got = pool.take(4 * MIB - 4 * MIB / 9).expect("within an eighth");
        assert_eq!(got.as_ptr_for_tests(), ptr);
        assert!(got.is_empty());
        assert_eq!(got.capacity(), 4 * MIB, "the spare eighth stays with it");
        assert_eq!(pool.pooled_bytes(), 0);
        assert!(pool.take(4 * MIB).is_none(), "handed out once");
        // Small frames never use the pool; small ranges are not kept.
        pool.give(Pages::map(MIB - 4096).unwrap());
        assert_eq!(pool.pooled_bytes(), 0);
        drop(got);
    }

    #[test]
    fn a_large_range_is_split_for_smaller_frames() {
        let pool = ReceivePool::new(64 * MIB, IDLE);
        let big = filled(16 * MIB);
        let base = big.as_ptr_for_tests() as usize;
        pool.give(big);
        // Four 4 MiB frames out of one 16 MiB range: no fresh page.
        let parts: Vec<Pages> = (0..4).map(|_| pool.take(4 * MIB).unwrap()).collect();
        assert_eq!(pool.pooled_bytes(), 0);
        assert_eq!(pool.counters().hits.load(Ordering::Relaxed), 4);
        let mut addrs: Vec<usize> = parts
            .iter()
            .map(|p| p.as_ptr_for_tests() as usize)
            .collect();
        addrs.sort();
        assert_eq!(
            addrs,
            (0..4).map(|k| base + k * 4 * MIB).collect::<Vec<_>>()
        );
        for mut p in parts {
            assert_eq!(p.capacity(), 4 * MIB);
            let cap = p.capacity();
            p.spare().fill(9);
            p.filled(cap);
            assert!(p.as_slice().iter().all(|&b| b == 9));
            assert!(resident(p.as_slice()));
            pool.give(p);
        }
        assert_eq!(pool.pooled_bytes(), 16 * MIB);
        assert_eq!(pool.pooled_buffers(), 4);
        // 516 KiB spare is more than an eighth: split off, and under the
        // pool's minimum, so not kept.
        let p = pool.take(4 * MIB - 516 * 1024).unwrap();
        assert_eq!(p.capacity(), 4 * MIB - 516 * 1024);
        assert_eq!(pool.pooled_bytes(), 12 * MIB);
        // 256 KiB spare is less: it stays with the frame.
        let q = pool.take(4 * MIB - 256 * 1024).unwrap();
        assert_eq!(q.capacity(), 4 * MIB);
        assert_eq!(pool.pooled_bytes(), 8 * MIB);
    }

    #[test]
    fn small_ranges_are_moved_together_for_a_larger_frame() {
        let pool = ReceivePool::new(64 * MIB, IDLE);
        for k in 0..4u8 {
            pool.give(Pages::copy_from(&vec![k; 2 * MIB]).unwrap());
        }
        let mut big = pool.take(7 * MIB).expect("8 MiB pooled in 2 MiB ranges");
        assert_eq!(pool.counters().hits.load(Ordering::Relaxed), 1);
        assert_eq!(big.capacity(), 7 * MIB);
        assert_eq!(
            pool.pooled_bytes(),
            MIB,
            "the last range's 1 MiB rest is kept"
        );
        {
            // Resident, and the old bytes are there to be overwritten.
            let all = unsafe { std::slice::from_raw_parts(big.as_ptr_for_tests(), 7 * MIB) };
            assert!(resident(all));
        }
        big.spare()[..5].copy_from_slice(b"hello");
        big.filled(5);
        assert_eq!(big.as_slice(), b"hello");
        drop(big);
        // Not all covered: the rest is fresh memory, and counted a miss.
        pool.give(Pages::copy_from(&vec![1u8; 2 * MIB]).unwrap());
        let p = pool.take(6 * MIB).unwrap();
        assert_eq!(p.capacity(), 6 * MIB);
        assert_eq!(pool.pooled_bytes(), 0);
        assert_eq!(pool.counters().misses.load(Ordering::Relaxed), 1);
        // Larger than the cap: the pool is left alone.
        pool.give(p);
        assert!(pool.take(65 * MIB).is_none());
        assert_eq!(pool.pooled_bytes(), 6 * MIB);
    }

    #[test]
    fn a_frame_is_assembled_from_at_most_max_pieces_ranges() {
        let pool = ReceivePool::new(64 * MIB, IDLE);
        let n = MAX_PIECES + 4;
        for _ in 0..n {
            pool.give(filled(MIB));
        }
        let p = pool.take(n * MIB).expect("pooled ranges");
        assert_eq!(p.capacity(), n * MIB);
        assert_eq!(
            pool.pooled_buffers(),
            4,
            "the ranges past MAX_PIECES stay pooled"
        );
        assert_eq!(
            pool.counters().misses.load(Ordering::Relaxed),
            1,
            "part fresh"
        );
        let all = unsafe { std::slice::from_raw_parts(p.as_ptr_for_tests(), n * MIB) };
        assert!(resident(&all[..MAX_PIECES * MIB]));
        assert!(
            all[MAX_PIECES * MIB..].iter().all(|&b| b == 0),
            "fresh pages are zeros"
        );
    }

    #[test]
    fn the_cap_is_respected_and_the_oldest_ranges_go_first() {
        let pool = ReceivePool::new(10 * MIB, IDLE);
        let a = ReceivePool::wrap(&pool, filled(4 * MIB));
        let b = ReceivePool::wrap(&pool, filled(4 * MIB));
        let c = ReceivePool::wrap(&pool, filled(3 * MIB));
        let big = ReceivePool::wrap(&pool, filled(11 * MIB));
        let (pb, pc) = (b.as_ptr(), c.as_ptr());
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
        assert_eq!((c.as_ptr_for_tests(), b.as_ptr_for_tests()), (pc, pb));
        assert_eq!(pool.pooled_bytes(), 0, "a was freed");
    }

    #[test]
    fn pages_come_back_only_when_the_last_slice_is_dropped() {
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
    fn idle_ranges_are_freed_after_the_idle_time() {
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
    fn a_pool_gone_frees_returning_pages() {
        let pool = ReceivePool::new(64 * MIB, IDLE);
        let frame = ReceivePool::wrap(&pool, filled(2 * MIB));
        drop(pool);
        assert_eq!(frame.len(), 2 * MIB);
        drop(frame);
    }

    #[test]
    fn pages_grow_without_losing_their_bytes() {
        let mut p = Pages::map(1).unwrap();
        assert_eq!(p.capacity(), page());
        p.spare()[..3].copy_from_slice(b"abc");
        p.filled(3);
        p.grow(10 * MIB).unwrap();
        assert_eq!(p.capacity(), 10 * MIB);
        assert_eq!(p.as_slice(), b"abc");
        assert_eq!(p.spare().len(), 10 * MIB - 3);
        assert!(p.spare().iter().all(|&b| b == 0), "fresh pages are zeros");
        p.clear();
        assert!(p.is_empty());
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
