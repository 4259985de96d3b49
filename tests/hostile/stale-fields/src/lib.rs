//! Hostile test plugin `stale-fields` (`stowage:policy@0.2.0`): keeps the
//! raw index of the `fields` handle lent to its first `select` and uses it
//! in the next one, after that borrow ended. Built with wit-bindgen
//! directly to reach the raw handle and the unsafe `Fields::from_handle`.
//! Not a shipped policy.
//!
//! - `select`, first call of an instance: keeps the handle's raw index and
//!   answers an honest `gather` per request.
//! - `select`, every later call: calls `row-byte-lens(0)` on the kept index
//!   first. The component model recycles handle slots, so the index either
//!   traps ("unknown handle") or names the `fields` lent to the call at
//!   hand; the answer is then `failed("stale fields handle H answered N
//!   rows")`, so a test can check it never reached an earlier call's field.
//! - `pack` declines.
//!
//! On non-wasm targets the crate is empty.

#[cfg(target_arch = "wasm32")]
mod guest {
    wit_bindgen::generate!({
        world: "policy",
        path: "../../../wit/since_v0.2.0",
    });

    use std::mem::ManuallyDrop;
    use std::sync::atomic::{AtomicU32, Ordering};

    use exports::stowage::policy::meta;
    use exports::stowage::policy::packing::{self, FramePlan, PackLimits, PieceInfo};
    use exports::stowage::policy::selection::{self, Piece, SelectRequest, SelectionPlan};
    use stowage::policy::types::{Capability, Description, FieldKind, Fields, Layout, PolicyError};

    /// Raw index of the handle lent to the first `select`; 0 = none yet.
    static KEPT: AtomicU32 = AtomicU32::new(0);

    struct Stale;

    impl meta::Guest for Stale {
        fn describe() -> Description {
            Description {
                name: "stale-fields".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                summary: "hostile: uses a fields handle kept from an earlier call".into(),
                capabilities: vec![Capability::Selection],
                kinds: vec![FieldKind::Regular],
                dtypes: vec![],
                pure: false,
            }
        }
    }

    impl selection::Guest for Stale {
        fn select(
            fields: &Fields,
            _layouts: Vec<Layout>,
            requests: Vec<SelectRequest>,
        ) -> Vec<Result<SelectionPlan, PolicyError>> {
            let kept = KEPT.load(Ordering::Relaxed);
            if kept != 0 {
                // SAFETY: deliberately unsound; this plugin tests the host's
                // handle checks. The handle is never dropped.
                let stale = ManuallyDrop::new(unsafe { Fields::from_handle(kept) });
                let rows = stale.row_byte_lens(0).len();
                return requests
                    .iter()
                    .map(|_| {
                        Err(PolicyError::Failed(format!(
                            "stale fields handle {kept} answered {rows} rows"
                        )))
                    })
                    .collect();
            }
            KEPT.store(fields.handle(), Ordering::Relaxed);
            requests
                .into_iter()
                .map(|r| {
                    Ok(SelectionPlan {
                        pieces: vec![Piece::Gather(r.positions)],
                    })
                })
                .collect()
        }
    }

    impl packing::Guest for Stale {
        fn pack(_pieces: Vec<PieceInfo>, _limits: PackLimits) -> Result<FramePlan, PolicyError> {
            Err(PolicyError::NotApplicable)
        }
    }

    export!(Stale);
}
