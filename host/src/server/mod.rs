//! The `stowd` sidecar: units, the router endpoint and the native endpoint
//! on ZeroMQ sockets.
//!
//! One file per service: [`tq`] (a local unit's TransferQueue endpoint and
//! the router endpoint), [`native`] (`stowage/1`), [`exposition`] (the
//! Prometheus `/metrics` endpoint); [`errors`] is the one
//! mapping from errors to each protocol's replies. Services read and write
//! the store only through the manager and the units' own methods.
//!
//! [`start`] builds everything from a [`Config`]: loads the plugins, makes
//! the local units, binds one TransferQueue ROUTER per unit, one router-mode
//! TransferQueue endpoint fanning out to the configured units, and the
//! native `stowage/1` endpoint, watches the plugin directory (hot reload,
//! [`crate::reload`]) and serves `/metrics` if configured ([`exposition`],
//! the counters of [`crate::metrics`] and more). It returns a [`Running`]
//! handle with the resolved endpoints and a shutdown method.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::manager::{Manager, PeerUnit, Target};
use crate::metrics::Metrics;
use crate::policy::registry::Registry;
use crate::shm::{Channels, SegmentStore};
use crate::store::Unit;
use crate::transport::{self, Peer};
use crate::wire::native as wire_native;

mod errors;
pub mod exposition;
mod native;
mod offload;
mod tq;

pub use tq::TQ_IDENTITY_PREFIXES;

/// Why `stowd` could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    #[error(transparent)]
    Registry(#[from] crate::policy::registry::RegistryError),
    #[error("cannot read plugin directory {dir}: {source}")]
    PluginDir { dir: String, source: std::io::Error },
    #[error(transparent)]
    Chains(#[from] crate::policy::registry::MissingEntries),
    #[error(transparent)]
    Bind(#[from] crate::transport::TransportError),
    #[error(transparent)]
    Shm(#[from] crate::shm::ShmError),
    #[error("cannot spill: {0}")]
    Spill(String),
    #[error("[checkpoint] roots: {0}")]
    Checkpoint(String),
    #[error("cannot restore the checkpoint in {dir}: {reason}")]
    Restore { dir: String, reason: String },
    #[error("cannot bind the metrics endpoint {addr}: {source}")]
    Metrics {
        addr: String,
        source: std::io::Error,
    },
}

/// One served unit in the endpoints file.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct UnitEndpoint {
    pub id: String,
    pub endpoint: String,
}

/// Everything `stowd` serves, as written to `--endpoints-file`.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Endpoints {
    /// Process id of the server.
    pub pid: u32,
    /// Local units, each a TransferQueue storage-unit endpoint.
    pub units: Vec<UnitEndpoint>,
    /// The router-mode TransferQueue endpoint, if enabled.
    pub router: Option<UnitEndpoint>,
    /// The native `stowage/1` endpoint.
    pub native: String,
    /// Loaded policy plugins (`name@version`).
    pub plugins: Vec<String>,
    /// Shared-memory directory for same-node clients, if enabled.
    pub shm_dir: Option<String>,
    /// The Prometheus endpoint (`http://host:port/metrics`), if enabled.
    #[serde(default)]
    pub metrics: Option<String>,
}

impl Endpoints {
    /// Writes the file atomically (temp file + rename).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(tmp, path)
    }
}

/// A running server.
pub struct Running {
    pub endpoints: Endpoints,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// Stops every socket loop and waits for them.
    pub async fn shutdown_and_wait(self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Raises the soft limit of open files to the hard one (every connection
/// is a file) and warns when even that is short of the endpoints' tables.
fn open_files_limit(config: &Config, max_connections: usize) {
    let endpoints = config.units.local as u64 + u64::from(config.router.enabled) + 1;
    let needed = endpoints * max_connections as u64 + 256;
    match transport::table::raise_open_files_limit() {
        Ok(n) if n < needed => tracing::warn!(
            limit = n,
            needed,
            "open files limit below the connection tables (endpoints x limits.max_connections              + 256): raise the hard limit (ulimit -Hn, LimitNOFILE=) or lower max_connections"
        ),
        Ok(n) => tracing::debug!(limit = n, "open files limit"),
        Err(e) => tracing::warn!(error = %e, "cannot read or raise the open files limit"),
    }
}

/// `[shm] max_leases` when it is 0: a quarter of the open-files limit
/// `nofile` (unknown or unlimited: 2^20), at least 1; see
/// [`crate::config::ShmConfig::max_leases`].
fn default_max_leases(nofile: Option<u64>) -> u64 {
    (nofile.unwrap_or(1 << 20) / 4).max(1)
}

/// Removes expired leases once a second until shutdown.
async fn sweep_leases(store: Arc<SegmentStore>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => { store.sweep(); }
            _ = shutdown.changed() => break,
        }
    }
}

/// The plugin directory of `config`, made absolute (hot reload matches
/// the watcher's paths against the loaded files' paths).
pub fn plugin_dir(config: &Config) -> Option<std::path::PathBuf> {
    config
        .plugins
        .resolve_dir()
        .map(|d| d.canonicalize().unwrap_or(d))
}

/// Loads the plugins and configures the chains; refuses chain entries that
/// name no loaded plugin (unless their chain has `allow_missing`).
pub fn build_registry(config: &Config) -> Result<Registry, StartError> {
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
                .map_err(|source| StartError::PluginDir {
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
fn checkpoint_roots(config: &Config) -> Result<crate::checkpoint::Roots, StartError> {
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
            Err(e) => return Err(StartError::Checkpoint(format!("{}: {e}", r.display()))),
        }
    }
    let mut protected = Vec::new();
    if !config.units.spill_dir.is_empty() {
        // stowd's own directory in it (crate::spill), not the directory
        // given, which may be shared (/tmp).
        let uid = rustix::process::geteuid().as_raw();
        protected.push(
            std::path::PathBuf::from(&config.units.spill_dir).join(format!("stowd-spill-{uid}")),
        );
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
    Ok(crate::checkpoint::Roots::new(roots, protected))
}

/// What every TransferQueue endpoint (a unit or the router) is served with.
struct TqServing {
    /// Where SAVE and LOAD may write and read.
    roots: Arc<crate::checkpoint::Roots>,
    metrics: Arc<Metrics>,
    tq_extra: bool,
    limits: crate::wire::tq::Limits,
    offload: Arc<offload::Offload>,
    transport_limits: transport::Limits,
    shutdown: watch::Receiver<bool>,
}

impl TqServing {
    /// Binds `addr` and serves `backend` there as `id`; returns the bound
    /// endpoint.
    async fn spawn(
        &self,
        addr: &str,
        id: &str,
        backend: tq::Backend,
        tasks: &mut Vec<JoinHandle<()>>,
    ) -> Result<String, StartError> {
        let (socket, endpoint) = transport::bind(addr).await?;
        let service =
            tq::TqService::new(id.to_string(), backend, self.metrics.clone(), self.tq_extra)
                .with_limits(self.limits, self.offload.clone())
                .with_roots(self.roots.clone());
        let serve = transport::serve_with(
            socket,
            service,
            self.transport_limits,
            self.shutdown.clone(),
        );
        tasks.push(tokio::spawn(serve));
        Ok(endpoint)
    }
}

/// Starts every socket of `config`.
pub async fn start(config: Config) -> Result<Running, StartError> {
    let registry = Arc::new(build_registry(&config)?);
    let plugins: Vec<String> = registry
        .names()
        .iter()
        .filter_map(|n| {
            registry
                .get(n)
                .map(|l| format!("{}@{}", n, l.policy.describe().version))
        })
        .collect();
    let (shutdown, rx) = watch::channel(false);
    let mut tasks = Vec::new();
    let metrics = Arc::new(Metrics::default());
    let missing = registry.missing().len() as u64;
    metrics
        .reloads
        .missing_chain_entries
        .store(missing, std::sync::atomic::Ordering::Relaxed);
    let tq_extra_on = config.metrics.tq_extra;
    let host = &config.server.host;
    let pid = std::process::id();
    let (capacity, bound) = config.units.unit_capacity();
    tracing::info!(capacity_per_unit = ?capacity, "unit capacity: {bound}");
    let transport_limits = config.limits.transport_limits();
    open_files_limit(&config, transport_limits.max_connections);
    let tq_limits = crate::wire::tq::Limits {
        max_rows: config.limits.max_rows,
        max_fields: config.limits.max_fields,
    };
    let offload = offload::Offload::new(offload::Offload::DEFAULT_CUTOFF);
    let roots = Arc::new(checkpoint_roots(&config)?);
    let serving = TqServing {
        roots: roots.clone(),
        metrics: metrics.clone(),
        tq_extra: tq_extra_on,
        limits: tq_limits,
        offload: offload.clone(),
        transport_limits,
        shutdown: rx.clone(),
    };

    // Every local unit records its puts and clears in one journal once a
    // checkpoint is taken (crate::journal).
    let journal = Arc::new(crate::journal::Journal::with_max(
        config.checkpoint.max_journals as usize,
    ));
    // With [units] spill_dir, one spiller bounds the units' memory together.
    let spiller = match config.units.spill().map_err(StartError::Spill)? {
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
                    .map_err(|e| StartError::Spill(format!("{dir}: {e}")))?,
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
                        Target::Peer(Arc::new(PeerUnit::new(
                            u,
                            endpoint,
                            unit,
                            format!("{sender}_to_unit{i}"),
                            config.limits.receive_limits(),
                            pool,
                        )))
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
    let manager = Arc::new(
        Manager::new(
            targets,
            registry.clone(),
            config.limits.clone(),
            Duration::from_secs(config.router.timeout_secs),
            sender,
        )
        .with_cache(cache)
        .with_dedup(config.dedup.fields.clone()),
    );

    if let Some(dir) = &config.restore {
        let units = manager.all_local().map_err(|remote| StartError::Restore {
            dir: dir.display().to_string(),
            reason: format!("stowd routes to {remote} remote unit(s) it cannot restore"),
        })?;
        let (path, journal, at) = (dir.clone(), journal.clone(), roots.clone());
        let restored = tokio::task::spawn_blocking(move || {
            use crate::checkpoint::dir as ckpt;
            let dir = at.dir(&path.to_string_lossy(), false)?;
            ckpt::restore(&units, &journal, &dir)
        })
        .await
        .map_err(|e| StartError::Restore {
            dir: dir.display().to_string(),
            reason: e.to_string(),
        })?
        .map_err(|e| StartError::Restore {
            dir: dir.display().to_string(),
            reason: e.to_string(),
        })?;
        tracing::info!(
            dir = %dir.display(),
            seq = restored.seq,
            rows = restored.rows,
            lost = restored.lost,
            verify_ms = restored.verify.as_millis() as u64,
            total_ms = restored.total.as_millis() as u64,
            "checkpoint restored"
        );
    }

    let mut unit_endpoints = Vec::new();
    for (i, unit) in (0u32..).zip(&units) {
        let id = unit.id().to_string();
        let port = if config.units.port_base == 0 {
            0
        } else {
            config.units.port_base as u32 + i
        };
        let addr = format!("tcp://{host}:{port}");
        let backend = tq::Backend::Unit(unit.clone());
        let endpoint = serving.spawn(&addr, &id, backend, &mut tasks).await?;
        tracing::info!(unit = %id, %endpoint, "unit listening");
        unit_endpoints.push(UnitEndpoint { id, endpoint });
    }

    let router = if config.router.enabled {
        let id = format!("TQ_STORAGE_UNIT_{:08x}", (pid << 8) ^ 0xff);
        let addr = format!("tcp://{host}:{}", config.router.port);
        let backend = tq::Backend::Router(manager.clone());
        let endpoint = serving.spawn(&addr, &id, backend, &mut tasks).await?;
        tracing::info!(%endpoint, units = manager.targets().len(), "router listening");
        Some(UnitEndpoint { id, endpoint })
    } else {
        None
    };

    let native_limits = wire_native::Limits {
        max_rows: config.limits.max_rows,
        max_fields: config.limits.max_fields,
        max_frames: config.limits.max_request_frames,
        max_message_bytes: config.limits.max_request_bytes,
    };
    let (socket, native_endpoint) =
        transport::bind(&format!("tcp://{host}:{}", config.server.native_port)).await?;
    let obsolete = config.shm.obsolete_keys();
    if !obsolete.is_empty() {
        tracing::warn!(
            keys = ?obsolete,
            "[shm] keys that no longer have any effect: same-node segments are sealed memory \
             files handed over as descriptors, never reused and never held for a reader; \
             remove them from the config"
        );
    }
    let shm = if config.shm.enabled {
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
        let connection_leases =
            usize::try_from(config.shm.max_connection_leases).unwrap_or(usize::MAX);
        let store = Arc::new(
            store
                .with_lease_counts(max_leases, connection_leases.min(max_leases))
                .with_lease_quota(quota)
                .with_connection_lease_quota(per_connection)
                .with_prealloc(
                    config.shm.prealloc_bytes,
                    Duration::from_secs(config.shm.prealloc_idle_secs),
                ),
        );
        let (channels, listener) = Channels::bind(
            &config.shm.dir,
            transport_limits.max_connections,
            transport_limits.write_timeout,
        )?;
        tasks.push(tokio::spawn(sweep_leases(store.clone(), rx.clone())));
        tasks.push(tokio::spawn(channels.clone().serve(listener, rx.clone())));
        if let Some(d) = channels.path().parent() {
            roots.protect(d.to_path_buf());
        }
        tracing::info!(
            channel = %channels.path().display(),
            max_leased_bytes = quota,
            max_leases,
            "same-node shared memory enabled"
        );
        Some((store, channels))
    } else {
        None
    };
    let pack_limits = config.limits.pack_limits();
    let service = Arc::new(native::NativeService {
        roots: roots.clone(),
        manager: manager.clone(),
        limits: native_limits,
        pack_limits,
        shm: shm.clone(),
        metrics: metrics.clone(),
        endpoint: native_endpoint.clone(),
        offload,
        units: units.clone(),
    });
    tasks.push(tokio::spawn(transport::serve_with(
        socket,
        service,
        transport_limits,
        rx.clone(),
    )));
    tracing::info!(endpoint = %native_endpoint, "native endpoint listening");

    let metrics_endpoint = if config.metrics.port != 0 {
        let addr = format!("{}:{}", config.metrics.host, config.metrics.port);
        // Bound by tokio (SO_REUSEADDR, as before), served on a thread of its own.
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .and_then(|l| l.into_std())
            .map_err(|source| StartError::Metrics {
                addr: addr.clone(),
                source,
            })?;
        let local = listener
            .local_addr()
            .map_err(|source| StartError::Metrics {
                addr: addr.clone(),
                source,
            })?;
        let (m, mg, us) = (metrics.clone(), manager.clone(), units.clone());
        let render: exposition::Render = Arc::new(move || exposition::render(&m, &mg, &us));
        tasks.push(exposition::spawn(listener, render, rx.clone()));
        let url = format!("http://{local}/metrics");
        tracing::info!(endpoint = %url, "metrics endpoint listening");
        Some(url)
    } else {
        None
    };

    if config.plugins.watch {
        match plugin_dir(&config) {
            Some(dir) if dir.is_dir() => {
                tasks.push(tokio::spawn(crate::reload::run(
                    dir,
                    manager.clone(),
                    metrics.clone(),
                    rx.clone(),
                )));
            }
            _ => tracing::info!("no plugin directory to watch: hot reload is off"),
        }
    }

    let shm_dir = shm.as_ref().map(|_| config.shm.dir.display().to_string());
    let endpoints = Endpoints {
        pid,
        units: unit_endpoints,
        router,
        native: native_endpoint,
        plugins,
        shm_dir,
        metrics: metrics_endpoint,
    };
    Ok(Running {
        endpoints,
        shutdown,
        tasks,
    })
}
