//! `stowage/1`, the native protocol of `stowd`: pure encode and decode of
//! multipart messages, no I/O.
//!
//! The specification is the protocol page (`protocol-stowage1.md`); this
//! module is its reference implementation. A message is a list of ZeroMQ
//! frames: frame 0 is a msgpack envelope
//! `{"proto": "stowage/1", "op", "id", "body"}`, frames 1..n carry tensor
//! bytes that the body's field descriptors point into by (frame, offset,
//! len), so several tensors may share one frame.
//!
//! | side | decode | encode |
//! |---|---|---|
//! | server (`stowd`) | [`decode_extras_and_body`] then [`decode_request_at`], or [`decode_request`] (+ [`request_id`] for error replies) | [`encode_reply`], [`encode_reply_with`] |
//! | Rust client (tests, the router) | [`decode_reply`] | [`encode_request`], [`encode_request_with`] |
//! | Python client (`stowage._core`) | [`decode_reply_layout_memo`] (a get's reply), [`decode_reply_layout`], [`decode_extras`] | [`encode_request_head`], [`with_extras`] |
//!
//! Fields travel as a [`WireField`]: a regular tensor as [`RegularParts`]
//! (its rows in one or more contiguous byte ranges), a nested tensor as one
//! tensor per row, plain values inline in frame 0. Where the rows of a
//! field go in the data frames is a [`FrameLayout`]: the default puts every
//! part or nested row in its own frame with no copy; a packing policy's plan
//! can coalesce small rows into shared frames instead.
//!
//! Zero copy, both ways: decoded tensors and `bin` values are `Bytes` slices
//! of the received frames; an encoded data frame that holds exactly one
//! contiguous range *is* that range (a slice of the stored buffer), and only
//! frames that concatenate several ranges are copied.
//!
//! Hostile input: decoding never panics, never allocates from a declared
//! size before checking it against the bytes that remain and the
//! [`Limits`], and rejects everything the protocol page calls invalid.
//! Encoders check only what they need to write a well-formed message with a
//! consistent layout; the receiver enforces the rest (row counts, empty
//! batches, duplicate indexes).

use std::sync::Arc;

use bytes::Bytes;

pub use crate::indexes::{IndexRun, Indexes};
use crate::tensor::{Dtype, TensorError};

mod decode;
mod encode;
mod field;
pub mod layout;
use crate::msgpack;
#[cfg(test)]
mod tests;

pub use field::{PartBytes, RegularParts, WireField};
pub use layout::{
    Dims, FieldLayout, LayoutMemo, PartLayout, Parts, ReplyLayout, RequestHead, RowLayout,
};

/// The value of the envelope's `proto` key.
pub const PROTO: &str = "stowage/1";

/// Most dimensions a shape may have.
pub const MAX_DIMS: usize = 64;

/// The error codes of an `error` reply.
pub mod code {
    /// Undecodable or inconsistent request.
    pub const BAD_REQUEST: &str = "bad_request";
    /// A requested (global index, field) is not stored.
    pub const KEY_NOT_FOUND: &str = "key_not_found";
    /// The put would exceed the unit's capacity.
    pub const CAPACITY: &str = "capacity";
    /// A requested (global index, field) was written or cleared after the
    /// checkpoint this stowd was restored from: its value is lost.
    pub const DATA_LOST: &str = "data_lost";
    /// The message exceeds a receiver limit.
    pub const TOO_LARGE: &str = "too_large";
    /// A policy chain with the `reject` fail strategy refused the request.
    pub const REJECTED: &str = "rejected";
    /// Unknown `proto` or `op`, or a get of rows that one descriptor cannot
    /// carry (one field mixing tensors and values, or dtypes).
    pub const UNSUPPORTED: &str = "unsupported";
    /// A bug or an unexpected failure on the replying side.
    pub const INTERNAL: &str = "internal";
    /// Every code, in the order of the protocol page.
    pub const ALL: [&str; 8] = [
        BAD_REQUEST,
        KEY_NOT_FOUND,
        CAPACITY,
        DATA_LOST,
        TOO_LARGE,
        REJECTED,
        UNSUPPORTED,
        INTERNAL,
    ];
}

/// Receiver limits, checked before anything is allocated from a declared
/// size. A violation is an [`Error::TooLarge`] (`too_large`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most global indexes in a request, and rows, parts or values in a field.
    pub max_rows: u64,
    /// Most fields in a put, get or get_ok (and entries in a stats map).
    pub max_fields: u64,
    /// Most frames in a message, frame 0 included.
    pub max_frames: u64,
    /// Most bytes in a message, all frames together.
    pub max_message_bytes: u64,
}

impl Limits {
    /// The defaults: 2^20 rows, 1,024 fields, 2^20 frames, 8 GiB.
    pub const DEFAULT: Limits = Limits {
        max_rows: 1 << 20,
        max_fields: 1024,
        max_frames: 1 << 20,
        max_message_bytes: 8 << 30,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// Why a message could not be decoded or encoded. [`Error::code`] gives the
/// code of the `error` reply; [`Reply::from_error`] builds that reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The message is empty (not even frame 0).
    #[error("message has no frames")]
    NoFrames,
    /// Frame 0 is not well-formed msgpack: truncated, reserved marker, bad
    /// UTF-8, a count larger than the bytes left, nesting deeper than 32,
    /// trailing bytes.
    #[error("malformed msgpack at byte {offset} of frame 0: {reason}")]
    Malformed { offset: usize, reason: &'static str },
    /// A required key is missing.
    #[error("{map} has no key {key:?}")]
    MissingKey {
        map: &'static str,
        key: &'static str,
    },
    /// A key that this map (or this descriptor kind) does not have.
    #[error("{map} has an unexpected key {key:?}")]
    UnknownKey { map: &'static str, key: String },
    /// A key appears twice in one map.
    #[error("{map} has the key {key:?} twice")]
    DuplicateKey { map: &'static str, key: String },
    /// A value has the wrong msgpack type (a negative integer where a count is expected, too).
    #[error("{key} must be {expected}")]
    WrongType {
        key: &'static str,
        expected: &'static str,
    },
    /// The envelope's `proto` is not `stowage/1`.
    #[error("unsupported protocol {0:?}; this end speaks stowage/1")]
    UnsupportedProto(String),
    /// The `op` is not one this side decodes.
    #[error("unsupported op {0:?}")]
    UnknownOp(String),
    /// A descriptor `kind` other than regular, nested, values.
    #[error("unknown descriptor kind {0:?} (regular, nested or values)")]
    UnknownKind(String),
    /// A dtype name [`Dtype::from_name`] does not know.
    #[error("unknown dtype {0:?}")]
    UnknownDType(String),
    /// A shape with more than [`MAX_DIMS`] dimensions.
    #[error("shape has {0} dimensions, at most 64 are allowed")]
    TooManyDims(usize),
    /// A shape without a row axis (regular), or whose byte size overflows.
    #[error("bad shape {shape:?}: {reason}")]
    BadShape {
        shape: Vec<u64>,
        reason: &'static str,
    },
    /// A descriptor names frame 0 or a frame past the last one.
    #[error(
        "frame {frame} does not exist (the message has {data_frames} data frames, numbered from 1)"
    )]
    FrameOutOfRange { frame: u64, data_frames: usize },
    /// A byte range does not fit inside its frame.
    #[error("bytes {offset}..+{len} lie outside frame {frame} ({frame_len} bytes)")]
    RangeOutsideFrame {
        frame: u64,
        offset: u64,
        len: u64,
        frame_len: usize,
    },
    /// A range's `len` is not what its rows and shape need.
    #[error("range of {len} bytes, the shape needs {expected}")]
    LengthMismatch { len: u64, expected: u128 },
    /// A regular part with 0 rows.
    #[error("a part has 0 rows")]
    EmptyPart,
    /// The parts' rows do not add up to `shape[0]`.
    #[error("parts hold {parts} rows or more, the shape says {rows}")]
    RowSum { parts: u64, rows: u64 },
    /// A field's row count differs from the number of global indexes (in a
    /// get_ok: from the other fields).
    #[error("field has {rows} rows, the batch has {expected}")]
    RowCount { rows: u64, expected: u64 },
    /// A put names one global index twice.
    #[error("global index {0} appears twice in a put")]
    DuplicateIndex(u64),
    /// A field name appears twice (put, get, clear or get_ok).
    #[error("field {0:?} is named twice")]
    DuplicateField(String),
    /// A data frame that no descriptor points into.
    #[error("data frame {0} is not referenced by any descriptor")]
    UnusedFrame(usize),
    /// A put or get without global indexes or without fields.
    #[error("empty batch: {0}")]
    EmptyBatch(&'static str),
    /// A count or size above a [`Limits`] bound.
    #[error(
        "{what} is {value}, the limit is {limit} ([limits] {})",
        limit_setting(what)
    )]
    TooLarge {
        what: &'static str,
        value: u64,
        limit: u64,
    },
    /// An error inside the descriptor of one field.
    #[error("field {field:?}: {inner}")]
    InField { field: String, inner: Box<Error> },
    /// Encoder side: the rows of one field mix tensors and values, or
    /// dtypes, so no single descriptor can carry them (`unsupported`).
    #[error("cannot send field: {0}")]
    MixedField(String),
    /// Encoder side: the data cannot be written (mixed dtypes, invalid
    /// opaque msgpack, lengths above 2^32-1).
    #[error("cannot encode: {0}")]
    Unencodable(String),
    /// Encoder side: a [`FrameLayout`] that misses, repeats or misnames rows.
    #[error("invalid frame layout: {0}")]
    Layout(String),
    /// A `{"ranges": ...}` form of global indexes with an empty range or
    /// one past the largest index.
    #[error("global_indexes: {0}")]
    BadRange(crate::indexes::RunsError),
    /// A tensor could not be built (a bug: lengths are checked before).
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

impl From<msgpack::MsgpackError> for Error {
    fn from(e: msgpack::MsgpackError) -> Self {
        match e {
            msgpack::MsgpackError::Malformed { offset, reason } => {
                Error::Malformed { offset, reason }
            }
            msgpack::MsgpackError::WrongType { key, expected } => {
                Error::WrongType { key, expected }
            }
        }
    }
}

impl From<msgpack::TooLong> for Error {
    fn from(e: msgpack::TooLong) -> Self {
        Error::Unencodable(e.to_string())
    }
}

/// The stowd configuration key of the [`Limits`] bound a count was checked
/// against, named in [`Error::TooLarge`] messages.
fn limit_setting(what: &str) -> &'static str {
    match what {
        "fields" | "stats" => "max_fields",
        "segments" | "frames" => "max_request_frames",
        "message bytes" => "max_request_bytes",
        _ => "max_rows",
    }
}

impl Error {
    /// The error code of the `error` reply for this error (see [`code`]).
    pub fn code(&self) -> &'static str {
        match self {
            Error::UnsupportedProto(_) | Error::UnknownOp(_) | Error::MixedField(_) => {
                code::UNSUPPORTED
            }
            Error::TooLarge { .. } => code::TOO_LARGE,
            Error::Unencodable(_) | Error::Layout(_) | Error::Tensor(_) => code::INTERNAL,
            Error::InField { inner, .. } => inner.code(),
            _ => code::BAD_REQUEST,
        }
    }

    /// The error itself, without the field it was found in.
    pub fn root(&self) -> &Error {
        match self {
            Error::InField { inner, .. } => inner.root(),
            other => other,
        }
    }

    fn in_field(self, field: &str) -> Error {
        Error::InField {
            field: field.to_owned(),
            inner: Box::new(self),
        }
    }
}

/// A decoded request: the client's id (echoed in the reply) and the op.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Chosen by the client; the reply carries the same id. Clients number
    /// from 1: id 0 answers a request whose id could not be read.
    pub id: u64,
    pub op: Op,
}

/// A request's operation and body.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Store one row per global index for each field (overwriting).
    Put {
        global_indexes: Vec<u64>,
        /// The names shared (`crate::names::shared_name` when decoded).
        fields: Vec<(Arc<str>, WireField)>,
    },
    /// Fetch the rows of `fields` for `global_indexes`, in that order.
    Get {
        global_indexes: Indexes,
        fields: Vec<String>,
    },
    /// Drop the rows of `global_indexes` (only of `fields`, if given).
    Clear {
        global_indexes: Vec<u64>,
        fields: Option<Vec<String>>,
    },
    /// Report the unit's counters.
    Stats,
    /// Same node only: create a shared-memory segment of `bytes` bytes for
    /// the client to fill and name in a put's `segments`.
    Lease { bytes: u64 },
    /// Same node only: where the client connects its descriptor channel
    /// (the Unix socket stowd hands shared-memory descriptors over).
    Channel,
    /// Write every local unit's rows to the checkpoint directory `dir` (an
    /// absolute path on stowd's machine). `journal` (the default; the body
    /// key `journal`, a bool, may say `false`): stowd journals the indexes
    /// changed after it in `dir`, and a restore marks those lost. Without:
    /// a snapshot, restored as it was written, whatever changed since.
    Checkpoint { dir: String, journal: bool },
    /// Replace every local unit's rows with the last checkpoint in `dir`.
    Restore { dir: String },
    /// Peers: the version of each (field, index) in the unit the envelope's
    /// `unit` names (a small reply: 8 bytes per row and field).
    Versions {
        global_indexes: Indexes,
        fields: Vec<String>,
    },
}

impl Op {
    /// The `op` string of this request.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Put { .. } => "put",
            Op::Get { .. } => "get",
            Op::Clear { .. } => "clear",
            Op::Stats => "stats",
            Op::Lease { .. } => "lease",
            Op::Channel => "channel",
            Op::Checkpoint { .. } => "checkpoint",
            Op::Restore { .. } => "restore",
            Op::Versions { .. } => "versions",
        }
    }
}

/// One value of a `stats_ok` map: a scalar, or a list or map of them
/// (a plugin's counters, a chain's policy lists). Nesting is at most
/// [`STATS_MAX_DEPTH`] levels deep.
#[derive(Clone, Debug, PartialEq)]
pub enum Stat {
    Int(i64),
    Float(f64),
    Str(String),
    Bool(bool),
    List(Vec<Stat>),
    Map(Vec<(String, Stat)>),
}

/// Deepest nesting of lists and maps inside one stats value.
pub const STATS_MAX_DEPTH: usize = 4;

impl Stat {
    /// An unsigned count (saturating at `i64::MAX`).
    pub fn count(v: u64) -> Stat {
        Stat::Int(v.min(i64::MAX as u64) as i64)
    }

    /// A list of strings.
    pub fn strs<S: AsRef<str>>(values: &[S]) -> Stat {
        Stat::List(
            values
                .iter()
                .map(|s| Stat::Str(s.as_ref().into()))
                .collect(),
        )
    }

    /// The entry `key` of a map value.
    pub fn get(&self, key: &str) -> Option<&Stat> {
        match self {
            Stat::Map(m) => m.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Stat::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Stat::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Stat::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The strings of a list value (None if it is not a list of strings).
    pub fn as_strs(&self) -> Option<Vec<&str>> {
        match self {
            Stat::List(l) => l.iter().map(Stat::as_str).collect(),
            _ => None,
        }
    }
}

/// A reply (the id travels beside it: see [`encode_reply`], [`decode_reply`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// The put stored `rows` rows (per field).
    PutOk { rows: u64 },
    /// The requested fields, each with one row per requested index, in
    /// request order. A server builds each field with
    /// [`WireField::from_cells`] from the stored cells.
    GetOk { fields: Vec<(String, WireField)> },
    /// `cleared` (global index, field) values were dropped.
    ClearOk { cleared: u64 },
    /// Counters, in the order the server lists them.
    StatsOk(Vec<(String, Stat)>),
    /// A leased segment: its name (its writable descriptor went over the
    /// client's channel under this name), its size, and how long the lease
    /// lasts before an unused segment is dropped.
    LeaseOk {
        segment: String,
        bytes: u64,
        ttl_ms: u64,
    },
    /// The path of the Unix socket to connect a descriptor channel to.
    ChannelOk { path: String },
    /// Checkpoint `seq` of `dir` is written: `rows` (index, field) values,
    /// `bytes` of them, in `files` files.
    CheckpointOk {
        dir: String,
        seq: u64,
        rows: u64,
        bytes: u64,
        files: u64,
    },
    /// Checkpoint `seq` of `dir` is restored: `rows` values loaded, `lost`
    /// indexes marked lost (written or cleared after the checkpoint).
    RestoreOk {
        dir: String,
        seq: u64,
        rows: u64,
        lost: u64,
    },
    /// The versions a `versions` request asked for, field-major
    /// (`versions[f * rows + i]`), 0 for a row that is not stored, and the
    /// unit's incarnation: a row is unchanged while both are.
    VersionsOk {
        incarnation: u64,
        versions: Vec<u64>,
    },
    /// The request failed; `code` is one of [`code::ALL`] (a client treats
    /// any other code as `internal`).
    Error { code: String, message: String },
}

impl Reply {
    /// The `op` string of this reply.
    pub fn name(&self) -> &'static str {
        match self {
            Reply::PutOk { .. } => "put_ok",
            Reply::GetOk { .. } => "get_ok",
            Reply::ClearOk { .. } => "clear_ok",
            Reply::StatsOk(_) => "stats_ok",
            Reply::LeaseOk { .. } => "lease_ok",
            Reply::ChannelOk { .. } => "channel_ok",
            Reply::CheckpointOk { .. } => "checkpoint_ok",
            Reply::RestoreOk { .. } => "restore_ok",
            Reply::VersionsOk { .. } => "versions_ok",
            Reply::Error { .. } => "error",
        }
    }

    /// The `error` reply for a decode (or encode) error.
    pub fn from_error(err: &Error) -> Reply {
        Reply::Error {
            code: err.code().to_owned(),
            message: err.to_string(),
        }
    }
}

/// Rows `start..end` of the field at index `field` of the message's field
/// list (the put's `fields`, or the get_ok's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowSlice {
    pub field: usize,
    pub start: u64,
    pub end: u64,
}

/// Where tensor rows go: data frame `k` (numbered from 1) is the
/// concatenation, in order, of the rows named by `frames[k - 1]`.
///
/// Every row of every tensor field must appear exactly once; value fields
/// never appear (they travel in frame 0). A frame made of one slice that
/// lies inside one stored byte range is sent without a copy; any other frame
/// is one allocation and one copy, with each range padded (zeros) to start
/// at a multiple of its dtype's itemsize. Rows of a regular field that end
/// up adjacent, in order, in one frame are described as a single part.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FrameLayout {
    pub frames: Vec<FrameSlices>,
}

/// The slices of one data frame: inline for the usual frame of one slice
/// (a field's part), so a get's layout makes no list a frame.
pub type FrameSlices = smallvec::SmallVec<[RowSlice; 1]>;

impl FrameLayout {
    /// The zero-copy layout: one frame per part of each regular field and
    /// one per row of each nested field. For a get_ok built from stored
    /// cells that is one frame per tensor row.
    pub fn one_per_piece<N>(fields: &[(N, WireField)]) -> FrameLayout {
        let mut frames = Vec::new();
        for (i, (_, field)) in fields.iter().enumerate() {
            let mut push = |start: u64, end: u64| {
                frames.push(smallvec::smallvec![RowSlice {
                    field: i,
                    start,
                    end,
                }])
            };
            match field {
                WireField::Regular(p) => {
                    let mut start = 0;
                    for &(_, rows) in p.parts() {
                        push(start, start + rows);
                        start += rows;
                    }
                }
                WireField::Nested(rows) => (0..rows.len() as u64).for_each(|r| push(r, r + 1)),
                WireField::Values(_) => {}
            }
        }
        FrameLayout { frames }
    }
}

/// Decodes a request (server side). On error, reply with
/// [`Reply::from_error`] under the id from [`request_id`] (0 if none).
pub fn decode_request(frames: &[Bytes], limits: &Limits) -> Result<Request, Error> {
    decode::request(frames, limits, None)
}

/// [`decode_request`] of a message whose extras were read with
/// [`decode_extras_and_body`], which found where frame 0's body lies: the
/// envelope is read again, its body is not walked twice. The same request
/// or error as [`decode_request`]; `body` from another frame 0 is ignored.
pub fn decode_request_at(
    frames: &[Bytes],
    limits: &Limits,
    body: &BodyAt,
) -> Result<Request, Error> {
    let at = frames.first().and_then(|f0| body.of(f0));
    decode::request(frames, limits, at)
}

/// Decodes a reply's frame 0 alone (client side): the echoed request id
/// and, for a `get_ok`, where each field's rows lie in the data frames
/// still to come ([`layout`]); any other reply whole.
pub fn decode_reply_layout(frame0: &Bytes, limits: &Limits) -> Result<(u64, ReplyLayout), Error> {
    decode::reply_layout(frame0, limits)
}

/// [`decode_reply_layout`] for a receiver that gets replies of the same
/// shape again and again (a trainer asking for its micro-batch): a get_ok
/// whose body is byte for byte the one `memo` kept gives the memo's fields,
/// not read again ([`LayoutMemo`]).
pub fn decode_reply_layout_memo(
    frame0: &Bytes,
    limits: &Limits,
    memo: &mut LayoutMemo,
) -> Result<(u64, ReplyLayout), Error> {
    decode::reply_layout_memo(frame0, limits, Some(memo))
}

/// Decodes a reply (client side): the echoed request id and the reply.
pub fn decode_reply(frames: &[Bytes], limits: &Limits) -> Result<(u64, Reply), Error> {
    decode::reply(frames, limits)
}

/// The envelope's `id`, if it can be read, even from a message that
/// [`decode_request`] refuses.
pub fn request_id(frames: &[Bytes]) -> Option<u64> {
    decode::id(frames.first()?)
}

/// Encodes a request with [`FrameLayout::one_per_piece`].
pub fn encode_request(request: &Request) -> Result<Vec<Bytes>, Error> {
    encode::request(request, None)
}

/// Encodes a request with a caller-supplied layout of the put's fields
/// (an op without fields takes an empty layout).
pub fn encode_request_with(request: &Request, layout: &FrameLayout) -> Result<Vec<Bytes>, Error> {
    encode::request(request, Some(layout))
}

/// A get's indexes as [`encode_get_head`] writes them.
#[derive(Clone, Copy, Debug)]
pub enum GetIndexes<'a> {
    /// As [`Op::Get`] writes them: as ranges where that is shorter.
    Runs(&'a Indexes),
    /// As the list (as [`RequestHead::GetList`] writes them).
    List(&'a [u64]),
}

/// Frame 0 of a get of `fields` at `global_indexes`: the bytes
/// [`encode_request_head`] writes for the same [`Op::Get`] (or
/// [`RequestHead::GetList`]), from borrowed names (a client asks with the
/// names it keeps to check the reply).
pub fn encode_get_head<S: AsRef<str>>(
    id: u64,
    global_indexes: GetIndexes<'_>,
    fields: &[S],
) -> Result<Bytes, Error> {
    encode::get_head(id, global_indexes, fields)
}

/// Encodes frame 0 of a request whose data frames the caller sends as it
/// laid them out (client side; see [`RequestHead`]).
pub fn encode_request_head(id: u64, head: &RequestHead) -> Result<Bytes, Error> {
    encode::request_head(id, head)
}

/// A message whose data frames may each be gathered from several buffers:
/// frame `k` is the next `per_frame[k]` of `parts`, back to back (one part
/// per frame where `per_frame` is `None`). The sender writes the parts with
/// vectored writes; on the wire it is an ordinary message.
#[derive(Clone, Debug, PartialEq)]
pub struct Gathered {
    pub parts: Vec<Bytes>,
    pub per_frame: Option<Vec<u32>>,
}

impl Gathered {
    /// The frames, each joined into one buffer (a copy where a frame has
    /// several parts; for tests and receivers of an encoded message).
    pub fn joined(&self) -> Vec<Bytes> {
        let Some(per_frame) = &self.per_frame else {
            return self.parts.clone();
        };
        let mut out = Vec::with_capacity(per_frame.len());
        let mut at = 0usize;
        for &n in per_frame {
            let parts = &self.parts[at..at + n as usize];
            out.push(match parts {
                [one] => one.clone(),
                many => Bytes::from(many.concat()),
            });
            at += n as usize;
        }
        out
    }
}

/// Encodes a request like [`encode_request_with`], except that a frame
/// of several ranges is not copied into one buffer but sent as its ranges
/// ([`Gathered`]).
pub fn encode_request_gathered(request: &Request, layout: &FrameLayout) -> Result<Gathered, Error> {
    encode::request_gathered(request, Some(layout))
}

/// Encodes a get_ok like [`encode_reply_joined`], except that a frame of
/// several ranges not back to back is sent as its ranges ([`Gathered`]),
/// not copied into one buffer.
pub fn encode_reply_gathered(
    id: u64,
    reply: &Reply,
    layout: &FrameLayout,
    span: &dyn Fn(*const u8, usize) -> Option<Bytes>,
) -> Result<Gathered, Error> {
    encode::reply_gathered(id, reply, Some(layout), Some(span))
}

/// Frame 0 of a get_ok whose data frames the sender lays out and sends
/// itself, `fields` saying where each field's rows lie in them (a router
/// forwarding a peer unit's rows while they arrive): what
/// [`decode_reply_layout`] reads back.
pub fn encode_get_ok_head<N: AsRef<str>>(
    id: u64,
    fields: &[(N, FieldLayout)],
) -> Result<Bytes, Error> {
    encode::get_ok_head(id, fields)
}

/// Encodes a reply with [`FrameLayout::one_per_piece`].
pub fn encode_reply(id: u64, reply: &Reply) -> Result<Vec<Bytes>, Error> {
    encode::reply(id, reply, None, None, None)
}

/// Encodes a reply whose data frames are whole buffers: each range lies in
/// the buffer `enclose` finds for it (returned with the range's offset in
/// it), one frame per buffer, descriptors at their offsets there (server
/// side, same node: one segment entry per segment however many rows).
pub fn encode_reply_enclosed(
    id: u64,
    reply: &Reply,
    enclose: &dyn Fn(&Bytes) -> Option<(Bytes, u64)>,
) -> Result<Vec<Bytes>, Error> {
    encode::reply(id, reply, None, None, Some(enclose))
}

/// Encodes a reply with a caller-supplied layout of the get_ok's fields (for
/// example a packing policy's plan that coalesces small rows).
pub fn encode_reply_with(
    id: u64,
    reply: &Reply,
    layout: &FrameLayout,
) -> Result<Vec<Bytes>, Error> {
    encode::reply(id, reply, Some(layout), None, None)
}

/// [`encode_reply_with`], except that a frame of several ranges that lie
/// back to back in memory, inside one buffer that `span(start, len)` returns
/// a slice of, is sent as that slice instead of a copy (server side: rows
/// stored from one received frame and packed into one frame in their
/// original order).
pub fn encode_reply_joined(
    id: u64,
    reply: &Reply,
    layout: &FrameLayout,
    span: &dyn Fn(*const u8, usize) -> Option<Bytes>,
) -> Result<Vec<Bytes>, Error> {
    encode::reply(id, reply, Some(layout), Some(span), None)
}

/// Parses a dtype name as the protocol allows (see [`Dtype::from_name`]).
fn dtype_from_name(name: &str) -> Result<Dtype, Error> {
    Dtype::from_name(name).ok_or_else(|| Error::UnknownDType(name.to_owned()))
}

/// Shared-memory keys an envelope may carry besides `proto`, `op`, `id` and
/// `body` (same-node clients only; see the protocol page).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Extras {
    /// `segments`: data frame `k` (from 1) is not sent over the socket; it
    /// is bytes `offset..offset + len` of the named segment.
    pub segments: Option<Vec<(String, u64, u64)>>,
    /// `same_node`: the client asks for the reply's data as segments.
    pub same_node: bool,
    /// `channel`: the token of the client's descriptor channel, over which
    /// the descriptors of a same-node reply's segments (or of a lease) go.
    pub channel: Option<String>,
    /// `unit` (peers): the request is for this stowd's local unit number
    /// `unit` alone: no routing, and a put is stored as it arrives.
    pub unit: Option<u64>,
    /// `with_versions` (peers, on a get): the get_ok carries each row's
    /// version in its envelope ([`Extras::versions`]).
    pub with_versions: bool,
    /// `incarnation` and `versions` (a get_ok's envelope, when asked):
    /// the unit's incarnation and each returned row's version, laid out
    /// as [`Reply::VersionsOk`]'s.
    pub versions: Option<(u64, Vec<u64>)>,
}

/// Reads the shared-memory keys of an envelope (frame 0). Other keys are
/// left to [`decode_request`] / [`decode_reply`].
pub fn decode_extras(frame0: &[u8], limits: &Limits) -> Result<Extras, Error> {
    decode::extras(frame0, limits).map(|(extras, _)| extras)
}

/// [`decode_extras`], and where the envelope's body lies in `frame0`, for
/// [`decode_request_at`].
pub fn decode_extras_and_body(frame0: &[u8], limits: &Limits) -> Result<(Extras, BodyAt), Error> {
    let (extras, body) = decode::extras(frame0, limits)?;
    let frame = (frame0.as_ptr() as usize, frame0.len());
    Ok((extras, BodyAt(body.map(|b| (frame, b)))))
}

/// Where the value of an envelope's first `body` key lies in the frame 0
/// it was read from ([`decode_extras_and_body`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BodyAt(Option<((usize, usize), std::ops::Range<usize>)>);

impl BodyAt {
    /// The body's range, if it was found in `frame0` (the same bytes: same
    /// address and length).
    fn of(&self, frame0: &[u8]) -> Option<&std::ops::Range<usize>> {
        let (frame, body) = self.0.as_ref()?;
        (*frame == (frame0.as_ptr() as usize, frame0.len())).then_some(body)
    }
}

/// Frame 0 with a `segments` key added: a copy of `frame0` whose envelope
/// map has one more entry. `frame0` must come from [`encode_reply`] or
/// [`encode_request`].
pub fn with_segments(frame0: &[u8], segments: &[(String, u64, u64)]) -> Result<Bytes, Error> {
    encode::with_segments(frame0, segments)
}

/// Frame 0 with the keys `incarnation` and `versions` added (a peer's
/// get_ok; see [`Extras::versions`]). `frame0` must come from
/// [`encode_reply`] or its variants.
pub fn with_versions(frame0: &[u8], incarnation: u64, versions: &[u64]) -> Result<Bytes, Error> {
    encode::with_versions(frame0, incarnation, versions)
}

/// Frame 0 with the keys `extras` sets added to its envelope (see
/// [`with_segments`]).
pub fn with_extras(frame0: &[u8], extras: &Extras) -> Result<Bytes, Error> {
    encode::with_extras(frame0, extras)
}
