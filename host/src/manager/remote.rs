//! The manager's side of remote units: a remote unit is a TransferQueue
//! storage-unit endpoint (another `stowd` or TransferQueue's own), spoken to
//! over [`crate::transport::Peer`]. This file holds the forwarding: puts sent
//! as `PUT` messages of at most `max_message_bytes` (per field and message
//! the packing chain picks one frame per row or one coalesced frame), gets
//! in messages of at most `max_frames` frames, and the one request/reply
//! exchange every remote operation goes through.

use std::sync::atomic::Ordering;

use crate::batch::{Cell, Field};
use crate::plan::{Frame, PieceInfo};
use crate::policy::registry::Registry;
use crate::store::{Column, PutField};
use crate::tensor::Tensor;
use crate::transport::Peer;
use crate::wire::tq;

use super::{Manager, ManagerError};

impl Manager {
    /// Sends one unit's rows to a remote unit in messages of bounded size.
    pub(super) async fn put_remote(
        &self,
        registry: &Registry,
        peer: &Peer,
        indexes: &[u64],
        fields: Vec<PutField>,
    ) -> Result<(), ManagerError> {
        let fields: Vec<(String, Vec<Cell>)> = fields
            .into_iter()
            .map(|(name, columns)| {
                (
                    name.to_string(),
                    columns.iter().flat_map(Column::cells).collect(),
                )
            })
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
    pub(super) fn pack_for_tq(
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
    pub(super) async fn exchange(
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

    /// Gets rows from a remote unit in messages of at most `max_frames`
    /// frames (the reply carries one frame per tensor row).
    pub(super) async fn get_remote(
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
