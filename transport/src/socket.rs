//! Sockets: the byte stream a connection runs on (tcp or a unix socket),
//! and [`bind`], which makes a ROUTER [`Listener`] of an endpoint.

use std::path::PathBuf;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};

use crate::error::TransportError;

/// A byte stream: tcp or a unix socket.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

pub(crate) type BoxStream = Box<dyn Stream>;

/// A bound ROUTER socket, not yet serving.
#[derive(Debug)]
pub enum Listener {
    Tcp(TcpListener),
    Ipc(UnixListener, PathBuf),
}

impl Listener {
    /// A new connection and its peer's address (none for ipc).
    pub(crate) async fn accept(&self) -> std::io::Result<(BoxStream, Option<std::net::IpAddr>)> {
        match self {
            Listener::Tcp(l) => {
                let (s, addr) = l.accept().await?;
                s.set_nodelay(true)?;
                Ok((Box::new(s), Some(addr.ip().to_canonical())))
            }
            Listener::Ipc(l, _) => {
                let (s, _) = l.accept().await?;
                Ok((Box::new(s), None))
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Ipc(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn bind_err(endpoint: &str, reason: impl ToString) -> TransportError {
    TransportError::Bind {
        endpoint: endpoint.into(),
        reason: reason.to_string(),
    }
}

/// Binds a ROUTER on `endpoint` (`tcp://host:port` or `ipc://path`) and
/// returns it with the resolved endpoint (the real port when 0 was asked).
pub async fn bind(endpoint: &str) -> Result<(Listener, String), TransportError> {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        // A socket file left by a dead process makes bind fail: remove it.
        let p = PathBuf::from(path);
        if p.exists() {
            let _ = std::fs::remove_file(&p);
        }
        let l = UnixListener::bind(&p).map_err(|e| bind_err(endpoint, e))?;
        return Ok((Listener::Ipc(l, p), endpoint.to_string()));
    }
    let Some(addr) = endpoint.strip_prefix("tcp://") else {
        return Err(bind_err(
            endpoint,
            "only tcp:// and ipc:// endpoints are supported",
        ));
    };
    let addr = if let Some(port) = addr.strip_prefix("*:") {
        format!("0.0.0.0:{port}")
    } else {
        addr.to_string()
    };
    let l = TcpListener::bind(&addr)
        .await
        .map_err(|e| bind_err(endpoint, e))?;
    let local = l.local_addr().map_err(|e| bind_err(endpoint, e))?;
    Ok((Listener::Tcp(l), format!("tcp://{local}")))
}
