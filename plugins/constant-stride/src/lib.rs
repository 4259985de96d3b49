//! `constant-stride`: two or more positions of a regular field with one
//! constant stride `> 0` (e.g. `[3, 7, 11]`) become one zero-copy
//! `start:stop:step` view; anything else is `not-applicable`.

use stowage_guest::{
    Description, Field, FieldKind, Piece, Policy, PolicyError, RowView, SelectionPlan,
    constant_stride,
};

/// The `constant-stride` selection policy.
pub struct ConstantStride;

impl Policy for ConstantStride {
    fn describe() -> Description {
        Description::new(
            "constant-stride",
            env!("CARGO_PKG_VERSION"),
            "evenly spaced positions -> one strided view",
        )
        .selects(&[FieldKind::Regular])
        .pure()
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        if field.kind() != FieldKind::Regular {
            return Err(PolicyError::NotApplicable);
        }
        let step = constant_stride(positions).ok_or(PolicyError::NotApplicable)?;
        Ok(Piece::View(RowView::new(positions[0], step, positions.len() as u64)).into())
    }
}

stowage_guest::export_policy!(ConstantStride);

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::Dtype;
    use stowage_guest::testing::{TestField, validate_selection};

    #[test]
    fn describes_itself() {
        assert_eq!(ConstantStride::describe().name, "constant-stride");
    }

    #[test]
    fn evenly_spaced_positions_are_one_view() {
        let field = TestField::regular(Dtype::Float32, &[1000, 4]);
        let cases: Vec<(Vec<u64>, RowView)> = vec![
            (vec![3, 7, 11], RowView::new(3, 4, 3)),
            (vec![0, 1], RowView::new(0, 1, 2)),
            ((0..1000).collect(), RowView::new(0, 1, 1000)),
            ((2..1000).step_by(4).collect(), RowView::new(2, 4, 250)),
            (vec![0, 999], RowView::new(0, 999, 2)),
        ];
        for (pos, want) in cases {
            let plan = ConstantStride::select(&field, &pos).unwrap();
            assert_eq!(plan.pieces, vec![Piece::View(want)]);
            validate_selection(&field, &pos, &plan).unwrap();
        }
    }

    #[test]
    fn declines_everything_else() {
        let field = TestField::regular(Dtype::Float32, &[100, 4]);
        for pos in [
            vec![],
            vec![5],
            vec![1, 1],
            vec![4, 2],
            vec![0, 1, 3],
            vec![9, 6, 3],
        ] {
            assert_eq!(
                ConstantStride::select(&field, &pos),
                Err(PolicyError::NotApplicable),
                "{pos:?}"
            );
        }
        let nested = TestField::nested(Dtype::Float32, [[2], [3], [4]]);
        assert_eq!(
            ConstantStride::select(&nested, &[0, 1, 2]),
            Err(PolicyError::NotApplicable)
        );
        let values = TestField::values(&[1, 2, 3]);
        assert_eq!(
            ConstantStride::select(&values, &[0, 1, 2]),
            Err(PolicyError::NotApplicable)
        );
    }
}
