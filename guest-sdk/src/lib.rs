//! Guest SDK for Stowage policy plugins.
//!
//! A Stowage policy is a small WebAssembly component implementing the frozen
//! WIT contract `stowage:policy@0.1.0` (`wit/since_v0.1.0/policy.wit`). It never sees a
//! writable byte: the host lends it a read-only [`Field`] for one call, and
//! the policy answers a *plan*, which is plain data. The host validates every
//! plan before carrying it out (the same rules as
//! [`testing::validate_selection`] and [`testing::validate_frames`]), so a
//! wrong plan only costs a fallback.
//!
//! This crate gives plugin authors plain Rust types mirroring the WIT, a
//! [`Policy`] trait with `not-applicable` defaults, a single
//! [`export_policy!`] macro that wires the trait to the component exports
//! when built for `wasm32`, and a native test harness in [`testing`], so a
//! policy can be unit-tested with `cargo test` without a host.
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
//! Build the plugin crate (`crate-type = ["cdylib", "rlib"]`) with
//! `cargo build --target wasm32-wasip2 --release`: the `.wasm` it produces is
//! the component the host loads. A panic in a policy traps; the host counts
//! the fault and uses its built-in policy instead.

#![deny(missing_docs)]

use std::fmt;

pub mod testing;

#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
pub mod __private;

/// Default "small piece" threshold for packing policies when
/// [`PackLimits::small_threshold`] is 0: 64 KiB.
pub const DEFAULT_SMALL_THRESHOLD: u64 = 64 * 1024;

/// Element type of a tensor; names follow torch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `torch.bool`, one byte.
    Bool,
    /// `torch.uint8`.
    Uint8,
    /// `torch.int8`.
    Int8,
    /// `torch.int16`.
    Int16,
    /// `torch.uint16`.
    Uint16,
    /// `torch.int32`.
    Int32,
    /// `torch.uint32`.
    Uint32,
    /// `torch.int64`.
    Int64,
    /// `torch.uint64`.
    Uint64,
    /// `torch.float16`.
    Float16,
    /// `torch.bfloat16`.
    Bfloat16,
    /// `torch.float32`.
    Float32,
    /// `torch.float64`.
    Float64,
    /// `torch.complex64` (two `float32`).
    Complex64,
    /// `torch.complex128` (two `float64`).
    Complex128,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            Dtype::Bool | Dtype::Uint8 | Dtype::Int8 => 1,
            Dtype::Int16 | Dtype::Uint16 | Dtype::Float16 | Dtype::Bfloat16 => 2,
            Dtype::Int32 | Dtype::Uint32 | Dtype::Float32 => 4,
            Dtype::Int64 | Dtype::Uint64 | Dtype::Float64 | Dtype::Complex64 => 8,
            Dtype::Complex128 => 16,
        }
    }
}

/// What a field is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FieldKind {
    /// One tensor `[n, ...]`, rows on axis 0.
    Regular,
    /// n rows of different shapes (a jagged tensor).
    Nested,
    /// n plain values (strings, bytes, opaque objects).
    Values,
}

/// What a policy can do, as listed by [`Policy::describe`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Capability {
    /// Implements [`Policy::select`].
    Selection,
    /// Implements [`Policy::pack`].
    Packing,
}

/// Identity of a policy: what [`Policy::describe`] answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Description {
    /// Short unique name, e.g. `constant-stride`.
    pub name: String,
    /// The policy's own version, semver.
    pub version: String,
    /// One line on what it does.
    pub summary: String,
    /// Which interfaces it implements for real (the others answer
    /// `not-applicable`).
    pub capabilities: Vec<Capability>,
    /// Field kinds it handles.
    pub kinds: Vec<FieldKind>,
}

impl Description {
    /// A description with no capability and no kind yet; add them with
    /// [`selects`](Self::selects), [`packs`](Self::packs),
    /// [`with_capability`](Self::with_capability) or
    /// [`with_kind`](Self::with_kind).
    pub fn new(
        name: impl Into<String>,
        version: impl Into<String>,
        summary: impl Into<String>,
    ) -> Self {
        Description {
            name: name.into(),
            version: version.into(),
            summary: summary.into(),
            capabilities: Vec::new(),
            kinds: Vec::new(),
        }
    }

    /// Adds a capability (once).
    pub fn with_capability(mut self, capability: Capability) -> Self {
        if !self.capabilities.contains(&capability) {
            self.capabilities.push(capability);
        }
        self
    }

    /// Adds a handled field kind (once).
    pub fn with_kind(mut self, kind: FieldKind) -> Self {
        if !self.kinds.contains(&kind) {
            self.kinds.push(kind);
        }
        self
    }

    /// Declares the selection capability for these field kinds.
    pub fn selects(self, kinds: &[FieldKind]) -> Self {
        kinds
            .iter()
            .fold(self.with_capability(Capability::Selection), |d, &k| {
                d.with_kind(k)
            })
    }

    /// Declares the packing capability (pieces of every field kind).
    pub fn packs(self) -> Self {
        self.with_capability(Capability::Packing)
            .with_kind(FieldKind::Regular)
            .with_kind(FieldKind::Nested)
            .with_kind(FieldKind::Values)
    }
}

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

/// Rows `start, start + step, ..., start + (count - 1) * step` of a regular
/// field, as one zero-copy view. `step` and `count` are at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowView {
    /// First row.
    pub start: u64,
    /// Distance between consecutive rows, at least 1.
    pub step: u64,
    /// Number of rows, at least 1.
    pub count: u64,
}

impl RowView {
    /// `count` rows from `start`, `step` apart.
    pub const fn new(start: u64, step: u64, count: u64) -> Self {
        RowView { start, step, count }
    }

    /// The one-row view of `row`.
    pub const fn single(row: u64) -> Self {
        RowView {
            start: row,
            step: 1,
            count: 1,
        }
    }

    /// Last row of the view, or `None` if it overflows `u64` or the view is
    /// empty.
    pub fn last(&self) -> Option<u64> {
        let span = self.count.checked_sub(1)?.checked_mul(self.step)?;
        self.start.checked_add(span)
    }

    /// The rows of the view, in order.
    pub fn rows(&self) -> impl Iterator<Item = u64> + '_ {
        let RowView { start, step, count } = *self;
        (0..count).map(move |k| start.wrapping_add(k.wrapping_mul(step)))
    }
}

/// One piece of a selection plan.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Piece {
    /// Regular field: a zero-copy strided view of rows.
    View(RowView),
    /// Regular field: these rows, in this order, copied into one new
    /// contiguous buffer (one allocation).
    Gather(Vec<u64>),
    /// Nested or values field: one zero-copy view per listed row.
    RowViews(Vec<u64>),
    /// Nested field: these rows concatenated into one new buffer, with the
    /// byte offset of each row (one allocation, one frame).
    Concat(Vec<u64>),
}

impl Piece {
    /// Number of rows the piece covers.
    pub fn row_count(&self) -> u64 {
        match self {
            Piece::View(v) => v.count,
            Piece::Gather(r) | Piece::RowViews(r) | Piece::Concat(r) => r.len() as u64,
        }
    }

    /// The rows of the piece, in order.
    pub fn rows(&self) -> Box<dyn Iterator<Item = u64> + '_> {
        match self {
            Piece::View(v) => Box::new(v.rows()),
            Piece::Gather(r) | Piece::RowViews(r) | Piece::Concat(r) => Box::new(r.iter().copied()),
        }
    }

    /// The WIT name of the piece's case (`view`, `gather`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            Piece::View(_) => "view",
            Piece::Gather(_) => "gather",
            Piece::RowViews(_) => "row-views",
            Piece::Concat(_) => "concat",
        }
    }
}

/// A selection plan: the rows of its pieces, taken in order, must be exactly
/// the requested positions, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct SelectionPlan {
    /// The pieces, in row order.
    pub pieces: Vec<Piece>,
}

impl SelectionPlan {
    /// A plan of these pieces.
    pub fn new(pieces: Vec<Piece>) -> Self {
        SelectionPlan { pieces }
    }

    /// A plan of one piece.
    pub fn single(piece: Piece) -> Self {
        SelectionPlan {
            pieces: vec![piece],
        }
    }

    /// Number of rows the plan covers.
    pub fn row_count(&self) -> u64 {
        self.pieces
            .iter()
            .map(Piece::row_count)
            .fold(0, u64::saturating_add)
    }
}

impl From<Piece> for SelectionPlan {
    fn from(piece: Piece) -> Self {
        SelectionPlan::single(piece)
    }
}

/// One piece to send, described by size only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PieceInfo {
    /// Bytes of the piece.
    pub byte_len: u64,
    /// True if the piece is one contiguous byte range (it can go out as its
    /// own frame without a copy).
    pub contiguous: bool,
}

impl PieceInfo {
    /// A contiguous piece of `byte_len` bytes.
    pub const fn contiguous(byte_len: u64) -> Self {
        PieceInfo {
            byte_len,
            contiguous: true,
        }
    }

    /// A non-contiguous (strided) piece of `byte_len` bytes.
    pub const fn strided(byte_len: u64) -> Self {
        PieceInfo {
            byte_len,
            contiguous: false,
        }
    }
}

/// Bounds the host sets for one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PackLimits {
    /// The most frames a message may have.
    pub max_frames: u32,
    /// Largest coalesced (copied) frame, in bytes.
    pub max_frame_bytes: u64,
    /// Pieces below this many bytes are "small" (a hint; 0 = policy's own).
    pub small_threshold: u64,
}

impl PackLimits {
    /// `small_threshold`, or `default` when the host left it at 0.
    pub fn small_threshold_or(&self, default: u64) -> u64 {
        if self.small_threshold == 0 {
            default
        } else {
            self.small_threshold
        }
    }
}

/// One frame of a message.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Frame {
    /// The piece at this index goes out as its own frame (zero copy if
    /// contiguous, else compacted with one copy).
    Single(u32),
    /// These pieces are copied, in this order, into one frame.
    Coalesced(Vec<u32>),
}

/// A frame plan: every piece index appears exactly once, and there are at
/// most `max_frames` frames.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct FramePlan {
    /// The frames of the message, in order.
    pub frames: Vec<Frame>,
}

impl FramePlan {
    /// A plan of these frames.
    pub fn new(frames: Vec<Frame>) -> Self {
        FramePlan { frames }
    }

    /// One `single` frame per piece: the plan of `n` pieces with no copy.
    pub fn one_per_piece(n: usize) -> Self {
        FramePlan {
            frames: (0..n as u32).map(Frame::Single).collect(),
        }
    }
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
/// `packing` interfaces of `stowage:policy@0.1.0`.
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

    #[test]
    fn description_builder() {
        let d = Description::new("x", "1.0.0", "s")
            .selects(&[FieldKind::Regular, FieldKind::Regular])
            .packs();
        assert_eq!(
            d.capabilities,
            vec![Capability::Selection, Capability::Packing]
        );
        assert_eq!(
            d.kinds,
            vec![FieldKind::Regular, FieldKind::Nested, FieldKind::Values]
        );
    }

    #[test]
    fn row_view_helpers() {
        assert_eq!(
            RowView::new(2, 3, 3).rows().collect::<Vec<_>>(),
            vec![2, 5, 8]
        );
        assert_eq!(RowView::new(2, 3, 3).last(), Some(8));
        assert_eq!(RowView::new(2, 3, 0).last(), None);
        assert_eq!(RowView::new(1, u64::MAX, 2).last(), None);
        assert_eq!(
            Piece::Gather(vec![4, 1]).rows().collect::<Vec<_>>(),
            vec![4, 1]
        );
        assert_eq!(
            SelectionPlan::new(vec![
                Piece::View(RowView::new(0, 1, 5)),
                Piece::Concat(vec![1])
            ])
            .row_count(),
            6
        );
    }
}
