//! Decoding: frames in, requests and replies out, tensors as zero-copy
//! slices of the frames. Every count is checked against the bytes left in
//! frame 0 (by the reader) and against the [`Limits`] before anything is
//! sized from it.
//!
//! | module | what it reads |
//! |---|---|
//! | `envelope` | the envelope: limits of the message, `proto`, `op`, `id`, where the body starts |
//! | `extras` | the envelope's shared-memory and peer keys, as [`Extras`] |
//! | `request` | a request's body, per op, into an [`Op`](super::Op) |
//! | `reply` | a reply's body, per op, into a [`Reply`](super::Reply); a reply's frame 0 alone |
//! | `descriptor` | field descriptors, checked and resolved against the data frames |
//! | `frames` | the data frames as descriptors slice them, and which were used |
//! | `stats` | a `stats_ok` body's values |
//! | `keys` | maps of known keys, required keys, counts against the limits, distinct names |
//!
//! [`Limits`]: super::Limits
//! [`Extras`]: super::Extras

mod descriptor;
#[cfg(test)]
pub(super) use descriptor::last_put_hits;
mod envelope;
mod extras;
mod frames;
mod keys;
mod reply;
mod request;
mod stats;

pub(super) use envelope::id;
pub(super) use extras::extras;
pub(super) use reply::{reply, reply_layout, reply_layout_memo};
pub(super) use request::request;
