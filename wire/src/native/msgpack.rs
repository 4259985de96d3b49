//! The msgpack subset `stowage/1` needs: a bounds-checked reader over frame 0
//! that never allocates, and a writer over [`rmp`]'s encoders.
//!
//! Every length the reader hands out has been checked against the bytes
//! that remain, so a caller may size an allocation from it (after its own
//! limit check) without trusting the sender.

use rmp::Marker;
use rmp::encode::{self, ByteBuf};

use super::Error;

/// Deepest nesting accepted inside an opaque value (`Value::Msgpack`).
pub(super) const MAX_DEPTH: usize = 32;

/// A cursor over one msgpack buffer.
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8], pos: usize) -> Self {
        Reader { buf, pos }
    }

    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    pub(super) fn malformed(&self, reason: &'static str) -> Error {
        Error::Malformed { offset: self.pos, reason }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if n > self.remaining() {
            return Err(self.malformed("truncated"));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    /// Reads an `n`-byte big-endian unsigned number (n <= 8).
    fn be(&mut self, n: usize) -> Result<u64, Error> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn marker(&mut self) -> Result<Marker, Error> {
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
    fn peek(&self) -> Result<Marker, Error> {
        Reader { buf: self.buf, pos: self.pos }.marker()
    }

    /// A count of `n` items, each at least `min_bytes` long, must fit.
    fn count(&self, n: u64, min_bytes: u64) -> Result<usize, Error> {
        match n.checked_mul(min_bytes) {
            Some(need) if need <= self.remaining() as u64 => Ok(n as usize),
            _ => Err(self.malformed("count exceeds the remaining bytes")),
        }
    }

    /// A map header; the count is checked against the remaining bytes.
    pub(super) fn map_len(&mut self, what: &'static str) -> Result<usize, Error> {
        let n = match self.marker()? {
            Marker::FixMap(n) => u64::from(n),
            Marker::Map16 => self.be(2)?,
            Marker::Map32 => self.be(4)?,
            _ => return Err(Error::WrongType { key: what, expected: "a map" }),
        };
        self.count(n, 2)
    }

    /// An array header; the count is checked against the remaining bytes.
    pub(super) fn array_len(&mut self, what: &'static str) -> Result<usize, Error> {
        let n = match self.marker()? {
            Marker::FixArray(n) => u64::from(n),
            Marker::Array16 => self.be(2)?,
            Marker::Array32 => self.be(4)?,
            _ => return Err(Error::WrongType { key: what, expected: "an array" }),
        };
        self.count(n, 1)
    }

    /// Length of a str (`Some((true, n))`) or bin (`Some((false, n))`)
    /// header, if the next value is one; consumes the header only.
    fn str_or_bin_len(&mut self) -> Result<Option<(bool, usize)>, Error> {
        let marker = self.peek()?;
        let (is_str, width) = match marker {
            Marker::FixStr(_) => (true, 0),
            Marker::Str8 => (true, 1),
            Marker::Str16 => (true, 2),
            Marker::Str32 => (true, 4),
            Marker::Bin8 => (false, 1),
            Marker::Bin16 => (false, 2),
            Marker::Bin32 => (false, 4),
            _ => return Ok(None),
        };
        self.pos += 1;
        let len = match marker {
            Marker::FixStr(n) => u64::from(n),
            _ => self.be(width)?,
        };
        Ok(Some((is_str, self.count(len, 1)?)))
    }

    /// A UTF-8 string, borrowed from the buffer.
    pub(super) fn str(&mut self, what: &'static str) -> Result<&'a str, Error> {
        match self.str_or_bin_len()? {
            Some((true, n)) => {
                let start = self.pos;
                let raw = self.take(n)?;
                std::str::from_utf8(raw)
                    .map_err(|_| Error::Malformed { offset: start, reason: "invalid UTF-8 in a str" })
            }
            _ => Err(Error::WrongType { key: what, expected: "a str" }),
        }
    }

    /// A str or bin value: `Some((is_str, byte range))`, or `None` (nothing
    /// consumed) if the next value is something else. UTF-8 is not checked.
    pub(super) fn str_or_bin(&mut self) -> Result<Option<(bool, std::ops::Range<usize>)>, Error> {
        let Some((is_str, n)) = self.str_or_bin_len()? else { return Ok(None) };
        self.take(n)?;
        Ok(Some((is_str, self.pos - n..self.pos)))
    }

    /// Any integer, as i128 (covers u64 and i64).
    fn integer(&mut self, what: &'static str, expected: &'static str) -> Result<i128, Error> {
        Ok(match self.marker()? {
            Marker::FixPos(v) => i128::from(v),
            Marker::FixNeg(v) => i128::from(v),
            Marker::U8 => i128::from(self.be(1)?),
            Marker::U16 => i128::from(self.be(2)?),
            Marker::U32 => i128::from(self.be(4)?),
            Marker::U64 => i128::from(self.be(8)?),
            Marker::I8 => i128::from(self.be(1)? as u8 as i8),
            Marker::I16 => i128::from(self.be(2)? as u16 as i16),
            Marker::I32 => i128::from(self.be(4)? as u32 as i32),
            Marker::I64 => i128::from(self.be(8)? as i64),
            _ => return Err(Error::WrongType { key: what, expected }),
        })
    }

    /// A bool (`Some`), or `None` (nothing consumed) for anything else.
    pub(super) fn bool_value(&mut self) -> Result<Option<bool>, Error> {
        Ok(match self.peek()? {
            Marker::True => {
                self.pos += 1;
                Some(true)
            }
            Marker::False => {
                self.pos += 1;
                Some(false)
            }
            _ => None,
        })
    }

    /// A non-negative integer in any msgpack integer format.
    pub(super) fn uint(&mut self, what: &'static str) -> Result<u64, Error> {
        const EXPECTED: &str = "a non-negative integer";
        let v = self.integer(what, EXPECTED)?;
        u64::try_from(v).map_err(|_| Error::WrongType { key: what, expected: EXPECTED })
    }

    /// A stats value: an integer that fits i64 (`Ok(Ok(_))`), a float
    /// (`Ok(Err(_))`), or `None` (nothing consumed) for anything else.
    pub(super) fn int_or_float(&mut self, what: &'static str) -> Result<Option<Result<i64, f64>>, Error> {
        Ok(Some(match self.peek()? {
            Marker::F32 => {
                self.pos += 1;
                Err(f64::from(f32::from_bits(self.be(4)? as u32)))
            }
            Marker::F64 => {
                self.pos += 1;
                Err(f64::from_bits(self.be(8)?))
            }
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::U8 | Marker::U16 | Marker::U32 | Marker::U64 => {
                let v = self.integer(what, "an integer")?;
                Ok(i64::try_from(v).map_err(|_| Error::WrongType { key: what, expected: "an integer within i64" })?)
            }
            Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => Ok(self.integer(what, "an integer")? as i64),
            _ => return Ok(None),
        }))
    }

    /// Skips one complete value of any type, nested at most `depth` deep;
    /// returns its byte range.
    pub(super) fn skip(&mut self, depth: usize) -> Result<std::ops::Range<usize>, Error> {
        let start = self.pos;
        if depth == 0 {
            return Err(self.malformed("nesting too deep"));
        }
        if self.skip_scalar()? {
            return Ok(start..self.pos);
        }
        if let Some((_, n)) = self.str_or_bin_len()? {
            self.take(n)?;
            return Ok(start..self.pos);
        }
        let (items, body) = match self.marker()? {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => (0, 0),
            Marker::U8 | Marker::I8 => (0, 1),
            Marker::U16 | Marker::I16 => (0, 2),
            Marker::U32 | Marker::I32 | Marker::F32 => (0, 4),
            Marker::U64 | Marker::I64 | Marker::F64 => (0, 8),
            Marker::FixExt1 => (0, 2),
            Marker::FixExt2 => (0, 3),
            Marker::FixExt4 => (0, 5),
            Marker::FixExt8 => (0, 9),
            Marker::FixExt16 => (0, 17),
            Marker::Ext8 => (0, self.be(1)? + 1),
            Marker::Ext16 => (0, self.be(2)? + 1),
            Marker::Ext32 => (0, self.be(4)? + 1),
            Marker::FixArray(n) => (u64::from(n), 0),
            Marker::Array16 => (self.be(2)?, 0),
            Marker::Array32 => (self.be(4)?, 0),
            Marker::FixMap(n) => (2 * u64::from(n), 0),
            Marker::Map16 => (2 * self.be(2)?, 0),
            Marker::Map32 => (2 * self.be(4)?, 0),
            _ => return Err(self.malformed("unexpected marker")),
        };
        let body = self.count(body, 1)?;
        self.take(body)?;
        for _ in 0..self.count(items, 1)? {
            if !self.skip_scalar()? {
                self.skip(depth - 1)?;
            }
        }
        Ok(start..self.pos)
    }

    /// Skips a scalar (integer, float, nil, bool) read from its marker
    /// byte alone; false, reading nothing, for any other value. A get's
    /// body is mostly an array of integers: skipping 524,288 of them
    /// through the general path was a quarter of stowd's time on a
    /// same-node get.
    #[inline]
    fn skip_scalar(&mut self) -> Result<bool, Error> {
        let width = match self.buf.get(self.pos) {
            Some(0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3) => 0,
            Some(0xcc | 0xd0) => 1,
            Some(0xcd | 0xd1) => 2,
            Some(0xce | 0xd2 | 0xca) => 4,
            Some(0xcf | 0xd3 | 0xcb) => 8,
            _ => return Ok(false),
        };
        self.pos += 1;
        self.take(width)?;
        Ok(true)
    }
}

/// A msgpack writer. Lengths above `u32::MAX` cannot be written; the first
/// such length poisons the writer and [`Writer::finish`] reports it.
pub(super) struct Writer {
    buf: ByteBuf,
    too_long: Option<&'static str>,
}

// Writing into a `ByteBuf` cannot fail (its error type is `Infallible`), so
// the `Result`s of the `rmp` encoders below are discarded.
impl Writer {
    pub(super) fn new() -> Self {
        Writer { buf: ByteBuf::with_capacity(256), too_long: None }
    }

    /// `n` as a msgpack length, or `None` (and the writer poisoned).
    fn len32(&mut self, n: usize, what: &'static str) -> Option<u32> {
        let n = u32::try_from(n).ok();
        if n.is_none() {
            self.too_long.get_or_insert(what);
        }
        n
    }

    pub(super) fn map(&mut self, n: usize) {
        if let Some(n) = self.len32(n, "map") {
            let _ = encode::write_map_len(&mut self.buf, n);
        }
    }

    pub(super) fn array(&mut self, n: usize) {
        if let Some(n) = self.len32(n, "array") {
            let _ = encode::write_array_len(&mut self.buf, n);
        }
    }

    pub(super) fn str(&mut self, s: &str) {
        if self.len32(s.len(), "str").is_some() {
            let _ = encode::write_str(&mut self.buf, s);
        }
    }

    pub(super) fn bin(&mut self, b: &[u8]) {
        if self.len32(b.len(), "bin").is_some() {
            let _ = encode::write_bin(&mut self.buf, b);
        }
    }

    pub(super) fn uint(&mut self, v: u64) {
        let _ = encode::write_uint(&mut self.buf, v);
    }

    pub(super) fn sint(&mut self, v: i64) {
        let _ = encode::write_sint(&mut self.buf, v);
    }

    pub(super) fn f64(&mut self, v: f64) {
        let _ = encode::write_f64(&mut self.buf, v);
    }

    /// Appends bytes that are already one msgpack value.
    pub(super) fn raw(&mut self, b: &[u8]) {
        self.buf.as_mut_vec().extend_from_slice(b);
    }

    /// A str key followed by a str value.
    pub(super) fn kv_str(&mut self, k: &str, v: &str) {
        self.str(k);
        self.str(v);
    }

    /// A str key followed by a uint value.
    pub(super) fn kv_uint(&mut self, k: &str, v: u64) {
        self.str(k);
        self.uint(v);
    }

    pub(super) fn finish(self) -> Result<Vec<u8>, Error> {
        match self.too_long {
            Some(what) => Err(Error::Unencodable(format!("a {what} longer than 2^32-1 cannot be written"))),
            None => Ok(self.buf.into_vec()),
        }
    }
}
