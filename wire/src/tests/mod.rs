//! Tests of the wire modules: golden TransferQueue 0.1.11 frames, bad
//! inputs, and pickle vectors produced by CPython.

mod bad_input;
mod dtypes;
mod fixtures;
mod pickle_vectors;
mod values;

use std::path::{Path, PathBuf};

use bytes::Bytes;

use crate::msgpack::{Reader, Writer};
use crate::pickle::{self, PValue};

/// Where the golden frames live: `$STOWAGE_FIXTURES` if set, else
/// `../../shared/fixtures/transferqueue-0.1.11` relative to this crate's
/// `wire/` folder: the `shared/` that sits beside the repository.
pub(super) fn fixtures_dir() -> PathBuf {
    match std::env::var_os("STOWAGE_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/transferqueue-0.1.11")
        }
    }
}

/// All frames of fixture message `name` (`NAME.frameK.bin`, K = 0, 1, ...).
pub(super) fn load(name: &str) -> Vec<Bytes> {
    let dir = fixtures_dir();
    let mut frames = Vec::new();
    loop {
        let path = dir.join(format!("{name}.frame{}.bin", frames.len()));
        match std::fs::read(&path) {
            Ok(b) => frames.push(Bytes::from(b)),
            Err(_) if !frames.is_empty() => return frames,
            Err(e) => panic!("cannot read fixture {}: {e}", path.display()),
        }
    }
}

/// Every ext value in frame 0 as (code, payload), in order.
pub(super) fn exts(frame0: &Bytes) -> Vec<(i8, Vec<u8>)> {
    let mut out = Vec::new();
    let mut r = Reader::bytes(frame0, 0);
    r.visit(crate::msgpack::TQ_MAX_DEPTH, &mut |code, data: &[u8], _| {
        out.push((code, data.to_vec()));
        Ok::<(), crate::msgpack::MsgpackError>(())
    })
    .unwrap();
    out
}

/// FNV-1a 64 of `b` (to compare long outputs with CPython's).
pub(super) fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Builds frame 0 from a request type and an already-encoded body, with a
/// fixed sender, receiver, id and time.
pub(super) fn frame0(request_type: &str, body: &[u8]) -> Bytes {
    let mut w = Writer::new();
    w.map(6);
    for (k, v) in [
        ("request_type", request_type),
        ("sender_id", "TQ_STORAGE_test"),
        ("receiver_id", "U"),
    ] {
        w.str(k);
        w.str(v);
    }
    w.str("request_id");
    w.str("0123abcd");
    w.str("timestamp");
    w.f64(1.5);
    w.str("body");
    w.raw(body);
    w.into_bytes()
}

/// Ext 3 bytes for `(dtype, shape, index)`; dims may be anything a pickle can hold.
pub(super) fn ext3(dtype: &str, shape: &[i128], index: i128) -> Vec<u8> {
    let meta = PValue::Tuple(vec![
        PValue::Str(dtype.into()),
        PValue::Tuple(shape.iter().map(|&d| PValue::Int(d)).collect()),
        PValue::Int(index),
    ]);
    ext(3, &pickle::dumps(&meta))
}

/// Any ext value.
pub(super) fn ext(code: i8, payload: &[u8]) -> Vec<u8> {
    let mut w = Writer::new();
    w.ext(code, payload);
    w.into_bytes().to_vec()
}

/// A PUT body `{global_indexes, data: {name: raw value}, data_parser: nil}`.
pub(super) fn put_body(indexes: &[u64], fields: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut w = Writer::new();
    w.map(3);
    w.str("global_indexes");
    w.array(indexes.len());
    indexes.iter().for_each(|&i| w.uint(i));
    w.str("data");
    w.map(fields.len());
    for (name, raw) in fields {
        w.str(name);
        w.raw(raw);
    }
    w.str("data_parser");
    w.nil();
    w.into_bytes().to_vec()
}

/// `len` bytes of f32 zeros as a frame.
pub(super) fn zeros(len: usize) -> Bytes {
    Bytes::from(vec![0u8; len])
}
