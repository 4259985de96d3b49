//! Stowage plans: the plain data a policy answers, and the one set of rules
//! that decides whether a plan may run.
//!
//! A policy (a Wasm plugin or the host's built-in) never touches bytes: it
//! answers a [`SelectionPlan`] for the rows of a field, or a [`FramePlan`]
//! grouping pieces into frames. Before anything runs, the plan is checked
//! with [`validate_selection`] or [`validate_frames`]. The host (`stowd`)
//! and the guest SDK's test harness (`stowage_guest::testing`) both call
//! these two functions, so a plan that passes the harness is accepted by the
//! host, and a fault reads the same [`PlanError`] message wherever it is
//! found. The `plan_validate` fuzz target drives them too.
//!
//! The types mirror the WIT contract `stowage:policy@0.2.0`
//! (`wit/since_v0.2.0/policy.wit`; 0.1.0 is the same less the seven newer
//! dtypes and [`Description::dtypes`] and [`Description::pure`]); the guest
//! SDK re-exports them and the host converts its wit-bindgen values into
//! them.
//!
//! The crate also holds the dtype table ([`DTYPES`], one row per
//! [`Dtype`]: wire name, WIT case, itemsize, first contract version,
//! aliases), the one list of dtypes the wire codecs, the guest SDK, the
//! host's Wasm runtime and the Python client's tests all read.
//!
//! ```
//! use stowage_plan::{
//!     validate_frames, validate_selection, FieldInfo, FieldKind, Frame, FramePlan, PackLimits,
//!     Piece, PieceInfo, PlanError, RowView, SelectionPlan,
//! };
//!
//! let field = FieldInfo::new(FieldKind::Regular, 10);
//! let plan = SelectionPlan::new(vec![Piece::View(RowView::new(0, 2, 2)), Piece::Gather(vec![9])]);
//! assert_eq!(validate_selection(field, &[0, 2, 9], &plan), Ok(()));
//! let err = validate_selection(field, &[0, 2], &plan).unwrap_err();
//! assert_eq!(err, PlanError::TooManyRows { planned: 3, requested: 2 });
//! assert_eq!(err.to_string(), "plan covers 3 rows or more, 2 were requested");
//!
//! let pieces = [PieceInfo::contiguous(10), PieceInfo::contiguous(10)];
//! let limits = PackLimits { max_frames: 1, max_frame_bytes: 20, small_threshold: 0 };
//! let plan = FramePlan::new(vec![Frame::Coalesced(vec![0, 1])]);
//! assert_eq!(validate_frames(&pieces, &limits, &plan), Ok(()));
//! ```
//!
//! The crate has no dependencies (std only), so it builds for the host and
//! for `wasm32-wasip2` alike and adds nothing to a plugin's build; that is
//! why [`PlanError`]'s `Display` is written by hand rather than derived with
//! `thiserror` (a proc-macro, with `syn`, `quote` and `proc-macro2` behind
//! it).

#![deny(missing_docs)]

mod dtype;
mod rules;

pub use dtype::{Contract, DTYPES, Dtype, DtypeInfo};
pub use rules::{PlanError, validate_frames, validate_selection};

/// What a field is made of (WIT `field-kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FieldKind {
    /// One tensor `[n, ...]`, rows on axis 0.
    Regular,
    /// n rows of different shapes (a jagged tensor).
    Nested,
    /// n plain values (strings, bytes, opaque objects).
    Values,
}

impl FieldKind {
    /// The WIT name of the kind: `regular`, `nested` or `values`.
    pub const fn name(self) -> &'static str {
        match self {
            FieldKind::Regular => "regular",
            FieldKind::Nested => "nested",
            FieldKind::Values => "values",
        }
    }
}

impl std::fmt::Display for FieldKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What selection is planned for: the kind of the field and its number of
/// rows. The rules need nothing else of the field (no bytes, no shapes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FieldInfo {
    /// Kind of the field.
    pub kind: FieldKind,
    /// Number of rows, `n`.
    pub rows: u64,
}

impl FieldInfo {
    /// A field of this kind with `rows` rows.
    pub const fn new(kind: FieldKind, rows: u64) -> Self {
        FieldInfo { kind, rows }
    }
}

/// What a policy can do, as listed in its [`Description`] (WIT
/// `capability`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Capability {
    /// Answers selection plans (the `selection` interface).
    Selection,
    /// Answers frame plans (the `packing` interface).
    Packing,
}

/// Identity of a policy: what its `describe()` answers (WIT `description`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
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
    /// Field kinds it handles (empty: every kind).
    pub kinds: Vec<FieldKind>,
    /// Element types it handles (empty: every dtype; contract 0.2.0).
    pub dtypes: Vec<Dtype>,
    /// True if `select` decides from layout and positions alone and never
    /// reads content: the host may memoize its answers (contract 0.2.0).
    pub pure: bool,
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
            dtypes: Vec::new(),
            pure: false,
        }
    }

    /// Adds a handled dtype (once). With none listed, every dtype is
    /// handled.
    pub fn with_dtype(mut self, dtype: Dtype) -> Self {
        if !self.dtypes.contains(&dtype) {
            self.dtypes.push(dtype);
        }
        self
    }

    /// Declares that only fields of these dtypes are handled: the host
    /// does not ask about others.
    pub fn for_dtypes(self, dtypes: &[Dtype]) -> Self {
        dtypes.iter().fold(self, |d, &t| d.with_dtype(t))
    }

    /// Declares the policy pure: `select` decides from the field's layout
    /// and the positions alone and never calls `read` (a `read` then
    /// traps), and `pack` from the pieces' sizes and the limits alone, so
    /// the host may answer a request it has seen before from memory,
    /// without a call. A policy that keeps state between calls (one that
    /// varies its answer to the same input) must not say so.
    pub fn pure(mut self) -> Self {
        self.pure = true;
        self
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

/// One piece of a selection plan (WIT `piece`).
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

    /// The WIT name of the piece's case (`view`, `gather`, `row-views`,
    /// `concat`), for messages, logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Piece::View(_) => "view",
            Piece::Gather(_) => "gather",
            Piece::RowViews(_) => "row-views",
            Piece::Concat(_) => "concat",
        }
    }

    /// True if the piece applies to a field of this kind: `view` and
    /// `gather` to regular fields, `row-views` to nested and values fields,
    /// `concat` to nested fields.
    pub fn fits(&self, kind: FieldKind) -> bool {
        matches!(
            (self, kind),
            (Piece::View(_) | Piece::Gather(_), FieldKind::Regular)
                | (Piece::RowViews(_), FieldKind::Nested | FieldKind::Values)
                | (Piece::Concat(_), FieldKind::Nested)
        )
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

    /// Number of rows the plan covers (saturating).
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

/// One piece to send, described by size only (WIT `piece-info`).
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

/// Bounds the host sets for one message (WIT `pack-limits`).
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

impl Default for PackLimits {
    /// The host's defaults: 1000 frames, 64 MiB frames, 64 KiB small pieces.
    fn default() -> Self {
        PackLimits {
            max_frames: 1000,
            max_frame_bytes: 64 << 20,
            small_threshold: 64 << 10,
        }
    }
}

/// One frame of a message (WIT `frame`).
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

#[cfg(test)]
mod tests;
