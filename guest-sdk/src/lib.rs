//! Guest SDK for Stowage policy plugins.
//!
//! A Stowage policy is a small WebAssembly component implementing the frozen
//! WIT contract `stowage:policy@0.2.0` (`wit/since_v0.2.0/policy.wit`). It never sees a
//! writable byte: the host lends it a read-only [`Field`] for one call, and
//! the policy answers a *plan*, which is plain data. The host validates every
//! plan before carrying it out, with the rules of the `stowage-plan` crate
//! that [`testing::validate_selection`] and [`testing::validate_frames`] apply
//! too, so a wrong plan only costs a fallback.
//!
//! This crate gives plugin authors plain Rust types mirroring the WIT (the
//! plan types are `stowage-plan`'s, shared with the host), a [`Policy`] trait
//! with `not-applicable` defaults, a single [`export_policy!`] macro that
//! wires the trait to the component exports when built for `wasm32`, and a
//! native test harness in [`testing`], so a policy can be unit-tested with
//! `cargo test` without a host.
//!
//! # A complete policy
//!
//! ```
//! use stowage_guest::{
//!     constant_stride, Description, Field, FieldKind, Piece, Policy, PolicyError, RowView,
//!     SelectionPlan,
//! };
//!
//! /// Positions with one constant stride become one zero-copy view.
//! pub struct ConstantStride;
//!
//! impl Policy for ConstantStride {
//!     fn describe() -> Description {
//!         Description::new("constant-stride", "0.1.0", "constant-stride positions -> one view")
//!             .selects(&[FieldKind::Regular])
//!     }
//!
//!     fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
//!         if field.kind() != FieldKind::Regular {
//!             return Err(PolicyError::NotApplicable);
//!         }
//!         let step = constant_stride(positions).ok_or(PolicyError::NotApplicable)?;
//!         let view = RowView::new(positions[0], step, positions.len() as u64);
//!         Ok(SelectionPlan::single(Piece::View(view)))
//!     }
//! }
//!
//! // Exports the component interfaces on wasm32; a no-op natively.
//! stowage_guest::export_policy!(ConstantStride);
//!
//! // Native test with the harness.
//! use stowage_guest::testing::{validate_selection, TestField};
//! use stowage_guest::Dtype;
//!
//! let field = TestField::regular(Dtype::Float32, &[100, 8]);
//! let positions = [3, 7, 11, 15];
//! let plan = ConstantStride::select(&field, &positions).unwrap();
//! assert_eq!(plan.pieces, vec![Piece::View(RowView::new(3, 4, 4))]);
//! validate_selection(&field, &positions, &plan).unwrap();
//! ```
//!
//! Under 0.2.0 the host enters a plugin once per put for all its (field,
//! unit) pairs; the SDK calls [`Policy::select`] for each. A policy whose
//! `select` decides from the layout and the positions alone, and whose
//! `pack` from the pieces' sizes and the limits alone, should say so with
//! [`Description::pure`]: the host then memoizes its answers (both
//! `select`'s and `pack`'s), and a call to [`Field::read`] traps.
//!
//! Build the plugin crate (`crate-type = ["cdylib", "rlib"]`) with
//! `cargo build --target wasm32-wasip2 --release`: the `.wasm` it produces is
//! the component the host loads. A panic in a policy traps; the host counts
//! the fault and uses its built-in policy instead.

#![deny(missing_docs)]

use std::fmt;

pub mod testing;

/// The plan types, shared with the host through the `stowage-plan` crate:
/// what a policy describes, receives and answers. The host validates every
/// plan with the same `stowage-plan` rules [`testing`] applies.
pub use stowage_plan::{
    Capability, Description, Dtype, FieldKind, Frame, FramePlan, PackLimits, Piece, PieceInfo,
    RowView, SelectionPlan,
};

#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
pub mod __private;

/// Default "small piece" threshold for packing policies when
/// [`PackLimits::small_threshold`] is 0: 64 KiB.
pub const DEFAULT_SMALL_THRESHOLD: u64 = 64 * 1024;

/// How a policy declines or fails.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyError {
    /// This policy does not handle the input: the host asks the next policy
    /// of the chain.
    NotApplicable,
    /// The input is not something this policy can plan for (message).
    InvalidInput(String),
    /// The policy failed (message). Counted as a policy fault.
    Failed(String),
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::NotApplicable => f.write_str("not applicable"),
            PolicyError::InvalidInput(m) => write!(f, "invalid input: {m}"),
            PolicyError::Failed(m) => write!(f, "failed: {m}"),
        }
    }
}

impl std::error::Error for PolicyError {}

/// Why a [`Field::read`] was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadError {
    /// `offset + len` goes past [`Field::byte_len`].
    OutOfRange,
    /// `len` is above the host's per-call cap (the payload is the cap).
    OverCap(u64),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::OutOfRange => f.write_str("read past the end of the field"),
            ReadError::OverCap(cap) => write!(f, "read above the per-call cap of {cap} bytes"),
        }
    }
}

impl std::error::Error for ReadError {}

/// A read-only field lent by the host for the duration of one call.
///
/// On `wasm32` this is the imported `tensor` resource; in native tests it is
/// a [`testing::TestField`]. Every method is a host call on `wasm32`: call
/// each once and keep the result if you need it several times. There is no
/// method that writes.
pub trait Field {
    /// Kind of the field.
    fn kind(&self) -> FieldKind;
    /// Element type. For a `values` field this is [`Dtype::Uint8`].
    fn dtype(&self) -> Dtype;
    /// Shape. For `regular`: `[n, ...]`. For `nested` and `values`: `[n]`.
    fn shape(&self) -> Vec<u64>;
    /// Strides in elements, one per shape entry (C order: the last is 1).
    fn strides(&self) -> Vec<i64>;
    /// Number of rows, `n`.
    fn rows(&self) -> u64;
    /// Byte length of the whole field (for `nested`: all rows together).
    fn byte_len(&self) -> u64;
    /// Shape of each row: for `regular` every row has `shape[1..]`; for
    /// `nested` the rows' own shapes; for `values` `[len]` in bytes. This
    /// list has `n` entries: avoid it on large regular fields.
    fn row_shapes(&self) -> Vec<Vec<u64>>;
    /// Bytes of each row, in row order (`n` entries).
    fn row_byte_lens(&self) -> Vec<u64>;
    /// The largest `len` a single [`read`](Field::read) accepts.
    fn read_cap(&self) -> u64;
    /// Copies `len` bytes starting at `offset` of the field's logical byte
    /// stream (rows in order, without gaps). Bounded by
    /// [`read_cap`](Field::read_cap); for content-aware policies only.
    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ReadError>;
}

/// A policy: implement [`describe`](Policy::describe) and the methods for
/// the capabilities it declares, then export it with [`export_policy!`].
///
/// The methods are associated functions (no `self`): a policy instance has
/// no state the host could rely on, since the host may replace the instance
/// at any time.
pub trait Policy {
    /// Name, version and capabilities. Must not fail.
    fn describe() -> Description;

    /// Plans the rows at `positions` (row indexes into `field`, in the order
    /// the unit must store them). The default answers
    /// [`PolicyError::NotApplicable`].
    fn select(field: &dyn Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        let _ = (field, positions);
        Err(PolicyError::NotApplicable)
    }

    /// Groups `pieces` (indexed from 0) into frames within `limits`. The
    /// default answers [`PolicyError::NotApplicable`].
    fn pack(pieces: &[PieceInfo], limits: &PackLimits) -> Result<FramePlan, PolicyError> {
        let _ = (pieces, limits);
        Err(PolicyError::NotApplicable)
    }
}

/// The stride of `positions` if they are at least two, strictly increasing,
/// and evenly spaced: `[3, 7, 11]` gives `Some(4)`; `[5]`, `[1, 1]`,
/// `[4, 2]` and `[0, 1, 3]` give `None`.
pub fn constant_stride(positions: &[u64]) -> Option<u64> {
    let [a, b, ..] = positions else { return None };
    let step = b.checked_sub(*a).filter(|&s| s > 0)?;
    positions
        .windows(2)
        .all(|w| w[1].checked_sub(w[0]) == Some(step))
        .then_some(step)
}

/// Splits `positions` into maximal runs of evenly spaced, strictly
/// increasing rows, in order: each a [`RowView`] with `step >= 1` (a lone
/// row is a view of count 1).
///
/// Runs are taken greedily from the left, each as long as possible; this
/// also gives the fewest runs (the fewest runs for a suffix never grows when
/// the suffix shrinks). Linear time.
///
/// `[0..100, 200..300]` gives two views; `[5, 3]` gives two one-row views;
/// `[]` gives none.
pub fn split_runs(positions: &[u64]) -> Vec<RowView> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < positions.len() {
        let start = positions[i];
        let step = match positions
            .get(i + 1)
            .and_then(|next| next.checked_sub(start))
        {
            Some(step) if step > 0 => step,
            _ => {
                runs.push(RowView::single(start));
                i += 1;
                continue;
            }
        };
        let mut end = i + 1;
        while end + 1 < positions.len()
            && positions[end + 1].checked_sub(positions[end]) == Some(step)
        {
            end += 1;
        }
        runs.push(RowView::new(start, step, (end - i + 1) as u64));
        i = end + 1;
    }
    runs
}

/// Exports a [`Policy`] as the component's `meta`, `selection` and
/// `packing` interfaces of `stowage:policy@0.2.0`.
///
/// Use it once per plugin crate, at the crate root:
///
/// ```
/// # use stowage_guest::{Description, Policy};
/// struct Noop;
/// impl Policy for Noop {
///     fn describe() -> Description { Description::new("noop", "0.1.0", "declines everything") }
/// }
/// stowage_guest::export_policy!(Noop);
/// ```
///
/// On `wasm32` it emits the component exports, converting between the WIT
/// types and this crate's types. On other targets it only checks that the
/// type implements [`Policy`], so native `cargo test` builds the same crate.
#[macro_export]
macro_rules! export_policy {
    ($policy:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            type __StowagePolicyExport = $crate::__private::Export<$policy>;
            $crate::__private::bindings::__stowage_export!(
                __StowagePolicyExport with_types_in $crate::__private::bindings
            );
        };
        #[cfg(not(target_arch = "wasm32"))]
        const _: () = {
            const fn __stowage_assert_policy<P: $crate::Policy>() {}
            __stowage_assert_policy::<$policy>()
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stride_detection() {
        assert_eq!(constant_stride(&[3, 7, 11]), Some(4));
        assert_eq!(constant_stride(&[0, 1]), Some(1));
        assert_eq!(constant_stride(&[]), None);
        assert_eq!(constant_stride(&[5]), None);
        assert_eq!(constant_stride(&[1, 1]), None);
        assert_eq!(constant_stride(&[4, 2]), None);
        assert_eq!(constant_stride(&[0, 1, 3]), None);
        assert_eq!(constant_stride(&[0, u64::MAX]), Some(u64::MAX));
    }

    fn flatten(runs: &[RowView]) -> Vec<u64> {
        runs.iter().flat_map(|r| r.rows()).collect()
    }

    #[test]
    fn runs_split() {
        let pos: Vec<u64> = (0..100).chain(200..300).collect();
        assert_eq!(
            split_runs(&pos),
            vec![RowView::new(0, 1, 100), RowView::new(200, 1, 100)]
        );
        assert_eq!(split_runs(&[]), vec![]);
        assert_eq!(split_runs(&[7]), vec![RowView::single(7)]);
        assert_eq!(
            split_runs(&[5, 3]),
            vec![RowView::single(5), RowView::single(3)]
        );
        assert_eq!(split_runs(&[2, 2, 2]), vec![RowView::single(2); 3]);
        // Earlier runs are as long as possible.
        assert_eq!(
            split_runs(&[0, 2, 4, 5, 6]),
            vec![RowView::new(0, 2, 3), RowView::new(5, 1, 2)]
        );
        assert_eq!(
            split_runs(&[0, 2, 3, 4, 5]),
            vec![RowView::new(0, 2, 2), RowView::new(3, 1, 3)]
        );
        assert_eq!(
            split_runs(&[9, 0, 3, 6]),
            vec![RowView::single(9), RowView::new(0, 3, 3)]
        );
    }

    /// Brute force: the fewest valid runs, by dynamic programming.
    fn fewest_runs(pos: &[u64]) -> usize {
        let valid = |s: &[u64]| s.len() < 2 || constant_stride(s).is_some();
        let mut best = vec![usize::MAX; pos.len() + 1];
        best[0] = 0;
        for end in 1..=pos.len() {
            for start in 0..end {
                if best[start] != usize::MAX && valid(&pos[start..end]) {
                    best[end] = best[end].min(best[start] + 1);
                }
            }
        }
        best[pos.len()]
    }

    #[test]
    fn runs_cover_positions_exactly() {
        // A deterministic pseudo-random walk over several shapes.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..200 {
            let mut pos = Vec::new();
            let mut cur = 0u64;
            for _ in 0..(x % 60) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                cur = match x % 5 {
                    0 => cur.saturating_sub(x % 7),
                    1 => cur,
                    _ => cur + x % 4,
                };
                pos.push(cur);
            }
            let runs = split_runs(&pos);
            assert_eq!(flatten(&runs), pos);
            assert_eq!(runs.len(), fewest_runs(&pos), "{pos:?}");
            for r in &runs {
                assert!(r.step >= 1 && r.count >= 1);
            }
        }
    }
}
