//! TransferQueue 0.1.11 storage-unit messages: types, errors, and the
//! decoders ([`decode_request`], [`decode_message`], [`decode_reply`]) and
//! encoders ([`encode_reply`], [`encode_request`]) for them.
//!
//! A message is a multipart: frame 0 is a msgpack map `{request_type,
//! sender_id, receiver_id, request_id, timestamp, body}` and frames 1.. are
//! raw tensor bytes referenced from the body by absolute frame index. Tensors
//! travel as msgpack ext 3 whose payload is a pickle of `(dtype, shape,
//! frame_index)`, nested tensors as ext 4, numpy arrays as ext 5 `(numpy
//! dtype str, shape, frame_index)`; see `shared/protocols/transferqueue.md`.
//!
//! A PUT field is stored as `SimpleStorageUnit` stores it, one row per
//! index: a regular tensor's rows and a list of tensors (nested field) as
//! zero-copy tensors over the received frames; anything else per row as a
//! value. A value with arrays inside (a per-row numpy array, a tensor in a
//! list or dict or among `None`s, a nested tensor as a row) is kept in an
//! *inlined* form, its arrays' bytes copied once inside it, and written back
//! with a fresh frame per array (`framed`). A whole field sent as one numpy
//! array gives the rows numpy's iteration gives: (n-1)-d arrays, or for a
//! 1-d array numpy scalars, which TransferQueue's encoder sends as ext 1
//! pickles and `numpy` writes byte for byte as numpy 2.x pickles them. A
//! whole field sent as a pickled 1-d numpy object array (ext 1) gives its
//! items (str, int, float, bool, None, bytes), as msgspec writes them; any
//! other pickle as a whole field is refused (stowd does not unpickle). A
//! whole field sent as a TensorDict (`{"__tq_tensordict__": true, ...}`,
//! tensors and nested TensorDicts) gives one TensorDict per row, as the
//! unit encodes `td[i]` (inlined).
//!
//! Decoding follows the real `SimpleStorageUnit`: anything that fails while
//! the Python side would still be decoding the message (bad msgpack, unknown
//! `request_type`, an ext 3 whose frame does not fit its dtype and shape, ...)
//! is *undecodable* and answered `PUT_GET_ERROR` with a message starting
//! `undecodable request: `; problems with the body of a decoded request are
//! answered with that operation's error reply (`PUT_ERROR`, `GET_ERROR`,
//! `CLEAR_DATA_ERROR`). [`Error::reply_type`] and [`Error::to_reply`] say which.
//!
//! Everything here is pure: no sockets, no I/O. Tensors are built over the
//! received frames and encoded data frames are slices of stored tensors, so
//! neither direction copies tensor bytes.

mod decode;
mod encode;
mod framed;
mod numpy;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::batch::{Cell, Field};
use crate::pickle::PickleError;
use crate::tensor::TensorError;

pub use decode::{decode_message, decode_message_with, decode_reply, decode_request, request_type};
pub use encode::{encode_reply, encode_reply_stamped, encode_request, encode_request_stamped};

/// Receiver limits of a unit or router endpoint (stowd's `[limits]`),
/// checked when a count is read, before the entries it counts are decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most global indexes in a PUT, GET or CLEAR_DATA (`max_rows`).
    pub max_rows: u64,
    /// Most fields in a PUT or GET (`max_fields`).
    pub max_fields: u64,
}

impl Limits {
    /// No limit: what [`decode_message`] applies.
    pub const NONE: Limits = Limits {
        max_rows: u64::MAX,
        max_fields: u64::MAX,
    };
}

/// Frame 0 of the pickle fallback form `[b"\xc1\xfe\xed", pickle]`.
pub const PICKLE_FALLBACK_SENTINEL: &[u8] = b"\xc1\xfe\xed";

/// Marker that a `GET_ERROR` means "the key is gone" (the message starts
/// with `[TQKeyNotFound] `).
pub const KEY_NOT_FOUND_MARKER: &str = "TQKeyNotFound";

/// Every `ZMQRequestType` of transferqueue 0.1.11 as (wire value, member
/// name). The unit counts arrivals by member name (`PUT_DATA`, not `PUT`) and
/// names the member in `PUT_GET_OPERATION_ERROR` messages.
const REQUEST_TYPES: &[(&str, &str)] = &[
    ("HANDSHAKE", "HANDSHAKE"),
    ("HANDSHAKE_ACK", "HANDSHAKE_ACK"),
    ("REQUEST_ERROR", "REQUEST_ERROR"),
    ("GET", "GET_DATA"),
    ("PUT", "PUT_DATA"),
    ("GET_DATA_RESPONSE", "GET_DATA_RESPONSE"),
    ("PUT_DATA_RESPONSE", "PUT_DATA_RESPONSE"),
    ("CLEAR_DATA", "CLEAR_DATA"),
    ("CLEAR_DATA_RESPONSE", "CLEAR_DATA_RESPONSE"),
    ("PUT_GET_OPERATION_ERROR", "PUT_GET_OPERATION_ERROR"),
    ("PUT_GET_ERROR", "PUT_GET_ERROR"),
    ("PUT_ERROR", "PUT_ERROR"),
    ("GET_ERROR", "GET_ERROR"),
    ("CLEAR_DATA_ERROR", "CLEAR_DATA_ERROR"),
    ("GET_META", "GET_META"),
    ("GET_META_RESPONSE", "GET_META_RESPONSE"),
    ("GET_PARTITION_META", "GET_PARTITION_META"),
    ("GET_PARTITION_META_RESPONSE", "GET_PARTITION_META_RESPONSE"),
    ("SET_CUSTOM_META", "SET_CUSTOM_META"),
    ("SET_CUSTOM_META_RESPONSE", "SET_CUSTOM_META_RESPONSE"),
    ("MARK_CLEARING", "MARK_CLEARING"),
    ("MARK_CLEARING_RESPONSE", "MARK_CLEARING_RESPONSE"),
    ("CLEAR_META", "CLEAR_META"),
    ("CLEAR_META_RESPONSE", "CLEAR_META_RESPONSE"),
    ("CLEAR_PARTITION", "CLEAR_PARTITION"),
    ("CLEAR_PARTITION_RESPONSE", "CLEAR_PARTITION_RESPONSE"),
    ("GET_CONSUMPTION", "GET_CONSUMPTION"),
    ("CONSUMPTION_RESPONSE", "CONSUMPTION_RESPONSE"),
    ("RESET_CONSUMPTION", "RESET_CONSUMPTION"),
    ("RESET_CONSUMPTION_RESPONSE", "RESET_CONSUMPTION_RESPONSE"),
    ("GET_PRODUCTION", "GET_PRODUCTION"),
    ("PRODUCTION_RESPONSE", "PRODUCTION_RESPONSE"),
    ("GET_LIST_PARTITIONS", "GET_LIST_PARTITIONS"),
    ("LIST_PARTITIONS_RESPONSE", "LIST_PARTITIONS_RESPONSE"),
    ("NOTIFY_DATA_UPDATE", "NOTIFY_DATA_UPDATE"),
    ("NOTIFY_DATA_UPDATE_ACK", "NOTIFY_DATA_UPDATE_ACK"),
    ("NOTIFY_DATA_UPDATE_ERROR", "NOTIFY_DATA_UPDATE_ERROR"),
    ("KV_RETRIEVE_META", "KV_RETRIEVE_META"),
    ("KV_RETRIEVE_META_RESPONSE", "KV_RETRIEVE_META_RESPONSE"),
    ("KV_RETRIEVE_KEYS", "KV_RETRIEVE_KEYS"),
    ("KV_RETRIEVE_KEYS_RESPONSE", "KV_RETRIEVE_KEYS_RESPONSE"),
    ("KV_LIST", "KV_LIST"),
    ("KV_LIST_RESPONSE", "KV_LIST_RESPONSE"),
    ("GET_METRICS", "GET_METRICS"),
    ("METRICS_RESPONSE", "METRICS_RESPONSE"),
    ("SAVE_CONTROLLER_CHECKPOINT", "SAVE_CONTROLLER_CHECKPOINT"),
    (
        "SAVE_CONTROLLER_CHECKPOINT_RESPONSE",
        "SAVE_CONTROLLER_CHECKPOINT_RESPONSE",
    ),
    ("SAVE_STORAGE_CHECKPOINT", "SAVE_STORAGE_CHECKPOINT"),
    (
        "SAVE_STORAGE_CHECKPOINT_RESPONSE",
        "SAVE_STORAGE_CHECKPOINT_RESPONSE",
    ),
    ("LOAD_CONTROLLER_CHECKPOINT", "LOAD_CONTROLLER_CHECKPOINT"),
    (
        "LOAD_CONTROLLER_CHECKPOINT_RESPONSE",
        "LOAD_CONTROLLER_CHECKPOINT_RESPONSE",
    ),
    ("LOAD_STORAGE_CHECKPOINT", "LOAD_STORAGE_CHECKPOINT"),
    (
        "LOAD_STORAGE_CHECKPOINT_RESPONSE",
        "LOAD_STORAGE_CHECKPOINT_RESPONSE",
    ),
];

/// The `ZMQRequestType` member name of a wire `request_type` (`"PUT"` ->
/// `"PUT_DATA"`), or `None` if TransferQueue does not know the type.
pub fn request_type_name(wire: &str) -> Option<&'static str> {
    REQUEST_TYPES
        .iter()
        .find(|(w, _)| *w == wire)
        .map(|(_, n)| *n)
}

/// Frame 0 of a message, without the body.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    /// Wire request type (`PUT`, `GET_DATA_RESPONSE`, ...).
    pub request_type: String,
    /// Sender id (for clients not the ZMQ identity: the fixtures have
    /// identity `TQ_STORAGE_fixture_0` and sender `TQ_STORAGE_fixture`).
    pub sender_id: String,
    /// Receiver id: the unit id in requests, nil in replies.
    pub receiver_id: Option<String>,
    /// 8 lowercase hex chars from the sender; replies do not echo it.
    pub request_id: String,
    /// Seconds since the epoch, as the sender's `time.time()`.
    pub timestamp: f64,
}

/// A decoded request.
#[derive(Clone, Debug, PartialEq)]
pub enum Request {
    /// `PUT`: one field value per global index, in `global_indexes` order.
    Put {
        /// Global indexes, distinct.
        global_indexes: Vec<u64>,
        /// Fields in body order, each with one row per index.
        fields: Vec<(String, Field)>,
    },
    /// `GET`: every field for every index, in request order.
    Get {
        /// Global indexes (repeats allowed).
        global_indexes: Vec<u64>,
        /// Field names.
        fields: Vec<String>,
    },
    /// `CLEAR_DATA`.
    Clear {
        /// Global indexes to drop from every field.
        global_indexes: Vec<u64>,
    },
    /// `GET_METRICS` (the body is ignored).
    GetMetrics,
    /// `SAVE_STORAGE_CHECKPOINT {path}`: write the unit's rows to the file
    /// `path` (the storage manager writes its manifest beside it).
    SaveCheckpoint {
        /// The file to write.
        path: String,
    },
    /// `LOAD_STORAGE_CHECKPOINT {path}`: replace the unit's rows with those
    /// of the file `path`, as a save wrote it.
    LoadCheckpoint {
        /// The file to read.
        path: String,
    },
    /// A request type TransferQueue knows but a storage unit does not serve
    /// here (`HANDSHAKE`, `SAVE_CONTROLLER_CHECKPOINT`, ...): answer it with
    /// [`Reply::invalid_operation`]. Holds the wire request type.
    Other(String),
}

impl Request {
    /// The wire `request_type`.
    pub fn request_type(&self) -> &str {
        match self {
            Request::Put { .. } => "PUT",
            Request::Get { .. } => "GET",
            Request::Clear { .. } => "CLEAR_DATA",
            Request::GetMetrics => "GET_METRICS",
            Request::SaveCheckpoint { .. } => "SAVE_STORAGE_CHECKPOINT",
            Request::LoadCheckpoint { .. } => "LOAD_STORAGE_CHECKPOINT",
            Request::Other(t) => t,
        }
    }

    /// The operation name the unit counts in `arrivals_by_op` (`PUT_DATA`,
    /// `GET_DATA`, `CLEAR_DATA`, `GET_METRICS`, or the member name of another
    /// type).
    pub fn op_name(&self) -> &str {
        let wire = self.request_type();
        request_type_name(wire).unwrap_or(wire)
    }
}

/// A decoded request with its envelope.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    /// Frame 0 without the body.
    pub envelope: Envelope,
    /// The request.
    pub request: Request,
}

/// The error reply types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorReply {
    /// `PUT_ERROR`: a decodable PUT failed.
    Put,
    /// `GET_ERROR`: a decodable GET failed.
    Get,
    /// `CLEAR_DATA_ERROR`: a decodable CLEAR_DATA failed.
    ClearData,
    /// `PUT_GET_ERROR`: undecodable request, or an unexpected failure.
    PutGet,
    /// `PUT_GET_OPERATION_ERROR`: a known request type the unit does not serve.
    PutGetOperation,
}

impl ErrorReply {
    /// The wire `request_type` of this reply.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorReply::Put => "PUT_ERROR",
            ErrorReply::Get => "GET_ERROR",
            ErrorReply::ClearData => "CLEAR_DATA_ERROR",
            ErrorReply::PutGet => "PUT_GET_ERROR",
            ErrorReply::PutGetOperation => "PUT_GET_OPERATION_ERROR",
        }
    }

    /// Parses a wire `request_type` of an error reply.
    pub fn from_wire(s: &str) -> Option<ErrorReply> {
        [
            ErrorReply::Put,
            ErrorReply::Get,
            ErrorReply::ClearData,
            ErrorReply::PutGet,
            ErrorReply::PutGetOperation,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

/// Body of `METRICS_RESPONSE`, keys in the order the real unit writes them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metrics {
    /// The unit's id.
    pub storage_unit_id: String,
    /// Capacity in keys, nil when unlimited.
    pub capacity: Option<u64>,
    /// Distinct global indexes stored.
    pub active_keys: u64,
    /// Resident set size of the process.
    pub process_rss_bytes: u64,
    /// Written as 0/1.
    pub ssd_offload_enabled: bool,
    /// Values offloaded to SSD.
    pub ssd_active_values: u64,
    /// Bytes offloaded to SSD.
    pub ssd_active_bytes: u64,
    /// Values kept in memory because SSD encoding was unavailable.
    pub ssd_fallback_values_total: u64,
    /// Requests decoded so far, this one included.
    pub requests_arrived: u64,
    /// Arrivals per op name ([`Request::op_name`]) in first-arrival order.
    pub arrivals_by_op: Vec<(String, u64)>,
    /// Any further keys (`accept_queue`, `op_stats`) as exact msgpack, in order.
    pub extra: Vec<(String, Bytes)>,
}

/// A reply of a storage unit.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// `PUT_DATA_RESPONSE {}`.
    PutData,
    /// `GET_DATA_RESPONSE {data: {field: [value per index]}}`; each tensor
    /// cell is sent as its own ext 3 with its own frame.
    GetData {
        /// Requested fields in request order, one cell per requested index.
        fields: Vec<(String, Vec<Cell>)>,
    },
    /// `CLEAR_DATA_RESPONSE {message}`.
    ClearData {
        /// Human-readable confirmation.
        message: String,
    },
    /// `METRICS_RESPONSE`.
    Metrics(Metrics),
    /// `SAVE_STORAGE_CHECKPOINT_RESPONSE` (or `LOAD_...` when `load`):
    /// `{success: true}`, or `{success: false, message}` with the error.
    Checkpoint {
        /// The reply to a load (else to a save).
        load: bool,
        /// Why it failed; `None`: it succeeded.
        error: Option<String>,
    },
    /// An error reply `{message}`.
    Error {
        /// Which error reply.
        kind: ErrorReply,
        /// The `message` body key.
        message: String,
    },
}

impl Reply {
    /// The wire `request_type` of this reply.
    pub fn request_type(&self) -> &'static str {
        match self {
            Reply::PutData => "PUT_DATA_RESPONSE",
            Reply::GetData { .. } => "GET_DATA_RESPONSE",
            Reply::ClearData { .. } => "CLEAR_DATA_RESPONSE",
            Reply::Metrics(_) => "METRICS_RESPONSE",
            Reply::Checkpoint { load: false, .. } => "SAVE_STORAGE_CHECKPOINT_RESPONSE",
            Reply::Checkpoint { load: true, .. } => "LOAD_STORAGE_CHECKPOINT_RESPONSE",
            Reply::Error { kind, .. } => kind.as_str(),
        }
    }

    /// The success reply to `CLEAR_DATA`, worded as the real unit words it.
    pub fn clear_ok(unit_id: &str) -> Reply {
        Reply::ClearData {
            message: format!("Clear data in storage unit id #{unit_id} successfully."),
        }
    }

    /// `GET_ERROR` for a missing (index, field), as the real unit words it
    /// (`[TQKeyNotFound] ...`, the detail quoted by Python's `KeyError`).
    pub fn key_not_found(unit_id: &str, index: u64, field: &str) -> Reply {
        let detail = format!(
            "StorageUnitData get_data: key {index} not found in field {}",
            py_repr(field)
        );
        Reply::Error {
            kind: ErrorReply::Get,
            message: format!(
                "[{KEY_NOT_FOUND_MARKER}] Failed to get data from storage unit id #{unit_id}, \
                 detail error message: {}",
                py_repr(&detail)
            ),
        }
    }

    /// `GET_ERROR` for a field the unit has never stored.
    pub fn field_not_found(unit_id: &str, field: &str, available: &[&str]) -> Reply {
        let list = available
            .iter()
            .map(|f| py_repr(f))
            .collect::<Vec<_>>()
            .join(", ");
        let detail = format!(
            "StorageUnitData get_data: field {} not found. Available: [{list}]",
            py_repr(field)
        );
        Reply::get_failed(unit_id, &detail)
    }

    /// `PUT_ERROR` with the real unit's wording around `detail`.
    pub fn put_failed(unit_id: &str, detail: &str) -> Reply {
        let message = format!(
            "Failed to put data into storage unit id #{unit_id}, detail error message: {detail}"
        );
        Reply::Error {
            kind: ErrorReply::Put,
            message,
        }
    }

    /// `GET_ERROR` with the real unit's wording around `detail`.
    pub fn get_failed(unit_id: &str, detail: &str) -> Reply {
        let message = format!(
            "Failed to get data from storage unit id #{unit_id}, detail error message: {detail}"
        );
        Reply::Error {
            kind: ErrorReply::Get,
            message,
        }
    }

    /// `CLEAR_DATA_ERROR` with the real unit's wording around `detail`.
    pub fn clear_failed(unit_id: &str, detail: &str) -> Reply {
        let message = format!(
            "Failed to clear data in storage unit id #{unit_id}, detail error message: {detail}"
        );
        Reply::Error {
            kind: ErrorReply::ClearData,
            message,
        }
    }

    /// `PUT_GET_OPERATION_ERROR` for a known request type the unit does not
    /// serve (`request_type` is the wire value).
    pub fn invalid_operation(unit_id: &str, request_type: &str) -> Reply {
        let name = request_type_name(request_type).unwrap_or(request_type);
        Reply::Error {
            kind: ErrorReply::PutGetOperation,
            message: format!(
                "Storage unit id #{unit_id} receive invalid operation: ZMQRequestType.{name}."
            ),
        }
    }
}

/// The `request_id` and `timestamp` of an outgoing envelope.
#[derive(Clone, Debug, PartialEq)]
pub struct Stamp {
    /// 8 lowercase hex chars.
    pub request_id: String,
    /// Seconds since the epoch.
    pub timestamp: f64,
}

impl Stamp {
    /// A fresh id from [`fresh_request_id`] and the current time.
    pub fn now() -> Stamp {
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        Stamp {
            request_id: fresh_request_id(),
            timestamp,
        }
    }

    /// A caller-chosen id and time (for tests and replays).
    pub fn new(request_id: impl Into<String>, timestamp: f64) -> Stamp {
        Stamp {
            request_id: request_id.into(),
            timestamp,
        }
    }
}

/// A new 8-lowercase-hex request id: a process-wide counter scrambled with
/// splitmix64 from a seed taken from the clock and the process id. Unique
/// enough for log correlation; TransferQueue never matches on it.
pub fn fresh_request_id() -> String {
    static SEED: OnceLock<u64> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let seed = *SEED.get_or_init(|| {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        nanos ^ (u64::from(std::process::id()) << 32)
    });
    let mut z = seed.wrapping_add(
        COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15),
    );
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    format!("{:08x}", z >> 32)
}

/// Python's `repr()` of a str, as used in `KeyError` and list messages.
pub fn py_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// The operation whose body an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A PUT request.
    Put,
    /// A GET request.
    Get,
    /// A CLEAR_DATA request.
    Clear,
    /// A SAVE_STORAGE_CHECKPOINT or LOAD_STORAGE_CHECKPOINT request.
    Checkpoint,
    /// A reply being decoded by a client.
    Reply,
}

impl Op {
    fn error_reply(self) -> ErrorReply {
        match self {
            Op::Put => ErrorReply::Put,
            Op::Get => ErrorReply::Get,
            Op::Clear => ErrorReply::ClearData,
            // TransferQueue's unit reads `path` outside its try: a bad
            // body is its worker's generic error.
            Op::Checkpoint | Op::Reply => ErrorReply::PutGet,
        }
    }
}

/// Why a message could not be decoded or encoded. Never a panic: every
/// malformed input ends here.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Undecodable: no frame at all.
    #[error("message has no frames")]
    NoFrames,
    /// Undecodable: frame 0 is empty (shifted multipart boundaries).
    #[error("leading frame is empty; num_frames={0}")]
    EmptyEnvelope(usize),
    /// Undecodable: the `[b"\xc1\xfe\xed", pickle]` fallback form, never unpickled.
    #[error("pickle fallback message (frame 0 is b'\\xc1\\xfe\\xed'); stowd does not unpickle")]
    PickleFallback,
    /// Undecodable: frame 0 is not well-formed msgpack (or nests too deep).
    #[error("malformed msgpack in frame 0 at byte {offset}: {reason}")]
    Msgpack {
        /// Byte offset in frame 0.
        offset: usize,
        /// What was wrong.
        reason: &'static str,
    },
    /// Undecodable: an envelope key is missing, duplicated or of the wrong type.
    #[error("envelope: {0}")]
    Envelope(String),
    /// Undecodable: `request_type` is not a TransferQueue request type.
    #[error("{0:?} is not a valid ZMQRequestType")]
    UnknownRequestType(String),
    /// Undecodable: an ext type other than 1, 2, 3, 4, 5 or -1 (timestamp).
    #[error("msgpack ext type {code} at byte {offset} is not supported")]
    UnknownExt {
        /// The ext type code.
        code: i8,
        /// Offset of the payload in frame 0.
        offset: usize,
    },
    /// Undecodable: an ext 3/4/5 pickle has the wrong structure.
    #[error("ext {code} at byte {offset}: {reason}")]
    BadExt {
        /// The ext type code.
        code: i8,
        /// Offset of the payload in frame 0.
        offset: usize,
        /// What was wrong.
        reason: &'static str,
    },
    /// Undecodable: an ext 3/4/5 payload is not a pickle of the supported subset.
    #[error("ext {code} at byte {offset}: {source}")]
    Pickle {
        /// The ext type code.
        code: i8,
        /// Offset of the payload in frame 0.
        offset: usize,
        /// The pickle reader's error.
        source: PickleError,
    },
    /// Undecodable: a tensor dtype [`crate::tensor::Dtype`] does not know.
    #[error("unknown dtype {0:?}")]
    UnknownDtype(String),
    /// Undecodable: a negative, too large or overflowing shape, or too many dimensions.
    #[error("invalid shape {shape:?}: {reason}")]
    BadShape {
        /// The declared shape.
        shape: Vec<i128>,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Undecodable: a frame index that names no data frame.
    #[error(
        "frame index {index} out of range: the message has {data_frames} data frames, numbered from 1"
    )]
    FrameIndex {
        /// The declared index.
        index: i128,
        /// Data frames in the message (frame 0 excluded).
        data_frames: usize,
    },
    /// Undecodable: a data frame nothing in the body refers to.
    #[error("data frame {0} is not referenced by the body")]
    UnusedFrame(usize),
    /// Undecodable: a frame's length is not shape x itemsize.
    #[error("data frame {frame} does not fit its tensor: {source}")]
    FrameLength {
        /// The absolute frame index.
        frame: usize,
        /// The length mismatch.
        source: TensorError,
    },
    /// Undecodable: a frame's length is not shape x itemsize of its numpy dtype.
    #[error(
        "data frame {frame} does not fit its numpy array: shape {shape:?} of {dtype} needs {expected} bytes, \
         the frame has {actual}"
    )]
    NumpyLength {
        /// The absolute frame index.
        frame: usize,
        /// The numpy dtype string.
        dtype: String,
        /// The declared shape.
        shape: Vec<u64>,
        /// Bytes the shape needs.
        expected: u128,
        /// Bytes in the frame.
        actual: usize,
    },
    /// A decodable request whose body is wrong for its operation (missing key, wrong type).
    #[error("{detail}")]
    Body {
        /// The operation (gives the reply type).
        op: Op,
        /// What is wrong.
        detail: String,
    },
    /// `PUT_ERROR`: the PUT carries a `data_parser` callable.
    #[error("data_parser must be nil: stowd does not run Python callables")]
    DataParser,
    /// `PUT_ERROR`: the same global index twice in one PUT.
    #[error("duplicate global index {0} in one PUT")]
    DuplicateIndex(u64),
    /// `PUT_ERROR`: a field has a different number of rows than the PUT has indexes.
    #[error(
        "StorageUnitData put_data: field '{field}' values length {rows} != global_indexes length {indexes}, \
         length mismatch"
    )]
    RowCount {
        /// The field.
        field: String,
        /// Its rows.
        rows: u64,
        /// The PUT's global indexes.
        indexes: usize,
    },
    /// A count above a [`Limits`] bound, refused when the count was read.
    #[error("{what} is {value}, over the limit [limits] {setting} = {limit}")]
    TooLarge {
        /// The operation (gives the reply type).
        op: Op,
        /// What was counted.
        what: &'static str,
        /// The configuration key of the limit.
        setting: &'static str,
        /// The count in the request.
        value: u64,
        /// The configured limit.
        limit: u64,
    },
    /// A field value stowd cannot store or represent (a pickled object as a
    /// whole field, a 1-d numpy array of datetimes as a whole field, ...).
    #[error("field '{field}': {what} is not supported by stowd")]
    Unsupported {
        /// The operation (gives the reply type).
        op: Op,
        /// The field.
        field: String,
        /// What it holds.
        what: String,
    },
}

impl Error {
    /// The reply type a storage unit answers this error with.
    pub fn reply_type(&self) -> ErrorReply {
        match self {
            Error::Body { op, .. } | Error::Unsupported { op, .. } | Error::TooLarge { op, .. } => {
                op.error_reply()
            }
            Error::DataParser | Error::DuplicateIndex(_) | Error::RowCount { .. } => {
                ErrorReply::Put
            }
            _ => ErrorReply::PutGet,
        }
    }

    /// True if the request could not be decoded at all (`PUT_GET_ERROR`).
    pub fn is_undecodable(&self) -> bool {
        self.reply_type() == ErrorReply::PutGet
    }

    /// The reply message, worded as the real unit words it
    /// (`undecodable request: ...`, `Failed to put data into ...`).
    pub fn reply_message(&self, unit_id: &str) -> String {
        match self.to_reply(unit_id) {
            Reply::Error { message, .. } => message,
            _ => String::new(),
        }
    }

    /// The error reply for this error.
    pub fn to_reply(&self, unit_id: &str) -> Reply {
        let detail = self.to_string();
        match self.reply_type() {
            ErrorReply::Put => Reply::put_failed(unit_id, &detail),
            ErrorReply::Get => Reply::get_failed(unit_id, &detail),
            ErrorReply::ClearData => Reply::clear_failed(unit_id, &detail),
            kind => Reply::Error {
                kind,
                message: format!("undecodable request: {detail}"),
            },
        }
    }
}
