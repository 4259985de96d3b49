//! Hostile test plugin `forged-handle`: uses a `tensor` handle it was not
//! lent. Built with wit-bindgen directly (not the SDK) to reach the raw
//! handle index and the unsafe `Tensor::from_handle`. Not a shipped policy.
//!
//! - `describe` is normal; it declares selection and packing for every kind.
//! - `select`, first call of an instance: keeps the raw index of the
//!   borrowed handle, then answers an honest plan (`gather` on regular
//!   fields, `row-views` otherwise).
//! - `select`, every later call: first calls `rows()`, `byte-len()` and a
//!   one-byte `read` on the handle index kept from an *earlier* call (its
//!   borrow ended with that call). If the host lets that through, the answer
//!   is `failed("stale handle H reached a field of R rows, B bytes, byte0 X")`
//!   so a test can check that the stale index only reached the field lent to
//!   the *current* call (slots are recycled); otherwise the call traps.
//! - `pack`: no tensor is lent during `pack` at all; it calls `rows()` on the
//!   kept index (or on an invented index, 1, if `select` never ran): the host
//!   must trap it ("unknown handle").
//!
//! On non-wasm targets the crate is empty.

#[cfg(target_arch = "wasm32")]
mod guest {
    wit_bindgen::generate!({
        world: "policy",
        path: "../../../wit/since_v0.1.0",
    });

    use std::mem::ManuallyDrop;
    use std::sync::atomic::{AtomicU32, Ordering};

    use exports::stowage::policy::meta;
    use exports::stowage::policy::packing::{self, FramePlan, PackLimits, PieceInfo};
    use exports::stowage::policy::selection::{self, Piece, SelectionPlan};
    use stowage::policy::types::{Capability, Description, FieldKind, PolicyError, Tensor};

    /// Raw index of the handle lent to the first `select`; 0 = none yet.
    static KEPT: AtomicU32 = AtomicU32::new(0);
    /// Index used by `pack` when nothing was kept.
    const INVENTED: u32 = 1;

    /// A handle built from a raw index. Never dropped: dropping would call
    /// `[resource-drop]tensor` on a handle this guest does not own.
    fn forge(index: u32) -> ManuallyDrop<Tensor> {
        // SAFETY: deliberately unsound; this plugin tests the host's handle
        // checks. The handle is never dropped.
        ManuallyDrop::new(unsafe { Tensor::from_handle(index) })
    }

    struct Forged;

    impl meta::Guest for Forged {
        fn describe() -> Description {
            Description {
                name: "forged-handle".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                summary: "hostile: calls a tensor handle kept from an earlier call or invented"
                    .into(),
                capabilities: vec![Capability::Selection, Capability::Packing],
                kinds: vec![FieldKind::Regular, FieldKind::Nested, FieldKind::Values],
            }
        }
    }

    impl selection::Guest for Forged {
        fn select(field: &Tensor, positions: Vec<u64>) -> Result<SelectionPlan, PolicyError> {
            let kept = KEPT.load(Ordering::Relaxed);
            if kept == 0 {
                KEPT.store(field.handle(), Ordering::Relaxed);
                if positions.is_empty() {
                    return Err(PolicyError::NotApplicable);
                }
                let piece = match field.kind() {
                    FieldKind::Regular => Piece::Gather(positions),
                    FieldKind::Nested | FieldKind::Values => Piece::RowViews(positions),
                };
                return Ok(SelectionPlan {
                    pieces: vec![piece],
                });
            }
            let stale = forge(kept);
            let rows = stale.rows();
            let bytes = stale.byte_len();
            let byte0 = match stale.read(0, 1) {
                Ok(b) => format!("{:?}", b.first()),
                Err(e) => format!("{e:?}"),
            };
            Err(PolicyError::Failed(format!(
                "stale handle {kept} reached a field of {rows} rows, {bytes} bytes, byte0 {byte0}"
            )))
        }
    }

    impl packing::Guest for Forged {
        fn pack(pieces: Vec<PieceInfo>, _limits: PackLimits) -> Result<FramePlan, PolicyError> {
            let index = match KEPT.load(Ordering::Relaxed) {
                0 => INVENTED,
                kept => kept,
            };
            let rows = forge(index).rows();
            Err(PolicyError::Failed(format!(
                "handle {index} answered {rows} rows during pack of {} pieces",
                pieces.len()
            )))
        }
    }

    export!(Forged);
}
