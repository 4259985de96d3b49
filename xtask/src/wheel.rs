//! `cargo xtask wheel [--debug] [--out DIR]`: the Python package `stowage`
//! as a wheel with `stowd` inside, for `pip install` on every node of a
//! cluster (`stowage.ray` runs the packaged binary by default).
//!
//! Builds the plugins (`target/plugins`) and `stowd` (release; `--debug`:
//! the dev profile), then writes `DIR/stowage-<version>-py3-none-<platform>.whl`
//! (default `DIR`: `target/wheels`) holding `stowage/**/*.py`,
//! `stowage/_core.abi3.so` (the client's Rust core, built in the same
//! profile), `stowage/_bin/stowd` and `stowage/plugins/*.wasm`. The plugins sit at
//! `<binary dir>/../plugins`, where `stowd` finds its bundled plugins, so
//! the installed binary works on its defaults. The wheel itself is written
//! by `wheel.py` (Python standard library only: no setuptools, no network).

use std::path::PathBuf;

use super::{Result, cargo, ensure_wasm_target, plugins, python, sh, target_dir, workspace_root};

const SCRIPT: &str = include_str!("wheel.py");

pub fn wheel(args: &[String]) -> Result<()> {
    let root = workspace_root();
    let mut out = target_dir(&root).join("wheels");
    let mut debug = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--debug" => debug = true,
            "--out" => out = PathBuf::from(it.next().ok_or("--out needs a directory")?),
            s if s.starts_with("--out=") => out = PathBuf::from(&s["--out=".len()..]),
            other => return Err(format!("unknown argument `{other}`").into()),
        }
    }
    ensure_wasm_target()?;
    plugins(&[])?;
    // `--lib` too: with `--bin stowd` alone cargo builds bin targets only,
    // and the core (a cdylib) is stowage-pycore's lib target; without it a
    // fresh target directory had no lib_core.so for the wheel.
    let mut build = vec![
        "build",
        "-p",
        "stowage-host",
        "--bin",
        "stowd",
        "-p",
        "stowage-pycore",
        "--lib",
    ];
    if !debug {
        build.push("--release");
    }
    sh(&cargo(), &build, &[])?;
    let built = target_dir(&root).join(if debug { "debug" } else { "release" });
    let stowd = built.join("stowd");
    let core = built.join("lib_core.so");
    let plugin_dir = target_dir(&root).join("plugins");
    let package = root.join("clients").join("python");

    let py = python();
    eprintln!("xtask: {py} - (wheel.py)");
    let mut child = std::process::Command::new(&py)
        .current_dir(&root)
        .arg("-")
        .arg("--package")
        .arg(&package)
        .arg("--stowd")
        .arg(&stowd)
        .arg("--plugins")
        .arg(&plugin_dir)
        .arg("--core")
        .arg(&core)
        .arg("--out")
        .arg(&out)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {py}: {e}"))?;
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().ok_or("no stdin for wheel.py")?;
        stdin.write_all(SCRIPT.as_bytes())?;
    }
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("wheel.py failed ({status})").into());
    }
    Ok(())
}
