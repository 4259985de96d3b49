//! Hostile test plugin `pure-read`: describes itself as pure (decides from
//! layout and positions alone, so its answers may be memoized), then calls
//! `read` in `select` anyway. The host must trap that read, so a plugin
//! that looks at content can never have a stale answer replayed from the
//! memo. Were the read let through, it answers a valid `gather`. Not a
//! shipped policy.

use stowage_guest::{Description, Field, FieldKind, Piece, Policy, PolicyError, SelectionPlan};

/// Pure by its word, reads anyway.
pub struct PureRead;

impl Policy for PureRead {
    fn describe() -> Description {
        Description::new(
            "pure-read",
            env!("CARGO_PKG_VERSION"),
            "hostile: declares itself pure, then reads content",
        )
        .selects(&[FieldKind::Regular])
        .pure()
    }

    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        let first = field
            .read(0, 1)
            .map_err(|e| PolicyError::Failed(e.to_string()))?;
        let _ = first;
        Ok(SelectionPlan::single(Piece::Gather(positions.to_vec())))
    }
}

stowage_guest::export_policy!(PureRead);
