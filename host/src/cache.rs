//! The node-local read cache of rows held by peer units (`stowage://` in
//! `[router] units`): K readers on this node getting the same remote rows
//! cost one transfer, not K.
//!
//! A get of a peer unit's rows first asks the unit for their versions
//! ([`crate::store::Unit::versions`]: the put generation that stored each
//! row, with the unit's random incarnation, so a restarted unit never
//! matches), a message of 8 bytes per row and field. Then, per (field,
//! row):
//! - cached at that version: served from here (a **hit**);
//! - being fetched by a concurrent get: that get's transfer is awaited and
//!   its rows are used if they are at least that version (**shared**);
//! - otherwise fetched (a **miss**), in one get of the rows missing, whose
//!   reply carries the version of every row it returns. Concurrent gets
//!   wait for it.
//!
//! A row whose version changed on the peer (put again, cleared, the unit
//! restarted) never matches, so it is never served stale: the versions are
//! asked on every get, after the get began.
//!
//! Cached rows stay in the frames they arrived in: extents, like any
//! stored row, which a same-node reader's get moves into shared memory
//! once. The cache is bounded in bytes (`[cache] max_bytes`) and evicts by
//! fetch, least recently used first: every row a fetch brought shares its
//! fate, which keeps the bookkeeping per fetch, not per row. A fetch larger
//! than the bound is served and not kept.
//!
//! Room is made before a fetch is sent, not only when it lands: the least
//! recently used fetches are evicted for the bytes it is expected to bring
//! (the field's bytes per row in its last fetch from that peer), and the
//! room stays taken while it is in flight. The evicted rows' pages go back
//! to the receive pool, and the fetch's frames are received into them. So
//! the bound holds for the rows in flight too: 8 readers getting 4 times
//! the bound in gets of a quarter of it grew the router's memory by 1.05x
//! the bound, against 1.30x when room was made only on landing (the test
//! `peers_netns::a_bounded_cache_holds_its_bound_with_rows_in_flight`).
//!
//! Rows a get still holds after their fetch was evicted count too. A
//! reply being written to a client holds the rows it sends until it is
//! written, and a slow reader can hold an evicted fetch's rows for a
//! while: a fetch's frames are received here through a token (see
//! [`tracked`]) that every slice of them holds, so the cache sees when the
//! last one goes. Until then their bytes are counted as **held**, beside
//! the rows kept and the room made for fetches in flight, and room for a
//! new fetch is made by evicting more. In a CI run where 8 readers drifted
//! apart (60 evictions where a quiet run has 26), the router grew by 1.19x
//! the bound before held rows were counted. The frames a get forwards to
//! its client as they arrive hold the fetch's token from the moment they
//! are shown to it, so a forwarded reply still being written counts as
//! held too (the test `peers::a_forwarded_reply_still_being_written_counts_as_held`:
//! 0 bytes counted before, the whole 6 MiB fetch after). Before that, in
//! a CI run where 8 readers drifted apart (94 evictions), the router grew
//! by 1.31x the bound. Not counted: rows a same-node reader maps.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use rustc_hash::FxHashMap;
use tokio::sync::watch;

use crate::store::{Column, ColumnRef};

/// Where the cache gets a peer unit's rows and versions: the manager, which
/// holds the cache. The cache names none of the manager's types, so the
/// two depend on each other one way (the manager on the cache).
pub trait Source: Sync {
    /// A peer unit.
    type Peer: Sync;
    /// A fetch's frames shown to a get that forwards them.
    type Tap: Sync;
    type Error: Send + std::fmt::Display;
    /// The peer unit's name (the cache's key).
    fn peer_name(p: &Self::Peer) -> &str;
    /// Tells the tap that the rows come otherwise than from one fetch.
    fn not_forwarded(tap: &Self::Tap);
    /// The error for a row the fetch did not bring.
    fn not_fetched() -> Self::Error;
    /// The peer's incarnation and the versions of `fields` x `indexes`.
    fn versions(
        &self,
        p: &Self::Peer,
        indexes: &[u64],
        fields: &[String],
    ) -> impl std::future::Future<Output = Result<(u64, Vec<u64>), Self::Error>> + Send;
    /// The rows of `fields` x `indexes`, per field, with the peer's
    /// incarnation and their versions.
    fn fetch(
        &self,
        p: &Self::Peer,
        indexes: &[u64],
        fields: &[String],
        tap: Option<&Self::Tap>,
    ) -> impl std::future::Future<Output = Result<PeerRows, Self::Error>> + Send;
}

/// Per row of a field: the column it is in and its row there.
pub type FieldRows = Vec<(ColumnRef, u32)>;

/// What a fetch brought.
pub struct PeerRows {
    /// Per field, per row.
    pub rows: Vec<FieldRows>,
    /// The peer's incarnation.
    pub incarnation: u64,
    /// The rows' versions, field-major.
    pub versions: Vec<u64>,
    /// Alive while any slice of the fetch's frames is (see [`tracked`]).
    pub alive: Weak<()>,
}

/// A fetch's frames, each wrapped (no copy) so that every slice of them
/// holds `token`; its `Weak` says when the last slice is gone. The cache
/// receives a fetch's frames through this, so that it can count the bytes
/// of an evicted fetch that gets still hold (see the module doc). The
/// frames a forwarding get is shown while they arrive hold the same token
/// ([`track`]).
pub fn tracked(frames: &[Bytes], token: Arc<()>) -> (Vec<Bytes>, Weak<()>) {
    let wrapped = frames.iter().map(|f| track(f, &token)).collect();
    (wrapped, Arc::downgrade(&token))
}

/// `frame`, wrapped (no copy) so that every slice of it holds `token`.
pub fn track(frame: &Bytes, token: &Arc<()>) -> Bytes {
    Bytes::from_owner(Tracked {
        bytes: frame.clone(),
        _token: token.clone(),
    })
}

/// A frame and its fetch's token.
struct Tracked {
    bytes: Bytes,
    _token: Arc<()>,
}

impl AsRef<[u8]> for Tracked {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

/// Per field, per row: found yet or not.
type Slots = Vec<Vec<Option<(ColumnRef, u32)>>>;

/// Counters of the read cache, as `stats` and `/metrics` show them.
#[derive(Debug, Default)]
pub struct CacheCounters {
    /// (field, row) values served from the cache.
    pub hits: AtomicU64,
    /// (field, row) values fetched from a peer unit.
    pub misses: AtomicU64,
    /// (field, row) values taken from another get's fetch in flight.
    pub shared: AtomicU64,
    /// Bytes of hits and shared rows: what did not cross the network again.
    pub saved_bytes: AtomicU64,
    /// Bytes fetched from peer units.
    pub fetched_bytes: AtomicU64,
    /// Fetches evicted to stay under the bound.
    pub evictions: AtomicU64,
}

/// One cached row.
struct Entry {
    incarnation: u64,
    version: u64,
    column: ColumnRef,
    row: u32,
    /// The fetch that brought it.
    batch: u64,
}

/// The rows one fetch brought: evicted together.
struct Batch {
    peer: String,
    fields: Vec<String>,
    indexes: Vec<u64>,
    bytes: u64,
    tick: u64,
    /// Its rows still cached: at 0 the fetch is dropped (its buffers
    /// freed, or back in the receive pool, once no get holds them).
    live: u64,
    /// Alive while any slice of its frames is.
    alive: Weak<()>,
}

/// What a fetch brought, for the gets that waited for it.
struct Fetched {
    fields: Vec<String>,
    /// The indexes fetched, in order (a get may name one twice).
    indexes: Vec<u64>,
    at: FxHashMap<u64, usize>,
    rows: Vec<FieldRows>,
    incarnation: u64,
    versions: Vec<u64>,
    alive: Weak<()>,
}

type FlightResult = Option<Result<Arc<Fetched>, String>>;

#[derive(Default)]
struct Inner {
    /// peer -> field -> global index -> row.
    rows: HashMap<String, HashMap<String, FxHashMap<u64, Entry>>>,
    /// peer -> field -> global index -> the fetch in flight for it.
    flights: HashMap<String, HashMap<String, FxHashMap<u64, watch::Receiver<FlightResult>>>>,
    batches: HashMap<u64, Batch>,
    /// Least recently used first: tick -> batch.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    next_batch: u64,
    bytes: u64,
    /// Bytes room was made for, for fetches in flight (see
    /// [`ReadCache::reserve`]).
    reserved: u64,
    /// peer -> field -> bytes per row of its last fetch: what the next
    /// fetch of that field is expected to bring.
    row_size: HashMap<String, HashMap<String, u64>>,
    /// Fetches no longer kept whose rows gets still hold: (alive, bytes).
    held: Vec<(Weak<()>, u64)>,
}

/// The read cache (see the module doc).
pub struct ReadCache {
    max_bytes: u64,
    inner: Mutex<Inner>,
    pub counters: CacheCounters,
}

impl std::fmt::Debug for ReadCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadCache")
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

/// Removes a get's flights when it ends, however it ends (a get dropped
/// mid-fetch included: its waiters then fetch themselves).
struct Landing<'a> {
    cache: &'a ReadCache,
    peer: &'a str,
    keys: Vec<(String, Vec<u64>)>,
    rx: watch::Receiver<FlightResult>,
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        let mut inner = self.cache.lock();
        let Some(by_field) = inner.flights.get_mut(self.peer) else {
            return;
        };
        for (field, indexes) in &self.keys {
            if let Some(map) = by_field.get_mut(field) {
                for g in indexes {
                    if map.get(g).is_some_and(|rx| rx.same_channel(&self.rx)) {
                        map.remove(g);
                    }
                }
                if map.is_empty() {
                    by_field.remove(field);
                }
            }
        }
        if by_field.is_empty() {
            inner.flights.remove(self.peer);
        }
    }
}

/// The most fields per peer whose bytes per row are remembered (see
/// [`ReadCache::reserve`]); past it the memory starts over, and a fetch of
/// a field not remembered makes no room before it lands.
const MAX_KNOWN_FIELDS: usize = 4096;

/// Room made in the cache for a fetch in flight; given back when dropped.
struct Reservation<'a> {
    cache: &'a ReadCache,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.cache.lock().reserved -= self.bytes;
        }
    }
}

fn row_bytes(column: &Column, row: u32) -> u64 {
    column.row_len(row as usize)
}

impl ReadCache {
    /// A cache of at most `max_bytes` bytes of rows.
    pub fn new(max_bytes: u64) -> ReadCache {
        ReadCache {
            max_bytes,
            inner: Mutex::new(Inner::default()),
            counters: CacheCounters::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The bound, bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Bytes of rows kept now.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// Bytes of fetches no longer kept whose rows gets still hold (a reply
    /// being written): counted against the bound until they go.
    pub fn held_bytes(&self) -> u64 {
        self.lock().held_bytes()
    }

    /// `fields` of `indexes` of peer unit `p`, per field, per index (see
    /// the module doc).
    pub async fn get<S: Source>(
        &self,
        m: &S,
        p: &S::Peer,
        indexes: &[u64],
        fields: &[String],
        tap: Option<&S::Tap>,
    ) -> Result<Vec<FieldRows>, S::Error> {
        let name = S::peer_name(p);
        let n = indexes.len();
        let (tx, rx) = watch::channel::<FlightResult>(None);
        let mut out: Slots = vec![vec![None; n]; fields.len()];
        // Rows to fetch (any field), and the fields they are fetched for.
        let (mut need, mut need_field) = (vec![false; n], vec![false; fields.len()]);
        let mut waits: Vec<(watch::Receiver<FlightResult>, usize, usize)> = Vec::new();
        let (mut hits, mut hit_bytes) = (0u64, 0u64);
        let (incarnation, versions, landing) =
            match self.claim_untouched(name, indexes, fields, &rx) {
                // Nothing of these rows is kept or being fetched: fetch them at
                // once, their versions with them (no versions round trip).
                Some(landing) => {
                    need.fill(true);
                    need_field.fill(true);
                    (0, Vec::new(), landing)
                }
                None => {
                    if let Some(tap) = tap {
                        S::not_forwarded(tap);
                    }
                    let (incarnation, versions) = m.versions(p, indexes, fields).await?;
                    let mut landing = Landing {
                        cache: self,
                        peer: name,
                        keys: Vec::new(),
                        rx: rx.clone(),
                    };
                    let mut inner = self.lock();
                    let mut touched: Vec<u64> = Vec::new();
                    let mut stale: Vec<(usize, u64)> = Vec::new();
                    for (f, field) in fields.iter().enumerate() {
                        let cached = inner.rows.get(name).and_then(|m| m.get(field));
                        let flying = inner.flights.get(name).and_then(|m| m.get(field));
                        let mut mine = Vec::new();
                        for (i, &g) in indexes.iter().enumerate() {
                            let version = versions[f * n + i];
                            if version != 0
                                && let Some(e) = cached.and_then(|c| c.get(&g))
                                && e.incarnation == incarnation
                                && e.version == version
                            {
                                hits += 1;
                                hit_bytes += row_bytes(&e.column, e.row);
                                if touched.last() != Some(&e.batch) {
                                    touched.push(e.batch);
                                }
                                out[f][i] = Some((e.column.clone(), e.row));
                            } else if version != 0
                                && let Some(flight) = flying.and_then(|fl| fl.get(&g))
                            {
                                waits.push((flight.clone(), f, i));
                            } else {
                                if cached.is_some_and(|c| c.contains_key(&g)) {
                                    stale.push((f, g));
                                }
                                need[i] = true;
                                need_field[f] = true;
                                mine.push(g);
                            }
                        }
                        if !mine.is_empty() {
                            landing.keys.push((field.clone(), mine));
                        }
                    }
                    touched.sort_unstable();
                    touched.dedup();
                    for b in touched {
                        inner.touch(b);
                    }
                    // Rows whose version moved on: dropped now, not at eviction.
                    for (f, g) in stale {
                        inner.remove(name, &fields[f], g);
                    }
                    inner.fly(name, &landing.keys, &rx);
                    drop(inner);
                    (incarnation, versions, landing)
                }
            };
        let c = &self.counters;
        c.hits.fetch_add(hits, Ordering::Relaxed);
        c.saved_bytes.fetch_add(hit_bytes, Ordering::Relaxed);
        if need.iter().any(|&b| b) {
            // Only a fetch of every row (nothing kept or in flight) is
            // shown to a forwarding get: the versions path said otherwise.
            let result = self
                .fetch(m, p, indexes, fields, &need, &need_field, &mut out, tap)
                .await;
            let _ = tx.send(Some(
                result.as_ref().map(Arc::clone).map_err(|e| e.to_string()),
            ));
            result?;
        }
        drop(landing);
        // Rows another get was fetching: theirs if at least our version.
        let mut again = vec![false; n];
        let mut again_field = vec![false; fields.len()];
        let (mut shared, mut shared_bytes) = (0u64, 0u64);
        for (mut flight, f, i) in waits {
            let got = match flight.wait_for(Option::is_some).await {
                Ok(v) => v.clone().and_then(Result::ok),
                Err(_) => None,
            };
            let used = got.and_then(|fetched| {
                let ff = fetched.fields.iter().position(|x| *x == fields[f])?;
                let at = *fetched.at.get(&indexes[i])?;
                let version = fetched.versions[ff * fetched.indexes.len() + at];
                (fetched.incarnation == incarnation && version >= versions[f * n + i])
                    .then(|| fetched.rows[ff][at].clone())
            });
            match used {
                Some(row) => {
                    shared += 1;
                    shared_bytes += row_bytes(&row.0, row.1);
                    out[f][i] = Some(row);
                }
                None => {
                    again[i] = true;
                    again_field[f] = true;
                }
            }
        }
        c.shared.fetch_add(shared, Ordering::Relaxed);
        c.saved_bytes.fetch_add(shared_bytes, Ordering::Relaxed);
        if again.iter().any(|&b| b) {
            self.fetch(m, p, indexes, fields, &again, &again_field, &mut out, None)
                .await?;
        }
        out.into_iter()
            .map(|rows| {
                rows.into_iter()
                    .map(|r| r.ok_or_else(S::not_fetched))
                    .collect()
            })
            .collect()
    }

    /// If no (field, index) of the request is kept or in flight, registers
    /// this get's flight for all of them and returns its landing.
    fn claim_untouched<'a>(
        &'a self,
        peer: &'a str,
        indexes: &[u64],
        fields: &[String],
        rx: &watch::Receiver<FlightResult>,
    ) -> Option<Landing<'a>> {
        let mut inner = self.lock();
        for field in fields {
            let cached = inner.rows.get(peer).and_then(|m| m.get(field));
            let flying = inner.flights.get(peer).and_then(|m| m.get(field));
            if let Some(c) = cached
                && indexes.iter().any(|g| c.contains_key(g))
            {
                return None;
            }
            if let Some(fl) = flying
                && indexes.iter().any(|g| fl.contains_key(g))
            {
                return None;
            }
        }
        let keys: Vec<(String, Vec<u64>)> = fields
            .iter()
            .map(|f| (f.clone(), indexes.to_vec()))
            .collect();
        inner.fly(peer, &keys, rx);
        Some(Landing {
            cache: self,
            peer,
            keys,
            rx: rx.clone(),
        })
    }

    /// Fetches the rows `need` marks, of the fields `need_field` marks,
    /// keeps them, and fills the empty slots of `out` with them.
    #[allow(clippy::too_many_arguments)]
    async fn fetch<S: Source>(
        &self,
        m: &S,
        p: &S::Peer,
        indexes: &[u64],
        fields: &[String],
        need: &[bool],
        need_field: &[bool],
        out: &mut Slots,
        tap: Option<&S::Tap>,
    ) -> Result<Arc<Fetched>, S::Error> {
        let name = S::peer_name(p);
        let rows: Vec<u64> = indexes
            .iter()
            .zip(need)
            .filter_map(|(&g, &b)| b.then_some(g))
            .collect();
        let fetch_fields: Vec<String> = fields
            .iter()
            .zip(need_field)
            .filter(|(_, b)| **b)
            .map(|(f, _)| f.clone())
            .collect();
        let room = self.reserve(name, &fetch_fields, rows.len() as u64);
        let got = m.fetch(p, &rows, &fetch_fields, tap).await?;
        let fetched = Arc::new(Fetched {
            at: rows.iter().enumerate().map(|(i, &g)| (g, i)).collect(),
            indexes: rows.clone(),
            fields: fetch_fields,
            rows: got.rows,
            incarnation: got.incarnation,
            versions: got.versions,
            alive: got.alive,
        });
        let mut bytes = 0u64;
        let mut sizes = Vec::with_capacity(fetched.fields.len());
        for field_rows in &fetched.rows {
            let b = field_rows
                .iter()
                .map(|(c, r)| row_bytes(c, *r))
                .sum::<u64>();
            sizes.push(b.div_ceil(rows.len().max(1) as u64));
            bytes += b;
        }
        let c = &self.counters;
        c.misses.fetch_add(
            (rows.len() * fetched.fields.len()) as u64,
            Ordering::Relaxed,
        );
        c.fetched_bytes.fetch_add(bytes, Ordering::Relaxed);
        let mut ff = 0;
        for (f, slots) in out.iter_mut().enumerate() {
            if !need_field[f] {
                continue;
            }
            let mut k = 0;
            for (i, slot) in slots.iter_mut().enumerate() {
                if need[i] {
                    if slot.is_none() {
                        *slot = Some(fetched.rows[ff][k].clone());
                    }
                    k += 1;
                }
            }
            ff += 1;
        }
        {
            let mut inner = self.lock();
            let known = inner.row_size.entry(name.to_string()).or_default();
            for (field, size) in fetched.fields.iter().zip(sizes) {
                // Field names are the clients': a bounded memory of them.
                if known.len() >= MAX_KNOWN_FIELDS && !known.contains_key(field) {
                    known.clear();
                }
                known.insert(field.clone(), size);
            }
        }
        drop(room);
        self.keep(name, &fetched, bytes);
        Ok(fetched)
    }

    /// Makes room for a fetch of `rows` rows of `fields` from `peer` before
    /// it is sent, so that the rows in flight stay within the bound too:
    /// the least recently used fetches are evicted until the rows kept,
    /// the room made for other fetches and this one's fit. Its size is
    /// expected from the last fetch of each field (a field never fetched
    /// from that peer expects nothing). The evicted rows' pages go back to
    /// the receive pool, where the fetch's frames are then received.
    fn reserve(&self, peer: &str, fields: &[String], rows: u64) -> Reservation<'_> {
        let mut inner = self.lock();
        let per_row: u64 = inner
            .row_size
            .get(peer)
            .map_or(0, |known| fields.iter().filter_map(|f| known.get(f)).sum());
        let bytes = per_row.saturating_mul(rows);
        if bytes == 0 || bytes > self.max_bytes {
            return Reservation {
                cache: self,
                bytes: 0,
            };
        }
        let evicted = inner.make_room(bytes, self.max_bytes);
        inner.reserved += bytes;
        drop(inner);
        self.counters
            .evictions
            .fetch_add(evicted, Ordering::Relaxed);
        Reservation { cache: self, bytes }
    }

    /// Keeps a fetch's rows (if it fits), evicting the least recently used
    /// fetches to stay under the bound (with the room made for other
    /// fetches in flight).
    fn keep(&self, peer: &str, fetched: &Fetched, bytes: u64) {
        if bytes > self.max_bytes {
            return;
        }
        let mut inner = self.lock();
        let evicted = inner.make_room(bytes, self.max_bytes);
        self.counters
            .evictions
            .fetch_add(evicted, Ordering::Relaxed);
        let id = inner.next_batch;
        inner.next_batch += 1;
        inner.tick += 1;
        let tick = inner.tick;
        let n = fetched.indexes.len();
        let indexes = fetched.indexes.clone();
        let by_field = inner.rows.entry(peer.to_string()).or_default();
        let mut replaced = Vec::new();
        let mut live = 0u64;
        for (ff, field) in fetched.fields.iter().enumerate() {
            let map = by_field.entry(field.clone()).or_default();
            for (i, &g) in indexes.iter().enumerate() {
                let (column, row) = fetched.rows[ff][i].clone();
                let old = map.insert(
                    g,
                    Entry {
                        incarnation: fetched.incarnation,
                        version: fetched.versions[ff * n + i],
                        column,
                        row,
                        batch: id,
                    },
                );
                match old {
                    // The same index twice in one fetch: one entry.
                    Some(e) if e.batch == id => {}
                    Some(e) => {
                        replaced.push(e.batch);
                        live += 1;
                    }
                    None => live += 1,
                }
            }
        }
        for batch in replaced {
            inner.release(batch);
        }
        inner.batches.insert(
            id,
            Batch {
                peer: peer.to_string(),
                fields: fetched.fields.clone(),
                live,
                indexes,
                bytes,
                tick,
                alive: fetched.alive.clone(),
            },
        );
        inner.lru.insert(tick, id);
        inner.bytes += bytes;
    }
}

impl ReadCache {
    /// Drops every field of `indexes` of peer unit `peer` (they were put or
    /// cleared through this stowd: their versions moved on).
    pub fn forget(&self, peer: &str, indexes: &[u64]) {
        let mut inner = self.lock();
        let fields: Vec<String> = match inner.rows.get(peer) {
            Some(by_field) => by_field.keys().cloned().collect(),
            None => return,
        };
        for field in &fields {
            for &g in indexes {
                inner.remove(peer, field, g);
            }
        }
    }
}

impl Inner {
    /// Evicts the least recently used fetches until `bytes` more fit under
    /// `max` beside the rows kept, the room made for fetches in flight and
    /// the rows gets still hold (or nothing is left to evict). Returns the
    /// fetches evicted.
    fn make_room(&mut self, bytes: u64, max: u64) -> u64 {
        let mut evicted = 0;
        let mut held = self.held_bytes();
        while self.bytes + self.reserved + held + bytes > max {
            let Some((_, oldest)) = self.lru.pop_first() else {
                break;
            };
            // A fetch a get still holds frees nothing yet: it is held now.
            held += self.evict(oldest);
            evicted += 1;
        }
        evicted
    }

    /// The bytes of fetches no longer kept that gets still hold (those
    /// gone since are forgotten).
    fn held_bytes(&mut self) -> u64 {
        self.held.retain(|(alive, _)| alive.strong_count() > 0);
        self.held.iter().map(|(_, b)| b).sum()
    }

    /// A fetch no longer kept: held if a get still holds its rows (its
    /// bytes, returned), else gone.
    fn dropped(&mut self, b: Batch) -> u64 {
        if b.alive.strong_count() == 0 {
            return 0;
        }
        self.held.push((b.alive, b.bytes));
        b.bytes
    }

    /// Registers the flight `rx` for `keys` (field, indexes) of `peer`.
    fn fly(&mut self, peer: &str, keys: &[(String, Vec<u64>)], rx: &watch::Receiver<FlightResult>) {
        let by_field = self.flights.entry(peer.to_string()).or_default();
        for (field, indexes) in keys {
            let map = by_field.entry(field.clone()).or_default();
            map.reserve(indexes.len());
            for &g in indexes {
                map.insert(g, rx.clone());
            }
        }
    }

    /// Removes one cached row, and its fetch once no row of it is left.
    fn remove(&mut self, peer: &str, field: &str, g: u64) {
        let Some(by_field) = self.rows.get_mut(peer) else {
            return;
        };
        let Some(map) = by_field.get_mut(field) else {
            return;
        };
        let Some(e) = map.remove(&g) else { return };
        if map.is_empty() {
            by_field.remove(field);
            if by_field.is_empty() {
                self.rows.remove(peer);
            }
        }
        self.release(e.batch);
    }

    /// One row of fetch `batch` is no longer cached.
    fn release(&mut self, batch: u64) {
        let Some(b) = self.batches.get_mut(&batch) else {
            return;
        };
        b.live = b.live.saturating_sub(1);
        if b.live == 0 {
            let b = self.batches.remove(&batch).expect("present");
            self.lru.remove(&b.tick);
            self.bytes -= b.bytes;
            self.dropped(b);
        }
    }

    /// Marks a fetch used now.
    fn touch(&mut self, batch: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(b) = self.batches.get_mut(&batch) {
            self.lru.remove(&b.tick);
            b.tick = tick;
            self.lru.insert(tick, batch);
        }
    }

    /// Drops a fetch and the rows it brought that are still its own;
    /// returns its bytes if gets still hold them (see [`Inner::dropped`]).
    fn evict(&mut self, batch: u64) -> u64 {
        let Some(b) = self.batches.remove(&batch) else {
            return 0;
        };
        self.lru.remove(&b.tick);
        self.bytes -= b.bytes;
        if let Some(by_field) = self.rows.get_mut(&b.peer) {
            for field in &b.fields {
                if let Some(map) = by_field.get_mut(field) {
                    for g in &b.indexes {
                        if map.get(g).is_some_and(|e| e.batch == batch) {
                            map.remove(g);
                        }
                    }
                    if map.is_empty() {
                        by_field.remove(field);
                    }
                }
            }
            if by_field.is_empty() {
                self.rows.remove(&b.peer);
            }
        }
        self.dropped(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Field;
    use crate::extent::Received;
    use crate::tensor::{Dtype, Tensor};

    /// A peer unit whose every row is `ROW` bytes of one value at version
    /// 1; each fetch brings its rows in a frame of its own, received
    /// through [`tracked`] as the manager's are.
    struct Peer {
        fetches: AtomicU64,
    }

    const ROW: usize = 1000;

    impl Source for Peer {
        type Peer = ();
        type Tap = ();
        type Error = String;
        fn peer_name(_: &()) -> &str {
            "peer"
        }
        fn not_forwarded(_: &()) {}
        fn not_fetched() -> String {
            "not fetched".into()
        }
        async fn versions(
            &self,
            _: &(),
            indexes: &[u64],
            fields: &[String],
        ) -> Result<(u64, Vec<u64>), String> {
            Ok((1, vec![1; indexes.len() * fields.len()]))
        }
        async fn fetch(
            &self,
            _: &(),
            indexes: &[u64],
            fields: &[String],
            _: Option<&()>,
        ) -> Result<PeerRows, String> {
            self.fetches.fetch_add(1, Ordering::Relaxed);
            let n = indexes.len();
            let frame = Bytes::from(vec![7u8; n * ROW]);
            let (frames, alive) = tracked(std::slice::from_ref(&frame), Arc::new(()));
            let received = Received::frames(&frames);
            let t = Tensor::contiguous(frames[0].clone(), Dtype::Uint8, vec![n as u64, ROW as u64])
                .map_err(|e| e.to_string())?;
            let column = ColumnRef::new(Column::from_field(Field::Regular(t), &received));
            let rows = fields
                .iter()
                .map(|_| (0..n as u32).map(|r| (column.clone(), r)).collect())
                .collect();
            Ok(PeerRows {
                rows,
                incarnation: 1,
                versions: vec![1; n * fields.len()],
                alive,
            })
        }
    }

    async fn get(cache: &ReadCache, peer: &Peer, first: u64) -> Vec<FieldRows> {
        let indexes: Vec<u64> = (first..first + 10).collect();
        cache
            .get(peer, &(), &indexes, &["x".to_string()], None)
            .await
            .expect("get")
    }

    /// Room for three fetches of 10 rows. A get holds the first fetch's
    /// rows (a reply still being written) while four more are fetched:
    /// the first, evicted, is counted as held, so the cache evicts one
    /// more to stay within the bound; once the get lets go, it is not
    /// held any more.
    #[tokio::test]
    async fn rows_a_get_holds_after_their_eviction_count_against_the_bound() {
        let bound = 3 * 10 * ROW as u64;
        let cache = ReadCache::new(bound);
        let peer = Peer {
            fetches: AtomicU64::new(0),
        };
        let held = get(&cache, &peer, 0).await;
        assert!(held[0].iter().all(|(c, r)| match c.cell(*r as usize) {
            crate::batch::Cell::Tensor(t) => t.contiguous_bytes() == [7u8; ROW][..],
            crate::batch::Cell::Value(_) => false,
        }));
        for first in [10, 20] {
            get(&cache, &peer, first).await;
        }
        assert_eq!((cache.bytes(), cache.held_bytes()), (bound, 0));
        // Kept rows are served from the cache, not fetched again.
        get(&cache, &peer, 10).await;
        assert_eq!(peer.fetches.load(Ordering::Relaxed), 3);
        for first in [30, 40] {
            get(&cache, &peer, first).await;
            assert!(
                cache.bytes() + cache.held_bytes() <= bound,
                "kept {} + held {} over the bound {bound}",
                cache.bytes(),
                cache.held_bytes()
            );
        }
        assert_eq!(
            cache.held_bytes(),
            10 * ROW as u64,
            "the first fetch, still held"
        );
        assert_eq!(cache.bytes(), 2 * 10 * ROW as u64);
        drop(held);
        assert_eq!(cache.held_bytes(), 0, "let go");
        // The rows held then are fetched again: they were evicted.
        get(&cache, &peer, 0).await;
        assert_eq!(peer.fetches.load(Ordering::Relaxed), 6);
    }
}
