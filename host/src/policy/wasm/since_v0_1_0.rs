//! `stowage:policy@0.1.0`, frozen: its bindings, the host side of its
//! `tensor` resource, and the conversions of its types into the latest
//! contract's (`since_v0_2_0`), which converts them into the host's.
//!
//! 0.1.0 lends each field as its own `tensor` handle and is asked once per
//! (field, unit) pair; its `dtype` enum names 15 dtypes, its `description`
//! has neither `dtypes` (it handles every dtype it can name) nor `pure`.

use stowage_plan::Dtype;
use wasmtime::component::Resource;

use self::exports::stowage::policy::{packing as wpack, selection as wsel};
use self::stowage::policy::types as wtypes;
use super::lent::ReadRefused;
use super::since_v0_2_0 as latest;
use super::{HostState, LentField};
use crate::policy::FieldKind;

use latest::exports::stowage::policy::{packing as lpack, selection as lsel};
use latest::stowage::policy::types as ltypes;

wasmtime::component::bindgen!({
    path: "../wit/since_v0.1.0",
    world: "policy",
    imports: { default: trappable },
    with: { "stowage:policy/types.tensor": super::LentField },
});

/// The contract version, as [`super::WasmPolicy::contract`] reports it.
pub(super) const VERSION: &str = "0.1.0";

/// The 0.1.0 case of a dtype; an error (a trap) for the seven it lacks.
pub(super) fn dtype(d: Dtype) -> wasmtime::Result<wtypes::Dtype> {
    use wtypes::Dtype as W;
    // Unreachable while the chain checks `can_describe` first; a trap (a
    // fault, answered by the built-in) rather than a wrong name.
    Ok(stowage_plan::dtype_cases!(into_v0_1 W, d, else {
        return Err(wasmtime::Error::msg(format!(
            "dtype {d:?} has no name in stowage:policy@0.1.0"
        )));
    }))
}

impl From<wtypes::FieldKind> for ltypes::FieldKind {
    fn from(k: wtypes::FieldKind) -> Self {
        match k {
            wtypes::FieldKind::Regular => Self::Regular,
            wtypes::FieldKind::Nested => Self::Nested,
            wtypes::FieldKind::Values => Self::Values,
        }
    }
}

impl From<wtypes::Capability> for ltypes::Capability {
    fn from(c: wtypes::Capability) -> Self {
        match c {
            wtypes::Capability::Selection => Self::Selection,
            wtypes::Capability::Packing => Self::Packing,
        }
    }
}

/// A 0.1.0 policy handles every dtype it can name (no `dtypes`) and is
/// never pure.
impl From<wtypes::Description> for ltypes::Description {
    fn from(d: wtypes::Description) -> Self {
        Self {
            name: d.name,
            version: d.version,
            summary: d.summary,
            capabilities: d.capabilities.into_iter().map(Into::into).collect(),
            kinds: d.kinds.into_iter().map(Into::into).collect(),
            dtypes: vec![],
            pure: false,
        }
    }
}

impl From<wtypes::PolicyError> for ltypes::PolicyError {
    fn from(e: wtypes::PolicyError) -> Self {
        match e {
            wtypes::PolicyError::NotApplicable => Self::NotApplicable,
            wtypes::PolicyError::InvalidInput(m) => Self::InvalidInput(m),
            wtypes::PolicyError::Failed(m) => Self::Failed(m),
        }
    }
}

impl From<wsel::SelectionPlan> for lsel::SelectionPlan {
    fn from(p: wsel::SelectionPlan) -> Self {
        Self {
            pieces: p
                .pieces
                .into_iter()
                .map(|piece| match piece {
                    wsel::Piece::View(v) => lsel::Piece::View(lsel::RowView {
                        start: v.start,
                        step: v.step,
                        count: v.count,
                    }),
                    wsel::Piece::Gather(r) => lsel::Piece::Gather(r),
                    wsel::Piece::RowViews(r) => lsel::Piece::RowViews(r),
                    wsel::Piece::Concat(r) => lsel::Piece::Concat(r),
                })
                .collect(),
        }
    }
}

impl From<lpack::PieceInfo> for wpack::PieceInfo {
    fn from(p: lpack::PieceInfo) -> Self {
        Self {
            byte_len: p.byte_len,
            contiguous: p.contiguous,
        }
    }
}

impl From<lpack::PackLimits> for wpack::PackLimits {
    fn from(l: lpack::PackLimits) -> Self {
        Self {
            max_frames: l.max_frames,
            max_frame_bytes: l.max_frame_bytes,
            small_threshold: l.small_threshold,
        }
    }
}

impl From<wpack::FramePlan> for lpack::FramePlan {
    fn from(p: wpack::FramePlan) -> Self {
        Self {
            frames: p
                .frames
                .into_iter()
                .map(|f| match f {
                    wpack::Frame::Single(i) => lpack::Frame::Single(i),
                    wpack::Frame::Coalesced(v) => lpack::Frame::Coalesced(v),
                })
                .collect(),
        }
    }
}

impl From<ReadRefused> for wtypes::ReadError {
    fn from(e: ReadRefused) -> Self {
        match e {
            ReadRefused::OutOfRange => wtypes::ReadError::OutOfRange,
            ReadRefused::OverCap(cap) => wtypes::ReadError::OverCap(cap),
        }
    }
}

impl wtypes::Host for HostState {}

/// The `tensor` resource over [`LentField`]'s methods.
impl wtypes::HostTensor for HostState {
    fn kind(&mut self, h: Resource<LentField>) -> wasmtime::Result<wtypes::FieldKind> {
        Ok(match self.table.get(&h)?.kind() {
            FieldKind::Regular => wtypes::FieldKind::Regular,
            FieldKind::Nested => wtypes::FieldKind::Nested,
            FieldKind::Values => wtypes::FieldKind::Values,
        })
    }

    fn dtype(&mut self, h: Resource<LentField>) -> wasmtime::Result<wtypes::Dtype> {
        dtype(self.table.get(&h)?.dtype())
    }

    fn shape(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<u64>> {
        Ok(self.table.get(&h)?.shape())
    }

    fn strides(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<i64>> {
        Ok(self.table.get(&h)?.strides())
    }

    fn rows(&mut self, h: Resource<LentField>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&h)?.field.rows())
    }

    fn byte_len(&mut self, h: Resource<LentField>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&h)?.byte_len())
    }

    fn row_shapes(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<Vec<u64>>> {
        Ok(self.table.get(&h)?.row_shapes())
    }

    fn row_byte_lens(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<u64>> {
        Ok(self.table.get(&h)?.row_byte_lens())
    }

    fn read_cap(&mut self, h: Resource<LentField>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&h)?.read_cap)
    }

    fn read(
        &mut self,
        h: Resource<LentField>,
        offset: u64,
        len: u64,
    ) -> wasmtime::Result<Result<Vec<u8>, wtypes::ReadError>> {
        Ok(self
            .table
            .get(&h)?
            .guest_read(offset, len)?
            .map_err(Into::into))
    }

    fn drop(&mut self, h: Resource<LentField>) -> wasmtime::Result<()> {
        // Borrowed handles are never dropped by the guest; the host
        // deletes the entry itself after the call.
        let _ = h;
        Ok(())
    }
}
