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
//! TransferQueue wire format allows.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;

use crate::batch::{Cell, Field};
use crate::config::LimitsConfig;
use crate::extent::Received;
use crate::metrics::DataCounters;
use crate::plan::{self, Frame, PieceInfo, Selected};
use crate::policy::chain::{ChainError, DecidedBy};
use crate::policy::registry::Registry;
use crate::shm::{SegmentStore, ShmError};
use crate::store::{Column, PutField, RowRef, Rows, StoreError, Unit};
use crate::tensor::Tensor;
use crate::transport::{Peer, TransportError};
use crate::wire::tq;

/// Where a unit lives.
#[derive(Clone, Debug)]
pub enum Target {
    /// An in-process unit.
    Local(Arc<Unit>),
    /// A remote TransferQueue storage-unit endpoint.
    Remote(Arc<Peer>),
}

impl Target {
    /// Name for errors and logs.
    pub fn name(&self) -> String {
        match self {
            Target::Local(u) => u.id().to_string(),
            Target::Remote(p) => p.endpoint().to_string(),
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
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager")
            .field("targets", &self.targets)
            .finish()
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
            targets,
            registry: ArcSwap::new(registry),
            limits,
            timeout,
            sender_id,
            counters: DataCounters::default(),
        }
    }

    pub fn targets(&self) -> &[Target] {
        &self.targets
    }

    /// The local unit that holds `global_index`, if it is local.
    pub fn local_unit(&self, global_index: u64) -> Option<&Arc<Unit>> {
        match &self.targets[(global_index % self.targets.len() as u64) as usize] {
            Target::Local(u) => Some(u),
            Target::Remote(_) => None,
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
        let each = global_indexes.len() / n as usize + 1;
        let mut routes: Vec<Route> = (0..n)
            .map(|_| Route {
                positions: Vec::with_capacity(each),
                indexes: Vec::with_capacity(each),
            })
            .collect();
        for (pos, &g) in global_indexes.iter().enumerate() {
            let r = &mut routes[(g % n) as usize];
            r.positions.push(pos as u64);
            r.indexes.push(g);
        }
        routes
    }

    fn check_size(&self, global_indexes: &[u64], fields: usize) -> Result<(), ManagerError> {
        if global_indexes.is_empty() {
            return Err(ManagerError::BadRequest(
                "empty batch: no global indexes".into(),
            ));
        }
        if global_indexes.len() as u64 > self.limits.max_rows {
            return Err(ManagerError::BadRequest(format!(
                "{} rows in one request, the limit is {}",
                global_indexes.len(),
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

    /// Selects the rows of `field` at `positions` through the field's chain
    /// and returns them as columns: views into the request's buffers
    /// (`received`) where the plan allows, a gather's output otherwise.
    fn select(
        &self,
        registry: &Registry,
        name: &str,
        field: &Field,
        positions: &[u64],
        received: &Received,
    ) -> Result<Vec<Column>, ManagerError> {
        let decision = registry.select_chain(name).select(field, positions)?;
        let c = &self.counters;
        match &decision.by {
            DecidedBy::Plugin(_) => c.plugin_decisions.fetch_add(1, Ordering::Relaxed),
            DecidedBy::Builtin => c.builtin_decisions.fetch_add(1, Ordering::Relaxed),
            DecidedBy::Fallback { .. } => c.fallbacks.fetch_add(1, Ordering::Relaxed),
        };
        let selected = plan::execute_selection(field, &decision.plan)
            .map_err(|e| ManagerError::Internal(e.to_string()))?;
        let mut columns = Vec::with_capacity(selected.len());
        for piece in selected {
            match piece {
                Selected::Rows(t) => {
                    let (extent, offset, zero_copy) = received.locate_or_own(t.buffer());
                    let counter = if zero_copy {
                        &c.zero_copy_bytes
                    } else {
                        &c.copied_bytes
                    };
                    counter.fetch_add(t.payload_len() as u64, Ordering::Relaxed);
                    columns.push(Column::regular(extent, offset, &t));
                }
                Selected::NestedRows(rows) => {
                    let bytes: usize = rows.iter().map(Tensor::payload_len).sum();
                    c.zero_copy_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
                    columns.push(Column::from_field(Field::Nested(rows), received));
                }
                Selected::Packed { buffer, rows } => {
                    c.copied_bytes
                        .fetch_add(buffer.len() as u64, Ordering::Relaxed);
                    // The packed buffer is the rows' one extent.
                    let own = Received::frames(std::slice::from_ref(&buffer));
                    columns.push(Column::from_field(Field::Nested(rows), &own));
                }
                Selected::Values(v) => columns.push(Column::Values(v)),
            }
        }
        Ok(columns)
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
        fields: Vec<(String, Field)>,
        received: &Received,
    ) -> Result<(), ManagerError> {
        self.check_size(global_indexes, fields.len())?;
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
        let mut per_unit = Vec::with_capacity(self.targets.len());
        for route in self.routes(global_indexes) {
            if route.positions.is_empty() {
                per_unit.push(None);
                continue;
            }
            let mut unit_fields = Vec::with_capacity(fields.len());
            for (name, field) in &fields {
                unit_fields.push((
                    name.clone(),
                    self.select(&registry, name, field, &route.positions, received)?,
                ));
            }
            per_unit.push(Some((route.indexes, unit_fields)));
        }
        for (target, part) in self.targets.iter().zip(&per_unit) {
            if let (Target::Local(unit), Some((indexes, unit_fields))) = (target, part) {
                unit.check_put(indexes, unit_fields)?;
            }
        }
        // Remote units first: they are the ones that can fail now (network,
        // their own capacity). If one fails, the rows already sent to other
        // remote units in this put are cleared again (best effort), and no
        // local unit has been written: the put's keys end up absent, never
        // half new. Local units were checked above and are written last.
        let mut written: Vec<(&Peer, Vec<u64>)> = Vec::new();
        for (target, part) in self.targets.iter().zip(per_unit.iter_mut()) {
            let (Target::Remote(peer), Some((indexes, unit_fields))) = (target, part.as_mut())
            else {
                continue;
            };
            match self
                .put_remote(&registry, peer, indexes, std::mem::take(unit_fields))
                .await
            {
                Ok(()) => written.push((peer.as_ref(), std::mem::take(indexes))),
                Err(e) => {
                    for (peer, indexes) in written {
                        let clear = tq::Request::Clear {
                            global_indexes: indexes,
                        };
                        if let Err(undo) = self.exchange(peer, &clear).await {
                            tracing::error!(unit = peer.endpoint(), error = %undo, "could not undo a failed put");
                        }
                    }
                    return Err(e);
                }
            }
        }
        for (target, part) in self.targets.iter().zip(per_unit) {
            if let (Target::Local(unit), Some((indexes, unit_fields))) = (target, part) {
                unit.put(&indexes, unit_fields)?;
            }
        }
        Ok(())
    }

    /// Sends one unit's rows to a remote unit in messages of bounded size.
    async fn put_remote(
        &self,
        registry: &Registry,
        peer: &Peer,
        indexes: &[u64],
        fields: Vec<PutField>,
    ) -> Result<(), ManagerError> {
        let fields: Vec<(String, Vec<Cell>)> = fields
            .into_iter()
            .map(|(name, columns)| (name, columns.iter().flat_map(Column::cells).collect()))
            .collect();
        let row_bytes: Vec<u64> = (0..indexes.len())
            .map(|i| fields.iter().map(|(_, c)| c[i].byte_len() as u64).sum())
            .collect();
        let tensor_fields = fields
            .iter()
            .filter(|(_, c)| matches!(c.first(), Some(Cell::Tensor(_))))
            .count()
            .max(1);
        let frame_budget = (self.limits.max_frames as usize).saturating_sub(1) / tensor_fields;
        let mut start = 0usize;
        while start < indexes.len() {
            // Rows [start, end): at most max_message_bytes (at least one row).
            let mut end = start;
            let mut bytes = 0u64;
            while end < indexes.len()
                && (end == start || bytes + row_bytes[end] <= self.limits.max_message_bytes)
            {
                bytes += row_bytes[end];
                end += 1;
            }
            let mut body = Vec::with_capacity(fields.len());
            for (name, cells) in &fields {
                body.push((
                    name.clone(),
                    self.pack_for_tq(registry, name, &cells[start..end], frame_budget.max(1))?,
                ));
            }
            let request = tq::Request::Put {
                global_indexes: indexes[start..end].to_vec(),
                fields: body,
            };
            self.exchange(peer, &request).await?;
            start = end;
        }
        Ok(())
    }

    /// Builds the TransferQueue value of one field for one message: one
    /// frame per row (zero copy) if the packing plan sends every row alone,
    /// otherwise one coalesced frame (one copy).
    fn pack_for_tq(
        &self,
        registry: &Registry,
        name: &str,
        cells: &[Cell],
        frame_budget: usize,
    ) -> Result<Field, ManagerError> {
        let tensors: Vec<&Tensor> = cells
            .iter()
            .filter_map(|c| match c {
                Cell::Tensor(t) => Some(t),
                Cell::Value(_) => None,
            })
            .collect();
        if tensors.len() != cells.len() {
            if !tensors.is_empty() {
                return Err(ManagerError::BadRequest(format!(
                    "field {name} mixes tensors and plain values"
                )));
            }
            let values = cells.iter().filter_map(|c| {
                if let Cell::Value(v) = c {
                    Some(v.clone())
                } else {
                    None
                }
            });
            return Ok(Field::Values(values.collect()));
        }
        let pieces: Vec<PieceInfo> = tensors
            .iter()
            .map(|t| PieceInfo {
                byte_len: t.payload_len() as u64,
                contiguous: t.is_contiguous(),
            })
            .collect();
        let mut limits = self.limits.pack_limits();
        limits.max_frames = frame_budget.min(u32::MAX as usize) as u32;
        let decision = registry.pack_chain(name).pack(&pieces, &limits);
        let all_single = matches!(&decision, Ok(d) if d.plan.frames.iter().all(|f| matches!(f, Frame::Single(_))));
        let uniform = tensors
            .windows(2)
            .all(|w| w[0].dtype() == w[1].dtype() && w[0].shape() == w[1].shape());
        let c = &self.counters;
        if all_single || !uniform {
            let bytes: usize = tensors.iter().map(|t| t.payload_len()).sum();
            c.zero_copy_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
            return Ok(Field::Nested(tensors.into_iter().cloned().collect()));
        }
        // One coalesced frame: the rows back to back, shape [k, ...row].
        let first = tensors[0];
        let total: usize = tensors.iter().map(|t| t.payload_len()).sum();
        let mut buf = bytes::BytesMut::with_capacity(total);
        for t in &tensors {
            buf.extend_from_slice(&t.contiguous_bytes());
        }
        c.copied_bytes.fetch_add(total as u64, Ordering::Relaxed);
        let mut shape = vec![tensors.len() as u64];
        shape.extend_from_slice(first.shape());
        let t = Tensor::contiguous(buf.freeze(), first.dtype(), shape)
            .map_err(|e| ManagerError::Internal(e.to_string()))?;
        Ok(Field::Regular(t))
    }

    /// One request/reply with a remote unit; error replies become errors.
    async fn exchange(
        &self,
        peer: &Peer,
        request: &tq::Request,
    ) -> Result<tq::Reply, ManagerError> {
        let frames = tq::encode_request(&self.sender_id, None, request).map_err(|e| {
            ManagerError::Internal(format!("encoding a request for {}: {e}", peer.endpoint()))
        })?;
        self.counters.messages_sent.fetch_add(1, Ordering::Relaxed);
        self.counters
            .frames_sent
            .fetch_add(frames.len() as u64, Ordering::Relaxed);
        let unit = peer.endpoint().to_string();
        let span = tracing::debug_span!("remote", unit = %unit, op = request.op_name(), frames = frames.len());
        let reply = tracing::Instrument::instrument(peer.request(frames, self.timeout), span)
            .await
            .map_err(|source| ManagerError::Transport {
                unit: unit.clone(),
                source,
            })?;
        let (_, reply) = tq::decode_reply(&reply).map_err(|e| ManagerError::Remote {
            unit: unit.clone(),
            message: format!("undecodable reply: {e}"),
            key_not_found: false,
        })?;
        match reply {
            tq::Reply::Error { message, .. } => {
                let key_not_found = message.starts_with(&format!("[{}]", tq::KEY_NOT_FOUND_MARKER));
                Err(ManagerError::Remote {
                    unit,
                    message,
                    key_not_found,
                })
            }
            ok => Ok(ok),
        }
    }

    /// The rows of `fields` at `global_indexes`, in request order: per
    /// field, the columns they are in (local units' and rows received from
    /// remote units) and one reference per index.
    pub async fn get(
        &self,
        global_indexes: &[u64],
        fields: &[String],
    ) -> Result<Vec<(String, Rows)>, ManagerError> {
        self.check_size(global_indexes, fields.len())?;
        if fields.is_empty() {
            return Err(ManagerError::BadRequest("no fields requested".into()));
        }
        let n = global_indexes.len();
        let unset = RowRef {
            column: u32::MAX,
            row: 0,
        };
        let mut out: Vec<Rows> = fields
            .iter()
            .map(|_| Rows {
                columns: Vec::new(),
                refs: vec![unset; n],
            })
            .collect();
        for (target, route) in self.targets.iter().zip(self.routes(global_indexes)) {
            if route.positions.is_empty() {
                continue;
            }
            let got: Vec<Rows> = match target {
                Target::Local(unit) => unit.get(&route.indexes, fields)?,
                Target::Remote(peer) => self
                    .get_remote(peer, &route.indexes, fields)
                    .await?
                    .into_iter()
                    .map(|cells| Rows {
                        refs: (0..cells.len() as u32)
                            .map(|column| RowRef { column, row: 0 })
                            .collect(),
                        columns: cells
                            .into_iter()
                            .map(|c| Arc::new(Column::from_cell(c)))
                            .collect(),
                    })
                    .collect(),
            };
            for (f, rows) in got.into_iter().enumerate() {
                if rows.refs.len() != route.positions.len() {
                    return Err(ManagerError::Remote {
                        unit: target.name(),
                        message: format!(
                            "returned {} rows for {} indexes",
                            rows.refs.len(),
                            route.positions.len()
                        ),
                        key_not_found: false,
                    });
                }
                let into = &mut out[f];
                let base = into.columns.len() as u32;
                into.columns.extend(rows.columns);
                for (pos, r) in route.positions.iter().zip(rows.refs) {
                    into.refs[*pos as usize] = RowRef {
                        column: base + r.column,
                        row: r.row,
                    };
                }
            }
        }
        Ok(fields.iter().cloned().zip(out).collect())
    }

    /// [`Manager::get`] for a same-node reader: every extent the rows are in
    /// is in shared memory afterwards (moved there once, see
    /// [`crate::extent::share_all`]).
    pub async fn get_shared(
        &self,
        global_indexes: &[u64],
        fields: &[String],
        shm: &SegmentStore,
    ) -> Result<Vec<(String, Rows)>, GetSharedError> {
        let got = self
            .get(global_indexes, fields)
            .await
            .map_err(GetSharedError::Manager)?;
        for (_, rows) in &got {
            rows.share(shm).map_err(GetSharedError::Shm)?;
        }
        Ok(got)
    }

    /// Gets rows from a remote unit in messages of at most `max_frames`
    /// frames (the reply carries one frame per tensor row).
    async fn get_remote(
        &self,
        peer: &Peer,
        indexes: &[u64],
        fields: &[String],
    ) -> Result<Vec<Vec<Cell>>, ManagerError> {
        let per_message =
            ((self.limits.max_frames as usize).saturating_sub(1) / fields.len().max(1)).max(1);
        let mut out: Vec<Vec<Cell>> = fields
            .iter()
            .map(|_| Vec::with_capacity(indexes.len()))
            .collect();
        for chunk in indexes.chunks(per_message) {
            let request = tq::Request::Get {
                global_indexes: chunk.to_vec(),
                fields: fields.to_vec(),
            };
            match self.exchange(peer, &request).await? {
                tq::Reply::GetData { fields: got } => {
                    for (f, cells) in reorder_fields(fields, got, peer.endpoint())?
                        .into_iter()
                        .enumerate()
                    {
                        out[f].extend(cells);
                    }
                }
                other => {
                    return Err(ManagerError::Remote {
                        unit: peer.endpoint().into(),
                        message: format!("unexpected reply {}", other.request_type()),
                        key_not_found: false,
                    });
                }
            }
        }
        Ok(out)
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
        let mut cleared = 0;
        for (target, route) in self.targets.iter().zip(routes) {
            if route.indexes.is_empty() {
                continue;
            }
            match target {
                Target::Local(unit) => cleared += unit.clear(&route.indexes, fields),
                Target::Remote(peer) => {
                    self.exchange(
                        peer,
                        &tq::Request::Clear {
                            global_indexes: route.indexes.clone(),
                        },
                    )
                    .await?;
                    cleared += route.indexes.len() as u64;
                }
            }
        }
        Ok(cleared)
    }
}

/// Puts a remote GET reply's fields in the order we asked for them.
fn reorder_fields(
    asked: &[String],
    got: Vec<(String, Vec<Cell>)>,
    unit: &str,
) -> Result<Vec<Vec<Cell>>, ManagerError> {
    let mut got: Vec<Option<(String, Vec<Cell>)>> = got.into_iter().map(Some).collect();
    asked
        .iter()
        .map(|name| {
            got.iter_mut()
                .find(|g| g.as_ref().is_some_and(|(n, _)| n == name))
                .and_then(Option::take)
                .map(|(_, cells)| cells)
                .ok_or_else(|| ManagerError::Remote {
                    unit: unit.into(),
                    message: format!("reply lacks field {name}"),
                    key_not_found: false,
                })
        })
        .collect()
}

/// Bytes helper: the payload of a cell (for tests and diagnostics).
pub fn cell_bytes(cell: &Cell) -> Bytes {
    match cell {
        Cell::Tensor(t) => t.contiguous_bytes(),
        Cell::Value(crate::batch::Value::Str(s)) => Bytes::copy_from_slice(s.as_bytes()),
        Cell::Value(crate::batch::Value::Bytes(b) | crate::batch::Value::Msgpack(b)) => b.clone(),
    }
}
