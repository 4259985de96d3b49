//! `runs`: the positions of a regular field split into runs of evenly
//! spaced, increasing rows, each one zero-copy `view` (a lone row is a view
//! of count 1). `[0..100, 200..300]` is exactly two views.
//!
//! The split is [`stowage_guest::split_runs`]: maximal runs taken greedily
//! from the left, which is also the fewest runs.
//!
//! **Rule.** With `n` positions split into `r` runs, the policy answers only
//! if `r <= max(1, n / 2)` (integer division), i.e. the views cover on
//! average at least two rows each (or there is a single run). Past that, a
//! plan of many tiny views is no better than one `gather`, and the policy
//! answers `not-applicable` so the chain moves on (typically to `gather`).
//! Empty positions and non-regular fields are `not-applicable` too.

use stowage_guest::{
    Description, Field, FieldKind, Piece, Policy, PolicyError, SelectionPlan, split_runs,
};

/// The `runs` selection policy.
pub struct Runs;

/// Most runs the policy answers for `n` positions: `max(1, n / 2)`.
pub fn max_runs(n: usize) -> usize {
    (n / 2).max(1)
}

impl Policy for Runs {
    fn describe() -> Description {
        Description::new(
            "runs",
            env!("CARGO_PKG_VERSION"),
            "positions split into constant-stride runs -> few views",
        )
        .selects(&[FieldKind::Regular])
        .pure()
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        if positions.is_empty() || field.kind() != FieldKind::Regular {
            return Err(PolicyError::NotApplicable);
        }
        let runs = split_runs(positions);
        if runs.len() > max_runs(positions.len()) {
            return Err(PolicyError::NotApplicable);
        }
        Ok(SelectionPlan::new(
            runs.into_iter().map(Piece::View).collect(),
        ))
    }
}

stowage_guest::export_policy!(Runs);

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::testing::{TestField, validate_selection};
    use stowage_guest::{Dtype, RowView};

    fn views(plan: &SelectionPlan) -> Vec<RowView> {
        plan.pieces
            .iter()
            .map(|p| match p {
                Piece::View(v) => *v,
                other => panic!("not a view: {other:?}"),
            })
            .collect()
    }

    fn select_ok(field: &TestField, pos: &[u64]) -> Vec<RowView> {
        let plan = Runs::select(field, pos).unwrap();
        validate_selection(field, pos, &plan).unwrap();
        views(&plan)
    }

    #[test]
    fn describes_itself() {
        assert_eq!(Runs::describe().name, "runs");
    }

    #[test]
    fn two_ranges_are_two_views() {
        let field = TestField::regular(Dtype::Float32, &[1000, 16]);
        let pos: Vec<u64> = (0..100).chain(200..300).collect();
        assert_eq!(
            select_ok(&field, &pos),
            vec![RowView::new(0, 1, 100), RowView::new(200, 1, 100)]
        );
    }

    #[test]
    fn single_runs_and_mixed_strides() {
        let field = TestField::regular(Dtype::Float32, &[1000, 16]);
        assert_eq!(select_ok(&field, &[42]), vec![RowView::single(42)]);
        assert_eq!(select_ok(&field, &[3, 7, 11]), vec![RowView::new(3, 4, 3)]);
        let pos: Vec<u64> = (0..50)
            .step_by(5)
            .chain((500..520).step_by(2))
            .chain([999])
            .collect();
        assert_eq!(
            select_ok(&field, &pos),
            vec![
                RowView::new(0, 5, 10),
                RowView::new(500, 2, 10),
                RowView::single(999)
            ]
        );
        // Backwards jumps start a new run; each run is still increasing.
        let pos: Vec<u64> = (500..600).chain(0..100).collect();
        assert_eq!(
            select_ok(&field, &pos),
            vec![RowView::new(500, 1, 100), RowView::new(0, 1, 100)]
        );
    }

    #[test]
    fn the_bound_on_runs() {
        let field = TestField::regular(Dtype::Float32, &[1000, 16]);
        // 4 positions, 2 runs: at the bound, answered.
        assert_eq!(select_ok(&field, &[0, 1, 10, 11]).len(), 2);
        // 3 positions, 2 runs: above max(1, 3 / 2) = 1.
        assert_eq!(
            Runs::select(&field, &[0, 1, 10]),
            Err(PolicyError::NotApplicable)
        );
        // Scattered or repeated rows: one run per row, no better than gather.
        assert_eq!(
            Runs::select(&field, &[5, 3, 9, 1]),
            Err(PolicyError::NotApplicable)
        );
        assert_eq!(
            Runs::select(&field, &[7, 7]),
            Err(PolicyError::NotApplicable)
        );
        // 6 positions in 3 runs of 2: exactly n / 2, answered.
        assert_eq!(select_ok(&field, &[0, 1, 5, 6, 20, 21]).len(), 3);
        assert_eq!(max_runs(0), 1);
        assert_eq!(max_runs(1), 1);
        assert_eq!(max_runs(7), 3);
    }

    #[test]
    fn declines_other_kinds_and_empty() {
        let field = TestField::regular(Dtype::Float32, &[10, 2]);
        assert_eq!(Runs::select(&field, &[]), Err(PolicyError::NotApplicable));
        let nested = TestField::nested(Dtype::Float32, [[1], [2]]);
        assert_eq!(
            Runs::select(&nested, &[0, 1]),
            Err(PolicyError::NotApplicable)
        );
    }

    #[test]
    fn every_answer_is_valid() {
        let field = TestField::regular(Dtype::Uint8, &[4096, 1]);
        let mut x: u64 = 12345;
        for _ in 0..300 {
            let mut pos = Vec::new();
            let mut cur = 0u64;
            for _ in 0..(x % 200) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                cur = match (x >> 33) % 10 {
                    0 => (x >> 20) % 4096,
                    1..=6 => (cur + 1).min(4095),
                    _ => (cur + 3).min(4095),
                };
                pos.push(cur);
            }
            match Runs::select(&field, &pos) {
                Ok(plan) => {
                    validate_selection(&field, &pos, &plan).unwrap();
                    assert!(plan.pieces.len() <= max_runs(pos.len()));
                }
                Err(e) => assert_eq!(e, PolicyError::NotApplicable),
            }
        }
    }
}
