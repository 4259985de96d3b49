//! Hot reload: the plugin directory is watched, and a new or changed
//! `.wasm` goes live without a restart.
//!
//! A change is handled off the request path, in a blocking task:
//! 1. events (inotify on Linux, through the `notify` crate) are gathered
//!    until the directory has been quiet for [`DEBOUNCE`], so a file being
//!    written is read once it is complete;
//! 2. each changed file is read and hashed; a file whose content is what is
//!    already live is left alone;
//! 3. a new content is checked (contract version), compiled (through the
//!    on-disk cache), described, and run through the conformance suite
//!    ([`crate::conformance::verify`]); a plugin that fails any step is not
//!    loaded, and the version its file held before stays live;
//! 4. a clone of the live registry gets the new plugins (a removed file
//!    unloads its plugin), its chains are rebuilt, and it is swapped in
//!    atomically ([`Manager::swap_registry`]). Requests already running
//!    finish on the snapshot they started with.
//!
//! Each swap is logged with the plugin's name, version and the time from
//! the first event to the swap. If the watcher reports lost events, or a
//! name other than a `*.wasm` file changes (a temporary file renamed into
//! place, a Kubernetes ConfigMap mount swapping its `..data` symlink), the
//! whole directory is rescanned (unchanged files cost one read and a hash).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use notify::event::{AccessKind, AccessMode, ModifyKind};
use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::{mpsc, watch};

use crate::conformance;
use crate::manager::Manager;
use crate::metrics::{Metrics, ReloadCounters};
use crate::policy::Policy;
use crate::policy::registry::{self, Prepared, Registry};
use crate::policy::wasm::LoadError;

/// Quiet time after the last event before the changed files are read.
pub const DEBOUNCE: Duration = Duration::from_millis(50);

/// Longest a burst of events may postpone a reload.
pub const MAX_DELAY: Duration = Duration::from_secs(2);

/// What happened to one file.
#[derive(Debug)]
pub enum Change {
    /// New content, checked: make it live.
    Load(Box<Prepared>),
    /// The file is gone: unload its plugin.
    Remove,
    /// Same content as the live plugin, or not a plugin file of ours.
    Unchanged,
    /// Refused; the previous version (if any) stays.
    Refused(String),
}

/// Reads, checks and compiles the changed files against the live registry.
/// Blocking: compiling and the conformance suite take milliseconds.
pub fn prepare(live: &Registry, paths: &BTreeSet<PathBuf>) -> Vec<(PathBuf, Change)> {
    paths
        .iter()
        .map(|p| (p.clone(), prepare_one(live, p)))
        .collect()
}

fn prepare_one(live: &Registry, path: &Path) -> Change {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return if live.file(path).is_some() {
                Change::Remove
            } else {
                Change::Unchanged
            };
        }
        Err(e) => {
            return Change::Refused(
                LoadError::Read {
                    path: path.display().to_string(),
                    source: e,
                }
                .to_string(),
            );
        }
    };
    if live
        .file(path)
        .is_some_and(|f| f.hash == registry::content_hash(&bytes))
    {
        return Change::Unchanged;
    }
    let prepared = match live.prepare_bytes(&bytes, path) {
        Ok(p) => p,
        Err(e) => return Change::Refused(e.to_string()),
    };
    match conformance::verify(&prepared.policy) {
        Ok(_) => {
            // The suite ran on this instance; start the live one fresh.
            prepared.policy.reset();
            Change::Load(Box::new(prepared))
        }
        Err(reason) => Change::Refused(
            LoadError::Check {
                path: path.display().to_string(),
                reason,
            }
            .to_string(),
        ),
    }
}

/// Plugins loaded and removed by an [`apply`]; counted in the metrics only
/// once the new registry is live, so a reader that sees the count go up
/// also sees the new plugins.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub swapped: u64,
    pub removed: u64,
}

impl Applied {
    /// Adds these counts to `reloads` (after the swap).
    pub fn count(self, reloads: &ReloadCounters) {
        reloads.swapped.fetch_add(self.swapped, Ordering::Relaxed);
        reloads.removed.fetch_add(self.removed, Ordering::Relaxed);
    }
}

/// Applies prepared changes to a clone of `live`; `None` if nothing changed.
pub fn apply(
    live: &Registry,
    changes: Vec<(PathBuf, Change)>,
    reloads: &ReloadCounters,
    since: Instant,
) -> (Option<Registry>, Applied) {
    let mut next: Option<Registry> = None;
    let mut applied = Applied::default();
    for (path, change) in changes {
        let shown = path.display().to_string();
        match change {
            Change::Unchanged => {}
            Change::Refused(reason) => {
                reloads.refused.fetch_add(1, Ordering::Relaxed);
                let stays = live.file(&path).map(|f| {
                    let d = f.loaded.policy.describe();
                    format!("{} {}", d.name, d.version)
                });
                tracing::error!(path = %shown, error = %reason, still_live = ?stays, "plugin refused, not loaded");
            }
            Change::Remove => {
                let reg = next.get_or_insert_with(|| live.clone());
                if let Some(old) = reg.remove_file(&path) {
                    applied.removed += 1;
                    let d = old.loaded.policy.describe();
                    tracing::info!(path = %shown, plugin = %d.name, version = %d.version, "plugin file removed, plugin unloaded");
                }
            }
            Change::Load(prepared) => {
                let d = prepared.policy.describe().clone();
                let from_cache = prepared.from_cache;
                let reg = next.get_or_insert_with(|| live.clone());
                let old = reg.set_file(*prepared);
                applied.swapped += 1;
                let replaced = old.map(|o| {
                    let od = o.loaded.policy.describe();
                    format!("{} {}", od.name, od.version)
                });
                tracing::info!(
                    path = %shown, plugin = %d.name, version = %d.version, replaced = ?replaced, from_cache,
                    took_ms = since.elapsed().as_millis() as u64,
                    "plugin swapped in"
                );
            }
        }
    }
    (next, applied)
}

/// Logs the chain entries a reload leaves without a plugin (a WARN each,
/// naming the loaded plugins and the closest name) and those it fills again
/// (INFO). The reload goes on: a missing entry is skipped, the built-in
/// answers in its place.
pub fn report_missing(live: &Registry, next: &Registry) {
    let key = |m: &registry::MissingEntry| {
        (
            m.pattern.clone(),
            registry::list_name(m.capability),
            m.name.clone(),
        )
    };
    let before: BTreeSet<_> = live.missing().iter().map(key).collect();
    let after: BTreeSet<_> = next.missing().iter().map(key).collect();
    for m in next.missing() {
        if !before.contains(&key(m)) {
            tracing::warn!(
                missing = next.missing().len(),
                "{m}: skipped until a plugin of that name is loaded"
            );
        }
    }
    for m in live.missing() {
        if !after.contains(&key(m)) {
            let (pattern, list) = (&m.pattern, registry::list_name(m.capability));
            tracing::info!(chain = %pattern, list, plugin = %m.name, "chain entry is live again");
        }
    }
}

/// True for events that may change a plugin file's content or existence
/// (our own reads of the files must not trigger another pass).
fn relevant(kind: &EventKind) -> bool {
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        EventKind::Modify(ModifyKind::Metadata(_)) => false,
        _ => true,
    }
}

/// What the watcher thread sends.
enum Signal {
    Paths(Vec<PathBuf>),
    Rescan,
}

/// Watches `dir` until shutdown, swapping the manager's registry on every
/// change. Returns at once (with a warning) if the directory cannot be
/// watched.
pub async fn run(
    dir: PathBuf,
    manager: Arc<Manager>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Signal>();
    let watched = dir.clone();
    let handler = move |res: notify::Result<notify::Event>| {
        let signal = match res {
            Ok(e) if e.need_rescan() => Signal::Rescan,
            // Another name changed (a Kubernetes ConfigMap mount swaps its
            // `..data` symlink; a tool renames a directory): look at all.
            Ok(e) if relevant(&e.kind) && e.paths.iter().any(|p| !registry::is_plugin_file(p)) => {
                Signal::Rescan
            }
            Ok(e) if relevant(&e.kind) => Signal::Paths(
                e.paths
                    .into_iter()
                    .filter(|p| p.parent() == Some(watched.as_path()))
                    .collect(),
            ),
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(error = %e, "plugin directory watcher error, rescanning");
                Signal::Rescan
            }
        };
        let _ = tx.send(signal);
    };
    let mut watcher = match notify::recommended_watcher(handler) {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot watch the plugin directory: hot reload is off");
            return;
        }
    };
    if let Err(e) = watcher.watch(&dir, RecursiveMode::NonRecursive) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot watch the plugin directory: hot reload is off");
        return;
    }
    tracing::info!(dir = %dir.display(), "watching the plugin directory");
    // Files changed between the first load and the watch start.
    let mut pending: BTreeSet<PathBuf> = BTreeSet::new();
    let mut rescan = true;
    let mut since = Instant::now();
    loop {
        if rescan || !pending.is_empty() {
            if rescan {
                pending.extend(registry::wasm_files(&dir).unwrap_or_default());
                pending.extend(manager.registry().file_paths());
            }
            let live = manager.registry();
            let paths = std::mem::take(&mut pending);
            let prepared = {
                // A plain thread, not tokio's blocking pool: outside a tokio
                // context the plugin calls of the conformance suite run
                // inline (see `WasmPolicy`), not on a helper thread each.
                let live = live.clone();
                let (tx, rx) = tokio::sync::oneshot::channel();
                let spawned = std::thread::Builder::new()
                    .name("stowd-reload".into())
                    .spawn(move || {
                        let _ = tx.send(prepare(&live, &paths));
                    });
                match spawned {
                    Ok(_) => rx.await.map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            };
            match prepared {
                Ok(changes) => {
                    let (next, applied) = apply(&live, changes, &metrics.reloads, since);
                    if let Some(next) = next {
                        report_missing(&live, &next);
                        let missing = next.missing().len() as u64;
                        manager.swap_registry(Arc::new(next));
                        let gauge = &metrics.reloads.missing_chain_entries;
                        gauge.store(missing, Ordering::Relaxed);
                    }
                    applied.count(&metrics.reloads);
                }
                Err(e) => tracing::error!(error = %e, "plugin reload task failed"),
            }
            rescan = false;
        }
        // Wait for the first event of the next burst.
        tokio::select! {
            signal = rx.recv() => match signal {
                Some(s) => note(s, &mut pending, &mut rescan),
                None => break,
            },
            _ = shutdown.changed() => break,
        }
        since = Instant::now();
        // Then until the directory is quiet.
        while since.elapsed() < MAX_DELAY {
            tokio::select! {
                signal = tokio::time::timeout(DEBOUNCE, rx.recv()) => match signal {
                    Ok(Some(s)) => note(s, &mut pending, &mut rescan),
                    Ok(None) | Err(_) => break,
                },
                _ = shutdown.changed() => return,
            }
        }
    }
    drop(watcher);
}

fn note(signal: Signal, pending: &mut BTreeSet<PathBuf>, rescan: &mut bool) {
    match signal {
        Signal::Paths(p) => pending.extend(p),
        Signal::Rescan => *rescan = true,
    }
}
