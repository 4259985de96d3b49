//! `stowage:policy@0.2.0`, the latest contract: its bindings, the host
//! side of its `fields` resource, and the conversions between its types and
//! the host's. Older versions convert their types into these
//! (`since_v0_1_0`), so this is the only place a contract type becomes a
//! host type.

use stowage_plan::Dtype;
use wasmtime::component::Resource;

use self::exports::stowage::policy::{packing as wpack, selection as wsel};
use self::stowage::policy::types as wtypes;
use super::lent::{LentFields, ReadRefused};
use super::{HostState, LentField};
use crate::plan::{self, FramePlan, PackLimits, PieceInfo, SelectionPlan};
use crate::policy::{Capability, Description, FieldKind, PolicyError};

wasmtime::component::bindgen!({
    path: "../wit/since_v0.2.0",
    world: "policy",
    imports: { default: trappable },
    with: { "stowage:policy/types.fields": super::lent::LentFields },
});

/// The contract version, as [`super::WasmPolicy::contract`] reports it.
pub(super) const VERSION: &str = "0.2.0";

/// The 0.2.0 case of a dtype (the enum names every dtype).
pub(super) fn dtype(d: Dtype) -> wtypes::Dtype {
    use wtypes::Dtype as W;
    stowage_plan::dtype_cases!(into W, d)
}

/// The dtype of a 0.2.0 case (the inverse of [`dtype`]).
pub(super) fn from_dtype(d: wtypes::Dtype) -> Dtype {
    use wtypes::Dtype as W;
    stowage_plan::dtype_cases!(from W, d)
}

/// The layout record of a lent field.
pub(super) fn layout(f: &LentField) -> wtypes::Layout {
    wtypes::Layout {
        kind: match f.kind() {
            FieldKind::Regular => wtypes::FieldKind::Regular,
            FieldKind::Nested => wtypes::FieldKind::Nested,
            FieldKind::Values => wtypes::FieldKind::Values,
        },
        dtype: dtype(f.dtype()),
        shape: f.shape(),
        strides: f.strides(),
        rows: f.field.rows(),
        byte_len: f.byte_len(),
        read_cap: f.read_cap,
    }
}

/// The host's [`Description`] of a `description` record.
pub(super) fn description(d: wtypes::Description) -> Description {
    Description {
        name: d.name,
        version: d.version,
        summary: d.summary,
        capabilities: d
            .capabilities
            .into_iter()
            .map(|c| match c {
                wtypes::Capability::Selection => Capability::Selection,
                wtypes::Capability::Packing => Capability::Packing,
            })
            .collect(),
        kinds: d
            .kinds
            .into_iter()
            .map(|k| match k {
                wtypes::FieldKind::Regular => FieldKind::Regular,
                wtypes::FieldKind::Nested => FieldKind::Nested,
                wtypes::FieldKind::Values => FieldKind::Values,
            })
            .collect(),
        dtypes: d.dtypes.iter().map(|&t| from_dtype(t)).collect(),
        pure: d.pure,
    }
}

pub(super) fn policy_error(e: wtypes::PolicyError) -> PolicyError {
    match e {
        wtypes::PolicyError::NotApplicable => PolicyError::NotApplicable,
        wtypes::PolicyError::InvalidInput(m) => PolicyError::InvalidInput(m),
        wtypes::PolicyError::Failed(m) => PolicyError::Failed(m),
    }
}

pub(super) fn plan(p: wsel::SelectionPlan) -> SelectionPlan {
    SelectionPlan {
        pieces: p
            .pieces
            .into_iter()
            .map(|piece| match piece {
                wsel::Piece::View(v) => plan::Piece::View(plan::RowView {
                    start: v.start,
                    step: v.step,
                    count: v.count,
                }),
                wsel::Piece::Gather(r) => plan::Piece::Gather(r),
                wsel::Piece::RowViews(r) => plan::Piece::RowViews(r),
                wsel::Piece::Concat(r) => plan::Piece::Concat(r),
            })
            .collect(),
    }
}

pub(super) fn pack_args(
    pieces: &[PieceInfo],
    limits: &PackLimits,
) -> (Vec<wpack::PieceInfo>, wpack::PackLimits) {
    let wpieces = pieces
        .iter()
        .map(|p| wpack::PieceInfo {
            byte_len: p.byte_len,
            contiguous: p.contiguous,
        })
        .collect();
    let wlimits = wpack::PackLimits {
        max_frames: limits.max_frames,
        max_frame_bytes: limits.max_frame_bytes,
        small_threshold: limits.small_threshold,
    };
    (wpieces, wlimits)
}

pub(super) fn frames(
    answer: Result<wpack::FramePlan, wtypes::PolicyError>,
) -> Result<FramePlan, PolicyError> {
    answer
        .map(|p| FramePlan {
            frames: p
                .frames
                .into_iter()
                .map(|f| match f {
                    wpack::Frame::Single(i) => plan::Frame::Single(i),
                    wpack::Frame::Coalesced(v) => plan::Frame::Coalesced(v),
                })
                .collect(),
        })
        .map_err(policy_error)
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

/// The `fields` resource over [`LentFields`].
impl wtypes::HostFields for HostState {
    fn row_shapes(
        &mut self,
        h: Resource<LentFields>,
        field: u32,
    ) -> wasmtime::Result<Vec<Vec<u64>>> {
        Ok(self.table.get(&h)?.field(field)?.row_shapes())
    }

    fn row_byte_lens(&mut self, h: Resource<LentFields>, field: u32) -> wasmtime::Result<Vec<u64>> {
        Ok(self.table.get(&h)?.field(field)?.row_byte_lens())
    }

    fn read(
        &mut self,
        h: Resource<LentFields>,
        field: u32,
        offset: u64,
        len: u64,
    ) -> wasmtime::Result<Result<Vec<u8>, wtypes::ReadError>> {
        let lent = self.table.get(&h)?.field(field)?;
        Ok(lent.guest_read(offset, len)?.map_err(Into::into))
    }

    fn drop(&mut self, h: Resource<LentFields>) -> wasmtime::Result<()> {
        // Borrowed: the host deletes the entry itself after the call.
        let _ = h;
        Ok(())
    }
}
