//! Mappings of stowd's shared-memory segments (a same-node client's):
//! [`Segments`], `_core.Segments`, one read-only shared mapping per memory
//! file, and the buffer objects arrays are made over: [`SharedPages`] (a
//! whole read-only mapping) and [`PrivatePages`] (a private copy-on-write
//! mapping of part of a segment, for tensors).
//!
//! A segment is mapped once (`PROT_READ`, `MAP_SHARED`), keyed by the
//! file's (device, inode): two gets of the same rows, with descriptors
//! received anew each time, give arrays over the very same memory (the
//! same data pointer), and every reader of the node shares its pages. The
//! cache holds the mappings weakly: a mapping lives while an array over it
//! does (an array holds its [`SharedPages`], which holds the mapping), and
//! stays valid after the rows are cleared in stowd. A mapping is made anew
//! if the file's size changed.
//!
//! torch has no read-only tensors, and a write through a tensor over a
//! `PROT_READ` page kills the process (SIGSEGV): tensors are made over
//! [`PrivatePages`] instead, a `MAP_PRIVATE`, `PROT_READ | PROT_WRITE`
//! mapping of the same file (opened read-only) that each get maps anew.
//! Until a write its pages are the very pages every other reader maps
//! (nothing is copied); a write copies only the page it touches, into this
//! process, and the file and every other mapping of it never see it.
//!
//! Only sealed segments are mapped (`F_SEAL_SHRINK` and `F_SEAL_WRITE`, as
//! stowd seals every segment a reply names): a file that could shrink under
//! a mapping would fault on a read. A mapping does not keep its descriptor
//! open (the kernel keeps the file while it is mapped).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Mutex, Weak};

use memmap2::{Mmap, MmapMut, MmapOptions};
use pyo3::prelude::*;

use crate::error::Fail;

/// A whole segment, mapped read-only and shared (no mapping when empty).
pub(crate) struct Mapping {
    map: Option<Mmap>,
}

impl Mapping {
    pub(crate) fn len(&self) -> usize {
        self.map.as_ref().map_or(0, |m| m.len())
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

/// The file of a descriptor: (device, inode), size; refused unless it is
/// sealed against shrinking and writes, as stowd seals every segment a
/// reply names (the trust model): a file that could shrink under a mapping
/// would fault (SIGBUS) on a read of the pages cut off.
fn identity(fd: BorrowedFd<'_>) -> Result<((u64, u64), u64), Fail> {
    use rustix::fs::SealFlags;
    let sealed = SealFlags::SHRINK | SealFlags::WRITE;
    match rustix::fs::fcntl_get_seals(fd) {
        Ok(seals) if seals.contains(sealed) => {}
        _ => {
            return Err(Fail::Protocol(
                "a segment that is not sealed against shrinking and writes".into(),
            ));
        }
    }
    let st = rustix::fs::fstat(fd).map_err(|e| Fail::Io(format!("fstat of a segment: {e}")))?;
    Ok(((st.st_dev, st.st_ino), st.st_size.max(0) as u64))
}

/// This client's mappings of stowd's segments (see the module doc).
#[pyclass(module = "stowage._core", frozen)]
pub(crate) struct Segments {
    cache: Mutex<HashMap<(u64, u64), Weak<Mapping>>>,
}

impl Segments {
    /// The whole segment `fd` is, mapped read-only and shared: the mapping
    /// already made for its file if an array still uses it (and its size
    /// is the same), else a new one.
    pub(crate) fn map(&self, fd: BorrowedFd<'_>) -> Result<Arc<Mapping>, Fail> {
        let (key, size) = identity(fd)?;
        let size = usize::try_from(size)
            .map_err(|_| Fail::Protocol(format!("a segment of {size} bytes")))?;
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = cache.get(&key).and_then(Weak::upgrade)
            && m.len() == size
        {
            return Ok(m);
        }
        let map = if size == 0 {
            None
        } else {
            // SAFETY: the segment is sealed against writes and shrinking
            // (checked above), and mapped read-only: the bytes behind the
            // slice stay as they are, and there, for as long as the
            // mapping lives.
            Some(
                unsafe { MmapOptions::new().len(size).map(fd.as_raw_fd()) }
                    .map_err(|e| Fail::Io(format!("cannot map a segment: {e}")))?,
            )
        };
        let m = Arc::new(Mapping { map });
        cache.retain(|_, w| w.strong_count() > 0);
        cache.insert(key, Arc::downgrade(&m));
        Ok(m)
    }
}

#[pymethods]
impl Segments {
    #[new]
    fn new() -> Segments {
        Segments {
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// How many segments are mapped (some array uses them).
    fn mapped(&self) -> usize {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.values().filter(|w| w.strong_count() > 0).count()
    }

    /// Forgets every mapping: each is unmapped once no array uses it, and
    /// the next get maps its segments anew. (Mappings no array uses are
    /// gone anyway.)
    fn release(&self) {
        self.cache.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// A private copy-on-write mapping of bytes `lo..hi` of the segment `fd`
/// (see the module doc): its own, never cached.
pub(crate) fn private(fd: BorrowedFd<'_>, lo: u64, hi: u64) -> Result<MmapMut, Fail> {
    let len = usize::try_from(hi - lo).map_err(|_| Fail::Protocol("a huge range".into()))?;
    // SAFETY: a private mapping: what this process writes stays in its
    // own copies of the pages, and the file (sealed) never changes under
    // it.
    unsafe {
        MmapOptions::new()
            .offset(lo)
            .len(len)
            .map_copy(fd.as_raw_fd())
    }
    .map_err(|e| Fail::Io(format!("cannot map a segment privately: {e}")))
}

/// Fills a Python buffer view with `len` bytes at `ptr`, owned by `owner`.
///
/// # Safety
/// `view` comes from Python's buffer machinery; the bytes stay where they
/// are, and alive, as long as `owner`, which the view holds a reference to.
unsafe fn fill_view(
    owner: &Bound<'_, PyAny>,
    view: *mut pyo3::ffi::Py_buffer,
    ptr: *const u8,
    len: usize,
    readonly: bool,
    flags: std::os::raw::c_int,
) -> PyResult<()> {
    // SAFETY: the caller's.
    let rc = unsafe {
        pyo3::ffi::PyBuffer_FillInfo(
            view,
            owner.as_ptr(),
            ptr as *mut std::os::raw::c_void,
            len as pyo3::ffi::Py_ssize_t,
            i32::from(readonly),
            flags,
        )
    };
    if rc == -1 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}

/// A whole shared mapping as a read-only buffer: the arrays of a get that
/// lie in one segment are views of it, and keep it mapped.
#[pyclass(module = "stowage._core", frozen)]
pub(crate) struct SharedPages {
    pub(crate) map: Arc<Mapping>,
}

#[pymethods]
impl SharedPages {
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let bytes = slf.get().map.bytes();
        let (ptr, len) = (bytes.as_ptr(), bytes.len());
        // SAFETY: the mapping lives as long as `slf` (its Arc), which the
        // view holds; it is read-only, and so is the view.
        unsafe { fill_view(slf.as_any(), view, ptr, len, true, flags) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.map.len()
    }
}

/// A private copy-on-write mapping as a writable buffer (tensors).
#[pyclass(module = "stowage._core", frozen)]
pub(crate) struct PrivatePages {
    map: MmapMut,
    /// The first byte's address (taken once, from the mutable mapping).
    ptr: usize,
}

impl PrivatePages {
    pub(crate) fn new(mut map: MmapMut) -> PrivatePages {
        let ptr = map.as_mut_ptr() as usize;
        PrivatePages { map, ptr }
    }

    /// The first byte's address.
    pub(crate) fn ptr(&self) -> usize {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

#[pymethods]
impl PrivatePages {
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let (ptr, len) = (slf.get().ptr as *const u8, slf.get().map.len());
        // SAFETY: the mapping lives as long as `slf`, which the view holds;
        // it is this get's own (private), so writes through it reach no
        // one else.
        unsafe { fill_view(slf.as_any(), view, ptr, len, false, flags) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.map.len()
    }
}
