//! A profile-guided build of `stowd` and the client's Rust core, for the
//! release wheel (`cargo xtask wheel`; `--no-pgo` skips it).
//!
//! Why: a small call's time on either side is mostly code run once per
//! call from cold caches, and LLVM lays out and inlines that code better
//! when it knows which paths run. Measured on the development VM (2 CPUs,
//! both builds fat-LTO, `docs/benchmarks.md`, "Profile-guided builds"):
//! `stowd`'s CPU per call 0.78-0.87x of the plain build's on small puts
//! and gets, the client process's 0.88-0.94x. rustc's own
//! `-Cprofile-generate` / `-Cprofile-use` and the toolchain's
//! `llvm-profdata` (rustup's `llvm-tools` component) do the work; nothing
//! here is hand-written instrumentation.
//!
//! The steps, all under `<target>/pgo/`:
//! 1. `generate/`: `stowd` and the core built with `-Cprofile-generate`,
//!    each writing its profile into a directory of its own under `raw/`;
//! 2. `train/stowage`: a copy of the Python package with the instrumented
//!    core as its `_core.abi3.so`;
//! 3. `bench/pgo_train.py` drives the instrumented `stowd` through that
//!    package (small and large puts and gets, sync and async, plugins and
//!    the built-in, a same-node get), stopping each `stowd` with SIGTERM
//!    so that it writes its profile; it checks what it reads back;
//! 4. `llvm-profdata merge` of both profiles into `stowage.profdata`;
//! 5. `use/`: `stowd` built with `-Cprofile-use`, and the environment for
//!    maturin's build of the core with the same profile.
//!
//! The builds name the host's target triple (`--target`), so `RUSTFLAGS`
//! reaches the binaries only, not build scripts and proc macros, and
//! they live in target directories of their own: the workspace's builds
//! are untouched, and each profile's build is a full one (the flags differ).
//!
//! Each step's failure is an error that says which step and what to do
//! (`--no-pgo` builds the wheel without a profile).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::{Result, cargo, ensure_components, python, sh, target_dir};

/// What the wheel's build takes from a profile-guided build.
pub struct Built {
    /// The optimized `stowd`.
    pub stowd: PathBuf,
    /// Environment for maturin's build of the core: the same flags and
    /// target directory as the optimized `stowd`'s build.
    pub env: Vec<(&'static str, OsString)>,
    /// The host's target triple, for maturin's `--target`.
    pub host: String,
}

/// Runs steps 1-5 (see the module doc) and returns the optimized `stowd`.
pub fn build(root: &Path, plugin_dir: &Path) -> Result<Built> {
    let host = host_triple()?;
    let profdata_tool = llvm_profdata(&host)?;
    let dir = target_dir(root).join("pgo");
    let raw = dir.join("raw");
    if raw.exists() {
        std::fs::remove_dir_all(&raw)
            .map_err(|e| format!("cannot clear {}: {e}", raw.display()))?;
    }
    let generate = dir.join("generate");
    let base = caller_flags(
        std::env::var_os("CARGO_ENCODED_RUSTFLAGS"),
        std::env::var_os("RUSTFLAGS"),
    );

    // 1. Instrumented builds, each writing its own profile directory.
    let raw_stowd = raw.join("stowd");
    let raw_core = raw.join("core");
    build_for(
        &host,
        &generate,
        &rustflags(&base, "-Cprofile-generate=", &raw_stowd),
        &["-p", "stowage-host", "--bin", "stowd"],
    )?;
    build_for(
        &host,
        &generate,
        &rustflags(&base, "-Cprofile-generate=", &raw_core),
        &["-p", "stowage-pycore"],
    )?;
    let built = generate.join(&host).join("release");

    // 2. The package, with the instrumented core.
    let train = dir.join("train");
    stage_package(
        &root.join("clients").join("python").join("stowage"),
        &train.join("stowage"),
        &built.join("lib_core.so"),
    )?;

    // 3. The training run.
    let py = python();
    let script = root.join("bench").join("pgo_train.py");
    let args: Vec<OsString> = vec![
        script.into(),
        "--stowd".into(),
        built.join("stowd").into(),
        "--plugins".into(),
        plugin_dir.into(),
        "--client-dir".into(),
        train.into(),
    ];
    eprintln!("xtask: {py} {args:?}");
    let status = Command::new(&py)
        .current_dir(root)
        .args(&args)
        .status()
        .map_err(|e| format!("cannot run {py}: {e}"))?;
    if !status.success() {
        return Err(format!(
            "the training run (bench/pgo_train.py) failed ({status}); \
             `cargo xtask wheel --no-pgo` builds the wheel without a profile"
        )
        .into());
    }

    // 4. One profile from both.
    let mut profiles = profiles_in(&raw_stowd, "stowd")?;
    profiles.extend(profiles_in(&raw_core, "the client's core")?);
    let merged = dir.join("stowage.profdata");
    let mut merge = vec![
        "merge".to_string(),
        "-o".into(),
        merged.display().to_string(),
    ];
    merge.extend(profiles.iter().map(|p| p.display().to_string()));
    let merge: Vec<&str> = merge.iter().map(String::as_str).collect();
    sh(&profdata_tool.display().to_string(), &merge, &[])?;

    // 5. The optimized stowd; the core's flags for maturin.
    let optimized = dir.join("use");
    let flags = rustflags(&base, "-Cprofile-use=", &merged);
    build_for(
        &host,
        &optimized,
        &flags,
        &["-p", "stowage-host", "--bin", "stowd"],
    )?;
    Ok(Built {
        stowd: optimized.join(&host).join("release").join("stowd"),
        env: vec![
            ("CARGO_ENCODED_RUSTFLAGS", flags),
            ("CARGO_TARGET_DIR", optimized.into_os_string()),
        ],
        host,
    })
}

/// `cargo build --release --target HOST` of `what` into `target_dir`
/// with `flags` (`CARGO_ENCODED_RUSTFLAGS`, which cargo takes before
/// `RUSTFLAGS`: a path with a space in it stays one flag).
fn build_for(host: &str, target_dir: &Path, flags: &OsString, what: &[&str]) -> Result<()> {
    let mut args = vec!["build", "--release", "--target", host];
    args.extend_from_slice(what);
    sh(
        &cargo(),
        &args,
        &[
            ("CARGO_ENCODED_RUSTFLAGS", flags.as_os_str()),
            ("CARGO_TARGET_DIR", target_dir.as_os_str()),
        ],
    )
}

/// The caller's own flags, kept under the profile's, in cargo's encoded
/// form (separated by 0x1f): `CARGO_ENCODED_RUSTFLAGS` as it is, else
/// `RUSTFLAGS` split at whitespace (as cargo splits it).
fn caller_flags(encoded: Option<OsString>, plain: Option<OsString>) -> OsString {
    match (encoded, plain) {
        (Some(e), _) if !e.is_empty() => e,
        (_, Some(p)) => {
            let p = p.to_string_lossy().into_owned();
            p.split_whitespace().collect::<Vec<_>>().join("\x1f").into()
        }
        _ => OsString::new(),
    }
}

/// `base` (the caller's flags, encoded) with `flag` + `path` after it.
fn rustflags(base: &OsString, flag: &str, path: &Path) -> OsString {
    let mut out = base.clone();
    if !out.is_empty() {
        out.push("\x1f");
    }
    out.push(flag);
    out.push(path.as_os_str());
    out
}

/// The `.profraw` files a training run left in `dir`; an error naming
/// `whose` when there are none (the process did not exit cleanly, or
/// never ran).
fn profiles_in(dir: &Path, whose: &str) -> Result<Vec<PathBuf>> {
    let mut found: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "profraw"))
            .collect(),
        Err(_) => Vec::new(),
    };
    if found.is_empty() {
        return Err(format!(
            "the training run left no profile of {whose} in {} (an instrumented \
             process writes it when it exits cleanly)",
            dir.display()
        )
        .into());
    }
    found.sort();
    Ok(found)
}

/// A copy of the Python package `from` at `to`, its sources only (no
/// caches, no staged binaries, no built core), with `core` as its
/// `_core.abi3.so`.
fn stage_package(from: &Path, to: &Path, core: &Path) -> Result<()> {
    if to.exists() {
        std::fs::remove_dir_all(to).map_err(|e| format!("cannot clear {}: {e}", to.display()))?;
    }
    copy_sources(from, to)?;
    std::fs::copy(core, to.join("_core.abi3.so")).map_err(|e| {
        format!(
            "cannot copy the instrumented core {} into {}: {e}",
            core.display(),
            to.display()
        )
    })?;
    Ok(())
}

/// Copies the `.py` files of `from` and of its subpackages (directories
/// holding an `__init__.py`) to `to`.
fn copy_sources(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    let entries =
        std::fs::read_dir(from).map_err(|e| format!("cannot list {}: {e}", from.display()))?;
    for entry in entries {
        let path = entry?.path();
        let Some(name) = path.file_name() else {
            continue;
        };
        if path.is_dir() {
            if path.join("__init__.py").is_file() {
                copy_sources(&path, &to.join(name))?;
            }
        } else if path.extension().is_some_and(|x| x == "py") {
            std::fs::copy(&path, to.join(name))
                .map_err(|e| format!("cannot copy {}: {e}", path.display()))?;
        }
    }
    Ok(())
}

/// The host's target triple (`rustc -vV`'s `host:` line).
fn host_triple() -> Result<String> {
    let out = Command::new(rustc())
        .arg("-vV")
        .output()
        .map_err(|e| format!("cannot run rustc -vV: {e}"))?;
    host_of(&String::from_utf8_lossy(&out.stdout))
        .ok_or_else(|| "rustc -vV printed no `host:` line".into())
}

fn host_of(version: &str) -> Option<String> {
    version
        .lines()
        .find_map(|l| l.strip_prefix("host:"))
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

fn rustc() -> String {
    std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into())
}

/// The toolchain's `llvm-profdata` (rustup's `llvm-tools` component,
/// added when missing): the one whose LLVM wrote the profiles.
fn llvm_profdata(host: &str) -> Result<PathBuf> {
    ensure_components(&["llvm-tools"])?;
    let out = Command::new(rustc())
        .args(["--print", "sysroot"])
        .output()
        .map_err(|e| format!("cannot run rustc --print sysroot: {e}"))?;
    let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let tool = sysroot
        .join("lib")
        .join("rustlib")
        .join(host)
        .join("bin")
        .join("llvm-profdata");
    if !tool.is_file() {
        return Err(format!(
            "a profile-guided build needs llvm-profdata, not found at {} \
             (`rustup component add llvm-tools` installs it); \
             `cargo xtask wheel --no-pgo` builds the wheel without a profile",
            tool.display()
        )
        .into());
    }
    Ok(tool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_is_read_from_rustc_vv() {
        let v = "rustc 1.95.0 (abc 2026-01-01)\nbinary: rustc\nhost: x86_64-unknown-linux-gnu\nrelease: 1.95.0\n";
        assert_eq!(host_of(v).as_deref(), Some("x86_64-unknown-linux-gnu"));
        assert_eq!(host_of("rustc 1.95.0\nrelease: 1.95.0\n"), None);
        assert_eq!(host_of("host:   \n"), None);
    }

    #[test]
    fn the_callers_rustflags_are_kept_before_the_profile() {
        let p = Path::new("/t/my pgo/raw/stowd");
        assert_eq!(
            rustflags(&OsString::new(), "-Cprofile-generate=", p),
            OsString::from("-Cprofile-generate=/t/my pgo/raw/stowd")
        );
        let plain = caller_flags(None, Some("  -Ctarget-cpu=native   -g ".into()));
        assert_eq!(plain, OsString::from("-Ctarget-cpu=native\x1f-g"));
        assert_eq!(
            rustflags(&plain, "-Cprofile-use=", p),
            OsString::from("-Ctarget-cpu=native\x1f-g\x1f-Cprofile-use=/t/my pgo/raw/stowd")
        );
        // cargo takes the encoded form first; so does the build.
        let encoded = caller_flags(Some("-Ca=b c\x1f-g".into()), Some("-O".into()));
        assert_eq!(encoded, OsString::from("-Ca=b c\x1f-g"));
        assert_eq!(caller_flags(Some(OsString::new()), None), OsString::new());
        assert_eq!(caller_flags(None, None), OsString::new());
    }

    #[test]
    fn a_run_that_left_no_profile_is_an_error_naming_whose() {
        let dir = std::env::temp_dir().join(format!("xtask-pgo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let missing = profiles_in(&dir, "stowd").unwrap_err().to_string();
        assert!(missing.contains("no profile of stowd"), "{missing}");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("notes.txt"), b"x").unwrap();
        assert!(profiles_in(&dir, "the client's core").is_err());
        std::fs::write(dir.join("b_1.profraw"), b"x").unwrap();
        std::fs::write(dir.join("a_2.profraw"), b"x").unwrap();
        let found = profiles_in(&dir, "stowd").unwrap();
        assert_eq!(
            found,
            vec![dir.join("a_2.profraw"), dir.join("b_1.profraw")]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_training_package_holds_the_sources_and_the_given_core() {
        let base = std::env::temp_dir().join(format!("xtask-pgo-stage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let from = base.join("from");
        std::fs::create_dir_all(from.join("ray")).unwrap();
        std::fs::create_dir_all(from.join("__pycache__")).unwrap();
        std::fs::create_dir_all(from.join("_bin")).unwrap();
        std::fs::write(from.join("__init__.py"), b"init").unwrap();
        std::fs::write(from.join("client.py"), b"client").unwrap();
        std::fs::write(from.join("_core.abi3.so"), b"old core").unwrap();
        std::fs::write(from.join("ray").join("__init__.py"), b"ray").unwrap();
        std::fs::write(from.join("__pycache__").join("client.pyc"), b"pyc").unwrap();
        std::fs::write(from.join("_bin").join("stowd"), b"bin").unwrap();
        let core = base.join("lib_core.so");
        std::fs::write(&core, b"instrumented").unwrap();
        let to = base.join("train").join("stowage");
        std::fs::create_dir_all(to.join("stale")).unwrap();
        stage_package(&from, &to, &core).unwrap();
        let mut names: Vec<String> = walk(&to);
        names.sort();
        assert_eq!(
            names,
            [
                "__init__.py",
                "_core.abi3.so",
                "client.py",
                "ray/__init__.py"
            ]
        );
        assert_eq!(
            std::fs::read(to.join("_core.abi3.so")).unwrap(),
            b"instrumented"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    fn walk(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                out.extend(walk(&p).into_iter().map(|n| format!("{name}/{n}")));
            } else {
                out.push(name);
            }
        }
        out
    }
}
