//! The msgpack writer, over [`rmp`]'s encoders. It picks the encodings
//! `msgspec` picks (smallest int, fixstr/str8/16/32, float64 `cb`, fixext
//! for payloads of 1/2/4/8/16 bytes), so TransferQueue replies re-encode
//! byte for byte.

use bytes::Bytes;
use rmp::encode::{self, ByteBuf};

/// A msgpack writer. Lengths above `u32::MAX` cannot be written; the first
/// such length poisons the writer and [`Writer::finish`] reports it.
pub struct Writer {
    buf: ByteBuf,
    too_long: Option<&'static str>,
}

impl Default for Writer {
    fn default() -> Self {
        Writer::new()
    }
}

/// A length above `u32::MAX` was given to a [`Writer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooLong(pub &'static str);

impl std::fmt::Display for TooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a {} longer than 2^32-1 cannot be written", self.0)
    }
}

// Writing into a `ByteBuf` cannot fail (its error type is `Infallible`), so
// the `Result`s of the `rmp` encoders below are discarded.
impl Writer {
    /// An empty writer.
    pub fn new() -> Self {
        Writer::with_capacity(256)
    }

    /// `n` as a msgpack length, or `None` (and the writer poisoned).
    fn len32(&mut self, n: usize, what: &'static str) -> Option<u32> {
        let n = u32::try_from(n).ok();
        if n.is_none() {
            self.too_long.get_or_insert(what);
        }
        n
    }

    // The short forms (fixmap, fixarray, fixstr, positive fixint) are
    // pushed as bytes: `rmp`'s encoders write a marker and its payload in
    // separate writes through `std::io::Write`, about 40 instructions a
    // short str where a push is a few (a put's descriptors are mostly
    // short keys and small ints). The bytes are the ones `rmp` writes.

    /// An empty writer with room for `n` bytes.
    pub fn with_capacity(n: usize) -> Self {
        Writer {
            buf: ByteBuf::with_capacity(n),
            too_long: None,
        }
    }

    /// Map header.
    pub fn map(&mut self, n: usize) {
        if n < 16 {
            self.buf.as_mut_vec().push(0x80 | n as u8);
        } else if let Some(n) = self.len32(n, "map") {
            let _ = encode::write_map_len(&mut self.buf, n);
        }
    }

    /// Array header.
    pub fn array(&mut self, n: usize) {
        if n < 16 {
            self.buf.as_mut_vec().push(0x90 | n as u8);
        } else if let Some(n) = self.len32(n, "array") {
            let _ = encode::write_array_len(&mut self.buf, n);
        }
    }

    /// A str in its shortest form.
    pub fn str(&mut self, s: &str) {
        if s.len() < 32 {
            let buf = self.buf.as_mut_vec();
            buf.push(0xa0 | s.len() as u8);
            buf.extend_from_slice(s.as_bytes());
        } else if self.len32(s.len(), "str").is_some() {
            let _ = encode::write_str(&mut self.buf, s);
        }
    }

    /// A bin in its shortest form.
    pub fn bin(&mut self, b: &[u8]) {
        if self.len32(b.len(), "bin").is_some() {
            let _ = encode::write_bin(&mut self.buf, b);
        }
    }

    /// nil.
    pub fn nil(&mut self) {
        let _ = encode::write_nil(&mut self.buf);
    }

    /// true or false.
    pub fn bool(&mut self, v: bool) {
        let _ = encode::write_bool(&mut self.buf, v);
    }

    /// A non-negative int in its shortest form.
    pub fn uint(&mut self, v: u64) {
        if v < 128 {
            self.buf.as_mut_vec().push(v as u8);
            return;
        }
        let _ = encode::write_uint(&mut self.buf, v);
    }

    /// A signed int in its shortest form.
    pub fn sint(&mut self, v: i64) {
        let _ = encode::write_sint(&mut self.buf, v);
    }

    /// A float64 (`cb`), as msgspec writes every Python float.
    pub fn f64(&mut self, v: f64) {
        let _ = encode::write_f64(&mut self.buf, v);
    }

    /// An ext value (fixext for 1/2/4/8/16 bytes, else ext8/16/32).
    pub fn ext(&mut self, code: i8, payload: &[u8]) {
        if let Some(n) = self.len32(payload.len(), "ext") {
            let _ = encode::write_ext_meta(&mut self.buf, n, code);
            self.raw(payload);
        }
    }

    /// Bytes that are already msgpack.
    pub fn raw(&mut self, b: &[u8]) {
        self.buf.as_mut_vec().extend_from_slice(b);
    }

    /// A str key followed by a str value.
    pub fn kv_str(&mut self, k: &str, v: &str) {
        self.str(k);
        self.str(v);
    }

    /// A str key followed by a uint value.
    pub fn kv_uint(&mut self, k: &str, v: u64) {
        self.str(k);
        self.uint(v);
    }

    /// How many bytes are written so far.
    pub fn len(&self) -> usize {
        self.buf.as_slice().len()
    }

    /// Whether nothing is written yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes written from offset `start` on (a [`Writer::len`] taken
    /// before).
    pub fn written_since(&self, start: usize) -> &[u8] {
        &self.buf.as_slice()[start..]
    }

    /// The bytes written, or the first length that could not be written.
    pub fn finish(self) -> Result<Vec<u8>, TooLong> {
        match self.too_long {
            Some(what) => Err(TooLong(what)),
            None => Ok(self.buf.into_vec()),
        }
    }

    /// The bytes written, for messages whose lengths are bounded by what
    /// was decoded (a TransferQueue reply): a length above `u32::MAX` there
    /// is a bug, caught by a debug assertion.
    pub fn into_bytes(self) -> Bytes {
        debug_assert!(self.too_long.is_none(), "{:?}", self.too_long);
        Bytes::from(self.buf.into_vec())
    }
}
