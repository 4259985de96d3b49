//! Small calls in one crossing into Rust: a get's, get_into's or clear's
//! arguments read as the user gave them, frame 0 written and the reply
//! read here, with no per-field or per-index Python work. (A put is read
//! and laid out by [`crate::put`], for every input kind.)
//!
//! Why: a one-field put of 1-4 rows used to cost the client 66-81 µs of
//! its own CPU (release build, stowd on the client's CPU), nearly all of
//! it the Python layer: checking the indexes, normalizing each field,
//! planning the messages with numpy, building the descriptors, and
//! reading the reply; read in Rust it costs 16-17 (docs/benchmarks.md,
//! "Small calls: the client's fixed cost"). And a same-node get of half a
//! million indexes given as a Python list took 109 ms, most of it turning
//! the list into the wire's list one Python int at a time; read here, its
//! runs go as ranges (a few ms).
//!
//! Everything here is a fast path beside the general one: each function
//! returns `None` (nothing sent) for any argument that is not plainly what
//! it reads, and the Python client then takes the general path, which
//! checks and words the error (a negative, out-of-range, non-integer
//! index; a field named twice) or handles the rarer forms. So an input
//! reads the same here as there, or not at all here.
//!
//! What is read: indexes as [`crate::indexes`] reads them; field names (a
//! `str`, or a list or tuple of distinct `str`s); a get_into's arrays
//! (numpy arrays or CPU torch tensors `.numpy()` shares memory with,
//! writable, any strides, of a dtype numpy has, little-endian).

use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};
use stowage_wire::names::shared_name;
use stowage_wire::tensor::Dtype;

use crate::assemble::RAW_BITS;
use crate::buffer::Held;
use crate::indexes::{is_ndarray, read_runs, tensor_numpy};

/// Most names checked for repeats by a scan ([`read_names`]).
const SCAN_NAMES: usize = 16;

/// Field names as a get or clear takes them: a `str`, or a non-empty list
/// or tuple of distinct `str`s.
pub(crate) fn read_names(obj: &Bound<'_, PyAny>) -> Option<Vec<Arc<str>>> {
    if let Ok(s) = obj.cast_exact::<PyString>() {
        return Some(vec![shared_name(s.to_str().ok()?)]);
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
    // This thread's shared names (`shared_name`): a get names the same
    // fields again and again, and a `String` a name was an allocation and
    // a free a field of every get.
    let mut names: Vec<Arc<str>> = Vec::with_capacity(items.len());
    // Repeats found by a scan of the few names a small call asks for, by a
    // set past that: a scan of 32 names compared about 280 pairs a call.
    // foldhash, not SipHash: SipHash's setup and rounds were about 500
    // instructions a name of a 32-field get (callgrind).
    let mut seen = (items.len() > SCAN_NAMES).then(|| {
        std::collections::HashSet::with_capacity_and_hasher(
            items.len(),
            foldhash::fast::RandomState::default(),
        )
    });
    for item in &items {
        let s = item.cast_exact::<PyString>().ok()?.to_str().ok()?;
        let repeat = match &mut seen {
            Some(seen) => !seen.insert(s),
            None => names.iter().any(|n| **n == *s),
        };
        if repeat {
            return None;
        }
        names.push(shared_name(s));
    }
    Some(names)
}

/// The stowage/1 dtype of a buffer's item format, and the unit its bytes
/// are swapped in to read them little-endian (1: nothing to swap; a
/// complex number's two parts each), for the formats numpy exports.
pub(crate) fn format_dtype(format: &[u8], itemsize: usize) -> Option<(Dtype, usize)> {
    let (big, code) = match format {
        [b'<', rest @ ..] => (false, rest),
        [b'>' | b'!', rest @ ..] => (true, rest),
        [b'@' | b'=', rest @ ..] => (cfg!(target_endian = "big"), rest),
        rest => (cfg!(target_endian = "big"), rest),
    };
    let dtype = match (code, itemsize) {
        (b"?", 1) => Dtype::Bool,
        (b"b", 1) => Dtype::Int8,
        (b"B", 1) => Dtype::Uint8,
        (b"h", 2) => Dtype::Int16,
        (b"H", 2) => Dtype::Uint16,
        (b"i", 4) | (b"l", 4) => Dtype::Int32,
        (b"I", 4) | (b"L", 4) => Dtype::Uint32,
        (b"l" | b"q", 8) => Dtype::Int64,
        (b"L" | b"Q", 8) => Dtype::Uint64,
        (b"e", 2) => Dtype::Float16,
        (b"f", 4) => Dtype::Float32,
        (b"d", 8) => Dtype::Float64,
        (b"Zf", 8) => Dtype::Complex64,
        (b"Zd", 16) => Dtype::Complex128,
        _ => return None,
    };
    let unit = match (big, code.first()) {
        (false, _) => 1,
        (true, Some(b'Z')) => itemsize / 2,
        (true, _) => itemsize,
    };
    Some((dtype, unit))
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
    let (dtype, _) = format_dtype(held.format(), held.itemsize()).filter(|&(_, unit)| unit == 1)?;
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

/// A get's indexes, as its frame 0 writes them: as ranges where shorter,
/// or as the list.
pub(crate) enum GetIx {
    Runs(stowage_wire::native::Indexes),
    List(Vec<u64>),
}

impl GetIx {
    /// Frame 0 of the get of `names` at these indexes, request `id`. The
    /// names are the ones the reply is checked against, borrowed: a head
    /// that owned a copy of them made and freed a string a field.
    pub(crate) fn frame0(
        &self,
        id: u64,
        names: &[Arc<str>],
    ) -> Result<bytes::Bytes, stowage_wire::native::Error> {
        use stowage_wire::native::{GetIndexes, encode_get_head};
        let ix = match self {
            GetIx::Runs(ix) => GetIndexes::Runs(ix),
            GetIx::List(ix) => GetIndexes::List(ix),
        };
        encode_get_head(id, ix, names)
    }
}

/// A get's request head, read as the fast paths read it: (how many
/// indexes, the names, the indexes).
pub(crate) fn get_head(
    indexes: &Bound<'_, PyAny>,
    fields: &Bound<'_, PyAny>,
    ranges: bool,
) -> Option<(u64, Vec<Arc<str>>, GetIx)> {
    let names = read_names(fields)?;
    let read = read_runs(indexes)?;
    let n = read.len();
    let ix = if ranges {
        GetIx::Runs(read.into_indexes())
    } else {
        GetIx::List(read.into_vec())
    };
    Some((n, names, ix))
}
