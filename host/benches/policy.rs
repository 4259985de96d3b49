//! Decision time of the Wasm policy chain vs the native built-in (criterion):
//!
//! - `select/*`: one decision of 1, 1,000 and 100,000 positions, through the
//!   chain with the pure plugins' memo on (the default: a repeated decision
//!   is a memo hit) and off (every decision enters the plugin), against the
//!   built-in's plan plus the same validation the chain applies;
//! - `request/*`: the 40 (field, unit) pairs of the small put of issue 20
//!   (10 fields of float32 `[4, 16]` rows, 4 units, one row each) decided in
//!   one chain call (`select_many`), memo on and off, against the built-in
//!   for the 40 pairs, and against a chain of no plugins (the built-in
//!   through `Chain::select_many`, what a stowd with an empty plugin
//!   directory runs).
//!
//! Needs the plugins built: `cargo xtask plugins`, then
//! `cargo bench -p stowage-host --bench policy`.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use stowage_host::batch::Field;
use stowage_host::plan;
use stowage_host::policy::SelectRequest;
use stowage_host::policy::builtin::Builtin;
use stowage_host::policy::chain::{Chain, FailStrategy};
use stowage_host::policy::registry::Registry;
use stowage_host::policy::wasm::SandboxLimits;
use stowage_host::tensor::{Dtype, Tensor};

fn plugin_dir() -> PathBuf {
    std::env::var_os("STOWAGE_PLUGIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/plugins"))
}

const CHAIN: [&str; 4] = ["single-row", "constant-stride", "runs", "gather"];

fn chain(memo_entries: usize) -> Chain {
    let limits = SandboxLimits {
        memo_entries,
        ..SandboxLimits::default()
    };
    let mut reg = Registry::new(None, limits).unwrap();
    for name in CHAIN {
        let (p, _) = reg
            .load_file(&plugin_dir().join(format!("{name}.wasm")))
            .expect("run `cargo xtask plugins` first");
        reg.insert(Arc::new(p));
    }
    Chain::new(
        CHAIN.iter().map(|n| reg.get(n).unwrap().clone()).collect(),
        FailStrategy::Reject,
        0,
    )
}

fn f32_field(rows: u64, cols: u64) -> Field {
    Field::Regular(
        Tensor::contiguous(
            Bytes::from(vec![0u8; (rows * cols) as usize * 4]),
            Dtype::Float32,
            vec![rows, cols],
        )
        .unwrap(),
    )
}

fn builtin(field: &Field, positions: &[u64]) -> plan::SelectionPlan {
    let p = Builtin::plan(field, positions).unwrap();
    plan::validate_selection(field, positions, &p).unwrap();
    p
}

fn bench(c: &mut Criterion) {
    let memo = chain(256);
    let raw = chain(0);
    let rows = 400_000u64;
    let field = f32_field(rows, 1);
    let mut group = c.benchmark_group("select");
    for n in [1u64, 1_000, 100_000] {
        let positions: Vec<u64> = (0..n).map(|i| i * 4).collect();
        group.bench_with_input(BenchmarkId::new("wasm-memo", n), &positions, |b, p| {
            b.iter(|| memo.select(&field, p).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("wasm-call", n), &positions, |b, p| {
            b.iter(|| raw.select(&field, p).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("builtin", n), &positions, |b, p| {
            b.iter(|| builtin(&field, p))
        });
    }
    group.finish();

    // The small put: 10 fields x 4 units, one row per unit.
    let fields: Vec<Field> = (0..10).map(|_| f32_field(4, 16)).collect();
    let units: Vec<Vec<u64>> = (0..4u64).map(|u| vec![u]).collect();
    let requests: Vec<SelectRequest<'_>> = units
        .iter()
        .flat_map(|p| fields.iter().map(move |f| SelectRequest::new(f, p)))
        .collect();
    let mut group = c.benchmark_group("request");
    group.bench_function("wasm-memo/40", |b| {
        b.iter(|| memo.select_many(&requests).unwrap())
    });
    group.bench_function("wasm-call/40", |b| {
        b.iter(|| raw.select_many(&requests).unwrap())
    });
    // The chain with no plugin (what an empty plugin directory runs): the
    // built-in's plans through `Chain::select_many`, as a put asks them.
    let none = Chain::builtin();
    group.bench_function("chain-builtin/40", |b| {
        b.iter(|| none.select_many(&requests).unwrap())
    });
    group.bench_function("builtin/40", |b| {
        b.iter(|| {
            requests
                .iter()
                .map(|r| builtin(r.field, r.positions))
                .collect::<Vec<_>>()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
