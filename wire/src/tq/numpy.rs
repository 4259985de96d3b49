//! numpy dtypes on the TransferQueue wire (ext 5) and the numpy scalars a
//! unit returns for the rows of a 1-d array.
//!
//! TransferQueue's encoder sends a numpy array of any non-object dtype as
//! ext 5 `(str(dtype), shape, frame_index)` over its C-contiguous bytes. The
//! dtype string is modelled here only for its item size (to check that a
//! frame fits its shape, as numpy's `reshape` does in the unit) and, for the
//! scalar kinds, for the pickle of a numpy scalar: iterating a 1-d array in
//! `SimpleStorageUnit` yields numpy scalars, which TransferQueue's encoder
//! sends as ext 1 `pickle.dumps(scalar, 5)`; [`scalar_pickle`] writes those
//! bytes exactly as numpy 2.x does. A numpy array of dtype object travels
//! as ext 1 `pickle.dumps(array, 5)`; [`object_array_rows`] reads that
//! pickle for a 1-d array of plain items (and nothing else).

/// Longest dtype string accepted.
pub(super) const MAX_DTYPE_LEN: usize = 64;

/// A numpy dtype as far as stowd needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NpDtype {
    /// A dtype with a modelled item size.
    Simple {
        /// numpy's kind character: `b i u f c M m S U V`.
        kind: u8,
        /// Bytes per item (a `U` item is 4 bytes per code point).
        itemsize: usize,
        /// Byte order of the data: `<`, `>` or `|` (not applicable).
        order: u8,
    },
}

impl NpDtype {
    /// Parses `str(dtype)` as numpy writes it: a name (`float64`, `bool`,
    /// `datetime64[ns]`) or a type string (`<U5`, `|S10`, `>i4`, `|V8`).
    /// `None` for anything else: an object dtype (TransferQueue pickles
    /// those as ext 1) and a structured dtype, whose `str()` numpy itself
    /// cannot parse (`SimpleStorageUnit` cannot decode such an ext 5 either).
    pub(super) fn parse(s: &str) -> Option<NpDtype> {
        if s.is_empty() || s.len() > MAX_DTYPE_LEN {
            return None;
        }
        let little = if cfg!(target_endian = "little") {
            b'<'
        } else {
            b'>'
        };
        let simple = |kind: u8, itemsize: usize, order: u8| {
            let order = if itemsize <= 1 || matches!(kind, b'S' | b'V') {
                b'|'
            } else {
                order
            };
            Some(NpDtype::Simple {
                kind,
                itemsize,
                order,
            })
        };
        let named = match s {
            "bool" => Some((b'b', 1)),
            "int8" => Some((b'i', 1)),
            "int16" => Some((b'i', 2)),
            "int32" => Some((b'i', 4)),
            "int64" => Some((b'i', 8)),
            "uint8" => Some((b'u', 1)),
            "uint16" => Some((b'u', 2)),
            "uint32" => Some((b'u', 4)),
            "uint64" => Some((b'u', 8)),
            "float16" => Some((b'f', 2)),
            "float32" => Some((b'f', 4)),
            "float64" => Some((b'f', 8)),
            "float128" => Some((b'f', 16)),
            "complex64" => Some((b'c', 8)),
            "complex128" => Some((b'c', 16)),
            "complex256" => Some((b'c', 32)),
            _ => None,
        };
        if let Some((kind, size)) = named {
            return simple(kind, size, little);
        }
        for (prefix, kind) in [("datetime64", b'M'), ("timedelta64", b'm')] {
            if let Some(rest) = s.strip_prefix(prefix)
                && (rest.is_empty() || unit_ok(rest))
            {
                return simple(kind, 8, little);
            }
        }
        // A type string: [<>|=]? kind digits ([unit] for M and m).
        let b = s.as_bytes();
        let (order, rest) = match b[0] {
            b'<' | b'>' | b'|' => (b[0], &b[1..]),
            b'=' => (little, &b[1..]),
            _ => (little, b),
        };
        let (&kind, rest) = rest.split_first()?;
        let digits = rest.iter().take_while(|c| c.is_ascii_digit()).count();
        let (num, tail) = rest.split_at(digits);
        if num.is_empty() || num.len() > 9 {
            return None;
        }
        let n: usize = std::str::from_utf8(num).ok()?.parse().ok()?;
        let ok = match kind {
            b'b' => n == 1 && tail.is_empty(),
            b'i' | b'u' => matches!(n, 1 | 2 | 4 | 8) && tail.is_empty(),
            b'f' => matches!(n, 2 | 4 | 8 | 12 | 16) && tail.is_empty(),
            b'c' => matches!(n, 8 | 16 | 24 | 32) && tail.is_empty(),
            b'M' | b'm' => n == 8 && (tail.is_empty() || unit_ok(std::str::from_utf8(tail).ok()?)),
            b'S' | b'U' | b'V' => tail.is_empty(),
            _ => false,
        };
        if !ok {
            return None;
        }
        let itemsize = if kind == b'U' { n.checked_mul(4)? } else { n };
        simple(kind, itemsize, order)
    }

    /// Bytes per item.
    pub(super) fn itemsize(&self) -> usize {
        match self {
            NpDtype::Simple { itemsize, .. } => *itemsize,
        }
    }
}

/// `[ns]`, `[25us]`, ...: a datetime unit in brackets.
fn unit_ok(s: &str) -> bool {
    let Some(inner) = s.strip_prefix('[').and_then(|r| r.strip_suffix(']')) else {
        return false;
    };
    !inner.is_empty() && inner.len() <= 16 && inner.bytes().all(|c| c.is_ascii_alphanumeric())
}

/// A pickle int as CPython writes it (BININT1, BININT2, BININT).
fn pickle_int(out: &mut Vec<u8>, v: i64) {
    match v {
        0..=0xff => out.extend_from_slice(&[b'K', v as u8]),
        0x100..=0xffff => {
            out.push(b'M');
            out.extend_from_slice(&(v as u16).to_le_bytes());
        }
        _ => {
            out.push(b'J');
            out.extend_from_slice(&(v as i32).to_le_bytes());
        }
    }
}

/// A SHORT_BINUNICODE + MEMOIZE.
fn pickle_short_str(out: &mut Vec<u8>, s: &str) {
    out.push(0x8c);
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
    out.push(0x94);
}

/// `pickle.dumps(scalar, protocol=5)` for the numpy scalar that indexing a
/// 1-d array of `dtype` at an item with bytes `item` gives (numpy 2.x:
/// `numpy._core.multiarray.scalar(dtype, bytes)`). Scalars are in native
/// byte order and `S`/`U` scalars drop trailing NULs, as numpy's do. `None`
/// for kinds stowd does not write (datetime, timedelta, void, a big-endian
/// long double or complex256).
pub(super) fn scalar_pickle(dtype: NpDtype, item: &[u8]) -> Option<Vec<u8>> {
    let NpDtype::Simple {
        kind,
        itemsize,
        order,
    } = dtype;
    if item.len() != itemsize {
        return None;
    }
    let native = if cfg!(target_endian = "little") {
        b'<'
    } else {
        b'>'
    };
    let swap = order != b'|' && order != native;
    let mut data = item.to_vec();
    // (descr name, byte order char, elsize, alignment, flags)
    let (name, order_char, elsize, align, flags): (String, u8, i64, i64, i64) = match kind {
        b'b' | b'i' | b'u' | b'f' | b'c' => {
            if swap {
                match kind {
                    b'c' if itemsize == 8 || itemsize == 16 => {
                        let half = itemsize / 2;
                        data[..half].reverse();
                        data[half..].reverse();
                    }
                    b'i' | b'u' | b'f' if itemsize <= 8 => data.reverse(),
                    _ => return None,
                }
            }
            let order_char = if itemsize == 1 { b'|' } else { native };
            (format!("{}{itemsize}", kind as char), order_char, -1, -1, 0)
        }
        b'S' => {
            let end = data.iter().rposition(|&c| c != 0).map_or(0, |p| p + 1);
            data.truncate(end);
            let n = data.len() as i64;
            (format!("S{n}"), b'|', n, 1, 0)
        }
        b'U' => {
            if swap {
                data.chunks_exact_mut(4).for_each(<[u8]>::reverse);
            }
            let units = data.len() / 4;
            let keep = (0..units)
                .rposition(|i| data[4 * i..4 * i + 4] != [0; 4])
                .map_or(0, |p| p + 1);
            data.truncate(4 * keep);
            (format!("U{keep}"), native, 4 * keep as i64, 4, 8)
        }
        _ => return None,
    };
    let mut body = Vec::with_capacity(112 + data.len());
    pickle_short_str(&mut body, "numpy._core.multiarray");
    pickle_short_str(&mut body, "scalar");
    body.extend_from_slice(&[0x93, 0x94]);
    pickle_short_str(&mut body, "numpy");
    pickle_short_str(&mut body, "dtype");
    body.extend_from_slice(&[0x93, 0x94]);
    pickle_short_str(&mut body, &name);
    // NEWFALSE NEWTRUE TUPLE3 MEMOIZE REDUCE MEMOIZE MARK BININT1 3
    body.extend_from_slice(&[0x89, 0x88, 0x87, 0x94, b'R', 0x94, b'(', b'K', 3]);
    pickle_short_str(&mut body, std::str::from_utf8(&[order_char]).unwrap_or("|"));
    body.extend_from_slice(b"NNN");
    pickle_int(&mut body, elsize);
    pickle_int(&mut body, align);
    pickle_int(&mut body, flags);
    // TUPLE MEMOIZE BUILD
    body.extend_from_slice(&[b't', 0x94, b'b']);
    match data.len() {
        n if n < 0x100 => body.extend_from_slice(&[b'C', n as u8]),
        n if n <= u32::MAX as usize => {
            body.push(b'B');
            body.extend_from_slice(&(n as u32).to_le_bytes());
        }
        n => {
            body.push(0x8e);
            body.extend_from_slice(&(n as u64).to_le_bytes());
        }
    }
    body.extend_from_slice(&data);
    // MEMOIZE TUPLE2 MEMOIZE REDUCE MEMOIZE STOP
    body.extend_from_slice(&[0x94, 0x86, 0x94, b'R', 0x94, b'.']);
    let mut out = Vec::with_capacity(11 + body.len());
    out.extend_from_slice(&[0x80, 5, 0x95]);
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    Some(out)
}

/// `pickle.dumps(a, 5)` of a 1-d object array `a`, up to its shape: what
/// TransferQueue's encoder sends (ext 1) for a numpy array of dtype object.
const OBJECT_ARRAY_HEAD: &[u8] =
    b"\x8c\x16numpy._core.multiarray\x94\x8c\x0c_reconstruct\x94\x93\x94\
\x8c\x05numpy\x94\x8c\x07ndarray\x94\x93\x94K\x00\x85\x94C\x01b\x94\x87\x94R\x94(K\x01";
/// From after the shape `(n,)` to the item list: dtype `O8` and `is_fortran`.
const OBJECT_ARRAY_DTYPE: &[u8] =
    b"\x85\x94h\x03\x8c\x05dtype\x94\x93\x94\x8c\x02O8\x94\x89\x88\x87\x94R\x94\
(K\x03\x8c\x01|\x94NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK?t\x94b\x89]\x94";
/// Memo index of the first item (the head and dtype memoize 0..=18).
const OBJECT_ARRAY_FIRST_MEMO: usize = 19;

/// One item of an object array, as msgspec writes it.
#[derive(Clone)]
enum Item {
    Str(String),
    Int(i128),
    Float(f64),
    Bool(bool),
    None,
    Bytes(Vec<u8>),
}

/// A pickle cursor that steps over FRAME opcodes.
struct Pk<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Pk<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.b.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }
    fn uint(&mut self, n: usize) -> Option<u64> {
        let s = self.take(n)?;
        Some(s.iter().rev().fold(0u64, |v, &x| (v << 8) | u64::from(x)))
    }
    /// The next opcode, FRAMEs skipped.
    fn op(&mut self) -> Option<u8> {
        loop {
            let op = self.take(1)?[0];
            if op != 0x95 {
                return Some(op);
            }
            self.take(8)?;
        }
    }
    fn int(&mut self, op: u8) -> Option<i128> {
        Some(match op {
            b'K' => i128::from(self.take(1)?[0]),
            b'M' => i128::from(self.uint(2)? as u16),
            b'J' => i128::from(self.uint(4)? as u32 as i32),
            0x8a => {
                let n = self.take(1)?[0] as usize;
                let s = self.take(n)?;
                if n > 16 {
                    return None;
                }
                let mut v: i128 = 0;
                for (i, &x) in s.iter().enumerate() {
                    v |= i128::from(x) << (8 * i);
                }
                if n > 0 && n < 16 && s[n - 1] & 0x80 != 0 {
                    v -= 1i128 << (8 * n);
                }
                v
            }
            _ => return None,
        })
    }
}

/// The rows of a whole field sent as a pickled 1-d numpy object array
/// (ext 1): its items, each as msgspec writes it, which is what
/// `SimpleStorageUnit` answers after iterating the array. `Ok(None)` if
/// `p` is not such a pickle; `Err` (why) if it is one stowd cannot take
/// apart: items other than str, int, float, bool, None and bytes (stowd
/// cannot pickle arbitrary objects again), or an int msgpack cannot hold.
/// One pass over `p`; the rows are at most as many as its bytes.
pub(super) fn object_array_rows(p: &[u8]) -> Result<Option<Vec<Vec<u8>>>, &'static str> {
    let mut c = Pk { b: p, pos: 0 };
    if c.take(2) != Some(b"\x80\x05") {
        return Ok(None);
    }
    if c.b.get(c.pos) == Some(&0x95) {
        c.take(9);
    }
    if c.take(OBJECT_ARRAY_HEAD.len()) != Some(OBJECT_ARRAY_HEAD) {
        return Ok(None);
    }
    let Some(n) = c.op().and_then(|op| c.int(op)) else {
        return Ok(None);
    };
    if c.take(OBJECT_ARRAY_DTYPE.len()) != Some(OBJECT_ARRAY_DTYPE) {
        return Err("a numpy object array that is not 1-d (or not C order)");
    }
    const BAD: &str = "a malformed pickle of a numpy object array";
    let mut memo: Vec<Item> = Vec::new();
    let mut items: Vec<Item> = Vec::new();
    let mut in_batch = false;
    let mut last: Option<Item> = None;
    loop {
        let op = c.op().ok_or(BAD)?;
        let item = match op {
            0x94 => {
                // MEMOIZE the item just read.
                memo.push(last.clone().ok_or(BAD)?);
                continue;
            }
            b'(' if !in_batch => {
                in_batch = true;
                continue;
            }
            b'e' if in_batch => {
                in_batch = false;
                continue;
            }
            b'a' if !in_batch => continue,
            b't' if !in_batch => break,
            0x8c | b'X' | 0x8d => {
                let n = match op {
                    0x8c => c.uint(1),
                    b'X' => c.uint(4),
                    _ => c.uint(8),
                }
                .ok_or(BAD)?;
                let s = c.take(usize::try_from(n).map_err(|_| BAD)?).ok_or(BAD)?;
                Item::Str(std::str::from_utf8(s).map_err(|_| BAD)?.to_owned())
            }
            b'C' | b'B' | 0x8e => {
                let n = match op {
                    b'C' => c.uint(1),
                    b'B' => c.uint(4),
                    _ => c.uint(8),
                }
                .ok_or(BAD)?;
                Item::Bytes(
                    c.take(usize::try_from(n).map_err(|_| BAD)?)
                        .ok_or(BAD)?
                        .to_vec(),
                )
            }
            b'K' | b'M' | b'J' | 0x8a => Item::Int(c.int(op).ok_or(BAD)?),
            b'G' => {
                let s = c.take(8).ok_or(BAD)?;
                Item::Float(f64::from_be_bytes(s.try_into().map_err(|_| BAD)?))
            }
            0x88 => Item::Bool(true),
            0x89 => Item::Bool(false),
            b'N' => Item::None,
            b'h' | b'j' => {
                let i = c.uint(if op == b'h' { 1 } else { 4 }).ok_or(BAD)? as usize;
                let i = i.checked_sub(OBJECT_ARRAY_FIRST_MEMO).ok_or(BAD)?;
                memo.get(i).cloned().ok_or(BAD)?
            }
            _ => {
                return Err(
                    "a numpy object array with items other than str, int, float, bool, None \
                     and bytes (stowd does not pickle arbitrary objects again)",
                );
            }
        };
        last = Some(item.clone());
        items.push(item);
    }
    if c.take(3) != Some(b"\x94b.") || c.pos != p.len() || in_batch {
        return Err(BAD);
    }
    if n != items.len() as i128 {
        return Err("a numpy object array whose shape is not its item count");
    }
    items
        .into_iter()
        .map(|item| {
            let mut w = crate::msgpack::Writer::new();
            match item {
                Item::Str(s) => w.str(&s),
                Item::Bytes(b) => w.bin(&b),
                Item::Int(v) if v >= 0 => {
                    w.uint(u64::try_from(v).map_err(|_| "an int over 64 bits")?)
                }
                Item::Int(v) => w.sint(i64::try_from(v).map_err(|_| "an int over 64 bits")?),
                Item::Float(f) => w.f64(f),
                Item::Bool(b) => w.bool(b),
                Item::None => w.nil(),
            }
            w.finish().map_err(|_| "an item of 4 GiB or more")
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}
