//! Hostile test plugin `frame-bomb`: describes itself like a normal policy
//! with both capabilities, then
//!
//! - `select` answers a plan of [`PIECES`] (10 million) one-row pieces
//!   cycling through the positions (`view` `{p, 1, 1}` on regular fields,
//!   `row-views [p]` on nested and values fields). Building and returning it
//!   takes about 320 MB of guest memory for the plan plus as much again for
//!   its canonical-ABI copy, so a guest memory cap below that turns it into
//!   an out-of-memory trap before the host ever sees the plan;
//! - `pack` answers one `single` frame per piece, ignoring `max_frames`.
//!
//! Not a shipped policy.

use stowage_guest::{
    Description, Field, FieldKind, FramePlan, PackLimits, Piece, PieceInfo, Policy, PolicyError,
    RowView, SelectionPlan,
};

/// Pieces in the answer of `select`.
pub const PIECES: usize = 10_000_000;

/// Floods the host with pieces and frames.
pub struct FrameBomb;

impl FrameBomb {
    /// The `select` answer with `count` pieces (tests use a small count).
    pub fn bomb(
        field: &dyn Field,
        positions: &[u64],
        count: usize,
    ) -> Result<SelectionPlan, PolicyError> {
        if positions.is_empty() {
            return Err(PolicyError::NotApplicable);
        }
        let regular = field.kind() == FieldKind::Regular;
        let pieces = (0..count)
            .map(|i| {
                let p = positions[i % positions.len()];
                if regular {
                    Piece::View(RowView::single(p))
                } else {
                    Piece::RowViews(vec![p])
                }
            })
            .collect();
        Ok(SelectionPlan::new(pieces))
    }
}

impl Policy for FrameBomb {
    fn describe() -> Description {
        Description::new(
            "frame-bomb",
            env!("CARGO_PKG_VERSION"),
            "hostile: 10 million pieces, one frame per piece",
        )
        .selects(&[FieldKind::Regular, FieldKind::Nested, FieldKind::Values])
        .packs()
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        FrameBomb::bomb(field, positions, PIECES)
    }

    fn pack(pieces: &[PieceInfo], _limits: &PackLimits) -> Result<FramePlan, PolicyError> {
        Ok(FramePlan::one_per_piece(pieces.len()))
    }
}

stowage_guest::export_policy!(FrameBomb);

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::Dtype;
    use stowage_guest::testing::{TestField, validate_frames, validate_selection};

    #[test]
    fn plans_are_refused() {
        let f = TestField::regular(Dtype::Float32, &[10, 2]);
        let plan = FrameBomb::bomb(&f, &[1, 2], 1000).unwrap();
        assert_eq!(plan.pieces.len(), 1000);
        assert!(validate_selection(&f, &[1, 2], &plan).is_err());
        let pieces = vec![PieceInfo::contiguous(8); 50];
        let limits = PackLimits {
            max_frames: 10,
            max_frame_bytes: 1 << 20,
            small_threshold: 0,
        };
        let frames = FrameBomb::pack(&pieces, &limits).unwrap();
        assert_eq!(frames.frames.len(), 50);
        assert!(validate_frames(&pieces, &limits, &frames).is_err());
    }
}
