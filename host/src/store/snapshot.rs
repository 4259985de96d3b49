//! Every row of a unit at once: a consistent snapshot for a checkpoint,
//! and replacing the unit's rows with a snapshot read back.

use std::sync::Arc;

use super::{Column, Loc, StoreError, Unit};
use crate::batch::Cell;

/// Every row of a unit: per field (by name), its (global index, cell)
/// pairs in global-index order.
pub type Snapshot = Vec<(Arc<str>, Vec<(u64, Cell)>)>;

impl Unit {
    /// Every stored row, by field, each with its global index, taken under
    /// the unit's lock: a consistent snapshot (the cells share the stored
    /// extents, nothing is copied). Fields and rows in global-index order.
    pub fn snapshot(&self) -> Snapshot {
        let inner = self.lock();
        let mut out: Snapshot = inner
            .fields
            .iter()
            .filter(|(_, index)| !index.is_empty())
            .map(|(name, index)| {
                let mut rows: Vec<(u64, Cell)> = index
                    .iter()
                    .map(|(g, packed)| {
                        let loc = Loc::unpack(packed);
                        let slot = inner.columns[loc.column as usize]
                            .as_ref()
                            .expect("indexed rows point at live columns");
                        (g, slot.column.cell(loc.row as usize))
                    })
                    .collect();
                rows.sort_unstable_by_key(|(g, _)| *g);
                (name.clone(), rows)
            })
            .collect();
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Replaces everything the unit holds with `rows` (a [`Unit::snapshot`]
    /// read back), checked first: if they do not fit the unit's capacity
    /// nothing changes. Each row becomes a column of its own.
    pub fn replace_with(&self, rows: Snapshot) -> Result<(), StoreError> {
        self.check_replace(&rows)?;
        let present: Vec<u64> = {
            let inner = self.lock();
            let mut v: Vec<u64> = inner.present.iter().map(|(g, _)| g).collect();
            v.sort_unstable();
            v
        };
        self.clear(&present, None)?;
        for (field, field_rows) in rows {
            let indexes: Vec<u64> = field_rows.iter().map(|(g, _)| *g).collect();
            let columns = field_rows
                .into_iter()
                .map(|(_, cell)| Column::from_cell(cell))
                .collect();
            self.put(&indexes, vec![(field.to_string(), columns)])?;
        }
        Ok(())
    }

    /// Whether `rows` would fit the unit's capacity in place of what it
    /// holds.
    pub fn check_replace(&self, rows: &Snapshot) -> Result<(), StoreError> {
        let needed: u64 = rows
            .iter()
            .flat_map(|(_, r)| r.iter().map(|(_, c)| c.byte_len() as u64))
            .sum();
        if let Some(capacity) = self.capacity
            && needed > capacity
        {
            return Err(StoreError::Capacity {
                unit: self.id.clone(),
                needed,
                free: capacity,
                capacity,
            });
        }
        Ok(())
    }
}
