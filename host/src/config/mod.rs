//! `stowd` configuration: one TOML file, every key optional.
//!
//! With no file at all `stowd` runs on [`Config::default`]: it binds
//! 127.0.0.1 on ports the OS picks, serves two local units, a router
//! endpoint over them and the native endpoint, loads the bundled plugins and
//! uses [`registry::default_chains`]. `stowd.example.toml` at the repository
//! root lists every key with its default.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::plan::PackLimits;
use crate::policy::registry::{self, ChainConfig, LimitsOverride};
use crate::policy::wasm::SandboxLimits;

/// The whole configuration.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub units: UnitsConfig,
    pub router: RouterConfig,
    pub plugins: PluginsConfig,
    pub limits: LimitsConfig,
    pub shm: ShmConfig,
    pub metrics: MetricsConfig,
    pub cache: CacheConfig,
    pub dedup: DedupConfig,
    pub checkpoint: CheckpointConfig,
    pub security: SecurityConfig,
    /// Policy chains by field-name pattern, first match wins.
    #[serde(rename = "chain")]
    pub chains: Vec<ChainConfig>,
    /// Restore the last checkpoint in this directory at start, before
    /// serving (`stowd serve --restore DIR`; not a configuration key).
    #[serde(skip)]
    pub restore: Option<std::path::PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            server: ServerConfig::default(),
            units: UnitsConfig::default(),
            router: RouterConfig::default(),
            plugins: PluginsConfig::default(),
            limits: LimitsConfig::default(),
            shm: ShmConfig::default(),
            metrics: MetricsConfig::default(),
            cache: CacheConfig::default(),
            dedup: DedupConfig::default(),
            checkpoint: CheckpointConfig::default(),
            security: SecurityConfig::default(),
            chains: registry::default_chains(),
            restore: None,
        }
    }
}

/// Where `stowd` listens.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address every socket binds to.
    pub host: String,
    /// Port of the native `stowage/1` endpoint (0: the OS picks).
    pub native_port: u16,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            native_port: 0,
        }
    }
}

/// Local storage units.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct UnitsConfig {
    /// Number of in-process units, each with its own TransferQueue endpoint.
    pub local: u32,
    /// First port of the units' endpoints; unit i binds `port_base + i`
    /// (0: the OS picks every port).
    pub port_base: u16,
    /// Capacity of each unit in bytes (0: the default bound,
    /// `memory_percent`).
    pub capacity_bytes: u64,
    /// With `capacity_bytes` 0: the local units together hold at most this
    /// percentage of the memory stowd may use (`memory_bytes`), split evenly
    /// between them; a put past it is refused with a capacity error, so a
    /// job that forgets to clear is refused rather than OOM-killed with
    /// every row. 0: unlimited.
    pub memory_percent: u32,
    /// The memory `memory_percent` is a share of, bytes; 0: the machine's
    /// (`MemTotal`), or the memory limit of stowd's cgroup if lower.
    pub memory_bytes: u64,
    /// Spill the coldest extents to files in a private directory that
    /// `stowd` makes inside this one (`stowd-spill-<uid>`, mode 0700)
    /// instead of refusing puts past the unit capacity. This directory may
    /// be shared (`/tmp`): `stowd` creates it 0700 if it is missing, and
    /// otherwise never changes its mode or removes anything in it. Empty:
    /// no spill.
    pub spill_dir: String,
    /// Per unit: past this many bytes in memory (times the units, for all
    /// of them) a background thread spills the coldest extents. 0: 80% of
    /// the unit capacity.
    pub spill_threshold_bytes: u64,
    /// Most bytes in spill files at once, all units together. 0: as many
    /// as the disk holds.
    pub spill_max_bytes: u64,
}

impl Default for UnitsConfig {
    fn default() -> Self {
        UnitsConfig {
            local: 2,
            port_base: 0,
            capacity_bytes: 0,
            memory_percent: 50,
            memory_bytes: 0,
            spill_dir: String::new(),
            spill_threshold_bytes: 0,
            spill_max_bytes: 0,
        }
    }
}

impl UnitsConfig {
    /// The spiller's settings, if `spill_dir` is set: the threshold and the
    /// bound are per unit times the units. Err: a spill without a memory
    /// bound, or a threshold past it.
    pub fn spill(&self) -> Result<Option<crate::spill::SpillConfig>, String> {
        if self.spill_dir.is_empty() {
            return Ok(None);
        }
        let dir = std::path::PathBuf::from(&self.spill_dir);
        if !dir.is_absolute() {
            return Err(format!(
                "[units] spill_dir {:?} must be an absolute path",
                self.spill_dir
            ));
        }
        let (Some(capacity), _) = self.unit_capacity() else {
            return Err("[units] spill_dir needs a memory bound to spill past: set \
                        capacity_bytes, or memory_percent above 0"
                .into());
        };
        let threshold = match self.spill_threshold_bytes {
            0 => capacity / 5 * 4,
            t if t > capacity => {
                return Err(format!(
                    "[units] spill_threshold_bytes ({t}) is above the unit capacity ({capacity})"
                ));
            }
            t => t,
        };
        let units = u64::from(self.local.max(1));
        Ok(Some(crate::spill::SpillConfig {
            dir,
            threshold: threshold.saturating_mul(units),
            bound: capacity.saturating_mul(units),
            max_disk: (self.spill_max_bytes > 0).then_some(self.spill_max_bytes),
        }))
    }

    /// The capacity of each local unit: `capacity_bytes`, else its share
    /// of the default bound (None: unlimited), and where the bound came
    /// from (for the log).
    pub fn unit_capacity(&self) -> (Option<u64>, String) {
        if self.capacity_bytes > 0 {
            return (Some(self.capacity_bytes), "[units] capacity_bytes".into());
        }
        if self.memory_percent == 0 {
            return (None, "[units] memory_percent = 0: unlimited".into());
        }
        let (memory, source) = match self.memory_bytes {
            0 => crate::sys::memory_limit(),
            n => (Some(n), "[units] memory_bytes"),
        };
        let Some(memory) = memory else {
            return (None, "memory size unknown: unlimited".into());
        };
        let total = (u128::from(memory) * u128::from(self.memory_percent) / 100) as u64;
        let each = total / u64::from(self.local.max(1));
        (
            Some(each.max(1)),
            format!(
                "{}% of {memory} bytes ({source}) over {} units",
                self.memory_percent,
                self.local.max(1)
            ),
        )
    }
}

/// Where checkpoints may be written and read ([`crate::checkpoint::confine`]).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Directories under which every checkpoint path a client names (a
    /// TransferQueue `SAVE_STORAGE_CHECKPOINT` / `LOAD_STORAGE_CHECKPOINT`
    /// file, a `checkpoint` or `restore` directory) and `serve --restore`
    /// must lie; each is made (0700) if missing. Default: one directory,
    /// `checkpoints` under stowd's state directory
    /// ([`CheckpointConfig::default_root`]). `["/"]`: any path stowd's
    /// user can write, as TransferQueue's own units allow (a WARN at
    /// start). Empty: checkpoints are off.
    pub roots: Vec<PathBuf>,
    /// Most checkpoint directories whose journals are kept at once (each
    /// costs every put one more `fdatasync`); past it a journaled
    /// checkpoint into another directory is refused.
    pub max_journals: u32,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            roots: vec![CheckpointConfig::default_root()],
            max_journals: crate::journal::MAX_JOURNALS as u32,
        }
    }
}

impl CheckpointConfig {
    /// `checkpoints` in stowd's state directory ([`state_dir`]).
    pub fn default_root() -> PathBuf {
        state_dir().join("checkpoints")
    }
}

/// Who may talk to the native endpoint ([`crate::node`] makes the token).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecurityConfig {
    /// `"token"`: a client of the native endpoint, and a peer `stowd`,
    /// must present a token at the ZMTP handshake (the PLAIN mechanism,
    /// the token as its password): stowd's own (`token_file`) or one of
    /// `tokens`. `"none"`: no credentials (ZMTP NULL), anyone who can
    /// reach the endpoint may read and write every row. `"curve"`: the
    /// native endpoint and peer connections speak CurveZMQ (ZMTP CURVE):
    /// every byte encrypted, and a client must hold a key stowd accepts
    /// (its own `client.key` in `curve_dir`, or one of `curve_clients`).
    pub auth: String,
    /// stowd's own token: read if the file exists, else made (32 random
    /// bytes, hex) and written mode 0600. Default: `token` under stowd's
    /// state directory, where this user's clients look for it.
    pub token_file: PathBuf,
    /// More tokens the native endpoint takes (other users', other nodes').
    pub tokens: Vec<String>,
    /// The token presented to peer units (`stowage://` in `[router]
    /// units`). Default (empty): stowd's own.
    pub peer_token: String,
    /// Who may connect to the TransferQueue unit and router endpoints,
    /// which take no credentials (TransferQueue's clients cannot present
    /// any): `"loopback"`, only connections from a loopback address (every
    /// local user); `"open"`, any host that reaches them (a WARN at start
    /// when they are bound beyond loopback).
    pub tq_endpoints: String,
    /// With `auth = "curve"`: where stowd's CURVE keys are, in pyzmq's
    /// certificate format (`server.key`, `server.key_secret`, `client.key`,
    /// `client.key_secret`; the secret files mode 0600), made at first
    /// start when missing. Default: `curve` under stowd's state directory,
    /// where this user's clients look for them.
    pub curve_dir: PathBuf,
    /// More client public keys (Z85, 40 characters) the native endpoint
    /// takes under CURVE (other users', other nodes').
    pub curve_clients: Vec<String>,
    /// The server public key (Z85) of peer units under CURVE. Default
    /// (empty): stowd's own, as in a cluster whose stowds share one
    /// `curve_dir` (as `stowage.ray` launches them).
    pub peer_curve_server_key: String,
}

impl Default for SecurityConfig {
    fn default() -> Self {
        SecurityConfig {
            auth: "token".into(),
            token_file: state_dir().join("token"),
            tokens: Vec::new(),
            peer_token: String::new(),
            tq_endpoints: "loopback".into(),
            curve_dir: state_dir().join("curve"),
            curve_clients: Vec::new(),
            peer_curve_server_key: String::new(),
        }
    }
}

impl SecurityConfig {
    /// `auth = "token"` or `"curve"`: stowd has a token (the native
    /// endpoint's PLAIN password under `"token"`; under both, what a
    /// `/metrics` scrape beyond loopback presents).
    pub fn requires_token(&self) -> bool {
        matches!(self.auth.as_str(), "token" | "curve")
    }

    /// `auth = "curve"`.
    pub fn curve(&self) -> bool {
        self.auth == "curve"
    }

    fn validate(&self) -> Result<(), String> {
        if !matches!(self.auth.as_str(), "token" | "curve" | "none") {
            return Err(format!(
                "[security] auth = {:?}: \"token\", \"curve\" or \"none\"",
                self.auth
            ));
        }
        for (i, k) in self.curve_clients.iter().enumerate() {
            crate::transport::curve::z85_decode(k)
                .map_err(|e| format!("[security] curve_clients[{i}]: {e}"))?;
        }
        if !self.peer_curve_server_key.is_empty() {
            crate::transport::curve::z85_decode(&self.peer_curve_server_key)
                .map_err(|e| format!("[security] peer_curve_server_key: {e}"))?;
        }
        if !matches!(self.tq_endpoints.as_str(), "loopback" | "open") {
            return Err(format!(
                "[security] tq_endpoints = {:?}: \"loopback\" or \"open\"",
                self.tq_endpoints
            ));
        }
        if !self.tokens.iter().all(|t| token_ok(t))
            || (!self.peer_token.is_empty() && !token_ok(&self.peer_token))
        {
            return Err(
                "[security] tokens and peer_token: 1 to 255 bytes each, no whitespace".into(),
            );
        }
        Ok(())
    }
}

/// A token as stowd takes one: 1 to 255 bytes (PLAIN's password field), no
/// whitespace.
pub fn token_ok(t: &str) -> bool {
    !t.is_empty() && t.len() <= 255 && !t.chars().any(char::is_whitespace)
}

/// stowd's state directory: `$STATE_DIRECTORY` (systemd's
/// `StateDirectory=`), else `$XDG_STATE_HOME/stowd`, else
/// `~/.local/state/stowd`; with no home, `/var/lib/stowd` for root and
/// `<temp dir>/stowd-<uid>` for others.
pub fn state_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    std::env::var("STATE_DIRECTORY")
        .ok()
        .and_then(|v| v.split(':').next().map(PathBuf::from))
        .filter(|p| p.is_absolute())
        .or_else(|| var("XDG_STATE_HOME").map(|d| d.join("stowd")))
        .or_else(|| var("HOME").map(|h| h.join(".local/state/stowd")))
        .unwrap_or_else(|| {
            let uid = rustix::process::geteuid().as_raw();
            if uid == 0 {
                PathBuf::from("/var/lib/stowd")
            } else {
                std::env::temp_dir().join(format!("stowd-{uid}"))
            }
        })
}

/// Router mode: one TransferQueue endpoint fanning out to units.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Serve the router endpoint.
    pub enabled: bool,
    /// Its port (0: the OS picks).
    pub port: u16,
    /// Units to route to, in order (`g % N` picks one): `local:<i>` for an
    /// in-process unit, `tcp://host:port` for a remote TransferQueue unit
    /// (another `stowd` or TransferQueue's own), `stowage://host:port/<i>`
    /// for unit `i` of another `stowd`, spoken to in `stowage/1` at its
    /// native port (rows in a few large frames; the read cache). Empty:
    /// every local unit.
    pub units: Vec<String>,
    /// Seconds to wait for a remote unit's reply.
    pub timeout_secs: u64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            enabled: true,
            port: 0,
            units: vec![],
            timeout_secs: 30,
        }
    }
}

/// Policy plugins and their sandbox.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct PluginsConfig {
    /// Directory of `.wasm` policies. Unset: the bundled plugins (the
    /// `plugins` folder next to the binary's folder, e.g. `target/plugins`
    /// for `target/debug/stowd`), or `$STOWD_PLUGIN_DIR`.
    pub dir: Option<PathBuf>,
    /// Compile cache. Unset: `<dir>/.cache`. Used only if private to this
    /// user (see [`crate::policy::cache`]).
    pub cache_dir: Option<PathBuf>,
    /// Fuel per policy call.
    pub fuel: u64,
    /// Linear-memory cap per plugin instance, bytes.
    pub memory_bytes: usize,
    /// Largest single `read` a plugin may make, bytes.
    pub read_cap: u64,
    /// Answers a pure plugin's memo keeps (0: none, every decision is a
    /// call).
    pub memo_entries: usize,
    /// Watch the directory: a new or changed `.wasm` is checked (the
    /// conformance suite), compiled and swapped in; a removed one unloads.
    pub watch: bool,
    /// Run the conformance suite on the plugins found at start too (plugins
    /// that arrive while running are always checked).
    pub check_at_start: bool,
    /// Sandbox limits of single plugins, by plugin name.
    pub overrides: BTreeMap<String, LimitsOverride>,
}

impl Default for PluginsConfig {
    fn default() -> Self {
        let s = SandboxLimits::default();
        PluginsConfig {
            dir: None,
            cache_dir: None,
            fuel: s.fuel,
            memory_bytes: s.memory_bytes,
            read_cap: s.read_cap,
            memo_entries: s.memo_entries,
            watch: true,
            check_at_start: false,
            overrides: BTreeMap::new(),
        }
    }
}

impl PluginsConfig {
    pub fn sandbox(&self) -> SandboxLimits {
        SandboxLimits {
            fuel: self.fuel,
            memory_bytes: self.memory_bytes,
            read_cap: self.read_cap,
            memo_entries: self.memo_entries,
        }
    }

    /// The plugin directory to load, if any exists.
    pub fn resolve_dir(&self) -> Option<PathBuf> {
        if let Some(d) = &self.dir {
            return Some(d.clone());
        }
        if let Some(d) = std::env::var_os("STOWD_PLUGIN_DIR") {
            return Some(PathBuf::from(d));
        }
        let exe = std::env::current_exe().ok()?;
        let bundled = exe.parent()?.parent()?.join("plugins");
        bundled.is_dir().then_some(bundled)
    }
}

/// Request and message limits.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Most frames one outgoing message may have.
    pub max_frames: u32,
    /// Largest outgoing message to a remote unit, bytes; larger puts are
    /// split into several messages.
    pub max_message_bytes: u64,
    /// Pieces below this size are "small" for the packing policy.
    pub small_piece_bytes: u64,
    /// Most rows (global indexes) in one request.
    pub max_rows: u64,
    /// Most fields in one request.
    pub max_fields: u64,
    /// Largest incoming message, bytes, all frames together. A bigger one is
    /// read to its end without being kept and answered with an error.
    pub max_request_bytes: u64,
    /// Most frames in one incoming message.
    pub max_request_frames: u64,
    /// Most open client connections per endpoint. When full, the longest
    /// idle connection is closed for a new client; only when all are busy
    /// is the new client closed at once.
    pub max_connections: u32,
    /// Most open connections from one peer address per endpoint; more are
    /// closed at once. 0: no cap. Unix-socket clients have no cap.
    pub max_connections_per_peer: u32,
    /// Seconds a connection may send nothing before it is closed (libzmq
    /// clients reconnect by themselves); 0: never.
    pub idle_timeout_secs: u64,
    /// Seconds a client has to take its reply; a client that stops reading
    /// loses its connection, and nobody else waits for it.
    pub write_timeout_secs: u64,
    /// Most bytes of freed large receive buffers kept for the next large
    /// frames (reused memory is already resident; fresh pages fault in at a
    /// fraction of copy speed); 0: off.
    pub receive_pool_bytes: u64,
    /// Seconds a pooled receive buffer may go unused before it is freed.
    pub receive_pool_idle_secs: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_frames: 1000,
            max_message_bytes: 64 << 20,
            small_piece_bytes: 64 << 10,
            max_rows: 1 << 24,
            max_fields: 1024,
            max_request_bytes: 8 << 30,
            max_request_frames: 1 << 20,
            max_connections: 1024,
            max_connections_per_peer: crate::transport::Limits::DEFAULT.max_connections_per_peer
                as u32,
            idle_timeout_secs: crate::transport::Limits::DEFAULT.idle_timeout.as_secs(),
            write_timeout_secs: 60,
            receive_pool_bytes: crate::transport::Limits::DEFAULT.receive_pool_bytes as u64,
            receive_pool_idle_secs: crate::transport::Limits::DEFAULT
                .receive_pool_idle
                .as_secs(),
        }
    }
}

impl LimitsConfig {
    /// What one connection may cost.
    pub fn transport_limits(&self) -> crate::transport::Limits {
        crate::transport::Limits {
            receive: self.receive_limits(),
            write_timeout: std::time::Duration::from_secs(self.write_timeout_secs),
            max_connections: self.max_connections as usize,
            max_connections_per_peer: self.max_connections_per_peer as usize,
            idle_timeout: std::time::Duration::from_secs(self.idle_timeout_secs),
            receive_pool_bytes: usize::try_from(self.receive_pool_bytes).unwrap_or(usize::MAX),
            receive_pool_idle: std::time::Duration::from_secs(self.receive_pool_idle_secs),
            ..crate::transport::Limits::DEFAULT
        }
    }

    /// Receive limits of every socket, replies from remote units included.
    pub fn receive_limits(&self) -> crate::transport::zmtp::Limits {
        crate::transport::zmtp::Limits {
            max_message_bytes: self.max_request_bytes,
            max_frames: usize::try_from(self.max_request_frames).unwrap_or(usize::MAX),
        }
    }

    pub fn pack_limits(&self) -> PackLimits {
        PackLimits {
            max_frames: self.max_frames,
            max_frame_bytes: self.max_message_bytes,
            small_threshold: self.small_piece_bytes,
        }
    }
}

/// Same-node shared memory.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShmConfig {
    /// Serve same-node clients through shared-memory segments.
    pub enabled: bool,
    /// Directory in which `stowd` makes its private (0700) directory for
    /// the descriptor-channel socket. It must be owned by `stowd`'s user or
    /// root, and not writable by group or others unless it has the sticky
    /// bit (`/dev/shm`, the default, and `/tmp` are root's, 1777); others
    /// are refused at start ([`crate::shm::channel`]). Missing: created
    /// 0700. Segments themselves are anonymous memory files and live in no
    /// directory.
    pub dir: PathBuf,
    /// Seconds a leased segment may stay unused before it is dropped.
    pub lease_secs: u64,
    /// Largest single lease, bytes.
    pub max_lease_bytes: u64,
    /// Most bytes of all leases granted and not yet put or expired,
    /// together; 0: the machine's memory (`MemTotal`).
    pub max_leased_bytes: u64,
    /// Most bytes of the leases of one connection granted and not yet put
    /// or expired; 0: `max_lease_bytes` (one lease of the largest size at
    /// a time).
    pub max_connection_leased_bytes: u64,
    /// Most leases granted and not yet put or expired, together, whatever
    /// their bytes: each keeps a descriptor open in `stowd` until then.
    /// 0: a quarter of `stowd`'s open-files limit (its soft
    /// `RLIMIT_NOFILE`, raised to the hard limit at start), so that leases
    /// alone never take the descriptors connections need: the connection
    /// tables take up to endpoints x `limits.max_connections` (3 x 1,024 at
    /// the defaults), and live segments, spill files and plugins take their
    /// own. With a hard limit of 20,000 that is 5,000 leases; with the
    /// common 1,048,576, 262,144.
    pub max_leases: u64,
    /// Most leases of one connection granted and not yet put or expired
    /// (at least 1; `max_leases` bounds it too). A put takes one lease
    /// and ends it within moments, and a client keeps one request in
    /// flight per connection, so a well-behaved connection holds a few at
    /// most; 256 leaves room for a client that leases ahead for many
    /// puts, while a connection leaking leases stops at 256 descriptors,
    /// and it takes 20 such connections to reach the total of a 20,000
    /// descriptor limit.
    pub max_connection_leases: u64,
    /// Bytes of memory files `stowd` allocates ahead of time, while idle,
    /// for the next leases and exports of the sizes recent ones had (a
    /// put then only copies into allocated pages); 0: allocate on demand.
    pub prealloc_bytes: u64,
    /// Seconds a file allocated ahead of time may go unused before it is
    /// freed.
    pub prealloc_idle_secs: u64,
    /// A same-node get whose rows come to fewer bytes than this is
    /// answered over the socket, as any get, with no segment made or
    /// named for it (`stowd_same_node_gets_inline_total`); 0: every
    /// same-node get through segments. Below it a segment's descriptor,
    /// mapping and checks cost the reader more than the bytes: a 4 KiB get
    /// took 47-51 µs through a segment and 32-38 µs over the socket, and
    /// the two met between 64 and 128 KiB, on one CPU and across two
    /// (`bench/same_node_small.py`; `docs/benchmarks.md`, "Same-node small
    /// gets").
    pub inline_below: u64,
    /// No longer used (cleared segments are never reused: a reader may
    /// still map them). Accepted, with a warning, so older configs load.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reuse_bytes: Option<u64>,
    /// No longer used (see `reuse_bytes`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reuse_secs: Option<u64>,
    /// No longer used: a same-node reply's descriptors reach the reader
    /// before the reply, so nothing needs holding for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reply_hold_ms: Option<u64>,
}

impl ShmConfig {
    /// The keys set that no longer have any effect.
    pub fn obsolete_keys(&self) -> Vec<&'static str> {
        [
            ("reuse_bytes", self.reuse_bytes.is_some()),
            ("reuse_secs", self.reuse_secs.is_some()),
            ("reply_hold_ms", self.reply_hold_ms.is_some()),
        ]
        .into_iter()
        .filter_map(|(k, set)| set.then_some(k))
        .collect()
    }
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            enabled: true,
            dir: PathBuf::from("/dev/shm"),
            lease_secs: 30,
            max_lease_bytes: 16 << 30,
            max_leased_bytes: 0,
            max_connection_leased_bytes: 0,
            max_leases: 0,
            max_connection_leases: 256,
            prealloc_bytes: 2 << 30,
            prealloc_idle_secs: 30,
            inline_below: 64 << 10,
            reuse_bytes: None,
            reuse_secs: None,
            reply_hold_ms: None,
        }
    }
}

/// The Prometheus endpoint.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address of the HTTP endpoint.
    pub host: String,
    /// Its port; 0: no metrics endpoint.
    pub port: u16,
    /// Add a `stowage` map of these figures to TransferQueue
    /// `METRICS_RESPONSE` bodies (off: exactly TransferQueue 0.1.11's keys).
    pub tq_extra: bool,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            host: "127.0.0.1".into(),
            port: 0,
            tq_extra: false,
        }
    }
}

/// The node-local read cache of peer units' rows (`stowage://` units in
/// `[router] units`; see `stowage_host::cache`).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Keep rows fetched from peer units, and fetch again only rows whose
    /// version changed.
    pub enabled: bool,
    /// Most bytes of rows kept; 0: an eighth of the memory stowd may use
    /// (the machine's, or its cgroup's limit if lower).
    pub max_bytes: u64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            enabled: true,
            max_bytes: 0,
        }
    }
}

impl CacheConfig {
    /// The bound in bytes, `max_bytes` or its default.
    pub fn bound(&self) -> u64 {
        match self.max_bytes {
            0 => crate::sys::memory_limit().0.map_or(1 << 30, |m| m / 8),
            n => n,
        }
    }
}

/// Deduplicated puts (`stowage_host::manager::dedup`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DedupConfig {
    /// Field-name patterns (as `[[chain]] fields`: `*` matches any run of
    /// characters) whose byte-identical rows within one put are stored
    /// once. Each put of such a field is hashed once (XXH3). Empty: none.
    pub fields: Vec<String>,
}

/// A configuration file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}:{line}:{column}: {message}")]
    Parse {
        path: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{path}: {problem}")]
    Invalid { path: String, problem: Invalid },
}

/// A configuration that parses but cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Invalid {
    #[error("no units: set units.local > 0 or router.units")]
    NoUnits,
    #[error("{0}")]
    Spill(String),
    #[error("{0}")]
    Checkpoint(String),
    #[error("{0}")]
    Security(String),
    #[error("router.units: bad local unit {0:?} (local:<i>, i a number)")]
    BadLocalUnit(String),
    #[error("router.units: {unit} but units.local is {local} (local units are local:0 to local:{})", local.saturating_sub(1))]
    NoSuchLocalUnit { unit: String, local: u32 },
    #[error(
        "router.units: {0:?} is neither local:<i>, tcp://host:port nor stowage://host:port/<unit>"
    )]
    BadUnit(String),
    #[error("{key} is {value}, it must be at least {min}")]
    TooSmall {
        key: String,
        value: u64,
        min: &'static str,
    },
    #[error("{key} is {value}, it must be at most {max}")]
    TooLarge {
        key: String,
        value: u64,
        max: &'static str,
    },
    #[error("chain {pattern:?}: backoff_max_ms ({max}) is below backoff_ms ({initial})")]
    Backoff {
        pattern: String,
        initial: u64,
        max: u64,
    },
}

impl Config {
    /// Reads and checks a TOML file; errors name the line and the reason.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        Config::parse(&text, &shown)
    }

    /// Parses TOML text (`origin` names it in errors).
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| {
            let (line, column) = e
                .span()
                .map(|s| {
                    let before = &text[..s.start.min(text.len())];
                    let line = before.matches('\n').count() + 1;
                    let column = before
                        .rsplit('\n')
                        .next()
                        .map(|l| l.chars().count() + 1)
                        .unwrap_or(1);
                    (line, column)
                })
                .unwrap_or((0, 0));
            ConfigError::Parse {
                path: origin.into(),
                line,
                column,
                message: e.message().to_string(),
            }
        })?;
        config.check().map_err(|problem| ConfigError::Invalid {
            path: origin.into(),
            problem,
        })?;
        Ok(config)
    }

    fn check(&self) -> Result<(), Invalid> {
        let at_least_one = |key: &str, value: u64| match value {
            0 => Err(Invalid::TooSmall {
                key: key.into(),
                value,
                min: "1",
            }),
            _ => Ok(()),
        };
        if self.units.local == 0 && self.router.units.is_empty() {
            return Err(Invalid::NoUnits);
        }
        if self.units.memory_percent > 100 {
            return Err(Invalid::TooLarge {
                key: "units.memory_percent".into(),
                value: u64::from(self.units.memory_percent),
                max: "100",
            });
        }
        self.units.spill().map_err(Invalid::Spill)?;
        self.security.validate().map_err(Invalid::Security)?;
        for r in &self.checkpoint.roots {
            if !r.is_absolute() {
                return Err(Invalid::Checkpoint(format!(
                    "[checkpoint] roots: {} is not an absolute path",
                    r.display()
                )));
            }
        }
        at_least_one(
            "checkpoint.max_journals",
            self.checkpoint.max_journals.into(),
        )?;
        for u in &self.router.units {
            match u.strip_prefix("local:") {
                Some(i) => {
                    let i: u32 = i.parse().map_err(|_| Invalid::BadLocalUnit(u.clone()))?;
                    if i >= self.units.local {
                        return Err(Invalid::NoSuchLocalUnit {
                            unit: u.clone(),
                            local: self.units.local,
                        });
                    }
                }
                None if u.starts_with("tcp://") => {}
                None if parse_peer_unit(u).is_some() => {}
                None => return Err(Invalid::BadUnit(u.clone())),
            }
        }
        let l = &self.limits;
        let at_least = |key: &str, value: u64, min: u64, shown: &'static str| match value < min {
            true => Err(Invalid::TooSmall {
                key: key.into(),
                value,
                min: shown,
            }),
            false => Ok(()),
        };
        at_least("limits.max_frames", l.max_frames.into(), 2, "2")?;
        at_least(
            "limits.max_message_bytes",
            l.max_message_bytes,
            4096,
            "4096",
        )?;
        at_least(
            "limits.max_request_bytes",
            l.max_request_bytes,
            4096,
            "4096",
        )?;
        at_least("limits.max_request_frames", l.max_request_frames, 2, "2")?;
        at_least("limits.max_connections", l.max_connections.into(), 1, "1")?;
        at_least("limits.write_timeout_secs", l.write_timeout_secs, 1, "1")?;
        at_least(
            "shm.max_connection_leases",
            self.shm.max_connection_leases,
            1,
            "1",
        )?;
        const MIB: u64 = 1 << 20;
        let memory = self.plugins.memory_bytes as u64;
        at_least("plugins.memory_bytes", memory, MIB, "1 MiB")?;
        for (name, o) in &self.plugins.overrides {
            if let Some(m) = o.memory_bytes {
                let key = format!("plugins.overrides.{name}.memory_bytes");
                at_least(&key, m as u64, MIB, "1 MiB")?;
            }
        }
        for c in &self.chains {
            if c.backoff_ms > 0 && c.backoff_max_ms < c.backoff_ms {
                return Err(Invalid::Backoff {
                    pattern: c.pattern.clone(),
                    initial: c.backoff_ms,
                    max: c.backoff_max_ms,
                });
            }
        }
        Ok(())
    }
}

/// Splits `stowage://host:port/<unit>` into the peer's native endpoint
/// (`tcp://host:port`) and the unit number; `None` if it is not one.
pub fn parse_peer_unit(s: &str) -> Option<(String, u64)> {
    let rest = s.strip_prefix("stowage://")?;
    let (addr, unit) = rest.rsplit_once('/')?;
    let (host, port) = addr.rsplit_once(':')?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return None;
    }
    let unit = unit.parse::<u64>().ok()?;
    Some((format!("tcp://{addr}"), unit))
}

#[cfg(test)]
mod tests;
