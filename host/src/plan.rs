//! Plans: the pure data a policy answers, their validation, and their
//! execution against host buffers.
//!
//! A plan never touches bytes by itself. [`validate_selection`] and
//! [`validate_frames`] check a plan against the request before anything
//! runs; [`execute_selection`] and [`execute_frames`] carry out a valid plan.
//! Views become `Bytes` slices of the original buffer (no copy); only
//! gathers, concatenations and coalesced frames allocate, once each.

use bytes::{Bytes, BytesMut};

use crate::batch::{Field, Value};
use crate::tensor::{Tensor, TensorError};

/// Rows `start, start + step, ...` (`count` rows) of a regular tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowView {
    pub start: u64,
    pub step: u64,
    pub count: u64,
}

/// One piece of a selection plan (see `wit/since_v0.1.0/policy.wit`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Regular field: zero-copy strided view.
    View(RowView),
    /// Regular field: rows copied into one contiguous buffer.
    Gather(Vec<u64>),
    /// Nested or values field: one zero-copy view per row.
    RowViews(Vec<u64>),
    /// Nested field: rows concatenated into one buffer.
    Concat(Vec<u64>),
}

impl Piece {
    /// Short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Piece::View(_) => "view",
            Piece::Gather(_) => "gather",
            Piece::RowViews(_) => "row-views",
            Piece::Concat(_) => "concat",
        }
    }
}

/// What a selection policy answers.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SelectionPlan {
    pub pieces: Vec<Piece>,
}

/// Size of one piece to pack into frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceInfo {
    pub byte_len: u64,
    pub contiguous: bool,
}

/// Bounds of one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackLimits {
    pub max_frames: u32,
    pub max_frame_bytes: u64,
    pub small_threshold: u64,
}

impl Default for PackLimits {
    fn default() -> Self {
        PackLimits { max_frames: 1000, max_frame_bytes: 64 << 20, small_threshold: 64 << 10 }
    }
}

/// One frame of a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Piece sent as its own frame.
    Single(u32),
    /// Pieces copied, in order, into one frame.
    Coalesced(Vec<u32>),
}

/// What a packing policy answers.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct FramePlan {
    pub frames: Vec<Frame>,
}

/// Why a plan was refused. Any of these is a policy fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ValidationError {
    #[error("plan covers {planned} rows or more, {requested} were requested")]
    TooManyRows { planned: u64, requested: u64 },
    #[error("plan covers {planned} rows, {requested} were requested")]
    TooFewRows { planned: u64, requested: u64 },
    #[error("plan row #{index} is row {got}, position {index} asks for row {want}")]
    WrongRow { index: u64, got: u64, want: u64 },
    #[error("plan names row {row}, the field has {rows} rows")]
    RowOutOfRange { row: u64, rows: u64 },
    #[error("a {piece} piece does not apply to a {kind} field")]
    WrongKind { piece: &'static str, kind: &'static str },
    #[error("view with step 0 or count 0")]
    DegenerateView,
    #[error("empty piece")]
    EmptyPiece,
    #[error("frame plan has {frames} frames, the budget is {budget}")]
    TooManyFrames { frames: u64, budget: u32 },
    #[error("piece {0} appears in no frame")]
    PieceMissing(u32),
    #[error("piece {0} appears in more than one frame, or twice")]
    PieceRepeated(u32),
    #[error("piece {piece} does not exist ({pieces} pieces)")]
    NoSuchPiece { piece: u32, pieces: u64 },
    #[error("coalesced frame of {bytes} bytes exceeds the {limit}-byte frame limit")]
    FrameTooLarge { bytes: u64, limit: u64 },
}

/// Name of a field's kind, as in the WIT `field-kind`.
pub fn kind_name(field: &Field) -> &'static str {
    match field {
        Field::Regular(_) => "regular",
        Field::Nested(_) => "nested",
        Field::Values(_) => "values",
    }
}

/// Checks that `plan` selects exactly `positions` of `field`, in order, with
/// pieces that fit the field's kind and stay inside it. Cost is linear in the
/// number of positions, whatever the plan claims.
pub fn validate_selection(field: &Field, positions: &[u64], plan: &SelectionPlan) -> Result<(), ValidationError> {
    let rows = field.rows();
    let requested = positions.len() as u64;
    let mut next: u64 = 0;
    let take = |row: u64, next: &mut u64| -> Result<(), ValidationError> {
        if row >= rows {
            return Err(ValidationError::RowOutOfRange { row, rows });
        }
        let want = positions[*next as usize];
        if row != want {
            return Err(ValidationError::WrongRow { index: *next, got: row, want });
        }
        *next += 1;
        Ok(())
    };
    for piece in &plan.pieces {
        let ok_kind = matches!(
            (piece, field),
            (Piece::View(_) | Piece::Gather(_), Field::Regular(_))
                | (Piece::RowViews(_), Field::Nested(_) | Field::Values(_))
                | (Piece::Concat(_), Field::Nested(_))
        );
        if !ok_kind {
            return Err(ValidationError::WrongKind { piece: piece.kind(), kind: kind_name(field) });
        }
        let len = match piece {
            Piece::View(v) => v.count,
            Piece::Gather(r) | Piece::RowViews(r) | Piece::Concat(r) => r.len() as u64,
        };
        if len == 0 {
            return Err(ValidationError::EmptyPiece);
        }
        if len > requested - next {
            // Saturating: `len` is whatever the plan claims (a view's count
            // may be u64::MAX).
            return Err(ValidationError::TooManyRows { planned: next.saturating_add(len), requested });
        }
        match piece {
            Piece::View(v) => {
                if v.step == 0 {
                    return Err(ValidationError::DegenerateView);
                }
                let last = v.step.checked_mul(v.count - 1).and_then(|x| x.checked_add(v.start));
                let last = last.ok_or(ValidationError::RowOutOfRange { row: u64::MAX, rows })?;
                if last >= rows {
                    return Err(ValidationError::RowOutOfRange { row: last, rows });
                }
                for k in 0..v.count {
                    take(v.start + k * v.step, &mut next)?;
                }
            }
            Piece::Gather(r) | Piece::RowViews(r) | Piece::Concat(r) => {
                for &row in r {
                    take(row, &mut next)?;
                }
            }
        }
    }
    if next != requested {
        return Err(ValidationError::TooFewRows { planned: next, requested });
    }
    Ok(())
}

/// Checks a frame plan: every piece exactly once, within the frame budget,
/// coalesced frames within the byte limit (a frame of one piece may be
/// larger: it is the piece itself).
pub fn validate_frames(pieces: &[PieceInfo], limits: &PackLimits, plan: &FramePlan) -> Result<(), ValidationError> {
    if plan.frames.len() as u64 > limits.max_frames as u64 {
        return Err(ValidationError::TooManyFrames { frames: plan.frames.len() as u64, budget: limits.max_frames });
    }
    let mut seen = vec![false; pieces.len()];
    let mut mark = |i: u32| -> Result<u64, ValidationError> {
        let slot = seen
            .get_mut(i as usize)
            .ok_or(ValidationError::NoSuchPiece { piece: i, pieces: pieces.len() as u64 })?;
        if *slot {
            return Err(ValidationError::PieceRepeated(i));
        }
        *slot = true;
        Ok(pieces[i as usize].byte_len)
    };
    for frame in &plan.frames {
        match frame {
            Frame::Single(i) => {
                mark(*i)?;
            }
            Frame::Coalesced(list) => {
                if list.is_empty() {
                    return Err(ValidationError::EmptyPiece);
                }
                let mut bytes = 0u64;
                for &i in list {
                    bytes = bytes.saturating_add(mark(i)?);
                }
                if list.len() > 1 && bytes > limits.max_frame_bytes {
                    return Err(ValidationError::FrameTooLarge { bytes, limit: limits.max_frame_bytes });
                }
            }
        }
    }
    if let Some(missing) = seen.iter().position(|s| !s) {
        return Err(ValidationError::PieceMissing(missing as u32));
    }
    Ok(())
}

/// The outcome of one executed piece.
#[derive(Clone, Debug, PartialEq)]
pub enum Selected {
    /// Rows of a regular field: a zero-copy view or a gathered copy.
    Rows(Tensor),
    /// Rows of a nested field, each its own zero-copy tensor.
    NestedRows(Vec<Tensor>),
    /// Rows of a nested field concatenated into `buffer`; each row tensor
    /// is a slice of it.
    Packed { buffer: Bytes, rows: Vec<Tensor> },
    /// Plain values (cheap clones of shared bytes).
    Values(Vec<Value>),
}

impl Selected {
    /// Number of rows in this piece.
    pub fn rows(&self) -> u64 {
        match self {
            Selected::Rows(t) => t.rows(),
            Selected::NestedRows(r) | Selected::Packed { rows: r, .. } => r.len() as u64,
            Selected::Values(v) => v.len() as u64,
        }
    }
}

/// Carries out a plan that passed [`validate_selection`] for this field.
pub fn execute_selection(field: &Field, plan: &SelectionPlan) -> Result<Vec<Selected>, TensorError> {
    let mut out = Vec::with_capacity(plan.pieces.len());
    for piece in &plan.pieces {
        let sel = match (piece, field) {
            (Piece::View(v), Field::Regular(t)) => Selected::Rows(t.rows_view(v.start, v.step, v.count)?),
            (Piece::Gather(rows), Field::Regular(t)) => Selected::Rows(t.gather(rows)?),
            (Piece::RowViews(rows), Field::Nested(all)) => {
                Selected::NestedRows(rows.iter().map(|&r| nested_row(all, r)).collect::<Result<_, _>>()?)
            }
            (Piece::RowViews(rows), Field::Values(all)) => Selected::Values(
                rows.iter()
                    .map(|&r| {
                        all.get(r as usize)
                            .cloned()
                            .ok_or(TensorError::RowOutOfRange { row: r, rows: all.len() as u64 })
                    })
                    .collect::<Result<_, _>>()?,
            ),
            (Piece::Concat(rows), Field::Nested(all)) => concat_rows(all, rows)?,
            (piece, field) => {
                // Unreachable for validated plans; refuse rather than guess.
                let _ = (piece, field);
                return Err(TensorError::NoRows);
            }
        };
        out.push(sel);
    }
    Ok(out)
}

fn nested_row(all: &[Tensor], r: u64) -> Result<Tensor, TensorError> {
    all.get(r as usize).cloned().ok_or(TensorError::RowOutOfRange { row: r, rows: all.len() as u64 })
}

/// One allocation holding the listed rows back to back.
fn concat_rows(all: &[Tensor], rows: &[u64]) -> Result<Selected, TensorError> {
    let mut total = 0usize;
    for &r in rows {
        total += nested_row(all, r)?.payload_len();
    }
    let mut buf = BytesMut::with_capacity(total);
    for &r in rows {
        let t = &all[r as usize];
        if t.is_contiguous() {
            buf.extend_from_slice(t.buffer());
        } else {
            for i in 0..t.rows() {
                buf.extend_from_slice(&t.row(i)?);
            }
        }
    }
    let buffer = buf.freeze();
    let mut offset = 0usize;
    let mut out = Vec::with_capacity(rows.len());
    for &r in rows {
        let t = &all[r as usize];
        let len = t.payload_len();
        out.push(Tensor::contiguous(buffer.slice(offset..offset + len), t.dtype(), t.shape().to_vec())?);
        offset += len;
    }
    Ok(Selected::Packed { buffer, rows: out })
}

/// Where a piece landed: frame index and byte range inside that frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub frame: u32,
    pub offset: u64,
    pub len: u64,
}

/// Frames built from a frame plan, and where each piece is in them.
#[derive(Clone, Debug, Default)]
pub struct Framed {
    pub frames: Vec<Bytes>,
    pub placements: Vec<Placement>,
    /// Bytes that went out without a copy.
    pub zero_copy_bytes: u64,
    /// Bytes copied (coalesced or compacted).
    pub copied_bytes: u64,
}

/// Carries out a frame plan that passed [`validate_frames`]. `pieces` are
/// the tensors to send, each as the contiguous payload a frame carries.
pub fn execute_frames(pieces: &[Tensor], plan: &FramePlan) -> Framed {
    let mut out = Framed {
        frames: Vec::with_capacity(plan.frames.len()),
        placements: vec![Placement { frame: 0, offset: 0, len: 0 }; pieces.len()],
        ..Framed::default()
    };
    for (fi, frame) in plan.frames.iter().enumerate() {
        let fi = fi as u32;
        match frame {
            Frame::Single(i) => {
                let t = &pieces[*i as usize];
                let bytes = t.contiguous_bytes();
                if t.is_contiguous() {
                    out.zero_copy_bytes += bytes.len() as u64;
                } else {
                    out.copied_bytes += bytes.len() as u64;
                }
                out.placements[*i as usize] = Placement { frame: fi, offset: 0, len: bytes.len() as u64 };
                out.frames.push(bytes);
            }
            Frame::Coalesced(list) => {
                let total: usize = list.iter().map(|&i| pieces[i as usize].payload_len()).sum();
                let mut buf = BytesMut::with_capacity(total);
                for &i in list {
                    let t = &pieces[i as usize];
                    let offset = buf.len() as u64;
                    if t.is_contiguous() {
                        buf.extend_from_slice(t.buffer());
                    } else {
                        buf.extend_from_slice(&t.contiguous_bytes());
                    }
                    out.placements[i as usize] = Placement { frame: fi, offset, len: buf.len() as u64 - offset };
                }
                out.copied_bytes += buf.len() as u64;
                out.frames.push(buf.freeze());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    fn regular(rows: u64) -> Field {
        let data: Vec<u8> = (0..rows * 2).flat_map(|v| (v as f32).to_le_bytes()).collect();
        Field::Regular(Tensor::contiguous(Bytes::from(data), DType::F32, vec![rows, 2]).unwrap())
    }

    fn view(start: u64, step: u64, count: u64) -> Piece {
        Piece::View(RowView { start, step, count })
    }

    #[test]
    fn accepts_exact_plans() {
        let f = regular(10);
        let plan = SelectionPlan { pieces: vec![view(0, 2, 3), Piece::Gather(vec![5, 1])] };
        validate_selection(&f, &[0, 2, 4, 5, 1], &plan).unwrap();
    }

    #[test]
    fn refuses_wrong_plans() {
        let f = regular(10);
        let pos = [0, 2, 4];
        let cases = [
            (vec![view(0, 2, 2)], "dropped row"),
            (vec![view(0, 2, 3), Piece::Gather(vec![4])], "extra row"),
            (vec![Piece::Gather(vec![4, 2, 0])], "reordered"),
            (vec![view(0, 2, 2), Piece::Gather(vec![2])], "duplicated"),
            (vec![view(0, 0, 3)], "step 0"),
            (vec![view(0, 5, 3)], "out of range"),
            (vec![Piece::RowViews(vec![0, 2, 4])], "wrong kind"),
            (vec![Piece::Gather(vec![]), view(0, 2, 3)], "empty piece"),
            (vec![view(u64::MAX, u64::MAX, 3)], "overflow"),
            (vec![view(0, 1, u64::MAX)], "absurd count"),
        ];
        for (pieces, what) in cases {
            let plan = SelectionPlan { pieces };
            assert!(validate_selection(&f, &pos, &plan).is_err(), "{what} was accepted");
        }
    }

    /// Found with the `plan_validate` fuzz target (input in
    /// `fuzz/regressions/plan_validate/view-count-overflow`): a view whose
    /// count is near u64::MAX after at least one planned row overflowed
    /// `next + len` while building the error (a panic in debug builds, a
    /// wrong row count in the message otherwise).
    #[test]
    fn fuzz_plan_validate_view_count_overflow() {
        let f = regular(10);
        let plan = SelectionPlan { pieces: vec![view(0, 1, 1), view(1, u64::MAX, u64::MAX)] };
        let err = validate_selection(&f, &[0, 1], &plan).unwrap_err();
        assert_eq!(err, ValidationError::TooManyRows { planned: u64::MAX, requested: 2 });
    }

    #[test]
    fn frame_rules() {
        let pieces = [PieceInfo { byte_len: 10, contiguous: true }; 3];
        let limits = PackLimits { max_frames: 2, max_frame_bytes: 15, small_threshold: 0 };
        let ok = FramePlan { frames: vec![Frame::Coalesced(vec![0]), Frame::Coalesced(vec![1, 2])] };
        assert!(matches!(validate_frames(&pieces, &limits, &ok), Err(ValidationError::FrameTooLarge { .. })));
        let limits = PackLimits { max_frame_bytes: 20, ..limits };
        validate_frames(&pieces, &limits, &ok).unwrap();
        let three = FramePlan { frames: vec![Frame::Single(0), Frame::Single(1), Frame::Single(2)] };
        assert!(validate_frames(&pieces, &limits, &three).is_err());
        let dup = FramePlan { frames: vec![Frame::Single(0), Frame::Coalesced(vec![0, 1])] };
        assert!(validate_frames(&pieces, &limits, &dup).is_err());
        let missing = FramePlan { frames: vec![Frame::Single(0), Frame::Single(1)] };
        assert!(validate_frames(&pieces, &limits, &missing).is_err());
        let bogus = FramePlan { frames: vec![Frame::Single(7)] };
        assert!(validate_frames(&pieces, &limits, &bogus).is_err());
    }

    #[test]
    fn execution_places_pieces() {
        let Field::Regular(t) = regular(4) else { unreachable!() };
        let pieces = vec![t.rows_view(0, 2, 2).unwrap(), t.rows_view(1, 1, 1).unwrap(), t.clone()];
        let plan = FramePlan { frames: vec![Frame::Coalesced(vec![0, 1]), Frame::Single(2)] };
        let framed = execute_frames(&pieces, &plan);
        assert_eq!(framed.frames.len(), 2);
        assert_eq!(framed.frames[0].len(), 24);
        assert_eq!(framed.placements[1], Placement { frame: 0, offset: 16, len: 8 });
        assert_eq!(framed.frames[1].as_ptr(), t.buffer().as_ptr());
        assert_eq!(framed.zero_copy_bytes, 32);
        assert_eq!(framed.copied_bytes, 24);
    }
}
