//! Storage units: one value per (global index, field).
//!
//! A stored row of a regular tensor is a zero-copy slice of the frame it
//! arrived in ([`Cell::Tensor`] over shared `Bytes`); the frame's memory is
//! freed when the last row pointing into it is cleared or overwritten.
//! Capacity is counted in bytes of the stored rows. A put is all-or-nothing:
//! it is checked completely (lengths, duplicates, capacity) before the first
//! row is written, under the unit's lock.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::batch::Cell;

/// Why a unit refused a request. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("[TQKeyNotFound] key (global_index={index}, field={field}) not found in unit {unit}")]
    KeyNotFound { unit: String, index: u64, field: String },
    #[error("unit {unit} is full: the put needs {needed} more bytes, {free} of {capacity} are free")]
    Capacity { unit: String, needed: u64, free: u64, capacity: u64 },
    #[error("global index {0} appears more than once in one put")]
    DuplicateIndex(u64),
    #[error("field {field} has {rows} rows for {indexes} global indexes")]
    RowCount { field: String, rows: usize, indexes: usize },
    #[error("empty batch: no global indexes")]
    Empty,
}

/// Counters of one unit (monotonic, for metrics).
#[derive(Debug, Default)]
pub struct UnitCounters {
    pub puts: AtomicU64,
    pub gets: AtomicU64,
    pub clears: AtomicU64,
    pub metrics: AtomicU64,
}

/// Hashes a global index with one multiplication (the constant of rustc's
/// FxHasher): SipHash was about 4% of stowd's samples in a perf profile of
/// put/get/clear of 131,072 small rows (the gain in stowd CPU time was
/// within this machine's noise). Not DoS-resistant; indexes come from the
/// cluster's own trainers.
#[derive(Default, Clone, Copy)]
struct IndexHasher(u64);

impl std::hash::Hasher for IndexHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type Rows = HashMap<u64, Vec<(Arc<str>, Cell)>, std::hash::BuildHasherDefault<IndexHasher>>;

#[derive(Default)]
struct Inner {
    rows: Rows,
    bytes: u64,
    keys: u64,
}

/// One storage unit.
pub struct Unit {
    id: String,
    capacity: Option<u64>,
    inner: Mutex<Inner>,
    pub counters: UnitCounters,
}

impl std::fmt::Debug for Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unit").field("id", &self.id).field("capacity", &self.capacity).finish()
    }
}

/// A snapshot of a unit's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitStats {
    pub keys: u64,
    pub rows: u64,
    pub bytes: u64,
    pub capacity: Option<u64>,
}

impl Unit {
    /// A unit with an optional capacity in bytes.
    pub fn new(id: impl Into<String>, capacity: Option<u64>) -> Unit {
        Unit { id: id.into(), capacity, inner: Mutex::new(Inner::default()), counters: UnitCounters::default() }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores `fields[f].1[i]` under `(global_indexes[i], fields[f].0)`.
    /// Existing keys are overwritten. All or nothing.
    pub fn put(&self, global_indexes: &[u64], fields: Vec<(String, Vec<Cell>)>) -> Result<(), StoreError> {
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        check_shape(global_indexes, &fields)?;
        let mut inner = self.lock();
        let (added, freed) = self.check_capacity(&inner, global_indexes, &fields)?;
        for (name, cells) in fields {
            let name: Arc<str> = Arc::from(name.as_str());
            for (g, cell) in global_indexes.iter().zip(cells) {
                let row = inner.rows.entry(*g).or_default();
                match row.iter_mut().find(|(n, _)| *n == name) {
                    Some(slot) => slot.1 = cell,
                    None => {
                        row.push((name.clone(), cell));
                        inner.keys += 1;
                    }
                }
            }
        }
        inner.bytes = inner.bytes - freed + added;
        drop(inner);
        release::note_freed(freed);
        Ok(())
    }

    /// Checks, without storing anything, that [`Unit::put`] of these cells
    /// would succeed now (a put over several units checks every unit first).
    pub fn check_put(&self, global_indexes: &[u64], fields: &[(String, Vec<Cell>)]) -> Result<(), StoreError> {
        check_shape(global_indexes, fields)?;
        self.check_capacity(&self.lock(), global_indexes, fields).map(drop)
    }

    /// Capacity: bytes after the put, counting overwritten cells as freed.
    /// Returns (bytes added, bytes freed).
    fn check_capacity(
        &self,
        inner: &Inner,
        global_indexes: &[u64],
        fields: &[(String, Vec<Cell>)],
    ) -> Result<(u64, u64), StoreError> {
        let added: u64 = fields.iter().flat_map(|(_, c)| c.iter()).map(|c| c.byte_len() as u64).sum();
        let mut freed = 0u64;
        for (name, _) in fields {
            for g in global_indexes {
                if let Some(row) = inner.rows.get(g)
                    && let Some((_, cell)) = row.iter().find(|(n, _)| **n == **name)
                {
                    freed += cell.byte_len() as u64;
                }
            }
        }
        if let Some(capacity) = self.capacity {
            let after = inner.bytes - freed + added;
            if after > capacity {
                return Err(StoreError::Capacity {
                    unit: self.id.clone(),
                    needed: added.saturating_sub(freed),
                    free: capacity.saturating_sub(inner.bytes),
                    capacity,
                });
            }
        }
        Ok((added, freed))
    }

    /// The cells of `fields` at `global_indexes`, field by field, in request
    /// order. Any missing key fails the whole request.
    pub fn get(&self, global_indexes: &[u64], fields: &[String]) -> Result<Vec<Vec<Cell>>, StoreError> {
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        let inner = self.lock();
        fields
            .iter()
            .map(|field| {
                global_indexes
                    .iter()
                    .map(|g| {
                        inner
                            .rows
                            .get(g)
                            .and_then(|row| row.iter().find(|(n, _)| **n == **field))
                            .map(|(_, c)| c.clone())
                            .ok_or_else(|| StoreError::KeyNotFound { unit: self.id.clone(), index: *g, field: field.clone() })
                    })
                    .collect()
            })
            .collect()
    }

    /// Removes every field of the given indexes (or only `fields`); returns
    /// the number of keys removed. Unknown indexes are ignored.
    pub fn clear(&self, global_indexes: &[u64], fields: Option<&[String]>) -> u64 {
        self.counters.clears.fetch_add(1, Ordering::Relaxed);
        let mut inner = self.lock();
        let (mut keys, mut bytes) = (0u64, 0u64);
        for g in global_indexes {
            match fields {
                None => {
                    if let Some(row) = inner.rows.remove(g) {
                        keys += row.len() as u64;
                        bytes += row.iter().map(|(_, c)| c.byte_len() as u64).sum::<u64>();
                    }
                }
                Some(fields) => {
                    if let Some(row) = inner.rows.get_mut(g) {
                        row.retain(|(n, c)| {
                            let drop = fields.iter().any(|f| **f == **n);
                            if drop {
                                keys += 1;
                                bytes += c.byte_len() as u64;
                            }
                            !drop
                        });
                        if row.is_empty() {
                            inner.rows.remove(g);
                        }
                    }
                }
            }
        }
        inner.keys -= keys;
        inner.bytes -= bytes;
        drop(inner);
        release::note_freed(bytes);
        keys
    }

    /// Replaces the stored cell of `(index, field)` by `new` if it still
    /// holds exactly the bytes of `old` (same address and length): used to
    /// move a row into shared memory once. Returns whether it replaced.
    /// The byte count is unchanged (same length).
    pub fn swap(&self, index: u64, field: &str, old: &Cell, new: Cell) -> bool {
        let (Cell::Tensor(old), Cell::Tensor(fresh)) = (old, &new) else { return false };
        if old.byte_len() != fresh.byte_len() {
            return false;
        }
        let mut inner = self.lock();
        let Some(row) = inner.rows.get_mut(&index) else { return false };
        let Some((_, slot)) = row.iter_mut().find(|(n, _)| **n == *field) else { return false };
        let same = matches!(&*slot, Cell::Tensor(t)
            if t.buffer().as_ptr() == old.buffer().as_ptr() && t.byte_len() == old.byte_len());
        if same {
            *slot = new;
        }
        same
    }

    /// Current size.
    pub fn stats(&self) -> UnitStats {
        let inner = self.lock();
        UnitStats { keys: inner.keys, rows: inner.rows.len() as u64, bytes: inner.bytes, capacity: self.capacity }
    }
}

/// Gives memory freed by clears and overwrites back to the OS.
///
/// glibc's malloc keeps freed chunks in its arenas (one per thread that
/// allocated, up to 8 per core) and returns a page to the OS only when the
/// free space sits at the top of an arena's heap above the trim threshold,
/// which rises with every large free. Rows are slices of the frames they
/// arrived in, so frames are freed in whatever order their last rows are
/// cleared: under a steady put/clear load the arenas end up full of free
/// holes, and after everything is cleared `stowd` still held 5 to 10 times
/// the bytes it ever stored (measured: 390 MiB resident for 46 MiB of rows,
/// 48 MiB at start, unchanged after the final clear; `malloc_trim(0)` brought
/// it back to 53 MiB). So a background thread calls `malloc_trim(0)` (which
/// also releases free pages in the middle of the arenas) once frees have
/// stopped for [`release::QUIET`], or every [`release::MAX_INTERVAL`] while they go on, and
/// once more [`release::FOLLOW_UP`] later. Frees only note a byte count; the trim
/// never runs on a request's path (it does hold each arena's lock while it
/// walks it: 1 to 90 ms measured on a 400 MiB debug-build heap).
mod release {
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
    unsafe extern "C" {
        fn malloc_trim(pad: usize) -> i32;
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
                        pending = wake.wait_timeout(pending, at - Instant::now()).unwrap_or_else(|p| p.into_inner()).0;
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
                pending = wake.wait_timeout(pending, wait).unwrap_or_else(|p| p.into_inner()).0;
            }
        }
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn trim(freed: u64) {
        let started = Instant::now();
        // SAFETY: malloc_trim only walks glibc's own arenas, under their locks.
        unsafe { malloc_trim(0) };
        tracing::trace!(freed, took_us = started.elapsed().as_micros() as u64, "malloc_trim");
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
            pending.bytes += bytes;
            pending.last_free = Some(Instant::now());
            wake.notify_one();
        }
    }
}

/// Checks a put's indexes (at least one, distinct) and row counts.
fn check_shape(global_indexes: &[u64], fields: &[(String, Vec<Cell>)]) -> Result<(), StoreError> {
    if global_indexes.is_empty() {
        return Err(StoreError::Empty);
    }
    let mut seen = std::collections::HashSet::with_capacity(global_indexes.len());
    for &g in global_indexes {
        if !seen.insert(g) {
            return Err(StoreError::DuplicateIndex(g));
        }
    }
    for (name, cells) in fields {
        if cells.len() != global_indexes.len() {
            return Err(StoreError::RowCount { field: name.clone(), rows: cells.len(), indexes: global_indexes.len() });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Value;
    use crate::tensor::{DType, Tensor};
    use bytes::Bytes;

    fn s(v: &str) -> Cell {
        Cell::Value(Value::Str(v.into()))
    }

    #[test]
    fn put_get_overwrite_clear() {
        let unit = Unit::new("u0", None);
        unit.put(&[1, 2], vec![("a".into(), vec![s("x"), s("yy")])]).unwrap();
        assert_eq!(unit.stats().bytes, 3);
        unit.put(&[2], vec![("a".into(), vec![s("zzzz")])]).unwrap();
        assert_eq!(unit.stats(), UnitStats { keys: 2, rows: 2, bytes: 5, capacity: None });
        assert_eq!(unit.get(&[2, 1], &["a".into()]).unwrap(), vec![vec![s("zzzz"), s("x")]]);
        let err = unit.get(&[1, 9], &["a".into()]).unwrap_err();
        assert!(err.to_string().starts_with("[TQKeyNotFound] "));
        assert_eq!(unit.clear(&[1, 7], None), 1);
        assert_eq!(unit.stats().bytes, 4);
    }

    #[test]
    fn puts_are_all_or_nothing() {
        let unit = Unit::new("u0", Some(10));
        unit.put(&[1], vec![("a".into(), vec![s("12345")])]).unwrap();
        let before = unit.stats();
        assert!(matches!(unit.put(&[2, 2], vec![("a".into(), vec![s("1"), s("2")])]), Err(StoreError::DuplicateIndex(2))));
        assert!(matches!(
            unit.put(&[2, 3], vec![("a".into(), vec![s("1"), s("2")]), ("b".into(), vec![s("1")])]),
            Err(StoreError::RowCount { .. })
        ));
        assert!(matches!(unit.put(&[2], vec![("a".into(), vec![s("123456")])]), Err(StoreError::Capacity { .. })));
        assert_eq!(unit.stats(), before);
        assert!(unit.get(&[2], &["a".into()]).is_err());
        // Overwriting frees the old bytes first.
        unit.put(&[1], vec![("a".into(), vec![s("1234567890")])]).unwrap();
        assert_eq!(unit.stats().bytes, 10);
    }

    #[test]
    fn check_put_stores_nothing() {
        let unit = Unit::new("u0", Some(4));
        unit.put(&[1], vec![("a".into(), vec![s("12")])]).unwrap();
        let too_big = [("a".to_string(), vec![s("123")])];
        assert!(matches!(unit.check_put(&[2], &too_big), Err(StoreError::Capacity { .. })));
        // Overwriting index 1 frees its 2 bytes first.
        unit.check_put(&[1], &too_big).unwrap();
        assert!(matches!(unit.check_put(&[2, 2], &[]), Err(StoreError::DuplicateIndex(2))));
        assert_eq!(unit.stats(), UnitStats { keys: 1, rows: 1, bytes: 2, capacity: Some(4) });
    }

    #[test]
    fn clearing_the_last_row_frees_the_frame() {
        let frame = Bytes::from(vec![0u8; 64]);
        let t = Tensor::contiguous(frame.clone(), DType::F32, vec![4, 4]).unwrap();
        let unit = Unit::new("u0", None);
        let cells = (0..4).map(|i| Cell::Tensor(t.row_tensor(i).unwrap())).collect();
        unit.put(&[0, 1, 2, 3], vec![("t".into(), cells)]).unwrap();
        drop(t);
        assert!(!frame.is_unique());
        unit.clear(&[0, 1, 2], None);
        assert!(!frame.is_unique());
        unit.clear(&[3], None);
        assert!(frame.is_unique(), "the frame is still pinned after the last clear");
    }
}
