//! The built-in policy: native, always applicable, always valid.
//!
//! Selection gives the same rows, and the same kind of piece, as
//! TransferQueue's `_select_by_positions`: one position is a one-row view;
//! positions with one constant stride > 0 are a strided view; anything else
//! (irregular, zero or negative stride, repeats) is a gather; a nested field
//! is one view per row. Empty positions are an error.

use super::{Capability, Description, FieldKind, Policy, PolicyError};
use crate::batch::Field;
use crate::plan::{Frame, FramePlan, PackLimits, Piece, PieceInfo, RowView, SelectionPlan};

/// The native fallback policy.
#[derive(Debug)]
pub struct Builtin {
    description: Description,
}

impl Default for Builtin {
    fn default() -> Self {
        Builtin {
            description: Description {
                name: "builtin".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                summary:
                    "native fallback: TransferQueue's _select_by_positions, one frame per piece"
                        .into(),
                capabilities: vec![Capability::Selection, Capability::Packing],
                kinds: vec![FieldKind::Regular, FieldKind::Nested, FieldKind::Values],
                dtypes: vec![],
                pure: true,
            },
        }
    }
}

/// The stride shared by all consecutive positions, if there is one and it
/// is positive.
pub fn constant_stride(positions: &[u64]) -> Option<u64> {
    let [a, b, ..] = positions else { return None };
    let step = b.checked_sub(*a).filter(|s| *s > 0)?;
    positions
        .windows(2)
        .all(|w| w[1].checked_sub(w[0]) == Some(step))
        .then_some(step)
}

impl Builtin {
    /// The plan `_select_by_positions` would execute.
    pub fn plan(field: &Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        if positions.is_empty() {
            return Err(PolicyError::InvalidInput("no positions to select".into()));
        }
        let piece = match field {
            Field::Regular(_) if positions.len() == 1 => Piece::View(RowView {
                start: positions[0],
                step: 1,
                count: 1,
            }),
            Field::Regular(_) => match constant_stride(positions) {
                Some(step) => Piece::View(RowView {
                    start: positions[0],
                    step,
                    count: positions.len() as u64,
                }),
                None => Piece::Gather(positions.to_vec()),
            },
            Field::Nested(_) | Field::Values(_) => Piece::RowViews(positions.to_vec()),
        };
        Ok(SelectionPlan {
            pieces: vec![piece],
        })
    }

    /// One frame per piece while the budget allows; otherwise pieces are
    /// coalesced greedily, in order, into frames of at most
    /// `max_frame_bytes` (a piece larger than that goes alone).
    pub fn frames(pieces: &[PieceInfo], limits: &PackLimits) -> Result<FramePlan, PolicyError> {
        if pieces.len() as u64 <= limits.max_frames as u64 {
            return Ok(FramePlan {
                frames: (0..pieces.len() as u32).map(Frame::Single).collect(),
            });
        }
        let mut frames = Vec::new();
        let mut current: Vec<u32> = Vec::new();
        let mut bytes = 0u64;
        for (i, p) in pieces.iter().enumerate() {
            if !current.is_empty() && bytes.saturating_add(p.byte_len) > limits.max_frame_bytes {
                frames.push(Frame::Coalesced(std::mem::take(&mut current)));
                bytes = 0;
            }
            current.push(i as u32);
            bytes = bytes.saturating_add(p.byte_len);
        }
        if !current.is_empty() {
            frames.push(Frame::Coalesced(current));
        }
        if frames.len() as u64 > limits.max_frames as u64 {
            return Err(PolicyError::Failed(format!(
                "{} pieces need {} frames of at most {} bytes, the budget is {}",
                pieces.len(),
                frames.len(),
                limits.max_frame_bytes,
                limits.max_frames
            )));
        }
        Ok(FramePlan { frames })
    }
}

impl Policy for Builtin {
    fn describe(&self) -> &Description {
        &self.description
    }

    fn select(&self, field: &Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        Builtin::plan(field, positions)
    }

    fn pack(&self, pieces: &[PieceInfo], limits: &PackLimits) -> Result<FramePlan, PolicyError> {
        Builtin::frames(pieces, limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Value;
    use crate::tensor::{Dtype, Tensor};
    use bytes::Bytes;

    fn regular() -> Field {
        let data: Vec<u8> = (0..8u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
        Field::Regular(Tensor::contiguous(Bytes::from(data), Dtype::Float32, vec![4, 2]).unwrap())
    }

    fn view(start: u64, step: u64, count: u64) -> Piece {
        Piece::View(RowView { start, step, count })
    }

    #[test]
    fn matches_select_by_positions() {
        let f = regular();
        let one = |p: &[u64]| Builtin::plan(&f, p).unwrap().pieces;
        assert_eq!(one(&[1]), vec![view(1, 1, 1)]);
        assert_eq!(one(&[0, 2]), vec![view(0, 2, 2)]);
        assert_eq!(one(&[0, 2, 3]), vec![Piece::Gather(vec![0, 2, 3])]);
        assert_eq!(one(&[3, 1, 0]), vec![Piece::Gather(vec![3, 1, 0])]);
        assert_eq!(one(&[2, 1, 0]), vec![Piece::Gather(vec![2, 1, 0])]);
        assert_eq!(one(&[1, 1]), vec![Piece::Gather(vec![1, 1])]);
        assert!(matches!(
            Builtin::plan(&f, &[]),
            Err(PolicyError::InvalidInput(_))
        ));
        let values = Field::Values(vec![Value::Str("a".into()), Value::Str("b".into())]);
        assert_eq!(
            Builtin::plan(&values, &[1]).unwrap().pieces,
            vec![Piece::RowViews(vec![1])]
        );
    }

    #[test]
    fn frames_respect_the_budget() {
        let pieces = vec![
            PieceInfo {
                byte_len: 10,
                contiguous: true
            };
            5
        ];
        let limits = PackLimits {
            max_frames: 2,
            max_frame_bytes: 30,
            small_threshold: 0,
        };
        let plan = Builtin::frames(&pieces, &limits).unwrap();
        crate::plan::validate_frames(&pieces, &limits, &plan).unwrap();
        let tight = PackLimits {
            max_frames: 1,
            max_frame_bytes: 30,
            small_threshold: 0,
        };
        assert!(Builtin::frames(&pieces, &tight).is_err());
    }
}
