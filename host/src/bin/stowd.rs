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
    },
    /// Print the effective configuration (defaults merged) as TOML.
    Config {
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

fn load(path: Option<&PathBuf>) -> anyhow::Result<Config> {
    Ok(match path {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    })
}

async fn serve(config: Config, endpoints_file: Option<PathBuf>) -> anyhow::Result<()> {
    let running = stowage_host::server::start(config).await?;
    if let Some(path) = &endpoints_file {
        running.endpoints.write(path).with_context(|| format!("writing {}", path.display()))?;
    }
    println!("{}", serde_json::to_string(&running.endpoints)?);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
    }
    running.shutdown_and_wait().await;
    if let Some(path) = &endpoints_file {
        let _ = std::fs::remove_file(path);
    }
    tracing::info!("stopped");
    Ok(())
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve { config, endpoints_file } => load(config.as_ref()).and_then(|c| {
            tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(serve(c, endpoints_file))
        }),
        Command::Config { config } => {
            load(config.as_ref()).and_then(|c| Ok(print!("{}", toml::to_string_pretty(&c)?)))
        }
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
