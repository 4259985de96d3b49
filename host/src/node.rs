//! A node: everything `stowd` holds, built from a [`Config`] before any
//! socket is bound. [`Node::build`] loads the plugins, makes the journal,
//! the spiller, the local units, the read cache, the managers (the node's,
//! which routes `g % N` over the configured units, and one per local unit,
//! [`Manager::over_unit`]) and the same-node segment store, and restores a
//! checkpoint if asked. [`crate::server::run`] serves a node on bound
//! listeners; nothing in `server` makes or changes what a node holds.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::checkpoint::Roots;
use crate::config::Config;
use crate::journal::Journal;
use crate::manager::{Manager, PeerUnit, Target};
use crate::metrics::Metrics;
use crate::policy::registry::Registry;
use crate::shm::SegmentStore;
use crate::store::Unit;
use crate::transport::{self, Peer};

/// Why a node could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    #[error(transparent)]
    Registry(#[from] crate::policy::registry::RegistryError),
    #[error("cannot read plugin directory {dir}: {source}")]
    PluginDir { dir: String, source: std::io::Error },
    #[error(transparent)]
    Chains(#[from] crate::policy::registry::MissingEntries),
    #[error("cannot spill: {0}")]
    Spill(String),
    #[error("[checkpoint] roots: {0}")]
    Checkpoint(String),
    #[error("cannot restore the checkpoint in {dir}: {reason}")]
    Restore { dir: String, reason: String },
    #[error("[security] token_file: {0}")]
    Token(String),
    #[error("stowd's CURVE keys: {0}")]
    Curve(String),
}

/// Everything a running `stowd` holds.
pub struct Node {
    /// This process's id (in unit ids and the endpoints file).
    pub pid: u32,
    /// Loaded policy plugins (`name@version`), as the endpoints file lists them.
    pub plugins: Vec<String>,
    pub metrics: Arc<Metrics>,
    /// Where checkpoints may be written and read.
    pub roots: Arc<Roots>,
    /// The local units, in configuration order.
    pub units: Vec<Arc<Unit>>,
    /// One manager per local unit, storing puts as they arrived.
    pub unit_managers: Vec<Arc<Manager>>,
    /// The node's manager: `g % N` over the configured units.
    pub manager: Arc<Manager>,
    /// Same-node segments, if `[shm] enabled`.
    pub segments: Option<Arc<SegmentStore>>,
    /// stowd's own token, with `[security] auth = "token"`.
    pub token: Option<String>,
    /// The tokens `/metrics` beyond loopback takes, and with `[security]
    /// auth = "token"` what a native client must present.
    pub auth: Option<Arc<crate::auth::Tokens>>,
    /// With `[security] auth = "curve"`: stowd's CURVE keys, and the
    /// client keys the native endpoint takes.
    pub curve: Option<Arc<crate::auth::CurveKeys>>,
}

impl Node {
    /// Builds the node of `config` (see the module docs).
    pub async fn build(config: &Config) -> Result<Node, BuildError> {
        let registry = Arc::new(build_registry(config)?);
        let plugins: Vec<String> = registry
            .names()
            .iter()
            .filter_map(|n| {
                registry
                    .get(n)
                    .map(|l| format!("{}@{}", n, l.policy.describe().version))
            })
            .collect();
        let metrics = Arc::new(Metrics::default());
        metrics.reloads.missing_chain_entries.store(
            registry.missing().len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        let pid = std::process::id();
        let (capacity, bound) = config.units.unit_capacity();
        tracing::info!(capacity_per_unit = ?capacity, "unit capacity: {bound}");
        // Freed memory goes back to the OS before it reaches a sixteenth of
        // the units' bound (crate::release).
        if let Some(each) = capacity {
            let units = u64::from(config.units.local.max(1));
            crate::release::trim_past(each.saturating_mul(units) / 16);
        }
        let roots = Arc::new(checkpoint_roots(config)?);
        let security = &config.security;
        let token = match security.requires_token() {
            true => {
                Some(crate::auth::load_or_make(&security.token_file).map_err(BuildError::Token)?)
            }
            false => None,
        };
        let auth = token
            .as_ref()
            .map(|own| Arc::new(crate::auth::Tokens::new(own, &security.tokens)));
        let curve = match security.curve() {
            true => Some(Arc::new(
                crate::auth::CurveKeys::load_or_make(security).map_err(BuildError::Curve)?,
            )),
            false => None,
        };
        let peer_token = match (security.peer_token.as_str(), &token) {
            ("", own) => own.clone(),
            (t, _) => Some(t.to_string()),
        };

        // Every local unit records its puts and clears in one journal once a
        // checkpoint is taken (crate::journal).
        let journal = Arc::new(Journal::with_max(config.checkpoint.max_journals as usize));
        // With [units] spill_dir, one spiller bounds the units' memory together.
        let spiller = match config.units.spill().map_err(BuildError::Spill)? {
            Some(sc) => {
                tracing::info!(
                    dir = %sc.dir.display(),
                    threshold = sc.threshold,
                    bound = sc.bound,
                    max_disk = ?sc.max_disk,
                    "spilling to disk past the threshold"
                );
                let dir = sc.dir.display().to_string();
                Some(
                    crate::spill::Spiller::start(sc)
                        .map_err(|e| BuildError::Spill(format!("{dir}: {e}")))?,
                )
            }
            None => None,
        };
        let units: Vec<Arc<Unit>> = (0..config.units.local)
            .map(|i| {
                let id = format!("TQ_STORAGE_UNIT_{:08x}", (pid << 8) ^ i);
                let unit = Unit::new(id, capacity).with_journal(journal.clone());
                Arc::new(match &spiller {
                    Some(s) => unit.with_spill(s.clone()),
                    None => unit,
                })
            })
            .collect();
        let unit_managers = units
            .iter()
            .map(|u| {
                Arc::new(Manager::over_unit(
                    u.clone(),
                    registry.clone(),
                    config.limits.clone(),
                ))
            })
            .collect();
        let manager = Arc::new(node_manager(
            config,
            pid,
            &units,
            registry,
            peer_token.as_deref(),
            curve.as_deref(),
        ));
        if let Some(dir) = &config.restore {
            restore(&manager, &roots, dir).await?;
        }
        let segments = config.shm.enabled.then(|| Arc::new(segment_store(config)));
        Ok(Node {
            pid,
            plugins,
            metrics,
            roots,
            units,
            unit_managers,
            manager,
            segments,
            token,
            auth,
            curve,
        })
    }
}

/// The node's manager: the configured units (`[router] units`, or every
/// local unit) with their peers' and remote units' connections, the read
/// cache if a peer unit is configured, and `[dedup]`. Peer units are
/// connected to with `curve` (ZMTP CURVE) if there are keys, else with
/// `peer_token` (ZMTP PLAIN) if there is one.
fn node_manager(
    config: &Config,
    pid: u32,
    units: &[Arc<Unit>],
    registry: Arc<Registry>,
    peer_token: Option<&str>,
    curve: Option<&crate::auth::CurveKeys>,
) -> Manager {
    let sender = format!(
        "TQ_STORAGE_{pid:08x}_{:08x}",
        std::time::UNIX_EPOCH
            .elapsed()
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    );
    let targets: Vec<Target> = if config.router.units.is_empty() {
        units.iter().cloned().map(Target::Local).collect()
    } else {
        config
            .router
            .units
            .iter()
            .enumerate()
            .map(|(i, u)| match u.strip_prefix("local:") {
                Some(n) => {
                    Target::Local(units[n.parse::<usize>().expect("checked by config")].clone())
                }
                None => match crate::config::parse_peer_unit(u) {
                    Some((endpoint, unit)) => {
                        let t = config.limits.transport_limits();
                        let pool = transport::ReceivePool::shared(
                            t.receive_pool_bytes,
                            t.receive_pool_idle,
                        );
                        let mut p = PeerUnit::new(
                            u,
                            endpoint,
                            unit,
                            format!("{sender}_to_unit{i}"),
                            config.limits.receive_limits(),
                            pool,
                        );
                        if let Some(k) = curve {
                            p.peer = p.peer.with_curve(k.client.clone(), k.peer_server);
                        } else if let Some(t) = peer_token {
                            p.peer = p
                                .peer
                                .with_credentials(crate::auth::USERNAME.as_bytes(), t.as_bytes());
                        }
                        Target::Peer(Arc::new(p))
                    }
                    None => Target::Remote(Arc::new(Peer::with_limits(
                        u.clone(),
                        format!("{sender}_to_unit{i}"),
                        config.limits.receive_limits(),
                    ))),
                },
            })
            .collect()
    };
    let peers = targets
        .iter()
        .filter(|t| matches!(t, Target::Peer(_)))
        .count();
    let cache = (peers > 0 && config.cache.enabled).then(|| {
        let bound = config.cache.bound();
        tracing::info!(
            peers,
            max_bytes = bound,
            "read cache of peer units' rows enabled"
        );
        Arc::new(crate::cache::ReadCache::new(bound))
    });
    Manager::new(
        targets,
        registry,
        config.limits.clone(),
        Duration::from_secs(config.router.timeout_secs),
        sender,
    )
    .with_cache(cache)
    .with_dedup(config.dedup.fields.clone())
}

/// `stowd serve --restore DIR`: the checkpoint in `dir` into every unit,
/// before any socket is bound.
async fn restore(
    manager: &Manager,
    roots: &Arc<Roots>,
    dir: &std::path::Path,
) -> Result<(), BuildError> {
    use crate::manager::checkpoint::CheckpointRunError;
    let shown = dir.display().to_string();
    let restored = manager
        .restore(roots, &dir.to_string_lossy())
        .await
        .map_err(|e| BuildError::Restore {
            dir: shown.clone(),
            reason: match e {
                CheckpointRunError::Remote(remote) => {
                    format!("stowd routes to {remote} remote unit(s) it cannot restore")
                }
                other => other.to_string(),
            },
        })?
        .1;
    tracing::info!(
        dir = %shown,
        seq = restored.seq,
        rows = restored.rows,
        lost = restored.lost,
        verify_ms = restored.verify.as_millis() as u64,
        total_ms = restored.total.as_millis() as u64,
        "checkpoint restored"
    );
    Ok(())
}

/// The same-node segment store of `[shm]`, its lease counts and quotas
/// resolved (0: the default each key documents).
fn segment_store(config: &Config) -> SegmentStore {
    let nofile = crate::sys::raise_nofile();
    let store = SegmentStore::new(
        Duration::from_secs(config.shm.lease_secs),
        config.shm.max_lease_bytes,
    );
    let quota = match config.shm.max_leased_bytes {
        0 => crate::sys::mem_total().unwrap_or(u64::MAX),
        n => n,
    };
    let per_connection = match config.shm.max_connection_leased_bytes {
        0 => config.shm.max_lease_bytes,
        n => n,
    };
    let max_leases = match config.shm.max_leases {
        0 => default_max_leases(nofile),
        n => n,
    };
    let max_leases = usize::try_from(max_leases).unwrap_or(usize::MAX);
    let connection_leases = usize::try_from(config.shm.max_connection_leases).unwrap_or(usize::MAX);
    tracing::info!(
        max_leased_bytes = quota,
        max_leases,
        "same-node shared memory enabled"
    );
    store
        .with_lease_counts(max_leases, connection_leases.min(max_leases))
        .with_lease_quota(quota)
        .with_connection_lease_quota(per_connection)
        .with_prealloc(
            config.shm.prealloc_bytes,
            Duration::from_secs(config.shm.prealloc_idle_secs),
        )
}

/// `[shm] max_leases` when it is 0: a quarter of the open-files limit
/// `nofile` (unknown or unlimited: 2^20), at least 1; see
/// [`crate::config::ShmConfig::max_leases`].
fn default_max_leases(nofile: Option<u64>) -> u64 {
    (nofile.unwrap_or(1 << 20) / 4).max(1)
}

/// The plugin directory of `config`, made absolute (hot reload matches
/// the watcher's paths against the loaded files' paths).
pub fn plugin_dir(config: &Config) -> Option<PathBuf> {
    config
        .plugins
        .resolve_dir()
        .map(|d| d.canonicalize().unwrap_or(d))
}

/// Loads the plugins and configures the chains; refuses chain entries that
/// name no loaded plugin (unless their chain has `allow_missing`).
pub fn build_registry(config: &Config) -> Result<Registry, BuildError> {
    let dir = plugin_dir(config);
    let cache = config
        .plugins
        .cache_dir
        .clone()
        .or_else(|| dir.as_ref().map(|d| d.join(".cache")));
    let mut registry = Registry::new(cache, config.plugins.sandbox())?
        .with_overrides(config.plugins.overrides.clone());
    match &dir {
        Some(d) => {
            let check_at_start = config.plugins.check_at_start;
            let reports = registry
                .load_dir_checked(d, |p| {
                    if check_at_start {
                        crate::conformance::verify(p).map(|_| ())
                    } else {
                        Ok(())
                    }
                })
                .map_err(|source| BuildError::PluginDir {
                    dir: d.display().to_string(),
                    source,
                })?;
            let loaded = reports.iter().filter(|r| r.result.is_ok()).count();
            tracing::info!(dir = %d.display(), loaded, refused = reports.len() - loaded, "plugins");
        }
        None => tracing::warn!("no plugin directory found: only the built-in policy answers"),
    }
    registry.configure(&config.chains);
    registry.check_chains()?;
    for m in registry.missing() {
        tracing::info!("{m}: skipped until a plugin of that name is loaded (allow_missing)");
    }
    Ok(registry)
}

/// `[checkpoint] roots`, each made (0700) if missing and made canonical,
/// and the directories of `stowd`'s state no checkpoint may lie in.
/// The default root is dropped with a WARN if it cannot be made; a root
/// set in the configuration that cannot be made stops the start.
fn checkpoint_roots(config: &Config) -> Result<Roots, BuildError> {
    use std::os::unix::fs::DirBuilderExt;
    let default = crate::config::CheckpointConfig::default_root();
    let mut roots = Vec::new();
    for r in &config.checkpoint.roots {
        let made = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(r)
            .and_then(|()| r.canonicalize());
        match made {
            Ok(c) => {
                if c == std::path::Path::new("/") {
                    tracing::warn!(
                        "[checkpoint] roots has \"/\": any client may make stowd write or read \
                         a checkpoint at any path stowd's user can reach (TransferQueue's own \
                         behaviour); name the directories checkpoints belong in instead"
                    );
                }
                roots.push(c);
            }
            Err(e) if *r == default => tracing::warn!(
                root = %r.display(), error = %e,
                "cannot make the default checkpoint root: checkpoints are refused until \
                 [checkpoint] roots names a directory"
            ),
            Err(e) => return Err(BuildError::Checkpoint(format!("{}: {e}", r.display()))),
        }
    }
    let mut protected = Vec::new();
    if !config.units.spill_dir.is_empty() {
        // stowd's own directory in it (crate::spill), not the directory
        // given, which may be shared (/tmp).
        let uid = rustix::process::geteuid().as_raw();
        protected.push(PathBuf::from(&config.units.spill_dir).join(format!("stowd-spill-{uid}")));
    }
    if let Some(d) = plugin_dir(config) {
        protected.push(d.join(".cache"));
        protected.push(d);
    }
    if let Some(d) = &config.plugins.cache_dir {
        protected.push(d.clone());
    }
    for p in &mut protected {
        if let Ok(c) = p.canonicalize() {
            *p = c;
        }
    }
    tracing::info!(roots = ?roots, "checkpoints are written and read only under these roots");
    Ok(Roots::new(roots, protected))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_max_leases_is_a_quarter_of_nofile() {
        assert_eq!(default_max_leases(Some(1024)), 256);
        assert_eq!(default_max_leases(Some(3)), 1);
        assert_eq!(default_max_leases(None), 1 << 18);
    }
}
