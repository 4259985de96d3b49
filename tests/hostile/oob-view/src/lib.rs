//! Hostile test plugin `oob-view`: answers a plan that reaches past the end
//! of the field, with the right number of rows so that only the range check
//! can catch it. Not a shipped policy.
//!
//! - regular field, 2+ positions: one view `{start: rows - 1, step: 1,
//!   count: n}` (first row inside, the rest past the end);
//! - regular field, 1 position: one view `{start: rows, step: 1, count: 1}`;
//! - nested or values field: `row-views` of the positions with the first
//!   replaced by row `rows` (one past the last row).

use stowage_guest::{
    Description, Field, FieldKind, Piece, Policy, PolicyError, RowView, SelectionPlan,
};

/// Answers out-of-range plans.
pub struct OobView;

impl Policy for OobView {
    fn describe() -> Description {
        Description::new(
            "oob-view",
            env!("CARGO_PKG_VERSION"),
            "hostile: a view past the end of the field",
        )
        .selects(&[FieldKind::Regular, FieldKind::Nested, FieldKind::Values])
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        if positions.is_empty() {
            return Err(PolicyError::NotApplicable);
        }
        let rows = field.rows();
        let n = positions.len() as u64;
        let piece = match field.kind() {
            FieldKind::Regular if n >= 2 => Piece::View(RowView::new(rows.saturating_sub(1), 1, n)),
            FieldKind::Regular => Piece::View(RowView::single(rows)),
            FieldKind::Nested | FieldKind::Values => {
                let mut bad = positions.to_vec();
                bad[0] = rows;
                Piece::RowViews(bad)
            }
        };
        Ok(piece.into())
    }
}

stowage_guest::export_policy!(OobView);

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::Dtype;
    use stowage_guest::testing::{TestField, validate_selection};

    #[test]
    fn every_plan_is_out_of_range() {
        let fields = [
            TestField::regular(Dtype::Float32, &[10, 2]),
            TestField::nested(Dtype::Float32, [[1], [2], [3]]),
            TestField::values(&[1, 2, 3]),
        ];
        for f in &fields {
            for pos in [vec![0], vec![1, 2], vec![2, 1, 0]] {
                let err =
                    validate_selection(f, &pos, &OobView::select(f, &pos).unwrap()).unwrap_err();
                assert!(err.contains("field has"), "{err}");
            }
        }
    }
}
