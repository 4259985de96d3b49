//! `Connection.get_into`: a get whose reply goes straight into the
//! caller's arrays, every requested field checked against its array
//! (kind, dtype, shape, bytes) before any byte is written.

use stowage_wire::native::FieldLayout;

use crate::error::Fail;
use crate::message::write_message;
use crate::receive::{Head, Other, Place, Places, read_frames, read_head};
use crate::stream::Stream;

/// A caller's array, writable and C-contiguous: where a field's rows go.
pub(crate) struct Target {
    pub(crate) name: String,
    pub(crate) dtypes: Vec<String>,
    pub(crate) shape: Vec<u64>,
    pub(crate) ptr: usize,
    pub(crate) len: usize,
}

/// The dtypes of a regular field as its descriptor names them.
fn layout_dtype(f: &FieldLayout) -> Option<(&str, &[u64])> {
    match f {
        FieldLayout::Regular { dtype, shape, .. } => Some((dtype.name(), shape)),
        _ => None,
    }
}

/// Sends a get and reads its reply's frame 0: the get_ok's layout and
/// whether data frames follow, or (the rest drained) any other reply.
fn request(s: &mut Stream, frame0: &[u8]) -> Result<Result<Head, Other>, Fail> {
    write_message(s, frame0, &[])?;
    read_head(s)
}

pub(crate) fn get_into(
    s: &mut Stream,
    frame0: &[u8],
    targets: &[Target],
) -> Result<Option<Other>, Fail> {
    let (fields, more) = match request(s, frame0)? {
        Ok((fields, more, _)) => (fields, more),
        Err(other) => return Ok(Some(other)),
    };
    // Every requested field, regular, of an accepted dtype and the array's
    // shape, before any byte is written.
    let mut places = Places::new();
    for t in targets {
        let Some((_, f)) = fields.iter().find(|(n, _)| *n == t.name) else {
            return Err(Fail::Protocol(format!(
                "the reply has no field {:?}",
                t.name
            )));
        };
        // Worded as the Python client words them (names as Python's repr).
        let name = format!("'{}'", t.name);
        let what = format!("get_into: out[{name}]");
        let Some((dtype, shape)) = layout_dtype(f) else {
            return Err(match f {
                FieldLayout::Values(_) => Fail::NotTensors(format!(
                    "{what}: field {name} holds plain values, not tensors; use get()"
                )),
                _ => Fail::Mismatch(format!(
                    "{what}: the requested rows of {name} have different shapes, so they do not fit one array; use get()"
                )),
            });
        };
        if !t.dtypes.iter().any(|d| d == dtype) {
            return Err(Fail::Mismatch(format!(
                "{what} has dtype {}, but field {name} is {dtype}",
                t.dtypes[0]
            )));
        }
        if shape != t.shape.as_slice() {
            return Err(Fail::Mismatch(format!(
                "{what} has shape {:?}, but field {name} is {shape:?}",
                t.shape
            )));
        }
        let FieldLayout::Regular { parts, .. } = f else {
            unreachable!("a regular layout")
        };
        // The array holds exactly the field's bytes (the descriptor's parts
        // were checked against the dtype and rows when decoded).
        let total: u64 = parts.iter().map(|p| p.len).sum();
        if total != t.len as u64 {
            return Err(Fail::Mismatch(format!(
                "{what} holds {} bytes, but field {name} is {total}",
                t.len
            )));
        }
        let row_bytes = total.checked_div(shape[0]).unwrap_or(0);
        let mut row = 0u64;
        for p in parts {
            places.entry(p.frame).or_default().push(Place {
                offset: p.offset,
                len: p.len,
                dest: t.ptr + (row * row_bytes) as usize,
            });
            row += p.rows;
        }
    }
    read_frames(s, more, &places, &fields)?;
    Ok(None)
}
