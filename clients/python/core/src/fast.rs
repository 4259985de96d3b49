//! Small calls in one crossing into Rust: a call's arguments read as the
//! user gave them, frame 0 written, the data frames laid out and the reply
//! read here, with no per-field or per-index Python work.
//!
//! Why: a one-field put of 1-4 rows used to cost the client 66-81 µs of
//! its own CPU (release build, stowd on the client's CPU), nearly all of
//! it the Python layer: checking the indexes, normalizing each field,
//! planning the messages with numpy, building the descriptors, and
//! reading the reply; here it costs 16-17 (docs/benchmarks.md, "Small
//! calls: the client's fixed cost"). And a same-node get of half a million
//! indexes given as a Python list took 109 ms, most of it turning the list
//! into the wire's list one Python int at a time; read here, its runs go
//! as ranges (a few ms).
//!
//! Everything here is a fast path beside the general one, which stays the
//! reference: each function returns `None` (nothing sent) for any argument
//! that is not plainly what it reads, and the Python client then takes the
//! general path, which checks, words the error (a negative, out-of-range,
//! non-integer or repeated index; a field of the wrong rows) or handles
//! the rarer forms (torch tensors that need a copy, `Bits`, `Packed`,
//! nested tensors, puts larger than one message). So an input reads the
//! same here as there, or not at all here.
//!
//! What is read:
//! - indexes: a list or tuple of `int`s, a `range`, or a 1-d buffer of an
//!   integer item type (a numpy array of any integer dtype and stride,
//!   `array.array`, a memoryview; a CPU torch tensor through `.numpy()`),
//!   each in `0..2^64`;
//! - a put's fields: a `dict` of `str` to a numpy array (or a CPU torch
//!   tensor `.numpy()` shares memory with), C-contiguous, little-endian, of
//!   a stowage/1 dtype numpy has (a regular field); a list or tuple of such
//!   arrays of one dtype (nested); or a list or tuple of `str`, `bytes`,
//!   `int`, `float`, `bool` and `None` (values).
//!
//! The data frames are laid out as the Python client lays them out
//! (`stowage/_codec.py`, `_Frames`): a piece of at least
//! [`SMALL_PIECE_BYTES`] is a frame of its own, sent from the caller's
//! array; smaller ones share frames of at most [`COALESCED_FRAME_BYTES`],
//! each at a multiple of its itemsize (copied into the message's small
//! write buffer as it is written).

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyRange, PyString, PyTuple};
use stowage_wire::indexes::{IndexRun, Indexes};
use stowage_wire::native::{FieldLayout, PartLayout, RowLayout};
use stowage_wire::tensor::DType;

use crate::Held;

/// Pieces below this share a copied frame (`_codec.SMALL_PIECE_BYTES`).
pub(crate) const SMALL_PIECE_BYTES: usize = 64 << 10;
/// Most bytes in one shared frame (`_codec.COALESCED_FRAME_BYTES`).
pub(crate) const COALESCED_FRAME_BYTES: usize = 1 << 20;

/// Most indexes a `range` with a negative step is read into (beyond, the
/// general path decides; it names no index twice, so a put of that many
/// rows is held in memory anyway).
const MAX_LISTED_RANGE: u64 = 1 << 28;

/// Indexes as read: a `range` of positive step stays one run (never
/// listed), anything else is listed.
pub(crate) enum Read {
    Run(IndexRun),
    List(Vec<u64>),
    /// Grouped as they were read ([`read_runs`]).
    Runs(Indexes),
}

impl Read {
    pub(crate) fn len(&self) -> u64 {
        match self {
            Read::Run(r) => r.count,
            Read::List(v) => v.len() as u64,
            Read::Runs(ix) => ix.len(),
        }
    }

    pub(crate) fn into_vec(self) -> Vec<u64> {
        match self {
            Read::Run(r) => (0..r.count).map(|k| r.at(k)).collect(),
            Read::List(v) => v,
            Read::Runs(ix) => ix.to_vec(),
        }
    }

    /// As runs, grouped as [`Indexes::from_list`] groups them.
    pub(crate) fn into_indexes(self) -> Indexes {
        match self {
            // (A range's run: its count, step and last index checked when read.)
            Read::Run(r) => Indexes::from_runs(vec![r], u64::MAX).expect("a checked run"),
            Read::List(v) => Indexes::from_list(&v),
            Read::Runs(ix) => ix,
        }
    }

    /// Whether no index appears twice.
    pub(crate) fn distinct(&self) -> bool {
        match self {
            Read::Run(r) => r.step > 0 || r.count <= 1,
            Read::Runs(ix) => Read::List(ix.to_vec()).distinct(),
            Read::List(v) => {
                if v.windows(2).all(|w| w[0] < w[1]) {
                    return true;
                }
                let mut sorted = v.clone();
                sorted.sort_unstable();
                sorted.windows(2).all(|w| w[0] < w[1])
            }
        }
    }
}

/// `numpy.ndarray`, and `torch.Tensor` if torch is loaded: the types read
/// as arrays (exactly these, no subclass).
fn is_ndarray(obj: &Bound<'_, PyAny>) -> bool {
    static NDARRAY: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();
    let py = obj.py();
    let t = NDARRAY.get_or_init(py, || {
        py.import("numpy")
            .and_then(|np| np.getattr("ndarray"))
            .ok()
            .map(Bound::unbind)
    });
    t.as_ref().is_some_and(|t| obj.get_type().is(t.bind(py)))
}

/// `obj` as a numpy array if it is a torch tensor (exactly `torch.Tensor`)
/// that `.numpy()` shares memory with (on the CPU, no grad, a dtype numpy
/// has); None otherwise.
fn tensor_numpy<'py>(obj: &Bound<'py, PyAny>) -> Option<Bound<'py, PyAny>> {
    // (Most objects asked about are lists or values: turned away by their
    // type's name before torch is looked up, and without an exception.)
    if !obj.get_type().name().is_ok_and(|n| n == "Tensor") {
        return None;
    }
    let py = obj.py();
    let modules = py.import("sys").ok()?.getattr("modules").ok()?;
    let torch = modules.cast::<PyDict>().ok()?.get_item("torch").ok()??;
    let tensor = torch.getattr("Tensor").ok()?;
    if !obj.get_type().is(&tensor) {
        return None;
    }
    obj.call_method0("numpy").ok().filter(is_ndarray)
}

/// Reads `obj` as global indexes (see the module doc), listed; None if it
/// is not plainly a sequence of ints in `0..2^64` (or is empty).
pub(crate) fn read_indexes(obj: &Bound<'_, PyAny>) -> Option<Read> {
    read_with(obj, Vec::new()).map(|(read, list)| read.unwrap_or(Read::List(list)))
}

/// Reads `obj` as [`read_indexes`] does, into runs as it reads (never
/// listed: half a million indexes in put order are one run, and no 4 MiB
/// list is allocated, on fresh pages, to find that out): for a get.
pub(crate) fn read_runs(obj: &Bound<'_, PyAny>) -> Option<Read> {
    read_with(obj, RunBuilder::default())
        .map(|(read, runs)| read.unwrap_or_else(|| Read::Runs(runs.finish())))
}

/// Where indexes go as they are read.
pub(crate) trait Sink {
    fn reserve(&mut self, n: usize);
    fn push(&mut self, v: u64);
    fn len(&self) -> u64;
    /// Every index of `vals`, in order (a contiguous array's).
    fn extend_from(&mut self, vals: &[u64]) {
        vals.iter().for_each(|&v| self.push(v));
    }
}

impl Sink for Vec<u64> {
    fn reserve(&mut self, n: usize) {
        Vec::reserve(self, n)
    }
    fn push(&mut self, v: u64) {
        Vec::push(self, v)
    }
    fn len(&self) -> u64 {
        Vec::len(self) as u64
    }
    fn extend_from(&mut self, vals: &[u64]) {
        self.extend_from_slice(vals)
    }
}

/// Groups indexes into runs as they come, as [`Indexes::from_list`] groups
/// a list (greedy: a run goes on while the step stays the same).
#[derive(Default)]
pub(crate) struct RunBuilder {
    runs: Vec<IndexRun>,
    /// The run being built: start, count, step (meaningful from 2 on), last.
    open: Option<(u64, u64, u64, u64)>,
    len: u64,
}

impl RunBuilder {
    fn finish(mut self) -> Indexes {
        if let Some((start, count, step, _)) = self.open.take() {
            let step = if count == 1 { 0 } else { step };
            self.runs.push(IndexRun { start, count, step });
        }
        // Grouped as from_list groups them (`push`), so taken as they are.
        Indexes::from_grouped_runs(self.runs, self.len)
            .expect("runs of at least one index each, within u64, adding up to len")
    }
}

impl Sink for RunBuilder {
    fn reserve(&mut self, _: usize) {}

    fn push(&mut self, v: u64) {
        self.len += 1;
        self.open = Some(match self.open {
            None => (v, 1, 0, v),
            Some((start, 1, _, _)) if v >= start => (start, 2, v - start, v),
            Some((start, count, step, last)) if count >= 2 && v.checked_sub(last) == Some(step) => {
                (start, count + 1, step, v)
            }
            Some((start, count, step, _)) => {
                let step = if count == 1 { 0 } else { step };
                self.runs.push(IndexRun { start, count, step });
                (v, 1, 0, v)
            }
        });
    }

    fn len(&self) -> u64 {
        self.len
    }

    /// As `push` for each, with a run's continuation found by one tight
    /// scan (half a million indexes in put order: one comparison each).
    fn extend_from(&mut self, vals: &[u64]) {
        let mut i = 0;
        while i < vals.len() {
            if let Some((start, count, step, last)) = self.open
                && count >= 2
            {
                let mut prev = last;
                let mut j = i;
                while j < vals.len() && prev.checked_add(step) == Some(vals[j]) {
                    prev = vals[j];
                    j += 1;
                }
                if j > i {
                    let k = (j - i) as u64;
                    self.open = Some((start, count + k, step, prev));
                    self.len += k;
                    i = j;
                    continue;
                }
            }
            self.push(vals[i]);
            i += 1;
        }
    }
}

/// Reads `obj` into `sink`; a positive-step `range` is returned as a run
/// instead (never listed). None if `obj` is not plainly indexes, or empty.
fn read_with<S: Sink>(obj: &Bound<'_, PyAny>, mut sink: S) -> Option<(Option<Read>, S)> {
    let ok = if let Ok(list) = obj.cast_exact::<PyList>() {
        // SAFETY: a list, read under the GIL (which nothing here releases).
        unsafe { ints(obj.as_ptr(), list.len(), ffi::PyList_GetItem, &mut sink) }
    } else if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
        // SAFETY: a tuple, as above.
        unsafe { ints(obj.as_ptr(), tuple.len(), ffi::PyTuple_GetItem, &mut sink) }
    } else if let Ok(range) = obj.cast_exact::<PyRange>() {
        match read_range(range, &mut sink)? {
            Some(run) => return Some((Some(Read::Run(run)), sink)),
            None => Some(()),
        }
    } else if obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<pyo3::types::PyByteArray>()
    {
        None
    } else if let Some(a) = tensor_numpy(obj) {
        read_buffer(&a, &mut sink)
    } else {
        read_buffer(obj, &mut sink)
    };
    ok?;
    (sink.len() > 0).then_some((None, sink))
}

/// The items of a list or tuple of `len` items into `sink`, if every one
/// is exactly an `int` in range.
///
/// # Safety
/// `seq` is a list (with `PyList_GetItem`) or a tuple (with
/// `PyTuple_GetItem`) of at least `len` items; the GIL is held.
unsafe fn ints<S: Sink>(
    seq: *mut ffi::PyObject,
    len: usize,
    get: unsafe extern "C" fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject,
    sink: &mut S,
) -> Option<()> {
    sink.reserve(len);
    // SAFETY: the caller's contract; each item is borrowed for the loop turn.
    unsafe {
        let int_type = std::ptr::addr_of_mut!(ffi::PyLong_Type);
        for i in 0..len {
            let item = get(seq, i as ffi::Py_ssize_t);
            if item.is_null() || ffi::Py_TYPE(item) != int_type {
                ffi::PyErr_Clear();
                return None;
            }
            let v = ffi::PyLong_AsUnsignedLongLong(item);
            if v == u64::MAX && !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear();
                return None;
            }
            sink.push(v);
        }
    }
    Some(())
}

/// A `range`: its one run if its step is positive, else its indexes into
/// `sink` (None: not indexes).
fn read_range<S: Sink>(range: &Bound<'_, PyRange>, sink: &mut S) -> Option<Option<IndexRun>> {
    let start: i128 = range.getattr("start").ok()?.extract().ok()?;
    let step: i128 = range.getattr("step").ok()?.extract().ok()?;
    let len: u64 = range.len().ok()? as u64;
    if len == 0 {
        return Some(None);
    }
    let last = start + step * (len as i128 - 1);
    if start < 0 || last < 0 || start > u64::MAX as i128 || last > u64::MAX as i128 {
        return None;
    }
    if step > 0 {
        return Some(Some(IndexRun {
            start: start as u64,
            count: len,
            step: step as u64,
        }));
    }
    if len > MAX_LISTED_RANGE {
        return None;
    }
    sink.reserve(len as usize);
    for k in 0..len as i128 {
        sink.push((start + step * k) as u64);
    }
    Some(None)
}

/// The integer item type of a buffer format: (signed, itemsize), for a
/// little-endian (or native, on a little-endian machine) integer format.
fn int_format(format: &[u8], itemsize: usize) -> Option<bool> {
    let code = match format {
        [b'@' | b'=' | b'<', c] | [c] => *c,
        _ => return None,
    };
    if format.len() == 2 && format[0] == b'@' && cfg!(target_endian = "big") {
        return None;
    }
    let (signed, size) = match code {
        b'b' => (true, 1),
        b'B' => (false, 1),
        b'h' => (true, 2),
        b'H' => (false, 2),
        b'i' => (true, 4),
        b'I' => (false, 4),
        b'l' | b'q' | b'n' => (true, itemsize),
        b'L' | b'Q' | b'N' => (false, itemsize),
        _ => return None,
    };
    (size == itemsize && matches!(itemsize, 1 | 2 | 4 | 8)).then_some(signed)
}

/// A 1-d buffer of an integer item type, any stride, into `sink`, if
/// each item is at least 0.
fn read_buffer<S: Sink>(obj: &Bound<'_, PyAny>, sink: &mut S) -> Option<()> {
    let held = Held::with_flags(obj, ffi::PyBUF_RECORDS_RO).ok()?;
    let size = held.itemsize();
    let signed = int_format(held.format(), size)?;
    if held.ndim() != 1 {
        return None;
    }
    let n = held.shape()[0] as usize;
    let stride = held.stride0();
    let base = held.ptr();
    sink.reserve(n);
    if size == 8
        && stride == 8
        && (base as usize).is_multiple_of(8)
        && cfg!(target_endian = "little")
    {
        // A contiguous, aligned array of 64-bit ints: read as it lies.
        // SAFETY: n aligned 8-byte items at `base`, alive while `held` is.
        let vals = unsafe { std::slice::from_raw_parts(base.cast::<u64>(), n) };
        if signed && vals.iter().any(|&v| v >> 63 == 1) {
            return None; // negative
        }
        sink.extend_from(vals);
        return Some(());
    }
    // One loop per item size (the read and the sign test inlined in each).
    fn each<S: Sink, const N: usize>(
        base: *const u8,
        stride: isize,
        n: usize,
        signed: bool,
        sink: &mut S,
    ) -> Option<()> {
        for k in 0..n {
            let mut b = [0u8; 8];
            // SAFETY: item k of a 1-d buffer of n items of N bytes lies at
            // base + k * stride, alive while the caller holds the buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(base.offset(k as isize * stride), b.as_mut_ptr(), N)
            };
            let v = u64::from_le_bytes(b);
            if signed && (v >> (N * 8 - 1)) & 1 == 1 {
                return None; // negative
            }
            sink.push(v);
        }
        Some(())
    }
    match size {
        1 => each::<S, 1>(base, stride, n, signed, sink),
        2 => each::<S, 2>(base, stride, n, signed, sink),
        4 => each::<S, 4>(base, stride, n, signed, sink),
        _ => each::<S, 8>(base, stride, n, signed, sink),
    }
}

/// Field names as a get or clear takes them: a `str`, or a non-empty list
/// or tuple of distinct `str`s.
pub(crate) fn read_names(obj: &Bound<'_, PyAny>) -> Option<Vec<String>> {
    if let Ok(s) = obj.cast_exact::<PyString>() {
        return Some(vec![s.to_str().ok()?.to_owned()]);
    }
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = obj.cast_exact::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return None;
    };
    if items.is_empty() {
        return None;
    }
    let mut names = Vec::with_capacity(items.len());
    for item in &items {
        let s = item.cast_exact::<PyString>().ok()?.to_str().ok()?;
        if names.iter().any(|n: &String| n == s) {
            return None;
        }
        names.push(s.to_owned());
    }
    Some(names)
}

/// The stowage/1 dtype of a buffer's item format, for the formats numpy
/// exports (little-endian or native on a little-endian machine).
fn dtype_of(format: &[u8], itemsize: usize) -> Option<DType> {
    let code: &[u8] = match format {
        [b'@' | b'=' | b'<', rest @ ..] => rest,
        rest => rest,
    };
    if matches!(format.first(), Some(b'@')) && cfg!(target_endian = "big") {
        return None;
    }
    let name = match (code, itemsize) {
        (b"?", 1) => "bool",
        (b"b", 1) => "int8",
        (b"B", 1) => "uint8",
        (b"h", 2) => "int16",
        (b"H", 2) => "uint16",
        (b"i", 4) | (b"l", 4) => "int32",
        (b"I", 4) | (b"L", 4) => "uint32",
        (b"l" | b"q", 8) => "int64",
        (b"L" | b"Q", 8) => "uint64",
        (b"e", 2) => "float16",
        (b"f", 4) => "float32",
        (b"d", 8) => "float64",
        (b"Zf", 8) => "complex64",
        (b"Zd", 16) => "complex128",
        _ => return None,
    };
    DType::from_name(name)
}

/// One array of a put (a regular field, or a nested field's row): its
/// held buffer, dtype, shape.
struct Array {
    held: Held,
    dtype: DType,
    shape: Vec<u64>,
}

/// `obj` as an [`Array`], if it is a numpy array (or a torch tensor
/// `.numpy()` shares memory with), C-contiguous, of a dtype read here.
fn read_array(obj: &Bound<'_, PyAny>) -> Option<Array> {
    let owned;
    let obj = if is_ndarray(obj) {
        obj
    } else {
        owned = tensor_numpy(obj)?;
        &owned
    };
    let flags = ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_FORMAT;
    let held = match Held::with_flags(obj, flags) {
        Ok(h) => h,
        Err(_) => return None,
    };
    let dtype = dtype_of(held.format(), held.itemsize())?;
    let shape = held.shape();
    Some(Array { held, dtype, shape })
}

/// A get_into's destination: a numpy array (or a CPU torch tensor that
/// `.numpy()` shares memory with), writable, C-contiguous, of a dtype read
/// here: (its dtype names accepted from stowd, its shape, its held
/// buffer). An int array also takes the raw bits of the dtypes numpy has
/// no type for, of its itemsize (`Client.get_into`).
pub(crate) fn read_out(obj: &Bound<'_, PyAny>) -> Option<(Vec<String>, Vec<u64>, Held)> {
    let owned;
    let obj = if is_ndarray(obj) {
        obj
    } else {
        owned = tensor_numpy(obj)?;
        &owned
    };
    let flags = ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_FORMAT | ffi::PyBUF_WRITABLE;
    let held = Held::with_flags(obj, flags).ok()?;
    let dtype = dtype_of(held.format(), held.itemsize())?;
    let mut accepted = vec![dtype.name().to_owned()];
    if dtype.name().contains("int") {
        accepted.extend(
            DType::ALL
                .iter()
                .filter(|d| RAW_BITS.contains(&d.name()) && d.itemsize() == dtype.itemsize())
                .map(|d| d.name().to_owned()),
        );
    }
    let shape = held.shape();
    Some((accepted, shape, held))
}

/// The dtypes numpy has no type for, carried as raw bits (`_dtypes.BITS_DTYPES`).
const RAW_BITS: [&str; 8] = [
    "bfloat16",
    "complex32",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
];

/// A piece of a data frame: bytes of a held array, or zeros (alignment).
#[derive(Clone, Copy)]
pub(crate) enum Piece {
    Array(usize),
    Zeros(usize),
}

/// The data frames of one message being laid out (`_codec._Frames`).
#[derive(Default)]
struct Frames {
    frames: Vec<Vec<Piece>>,
    /// The shared frame being filled (1-based frame number) and its length.
    shared: Option<(u64, usize)>,
}

impl Frames {
    /// Adds array `k` (`nbytes`, items of `itemsize`): (frame, offset).
    fn add(&mut self, k: usize, nbytes: usize, itemsize: usize) -> (u64, u64) {
        if nbytes >= SMALL_PIECE_BYTES {
            self.frames.push(vec![Piece::Array(k)]);
            return (self.frames.len() as u64, 0);
        }
        let align = itemsize.clamp(1, 16);
        let (frame, mut len) = match self.shared {
            Some((f, len)) if len + align + nbytes <= COALESCED_FRAME_BYTES => (f, len),
            _ => {
                self.frames.push(Vec::new());
                (self.frames.len() as u64, 0)
            }
        };
        let pieces = &mut self.frames[frame as usize - 1];
        let pad = (align - len % align) % align;
        if pad > 0 {
            pieces.push(Piece::Zeros(pad));
            len += pad;
        }
        if nbytes > 0 {
            pieces.push(Piece::Array(k));
        }
        self.shared = Some((frame, len + nbytes));
        (frame, len as u64)
    }
}

/// A put read and laid out: its indexes, fields' layouts, the arrays its
/// data frames are made of, and the frames as pieces of them.
pub(crate) struct PutPlan {
    pub(crate) indexes: Vec<u64>,
    pub(crate) fields: Vec<(String, FieldLayout)>,
    arrays: Vec<Held>,
    pub(crate) frames: Vec<Vec<Piece>>,
}

static ZEROS: [u8; 16] = [0; 16];

impl PutPlan {
    /// The data frames as byte slices (of the held arrays, and zeros).
    pub(crate) fn frame_slices(&self) -> Vec<Vec<&[u8]>> {
        self.frames
            .iter()
            .map(|pieces| {
                pieces
                    .iter()
                    .map(|p| match *p {
                        Piece::Array(k) => self.arrays[k].bytes(),
                        Piece::Zeros(n) => &ZEROS[..n],
                    })
                    .collect()
            })
            .collect()
    }

    /// The arrays, to be let go (with the GIL held).
    pub(crate) fn release(self) {
        drop(self.arrays);
    }

    /// Lays out `array` in `frames` (its bytes added to `cost`) and holds
    /// it: (frame, offset, bytes).
    fn place(&mut self, frames: &mut Frames, cost: &mut usize, array: Held) -> (u64, u64, usize) {
        let nbytes = array.bytes().len();
        *cost = cost.saturating_add(nbytes);
        let (frame, offset) = frames.add(self.arrays.len(), nbytes, array.itemsize());
        self.arrays.push(array);
        (frame, offset, nbytes)
    }

    /// Frame 0 of the put, request id `id`, and its rows (None: one the
    /// codec cannot write, for the general path). The layouts are taken;
    /// the arrays stay held for the data frames.
    pub(crate) fn frame0(&mut self, id: u64) -> Option<(bytes::Bytes, u64)> {
        let rows = self.indexes.len() as u64;
        let head = stowage_wire::native::RequestHead::Put {
            global_indexes: std::mem::take(&mut self.indexes),
            fields: std::mem::take(&mut self.fields),
        };
        stowage_wire::native::encode_request_head(id, &head)
            .ok()
            .map(|f| (f, rows))
    }
}

/// About how many bytes a row of a values field adds to a message
/// (`_codec._row_costs`).
fn value_cost(v: &Bound<'_, PyAny>) -> usize {
    if let Ok(b) = v.cast_exact::<PyBytes>() {
        return b.as_bytes().len();
    }
    if let Ok(s) = v.cast_exact::<PyString>() {
        let len = s.len().unwrap_or(0);
        return match s.to_str() {
            Ok(t) if t.is_ascii() => len,
            _ => 4 * len,
        };
    }
    64
}

/// A value read here: exactly `str`, `bytes`, `int`, `float`, `bool` or `None`.
fn plain_value(v: &Bound<'_, PyAny>) -> bool {
    v.is_exact_instance_of::<PyString>()
        || v.is_exact_instance_of::<PyBytes>()
        || v.is_exact_instance_of::<pyo3::types::PyInt>()
        || v.is_exact_instance_of::<pyo3::types::PyFloat>()
        || v.is_exact_instance_of::<pyo3::types::PyBool>()
        || v.is_none()
}

/// Reads and lays out a put of `indexes` and `data` as one message of at
/// most `max_bytes` (the general path's estimate); None when it is not
/// plainly that (see the module doc). Errors only for a failure of Python
/// itself (a value msgpack refuses is for the general path to word: None).
pub(crate) fn plan_put(
    indexes: &Bound<'_, PyAny>,
    data: &Bound<'_, PyAny>,
    max_bytes: usize,
) -> PyResult<Option<PutPlan>> {
    let Ok(data) = data.cast_exact::<PyDict>() else {
        return Ok(None);
    };
    if data.is_empty() {
        return Ok(None);
    }
    // How many indexes, without reading them: the fields are checked (and
    // a put of more than one message turned away) before any is read.
    let n = match indexes.len() {
        Ok(n) if n > 0 => n as u64,
        _ => return Ok(None),
    };
    let mut plan = PutPlan {
        indexes: Vec::new(),
        fields: Vec::with_capacity(data.len()),
        arrays: Vec::new(),
        frames: Vec::new(),
    };
    let mut frames = Frames::default();
    // `_codec._row_costs` summed: 16 bytes a row and field, plus each row's bytes.
    let mut cost = 16usize
        .saturating_mul(1 + data.len())
        .saturating_mul(n as usize);
    for (name, value) in data.iter() {
        let Ok(name) = name.cast_exact::<PyString>() else {
            return Ok(None);
        };
        let name = name.to_str()?.to_owned();
        let field = if let Some(a) = read_array(&value) {
            if a.shape.first() != Some(&n) {
                return Ok(None);
            }
            let (frame, offset, nbytes) = plan.place(&mut frames, &mut cost, a.held);
            FieldLayout::Regular {
                dtype: a.dtype,
                shape: a.shape,
                parts: vec![PartLayout {
                    frame,
                    offset,
                    len: nbytes as u64,
                    rows: n,
                }],
            }
        } else {
            let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = value.cast_exact::<PyList>() {
                list.iter().collect()
            } else if let Ok(tuple) = value.cast_exact::<PyTuple>() {
                tuple.iter().collect()
            } else {
                return Ok(None);
            };
            if items.len() as u64 != n {
                return Ok(None);
            }
            if is_ndarray(&items[0]) {
                let mut rows = Vec::with_capacity(items.len());
                let mut dtype = None;
                for item in &items {
                    if !is_ndarray(item) {
                        return Ok(None);
                    }
                    let Some(a) = read_array(item) else {
                        return Ok(None);
                    };
                    if *dtype.get_or_insert(a.dtype) != a.dtype {
                        return Ok(None);
                    }
                    let (frame, offset, nbytes) = plan.place(&mut frames, &mut cost, a.held);
                    rows.push(RowLayout {
                        shape: a.shape,
                        frame,
                        offset,
                        len: nbytes as u64,
                    });
                }
                FieldLayout::Nested {
                    dtype: dtype.expect("at least one row"),
                    rows,
                }
            } else {
                let mut values = Vec::with_capacity(items.len());
                for item in &items {
                    if !plain_value(item) {
                        return Ok(None);
                    }
                    cost = cost.saturating_add(value_cost(item));
                    match crate::codec::to_value(item) {
                        Ok(v) => values.push(v),
                        Err(_) => return Ok(None),
                    }
                }
                FieldLayout::Values(values)
            }
        };
        plan.fields.push((name, field));
        if cost > max_bytes {
            return Ok(None);
        }
    }
    let Some(read) = read_indexes(indexes) else {
        return Ok(None);
    };
    if read.len() != n || !read.distinct() {
        return Ok(None);
    }
    plan.frames = frames.frames;
    plan.indexes = read.into_vec();
    Ok(Some(plan))
}

/// Index lists read by the core, for the general path's requests: held in
/// Rust, written into frame 0 by `encode_request` as runs where that is
/// shorter.
#[pyclass(module = "stowage._core", frozen)]
pub(crate) struct IndexList {
    pub(crate) indexes: Indexes,
}

#[pymethods]
impl IndexList {
    fn __len__(&self) -> usize {
        self.indexes.len() as usize
    }

    /// The indexes as a list of ints.
    fn tolist(&self) -> Vec<u64> {
        self.indexes.to_vec()
    }

    /// How many runs the indexes make.
    #[getter]
    fn runs(&self) -> usize {
        self.indexes.runs().len()
    }
}

/// `global_indexes` read by the core (see the module doc): an
/// [`IndexList`], or None for the general path to check and word (an
/// empty one, a repeated index when `distinct`, anything not plainly
/// ints in `0..2^64`).
#[pyfunction]
#[pyo3(signature = (global_indexes, distinct = false))]
pub(crate) fn read_index_list(
    global_indexes: &Bound<'_, PyAny>,
    distinct: bool,
) -> PyResult<Option<IndexList>> {
    let read = if distinct {
        read_indexes(global_indexes)
    } else {
        read_runs(global_indexes)
    };
    let Some(read) = read else {
        return Ok(None);
    };
    if distinct && !read.distinct() {
        return Ok(None);
    }
    Ok(Some(IndexList {
        indexes: read.into_indexes(),
    }))
}

/// An [`IndexList`] or a Python list of ints, as a Vec.
pub(crate) fn index_vec(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(list) = obj.cast::<IndexList>() {
        return Ok(list.get().indexes.to_vec());
    }
    obj.extract()
        .map_err(|e| PyValueError::new_err(format!("global_indexes: {e}")))
}

/// A put read and laid out as [`plan_put`] does, for a sender of its own
/// (the asyncio client's DEALER): (frame 0, its data frames as bytes,
/// rows), each shared frame joined, as pyzmq sends a frame from one
/// buffer; or None for the general path.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub(crate) fn encode_put<'py>(
    py: Python<'py>,
    id: u64,
    indexes: &Bound<'py, PyAny>,
    data: &Bound<'py, PyAny>,
    max_bytes: usize,
) -> PyResult<Option<(Bound<'py, PyBytes>, Vec<Bound<'py, PyBytes>>, u64)>> {
    let Some(mut plan) = plan_put(indexes, data, max_bytes)? else {
        return Ok(None);
    };
    let Some((frame0, rows)) = plan.frame0(id) else {
        plan.release();
        return Ok(None);
    };
    let frames = plan
        .frame_slices()
        .iter()
        .map(|pieces| {
            let len = pieces.iter().map(|p| p.len()).sum();
            PyBytes::new_with(py, len, |out| {
                let mut at = 0;
                for p in pieces {
                    out[at..at + p.len()].copy_from_slice(p);
                    at += p.len();
                }
                Ok(())
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    plan.release();
    Ok(Some((PyBytes::new(py, &frame0), frames, rows)))
}

/// A get of `indexes` and `fields` read as `Connection.get_fast` reads
/// them, for a sender of its own: (how many indexes, the field names,
/// frame 0); or None for the general path.
#[pyfunction]
#[pyo3(signature = (id, indexes, fields, ranges = true))]
#[allow(clippy::type_complexity)]
pub(crate) fn encode_get<'py>(
    py: Python<'py>,
    id: u64,
    indexes: &Bound<'py, PyAny>,
    fields: &Bound<'py, PyAny>,
    ranges: bool,
) -> PyResult<Option<(u64, Vec<String>, Bound<'py, PyBytes>)>> {
    let Some(head) = get_head(indexes, fields, ranges) else {
        return Ok(None);
    };
    let (n, names, head) = head;
    let Ok(frame0) = stowage_wire::native::encode_request_head(id, &head) else {
        return Ok(None);
    };
    Ok(Some((n, names, PyBytes::new(py, &frame0))))
}

/// A get's request head, read as the fast paths read it: (how many
/// indexes, the names, the head).
pub(crate) fn get_head(
    indexes: &Bound<'_, PyAny>,
    fields: &Bound<'_, PyAny>,
    ranges: bool,
) -> Option<(u64, Vec<String>, stowage_wire::native::RequestHead)> {
    use stowage_wire::native::{Op, RequestHead};
    let names = read_names(fields)?;
    let read = read_runs(indexes)?;
    let n = read.len();
    let head = if ranges {
        RequestHead::Other(Op::Get {
            global_indexes: read.into_indexes(),
            fields: names.clone(),
        })
    } else {
        RequestHead::GetList {
            global_indexes: read.into_vec(),
            fields: names.clone(),
        }
    };
    Some((n, names, head))
}
