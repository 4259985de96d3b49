//! Values TransferQueue's encoder sends that carry arrays inside or are
//! numpy arrays (ext 5): golden frames from TransferQueue 0.1.11 (`values/`,
//! written by `tests/python/make_tq_value_goldens.py`). For each case the
//! PUT its encoder wrote is decoded as stowd decodes it, and the GET reply
//! stowd writes for the stored rows must equal, byte for byte, the reply a
//! real `SimpleStorageUnit` gave (same sender, request id and time).

use std::path::Path;

use bytes::Bytes;

use super::{ext, frame0, put_body, zeros};
use crate::batch::{Cell, Field, Value};
use crate::pickle;
use crate::tq::{
    Error, ErrorReply, Reply, Request, Stamp, decode_reply, decode_request, encode_reply_stamped,
    encode_request_stamped,
};

fn values_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src/tests/values"))
}

fn load(name: &str) -> Vec<Bytes> {
    let mut frames = Vec::new();
    while let Ok(b) = std::fs::read(values_dir().join(format!("{name}.frame{}.bin", frames.len())))
    {
        frames.push(Bytes::from(b));
    }
    assert!(!frames.is_empty(), "no golden frames {name}");
    frames
}

fn cases() -> Vec<String> {
    std::fs::read_to_string(values_dir().join("CASES"))
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The rows of a decoded PUT field, as the unit stores them.
fn cells(f: &Field) -> Vec<Cell> {
    match f {
        Field::Regular(t) => (0..t.rows())
            .map(|i| Cell::Tensor(t.row_tensor(i).unwrap()))
            .collect(),
        Field::Nested(ts) => ts.iter().cloned().map(Cell::Tensor).collect(),
        Field::Values(vs) => vs.iter().cloned().map(Cell::Value).collect(),
    }
}

/// stowd's GET reply for the rows of golden PUT `name`, stamped like the
/// golden reply.
fn stowd_reply(name: &str) -> (Vec<Bytes>, Vec<Bytes>) {
    let put = load(&format!("{name}.put"));
    let golden = load(&format!("{name}.get"));
    let Request::Put { fields, .. } =
        decode_request(&put).unwrap_or_else(|e| panic!("{name}: {e}"))
    else {
        panic!("{name}: not a PUT")
    };
    let reply = Reply::GetData {
        fields: fields.iter().map(|(n, f)| (n.clone(), cells(f))).collect(),
    };
    let (envelope, _) =
        decode_reply(&golden).unwrap_or_else(|e| panic!("{name}: golden reply: {e}"));
    let stamp = Stamp::new(&envelope.request_id, envelope.timestamp);
    (
        encode_reply_stamped(&envelope.sender_id, &reply, &stamp),
        golden,
    )
}

#[test]
fn every_case_round_trips_as_simple_storage_unit_answers() {
    let names = cases();
    assert!(names.len() >= 20, "{names:?}");
    for name in &names {
        let (ours, golden) = stowd_reply(name);
        assert_eq!(ours.len(), golden.len(), "{name}: frame count");
        for (k, (a, b)) in ours.iter().zip(&golden).enumerate() {
            assert_eq!(a, b, "{name}: frame {k} differs");
        }
    }
}

#[test]
fn golden_replies_decode_again_to_the_same_reply() {
    // The router side: a remote unit's reply with arrays inside is read
    // back (inlined) and written again unchanged.
    for name in cases() {
        let golden = load(&format!("{name}.get"));
        let (envelope, reply) = decode_reply(&golden).unwrap_or_else(|e| panic!("{name}: {e}"));
        let stamp = Stamp::new(&envelope.request_id, envelope.timestamp);
        assert_eq!(
            encode_reply_stamped(&envelope.sender_id, &reply, &stamp),
            golden,
            "{name}"
        );
    }
}

#[test]
fn puts_forwarded_by_the_router_keep_their_arrays() {
    // A PUT with arrays inside values, encoded again (the router forwarding
    // it to a remote unit), decodes to the same rows.
    for name in [
        "numpy_rows",
        "tensor_in_containers",
        "nested_tensor_row",
        "numpy_in_dict",
    ] {
        let put = load(&format!("{name}.put"));
        let request = decode_request(&put).unwrap();
        let again =
            encode_request_stamped("S", Some("U"), &request, &Stamp::new("00000000", 1.0)).unwrap();
        assert_eq!(decode_request(&again).unwrap(), request, "{name}");
    }
}

fn put(value: Vec<u8>, frames: &[Bytes]) -> Vec<Bytes> {
    put_n(&[0, 1, 2], value, frames)
}

fn put_n(indexes: &[u64], value: Vec<u8>, frames: &[Bytes]) -> Vec<Bytes> {
    let mut out = vec![frame0("PUT", &put_body(indexes, &[("f", value)]))];
    out.extend(frames.iter().cloned());
    out
}

fn np(dtype: &str, shape: &[u64], index: usize) -> Vec<u8> {
    ext(5, &pickle::dumps_tensor_meta(dtype, shape, index))
}

fn array(items: &[Vec<u8>]) -> Vec<u8> {
    let mut out = vec![0x90 | items.len() as u8];
    items.iter().for_each(|i| out.extend_from_slice(i));
    out
}

fn fails(frames: &[Bytes], kind: ErrorReply) -> Error {
    let e = decode_request(frames).unwrap_err();
    assert_eq!(e.reply_type(), kind, "{e}");
    e
}

#[test]
fn numpy_frames_must_fit_dtype_and_shape() {
    // 2 x '<U3' = 24 bytes; 23 is one byte short: undecodable, like numpy's reshape.
    let v = array(&[np("<U3", &[2], 1), b"\xc0".to_vec(), b"\xc0".to_vec()]);
    assert!(decode_request(&put(v.clone(), &[zeros(24)])).is_ok());
    let e = fails(&put(v, &[zeros(23)]), ErrorReply::PutGet);
    assert!(
        matches!(
            e,
            Error::NumpyLength {
                expected: 24,
                actual: 23,
                ..
            }
        ),
        "{e}"
    );
    // A whole-field array is checked the same way.
    let e = fails(
        &put(np("float64", &[3], 1), &[zeros(8)]),
        ErrorReply::PutGet,
    );
    assert!(matches!(e, Error::NumpyLength { .. }), "{e}");
}

#[test]
fn unknown_object_and_structured_numpy_dtypes_are_undecodable() {
    for dtype in [
        "",
        "object",
        "|O",
        "[('a', '<i4')]",
        "<x4",
        "int7",
        "<i3",
        "S",
        "U99999999999",
        "datetime64[n s]",
    ] {
        let v = array(&[np(dtype, &[1], 1), b"\xc0".to_vec(), b"\xc0".to_vec()]);
        let e = fails(&put(v, &[zeros(4)]), ErrorReply::PutGet);
        assert!(
            matches!(e, Error::UnknownDtype(_) | Error::BadExt { .. }),
            "{dtype}: {e}"
        );
    }
}

#[test]
fn whole_field_numpy_arrays_follow_len_and_row_count() {
    // 0-d: no len(), as in the unit.
    let e = fails(&put(np("uint8", &[], 1), &[zeros(1)]), ErrorReply::Put);
    assert!(e.to_string().contains("0-d numpy array"), "{e}");
    // Rows must match the indexes, checked before any row is built (a
    // 10^12-row array of zero-size items is one cheap error).
    let e = fails(
        &put(np("|S0", &[1_000_000_000_000], 1), &[zeros(0)]),
        ErrorReply::Put,
    );
    assert!(
        matches!(
            e,
            Error::RowCount {
                rows: 1_000_000_000_000,
                ..
            }
        ),
        "{e}"
    );
    // 1-d rows of a kind stowd does not pickle as numpy scalars: refused with why.
    let e = fails(
        &put(np("datetime64[ns]", &[3], 1), &[zeros(24)]),
        ErrorReply::Put,
    );
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("one array per row"), "{e}");
}

#[test]
fn a_frame_is_copied_into_values_at_most_once() {
    // Two per-row arrays naming the same frame: refused, so that copies
    // never exceed the message (TransferQueue never shares a frame).
    let v = array(&[np("uint8", &[4], 1), np("uint8", &[4], 1), b"\xc0".to_vec()]);
    let e = fails(&put(v, &[zeros(4)]), ErrorReply::PutGet);
    assert!(matches!(e, Error::BadExt { code: 5, .. }), "{e}");
}

#[test]
fn inlined_values_stay_inside_their_frames_and_nesting_is_bounded() {
    // Deep nesting around an array is refused like any deep msgpack.
    let mut deep = np("uint8", &[1], 1);
    for _ in 0..80 {
        deep = array(&[deep]);
    }
    let v = array(&[deep, b"\xc0".to_vec(), b"\xc0".to_vec()]);
    let e = fails(&put(v, &[zeros(1)]), ErrorReply::PutGet);
    assert!(matches!(e, Error::Msgpack { .. }), "{e}");
}

#[test]
fn a_foreign_value_that_looks_inlined_is_written_back_as_it_is() {
    // A stowage/1 client may store any msgpack; one that starts like an
    // inlined value but is not one goes out unchanged, with no frame.
    let bogus = Bytes::from_static(b"\xc9\x00\x00\x00\x03\x64\x00\x01\x02");
    let reply = Reply::GetData {
        fields: vec![("f".into(), vec![Cell::Value(Value::Msgpack(bogus.clone()))])],
    };
    let frames = encode_reply_stamped("U", &reply, &Stamp::new("00000000", 1.0));
    assert_eq!(frames.len(), 1);
    assert!(frames[0].windows(bogus.len()).any(|w| w == bogus));
}

#[test]
fn bad_input_takes_time_linear_in_its_size() {
    // Many rows, each a small numpy array: decoded in one pass.
    let n = 20_000u64;
    let mut w = crate::msgpack::Writer::new();
    w.array(n as usize);
    let mut frames = Vec::new();
    for i in 0..n {
        w.raw(&np("int32", &[2], i as usize + 1));
        frames.push(zeros(8));
    }
    let indexes: Vec<u64> = (0..n).collect();
    let msg = put_n(&indexes, w.into_bytes().to_vec(), &frames);
    let t = std::time::Instant::now();
    let Request::Put { fields, .. } = decode_request(&msg).unwrap() else {
        panic!()
    };
    assert_eq!(fields[0].1.rows(), n);
    assert!(t.elapsed().as_secs() < 20, "{:?}", t.elapsed());
}

/// The ext 1 payload (the pickle) of golden PUT `name`'s field.
fn pickle_of_field(name: &str) -> Vec<u8> {
    let put = load(&format!("{name}.put"));
    super::exts(&put[0])
        .into_iter()
        .find(|(code, _)| *code == 1)
        .expect("an ext 1")
        .1
}

#[test]
fn object_arrays_stowd_cannot_take_apart_are_refused_with_why() {
    let good = pickle_of_field("numpy_object_field_mixed");
    let refuse = |payload: Vec<u8>, n: usize| {
        let indexes: Vec<u64> = (0..n as u64).collect();
        fails(&put_n(&indexes, ext(1, &payload), &[]), ErrorReply::Put)
    };
    // An item stowd would have to pickle again: a dict (EMPTY_DICT) instead of None.
    let none_at = good.windows(2).position(|w| w == b"N\x8c").unwrap();
    let mut dict = good.clone();
    dict[none_at] = b'}';
    let e = refuse(dict, 3);
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("arbitrary objects"), "{e}");
    // Cut short, or one byte too many: malformed.
    for bad in [
        good[..good.len() - 1].to_vec(),
        [good.clone(), vec![b'.']].concat(),
    ] {
        let e = refuse(bad, 3);
        assert!(e.to_string().contains("malformed"), "{e}");
    }
    // Not an object array at all: the generic refusal.
    let e = refuse(b"\x80\x05K\x01.".to_vec(), 3);
    assert!(e.to_string().contains("as a whole field"), "{e}");
    // Rows must match the indexes.
    let e = refuse(good, 2);
    assert!(matches!(e, Error::RowCount { rows: 3, .. }), "{e}");
}

/// `{"__tq_tensordict__": true, "batch_size": batch, "data": {"x": leaf}}`.
fn tensordict(marker: bool, batch: &[u64], leaf: &[u8]) -> Vec<u8> {
    let mut w = crate::msgpack::Writer::new();
    w.map(3);
    w.str("__tq_tensordict__");
    w.bool(marker);
    w.str("batch_size");
    w.array(batch.len());
    batch.iter().for_each(|&d| w.uint(d));
    w.str("data");
    w.map(1);
    w.str("x");
    w.raw(leaf);
    w.into_bytes().to_vec()
}

#[test]
fn tensordict_fields_must_be_tensordicts_of_the_batch() {
    let leaf = super::ext3("float32", &[3, 2], 1);
    let ok = tensordict(true, &[3], &leaf);
    let Request::Put { fields, .. } = decode_request(&put(ok, &[zeros(24)])).unwrap() else {
        panic!()
    };
    assert!(matches!(&fields[0].1, Field::Values(v) if v.len() == 3));
    // Not marked, or a plain map: refused with why.
    let e = fails(
        &put(tensordict(false, &[3], &leaf), &[zeros(24)]),
        ErrorReply::Put,
    );
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    // A leaf that is not a tensor.
    let e = fails(&put(tensordict(true, &[3], b"\xa1s"), &[]), ErrorReply::Put);
    assert!(
        e.to_string().contains("neither a tensor nor a TensorDict"),
        "{e}"
    );
    // A batch size other than the indexes, a tensor of other rows.
    let e = fails(
        &put(tensordict(true, &[2], &leaf), &[zeros(24)]),
        ErrorReply::Put,
    );
    assert!(matches!(e, Error::RowCount { rows: 2, .. }), "{e}");
    let leaf2 = super::ext3("float32", &[2, 3], 1);
    let e = fails(
        &put(tensordict(true, &[3], &leaf2), &[zeros(24)]),
        ErrorReply::Put,
    );
    assert!(e.to_string().contains("first dimension"), "{e}");
    // Many rows of many zero-size tensors: rows x tensors is refused
    // before any row is written (it would be quadratic in the message).
    let (n, k) = (2_000u64, 2_000usize);
    let indexes: Vec<u64> = (0..n).collect();
    let mut w = crate::msgpack::Writer::new();
    w.map(3);
    w.str("__tq_tensordict__");
    w.bool(true);
    w.str("batch_size");
    w.array(1);
    w.uint(n);
    w.str("data");
    w.map(k);
    for i in 0..k {
        w.str(&format!("x{i}"));
        w.raw(&super::ext3("float32", &[n as i128, 0], i as i128 + 1));
    }
    let frames: Vec<Bytes> = (0..k).map(|_| zeros(0)).collect();
    let msg = put_n(&indexes, w.into_bytes().to_vec(), &frames);
    let Err(e) = decode_request(&msg) else {
        panic!("not refused")
    };
    assert!(e.to_string().contains("far over"), "{e}");
}
