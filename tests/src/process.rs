//! The real `stowd` binary as a child process.
//!
//! [`Stowd::start`] writes a config (the plugin directory and the shared
//! compile cache first, then the caller's tables, then, unless the caller
//! has a `[checkpoint]` table, checkpoint roots at the system's temporary
//! directory, where the tests' checkpoints are), starts
//! `stowd serve --config C --endpoints-file F` on OS-chosen ports and waits
//! for the endpoints file. [`Stowd::stop`] (or dropping the handle) sends
//! SIGTERM and checks that the process exits with status 0 in time.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use stowage_host::server::{Endpoints, UnitEndpoint};

use crate::{plugin_dir, shared_cache, temp_dir, workspace_root};

/// How long a start may take: the first start of a build compiles every
/// plugin into the shared cache.
pub const START_TIMEOUT: Duration = Duration::from_secs(120);

/// How long `stowd` may take to exit after SIGTERM.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// The `stowd` binary: `$STOWD_BIN`, else `<workspace>/target/debug/stowd`.
/// The default binary must be newer than every file of `host/src`, so that
/// a stale build is not tested by mistake (`cargo test` does not rebuild it).
pub fn stowd_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("STOWD_BIN").map(PathBuf::from) {
        assert!(bin.exists(), "STOWD_BIN={} does not exist", bin.display());
        return bin;
    }
    let bin = workspace_root().join("target").join("debug").join("stowd");
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| {
            panic!(
                "{} does not exist: run cargo build -p stowage-host",
                bin.display()
            )
        });
    let host = workspace_root().join("host");
    if let Some(newer) = newest_file(&host.join("src")).filter(|(t, _)| *t > built) {
        panic!(
            "{} is older than {}: run cargo build -p stowage-host",
            bin.display(),
            newer.1.display()
        );
    }
    bin
}

/// The most recently modified file under `dir`.
fn newest_file(dir: &Path) -> Option<(std::time::SystemTime, PathBuf)> {
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let found = if path.is_dir() {
            newest_file(&path)
        } else {
            entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .map(|t| (t, path))
        };
        if let Some(f) = found
            && newest.as_ref().is_none_or(|n| f.0 > n.0)
        {
            newest = Some(f);
        }
    }
    newest
}

/// A TOML basic string holding `path`.
fn toml_path(path: &Path) -> String {
    serde_json::to_string(&path.display().to_string()).expect("a string serializes")
}

/// A running `stowd` child process.
pub struct Stowd {
    child: Option<Child>,
    /// What the endpoints file said.
    pub endpoints: Endpoints,
    dir: PathBuf,
    endpoints_file: PathBuf,
    log_file: PathBuf,
}

impl std::fmt::Debug for Stowd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stowd")
            .field("endpoints", &self.endpoints)
            .field("dir", &self.dir)
            .finish()
    }
}

impl Stowd {
    /// Starts `stowd` with `config` appended after a `[plugins]` table that
    /// points at the built plugins and the shared compile cache (so `config`
    /// must not have a `[plugins]` table of its own). Panics, with the
    /// process log, if the endpoints file does not appear within
    /// [`START_TIMEOUT`] or the process exits first.
    pub fn start(config: &str) -> Stowd {
        Stowd::start_with_plugins(&plugin_dir(), config)
    }

    /// Like [`Stowd::start`], loading the plugins of `plugins` instead.
    pub fn start_with_plugins(plugins: &Path, config: &str) -> Stowd {
        Stowd::start_wrapped(&[], plugins, &shared_cache(), config, None)
    }

    /// Like [`Stowd::start_with_plugins`], with the compile cache in `cache`.
    pub fn start_with_cache(plugins: &Path, cache: &Path, config: &str) -> Stowd {
        Stowd::start_wrapped(&[], plugins, cache, config, None)
    }

    /// Like [`Stowd::start`], with `RUST_LOG` set to `filter` (instead of
    /// `$STOWD_TEST_LOG` or `info,stowage_host=debug`).
    pub fn start_with_log(filter: &str, config: &str) -> Stowd {
        Stowd::start_wrapped(&[], &plugin_dir(), &shared_cache(), config, Some(filter))
    }

    /// Like [`Stowd::start`], inside network namespace `netns` (`ip netns
    /// exec <netns> stowd ...`, which execs, so the child is `stowd` itself).
    pub fn start_in_netns(netns: &str, config: &str) -> Stowd {
        let wrapper = [
            "ip".to_string(),
            "netns".into(),
            "exec".into(),
            netns.to_string(),
        ];
        Stowd::start_wrapped(&wrapper, &plugin_dir(), &shared_cache(), config, None)
    }

    /// Like [`Stowd::start`]; Err: why it did not start, and its log.
    pub fn try_start(config: &str) -> Result<Stowd, String> {
        Stowd::spawn(&[], &plugin_dir(), &shared_cache(), config, None, &[], None)
    }

    /// Like [`Stowd::start`], as the user and group `uid` (the test must be
    /// root unless `uid` is its own), with no plugins and a compile cache
    /// of its own (the shared ones may not be that user's to read or
    /// write); the directory of its config and endpoints file is given to
    /// that user.
    pub fn start_as(uid: u32, config: &str) -> Stowd {
        let plugins = temp_dir("stowd-as-plugins");
        let cache = temp_dir("stowd-as-cache");
        let state = temp_dir("stowd-as-state");
        for dir in [&plugins, &cache, &state] {
            std::os::unix::fs::chown(dir, Some(uid), Some(uid)).expect("chown (needs root)");
        }
        // Its token where that user can write it (not in the test's home).
        let config = match config.contains("[security]") {
            true => config.to_string(),
            false => format!(
                "{config}\n[security]\ntoken_file = {:?}\n",
                state.join("token").display().to_string()
            ),
        };
        Stowd::spawn(&[], &plugins, &cache, &config, None, &[], Some(uid))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`Stowd::start`], restoring the checkpoint in `dir` at start
    /// (`serve --restore DIR`). Err: why it did not start, and its log.
    pub fn start_restoring(config: &str, dir: &Path) -> Result<Stowd, String> {
        let args = ["--restore".to_string(), dir.display().to_string()];
        Stowd::spawn(
            &[],
            &plugin_dir(),
            &shared_cache(),
            config,
            None,
            &args,
            None,
        )
    }

    /// Starts `wrapper... stowd serve ...` (no wrapper: `stowd` itself).
    fn start_wrapped(
        wrapper: &[String],
        plugins: &Path,
        cache: &Path,
        config: &str,
        log_filter: Option<&str>,
    ) -> Stowd {
        Stowd::spawn(wrapper, plugins, cache, config, log_filter, &[], None)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn spawn(
        wrapper: &[String],
        plugins: &Path,
        cache: &Path,
        config: &str,
        log_filter: Option<&str>,
        extra: &[String],
        user: Option<u32>,
    ) -> Result<Stowd, String> {
        let bin = stowd_bin();
        let dir = temp_dir("stowd");
        if let Some(uid) = user {
            std::os::unix::fs::chown(&dir, Some(uid), Some(uid)).expect("chown (needs root)");
        }
        let config_path = dir.join("stowd.toml");
        let mut text = format!(
            "[plugins]\ndir = {}\ncache_dir = {}\n\n{config}\n",
            toml_path(plugins),
            toml_path(cache)
        );
        if !config.contains("[checkpoint]") {
            // The tests' checkpoints live in their temporary directories.
            text.push_str(&format!(
                "\n[checkpoint]\nroots = [{}]\n",
                toml_path(&std::env::temp_dir())
            ));
        }
        std::fs::write(&config_path, text).expect("write the config");
        let endpoints_file = dir.join("endpoints.json");
        let log_file = dir.join("stowd.log");
        let log = std::fs::File::create(&log_file).expect("create the log file");
        let filter = match log_filter {
            Some(f) => f.to_string(),
            None => {
                std::env::var("STOWD_TEST_LOG").unwrap_or_else(|_| "info,stowage_host=debug".into())
            }
        };
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        if let Some(uid) = user {
            use std::os::unix::process::CommandExt;
            command.uid(uid).gid(uid);
        }
        let mut child = command
            .arg("serve")
            .arg("--config")
            .arg(&config_path)
            .arg("--endpoints-file")
            .arg(&endpoints_file)
            .args(extra)
            .env("RUST_LOG", filter)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        match wait_for_endpoints(&mut child, &endpoints_file) {
            Ok(endpoints) => Ok(Stowd {
                child: Some(child),
                endpoints,
                dir,
                endpoints_file,
                log_file,
            }),
            Err(why) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!(
                    "{why}\n--- stowd log ({}) ---\n{}",
                    log_file.display(),
                    log_tail(&log_file)
                ))
            }
        }
    }

    /// Local unit `i`.
    pub fn unit(&self, i: usize) -> &UnitEndpoint {
        &self.endpoints.units[i]
    }

    /// The router-mode endpoint (panics if the router is disabled).
    pub fn router(&self) -> &UnitEndpoint {
        self.endpoints
            .router
            .as_ref()
            .expect("the router endpoint is enabled")
    }

    /// The native `stowage/1` endpoint.
    pub fn native(&self) -> &str {
        &self.endpoints.native
    }

    /// Where `stowd` wrote its endpoints.
    pub fn endpoints_file(&self) -> &Path {
        &self.endpoints_file
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.endpoints.pid
    }

    /// The last lines of the process log (stderr).
    pub fn log(&self) -> String {
        log_tail(&self.log_file)
    }

    /// The whole process log (stderr) so far.
    pub fn full_log(&self) -> String {
        std::fs::read_to_string(&self.log_file).unwrap_or_default()
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Panics, with the log, if the process has exited.
    pub fn assert_running(&mut self) {
        if !self.is_running() {
            let status = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            panic!(
                "stowd is not running (exit status {status:?})\n--- stowd log ---\n{}",
                self.log()
            );
        }
    }

    /// Kills the process with SIGKILL (a crash: no clean shutdown) and
    /// reaps it. The handle stays, with the log, for [`Stowd::log`].
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends SIGTERM and waits for the exit; panics unless the process
    /// exits with status 0 within [`STOP_TIMEOUT`]. Returns the time it took.
    pub fn stop(mut self) -> Duration {
        match self.terminate() {
            Ok((status, took)) if status.success() => took,
            Ok((status, _)) => panic!(
                "stowd exited with {status} after SIGTERM\n--- stowd log ---\n{}",
                self.log()
            ),
            Err(why) => panic!("{why}\n--- stowd log ---\n{}", self.log()),
        }
    }

    fn terminate(&mut self) -> Result<(ExitStatus, Duration), String> {
        let Some(child) = self.child.as_mut() else {
            return Err("stowd was already stopped".into());
        };
        if let Ok(Some(status)) = child.try_wait() {
            self.child = None;
            return Err(format!("stowd had exited on its own, with {status}"));
        }
        let start = Instant::now();
        let sent = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        if !matches!(sent, Ok(s) if s.success()) {
            let _ = child.kill();
            let _ = child.wait();
            self.child = None;
            return Err(format!("could not send SIGTERM: {sent:?}"));
        }
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    self.child = None;
                    return Ok((status, start.elapsed()));
                }
                Ok(None) if start.elapsed() > STOP_TIMEOUT => {
                    let _ = child.kill();
                    let _ = child.wait();
                    self.child = None;
                    return Err(format!(
                        "stowd did not exit within {STOP_TIMEOUT:?} of SIGTERM (killed)"
                    ));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => return Err(format!("waiting for stowd: {e}")),
            }
        }
    }
}

impl Drop for Stowd {
    /// Stops a process still running and checks the clean shutdown (unless
    /// the test is already failing). The temporary directory is removed
    /// after a clean run and kept, for its log, otherwise.
    fn drop(&mut self) {
        let outcome = if self.child.is_some() {
            Some(self.terminate())
        } else {
            None
        };
        let clean = match &outcome {
            None => true,
            Some(Ok((status, _))) => status.success(),
            Some(Err(_)) => false,
        };
        if clean {
            let _ = std::fs::remove_dir_all(&self.dir);
            return;
        }
        let why = match outcome {
            Some(Ok((status, _))) => format!("stowd exited with {status} after SIGTERM"),
            Some(Err(why)) => why,
            None => unreachable!(),
        };
        if std::thread::panicking() {
            eprintln!("{why} (log kept in {})", self.log_file.display());
        } else {
            panic!("{why}\n--- stowd log ---\n{}", self.log());
        }
    }
}

/// Polls for the endpoints file (written atomically by `stowd`).
fn wait_for_endpoints(child: &mut Child, file: &Path) -> Result<Endpoints, String> {
    let start = Instant::now();
    loop {
        if let Ok(text) = std::fs::read(file) {
            let endpoints: Endpoints = serde_json::from_slice(&text)
                .map_err(|e| format!("{} is not an endpoints file: {e}", file.display()))?;
            if endpoints.pid != child.id() {
                return Err(format!(
                    "endpoints file names pid {}, the child is {}",
                    endpoints.pid,
                    child.id()
                ));
            }
            return Ok(endpoints);
        }
        match child.try_wait() {
            Ok(Some(status)) => {
                return Err(format!(
                    "stowd exited with {status} before writing its endpoints"
                ));
            }
            Ok(None) => {}
            Err(e) => return Err(format!("waiting for stowd: {e}")),
        }
        if start.elapsed() > START_TIMEOUT {
            return Err(format!(
                "no endpoints file {} after {START_TIMEOUT:?}",
                file.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(80)..].join("\n")
}
