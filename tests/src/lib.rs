//! Shared helpers for Stowage's integration tests.
//!
//! The tests use real `.wasm` components built from `plugins/` (and the
//! hostile ones from `tests/hostile/`) by `cargo xtask plugins --hostile`,
//! found in `$STOWAGE_PLUGIN_DIR` or `<workspace>/target/plugins`.
//!
//! | module | what |
//! |---|---|
//! | [`process`] | the real `stowd` binary as a child process ([`Stowd`]) |
//! | [`client`] | TransferQueue and `stowage/1` clients over real ZeroMQ sockets |
//! | [`data`] | deterministic test batches and their expected rows |
//! | [`load`] | concurrent load with a model of every key: mismatches, rates, latencies, memory |
//! | [`prom`] | a strict Prometheus text-format parser and an HTTP scrape |
//! | [`netns`] | network namespaces standing in for other hosts, joined by veth pairs |

use std::path::PathBuf;

pub mod client;
pub mod data;
pub mod load;
pub mod netns;
pub mod process;
pub mod prom;

pub use client::{NativeClient, NativePipeline, TqClient};
pub use process::Stowd;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Directory of the built seed plugins; panics with the command to run if
/// they are not built.
pub fn plugin_dir() -> PathBuf {
    let dir = std::env::var_os("STOWAGE_PLUGIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target").join("plugins"));
    assert!(
        dir.join("gather.wasm").exists(),
        "plugins are not built in {}: run `cargo xtask plugins --hostile` (or the README's test command)",
        dir.display()
    );
    dir
}

/// Path of one seed plugin.
pub fn plugin(name: &str) -> PathBuf {
    plugin_dir().join(format!("{name}.wasm"))
}

/// Path of a plugin built against `stowage:policy@0.1.0` before the SDK
/// moved to 0.2.0, kept as a fixture (`tests/fixtures/policy-0.1.0`:
/// `runs` and `single-row`).
pub fn plugin_v0_1(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/policy-0.1.0")
        .join(format!("{name}.wasm"))
}

/// Path of one hostile test plugin.
pub fn hostile(name: &str) -> PathBuf {
    let path = plugin_dir().join("hostile").join(format!("{name}.wasm"));
    assert!(
        path.exists(),
        "{} is not built: run `cargo xtask plugins --hostile`",
        path.display()
    );
    path
}

/// A free TCP port on 127.0.0.1 (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh, empty temporary directory (removed by the caller or left in
/// the system temp dir).
pub fn temp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("stowage-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// A compile cache shared by the tests of this workspace, so each plugin is
/// compiled once per build rather than once per test. Mode 0700, as stowd
/// makes its own: stowd refuses a cache another user could write, and one
/// readable by others when a sticky directory such as /tmp is above it.
pub fn shared_cache() -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = workspace_root().join("target").join("test-cwasm-cache");
    std::fs::create_dir_all(&dir).expect("create cache dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
        .expect("chmod 700 the cache dir");
    dir
}
