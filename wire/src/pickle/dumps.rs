//! The writer: CPython's C pickler (`pickle.dumps(obj, protocol=5)`) for
//! trees of [`PValue`], byte for byte (see the parent module).

use super::{PValue, op};

const FRAME_HEADER: usize = 9;
const FRAME_SIZE_MIN: usize = 4;
const FRAME_SIZE_TARGET: usize = 64 * 1024;
const BATCHSIZE: usize = 1000;

/// Emulates the C pickler's output buffer and framing.
struct Writer {
    out: Vec<u8>,
    framing: bool,
    frame_start: Option<usize>,
}

impl Writer {
    fn write(&mut self, bytes: &[u8]) {
        if self.framing && self.frame_start.is_none() {
            self.frame_start = Some(self.out.len());
            self.out.extend_from_slice(&[0xfe; FRAME_HEADER]);
        }
        self.out.extend_from_slice(bytes);
    }

    fn commit_frame(&mut self) {
        let Some(start) = self.frame_start.take() else {
            return;
        };
        let len = self.out.len() - start - FRAME_HEADER;
        if len >= FRAME_SIZE_MIN {
            self.out[start] = op::FRAME;
            self.out[start + 1..start + FRAME_HEADER].copy_from_slice(&(len as u64).to_le_bytes());
        } else {
            self.out.drain(start..start + FRAME_HEADER);
        }
    }

    /// Called at the start of every `save()`, as CPython does.
    fn opcode_boundary(&mut self) {
        if let Some(start) = self.frame_start
            && self.out.len() - start - FRAME_HEADER >= FRAME_SIZE_TARGET
        {
            self.commit_frame();
        }
    }

    fn save(&mut self, v: &PValue) {
        self.opcode_boundary();
        match v {
            PValue::Int(i) => self.save_int(*i),
            PValue::Str(s) => {
                let n = s.len();
                let mut header = Vec::with_capacity(5);
                if n <= 0xff {
                    header.extend_from_slice(&[op::SHORT_BINUNICODE, n as u8]);
                } else {
                    header.push(op::BINUNICODE);
                    header.extend_from_slice(&(n.min(u32::MAX as usize) as u32).to_le_bytes());
                }
                if n >= FRAME_SIZE_TARGET {
                    // Large payloads bypass the frame, as in `_Pickler_write_bytes`.
                    self.commit_frame();
                    self.framing = false;
                    self.write(&header);
                    self.write(s.as_bytes());
                    self.framing = true;
                } else {
                    self.write(&header);
                    self.write(s.as_bytes());
                }
                self.write(&[op::MEMOIZE]);
            }
            PValue::Tuple(items) => match items.len() {
                0 => self.write(&[op::EMPTY_TUPLE]),
                n @ 1..=3 => {
                    items.iter().for_each(|x| self.save(x));
                    self.write(&[op::TUPLE1 + (n as u8 - 1), op::MEMOIZE]);
                }
                _ => {
                    self.write(&[op::MARK]);
                    items.iter().for_each(|x| self.save(x));
                    self.write(&[op::TUPLE, op::MEMOIZE]);
                }
            },
            PValue::List(items) => {
                self.write(&[op::EMPTY_LIST, op::MEMOIZE]);
                if let [only] = items.as_slice() {
                    self.save(only);
                    self.write(&[op::APPEND]);
                } else if !items.is_empty() {
                    for batch in items.chunks(BATCHSIZE) {
                        self.write(&[op::MARK]);
                        batch.iter().for_each(|x| self.save(x));
                        self.write(&[op::APPENDS]);
                    }
                }
            }
            PValue::Dict(items) => {
                self.write(&[op::EMPTY_DICT, op::MEMOIZE]);
                if let [(k, x)] = items.as_slice() {
                    self.save(k);
                    self.save(x);
                    self.write(&[op::SETITEM]);
                } else if !items.is_empty() {
                    for batch in items.chunks(BATCHSIZE) {
                        self.write(&[op::MARK]);
                        for (k, x) in batch {
                            self.save(k);
                            self.save(x);
                        }
                        self.write(&[op::SETITEMS]);
                    }
                    // CPython loops while the last batch was full, so a
                    // multiple of 1000 items ends with an empty batch.
                    if items.len() % BATCHSIZE == 0 {
                        self.write(&[op::MARK, op::SETITEMS]);
                    }
                }
            }
        }
    }

    fn save_int(&mut self, i: i128) {
        if let Ok(v) = u8::try_from(i) {
            self.write(&[op::BININT1, v]);
        } else if let Ok(v) = u16::try_from(i) {
            self.write(&[op::BININT2]);
            self.write(&v.to_le_bytes());
        } else if let Ok(v) = i32::try_from(i) {
            self.write(&[op::BININT]);
            self.write(&v.to_le_bytes());
        } else {
            // LONG1 with CPython's byte count: bit_length(|i|) / 8 + 1, minus
            // one redundant sign byte for some negatives.
            let nbits = 128 - i.unsigned_abs().leading_zeros() as usize;
            let mut n = (nbits >> 3) + 1;
            let le = i.to_le_bytes();
            let mut bytes = [0u8; 17];
            bytes[..16].copy_from_slice(&le);
            bytes[16] = if i < 0 { 0xff } else { 0 };
            if i < 0 && n > 1 && bytes[n - 1] == 0xff && bytes[n - 2] & 0x80 != 0 {
                n -= 1;
            }
            self.write(&[op::LONG1, n as u8]);
            self.write(&bytes[..n]);
        }
    }
}

/// Writes `v` exactly as CPython's `pickle.dumps(v, protocol=5)` would for a
/// tree of fresh objects.
pub fn dumps(v: &PValue) -> Vec<u8> {
    let mut w = Writer {
        out: vec![op::PROTO, 5],
        framing: true,
        frame_start: None,
    };
    w.save(v);
    w.write(&[op::STOP]);
    w.commit_frame();
    w.out
}

/// The `(dtype, shape, frame_index)` tuple of ext 3 and ext 5.
pub fn tensor_meta(dtype: &str, shape: &[u64], frame_index: usize) -> PValue {
    PValue::Tuple(vec![
        PValue::Str(dtype.to_owned()),
        PValue::Tuple(shape.iter().map(|&d| PValue::Int(d.into())).collect()),
        PValue::Int(frame_index as i128),
    ])
}

/// The ext 3 / ext 5 payload: `pickle.dumps((dtype, shape, frame_index), 5)`.
pub fn dumps_tensor_meta(dtype: &str, shape: &[u64], frame_index: usize) -> Vec<u8> {
    dumps(&tensor_meta(dtype, shape, frame_index))
}

/// The ext 4 payload: `pickle.dumps({"layout": layout, "tensors": [meta, ...]}, 5)`
/// where each meta is `(dtype, shape, frame_index)`.
pub fn dumps_nested_meta(layout: &str, tensors: &[(&str, &[u64], usize)]) -> Vec<u8> {
    let metas = tensors
        .iter()
        .map(|(d, s, i)| tensor_meta(d, s, *i))
        .collect();
    dumps(&PValue::Dict(vec![
        (PValue::Str("layout".into()), PValue::Str(layout.into())),
        (PValue::Str("tensors".into()), PValue::List(metas)),
    ]))
}
