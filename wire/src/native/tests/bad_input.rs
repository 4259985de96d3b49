//! One test per kind of bad input.

use super::*;

#[test]
fn malformed_msgpack_is_bad_request() {
    let good = hand_put().bytes();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (good[..good.len() - 1].to_vec(), "truncated"),
        ([&good[..], &[0x00]].concat(), "trailing bytes"),
        (vec![0xc1], "reserved marker"),
        (vec![], "empty frame 0"),
        (vec![0x93, 0x01, 0x02, 0x03], "not a map"),
        (
            vec![0xdd, 0xff, 0xff, 0xff, 0xff],
            "array of 2^32-1 items in 5 bytes",
        ),
        (
            vec![0xdf, 0x7f, 0xff, 0xff, 0xff, 0xa1],
            "map of 2^31-1 entries",
        ),
    ];
    for (frame0, what) in cases {
        let err = decode(&[Bytes::from(frame0)]).expect_err(what);
        assert_eq!(err.code(), code::BAD_REQUEST, "{what}: {err}");
    }
    let huge_count = M::Raw(vec![0xdd, 0xff, 0xff, 0xff, 0xf0]);
    let err = bad_put(&["body", "global_indexes"], Some(huge_count));
    assert!(matches!(err, Error::Malformed { .. }), "{err}");
}

#[test]
fn invalid_utf8_and_deep_nesting_are_refused() {
    let err = bad_put(&["op"], Some(M::Raw(vec![0xa2, 0xff, 0xfe])));
    assert!(
        matches!(
            err,
            Error::Malformed {
                reason: "invalid UTF-8 in a str",
                ..
            }
        ),
        "{err}"
    );
    let deep = M::Raw([vec![0x91; 100], vec![0xc0]].concat());
    let values = M::Map(vec![
        ("kind", M::S("values")),
        ("values", M::Arr(vec![deep.clone(), deep])),
    ]);
    let err = bad_put(&["body", "fields", "x"], Some(values));
    assert!(
        matches!(
            err.root(),
            Error::Malformed {
                reason: "nesting too deep",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn missing_keys_are_refused() {
    for path in [
        &["id"][..],
        &["body"],
        &["body", "global_indexes"],
        &["body", "fields"],
        &["body", "fields", "x", "kind"],
    ] {
        let err = bad_put(path, None);
        assert!(
            matches!(err.root(), Error::MissingKey { .. }),
            "{path:?}: {err}"
        );
        assert_eq!(err.code(), code::BAD_REQUEST);
    }
    let parts = M::Arr(vec![M::Map(vec![
        ("frame", M::U(1)),
        ("offset", M::U(0)),
        ("rows", M::U(2)),
    ])]);
    assert!(matches!(
        bad_put(&X, Some(parts)).root(),
        Error::MissingKey { key: "len", .. }
    ));
    let err = bad_put(&["proto"], None);
    assert!(matches!(err, Error::MissingKey { key: "proto", .. }));
}

#[test]
fn unknown_and_duplicate_keys_are_refused() {
    let err = bad_put(&["body", "extra"], Some(M::U(1)));
    assert!(matches!(err, Error::UnknownKey { .. }), "{err}");
    let err = bad_put(&["trace"], Some(M::U(1)));
    assert!(matches!(err, Error::UnknownKey { .. }), "{err}");
    // A key that exists, but not for this kind.
    let err = bad_put(&["body", "fields", "x", "values"], Some(M::Arr(vec![])));
    assert!(matches!(err.root(), Error::UnknownKey { .. }), "{err}");
    let M::Map(mut kv) = hand_put() else {
        unreachable!()
    };
    kv.push(("id", M::U(3)));
    let err = decode(&frames_with(M::Map(kv), &[16])).unwrap_err();
    assert!(matches!(err, Error::DuplicateKey { .. }), "{err}");
}

#[test]
fn keys_are_read_in_any_order_and_a_key_of_bad_utf8_is_malformed() {
    // The decoder tries the key after the last one first: keys written in
    // reverse still decode, to the same request.
    let reversed = |m: M| match m {
        M::Map(mut kv) => {
            kv.reverse();
            M::Map(kv)
        }
        other => other,
    };
    let x = M::Map(vec![
        ("parts", M::Arr(vec![reversed(part(1, 0, 16, 2))])),
        ("shape", uints(&[2, 2])),
        ("dtype", M::S("float32")),
        ("kind", M::S("regular")),
    ]);
    let put = reversed(envelope(
        "put",
        reversed(M::Map(vec![
            ("global_indexes", uints(&[0, 1])),
            ("fields", M::Map(vec![("x", x)])),
        ])),
    ));
    assert_eq!(
        decode(&frames_with(put, &[16])).unwrap(),
        decode(&frames_with(hand_put(), &[16])).unwrap()
    );
    // A key is compared as bytes; one that matches none is checked as
    // UTF-8: invalid, a malformed str at its offset; valid, unknown.
    let good = hand_put().bytes().to_vec();
    let at = good
        .windows(6)
        .position(|w| w == b"\xa5dtype")
        .expect("the dtype key");
    let with_key = |key: &[u8]| {
        let frame0 = [&good[..at + 1], key, &good[at + 6..]].concat();
        decode(&[Bytes::from(frame0), Bytes::from(vec![0u8; 16])]).unwrap_err()
    };
    let err = with_key(b"\xffdtyp");
    assert!(
        matches!(
            err.root(),
            Error::Malformed {
                reason: "invalid UTF-8 in a str",
                offset,
            } if *offset == at + 1
        ),
        "{err}"
    );
    let err = with_key("dtyp\u{e9}".as_bytes().split_last().unwrap().1);
    assert!(
        matches!(err.root(), Error::Malformed { .. }),
        "half a character: {err}"
    );
    let err = with_key("dtýp".as_bytes());
    assert!(
        matches!(err.root(), Error::UnknownKey { key, .. } if key == "dtýp"),
        "{err}"
    );
}

#[test]
fn wrong_types_are_refused() {
    let cases = [
        (&["id"][..], M::S("1")),
        (&["id"], M::I(-1)),
        (&["body", "global_indexes"], M::Map(vec![])),
        (&["body", "global_indexes"], M::Arr(vec![M::I(-3)])),
        (&["body", "fields"], M::Arr(vec![])),
        (
            &["body", "fields", "x", "shape"],
            M::Arr(vec![M::S("2"), M::U(2)]),
        ),
        (&["body", "fields", "x", "dtype"], M::U(4)),
        (&X, M::Arr(vec![M::U(1)])),
    ];
    for (path, value) in cases {
        let err = bad_put(path, Some(value));
        assert!(
            matches!(err.root(), Error::WrongType { .. }),
            "{path:?}: {err}"
        );
    }
}

#[test]
fn unknown_proto_and_op_are_unsupported() {
    let frames = frames_with(
        hand_put()
            .set(&["proto"], Some(M::S("stowage/2")))
            .set(&["zzz"], Some(M::U(0))),
        &[16],
    );
    let err = decode(&frames).unwrap_err();
    assert_eq!(
        (err.code(), request_id(&frames)),
        (code::UNSUPPORTED, Some(9))
    );
    assert!(err.to_string().contains("stowage/2"));
    let err = bad_put(&["op"], Some(M::S("put_ok")));
    assert_eq!(err, Error::UnknownOp("put_ok".into()));
    assert_eq!(err.code(), code::UNSUPPORTED);
    let reply = Reply::from_error(&err);
    let (id, back) = decode_reply(&encode_reply(9, &reply).unwrap(), &Limits::default()).unwrap();
    assert_eq!(
        (id, back),
        (
            9,
            Reply::Error {
                code: "unsupported".into(),
                message: "unsupported op \"put_ok\"".into()
            }
        )
    );
    assert_eq!(request_id(&[Bytes::from_static(b"\xc1")]), None);
}

#[test]
fn frame_index_out_of_range() {
    for frame in [0, 2, u64::MAX] {
        let err = bad_put(&X, Some(M::Arr(vec![part(frame, 0, 16, 2)])));
        assert!(matches!(err.root(), Error::FrameOutOfRange { .. }), "{err}");
    }
}

#[test]
fn unused_data_frames() {
    let err = decode(&frames_with(hand_put(), &[16, 4])).unwrap_err();
    assert_eq!(err, Error::UnusedFrame(2));
    let get = Request {
        id: 1,
        op: Op::Get {
            global_indexes: vec![1].into(),
            fields: vec!["a".into()],
        },
    };
    let mut frames = encode_request(&get).unwrap();
    frames.push(Bytes::new());
    assert_eq!(decode(&frames).unwrap_err(), Error::UnusedFrame(1));
}

#[test]
fn part_ranges_outside_their_frame() {
    for (offset, len, rows) in [(8, 16, 2), (u64::MAX, 16, 2), (16, 0, 0), (0, 32, 4)] {
        let env = hand_put().set(&X, Some(M::Arr(vec![part(1, offset, len, rows)])));
        let env = env.set(&["body", "fields", "x", "shape"], Some(uints(&[rows, 2])));
        let err = decode(&frames_with(env, &[16])).unwrap_err();
        let ok = matches!(
            err.root(),
            Error::RangeOutsideFrame { .. } | Error::EmptyPart
        );
        assert!(ok, "{offset}+{len}: {err}");
    }
}

#[test]
fn part_rows_must_sum_to_the_shape() {
    for parts in [
        vec![part(1, 0, 8, 1)],
        vec![part(1, 0, 8, 1), part(1, 8, 8, 1), part(1, 0, 8, 1)],
    ] {
        let err = bad_put(&X, Some(M::Arr(parts)));
        assert!(matches!(err.root(), Error::RowSum { .. }), "{err}");
    }
    let err = bad_put(&X, Some(M::Arr(vec![part(1, 0, 0, 0), part(1, 0, 16, 2)])));
    assert_eq!(err.root(), &Error::EmptyPart);
    let err = bad_put(&X, Some(M::Arr(vec![part(1, 0, 12, 2)])));
    assert!(
        matches!(
            err.root(),
            Error::LengthMismatch {
                len: 12,
                expected: 16
            }
        ),
        "{err}"
    );
}

#[test]
fn row_count_must_match_the_indexes() {
    let err = bad_put(&["body", "global_indexes"], Some(uints(&[0, 1, 2])));
    assert!(
        matches!(
            err.root(),
            Error::RowCount {
                rows: 2,
                expected: 3
            }
        ),
        "{err}"
    );
    let req = put(
        vec![0, 1],
        vec![("v", Field::Values(vec![Value::Str("a".into())]))],
    );
    let err = decode(&encode_request(&req).unwrap()).unwrap_err();
    assert!(matches!(err.root(), Error::RowCount { .. }));
}

#[test]
fn duplicate_global_indexes_in_a_put() {
    let err = bad_put(&["body", "global_indexes"], Some(uints(&[4, 4])));
    assert_eq!(err, Error::DuplicateIndex(4));
    let req = put(
        vec![3, 1, 3],
        vec![("v", Field::Values(vec![Value::Str("a".into()); 3]))],
    );
    assert_eq!(
        decode(&encode_request(&req).unwrap()).unwrap_err(),
        Error::DuplicateIndex(3)
    );
}

#[test]
fn duplicate_field_names() {
    let get = Request {
        id: 1,
        op: Op::Get {
            global_indexes: vec![1].into(),
            fields: vec!["a".into(), "a".into()],
        },
    };
    assert_eq!(
        decode(&encode_request(&get).unwrap()).unwrap_err(),
        Error::DuplicateField("a".into())
    );
    let v = WireField::Values(vec![Value::Str("a".into())]);
    let req = Request {
        id: 1,
        op: Op::Put {
            global_indexes: vec![0],
            fields: vec![("a".into(), v.clone()), ("a".into(), v)],
        },
    };
    assert_eq!(
        decode(&encode_request(&req).unwrap()).unwrap_err(),
        Error::DuplicateField("a".into())
    );
    // Short lists are checked by a scan, long ones by a hash set: a
    // repeat is found either way, first or last, and distinct names pass.
    for n in [2usize, 15, 16, 17, 40] {
        let distinct: Vec<String> = (0..n).map(|i| format!("fé{i}")).collect();
        let get = |fields: Vec<String>| Request {
            id: 1,
            op: Op::Get {
                global_indexes: vec![1].into(),
                fields,
            },
        };
        assert!(decode(&encode_request(&get(distinct.clone())).unwrap()).is_ok());
        for (at, again) in [(n - 1, 0), (1, 0), (n - 1, n - 2)] {
            let mut fields = distinct.clone();
            fields[at] = fields[again].clone();
            assert_eq!(
                decode(&encode_request(&get(fields)).unwrap()).unwrap_err(),
                Error::DuplicateField(distinct[again].clone()),
                "{n} names, name {at} repeats name {again}"
            );
        }
        let puts = |names: &[String]| Request {
            id: 1,
            op: Op::Put {
                global_indexes: vec![0],
                fields: names
                    .iter()
                    .map(|name| {
                        (
                            name.as_str().into(),
                            WireField::Values(vec![Value::Str("x".into())]),
                        )
                    })
                    .collect(),
            },
        };
        assert!(decode(&encode_request(&puts(&distinct)).unwrap()).is_ok());
        let mut names = distinct.clone();
        names[n - 1] = names[0].clone();
        assert_eq!(
            decode(&encode_request(&puts(&names)).unwrap()).unwrap_err(),
            Error::DuplicateField(distinct[0].clone()),
        );
    }
}

#[test]
fn unknown_dtype_and_kind() {
    let err = bad_put(&["body", "fields", "x", "dtype"], Some(M::S("float8")));
    assert_eq!(err.root(), &Error::UnknownDType("float8".into()));
    let err = bad_put(&["body", "fields", "x", "kind"], Some(M::S("sparse")));
    assert_eq!(err.root(), &Error::UnknownKind("sparse".into()));
    // Receivers accept torch's prefix and aliases.
    let frames = frames_with(
        hand_put().set(&["body", "fields", "x", "dtype"], Some(M::S("torch.float"))),
        &[16],
    );
    assert!(decode(&frames).is_ok());
}

#[test]
fn negative_or_absurd_shapes() {
    let shape = ["body", "fields", "x", "shape"];
    let err = bad_put(&shape, Some(M::Arr(vec![M::I(-2), M::U(2)])));
    assert!(matches!(err.root(), Error::WrongType { .. }), "{err}");
    let err = bad_put(&shape, Some(uints(&[2, 1 << 62, 1 << 62])));
    assert!(matches!(err.root(), Error::BadShape { .. }), "{err}");
    let err = bad_put(&shape, Some(uints(&[])));
    assert!(matches!(err.root(), Error::BadShape { .. }), "{err}");
    let err = bad_put(&shape, Some(uints(&[1; 65])));
    assert_eq!(err.root(), &Error::TooManyDims(65));
    // [2, 0] rows have no bytes: the length check must not be fooled by
    // 2^63 rows of nothing.
    let env = hand_put().set(&shape, Some(uints(&[2, 0]))).set(
        &X,
        Some(M::Arr(vec![part(1, 0, 0, 1 << 63), part(1, 0, 0, 1 << 63)])),
    );
    let err = decode(&frames_with(env, &[16])).unwrap_err();
    assert!(matches!(err.root(), Error::RowSum { .. }), "{err}");
    let row = M::Map(vec![
        ("shape", uints(&[u64::MAX, 2])),
        ("frame", M::U(1)),
        ("offset", M::U(0)),
        ("len", M::U(16)),
    ]);
    let nested = M::Map(vec![
        ("kind", M::S("nested")),
        ("dtype", M::S("int8")),
        ("rows", M::Arr(vec![row.clone(), row])),
    ]);
    let err = bad_put(&["body", "fields", "x"], Some(nested));
    assert!(
        matches!(
            err.root(),
            Error::BadShape { .. } | Error::LengthMismatch { .. }
        ),
        "{err}"
    );
}

#[test]
fn empty_batches_are_refused() {
    let err = bad_put(&["body", "global_indexes"], Some(uints(&[])));
    assert!(matches!(err, Error::EmptyBatch(_)));
    assert!(err.to_string().starts_with("empty batch"), "{err}");
    let err = decode(&frames_with(
        hand_put().set(&["body", "fields"], Some(M::Map(vec![]))),
        &[],
    ))
    .unwrap_err();
    assert!(matches!(err, Error::EmptyBatch(_)), "{err}");
    for (ix, fields) in [(vec![], vec!["a".to_owned()]), (vec![1], vec![])] {
        let get = Request {
            id: 1,
            op: Op::Get {
                global_indexes: ix.into(),
                fields,
            },
        };
        let err = decode(&encode_request(&get).unwrap()).unwrap_err();
        assert!(err.to_string().starts_with("empty batch"), "{err}");
        assert_eq!(err.code(), code::BAD_REQUEST);
    }
}

#[test]
fn limits_are_enforced_before_allocating() {
    let frames = frames_with(hand_put(), &[16]);
    let cases = [
        (
            Limits {
                max_rows: 1,
                ..Limits::default()
            },
            "global indexes",
        ),
        (
            Limits {
                max_fields: 0,
                ..Limits::default()
            },
            "fields",
        ),
        (
            Limits {
                max_frames: 1,
                ..Limits::default()
            },
            "frames",
        ),
        (
            Limits {
                max_message_bytes: 100,
                ..Limits::default()
            },
            "message bytes",
        ),
    ];
    for (limits, what) in cases {
        let err = decode_request(&frames, &limits).unwrap_err();
        assert_eq!(err.code(), code::TOO_LARGE, "{what}: {err}");
        assert!(
            matches!(err.root(), Error::TooLarge { what: w, .. } if *w == what),
            "{err}"
        );
    }
    // A declared shape larger than the row limit, with the index count in range.
    let env = hand_put().set(
        &["body", "fields", "x", "shape"],
        Some(uints(&[1 << 40, 2])),
    );
    let err = decode_request(
        &frames_with(env, &[16]),
        &Limits {
            max_rows: 2,
            ..Limits::default()
        },
    )
    .unwrap_err();
    assert_eq!(err.code(), code::TOO_LARGE, "{err}");
    assert_eq!(decode(&[]).unwrap_err(), Error::NoFrames);
}

#[test]
fn bad_replies_are_refused() {
    let x = WireField::from_field(&Field::Regular(tensor(Dtype::Uint8, &[2, 1], 0))).unwrap();
    let y = WireField::Values(vec![Value::Str("a".into())]);
    let frames = encode_reply(
        1,
        &Reply::GetOk {
            fields: vec![("x".into(), x), ("y".into(), y)],
        },
    )
    .unwrap();
    let err = decode_reply(&frames, &Limits::default()).unwrap_err();
    assert!(
        matches!(
            err.root(),
            Error::RowCount {
                rows: 1,
                expected: 2
            }
        ),
        "{err}"
    );
    let stats = Reply::StatsOk(vec![("a".into(), Stat::Int(1)), ("a".into(), Stat::Int(2))]);
    let err = decode_reply(&encode_reply(1, &stats).unwrap(), &Limits::default()).unwrap_err();
    assert!(matches!(err, Error::DuplicateKey { .. }), "{err}");
    let err = decode_reply(&frames_with(hand_put(), &[16]), &Limits::default()).unwrap_err();
    assert_eq!(err, Error::UnknownOp("put".into()));
    let nested = Stat::Map(vec![("a".into(), Stat::Int(1)), ("a".into(), Stat::Int(2))]);
    let stats = Reply::StatsOk(vec![("plugin.x".into(), nested)]);
    let err = decode_reply(&encode_reply(1, &stats).unwrap(), &Limits::default()).unwrap_err();
    assert!(matches!(err, Error::DuplicateKey { .. }), "{err}");
}

#[test]
fn stats_nesting_is_bounded() {
    let deep = |levels: usize| {
        let mut v = Stat::Int(1);
        for _ in 0..levels {
            v = Stat::List(vec![v]);
        }
        Reply::StatsOk(vec![("x".into(), v)])
    };
    let ok = deep(STATS_MAX_DEPTH);
    let frames = encode_reply(1, &ok).unwrap();
    assert_eq!(decode_reply(&frames, &Limits::default()).unwrap(), (1, ok));
    let err = decode_reply(
        &encode_reply(1, &deep(STATS_MAX_DEPTH + 1)).unwrap(),
        &Limits::default(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::Malformed { .. }), "{err}");
    // A nil or bin value is not a stat.
    for value in [M::Raw(vec![0xc0]), M::Raw(vec![0xc4, 1, 0])] {
        let env = envelope("stats_ok", M::Map(vec![("x", value)]));
        let err = decode_reply(&[env.bytes()], &Limits::default()).unwrap_err();
        assert!(matches!(err, Error::WrongType { .. }), "{err}");
    }
}

#[test]
fn unencodable_values_are_refused() {
    let bad = WireField::Values(vec![Value::Msgpack(Bytes::from_static(&[0x92, 0x01]))]);
    let req = Request {
        id: 1,
        op: Op::Put {
            global_indexes: vec![0],
            fields: vec![("v".into(), bad)],
        },
    };
    assert_eq!(encode_request(&req).unwrap_err().code(), code::INTERNAL);
    let empty = WireField::Nested(vec![]);
    let reply = Reply::GetOk {
        fields: vec![("n".into(), empty)],
    };
    assert!(matches!(
        encode_reply(1, &reply).unwrap_err().root(),
        Error::Unencodable(_)
    ));
}

/// Every prefix and thousands of byte flips of valid messages: never a
/// panic, and anything accepted re-encodes.
#[test]
fn mangled_messages_never_panic() {
    let req = put(
        vec![0, 1],
        vec![
            ("r", Field::Regular(tensor(Dtype::Float32, &[2, 2], 0))),
            (
                "n",
                Field::Nested(vec![
                    tensor(Dtype::Uint8, &[1], 0),
                    tensor(Dtype::Uint8, &[3], 0),
                ]),
            ),
            (
                "v",
                Field::Values(vec![
                    Value::Msgpack(Bytes::from_static(&[0x81, 0xa1, 0x61, 0xc3])),
                    Value::Str("z".into()),
                ]),
            ),
        ],
    );
    let frames = encode_request(&req).unwrap();
    let reply = encode_reply(
        2,
        &Reply::StatsOk(vec![
            ("f".into(), Stat::Float(1.5)),
            ("s".into(), Stat::Str("x".into())),
        ]),
    )
    .unwrap();
    let nested = encode_reply(
        3,
        &Reply::StatsOk(vec![
            ("rows".into(), Stat::Int(4)),
            (
                "plugin.runs".into(),
                Stat::Map(vec![
                    ("version".into(), Stat::Str("0.1.0".into())),
                    ("capabilities".into(), Stat::strs(&["select"])),
                    ("disabled".into(), Stat::Bool(false)),
                ]),
            ),
            (
                "deep".into(),
                Stat::List(vec![Stat::List(vec![Stat::Map(vec![(
                    "k".into(),
                    Stat::Float(0.5),
                )])])]),
            ),
        ]),
    )
    .unwrap();
    for base in [frames, reply, nested] {
        let env = base[0].to_vec();
        for cut in 0..env.len() {
            let mut f = base.clone();
            f[0] = Bytes::copy_from_slice(&env[..cut]);
            assert!(decode(&f).is_err());
            let _ = decode_reply(&f, &Limits::default());
        }
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let mut bytes = env.clone();
            let i = (seed % bytes.len() as u64) as usize;
            bytes[i] = (seed >> 32) as u8;
            let mut f = base.clone();
            f[0] = Bytes::from(bytes);
            if let Ok(req) = decode(&f) {
                encode_request(&req).unwrap();
            }
            if let Ok((id, reply)) = decode_reply(&f, &Limits::default()) {
                let again = encode_reply(id, &reply).unwrap();
                let (_, back) = decode_reply(&again, &Limits::default()).unwrap();
                assert_eq!(format!("{back:?}"), format!("{reply:?}"));
            }
        }
    }
}

#[test]
fn a_packed_frame_of_rows_back_to_back_in_one_buffer_is_that_buffer() {
    // three nested int32 rows stored as slices of one received buffer, and
    // a fourth from elsewhere
    let buf = Bytes::from((0u8..48).collect::<Vec<u8>>());
    let row = |a: usize, b: usize| {
        Tensor::contiguous(buf.slice(a..b), Dtype::Int32, vec![((b - a) / 4) as u64]).unwrap()
    };
    let other = Tensor::contiguous(Bytes::from(vec![9u8; 8]), Dtype::Int32, vec![2]).unwrap();
    let span = |p: *const u8, len: usize| {
        let off = (p as usize).checked_sub(buf.as_ptr() as usize)?;
        (off + len <= buf.len()).then(|| buf.slice(off..off + len))
    };
    let all_in_one = |rows: usize| FrameLayout {
        frames: vec![
            (0..rows as u64)
                .map(|r| RowSlice {
                    field: 0,
                    start: r,
                    end: r + 1,
                })
                .collect(),
        ],
    };
    let reply = Reply::GetOk {
        fields: vec![(
            "n".into(),
            WireField::Nested(vec![row(0, 8), row(8, 20), row(20, 48)]),
        )],
    };
    let frames = encode_reply_joined(1, &reply, &all_in_one(3), &span).unwrap();
    assert_eq!(frames.len(), 2);
    assert_eq!(
        frames[1].as_ptr(),
        buf.as_ptr(),
        "the frame is not the stored buffer"
    );
    assert_eq!(frames[1].len(), 48);
    assert_eq!(
        decode_reply(&frames, &Limits::default()).unwrap(),
        (1, reply.clone())
    );
    assert_eq!(
        encode_reply_with(1, &reply, &all_in_one(3)).unwrap(),
        frames,
        "joined and copied frames differ"
    );
    // out of order, or with a row from another buffer: copied
    let reply = Reply::GetOk {
        fields: vec![(
            "n".into(),
            WireField::Nested(vec![row(8, 20), row(0, 8), other]),
        )],
    };
    let frames = encode_reply_joined(1, &reply, &all_in_one(3), &span).unwrap();
    assert_ne!(frames[1].as_ptr(), buf.as_ptr());
    assert_eq!(
        decode_reply(&frames, &Limits::default()).unwrap(),
        (1, reply)
    );
}

#[test]
fn a_channel_token_must_be_a_short_string() {
    let request = Request {
        id: 5,
        op: Op::Channel,
    };
    let frames = encode_request(&request).unwrap();
    // The channel op and its reply round-trip.
    assert_eq!(decode(&frames).unwrap(), request);
    let reply = encode_reply(
        5,
        &Reply::ChannelOk {
            path: "/dev/shm/x/sock".into(),
        },
    )
    .unwrap();
    assert!(matches!(
        decode_reply(&reply, &Limits::default()).unwrap().1,
        Reply::ChannelOk { .. }
    ));
    let with = |token: &str| {
        with_extras(
            &frames[0],
            &Extras {
                channel: Some(token.into()),
                ..Extras::default()
            },
        )
        .unwrap()
    };
    let ok = decode_extras(&with(&"a".repeat(64)), &Limits::default()).unwrap();
    assert_eq!(ok.channel.as_deref(), Some("a".repeat(64).as_str()));
    // The request itself still decodes with the key in its envelope.
    assert_eq!(decode(&[with("abc")]).unwrap(), request);
    for bad in [String::new(), "a".repeat(65)] {
        let err = decode_extras(&with(&bad), &Limits::default()).expect_err("refused");
        assert_eq!(err.code(), code::BAD_REQUEST, "{err}");
    }
    // A body for `channel` is refused.
    let err = decode(&[Bytes::from_static(&[
        0x84, 0xa5, b'p', b'r', b'o', b't', b'o', 0xa9, b's', b't', b'o', b'w', b'a', b'g', b'e',
        b'/', b'1', 0xa2, b'o', b'p', 0xa7, b'c', b'h', b'a', b'n', b'n', b'e', b'l', 0xa2, b'i',
        b'd', 0x01, 0xa4, b'b', b'o', b'd', b'y', 0x81, 0xa1, b'x', 0x01,
    ])])
    .expect_err("a channel body with a key");
    assert_eq!(err.code(), code::BAD_REQUEST, "{err}");
}

/// The envelope's keys, and its `proto`, are compared as bytes: one that
/// matches none is checked as UTF-8 then, with the errors a str read
/// gives (a malformed str at its offset; else an unknown key, or another
/// protocol), in `decode_request` and `decode_extras` alike.
#[test]
fn envelope_keys_and_proto_compared_as_bytes_are_checked_when_unknown() {
    let good = frames_with(hand_put(), &[16]);
    let f0 = good[0].to_vec();
    let splice = |find: &[u8], with: &[u8]| -> Vec<Bytes> {
        let at = f0
            .windows(find.len())
            .position(|w| w == find)
            .expect("in frame 0");
        let frame0 = [&f0[..at], with, &f0[at + find.len()..]].concat();
        vec![Bytes::from(frame0), good[1].clone()]
    };
    let offset_of = |find: &[u8]| f0.windows(find.len()).position(|w| w == find).unwrap() + 1;
    let utf8 = |err: &Error, at: usize| {
        matches!(
            err.root(),
            Error::Malformed { reason: "invalid UTF-8 in a str", offset } if *offset == at
        )
    };
    // A key: invalid UTF-8, valid but unknown, and the known one.
    let bad_key = splice(b"\xa5proto", b"\xa5\xffroto");
    let err = decode(&bad_key).unwrap_err();
    assert!(utf8(&err, offset_of(b"\xa5proto")), "{err}");
    let err = decode_extras(&bad_key[0], &Limits::default()).unwrap_err();
    assert!(utf8(&err, offset_of(b"\xa5proto")), "extras: {err}");
    let err = decode(&splice(b"\xa5proto", b"\xa5prot\xc3")).unwrap_err();
    assert!(
        utf8(&err, offset_of(b"\xa5proto")),
        "half a character: {err}"
    );
    let unknown = frames_with(hand_put().set(&["zzý"], Some(M::U(0))), &[16]);
    let err = decode(&unknown).unwrap_err();
    assert!(
        matches!(&err, Error::UnknownKey { key, .. } if key == "zzý"),
        "{err}"
    );
    assert_eq!(err.code(), code::BAD_REQUEST, "{err}");
    assert!(decode_extras(&good[0], &Limits::default()).is_ok());
    // The proto: invalid UTF-8, another protocol, the same length.
    let value = f0
        .windows(10)
        .position(|w| w == b"\xa9stowage/1")
        .expect("proto value")
        + 1;
    let err = decode(&splice(b"\xa9stowage/1", b"\xa9stowage\xff1")).unwrap_err();
    assert!(utf8(&err, value), "{err}");
    let err = decode(&splice(b"\xa9stowage/1", b"\xa9stowage/2")).unwrap_err();
    assert_eq!(err, Error::UnsupportedProto("stowage/2".into()));
    // A duplicate key is named as it was written.
    let err = decode(&splice(b"\xa5proto", b"\xa2op")).unwrap_err();
    assert!(
        matches!(&err, Error::DuplicateKey { key, .. } if key == "op"),
        "{err}"
    );
}
