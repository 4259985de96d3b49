//! A native test harness: fields without a host, and the host's plan rules.
//!
//! [`TestField`] implements [`Field`] with deterministic contents (byte `i`
//! of the logical stream is [`TestField::byte_at`]`(i)`), so content-aware
//! policies can be tested too. [`validate_selection`] and
//! [`validate_frames`] call the `stowage-plan` rules the host calls, so a
//! plan that passes them here is accepted by `stowd`, and a refused one
//! reads the same message ([`PlanError`]) here and in the host's log.
//!
//! ```
//! use stowage_guest::testing::{validate_frames, validate_selection, TestField};
//! use stowage_guest::{Dtype, Frame, FramePlan, PackLimits, Piece, PieceInfo, RowView, SelectionPlan};
//!
//! let field = TestField::regular(Dtype::Float32, &[10, 4]);
//! let plan = SelectionPlan::new(vec![Piece::View(RowView::new(0, 2, 2)), Piece::Gather(vec![9])]);
//! assert!(validate_selection(&field, &[0, 2, 9], &plan).is_ok());
//! assert!(validate_selection(&field, &[0, 2], &plan).is_err());
//!
//! let pieces = [PieceInfo::contiguous(10), PieceInfo::contiguous(10)];
//! let limits = PackLimits { max_frames: 1, max_frame_bytes: 20, small_threshold: 0 };
//! let plan = FramePlan::new(vec![Frame::Coalesced(vec![0, 1])]);
//! assert!(validate_frames(&pieces, &limits, &plan).is_ok());
//! ```

use stowage_plan::FieldInfo;
/// Why a plan was refused: the validators below return its message.
pub use stowage_plan::PlanError;

use crate::{Dtype, Field, FieldKind, FramePlan, PackLimits, PieceInfo, ReadError, SelectionPlan};

/// Read cap of a new [`TestField`]: 1 MiB, like the host's default.
pub const DEFAULT_READ_CAP: u64 = 1 << 20;

/// A field held in the test, implementing [`Field`] like the host's lent
/// `tensor` handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestField {
    kind: FieldKind,
    dtype: Dtype,
    shape: Vec<u64>,
    strides: Vec<i64>,
    row_shapes: Vec<Vec<u64>>,
    row_byte_lens: Vec<u64>,
    byte_len: u64,
    read_cap: u64,
}

fn c_strides(shape: &[u64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1] as i64);
    }
    strides
}

impl TestField {
    /// A regular tensor of this shape (`shape[0]` rows; at least one axis).
    ///
    /// # Panics
    /// If `shape` is empty.
    pub fn regular(dtype: Dtype, shape: &[u64]) -> Self {
        assert!(!shape.is_empty(), "a regular field needs a row axis");
        let rows = shape[0];
        let row_shape = shape[1..].to_vec();
        let row_bytes = row_shape.iter().product::<u64>() * dtype.size();
        TestField {
            kind: FieldKind::Regular,
            dtype,
            shape: shape.to_vec(),
            strides: c_strides(shape),
            row_shapes: vec![row_shape; rows as usize],
            row_byte_lens: vec![row_bytes; rows as usize],
            byte_len: rows * row_bytes,
            read_cap: DEFAULT_READ_CAP,
        }
    }

    /// A nested (jagged) field: one row per entry of `row_shapes`, e.g.
    /// `TestField::nested(Dtype::Int64, [vec![3], vec![5], vec![0]])`.
    pub fn nested<I>(dtype: Dtype, row_shapes: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<[u64]>,
    {
        let row_shapes: Vec<Vec<u64>> = row_shapes
            .into_iter()
            .map(|s| s.as_ref().to_vec())
            .collect();
        let row_byte_lens: Vec<u64> = row_shapes
            .iter()
            .map(|s| s.iter().product::<u64>() * dtype.size())
            .collect();
        TestField {
            kind: FieldKind::Nested,
            dtype,
            shape: vec![row_shapes.len() as u64],
            strides: vec![1],
            byte_len: row_byte_lens.iter().sum(),
            row_shapes,
            row_byte_lens,
            read_cap: DEFAULT_READ_CAP,
        }
    }

    /// A values field (strings, bytes, objects) whose rows have these byte
    /// lengths. Its dtype is `uint8`.
    pub fn values(row_byte_lens: &[u64]) -> Self {
        TestField {
            kind: FieldKind::Values,
            dtype: Dtype::Uint8,
            shape: vec![row_byte_lens.len() as u64],
            strides: vec![1],
            row_shapes: row_byte_lens.iter().map(|&l| vec![l]).collect(),
            row_byte_lens: row_byte_lens.to_vec(),
            byte_len: row_byte_lens.iter().sum(),
            read_cap: DEFAULT_READ_CAP,
        }
    }

    /// The same field with another per-call read cap.
    pub fn with_read_cap(mut self, read_cap: u64) -> Self {
        self.read_cap = read_cap;
        self
    }

    /// Byte `offset` of every test field's logical byte stream: a fixed
    /// pseudo-random function of the offset.
    pub fn byte_at(offset: u64) -> u8 {
        let x = offset.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (x >> 56) as u8 ^ (offset as u8)
    }
}

impl Field for TestField {
    fn kind(&self) -> FieldKind {
        self.kind
    }
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> Vec<u64> {
        self.shape.clone()
    }
    fn strides(&self) -> Vec<i64> {
        self.strides.clone()
    }
    fn rows(&self) -> u64 {
        self.row_byte_lens.len() as u64
    }
    fn byte_len(&self) -> u64 {
        self.byte_len
    }
    fn row_shapes(&self) -> Vec<Vec<u64>> {
        self.row_shapes.clone()
    }
    fn row_byte_lens(&self) -> Vec<u64> {
        self.row_byte_lens.clone()
    }
    fn read_cap(&self) -> u64 {
        self.read_cap
    }
    /// Checks the cap first, then the range, as the host does.
    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ReadError> {
        if len > self.read_cap {
            return Err(ReadError::OverCap(self.read_cap));
        }
        let end = offset.checked_add(len).ok_or(ReadError::OutOfRange)?;
        if end > self.byte_len {
            return Err(ReadError::OutOfRange);
        }
        Ok((offset..end).map(TestField::byte_at).collect())
    }
}

/// Checks `plan` against `positions` of `field` with the host's rules:
/// [`stowage_plan::validate_selection`], the very function `stowd` calls,
/// on the field's kind and row count.
///
/// - each piece fits the field's kind: `view` and `gather` only on regular
///   fields, `row-views` on nested or values fields, `concat` only on nested
///   fields;
/// - no piece is empty; a `view` has `step >= 1` and its last row is inside
///   the field (no overflow);
/// - every row named is `< rows`;
/// - the rows of the pieces, taken in order, are exactly `positions`, in
///   order (nothing dropped, repeated, reordered or added; an empty plan is
///   only valid for empty positions).
///
/// Cost is linear in `positions`, whatever the plan claims. The error is the
/// [`PlanError`]'s message, word for word what the host logs for the fault.
pub fn validate_selection(
    field: &dyn Field,
    positions: &[u64],
    plan: &SelectionPlan,
) -> Result<(), String> {
    let info = FieldInfo::new(field.kind(), field.rows());
    stowage_plan::validate_selection(info, positions, plan).map_err(|e| e.to_string())
}

/// Checks a frame plan with the host's rules
/// ([`stowage_plan::validate_frames`]): at most `max_frames` frames; every
/// piece index exists and appears exactly once; no coalesced frame is empty;
/// a coalesced frame of two or more pieces holds at most `max_frame_bytes`
/// bytes (a frame of one piece may be larger: it is the piece itself). The
/// error is the [`PlanError`]'s message, as the host logs it.
pub fn validate_frames(
    pieces: &[PieceInfo],
    limits: &PackLimits,
    plan: &FramePlan,
) -> Result<(), String> {
    stowage_plan::validate_frames(pieces, limits, plan).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Frame, Piece, RowView};

    #[test]
    fn regular_field_layout() {
        let f = TestField::regular(Dtype::Float32, &[10, 3, 2]);
        assert_eq!(f.kind(), FieldKind::Regular);
        assert_eq!(f.shape(), vec![10, 3, 2]);
        assert_eq!(f.strides(), vec![6, 2, 1]);
        assert_eq!(f.rows(), 10);
        assert_eq!(f.byte_len(), 240);
        assert_eq!(f.row_byte_lens(), vec![24; 10]);
        assert_eq!(f.row_shapes()[9], vec![3, 2]);
    }

    #[test]
    fn nested_and_values_layout() {
        let f = TestField::nested(Dtype::Int64, [vec![3], vec![2, 2], vec![0]]);
        assert_eq!(
            (f.kind(), f.rows(), f.shape(), f.strides()),
            (FieldKind::Nested, 3, vec![3], vec![1])
        );
        assert_eq!(f.row_byte_lens(), vec![24, 32, 0]);
        assert_eq!(f.byte_len(), 56);
        let v = TestField::values(&[5, 0, 7]);
        assert_eq!(
            (v.kind(), v.dtype(), v.rows(), v.byte_len()),
            (FieldKind::Values, Dtype::Uint8, 3, 12)
        );
        assert_eq!(v.row_shapes(), vec![vec![5], vec![0], vec![7]]);
    }

    #[test]
    fn reads_are_deterministic_and_bounded() {
        let f = TestField::regular(Dtype::Uint8, &[4, 4]).with_read_cap(8);
        assert_eq!(f.read_cap(), 8);
        let a = f.read(2, 8).unwrap();
        assert_eq!(a, (2..10).map(TestField::byte_at).collect::<Vec<_>>());
        assert_eq!(f.read(4, 4).unwrap(), a[2..6].to_vec());
        assert_eq!(f.read(0, 9), Err(ReadError::OverCap(8)));
        assert_eq!(f.read(10, 8), Err(ReadError::OutOfRange));
        assert_eq!(f.read(u64::MAX, 2), Err(ReadError::OutOfRange));
        assert_eq!(f.read(16, 0), Ok(vec![]));
    }

    /// The glue only: the harness hands the field's kind and rows to
    /// `stowage-plan` (whose tables test the rules) and returns its message.
    #[test]
    fn harness_uses_the_shared_rules() {
        let n = TestField::nested(Dtype::Float32, [[1], [2], [3]]);
        let plan = SelectionPlan::new(vec![Piece::Concat(vec![2]), Piece::RowViews(vec![0, 1])]);
        validate_selection(&n, &[2, 0, 1], &plan).unwrap();
        let v = TestField::values(&[1, 2]);
        assert_eq!(
            validate_selection(&v, &[0], &Piece::Concat(vec![0]).into()),
            Err("piece 0: a concat piece does not apply to a values field".to_string())
        );
        assert_eq!(
            validate_selection(&v, &[2], &Piece::RowViews(vec![2]).into()),
            Err(PlanError::RowOutOfRange {
                piece: 0,
                row: 2,
                rows: 2
            }
            .to_string())
        );
        let f = TestField::regular(Dtype::Float32, &[10, 2]);
        assert_eq!(
            validate_selection(&f, &[0, 2], &Piece::View(RowView::new(0, 2, 3)).into()),
            Err(PlanError::TooManyRows {
                planned: 3,
                requested: 2
            }
            .to_string())
        );
        let pieces = [PieceInfo::contiguous(10); 2];
        let limits = PackLimits {
            max_frames: 1,
            max_frame_bytes: 15,
            small_threshold: 0,
        };
        let plan = FramePlan::new(vec![Frame::Coalesced(vec![0, 1])]);
        assert_eq!(
            validate_frames(&pieces, &limits, &plan),
            Err("frame 0: coalesced frame of 20 bytes exceeds the 15-byte limit".to_string())
        );
        validate_frames(
            &pieces,
            &PackLimits {
                max_frame_bytes: 20,
                ..limits
            },
            &plan,
        )
        .unwrap();
    }
}
