//! The envelope, `{"proto", "op", "id", "body"}` plus the shared-memory
//! and peer keys ([`super::extras`] reads those): the message checked
//! against the limits, the envelope read, the body left to the op's
//! reader.

use std::ops::Range;

use bytes::Bytes;

use super::keys::{need, unknown};
use crate::msgpack::{NATIVE_MAX_DEPTH as MAX_DEPTH, Reader};
use crate::native::{Error, Limits, PROTO};

/// Envelope and body nest this much deeper than an opaque value may.
pub(super) const ENVELOPE_DEPTH: usize = MAX_DEPTH + 8;

/// The `id` key of an envelope, if it can be read.
pub(in crate::native) fn id(frame0: &[u8]) -> Option<u64> {
    let mut r = Reader::new(frame0, 0);
    for _ in 0..r.map_len("the envelope").ok()? {
        if r.str("a key").ok()? == "id" {
            return r.uint("id").ok();
        }
        r.skip(ENVELOPE_DEPTH).ok()?;
    }
    None
}

/// Whether the envelope's end is still to be checked once the body is
/// read: when `body` is its last key (as every encoder here writes it),
/// the body is not walked twice (once stepped over, once read), and the
/// body's reader must end where frame 0 does ([`Tail::check`]).
#[derive(Clone, Copy, Debug)]
#[must_use]
pub(super) struct Tail(bool);

impl Tail {
    /// Whether the body is the envelope's last key: then it runs to the
    /// end of frame 0.
    pub(super) fn body_last(self) -> bool {
        self.0
    }

    /// After the body was read through `r`: no byte may follow it.
    pub(super) fn check(self, r: &Reader<'_>) -> Result<(), Error> {
        if self.0 && r.remaining() > 0 {
            return Err(r.malformed("trailing bytes after the envelope").into());
        }
        Ok(())
    }
}

/// Checks the message against the limits, reads the envelope (keys in any
/// order), and returns the id, the op, a reader positioned at the body,
/// and whether the envelope's end is checked yet ([`Tail`]). `body`, if
/// known, is where the value of the first `body` key lies in frame 0 (as
/// [`super::extras`] found it): it is stepped over, not walked.
pub(super) fn envelope<'a>(
    frames: &'a [Bytes],
    limits: &Limits,
    body_at: Option<&Range<usize>>,
) -> Result<(u64, &'a str, Reader<'a>, Tail), Error> {
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
    let mut tail = Tail(false);
    let n = r.map_len(MAP)?;
    for k in 0..n {
        // Keys compared as bytes, UTF-8 checked only for one that matches
        // none (as `keys::keyed` does): six validations a message were a
        // thirtieth of a small get's instructions in `stowd`.
        let key = r.str_bytes("an envelope key")?;
        let dup = match key {
            b"proto" => {
                let value = match r.str_bytes("proto")? {
                    v if v == PROTO.as_bytes() => PROTO,
                    v => Reader::utf8_at(v, r.pos() - v.len())?,
                };
                proto.replace(value).is_some()
            }
            b"op" => op.replace(r.str("op")?).is_some(),
            b"id" => id.replace(r.uint("id")?).is_some(),
            b"body" => {
                let value = match body_at {
                    // The last key: the rest of the frame, read once by
                    // the op's reader, which then checks the end.
                    _ if body.is_none() && k + 1 == n => {
                        tail = Tail(true);
                        let at = r.pos();
                        r.set_pos(frame0.len());
                        at..frame0.len()
                    }
                    Some(at) if body.is_none() && at.start == r.pos() => {
                        r.set_pos(at.end);
                        at.clone()
                    }
                    _ => r.skip(ENVELOPE_DEPTH)?,
                };
                body.replace(value.start).is_some()
            }
            // Shared-memory and peer keys: read by `extras`.
            b"segments" | b"same_node" | b"channel" | b"unit" | b"with_versions"
            | b"incarnation" | b"versions" => r.skip(ENVELOPE_DEPTH).map(|_| false)?,
            other => {
                let other = Reader::utf8_at(other, r.pos() - other.len())?;
                stray.get_or_insert(other);
                r.skip(ENVELOPE_DEPTH).map(|_| false)?
            }
        };
        if dup {
            return Err(Error::DuplicateKey {
                map: MAP,
                // A known key: ASCII.
                key: String::from_utf8_lossy(key).into_owned(),
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
    Ok((id, op, Reader::new(frame0, body), tail))
}
