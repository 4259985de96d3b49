//! `stowload`: concurrent put / get / clear with verification against one
//! `stowd` (see `stowage_tests::load`).
//!
//! ```text
//! stowload [--clients 64] [--secs 10] [--keys 256] [--max-batch 48]
//!          [--blob-bytes 4096] [--protocols both|tq|native] [--seed 1]
//!          [--units 4] [--endpoints-file F] [--timeout-secs 30]
//! ```
//!
//! Without `--endpoints-file` it starts `target/debug/stowd` (or
//! `$STOWD_BIN`) in router mode over `--units` local units and stops it at
//! the end; with it, it loads the `stowd` that wrote that file (its router
//! and native endpoints, its pid for memory readings). Prints a table; exits
//! 1 if a row was lost, stale, swapped or corrupt, if a request failed
//! unexpectedly, or if `stowd`'s memory did not come back after the final
//! clear.

use std::time::Duration;

use stowage_host::server::Endpoints;
use stowage_tests::Stowd;
use stowage_tests::load::{self, Options, Protocols, Target};

fn usage(why: &str) -> ! {
    eprintln!("stowload: {why}");
    eprintln!(
        "usage: stowload [--clients N] [--secs S] [--keys K] [--max-batch B] [--blob-bytes N] \
         [--protocols both|tq|native] [--seed N] [--units N] [--endpoints-file F] [--timeout-secs S]"
    );
    std::process::exit(2)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let mut opts = Options::default();
    let mut units = 4u32;
    let mut endpoints_file = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            usage("help");
        }
        let value = args
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        let num = |v: &str| {
            v.parse::<u64>()
                .unwrap_or_else(|_| usage(&format!("{flag}: not a number: {v}")))
        };
        match flag.as_str() {
            "--clients" => opts.clients = num(&value) as usize,
            "--secs" => {
                opts.duration =
                    Duration::from_secs_f64(value.parse().unwrap_or_else(|_| usage("--secs")))
            }
            "--keys" => opts.keys_per_client = num(&value),
            "--max-batch" => opts.max_batch = num(&value) as usize,
            "--blob-bytes" => opts.blob_bytes = num(&value) as usize,
            "--seed" => opts.seed = num(&value),
            "--units" => units = num(&value) as u32,
            "--timeout-secs" => opts.timeout = Duration::from_secs(num(&value)),
            "--endpoints-file" => endpoints_file = Some(value),
            "--protocols" => {
                opts.protocols = match value.as_str() {
                    "both" => Protocols::Both,
                    "tq" => Protocols::Tq,
                    "native" => Protocols::Native,
                    _ => usage("--protocols is both, tq or native"),
                }
            }
            _ => usage(&format!("unknown flag {flag}")),
        }
    }
    if opts.clients == 0 || opts.keys_per_client == 0 || opts.max_batch == 0 || opts.blob_bytes < 16
    {
        usage("--clients, --keys and --max-batch must be > 0, --blob-bytes >= 16");
    }

    let (stowd, endpoints) = match &endpoints_file {
        Some(f) => {
            let text = std::fs::read(f).unwrap_or_else(|e| usage(&format!("cannot read {f}: {e}")));
            let e: Endpoints =
                serde_json::from_slice(&text).unwrap_or_else(|e| usage(&format!("{f}: {e}")));
            if e.token.is_some() && opts.protocols != Protocols::Tq {
                usage(&format!(
                    "{f}: that stowd's native endpoint takes a token ([security] auth = \"token\"), \
                     and stowload's clients speak ZMTP NULL only: run it with auth = \"none\", \
                     or --protocols tq"
                ));
            }
            (None, e)
        }
        None => {
            let s = Stowd::start(&format!(
                "[units]\nlocal = {units}\n\n{}",
                load::REUSE_CONFIG
            ));
            let e = s.endpoints.clone();
            (Some(s), e)
        }
    };
    let target = Target {
        tq: if opts.protocols == Protocols::Native {
            None
        } else {
            endpoints.router.clone()
        },
        native: if opts.protocols == Protocols::Tq {
            None
        } else {
            Some(endpoints.native.clone())
        },
        pid: Some(endpoints.pid),
    };
    if target.tq.is_none() && opts.protocols == Protocols::Tq {
        usage("this stowd has no router endpoint");
    }
    // Units of a remote unit host count indexes, not values, in a clear.
    opts.exact_clear_counts = endpoints_file.is_none();
    // Nor clear single fields.
    opts.field_clears =
        endpoints_file.is_none() || std::env::var_os("STOWLOAD_NO_FIELD_CLEARS").is_none();
    eprintln!(
        "stowload: {} clients for {:?} against stowd pid {} (router {}, native {})",
        opts.clients,
        opts.duration,
        endpoints.pid,
        endpoints
            .router
            .as_ref()
            .map(|r| r.endpoint.as_str())
            .unwrap_or("-"),
        endpoints.native
    );
    let report = load::run(&target, &opts).await;
    print!("{}", report.table());
    let classes = load::classify(&report.mismatches);
    if !classes.is_empty() {
        println!("mismatch kinds (first findings): {classes:?}");
    }
    if let Some(s) = stowd {
        s.stop();
    }
    let ok =
        report.mismatch_count == 0 && report.error_count == 0 && report.rss_ok() != Some(false);
    std::process::exit(if ok { 0 } else { 1 });
}
