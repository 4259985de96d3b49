//! The `stowd` sidecar: units, the router endpoint and the native endpoint
//! on ZeroMQ sockets.
//!
//! One file per service: [`tq`] (a local unit's TransferQueue endpoint and
//! the router endpoint), [`native`] (`stowage/1`), [`exposition`] (the
//! Prometheus `/metrics` endpoint); [`errors`] is the one
//! mapping from errors to each protocol's replies. Services read and write
//! the store only through the manager and the units' own methods.
//!
//! Start-up is three steps, each testable alone: [`Node::build`] makes
//! what `stowd` holds (plugins, units, managers, restore: [`crate::node`]);
//! [`Listeners::bind`] binds one TransferQueue ROUTER per unit, the
//! router-mode TransferQueue endpoint, the native `stowage/1` endpoint, the
//! same-node descriptor channel and `/metrics`, and knows the
//! [`Endpoints`]; [`run`] serves the node on them until shutdown, and
//! watches the plugin directory (hot reload, [`crate::reload`]). The
//! binary parses its arguments, installs tracing and calls these.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::manager::Manager;
use crate::metrics::Protocol;
use crate::node::{BuildError, Node};
use crate::shm::{Channels, SegmentStore};
use crate::transport::{self, Listener};
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
    Build(#[from] BuildError),
    #[error(transparent)]
    Bind(#[from] crate::transport::TransportError),
    #[error(transparent)]
    Shm(#[from] crate::shm::ShmError),
    #[error(
        "[metrics] host = {0:?} is not a loopback address: /metrics there takes \
         `Authorization: Bearer <token>`, which needs [security] auth = \"token\""
    )]
    MetricsOpen(String),
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
    /// The token the native endpoint takes (ZMTP PLAIN's password), with
    /// `[security] auth = "token"`: the file is written mode 0600.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// The native endpoint's CURVE public key (Z85), with `[security]
    /// auth = "curve"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub curve_server_key: Option<String>,
}

impl Endpoints {
    /// Writes the file atomically (temp file + rename), mode 0600: it may
    /// hold the token.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = path.with_extension("tmp");
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)?;
        drop(f);
        std::fs::rename(tmp, path)
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
            "open files limit below the connection tables (endpoints x limits.max_connections \
             + 256): raise the hard limit (ulimit -Hn, LimitNOFILE=) or lower max_connections"
        ),
        Ok(n) => tracing::debug!(limit = n, "open files limit"),
        Err(e) => tracing::warn!(error = %e, "cannot read or raise the open files limit"),
    }
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

/// One bound TransferQueue endpoint: its socket, its id and its address.
struct TqListener {
    listener: Listener,
    unit: UnitEndpoint,
}

/// Every socket of a node, bound: what [`run`] serves on.
pub struct Listeners {
    /// One per local unit, in the node's order.
    units: Vec<TqListener>,
    router: Option<TqListener>,
    native: (Listener, String),
    /// The same-node descriptor channel, with `[shm] enabled`.
    channels: Option<(Arc<Channels>, tokio::net::UnixListener)>,
    /// `/metrics`, if `[metrics] port` is set, and its URL.
    metrics: Option<(std::net::TcpListener, String, exposition::Bearer)>,
    /// The plugin directory to watch, if `[plugins] watch`.
    watch: Option<std::path::PathBuf>,
    config: Config,
}

impl Listeners {
    /// Binds every socket `config` names for `node` (its units' ids name
    /// the unit endpoints).
    pub async fn bind(config: &Config, node: &Node) -> Result<Listeners, StartError> {
        let host = &config.server.host;
        let transport_limits = config.limits.transport_limits();
        open_files_limit(config, transport_limits.max_connections);
        let mut units = Vec::new();
        for (i, unit) in (0u32..).zip(&node.units) {
            let port = match config.units.port_base {
                0 => 0,
                base => base as u32 + i,
            };
            let (listener, endpoint) = transport::bind(&format!("tcp://{host}:{port}")).await?;
            let id = unit.id().to_string();
            tracing::info!(unit = %id, %endpoint, "unit listening");
            units.push(TqListener {
                listener,
                unit: UnitEndpoint { id, endpoint },
            });
        }
        let router = if config.router.enabled {
            let id = format!("TQ_STORAGE_UNIT_{:08x}", (node.pid << 8) ^ 0xff);
            let addr = format!("tcp://{host}:{}", config.router.port);
            let (listener, endpoint) = transport::bind(&addr).await?;
            tracing::info!(%endpoint, units = node.manager.targets().len(), "router listening");
            Some(TqListener {
                listener,
                unit: UnitEndpoint { id, endpoint },
            })
        } else {
            None
        };
        if !units.is_empty() || router.is_some() {
            let reach = match config.security.tq_endpoints.as_str() {
                "open" => format!("any host that reaches {host}"),
                _ => "every local user (loopback connections only: [security] tq_endpoints = \"loopback\")".into(),
            };
            tracing::warn!(
                units = units.len(),
                router = router.is_some(),
                "the TransferQueue endpoints take no credentials (TransferQueue's clients cannot \
                 present any): {reach} can read and write their rows, the router's being every \
                 unit's; [units] local = 0 with [router] enabled = false closes them"
            );
        }
        let native =
            transport::bind(&format!("tcp://{host}:{}", config.server.native_port)).await?;
        tracing::info!(endpoint = %native.1, "native endpoint listening");
        match (&node.curve, &node.auth) {
            (Some(k), _) => {
                tracing::info!(
                    curve_dir = %config.security.curve_dir.display(),
                    server_key = %k.server_public(),
                    "native endpoint speaks CURVE: encrypted, and takes stowd's client.key or \
                     [security] curve_clients"
                );
            }
            (None, Some(_)) => {
                tracing::info!(
                    token_file = %config.security.token_file.display(),
                    "native endpoint takes stowd's token or [security] tokens (ZMTP PLAIN)"
                );
            }
            (None, None) => tracing::warn!(
                endpoint = %native.1,
                "[security] auth = \"none\": the native endpoint takes no credentials, \
                 whoever reaches it can read and write every row"
            ),
        }
        let obsolete = config.shm.obsolete_keys();
        if !obsolete.is_empty() {
            tracing::warn!(
                keys = ?obsolete,
                "[shm] keys that no longer have any effect: same-node segments are sealed memory \
                 files handed over as descriptors, never reused and never held for a reader; \
                 remove them from the config"
            );
        }
        let channels = match node.segments {
            Some(_) => {
                let (channels, listener) = Channels::bind(
                    &config.shm.dir,
                    transport_limits.max_connections,
                    transport_limits.write_timeout,
                )?;
                if let Some(d) = channels.path().parent() {
                    node.roots.protect(d.to_path_buf());
                }
                tracing::info!(channel = %channels.path().display(), "same-node channel listening");
                Some((channels, listener))
            }
            None => None,
        };
        let metrics = if config.metrics.port != 0 {
            let addr = format!("{}:{}", config.metrics.host, config.metrics.port);
            let err = |source| StartError::Metrics {
                addr: addr.clone(),
                source,
            };
            // Bound by tokio (SO_REUSEADDR, as before), served on a thread of its own.
            let listener = tokio::net::TcpListener::bind(&addr)
                .await
                .and_then(|l| l.into_std())
                .map_err(err)?;
            let local = listener.local_addr().map_err(err)?;
            let url = format!("http://{local}/metrics");
            // Beyond loopback, a scrape must carry the token.
            let bearer = match (local.ip().is_loopback(), &node.auth) {
                (true, _) => None,
                (false, Some(tokens)) => Some(tokens.clone()),
                (false, None) => return Err(StartError::MetricsOpen(config.metrics.host.clone())),
            };
            tracing::info!(endpoint = %url, bearer = bearer.is_some(), "metrics endpoint listening");
            Some((listener, url, bearer))
        } else {
            None
        };
        let watch = match (config.plugins.watch, crate::node::plugin_dir(config)) {
            (true, Some(dir)) if dir.is_dir() => Some(dir),
            (true, _) => {
                tracing::info!("no plugin directory to watch: hot reload is off");
                None
            }
            (false, _) => None,
        };
        Ok(Listeners {
            units,
            router,
            native,
            channels,
            metrics,
            watch,
            config: config.clone(),
        })
    }

    /// What the endpoints file says of these sockets and `node`.
    pub fn endpoints(&self, node: &Node) -> Endpoints {
        Endpoints {
            pid: node.pid,
            units: self.units.iter().map(|u| u.unit.clone()).collect(),
            router: self.router.as_ref().map(|r| r.unit.clone()),
            native: self.native.1.clone(),
            plugins: node.plugins.clone(),
            shm_dir: self
                .channels
                .as_ref()
                .map(|_| self.config.shm.dir.display().to_string()),
            metrics: self.metrics.as_ref().map(|(_, url, _)| url.clone()),
            token: node.token.clone(),
            curve_server_key: node.curve.as_ref().map(|k| k.server_public()),
        }
    }
}

/// Serves `node` on `listeners` until `shutdown` turns true, then waits
/// for every service to stop.
pub async fn run(listeners: Listeners, node: Node, shutdown: watch::Receiver<bool>) {
    let config = &listeners.config;
    let transport_limits = config.limits.transport_limits();
    let offload = offload::Offload::new(offload::Offload::DEFAULT_CUTOFF);
    let mut tasks: Vec<JoinHandle<()>> = Vec::new();
    let tq_service = |id: &str, manager: Arc<Manager>, protocol| {
        tq::TqService::new(
            id.to_string(),
            manager,
            protocol,
            node.metrics.clone(),
            config.metrics.tq_extra,
        )
        .with_limits(
            crate::wire::tq::Limits {
                max_rows: config.limits.max_rows,
                max_fields: config.limits.max_fields,
            },
            offload.clone(),
        )
        .with_roots(node.roots.clone())
        .loopback_only(config.security.tq_endpoints == "loopback")
    };
    let units = listeners.units.into_iter().zip(&node.unit_managers);
    let endpoints = units.map(|(l, m)| (l, m.clone(), Protocol::Tq)).chain(
        listeners
            .router
            .map(|l| (l, node.manager.clone(), Protocol::TqRouter)),
    );
    for (l, manager, protocol) in endpoints {
        let service = tq_service(&l.unit.id, manager, protocol);
        tasks.push(tokio::spawn(transport::serve_with(
            l.listener,
            service,
            transport_limits,
            shutdown.clone(),
        )));
    }
    let shm = match (listeners.channels, &node.segments) {
        (Some((channels, listener)), Some(store)) => {
            tasks.push(tokio::spawn(sweep_leases(store.clone(), shutdown.clone())));
            tasks.push(tokio::spawn(
                channels.clone().serve(listener, shutdown.clone()),
            ));
            Some((store.clone(), channels))
        }
        _ => None,
    };
    let (native_listener, native_endpoint) = listeners.native;
    let service = Arc::new(native::NativeService {
        roots: node.roots.clone(),
        manager: node.manager.clone(),
        limits: wire_native::Limits {
            max_rows: config.limits.max_rows,
            max_fields: config.limits.max_fields,
            max_frames: config.limits.max_request_frames,
            max_message_bytes: config.limits.max_request_bytes,
        },
        pack_limits: config.limits.pack_limits(),
        shm,
        inline_below: config.shm.inline_below,
        metrics: node.metrics.clone(),
        endpoint: native_endpoint,
        offload,
        units: node.unit_managers.clone(),
        auth: node.auth.clone(),
        curve: node.curve.clone(),
    });
    tasks.push(tokio::spawn(transport::serve_with(
        native_listener,
        service,
        transport_limits,
        shutdown.clone(),
    )));
    if let Some((listener, _, bearer)) = listeners.metrics {
        let (m, mg, us) = (
            node.metrics.clone(),
            node.manager.clone(),
            node.units.clone(),
        );
        let render: exposition::Render = Arc::new(move || exposition::render(&m, &mg, &us));
        tasks.push(exposition::spawn(
            listener,
            render,
            bearer,
            shutdown.clone(),
        ));
    }
    if let Some(dir) = listeners.watch {
        tasks.push(tokio::spawn(crate::reload::run(
            dir,
            node.manager.clone(),
            node.metrics.clone(),
            shutdown.clone(),
        )));
    }
    for t in tasks {
        let _ = t.await;
    }
}
