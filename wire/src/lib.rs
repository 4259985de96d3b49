//! Wire formats spoken by `stowd`, and the data model they carry.
//!
//! - [`tensor`]: `Tensor`, immutable bytes plus dtype and shape, with
//!   zero-copy rows and strided views. Its `Dtype` is `stowage-plan`'s
//!   dtype table, re-exported: the wire names and itemsizes are read there.
//! - [`batch`]: `Field` (regular, nested, values), `Value`, `Cell`.
//! - [`indexes`]: global indexes as arithmetic runs (how a `stowage/1`
//!   get may name them, and what a list of them is turned into).
//! - [`tq`]: the TransferQueue 0.1.11 storage-unit protocol (msgpack
//!   envelope plus raw data frames), both directions: a unit decodes
//!   requests and encodes replies, the router as a client encodes requests
//!   and decodes replies.
//! - [`pickle`]: the tiny pickle subset inside TransferQueue's tensor
//!   extension types.
//! - [`channel`]: the same-node descriptor channel's messages (the greeting
//!   with its token, and each request's segment names), which `stowd`
//!   sends with descriptors attached.
//!
//! Everything here is pure: bytes in, values out, and back. No sockets, no
//! I/O, no threads.

pub mod batch;
pub mod channel;
pub mod indexes;
pub mod msgpack;
pub mod names;
pub mod native;
pub mod pickle;
pub mod tensor;
pub mod tq;

#[cfg(test)]
mod tests;
