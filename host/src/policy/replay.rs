//! A selection call shaped like one of its chain's last: the same
//! decisions again, without asking.
//!
//! A job's small puts come one after the other with the same fields, rows
//! and units: each asks the selection chain the same requests, field
//! layouts and unit positions alike, and the chain answers the same. With
//! the bundled plugins every answer already came from the plugins' memos,
//! yet the chain's walk of them (a memo key a run, a lookup, a plan copied
//! and validated, the bookkeeping of 40 requests) was about 12,600
//! instructions of a 10-field, 4-row put in `stowd`, twice the built-in's
//! 6,100 (callgrind, `docs/benchmarks.md`, "A put shaped like the last").
//!
//! So a chain keeps its last calls' [`Shape`]s and decisions (up to
//! [`KEPT_CALLS`], the latest first), each when asking could only have
//! read memos:
//! - the caller gave the call's shape (a put's fields by its units, each
//!   unit's positions at most [`MAX_POSITIONS`]);
//! - every plugin of the chain memoizes, and with plugins every field is
//!   regular (a memo keys regular fields only; the built-in alone decides
//!   any kind by its positions);
//! - in that call no plugin was entered (every answer came from a memo),
//!   none faulted or answered an invalid plan, none was disabled or
//!   re-enabled.
//!
//! A call of a kept shape on the same policies, none of them disabled
//! now, takes those decisions again. A pure plugin answers a key as it
//! did (the memo rests on that), and a plan's validity depends only on the
//! layout and positions, so these are the decisions asking would give.
//! Each plugin is counted as asking would have counted it: the calls it
//! answered, the memo hits and the plans it gave. A call traced at
//! DEBUG (the `policy` span enabled) always asks, so its log is whole.
//!
//! Making a call's shape costs about as much as a replay saves when no
//! kept shape comes back: after [`SAMPLE`] calls without a replay, only
//! one call in [`SAMPLE`] is given its shape ([`Last::wants_shape`]).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use super::FieldKind;
use super::chain::{Loaded, Shared};
use crate::batch::Field;

/// Positions of one request at most, for its call to be kept or replayed
/// (a small call's; a large one's decisions cost little next to its rows).
pub const MAX_POSITIONS: usize = 64;

/// Words of a call's shape at most (32 KiB): a call over it is not kept.
pub const MAX_WORDS: usize = 4096;

/// A call's requests as words. A put asks about each of its fields (of one
/// chain) at each unit that gets rows, unit by unit: a grid of fields by
/// units' positions. Its shape is each field's kind and layout, then each
/// unit's positions: a put of 10 fields on 4 units is 14 entries, not 40.
/// Two calls of equal shapes ask the same requests (the same layouts at
/// the same positions, a unit's fields sharing its positions) and so get
/// the same decisions from the same chain.
pub struct Shape(Vec<u64>);

thread_local! {
    /// This thread's shape buffer, reused from call to call.
    static WORDS: std::cell::Cell<Vec<u64>> = const { std::cell::Cell::new(Vec::new()) };
}

impl Shape {
    /// The shape of the requests `fields` x `units` (each unit's fields in
    /// `fields`' order, unit after unit) for a chain of `policies`, or
    /// `None` if such a call is neither kept nor replayed (see the module
    /// doc).
    pub fn grid<'a>(
        policies: &[Loaded],
        fields: impl ExactSizeIterator<Item = &'a Field>,
        units: impl ExactSizeIterator<Item = &'a [u64]>,
    ) -> Option<Shape> {
        if !policies.iter().all(|l| l.policy.memoizes()) {
            return None;
        }
        let regular_only = !policies.is_empty();
        let mut w = Shape(WORDS.take());
        w.0.clear();
        // A field is 4 words and its dimensions, a unit a word and its
        // positions: room for the usual 2-dimensional field and 16
        // positions a unit, so the words are written without growing.
        w.0.reserve(2 + 6 * fields.len() + 17 * units.len());
        w.0.extend([fields.len() as u64, units.len() as u64]);
        for field in fields {
            match field {
                Field::Regular(t) => {
                    let shape = t.shape();
                    // The layout a memo keys: dtype, first stride, shape.
                    w.0.extend([
                        FieldKind::Regular as u64,
                        t.dtype() as u64,
                        t.first_stride() as u64,
                        shape.len() as u64,
                    ]);
                    w.0.extend_from_slice(shape);
                }
                Field::Nested(_) | Field::Values(_) if regular_only => return None,
                Field::Nested(_) => w.0.push(FieldKind::Nested as u64),
                Field::Values(_) => w.0.push(FieldKind::Values as u64),
            }
        }
        for positions in units {
            if positions.len() > MAX_POSITIONS {
                return None;
            }
            w.0.push(positions.len() as u64);
            w.0.extend_from_slice(positions);
        }
        (w.0.len() <= MAX_WORDS).then_some(w)
    }
}

impl Drop for Shape {
    fn drop(&mut self) {
        if self.0.capacity() <= MAX_WORDS * 2 {
            WORDS.set(std::mem::take(&mut self.0));
        }
    }
}

/// What one plugin was counted for a kept call (no entries: every
/// answer from its memo).
#[derive(Clone, Copy, Default, Debug)]
pub struct Counts {
    pub calls: u64,
    pub plans: u64,
    pub memo_hits: u64,
}

/// A kept call: the chain's policies then, the call's shape, its
/// decisions and each plugin's counts.
struct Kept {
    /// Each policy and its counters, by address.
    policies: SmallVec<[(usize, usize); 4]>,
    shape: Shape,
    decided: Arc<Vec<Shared>>,
    counts: SmallVec<[Counts; 4]>,
}

/// Calls a chain keeps: a job that puts a few kinds of batch in turn (the
/// prompts, then the responses, then the rewards) replays each.
pub const KEPT_CALLS: usize = 4;

/// After this many calls without a replay, one call in this many is given
/// its shape ([`Last::wants_shape`]).
pub const SAMPLE: u32 = 8;

/// A chain's last kept calls, the latest first, and how many calls took
/// their decisions. A chain's clone starts with none (its policies may be
/// changed).
#[derive(Default)]
pub struct Last {
    kept: Mutex<SmallVec<[Kept; KEPT_CALLS]>>,
    replays: AtomicU64,
    /// Calls since the last replay (see [`Last::wants_shape`]).
    since: AtomicU32,
}

impl Clone for Last {
    fn clone(&self) -> Self {
        Last::default()
    }
}

impl std::fmt::Debug for Last {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Last")
    }
}

fn identity(policies: &[Loaded]) -> impl Iterator<Item = (usize, usize)> + '_ {
    policies.iter().map(|l| {
        (
            Arc::as_ptr(&l.policy) as *const () as usize,
            Arc::as_ptr(&l.stats) as usize,
        )
    })
}

impl Last {
    /// The decisions of the kept call of this `shape` on the same
    /// policies, none disabled: each plugin counted as asking would have.
    /// `None` (ask) otherwise, or while another call holds the kept ones.
    pub fn replay(&self, policies: &[Loaded], shape: &Shape) -> Option<Arc<Vec<Shared>>> {
        let mut all = self.kept.try_lock().ok()?;
        let at = all.iter().position(|k| k.shape.0 == shape.0)?;
        if at > 0 {
            // The latest first: a call replayed goes to the front.
            all[..=at].rotate_right(1);
        }
        let kept = &all[0];
        if kept.policies.len() != policies.len()
            || !identity(policies).eq(kept.policies.iter().copied())
            || policies.iter().any(|l| l.stats.disabled.load(Relaxed))
        {
            return None;
        }
        for (l, c) in policies.iter().zip(&kept.counts) {
            for (stat, n) in [
                (&l.stats.calls, c.calls),
                (&l.stats.plans, c.plans),
                (&l.stats.memo_hits, c.memo_hits),
            ] {
                if n > 0 {
                    stat.fetch_add(n, Relaxed);
                }
            }
        }
        self.replays.fetch_add(1, Relaxed);
        self.since.store(0, Relaxed);
        Some(kept.decided.clone())
    }

    /// Whether the next call should be given its shape: yes for the first
    /// [`SAMPLE`] calls after a replay, then for one call in [`SAMPLE`].
    /// A job whose puts never repeat a shape (each of another length, or
    /// more kinds in turn than are kept) would otherwise pay for every
    /// shape and keep (about 2,000 instructions of a 10-field, 4-row put);
    /// one that settles into a kept shape is replayed again within
    /// 2 x [`SAMPLE`] calls.
    pub fn wants_shape(&self) -> bool {
        let n = self.since.fetch_add(1, Relaxed);
        if n == u32::MAX {
            self.since.store(SAMPLE, Relaxed);
        }
        n < SAMPLE || n.is_multiple_of(SAMPLE)
    }

    /// Calls that took a kept call's decisions.
    pub fn replays(&self) -> u64 {
        self.replays.load(Relaxed)
    }

    /// Keeps a call that only read memos (see the module doc): its shape,
    /// decisions and each policy's counts, in the chain's order.
    pub fn keep(
        &self,
        policies: &[Loaded],
        shape: Shape,
        decided: &Arc<Vec<Shared>>,
        counts: SmallVec<[Counts; 4]>,
    ) {
        let Ok(mut all) = self.kept.try_lock() else {
            return;
        };
        // A shape kept once: an older call of it (whose plugins' answers a
        // reload or a disable and re-enable may since have changed) goes.
        all.retain(|k| k.shape.0 != shape.0);
        all.truncate(KEPT_CALLS - 1);
        all.insert(
            0,
            Kept {
                policies: identity(policies).collect(),
                shape,
                decided: decided.clone(),
                counts,
            },
        );
    }
}
