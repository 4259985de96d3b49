//! The `/metrics` endpoint: the Prometheus text exposition (format 0.0.4)
//! of the counters in [`crate::metrics`] and of the figures read from the
//! units, the manager, the plugin registry and the process at scrape time,
//! served over HTTP/1.1 by hyper.
//!
//! The text is written by the `prometheus` crate's `TextEncoder` (escaping,
//! number formatting, histogram `_bucket`/`_sum`/`_count` series with
//! `le="+Inf"`). Its metric types (`IntCounterVec`, `HistogramVec`, a
//! `Registry`) are not used: most series are figures owned elsewhere (unit
//! sizes, plugin counters kept per version across reloads, the manager's
//! data-path atomics) and read once per scrape, so every scrape builds its
//! `MetricFamily` values afresh and hands them to the encoder. The encoder
//! refuses a family with no series, so such a family (no request answered
//! yet, no bounded unit) is left out until it has one, as Prometheus' own
//! client libraries do; a query cannot tell the difference.
//!
//! HTTP: `GET` (or `HEAD`) `/metrics` answers the exposition, `/` a pointer
//! to it, any other path 404, any other method 405. The endpoint runs on a
//! thread of its own ([`spawn`]): on the main runtime a scrape waited
//! behind queued data-path tasks (with 16 clients putting and getting, the
//! median scrape went from 14.8 ms there to 2.3 ms on its own thread, debug
//! build, `bench/metrics_scrape.py`, `docs/benchmarks.md`). Each connection
//! is served by its own task, one request per connection (`Connection:
//! close`, as before hyper). A request that is not HTTP/1.x is answered 400
//! by hyper, a head over [`MAX_REQUEST_HEAD`] 431, and a client that has
//! not sent its whole head within [`REQUEST_TIMEOUT`] is disconnected; a
//! slow or silent client holds only its own task, never another scrape.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, AUTHORIZATION, CONTENT_TYPE, HeaderValue, WWW_AUTHENTICATE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::manager::{Manager, Target};
use crate::metrics::{LATENCY_BUCKETS, Metrics};
use crate::policy::chain::PluginStats;
use crate::policy::registry::Registry;
use crate::store::Unit;

/// Largest HTTP request head the endpoint reads (hyper's smallest buffer).
pub const MAX_REQUEST_HEAD: usize = 8 * 1024;

/// How long a client may take to send its request head.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The content type of the exposition.
pub const CONTENT_TYPE_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What the endpoint renders on each scrape.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// The families of one exposition, in the order they are written.
#[derive(Default)]
struct Families(Vec<MetricFamily>);

impl Families {
    /// Starts a family; its samples follow with [`Families::sample`].
    fn family(&mut self, name: &str, kind: MetricType, help: &str) {
        let mut f = MetricFamily::default();
        f.set_name(name.into());
        f.set_help(help.into());
        f.set_field_type(kind);
        self.0.push(f);
    }

    /// A counter or gauge sample of the family started last.
    fn sample(&mut self, labels: &[(&str, &str)], value: f64) {
        let f = self.0.last_mut().expect("a family started");
        let mut m = proto::Metric::from_label(label_pairs(labels));
        match f.get_field_type() {
            MetricType::COUNTER => {
                let mut c = proto::Counter::default();
                c.set_value(value);
                m.set_counter(c);
            }
            _ => {
                let mut g = proto::Gauge::default();
                g.set_value(value);
                m.set_gauge(g);
            }
        }
        f.mut_metric().push(m);
    }

    /// A histogram sample of the family started last.
    fn histogram(&mut self, labels: &[(&str, &str)], h: &crate::metrics::Histogram) {
        let f = self.0.last_mut().expect("a family started");
        let mut cumulative = 0;
        let mut buckets = Vec::with_capacity(LATENCY_BUCKETS.len());
        for (bound, n) in LATENCY_BUCKETS.iter().zip(h.buckets.iter()) {
            cumulative += n;
            let mut b = proto::Bucket::default();
            b.set_upper_bound(*bound);
            b.set_cumulative_count(cumulative);
            buckets.push(b);
        }
        let mut p = proto::Histogram::default();
        p.set_bucket(buckets);
        p.set_sample_count(h.count);
        p.set_sample_sum(h.sum);
        let mut m = proto::Metric::from_label(label_pairs(labels));
        m.set_histogram(p);
        f.mut_metric().push(m);
    }

    /// The text exposition; families with no series are left out.
    fn encode(mut self) -> String {
        self.0.retain(|f| !f.get_metric().is_empty());
        let mut out = String::with_capacity(16 * 1024);
        if let Err(e) = prometheus::TextEncoder::new().encode_utf8(&self.0, &mut out) {
            tracing::error!(error = %e, "metrics exposition not encoded");
        }
        out
    }
}

fn label_pairs(labels: &[(&str, &str)]) -> Vec<LabelPair> {
    labels
        .iter()
        .map(|(k, v)| {
            let mut l = LabelPair::default();
            l.set_name((*k).into());
            l.set_value((*v).into());
            l
        })
        .collect()
}

/// The whole exposition, Prometheus text format 0.0.4.
pub fn render(metrics: &Metrics, manager: &Manager, units: &[Arc<Unit>]) -> String {
    use MetricType::{COUNTER, GAUGE, HISTOGRAM};
    let mut t = Families::default();
    let snapshot = metrics.snapshot();
    t.family(
        "stowd_requests_total",
        COUNTER,
        "Requests answered, by protocol, op and outcome.",
    );
    for ((p, op, o), n) in &snapshot.requests {
        t.sample(
            &[("protocol", p.label()), ("op", op), ("outcome", o.label())],
            *n as f64,
        );
    }
    let name = "stowd_request_duration_seconds";
    t.family(
        name,
        HISTOGRAM,
        "Time from a decoded request to its encoded reply, seconds.",
    );
    for ((p, op), h) in &snapshot.latency {
        t.histogram(&[("protocol", p.label()), ("op", op)], h);
    }

    let stats: Vec<_> = units.iter().map(|u| (u.id(), u.stats())).collect();
    t.family(
        "stowd_stored_bytes",
        GAUGE,
        "Bytes of rows stored, by local unit.",
    );
    for (id, s) in &stats {
        t.sample(&[("unit", id)], s.bytes as f64);
    }
    t.family(
        "stowd_stored_rows",
        GAUGE,
        "Global indexes stored, by local unit.",
    );
    for (id, s) in &stats {
        t.sample(&[("unit", id)], s.rows as f64);
    }
    t.family(
        "stowd_stored_values",
        GAUGE,
        "(global index, field) values stored, by local unit.",
    );
    for (id, s) in &stats {
        t.sample(&[("unit", id)], s.keys as f64);
    }
    t.family(
        "stowd_unit_capacity_bytes",
        GAUGE,
        "Capacity of each bounded local unit, bytes.",
    );
    for (id, s) in &stats {
        if let Some(c) = s.capacity {
            t.sample(&[("unit", id)], c as f64);
        }
    }

    let c = &manager.counters;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
    t.family(
        "stowd_zero_copy_bytes_total",
        COUNTER,
        "Row bytes moved as views of received buffers (no copy).",
    );
    t.sample(&[], get(&c.zero_copy_bytes));
    t.family(
        "stowd_copied_bytes_total",
        COUNTER,
        "Row bytes copied (gathers, concatenations, coalesced frames).",
    );
    t.sample(&[], get(&c.copied_bytes));
    t.family(
        "stowd_frames_sent_total",
        COUNTER,
        "ZeroMQ frames sent: to remote units, and in replies to clients.",
    );
    t.sample(&[("to", "unit")], get(&c.frames_sent));
    t.sample(&[("to", "client")], get(&metrics.reply_frames));
    t.family(
        "stowd_messages_sent_total",
        COUNTER,
        "Messages sent to remote units.",
    );
    t.sample(&[], get(&c.messages_sent));
    t.family(
        "stowd_policy_decisions_total",
        COUNTER,
        "Selection decisions, by who took them.",
    );
    t.sample(&[("by", "plugin")], get(&c.plugin_decisions));
    t.sample(&[("by", "builtin")], get(&c.builtin_decisions));
    t.sample(&[("by", "fallback")], get(&c.fallbacks));
    t.family(
        "stowd_gets_forwarded_total",
        COUNTER,
        "Gets of peer units' rows sent on to the client while they arrived.",
    );
    t.sample(&[], get(&c.gets_forwarded));
    t.family(
        "stowd_gets_forward_dropped_total",
        COUNTER,
        "Forwarded gets whose reply could not be finished (the peer's reply failed after the client's began, or the client left): the client's connection was closed.",
    );
    t.sample(&[], get(&c.gets_forward_dropped));
    t.family(
        "stowd_same_node_gets_inline_total",
        COUNTER,
        "Same-node gets answered over the socket, their rows under [shm] inline_below bytes.",
    );
    t.sample(&[], get(&c.same_node_gets_inline));
    let remote = manager
        .targets()
        .iter()
        .filter(|t| matches!(t, Target::Remote(_) | Target::Peer(_)))
        .count();
    t.family(
        "stowd_remote_units",
        GAUGE,
        "Remote units the router sends to.",
    );
    t.sample(&[], remote as f64);
    let d = &manager.dedup_counters;
    t.family(
        "stowd_dedup_rows_total",
        COUNTER,
        "Rows stored once because a put held a byte-identical row of the same field ([dedup] fields).",
    );
    t.sample(&[], get(&d.rows));
    t.family(
        "stowd_dedup_bytes_total",
        COUNTER,
        "Bytes of those rows: not stored again.",
    );
    t.sample(&[], get(&d.bytes));
    t.family(
        "stowd_dedup_scanned_bytes_total",
        COUNTER,
        "Row bytes hashed to find duplicates.",
    );
    t.sample(&[], get(&d.scanned_bytes));
    t.family(
        "stowd_dedup_seconds_total",
        COUNTER,
        "Time spent finding and storing duplicates once, seconds.",
    );
    t.sample(&[], get(&d.ns) / 1e9);
    if let Some(cache) = manager.cache() {
        let k = &cache.counters;
        t.family(
            "stowd_cache_rows_total",
            COUNTER,
            "(field, row) values of peer units a get needed, by how they were had: \
             hit (kept here at their version), shared (another get's transfer in flight), \
             miss (fetched).",
        );
        t.sample(&[("outcome", "hit")], get(&k.hits));
        t.sample(&[("outcome", "shared")], get(&k.shared));
        t.sample(&[("outcome", "miss")], get(&k.misses));
        t.family(
            "stowd_cache_saved_bytes_total",
            COUNTER,
            "Bytes of peer units' rows served without fetching them again (hits and shared).",
        );
        t.sample(&[], get(&k.saved_bytes));
        t.family(
            "stowd_cache_fetched_bytes_total",
            COUNTER,
            "Bytes of rows fetched from peer units.",
        );
        t.sample(&[], get(&k.fetched_bytes));
        t.family(
            "stowd_cache_bytes",
            GAUGE,
            "Bytes of peer units' rows kept in the read cache.",
        );
        t.sample(&[], cache.bytes() as f64);
        t.family(
            "stowd_cache_held_bytes",
            GAUGE,
            "Bytes of fetches no longer kept that replies still hold, counted against the bound.",
        );
        t.sample(&[], cache.held_bytes() as f64);
        t.family(
            "stowd_cache_max_bytes",
            GAUGE,
            "The read cache's bound, bytes ([cache] max_bytes).",
        );
        t.sample(&[], cache.max_bytes() as f64);
        t.family(
            "stowd_cache_evictions_total",
            COUNTER,
            "Fetches dropped from the read cache to stay under its bound.",
        );
        t.sample(&[], get(&k.evictions));
    }

    plugins(&mut t, &manager.registry());
    let r = &metrics.reloads;
    t.family(
        "stowd_plugin_reloads_total",
        COUNTER,
        "Hot reloads of plugin files, by outcome.",
    );
    t.sample(&[("outcome", "swapped")], get(&r.swapped));
    t.sample(&[("outcome", "refused")], get(&r.refused));
    t.sample(&[("outcome", "removed")], get(&r.removed));
    t.family(
        "stowd_chain_missing_entries",
        GAUGE,
        "Chain entries that name no live plugin with the capability their list needs.",
    );
    t.sample(&[], get(&r.missing_chain_entries));

    t.family(
        "stowd_process_resident_memory_bytes",
        GAUGE,
        "Resident set size of stowd.",
    );
    t.sample(&[], crate::sys::process_rss_bytes() as f64);
    t.family(
        "stowd_receive_pool_bytes",
        GAUGE,
        "Bytes of pages of freed large receive buffers kept for reuse.",
    );
    t.sample(&[], crate::transport::ReceivePool::shared_bytes() as f64);
    let pool = crate::transport::ReceivePool::shared_counters();
    t.family(
        "stowd_receive_pool_frames_total",
        MetricType::COUNTER,
        "Frames of 1 MiB or more received: wholly into kept pages (result=\"hit\") or partly or wholly into fresh memory (result=\"miss\").",
    );
    t.sample(
        &[("result", "hit")],
        pool.hits.load(Ordering::Relaxed) as f64,
    );
    t.sample(
        &[("result", "miss")],
        pool.misses.load(Ordering::Relaxed) as f64,
    );
    t.family(
        "stowd_receive_pool_freed_bytes_total",
        MetricType::COUNTER,
        "Bytes of kept receive pages freed: the pool was full ([limits] receive_pool_bytes) or they sat idle.",
    );
    t.sample(&[], pool.freed_bytes.load(Ordering::Relaxed) as f64);
    t.family(
        "stowd_policy_seconds_total",
        MetricType::COUNTER,
        "Seconds spent deciding plans (plugins, validation, built-in): against \
         stowd_request_duration_seconds_sum, the share of request time in policies.",
    );
    t.sample(&[], crate::policy::chain::policy_ns() as f64 / 1e9);
    t.family(
        "stowd_uptime_seconds",
        GAUGE,
        "Seconds since stowd started.",
    );
    t.sample(&[], metrics.uptime().as_secs_f64());
    t.encode()
}

/// Per plugin version: calls, plans, faults, fallbacks, rejections, state.
fn plugins(t: &mut Families, registry: &Registry) {
    let versions = registry.version_stats();
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    type Counter = fn(&PluginStats) -> &AtomicU64;
    let families: [(&str, &str, Counter); 9] = [
        (
            "stowd_plugin_calls_total",
            "Decisions asked of a plugin version (one per field and unit of a selection, one per packing).",
            |s| &s.calls,
        ),
        (
            "stowd_plugin_entries_total",
            "Times the host entered a plugin version (a 0.2.0 plugin answers a request's decisions in one entry).",
            |s| &s.entries,
        ),
        (
            "stowd_plugin_memo_hits_total",
            "Decisions of a pure plugin version answered from its memo, without a call.",
            |s| &s.memo_hits,
        ),
        (
            "stowd_plugin_plans_total",
            "Valid plans a plugin version answered.",
            |s| &s.plans,
        ),
        (
            "stowd_plugin_faults_total",
            "Faults of a plugin version (trap, timeout, memory, invalid plan, failed).",
            |s| &s.faults,
        ),
        (
            "stowd_plugin_invalid_plans_total",
            "Plans of a plugin version that failed validation.",
            |s| &s.invalid_plans,
        ),
        (
            "stowd_plugin_fallbacks_total",
            "Faults answered by the built-in (fail = fallback).",
            |s| &s.fallbacks,
        ),
        (
            "stowd_plugin_rejections_total",
            "Faults that failed the request (fail = reject).",
            |s| &s.rejections,
        ),
        (
            "stowd_plugin_reenables_total",
            "Times a disabled plugin version was re-enabled after its backoff.",
            |s| &s.reenables,
        ),
    ];
    for (name, help, counter) in families {
        t.family(name, MetricType::COUNTER, help);
        for v in &versions {
            t.sample(
                &[("plugin", &v.name), ("version", &v.version)],
                load(counter(&v.stats)) as f64,
            );
        }
    }
    t.family(
        "stowd_plugin_call_seconds_total",
        MetricType::COUNTER,
        "Seconds spent in calls into a plugin version (the host's side of each call included).",
    );
    for v in &versions {
        t.sample(
            &[("plugin", &v.name), ("version", &v.version)],
            load(&v.stats.call_ns) as f64 / 1e9,
        );
    }
    t.family(
        "stowd_plugin_disabled",
        MetricType::GAUGE,
        "1 while a plugin version is disabled after max_faults.",
    );
    for v in &versions {
        let disabled = v.stats.disabled.load(Ordering::Relaxed);
        t.sample(
            &[("plugin", &v.name), ("version", &v.version)],
            disabled as u8 as f64,
        );
    }
    t.family(
        "stowd_plugin_live",
        MetricType::GAUGE,
        "1 if this plugin version is the live one of its name.",
    );
    for v in &versions {
        t.sample(
            &[("plugin", &v.name), ("version", &v.version)],
            v.live as u8 as f64,
        );
    }
}

/// Serves the endpoint on a thread of its own (a single-threaded runtime on
/// a thread of the blocking pool) until shutdown, so that a scrape waits
/// for no data-path task queued on the main runtime's workers.
/// Who may scrape: everyone (bound to loopback), or only a request
/// carrying `Authorization: Bearer <token>` with a token `tokens` takes.
pub type Bearer = Option<Arc<crate::auth::Tokens>>;

pub fn spawn(
    listener: std::net::TcpListener,
    render: Render,
    bearer: Bearer,
    shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::task::spawn_blocking(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(r) => r,
            Err(e) => return tracing::error!(error = %e, "no runtime for the metrics endpoint"),
        };
        runtime.block_on(async move {
            let listener = listener
                .set_nonblocking(true)
                .and_then(|()| TcpListener::from_std(listener));
            match listener {
                Ok(l) => serve(l, render, bearer, shutdown).await,
                Err(e) => tracing::error!(error = %e, "metrics endpoint not served"),
            }
        });
    })
}

/// Serves the endpoint on `listener` until shutdown.
pub async fn serve(
    listener: TcpListener,
    render: Render,
    bearer: Bearer,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(REQUEST_TIMEOUT)
        .max_buf_size(MAX_REQUEST_HEAD)
        .keep_alive(false);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let (render, bearer) = (render.clone(), bearer.clone());
                    let service = service_fn(move |req| {
                        let response = respond(&req, &render, bearer.as_deref());
                        async move { Ok::<_, Infallible>(response) }
                    });
                    let connection = http.serve_connection(TokioIo::new(stream), service);
                    tokio::spawn(async move {
                        if let Err(e) = connection.await {
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

fn respond(
    req: &Request<Incoming>,
    render: &Render,
    bearer: Option<&crate::auth::Tokens>,
) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
        *r.status_mut() = status;
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        r
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    if let Some(tokens) = bearer {
        use crate::transport::zmtp::Authenticator;
        let presented = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if presented.is_none_or(|t| tokens.authenticate(b"", t.as_bytes()).is_err()) {
            let mut r = text(
                StatusCode::UNAUTHORIZED,
                "this endpoint takes Authorization: Bearer <stowd's token>\n",
            );
            r.headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return r;
        }
    }
    match req.uri().path() {
        "/metrics" => {
            let mut r = Response::new(Full::new(Bytes::from(render())));
            r.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE_TEXT));
            r
        }
        "/" => text(StatusCode::OK, "stowd: metrics at /metrics\n"),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

#[cfg(test)]
#[path = "exposition_tests.rs"]
mod tests;
