//! A get's result, every field kind, made here for the Python client:
//! [`Assembled`], where each field's arrays lie (computed with the GIL
//! released), then made into Python objects ([`Assembled::into_py`]).
//!
//! | field | result |
//! |---|---|
//! | regular | a numpy array `[n, ...]` |
//! | nested | a list of n numpy arrays (views of one buffer) |
//! | nested, packed (`GetOptions.packed`) | `Packed(values, shapes)`: one 1-D array of every row's elements, and the rows' shapes |
//! | values | a list of n Python values |
//!
//! An array's bytes lie in a [`Base`]: a buffer of this client's own (the
//! field's rows as the core received them, or a gather), handed to Python
//! as a read-only [`Buffer`]; a segment's shared read-only mapping
//! ([`SharedPages`]); or a private copy-on-write mapping of one
//! ([`PrivatePages`], for tensors). numpy arrays over the first two are
//! read-only: a write raises ValueError.
//!
//! The dtypes numpy has no type for (bfloat16, complex32, the float8s,
//! float4) come as unsigned ints of their itemsize (the `dtypes` table the
//! client passes says which numpy dtype each wire dtype is); the fields
//! whose dtype is one of these, or becomes a tensor, are listed beside the
//! result for the client's Python glue (torch, ml_dtypes).
//!
//! Given `torch.from_numpy` (`GetOptions(..., from_numpy)`, as
//! `get(as_torch=True)` gives it), the core makes a tensor field's tensors
//! itself, over arrays it makes writable where the bytes are this get's
//! own (a buffer of this client's, or a private copy-on-write mapping):
//! no Python glue for the field and no warning for torch to raise about a
//! read-only array. Why: the glue cost about 3 µs of Python a field, and
//! silencing torch's warning 2.7 µs a get, against 1 µs for
//! `torch.from_numpy` itself (docs/benchmarks.md, "Tensors made by the
//! core"). The raw-bits dtypes and a field over bytes that are not the
//! get's own (a frame received elsewhere) still go through the glue.

use std::collections::HashSet;
use std::sync::Arc;

use memmap2::MmapMut;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use stowage_wire::batch::Value;
use stowage_wire::native::{self, FieldLayout};
use stowage_wire::tensor::Dtype;

use crate::buffer::Buffer;
use crate::error::Fail;
use crate::segments::{Mapping, PrivatePages, SharedPages};

/// The dtypes numpy has no type for, carried as raw bits (`_dtypes.BITS_DTYPES`).
pub(crate) const RAW_BITS: [&str; 8] = [
    "bfloat16",
    "complex32",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
];

/// How a get's result is made (`_core.GetOptions(dtypes, tensors, packed,
/// from_numpy=None)`): `dtypes` maps each wire dtype name to its numpy
/// dtype; `tensors` names the dtypes whose fields become torch tensors
/// (same node: over private copy-on-write mappings); `packed` is the
/// `Packed` class to make nested fields as, or None for a list of rows;
/// `from_numpy` (`torch.from_numpy`), if given, makes the tensors of the
/// `tensors` dtypes that numpy has a type for here (see the module doc).
#[pyclass(module = "stowage._core", frozen)]
pub(crate) struct GetOptions {
    tensors: HashSet<String>,
    packed: Option<Py<PyAny>>,
    from_numpy: Option<Py<PyAny>>,
    /// By `Dtype as usize`: the numpy dtype given for it and its itemsize
    /// (None: none was given), and how its fields are finished; looked up
    /// once here, not for every field (or row) of every get.
    by_dtype: Vec<(Option<NumpyDtype>, Finish)>,
    /// The result dicts' keys: one Python string a field name, made once
    /// and hashed once ([`GetOptions::key`]).
    keys: std::sync::Mutex<KeyTable>,
}

/// Field names as the Python strings a get's dict is keyed by.
type KeyTable = std::collections::HashMap<Box<str>, Py<PyString>, foldhash::fast::RandomState>;

/// At most this many keys kept (then the table starts over), each of at
/// most [`KEY_KEPT_BYTES`]: 256 KiB of names at most.
const KEYS_KEPT: usize = 1024;
const KEY_KEPT_BYTES: usize = 256;

/// What becomes of a field's arrays once made.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Finish {
    /// Returned as they are.
    Arrays,
    /// Listed for the client's Python glue.
    Glue,
    /// Made tensors here (`from_numpy`), where their bytes are the get's
    /// own; else listed for the glue.
    Tensors,
}

/// A `numpy.dtype` and its itemsize.
type NumpyDtype = (Py<PyAny>, u64);

#[pymethods]
impl GetOptions {
    #[new]
    #[pyo3(signature = (dtypes, tensors, packed, from_numpy=None))]
    fn new(
        dtypes: Bound<'_, PyDict>,
        tensors: Vec<String>,
        packed: Option<Bound<'_, PyAny>>,
        from_numpy: Option<Bound<'_, PyAny>>,
    ) -> PyResult<GetOptions> {
        if let Some(f) = &from_numpy
            && !f.is_callable()
        {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "GetOptions: from_numpy must be callable, got {}",
                f.get_type().name()?
            )));
        }
        let tensors: HashSet<String> = tensors.into_iter().collect();
        let mut by_dtype: Vec<(Option<NumpyDtype>, Finish)> = Vec::new();
        for d in Dtype::ALL {
            let i = d as usize;
            if by_dtype.len() <= i {
                by_dtype.resize_with(i + 1, || (None, Finish::Arrays));
            }
            let name = d.name();
            let raw_bits = RAW_BITS.contains(&name);
            let glue = match (tensors.contains(name), raw_bits) {
                (true, false) if from_numpy.is_some() => Finish::Tensors,
                (true, _) | (_, true) => Finish::Glue,
                (false, false) => Finish::Arrays,
            };
            // As `numpy.dtype` objects: `NumpyApi::array` hands them to
            // numpy's C API as descriptors.
            let dt = match dtypes.get_item(name)? {
                Some(dt) => {
                    let dt = numpy_dtype(&dt)?;
                    let itemsize: u64 = dt.getattr("itemsize")?.extract()?;
                    Some((dt.unbind(), itemsize))
                }
                None => None,
            };
            by_dtype[i] = (dt, glue);
        }
        Ok(GetOptions {
            tensors,
            packed: packed.map(Bound::unbind),
            from_numpy: from_numpy.map(Bound::unbind),
            by_dtype,
            keys: Default::default(),
        })
    }
}

impl GetOptions {
    /// `name` as the key of a get's dict: the string made for it before,
    /// if any. A get's fields are named again and again; a string made
    /// for each field of each get, hashed as it went into the dict and
    /// freed with it, was about 700 instructions a field of a 32-field get
    /// (callgrind). A kept string is a lookup and a reference, its hash
    /// already known. (Under the GIL, so the lock is never contended.)
    fn key<'py>(&self, py: Python<'py>, name: &str) -> Bound<'py, PyString> {
        if name.len() > KEY_KEPT_BYTES {
            return PyString::new(py, name);
        }
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = keys.get(name) {
            return k.bind(py).clone();
        }
        if keys.len() >= KEYS_KEPT {
            keys.clear();
        }
        let k = PyString::new(py, name);
        keys.insert(name.into(), k.clone().unbind());
        k
    }

    /// Whether fields of `dtype` become tensors.
    pub(crate) fn tensor(&self, dtype: Dtype) -> bool {
        self.tensors.contains(dtype.name())
    }

    /// The numpy dtype given for `dtype`, and its itemsize.
    fn numpy<'py>(&self, py: Python<'py>, dtype: Dtype) -> PyResult<(&Bound<'py, PyAny>, u64)> {
        match self.by_dtype.get(dtype as usize) {
            Some((Some((dt, itemsize)), _)) => Ok((dt.bind(py), *itemsize)),
            _ => Err(PyValueError::new_err(format!(
                "no numpy dtype given for {}",
                dtype.name()
            ))),
        }
    }

    /// Whether nested fields come packed.
    pub(crate) fn packed(&self) -> bool {
        self.packed.is_some()
    }

    /// What becomes of a field of `dtype` once its arrays are made.
    fn finish(&self, dtype: Dtype) -> Finish {
        self.by_dtype
            .get(dtype as usize)
            .map_or(Finish::Arrays, |d| d.1)
    }
}

/// Where some of a result's bytes lie.
pub(crate) enum Base {
    /// This client's own bytes (read-only to numpy).
    Owned(Vec<u8>),
    /// A segment's shared read-only mapping.
    Shared(Arc<Mapping>),
    /// A private copy-on-write mapping of a segment (writable).
    Private(MmapMut),
    /// A Python buffer object (a read-only view of a frame received
    /// elsewhere).
    Object(Py<PyAny>),
}

/// An array's place: `at` bytes into base number `base` ([`NOWHERE`]: an
/// array of no bytes, made empty).
#[derive(Clone, Copy)]
pub(crate) struct Place {
    pub(crate) base: usize,
    pub(crate) at: usize,
}

/// The place of an array of no bytes.
pub(crate) const NOWHERE: Place = Place {
    base: usize::MAX,
    at: 0,
};

/// One field's result.
pub(crate) enum Made {
    /// An array of `shape`.
    Array(Place, native::Dims),
    /// One array per row: (place, shape).
    Rows(Vec<(Place, Vec<u64>)>),
    /// `Packed`: `elements` elements from the place, and each row's shape.
    Packed(Place, u64, Vec<Vec<u64>>),
    Values(Vec<Value>),
}

/// A get's result before it becomes Python objects: the bases, and each
/// field's result (its dtype: None for values), in reply order.
pub(crate) struct Assembled {
    pub(crate) bases: Vec<Base>,
    pub(crate) fields: Vec<(Arc<str>, Option<Dtype>, Made)>,
}

/// A list of names as Python writes it (the client's words).
fn py_names<S: AsRef<str>>(names: &[S]) -> String {
    let items: Vec<String> = names.iter().map(|n| format!("'{}'", n.as_ref())).collect();
    format!("[{}]", items.join(", "))
}

/// Checks a get_ok against the request: the fields asked for, in order,
/// each of `n` rows.
pub(crate) fn check_request(
    fields: &[(Arc<str>, FieldLayout)],
    names: &[Arc<str>],
    n: u64,
) -> Result<(), Fail> {
    if fields.len() != names.len() || fields.iter().zip(names).any(|((a, _), b)| **a != **b) {
        let got: Vec<&str> = fields.iter().map(|(n, _)| &**n).collect();
        return Err(Fail::Protocol(format!(
            "get_ok has fields {}, requested {}",
            py_names(&got),
            py_names(names)
        )));
    }
    for (name, f) in fields {
        let bad = match f {
            FieldLayout::Regular { shape, .. } if shape[0] != n => {
                format!("shape {shape:?} does not have {n} rows")
            }
            FieldLayout::Nested { rows, .. } if rows.len() as u64 != n => {
                format!("nested descriptor without {n} rows")
            }
            FieldLayout::Values(v) if v.len() as u64 != n => {
                format!("values descriptor without {n} values")
            }
            _ => continue,
        };
        return Err(Fail::Protocol(format!("field '{name}': {bad}")));
    }
    Ok(())
}

impl Assembled {
    /// The result of a reply whose fields' rows were received each into a
    /// buffer of its own, rows back to back in row order (`buffers`: one
    /// per regular or nested field, in order).
    pub(crate) fn from_received(
        fields: Vec<(Arc<str>, FieldLayout)>,
        buffers: Vec<Vec<u8>>,
        starts: &[(usize, usize)],
        opts: &GetOptions,
    ) -> Assembled {
        let mut bases = Vec::with_capacity(buffers.len());
        // Each buffer's base, made when a field with bytes first uses it.
        // (Not `vec![None; n]`: a zeroed allocation, past glibc's per-thread
        // cache.)
        let mut based: Vec<Option<usize>> = std::iter::repeat_n(None, buffers.len()).collect();
        let mut buffers: Vec<Option<Vec<u8>>> = buffers.into_iter().map(Some).collect();
        let mut starts = starts.iter();
        let mut out = Vec::with_capacity(fields.len());
        for (name, f) in fields {
            if let FieldLayout::Values(v) = f {
                out.push((name, None, Made::Values(v)));
                continue;
            }
            let &(b, at) = starts.next().expect("a start per regular or nested field");
            let place = if f.bytes() == 0 {
                NOWHERE
            } else {
                let base = *based[b].get_or_insert_with(|| {
                    let buf = buffers[b].take().expect("a buffer made a base once");
                    bases.push(Base::Owned(buf));
                    bases.len() - 1
                });
                Place { base, at }
            };
            let made = match f {
                FieldLayout::Regular { dtype, shape, .. } => (dtype, Made::Array(place, shape)),
                FieldLayout::Nested { dtype, rows } if opts.packed() => {
                    let total: u64 = rows.iter().map(|r| r.len).sum();
                    let shapes = rows.into_iter().map(|r| r.shape).collect();
                    let elements = total / dtype.itemsize() as u64;
                    (dtype, Made::Packed(place, elements, shapes))
                }
                FieldLayout::Nested { dtype, rows } => {
                    let mut at = place.at;
                    let rows = rows
                        .into_iter()
                        .map(|r| {
                            let p = if r.len == 0 {
                                NOWHERE
                            } else {
                                Place {
                                    base: place.base,
                                    at,
                                }
                            };
                            at += r.len as usize;
                            (p, r.shape)
                        })
                        .collect();
                    (dtype, Made::Rows(rows))
                }
                FieldLayout::Values(_) => unreachable!("values are made above"),
            };
            out.push((name, Some(made.0), made.1));
        }
        Assembled { bases, fields: out }
    }

    /// The Python result: (a dict of field name to its result, in reply
    /// order; a list of `(field, dtype name)` of the fields the client's
    /// glue turns into tensors or typed arrays: none that became tensors
    /// here).
    pub(crate) fn into_py<'py>(
        self,
        py: Python<'py>,
        opts: &GetOptions,
    ) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyList>)> {
        let ndarray = ndarray_type(py)?;
        let api = NumpyApi::get(py)?;
        // Each base, and where its bytes are when this crate owns them
        // (their address, length, and whether numpy may write them):
        // arrays of those are made through numpy's C API. Beside it,
        // whether the bytes are this get's own (a buffer of this client's,
        // or a private copy-on-write mapping): a tensor may write them.
        let bases = self
            .bases
            .into_iter()
            .map(|b| {
                Ok(match b {
                    Base::Owned(data) => {
                        let raw = (data.as_ptr() as usize, data.len(), false);
                        (Bound::new(py, Buffer { data })?.into_any(), Some(raw), true)
                    }
                    Base::Shared(map) => {
                        let bytes = map.bytes();
                        let raw = (bytes.as_ptr() as usize, bytes.len(), false);
                        let pages = Bound::new(py, SharedPages { map })?;
                        (pages.into_any(), Some(raw), false)
                    }
                    Base::Private(map) => {
                        let pages = PrivatePages::new(map);
                        let raw = (pages.ptr(), pages.len(), true);
                        (Bound::new(py, pages)?.into_any(), Some(raw), true)
                    }
                    Base::Object(obj) => (obj.into_bound(py), None, false),
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let own = |place: &Place| place.base == usize::MAX || bases[place.base].2;
        let from_numpy = opts.from_numpy.as_ref().map(|f| f.bind(py));
        let out = PyDict::new(py);
        let glue = PyList::empty(py);
        for (name, dtype, made) in self.fields {
            let Some(dtype) = dtype else {
                let Made::Values(values) = made else {
                    unreachable!("a field without a dtype holds values")
                };
                let values = values
                    .iter()
                    .map(|v| crate::codec::value(py, v))
                    .collect::<PyResult<Vec<_>>>()?;
                out.set_item(opts.key(py, &name), PyList::new(py, values)?)?;
                continue;
            };
            let (dt, itemsize) = opts.numpy(py, dtype)?;
            // Tensors made here: only over bytes that are the get's own,
            // and through numpy's C API (which makes them writable).
            let tensor = match (opts.finish(dtype), from_numpy, api) {
                (Finish::Tensors, Some(f), Some(_)) => {
                    let mine = match &made {
                        Made::Array(place, _) | Made::Packed(place, ..) => own(place),
                        Made::Rows(rows) => rows.iter().all(|(place, _)| own(place)),
                        Made::Values(_) => false,
                    };
                    mine.then_some(f)
                }
                _ => None,
            };
            let array = |place: Place, dims: &[u64]| -> PyResult<Bound<'py, PyAny>> {
                let a = if place.base == usize::MAX {
                    // (no bytes: a new empty array, read-only unless a
                    // tensor's)
                    let a = ndarray.call1((PyTuple::new(py, dims)?, &dt))?;
                    if tensor.is_none() {
                        a.getattr("flags")?.setattr("writeable", false)?;
                    }
                    a
                } else {
                    let (base, raw, _) = &bases[place.base];
                    match (api, raw) {
                        (Some(api), Some((ptr, len, writable))) => api.array(
                            py,
                            (dt, itemsize),
                            dims,
                            base,
                            (*ptr, *len, *writable || tensor.is_some()),
                            place.at,
                        )?,
                        _ => ndarray.call1((PyTuple::new(py, dims)?, &dt, base, place.at))?,
                    }
                };
                match tensor {
                    Some(f) => f.call1((a,)),
                    None => Ok(a),
                }
            };
            let value = match made {
                Made::Array(place, shape) => array(place, &shape)?,
                Made::Rows(rows) => {
                    let rows = rows
                        .iter()
                        .map(|(place, shape)| array(*place, shape))
                        .collect::<PyResult<Vec<_>>>()?;
                    PyList::new(py, rows)?.into_any()
                }
                Made::Packed(place, elements, shapes) => {
                    let values = array(place, &[elements])?;
                    let shapes = shapes
                        .iter()
                        .map(|s| PyTuple::new(py, s))
                        .collect::<PyResult<Vec<_>>>()?;
                    let class = opts.packed.as_ref().expect("packed fields with a class");
                    class.bind(py).call1((values, PyList::new(py, shapes)?))?
                }
                Made::Values(_) => unreachable!("values have no dtype"),
            };
            if tensor.is_none() && opts.finish(dtype) != Finish::Arrays {
                glue.append((&*name, dtype.name()))?;
            }
            out.set_item(opts.key(py, &name), value)?;
        }
        Ok((out, glue))
    }
}

/// `numpy.dtype(obj)`.
fn numpy_dtype<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    static DTYPE: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    let py = obj.py();
    DTYPE
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("numpy")?.getattr("dtype")?.unbind())
        })?
        .bind(py)
        .call1((obj,))
}

/// The three entries of numpy's C API a get's arrays are made with
/// (`PyArray_Type`, `PyArray_NewFromDescr`, `PyArray_SetBaseObject`),
/// from the `_ARRAY_API` capsule as numpy's own `import_array` finds it;
/// slots 2, 94 and 282, the same in numpy 1.x and 2.x.
///
/// Hand-written rather than through the `numpy` crate, whose limited-API
/// (abi3) support this wheel would depend on. Measured: `numpy.ndarray(shape,
/// dtype, buffer, offset)`, called through Python as before, cost about
/// 0.2 µs an array warm (its argument parsing, the buffer protocol on the
/// base), several an array after a round trip's context switches.
struct NumpyApi {
    array_type: *mut pyo3::ffi::PyObject,
    new_from_descr: NewFromDescr,
    set_base: SetBase,
}

type NewFromDescr = unsafe extern "C" fn(
    *mut pyo3::ffi::PyObject,
    *mut pyo3::ffi::PyObject,
    std::os::raw::c_int,
    *const isize,
    *const isize,
    *mut std::os::raw::c_void,
    std::os::raw::c_int,
    *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject;
type SetBase =
    unsafe extern "C" fn(*mut pyo3::ffi::PyObject, *mut pyo3::ffi::PyObject) -> std::os::raw::c_int;

// SAFETY: the pointers are numpy's, fixed for the life of the process
// (numpy is never unloaded), and used only with the GIL held.
unsafe impl Send for NumpyApi {}
unsafe impl Sync for NumpyApi {}

const NPY_ARRAY_C_CONTIGUOUS: std::os::raw::c_int = 0x0001;
const NPY_ARRAY_ALIGNED: std::os::raw::c_int = 0x0100;
const NPY_ARRAY_WRITEABLE: std::os::raw::c_int = 0x0400;

impl NumpyApi {
    /// The API, found once; None if this numpy has no capsule where
    /// `import_array` looks (arrays are then made through Python).
    fn get(py: Python<'_>) -> PyResult<Option<&'static NumpyApi>> {
        static API: pyo3::sync::PyOnceLock<Option<NumpyApi>> = pyo3::sync::PyOnceLock::new();
        API.get_or_try_init(py, || {
            let module = py
                .import("numpy._core._multiarray_umath")
                .or_else(|_| py.import("numpy.core._multiarray_umath"))?;
            let Ok(capsule) = module.getattr("_ARRAY_API") else {
                return Ok(None);
            };
            // SAFETY: `_ARRAY_API` is numpy's capsule of its C API table,
            // an array of pointers, named NULL (as `import_array` reads it).
            let table =
                unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), std::ptr::null()) }
                    as *const *mut std::os::raw::c_void;
            if table.is_null() {
                return Err(PyErr::fetch(py));
            }
            // SAFETY: slots 2, 94 and 282 of that table are these entries.
            Ok(unsafe {
                Some(NumpyApi {
                    array_type: *table.add(2) as *mut pyo3::ffi::PyObject,
                    new_from_descr: std::mem::transmute::<*mut std::os::raw::c_void, NewFromDescr>(
                        *table.add(94),
                    ),
                    set_base: std::mem::transmute::<*mut std::os::raw::c_void, SetBase>(
                        *table.add(282),
                    ),
                })
            })
        })
        .map(Option::as_ref)
    }

    /// A C-contiguous array of `dt` (a `numpy.dtype`, and its itemsize)
    /// and shape `dims` over bytes `at..` of `base`, whose bytes lie at
    /// `raw` (address, length, writable) and stay there while it lives;
    /// `base` becomes the array's base. Read-only unless `raw` is writable.
    fn array<'py>(
        &self,
        py: Python<'py>,
        (dt, itemsize): (&Bound<'py, PyAny>, u64),
        dims: &[u64],
        base: &Bound<'py, PyAny>,
        raw: (usize, usize, bool),
        at: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (ptr, len, writable) = raw;
        let need = dims
            .iter()
            .try_fold(itemsize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_add(at as u64));
        let mut shape = [0isize; 64];
        if need.is_none_or(|n| n > len as u64) || dims.len() > shape.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "an array of shape {dims:?} at byte {at} does not fit its {len}-byte buffer"
            )));
        }
        for (to, &d) in shape.iter_mut().zip(dims) {
            *to = d as isize;
        }
        // (Aligned claimed only where it is to the item's size, which
        // numpy's alignment of a dtype never exceeds.)
        let aligned = itemsize > 0 && ((ptr + at) as u64).is_multiple_of(itemsize);
        let flags = NPY_ARRAY_C_CONTIGUOUS
            | if aligned { NPY_ARRAY_ALIGNED } else { 0 }
            | if writable { NPY_ARRAY_WRITEABLE } else { 0 };
        // SAFETY: the descriptor is a `numpy.dtype` (GetOptions made it
        // one), whose reference `PyArray_NewFromDescr` steals (hence the
        // increment); the bytes were checked to hold the array above and
        // live as long as `base`, which `PyArray_SetBaseObject` makes the
        // array's (stealing the reference it is given, on failure too).
        unsafe {
            pyo3::ffi::Py_IncRef(dt.as_ptr());
            let a = (self.new_from_descr)(
                self.array_type,
                dt.as_ptr(),
                dims.len() as std::os::raw::c_int,
                shape.as_ptr(),
                std::ptr::null(),
                (ptr + at) as *mut std::os::raw::c_void,
                flags,
                std::ptr::null_mut(),
            );
            if a.is_null() {
                return Err(PyErr::fetch(py));
            }
            let a = Bound::from_owned_ptr(py, a);
            pyo3::ffi::Py_IncRef(base.as_ptr());
            if (self.set_base)(a.as_ptr(), base.as_ptr()) < 0 {
                return Err(PyErr::fetch(py));
            }
            Ok(a)
        }
    }
}

/// `numpy.ndarray`.
pub(crate) fn ndarray_type(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    static NDARRAY: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    NDARRAY
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("numpy")?.getattr("ndarray")?.unbind())
        })
        .map(|t| t.bind(py).clone())
}

/// A get_ok's data frames as they lie in memory: data frame k (from 1) is
/// bytes `at..at + len` of source number `source` (`usize::MAX`: the
/// empty frame), each source a buffer: a segment's mapping, or a frame
/// received whole. Every range was checked against the frames.
pub(crate) struct InMemory<'a> {
    pub(crate) frames: Vec<(usize, u64, u64)>,
    pub(crate) sources: Vec<&'a [u8]>,
}

/// A view a tensor wants of a private mapping: bytes `at..at + len` of
/// source `source`, for field number `field` (row `row`, or the field's
/// one array or `Packed` values).
pub(crate) struct Want {
    pub(crate) source: usize,
    pub(crate) at: u64,
    pub(crate) len: u64,
    pub(crate) field: usize,
    pub(crate) row: Option<usize>,
}

impl InMemory<'_> {
    /// The lengths of the frames.
    pub(crate) fn lens(&self) -> Vec<u64> {
        self.frames.iter().map(|f| f.2).collect()
    }

    /// Where byte `offset` of data frame `frame` lies: (source, offset in it).
    pub(crate) fn locate(&self, frame: u64, offset: u64) -> (usize, u64) {
        let (k, at, _) = self.frames[frame as usize - 1];
        (k, at + offset)
    }

    /// Bytes `offset..offset + len` of data frame `frame`.
    pub(crate) fn bytes(&self, frame: u64, offset: u64, len: u64) -> &[u8] {
        if len == 0 {
            return &[];
        }
        let (k, at) = self.locate(frame, offset);
        &self.sources[k][at as usize..(at + len) as usize]
    }

    /// Where a field's ranges lie: (source, offset, len), ranges that
    /// follow on directly merged, empty ones left out.
    fn pieces(&self, ranges: impl Iterator<Item = (u64, u64, u64)>) -> Vec<(usize, u64, u64)> {
        let mut out: Vec<(usize, u64, u64)> = Vec::new();
        for (frame, offset, len) in ranges {
            if len == 0 {
                continue;
            }
            let (k, at) = self.locate(frame, offset);
            match out.last_mut() {
                Some(last) if last.0 == k && last.1 + last.2 == at => last.2 += len,
                _ => out.push((k, at, len)),
            }
        }
        out
    }

    /// One buffer of the receive pool holding `pieces` back to back, in
    /// one pass (the GIL released by the caller).
    ///
    /// Why here: a same-node get of rows scattered over the segments
    /// (32,768 random 4 KiB rows of 4 units) was gathered by numpy, one
    /// `take` per segment into a temporary and a masked assignment from it
    /// (two copies), into a fresh array that numpy asks huge pages for:
    /// 196-291 ms, and 1.5 s when the huge pages had to come from the host
    /// (docs/benchmarks.md, "Same-node gathers").
    pub(crate) fn gather(&self, pieces: &[(usize, u64, u64)]) -> Vec<u8> {
        let total: u64 = pieces.iter().map(|p| p.2).sum();
        let mut out = crate::pool::take(total as usize, crate::pool::huge_pages);
        let mut to = 0usize;
        for &(k, at, len) in pieces {
            let (at, len) = (at as usize, len as usize);
            out[to..to + len].copy_from_slice(&self.sources[k][at..at + len]);
            to += len;
        }
        out
    }

    /// The result of a get_ok whose data frames are these, `bases` one per
    /// source (a view of source k is a view of base k): a regular field,
    /// or a packed nested one, whose bytes lie back to back in one source
    /// is a view of it, else a gather into a buffer of its own; a nested
    /// field's rows are views. With `private`, the views of fields that
    /// become tensors are left to the caller (returned as [`Want`]s, their
    /// places [`NOWHERE`] until then).
    pub(crate) fn assemble(
        &self,
        fields: Vec<(Arc<str>, FieldLayout)>,
        mut bases: Vec<Base>,
        opts: &GetOptions,
        private: bool,
    ) -> (Assembled, Vec<Want>) {
        let mut wants: Vec<Want> = Vec::new();
        let mut out = Vec::with_capacity(fields.len());
        // One place for a field's bytes: a view, a view a tensor wants, or
        // a gather.
        let one = |bases: &mut Vec<Base>,
                   wants: &mut Vec<Want>,
                   ps: Vec<(usize, u64, u64)>,
                   tensor: bool,
                   field: usize| match ps.as_slice() {
            [] => NOWHERE,
            &[(source, at, len)] if tensor && private => {
                wants.push(Want {
                    source,
                    at,
                    len,
                    field,
                    row: None,
                });
                NOWHERE
            }
            &[(source, at, _)] => Place {
                base: source,
                at: at as usize,
            },
            _ => {
                bases.push(Base::Owned(self.gather(&ps)));
                Place {
                    base: bases.len() - 1,
                    at: 0,
                }
            }
        };
        for (i, (name, f)) in fields.into_iter().enumerate() {
            let (dtype, made) = match f {
                FieldLayout::Values(v) => {
                    out.push((name, None, Made::Values(v)));
                    continue;
                }
                FieldLayout::Regular {
                    dtype,
                    shape,
                    parts,
                } => {
                    let ps = self.pieces(parts.iter().map(|p| (p.frame, p.offset, p.len)));
                    let place = one(&mut bases, &mut wants, ps, opts.tensor(dtype), i);
                    (dtype, Made::Array(place, shape))
                }
                FieldLayout::Nested { dtype, rows } if opts.packed() => {
                    let ps = self.pieces(rows.iter().map(|p| (p.frame, p.offset, p.len)));
                    let total: u64 = rows.iter().map(|p| p.len).sum();
                    let place = one(&mut bases, &mut wants, ps, opts.tensor(dtype), i);
                    let elements = total / dtype.itemsize() as u64;
                    let shapes = rows.into_iter().map(|r| r.shape).collect();
                    (dtype, Made::Packed(place, elements, shapes))
                }
                FieldLayout::Nested { dtype, rows } => {
                    let tensor = opts.tensor(dtype) && private;
                    let made = (rows.into_iter().enumerate())
                        .map(|(j, row)| {
                            if row.len == 0 {
                                return (NOWHERE, row.shape);
                            }
                            let (source, at) = self.locate(row.frame, row.offset);
                            if tensor {
                                wants.push(Want {
                                    source,
                                    at,
                                    len: row.len,
                                    field: i,
                                    row: Some(j),
                                });
                                return (NOWHERE, row.shape);
                            }
                            let place = Place {
                                base: source,
                                at: at as usize,
                            };
                            (place, row.shape)
                        })
                        .collect();
                    (dtype, Made::Rows(made))
                }
            };
            out.push((name, Some(dtype), made));
        }
        (Assembled { bases, fields: out }, wants)
    }
}

impl Assembled {
    /// Puts `place` where `w` wants it.
    pub(crate) fn place(&mut self, w: &Want, place: Place) {
        match (&mut self.fields[w.field].2, w.row) {
            (Made::Array(p, _), None) | (Made::Packed(p, _, _), None) => *p = place,
            (Made::Rows(rows), Some(j)) => rows[j].0 = place,
            _ => unreachable!("a want is for an array or a row"),
        }
    }
}

/// `_core.decode_get(frames, opts)`: a get_ok received whole elsewhere
/// (`frames`: frame 0, then the data frames, each a buffer: bytes, or a
/// pyzmq frame), decoded and checked by stowd's codec and made as
/// `Connection.get` makes it: what that returns. An array is a read-only
/// view of a received frame where its bytes lie in one (the frames'
/// memory is not copied), else a gather. ProtocolViolation for a get_ok
/// whose descriptors do not fit its frames.
#[pyfunction]
pub(crate) fn decode_get<'py>(
    py: Python<'py>,
    frames: Vec<Bound<'py, PyAny>>,
    opts: &Bound<'py, GetOptions>,
) -> PyResult<Bound<'py, PyAny>> {
    use stowage_wire::native::{self, ReplyLayout, layout};
    let opts = opts.get();
    let Some((first, data)) = frames.split_first() else {
        return Err(PyValueError::new_err("a reply has frame 0"));
    };
    let head = bytes::Bytes::copy_from_slice(crate::buffer::Held::get(first)?.bytes());
    let fields = match native::decode_reply_layout(&head, &crate::message::REPLY_LIMITS) {
        Ok((_, ReplyLayout::GetOk(fields))) => fields,
        other => {
            let problem = other.err().map(|e| e.to_string());
            return (pyo3::types::PyBytes::new(py, &head), problem)
                .into_pyobject(py)
                .map(|t| t.into_any());
        }
    };
    let held = data
        .iter()
        .map(crate::buffer::Held::get)
        .collect::<PyResult<Vec<_>>>()?;
    let mem = InMemory {
        frames: (0..held.len())
            .map(|k| (k, 0, held[k].bytes().len() as u64))
            .collect(),
        sources: held.iter().map(|h| h.bytes()).collect(),
    };
    layout::check_frames(&fields, &mem.lens())
        .map_err(|e| crate::error::ProtocolViolation::new_err(crate::receive::frames_error(&e)))?;
    let bases = data
        .iter()
        .map(|f| {
            let view = pyo3::types::PyMemoryView::from(f)?.call_method0("toreadonly")?;
            Ok(Base::Object(view.unbind()))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let (made, _) = mem.assemble(fields, bases, opts, false);
    drop(mem);
    drop(held);
    made.into_py(py, opts)?
        .into_pyobject(py)
        .map(|t| t.into_any())
}
