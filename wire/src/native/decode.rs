//! Decoding: frames in, requests and replies out, tensors as zero-copy
//! slices of the frames. Every count is checked against the bytes left in
//! frame 0 (by the reader) and against the [`Limits`] before anything is
//! sized from it.

use std::collections::HashSet;

use bytes::Bytes;

use super::{
    Error, Extras, IndexRun, Indexes, Limits, MAX_DIMS, Op, PROTO, RegularParts, Reply, Request,
    STATS_MAX_DEPTH, Stat, WireField, dtype_from_name,
};
use crate::batch::Value;
use crate::indexes::RunsError;
use crate::msgpack::{Item, NATIVE_MAX_DEPTH as MAX_DEPTH, Reader};
use crate::tensor::{Dtype, Tensor, contiguous_len};

/// Envelope and body nest this much deeper than an opaque value may.
const ENVELOPE_DEPTH: usize = MAX_DEPTH + 8;

pub(super) fn request(frames: &[Bytes], limits: &Limits) -> Result<Request, Error> {
    let (id, op, mut r) = envelope(frames, limits)?;
    let mut data = Frames::new(frames);
    let op = match op {
        "put" => put(&mut r, &mut data, limits)?,
        "get" => {
            let (global_indexes, fields) = selection(&mut r, limits, get_indexes)?;
            let fields = fields.ok_or(Error::MissingKey {
                map: "a get body",
                key: "fields",
            })?;
            if global_indexes.is_empty() {
                return Err(Error::EmptyBatch("a get needs at least one global index"));
            }
            if fields.is_empty() {
                return Err(Error::EmptyBatch("a get needs at least one field"));
            }
            Op::Get {
                global_indexes,
                fields,
            }
        }
        "clear" => {
            let (global_indexes, fields) = selection(&mut r, limits, indexes)?;
            Op::Clear {
                global_indexes,
                fields,
            }
        }
        "lease" => Op::Lease {
            bytes: single_uint(&mut r, "a lease body", "bytes")?,
        },
        "stats" => {
            empty_body(&mut r, "the stats body")?;
            Op::Stats
        }
        "channel" => {
            empty_body(&mut r, "the channel body")?;
            Op::Channel
        }
        "checkpoint" => checkpoint_body(&mut r)?,
        "restore" => Op::Restore {
            dir: single_str(&mut r, "a restore body", "dir")?,
        },
        "versions" => {
            let (global_indexes, fields) = selection(&mut r, limits, get_indexes)?;
            let fields = fields.ok_or(Error::MissingKey {
                map: "a versions body",
                key: "fields",
            })?;
            if global_indexes.is_empty() || fields.is_empty() {
                return Err(Error::EmptyBatch(
                    "versions needs at least one global index and one field",
                ));
            }
            Op::Versions {
                global_indexes,
                fields,
            }
        }
        other => return Err(Error::UnknownOp(other.to_owned())),
    };
    data.all_used()?;
    Ok(Request { id, op })
}

/// A reply's frame 0 alone: a `get_ok`'s descriptors, checked in
/// themselves but not against data frames (a receiver checks each range
/// against the frame it arrives in, and that every frame is used); any
/// other reply decoded whole (they carry no data frames).
pub(super) fn reply_layout(frame0: &Bytes, limits: &Limits) -> Result<(u64, ReplyLayout), Error> {
    let frames = std::slice::from_ref(frame0);
    let (id, op, mut r) = envelope(frames, limits)?;
    if op != "get_ok" {
        return reply(frames, limits).map(|(id, reply)| (id, ReplyLayout::Other(reply)));
    }
    const MAP: &str = "a get_ok body";
    let mut fields = None;
    keyed(&mut r, MAP, ["fields"], |_, r| {
        named_map(r, limits, |r| parse_descriptor(r, frame0, limits)).map(|f| fields = Some(f))
    })?;
    let fields = need(fields, MAP, "fields")?;
    same_rows(&fields, FieldLayout::rows)?;
    Ok((id, ReplyLayout::GetOk(fields)))
}

/// A body that must be an empty map.
fn empty_body(r: &mut Reader<'_>, map: &'static str) -> Result<(), Error> {
    if r.map_len(map)? != 0 {
        return Err(Error::UnknownKey {
            map,
            key: r.str("a key")?.to_owned(),
        });
    }
    Ok(())
}

pub(super) fn reply(frames: &[Bytes], limits: &Limits) -> Result<(u64, Reply), Error> {
    let (id, op, mut r) = envelope(frames, limits)?;
    let mut data = Frames::new(frames);
    let reply = match op {
        "put_ok" => Reply::PutOk {
            rows: single_uint(&mut r, "a put_ok body", "rows")?,
        },
        "clear_ok" => Reply::ClearOk {
            cleared: single_uint(&mut r, "a clear_ok body", "cleared")?,
        },
        "lease_ok" => {
            const MAP: &str = "a lease_ok body";
            let (mut segment, mut bytes, mut ttl_ms) = (None, None, None);
            keyed(&mut r, MAP, ["segment", "bytes", "ttl_ms"], |i, r| {
                match i {
                    0 => segment = Some(r.str("segment")?.to_owned()),
                    1 => bytes = Some(r.uint("bytes")?),
                    _ => ttl_ms = Some(r.uint("ttl_ms")?),
                }
                Ok(())
            })?;
            Reply::LeaseOk {
                segment: need(segment, MAP, "segment")?,
                bytes: need(bytes, MAP, "bytes")?,
                ttl_ms: need(ttl_ms, MAP, "ttl_ms")?,
            }
        }
        "channel_ok" => {
            const MAP: &str = "a channel_ok body";
            let mut path = None;
            keyed(&mut r, MAP, ["path"], |_, r| {
                path = Some(r.str("path")?.to_owned());
                Ok(())
            })?;
            Reply::ChannelOk {
                path: need(path, MAP, "path")?,
            }
        }
        "checkpoint_ok" => {
            const MAP: &str = "a checkpoint_ok body";
            let (mut dir, mut n) = (None, [None; 4]);
            keyed(
                &mut r,
                MAP,
                ["dir", "seq", "rows", "bytes", "files"],
                |i, r| {
                    match i {
                        0 => dir = Some(r.str("dir")?.to_owned()),
                        i => n[i - 1] = Some(r.uint(["seq", "rows", "bytes", "files"][i - 1])?),
                    }
                    Ok(())
                },
            )?;
            Reply::CheckpointOk {
                dir: need(dir, MAP, "dir")?,
                seq: need(n[0], MAP, "seq")?,
                rows: need(n[1], MAP, "rows")?,
                bytes: need(n[2], MAP, "bytes")?,
                files: need(n[3], MAP, "files")?,
            }
        }
        "restore_ok" => {
            const MAP: &str = "a restore_ok body";
            let (mut dir, mut n) = (None, [None; 3]);
            keyed(&mut r, MAP, ["dir", "seq", "rows", "lost"], |i, r| {
                match i {
                    0 => dir = Some(r.str("dir")?.to_owned()),
                    i => n[i - 1] = Some(r.uint(["seq", "rows", "lost"][i - 1])?),
                }
                Ok(())
            })?;
            Reply::RestoreOk {
                dir: need(dir, MAP, "dir")?,
                seq: need(n[0], MAP, "seq")?,
                rows: need(n[1], MAP, "rows")?,
                lost: need(n[2], MAP, "lost")?,
            }
        }
        "get_ok" => {
            const MAP: &str = "a get_ok body";
            let mut fields = None;
            keyed(&mut r, MAP, ["fields"], |_, r| {
                field_map(r, &mut data, limits).map(|f| fields = Some(f))
            })?;
            let fields = need(fields, MAP, "fields")?;
            same_rows(&fields, WireField::rows)?;
            Reply::GetOk { fields }
        }
        "versions_ok" => {
            const MAP: &str = "a versions_ok body";
            let (mut incarnation, mut versions) = (None, None);
            keyed(&mut r, MAP, ["incarnation", "versions"], |i, r| {
                match i {
                    0 => incarnation = Some(r.uint("incarnation")?),
                    _ => versions = Some(versions_bin(r, limits)?),
                }
                Ok(())
            })?;
            Reply::VersionsOk {
                incarnation: need(incarnation, MAP, "incarnation")?,
                versions: need(versions, MAP, "versions")?,
            }
        }
        "stats_ok" => {
            let n = r.map_len("a stats_ok body")?;
            limit("stats", n, limits.max_fields)?;
            Reply::StatsOk(stat_entries(&mut r, n, STATS_MAX_DEPTH, limits)?)
        }
        "error" => {
            const MAP: &str = "an error body";
            const KEYS: [&str; 2] = ["code", "message"];
            let mut v = [None; 2];
            keyed(&mut r, MAP, KEYS, |i, r| {
                r.str(KEYS[i]).map(|s| v[i] = Some(s)).map_err(Error::from)
            })?;
            let [code, message] = v;
            Reply::Error {
                code: need(code, MAP, "code")?.to_owned(),
                message: need(message, MAP, "message")?.to_owned(),
            }
        }
        other => return Err(Error::UnknownOp(other.to_owned())),
    };
    data.all_used()?;
    Ok((id, reply))
}

/// The `id` key of an envelope, if it can be read.
pub(super) fn id(frame0: &[u8]) -> Option<u64> {
    let mut r = Reader::new(frame0, 0);
    for _ in 0..r.map_len("the envelope").ok()? {
        if r.str("a key").ok()? == "id" {
            return r.uint("id").ok();
        }
        r.skip(ENVELOPE_DEPTH).ok()?;
    }
    None
}

/// Checks the message against the limits, reads the envelope (keys in any
/// order), and returns the id, the op and a reader positioned at the body.
fn envelope<'a>(frames: &'a [Bytes], limits: &Limits) -> Result<(u64, &'a str, Reader<'a>), Error> {
    const MAP: &str = "the envelope";
    let frame0 = frames.first().ok_or(Error::NoFrames)?;
    if frames.len() as u64 > limits.max_frames {
        return Err(Error::TooLarge {
            what: "frames",
            value: frames.len() as u64,
            limit: limits.max_frames,
        });
    }
    let total = frames
        .iter()
        .fold(0u64, |sum, f| sum.saturating_add(f.len() as u64));
    if total > limits.max_message_bytes {
        return Err(Error::TooLarge {
            what: "message bytes",
            value: total,
            limit: limits.max_message_bytes,
        });
    }
    let mut r = Reader::new(frame0, 0);
    let (mut proto, mut op, mut id, mut body, mut stray) = (None, None, None, None, None);
    for _ in 0..r.map_len(MAP)? {
        let key = r.str("an envelope key")?;
        let dup = match key {
            "proto" => proto.replace(r.str("proto")?).is_some(),
            "op" => op.replace(r.str("op")?).is_some(),
            "id" => id.replace(r.uint("id")?).is_some(),
            "body" => body.replace(r.skip(ENVELOPE_DEPTH)?.start).is_some(),
            // Shared-memory and peer keys: read by `extras`.
            "segments" | "same_node" | "channel" | "unit" | "with_versions" | "incarnation"
            | "versions" => r.skip(ENVELOPE_DEPTH).map(|_| false)?,
            other => {
                stray.get_or_insert(other);
                r.skip(ENVELOPE_DEPTH).map(|_| false)?
            }
        };
        if dup {
            return Err(Error::DuplicateKey {
                map: MAP,
                key: key.to_owned(),
            });
        }
    }
    if r.remaining() > 0 {
        return Err(r.malformed("trailing bytes after the envelope").into());
    }
    match need(proto, MAP, "proto")? {
        PROTO => {}
        other => return Err(Error::UnsupportedProto(other.to_owned())),
    }
    if let Some(key) = stray {
        return Err(unknown(MAP, key));
    }
    let (op, id, body) = (
        need(op, MAP, "op")?,
        need(id, MAP, "id")?,
        need(body, MAP, "body")?,
    );
    Ok((id, op, Reader::new(frame0, body)))
}

fn put(r: &mut Reader<'_>, data: &mut Frames<'_>, limits: &Limits) -> Result<Op, Error> {
    const MAP: &str = "a put body";
    let (mut global_indexes, mut fields) = (None, None);
    keyed(r, MAP, ["global_indexes", "fields"], |i, r| match i {
        0 => indexes(r, limits).map(|v| global_indexes = Some(v)),
        _ => field_map(r, data, limits).map(|v| fields = Some(v)),
    })?;
    let global_indexes: Vec<u64> = need(global_indexes, MAP, "global_indexes")?;
    let fields: Vec<(String, WireField)> = need(fields, MAP, "fields")?;
    if global_indexes.is_empty() {
        return Err(Error::EmptyBatch("a put needs at least one global index"));
    }
    if fields.is_empty() {
        return Err(Error::EmptyBatch("a put needs at least one field"));
    }
    let expected = global_indexes.len() as u64;
    if let Some((name, f)) = fields.iter().find(|(_, f)| f.rows() != expected) {
        return Err(Error::RowCount {
            rows: f.rows(),
            expected,
        }
        .in_field(name));
    }
    if !global_indexes.windows(2).all(|w| w[0] < w[1]) {
        let mut sorted = global_indexes.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::DuplicateIndex(w[0]));
        }
    }
    Ok(Op::Put {
        global_indexes,
        fields,
    })
}

/// The body of a get or clear: `global_indexes` (required, read by
/// `read`) and `fields`.
fn selection<T>(
    r: &mut Reader<'_>,
    limits: &Limits,
    read: impl Fn(&mut Reader<'_>, &Limits) -> Result<T, Error>,
) -> Result<(T, Option<Vec<String>>), Error> {
    const MAP: &str = "a get or clear body";
    let (mut global_indexes, mut fields) = (None, None);
    keyed(r, MAP, ["global_indexes", "fields"], |i, r| match i {
        0 => read(r, limits).map(|v| global_indexes = Some(v)),
        _ => names(r, limits).map(|v| fields = Some(v)),
    })?;
    Ok((need(global_indexes, MAP, "global_indexes")?, fields))
}

fn indexes(r: &mut Reader<'_>, limits: &Limits) -> Result<Vec<u64>, Error> {
    let n = r.array_len("global_indexes")?;
    limit("global indexes", n, limits.max_rows)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(r.uint("a global index")?);
    }
    Ok(out)
}

/// A get's `global_indexes`: an array of uints, or `{"ranges": [[start,
/// count, step], ...]}` (checked: no empty range, a step of at least 1,
/// none past 2^64 - 1, at most `max_rows` indexes in all), kept as runs.
/// Ranges are for gets only: a get's work grows with the rows it finds,
/// which earlier puts paid for, while a put's or a clear's would grow with
/// the count alone.
fn get_indexes(r: &mut Reader<'_>, limits: &Limits) -> Result<Indexes, Error> {
    if !r.next_is_map() {
        return indexes(r, limits).map(|list| Indexes::from_list(&list));
    }
    const MAP: &str = "global_indexes";
    let mut runs = None;
    keyed(r, MAP, ["ranges"], |_, r| {
        let n = r.array_len("ranges")?;
        limit("global index ranges", n, limits.max_rows)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            tuple(r, "a range", 3, "[start, count, step]")?;
            out.push(IndexRun {
                start: r.uint("a range's start")?,
                count: r.uint("a range's count")?,
                step: r.uint("a range's step")?,
            });
        }
        runs = Some(out);
        Ok(())
    })?;
    Indexes::from_runs(need(runs, MAP, "ranges")?, limits.max_rows).map_err(|e| match e {
        RunsError::TooMany(value, limit) => Error::TooLarge {
            what: "global indexes",
            value,
            limit,
        },
        other => Error::BadRange(other),
    })
}

fn names(r: &mut Reader<'_>, limits: &Limits) -> Result<Vec<String>, Error> {
    let n = r.array_len("fields")?;
    limit("fields", n, limits.max_fields)?;
    let mut seen = HashSet::with_capacity(n);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str("a field name")?;
        if !seen.insert(name) {
            return Err(Error::DuplicateField(name.to_owned()));
        }
        out.push(name.to_owned());
    }
    Ok(out)
}

/// A `{name: descriptor}` map (put and get_ok).
fn field_map(
    r: &mut Reader<'_>,
    data: &mut Frames<'_>,
    limits: &Limits,
) -> Result<Vec<(String, WireField)>, Error> {
    named_map(r, limits, |r| descriptor(r, data, limits))
}

/// A map of distinct field names to what `one` reads for each (at most
/// `max_fields` of them).
fn named_map<'a, T>(
    r: &mut Reader<'a>,
    limits: &Limits,
    mut one: impl FnMut(&mut Reader<'a>) -> Result<T, Error>,
) -> Result<Vec<(String, T)>, Error> {
    let n = r.map_len("fields")?;
    limit("fields", n, limits.max_fields)?;
    let mut seen = HashSet::with_capacity(n);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str("a field name")?;
        if !seen.insert(name) {
            return Err(Error::DuplicateField(name.to_owned()));
        }
        let field = one(r).map_err(|e| e.in_field(name))?;
        out.push((name.to_owned(), field));
    }
    Ok(out)
}

/// Every field of a get_ok has the same number of rows as the first.
fn same_rows<T>(fields: &[(String, T)], rows: impl Fn(&T) -> u64) -> Result<(), Error> {
    if let Some((_, first)) = fields.first() {
        let expected = rows(first);
        if let Some((name, f)) = fields.iter().find(|(_, f)| rows(f) != expected) {
            return Err(Error::RowCount {
                rows: rows(f),
                expected,
            }
            .in_field(name));
        }
    }
    Ok(())
}

use super::layout::{FieldLayout, PartLayout as PartDesc, ReplyLayout, RowLayout as RowDesc};

/// A descriptor read and checked in itself: kinds, keys, shapes, part and
/// row lengths against the dtype, row sums. Not yet resolved against the
/// data frames.
fn parse_descriptor(
    r: &mut Reader<'_>,
    frame0: &Bytes,
    limits: &Limits,
) -> Result<FieldLayout, Error> {
    const MAP: &str = "a descriptor";
    let (mut kind, mut dtype, mut shape, mut parts, mut rows, mut values) =
        (None, None, None, None, None, None);
    keyed(
        r,
        MAP,
        ["kind", "dtype", "shape", "parts", "rows", "values"],
        |i, r| match i {
            0 => r.str("kind").map(|v| kind = Some(v)).map_err(Error::from),
            1 => r
                .str("dtype")
                .map_err(Error::from)
                .and_then(dtype_from_name)
                .map(|v| dtype = Some(v)),
            2 => read_shape(r).map(|v| shape = Some(v)),
            3 => part_list(r, limits).map(|v| parts = Some(v)),
            4 => row_list(r, limits).map(|v| rows = Some(v)),
            _ => value_list(r, frame0, limits).map(|v| values = Some(v)),
        },
    )?;
    let kind = need(kind, MAP, "kind")?;
    let allowed: &[&str] = match kind {
        "regular" => &["dtype", "shape", "parts"],
        "nested" => &["dtype", "rows"],
        "values" => &["values"],
        other => return Err(Error::UnknownKind(other.to_owned())),
    };
    let present = [
        (dtype.is_some(), "dtype"),
        (shape.is_some(), "shape"),
        (parts.is_some(), "parts"),
        (rows.is_some(), "rows"),
        (values.is_some(), "values"),
    ];
    if let Some((_, key)) = present.iter().find(|(p, key)| *p && !allowed.contains(key)) {
        return Err(unknown(MAP, key));
    }
    match kind {
        "regular" => {
            let (dtype, shape, parts) = (
                need(dtype, MAP, "dtype")?,
                need(shape, MAP, "shape")?,
                need(parts, MAP, "parts")?,
            );
            check_regular(dtype, &shape, &parts, limits)?;
            Ok(FieldLayout::Regular {
                dtype,
                shape,
                parts,
            })
        }
        "nested" => {
            let (dtype, rows) = (need(dtype, MAP, "dtype")?, need(rows, MAP, "rows")?);
            for row in &rows {
                check_nested_row(dtype, row)?;
            }
            Ok(FieldLayout::Nested { dtype, rows })
        }
        _ => Ok(FieldLayout::Values(need(values, MAP, "values")?)),
    }
}

fn descriptor(
    r: &mut Reader<'_>,
    data: &mut Frames<'_>,
    limits: &Limits,
) -> Result<WireField, Error> {
    match parse_descriptor(r, data.frame0(), limits)? {
        FieldLayout::Regular {
            dtype,
            shape,
            parts,
        } => regular(dtype, shape, parts, data),
        FieldLayout::Nested { dtype, rows } => nested(dtype, rows, data),
        FieldLayout::Values(values) => Ok(WireField::Values(values)),
    }
}

/// The checks of a regular descriptor that need no data frame; returns
/// the bytes of a row.
fn check_regular(
    dtype: Dtype,
    shape: &[u64],
    parts: &[PartDesc],
    limits: &Limits,
) -> Result<usize, Error> {
    let Some((&n, row_shape)) = shape.split_first() else {
        return Err(Error::BadShape {
            shape: shape.to_vec(),
            reason: "a regular field needs a row axis",
        });
    };
    if n > limits.max_rows {
        return Err(Error::TooLarge {
            what: "rows",
            value: n,
            limit: limits.max_rows,
        });
    }
    let row_bytes = contiguous_len(dtype, row_shape).map_err(|_| Error::BadShape {
        shape: shape.to_vec(),
        reason: "a row overflows the address space",
    })?;
    let mut sum = 0u64;
    for p in parts {
        if p.rows == 0 {
            return Err(Error::EmptyPart);
        }
        let expected = u128::from(p.rows) * row_bytes as u128;
        if expected != u128::from(p.len) {
            return Err(Error::LengthMismatch {
                len: p.len,
                expected,
            });
        }
        sum = match sum.checked_add(p.rows) {
            Some(s) if s <= n => s,
            _ => {
                return Err(Error::RowSum {
                    parts: sum.saturating_add(p.rows),
                    rows: n,
                });
            }
        };
    }
    if sum != n {
        return Err(Error::RowSum {
            parts: sum,
            rows: n,
        });
    }
    Ok(row_bytes)
}

/// The checks of a nested row that need no data frame.
fn check_nested_row(dtype: Dtype, row: &RowDesc) -> Result<(), Error> {
    let expected = contiguous_len(dtype, &row.shape).map_err(|_| Error::BadShape {
        shape: row.shape.clone(),
        reason: "overflows the address space",
    })?;
    if expected as u64 != row.len {
        return Err(Error::LengthMismatch {
            len: row.len,
            expected: expected as u128,
        });
    }
    Ok(())
}

/// A checked regular descriptor resolved against the data frames.
fn regular(
    dtype: Dtype,
    shape: Vec<u64>,
    parts: Vec<PartDesc>,
    data: &mut Frames<'_>,
) -> Result<WireField, Error> {
    let row_shape = shape[1..].to_vec();
    let mut out: Vec<(Bytes, u64)> = Vec::with_capacity(parts.len());
    // (frame, start offset, end offset) of the last part kept, to merge the
    // next one into it when it follows on directly.
    let mut last: Option<(u64, u64, u64)> = None;
    for p in &parts {
        let bytes = data.slice(p.frame, p.offset, p.len)?;
        match (last, out.last_mut()) {
            (Some((frame, start, end)), Some(prev)) if frame == p.frame && end == p.offset => {
                let end = p.offset + p.len;
                *prev = (data.slice(frame, start, end - start)?, prev.1 + p.rows);
                last = Some((frame, start, end));
            }
            _ => {
                out.push((bytes, p.rows));
                last = Some((p.frame, p.offset, p.offset + p.len));
            }
        }
    }
    Ok(WireField::Regular(RegularParts::new(
        dtype, row_shape, out,
    )?))
}

/// A checked nested descriptor resolved against the data frames.
fn nested(dtype: Dtype, rows: Vec<RowDesc>, data: &mut Frames<'_>) -> Result<WireField, Error> {
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let bytes = data.slice(row.frame, row.offset, row.len)?;
        out.push(Tensor::contiguous(bytes, dtype, row.shape)?);
    }
    Ok(WireField::Nested(out))
}

fn read_shape(r: &mut Reader<'_>) -> Result<Vec<u64>, Error> {
    let n = r.array_len("shape")?;
    if n > MAX_DIMS {
        return Err(Error::TooManyDims(n));
    }
    (0..n)
        .map(|_| r.uint("a dimension").map_err(Error::from))
        .collect()
}

fn part_list(r: &mut Reader<'_>, limits: &Limits) -> Result<Vec<PartDesc>, Error> {
    const MAP: &str = "a part";
    let n = r.array_len("parts")?;
    limit("parts", n, limits.max_rows)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        const KEYS: [&str; 4] = ["frame", "offset", "len", "rows"];
        let mut v = [None; 4];
        keyed(r, MAP, KEYS, |i, r| {
            r.uint(KEYS[i]).map(|u| v[i] = Some(u)).map_err(Error::from)
        })?;
        let [frame, offset, len, rows] = v;
        let (frame, offset) = (need(frame, MAP, "frame")?, need(offset, MAP, "offset")?);
        out.push(PartDesc {
            frame,
            offset,
            len: need(len, MAP, "len")?,
            rows: need(rows, MAP, "rows")?,
        });
    }
    Ok(out)
}

fn row_list(r: &mut Reader<'_>, limits: &Limits) -> Result<Vec<RowDesc>, Error> {
    const MAP: &str = "a nested row";
    let n = r.array_len("rows")?;
    limit("rows", n, limits.max_rows)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        const KEYS: [&str; 4] = ["shape", "frame", "offset", "len"];
        let (mut shape, mut v) = (None, [None; 4]);
        keyed(r, MAP, KEYS, |i, r| match i {
            0 => read_shape(r).map(|s| shape = Some(s)),
            _ => r.uint(KEYS[i]).map(|u| v[i] = Some(u)).map_err(Error::from),
        })?;
        let [_, frame, offset, len] = v;
        let shape = need(shape, MAP, "shape")?;
        let (frame, offset, len) = (
            need(frame, MAP, "frame")?,
            need(offset, MAP, "offset")?,
            need(len, MAP, "len")?,
        );
        out.push(RowDesc {
            shape,
            frame,
            offset,
            len,
        });
    }
    Ok(out)
}

/// `str` -> `Value::Str`, `bin` -> `Value::Bytes` (a slice of frame 0),
/// anything else -> `Value::Msgpack` (its exact encoding, a slice).
fn value_list(r: &mut Reader<'_>, frame0: &Bytes, limits: &Limits) -> Result<Vec<Value>, Error> {
    let n = r.array_len("values")?;
    limit("values", n, limits.max_rows)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let start = r.pos();
        out.push(match r.str_or_bin()? {
            Some((true, range)) => {
                Value::Str(String::from_utf8(frame0[range].to_vec()).map_err(|_| {
                    Error::Malformed {
                        offset: start,
                        reason: "invalid UTF-8 in a str",
                    }
                })?)
            }
            Some((false, range)) => Value::Bytes(frame0.slice(range)),
            None => Value::Msgpack(frame0.slice(r.skip(MAX_DEPTH)?)),
        });
    }
    Ok(out)
}

/// A body that is a map with exactly one uint key.
fn single_uint(r: &mut Reader<'_>, map: &'static str, key: &'static str) -> Result<u64, Error> {
    let mut value = None;
    keyed(r, map, [key], |_, r| {
        r.uint(key).map(|u| value = Some(u)).map_err(Error::from)
    })?;
    need(value, map, key)
}

/// A checkpoint body: `{"dir": str}` or `{"dir": str, "journal": bool}`.
fn checkpoint_body(r: &mut Reader<'_>) -> Result<Op, Error> {
    const MAP: &str = "a checkpoint body";
    let (mut dir, mut journal) = (None, true);
    keyed(r, MAP, ["dir", "journal"], |i, r| {
        if i == 0 {
            dir = Some(r.str("dir")?.to_owned());
        } else {
            journal = r.bool_value()?.ok_or(Error::WrongType {
                key: "journal",
                expected: "a bool",
            })?;
        }
        Ok(())
    })?;
    Ok(Op::Checkpoint {
        dir: need(dir, MAP, "dir")?,
        journal,
    })
}

fn single_str(r: &mut Reader<'_>, map: &'static str, key: &'static str) -> Result<String, Error> {
    let mut value = None;
    keyed(r, map, [key], |_, r| {
        r.str(key)
            .map(|s| value = Some(s.to_owned()))
            .map_err(Error::from)
    })?;
    need(value, map, key)
}

/// The data frames of a message and which of them a descriptor used.
struct Frames<'f> {
    frames: &'f [Bytes],
    used: Vec<bool>,
}

impl<'f> Frames<'f> {
    fn new(frames: &'f [Bytes]) -> Self {
        Frames {
            frames,
            used: vec![false; frames.len()],
        }
    }

    fn frame0(&self) -> &'f Bytes {
        &self.frames[0]
    }

    /// Bytes `offset..offset + len` of data frame `frame` (zero copy).
    fn slice(&mut self, frame: u64, offset: u64, len: u64) -> Result<Bytes, Error> {
        let data_frames = self.frames.len() - 1;
        if frame == 0 || frame > data_frames as u64 {
            return Err(Error::FrameOutOfRange { frame, data_frames });
        }
        let f = &self.frames[frame as usize];
        match offset.checked_add(len) {
            Some(end) if end <= f.len() as u64 => {
                self.used[frame as usize] = true;
                Ok(f.slice(offset as usize..end as usize))
            }
            _ => Err(Error::RangeOutsideFrame {
                frame,
                offset,
                len,
                frame_len: f.len(),
            }),
        }
    }

    fn all_used(&self) -> Result<(), Error> {
        match self.used.iter().skip(1).position(|u| !u) {
            Some(i) => Err(Error::UnusedFrame(i + 1)),
            None => Ok(()),
        }
    }
}

/// Reads a map whose keys must be among `keys`, each at most once, in any
/// order: `read(i, r)` reads the value of `keys[i]`.
fn keyed<'a, const N: usize>(
    r: &mut Reader<'a>,
    map: &'static str,
    keys: [&'static str; N],
    mut read: impl FnMut(usize, &mut Reader<'a>) -> Result<(), Error>,
) -> Result<(), Error> {
    let mut seen = [false; N];
    for _ in 0..r.map_len(map)? {
        let key = r.str("a key")?;
        let Some(i) = keys.iter().position(|k| *k == key) else {
            return Err(unknown(map, key));
        };
        if std::mem::replace(&mut seen[i], true) {
            return Err(Error::DuplicateKey {
                map,
                key: key.to_owned(),
            });
        }
        read(i, r)?;
    }
    Ok(())
}

fn need<T>(slot: Option<T>, map: &'static str, key: &'static str) -> Result<T, Error> {
    slot.ok_or(Error::MissingKey { map, key })
}

fn unknown(map: &'static str, key: &str) -> Error {
    Error::UnknownKey {
        map,
        key: key.to_owned(),
    }
}

/// `n` entries of a stats map (the body, or a map value inside it), with
/// lists and maps nested at most `depth` more levels.
fn stat_entries(
    r: &mut Reader<'_>,
    n: usize,
    depth: usize,
    limits: &Limits,
) -> Result<Vec<(String, Stat)>, Error> {
    const MAP: &str = "a stats map";
    let (mut seen, mut stats) = (HashSet::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let key = r.str("a stats key")?;
        if !seen.insert(key) {
            return Err(Error::DuplicateKey {
                map: MAP,
                key: key.to_owned(),
            });
        }
        stats.push((key.to_owned(), stat_value(r, depth, limits)?));
    }
    Ok(stats)
}

/// One stats value: an integer within i64, a float, a str, a bool, or a
/// list or map of those.
fn stat_value(r: &mut Reader<'_>, depth: usize, limits: &Limits) -> Result<Stat, Error> {
    const WHAT: &str = "a stats value";
    let wrong = || Error::WrongType {
        key: WHAT,
        expected: "an integer, a float, a str, a bool, a list or a map",
    };
    let nested = |r: &Reader<'_>| {
        if depth == 0 {
            Err(Error::from(r.malformed("stats nested too deep")))
        } else {
            Ok(())
        }
    };
    Ok(match r.item()? {
        Item::Bool(b) => Stat::Bool(b),
        Item::UInt(v) => Stat::Int(i64::try_from(v).map_err(|_| Error::WrongType {
            key: WHAT,
            expected: "an integer within i64",
        })?),
        Item::Int(v) => Stat::Int(v),
        Item::Float(f) => Stat::Float(f),
        Item::Str { s, .. } => Stat::Str(s.to_owned()),
        Item::Array(n) => {
            nested(r)?;
            limit("stats", n, limits.max_rows)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(stat_value(r, depth - 1, limits)?);
            }
            Stat::List(items)
        }
        Item::Map(n) => {
            nested(r)?;
            limit("stats", n, limits.max_fields)?;
            Stat::Map(stat_entries(r, n, depth - 1, limits)?)
        }
        Item::Nil | Item::Bin { .. } | Item::Ext { .. } => return Err(wrong()),
    })
}

/// The header of an array that must hold exactly `n` items.
fn tuple(
    r: &mut Reader<'_>,
    what: &'static str,
    n: usize,
    expected: &'static str,
) -> Result<(), Error> {
    if r.array_len(what)? != n {
        return Err(Error::WrongType {
            key: what,
            expected,
        });
    }
    Ok(())
}

fn limit(what: &'static str, n: usize, max: u64) -> Result<(), Error> {
    if n as u64 > max {
        Err(Error::TooLarge {
            what,
            value: n as u64,
            limit: max,
        })
    } else {
        Ok(())
    }
}

/// A `versions` bin: 8 bytes per version, little-endian, at most one per
/// row and field a request may name.
fn versions_bin(r: &mut Reader<'_>, limits: &Limits) -> Result<Vec<u64>, Error> {
    let bad = Error::WrongType {
        key: "versions",
        expected: "a bin of 8 bytes per version",
    };
    let Some((false, range)) = r.str_or_bin()? else {
        return Err(bad);
    };
    let bytes = &r.buf()[range];
    if !bytes.len().is_multiple_of(8) {
        return Err(bad);
    }
    let n = bytes.len() / 8;
    limit(
        "versions",
        n,
        limits.max_rows.saturating_mul(limits.max_fields),
    )?;
    Ok(bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// Longest `channel` token an envelope may carry.
const MAX_CHANNEL_TOKEN: usize = 64;

/// The shared-memory keys of an envelope.
pub(super) fn extras(frame0: &[u8], limits: &Limits) -> Result<Extras, Error> {
    const MAP: &str = "the envelope";
    let mut r = Reader::new(frame0, 0);
    let mut out = Extras::default();
    for _ in 0..r.map_len(MAP)? {
        match r.str("an envelope key")? {
            "segments" => {
                let n = r.array_len("segments")?;
                limit("segments", n, limits.max_frames)?;
                let mut segs = Vec::with_capacity(n);
                for _ in 0..n {
                    tuple(&mut r, "a segment", 3, "[name, offset, len]")?;
                    let name = r.str("a segment name")?.to_owned();
                    segs.push((name, r.uint("a segment offset")?, r.uint("a segment len")?));
                }
                out.segments = Some(segs);
            }
            "channel" => {
                let token = r.str("channel")?;
                if token.is_empty() || token.len() > MAX_CHANNEL_TOKEN {
                    return Err(Error::WrongType {
                        key: "channel",
                        expected: "a channel token (1 to 64 characters)",
                    });
                }
                out.channel = Some(token.to_owned());
            }
            "unit" => out.unit = Some(r.uint("unit")?),
            "with_versions" => {
                out.with_versions = r.bool_value()?.ok_or(Error::WrongType {
                    key: "with_versions",
                    expected: "a bool",
                })?
            }
            "incarnation" => {
                let incarnation = r.uint("incarnation")?;
                let versions = out.versions.get_or_insert((0, Vec::new()));
                versions.0 = incarnation;
            }
            "versions" => {
                let v = versions_bin(&mut r, limits)?;
                out.versions.get_or_insert((0, Vec::new())).1 = v;
            }
            "same_node" => {
                out.same_node = match r.bool_value()? {
                    Some(b) => b,
                    None => {
                        return Err(Error::WrongType {
                            key: "same_node",
                            expected: "a bool",
                        });
                    }
                }
            }
            _ => {
                r.skip(ENVELOPE_DEPTH)?;
            }
        }
    }
    Ok(out)
}
