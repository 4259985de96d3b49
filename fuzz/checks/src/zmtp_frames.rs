//! The ZMTP framer and the frame reader on arbitrary bytes from a peer
//! (after the handshake).
//!
//! The framer first: a header parsed at any offset (of the first 4 KiB)
//! must be written back as the bytes it came from and parse again the
//! same, every shorter cut of it must ask for exactly its length, and a
//! refusal must name the flags byte, with a reserved bit set. The greeting
//! parser must agree with the whole-greeting check, and a first message
//! the reader returns must be one the framer's `message_complete` calls
//! whole.
//!
//! Then the reader, under small limits: it must never panic, never keep
//! more than the limits allow, and every message it returns must survive
//! being written and read back unchanged.
//!
//! Then the same bytes through a reader with a receive pool and limits
//! that let frames of 1 MiB and more through, so that declared sizes reach
//! the pool: ranges split, several moved into one mapping, fresh mappings
//! grown, all of it given back or unmapped when the input ends mid-frame.
//! The pool must stay within its cap, and a frame it serves must hold the
//! input's bytes.

use std::sync::{Arc, OnceLock};

use stowage_transport::Pages;
use stowage_transport::ReceivePool;
use stowage_transport::frame::{self, Decoded, FrameError, MAX_HEADER};
use stowage_transport::zmtp::{FrameReader, Incoming, Limits, write_message};

const LIMITS: Limits = Limits {
    max_message_bytes: 1 << 16,
    max_frames: 64,
};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
    })
}

/// Frames up to 8 MiB for the pooled reader.
const POOLED_LIMITS: Limits = Limits {
    max_message_bytes: 8 << 20,
    max_frames: 64,
};

/// A pool of 6 MiB, shared by every input of a run, topped up to a 3 MiB
/// and a 2 MiB range (resident: written once) whenever inputs drained it.
fn pool() -> &'static Arc<ReceivePool> {
    static POOL: OnceLock<Arc<ReceivePool>> = OnceLock::new();
    POOL.get_or_init(|| ReceivePool::new(6 << 20, std::time::Duration::from_secs(3600)))
}

/// The target's body: every invariant above, on one input.
pub fn check(data: &[u8]) {
    framer(data);
    plain(data);
    pooled(data);
}

fn pooled(data: &[u8]) {
    let pool = pool();
    if pool.pooled_bytes() < 5 << 20 {
        for mib in [3usize, 2] {
            let mut p = Pages::map(mib << 20).expect("a mapping");
            let n = p.capacity();
            p.spare().fill(0xa5);
            p.filled(n);
            pool.give(p);
        }
    }
    runtime().block_on(async {
        let mut reader = FrameReader::with_pool(data, Some(pool.clone()));
        loop {
            match reader.read(&POOLED_LIMITS).await {
                Ok(Some(Incoming::Message(frames))) => {
                    let total: usize = frames.iter().map(|f| f.len()).sum();
                    assert!(total as u64 <= POOLED_LIMITS.max_message_bytes);
                    // Whole frames come only from the input, which is far
                    // smaller than a pooled frame: each is in it.
                    for f in &frames {
                        assert!(
                            f.len() <= data.len(),
                            "a {}-byte frame from {} bytes",
                            f.len(),
                            data.len()
                        );
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
    });
    assert!(
        pool.pooled_bytes() <= 6 << 20,
        "{} bytes pooled",
        pool.pooled_bytes()
    );
}

/// Offsets of the input a header is parsed at.
const HEADER_OFFSETS: usize = 4096;

fn framer(data: &[u8]) {
    for at in 0..data.len().min(HEADER_OFFSETS) {
        let rest = &data[at..];
        match frame::parse_header(rest) {
            Ok(Decoded::Done(h)) => {
                assert!(h.header_len == 2 || h.header_len == MAX_HEADER, "{h:?}");
                let mut b = [0u8; MAX_HEADER];
                assert_eq!(h.encode(&mut b), &rest[..h.header_len], "written back");
                assert_eq!(
                    frame::parse_header(&rest[..h.header_len]),
                    Ok(Decoded::Done(h))
                );
                for cut in 0..h.header_len {
                    let want = if cut == 0 { 1 } else { h.header_len };
                    assert_eq!(
                        frame::parse_header(&rest[..cut]),
                        Ok(Decoded::Needs(want)),
                        "{h:?} cut at {cut}"
                    );
                }
            }
            Ok(Decoded::Needs(n)) => assert!(n > rest.len() && n <= MAX_HEADER, "needs {n}"),
            Err(FrameError::ReservedFlags(f)) => {
                assert_eq!(f, rest[0]);
                assert_ne!(
                    f & !(frame::FLAG_MORE | frame::FLAG_LONG | frame::FLAG_COMMAND),
                    0
                );
            }
            Err(e) => panic!("a header refused with {e}"),
        }
    }
    match frame::parse_greeting(data) {
        Ok(Decoded::Done(g)) => {
            assert_eq!(frame::check_greeting(&data[..frame::GREETING_LEN]), Ok(g));
            // Our own greeting for what was read reads back the same.
            let ours = frame::greeting_as(g.mechanism, g.as_server);
            assert_eq!(frame::check_greeting(&ours), Ok(g));
        }
        Ok(Decoded::Needs(n)) => assert!(n > data.len() && n <= frame::GREETING_LEN),
        Err(e) => {
            if let Some(g) = data.get(..frame::GREETING_LEN) {
                assert_eq!(frame::check_greeting(g), Err(e));
            }
        }
    }
    plain_commands(data);
    let whole = frame::message_complete(data);
    let first = runtime().block_on(FrameReader::new(data).read(&LIMITS));
    if matches!(
        first,
        Ok(Some(Incoming::Message(_) | Incoming::TooLarge { .. }))
    ) {
        assert!(
            whole,
            "a message read from bytes message_complete calls partial"
        );
    }
}

fn plain(data: &[u8]) {
    runtime().block_on(async {
        let mut reader = FrameReader::new(data);
        loop {
            match reader.read(&LIMITS).await {
                Ok(Some(Incoming::Message(frames))) => {
                    assert!(
                        frames.len() <= LIMITS.max_frames,
                        "{} frames kept",
                        frames.len()
                    );
                    let total: usize = frames.iter().map(|f| f.len()).sum();
                    assert!(
                        total as u64 <= LIMITS.max_message_bytes,
                        "{total} bytes kept"
                    );
                    let mut wire = Vec::new();
                    write_message(&mut wire, &frames)
                        .await
                        .expect("write to a Vec");
                    let mut again = FrameReader::new(&wire[..]);
                    match again.read(&LIMITS).await {
                        Ok(Some(Incoming::Message(back))) => assert_eq!(back, frames, "round trip"),
                        other => panic!("a written message reads back as {other:?}"),
                    }
                }
                Ok(Some(Incoming::TooLarge { head, .. })) => {
                    assert!(head.len() <= 1, "{} frames kept", head.len())
                }
                Ok(Some(Incoming::Command { .. })) => {}
                Ok(None) | Err(_) => break,
            }
        }
    });
}

/// PLAIN's HELLO and ERROR read from any bytes: a HELLO that parses is
/// written back byte for byte; an ERROR's reason never panics.
fn plain_commands(data: &[u8]) {
    if let Ok((username, password)) = frame::parse_hello(data) {
        let again = frame::hello_command(username, password);
        let Ok(Decoded::Done(h)) = frame::parse_header(&again) else {
            panic!("a HELLO frame without its header");
        };
        let (name, body) = frame::split_command(&again[h.header_len..]).expect("a command name");
        assert_eq!(name, b"HELLO");
        assert_eq!(body, data, "a parsed HELLO written back");
    }
    let reason = frame::error_reason(data);
    assert!(reason.len() <= 3 * data.len());
}
