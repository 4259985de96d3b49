//! The one msgpack reader both protocols use (TransferQueue's frame 0 and
//! `stowage/1`'s envelope), and the one writer ([`Writer`]).
//!
//! The reader is a cursor over one buffer that never allocates:
//! - every declared length (str, bin, ext, array, map) is checked against
//!   the bytes that remain before anything is done with it, so a header
//!   declaring 2^32-1 items fails at once and any input is read in time
//!   linear in its length; a caller may size an allocation from a count it
//!   hands out (after its own limit check) without trusting the sender;
//! - nesting is bounded by the depth each walk is given ([`TQ_MAX_DEPTH`],
//!   [`NATIVE_MAX_DEPTH`]);
//! - strings, byte strings and ext payloads are borrowed from the buffer
//!   and come with their offsets, so a caller keeps them as zero-copy
//!   [`Bytes`] slices of the frame ([`Reader::slice`]), and a value can be
//!   kept as its exact bytes;
//! - a str or bin says whether it used its shortest header
//!   ([`Item::Str::canonical`]), so TransferQueue values that re-encode
//!   byte for byte are told from those that must be kept verbatim.
//!
//! Why not `rmp-serde` for the envelopes, bodies and replies: measured with
//! rmp-serde 1.3.1 (debug build, this 2-core machine) by the probes in
//! `msgpack/serde_probe.rs`, which assert what they saw:
//! - depth: its default limit (`depth: 1024` in its `decode.rs`) is 1024
//!   levels, one recursion each; 1,000 nested arrays (a 1,001-byte
//!   input) overflow a 2 MiB thread stack (a tokio worker's default) and
//!   abort the process, before the limit is reached. A stack overflow cannot be caught, so one hostile frame 0
//!   would take `stowd` down. Ours stop at 32 and 64 levels.
//! - lengths: a declared 2^32-1-element array is not preallocated, but the
//!   items are read until the input ends: over 1 MiB of items it took
//!   1.6 s to fail (and grew a `Vec` to 4 MiB on the way); ours refuses the
//!   header before reading an item.
//! - offsets: a visitor gets no byte offsets, and errors name none
//!   (`InvalidDataRead(UnexpectedEof)`), while the TransferQueue and
//!   `stowage/1` error replies carry one; a value cannot be kept as its
//!   exact bytes (`Value::Msgpack`), and a zero-copy [`Bytes`] slice of a
//!   borrowed `&[u8]` can only be recovered by pointer arithmetic
//!   (`Bytes::slice_ref`).
//! - header width: `d9 02 'hi'` (str8) and `a2 'hi'` (fixstr) both decode to
//!   `"hi"`, so the TransferQueue codec could not tell which values
//!   re-encode byte for byte.
//! - what it does keep: `&str`, `&[u8]` and ext payloads (through its
//!   `_ExtStruct` newtype convention) borrow from the input.
//!
//! So both codecs keep this reader over [`rmp`]'s markers and encoders, and
//! `rmp-serde` is a dev-dependency that the probes pin down: if a later
//! version bounds depth without recursion or exposes offsets, the probes
//! are where to see it.

mod write;

#[cfg(test)]
mod serde_probe;
#[cfg(test)]
mod tests;

use bytes::Bytes;
use rmp::Marker;

pub use write::{TooLong, Writer};

/// Deepest nesting of arrays and maps accepted in a TransferQueue frame 0.
pub const TQ_MAX_DEPTH: usize = 64;

/// Deepest nesting accepted inside an opaque `stowage/1` value
/// (`Value::Msgpack`); the envelope around it may add a few levels.
pub const NATIVE_MAX_DEPTH: usize = 32;

/// A malformed input, or a value of the wrong type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MsgpackError {
    /// Not well-formed msgpack.
    Malformed {
        /// Byte offset in the buffer where the problem was found.
        offset: usize,
        /// What was wrong.
        reason: &'static str,
    },
    /// Well-formed, but not the type a typed read asked for.
    WrongType {
        /// The key or role of the value.
        key: &'static str,
        /// What it must be.
        expected: &'static str,
    },
}

/// One MessagePack item. Containers carry their length only (already
/// checked against the bytes left); str, bin and ext carry their payload.
#[derive(Clone, Debug, PartialEq)]
pub enum Item<'a> {
    /// nil.
    Nil,
    /// true / false.
    Bool(bool),
    /// A non-negative integer.
    UInt(u64),
    /// A negative integer.
    Int(i64),
    /// A float32 or float64.
    Float(f64),
    /// A UTF-8 string; `canonical` is true when it used the shortest header,
    /// so that writing it again gives the same bytes.
    Str {
        /// The text.
        s: &'a str,
        /// Shortest header used.
        canonical: bool,
    },
    /// A byte string, with the same `canonical` meaning.
    Bin {
        /// The bytes.
        data: &'a [u8],
        /// Offset of the bytes in the buffer.
        start: usize,
        /// Shortest header used.
        canonical: bool,
    },
    /// An array header with its item count.
    Array(usize),
    /// A map header with its entry count.
    Map(usize),
    /// An extension value.
    Ext {
        /// The ext type code.
        code: i8,
        /// The payload.
        data: &'a [u8],
        /// Offset of the payload in the buffer.
        start: usize,
    },
}

/// A cursor over one msgpack buffer.
pub struct Reader<'a> {
    buf: &'a [u8],
    owner: Option<&'a Bytes>,
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader at offset `pos` of `buf`.
    pub fn new(buf: &'a [u8], pos: usize) -> Self {
        Reader {
            buf,
            owner: None,
            pos,
        }
    }

    /// A reader at offset `pos` of a frame whose parts [`Reader::slice`]
    /// hands out without copying.
    pub fn bytes(buf: &'a Bytes, pos: usize) -> Self {
        Reader {
            buf,
            owner: Some(buf),
            pos,
        }
    }

    /// The whole buffer being read.
    pub fn buf(&self) -> &'a [u8] {
        self.buf
    }

    /// Current offset.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Moves the cursor back to an offset it has already passed.
    pub fn set_pos(&mut self, pos: usize) {
        self.pos = pos.min(self.buf.len());
    }

    /// True when every byte was consumed.
    pub fn at_end(&self) -> bool {
        self.pos >= self.buf.len()
    }

    /// Bytes not yet consumed.
    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    /// Bytes `start..end` of the buffer: a zero-copy slice of the frame for
    /// a reader made with [`Reader::bytes`], a copy otherwise.
    pub fn slice(&self, start: usize, end: usize) -> Bytes {
        match self.owner {
            Some(b) => b.slice(start..end),
            None => Bytes::copy_from_slice(&self.buf[start..end]),
        }
    }

    /// A [`MsgpackError::Malformed`] at the current offset.
    pub fn malformed(&self, reason: &'static str) -> MsgpackError {
        MsgpackError::Malformed {
            offset: self.pos,
            reason,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        if n > self.remaining() {
            return Err(self.malformed("truncated"));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    /// Reads an `n`-byte big-endian unsigned number (n <= 8).
    fn be(&mut self, n: usize) -> Result<u64, MsgpackError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn marker(&mut self) -> Result<Marker, MsgpackError> {
        let b = self.take(1)?[0];
        match Marker::from_u8(b) {
            Marker::Reserved => {
                self.pos -= 1;
                Err(self.malformed("reserved marker 0xc1"))
            }
            m => Ok(m),
        }
    }

    /// The next marker, not consumed.
    /// Whether the next value is a map (without consuming anything).
    pub fn next_is_map(&self) -> bool {
        matches!(
            self.peek(),
            Ok(Marker::FixMap(_) | Marker::Map16 | Marker::Map32)
        )
    }

    fn peek(&self) -> Result<Marker, MsgpackError> {
        Reader {
            buf: self.buf,
            owner: None,
            pos: self.pos,
        }
        .marker()
    }

    /// A count of `n` items, each at least `min_bytes` long, must fit.
    fn count(&self, n: u64, min_bytes: u64) -> Result<usize, MsgpackError> {
        match n.checked_mul(min_bytes) {
            Some(need) if need <= self.remaining() as u64 => Ok(n as usize),
            _ => Err(self.malformed("count exceeds the remaining bytes")),
        }
    }

    /// A `width`-byte count of items at least `min_bytes` long each.
    fn counted(&mut self, width: usize, min_bytes: u64) -> Result<usize, MsgpackError> {
        let n = self.be(width)?;
        self.count(n, min_bytes)
    }

    fn utf8(&mut self, n: usize) -> Result<&'a str, MsgpackError> {
        let start = self.pos;
        let raw = self.take(n)?;
        Reader::utf8_at(raw, start)
    }

    /// `raw` (a str's bytes, read from `offset`) as UTF-8, or the error
    /// [`Reader::str`] gives for it.
    pub fn utf8_at(raw: &[u8], offset: usize) -> Result<&str, MsgpackError> {
        std::str::from_utf8(raw).map_err(|_| MsgpackError::Malformed {
            offset,
            reason: "invalid UTF-8 in a str",
        })
    }

    /// Reads the next item header (and the payload of str, bin and ext).
    pub fn item(&mut self) -> Result<Item<'a>, MsgpackError> {
        let marker = self.marker()?;
        Ok(match marker {
            Marker::FixPos(v) => Item::UInt(v.into()),
            Marker::FixNeg(v) => Item::Int(v.into()),
            Marker::Null => Item::Nil,
            Marker::True => Item::Bool(true),
            Marker::False => Item::Bool(false),
            Marker::U8 => Item::UInt(self.be(1)?),
            Marker::U16 => Item::UInt(self.be(2)?),
            Marker::U32 => Item::UInt(self.be(4)?),
            Marker::U64 => Item::UInt(self.be(8)?),
            Marker::I8 => Item::Int(self.be(1)? as u8 as i8 as i64),
            Marker::I16 => Item::Int(self.be(2)? as u16 as i16 as i64),
            Marker::I32 => Item::Int(self.be(4)? as u32 as i32 as i64),
            Marker::I64 => Item::Int(self.be(8)? as i64),
            Marker::F32 => Item::Float(f32::from_bits(self.be(4)? as u32).into()),
            Marker::F64 => Item::Float(f64::from_bits(self.be(8)?)),
            Marker::FixStr(n) => Item::Str {
                s: self.utf8(n.into())?,
                canonical: true,
            },
            Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                let (width, min) = match marker {
                    Marker::Str8 => (1, 32),
                    Marker::Str16 => (2, 0x100),
                    _ => (4, 0x1_0000),
                };
                let n = self.be(width)? as usize;
                Item::Str {
                    s: self.utf8(n)?,
                    canonical: n >= min,
                }
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let (width, min) = match marker {
                    Marker::Bin8 => (1, 0),
                    Marker::Bin16 => (2, 0x100),
                    _ => (4, 0x1_0000),
                };
                let n = self.be(width)? as usize;
                let start = self.pos;
                Item::Bin {
                    data: self.take(n)?,
                    start,
                    canonical: n >= min,
                }
            }
            Marker::FixArray(n) => Item::Array(self.count(n.into(), 1)?),
            Marker::Array16 => Item::Array(self.counted(2, 1)?),
            Marker::Array32 => Item::Array(self.counted(4, 1)?),
            Marker::FixMap(n) => Item::Map(self.count(n.into(), 2)?),
            Marker::Map16 => Item::Map(self.counted(2, 2)?),
            Marker::Map32 => Item::Map(self.counted(4, 2)?),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => self.ext_len(1)?,
            Marker::Ext16 => self.ext_len(2)?,
            Marker::Ext32 => self.ext_len(4)?,
            Marker::Reserved => unreachable!("marker() refuses 0xc1"),
        })
    }

    fn ext_len(&mut self, width: usize) -> Result<Item<'a>, MsgpackError> {
        let n = self.be(width)? as usize;
        self.ext(n)
    }

    fn ext(&mut self, n: usize) -> Result<Item<'a>, MsgpackError> {
        let code = self.take(1)?[0] as i8;
        let start = self.pos;
        let data = self.take(n)?;
        Ok(Item::Ext { code, data, start })
    }

    /// Walks one complete value, calling `on_ext(code, payload, offset)` for
    /// every ext value inside it. Strings are validated as UTF-8 and at most
    /// `depth` levels of arrays and maps are entered.
    pub fn visit<E: From<MsgpackError>>(
        &mut self,
        depth: usize,
        on_ext: &mut dyn FnMut(i8, &'a [u8], usize) -> Result<(), E>,
    ) -> Result<(), E> {
        if depth == 0 {
            return Err(self.malformed("nesting too deep").into());
        }
        match self.item()? {
            Item::Array(n) => {
                for _ in 0..n {
                    self.visit(depth - 1, on_ext)?;
                }
            }
            Item::Map(n) => {
                for _ in 0..2 * n {
                    self.visit(depth - 1, on_ext)?;
                }
            }
            Item::Ext { code, data, start } => on_ext(code, data, start)?,
            _ => {}
        }
        Ok(())
    }
}

mod typed;
