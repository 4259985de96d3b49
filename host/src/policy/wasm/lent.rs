//! The tensor handle: the field a `select` call lends to the guest as a
//! `borrow<tensor>` resource, and the host side of its methods (layout,
//! dtype, and `read`, which copies at most `read_cap` bytes of the field's
//! logical byte stream).

use wasmtime::component::Resource;

use super::HostState;
use super::bindings::stowage::policy::types as wtypes;
use crate::batch::Field;

/// A field lent to a guest for one call.
pub struct LentField {
    pub(super) field: Field,
    pub(super) read_cap: u64,
}

fn field_kind(field: &Field) -> wtypes::FieldKind {
    match field {
        Field::Regular(_) => wtypes::FieldKind::Regular,
        Field::Nested(_) => wtypes::FieldKind::Nested,
        Field::Values(_) => wtypes::FieldKind::Values,
    }
}

/// The WIT name of a dtype, if `stowage:policy@0.1.0` has one. Its `dtype`
/// enum is closed (the 15 dtypes of 0.1.0): a plugin built against it is
/// never lent a field of any other dtype (see [`wit_can_name`]); the next
/// contract version names them.
fn wit_dtype(d: crate::tensor::DType) -> Option<wtypes::Dtype> {
    use crate::tensor::DType as D;
    use wtypes::Dtype as W;
    Some(match d {
        D::Bool => W::Bool,
        D::U8 => W::Uint8,
        D::I8 => W::Int8,
        D::I16 => W::Int16,
        D::U16 => W::Uint16,
        D::I32 => W::Int32,
        D::U32 => W::Uint32,
        D::I64 => W::Int64,
        D::U64 => W::Uint64,
        D::F16 => W::Float16,
        D::BF16 => W::Bfloat16,
        D::F32 => W::Float32,
        D::F64 => W::Float64,
        D::Complex64 => W::Complex64,
        D::Complex128 => W::Complex128,
        D::Complex32
        | D::F8E4M3Fn
        | D::F8E4M3Fnuz
        | D::F8E5M2
        | D::F8E5M2Fnuz
        | D::F8E8M0Fnu
        | D::F4E2M1FnX2 => return None,
    })
}

/// True if every tensor of `field` has a dtype the contract can name (a
/// `values` field has none: it is lent as `uint8`).
pub(super) fn wit_can_name(field: &Field) -> bool {
    match field {
        Field::Regular(t) => wit_dtype(t.dtype()).is_some(),
        Field::Nested(rows) => rows.iter().all(|t| wit_dtype(t.dtype()).is_some()),
        Field::Values(_) => true,
    }
}

impl LentField {
    fn row_byte_lens(&self) -> Vec<u64> {
        match &self.field {
            Field::Regular(t) => vec![t.row_bytes() as u64; t.rows() as usize],
            Field::Nested(rows) => rows.iter().map(|t| t.payload_len() as u64).collect(),
            Field::Values(v) => v.iter().map(|v| v.byte_len() as u64).collect(),
        }
    }

    /// Copies a range of the field's logical byte stream (rows in order).
    pub(super) fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, wtypes::ReadError> {
        if len > self.read_cap {
            return Err(wtypes::ReadError::OverCap(self.read_cap));
        }
        let lens = self.row_byte_lens();
        let total: u64 = lens.iter().sum();
        let end = offset
            .checked_add(len)
            .ok_or(wtypes::ReadError::OutOfRange)?;
        if end > total {
            return Err(wtypes::ReadError::OutOfRange);
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
}

impl wtypes::Host for HostState {}

impl wtypes::HostTensor for HostState {
    fn kind(&mut self, h: Resource<LentField>) -> wasmtime::Result<wtypes::FieldKind> {
        Ok(field_kind(&self.table.get(&h)?.field))
    }

    fn dtype(&mut self, h: Resource<LentField>) -> wasmtime::Result<wtypes::Dtype> {
        let dtype = match &self.table.get(&h)?.field {
            Field::Regular(t) => Some(t.dtype()),
            Field::Nested(rows) => rows.first().map(|t| t.dtype()),
            Field::Values(_) => None,
        };
        match dtype {
            None => Ok(wtypes::Dtype::Uint8),
            // Unreachable while `select` checks `wit_can_name` first; a trap
            // (a fault, answered by the built-in) rather than a wrong name.
            Some(d) => wit_dtype(d).ok_or_else(|| {
                wasmtime::Error::msg(format!("dtype {d} has no name in stowage:policy@0.1.0"))
            }),
        }
    }

    fn shape(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<u64>> {
        Ok(match &self.table.get(&h)?.field {
            Field::Regular(t) => t.shape().to_vec(),
            other => vec![other.rows()],
        })
    }

    fn strides(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<i64>> {
        Ok(match &self.table.get(&h)?.field {
            Field::Regular(t) => t.strides(),
            _ => vec![1],
        })
    }

    fn rows(&mut self, h: Resource<LentField>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&h)?.field.rows())
    }

    fn byte_len(&mut self, h: Resource<LentField>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&h)?.row_byte_lens().iter().sum())
    }

    fn row_shapes(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<Vec<u64>>> {
        let lent = self.table.get(&h)?;
        Ok(match &lent.field {
            Field::Regular(t) => vec![t.row_shape().to_vec(); t.rows() as usize],
            Field::Nested(rows) => rows.iter().map(|t| t.shape().to_vec()).collect(),
            Field::Values(_) => lent.row_byte_lens().into_iter().map(|l| vec![l]).collect(),
        })
    }

    fn row_byte_lens(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<u64>> {
        Ok(self.table.get(&h)?.row_byte_lens())
    }

    fn read_cap(&mut self, h: Resource<LentField>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&h)?.read_cap)
    }

    fn read(
        &mut self,
        h: Resource<LentField>,
        offset: u64,
        len: u64,
    ) -> wasmtime::Result<Result<Vec<u8>, wtypes::ReadError>> {
        Ok(self.table.get(&h)?.read(offset, len))
    }

    fn drop(&mut self, h: Resource<LentField>) -> wasmtime::Result<()> {
        // Borrowed handles are never dropped by the guest; the host deletes
        // the entry itself after the call.
        let _ = h;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{DType, Tensor};
    use bytes::Bytes;

    fn lent(field: Field, read_cap: u64) -> LentField {
        LentField { field, read_cap }
    }

    #[test]
    fn read_walks_the_logical_byte_stream() {
        let t = Tensor::contiguous(
            Bytes::from((0u8..32).collect::<Vec<_>>()),
            DType::U8,
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
        assert!(matches!(l.read(10, 3), Err(wtypes::ReadError::OutOfRange)));
        assert!(matches!(l.read(0, 17), Err(wtypes::ReadError::OverCap(16))));
        assert!(matches!(
            l.read(u64::MAX, 2),
            Err(wtypes::ReadError::OutOfRange)
        ));
        let rows = vec![
            Tensor::contiguous(Bytes::from(vec![1u8, 2]), DType::U8, vec![2]).unwrap(),
            Tensor::contiguous(Bytes::new(), DType::U8, vec![0]).unwrap(),
            Tensor::contiguous(Bytes::from(vec![3u8]), DType::U8, vec![1]).unwrap(),
        ];
        let l = lent(Field::Nested(rows), 16);
        assert_eq!(l.read(1, 2).unwrap(), vec![2, 3]);
        assert_eq!(l.row_byte_lens(), vec![2, 0, 1]);
    }

    #[test]
    fn the_contract_names_the_15_dtypes_of_0_1_0_and_no_other() {
        let named: Vec<DType> = DType::ALL
            .into_iter()
            .filter(|&d| wit_dtype(d).is_some())
            .collect();
        assert_eq!(named, DType::ALL[..15]);
        let t = |d: DType| Tensor::contiguous(Bytes::from(vec![0u8; 2]), d, vec![2]).unwrap();
        assert!(wit_can_name(&Field::Regular(t(DType::U8))));
        assert!(!wit_can_name(&Field::Regular(t(DType::F8E4M3Fn))));
        assert!(!wit_can_name(&Field::Nested(vec![
            t(DType::U8),
            t(DType::F8E5M2)
        ])));
        assert!(wit_can_name(&Field::Nested(vec![])));
    }
}
