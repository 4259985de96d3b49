//! Memoized answers of pure policies.
//!
//! A `stowage:policy@0.2.0` plugin that describes itself as `pure` decides
//! from the field's layout and the positions alone (its `read` traps), so
//! the same layout and positions always get the same answer. A training
//! loop that puts the same shapes every step then pays one call per shape.
//!
//! The key is what such a policy can see of a regular field, without loss:
//! dtype, shape and the first stride (the other strides, rows, byte lengths
//! and row shapes follow from them: rows are C contiguous), and the positions, either as (start, step, count) when they have
//! one constant positive step or as the exact list. Nested and values
//! fields are not memoized: their layout is per row, and a key holding
//! every row's shape would cost what the call costs.
//!
//! Bounds: a position list of more than [`MAX_KEY_POSITIONS`] that is not a
//! constant stride is not memoized, nor a plan of more than
//! [`MAX_PLAN_WORDS`] row numbers; the memo holds at most its capacity
//! (`[plugins] memo_entries`, [`DEFAULT_ENTRIES`] by default, 0 turns
//! memoization off) in two generations ([`Generations`]: the older half is
//! dropped when the newer fills), so it never holds more than about
//! `entries * ((MAX_KEY_POSITIONS + MAX_PLAN_WORDS) * 8 + 200)` bytes
//! (300 KiB at the default). The default is small on purpose: a training
//! loop repeats a few dozen layouts, while every entry is a few small
//! allocations that live on in whichever malloc arena the deciding thread
//! used. Measured with the 64-client load test (random shapes and
//! positions, so the memo churns): with 4,096 entries of up to 256
//! positions stowd kept 28-35 MiB over its baseline after the clients left
//! (glibc arenas pinned by scattered live entries: 6.9 MB in use against
//! 5.4 MB before the memo existed), with 256 entries of up to 64, 13-14
//! MiB, as before the memo (5-12 MiB).
//! Only plans and `not-applicable` / `invalid-input` answers are kept:
//! faults and `failed` are never memoized, and the chain validates a
//! memoized plan again like any other.
//!
//! A pure policy's `pack` answers have a memo of their own, of the same
//! capacity ([`Memo`] is generic over the answer): a packing policy sees
//! only the limits and each piece's length and contiguity, and that is the
//! key ([`encode_pack`]), for calls of at most [`MAX_KEY_PIECES`] pieces; a
//! plan of more than [`MAX_PLAN_WORDS`] piece indexes is not kept. So it
//! holds at most about `entries * ((4 + 2 * MAX_KEY_PIECES +
//! MAX_PLAN_WORDS) * 8 + 200)` bytes (450 KiB at the default).

use std::collections::HashMap;
use std::sync::Mutex;

use rustc_hash::FxBuildHasher;

use crate::batch::Field;
use crate::plan::{Frame, FramePlan, PackLimits, Piece, PieceInfo, SelectionPlan};
use crate::policy::PolicyError;

/// Longest position list kept in a key (constant strides have no limit).
pub const MAX_KEY_POSITIONS: usize = 64;
/// Most pieces a memoized `pack` call may have.
pub const MAX_KEY_PIECES: usize = 64;
/// Largest plan kept, in row numbers listed by its pieces.
pub const MAX_PLAN_WORDS: usize = 64;
/// Entries before the memo is emptied, by default.
pub const DEFAULT_ENTRIES: usize = 256;

/// Appends the key of a request to `out` and returns true, or returns
/// false (leaving `out` as it was) if the request is not memoized.
///
/// The key is one run of words, each part prefixed by its length, so two
/// requests share a key only if they share every part: dtype, shape,
/// strides, and the positions, as `[0, start, step, count]` when they have
/// one constant positive step (one position: step 0) or as `[1, len,
/// positions...]`. Encoding into a caller's buffer lets a memo hit cost no
/// allocation for the key.
pub fn encode(field: &Field, positions: &[u64], out: &mut Vec<u64>) -> bool {
    let Field::Regular(t) = field else {
        return false;
    };
    let stride = match positions {
        [] => return false,
        [one] => Some((*one, 0)),
        [a, b, ..] => b
            .checked_sub(*a)
            .filter(|&s| s > 0)
            .filter(|&s| {
                positions
                    .windows(2)
                    .all(|w| w[1].checked_sub(w[0]) == Some(s))
            })
            .map(|s| (*a, s)),
    };
    if stride.is_none() && positions.len() > MAX_KEY_POSITIONS {
        return false;
    }
    out.push(t.dtype() as u64);
    out.push(t.shape().len() as u64);
    out.extend_from_slice(t.shape());
    out.push(t.first_stride() as u64);
    match stride {
        Some((start, step)) => out.extend_from_slice(&[0, start, step, positions.len() as u64]),
        None => {
            out.extend_from_slice(&[1, positions.len() as u64]);
            out.extend_from_slice(positions);
        }
    }
    true
}

/// Whether two fields have the same key parts but the positions: both
/// regular, of one dtype, shape and first stride ([`encode`] at the same
/// positions gives both the same key).
pub fn same_layout(a: &Field, b: &Field) -> bool {
    match (a, b) {
        (Field::Regular(a), Field::Regular(b)) => a.same_layout(b),
        _ => false,
    }
}

/// Row numbers a plan lists (a view counts one).
fn plan_words(plan: &SelectionPlan) -> usize {
    plan.pieces
        .iter()
        .map(|p| match p {
            Piece::View(_) => 1,
            Piece::Gather(r) | Piece::RowViews(r) | Piece::Concat(r) => r.len(),
        })
        .sum()
}

/// An answer a pure policy may have kept for it: a selection answer
/// ([`SelectAnswer`]) or a packing one ([`PackAnswer`]).
pub trait Kept: Clone {
    /// True if the answer is worth keeping: a plan or a decline (never a
    /// fault or `failed`), and small.
    fn keep(&self) -> bool;
}

/// A `select` answer, as memoized.
pub type SelectAnswer = Result<SelectionPlan, PolicyError>;
/// A `pack` answer, as memoized.
pub type PackAnswer = Result<FramePlan, PolicyError>;

/// A kept decline or a fault, as [`Kept::keep`] sees it.
fn keeps_error(e: &PolicyError) -> bool {
    match e {
        PolicyError::NotApplicable | PolicyError::InvalidInput(_) => true,
        PolicyError::Failed(_) | PolicyError::Fault(_) => false,
    }
}

impl Kept for SelectAnswer {
    fn keep(&self) -> bool {
        match self {
            Ok(plan) => plan_words(plan) <= MAX_PLAN_WORDS,
            Err(e) => keeps_error(e),
        }
    }
}

impl Kept for PackAnswer {
    fn keep(&self) -> bool {
        match self {
            Ok(plan) => keeps_frame_plan(plan),
            Err(e) => keeps_error(e),
        }
    }
}

/// Whether a pack memo keeps `plan`: at most [`MAX_PLAN_WORDS`] piece
/// indexes.
pub fn keeps_frame_plan(plan: &FramePlan) -> bool {
    let words = plan.frames.iter().map(|f| match f {
        Frame::Single(_) => 1,
        Frame::Coalesced(p) => p.len(),
    });
    words.sum::<usize>() <= MAX_PLAN_WORDS
}

/// An answer a pure policy gave, by its encoded key.
type Answers<A> = HashMap<Box<[u64]>, A, FxBuildHasher>;

/// The memo, locked for a run of lookups or insertions.
pub struct Locked<'a, A = SelectAnswer>(std::sync::MutexGuard<'a, Generations<A>>, usize);

/// The answers, in two generations: new answers go to `current`; when it
/// holds half the capacity it becomes `previous` (the older generation is
/// dropped), and a hit in `previous` moves back into `current`. So a key
/// asked for again before half the capacity of other answers came in is
/// still answered, however many keys pass through in all (emptying one map
/// at capacity answered nothing once the keys in use outgrew it: 0 hits in
/// `stowd plugin bench`, whose suite has more cases than the default).
#[derive(Debug)]
pub struct Generations<A> {
    current: Answers<A>,
    previous: Answers<A>,
}

impl<A> Default for Generations<A> {
    fn default() -> Self {
        Generations {
            current: HashMap::default(),
            previous: HashMap::default(),
        }
    }
}

impl<A: Kept> Locked<'_, A> {
    /// The answer given before for `key`, if any.
    pub fn get(&mut self, key: &[u64]) -> Option<A> {
        if let Some(hit) = self.0.current.get(key) {
            return Some(hit.clone());
        }
        let (key, hit) = self.0.previous.remove_entry(key)?;
        self.insert(key, hit.clone());
        Some(hit)
    }

    fn insert(&mut self, key: Box<[u64]>, answer: A) {
        let half = self.1.div_ceil(2);
        let g = &mut *self.0;
        if g.current.len() >= half {
            g.previous = std::mem::take(&mut g.current);
        }
        g.current.insert(key, answer);
    }

    /// Keeps `answer` for `key` if it is a plan or a decline, and small.
    pub fn put(&mut self, key: &[u64], answer: &A) {
        if !answer.keep() || self.1 == 0 {
            return;
        }
        self.insert(key.into(), answer.clone());
    }
}

/// The answers a pure policy gave, by key.
#[derive(Debug)]
pub struct Memo<A = SelectAnswer> {
    map: Mutex<Generations<A>>,
    capacity: usize,
}

impl<A> Default for Memo<A> {
    fn default() -> Self {
        Memo::new(0)
    }
}

impl<A> Memo<A> {
    /// A memo of at most `capacity` answers (0: keeps nothing).
    pub fn new(capacity: usize) -> Memo<A> {
        Memo {
            map: Mutex::new(Generations::default()),
            capacity,
        }
    }

    /// True if the memo keeps answers at all.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Locks the memo for a run of lookups or insertions (one request's).
    pub fn lock(&self) -> Locked<'_, A> {
        Locked(
            self.map.lock().unwrap_or_else(|p| p.into_inner()),
            self.capacity,
        )
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        let g = self.map.lock().unwrap_or_else(|p| p.into_inner());
        g.current.len() + g.previous.len()
    }

    /// True if nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every answer.
    pub fn clear(&self) {
        *self.map.lock().unwrap_or_else(|p| p.into_inner()) = Generations::default();
    }
}

impl<A: Kept> Memo<A> {
    /// The answer given before for `key`, if any.
    pub fn get(&self, key: &[u64]) -> Option<A> {
        self.lock().get(key)
    }

    /// Keeps `answer` for `key` if it is a plan or a decline, and small.
    pub fn put(&self, key: &[u64], answer: &A) {
        self.lock().put(key, answer)
    }
}

/// Appends the key of a `pack` call to `out` and returns true, or returns
/// false (leaving `out` as it was) when it has more than
/// [`MAX_KEY_PIECES`] pieces (then it is not memoized). The key is all a
/// packing policy sees: the limits, then each piece's length and whether
/// it is contiguous, so two calls share a key only if they are the same
/// call.
pub fn encode_pack(pieces: &[PieceInfo], limits: &PackLimits, out: &mut Vec<u64>) -> bool {
    if pieces.len() > MAX_KEY_PIECES {
        return false;
    }
    out.reserve(4 + 2 * pieces.len());
    out.extend_from_slice(&[
        u64::from(limits.max_frames),
        limits.max_frame_bytes,
        limits.small_threshold,
        pieces.len() as u64,
    ]);
    for p in pieces {
        out.extend_from_slice(&[p.byte_len, u64::from(p.contiguous)]);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::RowView;
    use crate::tensor::{Dtype, Tensor};
    use bytes::Bytes;

    fn field(rows: u64, cols: u64, dtype: Dtype) -> Field {
        let bytes = (rows * cols * dtype.itemsize() as u64) as usize;
        Field::Regular(
            Tensor::contiguous(Bytes::from(vec![0u8; bytes]), dtype, vec![rows, cols]).unwrap(),
        )
    }

    fn key_of(f: &Field, p: &[u64]) -> Option<Vec<u64>> {
        let mut out = vec![];
        encode(f, p, &mut out).then_some(out)
    }

    #[test]
    fn the_key_loses_nothing_a_pure_policy_sees() {
        let f = field(100, 4, Dtype::Float32);
        let k = |f: &Field, p: &[u64]| key_of(f, p).unwrap();
        // A constant stride is compressed, and only an equal list matches.
        assert_eq!(k(&f, &[3, 7, 11]), k(&f, &[3, 7, 11]));
        assert_ne!(k(&f, &[3, 7, 11]), k(&f, &[3, 7, 11, 15]));
        assert_ne!(k(&f, &[3, 7, 11]), k(&f, &[3, 7, 12]));
        assert_ne!(k(&f, &[3]), k(&f, &[4]));
        // Order matters: [7, 3] is not [3, 7].
        assert_ne!(k(&f, &[7, 3]), k(&f, &[3, 7]));
        // Layout: rows, row shape, dtype and strides are all in the key.
        assert_ne!(k(&f, &[1]), k(&field(101, 4, Dtype::Float32), &[1]));
        assert_ne!(k(&f, &[1]), k(&field(100, 2, Dtype::Float32), &[1]));
        assert_ne!(k(&f, &[1]), k(&field(100, 4, Dtype::Int32), &[1]));
        let Field::Regular(t) = &f else {
            unreachable!()
        };
        let view = t.rows_view(0, 2, 50).unwrap();
        // The key keeps the first stride: the others follow from the shape.
        assert_eq!(view.first_stride(), view.strides()[0]);
        assert_eq!(t.first_stride(), t.strides()[0]);
        let strided = Field::Regular(view);
        let dense = field(50, 4, Dtype::Float32);
        assert_ne!(k(&strided, &[1]), k(&dense, &[1]));
        // Not memoized: long irregular lists, nested fields, no positions.
        let long: Vec<u64> = (0..100).map(|i| i * i).collect();
        assert!(key_of(&field(1_000_000, 1, Dtype::Uint8), &long).is_none());
        let stride: Vec<u64> = (0..1000).map(|i| i * 3).collect();
        assert!(key_of(&field(3000, 1, Dtype::Uint8), &stride).is_some());
        assert!(key_of(&Field::Nested(vec![]), &[0]).is_none());
        assert!(key_of(&f, &[]).is_none());
    }

    #[test]
    fn only_small_plans_and_declines_are_kept_and_the_memo_is_bounded() {
        let memo = Memo::new(DEFAULT_ENTRIES);
        let f = field(10_000, 1, Dtype::Uint8);
        let key = |i: u64| key_of(&f, &[i]).unwrap();
        let plan = SelectionPlan::single(Piece::View(RowView::single(1)));
        memo.put(&key(1), &Ok(plan.clone()));
        memo.put(&key(2), &Err(PolicyError::NotApplicable));
        memo.put(&key(3), &Err(PolicyError::Failed("no".into())));
        let big = SelectionPlan::single(Piece::Gather((0..100).collect()));
        memo.put(&key(4), &Ok(big));
        assert_eq!(memo.get(&key(1)), Some(Ok(plan)));
        assert_eq!(memo.get(&key(2)), Some(Err(PolicyError::NotApplicable)));
        assert_eq!(memo.get(&key(3)), None, "a failure is never memoized");
        assert_eq!(memo.get(&key(4)), None, "a large plan is not kept");
        for i in 10..(10 + DEFAULT_ENTRIES as u64) {
            memo.put(&key(i), &Err(PolicyError::NotApplicable));
        }
        assert!(memo.len() <= DEFAULT_ENTRIES);
        // Keys in use stay answered while ten times the capacity of other
        // keys passes through.
        let memo: Memo = Memo::new(64);
        let hot: Vec<Vec<u64>> = (0..8).map(key).collect();
        for k in &hot {
            memo.put(k, &Err(PolicyError::NotApplicable));
        }
        for i in 1000..1640u64 {
            memo.put(&key(i), &Err(PolicyError::NotApplicable));
            for k in &hot {
                assert!(memo.get(k).is_some(), "hot key {k:?} lost at {i}");
            }
            assert!(memo.len() <= 64);
        }
        // A cold key is gone once a generation passed.
        assert!(memo.get(&key(1000)).is_none());
        memo.clear();
        assert!(memo.is_empty());
        let off: Memo = Memo::new(0);
        off.put(&key(1), &Err(PolicyError::NotApplicable));
        assert!(!off.enabled() && off.is_empty());
    }

    /// A pack key holds the limits and every piece's length and
    /// contiguity; more than `MAX_KEY_PIECES` pieces give none. Only small
    /// plans and declines are kept.
    #[test]
    fn a_pack_key_loses_nothing_and_only_small_answers_are_kept() {
        let limits = PackLimits {
            max_frames: 8,
            max_frame_bytes: 1 << 20,
            small_threshold: 0,
        };
        let key = |pieces: &[PieceInfo], limits: &PackLimits| {
            let mut out = vec![];
            encode_pack(pieces, limits, &mut out).then_some(out)
        };
        let four = vec![PieceInfo::contiguous(64); 4];
        let k = key(&four, &limits).unwrap();
        assert_eq!(key(&four, &limits), Some(k.clone()));
        let mut other = four.clone();
        other[1].contiguous = false;
        assert_ne!(key(&other, &limits), Some(k.clone()));
        other = four.clone();
        other[3].byte_len = 65;
        assert_ne!(key(&other, &limits), Some(k.clone()));
        assert_ne!(key(&four[..3], &limits), Some(k.clone()));
        for changed in [
            PackLimits {
                max_frames: 9,
                ..limits
            },
            PackLimits {
                max_frame_bytes: 1,
                ..limits
            },
            PackLimits {
                small_threshold: 1,
                ..limits
            },
        ] {
            assert_ne!(key(&four, &changed), Some(k.clone()));
        }
        assert!(key(&vec![PieceInfo::contiguous(1); MAX_KEY_PIECES], &limits).is_some());
        assert_eq!(
            key(&vec![PieceInfo::contiguous(1); MAX_KEY_PIECES + 1], &limits),
            None
        );

        let memo: Memo<PackAnswer> = Memo::new(4);
        let small = FramePlan::one_per_piece(4);
        memo.put(&k, &Ok(small.clone()));
        assert_eq!(memo.get(&k), Some(Ok(small)));
        let big = FramePlan::one_per_piece(MAX_PLAN_WORDS + 1);
        let faults = [
            Err(PolicyError::Failed("no".into())),
            Err(PolicyError::Fault(crate::policy::Fault::Timeout)),
            Ok(big),
        ];
        for (i, answer) in faults.iter().enumerate() {
            let other = [i as u64];
            memo.put(&other, answer);
            assert_eq!(memo.get(&other), None, "{answer:?}");
        }
        memo.put(&[9], &Err(PolicyError::NotApplicable));
        assert_eq!(memo.get(&[9]), Some(Err(PolicyError::NotApplicable)));
    }
}
