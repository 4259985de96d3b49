//! `stowd plugin check` on every bundled plugin (passes) and on every
//! hostile test plugin (fails with a readable report); `stowd plugin list`
//! against a running stowd.

use std::process::Command;

use stowage_tests::{hostile, plugin_dir};

fn stowd() -> std::path::PathBuf {
    std::env::var_os("STOWD_BIN")
        .map(Into::into)
        .unwrap_or_else(|| stowage_tests::workspace_root().join("target/debug/stowd"))
}

fn check(path: &std::path::Path) -> (bool, String) {
    let out = Command::new(stowd())
        .args(["plugin", "check", "--fuel", "10000000"])
        .arg(path)
        .output()
        .expect("run stowd plugin check");
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
    }
}
