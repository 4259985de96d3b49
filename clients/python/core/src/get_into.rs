//! `Connection.get_into`: a get whose reply goes straight into the
//! caller's arrays, every requested field checked against its array
//! (kind, dtype, shape, bytes) before any byte is written.
//!
//! An array may be strided (a slice, a transposed array, a column of a
//! bigger one). Its bytes are then runs: the longest stretch of it that is
//! contiguous in memory (its trailing axes that are), the runs of a row
//! one after another in the reply. Runs of at least [`VECTORED_RUN`] bytes
//! are read from the socket straight into place, one slice each (a
//! `recvmsg` takes up to [`crate::stream::IOV_MAX`] of them); shorter runs
//! (an inner axis that is strided itself: every element a run) are read
//! into one scratch buffer of the field's size, then scattered into the
//! array by one copy. Why the threshold: a run a slice, the kernel's
//! per-slice cost outweighs the copy below about 2 KiB (256 B rows: 1.24
//! GB/s straight into place, 2.03 through the scratch buffer; 4 KiB rows:
//! 2.63 against 2.15; docs/benchmarks.md, "get_into a strided array").

use std::sync::Arc;
use stowage_wire::native::{FieldLayout, PartLayout};

use crate::buffer::Held;
use crate::error::Fail;
use crate::message::write_message;
use crate::pool;
use crate::receive::{Other, Place, Places, read_frames, read_head, segments};
use crate::stream::Stream;

/// Shortest run read straight into a strided array; shorter ones go
/// through a scratch buffer (see the module doc).
pub(crate) const VECTORED_RUN: usize = 2 << 10;

/// [`VECTORED_RUN`], or `STOWAGE_VECTORED_RUN` bytes (for benchmarks:
/// `bench/core_get_into.py --strided` compares the two ways with it).
fn vectored_run() -> usize {
    std::env::var("STOWAGE_VECTORED_RUN")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(VECTORED_RUN)
}

/// A caller's array, writable: where a field's rows go.
pub(crate) struct Target {
    pub(crate) name: String,
    pub(crate) dtypes: Vec<String>,
    pub(crate) shape: Vec<u64>,
    /// The address of its first element.
    pub(crate) ptr: usize,
    /// Bytes its elements hold.
    pub(crate) len: usize,
    /// None: C-contiguous, `len` bytes from `ptr`.
    pub(crate) strided: Option<Strided>,
}

impl Target {
    /// The target `held` (a buffer got with strides, writable) is.
    pub(crate) fn new(name: String, dtypes: Vec<String>, shape: Vec<u64>, held: &Held) -> Target {
        let itemsize = held.itemsize();
        let dims: Vec<u64> = held.shape();
        let len = dims.iter().product::<u64>() as usize * itemsize;
        let strided = match held.strides() {
            Some(strides) if len > 0 => Strided::of(itemsize, &dims, &strides),
            _ => None,
        };
        Target {
            name,
            dtypes,
            shape,
            ptr: held.ptr() as usize,
            len,
            strided,
        }
    }
}

/// Where a strided array's bytes lie: runs of `run` bytes, each
/// contiguous, at the offsets the `outer` axes give (count, stride in
/// bytes; outermost first), in C order.
pub(crate) struct Strided {
    run: usize,
    outer: Vec<(usize, isize)>,
}

impl Strided {
    /// The layout of an array of `itemsize`-byte items, `shape` and
    /// `strides` (bytes), not empty; None when it is C-contiguous.
    fn of(itemsize: usize, shape: &[u64], strides: &[isize]) -> Option<Strided> {
        let mut run = itemsize;
        let mut k = shape.len();
        while k > 0 {
            let (n, s) = (shape[k - 1] as usize, strides[k - 1]);
            if n != 1 && s != run as isize {
                break;
            }
            run *= n;
            k -= 1;
        }
        if k == 0 {
            return None;
        }
        let outer = (0..k).map(|d| (shape[d] as usize, strides[d])).collect();
        Some(Strided { run, outer })
    }

    /// How many runs (all of them).
    fn runs(&self) -> usize {
        self.outer.iter().map(|d| d.0).product()
    }

    /// Each run's offset from the first element, in C order.
    fn offsets(&self) -> Vec<isize> {
        let mut out = Vec::with_capacity(self.runs());
        self.lines(|base, (n, stride)| {
            out.extend((0..n as isize).map(|i| base + i * stride));
        });
        out
    }

    /// Calls `line(offset, (count, stride))` for each line of runs (the
    /// innermost outer axis), in C order.
    fn lines(&self, mut line: impl FnMut(isize, (usize, isize))) {
        let (last, rest) = self.outer.split_last().expect("at least one outer axis");
        let mut at = vec![0usize; rest.len()];
        loop {
            let base: isize = at.iter().zip(rest).map(|(&i, d)| i as isize * d.1).sum();
            line(base, *last);
            // The next line: an odometer over the other outer axes.
            let mut d = rest.len();
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                at[d] += 1;
                if at[d] < rest[d].0 {
                    break;
                }
                at[d] = 0;
            }
        }
    }

    /// Copies the array's bytes, back to back in C order at `src`, to
    /// their places from `dest`.
    ///
    /// # Safety
    /// `src` holds the array's bytes; the array at `dest` is writable and
    /// is the layout's.
    unsafe fn scatter(&self, src: *const u8, dest: usize) {
        let run = self.run;
        let mut from = src;
        self.lines(|base, (n, stride)| {
            let to = (dest as isize + base) as *mut u8;
            // SAFETY: `n` runs of `run` bytes at `from` (the source's next
            // ones) and at `to + i * stride` (the array's, by its layout).
            unsafe {
                match run {
                    1 => line::<u8>(from, to, n, stride),
                    2 => line::<u16>(from, to, n, stride),
                    4 => line::<u32>(from, to, n, stride),
                    8 => line::<u64>(from, to, n, stride),
                    16 => line::<u128>(from, to, n, stride),
                    _ => {
                        for i in 0..n as isize {
                            std::ptr::copy_nonoverlapping(
                                from.add(i as usize * run),
                                to.offset(i * stride),
                                run,
                            );
                        }
                    }
                }
                from = from.add(n * run);
            }
        });
    }
}

/// `n` items of `T` back to back at `from` to `to`, `stride` bytes apart.
///
/// # Safety
/// Both ranges are valid, as for [`Strided::scatter`].
unsafe fn line<T: Copy>(from: *const u8, to: *mut u8, n: usize, stride: isize) {
    let from = from as *const T;
    for i in 0..n {
        // SAFETY: the caller's.
        unsafe {
            let v = std::ptr::read_unaligned(from.add(i));
            std::ptr::write_unaligned(to.offset(i as isize * stride) as *mut T, v);
        }
    }
}

/// A target checked against the reply: its field's parts (rows in
/// order), and the bytes of a row.
pub(crate) type Checked<'f> = (&'f [PartLayout], u64);

/// Checks every target against its field of the reply (kind, dtype,
/// shape, bytes), before any byte is written: each one's field's parts.
pub(crate) fn check_targets<'f>(
    fields: &'f [(Arc<str>, FieldLayout)],
    targets: &[Target],
) -> Result<Vec<Checked<'f>>, Fail> {
    let mut out = Vec::with_capacity(targets.len());
    for t in targets {
        let Some((_, f)) = fields.iter().find(|(n, _)| **n == *t.name) else {
            return Err(Fail::Protocol(format!(
                "the reply has no field {:?}",
                t.name
            )));
        };
        // Worded as the Python client words them (names as Python's repr).
        let name = format!("'{}'", t.name);
        let what = format!("get_into: out[{name}]");
        let (dtype, shape, parts) = match f {
            FieldLayout::Regular {
                dtype,
                shape,
                parts,
            } => (dtype.name(), shape, parts),
            FieldLayout::Values(_) => {
                return Err(Fail::NotTensors(format!(
                    "{what}: field {name} holds plain values, not tensors; use get()"
                )));
            }
            FieldLayout::Nested { .. } => {
                return Err(Fail::Mismatch(format!(
                    "{what}: the requested rows of {name} have different shapes, so they do not fit one array; use get()"
                )));
            }
        };
        if !t.dtypes.iter().any(|d| d == dtype) {
            return Err(Fail::Mismatch(format!(
                "{what} has dtype {}, but field {name} is {dtype}",
                t.dtypes[0]
            )));
        }
        if **shape != *t.shape {
            return Err(Fail::Mismatch(format!(
                "{what} has shape {:?}, but field {name} is {shape:?}",
                t.shape
            )));
        }
        // The array holds exactly the field's bytes (the descriptor's parts
        // were checked against the dtype and rows when decoded).
        let total: u64 = parts.iter().map(|p| p.len).sum();
        if total != t.len as u64 {
            return Err(Fail::Mismatch(format!(
                "{what} holds {} bytes, but field {name} is {total}",
                t.len
            )));
        }
        out.push((parts.as_slice(), total.checked_div(shape[0]).unwrap_or(0)));
    }
    Ok(out)
}

/// Sends the get `frame0` and reads its reply's rows straight into
/// `targets`: None when they are in place, else the reply that is not a
/// get_ok (for the caller to decode).
pub(crate) fn get_into(
    s: &mut Stream,
    frame0: &[u8],
    targets: &[Target],
) -> Result<Option<Other>, Fail> {
    write_message(s, frame0, &[])?;
    reply_into(s, targets)
}

/// The reply half of [`get_into`]: its frame 0 read, and the rows of a
/// get_ok straight into `targets`; None, or any other reply (drained).
pub(crate) fn reply_into(s: &mut Stream, targets: &[Target]) -> Result<Option<Other>, Fail> {
    let (fields, more) = match read_head(s)? {
        Ok((_, fields, more, head)) => {
            if segments(&head)?.is_some() {
                return Err(Fail::Protocol(
                    "the reply carries shared-memory segments, but this client did not ask for \
                     same-node replies"
                        .into(),
                ));
            }
            (fields, more)
        }
        Err(other) => return Ok(Some(other)),
    };
    receive_into(s, &fields, more, targets)?;
    Ok(None)
}

/// Reads a get_ok's data frames (its frame 0 read: `fields`, `more`)
/// straight into `targets`, each checked first.
pub(crate) fn receive_into(
    s: &mut Stream,
    fields: &[(Arc<str>, FieldLayout)],
    more: bool,
    targets: &[Target],
) -> Result<(), Fail> {
    let checked = check_targets(fields, targets)?;
    let mut places = Places::new();
    // Strided arrays read through a scratch buffer: (buffer, layout, array).
    let mut scratch: Vec<(Vec<u8>, &Strided, usize)> = Vec::new();
    let vectored = if targets.iter().any(|t| t.strided.is_some()) {
        vectored_run()
    } else {
        VECTORED_RUN
    };
    for (t, &(parts, row_bytes)) in targets.iter().zip(&checked) {
        match &t.strided {
            None => place_rows(&mut places, parts, t.ptr, row_bytes),
            Some(l) if l.run >= vectored => {
                // Each run straight into place.
                let offsets = l.offsets();
                let per_row = offsets.len() as u64 / t.shape[0];
                let mut row = 0u64;
                for p in parts {
                    let first = (row * per_row) as usize;
                    let runs = &offsets[first..first + (p.rows * per_row) as usize];
                    for (k, &at) in runs.iter().enumerate() {
                        places.push(Place {
                            frame: p.frame,
                            offset: p.offset + (k * l.run) as u64,
                            len: l.run as u64,
                            dest: (t.ptr as isize + at) as usize,
                        });
                    }
                    row += p.rows;
                }
            }
            Some(l) => {
                // Into a scratch buffer, scattered once the reply is read.
                let buf = pool::take(t.len, |_| {});
                place_rows(&mut places, parts, buf.as_ptr() as usize, row_bytes);
                scratch.push((buf, l, t.ptr));
            }
        }
    }
    let read = read_frames(s, more, &mut places, fields);
    for (buf, l, dest) in scratch {
        if read.is_ok() {
            // SAFETY: `buf` holds the field's bytes, all read; `dest` is
            // the caller's array, of layout `l`, held for the call.
            unsafe { l.scatter(buf.as_ptr(), dest) };
        }
        pool::give(buf);
    }
    read
}

/// Copies each checked target's rows (`checked`, from [`check_targets`])
/// into it from memory: `src(frame, offset, len)` is where a part's bytes
/// lie (checked against the frames already).
pub(crate) fn copy_into<'a>(
    targets: &[Target],
    checked: &[Checked<'_>],
    src: impl Fn(u64, u64, u64) -> &'a [u8],
) {
    for (t, &(parts, row_bytes)) in targets.iter().zip(checked) {
        let mut scratch = t.strided.as_ref().map(|_| pool::take(t.len, |_| {}));
        let dest = scratch.as_mut().map_or(t.ptr, |b| b.as_mut_ptr() as usize);
        let mut row = 0u64;
        for p in parts {
            let bytes = src(p.frame, p.offset, p.len);
            // SAFETY: the parts' rows cover the destination (the array, or
            // a scratch buffer of its size) exactly once (checked by
            // `check_targets`), and the source lies in memory of this
            // call's.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    (dest + (row * row_bytes) as usize) as *mut u8,
                    bytes.len(),
                );
            }
            row += p.rows;
        }
        if let (Some(buf), Some(l)) = (scratch, &t.strided) {
            // SAFETY: `buf` holds the field's bytes in C order; `t.ptr` is
            // the caller's array, of layout `l`, held for the call.
            unsafe { l.scatter(buf.as_ptr(), t.ptr) };
            pool::give(buf);
        }
    }
}

/// The places of a field's `parts` (rows in order) in a C-contiguous
/// destination at `base`, `row_bytes` a row.
fn place_rows(places: &mut Places, parts: &[PartLayout], base: usize, row_bytes: u64) {
    let mut row = 0u64;
    for p in parts {
        places.push(Place {
            frame: p.frame,
            offset: p.offset,
            len: p.len,
            dest: base + (row * row_bytes) as usize,
        });
        row += p.rows;
    }
}
