//! `stowage/1` frame 0 for the Python client, written and read by stowd's
//! own codec ([`stowage_wire::native`]), so that the protocol has one
//! implementation (issue 17): the client, its tests and stowd's Python
//! tests all encode and decode envelopes and descriptors through here.
//!
//! Only frame 0 crosses: the client lays out its data frames itself (a
//! put's large rows go from the caller's arrays, small ones coalesced as it
//! chooses) and describes them as layouts ([`native::RequestHead`]); a
//! reply's descriptors come back checked in themselves
//! ([`native::decode_reply_layout`]: kinds, keys, shapes, lengths against
//! the dtype, row sums, the receiver limits), for the client to resolve
//! against the data frames (socket frames, or shared-memory segments).
//!
//! In Python terms (the names of `stowage/_codec.py`):
//!
//! | form | Python |
//! |---|---|
//! | regular descriptor | `("regular", dtype, shape, [(frame, offset, len, rows), ...])` |
//! | nested descriptor | `("nested", dtype, [(shape, frame, offset, len), ...])` |
//! | values descriptor | `("values", [value, ...])` |
//! | envelope | `{"proto", "op", "id", "body"}`, plus `segments`, `same_node`, `channel` when present |
//!
//! Values are the user's data, opaque to the protocol: a `str` or `bytes`
//! travels as msgpack str or bin; any other value as the msgpack that
//! `msgpack.packb` makes of it, and comes back through `msgpack.unpackb`.

use bytes::Bytes;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use stowage_wire::batch::Value;
use stowage_wire::indexes::{IndexRun, Indexes};
use stowage_wire::native::{
    self, Extras, FieldLayout, Op, PartLayout, Reply, ReplyLayout, RequestHead, RowLayout, Stat,
};
use stowage_wire::tensor::Dtype;

use crate::error::ProtocolViolation;

/// Frame 0 of a request: `op` with `body` as the client builds it (a put's
/// fields as descriptors of the data frames it sends), and the same-node
/// envelope keys `extras` holds (`segments`, `same_node`, `channel`). A get
/// whose `global_indexes` is a list goes as that list; as
/// `{"ranges": [[start, count, step], ...]}`, as ranges. ValueError or
/// TypeError for a body stowage/1 cannot carry (a bug of the caller: the
/// client checks the user's input first).
#[pyfunction]
#[pyo3(signature = (op, id, body, extras=None))]
pub fn encode_request<'py>(
    py: Python<'py>,
    op: &str,
    id: u64,
    body: &Bound<'py, PyDict>,
    extras: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut b = Body::new(body);
    let head = match op {
        "put" => RequestHead::Put {
            global_indexes: crate::indexes::index_vec(&b.take("global_indexes")?)?,
            fields: descriptors(&b.take("fields")?)?,
        },
        "get" => {
            let indexes = b.take("global_indexes")?;
            let fields = b.take("fields")?.extract()?;
            if let Ok(list) = indexes.cast::<crate::indexes::IndexList>() {
                RequestHead::Other(Op::Get {
                    global_indexes: list.get().indexes.clone(),
                    fields,
                })
            } else {
                match indexes.cast::<PyDict>() {
                    Ok(ranges) => {
                        let mut r = Body::new(ranges);
                        let runs = triples(&r.take("ranges")?)?
                            .into_iter()
                            .map(|[start, count, step]| {
                                Ok(IndexRun {
                                    start: start.extract()?,
                                    count: count.extract()?,
                                    step: step.extract()?,
                                })
                            })
                            .collect::<PyResult<_>>()?;
                        r.done("the ranges")?;
                        let global_indexes = Indexes::from_runs(runs, u64::MAX)
                            .map_err(|e| PyValueError::new_err(format!("global_indexes: {e}")))?;
                        RequestHead::Other(Op::Get {
                            global_indexes,
                            fields,
                        })
                    }
                    Err(_) => RequestHead::GetList {
                        global_indexes: indexes.extract()?,
                        fields,
                    },
                }
            }
        }
        "clear" => RequestHead::Other(Op::Clear {
            global_indexes: crate::indexes::index_vec(&b.take("global_indexes")?)?,
            fields: b.maybe("fields")?.map(|f| f.extract()).transpose()?,
        }),
        "stats" => RequestHead::Other(Op::Stats),
        "channel" => RequestHead::Other(Op::Channel),
        "lease" => RequestHead::Other(Op::Lease {
            bytes: b.take("bytes")?.extract()?,
        }),
        "checkpoint" => RequestHead::Other(Op::Checkpoint {
            dir: b.take("dir")?.extract()?,
            journal: b
                .maybe("journal")?
                .map(|j| j.extract())
                .transpose()?
                .unwrap_or(true),
        }),
        "restore" => RequestHead::Other(Op::Restore {
            dir: b.take("dir")?.extract()?,
        }),
        other => return Err(PyValueError::new_err(format!("unknown op {other:?}"))),
    };
    b.done(&format!("a {op} body"))?;
    let mut frame0 = native::encode_request_head(id, &head).map_err(unencodable)?;
    if let Some(extras) = extras {
        let mut e = Body::new(extras);
        let extras = Extras {
            segments: e
                .maybe("segments")?
                .map(|s| {
                    triples(&s)?
                        .into_iter()
                        .map(|[name, offset, len]| {
                            Ok((name.extract()?, offset.extract()?, len.extract()?))
                        })
                        .collect::<PyResult<Vec<_>>>()
                })
                .transpose()?,
            same_node: e.maybe("same_node")?.map(|v| v.extract()).transpose()? == Some(true),
            channel: e.maybe("channel")?.map(|c| c.extract()).transpose()?,
            ..Extras::default()
        };
        e.done("the extras")?;
        if extras != Extras::default() {
            frame0 = native::with_extras(&frame0, &extras).map_err(unencodable)?;
        }
    }
    Ok(PyBytes::new(py, &frame0))
}

/// A reply's frame 0 -> `{"proto", "op", "id", "body"}` (and the
/// same-node keys it has), decoded and checked by stowd's decoder with the
/// client's limits ([`crate::message::REPLY_LIMITS`]); a get_ok's body is `{"fields": {name: descriptor}}`
/// (see the module doc). ProtocolViolation, with the decoder's reason, for
/// anything stowage/1 calls invalid.
#[pyfunction]
pub fn decode_reply<'py>(py: Python<'py>, frame0: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let limits = crate::message::REPLY_LIMITS;
    let frame0 = Bytes::copy_from_slice(frame0);
    let (id, layout) = native::decode_reply_layout(&frame0, &limits).map_err(violation)?;
    let extras = native::decode_extras(&frame0, &limits).map_err(violation)?;
    let env = PyDict::new(py);
    env.set_item("proto", native::PROTO)?;
    let body = PyDict::new(py);
    let op = match layout {
        ReplyLayout::GetOk(fields) => {
            let descs = PyDict::new(py);
            for (name, field) in &fields {
                descs.set_item(&**name, descriptor(py, field)?)?;
            }
            body.set_item("fields", descs)?;
            "get_ok"
        }
        ReplyLayout::Other(reply) => {
            reply_body(&body, &reply)?;
            reply.name()
        }
    };
    env.set_item("op", op)?;
    env.set_item("id", id)?;
    env.set_item("body", body)?;
    if let Some(segments) = extras.segments {
        env.set_item("segments", segments_list(py, segments)?)?;
    }
    if extras.same_node {
        env.set_item("same_node", true)?;
    }
    if let Some(channel) = extras.channel {
        env.set_item("channel", channel)?;
    }
    Ok(env)
}

/// `segments` as the envelope has them: `[[name, offset, len], ...]`.
fn segments_list<'py>(
    py: Python<'py>,
    segments: Vec<(String, u64, u64)>,
) -> PyResult<Bound<'py, PyList>> {
    let items = segments
        .into_iter()
        .map(|(name, offset, len)| {
            PyList::new(
                py,
                [
                    name.into_pyobject(py)?.into_any(),
                    offset.into_pyobject(py)?.into_any(),
                    len.into_pyobject(py)?.into_any(),
                ],
            )
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

fn reply_body(body: &Bound<'_, PyDict>, reply: &Reply) -> PyResult<()> {
    match reply {
        Reply::PutOk { rows } => body.set_item("rows", rows),
        Reply::ClearOk { cleared } => body.set_item("cleared", cleared),
        Reply::StatsOk(stats) => {
            for (key, value) in stats {
                body.set_item(key, stat(body.py(), value)?)?;
            }
            Ok(())
        }
        Reply::LeaseOk {
            segment,
            bytes,
            ttl_ms,
        } => {
            body.set_item("segment", segment)?;
            body.set_item("bytes", bytes)?;
            body.set_item("ttl_ms", ttl_ms)
        }
        Reply::ChannelOk { path } => body.set_item("path", path),
        Reply::CheckpointOk {
            dir,
            seq,
            rows,
            bytes,
            files,
        } => {
            body.set_item("dir", dir)?;
            body.set_item("seq", seq)?;
            body.set_item("rows", rows)?;
            body.set_item("bytes", bytes)?;
            body.set_item("files", files)
        }
        Reply::RestoreOk {
            dir,
            seq,
            rows,
            lost,
        } => {
            body.set_item("dir", dir)?;
            body.set_item("seq", seq)?;
            body.set_item("rows", rows)?;
            body.set_item("lost", lost)
        }
        Reply::Error { code, message } => {
            body.set_item("code", code)?;
            body.set_item("message", message)
        }
        // A peer's reply (stowd to stowd); the Python client never asks.
        Reply::VersionsOk {
            incarnation,
            versions,
        } => {
            body.set_item("incarnation", incarnation)?;
            body.set_item("versions", versions)
        }
        Reply::GetOk { .. } => unreachable!("a get_ok comes as a layout"),
    }
}

fn stat<'py>(py: Python<'py>, value: &Stat) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Stat::Int(i) => i.into_pyobject(py)?.into_any(),
        Stat::Float(f) => f.into_pyobject(py)?.into_any(),
        Stat::Str(s) => s.into_pyobject(py)?.into_any(),
        Stat::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Stat::List(items) => PyList::new(
            py,
            items
                .iter()
                .map(|v| stat(py, v))
                .collect::<PyResult<Vec<_>>>()?,
        )?
        .into_any(),
        Stat::Map(entries) => {
            let d = PyDict::new(py);
            for (k, v) in entries {
                d.set_item(k, stat(py, v)?)?;
            }
            d.into_any()
        }
    })
}

/// A checked descriptor in its Python form (see the module doc).
fn descriptor<'py>(py: Python<'py>, field: &FieldLayout) -> PyResult<Bound<'py, PyTuple>> {
    match field {
        FieldLayout::Regular {
            dtype,
            shape,
            parts,
        } => {
            let parts = parts
                .iter()
                .map(|p| (p.frame, p.offset, p.len, p.rows))
                .collect::<Vec<_>>();
            ("regular", dtype.name(), PyTuple::new(py, shape)?, parts).into_pyobject(py)
        }
        FieldLayout::Nested { dtype, rows } => {
            let rows = rows
                .iter()
                .map(|r| Ok((PyTuple::new(py, &r.shape)?, r.frame, r.offset, r.len)))
                .collect::<PyResult<Vec<_>>>()?;
            ("nested", dtype.name(), rows).into_pyobject(py)
        }
        FieldLayout::Values(values) => {
            let values = values
                .iter()
                .map(|v| value(py, v))
                .collect::<PyResult<Vec<_>>>()?;
            ("values", values).into_pyobject(py)
        }
    }
}

pub(crate) fn value<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::Str(s) => PyString::new(py, s).into_any(),
        Value::Bytes(b) => PyBytes::new(py, b).into_any(),
        Value::Msgpack(raw) => msgpack(py, "unpackb")?
            .call1((PyBytes::new(py, raw),))
            .map_err(|e| ProtocolViolation::new_err(format!("a value: {e}")))?,
    })
}

/// `msgpack.<name>`, looked up once: the codec of opaque values.
fn msgpack<'py>(py: Python<'py>, name: &'static str) -> PyResult<Bound<'py, PyAny>> {
    static PACKB: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static UNPACKB: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let cell = if name == "packb" { &PACKB } else { &UNPACKB };
    cell.get_or_try_init(py, || {
        Ok::<_, PyErr>(py.import("msgpack")?.getattr(name)?.unbind())
    })
    .map(|f| f.bind(py).clone())
}

/// A put's `fields` as the client describes them -> layouts.
fn descriptors(fields: &Bound<'_, PyAny>) -> PyResult<Vec<(std::sync::Arc<str>, FieldLayout)>> {
    let fields = fields.cast::<PyDict>()?;
    let mut out = Vec::with_capacity(fields.len());
    for (name, d) in fields.iter() {
        let name: String = name.extract()?;
        let d = d.cast::<PyTuple>()?;
        let kind: String = d.get_item(0)?.extract()?;
        let bad = |what: &str| PyValueError::new_err(format!("field {name:?}: {what}"));
        let field = match (kind.as_str(), d.len()) {
            ("regular", 4) => FieldLayout::Regular {
                dtype: dtype(&d.get_item(1)?)?,
                shape: d.get_item(2)?.extract::<Vec<u64>>()?.into(),
                parts: d
                    .get_item(3)?
                    .extract::<Vec<(u64, u64, u64, u64)>>()?
                    .into_iter()
                    .map(|(frame, offset, len, rows)| PartLayout {
                        frame,
                        offset,
                        len,
                        rows,
                    })
                    .collect(),
            },
            ("nested", 3) => FieldLayout::Nested {
                dtype: dtype(&d.get_item(1)?)?,
                rows: d
                    .get_item(2)?
                    .extract::<Vec<(Vec<u64>, u64, u64, u64)>>()?
                    .into_iter()
                    .map(|(shape, frame, offset, len)| RowLayout {
                        shape,
                        frame,
                        offset,
                        len,
                    })
                    .collect(),
            },
            ("values", 2) => {
                let values = d.get_item(1)?;
                let values = values.cast::<PyList>()?;
                FieldLayout::Values(
                    values
                        .iter()
                        .map(|v| to_value(&v))
                        .collect::<PyResult<_>>()?,
                )
            }
            _ => return Err(bad(&format!("not a descriptor: {d}"))),
        };
        out.push((name.into(), field));
    }
    Ok(out)
}

fn dtype(name: &Bound<'_, PyAny>) -> PyResult<Dtype> {
    let name: &str = &name.extract::<String>()?;
    Dtype::from_name(name).ok_or_else(|| PyValueError::new_err(format!("unknown dtype {name:?}")))
}

/// A value of a values field: str and bytes as themselves, anything else
/// as its msgpack.
pub(crate) fn to_value(v: &Bound<'_, PyAny>) -> PyResult<Value> {
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(Value::Str(s.to_str()?.to_owned()));
    }
    if let Ok(b) = v.cast::<PyBytes>() {
        return Ok(Value::Bytes(Bytes::copy_from_slice(b.as_bytes())));
    }
    let packed = msgpack(v.py(), "packb")?.call1((v,))?;
    let packed = packed.cast::<PyBytes>()?;
    Ok(Value::Msgpack(Bytes::copy_from_slice(packed.as_bytes())))
}

/// A list of 3-item lists or tuples (a get's ranges, a put's segments).
fn triples<'py>(list: &Bound<'py, PyAny>) -> PyResult<Vec<[Bound<'py, PyAny>; 3]>> {
    list.try_iter()?
        .map(|item| {
            let item: Vec<Bound<'py, PyAny>> = item?.extract()?;
            <[_; 3]>::try_from(item)
                .map_err(|i| PyValueError::new_err(format!("{} items, expected 3", i.len())))
        })
        .collect()
}

/// A body dict read key by key; `done` refuses keys nobody took.
struct Body<'a, 'py> {
    dict: &'a Bound<'py, PyDict>,
    taken: usize,
}

impl<'a, 'py> Body<'a, 'py> {
    fn new(dict: &'a Bound<'py, PyDict>) -> Self {
        Body { dict, taken: 0 }
    }

    fn maybe(&mut self, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        let v = self.dict.get_item(key)?;
        self.taken += usize::from(v.is_some());
        Ok(v)
    }

    fn take(&mut self, key: &str) -> PyResult<Bound<'py, PyAny>> {
        self.maybe(key)?
            .ok_or_else(|| PyValueError::new_err(format!("the body has no key {key:?}")))
    }

    fn done(&self, what: &str) -> PyResult<()> {
        if self.dict.len() != self.taken {
            return Err(PyTypeError::new_err(format!(
                "{what} has keys stowage/1 does not define: {}",
                self.dict.keys()
            )));
        }
        Ok(())
    }
}

fn unencodable(e: native::Error) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn violation(e: native::Error) -> PyErr {
    ProtocolViolation::new_err(e.to_string())
}
