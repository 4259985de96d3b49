//! `stowd`: the Stowage sidecar. Parses arguments, installs tracing and
//! calls the library; everything else lives in `stowage_host::server`.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use stowage_host::config::Config;

#[derive(Parser)]
#[command(name = "stowd", version, about = "Stowage tensor storage sidecar")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve units, the router endpoint and the native endpoint.
    Serve {
        /// TOML configuration (every key optional; see stowd.example.toml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Write the served endpoints as JSON to this file once listening.
        #[arg(long)]
        endpoints_file: Option<PathBuf>,
        /// Restore the last checkpoint in this directory before serving
        /// (rows written or cleared after it are reported lost).
        #[arg(long, value_name = "DIR")]
        restore: Option<PathBuf>,
    },
    /// Write a checkpoint of every unit of a running stowd to DIR (on the
    /// stowd's machine), and wait for it.
    Checkpoint(CheckpointCmd),
    /// Replace every unit's rows of a running stowd with the last
    /// checkpoint in DIR.
    Restore(CheckpointArgs),
    /// Check the configuration (plugins loaded, chain entries named) and
    /// print it, defaults merged, as TOML.
    Config {
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Check, benchmark or list policy plugins.
    #[command(subcommand)]
    Plugin(PluginCommand),
}

#[derive(clap::Args)]
struct CheckpointArgs {
    /// The running stowd's native endpoint (from its endpoints file).
    #[arg(long)]
    endpoint: String,
    /// Give up waiting after this many seconds.
    #[arg(long, default_value_t = 3600)]
    timeout_secs: u64,
    /// The checkpoint directory (relative: to this process's directory).
    #[arg(value_name = "DIR")]
    dir: PathBuf,
}

#[derive(clap::Args)]
struct CheckpointCmd {
    #[command(flatten)]
    common: CheckpointArgs,
    /// Write a snapshot: no journal is kept, and a restore brings back every
    /// row as written, whatever changed after it (TransferQueue's checkpoint
    /// semantics; docs/protocol-stowage1.md).
    #[arg(long)]
    snapshot: bool,
}

#[derive(Subcommand)]
enum PluginCommand {
    /// Run the conformance suite: the plugin against the built-in on many
    /// layouts and position patterns. Exits non-zero on any failure.
    Check {
        /// The plugin component.
        file: PathBuf,
        /// Print every case, not only failures.
        #[arg(long)]
        verbose: bool,
        /// Fuel per call (the deadline); default: stowd's default.
        #[arg(long)]
        fuel: Option<u64>,
        /// Run every case, even after 16 failed cases in a row (without
        /// it, the check stops there and says how many cases it left).
        #[arg(long)]
        all: bool,
        /// Reuse compiled components from, and save them to, this compile
        /// cache (as `[plugins] cache_dir`; used only if private to this
        /// user). Default: compile without a cache.
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
    /// Decision time per call of the plugin next to the built-in's.
    Bench {
        file: PathBuf,
        /// Rounds over the suite.
        #[arg(long, default_value_t = 20)]
        rounds: u32,
        /// As for `check`.
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
    /// Plugins, versions, chains and fault counts of a running stowd.
    List {
        /// The running stowd's native endpoint (from its endpoints file).
        #[arg(long)]
        endpoint: String,
    },
}

fn load_plugin(
    file: &std::path::Path,
    fuel: Option<u64>,
    cache_dir: Option<PathBuf>,
    memo_entries: Option<usize>,
) -> anyhow::Result<stowage_host::policy::wasm::WasmPolicy> {
    let mut limits = stowage_host::policy::wasm::SandboxLimits::default();
    if let Some(f) = fuel {
        limits.fuel = f;
    }
    if let Some(m) = memo_entries {
        limits.memo_entries = m;
    }
    let registry = stowage_host::policy::registry::Registry::new(cache_dir, limits)?;
    let (policy, _) = registry.load_file(file)?;
    Ok(policy)
}

fn plugin_check(
    file: &std::path::Path,
    verbose: bool,
    fuel: Option<u64>,
    all: bool,
    cache_dir: Option<PathBuf>,
) -> anyhow::Result<bool> {
    use stowage_host::conformance;
    use stowage_host::policy::Policy;
    let policy = load_plugin(file, fuel, cache_dir, None)?;
    let d = policy.describe().clone();
    println!(
        "plugin {} {} ({}): {}",
        d.name,
        d.version,
        file.display(),
        d.summary
    );
    let stop = if all {
        conformance::Stop::Never
    } else {
        conformance::Stop::AfterFailuresInARow(conformance::GIVE_UP_AFTER)
    };
    let report = conformance::run_with(&policy, stop);
    print!("{}", conformance::check_table(&report, verbose));
    Ok(report.failures().is_empty())
}

fn plugin_bench(
    file: &std::path::Path,
    rounds: u32,
    cache_dir: Option<PathBuf>,
) -> anyhow::Result<()> {
    use stowage_host::conformance::{self, Outcome};
    use stowage_host::policy::Policy;
    // Memo off: every decision enters the plugin.
    let policy = load_plugin(file, None, cache_dir.clone(), Some(0))?;
    let d = policy.describe().clone();
    println!(
        "plugin {} {} (stowage:policy@{}{})",
        d.name,
        d.version,
        policy.contract(),
        if d.pure {
            ", pure: memoized in stowd"
        } else {
            ""
        }
    );
    let rounds = rounds.max(1);
    let run = |policy: &stowage_host::policy::wasm::WasmPolicy| -> Vec<conformance::Report> {
        (0..rounds)
            .map(|_| {
                let stop = conformance::Stop::AfterFailuresInARow(conformance::GIVE_UP_AFTER);
                conformance::run_with(policy, stop)
            })
            .collect()
    };
    let runs = run(&policy);
    let first = &runs[0];
    println!(
        "{} calls over {} rounds of the conformance suite ({} cases a round: {} answered, {} declined, {} failed)",
        runs.iter().map(|r| r.cases.len()).sum::<usize>(),
        runs.len(),
        first.cases.len(),
        first.count(&Outcome::Same),
        first.count(&Outcome::Declined),
        first.failures().len(),
    );
    if first.not_run > 0 {
        println!(
            "each round stopped after {} failed cases in a row: {} cases not run",
            conformance::GIVE_UP_AFTER,
            first.not_run
        );
    }
    println!("\nentering the plugin on every call (memo off):");
    print!("{}", conformance::bench_table(&runs));
    if d.pure {
        // As stowd runs it, with a memo that holds the whole suite (more
        // distinct cases than the default `memo_entries`, which would empty
        // itself every round): one round fills it, the rounds timed after
        // it are answered from it where the case can be memoized.
        let memoized = load_plugin(file, None, cache_dir, Some(4096))?;
        let _ = conformance::run_with(&memoized, conformance::Stop::Never);
        println!(
            "\nwith a memo of 4096 entries, filled by one round (selections of regular fields and packings of up to 64 pieces are memoized; {} held):",
            memoized.memo_len()
        );
        print!("{}", conformance::bench_table(&run(&memoized)));
    }
    Ok(())
}

fn plugin_list(endpoint: &str) -> anyhow::Result<()> {
    use stowage_host::wire::native;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let frames = native::encode_request(&native::Request {
        id: 1,
        op: native::Op::Stats,
    })?;
    let peer = stowage_host::auth::with_client_credentials(stowage_host::transport::Peer::new(
        endpoint,
        "stowd-plugin-list",
    ));
    let reply = rt.block_on(peer.request(frames, std::time::Duration::from_secs(10)))?;
    let (_, reply) = native::decode_reply(&reply, &native::Limits::default())?;
    let native::Reply::StatsOk(stats) = reply else {
        anyhow::bail!("unexpected reply {}", reply.name())
    };
    let mut plugins = 0;
    for (key, value) in &stats {
        if let Some(name) = key.strip_prefix("plugin.") {
            println!("{}", plugin_line(name, value));
            plugins += 1;
        } else if let Some(pattern) = key.strip_prefix("chain.") {
            println!("{}", chain_line(pattern, value));
        }
    }
    if plugins == 0 {
        println!("no plugins loaded");
    }
    let missing = stats.iter().find(|(k, _)| k == "missing_chain_entries");
    if let Some(n) = missing.and_then(|(_, v)| v.as_int()).filter(|n| *n > 0) {
        println!("{n} chain entries name no live plugin (see `missing` above)");
    }
    Ok(())
}

/// `stowd checkpoint` / `stowd restore`: one request, its reply printed.
fn checkpoint(args: &CheckpointArgs, restore: bool, journal: bool) -> anyhow::Result<()> {
    use stowage_host::wire::native;
    let dir = std::path::absolute(&args.dir)?
        .to_string_lossy()
        .into_owned();
    let op = if restore {
        native::Op::Restore { dir }
    } else {
        native::Op::Checkpoint { dir, journal }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let frames = native::encode_request(&native::Request { id: 1, op })?;
    let peer = stowage_host::auth::with_client_credentials(stowage_host::transport::Peer::new(
        &args.endpoint,
        "stowd-checkpoint",
    ));
    let timeout = std::time::Duration::from_secs(args.timeout_secs);
    let reply = rt.block_on(peer.request(frames, timeout))?;
    match native::decode_reply(&reply, &native::Limits::default())?.1 {
        native::Reply::CheckpointOk {
            dir,
            seq,
            rows,
            bytes,
            files,
        } => {
            println!("checkpoint {seq} written to {dir}: {rows} rows, {bytes} bytes, {files} files")
        }
        native::Reply::RestoreOk {
            dir,
            seq,
            rows,
            lost,
        } => println!("checkpoint {seq} of {dir} restored: {rows} rows, {lost} indexes lost"),
        native::Reply::Error { code, message } => anyhow::bail!("{code}: {message}"),
        other => anyhow::bail!("unexpected reply {}", other.name()),
    }
    Ok(())
}

/// `name: version V (select, pack) calls N plans N faults N ...` from a
/// plugin's stats map.
fn plugin_line(name: &str, v: &stowage_host::wire::native::Stat) -> String {
    let int = |k| v.get(k).and_then(|s| s.as_int()).unwrap_or(0);
    let version = v.get("version").and_then(|s| s.as_str()).unwrap_or("?");
    let caps = v
        .get("capabilities")
        .and_then(|s| s.as_strs())
        .unwrap_or_default();
    let mut line = format!("{name}: version {version} ({})", caps.join(", "));
    for k in [
        "calls",
        "plans",
        "faults",
        "invalid_plans",
        "fallbacks",
        "rejections",
        "reenables",
        "entries",
        "memo_hits",
    ] {
        line.push_str(&format!(" {k} {}", int(k)));
    }
    if v.get("disabled").and_then(|s| s.as_bool()) == Some(true) {
        line.push_str(" DISABLED");
        if let Some(ms) = v.get("reenable_in_ms").and_then(|s| s.as_int()) {
            line.push_str(&format!(" (re-enabled in {ms} ms)"));
        }
    }
    line
}

/// `chain P: select [..] pack [..] fail F max_faults N backoff ..` from a
/// chain's stats map, with its missing entries.
fn chain_line(pattern: &str, v: &stowage_host::wire::native::Stat) -> String {
    let list = |k| {
        v.get(k)
            .and_then(|s| s.as_strs())
            .unwrap_or_default()
            .join(", ")
    };
    let int = |k| v.get(k).and_then(|s| s.as_int()).unwrap_or(0);
    let fail = v.get("fail").and_then(|s| s.as_str()).unwrap_or("?");
    let backoff = match int("backoff_ms") {
        0 => "none".to_string(),
        ms => format!("{ms}..{} ms", int("backoff_max_ms")),
    };
    let mut line = format!(
        "chain {pattern}: select [{}] pack [{}] fail {fail} max_faults {} backoff {backoff}",
        list("select"),
        list("pack"),
        int("max_faults"),
    );
    for (key, shown) in [("missing_select", "select"), ("missing_pack", "pack")] {
        let names = list(key);
        if !names.is_empty() {
            line.push_str(&format!("; missing {shown} [{names}]"));
        }
    }
    line
}

fn load(path: Option<&PathBuf>) -> anyhow::Result<Config> {
    Ok(match path {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    })
}

async fn serve(config: Config, endpoints_file: Option<PathBuf>) -> anyhow::Result<()> {
    // Before the endpoints file says stowd is up: a SIGTERM sent as soon as
    // it appears must shut it down cleanly, not kill it.
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int) = (
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    );
    let node = stowage_host::node::Node::build(&config).await?;
    let listeners = stowage_host::server::Listeners::bind(&config, &node).await?;
    let endpoints = listeners.endpoints(&node);
    if let Some(path) = &endpoints_file {
        endpoints
            .write(path)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    // Standard output often ends in a log: the token stays in the files.
    let shown = stowage_host::server::Endpoints {
        token: None,
        ..endpoints.clone()
    };
    println!("{}", serde_json::to_string(&shown)?);
    let (shutdown, stop) = tokio::sync::watch::channel(false);
    let served = tokio::spawn(stowage_host::server::run(listeners, node, stop));
    tokio::select! {
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
    }
    let _ = shutdown.send(true);
    let _ = served.await;
    if let Some(path) = &endpoints_file {
        let _ = std::fs::remove_file(path);
    }
    tracing::info!("stopped");
    Ok(())
}

fn main() -> std::process::ExitCode {
    // The only subscriber: the library only makes spans and events. With
    // RUST_LOG=debug every request is a `request` span (one line when it
    // closes, with its id, op, rows and bytes) and its policy decisions are
    // events inside it; at the default `info` those spans are disabled.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve {
            config,
            endpoints_file,
            restore,
        } => load(config.as_ref()).and_then(|mut c| {
            c.restore = restore.map(std::path::absolute).transpose()?;
            // Before any row is stored: no other process of this user may
            // read or change them through /proc/<pid>/mem or ptrace.
            stowage_host::sys::forbid_same_user_access()
                .context("making stowd non-dumpable (prctl PR_SET_DUMPABLE)")?;
            tracing::info!("not dumpable: only root may read or write stowd's memory");
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(serve(c, endpoints_file))
        }),
        Command::Config { config } => load(config.as_ref()).and_then(|c| {
            // Loads the plugins, so that chains naming none are refused here
            // as they would be at start.
            stowage_host::node::build_registry(&c)?;
            print!("{}", toml::to_string_pretty(&c)?);
            Ok(())
        }),
        Command::Plugin(PluginCommand::Check {
            file,
            verbose,
            fuel,
            all,
            cache_dir,
        }) => match plugin_check(&file, verbose, fuel, all, cache_dir) {
            Ok(true) => Ok(()),
            Ok(false) => return std::process::ExitCode::FAILURE,
            Err(e) => Err(e),
        },
        Command::Plugin(PluginCommand::Bench {
            file,
            rounds,
            cache_dir,
        }) => plugin_bench(&file, rounds, cache_dir),
        Command::Plugin(PluginCommand::List { endpoint }) => plugin_list(&endpoint),
        Command::Checkpoint(cmd) => checkpoint(&cmd.common, false, !cmd.snapshot),
        Command::Restore(args) => checkpoint(&args, true, true),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stowd: error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}
