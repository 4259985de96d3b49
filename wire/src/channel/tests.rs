//! Exact bytes, round trips, and one test per kind of refused body.

use super::*;
use crate::msgpack::Writer;

/// The body of a whole message (its bytes after the length).
fn body(message: &[u8]) -> &[u8] {
    let len = body_len(message[..LEN_BYTES].try_into().unwrap(), &Limits::DEFAULT).unwrap();
    assert_eq!(len, message.len() - LEN_BYTES, "the length is the body's");
    &message[LEN_BYTES..]
}

/// A body written by hand: a map of `n` entries, then `entries` appends.
fn map(n: usize, entries: impl FnOnce(&mut Writer)) -> Vec<u8> {
    let mut w = Writer::new();
    w.map(n);
    entries(&mut w);
    w.finish().unwrap()
}

fn hello(body: &[u8]) -> Result<Hello<'_>, Error> {
    Hello::decode(body)
}

fn descriptors(body: &[u8]) -> Result<Descriptors<'_>, Error> {
    Descriptors::decode(body, &Limits::DEFAULT)
}

// ---------------------------------------------------------------- exact bytes

#[test]
fn hello_bytes_are_the_documented_ones() {
    let out = Hello { token: "ab" }.encode().unwrap();
    assert_eq!(
        out, b"\x0a\x00\x00\x00\x81\xa5token\xa2ab",
        "the greeting's bytes changed: the Python client's core reads them"
    );
    assert_eq!(hello(body(&out)).unwrap(), Hello { token: "ab" });
}

#[test]
fn descriptors_bytes_are_the_documented_ones() {
    let message = Descriptors {
        id: 7,
        names: vec!["s1"],
    };
    let out = message.encode().unwrap();
    assert_eq!(
        out, b"\x0f\x00\x00\x00\x82\xa2id\x07\xa5names\x91\xa2s1",
        "a descriptor message's bytes changed: the Python client's core reads them"
    );
    assert_eq!(descriptors(body(&out)).unwrap(), message);
}

#[test]
fn a_real_greeting_is_what_rmp_wrote_before() {
    // What stowd wrote with rmp's encoders before this module: a 32-digit
    // token, a 300-name message (array16, str8 names, a uint32 id).
    let token = "0123456789abcdef0123456789abcdef";
    let mut old = Vec::new();
    rmp::encode::write_map_len(&mut old, 1).unwrap();
    rmp::encode::write_str(&mut old, "token").unwrap();
    rmp::encode::write_str(&mut old, token).unwrap();
    assert_eq!(body(&Hello { token }.encode().unwrap()), old);

    let names: Vec<String> = (0..300)
        .map(|i| format!("s{i:x}{}", "0".repeat(40)))
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut old = Vec::new();
    rmp::encode::write_map_len(&mut old, 2).unwrap();
    rmp::encode::write_str(&mut old, "id").unwrap();
    rmp::encode::write_uint(&mut old, 70_000).unwrap();
    rmp::encode::write_str(&mut old, "names").unwrap();
    rmp::encode::write_array_len(&mut old, names.len() as u32).unwrap();
    for n in &names {
        rmp::encode::write_str(&mut old, n).unwrap();
    }
    let message = Descriptors { id: 70_000, names };
    let out = message.encode().unwrap();
    assert_eq!(body(&out), old);
    assert_eq!(descriptors(body(&out)).unwrap(), message);
}

// ---------------------------------------------------------------- round trips

#[test]
fn round_trips() {
    let token = "f".repeat(MAX_TOKEN_BYTES);
    for t in ["x", token.as_str()] {
        let out = Hello { token: t }.encode().unwrap();
        assert_eq!(hello(body(&out)).unwrap().token, t);
    }
    let long = "n".repeat(255);
    for message in [
        Descriptors {
            id: 0,
            names: vec![],
        },
        Descriptors {
            id: u64::MAX,
            names: vec!["", "s0", &long],
        },
        Descriptors {
            id: 1,
            names: vec!["s"; 70_000],
        },
    ] {
        let out = message.encode().unwrap();
        assert_eq!(descriptors(body(&out)).unwrap(), message);
    }
}

#[test]
fn keys_in_any_order_and_headers_of_any_width_are_taken() {
    // names before id; id as uint64, token and names as str8/array16/map16.
    let mut raw = Vec::new();
    rmp::encode::write_map_len(&mut raw, 2).unwrap();
    raw.extend_from_slice(b"\xa5names\xdc\x00\x01\xd9\x02s1\xa2id\xcf");
    raw.extend_from_slice(&9u64.to_be_bytes());
    assert_eq!(
        descriptors(&raw).unwrap(),
        Descriptors {
            id: 9,
            names: vec!["s1"]
        }
    );
    let raw = b"\xde\x00\x01\xd9\x05token\xd9\x02ab";
    assert_eq!(hello(raw).unwrap().token, "ab");
}

// ---------------------------------------------------------------- refusals

#[test]
fn every_truncation_is_refused() {
    let h = Hello { token: "ab" }.encode().unwrap();
    let d = Descriptors {
        id: 300,
        names: vec!["s1", "s2"],
    }
    .encode()
    .unwrap();
    for n in 0..h.len() - LEN_BYTES {
        assert!(hello(&body(&h)[..n]).is_err(), "{n}-byte greeting taken");
    }
    for n in 0..d.len() - LEN_BYTES {
        assert!(
            descriptors(&body(&d)[..n]).is_err(),
            "{n}-byte message taken"
        );
    }
    assert!(matches!(
        hello(&body(&h)[..7]),
        Err(Error::Malformed {
            reason: "truncated",
            ..
        })
    ));
}

#[test]
fn trailing_bytes_are_refused() {
    let mut h = body(&Hello { token: "ab" }.encode().unwrap()).to_vec();
    h.push(0xc0);
    let e = hello(&h).unwrap_err();
    assert_eq!(
        e,
        Error::Malformed {
            offset: 10,
            reason: "trailing bytes after the body"
        }
    );
    let mut d = body(
        &Descriptors {
            id: 1,
            names: vec![],
        }
        .encode()
        .unwrap(),
    )
    .to_vec();
    d.push(0);
    assert!(matches!(descriptors(&d), Err(Error::Malformed { .. })));
}

#[test]
fn wrong_types_are_refused() {
    let wrong = |r: Result<_, Error>, key: &str| match r {
        Err(Error::WrongType { key: k, .. }) => assert_eq!(k, key),
        other => panic!("{key}: {other:?}"),
    };
    // Not a map.
    wrong(hello(b"\x91\xa2ab").map(|_| ()), "the channel greeting");
    wrong(descriptors(b"\xc0").map(|_| ()), "a channel message");
    // A key that is not a str.
    wrong(hello(b"\x81\x01\xa2ab").map(|_| ()), "a greeting key");
    // token: a bin, an int.
    wrong(
        hello(&map(1, |w| {
            w.str("token");
            w.bin(b"ab");
        }))
        .map(|_| ()),
        "token",
    );
    wrong(
        hello(&map(1, |w| w.kv_uint("token", 5))).map(|_| ()),
        "token",
    );
    // id: negative, a float, a str.
    let ids: [fn(&mut Writer); 3] = [|w| w.sint(-1), |w| w.f64(1.0), |w| w.str("1")];
    for id in ids {
        let raw = map(2, |w| {
            w.str("id");
            id(w);
            w.str("names");
            w.array(0);
        });
        wrong(descriptors(&raw).map(|_| ()), "id");
    }
    // names: a map, an array holding an int or a bin.
    let with_names = |names: &dyn Fn(&mut Writer)| {
        map(2, |w| {
            w.kv_uint("id", 1);
            w.str("names");
            names(w);
        })
    };
    wrong(descriptors(&with_names(&|w| w.map(0))).map(|_| ()), "names");
    let items: [fn(&mut Writer); 2] = [|w| w.uint(1), |w| w.bin(b"s1")];
    for item in items {
        let raw = with_names(&|w| {
            w.array(1);
            item(w);
        });
        wrong(descriptors(&raw).map(|_| ()), "a segment name");
    }
    // Invalid UTF-8 in a name.
    let raw = with_names(&|w| {
        w.array(1);
        w.raw(b"\xa2\xff\xfe");
    });
    assert!(matches!(
        descriptors(&raw),
        Err(Error::Malformed {
            reason: "invalid UTF-8 in a str",
            ..
        })
    ));
}

#[test]
fn a_token_of_0_or_more_than_64_bytes_is_refused() {
    for t in [String::new(), "a".repeat(MAX_TOKEN_BYTES + 1)] {
        let raw = map(1, |w| w.kv_str("token", &t));
        assert_eq!(
            hello(&raw),
            Err(Error::WrongType {
                key: "token",
                expected: "a str of 1 to 64 bytes"
            }),
            "{} bytes",
            t.len()
        );
    }
}

#[test]
fn missing_unknown_and_repeated_keys_are_refused() {
    assert_eq!(
        hello(b"\x80"),
        Err(Error::MissingKey {
            map: "the channel greeting",
            key: "token"
        })
    );
    let two_tokens = map(2, |w| {
        w.kv_str("token", "ab");
        w.kv_str("token", "cd");
    });
    assert_eq!(
        hello(&two_tokens),
        Err(Error::DuplicateKey {
            map: "the channel greeting",
            key: "token"
        })
    );
    let extra = map(2, |w| {
        w.kv_str("token", "ab");
        w.kv_uint("version", 1);
    });
    assert!(matches!(
        hello(&extra),
        Err(Error::UnknownKey { key, .. }) if key == "version"
    ));

    let only_id = map(1, |w| w.kv_uint("id", 1));
    assert_eq!(
        descriptors(&only_id),
        Err(Error::MissingKey {
            map: "a channel message",
            key: "names"
        })
    );
    let only_names = map(1, |w| {
        w.str("names");
        w.array(0);
    });
    assert!(matches!(
        descriptors(&only_names),
        Err(Error::MissingKey { key: "id", .. })
    ));
    let two_ids = map(3, |w| {
        w.kv_uint("id", 1);
        w.kv_uint("id", 2);
        w.str("names");
        w.array(0);
    });
    assert!(matches!(
        descriptors(&two_ids),
        Err(Error::DuplicateKey { key: "id", .. })
    ));
    let long_key = "k".repeat(100);
    let unknown = map(3, |w| {
        w.kv_uint("id", 1);
        w.str("names");
        w.array(0);
        w.kv_uint(&long_key, 0);
    });
    match descriptors(&unknown) {
        Err(Error::UnknownKey { key, .. }) => assert_eq!(key.len(), 64, "the key is cut"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn counts_and_lengths_past_the_limits_are_refused() {
    let tight = Limits {
        max_body_bytes: 64,
        max_names: 2,
        max_name_bytes: 4,
    };
    let three = Descriptors {
        id: 1,
        names: vec!["a", "b", "c"],
    }
    .encode()
    .unwrap();
    assert_eq!(
        Descriptors::decode(body(&three), &tight),
        Err(Error::TooLarge {
            what: "a channel message's name count",
            value: 3,
            limit: 2
        })
    );
    let long = Descriptors {
        id: 1,
        names: vec!["abcd", "abcde"],
    }
    .encode()
    .unwrap();
    assert_eq!(
        Descriptors::decode(body(&long), &tight),
        Err(Error::TooLarge {
            what: "a segment name's length",
            value: 5,
            limit: 4
        })
    );
    let fits = Descriptors {
        id: 1,
        names: vec!["abcd", "abcd"],
    };
    assert_eq!(
        Descriptors::decode(body(&fits.encode().unwrap()), &tight).as_ref(),
        Ok(&fits)
    );
    // A body length past the limit, before a byte of it is read.
    assert_eq!(body_len(64u32.to_le_bytes(), &tight), Ok(64));
    assert!(matches!(
        body_len(65u32.to_le_bytes(), &tight),
        Err(Error::TooLarge { value: 65, .. })
    ));
    assert!(body_len([0xff; 4], &Limits::DEFAULT).is_err());
}

#[test]
fn a_declared_count_beyond_the_bytes_is_refused_before_allocating() {
    // 2^32-1 names declared in a 20-byte body; and under limits that would
    // allow them, the bytes left still refuse them.
    let raw = map(2, |w| {
        w.kv_uint("id", 1);
        w.str("names");
        w.raw(b"\xdd\xff\xff\xff\xff");
    });
    let open = Limits {
        max_names: u64::MAX,
        ..Limits::DEFAULT
    };
    assert!(matches!(
        Descriptors::decode(&raw, &open),
        Err(Error::Malformed {
            reason: "count exceeds the remaining bytes",
            ..
        })
    ));
    assert!(matches!(descriptors(&raw), Err(Error::Malformed { .. })));
}

#[test]
fn errors_read_well() {
    let e = Descriptors::decode(
        body(
            &Descriptors {
                id: 1,
                names: vec!["a", "b"],
            }
            .encode()
            .unwrap(),
        ),
        &Limits {
            max_names: 1,
            ..Limits::DEFAULT
        },
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "a channel message's name count is 2, the limit is 1"
    );
    assert_eq!(
        hello(b"\x80").unwrap_err().to_string(),
        "the channel greeting has no key \"token\""
    );
}
