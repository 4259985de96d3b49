//! Hostile test plugin `infinite-loop`: describes itself like a normal
//! policy, then never returns from `select`. Not a shipped policy.

use stowage_guest::{Description, Field, FieldKind, Policy, PolicyError, SelectionPlan};

/// Loops forever in `select`.
pub struct InfiniteLoop;

impl Policy for InfiniteLoop {
    fn describe() -> Description {
        Description::new(
            "infinite-loop",
            env!("CARGO_PKG_VERSION"),
            "hostile: loops forever in select",
        )
        .selects(&[FieldKind::Regular, FieldKind::Nested, FieldKind::Values])
    }

    fn select(_field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        let mut x = positions.len() as u64;
        loop {
            // Opaque to the optimizer, so the loop stays a real loop.
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
}

stowage_guest::export_policy!(InfiniteLoop);
