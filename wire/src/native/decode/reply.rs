//! Replies: a whole reply read into a [`Reply`], or a reply's frame 0
//! alone into a [`ReplyLayout`] (a `get_ok`'s descriptors, for a receiver
//! that reads the data frames itself).

use bytes::Bytes;

use super::descriptor::{field_map, named_map, parse_descriptor};
use super::envelope::envelope;
use super::extras::versions_bin;
use super::frames::Frames;
use super::keys::{keyed, limit, need, single_uint};
use super::stats::stat_entries;
use crate::native::layout::{FieldLayout, LayoutMemo, ReplyLayout};
use crate::native::{Error, Limits, Reply, STATS_MAX_DEPTH, WireField};

/// A reply's frame 0 alone: a `get_ok`'s descriptors, checked in
/// themselves but not against data frames (a receiver checks each range
/// against the frame it arrives in, and that every frame is used); any
/// other reply decoded whole (they carry no data frames).
pub(in crate::native) fn reply_layout(
    frame0: &Bytes,
    limits: &Limits,
) -> Result<(u64, ReplyLayout), Error> {
    reply_layout_memo(frame0, limits, None)
}

/// [`reply_layout`], a get_ok's body first compared with the one `memo`
/// holds: the same bytes give the same fields, which are cloned from the
/// memo instead of read again. A get_ok of regular fields only, whose body
/// is the envelope's last key and at most [`LayoutMemo::MAX_BODY`] bytes,
/// is kept for the next.
pub(in crate::native) fn reply_layout_memo(
    frame0: &Bytes,
    limits: &Limits,
    mut memo: Option<&mut LayoutMemo>,
) -> Result<(u64, ReplyLayout), Error> {
    let frames = std::slice::from_ref(frame0);
    let (id, op, mut r, tail) = envelope(frames, limits, None)?;
    if op != "get_ok" {
        return reply(frames, limits).map(|(id, reply)| (id, ReplyLayout::Other(reply)));
    }
    // The body's bytes, when it runs to the end of frame 0.
    let body = tail
        .body_last()
        .then(|| &frame0[frame0.len() - r.remaining()..]);
    if let (Some(memo), Some(body)) = (memo.as_deref_mut(), body)
        && let Some(fields) = memo.get(body, limits)
    {
        return Ok((id, ReplyLayout::GetOk(fields)));
    }
    const MAP: &str = "a get_ok body";
    let mut fields = None;
    keyed(&mut r, MAP, ["fields"], |_, r| {
        named_map(r, limits, crate::names::shared_name, |r| {
            parse_descriptor(r, frame0, limits)
        })
        .map(|f| fields = Some(f))
    })?;
    tail.check(&r)?;
    let fields = need(fields, MAP, "fields")?;
    same_rows(&fields, FieldLayout::rows)?;
    if let (Some(memo), Some(body)) = (memo, body) {
        memo.keep(body, limits, &fields);
    }
    Ok((id, ReplyLayout::GetOk(fields)))
}

pub(in crate::native) fn reply(frames: &[Bytes], limits: &Limits) -> Result<(u64, Reply), Error> {
    let (id, op, mut r, tail) = envelope(frames, limits, None)?;
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
    tail.check(&r)?;
    data.all_used()?;
    Ok((id, reply))
}

/// Every field of a get_ok has the same number of rows as the first.
fn same_rows<N: AsRef<str>, T>(fields: &[(N, T)], rows: impl Fn(&T) -> u64) -> Result<(), Error> {
    if let Some((_, first)) = fields.first() {
        let expected = rows(first);
        if let Some((name, f)) = fields.iter().find(|(_, f)| rows(f) != expected) {
            return Err(Error::RowCount {
                rows: rows(f),
                expected,
            }
            .in_field(name.as_ref()));
        }
    }
    Ok(())
}
