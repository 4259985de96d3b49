//! Metrics: request counters and latency histograms kept by the services,
//! the figures read from units, the manager and the plugin registry at
//! scrape time, the Prometheus text format (version 0.0.4), and the tiny
//! HTTP/1.1 responder that serves it at `/metrics`.
//!
//! Every series name starts with `stowd_`. Counters end in `_total`; the
//! latency histogram is `stowd_request_duration_seconds`. Plugin series are
//! labelled by `plugin` and `version`, and a version's counters survive hot
//! reloads (they are kept for every version ever loaded; `stowd_plugin_live`
//! says which versions are live).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::manager::{Manager, Target, process_rss_bytes};
use crate::policy::registry::Registry;
use crate::store::Unit;

/// Upper bounds of the latency histogram buckets, seconds.
pub const LATENCY_BUCKETS: [f64; 16] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Largest HTTP request head the metrics endpoint reads.
pub const MAX_REQUEST_HEAD: usize = 8 * 1024;

/// How long a metrics client may take to send its request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

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

#[derive(Clone, Debug, Default)]
struct Histogram {
    /// Non-cumulative counts per bucket of [`LATENCY_BUCKETS`], then +Inf.
    buckets: [u64; LATENCY_BUCKETS.len() + 1],
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        let i = LATENCY_BUCKETS.iter().position(|b| seconds <= *b).unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i] += 1;
        self.sum += seconds;
        self.count += 1;
    }
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
}

/// The counters the services keep.
#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(Protocol, &'static str, Outcome), u64>>,
    latency: Mutex<BTreeMap<(Protocol, &'static str), Histogram>>,
    /// Reply frames sent to clients.
    pub reply_frames: AtomicU64,
    pub reloads: ReloadCounters,
    started: Instant,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            latency: Mutex::default(),
            reply_frames: AtomicU64::new(0),
            reloads: ReloadCounters::default(),
            started: Instant::now(),
        }
    }
}

impl Metrics {
    /// Counts one answered request.
    pub fn observe(&self, protocol: Protocol, op: &'static str, outcome: Outcome, took: Duration, reply_frames: usize) {
        *self.requests.lock().unwrap_or_else(|p| p.into_inner()).entry((protocol, op, outcome)).or_default() += 1;
        self.latency
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((protocol, op))
            .or_default()
            .observe(took.as_secs_f64());
        self.reply_frames.fetch_add(reply_frames as u64, Ordering::Relaxed);
    }

    /// Requests counted for (protocol, op), any outcome.
    pub fn requests(&self, protocol: Protocol, op: &str) -> u64 {
        let map = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        map.iter().filter(|((p, o, _), _)| *p == protocol && *o == op).map(|(_, n)| n).sum()
    }

    /// The whole exposition, Prometheus text format 0.0.4.
    pub fn render(&self, manager: &Manager, units: &[Arc<Unit>]) -> String {
        let mut t = Text::default();
        {
            let requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
            t.family("stowd_requests_total", "counter", "Requests answered, by protocol, op and outcome.");
            for ((p, op, o), n) in requests.iter() {
                t.sample("stowd_requests_total", &[("protocol", p.label()), ("op", op), ("outcome", o.label())], *n as f64);
            }
        }
        {
            let latency = self.latency.lock().unwrap_or_else(|p| p.into_inner());
            let name = "stowd_request_duration_seconds";
            t.family(name, "histogram", "Time from a decoded request to its encoded reply, seconds.");
            for ((p, op), h) in latency.iter() {
                let mut cumulative = 0;
                for (i, n) in h.buckets.iter().enumerate() {
                    cumulative += n;
                    let le = LATENCY_BUCKETS.get(i).map(|b| format_float(*b)).unwrap_or_else(|| "+Inf".into());
                    t.sample(&format!("{name}_bucket"), &[("protocol", p.label()), ("op", op), ("le", &le)], cumulative as f64);
                }
                t.sample(&format!("{name}_sum"), &[("protocol", p.label()), ("op", op)], h.sum);
                t.sample(&format!("{name}_count"), &[("protocol", p.label()), ("op", op)], h.count as f64);
            }
        }

        t.family("stowd_stored_bytes", "gauge", "Bytes of rows stored, by local unit.");
        for u in units {
            t.sample("stowd_stored_bytes", &[("unit", u.id())], u.stats().bytes as f64);
        }
        t.family("stowd_stored_rows", "gauge", "Global indexes stored, by local unit.");
        for u in units {
            t.sample("stowd_stored_rows", &[("unit", u.id())], u.stats().rows as f64);
        }
        t.family("stowd_stored_values", "gauge", "(global index, field) values stored, by local unit.");
        for u in units {
            t.sample("stowd_stored_values", &[("unit", u.id())], u.stats().keys as f64);
        }
        t.family("stowd_unit_capacity_bytes", "gauge", "Capacity of each bounded local unit, bytes.");
        for u in units {
            if let Some(c) = u.stats().capacity {
                t.sample("stowd_unit_capacity_bytes", &[("unit", u.id())], c as f64);
            }
        }

        let c = &manager.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        t.family("stowd_zero_copy_bytes_total", "counter", "Row bytes moved as views of received buffers (no copy).");
        t.sample("stowd_zero_copy_bytes_total", &[], get(&c.zero_copy_bytes));
        t.family("stowd_copied_bytes_total", "counter", "Row bytes copied (gathers, concatenations, coalesced frames).");
        t.sample("stowd_copied_bytes_total", &[], get(&c.copied_bytes));
        t.family("stowd_frames_sent_total", "counter", "ZeroMQ frames sent: to remote units, and in replies to clients.");
        t.sample("stowd_frames_sent_total", &[("to", "unit")], get(&c.frames_sent));
        t.sample("stowd_frames_sent_total", &[("to", "client")], get(&self.reply_frames));
        t.family("stowd_messages_sent_total", "counter", "Messages sent to remote units.");
        t.sample("stowd_messages_sent_total", &[], get(&c.messages_sent));
        t.family("stowd_policy_decisions_total", "counter", "Selection decisions, by who took them.");
        t.sample("stowd_policy_decisions_total", &[("by", "plugin")], get(&c.plugin_decisions));
        t.sample("stowd_policy_decisions_total", &[("by", "builtin")], get(&c.builtin_decisions));
        t.sample("stowd_policy_decisions_total", &[("by", "fallback")], get(&c.fallbacks));
        let remote = manager.targets().iter().filter(|t| matches!(t, Target::Remote(_))).count();
        t.family("stowd_remote_units", "gauge", "Remote units the router sends to.");
        t.sample("stowd_remote_units", &[], remote as f64);

        render_plugins(&mut t, &manager.registry());
        let r = &self.reloads;
        t.family("stowd_plugin_reloads_total", "counter", "Hot reloads of plugin files, by outcome.");
        t.sample("stowd_plugin_reloads_total", &[("outcome", "swapped")], get(&r.swapped));
        t.sample("stowd_plugin_reloads_total", &[("outcome", "refused")], get(&r.refused));
        t.sample("stowd_plugin_reloads_total", &[("outcome", "removed")], get(&r.removed));

        t.family("stowd_process_resident_memory_bytes", "gauge", "Resident set size of stowd.");
        t.sample("stowd_process_resident_memory_bytes", &[], process_rss_bytes() as f64);
        t.family("stowd_receive_pool_bytes", "gauge", "Bytes of freed large receive buffers kept for reuse.");
        t.sample("stowd_receive_pool_bytes", &[], crate::transport::ReceivePool::shared_bytes() as f64);
        t.family("stowd_uptime_seconds", "gauge", "Seconds since stowd started.");
        t.sample("stowd_uptime_seconds", &[], self.started.elapsed().as_secs_f64());
        t.out
    }
}

/// Per plugin version: calls, plans, faults, fallbacks, rejections, state.
fn render_plugins(t: &mut Text, registry: &Registry) {
    let versions = registry.version_stats();
    let families: [(&str, &str, &str, fn(&crate::policy::chain::PluginStats) -> u64); 7] = [
        ("stowd_plugin_calls_total", "counter", "Calls into a plugin version.", |s| s.calls.load(Ordering::Relaxed)),
        ("stowd_plugin_plans_total", "counter", "Valid plans a plugin version answered.", |s| s.plans.load(Ordering::Relaxed)),
        ("stowd_plugin_faults_total", "counter", "Faults of a plugin version (trap, timeout, memory, invalid plan, failed).", |s| {
            s.faults.load(Ordering::Relaxed)
        }),
        ("stowd_plugin_invalid_plans_total", "counter", "Plans of a plugin version that failed validation.", |s| {
            s.invalid_plans.load(Ordering::Relaxed)
        }),
        ("stowd_plugin_fallbacks_total", "counter", "Faults answered by the built-in (fail = fallback).", |s| {
            s.fallbacks.load(Ordering::Relaxed)
        }),
        ("stowd_plugin_rejections_total", "counter", "Faults that failed the request (fail = reject).", |s| {
            s.rejections.load(Ordering::Relaxed)
        }),
        ("stowd_plugin_reenables_total", "counter", "Times a disabled plugin version was re-enabled after its backoff.", |s| {
            s.reenables.load(Ordering::Relaxed)
        }),
    ];
    for (name, kind, help, value) in families {
        t.family(name, kind, help);
        for v in &versions {
            t.sample(name, &[("plugin", &v.name), ("version", &v.version)], value(&v.stats) as f64);
        }
    }
    t.family("stowd_plugin_disabled", "gauge", "1 while a plugin version is disabled after max_faults.");
    for v in &versions {
        let disabled = v.stats.disabled.load(Ordering::Relaxed);
        t.sample("stowd_plugin_disabled", &[("plugin", &v.name), ("version", &v.version)], disabled as u8 as f64);
    }
    t.family("stowd_plugin_live", "gauge", "1 if this plugin version is the live one of its name.");
    for v in &versions {
        t.sample("stowd_plugin_live", &[("plugin", &v.name), ("version", &v.version)], v.live as u8 as f64);
    }
}

/// A float as Prometheus writes it.
fn format_float(v: f64) -> String {
    if v.is_infinite() {
        return if v > 0.0 { "+Inf".into() } else { "-Inf".into() };
    }
    if v.is_nan() {
        return "NaN".into();
    }
    if v.fract() == 0.0 && v.abs() < 1e15 {
        return format!("{}", v as i64);
    }
    format!("{v}")
}

/// Label value escaping: backslash, double quote and newline.
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for ch in v.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// HELP text escaping: backslash and newline.
fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A text exposition being written.
#[derive(Default)]
struct Text {
    out: String,
}

impl Text {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {}", format_float(value));
    }
}

/// What the endpoint renders on each scrape.
pub trait Exposition: Send + Sync + 'static {
    fn render(&self) -> String;
}

impl<F: Fn() -> String + Send + Sync + 'static> Exposition for F {
    fn render(&self) -> String {
        self()
    }
}

/// Serves `GET /metrics` on `listener` until shutdown: one request per
/// connection (`Connection: close`), 404 for other paths, 405 for other
/// methods, 400 for a request head that is not HTTP/1.x or too large.
pub async fn serve_http(listener: TcpListener, exposition: Arc<dyn Exposition>, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let exposition = exposition.clone();
                    tokio::spawn(async move {
                        if let Err(e) = answer(stream, exposition.as_ref()).await {
                            tracing::debug!(error = %e, "metrics connection ended");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = shutdown.changed() => break,
        }
    }
}

async fn answer(mut stream: TcpStream, exposition: &dyn Exposition) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let complete = tokio::time::timeout(REQUEST_TIMEOUT, async {
        let mut buf = [0u8; 1024];
        loop {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Ok::<bool, std::io::Error>(false);
            }
            head.extend_from_slice(&buf[..n]);
            if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
                return Ok(true);
            }
            if head.len() > MAX_REQUEST_HEAD {
                return Ok(false);
            }
        }
    })
    .await;
    let (status, content_type, body) = match complete {
        Ok(Ok(true)) => route(&head, exposition),
        Ok(Ok(false)) if head.is_empty() => return Ok(()),
        Ok(Ok(false)) => ("400 Bad Request", "text/plain", "bad request\n".to_string()),
        Ok(Err(e)) => return Err(e),
        Err(_) => ("408 Request Timeout", "text/plain", "request timeout\n".to_string()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    if !head.starts_with(b"HEAD ") {
        stream.write_all(body.as_bytes()).await?;
    }
    stream.shutdown().await
}

fn route(head: &[u8], exposition: &dyn Exposition) -> (&'static str, &'static str, String) {
    let text = String::from_utf8_lossy(head);
    let line = text.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    if !version.is_some_and(|v| v.starts_with("HTTP/1.")) {
        return ("400 Bad Request", "text/plain", "bad request\n".into());
    }
    let path = target.unwrap_or_default().split('?').next().unwrap_or_default();
    match (method, path) {
        (Some("GET" | "HEAD"), "/metrics") => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", exposition.render()),
        (Some("GET" | "HEAD"), "/") => ("200 OK", "text/plain", "stowd: metrics at /metrics\n".into()),
        (Some("GET" | "HEAD"), _) => ("404 Not Found", "text/plain", "not found\n".into()),
        _ => ("405 Method Not Allowed", "text/plain", "method not allowed\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_and_text() {
        let mut h = Histogram::default();
        h.observe(0.00005);
        h.observe(0.003);
        h.observe(100.0);
        assert_eq!(h.buckets[0], 1);
        assert_eq!(h.buckets[5], 1);
        assert_eq!(h.buckets[LATENCY_BUCKETS.len()], 1);
        assert_eq!(h.count, 3);
        let mut t = Text::default();
        t.family("x_total", "counter", "a \\ b\nc");
        t.sample("x_total", &[("l", "q\"u\\o\nte")], 3.0);
        assert_eq!(t.out, "# HELP x_total a \\\\ b\\nc\n# TYPE x_total counter\nx_total{l=\"q\\\"u\\\\o\\nte\"} 3\n");
        assert_eq!(format_float(0.00025), "0.00025");
        assert_eq!(format_float(f64::INFINITY), "+Inf");
    }

    #[test]
    fn routes() {
        let e = || "body".to_string();
        assert_eq!(route(b"GET /metrics HTTP/1.1\r\n\r\n", &e).0, "200 OK");
        assert_eq!(route(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n", &e).2, "body");
        assert_eq!(route(b"GET /nope HTTP/1.1\r\n\r\n", &e).0, "404 Not Found");
        assert_eq!(route(b"POST /metrics HTTP/1.1\r\n\r\n", &e).0, "405 Method Not Allowed");
        assert_eq!(route(b"hello\r\n\r\n", &e).0, "400 Bad Request");
    }
}
