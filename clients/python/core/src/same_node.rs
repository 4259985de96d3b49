//! Same-node gets and get_intos (the protocol page, "Same-node shared
//! memory"): the request names the client's descriptor channel
//! ([`crate::channel`]); the get_ok comes as `segments`, `[[name, offset,
//! len], ...]`, each virtual data frame a range of a segment whose
//! descriptor came over the channel before the reply.
//!
//! While it waits for the reply, a get reads the channel as messages
//! arrive (it polls both), so a long list of descriptors never fills the
//! channel and stops stowd. Then the segments are mapped
//! ([`crate::segments`]), every `[name, offset, len]` checked against its
//! file's size and every descriptor's range against its frame (a bad one
//! is a protocol violation, and the connection is dropped), and the result
//! made ([`crate::assemble`]):
//!
//! - a regular field whose rows lie back to back in one segment (stowd
//!   names rows that do as one part), and a packed nested field whose rows
//!   do, is a view of the segment's shared read-only mapping: two gets of
//!   the same rows give the same data pointer, and nothing is copied;
//!   rows spread over several places are gathered into one buffer of the
//!   receive pool ([`crate::pool`]): a training loop that gets the same
//!   shape every step copies into pages already resident;
//! - a nested field's rows are views of the shared mapping;
//! - fields that become tensors are views of private copy-on-write
//!   mappings instead (one per segment and get, of the span they use):
//!   no two tensors of a get share a byte, so a view whose bytes overlap
//!   another's (a row asked for twice) is copied.
//!
//! A same-node get_into copies each field's rows from the mappings into
//! the caller's arrays, each checked first, as over the socket.
//!
//! A get_ok without `segments` (stowd always names them in a same-node
//! reply, an empty list if it must) is read from the socket as any get's.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;

use stowage_wire::native::{FieldLayout, layout};

use crate::assemble::{Assembled, Base, GetOptions, InMemory, NOWHERE, Place, Want};
use crate::channel::{Channel, Fds};
use crate::error::Fail;
use crate::get::{Asked, Reply, check_answer, receive};
use crate::get_into::{Target, check_targets, copy_into, receive_into};
use crate::message::write_message;
use crate::receive::{Entries, Head, Other, frames_error, read_head, segments};
use crate::segments::{Mapping, Segments, private};
use crate::stream::Stream;
use crate::wait::Turn;

/// A same-node client's channel and mappings.
pub(crate) struct Shm<'a> {
    pub(crate) channel: &'a Channel,
    pub(crate) segments: &'a Segments,
}

/// Forgets a request on the channel when dropped (its descriptors, if
/// they come after all, are closed).
struct Expected<'a>(&'a Channel, u64);

impl Drop for Expected<'_> {
    fn drop(&mut self) {
        self.0.forget_id(self.1);
    }
}

/// Waits until the reply's first bytes are there, reading channel
/// messages as they arrive (a channel that breaks meanwhile is closed,
/// and says why once a reply needs it). It spins first, as a wait on the
/// socket alone does ([`crate::wait::Spin`]), the channel read on each
/// turn: a 4 KiB same-node get answered over the socket (`[shm]
/// inline_below`), across two CPUs, took 40 µs at the median sleeping at
/// once and 30 µs spinning (`docs/benchmarks.md`, "Same-node small
/// gets").
fn await_reply(s: &mut Stream, ch: &Channel) -> Result<(), Fail> {
    if !s.buffered() {
        let (fd, deadline) = (s.sock.as_raw_fd(), s.deadline);
        s.spin.poll(deadline, || {
            // (A failure closed the channel: the wait below says so.)
            let _ = ch.pump_one(deadline, false);
            if crate::wait::readable(fd) {
                Turn::Ready
            } else {
                Turn::NotYet
            }
        });
    }
    loop {
        if s.buffered() {
            return Ok(());
        }
        let chan = ch.sock();
        let mut fds = [
            libc::pollfd {
                fd: s.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: chan.as_ref().map_or(-1, |c| c.as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let left = s
            .deadline
            .checked_duration_since(std::time::Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| Fail::Timeout("no reply within the timeout".into()))?;
        let ms = left.as_millis().saturating_add(1).min(i32::MAX as u128) as i32;
        // SAFETY: two valid pollfds (a negative fd is skipped), alive for
        // the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                crate::error::interrupted()?;
                continue;
            }
            return Err(Fail::Io(e.to_string()));
        }
        if fds[1].revents != 0 {
            // (A failure closed the channel: the reply says what became
            // of the request, and one that needs descriptors says why
            // there are none.)
            let _ = ch.pump_one(s.deadline, true);
        }
        if fds[0].revents != 0 {
            return Ok(());
        }
    }
}

/// Sends a same-node request (`frame0`; None: sent already, by an event
/// loop's `start_get`) and reads its reply's frame 0, the channel read
/// meanwhile.
fn request(
    s: &mut Stream,
    ch: &Channel,
    frame0: Option<&[u8]>,
) -> Result<Result<Head, Other>, Fail> {
    if let Some(frame0) = frame0 {
        write_message(s, frame0, &[])?;
    }
    await_reply(s, ch)?;
    read_head(s)
}

/// The segments of a reply, mapped and checked: each virtual data frame
/// as (its mapping's number, or `usize::MAX` for the empty frame; offset
/// in the segment; length), the mappings, and each mapping's descriptor.
struct Resolved {
    frames: Vec<(usize, u64, u64)>,
    maps: Vec<Arc<Mapping>>,
    fds: Vec<OwnedFd>,
}

impl Resolved {
    /// Maps the segments `entries` names (descriptors `fds`), checking
    /// every entry against its file's size.
    fn new(entries: Entries, fds: Fds, cache: &Segments) -> Result<Resolved, Fail> {
        let mut fds: std::collections::HashMap<String, OwnedFd> = fds.into_iter().collect();
        let mut number: std::collections::HashMap<String, usize> = Default::default();
        let mut r = Resolved {
            frames: Vec::with_capacity(entries.len()),
            maps: Vec::new(),
            fds: Vec::new(),
        };
        for (name, offset, len) in entries {
            if name.is_empty() && offset == 0 && len == 0 {
                r.frames.push((usize::MAX, 0, 0));
                continue;
            }
            let k = match number.get(&name) {
                Some(&k) => k,
                None => {
                    let Some(fd) = fds.remove(&name) else {
                        return Err(Fail::Protocol(format!(
                            "segment {name:?} came without its descriptor"
                        )));
                    };
                    r.maps.push(cache.map(fd.as_fd())?);
                    r.fds.push(fd);
                    number.insert(name.clone(), r.maps.len() - 1);
                    r.maps.len() - 1
                }
            };
            let size = r.maps[k].len() as u64;
            if offset.checked_add(len).is_none_or(|end| end > size) {
                return Err(Fail::Protocol(format!(
                    "range {offset}+{len} lies outside segment {name:?} ({size} bytes)"
                )));
            }
            r.frames.push((k, offset, len));
        }
        Ok(r)
    }

    /// The frames as they lie in the mappings.
    fn in_memory(&self) -> InMemory<'_> {
        InMemory {
            frames: self.frames.clone(),
            sources: self.maps.iter().map(|m| m.bytes()).collect(),
        }
    }
}

/// A same-node request's reply.
enum Answer {
    /// A get_ok with segments: its request id, fields, and the segments
    /// mapped and checked.
    Mapped(u64, Vec<(Arc<str>, FieldLayout)>, Resolved),
    /// A get_ok without segments, its data frames still on the socket.
    Plain(Head),
    /// Any other reply.
    Other(Other),
}

/// Reads a same-node reply's frame 0 and, for a get_ok with segments,
/// takes its descriptors and maps its segments.
fn mapped_reply(
    s: &mut Stream,
    id: u64,
    frame0: Option<&[u8]>,
    shm: &Shm<'_>,
) -> Result<Answer, Fail> {
    let head = match request(s, shm.channel, frame0)? {
        Ok(head) => head,
        Err(other) => return Ok(Answer::Other(other)),
    };
    let Some(entries) = segments(&head.3)? else {
        return Ok(Answer::Plain(head));
    };
    let (rid, fields, more, _) = head;
    if more {
        return Err(Fail::Protocol(
            "a reply with segments must have no data frames".into(),
        ));
    }
    if rid != id {
        return Err(Fail::Protocol(format!(
            "a get_ok for request {rid}, not {id}"
        )));
    }
    let fds = if entries.iter().any(|e| !e.0.is_empty()) {
        shm.channel.take_fds(id, s.deadline)?
    } else {
        Vec::new()
    };
    let r = Resolved::new(entries, fds, shm.segments)?;
    layout::check_frames(&fields, &r.in_memory().lens())
        .map_err(|e| Fail::Protocol(frames_error(&e)))?;
    Ok(Answer::Mapped(rid, fields, r))
}

/// A same-node get: the request `frame0` (with the envelope keys
/// `same_node` and `channel`; None: written already, its reply awaited by
/// an event loop), and its result.
pub(crate) fn get(
    s: &mut Stream,
    frame0: Option<&[u8]>,
    asked: &Asked<'_>,
    opts: &GetOptions,
    shm: &Shm<'_>,
) -> Result<Reply, Fail> {
    shm.channel.expect_id(asked.id);
    let _forget = Expected(shm.channel, asked.id);
    match mapped_reply(s, asked.id, frame0, shm)? {
        Answer::Mapped(rid, fields, r) => {
            check_answer(rid, &fields, asked)?;
            Ok(Reply::Got(assemble(fields, &r, opts)?))
        }
        Answer::Plain(head) => receive(s, head, asked, opts),
        Answer::Other((head, problem)) => Ok(Reply::Other(head, problem)),
    }
}

/// A same-node get_into (see [`crate::get_into::get_into`]; `frame0` as
/// for [`get`]).
pub(crate) fn get_into(
    s: &mut Stream,
    id: u64,
    frame0: Option<&[u8]>,
    targets: &[Target],
    shm: &Shm<'_>,
) -> Result<Option<Other>, Fail> {
    shm.channel.expect_id(id);
    let _forget = Expected(shm.channel, id);
    match mapped_reply(s, id, frame0, shm)? {
        Answer::Mapped(_, fields, r) => {
            let checked = check_targets(&fields, targets)?;
            let mem = r.in_memory();
            copy_into(targets, &checked, |frame, offset, len| {
                mem.bytes(frame, offset, len)
            });
            Ok(None)
        }
        Answer::Plain((_, fields, more, _)) => {
            receive_into(s, &fields, more, targets).map(|()| None)
        }
        Answer::Other(other) => Ok(Some(other)),
    }
}

/// The result of a get_ok whose frames are `r` (see the module doc).
fn assemble(
    fields: Vec<(Arc<str>, FieldLayout)>,
    r: &Resolved,
    opts: &GetOptions,
) -> Result<Assembled, Fail> {
    let mem = r.in_memory();
    // Base k is mapping k, shared.
    let bases = r.maps.iter().map(|m| Base::Shared(m.clone())).collect();
    let (mut made, wants) = mem.assemble(fields, bases, opts, true);
    if !wants.is_empty() {
        private_views(r, &mem, &mut made, wants)?;
    }
    Ok(made)
}

/// Places the views tensors want: over one private copy-on-write mapping
/// per segment, of the span they use; a view whose bytes overlap an
/// earlier one's (in address order) is a copy instead, into one buffer of
/// this get's own.
fn private_views(
    r: &Resolved,
    mem: &InMemory<'_>,
    made: &mut Assembled,
    mut wants: Vec<Want>,
) -> Result<(), Fail> {
    wants.sort_by_key(|w| (w.source, w.at));
    let mut copied = vec![false; wants.len()];
    let mut reach: Option<(usize, u64)> = None;
    for (i, w) in wants.iter().enumerate() {
        match reach {
            Some((source, end)) if source == w.source && w.at < end => {
                copied[i] = true;
                reach = Some((source, end.max(w.at + w.len)));
            }
            _ => reach = Some((w.source, w.at + w.len)),
        }
    }
    let mut places = vec![NOWHERE; wants.len()];
    // The copies, back to back in one buffer.
    let copies: Vec<(usize, u64, u64)> = (wants.iter().zip(&copied))
        .filter(|(_, c)| **c)
        .map(|(w, _)| (w.source, w.at, w.len))
        .collect();
    if !copies.is_empty() {
        made.bases.push(Base::Owned(mem.gather(&copies)));
        let base = made.bases.len() - 1;
        let mut at = 0usize;
        for (i, w) in wants.iter().enumerate() {
            if copied[i] {
                places[i] = Place { base, at };
                at += w.len as usize;
            }
        }
    }
    // One private mapping per segment, of the span its other views use.
    let mut i = 0;
    while i < wants.len() {
        let source = wants[i].source;
        let j = i + wants[i..].iter().take_while(|w| w.source == source).count();
        let kept = (i..j).filter(|&k| !copied[k]);
        let lo = kept.clone().map(|k| wants[k].at).min();
        let hi = kept.clone().map(|k| wants[k].at + wants[k].len).max();
        if let (Some(lo), Some(hi)) = (lo, hi) {
            made.bases
                .push(Base::Private(private(r.fds[source].as_fd(), lo, hi)?));
            let base = made.bases.len() - 1;
            for k in kept {
                places[k] = Place {
                    base,
                    at: (wants[k].at - lo) as usize,
                };
            }
        }
        i = j;
    }
    for (w, place) in wants.iter().zip(places) {
        made.place(w, place);
    }
    Ok(())
}
