//! A get over the socket: each field's rows received into one buffer of
//! their size (taken from the receive pool, [`crate::pool`]), or a small
//! reply's fields into one buffer they share, rows back to back in row
//! order, then made into the field's result ([`crate::assemble`]).

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Arc;
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
    pub(crate) names: &'a [Arc<str>],
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
    fields: &[(Arc<str>, FieldLayout)],
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

/// Replies whose fields' rows come to at most this many bytes in all
/// receive them into one buffer the fields share: one allocation, and one
/// Python object under the arrays, for the lot rather than one a field: a
/// 32-field get of 4 rows took 68 µs of client CPU against 74 with a
/// buffer a field (`stowd` on the same CPU; 10 fields: 33 against 34).
const SHARED_MAX: u64 = 64 << 10;

/// Where each field starts in a shared buffer: a multiple of this, so
/// every field is aligned as a buffer of its own would be, and more.
const FIELD_ALIGN: u64 = 64;

/// Receives a get_ok's data frames (frame 0 read: `head`), each field's
/// rows back to back in row order into a buffer of its own, or, for a small
/// reply, at its place in a buffer all fields share ([`SHARED_MAX`]), and
/// makes the result.
pub(crate) fn receive(
    s: &mut Stream,
    head: Head,
    asked: &Asked<'_>,
    opts: &GetOptions,
) -> Result<Reply, Fail> {
    let (id, layouts, more, _) = head;
    check_answer(id, &layouts, asked)?;
    let received =
        || (layouts.iter().map(|(_, f)| f)).filter(|f| !matches!(f, FieldLayout::Values(_)));
    let aligned = |n: u64| n.saturating_add(FIELD_ALIGN - 1) / FIELD_ALIGN * FIELD_ALIGN;
    let shared = received().fold(0u64, |n, f| n.saturating_add(aligned(f.bytes())));
    // Each received field's (buffer, start in it). Buffers are reused or
    // zeroed by calloc (fresh pages for a large one); every byte a field
    // covers is written here, by this reply (`pool` says why).
    let mut buffers: Vec<Vec<u8>> = Vec::new();
    let mut starts: Vec<(usize, usize)> = Vec::with_capacity(layouts.len());
    if shared <= SHARED_MAX {
        buffers.push(pool::take(shared as usize, huge_pages));
        let mut at = 0u64;
        for f in received() {
            starts.push((0, at as usize));
            at += aligned(f.bytes());
        }
    } else {
        for f in received() {
            buffers.push(pool::take(f.bytes() as usize, huge_pages));
            starts.push((buffers.len() - 1, 0));
        }
    }
    let mut places = Places::new();
    places.reserve(starts.len());
    for (f, &(b, at)) in received().zip(&starts) {
        let base = buffers[b].as_ptr() as usize + at;
        let mut off = 0usize;
        for (frame, offset, len) in f.each_range() {
            places.push(Place {
                frame,
                offset,
                len,
                dest: base + off,
            });
            off += len as usize;
        }
    }
    read_frames(s, more, &mut places, &layouts)?;
    Ok(Reply::Got(Assembled::from_received(
        layouts, buffers, &starts, opts,
    )))
}
