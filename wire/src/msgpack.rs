//! Just enough MessagePack for the TransferQueue envelope: a bounded,
//! position-tracking reader (so a value can be kept as its exact bytes) and an
//! infallible writer over `rmp` that picks the same encodings as `msgspec`
//! (smallest int, fixstr/str8/16/32, float64 `cb`, fixext for sizes 1/2/4/8/16).

use bytes::Bytes;
use rmp::Marker;
use rmp::encode::ByteBuf;

/// Deepest nesting of arrays and maps accepted in frame 0.
pub const MAX_DEPTH: usize = 64;

/// A malformed MessagePack input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MsgpackError {
    /// Byte offset in the buffer where the problem was found.
    pub offset: usize,
    /// What was wrong.
    pub reason: &'static str,
}

/// One MessagePack item. Containers carry their length only; str, bin and
/// ext carry their payload (already bounds-checked).
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
        /// Offset of the bytes in the frame.
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
        /// Offset of the payload in the frame.
        start: usize,
    },
}

/// A cursor over one frame.
pub struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader at offset `pos` of `buf`.
    pub fn new(buf: &'a Bytes, pos: usize) -> Self {
        Reader { buf, pos }
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

    /// A zero-copy slice of the underlying frame.
    pub fn slice(&self, start: usize, end: usize) -> Bytes {
        self.buf.slice(start..end)
    }

    fn err(&self, reason: &'static str) -> MsgpackError {
        MsgpackError { offset: self.pos, reason }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        let buf: &'a [u8] = self.buf.as_ref();
        if n > buf.len() - self.pos {
            return Err(self.err("truncated"));
        }
        let s = &buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64, MsgpackError> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Reads the next item header (and the payload of str, bin and ext).
    pub fn item(&mut self) -> Result<Item<'a>, MsgpackError> {
        let at = self.pos;
        let marker = Marker::from_u8(self.take(1)?[0]);
        let item = match marker {
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
            Marker::FixStr(n) => self.str(n.into(), true)?,
            Marker::Str8 => {
                let n = self.be(1)? as usize;
                self.str(n, n >= 32)?
            }
            Marker::Str16 => {
                let n = self.be(2)? as usize;
                self.str(n, n > 0xff)?
            }
            Marker::Str32 => {
                let n = self.be(4)? as usize;
                self.str(n, n > 0xffff)?
            }
            Marker::Bin8 => self.bin(1, 0)?,
            Marker::Bin16 => self.bin(2, 0x100)?,
            Marker::Bin32 => self.bin(4, 0x1_0000)?,
            Marker::FixArray(n) => Item::Array(n.into()),
            Marker::Array16 => self.container(2, false)?,
            Marker::Array32 => self.container(4, false)?,
            Marker::FixMap(n) => Item::Map(n.into()),
            Marker::Map16 => self.container(2, true)?,
            Marker::Map32 => self.container(4, true)?,
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 | Marker::Ext16 | Marker::Ext32 => {
                let width = match marker {
                    Marker::Ext8 => 1,
                    Marker::Ext16 => 2,
                    _ => 4,
                };
                let n = self.be(width)? as usize;
                self.ext(n)?
            }
            Marker::Reserved => return Err(MsgpackError { offset: at, reason: "reserved marker 0xc1" }),
        };
        if let Item::Array(n) = item
            && n > self.remaining()
        {
            return Err(self.err("array length exceeds the remaining input"));
        }
        if let Item::Map(n) = item
            && n.saturating_mul(2) > self.remaining()
        {
            return Err(self.err("map length exceeds the remaining input"));
        }
        Ok(item)
    }

    fn str(&mut self, n: usize, canonical: bool) -> Result<Item<'a>, MsgpackError> {
        let at = self.pos;
        let raw = self.take(n)?;
        let s = std::str::from_utf8(raw).map_err(|_| MsgpackError { offset: at, reason: "invalid UTF-8 in str" })?;
        Ok(Item::Str { s, canonical })
    }

    fn bin(&mut self, width: usize, min: usize) -> Result<Item<'a>, MsgpackError> {
        let n = self.be(width)? as usize;
        let start = self.pos;
        let data = self.take(n)?;
        Ok(Item::Bin { data, start, canonical: n >= min })
    }

    fn container(&mut self, width: usize, map: bool) -> Result<Item<'a>, MsgpackError> {
        let n = self.be(width)? as usize;
        Ok(if map { Item::Map(n) } else { Item::Array(n) })
    }

    fn ext(&mut self, n: usize) -> Result<Item<'a>, MsgpackError> {
        let code = self.take(1)?[0] as i8;
        let start = self.pos;
        let data = self.take(n)?;
        Ok(Item::Ext { code, data, start })
    }

    /// Skips one complete value, calling `on_ext(code, payload, offset)` for
    /// every ext value inside it. Strings are validated as UTF-8 and nesting
    /// is limited to [`MAX_DEPTH`] (counting from `depth`).
    pub fn skip<E: From<MsgpackError>>(
        &mut self,
        depth: usize,
        on_ext: &mut dyn FnMut(i8, &'a [u8], usize) -> Result<(), E>,
    ) -> Result<(), E> {
        if depth >= MAX_DEPTH {
            return Err(self.err("nesting too deep").into());
        }
        match self.item()? {
            Item::Array(n) => {
                for _ in 0..n {
                    self.skip(depth + 1, on_ext)?;
                }
            }
            Item::Map(n) => {
                for _ in 0..n.saturating_mul(2) {
                    self.skip(depth + 1, on_ext)?;
                }
            }
            Item::Ext { code, data, start } => on_ext(code, data, start)?,
            _ => {}
        }
        Ok(())
    }
}

/// An infallible MessagePack writer.
#[derive(Default)]
pub struct Writer {
    buf: ByteBuf,
}

fn len32(n: usize) -> u32 {
    // A message cannot hold 4 Gi items or a 4 GiB string in frame 0.
    debug_assert!(u32::try_from(n).is_ok());
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Writer {
    /// An empty writer.
    pub fn new() -> Self {
        Writer::default()
    }

    /// The bytes written so far.
    pub fn into_bytes(self) -> Bytes {
        Bytes::from(self.buf.into_vec())
    }

    /// Map header.
    pub fn map(&mut self, len: usize) {
        let Ok(_) = rmp::encode::write_map_len(&mut self.buf, len32(len));
    }

    /// Array header.
    pub fn array(&mut self, len: usize) {
        let Ok(_) = rmp::encode::write_array_len(&mut self.buf, len32(len));
    }

    /// A str in its shortest form.
    pub fn str(&mut self, s: &str) {
        let Ok(_) = rmp::encode::write_str_len(&mut self.buf, len32(s.len()));
        self.raw(s.as_bytes());
    }

    /// A bin in its shortest form.
    pub fn bin(&mut self, b: &[u8]) {
        let Ok(_) = rmp::encode::write_bin_len(&mut self.buf, len32(b.len()));
        self.raw(b);
    }

    /// nil.
    pub fn nil(&mut self) {
        let Ok(()) = rmp::encode::write_nil(&mut self.buf);
    }

    /// A non-negative int in its shortest form.
    pub fn uint(&mut self, v: u64) {
        let Ok(_) = rmp::encode::write_uint(&mut self.buf, v);
    }

    /// A float64 (`cb`), as msgspec writes every Python float.
    pub fn f64(&mut self, v: f64) {
        let Ok(()) = rmp::encode::write_f64(&mut self.buf, v);
    }

    /// An ext value (fixext for 1/2/4/8/16 bytes, else ext8/16/32).
    pub fn ext(&mut self, code: i8, payload: &[u8]) {
        let Ok(_) = rmp::encode::write_ext_meta(&mut self.buf, len32(payload.len()), code);
        self.raw(payload);
    }

    /// Bytes that are already MessagePack.
    pub fn raw(&mut self, b: &[u8]) {
        self.buf.as_mut_vec().extend_from_slice(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(bytes: &'static [u8]) -> Item<'static> {
        let b: &'static Bytes = Box::leak(Box::new(Bytes::from_static(bytes)));
        Reader::new(b, 0).item().unwrap()
    }

    #[test]
    fn canonical_forms_are_recognised() {
        assert_eq!(item(b"\xa2hi"), Item::Str { s: "hi", canonical: true });
        assert_eq!(item(b"\xd9\x02hi"), Item::Str { s: "hi", canonical: false });
        assert!(matches!(item(b"\xc4\x01x"), Item::Bin { canonical: true, .. }));
        assert!(matches!(item(b"\xc5\x00\x01x"), Item::Bin { canonical: false, .. }));
        assert_eq!(item(b"\xd0\x80"), Item::Int(-128));
        assert_eq!(item(b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff"), Item::UInt(u64::MAX));
    }

    #[test]
    fn declared_lengths_are_checked() {
        let b = Bytes::from_static(b"\xdd\xff\xff\xff\xff\x01");
        assert!(Reader::new(&b, 0).item().is_err());
        let b = Bytes::from_static(b"\xdb\x00\x00\x01\x00ab");
        assert!(Reader::new(&b, 0).item().is_err());
        let b = Bytes::from_static(b"\xc7\xff\x03ab");
        assert!(Reader::new(&b, 0).item().is_err());
    }

    #[test]
    fn writer_matches_msgspec_choices() {
        let mut w = Writer::new();
        w.uint(5);
        w.uint(300);
        w.str(&"x".repeat(40));
        w.ext(3, &[0; 4]);
        w.ext(3, &[0; 5]);
        let out = w.into_bytes();
        assert_eq!(&out[..4], b"\x05\xcd\x01\x2c");
        assert_eq!(&out[4..6], b"\xd9\x28");
        assert_eq!(&out[46..48], b"\xd6\x03");
        assert_eq!(&out[52..55], b"\xc7\x05\x03");
    }
}
