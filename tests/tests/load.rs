//! Concurrent load with verification against the real `stowd` (issue 6,
//! "a storage sidecar must never lose or mix up a row"): 64 clients doing
//! random put / get / clear of random batches of regular, nested and string
//! fields over both protocols (TransferQueue router endpoint and
//! `stowage/1`) against one `stowd` in router mode over 4 local units, for
//! about 12 seconds. Every row returned is checked against each client's
//! model of its keys (see `stowage_tests::load`); then everything is read
//! back, cleared, and `stowd`'s resident memory must come back to its
//! baseline within the stated tolerance.
//!
//! `STOWLOAD_SECS` overrides the duration (`stowload` is the same run as a
//! program, for longer runs by hand).

use std::time::Duration;

use stowage_tests::Stowd;
use stowage_tests::load::{self, Options, Target};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_clients_lose_and_mix_up_nothing() {
    let secs: f64 = std::env::var("STOWLOAD_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(12.0);
    let mut stowd = Stowd::start("[units]\nlocal = 4\n");
    let target = Target {
        tq: Some(stowd.router().clone()),
        native: Some(stowd.native().to_string()),
        pid: Some(stowd.pid()),
    };
    let opts = Options { clients: 64, duration: Duration::from_secs_f64(secs), seed: 6, ..Options::default() };
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
    assert_eq!(report.error_count, 0, "unexpected errors:\n{}", report.table());
    for op in load::OPS {
        assert!(report.op(op).count > 0, "no {op} in the run:\n{}", report.table());
    }
    assert!(report.per_proto[0] > 0 && report.per_proto[1] > 0, "both protocols are used");
    assert_eq!(report.after_clear_stats, Some((0, 0, 0)), "stats after the final clear (keys, rows, bytes)");
    let m = report.memory.expect("memory readings");
    assert!(m.peak > m.baseline, "the run used memory: {m:?}");
    assert_eq!(report.rss_ok(), Some(true), "stowd's memory did not come back:\n{}", report.table());
    stowd.stop();
}
