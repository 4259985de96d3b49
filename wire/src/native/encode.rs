//! Encoding: frame placement (a [`FrameLayout`] carried out over the
//! fields' buffers) and the msgpack envelope that describes it.

use bytes::{Bytes, BytesMut};

use super::layout::{FieldLayout, RequestHead, canonical};
use super::{
    Error, Extras, FrameLayout, GetIndexes, Indexes, Op, PROTO, Reply, Request, Stat, WireField,
};
use crate::batch::Value;
use crate::msgpack::{NATIVE_MAX_DEPTH as MAX_DEPTH, Reader, Writer};
use crate::tensor::Dtype;

pub(super) fn request(req: &Request, layout: Option<&FrameLayout>) -> Result<Vec<Bytes>, Error> {
    op_frames(req.id, &req.op, layout)
}

/// A request whose frames of several ranges are gathered, not copied.
pub(super) fn request_gathered(
    req: &Request,
    layout: Option<&FrameLayout>,
) -> Result<super::Gathered, Error> {
    op_placed(req.id, &req.op, layout, true)
}

fn op_frames(id: u64, op: &Op, layout: Option<&FrameLayout>) -> Result<Vec<Bytes>, Error> {
    Ok(op_placed(id, op, layout, false)?.parts)
}

fn op_placed(
    id: u64,
    op: &Op,
    layout: Option<&FrameLayout>,
    gather: bool,
) -> Result<super::Gathered, Error> {
    let mut w = envelope(op.name(), id);
    let no_fields: &[(std::sync::Arc<str>, WireField)] = &[];
    let placed = place(
        if let Op::Put { fields, .. } = op {
            fields
        } else {
            no_fields
        },
        layout,
        None,
        None,
        gather,
    )?;
    match op {
        Op::Put {
            global_indexes,
            fields,
        } => {
            w.map(2);
            w.str("global_indexes");
            uints(&mut w, global_indexes);
            w.str("fields");
            field_map(&mut w, fields, &placed.locs)?;
        }
        Op::Get {
            global_indexes,
            fields,
        }
        | Op::Versions {
            global_indexes,
            fields,
        } => {
            w.map(2);
            w.str("global_indexes");
            get_indexes(&mut w, global_indexes);
            w.str("fields");
            strs(&mut w, fields);
        }
        Op::Clear {
            global_indexes,
            fields,
        } => {
            w.map(1 + usize::from(fields.is_some()));
            w.str("global_indexes");
            uints(&mut w, global_indexes);
            if let Some(fields) = fields {
                w.str("fields");
                strs(&mut w, fields);
            }
        }
        Op::Stats | Op::Channel => w.map(0),
        Op::Lease { bytes } => {
            w.map(1);
            w.kv_uint("bytes", *bytes);
        }
        Op::Checkpoint { dir, journal } => {
            // `journal` only when false: the default body stays `{"dir": ...}`.
            w.map(if *journal { 1 } else { 2 });
            w.kv_str("dir", dir);
            if !*journal {
                w.str("journal");
                w.bool(false);
            }
        }
        Op::Restore { dir } => {
            w.map(1);
            w.kv_str("dir", dir);
        }
    }
    finish_gathered(w, placed)
}

pub(super) fn reply(
    id: u64,
    reply: &Reply,
    layout: Option<&FrameLayout>,
    span: Option<SpanFn<'_>>,
    enclose: Option<EncloseFn<'_>>,
) -> Result<Vec<Bytes>, Error> {
    Ok(reply_placed(id, reply, layout, span, enclose, false)?.parts)
}

/// A reply whose frames of several ranges are gathered, not copied.
pub(super) fn reply_gathered(
    id: u64,
    reply: &Reply,
    layout: Option<&FrameLayout>,
    span: Option<SpanFn<'_>>,
) -> Result<super::Gathered, Error> {
    reply_placed(id, reply, layout, span, None, true)
}

fn reply_placed(
    id: u64,
    reply: &Reply,
    layout: Option<&FrameLayout>,
    span: Option<SpanFn<'_>>,
    enclose: Option<EncloseFn<'_>>,
    gather: bool,
) -> Result<super::Gathered, Error> {
    let mut w = envelope(reply.name(), id);
    let no_fields: &[(String, WireField)] = &[];
    let placed = place(
        if let Reply::GetOk { fields } = reply {
            fields
        } else {
            no_fields
        },
        layout,
        span,
        enclose,
        gather,
    )?;
    match reply {
        Reply::PutOk { rows } => {
            w.map(1);
            w.kv_uint("rows", *rows);
        }
        Reply::GetOk { fields } => {
            w.map(1);
            w.str("fields");
            field_map(&mut w, fields, &placed.locs)?;
        }
        Reply::ClearOk { cleared } => {
            w.map(1);
            w.kv_uint("cleared", *cleared);
        }
        Reply::StatsOk(stats) => {
            w.map(stats.len());
            for (key, value) in stats {
                w.str(key);
                stat(&mut w, value);
            }
        }
        Reply::LeaseOk {
            segment,
            bytes,
            ttl_ms,
        } => {
            w.map(3);
            w.kv_str("segment", segment);
            w.kv_uint("bytes", *bytes);
            w.kv_uint("ttl_ms", *ttl_ms);
        }
        Reply::ChannelOk { path } => {
            w.map(1);
            w.kv_str("path", path);
        }
        Reply::CheckpointOk {
            dir,
            seq,
            rows,
            bytes,
            files,
        } => {
            w.map(5);
            w.kv_str("dir", dir);
            w.kv_uint("seq", *seq);
            w.kv_uint("rows", *rows);
            w.kv_uint("bytes", *bytes);
            w.kv_uint("files", *files);
        }
        Reply::RestoreOk {
            dir,
            seq,
            rows,
            lost,
        } => {
            w.map(4);
            w.kv_str("dir", dir);
            w.kv_uint("seq", *seq);
            w.kv_uint("rows", *rows);
            w.kv_uint("lost", *lost);
        }
        Reply::VersionsOk {
            incarnation,
            versions,
        } => {
            w.map(2);
            w.kv_uint("incarnation", *incarnation);
            w.str("versions");
            w.bin(&versions_bin(versions));
        }
        Reply::Error { code, message } => {
            w.map(2);
            w.kv_str("code", code);
            w.kv_str("message", message);
        }
    }
    finish_gathered(w, placed)
}

/// Starts an envelope; the caller writes the body map next.
fn stat(w: &mut Writer, value: &Stat) {
    match value {
        Stat::Int(i) => w.sint(*i),
        Stat::Float(f) => w.f64(*f),
        Stat::Str(s) => w.str(s),
        Stat::Bool(b) => w.bool(*b),
        Stat::List(items) => {
            w.array(items.len());
            for item in items {
                stat(w, item);
            }
        }
        Stat::Map(entries) => {
            w.map(entries.len());
            for (k, v) in entries {
                w.str(k);
                stat(w, v);
            }
        }
    }
}

fn envelope(op: &str, id: u64) -> Writer {
    envelope_with(op, id, 0)
}

/// [`envelope`] in a writer with room for `body` more bytes.
fn envelope_with(op: &str, id: u64, body: usize) -> Writer {
    let mut w = Writer::with_capacity(256 + body);
    w.map(4);
    w.kv_str("proto", PROTO);
    w.kv_str("op", op);
    w.kv_uint("id", id);
    w.str("body");
    w
}

/// Frame 0 and the placed data frames (or parts, with their counts).
/// Frame 0 goes in front of the placed lists, which [`place`] made with
/// room for it (no second list each).
fn finish_gathered(w: Writer, placed: Placed) -> Result<super::Gathered, Error> {
    let mut parts = placed.frames;
    parts.insert(0, Bytes::from(w.finish()?));
    let per_frame = placed.counts.map(|mut counts| {
        counts.insert(0, 1);
        counts
    });
    Ok(super::Gathered { parts, per_frame })
}

fn uints(w: &mut Writer, values: &[u64]) {
    w.array(values.len());
    values.iter().for_each(|&v| w.uint(v));
}

/// A get's indexes: as `{"ranges": ...}` where that is shorter than the
/// list (and no run repeats an index), else as the list. A run of one is
/// written with step 1 (a range's step is at least 1).
fn get_indexes(w: &mut Writer, ix: &Indexes) {
    if ix.as_ranges_is_shorter() && ix.runs().iter().all(|r| r.step > 0 || r.count == 1) {
        w.map(1);
        w.str("ranges");
        w.array(ix.runs().len());
        for r in ix.runs() {
            w.array(3);
            w.uint(r.start);
            w.uint(r.count);
            w.uint(r.step.max(1));
        }
    } else {
        w.array(ix.len() as usize);
        ix.iter().for_each(|v| w.uint(v));
    }
}

fn strs<S: AsRef<str>>(w: &mut Writer, values: &[S]) {
    w.array(values.len());
    values.iter().for_each(|v| w.str(v.as_ref()));
}

/// Where a field's runs landed: inline for the one run a field of a
/// small message has (a list a field was made and freed in every get_ok
/// reply, about 400 instructions a field, callgrind).
type Locs = smallvec::SmallVec<[Loc; 1]>;

/// Where a run of rows of one field landed.
#[derive(Clone, Copy, Debug)]
struct Loc {
    row: u64,
    rows: u64,
    frame: u64,
    offset: u64,
    len: u64,
}

/// The data frames of a message, and per field where its rows are: sorted
/// by row, covering every row once, adjacent runs of a regular field merged.
struct Placed {
    frames: Vec<Bytes>,
    locs: Vec<Locs>,
    /// With `gather`: how many of `frames` (parts) make each data frame.
    counts: Option<Vec<u32>>,
}

/// The chunks of a frame as one slice of the buffer that holds them all, if
/// they follow each other in memory (padding never does: it is static).
fn joined(chunks: &[Bytes], span: SpanFn<'_>) -> Option<Bytes> {
    let start = chunks.first()?.as_ptr() as usize;
    let mut end = start;
    for c in chunks {
        if c.as_ptr() as usize != end || c.is_empty() {
            return None;
        }
        end += c.len();
    }
    span(start as *const u8, end - start)
}

/// Padding source: no dtype is wider than 16 bytes.
static ZEROS: [u8; 16] = [0; 16];

/// Finds the buffer that holds `len` bytes from an address, as a slice of it.
pub(super) type SpanFn<'a> = &'a dyn Fn(*const u8, usize) -> Option<Bytes>;

/// Finds the whole buffer that holds some bytes, and where in it they start.
pub(super) type EncloseFn<'a> = &'a dyn Fn(&Bytes) -> Option<(Bytes, u64)>;

/// Carries out a layout (`None`: [`FrameLayout::one_per_piece`]). A frame of
/// several ranges that lie back to back in memory, inside one buffer `span`
/// finds, is that buffer's slice (no copy); any other frame of several
/// ranges is one allocation and one copy, or with `gather` its ranges
/// themselves (no copy: the sender writes them back to back). With
/// `enclose`, every frame that lies inside a buffer it finds is replaced by
/// that whole buffer (one frame per buffer, the ranges at their offsets in
/// it).
fn place<N: AsRef<str> + std::fmt::Debug>(
    fields: &[(N, WireField)],
    layout: Option<&FrameLayout>,
    span: Option<SpanFn<'_>>,
    enclose: Option<EncloseFn<'_>>,
    gather: bool,
) -> Result<Placed, Error> {
    let default;
    let layout = match layout {
        Some(layout) => layout,
        None => {
            default = FrameLayout::one_per_piece(fields);
            &default
        }
    };
    // First row of each part of each regular field.
    // Inline for the usual field of a part or two: no list a field.
    let starts: Vec<smallvec::SmallVec<[u64; 2]>> = fields
        .iter()
        .map(|(_, f)| match f {
            WireField::Regular(p) => p
                .parts()
                .iter()
                .scan(0, |row, (_, n)| Some(std::mem::replace(row, *row + n)))
                .collect(),
            _ => smallvec::SmallVec::new(),
        })
        .collect();
    let mut locs: Vec<Locs> = vec![Locs::new(); fields.len()];
    // Room for frame 0 in front too ([`finish_gathered`]).
    let mut frames = Vec::with_capacity(layout.frames.len() + 1);
    let mut counts: Option<Vec<u32>> = gather.then(|| Vec::with_capacity(layout.frames.len() + 1));
    for (k, slices) in layout.frames.iter().enumerate() {
        let frame = k as u64 + 1;
        let mut chunks: smallvec::SmallVec<[Bytes; 2]> =
            smallvec::SmallVec::with_capacity(slices.len());
        let mut offset = 0u64;
        // Appends a range, first padding the frame to the dtype's itemsize.
        let mut put = |loc: &mut Locs, align: usize, row: u64, rows: u64, chunk: Bytes| {
            let pad = offset.next_multiple_of(align as u64) - offset;
            if pad > 0 {
                chunks.push(Bytes::from_static(&ZEROS[..pad as usize]));
                offset += pad;
            }
            let len = chunk.len() as u64;
            loc.push(Loc {
                row,
                rows,
                frame,
                offset,
                len,
            });
            offset += len;
            chunks.push(chunk);
        };
        for s in slices {
            let Some((name, field)) = fields.get(s.field) else {
                return Err(Error::Layout(format!(
                    "frame {frame} names field #{} of {}",
                    s.field,
                    fields.len()
                )));
            };
            if s.start >= s.end || s.end > field.rows() {
                let (start, end, rows) = (s.start, s.end, field.rows());
                return Err(Error::Layout(format!(
                    "frame {frame} names rows {start}..{end} of {name:?}, which has {rows}"
                )));
            }
            match field {
                WireField::Regular(p) => {
                    let rb = p.row_bytes() as u64;
                    let st = &starts[s.field];
                    let mut i = st
                        .partition_point(|&first| first <= s.start)
                        .saturating_sub(1);
                    let mut row = s.start;
                    while row < s.end {
                        let (bytes, n) = &p.parts()[i];
                        let to = s.end.min(st[i] + n);
                        let range = ((row - st[i]) * rb) as usize..((to - st[i]) * rb) as usize;
                        put(
                            &mut locs[s.field],
                            p.dtype().itemsize(),
                            row,
                            to - row,
                            bytes.slice(range),
                        );
                        (row, i) = (to, i + 1);
                    }
                }
                WireField::Nested(rows) => {
                    for row in s.start..s.end {
                        let t = &rows[row as usize];
                        put(
                            &mut locs[s.field],
                            t.dtype().itemsize(),
                            row,
                            1,
                            t.contiguous_bytes(),
                        );
                    }
                }
                WireField::Values(_) => {
                    return Err(Error::Layout(format!(
                        "frame {frame} names {name:?}, whose values travel in frame 0"
                    )));
                }
            }
        }
        let whole = match chunks.len() {
            0 => return Err(Error::Layout(format!("frame {frame} is empty"))),
            1 => chunks.swap_remove(0),
            _ if let Some(joined) = span.and_then(|span| joined(&chunks, span)) => joined,
            n if let Some(counts) = &mut counts => {
                counts.push(n as u32);
                frames.extend(chunks);
                continue;
            }
            _ => {
                let mut buf = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
                chunks.iter().for_each(|c| buf.extend_from_slice(c));
                buf.freeze()
            }
        };
        if let Some(counts) = &mut counts {
            counts.push(1);
        }
        frames.push(whole);
    }
    if let Some(enclose) = enclose {
        frames = enclosed(frames, &mut locs, enclose);
    }
    for ((name, field), locs) in fields.iter().zip(&mut locs) {
        locs.sort_by_key(|l| l.row);
        let mut next = 0;
        for l in locs.iter() {
            if l.row != next {
                return Err(Error::Layout(format!(
                    "row {} of {name:?} is placed twice or not at all",
                    next.min(l.row)
                )));
            }
            next += l.rows;
        }
        if !matches!(field, WireField::Values(_)) && next != field.rows() {
            return Err(Error::Layout(format!(
                "row {next} of {name:?} is placed nowhere"
            )));
        }
        if let WireField::Regular(_) = field {
            locs.dedup_by(|l, prev| {
                let adjacent = l.frame == prev.frame && prev.offset + prev.len == l.offset;
                if adjacent {
                    (prev.rows, prev.len) = (prev.rows + l.rows, prev.len + l.len);
                }
                adjacent
            });
        }
    }
    Ok(Placed {
        frames,
        locs,
        counts,
    })
}

/// The frames replaced by the buffers that enclose them, each buffer once
/// (in order of first use), and `locs` pointed at the same bytes there.
fn enclosed(frames: Vec<Bytes>, locs: &mut [Locs], enclose: EncloseFn<'_>) -> Vec<Bytes> {
    let mut out: Vec<Bytes> = Vec::new();
    let mut number: std::collections::HashMap<(usize, usize), u64> =
        std::collections::HashMap::new();
    let mut moved = Vec::with_capacity(frames.len());
    for f in frames {
        match enclose(&f) {
            Some((whole, at)) => {
                let key = (whole.as_ptr() as usize, whole.len());
                let k = *number.entry(key).or_insert_with(|| {
                    out.push(whole);
                    out.len() as u64
                });
                moved.push((k, at));
            }
            None => {
                out.push(f);
                moved.push((out.len() as u64, 0));
            }
        }
    }
    for l in locs.iter_mut().flatten() {
        let (k, at) = moved[(l.frame - 1) as usize];
        (l.frame, l.offset) = (k, l.offset + at);
    }
    out
}

fn field_map<N: AsRef<str>>(
    w: &mut Writer,
    fields: &[(N, WireField)],
    locs: &[Locs],
) -> Result<(), Error> {
    w.map(fields.len());
    for ((name, field), locs) in fields.iter().zip(locs) {
        let name = name.as_ref();
        w.str(name);
        descriptor(w, field, locs).map_err(|e| e.in_field(name))?;
    }
    Ok(())
}

fn descriptor(w: &mut Writer, field: &WireField, locs: &[Loc]) -> Result<(), Error> {
    match field {
        WireField::Regular(p) => {
            regular_head(w, p.dtype(), &p.shape_dims(), locs.len());
            for l in locs {
                part(w, l.frame, l.offset, l.len, l.rows);
            }
        }
        WireField::Nested(rows) => {
            let dtype = rows.first().map(|t| t.dtype());
            let dtype = dtype.ok_or_else(|| {
                Error::Unencodable("a nested field with no rows has no dtype".into())
            })?;
            if let Some(t) = rows.iter().find(|t| t.dtype() != dtype) {
                return Err(Error::MixedField(format!(
                    "its rows mix dtypes {dtype} and {}",
                    t.dtype()
                )));
            }
            nested_head(w, dtype, rows.len());
            for (t, l) in rows.iter().zip(locs) {
                nested_row(w, t.shape(), l.frame, l.offset, l.len);
            }
        }
        WireField::Values(values) => values_descriptor(w, values)?,
    }
    Ok(())
}

/// A descriptor from a [`FieldLayout`]: where the rows already lie in data
/// frames the caller sends (the same bytes [`descriptor`] writes for the
/// same placement).
fn layout_descriptor(w: &mut Writer, field: &FieldLayout) -> Result<(), Error> {
    match field {
        FieldLayout::Regular {
            dtype,
            shape,
            parts,
        } => {
            regular_head(w, *dtype, shape, parts.len());
            for p in parts {
                part(w, p.frame, p.offset, p.len, p.rows);
            }
        }
        FieldLayout::Nested { dtype, rows } => {
            nested_head(w, *dtype, rows.len());
            for r in rows {
                nested_row(w, &r.shape, r.frame, r.offset, r.len);
            }
        }
        FieldLayout::Values(values) => values_descriptor(w, values)?,
    }
    Ok(())
}

/// A regular descriptor up to its parts (`parts` of them follow).
fn regular_head(w: &mut Writer, dtype: Dtype, shape: &[u64], parts: usize) {
    w.raw(canonical::REGULAR);
    w.str(dtype.name());
    w.raw(canonical::SHAPE);
    uints(w, shape);
    w.raw(canonical::PARTS);
    w.array(parts);
}

fn part(w: &mut Writer, frame: u64, offset: u64, len: u64, rows: u64) {
    w.raw(canonical::FRAME);
    w.uint(frame);
    w.raw(canonical::OFFSET);
    w.uint(offset);
    w.raw(canonical::LEN);
    w.uint(len);
    w.raw(canonical::ROWS);
    w.uint(rows);
}

/// A nested descriptor up to its rows (`rows` of them follow).
fn nested_head(w: &mut Writer, dtype: Dtype, rows: usize) {
    w.map(3);
    w.kv_str("kind", "nested");
    w.kv_str("dtype", dtype.name());
    w.str("rows");
    w.array(rows);
}

fn nested_row(w: &mut Writer, shape: &[u64], frame: u64, offset: u64, len: u64) {
    w.map(4);
    w.str("shape");
    uints(w, shape);
    w.kv_uint("frame", frame);
    w.kv_uint("offset", offset);
    w.kv_uint("len", len);
}

fn values_descriptor(w: &mut Writer, values: &[Value]) -> Result<(), Error> {
    w.map(2);
    w.kv_str("kind", "values");
    w.str("values");
    w.array(values.len());
    for v in values {
        match v {
            Value::Str(s) => w.str(s),
            Value::Bytes(b) => w.bin(b),
            Value::Msgpack(raw) => {
                let mut r = Reader::new(raw, 0);
                if r.skip(MAX_DEPTH).is_err() || r.remaining() != 0 {
                    return Err(Error::Unencodable(
                        "a msgpack value is not exactly one msgpack value".into(),
                    ));
                }
                w.raw(raw);
            }
        }
    }
    Ok(())
}

/// Frame 0 of a get_ok whose data frames the sender lays out itself.
pub(super) fn get_ok_head<N: AsRef<str>>(
    id: u64,
    fields: &[(N, FieldLayout)],
) -> Result<Bytes, Error> {
    let mut w = envelope("get_ok", id);
    w.map(1);
    w.str("fields");
    layout_map(&mut w, fields)?;
    Ok(Bytes::from(w.finish()?))
}

/// A map of fields to descriptors from their layouts.
fn layout_map<N: AsRef<str>>(w: &mut Writer, fields: &[(N, FieldLayout)]) -> Result<(), Error> {
    w.map(fields.len());
    for (name, field) in fields {
        let name = name.as_ref();
        w.str(name);
        layout_descriptor(w, field).map_err(|e| e.in_field(name))?;
    }
    Ok(())
}

/// A put's fields map: as the last one this thread wrote, copied, where
/// its fields are the same (names and layouts, all regular); else
/// written, and kept for the next put.
///
/// Why: a stream of puts of one shape (a rollout worker's samples)
/// writes the same descriptors every time, only the indexes change.
/// Writing them was about 430 instructions a field of a 32-field put of
/// 4 rows in the Python client's core (callgrind, 2026-12-08); comparing
/// a field's name and layout with the last is a few dozen.
fn put_layout_map(
    w: &mut Writer,
    fields: &[(std::sync::Arc<str>, FieldLayout)],
) -> Result<(), Error> {
    let regular = fields
        .iter()
        .all(|(_, f)| matches!(f, FieldLayout::Regular { .. }));
    if !regular {
        return layout_map(w, fields);
    }
    let copied = LAST_PUT_HEAD.with_borrow(|last| match last {
        Some(last) if last.fields[..] == *fields => {
            w.raw(&last.bytes);
            true
        }
        _ => false,
    });
    if copied {
        return Ok(());
    }
    let start = w.len();
    layout_map(w, fields)?;
    // (A length too long to write makes the map longer than this: such a
    // map, which the writer refuses, is never kept.)
    let bytes = w.written_since(start);
    if bytes.len() <= LastPutHead::MAX_BYTES {
        LAST_PUT_HEAD.set(Some(LastPutHead {
            fields: fields.to_vec(),
            bytes: bytes.to_vec(),
        }));
    }
    Ok(())
}

/// The fields map of the last put a thread wrote ([`put_layout_map`]).
struct LastPutHead {
    fields: Vec<(std::sync::Arc<str>, FieldLayout)>,
    bytes: Vec<u8>,
}

impl LastPutHead {
    /// Largest map kept: a few hundred fields' descriptors.
    const MAX_BYTES: usize = 64 << 10;
}

thread_local! {
    static LAST_PUT_HEAD: std::cell::RefCell<Option<LastPutHead>> =
        const { std::cell::RefCell::new(None) };
}

/// About the bytes of a put's body (at most 9 an integer): frame 0 is
/// written once, into a buffer of its size, where a 32-field put's grew
/// from 256 bytes by doubling, four reallocations and their copies.
fn put_head_room<N: AsRef<str>>(global_indexes: &[u64], fields: &[(N, FieldLayout)]) -> usize {
    let field = |f: &FieldLayout| match f {
        FieldLayout::Regular { shape, parts, .. } => 48 + 9 * shape.len() + 44 * parts.len(),
        FieldLayout::Nested { rows, .. } => {
            32 + rows.iter().map(|r| 40 + 9 * r.shape.len()).sum::<usize>()
        }
        FieldLayout::Values(values) => 24 + 16 * values.len(),
    };
    9 * global_indexes.len()
        + fields
            .iter()
            .map(|(name, f)| 5 + name.as_ref().len() + field(f))
            .sum::<usize>()
}

/// Frame 0 of a request whose data frames the sender lays out itself.
pub(super) fn request_head(id: u64, head: &RequestHead) -> Result<Bytes, Error> {
    match head {
        RequestHead::Put {
            global_indexes,
            fields,
        } => {
            let mut w = envelope_with("put", id, put_head_room(global_indexes, fields));
            w.map(2);
            w.str("global_indexes");
            uints(&mut w, global_indexes);
            w.str("fields");
            put_layout_map(&mut w, fields)?;
            Ok(Bytes::from(w.finish()?))
        }
        RequestHead::GetList {
            global_indexes,
            fields,
        } => get_head(id, GetIndexes::List(global_indexes), fields),
        RequestHead::Other(op) => {
            if let Op::Put { fields, .. } = op
                && !fields.is_empty()
            {
                return Err(Error::Layout(
                    "a put's fields go in a RequestHead::Put, as layouts".into(),
                ));
            }
            Ok(op_frames(id, op, None)?.swap_remove(0))
        }
    }
}

/// Frame 0 of a get (see [`super::encode_get_head`]).
pub(super) fn get_head<S: AsRef<str>>(
    id: u64,
    ix: GetIndexes<'_>,
    fields: &[S],
) -> Result<Bytes, Error> {
    let mut w = envelope("get", id);
    w.map(2);
    w.str("global_indexes");
    match ix {
        GetIndexes::Runs(ix) => get_indexes(&mut w, ix),
        GetIndexes::List(ix) => uints(&mut w, ix),
    }
    w.str("fields");
    strs(&mut w, fields);
    Ok(Bytes::from(w.finish()?))
}

/// Frame 0 plus the keys `extras` sets (`segments`, `same_node`,
/// `channel`, `unit`, `with_versions`) in its envelope map.
pub(super) fn with_extras(frame0: &[u8], extras: &Extras) -> Result<Bytes, Error> {
    let mut w = Writer::new();
    let mut keys = 0u8;
    if let Some(segments) = &extras.segments {
        keys += 1;
        segments_key(&mut w, segments);
    }
    if extras.same_node {
        keys += 1;
        w.str("same_node");
        w.bool(true);
    }
    if let Some(channel) = &extras.channel {
        keys += 1;
        w.str("channel");
        w.str(channel);
    }
    if let Some(unit) = extras.unit {
        keys += 1;
        w.kv_uint("unit", unit);
    }
    if extras.with_versions {
        keys += 1;
        w.str("with_versions");
        w.bool(true);
    }
    append_keys(frame0, keys, w)
}

/// Frame 0 plus `segments` (a reply's segments, not copied).
pub(super) fn with_segments(
    frame0: &[u8],
    segments: &[(String, u64, u64)],
) -> Result<Bytes, Error> {
    let mut w = Writer::new();
    segments_key(&mut w, segments);
    append_keys(frame0, 1, w)
}

fn segments_key(w: &mut Writer, segments: &[(String, u64, u64)]) {
    w.str("segments");
    w.array(segments.len());
    for (name, offset, len) in segments {
        w.array(3);
        w.str(name);
        w.uint(*offset);
        w.uint(*len);
    }
}

/// Versions as they travel: 8 bytes each, little-endian.
fn versions_bin(versions: &[u64]) -> Vec<u8> {
    versions.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Frame 0 plus `incarnation` and `versions` in its envelope map.
pub(super) fn with_versions(
    frame0: &[u8],
    incarnation: u64,
    versions: &[u64],
) -> Result<Bytes, Error> {
    let mut w = Writer::new();
    w.kv_uint("incarnation", incarnation);
    w.str("versions");
    w.bin(&versions_bin(versions));
    append_keys(frame0, 2, w)
}

/// `frame0`, an envelope this encoder wrote (a fixmap of 4 entries first),
/// with `keys` more entries, written in `tail`.
fn append_keys(frame0: &[u8], keys: u8, tail: Writer) -> Result<Bytes, Error> {
    if frame0.first() != Some(&0x84) {
        return Err(Error::Layout(
            "frame 0 is not an envelope written by this encoder".into(),
        ));
    }
    let tail = tail.finish()?;
    let mut out = Vec::with_capacity(frame0.len() + tail.len());
    out.push(0x84 + keys);
    out.extend_from_slice(&frame0[1..]);
    out.extend_from_slice(&tail);
    Ok(Bytes::from(out))
}
