//! The one place where errors become replies: for each protocol, the reply
//! to a failed request, and to a request refused unread. The services
//! (`tq`, `native`) build every error reply through this module.
//!
//! | error | TransferQueue reply (`request_type`, message) | `stowage/1` reply (`code`) |
//! |---|---|---|
//! | `StoreError::KeyNotFound` (a local unit) | `GET_ERROR`, `[TQKeyNotFound] Failed to get data from storage unit id #U, detail error message: '...'` (the real unit's words) | `key_not_found` |
//! | `ManagerError::Remote` whose message starts `[TQKeyNotFound]` | `GET_ERROR`, the remote unit's message as is | `key_not_found` |
//! | `ManagerError::Peer` (a peer unit's error reply, `stowage://` units) | `GET_ERROR` marked `[TQKeyNotFound]` for its `key_not_found`, else the request's own error reply | the peer's own code |
//! | `StoreError::DataLost` (an index written or cleared after the checkpoint restored) | `GET_ERROR`, `Failed to get data from storage unit id #U, detail error message: [DataLost] ...` | `data_lost` |
//! | `StoreError::Journal` (the checkpoint journal could not be written: nothing changed) | the request's own error reply | `internal` |
//! | `StoreError::Spill` (memory full and spilling could not make room: disk full, `spill_max_bytes`) | `PUT_ERROR`, its message | `capacity` |
//! | `StoreError::Capacity` | `PUT_ERROR`, `Failed to put data into storage unit id #U, detail error message: unit ... is full: ...` | `capacity` |
//! | other `StoreError`, `ManagerError::BadRequest`, `ChainError::EmptyPositions` | `PUT_ERROR` / `GET_ERROR` / `CLEAR_DATA_ERROR` (the request's own), `Failed to ... storage unit id #U, detail error message: <error>` | `bad_request` |
//! | `ChainError::Rejected` (a plugin faulted under `fail = "reject"`) | as above | `rejected` |
//! | `ChainError::Packing`, `ManagerError::Remote` (other), `Transport`, `Internal` | as above | `internal` |
//! | `ShmError::Disabled` (a same-node op on a stowd without shared memory) | — | `unsupported` |
//! | `ShmError::TooLarge` (a lease over `max_lease_bytes`), `ShmError::LeaseQuota` / `ConnectionLeaseQuota` (leases over `max_leased_bytes` together, or `max_connection_leased_bytes` on one connection), `ShmError::LeaseCount` / `ConnectionLeaseCount` (more leases than `max_leases`, or `max_connection_leases` on one connection) | — | `too_large` |
//! | `ShmError::Io` | — | `internal` |
//! | other `ShmError` (unknown lease, a lease another connection took, bad name, range outside a segment), a `segments` message with data frames | — | `bad_request` |
//! | a request that breaks `max_request_bytes`/`max_request_frames` (refused unread) | `PUT_ERROR` / `GET_ERROR` / `CLEAR_DATA_ERROR` if frame 0 says which, else `PUT_GET_ERROR`; message `request refused unread: ...` | `too_large` |
//! | an undecodable request (`wire::tq::Error`, `wire::native::Error`) | `PUT_GET_ERROR`, `undecodable request: ...`; or the request's own error type once the op is known ([`tq::Error::reply_type`]) | the decode error's own code ([`native::Error::code`]: `bad_request`, `unsupported`, `too_large`) |
//! | a known TransferQueue request type a unit does not serve | `PUT_GET_OPERATION_ERROR`, `Storage unit id #U receive invalid operation: ZMQRequestType.X.` | — |
//! | `CheckpointError` of a `checkpoint` or `restore` | — | `capacity` (rows that do not fit), `internal` (a disk failure), else `bad_request` (a relative, missing or symlinked directory, a changed or foreign file) |
//! | a checkpoint, restore, `SAVE_STORAGE_CHECKPOINT` or `LOAD_STORAGE_CHECKPOINT` over remote units (`CheckpointRunError::Remote`) | `success: false`, saying to send it to each unit's own endpoint | `unsupported` |
//! | a `CheckpointError` of `SAVE_STORAGE_CHECKPOINT` / `LOAD_STORAGE_CHECKPOINT` | `success: false` with the error's text | — |
//! | a peer request naming a unit this stowd does not have, over shared memory, or an op that names no unit; `versions` without a unit | — | `bad_request` |
//! | a reply that cannot be encoded ([`EncodeError`]) | — | `internal` |
//!
//! Which decode error gets which code or reply type is the codecs' to say
//! (they know the ops); this module only calls them. The other direction,
//! a remote TransferQueue unit's error reply read back into a
//! `ManagerError::Remote` (key-not-found recognised by its
//! `[TQKeyNotFound]` marker), is in `Manager::exchange`. The same table is
//! in `docs/protocol-stowage1.md` ("Errors").

use bytes::Bytes;

use crate::manager::checkpoint::CheckpointRunError;
use crate::manager::{GetSharedError, ManagerError};
use crate::policy::chain::ChainError;
use crate::shm::ShmError;
use crate::store::StoreError;
use crate::wire::{native, tq};

/// Why a `stowage/1` reply could not be encoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    #[error(transparent)]
    Wire(#[from] native::Error),
    #[error("a reply frame is not a shared-memory segment")]
    NotASegment,
}

/// What a refusal of an oversized request says, whatever the protocol.
fn too_large_detail(reason: &str) -> String {
    format!(
        "request refused unread: {reason} (see [limits] max_request_bytes and max_request_frames in the stowd configuration)"
    )
}

/// The TransferQueue reply of endpoint `id` to a request of type `kind`
/// that failed with `e`.
pub(super) fn tq_reply(id: &str, kind: tq::ErrorReply, e: &ManagerError) -> tq::Reply {
    match (kind, e) {
        (
            tq::ErrorReply::Get,
            ManagerError::Store(StoreError::KeyNotFound { index, field, .. }),
        ) => tq::Reply::key_not_found(id, *index, field),
        (
            tq::ErrorReply::Get,
            ManagerError::Remote {
                message,
                key_not_found: true,
                ..
            },
        ) => tq::Reply::Error {
            kind: tq::ErrorReply::Get,
            message: message.clone(),
        },
        // A peer unit's missing key, marked as TransferQueue's clients
        // recognise it.
        (tq::ErrorReply::Get, e @ ManagerError::Peer { .. }) if e.is_key_not_found() => {
            tq::Reply::Error {
                kind: tq::ErrorReply::Get,
                message: format!(
                    "[{}] Failed to get data from storage unit id #{id}, detail error message: {e}",
                    tq::KEY_NOT_FOUND_MARKER
                ),
            }
        }
        (tq::ErrorReply::Get, e) => tq::Reply::get_failed(id, &e.to_string()),
        (tq::ErrorReply::Put, e) => tq::Reply::put_failed(id, &e.to_string()),
        (tq::ErrorReply::ClearData, e) => tq::Reply::clear_failed(id, &e.to_string()),
        (kind, e) => tq::Reply::Error {
            kind,
            message: e.to_string(),
        },
    }
}

/// The TransferQueue reply of endpoint `id` to a request it could not
/// decode.
pub(super) fn tq_undecodable(id: &str, e: &tq::Error) -> tq::Reply {
    e.to_reply(id)
}

/// The TransferQueue reply of endpoint `id` to a known request type it
/// does not serve (`request_type` as on the wire).
pub(super) fn tq_invalid_operation(id: &str, request_type: &str) -> tq::Reply {
    tq::Reply::invalid_operation(id, request_type)
}

/// The TransferQueue error reply to a request that broke a receive limit:
/// `PUT_ERROR`, `GET_ERROR` or `CLEAR_DATA_ERROR` when frame 0 says which
/// request it was, `PUT_GET_ERROR` otherwise.
pub(super) fn tq_too_large(unit_id: &str, head: &[Bytes], reason: &str) -> tq::Reply {
    let detail = too_large_detail(reason);
    let request_type = head.first().map(tq::request_type);
    match request_type.as_ref().and_then(|r| r.as_deref().ok()) {
        Some("PUT") => tq::Reply::put_failed(unit_id, &detail),
        Some("GET") => tq::Reply::get_failed(unit_id, &detail),
        Some("CLEAR_DATA") => tq::Reply::clear_failed(unit_id, &detail),
        _ => tq::Reply::Error {
            kind: tq::ErrorReply::PutGet,
            message: format!("undecodable request: {detail}"),
        },
    }
}

/// The `stowage/1` code of a failed request.
fn native_code(e: &ManagerError) -> &'static str {
    match e {
        _ if e.is_key_not_found() => native::code::KEY_NOT_FOUND,
        ManagerError::Store(StoreError::DataLost { .. }) => native::code::DATA_LOST,
        ManagerError::Store(StoreError::Capacity { .. } | StoreError::Spill(_)) => {
            native::code::CAPACITY
        }
        ManagerError::Store(StoreError::Journal(_)) => native::code::INTERNAL,
        ManagerError::Store(_) | ManagerError::BadRequest(_) => native::code::BAD_REQUEST,
        ManagerError::Policy(ChainError::Rejected { .. }) => native::code::REJECTED,
        ManagerError::Policy(ChainError::EmptyPositions) => native::code::BAD_REQUEST,
        ManagerError::Peer { code, .. } => code,
        _ => native::code::INTERNAL,
    }
}

/// The `stowage/1` code of a failed `checkpoint` or `restore`: the
/// request's own mistakes (a path outside the roots, a relative or missing
/// directory, a corrupted or foreign file) are `bad_request`; rows that do
/// not fit are `capacity`; disk failures (a full disk, a journal that
/// cannot be written) are `internal`.
pub(super) fn checkpoint_code(e: &crate::checkpoint::CheckpointError) -> &'static str {
    use crate::checkpoint::CheckpointError as E;
    match e {
        E::Io { .. } => native::code::INTERNAL,
        E::Store {
            source: StoreError::Capacity { .. } | StoreError::Spill(_),
            ..
        } => native::code::CAPACITY,
        E::Store {
            source: StoreError::Journal(_),
            ..
        } => native::code::INTERNAL,
        _ => native::code::BAD_REQUEST,
    }
}

/// The `stowage/1` reply to a failed request.
pub(super) fn native(e: &ManagerError) -> native::Reply {
    native::Reply::Error {
        code: native_code(e).into(),
        message: e.to_string(),
    }
}

/// The `stowage/1` reply to a request (or a field of it) that could not be
/// decoded, or rows that cannot be represented on the wire.
pub(super) fn native_decode(e: &native::Error) -> native::Reply {
    native::Reply::from_error(e)
}

/// The `stowage/1` reply to a shared-memory failure.
pub(super) fn shm(e: &ShmError) -> native::Reply {
    let code = match e {
        ShmError::Disabled => native::code::UNSUPPORTED,
        ShmError::TooLarge { .. }
        | ShmError::LeaseQuota { .. }
        | ShmError::ConnectionLeaseQuota { .. }
        | ShmError::LeaseCount { .. }
        | ShmError::ConnectionLeaseCount { .. } => native::code::TOO_LARGE,
        ShmError::Io { .. } => native::code::INTERNAL,
        _ => native::code::BAD_REQUEST,
    };
    native::Reply::Error {
        code: code.into(),
        message: e.to_string(),
    }
}

/// The `stowage/1` reply to a `segments` message that also carries data
/// frames over the socket.
pub(super) fn native_segments_with_frames() -> native::Reply {
    let message = "a message with `segments` carries no data frames over the socket".to_string();
    native::Reply::Error {
        code: native::code::BAD_REQUEST.into(),
        message,
    }
}

/// The `stowage/1` reply to a failed same-node get.
pub(super) fn native_shared(e: &GetSharedError) -> native::Reply {
    match e {
        GetSharedError::Manager(e) => native(e),
        GetSharedError::Shm(e) => shm(e),
    }
}

/// The `stowage/1` reply to a request that broke a receive limit.
pub(super) fn native_too_large(reason: &str) -> native::Reply {
    native::Reply::Error {
        code: native::code::TOO_LARGE.into(),
        message: too_large_detail(reason),
    }
}

/// The `stowage/1` reply to a request that is well formed but that this
/// endpoint does not serve as asked (a unit that does not exist, a peer
/// request without its unit).
pub(super) fn native_bad_request(message: String) -> native::Reply {
    native::Reply::Error {
        code: native::code::BAD_REQUEST.into(),
        message,
    }
}

/// The `stowage/1` reply to a `checkpoint` or `restore` (`what`) that did
/// not run or failed.
pub(super) fn native_checkpoint(what: &str, e: &CheckpointRunError) -> native::Reply {
    let (code, message) = match e {
        CheckpointRunError::Remote(remote) => (
            native::code::UNSUPPORTED,
            format!(
                "stowd routes to {remote} remote unit(s) it cannot {what}: \
                 {what} each stowd on its own"
            ),
        ),
        CheckpointRunError::Checkpoint(e) => (checkpoint_code(e), format!("{what} failed: {e}")),
        CheckpointRunError::Task(e) => (native::code::INTERNAL, format!("{what} failed: {e}")),
    };
    native::Reply::Error {
        code: code.into(),
        message,
    }
}

/// The error text of a TransferQueue `SAVE_STORAGE_CHECKPOINT` or
/// `LOAD_STORAGE_CHECKPOINT` (`what`: `save` or `load`) that did not run
/// or failed (its reply says `success: false` and this).
pub(super) fn tq_checkpoint(what: &str, e: &CheckpointRunError) -> String {
    match e {
        CheckpointRunError::Remote(remote) => format!(
            "stowd's router routes to {remote} remote unit(s) it cannot write a \
             checkpoint for: send SAVE_STORAGE_CHECKPOINT and \
             LOAD_STORAGE_CHECKPOINT to each unit's own endpoint instead"
        ),
        CheckpointRunError::Checkpoint(e) => e.to_string(),
        CheckpointRunError::Task(e) => format!("the checkpoint {what} failed: {e}"),
    }
}

/// The `stowage/1` reply for an internal failure to encode a reply.
pub(super) fn native_encode(e: &EncodeError) -> native::Reply {
    native::Reply::Error {
        code: native::code::INTERNAL.into(),
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(r: &native::Reply) -> &str {
        match r {
            native::Reply::Error { code, .. } => code,
            _ => panic!("not an error reply"),
        }
    }

    #[test]
    fn codes_follow_the_table() {
        let missing = ManagerError::Store(StoreError::KeyNotFound {
            unit: "u".into(),
            index: 3,
            field: "f".into(),
        });
        assert_eq!(code(&native(&missing)), native::code::KEY_NOT_FOUND);
        let remote_missing = ManagerError::Remote {
            unit: "u".into(),
            message: "[TQKeyNotFound] x".into(),
            key_not_found: true,
        };
        assert_eq!(code(&native(&remote_missing)), native::code::KEY_NOT_FOUND);
        let full = ManagerError::Store(StoreError::Capacity {
            unit: "u".into(),
            needed: 2,
            free: 1,
            capacity: 1,
        });
        assert_eq!(code(&native(&full)), native::code::CAPACITY);
        assert_eq!(
            code(&native(&ManagerError::BadRequest("x".into()))),
            native::code::BAD_REQUEST
        );
        let rejected = ChainError::Rejected {
            plugin: "p".into(),
            version: "1".into(),
            reason: "trap".into(),
        };
        assert_eq!(
            code(&native(&ManagerError::Policy(rejected))),
            native::code::REJECTED
        );
        assert_eq!(
            code(&native(&ManagerError::Internal("x".into()))),
            native::code::INTERNAL
        );
        assert_eq!(code(&shm(&ShmError::Disabled)), native::code::UNSUPPORTED);
        for too_many in [
            ShmError::TooLarge { asked: 2, limit: 1 },
            ShmError::LeaseCount {
                outstanding: 2,
                limit: 2,
            },
            ShmError::ConnectionLeaseCount {
                outstanding: 2,
                limit: 2,
            },
        ] {
            assert_eq!(code(&shm(&too_many)), native::code::TOO_LARGE);
        }
        for refused in [
            ShmError::StillMapped("x".into()),
            ShmError::Tampered("x".into()),
            ShmError::NoChannel("get"),
            ShmError::UnknownChannel("x".into()),
        ] {
            assert_eq!(code(&shm(&refused)), native::code::BAD_REQUEST);
        }
        assert_eq!(
            code(&native_segments_with_frames()),
            native::code::BAD_REQUEST
        );
        assert_eq!(code(&native_too_large("big")), native::code::TOO_LARGE);
        assert_eq!(
            code(&native_encode(&EncodeError::NotASegment)),
            native::code::INTERNAL
        );
    }

    #[test]
    fn tq_replies_keep_the_real_units_words() {
        let missing = ManagerError::Store(StoreError::KeyNotFound {
            unit: "u".into(),
            index: 3,
            field: "f".into(),
        });
        let tq::Reply::Error { kind, message } = tq_reply("U1", tq::ErrorReply::Get, &missing)
        else {
            panic!()
        };
        assert_eq!(kind, tq::ErrorReply::Get);
        assert!(
            message.starts_with("[TQKeyNotFound] Failed to get data from storage unit id #U1"),
            "{message}"
        );
        let full = ManagerError::Store(StoreError::Capacity {
            unit: "u".into(),
            needed: 2,
            free: 1,
            capacity: 1,
        });
        let tq::Reply::Error { kind, message } = tq_reply("U1", tq::ErrorReply::Put, &full) else {
            panic!()
        };
        assert_eq!(kind, tq::ErrorReply::Put);
        assert!(
            message.starts_with(
                "Failed to put data into storage unit id #U1, detail error message: unit u is full"
            ),
            "{message}"
        );
        let tq::Reply::Error { kind, message } = tq_too_large("U1", &[], "too many frames") else {
            panic!()
        };
        assert_eq!(kind, tq::ErrorReply::PutGet);
        assert!(
            message.starts_with("undecodable request: request refused unread: too many frames"),
            "{message}"
        );
    }
}
