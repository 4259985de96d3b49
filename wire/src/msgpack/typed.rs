//! Typed reads on [`Reader`] (the `stowage/1` envelope reads each key's
//! value as the type it must be) and the fast [`Reader::skip`].

use std::ops::Range;

use rmp::Marker;

use super::{MsgpackError, Reader};

fn wrong(key: &'static str, expected: &'static str) -> MsgpackError {
    MsgpackError::WrongType { key, expected }
}

impl<'a> Reader<'a> {
    /// A map header; the count is checked against the remaining bytes.
    pub fn map_len(&mut self, what: &'static str) -> Result<usize, MsgpackError> {
        let n = match self.marker()? {
            Marker::FixMap(n) => u64::from(n),
            Marker::Map16 => self.be(2)?,
            Marker::Map32 => self.be(4)?,
            _ => return Err(wrong(what, "a map")),
        };
        self.count(n, 2)
    }

    /// An array header; the count is checked against the remaining bytes.
    pub fn array_len(&mut self, what: &'static str) -> Result<usize, MsgpackError> {
        let n = match self.marker()? {
            Marker::FixArray(n) => u64::from(n),
            Marker::Array16 => self.be(2)?,
            Marker::Array32 => self.be(4)?,
            _ => return Err(wrong(what, "an array")),
        };
        self.count(n, 1)
    }

    /// Length of a str (`Some((true, n))`) or bin (`Some((false, n))`)
    /// header, if the next value is one; consumes the header only.
    fn str_or_bin_len(&mut self) -> Result<Option<(bool, usize)>, MsgpackError> {
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
    pub fn str(&mut self, what: &'static str) -> Result<&'a str, MsgpackError> {
        match self.str_or_bin_len()? {
            Some((true, n)) => self.utf8(n),
            _ => Err(wrong(what, "a str")),
        }
    }

    /// A str's bytes, borrowed from the buffer, UTF-8 not checked: for a
    /// caller that compares them with ASCII names first (a map's keys) and
    /// checks them ([`Reader::utf8_at`]) only when none matches.
    pub fn str_bytes(&mut self, what: &'static str) -> Result<&'a [u8], MsgpackError> {
        match self.str_or_bin_len()? {
            Some((true, n)) => self.take(n),
            _ => Err(wrong(what, "a str")),
        }
    }

    /// A str or bin value: `Some((is_str, byte range))`, or `None` (nothing
    /// consumed) if the next value is something else. UTF-8 is not checked.
    pub fn str_or_bin(&mut self) -> Result<Option<(bool, Range<usize>)>, MsgpackError> {
        let Some((is_str, n)) = self.str_or_bin_len()? else {
            return Ok(None);
        };
        self.take(n)?;
        Ok(Some((is_str, self.pos - n..self.pos)))
    }

    /// Any integer, as i128 (covers u64 and i64).
    fn integer(
        &mut self,
        what: &'static str,
        expected: &'static str,
    ) -> Result<i128, MsgpackError> {
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
            _ => return Err(wrong(what, expected)),
        })
    }

    /// A bool (`Some`), or `None` (nothing consumed) for anything else.
    pub fn bool_value(&mut self) -> Result<Option<bool>, MsgpackError> {
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
    pub fn uint(&mut self, what: &'static str) -> Result<u64, MsgpackError> {
        const EXPECTED: &str = "a non-negative integer";
        let v = self.integer(what, EXPECTED)?;
        u64::try_from(v).map_err(|_| wrong(what, EXPECTED))
    }

    /// A stats value: an integer that fits i64 (`Ok(Ok(_))`), a float
    /// (`Ok(Err(_))`), or `None` (nothing consumed) for anything else.
    pub fn int_or_float(
        &mut self,
        what: &'static str,
    ) -> Result<Option<Result<i64, f64>>, MsgpackError> {
        Ok(Some(match self.peek()? {
            Marker::F32 => {
                self.pos += 1;
                Err(f64::from(f32::from_bits(self.be(4)? as u32)))
            }
            Marker::F64 => {
                self.pos += 1;
                Err(f64::from_bits(self.be(8)?))
            }
            Marker::FixPos(_)
            | Marker::FixNeg(_)
            | Marker::U8
            | Marker::U16
            | Marker::U32
            | Marker::U64 => {
                let v = self.integer(what, "an integer")?;
                Ok(i64::try_from(v).map_err(|_| wrong(what, "an integer within i64"))?)
            }
            Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => {
                Ok(self.integer(what, "an integer")? as i64)
            }
            _ => return Ok(None),
        }))
    }

    /// Skips one complete value of any type, entering at most `depth`
    /// levels of arrays and maps; returns its byte range. Unlike
    /// [`Reader::visit`] it does not check UTF-8 (a kept value is returned
    /// as its bytes, never read as text).
    pub fn skip(&mut self, depth: usize) -> Result<Range<usize>, MsgpackError> {
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
    fn skip_scalar(&mut self) -> Result<bool, MsgpackError> {
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

    // Quiet reads, for a fast path that reads the one encoding it expects
    // and leaves anything else to the general reads (which make every
    // error): each returns `None` and consumes nothing when the next
    // bytes are not what it reads.

    /// Consumes `lit` if the next bytes are exactly it.
    #[inline]
    pub fn eat<const N: usize>(&mut self, lit: &[u8; N]) -> Option<()> {
        // A literal of known length: compared inline, where a slice's
        // compare called `memcmp` (about 40 instructions an `eat`, five a
        // regular descriptor).
        let end = self.pos.checked_add(N)?;
        let got: &[u8; N] = self.buf.get(self.pos..end)?.try_into().ok()?;
        if got == lit {
            self.pos = end;
            Some(())
        } else {
            None
        }
    }

    /// A fixstr's bytes (UTF-8 not checked).
    #[inline]
    pub fn fixstr_bytes(&mut self) -> Option<&'a [u8]> {
        let &b = self.buf.get(self.pos)?;
        if b & 0xe0 != 0xa0 {
            return None;
        }
        let start = self.pos + 1;
        let out = self.buf.get(start..start + usize::from(b & 0x1f))?;
        self.pos = start + out.len();
        Some(out)
    }

    /// A fixarray's count.
    #[inline]
    pub fn fixarray_len(&mut self) -> Option<usize> {
        let &b = self.buf.get(self.pos)?;
        if b & 0xf0 != 0x90 {
            return None;
        }
        self.pos += 1;
        Some(usize::from(b & 0x0f))
    }

    /// A non-negative integer written as a positive fixint or uint 8-64.
    #[inline]
    pub fn uint_quiet(&mut self) -> Option<u64> {
        let &b = self.buf.get(self.pos)?;
        let width = match b {
            0x00..=0x7f => {
                self.pos += 1;
                return Some(u64::from(b));
            }
            0xcc => 1,
            0xcd => 2,
            0xce => 4,
            0xcf => 8,
            _ => return None,
        };
        let at = self.pos;
        self.pos += 1;
        let v = self.be(width).ok();
        if v.is_none() {
            self.pos = at;
        }
        v
    }
}
