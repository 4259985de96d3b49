//! `cargo xtask wheel [--debug] [--no-pgo] [--out DIR]`: the Python package `stowage`
//! as a manylinux wheel with `stowd` inside, for `pip install` on every
//! node of a cluster (`stowage.ray` runs the packaged binary by default,
//! and the wheel puts a `stowd` command on PATH).
//!
//! Builds the plugins (`target/plugins`) and `stowd` (release, guided by
//! a profile of a training run, see `pgo.rs`; `--no-pgo`: a plain release
//! build; `--debug`: the dev profile, as `cargo xtask test` builds the
//! workspace), stages
//! them into the package's tree as `clients/python/stowage/_bin/stowd`
//! and `clients/python/stowage/plugins/*.wasm` (both ignored by git;
//! `<binary dir>/../plugins` is where stowd finds its bundled plugins, so
//! the installed binary works on its defaults), and runs `maturin build`, which compiles the client's Rust
//! core (`stowage._core`, abi3; with the same profile unless `--no-pgo`
//! or `--debug`), takes every file of the package, the
//! staged ones included, and writes
//! `DIR/stowage-<version>-cp311-abi3-manylinux_2_<N>_<arch>.whl` (default
//! `DIR`: `target/wheels`). The staged files are removed afterwards.
//!
//! The platform tag is the oldest glibc that the binary can run on: the
//! highest `GLIBC_2.N` symbol version stowd needs (read from its dynamic
//! string table), so the tag is what the build machine honestly allows,
//! `manylinux_2_28` on a glibc 2.28 build image. maturin audits the core
//! against the same tag and refuses the build if the core needs more;
//! `auditwheel show` on the wheel reports the same policy (the wheel test,
//! `tests/python/test_wheel.py`, checks it when auditwheel is installed).
//!
//! `--stage PACKAGE_DIR` only builds and stages (into `PACKAGE_DIR/_bin`
//! and `PACKAGE_DIR/plugins`), for the package's PEP 517 backend
//! (`clients/python/_build/stowage_build.py`), which then calls maturin
//! itself: `pip install ./clients/python` and a build from the sdist give
//! the same wheel, built without a profile (`--stage` never runs the
//! training: it would double a source install's build time).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::{
    Result, cargo, ensure_wasm_target, pgo, plugins, python, sh, target_dir, workspace_root,
};

pub fn wheel(args: &[String]) -> Result<()> {
    let root = workspace_root();
    let mut out = target_dir(&root).join("wheels");
    let mut debug = false;
    let mut profile = true;
    let mut stage: Option<PathBuf> = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--debug" => debug = true,
            "--no-pgo" => profile = false,
            "--out" => out = PathBuf::from(it.next().ok_or("--out needs a directory")?),
            s if s.starts_with("--out=") => out = PathBuf::from(&s["--out=".len()..]),
            "--stage" => {
                stage = Some(PathBuf::from(
                    it.next().ok_or("--stage needs the package directory")?,
                ))
            }
            other => return Err(format!("unknown argument `{other}`").into()),
        }
    }
    ensure_wasm_target()?;
    plugins(&[])?;
    // `--debug` is the wheel test's (tests/python/test_wheel.py, run by
    // `cargo xtask test`): stowd as the suite's one build made it, the
    // same command in the same environment, so nothing is rebuilt. A
    // build of stowage-host alone resolves its dependencies' features
    // apart from the workspace's and compiled wasmtime, cranelift, tokio
    // and 30 more crates again: 75 s of a clean CI's wheel test.
    let build: &[&str] = if debug {
        &["build", "--workspace", "--all-targets"]
    } else {
        &["build", "-p", "stowage-host", "--bin", "stowd", "--release"]
    };
    let plugin_dir = target_dir(&root).join("plugins");
    let guided = if profile && !debug && stage.is_none() {
        Some(pgo::build(&root, &plugin_dir)?)
    } else {
        sh(&cargo(), build, &[])?;
        None
    };
    let stowd = match &guided {
        Some(g) => g.stowd.clone(),
        None => target_dir(&root)
            .join(if debug { "debug" } else { "release" })
            .join("stowd"),
    };

    if let Some(package) = stage {
        return Staged::put(&package, &stowd, &plugin_dir).map(Staged::keep);
    }

    let package = root.join("clients").join("python");
    let tag = manylinux_tag(&stowd)?;
    ensure_maturin()?;
    std::fs::create_dir_all(&out)?;
    let out = out.canonicalize()?;
    let staged = Staged::put(&package.join("stowage"), &stowd, &plugin_dir)?;
    let py = python();
    let mut cmd = Command::new(&py);
    cmd.current_dir(&package)
        .args(["-m", "maturin", "build", "--compatibility", &tag, "--out"])
        .arg(&out);
    if !debug {
        cmd.arg("--release");
    }
    if let Some(g) = &guided {
        // The core with the same profile, built where the optimized
        // stowd was (the same flags: its dependencies are reused).
        cmd.args(["--target", &g.host]);
        cmd.envs(g.env.iter().map(|(k, v)| (*k, v)));
    }
    eprintln!("xtask: (in {}) {cmd:?}", package.display());
    let started = std::time::Instant::now();
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run {py} -m maturin: {e}"))?;
    drop(staged);
    if !status.success() {
        return Err(format!("maturin build failed ({status})").into());
    }
    eprintln!(
        "xtask: maturin build took {:.0} s; wheel in {}",
        started.elapsed().as_secs_f64(),
        out.display()
    );
    Ok(())
}

/// stowd and the plugins copied into the package's tree; removed on drop
/// (unless kept: `--stage`).
struct Staged {
    dirs: Vec<PathBuf>,
}

impl Staged {
    fn put(package: &Path, stowd: &Path, plugin_dir: &Path) -> Result<Staged> {
        if !package.join("__init__.py").is_file() {
            return Err(format!(
                "{} is not the stowage package (no __init__.py)",
                package.display()
            )
            .into());
        }
        let bin = package.join("_bin");
        let plugins = package.join("plugins");
        let staged = Staged {
            dirs: vec![bin.clone(), plugins.clone()],
        };
        for dir in &staged.dirs {
            if dir.exists() {
                std::fs::remove_dir_all(dir)
                    .map_err(|e| format!("cannot clear {}: {e}", dir.display()))?;
            }
            std::fs::create_dir_all(dir)?;
        }
        copy(stowd, &bin.join("stowd"))?;
        let mut wasm: Vec<PathBuf> = std::fs::read_dir(plugin_dir)
            .map_err(|e| format!("cannot list {}: {e}", plugin_dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "wasm"))
            .collect();
        wasm.sort();
        if wasm.is_empty() {
            return Err(format!("no plugins in {}", plugin_dir.display()).into());
        }
        for p in &wasm {
            let name = p.file_name().ok_or("plugin without a name")?;
            copy(p, &plugins.join(name))?;
        }
        eprintln!(
            "xtask: staged {} and {} plugins into {}",
            stowd.display(),
            wasm.len(),
            package.display()
        );
        Ok(staged)
    }

    fn keep(mut self) {
        self.dirs.clear();
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for dir in &self.dirs {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                eprintln!("xtask: cannot remove staged {}: {e}", dir.display());
            }
        }
    }
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .map_err(|e| format!("cannot copy {} to {}: {e}", from.display(), to.display()))?;
    Ok(())
}

/// `manylinux_2_N_<arch>`'s policy name for `binary`: N is the highest
/// `GLIBC_2.N[.M]` version among the strings of its dynamic string table
/// (the versions its symbols need), at least 17 (the oldest policy).
fn manylinux_tag(binary: &Path) -> Result<String> {
    use object::{Object, ObjectSection};
    let data = std::fs::read(binary).map_err(|e| format!("{}: {e}", binary.display()))?;
    let file = object::File::parse(&*data).map_err(|e| format!("{}: {e}", binary.display()))?;
    let dynstr = file.section_by_name(".dynstr").ok_or_else(|| {
        format!(
            "{} has no .dynstr: not dynamically linked?",
            binary.display()
        )
    })?;
    let strings = dynstr.data()?;
    let minor = glibc_minor(strings).unwrap_or(17).max(17);
    Ok(format!("manylinux_2_{minor}"))
}

/// The highest N of the `GLIBC_2.N` (or `GLIBC_2.N.M`) strings in a
/// string table (NUL-separated), if any.
fn glibc_minor(strings: &[u8]) -> Option<u32> {
    strings
        .split(|&b| b == 0)
        .filter_map(|s| s.strip_prefix(b"GLIBC_2."))
        .filter_map(|rest| {
            let digits: Vec<u8> = rest
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .copied()
                .collect();
            std::str::from_utf8(&digits).ok()?.parse().ok()
        })
        .max()
}

/// maturin, from PyPI when this Python lacks it.
fn ensure_maturin() -> Result<()> {
    let py = python();
    let found = Command::new(&py)
        .args(["-m", "maturin", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if found {
        return Ok(());
    }
    sh(&py, &["-m", "pip", "install", "-q", "maturin>=1.9,<2"], &[])
}

/// The environment `maturin build` gives cargo for the client's core
/// (maturin 1.x sets these four for a PyO3 abi3 module, `maturin build
/// -vv` shows them), for `cargo xtask test`'s own builds.
///
/// PyO3's build script reruns when one of them changes, and with it
/// `pyo3` and everything above it. The wheel test's `maturin build`
/// compiled PyO3 a second time after the suite's build had compiled it
/// without them, and the next suite build a third time. With them set
/// alike, maturin finds the suite's artifacts fresh.
///
/// `None` when `python` cannot be run (the build goes on without them;
/// only the reuse is lost).
pub fn maturin_env(python: &str) -> Option<Vec<(&'static str, OsString)>> {
    let out = Command::new(python)
        .args([
            "-c",
            "import sys; print(sys.executable); print(sys.implementation.name, *sys.version_info[:2], 64 if sys.maxsize > 2**32 else 32)",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let (exe, sig) = parse_interpreter(&text)?;
    Some(vec![
        ("PYO3_BUILD_EXTENSION_MODULE", "1".into()),
        ("PYO3_ENVIRONMENT_SIGNATURE", sig.into()),
        ("PYO3_PYTHON", exe.clone().into()),
        ("PYTHON_SYS_EXECUTABLE", exe.into()),
    ])
}

/// (executable, `cpython-3.11-64bit`) from the probe's two lines.
fn parse_interpreter(text: &str) -> Option<(String, String)> {
    let mut lines = text.lines();
    let exe = lines.next()?.trim();
    let mut parts = lines.next()?.split_whitespace();
    let (name, major, minor, bits) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if exe.is_empty() || parts.next().is_some() {
        return None;
    }
    Some((exe.to_string(), format!("{name}-{major}.{minor}-{bits}bit")))
}

#[cfg(test)]
mod tests {
    use super::{glibc_minor, parse_interpreter};

    #[test]
    fn glibc_minor_is_the_highest_version_named() {
        let table = b"\0libc.so.6\0GLIBC_2.2.5\0GLIBC_2.34\0GLIBC_2.3\0GCC_4.2.0\0memcpy\0";
        assert_eq!(glibc_minor(table), Some(34));
        assert_eq!(glibc_minor(b"\0GLIBC_PRIVATE\0GCC_3.0\0"), None);
        assert_eq!(glibc_minor(b""), None);
    }

    #[test]
    fn the_interpreter_probe_gives_maturins_signature() {
        assert_eq!(
            parse_interpreter("/usr/bin/python3\ncpython 3 11 64\n"),
            Some(("/usr/bin/python3".into(), "cpython-3.11-64bit".into()))
        );
        assert_eq!(parse_interpreter("/usr/bin/python3\n"), None);
        assert_eq!(parse_interpreter("\ncpython 3 11 64\n"), None);
        assert_eq!(parse_interpreter("/p\ncpython 3 11 64 extra\n"), None);
    }
}
