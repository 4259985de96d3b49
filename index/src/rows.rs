//! Row numbers and per-field entries: a unit's index with one hash-map
//! entry a row, not one a (row, field).
//!
//! A unit used to keep one [`IndexMap`] a field (global index -> row
//! location) and one more counting the fields of each index. A put of
//! `f` fields of `r` rows made `f * r` hash-map inserts in `f` maps; a
//! 32-field put of 64 rows (4 units) spent 30% of `stowd`'s instructions
//! in them (callgrind, 2026-12-06), at about 76 instructions an insert,
//! before counting the cache misses of 32 maps.
//!
//! Here a unit numbers its indexes once ([`RowNumbers`]: global index ->
//! a dense `u32`, reused once the index holds no field), and each field
//! keeps its entries by row number in pages of [`PAGE`] ([`FieldIndex`]).
//! A put looks each index up once, whatever its number of fields; each
//! field then writes its entries into the page of a run of row numbers,
//! one page lookup a page, not one a row. The pages are kept in a map by
//! page number, not a vector, so a field stored at a few rows of a large
//! unit costs a page each, not a slot for every row number below them.
//!
//! Memory: a row number about 30 bytes (its map entry, its index and its
//! field count); a (row, field) 8 bytes and a page's share (8.3 in all)
//! where a field has runs of numbers, and at worst a whole page (about
//! 530 bytes with its map entry) for a field's one row among 64 numbers.
//! The per-field maps before took a hash-map entry a (row, field) and
//! one more a row (16 bytes and a control byte each, the maps 44-88%
//! full: 19-39 bytes), however the rows lay.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use crate::{IndexHasher, IndexMap};

/// Row numbers a page of a [`FieldIndex`] holds.
pub const PAGE: usize = 64;

/// The empty entry. No row location packs to it: a unit's column numbers
/// and rows in a column are both below `u32::MAX`.
pub const EMPTY: u64 = u64::MAX;

/// Global index -> row number, and per number its global index and how
/// many fields it holds. A number is taken when its index gets its first
/// field and given back (for the next new index) when it loses its last.
#[derive(Default, Clone)]
pub struct RowNumbers {
    map: IndexMap,
    /// Number -> global index (meaningless for a free number).
    indexes: Vec<u64>,
    /// Number -> fields stored at it (0 for a free number).
    fields: Vec<u32>,
    free: Vec<u32>,
}

impl std::fmt::Debug for RowNumbers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RowNumbers({} indexes)", self.map.len())
    }
}

impl RowNumbers {
    /// Indexes numbered (with at least one field once a put completes).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn get(&self, g: u64) -> Option<u32> {
        self.map.get(g).map(|n| n as u32)
    }

    pub fn contains(&self, g: u64) -> bool {
        self.map.contains(g)
    }

    /// The global index of number `n`.
    pub fn index_of(&self, n: u32) -> u64 {
        self.indexes[n as usize]
    }

    /// Writes the number of each of `gs` into `out` (same length), giving
    /// a new one, with no field yet, to an index that has none. The caller
    /// adds fields to every new number ([`RowNumbers::add_fields`]) before
    /// anything else reads the numbers.
    ///
    /// # Panics
    /// If the unit would hold `u32::MAX` indexes (about 150 GB of index
    /// alone).
    pub fn number(&mut self, gs: &[u64], out: &mut [u32]) {
        assert_eq!(gs.len(), out.len(), "one number an index");
        if self.map.is_empty() {
            self.map.reserve(gs.len());
            self.indexes.reserve(gs.len());
            self.fields.reserve(gs.len());
        }
        // One hash of each index, found or added (`entry`, not a lookup
        // and then an insert).
        let RowNumbers {
            map,
            indexes,
            fields,
            free,
        } = self;
        for (&g, slot) in gs.iter().zip(out.iter_mut()) {
            let n = *map.map.entry(g).or_insert_with(|| {
                let n = match free.pop() {
                    Some(n) => {
                        indexes[n as usize] = g;
                        n
                    }
                    None => {
                        let n = u32::try_from(indexes.len())
                            .ok()
                            .filter(|&n| n < u32::MAX)
                            .expect("a unit holds fewer than u32::MAX indexes");
                        indexes.push(g);
                        fields.push(0);
                        n
                    }
                };
                u64::from(n)
            });
            *slot = n as u32;
        }
    }

    /// Adds `added[i]` fields at number `nums[i]`.
    pub fn add_fields(&mut self, nums: &[u32], added: &[u32]) {
        for (&n, &k) in nums.iter().zip(added) {
            self.fields[n as usize] += k;
        }
    }

    /// Takes `k` fields from number `n`; at none left, its index is
    /// forgotten and the number freed. Returns the fields left (`k` of 0
    /// changes nothing).
    pub fn drop_fields(&mut self, n: u32, k: u32) -> u32 {
        if k == 0 {
            return self.fields[n as usize];
        }
        let left = &mut self.fields[n as usize];
        *left = left.saturating_sub(k);
        let left = *left;
        if left == 0 {
            self.map.remove(self.indexes[n as usize]);
            self.free.push(n);
        }
        left
    }

    /// Forgets `g` and frees its number, whatever fields it had (the
    /// caller removed them); returns the number.
    pub fn remove(&mut self, g: u64) -> Option<u32> {
        let n = self.map.remove(g)? as u32;
        self.fields[n as usize] = 0;
        self.free.push(n);
        Some(n)
    }

    /// Every numbered global index, in no particular order.
    pub fn indexes(&self) -> impl Iterator<Item = u64> + '_ {
        self.map.iter().map(|(g, _)| g)
    }

    /// Gives all memory back (the unit holds nothing).
    pub fn clear(&mut self) {
        *self = RowNumbers::default();
    }
}

struct Page {
    /// Entries that are not [`EMPTY`].
    len: u32,
    entries: [u64; PAGE],
}

fn new_page() -> Box<Page> {
    Box::new(Page {
        len: 0,
        entries: [EMPTY; PAGE],
    })
}

/// One field's entries (a `u64` each, never [`EMPTY`]) by row number, in
/// pages of [`PAGE`] numbers kept only while they hold one.
#[derive(Default)]
pub struct FieldIndex {
    pages: HashMap<u64, Box<Page>, BuildHasherDefault<IndexHasher>>,
    len: usize,
}

impl std::fmt::Debug for FieldIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FieldIndex({} entries)", self.len)
    }
}

fn split(n: u32) -> (u64, usize) {
    (u64::from(n) / PAGE as u64, n as usize % PAGE)
}

impl FieldIndex {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, n: u32) -> Option<u64> {
        let (p, o) = split(n);
        let v = self.pages.get(&p)?.entries[o];
        (v != EMPTY).then_some(v)
    }

    /// Sets the entry of `nums[i]` to `first + i`. An entry it replaces is
    /// given to `replaced` (a `dyn` callback, so this stays compiled here,
    /// optimised, and an overwrite allocates no list); where there was
    /// none, `added[i]` goes up by one. One page lookup a run of numbers
    /// in the same page.
    ///
    /// # Panics
    /// If `added` is shorter than `nums`, or an entry would be [`EMPTY`].
    pub fn set_run(
        &mut self,
        nums: &[u32],
        first: u64,
        added: &mut [u32],
        replaced: &mut dyn FnMut(u64),
    ) {
        assert!(added.len() >= nums.len(), "a count an entry");
        // The last entry, first + len - 1, is below EMPTY (u64::MAX).
        assert!(
            first.checked_add(nums.len() as u64).is_some(),
            "entries below EMPTY"
        );
        let added = &mut added[..nums.len()];
        // Room for the pages a long run of new numbers needs, ahead of
        // time (a short run finds its page or adds one as it goes).
        if nums.len() > PAGE {
            self.pages.reserve(nums.len() / PAGE + 1);
        }
        let mut new = 0usize;
        let mut i = 0;
        while i < nums.len() {
            let p = nums[i] / PAGE as u32;
            let page = self.pages.entry(u64::from(p)).or_insert_with(new_page);
            let base = p * PAGE as u32;
            let mut len = page.len;
            // The numbers that fall in this page, as they come.
            while let Some(&n) = nums.get(i) {
                let o = n.wrapping_sub(base) as usize;
                if o >= PAGE {
                    break;
                }
                let old = std::mem::replace(&mut page.entries[o], first + i as u64);
                if old == EMPTY {
                    len += 1;
                    added[i] += 1;
                    new += 1;
                } else {
                    replaced(old);
                }
                i += 1;
            }
            page.len = len;
        }
        self.len += new;
    }

    /// Removes the entries of `nums` that it has, giving each to `removed`
    /// with its position in `nums`. One page lookup a run of numbers in
    /// the same page; a number it has no entry for is passed over.
    pub fn remove_run(&mut self, nums: &[u32], removed: &mut dyn FnMut(usize, u64)) {
        let mut i = 0;
        while i < nums.len() {
            let (p, _) = split(nums[i]);
            let Some(page) = self.pages.get_mut(&p) else {
                while i < nums.len() && split(nums[i]).0 == p {
                    i += 1;
                }
                continue;
            };
            while i < nums.len() && split(nums[i]).0 == p {
                let v = std::mem::replace(&mut page.entries[split(nums[i]).1], EMPTY);
                if v != EMPTY {
                    page.len -= 1;
                    self.len -= 1;
                    removed(i, v);
                }
                i += 1;
            }
            if page.len == 0 {
                self.pages.remove(&p);
            }
        }
    }

    /// Every (row number, entry), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.pages.iter().flat_map(|(&p, page)| {
            page.entries
                .iter()
                .enumerate()
                .filter(|(_, v)| **v != EMPTY)
                .map(move |(o, &v)| ((p as usize * PAGE + o) as u32, v))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_given_once_and_reused_when_freed() {
        let mut r = RowNumbers::default();
        let mut out = [0u32; 3];
        r.number(&[10, 20, 30], &mut out);
        assert_eq!(out, [0, 1, 2]);
        r.add_fields(&out, &[1, 2, 1]);
        let mut again = [9u32; 2];
        r.number(&[20, 40], &mut again);
        assert_eq!(again, [1, 3]);
        r.add_fields(&again, &[0, 1]);
        assert_eq!(r.len(), 4);
        assert_eq!(r.drop_fields(1, 0), 2);
        assert_eq!(r.drop_fields(1, 1), 1);
        assert!(r.contains(20));
        assert_eq!(r.drop_fields(1, 1), 0);
        assert!(!r.contains(20));
        assert_eq!(r.remove(10), Some(0));
        assert_eq!(r.remove(10), None);
        let mut third = [0u32; 3];
        r.number(&[50, 60, 70], &mut third);
        // The freed numbers first (last freed first), then a new one.
        assert_eq!(third, [0, 1, 4]);
        assert_eq!(r.index_of(1), 60);
        assert_eq!(r.drop_fields(0, 0), 0);
        let mut all: Vec<u64> = r.indexes().collect();
        all.sort_unstable();
        assert_eq!(all, [30, 40, 50, 60, 70]);
        r.clear();
        assert!(r.is_empty());
    }

    #[test]
    fn entries_set_replace_remove_across_pages() {
        let mut f = FieldIndex::default();
        let nums: Vec<u32> = (60..70).chain([1000, 5, 200_000]).collect();
        let mut added = vec![0u32; nums.len()];
        let mut replaced = Vec::new();
        f.set_run(&nums, 100, &mut added, &mut |v| replaced.push(v));
        assert_eq!(f.len(), nums.len());
        assert!(replaced.is_empty());
        assert!(added.iter().all(|&a| a == 1));
        for (i, &n) in nums.iter().enumerate() {
            assert_eq!(f.get(n), Some(100 + i as u64));
        }
        assert_eq!(f.get(70), None);
        assert_eq!(f.get(u32::MAX), None);
        // Again over part of it: two replaced, one new.
        let mut added = [0u32; 3];
        f.set_run(&[61, 1000, 7], 500, &mut added, &mut |v| replaced.push(v));
        assert_eq!(added, [0, 0, 1]);
        assert_eq!(replaced, [101, 110]);
        assert_eq!(f.get(61), Some(500));
        assert_eq!(f.get(1000), Some(501));
        assert_eq!(f.get(7), Some(502));
        assert_eq!(f.len(), nums.len() + 1);
        let mut seen: Vec<(u32, u64)> = f.iter().collect();
        seen.sort_unstable();
        assert_eq!(seen.len(), f.len());
        assert_eq!(seen[0], (5, 111));
        assert_eq!(seen.last(), Some(&(200_000, 112)));
        // Removing every entry gives every page back.
        let mut take = |n: u32| {
            let mut got = None;
            f.remove_run(&[n], &mut |_, v| got = Some(v));
            got
        };
        for (n, v) in seen {
            assert_eq!(take(n), Some(v));
            assert_eq!(take(n), None);
        }
        assert!(f.is_empty());
        assert!(f.pages.is_empty());
    }

    #[test]
    fn a_run_of_numbers_is_removed_page_by_page_whatever_it_lacks() {
        let mut f = FieldIndex::default();
        let nums: Vec<u32> = (0..200).collect();
        f.set_run(&nums, 1000, &mut vec![0; 200], &mut |_| {});
        // Every other number of 50..150, one twice, one never set, and
        // numbers in a page the field never had.
        let gone: Vec<u32> = (50..150).step_by(2).chain([52, 5000, 5001]).collect();
        let mut seen = Vec::new();
        f.remove_run(&gone, &mut |i, v| seen.push((i, v)));
        let want: Vec<(usize, u64)> = (0..50).map(|i| (i, 1050 + 2 * i as u64)).collect();
        assert_eq!(seen, want);
        assert_eq!(f.len(), 150);
        assert_eq!(f.get(52), None);
        assert_eq!(f.get(53), Some(1053));
        // The rest, in any order: every page goes back.
        let rest: Vec<u32> = (0..200).rev().collect();
        let mut n = 0;
        f.remove_run(&rest, &mut |_, _| n += 1);
        assert_eq!(n, 150);
        assert!(f.is_empty() && f.pages.is_empty());
    }

    #[test]
    #[should_panic(expected = "entries below EMPTY")]
    fn an_entry_that_would_be_empty_is_refused() {
        let mut f = FieldIndex::default();
        f.set_run(&[1, 2], EMPTY - 1, &mut [0, 0], &mut |_| {});
    }
}
