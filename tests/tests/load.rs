//! Concurrent load with verification against the real `stowd` (issue 6,
//! "a storage sidecar must never lose or mix up a row"): 64 clients doing
//! random put / get / clear of random batches of regular, nested and string
//! fields over both protocols (TransferQueue router endpoint and
//! `stowage/1`) against one `stowd` in router mode over 4 local units, for
//! about 12 seconds (and 16 clients with rows of 1 MB, through the receive
//! pool, for 8). Every row returned is checked against each client's
//! model of its keys (see `stowage_tests::load`); then everything is read
//! back, cleared, and `stowd`'s resident memory must come back to its
//! baseline within the stated tolerance.
//!
//! `STOWLOAD_SECS` overrides the duration (`stowload` is the same run as a
//! program, for longer runs by hand).

use std::time::Duration;

use stowage_tests::Stowd;
use stowage_tests::load::{self, Options, Target};

fn secs(default: f64) -> Duration {
    Duration::from_secs_f64(
        std::env::var("STOWLOAD_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_clients_lose_and_mix_up_nothing() {
    run_and_check(Options {
        clients: 64,
        duration: secs(12.0),
        seed: 6,
        ..Options::default()
    })
    .await;
}

/// Rows of 1 MB: puts of a few rows make frames of more than 1 MiB, which
/// the receive pool keeps and reuses; nothing may come back wrong, and the
/// memory must still go back once the pool's idle time has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_rows_through_the_receive_pool_lose_nothing_and_memory_goes_back() {
    let opts = Options {
        clients: 16,
        keys_per_client: 8,
        blob_bytes: 1_000_000,
        duration: secs(8.0),
        seed: 7,
        ..Options::default()
    };
    run_and_check(opts).await;
}

async fn run_and_check(opts: Options) {
    let mut stowd = Stowd::start(&format!("[units]\nlocal = 4\n\n{}", load::REUSE_CONFIG));
    let target = Target {
        tq: Some(stowd.router().clone()),
        native: Some(stowd.native().to_string()),
        pid: Some(stowd.pid()),
    };
    let report = load::run(&target, &opts).await;
    println!("{}", report.table());
    stowd.assert_running();

    assert_eq!(
        report.mismatch_count,
        0,
        "rows lost, stale, swapped or corrupt ({:?}):\n{}",
        load::classify(&report.mismatches),
        report.table()
    );
    assert_eq!(
        report.error_count,
        0,
        "unexpected errors:\n{}",
        report.table()
    );
    for op in load::OPS {
        assert!(
            report.op(op).count > 0,
            "no {op} in the run:\n{}",
            report.table()
        );
    }
    assert!(
        report.per_proto[0] > 0 && report.per_proto[1] > 0,
        "both protocols are used"
    );
    assert_eq!(
        report.after_clear_stats,
        Some((0, 0, 0)),
        "stats after the final clear (keys, rows, bytes)"
    );
    let m = report.memory.expect("memory readings");
    assert!(m.peak > m.baseline, "the run used memory: {m:?}");
    assert_eq!(
        report.rss_ok(),
        Some(true),
        "stowd's memory did not come back:\n{}",
        report.table()
    );
    stowd.stop();
}
