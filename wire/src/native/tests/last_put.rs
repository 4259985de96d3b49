//! A put shaped like the last one read on its thread takes that one's
//! checked fields map: the same request as a thread reading it first would
//! make, or the same error.

use super::*;
use crate::native::decode::last_put_hits;

/// The decode of `frames` on a thread that has read no put before.
fn first_read(frames: &[Bytes], limits: Limits) -> Result<Request, Error> {
    let frames = frames.to_vec();
    std::thread::spawn(move || decode_request(&frames, &limits))
        .join()
        .unwrap()
}

fn shaped(indexes: Vec<u64>, seed: u8) -> Vec<Bytes> {
    let n = indexes.len() as u64;
    encode_request(&put(
        indexes,
        vec![
            ("x", Field::Regular(tensor(Dtype::Float32, &[n, 4], seed))),
            ("mask", Field::Regular(tensor(Dtype::Bool, &[n], seed))),
            (
                "ids",
                Field::Regular(tensor(Dtype::Int64, &[n, 2, 3], seed)),
            ),
        ],
    ))
    .unwrap()
}

fn fields_of(req: &Request) -> &[(std::sync::Arc<str>, WireField)] {
    match &req.op {
        Op::Put { fields, .. } => fields,
        other => panic!("not a put: {other:?}"),
    }
}

#[test]
fn a_put_shaped_like_the_last_reads_as_a_first_read_would() {
    let limits = Limits::default();
    let a = shaped(vec![4, 5, 6], 1);
    let b = shaped(vec![40, 9, 70], 9);
    decode_request(&a, &limits).unwrap();
    let hits = last_put_hits();
    let got = decode_request(&b, &limits).unwrap();
    assert_eq!(
        last_put_hits(),
        hits + 1,
        "the second put took the first's map"
    );
    assert_eq!(got, first_read(&b, limits).unwrap());
    // Its tensors are views of its own frames, not of the first put's.
    for (_, field) in fields_of(&got) {
        if let WireField::Regular(parts) = field {
            for (bytes, _) in parts.parts() {
                assert!(b[1..].iter().any(|f| within(bytes, f)));
                assert!(!a[1..].iter().any(|f| within(bytes, f)));
            }
        }
    }
}

#[test]
fn a_changed_descriptor_or_other_limits_are_read_again() {
    let limits = Limits::default();
    decode_request(&shaped(vec![1, 2, 3], 1), &limits).unwrap();
    let hits = last_put_hits();
    // Four rows: other shapes, other parts.
    let four = shaped(vec![1, 2, 3, 4], 1);
    assert_eq!(
        decode_request(&four, &limits).unwrap(),
        first_read(&four, limits).unwrap()
    );
    assert_eq!(last_put_hits(), hits);
    // The same bytes under a limit they break: refused as a first read is.
    let tight = Limits {
        max_rows: 3,
        ..limits
    };
    let (ours, first) = (
        decode_request(&four, &tight).unwrap_err(),
        first_read(&four, tight).unwrap_err(),
    );
    assert_eq!(ours.to_string(), first.to_string());
    assert_eq!(last_put_hits(), hits);
    // And the map read under the first limits is still kept.
    decode_request(&four, &limits).unwrap();
    assert_eq!(last_put_hits(), hits + 1);
}

#[test]
fn a_same_shaped_put_without_its_data_gets_a_first_reads_error() {
    let limits = Limits::default();
    let a = shaped(vec![1, 2, 3], 1);
    decode_request(&a, &limits).unwrap();
    let hits = last_put_hits();
    let mut b = shaped(vec![7, 8, 9], 2);
    let last = b.len() - 1;
    b[last] = b[last].slice(..b[last].len() - 1);
    let (ours, first) = (
        decode_request(&b, &limits).unwrap_err(),
        first_read(&b, limits).unwrap_err(),
    );
    assert_eq!(last_put_hits(), hits + 1);
    assert_eq!(ours.to_string(), first.to_string());
    // A frame too many is refused too.
    let mut c = shaped(vec![7, 8, 9], 2);
    c.push(Bytes::from_static(b"extra"));
    assert_eq!(
        decode_request(&c, &limits).unwrap_err().to_string(),
        first_read(&c, limits).unwrap_err().to_string()
    );
}

#[test]
fn a_map_with_plain_values_or_nested_rows_is_not_kept() {
    let limits = Limits::default();
    let values = |s: &str| {
        encode_request(&put(
            vec![1],
            vec![
                ("x", Field::Regular(tensor(Dtype::Uint8, &[1, 2], 3))),
                ("v", Field::Values(vec![Value::Str(s.into())])),
            ],
        ))
        .unwrap()
    };
    let (a, b) = (values("one"), values("two"));
    decode_request(&a, &limits).unwrap();
    let hits = last_put_hits();
    let got = decode_request(&b, &limits).unwrap();
    assert_eq!(last_put_hits(), hits);
    assert_eq!(got, first_read(&b, limits).unwrap());
    let nested = |seed: u8| {
        let rows = (0..3).map(|i| tensor(Dtype::Int16, &[i], seed)).collect();
        encode_request(&put(vec![5, 6, 7], vec![("n", Field::Nested(rows))])).unwrap()
    };
    for seed in [1, 2] {
        let frames = nested(seed);
        assert_eq!(
            decode_request(&frames, &limits).unwrap(),
            first_read(&frames, limits).unwrap()
        );
    }
    assert_eq!(last_put_hits(), hits);
    // A put of another shape between two alike: the last one is what counts.
    let (x, y) = (shaped(vec![1, 2], 1), shaped(vec![3, 4], 2));
    decode_request(&x, &limits).unwrap();
    decode_request(&a, &limits).unwrap();
    decode_request(&y, &limits).unwrap();
    assert_eq!(
        last_put_hits(),
        hits + 1,
        "x's map is kept past a's, which is not kept"
    );
}

/// Frame 0 of a put of `fields`' layouts, written on this thread and on a
/// thread that has written none: the two must be the same bytes.
fn head_both_ways(indexes: Vec<u64>, fields: Vec<(std::sync::Arc<str>, FieldLayout)>) -> Bytes {
    let head = RequestHead::Put {
        global_indexes: indexes,
        fields,
    };
    let here = encode_request_head(3, &head).unwrap();
    let first = std::thread::spawn(move || encode_request_head(3, &head).unwrap())
        .join()
        .unwrap();
    assert_eq!(here, first);
    here
}

fn regular_layout(dtype: Dtype, shape: &[u64], frame: u64, offset: u64) -> FieldLayout {
    let row: u64 = shape[1..].iter().product::<u64>() * dtype.itemsize() as u64;
    FieldLayout::Regular {
        dtype,
        shape: shape.iter().copied().collect(),
        parts: smallvec::smallvec![PartLayout {
            frame,
            offset,
            len: row * shape[0],
            rows: shape[0],
        }],
    }
}

#[test]
fn a_put_head_like_the_last_is_written_as_a_first_write_would() {
    let name = |s: &str| crate::names::shared_name(s);
    let fields = |n: u64, second: &str| {
        vec![
            (name("x"), regular_layout(Dtype::Float32, &[n, 4], 1, 0)),
            (name(second), regular_layout(Dtype::Int64, &[n], 1, 16 * n)),
        ]
    };
    let a = head_both_ways(vec![1, 2], fields(2, "y"));
    // The same fields, other indexes: frame 0 differs only there.
    let b = head_both_ways(vec![7, 9], fields(2, "y"));
    assert_ne!(a, b);
    let decoded = |f: Bytes| {
        let mut frames = vec![f];
        frames.push(Bytes::from(vec![0u8; 64]));
        decode_request(&frames, &Limits::default()).unwrap()
    };
    let (ra, rb) = (decoded(a), decoded(b));
    assert_eq!(fields_of(&ra).len(), 2);
    assert_eq!(
        fields_of(&ra)
            .iter()
            .map(|(n, f)| (n.clone(), f.rows()))
            .collect::<Vec<_>>(),
        fields_of(&rb)
            .iter()
            .map(|(n, f)| (n.clone(), f.rows()))
            .collect::<Vec<_>>()
    );
    // Another name, another row count, another order: each written anew.
    head_both_ways(vec![7, 9], fields(2, "z"));
    head_both_ways(vec![7, 9, 10], fields(3, "z"));
    let mut swapped = fields(3, "z");
    swapped.reverse();
    head_both_ways(vec![7, 9, 10], swapped);
    // A nested field beside a regular one is written, not kept.
    let nested = FieldLayout::Nested {
        dtype: Dtype::Uint8,
        rows: vec![RowLayout {
            shape: vec![2],
            frame: 1,
            offset: 0,
            len: 2,
        }],
    };
    let mut mixed = fields(1, "z");
    mixed.push((name("n"), nested));
    head_both_ways(vec![5], mixed.clone());
    head_both_ways(vec![5], mixed);
}
