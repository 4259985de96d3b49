//! Stowage build tasks, run as `cargo xtask <command>` (alias in
//! `.cargo/config.toml`). Only std, `sha2` (which the host builds
//! anyway) and `object`'s ELF reader, so it builds in seconds.
//!
//! Commands:
//! - `plugins [--out DIR] [--hostile]`: builds every crate under `plugins/`
//!   (and with `--hostile` every crate under `tests/hostile/`) as a
//!   `wasm32-wasip2` component with the `plugin` profile, copies each to
//!   `DIR/<dir-name>.wasm` (hostile ones to `DIR/hostile/<dir-name>.wasm`;
//!   default `DIR` is `<workspace>/target/plugins`), checks that each is a
//!   component exporting the `stowage:policy@0.1.0` interfaces, and prints
//!   its name and size.
//!
//! - `run [-- ARGS]`: installs the wasm target if missing, builds the
//!   plugins into `target/plugins` (where `stowd` finds them: the bundled
//!   plugins) and runs `stowd serve ARGS`.
//! - `test`: checks that no released WIT contract changed (`contract.rs`)
//!   and that no crate's modules import each other in a cycle (`cycles.rs`),
//!   installs what is missing (wasm target, rustfmt and clippy, Python
//!   packages), checks the formatting (`cargo fmt --all -- --check`),
//!   builds the plugins (hostile ones too), then `stowd` and every target
//!   of the workspace in one cargo build that clippy lints on the way
//!   (`-D warnings`, see [`LINT`]), runs `cargo test --workspace` (which
//!   includes every fuzz target's committed corpus and regressions as
//!   regression inputs, `tests/tests/fuzz_corpora.rs`), then the Python
//!   suite with pytest.
//! - `contract`: only the released-contract check.
//! - `cycles`: only the module-cycle check (`cycles.rs`), which `test`
//!   runs first too.
//! - `wheel [--debug] [--no-pgo] [--out DIR]`: the `stowage` wheel with
//!   stowd and the plugins inside, built by maturin (`wheel.rs`), stowd and
//!   the client's core guided by a profile (`pgo.rs`).
//! - `fuzz [TARGET] [--time SECS] [--sanitizer NAME]`: runs the cargo-fuzz
//!   targets in `fuzz/` (installs nightly and cargo-fuzz if missing).
//!
//! To add a command: write `fn name(args: &[String]) -> Result<()>` and add
//! a line to [`COMMANDS`].

mod pgo;
mod wheel;

mod contract;
mod cycles;
mod fuzz;

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// A command: name, usage line, entry point.
type Cmd = (&'static str, &'static str, fn(&[String]) -> Result<()>);

/// Every command, in the order `help` lists them.
const COMMANDS: &[Cmd] = &[
    (
        "plugins",
        "plugins [--out DIR] [--hostile]   build plugins/* (and tests/hostile/*) to DIR/<name>.wasm",
        plugins,
    ),
    (
        "run",
        "run [-- STOWD ARGS]               set up, build the plugins and stowd, run `stowd serve` on its defaults",
        run,
    ),
    (
        "test",
        "test                              set up, build everything, run every Rust and Python test",
        test,
    ),
    (
        "contract",
        "contract                          check that no released WIT contract (wit/since_v*/) changed",
        contract::contract,
    ),
    (
        "fuzz",
        "fuzz [TARGET] [--time SECS]       run the fuzz targets (cargo-fuzz, nightly) for SECS each (default 60)",
        fuzz::fuzz,
    ),
    (
        "cycles",
        "cycles                            check that no crate's top-level modules import each other in a cycle",
        cycles::cycles,
    ),
    (
        "wheel",
        "wheel [--debug] [--no-pgo] [--out DIR]  build the plugins and stowd (release, profile-guided; --no-pgo: without the training run; --debug: the dev profile, as `xtask test` builds the workspace) and, with maturin, a manylinux stowage wheel holding them (target/wheels)",
        wheel::wheel,
    ),
];

const TARGET: &str = "wasm32-wasip2";
const PROFILE: &str = "plugin";
/// Interfaces every policy component must export, without version.
const EXPORTS: &[&str] = &[
    "stowage:policy/meta@",
    "stowage:policy/selection@",
    "stowage:policy/packing@",
];
/// Contract versions a component may export (the SDK builds for the last;
/// a hand-written plugin, such as the forged-handle test, may target 0.1.0).
const VERSIONS: &[&str] = &["0.1.0", "0.2.0"];

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let Some(name) = args.first() else {
        usage();
        return ExitCode::FAILURE;
    };
    if matches!(name.as_str(), "help" | "-h" | "--help") {
        usage();
        return ExitCode::SUCCESS;
    }
    let Some((_, _, run)) = COMMANDS.iter().find(|(n, _, _)| n == name) else {
        eprintln!("xtask: unknown command `{name}`");
        usage();
        return ExitCode::FAILURE;
    };
    match run(&args[1..]) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask {name}: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage() {
    eprintln!("usage: cargo xtask <command>\n\ncommands:");
    for (_, line, _) in COMMANDS {
        eprintln!("  {line}");
    }
}

/// The workspace root (the parent of this crate).
fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(Path::to_path_buf).unwrap_or(manifest)
}

/// The cargo target directory.
fn target_dir(root: &Path) -> PathBuf {
    match env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir),
        None => root.join("target"),
    }
}

/// A plugin crate found on disk.
struct Crate {
    /// Directory name: the artifact is `<dir_name>.wasm`.
    dir_name: String,
    /// Cargo package name (for `-p`).
    package: String,
    /// Library target name: cargo writes `<lib_name>.wasm`.
    lib_name: String,
    /// Where the artifact goes.
    out: PathBuf,
}

fn plugins(args: &[String]) -> Result<()> {
    let root = workspace_root();
    let mut out_dir = target_dir(&root).join("plugins");
    let mut hostile = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--hostile" => hostile = true,
            "--out" => out_dir = PathBuf::from(it.next().ok_or("--out needs a directory")?),
            s if s.starts_with("--out=") => out_dir = PathBuf::from(&s["--out=".len()..]),
            other => return Err(format!("unknown argument `{other}`").into()),
        }
    }

    let mut crates = discover(&root.join("plugins"), &out_dir)?;
    if hostile {
        crates.extend(discover(
            &root.join("tests").join("hostile"),
            &out_dir.join("hostile"),
        )?);
    }
    if crates.is_empty() {
        return Err("no plugin crates found".into());
    }

    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(&root)
        .args(["build", "--target", TARGET, "--profile", PROFILE]);
    for c in &crates {
        build.args(["-p", &c.package]);
    }
    let status = build
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build failed ({status})").into());
    }

    let built = target_dir(&root).join(TARGET).join(PROFILE);
    let width = crates
        .iter()
        .map(|c| c.dir_name.len() + 8)
        .max()
        .unwrap_or(0);
    for c in &crates {
        let from = built.join(format!("{}.wasm", c.lib_name));
        let bytes = fs::read(&from).map_err(|e| format!("{}: {e}", from.display()))?;
        check_component(&bytes).map_err(|e| format!("{}: {e}", from.display()))?;
        if let Some(parent) = c.out.parent() {
            fs::create_dir_all(parent)?;
        }
        fs::write(&c.out, &bytes).map_err(|e| format!("{}: {e}", c.out.display()))?;
        let label = if c.out.parent().is_some_and(|p| p.ends_with("hostile")) {
            format!("hostile/{}", c.dir_name)
        } else {
            c.dir_name.clone()
        };
        println!(
            "{label:<width$} {:>8} bytes  {}",
            bytes.len(),
            c.out.display()
        );
    }
    Ok(())
}

/// Every directory under `dir` holding a `Cargo.toml`, sorted by name.
fn discover(dir: &Path, out_dir: &Path) -> Result<Vec<Crate>> {
    let mut crates = Vec::new();
    let entries = fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        let manifest = path.join("Cargo.toml");
        if !manifest.is_file() {
            continue;
        }
        let text = fs::read_to_string(&manifest)?;
        let package = toml_value(&text, "package", "name")
            .ok_or_else(|| format!("{}: no [package] name", manifest.display()))?;
        let lib_name =
            toml_value(&text, "lib", "name").unwrap_or_else(|| package.replace('-', "_"));
        let dir_name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or("bad directory name")?
            .to_string();
        let out = out_dir.join(format!("{dir_name}.wasm"));
        crates.push(Crate {
            dir_name,
            package,
            lib_name,
            out,
        });
    }
    crates.sort_by(|a, b| a.dir_name.cmp(&b.dir_name));
    Ok(crates)
}

/// The string value of `key` in `[section]` of a simple TOML file.
fn toml_value(text: &str, section: &str, key: &str) -> Option<String> {
    let mut current = "";
    for line in text.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = name.trim();
            continue;
        }
        if current != section {
            continue;
        }
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        if k.trim() == key {
            let v = v.trim();
            return v
                .strip_prefix('"')
                .and_then(|v| v.split('"').next())
                .map(str::to_string);
        }
    }
    None
}

/// A component (not a core module) that names every policy export.
fn check_component(bytes: &[u8]) -> Result<()> {
    // Magic, then version 0x0d and layer 1 for components (core modules: 1, 0).
    if bytes.get(..8) != Some(b"\0asm\x0d\0\x01\0") {
        return Err("not a WebAssembly component".into());
    }
    let mentions = |s: &str| bytes.windows(s.len()).any(|w| w == s.as_bytes());
    let speaks = |v: &&str| EXPORTS.iter().all(|e| mentions(&format!("{e}{v}")));
    if VERSIONS.iter().any(speaks) {
        return Ok(());
    }
    Err(format!(
        "does not mention the exports {} of one contract version ({})",
        EXPORTS.join("VERSION, ") + "VERSION",
        VERSIONS.join(", ")
    )
    .into())
}

/// Runs a command in the workspace root; fails on a non-zero exit.
fn sh(program: &str, args: &[&str], envs: &[(&str, &std::ffi::OsStr)]) -> Result<()> {
    sh_timed(program, args, envs, true)
}

/// As [`sh`]; `timed: false` prints nothing after the command, so that a
/// test runner's own summary lines end the output.
fn sh_timed(
    program: &str,
    args: &[&str],
    envs: &[(&str, &std::ffi::OsStr)],
    timed: bool,
) -> Result<()> {
    let root = workspace_root();
    eprintln!("xtask: {program} {}", args.join(" "));
    let started = std::time::Instant::now();
    let status = Command::new(program)
        .current_dir(&root)
        .args(args)
        .envs(envs.iter().map(|(k, v)| (*k, *v)))
        .status()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if !status.success() {
        return Err(format!("`{program} {}` failed ({status})", args.join(" ")).into());
    }
    if !timed {
        return Ok(());
    }
    eprintln!(
        "xtask: {program} {} took {:.0} s",
        args.join(" "),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Installs the wasm32-wasip2 target when rustup lacks it.
fn ensure_wasm_target() -> Result<()> {
    let listed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output();
    match listed {
        Ok(out)
            if String::from_utf8_lossy(&out.stdout)
                .lines()
                .any(|l| l.trim() == TARGET) =>
        {
            Ok(())
        }
        Ok(_) => sh("rustup", &["target", "add", TARGET], &[]),
        Err(_) => {
            eprintln!("xtask: rustup not found; assuming the {TARGET} target is installed");
            Ok(())
        }
    }
}

/// The Python interpreter for the test suite.
fn python() -> String {
    env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The Python test dependencies: (pip name, module name).
const PYTHON_DEPS: &[(&str, &str)] = &[
    // The tests' own ZeroMQ peers (the client itself needs no pyzmq).
    ("pyzmq", "zmq"),
    ("msgpack", "msgpack"),
    ("numpy", "numpy"),
    ("pytest", "pytest"),
    ("tomli-w", "tomli_w"),
    // The float8 client tests read float8 fields as ml_dtypes arrays.
    ("ml_dtypes", "ml_dtypes"),
    // The wheel test (tests/python/test_wheel.py): maturin builds the
    // wheel, auditwheel checks its manylinux tag.
    ("maturin", "maturin"),
    ("auditwheel", "auditwheel"),
];

/// Installs the Python test dependencies when one is missing.
fn ensure_python_deps() -> Result<()> {
    let py = python();
    let modules: Vec<&str> = PYTHON_DEPS.iter().map(|(_, m)| *m).collect();
    let probe = Command::new(&py)
        .args(["-c", &format!("import {}", modules.join(", "))])
        .output();
    let mut install = vec!["-m", "pip", "install", "-q"];
    install.extend(PYTHON_DEPS.iter().map(|(p, _)| *p));
    match probe {
        Ok(out) if out.status.success() => Ok(()),
        Ok(_) => sh(&py, &install, &[]),
        Err(e) => Err(format!("cannot run {py}: {e}").into()),
    }
}

/// Clippy's arguments for the test build: what `cargo clippy -- -D
/// warnings` passes to `clippy-driver` (cargo-clippy hands them over in
/// `CLIPPY_ARGS`, each followed by `__CLIPPY_HACKERY__`).
///
/// Why clippy runs as the build's `RUSTC_WORKSPACE_WRAPPER` instead of as
/// `cargo clippy`: `cargo clippy` is a check build, whose dependencies
/// (wasmtime and cranelift among them) are compiled a second time as
/// metadata only; as the wrapper, clippy lints each workspace crate inside
/// the one build the tests need anyway, and every dependency is compiled
/// once (see `docs/benchmarks.md`, "CI time", for the measured cost of the
/// separate check build). The lints and the `-D warnings` are the same.
const LINT: &str = "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__";

/// The `clippy-driver` of the toolchain in use.
fn clippy_driver() -> Result<PathBuf> {
    let out = Command::new("rustup")
        .args(["which", "clippy-driver"])
        .current_dir(workspace_root())
        .output();
    if let Ok(out) = out
        && out.status.success()
    {
        return Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    }
    // Without rustup: next to cargo, or on the PATH.
    let beside = env::var_os("CARGO")
        .map(PathBuf::from)
        .and_then(|c| c.parent().map(|d| d.join("clippy-driver")));
    match beside {
        Some(p) if p.exists() => Ok(p),
        _ => Ok(PathBuf::from("clippy-driver")),
    }
}

/// Installs rustup components (rustfmt, clippy) when missing.
fn ensure_components(names: &[&str]) -> Result<()> {
    let listed = Command::new("rustup")
        .args(["component", "list", "--installed"])
        .current_dir(workspace_root())
        .output();
    let Ok(out) = listed else {
        eprintln!(
            "xtask: rustup not found; assuming {} are installed",
            names.join(" and ")
        );
        return Ok(());
    };
    let installed = String::from_utf8_lossy(&out.stdout);
    let missing: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| !installed.lines().any(|l| l.starts_with(&format!("{n}-"))))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let mut args = vec!["component", "add"];
    args.extend(missing);
    sh("rustup", &args, &[])
}

/// Puts the Python client's Rust core (`lib_core.so`, built by the
/// workspace build in `built`) into the package's tree as
/// `stowage/_core.abi3.so`, where the tests import the package from (`pip
/// install ./clients/python` builds it with maturin instead).
fn install_core(built: &std::path::Path) -> Result<()> {
    let from = built.join("lib_core.so");
    let to = workspace_root()
        .join("clients")
        .join("python")
        .join("stowage")
        .join("_core.abi3.so");
    // A fresh file, not an overwrite: a process may have the old one mapped.
    let tmp = to.with_extension("so.tmp");
    std::fs::copy(&from, &tmp)
        .and_then(|_| std::fs::rename(&tmp, &to))
        .map_err(|e| format!("cannot install {} as {}: {e}", from.display(), to.display()))?;
    eprintln!("xtask: {} -> {}", from.display(), to.display());
    Ok(())
}

fn cargo() -> String {
    env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn run(args: &[String]) -> Result<()> {
    ensure_wasm_target()?;
    plugins(&[])?;
    let mut cmd = vec![
        "run",
        "-q",
        "-p",
        "stowage-host",
        "--bin",
        "stowd",
        "--",
        "serve",
    ];
    let extra: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| *a != "--")
        .collect();
    cmd.extend(extra);
    sh(&cargo(), &cmd, &[])
}

fn test(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        return Err(format!("unknown argument `{a}`").into());
    }
    contract::contract(&[])?;
    cycles::cycles(&[])?;
    ensure_wasm_target()?;
    ensure_components(&["rustfmt", "clippy"])?;
    ensure_python_deps()?;
    sh(&cargo(), &["fmt", "--all", "--", "--check"], &[])?;
    plugins(&["--hostile".to_string()])?;
    let root = workspace_root();
    let plugin_dir = target_dir(&root).join("plugins");
    let stowd = target_dir(&root).join("debug").join("stowd");
    let driver = clippy_driver()?;
    let mut envs: Vec<(&str, &std::ffi::OsStr)> = vec![
        ("STOWAGE_PLUGIN_DIR", plugin_dir.as_os_str()),
        ("STOWD_BIN", stowd.as_os_str()),
        ("RUSTC_WORKSPACE_WRAPPER", driver.as_os_str()),
        ("CLIPPY_ARGS", std::ffi::OsStr::new(LINT)),
    ];
    // As maturin builds the core, so that the wheel test's maturin build
    // reuses this build's PyO3 (wheel::maturin_env).
    let pyo3 = wheel::maturin_env(&python()).unwrap_or_default();
    envs.extend(pyo3.iter().map(|(k, v)| (*k, v.as_os_str())));
    // One cargo build for `stowd` (and the other binaries), every test
    // binary and the benches, so cargo schedules them all together, linted
    // by clippy on the way; `cargo test` (same environment, so nothing is
    // rebuilt) then only builds the doc tests.
    sh(&cargo(), &["build", "--workspace", "--all-targets"], &envs)?;
    install_core(&target_dir(&root).join("debug"))?;
    sh(&cargo(), &["test", "--workspace"], &envs)?;
    // Last, and untimed: pytest's summary ends the output, after its 15
    // slowest steps (where CI's time goes).
    sh_timed(
        &python(),
        &[
            "-m",
            "pytest",
            "tests/python",
            "clients/python/tests",
            "-q",
            "--durations=15",
        ],
        &envs,
        false,
    )
}
