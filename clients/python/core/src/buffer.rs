//! The buffer protocol, both ways: [`Held`], a caller's buffer held
//! (`PyObject_GetBuffer`) while its bytes move with the GIL released, and
//! [`Buffer`], bytes handed to Python without a copy, as a read-only
//! buffer object.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::pool;

/// A caller's buffer held while its bytes are sent with the GIL released:
/// C-contiguous, of any item type (no format is asked for), neither freed
/// nor resized until released (on drop).
pub(crate) struct Held(Box<ffi::Py_buffer>);

impl Held {
    pub(crate) fn get(obj: &Bound<'_, PyAny>) -> PyResult<Held> {
        Held::with_flags(obj, ffi::PyBUF_C_CONTIGUOUS)
    }

    /// The buffer of `obj` as `flags` ask for it (`PyObject_GetBuffer`).
    pub(crate) fn with_flags(obj: &Bound<'_, PyAny>, flags: std::os::raw::c_int) -> PyResult<Held> {
        // Boxed: an exporter may point the view's fields into the view
        // itself, so it must not move. Not zeroed whole: the exporter
        // fills the view on success (`PyBuffer_FillInfo` and numpy's
        // `array_getbuffer` set every field), and a zeroed box was glibc's
        // `calloc`, which bypasses the per-thread cache: about 300
        // instructions a field of a put, where `malloc` takes a few dozen.
        // The pointers are nulled all the same, for an exporter that sets
        // only the fields its flags ask for.
        let mut view = Box::<ffi::Py_buffer>::new_uninit();
        let p = view.as_mut_ptr();
        // SAFETY: `p` is room for a Py_buffer: its pointer fields are
        // written through raw places (nothing uninitialised is read); the
        // exporter fills the rest; on success the view is released exactly
        // once, by `drop`.
        let rc = unsafe {
            (&raw mut (*p).buf).write(std::ptr::null_mut());
            (&raw mut (*p).obj).write(std::ptr::null_mut());
            (&raw mut (*p).format).write(std::ptr::null_mut());
            (&raw mut (*p).shape).write(std::ptr::null_mut());
            (&raw mut (*p).strides).write(std::ptr::null_mut());
            (&raw mut (*p).suboffsets).write(std::ptr::null_mut());
            (&raw mut (*p).internal).write(std::ptr::null_mut());
            ffi::PyObject_GetBuffer(obj.as_ptr(), p, flags)
        };
        if rc == -1 {
            return Err(PyErr::fetch(obj.py()));
        }
        // SAFETY: filled by a successful PyObject_GetBuffer.
        Ok(Held(unsafe { view.assume_init() }))
    }

    /// The item format (struct module syntax; "B" when the exporter gave none).
    pub(crate) fn format(&self) -> &[u8] {
        if self.0.format.is_null() {
            return b"B";
        }
        // SAFETY: a NUL-terminated string the exporter keeps with the view.
        unsafe { std::ffi::CStr::from_ptr(self.0.format) }.to_bytes()
    }

    pub(crate) fn itemsize(&self) -> usize {
        self.0.itemsize.max(0) as usize
    }

    /// The shape (none for a 0-d buffer; `[len / itemsize]` when the
    /// exporter gave none).
    pub(crate) fn shape(&self) -> Vec<u64> {
        if self.0.ndim == 0 {
            return Vec::new();
        }
        if self.0.shape.is_null() {
            return vec![(self.0.len.max(0) as u64) / (self.itemsize().max(1) as u64)];
        }
        // SAFETY: `ndim` sizes the exporter keeps with the view.
        unsafe { std::slice::from_raw_parts(self.0.shape, self.0.ndim.max(0) as usize) }
            .iter()
            .map(|&d| d.max(0) as u64)
            .collect()
    }

    /// The exporter's shape as it keeps it with the view, if it gave one
    /// and no length is negative (none is for an array).
    pub(crate) fn lengths_slice(&self) -> Option<&[usize]> {
        if self.0.ndim == 0 {
            return Some(&[]);
        }
        if self.0.shape.is_null() {
            return None;
        }
        // SAFETY: `ndim` sizes the exporter keeps with the view, alive as
        // long as `self`.
        let shape = unsafe { std::slice::from_raw_parts(self.0.shape, self.ndim()) };
        if shape.iter().any(|&d| d < 0) {
            return None;
        }
        // SAFETY: non-negative `Py_ssize_t`s read as `usize`s of the same
        // size and value.
        Some(unsafe { std::slice::from_raw_parts(shape.as_ptr().cast::<usize>(), shape.len()) })
    }

    /// The shape as lengths (as [`Held::shape`] gives it).
    pub(crate) fn lengths(&self) -> Vec<usize> {
        if self.0.ndim == 0 {
            return Vec::new();
        }
        if self.0.shape.is_null() {
            return vec![self.0.len.max(0) as usize / self.itemsize().max(1)];
        }
        // SAFETY: `ndim` sizes the exporter keeps with the view.
        unsafe { std::slice::from_raw_parts(self.0.shape, self.ndim()) }
            .iter()
            .map(|&d| d.max(0) as usize)
            .collect()
    }

    /// Every axis' stride in bytes, as the exporter keeps them (None: it
    /// gave none, the buffer is C-contiguous).
    pub(crate) fn stride_slice(&self) -> Option<&[isize]> {
        if self.0.strides.is_null() {
            return None;
        }
        // SAFETY: `ndim` strides the exporter keeps with the view, alive
        // as long as `self`.
        Some(unsafe { std::slice::from_raw_parts(self.0.strides, self.ndim()) })
    }

    /// The first axis' stride in bytes (the itemsize when the exporter gave none).
    pub(crate) fn stride0(&self) -> isize {
        if self.0.strides.is_null() || self.0.ndim < 1 {
            return self.itemsize() as isize;
        }
        // SAFETY: `ndim` (at least 1) strides the exporter keeps with the view.
        unsafe { *self.0.strides }
    }

    /// Every axis' stride in bytes (None when the exporter gave none: the
    /// buffer is C-contiguous).
    pub(crate) fn strides(&self) -> Option<Vec<isize>> {
        if self.0.strides.is_null() {
            return None;
        }
        // SAFETY: `ndim` strides the exporter keeps with the view.
        Some(unsafe { std::slice::from_raw_parts(self.0.strides, self.ndim()) }.to_vec())
    }

    pub(crate) fn ndim(&self) -> usize {
        self.0.ndim.max(0) as usize
    }

    /// The first byte's address (for strided reads).
    pub(crate) fn ptr(&self) -> *const u8 {
        self.0.buf as *const u8
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        if self.0.len <= 0 {
            return &[];
        }
        // SAFETY: the exporter keeps `len` contiguous bytes at `buf` until
        // the view is released, which `self` outlives. (Another thread may
        // write the array meanwhile; its bytes are only copied out to the
        // socket, as pyzmq would.)
        unsafe { std::slice::from_raw_parts(self.0.buf as *const u8, self.0.len as usize) }
    }
}

// SAFETY: a held buffer is neither freed nor moved until it is released,
// and its bytes are only read: any thread may read them (the point of
// holding it is to read them with the GIL released), and the release in
// `drop` attaches to the interpreter first, from whatever thread.
unsafe impl Send for Held {}
// SAFETY: as above: `&Held` only reads.
unsafe impl Sync for Held {}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: a view PyObject_GetBuffer filled, released once, attached
        // to the interpreter.
        Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut *self.0) });
    }
}

/// Bytes handed to Python without a copy: a read-only buffer object.
#[pyclass(module = "stowage._core", frozen)]
pub(crate) struct Buffer {
    pub(crate) data: Vec<u8>,
}

#[pymethods]
impl Buffer {
    /// The buffer protocol: a read-only view of the bytes.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let (ptr, len) = {
            let me = slf.get();
            (me.data.as_ptr(), me.data.len())
        };
        // SAFETY: `view` comes from Python's buffer machinery; the bytes
        // never move or change and live as long as `slf`, which the view
        // holds a reference to.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr as *mut std::os::raw::c_void,
                len as pyo3::ffi::Py_ssize_t,
                1,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.data.len()
    }
}

impl Drop for Buffer {
    /// The last array over these bytes is gone: the next get may take them.
    fn drop(&mut self) {
        pool::give(std::mem::take(&mut self.data));
    }
}

/// Holds the buffers of `frames` (each a buffer, or a list of pieces sent
/// back to back as one frame) in `held`; how many pieces each frame has.
pub(crate) fn hold_frames(
    frames: &[Bound<'_, PyAny>],
    held: &mut Vec<Held>,
) -> PyResult<Vec<usize>> {
    let mut counts = Vec::with_capacity(frames.len());
    for frame in frames {
        if let Ok(pieces) = frame.cast::<PyList>() {
            for piece in pieces.iter() {
                held.push(Held::get(&piece)?);
            }
            counts.push(pieces.len());
        } else {
            held.push(Held::get(frame)?);
            counts.push(1);
        }
    }
    Ok(counts)
}
