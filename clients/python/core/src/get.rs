//! A get over the socket: each field's rows received into one buffer of
//! their size (taken from the receive pool, [`crate::pool`]), rows back to
//! back in row order, then made into the field's result
//! ([`crate::assemble`]).

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use stowage_wire::native::FieldLayout;

use crate::assemble::{Assembled, GetOptions, check_request};
use crate::error::Fail;
use crate::message::write_message;
use crate::pool::{self, huge_pages};
use crate::receive::{Head, Place, Places, read_frames, read_head, segments};
use crate::stream::Stream;

/// A get's reply: a get_ok's result, or any other reply (frame 0, and why
/// this codec refused it, if it did), for the caller to decode.
pub(crate) enum Reply {
    Got(Assembled),
    Other(Vec<u8>, Option<String>),
}

impl Reply {
    /// What the Python client reads: `(dict of results, glue list)` for a
    /// get_ok (see [`Assembled::into_py`]), else `(frame 0, why the codec
    /// refused it or None)`.
    pub(crate) fn into_py<'py>(
        self,
        py: Python<'py>,
        opts: &GetOptions,
    ) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Reply::Got(a) => a.into_py(py, opts)?.into_pyobject(py).map(|t| t.into_any()),
            Reply::Other(head, problem) => (PyBytes::new(py, &head), problem)
                .into_pyobject(py)
                .map(|t| t.into_any()),
        }
    }
}

/// What a get asked: its request id, the fields, how many rows.
pub(crate) struct Asked<'a> {
    pub(crate) id: u64,
    pub(crate) names: &'a [String],
    pub(crate) rows: u64,
}

/// Sends the get `frame0` and reads its reply (see [`get_reply`]).
pub(crate) fn get(
    s: &mut Stream,
    frame0: &[u8],
    asked: &Asked<'_>,
    opts: &GetOptions,
) -> Result<Reply, Fail> {
    write_message(s, frame0, &[])?;
    get_reply(s, asked, opts)
}

/// Reads a get's reply.
pub(crate) fn get_reply(
    s: &mut Stream,
    asked: &Asked<'_>,
    opts: &GetOptions,
) -> Result<Reply, Fail> {
    match read_head(s)? {
        Ok(head) => {
            if segments(&head.3)?.is_some() {
                return Err(Fail::Protocol(
                    "the reply carries shared-memory segments, but this client did not ask for \
                     same-node replies"
                        .into(),
                ));
            }
            receive(s, head, asked, opts)
        }
        Err((head, problem)) => Ok(Reply::Other(head, problem)),
    }
}

/// Checks a get_ok against the request (its id, fields and rows).
pub(crate) fn check_answer(
    id: u64,
    fields: &[(String, FieldLayout)],
    asked: &Asked<'_>,
) -> Result<(), Fail> {
    if id != asked.id {
        return Err(Fail::Protocol(format!(
            "a get_ok for request {id}, not {}",
            asked.id
        )));
    }
    check_request(fields, asked.names, asked.rows)
}

/// Receives a get_ok's data frames (frame 0 read: `head`), each field's
/// rows into a buffer of its own, and makes the result.
pub(crate) fn receive(
    s: &mut Stream,
    head: Head,
    asked: &Asked<'_>,
    opts: &GetOptions,
) -> Result<Reply, Fail> {
    let (id, layouts, more, _) = head;
    check_answer(id, &layouts, asked)?;
    // One buffer per field; each range of the reply goes to its place in
    // its field's buffer, rows in row order.
    let mut buffers: Vec<Vec<u8>> = Vec::new();
    let mut places = Places::new();
    for (_, f) in &layouts {
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
        buffers.push(buf);
    }
    read_frames(s, more, &places, &layouts)?;
    Ok(Reply::Got(Assembled::from_received(layouts, buffers, opts)))
}
