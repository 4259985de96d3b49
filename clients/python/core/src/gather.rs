//! `_core.gather`: the parts of a regular field that lie in several
//! buffers, copied into one [`Buffer`].

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffer::{Buffer, Held};
use crate::pool::{self, huge_pages};

/// Copies the parts of a regular field that lie in several buffers into
/// one buffer of `total` bytes, in order: part k is bytes `at[k]..at[k] +
/// len[k]` of `bases[base[k]]` and goes right after part k - 1. The result
/// is a [`Buffer`] (read-only to Python) taken from the receive pool, so a
/// training loop that gets the same shape every step copies into pages
/// already resident, with the GIL released.
///
/// Why: a same-node get of rows scattered over the segments (32,768 random
/// 4 KiB rows of 4 units) was gathered by numpy, one `take` per segment
/// into a temporary and a masked assignment from it (two copies), into a
/// fresh array that numpy asks huge pages for: 196-291 ms, and 1.5 s when
/// the huge pages had to come from the host (docs/benchmarks.md, "Same-node
/// gathers").
///
/// ValueError if the parts do not fill `total` exactly or one lies outside
/// its buffer (nothing of a reused buffer shows through a result).
#[pyfunction]
pub(crate) fn gather<'py>(
    py: Python<'py>,
    total: u64,
    bases: Vec<Bound<'py, PyAny>>,
    base: PyBuffer<i64>,
    at: PyBuffer<i64>,
    len: PyBuffer<i64>,
) -> PyResult<Bound<'py, Buffer>> {
    let (base, at, len) = (base.to_vec(py)?, at.to_vec(py)?, len.to_vec(py)?);
    if base.len() != at.len() || at.len() != len.len() {
        return Err(PyValueError::new_err(format!(
            "gather: {} bases, {} offsets and {} lengths",
            base.len(),
            at.len(),
            len.len()
        )));
    }
    let held = bases
        .iter()
        .map(Held::get)
        .collect::<PyResult<Vec<Held>>>()?;
    let srcs: Vec<(usize, usize)> = held
        .iter()
        .map(|h| (h.bytes().as_ptr() as usize, h.bytes().len()))
        .collect();
    let mut sum = 0u64;
    for k in 0..base.len() {
        let (b, a, l) = (base[k], at[k], len[k]);
        let src = usize::try_from(b).ok().and_then(|b| srcs.get(b));
        let inside = match (src, u64::try_from(a), u64::try_from(l)) {
            (Some(&(_, n)), Ok(a), Ok(l)) => a.checked_add(l).is_some_and(|end| end <= n as u64),
            _ => false,
        };
        if !inside {
            return Err(PyValueError::new_err(format!(
                "gather: part {k} ({a}+{l} of buffer {b}) lies outside its buffer"
            )));
        }
        sum += l as u64;
    }
    if sum != total || usize::try_from(total).is_err() {
        return Err(PyValueError::new_err(format!(
            "gather: the parts hold {sum} bytes, not {total}"
        )));
    }
    let data = py.detach(|| {
        let mut out = pool::take(total as usize, huge_pages);
        let mut to = 0usize;
        for k in 0..base.len() {
            let (from, _) = srcs[base[k] as usize];
            let l = len[k] as usize;
            // SAFETY: the source range was checked to lie inside its
            // buffer, which `held` keeps alive and in place; the parts'
            // lengths sum to `out`'s length, so `to..to + l` is inside it.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (from + at[k] as usize) as *const u8,
                    out.as_mut_ptr().add(to),
                    l,
                );
            }
            to += l;
        }
        out
    });
    drop(held);
    Bound::new(py, Buffer { data })
}
