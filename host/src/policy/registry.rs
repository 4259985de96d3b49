//! The plugin registry: the loaded plugins by name and the chains built
//! from them per field-name pattern. Loading plugins (a file, a directory,
//! the compile cache) is in `registry/load.rs`.
//!
//! Hot reload (see [`crate::reload`]) keeps the plugins of the directory by
//! file: a changed file replaces its plugin, a removed file unloads it.

mod load;
mod missing;

pub use load::{LoadReport, Prepared, content_hash, is_plugin_file, wasm_files};
pub use missing::{ChainSummary, MissingEntries, MissingEntry, closest, list_name};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use wasmtime::Engine;
use wasmtime::component::Linker;

use super::cache::CompileCache;
use super::chain::{Backoff, Chain, FailStrategy, Loaded, PluginStats};
use super::wasm::{self, HostState, SandboxLimits};
use super::{Capability, Policy};

/// Chain configuration for fields whose name matches `pattern`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChainConfig {
    /// Field-name glob: `*` matches any run of characters, `?` one.
    pub pattern: String,
    /// Selection policies, by name, in the order they are asked.
    #[serde(default)]
    pub select: Vec<String>,
    /// Packing policies, by name, in order.
    #[serde(default)]
    pub pack: Vec<String>,
    /// What to do after a plugin fault.
    #[serde(default)]
    pub fail: FailStrategy,
    /// Faults after which a plugin is disabled (0 = never).
    #[serde(default = "default_max_faults")]
    pub max_faults: u64,
    /// Milliseconds before a disabled plugin is re-enabled; doubles at each
    /// further disable (0 = stays disabled until its file is reloaded).
    #[serde(default = "default_backoff_ms")]
    pub backoff_ms: u64,
    /// Longest backoff, milliseconds.
    #[serde(default = "default_backoff_max_ms")]
    pub backoff_max_ms: u64,
    /// Entries that name no loaded plugin are skipped (until a plugin of
    /// that name is loaded) instead of refusing the configuration. For
    /// chains naming plugins that arrive later by hot reload.
    #[serde(default)]
    pub allow_missing: bool,
}

impl Default for ChainConfig {
    /// A chain for every field (`*`) with no policy: the built-in answers.
    fn default() -> Self {
        ChainConfig {
            pattern: "*".into(),
            select: vec![],
            pack: vec![],
            fail: FailStrategy::Fallback,
            max_faults: default_max_faults(),
            backoff_ms: default_backoff_ms(),
            backoff_max_ms: default_backoff_max_ms(),
            allow_missing: false,
        }
    }
}

impl ChainConfig {
    /// The re-enable backoff, if any.
    pub fn backoff(&self) -> Option<Backoff> {
        (self.backoff_ms > 0).then(|| Backoff {
            initial: Duration::from_millis(self.backoff_ms),
            max: Duration::from_millis(self.backoff_max_ms.max(self.backoff_ms)),
        })
    }
}

fn default_max_faults() -> u64 {
    10
}

fn default_backoff_ms() -> u64 {
    1_000
}

fn default_backoff_max_ms() -> u64 {
    300_000
}

/// Sandbox limits of one plugin, by name (`[plugins.overrides.<name>]`);
/// unset keys keep the `[plugins]` value.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsOverride {
    /// Fuel per call (the deadline).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fuel: Option<u64>,
    /// Linear-memory cap of an instance, bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<usize>,
    /// Largest single `read`, bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_cap: Option<u64>,
    /// Answers kept by a pure plugin's memo (0: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memo_entries: Option<usize>,
}

impl LimitsOverride {
    /// `base` with this override's keys applied.
    pub fn apply(&self, base: SandboxLimits) -> SandboxLimits {
        SandboxLimits {
            fuel: self.fuel.unwrap_or(base.fuel),
            memory_bytes: self.memory_bytes.unwrap_or(base.memory_bytes),
            read_cap: self.read_cap.unwrap_or(base.read_cap),
            memo_entries: self.memo_entries.unwrap_or(base.memo_entries),
        }
    }
}

/// Chains used when the configuration names none: every field goes through
/// the seed policies, those not loaded are skipped (`allow_missing`, so
/// `stowd` runs without a plugin directory). Zero-copy policies come
/// first; `nested-pack` (one copy at put time) is not in the default chain:
/// stored nested rows stay views of what arrived, and the packing policy
/// coalesces small rows when they are sent.
pub fn default_chains() -> Vec<ChainConfig> {
    vec![ChainConfig {
        pattern: "*".into(),
        select: [
            "single-row",
            "constant-stride",
            "runs",
            "gather",
            "nested-rows",
        ]
        .map(String::from)
        .to_vec(),
        pack: vec!["coalesce".into()],
        allow_missing: true,
        ..ChainConfig::default()
    }]
}

/// True if `name` matches the glob `pattern` (`*` and `?`), character by
/// character. Allocates nothing: it runs for every field of every request.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    // The usual patterns first: `*` (the default chain's) matches every
    // name, and a pattern without wildcards only itself. The walk below
    // took about 150 instructions for a 3-character name against `*`, once
    // per field of every put (callgrind, `small_put` 32x1).
    if !pattern.is_empty() && pattern.bytes().all(|b| b == b'*') {
        return true;
    }
    if !pattern.bytes().any(|b| b == b'*' || b == b'?') {
        return pattern == name;
    }
    glob_walk(pattern, name)
}

/// [`glob_match`] by walking both strings, with backtracking to the last
/// star.
fn glob_walk(pattern: &str, name: &str) -> bool {
    // Positions are byte offsets at character boundaries.
    let at = |s: &str, i: usize| s[i..].chars().next();
    let (mut pi, mut ni, mut star, mut mark) = (0usize, 0usize, None::<usize>, 0usize);
    while let Some(n) = at(name, ni) {
        match at(pattern, pi) {
            // (A star is a wildcard even against a `*` in the name.)
            Some('*') => {
                star = Some(pi);
                mark = ni;
                pi += 1;
            }
            Some(p) if p == '?' || p == n => {
                pi += p.len_utf8();
                ni += n.len_utf8();
            }
            _ => match star {
                Some(s) => {
                    pi = s + 1;
                    mark += at(name, mark).map_or(1, char::len_utf8);
                    ni = mark;
                }
                None => return false,
            },
        }
    }
    pattern[pi..].chars().all(|c| c == '*')
}

/// What every snapshot of a registry shares: the engine, the linker, the
/// compile cache and the counters of every plugin version ever loaded.
struct Shared {
    engine: Engine,
    linker: Linker<HostState>,
    /// The compile cache, if its directory and key passed the checks.
    cache: Option<CompileCache>,
    limits: SandboxLimits,
    /// Counters by (name, version), kept across reloads.
    book: Mutex<BTreeMap<(String, String), Arc<PluginStats>>>,
}

/// A plugin loaded from a file of the plugin directory.
#[derive(Clone, Debug)]
pub struct FilePlugin {
    /// SHA-256 of the file's bytes, hex.
    pub hash: String,
    pub loaded: Loaded,
}

/// Loaded plugins by name, and chains by pattern.
///
/// A registry is a value: hot reload clones the live one (plugins and
/// chains are `Arc`s, nothing is recompiled), changes the clone and swaps it
/// in. Every clone shares one engine, compile cache and counter book.
#[derive(Clone)]
pub struct Registry {
    shared: Arc<Shared>,
    overrides: BTreeMap<String, LimitsOverride>,
    /// Plugins inserted by hand (tests, benchmarks), by name.
    manual: BTreeMap<String, Loaded>,
    /// Plugins loaded from files, by path.
    files: BTreeMap<PathBuf, FilePlugin>,
    /// Every live plugin by name: `manual`, then `files` in path order (a
    /// later file of the same name wins).
    plugins: BTreeMap<String, Loaded>,
    chains: Vec<ChainConfig>,
    select_chains: Vec<(String, Chain)>,
    pack_chains: Vec<(String, Chain)>,
    /// Chain entries with no live plugin behind them.
    missing: Vec<MissingEntry>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("plugins", &self.plugins.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// One entry of the counter book.
#[derive(Clone, Debug)]
pub struct VersionStats {
    pub name: String,
    pub version: String,
    pub stats: Arc<PluginStats>,
    /// True if this version is live in the registry asked.
    pub live: bool,
}

/// Why a registry could not be made. wasmtime's `anyhow::Error` is kept
/// as its formatted chain (`{:#}`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    #[error("cannot build the WebAssembly engine: {0}")]
    Engine(String),
    #[error("cannot build the plugin linker (WASI and the tensor resource): {0}")]
    Linker(String),
}

impl Registry {
    /// An empty registry (only the built-in answers), caching compiled
    /// plugins in `cache_dir` (created `0700` if missing). A directory or key
    /// that fails the checks of [`super::cache`] is not used: one WARN says
    /// why, and every plugin is compiled at each load.
    pub fn new(
        cache_dir: Option<PathBuf>,
        limits: SandboxLimits,
    ) -> Result<Registry, RegistryError> {
        let engine = wasm::engine().map_err(|e| RegistryError::Engine(format!("{e:#}")))?;
        let linker = wasm::linker(&engine).map_err(|e| RegistryError::Linker(format!("{e:#}")))?;
        let cache = cache_dir.and_then(|dir| match CompileCache::open(&dir) {
            Ok(c) => Some(c),
            Err(reason) => {
                tracing::warn!(
                    dir = %dir.display(),
                    "compile cache disabled, every plugin is compiled at each load: {reason}"
                );
                None
            }
        });
        Ok(Registry {
            shared: Arc::new(Shared {
                engine,
                linker,
                cache,
                limits,
                book: Mutex::new(BTreeMap::new()),
            }),
            overrides: BTreeMap::new(),
            manual: BTreeMap::new(),
            files: BTreeMap::new(),
            plugins: BTreeMap::new(),
            chains: vec![],
            select_chains: vec![],
            pack_chains: vec![],
            missing: vec![],
        })
    }

    /// Per-plugin sandbox limits, by plugin name, for plugins loaded from
    /// now on.
    pub fn with_overrides(mut self, overrides: BTreeMap<String, LimitsOverride>) -> Registry {
        self.overrides = overrides;
        self
    }

    /// The limits a plugin of this name runs under.
    pub fn limits_for(&self, name: &str) -> SandboxLimits {
        match self.overrides.get(name) {
            Some(o) => o.apply(self.shared.limits),
            None => self.shared.limits,
        }
    }

    /// The compile cache's directory (its real path), or None if there is
    /// no cache or it failed the checks.
    pub fn cache_dir(&self) -> Option<&Path> {
        self.shared.cache.as_ref().map(|c| c.dir())
    }

    /// The counters of `name` at `version` (created on first use).
    fn stats_for(&self, name: &str, version: &str) -> Arc<PluginStats> {
        let mut book = self.shared.book.lock().unwrap_or_else(|p| p.into_inner());
        book.entry((name.to_string(), version.to_string()))
            .or_default()
            .clone()
    }

    fn loaded(&self, policy: Arc<dyn Policy>) -> Loaded {
        let d = policy.describe();
        let stats = self.stats_for(&d.name, &d.version);
        Loaded::with_stats(policy, stats)
    }

    /// Adds a policy under its described name (replacing one of that name).
    pub fn insert(&mut self, policy: Arc<dyn Policy>) -> Loaded {
        let loaded = self.loaded(policy);
        self.manual
            .insert(loaded.policy.describe().name.clone(), loaded.clone());
        self.rebuild();
        loaded
    }

    /// Makes a prepared plugin live as the plugin of its file, replacing
    /// whatever that file held (which may have another name). Its counters
    /// continue those of the same name and version; it starts enabled.
    /// Returns what the file held before.
    pub fn set_file(&mut self, prepared: Prepared) -> Option<FilePlugin> {
        let loaded = self.loaded(Arc::new(prepared.policy));
        loaded.stats.reset_on_load();
        let old = self.files.insert(
            prepared.path,
            FilePlugin {
                hash: prepared.hash,
                loaded,
            },
        );
        self.rebuild();
        old
    }

    /// Unloads the plugin of a file that is gone; returns it.
    pub fn remove_file(&mut self, path: &Path) -> Option<FilePlugin> {
        let old = self.files.remove(path);
        if old.is_some() {
            self.rebuild();
        }
        old
    }

    /// The plugin loaded from `path`, if any.
    pub fn file(&self, path: &Path) -> Option<&FilePlugin> {
        self.files.get(path)
    }

    /// Paths of the plugins loaded from files.
    pub fn file_paths(&self) -> Vec<PathBuf> {
        self.files.keys().cloned().collect()
    }

    /// Recomputes the live plugins and the chains.
    fn rebuild(&mut self) {
        let mut plugins = self.manual.clone();
        for f in self.files.values() {
            plugins.insert(f.loaded.policy.describe().name.clone(), f.loaded.clone());
        }
        self.plugins = plugins;
        let chains = std::mem::take(&mut self.chains);
        self.configure(&chains);
    }

    /// A loaded plugin by name.
    pub fn get(&self, name: &str) -> Option<&Loaded> {
        self.plugins.get(name)
    }

    /// Names of the loaded plugins.
    pub fn names(&self) -> Vec<String> {
        self.plugins.keys().cloned().collect()
    }

    /// The counters of every plugin version this registry (or any snapshot
    /// sharing its book) ever loaded, by name and version.
    pub fn version_stats(&self) -> Vec<VersionStats> {
        let book = self.shared.book.lock().unwrap_or_else(|p| p.into_inner());
        book.iter()
            .map(|((name, version), stats)| VersionStats {
                name: name.clone(),
                version: version.clone(),
                stats: stats.clone(),
                live: self
                    .plugins
                    .get(name)
                    .is_some_and(|l| Arc::ptr_eq(&l.stats, stats)),
            })
            .collect()
    }

    /// Each chain's live policies and settings, in configuration order.
    pub fn chain_summaries(&self) -> Vec<ChainSummary> {
        let missing = |pattern: &str, cap: Capability| -> Vec<String> {
            let m = self.missing.iter();
            m.filter(|m| m.pattern == pattern && m.capability == cap)
                .map(|m| m.name.clone())
                .collect()
        };
        let chains = self.select_chains.iter().zip(&self.pack_chains);
        chains
            .zip(&self.chains)
            .map(|(((pattern, sel), (_, pack)), config)| ChainSummary {
                pattern: pattern.clone(),
                select: sel.names(),
                pack: pack.names(),
                fail: sel.fail,
                max_faults: sel.max_faults,
                backoff: sel.backoff,
                allow_missing: config.allow_missing,
                missing_select: missing(pattern, Capability::Selection),
                missing_pack: missing(pattern, Capability::Packing),
            })
            .collect()
    }

    /// Chain entries that name no live plugin with the capability their
    /// list needs, in configuration order.
    pub fn missing(&self) -> &[MissingEntry] {
        &self.missing
    }

    /// The missing entries of chains that do not allow them: an error for
    /// `stowd` at start and for `stowd config`.
    pub fn check_chains(&self) -> Result<(), MissingEntries> {
        let refused: Vec<MissingEntry> = self
            .missing
            .iter()
            .filter(|m| !m.allowed)
            .cloned()
            .collect();
        match refused.is_empty() {
            true => Ok(()),
            false => Err(MissingEntries(refused)),
        }
    }

    /// Builds the chains. Entries with no live plugin of the needed
    /// capability are skipped (the built-in still answers) and recorded in
    /// [`Registry::missing`]; [`Registry::check_chains`] refuses them. The
    /// configuration is kept: chains are rebuilt from it whenever the
    /// plugins change.
    pub fn configure(&mut self, chains: &[ChainConfig]) {
        let mut missing = Vec::new();
        let mut pick = |c: &ChainConfig, names: &[String], cap: Capability| -> Vec<Loaded> {
            let able = |l: &Loaded| l.policy.describe().capabilities.contains(&cap);
            let mut live = Vec::new();
            for n in names {
                match self.plugins.get(n) {
                    Some(l) if able(l) => live.push(l.clone()),
                    found => {
                        let loaded: Vec<String> = self
                            .plugins
                            .iter()
                            .filter(|(_, l)| able(l))
                            .map(|(name, _)| name.clone())
                            .collect();
                        missing.push(MissingEntry {
                            pattern: c.pattern.clone(),
                            capability: cap,
                            name: n.clone(),
                            lacks_capability: found.is_some(),
                            closest: closest(n, loaded.iter().map(String::as_str)),
                            loaded,
                            allowed: c.allow_missing,
                        });
                    }
                }
            }
            live
        };
        let mut select_chains = Vec::with_capacity(chains.len());
        let mut pack_chains = Vec::with_capacity(chains.len());
        for c in chains {
            let build =
                |policies| Chain::new(policies, c.fail, c.max_faults).with_backoff(c.backoff());
            let select = build(pick(c, &c.select, Capability::Selection));
            let pack = build(pick(c, &c.pack, Capability::Packing));
            select_chains.push((c.pattern.clone(), select));
            pack_chains.push((c.pattern.clone(), pack));
        }
        self.select_chains = select_chains;
        self.pack_chains = pack_chains;
        self.missing = missing;
        self.chains = chains.to_vec();
    }

    /// The selection chain of a field: the first pattern that matches, else
    /// the built-in alone.
    pub fn select_chain(&self, field: &str) -> &Chain {
        self.select_chain_of(self.select_chain_at(field))
    }

    /// Which selection chain a field uses: the position of the first
    /// pattern that matches (`None`: the built-in alone). Fields with the
    /// same answer share a chain, so their decisions can be asked together.
    pub fn select_chain_at(&self, field: &str) -> Option<usize> {
        self.select_chains
            .iter()
            .position(|(p, _)| glob_match(p, field))
    }

    /// The selection chain at a position [`select_chain_at`] answered.
    ///
    /// [`select_chain_at`]: Self::select_chain_at
    pub fn select_chain_of(&self, at: Option<usize>) -> &Chain {
        at.and_then(|i| self.select_chains.get(i))
            .map_or(builtin_chain(), |(_, c)| c)
    }

    /// The packing chain of a field.
    pub fn pack_chain(&self, field: &str) -> &Chain {
        self.pack_chains
            .iter()
            .find(|(p, _)| glob_match(p, field))
            .map_or(builtin_chain(), |(_, c)| c)
    }
}

/// The chain of a field no pattern matches: the built-in alone.
fn builtin_chain() -> &'static Chain {
    static BUILTIN: std::sync::OnceLock<Chain> = std::sync::OnceLock::new();
    BUILTIN.get_or_init(Chain::builtin)
}

#[cfg(test)]
mod tests {
    use super::{glob_match, glob_walk};

    #[test]
    fn globs() {
        assert!(glob_match("*", "anything"));
        assert!(glob_match("resp*", "responses"));
        assert!(glob_match("*_ids", "input_ids"));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("a?c", "abbc"));
        assert!(!glob_match("resp*", "prompt"));
        assert!(glob_match("*a*b*", "xxaxxbxx"));
        assert!(glob_match("", ""));
        assert!(!glob_match("", "x"));
        // Characters, not bytes: `?` takes one character of any width.
        assert!(glob_match("r?sum?", "résumé"));
        assert!(glob_match("*é", "café"));
        assert!(glob_match("*_ids*", "ünï_ids_ö"));
        assert!(!glob_match("??", "é"));
        assert!(glob_match("?", "é"));
        assert!(glob_match("*?*", "日本"));
        assert!(!glob_match("日?本", "日本"));
        // Backtracking over several stars, and a literal star in the name.
        assert!(glob_match("a*b*c", "axbxbxc"));
        assert!(!glob_match("a*b*c", "axbxbx"));
        assert!(glob_match("a*", "a*"));
        assert!(glob_match("**", ""));
        // A star stays a wildcard where the name has a `*` too (the walk
        // once took it for the literal and then had no star to go back to).
        assert!(glob_walk("*", "**"));
        assert!(glob_walk("a*", "a**b"));
        assert!(glob_walk("*b", "*ab"));
    }

    #[test]
    fn the_shortcuts_answer_as_the_walk() {
        let patterns = [
            "", "*", "**", "***", "f12", "f1", "f12*", "*f12", "?", "f?2", "é", "*é", "ab", "a*b",
        ];
        let names = [
            "", "f", "f1", "f12", "f123", "xf12", "é", "ab", "a*b", "*", "**", "?",
        ];
        for p in patterns {
            for n in names {
                assert_eq!(
                    glob_match(p, n),
                    glob_walk(p, n),
                    "pattern {p:?}, name {n:?}"
                );
            }
        }
    }
}
