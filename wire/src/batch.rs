//! Batches: global indexes plus named fields with one row per index.

use bytes::Bytes;

use crate::tensor::Tensor;

/// One non-tensor value of a field.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// A UTF-8 string.
    Str(String),
    /// Raw bytes.
    Bytes(Bytes),
    /// Any other value, kept as its exact msgpack encoding (for example a
    /// TransferQueue ext 1 pickle): stored and returned unchanged, never
    /// interpreted; but for TransferQueue's values with arrays inside, kept
    /// in an inlined form that the TransferQueue encoder writes back with
    /// one data frame per array (see `tq`'s module doc).
    Msgpack(Bytes),
}

impl Value {
    /// Bytes this value pins in memory.
    pub fn byte_len(&self) -> usize {
        match self {
            Value::Str(s) => s.len(),
            Value::Bytes(b) | Value::Msgpack(b) => b.len(),
        }
    }
}

/// The data of one field across the rows of a batch.
#[derive(Clone, Debug, PartialEq)]
pub enum Field {
    /// A regular tensor `[n, ...]`, rows on axis 0.
    Regular(Tensor),
    /// n rows of different shapes (a jagged tensor), one tensor per row.
    Nested(Vec<Tensor>),
    /// n plain values.
    Values(Vec<Value>),
}

impl Field {
    /// Number of rows.
    pub fn rows(&self) -> u64 {
        match self {
            Field::Regular(t) => t.rows(),
            Field::Nested(v) => v.len() as u64,
            Field::Values(v) => v.len() as u64,
        }
    }
}

/// One stored value: a single row of a field.
#[derive(Clone, Debug, PartialEq)]
pub enum Cell {
    /// A row of a regular or nested tensor (zero-copy slice).
    Tensor(Tensor),
    /// A plain value.
    Value(Value),
}

impl Cell {
    /// Bytes this cell pins.
    pub fn byte_len(&self) -> usize {
        match self {
            Cell::Tensor(t) => t.byte_len(),
            Cell::Value(v) => v.byte_len(),
        }
    }
}
