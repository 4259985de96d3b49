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

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::BytesMut;

use crate::extent::Extent;
use crate::store::{Column, NestedRow};
use crate::tensor::Tensor;

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

/// Where a row to store is: (unit, column, row in it).
type RowAt = (usize, usize, usize);

/// Per unit, the fields of its part of a put (`None`: no rows, or remote).
pub(super) type UnitFields<'a> = Option<&'a mut Vec<(String, Vec<Column>)>>;

/// Deduplicates field `f` of a put's per-unit columns (see the module
/// doc); `units[u]` is `None` for a unit that gets no rows or is not local.
pub(super) fn field(units: &mut [UnitFields<'_>], f: usize, counters: &DedupCounters) {
    let started = Instant::now();
    let mut rows: Vec<(RowAt, Tensor)> = Vec::new();
    for (u, part) in units.iter().enumerate() {
        let Some(fields) = part else { continue };
        for (c, column) in fields[f].1.iter().enumerate() {
            if matches!(column, Column::Values(_)) {
                return;
            }
            for r in 0..column.rows() as usize {
                match column.cell(r) {
                    crate::batch::Cell::Tensor(t) => rows.push(((u, c, r), t)),
                    crate::batch::Cell::Value(_) => return,
                }
            }
        }
    }
    // The first row with the same dtype, shape and bytes, per row.
    let mut first: HashMap<u64, Vec<usize>> = HashMap::with_capacity(rows.len());
    let mut same_as: Vec<usize> = Vec::with_capacity(rows.len());
    let mut scanned = 0u64;
    for (i, (_, t)) in rows.iter().enumerate() {
        let bytes = t.contiguous_bytes();
        scanned += bytes.len() as u64;
        let candidates = first.entry(xxhash_rust::xxh3::xxh3_64(&bytes)).or_default();
        let found = candidates.iter().copied().find(|&j| {
            let o = &rows[j].1;
            o.dtype() == t.dtype() && o.shape() == t.shape() && o.contiguous_bytes() == bytes
        });
        match found {
            Some(j) => same_as.push(j),
            None => {
                candidates.push(i);
                same_as.push(i);
            }
        }
    }
    counters.scanned_bytes.fetch_add(scanned, Ordering::Relaxed);
    let duplicates = same_as.iter().enumerate().filter(|(i, j)| i != *j).count();
    if duplicates == 0 {
        counters
            .ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        return;
    }
    // The distinct rows back to back, each at a multiple of 64 bytes.
    let mut offsets = vec![0usize; rows.len()];
    let mut size = 0usize;
    for (i, (_, t)) in rows.iter().enumerate() {
        if same_as[i] == i {
            offsets[i] = size;
            size += t.payload_len().next_multiple_of(64);
        }
    }
    let mut buf = BytesMut::zeroed(size);
    let mut saved = 0u64;
    for (i, (_, t)) in rows.iter().enumerate() {
        if same_as[i] == i {
            let bytes = t.contiguous_bytes();
            buf[offsets[i]..offsets[i] + bytes.len()].copy_from_slice(&bytes);
        } else {
            saved += t.payload_len() as u64;
        }
    }
    let extent: Arc<Extent> = Extent::new(buf.freeze());
    // Each unit's rows of the field, in order, as one column of references.
    let mut per_unit: Vec<Vec<NestedRow>> = units.iter().map(|_| Vec::new()).collect();
    for (i, ((u, _, _), t)) in rows.iter().enumerate() {
        per_unit[*u].push(NestedRow {
            extent: extent.clone(),
            offset: offsets[same_as[i]],
            len: t.payload_len(),
            dtype: t.dtype(),
            shape: t.shape().to_vec().into_boxed_slice(),
        });
    }
    for (part, rows) in units.iter_mut().zip(per_unit) {
        if let Some(fields) = part
            && !rows.is_empty()
        {
            fields[f].1 = vec![Column::Nested(rows)];
        }
    }
    counters
        .rows
        .fetch_add(duplicates as u64, Ordering::Relaxed);
    counters.bytes.fetch_add(saved, Ordering::Relaxed);
    counters
        .ns
        .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
}
