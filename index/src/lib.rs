//! The row index of a storage unit: maps from a global index to a `u64`
//! (a packed row location, a count, or nothing), with a hasher that keeps
//! consecutive indexes in consecutive buckets; and, built on them, a
//! unit's row numbers with each field's entries by row number
//! ([`RowNumbers`], [`FieldIndex`]: one map entry a row, not one a (row,
//! field); see the `rows` module).
//!
//! # Why a crate of its own
//!
//! A unit does a few hash-map operations per row on every put, get and
//! clear. `HashMap`'s methods are generic and `#[inline]`, so they are
//! compiled in the crate that uses them, at that crate's opt-level. In an
//! unoptimised (debug) build of `stowage-host`, a put of 1,000,000
//! one-element rows to each of four endpoints spent 90% of `stowd`'s time
//! in hashbrown's probing (`perf`, 2026-12-02), at about 1-2 µs per map
//! operation; the test that does it ran 125 s. Building all of
//! `stowage-host` at opt-level 1 brought it to 28 s, but made its library
//! take 269 s to compile instead of 78 s (it instantiates wasmtime's
//! generics). The maps' methods here are concrete and not `#[inline]`, so
//! they are compiled once, in this crate, which the workspace builds at
//! opt-level 3 in every profile (`Cargo.toml`, `[profile.dev.package]`).
//! Release builds are unchanged: everything is optimised there anyway.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

mod rows;
pub use rows::{EMPTY, FieldIndex, PAGE, RowNumbers};

/// Hashes a global index so that consecutive indexes land in consecutive
/// buckets (their low 16 bits are kept as they are), while indexes that
/// differ above bit 16 are spread by one multiplication (the constant of
/// rustc's FxHasher).
///
/// Measured with `cargo bench -p stowage-host --bench unit` (131,072
/// consecutive indexes): with a plain Fx multiply every row was a cache
/// miss in each map, and `clear` cost 889 ns per row; keeping the low bits
/// makes the accesses sequential. Strided indexes (every 4th, as `g % 4`
/// routing leaves each unit) still fall in distinct buckets. Not
/// DoS-resistant; indexes come from the cluster's own trainers.
#[derive(Default, Clone, Copy)]
struct IndexHasher(u64);

const MIX: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl Hasher for IndexHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(MIX);
        }
    }

    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0 ^ i).wrapping_add((i >> 16).wrapping_mul(MIX));
    }
}

/// A map from a global index to a `u64`.
#[derive(Default, Clone)]
pub struct IndexMap {
    map: HashMap<u64, u64, BuildHasherDefault<IndexHasher>>,
}

impl std::fmt::Debug for IndexMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IndexMap({} entries)", self.map.len())
    }
}

impl IndexMap {
    pub fn new() -> IndexMap {
        IndexMap::default()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Room for `additional` more entries without a rehash.
    pub fn reserve(&mut self, additional: usize) {
        self.map.reserve(additional);
    }

    /// Gives memory back, keeping room for at least `min` entries.
    pub fn shrink_to(&mut self, min: usize) {
        self.map.shrink_to(min);
    }

    pub fn get(&self, g: u64) -> Option<u64> {
        self.map.get(&g).copied()
    }

    /// Every (key, value), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.map.iter().map(|(&g, &v)| (g, v))
    }

    pub fn contains(&self, g: u64) -> bool {
        self.map.contains_key(&g)
    }

    /// Sets `g` to `v`; returns the value it replaced.
    pub fn insert(&mut self, g: u64, v: u64) -> Option<u64> {
        self.map.insert(g, v)
    }

    /// Removes `g`; returns its value.
    pub fn remove(&mut self, g: u64) -> Option<u64> {
        self.map.remove(&g)
    }

    /// Adds one to `g`'s count (0 if absent); returns the new count.
    pub fn increment(&mut self, g: u64) -> u64 {
        self.add(g, 1)
    }

    /// Adds `n` to `g`'s count (0 if absent); returns the new count.
    pub fn add(&mut self, g: u64, n: u64) -> u64 {
        let count = self.map.entry(g).or_insert(0);
        *count += n;
        *count
    }

    /// Takes one from `g`'s count, removing `g` at zero; returns the new
    /// count, or `None` if `g` was absent.
    pub fn decrement(&mut self, g: u64) -> Option<u64> {
        let n = self.map.get_mut(&g)?;
        *n = n.saturating_sub(1);
        let left = *n;
        if left == 0 {
            self.map.remove(&g);
        }
        Some(left)
    }
}

/// The first index of `global_indexes` that appears twice, if any: a
/// linear scan when the indexes increase (the usual put), a hash set
/// otherwise.
pub fn duplicate(global_indexes: &[u64]) -> Option<u64> {
    if global_indexes.windows(2).all(|w| w[0] < w[1]) {
        return None;
    }
    let mut seen = IndexMap::new();
    seen.reserve(global_indexes.len());
    global_indexes
        .iter()
        .copied()
        .find(|&g| seen.insert(g, 0).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_get_remove() {
        let mut m = IndexMap::new();
        assert!(m.is_empty());
        assert_eq!(m.insert(7, 70), None);
        assert_eq!(m.insert(7, 71), Some(70));
        assert_eq!(m.get(7), Some(71));
        assert!(m.contains(7) && !m.contains(8));
        assert_eq!(m.remove(7), Some(71));
        assert_eq!(m.remove(7), None);
        assert_eq!(m.get(7), None);
        assert_eq!(m.len(), 0);
    }

    #[test]
    fn counts_go_up_and_down_and_vanish_at_zero() {
        let mut m = IndexMap::new();
        assert_eq!(m.decrement(3), None);
        assert_eq!(m.increment(3), 1);
        assert_eq!(m.increment(3), 2);
        assert_eq!(m.decrement(3), Some(1));
        assert!(m.contains(3));
        assert_eq!(m.decrement(3), Some(0));
        assert!(!m.contains(3));
        assert_eq!(m.add(4, 3), 3);
        assert_eq!(m.add(4, 2), 5);
        assert_eq!(m.increment(4), 6);
        assert_eq!(m.decrement(4), Some(5));
    }

    #[test]
    fn many_keys_consecutive_strided_and_far_apart() {
        let mut m = IndexMap::new();
        let keys: Vec<u64> = (0..10_000u64)
            .chain((0..10_000).map(|i| (1 << 20) | (i * 4)))
            .chain((0..1_000).map(|i| ((i + 1) << 40) | 5))
            .chain([u64::MAX, u64::MAX - 1])
            .collect();
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(m.insert(k, i as u64), None, "key {k}");
        }
        assert_eq!(m.len(), keys.len());
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(m.get(k), Some(i as u64), "key {k}");
        }
        m.shrink_to(0);
        assert_eq!(m.len(), keys.len());
    }

    #[test]
    fn duplicates_are_found_in_any_order() {
        assert_eq!(duplicate(&[]), None);
        assert_eq!(duplicate(&[1, 2, 3]), None);
        assert_eq!(duplicate(&[3, 2, 1]), None);
        assert_eq!(duplicate(&[1, 2, 2]), Some(2));
        assert_eq!(duplicate(&[5, 1, 9, 1, 5]), Some(1));
        assert_eq!(duplicate(&[u64::MAX, 0, u64::MAX]), Some(u64::MAX));
    }
}
