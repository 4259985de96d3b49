//! `nested-pack`: the positions of a nested field become one `concat` piece
//! (rows concatenated into one buffer with their offsets: one copy, one
//! frame, never a frame per row). Other kinds and empty positions are
//! `not-applicable`.

use stowage_guest::{Description, Field, FieldKind, Piece, Policy, PolicyError, SelectionPlan};

/// The `nested-pack` selection policy.
pub struct NestedPack;

impl Policy for NestedPack {
    fn describe() -> Description {
        Description::new(
            "nested-pack",
            env!("CARGO_PKG_VERSION"),
            "nested field -> rows concatenated into one frame",
        )
        .selects(&[FieldKind::Nested])
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        if positions.is_empty() || field.kind() != FieldKind::Nested {
            return Err(PolicyError::NotApplicable);
        }
        Ok(Piece::Concat(positions.to_vec()).into())
    }
}

stowage_guest::export_policy!(NestedPack);

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::Dtype;
    use stowage_guest::testing::{TestField, validate_selection};

    #[test]
    fn describes_itself() {
        let d = NestedPack::describe();
        assert_eq!(d.name, "nested-pack");
        assert_eq!(d.kinds, vec![FieldKind::Nested]);
    }

    #[test]
    fn nested_rows_are_concatenated() {
        let field = TestField::nested(Dtype::Bfloat16, [vec![7], vec![0], vec![128], vec![3]]);
        for pos in [vec![1], vec![3, 0, 2], vec![2, 2, 1], vec![0, 1, 2, 3]] {
            let plan = NestedPack::select(&field, &pos).unwrap();
            assert_eq!(plan.pieces, vec![Piece::Concat(pos.clone())]);
            validate_selection(&field, &pos, &plan).unwrap();
        }
    }

    #[test]
    fn declines_other_kinds_and_empty() {
        let regular = TestField::regular(Dtype::Float32, &[4, 2]);
        assert_eq!(
            NestedPack::select(&regular, &[0]),
            Err(PolicyError::NotApplicable)
        );
        assert_eq!(
            NestedPack::select(&TestField::values(&[1]), &[0]),
            Err(PolicyError::NotApplicable)
        );
        let nested = TestField::nested(Dtype::Float32, [[1]]);
        assert_eq!(
            NestedPack::select(&nested, &[]),
            Err(PolicyError::NotApplicable)
        );
    }
}
