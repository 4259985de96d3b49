//! A caller's array as the bytes a put sends: [`Source`], its buffer held
//! (or, for a big-endian array, a little-endian copy of ours), read as its
//! shape and strides say. Rows of it are handed to a writer as the
//! contiguous blocks they are made of ([`Source::blocks`]), so a strided
//! array goes out as slices of itself, or copied block by block into the
//! writer's own buffer, and is never copied whole first (as numpy's
//! `copy(order="C")` did before).

use pyo3::prelude::*;

use crate::buffer::Held;
use crate::ndarray::{DIRECT_DIMS, NdArray};

/// What keeps a [`Source`]'s bytes alive.
enum Keep {
    /// The caller's buffer, held until the source is dropped.
    Held(Held),
    /// A copy of ours (a big-endian array, swapped; or gathered).
    Owned(#[allow(dead_code, reason = "held for its bytes")] Vec<u8>),
    /// A numpy array read from its own fields ([`Source::of_ndarray`]):
    /// a reference to it, and its shape and strides as they were read.
    Array(ArrayKeep),
}

/// What a [`Keep::Array`] holds.
struct ArrayKeep {
    /// Dropped with the interpreter attached (see `Drop`).
    array: Option<Py<PyAny>>,
    nd: usize,
    lengths: [usize; DIRECT_DIMS],
    strides: [isize; DIRECT_DIMS],
}

impl Drop for ArrayKeep {
    fn drop(&mut self) {
        // Attached, so that the reference is given back now, from whatever
        // thread, not queued for the next thread that attaches.
        if let Some(a) = self.array.take() {
            Python::attach(|_| drop(a));
        }
    }
}

/// An array's bytes: element `[i0, i1, ...]` lies at `base + Σ ik *
/// strides[k]`, `itemsize` bytes of it.
pub(crate) struct Source {
    keep: Keep,
    /// The address of element `[0, 0, ...]` (an address, so that the
    /// source is `Send`: the bytes are owned or held by `keep`).
    base: usize,
    itemsize: usize,
    /// The shape, where it is not the held buffer's own (which the
    /// exporter keeps with the view: nothing to copy for the usual array).
    own_shape: Option<Vec<usize>>,
    /// Whether the bytes lie C-contiguous: rows `a..b` are then one slice.
    /// (A source that is not is the caller's buffer, its strides the
    /// exporter's.)
    contiguous: bool,
}

impl Source {
    /// The array `held` (shape, strides, itemsize as its exporter gives
    /// them), its items byte-swapped in units of `swap` bytes into a copy
    /// of ours when `swap > 1` (a big-endian array; a complex one swaps
    /// each of its two parts).
    pub(crate) fn new(held: Held, swap: usize) -> Source {
        let itemsize = held.itemsize();
        let own_shape = match held.lengths_slice() {
            Some(_) => None,
            None => Some(held.lengths()),
        };
        let contiguous = {
            let shape = own_shape.as_deref().or(held.lengths_slice()).unwrap_or(&[]);
            held.stride_slice()
                .is_none_or(|s| is_c_contiguous(shape, s, itemsize))
        };
        let base = held.ptr() as usize;
        Source {
            keep: Keep::Held(held),
            base,
            itemsize,
            own_shape,
            contiguous,
        }
        .swapped(swap)
    }

    /// This source, its items byte-swapped in units of `swap` bytes into
    /// a copy of ours when `swap > 1` (a big-endian array; a complex one
    /// swaps each of its two parts); as it is otherwise.
    fn swapped(self, swap: usize) -> Source {
        if swap <= 1 || self.itemsize <= 1 {
            return self;
        }
        let mut bytes = self.gather();
        for unit in bytes.chunks_exact_mut(swap) {
            unit.reverse();
        }
        self.with_bytes(bytes, None)
    }

    /// An exact numpy array of a dtype the wire has, read from its own
    /// fields (`ndarray::NdArray`) rather than through the buffer protocol:
    /// the source and its dtype; None for any other object, which then
    /// takes [`Held`] (see `NdArray::read` for why).
    pub(crate) fn of_ndarray(
        obj: &Bound<'_, PyAny>,
    ) -> Option<(Source, stowage_wire::tensor::Dtype)> {
        let a = NdArray::read(obj)?;
        let contiguous = is_c_contiguous(&a.lengths[..a.nd], &a.strides[..a.nd], a.itemsize);
        let source = Source {
            keep: Keep::Array(ArrayKeep {
                array: Some(obj.clone().unbind()),
                nd: a.nd,
                lengths: a.lengths,
                strides: a.strides,
            }),
            base: a.data as usize,
            itemsize: a.itemsize,
            own_shape: None,
            contiguous,
        };
        Some((source.swapped(a.swap), a.dtype))
    }

    /// The same elements, C-contiguous in `bytes` (ours), as `shape` (the
    /// same element count; None: this source's).
    fn with_bytes(&self, bytes: Vec<u8>, shape: Option<Vec<usize>>) -> Source {
        let shape = shape.unwrap_or_else(|| self.shape().to_vec());
        Source {
            base: bytes.as_ptr() as usize,
            keep: Keep::Owned(bytes),
            itemsize: self.itemsize,
            own_shape: Some(shape),
            contiguous: true,
        }
    }

    /// This source as C-contiguous `shape` (the same element count, in C
    /// order): itself relabelled, or a copy gathered once if its bytes
    /// are not contiguous.
    pub(crate) fn reshaped(self, shape: Vec<usize>) -> Source {
        if self.contiguous {
            return Source {
                own_shape: Some(shape),
                ..self
            };
        }
        let bytes = self.gather();
        self.with_bytes(bytes, Some(shape))
    }

    pub(crate) fn shape(&self) -> &[usize] {
        match (&self.own_shape, &self.keep) {
            (Some(shape), _) => shape,
            (None, Keep::Held(held)) => held.lengths_slice().unwrap_or(&[]),
            (None, Keep::Array(a)) => &a.lengths[..a.nd],
            (None, Keep::Owned(_)) => &[],
        }
    }

    /// Each axis' stride in bytes: a source that is not contiguous is the
    /// caller's buffer, and these are its exporter's.
    fn strides(&self) -> &[isize] {
        match &self.keep {
            Keep::Held(held) => held.stride_slice().unwrap_or(&[]),
            Keep::Array(a) => &a.strides[..a.nd],
            Keep::Owned(_) => &[],
        }
    }

    pub(crate) fn itemsize(&self) -> usize {
        self.itemsize
    }

    pub(crate) fn is_contiguous(&self) -> bool {
        self.contiguous
    }

    /// How many elements the array has.
    pub(crate) fn elements(&self) -> usize {
        self.shape().iter().product()
    }

    /// Bytes of one row (of the first axis; a 0-d array's one item).
    pub(crate) fn row_bytes(&self) -> usize {
        self.itemsize * self.shape().iter().skip(1).product::<usize>()
    }

    /// Bytes of the whole array.
    pub(crate) fn nbytes(&self) -> usize {
        self.itemsize * self.elements()
    }

    /// Bytes `off..off + len` of a contiguous source.
    pub(crate) fn slice(&self, off: usize, len: usize) -> &[u8] {
        debug_assert!(self.contiguous && off + len <= self.nbytes());
        if len == 0 {
            return &[];
        }
        // SAFETY: the source is contiguous and holds `nbytes` bytes from
        // `base` (checked in debug builds, guaranteed by the callers, which
        // lay out ranges of `nbytes`), alive while `self` is.
        unsafe { std::slice::from_raw_parts((self.base + off) as *const u8, len) }
    }

    /// Bytes of the contiguous blocks a non-contiguous source's rows are
    /// made of (the innermost axes that lie contiguous), and how many
    /// leading axes are counted over them.
    fn run(&self) -> (usize, usize) {
        let (shape, strides) = (self.shape(), self.strides());
        let mut block = self.itemsize;
        let mut j = shape.len();
        while j > 1 && (shape[j - 1] == 1 || strides[j - 1] == block as isize) {
            block *= shape[j - 1];
            j -= 1;
        }
        (block, j)
    }

    /// Bytes of the contiguous blocks [`Source::blocks`] gives (a whole
    /// row or more for a contiguous source).
    pub(crate) fn block_bytes(&self) -> usize {
        if self.contiguous || self.shape().is_empty() {
            return self.row_bytes();
        }
        self.run().0
    }

    /// Calls `each(address, count, stride)` for every run of `count` blocks
    /// `stride` bytes apart that rows `a..b` of a non-contiguous source are
    /// made of, in order (its blocks are [`Source::run`]'s).
    fn runs<E>(
        &self,
        a: usize,
        b: usize,
        each: &mut dyn FnMut(isize, usize, isize) -> Result<(), E>,
    ) -> Result<(), E> {
        let (shape, strides) = (self.shape(), self.strides());
        let (block, j) = self.run();
        if j == 1 && (b - a == 1 || strides[0] == block as isize) {
            // The rows themselves follow on: one block.
            return each(self.base as isize + a as isize * strides[0], 1, 0);
        }
        // Axes 0..j counted like an odometer, axis 0 from a to b; the last
        // of them (`j - 1`) is each run.
        let inner = j - 1;
        if inner == 0 {
            return each(
                self.base as isize + a as isize * strides[0],
                b - a,
                strides[0],
            );
        }
        let mut index = vec![0usize; inner];
        index[0] = a;
        loop {
            let mut at = self.base as isize;
            for (k, &i) in index.iter().enumerate() {
                at += i as isize * strides[k];
            }
            each(at, shape[inner], strides[inner])?;
            // Next index of axes 0..inner.
            let mut k = inner - 1;
            loop {
                index[k] += 1;
                let end = if k == 0 { b } else { shape[k] };
                if index[k] < end {
                    break;
                }
                if k == 0 {
                    return Ok(());
                }
                index[k] = 0;
                k -= 1;
            }
        }
    }

    /// Gives the bytes of rows `a..b` (of the first axis; a 0-d source's
    /// one item for `0..1`) to `f`, in order, as the contiguous blocks they
    /// are made of: one slice for a contiguous source, else one per run of
    /// the innermost axes that lie contiguous (a transposed array's every
    /// item: [`Source::copy_rows`] copies those faster).
    pub(crate) fn blocks<'s, E>(
        &'s self,
        a: usize,
        b: usize,
        f: &mut dyn FnMut(&'s [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let row = self.row_bytes();
        if b <= a || row == 0 {
            return Ok(());
        }
        if self.shape().is_empty() {
            return f(self.slice(0, self.itemsize));
        }
        if self.contiguous {
            return f(self.slice(a * row, (b - a) * row));
        }
        let (block, _) = self.run();
        let len = if self.run().1 == 1 && (b - a == 1 || self.strides()[0] == block as isize) {
            (b - a) * row
        } else {
            block
        };
        self.runs(a, b, &mut |at, count, stride| {
            for i in 0..count {
                let p = (at + i as isize * stride) as usize;
                // SAFETY: every index is inside the shape, so the block
                // lies inside the held buffer, alive while `self` is.
                f(unsafe { std::slice::from_raw_parts(p as *const u8, len) })?;
            }
            Ok(())
        })
    }

    /// Copies rows `a..b` into `out` (exactly their bytes), C-contiguous:
    /// block by block, with one load and store per block where a block is
    /// a machine word or less (a transposed array's items).
    pub(crate) fn copy_rows(&self, a: usize, b: usize, out: &mut [u8]) {
        debug_assert_eq!(out.len(), (b - a) * self.row_bytes());
        if b <= a || out.is_empty() {
            return;
        }
        if self.contiguous || self.shape().is_empty() {
            let row = self.row_bytes();
            let from = if self.shape().is_empty() { 0 } else { a * row };
            out.copy_from_slice(self.slice(from, out.len()));
            return;
        }
        let (block, j) = self.run();
        let one = j == 1 && (b - a == 1 || self.strides()[0] == block as isize);
        let block = if one { out.len() } else { block };
        let mut to = 0usize;
        let dst = out.as_mut_ptr();
        let _ = self.runs::<()>(a, b, &mut |at, count, stride| {
            // SAFETY: each block lies inside the held buffer (the indexes
            // are inside the shape), and the blocks of rows a..b add up to
            // `out`'s length, so `to..to + count * block` is inside it.
            unsafe {
                let dst = dst.add(to);
                match block {
                    1 => copy_blocks::<1>(at, count, stride, dst),
                    2 => copy_blocks::<2>(at, count, stride, dst),
                    4 => copy_blocks::<4>(at, count, stride, dst),
                    8 => copy_blocks::<8>(at, count, stride, dst),
                    16 => copy_blocks::<16>(at, count, stride, dst),
                    _ => {
                        for i in 0..count {
                            std::ptr::copy_nonoverlapping(
                                (at + i as isize * stride) as *const u8,
                                dst.add(i * block),
                                block,
                            );
                        }
                    }
                }
            }
            to += count * block;
            Ok(())
        });
    }

    /// Every byte of the array, C-contiguous, in a new buffer.
    fn gather(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.nbytes()];
        let rows = self.shape().first().copied().unwrap_or(1);
        self.copy_rows(0, rows, &mut out);
        out
    }
}

/// Copies `count` blocks of `N` bytes, `stride` bytes apart from address
/// `at`, to `dst` back to back.
///
/// # Safety
/// Every block is readable, `dst` has room for `count * N` bytes, and the
/// two do not overlap.
unsafe fn copy_blocks<const N: usize>(at: isize, count: usize, stride: isize, dst: *mut u8) {
    for i in 0..count {
        // SAFETY: the caller's contract.
        unsafe {
            let v = std::ptr::read_unaligned((at + i as isize * stride) as *const [u8; N]);
            std::ptr::write_unaligned(dst.add(i * N).cast::<[u8; N]>(), v);
        }
    }
}

/// Whether `strides` lay `shape` out C-contiguous (axes of one element, or
/// arrays of none, whatever their strides).
fn is_c_contiguous(shape: &[usize], strides: &[isize], itemsize: usize) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut step = itemsize as isize;
    for k in (0..shape.len()).rev() {
        if shape[k] != 1 && strides[k] != step {
            return false;
        }
        step *= shape[k] as isize;
    }
    true
}
