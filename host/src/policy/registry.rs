//! The plugin registry: loads a directory of `.wasm` policies (through an
//! on-disk cache of compiled components) and builds chains per field-name
//! pattern.
//!
//! Cache: a compiled component is stored as `<cache>/<sha256 of the .wasm>-
//! <engine hash>.cwasm`; the engine hash covers wasmtime's version and the
//! engine configuration, so a cache made by another build is never used.
//! A cache entry that fails to load is recompiled and rewritten.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::{Component, Linker};

use super::chain::{Chain, FailStrategy, Loaded};
use super::wasm::{self, HostState, LoadError, SandboxLimits, WasmPolicy};
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
    /// Faults after which a plugin is no longer called (0 = never stop).
    #[serde(default = "default_max_faults")]
    pub max_faults: u64,
}

fn default_max_faults() -> u64 {
    10
}

/// Chains used when the configuration names none: every field goes through
/// the seed policies, unknown names are skipped.
pub fn default_chains() -> Vec<ChainConfig> {
    vec![ChainConfig {
        pattern: "*".into(),
        select: ["single-row", "constant-stride", "runs", "nested-pack", "gather", "nested-rows"]
            .map(String::from)
            .to_vec(),
        pack: vec!["coalesce".into()],
        fail: FailStrategy::Fallback,
        max_faults: default_max_faults(),
    }]
}

/// True if `name` matches the glob `pattern` (`*` and `?`).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni, mut star, mut mark) = (0usize, 0usize, None::<usize>, 0usize);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// Loaded plugins by name, and chains by pattern.
pub struct Registry {
    engine: Engine,
    linker: Linker<HostState>,
    cache_dir: Option<PathBuf>,
    limits: SandboxLimits,
    plugins: BTreeMap<String, Loaded>,
    select_chains: Vec<(String, Chain)>,
    pack_chains: Vec<(String, Chain)>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("plugins", &self.plugins.keys().collect::<Vec<_>>()).finish()
    }
}

/// Where a plugin was loaded from, for reports.
#[derive(Clone, Debug)]
pub struct LoadReport {
    pub path: PathBuf,
    pub result: Result<String, String>,
    pub from_cache: bool,
}

impl Registry {
    /// An empty registry (only the built-in answers).
    pub fn new(cache_dir: Option<PathBuf>, limits: SandboxLimits) -> anyhow::Result<Registry> {
        let engine = wasm::engine().map_err(|e| anyhow::anyhow!("{e:#}"))?;
        let linker = wasm::linker(&engine).map_err(|e| anyhow::anyhow!("{e:#}"))?;
        Ok(Registry {
            engine,
            linker,
            cache_dir,
            limits,
            plugins: BTreeMap::new(),
            select_chains: vec![],
            pack_chains: vec![],
        })
    }

    fn engine_hash(&self) -> u64 {
        let mut h = std::hash::DefaultHasher::new();
        self.engine.precompile_compatibility_hash().hash(&mut h);
        h.finish()
    }

    /// Compiles `bytes`, or loads the cached compilation.
    fn compile(&self, bytes: &[u8], path: &str) -> Result<(Component, bool), LoadError> {
        let key = format!("{:x}-{:016x}.cwasm", Sha256::digest(bytes), self.engine_hash());
        let cached = self.cache_dir.as_ref().map(|d| d.join(key));
        if let Some(file) = cached.as_ref().filter(|f| f.exists()) {
            // Read into memory rather than map the file: a cache file changed
            // under a live mapping would crash the process (SIGBUS).
            match std::fs::read(file) {
                // SAFETY: the bytes come from `Component::serialize` of an
                // engine with the same compatibility hash (it is in the file
                // name), in a cache directory this host owns; wasmtime also
                // checks the header and refuses artifacts of another engine.
                // Bytes that do not deserialize are recompiled below.
                Ok(data) => match unsafe { Component::deserialize(&self.engine, &data) } {
                    Ok(c) => return Ok((c, true)),
                    Err(e) => tracing::warn!(path, error = %e, "cached component unusable, recompiling"),
                },
                Err(e) => tracing::warn!(path, error = %e, "cached component unreadable, recompiling"),
            }
        }
        let component = Component::new(&self.engine, bytes)
            .map_err(|e| LoadError::Compile { path: path.into(), reason: format!("{e:#}") })?;
        if let Some(file) = cached {
            let write = || -> std::io::Result<()> {
                std::fs::create_dir_all(file.parent().expect("cache file has a parent"))?;
                let data = component.serialize().map_err(std::io::Error::other)?;
                static TMP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = TMP.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let tmp = file.with_extension(format!("tmp{}-{n}", std::process::id()));
                std::fs::write(&tmp, data)?;
                std::fs::rename(&tmp, &file)
            };
            if let Err(e) = write() {
                tracing::warn!(path, error = %e, "could not write the compile cache");
            }
        }
        Ok((component, false))
    }

    /// Loads one plugin file (contract check, compile or cache, describe).
    pub fn load_file(&self, path: &Path) -> Result<(WasmPolicy, bool), LoadError> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| LoadError::Read { path: shown.clone(), source })?;
        wasm::check_contract(&bytes).map_err(|reason| LoadError::Contract { path: shown.clone(), reason })?;
        let (component, from_cache) = self.compile(&bytes, &shown)?;
        let policy = WasmPolicy::new(&self.engine, &self.linker, &component, self.limits, &shown)?;
        Ok((policy, from_cache))
    }

    /// Adds a policy under its described name (replacing one of that name).
    pub fn insert(&mut self, policy: Arc<dyn Policy>) -> Loaded {
        let name = policy.describe().name.clone();
        let loaded = Loaded::new(policy);
        self.plugins.insert(name, loaded.clone());
        loaded
    }

    /// Loads every `*.wasm` in `dir` (sorted by file name). A plugin that
    /// fails to load is reported and skipped; the others still load.
    pub fn load_dir(&mut self, dir: &Path) -> std::io::Result<Vec<LoadReport>> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "wasm"))
            .collect();
        files.sort();
        let mut reports = Vec::new();
        for path in files {
            match self.load_file(&path) {
                Ok((policy, from_cache)) => {
                    let d = policy.describe().clone();
                    tracing::info!(plugin = %d.name, version = %d.version, from_cache, path = %path.display(), "plugin loaded");
                    self.insert(Arc::new(policy));
                    reports.push(LoadReport { path, result: Ok(d.name), from_cache });
                }
                Err(e) => {
                    tracing::error!(error = %e, "plugin not loaded");
                    reports.push(LoadReport { path, result: Err(e.to_string()), from_cache: false });
                }
            }
        }
        Ok(reports)
    }

    /// A loaded plugin by name.
    pub fn get(&self, name: &str) -> Option<&Loaded> {
        self.plugins.get(name)
    }

    /// Names of the loaded plugins.
    pub fn names(&self) -> Vec<String> {
        self.plugins.keys().cloned().collect()
    }

    /// One line per chain: pattern, selection names, packing names and
    /// fail strategy.
    pub fn chain_summaries(&self) -> Vec<(String, String)> {
        self.select_chains
            .iter()
            .zip(&self.pack_chains)
            .map(|((pattern, sel), (_, pack))| {
                let line = format!(
                    "select [{}] pack [{}] fail {:?} max_faults {}",
                    sel.names().join(", "),
                    pack.names().join(", "),
                    sel.fail,
                    sel.max_faults
                );
                (pattern.clone(), line)
            })
            .collect()
    }

    /// Builds the chains. Names that are not loaded are skipped with a
    /// warning (the built-in still answers); a name loaded without the
    /// needed capability is skipped too.
    pub fn configure(&mut self, chains: &[ChainConfig]) {
        let pick = |names: &[String], cap: Capability| -> Vec<Loaded> {
            names
                .iter()
                .filter_map(|n| match self.plugins.get(n) {
                    Some(l) if l.policy.describe().capabilities.contains(&cap) => Some(l.clone()),
                    Some(_) => {
                        tracing::warn!(plugin = %n, capability = ?cap, "plugin lacks the capability, skipped");
                        None
                    }
                    None => {
                        tracing::debug!(plugin = %n, "chain names a plugin that is not loaded, skipped");
                        None
                    }
                })
                .collect()
        };
        self.select_chains = chains
            .iter()
            .map(|c| (c.pattern.clone(), Chain::new(pick(&c.select, Capability::Selection), c.fail, c.max_faults)))
            .collect();
        self.pack_chains = chains
            .iter()
            .map(|c| (c.pattern.clone(), Chain::new(pick(&c.pack, Capability::Packing), c.fail, c.max_faults)))
            .collect();
    }

    /// The selection chain of a field: the first pattern that matches, else
    /// the built-in alone.
    pub fn select_chain(&self, field: &str) -> Chain {
        self.select_chains.iter().find(|(p, _)| glob_match(p, field)).map(|(_, c)| c.clone()).unwrap_or_else(Chain::builtin)
    }

    /// The packing chain of a field.
    pub fn pack_chain(&self, field: &str) -> Chain {
        self.pack_chains.iter().find(|(p, _)| glob_match(p, field)).map(|(_, c)| c.clone()).unwrap_or_else(Chain::builtin)
    }
}

#[cfg(test)]
mod tests {
    use super::glob_match;

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
    }
}
