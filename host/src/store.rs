//! Storage units: rows indexed into immutable extents.
//!
//! A put stores each (field, piece) it was given as one [`Column`]: a run of
//! rows that lie in one extent ([`crate::extent`]) at a constant stride (a
//! regular field), one row each (a nested field, every row its own range of
//! an extent), or plain values. Per stored row a unit keeps a few words: in
//! the field's index, global index -> (column, row in it), and a count of
//! the fields each global index has. No heap allocation per row.
//!
//! A get answers, per field, the columns it touched and one [`RowRef`] per
//! requested index ([`Rows`]); rows that were put together come back as
//! consecutive rows of one column, so whoever sends them finds runs by
//! comparing offsets, not addresses. Overwrite and clear drop a row's
//! reference to its column; a column with no live row is dropped, and with
//! it its reference to the extent. Capacity is counted in bytes of the
//! stored rows. A put is all-or-nothing: it is checked completely
//! (lengths, duplicates, capacity) before the first row is written, under
//! the unit's lock.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use crate::batch::{Cell, Field, Value};
use crate::extent::{self, Extent, Place, Received};
use crate::shm::{SegmentStore, ShmError};
use crate::tensor::{DType, Tensor};

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
    RowCount { field: String, rows: u64, indexes: usize },
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

/// Rows of a regular field stored from one piece of a put: `rows` rows of
/// `row_bytes` bytes each, the first at `offset` in the extent, each next
/// one `stride` bytes further.
#[derive(Clone, Debug)]
pub struct RegularColumn {
    pub extent: Arc<Extent>,
    pub offset: usize,
    pub stride: usize,
    pub rows: u64,
    pub row_bytes: usize,
    pub dtype: DType,
    pub row_shape: Arc<[u64]>,
}

/// One row of a nested field: `len` bytes at `offset` in the extent.
#[derive(Clone, Debug)]
pub struct NestedRow {
    pub extent: Arc<Extent>,
    pub offset: usize,
    pub len: usize,
    pub dtype: DType,
    pub shape: Box<[u64]>,
}

/// The rows of one field that one put stored together in one unit.
#[derive(Clone, Debug)]
pub enum Column {
    Regular(RegularColumn),
    Nested(Vec<NestedRow>),
    Values(Vec<Value>),
}

impl Column {
    /// A column over the rows of `t` (rows on axis 0), where `t`'s bytes
    /// start `offset` bytes into `extent`.
    pub fn regular(extent: Arc<Extent>, offset: usize, t: &Tensor) -> Column {
        Column::Regular(RegularColumn {
            extent,
            offset,
            stride: t.row_stride(),
            rows: t.rows(),
            row_bytes: t.row_bytes(),
            dtype: t.dtype(),
            row_shape: t.row_shape().into(),
        })
    }

    /// A nested row: the whole of `t`, whose bytes start `offset` bytes into
    /// `extent`. `t` must be contiguous (every nested row is).
    pub fn nested_row(extent: Arc<Extent>, offset: usize, t: Tensor) -> NestedRow {
        let len = t.payload_len();
        let dtype = t.dtype();
        NestedRow { extent, offset, len, dtype, shape: t.into_shape().into_boxed_slice() }
    }

    /// The rows of a decoded field as stored: slices of the request's
    /// buffers where they lie in one, else each piece its own extent (a
    /// non-contiguous nested row is compacted first).
    pub fn from_field(field: Field, received: &Received) -> Column {
        match field {
            Field::Regular(t) => {
                let (extent, offset, _) = received.locate_or_own(t.buffer());
                Column::regular(extent, offset, &t)
            }
            Field::Nested(rows) => Column::Nested(
                rows.into_iter()
                    .map(|t| {
                        let t = if t.is_contiguous() { t } else { contiguous(&t) };
                        let (extent, offset, _) = received.locate_or_own(t.buffer());
                        Column::nested_row(extent, offset, t)
                    })
                    .collect(),
            ),
            Field::Values(v) => Column::Values(v),
        }
    }

    /// A column of one row, in an extent of its own (a row received from a
    /// remote unit).
    pub fn from_cell(cell: Cell) -> Column {
        match cell {
            Cell::Tensor(t) => {
                let t = if t.is_contiguous() && t.byte_len() == t.payload_len() { t } else { contiguous(&t) };
                let extent = Extent::new(t.buffer().clone());
                Column::Nested(vec![Column::nested_row(extent, 0, t)])
            }
            Cell::Value(v) => Column::Values(vec![v]),
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> u64 {
        match self {
            Column::Regular(c) => c.rows,
            Column::Nested(r) => r.len() as u64,
            Column::Values(v) => v.len() as u64,
        }
    }

    /// Bytes of row `r`.
    fn row_len(&self, r: usize) -> u64 {
        match self {
            Column::Regular(c) => c.row_bytes as u64,
            Column::Nested(rows) => rows[r].len as u64,
            Column::Values(v) => v[r].byte_len() as u64,
        }
    }

    /// Bytes of all rows.
    pub fn byte_len(&self) -> u64 {
        match self {
            Column::Regular(c) => c.row_bytes as u64 * c.rows,
            Column::Nested(rows) => rows.iter().map(|r| r.len as u64).sum(),
            Column::Values(v) => v.iter().map(|v| v.byte_len() as u64).sum(),
        }
    }

    /// Row `r` as a cell (zero copy: a slice of where its extent is now).
    pub fn cell(&self, r: usize) -> Cell {
        match self {
            Column::Regular(c) => {
                let at = c.offset + r * c.stride;
                let bytes = c.extent.bytes().slice(at..at + c.row_bytes);
                Cell::Tensor(tensor(bytes, c.dtype, c.row_shape.to_vec()))
            }
            Column::Nested(rows) => {
                let n = &rows[r];
                let bytes = n.extent.bytes().slice(n.offset..n.offset + n.len);
                Cell::Tensor(tensor(bytes, n.dtype, n.shape.to_vec()))
            }
            Column::Values(v) => Cell::Value(v[r].clone()),
        }
    }

    /// Every row as a cell.
    pub fn cells(&self) -> Vec<Cell> {
        (0..self.rows() as usize).map(|r| self.cell(r)).collect()
    }
}

/// A tensor of bytes known to match the shape (they were checked when the
/// rows were stored).
fn tensor(bytes: Bytes, dtype: DType, shape: Vec<u64>) -> Tensor {
    Tensor::contiguous(bytes, dtype, shape).expect("stored rows match their shapes")
}

fn contiguous(t: &Tensor) -> Tensor {
    Tensor::contiguous(t.contiguous_bytes(), t.dtype(), t.shape().to_vec()).expect("same shape")
}

/// Row `row` of column `column` of a [`Rows`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowRef {
    pub column: u32,
    pub row: u32,
}

/// The rows of one field a get found: the columns they are in, and one
/// reference per requested index, in request order.
#[derive(Clone, Debug, Default)]
pub struct Rows {
    pub columns: Vec<Arc<Column>>,
    pub refs: Vec<RowRef>,
}

/// A run of rows to send: consecutive requested rows that lie back to
/// back in one buffer (`base`, an extent or the segment it is in), from
/// `offset` on; or one plain value.
#[derive(Clone, Debug)]
pub enum Run {
    Tensor {
        base: Bytes,
        segment: Option<Arc<str>>,
        offset: usize,
        rows: u64,
        row_bytes: usize,
        dtype: DType,
        row_shape: Vec<u64>,
    },
    Value(Value),
}

impl Run {
    /// The run's bytes: a slice of its base (zero copy).
    pub fn bytes(&self) -> Bytes {
        match self {
            Run::Tensor { base, offset, rows, row_bytes, .. } => base.slice(*offset..*offset + *rows as usize * *row_bytes),
            Run::Value(_) => Bytes::new(),
        }
    }
}

impl Rows {
    /// Appends `other`'s rows after these (its columns renumbered).
    pub fn append(&mut self, other: Rows) {
        let base = self.columns.len() as u32;
        self.columns.extend(other.columns);
        self.refs.extend(other.refs.into_iter().map(|r| RowRef { column: base + r.column, row: r.row }));
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.refs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.refs.is_empty()
    }

    /// One cell per row (zero copy).
    pub fn cells(&self) -> Vec<Cell> {
        self.refs.iter().map(|r| self.columns[r.column as usize].cell(r.row as usize)).collect()
    }

    /// Moves every extent these rows are in into shared memory, once: the
    /// ones not there yet go into one new segment, in the order the rows
    /// are asked for (see [`extent::share_all`]).
    pub fn share(&self, shm: &SegmentStore) -> Result<(), ShmError> {
        let mut seen = std::collections::HashSet::new();
        let mut column_done = vec![false; self.columns.len()];
        let mut order: Vec<Arc<Extent>> = Vec::new();
        for r in &self.refs {
            match self.columns[r.column as usize].as_ref() {
                Column::Regular(c) => {
                    if !std::mem::replace(&mut column_done[r.column as usize], true) && seen.insert(c.extent.id()) {
                        order.push(c.extent.clone());
                    }
                }
                Column::Nested(rows) => {
                    let e = &rows[r.row as usize].extent;
                    if seen.insert(e.id()) {
                        order.push(e.clone());
                    }
                }
                Column::Values(_) => {}
            }
        }
        extent::share_all(&order, shm)
    }

    /// The rows as runs: consecutive rows of one dtype and row shape that
    /// lie back to back in one place become one run, whichever columns
    /// (and units) they came from. One place snapshot per extent per call,
    /// so a run never mixes an extent's old and new place.
    pub fn runs(&self) -> Vec<Run> {
        let mut places: HashMap<u64, Place> = HashMap::new();
        let mut place_of = |e: &Arc<Extent>| places.entry(e.id()).or_insert_with(|| e.place()).clone();
        // Per column, its place (regular columns), taken once.
        let col_places: Vec<Option<Place>> = self
            .columns
            .iter()
            .map(|c| if let Column::Regular(c) = c.as_ref() { Some(place_of(&c.extent)) } else { None })
            .collect();
        let mut runs: Vec<Run> = Vec::new();
        for r in &self.refs {
            let column = &self.columns[r.column as usize];
            let row = r.row as usize;
            let (place, offset, row_bytes, dtype, shape): (&Place, usize, usize, DType, &[u64]) = match column.as_ref() {
                Column::Regular(c) => {
                    let place = col_places[r.column as usize].as_ref().expect("regular column has a place");
                    (place, c.offset + row * c.stride, c.row_bytes, c.dtype, &c.row_shape)
                }
                Column::Nested(rows) => {
                    let n = &rows[row];
                    let place = places.entry(n.extent.id()).or_insert_with(|| n.extent.place());
                    push_row(&mut runs, place, n.offset, n.len, n.dtype, &n.shape);
                    continue;
                }
                Column::Values(v) => {
                    runs.push(Run::Value(v[row].clone()));
                    continue;
                }
            };
            push_row(&mut runs, place, offset, row_bytes, dtype, shape);
        }
        runs
    }
}

/// Appends one row (`row_bytes` at `offset` in the extent at `place`) to
/// the last run if it follows it in the same buffer, else as a new run.
fn push_row(runs: &mut Vec<Run>, place: &Place, offset: usize, row_bytes: usize, dtype: DType, shape: &[u64]) {
    let at = place.offset + offset;
    if let Some(Run::Tensor { base, offset: o, rows, row_bytes: rb, dtype: d, row_shape, .. }) = runs.last_mut()
        && *rb == row_bytes
        && *d == dtype
        && base.as_ptr() == place.base.as_ptr()
        && base.len() == place.base.len()
        && *o + *rows as usize * *rb == at
        && row_shape.as_slice() == shape
    {
        *rows += 1;
        return;
    }
    runs.push(Run::Tensor {
        base: place.base.clone(),
        segment: place.segment.clone(),
        offset: at,
        rows: 1,
        row_bytes,
        dtype,
        row_shape: shape.to_vec(),
    });
}

/// Hashes a global index so that consecutive indexes land in consecutive
/// buckets (their low 16 bits are kept as they are), while indexes that
/// differ above bit 16 are spread by one multiplication (the constant of
/// rustc's FxHasher).
///
/// Measured with `cargo bench -p stowage-host --bench unit` (131,072
/// consecutive indexes): with a plain Fx multiply every row was a cache
/// miss in each map, and `clear` cost 889 ns per row; keeping the low bits
/// makes the accesses sequential. Strided indexes (every 4th, as `g % 4`
/// routing leaves each unit) still fall in distinct buckets. Not
/// DoS-resistant; indexes come from the cluster's own trainers.
#[derive(Default, Clone, Copy)]
struct IndexHasher(u64);

const MIX: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl std::hash::Hasher for IndexHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(MIX);
        }
    }

    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0 ^ i).wrapping_add((i >> 16).wrapping_mul(MIX));
    }
}

type IndexMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<IndexHasher>>;

/// Where a stored row is.
#[derive(Clone, Copy, Debug)]
struct Loc {
    column: u32,
    row: u32,
}

/// A stored column, the global index of each of its rows, and how many of
/// its rows are still indexed. While all are (`live` equals the row
/// count), row `r` is where `indexes[r]` is: a get of rows in put order
/// follows the column without a hash lookup per row.
struct Slot {
    column: Arc<Column>,
    indexes: Box<[u64]>,
    live: u64,
}

impl Slot {
    fn intact(&self) -> bool {
        self.live == self.indexes.len() as u64
    }
}

#[derive(Default)]
struct Inner {
    /// Per field: global index -> row.
    fields: HashMap<Arc<str>, IndexMap<Loc>>,
    /// Per global index: how many fields it has.
    present: IndexMap<u32>,
    /// Columns by number; `None` is a free number (in `free`).
    columns: Vec<Option<Slot>>,
    free: Vec<u32>,
    bytes: u64,
    keys: u64,
}

/// Stores a column (rows for `indexes`) under a free number.
fn add_column(columns: &mut Vec<Option<Slot>>, free: &mut Vec<u32>, column: Column, indexes: &[u64]) -> u32 {
    let slot = Some(Slot { live: indexes.len() as u64, indexes: indexes.into(), column: Arc::new(column) });
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
    let slot = columns[loc.column as usize].as_mut().expect("indexed rows point at live columns");
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
        self.columns[loc.column as usize].as_ref().expect("indexed rows point at live columns").column.row_len(loc.row as usize)
    }

    /// Removes (g, field) if present: returns its bytes.
    fn remove(&mut self, field: &str, g: u64) -> Option<u64> {
        let Inner { fields, present, columns, free, keys, .. } = self;
        let loc = fields.get_mut(field)?.remove(&g)?;
        let len = release(columns, free, loc);
        if let Some(n) = present.get_mut(&g) {
            *n -= 1;
            if *n == 0 {
                present.remove(&g);
            }
        }
        *keys -= 1;
        Some(len)
    }
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

/// The columns of one field of a put, in row order.
pub type PutField = (String, Vec<Column>);

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

    /// Stores the rows of `fields[f].1` (its columns' rows, in order) under
    /// `(global_indexes[i], fields[f].0)`. Existing keys are overwritten.
    /// All or nothing.
    pub fn put(&self, global_indexes: &[u64], fields: Vec<PutField>) -> Result<(), StoreError> {
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        check_shape(global_indexes, &fields)?;
        let mut inner = self.lock();
        let (added, _) = self.check_capacity(&inner, global_indexes, &fields)?;
        let mut freed = 0u64;
        for (name, columns_in) in fields {
            let name: Arc<str> = match inner.fields.get_key_value(name.as_str()) {
                Some((k, _)) => k.clone(),
                None => Arc::from(name.as_str()),
            };
            let Inner { fields, present, columns, free, keys, .. } = &mut *inner;
            let index = fields.entry(name).or_default();
            index.reserve(global_indexes.len());
            if present.is_empty() {
                present.reserve(global_indexes.len());
            }
            let mut next = 0usize;
            for column in columns_in {
                let rows = column.rows() as usize;
                let c = add_column(columns, free, column, &global_indexes[next..next + rows]);
                for (row, g) in global_indexes[next..next + rows].iter().enumerate() {
                    match index.insert(*g, Loc { column: c, row: row as u32 }) {
                        Some(old) => freed += release(columns, free, old),
                        None => {
                            *keys += 1;
                            *present.entry(*g).or_insert(0) += 1;
                        }
                    }
                }
                next += rows;
            }
        }
        inner.bytes = inner.bytes - freed + added;
        drop(inner);
        release::note_freed(freed);
        Ok(())
    }

    /// Checks, without storing anything, that [`Unit::put`] of these rows
    /// would succeed now (a put over several units checks every unit first).
    pub fn check_put(&self, global_indexes: &[u64], fields: &[PutField]) -> Result<(), StoreError> {
        check_shape(global_indexes, fields)?;
        self.check_capacity(&self.lock(), global_indexes, fields).map(drop)
    }

    /// Capacity: bytes after the put, counting overwritten rows as freed.
    /// Returns (bytes added, bytes freed).
    fn check_capacity(&self, inner: &Inner, global_indexes: &[u64], fields: &[PutField]) -> Result<(u64, u64), StoreError> {
        let added: u64 = fields.iter().flat_map(|(_, c)| c.iter()).map(Column::byte_len).sum();
        let Some(capacity) = self.capacity else { return Ok((added, 0)) };
        let mut freed = 0u64;
        for (name, _) in fields {
            if let Some(index) = inner.fields.get(name.as_str()) {
                freed += global_indexes.iter().filter_map(|g| index.get(g)).map(|loc| inner.row_len(*loc)).sum::<u64>();
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
        Ok((added, freed))
    }

    /// The rows of `fields` at `global_indexes`, field by field, in request
    /// order. Any missing key fails the whole request.
    pub fn get(&self, global_indexes: &[u64], fields: &[String]) -> Result<Vec<Rows>, StoreError> {
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        let inner = self.lock();
        let missing = |g: u64, field: &str| StoreError::KeyNotFound { unit: self.id.clone(), index: g, field: field.to_string() };
        let mut out = Vec::with_capacity(fields.len());
        for field in fields {
            let Some(index) = inner.fields.get(field.as_str()) else {
                return Err(missing(global_indexes.first().copied().unwrap_or(0), field));
            };
            let mut rows = Rows { columns: Vec::new(), refs: Vec::with_capacity(global_indexes.len()) };
            // Column number in the unit -> in `rows`; requested rows mostly
            // come in runs of one column, in put order.
            let mut numbered: IndexMap<u32> = IndexMap::default();
            // (column in the unit, in `rows`, row) of the last row.
            let mut last: Option<(u32, u32, u32)> = None;
            for &g in global_indexes {
                if let Some((unit_col, ours, row)) = last {
                    let slot = inner.columns[unit_col as usize].as_ref().expect("indexed rows point at live columns");
                    if slot.intact() && slot.indexes.get(row as usize + 1) == Some(&g) {
                        rows.refs.push(RowRef { column: ours, row: row + 1 });
                        last = Some((unit_col, ours, row + 1));
                        continue;
                    }
                }
                let loc = index.get(&g).ok_or_else(|| missing(g, field))?;
                let ours = match last {
                    Some((unit_col, ours, _)) if unit_col == loc.column => ours,
                    _ => *numbered.entry(u64::from(loc.column)).or_insert_with(|| {
                        let slot = inner.columns[loc.column as usize].as_ref().expect("indexed rows point at live columns");
                        rows.columns.push(slot.column.clone());
                        (rows.columns.len() - 1) as u32
                    }),
                };
                last = Some((loc.column, ours, loc.row));
                rows.refs.push(RowRef { column: ours, row: loc.row });
            }
            out.push(rows);
        }
        Ok(out)
    }

    /// Removes every field of the given indexes (or only `fields`); returns
    /// the number of keys removed. Unknown indexes are ignored.
    pub fn clear(&self, global_indexes: &[u64], fields: Option<&[String]>) -> u64 {
        self.counters.clears.fetch_add(1, Ordering::Relaxed);
        let mut inner = self.lock();
        let keys_before = inner.keys;
        let mut bytes = 0u64;
        match fields {
            Some(fields) => {
                for field in fields {
                    for &g in global_indexes {
                        bytes += inner.remove(field, g).unwrap_or(0);
                    }
                }
            }
            None => {
                // Field by field, each index's map walked in request order.
                let Inner { fields, present, columns, free, keys, .. } = &mut *inner;
                let mut gone = 0u64;
                for index in fields.values_mut() {
                    for g in global_indexes {
                        if let Some(loc) = index.remove(g) {
                            bytes += release(columns, free, loc);
                            gone += 1;
                        }
                    }
                }
                for g in global_indexes {
                    present.remove(g);
                }
                *keys -= gone;
            }
        }
        // Forget fields no index has any more.
        inner.fields.retain(|_, index| !index.is_empty());
        if inner.keys == 0 {
            let Inner { fields, present, columns, free, .. } = &mut *inner;
            fields.shrink_to_fit();
            present.shrink_to(0);
            columns.clear();
            columns.shrink_to(0);
            free.clear();
            free.shrink_to(0);
        }
        inner.bytes -= bytes;
        let keys = keys_before - inner.keys;
        drop(inner);
        release::note_freed(bytes);
        keys
    }

    /// Current size.
    pub fn stats(&self) -> UnitStats {
        let inner = self.lock();
        UnitStats { keys: inner.keys, rows: inner.present.len() as u64, bytes: inner.bytes, capacity: self.capacity }
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
        crate::sys::malloc_trim();
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

/// An index that appears twice, if any: a linear scan when the indexes
/// increase (the usual put), a hash set otherwise.
pub fn duplicate(global_indexes: &[u64]) -> Option<u64> {
    if global_indexes.windows(2).all(|w| w[0] < w[1]) {
        return None;
    }
    let mut seen: IndexMap<()> = IndexMap::default();
    seen.reserve(global_indexes.len());
    global_indexes.iter().copied().find(|&g| seen.insert(g, ()).is_some())
}

/// Checks a put's indexes (at least one, distinct) and row counts.
fn check_shape(global_indexes: &[u64], fields: &[PutField]) -> Result<(), StoreError> {
    if global_indexes.is_empty() {
        return Err(StoreError::Empty);
    }
    if u32::try_from(global_indexes.len()).is_err() {
        return Err(StoreError::RowCount { field: String::new(), rows: global_indexes.len() as u64, indexes: global_indexes.len() });
    }
    if let Some(g) = duplicate(global_indexes) {
        return Err(StoreError::DuplicateIndex(g));
    }
    for (name, columns) in fields {
        let rows: u64 = columns.iter().map(Column::rows).sum();
        if rows != global_indexes.len() as u64 {
            return Err(StoreError::RowCount { field: name.clone(), rows, indexes: global_indexes.len() });
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

    fn s(v: &str) -> Value {
        Value::Str(v.into())
    }

    fn values(v: &[&str]) -> Vec<Column> {
        vec![Column::Values(v.iter().map(|x| s(x)).collect())]
    }

    fn got(unit: &Unit, g: &[u64], field: &str) -> Vec<Cell> {
        unit.get(g, &[field.to_string()]).unwrap().remove(0).cells()
    }

    #[test]
    fn put_get_overwrite_clear() {
        let unit = Unit::new("u0", None);
        unit.put(&[1, 2], vec![("a".into(), values(&["x", "yy"]))]).unwrap();
        assert_eq!(unit.stats().bytes, 3);
        unit.put(&[2], vec![("a".into(), values(&["zzzz"]))]).unwrap();
        assert_eq!(unit.stats(), UnitStats { keys: 2, rows: 2, bytes: 5, capacity: None });
        assert_eq!(got(&unit, &[2, 1], "a"), vec![Cell::Value(s("zzzz")), Cell::Value(s("x"))]);
        let err = unit.get(&[1, 9], &["a".into()]).unwrap_err();
        assert!(err.to_string().starts_with("[TQKeyNotFound] "));
        assert!(unit.get(&[1], &["nope".into()]).is_err());
        assert_eq!(unit.clear(&[1, 7], None), 1);
        assert_eq!(unit.stats().bytes, 4);
    }

    #[test]
    fn fields_clear_one_by_one() {
        let unit = Unit::new("u0", None);
        unit.put(&[1, 2], vec![("a".into(), values(&["x", "y"])), ("b".into(), values(&["p", "q"]))]).unwrap();
        assert_eq!(unit.stats(), UnitStats { keys: 4, rows: 2, bytes: 4, capacity: None });
        assert_eq!(unit.clear(&[1], Some(&["a".to_string()])), 1);
        assert_eq!(unit.stats(), UnitStats { keys: 3, rows: 2, bytes: 3, capacity: None });
        assert_eq!(unit.clear(&[1], Some(&["b".to_string(), "a".to_string()])), 1);
        assert_eq!(unit.stats(), UnitStats { keys: 2, rows: 1, bytes: 2, capacity: None });
        assert_eq!(got(&unit, &[2], "b"), vec![Cell::Value(s("q"))]);
        assert_eq!(unit.clear(&[2], None), 2);
        assert_eq!(unit.stats(), UnitStats { keys: 0, rows: 0, bytes: 0, capacity: None });
    }

    #[test]
    fn puts_are_all_or_nothing() {
        let unit = Unit::new("u0", Some(10));
        unit.put(&[1], vec![("a".into(), values(&["12345"]))]).unwrap();
        let before = unit.stats();
        assert!(matches!(unit.put(&[2, 2], vec![("a".into(), values(&["1", "2"]))]), Err(StoreError::DuplicateIndex(2))));
        assert!(matches!(
            unit.put(&[2, 3], vec![("a".into(), values(&["1", "2"])), ("b".into(), values(&["1"]))]),
            Err(StoreError::RowCount { .. })
        ));
        assert!(matches!(unit.put(&[2], vec![("a".into(), values(&["123456"]))]), Err(StoreError::Capacity { .. })));
        assert_eq!(unit.stats(), before);
        assert!(unit.get(&[2], &["a".into()]).is_err());
        // Overwriting frees the old bytes first.
        unit.put(&[1], vec![("a".into(), values(&["1234567890"]))]).unwrap();
        assert_eq!(unit.stats().bytes, 10);
    }

    #[test]
    fn check_put_stores_nothing() {
        let unit = Unit::new("u0", Some(4));
        unit.put(&[1], vec![("a".into(), values(&["12"]))]).unwrap();
        let too_big = [("a".to_string(), values(&["123"]))];
        assert!(matches!(unit.check_put(&[2], &too_big), Err(StoreError::Capacity { .. })));
        // Overwriting index 1 frees its 2 bytes first.
        unit.check_put(&[1], &too_big).unwrap();
        assert!(matches!(unit.check_put(&[2, 2], &[]), Err(StoreError::DuplicateIndex(2))));
        assert_eq!(unit.stats(), UnitStats { keys: 1, rows: 1, bytes: 2, capacity: Some(4) });
    }

    fn frame_tensor(rows: u64, cols: u64) -> (Bytes, Tensor) {
        let data: Vec<u8> = (0..rows * cols).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let frame = Bytes::from(data);
        let t = Tensor::contiguous(frame.clone(), DType::F32, vec![rows, cols]).unwrap();
        (frame, t)
    }

    #[test]
    fn clearing_the_last_row_frees_the_extent() {
        let (frame, t) = frame_tensor(4, 4);
        let received = Received::frames(std::slice::from_ref(&frame));
        let unit = Unit::new("u0", None);
        unit.put(&[0, 1, 2, 3], vec![("t".into(), vec![Column::from_field(Field::Regular(t), &received)])]).unwrap();
        drop(received);
        assert!(!frame.is_unique());
        unit.clear(&[0, 1, 2], None);
        assert!(!frame.is_unique());
        unit.put(&[3], vec![("t".into(), values(&["over"]))]).unwrap();
        assert!(frame.is_unique(), "the frame is still pinned after its last row was overwritten");
    }

    #[test]
    fn rows_put_together_come_back_as_one_run_across_units() {
        // One frame of 8 rows, split over two units as strided views (the
        // g % 2 routing), got back in put order: one run, one slice of the
        // frame, no copy.
        let (frame, t) = frame_tensor(8, 2);
        let received = Received::frames(std::slice::from_ref(&frame));
        let units = [Unit::new("u0", None), Unit::new("u1", None)];
        for (u, unit) in units.iter().enumerate() {
            let view = t.rows_view(u as u64, 2, 4).unwrap();
            let (extent, offset, zero_copy) = received.locate_or_own(view.buffer());
            assert!(zero_copy);
            let g: Vec<u64> = (0..4).map(|i| u as u64 + 2 * i).collect();
            unit.put(&g, vec![("t".into(), vec![Column::regular(extent, offset, &view)])]).unwrap();
        }
        let mut all = Rows::default();
        for g in 0..8u64 {
            all.append(units[(g % 2) as usize].get(&[g], &["t".into()]).unwrap().remove(0));
        }
        let runs = all.runs();
        assert_eq!(runs.len(), 1);
        let bytes = runs[0].bytes();
        assert_eq!(bytes.as_ptr(), frame.as_ptr());
        assert_eq!(bytes.len(), frame.len());
        // Reversed order: every row its own run, each a slice of the frame.
        let mut rev = Rows::default();
        for g in (0..8u64).rev() {
            rev.append(units[(g % 2) as usize].get(&[g], &["t".into()]).unwrap().remove(0));
        }
        let runs = rev.runs();
        assert_eq!(runs.len(), 8);
        assert_eq!(runs[0].bytes().as_ptr(), frame.slice(7 * 8..).as_ptr());
        let cells = rev.cells();
        assert_eq!(cells[0], Cell::Tensor(t.row_tensor(7).unwrap()));
    }

    #[test]
    fn a_get_in_put_order_sees_an_overwritten_or_cleared_row() {
        let unit = Unit::new("u0", None);
        unit.put(&[1, 2, 3, 4], vec![("a".into(), values(&["a1", "a2", "a3", "a4"]))]).unwrap();
        assert_eq!(got(&unit, &[1, 2, 3, 4], "a"), ["a1", "a2", "a3", "a4"].map(|v| Cell::Value(s(v))).to_vec());
        unit.put(&[2], vec![("a".into(), values(&["b2"]))]).unwrap();
        assert_eq!(got(&unit, &[1, 2, 3, 4], "a"), ["a1", "b2", "a3", "a4"].map(|v| Cell::Value(s(v))).to_vec());
        unit.clear(&[3], None);
        assert!(matches!(unit.get(&[1, 2, 3, 4], &["a".into()]), Err(StoreError::KeyNotFound { index: 3, .. })));
        assert_eq!(got(&unit, &[4, 1], "a"), ["a4", "a1"].map(|v| Cell::Value(s(v))).to_vec());
    }

    #[test]
    fn sharing_puts_the_extents_of_a_get_into_one_segment_in_request_order() {
        // Two puts (two frames), rows read back across both: after the
        // move into shared memory they are one run of one segment.
        let dir = std::env::temp_dir().join(format!("stowage-store-share-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let shm = SegmentStore::new(&dir, std::time::Duration::from_secs(5), 1 << 30).unwrap();
        let unit = Unit::new("u0", None);
        let (f1, t1) = frame_tensor(4, 2);
        let (f2, t2) = frame_tensor(4, 2);
        for (g, f, t) in [([0u64, 1, 2, 3], &f1, t1), ([4, 5, 6, 7], &f2, t2)] {
            let received = Received::frames(std::slice::from_ref(f));
            unit.put(&g, vec![("t".into(), vec![Column::from_field(Field::Regular(t), &received)])]).unwrap();
        }
        let all: Vec<u64> = (0..8).collect();
        let rows = unit.get(&all, &["t".into()]).unwrap().remove(0);
        assert_eq!(rows.runs().len(), 2, "two frames before the move");
        rows.share(&shm).unwrap();
        let runs = rows.runs();
        assert_eq!(runs.len(), 1, "one segment after the move");
        let Run::Tensor { segment, base, .. } = &runs[0] else { panic!() };
        assert!(segment.is_some());
        assert_eq!(&runs[0].bytes()[..], [&f1[..], &f2[..]].concat().as_slice());
        assert_eq!(base.len(), 64);
        // A second share copies nothing more.
        let before = shm.counts().0;
        unit.get(&all, &["t".into()]).unwrap()[0].share(&shm).unwrap();
        assert_eq!(shm.counts().0, before);
        // The frames are no longer pinned by the store.
        assert!(f1.is_unique() && f2.is_unique());
        drop(runs);
        drop(rows);
        unit.clear(&all, None);
        assert_eq!(shm.counts().0, 0, "the segment outlived its rows");
    }

    #[test]
    fn overwriting_many_rows_keeps_counts() {
        let unit = Unit::new("u0", None);
        let g: Vec<u64> = (0..1000).collect();
        let v: Vec<String> = g.iter().map(|i| i.to_string()).collect();
        let col = || vec![Column::Values(v.iter().map(|x| s(x)).collect())];
        unit.put(&g, vec![("a".into(), col()), ("b".into(), col())]).unwrap();
        unit.put(&g[500..], vec![("a".into(), vec![Column::Values(g[500..].iter().map(|_| s("z")).collect())])]).unwrap();
        let st = unit.stats();
        assert_eq!((st.keys, st.rows), (2000, 1000));
        assert_eq!(got(&unit, &[499, 500], "a"), vec![Cell::Value(s("499")), Cell::Value(s("z"))]);
        assert_eq!(unit.clear(&g, None), 2000);
        assert_eq!(unit.stats(), UnitStats { keys: 0, rows: 0, bytes: 0, capacity: None });
    }
}
