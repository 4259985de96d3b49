//! The multi-frame input format of the decoder targets.
//!
//! Multi-frame input format (`tq_decode`, `native_decode`): the fuzz input
//! is a sequence of frames, each a little-endian `u32` length followed by
//! that many bytes. A length running past the end takes the rest of the
//! input; 1 to 3 trailing bytes too short for a length are one last frame.
//! So every input is some multipart message, and [`join_frames`] writes
//! a message back in this format (the seed corpora are made that way).

use bytes::Bytes;

/// Splits a fuzz input into frames (see the module docs).
pub fn split_frames(data: &[u8]) -> Vec<Bytes> {
    let all = Bytes::copy_from_slice(data);
    let mut frames = Vec::new();
    let mut pos = 0usize;
    while pos < all.len() {
        let Some(head) = all.get(pos..pos + 4) else {
            frames.push(all.slice(pos..));
            break;
        };
        let len = u32::from_le_bytes(head.try_into().expect("4 bytes")) as usize;
        let start = pos + 4;
        let end = start.saturating_add(len).min(all.len());
        frames.push(all.slice(start..end));
        pos = end;
    }
    frames
}

/// Writes frames in the input format [`split_frames`] reads.
pub fn join_frames<B: AsRef<[u8]>>(frames: &[B]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        let f = f.as_ref();
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}
