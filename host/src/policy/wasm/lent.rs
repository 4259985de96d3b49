//! The tensor handle: the field a `select` call lends to the guest as a
//! `borrow<tensor>` resource, and the host side of its methods (layout,
//! dtype, and `read`, which copies at most `read_cap` bytes of the field's
//! logical byte stream).
//!
//! `stowage:policy@0.1.0` lends each field as its own `tensor` handle;
//! 0.2.0 lends all the fields of a call as one `fields` handle
//! ([`LentFields`]) and passes their layouts as data. Both resources are
//! written over [`LentField`]'s methods, which answer plain host types, in
//! their version's module (`since_v0_1_0`, `since_v0_2_0`).
//!
//! A lent field's dtype is its tensor's own: the wire and the contract share
//! one `Dtype` (the dtype table of `stowage-plan`), so nothing is converted
//! here; the generated WIT enums are matched in the version modules.

use stowage_plan::Dtype;

use crate::batch::Field;
use crate::policy::FieldKind;

/// A field lent to a guest for one call.
pub struct LentField {
    pub(super) field: Field,
    pub(super) read_cap: u64,
    /// The policy described itself as pure: a `read` traps.
    pub(super) pure: bool,
}

/// Why a `read` was refused (WIT `read-error`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ReadRefused {
    OutOfRange,
    OverCap(u64),
}

/// The dtype a policy sees for `field`: a values field is `uint8`; a
/// nested field, its first row's (`uint8` when it has no rows).
pub fn field_dtype(field: &Field) -> Dtype {
    match field {
        Field::Regular(t) => t.dtype(),
        Field::Nested(rows) => rows.first().map(|t| t.dtype()).unwrap_or(Dtype::Uint8),
        Field::Values(_) => Dtype::Uint8,
    }
}

/// True if every tensor of `field` has a dtype `stowage:policy@0.1.0` can
/// name (a `values` field has none: it is lent as `uint8`). Its `dtype`
/// enum is closed (15 dtypes): a 0.1.0 plugin is never lent a field of
/// another dtype.
pub(super) fn v0_1_can_name(field: &Field) -> bool {
    match field {
        Field::Regular(t) => t.dtype().in_v0_1(),
        Field::Nested(rows) => rows.iter().all(|t| t.dtype().in_v0_1()),
        Field::Values(_) => true,
    }
}

impl LentField {
    pub(super) fn kind(&self) -> FieldKind {
        match &self.field {
            Field::Regular(_) => FieldKind::Regular,
            Field::Nested(_) => FieldKind::Nested,
            Field::Values(_) => FieldKind::Values,
        }
    }

    pub(super) fn dtype(&self) -> Dtype {
        field_dtype(&self.field)
    }

    pub(super) fn shape(&self) -> Vec<u64> {
        match &self.field {
            Field::Regular(t) => t.shape().to_vec(),
            other => vec![other.rows()],
        }
    }

    pub(super) fn strides(&self) -> Vec<i64> {
        match &self.field {
            Field::Regular(t) => t.strides(),
            _ => vec![1],
        }
    }

    pub(super) fn row_shapes(&self) -> Vec<Vec<u64>> {
        match &self.field {
            Field::Regular(t) => vec![t.row_shape().to_vec(); t.rows() as usize],
            Field::Nested(rows) => rows.iter().map(|t| t.shape().to_vec()).collect(),
            Field::Values(_) => self.row_byte_lens().into_iter().map(|l| vec![l]).collect(),
        }
    }

    pub(super) fn byte_len(&self) -> u64 {
        match &self.field {
            Field::Regular(t) => t.row_bytes() as u64 * t.rows(),
            Field::Nested(rows) => rows.iter().map(|t| t.payload_len() as u64).sum(),
            Field::Values(v) => v.iter().map(|v| v.byte_len() as u64).sum(),
        }
    }

    pub(super) fn row_byte_lens(&self) -> Vec<u64> {
        match &self.field {
            Field::Regular(t) => vec![t.row_bytes() as u64; t.rows() as usize],
            Field::Nested(rows) => rows.iter().map(|t| t.payload_len() as u64).collect(),
            Field::Values(v) => v.iter().map(|v| v.byte_len() as u64).collect(),
        }
    }

    /// Copies a range of the field's logical byte stream (rows in order).
    pub(super) fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ReadRefused> {
        if len > self.read_cap {
            return Err(ReadRefused::OverCap(self.read_cap));
        }
        let lens = self.row_byte_lens();
        let total: u64 = lens.iter().sum();
        let end = offset.checked_add(len).ok_or(ReadRefused::OutOfRange)?;
        if end > total {
            return Err(ReadRefused::OutOfRange);
        }
        let mut out = Vec::with_capacity(len as usize);
        let mut row_start = 0u64;
        for (i, row_len) in lens.iter().enumerate() {
            let row_end = row_start + row_len;
            if row_end > offset && row_start < end {
                let a = offset.max(row_start) - row_start;
                let b = end.min(row_end) - row_start;
                let row_bytes: bytes::Bytes = match &self.field {
                    Field::Regular(t) => t.row(i as u64).unwrap_or_default(),
                    Field::Nested(rows) => rows[i].contiguous_bytes(),
                    Field::Values(v) => match &v[i] {
                        crate::batch::Value::Str(s) => bytes::Bytes::copy_from_slice(s.as_bytes()),
                        crate::batch::Value::Bytes(b) | crate::batch::Value::Msgpack(b) => {
                            b.clone()
                        }
                    },
                };
                out.extend_from_slice(&row_bytes[a as usize..b as usize]);
            }
            if row_end >= end {
                break;
            }
            row_start = row_end;
        }
        Ok(out)
    }

    /// `read` as the guest calls it: a pure policy's read traps.
    pub(super) fn guest_read(
        &self,
        offset: u64,
        len: u64,
    ) -> wasmtime::Result<Result<Vec<u8>, ReadRefused>> {
        if self.pure {
            return Err(wasmtime::Error::msg(
                "the policy describes itself as pure but called read: a pure policy decides from layout and positions alone",
            ));
        }
        Ok(self.read(offset, len))
    }
}

/// The fields of one `stowage:policy@0.2.0` `select` call, lent as one
/// `borrow<fields>`; the guest names a field by its number.
pub struct LentFields {
    pub(super) fields: Vec<LentField>,
}

impl LentFields {
    pub(super) fn field(&self, n: u32) -> wasmtime::Result<&LentField> {
        self.fields.get(n as usize).ok_or_else(|| {
            wasmtime::Error::msg(format!(
                "field number {n} out of range: the call lent {} fields",
                self.fields.len()
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;
    use bytes::Bytes;

    fn lent(field: Field, read_cap: u64) -> LentField {
        LentField {
            field,
            read_cap,
            pure: false,
        }
    }

    #[test]
    fn read_walks_the_logical_byte_stream() {
        let t = Tensor::contiguous(
            Bytes::from((0u8..32).collect::<Vec<_>>()),
            Dtype::Uint8,
            vec![8, 4],
        )
        .unwrap();
        // A strided view: rows 1, 3, 5 -> bytes 4..8, 12..16, 20..24 without gaps.
        let view = t.rows_view(1, 2, 3).unwrap();
        let l = lent(Field::Regular(view), 16);
        assert_eq!(l.read(2, 4).unwrap(), vec![6, 7, 12, 13]);
        assert_eq!(
            l.read(0, 12).unwrap(),
            vec![4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
        );
        assert!(matches!(l.read(10, 3), Err(ReadRefused::OutOfRange)));
        assert!(matches!(l.read(0, 17), Err(ReadRefused::OverCap(16))));
        assert!(matches!(l.read(u64::MAX, 2), Err(ReadRefused::OutOfRange)));
        let rows = vec![
            Tensor::contiguous(Bytes::from(vec![1u8, 2]), Dtype::Uint8, vec![2]).unwrap(),
            Tensor::contiguous(Bytes::new(), Dtype::Uint8, vec![0]).unwrap(),
            Tensor::contiguous(Bytes::from(vec![3u8]), Dtype::Uint8, vec![1]).unwrap(),
        ];
        let l = lent(Field::Nested(rows), 16);
        assert_eq!(l.read(1, 2).unwrap(), vec![2, 3]);
        assert_eq!(l.row_byte_lens(), vec![2, 0, 1]);
    }

    #[test]
    fn contract_0_1_names_the_first_15_dtypes_and_no_other() {
        let named: Vec<Dtype> = Dtype::ALL.into_iter().filter(|&d| d.in_v0_1()).collect();
        assert_eq!(named, Dtype::ALL[..15]);
        let t = |d: Dtype| Tensor::contiguous(Bytes::from(vec![0u8; 2]), d, vec![2]).unwrap();
        assert!(v0_1_can_name(&Field::Regular(t(Dtype::Uint8))));
        assert!(!v0_1_can_name(&Field::Regular(t(Dtype::Float8E4m3fn))));
        assert!(!v0_1_can_name(&Field::Nested(vec![
            t(Dtype::Uint8),
            t(Dtype::Float8E5m2)
        ])));
        assert!(v0_1_can_name(&Field::Nested(vec![])));
    }

    #[test]
    fn a_pure_policys_read_traps() {
        let t = Tensor::contiguous(Bytes::from(vec![0u8; 8]), Dtype::Uint8, vec![8]).unwrap();
        let mut l = lent(Field::Regular(t), 16);
        assert_eq!(l.guest_read(0, 2).unwrap().unwrap(), vec![0, 0]);
        l.pure = true;
        let err = l.guest_read(0, 2).unwrap_err();
        assert!(format!("{err:#}").contains("pure"), "{err:#}");
    }
}
