//! The one place where errors become replies: for each protocol, the reply
//! to a failed request, and to a request refused unread.

use bytes::Bytes;

use crate::manager::{GetSharedError, ManagerError};
use crate::policy::chain::ChainError;
use crate::shm::ShmError;
use crate::store::StoreError;
use crate::wire::{native, tq};

/// What a refusal of an oversized request says, whatever the protocol.
fn too_large_detail(reason: &str) -> String {
    format!("request refused unread: {reason} (see [limits] max_request_bytes and max_request_frames in the stowd configuration)")
}

/// The TransferQueue reply of endpoint `id` to a request of type `kind`
/// that failed with `e`.
pub(super) fn tq_reply(id: &str, kind: tq::ErrorReply, e: &ManagerError) -> tq::Reply {
    match (kind, e) {
        (tq::ErrorReply::Get, ManagerError::Store(StoreError::KeyNotFound { index, field, .. })) => {
            tq::Reply::key_not_found(id, *index, field)
        }
        (tq::ErrorReply::Get, ManagerError::Remote { message, key_not_found: true, .. }) => {
            tq::Reply::Error { kind: tq::ErrorReply::Get, message: message.clone() }
        }
        (tq::ErrorReply::Get, e) => tq::Reply::get_failed(id, &e.to_string()),
        (tq::ErrorReply::Put, e) => tq::Reply::put_failed(id, &e.to_string()),
        (tq::ErrorReply::ClearData, e) => tq::Reply::clear_failed(id, &e.to_string()),
        (kind, e) => tq::Reply::Error { kind, message: e.to_string() },
    }
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
        _ => tq::Reply::Error { kind: tq::ErrorReply::PutGet, message: format!("undecodable request: {detail}") },
    }
}

/// The `stowage/1` reply to a failed request.
pub(super) fn native(e: &ManagerError) -> native::Reply {
    let code = match e {
        _ if e.is_key_not_found() => native::code::KEY_NOT_FOUND,
        ManagerError::Store(StoreError::Capacity { .. }) => native::code::CAPACITY,
        ManagerError::Store(_) | ManagerError::BadRequest(_) => native::code::BAD_REQUEST,
        ManagerError::Policy(ChainError::Rejected { .. }) => native::code::REJECTED,
        ManagerError::Policy(ChainError::EmptyPositions) => native::code::BAD_REQUEST,
        _ => native::code::INTERNAL,
    };
    native::Reply::Error { code: code.into(), message: e.to_string() }
}

/// The `stowage/1` reply to a shared-memory failure.
pub(super) fn shm(e: &ShmError) -> native::Reply {
    let code = match e {
        ShmError::Disabled => native::code::UNSUPPORTED,
        ShmError::TooLarge { .. } => native::code::TOO_LARGE,
        ShmError::Io { .. } => native::code::INTERNAL,
        _ => native::code::BAD_REQUEST,
    };
    native::Reply::Error { code: code.into(), message: e.to_string() }
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
    native::Reply::Error { code: native::code::TOO_LARGE.into(), message: too_large_detail(reason) }
}

/// The `stowage/1` reply for an internal failure to encode a reply.
pub(super) fn native_internal(message: String) -> native::Reply {
    native::Reply::Error { code: native::code::INTERNAL.into(), message }
}
