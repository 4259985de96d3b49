//! Global indexes as arithmetic runs: `start, start + step, ...`, `count`
//! of them.
//!
//! A get of half a million rows in put order names them as one run, not
//! as half a million integers, so that decoding, routing and looking them
//! up cost per run, not per row. A list of integers becomes runs by
//! [`Indexes::from_list`] (one pass; a list with no pattern is runs of one
//! or two).

/// `count` global indexes from `start`, each `step` after the one before
/// (`step` 0 repeats `start`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexRun {
    pub start: u64,
    pub count: u64,
    pub step: u64,
}

impl IndexRun {
    /// The `k`-th index of the run (`k < count`).
    pub fn at(&self, k: u64) -> u64 {
        self.start + k * self.step
    }

    /// The last index, if the run is not empty and does not pass `u64::MAX`.
    pub fn last(&self) -> Option<u64> {
        let k = self.count.checked_sub(1)?;
        k.checked_mul(self.step)?.checked_add(self.start)
    }
}

/// Global indexes, in order, as runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Indexes {
    runs: Vec<IndexRun>,
    len: u64,
}

/// Why runs cannot be [`Indexes`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RunsError {
    #[error("a range of 0 indexes (range {0})")]
    Empty(usize),
    #[error("a range with step 0 (range {0}): a range names each index once")]
    ZeroStep(usize),
    #[error("range {0} runs past the largest global index (2^64 - 1)")]
    Overflow(usize),
    #[error("the ranges name {0} global indexes or more, the limit is {1}")]
    TooMany(u64, u64),
}

impl Indexes {
    /// The indexes of `list`, in its order, as maximal runs (greedy: a run
    /// goes on while the step stays the same).
    pub fn from_list(list: &[u64]) -> Indexes {
        let mut runs: Vec<IndexRun> = Vec::new();
        let mut i = 0;
        while i < list.len() {
            let start = list[i];
            let step = match list.get(i + 1) {
                Some(&next) if next >= start => next - start,
                _ => {
                    runs.push(IndexRun {
                        start,
                        count: 1,
                        step: 0,
                    });
                    i += 1;
                    continue;
                }
            };
            let mut count = 2;
            while let Some(&g) = list.get(i + count as usize) {
                if g.checked_sub(list[i + count as usize - 1]) != Some(step) {
                    break;
                }
                count += 1;
            }
            runs.push(IndexRun { start, count, step });
            i += count as usize;
        }
        Indexes {
            runs,
            len: list.len() as u64,
        }
    }

    /// The indexes of `runs`, checked (none empty, every step at least 1:
    /// a run never repeats an index; none past `u64::MAX`; at most `max`
    /// indexes in all) and regrouped as [`Indexes::from_list`] groups the
    /// same indexes, in one pass over the runs: two `Indexes` of the same
    /// indexes in the same order are equal, however they were named.
    pub fn from_runs(runs: Vec<IndexRun>, max: u64) -> Result<Indexes, RunsError> {
        let mut len = 0u64;
        for (i, r) in runs.iter().enumerate() {
            if r.count == 0 {
                return Err(RunsError::Empty(i));
            }
            if r.step == 0 {
                return Err(RunsError::ZeroStep(i));
            }
            r.last().ok_or(RunsError::Overflow(i))?;
            len = len
                .checked_add(r.count)
                .filter(|&n| n <= max)
                .ok_or(RunsError::TooMany(len.saturating_add(r.count), max))?;
        }
        let mut grouped = Vec::with_capacity(runs.len());
        for r in runs {
            extend(&mut grouped, r);
        }
        Ok(Indexes { runs: grouped, len })
    }

    /// Runs a reader grouped as it read (as [`Indexes::from_list`] groups
    /// a list, so a run of one has step 0 and a run may repeat an index),
    /// `len` indexes in all; checked: none empty, none past `u64::MAX`,
    /// their counts adding up to `len`.
    pub fn from_grouped_runs(runs: Vec<IndexRun>, len: u64) -> Result<Indexes, RunsError> {
        let mut total = 0u64;
        for (i, r) in runs.iter().enumerate() {
            if r.count == 0 {
                return Err(RunsError::Empty(i));
            }
            r.last().ok_or(RunsError::Overflow(i))?;
            total = total
                .checked_add(r.count)
                .ok_or(RunsError::TooMany(u64::MAX, len))?;
        }
        if total != len {
            return Err(RunsError::TooMany(total, len));
        }
        Ok(Indexes { runs, len })
    }

    /// Number of indexes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn runs(&self) -> &[IndexRun] {
        &self.runs
    }

    /// The first index, if any.
    pub fn first(&self) -> Option<u64> {
        self.runs.first().map(|r| r.start)
    }

    /// Every index, in order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.runs.iter().flat_map(|r| (0..r.count).map(|k| r.at(k)))
    }

    /// Every index, in order, as a list.
    pub fn to_vec(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.len as usize);
        out.extend(self.iter());
        out
    }

    /// Whether the runs are written more briefly as ranges than as a list
    /// (what an encoder writes).
    pub fn as_ranges_is_shorter(&self) -> bool {
        (self.runs.len() as u64) * 4 < self.len
    }
}

/// Appends the indexes of `r` (at least one, in range) to `out` as
/// [`Indexes::from_list`] would group them: a run of one takes the next
/// index if it is not smaller (the difference becomes its step), a longer
/// run takes it if it is its step further; else it starts a run.
fn extend(out: &mut Vec<IndexRun>, mut r: IndexRun) {
    while let Some(last) = out.last_mut() {
        let end = last.start + (last.count - 1) * last.step;
        let Some(d) = r.start.checked_sub(end) else {
            break;
        };
        if last.count >= 2 && d != last.step {
            break;
        }
        last.step = d;
        if r.count == 1 || r.step == d {
            last.count += r.count;
            return;
        }
        last.count += 1;
        r = IndexRun {
            start: r.start + r.step,
            count: r.count - 1,
            step: r.step,
        };
    }
    if r.count == 1 {
        r.step = 0;
    }
    out.push(r);
}

impl From<Vec<u64>> for Indexes {
    fn from(list: Vec<u64>) -> Indexes {
        Indexes::from_list(&list)
    }
}

impl From<&[u64]> for Indexes {
    fn from(list: &[u64]) -> Indexes {
        Indexes::from_list(list)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(start: u64, count: u64, step: u64) -> IndexRun {
        IndexRun { start, count, step }
    }

    #[test]
    fn grouped_runs_are_taken_as_they_are_and_checked() {
        let list = [5, 5, 5, 9, 3, 4, 5, 6, u64::MAX];
        let grouped = Indexes::from_list(&list);
        assert_eq!(
            Indexes::from_grouped_runs(grouped.runs().to_vec(), 9),
            Ok(grouped.clone())
        );
        assert_eq!(
            Indexes::from_grouped_runs(vec![run(1, 2, 1), run(7, 0, 1)], 2),
            Err(RunsError::Empty(1))
        );
        assert_eq!(
            Indexes::from_grouped_runs(vec![run(u64::MAX, 2, 1)], 2),
            Err(RunsError::Overflow(0))
        );
        assert!(Indexes::from_grouped_runs(vec![run(1, 2, 1)], 3).is_err());
    }

    #[test]
    fn a_list_becomes_maximal_runs_and_back() {
        for list in [
            vec![],
            vec![7],
            vec![0, 1, 2, 3],
            vec![3, 2, 1, 0],
            vec![0, 4, 8, 1, 5, 9, 9, 9, 2],
            vec![5, 5, 5],
            vec![u64::MAX, 0, u64::MAX],
        ] {
            let ix = Indexes::from_list(&list);
            assert_eq!(ix.to_vec(), list);
            assert_eq!(ix.len(), list.len() as u64);
        }
        assert_eq!(Indexes::from_list(&[0, 1, 2, 3]).runs(), [run(0, 4, 1)]);
        assert_eq!(
            Indexes::from_list(&[0, 4, 8, 1, 5, 9, 9, 9, 2]).runs(),
            [run(0, 3, 4), run(1, 3, 4), run(9, 2, 0), run(2, 1, 0)]
        );
        assert_eq!(
            Indexes::from_list(&[3, 2, 1]).runs(),
            [run(3, 1, 0), run(2, 1, 0), run(1, 1, 0)]
        );
    }

    #[test]
    fn runs_are_grouped_as_the_same_list_would_be() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..2000 {
            // Runs named any which way: short, long, rising, falling, overlapping.
            let runs: Vec<IndexRun> = (0..1 + next(6))
                .map(|_| run(next(20), 1 + next(5), 1 + next(3)))
                .collect();
            let ix = Indexes::from_runs(runs.clone(), u64::MAX).unwrap();
            let list: Vec<u64> = runs
                .iter()
                .flat_map(|r| (0..r.count).map(|k| r.at(k)))
                .collect();
            assert_eq!(ix, Indexes::from_list(&list), "{runs:?}");
            assert_eq!(ix.to_vec(), list);
        }
        // A get of all rows named as two halves is the same as one range.
        assert_eq!(
            Indexes::from_runs(vec![run(0, 4, 1), run(4, 4, 1)], 100)
                .unwrap()
                .runs(),
            [run(0, 8, 1)]
        );
    }

    #[test]
    fn runs_are_checked_for_emptiness_overflow_and_the_limit() {
        assert_eq!(
            Indexes::from_runs(vec![run(0, 2, 1), run(0, 0, 1)], 10),
            Err(RunsError::Empty(1))
        );
        assert_eq!(
            Indexes::from_runs(vec![run(5, 2, 0)], 10),
            Err(RunsError::ZeroStep(0))
        );
        assert_eq!(
            Indexes::from_runs(vec![run(u64::MAX - 1, 3, 1)], 10),
            Err(RunsError::Overflow(0))
        );
        assert_eq!(
            Indexes::from_runs(vec![run(0, u64::MAX, u64::MAX)], u64::MAX),
            Err(RunsError::Overflow(0))
        );
        assert_eq!(
            Indexes::from_runs(vec![run(0, 6, 1), run(100, 5, 1)], 10),
            Err(RunsError::TooMany(11, 10))
        );
        assert_eq!(
            Indexes::from_runs(vec![run(0, u64::MAX, 1), run(0, u64::MAX, 1)], u64::MAX),
            Err(RunsError::TooMany(u64::MAX, u64::MAX))
        );
        let ix = Indexes::from_runs(vec![run(u64::MAX, 1, 9), run(10, 3, 5)], 4).unwrap();
        assert_eq!(ix.to_vec(), [u64::MAX, 10, 15, 20]);
    }
}
