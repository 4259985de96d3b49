//! A bounded reader and a byte-exact writer for the small pickle subset that
//! TransferQueue puts inside its msgpack ext 3, 4 and 5 payloads.
//!
//! The reader accepts exactly these opcodes: PROTO, FRAME, SHORT_BINUNICODE,
//! BINUNICODE, MEMOIZE, BININT1, BININT2, BININT, LONG1, EMPTY_TUPLE,
//! TUPLE1/2/3, MARK, TUPLE, EMPTY_LIST, APPEND, APPENDS, EMPTY_DICT, SETITEM,
//! SETITEMS, BINGET and STOP. Anything else is an error. It never allocates
//! from a declared size before checking it against the remaining input, caps
//! nesting at [`MAX_DEPTH`] and caps the number of values it builds (memo
//! copies included) in proportion to the input length.
//!
//! The writer reproduces CPython's C pickler (`pickle.dumps(obj, protocol=5)`)
//! for trees of these values: `PROTO 5`, frames of at least 64 KiB committed at
//! the start of each `save()`, frames shorter than 4 bytes left unframed,
//! strings of 64 KiB or more written outside frames, `MEMOIZE` after every
//! string, non-empty tuple, list and dict, and lists and dicts written in
//! batches of 1000 (including CPython's empty trailing `MARK SETITEMS` batch for
//! a dict of exactly 1000, 2000, ... items). A tree has no shared objects, so
//! the writer never emits `BINGET`; that matches TransferQueue, whose dtype
//! strings and shape tuples are fresh objects for every tensor.

mod dumps;

pub use dumps::{dumps, dumps_nested_meta, dumps_tensor_meta, tensor_meta};

/// Deepest nesting of containers the reader accepts (ext 4 needs 4).
pub const MAX_DEPTH: usize = 16;

/// A value of the supported pickle subset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PValue {
    /// A Python int (BININT1/BININT2/BININT/LONG1), limited to 128 bits.
    Int(i128),
    /// A Python str.
    Str(String),
    /// A Python tuple.
    Tuple(Vec<PValue>),
    /// A Python list.
    List(Vec<PValue>),
    /// A Python dict, in insertion order.
    Dict(Vec<(PValue, PValue)>),
}

impl PValue {
    /// The items of a tuple or a list.
    pub fn as_seq(&self) -> Option<&[PValue]> {
        match self {
            PValue::Tuple(v) | PValue::List(v) => Some(v),
            _ => None,
        }
    }

    /// The string, if this is a str.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            PValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The int, if this is an int.
    pub fn as_int(&self) -> Option<i128> {
        match self {
            PValue::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// Looks up a str key in a dict.
    pub fn get(&self, key: &str) -> Option<&PValue> {
        match self {
            PValue::Dict(items) => items
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// Number of values in this tree (itself included).
    fn nodes(&self) -> usize {
        match self {
            PValue::Int(_) | PValue::Str(_) => 1,
            PValue::Tuple(v) | PValue::List(v) => 1 + v.iter().map(PValue::nodes).sum::<usize>(),
            PValue::Dict(v) => 1 + v.iter().map(|(k, x)| k.nodes() + x.nodes()).sum::<usize>(),
        }
    }
}

/// Why a pickle could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PickleError {
    /// The input ends inside an opcode.
    #[error("pickle truncated at byte {0}")]
    Truncated(usize),
    /// An opcode outside the subset (GLOBAL, REDUCE, ... are never run).
    #[error("opcode 0x{op:02x} at byte {at} is outside the supported subset")]
    UnsupportedOpcode {
        /// The opcode byte.
        op: u8,
        /// Its offset.
        at: usize,
    },
    /// PROTO above 5.
    #[error("unsupported pickle protocol {0}")]
    Protocol(u8),
    /// A FRAME or string length larger than the rest of the input.
    #[error("declared length {len} at byte {at} exceeds the {remaining} bytes left")]
    Length {
        /// Declared length.
        len: u64,
        /// Offset of the opcode.
        at: usize,
        /// Bytes left after its header.
        remaining: usize,
    },
    /// A string that is not UTF-8.
    #[error("invalid UTF-8 in string at byte {0}")]
    Utf8(usize),
    /// A LONG1 longer than 16 bytes.
    #[error("integer at byte {0} does not fit in 128 bits")]
    IntTooLarge(usize),
    /// An opcode needs more values than the stack (above the last MARK) has.
    #[error("stack underflow at byte {0}")]
    Underflow(usize),
    /// Structurally wrong (APPEND to a non-list, odd SETITEMS, ...).
    #[error("{what} at byte {at}")]
    Malformed {
        /// What is wrong.
        what: &'static str,
        /// Offset of the opcode.
        at: usize,
    },
    /// BINGET of an unset memo slot or of a (mutable) list or dict.
    #[error("memo index {index} at byte {at} is not set or refers to a list or dict")]
    Memo {
        /// The memo index.
        index: usize,
        /// Offset of the opcode.
        at: usize,
    },
    /// Containers nested deeper than [`MAX_DEPTH`].
    #[error("nesting deeper than {MAX_DEPTH} at byte {0}")]
    TooDeep(usize),
    /// More values (memo copies included) than the input length justifies.
    #[error("pickle builds too many values")]
    TooManyValues,
    /// Bytes after STOP.
    #[error("data after STOP at byte {0}")]
    Trailing(usize),
    /// The input ends without STOP.
    #[error("pickle has no STOP")]
    NoStop,
}

mod op {
    pub const PROTO: u8 = 0x80;
    pub const FRAME: u8 = 0x95;
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE: u8 = b'X';
    pub const MEMOIZE: u8 = 0x94;
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const BININT: u8 = b'J';
    pub const LONG1: u8 = 0x8a;
    pub const EMPTY_TUPLE: u8 = b')';
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const MARK: u8 = b'(';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_LIST: u8 = b']';
    pub const APPEND: u8 = b'a';
    pub const APPENDS: u8 = b'e';
    pub const EMPTY_DICT: u8 = b'}';
    pub const SETITEM: u8 = b's';
    pub const SETITEMS: u8 = b'u';
    pub const BINGET: u8 = b'h';
    pub const STOP: u8 = b'.';
}

/// Largest number of entries one dict may have (keys are checked for
/// duplicates, quadratically; ext 4 dicts have two).
const MAX_DICT_LEN: usize = 256;

/// A memo entry: immutable values are kept; lists and dicts are recorded as
/// unavailable because Python memoizes them before they are filled.
enum Memo {
    Value(PValue),
    Mutable,
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
    /// Stack of (value, nesting depth).
    stack: Vec<(PValue, usize)>,
    marks: Vec<usize>,
    memo: Vec<Memo>,
    budget: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let remaining = self.data.len() - self.pos;
        if n > remaining {
            return Err(PickleError::Truncated(self.data.len()));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn spend(&mut self, nodes: usize) -> Result<(), PickleError> {
        self.budget = self
            .budget
            .checked_sub(nodes)
            .ok_or(PickleError::TooManyValues)?;
        Ok(())
    }

    fn push(&mut self, v: PValue, depth: usize, at: usize) -> Result<(), PickleError> {
        if depth > MAX_DEPTH {
            return Err(PickleError::TooDeep(at));
        }
        self.spend(1)?;
        self.stack.push((v, depth));
        Ok(())
    }

    /// Index in the stack of the first item above the innermost mark.
    fn fence(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self, at: usize) -> Result<(PValue, usize), PickleError> {
        if self.stack.len() <= self.fence() {
            return Err(PickleError::Underflow(at));
        }
        self.stack.pop().ok_or(PickleError::Underflow(at))
    }

    /// Pops everything above the innermost mark and the mark itself.
    fn pop_mark(&mut self, at: usize) -> Result<Vec<(PValue, usize)>, PickleError> {
        let m = self.marks.pop().ok_or(PickleError::Malformed {
            what: "no MARK on the stack",
            at,
        })?;
        Ok(self.stack.split_off(m))
    }

    fn string(&mut self, len: u64, at: usize) -> Result<(), PickleError> {
        let remaining = self.data.len() - self.pos;
        if len > remaining as u64 {
            return Err(PickleError::Length { len, at, remaining });
        }
        let raw = self.take(len as usize)?;
        let s = std::str::from_utf8(raw).map_err(|_| PickleError::Utf8(at))?;
        self.push(PValue::Str(s.to_owned()), 1, at)
    }

    fn tuple(&mut self, items: Vec<(PValue, usize)>, at: usize) -> Result<(), PickleError> {
        let depth = 1 + items.iter().map(|(_, d)| *d).max().unwrap_or(0);
        self.push(
            PValue::Tuple(items.into_iter().map(|(v, _)| v).collect()),
            depth,
            at,
        )
    }

    /// Appends `items` to the list on top of the stack.
    fn extend_list(&mut self, items: Vec<(PValue, usize)>, at: usize) -> Result<(), PickleError> {
        if self.stack.len() <= self.fence() {
            return Err(PickleError::Underflow(at));
        }
        let Some((PValue::List(list), depth)) = self.stack.last_mut() else {
            return Err(PickleError::Malformed {
                what: "APPEND to a non-list",
                at,
            });
        };
        for (v, d) in items {
            *depth = (*depth).max(d + 1);
            list.push(v);
        }
        if *depth > MAX_DEPTH {
            return Err(PickleError::TooDeep(at));
        }
        Ok(())
    }

    /// Sets `items` (key, value, key, value, ...) in the dict on top of the stack.
    fn extend_dict(&mut self, items: Vec<(PValue, usize)>, at: usize) -> Result<(), PickleError> {
        if !items.len().is_multiple_of(2) {
            return Err(PickleError::Malformed {
                what: "odd number of items for SETITEMS",
                at,
            });
        }
        if self.stack.len() <= self.fence() {
            return Err(PickleError::Underflow(at));
        }
        let Some((PValue::Dict(dict), depth)) = self.stack.last_mut() else {
            return Err(PickleError::Malformed {
                what: "SETITEM on a non-dict",
                at,
            });
        };
        let mut it = items.into_iter();
        while let (Some((k, dk)), Some((v, dv))) = (it.next(), it.next()) {
            if matches!(k, PValue::List(_) | PValue::Dict(_)) {
                return Err(PickleError::Malformed {
                    what: "unhashable dict key",
                    at,
                });
            }
            *depth = (*depth).max(dk.max(dv) + 1);
            if let Some(slot) = dict.iter_mut().find(|(old, _)| *old == k) {
                slot.1 = v;
            } else if dict.len() < MAX_DICT_LEN {
                dict.push((k, v));
            } else {
                return Err(PickleError::Malformed {
                    what: "dict too large",
                    at,
                });
            }
        }
        if *depth > MAX_DEPTH {
            return Err(PickleError::TooDeep(at));
        }
        Ok(())
    }

    fn run(mut self) -> Result<PValue, PickleError> {
        loop {
            let at = self.pos;
            let Ok(code) = self.u8() else {
                return Err(PickleError::NoStop);
            };
            match code {
                op::PROTO => {
                    let p = self.u8()?;
                    if p > 5 {
                        return Err(PickleError::Protocol(p));
                    }
                }
                op::FRAME => {
                    let len = u64::from_le_bytes(self.take(8)?.try_into().unwrap_or([0xff; 8]));
                    let remaining = self.data.len() - self.pos;
                    if len > remaining as u64 {
                        return Err(PickleError::Length { len, at, remaining });
                    }
                }
                op::SHORT_BINUNICODE => {
                    let len = self.u8()?;
                    self.string(len.into(), at)?;
                }
                op::BINUNICODE => {
                    let len = u32::from_le_bytes(self.take(4)?.try_into().unwrap_or([0xff; 4]));
                    self.string(len.into(), at)?;
                }
                op::MEMOIZE => {
                    let (top, _) = self.stack.last().ok_or(PickleError::Underflow(at))?;
                    let entry = match top {
                        PValue::List(_) | PValue::Dict(_) => Memo::Mutable,
                        v => Memo::Value(v.clone()),
                    };
                    if let Memo::Value(v) = &entry {
                        self.spend(v.nodes())?;
                    }
                    self.memo.push(entry);
                }
                op::BININT1 => {
                    let v = self.u8()?;
                    self.push(PValue::Int(v.into()), 1, at)?;
                }
                op::BININT2 => {
                    let b = self.take(2)?;
                    self.push(PValue::Int(u16::from_le_bytes([b[0], b[1]]).into()), 1, at)?;
                }
                op::BININT => {
                    let b = self.take(4)?;
                    self.push(
                        PValue::Int(i32::from_le_bytes([b[0], b[1], b[2], b[3]]).into()),
                        1,
                        at,
                    )?;
                }
                op::LONG1 => {
                    let n = usize::from(self.u8()?);
                    if n > 16 {
                        return Err(PickleError::IntTooLarge(at));
                    }
                    let b = self.take(n)?;
                    let fill = if b.last().is_some_and(|x| x & 0x80 != 0) {
                        0xff
                    } else {
                        0
                    };
                    let mut le = [fill; 16];
                    le[..n].copy_from_slice(b);
                    self.push(PValue::Int(i128::from_le_bytes(le)), 1, at)?;
                }
                op::EMPTY_TUPLE => self.push(PValue::Tuple(Vec::new()), 1, at)?,
                op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                    let n = usize::from(code - op::TUPLE1) + 1;
                    if self.stack.len() < self.fence() + n {
                        return Err(PickleError::Underflow(at));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.tuple(items, at)?;
                }
                op::MARK => {
                    self.spend(1)?;
                    self.marks.push(self.stack.len());
                }
                op::TUPLE => {
                    let items = self.pop_mark(at)?;
                    self.tuple(items, at)?;
                }
                op::EMPTY_LIST => self.push(PValue::List(Vec::new()), 1, at)?,
                op::APPEND => {
                    let item = self.pop(at)?;
                    self.extend_list(vec![item], at)?;
                }
                op::APPENDS => {
                    let items = self.pop_mark(at)?;
                    self.extend_list(items, at)?;
                }
                op::EMPTY_DICT => self.push(PValue::Dict(Vec::new()), 1, at)?,
                op::SETITEM => {
                    let v = self.pop(at)?;
                    let k = self.pop(at)?;
                    self.extend_dict(vec![k, v], at)?;
                }
                op::SETITEMS => {
                    let items = self.pop_mark(at)?;
                    self.extend_dict(items, at)?;
                }
                op::BINGET => {
                    let index = usize::from(self.u8()?);
                    let v = match self.memo.get(index) {
                        Some(Memo::Value(v)) => v.clone(),
                        _ => return Err(PickleError::Memo { index, at }),
                    };
                    let nodes = v.nodes();
                    self.spend(nodes.saturating_sub(1))?;
                    let depth = depth_of(&v);
                    self.push(v, depth, at)?;
                }
                op::STOP => {
                    if self.pos != self.data.len() {
                        return Err(PickleError::Trailing(self.pos));
                    }
                    if !self.marks.is_empty() || self.stack.len() != 1 {
                        return Err(PickleError::Malformed {
                            what: "STOP with a stack other than one value",
                            at,
                        });
                    }
                    return self
                        .stack
                        .pop()
                        .map(|(v, _)| v)
                        .ok_or(PickleError::Underflow(at));
                }
                other => return Err(PickleError::UnsupportedOpcode { op: other, at }),
            }
        }
    }
}

/// Nesting depth of a value that is already known to be within bounds.
fn depth_of(v: &PValue) -> usize {
    match v {
        PValue::Int(_) | PValue::Str(_) => 1,
        PValue::Tuple(x) | PValue::List(x) => 1 + x.iter().map(depth_of).max().unwrap_or(0),
        PValue::Dict(x) => {
            1 + x
                .iter()
                .map(|(k, v)| depth_of(k).max(depth_of(v)))
                .max()
                .unwrap_or(0)
        }
    }
}

/// Reads one pickle of the supported subset. The whole input must be the
/// pickle: bytes after STOP are an error.
pub fn loads(data: &[u8]) -> Result<PValue, PickleError> {
    let budget = data.len().saturating_mul(8).saturating_add(64);
    Reader {
        data,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        budget,
    }
    .run()
}
