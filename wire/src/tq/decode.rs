//! Decoding of storage-unit requests (unit side) and replies (client side).
//!
//! Decoding runs in two passes over frame 0, like the Python unit: first the
//! whole envelope is parsed and every ext 3/4/5 anywhere in it is checked
//! against the data frames (undecodable errors); then the body is read for
//! its operation (errors answered with that operation's reply type).

use std::collections::HashSet;

use bytes::Bytes;

use super::{
    Envelope, Error, ErrorReply, Limits, Message, Metrics, Op, PICKLE_FALLBACK_SENTINEL, Reply,
    Request, request_type_name,
};
use crate::batch::{Cell, Field, Value};
use crate::msgpack::{Item, MsgpackError, Reader, TQ_MAX_DEPTH, Writer};
use crate::pickle::{self, PValue};
use crate::tensor::{Dtype, Tensor, TensorError};

use super::framed;
use super::numpy::{self, NpDtype};

/// Most dimensions a tensor shape may have.
const MAX_RANK: usize = 64;

impl From<MsgpackError> for Error {
    fn from(e: MsgpackError) -> Self {
        match e {
            MsgpackError::Malformed { offset, reason } => Error::Msgpack { offset, reason },
            // Only the typed reads of stowage/1 give this; TransferQueue
            // decoding reads items.
            MsgpackError::WrongType { expected, .. } => Error::Msgpack {
                offset: 0,
                reason: expected,
            },
        }
    }
}

/// The frames of one message, which data frames the body referenced, and
/// which were copied into inlined values (at most once each, so that the
/// copies never exceed the message's size).
struct Ctx<'f> {
    frames: &'f [Bytes],
    used: Vec<bool>,
    copied: Vec<bool>,
}

/// An ext 5 array: numpy dtype string, its model, shape and frame.
struct NumpyArray {
    dtype: String,
    model: NpDtype,
    shape: Vec<u64>,
    frame: usize,
}

fn pickle_of(code: i8, offset: usize, data: &[u8]) -> Result<PValue, Error> {
    pickle::loads(data).map_err(|source| Error::Pickle {
        code,
        offset,
        source,
    })
}

fn shape_of(v: &PValue, code: i8, offset: usize) -> Result<Vec<u64>, Error> {
    let Some(dims) = v.as_seq() else {
        return Err(Error::BadExt {
            code,
            offset,
            reason: "shape is not a tuple",
        });
    };
    let ints: Vec<i128> = dims
        .iter()
        .map(|d| match d.as_int() {
            Some(v) => Ok(v),
            None => Err(Error::BadExt {
                code,
                offset,
                reason: "shape has a non-int dimension",
            }),
        })
        .collect::<Result<_, _>>()?;
    if ints.len() > MAX_RANK {
        return Err(Error::BadShape {
            shape: ints,
            reason: "too many dimensions",
        });
    }
    if ints.iter().any(|&d| d < 0) {
        return Err(Error::BadShape {
            shape: ints,
            reason: "negative dimension",
        });
    }
    if ints.iter().any(|&d| d > i128::from(i64::MAX)) {
        return Err(Error::BadShape {
            shape: ints,
            reason: "dimension too large",
        });
    }
    Ok(ints.iter().map(|&d| d as u64).collect())
}

/// Splits a `(dtype, shape, frame_index)` meta.
fn meta_of(v: &PValue, code: i8, offset: usize) -> Result<(&str, Vec<u64>, i128), Error> {
    let bad = |reason| Error::BadExt {
        code,
        offset,
        reason,
    };
    let [dtype, shape, index] = v
        .as_seq()
        .ok_or_else(|| bad("expected (dtype, shape, frame_index)"))?
    else {
        return Err(bad("expected (dtype, shape, frame_index)"));
    };
    let dtype = dtype.as_str().ok_or_else(|| bad("dtype is not a str"))?;
    let index = index
        .as_int()
        .ok_or_else(|| bad("frame_index is not an int"))?;
    Ok((dtype, shape_of(shape, code, offset)?, index))
}

impl<'f> Ctx<'f> {
    fn new(frames: &'f [Bytes]) -> Self {
        Ctx {
            frames,
            used: vec![false; frames.len().saturating_sub(1)],
            copied: vec![false; frames.len().saturating_sub(1)],
        }
    }

    /// Validates an absolute frame index and marks the frame as used.
    fn frame(&mut self, index: i128) -> Result<usize, Error> {
        let data_frames = self.used.len();
        match usize::try_from(index) {
            Ok(i) if (1..=data_frames).contains(&i) => {
                self.used[i - 1] = true;
                Ok(i)
            }
            _ => Err(Error::FrameIndex { index, data_frames }),
        }
    }

    /// A tensor over its frame (zero copy) from a `(dtype, shape, index)` meta.
    fn tensor(&mut self, v: &PValue, code: i8, offset: usize) -> Result<Tensor, Error> {
        let (name, shape, index) = meta_of(v, code, offset)?;
        let dtype = Dtype::from_name(name).ok_or_else(|| Error::UnknownDtype(name.to_owned()))?;
        let frame = self.frame(index)?;
        Tensor::contiguous(self.frames[frame].clone(), dtype, shape).map_err(|e| match e {
            TensorError::Overflow(s) => Error::BadShape {
                shape: s.iter().map(|&d| d.into()).collect(),
                reason: "overflows the addressable size",
            },
            source => Error::FrameLength { frame, source },
        })
    }

    /// Ext 3: one tensor.
    fn ext3(&mut self, data: &[u8], offset: usize) -> Result<Tensor, Error> {
        let v = pickle_of(3, offset, data)?;
        self.tensor(&v, 3, offset)
    }

    /// Ext 4: `{"layout": "jagged"|"strided", "tensors": [meta, ...]}`, one
    /// tensor per component (what iterating the nested tensor yields).
    fn ext4(&mut self, data: &[u8], offset: usize) -> Result<Vec<Tensor>, Error> {
        let v = pickle_of(4, offset, data)?;
        let bad = |reason| Error::BadExt {
            code: 4,
            offset,
            reason,
        };
        match v.get("layout").and_then(PValue::as_str) {
            Some("jagged" | "strided") => {}
            _ => return Err(bad("layout is not \"jagged\" or \"strided\"")),
        }
        let metas = v
            .get("tensors")
            .and_then(PValue::as_seq)
            .ok_or_else(|| bad("tensors is not a list"))?;
        metas.iter().map(|m| self.tensor(m, 4, offset)).collect()
    }

    /// Ext 5: `(numpy dtype str, shape, frame_index)`, the frame's length
    /// checked against the shape and the dtype's item size, as numpy's
    /// `reshape` checks it in the unit.
    fn ext5(&mut self, data: &[u8], offset: usize) -> Result<NumpyArray, Error> {
        let v = pickle_of(5, offset, data)?;
        let (dtype, shape, index) = meta_of(&v, 5, offset)?;
        let model = NpDtype::parse(dtype).ok_or_else(|| Error::UnknownDtype(dtype.to_owned()))?;
        let frame = self.frame(index)?;
        let items = shape
            .iter()
            .try_fold(1u128, |n, &d| n.checked_mul(u128::from(d)))
            .filter(|&n| n <= isize::MAX as u128)
            .ok_or_else(|| Error::BadShape {
                shape: shape.iter().map(|&d| d.into()).collect(),
                reason: "overflows the addressable size",
            })?;
        let actual = self.frames[frame].len();
        let expected = items * model.itemsize() as u128;
        if expected != actual as u128 {
            return Err(Error::NumpyLength {
                frame,
                dtype: dtype.to_owned(),
                shape,
                expected,
                actual,
            });
        }
        Ok(NumpyArray {
            dtype: dtype.to_owned(),
            model,
            shape,
            frame,
        })
    }

    /// Claims data frame `frame` for one copy into an inlined value.
    fn claim(&mut self, frame: usize, code: i8, offset: usize) -> Result<&'f Bytes, Error> {
        if std::mem::replace(&mut self.copied[frame - 1], true) {
            return Err(Error::BadExt {
                code,
                offset,
                reason: "a data frame referenced by two arrays inside values \
                         (stowd copies those once; TransferQueue's encoder never shares a frame)",
            });
        }
        Ok(&self.frames[frame])
    }

    /// The frame index of a tensor meta (already checked by [`Ctx::tensor`]).
    fn meta_frame(v: &PValue) -> usize {
        v.as_seq()
            .and_then(|m| m.get(2))
            .and_then(PValue::as_int)
            .and_then(|i| usize::try_from(i).ok())
            .unwrap_or(0)
    }

    /// One ext 3/4/5 of a value, into an inlined value's template.
    fn inline_ext(
        &mut self,
        b: &mut framed::Builder,
        code: i8,
        data: &[u8],
        offset: usize,
    ) -> Result<(), Error> {
        match code {
            3 => {
                let v = pickle_of(3, offset, data)?;
                let t = self.tensor(&v, 3, offset)?;
                let bytes = self.claim(Self::meta_frame(&v), 3, offset)?;
                b.array(
                    3,
                    &framed::Part {
                        dtype: t.dtype().name(),
                        shape: t.shape(),
                        data: bytes,
                    },
                );
            }
            4 => {
                let tensors = self.ext4(data, offset)?;
                let v = pickle_of(4, offset, data)?;
                let jagged = v.get("layout").and_then(PValue::as_str) == Some("jagged");
                let metas = v.get("tensors").and_then(PValue::as_seq).unwrap_or(&[]);
                let mut parts = Vec::with_capacity(tensors.len());
                for (t, m) in tensors.iter().zip(metas) {
                    let bytes = self.claim(Self::meta_frame(m), 4, offset)?;
                    parts.push(framed::Part {
                        dtype: t.dtype().name(),
                        shape: t.shape(),
                        data: bytes,
                    });
                }
                b.nested(jagged, &parts);
            }
            _ => {
                let a = self.ext5(data, offset)?;
                let bytes = self.claim(a.frame, 5, offset)?;
                b.array(
                    5,
                    &framed::Part {
                        dtype: &a.dtype,
                        shape: &a.shape,
                        data: bytes,
                    },
                );
            }
        }
        Ok(())
    }

    /// The value at `r` (which carries an ext 3/4/5 somewhere) as an
    /// inlined value: its msgpack with each array's bytes inside.
    fn inline(&mut self, r: &mut Reader<'_>, op: Op, field: &str) -> Result<Value, Error> {
        let mut b = framed::Builder::new(64);
        self.rewrite(r, &mut b, TQ_MAX_DEPTH)?;
        b.finish()
            .map(Value::Msgpack)
            .ok_or_else(|| Error::Unsupported {
                op,
                field: field.to_owned(),
                what: "a value whose arrays total 4 GiB or more".into(),
            })
    }

    fn rewrite(
        &mut self,
        r: &mut Reader<'_>,
        b: &mut framed::Builder,
        depth: usize,
    ) -> Result<(), Error> {
        if depth == 0 {
            return Err(r.malformed("nesting too deep").into());
        }
        let start = r.pos();
        match r.item()? {
            Item::Array(n) => {
                b.raw(&r.buf()[start..r.pos()]);
                for _ in 0..n {
                    self.rewrite(r, b, depth - 1)?;
                }
            }
            Item::Map(n) => {
                b.raw(&r.buf()[start..r.pos()]);
                for _ in 0..2 * n {
                    self.rewrite(r, b, depth - 1)?;
                }
            }
            Item::Ext {
                code: code @ 3..=5,
                data,
                start: at,
            } => self.inline_ext(b, code, data, at)?,
            _ => b.raw(&r.buf()[start..r.pos()]),
        }
        Ok(())
    }

    /// First-pass check of any ext value.
    fn check_ext(&mut self, code: i8, data: &[u8], offset: usize) -> Result<(), Error> {
        match code {
            // pickle, cloudpickle, msgpack timestamp: opaque, never unpickled.
            1 | 2 | -1 => Ok(()),
            3 => self.ext3(data, offset).map(drop),
            4 => self.ext4(data, offset).map(drop),
            5 => self.ext5(data, offset).map(drop),
            _ => Err(Error::UnknownExt { code, offset }),
        }
    }
}

fn envelope_str(r: &mut Reader<'_>, key: &str) -> Result<String, Error> {
    match r.item()? {
        Item::Str { s, .. } => Ok(s.to_owned()),
        _ => Err(Error::Envelope(format!("'{key}' is not a str"))),
    }
}

/// Pass 1: the envelope, the body's offset, and the frame checks.
fn open(frames: &[Bytes]) -> Result<(Envelope, usize, Ctx<'_>), Error> {
    let first = frames.first().ok_or(Error::NoFrames)?;
    if frames.len() >= 2 && first.as_ref() == PICKLE_FALLBACK_SENTINEL {
        return Err(Error::PickleFallback);
    }
    if first.is_empty() {
        return Err(Error::EmptyEnvelope(frames.len()));
    }
    let mut ctx = Ctx::new(frames);
    let mut r = Reader::bytes(first, 0);
    let Item::Map(n) = r.item()? else {
        return Err(Error::Envelope("frame 0 is not a map".into()));
    };
    let (mut request_type, mut sender_id, mut receiver_id, mut request_id, mut timestamp, mut body) =
        (None, None, None, None, None, None);
    for _ in 0..n {
        let Item::Str { s: key, .. } = r.item()? else {
            return Err(Error::Envelope("a key is not a str".into()));
        };
        let dup = match key {
            "request_type" => request_type.replace(envelope_str(&mut r, key)?).is_some(),
            "sender_id" => sender_id.replace(envelope_str(&mut r, key)?).is_some(),
            "request_id" => request_id.replace(envelope_str(&mut r, key)?).is_some(),
            "receiver_id" => {
                let v = match r.item()? {
                    Item::Nil => None,
                    Item::Str { s, .. } => Some(s.to_owned()),
                    _ => return Err(Error::Envelope("'receiver_id' is not a str or nil".into())),
                };
                receiver_id.replace(v).is_some()
            }
            "timestamp" => {
                let t = match r.item()? {
                    Item::Float(f) => f,
                    Item::UInt(u) => u as f64,
                    Item::Int(i) => i as f64,
                    _ => return Err(Error::Envelope("'timestamp' is not a number".into())),
                };
                timestamp.replace(t).is_some()
            }
            other => {
                let at = r.pos();
                r.visit(TQ_MAX_DEPTH, &mut |code, data, offset| {
                    ctx.check_ext(code, data, offset)
                })?;
                other == "body" && body.replace(at).is_some()
            }
        };
        if dup {
            return Err(Error::Envelope(format!("duplicate key '{key}'")));
        }
    }
    if !r.at_end() {
        return Err(Error::Msgpack {
            offset: r.pos(),
            reason: "trailing bytes after the envelope",
        });
    }
    let missing = |k: &str| Error::Envelope(format!("missing key '{k}'"));
    let envelope = Envelope {
        request_type: request_type.ok_or_else(|| missing("request_type"))?,
        sender_id: sender_id.ok_or_else(|| missing("sender_id"))?,
        receiver_id: receiver_id.ok_or_else(|| missing("receiver_id"))?,
        request_id: request_id.ok_or_else(|| missing("request_id"))?,
        timestamp: timestamp.ok_or_else(|| missing("timestamp"))?,
    };
    let body = body.ok_or_else(|| missing("body"))?;
    if request_type_name(&envelope.request_type).is_none() {
        return Err(Error::UnknownRequestType(envelope.request_type));
    }
    if let Some(i) = ctx.used.iter().position(|u| !u) {
        return Err(Error::UnusedFrame(i + 1));
    }
    Ok((envelope, body, ctx))
}

/// The body's str keys with the byte range of each value.
fn body_entries(buf: &Bytes, pos: usize, op: Op) -> Result<Vec<(&str, usize, usize)>, Error> {
    let mut r = Reader::bytes(buf, pos);
    let Item::Map(n) = r.item()? else {
        return Err(Error::Body {
            op,
            detail: "body is not a map".into(),
        });
    };
    let mut out: Vec<(&str, usize, usize)> = Vec::with_capacity(n.min(64));
    let mut seen: HashSet<&str> = HashSet::new();
    let skip = |r: &mut Reader<'_>| r.visit(TQ_MAX_DEPTH, &mut |_, _, _| Ok::<(), Error>(()));
    for _ in 0..n {
        let key_start = r.pos();
        let key = r.item()?;
        if !matches!(key, Item::Str { .. }) {
            // Not a str: skip the whole key (it may be a container).
            r.set_pos(key_start);
            skip(&mut r)?;
        }
        let start = r.pos();
        skip(&mut r)?;
        if let Item::Str { s, .. } = key {
            if !seen.insert(s) {
                return Err(Error::Body {
                    op,
                    detail: format!("duplicate key '{s}' in body"),
                });
            }
            out.push((s, start, r.pos()));
        }
    }
    Ok(out)
}

fn find(entries: &[(&str, usize, usize)], key: &str, op: Op) -> Result<usize, Error> {
    entries
        .iter()
        .find(|(k, _, _)| *k == key)
        .map(|(_, start, _)| *start)
        .ok_or_else(|| Error::Body {
            op,
            detail: format!("missing key '{key}' in body"),
        })
}

fn u64_list(buf: &Bytes, pos: usize, op: Op, key: &str) -> Result<Vec<u64>, Error> {
    let bad = || Error::Body {
        op,
        detail: format!("'{key}' must be a list of non-negative ints"),
    };
    let mut r = Reader::bytes(buf, pos);
    let Item::Array(n) = r.item()? else {
        return Err(bad());
    };
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        match r.item()? {
            Item::UInt(v) => out.push(v),
            _ => return Err(bad()),
        }
    }
    Ok(out)
}

fn str_list(buf: &Bytes, pos: usize, op: Op, key: &str) -> Result<Vec<String>, Error> {
    let bad = || Error::Body {
        op,
        detail: format!("'{key}' must be a list of str"),
    };
    let mut r = Reader::bytes(buf, pos);
    let Item::Array(n) = r.item()? else {
        return Err(bad());
    };
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        match r.item()? {
            Item::Str { s, .. } => out.push(s.to_owned()),
            _ => return Err(bad()),
        }
    }
    Ok(out)
}

/// One element of a per-row list.
enum Element<'a> {
    /// An ext 3 payload and its offset.
    Tensor(&'a [u8], usize),
    /// A plain value, or an inlined one (arrays inside: [`framed`]).
    Plain(Value),
}

/// Reads one element of a per-row list. A plain value is kept as a `Str` or
/// `Bytes` when writing it again gives the same bytes, else as its exact
/// msgpack; a value with an ext 3/4/5 inside (a numpy array, a tensor in a
/// list or dict, ...) is inlined ([`framed`]). With `tensors` false, a
/// top-level ext 3 is inlined too (a list mixing tensors with other values).
fn element<'a>(
    r: &mut Reader<'a>,
    ctx: &mut Ctx<'_>,
    tensors: bool,
    op: Op,
    field: &str,
) -> Result<Element<'a>, Error> {
    let start = r.pos();
    let head = r.item()?;
    if let Item::Ext {
        code: 3,
        data,
        start: at,
    } = head
        && tensors
    {
        return Ok(Element::Tensor(data, at));
    }
    r.set_pos(start);
    let mut framed = false;
    r.visit(TQ_MAX_DEPTH, &mut |code, _, _| {
        framed |= matches!(code, 3..=5);
        Ok::<(), Error>(())
    })?;
    if framed {
        r.set_pos(start);
        return ctx.inline(r, op, field).map(Element::Plain);
    }
    Ok(Element::Plain(match head {
        Item::Str { s, canonical: true } => Value::Str(s.to_owned()),
        Item::Bin {
            data,
            start: at,
            canonical: true,
        } => Value::Bytes(r.slice(at, at + data.len())),
        _ => Value::Msgpack(r.slice(start, r.pos())),
    }))
}

/// True if the `n` items at `r` are all ext 3 (one tensor per row); `r` is
/// left where it was.
fn all_tensors(r: &mut Reader<'_>, n: usize) -> Result<bool, Error> {
    let start = r.pos();
    let mut all = true;
    for _ in 0..n {
        let at = r.pos();
        all &= matches!(r.item()?, Item::Ext { code: 3, .. });
        r.set_pos(at);
        r.visit(TQ_MAX_DEPTH, &mut |_, _, _| Ok::<(), Error>(()))?;
    }
    r.set_pos(start);
    Ok(all)
}

/// A list of one value per row: all ext 3 is a nested field (rows are
/// zero-copy tensors); anything else is a field of values, where a value
/// with arrays inside (a tensor among `None`s, a numpy array, ...) is inlined.
fn row_list(
    r: &mut Reader<'_>,
    ctx: &mut Ctx<'_>,
    n: usize,
    op: Op,
    field: &str,
) -> Result<Field, Error> {
    let tensors = n > 0 && all_tensors(r, n)?;
    let (mut rows, mut values) = (Vec::new(), Vec::new());
    for _ in 0..n {
        match element(r, ctx, tensors, op, field)? {
            Element::Plain(v) => values.push(v),
            Element::Tensor(data, at) => rows.push(ctx.ext3(data, at)?),
        }
    }
    Ok(if tensors {
        Field::Nested(rows)
    } else {
        Field::Values(values)
    })
}

/// A TensorDict as TransferQueue's encoder writes it: `{"__tq_tensordict__":
/// true, "batch_size": [...], "data": {key: tensor or TensorDict}}`.
struct TensorDictNode {
    /// `batch_size[1..]`: what a row's TensorDict has.
    row_batch: Vec<u64>,
    /// Keys (their exact msgpack) and values, in order.
    entries: Vec<(Bytes, TdValue)>,
}

enum TdValue {
    /// A tensor `[n, ...]`.
    Tensor(Tensor),
    /// A nested TensorDict `[n, ...]`.
    Dict(TensorDictNode),
}

impl TensorDictNode {
    /// Leaves (tensors) in the tree.
    fn leaves(&self) -> usize {
        self.entries
            .iter()
            .map(|(_, v)| match v {
                TdValue::Tensor(_) => 1,
                TdValue::Dict(d) => d.leaves(),
            })
            .sum()
    }

    /// Row `i` as `SimpleStorageUnit` answers it: `td[i]` encoded again.
    fn write_row(&self, b: &mut framed::Builder, i: u64) -> Result<(), Error> {
        let mut w = Writer::new();
        w.map(3);
        w.str("__tq_tensordict__");
        w.bool(true);
        w.str("batch_size");
        w.array(self.row_batch.len());
        self.row_batch.iter().for_each(|&d| w.uint(d));
        w.str("data");
        w.map(self.entries.len());
        b.raw(&w.into_bytes());
        for (key, value) in &self.entries {
            b.raw(key);
            match value {
                TdValue::Tensor(t) => {
                    let row = t.row_tensor(i).map_err(|e| Error::Body {
                        op: Op::Put,
                        detail: e.to_string(),
                    })?;
                    b.array(
                        3,
                        &framed::Part {
                            dtype: row.dtype().name(),
                            shape: row.shape(),
                            data: &row.contiguous_bytes(),
                        },
                    );
                }
                TdValue::Dict(d) => d.write_row(b, i)?,
            }
        }
        Ok(())
    }
}

/// Reads a marked TensorDict map whose batch size starts with `n`.
fn tensordict_node(
    r: &mut Reader<'_>,
    ctx: &mut Ctx<'_>,
    field: &str,
    n: usize,
    depth: usize,
) -> Result<TensorDictNode, Error> {
    let unsupported = |what: &str| Error::Unsupported {
        op: Op::Put,
        field: field.to_owned(),
        what: format!(
            "a map as a field that is not a TensorDict of tensors as TransferQueue encodes one ({what})"
        ),
    };
    if depth == 0 {
        return Err(r.malformed("nesting too deep").into());
    }
    let Item::Map(m) = r.item()? else {
        return Err(unsupported("not a map"));
    };
    let (mut marked, mut batch, mut entries) = (false, None, None);
    for _ in 0..m {
        let Item::Str { s: key, .. } = r.item()? else {
            return Err(unsupported("a key is not a str"));
        };
        match key {
            "__tq_tensordict__" => marked = r.item()? == Item::Bool(true),
            "batch_size" => {
                let Item::Array(k) = r.item()? else {
                    return Err(unsupported("batch_size is not a list"));
                };
                let mut dims = Vec::with_capacity(k.min(MAX_RANK));
                for _ in 0..k {
                    match r.item()? {
                        Item::UInt(d) if dims.len() < MAX_RANK => dims.push(d),
                        _ => return Err(unsupported("batch_size is not a short list of ints")),
                    }
                }
                batch = Some(dims);
            }
            "data" => {
                let Item::Map(k) = r.item()? else {
                    return Err(unsupported("data is not a map"));
                };
                let mut out = Vec::with_capacity(k.min(1024));
                for _ in 0..k {
                    let at = r.pos();
                    let Item::Str { .. } = r.item()? else {
                        return Err(unsupported("a data key is not a str"));
                    };
                    let key = r.slice(at, r.pos());
                    let vstart = r.pos();
                    let value = match r.item()? {
                        Item::Ext {
                            code: 3,
                            data,
                            start,
                        } => {
                            let v = pickle_of(3, start, data)?;
                            let t = ctx.tensor(&v, 3, start)?;
                            ctx.claim(Ctx::meta_frame(&v), 3, start)?;
                            if t.shape().first() != Some(&(n as u64)) {
                                return Err(unsupported(
                                    "a tensor whose first dimension is not the batch size",
                                ));
                            }
                            TdValue::Tensor(t)
                        }
                        Item::Map(_) => {
                            r.set_pos(vstart);
                            TdValue::Dict(tensordict_node(r, ctx, field, n, depth - 1)?)
                        }
                        _ => {
                            return Err(unsupported(
                                "a value that is neither a tensor nor a TensorDict",
                            ));
                        }
                    };
                    out.push((key, value));
                }
                entries = Some(out);
            }
            _ => {
                return Err(unsupported(
                    "a key other than __tq_tensordict__, batch_size and data",
                ));
            }
        }
    }
    let (true, Some(batch), Some(entries)) = (marked, batch, entries) else {
        return Err(unsupported(
            "no __tq_tensordict__ marker, batch_size or data",
        ));
    };
    if batch.first() != Some(&(n as u64)) {
        return Err(Error::RowCount {
            field: field.to_owned(),
            rows: batch.first().copied().unwrap_or(0),
            indexes: n,
        });
    }
    Ok(TensorDictNode {
        row_batch: batch[1..].to_vec(),
        entries,
    })
}

/// A whole field sent as a TensorDict (a nested TensorDict of the batch):
/// one row per index, each the row's TensorDict as the unit encodes
/// `td[i]` (inlined: its tensors' row bytes are copied once).
fn tensordict_field(
    r: &mut Reader<'_>,
    ctx: &mut Ctx<'_>,
    field: &str,
    n: usize,
) -> Result<Field, Error> {
    let node = tensordict_node(r, ctx, field, n, TQ_MAX_DEPTH)?;
    // Rows x leaves is what the rows cost to write: bounded by the message
    // (zero-size leaves would otherwise make it quadratic).
    let message: usize = ctx.frames.iter().map(Bytes::len).sum();
    if (node.leaves().max(1) as u128) * (n as u128) > 4 * message as u128 + 4096 {
        return Err(Error::Unsupported {
            op: Op::Put,
            field: field.to_owned(),
            what: "a TensorDict whose rows x tensors is far over the message's size".into(),
        });
    }
    (0..n as u64)
        .map(|i| {
            let mut b = framed::Builder::new(64);
            node.write_row(&mut b, i)?;
            b.finish()
                .map(Value::Msgpack)
                .ok_or_else(|| Error::Unsupported {
                    op: Op::Put,
                    field: field.to_owned(),
                    what: "a TensorDict row of 4 GiB or more".into(),
                })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Field::Values)
}

/// A value from its msgpack: a canonical str or bin as such, else as is.
fn plain_value(m: Vec<u8>) -> Value {
    let m = Bytes::from(m);
    let mut r = Reader::bytes(&m, 0);
    match r.item() {
        Ok(Item::Str { s, canonical: true }) if r.at_end() => Value::Str(s.to_owned()),
        Ok(Item::Bin {
            start,
            canonical: true,
            ..
        }) if r.at_end() => Value::Bytes(m.slice(start..)),
        _ => Value::Msgpack(m),
    }
}

/// A whole field sent as one numpy array (ext 5): its rows as the unit's
/// iteration gives them. A 0-d array has no `len()`; the rows of a 1-d array
/// are numpy scalars, which TransferQueue's encoder pickles (ext 1), written
/// here as numpy would pickle them; the rows of an n-d array are (n-1)-d
/// arrays, inlined.
fn numpy_field(
    ctx: &mut Ctx<'_>,
    data: &[u8],
    offset: usize,
    field: &str,
    n: usize,
) -> Result<Field, Error> {
    let a = ctx.ext5(data, offset)?;
    let Some((&rows, row_shape)) = a.shape.split_first() else {
        let detail = format!("field '{field}' is a 0-d numpy array: len() of unsized object");
        return Err(Error::Body {
            op: Op::Put,
            detail,
        });
    };
    if rows != n as u64 {
        return Err(Error::RowCount {
            field: field.to_owned(),
            rows,
            indexes: n,
        });
    }
    let bytes = ctx.claim(a.frame, 5, offset)?;
    // ext5 checked the frame: rows x row_len bytes.
    let row_len = row_shape
        .iter()
        .fold(a.model.itemsize(), |n, &d| n * d as usize);
    let mut values = Vec::with_capacity(n);
    for i in 0..rows as usize {
        let item = &bytes[i * row_len..(i + 1) * row_len];
        let value = if row_shape.is_empty() {
            let pickled =
                numpy::scalar_pickle(a.model, item).ok_or_else(|| Error::Unsupported {
                    op: Op::Put,
                    field: field.to_owned(),
                    what: format!(
                        "a 1-d numpy array of dtype {:?} as a whole field (its rows are numpy \
                     scalars of a kind stowd does not pickle; send one array per row)",
                        a.dtype
                    ),
                })?;
            let mut w = Writer::new();
            w.ext(1, &pickled);
            Value::Msgpack(w.into_bytes())
        } else {
            let mut b = framed::Builder::new(item.len());
            b.array(
                5,
                &framed::Part {
                    dtype: &a.dtype,
                    shape: row_shape,
                    data: item,
                },
            );
            Value::Msgpack(b.finish().ok_or_else(|| Error::Unsupported {
                op: Op::Put,
                field: field.to_owned(),
                what: "a numpy row of 4 GiB or more".into(),
            })?)
        };
        values.push(value);
    }
    Ok(Field::Values(values))
}

/// One field of a PUT.
fn put_field(r: &mut Reader<'_>, ctx: &mut Ctx<'_>, field: &str, n: usize) -> Result<Field, Error> {
    let unsupported = |what: String| Error::Unsupported {
        op: Op::Put,
        field: field.to_owned(),
        what,
    };
    let count = |rows: u64| Error::RowCount {
        field: field.to_owned(),
        rows,
        indexes: n,
    };
    let start = r.pos();
    let value = match r.item()? {
        Item::Ext {
            code: 3,
            data,
            start,
        } => {
            let t = ctx.ext3(data, start)?;
            if t.shape().is_empty() {
                let detail = format!("field '{field}' is a 0-d tensor: len() of a 0-d tensor");
                return Err(Error::Body {
                    op: Op::Put,
                    detail,
                });
            }
            Field::Regular(t)
        }
        Item::Ext {
            code: 4,
            data,
            start,
        } => Field::Nested(ctx.ext4(data, start)?),
        Item::Ext {
            code: 5,
            data,
            start,
        } => numpy_field(ctx, data, start, field, n)?,
        Item::Ext { code: 1, data, .. } => match numpy::object_array_rows(data) {
            Ok(Some(rows)) if rows.len() != n => return Err(count(rows.len() as u64)),
            Ok(Some(rows)) => Field::Values(rows.into_iter().map(plain_value).collect()),
            Ok(None) => {
                return Err(unsupported(
                    "a pickled object (ext 1) as a whole field (stowd unpickles only 1-d numpy \
                     object arrays of str, int, float, bool, None and bytes)"
                        .into(),
                ));
            }
            Err(why) => return Err(unsupported(format!("{why}, as a whole field"))),
        },
        Item::Ext { code, .. } => {
            return Err(unsupported(format!("an ext {code} value as a whole field")));
        }
        Item::Array(m) if m != n => return Err(count(m as u64)),
        Item::Array(m) => row_list(r, ctx, m, Op::Put, field)?,
        Item::Map(_) => {
            r.set_pos(start);
            tensordict_field(r, ctx, field, n)?
        }
        _ => {
            return Err(unsupported(
                "a scalar where a list or a tensor was expected".into(),
            ));
        }
    };
    if value.rows() != n as u64 {
        return Err(count(value.rows()));
    }
    Ok(value)
}

fn put(buf: &Bytes, body: usize, ctx: &mut Ctx<'_>) -> Result<Request, Error> {
    let entries = body_entries(buf, body, Op::Put)?;
    let gi = find(&entries, "global_indexes", Op::Put)?;
    let data = find(&entries, "data", Op::Put)?;
    if let Ok(pos) = find(&entries, "data_parser", Op::Put)
        && Reader::bytes(buf, pos).item()? != Item::Nil
    {
        return Err(Error::DataParser);
    }
    let global_indexes = u64_list(buf, gi, Op::Put, "global_indexes")?;
    // Increasing indexes (the usual put) have no duplicate: one pass, no
    // hash set (which cost about 450 ns per index at 1,000,000 indexes).
    if !global_indexes.windows(2).all(|w| w[0] < w[1]) {
        let mut seen = HashSet::with_capacity(global_indexes.len());
        if let Some(&dup) = global_indexes.iter().find(|&&g| !seen.insert(g)) {
            return Err(Error::DuplicateIndex(dup));
        }
    }
    let mut r = Reader::bytes(buf, data);
    let Item::Map(n) = r.item()? else {
        return Err(Error::Body {
            op: Op::Put,
            detail: "'data' is not a map".into(),
        });
    };
    let mut fields: Vec<(String, Field)> = Vec::with_capacity(n);
    let mut names: HashSet<&str> = HashSet::with_capacity(n);
    for _ in 0..n {
        let Item::Str { s: name, .. } = r.item()? else {
            return Err(Error::Body {
                op: Op::Put,
                detail: "a field name is not a str".into(),
            });
        };
        if !names.insert(name) {
            return Err(Error::Body {
                op: Op::Put,
                detail: format!("duplicate field '{name}'"),
            });
        }
        let field = put_field(&mut r, ctx, name, global_indexes.len())?;
        fields.push((name.to_owned(), field));
    }
    Ok(Request::Put {
        global_indexes,
        fields,
    })
}

/// Checks the counts of a request's body against `limits` before anything
/// is decoded: one walk over frame 0 that reads `request_type`, then the
/// body's `global_indexes`, `data` (PUT) and `fields` (GET) headers, and
/// skips every other value without unpickling ext payloads. Anything
/// malformed is left to [`open`], which reports it.
fn check_limits(frame0: &Bytes, limits: &Limits) -> Result<(), Error> {
    if *limits == Limits::NONE {
        return Ok(());
    }
    let skip = |r: &mut Reader<'_>| {
        r.visit(TQ_MAX_DEPTH, &mut |_, _, _| Ok::<(), Error>(()))
            .is_ok()
    };
    let mut r = Reader::bytes(frame0, 0);
    let Ok(Item::Map(n)) = r.item() else {
        return Ok(());
    };
    let (mut op, mut body) = (None, None);
    for _ in 0..n {
        let Ok(Item::Str { s: key, .. }) = r.item() else {
            return Ok(());
        };
        let at = r.pos();
        if key == "request_type"
            && let Ok(Item::Str { s, .. }) = r.item()
        {
            op = match s {
                "PUT" => Some(Op::Put),
                "GET" => Some(Op::Get),
                "CLEAR_DATA" => Some(Op::Clear),
                _ => return Ok(()),
            };
        }
        if key == "body" {
            body = Some(at);
        }
        r.set_pos(at);
        if !skip(&mut r) {
            return Ok(());
        }
    }
    let (Some(op), Some(body)) = (op, body) else {
        return Ok(());
    };
    let mut r = Reader::bytes(frame0, body);
    let Ok(Item::Map(n)) = r.item() else {
        return Ok(());
    };
    let too_large = |what, setting, value: usize, limit| Error::TooLarge {
        op,
        what,
        setting,
        value: value as u64,
        limit,
    };
    for _ in 0..n {
        let Ok(Item::Str { s: key, .. }) = r.item() else {
            return Ok(());
        };
        let at = r.pos();
        match (key, r.item()) {
            ("global_indexes", Ok(Item::Array(m))) if m as u64 > limits.max_rows => {
                return Err(too_large("global_indexes", "max_rows", m, limits.max_rows));
            }
            ("data", Ok(Item::Map(m))) if op == Op::Put && m as u64 > limits.max_fields => {
                return Err(too_large(
                    "fields in 'data'",
                    "max_fields",
                    m,
                    limits.max_fields,
                ));
            }
            ("fields", Ok(Item::Array(m))) if op == Op::Get && m as u64 > limits.max_fields => {
                return Err(too_large("'fields'", "max_fields", m, limits.max_fields));
            }
            _ => {}
        }
        r.set_pos(at);
        if !skip(&mut r) {
            return Ok(());
        }
    }
    Ok(())
}

/// Decodes a request arriving at a storage unit: `frames[0]` is the envelope
/// (the ZMQ identity already removed), `frames[1..]` the data frames.
pub fn decode_message(frames: &[Bytes]) -> Result<Message, Error> {
    decode_message_with(frames, &Limits::NONE)
}

/// [`decode_message`] with receiver limits: a PUT, GET or CLEAR_DATA whose
/// global indexes or fields are over `limits` is refused
/// ([`Error::TooLarge`]) after one walk over frame 0's msgpack, before any
/// ext payload is unpickled or any entry decoded.
pub fn decode_message_with(frames: &[Bytes], limits: &Limits) -> Result<Message, Error> {
    if let Some(first) = frames.first() {
        check_limits(first, limits)?;
    }
    let (envelope, body, mut ctx) = open(frames)?;
    let buf = &frames[0];
    let request = match envelope.request_type.as_str() {
        "PUT" => put(buf, body, &mut ctx)?,
        "GET" => {
            let entries = body_entries(buf, body, Op::Get)?;
            let fields = str_list(buf, find(&entries, "fields", Op::Get)?, Op::Get, "fields")?;
            let gi = find(&entries, "global_indexes", Op::Get)?;
            Request::Get {
                global_indexes: u64_list(buf, gi, Op::Get, "global_indexes")?,
                fields,
            }
        }
        "CLEAR_DATA" => {
            let entries = body_entries(buf, body, Op::Clear)?;
            let gi = find(&entries, "global_indexes", Op::Clear)?;
            Request::Clear {
                global_indexes: u64_list(buf, gi, Op::Clear, "global_indexes")?,
            }
        }
        "GET_METRICS" => Request::GetMetrics,
        t @ ("SAVE_STORAGE_CHECKPOINT" | "LOAD_STORAGE_CHECKPOINT") => {
            let entries = body_entries(buf, body, Op::Checkpoint)?;
            let pos = find(&entries, "path", Op::Checkpoint)?;
            let path = match Reader::bytes(buf, pos).item()? {
                Item::Str { s, .. } => s.to_owned(),
                _ => {
                    return Err(Error::Body {
                        op: Op::Checkpoint,
                        detail: "'path' is not a str".into(),
                    });
                }
            };
            if t == "SAVE_STORAGE_CHECKPOINT" {
                Request::SaveCheckpoint { path }
            } else {
                Request::LoadCheckpoint { path }
            }
        }
        other => Request::Other(other.to_owned()),
    };
    Ok(Message { envelope, request })
}

/// The wire request type in envelope `frame0`, read without the body and
/// the data frames (to answer a request that was too large to keep).
pub fn request_type(frame0: &Bytes) -> Result<String, Error> {
    let mut r = Reader::bytes(frame0, 0);
    let Item::Map(n) = r.item()? else {
        return Err(Error::Envelope("frame 0 is not a map".into()));
    };
    for _ in 0..n {
        let Item::Str { s: key, .. } = r.item()? else {
            return Err(Error::Envelope("a key is not a str".into()));
        };
        if key == "request_type" {
            return envelope_str(&mut r, key);
        }
        // The data frames are not here: do not follow ext references.
        r.visit(TQ_MAX_DEPTH, &mut |_, _, _| Ok::<(), Error>(()))?;
    }
    Err(Error::Envelope("missing key 'request_type'".into()))
}

/// [`decode_message`] without the envelope.
pub fn decode_request(frames: &[Bytes]) -> Result<Request, Error> {
    decode_message(frames).map(|m| m.request)
}

fn reply_err(detail: impl Into<String>) -> Error {
    Error::Body {
        op: Op::Reply,
        detail: detail.into(),
    }
}

fn reply_message(
    buf: &Bytes,
    entries: &[(&str, usize, usize)],
    default: &str,
) -> Result<String, Error> {
    match find(entries, "message", Op::Reply) {
        Err(_) => Ok(default.to_owned()),
        Ok(pos) => match Reader::bytes(buf, pos).item()? {
            Item::Str { s, .. } => Ok(s.to_owned()),
            _ => Err(reply_err("'message' is not a str")),
        },
    }
}

fn get_data(buf: &Bytes, body: usize, ctx: &mut Ctx<'_>) -> Result<Reply, Error> {
    let entries = body_entries(buf, body, Op::Reply)?;
    let mut r = Reader::bytes(buf, find(&entries, "data", Op::Reply)?);
    let Item::Map(n) = r.item()? else {
        return Err(reply_err("'data' is not a map"));
    };
    let mut fields = Vec::with_capacity(n);
    for _ in 0..n {
        let Item::Str { s: name, .. } = r.item()? else {
            return Err(reply_err("a field name is not a str"));
        };
        let Item::Array(m) = r.item()? else {
            return Err(reply_err(format!("field '{name}' is not a list")));
        };
        let mut cells = Vec::with_capacity(m);
        for _ in 0..m {
            cells.push(match element(&mut r, ctx, true, Op::Reply, name)? {
                Element::Plain(v) => Cell::Value(v),
                Element::Tensor(data, at) => Cell::Tensor(ctx.ext3(data, at)?),
            });
        }
        fields.push((name.to_owned(), cells));
    }
    Ok(Reply::GetData { fields })
}

fn metrics(buf: &Bytes, body: usize) -> Result<Metrics, Error> {
    let mut m = Metrics::default();
    for (key, start, end) in body_entries(buf, body, Op::Reply)? {
        let mut r = Reader::bytes(buf, start);
        let item = r.item()?;
        let uint = |item: &Item<'_>| match item {
            Item::UInt(v) => Ok(*v),
            Item::Bool(b) => Ok(u64::from(*b)),
            _ => Err(reply_err(format!(
                "metrics '{key}' is not a non-negative int"
            ))),
        };
        match key {
            "storage_unit_id" => match item {
                Item::Str { s, .. } => m.storage_unit_id = s.to_owned(),
                _ => return Err(reply_err("metrics 'storage_unit_id' is not a str")),
            },
            "capacity" => {
                m.capacity = if item == Item::Nil {
                    None
                } else {
                    Some(uint(&item)?)
                }
            }
            "active_keys" => m.active_keys = uint(&item)?,
            "process_rss_bytes" => m.process_rss_bytes = uint(&item)?,
            "ssd_offload_enabled" => m.ssd_offload_enabled = uint(&item)? != 0,
            "ssd_active_values" => m.ssd_active_values = uint(&item)?,
            "ssd_active_bytes" => m.ssd_active_bytes = uint(&item)?,
            "ssd_fallback_values_total" => m.ssd_fallback_values_total = uint(&item)?,
            "requests_arrived" => m.requests_arrived = uint(&item)?,
            "arrivals_by_op" => {
                let Item::Map(n) = item else {
                    return Err(reply_err("'arrivals_by_op' is not a map"));
                };
                for _ in 0..n {
                    let Item::Str { s: op, .. } = r.item()? else {
                        return Err(reply_err("op name is not a str"));
                    };
                    let count = uint(&r.item()?)?;
                    m.arrivals_by_op.push((op.to_owned(), count));
                }
            }
            other => {
                // Kept as exact msgpack and written back as is, so it must
                // not point into this message's data frames.
                let mut framed = false;
                Reader::bytes(buf, start).visit(TQ_MAX_DEPTH, &mut |code, _, _| {
                    framed |= matches!(code, 3..=5);
                    Ok::<(), Error>(())
                })?;
                if framed {
                    return Err(reply_err(format!(
                        "metrics '{other}' carries a tensor or numpy array (ext 3/4/5)"
                    )));
                }
                m.extra.push((other.to_owned(), buf.slice(start..end)))
            }
        }
    }
    Ok(m)
}

/// Decodes a storage unit's reply (client side, e.g. the router talking to
/// remote units). Tensor cells of `GET_DATA_RESPONSE` are zero-copy views of
/// the received frames.
pub fn decode_reply(frames: &[Bytes]) -> Result<(Envelope, Reply), Error> {
    let (envelope, body, mut ctx) = open(frames)?;
    let buf = &frames[0];
    let reply = match envelope.request_type.as_str() {
        "PUT_DATA_RESPONSE" => Reply::PutData,
        "GET_DATA_RESPONSE" => get_data(buf, body, &mut ctx)?,
        "CLEAR_DATA_RESPONSE" => {
            let entries = body_entries(buf, body, Op::Reply)?;
            Reply::ClearData {
                message: reply_message(buf, &entries, "")?,
            }
        }
        "METRICS_RESPONSE" => Reply::Metrics(metrics(buf, body)?),
        t @ ("SAVE_STORAGE_CHECKPOINT_RESPONSE" | "LOAD_STORAGE_CHECKPOINT_RESPONSE") => {
            let entries = body_entries(buf, body, Op::Reply)?;
            let success = match Reader::bytes(buf, find(&entries, "success", Op::Reply)?).item()? {
                Item::Bool(b) => b,
                _ => return Err(reply_err("'success' is not a bool")),
            };
            Reply::Checkpoint {
                load: t.starts_with("LOAD"),
                error: (!success)
                    .then(|| reply_message(buf, &entries, "Unknown error"))
                    .transpose()?,
            }
        }
        other => match ErrorReply::from_wire(other) {
            Some(kind) => {
                let entries = body_entries(buf, body, Op::Reply)?;
                Reply::Error {
                    kind,
                    message: reply_message(buf, &entries, "Unknown error")?,
                }
            }
            None => return Err(reply_err(format!("{other} is not a storage-unit reply"))),
        },
    };
    Ok((envelope, reply))
}
