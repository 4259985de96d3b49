//! Glue between the wit-bindgen output and the SDK types (wasm32 only).
//! Used by [`crate::export_policy!`]; not a public API.

#![allow(missing_docs)]

use core::marker::PhantomData;

use crate::{
    Capability, Description, Dtype, Field, FieldKind, Frame, PackLimits, Piece, PieceInfo, Policy,
    PolicyError, ReadError, RowView,
};

pub mod bindings {
    #![allow(missing_docs, clippy::all)]
    wit_bindgen::generate!({
        world: "policy",
        path: "../wit/since_v0.1.0",
        pub_export_macro: true,
        export_macro_name: "__stowage_export",
        default_bindings_module: "stowage_guest::__private::bindings",
    });
}

use bindings::exports::stowage::policy::{meta, packing, selection};
use bindings::stowage::policy::types as wt;

/// The type the wit-bindgen export macro is instantiated with.
pub struct Export<P>(PhantomData<P>);

impl<P: Policy> meta::Guest for Export<P> {
    fn describe() -> wt::Description {
        P::describe().into()
    }
}

impl<P: Policy> selection::Guest for Export<P> {
    fn select(
        field: &wt::Tensor,
        positions: Vec<u64>,
    ) -> Result<selection::SelectionPlan, wt::PolicyError> {
        let field = HostField(field);
        match P::select(&field, &positions) {
            Ok(plan) => Ok(selection::SelectionPlan {
                pieces: plan.pieces.into_iter().map(Into::into).collect(),
            }),
            Err(e) => Err(e.into()),
        }
    }
}

impl<P: Policy> packing::Guest for Export<P> {
    fn pack(
        pieces: Vec<packing::PieceInfo>,
        limits: packing::PackLimits,
    ) -> Result<packing::FramePlan, wt::PolicyError> {
        let pieces: Vec<PieceInfo> = pieces
            .into_iter()
            .map(|p| PieceInfo {
                byte_len: p.byte_len,
                contiguous: p.contiguous,
            })
            .collect();
        let limits = PackLimits {
            max_frames: limits.max_frames,
            max_frame_bytes: limits.max_frame_bytes,
            small_threshold: limits.small_threshold,
        };
        match P::pack(&pieces, &limits) {
            Ok(plan) => Ok(packing::FramePlan {
                frames: plan.frames.into_iter().map(Into::into).collect(),
            }),
            Err(e) => Err(e.into()),
        }
    }
}

/// The borrowed `tensor` handle of the current call.
struct HostField<'a>(&'a wt::Tensor);

impl Field for HostField<'_> {
    fn kind(&self) -> FieldKind {
        match self.0.kind() {
            wt::FieldKind::Regular => FieldKind::Regular,
            wt::FieldKind::Nested => FieldKind::Nested,
            wt::FieldKind::Values => FieldKind::Values,
        }
    }
    fn dtype(&self) -> Dtype {
        use wt::Dtype as W;
        match self.0.dtype() {
            W::Bool => Dtype::Bool,
            W::Uint8 => Dtype::Uint8,
            W::Int8 => Dtype::Int8,
            W::Int16 => Dtype::Int16,
            W::Uint16 => Dtype::Uint16,
            W::Int32 => Dtype::Int32,
            W::Uint32 => Dtype::Uint32,
            W::Int64 => Dtype::Int64,
            W::Uint64 => Dtype::Uint64,
            W::Float16 => Dtype::Float16,
            W::Bfloat16 => Dtype::Bfloat16,
            W::Float32 => Dtype::Float32,
            W::Float64 => Dtype::Float64,
            W::Complex64 => Dtype::Complex64,
            W::Complex128 => Dtype::Complex128,
        }
    }
    fn shape(&self) -> Vec<u64> {
        self.0.shape()
    }
    fn strides(&self) -> Vec<i64> {
        self.0.strides()
    }
    fn rows(&self) -> u64 {
        self.0.rows()
    }
    fn byte_len(&self) -> u64 {
        self.0.byte_len()
    }
    fn row_shapes(&self) -> Vec<Vec<u64>> {
        self.0.row_shapes()
    }
    fn row_byte_lens(&self) -> Vec<u64> {
        self.0.row_byte_lens()
    }
    fn read_cap(&self) -> u64 {
        self.0.read_cap()
    }
    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ReadError> {
        self.0.read(offset, len).map_err(|e| match e {
            wt::ReadError::OutOfRange => ReadError::OutOfRange,
            wt::ReadError::OverCap(cap) => ReadError::OverCap(cap),
        })
    }
}

impl From<Description> for wt::Description {
    fn from(d: Description) -> Self {
        wt::Description {
            name: d.name,
            version: d.version,
            summary: d.summary,
            capabilities: d
                .capabilities
                .into_iter()
                .map(|c| match c {
                    Capability::Selection => wt::Capability::Selection,
                    Capability::Packing => wt::Capability::Packing,
                })
                .collect(),
            kinds: d
                .kinds
                .into_iter()
                .map(|k| match k {
                    FieldKind::Regular => wt::FieldKind::Regular,
                    FieldKind::Nested => wt::FieldKind::Nested,
                    FieldKind::Values => wt::FieldKind::Values,
                })
                .collect(),
        }
    }
}

impl From<PolicyError> for wt::PolicyError {
    fn from(e: PolicyError) -> Self {
        match e {
            PolicyError::NotApplicable => wt::PolicyError::NotApplicable,
            PolicyError::InvalidInput(m) => wt::PolicyError::InvalidInput(m),
            PolicyError::Failed(m) => wt::PolicyError::Failed(m),
        }
    }
}

impl From<Piece> for selection::Piece {
    fn from(p: Piece) -> Self {
        match p {
            Piece::View(RowView { start, step, count }) => {
                selection::Piece::View(selection::RowView { start, step, count })
            }
            Piece::Gather(rows) => selection::Piece::Gather(rows),
            Piece::RowViews(rows) => selection::Piece::RowViews(rows),
            Piece::Concat(rows) => selection::Piece::Concat(rows),
        }
    }
}

impl From<Frame> for packing::Frame {
    fn from(f: Frame) -> Self {
        match f {
            Frame::Single(i) => packing::Frame::Single(i),
            Frame::Coalesced(list) => packing::Frame::Coalesced(list),
        }
    }
}
