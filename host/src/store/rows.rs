//! What a get answers: per field, the columns its rows are in and
//! [`Piece`]s, runs of consecutive rows of one column answering evenly
//! spaced request positions ([`Rows`]); and those rows grouped into
//! [`Run`]s that lie back to back in one buffer, in request order, for the
//! encoders. Both cost per piece where the rows allow (a get of rows in put
//! order, over any number of units), per row only where they do not.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use smallvec::SmallVec;

use super::{Column, ColumnRef};
use crate::batch::{Cell, Value};
use crate::extent::{self, Extent, Place};
use crate::shm::{SegmentStore, ShmError};
use crate::tensor::Dtype;

/// Rows `row..row + count` of column `column` of a [`Rows`], answering the
/// request positions `pos, pos + pos_step, ...`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub pos: u64,
    pub pos_step: u64,
    pub column: u32,
    pub row: u32,
    pub count: u32,
}

impl Piece {
    /// The position of the piece's `k`-th row.
    fn pos_of(&self, k: u64) -> u64 {
        self.pos + k * self.pos_step
    }
}

/// The rows of one field a get found: the columns they are in, and pieces
/// that answer every requested position exactly once (in any order).
/// Inline for the few of a small get (a field over 4 units: 4 of each),
/// where two lists grown and freed a field were about 900 instructions of
/// each field of a get (callgrind).
#[derive(Clone, Debug, Default)]
pub struct Rows {
    pub columns: SmallVec<[ColumnRef; 4]>,
    pub pieces: SmallVec<[Piece; 4]>,
}

/// A run of rows to send: consecutive requested rows that lie back to
/// back in one buffer (`base`, an extent or the segment it is in), from
/// `offset` on; or one plain value.
#[derive(Clone, Debug)]
pub enum Run {
    Tensor {
        base: Bytes,
        segment: Option<crate::shm::Handle>,
        offset: usize,
        rows: u64,
        row_bytes: usize,
        dtype: Dtype,
        /// Shared with the column the rows are in (a regular column's).
        row_shape: Arc<[u64]>,
    },
    Value(Value),
}

/// What [`Rows::runs`] answers: inline for the usual field of a get, whose
/// rows are one run (a get of 32 fields made and freed a list a field).
pub type Runs = SmallVec<[Run; 1]>;

impl Run {
    /// The run's bytes: a slice of its base (zero copy).
    pub fn bytes(&self) -> Bytes {
        match self {
            Run::Tensor {
                base,
                offset,
                rows,
                row_bytes,
                ..
            } => base.slice(*offset..*offset + *rows as usize * *row_bytes),
            Run::Value(_) => Bytes::new(),
        }
    }
}

impl Rows {
    /// Adds a piece, or lengthens the last one if `p` continues it (the
    /// next rows of the same column at the next positions).
    pub fn push(&mut self, p: Piece) {
        if let Some(l) = self.pieces.last_mut()
            && l.column == p.column
            && u64::from(l.row) + u64::from(l.count) == u64::from(p.row)
            && p.pos > l.pos
        {
            // The position step the merged piece would have.
            let step = if l.count == 1 {
                p.pos - l.pos
            } else {
                l.pos_step
            };
            if p.pos == l.pos + u64::from(l.count) * step && (p.count == 1 || p.pos_step == step) {
                l.pos_step = step;
                l.count += p.count;
                return;
            }
        }
        self.pieces.push(p);
    }

    /// Appends `other`'s rows after these (its columns renumbered, its
    /// positions after ours).
    pub fn append(&mut self, other: Rows) {
        let base = self.columns.len() as u32;
        let shift = self.len() as u64;
        self.columns.extend(other.columns);
        self.pieces.extend(other.pieces.into_iter().map(|p| Piece {
            pos: p.pos + shift,
            column: base + p.column,
            ..p
        }));
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(|p| p.count as usize).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The rows' bytes (a value's as [`Column::row_len`] counts it).
    pub fn byte_len(&self) -> u64 {
        self.pieces
            .iter()
            .map(|p| match self.columns[p.column as usize].as_ref() {
                Column::Regular(c) => c.row_bytes as u64 * u64::from(p.count),
                other => (p.row..p.row + p.count)
                    .map(|r| other.row_len(r as usize))
                    .sum(),
            })
            .sum()
    }

    /// Every row as (position, column, row in it), piece by piece.
    fn each_row(&self) -> impl Iterator<Item = (u64, &Column, usize)> + '_ {
        self.pieces.iter().flat_map(move |p| {
            let column = self.columns[p.column as usize].as_ref();
            (0..u64::from(p.count)).map(move |k| (p.pos_of(k), column, (p.row as u64 + k) as usize))
        })
    }

    /// One cell per row, in request order (zero copy).
    pub fn cells(&self) -> Vec<Cell> {
        let mut out: Vec<Option<Cell>> = vec![None; self.len()];
        for (pos, column, row) in self.each_row() {
            out[pos as usize] = Some(column.cell(row));
        }
        out.into_iter()
            .map(|c| c.expect("pieces answer every position"))
            .collect()
    }

    /// The pieces' numbers in request order (of their first position).
    fn in_order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.pieces.len()).collect();
        order.sort_unstable_by_key(|&i| self.pieces[i].pos);
        order
    }

    /// Moves every extent these rows are in into shared memory, once: the
    /// ones not there yet go into one new segment, in the order the rows
    /// are asked for (see [`extent::share_all`]).
    pub fn share(&self, shm: &SegmentStore) -> Result<(), ShmError> {
        let mut seen = std::collections::HashSet::new();
        let mut column_done = vec![false; self.columns.len()];
        let mut order: Vec<Arc<Extent>> = Vec::new();
        for i in self.in_order() {
            let p = &self.pieces[i];
            match self.columns[p.column as usize].as_ref() {
                Column::Regular(c) => {
                    if !std::mem::replace(&mut column_done[p.column as usize], true)
                        && seen.insert(c.extent.id())
                    {
                        order.push(c.extent.clone());
                    }
                }
                Column::Nested(rows) => {
                    for n in &rows[p.row as usize..(p.row + p.count) as usize] {
                        if seen.insert(n.extent.id()) {
                            order.push(n.extent.clone());
                        }
                    }
                }
                Column::Values(_) => {}
            }
        }
        extent::share_all(&order, shm)
    }

    /// The rows as runs, in request order: consecutive rows of one dtype
    /// and row shape that lie back to back in one place become one run,
    /// whichever columns (and units) they came from. One place snapshot
    /// per extent per call, so a run never mixes an extent's old and new
    /// place.
    ///
    /// Regular pieces are grouped first by where position 0 would lie if
    /// their rows were one array (same buffer, dtype, row shape, and row
    /// `k` of the piece at `row_bytes` per position): a group that answers
    /// an unbroken range of positions is one run, found per piece (a get
    /// in put order over 4 units that each hold every 4th row). Everything
    /// else goes row by row, as before.
    pub fn runs(&self) -> Runs {
        self.runs_with(&mut Snapshots::default())
    }

    /// [`Rows::runs`], with the extents' places taken from `places` (and
    /// kept there): the fields of one get share them, so an extent several
    /// fields' rows lie in (a put's frame) is looked up once a get, not
    /// once a field (each a lock, the spiller's clock read and two
    /// reference counts).
    pub fn runs_with(&self, places: &mut Snapshots) -> Runs {
        // Inline for the few pieces of a small get's field: a get of 32
        // fields made and freed two lists and a snapshot list a field
        // (about 750 of its 2,070 instructions a field here, callgrind).
        let mut items: SmallVec<[Item<'_>; 8]> = SmallVec::new();
        // Regular pieces of more than one row, by (place, dtype, row shape,
        // row bytes, where position 0 would be): (first position, last
        // position, rows, the pieces).
        type Key<'a> = (u32, Dtype, &'a Arc<[u64]>, usize, i128);
        let mut groups: HashMap<Key<'_>, (u64, u64, u64, Vec<usize>)> = HashMap::new();
        let mut by_row: SmallVec<[usize; 8]> = SmallVec::new();
        for (i, p) in self.pieces.iter().enumerate() {
            match self.columns[p.column as usize].as_ref() {
                Column::Regular(c)
                    if p.count > 1
                        && c.stride as u128 == u128::from(p.pos_step) * c.row_bytes as u128 =>
                {
                    let place = places.of(&c.extent);
                    let at0 = (places.list[place as usize].offset
                        + c.offset
                        + p.row as usize * c.stride) as i128;
                    let origin = at0 - i128::from(p.pos) * c.row_bytes as i128;
                    let key = (place, c.dtype, &c.row_shape, c.row_bytes, origin);
                    let last = p.pos_of(u64::from(p.count) - 1);
                    let g = groups
                        .entry(key)
                        .or_insert_with(|| (p.pos, last, 0, Vec::new()));
                    g.0 = g.0.min(p.pos);
                    g.1 = g.1.max(last);
                    g.2 += u64::from(p.count);
                    g.3.push(i);
                }
                _ => by_row.push(i),
            }
        }
        for ((place, dtype, shape, row_bytes, origin), (first, last, rows, members)) in groups {
            if rows != last - first + 1 {
                by_row.extend(members);
                continue;
            }
            items.push(Item {
                pos: first,
                rows,
                what: What::Tensor {
                    place,
                    offset: (origin + i128::from(first) * row_bytes as i128) as usize
                        - places.list[place as usize].offset,
                    row_bytes,
                    dtype,
                    shape: Shape::Shared(shape),
                },
            });
        }
        for i in by_row {
            let p = &self.pieces[i];
            let column = self.columns[p.column as usize].as_ref();
            for k in 0..u64::from(p.count) {
                let row = (u64::from(p.row) + k) as usize;
                let what = match column {
                    Column::Regular(c) => What::Tensor {
                        place: places.of(&c.extent),
                        offset: c.offset + row * c.stride,
                        row_bytes: c.row_bytes,
                        dtype: c.dtype,
                        shape: Shape::Shared(&c.row_shape),
                    },
                    Column::Nested(rows) => {
                        let n = &rows[row];
                        What::Tensor {
                            place: places.of(&n.extent),
                            offset: n.offset,
                            row_bytes: n.len,
                            dtype: n.dtype,
                            shape: Shape::Own(&n.shape),
                        }
                    }
                    Column::Values(v) => What::Value(&v[row]),
                };
                items.push(Item {
                    pos: p.pos_of(k),
                    rows: 1,
                    what,
                });
            }
        }
        items.sort_unstable_by_key(|it| it.pos);
        let mut runs = Runs::new();
        for it in items {
            let What::Tensor {
                place,
                offset,
                row_bytes,
                dtype,
                shape,
            } = it.what
            else {
                if let What::Value(v) = it.what {
                    runs.push(Run::Value(v.clone()));
                }
                continue;
            };
            let place = &places.list[place as usize];
            let at = place.offset + offset;
            if let Some(Run::Tensor {
                base,
                offset: o,
                rows,
                row_bytes: rb,
                dtype: d,
                row_shape,
                ..
            }) = runs.last_mut()
                && *rb == row_bytes
                && *d == dtype
                && base.as_ptr() == place.base.as_ptr()
                && base.len() == place.base.len()
                && *o + *rows as usize * *rb == at
                && **row_shape == *shape.dims()
            {
                *rows += it.rows;
                continue;
            }
            runs.push(Run::Tensor {
                base: place.base.clone(),
                segment: place.segment.clone(),
                offset: at,
                rows: it.rows,
                row_bytes,
                dtype,
                row_shape: shape.shared(),
            });
        }
        runs
    }
}

/// One place snapshot per extent the calls of [`Rows::runs_with`] given it
/// meet: where the extent's bytes were when first met.
#[derive(Default)]
pub struct Snapshots {
    list: SmallVec<[Place; 2]>,
    ids: FewMap<u64, u32>,
}

impl Snapshots {
    /// How many extents' places are kept.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The number of `e`'s snapshot, taken the first time.
    fn of(&mut self, e: &Arc<Extent>) -> u32 {
        let list = &mut self.list;
        self.ids.get_or_insert_with(e.id(), || {
            list.push(e.place());
            (list.len() - 1) as u32
        })
    }
}

/// A map for the few keys a small get meets (the columns of a field, the
/// extents of a reply): a scan of an inline list up to [`FewMap::SCAN`]
/// keys, no allocation; a hash map past that, so a large get stays linear.
pub(super) enum FewMap<K, V> {
    Few(smallvec::SmallVec<[(K, V); 8]>),
    Many(HashMap<K, V>),
}

impl<K, V> Default for FewMap<K, V> {
    fn default() -> Self {
        FewMap::Few(smallvec::SmallVec::new())
    }
}

impl<K: Copy + Eq + std::hash::Hash, V: Copy> FewMap<K, V> {
    /// Most keys kept in the inline list.
    const SCAN: usize = 8;

    /// The value of `k`, made by `make` (and kept) the first time.
    pub(super) fn get_or_insert_with(&mut self, k: K, make: impl FnOnce() -> V) -> V {
        match self {
            FewMap::Few(few) => {
                if let Some((_, v)) = few.iter().find(|(key, _)| *key == k) {
                    return *v;
                }
                let v = make();
                if few.len() < Self::SCAN {
                    few.push((k, v));
                } else {
                    let mut all: HashMap<K, V> = few.drain(..).collect();
                    all.insert(k, v);
                    *self = FewMap::Many(all);
                }
                v
            }
            FewMap::Many(all) => *all.entry(k).or_insert_with(make),
        }
    }
}

/// Rows that answer `rows` positions from `pos`, before they become runs.
struct Item<'a> {
    pos: u64,
    rows: u64,
    what: What<'a>,
}

/// What an [`Item`] is: rows of `row_bytes` from `offset` in the extent
/// whose place is `places[place]`, or one value.
enum What<'a> {
    Tensor {
        place: u32,
        offset: usize,
        row_bytes: usize,
        dtype: Dtype,
        shape: Shape<'a>,
    },
    Value(&'a Value),
}

/// The row shape of an [`Item`]'s rows: a regular column's, which a run
/// shares, or a nested row's own.
#[derive(Clone, Copy)]
enum Shape<'a> {
    Shared(&'a Arc<[u64]>),
    Own(&'a [u64]),
}

impl Shape<'_> {
    fn dims(&self) -> &[u64] {
        match self {
            Shape::Shared(s) => s,
            Shape::Own(s) => s,
        }
    }

    fn shared(&self) -> Arc<[u64]> {
        match self {
            Shape::Shared(s) => Arc::clone(s),
            Shape::Own(s) => Arc::from(*s),
        }
    }
}
