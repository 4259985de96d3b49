//! One client connection of a server: the handshake, then requests read
//! (the next one while one is handled, no further), handed to the
//! [`Service`] and answered in order, each reply (and its tail) written
//! within the write timeout.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use bytes::Bytes;
use tokio::sync::watch;

use crate::curve_io::WriteStream;
use crate::limits::Limits;
use crate::message::{Chunk, Message, Tail};
use crate::pool::ReceivePool;
use crate::service::{Caller, Service};
use crate::socket::BoxStream;
use crate::zmtp::{self, FrameReader, Incoming, ZmtpError};
use crate::{frame, table};

/// One client connection: handshake, then request, reply, request, ...,
/// with the next request read while one is handled.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn connection(
    stream: BoxStream,
    service: Arc<dyn Service>,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
    next_id: Arc<AtomicU32>,
    pool: Option<Arc<ReceivePool>>,
    activity: &Arc<table::Activity>,
    connection: u64,
    peer: Option<std::net::IpAddr>,
) {
    let (reader, mut writer) = tokio::io::split(stream);
    let reader = table::Tracked::new(reader, activity.clone());
    let mut reader = FrameReader::new(reader);
    let security = service.security();
    let shake = zmtp::handshake_with(
        &mut reader,
        &mut writer,
        security,
        "ROUTER",
        b"",
        &["DEALER", "REQ", "ROUTER"],
    );
    let shown = || peer.map_or_else(|| "local (ipc)".into(), |p| p.to_string());
    let mut peer = match tokio::time::timeout(limits.handshake_timeout, shake).await {
        Ok(Ok(p)) => {
            if let Some(user) = &p.user {
                tracing::debug!(peer = %shown(), user, "client authenticated");
            }
            p
        }
        // A peer that closes before its greeting (a probe reading ours) is
        // no refusal.
        Ok(Err(e))
            if !matches!(security, zmtp::Security::Null) && !matches!(e, ZmtpError::Closed) =>
        {
            // The peer's address and why; never a credential (the errors
            // name none).
            return tracing::warn!(peer = %shown(), error = %e, "connection refused at the handshake");
        }
        Ok(Err(e)) => return tracing::debug!(error = %e, "handshake failed"),
        Err(_) => {
            return tracing::debug!(timeout = ?limits.handshake_timeout, "handshake timed out");
        }
    };
    let (reader, mut writer) =
        zmtp::secure(reader, writer, peer.session.take(), pool, &limits.receive);
    let identity = if peer.identity.is_empty() {
        // As libzmq does: a zero byte then a 32-bit counter.
        let n = next_id.fetch_add(1, Ordering::Relaxed);
        let mut id = vec![0u8];
        id.extend_from_slice(&n.to_be_bytes());
        Bytes::from(id)
    } else {
        peer.identity
    };
    let caller = Caller {
        connection,
        identity: identity.clone(),
    };
    // The next message is read while one is handled (a client may send it
    // before the reply, as the Python client's puts of several messages
    // do), never more than one: a message read ahead is held until the one
    // before it is answered, and only then is the next read begun. Requests
    // are handled, and answered, one at a time and in order. All in this
    // task: the read ahead is polled alongside the handling and writing of
    // the request before it, with no second task and no channel between
    // them (a request's hop through one cost each small call a wake-up
    // and a task poll more).
    let read_limits = limits.receive;
    let mut reading = std::pin::pin!(Some(read_next(reader, read_limits)));
    // One wait for shutdown for the connection's life, not one a request
    // (each joins and leaves the watch's list of waiters under its lock).
    let mut stop = std::pin::pin!(shutdown.changed());
    // A message read ahead, and the reader then idle until it is taken.
    let mut ahead: Option<Read> = None;
    let mut idle: Option<FrameReader<crate::curve_io::ReadStream>> = None;
    loop {
        let incoming = match ahead.take() {
            Some(incoming) => {
                if let Some(reader) = idle.take() {
                    reading.set(Some(read_next(reader, read_limits)));
                }
                incoming
            }
            None => {
                let Some(next) = reading.as_mut().as_pin_mut() else {
                    return;
                };
                let (reader, incoming) = tokio::select! {
                    biased;
                    r = next => r,
                    _ = stop.as_mut() => return,
                };
                reading
                    .set(matches!(incoming, Ok(Some(_))).then(|| read_next(reader, read_limits)));
                incoming
            }
        };
        let serve = serve_one(
            incoming,
            &service,
            &caller,
            &mut writer,
            &limits,
            activity,
            &identity,
        );
        let mut serve = std::pin::pin!(serve);
        let flow = loop {
            let next = match reading.as_mut().as_pin_mut() {
                Some(next) if ahead.is_none() => next,
                _ => break serve.as_mut().await,
            };
            tokio::select! {
                biased;
                flow = serve.as_mut() => break flow,
                (reader, read) = next => {
                    if matches!(read, Ok(Some(_))) {
                        idle = Some(reader);
                    }
                    ahead = Some(read);
                    reading.set(None);
                }
            }
        };
        if flow.is_break() {
            return;
        }
    }
}

/// What one read gives: a message, a command, the end of the stream, or
/// why the connection ends.
type Read = Result<Option<Incoming>, ZmtpError>;

/// Reads the next message or command of `reader`, handing the reader back
/// with it.
async fn read_next<R: tokio::io::AsyncRead + Unpin>(
    mut reader: FrameReader<R>,
    limits: zmtp::Limits,
) -> (FrameReader<R>, Read) {
    let read = reader.read(&limits).await;
    (reader, read)
}

/// Answers one incoming item: a request handed to the service and its
/// reply (and tail) written, a PING answered. `Break` when the connection
/// ends (the stream closed or broke, or a reply could not be written).
async fn serve_one(
    incoming: Read,
    service: &Arc<dyn Service>,
    caller: &Caller,
    writer: &mut WriteStream,
    limits: &Limits,
    activity: &Arc<table::Activity>,
    identity: &Bytes,
) -> std::ops::ControlFlow<()> {
    use std::ops::ControlFlow::{Break, Continue};
    let reply = match incoming {
        Ok(None) => return Break(()),
        Err(e) => {
            log_end(&e);
            return Break(());
        }
        Ok(Some(Incoming::Command { name, body })) => {
            if name == "PING" && reply_pong(writer, &body, limits).await.is_err() {
                return Break(());
            }
            return Continue(());
        }
        Ok(Some(Incoming::Message(frames))) => {
            activity.set_busy(true);
            service.clone().handle(caller.clone(), frames).await
        }
        Ok(Some(Incoming::TooLarge { head, reason })) => {
            activity.set_busy(true);
            tracing::info!(identity = %String::from_utf8_lossy(identity), %reason, "request refused unread");
            service.clone().reject(caller.clone(), head, reason).await
        }
    };
    let Some(reply) = reply.filter(|r| !r.is_empty()) else {
        activity.set_busy(false);
        return Continue(());
    };
    let mut tail = reply.tail.as_ref().and_then(Tail::take);
    let mut write = write_within(writer, limits, identity, &reply).await;
    while write.is_ok()
        && let Some(rx) = tail.as_mut()
    {
        match rx.recv().await {
            Some(Ok(chunk)) => {
                let more = !chunk.last;
                write = write_within(writer, limits, identity, &chunk).await;
                if !more {
                    tail = None;
                }
            }
            why => {
                let why = match why {
                    Some(Err(why)) => why,
                    _ => "its sender ended before the last frame".into(),
                };
                tracing::warn!(
                    identity = %String::from_utf8_lossy(identity),
                    reason = %why,
                    "a reply begun could not be finished: connection dropped"
                );
                return Break(());
            }
        }
    }
    match write {
        Ok(()) => {
            activity.set_busy(false);
            Continue(())
        }
        Err(()) => Break(()),
    }
}

/// Something a connection writes: a message's first frames or a tail's
/// chunk. Its write is a future of its own type, not boxed: a boxed
/// gathered write was over 1 KiB (its inline I/O slices), past glibc's
/// per-thread cache (chunks up to 1,032 bytes), and its box took about
/// 390 instructions to allocate, every reply. Unboxed (callgrind, one
/// build against the other): a 1-row get took 22,350 instructions in
/// `stowd` against 22,850 (2.2% fewer), and a 32-field by 4-row get's
/// writing about 1,230 fewer. In time, the two builds side by side
/// (alternating blocks of gets, one CPU) took the same CPU a get within
/// the noise: 1.000 (1x1), 1.000 (10x4), 1.018 (32x4).
trait Writable: Sync {
    fn write_to<'a>(
        &'a self,
        w: &'a mut WriteStream,
    ) -> impl Future<Output = std::io::Result<()>> + Send + 'a;
}

impl Writable for Message {
    fn write_to<'a>(
        &'a self,
        w: &'a mut WriteStream,
    ) -> impl Future<Output = std::io::Result<()>> + Send + 'a {
        self.write(w)
    }
}

impl Writable for Chunk {
    fn write_to<'a>(
        &'a self,
        w: &'a mut WriteStream,
    ) -> impl Future<Output = std::io::Result<()>> + Send + 'a {
        zmtp::write_gathered_more(w, &self.parts, &self.per_frame, !self.last)
    }
}

/// Writes `what` within the write timeout; `Err` (logged) if the
/// connection is to be dropped.
async fn write_within(
    writer: &mut WriteStream,
    limits: &Limits,
    identity: &[u8],
    what: &impl Writable,
) -> Result<(), ()> {
    match tokio::time::timeout(limits.write_timeout, what.write_to(writer)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "reply could not be sent (client gone?)");
            Err(())
        }
        Err(_) => {
            tracing::warn!(
                identity = %String::from_utf8_lossy(identity),
                timeout = ?limits.write_timeout,
                "client did not read its reply in time: connection dropped"
            );
            Err(())
        }
    }
}

fn log_end(e: &ZmtpError) {
    match e {
        ZmtpError::Closed => tracing::debug!("client closed the connection mid-message"),
        e => tracing::debug!(error = %e, "connection dropped"),
    }
}

/// Answers a ZMTP 3.1 PING with its context.
async fn reply_pong(writer: &mut WriteStream, ping: &[u8], limits: &Limits) -> Result<(), ()> {
    use tokio::io::AsyncWriteExt;
    let context = ping.get(2..).unwrap_or(&[]);
    let pong = frame::command_frame("PONG", &context[..context.len().min(16)]);
    let write = async {
        writer.write_all(&pong).await?;
        writer.flush().await
    };
    match tokio::time::timeout(limits.write_timeout, write).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(()),
    }
}
