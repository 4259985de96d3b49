//! Decision time of the Wasm policy chain vs the native built-in, for 1,
//! 1,000 and 100,000 positions (criterion). Needs the plugins built:
//! `cargo xtask plugins`, then `cargo bench -p stowage-host --bench policy`.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use stowage_host::batch::Field;
use stowage_host::policy::builtin::Builtin;
use stowage_host::policy::chain::{Chain, FailStrategy};
use stowage_host::policy::registry::Registry;
use stowage_host::policy::wasm::SandboxLimits;
use stowage_host::tensor::{DType, Tensor};

fn plugin_dir() -> PathBuf {
    std::env::var_os("STOWAGE_PLUGIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/plugins"))
}

fn bench(c: &mut Criterion) {
    let mut reg = Registry::new(None, SandboxLimits::default()).unwrap();
    for name in ["single-row", "constant-stride", "runs", "gather"] {
        let (p, _) = reg
            .load_file(&plugin_dir().join(format!("{name}.wasm")))
            .expect("run `cargo xtask plugins` first");
        reg.insert(Arc::new(p));
    }
    let chain = Chain::new(
        ["single-row", "constant-stride", "runs", "gather"]
            .iter()
            .map(|n| reg.get(n).unwrap().clone())
            .collect(),
        FailStrategy::Reject,
        0,
    );
    let rows = 400_000u64;
    let field = Field::Regular(
        Tensor::contiguous(
            Bytes::from(vec![0u8; rows as usize * 4]),
            DType::F32,
            vec![rows, 1],
        )
        .unwrap(),
    );
    let mut group = c.benchmark_group("select");
    for n in [1u64, 1_000, 100_000] {
        let positions: Vec<u64> = (0..n).map(|i| i * 4).collect();
        group.bench_with_input(BenchmarkId::new("wasm-chain", n), &positions, |b, p| {
            b.iter(|| chain.select(&field, p).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("builtin", n), &positions, |b, p| {
            b.iter(|| Builtin::plan(&field, p).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
