//! Hostile test plugin `reorder`: answers an otherwise honest plan
//! (`gather` on regular fields, `row-views` on nested and values fields)
//! with the rows in reverse order. When reversing changes nothing (one
//! position, or a palindrome such as `[1, 2, 1]`) the plan is, by
//! necessity, valid. Not a shipped policy.

use stowage_guest::{Description, Field, FieldKind, Piece, Policy, PolicyError, SelectionPlan};

/// Reverses the rows.
pub struct Reorder;

impl Policy for Reorder {
    fn describe() -> Description {
        Description::new(
            "reorder",
            env!("CARGO_PKG_VERSION"),
            "hostile: answers the rows in reverse order",
        )
        .selects(&[FieldKind::Regular, FieldKind::Nested, FieldKind::Values])
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        if positions.is_empty() {
            return Err(PolicyError::NotApplicable);
        }
        let rows: Vec<u64> = positions.iter().rev().copied().collect();
        Ok(match field.kind() {
            FieldKind::Regular => Piece::Gather(rows),
            FieldKind::Nested | FieldKind::Values => Piece::RowViews(rows),
        }
        .into())
    }
}

stowage_guest::export_policy!(Reorder);

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::Dtype;
    use stowage_guest::testing::{TestField, validate_selection};

    #[test]
    fn plans_are_reversed() {
        let f = TestField::regular(Dtype::Float32, &[10, 2]);
        for pos in [vec![1, 2], vec![2, 1, 0], vec![0, 5, 9, 3]] {
            assert!(validate_selection(&f, &pos, &Reorder::select(&f, &pos).unwrap()).is_err());
        }
        // A palindrome reverses to itself.
        validate_selection(&f, &[1, 2, 1], &Reorder::select(&f, &[1, 2, 1]).unwrap()).unwrap();
    }
}
