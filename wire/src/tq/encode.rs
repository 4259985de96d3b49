//! Encoding of storage-unit replies (unit side) and requests (client side).
//!
//! Frame 0 is written exactly as `msgspec` writes the Python unit's dict:
//! keys `request_type, sender_id, receiver_id, request_id, timestamp, body`
//! in that order, the timestamp as float64 (`cb`), ints and strings in their
//! shortest form. Data frames are the tensors' own `Bytes`, never copied;
//! a value stored inlined (arrays inside, see `framed`) is written with one
//! fresh frame per array, each a slice of the stored value.

use bytes::Bytes;

use super::framed;
use super::{Error, Metrics, Op, Reply, Request, Stamp, request_type_name};
use crate::batch::{Cell, Field, Value};
use crate::msgpack::Writer;
use crate::pickle;
use crate::tensor::Tensor;

/// Frame 0 under construction plus the data frames it references.
struct Out {
    w: Writer,
    frames: Vec<Bytes>,
}

impl Out {
    /// Writes the envelope up to and including the `body` key.
    fn new(request_type: &str, sender_id: &str, receiver_id: Option<&str>, stamp: &Stamp) -> Out {
        let mut w = Writer::new();
        w.map(6);
        w.str("request_type");
        w.str(request_type);
        w.str("sender_id");
        w.str(sender_id);
        w.str("receiver_id");
        match receiver_id {
            Some(r) => w.str(r),
            None => w.nil(),
        }
        w.str("request_id");
        w.str(&stamp.request_id);
        w.str("timestamp");
        w.f64(stamp.timestamp);
        w.str("body");
        Out {
            w,
            frames: Vec::new(),
        }
    }

    /// One ext 3 with its own frame: the tensor's bytes, zero copy when the
    /// tensor is contiguous (every stored row and nested row is).
    fn tensor(&mut self, t: &Tensor) {
        let index = self.frames.len() + 1;
        self.frames.push(t.contiguous_bytes());
        self.w.ext(
            3,
            &pickle::dumps_tensor_meta(t.dtype().name(), t.shape(), index),
        );
    }

    fn value(&mut self, v: &Value) {
        match v {
            Value::Str(s) => self.w.str(s),
            Value::Bytes(b) => self.w.bin(b),
            Value::Msgpack(b) => {
                // A value with arrays inside, stored inlined: each array
                // gets a fresh frame (a slice of the stored value).
                if framed::is_inlined(b)
                    && let Some(e) = framed::Expander::expand(b, self.frames.len() + 1)
                {
                    self.w.raw(&e.w.into_bytes());
                    self.frames.extend(e.frames);
                    return;
                }
                self.w.raw(b)
            }
        }
    }

    fn cell(&mut self, c: &Cell) {
        match c {
            Cell::Tensor(t) => self.tensor(t),
            Cell::Value(v) => self.value(v),
        }
    }

    fn uints(&mut self, xs: &[u64]) {
        self.w.array(xs.len());
        xs.iter().for_each(|&x| self.w.uint(x));
    }

    fn message(&mut self, message: &str) {
        self.w.map(1);
        self.w.str("message");
        self.w.str(message);
    }

    fn metrics(&mut self, m: &Metrics) {
        let w = &mut self.w;
        w.map(10 + m.extra.len());
        w.str("storage_unit_id");
        w.str(&m.storage_unit_id);
        w.str("capacity");
        match m.capacity {
            Some(c) => w.uint(c),
            None => w.nil(),
        }
        for (key, v) in [
            ("active_keys", m.active_keys),
            ("process_rss_bytes", m.process_rss_bytes),
            ("ssd_offload_enabled", u64::from(m.ssd_offload_enabled)),
            ("ssd_active_values", m.ssd_active_values),
            ("ssd_active_bytes", m.ssd_active_bytes),
            ("ssd_fallback_values_total", m.ssd_fallback_values_total),
            ("requests_arrived", m.requests_arrived),
        ] {
            w.str(key);
            w.uint(v);
        }
        w.str("arrivals_by_op");
        w.map(m.arrivals_by_op.len());
        for (op, n) in &m.arrivals_by_op {
            w.str(op);
            w.uint(*n);
        }
        for (key, raw) in &m.extra {
            w.str(key);
            w.raw(raw);
        }
    }

    /// A PUT field value: a contiguous regular tensor as ONE ext 3 `[n, ...]`
    /// over its own buffer (as the Python client sends it); a strided one as
    /// a list of per-row ext 3 (the unit stores rows either way, and this
    /// avoids the copy `.contiguous()` makes in Python); nested rows as a
    /// list of ext 3; plain values as they are.
    fn field(&mut self, f: &Field) -> Result<(), Error> {
        match f {
            Field::Regular(t) if t.is_contiguous() => self.tensor(t),
            Field::Regular(t) => {
                self.w.array(t.rows() as usize);
                for i in 0..t.rows() {
                    let row = t.row_tensor(i).map_err(|e| Error::Body {
                        op: Op::Put,
                        detail: e.to_string(),
                    })?;
                    self.tensor(&row);
                }
            }
            Field::Nested(ts) => {
                self.w.array(ts.len());
                ts.iter().for_each(|t| self.tensor(t));
            }
            Field::Values(vs) => {
                self.w.array(vs.len());
                vs.iter().for_each(|v| self.value(v));
            }
        }
        Ok(())
    }

    fn finish(self) -> Vec<Bytes> {
        let mut out = Vec::with_capacity(1 + self.frames.len());
        out.push(self.w.into_bytes());
        out.extend(self.frames);
        out
    }
}

/// Encodes a reply of unit `unit_id` with a fresh request id and the current
/// time (see [`Stamp::now`]).
pub fn encode_reply(unit_id: &str, reply: &Reply) -> Vec<Bytes> {
    encode_reply_stamped(unit_id, reply, &Stamp::now())
}

/// Encodes a reply with a given request id and timestamp. `receiver_id` is
/// nil, as in every reply of the real unit.
pub fn encode_reply_stamped(unit_id: &str, reply: &Reply, stamp: &Stamp) -> Vec<Bytes> {
    let mut out = Out::new(reply.request_type(), unit_id, None, stamp);
    match reply {
        Reply::PutData => out.w.map(0),
        Reply::GetData { fields } => {
            out.w.map(1);
            out.w.str("data");
            out.w.map(fields.len());
            for (name, cells) in fields {
                out.w.str(name);
                out.w.array(cells.len());
                cells.iter().for_each(|c| out.cell(c));
            }
        }
        Reply::ClearData { message } | Reply::Error { message, .. } => out.message(message),
        Reply::Metrics(m) => out.metrics(m),
        Reply::Checkpoint { error: None, .. } => {
            out.w.map(1);
            out.w.str("success");
            out.w.bool(true);
        }
        Reply::Checkpoint {
            error: Some(message),
            ..
        } => {
            out.w.map(2);
            out.w.str("success");
            out.w.bool(false);
            out.w.str("message");
            out.w.str(message);
        }
    }
    out.finish()
}

/// Encodes a request from client `sender_id` to unit `receiver_id` with a
/// fresh request id and the current time.
pub fn encode_request(
    sender_id: &str,
    receiver_id: Option<&str>,
    request: &Request,
) -> Result<Vec<Bytes>, Error> {
    encode_request_stamped(sender_id, receiver_id, request, &Stamp::now())
}

/// Encodes a request with a given request id and timestamp. Fails if a PUT
/// field's row count differs from the number of indexes, if a regular field
/// is 0-d, or if an `Other` type is unknown to TransferQueue.
pub fn encode_request_stamped(
    sender_id: &str,
    receiver_id: Option<&str>,
    request: &Request,
    stamp: &Stamp,
) -> Result<Vec<Bytes>, Error> {
    let kind = request.request_type();
    if request_type_name(kind).is_none() {
        return Err(Error::UnknownRequestType(kind.to_owned()));
    }
    let mut out = Out::new(kind, sender_id, receiver_id, stamp);
    match request {
        Request::Put {
            global_indexes,
            fields,
        } => {
            for (name, f) in fields {
                if matches!(f, Field::Regular(t) if t.shape().is_empty()) {
                    let detail = format!("field '{name}' is a 0-d tensor: it has no rows");
                    return Err(Error::Body {
                        op: Op::Put,
                        detail,
                    });
                }
                if f.rows() != global_indexes.len() as u64 {
                    return Err(Error::RowCount {
                        field: name.clone(),
                        rows: f.rows(),
                        indexes: global_indexes.len(),
                    });
                }
            }
            out.w.map(3);
            out.w.str("global_indexes");
            out.uints(global_indexes);
            out.w.str("data");
            out.w.map(fields.len());
            for (name, f) in fields {
                out.w.str(name);
                out.field(f)?;
            }
            out.w.str("data_parser");
            out.w.nil();
        }
        Request::Get {
            global_indexes,
            fields,
        } => {
            out.w.map(2);
            out.w.str("global_indexes");
            out.uints(global_indexes);
            out.w.str("fields");
            out.w.array(fields.len());
            fields.iter().for_each(|f| out.w.str(f));
        }
        Request::Clear { global_indexes } => {
            out.w.map(1);
            out.w.str("global_indexes");
            out.uints(global_indexes);
        }
        Request::SaveCheckpoint { path } | Request::LoadCheckpoint { path } => {
            out.w.map(1);
            out.w.str("path");
            out.w.str(path);
        }
        Request::GetMetrics | Request::Other(_) => out.w.map(0),
    }
    Ok(out.finish())
}
