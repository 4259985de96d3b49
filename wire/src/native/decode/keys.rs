//! Reading maps of known keys, and the small checks every body shares:
//! each key at most once and none unknown ([`keyed`]), required keys
//! ([`need`]), fixed-length arrays ([`tuple`]), counts against the limits
//! ([`limit`]), distinct names ([`Seen`]), and the bodies of one key or
//! none.

use std::collections::HashSet;

use crate::msgpack::Reader;
use crate::native::Error;

/// The names seen so far in a list or map of distinct names: a scan of
/// the few a small request has (no allocation), a hash set past
/// [`Seen::SCAN`], so a check stays linear in the request's size. The set
/// hashes with foldhash, seeded per set (as the units' field maps), not
/// SipHash: SipHash was 6% of decoding a 32-field put's descriptors
/// (`cargo bench -p stowage-wire --bench decode`).
// Large on purpose: it lives on the stack for one map.
#[allow(clippy::large_enum_variant)]
pub(super) enum Seen<'a> {
    Few(smallvec::SmallVec<[&'a str; Seen::SCAN]>),
    Many(Names<'a>),
}

type Names<'a> = HashSet<&'a str, foldhash::fast::RandomState>;

impl<'a> Seen<'a> {
    /// Most names checked by a scan.
    const SCAN: usize = 16;

    pub(super) fn with_capacity(n: usize) -> Seen<'a> {
        if n <= Self::SCAN {
            Seen::Few(smallvec::SmallVec::new())
        } else {
            Seen::Many(HashSet::with_capacity_and_hasher(n, Default::default()))
        }
    }

    /// Adds `name`; false if it was seen before.
    pub(super) fn insert(&mut self, name: &'a str) -> bool {
        match self {
            Seen::Few(few) if few.len() < Self::SCAN => {
                if few.contains(&name) {
                    return false;
                }
                few.push(name);
                true
            }
            Seen::Few(few) => {
                let mut all: Names<'a> = few.drain(..).collect();
                let new = all.insert(name);
                *self = Seen::Many(all);
                new
            }
            Seen::Many(all) => all.insert(name),
        }
    }
}

/// Reads a map whose keys must be among `keys`, each at most once, in any
/// order: `read(i, r)` reads the value of `keys[i]`.
pub(super) fn keyed<'a, const N: usize>(
    r: &mut Reader<'a>,
    map: &'static str,
    keys: [&'static str; N],
    mut read: impl FnMut(usize, &mut Reader<'a>) -> Result<(), Error>,
) -> Result<(), Error> {
    let mut seen = [false; N];
    // The key after the last one read: every encoder here writes a map's
    // keys in the order of `keys`, so one comparison usually finds it. Keys
    // are compared as bytes (they are ASCII), and UTF-8 is checked only
    // for a key that matches none (a decode of a small put's descriptors
    // spent a tenth of its time validating keys it then compared).
    let mut next = 0;
    for _ in 0..r.map_len(map)? {
        let key = r.str_bytes("a key")?;
        let found = match keys.get(next) {
            Some(k) if k.as_bytes() == key => Some(next),
            _ => keys.iter().position(|k| k.as_bytes() == key),
        };
        let Some(i) = found else {
            return Err(unknown(map, Reader::utf8_at(key, r.pos() - key.len())?));
        };
        if std::mem::replace(&mut seen[i], true) {
            return Err(Error::DuplicateKey {
                map,
                key: keys[i].to_owned(),
            });
        }
        next = i + 1;
        read(i, r)?;
    }
    Ok(())
}

pub(super) fn need<T>(slot: Option<T>, map: &'static str, key: &'static str) -> Result<T, Error> {
    // Not `ok_or`: an error made ahead, on every field's every key, and
    // dropped (a 10-field put's descriptors spent 2,100 instructions
    // dropping errors they never returned, callgrind).
    match slot {
        Some(v) => Ok(v),
        None => Err(Error::MissingKey { map, key }),
    }
}

pub(super) fn unknown(map: &'static str, key: &str) -> Error {
    Error::UnknownKey {
        map,
        key: key.to_owned(),
    }
}

/// The header of an array that must hold exactly `n` items.
pub(super) fn tuple(
    r: &mut Reader<'_>,
    what: &'static str,
    n: usize,
    expected: &'static str,
) -> Result<(), Error> {
    if r.array_len(what)? != n {
        return Err(Error::WrongType {
            key: what,
            expected,
        });
    }
    Ok(())
}

pub(super) fn limit(what: &'static str, n: usize, max: u64) -> Result<(), Error> {
    if n as u64 > max {
        Err(Error::TooLarge {
            what,
            value: n as u64,
            limit: max,
        })
    } else {
        Ok(())
    }
}

/// A body that is a map with exactly one uint key.
pub(super) fn single_uint(
    r: &mut Reader<'_>,
    map: &'static str,
    key: &'static str,
) -> Result<u64, Error> {
    let mut value = None;
    keyed(r, map, [key], |_, r| {
        r.uint(key).map(|u| value = Some(u)).map_err(Error::from)
    })?;
    need(value, map, key)
}

pub(super) fn single_str(
    r: &mut Reader<'_>,
    map: &'static str,
    key: &'static str,
) -> Result<String, Error> {
    let mut value = None;
    keyed(r, map, [key], |_, r| {
        r.str(key)
            .map(|s| value = Some(s.to_owned()))
            .map_err(Error::from)
    })?;
    need(value, map, key)
}

/// A body that must be an empty map.
pub(super) fn empty_body(r: &mut Reader<'_>, map: &'static str) -> Result<(), Error> {
    if r.map_len(map)? != 0 {
        return Err(Error::UnknownKey {
            map,
            key: r.str("a key")?.to_owned(),
        });
    }
    Ok(())
}
