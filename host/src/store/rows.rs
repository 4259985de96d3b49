//! What a get answers: per field, the columns its rows are in and one
//! [`RowRef`] per requested index ([`Rows`]), and those rows grouped into
//! [`Run`]s that lie back to back in one buffer, for the encoders.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use super::Column;
use crate::batch::{Cell, Value};
use crate::extent::{self, Extent, Place};
use crate::shm::{SegmentStore, ShmError};
use crate::tensor::DType;

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
    /// Appends `other`'s rows after these (its columns renumbered).
    pub fn append(&mut self, other: Rows) {
        let base = self.columns.len() as u32;
        self.columns.extend(other.columns);
        self.refs.extend(other.refs.into_iter().map(|r| RowRef {
            column: base + r.column,
            row: r.row,
        }));
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
        self.refs
            .iter()
            .map(|r| self.columns[r.column as usize].cell(r.row as usize))
            .collect()
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
                    if !std::mem::replace(&mut column_done[r.column as usize], true)
                        && seen.insert(c.extent.id())
                    {
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
        let mut place_of =
            |e: &Arc<Extent>| places.entry(e.id()).or_insert_with(|| e.place()).clone();
        // Per column, its place (regular columns), taken once.
        let col_places: Vec<Option<Place>> = self
            .columns
            .iter()
            .map(|c| {
                if let Column::Regular(c) = c.as_ref() {
                    Some(place_of(&c.extent))
                } else {
                    None
                }
            })
            .collect();
        let mut runs: Vec<Run> = Vec::new();
        for r in &self.refs {
            let column = &self.columns[r.column as usize];
            let row = r.row as usize;
            let (place, offset, row_bytes, dtype, shape): (&Place, usize, usize, DType, &[u64]) =
                match column.as_ref() {
                    Column::Regular(c) => {
                        let place = col_places[r.column as usize]
                            .as_ref()
                            .expect("regular column has a place");
                        (
                            place,
                            c.offset + row * c.stride,
                            c.row_bytes,
                            c.dtype,
                            &c.row_shape,
                        )
                    }
                    Column::Nested(rows) => {
                        let n = &rows[row];
                        let place = places
                            .entry(n.extent.id())
                            .or_insert_with(|| n.extent.place());
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
fn push_row(
    runs: &mut Vec<Run>,
    place: &Place,
    offset: usize,
    row_bytes: usize,
    dtype: DType,
    shape: &[u64],
) {
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
