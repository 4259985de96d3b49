//! The serve loop: connections accepted on a [`Listener`], admitted by the
//! connection table ([`crate::table`]), each served by its own task
//! ([`crate::connection`]) until it ends, is evicted or idles out.

use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use tokio::sync::watch;

use crate::connection::connection;
use crate::limits::Limits;
use crate::pool::ReceivePool;
use crate::service::Service;
use crate::socket::Listener;
use crate::table;

/// Serves `service` on `listener` with the default [`Limits`] until
/// `shutdown` turns true.
pub async fn serve(listener: Listener, service: Arc<dyn Service>, shutdown: watch::Receiver<bool>) {
    serve_with(listener, service, Limits::DEFAULT, shutdown).await
}

/// Serves `service` on `listener` until `shutdown` turns true.
pub async fn serve_with(
    listener: Listener,
    service: Arc<dyn Service>,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) {
    let table = table::Table::new(&limits);
    let next_id = Arc::new(AtomicU32::new(0x6b8b_4567));
    let pool = ReceivePool::shared(limits.receive_pool_bytes, limits.receive_pool_idle);
    loop {
        let stream = tokio::select! {
            s = listener.accept() => s,
            _ = shutdown.changed() => break,
        };
        let (stream, peer) = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "accept failed");
                // EMFILE and friends: do not spin.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if !service.admits(peer) {
            tracing::debug!(peer = ?peer, "connection from a peer this endpoint does not serve closed");
            drop(stream);
            continue;
        }
        // Refusals and evictions are logged by the table.
        let Ok(entry) = table.admit(peer) else {
            drop(stream);
            continue;
        };
        let (service, shutdown, next_id, pool) = (
            service.clone(),
            shutdown.clone(),
            next_id.clone(),
            pool.clone(),
        );
        tokio::spawn(async move {
            let activity = entry.activity.clone();
            let owner = service.clone();
            tokio::select! {
                _ = connection(stream, service, limits, shutdown, next_id, pool, &activity, entry.id(), peer) => {}
                _ = activity.evicted() => {}
                _ = activity.idle_expired(limits.idle_timeout) => {
                    tracing::debug!(
                        peer = %peer.map_or_else(|| "local (ipc)".into(), |p| p.to_string()),
                        timeout = ?limits.idle_timeout,
                        "idle connection closed (limits.idle_timeout_secs)"
                    );
                }
            }
            owner.closed(entry.id());
            drop(entry);
        });
    }
}

#[cfg(test)]
mod tests;
