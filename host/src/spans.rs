//! Received buffers registered by address, so that rows stored as separate
//! slices of one buffer can be sent as one range again.
//!
//! A put stores every row as its own `Bytes` slice of the received frame
//! (zero copy). A later get of rows that lie back to back in that frame
//! would otherwise go out as one part per row, which the packing policy
//! then copies into shared frames and the client concatenates again. With
//! the frame registered here, [`Spans::span`] turns such a run back into
//! one slice of the frame: one part, sent without a copy.
//!
//! Ownership: the registry never keeps a buffer alive. [`Spans::register`]
//! wraps a frame in an owner that removes its entry when the last slice is
//! dropped, before the memory is freed, so an address in the registry
//! always belongs to a live buffer.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

type Live = Mutex<BTreeMap<usize, (usize, Weak<Owner>)>>;

struct Owner {
    bytes: Bytes,
    live: Weak<Live>,
}

struct OwnerRef(Arc<Owner>);

impl AsRef<[u8]> for OwnerRef {
    fn as_ref(&self) -> &[u8] {
        &self.0.bytes
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        // Runs before `bytes` is dropped: the address cannot have been reused yet.
        if let Some(live) = self.live.upgrade() {
            let mut live = live.lock().unwrap_or_else(|p| p.into_inner());
            let key = self.bytes.as_ptr() as usize;
            if live.get(&key).is_some_and(|(_, w)| w.strong_count() == 0) {
                live.remove(&key);
            }
        }
    }
}

/// Registered buffers of one process, by start address.
#[derive(Default)]
pub struct Spans {
    live: Arc<Live>,
}

impl std::fmt::Debug for Spans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spans").field("registered", &self.len()).finish()
    }
}

impl Spans {
    pub fn new() -> Spans {
        Spans::default()
    }

    /// The same bytes, now owned through the registry: slices of the
    /// returned `Bytes` can later be joined by [`Spans::span`]. Empty
    /// buffers are returned as they are.
    pub fn register(&self, bytes: Bytes) -> Bytes {
        if bytes.is_empty() {
            return bytes;
        }
        let (start, len) = (bytes.as_ptr() as usize, bytes.len());
        let owner = Arc::new(Owner { bytes, live: Arc::downgrade(&self.live) });
        self.live.lock().unwrap_or_else(|p| p.into_inner()).insert(start, (len, Arc::downgrade(&owner)));
        Bytes::from_owner(OwnerRef(owner))
    }

    /// `len` bytes from `start`, as a slice of the registered buffer that
    /// holds all of them; `None` if no live registered buffer does.
    pub fn span(&self, start: *const u8, len: usize) -> Option<Bytes> {
        let p = start as usize;
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let (&base, (size, weak)) = live.range(..=p).next_back()?;
        let end = p.checked_add(len)?;
        if end > base + size {
            return None;
        }
        let owner = weak.upgrade()?;
        drop(live);
        Some(Bytes::from_owner(OwnerRef(owner)).slice(p - base..end - base))
    }

    /// Number of registered live buffers.
    pub fn len(&self) -> usize {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Joins runs of parts that lie back to back in memory into one part each,
/// where `span` finds one buffer holding the whole run (zero copy). Parts
/// keep their order; a run `span` cannot resolve stays as it was.
pub fn join_runs(parts: &[(Bytes, u64)], span: impl Fn(*const u8, usize) -> Option<Bytes>) -> Option<Vec<(Bytes, u64)>> {
    let mut out: Vec<(Bytes, u64)> = Vec::new();
    let mut joined = false;
    let mut i = 0;
    while i < parts.len() {
        let start = parts[i].0.as_ptr() as usize;
        let (mut end, mut rows, mut j) = (start + parts[i].0.len(), parts[i].1, i + 1);
        while j < parts.len() && !parts[j].0.is_empty() && parts[j].0.as_ptr() as usize == end {
            end += parts[j].0.len();
            rows += parts[j].1;
            j += 1;
        }
        match (j - i > 1).then(|| span(start as *const u8, end - start)).flatten() {
            Some(b) => {
                out.push((b, rows));
                joined = true;
            }
            None => out.extend(parts[i..j].iter().cloned()),
        }
        i = j;
    }
    joined.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_slices_of_a_registered_buffer_join_into_one() {
        let spans = Spans::new();
        let frame = spans.register(Bytes::from((0u8..64).collect::<Vec<u8>>()));
        let parts: Vec<(Bytes, u64)> = (0..8).map(|i| (frame.slice(i * 8..(i + 1) * 8), 1)).collect();
        // rows 0..4 in order, then row 6, then rows 2..3 again
        let picked = vec![parts[0].clone(), parts[1].clone(), parts[2].clone(), parts[3].clone(), parts[6].clone(), parts[2].clone(), parts[3].clone()];
        let joined = join_runs(&picked, |p, l| spans.span(p, l)).unwrap();
        let lens: Vec<(usize, u64)> = joined.iter().map(|(b, r)| (b.len(), *r)).collect();
        assert_eq!(lens, vec![(32, 4), (8, 1), (16, 2)]);
        assert_eq!(&joined[0].0[..], &(0u8..32).collect::<Vec<u8>>()[..]);
        assert_eq!(&joined[2].0[..], &(16u8..32).collect::<Vec<u8>>()[..]);
        // nothing adjacent: no change
        assert!(join_runs(&[parts[5].clone(), parts[1].clone()], |p, l| spans.span(p, l)).is_none());
    }

    #[test]
    fn unregistered_memory_is_never_joined_and_entries_go_with_the_buffer() {
        let spans = Spans::new();
        let plain = Bytes::from(vec![7u8; 32]);
        let parts = vec![(plain.slice(0..16), 1), (plain.slice(16..32), 1)];
        assert!(join_runs(&parts, |p, l| spans.span(p, l)).is_none());
        let frame = spans.register(Bytes::from(vec![1u8; 32]));
        let tail = frame.slice(16..32);
        assert_eq!(spans.len(), 1);
        // a span running past the end of the buffer is refused
        assert!(spans.span(tail.as_ptr(), 17).is_none());
        drop(frame);
        assert_eq!(spans.len(), 1, "a live slice keeps the entry");
        let whole_tail = spans.span(tail.as_ptr(), 16).unwrap();
        drop(tail);
        drop(whole_tail);
        assert!(spans.is_empty(), "the entry goes with the last slice");
    }
}
