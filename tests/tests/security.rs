//! Who may talk to stowd across hosts, with a network namespace standing
//! in for another host: the test process reaches a `stowd` in namespace
//! `n` over a veth (10.76.x.1 here, 10.76.x.2 there; a block no other
//! test of this binary uses, since they run at once), so stowd sees a
//! connection from a non-loopback address.
//!
//! - `[security] auth = "token"`: the native endpoint refuses a client
//!   without the token or with a wrong one at the handshake, and serves one
//!   with it (a put and a get of the same rows);
//! - `[security] auth = "curve"`: the native endpoint takes a client with
//!   stowd's client key and refuses one with a key not allowed, with the
//!   wrong server key, or speaking NULL or PLAIN; the row put crosses the
//!   wire only encrypted (a relay records every byte); a router stowd here
//!   whose units are the namespace stowd's reaches them over CURVE;
//! - `[security] tq_endpoints = "loopback"` (the default): a TransferQueue
//!   unit endpoint bound to every address closes a connection from the
//!   other host before the handshake; `"open"` serves it.
//!
//! Needs root and `ip`; a guard removes the namespace and link.

use std::time::Duration;

use stowage_host::batch::Field;
use stowage_host::wire::{native, tq};
use stowage_tests::data::{assert_cells, cells, f32_rows, wire_cells};
use stowage_tests::netns::{self, Netns};
use stowage_tests::{NativeClient, Stowd, temp_dir};

/// Namespace `n` and a veth from here to it; removed on drop.
struct Host {
    ns: Netns,
    link: String,
    subnet: u8,
}

impl Host {
    fn create() -> Result<Host, String> {
        netns::available()?;
        let made = netns::creating();
        let tag = format!("{:05}", (std::process::id() * 4 + *made) % 100_000);
        let subnet = netns::free_subnets("10.76", 1)?;
        let host = Host {
            ns: Netns::add(&format!("stowage-sec-{tag}"))?,
            link: format!("sts{tag}h"),
            subnet,
        };
        netns::veth(
            &netns::End {
                ns: None,
                name: &host.link,
                addr: &format!("10.76.{subnet}.1/24"),
            },
            &netns::End {
                ns: Some(&host.ns.name),
                name: &format!("sts{tag}n"),
                addr: &format!("10.76.{subnet}.2/24"),
            },
        )?;
        Ok(host)
    }

    fn addr(&self) -> String {
        format!("10.76.{}.2", self.subnet)
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        netns::del_link(&self.link);
    }
}

/// A stowd in the namespace, bound to every address there.
fn config(token_file: &std::path::Path, tq_endpoints: &str) -> String {
    format!(
        "[server]\nhost = \"0.0.0.0\"\n\n[units]\nlocal = 1\n\n[shm]\nenabled = false\n\n\
         [security]\nauth = \"token\"\ntoken_file = {:?}\ntq_endpoints = {tq_endpoints:?}\n",
        token_file.display().to_string()
    )
}

/// The same endpoint at the namespace's address.
fn there(endpoint: &str, host: &Host) -> String {
    let port = endpoint.rsplit(':').next().expect("a port");
    format!("tcp://{}:{port}", host.addr())
}

/// A TransferQueue GET_METRICS from here to `endpoint`: its reply, or why
/// none came.
async fn tq_metrics(endpoint: &str, unit: &str) -> Result<tq::Reply, String> {
    let peer = stowage_host::transport::Peer::new(endpoint, "TQ_STORAGE_sec_test");
    let frames = tq::encode_request("TQ_STORAGE_sec_test", Some(unit), &tq::Request::GetMetrics)
        .map_err(|e| e.to_string())?;
    let reply = peer
        .request(frames, Duration::from_secs(3))
        .await
        .map_err(|e| e.to_string())?;
    tq::decode_reply(&reply)
        .map(|(_, r)| r)
        .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_hosts_the_token_is_required_and_tq_endpoints_are_loopback_only() {
    let host = match Host::create() {
        Ok(h) => h,
        Err(why) => panic!("network namespaces are needed for this test: {why}"),
    };
    let dir = temp_dir("security-netns");
    let token_file = dir.join("state").join("token");
    let s = Stowd::start_in_netns(&host.ns.name, &config(&token_file, "loopback"));
    let token = s
        .endpoints
        .token
        .clone()
        .expect("the endpoints file has the token");
    assert_eq!(std::fs::read_to_string(&token_file).unwrap().trim(), token);
    let native = there(s.native(), &host);

    let mut anonymous = NativeClient::without_token(&native);
    anonymous.timeout = Duration::from_secs(5);
    let e = anonymous.try_call(native::Op::Stats).await.unwrap_err();
    assert!(e.contains("requires stowd's token"), "{e}");
    let mut wrong = NativeClient::with_token(&native, "not-the-token");
    wrong.timeout = Duration::from_secs(5);
    let e = wrong.try_call(native::Op::Stats).await.unwrap_err();
    assert!(e.contains("wrong or missing token"), "{e}");

    let c = NativeClient::with_token(&native, &token);
    let a = Field::Regular(f32_rows(3, 4, 9));
    c.put_ok(&[4, 5, 6], &[("a".into(), a.clone())]).await;
    let mut got = c.get_ok(&[4, 5, 6], &["a"]).await;
    assert_cells("across hosts", &wire_cells(got.remove(0).1), &cells(&a));

    // The unit endpoint takes loopback connections only: from here, none.
    let unit = s.unit(0).clone();
    let e = tq_metrics(&there(&unit.endpoint, &host), &unit.id)
        .await
        .unwrap_err();
    // Closed before the handshake: a reset, an end of stream, or no reply.
    let closed = ["reset", "clos", "timed out"];
    assert!(closed.iter().any(|w| e.to_lowercase().contains(w)), "{e}");
    drop(s);

    // "open": the same request is answered.
    let s = Stowd::start_in_netns(&host.ns.name, &config(&token_file, "open"));
    assert_eq!(
        s.endpoints.token.as_deref(),
        Some(token.as_str()),
        "the same token"
    );
    let unit = s.unit(0).clone();
    let reply = match tq_metrics(&there(&unit.endpoint, &host), &unit.id).await {
        Ok(r) => r,
        Err(e) => panic!(
            "an open unit endpoint did not answer another host: {e}\n{}",
            s.log()
        ),
    };
    assert!(matches!(reply, tq::Reply::Metrics(_)), "{reply:?}");
}

/// A tcp relay on 127.0.0.1 to `to`: its address, and every byte it
/// carried either way.
async fn recording_relay(to: String) -> (String, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let server = tokio::net::TcpStream::connect(&to).await.unwrap();
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            for (mut r, mut w, seen) in [
                (
                    Box::new(cr) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                    Box::new(sw) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                    record.clone(),
                ),
                (Box::new(sr), Box::new(cw), record.clone()),
            ] {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 1 << 16];
                    while let Ok(n) = r.read(&mut buf).await {
                        if n == 0 || w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        seen.lock().unwrap().extend_from_slice(&buf[..n]);
                    }
                });
            }
        }
    });
    (format!("tcp://{addr}"), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_hosts_curve_takes_only_allowed_keys_and_carries_rows_encrypted() {
    use stowage_host::auth::curve::{read_pair, read_public};
    use stowage_host::transport::curve::Keypair;
    let host = match Host::create() {
        Ok(h) => h,
        Err(why) => panic!("network namespaces are needed for this test: {why}"),
    };
    let dir = temp_dir("security-curve");
    let curve_dir = dir.join("curve");
    let there_config = format!(
        "[server]\nhost = \"0.0.0.0\"\n\n[units]\nlocal = 2\n\n[router]\nenabled = false\n\n\
         [shm]\nenabled = false\n\n[security]\nauth = \"curve\"\ncurve_dir = {:?}\n",
        curve_dir.display().to_string()
    );
    let s = Stowd::start_in_netns(&host.ns.name, &there_config);
    let server = read_public(&curve_dir.join("server.key")).unwrap();
    let client = read_pair(&curve_dir.join("client.key_secret"))
        .unwrap()
        .unwrap();
    assert_eq!(
        s.endpoints.curve_server_key.as_deref(),
        Some(stowage_host::transport::curve::z85_encode(&server).as_str()),
        "the endpoints file names the server key"
    );
    let native = there(s.native(), &host);

    // A key not allowed, the wrong server key, NULL and PLAIN: refused.
    let stranger = Keypair::generate().unwrap();
    let refused = [
        (
            NativeClient::with_curve(&native, stranger, server),
            "client key not allowed",
        ),
        (
            NativeClient::with_curve(
                &native,
                client.clone(),
                *Keypair::generate().unwrap().public(),
            ),
            "HELLO did not decrypt",
        ),
        (NativeClient::without_token(&native), "requires CURVE"),
        (
            NativeClient::with_token(&native, "a-token"),
            "requires CURVE",
        ),
    ];
    for (mut c, why) in refused {
        c.timeout = Duration::from_secs(5);
        let e = c.try_call(native::Op::Stats).await.unwrap_err();
        assert!(e.contains(why), "{why}: {e}");
    }
    let log = s.log();
    assert!(log.contains("connection refused at the handshake"), "{log}");
    assert!(!log.contains(&stowage_host::transport::curve::z85_encode(
        &client.secret_bytes()
    )));

    // Through a relay that records the wire: the rows go and come back
    // intact, and never in the clear.
    let (relay, seen) = recording_relay(native.trim_start_matches("tcp://").to_string()).await;
    let c = NativeClient::with_curve(&relay, client.clone(), server);
    let a = Field::Regular(f32_rows(2, 2048, 777_000));
    c.put_ok(&[7, 8], &[("a".into(), a.clone())]).await;
    let mut got = c.get_ok(&[7, 8], &["a"]).await;
    assert_cells("over CURVE", &wire_cells(got.remove(0).1), &cells(&a));
    let wire = seen.lock().unwrap().clone();
    let clear: Vec<u8> = (0..64u32)
        .flat_map(|c| ((777_000 + c) as f32).to_le_bytes())
        .collect();
    assert!(
        wire.len() > 2 * 4 * 4096,
        "the relay carried the rows: {} bytes",
        wire.len()
    );
    assert!(
        !wire.windows(clear.len()).any(|w| w == clear),
        "the row crossed the wire in the clear"
    );

    // A router stowd here whose units are the namespace stowd's, sharing
    // its curve_dir: it connects to its peer over CURVE.
    let router = Stowd::start(&format!(
        "[units]\nlocal = 0\n\n[router]\nunits = [\"stowage://{addr}:{port}/0\", \"stowage://{addr}:{port}/1\"]\n\n\
         [shm]\nenabled = false\n\n[security]\nauth = \"curve\"\ncurve_dir = {:?}\n",
        curve_dir.display().to_string(),
        addr = host.addr(),
        port = native.rsplit(':').next().unwrap(),
    ));
    let via = NativeClient::with_curve(router.native(), client, server);
    let b = Field::Regular(f32_rows(4, 8, 3));
    via.put_ok(&[0, 1, 2, 3], &[("b".into(), b.clone())]).await;
    let mut got = c.get_ok(&[0, 1, 2, 3], &["b"]).await;
    assert_cells(
        "put through the router, read at the units",
        &wire_cells(got.remove(0).1),
        &cells(&b),
    );
}

/// A free tcp port on this host (bound, then let go).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("an ephemeral port")
}

/// `GET /metrics` to `addr` with `auth` as its Authorization header, if
/// any: the reply's status line.
fn scrape(addr: &str, auth: Option<&str>) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to /metrics");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let header = auth.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n{header}\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.lines().next().unwrap_or_default().to_string()
}

#[test]
fn metrics_beyond_loopback_take_only_a_bearer_token() {
    let port = free_port();
    let open = format!("[metrics]\nhost = \"0.0.0.0\"\nport = {port}\n");
    let e = Stowd::try_start(&format!("{open}\n[security]\nauth = \"none\"\n")).unwrap_err();
    assert!(e.contains("is not a loopback address"), "{e}");

    let dir = temp_dir("security-metrics");
    let token_file = dir.join("token");
    let s = Stowd::start(&format!(
        "{open}\n[security]\ntoken_file = {:?}\n",
        token_file.display().to_string()
    ));
    let token = s.endpoints.token.clone().expect("a token");
    let addr = format!("127.0.0.1:{port}");
    assert!(scrape(&addr, None).contains("401"));
    assert!(scrape(&addr, Some("Bearer not-the-token")).contains("401"));
    assert!(scrape(&addr, Some(&format!("Bearer {token}"))).contains("200 OK"));
}
