//! Storage units: rows indexed into immutable extents.
//!
//! A put stores each (field, piece) it was given as one [`Column`]: a run of
//! rows that lie in one extent ([`crate::extent`]) at a constant stride (a
//! regular field), one row each (a nested field, every row its own range of
//! an extent), or plain values. A unit numbers the global indexes it holds
//! ([`RowNumbers`]: one hash-map entry an index, with a count of its
//! fields), and each field keeps, by row number, where its row is
//! ([`FieldIndex`]: (column, row in it), in pages of consecutive numbers).
//! A put of many fields looks each index up once, not once a field. No
//! heap allocation per row.
//!
//! A get answers, per field, the columns it touched and [`Piece`]s: runs
//! of consecutive rows of one column answering evenly spaced request
//! positions ([`Rows`]). A get of rows in put order is one piece per
//! column, however many rows, and whoever sends them finds runs by
//! comparing offsets, not addresses. Overwrite and clear drop a row's
//! reference to its column; a column with no live row is dropped, and with
//! it its reference to the extent. A put's regular columns that lie in one
//! extent of a unit are allocated together ([`ColumnRef`]): the
//! allocation goes with the last of them. Capacity is counted in bytes of the
//! stored rows. A put is all-or-nothing: it is checked completely
//! (lengths, duplicates, capacity) before the first row is written, under
//! the unit's lock.
//!
//! | module | what it holds |
//! |---|---|
//! | this file | [`Unit`]: the per-field index, capacity, put/get/clear; [`StoreError`] |
//! | [`column`] | [`Column`]: one put's rows of one field, and back to cells; [`ColumnRef`]: a stored column, in its put's [`Group`] |
//! | [`rows`] | [`Rows`], [`Piece`] and [`Run`]: what a get answers, grouped for the encoders |
//! | `seqs` | [`Seq`]: a run of requested indexes at evenly spaced positions; a column's indexes as a run or a list |
//! | `snapshot` | [`Unit::snapshot`] and [`Unit::replace_with`]: every row at once, for checkpoints |

use std::collections::HashMap;
use std::sync::Arc;

use smallvec::SmallVec;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::journal::Journal;
use crate::spill::Spiller;

/// Why a unit refused a request. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("[TQKeyNotFound] key (global_index={index}, field={field}) not found in unit {unit}")]
    KeyNotFound {
        unit: String,
        index: u64,
        field: String,
    },
    #[error(
        "unit {unit} is full: the put needs {needed} more bytes, {free} of {capacity} are free \
         (bound by [units] capacity_bytes, or by default by [units] memory_percent)"
    )]
    Capacity {
        unit: String,
        needed: u64,
        free: u64,
        capacity: u64,
    },
    #[error(
        "[DataLost] key (global_index={index}, field={field}) in unit {unit} was written or \
         cleared after checkpoint {checkpoint}, which this stowd was restored from: its value \
         is lost (put it again)"
    )]
    DataLost {
        unit: String,
        index: u64,
        field: String,
        checkpoint: Arc<str>,
    },
    #[error("the put or clear was not made: {0}")]
    Journal(String),
    #[error(transparent)]
    Spill(#[from] crate::spill::SpillError),
    #[error("global index {0} appears more than once in one put")]
    DuplicateIndex(u64),
    #[error("field {field} has {rows} rows for {indexes} global indexes")]
    RowCount {
        field: String,
        rows: u64,
        indexes: usize,
    },
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

mod column;
mod rows;
mod seqs;
mod snapshot;
#[cfg(test)]
mod tests;

pub use column::{Column, ColumnRef, Group, NestedRow, RegularColumn, shared_row_shape};
pub use rows::{Piece, Rows, Run, Runs, Snapshots};
use seqs::ColIndexes;
pub use seqs::Seq;
pub use snapshot::{RUN_BYTES, Snapshot, Stored, add_rows};

/// The row maps live in `stowage-index`, which is optimised even in debug
/// builds (see its crate doc).
use stowage_index::{FieldIndex, RowNumbers};

/// Where a stored row is.
#[derive(Clone, Copy, Debug)]
struct Loc {
    column: u32,
    row: u32,
}

impl Loc {
    /// As stored in an [`IndexMap`]: the column in the high half.
    fn pack(self) -> u64 {
        (u64::from(self.column) << 32) | u64::from(self.row)
    }

    fn unpack(v: u64) -> Loc {
        Loc {
            column: (v >> 32) as u32,
            row: v as u32,
        }
    }
}

/// A stored column, the global index of each of its rows, and how many of
/// its rows are still indexed. While all are (`live` equals the row
/// count), row `r` is where its global index is: a get of rows in put
/// order follows the column, per run of requested indexes, not per row.
struct Slot {
    column: ColumnRef,
    indexes: ColIndexes,
    live: u64,
    /// The unit's put generation that stored it: the version of its rows
    /// ([`Unit::versions`]).
    generation: u64,
}

impl Slot {
    fn intact(&self) -> bool {
        self.live == self.indexes.len()
    }
}

#[derive(Default)]
struct Inner {
    /// Per field: row number -> where the row is. Hashed by foldhash
    /// (seeded per map, as hashbrown's default), not SipHash: a field name
    /// is looked up once per field per unit in every put and get (128
    /// times in a 32-field call over 4 units).
    fields: HashMap<Arc<str>, FieldIndex, foldhash::fast::RandomState>,
    /// Global index -> row number, and the fields each number has.
    rows: RowNumbers,
    /// Columns by number; `None` is a free number (in `free`).
    columns: Vec<Option<Slot>>,
    free: Vec<u32>,
    bytes: u64,
    keys: u64,
    /// Indexes lost to a restore (written or cleared after the checkpoint
    /// restored), and the checkpoint's name; until put again.
    lost: HashMap<u64, Arc<str>>,
    /// Puts stored so far: the generation of the next put's columns is
    /// one more (so 0 is never a stored row's version).
    generation: u64,
}

/// Stores a column (rows for `indexes`, as `col_indexes`) under a free
/// number.
fn add_column(
    columns: &mut Vec<Option<Slot>>,
    free: &mut Vec<u32>,
    column: ColumnRef,
    col_indexes: ColIndexes,
    generation: u64,
) -> u32 {
    let slot = Some(Slot {
        generation,
        live: col_indexes.len(),
        indexes: col_indexes,
        column,
    });
    match free.pop() {
        Some(i) => {
            columns[i as usize] = slot;
            i
        }
        None => {
            columns.push(slot);
            (columns.len() - 1) as u32
        }
    }
}

/// Drops one row's reference to its column (and the column with its last
/// row); returns the row's bytes.
fn release(columns: &mut [Option<Slot>], free: &mut Vec<u32>, loc: Loc) -> u64 {
    let slot = columns[loc.column as usize]
        .as_mut()
        .expect("indexed rows point at live columns");
    let len = slot.column.row_len(loc.row as usize);
    slot.live -= 1;
    if slot.live == 0 {
        columns[loc.column as usize] = None;
        free.push(loc.column);
    }
    len
}

impl Inner {
    fn row_len(&self, loc: Loc) -> u64 {
        self.columns[loc.column as usize]
            .as_ref()
            .expect("indexed rows point at live columns")
            .column
            .row_len(loc.row as usize)
    }

    /// Where `(g, field)` is stored, if it is.
    fn find(&self, index: &FieldIndex, g: u64) -> Option<Loc> {
        index.get(self.rows.get(g)?).map(Loc::unpack)
    }

    /// Stores `columns` (their rows, in order) under `(indexes[i], name)`,
    /// as rows of put `generation`; a row already stored there is
    /// released. Returns the bytes released.
    ///
    /// `nums` are the indexes' row numbers ([`RowNumbers::number`]), and
    /// `added[i]` counts the fields new at `nums[i]` (the put's fields
    /// stored so far): the caller adds them to the numbers' counts once,
    /// after the last field. `whole` is the indexes as a column's
    /// ([`ColIndexes`]) when they are a run, kept by the first field whose
    /// column covers them all for the next (a list is made for each).
    #[allow(clippy::too_many_arguments)]
    fn store_field(
        &mut self,
        name: &Arc<str>,
        indexes: &[u64],
        nums: &[u32],
        columns_in: impl Iterator<Item = ColumnRef>,
        generation: u64,
        added: &mut [u32],
        whole: &mut Option<ColIndexes>,
    ) -> u64 {
        let Inner {
            fields,
            columns,
            free,
            keys,
            ..
        } = self;
        // One lookup of the name (and one more for a field's first row).
        let index = match fields.get_mut(&**name) {
            Some(index) => index,
            None => fields.entry(name.clone()).or_default(),
        };
        let before = index.len();
        let mut freed = 0u64;
        let mut next = 0usize;
        for column in columns_in {
            let rows = column.rows() as usize;
            let span = next..next + rows;
            let col_indexes = if rows == indexes.len() {
                match whole {
                    Some(ix) => ix.clone(),
                    None => {
                        let ix = ColIndexes::new(indexes);
                        if let ColIndexes::Arith { .. } = ix {
                            *whole = Some(ix.clone());
                        }
                        ix
                    }
                }
            } else {
                ColIndexes::new(&indexes[span.clone()])
            };
            let c = add_column(columns, free, column, col_indexes, generation);
            let first = Loc { column: c, row: 0 }.pack();
            index.set_run(&nums[span.clone()], first, &mut added[span], &mut |old| {
                freed += release(columns, free, Loc::unpack(old));
            });
            next += rows;
        }
        *keys += (index.len() - before) as u64;
        freed
    }
}

/// One storage unit.
pub struct Unit {
    id: String,
    capacity: Option<u64>,
    inner: Mutex<Inner>,
    /// Where puts and clears are recorded once checkpoints are taken.
    journal: Arc<Journal>,
    /// Spills the coldest extents to disk, if configured (then `capacity`
    /// is None: the spiller bounds memory).
    spill: Option<Arc<Spiller>>,
    /// keys, rows (distinct indexes), bytes: copied from `inner` before each
    /// write releases the lock, so that [`Unit::stats`] (the `stats` and
    /// metrics replies) never waits behind a large put.
    sizes: [AtomicU64; 3],
    pub counters: UnitCounters,
    /// Drawn at random when the unit is made: with a put generation it is
    /// a row's version ([`Unit::versions`]), so a restarted unit's rows
    /// never match a version its predecessor gave.
    incarnation: u64,
}

impl std::fmt::Debug for Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unit")
            .field("id", &self.id)
            .field("capacity", &self.capacity)
            .finish()
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

/// [`Unit::check_put`]'s answer that a put's rows have the right shape (a
/// row a global index in every field, no index twice), with the bytes they
/// add, for [`Unit::put_journaled`] of the same rows, which then neither
/// checks them again nor counts them (about 1,800 instructions a unit of
/// a 32-field put, callgrind). Capacity is checked again, under the
/// unit's lock.
pub struct PutChecked {
    added: u64,
}

/// The columns of one field of a put, in row order, under the field's
/// name (shared by the units of a put, and kept by a unit that stores a
/// field for the first time).
pub type PutField = (Arc<str>, Columns);

/// The columns of one field of a put: inline for the usual one (a put's
/// field at a unit is one piece of its frame), so a put of many fields
/// allocates no list per (field, unit).
pub type Columns = SmallVec<[Column; 1]>;

impl Unit {
    /// A unit with an optional capacity in bytes.
    pub fn new(id: impl Into<String>, capacity: Option<u64>) -> Unit {
        Unit {
            id: id.into(),
            capacity,
            inner: Mutex::new(Inner::default()),
            journal: Arc::new(Journal::new()),
            spill: None,
            sizes: Default::default(),
            counters: UnitCounters::default(),
            incarnation: new_incarnation(),
        }
    }

    /// This unit's incarnation (see [`Unit::versions`]).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The version of each (field, index) of `seqs`: the generation of the
    /// put that stored it, 0 if it is not stored (nothing is refused).
    /// Field-major: `out[f * n + pos]` for the row at position `pos` of
    /// the `n` the seqs name. With [`Unit::incarnation`] it tells a peer
    /// whether a copy it keeps is still the stored row: a put or clear of
    /// the row changes it, and a restarted unit has another incarnation.
    pub fn versions(&self, seqs: &[Seq], fields: &[String]) -> Vec<u64> {
        let n: u64 = seqs.iter().map(|s| s.count).sum();
        let mut out = vec![0u64; n as usize * fields.len()];
        let inner = self.lock();
        for (f, field) in fields.iter().enumerate() {
            let Some(index) = inner.fields.get(field.as_str()) else {
                continue;
            };
            let base = f * n as usize;
            for seq in seqs {
                for k in 0..seq.count {
                    let (g, pos) = seq.at(k);
                    if let Some(loc) = inner.find(index, g) {
                        let slot = inner.columns[loc.column as usize]
                            .as_ref()
                            .expect("indexed rows point at live columns");
                        out[base + pos as usize] = slot.generation;
                    }
                }
            }
        }
        out
    }

    /// The same unit, recording its puts and clears in `journal` (shared
    /// by every unit of a `stowd`).
    pub fn with_journal(mut self, journal: Arc<Journal>) -> Unit {
        self.journal = journal;
        self
    }

    /// The same unit, spilling through `spill` (shared by every unit of a
    /// `stowd`); its own capacity no longer applies.
    pub fn with_spill(mut self, spill: Arc<Spiller>) -> Unit {
        self.spill = Some(spill);
        self.capacity = None;
        self
    }

    /// The spiller, if the unit spills.
    pub fn spiller(&self) -> Option<&Arc<Spiller>> {
        self.spill.as_ref()
    }

    /// Counts a put's extents with the spiller and makes room for them
    /// (see [`crate::spill`]).
    fn admit(&self, fields: &[PutField]) -> Result<(), StoreError> {
        let Some(spill) = &self.spill else {
            return Ok(());
        };
        let extents = fields.iter().flat_map(|(_, c)| c.iter()).flat_map(|c| {
            let (regular, nested) = match c {
                Column::Regular(r) => (Some(&r.extent), &[][..]),
                Column::Nested(rows) => (None, &rows[..]),
                Column::Values(_) => (None, &[][..]),
            };
            regular.into_iter().chain(nested.iter().map(|n| &n.extent))
        });
        spill.admit(extents)?;
        Ok(())
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The journal this unit records in.
    pub fn journal(&self) -> &Arc<Journal> {
        &self.journal
    }

    /// Records the change of `indexes` in the journal (once checkpoints are
    /// taken); the change must be made while the guard is held.
    fn touch(&self, indexes: &[u64]) -> Result<crate::journal::Touch<'_>, StoreError> {
        self.journal
            .touch(indexes)
            .map_err(|e| StoreError::Journal(e.to_string()))
    }

    /// Makes `indexes` the ones lost to the restore of `checkpoint`
    /// (replacing earlier marks): a get of one fails with
    /// [`StoreError::DataLost`] until it is put again.
    pub fn set_lost(&self, indexes: &[u64], checkpoint: &Arc<str>) {
        let mut inner = self.lock();
        inner.lost = indexes.iter().map(|&g| (g, checkpoint.clone())).collect();
    }

    /// How many indexes are marked lost.
    pub fn lost(&self) -> usize {
        self.lock().lost.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes the sizes of `inner` for [`Unit::stats`] (under the lock).
    fn publish(&self, inner: &Inner) {
        let values = [inner.keys, inner.rows.len() as u64, inner.bytes];
        for (slot, v) in self.sizes.iter().zip(values) {
            slot.store(v, Ordering::Relaxed);
        }
    }

    /// Stores the rows of `fields[f].1` (its columns' rows, in order) under
    /// `(global_indexes[i], fields[f].0)`. Existing keys are overwritten.
    /// All or nothing.
    pub fn put(&self, global_indexes: &[u64], fields: Vec<PutField>) -> Result<(), StoreError> {
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        check_shape(global_indexes, &fields)?;
        self.admit(&fields)?;
        let added = put_bytes(&fields);
        if self.journal.is_active() {
            // A put refused for capacity is not journaled.
            self.check_capacity(&self.lock(), global_indexes, &fields, added)?;
        }
        let journaled = self.touch(global_indexes)?;
        self.store(global_indexes, fields, added, &journaled)
    }

    /// [`Unit::put`] of rows whose indexes the caller journaled already
    /// (`journaled`, held until the put returns: a put over several units
    /// journals all of them first, so that a journal that cannot be written
    /// refuses the put on every unit).
    ///
    /// `checked` is what [`Unit::check_put`] of these rows answered: their
    /// shape (counts, duplicates) is not checked again.
    pub fn put_journaled(
        &self,
        global_indexes: &[u64],
        fields: Vec<PutField>,
        journaled: &crate::journal::Touch<'_>,
        checked: PutChecked,
    ) -> Result<(), StoreError> {
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        self.admit(&fields)?;
        self.store(global_indexes, fields, checked.added, journaled)
    }

    fn store(
        &self,
        global_indexes: &[u64],
        mut fields: Vec<PutField>,
        added: u64,
        _journaled: &crate::journal::Touch<'_>,
    ) -> Result<(), StoreError> {
        let mut inner = self.lock();
        self.check_capacity(&inner, global_indexes, &fields, added)?;
        if !inner.lost.is_empty() {
            for g in global_indexes {
                inner.lost.remove(g);
            }
        }
        let mut freed = 0u64;
        inner.generation += 1;
        let generation = inner.generation;
        let mut new_fields: SmallVec<[u32; 64]> = smallvec::smallvec![0; global_indexes.len()];
        // Each index looked up once, for every field. A put of no field
        // numbers nothing (a number is only kept while it has a field).
        let mut nums: SmallVec<[u32; 64]> = smallvec::smallvec![0; global_indexes.len()];
        if !fields.is_empty() {
            inner.rows.number(global_indexes, &mut nums);
        }
        let mut whole = None;
        // The put's columns of one extent in one allocation. The names are
        // lent, and dropped with the list once the lock is given back (no
        // reference count taken and given back a field under the lock).
        if let Some(group) = Group::whole(&mut fields) {
            for (f, (name, _)) in fields.iter().enumerate() {
                freed += inner.store_field(
                    name,
                    global_indexes,
                    &nums,
                    std::iter::once(ColumnRef::of_whole(&group, f)),
                    generation,
                    &mut new_fields,
                    &mut whole,
                );
            }
        } else {
            let mut group = Group::take(&mut fields, |(_, c)| c);
            for (name, columns_in) in &mut fields {
                let columns_in = std::mem::take(columns_in)
                    .into_iter()
                    .map(|c| ColumnRef::place(&mut group, c));
                freed += inner.store_field(
                    name,
                    global_indexes,
                    &nums,
                    columns_in,
                    generation,
                    &mut new_fields,
                    &mut whole,
                );
            }
        }
        inner.rows.add_fields(&nums, &new_fields);
        inner.bytes = inner.bytes - freed + added;
        self.publish(&inner);
        drop(inner);
        drop(fields);
        crate::release::note_freed(freed);
        Ok(())
    }

    /// Checks, without storing anything, that [`Unit::put`] of these rows
    /// would succeed now (a put over several units checks every unit first).
    pub fn check_put(
        &self,
        global_indexes: &[u64],
        fields: &[PutField],
    ) -> Result<PutChecked, StoreError> {
        check_shape(global_indexes, fields)?;
        self.admit(fields)?;
        let added = put_bytes(fields);
        self.check_capacity(&self.lock(), global_indexes, fields, added)?;
        Ok(PutChecked { added })
    }

    /// Capacity: refuses a put the unit cannot hold, counting the rows it
    /// overwrites as freed. `added` is what the put adds ([`put_bytes`]).
    fn check_capacity(
        &self,
        inner: &Inner,
        global_indexes: &[u64],
        fields: &[PutField],
        added: u64,
    ) -> Result<(), StoreError> {
        let Some(capacity) = self.capacity else {
            return Ok(());
        };
        // What the put replaces only matters when the unit would not take
        // it all on top of what it holds: the common put skips the lookups
        // (it would make them twice, in `check_put` and `store`, and
        // `store_field` counts what it frees as it writes).
        if inner.bytes.saturating_add(added) <= capacity {
            return Ok(());
        }
        let mut freed = 0u64;
        for (name, _) in fields {
            if let Some(index) = inner.fields.get(&**name) {
                freed += global_indexes
                    .iter()
                    .filter_map(|&g| inner.find(index, g))
                    .map(|loc| inner.row_len(loc))
                    .sum::<u64>();
            }
        }
        let after = inner.bytes - freed + added;
        if after > capacity {
            return Err(StoreError::Capacity {
                unit: self.id.clone(),
                needed: added.saturating_sub(freed),
                free: capacity.saturating_sub(inner.bytes),
                capacity,
            });
        }
        Ok(())
    }

    /// The rows of `fields` at `global_indexes`, field by field, in request
    /// order. Any missing key fails the whole request.
    pub fn get(&self, global_indexes: &[u64], fields: &[String]) -> Result<Vec<Rows>, StoreError> {
        self.get_seqs(&Seq::from_list(global_indexes), fields)
    }

    /// The rows of `fields` at the indexes of `seqs`, field by field, each
    /// row as a [`Piece`] at the position its seq gives. A seq that
    /// follows a column whose rows are all still indexed costs one lookup,
    /// whatever its length. Any missing key fails the whole request.
    pub fn get_seqs(&self, seqs: &[Seq], fields: &[String]) -> Result<Vec<Rows>, StoreError> {
        self.get_versioned(seqs, fields, None)
    }

    /// [`Unit::get_seqs`], also writing each returned row's version into
    /// `versions` (laid out as [`Unit::versions`]), read under the same
    /// lock as the rows.
    pub fn get_versioned(
        &self,
        seqs: &[Seq],
        fields: &[String],
        versions: Option<&mut Vec<u64>>,
    ) -> Result<Vec<Rows>, StoreError> {
        let mut out: Vec<Rows> = fields.iter().map(|_| Rows::default()).collect();
        self.get_into(seqs, fields, versions, &mut out)?;
        Ok(out)
    }

    /// [`Unit::get_versioned`] adding each field's rows to `out[field]`
    /// (its columns after those already there): a get over several units
    /// gathers them in one [`Rows`] a field, with no [`Rows`] a (unit,
    /// field) to allocate and merge (a 32-field get of 4 rows over 4 units
    /// made and freed 256 vectors that way). On an error `out` holds part
    /// of the rows (the caller drops them with the request).
    pub fn get_into(
        &self,
        seqs: &[Seq],
        fields: &[String],
        mut versions: Option<&mut Vec<u64>>,
        out: &mut [Rows],
    ) -> Result<(), StoreError> {
        assert_eq!(out.len(), fields.len(), "one Rows a field");
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        let n: u64 = seqs.iter().map(|s| s.count).sum();
        if let Some(v) = versions.as_deref_mut() {
            v.clear();
            v.resize(n as usize * fields.len(), 0);
        }
        let inner = self.lock();
        let missing = |g: u64, field: &str| match inner.lost.get(&g) {
            Some(checkpoint) => StoreError::DataLost {
                unit: self.id.clone(),
                index: g,
                field: field.to_string(),
                checkpoint: checkpoint.clone(),
            },
            None => StoreError::KeyNotFound {
                unit: self.id.clone(),
                index: g,
                field: field.to_string(),
            },
        };
        // The row number of each seq's first index, looked up once for
        // every field (a seq that follows its column needs no other).
        let firsts: SmallVec<[Option<u32>; 8]> = if fields.len() > 1 {
            seqs.iter().map(|s| inner.rows.get(s.at(0).0)).collect()
        } else {
            SmallVec::new()
        };
        for ((f, field), rows) in fields.iter().enumerate().zip(out.iter_mut()) {
            let Some(index) = inner.fields.get(field.as_str()) else {
                return Err(missing(seqs.first().map_or(0, |s| s.start), field));
            };
            // Column number in the unit -> in `rows`.
            let mut numbered: rows::FewMap<u32, u32> = rows::FewMap::default();
            let mut last: Option<(u32, u32)> = None;
            for (q, seq) in seqs.iter().enumerate() {
                let mut k = 0;
                while k < seq.count {
                    let (g, pos) = seq.at(k);
                    let found = match firsts.get(q) {
                        Some(&n) if k == 0 => n.and_then(|n| index.get(n)).map(Loc::unpack),
                        _ => inner.find(index, g),
                    };
                    let loc = found.ok_or_else(|| missing(g, field))?;
                    let slot = inner.columns[loc.column as usize]
                        .as_ref()
                        .expect("indexed rows point at live columns");
                    let m = if slot.intact() {
                        slot.indexes.follow(loc.row, g, seq.step, seq.count - k)
                    } else {
                        1
                    };
                    let ours = match last {
                        Some((unit_col, ours)) if unit_col == loc.column => ours,
                        _ => numbered.get_or_insert_with(loc.column, || {
                            rows.columns.push(slot.column.clone());
                            (rows.columns.len() - 1) as u32
                        }),
                    };
                    last = Some((loc.column, ours));
                    if let Some(v) = versions.as_deref_mut() {
                        let base = f * n as usize;
                        for j in 0..m {
                            v[base + (pos + j * seq.pos_step) as usize] = slot.generation;
                        }
                    }
                    rows.push(Piece {
                        pos,
                        pos_step: seq.pos_step,
                        column: ours,
                        row: loc.row,
                        count: m as u32,
                    });
                    k += m;
                }
            }
        }
        Ok(())
    }

    /// Removes every field of the given indexes (or only `fields`); returns
    /// the number of keys removed. Unknown indexes are ignored.
    pub fn clear(
        &self,
        global_indexes: &[u64],
        fields: Option<&[String]>,
    ) -> Result<u64, StoreError> {
        self.counters.clears.fetch_add(1, Ordering::Relaxed);
        let journaled = self.touch(global_indexes)?;
        Ok(self.remove_rows(global_indexes, fields, &journaled))
    }

    /// [`Unit::clear`] of indexes the caller journaled already (see
    /// [`Unit::put_journaled`]).
    pub fn clear_journaled(
        &self,
        global_indexes: &[u64],
        fields: Option<&[String]>,
        journaled: &crate::journal::Touch<'_>,
    ) -> u64 {
        self.counters.clears.fetch_add(1, Ordering::Relaxed);
        self.remove_rows(global_indexes, fields, journaled)
    }

    fn remove_rows(
        &self,
        global_indexes: &[u64],
        fields: Option<&[String]>,
        _journaled: &crate::journal::Touch<'_>,
    ) -> u64 {
        let mut inner = self.lock();
        if !inner.lost.is_empty() {
            for g in global_indexes {
                inner.lost.remove(g);
            }
        }
        let keys_before = inner.keys;
        let mut bytes = 0u64;
        let Inner {
            fields: by_name,
            rows,
            columns,
            free,
            keys,
            ..
        } = &mut *inner;
        // Each index looked up once; then each field's entries at those
        // numbers, a page at a time (not one lookup a (row, field)).
        // Clearing every field, an index is taken out of the numbering at
        // once (one hash-map operation a row; its number is free for the
        // next put, and no put comes before this clear ends); clearing
        // some, it keeps its number while it has a field left.
        let nums: SmallVec<[u32; 64]> = match fields {
            None => global_indexes
                .iter()
                .filter_map(|&g| rows.remove(g))
                .collect(),
            Some(_) => global_indexes.iter().filter_map(|&g| rows.get(g)).collect(),
        };
        let mut gone: SmallVec<[u32; 64]> = smallvec::smallvec![0; nums.len()];
        // One field to clear: its columns are released as its entries
        // come. Several: their entries are kept, (position in nums,
        // entry) per field in position order, and released below.
        let one = match fields {
            Some(names) => names.len() == 1,
            None => by_name.len() == 1,
        };
        let mut taken: SmallVec<[Vec<(u32, u64)>; 8]> = SmallVec::new();
        let mut clear = |index: &mut FieldIndex| {
            if one {
                index.remove_run(&nums, &mut |i, v| {
                    bytes += release(columns, free, Loc::unpack(v));
                    gone[i] += 1;
                });
                return;
            }
            let mut list = Vec::new();
            index.remove_run(&nums, &mut |i, v| list.push((i as u32, v)));
            if !list.is_empty() {
                taken.push(list);
            }
        };
        match fields {
            Some(names) => {
                for name in names {
                    if let Some(index) = by_name.get_mut(name.as_str()) {
                        clear(index);
                    }
                }
            }
            None => by_name.values_mut().for_each(clear),
        }
        // The rows' columns released row by row, each row's fields
        // together, as a put stored them: the column numbers freed go back
        // in the order a put took them.
        let mut heads: SmallVec<[usize; 8]> = smallvec::smallvec![0; taken.len()];
        for (i, gone) in gone.iter_mut().enumerate() {
            for (list, head) in taken.iter().zip(heads.iter_mut()) {
                if let Some(&(at, v)) = list.get(*head)
                    && at as usize == i
                {
                    bytes += release(columns, free, Loc::unpack(v));
                    *gone += 1;
                    *head += 1;
                }
            }
        }
        // An index named twice is cleared at its first place (its second
        // finds nothing, and takes nothing from the count).
        for (&n, &k) in nums.iter().zip(&gone) {
            if fields.is_some() {
                rows.drop_fields(n, k);
            }
            *keys -= u64::from(k);
        }
        // Forget fields no index has any more.
        inner.fields.retain(|_, index| !index.is_empty());
        if inner.keys == 0 {
            let Inner {
                fields,
                rows,
                columns,
                free,
                ..
            } = &mut *inner;
            fields.shrink_to_fit();
            rows.clear();
            columns.clear();
            columns.shrink_to(0);
            free.clear();
            free.shrink_to(0);
        }
        inner.bytes -= bytes;
        let keys = keys_before - inner.keys;
        self.publish(&inner);
        drop(inner);
        crate::release::note_freed(bytes);
        keys
    }

    /// Current size, as of the last completed put or clear; never waits
    /// for the unit's lock.
    pub fn stats(&self) -> UnitStats {
        let [keys, rows, bytes] = &self.sizes;
        UnitStats {
            keys: keys.load(Ordering::Relaxed),
            rows: rows.load(Ordering::Relaxed),
            bytes: bytes.load(Ordering::Relaxed),
            capacity: self.capacity,
        }
    }
}

pub use stowage_index::duplicate;

/// A random, nonzero incarnation (the clock and the process id if the
/// kernel's generator fails: still different across restarts).
fn new_incarnation() -> u64 {
    let mut b = [0u8; 8];
    let v = match getrandom::fill(&mut b) {
        Ok(()) => u64::from_le_bytes(b),
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            t ^ (u64::from(std::process::id()) << 40)
        }
    };
    v.max(1)
}

/// The bytes of a put's rows.
fn put_bytes(fields: &[PutField]) -> u64 {
    fields
        .iter()
        .flat_map(|(_, c)| c.iter())
        .map(Column::byte_len)
        .sum()
}

/// Checks a put's indexes (at least one, distinct) and row counts.
fn check_shape(global_indexes: &[u64], fields: &[PutField]) -> Result<(), StoreError> {
    if global_indexes.is_empty() {
        return Err(StoreError::Empty);
    }
    if u32::try_from(global_indexes.len()).is_err() {
        return Err(StoreError::RowCount {
            field: String::new(),
            rows: global_indexes.len() as u64,
            indexes: global_indexes.len(),
        });
    }
    if let Some(g) = duplicate(global_indexes) {
        return Err(StoreError::DuplicateIndex(g));
    }
    for (name, columns) in fields {
        let rows: u64 = columns.iter().map(Column::rows).sum();
        if rows != global_indexes.len() as u64 {
            return Err(StoreError::RowCount {
                field: name.to_string(),
                rows,
                indexes: global_indexes.len(),
            });
        }
    }
    Ok(())
}
