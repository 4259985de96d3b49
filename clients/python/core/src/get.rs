//! `Connection.get` and `get_arrays`: a get whose reply goes into one
//! buffer per field (taken from the receive pool, [`crate::pool`]), handed
//! to Python as [`Buffer`]s, or as numpy arrays over them.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use stowage_wire::native::{self, FieldLayout};

use crate::buffer::Buffer;
use crate::error::Fail;
use crate::message::{REPLY_LIMITS, write_message};
use crate::pool::{self, huge_pages};
use crate::receive::{Place, Places, read_frames, read_head};
use crate::stream::Stream;

/// A reply read by [`get`]: frame 0, and the fields' buffers.
pub(crate) struct Gotten {
    head: Vec<u8>,
    /// Why this codec refused frame 0, if it did.
    problem: Option<String>,
    /// (field, its rows back to back) for each regular or nested field, in
    /// reply order; None for a reply that is not a get_ok.
    fields: Option<Vec<(String, Vec<u8>)>>,
    /// (dtype name, shape) of each field, in reply order, if every field
    /// is regular (its buffer then holds exactly that array's bytes).
    regular: Option<Vec<(&'static str, Vec<u64>)>>,
}

/// What `Connection.get` returns: (frame 0, [(field, Buffer)] or None,
/// why the codec refused frame 0 or None).
pub(crate) type GotTuple<'py> = (
    Bound<'py, PyBytes>,
    Option<Vec<(String, Bound<'py, Buffer>)>>,
    Option<String>,
);

impl Gotten {
    pub(crate) fn into_tuple(self, py: Python<'_>) -> PyResult<GotTuple<'_>> {
        let fields = match self.fields {
            None => None,
            Some(fields) => Some(
                fields
                    .into_iter()
                    .map(|(name, data)| Ok((name, Bound::new(py, Buffer { data })?)))
                    .collect::<PyResult<Vec<_>>>()?,
            ),
        };
        Ok((PyBytes::new(py, &self.head), fields, self.problem))
    }
}

/// `numpy.ndarray`.
fn ndarray_type(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    static NDARRAY: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    NDARRAY
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("numpy")?.getattr("ndarray")?.unbind())
        })
        .map(|t| t.bind(py).clone())
}

/// What `get_arrays` returns for a reply `get` read: for a get_ok whose
/// every field is regular, of a dtype `dtypes` (a dict of dtype name to
/// numpy dtype) has, a dict of field name to a read-only numpy array over
/// its received bytes, in reply order; else `Gotten::into_tuple`.
pub(crate) fn arrays<'py>(
    py: Python<'py>,
    got: Gotten,
    dtypes: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    // `regular` is only ever set beside the buffers of a get_ok.
    if let (Some(_), Some(regular)) = (&got.fields, &got.regular) {
        let mut made = Vec::with_capacity(regular.len());
        for (dtype, _) in regular {
            match dtypes.get_item(*dtype) {
                Ok(dt) => made.push(dt),
                Err(_) => break,
            }
        }
        if made.len() == regular.len() {
            // Each array made here (numpy.ndarray over the field's read-only
            // buffer: read-only itself), one call a field.
            let ndarray = ndarray_type(py)?;
            let out = pyo3::types::PyDict::new(py);
            let fields = got.fields.expect("checked above");
            for (((name, data), (_, shape)), dt) in fields.into_iter().zip(regular).zip(made) {
                let shape = PyTuple::new(py, shape)?;
                let array = if data.is_empty() {
                    // (an empty buffer is no buffer to numpy: a new empty array, read-only)
                    let a = ndarray.call1((shape, dt))?;
                    a.getattr("flags")?.setattr("writeable", false)?;
                    a
                } else {
                    ndarray.call1((shape, dt, Bound::new(py, Buffer { data })?))?
                };
                out.set_item(name, array)?;
            }
            return Ok(out.into_any());
        }
    }
    got.into_tuple(py)?.into_pyobject(py).map(|t| t.into_any())
}

pub(crate) fn get(s: &mut Stream, frame0: &[u8]) -> Result<Gotten, Fail> {
    write_message(s, frame0, &[])?;
    get_reply(s)
}

/// Reads a get's reply (see [`get`]).
pub(crate) fn get_reply(s: &mut Stream) -> Result<Gotten, Fail> {
    let (layouts, more, head) = match read_head(s)? {
        Ok(got) => got,
        Err((head, problem)) => {
            return Ok(Gotten {
                head,
                problem,
                fields: None,
                regular: None,
            });
        }
    };
    // Only for a plain reply: one that names shared-memory segments goes
    // to the caller's decoder, which refuses it (this client asked for none).
    // (A frame 0 without the bytes of the key `segments` has none: the
    // second decode, a pass over all of frame 0, only when it might.)
    let plain = !head.windows(9).any(|w| w == b"\xa8segments")
        || native::decode_extras(&head, &REPLY_LIMITS).is_ok_and(|e| e.segments.is_none());
    let regular = if plain {
        layouts
            .iter()
            .map(|(_, f)| match f {
                FieldLayout::Regular { dtype, shape, .. } => Some((dtype.name(), shape.clone())),
                _ => None,
            })
            .collect()
    } else {
        None
    };
    // One buffer per field; each range of the reply goes to its place in
    // its field's buffer, rows in row order.
    let mut buffers: Vec<(String, Vec<u8>)> = Vec::new();
    let mut places = Places::new();
    for (name, f) in &layouts {
        if matches!(f, FieldLayout::Values(_)) {
            continue;
        }
        let ranges = f.ranges();
        let total: u64 = ranges.iter().map(|r| r.2).sum();
        // A reused buffer, or one zeroed by calloc (fresh pages for a large
        // one); every byte is written here, by this reply (`pool` says why).
        let buf = pool::take(total as usize, huge_pages);
        let base = buf.as_ptr() as usize;
        let mut at = 0u64;
        for (frame, offset, len) in ranges {
            places.entry(frame).or_default().push(Place {
                offset,
                len,
                dest: base + at as usize,
            });
            at += len;
        }
        buffers.push((name.clone(), buf));
    }
    read_frames(s, more, &places, &layouts)?;
    Ok(Gotten {
        head: head.to_vec(),
        problem: None,
        fields: Some(buffers),
        regular,
    })
}
