//! Columns: the rows of one field that one put stored together, as a
//! regular run at a constant stride in one extent, one range per nested
//! row, or plain values; and turning them back into cells.

use std::sync::Arc;

use bytes::Bytes;
use smallvec::SmallVec;

use super::{Columns, PutField};
use crate::batch::{Cell, Field, Value};
use crate::extent::{Extent, Received};
use crate::tensor::{Dtype, Tensor};

/// A stored column, allocated with the other regular columns one put
/// stored in the same extent of a unit (`Arc<[Column]>`, one allocation a
/// unit a put: [`Group::whole`] or [`Group::take`]). A 32-field put of 4
/// rows over 4 units made 128 `Arc`s of one column each, the most
/// frequent allocation of a small put in `stowd`; with the groups it
/// makes 4. Measured (`small_put`, docs/benchmarks.md): a put's
/// allocations fell 2-3x with this and the wire layout's inline shapes,
/// its time did not move beyond the noise (glibc's per-thread cache
/// served those `Arc`s cheaply). Columns share
/// a group only when they share the extent, so a group outliving one of
/// its columns (the rows of one field overwritten) keeps no more memory
/// alive than the others' rows do: that column's metadata (about 100
/// bytes), not its bytes.
#[derive(Clone, Debug)]
pub struct ColumnRef {
    group: Arc<[Column]>,
    at: u32,
}

impl ColumnRef {
    /// A column of its own.
    pub fn new(column: Column) -> ColumnRef {
        ColumnRef {
            group: Arc::new([column]),
            at: 0,
        }
    }

    /// Whether `self` and `other` are in one allocation (one [`Group`]).
    pub fn shares_allocation_with(&self, other: &ColumnRef) -> bool {
        Arc::ptr_eq(&self.group, &other.group)
    }

    /// Field `f`'s column of a put's columns taken whole
    /// ([`Group::whole`]).
    pub fn of_whole(group: &Arc<[Column]>, f: usize) -> ColumnRef {
        ColumnRef {
            group: group.clone(),
            at: u32::try_from(f).expect("a put's fields are counted in u32"),
        }
    }

    /// The next column of the lists [`Group::take`] was given, as
    /// stored: in `group`'s allocation if it was moved there (`column` is
    /// then the empty values column left in its place), else on its own.
    /// Called once for each column of those lists, in their order.
    pub fn place(group: &mut Option<Group>, column: Column) -> ColumnRef {
        match group {
            Some(g) => {
                let k = g.seen;
                g.seen += 1;
                if !g.moved.get(k).is_some_and(|&m| m) {
                    return ColumnRef::new(column);
                }
                let at = g.next;
                g.next += 1;
                ColumnRef {
                    group: g.columns.clone(),
                    at,
                }
            }
            None => ColumnRef::new(column),
        }
    }
}

/// The regular columns of a put at a unit that lie in one extent, in one
/// allocation ([`ColumnRef`]): moved there from the put's lists, each
/// left as an empty values column (no allocation) for [`ColumnRef::place`]
/// to drop. Moved, not copied: a copy took two reference counts a column
/// and dropping the original two more, atomic operations of about 7 ns
/// each on these VMs, 4 a (unit, field) pair of every put (see
/// docs/benchmarks.md, "A field's cost, a third time").
pub struct Group {
    columns: Arc<[Column]>,
    /// Per column of the lists, in order: whether it was moved (none past
    /// the last one moved).
    moved: SmallVec<[bool; 64]>,
    /// Columns placed so far, and moved ones among them.
    seen: usize,
    next: u32,
}

impl Group {
    /// A put's fields at a unit as one allocation, field `f`'s column at
    /// `f` ([`ColumnRef::of_whole`]), when there are two or more, each is
    /// one regular column and all lie in one extent (then a field
    /// overwritten keeps alive no more bytes than the others' rows do, as
    /// in [`Group::take`]): the usual small put, whose frames arrive in
    /// one buffer. Each column is moved out (its field left with none);
    /// nothing is searched or left behind to drop, where [`Group::take`]
    /// cost about 230 instructions a (unit, field) pair of a 32-field put
    /// (callgrind).
    pub fn whole(fields: &mut [PutField]) -> Option<Arc<[Column]>> {
        let mut extent: Option<&Arc<Extent>> = None;
        let one = fields.len() >= 2
            && fields.iter().all(|(_, c)| match &c[..] {
                [Column::Regular(r)] => match extent {
                    Some(e) => Arc::ptr_eq(e, &r.extent),
                    None => {
                        extent = Some(&r.extent);
                        true
                    }
                },
                _ => false,
            });
        // `Map<IterMut, _>` has a trusted length: one allocation.
        one.then(|| {
            fields
                .iter_mut()
                .map(|(_, c)| c.pop().expect("one column a field"))
                .collect()
        })
    }

    /// Moves the regular columns of `items`' column lists (`columns` of
    /// each, in order) that lie in the extent of the first regular one
    /// into a group, if two or more do. Every column of those lists must
    /// then go through [`ColumnRef::place`], in the same order.
    pub fn take<T>(items: &mut [T], columns: impl Fn(&mut T) -> &mut Columns) -> Option<Group> {
        let extent = items.iter_mut().find_map(|t| {
            columns(t).iter().find_map(|c| match c {
                Column::Regular(r) => Some(r.extent.clone()),
                _ => None,
            })
        })?;
        let holds = |c: &Column| matches!(c, Column::Regular(r) if Arc::ptr_eq(&r.extent, &extent));
        let n: usize = items
            .iter_mut()
            .map(|t| columns(t).iter().filter(|c| holds(c)).count())
            .sum();
        if n < 2 {
            return None;
        }
        let mut moved = SmallVec::new();
        let mut all = items.iter_mut().flat_map(|t| columns(t).iter_mut());
        // `Map<Range, _>` has a trusted length: one allocation.
        let grouped: Arc<[Column]> = (0..n)
            .map(|_| {
                loop {
                    let c = all.next().expect("counted above");
                    let m = holds(c);
                    moved.push(m);
                    if m {
                        break std::mem::replace(c, Column::Values(Vec::new()));
                    }
                }
            })
            .collect();
        Some(Group {
            columns: grouped,
            moved,
            seen: 0,
            next: 0,
        })
    }
}

impl std::ops::Deref for ColumnRef {
    type Target = Column;

    fn deref(&self) -> &Column {
        &self.group[self.at as usize]
    }
}

impl AsRef<Column> for ColumnRef {
    fn as_ref(&self) -> &Column {
        self
    }
}

/// `shape` as a column's row shape: `last`'s (the row shape of the column
/// made before) when they are equal, else a new one, kept in `last`.
pub fn shared_row_shape(last: &mut Option<Arc<[u64]>>, shape: &[u64]) -> Arc<[u64]> {
    match last {
        Some(kept) if **kept == *shape => kept.clone(),
        _ => last.insert(shape.into()).clone(),
    }
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
    pub dtype: Dtype,
    pub row_shape: Arc<[u64]>,
}

/// One row of a nested field: `len` bytes at `offset` in the extent.
#[derive(Clone, Debug)]
pub struct NestedRow {
    pub extent: Arc<Extent>,
    pub offset: usize,
    pub len: usize,
    pub dtype: Dtype,
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
        Column::regular_sharing(extent, offset, t, &mut None)
    }

    /// [`Column::regular`], its row shape shared with `last` (the row
    /// shape of the column made before) when they are equal: the columns
    /// of a put, many fields of one row shape over several units, then
    /// hold one row shape between them, not one allocation each.
    pub fn regular_sharing(
        extent: Arc<Extent>,
        offset: usize,
        t: &Tensor,
        last: &mut Option<Arc<[u64]>>,
    ) -> Column {
        let row_shape = shared_row_shape(last, t.row_shape());
        Column::Regular(RegularColumn {
            extent,
            offset,
            stride: t.row_stride(),
            rows: t.rows(),
            row_bytes: t.row_bytes(),
            dtype: t.dtype(),
            row_shape,
        })
    }

    /// A nested row: the whole of `t`, whose bytes start `offset` bytes into
    /// `extent`. `t` must be contiguous (every nested row is).
    pub fn nested_row(extent: Arc<Extent>, offset: usize, t: Tensor) -> NestedRow {
        let len = t.payload_len();
        let dtype = t.dtype();
        NestedRow {
            extent,
            offset,
            len,
            dtype,
            shape: t.into_shape().into_boxed_slice(),
        }
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

    /// The columns of a decoded `stowage/1` field as stored: a regular
    /// field's parts each a column over the frame it arrived in (several
    /// parts are not joined), a nested field's rows one column, values one.
    pub fn from_wire(field: crate::wire::native::WireField, received: &Received) -> Vec<Column> {
        use crate::wire::native::WireField;
        match field {
            WireField::Regular(p) => {
                let mut shape = vec![0u64];
                shape.extend_from_slice(p.row_shape());
                p.parts()
                    .iter()
                    .map(|(bytes, rows)| {
                        shape[0] = *rows;
                        let t = tensor(bytes.clone(), p.dtype(), shape.clone());
                        let (extent, offset, _) = received.locate_or_own(t.buffer());
                        Column::regular(extent, offset, &t)
                    })
                    .collect()
            }
            WireField::Nested(rows) => vec![Column::from_field(Field::Nested(rows), received)],
            WireField::Values(v) => vec![Column::Values(v)],
        }
    }

    /// A column over the rows of `t` (rows on axis 0, possibly strided),
    /// in an extent of its own: `t`'s bytes, which start at its first row
    /// (rows read back from a checkpoint).
    pub fn from_rows(t: &Tensor) -> Column {
        Column::regular(Extent::new(t.buffer().clone()), 0, t)
    }

    /// A column of one row, in an extent of its own (a row received from a
    /// remote unit).
    pub fn from_cell(cell: Cell) -> Column {
        match cell {
            Cell::Tensor(t) => {
                let t = if t.is_contiguous() && t.byte_len() == t.payload_len() {
                    t
                } else {
                    contiguous(&t)
                };
                let extent = Extent::new(t.buffer().clone());
                Column::Nested(vec![Column::nested_row(extent, 0, t)])
            }
            Cell::Value(v) => Column::Values(vec![v]),
        }
    }

    /// Marks the column's extents file-backed (see [`Extent::mark_mapped`]).
    pub fn mark_mapped(&self) {
        match self {
            Column::Regular(c) => c.extent.mark_mapped(),
            Column::Nested(rows) => rows.iter().for_each(|r| r.extent.mark_mapped()),
            Column::Values(_) => {}
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
    pub fn row_len(&self, r: usize) -> u64 {
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

impl RegularColumn {
    /// Rows `first..first + count` as a zero-copy (possibly strided) view.
    pub fn rows_tensor(&self, first: usize, count: usize) -> Tensor {
        let bytes = self
            .extent
            .bytes()
            .slice(self.offset + first * self.stride..);
        let mut shape = Vec::with_capacity(1 + self.row_shape.len());
        shape.push(count as u64);
        shape.extend_from_slice(&self.row_shape);
        Tensor::strided(bytes, self.dtype, shape, self.stride)
            .expect("stored rows match their shapes")
    }
}

/// A tensor of bytes known to match the shape (they were checked when the
/// rows were stored).
fn tensor(bytes: Bytes, dtype: Dtype, shape: Vec<u64>) -> Tensor {
    Tensor::contiguous(bytes, dtype, shape).expect("stored rows match their shapes")
}

fn contiguous(t: &Tensor) -> Tensor {
    Tensor::contiguous(t.contiguous_bytes(), t.dtype(), t.shape().to_vec()).expect("same shape")
}
