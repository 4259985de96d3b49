//! Values that carry arrays inside: a per-row numpy array (ext 5), a tensor
//! inside a list or a dict, a list mixing tensors with `None`, a nested
//! tensor as one row's value. `SimpleStorageUnit` keeps such a row as the
//! Python object it decoded and encodes it again on GET, each array in a
//! fresh data frame; stowd keeps it as one self-contained [`Value::Msgpack`]
//! (its *inlined* form) and [`Expander`] writes it back with fresh frames.
//!
//! The inlined form is one msgpack ext [`FRAMED_EXT`] (always ext 32, so its
//! length can be patched in place): payload `0x00` then the row's msgpack as
//! it arrived (the *template*), except that every ext 3/4/5 in it is itself
//! an ext [`FRAMED_EXT`] whose payload is the kind (3, 4 or 5) then the
//! array(s) with their bytes:
//!
//! ```text
//! kind 3 or 5: part
//! kind 4:      layout (u8: 0 jagged, 1 strided), count (u32 LE), count x part
//! part:        dtype length (u16 LE), dtype (utf-8), rank (u8), rank x dim (u64 LE),
//!              byte length (u64 LE), bytes
//! ```
//!
//! The array bytes are copied once on PUT (into the inlined value) and
//! never on GET (the reply's frames are slices of the stored value). Ext
//! [`FRAMED_EXT`] is never accepted from a TransferQueue peer (an unknown
//! ext type is undecodable), so a stored value starts with it only if stowd
//! wrote it, or a stowage/1 client stored such bytes: a value that does not
//! parse as the inlined form is written back as it is.

use bytes::Bytes;

use crate::msgpack::{Item, Reader, TQ_MAX_DEPTH, Writer};
use crate::pickle;

/// The ext type of an inlined value and of each array inside one.
pub(super) const FRAMED_EXT: i8 = 100;
/// Payload's first byte of the outer ext: a value (template follows).
const KIND_VALUE: u8 = 0;

/// One array of an inlined value.
pub(super) struct Part<'a> {
    /// torch dtype name (ext 3/4) or numpy dtype string (ext 5).
    pub dtype: &'a str,
    /// Shape.
    pub shape: &'a [u64],
    /// The array's C-contiguous bytes.
    pub data: &'a [u8],
}

/// Starts an ext 32 of type [`FRAMED_EXT`]; returns where its length goes.
fn open_ext(out: &mut Vec<u8>) -> usize {
    out.push(0xc9);
    let at = out.len();
    out.extend_from_slice(&[0; 4]);
    out.push(FRAMED_EXT as u8);
    at
}

/// Patches the length of the ext opened at `at`. `None` if over `u32::MAX`.
fn close_ext(out: &mut [u8], at: usize) -> Option<()> {
    let len = u32::try_from(out.len() - at - 5).ok()?;
    out[at..at + 4].copy_from_slice(&len.to_be_bytes());
    Some(())
}

fn part(out: &mut Vec<u8>, p: &Part<'_>) {
    // The dtype is bounded by the decoder (a pickled str of at most a few KiB).
    let dtype = &p.dtype.as_bytes()[..p.dtype.len().min(u16::MAX as usize)];
    out.extend_from_slice(&(dtype.len() as u16).to_le_bytes());
    out.extend_from_slice(dtype);
    out.push(p.shape.len() as u8);
    p.shape
        .iter()
        .for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
    out.extend_from_slice(&(p.data.len() as u64).to_le_bytes());
    out.extend_from_slice(p.data);
}

/// An inlined value under construction.
pub(super) struct Builder {
    out: Vec<u8>,
    outer: usize,
}

impl Builder {
    pub(super) fn new(capacity: usize) -> Builder {
        let mut out = Vec::with_capacity(capacity + 32);
        let outer = open_ext(&mut out);
        out.push(KIND_VALUE);
        Builder { out, outer }
    }

    /// Template bytes, copied as they are.
    pub(super) fn raw(&mut self, b: &[u8]) {
        self.out.extend_from_slice(b);
    }

    /// An ext 3 or ext 5 array.
    pub(super) fn array(&mut self, kind: u8, p: &Part<'_>) {
        let at = open_ext(&mut self.out);
        self.out.push(kind);
        part(&mut self.out, p);
        close_ext(&mut self.out, at);
    }

    /// An ext 4 nested tensor.
    pub(super) fn nested(&mut self, jagged: bool, parts: &[Part<'_>]) {
        let at = open_ext(&mut self.out);
        self.out.push(4);
        self.out.push(u8::from(!jagged));
        self.out
            .extend_from_slice(&(parts.len() as u32).to_le_bytes());
        parts.iter().for_each(|p| part(&mut self.out, p));
        close_ext(&mut self.out, at);
    }

    /// The inlined value, or `None` if it is over 4 GiB.
    pub(super) fn finish(mut self) -> Option<Bytes> {
        close_ext(&mut self.out, self.outer)?;
        Some(Bytes::from(self.out))
    }
}

/// True if `b` starts like an inlined value (checked fully when expanded).
pub(super) fn is_inlined(b: &[u8]) -> bool {
    b.len() >= 7 && b[0] == 0xc9 && b[5] == FRAMED_EXT as u8 && b[6] == KIND_VALUE
}

/// A cursor over a part's bytes.
struct Cur<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.b.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|s| s[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|s| u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|s| u32::from_le_bytes(s.try_into().unwrap_or([0; 4])))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])))
    }
    /// A part: (dtype, shape, byte range in `b`).
    fn part(&mut self) -> Option<(&'a str, Vec<u64>, std::ops::Range<usize>)> {
        let n = self.u16()? as usize;
        let dtype = std::str::from_utf8(self.take(n)?).ok()?;
        let rank = self.u8()? as usize;
        let shape = (0..rank).map(|_| self.u64()).collect::<Option<Vec<_>>>()?;
        let len = usize::try_from(self.u64()?).ok()?;
        let start = self.pos;
        self.take(len)?;
        Some((dtype, shape, start..start + len))
    }
}

/// Writes inlined values back as TransferQueue msgpack with data frames.
pub(super) struct Expander {
    /// Frame 0 bytes of the value.
    pub w: Writer,
    /// Its data frames, in order.
    pub frames: Vec<Bytes>,
    /// Absolute index of the first of `frames`.
    first: usize,
}

impl Expander {
    /// Expands inlined value `b` whose first new frame has absolute index
    /// `first`. `None` if `b` is not a well-formed inlined value.
    pub(super) fn expand(b: &Bytes, first: usize) -> Option<Expander> {
        if !is_inlined(b) {
            return None;
        }
        let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        if len != b.len() - 6 {
            return None;
        }
        let mut e = Expander {
            w: Writer::new(),
            frames: Vec::new(),
            first,
        };
        let mut r = Reader::bytes(b, 7);
        e.walk(b, &mut r, TQ_MAX_DEPTH)?;
        r.at_end().then_some(e)
    }

    fn walk(&mut self, b: &Bytes, r: &mut Reader<'_>, depth: usize) -> Option<()> {
        if depth == 0 {
            return None;
        }
        let start = r.pos();
        match r.item().ok()? {
            Item::Array(n) => {
                self.w.raw(&b[start..r.pos()]);
                for _ in 0..n {
                    self.walk(b, r, depth - 1)?;
                }
            }
            Item::Map(n) => {
                self.w.raw(&b[start..r.pos()]);
                for _ in 0..2 * n {
                    self.walk(b, r, depth - 1)?;
                }
            }
            Item::Ext {
                code: FRAMED_EXT,
                data,
                start: at,
            } => self.array(b, data, at)?,
            _ => self.w.raw(&b[start..r.pos()]),
        }
        Some(())
    }

    /// Index of the next frame, after pushing `b[range]` as it.
    fn frame(&mut self, b: &Bytes, range: std::ops::Range<usize>) -> usize {
        self.frames.push(b.slice(range));
        self.first + self.frames.len() - 1
    }

    fn array(&mut self, b: &Bytes, data: &[u8], at: usize) -> Option<()> {
        let mut c = Cur { b: data, pos: 0 };
        match c.u8()? {
            kind @ (3 | 5) => {
                let (dtype, shape, range) = c.part()?;
                if c.pos != data.len() {
                    return None;
                }
                let index = self.frame(b, at + range.start..at + range.end);
                self.w
                    .ext(kind as i8, &pickle::dumps_tensor_meta(dtype, &shape, index));
            }
            4 => {
                let layout = match c.u8()? {
                    0 => "jagged",
                    1 => "strided",
                    _ => return None,
                };
                let count = c.u32()? as usize;
                let mut metas = Vec::with_capacity(count.min(data.len()));
                for _ in 0..count {
                    let (dtype, shape, range) = c.part()?;
                    let index = self.frame(b, at + range.start..at + range.end);
                    metas.push((dtype, shape, index));
                }
                if c.pos != data.len() {
                    return None;
                }
                let metas: Vec<(&str, &[u64], usize)> = metas
                    .iter()
                    .map(|(d, s, i)| (*d, s.as_slice(), *i))
                    .collect();
                self.w.ext(4, &pickle::dumps_nested_meta(layout, &metas));
            }
            _ => return None,
        }
        Some(())
    }
}
