//! Deduplicated puts: byte-identical rows of one field within one put are
//! stored once (`[dedup] fields`, field-name patterns).
//!
//! GRPO-style batches repeat each prompt (and, in multimodal jobs, its
//! images) `n_samples_per_prompt` times in one put. For a field the config
//! names, the rows the local units are about to store are hashed once
//! (XXH3, one pass over the bytes); rows whose hash and bytes match an
//! earlier row are duplicates. Without duplicates nothing changes (the rows
//! stay views of the request's buffers). With some, the distinct rows are
//! copied once into a new extent, back to back, and every row, duplicates
//! included, becomes a reference into it; the request's buffers are then
//! no longer held for that field. Each row keeps its own index entry, so
//! clearing or overwriting one copy leaves the others.
//!
//! Values (strings, bytes) are not deduplicated. A unit's capacity still
//! counts every row's bytes (the logical size); `stats` reports the rows
//! and bytes saved.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use rustc_hash::FxHashMap;

use crate::extent::Extent;
use crate::store::{Column, NestedRow};
use crate::tensor::Dtype;

/// Deduplication counters, as `stats` and `/metrics` show them.
#[derive(Debug, Default)]
pub struct DedupCounters {
    /// Row bytes hashed.
    pub scanned_bytes: AtomicU64,
    /// Rows found identical to an earlier row of the same put and field.
    pub rows: AtomicU64,
    /// Their bytes: stored once instead of again.
    pub bytes: AtomicU64,
    /// Time spent hashing, comparing and compacting, nanoseconds.
    pub ns: AtomicU64,
}

/// Per unit, the fields of its part of a put (`None`: no rows, or remote).
pub(super) type UnitFields<'a> = Option<&'a mut Vec<crate::store::PutField>>;

/// One row to store: its unit, bytes, dtype and shape.
struct Row<'a> {
    unit: usize,
    bytes: &'a [u8],
    dtype: Dtype,
    shape: &'a [u64],
}

/// Deduplicates field `f` of a put's per-unit columns (see the module
/// doc); `units[u]` is `None` for a unit that gets no rows or is not local.
pub(super) fn field(units: &mut [UnitFields<'_>], f: usize, counters: &DedupCounters) {
    let started = Instant::now();
    let timed = || {
        counters
            .ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed)
    };
    // The buffers the rows are in, held for the scan: one per regular
    // column, one per nested row.
    let mut buffers: Vec<(usize, &Column, usize, Bytes)> = Vec::new();
    for (u, part) in units.iter().enumerate() {
        let Some(fields) = part else { continue };
        for column in &fields[f].1 {
            match column {
                Column::Values(_) => return,
                Column::Regular(c) => buffers.push((u, column, 0, c.extent.bytes())),
                Column::Nested(nested) => {
                    for (k, n) in nested.iter().enumerate() {
                        let bytes = n.extent.bytes().slice(n.offset..n.offset + n.len);
                        buffers.push((u, column, k, bytes));
                    }
                }
            }
        }
    }
    let mut rows: Vec<Row<'_>> = Vec::new();
    for (u, column, k, bytes) in &buffers {
        match column {
            Column::Regular(c) => {
                for r in 0..c.rows as usize {
                    let at = c.offset + r * c.stride;
                    rows.push(Row {
                        unit: *u,
                        bytes: &bytes[at..at + c.row_bytes],
                        dtype: c.dtype,
                        shape: &c.row_shape,
                    });
                }
            }
            Column::Nested(nested) => rows.push(Row {
                unit: *u,
                bytes,
                dtype: nested[*k].dtype,
                shape: &nested[*k].shape,
            }),
            Column::Values(_) => unreachable!("refused above"),
        }
    }
    // Per row, the first row with the same dtype, shape and bytes. Rows
    // whose hashes match but whose bytes differ (a collision) stay apart.
    let mut first: FxHashMap<u64, u32> = FxHashMap::default();
    first.reserve(rows.len());
    let mut same_as: Vec<u32> = Vec::with_capacity(rows.len());
    let mut scanned = 0u64;
    for (i, row) in rows.iter().enumerate() {
        scanned += row.bytes.len() as u64;
        let j = *first
            .entry(xxhash_rust::xxh3::xxh3_64(row.bytes))
            .or_insert(i as u32);
        let o = &rows[j as usize];
        let same =
            j as usize != i && o.dtype == row.dtype && o.shape == row.shape && o.bytes == row.bytes;
        same_as.push(if same { j } else { i as u32 });
    }
    counters.scanned_bytes.fetch_add(scanned, Ordering::Relaxed);
    let duplicates = same_as
        .iter()
        .enumerate()
        .filter(|(i, j)| *i != **j as usize)
        .count();
    if duplicates == 0 {
        timed();
        return;
    }
    // The distinct rows back to back, each at a multiple of 64 bytes.
    let mut offsets = vec![0usize; rows.len()];
    let mut size = 0usize;
    for (i, row) in rows.iter().enumerate() {
        if same_as[i] as usize == i {
            offsets[i] = size;
            size += row.bytes.len().next_multiple_of(64);
        }
    }
    let mut buf = BytesMut::zeroed(size);
    let mut saved = 0u64;
    for (i, row) in rows.iter().enumerate() {
        if same_as[i] as usize == i {
            buf[offsets[i]..offsets[i] + row.bytes.len()].copy_from_slice(row.bytes);
        } else {
            saved += row.bytes.len() as u64;
        }
    }
    let extent: Arc<Extent> = Extent::new(buf.freeze());
    // Each unit's rows of the field, in order, as one column of references.
    let mut per_unit: Vec<Vec<NestedRow>> = units.iter().map(|_| Vec::new()).collect();
    for (i, row) in rows.iter().enumerate() {
        per_unit[row.unit].push(NestedRow {
            extent: extent.clone(),
            offset: offsets[same_as[i] as usize],
            len: row.bytes.len(),
            dtype: row.dtype,
            shape: row.shape.to_vec().into_boxed_slice(),
        });
    }
    drop(rows);
    drop(buffers);
    for (part, rows) in units.iter_mut().zip(per_unit) {
        if let Some(fields) = part
            && !rows.is_empty()
        {
            fields[f].1 = smallvec::smallvec![Column::Nested(rows)];
        }
    }
    counters
        .rows
        .fetch_add(duplicates as u64, Ordering::Relaxed);
    counters.bytes.fetch_add(saved, Ordering::Relaxed);
    timed();
}
