//! `stowd plugin check` on every bundled plugin (passes) and on every
//! hostile test plugin (fails with a readable report); `stowd plugin list`
//! against a running stowd.

use std::process::Command;

use stowage_tests::{hostile, plugin_dir, shared_cache, temp_dir};

fn stowd() -> std::path::PathBuf {
    std::env::var_os("STOWD_BIN")
        .map(Into::into)
        .unwrap_or_else(|| stowage_tests::workspace_root().join("target/debug/stowd"))
}

/// `stowd plugin check` with the tests' shared compile cache (each plugin
/// is compiled once per test run, not once per check).
fn check(path: &std::path::Path) -> (bool, String) {
    check_with(path, &[])
}

fn check_with(path: &std::path::Path, extra: &[&str]) -> (bool, String) {
    let has_cache = extra.contains(&"--cache-dir");
    let mut cmd = Command::new(stowd());
    cmd.args(["plugin", "check", "--fuel", "10000000"])
        .args(extra);
    if !has_cache {
        cmd.arg("--cache-dir").arg(shared_cache());
    }
    let out = cmd.arg(path).output().expect("run stowd plugin check");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn every_bundled_plugin_passes_the_conformance_suite() {
    let mut checked = 0;
    for entry in std::fs::read_dir(plugin_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "wasm") {
            let (ok, report) = check(&path);
            assert!(ok, "{} failed:\n{report}", path.display());
            assert!(report.contains(" 0 failed"), "{report}");
            assert!(report.contains("decision time per call"), "{report}");
            checked += 1;
        }
    }
    assert_eq!(checked, 7);
}

#[test]
fn every_hostile_plugin_fails_with_a_readable_report() {
    let expect = [
        ("trap", "trap"),
        ("infinite-loop", "ran out of fuel"),
        // With the low test fuel it may run out of fuel before the memory cap.
        ("memory-bomb", "FAIL  select"),
        ("oob-view", "invalid plan: piece 0: view ends at row"),
        ("drop-row", "invalid plan: plan covers"),
        ("dup-row", "invalid plan"),
        ("reorder", "invalid plan: plan row #0 is row"),
        ("frame-bomb", "FAIL"),
        ("forged-handle", "stale handle"),
    ];
    for (name, says) in expect {
        let (ok, report) = check(&hostile(name));
        assert!(!ok, "{name} passed the conformance suite:\n{report}");
        assert!(report.contains("FAIL  "), "{name}: {report}");
        assert!(
            report.contains(says),
            "{name}: report lacks {says:?}:\n{report}"
        );
        let summary = report
            .lines()
            .find(|l| l.contains(" cases: "))
            .unwrap_or_default();
        assert!(!summary.contains(" 0 failed"), "{name}: {summary}");
        // These fail every call: the check gives up after 16 failed cases
        // in a row, and says how many it did not run.
        if !["trap", "infinite-loop", "memory-bomb"].contains(&name) {
            continue;
        }
        assert!(summary.starts_with("16 cases: "), "{name}: {summary}");
        assert!(
            report.contains("stopped after 16 failed cases in a row: ")
                && report.contains(" cases not run (--all runs every case)"),
            "{name}: {report}"
        );
    }
}

#[test]
fn plugin_check_all_runs_every_case_of_a_failing_plugin() {
    let total = |report: &str| -> usize {
        let summary = report.lines().find(|l| l.contains(" cases: ")).unwrap();
        summary.split(' ').next().unwrap().parse().unwrap()
    };
    // A cache directory of its own (stowd creates it, private): the check
    // compiles once and leaves one entry there.
    let cache = temp_dir("check-cache").join("c");
    let cache_arg = cache.to_str().unwrap();
    let (ok, all) = check_with(&hostile("trap"), &["--all", "--cache-dir", cache_arg]);
    let entries = std::fs::read_dir(&cache)
        .unwrap()
        .filter(|e| {
            let p = e.as_ref().unwrap().path();
            p.extension().is_some_and(|x| x == "cwasm")
        })
        .count();
    assert_eq!(entries, 1, "{all}");
    assert!(!ok, "{all}");
    assert!(!all.contains("stopped after"), "{all}");
    assert!(total(&all) > 100, "{all}");
    let summary = all.lines().find(|l| l.contains(" cases: ")).unwrap();
    assert!(
        summary.ends_with(&format!(", {} failed", total(&all))),
        "{summary}"
    );
    let (_, stopped) = check(&hostile("trap"));
    let not_run: usize = stopped
        .split("stopped after 16 failed cases in a row: ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{stopped}"));
    assert_eq!(16 + not_run, total(&all), "{stopped}");
}

fn stowd_out(args: &[&str], plugin: &std::path::Path) -> String {
    let out = Command::new(stowd())
        .args(["plugin"])
        .args(args)
        .arg("--cache-dir")
        .arg(shared_cache())
        .arg(plugin)
        .output()
        .expect("run stowd plugin");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "stowd plugin {args:?} failed:\n{text}"
    );
    text
}

/// Cells of a line of an aligned table (columns are two or more spaces apart).
fn cells(line: &str) -> Vec<String> {
    line.split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(String::from)
        .collect()
}

/// The number before `word` in the check's summary line.
fn summary_count(report: &str, word: &str) -> usize {
    let summary = report
        .lines()
        .find(|l| l.contains(" cases: "))
        .unwrap_or_else(|| panic!("no summary in:\n{report}"));
    let words: Vec<&str> = summary
        .split([' ', ','])
        .filter(|w| !w.is_empty())
        .collect();
    let i = words
        .iter()
        .position(|w| *w == word)
        .unwrap_or_else(|| panic!("no {word:?} in {summary:?}"));
    words[i - 1].parse().unwrap()
}

#[test]
fn check_verbose_shows_each_answered_plan_and_its_bytes_next_to_the_builtins() {
    let plugin = |name: &str| plugin_dir().join(format!("{name}.wasm"));
    let mut reports = std::collections::HashMap::new();
    for name in ["gather", "runs", "coalesce", "nested-pack", "single-row"] {
        let report = stowd_out(&["check", "--verbose"], &plugin(name));
        let report: &str = reports.entry(name).or_insert(report);
        let lines: Vec<&str> = report.lines().collect();
        let header = lines[1];
        assert_eq!(
            cells(header),
            [
                "result",
                "case",
                "plugin plan",
                "copied B",
                "built-in plan",
                "copied B"
            ],
            "{name}:\n{report}"
        );
        let plan_col = header.find("plugin plan").unwrap();
        let rows: Vec<&str> = lines[2..]
            .iter()
            .take_while(|l| !l.is_empty())
            .copied()
            .collect();
        let (mut ok, mut declined, mut copied, mut builtin_copied) = (0, 0, 0u64, 0u64);
        for row in &rows {
            let c = cells(row);
            assert_eq!(c.len(), 6, "{name}: {row:?}");
            // One word per outcome, the summary's: no "skip".
            match c[0].as_str() {
                "ok" => {
                    ok += 1;
                    assert!(
                        c[2].contains(" piece") || c[2].contains(" frame"),
                        "{row:?}"
                    );
                    copied += c[3].parse::<u64>().unwrap();
                    builtin_copied += c[5].parse::<u64>().unwrap_or(0);
                }
                "declined" => {
                    declined += 1;
                    assert_eq!((c[2].as_str(), c[3].as_str()), ("-", "-"), "{row:?}");
                }
                other => panic!("{name}: unexpected result {other:?} in {row:?}"),
            }
            // Aligned: the plan column starts at the header's column.
            assert_eq!(&row[plan_col - 2..plan_col], "  ", "{name}: {row:?}");
            assert_ne!(&row[plan_col..plan_col + 1], " ", "{name}: {row:?}");
        }
        assert!(!report.contains("skip"), "{name}:\n{report}");
        assert_eq!(ok, summary_count(report, "ok"), "{name}");
        assert_eq!(declined, summary_count(report, "declined"), "{name}");
        assert_eq!(ok + declined, rows.len());
        assert!(
            report.contains(&format!(
                "bytes copied by the {ok} answered cases: plugin {copied}, built-in {builtin_copied}"
            )),
            "{name}:\n{report}"
        );
    }

    // Known plans, each next to the built-in's.
    let row = |name: &str, case: &str| {
        let report = &reports[name];
        let line = report
            .lines()
            .find(|l| l.contains(&format!("  {case}  ")))
            .unwrap_or_else(|| panic!("{name}: no case {case:?}:\n{report}"));
        cells(line)
    };
    let case = "select: regular float32 [8, 2] / single-first (1 positions)";
    assert_eq!(
        row("gather", case)[2..],
        ["1 piece: gather", "8", "1 piece: view", "0"]
    );
    let case = "select: regular float32 [8, 2] / runs (4 positions)";
    assert_eq!(
        row("runs", case)[2..],
        ["2 pieces: 2 view", "0", "1 piece: gather", "32"]
    );
    let case = "select: regular float32 [8, 2] / negative-stride (8 positions)";
    assert_eq!(
        row("runs", case),
        ["declined", case, "-", "-", "1 piece: gather", "64"]
    );
    assert_eq!(
        row("coalesce", "pack: mixed")[2..],
        [
            "4 frames: 1 coalesced + 3 single",
            "55296",
            "104 frames: 104 single",
            "4096"
        ]
    );
}

#[test]
fn bench_times_answered_cases_apart_from_declined_ones() {
    for name in ["runs", "coalesce"] {
        let path = plugin_dir().join(format!("{name}.wasm"));
        let check = stowd_out(&["check"], &path);
        let (ok, declined) = (
            summary_count(&check, "ok"),
            summary_count(&check, "declined"),
        );
        let bench = stowd_out(&["bench", "--rounds", "2"], &path);
        assert!(
            bench.contains(&format!(
                "{} calls over 2 rounds of the conformance suite ({} cases a round: {ok} answered, {declined} declined, 0 failed)",
                2 * (ok + declined),
                ok + declined
            )),
            "{name}:\n{bench}"
        );
        let lines: Vec<&str> = bench.lines().collect();
        let header = lines
            .iter()
            .position(|l| l.starts_with("decision time (us)"))
            .unwrap();
        assert_eq!(
            cells(lines[header]),
            ["decision time (us)", "calls", "p50", "p90", "p99", "max"]
        );
        assert!(
            lines[..header]
                .iter()
                .any(|l| l.starts_with("entering the plugin on every call (memo off)")),
            "{name}:\n{bench}"
        );
        let table: Vec<Vec<String>> = lines[header + 1..]
            .iter()
            .take_while(|l| !l.trim().is_empty())
            .map(|l| cells(l))
            .collect();
        // Both are pure (memoized in stowd, runs' selections and
        // coalesce's packings): a second table shows the decisions
        // answered from the memo, which one round filled.
        assert!(
            bench.contains("with a memo of 4096 entries, filled by one round"),
            "{name}:\n{bench}"
        );
        let held = bench
            .split_once("are memoized; ")
            .and_then(|(_, rest)| rest.split_once(" held"))
            .and_then(|(n, _)| n.parse::<usize>().ok())
            .unwrap_or_else(|| panic!("{name}: no count held:\n{bench}"));
        assert!(held > 0, "{name}: an empty memo:\n{bench}");
        let labels: Vec<&str> = table.iter().map(|r| r[0].as_str()).collect();
        assert_eq!(
            labels,
            [
                "plugin, answered cases",
                "built-in, same cases",
                "plugin, declined cases",
                "built-in, same cases"
            ],
            "{name}:\n{bench}"
        );
        for (row, calls) in table.iter().zip([ok, ok, declined, declined]) {
            assert_eq!(row[1], (2 * calls).to_string(), "{name}: {row:?}");
            if calls == 0 {
                assert_eq!(row[2..], ["-", "-", "-", "-"], "{name}: {row:?}");
                continue;
            }
            let p: Vec<f64> = row[2..].iter().map(|v| v.parse().unwrap()).collect();
            assert!(p.windows(2).all(|w| w[0] <= w[1]), "{name}: {row:?}");
            assert!(p[0] > 0.0, "{name}: {row:?}");
        }
    }
}
