//! Router mode across hosts, with network namespaces standing in for hosts
//! (issue 6, part 3): three unit hosts, each a `stowd` serving one unit in
//! its own namespace, and a router `stowd` in a fourth namespace routing to
//! them over tcp (`g % 3`). The test process reaches the router through a
//! veth pair from the host namespace. Every address is a 10.77.x.y/24
//! inside these namespaces and that one veth; nothing touches the host's
//! real interfaces, and a guard removes the namespaces and the veth at the
//! end, panics included.
//!
//! 1. Healthy: the verifying load (`stowage_tests::load`) over the router,
//!    both protocols: nothing lost or mixed up.
//! 2. One unit host is killed (SIGKILL): requests touching it fail with an
//!    error naming it within the router's timeout; requests touching only
//!    the other units go on working, with their data intact.
//! 3. It restarts, empty, on the same address: new puts to it succeed, and
//!    its old rows are reported missing (key not found), never returned
//!    wrong.
//!
//! Needs root and `ip` (iproute2). Without them the test says why and
//! returns.

use std::time::{Duration, Instant};

use stowage_host::batch::Field;
use stowage_tests::Stowd;
use stowage_tests::load::{self, DualClient, Outcome, Proto, Target, join_all};
use stowage_tests::netns::{self, Netns, ip};

/// The router's reply timeout towards its units.
const ROUTER_TIMEOUT: Duration = Duration::from_secs(3);
/// The unit hosts' port.
const UNIT_PORT: u16 = 7100;
const UNITS: usize = 3;

/// The namespaces and links of one run; removed on drop.
struct Net {
    /// Router namespace, then unit namespaces.
    router_ns: String,
    unit_ns: Vec<String>,
    host_link: String,
    /// Per-run tag in link names.
    tag: String,
    /// Third octet of the host <-> router subnet; unit i uses `base + 1 + i`.
    base: u8,
    /// The namespaces made so far, deleted on drop.
    made: Vec<Netns>,
}

impl Net {
    fn router_addr(&self) -> String {
        format!("10.77.{}.2", self.base)
    }
    fn unit_addr(&self, i: usize) -> String {
        format!("10.77.{}.2", self.base as usize + 1 + i)
    }
    fn unit_endpoint(&self, i: usize) -> String {
        format!("tcp://{}:{UNIT_PORT}", self.unit_addr(i))
    }
    /// Takes unit host `i`'s only link down or up: a network partition,
    /// with the process alive and its rows kept.
    fn set_unit_link(&self, i: usize, up: bool) -> Result<(), String> {
        let dev = format!("stw{}u{i}", self.tag);
        ip(&[
            "-n",
            &self.unit_ns[i],
            "link",
            "set",
            &dev,
            if up { "up" } else { "down" },
        ])
    }

    /// Creates everything, or says why it cannot.
    fn create() -> Result<Net, String> {
        netns::available()?;
        let _made = netns::creating();
        let tag = format!("{:05}", std::process::id() % 100_000);
        // Five subnets: host <-> router, then router <-> each unit host.
        let base = netns::free_subnets("10.77", UNITS as u8 + 1)?;
        let mut net = Net {
            router_ns: format!("stowage-mh-{tag}-r"),
            unit_ns: (0..UNITS)
                .map(|i| format!("stowage-mh-{tag}-u{i}"))
                .collect(),
            host_link: format!("stw{tag}h"),
            tag: tag.clone(),
            base,
            made: Vec::new(),
        };
        // From here on, drop cleans up whatever was made.
        net.build(&tag)
            .map_err(|e| format!("cannot create the namespaces: {e}"))?;
        Ok(net)
    }

    fn build(&mut self, tag: &str) -> Result<(), String> {
        self.made.push(Netns::add(&self.router_ns)?);
        netns::veth(
            &netns::End {
                ns: None,
                name: &self.host_link,
                addr: &format!("10.77.{}.1/24", self.base),
            },
            &netns::End {
                ns: Some(&self.router_ns),
                name: &format!("stw{tag}r"),
                addr: &format!("{}/24", self.router_addr()),
            },
        )?;
        for i in 0..UNITS {
            self.made.push(Netns::add(&self.unit_ns[i])?);
            let subnet = self.base as usize + 1 + i;
            netns::veth(
                &netns::End {
                    ns: Some(&self.router_ns),
                    name: &format!("stw{tag}a{i}"),
                    addr: &format!("10.77.{subnet}.1/24"),
                },
                &netns::End {
                    ns: Some(&self.unit_ns[i]),
                    name: &format!("stw{tag}u{i}"),
                    addr: &format!("{}/24", self.unit_addr(i)),
                },
            )?;
        }
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // The namespaces go with `made` (and the veth ends in them, and so
        // their peers); the host end goes here in case its peer never moved.
        netns::del_link(&self.host_link);
    }
}

/// Hosts reach each other's TransferQueue endpoints (the router's remote
/// units, the load's clients), and the load's clients (the zeromq crate's
/// DEALERs) speak NULL only.
const SECURITY: &str = "[security]\nauth = \"none\"\ntq_endpoints = \"open\"\n";

fn unit_config(net: &Net, i: usize) -> String {
    format!(
        "[server]\nhost = {:?}\n\n[units]\nlocal = 1\nport_base = {UNIT_PORT}\n\n[router]\nenabled = false\n\n[shm]\nenabled = false\n\n{SECURITY}",
        net.unit_addr(i)
    )
}

fn router_config(net: &Net) -> String {
    let units: Vec<String> = (0..UNITS)
        .map(|i| format!("{:?}", net.unit_endpoint(i)))
        .collect();
    format!(
        "[server]\nhost = {:?}\n\n[units]\nlocal = 0\n\n[router]\nunits = [{}]\ntimeout_secs = {}\n\n[shm]\nenabled = false\n\n{SECURITY}",
        net.router_addr(),
        units.join(", "),
        ROUTER_TIMEOUT.as_secs()
    )
}

/// A put of `fields` (reg, jag, str) at `indexes`, version `v`.
fn batch(indexes: &[u64], v: u64) -> Vec<(String, Field)> {
    ["reg", "jag", "str"]
        .iter()
        .map(|f| (f.to_string(), load::field(f, indexes, v)))
        .collect()
}

const NAMES: [&str; 3] = ["reg", "jag", "str"];

fn names() -> Vec<String> {
    NAMES.iter().map(|s| s.to_string()).collect()
}

/// Asserts a get of `indexes` succeeded with version `v` of every row.
fn assert_rows(what: &str, outcome: &Outcome, indexes: &[u64], v: u64) {
    let Outcome::Got(fields) = outcome else {
        panic!("{what}: expected rows, got {outcome:?}")
    };
    assert_eq!(fields.len(), NAMES.len(), "{what}: fields");
    for ((name, cells), want) in fields.iter().zip(NAMES) {
        assert_eq!(name, want, "{what}: field order");
        assert_eq!(cells.len(), indexes.len(), "{what}: rows of {name}");
        for (cell, g) in cells.iter().zip(indexes) {
            if let Some(why) = load::check(cell, *g, name, v) {
                panic!("{what}: g={g} field={name}: {why}");
            }
        }
    }
}

/// The error text of a failed request (panics on success).
fn error_text(what: &str, outcome: &Outcome) -> String {
    match outcome {
        Outcome::Error(e) | Outcome::KeyNotFound(e) => e.clone(),
        other => panic!("{what}: expected an error reply, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_host_dies_and_comes_back() {
    let net = match Net::create() {
        Ok(n) => n,
        Err(why) => {
            eprintln!("SKIPPED multihost: network namespaces are not available here: {why}");
            return;
        }
    };
    let started = Instant::now();
    let mut units: Vec<Stowd> = (0..UNITS)
        .map(|i| Stowd::start_in_netns(&net.unit_ns[i], &unit_config(&net, i)))
        .collect();
    let mut router = Stowd::start_in_netns(&net.router_ns, &router_config(&net));
    for (i, u) in units.iter().enumerate() {
        assert_eq!(
            u.unit(0).endpoint,
            net.unit_endpoint(i),
            "unit host {i} endpoint"
        );
    }
    let target = Target {
        tq: Some(router.router().clone()),
        native: Some(router.native().to_string()),
        pid: None,
    };
    println!(
        "router {} / {} over {:?}",
        router.router().endpoint,
        router.native(),
        (0..UNITS).map(|i| net.unit_endpoint(i)).collect::<Vec<_>>()
    );

    // 1. Healthy: the verifying load across the namespaces.
    let opts = load::Options {
        clients: 16,
        duration: Duration::from_secs(4),
        keys_per_client: 64,
        max_batch: 24,
        seed: 7,
        timeout: Duration::from_secs(20),
        exact_clear_counts: false,
        field_clears: false,
        ..load::Options::default()
    };
    let report = load::run(&target, &opts).await;
    println!("{}", report.table());
    assert_eq!(
        report.mismatch_count,
        0,
        "healthy phase:\n{}",
        report.table()
    );
    assert_eq!(report.error_count, 0, "healthy phase:\n{}", report.table());
    assert!(
        report.op("put").count > 0 && report.op("get").count > 0 && report.op("clear").count > 0
    );

    // 2. Known rows on every unit; a partition, then unit host 1 dies.
    let mut client = DualClient::new(&target, "mh", Duration::from_secs(20));
    let all: Vec<u64> = (0..30).collect();
    assert!(
        matches!(
            client.put(Proto::Native, &all, batch(&all, 1)).await,
            Outcome::Put
        ),
        "put before the kill"
    );
    assert_rows(
        "get before the kill",
        &client.get(Proto::Tq, &all, &names()).await,
        &all,
        1,
    );

    // 2a. A partition: unit host 2 unreachable, its process alive. Requests
    // touching it fail within the router timeout, several at once too;
    // when the link comes back its rows are there, unchanged.
    let cut = 2usize;
    let on_cut: Vec<u64> = all
        .iter()
        .copied()
        .filter(|g| g % 3 == cut as u64)
        .collect();
    net.set_unit_link(cut, false).expect("link down");
    let cut_endpoint = net.unit_endpoint(cut);
    let mut waiting: Vec<DualClient> = (0..4)
        .map(|i| DualClient::new(&target, &format!("cut{i}"), Duration::from_secs(60)))
        .collect();
    let tasks = waiting.iter_mut().enumerate().map(|(i, c)| {
        let g = [on_cut[i % on_cut.len()]];
        let p = if i % 2 == 0 { Proto::Tq } else { Proto::Native };
        async move {
            let t = Instant::now();
            let o = c.get(p, &g, &names()).await;
            (t.elapsed(), o)
        }
    });
    let partitioned = join_all(tasks).await;
    for (took, o) in &partitioned {
        let text = error_text("get across the partition", o);
        println!("get across the partition: {took:?}: {text}");
        assert!(
            text.contains(&cut_endpoint),
            "the error names the unreachable unit: {text}"
        );
        assert!(
            *took <= ROUTER_TIMEOUT + Duration::from_secs(2),
            "took {took:?} with a router timeout of {ROUTER_TIMEOUT:?}"
        );
    }
    net.set_unit_link(cut, true).expect("link up");
    assert_rows(
        "get after the partition healed",
        &client.get(Proto::Tq, &all, &names()).await,
        &all,
        1,
    );
    drop(waiting);

    let dead = 1usize;
    let on_dead: Vec<u64> = all
        .iter()
        .copied()
        .filter(|g| g % 3 == dead as u64)
        .collect();
    let elsewhere: Vec<u64> = all
        .iter()
        .copied()
        .filter(|g| g % 3 != dead as u64)
        .collect();
    units[dead].kill();
    println!("killed unit host {dead} ({})", net.unit_endpoint(dead));

    let dead_endpoint = net.unit_endpoint(dead);
    let bound = ROUTER_TIMEOUT + Duration::from_secs(2);
    for (p, what) in [
        (Proto::Tq, "get over transferqueue"),
        (Proto::Native, "get over stowage/1"),
        (Proto::Tq, "get again"),
    ] {
        let t = Instant::now();
        let outcome = client.get(p, &[on_dead[0], elsewhere[0]], &names()).await;
        let took = t.elapsed();
        let text = error_text(what, &outcome);
        println!("{what} touching the dead unit: {took:?}: {text}");
        assert!(
            matches!(outcome, Outcome::Error(_)),
            "{what}: a dead unit is not a missing key: {text}"
        );
        assert!(
            text.contains(&dead_endpoint),
            "{what}: the error names the unit: {text}"
        );
        assert!(
            took <= bound,
            "{what}: took {took:?}, more than the router timeout {ROUTER_TIMEOUT:?} + 2 s"
        );
    }
    let t = Instant::now();
    let outcome = client
        .put(Proto::Native, &on_dead[..2], batch(&on_dead[..2], 2))
        .await;
    let text = error_text("put to the dead unit", &outcome);
    println!("put touching the dead unit: {:?}: {text}", t.elapsed());
    assert!(
        text.contains(&dead_endpoint),
        "put: the error names the unit: {text}"
    );
    assert!(
        t.elapsed() <= bound,
        "put to the dead unit took {:?}",
        t.elapsed()
    );

    // Several requests at once: each fails in time, not one after another.
    let mut others: Vec<DualClient> = (0..4)
        .map(|i| DualClient::new(&target, &format!("mh{i}"), Duration::from_secs(60)))
        .collect();
    let t = Instant::now();
    let tasks = others.iter_mut().enumerate().map(|(i, c)| {
        let g = [on_dead[i % on_dead.len()]];
        async move {
            let t = Instant::now();
            let o = c.get(Proto::Native, &g, &names()).await;
            (t.elapsed(), o)
        }
    });
    let concurrent = join_all(tasks).await;
    let slowest = concurrent.iter().map(|(d, _)| *d).max().unwrap_or_default();
    println!(
        "4 concurrent gets on the dead unit: slowest {slowest:?} (all {:?})",
        concurrent.iter().map(|(d, _)| *d).collect::<Vec<_>>()
    );
    for (d, o) in &concurrent {
        let text = error_text("concurrent get", o);
        assert!(text.contains(&dead_endpoint), "concurrent get: {text}");
        let _ = d;
    }
    println!("(concurrent phase took {:?})", t.elapsed());

    // Requests touching only the live units go on, data intact.
    for p in [Proto::Tq, Proto::Native] {
        let t = Instant::now();
        let outcome = client.get(p, &elsewhere, &names()).await;
        assert_rows(
            &format!("{p:?} get on the live units"),
            &outcome,
            &elsewhere,
            1,
        );
        assert!(
            t.elapsed() < bound,
            "get on the live units took {:?}",
            t.elapsed()
        );
        let fresh = [elsewhere[0], elsewhere[1]];
        assert!(
            matches!(client.put(p, &fresh, batch(&fresh, 3)).await, Outcome::Put),
            "{p:?} put on live units"
        );
        assert_rows("reread", &client.get(p, &fresh, &names()).await, &fresh, 3);
        assert!(matches!(
            client.put(p, &fresh, batch(&fresh, 1)).await,
            Outcome::Put
        ));
    }
    assert_slowest_ok(slowest, bound);

    // 3. The unit host restarts, empty, on the same address.
    let dead_before = std::mem::replace(
        &mut units[dead],
        Stowd::start_in_netns(&net.unit_ns[dead], &unit_config(&net, dead)),
    );
    drop(dead_before);
    println!("restarted unit host {dead}");
    // The router's connections to the old process are dead; the first
    // request finds that out and retries on a fresh connection.
    let t = Instant::now();
    let mut attempts = vec![];
    let fresh: Vec<u64> = on_dead[..3].to_vec();
    loop {
        let a = Instant::now();
        let outcome = client.put(Proto::Tq, &fresh, batch(&fresh, 4)).await;
        attempts.push((
            a.elapsed(),
            format!("{outcome:?}").chars().take(200).collect::<String>(),
        ));
        if matches!(outcome, Outcome::Put) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "puts to the restarted unit keep failing: {attempts:#?}"
        );
    }
    println!(
        "put to the restarted unit: {} attempt(s) in {:?}: {attempts:?}",
        attempts.len(),
        t.elapsed()
    );
    // A kept connection to the dead process is retried once on a fresh one,
    // so the very first put succeeds.
    assert_eq!(
        attempts.len(),
        1,
        "the first put to the restarted unit failed: {attempts:#?}"
    );
    assert_rows(
        "get of new rows on the restarted unit",
        &client.get(Proto::Native, &fresh, &names()).await,
        &fresh,
        4,
    );
    // Its old rows are gone, and reported so, over both protocols.
    let lost = on_dead[3];
    for p in [Proto::Tq, Proto::Native] {
        let outcome = client.get(p, &[lost], &names()).await;
        let text = error_text("get of a row the dead unit held", &outcome);
        println!("{p:?} get of an old row of the restarted unit: {text}");
        assert!(
            matches!(outcome, Outcome::KeyNotFound(_)),
            "{p:?}: an old row is reported missing: {text}"
        );
    }
    // The other units kept everything.
    assert_rows(
        "get on the other units after the restart",
        &client.get(Proto::Tq, &elsewhere, &names()).await,
        &elsewhere,
        1,
    );
    router.assert_running();
    println!("multihost took {:?}", started.elapsed());
    drop(client);
    drop(others);
    router.stop();
    for u in units {
        u.stop();
    }
    drop(net);
}

/// Requests at once on a dead unit each fail within the router timeout
/// (plus slack): a request's deadline counts from its start, and the
/// router's connections to a unit do not queue requests behind a dead one.
fn assert_slowest_ok(slowest: Duration, bound: Duration) {
    assert!(
        slowest <= bound,
        "with 4 requests at once on the dead unit the slowest took {slowest:?}, more than {bound:?}"
    );
}
