//! A `get_ok` reply's layout from frame 0 alone: where each field's rows lie
//! in which data frame, before the data frames arrive. A receiver that
//! knows this can read each frame's bytes straight into the arrays they
//! belong in (the Python client's Rust core does), checking each range
//! against the frame as it arrives ([`FieldLayout::check_frames`]).

use smallvec::SmallVec;

use crate::batch::Value;
use crate::tensor::Dtype;

use super::{Error, Limits, Op, Reply};

/// The fixed bytes of a regular descriptor as every encoder here writes
/// it (the encoder writes them, the decoder's fast path matches them): the
/// keys in this order, as fixstrs; between them the dtype's name (a
/// fixstr), the shape and the parts (arrays of uints), and each part's
/// four uints.
pub(super) mod canonical {
    /// `{"kind": "regular", "dtype": ` (a map of 4).
    pub const REGULAR: &[u8; 20] = b"\x84\xa4kind\xa7regular\xa5dtype";
    pub const SHAPE: &[u8; 6] = b"\xa5shape";
    pub const PARTS: &[u8; 6] = b"\xa5parts";
    /// A part: `{"frame": ` (a map of 4).
    pub const FRAME: &[u8; 7] = b"\x84\xa5frame";
    pub const OFFSET: &[u8; 7] = b"\xa6offset";
    pub const LEN: &[u8; 4] = b"\xa3len";
    pub const ROWS: &[u8; 5] = b"\xa4rows";
}

/// One part of a regular field: `rows` consecutive rows (in request order)
/// at `offset..offset + len` of data frame `frame` (1-based).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartLayout {
    pub frame: u64,
    pub offset: u64,
    pub len: u64,
    pub rows: u64,
}

/// One row of a nested field: its shape and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowLayout {
    pub shape: Vec<u64>,
    pub frame: u64,
    pub offset: u64,
    pub len: u64,
}

/// A regular field's shape `[n, ...row]`: inline up to 4 dimensions, so
/// decoding a small put's descriptors allocates no shape a field.
pub type Dims = SmallVec<[u64; 4]>;

/// A regular field's parts: inline for the usual one (every field's rows
/// in one data frame), no list a field.
pub type Parts = SmallVec<[PartLayout; 1]>;

/// A field's descriptor, checked in itself (shapes, lengths against the
/// dtype, row sums, limits) but not against the data frames.
#[derive(Clone, Debug, PartialEq)]
pub enum FieldLayout {
    /// `shape[0]` rows; the parts cover them in order.
    Regular {
        dtype: Dtype,
        shape: Dims,
        parts: Parts,
    },
    Nested {
        dtype: Dtype,
        rows: Vec<RowLayout>,
    },
    Values(Vec<Value>),
}

impl FieldLayout {
    /// Number of rows.
    pub fn rows(&self) -> u64 {
        match self {
            FieldLayout::Regular { shape, .. } => shape[0],
            FieldLayout::Nested { rows, .. } => rows.len() as u64,
            FieldLayout::Values(v) => v.len() as u64,
        }
    }

    /// The (frame, offset, len) ranges the field reads.
    pub fn ranges(&self) -> Vec<(u64, u64, u64)> {
        self.each_range().collect()
    }

    /// [`FieldLayout::ranges`], without a list.
    pub fn each_range(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let (parts, rows) = match self {
            FieldLayout::Regular { parts, .. } => (&parts[..], &[][..]),
            FieldLayout::Nested { rows, .. } => (&[][..], &rows[..]),
            FieldLayout::Values(_) => (&[][..], &[][..]),
        };
        (parts.iter().map(|p| (p.frame, p.offset, p.len)))
            .chain(rows.iter().map(|r| (r.frame, r.offset, r.len)))
    }

    /// Bytes the field's ranges hold (0 for values), saturating.
    pub fn bytes(&self) -> u64 {
        self.each_range().fold(0u64, |n, r| n.saturating_add(r.2))
    }
}

/// Checks the ranges of `fields` against the lengths of the data frames
/// that arrived (`frame_lens[i]` is data frame `i + 1`): every range inside
/// its frame, every frame used, as [`super::decode_reply`] checks them.
pub fn check_frames<N: AsRef<str>>(
    fields: &[(N, FieldLayout)],
    frame_lens: &[u64],
) -> Result<(), Error> {
    // Inline for up to 64 data frames: `vec![false; n]` is a zeroed
    // allocation, which glibc serves past its per-thread cache.
    let mut used: smallvec::SmallVec<[bool; 64]> = smallvec::smallvec![false; frame_lens.len()];
    for (name, f) in fields {
        for (frame, offset, len) in f.ranges() {
            let in_field = |e: Error| Error::InField {
                field: name.as_ref().to_owned(),
                inner: Box::new(e),
            };
            if frame == 0 || frame > frame_lens.len() as u64 {
                return Err(in_field(Error::FrameOutOfRange {
                    frame,
                    data_frames: frame_lens.len(),
                }));
            }
            let frame_len = frame_lens[frame as usize - 1];
            if offset.checked_add(len).is_none_or(|end| end > frame_len) {
                return Err(in_field(Error::RangeOutsideFrame {
                    frame,
                    offset,
                    len,
                    frame_len: frame_len as usize,
                }));
            }
            used[frame as usize - 1] = true;
        }
    }
    match used.iter().position(|u| !u) {
        Some(i) => Err(Error::UnusedFrame(i + 1)),
        None => Ok(()),
    }
}

/// The last get_ok body a receiver decoded with
/// [`super::decode_reply_layout_memo`], and its fields: a body byte for
/// byte the same, under the same limits, gives the same fields (reading a
/// body depends on nothing else), so they are cloned instead of read again.
/// Only bodies of regular fields are kept (their descriptors say where the
/// rows lie, which is the same from one micro-batch to the next; nested
/// fields and values differ with the rows), up to
/// [`LayoutMemo::MAX_BODY`] bytes.
///
/// Why: reading a field's descriptor (its name, dtype, shape and parts,
/// each checked) took about 1,100 instructions in the client, a quarter of
/// what a 10-field get's core spends a field (docs/benchmarks.md, "A get's
/// layout from the last").
#[derive(Debug, Default)]
pub struct LayoutMemo {
    body: Vec<u8>,
    limits: Option<Limits>,
    fields: Vec<(std::sync::Arc<str>, FieldLayout)>,
    /// Bodies answered from the memo, for tests and benchmarks.
    hits: u64,
}

impl LayoutMemo {
    /// The largest body kept (a get of 32 regular fields' body is about
    /// 1.5 KiB).
    pub const MAX_BODY: usize = 16 << 10;

    /// The kept fields, if `body` (under `limits`) is the kept body.
    pub(super) fn get(
        &mut self,
        body: &[u8],
        limits: &Limits,
    ) -> Option<Vec<(std::sync::Arc<str>, FieldLayout)>> {
        if self.limits.as_ref() != Some(limits) || self.body != body {
            return None;
        }
        self.hits += 1;
        Some(self.fields.clone())
    }

    /// Keeps `body`, read under `limits` into `fields`, for the next
    /// (replacing what was kept), if it is small and every field regular;
    /// else forgets what was kept.
    pub(super) fn keep(
        &mut self,
        body: &[u8],
        limits: &Limits,
        fields: &[(std::sync::Arc<str>, FieldLayout)],
    ) {
        let regular = fields
            .iter()
            .all(|(_, f)| matches!(f, FieldLayout::Regular { .. }));
        self.body.clear();
        self.fields.clear();
        if !regular || body.len() > Self::MAX_BODY {
            self.limits = None;
            return;
        }
        self.body.extend_from_slice(body);
        self.fields.extend_from_slice(fields);
        self.limits = Some(*limits);
    }

    /// How many bodies were answered from the memo.
    pub fn hits(&self) -> u64 {
        self.hits
    }
}

/// A reply from frame 0: a `get_ok`'s layout, or any other reply whole.
/// A `get_ok`'s field names are this thread's shared names
/// ([`crate::names::shared_name`]): a get's fields are named again and
/// again, and a `String` a field of every reply was an allocation and a
/// free each (past glibc's per-thread cache for a get of many fields).
#[derive(Clone, Debug, PartialEq)]
pub enum ReplyLayout {
    GetOk(Vec<(std::sync::Arc<str>, FieldLayout)>),
    Other(Reply),
}

/// A request's frame 0 for a sender that lays out its data frames itself
/// (the Python client: a put's large rows go from the caller's arrays, its
/// small ones coalesced as it chooses), written by
/// [`super::encode_request_head`].
#[derive(Clone, Debug, PartialEq)]
pub enum RequestHead {
    /// A put whose fields are described by where their rows lie in the data
    /// frames that follow.
    Put {
        global_indexes: Vec<u64>,
        /// The names shared ([`crate::names::shared_name`] where the
        /// sender reads them again and again): a put's names are not
        /// allocated and freed a field a request.
        fields: Vec<(std::sync::Arc<str>, FieldLayout)>,
    },
    /// A get whose indexes are written as a list whatever their runs: for a
    /// `stowd` from before ranges (protocol page, "Versioning").
    GetList {
        global_indexes: Vec<u64>,
        fields: Vec<String>,
    },
    /// Any request without data frames, as [`super::encode_request`]
    /// writes it.
    Other(Op),
}
