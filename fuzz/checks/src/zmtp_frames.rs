//! The ZMTP frame reader on arbitrary bytes from a peer (after the
//! handshake), under small limits: it must never panic, never keep more
//! than the limits allow, and every message it returns must survive being
//! written and read back unchanged.
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
