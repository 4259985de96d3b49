//! The policy path end to end with real `.wasm` components: seed plugins
//! against the built-in, hostile plugins contained, zero copy proven with a
//! counting allocator, the contract check and the compile cache.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::Bytes;
use stowage_host::batch::{Field, Value};
use stowage_host::plan::{self, PackLimits, PieceInfo, Selected};
use stowage_host::policy::builtin::Builtin;
use stowage_host::policy::chain::{Chain, ChainError, DecidedBy, FailStrategy, Loaded};
use stowage_host::policy::registry::{ChainConfig, Registry};
use stowage_host::policy::wasm::{self, SandboxLimits};
use stowage_host::policy::{Fault, Policy, PolicyError};
use stowage_host::tensor::{Dtype, Tensor};
use stowage_tests::{hostile, plugin, plugin_dir, shared_cache, temp_dir};

// ---------------------------------------------------------------------------
// A counting allocator: per-thread bytes and calls, so that concurrent tests
// do not disturb each other's counts.

struct Counting;

thread_local! {
    static ALLOCS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    static SIZES: Cell<[u64; 8]> = const { Cell::new([0; 8]) };
}

// SAFETY: forwards to the system allocator; the bookkeeping touches only
// const-initialised thread-locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| {
            let (n, b) = c.get();
            c.set((n + 1, b + layout.size() as u64));
        });
        let _ = SIZES.try_with(|s| {
            let mut v = s.get();
            v.rotate_right(1);
            v[0] = layout.size() as u64;
            s.set(v);
        });
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` and returns (its result, allocations made, bytes allocated,
/// sizes of the last 8 allocations) on this thread.
fn counted<R>(f: impl FnOnce() -> R) -> (R, u64, u64, [u64; 8]) {
    let before = ALLOCS.with(|c| c.get());
    SIZES.with(|s| s.set([0; 8]));
    let r = f();
    let after = ALLOCS.with(|c| c.get());
    (
        r,
        after.0 - before.0,
        after.1 - before.1,
        SIZES.with(|s| s.get()),
    )
}

// ---------------------------------------------------------------------------
// Fixtures.

fn regular(rows: u64, cols: u64) -> Field {
    let data: Vec<u8> = (0..rows * cols)
        .flat_map(|v| (v as f32).to_le_bytes())
        .collect();
    Field::Regular(Tensor::contiguous(Bytes::from(data), Dtype::Float32, vec![rows, cols]).unwrap())
}

/// Row i = arange(i + 1) as int64, like TransferQueue's jagged test field.
fn nested(rows: u64) -> Field {
    Field::Nested(
        (0..rows)
            .map(|i| {
                let data: Vec<u8> = (0..=i as i64).flat_map(|v| v.to_le_bytes()).collect();
                Tensor::contiguous(Bytes::from(data), Dtype::Int64, vec![i + 1]).unwrap()
            })
            .collect(),
    )
}

fn values(rows: u64) -> Field {
    Field::Values((0..rows).map(|i| Value::Str(format!("s{i}"))).collect())
}

/// The selected rows, as bytes per row (what a unit would store).
fn rows_of(selected: &[Selected]) -> Vec<Bytes> {
    let mut out = Vec::new();
    for s in selected {
        match s {
            Selected::Rows(t) => out.extend((0..t.rows()).map(|i| t.row(i).unwrap())),
            Selected::NestedRows(r) | Selected::Packed { rows: r, .. } => {
                out.extend(r.iter().map(|t| t.contiguous_bytes()))
            }
            Selected::Values(v) => out.extend(v.iter().map(|v| match v {
                Value::Str(s) => Bytes::from(s.clone()),
                Value::Bytes(b) | Value::Msgpack(b) => b.clone(),
            })),
        }
    }
    out
}

fn builtin_rows(field: &Field, positions: &[u64]) -> Vec<Bytes> {
    let plan = Builtin::plan(field, positions).unwrap();
    rows_of(&plan::execute_selection(field, &plan).unwrap())
}

fn registry_with(paths: &[std::path::PathBuf]) -> Registry {
    let mut reg = Registry::new(Some(shared_cache()), SandboxLimits::default()).unwrap();
    for p in paths {
        let (policy, _) = reg.load_file(p).unwrap_or_else(|e| panic!("{e}"));
        reg.insert(Arc::new(policy));
    }
    reg
}

fn chain_of(reg: &Registry, names: &[&str], fail: FailStrategy) -> Chain {
    let loaded: Vec<Loaded> = names
        .iter()
        .map(|n| {
            reg.get(n)
                .unwrap_or_else(|| panic!("{n} not loaded"))
                .clone()
        })
        .collect();
    Chain::new(loaded, fail, 0)
}

const SEED: [&str; 7] = [
    "single-row",
    "constant-stride",
    "gather",
    "nested-rows",
    "nested-pack",
    "runs",
    "coalesce",
];

fn seed_registry() -> Registry {
    let paths: Vec<_> = SEED.iter().map(|n| plugin(n)).collect();
    registry_with(&paths)
}

// ---------------------------------------------------------------------------
// TransferQueue's TestSelectByPositions cases through every real chain.

#[test]
fn seed_cases_give_the_builtin_rows_through_every_plugin_chain() {
    let reg = seed_registry();
    let reg_field = regular(4, 2);
    let nested_field = nested(4);
    let cases: Vec<(&Field, Vec<u64>)> = vec![
        (&reg_field, vec![1]),
        (&reg_field, vec![0, 2]),
        (&reg_field, vec![0, 2, 3]),
        (&reg_field, vec![3, 1, 0]),
        (&reg_field, vec![2, 1, 0]),
        (&nested_field, vec![1]),
        (&nested_field, vec![0, 2]),
    ];
    let chains: Vec<Vec<&str>> = vec![
        vec!["single-row"],
        vec!["constant-stride"],
        vec!["gather"],
        vec!["runs"],
        vec!["nested-rows"],
        vec!["nested-pack"],
        vec![
            "single-row",
            "constant-stride",
            "runs",
            "nested-pack",
            "gather",
            "nested-rows",
        ],
    ];
    for names in &chains {
        let chain = chain_of(&reg, names, FailStrategy::Reject);
        for (field, positions) in &cases {
            let decision = chain
                .select(field, positions)
                .unwrap_or_else(|e| panic!("{names:?} {positions:?}: {e}"));
            assert!(
                !matches!(decision.by, DecidedBy::Fallback { .. }),
                "{names:?} faulted on {positions:?}"
            );
            let got = rows_of(&plan::execute_selection(field, &decision.plan).unwrap());
            assert_eq!(
                got,
                builtin_rows(field, positions),
                "chain {names:?} positions {positions:?}"
            );
        }
        // Empty positions are an error, whatever the chain.
        assert_eq!(
            chain.select(&reg_field, &[]).unwrap_err(),
            ChainError::EmptyPositions
        );
    }
}

#[test]
fn a_plugin_is_not_asked_about_a_kind_its_describe_does_not_list() {
    let reg = seed_registry();
    // nested-rows lists nested and values; single-row lists regular.
    let chain = chain_of(&reg, &["nested-rows", "single-row"], FailStrategy::Reject);
    let decided = chain.select(&regular(40, 2), &[7]).unwrap();
    assert_eq!(decided.by, DecidedBy::Plugin("single-row".into()));
    let stats = |n: &str| reg.get(n).unwrap().stats.calls.load(Ordering::Relaxed);
    assert_eq!(
        stats("nested-rows"),
        0,
        "a plugin was asked about a kind it does not list"
    );
    assert_eq!(stats("single-row"), 1);
    // A nested field: nested-rows is asked (and answers), single-row is not.
    let decided = chain.select(&nested(40), &[3, 9]).unwrap();
    assert_eq!(decided.by, DecidedBy::Plugin("nested-rows".into()));
    assert_eq!(stats("nested-rows"), 1);
    assert_eq!(stats("single-row"), 1);
}

#[test]
fn each_seed_plugin_decides_what_it_is_for() {
    let reg = seed_registry();
    let r = regular(400, 2);
    let decide = |name: &str, field: &Field, positions: &[u64]| {
        reg.get(name).unwrap().policy.select(field, positions)
    };
    use stowage_host::plan::{Piece, RowView};
    assert_eq!(
        decide("single-row", &r, &[7]).unwrap().pieces,
        vec![Piece::View(RowView {
            start: 7,
            step: 1,
            count: 1
        })]
    );
    assert_eq!(
        decide("constant-stride", &r, &[1, 5, 9]).unwrap().pieces,
        vec![Piece::View(RowView {
            start: 1,
            step: 4,
            count: 3
        })]
    );
    assert_eq!(
        decide("gather", &r, &[3, 1]).unwrap().pieces,
        vec![Piece::Gather(vec![3, 1])]
    );
    let runs: Vec<u64> = (0..100).chain(200..300).collect();
    assert_eq!(
        decide("runs", &r, &runs).unwrap().pieces,
        vec![
            Piece::View(RowView {
                start: 0,
                step: 1,
                count: 100
            }),
            Piece::View(RowView {
                start: 200,
                step: 1,
                count: 100
            })
        ]
    );
    assert_eq!(
        decide("nested-pack", &nested(3), &[2, 0]).unwrap().pieces,
        vec![Piece::Concat(vec![2, 0])]
    );
    assert_eq!(
        decide("nested-rows", &values(3), &[2, 0]).unwrap().pieces,
        vec![Piece::RowViews(vec![2, 0])]
    );
    // Not applicable is an answer, not a fault.
    assert!(decide("constant-stride", &r, &[3, 1]).is_err());
    assert!(decide("single-row", &nested(3), &[1]).is_err());

    // Packing: small pieces share a frame, a large one goes alone, budget kept.
    let mut pieces = vec![
        PieceInfo {
            byte_len: 100,
            contiguous: true
        };
        50
    ];
    pieces.push(PieceInfo {
        byte_len: 1 << 20,
        contiguous: true,
    });
    let limits = PackLimits {
        max_frames: 4,
        max_frame_bytes: 1 << 20,
        small_threshold: 4096,
    };
    let frames = reg
        .get("coalesce")
        .unwrap()
        .policy
        .pack(&pieces, &limits)
        .unwrap();
    plan::validate_frames(&pieces, &limits, &frames).unwrap();
    assert_eq!(frames.frames.len(), 2, "{frames:?}");
    assert!(frames.frames.contains(&plan::Frame::Single(50)));
}

// ---------------------------------------------------------------------------
// Hostile plugins: the host survives, the result is the built-in one, the
// fault is counted.

fn assert_contained(name: &str, field: &Field, positions: &[u64]) {
    let reg = registry_with(&[hostile(name)]);
    let loaded = reg.names();
    assert_eq!(loaded.len(), 1, "{name} did not load");
    let chain = chain_of(&reg, &[loaded[0].as_str()], FailStrategy::Fallback);
    let stats = chain.policies[0].stats.clone();
    for round in 1..=2u64 {
        let start = Instant::now();
        let decision = chain.select(field, positions).unwrap();
        assert!(
            start.elapsed().as_secs() < 10,
            "{name} took {:?}",
            start.elapsed()
        );
        assert!(
            matches!(decision.by, DecidedBy::Fallback { .. }),
            "{name} round {round}: {:?}",
            decision.by
        );
        let got = rows_of(&plan::execute_selection(field, &decision.plan).unwrap());
        assert_eq!(got, builtin_rows(field, positions), "{name}");
        assert_eq!(
            stats.faults.load(Ordering::Relaxed),
            round,
            "{name} fault count"
        );
    }
    // With `reject` the request fails, naming the plugin.
    let chain = chain_of(&reg, &[loaded[0].as_str()], FailStrategy::Reject);
    match chain.select(field, positions) {
        Err(ChainError::Rejected { plugin, .. }) => assert_eq!(plugin, loaded[0]),
        other => panic!("{name}: expected a rejection, got {other:?}"),
    }
}

#[test]
fn hostile_trap_is_contained() {
    assert_contained("trap", &regular(8, 2), &[0, 2, 4]);
}

#[test]
fn hostile_infinite_loop_runs_out_of_fuel() {
    assert_contained("infinite-loop", &regular(8, 2), &[0, 2, 4]);
}

#[test]
fn hostile_memory_bomb_hits_the_cap() {
    assert_contained("memory-bomb", &regular(8, 2), &[0, 2, 4]);
}

#[test]
fn hostile_out_of_bounds_view_is_refused() {
    assert_contained("oob-view", &regular(8, 2), &[0, 2, 4]);
}

#[test]
fn hostile_dropped_row_is_refused() {
    assert_contained("drop-row", &regular(8, 2), &[0, 2, 4]);
}

#[test]
fn hostile_duplicated_row_is_refused() {
    assert_contained("dup-row", &regular(8, 2), &[0, 2, 4]);
}

#[test]
fn hostile_reordered_rows_are_refused() {
    assert_contained("reorder", &regular(8, 2), &[0, 2, 4]);
}

#[test]
fn hostile_absurd_plan_is_refused() {
    assert_contained("frame-bomb", &regular(8, 2), &[0, 2, 4]);
}

#[test]
fn hostile_absurd_frame_count_is_refused() {
    let reg = registry_with(&[hostile("frame-bomb")]);
    let name = reg.names().remove(0);
    let chain = chain_of(&reg, &[name.as_str()], FailStrategy::Fallback);
    let pieces = vec![
        PieceInfo {
            byte_len: 10,
            contiguous: true
        };
        100
    ];
    let limits = PackLimits {
        max_frames: 4,
        max_frame_bytes: 1 << 20,
        small_threshold: 0,
    };
    let decision = chain.pack(&pieces, &limits).unwrap();
    assert!(matches!(decision.by, DecidedBy::Fallback { .. }));
    plan::validate_frames(&pieces, &limits, &decision.plan).unwrap();
    assert_eq!(decision.plan, Builtin::frames(&pieces, &limits).unwrap());
    assert_eq!(chain.policies[0].stats.faults.load(Ordering::Relaxed), 1);
}

#[test]
fn hostile_forged_handle_traps_and_is_contained() {
    // The plugin keeps the handle of one call and uses it in the next (or
    // invents one): every call after the first faults.
    let reg = registry_with(&[hostile("forged-handle")]);
    let name = reg.names().remove(0);
    let chain = chain_of(&reg, &[name.as_str()], FailStrategy::Fallback);
    let field = regular(8, 2);
    let mut fallbacks = 0;
    for _ in 0..3 {
        let d = chain.select(&field, &[1, 3]).unwrap();
        assert_eq!(
            rows_of(&plan::execute_selection(&field, &d.plan).unwrap()),
            builtin_rows(&field, &[1, 3])
        );
        if matches!(d.by, DecidedBy::Fallback { .. }) {
            fallbacks += 1;
        }
    }
    assert!(
        fallbacks >= 2,
        "a stale handle was accepted ({fallbacks} fallbacks)"
    );
    assert_eq!(
        chain.policies[0].stats.faults.load(Ordering::Relaxed),
        fallbacks
    );
}

#[test]
fn a_plugin_is_disabled_after_max_faults() {
    let reg = registry_with(&[hostile("trap")]);
    let name = reg.names().remove(0);
    let loaded = reg.get(&name).unwrap().clone();
    let chain = Chain::new(vec![loaded.clone()], FailStrategy::Fallback, 3);
    for _ in 0..10 {
        chain.select(&regular(4, 2), &[0, 1]).unwrap();
    }
    assert_eq!(loaded.stats.faults.load(Ordering::Relaxed), 3);
    assert_eq!(loaded.stats.calls.load(Ordering::Relaxed), 3);
    assert!(loaded.stats.disabled.load(Ordering::Relaxed));
    // Disabled: the built-in answers, not as a fallback.
    assert_eq!(
        chain.select(&regular(4, 2), &[0, 1]).unwrap().by,
        DecidedBy::Builtin
    );
}

// ---------------------------------------------------------------------------
// Zero copy, proven.

#[test]
fn constant_stride_and_runs_allocate_no_buffer_and_point_into_the_original() {
    let reg = seed_registry();
    let field = regular(1 << 14, 16); // 1 MiB of float32
    let Field::Regular(original) = &field else {
        unreachable!()
    };
    let base = original.buffer().as_ptr() as usize;
    let end = base + original.byte_len();
    let strided: Vec<u64> = (0..1 << 14).step_by(4).collect();
    let runs: Vec<u64> = (0..1000).chain(5000..6000).chain(9000..9100).collect();
    for (name, positions) in [("constant-stride", &strided), ("runs", &runs)] {
        let chain = chain_of(&reg, &[name], FailStrategy::Reject);
        let decision = chain.select(&field, positions).unwrap();
        assert_eq!(decision.by, DecidedBy::Plugin(name.into()));
        let (selected, allocs, bytes, _) =
            counted(|| plan::execute_selection(&field, &decision.plan).unwrap());
        assert!(
            bytes < 1024,
            "{name}: the data path allocated {bytes} bytes in {allocs} allocations"
        );
        for s in &selected {
            let Selected::Rows(t) = s else {
                panic!("{name}: not a view")
            };
            let p = t.buffer().as_ptr() as usize;
            assert!(
                p >= base && p + t.byte_len() <= end,
                "{name}: piece outside the original allocation"
            );
        }
        assert_eq!(rows_of(&selected), builtin_rows(&field, positions));
    }
}

#[test]
fn gather_allocates_exactly_the_selected_bytes_once() {
    let reg = seed_registry();
    let field = regular(1 << 14, 16);
    let positions: Vec<u64> = (0..1 << 14).rev().step_by(3).collect();
    let selected_bytes = positions.len() as u64 * 16 * 4;
    let chain = chain_of(&reg, &["gather"], FailStrategy::Reject);
    let decision = chain.select(&field, &positions).unwrap();
    let (selected, _allocs, bytes, sizes) =
        counted(|| plan::execute_selection(&field, &decision.plan).unwrap());
    let big = sizes.iter().filter(|s| **s >= selected_bytes).count();
    assert_eq!(
        big, 1,
        "expected one allocation of {selected_bytes} bytes, saw sizes {sizes:?}"
    );
    assert!(
        bytes < selected_bytes + 1024,
        "allocated {bytes} bytes for {selected_bytes} selected"
    );
    assert_eq!(rows_of(&selected), builtin_rows(&field, &positions));
}

// ---------------------------------------------------------------------------
// Loading: the contract is checked before compiling; the cache is reused.

#[test]
fn contract_versions_are_checked_before_compiling() {
    let bytes = std::fs::read(plugin("gather")).unwrap();
    assert_eq!(wasm::check_contract(&bytes).unwrap(), "0.2.0");
    let old = std::fs::read(stowage_tests::plugin_v0_1("runs")).unwrap();
    assert_eq!(wasm::check_contract(&old).unwrap(), "0.1.0");
    // Same plugin claiming contract 0.3.0 (same length, so still valid Wasm).
    let claim = |bytes: &[u8], from: &[u8], to: &[u8; 5]| {
        let mut out = bytes.to_vec();
        let mut hits = 0;
        for i in 0..out.len().saturating_sub(from.len()) {
            if &out[i..i + from.len()] == from {
                out[i + from.len() - 5..i + from.len()].copy_from_slice(to);
                hits += 1;
            }
        }
        assert!(hits > 0);
        out
    };
    let future = claim(&bytes, b"stowage:policy/selection@0.2.0", b"0.3.0");
    let err = wasm::check_contract(&future).unwrap_err().to_string();
    assert!(
        err.contains("0.3.0") && err.contains("0.1.x and 0.2.x"),
        "{err}"
    );
    // One interface of 0.1.0 among 0.2.0 ones: refused too.
    let mixed = claim(&bytes, b"stowage:policy/packing@0.2.0", b"0.1.0");
    let err = wasm::check_contract(&mixed).unwrap_err().to_string();
    assert!(err.contains("0.1.0"), "{err}");
    let dir = temp_dir("contract");
    std::fs::write(dir.join("future.wasm"), &future).unwrap();
    std::fs::write(dir.join("junk.wasm"), b"\0asm\x01\0\0\0").unwrap();
    std::fs::write(dir.join("text.wasm"), b"hello").unwrap();
    std::fs::copy(plugin("gather"), dir.join("gather.wasm")).unwrap();
    let mut reg = Registry::new(None, SandboxLimits::default()).unwrap();
    let reports = reg.load_dir(&dir).unwrap();
    assert_eq!(reports.len(), 4);
    assert_eq!(
        reg.names(),
        vec!["gather".to_string()],
        "only the good plugin loads: {reports:?}"
    );
    let refused: Vec<_> = reports
        .iter()
        .filter_map(|r| r.result.as_ref().err())
        .collect();
    use wasm::{ContractError, LoadError};
    assert!(
        refused.iter().any(|e| matches!(
            e,
            LoadError::Contract {
                reason: ContractError::CoreModule,
                ..
            }
        )),
        "{refused:?}"
    );
    assert!(
        refused.iter().any(|e| matches!(
            e,
            LoadError::Contract { reason: ContractError::Version { version, .. }, .. } if version == "0.3.0"
        )),
        "{refused:?}"
    );
}

#[test]
fn compiled_components_are_cached_and_reused() {
    // A directory stowd creates (0700): a 0755 one under the sticky /tmp is refused.
    let cache = temp_dir("cache").join("c");
    let entries = || {
        std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
            .collect::<Vec<_>>()
    };
    let load = || {
        let mut reg = Registry::new(Some(cache.clone()), SandboxLimits::default()).unwrap();
        let reports = reg.load_dir(&plugin_dir()).unwrap();
        reg.configure(&stowage_host::policy::registry::default_chains());
        (reg, reports)
    };
    let (_, first) = load();
    assert!(
        first.iter().all(|r| r.result.is_ok() && !r.from_cache),
        "{first:?}"
    );
    assert_eq!(entries().len(), SEED.len());
    let (reg, second) = load();
    assert!(
        second.iter().all(|r| r.result.is_ok() && r.from_cache),
        "{second:?}"
    );
    // A corrupt cache entry is recompiled, not trusted; the intact ones
    // are still used (one corrupt entry: every compile costs seconds in a
    // debug build).
    std::fs::write(&entries()[0], b"garbage").unwrap();
    let (_, third) = load();
    assert!(third.iter().all(|r| r.result.is_ok()), "{third:?}");
    assert_eq!(
        third.iter().filter(|r| !r.from_cache).count(),
        1,
        "{third:?}"
    );
    // ... and written back whole.
    let (_, fourth) = load();
    assert!(
        fourth.iter().all(|r| r.result.is_ok() && r.from_cache),
        "{fourth:?}"
    );
    // Chains by pattern: the default chain uses the plugins.
    let d = reg
        .select_chain("responses")
        .select(&regular(8, 2), &[0, 2, 4])
        .unwrap();
    assert_eq!(d.by, DecidedBy::Plugin("constant-stride".into()));
}

#[test]
fn chains_are_chosen_by_field_pattern() {
    let mut reg = seed_registry();
    reg.configure(&[
        ChainConfig {
            pattern: "prompt*".into(),
            select: vec!["gather".into()],
            pack: vec![],
            fail: FailStrategy::Reject,
            max_faults: 0,
            ..ChainConfig::default()
        },
        ChainConfig {
            pattern: "*".into(),
            select: vec!["runs".into()],
            pack: vec!["coalesce".into()],
            fail: FailStrategy::Fallback,
            max_faults: 5,
            ..ChainConfig::default()
        },
    ]);
    let f = regular(8, 2);
    assert_eq!(
        reg.select_chain("prompts").select(&f, &[0, 2]).unwrap().by,
        DecidedBy::Plugin("gather".into())
    );
    assert_eq!(
        reg.select_chain("responses")
            .select(&f, &[0, 2])
            .unwrap()
            .by,
        DecidedBy::Plugin("runs".into())
    );
    assert_eq!(reg.pack_chain("prompts").names(), Vec::<String>::new());
    assert_eq!(reg.pack_chain("x").names(), vec!["coalesce".to_string()]);
}

#[test]
fn wasm_policies_are_safe_to_call_from_many_threads() {
    let reg = seed_registry();
    let chain = chain_of(&reg, &["runs", "gather"], FailStrategy::Reject);
    let field = regular(64, 4);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (chain, field) = (&chain, &field);
            s.spawn(move || {
                for i in 0..200u64 {
                    let positions: Vec<u64> = (0..64).filter(|p| (p + t + i) % 3 != 0).collect();
                    let d = chain.select(field, &positions).unwrap();
                    assert_eq!(
                        rows_of(&plan::execute_selection(field, &d.plan).unwrap()),
                        builtin_rows(field, &positions)
                    );
                }
            });
        }
    });
}

// ---------------------------------------------------------------------------
// Where a call runs.

/// On a tokio worker a plugin is entered right there (no handoff to another
/// thread); a guest whose WASI call needs tokio (`trap` writes its panic
/// message to stderr) is entered again off the runtime, from then on, and
/// its fault still carries what it wrote.
#[test]
fn plugins_are_entered_on_the_worker_and_one_writing_stderr_is_retried_off_it() {
    let reg = Registry::new(Some(shared_cache()), SandboxLimits::default()).unwrap();
    let runs = Arc::new(reg.load_file(&plugin("runs")).unwrap().0);
    let trap = Arc::new(reg.load_file(&hostile("trap")).unwrap().0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let (r, t) = (runs.clone(), trap.clone());
    rt.block_on(rt.spawn(async move {
        let field = regular(8, 2);
        for _ in 0..3 {
            let plan = r.select(&field, &[0, 2, 4]).unwrap();
            let got = rows_of(&plan::execute_selection(&field, &plan).unwrap());
            assert_eq!(got, builtin_rows(&field, &[0, 2, 4]));
        }
        for round in 0..2 {
            match t.select(&field, &[0, 2, 4]) {
                Err(PolicyError::Fault(Fault::Trap(text))) => assert!(
                    text.contains("guest stderr: ")
                        && text.contains("hostile plugin `trap`: select(8 rows, 3 positions)"),
                    "round {round}: {text}"
                ),
                other => panic!("round {round}: expected a trap, got {other:?}"),
            }
        }
    }))
    .unwrap();
    assert!(!runs.enters_off_runtime(), "runs left the worker");
    assert!(
        trap.enters_off_runtime(),
        "trap's stderr write did not send it off the runtime"
    );
}

/// A call on the worker gets only `WORKER_FUEL`: `infinite-loop` is cut
/// short there, run again off the runtime with its whole budget (where it
/// runs out of fuel, a fault like any), and from then on entered off the
/// runtime, so the one worker of this runtime keeps running its other
/// tasks: a ticker on it never waits as long as a call takes.
#[test]
fn a_long_call_leaves_the_worker_after_the_workers_fuel() {
    let reg = Registry::new(
        Some(shared_cache()),
        SandboxLimits {
            fuel: 100 * wasm::WORKER_FUEL,
            ..SandboxLimits::default()
        },
    )
    .unwrap();
    let looping = Arc::new(reg.load_file(&hostile("infinite-loop")).unwrap().0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .unwrap();
    let p = looping.clone();
    let (call, gap) = rt.block_on(async move {
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d = done.clone();
        let ticker = tokio::spawn(async move {
            let (mut last, mut gap) = (Instant::now(), std::time::Duration::ZERO);
            while !d.load(Ordering::Relaxed) {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                gap = gap.max(last.elapsed());
                last = Instant::now();
            }
            gap
        });
        let call = tokio::spawn(async move {
            let start = Instant::now();
            let field = regular(8, 2);
            let got = p.select(&field, &[0, 2, 4]);
            assert!(
                matches!(got, Err(PolicyError::Fault(Fault::Timeout))),
                "{got:?}"
            );
            start.elapsed()
        })
        .await
        .unwrap();
        done.store(true, Ordering::Relaxed);
        (call, ticker.await.unwrap())
    });
    assert!(
        looping.enters_off_runtime(),
        "the long call stayed on the worker"
    );
    assert!(
        gap * 3 < call,
        "the ticker waited {gap:?} during a call of {call:?}: the call held the worker"
    );
}
