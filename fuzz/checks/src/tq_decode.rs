//! TransferQueue 0.1.11 wire: envelope, msgpack, ext 3/4/5 and the pickle
//! subset, through the unit's request decoder and the router's reply
//! decoder.
//!
//! Input: frames in the [`crate::split_frames`] format.
//!
//! Invariants checked (each holds by design):
//! - decoding never panics, whatever the frames;
//! - a decoded request (reply) encodes again with its own request id and
//!   timestamp, and decoding that gives the same envelope and the same
//!   request (reply); an empty nested field and an empty list of values are
//!   the same thing on the wire (both an empty list);
//! - encoding is stable: encoding the re-decoded value gives the same bytes;
//! - a decode error gives the error reply the unit sends, and that reply
//!   decodes (as the router reads it) to the same kind and message.

use crate::split_frames;
use bytes::Bytes;
use stowage_wire::batch::Field;
use stowage_wire::tq::{
    Envelope, Error, Reply, Request, Stamp, decode_message, decode_reply, encode_reply_stamped,
    encode_request_stamped,
};

const UNIT: &str = "TQ_STORAGE_UNIT_fuzz";

fn stamp(e: &Envelope) -> Stamp {
    Stamp::new(e.request_id.clone(), e.timestamp)
}

/// Envelope equality with the timestamp compared bit for bit (NaN is a
/// valid float64 on the wire).
fn same_envelope(a: &Envelope, b: &Envelope, receiver: bool) {
    assert_eq!(a.request_type, b.request_type);
    assert_eq!(a.sender_id, b.sender_id);
    assert_eq!(a.request_id, b.request_id);
    assert_eq!(
        a.timestamp.to_bits(),
        b.timestamp.to_bits(),
        "timestamp {} != {}",
        a.timestamp,
        b.timestamp
    );
    if receiver {
        assert_eq!(a.receiver_id, b.receiver_id);
    }
}

/// An empty nested field travels as an empty list, which decodes as an
/// empty list of values.
fn normalized(r: &Request) -> Request {
    match r {
        Request::Put {
            global_indexes,
            fields,
        } => Request::Put {
            global_indexes: global_indexes.clone(),
            fields: fields
                .iter()
                .map(|(name, f)| match f {
                    Field::Nested(rows) if rows.is_empty() => {
                        (name.clone(), Field::Values(Vec::new()))
                    }
                    f => (name.clone(), f.clone()),
                })
                .collect(),
        },
        other => other.clone(),
    }
}

fn check_request(frames: &[Bytes]) {
    let m = match decode_message(frames) {
        Ok(m) => m,
        Err(e) => return check_error(&e),
    };
    let e = &m.envelope;
    let encode = |req: &Request| {
        encode_request_stamped(&e.sender_id, e.receiver_id.as_deref(), req, &stamp(e))
            .unwrap_or_else(|err| panic!("a decoded request does not encode again: {err}\n{req:?}"))
    };
    let again = encode(&m.request);
    let m2 = decode_message(&again)
        .unwrap_or_else(|err| panic!("a re-encoded request does not decode: {err}"));
    same_envelope(e, &m2.envelope, true);
    assert_eq!(normalized(&m.request), m2.request);
    assert_eq!(again, encode(&m2.request), "encoding is not stable");
}

fn check_error(err: &Error) {
    let reply = err.to_reply(UNIT);
    let Reply::Error { kind, message } = &reply else {
        panic!("to_reply gave {reply:?}")
    };
    assert_eq!(*kind, err.reply_type());
    assert_eq!(
        err.is_undecodable(),
        message.starts_with("undecodable request: ")
    );
    let frames = encode_reply_stamped(UNIT, &reply, &Stamp::new("0badc0de", 1.0));
    let (_, back) =
        decode_reply(&frames).unwrap_or_else(|e| panic!("an error reply does not decode: {e}"));
    assert_eq!(back, reply);
}

fn check_reply(frames: &[Bytes]) {
    let Ok((e, reply)) = decode_reply(frames) else {
        return;
    };
    let again = encode_reply_stamped(&e.sender_id, &reply, &stamp(&e));
    let (e2, reply2) = decode_reply(&again)
        .unwrap_or_else(|err| panic!("a re-encoded reply does not decode: {err}"));
    same_envelope(&e, &e2, false);
    assert_eq!(e2.receiver_id, None);
    assert_eq!(reply, reply2);
    assert_eq!(
        again,
        encode_reply_stamped(&e2.sender_id, &reply2, &stamp(&e2)),
        "encoding is not stable"
    );
}

/// The target's body: every invariant above, on one input.
pub fn check(data: &[u8]) {
    let frames = split_frames(data);
    check_request(&frames);
    check_reply(&frames);
}
