//! `stowage/1`: the native protocol's request and reply decoders, the
//! envelope's shared-memory keys and the id reader, and the same-node
//! descriptor channel's messages.
//!
//! Input: frames in the [`crate::split_frames`] format, which is also the
//! descriptor channel's framing (a little-endian `u32` length, then the
//! body): every frame is tried as a channel message body too.
//!
//! Invariants checked (each holds by design):
//! - decoding never panics, whatever the frames;
//! - a request decodes the same read twice on one thread (the second
//!   read takes the put's fields map the first kept) and on a new thread;
//! - a decoded request (reply) encodes again with the zero-copy layout, and
//!   decoding that gives the same request (reply) and the same id;
//!   (re-decoded under the default limits: the zero-copy layout may use
//!   more frames than the input did);
//! - encoding is stable: encoding the re-decoded value gives the same bytes;
//! - a refused request gives an `error` reply that encodes under the id
//!   [`request_id`] reads (0 if none) and decodes to the same code and
//!   message; its code is one of the protocol's codes;
//! - a decoded channel greeting or descriptor message encodes again, its
//!   length prefix the length of its body, which decodes to the same
//!   message and encodes to the same bytes.

use crate::split_frames;
use bytes::Bytes;
use stowage_wire::channel::{self, Descriptors, Hello};
use stowage_wire::native::{
    LayoutMemo, Limits, Reply, ReplyLayout, code, decode_extras, decode_reply, decode_reply_layout,
    decode_reply_layout_memo, decode_request, encode_reply, encode_request, layout, request_id,
};

/// Reply equality where a float stat may be NaN: `Debug` prints NaN as
/// `NaN` on both sides and keeps -0.0 apart from 0.0.
fn same_reply(a: &Reply, b: &Reply) {
    match (a, b) {
        (Reply::StatsOk(_), Reply::StatsOk(_)) => assert_eq!(format!("{a:?}"), format!("{b:?}")),
        _ => assert_eq!(a, b),
    }
}

/// A request's decode as text: what it decoded to, or its error.
fn decoded(r: &Result<stowage_wire::native::Request, stowage_wire::native::Error>) -> String {
    match r {
        Ok(req) => format!("{req:?}"),
        Err(e) => format!("error: {e}"),
    }
}

fn check_request(frames: &[Bytes], limits: &Limits) {
    let first = decode_request(frames, limits);
    // A put's fields map is kept a thread (the decoder's `LastPut`): read
    // again here, it comes from what this read kept; on a thread that has
    // read nothing, from the bytes. All three agree.
    let again = decode_request(frames, limits);
    assert_eq!(decoded(&first), decoded(&again), "a second read differs");
    let fresh = std::thread::scope(|s| s.spawn(|| decode_request(frames, limits)).join())
        .expect("a first read on a new thread panicked");
    assert_eq!(
        decoded(&first),
        decoded(&fresh),
        "a first read on a new thread differs"
    );
    let req = match first {
        Ok(req) => req,
        Err(err) => {
            let reply = Reply::from_error(&err);
            let Reply::Error { code: c, .. } = &reply else {
                panic!("from_error gave {reply:?}")
            };
            assert!(code::ALL.contains(&c.as_str()), "unknown code {c}");
            let id = request_id(frames).unwrap_or(0);
            let out = encode_reply(id, &reply)
                .unwrap_or_else(|e| panic!("an error reply does not encode: {e}"));
            let (id2, back) = decode_reply(&out, &Limits::DEFAULT)
                .unwrap_or_else(|e| panic!("an error reply does not decode: {e}"));
            assert_eq!((id2, back), (id, reply));
            return;
        }
    };
    assert_eq!(request_id(frames), Some(req.id));
    let out = encode_request(&req)
        .unwrap_or_else(|e| panic!("a decoded request does not encode again: {e}\n{req:?}"));
    let req2 = decode_request(&out, &Limits::DEFAULT)
        .unwrap_or_else(|e| panic!("a re-encoded request does not decode: {e}"));
    assert_eq!(req, req2);
    assert_eq!(request_id(&out), Some(req.id));
    assert_eq!(
        out,
        encode_request(&req2).expect("encodes once, encodes twice"),
        "encoding is not stable"
    );
}

fn check_reply(frames: &[Bytes], limits: &Limits) {
    check_layout(frames, limits);
    let Ok((id, reply)) = decode_reply(frames, limits) else {
        return;
    };
    let out = encode_reply(id, &reply)
        .unwrap_or_else(|e| panic!("a decoded reply does not encode again: {e}\n{reply:?}"));
    let (id2, reply2) = decode_reply(&out, &Limits::DEFAULT)
        .unwrap_or_else(|e| panic!("a re-encoded reply does not decode: {e}"));
    assert_eq!(id, id2);
    same_reply(&reply, &reply2);
    assert_eq!(
        out,
        encode_reply(id2, &reply2).expect("encodes once, encodes twice"),
        "encoding is not stable"
    );
}

/// The layout of frame 0 alone never contradicts the whole decode: a
/// reply that decodes whole has a layout whose ranges fit its frames, and
/// a get_ok layout whose ranges fit the frames means the whole decode
/// succeeds with the same rows.
fn check_layout(frames: &[Bytes], limits: &Limits) {
    let Some(frame0) = frames.first() else { return };
    let whole = decode_reply(frames, limits);
    let layout = decode_reply_layout(frame0, limits);
    // Through a memo that the inputs checked before on this thread left,
    // twice (the second read may come from it): the fresh read's answer
    // both times. (Compared as printed: a NaN among a field's values is
    // not equal to itself.)
    thread_local! {
        static MEMO: std::cell::RefCell<LayoutMemo> = std::cell::RefCell::default();
    }
    MEMO.with_borrow_mut(|memo| {
        for _ in 0..2 {
            let memoized = decode_reply_layout_memo(frame0, limits, memo);
            assert_eq!(
                format!("{memoized:?}"),
                format!("{layout:?}"),
                "a layout through the memo is not the fresh read's"
            );
        }
    });
    let lens: Vec<u64> = frames[1..].iter().map(|f| f.len() as u64).collect();
    match (&whole, &layout) {
        (Ok((id, Reply::GetOk { fields })), Ok((lid, ReplyLayout::GetOk(l)))) => {
            assert_eq!(id, lid);
            layout::check_frames(l, &lens).expect("a decoded get_ok's layout fits its frames");
            assert_eq!(fields.len(), l.len());
            for ((n1, f), (n2, fl)) in fields.iter().zip(l) {
                assert_eq!((n1.as_str(), f.rows()), (&**n2, fl.rows()));
            }
        }
        (Ok(_), Ok((_, ReplyLayout::GetOk(_)))) => panic!("a get_ok layout for another reply"),
        (Ok((id, reply)), Ok((lid, ReplyLayout::Other(other)))) => {
            assert_eq!(id, lid);
            same_reply(reply, other);
        }
        (Ok(_), Err(e)) if frames.len() == 1 => panic!("frame 0 alone refused: {e}"),
        (Err(_), Ok((_, ReplyLayout::GetOk(l)))) if frames.len() as u64 <= limits.max_frames => {
            let total: u64 = frames.iter().map(|f| f.len() as u64).sum();
            if total <= limits.max_message_bytes {
                assert!(
                    layout::check_frames(l, &lens).is_err(),
                    "the layout fits frames the whole decode refused"
                );
            }
        }
        _ => {}
    }
}

/// A channel message body, decoded as both kinds of message.
fn check_channel(body: &[u8], limits: &channel::Limits) {
    if let Ok(hello) = Hello::decode(body) {
        let out = hello.encode().expect("a decoded greeting encodes");
        let back = Hello::decode(channel_body(&out)).expect("a re-encoded greeting decodes");
        assert_eq!(back, hello);
        assert_eq!(
            back.encode().expect("encodes twice"),
            out,
            "encoding is not stable"
        );
    }
    if let Ok(message) = Descriptors::decode(body, limits) {
        let out = message.encode().expect("a decoded channel message encodes");
        let back = Descriptors::decode(channel_body(&out), limits)
            .expect("a re-encoded channel message decodes");
        assert_eq!(back, message);
        assert_eq!(
            back.encode().expect("encodes twice"),
            out,
            "encoding is not stable"
        );
    }
}

/// The body of an encoded channel message, its length prefix checked.
fn channel_body(message: &[u8]) -> &[u8] {
    let (prefix, body) = message.split_at(channel::LEN_BYTES);
    let len = u32::from_le_bytes(prefix.try_into().expect("4 bytes"));
    assert_eq!(
        len as usize,
        body.len(),
        "the length prefix is not the body's"
    );
    body
}

/// The target's body: every invariant above, on one input.
pub fn check(data: &[u8]) {
    let frames = split_frames(data);
    // The default limits (what stowd runs with) and tight ones, so the
    // limit checks themselves are reached.
    let tight = Limits {
        max_rows: 8,
        max_fields: 4,
        max_frames: 8,
        max_message_bytes: 4096,
    };
    for limits in [Limits::DEFAULT, tight] {
        if let Some(frame0) = frames.first() {
            let _ = decode_extras(frame0, &limits);
        }
        check_request(&frames, &limits);
        check_reply(&frames, &limits);
    }
    let tight = channel::Limits {
        max_body_bytes: 4096,
        max_names: 4,
        max_name_bytes: 8,
    };
    for limits in [channel::Limits::DEFAULT, tight] {
        for frame in &frames {
            check_channel(frame, &limits);
        }
    }
}
