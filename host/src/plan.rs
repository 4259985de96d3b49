//! Plans against host buffers: the plan types and rules are the
//! `stowage-plan` crate's (re-exported here, shared with the guest SDK's test
//! harness and the fuzz target); this module adds what is host-specific.
//!
//! A plan never touches bytes by itself. [`validate_selection`] (the shared
//! rule on a host [`Field`]) and [`validate_frames`] check a plan against the
//! request before anything runs; [`execute_selection`] and [`execute_frames`]
//! carry out a valid plan.
//! Views become `Bytes` slices of the original buffer (no copy); only
//! gathers, concatenations and coalesced frames allocate, once each.

use bytes::{Bytes, BytesMut};

use crate::batch::{Field, Value};
use crate::tensor::{Tensor, TensorError};

pub use stowage_plan::{
    FieldInfo, FieldKind, Frame, FramePlan, PackLimits, Piece, PieceInfo, PlanError, RowView,
    SelectionPlan, validate_frames,
};

/// What the plan rules need of `field`: its kind and row count.
pub fn field_info(field: &Field) -> FieldInfo {
    let kind = match field {
        Field::Regular(_) => FieldKind::Regular,
        Field::Nested(_) => FieldKind::Nested,
        Field::Values(_) => FieldKind::Values,
    };
    FieldInfo::new(kind, field.rows())
}

/// Checks that `plan` selects exactly `positions` of `field`, in order, with
/// pieces that fit the field's kind and stay inside it:
/// [`stowage_plan::validate_selection`] on the field's [`field_info`].
pub fn validate_selection(
    field: &Field,
    positions: &[u64],
    plan: &SelectionPlan,
) -> Result<(), PlanError> {
    stowage_plan::validate_selection(field_info(field), positions, plan)
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

/// What a plan selected: inline for the usual plan of one or two pieces
/// (a put executes one plan per (field, unit)).
pub type SelectedPieces = smallvec::SmallVec<[Selected; 2]>;

/// Carries out a plan that passed [`validate_selection`] for this field.
pub fn execute_selection(
    field: &Field,
    plan: &SelectionPlan,
) -> Result<SelectedPieces, TensorError> {
    let mut out = SelectedPieces::with_capacity(plan.pieces.len());
    for piece in &plan.pieces {
        let sel = match (piece, field) {
            (Piece::View(v), Field::Regular(t)) => {
                Selected::Rows(t.rows_view(v.start, v.step, v.count)?)
            }
            (Piece::Gather(rows), Field::Regular(t)) => Selected::Rows(t.gather(rows)?),
            (Piece::RowViews(rows), Field::Nested(all)) => Selected::NestedRows(
                rows.iter()
                    .map(|&r| nested_row(all, r))
                    .collect::<Result<_, _>>()?,
            ),
            (Piece::RowViews(rows), Field::Values(all)) => Selected::Values(
                rows.iter()
                    .map(|&r| {
                        all.get(r as usize)
                            .cloned()
                            .ok_or(TensorError::RowOutOfRange {
                                row: r,
                                rows: all.len() as u64,
                            })
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
    all.get(r as usize)
        .cloned()
        .ok_or(TensorError::RowOutOfRange {
            row: r,
            rows: all.len() as u64,
        })
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
        out.push(Tensor::contiguous(
            buffer.slice(offset..offset + len),
            t.dtype(),
            t.shape().to_vec(),
        )?);
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
        placements: vec![
            Placement {
                frame: 0,
                offset: 0,
                len: 0
            };
            pieces.len()
        ],
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
                out.placements[*i as usize] = Placement {
                    frame: fi,
                    offset: 0,
                    len: bytes.len() as u64,
                };
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
                    out.placements[i as usize] = Placement {
                        frame: fi,
                        offset,
                        len: buf.len() as u64 - offset,
                    };
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
    use crate::tensor::Dtype;

    fn regular_tensor(rows: u64) -> Tensor {
        let data: Vec<u8> = (0..rows * 2)
            .flat_map(|v| (v as f32).to_le_bytes())
            .collect();
        Tensor::contiguous(Bytes::from(data), Dtype::Float32, vec![rows, 2]).unwrap()
    }

    fn regular(rows: u64) -> Field {
        Field::Regular(regular_tensor(rows))
    }

    fn view(start: u64, step: u64, count: u64) -> Piece {
        Piece::View(RowView { start, step, count })
    }

    /// The glue only (the rules are tested in `stowage-plan`): each host
    /// field kind and its row count reach the shared rules.
    #[test]
    fn host_fields_reach_the_shared_rules() {
        let nested = Field::Nested(vec![regular_tensor(1), regular_tensor(2)]);
        let values = Field::Values(vec![Value::Bytes(Bytes::from_static(b"a")); 3]);
        assert_eq!(
            field_info(&regular(10)),
            FieldInfo::new(FieldKind::Regular, 10)
        );
        assert_eq!(field_info(&nested), FieldInfo::new(FieldKind::Nested, 2));
        assert_eq!(field_info(&values), FieldInfo::new(FieldKind::Values, 3));
        let plan = SelectionPlan {
            pieces: vec![view(0, 2, 3), Piece::Gather(vec![5, 1])],
        };
        validate_selection(&regular(10), &[0, 2, 4, 5, 1], &plan).unwrap();
        let concat = SelectionPlan::single(Piece::Concat(vec![1, 0]));
        validate_selection(&nested, &[1, 0], &concat).unwrap();
        assert_eq!(
            validate_selection(&values, &[1, 0], &concat)
                .unwrap_err()
                .to_string(),
            "piece 0: a concat piece does not apply to a values field"
        );
        assert_eq!(
            validate_selection(&nested, &[2], &Piece::RowViews(vec![2]).into()),
            Err(PlanError::RowOutOfRange {
                piece: 0,
                row: 2,
                rows: 2
            })
        );
    }

    #[test]
    fn execution_places_pieces() {
        let Field::Regular(t) = regular(4) else {
            unreachable!()
        };
        let pieces = vec![
            t.rows_view(0, 2, 2).unwrap(),
            t.rows_view(1, 1, 1).unwrap(),
            t.clone(),
        ];
        let plan = FramePlan {
            frames: vec![Frame::Coalesced(vec![0, 1]), Frame::Single(2)],
        };
        let framed = execute_frames(&pieces, &plan);
        assert_eq!(framed.frames.len(), 2);
        assert_eq!(framed.frames[0].len(), 24);
        assert_eq!(
            framed.placements[1],
            Placement {
                frame: 0,
                offset: 16,
                len: 8
            }
        );
        assert_eq!(framed.frames[1].as_ptr(), t.buffer().as_ptr());
        assert_eq!(framed.zero_copy_bytes, 32);
        assert_eq!(framed.copied_bytes, 24);
    }
}
