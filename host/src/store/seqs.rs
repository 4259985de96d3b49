//! How a get names rows to a unit, and how a column knows its rows'
//! global indexes: both as arithmetic runs where they are, so that a get
//! of rows in put order costs one lookup per run ([`super::Unit::get_seqs`]).

/// Requested global indexes `start + k * step` (`k < count`), answering
/// request positions `pos + k * pos_step`: how a get reaches a unit
/// ([`super::Unit::get_seqs`]), a run of the request routed to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seq {
    pub start: u64,
    pub step: u64,
    pub count: u64,
    pub pos: u64,
    pub pos_step: u64,
}

impl Seq {
    /// Index `k` and the position it answers.
    pub(super) fn at(&self, k: u64) -> (u64, u64) {
        (
            self.start.wrapping_add(k.wrapping_mul(self.step)),
            self.pos + k * self.pos_step,
        )
    }

    /// `list` as runs, position `i` answering `list[i]`.
    pub fn from_list(list: &[u64]) -> Vec<Seq> {
        Seq::from_indexes(&stowage_wire::indexes::Indexes::from_list(list))
    }

    /// The runs of `indexes`, position `i` answering its `i`-th index.
    pub fn from_indexes(indexes: &stowage_wire::indexes::Indexes) -> Vec<Seq> {
        let mut pos = 0;
        indexes
            .runs()
            .iter()
            .map(|r| {
                let s = Seq {
                    start: r.start,
                    step: r.step,
                    count: r.count,
                    pos,
                    pos_step: 1,
                };
                pos += r.count;
                s
            })
            .collect()
    }
}

/// The global indexes of a column's rows: arithmetic (row `r + 1`'s is
/// row `r`'s plus `step`: two words for any row count, what a put in index
/// order stores) or a list.
#[derive(Clone)]
pub(super) enum ColIndexes {
    Arith { step: u64, len: u64 },
    List(Box<[u64]>),
}

impl ColIndexes {
    pub(super) fn new(indexes: &[u64]) -> ColIndexes {
        let step = match indexes {
            [] | [_] => Some(1),
            [a, b, ..] if b > a => {
                let step = b - a;
                indexes
                    .windows(2)
                    .all(|w| w[1] > w[0] && w[1] - w[0] == step)
                    .then_some(step)
            }
            _ => None,
        };
        match step {
            Some(step) => ColIndexes::Arith {
                step,
                len: indexes.len() as u64,
            },
            None => ColIndexes::List(indexes.into()),
        }
    }

    pub(super) fn len(&self) -> u64 {
        match self {
            ColIndexes::Arith { len, .. } => *len,
            ColIndexes::List(l) => l.len() as u64,
        }
    }

    /// How many of `g, g + step, ...` (at most `max`) are the indexes of
    /// rows `row, row + 1, ...` (`g` is row `row`'s).
    pub(super) fn follow(&self, row: u32, g: u64, step: u64, max: u64) -> u64 {
        let left = (self.len() - u64::from(row)).min(max);
        match self {
            ColIndexes::Arith { step: s, .. } => {
                if *s == step {
                    left
                } else {
                    1
                }
            }
            ColIndexes::List(list) => {
                let row = row as usize;
                let mut m = 1u64;
                while m < left && list[row + m as usize] == g.wrapping_add(m.wrapping_mul(step)) {
                    m += 1;
                }
                m
            }
        }
    }
}
