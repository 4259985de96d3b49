//! Hostile test plugin `dup-row`: answers an otherwise honest plan
//! (`gather` on regular fields, `row-views` on nested and values fields) in
//! which a row is repeated: the last position is replaced by a second copy
//! of the first (same row count, wrong rows); when that would change nothing
//! (one position, or first == last) the first row is appended again (one
//! row too many). Not a shipped policy.

use stowage_guest::{Description, Field, FieldKind, Piece, Policy, PolicyError, SelectionPlan};

/// Repeats a row.
pub struct DupRow;

impl Policy for DupRow {
    fn describe() -> Description {
        Description::new(
            "dup-row",
            env!("CARGO_PKG_VERSION"),
            "hostile: repeats a row in the plan",
        )
        .selects(&[FieldKind::Regular, FieldKind::Nested, FieldKind::Values])
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        let (&first, &last) = match (positions.first(), positions.last()) {
            (Some(f), Some(l)) => (f, l),
            _ => return Err(PolicyError::NotApplicable),
        };
        let mut rows = positions.to_vec();
        if positions.len() >= 2 && first != last {
            *rows.last_mut().unwrap() = first;
        } else {
            rows.push(first);
        }
        Ok(match field.kind() {
            FieldKind::Regular => Piece::Gather(rows),
            FieldKind::Nested | FieldKind::Values => Piece::RowViews(rows),
        }
        .into())
    }
}

stowage_guest::export_policy!(DupRow);

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::Dtype;
    use stowage_guest::testing::{TestField, validate_selection};

    #[test]
    fn every_plan_repeats_a_row() {
        let fields = [
            TestField::regular(Dtype::Float32, &[10, 2]),
            TestField::nested(Dtype::Int8, [[1], [2], [3]]),
        ];
        for f in &fields {
            for pos in [vec![0], vec![1, 2], vec![2, 1, 0], vec![1, 0, 1]] {
                let plan = DupRow::select(f, &pos).unwrap();
                assert!(validate_selection(f, &pos, &plan).is_err(), "{pos:?}");
            }
        }
    }
}
