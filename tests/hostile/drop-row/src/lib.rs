//! Hostile test plugin `drop-row`: answers an otherwise honest plan
//! (`gather` on regular fields, `row-views` on nested and values fields)
//! that omits the middle position (index `n / 2`); with one position the
//! plan is empty. Not a shipped policy.

use stowage_guest::{Description, Field, FieldKind, Piece, Policy, PolicyError, SelectionPlan};

/// Omits one row.
pub struct DropRow;

impl Policy for DropRow {
    fn describe() -> Description {
        Description::new(
            "drop-row",
            env!("CARGO_PKG_VERSION"),
            "hostile: omits one row from the plan",
        )
        .selects(&[FieldKind::Regular, FieldKind::Nested, FieldKind::Values])
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        if positions.is_empty() {
            return Err(PolicyError::NotApplicable);
        }
        let mut rows = positions.to_vec();
        rows.remove(rows.len() / 2);
        if rows.is_empty() {
            return Ok(SelectionPlan::default());
        }
        Ok(match field.kind() {
            FieldKind::Regular => Piece::Gather(rows),
            FieldKind::Nested | FieldKind::Values => Piece::RowViews(rows),
        }
        .into())
    }
}

stowage_guest::export_policy!(DropRow);

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::Dtype;
    use stowage_guest::testing::{TestField, validate_selection};

    #[test]
    fn every_plan_misses_a_row() {
        let fields = [
            TestField::regular(Dtype::Float32, &[10, 2]),
            TestField::values(&[1, 2, 3]),
        ];
        for f in &fields {
            for pos in [vec![0], vec![1, 2], vec![2, 1, 0]] {
                let plan = DropRow::select(f, &pos).unwrap();
                assert_eq!(plan.row_count(), pos.len() as u64 - 1);
                assert!(validate_selection(f, &pos, &plan).is_err());
            }
        }
    }
}
