//! Per-row cost of a unit: put, get (and planning the reply's runs) and
//! clear of 131,072 rows of 512 B (float32 `[128]`) in one call each, the
//! "many small rows" shape. Reported per row (criterion's elements).
//!
//! `cargo bench -p stowage-host --bench unit`

use std::hint::black_box;

use bytes::Bytes;
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use stowage_host::batch::Field;
use stowage_host::extent::Received;
use stowage_host::store::{Column, Unit};
use stowage_host::tensor::{Dtype, Tensor};

const ROWS: u64 = 131_072;
const COLS: u64 = 128;

/// One received frame holding every row, and the put's global indexes.
fn frame() -> (Bytes, Vec<u64>) {
    let bytes = Bytes::from(vec![1u8; (ROWS * COLS * 4) as usize]);
    (bytes, (0..ROWS).collect())
}

fn columns(frame: &Bytes) -> Vec<stowage_host::store::PutField> {
    let t = Tensor::contiguous(frame.clone(), Dtype::Float32, vec![ROWS, COLS]).expect("shape");
    let received = Received::frames(std::slice::from_ref(frame));
    vec![(
        "x".into(),
        vec![Column::from_field(Field::Regular(t), &received)].into(),
    )]
}

fn filled(frame: &Bytes, g: &[u64]) -> Unit {
    let unit = Unit::new("bench", None);
    unit.put(g, columns(frame)).expect("put");
    unit
}

fn bench(c: &mut Criterion) {
    let (frame, g) = frame();
    let fields = vec!["x".to_string()];
    let mut group = c.benchmark_group("unit");
    group.throughput(Throughput::Elements(ROWS));
    group.sample_size(20);
    group.bench_function("put", |b| {
        b.iter_batched(
            || (Unit::new("bench", None), columns(&frame)),
            |(u, cols)| u.put(&g, cols).map(|_| u),
            BatchSize::PerIteration,
        )
    });
    group.bench_function("overwrite", |b| {
        b.iter_batched(
            || (filled(&frame, &g), columns(&frame)),
            |(u, cols)| u.put(&g, cols).map(|_| u),
            BatchSize::PerIteration,
        )
    });
    let unit = filled(&frame, &g);
    group.bench_function("get", |b| {
        b.iter(|| black_box(unit.get(&g, &fields).expect("get")))
    });
    group.bench_function("get+runs", |b| {
        b.iter(|| {
            let rows = unit.get(&g, &fields).expect("get");
            black_box(rows[0].runs())
        })
    });
    group.bench_function("clear", |b| {
        b.iter_batched(
            || filled(&frame, &g),
            |u| (u.clear(&g, None), u),
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
