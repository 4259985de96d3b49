//! Operating `stowd`: hot reload, fail strategies, metrics. The real binary
//! (port 0 sockets, a temporary plugin directory it watches), real `.wasm`
//! components, real ZeroMQ and HTTP sockets.
//!
//! Sections:
//! 1. hot reload: a plugin file swapped 100 times under continuous puts and
//!    gets; broken plugins dropped into the directory never go live;
//! 2. fail strategies: fallback, reject, re-enable after a backoff that
//!    doubles up to its cap, disabled until reload, per-plugin fuel;
//! 3. `/metrics`: strict Prometheus text, zero-copy and copied byte
//!    counters against known puts, request counts and latency histograms,
//!    the same figures in TransferQueue's `GET_METRICS` (opt-in key).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use stowage_host::batch::Field;
use stowage_host::tensor::Dtype;
use stowage_host::wire::native;
use stowage_host::wire::tq;
use stowage_tests::client::{native_error, stat};
use stowage_tests::data::{assert_cells, cells, f32_rows, tensor, wire_cells};
use stowage_tests::{NativeClient, Stowd, TqClient, hostile, plugin, prom, temp_dir};

// ---------------------------------------------------------------------------
// Shared helpers

/// Copies `src` into `dir` as `name` the way an operator should: a hidden
/// temporary file, then a rename (atomic: the watcher never sees half a file).
fn install(src: &Path, dir: &Path, name: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::copy(src, &tmp).unwrap_or_else(|e| panic!("copy {}: {e}", src.display()));
    std::fs::rename(&tmp, dir.join(name)).expect("rename into the plugin directory");
}

/// A plugin directory holding copies of the named seed plugins.
fn plugin_dir_with(seed: &[&str]) -> PathBuf {
    let dir = temp_dir("watched-plugins");
    for name in seed {
        std::fs::copy(plugin(name), dir.join(format!("{name}.wasm"))).unwrap();
    }
    dir
}

/// The `plugin.<name>` map of native `stats`, if that plugin is live.
fn plugin_line(stats: &[(String, native::Stat)], name: &str) -> Option<native::Stat> {
    stats
        .iter()
        .find(|(k, _)| *k == format!("plugin.{name}"))
        .map(|(_, v)| v.clone())
}

/// A count of a plugin's stats map (`faults`, `calls`, ...).
fn field_of(plugin: &native::Stat, key: &str) -> u64 {
    match plugin.get(key) {
        Some(native::Stat::Int(v)) if *v >= 0 => *v as u64,
        other => panic!("{key} is {other:?} in {plugin:?}"),
    }
}

/// A flag of a plugin's stats map (`disabled`).
fn flag_of(plugin: &native::Stat, key: &str) -> bool {
    plugin
        .get(key)
        .and_then(native::Stat::as_bool)
        .unwrap_or_else(|| panic!("no bool {key} in {plugin:?}"))
}

/// Polls native stats until `done` holds (panics after `limit`).
async fn wait_for(
    client: &NativeClient,
    what: &str,
    limit: Duration,
    done: impl Fn(&[(String, native::Stat)]) -> bool,
) -> Vec<(String, native::Stat)> {
    let start = Instant::now();
    loop {
        let stats = client.stats().await;
        if done(&stats) {
            return stats;
        }
        assert!(
            start.elapsed() < limit,
            "{what}: not within {limit:?}; stats: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

// ---------------------------------------------------------------------------
// 1. Hot reload

/// One client's loop: overwrite its own rows with a fresh seed, read them
/// back in another order, compare every byte; count requests.
async fn churn(
    endpoint: String,
    base: u64,
    stop: Arc<AtomicBool>,
    requests: Arc<AtomicU64>,
) -> u64 {
    let client = NativeClient::new(&endpoint);
    let n = 64u64;
    let indexes: Vec<u64> = (base..base + n).collect();
    let order: Vec<u64> = indexes
        .iter()
        .rev()
        .step_by(3)
        .copied()
        .chain(indexes.iter().step_by(5).copied())
        .collect();
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let x = Field::Regular(f32_rows(n, 8, base * 1000 + round));
        let ids = stowage_tests::data::nested(
            Dtype::Int64,
            &(0..n).map(|i| (i + round) % 4).collect::<Vec<_>>(),
            round,
        );
        // Strided positions per unit, runs, a single row: every plugin kind is asked.
        let fields = vec![
            ("x".to_string(), x.clone()),
            ("ids".to_string(), ids.clone()),
        ];
        match client.put(&indexes, &fields).await {
            native::Reply::PutOk { rows } => assert_eq!(rows, n),
            other => panic!("client {base}: put {round} failed: {other:?}"),
        }
        let got = client.get_ok(&order, &["x", "ids"]).await;
        let want_x = stowage_tests::data::expected(&x, &indexes, &order);
        let want_ids = stowage_tests::data::expected(&ids, &indexes, &order);
        let mut got = got.into_iter();
        assert_cells(
            &format!("client {base} round {round} x"),
            &wire_cells(got.next().unwrap().1),
            &want_x,
        );
        assert_cells(
            &format!("client {base} round {round} ids"),
            &wire_cells(got.next().unwrap().1),
            &want_ids,
        );
        let one = client.get_ok(&[base + round % n], &["x"]).await;
        assert_cells(
            "single row",
            &wire_cells(one.into_iter().next().unwrap().1),
            &[cells(&x)[(round % n) as usize].clone()],
        );
        requests.fetch_add(3, Ordering::Relaxed);
        round += 1;
    }
    round
}

/// The same through the TransferQueue router endpoint.
async fn churn_tq(
    router: stowage_host::server::UnitEndpoint,
    base: u64,
    stop: Arc<AtomicBool>,
    requests: Arc<AtomicU64>,
) -> u64 {
    let client = TqClient::new(&router);
    let n = 32u64;
    let indexes: Vec<u64> = (base..base + n).collect();
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let x = Field::Regular(f32_rows(n, 4, base * 1000 + round));
        client.put_ok(&indexes, vec![("x".into(), x.clone())]).await;
        let order: Vec<u64> = indexes.iter().rev().copied().collect();
        let got = client.get_ok(&order, &["x"]).await;
        assert_cells(
            &format!("tq {base} round {round}"),
            &got[0].1,
            &stowage_tests::data::expected(&x, &indexes, &order),
        );
        requests.fetch_add(2, Ordering::Relaxed);
        round += 1;
    }
    round
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plugin_swapped_100_times_under_load_loses_no_request() {
    // `swap.wasm` alternates between the `runs` and `constant-stride`
    // components; the chain asks both names, so whichever is live answers
    // (and allows the other to be missing).
    let dir = plugin_dir_with(&["single-row", "gather", "nested-rows", "coalesce"]);
    install(&plugin("runs"), &dir, "swap.wasm");
    let config = "[[chain]]\npattern = \"*\"\nselect = [\"single-row\", \"constant-stride\", \"runs\", \"gather\", \"nested-rows\"]\n\
                  pack = [\"coalesce\"]\nfail = \"reject\"\nmax_faults = 0\nallow_missing = true\n";
    let mut stowd = Stowd::start_with_plugins(&dir, config);
    let admin = NativeClient::new(stowd.native());
    assert!(plugin_line(&admin.stats().await, "runs").is_some());

    let stop = Arc::new(AtomicBool::new(false));
    let requests = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for c in 0..3u64 {
        clients.push(tokio::spawn(churn(
            stowd.native().to_string(),
            c * 1000,
            stop.clone(),
            requests.clone(),
        )));
    }
    clients.push(tokio::spawn(churn_tq(
        stowd.router().clone(),
        5000,
        stop.clone(),
        requests.clone(),
    )));

    let started = Instant::now();
    let mut latencies = Vec::with_capacity(100);
    for i in 0..100u64 {
        let (src, live) = if i % 2 == 0 {
            ("constant-stride", "constant-stride")
        } else {
            ("runs", "runs")
        };
        let swaps_before = stat(&admin.stats().await, "plugin_swaps");
        let t = Instant::now();
        install(&plugin(src), &dir, "swap.wasm");
        let stats = wait_for(
            &admin,
            &format!("swap {i} to {src}"),
            Duration::from_secs(30),
            |s| stat(s, "plugin_swaps") > swaps_before,
        )
        .await;
        latencies.push(t.elapsed());
        assert!(
            plugin_line(&stats, live).is_some(),
            "swap {i}: {live} is not live: {stats:?}"
        );
        let other = if live == "runs" {
            "constant-stride"
        } else {
            "runs"
        };
        assert!(
            plugin_line(&stats, other).is_none(),
            "swap {i}: {other} is still live"
        );
        // Let the clients run on this version for a moment.
        tokio::time::sleep(Duration::from_millis(20)).await;
        stowd.assert_running();
    }
    let swapping = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut rounds = 0;
    for c in clients {
        rounds += c.await.expect("a client failed (see its panic above)");
    }
    let stats = admin.stats().await;
    assert_eq!(
        stat(&stats, "plugin_swaps"),
        100,
        "exactly one swap per copy"
    );
    assert_eq!(stat(&stats, "plugin_refusals"), 0);
    assert_eq!(stat(&stats, "fallbacks"), 0, "no fault while swapping");
    latencies.sort();
    let total = requests.load(Ordering::Relaxed);
    eprintln!(
        "100 swaps in {swapping:.1?} under {total} requests ({rounds} client rounds), 0 failed; \
         reload latency (copy -> live) p50 {:.1?} p90 {:.1?} max {:.1?}",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.9),
        percentile(&latencies, 1.0)
    );
    assert!(total >= 200, "the clients made only {total} requests");
    stowd.assert_running();
    stowd.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_plugins_dropped_into_the_directory_never_go_live() {
    let dir = plugin_dir_with(&["gather", "coalesce"]);
    // The chain names the hostile plugins first: if one went live, it would
    // be asked (and a reject chain would fail the request). They are not
    // loaded at start: the chain allows missing entries.
    let config = "[[chain]]\npattern = \"*\"\nselect = [\"trap\", \"infinite-loop\", \"drop-row\", \"oob-view\", \"runs\", \"gather\"]\n\
                  pack = [\"coalesce\"]\nfail = \"reject\"\nmax_faults = 0\nallow_missing = true\n";
    let stowd = Stowd::start_with_plugins(&dir, config);
    let client = NativeClient::new(stowd.native());
    let before = client.stats().await;

    for name in ["trap", "infinite-loop", "drop-row", "oob-view"] {
        install(&hostile(name), &dir, &format!("{name}.wasm"));
    }
    // A truncated component, a text file, and a hostile plugin over the live
    // `gather.wasm` (whose gather 0.1.0 must stay).
    let runs = std::fs::read(plugin("runs")).unwrap();
    std::fs::write(dir.join(".t"), &runs[..runs.len() / 2]).unwrap();
    std::fs::rename(dir.join(".t"), dir.join("runs.wasm")).unwrap();
    std::fs::write(dir.join(".t"), b"not a component").unwrap();
    std::fs::rename(dir.join(".t"), dir.join("junk.wasm")).unwrap();
    install(&hostile("dup-row"), &dir, "gather.wasm");

    let stats = wait_for(&client, "seven refusals", Duration::from_secs(60), |s| {
        stat(s, "plugin_refusals") >= 7
    })
    .await;
    assert_eq!(
        stat(&stats, "plugin_swaps"),
        stat(&before, "plugin_swaps"),
        "nothing was swapped in"
    );
    let live: Vec<&str> = stats
        .iter()
        .filter_map(|(k, _)| k.strip_prefix("plugin."))
        .collect();
    assert_eq!(live, vec!["coalesce", "gather"], "live plugins: {stats:?}");

    // `stowd plugin list` says the same.
    let out = Command::new(stowage_tests::process::stowd_bin())
        .args(["plugin", "list", "--endpoint", stowd.native()])
        .output()
        .expect("run stowd plugin list");
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{listing}");
    assert!(listing.contains("gather: version 0.1.0"), "{listing}");
    for name in [
        "trap",
        "infinite-loop",
        "drop-row",
        "oob-view",
        "dup-row",
        "runs",
    ] {
        assert!(
            !listing.lines().any(|l| l.starts_with(&format!("{name}:"))),
            "{name} is listed:\n{listing}"
        );
    }

    // Requests are answered by the old gather, correctly.
    let indexes: Vec<u64> = vec![9, 2, 7, 4, 5, 0];
    let x = Field::Regular(tensor(Dtype::Float32, &[6, 16], 3));
    client.put_ok(&indexes, &[("x".into(), x.clone())]).await;
    let got = client.get_ok(&[0, 9, 5], &["x"]).await;
    assert_cells(
        "rows",
        &wire_cells(got.into_iter().next().unwrap().1),
        &stowage_tests::data::expected(&x, &indexes, &[0, 9, 5]),
    );
    let stats = client.stats().await;
    assert!(field_of(&plugin_line(&stats, "gather").unwrap(), "plans") >= 2);
    assert_eq!(stat(&stats, "fallbacks"), 0);
    let log = stowd.log();
    assert!(log.contains("plugin refused, not loaded"), "{log}");
    assert!(log.contains("refused by the conformance suite"), "{log}");
    stowd.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_plugin_file_is_unloaded_and_a_new_one_loaded() {
    let dir = plugin_dir_with(&["gather", "runs"]);
    let stowd = Stowd::start_with_plugins(&dir, "");
    let client = NativeClient::new(stowd.native());
    std::fs::remove_file(dir.join("runs.wasm")).unwrap();
    let stats = wait_for(&client, "runs unloaded", Duration::from_secs(30), |s| {
        stat(s, "plugin_removals") == 1
    })
    .await;
    assert!(plugin_line(&stats, "runs").is_none(), "{stats:?}");
    install(&plugin("constant-stride"), &dir, "constant-stride.wasm");
    let stats = wait_for(
        &client,
        "constant-stride loaded",
        Duration::from_secs(30),
        |s| stat(s, "plugin_swaps") == 1,
    )
    .await;
    assert!(
        plugin_line(&stats, "constant-stride").is_some(),
        "{stats:?}"
    );
    // A stride-2 put per unit now goes to constant-stride (zero copy).
    let indexes: Vec<u64> = (0..64).collect();
    client
        .put_ok(
            &indexes,
            &[(
                "x".into(),
                Field::Regular(tensor(Dtype::Float32, &[64, 4], 1)),
            )],
        )
        .await;
    let stats = client.stats().await;
    assert_eq!(
        field_of(&plugin_line(&stats, "constant-stride").unwrap(), "plans"),
        2
    );
    assert!(stowd.log().contains("plugin swapped in"));
    stowd.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------
// 2. Fail strategies

/// Hostile plugins, each in its own chain (a plugin's disabled state is
/// shared by the chains that use it):
/// - `fb*`:  drop-row, fallback, never disabled;
/// - `rej*`: oob-view, reject, never disabled;
/// - `bo*`:  dup-row, fallback, disabled after 2 faults, backoff 1 s
///   doubling to 2 s;
/// - `off*`: reorder, fallback, disabled after 1 fault, no backoff;
/// - `fuel*`: runs under a per-plugin fuel of 1,000 (too little: a timeout).
const FAIL_CONFIG: &str = "\
[plugins.overrides.runs]
fuel = 1000

[[chain]]
pattern = \"fb*\"
select = [\"drop-row\"]
fail = \"fallback\"
max_faults = 0

[[chain]]
pattern = \"rej*\"
select = [\"oob-view\"]
fail = \"reject\"
max_faults = 0

[[chain]]
pattern = \"bo*\"
select = [\"dup-row\"]
fail = \"fallback\"
max_faults = 2
backoff_ms = 1000
backoff_max_ms = 2000

[[chain]]
pattern = \"off*\"
select = [\"reorder\"]
fail = \"fallback\"
max_faults = 1
backoff_ms = 0

[[chain]]
pattern = \"fuel*\"
select = [\"runs\"]
fail = \"fallback\"
max_faults = 0
";

fn fail_plugins() -> PathBuf {
    let dir = temp_dir("fail-plugins");
    for name in ["drop-row", "oob-view", "dup-row", "reorder"] {
        std::fs::copy(hostile(name), dir.join(format!("{name}.wasm"))).unwrap();
    }
    std::fs::copy(plugin("runs"), dir.join("runs.wasm")).unwrap();
    dir
}

/// Puts 8 rows of field `name` (4 positions per unit, stride 2) and checks
/// them back.
async fn put_and_check(client: &NativeClient, name: &str, seed: u64) {
    let indexes: Vec<u64> = (0..8).map(|i| i + seed * 8).collect();
    let x = Field::Regular(f32_rows(8, 4, seed));
    client
        .put_ok(&indexes, &[(name.to_string(), x.clone())])
        .await;
    let got = client.get_ok(&indexes, &[name]).await;
    assert_cells(
        name,
        &wire_cells(got.into_iter().next().unwrap().1),
        &cells(&x),
    );
}

fn line(stats: &[(String, native::Stat)], plugin: &str) -> native::Stat {
    plugin_line(stats, plugin).unwrap_or_else(|| panic!("{plugin} not live: {stats:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_answers_the_builtin_and_counts_the_fault() {
    let dir = fail_plugins();
    let stowd = Stowd::start_with_plugins(&dir, FAIL_CONFIG);
    let client = NativeClient::new(stowd.native());
    for seed in 0..3 {
        put_and_check(&client, "fb_x", seed).await;
    }
    let stats = client.stats().await;
    let l = line(&stats, "drop-row");
    // Two units per put: two decisions, each a fault answered by the built-in.
    assert_eq!(
        (
            field_of(&l, "faults"),
            field_of(&l, "fallbacks"),
            field_of(&l, "invalid_plans")
        ),
        (6, 6, 6),
        "{l:?}"
    );
    assert!(!flag_of(&l, "disabled"), "{l:?}");
    assert_eq!(stat(&stats, "fallbacks"), 6);
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_fails_the_request_naming_the_plugin_and_stores_nothing() {
    let dir = fail_plugins();
    let stowd = Stowd::start_with_plugins(&dir, FAIL_CONFIG);
    let client = NativeClient::new(stowd.native());
    let x = Field::Regular(f32_rows(8, 4, 1));
    for _ in 0..2 {
        let reply = client
            .put(&(0..8).collect::<Vec<_>>(), &[("rej_x".into(), x.clone())])
            .await;
        let (code, message) = native_error(&reply);
        assert_eq!(code, native::code::REJECTED, "{message}");
        assert!(
            message.contains("\"oob-view\" version 0.1.0") && message.contains("invalid plan"),
            "{message}"
        );
        assert_eq!(
            native_error(&client.get(&[0], &["rej_x"]).await).0,
            native::code::KEY_NOT_FOUND
        );
    }
    let stats = client.stats().await;
    let l = line(&stats, "oob-view");
    assert_eq!(
        (field_of(&l, "rejections"), field_of(&l, "fallbacks")),
        (2, 0),
        "{l:?}"
    );
    // Other chains are unaffected.
    put_and_check(&client, "fb_y", 0).await;
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_plugin_is_reenabled_after_a_doubling_capped_backoff() {
    let dir = fail_plugins();
    let stowd = Stowd::start_with_plugins(&dir, FAIL_CONFIG);
    let client = NativeClient::new(stowd.native());

    // Put 1: two faults -> disabled, re-enabled in 1 s. (The bounds leave
    // room for a slow machine: each check only needs the time between the
    // fault and the stats reply to stay under the initial backoff.)
    put_and_check(&client, "bo_x", 0).await;
    let l = line(&client.stats().await, "dup-row");
    assert_eq!(
        (field_of(&l, "calls"), field_of(&l, "faults")),
        (2, 2),
        "{l:?}"
    );
    assert!(flag_of(&l, "disabled"), "{l:?}");
    let left = field_of(&l, "reenable_in_ms");
    assert!(left <= 1000 && left > 0, "{l:?}");
    // While disabled it is not called; the built-in answers.
    put_and_check(&client, "bo_x", 1).await;
    assert_eq!(
        field_of(&line(&client.stats().await, "dup-row"), "calls"),
        2
    );

    // After the backoff: called again (a fresh instance), faults twice more,
    // disabled again for twice as long.
    tokio::time::sleep(Duration::from_millis(1050)).await;
    put_and_check(&client, "bo_x", 2).await;
    let l = line(&client.stats().await, "dup-row");
    assert_eq!(
        (field_of(&l, "calls"), field_of(&l, "reenables")),
        (4, 1),
        "{l:?}"
    );
    let left = field_of(&l, "reenable_in_ms");
    assert!(left <= 2000 && left > 1000, "second backoff doubles: {l:?}");

    // Third time: the doubling is capped at 2 s.
    tokio::time::sleep(Duration::from_millis(2050)).await;
    put_and_check(&client, "bo_x", 3).await;
    let l = line(&client.stats().await, "dup-row");
    assert_eq!(
        (field_of(&l, "calls"), field_of(&l, "reenables")),
        (6, 2),
        "{l:?}"
    );
    let left = field_of(&l, "reenable_in_ms");
    assert!(left <= 2000 && left > 1000, "capped at 2 s: {l:?}");

    // backoff_ms = 0: disabled after one fault, and stays so.
    put_and_check(&client, "off_x", 0).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    put_and_check(&client, "off_x", 1).await;
    let l = line(&client.stats().await, "reorder");
    assert_eq!(
        (field_of(&l, "calls"), field_of(&l, "faults")),
        (1, 1),
        "{l:?}"
    );
    assert!(
        flag_of(&l, "disabled") && l.get("reenable_in_ms").is_none(),
        "{l:?}"
    );
    let log = stowd.log();
    assert!(log.contains("plugin re-enabled after its backoff"), "{log}");
    assert!(log.contains("until its file is reloaded"), "{log}");

    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_plugin_fuel_override_applies() {
    let dir = fail_plugins();
    let stowd = Stowd::start_with_plugins(&dir, FAIL_CONFIG);
    let client = NativeClient::new(stowd.native());
    put_and_check(&client, "fuel_x", 0).await;
    let l = line(&client.stats().await, "runs");
    assert_eq!(
        (field_of(&l, "faults"), field_of(&l, "fallbacks")),
        (2, 2),
        "{l:?}"
    );
    assert!(stowd.log().contains("ran out of fuel"), "{}", stowd.log());
    stowd.stop();
}

// ---------------------------------------------------------------------------
// 3. Metrics

/// A regular field of more than a frame's bytes (`[limits]
/// max_message_bytes`, 1 MiB here) comes back in frames of at most that,
/// whole rows each, and reads back byte for byte: every large frame a
/// stowd sends is of one size, for the receiver's pool to reuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_part_goes_out_in_frames_of_at_most_the_frame_size() {
    let port = stowage_tests::free_port();
    let stowd = Stowd::start(&format!(
        "[metrics]\nport = {port}\n\n[units]\nlocal = 1\n\n[limits]\nmax_message_bytes = 1048576\n"
    ));
    let url = stowd.endpoints.metrics.clone().expect("metrics endpoint");
    let client = NativeClient::new(stowd.native());
    // 3.5 MiB in one part: rows of 3,000 bytes, 1,223 rows.
    let t = tensor(Dtype::Uint8, &[1223, 3000], 4);
    let indexes: Vec<u64> = (0..1223).collect();
    client
        .put_ok(&indexes, &[("x".into(), Field::Regular(t.clone()))])
        .await;
    let sent = |m: &prom::Exposition| m.value("stowd_frames_sent_total", &[("to", "client")]);
    let m0 = prom::scrape(&url);
    let got = client.get_ok(&indexes, &["x"]).await;
    let m1 = prom::scrape(&url);
    // Frame 0 and 4 data frames (349 rows of 3,000 bytes fit 1 MiB).
    assert_eq!(sent(&m1) - sent(&m0), 5.0);
    match &got[0].1 {
        native::WireField::Regular(p) => {
            assert_eq!(p.parts().len(), 4);
            assert!(p.parts().iter().all(|(b, _)| b.len() <= 1 << 20));
            assert_eq!(
                p.to_tensor().unwrap().contiguous_bytes(),
                t.contiguous_bytes()
            );
        }
        other => panic!("not regular: {other:?}"),
    }
}

/// The receive pool's counters: a 2 MiB frame into an empty pool is a
/// miss; after its rows are cleared the next put of that size lands in
/// the same buffer, a hit; nothing was freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_receive_pool_hits_and_misses() {
    let port = stowage_tests::free_port();
    let stowd = Stowd::start(&format!("[metrics]\nport = {port}\n\n[units]\nlocal = 1\n"));
    let url = stowd.endpoints.metrics.clone().expect("metrics endpoint");
    let client = NativeClient::new(stowd.native());
    let field = |seed| {
        vec![(
            "x".to_string(),
            Field::Regular(tensor(Dtype::Float32, &[512, 1024], seed)),
        )]
    };
    let indexes: Vec<u64> = (0..512).collect();
    let frames = |m: &prom::Exposition, result: &str| {
        m.value("stowd_receive_pool_frames_total", &[("result", result)])
    };
    let m0 = prom::scrape(&url);
    client.put_ok(&indexes, &field(1)).await;
    let m1 = prom::scrape(&url);
    assert_eq!(frames(&m1, "miss") - frames(&m0, "miss"), 1.0);
    assert_eq!(frames(&m1, "hit") - frames(&m0, "hit"), 0.0);
    assert_eq!(client.clear(&indexes, None).await, 512);
    client.put_ok(&indexes, &field(2)).await;
    let m2 = prom::scrape(&url);
    assert_eq!(frames(&m2, "hit") - frames(&m1, "hit"), 1.0);
    assert_eq!(frames(&m2, "miss") - frames(&m1, "miss"), 0.0);
    assert_eq!(m2.value("stowd_receive_pool_freed_bytes_total", &[]), 0.0);
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_count_zero_copy_and_copied_bytes() {
    let port = stowage_tests::free_port();
    let config = format!(
        "[metrics]\nport = {port}\ntq_extra = true\n\n\
         [[chain]]\npattern = \"g*\"\nselect = [\"gather\"]\n\n\
         [[chain]]\npattern = \"*\"\nselect = [\"single-row\", \"constant-stride\", \"runs\", \"gather\"]\npack = [\"coalesce\"]\n"
    );
    let stowd = Stowd::start(&config);
    let url = stowd
        .endpoints
        .metrics
        .clone()
        .expect("metrics endpoint in the endpoints file");
    assert_eq!(url, format!("http://127.0.0.1:{port}/metrics"));
    let client = NativeClient::new(stowd.native());
    let m0 = prom::scrape(&url);
    assert_eq!(
        m0.value(
            "stowd_plugin_live",
            &[("plugin", "constant-stride"), ("version", "0.1.0")]
        ),
        1.0
    );

    // [1024, 256] float32 over two local units, constant stride: views only.
    let indexes: Vec<u64> = (0..1024).collect();
    client
        .put_ok(
            &indexes,
            &[(
                "obs".into(),
                Field::Regular(tensor(Dtype::Float32, &[1024, 256], 5)),
            )],
        )
        .await;
    let m1 = prom::scrape(&url);
    let delta = |a: &prom::Exposition, b: &prom::Exposition, name: &str| {
        b.value(name, &[]) - a.value(name, &[])
    };
    // Every family is there once it has a series (the first request was
    // answered; a family with no series yet is left out).
    for family in [
        "stowd_requests_total",
        "stowd_request_duration_seconds",
        "stowd_stored_bytes",
        "stowd_stored_rows",
        "stowd_zero_copy_bytes_total",
        "stowd_copied_bytes_total",
        "stowd_frames_sent_total",
        "stowd_policy_decisions_total",
        "stowd_plugin_faults_total",
        "stowd_plugin_fallbacks_total",
    ] {
        assert!(m1.types.contains_key(family), "no family {family}");
    }
    assert_eq!(
        delta(&m0, &m1, "stowd_zero_copy_bytes_total"),
        (1 << 20) as f64
    );
    assert_eq!(delta(&m0, &m1, "stowd_copied_bytes_total"), 0.0);
    assert_eq!(m1.sum("stowd_stored_bytes", &[]), (1 << 20) as f64);
    assert_eq!(m1.sum("stowd_stored_rows", &[]), 1024.0);
    assert_eq!(
        m1.value("stowd_policy_decisions_total", &[("by", "plugin")]),
        2.0
    );
    assert_eq!(
        m1.value(
            "stowd_plugin_plans_total",
            &[("plugin", "constant-stride"), ("version", "0.1.0")]
        ),
        2.0
    );
    assert_eq!(
        m1.value(
            "stowd_requests_total",
            &[("protocol", "native"), ("op", "put"), ("outcome", "ok")]
        ),
        1.0
    );
    assert_eq!(
        m1.value(
            "stowd_request_duration_seconds_count",
            &[("protocol", "native"), ("op", "put")]
        ),
        1.0
    );

    // The same payload under a gather-routed name: every byte copied once.
    let more: Vec<u64> = (2000..3024).collect();
    client
        .put_ok(
            &more,
            &[(
                "gobs".into(),
                Field::Regular(tensor(Dtype::Float32, &[1024, 256], 6)),
            )],
        )
        .await;
    let m2 = prom::scrape(&url);
    assert_eq!(
        delta(&m1, &m2, "stowd_copied_bytes_total"),
        (1 << 20) as f64
    );
    assert_eq!(delta(&m1, &m2, "stowd_zero_copy_bytes_total"), 0.0);
    assert_eq!(
        m2.value(
            "stowd_plugin_plans_total",
            &[("plugin", "gather"), ("version", "0.1.0")]
        ),
        2.0
    );
    assert_eq!(m2.sum("stowd_stored_bytes", &[]), (2 << 20) as f64);

    // A get, an error, and the TransferQueue side.
    let got = client.get_ok(&[5, 1000], &["obs"]).await;
    assert_eq!(got.len(), 1);
    assert_eq!(
        native_error(&client.get(&[99_999], &["obs"]).await).0,
        native::code::KEY_NOT_FOUND
    );
    let router = TqClient::new(stowd.router());
    let tq_metrics = router.metrics().await;
    let m3 = prom::scrape(&url);
    assert_eq!(
        m3.value(
            "stowd_requests_total",
            &[("protocol", "native"), ("op", "get"), ("outcome", "ok")]
        ),
        1.0
    );
    assert_eq!(
        m3.value(
            "stowd_requests_total",
            &[("protocol", "native"), ("op", "get"), ("outcome", "error")]
        ),
        1.0
    );
    assert_eq!(
        m3.value(
            "stowd_requests_total",
            &[
                ("protocol", "tq_router"),
                ("op", "metrics"),
                ("outcome", "ok")
            ]
        ),
        1.0
    );
    assert!(m3.value("stowd_frames_sent_total", &[("to", "client")]) >= 5.0);
    let get_hist = m3.value(
        "stowd_request_duration_seconds_bucket",
        &[("protocol", "native"), ("op", "get"), ("le", "+Inf")],
    );
    assert_eq!(get_hist, 2.0);

    // GET_METRICS carries the same figures in its `stowage` key.
    let (key, raw) = tq_metrics
        .extra
        .first()
        .expect("a stowage key (tq_extra = true)");
    assert_eq!(key, "stowage");
    let extra = decode_u64_map(raw);
    assert_eq!(
        extra["zero_copy_bytes"],
        m3.value("stowd_zero_copy_bytes_total", &[]) as u64
    );
    assert_eq!(extra["copied_bytes"], 1 << 20);
    assert_eq!(extra["stored_bytes"], 2 << 20);
    assert_eq!(extra["stored_rows"], 2048);
    assert_eq!(tq_metrics.active_keys, 2048);
    let unit = TqClient::new(stowd.unit(0)).metrics().await;
    assert_eq!(
        decode_u64_map(&unit.extra[0].1)["stored_bytes"],
        1 << 20,
        "unit 0 holds half"
    );

    // Other paths and methods.
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .to_string();
    assert_eq!(prom::http_get(&addr, "/nope").unwrap().0, 404);
    stowd.stop();
}

#[test]
fn metrics_endpoint_answers_garbage_and_slow_clients_without_blocking_scrapes() {
    use std::io::{Read, Write};
    let port = stowage_tests::free_port();
    let stowd = Stowd::start(&format!("[metrics]\nport = {port}\n"));
    let url = stowd.endpoints.metrics.clone().expect("metrics endpoint");
    let addr = format!("127.0.0.1:{port}");
    let raw = |request: &[u8]| {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        s.write_all(request).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    // Two silent clients hold connections open with half a request head.
    let silent: Vec<std::net::TcpStream> = (0..2)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(&addr).unwrap();
            s.write_all(b"GET /met").unwrap();
            s
        })
        .collect();
    let garbage = raw(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http\r\n\r\n");
    assert!(
        garbage.starts_with("HTTP/1.1 400 Bad Request\r\n"),
        "{garbage:?}"
    );
    assert!(raw(b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n").starts_with("HTTP/1.1 405 "));
    let started = std::time::Instant::now();
    let m = prom::scrape(&url);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(2),
        "scrape took {:?}",
        started.elapsed()
    );
    assert_eq!(
        m.value("stowd_plugin_reloads_total", &[("outcome", "refused")]),
        0.0
    );
    assert!(m.value("stowd_process_resident_memory_bytes", &[]) > 0.0);
    drop(silent);
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_off_by_default_and_tq_replies_keep_their_keys() {
    let stowd = Stowd::start("");
    assert_eq!(stowd.endpoints.metrics, None);
    let m = TqClient::new(stowd.unit(0)).metrics().await;
    assert!(m.extra.is_empty(), "{m:?}");
    let reply = TqClient::new(stowd.router())
        .request(&tq::Request::GetMetrics)
        .await;
    assert!(matches!(reply, tq::Reply::Metrics(m) if m.extra.is_empty()));
    stowd.stop();
}

/// A msgpack map of string -> unsigned integer.
fn decode_u64_map(raw: &[u8]) -> std::collections::HashMap<String, u64> {
    let mut rd = raw;
    let n = rmp::decode::read_map_len(&mut rd).expect("a map");
    let mut out = std::collections::HashMap::new();
    for _ in 0..n {
        let len = rmp::decode::read_str_len(&mut rd).expect("a key") as usize;
        let key = String::from_utf8(rd[..len].to_vec()).unwrap();
        rd = &rd[len..];
        let v: u64 = rmp::decode::read_int(&mut rd).expect("an unsigned value");
        out.insert(key, v);
    }
    out
}
