//! Round trips, zero-copy checks, and one test per kind of bad input.

use bytes::Bytes;

use crate::msgpack::Writer;
use super::*;
use crate::batch::{Cell, Field, Value};
use crate::tensor::{DType, Tensor};

// ---------------------------------------------------------------- helpers

/// A tensor of `shape` whose bytes count up from `seed`.
fn tensor(dtype: DType, shape: &[u64], seed: u8) -> Tensor {
    let len = crate::tensor::contiguous_len(dtype, shape).unwrap();
    let data: Vec<u8> = (0..len).map(|i| seed.wrapping_add(i as u8)).collect();
    Tensor::contiguous(Bytes::from(data), dtype, shape.to_vec()).unwrap()
}

fn within(inner: &[u8], outer: &[u8]) -> bool {
    let (i, o) = (inner.as_ptr() as usize, outer.as_ptr() as usize);
    i >= o && i + inner.len() <= o + outer.len()
}

fn put(global_indexes: Vec<u64>, fields: Vec<(&str, Field)>) -> Request {
    let fields = fields.into_iter().map(|(n, f)| (n.to_owned(), WireField::from_field(&f).unwrap())).collect();
    Request { id: 7, op: Op::Put { global_indexes, fields } }
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
        let M::Map(kv) = &mut self else { panic!("not a map") };
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
    M::Map(vec![("proto", M::S("stowage/1")), ("op", M::S(op)), ("id", M::U(9)), ("body", body)])
}

fn part(frame: u64, offset: u64, len: u64, rows: u64) -> M {
    M::Map(vec![("frame", M::U(frame)), ("offset", M::U(offset)), ("len", M::U(len)), ("rows", M::U(rows))])
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
    envelope("put", M::Map(vec![("global_indexes", uints(&[0, 1])), ("fields", M::Map(vec![("x", x)]))]))
}

fn frames_with(env: M, data: &[usize]) -> Vec<Bytes> {
    std::iter::once(env.bytes()).chain(data.iter().map(|&n| Bytes::from(vec![0u8; n]))).collect()
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
    let Op::Put { global_indexes, fields } = req.op else { panic!() };
    assert_eq!(global_indexes, vec![0, 1]);
    assert_eq!(fields[0].1.rows(), 2);
}

#[test]
fn every_field_kind_round_trips() {
    let regular = tensor(DType::F32, &[3, 2], 0);
    let nested = vec![tensor(DType::I64, &[2], 1), tensor(DType::I64, &[0], 2), tensor(DType::I64, &[], 3)];
    let values = vec![
        Value::Str("héllo".into()),
        Value::Bytes(Bytes::from_static(b"\x00\xff")),
        Value::Msgpack(Bytes::from_static(&[0x92, 0x01, 0xc0])), // [1, nil]
    ];
    let req = put(
        vec![5, 1, 9],
        vec![("r", Field::Regular(regular)), ("n", Field::Nested(nested)), ("v", Field::Values(values))],
    );
    assert_eq!(round_trip(&req), req);
}

#[test]
fn every_dtype_round_trips() {
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let regular = tensor(dtype, &[2, 3], i as u8);
        let nested = vec![tensor(dtype, &[1, 2], 7), tensor(dtype, &[3], 9)];
        let req = put(vec![0, 1], vec![("r", Field::Regular(regular)), ("n", Field::Nested(nested))]);
        assert_eq!(round_trip(&req), req, "{dtype}");
    }
}

#[test]
fn other_requests_round_trip() {
    let ops = [
        Op::Get { global_indexes: vec![3, 3, 1], fields: vec!["a".into(), "b".into()] },
        Op::Clear { global_indexes: vec![], fields: None },
        Op::Clear { global_indexes: vec![u64::MAX], fields: Some(vec!["a".into()]) },
        Op::Stats,
    ];
    for op in ops {
        let req = Request { id: u64::MAX, op };
        let frames = encode_request(&req).unwrap();
        assert_eq!(frames.len(), 1);
        assert_eq!(decode(&frames).unwrap(), req);
    }
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
        ]),
        Reply::Error { code: code::KEY_NOT_FOUND.into(), message: "index 3, field \"a\"".into() },
        Reply::GetOk { fields: vec![("v".into(), WireField::Values(vec![Value::Str("x".into())]))] },
    ];
    for reply in replies {
        let frames = encode_reply(42, &reply).unwrap();
        assert_eq!(decode_reply(&frames, &Limits::default()).unwrap(), (42, reply));
    }
}

#[test]
fn get_ok_from_cells_round_trips_per_kind() {
    let stored = tensor(DType::BF16, &[4, 3], 0);
    let rows: Vec<Cell> = (0..4).map(|i| Cell::Tensor(stored.row_tensor(i).unwrap())).collect();
    let jagged: Vec<Cell> = [2, 5, 0, 1].iter().map(|&n| Cell::Tensor(tensor(DType::U8, &[n], 1))).collect();
    let values: Vec<Cell> = ["a", "b", "", "d"].iter().map(|s| Cell::Value(Value::Str((*s).into()))).collect();
    let fields = vec![
        ("r".to_owned(), WireField::from_cells(rows.clone()).unwrap()),
        ("n".to_owned(), WireField::from_cells(jagged.clone()).unwrap()),
        ("v".to_owned(), WireField::from_cells(values.clone()).unwrap()),
    ];
    assert_eq!(fields[0].1.kind(), "regular");
    assert_eq!(fields[1].1.kind(), "nested");
    let frames = encode_reply(1, &Reply::GetOk { fields }).unwrap();
    assert_eq!(frames.len(), 1 + 4 + 4, "one frame per tensor row");
    let (_, Reply::GetOk { fields }) = decode_reply(&frames, &Limits::default()).unwrap() else { panic!() };
    let mut it = fields.into_iter().map(|(_, f)| f);
    let r = it.next().unwrap();
    assert_eq!(r.clone().into_field().unwrap(), Field::Regular(stored));
    assert_eq!(r.into_cells(), rows);
    assert_eq!(it.next().unwrap().into_cells(), jagged);
    assert_eq!(it.next().unwrap().into_cells(), values);
}

#[test]
fn from_cells_refuses_mixtures() {
    let t = Cell::Tensor(tensor(DType::F32, &[2], 0));
    let v = Cell::Value(Value::Str("a".into()));
    let other = Cell::Tensor(tensor(DType::F64, &[2], 0));
    for cells in [vec![t.clone(), v.clone()], vec![v, t.clone()], vec![t, other]] {
        assert_eq!(WireField::from_cells(cells).unwrap_err().code(), code::UNSUPPORTED);
    }
    assert_eq!(WireField::from_cells(vec![]).unwrap(), WireField::Values(vec![]));
}

#[test]
fn multi_part_regular_round_trips() {
    let a = tensor(DType::F32, &[2, 2], 0);
    let b = tensor(DType::F32, &[1, 2], 50);
    let c = tensor(DType::F32, &[3, 2], 100);
    let parts = [&a, &b, &c].iter().map(|t| (t.buffer().clone(), t.rows())).collect();
    let field = WireField::Regular(RegularParts::new(DType::F32, vec![2], parts).unwrap());
    let req = Request { id: 1, op: Op::Put { global_indexes: (0..6).collect(), fields: vec![("x".into(), field)] } };
    let frames = encode_request(&req).unwrap();
    assert_eq!(frames.len(), 4);
    assert_eq!(frames[2].as_ptr(), b.buffer().as_ptr(), "each part is its own frame, zero copy");
    let back = decode(&frames).unwrap();
    assert_eq!(back, req);
    let Op::Put { fields, .. } = back.op else { panic!() };
    let WireField::Regular(p) = &fields[0].1 else { panic!() };
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
    let Op::Put { fields, .. } = decode(&frames).unwrap().op else { panic!() };
    let Field::Regular(t) = fields[0].1.clone().into_field().unwrap() else { panic!() };
    assert_eq!(t.buffer().as_ptr(), frames[1].as_ptr());
    // Out of order: two parts, rows still in descriptor order.
    let parts = M::Arr(vec![part(1, 8, 8, 1), part(1, 0, 8, 1)]);
    let frames = frames_with(hand_put().set(&X, Some(parts)), &[16]);
    let Op::Put { fields, .. } = decode(&frames).unwrap().op else { panic!() };
    let WireField::Regular(p) = &fields[0].1 else { panic!() };
    assert_eq!(p.parts().len(), 2);
    assert_eq!(p.parts()[0].0.as_ptr(), frames[1][8..].as_ptr());
}

#[test]
fn ranges_may_share_a_frame_across_fields() {
    let env = hand_put().set(&X, Some(M::Arr(vec![part(1, 8, 16, 2)]))).set(
        &["body", "fields", "n"],
        Some(M::Map(vec![
            ("kind", M::S("nested")),
            ("dtype", M::S("uint8")),
            (
                "rows",
                M::Arr(vec![
                    M::Map(vec![("shape", uints(&[3])), ("frame", M::U(1)), ("offset", M::U(0)), ("len", M::U(3))]),
                    M::Map(vec![("shape", uints(&[])), ("frame", M::U(1)), ("offset", M::U(3)), ("len", M::U(1))]),
                ]),
            ),
        ])),
    );
    let frames = frames_with(env, &[24]);
    let Op::Put { fields, .. } = decode(&frames).unwrap().op else { panic!() };
    let WireField::Nested(rows) = &fields[1].1 else { panic!() };
    assert_eq!(rows[1].shape(), &[] as &[u64]);
    assert!(within(rows[0].buffer(), &frames[1]));
}

// -------------------------------------------------------------- zero copy

#[test]
fn decoded_buffers_point_into_the_frames() {
    let req = put(
        vec![0, 1],
        vec![
            ("r", Field::Regular(tensor(DType::F64, &[2, 4], 0))),
            ("n", Field::Nested(vec![tensor(DType::I32, &[1], 0), tensor(DType::I32, &[2], 0)])),
            ("v", Field::Values(vec![Value::Bytes(Bytes::from_static(b"abc")), Value::Str("s".into())])),
        ],
    );
    let frames = encode_request(&req).unwrap();
    let Op::Put { fields, .. } = decode(&frames).unwrap().op else { panic!() };
    let WireField::Regular(p) = &fields[0].1 else { panic!() };
    let Field::Regular(t) = fields[0].1.clone().into_field().unwrap() else { panic!() };
    assert_eq!(p.parts()[0].0.as_ptr(), frames[1].as_ptr());
    assert!(within(t.buffer(), &frames[1]));
    let WireField::Nested(rows) = &fields[1].1 else { panic!() };
    assert!(within(rows[0].buffer(), &frames[2]) && within(rows[1].buffer(), &frames[3]));
    let WireField::Values(values) = &fields[2].1 else { panic!() };
    let Value::Bytes(b) = &values[0] else { panic!() };
    assert!(within(b, &frames[0]));
    for cell in fields[0].1.clone().into_cells() {
        let Cell::Tensor(row) = cell else { panic!() };
        assert!(within(row.buffer(), &frames[1]));
    }
}

#[test]
fn encoded_frames_are_the_stored_rows() {
    let stored = tensor(DType::F32, &[3, 2], 0);
    let cells: Vec<Cell> = (0..3).map(|i| Cell::Tensor(stored.row_tensor(i).unwrap())).collect();
    let reply = Reply::GetOk { fields: vec![("x".into(), WireField::from_cells(cells).unwrap())] };
    let frames = encode_reply(3, &reply).unwrap();
    for i in 0..3 {
        assert_eq!(frames[i + 1].as_ptr(), stored.row(i as u64).unwrap().as_ptr());
        assert_eq!(frames[i + 1].len(), 8);
    }
    let put_frames = encode_request(&put(vec![0, 1, 2], vec![("x", Field::Regular(stored.clone()))])).unwrap();
    assert_eq!(put_frames[1].as_ptr(), stored.buffer().as_ptr());
}

#[test]
fn a_packing_layout_coalesces_and_keeps_large_rows_zero_copy() {
    let stored = tensor(DType::I16, &[6, 2], 0);
    let cells: Vec<Cell> = (0..6).map(|i| Cell::Tensor(stored.row_tensor(i).unwrap())).collect();
    let fields = vec![
        ("x".to_owned(), WireField::from_cells(cells.clone()).unwrap()),
        ("y".to_owned(), WireField::from_cells(cells.clone()).unwrap()),
    ];
    let s = |field, start, end| RowSlice { field, start, end };
    // Frame 1: x rows 0..3 then y rows 0..6; frame 2: x row 3 alone; frame 3: x rows 4..6.
    let layout = FrameLayout { frames: vec![vec![s(0, 0, 3), s(1, 0, 6)], vec![s(0, 3, 4)], vec![s(0, 4, 6)]] };
    let reply = Reply::GetOk { fields };
    let frames = encode_reply_with(5, &reply, &layout).unwrap();
    assert_eq!(frames.len(), 4);
    assert_eq!(frames[1].len(), 9 * 4);
    assert_eq!(frames[2].as_ptr(), stored.row(3).unwrap().as_ptr(), "a lone row is not copied");
    let (id, Reply::GetOk { fields }) = decode_reply(&frames, &Limits::default()).unwrap() else { panic!() };
    assert_eq!(id, 5);
    let WireField::Regular(y) = &fields[1].1 else { panic!() };
    assert_eq!(y.parts().len(), 1, "y's six rows are one range");
    for (_, f) in fields {
        assert_eq!(f.into_field().unwrap(), Field::Regular(stored.clone()));
    }
}

#[test]
fn coalesced_ranges_are_aligned_to_their_itemsize() {
    let bytes3 = WireField::from_field(&Field::Nested(vec![tensor(DType::U8, &[3], 0)])).unwrap();
    let wide = WireField::from_field(&Field::Regular(tensor(DType::Complex128, &[1, 1], 9))).unwrap();
    let fields = vec![("b".to_owned(), bytes3), ("c".to_owned(), wide)];
    let layout = FrameLayout {
        frames: vec![vec![RowSlice { field: 0, start: 0, end: 1 }, RowSlice { field: 1, start: 0, end: 1 }]],
    };
    let frames = encode_reply_with(1, &Reply::GetOk { fields: fields.clone() }, &layout).unwrap();
    assert_eq!(frames[1].len(), 16 + 16);
    let (_, Reply::GetOk { fields: back }) = decode_reply(&frames, &Limits::default()).unwrap() else { panic!() };
    let WireField::Regular(c) = &back[1].1 else { panic!() };
    assert_eq!(c.parts()[0].0.as_ptr(), frames[1][16..].as_ptr(), "complex128 range starts at offset 16");
    assert_eq!(back, fields);
}

#[test]
fn invalid_layouts_are_refused() {
    let t = tensor(DType::U8, &[3, 1], 0);
    let fields = vec![
        ("x".to_owned(), WireField::from_field(&Field::Regular(t)).unwrap()),
        ("v".to_owned(), WireField::Values(vec![Value::Str("a".into()); 3])),
    ];
    let reply = Reply::GetOk { fields };
    let s = |field, start, end| RowSlice { field, start, end };
    let cases = [
        (vec![vec![s(0, 0, 2)]], "row missing"),
        (vec![vec![s(0, 0, 2)], vec![s(0, 1, 3)]], "row twice"),
        (vec![vec![s(0, 0, 3)], vec![s(1, 0, 3)]], "values in a frame"),
        (vec![vec![s(0, 0, 3)], vec![s(2, 0, 1)]], "no such field"),
        (vec![vec![s(0, 0, 3)], vec![]], "empty frame"),
        (vec![vec![s(0, 0, 4)]], "rows out of range"),
        (vec![vec![s(0, 2, 2), s(0, 0, 3)]], "empty slice"),
    ];
    for (frames, what) in cases {
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
                ("rows", M::Raw(vec![0xd3, 0, 0, 0, 0, 0, 0, 0, 2])),   // int64 2
                ("len", M::Raw(vec![0xcd, 0, 16])),                     // uint16 16
                ("offset", M::Raw(vec![0xcf, 0, 0, 0, 0, 0, 0, 0, 0])), // uint64 0
                ("frame", M::U(1)),
            ])]),
        ),
        ("shape", uints(&[2, 2])),
        ("dtype", M::S("float32")),
        ("kind", M::S("regular")),
    ]);
    let body = M::Map(vec![("fields", M::Map(vec![("x", x)])), ("global_indexes", uints(&[1, 0]))]);
    let env =
        M::Map(vec![("body", body), ("id", M::Raw(vec![0xd0, 0x09])), ("op", M::S("put")), ("proto", M::S(PROTO))]);
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
    let x: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let x = Tensor::contiguous(Bytes::from(x), DType::F32, vec![2, 2]).unwrap();
    let tag = Field::Values(vec![Value::Str("a".into()), Value::Str("b".into())]);
    let mut req = put(vec![0, 1], vec![("x", Field::Regular(x)), ("tag", tag)]);
    req.id = 1;
    let frames = encode_request(&req).unwrap();
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>().join(" ");
    assert_eq!(
        hex(&frames[0]),
        "84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a3 70 75 74 a2 69 64 01 \
         a4 62 6f 64 79 82 ae 67 6c 6f 62 61 6c 5f 69 6e 64 65 78 65 73 92 00 01 a6 66 69 65 6c 64 73 \
         82 a1 78 84 a4 6b 69 6e 64 a7 72 65 67 75 6c 61 72 a5 64 74 79 70 65 a7 66 6c 6f 61 74 33 32 \
         a5 73 68 61 70 65 92 02 02 a5 70 61 72 74 73 91 84 a5 66 72 61 6d 65 01 a6 6f 66 66 73 65 74 00 \
         a3 6c 65 6e 10 a4 72 6f 77 73 02 a3 74 61 67 82 a4 6b 69 6e 64 a6 76 61 6c 75 65 73 \
         a6 76 61 6c 75 65 73 92 a1 61 a1 62"
    );
    assert_eq!(hex(&frames[1]), "00 00 80 3f 00 00 00 40 00 00 40 40 00 00 80 40");
    assert_eq!(frames.len(), 2);
    let reply = encode_reply(1, &Reply::PutOk { rows: 2 }).unwrap();
    assert_eq!(
        hex(&reply[0]),
        "84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a6 70 75 74 5f 6f 6b a2 69 64 01 \
         a4 62 6f 64 79 81 a4 72 6f 77 73 02"
    );
    // get of indexes [1, 0], field "x"; the stored rows go back one frame each.
    let get = Request { id: 2, op: Op::Get { global_indexes: vec![1, 0], fields: vec!["x".into()] } };
    assert_eq!(
        hex(&encode_request(&get).unwrap()[0]),
        "84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a3 67 65 74 a2 69 64 02 \
         a4 62 6f 64 79 82 ae 67 6c 6f 62 61 6c 5f 69 6e 64 65 78 65 73 92 01 00 a6 66 69 65 6c 64 73 91 a1 78"
    );
    let Op::Put { fields, .. } = decode(&frames).unwrap().op else { panic!() };
    let cells = fields.into_iter().next().unwrap().1.into_cells();
    let cells = vec![cells[1].clone(), cells[0].clone()];
    let reply = encode_reply(2, &Reply::GetOk { fields: vec![("x".into(), WireField::from_cells(cells).unwrap())] });
    let reply = reply.unwrap();
    assert_eq!(
        hex(&reply[0]),
        "84 a5 70 72 6f 74 6f a9 73 74 6f 77 61 67 65 2f 31 a2 6f 70 a6 67 65 74 5f 6f 6b a2 69 64 02 \
         a4 62 6f 64 79 81 a6 66 69 65 6c 64 73 81 a1 78 84 a4 6b 69 6e 64 a7 72 65 67 75 6c 61 72 \
         a5 64 74 79 70 65 a7 66 6c 6f 61 74 33 32 a5 73 68 61 70 65 92 02 02 a5 70 61 72 74 73 92 \
         84 a5 66 72 61 6d 65 01 a6 6f 66 66 73 65 74 00 a3 6c 65 6e 08 a4 72 6f 77 73 01 \
         84 a5 66 72 61 6d 65 02 a6 6f 66 66 73 65 74 00 a3 6c 65 6e 08 a4 72 6f 77 73 01"
    );
    assert_eq!((hex(&reply[1]), hex(&reply[2])), ("00 00 40 40 00 00 80 40".into(), "00 00 80 3f 00 00 00 40".into()));
    assert_eq!(reply[1].as_ptr(), frames[1][8..].as_ptr(), "the stored row is the frame that went in");
}

// ---------------------------------------------------------- bad input

#[test]
fn malformed_msgpack_is_bad_request() {
    let good = hand_put().bytes();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (good[..good.len() - 1].to_vec(), "truncated"),
        ([&good[..], &[0x00]].concat(), "trailing bytes"),
        (vec![0xc1], "reserved marker"),
        (vec![], "empty frame 0"),
        (vec![0x93, 0x01, 0x02, 0x03], "not a map"),
        (vec![0xdd, 0xff, 0xff, 0xff, 0xff], "array of 2^32-1 items in 5 bytes"),
        (vec![0xdf, 0x7f, 0xff, 0xff, 0xff, 0xa1], "map of 2^31-1 entries"),
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
    assert!(matches!(err, Error::Malformed { reason: "invalid UTF-8 in a str", .. }), "{err}");
    let deep = M::Raw([vec![0x91; 100], vec![0xc0]].concat());
    let values = M::Map(vec![("kind", M::S("values")), ("values", M::Arr(vec![deep.clone(), deep]))]);
    let err = bad_put(&["body", "fields", "x"], Some(values));
    assert!(matches!(err.root(), Error::Malformed { reason: "nesting too deep", .. }), "{err}");
}

#[test]
fn missing_keys_are_refused() {
    for path in
        [&["id"][..], &["body"], &["body", "global_indexes"], &["body", "fields"], &["body", "fields", "x", "kind"]]
    {
        let err = bad_put(path, None);
        assert!(matches!(err.root(), Error::MissingKey { .. }), "{path:?}: {err}");
        assert_eq!(err.code(), code::BAD_REQUEST);
    }
    let parts = M::Arr(vec![M::Map(vec![("frame", M::U(1)), ("offset", M::U(0)), ("rows", M::U(2))])]);
    assert!(matches!(bad_put(&X, Some(parts)).root(), Error::MissingKey { key: "len", .. }));
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
    let M::Map(mut kv) = hand_put() else { unreachable!() };
    kv.push(("id", M::U(3)));
    let err = decode(&frames_with(M::Map(kv), &[16])).unwrap_err();
    assert!(matches!(err, Error::DuplicateKey { .. }), "{err}");
}

#[test]
fn wrong_types_are_refused() {
    let cases = [
        (&["id"][..], M::S("1")),
        (&["id"], M::I(-1)),
        (&["body", "global_indexes"], M::Map(vec![])),
        (&["body", "global_indexes"], M::Arr(vec![M::I(-3)])),
        (&["body", "fields"], M::Arr(vec![])),
        (&["body", "fields", "x", "shape"], M::Arr(vec![M::S("2"), M::U(2)])),
        (&["body", "fields", "x", "dtype"], M::U(4)),
        (&X, M::Arr(vec![M::U(1)])),
    ];
    for (path, value) in cases {
        let err = bad_put(path, Some(value));
        assert!(matches!(err.root(), Error::WrongType { .. }), "{path:?}: {err}");
    }
}

#[test]
fn unknown_proto_and_op_are_unsupported() {
    let frames = frames_with(hand_put().set(&["proto"], Some(M::S("stowage/2"))).set(&["zzz"], Some(M::U(0))), &[16]);
    let err = decode(&frames).unwrap_err();
    assert_eq!((err.code(), request_id(&frames)), (code::UNSUPPORTED, Some(9)));
    assert!(err.to_string().contains("stowage/2"));
    let err = bad_put(&["op"], Some(M::S("put_ok")));
    assert_eq!(err, Error::UnknownOp("put_ok".into()));
    assert_eq!(err.code(), code::UNSUPPORTED);
    let reply = Reply::from_error(&err);
    let (id, back) = decode_reply(&encode_reply(9, &reply).unwrap(), &Limits::default()).unwrap();
    assert_eq!(
        (id, back),
        (9, Reply::Error { code: "unsupported".into(), message: "unsupported op \"put_ok\"".into() })
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
    let get = Request { id: 1, op: Op::Get { global_indexes: vec![1], fields: vec!["a".into()] } };
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
        let ok = matches!(err.root(), Error::RangeOutsideFrame { .. } | Error::EmptyPart);
        assert!(ok, "{offset}+{len}: {err}");
    }
}

#[test]
fn part_rows_must_sum_to_the_shape() {
    for parts in [vec![part(1, 0, 8, 1)], vec![part(1, 0, 8, 1), part(1, 8, 8, 1), part(1, 0, 8, 1)]] {
        let err = bad_put(&X, Some(M::Arr(parts)));
        assert!(matches!(err.root(), Error::RowSum { .. }), "{err}");
    }
    let err = bad_put(&X, Some(M::Arr(vec![part(1, 0, 0, 0), part(1, 0, 16, 2)])));
    assert_eq!(err.root(), &Error::EmptyPart);
    let err = bad_put(&X, Some(M::Arr(vec![part(1, 0, 12, 2)])));
    assert!(matches!(err.root(), Error::LengthMismatch { len: 12, expected: 16 }), "{err}");
}

#[test]
fn row_count_must_match_the_indexes() {
    let err = bad_put(&["body", "global_indexes"], Some(uints(&[0, 1, 2])));
    assert!(matches!(err.root(), Error::RowCount { rows: 2, expected: 3 }), "{err}");
    let req = put(vec![0, 1], vec![("v", Field::Values(vec![Value::Str("a".into())]))]);
    let err = decode(&encode_request(&req).unwrap()).unwrap_err();
    assert!(matches!(err.root(), Error::RowCount { .. }));
}

#[test]
fn duplicate_global_indexes_in_a_put() {
    let err = bad_put(&["body", "global_indexes"], Some(uints(&[4, 4])));
    assert_eq!(err, Error::DuplicateIndex(4));
    let req = put(vec![3, 1, 3], vec![("v", Field::Values(vec![Value::Str("a".into()); 3]))]);
    assert_eq!(decode(&encode_request(&req).unwrap()).unwrap_err(), Error::DuplicateIndex(3));
}

#[test]
fn duplicate_field_names() {
    let get = Request { id: 1, op: Op::Get { global_indexes: vec![1], fields: vec!["a".into(), "a".into()] } };
    assert_eq!(decode(&encode_request(&get).unwrap()).unwrap_err(), Error::DuplicateField("a".into()));
    let v = WireField::Values(vec![Value::Str("a".into())]);
    let req = Request {
        id: 1,
        op: Op::Put { global_indexes: vec![0], fields: vec![("a".into(), v.clone()), ("a".into(), v)] },
    };
    assert_eq!(decode(&encode_request(&req).unwrap()).unwrap_err(), Error::DuplicateField("a".into()));
}

#[test]
fn unknown_dtype_and_kind() {
    let err = bad_put(&["body", "fields", "x", "dtype"], Some(M::S("float8")));
    assert_eq!(err.root(), &Error::UnknownDType("float8".into()));
    let err = bad_put(&["body", "fields", "x", "kind"], Some(M::S("sparse")));
    assert_eq!(err.root(), &Error::UnknownKind("sparse".into()));
    // Receivers accept torch's prefix and aliases.
    let frames = frames_with(hand_put().set(&["body", "fields", "x", "dtype"], Some(M::S("torch.float"))), &[16]);
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
    let env = hand_put()
        .set(&shape, Some(uints(&[2, 0])))
        .set(&X, Some(M::Arr(vec![part(1, 0, 0, 1 << 63), part(1, 0, 0, 1 << 63)])));
    let err = decode(&frames_with(env, &[16])).unwrap_err();
    assert!(matches!(err.root(), Error::RowSum { .. }), "{err}");
    let row =
        M::Map(vec![("shape", uints(&[u64::MAX, 2])), ("frame", M::U(1)), ("offset", M::U(0)), ("len", M::U(16))]);
    let nested =
        M::Map(vec![("kind", M::S("nested")), ("dtype", M::S("int8")), ("rows", M::Arr(vec![row.clone(), row]))]);
    let err = bad_put(&["body", "fields", "x"], Some(nested));
    assert!(matches!(err.root(), Error::BadShape { .. } | Error::LengthMismatch { .. }), "{err}");
}

#[test]
fn empty_batches_are_refused() {
    let err = bad_put(&["body", "global_indexes"], Some(uints(&[])));
    assert!(matches!(err, Error::EmptyBatch(_)));
    assert!(err.to_string().starts_with("empty batch"), "{err}");
    let err = decode(&frames_with(hand_put().set(&["body", "fields"], Some(M::Map(vec![]))), &[])).unwrap_err();
    assert!(matches!(err, Error::EmptyBatch(_)), "{err}");
    for (ix, fields) in [(vec![], vec!["a".to_owned()]), (vec![1], vec![])] {
        let get = Request { id: 1, op: Op::Get { global_indexes: ix, fields } };
        let err = decode(&encode_request(&get).unwrap()).unwrap_err();
        assert!(err.to_string().starts_with("empty batch"), "{err}");
        assert_eq!(err.code(), code::BAD_REQUEST);
    }
}

#[test]
fn limits_are_enforced_before_allocating() {
    let frames = frames_with(hand_put(), &[16]);
    let cases = [
        (Limits { max_rows: 1, ..Limits::default() }, "global indexes"),
        (Limits { max_fields: 0, ..Limits::default() }, "fields"),
        (Limits { max_frames: 1, ..Limits::default() }, "frames"),
        (Limits { max_message_bytes: 100, ..Limits::default() }, "message bytes"),
    ];
    for (limits, what) in cases {
        let err = decode_request(&frames, &limits).unwrap_err();
        assert_eq!(err.code(), code::TOO_LARGE, "{what}: {err}");
        assert!(matches!(err.root(), Error::TooLarge { what: w, .. } if *w == what), "{err}");
    }
    // A declared shape larger than the row limit, with the index count in range.
    let env = hand_put().set(&["body", "fields", "x", "shape"], Some(uints(&[1 << 40, 2])));
    let err = decode_request(&frames_with(env, &[16]), &Limits { max_rows: 2, ..Limits::default() }).unwrap_err();
    assert_eq!(err.code(), code::TOO_LARGE, "{err}");
    assert_eq!(decode(&[]).unwrap_err(), Error::NoFrames);
}

#[test]
fn bad_replies_are_refused() {
    let x = WireField::from_field(&Field::Regular(tensor(DType::U8, &[2, 1], 0))).unwrap();
    let y = WireField::Values(vec![Value::Str("a".into())]);
    let frames = encode_reply(1, &Reply::GetOk { fields: vec![("x".into(), x), ("y".into(), y)] }).unwrap();
    let err = decode_reply(&frames, &Limits::default()).unwrap_err();
    assert!(matches!(err.root(), Error::RowCount { rows: 1, expected: 2 }), "{err}");
    let stats = Reply::StatsOk(vec![("a".into(), Stat::Int(1)), ("a".into(), Stat::Int(2))]);
    let err = decode_reply(&encode_reply(1, &stats).unwrap(), &Limits::default()).unwrap_err();
    assert!(matches!(err, Error::DuplicateKey { .. }), "{err}");
    let err = decode_reply(&frames_with(hand_put(), &[16]), &Limits::default()).unwrap_err();
    assert_eq!(err, Error::UnknownOp("put".into()));
}

#[test]
fn unencodable_values_are_refused() {
    let bad = WireField::Values(vec![Value::Msgpack(Bytes::from_static(&[0x92, 0x01]))]);
    let req = Request { id: 1, op: Op::Put { global_indexes: vec![0], fields: vec![("v".into(), bad)] } };
    assert_eq!(encode_request(&req).unwrap_err().code(), code::INTERNAL);
    let empty = WireField::Nested(vec![]);
    let reply = Reply::GetOk { fields: vec![("n".into(), empty)] };
    assert!(matches!(encode_reply(1, &reply).unwrap_err().root(), Error::Unencodable(_)));
}

/// Every prefix and thousands of byte flips of valid messages: never a
/// panic, and anything accepted re-encodes.
#[test]
fn mangled_messages_never_panic() {
    let req = put(
        vec![0, 1],
        vec![
            ("r", Field::Regular(tensor(DType::F32, &[2, 2], 0))),
            ("n", Field::Nested(vec![tensor(DType::U8, &[1], 0), tensor(DType::U8, &[3], 0)])),
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
    let reply =
        encode_reply(2, &Reply::StatsOk(vec![("f".into(), Stat::Float(1.5)), ("s".into(), Stat::Str("x".into()))]))
            .unwrap();
    for base in [frames, reply] {
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
                encode_reply(id, &reply).unwrap();
            }
        }
    }
}

#[test]
fn a_packed_frame_of_rows_back_to_back_in_one_buffer_is_that_buffer() {
    // three nested int32 rows stored as slices of one received buffer, and
    // a fourth from elsewhere
    let buf = Bytes::from((0u8..48).collect::<Vec<u8>>());
    let row = |a: usize, b: usize| Tensor::contiguous(buf.slice(a..b), DType::I32, vec![((b - a) / 4) as u64]).unwrap();
    let other = Tensor::contiguous(Bytes::from(vec![9u8; 8]), DType::I32, vec![2]).unwrap();
    let span = |p: *const u8, len: usize| {
        let off = (p as usize).checked_sub(buf.as_ptr() as usize)?;
        (off + len <= buf.len()).then(|| buf.slice(off..off + len))
    };
    let all_in_one = |rows: usize| FrameLayout { frames: vec![(0..rows as u64).map(|r| RowSlice { field: 0, start: r, end: r + 1 }).collect()] };
    let reply = Reply::GetOk { fields: vec![("n".into(), WireField::Nested(vec![row(0, 8), row(8, 20), row(20, 48)]))] };
    let frames = encode_reply_joined(1, &reply, &all_in_one(3), &span).unwrap();
    assert_eq!(frames.len(), 2);
    assert_eq!(frames[1].as_ptr(), buf.as_ptr(), "the frame is not the stored buffer");
    assert_eq!(frames[1].len(), 48);
    assert_eq!(decode_reply(&frames, &Limits::default()).unwrap(), (1, reply.clone()));
    assert_eq!(encode_reply_with(1, &reply, &all_in_one(3)).unwrap(), frames, "joined and copied frames differ");
    // out of order, or with a row from another buffer: copied
    let reply = Reply::GetOk { fields: vec![("n".into(), WireField::Nested(vec![row(8, 20), row(0, 8), other]))] };
    let frames = encode_reply_joined(1, &reply, &all_in_one(3), &span).unwrap();
    assert_ne!(frames[1].as_ptr(), buf.as_ptr());
    assert_eq!(decode_reply(&frames, &Limits::default()).unwrap(), (1, reply));
}
