//! `stowage:policy@0.2.0` beside the frozen 0.1.0: one entry into a 0.2.0
//! plugin decides a whole request, a 0.1.0 plugin (kept as a fixture, built
//! before the SDK moved) still loads, passes `plugin check` and decides one
//! pair per entry, pure plugins are memoized and only they, and the new
//! ways a plugin can misbehave (a read from a "pure" plugin, an answer of
//! the wrong length) are faults like any other. Real `.wasm` components,
//! in process (the chain), and the real `stowd` for the CLI and a put.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use stowage_host::batch::Field;
use stowage_host::plan;
use stowage_host::policy::SelectRequest;
use stowage_host::policy::chain::{Chain, ChainError, DecidedBy, FailStrategy, Loaded, Shared};
use stowage_host::policy::registry::Registry;
use stowage_host::policy::replay::Shape;
use stowage_host::policy::wasm::SandboxLimits;
use stowage_host::tensor::{Dtype, Tensor};
use stowage_tests::client::stat;
use stowage_tests::process::stowd_bin;
use stowage_tests::{NativeClient, Stowd, hostile, plugin, plugin_v0_1, shared_cache};

fn regular(rows: u64, cols: u64, seed: u64) -> Field {
    let data: Vec<u8> = (0..rows * cols)
        .flat_map(|v| ((v + seed) as f32).to_le_bytes())
        .collect();
    Field::Regular(Tensor::contiguous(Bytes::from(data), Dtype::Float32, vec![rows, cols]).unwrap())
}

fn registry(paths: &[std::path::PathBuf], memo_entries: usize) -> Registry {
    let limits = SandboxLimits {
        memo_entries,
        ..SandboxLimits::default()
    };
    let mut reg = Registry::new(Some(shared_cache()), limits).unwrap();
    for p in paths {
        let (policy, _) = reg.load_file(p).unwrap_or_else(|e| panic!("{e}"));
        reg.insert(Arc::new(policy));
    }
    reg
}

fn chain(reg: &Registry, names: &[&str], fail: FailStrategy, max_faults: u64) -> Chain {
    let loaded: Vec<Loaded> = names
        .iter()
        .map(|n| {
            reg.get(n)
                .unwrap_or_else(|| panic!("{n} not loaded"))
                .clone()
        })
        .collect();
    Chain::new(loaded, fail, max_faults)
}

/// (calls, entries, memo hits, plans, faults) of a loaded plugin.
fn counts(reg: &Registry, name: &str) -> [u64; 5] {
    let s = &reg.get(name).unwrap().stats;
    [
        s.calls.load(Ordering::Relaxed),
        s.entries.load(Ordering::Relaxed),
        s.memo_hits.load(Ordering::Relaxed),
        s.plans.load(Ordering::Relaxed),
        s.faults.load(Ordering::Relaxed),
    ]
}

/// The (field, unit) pairs of a put of `fields` fields over 4 units, each
/// unit's positions a constant stride of 4.
fn pairs(fields: &[Field], positions: &[Vec<u64>]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for u in 0..positions.len() {
        for f in 0..fields.len() {
            out.push((f, u));
        }
    }
    out
}

fn requests<'a>(fields: &'a [Field], positions: &'a [Vec<u64>]) -> Vec<SelectRequest<'a>> {
    pairs(fields, positions)
        .into_iter()
        .map(|(f, u)| SelectRequest::new(&fields[f], &positions[u]))
        .collect()
}

fn put_shape(seed: u64) -> (Vec<Field>, Vec<Vec<u64>>) {
    let fields: Vec<Field> = (0..10).map(|f| regular(64, 16, seed + f)).collect();
    let positions: Vec<Vec<u64>> = (0..4u64)
        .map(|u| (0..16).map(|i| u + 4 * i).collect())
        .collect();
    (fields, positions)
}

#[test]
fn a_request_enters_a_0_2_0_plugin_once_and_a_0_1_0_plugin_once_per_pair() {
    // Memo off: every decision is asked of the plugin.
    let reg = registry(&[plugin("constant-stride"), plugin_v0_1("runs")], 0);
    assert_eq!(
        reg.get("constant-stride").unwrap().policy.describe().dtypes,
        vec![]
    );
    let (fields, positions) = put_shape(0);
    let asked = requests(&fields, &positions);
    assert_eq!(asked.len(), 40);

    let decided = chain(&reg, &["constant-stride"], FailStrategy::Reject, 0)
        .select_many(&asked)
        .unwrap();
    assert_eq!(counts(&reg, "constant-stride"), [40, 1, 0, 40, 0]);
    let decided_old = chain(&reg, &["runs"], FailStrategy::Reject, 0)
        .select_many(&asked)
        .unwrap();
    assert_eq!(counts(&reg, "runs"), [40, 40, 0, 40, 0]);
    // Both decide every pair, and each plan gives the built-in's rows.
    for ((r, a), b) in asked.iter().zip(&decided).zip(&decided_old) {
        assert_eq!(a.by, DecidedBy::Plugin("constant-stride".into()));
        assert_eq!(b.by, DecidedBy::Plugin("runs".into()));
        let rows = |plan| {
            plan::execute_selection(r.field, plan)
                .unwrap()
                .iter()
                .map(|s| match s {
                    plan::Selected::Rows(t) => t.contiguous_bytes(),
                    other => panic!("{other:?}"),
                })
                .collect::<Vec<_>>()
        };
        let builtin = stowage_host::policy::builtin::Builtin::plan(r.field, r.positions).unwrap();
        assert_eq!(rows(&a.plan), rows(&builtin));
        assert_eq!(rows(&b.plan), rows(&builtin));
    }
}

#[test]
fn requests_a_plugin_declines_go_on_alone_to_the_next_one() {
    let reg = registry(
        &[
            plugin("single-row"),
            plugin("constant-stride"),
            plugin("gather"),
        ],
        0,
    );
    let field = regular(100, 4, 0);
    let one = [7u64];
    let strided = [1u64, 3, 5];
    let irregular = [9u64, 2, 40];
    let asked = [
        SelectRequest::new(&field, &one),
        SelectRequest::new(&field, &strided),
        SelectRequest::new(&field, &irregular),
    ];
    let c = chain(
        &reg,
        &["single-row", "constant-stride", "gather"],
        FailStrategy::Reject,
        0,
    );
    let by: Vec<DecidedBy> = c
        .select_many(&asked)
        .unwrap()
        .into_iter()
        .map(|d| d.by)
        .collect();
    assert_eq!(
        by,
        [
            DecidedBy::Plugin("single-row".into()),
            DecidedBy::Plugin("constant-stride".into()),
            DecidedBy::Plugin("gather".into()),
        ]
    );
    // Each plugin entered once, asked only what the ones before declined.
    assert_eq!(counts(&reg, "single-row"), [3, 1, 0, 1, 0]);
    assert_eq!(counts(&reg, "constant-stride"), [2, 1, 0, 1, 0]);
    assert_eq!(counts(&reg, "gather"), [1, 1, 0, 1, 0]);
    // An empty position list anywhere is refused before any call.
    let none: [u64; 0] = [];
    let bad = [asked[0], SelectRequest::new(&field, &none)];
    assert_eq!(c.select_many(&bad).unwrap_err(), ChainError::EmptyPositions);
    assert_eq!(counts(&reg, "single-row")[0], 3);
}

#[test]
fn a_pure_plugin_is_memoized_and_a_plugin_that_reads_never() {
    let reg = registry(&[plugin("constant-stride"), hostile("drop-row")], 256);
    assert!(reg.get("constant-stride").unwrap().policy.describe().pure);
    assert!(!reg.get("drop-row").unwrap().policy.describe().pure);
    let (fields, positions) = put_shape(0);
    let c = chain(&reg, &["constant-stride"], FailStrategy::Reject, 0);
    let first = c.select_many(&requests(&fields, &positions)).unwrap();
    assert_eq!(counts(&reg, "constant-stride"), [40, 1, 0, 40, 0]);
    // The next step: other bytes, the same shapes -> no entry at all.
    let (next, _) = put_shape(100);
    let again = c.select_many(&requests(&next, &positions)).unwrap();
    assert_eq!(counts(&reg, "constant-stride"), [80, 1, 40, 80, 0]);
    assert!(
        again
            .iter()
            .all(|d| d.by == DecidedBy::Plugin("constant-stride".into()))
    );
    // The same plans as when the plugin was entered (a run of requests of
    // one key is answered from the first one's lookup).
    let plans = |d: &[stowage_host::policy::chain::Decision<plan::SelectionPlan>]| {
        d.iter().map(|d| d.plan.clone()).collect::<Vec<_>>()
    };
    assert_eq!(plans(&first), plans(&again));
    // Another layout (rows, dtype) or other positions: asked again.
    let shorter: Vec<Vec<u64>> = positions.iter().map(|p| p[..8].to_vec()).collect();
    c.select_many(&requests(&next, &shorter)).unwrap();
    assert_eq!(counts(&reg, "constant-stride")[1], 2);
    let wider = vec![regular(64, 8, 0)];
    c.select_many(&requests(&wider, &positions)).unwrap();
    assert_eq!(counts(&reg, "constant-stride")[1], 3);
    // Keys interleaved (equal ones next to each other and apart, some
    // never asked before): each answer is the plan the plugin itself
    // gives, as a chain without a memo asks it.
    let other = [
        regular(32, 16, 7),
        regular(64, 16, 9),
        regular(64, 2, 3),
        regular(64, 16, 11),
    ];
    let mut mixed: Vec<SelectRequest<'_>> = Vec::new();
    for u in [0usize, 1, 3, 3] {
        for f in [0usize, 1, 3, 1, 0, 2, 2, 1, 0, 0, 2] {
            mixed.push(SelectRequest::new(&other[f], &positions[u][..8 - u]));
        }
    }
    let raw = registry(&[plugin("constant-stride")], 0);
    let reference = chain(&raw, &["constant-stride"], FailStrategy::Reject, 0)
        .select_many(&mixed)
        .unwrap();
    for _ in 0..2 {
        let memoized = c.select_many(&mixed).unwrap();
        assert_eq!(plans(&memoized), plans(&reference));
    }

    // drop-row is not pure: every request is a call (and a fault) again.
    let d = chain(&reg, &["drop-row"], FailStrategy::Fallback, 0);
    for round in 1..=2u64 {
        let decided = d.select_many(&requests(&fields, &positions)).unwrap();
        assert!(
            decided
                .iter()
                .all(|x| matches!(x.by, DecidedBy::Fallback { .. }))
        );
        assert_eq!(
            counts(&reg, "drop-row"),
            [40 * round, round, 0, 0, 40 * round]
        );
    }
}

#[test]
fn a_pure_plugin_that_reads_traps_every_time() {
    let reg = registry(&[hostile("pure-read")], 256);
    let field = regular(16, 4, 0);
    let c = chain(&reg, &["pure-read"], FailStrategy::Fallback, 0);
    for round in 1..=3u64 {
        let d = c.select(&field, &[1, 2, 3]).unwrap();
        assert_eq!(
            d.by,
            DecidedBy::Fallback {
                plugin: "pure-read".into()
            }
        );
        // A fault is never memoized: each round enters the plugin again.
        assert_eq!(counts(&reg, "pure-read"), [round, round, 0, 0, round]);
    }
    let c = chain(&reg, &["pure-read"], FailStrategy::Reject, 0);
    match c.select(&field, &[1, 2, 3]) {
        Err(ChainError::Rejected { plugin, reason, .. }) => {
            assert_eq!(plugin, "pure-read");
            assert!(
                reason.contains("pure") && reason.contains("read"),
                "{reason}"
            );
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn an_answer_of_the_wrong_length_is_a_fault_of_every_request_it_covers() {
    let reg = registry(&[hostile("short-answer")], 256);
    let (fields, positions) = put_shape(0);
    let asked = requests(&fields, &positions);
    let c = chain(&reg, &["short-answer"], FailStrategy::Fallback, 0);
    let decided = c.select_many(&asked).unwrap();
    assert!(decided.iter().all(|d| d.by
        == DecidedBy::Fallback {
            plugin: "short-answer".into()
        }));
    assert_eq!(counts(&reg, "short-answer"), [40, 1, 0, 0, 40]);
    // One request: an empty answer, the same fault.
    let d = c.select(&fields[0], &positions[0]).unwrap();
    assert!(matches!(d.by, DecidedBy::Fallback { .. }));
    let c = chain(&reg, &["short-answer"], FailStrategy::Reject, 0);
    match c.select_many(&asked) {
        Err(ChainError::Rejected { reason, .. }) => {
            assert!(
                reason.contains("answered 39 results for 40 requests"),
                "{reason}"
            )
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn a_plugin_disabled_midway_through_an_answer_is_not_asked_the_rest() {
    let reg = registry(&[hostile("reorder")], 0);
    let (fields, positions) = put_shape(0);
    let c = chain(&reg, &["reorder"], FailStrategy::Fallback, 3);
    let decided = c.select_many(&requests(&fields, &positions)).unwrap();
    let fallbacks = decided
        .iter()
        .filter(|d| matches!(d.by, DecidedBy::Fallback { .. }))
        .count();
    assert_eq!(fallbacks, 3, "three faults, then disabled");
    assert!(decided[3..].iter().all(|d| d.by == DecidedBy::Builtin));
    assert_eq!(counts(&reg, "reorder"), [3, 1, 0, 0, 3]);
    assert!(
        reg.get("reorder")
            .unwrap()
            .stats
            .disabled
            .load(Ordering::Relaxed)
    );
}

/// (plan, decided by) of each decision.
fn plans(decided: &[stowage_host::policy::chain::Decision<plan::SelectionPlan>]) -> Vec<String> {
    decided
        .iter()
        .map(|d| format!("{:?} by {:?}", d.plan, d.by))
        .collect()
}

/// A copy of each request's positions.
fn own_positions(asked: &[SelectRequest<'_>]) -> Vec<Vec<u64>> {
    asked.iter().map(|r| r.positions.to_vec()).collect()
}

/// `asked`, each request at its own copy of its positions (from
/// [`own_positions`]): no request repeats the one before it.
fn asked_alone<'a>(asked: &[SelectRequest<'a>], own: &'a [Vec<u64>]) -> Vec<SelectRequest<'a>> {
    asked
        .iter()
        .zip(own)
        .map(|(r, p)| SelectRequest::new(r.field, p))
        .collect()
}

/// A put's fields of one layout at one unit's positions repeat the request
/// before them: a chain of plugins that all memoize asks only the first of
/// each run. Its decisions and every plugin's counts must be those of the
/// same requests asked one by one (each unit's positions in a list of its
/// own per field, so none repeats), cold and from the memo, with faults,
/// and with a plugin disabled partway through a run.
#[test]
fn repeated_requests_are_decided_and_counted_as_if_each_were_asked() {
    let names = ["single-row", "constant-stride", "gather"];
    let paths: Vec<_> = names.iter().map(|n| plugin(n)).collect();
    let (fields, positions) = put_shape(0);
    // Unit-major, as a put asks: the 10 fields at unit 0's positions, ...
    let repeating = requests(&fields, &positions);
    // The same, each request's positions a list of its own.
    let own = own_positions(&repeating);
    let alone = asked_alone(&repeating, &own);
    // Some rows irregular (gather), some single (single-row), the rest
    // constant-stride, and a field of another layout between repeats.
    let single = [5u64];
    let irregular = [9u64, 2, 40];
    let other = regular(64, 8, 3);
    let mut mixed = repeating.clone();
    mixed.splice(13..13, [SelectRequest::new(&other, &positions[1])]);
    mixed.extend((0..3).map(|f| SelectRequest::new(&fields[f], &single)));
    mixed.extend((0..3).map(|f| SelectRequest::new(&fields[f], &irregular)));
    let mixed_own = own_positions(&mixed);
    let mixed_alone = asked_alone(&mixed, &mixed_own);
    let (a, b) = (registry(&paths, 256), registry(&paths, 256));
    let (ca, cb) = (
        chain(&a, &names, FailStrategy::Reject, 0),
        chain(&b, &names, FailStrategy::Reject, 0),
    );
    for (round, (x, y)) in [
        (&repeating, &alone),
        (&repeating, &alone),
        (&mixed, &mixed_alone),
        (&mixed, &mixed_alone),
    ]
    .into_iter()
    .enumerate()
    {
        let (da, db) = (ca.select_many(x).unwrap(), cb.select_many(y).unwrap());
        assert_eq!(plans(&da), plans(&db), "round {round}");
        for n in names {
            assert_eq!(counts(&a, n), counts(&b, n), "{n}, round {round}");
        }
        if round == 1 {
            // The second round came from the memo: every request a hit.
            assert_eq!(counts(&a, "constant-stride"), [80, 1, 40, 80, 0]);
        }
    }

    // A pure plugin that traps: a fault for every request; with
    // max_faults 3, disabled at the third, inside the first run.
    for max_faults in [0, 3] {
        let (a, b) = (
            registry(&[hostile("pure-read")], 256),
            registry(&[hostile("pure-read")], 256),
        );
        let (ca, cb) = (
            chain(&a, &["pure-read"], FailStrategy::Fallback, max_faults),
            chain(&b, &["pure-read"], FailStrategy::Fallback, max_faults),
        );
        let (da, db) = (
            ca.select_many(&repeating).unwrap(),
            cb.select_many(&alone).unwrap(),
        );
        assert_eq!(plans(&da), plans(&db), "max_faults {max_faults}");
        assert_eq!(counts(&a, "pure-read"), counts(&b, "pure-read"));
        let faults = if max_faults == 0 { 40 } else { 3 };
        assert_eq!(counts(&a, "pure-read"), [faults, 1, 0, 0, faults]);
        assert_eq!(
            da.iter()
                .filter(|d| matches!(d.by, DecidedBy::Fallback { .. }))
                .count() as u64,
            faults
        );
    }
}

/// The plans and deciders of a put's selection of `fields` at each unit's
/// `positions`, asked as `stowd` asks: the grid's requests with their shape
/// (`shaped`), or with none.
fn select_grid(
    chain: &Chain,
    fields: &[Field],
    positions: &[Vec<u64>],
    shaped: bool,
) -> Vec<(String, DecidedBy)> {
    let asked = requests(fields, positions);
    let shape = shaped
        .then(|| {
            Shape::grid(
                &chain.policies,
                fields.iter(),
                positions.iter().map(|p| p.as_slice()),
            )
        })
        .flatten();
    let shared = chain.select_many_shared(&asked, shape).unwrap();
    (0..shared.len())
        .map(|i| match &shared[i] {
            Shared::Decided(d) => (format!("{:?}", d.plan), d.by.clone()),
            Shared::Same(j) => match &shared[*j] {
                Shared::Decided(d) => (format!("{:?}", d.plan), d.by.clone()),
                Shared::Same(_) => panic!("request {i} repeats a repeat"),
            },
        })
        .collect()
}

#[test]
fn a_put_shaped_like_the_last_takes_its_decisions_counted_as_if_asked() {
    let names = ["single-row", "constant-stride", "gather"];
    let paths: Vec<_> = names.iter().map(|n| plugin(n)).collect();
    let (a, b) = (registry(&paths, 256), registry(&paths, 256));
    let (ca, cb) = (
        chain(&a, &names, FailStrategy::Fallback, 0),
        chain(&b, &names, FailStrategy::Fallback, 0),
    );
    let (fields, positions) = put_shape(0);
    // Other data of the same layout: the same shape.
    let (same_layout, _) = put_shape(7);
    let wider: Vec<Field> = (0..10).map(|f| regular(64, 8, f)).collect();
    // Within the 64 rows: unit 3's last position wraps to 0.
    let shifted: Vec<Vec<u64>> = positions
        .iter()
        .map(|p| p.iter().map(|i| (i + 1) % 64).collect())
        .collect();
    let irregular: Vec<Vec<u64>> = vec![vec![9, 2, 40], vec![5], vec![1, 3, 5, 7]];
    // (fields, positions, replayed: whether the shaped chain takes a kept
    // call's decisions). A call that entered a plugin is not kept (the
    // first of each shape); the one after it is, the next replays. The
    // chain keeps 4 shapes, the latest used first.
    type Round<'a> = (&'a [Field], &'a [Vec<u64>], bool);
    let rounds: [Round<'_>; 11] = [
        (&fields, &positions, false),
        (&fields, &positions, false),
        (&same_layout, &positions, true),
        (&fields, &positions, true),
        (&wider, &positions, false),
        (&wider, &positions, false),
        (&fields, &positions, true),
        (&fields, &shifted, false),
        (&fields, &shifted, false),
        (&fields, &irregular, false),
        (&fields, &irregular, false),
    ];
    // Each round asked of both chains: the same decisions and counts, and
    // the shaped chain's replays as the round says.
    let mut replays = 0;
    let mut play = |rounds: &[Round<'_>], what: &str| {
        for (round, &(f, p, replayed)) in rounds.iter().enumerate() {
            let (da, db) = (select_grid(&ca, f, p, true), select_grid(&cb, f, p, false));
            assert_eq!(da, db, "{what}, round {round}");
            for n in names {
                assert_eq!(counts(&a, n), counts(&b, n), "{n}, {what}, round {round}");
            }
            replays += u64::from(replayed);
            assert_eq!(ca.replays(), replays, "{what}, round {round}");
        }
    };
    play(&rounds, "first");
    // Irregular positions kept too (gather and single-row decide them).
    play(&[(&fields, &irregular, true)], "irregular");

    // A plugin disabled since the kept call is not asked: no replay, and
    // it is not counted. Enabled again, the kept call (made with it
    // enabled) is replayed.
    let single_row = |disabled: bool| {
        for reg in [&a, &b] {
            let stats = &reg.get("single-row").unwrap().stats;
            stats.disabled.store(disabled, Ordering::Relaxed);
        }
    };
    single_row(true);
    let before = counts(&a, "single-row");
    play(&[(&fields, &irregular, false)], "disabled");
    assert_eq!(counts(&a, "single-row"), before);
    single_row(false);
    play(&[(&fields, &irregular, true)], "enabled again");

    // Kept, the latest used first: irregular, shifted, 10 fields at
    // positions, wider. Wider is replayed (and now first); a fifth shape
    // kept pushes out the one used longest ago (10 fields at positions),
    // kept again it pushes out the next (shifted).
    let narrow: Vec<Field> = (0..10).map(|f| regular(64, 4, f)).collect();
    let rounds: [Round<'_>; 6] = [
        (&wider, &positions, true),
        (&narrow, &positions, false),
        (&narrow, &positions, false),
        (&fields, &positions, false),
        (&fields, &positions, true),
        (&fields, &shifted, false),
    ];
    play(&rounds, "kept 4");
    assert_eq!(cb.replays(), 0);

    // A plugin that faults on every call: never kept, each call's faults
    // counted.
    let (a, b) = (
        registry(&[hostile("pure-read"), plugin("constant-stride")], 256),
        registry(&[hostile("pure-read"), plugin("constant-stride")], 256),
    );
    let names = ["pure-read", "constant-stride"];
    let (ca, cb) = (
        chain(&a, &names, FailStrategy::Fallback, 0),
        chain(&b, &names, FailStrategy::Fallback, 0),
    );
    for round in 0..3 {
        assert_eq!(
            select_grid(&ca, &fields, &positions, true),
            select_grid(&cb, &fields, &positions, false),
            "round {round}"
        );
        for n in names {
            assert_eq!(counts(&a, n), counts(&b, n), "{n}, round {round}");
        }
    }
    assert_eq!(counts(&a, "pure-read")[4], 120);
    assert_eq!(ca.replays(), 0);

    // A plugin without a memo: always asked.
    let a = registry(&[plugin("constant-stride")], 0);
    let ca = chain(&a, &["constant-stride"], FailStrategy::Fallback, 0);
    for _ in 0..3 {
        select_grid(&ca, &fields, &positions, true);
    }
    assert_eq!(counts(&a, "constant-stride"), [120, 3, 0, 120, 0]);
    assert_eq!(ca.replays(), 0);

    // With plugins, a nested field has no shape (a memo keys regular
    // fields only); the built-in alone decides it by its positions, and
    // replays it.
    let row = |n: u64| {
        Tensor::contiguous(
            Bytes::from(vec![0u8; n as usize * 4]),
            Dtype::Float32,
            vec![n],
        )
        .unwrap()
    };
    let nested = vec![Field::Nested((0..64).map(|r| row(1 + r % 3)).collect())];
    assert!(
        Shape::grid(
            &chain(&a, &["constant-stride"], FailStrategy::Fallback, 0).policies,
            nested.iter(),
            positions.iter().map(|p| p.as_slice())
        )
        .is_none()
    );
    let builtin = Chain::builtin();
    let expected: Vec<_> = requests(&nested, &positions)
        .iter()
        .map(|r| {
            (
                format!(
                    "{:?}",
                    stowage_host::policy::builtin::Builtin::plan(r.field, r.positions).unwrap()
                ),
                DecidedBy::Builtin,
            )
        })
        .collect();
    for _ in 0..3 {
        assert_eq!(select_grid(&builtin, &nested, &positions, true), expected);
    }
    assert_eq!(builtin.replays(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0_1_0_plugin_passes_plugin_check_and_decides_beside_0_2_0_ones() {
    let dir = stowage_tests::temp_dir("contract-v0-1");
    std::fs::copy(plugin_v0_1("runs"), dir.join("runs.wasm")).unwrap();
    std::fs::copy(plugin("single-row"), dir.join("single-row.wasm")).unwrap();
    let out = Command::new(stowd_bin())
        .args(["plugin", "check"])
        .arg(dir.join("runs.wasm"))
        .output()
        .expect("run stowd plugin check");
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");

    let stowd = Stowd::start_with_plugins(
        &dir,
        "[[chain]]\npattern = \"*\"\nselect = [\"single-row\", \"runs\"]\nfail = \"reject\"\n",
    );
    let client = NativeClient::new(stowd.native());
    // Two fields over the default units: runs (0.1.0) plans every pair,
    // single-row (0.2.0) is entered once per put and declines.
    let indexes: Vec<u64> = (0..64).collect();
    let batch: Vec<(String, Field)> = (0..2)
        .map(|f| (format!("f{f}"), regular(64, 4, f)))
        .collect();
    let before = client.stats().await;
    client.put_ok(&indexes, &batch).await;
    let after = client.stats().await;
    let decisions = stat(&after, "plugin_decisions") - stat(&before, "plugin_decisions");
    assert!(decisions >= 2, "{decisions} plugin decisions");
    let plugin_int =
        |stats: &[(String, stowage_host::wire::native::Stat)], name: &str, key: &str| {
            stats
                .iter()
                .find(|(k, _)| k == &format!("plugin.{name}"))
                .and_then(|(_, v)| v.get(key).and_then(|s| s.as_int()))
                .unwrap_or_else(|| panic!("no {key} for {name}: {stats:?}"))
        };
    let d = |name, key| plugin_int(&after, name, key) - plugin_int(&before, name, key);
    assert_eq!(d("single-row", "entries"), 1, "one entry for the whole put");
    assert_eq!(d("single-row", "calls"), decisions);
    assert_eq!(d("runs", "entries"), decisions, "one entry per pair");
    assert_eq!(d("runs", "plans"), decisions);
    let got = client.get_ok(&indexes, &["f0", "f1"]).await;
    assert_eq!(got.len(), 2);
    stowd.stop();
}

#[test]
fn a_fields_handle_kept_past_its_call_reaches_nothing_but_the_current_call() {
    let reg = registry(&[hostile("stale-fields")], 0);
    let first = regular(16, 4, 0);
    let positions = [1u64, 5, 6];
    let c = chain(&reg, &["stale-fields"], FailStrategy::Fallback, 0);
    // The first call keeps its handle's index and answers honestly.
    let d = c.select(&first, &positions).unwrap();
    assert_eq!(d.by, DecidedBy::Plugin("stale-fields".into()));
    // Later calls use the kept index. The component model recycles handle
    // slots, so the index either traps (unknown handle) or names the field
    // lent to the call at hand, never the 16-row field of the first call.
    let later = regular(24, 4, 1);
    let builtin = stowage_host::policy::builtin::Builtin::plan(&later, &positions).unwrap();
    for round in 1..4u64 {
        let d = c.select(&later, &positions).unwrap();
        assert_eq!(
            d.by,
            DecidedBy::Fallback {
                plugin: "stale-fields".into()
            },
            "round {round}"
        );
        assert_eq!(d.plan, builtin);
    }
    let c = chain(&reg, &["stale-fields"], FailStrategy::Reject, 0);
    match c.select(&later, &positions) {
        Err(ChainError::Rejected { reason, .. }) => assert!(
            reason.contains("unknown handle") || reason.contains("answered 24 rows"),
            "{reason}"
        ),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn a_field_number_the_call_did_not_lend_traps() {
    let reg = registry(&[hostile("bad-field-number")], 0);
    let (fields, positions) = put_shape(0);
    let c = chain(&reg, &["bad-field-number"], FailStrategy::Fallback, 0);
    let decided = c.select_many(&requests(&fields, &positions)).unwrap();
    assert!(decided.iter().all(|d| d.by
        == DecidedBy::Fallback {
            plugin: "bad-field-number".into()
        }));
    assert_eq!(counts(&reg, "bad-field-number"), [40, 1, 0, 0, 40]);
    let c = chain(&reg, &["bad-field-number"], FailStrategy::Reject, 0);
    match c.select(&fields[0], &positions[0]) {
        Err(ChainError::Rejected { reason, .. }) => assert!(
            reason.contains("field number 1 out of range: the call lent 1 fields"),
            "{reason}"
        ),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// A pure packing plugin (the bundled `coalesce`) answers a call it has
/// answered before from its memo: the same limits and pieces (a get of
/// many fields of one layout packs each field the same way) get the same
/// plan, counted as a call, a plan and a memo hit, not an entry. Other
/// limits, another length or a piece that is not contiguous enter it again;
/// a call of more than 64 pieces is never memoized; with `memo_entries = 0`
/// every call enters it. Every answer equals a memo-less chain's.
#[test]
fn a_pure_packing_plugin_answers_a_call_it_has_answered_from_its_memo() {
    use stowage_host::plan::{PackLimits, PieceInfo};
    let paths = [plugin("coalesce")];
    let (reg, reg_off) = (registry(&paths, 256), registry(&paths, 0));
    let (pack, pack_off) = (
        chain(&reg, &["coalesce"], FailStrategy::Reject, 0),
        chain(&reg_off, &["coalesce"], FailStrategy::Reject, 0),
    );
    let limits = PackLimits {
        max_frames: 64,
        max_frame_bytes: 1 << 20,
        small_threshold: 0,
    };
    let four = vec![PieceInfo::contiguous(64); 4];
    let mut strided = four.clone();
    strided[2].contiguous = false;
    let mut longer = four.clone();
    longer[3].byte_len = 128 << 10;
    let tight = PackLimits {
        max_frame_bytes: 128,
        ..limits
    };
    let cases = [
        (&four, limits),
        (&four, tight),
        (&strided, limits),
        (&longer, limits),
    ];
    for (i, (pieces, limits)) in cases.iter().enumerate() {
        let want = pack_off.pack(pieces, limits).unwrap();
        for round in 0..3u64 {
            let got = pack.pack(pieces, limits).unwrap();
            assert_eq!((&got.plan, &got.by), (&want.plan, &want.by), "case {i}");
            let (i, round) = (i as u64, round);
            // Each case entered once, on its first round.
            assert_eq!(
                counts(&reg, "coalesce"),
                [
                    3 * i + round + 1,
                    i + 1,
                    2 * i + round,
                    3 * i + round + 1,
                    0
                ],
                "case {i}, round {round}"
            );
        }
    }
    // The cases are told apart: four plans, not all one.
    let plans: Vec<_> = cases
        .iter()
        .map(|(p, l)| pack.pack(p, l).unwrap().plan)
        .collect();
    assert_ne!(plans[0], plans[1]);
    assert_ne!(plans[0], plans[3]);
    // Over 64 pieces: entered every time.
    let before = counts(&reg, "coalesce");
    let many = vec![PieceInfo::contiguous(64); 65];
    for _ in 0..2 {
        assert_eq!(
            pack.pack(&many, &limits).unwrap().plan,
            pack_off.pack(&many, &limits).unwrap().plan
        );
    }
    let after = counts(&reg, "coalesce");
    assert_eq!([after[1] - before[1], after[2] - before[2]], [2, 0]);
    // Memo off: every call of the off chain entered it.
    let off = counts(&reg_off, "coalesce");
    assert_eq!(off[1], off[0]);
    assert_eq!(off[2], 0);

    // The next field of a get asking the same: the decision before, again,
    // counted as the memo hit it would have been (a call, a hit, a plan).
    let timed = stowage_host::policy::chain::PolicyTime::start();
    for (pieces, limits) in &cases {
        let first = pack.pack(pieces, limits).unwrap();
        let before = counts(&reg, "coalesce");
        let again = pack.pack_repeat(pieces, limits, &timed, &first).unwrap();
        assert_eq!((&again.plan, &again.by), (&first.plan, &first.by));
        let after = counts(&reg, "coalesce");
        let d: Vec<u64> = (0..5).map(|k| after[k] - before[k]).collect();
        assert_eq!(d, [1, 0, 1, 1, 0]);
    }
    // Where asking would enter the plugin, it is asked: memo off, or more
    // pieces than a memo keeps.
    let first = pack_off.pack(&four, &limits).unwrap();
    let before = counts(&reg_off, "coalesce");
    pack_off
        .pack_repeat(&four, &limits, &timed, &first)
        .unwrap();
    assert_eq!(counts(&reg_off, "coalesce")[1], before[1] + 1);
    let first = pack.pack(&many, &limits).unwrap();
    let before = counts(&reg, "coalesce");
    let again = pack.pack_repeat(&many, &limits, &timed, &first).unwrap();
    assert_eq!(again.plan, first.plan);
    assert_eq!(counts(&reg, "coalesce")[1], before[1] + 1);
}

/// A plugin that says it is pure and packs the same call differently each
/// time (`pure-varying-pack`: one frame per piece, then all in one frame,
/// then an invalid plan, in turn). With the memo, a call it has answered
/// gets that first answer again, without entering it; an answer is
/// validated on every hit, so the invalid one, memoized, is a fault each
/// time it comes back and the built-in's plan goes out instead. Without
/// the memo every call enters it and its answers vary, the invalid one a
/// fault too.
#[test]
fn a_pure_packing_plugin_that_varies_is_answered_from_its_memo_and_validated_each_time() {
    use stowage_host::plan::{FramePlan, PackLimits, PieceInfo};
    let path = hostile("pure-varying-pack");
    let limits = PackLimits {
        max_frames: 64,
        max_frame_bytes: 1 << 20,
        small_threshold: 0,
    };
    let pieces = |n: usize| vec![PieceInfo::contiguous(64); n];
    let plugin = || DecidedBy::Plugin("pure-varying-pack".into());
    let fallback = || DecidedBy::Fallback {
        plugin: "pure-varying-pack".into(),
    };
    let one_per_piece = FramePlan::one_per_piece(4);
    let coalesced = |n: u32| FramePlan::new(vec![plan::Frame::Coalesced((0..n).collect())]);

    // Memo off: the answers vary, and the invalid one falls back.
    let reg = registry(std::slice::from_ref(&path), 0);
    let c = chain(&reg, &["pure-varying-pack"], FailStrategy::Fallback, 0);
    let got: Vec<_> = (0..3)
        .map(|_| c.pack(&pieces(4), &limits).unwrap())
        .collect();
    assert_eq!((&got[0].plan, &got[0].by), (&one_per_piece, &plugin()));
    assert_eq!((&got[1].plan, &got[1].by), (&coalesced(4), &plugin()));
    assert_eq!(got[2].by, fallback());
    assert_eq!(counts(&reg, "pure-varying-pack"), [3, 3, 0, 2, 1]);

    // Memo on: a call answered before gets its first answer again.
    let reg = registry(std::slice::from_ref(&path), 256);
    let c = chain(&reg, &["pure-varying-pack"], FailStrategy::Fallback, 0);
    for _ in 0..4 {
        let d = c.pack(&pieces(4), &limits).unwrap();
        assert_eq!((&d.plan, &d.by), (&one_per_piece, &plugin()));
    }
    assert_eq!(counts(&reg, "pure-varying-pack"), [4, 1, 3, 4, 0]);
    // Two other calls enter it: its second answer (valid) and its third
    // (invalid, kept by the memo all the same).
    let d = c.pack(&pieces(2), &limits).unwrap();
    assert_eq!((&d.plan, &d.by), (&coalesced(2), &plugin()));
    let d = c.pack(&pieces(3), &limits).unwrap();
    assert_eq!(d.by, fallback());
    // The invalid answer, from the memo, is a fault again each time; the
    // valid ones stay as they were.
    for _ in 0..3 {
        assert_eq!(c.pack(&pieces(3), &limits).unwrap().by, fallback());
        let d = c.pack(&pieces(2), &limits).unwrap();
        assert_eq!((&d.plan, &d.by), (&coalesced(2), &plugin()));
    }
    assert_eq!(counts(&reg, "pure-varying-pack"), [12, 3, 9, 8, 4]);
}
