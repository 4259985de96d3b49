//! The bodies of the fuzz targets in `fuzz/`, with every invariant they
//! check, on stable and without libFuzzer: the cargo-fuzz targets
//! (`fuzz/fuzz_targets/*.rs`) are one-line calls into this crate, and the
//! integration tests (`tests/tests/fuzz_corpora.rs`) run every committed
//! corpus and regression input (`fuzz/corpus/T`, `fuzz/regressions/T`)
//! through the same functions on each `cargo xtask test`.
//!
//! | module | target | input |
//! |---|---|---|
//! | [`tq_decode`] | TransferQueue 0.1.11 request and reply decoders | frames |
//! | [`native_decode`] | `stowage/1` request and reply decoders, the descriptor channel's messages | frames |
//! | [`plan_validate`] | selection and frame plans, validated and executed | `arbitrary` |
//! | [`zmtp_frames`] | the ZMTP framer (headers, greeting) and the frame reader | a byte stream |
//! | [`checkpoint_file`] | unit checkpoint files (both readers, the writer) and manifests | a file |
//! | [`plain_handshake`] | the server side of the ZMTP PLAIN handshake, sans-IO and the real one | a byte stream |
//! | [`curve_handshake`] | CurveZMQ: both handshakes fed changed, replayed and garbage messages, the MESSAGE decrypter | a mode byte, its parameters |
//! | [`frames`] | the multi-frame input format ([`split_frames`], [`join_frames`]) | |
//!
//! A check fails by panicking, as libFuzzer expects.

pub mod checkpoint_file;
pub mod curve_handshake;
pub mod frames;
pub mod native_decode;
pub mod plain_handshake;
pub mod plan_validate;
pub mod tq_decode;
pub mod zmtp_frames;

pub use frames::{join_frames, split_frames};

/// A fuzz target's body on raw bytes: panics on a broken invariant.
pub type Check = fn(&[u8]);

/// Every target by name (the directory names under `fuzz/corpus` and
/// `fuzz/regressions`) with its body on raw bytes.
pub const TARGETS: &[(&str, Check)] = &[
    ("tq_decode", tq_decode::check),
    ("native_decode", native_decode::check),
    ("plan_validate", plan_validate::check),
    ("zmtp_frames", zmtp_frames::check),
    ("checkpoint_file", checkpoint_file::check),
    ("plain_handshake", plain_handshake::check),
    ("curve_handshake", curve_handshake::check),
];
