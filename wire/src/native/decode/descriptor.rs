//! Field descriptors (`regular`, `nested`, `values`): read and checked in
//! themselves (kinds, keys, shapes, part and row lengths against the
//! dtype, row sums), then resolved against the data frames into a
//! [`WireField`], tensors as zero-copy slices of the frames.

use std::sync::Arc;

use bytes::Bytes;

use super::frames::Frames;
use super::keys::{Seen, keyed, limit, need, unknown};
use crate::batch::Value;
use crate::msgpack::{NATIVE_MAX_DEPTH as MAX_DEPTH, Reader};
use crate::native::field::PartBytes;
use crate::native::layout::{
    Dims, FieldLayout, PartLayout as PartDesc, Parts, RowLayout as RowDesc, canonical,
};
use crate::native::{Error, Limits, MAX_DIMS, RegularParts, WireField, dtype_from_name};
use crate::tensor::{Dtype, Tensor, contiguous_len};

/// A `{name: descriptor}` map (get_ok).
pub(super) fn field_map(
    r: &mut Reader<'_>,
    data: &mut Frames<'_>,
    limits: &Limits,
) -> Result<Vec<(String, WireField)>, Error> {
    named_map(r, limits, str::to_owned, |r| descriptor(r, data, limits))
}

/// A put's `{name: descriptor}` map: the names shared
/// ([`crate::names::shared_name`]).
///
/// A put shaped like the last one this thread read (the same map, byte
/// for byte, under the same limits) takes that one's names and checked
/// layouts ([`LastPut`]), and only resolves them against its own data
/// frames.
pub(super) fn put_field_map(
    r: &mut Reader<'_>,
    data: &mut Frames<'_>,
    limits: &Limits,
) -> Result<Vec<(Arc<str>, WireField)>, Error> {
    let start = r.pos();
    let hit = LAST_PUT.with_borrow(|last| {
        let last = last.as_ref()?;
        let bytes = &r.buf()[start..];
        (last.limits == *limits && bytes.starts_with(&last.bytes))
            .then(|| (last.bytes.len(), last.fields.clone()))
    });
    if let Some((len, fields)) = hit {
        #[cfg(test)]
        LAST_PUT_HITS.set(LAST_PUT_HITS.get() + 1);
        r.set_pos(start + len);
        return fields
            .iter()
            .map(|(name, dtype, shape, parts)| {
                regular(*dtype, shape, parts, data)
                    .map(|f| (name.clone(), f))
                    .map_err(|e| e.in_field(name))
            })
            .collect();
    }
    let mut layouts = Vec::new();
    let fields = named_map(
        r,
        limits,
        crate::names::shared_name,
        |r| match parse_descriptor(r, data.frame0(), limits)? {
            FieldLayout::Regular {
                dtype,
                shape,
                parts,
            } => {
                let field = regular(dtype, &shape, &parts, data)?;
                layouts.push((dtype, shape, parts));
                Ok(field)
            }
            other => resolve(other, data),
        },
    )?;
    let bytes = &r.buf()[start..r.pos()];
    if layouts.len() == fields.len() && bytes.len() <= LastPut::MAX_BYTES {
        let names = fields.iter().map(|(name, _)| name.clone());
        let last = LastPut {
            bytes: bytes.to_vec(),
            limits: *limits,
            fields: Arc::new(
                names
                    .zip(layouts)
                    .map(|(name, (dtype, shape, parts))| (name, dtype, shape, parts))
                    .collect(),
            ),
        };
        LAST_PUT.set(Some(last));
    }
    Ok(fields)
}

/// The fields map of the last put a thread read, as it was checked: the
/// map's bytes, the limits it was read under, and each field's name and
/// layout. msgpack values end where their bytes say, so a map whose
/// bytes begin with `bytes` is that map: read under the same limits, it
/// would give the same names and layouts (or it would not have been
/// kept). Only maps of regular fields are kept: a nested field's row
/// shapes change from put to put, and a plain value's bytes are shared
/// with the frame they came in.
///
/// Why: a stream of puts of one shape (a rollout worker's samples) sends
/// the same descriptors each time, only the indexes change. Reading them
/// was about 1,230 instructions a field of a 32-field put of 4 rows, a
/// sixth of `stowd`'s (callgrind, 2026-12-08).
struct LastPut {
    bytes: Vec<u8>,
    limits: Limits,
    fields: Arc<Vec<KeptField>>,
}

/// A kept field: its name, and its regular layout as checked.
type KeptField = (Arc<str>, Dtype, Dims, Parts);

impl LastPut {
    /// Largest map kept: a few hundred fields' descriptors.
    const MAX_BYTES: usize = 64 << 10;
}

thread_local! {
    static LAST_PUT: std::cell::RefCell<Option<LastPut>> = const { std::cell::RefCell::new(None) };
}

#[cfg(test)]
thread_local! {
    static LAST_PUT_HITS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Puts this thread read with the last one's fields map.
#[cfg(test)]
pub(in crate::native) fn last_put_hits() -> u64 {
    LAST_PUT_HITS.get()
}

/// A map of distinct field names (each made by `name_of`) to what `one`
/// reads for each (at most `max_fields` of them).
pub(super) fn named_map<'a, N, T>(
    r: &mut Reader<'a>,
    limits: &Limits,
    name_of: impl Fn(&str) -> N,
    mut one: impl FnMut(&mut Reader<'a>) -> Result<T, Error>,
) -> Result<Vec<(N, T)>, Error> {
    let n = r.map_len("fields")?;
    limit("fields", n, limits.max_fields)?;
    let mut seen = Seen::with_capacity(n);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str("a field name")?;
        if !seen.insert(name) {
            return Err(Error::DuplicateField(name.to_owned()));
        }
        let field = one(r).map_err(|e| e.in_field(name))?;
        out.push((name_of(name), field));
    }
    Ok(out)
}

/// A descriptor read and checked in itself: kinds, keys, shapes, part and
/// row lengths against the dtype, row sums. Not yet resolved against the
/// data frames.
pub(super) fn parse_descriptor(
    r: &mut Reader<'_>,
    frame0: &Bytes,
    limits: &Limits,
) -> Result<FieldLayout, Error> {
    if let Some((dtype, shape, parts)) = canonical_regular(r, limits) {
        check_regular(dtype, &shape, &parts, limits)?;
        return Ok(FieldLayout::Regular {
            dtype,
            shape,
            parts,
        });
    }
    any_descriptor(r, frame0, limits)
}

/// A regular descriptor as every encoder here writes it: the keys
/// `kind`, `dtype`, `shape` and `parts` in that order, a part's `frame`,
/// `offset`, `len` and `rows` in that order, names as fixstrs, at most 15
/// dims and parts, integers as fixints or uints. Read by matching its
/// fixed bytes: the general walk ([`any_descriptor`]: any key order, any
/// width, each key looked up and checked for repeats) spent about 2,700
/// instructions on each field of a 32-field put, about 600 of them for
/// each part's map (callgrind, `small_put`). `None`, with nothing
/// consumed, for any other bytes: the general walk then reads them and
/// makes every error, so the two agree on every input (a test compares
/// them on every one-byte change and every truncation of such
/// descriptors). The checks that need no bytes ([`check_regular`]) are the
/// caller's, for both.
fn canonical_regular(r: &mut Reader<'_>, limits: &Limits) -> Option<(Dtype, Dims, Parts)> {
    let start = r.pos();
    let read = |r: &mut Reader<'_>| {
        r.eat(canonical::REGULAR)?;
        let dtype = Dtype::from_name_bytes(r.fixstr_bytes()?)?;
        r.eat(canonical::SHAPE)?;
        // (A fixarray holds at most 15 dims: within `MAX_DIMS`.)
        const _: () = assert!(MAX_DIMS >= 15);
        let n = r.fixarray_len()?;
        let mut shape = Dims::new();
        for _ in 0..n {
            shape.push(r.uint_quiet()?);
        }
        r.eat(canonical::PARTS)?;
        let n = r.fixarray_len()?;
        if n as u64 > limits.max_rows {
            return None;
        }
        let mut parts = Parts::with_capacity(n);
        for _ in 0..n {
            r.eat(canonical::FRAME)?;
            let frame = r.uint_quiet()?;
            r.eat(canonical::OFFSET)?;
            let offset = r.uint_quiet()?;
            r.eat(canonical::LEN)?;
            let len = r.uint_quiet()?;
            r.eat(canonical::ROWS)?;
            let rows = r.uint_quiet()?;
            parts.push(PartDesc {
                frame,
                offset,
                len,
                rows,
            });
        }
        Some((dtype, shape, parts))
    };
    let out = read(r);
    if out.is_none() {
        r.set_pos(start);
    }
    out
}

/// A descriptor of any kind, its keys in any order.
fn any_descriptor(
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
    let layout = parse_descriptor(r, data.frame0(), limits)?;
    resolve(layout, data)
}

/// A checked layout resolved against the data frames (its plain values
/// taken as they are).
fn resolve(layout: FieldLayout, data: &mut Frames<'_>) -> Result<WireField, Error> {
    match layout {
        FieldLayout::Regular {
            dtype,
            shape,
            parts,
        } => regular(dtype, &shape, &parts, data),
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
    shape: &[u64],
    parts: &[PartDesc],
    data: &mut Frames<'_>,
) -> Result<WireField, Error> {
    let row_shape = Dims::from_slice(&shape[1..]);
    let mut out = PartBytes::with_capacity(parts.len());
    // (frame, start offset, end offset) of the last part kept, to merge the
    // next one into it when it follows on directly.
    let mut last: Option<(u64, u64, u64)> = None;
    for p in parts {
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

fn read_shape(r: &mut Reader<'_>) -> Result<Dims, Error> {
    let n = r.array_len("shape")?;
    if n > MAX_DIMS {
        return Err(Error::TooManyDims(n));
    }
    (0..n)
        .map(|_| r.uint("a dimension").map_err(Error::from))
        .collect()
}

fn part_list(r: &mut Reader<'_>, limits: &Limits) -> Result<Parts, Error> {
    const MAP: &str = "a part";
    let n = r.array_len("parts")?;
    limit("parts", n, limits.max_rows)?;
    let mut out = Parts::with_capacity(n);
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
            shape: shape.into_vec(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msgpack::Writer;

    /// A regular descriptor with its keys in the canonical order;
    /// `dtype` as given (an alias or a bad name too).
    fn canonical(dtype: &str, shape: &[u64], parts: &[[u64; 4]]) -> Vec<u8> {
        let mut w = Writer::new();
        w.map(4);
        w.kv_str("kind", "regular");
        w.kv_str("dtype", dtype);
        w.str("shape");
        w.array(shape.len());
        for &d in shape {
            w.uint(d);
        }
        w.str("parts");
        w.array(parts.len());
        for p in parts {
            w.map(4);
            for (k, v) in ["frame", "offset", "len", "rows"].iter().zip(p) {
                w.kv_uint(k, *v);
            }
        }
        w.finish().unwrap()
    }

    /// What each path makes of `bytes`, and where it leaves the reader.
    fn both(bytes: &[u8], limits: &Limits) -> [(Result<FieldLayout, Error>, usize); 2] {
        let frame0 = Bytes::copy_from_slice(bytes);
        let mut fast = Reader::bytes(&frame0, 0);
        let mut general = Reader::bytes(&frame0, 0);
        [
            (parse_descriptor(&mut fast, &frame0, limits), fast.pos()),
            (any_descriptor(&mut general, &frame0, limits), general.pos()),
        ]
    }

    #[test]
    fn the_canonical_reading_agrees_with_the_general_one_on_every_change() {
        let bases = [
            canonical("float32", &[4, 16], &[[1, 0, 256, 4]]),
            canonical("torch.int64", &[3], &[[1, 8, 8, 1], [2, 70_000, 16, 2]]),
            canonical("bool", &[2, 3, 1], &[[3, 1 << 33, 6, 2]]),
            canonical("float", &[0, 5], &[]),
            // Errors of the checks that need no bytes, and of the bytes.
            canonical("float32", &[4, 16], &[[1, 0, 255, 4]]),
            canonical("float32", &[4, 16], &[[1, 0, 192, 3]]),
            canonical("float33", &[1], &[[1, 0, 4, 1]]),
            canonical("uint8", &[41], &[[1, 0, 41, 41]]),
            canonical("uint8", &[], &[]),
        ];
        let mut fast_reads = 0;
        // With a limit of 1 row, the two parts of the second are too many.
        for (limits, base) in [40, 1].into_iter().flat_map(|max_rows| {
            let limits = Limits {
                max_rows,
                ..Limits::DEFAULT
            };
            bases.iter().map(move |b| (limits, b))
        }) {
            let limits = &limits;
            let [fast, general] = both(base, limits);
            assert_eq!(fast, general, "{base:x?}");
            if fast.0.is_ok() {
                let mut r = Reader::new(base, 0);
                fast_reads += usize::from(canonical_regular(&mut r, limits).is_some());
            }
            for end in 0..base.len() {
                let [fast, general] = both(&base[..end], limits);
                assert_eq!(fast, general, "truncated at {end}: {base:x?}");
            }
            for at in 0..base.len() {
                for b in 0..=255u8 {
                    let mut changed = base.clone();
                    changed[at] = b;
                    let [fast, general] = both(&changed, limits);
                    assert_eq!(fast, general, "byte {at} = {b:#x}: {changed:x?}");
                }
            }
        }
        // The well-formed bases were read by the canonical path itself: 4
        // under the first limit, 1 under the second (`float`, of no rows).
        assert_eq!(fast_reads, 5);
    }
}
