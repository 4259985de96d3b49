//! `_core.Put`: a put read and laid out, for every input kind, once. The
//! client's put exists only here: its arguments checked (the errors that
//! name a field and what is wrong with it), its rows split into messages,
//! each message's data frames laid out and frame 0 written, and its bytes
//! sent from where they lie ([`crate::connection`]'s `put`) or written
//! into a leased shared-memory segment (`Put.fill`); `Put.encode` gives a
//! message as it goes on the wire.
//!
//! What is read (`data` maps field names to one of):
//! - a numpy array or torch tensor `[n, ...]` of any strides (a regular
//!   field); big-endian arrays are swapped into a little-endian copy;
//! - `stowage.Bits(array, dtype)` (a regular field of `dtype`'s bits), or
//!   `Bits([row, ...], dtype)` (nested);
//! - a list or tuple of n arrays, tensors or `Bits` of one dtype, any
//!   shapes (nested);
//! - `stowage.Packed(values, shapes)` (nested, no array per row);
//! - a nested torch tensor (its values and offsets where its rows lie back
//!   to back, else its rows);
//! - a list or tuple of n values: `str`, `bytes` (`bytearray`,
//!   `memoryview`), or anything msgpack packs.
//!
//! The buffer formats numpy exports are read here; anything else that is
//! an array (a torch tensor, `Bits`, a numpy scalar row, an ml_dtypes
//! float8) goes through the Python client's `_codec._wire_array`, which
//! gives it as a numpy array sharing its memory (or says why it cannot be
//! sent), and a nested torch tensor through `_codec._nested_tensor`.
//! Index inputs are read by [`crate::indexes`]; one it does not plainly
//! read goes to `_codec.check_indexes`, which words what is wrong with it.
//!
//! The layout, the same whichever way the put goes: a piece (a regular
//! field's rows, a nested row, a packed field's rows) of at least
//! [`SMALL_PIECE_BYTES`] is a data frame of its own, sent from where it
//! lies; smaller ones share frames of at most [`COALESCED_FRAME_BYTES`],
//! each at a multiple of its itemsize (at most 16), copied into place as
//! the frame is written. A put whose rows cost more than
//! `max_message_bytes` (each row 16 bytes per field and one, plus its
//! bytes; a value about its length) is split into messages of contiguous
//! rows, a row too big for one going alone; a same-node put is one message.
//! A non-contiguous array is sent as the contiguous blocks it is made of
//! ([`crate::source`]): large ones from where they lie, small ones
//! gathered into the writer's buffer as it goes. Each data frame of a
//! same-node put lies at a multiple of [`LEASE_ALIGN`] in its lease.

use std::borrow::Cow;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use bytes::Bytes;
use pyo3::PyTypeInfo;
use pyo3::exceptions::{PyOSError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{
    PyByteArray, PyBytes, PyDict, PyInt, PyList, PyMapping, PyMemoryView, PyString, PyTuple,
};
use stowage_transport::zmtp;
use stowage_wire::batch::Value;
use stowage_wire::native::{self, Extras, FieldLayout, PartLayout, RequestHead, RowLayout};
use stowage_wire::tensor::Dtype;

use crate::buffer::Held;
use crate::error::Fail;
use crate::fast::format_dtype;
use crate::indexes::{is_ndarray, read_indexes, tensor_numpy};
use crate::message::{DataFrames, Gather, GatherTo, Out, Sink};
use crate::source::Source;
use crate::stream::IOV_MAX;

/// Pieces below this share a copied frame.
pub(crate) const SMALL_PIECE_BYTES: usize = 64 << 10;
/// Most bytes in one shared frame.
pub(crate) const COALESCED_FRAME_BYTES: usize = 1 << 20;
/// Each data frame of a same-node put starts at a multiple of this in its
/// lease (a cache line: no two frames share one).
pub(crate) const LEASE_ALIGN: usize = 64;
/// Pieces up to this are copied into the write buffer before a `pwritev`
/// into a lease (larger ones are a slice each).
const LEASE_COPY: usize = 512;
/// Blocks of a strided source from this many bytes are written as slices
/// of it (the writer copies those up to [`zmtp::COALESCE`] into its
/// buffer); smaller ones (a transposed array's items) are gathered rows
/// at a time, one load and store a block.
const MIN_SLICE: usize = 512;
/// Most dimensions a row's shape may have (stowage/1's bound).
const MAX_DIMS: usize = native::MAX_DIMS;

// ---------------------------------------------------------------- the plan

/// A run of a source's bytes: a contiguous range, or rows of a source
/// whose bytes are not contiguous (written block by block).
#[derive(Clone, Copy)]
enum Span {
    Bytes { src: usize, off: usize, len: usize },
    Rows { src: usize, a: usize, b: usize },
}

/// A piece of a data frame.
#[derive(Clone, Copy)]
enum Piece {
    Span(Span),
    /// Padding (less than 16 bytes).
    Zeros(usize),
}

/// A nested field's rows.
enum NestedRows {
    /// One span per row, each with its shape (a list of arrays; a packed
    /// field whose rows have several tail shapes).
    Each(Vec<(Vec<u64>, Span)>),
    /// Row `i` is the first axis' `offsets[i]..offsets[i + 1]` of `src`
    /// (a packed field, a jagged tensor: no array per row).
    Runs { src: usize, offsets: Vec<u64> },
}

enum Field {
    Regular {
        dtype: Dtype,
        src: usize,
    },
    Nested {
        dtype: Dtype,
        rows: NestedRows,
    },
    /// The values and what each adds to a message.
    Values {
        values: Vec<Value>,
        costs: Vec<u64>,
    },
}

/// A put read and laid out (see the module doc).
pub(crate) struct Plan {
    /// The indexes (empty once `single` holds them).
    indexes: Vec<u64>,
    /// How many rows.
    rows: usize,
    /// The fields, their names shared ([`stowage_wire::names::shared_name`]:
    /// a put's names are read again every step, and a `String` a field
    /// was an allocation and a free a field of every put, whose many
    /// small frees overflowed glibc's per-thread cache and had the next
    /// large allocation consolidate them).
    fields: Vec<(Arc<str>, Field)>,
    sources: Vec<Source>,
    /// The row ranges of the messages.
    messages: Vec<(usize, usize)>,
    /// The bytes of every row of every tensor field.
    nbytes: u64,
    /// What all the rows cost as one message ([`Plan::split`]'s measure).
    cost: u64,
    /// A put of one message (the usual small one): its data frames and
    /// frame 0's body, laid out once, names and indexes moved in (frame
    /// 0 is written from them for each request id).
    single: Option<(Frames, RequestHead)>,
}

/// One message of a plan: frame 0, and the data frames as pieces of the
/// plan's sources.
pub(crate) struct Message<'p> {
    plan: &'p Plan,
    pub(crate) frame0: Bytes,
    frames: Cow<'p, [Vec<Piece>]>,
    lens: Cow<'p, [usize]>,
}

/// The data frames of a message being laid out.
#[derive(Default, Clone)]
struct Frames {
    frames: Vec<Vec<Piece>>,
    lens: Vec<usize>,
    /// The shared frame being filled (its index).
    shared: Option<usize>,
    /// Pieces a shared frame is made with room for: a piece and its
    /// padding a field of the message (at most [`SHARED_PIECES_AHEAD`]).
    /// Grown a piece at a time, the list of a 10-field put's shared frame
    /// was reallocated 4 times, about 130 instructions a field.
    room: usize,
}

/// Most pieces a shared frame is made with room for ([`Frames::room`]).
const SHARED_PIECES_AHEAD: usize = 256;

impl Frames {
    /// Adds `span` (`len` bytes, items of `itemsize`): (frame number from
    /// 1, offset in it).
    fn add(&mut self, span: Span, len: usize, itemsize: usize) -> (u64, u64) {
        if len >= SMALL_PIECE_BYTES {
            self.frames.push(vec![Piece::Span(span)]);
            self.lens.push(len);
            return (self.frames.len() as u64, 0);
        }
        let align = itemsize.clamp(1, 16);
        let k = match self.shared {
            Some(k) if self.lens[k] + align + len <= COALESCED_FRAME_BYTES => k,
            _ => {
                self.frames.push(Vec::with_capacity(self.room));
                self.lens.push(0);
                self.shared = Some(self.frames.len() - 1);
                self.frames.len() - 1
            }
        };
        let pad = (align - self.lens[k] % align) % align;
        if pad > 0 {
            self.frames[k].push(Piece::Zeros(pad));
            self.lens[k] += pad;
        }
        let at = self.lens[k];
        if len > 0 {
            self.frames[k].push(Piece::Span(span));
            self.lens[k] += len;
        }
        (k as u64 + 1, at as u64)
    }
}

static ZEROS: [u8; 16] = [0; 16];

impl Plan {
    /// How many messages the put is sent as.
    pub(crate) fn message_count(&self) -> usize {
        self.messages.len()
    }

    /// Rows message `k` carries.
    pub(crate) fn message_len(&self, k: usize) -> u64 {
        let (a, b) = self.messages[k];
        (b - a) as u64
    }

    fn src(&self, span: Span) -> &Source {
        match span {
            Span::Bytes { src, .. } | Span::Rows { src, .. } => &self.sources[src],
        }
    }

    fn span_len(&self, span: Span) -> usize {
        match span {
            Span::Bytes { len, .. } => len,
            Span::Rows { src, a, b } => (b - a) * self.sources[src].row_bytes(),
        }
    }

    /// Gives `span`'s bytes to `out`: as the slices they are, or, for a
    /// strided source of blocks under [`MIN_SLICE`] bytes, gathered a
    /// [`zmtp::WRITE_CHUNK`] of rows (at least one) at a time.
    fn span_out<'s>(&'s self, span: Span, out: &mut dyn Out<'s>) -> Result<(), Fail> {
        match span {
            Span::Bytes { src, off, len } => {
                if len > 0 {
                    out.slice(self.sources[src].slice(off, len))?;
                }
                Ok(())
            }
            Span::Rows { src, a, b } => {
                let s = &self.sources[src];
                if s.block_bytes() >= MIN_SLICE {
                    return s.blocks(a, b, &mut |block| out.slice(block));
                }
                let row = s.row_bytes().max(1);
                let step = (zmtp::WRITE_CHUNK / row).max(1);
                let mut r = a;
                while r < b {
                    let end = (r + step).min(b);
                    out.fill((end - r) * row, &mut |buf| s.copy_rows(r, end, buf))?;
                    r = end;
                }
                Ok(())
            }
        }
    }

    /// The data frames of message `k`, and with `describe` its fields'
    /// descriptors under their (shared) names (a lease's size and its fill
    /// need only the frames).
    fn lay_out(&self, k: usize, describe: bool) -> (Frames, Vec<(Arc<str>, FieldLayout)>) {
        let (a, b) = self.messages[k];
        let mut frames = Frames {
            room: (2 * self.fields.len()).min(SHARED_PIECES_AHEAD),
            ..Frames::default()
        };
        let mut fields = Vec::with_capacity(if describe { self.fields.len() } else { 0 });
        for (name, field) in &self.fields {
            let layout = match field {
                Field::Regular { dtype, src } => {
                    let s = &self.sources[*src];
                    let span = rows_span(*src, s, a, b);
                    let len = self.span_len(span);
                    let (frame, offset) = frames.add(span, len, s.itemsize());
                    if !describe {
                        continue;
                    }
                    let mut shape = native::Dims::with_capacity(s.shape().len());
                    shape.push((b - a) as u64);
                    shape.extend(s.shape()[1..].iter().map(|&d| d as u64));
                    FieldLayout::Regular {
                        dtype: *dtype,
                        shape,
                        parts: smallvec::smallvec![PartLayout {
                            frame,
                            offset,
                            len: len as u64,
                            rows: (b - a) as u64,
                        }],
                    }
                }
                Field::Nested {
                    dtype,
                    rows: NestedRows::Each(each),
                } => {
                    let mut rows = Vec::with_capacity(if describe { b - a } else { 0 });
                    for (shape, span) in &each[a..b] {
                        let len = self.span_len(*span);
                        let (frame, offset) = frames.add(*span, len, self.src(*span).itemsize());
                        if describe {
                            rows.push(RowLayout {
                                shape: shape.clone(),
                                frame,
                                offset,
                                len: len as u64,
                            });
                        }
                    }
                    if !describe {
                        continue;
                    }
                    FieldLayout::Nested {
                        dtype: *dtype,
                        rows,
                    }
                }
                Field::Nested {
                    dtype,
                    rows: NestedRows::Runs { src, offsets },
                } => {
                    let s = &self.sources[*src];
                    let (lo, hi) = (offsets[a] as usize, offsets[b] as usize);
                    let span = rows_span(*src, s, lo, hi);
                    let per = s.row_bytes() as u64;
                    let (frame, at) = frames.add(span, self.span_len(span), s.itemsize());
                    if !describe {
                        continue;
                    }
                    let tail: Vec<u64> = s.shape()[1..].iter().map(|&d| d as u64).collect();
                    let rows = (a..b)
                        .map(|i| {
                            let k = offsets[i + 1] - offsets[i];
                            let mut shape = Vec::with_capacity(1 + tail.len());
                            shape.push(k);
                            shape.extend_from_slice(&tail);
                            RowLayout {
                                shape,
                                frame,
                                offset: at + (offsets[i] - lo as u64) * per,
                                len: k * per,
                            }
                        })
                        .collect();
                    FieldLayout::Nested {
                        dtype: *dtype,
                        rows,
                    }
                }
                Field::Values { values, .. } => {
                    if !describe {
                        continue;
                    }
                    FieldLayout::Values(values[a..b].to_vec())
                }
            };
            fields.push((name.clone(), layout));
        }
        (frames, fields)
    }

    /// Lays out a put of one message once, for every request of it.
    fn lay_out_single(&mut self) {
        if self.messages.len() != 1 {
            return;
        }
        let (frames, fields) = self.lay_out(0, true);
        let head = RequestHead::Put {
            global_indexes: std::mem::take(&mut self.indexes),
            fields,
        };
        self.single = Some((frames, head));
    }

    /// Message `k`'s data frames alone (no frame 0).
    fn frames_only(&self, k: usize) -> Message<'_> {
        if let Some((frames, _)) = &self.single {
            return Message {
                plan: self,
                frame0: Bytes::new(),
                frames: Cow::Borrowed(&frames.frames),
                lens: Cow::Borrowed(&frames.lens),
            };
        }
        let (frames, _) = self.lay_out(k, false);
        Message {
            plan: self,
            frame0: Bytes::new(),
            frames: Cow::Owned(frames.frames),
            lens: Cow::Owned(frames.lens),
        }
    }

    /// Message `k` laid out, request id `id`; with `segments`, the
    /// same-node form: its data frames named as those ranges of leased
    /// segments, none sent.
    pub(crate) fn message(
        &self,
        k: usize,
        id: u64,
        segments: Option<&[(String, u64, u64)]>,
    ) -> Result<Message<'_>, Fail> {
        let (a, b) = self.messages[k];
        let built;
        let (frames, head): (Cow<'_, Frames>, &RequestHead) = match &self.single {
            Some((frames, head)) => (Cow::Borrowed(frames), head),
            None => {
                let (frames, fields) = self.lay_out(k, true);
                built = RequestHead::Put {
                    global_indexes: self.indexes[a..b].to_vec(),
                    fields,
                };
                (Cow::Owned(frames), &built)
            }
        };
        let unencodable = |e: native::Error| Fail::Mismatch(format!("put: {e}"));
        let mut frame0 = native::encode_request_head(id, head).map_err(unencodable)?;
        let (frames, lens) = match (segments, frames) {
            (None, Cow::Borrowed(f)) => (Cow::Borrowed(&f.frames[..]), Cow::Borrowed(&f.lens[..])),
            (None, Cow::Owned(f)) => (Cow::Owned(f.frames), Cow::Owned(f.lens)),
            (Some(segments), _) => {
                let extras = Extras {
                    segments: Some(segments.to_vec()),
                    ..Extras::default()
                };
                frame0 = native::with_extras(&frame0, &extras).map_err(unencodable)?;
                (Cow::Owned(Vec::new()), Cow::Owned(Vec::new()))
            }
        };
        Ok(Message {
            plan: self,
            frame0,
            frames,
            lens,
        })
    }
}

/// Rows `a..b` of source `src` (`s`): a contiguous range, or rows to write
/// block by block.
fn rows_span(src: usize, s: &Source, a: usize, b: usize) -> Span {
    if s.is_contiguous() {
        let row = s.row_bytes();
        Span::Bytes {
            src,
            off: a * row,
            len: (b - a) * row,
        }
    } else {
        Span::Rows { src, a, b }
    }
}

/// The whole of source `src` (`s`): a nested row.
fn whole_span(src: usize, s: &Source) -> Span {
    if s.shape().is_empty() {
        Span::Bytes {
            src,
            off: 0,
            len: s.itemsize(),
        }
    } else {
        rows_span(src, s, 0, s.shape()[0])
    }
}

impl DataFrames for Message<'_> {
    fn count(&self) -> usize {
        self.frames.len()
    }

    fn frame_len(&self, k: usize) -> usize {
        self.lens[k]
    }

    fn each<'a>(&'a self, k: usize, out: &mut dyn Out<'a>) -> Result<(), Fail> {
        for piece in &self.frames[k] {
            match *piece {
                Piece::Zeros(n) => out.slice(&ZEROS[..n])?,
                Piece::Span(span) => self.plan.span_out(span, out)?,
            }
        }
        Ok(())
    }
}

impl Message<'_> {
    /// Where each data frame goes in a lease: (offset, len) each at a
    /// multiple of [`LEASE_ALIGN`]; and the bytes the lease needs.
    fn lease_ranges(&self) -> (Vec<(u64, u64)>, u64) {
        let mut at = 0usize;
        let ranges = self
            .lens
            .iter()
            .map(|&len| {
                at = at.next_multiple_of(LEASE_ALIGN);
                let range = (at as u64, len as u64);
                at += len;
                range
            })
            .collect();
        (ranges, at as u64)
    }
}

// ---------------------------------------------------------------- writing a lease

/// A leased segment's descriptor, written at `at` with `pwritev` (never
/// through a mapping: stowd seals the segment at the put, which the kernel
/// refuses while a writable mapping of it is left).
struct Lease {
    fd: RawFd,
    at: u64,
}

impl Sink for Lease {
    fn write_vectored_all(&mut self, mut io: &mut [IoSlice<'_>]) -> Result<(), Fail> {
        IoSlice::advance_slices(&mut io, 0);
        while !io.is_empty() {
            let count = io.len().min(IOV_MAX);
            // SAFETY: `count` IoSlices (iovec-compatible on Unix) of
            // buffers alive for the call.
            let n = unsafe {
                libc::pwritev(
                    self.fd,
                    io.as_ptr().cast::<libc::iovec>(),
                    count as libc::c_int,
                    self.at as libc::off_t,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Fail::Io(format!("writing the leased segment: {e}")));
            }
            if n == 0 {
                return Err(Fail::Io("writing the leased segment: no progress".into()));
            }
            self.at += n as u64;
            IoSlice::advance_slices(&mut io, n as usize);
        }
        Ok(())
    }
}

/// Writes `m`'s data frames into the lease `fd` at `ranges`.
fn fill(m: &Message<'_>, fd: RawFd, ranges: &[(u64, u64)]) -> Result<(), Fail> {
    let mut lease = Lease { fd, at: 0 };
    let mut g = Gather::new(LEASE_COPY);
    let mut end = 0u64;
    for (k, &(at, len)) in ranges.iter().enumerate() {
        if at != end {
            g.flush(&mut lease)?;
            lease.at = at;
        }
        m.each(
            k,
            &mut GatherTo {
                g: &mut g,
                s: &mut lease,
            },
        )?;
        end = at + len;
    }
    g.flush(&mut lease)
}

// ---------------------------------------------------------------- the Python class

/// A put read, checked and laid out: `Put(global_indexes, data,
/// max_message_bytes, same_node=False)` (TypeError or ValueError, with the
/// field and what is wrong with it, for anything stowage/1 cannot carry).
/// A connection's `put` sends it; `fill` writes a same-node put into its
/// lease; `encode` gives a message as it goes on the wire.
#[pyclass(module = "stowage._core", frozen)]
pub(crate) struct Put {
    pub(crate) plan: Plan,
    /// Whether the rows fit one message of `max_message_bytes` (always
    /// so once split by it; a same-node put is laid out as one message
    /// whatever its size).
    fits_message: bool,
}

#[pymethods]
impl Put {
    #[new]
    #[pyo3(signature = (global_indexes, data, max_message_bytes, same_node = false))]
    fn new(
        global_indexes: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
        max_message_bytes: u64,
        same_node: bool,
    ) -> PyResult<Put> {
        let limit = if same_node {
            u64::MAX
        } else {
            max_message_bytes
        };
        let plan = read_put(global_indexes, data, limit)?;
        Ok(Put {
            fits_message: plan.cost <= max_message_bytes,
            plan,
        })
    }

    /// Whether the put could go on the socket as one message of at most
    /// `max_message_bytes` (a small same-node put does: see
    /// `Client.SAME_NODE_INLINE_BELOW`).
    #[getter]
    fn fits_message(&self) -> bool {
        self.fits_message
    }

    /// How many rows the put stores.
    #[getter]
    fn rows(&self) -> usize {
        self.plan.rows
    }

    /// How many messages it is sent as.
    #[getter]
    fn messages(&self) -> usize {
        self.plan.messages.len()
    }

    /// The bytes of its tensor fields' rows.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.plan.nbytes
    }

    /// Rows message `k` carries.
    fn message_rows(&self, k: usize) -> PyResult<usize> {
        let (a, b) = self.range(k)?;
        Ok(b - a)
    }

    /// The bytes of message `k`'s data frames (padding included).
    fn message_bytes(&self, k: usize) -> PyResult<usize> {
        self.range(k)?;
        Ok(self.plan.frames_only(k).lens.iter().sum())
    }

    /// The bytes a lease must have for message 0 (the one message of a
    /// same-node put): its data frames, each at a multiple of 64. 0 when
    /// they hold no byte (nothing to lease: they go on the socket).
    #[getter]
    fn lease_bytes(&self) -> u64 {
        self.plan.frames_only(0).lease_ranges().1
    }

    /// Message `k` as request `id`, as it goes on the wire: (frame 0, its
    /// data frames, each joined into bytes; a copy, for tests and tools:
    /// `Connection.put` writes them from where they lie). With `segments`
    /// (what `fill` returned) frame 0 names them, and there are no data
    /// frames.
    #[pyo3(signature = (k, id, segments = None))]
    #[allow(clippy::type_complexity)]
    fn encode<'py>(
        &self,
        py: Python<'py>,
        k: usize,
        id: u64,
        segments: Option<Vec<(String, u64, u64)>>,
    ) -> PyResult<(Bound<'py, PyBytes>, Vec<Bound<'py, PyBytes>>)> {
        self.range(k)?;
        let m = self.plan.message(k, id, segments.as_deref())?;
        let frames = (0..m.frames.len())
            .map(|k| {
                PyBytes::new_with(py, m.lens[k], |buf| {
                    m.each(k, &mut Join { buf, at: 0 }).map_err(PyErr::from)
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok((PyBytes::new(py, &m.frame0), frames))
    }

    /// Writes message 0's data frames into the leased segment `name` with
    /// `pwritev` (never through a mapping: stowd seals the segment at the
    /// put, which the kernel refuses while a writable mapping of it is
    /// left), the GIL released. Its writable descriptor `fd` is taken over
    /// and closed, whatever happens. Returns the ranges to name in the put,
    /// `[(name, offset, len), ...]`, each at a multiple of 64. OSError if
    /// the writes fail.
    fn fill(&self, py: Python<'_>, name: String, fd: RawFd) -> PyResult<Vec<(String, u64, u64)>> {
        // SAFETY: the caller hands the descriptor over (the lease's, taken
        // from the descriptor channel); it is closed once, here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let m = self.plan.frames_only(0);
        let (ranges, _) = m.lease_ranges();
        let raw = fd.as_raw_fd();
        py.detach(|| fill(&m, raw, &ranges)).map_err(|f| match f {
            Fail::Io(msg) => PyOSError::new_err(msg),
            f => PyErr::from(f),
        })?;
        drop(fd);
        Ok(ranges
            .into_iter()
            .map(|(at, len)| (name.clone(), at, len))
            .collect())
    }
}

impl Put {
    fn range(&self, k: usize) -> PyResult<(usize, usize)> {
        self.plan.messages.get(k).copied().ok_or_else(|| {
            PyValueError::new_err(format!(
                "message {k} of a put of {}",
                self.plan.messages.len()
            ))
        })
    }
}

/// A data frame joined into one buffer (`Put.encode`), as an [`Out`].
struct Join<'b> {
    buf: &'b mut [u8],
    at: usize,
}

impl Out<'_> for Join<'_> {
    fn slice(&mut self, bytes: &[u8]) -> Result<(), Fail> {
        self.buf[self.at..self.at + bytes.len()].copy_from_slice(bytes);
        self.at += bytes.len();
        Ok(())
    }

    fn fill(&mut self, len: usize, fill: &mut dyn FnMut(&mut [u8])) -> Result<(), Fail> {
        fill(&mut self.buf[self.at..self.at + len]);
        self.at += len;
        Ok(())
    }
}

// ---------------------------------------------------------------- reading

/// What the Python client lends the reader: its wording of bad indexes,
/// and its conversions of the arrays read through Python.
struct Helpers {
    check_indexes: Py<PyAny>,
    wire_array: Py<PyAny>,
    nested_tensor: Py<PyAny>,
    bits: Py<PyAny>,
    packed: Py<PyAny>,
    generic: Py<PyAny>,
    ndarray: Py<PyAny>,
}

fn helpers(py: Python<'_>) -> PyResult<&Helpers> {
    static HELPERS: PyOnceLock<Helpers> = PyOnceLock::new();
    HELPERS.get_or_try_init(py, || {
        let codec = py.import("stowage._codec")?;
        let numpy = py.import("numpy")?;
        let get = |m: &Bound<'_, PyModule>, name: &str| m.getattr(name).map(Bound::unbind);
        Ok::<_, PyErr>(Helpers {
            check_indexes: get(&codec, "check_indexes")?,
            wire_array: get(&codec, "_wire_array")?,
            nested_tensor: get(&codec, "_nested_tensor")?,
            bits: get(&codec, "Bits")?,
            packed: get(&codec, "Packed")?,
            generic: get(&numpy, "generic")?,
            ndarray: get(&numpy, "ndarray")?,
        })
    })
}

/// `torch.Tensor` (or a subclass), if torch is loaded (never imported
/// here: a tensor exists only if the caller imported torch).
fn is_tensor(obj: &Bound<'_, PyAny>) -> bool {
    static MODULES: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let py = obj.py();
    let Ok(modules) = MODULES.get_or_try_init(py, || {
        py.import("sys")
            .and_then(|s| s.getattr("modules"))
            .map(Bound::unbind)
    }) else {
        return false;
    };
    let Ok(Some(torch)) = modules
        .bind(py)
        .cast::<PyDict>()
        .map(|m| m.get_item("torch").ok().flatten())
    else {
        return false;
    };
    torch
        .getattr("Tensor")
        .and_then(|t| obj.is_instance(&t))
        .unwrap_or(false)
}

/// How a field's item reads: an array (ndarray, numpy scalar, `Bits`,
/// tensor) or not (a value). `str` and `bytes` (numpy's too) are values.
fn is_array_like(h: &Helpers, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Ok(false);
    }
    if is_ndarray(obj) {
        return Ok(true);
    }
    let py = obj.py();
    if obj.is_none()
        || obj.is_exact_instance_of::<PyInt>()
        || obj.is_exact_instance_of::<pyo3::types::PyFloat>()
        || obj.is_exact_instance_of::<pyo3::types::PyBool>()
        || obj.is_exact_instance_of::<PyDict>()
        || obj.is_exact_instance_of::<PyList>()
        || obj.is_exact_instance_of::<PyTuple>()
    {
        return Ok(false);
    }
    Ok(obj.is_instance(h.ndarray.bind(py))?
        || obj.is_instance(h.generic.bind(py))?
        || obj.is_instance(h.bits.bind(py))?
        || is_tensor(obj))
}

/// Where a field's message words come from: `field 'name'` (its repr),
/// made only for an error.
struct What<'a, 'py> {
    name: &'a Bound<'py, PyAny>,
    row: Option<usize>,
}

impl What<'_, '_> {
    fn text(&self) -> PyResult<String> {
        let base = format!("field {}", self.name.repr()?);
        Ok(match self.row {
            Some(i) => format!("{base} row {i}"),
            None => base,
        })
    }

    fn row(&self, i: usize) -> Self {
        What {
            name: self.name,
            row: Some(i),
        }
    }
}

/// The reader's state: the sources read so far.
struct Reader<'py> {
    py: Python<'py>,
    h: &'py Helpers,
    sources: Vec<Source>,
}

impl<'py> Reader<'py> {
    fn push(&mut self, s: Source) -> usize {
        self.sources.push(s);
        self.sources.len() - 1
    }

    /// An array-like `obj` (with `bits`: the data of `Bits(obj, bits)`) as
    /// its dtype and a source (see the module doc).
    fn tensor(
        &mut self,
        obj: &Bound<'py, PyAny>,
        what: &What<'_, 'py>,
        bits: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Dtype, usize)> {
        let flags = ffi::PyBUF_RECORDS_RO;
        if bits.is_none() {
            let direct = if is_ndarray(obj) {
                Some(obj.clone())
            } else {
                tensor_numpy(obj)
            };
            if let Some(a) = &direct
                && let Some((source, dtype)) = Source::of_ndarray(a)
            {
                return Ok((dtype, self.push(source)));
            }
            if let Some(a) = direct
                && let Ok(held) = Held::with_flags(&a, flags)
                && let Some((dtype, swap)) = format_dtype(held.format(), held.itemsize())
            {
                return Ok((dtype, self.push(Source::new(held, swap))));
            }
        }
        let got = self
            .h
            .wire_array
            .bind(self.py)
            .call1((obj, what.text()?, bits))?;
        let (name, a): (String, Bound<'py, PyAny>) = got.extract()?;
        let dtype = Dtype::from_name(&name)
            .ok_or_else(|| PyValueError::new_err(format!("unknown dtype {name:?}")))?;
        let held = Held::with_flags(&a, flags)?;
        let Some((_, swap)) = format_dtype(held.format(), held.itemsize())
            .filter(|_| held.itemsize() == dtype.itemsize())
        else {
            return Err(PyTypeError::new_err(format!(
                "{}: cannot read the bytes of a {name} array (buffer format {:?}, itemsize {})",
                what.text()?,
                String::from_utf8_lossy(held.format()),
                held.itemsize()
            )));
        };
        Ok((dtype, self.push(Source::new(held, swap))))
    }

    /// One field of `n` rows.
    fn field(
        &mut self,
        name: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
        n: usize,
    ) -> PyResult<Field> {
        let py = self.py;
        let what = What { name, row: None };
        let h = self.h;
        if is_ndarray(value) {
            return self.regular(value, &what, n);
        }
        if value.is_instance(h.bits.bind(py))? {
            let data = value.getattr("data")?;
            if data.is_instance_of::<PyList>() || data.is_instance_of::<PyTuple>() {
                let dtype = value.getattr("dtype")?;
                let items: Vec<Bound<'py, PyAny>> = data.try_iter()?.collect::<PyResult<_>>()?;
                return self.nested(&what, &items, n, Some(&dtype));
            }
            return self.regular(value, &what, n);
        }
        if is_tensor(value) && value.getattr("is_nested")?.is_truthy()? {
            let parts = h.nested_tensor.bind(py).call1((value,))?;
            if let Ok(pair) = parts.cast::<PyTuple>() {
                let (values, offsets) = (pair.get_item(0)?, pair.get_item(1)?);
                return self.jagged(&what, &values, &offsets, n);
            }
            let items: Vec<Bound<'py, PyAny>> = parts.try_iter()?.collect::<PyResult<_>>()?;
            return self.nested(&what, &items, n, None);
        }
        if value.is_instance(h.packed.bind(py))? {
            return self.packed(&what, value, n);
        }
        if value.is_instance(h.ndarray.bind(py))? || is_tensor(value) {
            return self.regular(value, &what, n);
        }
        let items: Vec<Bound<'py, PyAny>> = if let Ok(list) = value.cast::<PyList>() {
            list.iter().collect()
        } else if let Ok(tuple) = value.cast::<PyTuple>() {
            tuple.iter().collect()
        } else {
            return Err(PyTypeError::new_err(format!(
                "{}: expected a numpy array or torch tensor [n, ...], a list of n \
                 arrays/tensors (nested), a nested torch tensor, or a list of n str/bytes \
                 values; got {}",
                what.text()?,
                value.get_type().name()?
            )));
        };
        self.nested(&what, &items, n, None)
    }

    fn regular(
        &mut self,
        value: &Bound<'py, PyAny>,
        what: &What<'_, 'py>,
        n: usize,
    ) -> PyResult<Field> {
        let (dtype, src) = self.tensor(value, what, None)?;
        let shape = self.sources[src].shape();
        if shape.is_empty() {
            return Err(PyValueError::new_err(format!(
                "{}: a regular field needs a row axis, got a 0-d array",
                what.text()?
            )));
        }
        if shape[0] != n {
            return Err(PyValueError::new_err(format!(
                "{} has {} rows but {n} global indexes were given",
                what.text()?,
                shape[0]
            )));
        }
        Ok(Field::Regular { dtype, src })
    }

    /// A list of `n` items: arrays of one dtype (nested; `bits`: each the
    /// data of `Bits(item, bits)`), or values.
    fn nested(
        &mut self,
        what: &What<'_, 'py>,
        items: &[Bound<'py, PyAny>],
        n: usize,
        bits: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Field> {
        if items.len() != n {
            return Err(PyValueError::new_err(format!(
                "{} has {} rows but {n} global indexes were given",
                what.text()?,
                items.len()
            )));
        }
        let h = self.h;
        let mut arrays = 0usize;
        for item in items {
            arrays += usize::from(bits.is_some() || is_array_like(h, item)?);
        }
        if arrays == 0 {
            return self.values(what, items);
        }
        if arrays < items.len() {
            return Err(PyTypeError::new_err(format!(
                "{} mixes arrays/tensors and plain values; a field is one or the other",
                what.text()?
            )));
        }
        let mut rows = Vec::with_capacity(items.len());
        let mut dtypes: Vec<Dtype> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let (dtype, src) = self.tensor(item, &what.row(i), bits)?;
            if !dtypes.contains(&dtype) {
                dtypes.push(dtype);
            }
            let s = &self.sources[src];
            let shape = s.shape().iter().map(|&d| d as u64).collect();
            rows.push((shape, whole_span(src, s)));
        }
        if dtypes.len() > 1 {
            let mut names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
            names.sort_unstable();
            let listed: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
            return Err(PyValueError::new_err(format!(
                "{}: nested rows must share one dtype, got [{}]",
                what.text()?,
                listed.join(", ")
            )));
        }
        Ok(Field::Nested {
            dtype: dtypes[0],
            rows: NestedRows::Each(rows),
        })
    }

    /// A values field.
    fn values(&mut self, what: &What<'_, 'py>, items: &[Bound<'py, PyAny>]) -> PyResult<Field> {
        let mut values = Vec::with_capacity(items.len());
        let mut costs = Vec::with_capacity(items.len());
        for (i, v) in items.iter().enumerate() {
            let (value, cost) = if let Ok(s) = v.cast::<PyString>() {
                let text = s.to_str()?;
                let chars = s.len()? as u64;
                let cost = if text.is_ascii() { chars } else { 4 * chars };
                (Value::Str(text.to_owned()), cost)
            } else if let Ok(b) = v.cast::<PyBytes>() {
                let b = b.as_bytes();
                (Value::Bytes(Bytes::copy_from_slice(b)), b.len() as u64)
            } else if v.is_instance_of::<PyByteArray>() || v.is_instance_of::<PyMemoryView>() {
                let b = PyBytes::type_object(self.py).call1((v,))?;
                let b = b.cast::<PyBytes>()?.as_bytes();
                (Value::Bytes(Bytes::copy_from_slice(b)), b.len() as u64)
            } else {
                match crate::codec::to_value(v) {
                    Ok(value) => (value, 64),
                    Err(e) => {
                        return Err(PyTypeError::new_err(format!(
                            "{}: cannot send {} as a value ({})",
                            what.row(i).text()?,
                            v.get_type().name()?,
                            e.value(self.py)
                        )));
                    }
                }
            };
            values.push(value);
            costs.push(cost);
        }
        Ok(Field::Values { values, costs })
    }

    /// A jagged tensor's `values` `[total, *tail]` and `offsets` (int64
    /// `[n + 1]`, row starts on the values' first axis), checked.
    fn jagged(
        &mut self,
        what: &What<'_, 'py>,
        values: &Bound<'py, PyAny>,
        offsets: &Bound<'py, PyAny>,
        n: usize,
    ) -> PyResult<Field> {
        let (dtype, src) = self.tensor(values, what, None)?;
        let offsets: Vec<i64> = offsets.extract()?;
        if offsets.len() != n + 1 {
            return Err(PyValueError::new_err(format!(
                "{} has {} rows but {n} global indexes were given",
                what.text()?,
                offsets.len().saturating_sub(1)
            )));
        }
        let shape = self.sources[src].shape();
        if shape.is_empty() {
            return Err(PyValueError::new_err(format!(
                "{}: packed values need a first axis, got a 0-d array",
                what.text()?
            )));
        }
        let total = shape[0] as i64;
        if offsets[0] != 0 || offsets[n] != total || offsets.windows(2).any(|w| w[1] < w[0]) {
            return Err(PyValueError::new_err(format!(
                "{}: offsets must rise from 0 to {total} (the values' first axis)",
                what.text()?
            )));
        }
        Ok(Field::Nested {
            dtype,
            rows: NestedRows::Runs {
                src,
                offsets: offsets.into_iter().map(|o| o as u64).collect(),
            },
        })
    }

    /// A `stowage.Packed`: runs of its values' first axis where the rows
    /// share one tail shape (no array per row), else a range of its
    /// values per row.
    fn packed(&mut self, what: &What<'_, 'py>, p: &Bound<'py, PyAny>, n: usize) -> PyResult<Field> {
        let (dtype, src) = self.tensor(&p.getattr("values")?, what, None)?;
        let shapes = p.getattr("shapes")?;
        let listed: Option<Vec<Bound<'py, PyAny>>> = if let Ok(l) = shapes.cast::<PyList>() {
            Some(l.iter().collect())
        } else if let Ok(t) = shapes.cast::<PyTuple>() {
            Some(t.iter().collect())
        } else {
            None
        };
        let shapes = match listed {
            Some(s) if s.len() == n => s,
            other => {
                let got = match other {
                    Some(s) => s.len().to_string(),
                    None => shapes.get_type().name()?.to_string(),
                };
                return Err(PyValueError::new_err(format!(
                    "{}: Packed.shapes must list {n} row shapes, got {got}",
                    what.text()?
                )));
            }
        };
        let int = PyInt::type_object(self.py);
        let mut rows: Vec<Vec<u64>> = Vec::with_capacity(n);
        for s in &shapes {
            let mut dims = Vec::new();
            for d in s.try_iter()? {
                let d = d?;
                let v: i128 = match d.extract::<i64>() {
                    Ok(v) if d.is_exact_instance_of::<PyInt>() => v as i128,
                    _ => int.call1((&d,))?.extract()?,
                };
                if v < 0 {
                    return Err(PyValueError::new_err(format!(
                        "{}: a row shape has a negative dimension",
                        what.text()?
                    )));
                }
                if dims.len() == MAX_DIMS {
                    return Err(PyValueError::new_err(format!(
                        "{}: a row shape has more than {MAX_DIMS} dimensions",
                        what.text()?
                    )));
                }
                dims.push(u64::try_from(v).unwrap_or(u64::MAX));
            }
            rows.push(dims);
        }
        // Element counts, in u128 (saturating: a shape that overflows it
        // holds more elements than any values can).
        let count = |s: &[u64]| -> u128 {
            if s.contains(&0) {
                return 0;
            }
            s.iter()
                .try_fold(1u128, |acc, &d| acc.checked_mul(u128::from(d)))
                .unwrap_or(u128::MAX)
        };
        let counts: Vec<u128> = rows.iter().map(|s| count(s)).collect();
        let sum = counts.iter().fold(0u128, |acc, &c| acc.saturating_add(c));
        let total = self.sources[src].elements();
        if sum != total as u128 {
            return Err(PyValueError::new_err(format!(
                "{}: the row shapes hold {sum} elements, values has {total}",
                what.text()?
            )));
        }
        let tail = rows
            .first()
            .filter(|s| !s.is_empty())
            .map(|s| s[1..].to_vec());
        let per = tail.as_deref().map(count).unwrap_or(0) as usize;
        let one_tail = tail.is_some()
            && per > 0
            && rows
                .iter()
                .all(|s| !s.is_empty() && s[1..] == *tail.as_deref().unwrap());
        let itemsize = self.sources[src].itemsize();
        let source = self.sources.pop().expect("the values just read");
        if one_tail {
            // Rows are runs of the first axis of values `[total / per, *tail]`.
            let mut shape = vec![total / per];
            shape.extend(tail.unwrap().iter().map(|&d| d as usize));
            let source = if source.shape() == shape.as_slice() {
                source
            } else {
                source.reshaped(shape)
            };
            let src = self.push(source);
            let mut offsets = Vec::with_capacity(n + 1);
            let mut at = 0u64;
            offsets.push(0);
            for c in &counts {
                at += (*c as u64) / per as u64;
                offsets.push(at);
            }
            return Ok(Field::Nested {
                dtype,
                rows: NestedRows::Runs { src, offsets },
            });
        }
        // One range of the values (C order, contiguous) per row.
        let src = self.push(source.reshaped(vec![total]));
        let mut at = 0usize;
        let each = rows
            .into_iter()
            .zip(&counts)
            .map(|(shape, &c)| {
                let len = c as usize * itemsize;
                let span = Span::Bytes { src, off: at, len };
                at += len;
                (shape, span)
            })
            .collect();
        Ok(Field::Nested {
            dtype,
            rows: NestedRows::Each(each),
        })
    }
}

/// A put's indexes: read by [`crate::indexes`], or, for anything it does
/// not plainly read (or a repeat), worded by `_codec.check_indexes`.
fn put_indexes(h: &Helpers, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Some(read) = read_indexes(obj)
        && read.distinct()
    {
        return Ok(read.into_vec());
    }
    let py = obj.py();
    let kwargs = PyDict::new(py);
    kwargs.set_item("unique", true)?;
    let checked = h.check_indexes.bind(py).call((obj, "put"), Some(&kwargs))?;
    match read_indexes(&checked) {
        Some(read) if read.distinct() => Ok(read.into_vec()),
        _ => Err(PyValueError::new_err(
            "put: global_indexes must be distinct non-negative ints below 2**64",
        )),
    }
}

/// Reads a put (see the module doc) and splits it into messages of at
/// most `limit` bytes (as the rows cost).
fn read_put(indexes: &Bound<'_, PyAny>, data: &Bound<'_, PyAny>, limit: u64) -> PyResult<Plan> {
    let py = indexes.py();
    let h = helpers(py)?;
    let indexes = put_indexes(h, indexes)?;
    let n = indexes.len();
    let items: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)> =
        if let Ok(d) = data.cast_exact::<PyDict>() {
            d.iter().collect()
        } else if let Ok(m) = data.cast::<PyMapping>() {
            m.items()?
                .iter()
                .map(|kv| kv.extract())
                .collect::<PyResult<_>>()?
        } else {
            return Err(PyTypeError::new_err(format!(
                "put: data must map field names to values, got {}",
                data.get_type().name()?
            )));
        };
    if items.is_empty() {
        return Err(PyValueError::new_err(
            "put: empty batch: data has no fields",
        ));
    }
    let mut reader = Reader {
        py,
        h,
        sources: Vec::with_capacity(items.len()),
    };
    let mut fields = Vec::with_capacity(items.len());
    for (name, value) in &items {
        let Ok(s) = name.cast::<PyString>() else {
            return Err(PyTypeError::new_err(format!(
                "field names must be str, got {}",
                name.repr()?
            )));
        };
        let field = reader.field(name, value, n)?;
        fields.push((stowage_wire::names::shared_name(s.to_str()?), field));
    }
    let sources = reader.sources;
    let mut plan = Plan {
        indexes,
        rows: n,
        fields,
        sources,
        messages: Vec::new(),
        nbytes: 0,
        cost: 0,
        single: None,
    };
    plan.split(limit);
    plan.lay_out_single();
    Ok(plan)
}

impl Plan {
    /// What row `i` adds to a message, besides the 16 bytes a field (and
    /// one) each row costs.
    fn row_cost(&self, i: usize) -> u64 {
        self.fields
            .iter()
            .map(|(_, f)| match f {
                Field::Regular { src, .. } => self.sources[*src].row_bytes() as u64,
                Field::Nested { rows, .. } => match rows {
                    NestedRows::Each(each) => self.span_len(each[i].1) as u64,
                    NestedRows::Runs { src, offsets } => {
                        (offsets[i + 1] - offsets[i]) * self.sources[*src].row_bytes() as u64
                    }
                },
                Field::Values { costs, .. } => costs[i],
            })
            .sum()
    }

    /// The bytes of every tensor field's rows.
    fn tensor_bytes(&self) -> u64 {
        let n = self.rows;
        self.fields
            .iter()
            .map(|(_, f)| match f {
                Field::Regular { src, .. } => self.sources[*src].nbytes() as u64,
                Field::Nested { rows, .. } => match rows {
                    NestedRows::Each(each) => {
                        each.iter().map(|(_, s)| self.span_len(*s) as u64).sum()
                    }
                    NestedRows::Runs { src, offsets } => {
                        offsets[n] * self.sources[*src].row_bytes() as u64
                    }
                },
                Field::Values { .. } => 0,
            })
            .sum()
    }

    /// Splits the rows into messages of at most `limit` bytes each (a row
    /// costlier than that goes alone).
    fn split(&mut self, limit: u64) {
        let n = self.rows;
        self.nbytes = self.tensor_bytes();
        let fixed = 16 * (1 + self.fields.len() as u64);
        let values: u64 = self
            .fields
            .iter()
            .map(|(_, f)| match f {
                Field::Values { costs, .. } => costs.iter().sum(),
                _ => 0,
            })
            .sum();
        let total = (fixed * n as u64)
            .saturating_add(self.nbytes)
            .saturating_add(values);
        self.cost = total;
        if total <= limit {
            self.messages = vec![(0, n)];
            return;
        }
        let mut cum = Vec::with_capacity(n);
        let mut sum = 0u64;
        for i in 0..n {
            sum = sum.saturating_add(fixed + self.row_cost(i));
            cum.push(sum);
        }
        let mut a = 0;
        while a < n {
            let base = if a == 0 { 0 } else { cum[a - 1] };
            let b = cum.partition_point(|&c| c <= base.saturating_add(limit));
            let b = b.max(a + 1);
            self.messages.push((a, b));
            a = b;
        }
    }
}
