//! `gather`: any non-empty positions of a regular field become one `gather`
//! piece (rows copied, in order, into one contiguous buffer: one copy, one
//! frame). It always applies to regular fields, so it fits at the end of a
//! chain; empty positions and other kinds are `not-applicable`.

use stowage_guest::{Description, Field, FieldKind, Piece, Policy, PolicyError, SelectionPlan};

/// The `gather` selection policy.
pub struct Gather;

impl Policy for Gather {
    fn describe() -> Description {
        Description::new(
            "gather",
            env!("CARGO_PKG_VERSION"),
            "any positions -> one contiguous copy (index_select)",
        )
        .selects(&[FieldKind::Regular])
        .pure()
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        if positions.is_empty() || field.kind() != FieldKind::Regular {
            return Err(PolicyError::NotApplicable);
        }
        Ok(Piece::Gather(positions.to_vec()).into())
    }
}

stowage_guest::export_policy!(Gather);

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::Dtype;
    use stowage_guest::testing::{TestField, validate_selection};

    #[test]
    fn describes_itself() {
        assert_eq!(Gather::describe().name, "gather");
    }

    #[test]
    fn any_positions_are_one_gather() {
        let field = TestField::regular(Dtype::Int64, &[50, 3]);
        for pos in [
            vec![7],
            vec![49, 0, 3],
            vec![2, 2, 2],
            (0..50).rev().collect::<Vec<_>>(),
        ] {
            let plan = Gather::select(&field, &pos).unwrap();
            assert_eq!(plan.pieces, vec![Piece::Gather(pos.clone())]);
            validate_selection(&field, &pos, &plan).unwrap();
        }
    }

    #[test]
    fn declines_empty_and_other_kinds() {
        let field = TestField::regular(Dtype::Int64, &[5, 3]);
        assert_eq!(Gather::select(&field, &[]), Err(PolicyError::NotApplicable));
        let nested = TestField::nested(Dtype::Float32, [[2], [3]]);
        assert_eq!(
            Gather::select(&nested, &[0]),
            Err(PolicyError::NotApplicable)
        );
        assert_eq!(
            Gather::select(&TestField::values(&[4]), &[0]),
            Err(PolicyError::NotApplicable)
        );
    }
}
