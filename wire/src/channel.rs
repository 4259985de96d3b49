//! The same-node descriptor channel's messages: pure encode and decode, no
//! I/O. The protocol page ("Same-node shared memory", "The descriptor
//! channel") specifies them; this module is their reference
//! implementation. `stowd` writes them on a Unix stream socket with
//! descriptors attached (`SCM_RIGHTS`, in `stowage-host`'s `shm::channel`);
//! the Python client's Rust core (`clients/python/core`, its `channel`
//! module) reads them with this decoder.
//!
//! Messages go one way only, `stowd` to client. Each is a 4-byte
//! little-endian body length, then the body: one msgpack map.
//!
//! | message | body | descriptors attached |
//! |---|---|---|
//! | [`Hello`], the first | `{"token": str}`, the token 1 to 64 bytes | none |
//! | [`Descriptors`], every later one | `{"id": uint, "names": [str, ...]}` | one per name, in order |
//!
//! `token` is what a client names in the envelope key `channel` of its
//! same-node gets and leases; `id` is the request whose descriptors these
//! are, and `names` the segments they are (as the reply names them).
//!
//! **Encoding.** The keys in the order above, every value in its shortest
//! msgpack form (fixmap, fixstr/str8/16/32, the smallest uint, fixarray or
//! array16/32). `Hello { token: "ab" }` is these 14 bytes:
//!
//! ```text
//! 0a 00 00 00        body length 10
//! 81                 map of 1
//! a5 74 6f 6b 65 6e  "token"
//! a2 61 62           "ab"
//! ```
//!
//! and `Descriptors { id: 7, names: ["s1"] }` is `0f 00 00 00` (15), then
//! `82 a2 "id" 07 a5 "names" 91 a2 "s1"`.
//!
//! **Decoding** takes the body alone: a reader reads the 4 length bytes,
//! checks them with [`body_len`], then reads exactly that many bytes, and so
//! gets exactly that message's descriptors. Keys may come in any order and
//! values in any header width (a str8 token, a uint64 id); refused are
//! anything but a map, a missing, unknown or repeated key, a value of
//! another type (a negative or non-integer `id`, a bin where a str
//! goes), a token that is empty or longer than [`MAX_TOKEN_BYTES`], a body,
//! name count or name longer than its [`Limits`] bound, malformed msgpack
//! (truncated, bad UTF-8) and bytes after the map. Every count is checked
//! against the bytes left before anything is allocated from it: the crate's
//! one bounded msgpack [`Reader`].

use crate::msgpack::{MsgpackError, Reader, TooLong, Writer};

#[cfg(test)]
mod tests;

/// Bytes of the little-endian body length that starts every message.
pub const LEN_BYTES: usize = 4;

/// Longest token a [`Hello`] may carry (as long as the envelope key
/// `channel` that names it may be).
pub const MAX_TOKEN_BYTES: usize = 64;

/// Receiver limits, checked before anything is allocated from a declared
/// size. A violation is an [`Error::TooLarge`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes in a message body.
    pub max_body_bytes: u64,
    /// Most names (so descriptors) in one [`Descriptors`].
    pub max_names: u64,
    /// Most bytes in one segment name.
    pub max_name_bytes: u64,
}

impl Limits {
    /// The defaults: 64 MiB bodies (as the Python client takes), 2^20
    /// names (a `get_ok` names each of its segments once, and has at most
    /// `stowage/1`'s default 2^20 frames), names of 255 bytes (`stowd`'s are
    /// `s` and at most 16 hex digits).
    pub const DEFAULT: Limits = Limits {
        max_body_bytes: 64 << 20,
        max_names: 1 << 20,
        max_name_bytes: 255,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// Why a channel message could not be decoded or encoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The body is not well-formed msgpack: truncated, a reserved marker,
    /// bad UTF-8, a count larger than the bytes left, trailing bytes.
    #[error("malformed msgpack at byte {offset} of a channel message body: {reason}")]
    Malformed { offset: usize, reason: &'static str },
    /// A value has the wrong msgpack type, or a token the wrong length.
    #[error("{key} must be {expected}")]
    WrongType {
        key: &'static str,
        expected: &'static str,
    },
    /// A required key is missing.
    #[error("{map} has no key {key:?}")]
    MissingKey {
        map: &'static str,
        key: &'static str,
    },
    /// A key the message does not have (its first 64 characters).
    #[error("{map} has an unexpected key {key:?}")]
    UnknownKey { map: &'static str, key: String },
    /// A key appears twice.
    #[error("{map} has the key {key:?} twice")]
    DuplicateKey {
        map: &'static str,
        key: &'static str,
    },
    /// A length or count above a [`Limits`] bound.
    #[error("{what} is {value}, the limit is {limit}")]
    TooLarge {
        what: &'static str,
        value: u64,
        limit: u64,
    },
    /// Encoder side: a body or a count above 2^32-1.
    #[error("cannot encode a channel message: {0}")]
    Unencodable(TooLong),
}

impl From<MsgpackError> for Error {
    fn from(e: MsgpackError) -> Self {
        match e {
            MsgpackError::Malformed { offset, reason } => Error::Malformed { offset, reason },
            MsgpackError::WrongType { key, expected } => Error::WrongType { key, expected },
        }
    }
}

impl From<TooLong> for Error {
    fn from(e: TooLong) -> Self {
        Error::Unencodable(e)
    }
}

/// The greeting, the first message of every channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello<'a> {
    /// The channel's token (`stowd` draws 32 lowercase hex digits).
    pub token: &'a str,
}

impl<'a> Hello<'a> {
    /// The whole message: length, then body.
    pub fn encode(&self) -> Result<Vec<u8>, Error> {
        let mut w = message();
        w.map(1);
        w.kv_str("token", self.token);
        finish(w)
    }

    /// Decodes a greeting's body (the bytes after its length).
    pub fn decode(body: &'a [u8]) -> Result<Hello<'a>, Error> {
        const MAP: &str = "the channel greeting";
        let mut r = Reader::new(body, 0);
        let mut token = None;
        for _ in 0..r.map_len(MAP)? {
            match r.str("a greeting key")? {
                "token" => {
                    let t = r.str("token")?;
                    if t.is_empty() || t.len() > MAX_TOKEN_BYTES {
                        return Err(Error::WrongType {
                            key: "token",
                            expected: "a str of 1 to 64 bytes",
                        });
                    }
                    once(&mut token, t, MAP, "token")?;
                }
                other => return Err(unknown(MAP, other)),
            }
        }
        end(&r)?;
        Ok(Hello {
            token: need(token, MAP, "token")?,
        })
    }
}

/// The descriptors of one request's segments; the message carries one
/// descriptor per name, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptors<'a> {
    /// The request they answer.
    pub id: u64,
    /// The segments, as the reply (or `lease_ok`) names them.
    pub names: Vec<&'a str>,
}

impl<'a> Descriptors<'a> {
    /// The whole message: length, then body. Limits are the receiver's to
    /// check; only lengths above 2^32-1 are refused here.
    pub fn encode(&self) -> Result<Vec<u8>, Error> {
        let mut w = message();
        w.map(2);
        w.kv_uint("id", self.id);
        w.str("names");
        w.array(self.names.len());
        for name in &self.names {
            w.str(name);
        }
        finish(w)
    }

    /// Decodes a descriptor message's body (the bytes after its length).
    pub fn decode(body: &'a [u8], limits: &Limits) -> Result<Descriptors<'a>, Error> {
        const MAP: &str = "a channel message";
        let mut r = Reader::new(body, 0);
        let (mut id, mut names) = (None, None);
        for _ in 0..r.map_len(MAP)? {
            match r.str("a channel message key")? {
                "id" => {
                    let v = r.uint("id")?;
                    once(&mut id, v, MAP, "id")?;
                }
                "names" => {
                    let v = read_names(&mut r, limits)?;
                    once(&mut names, v, MAP, "names")?;
                }
                other => return Err(unknown(MAP, other)),
            }
        }
        end(&r)?;
        Ok(Descriptors {
            id: need(id, MAP, "id")?,
            names: need(names, MAP, "names")?,
        })
    }
}

/// The length of the body that follows the 4-byte length `prefix`, if
/// within `limits`: how many bytes to read next.
pub fn body_len(prefix: [u8; LEN_BYTES], limits: &Limits) -> Result<usize, Error> {
    let len = u32::from_le_bytes(prefix);
    check(
        "a channel message body's length",
        len as usize,
        limits.max_body_bytes,
    )?;
    Ok(len as usize)
}

/// A writer holding a placeholder for the body length.
fn message() -> Writer {
    let mut w = Writer::new();
    w.raw(&[0; LEN_BYTES]);
    w
}

/// The message `w` wrote, its body length filled in.
fn finish(w: Writer) -> Result<Vec<u8>, Error> {
    let mut out = w.finish()?;
    let len = u32::try_from(out.len() - LEN_BYTES).map_err(|_| TooLong("channel message"))?;
    out[..LEN_BYTES].copy_from_slice(&len.to_le_bytes());
    Ok(out)
}

/// An array of segment names, bounded by `limits`.
fn read_names<'a>(r: &mut Reader<'a>, limits: &Limits) -> Result<Vec<&'a str>, Error> {
    let n = r.array_len("names")?;
    check("a channel message's name count", n, limits.max_names)?;
    let mut names = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str("a segment name")?;
        check("a segment name's length", name.len(), limits.max_name_bytes)?;
        names.push(name);
    }
    Ok(names)
}

fn check(what: &'static str, n: usize, limit: u64) -> Result<(), Error> {
    if n as u64 > limit {
        return Err(Error::TooLarge {
            what,
            value: n as u64,
            limit,
        });
    }
    Ok(())
}

fn once<T>(slot: &mut Option<T>, v: T, map: &'static str, key: &'static str) -> Result<(), Error> {
    if slot.replace(v).is_some() {
        return Err(Error::DuplicateKey { map, key });
    }
    Ok(())
}

fn need<T>(slot: Option<T>, map: &'static str, key: &'static str) -> Result<T, Error> {
    // Not `ok_or`: an error made ahead, on every field's every key, and
    // dropped (a 10-field put's descriptors spent 2,100 instructions
    // dropping errors they never returned, callgrind).
    match slot {
        Some(v) => Ok(v),
        None => Err(Error::MissingKey { map, key }),
    }
}

fn unknown(map: &'static str, key: &str) -> Error {
    Error::UnknownKey {
        map,
        key: key.chars().take(64).collect(),
    }
}

/// Nothing may follow the map.
fn end(r: &Reader<'_>) -> Result<(), Error> {
    if r.at_end() {
        Ok(())
    } else {
        Err(r.malformed("trailing bytes after the body").into())
    }
}
