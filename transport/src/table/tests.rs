//! The table over real sockets: a ROUTER served by [`crate::serve_with`]
//! on 127.0.0.1 and raw DEALER clients.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Semaphore, watch};

use super::*;
use crate::zmtp::{self, FrameReader, Incoming};
use crate::{BoxFuture, Caller, Limits, Service};

/// Echoes, except that a request `hold` waits for a permit first.
struct Holder(Arc<Semaphore>);

impl Service for Holder {
    fn handle(
        self: Arc<Self>,
        _caller: Caller,
        frames: Vec<Bytes>,
    ) -> BoxFuture<'static, Option<crate::Message>> {
        Box::pin(async move {
            if frames[0].as_ref() == b"hold" {
                self.0.acquire().await.unwrap().forget();
            }
            Some(frames.into())
        })
    }
}

struct Server {
    addr: String,
    release: Arc<Semaphore>,
    _stop: watch::Sender<bool>,
}

async fn server(limits: Limits) -> Server {
    let (listener, endpoint) = crate::bind("tcp://127.0.0.1:0").await.unwrap();
    let release = Arc::new(Semaphore::new(0));
    let (tx, rx) = watch::channel(false);
    tokio::spawn(crate::serve_with(
        listener,
        Arc::new(Holder(release.clone())),
        limits,
        rx,
    ));
    Server {
        addr: endpoint.strip_prefix("tcp://").unwrap().to_string(),
        release,
        _stop: tx,
    }
}

struct Client {
    reader: FrameReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

impl Client {
    async fn connect(addr: &str) -> Client {
        Client::try_connect(addr).await.expect("handshake")
    }

    async fn try_connect(addr: &str) -> Result<Client, zmtp::ZmtpError> {
        let (r, mut writer) = TcpStream::connect(addr).await?.into_split();
        let mut reader = FrameReader::new(r);
        let shake = zmtp::handshake(&mut reader, &mut writer, "DEALER", b"", &["ROUTER"]);
        tokio::time::timeout(Duration::from_secs(5), shake)
            .await
            .expect("handshake answered")?;
        Ok(Client { reader, writer })
    }

    async fn send(&mut self, body: &'static [u8]) {
        zmtp::write_message(&mut self.writer, &[Bytes::from_static(body)])
            .await
            .unwrap();
    }

    /// Sends `ping` and waits for its echo: the connection is served.
    async fn served(&mut self) -> bool {
        if zmtp::write_message(&mut self.writer, &[Bytes::from_static(b"ping")])
            .await
            .is_err()
        {
            return false;
        }
        let read = tokio::time::timeout(
            Duration::from_secs(5),
            self.reader.read(&zmtp::Limits::DEFAULT),
        );
        matches!(read.await, Ok(Ok(Some(Incoming::Message(_)))))
    }

    /// Whether the server closed the connection within `within`.
    async fn closed(&mut self, within: Duration) -> bool {
        let read = tokio::time::timeout(within, self.reader.read(&zmtp::Limits::DEFAULT));
        matches!(read.await, Ok(Ok(None) | Err(_)))
    }
}

fn limits(max: usize, per_peer: usize, idle: Duration) -> Limits {
    Limits {
        max_connections: max,
        max_connections_per_peer: per_peer,
        idle_timeout: idle,
        ..Limits::DEFAULT
    }
}

#[tokio::test]
async fn idle_connections_are_closed_after_the_idle_timeout_and_active_ones_stay() {
    let idle = Duration::from_millis(300);
    let s = server(limits(16, 0, idle)).await;
    let mut quiet = Client::connect(&s.addr).await;
    let mut active = Client::connect(&s.addr).await;
    // Connected, never handshaking: the idle timeout closes it long before
    // the 10 s handshake timeout.
    let mut mute = TcpStream::connect(&s.addr).await.unwrap();
    let t0 = Instant::now();
    // The active one sends every 100 ms, for 4 timeouts.
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(active.served().await, "an active connection was closed");
    }
    assert!(
        quiet.closed(Duration::from_millis(10)).await,
        "idle connection still open"
    );
    let mut sink = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_millis(10), async {
        loop {
            match mute.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // our greeting
            }
        }
    })
    .await;
    assert!(n.is_ok(), "a connection that never handshook is still open");
    eprintln!(
        "idle timeout {idle:?}: quiet ones closed, active one served for {:?}",
        t0.elapsed()
    );
}

#[tokio::test]
async fn a_full_table_evicts_the_longest_idle_and_never_a_busy_one() {
    let s = server(limits(3, 0, Duration::ZERO)).await;
    let mut busy = Client::connect(&s.addr).await;
    busy.send(b"hold").await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    let mut older = Client::connect(&s.addr).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    let mut newer = Client::connect(&s.addr).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    // The busy one is the oldest; `older` is the longest idle.
    let mut fourth = Client::connect(&s.addr).await;
    assert!(fourth.served().await, "the new client is not served");
    assert!(
        older.closed(Duration::from_secs(2)).await,
        "the longest idle stayed"
    );
    // Idle ages are kept in milliseconds: keep the order unambiguous.
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(
        newer.served().await,
        "a younger idle connection was evicted first"
    );
    // `newer` just sent: now `fourth` is the longest idle.
    tokio::time::sleep(Duration::from_millis(30)).await;
    let mut fifth = Client::connect(&s.addr).await;
    assert!(fifth.served().await);
    assert!(
        fourth.closed(Duration::from_secs(2)).await,
        "eviction order is not by idle time"
    );
    // All three busy: a new client is refused, nobody evicted.
    newer.send(b"hold").await;
    fifth.send(b"hold").await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(
        Client::try_connect(&s.addr).await.is_err(),
        "admitted with all busy"
    );
    // The busy one kept its request and gets its reply.
    s.release.add_permits(3);
    let reply = tokio::time::timeout(
        Duration::from_secs(5),
        busy.reader.read(&zmtp::Limits::DEFAULT),
    );
    assert!(
        matches!(reply.await, Ok(Ok(Some(Incoming::Message(_))))),
        "busy lost its reply"
    );
}

#[tokio::test]
async fn an_address_at_its_cap_gives_up_its_longest_idle_and_another_address_is_untouched() {
    let table = Table::new(&limits(8, 2, Duration::ZERO));
    let a = Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1)));
    let b = Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
    let first = table.admit(a).unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let second = table.admit(a).unwrap();
    let other = table.admit(b).unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    // `other` is idle longer than `second`, but it is another address's.
    let third = table.admit(a).expect("an idle connection of a makes room");
    assert!(first.activity.evicted.load(Ordering::Acquire));
    assert!(!second.activity.evicted.load(Ordering::Acquire));
    assert!(!other.activity.evicted.load(Ordering::Acquire));
    assert_eq!(table.len(), 3);
    // Both of a's busy: refused, nobody evicted.
    second.activity.set_busy(true);
    third.activity.set_busy(true);
    assert_eq!(table.admit(a).unwrap_err(), Refusal::PeerCap(2));
    assert!(!second.activity.evicted.load(Ordering::Acquire));
    let _other2 = table.admit(b).unwrap();
    // ipc clients have no address and no cap.
    let ipc: Vec<_> = (0..3).map(|_| table.admit(None).unwrap()).collect();
    assert_eq!(table.len(), 7);
    drop(second);
    let _again = table.admit(a).expect("a closed connection frees its place");
    drop(ipc);
    assert_eq!(table.len(), 4);
}

#[tokio::test]
async fn a_flood_from_one_address_cannot_lock_out_its_next_client() {
    let s = server(limits(64, 4, Duration::ZERO)).await;
    // Four idle connections from 127.0.0.1, oldest first.
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(Client::connect(&s.addr).await);
        // Idle ages are kept in milliseconds: keep the order unambiguous.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut fifth = Client::connect(&s.addr).await;
    assert!(
        fifth.served().await,
        "the fifth from 127.0.0.1 is not served"
    );
    assert!(
        idle[0].closed(Duration::from_secs(2)).await,
        "the oldest idle connection stayed"
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    for c in &mut idle[1..] {
        assert!(c.served().await, "a younger idle connection was evicted");
    }
    // 127.0.0.2 is another loopback address: another peer, its own share.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let (r, mut w) = sock
        .connect(s.addr.parse().unwrap())
        .await
        .unwrap()
        .into_split();
    let mut reader = FrameReader::new(r);
    zmtp::handshake(&mut reader, &mut w, "DEALER", b"", &["ROUTER"])
        .await
        .expect("another address is admitted");
    // All four of 127.0.0.1's busy: the next one is refused, nobody evicted.
    let mut busy: Vec<Client> = idle.drain(1..).collect();
    busy.push(fifth);
    for c in &mut busy {
        c.send(b"hold").await;
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(
        Client::try_connect(&s.addr).await.is_err(),
        "admitted with all of its address's connections busy"
    );
    s.release.add_permits(4);
    for c in &mut busy {
        let reply = tokio::time::timeout(
            Duration::from_secs(5),
            c.reader.read(&zmtp::Limits::DEFAULT),
        );
        assert!(
            matches!(reply.await, Ok(Ok(Some(Incoming::Message(_))))),
            "a busy connection lost its reply"
        );
    }
}

/// Echoes the caller's connection number; records the connections closed.
#[derive(Default)]
struct Closes(std::sync::Mutex<Vec<u64>>);

impl Service for Closes {
    fn handle(
        self: Arc<Self>,
        caller: Caller,
        _frames: Vec<Bytes>,
    ) -> BoxFuture<'static, Option<crate::Message>> {
        let id = Bytes::from(caller.connection.to_le_bytes().to_vec());
        Box::pin(async move { Some(vec![id].into()) })
    }

    fn closed(&self, connection: u64) {
        self.0.lock().unwrap().push(connection);
    }
}

#[tokio::test]
async fn the_service_hears_of_each_connection_that_ended() {
    let (listener, endpoint) = crate::bind("tcp://127.0.0.1:0").await.unwrap();
    let addr = endpoint.strip_prefix("tcp://").unwrap().to_string();
    let closes = Arc::new(Closes::default());
    let (_stop, rx) = watch::channel(false);
    tokio::spawn(crate::serve_with(
        listener,
        closes.clone(),
        limits(8, 2, Duration::ZERO),
        rx,
    ));
    let who = async |c: &mut Client| {
        c.send(b"who").await;
        match c.reader.read(&zmtp::Limits::DEFAULT).await.unwrap() {
            Some(Incoming::Message(frames)) => {
                u64::from_le_bytes(frames.last().unwrap()[..8].try_into().unwrap())
            }
            other => panic!("no reply: {other:?}"),
        }
    };
    // Two closed by their client, one evicted by the per-peer cap of 2.
    let mut ids = Vec::new();
    for _ in 0..2 {
        let mut c = Client::connect(&addr).await;
        ids.push(who(&mut c).await);
    }
    let mut oldest = Client::connect(&addr).await;
    ids.push(who(&mut oldest).await);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut younger = Client::connect(&addr).await;
    let kept = who(&mut younger).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut newest = Client::connect(&addr).await;
    assert!(newest.served().await);
    assert!(oldest.closed(Duration::from_secs(2)).await);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let seen = closes.0.lock().unwrap().clone();
        if ids.iter().all(|id| seen.contains(id)) {
            assert!(
                !seen.contains(&kept),
                "an open connection was reported closed"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "closed {seen:?}, connections {ids:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
