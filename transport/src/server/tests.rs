//! End-to-end tests of the crate: a server and a [`Peer`] (or a raw
//! DEALER) as its client, over real sockets.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::zmtp::{self, FrameReader, Incoming};
use crate::*;

struct Echo;

impl Service for Echo {
    fn handle(
        self: Arc<Self>,
        _caller: Caller,
        frames: Vec<Bytes>,
    ) -> BoxFuture<'static, Option<Message>> {
        // Each frame sent back gathered from two parts (its halves).
        Box::pin(async move {
            let mut parts = Vec::new();
            for f in &frames {
                let half = f.len() / 2;
                parts.push(f.slice(..half));
                parts.push(f.slice(half..));
            }
            let per_frame = Some(vec![2; frames.len()]);
            Some(Message {
                parts,
                per_frame,
                tail: None,
            })
        })
    }
}

/// Answers each request with the length of its first frame; the first
/// request waits for the test's go first.
struct Gate {
    go: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
}

impl Service for Gate {
    fn handle(
        self: Arc<Self>,
        _caller: Caller,
        frames: Vec<Bytes>,
    ) -> BoxFuture<'static, Option<Message>> {
        Box::pin(async move {
            let go = self.go.lock().unwrap().take();
            if let Some(go) = go {
                let _ = go.await;
            }
            let len = frames[0].len() as u64;
            Some(Message::from(vec![Bytes::from(len.to_le_bytes().to_vec())]))
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_request_is_read_while_one_is_handled() {
    let (socket, bound) = bind("tcp://127.0.0.1:0").await.unwrap();
    let (go, wait) = tokio::sync::oneshot::channel();
    let gate = Arc::new(Gate {
        go: std::sync::Mutex::new(Some(wait)),
    });
    let (tx, rx) = watch::channel(false);
    let server = tokio::spawn(serve(socket, gate, rx));
    let stream = TcpStream::connect(bound.trim_start_matches("tcp://"))
        .await
        .unwrap();
    let (r, mut w) = tokio::io::split(stream);
    let mut r = FrameReader::new(r);
    zmtp::handshake(&mut r, &mut w, "DEALER", b"", &["ROUTER"])
        .await
        .unwrap();
    // The first request, held by the service; then one of 64 MiB, far
    // more than the sockets' buffers hold: its write ends only if the
    // server reads it while it handles the first.
    zmtp::write_message(&mut w, &[Bytes::from_static(b"first")])
        .await
        .unwrap();
    let big = Bytes::from(vec![7u8; 64 << 20]);
    tokio::time::timeout(Duration::from_secs(30), zmtp::write_message(&mut w, &[big]))
        .await
        .expect("the second request was not read while the first was handled")
        .unwrap();
    go.send(()).unwrap();
    // Both answered, in order.
    for want in [5u64, 64 << 20] {
        match r.read(&zmtp::Limits::DEFAULT).await.unwrap() {
            Some(Incoming::Message(f)) => {
                assert_eq!(f, vec![Bytes::from(want.to_le_bytes().to_vec())])
            }
            other => panic!("{other:?}"),
        }
    }
    tx.send(true).unwrap();
    server.await.unwrap();
}

/// Answers with frame 0 "head", then a tail of one chunk per
/// remaining request frame sent 20 ms apart (the request's frames
/// echoed); a request whose first frame is "abort" gets a tail that
/// fails after its first chunk.
struct Trickle;

impl Service for Trickle {
    fn handle(
        self: Arc<Self>,
        _caller: Caller,
        frames: Vec<Bytes>,
    ) -> BoxFuture<'static, Option<Message>> {
        Box::pin(async move {
            let (tx, tail) = Tail::channel(1);
            let abort = frames[0] == "abort";
            tokio::spawn(async move {
                let n = frames.len() - 1;
                for (k, f) in frames.into_iter().skip(1).enumerate() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    if abort && k == 1 {
                        let _ = tx.send(Err("the source went away".into())).await;
                        return;
                    }
                    let chunk = Chunk {
                        parts: vec![f.slice(..f.len() / 2), f.slice(f.len() / 2..)],
                        per_frame: vec![2],
                        last: k + 1 == n,
                    };
                    if tx.send(Ok(chunk)).await.is_err() {
                        return;
                    }
                }
            });
            Some(Message {
                parts: vec![Bytes::from_static(b"head")],
                per_frame: None,
                tail: Some(tail),
            })
        })
    }
}

#[tokio::test]
async fn a_reply_with_a_tail_arrives_whole_and_an_abandoned_one_ends_its_connection() {
    let (socket, bound) = bind("tcp://127.0.0.1:0").await.unwrap();
    let (tx, rx) = watch::channel(false);
    let server = tokio::spawn(serve(socket, Arc::new(Trickle), rx));
    let peer = Peer::new(bound, "tail_test");
    let t = Duration::from_secs(10);
    let big = Bytes::from(vec![3u8; 8 << 20]);
    let request = vec![
        Bytes::from_static(b"go"),
        Bytes::from_static(b"one"),
        big.clone(),
        Bytes::new(),
    ];
    let seen = std::sync::Mutex::new(Vec::new());
    let reply = peer
        .request_tapped(request.clone().into(), t, &|e| {
            if let Tapped::Frame(f) = e {
                seen.lock().unwrap().push(f.len());
            }
        })
        .await
        .unwrap();
    assert_eq!(reply.len(), 4);
    assert_eq!(reply[0], "head");
    assert_eq!(reply[1..], request[1..]);
    assert_eq!(*seen.lock().unwrap(), vec![4, 3, 8 << 20, 0]);
    // A tail that fails: the caller sees the connection end, not a
    // reply, and the next request is answered on a fresh connection.
    let e = peer
        .request(vec![Bytes::from_static(b"abort"), big.clone(), big], t)
        .await
        .unwrap_err();
    assert!(matches!(e, TransportError::Recv { .. }), "{e:?}");
    let reply = peer.request(request.clone(), t).await.unwrap();
    assert_eq!(reply[1..], request[1..]);
    tx.send(true).unwrap();
    server.await.unwrap();
}

#[tokio::test]
async fn ipc_bind_survives_a_stale_socket_file_and_peers_reconnect() {
    let dir = std::env::temp_dir().join(format!("stowage-ipc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("unit.sock");
    // A file left behind by a dead process.
    std::fs::write(&path, b"stale").unwrap();
    let endpoint = format!("ipc://{}", path.display());
    let (socket, bound) = bind(&endpoint).await.unwrap();
    assert!(bound.starts_with("ipc://"), "{bound}");
    let (tx, rx) = watch::channel(false);
    let server = tokio::spawn(serve(socket, Arc::new(Echo), rx));
    let peer = Peer::new(endpoint.clone(), "TQ_STORAGE_test");
    let t = Duration::from_secs(5);
    for i in 0..3u8 {
        let reply = peer
            .request(vec![Bytes::from(vec![i; 3]), Bytes::from_static(b"x")], t)
            .await
            .unwrap();
        assert_eq!(
            reply,
            vec![Bytes::from(vec![i; 3]), Bytes::from_static(b"x")]
        );
    }
    tx.send(true).unwrap();
    server.await.unwrap();
    // A peer whose unit is gone fails within its timeout, it does not hang.
    let gone = Peer::new("tcp://127.0.0.1:1", "TQ_STORAGE_test");
    assert!(
        gone.request(vec![Bytes::from_static(b"x")], Duration::from_millis(500))
            .await
            .is_err()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn gathered_messages_cross_tcp_whole() {
    let (socket, bound) = bind("tcp://127.0.0.1:0").await.unwrap();
    let (tx, rx) = watch::channel(false);
    let server = tokio::spawn(serve(socket, Arc::new(Echo), rx));
    let peer = Peer::new(bound, "TQ_STORAGE_test");
    // Frame 1 from 5,000 parts of 4 KiB (more than one vectored write
    // takes, and more than a socket buffer holds), an empty part among
    // them; frame 2 from one part.
    let mut parts: Vec<Bytes> = (0..5000u32)
        .map(|i| Bytes::from(vec![(i % 251) as u8; 4096]))
        .collect();
    parts.insert(17, Bytes::new());
    let mut whole = Vec::new();
    parts.iter().for_each(|p| whole.extend_from_slice(p));
    parts.push(Bytes::from_static(b"tail"));
    let msg = Message {
        parts,
        per_frame: Some(vec![5001, 1]),
        tail: None,
    };
    let reply = peer
        .request_message(msg, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(reply.len(), 2);
    assert!(
        reply[0] == whole,
        "frame 1 arrives as its parts back to back"
    );
    assert_eq!(reply[1], Bytes::from_static(b"tail"));
    // Counts that do not add up are refused before anything is sent.
    let mut sink = Vec::new();
    let e = zmtp::write_gathered(&mut sink, &[Bytes::from_static(b"x")], &[2])
        .await
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(sink.is_empty());
    tx.send(true).unwrap();
    server.await.unwrap();
}
