//! Extents: the immutable buffers every stored byte lives in.
//!
//! An extent is one of
//! - a data frame a put arrived in (over tcp, from the receive pool),
//! - a shared-memory segment a same-node client handed over,
//! - the one buffer a gather plan produced.
//!
//! Units never store a row on its own: they index rows into extents
//! ([`crate::store`]). Rows put together stay together, so a get of them is
//! a slice of one extent, found from the index (extent and offset), never
//! rediscovered from memory addresses.
//!
//! The bytes of an extent never change. The one thing that can change is
//! *where* they live: an extent that a same-node reader asks for is copied
//! into a shared-memory segment once ([`share_all`]), and from then on
//! every reader gets that segment. Readers that took a snapshot before keep
//! the old buffer alive through their own reference, with the same bytes,
//! so a move never tears a row.
//!
//! Memory: an extent is freed (its receive buffer returned to the pool, its
//! segment's pages freed once no reader maps them either) when the last `Arc` goes: every unit
//! column over it dropped by overwrite or clear, and no reply in flight.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;

use crate::shm::{Handle, SegmentStore, ShmError};

/// The extents' clock: advanced by each scan of the spiller
/// ([`crate::spill`]), read by every use of an extent (a plain load, so
/// gets never contend on it).
static CLOCK: AtomicU64 = AtomicU64::new(1);

/// The current tick of the clock.
pub fn now() -> u64 {
    CLOCK.load(Ordering::Relaxed)
}

/// Advances the clock by one tick (the spiller's scans).
pub(crate) fn tick() {
    CLOCK.fetch_add(1, Ordering::Relaxed);
}

/// The memory and disk totals of the extents units stored (kept here, with
/// the extents; the spiller reads and moves them).
#[derive(Debug, Default)]
pub struct Accounts {
    pub(crate) memory: AtomicU64,
    pub(crate) disk: AtomicU64,
    /// Bytes written to spill files, ever.
    pub(crate) spilled: AtomicU64,
    /// Extents spilled, ever.
    pub(crate) files: AtomicU64,
    /// Spill writes that failed.
    pub(crate) failures: AtomicU64,
    /// Time spent writing (and syncing and mapping) spill files, ns.
    pub(crate) write_ns: AtomicU64,
}

impl Accounts {
    pub(crate) fn add(&self, len: u64, on_disk: bool) {
        let total = if on_disk { &self.disk } else { &self.memory };
        total.fetch_add(len, Ordering::AcqRel);
    }

    pub(crate) fn forget(&self, len: u64, on_disk: bool) {
        let total = if on_disk { &self.disk } else { &self.memory };
        total.fetch_sub(len, Ordering::AcqRel);
    }

    pub(crate) fn to_disk(&self, len: u64) {
        self.memory.fetch_sub(len, Ordering::AcqRel);
        self.disk.fetch_add(len, Ordering::AcqRel);
        self.spilled.fetch_add(len, Ordering::Relaxed);
        self.files.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn to_memory(&self, len: u64) {
        self.disk.fetch_sub(len, Ordering::AcqRel);
        self.memory.fetch_add(len, Ordering::AcqRel);
    }
}

/// Where an extent's bytes are now: `base[offset..offset + len]`.
#[derive(Clone, Debug)]
pub struct Place {
    /// The buffer the extent is a range of: the extent's own buffer, or
    /// the whole shared-memory segment it lives in.
    pub base: Bytes,
    /// Where the extent starts in `base`.
    pub offset: usize,
    /// The segment `base` is, if it is one.
    pub segment: Option<Handle>,
}

/// Where an extent's bytes are, for the spiller ([`crate::spill`]).
pub(crate) mod state {
    /// In memory (a buffer, or a shared-memory segment).
    pub const MEMORY: u8 = 0;
    /// Being written to a spill file.
    pub const SPILLING: u8 = 1;
    /// In a spill file, mapped read-only.
    pub const DISK: u8 = 2;
}

/// One immutable buffer.
pub struct Extent {
    id: u64,
    len: usize,
    place: Mutex<Place>,
    /// The spiller's clock when the extent was last stored or read:
    /// the smallest is the coldest.
    used: AtomicU64,
    /// One of [`state`].
    state: AtomicU8,
    /// The memory and disk counts this extent is in, once a unit with a
    /// spiller stored it.
    accounts: OnceLock<Arc<Accounts>>,
}

impl Drop for Extent {
    fn drop(&mut self) {
        if let Some(a) = self.accounts.get() {
            a.forget(
                self.len as u64,
                self.state.load(Ordering::Acquire) == state::DISK,
            );
        }
    }
}

impl std::fmt::Debug for Extent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = self.place();
        f.debug_struct("Extent")
            .field("id", &self.id)
            .field("len", &self.len)
            .field("segment", &place.segment)
            .finish()
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Extent {
    /// An extent over `bytes` (a received frame or a gathered buffer).
    pub fn new(bytes: Bytes) -> Arc<Extent> {
        Self::placed(Place {
            base: bytes,
            offset: 0,
            segment: None,
        })
    }

    /// An extent that is the whole shared-memory segment `segment`.
    pub fn in_segment(bytes: Bytes, segment: Handle) -> Arc<Extent> {
        Self::placed(Place {
            base: bytes,
            offset: 0,
            segment: Some(segment),
        })
    }

    fn placed(place: Place) -> Arc<Extent> {
        let len = place.base.len();
        Arc::new(Extent {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            len,
            place: Mutex::new(place),
            used: AtomicU64::new(now()),
            state: AtomicU8::new(state::MEMORY),
            accounts: OnceLock::new(),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A process-wide unique id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Where the bytes are now (a cheap clone of shared handles). Marks
    /// the extent used (for the spiller's coldest-first order).
    pub fn place(&self) -> Place {
        // Written only when the spiller's clock moved (a scan), so readers
        // of one extent do not all write its cache line on every get.
        let now = now();
        if self.used.load(Ordering::Relaxed) != now {
            self.used.store(now, Ordering::Relaxed);
        }
        self.place.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The extent's bytes, wherever they are now (zero copy).
    pub fn bytes(&self) -> Bytes {
        let place = self.place();
        place.base.slice(place.offset..place.offset + self.len)
    }

    /// Whether its bytes are in a spill file now.
    pub fn is_spilled(&self) -> bool {
        self.state.load(Ordering::Acquire) == state::DISK
    }

    /// When it was last used (the spiller's clock).
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Counts the extent in `accounts` (once: false if it already is).
    pub(crate) fn account(&self, accounts: &Arc<Accounts>) -> bool {
        // A mapping of a checkpoint file is neither memory nor spilled.
        if self.is_spilled() || self.accounts.set(accounts.clone()).is_err() {
            return false;
        }
        accounts.add(self.len as u64, false);
        true
    }

    /// Marks a new extent as file-backed already (a mapping of a checkpoint
    /// file): the spiller neither counts nor spills it.
    pub fn mark_mapped(&self) {
        if self.accounts.get().is_none() {
            self.state.store(state::DISK, Ordering::Release);
        }
    }

    /// Claims the extent for spilling: its bytes, if it is in memory and
    /// nobody else is spilling it.
    pub(crate) fn claim(&self) -> Option<Bytes> {
        self.state
            .compare_exchange(
                state::MEMORY,
                state::SPILLING,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .ok()?;
        let place = self.place.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Some(place.base.slice(place.offset..place.offset + self.len))
    }

    /// Ends a claim: with `file` (the bytes, mapped from the spill file)
    /// the extent moves there, unless a same-node reader moved it into a
    /// segment meanwhile; without, it stays in memory. Returns whether it
    /// moved.
    pub(crate) fn settle(&self, file: Option<Bytes>, claimed: &Bytes) -> bool {
        let mut place = self.place.lock().unwrap_or_else(|p| p.into_inner());
        let unchanged = place.base.as_ptr() as usize + place.offset == claimed.as_ptr() as usize;
        let moved = match file {
            Some(base) if unchanged => {
                *place = Place {
                    base,
                    offset: 0,
                    segment: None,
                };
                if let Some(a) = self.accounts.get() {
                    a.to_disk(self.len as u64);
                }
                true
            }
            _ => false,
        };
        self.state.store(
            if moved { state::DISK } else { state::MEMORY },
            Ordering::Release,
        );
        moved
    }

    /// Places the extent in a segment (see [`share_all`]); a spilled extent
    /// is back in memory.
    fn to_segment(&self, place: Place) {
        let mut current = self.place.lock().unwrap_or_else(|p| p.into_inner());
        *current = place;
        if self
            .state
            .compare_exchange(
                state::DISK,
                state::MEMORY,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
            && let Some(a) = self.accounts.get()
        {
            a.to_memory(self.len as u64);
        }
    }
}

/// Moves the extents that are not in shared memory yet into one new
/// segment, back to back in the order given (one copy, once), so rows read
/// in that order later are one range of one segment. Extents already in a
/// segment, and empty ones, stay where they are. Readers holding an old
/// place keep it alive until they let go; its bytes are the same.
pub fn share_all(extents: &[Arc<Extent>], shm: &SegmentStore) -> Result<(), ShmError> {
    // One share at a time: two readers of the same rows share one copy.
    static SHARING: Mutex<()> = Mutex::new(());
    let _one = SHARING.lock().unwrap_or_else(|p| p.into_inner());
    let pending: Vec<(&Arc<Extent>, Bytes)> = extents
        .iter()
        .filter(|e| !e.is_empty())
        .filter_map(|e| {
            let place = e.place();
            place
                .segment
                .is_none()
                .then(|| (e, place.base.slice(place.offset..place.offset + e.len)))
        })
        .collect();
    if pending.is_empty() {
        return Ok(());
    }
    let parts: Vec<&[u8]> = pending.iter().map(|(_, b)| b.as_ref()).collect();
    let (whole, segment) = shm.export(&parts)?;
    let mut at = 0;
    for (extent, bytes) in &pending {
        extent.to_segment(Place {
            base: whole.clone(),
            offset: at,
            segment: Some(segment.clone()),
        });
        at += bytes.len();
    }
    Ok(())
}

/// The buffers of one request (its data frames, or the segments it names),
/// so that the pieces decoded from them are stored as offsets into them.
///
/// Looked up by address only within the request's own frames (a handful),
/// at put time; nothing keeps an address once the put is stored.
#[derive(Default)]
pub struct Received {
    /// (start address, length, extent), sorted by address.
    sorted: Vec<(usize, usize, Arc<Extent>)>,
}

impl Received {
    /// The extents of a request's buffers. Empty buffers are skipped.
    pub fn new(extents: impl IntoIterator<Item = Arc<Extent>>) -> Received {
        let mut sorted: Vec<(usize, usize, Arc<Extent>)> = extents
            .into_iter()
            .filter_map(|e| {
                let b = e.bytes();
                (!b.is_empty()).then(|| (b.as_ptr() as usize, b.len(), e))
            })
            .collect();
        sorted.sort_by_key(|(start, _, _)| *start);
        Received { sorted }
    }

    /// Extents over received frames.
    pub fn frames(frames: &[Bytes]) -> Received {
        Received::new(
            frames
                .iter()
                .filter(|f| !f.is_empty())
                .map(|f| Extent::new(f.clone())),
        )
    }

    /// The extent that holds all of `bytes`, and their offset in it.
    pub fn locate(&self, bytes: &[u8]) -> Option<(Arc<Extent>, usize)> {
        let p = bytes.as_ptr() as usize;
        let i = self
            .sorted
            .partition_point(|(start, _, _)| *start <= p)
            .checked_sub(1)?;
        let (start, len, extent) = &self.sorted[i];
        (p + bytes.len() <= start + len).then(|| (extent.clone(), p - start))
    }

    /// The extent that holds `bytes`, or a new extent of exactly them (a
    /// buffer the request did not bring: a gather's output).
    pub fn locate_or_own(&self, bytes: &Bytes) -> (Arc<Extent>, usize, bool) {
        match self.locate(bytes) {
            Some((e, at)) if !bytes.is_empty() => (e, at, true),
            _ => (Extent::new(bytes.clone()), 0, false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn received_locates_slices_of_its_frames() {
        let a = Bytes::from(vec![1u8; 64]);
        let b = Bytes::from(vec![2u8; 32]);
        let r = Received::frames(&[a.clone(), Bytes::new(), b.clone()]);
        let (e, at) = r.locate(&a.slice(8..16)).unwrap();
        assert_eq!((at, e.len()), (8, 64));
        let (e2, at) = r.locate(&b.slice(31..32)).unwrap();
        assert_eq!((at, e2.len()), (31, 32));
        assert_ne!(e.id(), e2.id());
        let other = Bytes::from(vec![3u8; 8]);
        assert!(r.locate(&other).is_none());
        let (own, at, zero_copy) = r.locate_or_own(&other);
        assert_eq!((at, zero_copy, own.len()), (0, false, 8));
    }
}
