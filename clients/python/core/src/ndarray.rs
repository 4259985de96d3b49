//! A numpy array read from its own fields ([`NdArray`]) rather than
//! through the buffer protocol (`buffer::Held`), for a put's sources:
//! numpy's `getbuffer` builds the array's format string and compares it
//! with the one it cached on every call, and the view needs a box and a
//! release. The fields' layout is checked once against the buffer
//! protocol ([`ndarray_layout_ok`]).

use pyo3::ffi;
use pyo3::prelude::*;
use stowage_wire::tensor::Dtype;

use crate::buffer::Held;

/// The most axes [`NdArray::read`] takes (more take the buffer
/// protocol).
pub(crate) const DIRECT_DIMS: usize = 8;

/// An exact `numpy.ndarray` of a dtype the wire has, as its own fields
/// say: where its first item is, its shape and strides, its dtype, item
/// size and byte-swap unit (as [`crate::fast::format_dtype`] gives it).
pub(crate) struct NdArray {
    pub(crate) data: *mut std::ffi::c_void,
    pub(crate) nd: usize,
    pub(crate) lengths: [usize; DIRECT_DIMS],
    pub(crate) strides: [isize; DIRECT_DIMS],
    pub(crate) itemsize: usize,
    pub(crate) dtype: Dtype,
    pub(crate) swap: usize,
}

impl NdArray {
    /// `obj`'s fields, if it is an exact numpy array of a wire dtype with
    /// at most [`DIRECT_DIMS`] axes and numpy here has the layout
    /// [`ndarray_layout_ok`] confirmed; None otherwise (the caller then
    /// takes the buffer protocol, [`Held`]).
    ///
    /// Why: numpy's `getbuffer` builds the array's format string and
    /// compares it with the one it cached, on every call. With the view's
    /// box and its release, that was about 860 instructions a field of a
    /// put, a sixth of the core's work on a 32-field put (callgrind).
    /// Read here, it is the fields' loads and a copy of the shape and
    /// strides (the array's own may be replaced by an in-place reshape
    /// while the put runs with the GIL released).
    pub(crate) fn read(obj: &Bound<'_, PyAny>) -> Option<NdArray> {
        if !crate::indexes::is_ndarray(obj) || !ndarray_layout_ok(obj.py()) {
            return None;
        }
        // SAFETY: `obj` is an exact numpy.ndarray with numpy's object
        // layout (`ndarray_layout_ok`), alive (borrowed), read with the GIL
        // held.
        let f = unsafe { NdFields::read(obj.as_ptr()) };
        let (dtype, itemsize, swap) = wire_dtype(f.type_num, f.byteorder)?;
        if f.nd < 0 || f.nd as usize > DIRECT_DIMS || f.data.is_null() {
            return None;
        }
        let nd = f.nd as usize;
        let mut a = NdArray {
            data: f.data,
            nd,
            lengths: [0; DIRECT_DIMS],
            strides: [0; DIRECT_DIMS],
            itemsize,
            dtype,
            swap,
        };
        for k in 0..nd {
            // SAFETY: numpy keeps `nd` lengths and `nd` strides at these
            // pointers while the array lives.
            let (d, st) = unsafe { (*f.dimensions.add(k), *f.strides.add(k)) };
            a.lengths[k] = usize::try_from(d).ok()?;
            a.strides[k] = st;
        }
        Some(a)
    }
}

/// The fields of a numpy array (`PyArrayObject_fields`) and of its dtype
/// (`PyArray_Descr`) read here: their offsets are the same in numpy 1.x
/// and 2.x (data, nd, dimensions, strides, base, descr after the
/// object head; a descr's byteorder and type_num after its head and type
/// object), and are checked against the buffer protocol once
/// ([`ndarray_layout_ok`]).
struct NdFields {
    data: *mut std::ffi::c_void,
    nd: i32,
    dimensions: *const isize,
    strides: *const isize,
    type_num: i32,
    byteorder: u8,
}

#[repr(C)]
struct ArrayHead {
    ob_base: ffi::PyObject,
    data: *mut std::ffi::c_void,
    nd: i32,
    dimensions: *const isize,
    strides: *const isize,
    base: *mut ffi::PyObject,
    descr: *const DescrHead,
}

#[repr(C)]
struct DescrHead {
    ob_base: ffi::PyObject,
    typeobj: *mut ffi::PyObject,
    kind: u8,
    type_: u8,
    byteorder: u8,
    flags: u8,
    type_num: i32,
}

impl NdFields {
    /// # Safety
    /// `obj` is a live numpy array, of numpy's layout, the GIL held.
    unsafe fn read(obj: *mut ffi::PyObject) -> NdFields {
        // SAFETY: the caller's contract.
        unsafe {
            let a = &*obj.cast::<ArrayHead>();
            let d = &*a.descr;
            NdFields {
                data: a.data,
                nd: a.nd,
                dimensions: a.dimensions,
                strides: a.strides,
                type_num: d.type_num,
                byteorder: d.byteorder,
            }
        }
    }
}

/// A numpy type number and byte order as (dtype, itemsize, byte-swap
/// unit): the builtin numeric types the wire has (`long` is 8 bytes on
/// the 64-bit Linux this is built for; `longdouble` and the rest: None).
fn wire_dtype(type_num: i32, byteorder: u8) -> Option<(Dtype, usize, usize)> {
    const _: () = assert!(std::mem::size_of::<std::ffi::c_long>() == 8);
    let (dtype, itemsize) = match type_num {
        0 => (Dtype::Bool, 1),
        1 => (Dtype::Int8, 1),
        2 => (Dtype::Uint8, 1),
        3 => (Dtype::Int16, 2),
        4 => (Dtype::Uint16, 2),
        5 => (Dtype::Int32, 4),
        6 => (Dtype::Uint32, 4),
        7 | 9 => (Dtype::Int64, 8),
        8 | 10 => (Dtype::Uint64, 8),
        11 => (Dtype::Float32, 4),
        12 => (Dtype::Float64, 8),
        14 => (Dtype::Complex64, 8),
        15 => (Dtype::Complex128, 16),
        23 => (Dtype::Float16, 2),
        _ => return None,
    };
    let big = match byteorder {
        b'>' => true,
        b'<' => false,
        b'=' | b'|' => cfg!(target_endian = "big"),
        _ => return None,
    };
    let swap = match (big, dtype) {
        (false, _) => 1,
        (true, Dtype::Complex64 | Dtype::Complex128) => itemsize / 2,
        (true, _) => itemsize,
    };
    Some((dtype, itemsize, swap))
}

/// Whether numpy's arrays here have the layout [`NdFields`] reads and
/// the type numbers [`wire_dtype`] knows: checked once, on a strided
/// array of every dtype the wire has in both byte orders, read both ways
/// (fields, buffer protocol). They must agree on the address, the shape,
/// the strides, the dtype, the item size and the byte-swap unit.
/// Otherwise every array takes the buffer protocol.
pub(crate) fn ndarray_layout_ok(py: Python<'_>) -> bool {
    static OK: pyo3::sync::PyOnceLock<bool> = pyo3::sync::PyOnceLock::new();
    *OK.get_or_init(py, || {
        let check = || -> PyResult<bool> {
            let np = py.import("numpy")?;
            let cols = pyo3::types::PySlice::new(py, 0, 5, 2);
            let full = pyo3::types::PySlice::full(py);
            for name in [
                "?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16",
            ] {
                for order in ["<", ">"] {
                    let a = np
                        .call_method1("zeros", ((3, 5), format!("{order}{name}")))?
                        .get_item((&full, &cols))?;
                    if !crate::indexes::is_ndarray(&a) {
                        return Ok(false);
                    }
                    let held = Held::with_flags(&a, ffi::PyBUF_RECORDS_RO)?;
                    let Some(theirs) = crate::fast::format_dtype(held.format(), held.itemsize())
                    else {
                        return Ok(false);
                    };
                    // SAFETY: an exact ndarray just made; its head is read
                    // as numpy lays it out, which this compares against.
                    let f = unsafe { NdFields::read(a.as_ptr()) };
                    let Some((dtype, itemsize, swap)) = wire_dtype(f.type_num, f.byteorder) else {
                        return Ok(false);
                    };
                    let nd = held.ndim();
                    let lengths: Vec<isize> = held.lengths().iter().map(|&d| d as isize).collect();
                    let same = f.data.cast_const().cast::<u8>() == held.ptr()
                        && f.nd as usize == nd
                        // SAFETY: `nd` lengths and strides, as numpy keeps
                        // them while `a` lives.
                        && unsafe { std::slice::from_raw_parts(f.dimensions, nd) } == &lengths[..]
                        && Some(unsafe { std::slice::from_raw_parts(f.strides, nd) })
                            == held.stride_slice()
                        && (dtype, swap) == theirs
                        && itemsize == held.itemsize();
                    if !same {
                        return Ok(false);
                    }
                }
            }
            Ok(true)
        };
        check().unwrap_or(false)
    })
}
