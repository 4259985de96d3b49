//! Deterministic test data: tensors whose bytes depend on a seed, and the
//! cells a unit is expected to hand back for them.

use bytes::Bytes;
use stowage_host::batch::{Cell, Field, Value};
use stowage_host::tensor::{Dtype, Tensor, contiguous_len};
use stowage_host::wire::native::WireField;

/// `len` pseudo-random bytes from `seed` (splitmix64).
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5851_f42d_4c95_7f2d;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A contiguous tensor of `shape` with seeded bytes (`bool` elements are
/// 0 or 1, so every byte is a valid bool).
pub fn tensor(dtype: Dtype, shape: &[u64], seed: u64) -> Tensor {
    let len = contiguous_len(dtype, shape).expect("test shapes fit");
    let mut bytes = pattern(len, seed);
    if dtype == Dtype::Bool {
        bytes.iter_mut().for_each(|b| *b &= 1);
    }
    Tensor::contiguous(Bytes::from(bytes), dtype, shape.to_vec()).expect("length matches")
}

/// A float32 tensor whose element `[r, c]` is `r * 1000 + c + seed`.
pub fn f32_rows(rows: u64, cols: u64, seed: u64) -> Tensor {
    let bytes: Vec<u8> = (0..rows)
        .flat_map(|r| (0..cols).map(move |c| (r * 1000 + c + seed) as f32))
        .flat_map(f32::to_le_bytes)
        .collect();
    Tensor::contiguous(Bytes::from(bytes), Dtype::Float32, vec![rows, cols])
        .expect("length matches")
}

/// A nested field: row `i` is a 1-d tensor of `lengths[i]` elements.
pub fn nested(dtype: Dtype, lengths: &[u64], seed: u64) -> Field {
    Field::Nested(
        lengths
            .iter()
            .enumerate()
            .map(|(i, &n)| tensor(dtype, &[n], seed + i as u64))
            .collect(),
    )
}

/// A values field of strings `"<prefix>-<i>"`.
pub fn strings(prefix: &str, n: usize) -> Field {
    Field::Values(
        (0..n)
            .map(|i| Value::Str(format!("{prefix}-{i}")))
            .collect(),
    )
}

/// The cells a unit stores for `field`: one per row.
pub fn cells(field: &Field) -> Vec<Cell> {
    match field {
        Field::Regular(t) => (0..t.rows())
            .map(|i| Cell::Tensor(t.row_tensor(i).expect("row in range")))
            .collect(),
        Field::Nested(rows) => rows.iter().cloned().map(Cell::Tensor).collect(),
        Field::Values(v) => v.iter().cloned().map(Cell::Value).collect(),
    }
}

/// The expected cells of `field` (put at `put_indexes`) for a get of `get_indexes`.
pub fn expected(field: &Field, put_indexes: &[u64], get_indexes: &[u64]) -> Vec<Cell> {
    let all = cells(field);
    get_indexes
        .iter()
        .map(|g| {
            let pos = put_indexes
                .iter()
                .position(|p| p == g)
                .unwrap_or_else(|| panic!("index {g} was not put"));
            all[pos].clone()
        })
        .collect()
}

/// (dtype, shape, bytes) of a tensor cell, for readable assertion failures.
pub fn describe(cell: &Cell) -> String {
    match cell {
        Cell::Tensor(t) => format!("{} {:?} {} bytes", t.dtype(), t.shape(), t.payload_len()),
        Cell::Value(v) => format!("{v:?}"),
    }
}

/// Asserts that `got` equals `want` cell by cell: same dtype, shape and
/// bytes for tensors, same values otherwise.
pub fn assert_cells(what: &str, got: &[Cell], want: &[Cell]) {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = match (g, w) {
            (Cell::Tensor(a), Cell::Tensor(b)) => {
                a.dtype() == b.dtype()
                    && a.shape() == b.shape()
                    && a.contiguous_bytes() == b.contiguous_bytes()
            }
            (a, b) => a == b,
        };
        assert!(
            same,
            "{what}: row {i} differs: got {}, want {}",
            describe(g),
            describe(w)
        );
    }
}

/// One cell per row of a field received over `stowage/1`.
pub fn wire_cells(field: WireField) -> Vec<Cell> {
    field.into_cells()
}

/// Five fields of every kind (float32, bfloat16, complex128 (no safetensors
/// dtype), nested int64, strings) on 6 indexes: the checkpoint tests' batch.
pub fn every_kind() -> (Vec<u64>, Vec<(String, Field)>) {
    let indexes: Vec<u64> = vec![3, 9, 10, 11, 40, 7];
    let fields = vec![
        ("x".to_string(), Field::Regular(f32_rows(6, 8, 1))),
        (
            "bf".to_string(),
            Field::Regular(tensor(Dtype::Bfloat16, &[6, 3], 2)),
        ),
        // complex128 has no safetensors dtype: kept as bytes plus its dtype.
        (
            "c".to_string(),
            Field::Regular(tensor(Dtype::Complex128, &[6, 2], 3)),
        ),
        (
            "resp".to_string(),
            nested(Dtype::Int64, &[3, 0, 7, 1, 2, 5], 4),
        ),
        ("text".to_string(), strings("t", 6)),
    ];
    (indexes, fields)
}
