//! `nested-rows`: the positions of a nested or values field become one
//! `row-views` piece (one zero-copy view per row, no copy). Regular fields
//! and empty positions are `not-applicable`.

use stowage_guest::{Description, Field, FieldKind, Piece, Policy, PolicyError, SelectionPlan};

/// The `nested-rows` selection policy.
pub struct NestedRows;

impl Policy for NestedRows {
    fn describe() -> Description {
        Description::new(
            "nested-rows",
            env!("CARGO_PKG_VERSION"),
            "nested or values field -> one view per row",
        )
        .selects(&[FieldKind::Nested, FieldKind::Values])
        .pure()
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        match field.kind() {
            FieldKind::Nested | FieldKind::Values if !positions.is_empty() => {
                Ok(Piece::RowViews(positions.to_vec()).into())
            }
            _ => Err(PolicyError::NotApplicable),
        }
    }
}

stowage_guest::export_policy!(NestedRows);

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::Dtype;
    use stowage_guest::testing::{TestField, validate_selection};

    #[test]
    fn describes_itself() {
        let d = NestedRows::describe();
        assert_eq!(d.name, "nested-rows");
        assert_eq!(d.kinds, vec![FieldKind::Nested, FieldKind::Values]);
    }

    #[test]
    fn nested_and_values_rows_are_views() {
        let nested = TestField::nested(
            Dtype::Float32,
            [vec![2, 3], vec![0, 3], vec![5, 3], vec![1, 3]],
        );
        let values = TestField::values(&[3, 0, 17, 4]);
        for field in [&nested, &values] {
            for pos in [vec![0], vec![3, 1, 2], vec![2, 2], vec![0, 1, 2, 3]] {
                let plan = NestedRows::select(field, &pos).unwrap();
                assert_eq!(plan.pieces, vec![Piece::RowViews(pos.clone())]);
                validate_selection(field, &pos, &plan).unwrap();
            }
        }
    }

    #[test]
    fn declines_regular_and_empty() {
        let regular = TestField::regular(Dtype::Float32, &[4, 2]);
        assert_eq!(
            NestedRows::select(&regular, &[0]),
            Err(PolicyError::NotApplicable)
        );
        assert_eq!(
            NestedRows::select(&TestField::values(&[1]), &[]),
            Err(PolicyError::NotApplicable)
        );
    }
}
