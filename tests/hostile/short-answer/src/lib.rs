//! Hostile test plugin `short-answer` (`stowage:policy@0.2.0`): `select`
//! answers one result fewer than it was asked for (none for one request),
//! each an honest `gather`. The host must count that as a fault of every
//! request of the call, not pair answers with the wrong requests. Built
//! with wit-bindgen directly: the SDK always answers one result per
//! request. `pack` declines. Not a shipped policy.
//!
//! On non-wasm targets the crate is empty.

#[cfg(target_arch = "wasm32")]
mod guest {
    wit_bindgen::generate!({
        world: "policy",
        path: "../../../wit/since_v0.2.0",
    });

    use exports::stowage::policy::meta;
    use exports::stowage::policy::packing::{self, FramePlan, PackLimits, PieceInfo};
    use exports::stowage::policy::selection::{self, Piece, SelectRequest, SelectionPlan};
    use stowage::policy::types::{Capability, Description, FieldKind, Fields, Layout, PolicyError};

    struct Short;

    impl meta::Guest for Short {
        fn describe() -> Description {
            Description {
                name: "short-answer".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                summary: "hostile: answers one result fewer than asked".into(),
                capabilities: vec![Capability::Selection],
                kinds: vec![FieldKind::Regular],
                dtypes: vec![],
                pure: false,
            }
        }
    }

    impl selection::Guest for Short {
        fn select(
            _fields: &Fields,
            _layouts: Vec<Layout>,
            requests: Vec<SelectRequest>,
        ) -> Vec<Result<SelectionPlan, PolicyError>> {
            let keep = requests.len().saturating_sub(1);
            requests
                .into_iter()
                .take(keep)
                .map(|r| {
                    Ok(SelectionPlan {
                        pieces: vec![Piece::Gather(r.positions)],
                    })
                })
                .collect()
        }
    }

    impl packing::Guest for Short {
        fn pack(_pieces: Vec<PieceInfo>, _limits: PackLimits) -> Result<FramePlan, PolicyError> {
            Err(PolicyError::NotApplicable)
        }
    }

    export!(Short);
}
