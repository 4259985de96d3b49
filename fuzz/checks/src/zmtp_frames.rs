//! The ZMTP frame reader on arbitrary bytes from a peer (after the
//! handshake), under small limits: it must never panic, never keep more
//! than the limits allow, and every message it returns must survive being
//! written and read back unchanged.

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

/// The target's body: every invariant above, on one input.
pub fn check(data: &[u8]) {
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
