//! The compile cache trusts only what this `stowd` wrote (issue 14,
//! finding 9). A cache entry is native code run as `stowd`: an entry copied
//! over another's name, planted without this cache's tag, or sitting in a
//! directory another user can write is never loaded; the plugin is compiled
//! from its `.wasm` instead, answers as itself, and a WARN says why. A
//! normal restart still loads from the cache.
//!
//! Written against the public API that existed before the fix too, so that
//! each test fails on the old code (which loaded every such entry).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use stowage_host::policy::registry::{LoadReport, Registry, content_hash};
use stowage_host::policy::wasm::SandboxLimits;
use stowage_tests::{Stowd, plugin, temp_dir};

const NOBODY: u32 = 65534;

/// True when the tests run as root (and can act as `nobody`).
fn root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

/// A plugin directory holding copies of the named seed plugins.
fn plugins_of(names: &[&str]) -> PathBuf {
    let dir = temp_dir("cc-plugins");
    for n in names {
        std::fs::copy(plugin(n), dir.join(format!("{n}.wasm"))).unwrap();
    }
    dir
}

/// A cache path that does not exist yet (stowd creates it).
fn fresh_cache() -> PathBuf {
    temp_dir("cc").join("cache")
}

fn load(cache: &Path, plugins: &Path) -> Vec<LoadReport> {
    let mut reg = Registry::new(Some(cache.to_path_buf()), SandboxLimits::default()).unwrap();
    reg.load_dir(plugins).unwrap()
}

/// The report of the plugin file `name.wasm`.
fn report<'a>(reports: &'a [LoadReport], name: &str) -> &'a LoadReport {
    reports
        .iter()
        .find(|r| r.path.file_stem().is_some_and(|s| s == name))
        .unwrap_or_else(|| panic!("no report for {name}: {reports:?}"))
}

/// Asserts that `name.wasm` loaded as the plugin `name`, from the cache or not.
fn assert_loaded(reports: &[LoadReport], name: &str, from_cache: bool) {
    let r = report(reports, name);
    assert_eq!(
        r.result.as_ref().ok().map(String::as_str),
        Some(name),
        "{name}.wasm must answer as itself: {r:?}"
    );
    assert_eq!(r.from_cache, from_cache, "{name}: from_cache: {r:?}");
}

/// The cache entry of the seed plugin `name` (its file name starts with the
/// SHA-256 of the `.wasm`).
fn entry_of(cache: &Path, name: &str) -> PathBuf {
    let hash = content_hash(&std::fs::read(plugin(name)).unwrap());
    std::fs::read_dir(cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name().unwrap().to_string_lossy().starts_with(&hash)
                && p.extension().is_some_and(|x| x == "cwasm")
        })
        .unwrap_or_else(|| panic!("no cache entry for {name} in {}", cache.display()))
}

/// The bare compiled artifact of an entry (what `Component::serialize`
/// gives, as another program would write it): without this cache's header
/// if the entry has one.
fn bare_artifact(entry: &Path) -> Vec<u8> {
    let data = std::fs::read(entry).unwrap();
    match data.strip_prefix(b"STOWCW1\n") {
        Some(rest) => rest[32..].to_vec(),
        None => data,
    }
}

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Runs `program args` as `nobody`.
fn as_nobody(program: &str, args: &[&Path]) -> std::process::Output {
    Command::new(program)
        .args(args)
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap()
}

/// Strips ANSI colour sequences from a log.
fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The `plugin loaded` lines of a stowd log: (plugin name, from_cache, file).
fn loaded_lines(log: &str) -> Vec<(String, bool, String)> {
    let field = |line: &str, key: &str| {
        let at = line.find(&format!(" {key}="))? + key.len() + 2;
        Some(
            line[at..]
                .split_whitespace()
                .next()?
                .trim_matches('"')
                .to_string(),
        )
    };
    plain(log)
        .lines()
        .filter(|l| l.contains("plugin loaded"))
        .filter_map(|l| {
            let path = field(l, "path")?;
            let file = Path::new(&path).file_stem()?.to_string_lossy().into_owned();
            Some((field(l, "plugin")?, field(l, "from_cache")? == "true", file))
        })
        .collect()
}

/// Asserts that stowd loaded `file.wasm` as the plugin `file`, from the cache or not.
fn assert_stowd_loaded(log: &str, file: &str, from_cache: bool) {
    let lines = loaded_lines(log);
    let line = lines
        .iter()
        .find(|l| l.2 == file)
        .unwrap_or_else(|| panic!("{file} not loaded: {lines:?}\n{log}"));
    assert_eq!(line.0, file, "{file}.wasm must answer as itself: {lines:?}");
    assert_eq!(line.1, from_cache, "{file}: from_cache: {lines:?}\n{log}");
}

// ---------------------------------------------------------------------------
// The registry.

#[test]
fn a_normal_restart_loads_from_the_cache() {
    let (plugins, cache) = (plugins_of(&["gather", "constant-stride"]), fresh_cache());
    let first = load(&cache, &plugins);
    assert_loaded(&first, "gather", false);
    assert_loaded(&first, "constant-stride", false);
    let second = load(&cache, &plugins);
    assert_loaded(&second, "gather", true);
    assert_loaded(&second, "constant-stride", true);
}

#[test]
fn an_entry_copied_over_another_plugins_name_is_recompiled() {
    let (plugins, cache) = (plugins_of(&["gather", "constant-stride"]), fresh_cache());
    load(&cache, &plugins);
    std::fs::copy(
        entry_of(&cache, "gather"),
        entry_of(&cache, "constant-stride"),
    )
    .unwrap();
    let swapped = load(&cache, &plugins);
    assert_loaded(&swapped, "constant-stride", false);
    assert_loaded(&swapped, "gather", true);
    // The entry was rewritten: the next load uses it.
    assert_loaded(&load(&cache, &plugins), "constant-stride", true);
}

#[test]
fn an_entry_without_this_caches_tag_is_recompiled() {
    let (plugins, cache) = (plugins_of(&["gather", "constant-stride"]), fresh_cache());
    load(&cache, &plugins);
    let target = entry_of(&cache, "constant-stride");
    // Planted: gather's bare compiled code under constant-stride's name.
    std::fs::write(&target, bare_artifact(&entry_of(&cache, "gather"))).unwrap();
    assert_loaded(&load(&cache, &plugins), "constant-stride", false);
    // Planted: constant-stride's own code, tagged by another cache (another key).
    let other = fresh_cache();
    load(&other, &plugins);
    std::fs::copy(entry_of(&other, "constant-stride"), &target).unwrap();
    assert_loaded(&load(&cache, &plugins), "constant-stride", false);
    assert_loaded(&load(&cache, &plugins), "constant-stride", true);
}

#[test]
fn a_cache_dir_others_can_write_is_not_used() {
    let (plugins, cache) = (plugins_of(&["gather", "constant-stride"]), fresh_cache());
    load(&cache, &plugins);
    set_mode(&cache, 0o777);
    let reports = load(&cache, &plugins);
    assert_loaded(&reports, "gather", false);
    assert_loaded(&reports, "constant-stride", false);
    // Back to private: the entries are good again.
    set_mode(&cache, 0o700);
    assert_loaded(&load(&cache, &plugins), "gather", true);
}

#[test]
fn a_cache_dir_of_another_user_is_not_used() {
    if !root() {
        eprintln!("skipped: needs root to chown the cache to nobody");
        return;
    }
    let (plugins, cache) = (plugins_of(&["gather"]), fresh_cache());
    load(&cache, &plugins);
    std::os::unix::fs::chown(&cache, Some(NOBODY), Some(NOBODY)).unwrap();
    assert_loaded(&load(&cache, &plugins), "gather", false);
    // An ancestor owned by another user.
    std::os::unix::fs::chown(&cache, Some(0), Some(0)).unwrap();
    std::os::unix::fs::chown(cache.parent().unwrap(), Some(NOBODY), Some(NOBODY)).unwrap();
    assert_loaded(&load(&cache, &plugins), "gather", false);
    std::os::unix::fs::chown(cache.parent().unwrap(), Some(0), Some(0)).unwrap();
    assert_loaded(&load(&cache, &plugins), "gather", true);
}

#[test]
fn another_user_can_neither_read_the_key_nor_write_the_cache() {
    let (plugins, cache) = (plugins_of(&["gather"]), fresh_cache());
    load(&cache, &plugins);
    let key = cache.join("cache.key");
    let meta = std::fs::symlink_metadata(&key)
        .unwrap_or_else(|e| panic!("no key file {}: {e}", key.display()));
    assert!(meta.is_file() && meta.len() == 32, "{meta:?}");
    assert_eq!(meta.mode() & 0o777, 0o600, "key file mode");
    assert_eq!(
        std::fs::metadata(&cache).unwrap().mode() & 0o777,
        0o700,
        "cache dir mode"
    );
    assert_eq!(
        std::fs::metadata(entry_of(&cache, "gather"))
            .unwrap()
            .mode()
            & 0o077,
        0,
        "entry mode"
    );
    if !root() {
        eprintln!("skipped the part as nobody: needs root");
        return;
    }
    // Even with a world-readable parent on the way.
    set_mode(cache.parent().unwrap(), 0o755);
    let read = as_nobody("cat", &[&key]);
    assert!(
        !read.status.success() && read.stdout.is_empty(),
        "nobody read the key: {read:?}"
    );
    let planted = cache.join("planted.cwasm");
    let write = as_nobody("touch", &[&planted]);
    assert!(
        !write.status.success() && !planted.exists(),
        "nobody wrote into the cache: {write:?}"
    );
}

// ---------------------------------------------------------------------------
// stowd, with what its log says.

#[test]
fn stowd_recompiles_a_swapped_entry_and_says_why() {
    let (plugins, cache) = (plugins_of(&["gather", "constant-stride"]), fresh_cache());
    let log = Stowd::start_with_cache(&plugins, &cache, "").log();
    assert_stowd_loaded(&log, "constant-stride", false);
    let log = Stowd::start_with_cache(&plugins, &cache, "").log();
    assert_stowd_loaded(&log, "gather", true);
    assert_stowd_loaded(&log, "constant-stride", true);
    let target = entry_of(&cache, "constant-stride");
    std::fs::copy(entry_of(&cache, "gather"), &target).unwrap();
    let log = plain(&Stowd::start_with_cache(&plugins, &cache, "").log());
    assert_stowd_loaded(&log, "constant-stride", false);
    assert_stowd_loaded(&log, "gather", true);
    let warn = log
        .lines()
        .find(|l| l.contains("WARN") && l.contains("compile cache entry not trusted"))
        .unwrap_or_else(|| panic!("no WARN about the entry:\n{log}"));
    assert!(warn.contains("tag does not match"), "{warn}");
    let name = target.file_name().unwrap().to_string_lossy();
    assert!(
        warn.contains(&*name) && warn.contains("constant-stride.wasm"),
        "{warn}"
    );
}

#[test]
fn stowd_with_an_insecure_cache_dir_warns_once_and_compiles() {
    let (plugins, cache) = (plugins_of(&["gather", "constant-stride"]), fresh_cache());
    drop(Stowd::start_with_cache(&plugins, &cache, ""));
    set_mode(&cache, 0o777);
    let log = plain(&Stowd::start_with_cache(&plugins, &cache, "").log());
    assert_stowd_loaded(&log, "gather", false);
    assert_stowd_loaded(&log, "constant-stride", false);
    let warns: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("compile cache disabled"))
        .collect();
    assert_eq!(warns.len(), 1, "one WARN:\n{log}");
    let real = cache.canonicalize().unwrap();
    assert!(
        warns[0].contains("WARN")
            && warns[0].contains("writable by group or others")
            && warns[0].contains(&*real.to_string_lossy()),
        "{}",
        warns[0]
    );
    if root() {
        set_mode(&cache, 0o700);
        std::os::unix::fs::chown(&cache, Some(NOBODY), Some(NOBODY)).unwrap();
        let log = plain(&Stowd::start_with_cache(&plugins, &cache, "").log());
        assert_stowd_loaded(&log, "gather", false);
        assert!(
            log.contains("compile cache disabled")
                && log.contains(&format!("owned by uid {NOBODY}")),
            "{log}"
        );
    }
}
