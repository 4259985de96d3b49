//! Immutable tensors over shared bytes.
//!
//! A [`Tensor`] is a [`Bytes`] buffer (a slice of a received frame, of a
//! shared-memory mapping, or of a gathered copy) plus a [`Layout`]. Rows live
//! on axis 0. Only axis 0 may be strided: every row is itself C-contiguous, so
//! a row is always one byte range and can be handed out as a `Bytes` slice.
//! Cloning a tensor, taking a row or a strided view of rows never copies.
//!
//! A tensor's [`Dtype`] is the dtype table's (`stowage-plan`): stowd never
//! reads an element, so a dtype is a name and an itemsize, and the bytes are
//! stored and served as they came.

use bytes::{Bytes, BytesMut};
use smallvec::SmallVec;

/// A tensor's shape, inline up to 4 dimensions: views, rows and clones of
/// a tensor (several per field of every put and get) allocate nothing.
type Shape = SmallVec<[u64; 4]>;

/// Element type of a tensor: the dtype table's enum, from `stowage-plan`
/// (one row per dtype: its name on the wire, itemsize, WIT case, aliases).
pub use stowage_plan::Dtype;

/// Why a tensor could not be built from bytes and a declared layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    #[error("shape {shape:?} of {dtype} needs {expected} bytes, the buffer has {actual}")]
    LengthMismatch {
        dtype: Dtype,
        shape: Vec<u64>,
        expected: u128,
        actual: usize,
    },
    #[error("shape {0:?} overflows the addressable size")]
    Overflow(Vec<u64>),
    #[error("tensor has no row axis (shape is empty)")]
    NoRows,
    #[error("row {row} out of range for a tensor of {rows} rows")]
    RowOutOfRange { row: u64, rows: u64 },
    #[error("rows view start={start} step={step} count={count} leaves a tensor of {rows} rows")]
    ViewOutOfRange {
        start: u64,
        step: u64,
        count: u64,
        rows: u64,
    },
}

/// Number of bytes a C-contiguous tensor of `shape` needs, checked.
pub fn contiguous_len(dtype: Dtype, shape: &[u64]) -> Result<usize, TensorError> {
    let mut n: u128 = dtype.itemsize() as u128;
    for &d in shape {
        n = n
            .checked_mul(d as u128)
            .ok_or_else(|| TensorError::Overflow(shape.to_vec()))?;
        if n > isize::MAX as u128 {
            return Err(TensorError::Overflow(shape.to_vec()));
        }
    }
    Ok(n as usize)
}

/// An immutable, possibly row-strided tensor over shared bytes.
///
/// Ownership: the tensor holds a reference count on the allocation behind
/// `bytes`; the allocation is freed when the last tensor, row or frame that
/// points into it is dropped.
#[derive(Clone, PartialEq)]
pub struct Tensor {
    bytes: Bytes,
    dtype: Dtype,
    shape: Shape,
    /// Distance between consecutive rows, in bytes.
    row_stride: usize,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("row_stride", &self.row_stride)
            .field("byte_len", &self.bytes.len())
            .finish()
    }
}

impl Tensor {
    /// A C-contiguous tensor over `bytes`; the length must match exactly.
    pub fn contiguous(bytes: Bytes, dtype: Dtype, shape: Vec<u64>) -> Result<Tensor, TensorError> {
        Tensor::contiguous_shape(bytes, dtype, Shape::from_vec(shape))
    }

    /// [`Tensor::contiguous`] of a borrowed shape (copied inline: no
    /// allocation up to 4 dimensions).
    pub fn contiguous_of(bytes: Bytes, dtype: Dtype, shape: &[u64]) -> Result<Tensor, TensorError> {
        Tensor::contiguous_shape(bytes, dtype, Shape::from_slice(shape))
    }

    /// A C-contiguous tensor of `rows` rows of `row_shape` over `bytes`
    /// (the length must match exactly): [`Tensor::contiguous`] without a
    /// shape to allocate.
    pub fn contiguous_rows(
        bytes: Bytes,
        dtype: Dtype,
        rows: u64,
        row_shape: &[u64],
    ) -> Result<Tensor, TensorError> {
        let mut shape = Shape::with_capacity(1 + row_shape.len());
        shape.push(rows);
        shape.extend_from_slice(row_shape);
        Tensor::contiguous_shape(bytes, dtype, shape)
    }

    /// [`Tensor::contiguous_rows`] of lengths the caller has checked:
    /// `bytes` is `rows` rows of `row_bytes` bytes, `row_bytes` is
    /// `row_shape`'s contiguous length (a regular field's parts, checked
    /// when they were made). Nothing is computed again: a put's field
    /// spent about 340 instructions on those two checks.
    pub(crate) fn contiguous_rows_checked(
        bytes: Bytes,
        dtype: Dtype,
        rows: u64,
        row_shape: &[u64],
        row_bytes: usize,
    ) -> Tensor {
        debug_assert_eq!(contiguous_len(dtype, row_shape).ok(), Some(row_bytes));
        debug_assert_eq!(
            Some(bytes.len() as u128),
            (rows as u128).checked_mul(row_bytes as u128)
        );
        let mut shape = Shape::with_capacity(1 + row_shape.len());
        shape.push(rows);
        shape.extend_from_slice(row_shape);
        Tensor {
            bytes,
            dtype,
            shape,
            row_stride: row_bytes,
        }
    }

    fn contiguous_shape(bytes: Bytes, dtype: Dtype, shape: Shape) -> Result<Tensor, TensorError> {
        let expected = contiguous_len(dtype, &shape)?;
        if expected != bytes.len() {
            return Err(TensorError::LengthMismatch {
                dtype,
                shape: shape.into_vec(),
                expected: expected as u128,
                actual: bytes.len(),
            });
        }
        let row_stride = if shape.is_empty() {
            0
        } else {
            contiguous_len(dtype, &shape[1..])?
        };
        Ok(Tensor {
            bytes,
            dtype,
            shape,
            row_stride,
        })
    }

    /// `shape[0]` rows `row_stride` bytes apart over `bytes`, which start
    /// at the first row (a stored column's rows, as a zero-copy view).
    pub fn strided(
        bytes: Bytes,
        dtype: Dtype,
        shape: Vec<u64>,
        row_stride: usize,
    ) -> Result<Tensor, TensorError> {
        let (&rows, row_shape) = shape.split_first().ok_or(TensorError::NoRows)?;
        let row_bytes = contiguous_len(dtype, row_shape)?;
        if rows <= 1 || row_stride == row_bytes {
            let len = contiguous_len(dtype, &shape)?;
            let bytes = bytes.slice(..len.min(bytes.len()));
            return Tensor::contiguous(bytes, dtype, shape);
        }
        let shape = Shape::from_vec(shape);
        let mismatch = |expected: u128| TensorError::LengthMismatch {
            dtype,
            shape: shape.to_vec(),
            expected,
            actual: bytes.len(),
        };
        let need = (rows as u128 - 1) * row_stride as u128 + row_bytes as u128;
        if row_stride < row_bytes || need > bytes.len() as u128 {
            return Err(mismatch(need));
        }
        Ok(Tensor {
            bytes: bytes.slice(..need as usize),
            dtype,
            shape,
            row_stride,
        })
    }

    #[inline]
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    #[inline]
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Number of rows (the size of axis 0); 1 for a scalar.
    #[inline]
    pub fn rows(&self) -> u64 {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Shape of one row.
    #[inline]
    pub fn row_shape(&self) -> &[u64] {
        self.shape.get(1..).unwrap_or(&[])
    }

    /// Bytes in one row.
    pub fn row_bytes(&self) -> usize {
        if self.shape.is_empty() {
            self.bytes.len()
        } else {
            contiguous_len(self.dtype, self.row_shape()).unwrap_or(0)
        }
    }

    /// The first of [`strides`](Self::strides), without building the
    /// others (which follow from the shape: the rows themselves are C
    /// contiguous).
    #[inline]
    pub fn first_stride(&self) -> i64 {
        self.row_stride as i64 / self.dtype.itemsize() as i64
    }

    /// Whether `other` has this tensor's dtype, shape and first stride
    /// (what a selection policy is told of a field besides its rows). A
    /// put asks it of each field at each unit: inlined, and the shapes
    /// compared without a call to `memcmp` (a shape is a few dimensions).
    #[inline]
    pub fn same_layout(&self, other: &Tensor) -> bool {
        let (a, b) = (self.shape(), other.shape());
        self.dtype == other.dtype
            && a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| x == y)
            && (self.row_stride == other.row_stride || self.first_stride() == other.first_stride())
    }

    /// Strides in elements, as torch reports them.
    pub fn strides(&self) -> Vec<i64> {
        let item = self.dtype.itemsize() as i64;
        let mut out = vec![0i64; self.shape.len()];
        let mut acc = 1i64;
        for i in (0..self.shape.len()).rev() {
            out[i] = acc;
            acc = acc.saturating_mul(self.shape[i].max(1) as i64);
        }
        if let Some(first) = out.first_mut() {
            *first = self.row_stride as i64 / item;
        }
        out
    }

    /// Bytes from the start of one row to the start of the next (the row
    /// size for a contiguous tensor).
    pub fn row_stride(&self) -> usize {
        if self.rows() <= 1 {
            self.row_bytes()
        } else {
            self.row_stride
        }
    }

    /// The shape, giving up the tensor.
    pub fn into_shape(self) -> Vec<u64> {
        self.shape.into_vec()
    }

    /// Bytes spanned by this tensor in its buffer (gaps included).
    #[inline]
    pub fn byte_len(&self) -> usize {
        self.bytes.len()
    }

    /// Bytes of the elements themselves (gaps excluded).
    pub fn payload_len(&self) -> usize {
        self.row_bytes() * self.rows() as usize
    }

    /// True if the rows follow each other without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.shape.is_empty() || self.rows() <= 1 || self.row_stride == self.row_bytes()
    }

    /// The underlying buffer (for a strided view: from the first byte of the
    /// first row to the last byte of the last row).
    #[inline]
    pub fn buffer(&self) -> &Bytes {
        &self.bytes
    }

    /// Row `i` as a zero-copy slice.
    pub fn row(&self, i: u64) -> Result<Bytes, TensorError> {
        if self.shape.is_empty() || i >= self.rows() {
            return Err(TensorError::RowOutOfRange {
                row: i,
                rows: self.rows(),
            });
        }
        let start = i as usize * self.row_stride;
        Ok(self.bytes.slice(start..start + self.row_bytes()))
    }

    /// Row `i` as a tensor of the row's shape (zero copy).
    pub fn row_tensor(&self, i: u64) -> Result<Tensor, TensorError> {
        let bytes = self.row(i)?;
        Tensor::contiguous_shape(bytes, self.dtype, Shape::from_slice(self.row_shape()))
    }

    /// Rows `start, start+step, ...` (`count` of them) as a zero-copy view.
    pub fn rows_view(&self, start: u64, step: u64, count: u64) -> Result<Tensor, TensorError> {
        let rows = self.rows();
        let bad = || TensorError::ViewOutOfRange {
            start,
            step,
            count,
            rows,
        };
        if self.shape.is_empty() || step == 0 {
            return Err(bad());
        }
        let mut shape = self.shape.clone();
        shape[0] = count;
        if count == 0 {
            return Ok(Tensor {
                bytes: Bytes::new(),
                dtype: self.dtype,
                shape,
                row_stride: self.row_bytes(),
            });
        }
        let last = (count - 1)
            .checked_mul(step)
            .and_then(|x| x.checked_add(start))
            .ok_or_else(bad)?;
        if last >= rows {
            return Err(bad());
        }
        let begin = start as usize * self.row_stride;
        let end = last as usize * self.row_stride + self.row_bytes();
        let row_stride = if count == 1 {
            self.row_bytes()
        } else {
            self.row_stride * step as usize
        };
        Ok(Tensor {
            bytes: self.bytes.slice(begin..end),
            dtype: self.dtype,
            shape,
            row_stride,
        })
    }

    /// Copies `positions` (in order, repeats allowed) into one new contiguous
    /// tensor: exactly one allocation of the selected bytes.
    pub fn gather(&self, positions: &[u64]) -> Result<Tensor, TensorError> {
        let row_bytes = self.row_bytes();
        for &p in positions {
            if self.shape.is_empty() || p >= self.rows() {
                return Err(TensorError::RowOutOfRange {
                    row: p,
                    rows: self.rows(),
                });
            }
        }
        let mut out = BytesMut::with_capacity(row_bytes * positions.len());
        for &p in positions {
            let start = p as usize * self.row_stride;
            out.extend_from_slice(&self.bytes[start..start + row_bytes]);
        }
        let mut shape = self.shape.clone();
        shape[0] = positions.len() as u64;
        Tensor::contiguous_shape(out.freeze(), self.dtype, shape)
    }

    /// The elements as one contiguous buffer: zero copy when already
    /// contiguous, one copy otherwise.
    pub fn contiguous_bytes(&self) -> Bytes {
        if self.is_contiguous() {
            return self.bytes.clone();
        }
        let all: Vec<u64> = (0..self.rows()).collect();
        self.gather(&all).map(|t| t.bytes).unwrap_or_default()
    }
}

#[cfg(test)]
mod strided_tests {
    use super::*;

    #[test]
    fn strided_views_check_their_bytes() {
        let b = Bytes::from((0u8..32).collect::<Vec<_>>());
        // Rows of 2 x u8 every 8 bytes: 4 rows fit in 26 bytes.
        let t = Tensor::strided(b.clone(), Dtype::Uint8, vec![4, 2], 8).unwrap();
        assert_eq!(t.row(3).unwrap().as_ref(), &[24, 25]);
        assert_eq!(t.contiguous_bytes().as_ref(), &[0, 1, 8, 9, 16, 17, 24, 25]);
        assert!(Tensor::strided(b.clone(), Dtype::Uint8, vec![5, 2], 8).is_err());
        assert!(Tensor::strided(b.clone(), Dtype::Uint8, vec![2, 4], 2).is_err());
        assert!(Tensor::strided(b.clone(), Dtype::Uint8, vec![], 2).is_err());
        // Contiguous when the stride is the row size.
        let c = Tensor::strided(b, Dtype::Uint8, vec![3, 4], 4).unwrap();
        assert!(c.is_contiguous() && c.byte_len() == 12);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arange(rows: u64, cols: u64) -> Tensor {
        let data: Vec<u8> = (0..rows * cols)
            .flat_map(|v| (v as f32).to_le_bytes())
            .collect();
        Tensor::contiguous(Bytes::from(data), Dtype::Float32, vec![rows, cols]).unwrap()
    }

    fn floats(b: &[u8]) -> Vec<f32> {
        b.chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn strided_view_shares_the_buffer() {
        let t = arange(8, 2);
        let v = t.rows_view(1, 3, 3).unwrap();
        assert_eq!(v.shape(), &[3, 2]);
        assert_eq!(v.strides(), vec![6, 1]);
        assert!(!v.is_contiguous());
        assert_eq!(floats(&v.row(2).unwrap()), vec![14.0, 15.0]);
        let base = t.buffer().as_ptr() as usize;
        let p = v.buffer().as_ptr() as usize;
        assert!(p >= base && p + v.byte_len() <= base + t.byte_len());
        assert_eq!(
            floats(&v.contiguous_bytes()),
            vec![2.0, 3.0, 8.0, 9.0, 14.0, 15.0]
        );
    }

    #[test]
    fn views_out_of_range_are_refused() {
        let t = arange(4, 2);
        assert!(t.rows_view(0, 2, 3).is_err());
        assert!(t.rows_view(0, 0, 1).is_err());
        assert!(t.rows_view(u64::MAX, u64::MAX, 2).is_err());
        assert!(t.row(4).is_err());
        assert!(t.gather(&[0, 9]).is_err());
    }

    #[test]
    fn length_must_match_shape() {
        let err =
            Tensor::contiguous(Bytes::from(vec![0u8; 7]), Dtype::Float32, vec![2]).unwrap_err();
        assert!(matches!(err, TensorError::LengthMismatch { .. }));
        assert!(
            Tensor::contiguous(Bytes::new(), Dtype::Float32, vec![u64::MAX, u64::MAX]).is_err()
        );
        assert!(Tensor::contiguous(Bytes::new(), Dtype::Float32, vec![0, 5]).is_ok());
    }

    #[test]
    fn every_dtype_builds_tensors_of_its_itemsize() {
        for d in Dtype::ALL {
            let n = d.itemsize() * 6;
            let t = Tensor::contiguous(Bytes::from(vec![0xA5u8; n]), d, vec![3, 2]).unwrap();
            assert_eq!((t.row_bytes(), t.strides()), (2 * d.itemsize(), vec![2, 1]));
            assert_eq!(t.rows_view(0, 2, 2).unwrap().row_stride(), 4 * d.itemsize());
            let short = Tensor::contiguous(Bytes::from(vec![0u8; n - 1]), d, vec![3, 2]);
            assert!(
                matches!(short, Err(TensorError::LengthMismatch { .. })),
                "{d}"
            );
        }
    }
}
