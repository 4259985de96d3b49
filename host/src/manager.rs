//! The manager: routes a batch to units and back.
//!
//! Global index `g` goes to unit `g % N` (units in configuration order), the
//! rule TransferQueue's client uses. For each (field, unit) the field's
//! selection chain plans which rows go there; the plan is validated and
//! executed, so rows going to a unit are zero-copy views where the plan
//! allows. A local unit stores those rows directly. A remote unit (a
//! TransferQueue storage-unit endpoint: another `stowd` or TransferQueue's
//! own) receives them as `PUT` messages of at most `max_message_bytes`; per
//! field and message the packing chain decides between one frame per row
//! (zero copy) and one coalesced frame (one copy), the two layouts the
//! TransferQueue wire format allows; that forwarding is in `manager/remote.rs`.
//!
//! Every service reaches the store through a manager: the router and
//! native endpoints through the node's, a TransferQueue unit endpoint and a
//! peer's request naming a unit through that unit's own
//! ([`Manager::over_unit`], which stores puts as they arrived). Checkpoints
//! and restores are manager operations too (`manager/checkpoint.rs`).

pub mod checkpoint;
pub mod dedup;
mod peer;
mod remote;
#[cfg(test)]
mod tests;

pub use peer::{FetchTap, PeerUnit, TapEvent, frame_layout};

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use smallvec::SmallVec;

use crate::batch::{Cell, Field};
use crate::config::LimitsConfig;
use crate::extent::{Extent, Received};
use crate::metrics::DataCounters;
use crate::plan::{self, Selected, SelectionPlan};
use crate::policy::SelectRequest;
use crate::policy::chain::{ChainError, DecidedBy, Decision, Shared};
use crate::policy::registry::Registry;
use crate::shm::{SegmentStore, ShmError};
use crate::store::{Column, Columns, Piece, PutChecked, PutField, Rows, Seq, StoreError, Unit};
use crate::tensor::Tensor;
use crate::transport::{Peer, TransportError};
use crate::wire::indexes::Indexes;
use crate::wire::tq;

/// Where a unit lives.
#[derive(Clone, Debug)]
pub enum Target {
    /// An in-process unit.
    Local(Arc<Unit>),
    /// A remote TransferQueue storage-unit endpoint.
    Remote(Arc<Peer>),
    /// A unit of another `stowd`, spoken to in `stowage/1`.
    Peer(Arc<PeerUnit>),
}

impl Target {
    /// Name for errors and logs.
    pub fn name(&self) -> String {
        match self {
            Target::Local(u) => u.id().to_string(),
            Target::Remote(p) => p.endpoint().to_string(),
            Target::Peer(p) => p.name.clone(),
        }
    }
}

/// Why a same-node get failed.
#[derive(Debug, thiserror::Error)]
pub enum GetSharedError {
    #[error(transparent)]
    Manager(ManagerError),
    #[error(transparent)]
    Shm(ShmError),
}

/// Why a routed request failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManagerError {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Policy(#[from] ChainError),
    #[error("unit {unit}: {message}")]
    Remote {
        unit: String,
        message: String,
        key_not_found: bool,
    },
    #[error("unit {unit}: {source}")]
    Transport {
        unit: String,
        source: TransportError,
    },
    /// A peer unit answered with an error; its `stowage/1` code is kept.
    #[error("unit {unit}: {message}")]
    Peer {
        unit: String,
        code: &'static str,
        message: String,
    },
    #[error("internal: {0}")]
    Internal(String),
}

impl ManagerError {
    /// True for a missing (index, field).
    pub fn is_key_not_found(&self) -> bool {
        matches!(self, ManagerError::Store(StoreError::KeyNotFound { .. }))
            || matches!(
                self,
                ManagerError::Remote {
                    key_not_found: true,
                    ..
                }
            )
            || matches!(self, ManagerError::Peer { code, .. } if *code == crate::wire::native::code::KEY_NOT_FOUND)
    }
}

/// Routes batches over a fixed list of units.
///
/// The policy registry is swapped atomically by hot reload
/// ([`Manager::swap_registry`]); a request loads the registry once when it
/// starts and finishes on that snapshot, so a request in flight never mixes
/// two versions of a plugin.
pub struct Manager {
    targets: Vec<Target>,
    registry: ArcSwap<Registry>,
    limits: LimitsConfig,
    timeout: Duration,
    sender_id: String,
    pub counters: DataCounters,
    /// Rows of peer units kept on this node, if enabled.
    cache: Option<Arc<crate::cache::ReadCache>>,
    /// Field-name patterns whose puts are deduplicated ([`dedup`]).
    dedup: Vec<String>,
    pub dedup_counters: dedup::DedupCounters,
    /// Puts stored as they arrived, with no selection ([`Manager::over_unit`]).
    as_received: bool,
    /// Every target is a local unit (a get needs no future per unit).
    all_local: bool,
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager")
            .field("targets", &self.targets)
            .finish()
    }
}

/// The data counters of one put's selections, added to the manager's
/// [`DataCounters`] once (a few atomic additions a put, not a few a
/// (field, unit) pair).
#[derive(Default)]
struct Tally {
    plugin_decisions: u64,
    builtin_decisions: u64,
    fallbacks: u64,
    zero_copy_bytes: u64,
    copied_bytes: u64,
    /// The row shape of the last regular column made, for the next one to
    /// share ([`Column::regular_sharing`]).
    row_shape: Option<Arc<[u64]>>,
}

impl Tally {
    fn add_to(&self, c: &DataCounters) {
        for (counter, n) in [
            (&c.plugin_decisions, self.plugin_decisions),
            (&c.builtin_decisions, self.builtin_decisions),
            (&c.fallbacks, self.fallbacks),
            (&c.zero_copy_bytes, self.zero_copy_bytes),
            (&c.copied_bytes, self.copied_bytes),
        ] {
            if n > 0 {
                counter.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

/// What the columns of views of one regular field share, whichever rows a
/// unit gets: worked out once a field of a put, where it was once a
/// (unit, field) pair (a 32-field put over 4 units recomputed each row's
/// bytes, stride and shape and searched the frames for the field 128
/// times).
struct FieldView<'f> {
    t: &'f Tensor,
    extent: Arc<Extent>,
    base: usize,
    row_bytes: usize,
    row_stride: usize,
    row_shape: Arc<[u64]>,
}

impl<'f> FieldView<'f> {
    /// `None` for a field whose views the general path makes: not
    /// regular, no row axis, no bytes, or bytes the request did not bring.
    fn of(field: &'f Field, received: &Received, last: &mut Option<Arc<[u64]>>) -> Option<Self> {
        let Field::Regular(t) = field else {
            return None;
        };
        if t.shape().is_empty() || t.buffer().is_empty() {
            return None;
        }
        let (extent, base) = received.locate(t.buffer())?;
        Some(FieldView {
            t,
            extent,
            base,
            row_bytes: t.row_bytes(),
            row_stride: t.row_stride(),
            row_shape: crate::store::shared_row_shape(last, t.row_shape()),
        })
    }

    /// The columns of a plan of views of the field, made straight from
    /// it: what [`plan::execute_selection`] and
    /// [`Column::regular_sharing`] make of it (the same extent, offset,
    /// stride, rows and counts), without a view tensor a piece (a slice of
    /// the field's bytes made and dropped, its shape copied) or a search
    /// of the frames a piece. `None` for any other plan, and for a view
    /// the general path refuses or that has no rows: the general path
    /// handles those.
    fn columns(&self, plan: &SelectionPlan, c: &mut Tally) -> Option<Columns> {
        let rows = self.t.rows();
        let fits = |v: &plan::RowView| {
            v.count > 0
                && v.step > 0
                && (v.count - 1)
                    .checked_mul(v.step)
                    .and_then(|x| x.checked_add(v.start))
                    .is_some_and(|last| last < rows)
        };
        let views = plan.pieces.iter().map(|p| match p {
            plan::Piece::View(v) => Some(v),
            _ => None,
        });
        if !views.clone().all(|v| v.is_some_and(fits)) {
            return None;
        }
        let mut columns = Columns::with_capacity(plan.pieces.len());
        for v in views.flatten() {
            c.zero_copy_bytes += v.count * self.row_bytes as u64;
            columns.push(Column::Regular(crate::store::RegularColumn {
                extent: self.extent.clone(),
                offset: self.base + v.start as usize * self.row_stride,
                stride: if v.count == 1 {
                    self.row_bytes
                } else {
                    self.row_stride * v.step as usize
                },
                rows: v.count,
                row_bytes: self.row_bytes,
                dtype: self.t.dtype(),
                row_shape: self.row_shape.clone(),
            }));
        }
        Some(columns)
    }
}

/// Positions (into the batch) and global indexes that go to one unit.
struct Route {
    positions: Vec<u64>,
    indexes: Vec<u64>,
}

impl Manager {
    pub fn new(
        targets: Vec<Target>,
        registry: Arc<Registry>,
        limits: LimitsConfig,
        timeout: Duration,
        sender_id: String,
    ) -> Manager {
        Manager {
            all_local: targets.iter().all(|t| matches!(t, Target::Local(_))),
            targets,
            registry: ArcSwap::new(registry),
            limits,
            timeout,
            sender_id,
            counters: DataCounters::default(),
            cache: None,
            dedup: Vec::new(),
            dedup_counters: Default::default(),
            as_received: false,
        }
    }

    /// A manager over one local unit that stores each put as it arrived,
    /// with no selection policy and no deduplication: what a TransferQueue
    /// unit endpoint answers with (TransferQueue's own unit stores what its
    /// client sent) and what a peer's request naming the unit reaches (the
    /// peer's policies chose its rows). `registry` is the node's; no chain
    /// of it runs here.
    pub fn over_unit(unit: Arc<Unit>, registry: Arc<Registry>, limits: LimitsConfig) -> Manager {
        let id = unit.id().to_string();
        let mut m = Manager::new(
            vec![Target::Local(unit)],
            registry,
            limits,
            Duration::ZERO,
            id,
        );
        m.as_received = true;
        m
    }

    /// The one unit of a manager made by [`Manager::over_unit`].
    pub fn unit(&self) -> Option<&Arc<Unit>> {
        match (self.as_received, self.targets.as_slice()) {
            (true, [Target::Local(u)]) => Some(u),
            _ => None,
        }
    }

    /// The same manager, deduplicating the rows of fields whose name
    /// matches one of `patterns` within each put ([`dedup`]).
    pub fn with_dedup(mut self, patterns: Vec<String>) -> Manager {
        self.dedup = patterns;
        self
    }

    /// The same manager, keeping peer units' rows in `cache`.
    pub fn with_cache(mut self, cache: Option<Arc<crate::cache::ReadCache>>) -> Manager {
        self.cache = cache;
        self
    }

    /// The read cache, if enabled.
    pub fn cache(&self) -> Option<&Arc<crate::cache::ReadCache>> {
        self.cache.as_ref()
    }

    pub fn targets(&self) -> &[Target] {
        &self.targets
    }

    /// Every unit, in routing order, if all are local; else how many are
    /// remote (a checkpoint cannot be written or restored for them).
    pub fn all_local(&self) -> Result<Vec<Arc<Unit>>, usize> {
        let locals: Vec<Arc<Unit>> = self
            .targets
            .iter()
            .filter_map(|t| match t {
                Target::Local(u) => Some(u.clone()),
                Target::Remote(_) | Target::Peer(_) => None,
            })
            .collect();
        match self.targets.len() - locals.len() {
            0 => Ok(locals),
            remote => Err(remote),
        }
    }

    /// The local unit that holds `global_index`, if it is local.
    pub fn local_unit(&self, global_index: u64) -> Option<&Arc<Unit>> {
        match &self.targets[(global_index % self.targets.len() as u64) as usize] {
            Target::Local(u) => Some(u),
            Target::Remote(_) | Target::Peer(_) => None,
        }
    }

    /// The live registry (a snapshot: it stays valid after a swap).
    pub fn registry(&self) -> Arc<Registry> {
        self.registry.load_full()
    }

    /// Makes `next` the live registry; returns the previous one. Requests
    /// already running keep the snapshot they loaded.
    pub fn swap_registry(&self, next: Arc<Registry>) -> Arc<Registry> {
        self.registry.swap(next)
    }

    fn routes(&self, global_indexes: &[u64]) -> Vec<Route> {
        let n = self.targets.len() as u64;
        // Sized exactly: a unit that gets no rows allocates nothing.
        let mut counts: SmallVec<[usize; 16]> = smallvec::smallvec![0; n as usize];
        for &g in global_indexes {
            counts[(g % n) as usize] += 1;
        }
        let mut routes: Vec<Route> = counts
            .iter()
            .map(|&c| Route {
                positions: Vec::with_capacity(c),
                indexes: Vec::with_capacity(c),
            })
            .collect();
        for (pos, &g) in global_indexes.iter().enumerate() {
            let r = &mut routes[(g % n) as usize];
            r.positions.push(pos as u64);
            r.indexes.push(g);
        }
        routes
    }

    fn check_size(&self, rows: u64, fields: usize) -> Result<(), ManagerError> {
        if rows == 0 {
            return Err(ManagerError::BadRequest(
                "empty batch: no global indexes".into(),
            ));
        }
        if rows > self.limits.max_rows {
            return Err(ManagerError::BadRequest(format!(
                "{rows} rows in one request, the limit is {}",
                self.limits.max_rows
            )));
        }
        if fields as u64 > self.limits.max_fields {
            return Err(ManagerError::BadRequest(format!(
                "{fields} fields in one request, the limit is {}",
                self.limits.max_fields
            )));
        }
        Ok(())
    }

    /// Carries out a field's selection decision and returns the rows as
    /// columns: views into the request's buffers (`received`) where the plan
    /// allows, a gather's output otherwise.
    fn execute(
        &self,
        field: &Field,
        view: Option<&FieldView<'_>>,
        decision: &Decision<SelectionPlan>,
        received: &Received,
        c: &mut Tally,
    ) -> Result<Columns, ManagerError> {
        match &decision.by {
            DecidedBy::Plugin(_) => c.plugin_decisions += 1,
            DecidedBy::Builtin => c.builtin_decisions += 1,
            DecidedBy::Fallback { .. } => c.fallbacks += 1,
        };
        if let Some(columns) = view.and_then(|v| v.columns(&decision.plan, c)) {
            return Ok(columns);
        }
        let selected = plan::execute_selection(field, &decision.plan)
            .map_err(|e| ManagerError::Internal(e.to_string()))?;
        let mut columns = Columns::with_capacity(selected.len());
        for piece in selected {
            match piece {
                Selected::Rows(t) => {
                    let (extent, offset, zero_copy) = received.locate_or_own(t.buffer());
                    let counter = if zero_copy {
                        &mut c.zero_copy_bytes
                    } else {
                        &mut c.copied_bytes
                    };
                    *counter += t.payload_len() as u64;
                    columns.push(Column::regular_sharing(
                        extent,
                        offset,
                        &t,
                        &mut c.row_shape,
                    ));
                }
                Selected::NestedRows(rows) => {
                    let bytes: usize = rows.iter().map(Tensor::payload_len).sum();
                    c.zero_copy_bytes += bytes as u64;
                    columns.push(Column::from_field(Field::Nested(rows), received));
                }
                Selected::Packed { buffer, rows } => {
                    c.copied_bytes += buffer.len() as u64;
                    // The packed buffer is the rows' one extent.
                    let own = Received::frames(std::slice::from_ref(&buffer));
                    columns.push(Column::from_field(Field::Nested(rows), &own));
                }
                Selected::Values(v) => columns.push(Column::Values(v)),
            }
        }
        Ok(columns)
    }

    /// Decides and carries out the selection of every (field, unit) pair
    /// of a put: fields that share a selection chain are decided in one
    /// chain call (one entry into each `stowage:policy@0.2.0` plugin for
    /// all their pairs), then each unit's columns are built. `None` for a
    /// unit that gets no rows.
    #[allow(clippy::type_complexity)]
    fn select_all(
        &self,
        registry: &Registry,
        global_indexes: &[u64],
        fields: &[(Arc<str>, Field)],
        received: &Received,
    ) -> Result<Vec<Option<(Vec<u64>, Vec<PutField>)>>, ManagerError> {
        let routes = self.routes(global_indexes);
        // Fields by selection chain, in order of first appearance.
        let mut groups: SmallVec<[(Option<usize>, SmallVec<[usize; 8]>); 2]> = SmallVec::new();
        for (f, (name, _)) in fields.iter().enumerate() {
            let at = registry.select_chain_at(name);
            match groups.iter_mut().find(|(a, _)| *a == at) {
                Some((_, members)) => members.push(f),
                None => groups.push((at, smallvec::smallvec![f])),
            }
        }
        // decisions[unit * fields + field], in one list: the group's
        // decisions and the one taken for it (the chain's `Shared::Same`,
        // one plan for the fields of one layout at a unit, resolved).
        let nf = fields.len();
        let busy: SmallVec<[&[u64]; 8]> = routes
            .iter()
            .filter(|r| !r.positions.is_empty())
            .map(|r| r.positions.as_slice())
            .collect();
        let mut decided: SmallVec<[Arc<Vec<Shared>>; 2]> = SmallVec::new();
        let mut decisions: Vec<Option<(u32, u32)>> = vec![None; routes.len() * nf];
        for (at, members) in &groups {
            if busy.is_empty() {
                break;
            }
            let mut requests = Vec::with_capacity(busy.len() * members.len());
            let mut slots = Vec::with_capacity(busy.len() * members.len());
            for (u, route) in routes.iter().enumerate() {
                if route.positions.is_empty() {
                    continue;
                }
                for &f in members {
                    requests.push(SelectRequest::new(&fields[f].1, &route.positions));
                    slots.push(u * nf + f);
                }
            }
            let chain = registry.select_chain_of(*at);
            // The requests are the group's fields at each busy unit, in
            // that order: their shape, for a put shaped like the last.
            let shape = chain.shape_of(members.iter().map(|&f| &fields[f].1), busy.iter().copied());
            let group = chain.select_many_shared(&requests, shape)?;
            let g = decided.len() as u32;
            for (k, (&slot, d)) in slots.iter().zip(group.iter()).enumerate() {
                let of = match d {
                    Shared::Decided(_) => k,
                    Shared::Same(j) => *j,
                };
                decisions[slot] = Some((g, of as u32));
            }
            decided.push(group);
        }
        drop(busy);
        let decision = |slot: usize| match decisions[slot] {
            Some((g, k)) => match &decided[g as usize][k as usize] {
                Shared::Decided(d) => Some(d),
                Shared::Same(_) => None,
            },
            None => None,
        };
        let mut tally = Tally::default();
        // Each name once, shared by the units (the last one busy takes
        // these, the others a clone: a reference count is an atomic
        // operation, about 7 ns here); so is what a field's views share.
        let mut names: SmallVec<[Arc<str>; 8]> = fields.iter().map(|(n, _)| n.clone()).collect();
        let last_busy = routes.iter().rposition(|r| !r.positions.is_empty());
        let views: SmallVec<[Option<FieldView<'_>>; 8]> = fields
            .iter()
            .map(|(_, f)| FieldView::of(f, received, &mut tally.row_shape))
            .collect();
        let mut per_unit = Vec::with_capacity(routes.len());
        let build = || -> Result<(), ManagerError> {
            for (u, route) in routes.into_iter().enumerate() {
                if route.positions.is_empty() {
                    per_unit.push(None);
                    continue;
                }
                let mut unit_fields = Vec::with_capacity(nf);
                let mut taken =
                    (Some(u) == last_busy).then(|| std::mem::take(&mut names).into_iter());
                for (f, ((_, field), view)) in fields.iter().zip(&views).enumerate() {
                    let name = match &mut taken {
                        Some(kept) => kept.next().expect("a name a field"),
                        None => names[f].clone(),
                    };
                    let d = decision(u * nf + f).ok_or_else(|| {
                        ManagerError::Internal(format!("no selection decision for field {name}"))
                    })?;
                    let columns = self.execute(field, view.as_ref(), d, received, &mut tally)?;
                    unit_fields.push((name, columns));
                }
                per_unit.push(Some((route.indexes, unit_fields)));
            }
            Ok(())
        };
        let built = build();
        // Counted as they were taken, a put that fails here too.
        tally.add_to(&self.counters);
        built.map(|()| per_unit)
    }

    /// Stores a batch: each global index on its unit, each field's rows
    /// chosen by its selection chain. Every local unit's part is checked
    /// (capacity included) before any unit is written, so a refused put
    /// leaves the local units untouched (barring a concurrent put racing
    /// between check and write); then units are written one after the other,
    /// each unit's part all-or-nothing.
    ///
    /// `received` holds the request's buffers: rows selected as views of
    /// them are stored as offsets into them (zero copy).
    pub async fn put(
        &self,
        global_indexes: &[u64],
        fields: Vec<(Arc<str>, Field)>,
        received: &Received,
    ) -> Result<(), ManagerError> {
        if let Some(unit) = self.unit() {
            let columns = fields
                .into_iter()
                .map(|(name, f)| {
                    let columns: Columns = smallvec::smallvec![Column::from_field(f, received)];
                    (name, columns)
                })
                .collect();
            return Ok(unit.put(global_indexes, columns)?);
        }
        self.check_size(global_indexes.len() as u64, fields.len())?;
        for (name, field) in &fields {
            if field.rows() != global_indexes.len() as u64 {
                return Err(ManagerError::BadRequest(format!(
                    "field {name} has {} rows for {} global indexes",
                    field.rows(),
                    global_indexes.len()
                )));
            }
        }
        if let Some(g) = crate::store::duplicate(global_indexes) {
            return Err(ManagerError::Store(StoreError::DuplicateIndex(g)));
        }
        // Plan and execute every selection before storing anything, so a
        // policy rejection leaves every unit untouched. One registry
        // snapshot for the whole request.
        let registry = self.registry.load_full();
        let plan_all = || self.select_all(&registry, global_indexes, &fields, received);
        // On the runtime's worker: a plugin leaves it (`block_in_place`)
        // only when it is entered, after taking its instance, once per
        // plugin per request under stowage:policy@0.2.0 (never for a memo
        // hit). Until 0.2.0 the whole planning left the worker, behind a
        // semaphore of one turn per core: 40 entries a put, each leaving
        // the worker, had made tokio start a replacement worker per entry
        // (196 threads under 64 clients, docs/benchmarks.md).
        let mut per_unit = plan_all()?;
        self.dedup_put(&fields, &mut per_unit);
        let mut checked: SmallVec<[Option<PutChecked>; 8]> = SmallVec::new();
        for (target, part) in self.targets.iter().zip(&per_unit) {
            checked.push(match (target, part) {
                (Target::Local(unit), Some((indexes, unit_fields))) => {
                    Some(unit.check_put(indexes, unit_fields)?)
                }
                _ => None,
            });
        }
        // Remote units first, all at once: they are the ones that can fail
        // now (network, their own capacity). If one fails, the rows sent to
        // the others in this put are cleared again (best effort), and no
        // local unit has been written: the put's keys end up absent, never
        // half new. Local units were checked above and are written last.
        let mut sends = Vec::new();
        for (target, part) in self.targets.iter().zip(per_unit.iter_mut()) {
            let (Some((indexes, unit_fields)), false) =
                (part.as_mut(), matches!(target, Target::Local(_)))
            else {
                continue;
            };
            let (indexes, unit_fields) = (std::mem::take(indexes), std::mem::take(unit_fields));
            let registry = &registry;
            sends.push(async move {
                let sent = match target {
                    Target::Remote(peer) => {
                        self.put_remote(registry, peer, &indexes, unit_fields).await
                    }
                    Target::Peer(p) => self.put_peer(registry, p, &indexes, unit_fields).await,
                    Target::Local(_) => unreachable!("local units are written below"),
                };
                (target, indexes, sent)
            });
        }
        let sent = futures_util::future::join_all(sends).await;
        if let Some(e) = sent.iter().find_map(|(_, _, r)| r.as_ref().err()) {
            let e = e.to_string();
            for (target, indexes, r) in &sent {
                if r.is_ok()
                    && let Err(undo) = self.clear_target(target, indexes, None).await
                {
                    tracing::error!(unit = %target.name(), error = %undo, "could not undo a failed put");
                }
            }
            return Err(sent
                .into_iter()
                .find_map(|(_, _, r)| r.err())
                .unwrap_or(ManagerError::Internal(e)));
        }
        // Every local unit's indexes journaled at once (they share one
        // journal): a journal that cannot be written refuses the put on
        // every unit, and the remote units' rows are cleared again.
        let local: Vec<u64> = self
            .targets
            .iter()
            .zip(&per_unit)
            .filter(|(t, _)| matches!(t, Target::Local(_)))
            .filter_map(|(_, part)| part.as_ref())
            .flat_map(|(indexes, _)| indexes.iter().copied())
            .collect();
        let Some(journal) = self.targets.iter().find_map(|t| match t {
            Target::Local(u) => Some(u.journal().clone()),
            _ => None,
        }) else {
            return Ok(());
        };
        let failed = match journal.touch(&local) {
            Ok(journaled) => {
                for ((target, part), checked) in self.targets.iter().zip(per_unit).zip(checked) {
                    if let (Target::Local(unit), Some((indexes, unit_fields)), Some(checked)) =
                        (target, part, checked)
                    {
                        unit.put_journaled(&indexes, unit_fields, &journaled, checked)?;
                    }
                }
                return Ok(());
            }
            Err(e) => e.to_string(),
        };
        for (target, indexes, _) in &sent {
            if let Err(undo) = self.clear_target(target, indexes, None).await {
                tracing::error!(unit = %target.name(), error = %undo, "could not undo a failed put");
            }
        }
        Err(ManagerError::Store(StoreError::Journal(failed)))
    }

    /// Deduplicates the rows local units are about to store for fields
    /// whose name `[dedup] fields` matches.
    #[allow(clippy::type_complexity)]
    fn dedup_put(
        &self,
        fields: &[(Arc<str>, Field)],
        per_unit: &mut [Option<(Vec<u64>, Vec<PutField>)>],
    ) {
        for (f, (name, _)) in fields.iter().enumerate() {
            if !self
                .dedup
                .iter()
                .any(|p| crate::policy::registry::glob_match(p, name))
            {
                continue;
            }
            let mut units: Vec<dedup::UnitFields<'_>> = self
                .targets
                .iter()
                .zip(per_unit.iter_mut())
                .map(|(t, part)| match (t, part) {
                    (Target::Local(_), Some((_, fields))) => Some(fields),
                    _ => None,
                })
                .collect();
            dedup::field(&mut units, f, &self.dedup_counters);
        }
    }

    /// The runs of `global_indexes` each target gets: index `g` goes to
    /// target `g % n`, so a run whose step is a multiple of `n` goes whole
    /// to one target, and any other run splits into at most `n` runs with
    /// `n / gcd(step, n)` times its step (a run of step 1 over 4 units: 4
    /// runs of step 4). Per run, not per index.
    fn seq_routes(&self, global_indexes: &Indexes) -> Vec<Vec<Seq>> {
        let n = self.targets.len() as u64;
        let mut routes: Vec<Vec<Seq>> = vec![Vec::new(); n as usize];
        let mut pos = 0u64;
        for r in global_indexes.runs() {
            let period = n / gcd(r.step % n, n);
            for j in 0..period.min(r.count) {
                let count = (r.count - j).div_ceil(period);
                let start = r.start + j * r.step;
                routes[(start % n) as usize].push(Seq {
                    start,
                    step: if count > 1 { r.step * period } else { 0 },
                    count,
                    pos: pos + j,
                    pos_step: period,
                });
            }
            pos += r.count;
        }
        routes
    }

    /// The rows of `fields` at `global_indexes`, in request order: per
    /// field, the columns they are in (local units' and rows received from
    /// remote units) and the pieces that answer each position.
    pub async fn get(
        &self,
        global_indexes: &Indexes,
        fields: &[String],
    ) -> Result<Vec<(String, Rows)>, ManagerError> {
        self.get_tapped(global_indexes, fields, &[]).await
    }

    /// Per target (in [`Manager::targets`] order) that holds rows of
    /// `global_indexes`: its number and the request positions of its rows,
    /// in the order a get asks it for them; `None` unless every such
    /// target is a peer unit (a get a router may forward as it arrives).
    pub fn peer_positions(&self, global_indexes: &Indexes) -> Option<Vec<(usize, Vec<u64>)>> {
        if !self.targets.iter().any(|t| matches!(t, Target::Peer(_))) {
            return None; // a stowd without peer units: nothing to route
        }
        let mut out = Vec::new();
        for (t, (target, seqs)) in self
            .targets
            .iter()
            .zip(self.seq_routes(global_indexes))
            .enumerate()
        {
            if seqs.is_empty() {
                continue;
            }
            if !matches!(target, Target::Peer(_)) {
                return None;
            }
            let positions = seqs
                .iter()
                .flat_map(|s| (0..s.count).map(move |k| s.pos + k * s.pos_step))
                .collect();
            out.push((t, positions));
        }
        Some(out)
    }

    /// [`Manager::get`], showing each peer unit's fetch to `taps[t]` for
    /// target `t` (if there is one): a router forwards a peer's reply to
    /// its client while it arrives (`server/native/forward.rs`).
    pub async fn get_tapped(
        &self,
        global_indexes: &Indexes,
        fields: &[String],
        taps: &[Option<FetchTap>],
    ) -> Result<Vec<(String, Rows)>, ManagerError> {
        let rows = self.get_rows_tapped(global_indexes, fields, taps).await?;
        Ok(fields.iter().cloned().zip(rows).collect())
    }

    /// [`Manager::get`]'s rows, one [`Rows`] a field in `fields`' order,
    /// without the names: a caller that owns the names pairs them itself
    /// (a get's reply took a copy of each asked name, about 320
    /// instructions a field with its free).
    pub async fn get_rows(
        &self,
        global_indexes: &Indexes,
        fields: &[String],
    ) -> Result<Vec<Rows>, ManagerError> {
        self.get_rows_tapped(global_indexes, fields, &[]).await
    }

    async fn get_rows_tapped(
        &self,
        global_indexes: &Indexes,
        fields: &[String],
        taps: &[Option<FetchTap>],
    ) -> Result<Vec<Rows>, ManagerError> {
        self.check_size(global_indexes.len(), fields.len())?;
        if fields.is_empty() {
            return Err(ManagerError::BadRequest("no fields requested".into()));
        }
        let mut out: Vec<Rows> = fields.iter().map(|_| Rows::default()).collect();
        let routes = self.seq_routes(global_indexes);
        let add = |out: &mut Vec<Rows>, got: Vec<Rows>| {
            for (into, rows) in out.iter_mut().zip(got) {
                let base = into.columns.len() as u32;
                into.columns.extend(rows.columns);
                into.pieces.extend(rows.pieces.into_iter().map(|p| Piece {
                    column: base + p.column,
                    ..p
                }));
            }
        };
        if self.all_local {
            // Local units answer at once: no future per unit.
            for (t, (target, seqs)) in self.targets.iter().zip(routes).enumerate() {
                if let (Target::Local(unit), false) = (target, seqs.is_empty()) {
                    if let Some(tap) = taps.get(t).and_then(Option::as_ref) {
                        tap.send(TapEvent::NotForwarded);
                    }
                    unit.get_into(&seqs, fields, None, &mut out)?;
                }
            }
            return Ok(out);
        }
        // Every unit at once: remote units' transfers overlap.
        let gets = self
            .targets
            .iter()
            .zip(routes)
            .enumerate()
            .filter(|(_, (_, seqs))| !seqs.is_empty())
            .map(|(t, (target, seqs))| {
                let tap = taps.get(t).and_then(Option::as_ref);
                self.get_target(target, seqs, fields, tap)
            });
        for got in futures_util::future::join_all(gets).await {
            add(&mut out, got?);
        }
        Ok(out)
    }

    /// One unit's rows of a get, per field.
    async fn get_target(
        &self,
        target: &Target,
        seqs: Vec<Seq>,
        fields: &[String],
        tap: Option<&FetchTap>,
    ) -> Result<Vec<Rows>, ManagerError> {
        if let Some(tap) = tap
            && !matches!(target, Target::Peer(_))
        {
            tap.send(TapEvent::NotForwarded);
        }
        let unit = match target {
            Target::Local(unit) => return Ok(unit.get_seqs(&seqs, fields)?),
            Target::Remote(_) | Target::Peer(_) => target.name(),
        };
        let (mut indexes, mut positions) = (Vec::new(), Vec::new());
        for s in &seqs {
            for k in 0..s.count {
                indexes.push(s.start + k * s.step);
                positions.push(s.pos + k * s.pos_step);
            }
        }
        // Boxed, as in `clear_target`.
        if let Target::Peer(p) = target {
            return Box::pin(self.get_peer(p, &indexes, &positions, fields, tap)).await;
        }
        let Target::Remote(peer) = target else {
            unreachable!("local and peer units are answered above")
        };
        let got = Box::pin(self.get_remote(peer, &indexes, fields)).await?;
        let mut rows_of = Vec::with_capacity(got.len());
        for cells in got {
            if cells.len() != positions.len() {
                return Err(ManagerError::Remote {
                    unit,
                    message: format!(
                        "returned {} rows for {} indexes",
                        cells.len(),
                        positions.len()
                    ),
                    key_not_found: false,
                });
            }
            let mut rows = Rows::default();
            for (column, (cell, &pos)) in cells.into_iter().zip(&positions).enumerate() {
                rows.columns
                    .push(crate::store::ColumnRef::new(Column::from_cell(cell)));
                rows.pieces.push(Piece {
                    pos,
                    pos_step: 1,
                    column: column as u32,
                    row: 0,
                    count: 1,
                });
            }
            rows_of.push(rows);
        }
        Ok(rows_of)
    }

    /// Clears `indexes` (only `fields`, if given) in one unit; the number
    /// of (index, field) values removed (for a TransferQueue unit, which
    /// does not say, the number of indexes sent).
    async fn clear_target(
        &self,
        target: &Target,
        indexes: &[u64],
        fields: Option<&[String]>,
    ) -> Result<u64, ManagerError> {
        // The exchanges with other processes are boxed: their futures are
        // large, and a future holding them inline makes every request that
        // awaits one (a put, a clear, over local units too) that large.
        match target {
            Target::Local(unit) => Ok(unit.clear(indexes, fields)?),
            Target::Peer(p) => Box::pin(self.clear_peer(p, indexes, fields)).await,
            Target::Remote(peer) => {
                let request = tq::Request::Clear {
                    global_indexes: indexes.to_vec(),
                };
                Box::pin(self.exchange(peer, &request)).await?;
                Ok(indexes.len() as u64)
            }
        }
    }

    /// [`Manager::get`] for a same-node reader: every extent the rows are in
    /// is in shared memory afterwards (moved there once, see
    /// [`crate::extent::share_all`]), unless `small` says the rows are
    /// better sent over the socket; whether they were shared.
    pub async fn get_shared(
        &self,
        global_indexes: &Indexes,
        fields: &[String],
        shm: &SegmentStore,
        small: impl FnOnce(&[(String, Rows)]) -> bool,
    ) -> Result<(Vec<(String, Rows)>, bool), GetSharedError> {
        let got = self
            .get(global_indexes, fields)
            .await
            .map_err(GetSharedError::Manager)?;
        if small(&got) {
            return Ok((got, false));
        }
        shm.touch();
        for (_, rows) in &got {
            rows.share(shm).map_err(GetSharedError::Shm)?;
        }
        Ok((got, true))
    }

    /// Drops the given indexes (only `fields`, if given) on every unit that
    /// holds them. Returns the (index, field) values removed from local
    /// units plus, for remote units (which do not report it), the number of
    /// indexes sent to them.
    pub async fn clear(
        &self,
        global_indexes: &[u64],
        fields: Option<&[String]>,
    ) -> Result<u64, ManagerError> {
        let routes = self.routes(global_indexes);
        // Refuse before clearing anything: a refused clear changes nothing.
        if fields.is_some()
            && self
                .targets
                .iter()
                .zip(&routes)
                .any(|(t, r)| matches!(t, Target::Remote(_)) && !r.indexes.is_empty())
        {
            return Err(ManagerError::BadRequest(
                "clearing single fields is not possible on a TransferQueue unit".into(),
            ));
        }
        // Remote units first (they can fail); then every local unit under
        // one journal record, so that a journal that cannot be written
        // clears nothing locally.
        let mut cleared = 0;
        let mut local = Vec::new();
        for (target, route) in self.targets.iter().zip(routes) {
            if route.indexes.is_empty() {
                continue;
            }
            match target {
                Target::Local(unit) => local.push((unit, route.indexes)),
                _ => cleared += self.clear_target(target, &route.indexes, fields).await?,
            }
        }
        let Some((first, _)) = local.first() else {
            return Ok(cleared);
        };
        let all: Vec<u64> = local.iter().flat_map(|(_, i)| i.iter().copied()).collect();
        let journaled = first
            .journal()
            .touch(&all)
            .map_err(|e| ManagerError::Store(StoreError::Journal(e.to_string())))?;
        for (unit, indexes) in &local {
            cleared += unit.clear_journaled(indexes, fields, &journaled);
        }
        Ok(cleared)
    }
}

/// Bytes helper: the payload of a cell (for tests and diagnostics).
pub fn cell_bytes(cell: &Cell) -> Bytes {
    match cell {
        Cell::Tensor(t) => t.contiguous_bytes(),
        Cell::Value(crate::batch::Value::Str(s)) => Bytes::copy_from_slice(s.as_bytes()),
        Cell::Value(crate::batch::Value::Bytes(b) | crate::batch::Value::Msgpack(b)) => b.clone(),
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}
