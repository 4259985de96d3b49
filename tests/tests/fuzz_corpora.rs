//! The fuzz corpora as regression inputs: every committed input of every
//! fuzz target (`fuzz/corpus/T/*` and the crash regressions
//! `fuzz/regressions/T/*`) through the target's own body and invariant
//! checks (`stowage_fuzz_checks`, the functions the cargo-fuzz targets
//! call), on stable, without libFuzzer. Fuzzing itself (new inputs) is
//! `cargo xtask fuzz`.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use stowage_fuzz_checks::TARGETS;

/// `fuzz/` in the repository.
fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("fuzz")
}

/// Every file in `dir`, sorted; none if the directory does not exist.
fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    out
}

/// Runs every corpus and regression input of `target`; fails naming each
/// input whose check panicked. Returns how many inputs ran.
fn run(target: &str) -> usize {
    let (_, check) = TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .expect("a known target");
    let fuzz = fuzz_dir();
    let inputs: Vec<PathBuf> = ["corpus", "regressions"]
        .iter()
        .flat_map(|kind| files(&fuzz.join(kind).join(target)))
        .collect();
    assert!(
        !inputs.is_empty(),
        "no inputs for {target} under {}",
        fuzz.display()
    );
    let mut failed = Vec::new();
    for path in &inputs {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if catch_unwind(AssertUnwindSafe(|| check(&data))).is_err() {
            failed.push(path.display().to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{target}: {} of {} inputs fail its checks:\n{}",
        failed.len(),
        inputs.len(),
        failed.join("\n")
    );
    inputs.len()
}

#[test]
fn every_target_has_a_corpus_test() {
    let names: Vec<&str> = TARGETS.iter().map(|(name, _)| *name).collect();
    assert_eq!(
        names,
        [
            "tq_decode",
            "native_decode",
            "plan_validate",
            "zmtp_frames",
            "checkpoint_file",
            "plain_handshake",
            "curve_handshake"
        ],
        "add a test below for a new target"
    );
    for name in names {
        assert!(
            fuzz_dir()
                .join("fuzz_targets")
                .join(format!("{name}.rs"))
                .is_file(),
            "no cargo-fuzz target {name}"
        );
    }
}

#[test]
fn tq_decode_corpus() {
    // The seeds include the golden TransferQueue fixtures.
    assert!(run("tq_decode") >= 400);
}

#[test]
fn native_decode_corpus() {
    assert!(run("native_decode") >= 600);
}

#[test]
fn plan_validate_corpus() {
    assert!(run("plan_validate") >= 800);
}

#[test]
fn zmtp_frames_corpus() {
    assert!(run("zmtp_frames") >= 80);
}

#[test]
fn checkpoint_file_corpus() {
    // The seeds (`fuzz/checks/src/checkpoint_file.rs`, `seeds`) and what
    // the runs found.
    assert!(run("checkpoint_file") >= 50);
}

/// The committed `checkpoint_file` seeds are what
/// `stowage_fuzz_checks::checkpoint_file::seeds` makes (with
/// `STOWAGE_WRITE_SEEDS=1`: writes them).
#[test]
fn checkpoint_file_seeds_current() {
    let dir = fuzz_dir().join("corpus").join("checkpoint_file");
    let write = std::env::var_os("STOWAGE_WRITE_SEEDS").is_some();
    for (name, bytes) in stowage_fuzz_checks::checkpoint_file::seeds() {
        let path = dir.join(name);
        if write {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        }
        let committed = std::fs::read(&path).unwrap_or_default();
        assert!(
            committed == bytes,
            "{} is not the seed `seeds()` makes (STOWAGE_WRITE_SEEDS=1 rewrites it)",
            path.display()
        );
        // Which the readers accept: stowd's own files and the one out of
        // entry order.
        let rows = stowage_host::checkpoint::parse_untrusted(&bytes);
        let unit = [
            "seed-rows",
            "seed-every-kind",
            "seed-no-rows",
            "seed-offsets-out-of-order",
        ];
        assert_eq!(rows.is_some(), unit.contains(&name), "{name}: {rows:?}");
    }
}

#[test]
fn plain_handshake_corpus() {
    // The seeds (`fuzz/checks/src/plain_handshake.rs`, `seeds`) and what
    // the runs found.
    assert!(run("plain_handshake") >= 80);
}

#[test]
fn curve_handshake_corpus() {
    // The seeds (`fuzz/checks/src/curve_handshake.rs`, `seeds`) and what
    // the runs found.
    assert!(run("curve_handshake") >= 120);
}

/// Checks that the committed seeds of `target` are `seeds` (with
/// `STOWAGE_WRITE_SEEDS=1`: writes them).
fn seeds_current(target: &str, seeds: Vec<(String, Vec<u8>)>) {
    let dir = fuzz_dir().join("corpus").join(target);
    let write = std::env::var_os("STOWAGE_WRITE_SEEDS").is_some();
    for (name, bytes) in seeds {
        let path = dir.join(&name);
        if write {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        }
        let committed = std::fs::read(&path).unwrap_or_default();
        assert!(
            committed == bytes,
            "{} is not the seed `seeds()` makes (STOWAGE_WRITE_SEEDS=1 rewrites it)",
            path.display()
        );
    }
}

/// The committed `plain_handshake` seeds are what
/// `stowage_fuzz_checks::plain_handshake::seeds` makes.
#[test]
fn plain_handshake_seeds_current() {
    let seeds = stowage_fuzz_checks::plain_handshake::seeds()
        .into_iter()
        .map(|(name, bytes)| (name.to_string(), bytes))
        .collect();
    seeds_current("plain_handshake", seeds);
}

/// The committed `curve_handshake` seeds are what
/// `stowage_fuzz_checks::curve_handshake::seeds` makes.
#[test]
fn curve_handshake_seeds_current() {
    seeds_current(
        "curve_handshake",
        stowage_fuzz_checks::curve_handshake::seeds(),
    );
}
