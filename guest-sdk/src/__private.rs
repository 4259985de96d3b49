//! Glue between the wit-bindgen output and the SDK types (wasm32 only).
//! Used by [`crate::export_policy!`]; not a public API.

#![allow(missing_docs)]

use core::marker::PhantomData;

use stowage_plan::DTYPES;

use crate::{
    Capability, Description, Dtype, Field, FieldKind, Frame, PackLimits, Piece, PieceInfo, Policy,
    PolicyError, ReadError, RowView,
};

pub mod bindings {
    #![allow(missing_docs, clippy::all)]
    wit_bindgen::generate!({
        world: "policy",
        path: "../wit/since_v0.2.0",
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
        fields: &wt::Fields,
        layouts: Vec<wt::Layout>,
        requests: Vec<selection::SelectRequest>,
    ) -> Vec<Result<selection::SelectionPlan, wt::PolicyError>> {
        requests
            .into_iter()
            .map(|request| {
                let Some(layout) = layouts.get(request.field as usize) else {
                    return Err(wt::PolicyError::InvalidInput(format!(
                        "field number {} of {} fields",
                        request.field,
                        layouts.len()
                    )));
                };
                let field = HostField {
                    fields,
                    index: request.field,
                    layout,
                };
                match P::select(&field, &request.positions) {
                    Ok(plan) => Ok(selection::SelectionPlan {
                        pieces: plan.pieces.into_iter().map(Into::into).collect(),
                    }),
                    Err(e) => Err(e.into()),
                }
            })
            .collect()
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

/// One field of the current call: its layout, and the borrowed `fields`
/// handle for its rows and bytes.
struct HostField<'a> {
    fields: &'a wt::Fields,
    index: u32,
    layout: &'a wt::Layout,
}

impl Field for HostField<'_> {
    fn kind(&self) -> FieldKind {
        match self.layout.kind {
            wt::FieldKind::Regular => FieldKind::Regular,
            wt::FieldKind::Nested => FieldKind::Nested,
            wt::FieldKind::Values => FieldKind::Values,
        }
    }
    fn dtype(&self) -> Dtype {
        from_wit_dtype(self.layout.dtype)
    }
    fn shape(&self) -> Vec<u64> {
        self.layout.shape.clone()
    }
    fn strides(&self) -> Vec<i64> {
        self.layout.strides.clone()
    }
    fn rows(&self) -> u64 {
        self.layout.rows
    }
    fn byte_len(&self) -> u64 {
        self.layout.byte_len
    }
    fn row_shapes(&self) -> Vec<Vec<u64>> {
        self.fields.row_shapes(self.index)
    }
    fn row_byte_lens(&self) -> Vec<u64> {
        self.fields.row_byte_lens(self.index)
    }
    fn read_cap(&self) -> u64 {
        self.layout.read_cap
    }
    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ReadError> {
        self.fields
            .read(self.index, offset, len)
            .map_err(|e| match e {
                wt::ReadError::OutOfRange => ReadError::OutOfRange,
                wt::ReadError::OverCap(cap) => ReadError::OverCap(cap),
            })
    }
}

/// The dtype of a WIT case, matched by name (the dtype table's cases).
const fn from_wit_dtype(d: wt::Dtype) -> Dtype {
    use wt::Dtype as W;
    stowage_plan::dtype_cases!(from W, d)
}

/// The WIT case of a dtype (the inverse of [`from_wit_dtype`]).
const fn to_wit_dtype(d: Dtype) -> wt::Dtype {
    use wt::Dtype as W;
    stowage_plan::dtype_cases!(into W, d)
}

// Checked as a plugin compiles: each dtype's case is the one at its row of
// the dtype table (the table is in the WIT enum's order, which the host's
// tests check against the WIT file), and the two matches are inverses.
const _: () = {
    let mut i = 0;
    while i < DTYPES.len() {
        let d = DTYPES[i].dtype;
        assert!(to_wit_dtype(d) as usize == i);
        assert!(from_wit_dtype(to_wit_dtype(d)) as usize == d as usize);
        i += 1;
    }
};

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
            dtypes: d.dtypes.into_iter().map(to_wit_dtype).collect(),
            pure: d.pure,
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
