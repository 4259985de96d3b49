//! Golden frames from a real transferqueue 0.1.11 `SimpleStorageUnit`: every
//! message decodes to the batch the fixture README describes, and encoding
//! the decoded values again gives the same bytes.

use bytes::Bytes;

use super::{exts, load};
use crate::batch::{Cell, Field, Value};
use crate::pickle;
use crate::tensor::{Dtype, Tensor};
use crate::tq::{
    Envelope, ErrorReply, Metrics, Reply, Request, Stamp, decode_message, decode_reply,
    decode_request, encode_reply_stamped, encode_request_stamped,
};

const UNIT: &str = "TQ_STORAGE_UNIT_48745fbb";
const CLIENT: &str = "TQ_STORAGE_fixture";

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn stamp(e: &Envelope) -> Stamp {
    Stamp::new(e.request_id.clone(), e.timestamp)
}

fn check_request_envelope(e: &Envelope, request_type: &str, sender: &str) {
    assert_eq!(e.request_type, request_type);
    assert_eq!(e.sender_id, sender);
    assert_eq!(e.receiver_id.as_deref(), Some(UNIT));
    assert_eq!(e.request_id.len(), 8);
    assert!(
        e.request_id
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    );
    assert!(e.timestamp > 1.7e9, "timestamp {}", e.timestamp);
}

/// Decodes a fixture reply and checks the reply envelope conventions.
fn reply(name: &str) -> (Vec<Bytes>, Envelope, Reply) {
    let frames = load(name);
    let (e, r) = decode_reply(&frames).unwrap();
    assert_eq!(e.sender_id, UNIT);
    assert_eq!(e.receiver_id, None);
    assert_eq!(e.request_id.len(), 8);
    assert_eq!(e.request_type, r.request_type());
    (frames, e, r)
}

/// The batch of the README: rows 0 and 2 of reg, jag, txt, bf.
fn check_put(fields: &[(String, Field)], frames: &[Bytes]) {
    let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["reg", "jag", "txt", "bf"]);
    let Field::Regular(reg) = &fields[0].1 else {
        panic!("reg is {:?}", fields[0].1)
    };
    assert_eq!((reg.dtype(), reg.shape()), (Dtype::Float32, &[2u64, 2][..]));
    assert_eq!(f32s(&reg.contiguous_bytes()), [0.0, 1.0, 4.0, 5.0]);
    assert_eq!(
        reg.buffer().as_ptr(),
        frames[1].as_ptr(),
        "reg must be a view of frame 1"
    );
    let Field::Nested(jag) = &fields[1].1 else {
        panic!("jag is {:?}", fields[1].1)
    };
    assert_eq!(jag.len(), 2);
    assert_eq!(
        (jag[0].dtype(), jag[0].shape()),
        (Dtype::Int64, &[1u64][..])
    );
    assert_eq!(i64s(&jag[0].contiguous_bytes()), [0]);
    assert_eq!(jag[1].shape(), &[3]);
    assert_eq!(i64s(&jag[1].contiguous_bytes()), [0, 1, 2]);
    assert_eq!(
        fields[2].1,
        Field::Values(vec![Value::Str("s0".into()), Value::Str("s2".into())])
    );
    let Field::Regular(bf) = &fields[3].1 else {
        panic!("bf is {:?}", fields[3].1)
    };
    assert_eq!((bf.dtype(), bf.shape()), (Dtype::Bfloat16, &[2u64, 1][..]));
    assert_eq!(bf.contiguous_bytes().as_ref(), b"\x80\x3f\x80\x3f");
}

#[test]
fn put_req_decodes_to_the_readme_batch_and_reencodes_identically() {
    let frames = load("put_req");
    assert_eq!(frames.len(), 5);
    let m = decode_message(&frames).unwrap();
    check_request_envelope(&m.envelope, "PUT", CLIENT);
    let Request::Put {
        global_indexes,
        fields,
    } = &m.request
    else {
        panic!("{:?}", m.request)
    };
    assert_eq!(global_indexes, &[0, 2]);
    check_put(fields, &frames);
    assert_eq!(m.request.op_name(), "PUT_DATA");
    let again =
        encode_request_stamped(CLIENT, Some(UNIT), &m.request, &stamp(&m.envelope)).unwrap();
    assert_eq!(again, frames);
}

#[test]
fn get_clear_and_metrics_requests_decode_and_reencode_identically() {
    let cases: [(&str, &str, &str, Request); 4] = [
        (
            "get_req",
            "GET",
            CLIENT,
            Request::Get {
                global_indexes: vec![0, 2],
                fields: ["reg", "jag", "txt", "bf"].map(String::from).to_vec(),
            },
        ),
        (
            "get_missing_req",
            "GET",
            CLIENT,
            Request::Get {
                global_indexes: vec![9],
                fields: vec!["reg".into()],
            },
        ),
        (
            "clear_req",
            "CLEAR_DATA",
            CLIENT,
            Request::Clear {
                global_indexes: vec![0, 2],
            },
        ),
        (
            "metrics_req",
            "GET_METRICS",
            "TQ_STORAGE_fixture_probe",
            Request::GetMetrics,
        ),
    ];
    for (name, kind, sender, expected) in cases {
        let frames = load(name);
        let m = decode_message(&frames).unwrap();
        check_request_envelope(&m.envelope, kind, sender);
        assert_eq!(m.request, expected, "{name}");
        assert_eq!(decode_request(&frames).unwrap(), expected);
        let again =
            encode_request_stamped(sender, Some(UNIT), &m.request, &stamp(&m.envelope)).unwrap();
        assert_eq!(again, frames, "{name}");
    }
}

#[test]
fn op_names_are_the_ones_metrics_count() {
    let requests = [
        Request::Put {
            global_indexes: vec![],
            fields: vec![],
        },
        Request::Get {
            global_indexes: vec![],
            fields: vec![],
        },
        Request::Clear {
            global_indexes: vec![],
        },
        Request::GetMetrics,
        Request::Other("HANDSHAKE".into()),
    ];
    let names: Vec<&str> = requests.iter().map(|r| r.op_name()).collect();
    assert_eq!(
        names,
        [
            "PUT_DATA",
            "GET_DATA",
            "CLEAR_DATA",
            "GET_METRICS",
            "HANDSHAKE"
        ]
    );
}

#[test]
fn get_resp_decodes_to_one_frame_per_tensor_row() {
    let (frames, _, r) = reply("get_resp");
    assert_eq!(frames.len(), 7);
    let Reply::GetData { fields } = &r else {
        panic!("{r:?}")
    };
    let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["reg", "jag", "txt", "bf"]);
    let tensor = |c: &Cell| match c {
        Cell::Tensor(t) => t.clone(),
        other => panic!("{other:?}"),
    };
    let reg: Vec<Tensor> = fields[0].1.iter().map(tensor).collect();
    assert_eq!(reg[0].shape(), &[2]);
    assert_eq!(f32s(&reg[0].contiguous_bytes()), [0.0, 1.0]);
    assert_eq!(f32s(&reg[1].contiguous_bytes()), [4.0, 5.0]);
    assert_eq!(reg[1].buffer().as_ptr(), frames[2].as_ptr());
    let jag: Vec<Tensor> = fields[1].1.iter().map(tensor).collect();
    assert_eq!(i64s(&jag[1].contiguous_bytes()), [0, 1, 2]);
    assert_eq!(
        fields[2].1,
        [
            Cell::Value(Value::Str("s0".into())),
            Cell::Value(Value::Str("s2".into()))
        ]
    );
    let bf: Vec<Tensor> = fields[3].1.iter().map(tensor).collect();
    assert_eq!(
        (bf[0].dtype(), bf[0].shape()),
        (Dtype::Bfloat16, &[1u64][..])
    );
}

#[test]
fn get_response_rebuilt_from_the_put_matches_the_real_unit() {
    let put = load("put_req");
    let Request::Put { fields, .. } = decode_request(&put).unwrap() else {
        panic!()
    };
    // The unit stores one cell per (index, field) and answers GET [0, 2],
    // i.e. positions 0 and 1 of the PUT, in the GET's field order.
    let cells = |f: &Field| -> Vec<Cell> {
        (0..2u64)
            .map(|i| match f {
                Field::Regular(t) => Cell::Tensor(t.row_tensor(i).unwrap()),
                Field::Nested(ts) => Cell::Tensor(ts[i as usize].clone()),
                Field::Values(vs) => Cell::Value(vs[i as usize].clone()),
            })
            .collect()
    };
    let rebuilt = Reply::GetData {
        fields: fields.iter().map(|(n, f)| (n.clone(), cells(f))).collect(),
    };

    let (golden, golden_env, golden_reply) = reply("get_resp");
    assert_eq!(golden_reply, rebuilt);
    let ours = encode_reply_stamped(UNIT, &rebuilt, &Stamp::new("00c0ffee", 1.25e9));
    let (env, decoded) = decode_reply(&ours).unwrap();
    assert_eq!(decoded, rebuilt);
    assert_eq!(env.request_type, golden_env.request_type);
    assert_eq!(env.sender_id, golden_env.sender_id);
    assert_eq!(env.receiver_id, golden_env.receiver_id);
    assert_eq!(
        (env.request_id.as_str(), env.timestamp),
        ("00c0ffee", 1.25e9)
    );
    // Data frames: identical bytes, and views of the PUT's frames (no copy).
    assert_eq!(ours[1..], golden[1..]);
    let within = |b: &Bytes, f: &Bytes| {
        let (p, q) = (b.as_ptr() as usize, f.as_ptr() as usize);
        p >= q && p + b.len() <= q + f.len()
    };
    for (k, frame) in ours[1..].iter().enumerate() {
        assert!(
            put[1..].iter().any(|f| within(frame, f)),
            "frame {} was copied",
            k + 1
        );
    }
    // Body byte for byte: with the golden stamp the whole frame 0 is equal.
    let same_stamp = encode_reply_stamped(UNIT, &rebuilt, &stamp(&golden_env));
    assert_eq!(same_stamp, golden);
}

#[test]
fn put_clear_and_error_replies_reencode_identically() {
    let cases = [
        ("put_resp", Reply::PutData),
        ("clear_resp", Reply::clear_ok(UNIT)),
        ("get_missing_resp", Reply::key_not_found(UNIT, 9, "reg")),
    ];
    for (name, expected) in cases {
        let (frames, env, r) = reply(name);
        assert_eq!(r, expected, "{name}");
        assert_eq!(
            encode_reply_stamped(UNIT, &expected, &stamp(&env)),
            frames,
            "{name}"
        );
    }
    let (_, _, missing) = reply("get_missing_resp");
    let Reply::Error {
        kind: ErrorReply::Get,
        message,
    } = missing
    else {
        panic!()
    };
    assert!(message.starts_with("[TQKeyNotFound] "));
}

#[test]
fn metrics_resp_decodes_and_reencodes_identically() {
    let (frames, env, r) = reply("metrics_resp");
    let Reply::Metrics(m) = &r else {
        panic!("{r:?}")
    };
    let arrivals = [
        ("PUT_DATA", 1),
        ("GET_DATA", 2),
        ("CLEAR_DATA", 1),
        ("GET_METRICS", 1),
    ];
    let expected = Metrics {
        storage_unit_id: UNIT.into(),
        capacity: None,
        active_keys: 0,
        process_rss_bytes: m.process_rss_bytes,
        ssd_offload_enabled: false,
        ssd_active_values: 0,
        ssd_active_bytes: 0,
        ssd_fallback_values_total: 0,
        requests_arrived: 5,
        arrivals_by_op: arrivals.map(|(k, v)| (k.to_string(), v)).to_vec(),
        extra: vec![],
    };
    assert_eq!(m, &expected);
    assert!(m.process_rss_bytes > 0);
    assert_eq!(encode_reply_stamped(UNIT, &r, &stamp(&env)), frames);
}

#[test]
fn pickle_writer_reproduces_every_fixture_pickle() {
    let mut seen = 0;
    for name in ["put_req", "get_resp"] {
        for (code, payload) in exts(&load(name)[0]) {
            assert_eq!(code, 3);
            let v = pickle::loads(&payload).unwrap();
            assert_eq!(pickle::dumps(&v), payload);
            let [dtype, shape, index] = v.as_seq().unwrap() else {
                panic!()
            };
            let dims: Vec<u64> = shape
                .as_seq()
                .unwrap()
                .iter()
                .map(|d| d.as_int().unwrap() as u64)
                .collect();
            let index = index.as_int().unwrap() as usize;
            assert_eq!(
                pickle::dumps_tensor_meta(dtype.as_str().unwrap(), &dims, index),
                payload
            );
            seen += 1;
        }
    }
    assert_eq!(seen, 10);
}

/// The checkpoint golden frames (`tests/fixtures/transferqueue-0.1.11-checkpoint`
/// in this repository, captured from a real 0.1.11 `SimpleStorageUnit`).
fn checkpoint_frames(name: &str) -> Vec<Bytes> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/transferqueue-0.1.11-checkpoint")
        .join(format!("{name}.frame0.bin"));
    vec![Bytes::from(
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )]
}

#[test]
fn checkpoint_requests_and_replies_decode_and_reencode_identically() {
    const CKPT_UNIT: &str = "TQ_STORAGE_UNIT_84077ff1";
    let path = "/tmp/stowage-fixture/su_0.pkl".to_string();
    let missing = "/tmp/stowage-fixture/missing.pkl".to_string();
    let requests = [
        ("save_req", Request::SaveCheckpoint { path: path.clone() }),
        ("load_req", Request::LoadCheckpoint { path }),
        (
            "load_missing_req",
            Request::LoadCheckpoint { path: missing },
        ),
    ];
    for (name, want) in requests {
        let frames = checkpoint_frames(name);
        let m = decode_message(&frames).unwrap();
        assert_eq!(m.request, want, "{name}");
        assert_eq!(m.envelope.sender_id, CLIENT);
        assert_eq!(m.envelope.receiver_id.as_deref(), Some(CKPT_UNIT));
        let again =
            encode_request_stamped(CLIENT, Some(CKPT_UNIT), &m.request, &stamp(&m.envelope))
                .unwrap();
        assert_eq!(again, frames, "{name}");
    }
    let replies = [
        (
            "save_resp",
            Reply::Checkpoint {
                load: false,
                error: None,
            },
        ),
        (
            "load_resp",
            Reply::Checkpoint {
                load: true,
                error: None,
            },
        ),
        (
            "load_missing_resp",
            Reply::Checkpoint {
                load: true,
                error: Some(
                    "[Errno 2] No such file or directory: '/tmp/stowage-fixture/missing.pkl'"
                        .into(),
                ),
            },
        ),
    ];
    for (name, want) in replies {
        let frames = checkpoint_frames(name);
        let (env, r) = decode_reply(&frames).unwrap();
        assert_eq!(r, want, "{name}");
        assert_eq!(env.sender_id, CKPT_UNIT);
        assert_eq!(env.receiver_id, None);
        assert_eq!(
            encode_reply_stamped(CKPT_UNIT, &r, &stamp(&env)),
            frames,
            "{name}"
        );
    }
}
