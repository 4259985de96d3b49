//! Index inputs read as the user gives them: a list or tuple of `int`s, a
//! `range`, or a 1-d buffer of an integer item type (a numpy array of any
//! integer dtype and stride, `array.array`, a memoryview; a CPU torch
//! tensor through `.numpy()`), each in `0..2^64`, into a list or straight
//! into runs ([`Sink`]); and [`IndexList`], such indexes held in Rust for
//! the general path's requests.
//!
//! Each reader returns `None` for anything that is not plainly that: the
//! Python client's general path then checks it and words the error (a
//! negative, out-of-range, non-integer or repeated index). Used by the
//! fast paths ([`crate::fast`]) and by the codec's requests
//! ([`crate::codec`]).

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyRange, PyString, PyTuple};
use stowage_wire::indexes::{IndexRun, Indexes};

use crate::buffer::Held;

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
pub(crate) fn is_ndarray(obj: &Bound<'_, PyAny>) -> bool {
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
pub(crate) fn tensor_numpy<'py>(obj: &Bound<'py, PyAny>) -> Option<Bound<'py, PyAny>> {
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
    let ok = if obj.cast_exact::<PyList>().is_ok() || obj.cast_exact::<PyTuple>().is_ok() {
        // SAFETY: an exact list or tuple, read under the GIL (which nothing
        // here releases).
        unsafe { read_sequence(obj, &mut sink) }
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

/// Items a list or tuple is read ahead by: item `i + AHEAD`'s object is
/// prefetched as item `i` is read. Over a list of 524,288 ints made out
/// of order, read through the C API, 8 to 24 ahead took 7.6-11.6 ms, no
/// distance among them ahead of the others beyond this machine's noise;
/// 32 took 13.2-18.6.
const AHEAD: usize = 16;

/// Indexes a list or tuple's ints are read into before they go to the
/// sink together ([`Sink::extend_from`]: a run's continuation is then one
/// tight scan).
const CHUNK: usize = 256;

/// The items of an exact list or tuple into `sink`, if every one is
/// exactly an `int` in range.
///
/// The sequence holds pointers; the `int`s they point to lie wherever
/// they were made. Made in order (`list(range(n))`) they lie one after
/// the other and the hardware prefetcher finds them; made out of order,
/// or among other objects, each read one by one waits for memory:
/// 524,288 such ints took 21-23 ms, as Python's own `sum` takes 18-19 ms
/// over them, and 7.7-11.6 ms read [`AHEAD`] items ahead (5.3-6.1 ms read
/// from the objects, below).
///
/// The items and the ints' values are read from the objects themselves
/// where this interpreter's layouts were confirmed ([`Layouts`]), the
/// items as one slice and each value from its digits. With a call of
/// `PyList_GetItem` and of `PyLong_AsUnsignedLongLong` an item, 524,288
/// ints made in order took 3.3-5.3 ms, no less than Python's `sum` over
/// them (2.9-4.9 ms in the same runs); read from the objects, 1.7-2.5 ms
/// ("Index lists read from the objects" in docs/benchmarks.md).
///
/// # Safety
/// `seq` is an exact list or tuple; the GIL is held, and stays held.
unsafe fn read_sequence<S: Sink>(seq: &Bound<'_, PyAny>, sink: &mut S) -> Option<()> {
    let layouts = Layouts::get(seq.py());
    // SAFETY: the caller's contract; the items are borrowed while this
    // runs, and nothing here runs Python code (an exact `int` converts
    // without `__index__`), so nothing can change the sequence meanwhile.
    unsafe {
        let taken;
        let items: &[*mut ffi::PyObject] = match layouts.items(seq.as_ptr()) {
            Some(items) => items,
            None => {
                taken = seq
                    .try_iter()
                    .ok()?
                    .map(|item| item.map(|i| i.as_ptr()))
                    .collect::<PyResult<Vec<_>>>()
                    .ok()?;
                &taken
            }
        };
        sink.reserve(items.len());
        let int_type = std::ptr::addr_of_mut!(ffi::PyLong_Type);
        let mut buf = [0u64; CHUNK];
        for (c, chunk) in items.chunks(CHUNK).enumerate() {
            let base = c * CHUNK;
            for (k, &item) in chunk.iter().enumerate() {
                if let Some(&ahead) = items.get(base + k + AHEAD) {
                    prefetch(ahead);
                }
                if ffi::Py_TYPE(item) != int_type {
                    return None;
                }
                buf[k] = layouts.int.value(item)?;
            }
            sink.extend_from(&buf[..chunk.len()]);
        }
    }
    Some(())
}

/// How this interpreter lays out a list's and a tuple's items and an
/// `int`'s value, as far as [`read_sequence`] reads them directly:
/// confirmed once against the C API on sample objects ([`Layouts::get`]);
/// what is not confirmed is read through the C API.
struct Layouts {
    /// Lists keep a pointer to their items after the object's variable
    /// head (`ob_item`), tuples keep them inline there.
    sequences: bool,
    int: IntLayout,
}

/// Where an exact `int`'s value is, after the object's head: a word,
/// then 30-bit digits, least significant first.
#[derive(Clone, Copy, PartialEq, Debug)]
enum IntLayout {
    /// CPython up to 3.11: the word is the signed count of digits.
    Size,
    /// CPython 3.12 on: the word is the count of digits shifted up by 3,
    /// with the sign in its low two bits (0 positive, 1 zero, 2
    /// negative).
    Tag,
    /// Neither confirmed: `PyLong_AsUnsignedLongLong`.
    Api,
}

/// Bytes of an object's head (`ob_refcnt`, `ob_type`).
const HEAD: usize = std::mem::size_of::<ffi::PyObject>();
/// Bytes of a variable object's head (`ob_size` after the object's).
const VAR_HEAD: usize = std::mem::size_of::<ffi::PyVarObject>();

impl IntLayout {
    /// The value of the exact `int` at `item` in `0..2^64`; None if it is
    /// negative or 2^64 or more.
    ///
    /// # Safety
    /// `item` is an exact `int`, alive; the GIL is held.
    #[inline(always)]
    unsafe fn value(self, item: *mut ffi::PyObject) -> Option<u64> {
        // SAFETY: an int object holds the word and at least one digit
        // after its head (a zero too), and `n` digits when the word says
        // `n`; only counts of 1 and 2 are read here.
        unsafe {
            let word = item.cast::<u8>().add(HEAD).cast::<isize>().read();
            let digits = item.cast::<u8>().add(VAR_HEAD).cast::<u32>();
            let (negative, count) = match self {
                IntLayout::Size => (word < 0, word.unsigned_abs()),
                IntLayout::Tag => (word & 3 == 2, (word as usize) >> 3),
                IntLayout::Api => return api_value(item),
            };
            match (negative, count) {
                (true, _) => None,
                (false, 0) => Some(0),
                (false, 1) => Some(u64::from(digits.read())),
                (false, 2) => {
                    Some(u64::from(digits.read()) | u64::from(digits.add(1).read()) << 30)
                }
                (false, _) => api_value(item),
            }
        }
    }
}

/// An exact `int`'s value through the C API, if in `0..2^64`.
///
/// # Safety
/// `item` is an `int`, alive; the GIL is held.
unsafe fn api_value(item: *mut ffi::PyObject) -> Option<u64> {
    // SAFETY: the caller's contract.
    unsafe {
        let v = ffi::PyLong_AsUnsignedLongLong(item);
        if v == u64::MAX && !ffi::PyErr_Occurred().is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        Some(v)
    }
}

impl Layouts {
    /// This interpreter's, confirmed on first use. With
    /// `STOWAGE_INDEX_LAYOUTS=api` in the environment then, none is used:
    /// everything is read through the C API (for tests of that path, and
    /// to rule this reader out).
    fn get(py: Python<'_>) -> &'static Layouts {
        static LAYOUTS: PyOnceLock<Layouts> = PyOnceLock::new();
        LAYOUTS.get_or_init(py, || {
            if std::env::var_os("STOWAGE_INDEX_LAYOUTS").is_some_and(|v| v == "api") {
                return Layouts {
                    sequences: false,
                    int: IntLayout::Api,
                };
            }
            let sequences = sequences_ok(py).unwrap_or(false);
            let guess = if py.version_info() >= (3, 12) {
                IntLayout::Tag
            } else {
                IntLayout::Size
            };
            let int = if int_layout_ok(py, guess).unwrap_or(false) {
                guess
            } else {
                IntLayout::Api
            };
            Layouts { sequences, int }
        })
    }

    /// The items of the exact list or tuple `seq`, if their layout was
    /// confirmed.
    ///
    /// # Safety
    /// `seq` is an exact list or tuple, alive and unchanged while the
    /// slice is used; the GIL is held.
    unsafe fn items<'a>(&self, seq: *mut ffi::PyObject) -> Option<&'a [*mut ffi::PyObject]> {
        if !self.sequences {
            return None;
        }
        // SAFETY: the layout confirmed by `sequences_ok`: the count in
        // the variable head, then the items (a list's through a pointer,
        // null when empty).
        unsafe {
            let len = usize::try_from(ffi::Py_SIZE(seq)).ok()?;
            let at = seq.cast::<u8>().add(VAR_HEAD);
            let items = if ffi::PyList_CheckExact(seq) != 0 {
                at.cast::<*mut *mut ffi::PyObject>().read()
            } else {
                at.cast::<*mut ffi::PyObject>()
            };
            if len == 0 {
                return Some(&[]);
            }
            Some(std::slice::from_raw_parts(items, len))
        }
    }
}

/// How the core reads a list's or tuple's items and ints here, as
/// confirmed on first use: `{"sequences": bool, "int": "size" | "tag" |
/// "api"}` (`sequences` false and `"api"`: through the C API). For tests
/// and for the curious: a layout not confirmed costs speed, not results.
#[pyfunction]
pub(crate) fn index_layouts(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let layouts = Layouts::get(py);
    let d = PyDict::new(py);
    d.set_item("sequences", layouts.sequences)?;
    let int = match layouts.int {
        IntLayout::Size => "size",
        IntLayout::Tag => "tag",
        IntLayout::Api => "api",
    };
    d.set_item("int", int)?;
    Ok(d)
}

/// Whether a list's and a tuple's items are where [`Layouts::items`]
/// reads them, as `PyList_GetItem` and `PyTuple_GetItem` find them, on a
/// list and a tuple of 3 items.
fn sequences_ok(py: Python<'_>) -> PyResult<bool> {
    let objs = [
        py.None(),
        7u32.into_pyobject(py)?.into_any().unbind(),
        PyString::new(py, "x").into_any().unbind(),
    ];
    let list = PyList::new(py, &objs)?;
    let tuple = PyTuple::new(py, &objs)?;
    let layouts = Layouts {
        sequences: true,
        int: IntLayout::Api,
    };
    for (seq, get) in [
        (
            list.as_any(),
            ffi::PyList_GetItem as unsafe extern "C" fn(_, _) -> _,
        ),
        (tuple.as_any(), ffi::PyTuple_GetItem),
    ] {
        // SAFETY: an exact list or tuple made here, alive, under the GIL;
        // the check reads at most its count of pointers where the layout
        // says they are, and compares them with the C API's.
        let same = unsafe {
            let Some(items) = layouts.items(seq.as_ptr()) else {
                return Ok(false);
            };
            items.len() == 3 && (0..3).all(|i| items[i] == get(seq.as_ptr(), i as ffi::Py_ssize_t))
        };
        if !same {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether `layout` reads the values the C API gives, on ints either side
/// of every digit count it reads, and turns away negative ones and ones
/// of 2^64 or more.
fn int_layout_ok(py: Python<'_>, layout: IntLayout) -> PyResult<bool> {
    let int = py.get_type::<pyo3::types::PyInt>();
    for v in [
        0u64,
        1,
        7,
        (1 << 30) - 1,
        1 << 30,
        (1 << 31) + 5,
        (1 << 60) - 1,
        1 << 60,
        (1 << 62) + 3,
        1 << 63,
        u64::MAX,
    ] {
        let obj = v.into_pyobject(py)?;
        // SAFETY: an exact int made here, alive, under the GIL.
        if unsafe { layout.value(obj.as_ptr()) } != Some(v) {
            return Ok(false);
        }
    }
    for text in [
        "-1",
        "-1073741824",
        "-4611686018427387904",
        "-18446744073709551615",
        "18446744073709551616",
        "1237940039285380274899124224",
    ] {
        let obj = int.call1((text,))?;
        // SAFETY: as above.
        if unsafe { layout.value(obj.as_ptr()) }.is_some() {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Asks for the cache line at `p` ahead of its read (a hint: nothing is
/// read, and no address faults).
#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing and cannot fault, whatever `p`.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: as above (`prfm` is a hint).
    unsafe {
        std::arch::asm!("prfm pldl1keep, [{0}]", in(reg) p, options(nostack, readonly, preserves_flags));
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = p;
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
