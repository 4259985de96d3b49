//! Requests: the op's body read into an [`Op`] (put, get, clear, lease,
//! stats, channel, checkpoint, restore, versions), its descriptors
//! resolved against the data frames, every data frame used.

use std::sync::Arc;

use bytes::Bytes;

use super::descriptor::put_field_map;
use super::envelope::envelope;
use super::frames::Frames;
use super::keys::{Seen, empty_body, keyed, limit, need, single_str, single_uint, tuple};
use crate::indexes::RunsError;
use crate::msgpack::Reader;
use crate::native::{Error, IndexRun, Indexes, Limits, Op, Request, WireField};

/// The request in `frames`; `body`, if known, is where frame 0's `body`
/// value lies (see [`envelope`]).
pub(in crate::native) fn request(
    frames: &[Bytes],
    limits: &Limits,
    body: Option<&std::ops::Range<usize>>,
) -> Result<Request, Error> {
    let (id, op, mut r, tail) = envelope(frames, limits, body)?;
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
    tail.check(&r)?;
    data.all_used()?;
    Ok(Request { id, op })
}

fn put(r: &mut Reader<'_>, data: &mut Frames<'_>, limits: &Limits) -> Result<Op, Error> {
    const MAP: &str = "a put body";
    let (mut global_indexes, mut fields) = (None, None);
    keyed(r, MAP, ["global_indexes", "fields"], |i, r| match i {
        0 => indexes(r, limits).map(|v| global_indexes = Some(v)),
        _ => put_field_map(r, data, limits).map(|v| fields = Some(v)),
    })?;
    let global_indexes: Vec<u64> = need(global_indexes, MAP, "global_indexes")?;
    let fields: Vec<(Arc<str>, WireField)> = need(fields, MAP, "fields")?;
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
    let mut seen = Seen::with_capacity(n);
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
