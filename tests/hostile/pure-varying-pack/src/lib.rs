//! Hostile test plugin `pure-varying-pack`: describes itself as pure, then
//! answers the same `pack` call differently each time, from a counter kept
//! in its instance: the k-th call (from 0) answers one frame per piece
//! when k % 3 is 0, every piece in one coalesced frame when it is 1, and
//! an invalid plan (piece 0 listed twice) when it is 2. The host memoizes
//! a pure plugin's `pack` answers, so a call it has answered gets that
//! first answer again, validated again each time: an invalid one is never
//! sent. Not a shipped policy.

use std::sync::atomic::{AtomicU32, Ordering};

use stowage_guest::{Description, Frame, FramePlan, PackLimits, PieceInfo, Policy, PolicyError};

/// Pure by its word, varies anyway.
pub struct PureVaryingPack;

static CALLS: AtomicU32 = AtomicU32::new(0);

impl Policy for PureVaryingPack {
    fn describe() -> Description {
        Description::new(
            "pure-varying-pack",
            env!("CARGO_PKG_VERSION"),
            "hostile: declares itself pure, then packs the same call differently each time",
        )
        .packs()
        .pure()
    }

    fn pack(pieces: &[PieceInfo], _: &PackLimits) -> Result<FramePlan, PolicyError> {
        let n = pieces.len() as u32;
        Ok(match CALLS.fetch_add(1, Ordering::Relaxed) % 3 {
            0 => FramePlan::one_per_piece(pieces.len()),
            1 => FramePlan::new(vec![Frame::Coalesced((0..n).collect())]),
            _ => FramePlan::new(vec![Frame::Coalesced(
                std::iter::once(0).chain(0..n).collect(),
            )]),
        })
    }
}

stowage_guest::export_policy!(PureVaryingPack);
