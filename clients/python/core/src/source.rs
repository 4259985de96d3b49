//! A caller's array as the bytes a put sends: [`Source`], its buffer held
//! (or, for a big-endian array, a little-endian copy of ours), read as its
//! shape and strides say. Rows of it are handed to a writer as the
//! contiguous blocks they are made of ([`Source::blocks`]), so a strided
//! array goes out as slices of itself, or copied block by block into the
//! writer's own buffer, and is never copied whole first (as numpy's
//! `copy(order="C")` did before).

use crate::buffer::Held;

/// What keeps a [`Source`]'s bytes alive.
enum Keep {
    /// The caller's buffer, held until the source is dropped.
    Held(#[allow(dead_code, reason = "held for its Drop")] Held),
    /// A copy of ours (a big-endian array, swapped; or gathered).
    Owned(#[allow(dead_code, reason = "held for its bytes")] Vec<u8>),
}

/// An array's bytes: element `[i0, i1, ...]` lies at `base + Σ ik *
/// strides[k]`, `itemsize` bytes of it.
pub(crate) struct Source {
    _keep: Keep,
    /// The address of element `[0, 0, ...]` (an address, so that the
    /// source is `Send`: the bytes are owned or held by `_keep`).
    base: usize,
    itemsize: usize,
    shape: Vec<usize>,
    strides: Vec<isize>,
    /// Whether the bytes lie C-contiguous: rows `a..b` are then one slice.
    contiguous: bool,
}

impl Source {
    /// The array `held` (shape, strides, itemsize as its exporter gives
    /// them), its items byte-swapped in units of `swap` bytes into a copy
    /// of ours when `swap > 1` (a big-endian array; a complex one swaps
    /// each of its two parts).
    pub(crate) fn new(held: Held, swap: usize) -> Source {
        let itemsize = held.itemsize();
        let shape: Vec<usize> = held.shape().iter().map(|&d| d as usize).collect();
        let strides = match held.strides() {
            Some(s) => s,
            None => c_strides(&shape, itemsize),
        };
        let base = held.ptr() as usize;
        let contiguous = is_c_contiguous(&shape, &strides, itemsize);
        let source = Source {
            _keep: Keep::Held(held),
            base,
            itemsize,
            shape,
            strides,
            contiguous,
        };
        if swap > 1 && itemsize > 1 {
            let mut bytes = source.gather();
            for unit in bytes.chunks_exact_mut(swap) {
                unit.reverse();
            }
            return source.with_bytes(bytes, None);
        }
        source
    }

    /// The same elements, C-contiguous in `bytes` (ours), as `shape` (the
    /// same element count; None: this source's).
    fn with_bytes(&self, bytes: Vec<u8>, shape: Option<Vec<usize>>) -> Source {
        let shape = shape.unwrap_or_else(|| self.shape.clone());
        Source {
            base: bytes.as_ptr() as usize,
            _keep: Keep::Owned(bytes),
            itemsize: self.itemsize,
            strides: c_strides(&shape, self.itemsize),
            shape,
            contiguous: true,
        }
    }

    /// This source as C-contiguous `shape` (the same element count, in C
    /// order): itself relabelled, or a copy gathered once if its bytes
    /// are not contiguous.
    pub(crate) fn reshaped(self, shape: Vec<usize>) -> Source {
        if self.contiguous {
            return Source {
                strides: c_strides(&shape, self.itemsize),
                shape,
                ..self
            };
        }
        let bytes = self.gather();
        self.with_bytes(bytes, Some(shape))
    }

    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub(crate) fn itemsize(&self) -> usize {
        self.itemsize
    }

    pub(crate) fn is_contiguous(&self) -> bool {
        self.contiguous
    }

    /// How many elements the array has.
    pub(crate) fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of one row (of the first axis; a 0-d array's one item).
    pub(crate) fn row_bytes(&self) -> usize {
        self.itemsize * self.shape.iter().skip(1).product::<usize>()
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

    /// Gives the bytes of rows `a..b` (of the first axis; a 0-d source's
    /// one item for `0..1`) to `f`, in order, as the contiguous blocks they
    /// are made of: one slice for a contiguous source, else one per run of
    /// the innermost axes that lie contiguous (a transposed array's every
    /// item).
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
        if self.shape.is_empty() {
            return f(self.slice(0, self.itemsize));
        }
        if self.contiguous {
            return f(self.slice(a * row, (b - a) * row));
        }
        // The innermost axes j.. lie contiguous: blocks of `block` bytes.
        let nd = self.shape.len();
        let mut block = self.itemsize;
        let mut j = nd;
        while j > 1 && (self.shape[j - 1] == 1 || self.strides[j - 1] == block as isize) {
            block *= self.shape[j - 1];
            j -= 1;
        }
        if j == 1 && (b - a == 1 || self.strides[0] == block as isize) {
            // The rows themselves follow on: one block.
            let at = self.base.wrapping_add_signed(a as isize * self.strides[0]);
            // SAFETY: rows a..b lie back to back from `at`, inside the
            // held buffer.
            return f(unsafe { std::slice::from_raw_parts(at as *const u8, (b - a) * row) });
        }
        // Axes 0..j counted like an odometer, axis 0 from a to b; the last
        // of them (`j - 1`) in the inner loop.
        let mut index = vec![0usize; j];
        index[0] = a;
        let inner = j - 1;
        let (inner_len, inner_stride) = (self.shape[inner], self.strides[inner]);
        loop {
            let mut at = self.base as isize;
            for (k, &i) in index.iter().enumerate().take(inner) {
                at += i as isize * self.strides[k];
            }
            let first = if inner == 0 { index[0] } else { 0 };
            let last = if inner == 0 { b } else { inner_len };
            for i in first..last {
                let p = (at + i as isize * inner_stride) as usize;
                // SAFETY: every index is inside the shape, so the block
                // lies inside the held buffer, alive while `self` is.
                f(unsafe { std::slice::from_raw_parts(p as *const u8, block) })?;
            }
            if inner == 0 {
                return Ok(());
            }
            // Next index of axes 0..inner.
            let mut k = inner - 1;
            loop {
                index[k] += 1;
                let end = if k == 0 { b } else { self.shape[k] };
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

    /// Every byte of the array, C-contiguous, in a new buffer.
    fn gather(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.nbytes());
        let rows = self.shape.first().copied().unwrap_or(1);
        let _ = self.blocks::<()>(0, rows, &mut |b| {
            out.extend_from_slice(b);
            Ok(())
        });
        out
    }
}

/// The strides of a C-contiguous array of `shape`.
fn c_strides(shape: &[usize], itemsize: usize) -> Vec<isize> {
    let mut strides = vec![0isize; shape.len()];
    let mut step = itemsize as isize;
    for k in (0..shape.len()).rev() {
        strides[k] = step;
        step *= shape[k].max(1) as isize;
    }
    strides
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
