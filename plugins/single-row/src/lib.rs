//! `single-row`: exactly one position of a regular field becomes one
//! zero-copy view `{start: p, step: 1, count: 1}`; anything else is
//! `not-applicable`.

use stowage_guest::{
    Description, Field, FieldKind, Piece, Policy, PolicyError, RowView, SelectionPlan,
};

/// The `single-row` selection policy.
pub struct SingleRow;

impl Policy for SingleRow {
    fn describe() -> Description {
        Description::new(
            "single-row",
            env!("CARGO_PKG_VERSION"),
            "one position of a regular field -> a one-row view",
        )
        .selects(&[FieldKind::Regular])
        .pure()
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        match positions {
            [p] if field.kind() == FieldKind::Regular => {
                Ok(Piece::View(RowView::single(*p)).into())
            }
            _ => Err(PolicyError::NotApplicable),
        }
    }
}

stowage_guest::export_policy!(SingleRow);

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::testing::{TestField, validate_selection};
    use stowage_guest::{Capability, Dtype};

    #[test]
    fn describes_itself() {
        let d = SingleRow::describe();
        assert_eq!(d.name, "single-row");
        assert_eq!(d.capabilities, vec![Capability::Selection]);
        assert_eq!(d.kinds, vec![FieldKind::Regular]);
    }

    #[test]
    fn one_position_is_one_view() {
        let field = TestField::regular(Dtype::Float32, &[10, 4]);
        for p in [0, 5, 9] {
            let plan = SingleRow::select(&field, &[p]).unwrap();
            assert_eq!(plan.pieces, vec![Piece::View(RowView::new(p, 1, 1))]);
            validate_selection(&field, &[p], &plan).unwrap();
        }
    }

    #[test]
    fn declines_everything_else() {
        let field = TestField::regular(Dtype::Float32, &[10, 4]);
        assert_eq!(
            SingleRow::select(&field, &[]),
            Err(PolicyError::NotApplicable)
        );
        assert_eq!(
            SingleRow::select(&field, &[1, 2]),
            Err(PolicyError::NotApplicable)
        );
        let nested = TestField::nested(Dtype::Float32, [[2], [3]]);
        assert_eq!(
            SingleRow::select(&nested, &[1]),
            Err(PolicyError::NotApplicable)
        );
        assert_eq!(
            SingleRow::select(&TestField::values(&[1]), &[0]),
            Err(PolicyError::NotApplicable)
        );
        assert_eq!(
            SingleRow::pack(
                &[],
                &stowage_guest::PackLimits {
                    max_frames: 1,
                    max_frame_bytes: 1,
                    small_threshold: 0
                }
            ),
            Err(PolicyError::NotApplicable)
        );
    }
}
