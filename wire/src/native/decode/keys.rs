//! Reading maps of known keys, and the small checks every body shares:
//! each key at most once and none unknown ([`keyed`]), required keys
//! ([`need`]), fixed-length arrays ([`tuple`]), counts against the limits
//! ([`limit`]), and the bodies of one key or none.

use crate::msgpack::Reader;
use crate::native::Error;

/// Reads a map whose keys must be among `keys`, each at most once, in any
/// order: `read(i, r)` reads the value of `keys[i]`.
pub(super) fn keyed<'a, const N: usize>(
    r: &mut Reader<'a>,
    map: &'static str,
    keys: [&'static str; N],
    mut read: impl FnMut(usize, &mut Reader<'a>) -> Result<(), Error>,
) -> Result<(), Error> {
    let mut seen = [false; N];
    for _ in 0..r.map_len(map)? {
        let key = r.str("a key")?;
        let Some(i) = keys.iter().position(|k| *k == key) else {
            return Err(unknown(map, key));
        };
        if std::mem::replace(&mut seen[i], true) {
            return Err(Error::DuplicateKey {
                map,
                key: key.to_owned(),
            });
        }
        read(i, r)?;
    }
    Ok(())
}

pub(super) fn need<T>(slot: Option<T>, map: &'static str, key: &'static str) -> Result<T, Error> {
    slot.ok_or(Error::MissingKey { map, key })
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
