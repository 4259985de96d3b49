//! A get's `global_indexes` as `{"ranges": [[start, count, step], ...]}`:
//! decoded as runs, written by the encoder where shorter, and refused with
//! a clear error when a range is empty, repeats, overflows or is too large,
//! or appears in a put or a clear.

use super::*;

fn ranges(rs: &[[u64; 3]]) -> M {
    M::Map(vec![(
        "ranges",
        M::Arr(rs.iter().map(|r| uints(r)).collect()),
    )])
}

fn get_with(indexes: M) -> Result<Request, Error> {
    let env = envelope(
        "get",
        M::Map(vec![
            ("global_indexes", indexes),
            ("fields", M::Arr(vec![M::S("x")])),
        ]),
    );
    decode(&[env.bytes()])
}

fn indexes_of(req: Request) -> Indexes {
    match req.op {
        Op::Get { global_indexes, .. } => global_indexes,
        other => panic!("not a get: {other:?}"),
    }
}

#[test]
fn a_get_names_its_indexes_as_ranges() {
    let ix = indexes_of(get_with(ranges(&[[10, 3, 5], [0, 2, 1]])).unwrap());
    assert_eq!(ix.to_vec(), [10, 15, 20, 0, 1]);
    assert_eq!(ix.runs().len(), 2);
    let top = indexes_of(get_with(ranges(&[[u64::MAX - 2, 3, 1]])).unwrap());
    assert_eq!(top.to_vec(), [u64::MAX - 2, u64::MAX - 1, u64::MAX]);
    // A list is runs too, found in one pass.
    let ix = indexes_of(get_with(uints(&[0, 1, 2, 3, 9])).unwrap());
    assert_eq!(ix.runs().len(), 2);
}

fn get_of(id: u64, list: &[u64]) -> Request {
    Request {
        id,
        op: Op::Get {
            global_indexes: list.into(),
            fields: vec!["x".into()],
        },
    }
}

#[test]
fn the_encoder_writes_ranges_only_where_shorter() {
    let long: Vec<u64> = (0..1000).map(|i| 7 + 3 * i).collect();
    // A run of one among long runs goes as a range of step 1.
    let mut mixed: Vec<u64> = (0..100).collect();
    mixed.push(7);
    mixed.extend(200..300);
    for (id, list) in [(3, long), (5, mixed)] {
        let req = get_of(id, &list);
        let frames = encode_request(&req).unwrap();
        assert!(frames[0].len() < 100, "{} bytes", frames[0].len());
        assert_eq!(decode(&frames).unwrap(), req);
    }
    // Short lists, and repeats, stay lists: the bytes a list-only peer
    // expects.
    for list in [vec![1, 0], vec![5, 5, 5, 5, 5, 5, 5, 5], vec![0, 1, 2]] {
        let req = get_of(4, &list);
        let frames = encode_request(&req).unwrap();
        let env = envelope(
            "get",
            M::Map(vec![
                ("global_indexes", uints(&list)),
                ("fields", M::Arr(vec![M::S("x")])),
            ]),
        )
        .set(&["id"], Some(M::U(4)));
        assert_eq!(frames[0], env.bytes(), "{list:?}");
        assert_eq!(decode(&frames).unwrap(), req);
    }
}

#[test]
fn bad_ranges_are_refused_with_what_is_wrong() {
    let cases: Vec<(M, &str, &str)> = vec![
        (
            ranges(&[[0, 0, 1]]),
            code::BAD_REQUEST,
            "a range of 0 indexes",
        ),
        (ranges(&[[4, 2, 0]]), code::BAD_REQUEST, "step 0"),
        (
            ranges(&[[u64::MAX, 2, 1]]),
            code::BAD_REQUEST,
            "past the largest",
        ),
        (
            ranges(&[[0, 3, u64::MAX]]),
            code::BAD_REQUEST,
            "past the largest",
        ),
        (
            ranges(&[[0, Limits::default().max_rows, 1], [0, 1, 1]]),
            code::TOO_LARGE,
            "global indexes is",
        ),
        (ranges(&[]), code::BAD_REQUEST, "empty batch"),
        (
            M::Map(vec![("ranges", M::Arr(vec![uints(&[1, 2])]))]),
            code::BAD_REQUEST,
            "[start, count, step]",
        ),
        (
            M::Map(vec![(
                "ranges",
                M::Arr(vec![M::Arr(vec![M::U(0), M::U(2), M::I(-1)])]),
            )]),
            code::BAD_REQUEST,
            "step",
        ),
        (
            M::Map(vec![("ranges", M::Arr(vec![])), ("step", M::U(1))]),
            code::BAD_REQUEST,
            "unexpected key",
        ),
        (M::Map(vec![]), code::BAD_REQUEST, "no key \"ranges\""),
    ];
    for (indexes, code, words) in cases {
        let err = get_with(indexes).expect_err(words);
        assert_eq!(err.code(), code, "{err}");
        assert!(err.to_string().contains(words), "{err} (wanted {words:?})");
    }
}

#[test]
fn puts_and_clears_take_lists_only() {
    let err = bad_put(&["body", "global_indexes"], Some(ranges(&[[0, 2, 1]])));
    assert_eq!(err.code(), code::BAD_REQUEST);
    assert!(err.to_string().contains("must be an array"), "{err}");
    let clear = envelope(
        "clear",
        M::Map(vec![("global_indexes", ranges(&[[0, 2, 1]]))]),
    );
    let err = decode(&[clear.bytes()]).expect_err("a clear by ranges");
    assert_eq!(err.code(), code::BAD_REQUEST);
}
