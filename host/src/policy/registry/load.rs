//! Loading plugins into a [`Registry`]: a `.wasm` file is read, its
//! contract checked, compiled (or its compilation loaded from the cache),
//! described and given the sandbox limits of its name; a directory is loaded
//! file by file (`*.wasm`, sorted, hidden files skipped).
//!
//! Cache: a compiled component is stored as `<cache>/<sha256 of the .wasm>-
//! <engine hash>.cwasm`; the engine hash covers wasmtime's version and the
//! engine configuration, so a cache made by another build is never used.
//! An entry is native code, so it is loaded only if this `stowd` can prove
//! it wrote it (a private directory, a private key, a tag per entry: see
//! [`crate::policy::cache`]); an entry that fails a check or fails to load is
//! recompiled and rewritten, with a WARN saying why.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::component::Component;

use super::Registry;
use crate::policy::Policy;
use crate::policy::cache::CompileCache;
use crate::policy::wasm::{self, LoadError, WasmPolicy};

/// Where a plugin was loaded from, for reports.
#[derive(Debug)]
pub struct LoadReport {
    pub path: PathBuf,
    /// The plugin's `describe()` name, or why it was not loaded.
    pub result: Result<String, LoadError>,
    pub from_cache: bool,
}

/// A plugin compiled and described, not yet live.
#[derive(Debug)]
pub struct Prepared {
    pub path: PathBuf,
    /// SHA-256 of the file's bytes, hex.
    pub hash: String,
    pub policy: WasmPolicy,
    pub from_cache: bool,
}

/// SHA-256 of `bytes`, hex.
pub fn content_hash(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// The `*.wasm` files of `dir`, sorted.
pub fn wasm_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| is_plugin_file(p))
        .collect();
    files.sort();
    Ok(files)
}

/// True for a `*.wasm` path that is not hidden (editors and copy tools
/// write `.name.wasm.tmp`-style files first).
pub fn is_plugin_file(path: &Path) -> bool {
    path.extension().is_some_and(|x| x == "wasm")
        && !path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.'))
}

impl Registry {
    fn engine_hash(&self) -> u64 {
        let mut h = std::hash::DefaultHasher::new();
        self.shared
            .engine
            .precompile_compatibility_hash()
            .hash(&mut h);
        h.finish()
    }

    /// Compiles `bytes` (whose hash is `hash`), or loads the cached compilation.
    fn compile(
        &self,
        bytes: &[u8],
        hash: &str,
        path: &str,
    ) -> Result<(Component, bool), LoadError> {
        let engine = &self.shared.engine;
        let cache = self.shared.cache.as_ref();
        let name = format!("{hash}-{:016x}", self.engine_hash());
        if let Some(cache) = cache {
            // Read into memory rather than map the file: a cache file changed
            // under a live mapping would crash the process (SIGBUS).
            match cache.load(&name) {
                Ok(None) => {}
                // SAFETY: the bytes carry a tag that only the holder of this
                // cache's key (this uid, in a directory no other user can
                // write) can make, over the exact bytes `Component::serialize`
                // gave for this .wasm hash and this engine's compatibility
                // hash. wasmtime also checks the header and refuses artifacts
                // of another engine; bytes that do not deserialize are
                // recompiled below.
                Ok(Some(data)) => match unsafe {
                    Component::deserialize(engine, &data[CompileCache::ARTIFACT_AT..])
                } {
                    Ok(c) => return Ok((c, true)),
                    Err(e) => tracing::warn!(
                        path,
                        entry = %cache.entry_path(&name).display(),
                        error = %e,
                        "cached component unusable, recompiling"
                    ),
                },
                Err(reason) => tracing::warn!(
                    path,
                    entry = %cache.entry_path(&name).display(),
                    "compile cache entry not trusted, recompiling: {reason}"
                ),
            }
        }
        let component = Component::new(engine, bytes).map_err(|e| LoadError::Compile {
            path: path.into(),
            reason: format!("{e:#}"),
        })?;
        if let Some(cache) = cache {
            let written = component
                .serialize()
                .map_err(std::io::Error::other)
                .and_then(|data| cache.store(&name, &data));
            if let Err(e) = written {
                tracing::warn!(path, entry = %cache.entry_path(&name).display(), error = %e, "could not write the compile cache");
            }
        }
        Ok((component, false))
    }

    /// Loads one plugin from its bytes: contract check, compile or cache,
    /// describe, then the per-plugin limits of its name.
    pub fn prepare_bytes(&self, bytes: &[u8], path: &Path) -> Result<Prepared, LoadError> {
        let shown = path.display().to_string();
        wasm::check_contract(bytes).map_err(|reason| LoadError::Contract {
            path: shown.clone(),
            reason,
        })?;
        let hash = content_hash(bytes);
        let (component, from_cache) = self.compile(bytes, &hash, &shown)?;
        let s = &self.shared;
        let mut policy = WasmPolicy::new(&s.engine, &s.linker, &component, s.limits, &shown)?;
        let limits = self.limits_for(&policy.describe().name);
        if limits != s.limits {
            policy.set_limits(limits);
        }
        Ok(Prepared {
            path: path.to_path_buf(),
            hash,
            policy,
            from_cache,
        })
    }

    /// Reads and loads one plugin file.
    pub fn prepare_file(&self, path: &Path) -> Result<Prepared, LoadError> {
        let bytes = std::fs::read(path).map_err(|source| LoadError::Read {
            path: path.display().to_string(),
            source,
        })?;
        self.prepare_bytes(&bytes, path)
    }

    /// Loads one plugin file (contract check, compile or cache, describe).
    pub fn load_file(&self, path: &Path) -> Result<(WasmPolicy, bool), LoadError> {
        self.prepare_file(path).map(|p| (p.policy, p.from_cache))
    }

    /// Loads every `*.wasm` in `dir` (sorted by file name). A plugin that
    /// fails to load is reported and skipped; the others still load.
    pub fn load_dir(&mut self, dir: &Path) -> std::io::Result<Vec<LoadReport>> {
        self.load_dir_checked(dir, |_| Ok(()))
    }

    /// [`Registry::load_dir`], with `check` run on each plugin before it goes
    /// live (a plugin it refuses is reported and skipped).
    pub fn load_dir_checked(
        &mut self,
        dir: &Path,
        check: impl Fn(&WasmPolicy) -> Result<(), crate::policy::Refusal>,
    ) -> std::io::Result<Vec<LoadReport>> {
        let mut reports = Vec::new();
        for path in wasm_files(dir)? {
            let prepared = self
                .prepare_file(&path)
                .and_then(|p| match check(&p.policy) {
                    Ok(()) => Ok(p),
                    Err(reason) => Err(LoadError::Check {
                        path: path.display().to_string(),
                        reason,
                    }),
                });
            match prepared {
                Ok(p) => {
                    let d = p.policy.describe().clone();
                    let from_cache = p.from_cache;
                    tracing::info!(plugin = %d.name, version = %d.version, from_cache, path = %path.display(), "plugin loaded");
                    self.set_file(p);
                    reports.push(LoadReport {
                        path,
                        result: Ok(d.name),
                        from_cache,
                    });
                }
                Err(e) => {
                    tracing::error!(error = %e, "plugin not loaded");
                    reports.push(LoadReport {
                        path,
                        result: Err(e),
                        from_cache: false,
                    });
                }
            }
        }
        Ok(reports)
    }
}
