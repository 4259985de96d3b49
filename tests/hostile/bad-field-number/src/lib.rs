//! Hostile test plugin `bad-field-number` (`stowage:policy@0.2.0`): asks
//! the lent `fields` about a field number the call did not lend (one past
//! the last layout), then, were that let through, answers requests naming
//! fields by numbers it made up. The host must trap the first (a fault
//! like any other); the plans are never reached. Built with wit-bindgen
//! directly: the SDK only ever passes the numbers it was given. Not a
//! shipped policy.
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
    use exports::stowage::policy::selection::{self, SelectRequest, SelectionPlan};
    use stowage::policy::types::{Capability, Description, FieldKind, Fields, Layout, PolicyError};

    struct BadNumber;

    impl meta::Guest for BadNumber {
        fn describe() -> Description {
            Description {
                name: "bad-field-number".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                summary: "hostile: reads a field number the call did not lend".into(),
                capabilities: vec![Capability::Selection],
                kinds: vec![FieldKind::Regular],
                dtypes: vec![],
                pure: false,
            }
        }
    }

    impl selection::Guest for BadNumber {
        fn select(
            fields: &Fields,
            layouts: Vec<Layout>,
            requests: Vec<SelectRequest>,
        ) -> Vec<Result<SelectionPlan, PolicyError>> {
            let past = layouts.len() as u32;
            let bytes = fields.read(past, 0, 1);
            requests
                .into_iter()
                .map(|r| {
                    Err(PolicyError::Failed(format!(
                        "field number {past} of {} answered {bytes:?} for a request on field {}",
                        layouts.len(),
                        r.field
                    )))
                })
                .collect()
        }
    }

    impl packing::Guest for BadNumber {
        fn pack(_pieces: Vec<PieceInfo>, _limits: PackLimits) -> Result<FramePlan, PolicyError> {
            Err(PolicyError::NotApplicable)
        }
    }

    export!(BadNumber);
}
