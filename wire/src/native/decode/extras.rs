//! The envelope's shared-memory and peer keys, as [`Extras`]: `segments`,
//! `channel`, `unit`, `same_node`, `with_versions`, `incarnation` and
//! `versions` (a versions bin, which a `versions_ok` body holds too).

use std::ops::Range;

use super::envelope::ENVELOPE_DEPTH;
use super::keys::{limit, tuple};
use crate::msgpack::Reader;
use crate::native::{Error, Extras, Limits};

/// Longest `channel` token an envelope may carry.
const MAX_CHANNEL_TOKEN: usize = 64;

/// The shared-memory keys of an envelope, and where the value of its
/// first `body` key lies (skipped here, so that [`super::envelope`] need
/// not walk it again).
pub(in crate::native) fn extras(
    frame0: &[u8],
    limits: &Limits,
) -> Result<(Extras, Option<Range<usize>>), Error> {
    const MAP: &str = "the envelope";
    let mut r = Reader::new(frame0, 0);
    let mut out = Extras::default();
    let mut body = None;
    let n = r.map_len(MAP)?;
    for k in 0..n {
        // Keys compared as bytes, as in `super::envelope`.
        match r.str_bytes("an envelope key")? {
            // The last key: nothing after it to find, and the envelope's
            // reader does not walk a last body either.
            b"body" if k + 1 == n => break,
            b"segments" => {
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
            b"channel" => {
                let token = r.str("channel")?;
                if token.is_empty() || token.len() > MAX_CHANNEL_TOKEN {
                    return Err(Error::WrongType {
                        key: "channel",
                        expected: "a channel token (1 to 64 characters)",
                    });
                }
                out.channel = Some(token.to_owned());
            }
            b"unit" => out.unit = Some(r.uint("unit")?),
            b"with_versions" => {
                out.with_versions = r.bool_value()?.ok_or(Error::WrongType {
                    key: "with_versions",
                    expected: "a bool",
                })?
            }
            b"incarnation" => {
                let incarnation = r.uint("incarnation")?;
                let versions = out.versions.get_or_insert((0, Vec::new()));
                versions.0 = incarnation;
            }
            b"versions" => {
                let v = versions_bin(&mut r, limits)?;
                out.versions.get_or_insert((0, Vec::new())).1 = v;
            }
            b"same_node" => {
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
            key => {
                // The envelope's own keys are ASCII; any other is checked
                // as `Reader::str` would have.
                if !matches!(key, b"body" | b"proto" | b"op" | b"id") {
                    Reader::utf8_at(key, r.pos() - key.len())?;
                }
                let value = r.skip(ENVELOPE_DEPTH)?;
                if key == b"body" && body.is_none() {
                    body = Some(value);
                }
            }
        }
    }
    Ok((out, body))
}

/// A `versions` bin: 8 bytes per version, little-endian, at most one per
/// row and field a request may name.
pub(super) fn versions_bin(r: &mut Reader<'_>, limits: &Limits) -> Result<Vec<u64>, Error> {
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
