//! Hostile test plugin `memory-bomb`: describes itself like a normal policy,
//! then allocates and touches memory without bound in `select` (1 MiB at a
//! time, every page written) until the host's memory cap stops it. Not a
//! shipped policy.

use stowage_guest::{Description, Field, FieldKind, Policy, PolicyError, SelectionPlan};

/// Allocates without bound in `select`.
pub struct MemoryBomb;

const CHUNK: usize = 1 << 20;

impl Policy for MemoryBomb {
    fn describe() -> Description {
        Description::new(
            "memory-bomb",
            env!("CARGO_PKG_VERSION"),
            "hostile: allocates without bound in select",
        )
        .selects(&[FieldKind::Regular, FieldKind::Nested, FieldKind::Values])
    }

    fn select(_field: &dyn Field, _positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            let mut chunk = vec![0u8; CHUNK];
            for page in chunk.iter_mut().step_by(4096) {
                *page = 0xa5;
            }
            hoard.push(std::hint::black_box(chunk));
        }
    }
}

stowage_guest::export_policy!(MemoryBomb);
