//! Hostile test plugin `trap`: describes itself like a normal policy, then
//! panics in `select` (the guest traps). Not a shipped policy.

use stowage_guest::{Description, Field, FieldKind, Policy, PolicyError, SelectionPlan};

/// Panics in `select`.
pub struct Trap;

impl Policy for Trap {
    fn describe() -> Description {
        Description::new(
            "trap",
            env!("CARGO_PKG_VERSION"),
            "hostile: panics in select",
        )
        .selects(&[FieldKind::Regular, FieldKind::Nested, FieldKind::Values])
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        panic!(
            "hostile plugin `trap`: select({} rows, {} positions)",
            field.rows(),
            positions.len()
        );
    }
}

stowage_guest::export_policy!(Trap);
