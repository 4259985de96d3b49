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
//! - indexes: as [`crate::indexes`] reads them;
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

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use stowage_wire::native::{FieldLayout, PartLayout, RowLayout};
use stowage_wire::tensor::Dtype;

use crate::assemble::RAW_BITS;
use crate::buffer::Held;
use crate::indexes::{is_ndarray, read_indexes, read_runs, tensor_numpy};

/// Pieces below this share a copied frame (`_codec.SMALL_PIECE_BYTES`).
pub(crate) const SMALL_PIECE_BYTES: usize = 64 << 10;
/// Most bytes in one shared frame (`_codec.COALESCED_FRAME_BYTES`).
pub(crate) const COALESCED_FRAME_BYTES: usize = 1 << 20;

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
fn dtype_of(format: &[u8], itemsize: usize) -> Option<Dtype> {
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
    Dtype::from_name(name)
}

/// One array of a put (a regular field, or a nested field's row): its
/// held buffer, dtype, shape.
struct Array {
    held: Held,
    dtype: Dtype,
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
/// `.numpy()` shares memory with), writable, contiguous or strided, of a
/// dtype read here: (its dtype names accepted from stowd, its shape, its held
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
    let flags = ffi::PyBUF_STRIDES | ffi::PyBUF_FORMAT | ffi::PyBUF_WRITABLE;
    let held = Held::with_flags(obj, flags).ok()?;
    let dtype = dtype_of(held.format(), held.itemsize())?;
    let mut accepted = vec![dtype.name().to_owned()];
    if dtype.name().contains("int") {
        accepted.extend(
            Dtype::ALL
                .iter()
                .filter(|d| RAW_BITS.contains(&d.name()) && d.itemsize() == dtype.itemsize())
                .map(|d| d.name().to_owned()),
        );
    }
    let shape = held.shape();
    Some((accepted, shape, held))
}

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
