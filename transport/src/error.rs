//! The transport's errors: [`TransportError`], and why a connection to a
//! peer could not be made ([`ConnectError`]).

use std::time::Duration;

use crate::zmtp::ZmtpError;

/// Transport failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    #[error("cannot bind {endpoint}: {reason}")]
    Bind { endpoint: String, reason: String },
    #[error("cannot connect to {endpoint}: {reason}")]
    Connect {
        endpoint: String,
        #[source]
        reason: ConnectError,
    },
    #[error("send to {endpoint} failed: {reason}")]
    Send { endpoint: String, reason: String },
    #[error("no reply from {endpoint} within {timeout:?}")]
    Timeout { endpoint: String, timeout: Duration },
    #[error("receive from {endpoint} failed: {reason}")]
    Recv { endpoint: String, reason: String },
}

/// Why a connection to a peer could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("only tcp:// and ipc:// endpoints are supported")]
    Scheme,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Handshake(#[from] ZmtpError),
}
