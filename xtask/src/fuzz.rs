//! The fuzz targets in `fuzz/` (cargo-fuzz, libFuzzer), run with
//! `cargo xtask fuzz [TARGET] [--time SECS] [--sanitizer NAME]`.
//! `cargo xtask test` does not fuzz: it runs the committed corpora and
//! regressions through the targets' bodies (`stowage-fuzz-checks`) on
//! stable, in `cargo test` (`tests/tests/fuzz_corpora.rs`).
//!
//! Needs the nightly toolchain and cargo-fuzz; both are installed when
//! missing. The fuzz crate is its own workspace and builds into
//! `fuzz/target` (or `$STOWAGE_FUZZ_TARGET_DIR`). Each run reads the committed corpus (`fuzz/corpus/T`) and
//! the crash regressions (`fuzz/regressions/T`), and writes new inputs to a
//! scratch corpus, `fuzz/target/corpus/T`, so the committed files never
//! change under a run; a crash is written to `fuzz/artifacts/T/` and fails
//! the command.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use crate::{Result, workspace_root};

/// Every fuzz target, in the order they run.
pub const TARGETS: &[&str] = &[
    "tq_decode",
    "native_decode",
    "plan_validate",
    "zmtp_frames",
    "checkpoint_file",
    "plain_handshake",
    "curve_handshake",
];

/// Build and run options.
#[derive(Clone, Debug)]
pub struct Options {
    /// Seconds per target (`-max_total_time`).
    pub secs: u64,
    /// `address` (cargo-fuzz's default), `none`, ...
    pub sanitizer: String,
}

/// `cargo xtask fuzz [TARGET] [--time SECS] [--sanitizer NAME]`.
pub fn fuzz(args: &[String]) -> Result<()> {
    let mut opts = Options {
        secs: 60,
        sanitizer: "address".into(),
    };
    let mut targets: Vec<&str> = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--time" => {
                let v = it.next().ok_or("--time needs a number of seconds")?;
                opts.secs = v
                    .parse()
                    .map_err(|_| format!("--time: `{v}` is not a number of seconds"))?;
            }
            "--sanitizer" => opts.sanitizer = it.next().ok_or("--sanitizer needs a name")?.clone(),
            other => match TARGETS.iter().find(|t| **t == other) {
                Some(t) => targets.push(t),
                None => {
                    return Err(format!(
                        "unknown argument `{other}` (targets: {})",
                        TARGETS.join(", ")
                    )
                    .into());
                }
            },
        }
    }
    if targets.is_empty() {
        targets = TARGETS.to_vec();
    }
    run_targets(&targets, &opts)
}

/// Installs what is missing, builds every target once, then runs each in
/// turn, one process each (the machines are small); fails on the first
/// crash.
pub fn run_targets(targets: &[&str], opts: &Options) -> Result<()> {
    ensure_nightly()?;
    ensure_cargo_fuzz()?;
    let started = Instant::now();
    let mut build = vec!["build".to_string()];
    build.extend(build_flags(opts));
    cargo_fuzz(&build)?;
    eprintln!(
        "xtask: fuzz build took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let root = workspace_root();
    for t in targets {
        let fuzz = root.join("fuzz");
        let scratch = fuzz.join("target").join("corpus").join(t);
        let artifacts = fuzz.join("artifacts").join(t);
        std::fs::create_dir_all(&scratch)?;
        std::fs::create_dir_all(&artifacts)?;
        let mut args = vec!["run".to_string(), (*t).to_string()];
        args.extend(build_flags(opts));
        args.push(path(&scratch));
        for dir in [
            fuzz.join("corpus").join(t),
            fuzz.join("regressions").join(t),
        ] {
            if dir.is_dir() {
                args.push(path(&dir));
            }
        }
        args.extend([
            "--".into(),
            format!("-max_total_time={}", opts.secs),
            // One in-process job (libFuzzer's -jobs=N would fork workers
            // that log to ./fuzz-N.log instead of the terminal).
            "-print_final_stats=1".into(),
            format!("-artifact_prefix={}/", path(&artifacts)),
        ]);
        let t0 = Instant::now();
        cargo_fuzz(&args).map_err(|e| {
            format!(
                "fuzz target {t} failed (a crash is in {}): {e}",
                artifacts.display()
            )
        })?;
        eprintln!(
            "xtask: fuzz target {t}: no crash in {:.0} s",
            t0.elapsed().as_secs_f64()
        );
    }
    eprintln!(
        "xtask: fuzzing took {:.0} s in all (build included)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Flags `cargo fuzz build` and `cargo fuzz run` must share (or `run`
/// rebuilds). Build time is kept down in `fuzz/Cargo.toml` instead (the
/// host's dependencies the targets never run are built unoptimised).
///
/// `STOWAGE_FUZZ_TARGET_DIR`, if set, is the build's target directory (e.g.
/// one under a shared build cache) instead of `fuzz/target`.
fn build_flags(opts: &Options) -> Vec<String> {
    let mut flags = vec!["--sanitizer".into(), opts.sanitizer.clone()];
    if let Some(dir) = std::env::var_os("STOWAGE_FUZZ_TARGET_DIR") {
        flags.extend(["--target-dir".into(), dir.to_string_lossy().into_owned()]);
    }
    flags
}

fn path(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// `cargo +nightly fuzz ARGS` in the repository root, with nothing of the
/// stable toolchain that runs xtask leaking in.
fn cargo_fuzz(args: &[String]) -> Result<()> {
    let mut all = vec!["+nightly".to_string(), "fuzz".to_string()];
    all.extend(args.iter().cloned());
    eprintln!("xtask: cargo {}", all.join(" "));
    let status = nightly_cargo()
        .args(&all)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("`cargo {}` failed ({status})", all.join(" ")).into());
    }
    Ok(())
}

/// The rustup `cargo` proxy (not `$CARGO`, the stable toolchain's own
/// binary, which does not understand `+nightly`), in the repository root,
/// building into `fuzz/target` whatever `CARGO_TARGET_DIR` says.
fn nightly_cargo() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(workspace_root());
    for var in [
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTDOC",
        "CARGO",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET_DIR",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

fn ensure_nightly() -> Result<()> {
    let ok = nightly_cargo()
        .args(["+nightly", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Ok(());
    }
    crate::sh(
        "rustup",
        &["toolchain", "install", "nightly", "--profile", "minimal"],
        &[],
    )
}

fn ensure_cargo_fuzz() -> Result<()> {
    let ok = nightly_cargo()
        .args(["+nightly", "fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Ok(());
    }
    crate::sh(&crate::cargo(), &["install", "cargo-fuzz", "--locked"], &[])
}
