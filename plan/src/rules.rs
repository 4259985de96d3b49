//! The plan rules and the one message each rule reports.

use std::fmt;

use crate::{FieldInfo, Frame, FramePlan, PackLimits, Piece, PieceInfo, SelectionPlan};

/// Why a plan was refused: one variant, and one message, per rule. Whoever
/// finds the fault (the host or the guest SDK's test harness) reports the
/// same text. For the host, any of these is a policy fault.
///
/// `piece` and `frame` fields are indexes into the plan (from 0); `row`,
/// `got`, `want` and `last` are row numbers of the field.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PlanError {
    /// A piece's case does not apply to the field's kind.
    WrongKind {
        /// Index of the piece.
        piece: usize,
        /// WIT name of the piece's case.
        name: &'static str,
        /// Kind of the field.
        kind: crate::FieldKind,
    },
    /// A piece covers no row (an empty list, or a view of count 0).
    EmptyPiece {
        /// Index of the piece.
        piece: usize,
    },
    /// The pieces so far cover more rows than were requested.
    TooManyRows {
        /// Rows covered up to and including the offending piece
        /// (saturating at `u64::MAX`).
        planned: u64,
        /// Number of positions requested.
        requested: u64,
    },
    /// A view has step 0.
    ZeroStep {
        /// Index of the piece.
        piece: usize,
    },
    /// A view's last row, `start + (count - 1) * step`, overflows `u64`.
    ViewOverflow {
        /// Index of the piece.
        piece: usize,
    },
    /// A view's last row is past the end of the field.
    ViewOutOfRange {
        /// Index of the piece.
        piece: usize,
        /// The view's last row.
        last: u64,
        /// Rows of the field.
        rows: u64,
    },
    /// A listed row is past the end of the field.
    RowOutOfRange {
        /// Index of the piece.
        piece: usize,
        /// The row named.
        row: u64,
        /// Rows of the field.
        rows: u64,
    },
    /// The plan's rows, in order, differ from the requested positions.
    WrongRow {
        /// Position (from 0) where plan and request differ.
        index: u64,
        /// Row the plan names there.
        got: u64,
        /// Row requested there.
        want: u64,
    },
    /// The plan covers fewer rows than were requested.
    TooFewRows {
        /// Rows the plan covers.
        planned: u64,
        /// Number of positions requested.
        requested: u64,
    },
    /// The frame plan has more frames than `max_frames`.
    TooManyFrames {
        /// Frames in the plan.
        frames: u64,
        /// `max_frames`.
        budget: u32,
    },
    /// A frame names a piece index that does not exist.
    NoSuchPiece {
        /// Index of the frame.
        frame: usize,
        /// The piece index named.
        piece: u32,
        /// Number of pieces.
        pieces: u64,
    },
    /// A piece appears in two frames, or twice in one.
    PieceRepeated {
        /// Index of the frame where it appears again.
        frame: usize,
        /// The piece index.
        piece: u32,
    },
    /// A coalesced frame lists no piece.
    EmptyFrame {
        /// Index of the frame.
        frame: usize,
    },
    /// A coalesced frame of two or more pieces is over `max_frame_bytes`.
    FrameTooLarge {
        /// Index of the frame.
        frame: usize,
        /// Bytes of its pieces together (saturating).
        bytes: u64,
        /// `max_frame_bytes`.
        limit: u64,
    },
    /// A piece appears in no frame (the first such piece).
    PieceMissing {
        /// The piece index.
        piece: u32,
    },
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanError::WrongKind { piece, name, kind } => {
                write!(
                    f,
                    "piece {piece}: a {name} piece does not apply to a {kind} field"
                )
            }
            PlanError::EmptyPiece { piece } => write!(f, "piece {piece} is empty"),
            PlanError::TooManyRows { planned, requested } => {
                write!(
                    f,
                    "plan covers {planned} rows or more, {requested} were requested"
                )
            }
            PlanError::ZeroStep { piece } => write!(f, "piece {piece}: view with step 0"),
            PlanError::ViewOverflow { piece } => {
                write!(f, "piece {piece}: the view's last row overflows u64")
            }
            PlanError::ViewOutOfRange { piece, last, rows } => {
                write!(
                    f,
                    "piece {piece}: view ends at row {last}, the field has {rows} rows"
                )
            }
            PlanError::RowOutOfRange { piece, row, rows } => {
                write!(
                    f,
                    "piece {piece} names row {row}, the field has {rows} rows"
                )
            }
            PlanError::WrongRow { index, got, want } => {
                write!(
                    f,
                    "plan row #{index} is row {got}, position {index} asks for row {want}"
                )
            }
            PlanError::TooFewRows { planned, requested } => {
                write!(f, "plan covers {planned} rows, {requested} were requested")
            }
            PlanError::TooManyFrames { frames, budget } => {
                write!(f, "frame plan has {frames} frames, the budget is {budget}")
            }
            PlanError::NoSuchPiece {
                frame,
                piece,
                pieces,
            } => {
                write!(
                    f,
                    "frame {frame} names piece {piece}, there are {pieces} pieces"
                )
            }
            PlanError::PieceRepeated { frame, piece } => {
                write!(f, "frame {frame}: piece {piece} appears more than once")
            }
            PlanError::EmptyFrame { frame } => {
                write!(f, "frame {frame} is an empty coalesced frame")
            }
            PlanError::FrameTooLarge {
                frame,
                bytes,
                limit,
            } => write!(
                f,
                "frame {frame}: coalesced frame of {bytes} bytes exceeds the {limit}-byte limit"
            ),
            PlanError::PieceMissing { piece } => write!(f, "piece {piece} appears in no frame"),
        }
    }
}

impl std::error::Error for PlanError {}

/// Checks that `plan` selects exactly `positions` of `field`:
///
/// - each piece fits the field's kind ([`Piece::fits`]): `view` and
///   `gather` only on regular fields, `row-views` on nested or values
///   fields, `concat` only on nested fields;
/// - no piece is empty; a `view` has `step >= 1` and its last row is inside
///   the field (no overflow);
/// - every row named is `< rows`;
/// - the rows of the pieces, taken in order, are exactly `positions`, in
///   order (nothing dropped, repeated, reordered or added; an empty plan is
///   only valid for empty positions).
///
/// The first broken rule is reported. Cost is linear in `positions`,
/// whatever the plan claims (a view's count may be `u64::MAX`).
pub fn validate_selection(
    field: FieldInfo,
    positions: &[u64],
    plan: &SelectionPlan,
) -> Result<(), PlanError> {
    let rows = field.rows;
    let requested = positions.len() as u64;
    // Rows matched so far; never above `requested`, so `positions[next]` is
    // in bounds whenever a row is taken.
    let mut next: u64 = 0;
    let take = |piece: usize, row: u64, next: &mut u64| -> Result<(), PlanError> {
        if row >= rows {
            return Err(PlanError::RowOutOfRange { piece, row, rows });
        }
        let want = positions[*next as usize];
        if row != want {
            return Err(PlanError::WrongRow {
                index: *next,
                got: row,
                want,
            });
        }
        *next += 1;
        Ok(())
    };
    for (i, piece) in plan.pieces.iter().enumerate() {
        if !piece.fits(field.kind) {
            return Err(PlanError::WrongKind {
                piece: i,
                name: piece.name(),
                kind: field.kind,
            });
        }
        let len = piece.row_count();
        if len == 0 {
            return Err(PlanError::EmptyPiece { piece: i });
        }
        if len > requested - next {
            return Err(PlanError::TooManyRows {
                planned: next.saturating_add(len),
                requested,
            });
        }
        match piece {
            Piece::View(v) => {
                if v.step == 0 {
                    return Err(PlanError::ZeroStep { piece: i });
                }
                let last = v.last().ok_or(PlanError::ViewOverflow { piece: i })?;
                if last >= rows {
                    return Err(PlanError::ViewOutOfRange {
                        piece: i,
                        last,
                        rows,
                    });
                }
                // In range, so `start + k * step <= last` does not overflow.
                for k in 0..v.count {
                    take(i, v.start + k * v.step, &mut next)?;
                }
            }
            Piece::Gather(r) | Piece::RowViews(r) | Piece::Concat(r) => {
                for &row in r {
                    take(i, row, &mut next)?;
                }
            }
        }
    }
    if next != requested {
        return Err(PlanError::TooFewRows {
            planned: next,
            requested,
        });
    }
    Ok(())
}

/// Checks a frame plan for `pieces` within `limits`:
///
/// - at most `max_frames` frames;
/// - every piece index named exists, and appears exactly once in the plan;
/// - no coalesced frame is empty;
/// - a coalesced frame of two or more pieces holds at most
///   `max_frame_bytes` bytes (a frame of one piece may be larger: it is the
///   piece itself).
///
/// The first broken rule is reported. Cost is linear in the plan and the
/// pieces.
pub fn validate_frames(
    pieces: &[PieceInfo],
    limits: &PackLimits,
    plan: &FramePlan,
) -> Result<(), PlanError> {
    let frames = plan.frames.len() as u64;
    if frames > u64::from(limits.max_frames) {
        return Err(PlanError::TooManyFrames {
            frames,
            budget: limits.max_frames,
        });
    }
    let mut seen = vec![false; pieces.len()];
    let mut mark = |frame: usize, piece: u32| -> Result<u64, PlanError> {
        let slot = seen.get_mut(piece as usize).ok_or(PlanError::NoSuchPiece {
            frame,
            piece,
            pieces: pieces.len() as u64,
        })?;
        if *slot {
            return Err(PlanError::PieceRepeated { frame, piece });
        }
        *slot = true;
        Ok(pieces[piece as usize].byte_len)
    };
    for (f, frame) in plan.frames.iter().enumerate() {
        match frame {
            Frame::Single(i) => {
                mark(f, *i)?;
            }
            Frame::Coalesced(list) => {
                if list.is_empty() {
                    return Err(PlanError::EmptyFrame { frame: f });
                }
                let mut bytes = 0u64;
                for &i in list {
                    bytes = bytes.saturating_add(mark(f, i)?);
                }
                if list.len() > 1 && bytes > limits.max_frame_bytes {
                    return Err(PlanError::FrameTooLarge {
                        frame: f,
                        bytes,
                        limit: limits.max_frame_bytes,
                    });
                }
            }
        }
    }
    if let Some(missing) = seen.iter().position(|s| !s) {
        return Err(PlanError::PieceMissing {
            piece: missing as u32,
        });
    }
    Ok(())
}
