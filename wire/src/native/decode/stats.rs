//! A `stats_ok` body: a map of integers, floats, strs and bools, and of
//! lists and maps of those, nested at most [`STATS_MAX_DEPTH`] levels.
//!
//! [`STATS_MAX_DEPTH`]: crate::native::STATS_MAX_DEPTH

use std::collections::HashSet;

use super::keys::limit;
use crate::msgpack::{Item, Reader};
use crate::native::{Error, Limits, Stat};

/// `n` entries of a stats map (the body, or a map value inside it), with
/// lists and maps nested at most `depth` more levels.
pub(super) fn stat_entries(
    r: &mut Reader<'_>,
    n: usize,
    depth: usize,
    limits: &Limits,
) -> Result<Vec<(String, Stat)>, Error> {
    const MAP: &str = "a stats map";
    let (mut seen, mut stats) = (HashSet::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let key = r.str("a stats key")?;
        if !seen.insert(key) {
            return Err(Error::DuplicateKey {
                map: MAP,
                key: key.to_owned(),
            });
        }
        stats.push((key.to_owned(), stat_value(r, depth, limits)?));
    }
    Ok(stats)
}

/// One stats value: an integer within i64, a float, a str, a bool, or a
/// list or map of those.
fn stat_value(r: &mut Reader<'_>, depth: usize, limits: &Limits) -> Result<Stat, Error> {
    const WHAT: &str = "a stats value";
    let wrong = || Error::WrongType {
        key: WHAT,
        expected: "an integer, a float, a str, a bool, a list or a map",
    };
    let nested = |r: &Reader<'_>| {
        if depth == 0 {
            Err(Error::from(r.malformed("stats nested too deep")))
        } else {
            Ok(())
        }
    };
    Ok(match r.item()? {
        Item::Bool(b) => Stat::Bool(b),
        Item::UInt(v) => Stat::Int(i64::try_from(v).map_err(|_| Error::WrongType {
            key: WHAT,
            expected: "an integer within i64",
        })?),
        Item::Int(v) => Stat::Int(v),
        Item::Float(f) => Stat::Float(f),
        Item::Str { s, .. } => Stat::Str(s.to_owned()),
        Item::Array(n) => {
            nested(r)?;
            limit("stats", n, limits.max_rows)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(stat_value(r, depth - 1, limits)?);
            }
            Stat::List(items)
        }
        Item::Map(n) => {
            nested(r)?;
            limit("stats", n, limits.max_fields)?;
            Stat::Map(stat_entries(r, n, depth - 1, limits)?)
        }
        Item::Nil | Item::Bin { .. } | Item::Ext { .. } => return Err(wrong()),
    })
}
