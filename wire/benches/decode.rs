//! Decode time against request size: TransferQueue PUTs and `stowage/1`
//! puts with 1k-100k one-row fields and 10k-1M one-element rows of one
//! regular field, decoded without limits (so every entry is decoded), and
//! the 100,000-field PUT refused by the default `max_fields` (1,024).
//! Prints a table: best time of several runs, and time per field or row;
//! linear decoding keeps the per-item column flat.
//!
//! `cargo bench -p stowage-wire --bench decode`

use std::time::{Duration, Instant};

use bytes::Bytes;
use stowage_wire::batch::{Field, Value};
use stowage_wire::native;
use stowage_wire::tensor::{Dtype, Tensor};
use stowage_wire::tq;

/// Best of at least 3 runs and at least 300 ms of runs.
fn best(mut run: impl FnMut()) -> Duration {
    let (mut best, mut spent, mut n) = (Duration::MAX, Duration::ZERO, 0);
    while n < 3 || spent < Duration::from_millis(300) {
        let t = Instant::now();
        run();
        let d = t.elapsed();
        best = best.min(d);
        spent += d;
        n += 1;
    }
    best
}

fn fields(n: usize) -> Vec<(String, Field)> {
    (0..n)
        .map(|i| (format!("f{i}"), Field::Values(vec![Value::Str("v".into())])))
        .collect()
}

fn rows(n: u64) -> Vec<(String, Field)> {
    let bytes: Vec<u8> = (0..n * 4).map(|i| i as u8).collect();
    let t = Tensor::contiguous(Bytes::from(bytes), Dtype::Float32, vec![n, 1]).expect("tensor");
    vec![("big".into(), Field::Regular(t))]
}

fn tq_frames(indexes: u64, fields: Vec<(String, Field)>) -> Vec<Bytes> {
    let request = tq::Request::Put {
        global_indexes: (0..indexes).collect(),
        fields,
    };
    tq::encode_request("TQ_STORAGE_bench", Some("unit"), &request).expect("encodable")
}

fn native_frames(indexes: u64, fields: Vec<(String, Field)>) -> Vec<Bytes> {
    let op = native::Op::Put {
        global_indexes: (0..indexes).collect(),
        fields: fields
            .iter()
            .map(|(n, f)| {
                (
                    n.as_str().into(),
                    native::WireField::from_field(f).expect("wire"),
                )
            })
            .collect(),
    };
    native::encode_request(&native::Request { id: 1, op }).expect("encodable")
}

/// A put of `n` regular fields of 4 rows of float32 `[16]`, every field's
/// rows in data frame 1, as the Python client sends a small put.
fn small_put_frames(n: usize) -> Vec<Bytes> {
    let rows = 4u64;
    let field_bytes = rows as usize * 64;
    let data = Bytes::from(vec![7u8; n * field_bytes]);
    let fields = (0..n)
        .map(|f| {
            let part = data.slice(f * field_bytes..(f + 1) * field_bytes);
            let parts = native::RegularParts::new(Dtype::Float32, vec![16], vec![(part, rows)])
                .expect("parts");
            (format!("f{f}").into(), native::WireField::Regular(parts))
        })
        .collect();
    let layout = native::FrameLayout {
        frames: vec![
            (0..n)
                .map(|field| native::RowSlice {
                    field,
                    start: 0,
                    end: rows,
                })
                .collect(),
        ],
    };
    let op = native::Op::Put {
        global_indexes: (0..rows).collect(),
        fields,
    };
    native::encode_request_with(&native::Request { id: 1, op }, &layout).expect("encodable")
}

fn row(what: &str, count: u64, per: &str, frame0: usize, d: Duration) {
    println!(
        "| {what} | {count} | {:.1} KiB | {:.3} ms | {:.1} ns/{per} |",
        frame0 as f64 / 1024.0,
        d.as_secs_f64() * 1e3,
        d.as_secs_f64() * 1e9 / count as f64
    );
}

fn main() {
    let open = native::Limits {
        max_rows: u64::MAX,
        max_fields: u64::MAX,
        ..native::Limits::DEFAULT
    };
    println!("| request | count | frame 0 | decode | per item |");
    println!("|---|---|---|---|---|");
    for n in [1_000, 10_000, 100_000] {
        let f = tq_frames(1, fields(n));
        let d = best(|| {
            tq::decode_message(&f).expect("decodes");
        });
        row("TQ PUT, one-row fields", n as u64, "field", f[0].len(), d);
    }
    for n in [1_000, 10_000, 100_000] {
        let f = native_frames(1, fields(n));
        let d = best(|| {
            native::decode_request(&f, &open).expect("decodes");
        });
        row(
            "native put, one-row fields",
            n as u64,
            "field",
            f[0].len(),
            d,
        );
    }
    for n in [1, 10, 32] {
        let f = small_put_frames(n);
        let d = best(|| {
            for _ in 0..1000 {
                native::decode_request(&f, &native::Limits::DEFAULT).expect("decodes");
            }
        }) / 1000;
        row(
            "native small put, 4-row float32[16] fields",
            n as u64,
            "field",
            f[0].len(),
            d,
        );
    }
    for n in [10_000, 100_000, 1_000_000] {
        let f = tq_frames(n, rows(n));
        let d = best(|| {
            tq::decode_message(&f).expect("decodes");
        });
        row("TQ PUT, one regular field", n, "row", f[0].len(), d);
    }
    for n in [10_000, 100_000, 1_000_000] {
        let f = native_frames(n, rows(n));
        let d = best(|| {
            native::decode_request(&f, &open).expect("decodes");
        });
        row("native put, one regular field", n, "row", f[0].len(), d);
    }
    let limits = tq::Limits {
        max_rows: 1 << 24,
        max_fields: 1024,
    };
    let f = tq_frames(1, fields(100_000));
    let d = best(|| {
        tq::decode_message_with(&f, &limits).expect_err("refused");
    });
    row(
        "TQ PUT refused by max_fields",
        100_000,
        "field",
        f[0].len(),
        d,
    );
    let f = native_frames(1, fields(100_000));
    let d = best(|| {
        native::decode_request(&f, &native::Limits::DEFAULT).expect_err("refused");
    });
    row(
        "native put refused by max_fields",
        100_000,
        "field",
        f[0].len(),
        d,
    );
}
