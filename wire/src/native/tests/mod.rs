//! Round trips, zero-copy checks, and one test per kind of bad input.

use bytes::Bytes;

use super::*;
use crate::batch::{Cell, Field, Value};
use crate::msgpack::Writer;
use crate::tensor::{Dtype, Tensor};

// ---------------------------------------------------------------- helpers

/// A tensor of `shape` whose bytes count up from `seed`.
fn tensor(dtype: Dtype, shape: &[u64], seed: u8) -> Tensor {
    let len = crate::tensor::contiguous_len(dtype, shape).unwrap();
    let data: Vec<u8> = (0..len).map(|i| seed.wrapping_add(i as u8)).collect();
    Tensor::contiguous(Bytes::from(data), dtype, shape.to_vec()).unwrap()
}

fn within(inner: &[u8], outer: &[u8]) -> bool {
    let (i, o) = (inner.as_ptr() as usize, outer.as_ptr() as usize);
    i >= o && i + inner.len() <= o + outer.len()
}

fn put(global_indexes: Vec<u64>, fields: Vec<(&str, Field)>) -> Request {
    let fields = fields
        .into_iter()
        .map(|(n, f)| (n.into(), WireField::from_field(&f).unwrap()))
        .collect();
    Request {
        id: 7,
        op: Op::Put {
            global_indexes,
            fields,
        },
    }
}

fn decode(frames: &[Bytes]) -> Result<Request, Error> {
    decode_request(frames, &Limits::default())
}

fn round_trip(req: &Request) -> Request {
    let frames = encode_request(req).unwrap();
    decode(&frames).unwrap()
}

/// A msgpack value to build (bad) messages by hand.
#[derive(Clone)]
enum M {
    Map(Vec<(&'static str, M)>),
    Arr(Vec<M>),
    S(&'static str),
    U(u64),
    I(i64),
    Raw(Vec<u8>),
}

impl M {
    fn write(&self, w: &mut Writer) {
        match self {
            M::Map(kv) => {
                w.map(kv.len());
                kv.iter().for_each(|(k, v)| {
                    w.str(k);
                    v.write(w);
                });
            }
            M::Arr(items) => {
                w.array(items.len());
                items.iter().for_each(|v| v.write(w));
            }
            M::S(s) => w.str(s),
            M::U(u) => w.uint(*u),
            M::I(i) => w.sint(*i),
            M::Raw(b) => w.raw(b),
        }
    }

    fn bytes(&self) -> Bytes {
        let mut w = Writer::new();
        self.write(&mut w);
        Bytes::from(w.finish().unwrap())
    }

    /// Replaces (or with `None` removes) the value at a path of map keys.
    fn set(mut self, path: &[&'static str], value: Option<M>) -> M {
        let M::Map(kv) = &mut self else {
            panic!("not a map")
        };
        let i = kv.iter().position(|(k, _)| *k == path[0]);
        match (path.len(), i, value) {
            (1, Some(i), None) => {
                kv.remove(i);
            }
            (1, Some(i), Some(v)) => kv[i].1 = v,
            (1, None, Some(v)) => kv.push((path[0], v)),
            (_, Some(i), v) => kv[i].1 = kv[i].1.clone().set(&path[1..], v),
            _ => panic!("no key {}", path[0]),
        }
        self
    }
}

fn uints(v: &[u64]) -> M {
    M::Arr(v.iter().map(|&u| M::U(u)).collect())
}

fn envelope(op: &'static str, body: M) -> M {
    M::Map(vec![
        ("proto", M::S("stowage/1")),
        ("op", M::S(op)),
        ("id", M::U(9)),
        ("body", body),
    ])
}

fn part(frame: u64, offset: u64, len: u64, rows: u64) -> M {
    M::Map(vec![
        ("frame", M::U(frame)),
        ("offset", M::U(offset)),
        ("len", M::U(len)),
        ("rows", M::U(rows)),
    ])
}

/// A valid put by hand: indexes [0, 1], field "x" float32 [2, 2] in one
/// part of frame 1 (16 bytes).
fn hand_put() -> M {
    let x = M::Map(vec![
        ("kind", M::S("regular")),
        ("dtype", M::S("float32")),
        ("shape", uints(&[2, 2])),
        ("parts", M::Arr(vec![part(1, 0, 16, 2)])),
    ]);
    envelope(
        "put",
        M::Map(vec![
            ("global_indexes", uints(&[0, 1])),
            ("fields", M::Map(vec![("x", x)])),
        ]),
    )
}

fn frames_with(env: M, data: &[usize]) -> Vec<Bytes> {
    std::iter::once(env.bytes())
        .chain(data.iter().map(|&n| Bytes::from(vec![0u8; n])))
        .collect()
}

/// Decodes a hand-built put with one 16-byte data frame and returns the error.
fn bad_put(path: &[&'static str], value: Option<M>) -> Error {
    let frames = frames_with(hand_put().set(path, value), &[16]);
    decode(&frames).expect_err("accepted a bad put")
}

const X: [&str; 4] = ["body", "fields", "x", "parts"];

// ------------------------------------------------------------ round trips

#[test]
fn hand_built_put_is_valid() {
    let req = decode(&frames_with(hand_put(), &[16])).unwrap();
    assert_eq!(req.id, 9);
    let Op::Put {
        global_indexes,
        fields,
    } = req.op
    else {
        panic!()
    };
    assert_eq!(global_indexes, vec![0, 1]);
    assert_eq!(fields[0].1.rows(), 2);
}

#[test]
fn every_field_kind_round_trips() {
    let regular = tensor(Dtype::Float32, &[3, 2], 0);
    let nested = vec![
        tensor(Dtype::Int64, &[2], 1),
        tensor(Dtype::Int64, &[0], 2),
        tensor(Dtype::Int64, &[], 3),
    ];
    let values = vec![
        Value::Str("héllo".into()),
        Value::Bytes(Bytes::from_static(b"\x00\xff")),
        Value::Msgpack(Bytes::from_static(&[0x92, 0x01, 0xc0])), // [1, nil]
    ];
    let req = put(
        vec![5, 1, 9],
        vec![
            ("r", Field::Regular(regular)),
            ("n", Field::Nested(nested)),
            ("v", Field::Values(values)),
        ],
    );
    assert_eq!(round_trip(&req), req);
}

#[test]
fn every_dtype_round_trips() {
    for (i, dtype) in Dtype::ALL.into_iter().enumerate() {
        let regular = tensor(dtype, &[2, 3], i as u8);
        let nested = vec![tensor(dtype, &[1, 2], 7), tensor(dtype, &[3], 9)];
        let req = put(
            vec![0, 1],
            vec![("r", Field::Regular(regular)), ("n", Field::Nested(nested))],
        );
        assert_eq!(round_trip(&req), req, "{dtype}");
    }
}

#[test]
fn other_requests_round_trip() {
    let ops = [
        Op::Get {
            global_indexes: vec![3, 3, 1].into(),
            fields: vec!["a".into(), "b".into()],
        },
        Op::Clear {
            global_indexes: vec![],
            fields: None,
        },
        Op::Clear {
            global_indexes: vec![u64::MAX],
            fields: Some(vec!["a".into()]),
        },
        Op::Stats,
        Op::Checkpoint {
            dir: "/var/lib/stowd/ckpt".into(),
            journal: true,
        },
        Op::Checkpoint {
            dir: "/var/lib/stowd/snap".into(),
            journal: false,
        },
        Op::Restore { dir: String::new() },
        Op::Versions {
            global_indexes: vec![9, 10, 11, 12].into(),
            fields: vec!["a".into()],
        },
    ];
    for op in ops {
        let req = Request { id: u64::MAX, op };
        let frames = encode_request(&req).unwrap();
        assert_eq!(frames.len(), 1);
        assert_eq!(decode(&frames).unwrap(), req);
    }
}

#[test]
fn checkpoint_bodies_are_checked() {
    let body = |m: M| frames_with(envelope("checkpoint", m), &[]);
    for (m, want) in [
        (M::Map(vec![]), "dir"),
        (M::Map(vec![("dir", M::U(3))]), "dir"),
        (
            M::Map(vec![("dir", M::S("/a")), ("path", M::S("/b"))]),
            "path",
        ),
        (
            M::Map(vec![("dir", M::S("/a")), ("dir", M::S("/b"))]),
            "dir",
        ),
        (
            M::Map(vec![("dir", M::S("/a")), ("journal", M::U(0))]),
            "journal must be a bool",
        ),
        (
            M::Map(vec![("dir", M::S("/a")), ("journal", M::S("false"))]),
            "journal must be a bool",
        ),
        (M::Map(vec![("journal", M::Raw(vec![0xc2]))]), "dir"),
    ] {
        let e = decode(&body(m)).expect_err("accepted a bad checkpoint body");
        assert_eq!(e.code(), code::BAD_REQUEST);
        assert!(e.to_string().contains(want), "{e}");
    }
    let e = decode(&frames_with(
        envelope("restore", M::Map(vec![("dir", M::S("/a"))])),
        &[4],
    ))
    .expect_err("a restore carries no data frame");
    assert!(matches!(e, Error::UnusedFrame(1)), "{e}");
}

#[test]
fn replies_round_trip() {
    let replies = [
        Reply::PutOk { rows: 3 },
        Reply::ClearOk { cleared: 0 },
        Reply::StatsOk(vec![
            ("units".into(), Stat::Int(2)),
            ("delta".into(), Stat::Int(-5)),
            ("bytes".into(), Stat::Int(i64::MAX)),
            ("load".into(), Stat::Float(0.25)),
            ("policy".into(), Stat::Str("coalesce".into())),
            (
                "plugin.runs".into(),
                Stat::Map(vec![
                    ("version".into(), Stat::Str("0.1.0".into())),
                    ("calls".into(), Stat::Int(7)),
                    ("disabled".into(), Stat::Bool(false)),
                ]),
            ),
            (
                "chain.*".into(),
                Stat::Map(vec![
                    ("select".into(), Stat::strs(&["runs", "gather"])),
                    ("pack".into(), Stat::List(vec![])),
                    ("live".into(), Stat::Bool(true)),
                ]),
            ),
        ]),
        Reply::Error {
            code: code::KEY_NOT_FOUND.into(),
            message: "index 3, field \"a\"".into(),
        },
        Reply::GetOk {
            fields: vec![("v".into(), WireField::Values(vec![Value::Str("x".into())]))],
        },
        Reply::CheckpointOk {
            dir: "/ckpt".into(),
            seq: 7,
            rows: u64::MAX,
            bytes: 0,
            files: 4,
        },
        Reply::RestoreOk {
            dir: "/ckpt".into(),
            seq: 7,
            rows: 10,
            lost: 2,
        },
        Reply::VersionsOk {
            incarnation: u64::MAX,
            versions: vec![0, 1, u64::MAX],
        },
    ];
    for reply in replies {
        let frames = encode_reply(42, &reply).unwrap();
        assert_eq!(
            decode_reply(&frames, &Limits::default()).unwrap(),
            (42, reply)
        );
    }
}

#[test]
fn get_ok_from_cells_round_trips_per_kind() {
    let stored = tensor(Dtype::Bfloat16, &[4, 3], 0);
    let rows: Vec<Cell> = (0..4)
        .map(|i| Cell::Tensor(stored.row_tensor(i).unwrap()))
        .collect();
    let jagged: Vec<Cell> = [2, 5, 0, 1]
        .iter()
        .map(|&n| Cell::Tensor(tensor(Dtype::Uint8, &[n], 1)))
        .collect();
    let values: Vec<Cell> = ["a", "b", "", "d"]
        .iter()
        .map(|s| Cell::Value(Value::Str((*s).into())))
        .collect();
    let fields = vec![
        ("r".to_owned(), WireField::from_cells(rows.clone()).unwrap()),
        (
            "n".to_owned(),
            WireField::from_cells(jagged.clone()).unwrap(),
        ),
        (
            "v".to_owned(),
            WireField::from_cells(values.clone()).unwrap(),
        ),
    ];
    assert_eq!(fields[0].1.kind(), "regular");
    assert_eq!(fields[1].1.kind(), "nested");
    let frames = encode_reply(1, &Reply::GetOk { fields }).unwrap();
    assert_eq!(frames.len(), 1 + 4 + 4, "one frame per tensor row");
    let (_, Reply::GetOk { fields }) = decode_reply(&frames, &Limits::default()).unwrap() else {
        panic!()
    };
    let mut it = fields.into_iter().map(|(_, f)| f);
    let r = it.next().unwrap();
    assert_eq!(r.clone().into_field().unwrap(), Field::Regular(stored));
    assert_eq!(r.into_cells(), rows);
    assert_eq!(it.next().unwrap().into_cells(), jagged);
    assert_eq!(it.next().unwrap().into_cells(), values);
}

#[test]
fn from_cells_refuses_mixtures() {
    let t = Cell::Tensor(tensor(Dtype::Float32, &[2], 0));
    let v = Cell::Value(Value::Str("a".into()));
    let other = Cell::Tensor(tensor(Dtype::Float64, &[2], 0));
    for cells in [
        vec![t.clone(), v.clone()],
        vec![v, t.clone()],
        vec![t, other],
    ] {
        assert_eq!(
            WireField::from_cells(cells).unwrap_err().code(),
            code::UNSUPPORTED
        );
    }
    assert_eq!(
        WireField::from_cells(vec![]).unwrap(),
        WireField::Values(vec![])
    );
}

#[test]
fn multi_part_regular_round_trips() {
    let a = tensor(Dtype::Float32, &[2, 2], 0);
    let b = tensor(Dtype::Float32, &[1, 2], 50);
    let c = tensor(Dtype::Float32, &[3, 2], 100);
    let parts: Vec<_> = [&a, &b, &c]
        .iter()
        .map(|t| (t.buffer().clone(), t.rows()))
        .collect();
    let field = WireField::Regular(RegularParts::new(Dtype::Float32, vec![2], parts).unwrap());
    let req = Request {
        id: 1,
        op: Op::Put {
            global_indexes: (0..6).collect(),
            fields: vec![("x".into(), field)],
        },
    };
    let frames = encode_request(&req).unwrap();
    assert_eq!(frames.len(), 4);
    assert_eq!(
        frames[2].as_ptr(),
        b.buffer().as_ptr(),
        "each part is its own frame, zero copy"
    );
    let back = decode(&frames).unwrap();
    assert_eq!(back, req);
    let Op::Put { fields, .. } = back.op else {
        panic!()
    };
    let WireField::Regular(p) = &fields[0].1 else {
        panic!()
    };
    assert_eq!(p.parts().len(), 3);
    let rows: Vec<Tensor> = p.row_tensors().collect();
    assert_eq!(rows[2], b.row_tensor(0).unwrap());
    assert_eq!(rows[5].buffer().as_ptr(), frames[3][16..].as_ptr());
    let whole = p.to_tensor().unwrap();
    assert_eq!(whole.shape(), &[6, 2]);
    assert_eq!(&whole.buffer()[8..16], &a.buffer()[8..16]);
    assert_eq!(&whole.buffer()[16..24], &b.buffer()[..]);
}

#[test]
fn decoder_merges_adjacent_parts() {
    // Two parts that follow each other in frame 1 become one zero-copy part.
    let parts = M::Arr(vec![part(1, 0, 8, 1), part(1, 8, 8, 1)]);
    let env = hand_put().set(&X, Some(parts));
    let frames = frames_with(env, &[16]);
    let Op::Put { fields, .. } = decode(&frames).unwrap().op else {
        panic!()
    };
    let Field::Regular(t) = fields[0].1.clone().into_field().unwrap() else {
        panic!()
    };
    assert_eq!(t.buffer().as_ptr(), frames[1].as_ptr());
    // Out of order: two parts, rows still in descriptor order.
    let parts = M::Arr(vec![part(1, 8, 8, 1), part(1, 0, 8, 1)]);
    let frames = frames_with(hand_put().set(&X, Some(parts)), &[16]);
    let Op::Put { fields, .. } = decode(&frames).unwrap().op else {
        panic!()
    };
    let WireField::Regular(p) = &fields[0].1 else {
        panic!()
    };
    assert_eq!(p.parts().len(), 2);
    assert_eq!(p.parts()[0].0.as_ptr(), frames[1][8..].as_ptr());
}

#[test]
fn ranges_may_share_a_frame_across_fields() {
    let env = hand_put()
        .set(&X, Some(M::Arr(vec![part(1, 8, 16, 2)])))
        .set(
            &["body", "fields", "n"],
            Some(M::Map(vec![
                ("kind", M::S("nested")),
                ("dtype", M::S("uint8")),
                (
                    "rows",
                    M::Arr(vec![
                        M::Map(vec![
                            ("shape", uints(&[3])),
                            ("frame", M::U(1)),
                            ("offset", M::U(0)),
                            ("len", M::U(3)),
                        ]),
                        M::Map(vec![
                            ("shape", uints(&[])),
                            ("frame", M::U(1)),
                            ("offset", M::U(3)),
                            ("len", M::U(1)),
                        ]),
                    ]),
                ),
            ])),
        );
    let frames = frames_with(env, &[24]);
    let Op::Put { fields, .. } = decode(&frames).unwrap().op else {
        panic!()
    };
    let WireField::Nested(rows) = &fields[1].1 else {
        panic!()
    };
    assert_eq!(rows[1].shape(), &[] as &[u64]);
    assert!(within(rows[0].buffer(), &frames[1]));
}

// -------------------------------------------------------------- zero copy

#[test]
fn decoded_buffers_point_into_the_frames() {
    let req = put(
        vec![0, 1],
        vec![
            ("r", Field::Regular(tensor(Dtype::Float64, &[2, 4], 0))),
            (
                "n",
                Field::Nested(vec![
                    tensor(Dtype::Int32, &[1], 0),
                    tensor(Dtype::Int32, &[2], 0),
                ]),
            ),
            (
                "v",
                Field::Values(vec![
                    Value::Bytes(Bytes::from_static(b"abc")),
                    Value::Str("s".into()),
                ]),
            ),
        ],
    );
    let frames = encode_request(&req).unwrap();
    let Op::Put { fields, .. } = decode(&frames).unwrap().op else {
        panic!()
    };
    let WireField::Regular(p) = &fields[0].1 else {
        panic!()
    };
    let Field::Regular(t) = fields[0].1.clone().into_field().unwrap() else {
        panic!()
    };
    assert_eq!(p.parts()[0].0.as_ptr(), frames[1].as_ptr());
    assert!(within(t.buffer(), &frames[1]));
    let WireField::Nested(rows) = &fields[1].1 else {
        panic!()
    };
    assert!(within(rows[0].buffer(), &frames[2]) && within(rows[1].buffer(), &frames[3]));
    let WireField::Values(values) = &fields[2].1 else {
        panic!()
    };
    let Value::Bytes(b) = &values[0] else {
        panic!()
    };
    assert!(within(b, &frames[0]));
    for cell in fields[0].1.clone().into_cells() {
        let Cell::Tensor(row) = cell else { panic!() };
        assert!(within(row.buffer(), &frames[1]));
    }
}

#[test]
fn encoded_frames_are_the_stored_rows() {
    let stored = tensor(Dtype::Float32, &[3, 2], 0);
    let cells: Vec<Cell> = (0..3)
        .map(|i| Cell::Tensor(stored.row_tensor(i).unwrap()))
        .collect();
    let reply = Reply::GetOk {
        fields: vec![("x".into(), WireField::from_cells(cells).unwrap())],
    };
    let frames = encode_reply(3, &reply).unwrap();
    for i in 0..3 {
        assert_eq!(
            frames[i + 1].as_ptr(),
            stored.row(i as u64).unwrap().as_ptr()
        );
        assert_eq!(frames[i + 1].len(), 8);
    }
    let put_frames = encode_request(&put(
        vec![0, 1, 2],
        vec![("x", Field::Regular(stored.clone()))],
    ))
    .unwrap();
    assert_eq!(put_frames[1].as_ptr(), stored.buffer().as_ptr());
}

#[test]
fn a_packing_layout_coalesces_and_keeps_large_rows_zero_copy() {
    let stored = tensor(Dtype::Int16, &[6, 2], 0);
    let cells: Vec<Cell> = (0..6)
        .map(|i| Cell::Tensor(stored.row_tensor(i).unwrap()))
        .collect();
    let fields = vec![
        (
            "x".to_owned(),
            WireField::from_cells(cells.clone()).unwrap(),
        ),
        (
            "y".to_owned(),
            WireField::from_cells(cells.clone()).unwrap(),
        ),
    ];
    let s = |field, start, end| RowSlice { field, start, end };
    // Frame 1: x rows 0..3 then y rows 0..6; frame 2: x row 3 alone; frame 3: x rows 4..6.
    let layout = FrameLayout {
        frames: vec![
            smallvec::smallvec![s(0, 0, 3), s(1, 0, 6)],
            smallvec::smallvec![s(0, 3, 4)],
            smallvec::smallvec![s(0, 4, 6)],
        ],
    };
    let reply = Reply::GetOk { fields };
    let frames = encode_reply_with(5, &reply, &layout).unwrap();
    assert_eq!(frames.len(), 4);
    assert_eq!(frames[1].len(), 9 * 4);
    assert_eq!(
        frames[2].as_ptr(),
        stored.row(3).unwrap().as_ptr(),
        "a lone row is not copied"
    );
    let (id, Reply::GetOk { fields }) = decode_reply(&frames, &Limits::default()).unwrap() else {
        panic!()
    };
    assert_eq!(id, 5);
    let WireField::Regular(y) = &fields[1].1 else {
        panic!()
    };
    assert_eq!(y.parts().len(), 1, "y's six rows are one range");
    for (_, f) in fields {
        assert_eq!(f.into_field().unwrap(), Field::Regular(stored.clone()));
    }
}

#[test]
fn coalesced_ranges_are_aligned_to_their_itemsize() {
    let bytes3 =
        WireField::from_field(&Field::Nested(vec![tensor(Dtype::Uint8, &[3], 0)])).unwrap();
    let wide =
        WireField::from_field(&Field::Regular(tensor(Dtype::Complex128, &[1, 1], 9))).unwrap();
    let fields = vec![("b".to_owned(), bytes3), ("c".to_owned(), wide)];
    let layout = FrameLayout {
        frames: vec![smallvec::smallvec![
            RowSlice {
                field: 0,
                start: 0,
                end: 1,
            },
            RowSlice {
                field: 1,
                start: 0,
                end: 1,
            },
        ]],
    };
    let frames = encode_reply_with(
        1,
        &Reply::GetOk {
            fields: fields.clone(),
        },
        &layout,
    )
    .unwrap();
    assert_eq!(frames[1].len(), 16 + 16);
    let (_, Reply::GetOk { fields: back }) = decode_reply(&frames, &Limits::default()).unwrap()
    else {
        panic!()
    };
    let WireField::Regular(c) = &back[1].1 else {
        panic!()
    };
    assert_eq!(
        c.parts()[0].0.as_ptr(),
        frames[1][16..].as_ptr(),
        "complex128 range starts at offset 16"
    );
    assert_eq!(back, fields);
}

#[test]
fn invalid_layouts_are_refused() {
    let t = tensor(Dtype::Uint8, &[3, 1], 0);
    let fields = vec![
        (
            "x".to_owned(),
            WireField::from_field(&Field::Regular(t)).unwrap(),
        ),
        (
            "v".to_owned(),
            WireField::Values(vec![Value::Str("a".into()); 3]),
        ),
    ];
    let reply = Reply::GetOk { fields };
    let s = |field, start, end| RowSlice { field, start, end };
    let cases = [
        (vec![vec![s(0, 0, 2)]], "row missing"),
        (vec![vec![s(0, 0, 2)], vec![s(0, 1, 3)]], "row twice"),
        (
            vec![vec![s(0, 0, 3)], vec![s(1, 0, 3)]],
            "values in a frame",
        ),
        (vec![vec![s(0, 0, 3)], vec![s(2, 0, 1)]], "no such field"),
        (vec![vec![s(0, 0, 3)], vec![]], "empty frame"),
        (vec![vec![s(0, 0, 4)]], "rows out of range"),
        (vec![vec![s(0, 2, 2), s(0, 0, 3)]], "empty slice"),
    ];
    for (frames, what) in cases {
        let frames = frames.into_iter().map(FrameSlices::from_vec).collect();
        let err = encode_reply_with(1, &reply, &FrameLayout { frames }).expect_err(what);
        assert!(matches!(err, Error::Layout(_)), "{what}: {err}");
    }
}

#[test]
fn keys_in_any_order_and_any_integer_format() {
    let x = M::Map(vec![
        (
            "parts",
            M::Arr(vec![M::Map(vec![
                ("rows", M::Raw(vec![0xd3, 0, 0, 0, 0, 0, 0, 0, 2])), // int64 2
                ("len", M::Raw(vec![0xcd, 0, 16])),                   // uint16 16
                ("offset", M::Raw(vec![0xcf, 0, 0, 0, 0, 0, 0, 0, 0])), // uint64 0
                ("frame", M::U(1)),
            ])]),
        ),
        ("shape", uints(&[2, 2])),
        ("dtype", M::S("float32")),
        ("kind", M::S("regular")),
    ]);
    let body = M::Map(vec![
        ("fields", M::Map(vec![("x", x)])),
        ("global_indexes", uints(&[1, 0])),
    ]);
    let env = M::Map(vec![
        ("body", body),
        ("id", M::Raw(vec![0xd0, 0x09])),
        ("op", M::S("put")),
        ("proto", M::S(PROTO)),
    ]);
    let frames = frames_with(env, &[16]);
    assert_eq!(request_id(&frames), Some(9));
    let req = decode(&frames).unwrap();
    assert_eq!(decode(&encode_request(&req).unwrap()).unwrap(), req);
}

#[test]
fn decoded_request_re_encodes_to_the_same_bytes() {
    let frames = frames_with(hand_put(), &[16]);
    let again = encode_request(&decode(&frames).unwrap()).unwrap();
    assert_eq!(again[0], frames[0]);
}

// ------------------------------------------------- the page's hex example

/// The example on the protocol page: a put of two rows (indexes 0 and 1),
/// field "x" float32 [2, 2] in frame 1 and field "tag" = ["a", "b"].
#[test]
fn protocol_page_example() {
    let x: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let x = Tensor::contiguous(Bytes::from(x), Dtype::Float32, vec![2, 2]).unwrap();
    let tag = Field::Values(vec![Value::Str("a".into()), Value::Str("b".into())]);
    let mut req = put(vec![0, 1], vec![("x", Field::Regular(x)), ("tag", tag)]);
    req.id = 1;
    let frames = encode_request(&req).unwrap();
    let hex = |b: &[u8]| {
        b.iter()
            .map(|x| format!("{x:02x}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(
        hex(&frames[0]),
        "84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a3 70 75 74 a2 69 64 01 \
         a4 62 6f 64 79 82 ae 67 6c 6f 62 61 6c 5f 69 6e 64 65 78 65 73 92 00 01 a6 66 69 65 6c 64 73 \
         82 a1 78 84 a4 6b 69 6e 64 a7 72 65 67 75 6c 61 72 a5 64 74 79 70 65 a7 66 6c 6f 61 74 33 32 \
         a5 73 68 61 70 65 92 02 02 a5 70 61 72 74 73 91 84 a5 66 72 61 6d 65 01 a6 6f 66 66 73 65 74 00 \
         a3 6c 65 6e 10 a4 72 6f 77 73 02 a3 74 61 67 82 a4 6b 69 6e 64 a6 76 61 6c 75 65 73 \
         a6 76 61 6c 75 65 73 92 a1 61 a1 62"
    );
    assert_eq!(
        hex(&frames[1]),
        "00 00 80 3f 00 00 00 40 00 00 40 40 00 00 80 40"
    );
    assert_eq!(frames.len(), 2);
    let reply = encode_reply(1, &Reply::PutOk { rows: 2 }).unwrap();
    assert_eq!(
        hex(&reply[0]),
        "84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a6 70 75 74 5f 6f 6b a2 69 64 01 \
         a4 62 6f 64 79 81 a4 72 6f 77 73 02"
    );
    // get of indexes [1, 0], field "x"; the stored rows go back one frame each.
    let get = Request {
        id: 2,
        op: Op::Get {
            global_indexes: vec![1, 0].into(),
            fields: vec!["x".into()],
        },
    };
    assert_eq!(
        hex(&encode_request(&get).unwrap()[0]),
        "84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a3 67 65 74 a2 69 64 02 \
         a4 62 6f 64 79 82 ae 67 6c 6f 62 61 6c 5f 69 6e 64 65 78 65 73 92 01 00 a6 66 69 65 6c 64 73 91 a1 78"
    );
    let Op::Put { fields, .. } = decode(&frames).unwrap().op else {
        panic!()
    };
    let cells = fields.into_iter().next().unwrap().1.into_cells();
    let cells = vec![cells[1].clone(), cells[0].clone()];
    let reply = encode_reply(
        2,
        &Reply::GetOk {
            fields: vec![("x".into(), WireField::from_cells(cells).unwrap())],
        },
    );
    let reply = reply.unwrap();
    assert_eq!(
        hex(&reply[0]),
        "84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a6 67 65 74 5f 6f 6b a2 69 64 02 \
         a4 62 6f 64 79 81 a6 66 69 65 6c 64 73 81 a1 78 84 a4 6b 69 6e 64 a7 72 65 67 75 6c 61 72 \
         a5 64 74 79 70 65 a7 66 6c 6f 61 74 33 32 a5 73 68 61 70 65 92 02 02 a5 70 61 72 74 73 92 \
         84 a5 66 72 61 6d 65 01 a6 6f 66 66 73 65 74 00 a3 6c 65 6e 08 a4 72 6f 77 73 01 \
         84 a5 66 72 61 6d 65 02 a6 6f 66 66 73 65 74 00 a3 6c 65 6e 08 a4 72 6f 77 73 01"
    );
    assert_eq!(
        (hex(&reply[1]), hex(&reply[2])),
        (
            "00 00 40 40 00 00 80 40".into(),
            "00 00 80 3f 00 00 00 40".into()
        )
    );
    assert_eq!(
        reply[1].as_ptr(),
        frames[1][8..].as_ptr(),
        "the stored row is the frame that went in"
    );
}

/// A sender that lays out its own data frames (the Python client) writes
/// frame 0 from layouts: the same bytes as the encoder that places the
/// rows itself, for every field kind.
#[test]
fn a_request_head_is_the_bytes_of_the_placing_encoder() {
    let tag = Field::Values(vec![
        Value::Str("a".into()),
        Value::Bytes(Bytes::from_static(b"b")),
    ]);
    let n: Vec<Tensor> = [2u64, 0, 3]
        .iter()
        .map(|&k| tensor(Dtype::Int16, &[k], 9))
        .collect();
    let req = put(
        vec![0, 1, 5],
        vec![
            ("x", Field::Regular(tensor(Dtype::Float32, &[3, 2], 1))),
            ("n", Field::Nested(n.clone())),
            ("tag", {
                let Field::Values(mut v) = tag else { panic!() };
                v.push(Value::Msgpack(Bytes::from_static(&[0x92, 0x01, 0xc0])));
                Field::Values(v)
            }),
        ],
    );
    let frames = encode_request(&req).unwrap();
    let Op::Put {
        global_indexes,
        fields,
    } = &req.op
    else {
        panic!()
    };
    let WireField::Values(values) = &fields[2].1 else {
        panic!()
    };
    // One frame for x, one per nested row, as `one_per_piece` places them.
    let head = RequestHead::Put {
        global_indexes: global_indexes.clone(),
        fields: vec![
            (
                "x".into(),
                FieldLayout::Regular {
                    dtype: Dtype::Float32,
                    shape: smallvec::smallvec![3, 2],
                    parts: smallvec::smallvec![PartLayout {
                        frame: 1,
                        offset: 0,
                        len: 24,
                        rows: 3,
                    }],
                },
            ),
            (
                "n".into(),
                FieldLayout::Nested {
                    dtype: Dtype::Int16,
                    rows: n
                        .iter()
                        .enumerate()
                        .map(|(i, t)| RowLayout {
                            shape: t.shape().to_vec(),
                            frame: i as u64 + 2,
                            offset: 0,
                            len: t.contiguous_bytes().len() as u64,
                        })
                        .collect(),
                },
            ),
            ("tag".into(), FieldLayout::Values(values.clone())),
        ],
    };
    let frame0 = encode_request_head(req.id, &head).unwrap();
    assert_eq!(frame0, frames[0]);
    let mut sent = vec![frame0];
    sent.extend_from_slice(&frames[1..]);
    assert_eq!(decode(&sent).unwrap(), req);
    // A get written as the placing encoder writes it, or as a list.
    let get = Op::Get {
        global_indexes: Indexes::from_list(&(10..30).collect::<Vec<u64>>()),
        fields: vec!["x".into()],
    };
    let same = encode_request(&Request {
        id: 3,
        op: get.clone(),
    })
    .unwrap();
    assert_eq!(
        encode_request_head(3, &RequestHead::Other(get)).unwrap(),
        same[0]
    );
    let list = encode_request_head(
        3,
        &RequestHead::GetList {
            global_indexes: (10..30).collect(),
            fields: vec!["x".into()],
        },
    )
    .unwrap();
    assert!(list.len() > same[0].len(), "twenty indexes as a list");
    // The same two from borrowed names, byte for byte.
    let (ix, names) = (
        Indexes::from_list(&(10..30).collect::<Vec<u64>>()),
        ["x".to_owned()],
    );
    assert_eq!(
        encode_get_head(3, GetIndexes::Runs(&ix), &names).unwrap(),
        same[0]
    );
    let listed: Vec<u64> = (10..30).collect();
    assert_eq!(
        encode_get_head(3, GetIndexes::List(&listed), &names).unwrap(),
        list
    );
    let Op::Get { global_indexes, .. } = decode(&[list]).unwrap().op else {
        panic!()
    };
    assert_eq!(global_indexes.to_vec(), (10..30).collect::<Vec<u64>>());
    // A put with data of its own goes through the placing encoder.
    assert!(matches!(
        encode_request_head(1, &RequestHead::Other(req.op)),
        Err(Error::Layout(_))
    ));
}

mod bad_input;
mod body_at;
mod last_put;
mod ranges;

#[test]
fn a_get_ok_layout_from_frame_0_places_every_row() {
    let stored = tensor(Dtype::Bfloat16, &[4, 3], 0);
    let rows: Vec<Cell> = (0..4)
        .map(|i| Cell::Tensor(stored.row_tensor(i).unwrap()))
        .collect();
    let jagged: Vec<Cell> = [2, 5, 0, 1]
        .iter()
        .map(|&n| Cell::Tensor(tensor(Dtype::Uint8, &[n], 1)))
        .collect();
    let fields = vec![
        ("r".to_owned(), WireField::from_cells(rows).unwrap()),
        (
            "n".to_owned(),
            WireField::from_cells(jagged.clone()).unwrap(),
        ),
        (
            "v".to_owned(),
            WireField::Values(vec![Value::Str("a".into()); 4]),
        ),
    ];
    let frames = encode_reply(7, &Reply::GetOk { fields }).unwrap();
    let (id, ReplyLayout::GetOk(layout)) =
        decode_reply_layout(&frames[0], &Limits::default()).unwrap()
    else {
        panic!("not a get_ok layout")
    };
    assert_eq!(id, 7);
    let lens: Vec<u64> = frames[1..].iter().map(|f| f.len() as u64).collect();
    crate::native::layout::check_frames(&layout, &lens).unwrap();
    // The regular field's parts, read in order, are its rows.
    let FieldLayout::Regular {
        dtype,
        shape,
        parts,
    } = &layout[0].1
    else {
        panic!()
    };
    assert_eq!(
        (*dtype, shape.as_slice()),
        (Dtype::Bfloat16, &[4u64, 3][..])
    );
    let mut got = Vec::new();
    for p in parts {
        let f = &frames[p.frame as usize];
        got.extend_from_slice(&f[p.offset as usize..(p.offset + p.len) as usize]);
    }
    assert_eq!(got, stored.contiguous_bytes().to_vec());
    let FieldLayout::Nested { rows, .. } = &layout[1].1 else {
        panic!()
    };
    for (row, cell) in rows.iter().zip(&jagged) {
        let Cell::Tensor(t) = cell else { panic!() };
        assert_eq!(row.shape, t.shape());
        let f = &frames[row.frame as usize];
        assert_eq!(
            &f[row.offset as usize..(row.offset + row.len) as usize],
            t.contiguous_bytes().as_ref()
        );
    }
    assert_eq!(layout[2].1.rows(), 4);
    // The layout written back as a frame 0 of its own is the same bytes,
    // and reads back the same (a router that forwards rows writes it).
    let head = encode_get_ok_head(7, &layout).unwrap();
    assert_eq!(head, frames[0]);
    let (_, again) = decode_reply_layout(&head, &Limits::default()).unwrap();
    assert_eq!(again, ReplyLayout::GetOk(layout.clone()));
    // Frames that do not match: too short, one missing, one too many.
    let mut short = lens.clone();
    short[0] -= 1;
    assert!(matches!(
        crate::native::layout::check_frames(&layout, &short),
        Err(Error::InField { .. })
    ));
    assert!(crate::native::layout::check_frames(&layout, &lens[..lens.len() - 1]).is_err());
    let mut extra = lens.clone();
    extra.push(3);
    assert!(matches!(
        crate::native::layout::check_frames(&layout, &extra),
        Err(Error::UnusedFrame(_))
    ));
    // Any other reply comes whole.
    let err = encode_reply(
        8,
        &Reply::Error {
            code: code::DATA_LOST.into(),
            message: "m".into(),
        },
    )
    .unwrap();
    assert!(matches!(
        decode_reply_layout(&err[0], &Limits::default()).unwrap(),
        (8, ReplyLayout::Other(Reply::Error { .. }))
    ));
    // A descriptor wrong in itself is refused from frame 0 alone.
    let bad = frames_with(
        envelope(
            "get_ok",
            M::Map(vec![(
                "fields",
                M::Map(vec![(
                    "x",
                    M::Map(vec![
                        ("kind", M::S("regular")),
                        ("dtype", M::S("float32")),
                        ("shape", uints(&[2, 2])),
                        ("parts", M::Arr(vec![part(1, 0, 15, 2)])),
                    ]),
                )]),
            )]),
        ),
        &[],
    );
    assert!(decode_reply_layout(&bad[0], &Limits::default()).is_err());
}

#[test]
fn peer_keys_round_trip_and_are_checked() {
    let req = Request {
        id: 5,
        op: Op::Get {
            global_indexes: vec![1, 2].into(),
            fields: vec!["a".into()],
        },
    };
    let mut frames = encode_request(&req).unwrap();
    let extras = Extras {
        unit: Some(3),
        with_versions: true,
        channel: Some("tok".into()),
        ..Extras::default()
    };
    frames[0] = with_extras(&frames[0], &extras).unwrap();
    assert_eq!(decode(&frames).unwrap(), req, "the request is unchanged");
    assert_eq!(
        decode_extras(&frames[0], &Limits::default()).unwrap(),
        extras
    );

    let reply = encode_reply(
        5,
        &Reply::GetOk {
            fields: vec![(
                "a".into(),
                WireField::Values(vec![Value::Str("x".into()); 2]),
            )],
        },
    )
    .unwrap();
    let frame0 = with_versions(&reply[0], 77, &[4, 0]).unwrap();
    let got = decode_extras(&frame0, &Limits::default()).unwrap();
    assert_eq!(got.versions, Some((77, vec![4, 0])));
    assert!(decode_reply(&[frame0], &Limits::default()).is_ok());

    // A versions bin that is not whole u64s, or a unit that is not a count.
    let bad = |key: &'static str, value: M| {
        let mut env = envelope("get", M::Map(vec![]));
        if let M::Map(entries) = &mut env {
            entries.push((key, value));
        }
        let frames = frames_with(env, &[]);
        decode_extras(&frames[0], &Limits::default()).expect_err("accepted a bad peer key")
    };
    let bin7: Vec<u8> = [0xc4, 7].into_iter().chain([0; 7]).collect();
    assert!(
        bad("versions", M::Raw(bin7))
            .to_string()
            .contains("8 bytes")
    );
    assert!(bad("unit", M::S("0")).to_string().contains("unit"));
    assert!(bad("with_versions", M::U(1)).to_string().contains("bool"));
    // More versions than rows times fields a request may name.
    let limits = Limits {
        max_rows: 2,
        max_fields: 1,
        ..Limits::default()
    };
    let frame0 = with_versions(&reply[0], 1, &[1, 2, 3]).unwrap();
    let e = decode_extras(&frame0, &limits).expect_err("too many versions");
    assert_eq!(e.code(), code::TOO_LARGE, "{e}");
}

#[test]
fn gathered_frames_are_the_copied_frames_unjoined() {
    // Rows of one field from two buffers, interleaved: each frame of the
    // layout names rows that do not lie back to back.
    let a = tensor(Dtype::Float32, &[4, 3], 1);
    let b = tensor(Dtype::Float32, &[4, 3], 60);
    let rows: Vec<(Bytes, u64)> = (0..8)
        .map(|i| {
            let t = if i % 2 == 0 { &a } else { &b };
            (t.row_tensor(i / 2).unwrap().contiguous_bytes(), 1)
        })
        .collect();
    let field = WireField::Regular(RegularParts::new(Dtype::Float32, vec![3], rows).unwrap());
    // 46 bytes of int16 rows: the float32 rows after them are padded.
    let nested = WireField::Nested(
        (0..8u8)
            .map(|i| tensor(Dtype::Int16, &[if i == 7 { 2 } else { 3 }], i))
            .collect(),
    );
    let reply = Reply::GetOk {
        fields: vec![("x".into(), field), ("n".into(), nested)],
    };
    let slice = |field, start, end| RowSlice { field, start, end };
    let layout = FrameLayout {
        frames: vec![
            smallvec::smallvec![slice(0, 0, 5)],
            smallvec::smallvec![slice(1, 0, 8), slice(0, 5, 8)],
        ],
    };
    let copied = encode_reply_with(7, &reply, &layout).unwrap();
    let gathered = encode_reply_gathered(7, &reply, &layout, &|_, _| None).unwrap();
    let per_frame = gathered.per_frame.clone().expect("frames of several parts");
    assert_eq!(per_frame.len(), copied.len());
    assert!(per_frame[1] > 1, "{per_frame:?}");
    assert_eq!(gathered.joined(), copied);
    // No part is a copy: every row part points into a or b.
    for part in &gathered.parts[1..] {
        if part.len() == 12 {
            assert!(within(part, a.buffer()) || within(part, b.buffer()));
        }
    }
    assert_eq!(
        decode_reply(&gathered.joined(), &Limits::default()).unwrap(),
        decode_reply(&copied, &Limits::default()).unwrap()
    );
    let request = Request {
        id: 3,
        op: Op::Put {
            global_indexes: (0..8).collect(),
            fields: match &reply {
                Reply::GetOk { fields } => vec![(fields[0].0.as_str().into(), fields[0].1.clone())],
                _ => unreachable!(),
            },
        },
    };
    let layout = FrameLayout {
        frames: vec![smallvec::smallvec![slice(0, 0, 8)]],
    };
    let gathered = encode_request_gathered(&request, &layout).unwrap();
    assert_eq!(
        gathered.joined(),
        encode_request_with(&request, &layout).unwrap()
    );
    let Op::Put { fields, .. } = decode(&gathered.joined()).unwrap().op else {
        panic!("a put")
    };
    let Op::Put { fields: sent, .. } = request.op else {
        unreachable!()
    };
    assert_eq!(
        fields[0].1.clone().into_cells(),
        sent[0].1.clone().into_cells()
    );
}

/// A regular field: name, dtype, shape, and the first byte of its rows.
type RegularSpec<'a> = (&'a str, Dtype, &'a [u64], u8);

/// A get_ok of regular fields as stowd writes it, request id `id`.
fn regular_get_ok(id: u64, fields: &[RegularSpec<'_>]) -> Vec<Bytes> {
    let fields = fields
        .iter()
        .map(|&(name, dtype, shape, seed)| {
            let t = tensor(dtype, shape, seed);
            let rows: Vec<Cell> = (0..shape[0])
                .map(|i| Cell::Tensor(t.row_tensor(i).unwrap()))
                .collect();
            (name.to_owned(), WireField::from_cells(rows).unwrap())
        })
        .collect();
    encode_reply(id, &Reply::GetOk { fields }).unwrap()
}

#[test]
fn a_get_ok_layout_from_the_memo_is_the_layout_read_afresh() {
    let limits = Limits::default();
    let mut memo = LayoutMemo::default();
    let fresh = |f0: &Bytes| decode_reply_layout(f0, &limits).unwrap();
    let shape: &[RegularSpec<'_>] = &[
        ("a", Dtype::Float32, &[4, 16], 0),
        ("b", Dtype::Int64, &[4], 9),
    ];
    // The first is read and kept; the next of the same shape (another id,
    // other bytes in the rows) comes from the memo, and is what a fresh
    // read gives, its own id included.
    let first = regular_get_ok(1, shape);
    assert_eq!(
        decode_reply_layout_memo(&first[0], &limits, &mut memo).unwrap(),
        fresh(&first[0])
    );
    assert_eq!(memo.hits(), 0);
    let second = regular_get_ok(2, &[shape[0], ("b", Dtype::Int64, &[4], 77)]);
    let got = decode_reply_layout_memo(&second[0], &limits, &mut memo).unwrap();
    assert_eq!(memo.hits(), 1);
    assert_eq!(got, fresh(&second[0]));
    assert_eq!(got.0, 2);
    // A body that differs anywhere is read afresh: a dtype, a shape, a
    // name, a field more or fewer.
    let others: [&[RegularSpec<'_>]; 5] = [
        &[shape[0], ("b", Dtype::Uint64, &[4], 9)],
        &[shape[0], ("b", Dtype::Int64, &[4, 2], 9)],
        &[shape[0], ("c", Dtype::Int64, &[4], 9)],
        &[shape[0]],
        &[shape[0], shape[1], ("c", Dtype::Int8, &[4, 2], 1)],
    ];
    for (k, other) in others.into_iter().enumerate() {
        let f = regular_get_ok(10 + k as u64, other);
        let hits = memo.hits();
        let got = decode_reply_layout_memo(&f[0], &limits, &mut memo).unwrap();
        assert_eq!(memo.hits(), hits, "case {k}");
        assert_eq!(got, fresh(&f[0]), "case {k}");
        // ... and kept: the same again comes from the memo.
        let again = decode_reply_layout_memo(&f[0], &limits, &mut memo).unwrap();
        assert_eq!((memo.hits(), &again), (hits + 1, &got), "case {k}");
    }
    // Other limits: read afresh, under those limits (one field too many).
    let f = regular_get_ok(20, shape);
    decode_reply_layout_memo(&f[0], &limits, &mut memo).unwrap();
    let tight = Limits {
        max_fields: 1,
        ..limits
    };
    let hits = memo.hits();
    assert!(decode_reply_layout_memo(&f[0], &tight, &mut memo).is_err());
    assert_eq!(memo.hits(), hits);
    // A body with a nested field or values is not kept (its rows' shapes
    // and values change from one get to the next).
    let nested: Vec<Cell> = [2u64, 5]
        .iter()
        .map(|&n| Cell::Tensor(tensor(Dtype::Uint8, &[n], 1)))
        .collect();
    for field in [
        WireField::from_cells(nested).unwrap(),
        WireField::Values(vec![Value::Str("x".into()); 2]),
    ] {
        let f = encode_reply(
            30,
            &Reply::GetOk {
                fields: vec![("n".to_owned(), field)],
            },
        )
        .unwrap();
        for _ in 0..2 {
            let got = decode_reply_layout_memo(&f[0], &limits, &mut memo).unwrap();
            assert_eq!(got, fresh(&f[0]));
        }
        assert_eq!(memo.hits(), hits);
    }
    // Neither is a body over the most kept.
    let long = "l".repeat(LayoutMemo::MAX_BODY);
    let f = regular_get_ok(40, &[(&long, Dtype::Uint8, &[1], 0)]);
    for _ in 0..2 {
        assert_eq!(
            decode_reply_layout_memo(&f[0], &limits, &mut memo).unwrap(),
            fresh(&f[0])
        );
    }
    assert_eq!(memo.hits(), hits);
    // A reply that is not a get_ok leaves the memo as it was; a malformed
    // body is refused as a fresh read refuses it, and kept nothing.
    let f = regular_get_ok(50, shape);
    decode_reply_layout_memo(&f[0], &limits, &mut memo).unwrap();
    let err = encode_reply(
        51,
        &Reply::Error {
            code: "bad_request".into(),
            message: "no".into(),
        },
    )
    .unwrap();
    assert!(matches!(
        decode_reply_layout_memo(&err[0], &limits, &mut memo)
            .unwrap()
            .1,
        ReplyLayout::Other(Reply::Error { .. })
    ));
    let mut cut = f[0].to_vec();
    cut.truncate(cut.len() - 3);
    let cut = Bytes::from(cut);
    assert_eq!(
        decode_reply_layout_memo(&cut, &limits, &mut memo)
            .unwrap_err()
            .to_string(),
        decode_reply_layout(&cut, &limits).unwrap_err().to_string()
    );
    decode_reply_layout_memo(&f[0], &limits, &mut memo).unwrap();
    assert_eq!(memo.hits(), hits + 1);
}
