//! Every row of a unit at once: a consistent snapshot for a checkpoint,
//! and replacing the unit's rows with a snapshot read back.
//!
//! A snapshot is per column, not per row: the live rows of a regular
//! column that follow each other are one [`Stored::Rows`] (a zero-copy
//! view of the column, up to [`RUN_BYTES`] each), so a checkpoint of a
//! million rows put in a few large puts is a few tensors, and a restore
//! stores it back as a few columns.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Column, ColumnRef, Group, Inner, Loc, StoreError, Unit};
use crate::batch::Cell;
use crate::tensor::Tensor;

/// Most bytes in one [`Stored::Rows`]: a run of a strided column is
/// gathered this much at a time when written.
pub const RUN_BYTES: usize = 64 << 20;

/// Stored rows of one field.
#[derive(Clone, Debug)]
pub enum Stored {
    /// Rows of a regular column: row `i` of `tensor` (axis 0) is stored
    /// under `indexes[i]`.
    Rows { indexes: Vec<u64>, tensor: Tensor },
    /// One row: a nested row or a plain value.
    One { index: u64, cell: Cell },
}

impl Stored {
    /// The global indexes, in row order.
    pub fn indexes(&self) -> &[u64] {
        match self {
            Stored::Rows { indexes, .. } => indexes,
            Stored::One { index, .. } => std::slice::from_ref(index),
        }
    }

    /// Bytes of the rows.
    pub fn byte_len(&self) -> u64 {
        match self {
            Stored::Rows { tensor, .. } => tensor.payload_len() as u64,
            Stored::One { cell, .. } => cell.byte_len() as u64,
        }
    }

    /// The rows at `positions` (an arithmetic progression: `start`,
    /// `step`, `count`), as a zero-copy view.
    fn view(&self, start: usize, step: usize, count: usize) -> Stored {
        match self {
            Stored::Rows { indexes, tensor } => Stored::Rows {
                indexes: (0..count).map(|k| indexes[start + k * step]).collect(),
                tensor: tensor
                    .rows_view(start as u64, step as u64, count as u64)
                    .expect("positions of the run"),
            },
            one => one.clone(),
        }
    }

    /// Splits the rows by where they go: `to(g)` is the part of index `g`
    /// (None: dropped). Rows going to one part at evenly spaced positions
    /// (consecutive indexes over `N` units: every `N`-th row) stay one
    /// view; no row is copied.
    pub fn split(&self, to: impl Fn(u64) -> Option<usize>) -> Vec<(usize, Stored)> {
        let indexes = self.indexes();
        let parts: Vec<Option<usize>> = indexes.iter().map(|&g| to(g)).collect();
        if let Some(&Some(first)) = parts.first()
            && parts.iter().all(|p| *p == Some(first))
        {
            return vec![(first, self.clone())];
        }
        let mut by_part: HashMap<usize, Vec<usize>> = HashMap::new();
        for (i, p) in parts.iter().enumerate() {
            if let Some(p) = p {
                by_part.entry(*p).or_default().push(i);
            }
        }
        let mut out = Vec::new();
        for (part, positions) in by_part {
            let mut k = 0;
            while k < positions.len() {
                let start = positions[k];
                let step = positions.get(k + 1).map_or(1, |next| next - start);
                let mut count = 1;
                while k + count < positions.len() && positions[k + count] == start + count * step {
                    count += 1;
                }
                out.push((part, self.view(start, step, count)));
                k += count;
            }
        }
        out.sort_by_key(|(p, s)| (*p, s.indexes()[0]));
        out
    }
}

/// Every row of a unit: per field (by name), its stored rows in order of
/// their first global index.
pub type Snapshot = Vec<(Arc<str>, Vec<Stored>)>;

/// Adds `stored` to the rows of `field` in `snapshot` (the field at the
/// end if it is new; the last field is looked at first).
pub fn add_rows(snapshot: &mut Snapshot, field: &str, stored: impl IntoIterator<Item = Stored>) {
    let i = match snapshot.last() {
        Some((f, _)) if **f == *field => snapshot.len() - 1,
        _ => match snapshot.iter().position(|(f, _)| **f == *field) {
            Some(i) => i,
            None => {
                snapshot.push((Arc::from(field), Vec::new()));
                snapshot.len() - 1
            }
        },
    };
    snapshot[i].1.extend(stored);
}

/// The runs of consecutive rows in `rows` ((row, global index), sorted),
/// each at most `max` rows: (first row, count, their indexes).
fn runs(rows: &[(u32, u64)], max: usize) -> impl Iterator<Item = (u32, Vec<u64>)> + '_ {
    let mut k = 0;
    std::iter::from_fn(move || {
        let (first, _) = *rows.get(k)?;
        let mut n = 1;
        while n < max && k + n < rows.len() && rows[k + n].0 == first + n as u32 {
            n += 1;
        }
        let indexes = rows[k..k + n].iter().map(|(_, g)| *g).collect();
        k += n;
        Some((first, indexes))
    })
}

impl Unit {
    /// Every stored row, by field, taken under the unit's lock: a
    /// consistent snapshot (views of the stored extents, nothing is
    /// copied). Fields by name.
    pub fn snapshot(&self) -> Snapshot {
        let inner = self.lock();
        let mut out: Snapshot = Vec::new();
        for (name, index) in inner.fields.iter().filter(|(_, i)| !i.is_empty()) {
            let mut by_column: HashMap<u32, Vec<(u32, u64)>> = HashMap::new();
            for (n, packed) in index.iter() {
                let g = inner.rows.index_of(n);
                let loc = Loc::unpack(packed);
                by_column.entry(loc.column).or_default().push((loc.row, g));
            }
            let mut stored = Vec::new();
            for (c, mut rows) in by_column {
                rows.sort_unstable();
                let column = &inner.columns[c as usize]
                    .as_ref()
                    .expect("indexed rows point at live columns")
                    .column;
                match column.as_ref() {
                    Column::Regular(col) => {
                        let max = (RUN_BYTES / col.row_bytes.max(1)).max(1);
                        for (first, indexes) in runs(&rows, max) {
                            let tensor = col.rows_tensor(first as usize, indexes.len());
                            stored.push(Stored::Rows { indexes, tensor });
                        }
                    }
                    other => stored.extend(rows.iter().map(|&(r, g)| Stored::One {
                        index: g,
                        cell: other.cell(r as usize),
                    })),
                }
            }
            stored.sort_unstable_by_key(|s| s.indexes()[0]);
            out.push((name.clone(), stored));
        }
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Replaces everything the unit holds with `rows` (a [`Unit::snapshot`]
    /// read back): [`Unit::prepare`], then [`Unit::commit`]. If the rows do
    /// not fit, nothing changes. The caller journals the change.
    pub fn replace_with(&self, rows: Snapshot, mapped: bool) -> Result<(), StoreError> {
        let r = self.prepare(rows, mapped)?;
        self.commit(r);
        Ok(())
    }

    /// Whether rows of `bytes` would fit in place of what the unit holds:
    /// its capacity, or (spilling, rows not `mapped` from a checkpoint
    /// file) the room left in memory and on the spill disk. Nothing is
    /// read or changed: a load asks before it reads a file's rows.
    pub fn check_fits(&self, bytes: u64, mapped: bool) -> Result<(), StoreError> {
        if let Some(capacity) = self.capacity
            && bytes > capacity
        {
            return Err(StoreError::Capacity {
                unit: self.id.clone(),
                needed: bytes,
                free: capacity,
                capacity,
            });
        }
        if let (Some(spill), false) = (&self.spill, mapped) {
            let held = self.stats().bytes;
            spill.check_room(bytes, held)?;
        }
        Ok(())
    }

    /// The columns `rows` would be stored as, checked to fit
    /// ([`Unit::check_fits`]) and counted by the spiller (which may spill
    /// to make room, or refuse). Nothing the unit holds changes.
    pub fn prepare(&self, rows: Snapshot, mapped: bool) -> Result<Replacement, StoreError> {
        let bytes: u64 = rows
            .iter()
            .flat_map(|(_, r)| r.iter().map(Stored::byte_len))
            .sum();
        self.check_fits(bytes, mapped)?;
        let mut fields: Vec<super::PutField> = Vec::with_capacity(rows.len());
        let mut all: Vec<Vec<u64>> = Vec::with_capacity(rows.len());
        for (field, stored) in rows {
            let mut indexes = Vec::new();
            let mut columns = super::Columns::new();
            for s in stored {
                indexes.extend_from_slice(s.indexes());
                let column = match s {
                    Stored::Rows { tensor, .. } => Column::from_rows(&tensor),
                    Stored::One { cell, .. } => Column::from_cell(cell),
                };
                if mapped {
                    column.mark_mapped();
                }
                columns.push(column);
            }
            if indexes.is_empty() {
                continue;
            }
            if let Some(g) = super::duplicate(&indexes) {
                return Err(StoreError::DuplicateIndex(g));
            }
            fields.push((Arc::from(&*field), columns));
            all.push(indexes);
        }
        self.admit(&fields)?;
        let fields = fields
            .into_iter()
            .zip(all)
            .map(|((name, columns), indexes)| (name, indexes, columns))
            .collect();
        Ok(Replacement { fields, bytes })
    }

    /// Puts `r` in place of everything the unit holds, at once, under its
    /// lock: a get sees all the old rows or all the new ones. Indexes
    /// marked lost stay so unless `r` stores them.
    pub fn commit(&self, r: Replacement) {
        let mut inner = self.lock();
        let mut new = Inner {
            generation: inner.generation + 1,
            ..Inner::default()
        };
        let generation = new.generation;
        for (name, indexes, mut columns_in) in r.fields {
            let mut added = vec![0u32; indexes.len()];
            let mut nums = vec![0u32; indexes.len()];
            new.rows.number(&indexes, &mut nums);
            let mut group = Group::take(std::slice::from_mut(&mut columns_in), |c| c);
            let columns_in = columns_in
                .into_iter()
                .map(|c| ColumnRef::place(&mut group, c));
            new.store_field(
                &name, &indexes, &nums, columns_in, generation, &mut added, &mut None,
            );
            new.rows.add_fields(&nums, &added);
        }
        new.bytes = r.bytes;
        new.lost = std::mem::take(&mut inner.lost);
        if !new.lost.is_empty() {
            let rows = &new.rows;
            new.lost.retain(|g, _| !rows.contains(*g));
        }
        let old = std::mem::replace(&mut *inner, new);
        self.publish(&inner);
        drop(inner);
        let freed = old.bytes;
        drop(old);
        crate::release::note_freed(freed);
    }

    /// The global indexes the unit holds any field of, sorted.
    pub fn indexes(&self) -> Vec<u64> {
        let inner = self.lock();
        let mut v: Vec<u64> = inner.rows.indexes().collect();
        drop(inner);
        v.sort_unstable();
        v
    }
}

/// A unit's new rows, made into columns and checked to fit: what
/// [`Unit::commit`] puts in place of everything the unit holds.
pub struct Replacement {
    /// Per field: its name, the global index of each row, the columns.
    fields: Vec<(Arc<str>, Vec<u64>, super::Columns)>,
    bytes: u64,
}

impl std::fmt::Debug for Replacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replacement")
            .field("fields", &self.fields.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Dtype;
    use bytes::Bytes;

    fn rows(n: u64) -> Stored {
        let t = Tensor::contiguous(
            Bytes::from((0..n as u8).collect::<Vec<_>>()),
            Dtype::Uint8,
            vec![n, 1],
        )
        .unwrap();
        Stored::Rows {
            indexes: (100..100 + n).collect(),
            tensor: t,
        }
    }

    #[test]
    fn a_run_splits_into_one_strided_view_per_unit() {
        let parts = rows(10).split(|g| Some((g % 4) as usize));
        assert_eq!(parts.len(), 4);
        let (u, s) = &parts[0];
        assert_eq!(*u, 0);
        assert_eq!(s.indexes(), &[100, 104, 108]);
        let Stored::Rows { tensor, .. } = s else {
            panic!()
        };
        assert_eq!(tensor.contiguous_bytes().as_ref(), &[0, 4, 8]);
        // Dropping indexes breaks a progression into the pieces left.
        let parts = rows(10).split(|g| (g != 104).then_some(0));
        let got: Vec<&[u64]> = parts.iter().map(|(_, s)| s.indexes()).collect();
        assert_eq!(
            got,
            vec![&[100, 101, 102, 103][..], &[105, 106, 107, 108, 109][..]]
        );
        // All to one part: the run as it is.
        assert_eq!(rows(3).split(|_| Some(2))[0].1.indexes(), &[100, 101, 102]);
        assert!(rows(3).split(|_| None).is_empty());
    }
}
