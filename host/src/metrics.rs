//! Metrics: the counters and latency histograms the services keep. A leaf
//! module: it imports nothing from the crate, and every other module may
//! import it (the services count requests here, hot reload counts reloads,
//! the manager its data path). The Prometheus exposition and its HTTP
//! endpoint are in [`crate::server::exposition`], which reads these and the
//! figures of units, the manager and the plugin registry at scrape time.
//!
//! Every series name starts with `stowd_`. Counters end in `_total`; the
//! latency histogram is `stowd_request_duration_seconds`. Plugin series are
//! labelled by `plugin` and `version`, and a version's counters survive hot
//! reloads (they are kept for every version ever loaded; `stowd_plugin_live`
//! says which versions are live).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Upper bounds of the latency histogram buckets, seconds.
pub const LATENCY_BUCKETS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Where a request came in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Protocol {
    /// A TransferQueue unit endpoint.
    Tq,
    /// The router-mode TransferQueue endpoint.
    TqRouter,
    /// The native `stowage/1` endpoint.
    Native,
}

impl Protocol {
    pub fn label(self) -> &'static str {
        match self {
            Protocol::Tq => "tq",
            Protocol::TqRouter => "tq_router",
            Protocol::Native => "native",
        }
    }
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    Ok,
    /// An error reply (including a missing key and a bad request).
    Error,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
        }
    }
}

/// A latency histogram over [`LATENCY_BUCKETS`].
#[derive(Clone, Debug, Default)]
pub struct Histogram {
    /// Non-cumulative counts per bucket of [`LATENCY_BUCKETS`], then +Inf.
    pub buckets: [u64; LATENCY_BUCKETS.len() + 1],
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        let i = LATENCY_BUCKETS
            .iter()
            .position(|b| seconds <= *b)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i] += 1;
        self.sum += seconds;
        self.count += 1;
    }
}

/// Data-path counters of the manager.
#[derive(Debug, Default)]
pub struct DataCounters {
    /// Row bytes handed to units as views of the received frames.
    pub zero_copy_bytes: AtomicU64,
    /// Row bytes copied (gathers, concatenations, coalesced frames).
    pub copied_bytes: AtomicU64,
    /// Frames sent to remote units.
    pub frames_sent: AtomicU64,
    /// Messages sent to remote units.
    pub messages_sent: AtomicU64,
    /// Selection decisions taken by plugins.
    pub plugin_decisions: AtomicU64,
    /// Selection decisions answered by the built-in (no plugin applied).
    pub builtin_decisions: AtomicU64,
    /// Built-in answers after a plugin fault.
    pub fallbacks: AtomicU64,
    /// Gets of peer units' rows forwarded to the client while they
    /// arrived (`server/native/forward.rs`).
    pub gets_forwarded: AtomicU64,
    /// Of those, the ones whose reply could not be finished (the peer's
    /// reply failed after the client's began, or the client left): the
    /// client's connection was closed.
    pub gets_forward_dropped: AtomicU64,
    /// Same-node gets answered over the socket, their rows under
    /// `[shm] inline_below` bytes.
    pub same_node_gets_inline: AtomicU64,
}

/// Hot-reload outcomes.
#[derive(Debug, Default)]
pub struct ReloadCounters {
    /// Plugin files made live (new or changed).
    pub swapped: AtomicU64,
    /// Plugin files refused (contract, compile, conformance); the previous
    /// version of the file, if any, stayed live.
    pub refused: AtomicU64,
    /// Plugin files removed, their plugin unloaded.
    pub removed: AtomicU64,
    /// A gauge: chain entries that name no live plugin with the capability
    /// their list needs (skipped; set at start and after each reload).
    pub missing_chain_entries: AtomicU64,
}

/// The counters the services keep.
#[derive(Debug)]
pub struct Metrics {
    /// Requests and their latency, under one lock (one lock a request).
    counts: Mutex<Snapshot>,
    /// Reply frames sent to clients.
    pub reply_frames: AtomicU64,
    pub reloads: ReloadCounters,
    started: Instant,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            counts: Mutex::default(),
            reply_frames: AtomicU64::new(0),
            reloads: ReloadCounters::default(),
            started: Instant::now(),
        }
    }
}

impl Metrics {
    /// Counts one answered request.
    pub fn observe(
        &self,
        protocol: Protocol,
        op: &'static str,
        outcome: Outcome,
        took: Duration,
        reply_frames: usize,
    ) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        *counts.requests.entry((protocol, op, outcome)).or_default() += 1;
        counts
            .latency
            .entry((protocol, op))
            .or_default()
            .observe(took.as_secs_f64());
        drop(counts);
        self.reply_frames
            .fetch_add(reply_frames as u64, Ordering::Relaxed);
    }

    /// Requests counted for (protocol, op), any outcome.
    pub fn requests(&self, protocol: Protocol, op: &str) -> u64 {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        counts
            .requests
            .iter()
            .filter(|((p, o, _), _)| *p == protocol && *o == op)
            .map(|(_, n)| n)
            .sum()
    }

    /// Requests counted and their latency histograms, in (protocol, op,
    /// outcome) and (protocol, op) order, read under their lock.
    pub fn snapshot(&self) -> Snapshot {
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Time since these metrics were created (stowd started).
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }
}

/// A copy of the request counters taken at one scrape.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub requests: BTreeMap<(Protocol, &'static str, Outcome), u64>,
    pub latency: BTreeMap<(Protocol, &'static str), Histogram>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets() {
        let mut h = Histogram::default();
        h.observe(0.00005);
        h.observe(0.003);
        h.observe(100.0);
        assert_eq!(h.buckets[0], 1);
        assert_eq!(h.buckets[5], 1);
        assert_eq!(h.buckets[LATENCY_BUCKETS.len()], 1);
        assert_eq!(h.count, 3);
    }

    #[test]
    fn observe_counts_by_protocol_op_and_outcome() {
        let m = Metrics::default();
        m.observe(
            Protocol::Tq,
            "put",
            Outcome::Ok,
            Duration::from_micros(50),
            1,
        );
        m.observe(
            Protocol::Tq,
            "put",
            Outcome::Error,
            Duration::from_millis(3),
            1,
        );
        m.observe(
            Protocol::Native,
            "put",
            Outcome::Ok,
            Duration::from_millis(3),
            2,
        );
        assert_eq!(m.requests(Protocol::Tq, "put"), 2);
        assert_eq!(m.requests(Protocol::Native, "get"), 0);
        assert_eq!(m.reply_frames.load(Ordering::Relaxed), 4);
        let s = m.snapshot();
        assert_eq!(s.requests[&(Protocol::Tq, "put", Outcome::Error)], 1);
        assert_eq!(s.latency[&(Protocol::Tq, "put")].count, 2);
    }
}
