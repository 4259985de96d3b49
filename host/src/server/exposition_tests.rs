//! The endpoint over real TCP on 127.0.0.1, and the text of a real manager.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use super::*;
use crate::config::LimitsConfig;
use crate::metrics::{Outcome, Protocol};

/// An endpoint serving `body` (counting renders) on an ephemeral port.
async fn endpoint(body: &'static str) -> (String, Arc<AtomicU64>, watch::Sender<bool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let renders = Arc::new(AtomicU64::new(0));
    let counted = renders.clone();
    let render: Render = Arc::new(move || {
        counted.fetch_add(1, Ordering::Relaxed);
        body.to_string()
    });
    let (tx, rx) = watch::channel(false);
    tokio::spawn(serve(listener, render, None, rx));
    (addr, renders, tx)
}

/// Sends `request` raw and reads the reply to its end (blocking; run it
/// off the runtime).
fn exchange(addr: &str, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

async fn ask(addr: &str, request: &'static [u8]) -> String {
    let addr = addr.to_string();
    tokio::task::spawn_blocking(move || exchange(&addr, request))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_bearer_only_a_request_carrying_a_taken_token_is_answered() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let render: Render = Arc::new(|| "a_total 1\n".to_string());
    let tokens = Arc::new(crate::auth::Tokens::new("own", &["other".into()]));
    let (_stop, rx) = watch::channel(false);
    tokio::spawn(serve(listener, render, Some(tokens), rx));
    for (request, ok) in [
        (&b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"[..], false),
        (
            b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer wrong\r\n\r\n",
            false,
        ),
        (
            b"GET /metrics HTTP/1.1\r\nAuthorization: Basic b3du\r\n\r\n",
            false,
        ),
        (
            b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer own\r\n\r\n",
            true,
        ),
        (
            b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer other\r\n\r\n",
            true,
        ),
    ] {
        let got = ask(&addr, request).await;
        if ok {
            assert!(
                got.starts_with("HTTP/1.1 200 OK\r\n") && got.ends_with("a_total 1\n"),
                "{got}"
            );
        } else {
            assert!(got.starts_with("HTTP/1.1 401 Unauthorized\r\n"), "{got}");
            assert!(
                got.contains("www-authenticate: Bearer\r\n") && !got.contains("a_total"),
                "{got}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_methods_and_bad_requests() {
    let (addr, renders, _stop) = endpoint("a_total 1\n").await;
    let ok = ask(&addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
    assert!(
        ok.contains("content-type: text/plain; version=0.0.4; charset=utf-8\r\n"),
        "{ok}"
    );
    assert!(ok.contains("connection: close\r\n"), "{ok}");
    assert!(ok.ends_with("\r\n\r\na_total 1\n"), "{ok}");
    let query = ask(&addr, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n").await;
    assert!(
        query.starts_with("HTTP/1.0 200 OK\r\n") && query.ends_with("a_total 1\n"),
        "{query}"
    );
    let head = ask(&addr, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(
        head.starts_with("HTTP/1.1 200 OK\r\n") && head.ends_with("\r\n\r\n"),
        "{head}"
    );
    assert!(head.contains("content-length: 10\r\n"), "{head}");
    assert!(
        ask(&addr, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .starts_with("HTTP/1.1 404 Not Found\r\n")
    );
    let post = ask(
        &addr,
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    )
    .await;
    assert!(
        post.starts_with("HTTP/1.1 405 Method Not Allowed\r\n")
            && post.contains("allow: GET, HEAD\r\n"),
        "{post}"
    );
    assert_eq!(
        renders.load(Ordering::Relaxed),
        3,
        "rendered only for /metrics"
    );
    // Garbage, and a head larger than the limit: an error status, then close.
    let garbage = ask(&addr, b"\x00\x01hello there\r\n\r\n").await;
    assert!(
        garbage.starts_with("HTTP/1.1 400 Bad Request\r\n"),
        "{garbage:?}"
    );
    let big: &'static [u8] = Box::leak(
        format!(
            "GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n",
            "y".repeat(MAX_REQUEST_HEAD * 2)
        )
        .into_bytes()
        .into(),
    );
    let too_big = ask(&addr, big).await;
    assert!(too_big.starts_with("HTTP/1.1 431 "), "{too_big:?}");
    assert_eq!(renders.load(Ordering::Relaxed), 3);
    // It still answers.
    assert!(
        ask(&addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .ends_with("a_total 1\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_blocks_no_other_scrape() {
    let (addr, _, _stop) = endpoint("a_total 1\n").await;
    // Three clients that connect and send half a head, then nothing.
    let silent: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(b"GET /metr").unwrap();
            s
        })
        .collect();
    let started = Instant::now();
    for _ in 0..5 {
        assert!(
            ask(&addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .ends_with("a_total 1\n")
        );
    }
    assert!(
        started.elapsed() < REQUEST_TIMEOUT / 2,
        "scrapes waited {:?}",
        started.elapsed()
    );
    drop(silent);
}

#[test]
fn render_writes_the_families_of_a_real_manager() {
    let registry = Registry::new(None, Default::default()).unwrap();
    let unit = Arc::new(Unit::new("u\"0", Some(1 << 20)));
    let manager = Manager::new(
        vec![Target::Local(unit.clone())],
        Arc::new(registry),
        LimitsConfig::default(),
        Duration::ZERO,
        "t".into(),
    );
    manager
        .counters
        .copied_bytes
        .fetch_add(7, Ordering::Relaxed);
    let metrics = Metrics::default();
    let before = render(&metrics, &manager, std::slice::from_ref(&unit));
    assert!(
        !before.contains("stowd_requests_total"),
        "an empty family is left out:\n{before}"
    );
    metrics.observe(
        Protocol::Native,
        "put",
        Outcome::Ok,
        Duration::from_micros(300),
        2,
    );
    metrics.observe(
        Protocol::Native,
        "put",
        Outcome::Ok,
        Duration::from_secs(20),
        1,
    );
    let text = render(&metrics, &manager, std::slice::from_ref(&unit));
    for want in [
        "# HELP stowd_requests_total Requests answered, by protocol, op and outcome.\n\
         # TYPE stowd_requests_total counter\n\
         stowd_requests_total{protocol=\"native\",op=\"put\",outcome=\"ok\"} 2\n",
        "# TYPE stowd_request_duration_seconds histogram\n\
         stowd_request_duration_seconds_bucket{protocol=\"native\",op=\"put\",le=\"0.0001\"} 0\n",
        "stowd_request_duration_seconds_bucket{protocol=\"native\",op=\"put\",le=\"0.0005\"} 1\n",
        "stowd_request_duration_seconds_bucket{protocol=\"native\",op=\"put\",le=\"10\"} 1\n\
         stowd_request_duration_seconds_bucket{protocol=\"native\",op=\"put\",le=\"+Inf\"} 2\n\
         stowd_request_duration_seconds_sum{protocol=\"native\",op=\"put\"} 20.0003\n\
         stowd_request_duration_seconds_count{protocol=\"native\",op=\"put\"} 2\n",
        "stowd_unit_capacity_bytes{unit=\"u\\\"0\"} 1048576\n",
        "stowd_copied_bytes_total 7\n",
        "stowd_frames_sent_total{to=\"client\"} 3\n",
        "# HELP stowd_process_resident_memory_bytes Resident set size of stowd.\n\
         # TYPE stowd_process_resident_memory_bytes gauge\n",
        "stowd_plugin_reloads_total{outcome=\"refused\"} 0\n",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
}
