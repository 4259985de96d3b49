//! Fields as they travel: zero-copy views into frames (decoded) or into
//! stored buffers (to encode).

use bytes::{Bytes, BytesMut};

use smallvec::SmallVec;

use super::{Dims, Error, MAX_DIMS};
use crate::batch::{Cell, Field, Value};
use crate::tensor::{Dtype, Tensor, contiguous_len};

/// The data of one field on the wire.
#[derive(Clone, Debug, PartialEq)]
pub enum WireField {
    /// A regular tensor `[n, ...]`, its rows in one or more contiguous parts.
    Regular(RegularParts),
    /// A nested tensor: one tensor per row (shapes may differ, one dtype).
    Nested(Vec<Tensor>),
    /// Plain values, carried inline in frame 0.
    Values(Vec<Value>),
}

impl WireField {
    /// The descriptor's `kind`: `regular`, `nested` or `values`.
    pub fn kind(&self) -> &'static str {
        match self {
            WireField::Regular(_) => "regular",
            WireField::Nested(_) => "nested",
            WireField::Values(_) => "values",
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> u64 {
        match self {
            WireField::Regular(p) => p.rows(),
            WireField::Nested(rows) => rows.len() as u64,
            WireField::Values(values) => values.len() as u64,
        }
    }

    /// A field to send (client side). Zero copy, except that a row-strided
    /// regular tensor is compacted once into one part.
    pub fn from_field(field: &Field) -> Result<WireField, Error> {
        Ok(match field {
            Field::Regular(t) => WireField::Regular(RegularParts::from_tensor(t)?),
            Field::Nested(rows) => WireField::Nested(rows.clone()),
            Field::Values(values) => WireField::Values(values.clone()),
        })
    }

    /// A field to send from stored rows (server side, for a get_ok), zero
    /// copy: tensors of one dtype and one shape become a regular field with
    /// one part per row, tensors of one dtype and several shapes a nested
    /// field, values a values field. No rows give an empty values field.
    /// A mix of tensors and values, or of dtypes, cannot be sent
    /// ([`Error::MixedField`], code `unsupported`).
    pub fn from_cells(cells: Vec<Cell>) -> Result<WireField, Error> {
        let first = match cells.first() {
            None => return Ok(WireField::Values(Vec::new())),
            Some(Cell::Value(_)) => None,
            Some(Cell::Tensor(t)) => Some((t.dtype(), t.shape().to_vec())),
        };
        let Some((dtype, shape)) = first else {
            let values = cells.into_iter().map(|c| match c {
                Cell::Value(v) => Ok(v),
                Cell::Tensor(_) => Err(Error::MixedField("its rows mix tensors and values".into())),
            });
            return Ok(WireField::Values(values.collect::<Result<_, _>>()?));
        };
        let mut same_shape = true;
        let mut tensors = Vec::with_capacity(cells.len());
        for cell in cells {
            let Cell::Tensor(t) = cell else {
                return Err(Error::MixedField("its rows mix tensors and values".into()));
            };
            if t.dtype() != dtype {
                return Err(Error::MixedField(format!(
                    "its rows mix dtypes {dtype} and {}",
                    t.dtype()
                )));
            }
            same_shape &= t.shape() == shape.as_slice();
            tensors.push(t);
        }
        if !same_shape {
            return Ok(WireField::Nested(tensors));
        }
        let parts: PartBytes = tensors.iter().map(|t| (t.contiguous_bytes(), 1)).collect();
        Ok(WireField::Regular(RegularParts::new(dtype, shape, parts)?))
    }

    /// The field as a [`Field`] (client side, after a get). Zero copy,
    /// except that a regular field in several parts is concatenated once.
    pub fn into_field(self) -> Result<Field, Error> {
        Ok(match self {
            WireField::Regular(p) => Field::Regular(p.into_tensor()?),
            WireField::Nested(rows) => Field::Nested(rows),
            WireField::Values(values) => Field::Values(values),
        })
    }

    /// One cell per row, as a unit stores them (zero copy).
    pub fn into_cells(self) -> Vec<Cell> {
        match self {
            WireField::Regular(p) => p.row_tensors().map(Cell::Tensor).collect(),
            WireField::Nested(rows) => rows.into_iter().map(Cell::Tensor).collect(),
            WireField::Values(values) => values.into_iter().map(Cell::Value).collect(),
        }
    }
}

/// A regular tensor `[n, ...row_shape]` whose n rows are split, in order,
/// into parts: each part is `rows` consecutive C-contiguous rows in one
/// buffer (usually a slice of a received frame).
///
/// Invariants (checked by [`RegularParts::new`]): every part has at least
/// one row and exactly `rows * row_bytes` bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct RegularParts {
    dtype: Dtype,
    row_shape: Dims,
    row_bytes: usize,
    rows: u64,
    parts: PartBytes,
}

/// A regular field's `(bytes, rows)` parts: inline for the usual one.
pub type PartBytes = SmallVec<[(Bytes, u64); 1]>;

impl RegularParts {
    /// Checks and builds a regular field from `(bytes, rows)` parts (a
    /// `Vec` or the inline lists).
    pub fn new(
        dtype: Dtype,
        row_shape: impl Into<Dims>,
        parts: impl Into<PartBytes>,
    ) -> Result<RegularParts, Error> {
        let (row_shape, parts) = (row_shape.into(), parts.into());
        if row_shape.len() >= MAX_DIMS {
            return Err(Error::TooManyDims(row_shape.len() + 1));
        }
        let row_bytes = contiguous_len(dtype, &row_shape).map_err(|_| Error::BadShape {
            shape: row_shape.to_vec(),
            reason: "a row overflows the address space",
        })?;
        let mut rows = 0u64;
        for (bytes, n) in &parts {
            if *n == 0 {
                return Err(Error::EmptyPart);
            }
            let expected = u128::from(*n) * row_bytes as u128;
            if expected != bytes.len() as u128 {
                return Err(Error::LengthMismatch {
                    len: bytes.len() as u64,
                    expected,
                });
            }
            rows = rows.checked_add(*n).ok_or(Error::RowSum {
                parts: u64::MAX,
                rows: u64::MAX,
            })?;
        }
        Ok(RegularParts {
            dtype,
            row_shape,
            row_bytes,
            rows,
            parts,
        })
    }

    /// One part holding the whole tensor: zero copy if `t` is contiguous,
    /// one copy if its rows are strided. `t` needs a row axis.
    pub fn from_tensor(t: &Tensor) -> Result<RegularParts, Error> {
        if t.shape().is_empty() {
            return Err(Error::BadShape {
                shape: Vec::new(),
                reason: "a regular field needs a row axis",
            });
        }
        let parts = if t.rows() == 0 {
            PartBytes::new()
        } else {
            smallvec::smallvec![(t.contiguous_bytes(), t.rows())]
        };
        RegularParts::new(t.dtype(), Dims::from(t.row_shape()), parts)
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Shape of one row.
    pub fn row_shape(&self) -> &[u64] {
        &self.row_shape
    }

    /// Bytes in one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Number of rows (sum over the parts).
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// The full shape `[n, ...row_shape]`.
    pub fn shape(&self) -> Vec<u64> {
        self.shape_dims().into_vec()
    }

    /// [`RegularParts::shape`], inline (no allocation up to the
    /// [`super::Dims`] capacity): what an encoder writes per field.
    pub fn shape_dims(&self) -> super::Dims {
        std::iter::once(self.rows)
            .chain(self.row_shape.iter().copied())
            .collect()
    }

    /// The parts, in row order: `(bytes, rows)`.
    pub fn parts(&self) -> &[(Bytes, u64)] {
        &self.parts
    }

    /// Every row as its own tensor, in order (zero copy).
    pub fn row_tensors(&self) -> impl Iterator<Item = Tensor> + '_ {
        let rb = self.row_bytes;
        self.parts.iter().flat_map(move |(bytes, n)| {
            // Cannot fail: the part holds exactly `n * rb` bytes.
            (0..*n as usize).filter_map(move |i| {
                Tensor::contiguous_of(
                    bytes.slice(i * rb..(i + 1) * rb),
                    self.dtype,
                    &self.row_shape,
                )
                .ok()
            })
        })
    }

    /// [`RegularParts::to_tensor`], giving up the parts: one part's bytes
    /// are moved, not shared and then dropped (two atomic operations on
    /// the frame's count a field of every put).
    pub fn into_tensor(mut self) -> Result<Tensor, Error> {
        if self.parts.len() != 1 {
            return self.to_tensor();
        }
        let (bytes, _) = self.parts.pop().expect("one part");
        self.tensor_of(bytes)
    }

    /// The whole field as one tensor: zero copy for one part (or none),
    /// one allocation and one copy for several.
    pub fn to_tensor(&self) -> Result<Tensor, Error> {
        let bytes = match self.parts.as_slice() {
            [] => Bytes::new(),
            [(bytes, _)] => bytes.clone(),
            many => {
                let mut buf = BytesMut::with_capacity(many.iter().map(|(b, _)| b.len()).sum());
                many.iter().for_each(|(b, _)| buf.extend_from_slice(b));
                buf.freeze()
            }
        };
        self.tensor_of(bytes)
    }

    /// The field's tensor over `bytes` (all its rows, back to back).
    fn tensor_of(&self, bytes: Bytes) -> Result<Tensor, Error> {
        // The parts' lengths were checked against `row_bytes` when they
        // were made, and `bytes` is all of them.
        Ok(Tensor::contiguous_rows_checked(
            bytes,
            self.dtype,
            self.rows,
            &self.row_shape,
            self.row_bytes,
        ))
    }
}
