//! The dtype table: every element type Stowage carries, once, with all that
//! is known of it.
//!
//! One row per dtype, in the order of the WIT enum `dtype` of
//! `stowage:policy@0.2.0`: the [`Dtype`] variant, its name on the wire
//! (torch's, without `torch.`: what TransferQueue writes and `stowage/1`
//! carries), its case in the WIT enum, its itemsize, the contract version
//! that first names it, and the torch aliases a decoder also accepts. The
//! enum, [`Dtype::ALL`] and [`DTYPES`] are all written by one macro from
//! these rows, so they cannot disagree.
//!
//! Who reads it: the wire codecs (`stowage-wire` re-exports [`Dtype`] as its
//! tensor element type), the guest SDK and the host's Wasm runtime (which
//! map the generated WIT enums to [`Dtype`] with exhaustive `match`es,
//! checked against the WIT files by the host's tests), and the Python
//! client's `_dtypes.py`, compared with this table by a client test through
//! the core module's `DTYPES`.
//!
//! The dtypes are those TransferQueue 0.1.11 serializes by their bytes
//! (`tensor.view(torch.uint8)`, then `str(dtype)` without `torch.`) with the
//! torch 2.15 it installs, except the quantized dtypes (their scale and zero
//! point are not in the bytes), torch's `bits*` and sub-byte shell dtypes
//! (`uint1`..`uint7`, `int1`..`int7`) and `bcomplex32`. Itemsizes are
//! torch's `dtype.itemsize`. Nothing in Stowage reads an element: a dtype is
//! a name and a size, and the bytes are stored and served as they came.

/// A released version of the WIT contract `stowage:policy`, as far as the
/// dtype table needs one: the version that first names a dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Contract {
    /// `stowage:policy@0.1.0` (`wit/since_v0.1.0`).
    V0_1_0,
    /// `stowage:policy@0.2.0` (`wit/since_v0.2.0`).
    V0_2_0,
}

impl Contract {
    /// Every released version, oldest first.
    pub const ALL: [Contract; 2] = [Contract::V0_1_0, Contract::V0_2_0];

    /// The package version, `0.1.0` or `0.2.0`.
    pub const fn version(self) -> &'static str {
        match self {
            Contract::V0_1_0 => "0.1.0",
            Contract::V0_2_0 => "0.2.0",
        }
    }
}

/// One row of the dtype table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DtypeInfo {
    /// The dtype.
    pub dtype: Dtype,
    /// Its name on the wire: torch's `str(dtype)` without `torch.`.
    pub name: &'static str,
    /// Its case in the WIT enum `dtype`.
    pub wit: &'static str,
    /// Bytes per element (per packed pair for `float4_e2m1fn_x2`).
    pub itemsize: usize,
    /// The first contract version whose `dtype` enum names it.
    pub since: Contract,
    /// Other torch names a decoder accepts for it (`float` for `float32`).
    pub aliases: &'static [&'static str],
}

/// Writes [`Dtype`], [`Dtype::ALL`], [`DTYPES`] and the exported
/// [`dtype_cases!`](crate::dtype_cases) from one list of rows, grouped by
/// the contract version that first names them. (`$d` is a `$` token, for
/// the metavariables of the macro this one writes.)
macro_rules! dtype_table {
    ($d:tt
    V0_1_0 {$(
        $(#[doc = $doc1:literal])*
        $v1:ident => $name1:literal, $wit1:literal, $itemsize1:literal, [$($alias1:literal),*];
    )+}
    V0_2_0 {$(
        $(#[doc = $doc2:literal])*
        $v2:ident => $name2:literal, $wit2:literal, $itemsize2:literal, [$($alias2:literal),*];
    )+}) => {
        /// Element type of a tensor; names follow torch (WIT `dtype`).
        ///
        /// Each variant is one row of the dtype table ([`DTYPES`]): read its
        /// attributes with [`name`](Dtype::name),
        /// [`itemsize`](Dtype::itemsize), [`since`](Dtype::since) or
        /// [`info`](Dtype::info).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Dtype {
            $( $(#[doc = $doc1])* $v1, )+
            $( $(#[doc = $doc2])* $v2, )+
        }

        /// The dtype table: every dtype once, in WIT order (the order of
        /// [`Dtype::ALL`]).
        pub const DTYPES: &[DtypeInfo; Dtype::ALL.len()] = &[
            $( DtypeInfo { dtype: Dtype::$v1, name: $name1, wit: $wit1, itemsize: $itemsize1,
                           since: Contract::V0_1_0, aliases: &[$($alias1),*] }, )+
            $( DtypeInfo { dtype: Dtype::$v2, name: $name2, wit: $wit2, itemsize: $itemsize2,
                           since: Contract::V0_2_0, aliases: &[$($alias2),*] }, )+
        ];

        impl Dtype {
            /// Every dtype, in WIT order.
            pub const ALL: [Dtype; [$(Dtype::$v1,)+ $(Dtype::$v2),+].len()] = [$(Dtype::$v1,)+ $(Dtype::$v2),+];
        }

        /// Converts between [`Dtype`] and an enum whose cases have the same
        /// names: the `dtype` enums that the frozen WIT packages'
        /// bindings generate, in the host's Wasm runtime and in the guest
        /// SDK. The cases come from the dtype table, matched by name (never
        /// by position), so no crate lists them again:
        ///
        /// - `dtype_cases!(into W, d)`: the case of `W` for `d: Dtype`
        ///   (`W` names every dtype: `stowage:policy@0.2.0`'s enum);
        /// - `dtype_cases!(from W, w)`: the [`Dtype`] of a case of `W`;
        /// - `dtype_cases!(into_v0_1 W, d, else e)`: the case of 0.1.0's enum,
        ///   which names the 15 dtypes of that version; `e` (an expression,
        ///   e.g. an early `return`) for the others;
        /// - `dtype_cases!(from_v0_1 W, w)`: the [`Dtype`] of a 0.1.0 case.
        ///
        /// `W` is an identifier in scope (`use wt::Dtype as W;`).
        #[macro_export]
        macro_rules! dtype_cases {
            (into $d w:ident, $d value:expr) => {
                match $d value {
                    $( $crate::Dtype::$v1 => $d w::$v1, )+
                    $( $crate::Dtype::$v2 => $d w::$v2, )+
                }
            };
            (from $d w:ident, $d value:expr) => {
                match $d value {
                    $( $d w::$v1 => $crate::Dtype::$v1, )+
                    $( $d w::$v2 => $crate::Dtype::$v2, )+
                }
            };
            (into_v0_1 $d w:ident, $d value:expr, else $d other:expr) => {
                match $d value {
                    $( $crate::Dtype::$v1 => $d w::$v1, )+
                    $( $crate::Dtype::$v2 )|+ => $d other,
                }
            };
            (from_v0_1 $d w:ident, $d value:expr) => {
                match $d value {
                    $( $d w::$v1 => $crate::Dtype::$v1, )+
                }
            };
        }
    };
}

dtype_table! { $
    V0_1_0 {
        /// `torch.bool`, one byte.
        Bool => "bool", "bool", 1, [];
        /// `torch.uint8`.
        Uint8 => "uint8", "uint8", 1, [];
        /// `torch.int8`.
        Int8 => "int8", "int8", 1, [];
        /// `torch.int16`.
        Int16 => "int16", "int16", 2, ["short"];
        /// `torch.uint16`.
        Uint16 => "uint16", "uint16", 2, [];
        /// `torch.int32`.
        Int32 => "int32", "int32", 4, ["int"];
        /// `torch.uint32`.
        Uint32 => "uint32", "uint32", 4, [];
        /// `torch.int64`.
        Int64 => "int64", "int64", 8, ["long"];
        /// `torch.uint64`.
        Uint64 => "uint64", "uint64", 8, [];
        /// `torch.float16`.
        Float16 => "float16", "float16", 2, ["half"];
        /// `torch.bfloat16`.
        Bfloat16 => "bfloat16", "bfloat16", 2, [];
        /// `torch.float32`.
        Float32 => "float32", "float32", 4, ["float"];
        /// `torch.float64`.
        Float64 => "float64", "float64", 8, ["double"];
        /// `torch.complex64`.
        Complex64 => "complex64", "complex64", 8, ["cfloat"];
        /// `torch.complex128`.
        Complex128 => "complex128", "complex128", 16, ["cdouble"];
    }
    V0_2_0 {
        /// `torch.complex32`: two float16 (since contract 0.2.0).
        Complex32 => "complex32", "complex32", 4, ["chalf"];
        /// `torch.float8_e4m3fn` (since 0.2.0).
        Float8E4m3fn => "float8_e4m3fn", "float8-e4m3fn", 1, [];
        /// `torch.float8_e4m3fnuz` (since 0.2.0).
        Float8E4m3fnuz => "float8_e4m3fnuz", "float8-e4m3fnuz", 1, [];
        /// `torch.float8_e5m2` (since 0.2.0).
        Float8E5m2 => "float8_e5m2", "float8-e5m2", 1, [];
        /// `torch.float8_e5m2fnuz` (since 0.2.0).
        Float8E5m2fnuz => "float8_e5m2fnuz", "float8-e5m2fnuz", 1, [];
        /// `torch.float8_e8m0fnu`, an 8-bit exponent (MX block scales; since
        /// 0.2.0).
        Float8E8m0fnu => "float8_e8m0fnu", "float8-e8m0fnu", 1, [];
        /// `torch.float4_e2m1fn_x2`: two 4-bit floats in one byte; the shape
        /// counts bytes (since 0.2.0).
        Float4E2m1fnX2 => "float4_e2m1fn_x2", "float4-e2m1fn-x2", 1, [];
    }
}

impl Dtype {
    /// Its row of the dtype table.
    pub const fn info(self) -> &'static DtypeInfo {
        // The macro writes the variants and the rows in one order, so a
        // variant's discriminant is its row (checked by the tests too).
        &DTYPES[self as usize]
    }

    /// The torch name without the `torch.` prefix, as the wire carries it.
    pub const fn name(self) -> &'static str {
        self.info().name
    }

    /// Bytes per element (per packed pair for `Float4E2m1fnX2`).
    pub const fn itemsize(self) -> usize {
        self.info().itemsize
    }

    /// [`itemsize`](Self::itemsize) as the contract's `u64` byte counts.
    pub const fn size(self) -> u64 {
        self.info().itemsize as u64
    }

    /// The first contract version whose WIT enum names the dtype.
    pub const fn since(self) -> Contract {
        self.info().since
    }

    /// True for the 15 dtypes contract 0.1.0 names.
    pub const fn in_v0_1(self) -> bool {
        matches!(self.since(), Contract::V0_1_0)
    }

    /// Parses a torch dtype name: a table name (`float32`), also with the
    /// `torch.` prefix, or one of the table's aliases (`float`, `half`,
    /// `double`, `long`, `int`, `short`, `chalf`, `cfloat`, `cdouble`).
    pub fn from_name(name: &str) -> Option<Dtype> {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        // Table names first, aliases only then: a put names a dtype per
        // field, nearly always by its table name, and checking each row's
        // aliases on the way cost about 240 instructions a name (the
        // aliases are no other row's name, so the order changes nothing).
        DTYPES
            .iter()
            .find(|row| row.name == name)
            .or_else(|| DTYPES.iter().find(|row| row.aliases.contains(&name)))
            .map(|row| row.dtype)
    }

    /// [`Dtype::from_name`] of a name's bytes: compared as they are with
    /// the table names (ASCII, so bytes equal only to the same string),
    /// and only if none matches read as UTF-8 and looked up as
    /// `from_name` does (a `torch.` prefix, aliases). A decoder's common
    /// case then skips the UTF-8 check (about 90 instructions a field of a
    /// put, callgrind).
    pub fn from_name_bytes(name: &[u8]) -> Option<Dtype> {
        DTYPES
            .iter()
            .find(|row| row.name.as_bytes() == name)
            .map(|row| row.dtype)
            .or_else(|| Dtype::from_name(std::str::from_utf8(name).ok()?))
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `from_name_bytes` agrees with `from_name` on every table name,
    /// alias and `torch.` name, and on bytes that are no name or not
    /// UTF-8.
    #[test]
    fn names_read_as_bytes_or_as_strings_agree() {
        let mut names: Vec<String> = Vec::new();
        for row in DTYPES {
            names.push(row.name.to_string());
            names.push(format!("torch.{}", row.name));
            names.extend(row.aliases.iter().map(|a| a.to_string()));
        }
        names.extend(["", "float", "Float32", "torch.", "float32 "].map(String::from));
        for n in &names {
            assert_eq!(
                Dtype::from_name_bytes(n.as_bytes()),
                Dtype::from_name(n),
                "{n:?}"
            );
        }
        assert_eq!(Dtype::from_name_bytes(b"float\xff32"), None);
        assert_eq!(Dtype::from_name_bytes(&[0xff, 0xfe]), None);
    }

    /// Every name and itemsize as `str(torch.X)` and `torch.X.itemsize`
    /// print them with the torch 2.15 that TransferQueue 0.1.11 installs.
    const TORCH: [(&str, usize); 22] = [
        ("bool", 1),
        ("uint8", 1),
        ("int8", 1),
        ("int16", 2),
        ("uint16", 2),
        ("int32", 4),
        ("uint32", 4),
        ("int64", 8),
        ("uint64", 8),
        ("float16", 2),
        ("bfloat16", 2),
        ("float32", 4),
        ("float64", 8),
        ("complex64", 8),
        ("complex128", 16),
        ("complex32", 4),
        ("float8_e4m3fn", 1),
        ("float8_e4m3fnuz", 1),
        ("float8_e5m2", 1),
        ("float8_e5m2fnuz", 1),
        ("float8_e8m0fnu", 1),
        ("float4_e2m1fn_x2", 1),
    ];

    #[test]
    fn each_variant_is_its_own_row() {
        assert_eq!(DTYPES.len(), Dtype::ALL.len());
        for (row, d) in DTYPES.iter().zip(Dtype::ALL) {
            assert_eq!(row.dtype, d);
            assert_eq!(d.info(), row);
        }
    }

    #[test]
    fn names_and_itemsizes_are_torchs() {
        let mut torch = TORCH.to_vec();
        let mut ours: Vec<(&str, usize)> = DTYPES.iter().map(|r| (r.name, r.itemsize)).collect();
        torch.sort();
        ours.sort();
        assert_eq!(ours, torch);
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_name(d.name()), Some(d));
            assert_eq!(Dtype::from_name(&format!("torch.{d}")), Some(d));
            assert_eq!(d.to_string(), d.name());
            assert_eq!(d.size(), d.itemsize() as u64);
        }
    }

    #[test]
    fn wit_cases_are_the_names_in_kebab_case() {
        for row in DTYPES.iter() {
            assert_eq!(row.wit, row.name.replace('_', "-"), "{}", row.name);
        }
    }

    #[test]
    fn names_aliases_and_cases_are_unique() {
        let mut names: Vec<&str> = DTYPES
            .iter()
            .flat_map(|r| std::iter::once(r.name).chain(r.aliases.iter().copied()))
            .collect();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n);
        let mut cases: Vec<&str> = DTYPES.iter().map(|r| r.wit).collect();
        cases.sort();
        cases.dedup();
        assert_eq!(cases.len(), DTYPES.len());
    }

    #[test]
    fn contract_0_1_0_names_the_first_fifteen() {
        let v1: Vec<Dtype> = Dtype::ALL.into_iter().filter(|d| d.in_v0_1()).collect();
        assert_eq!(v1, Dtype::ALL[..15]);
        assert!(
            Dtype::ALL[15..]
                .iter()
                .all(|d| d.since() == Contract::V0_2_0)
        );
    }

    #[test]
    fn aliases_and_unknown_names() {
        // `from_name` looks names up before aliases: no alias may be a name.
        for row in DTYPES {
            for alias in row.aliases {
                assert!(DTYPES.iter().all(|r| r.name != *alias), "{alias}");
            }
        }
        for (alias, d) in [
            ("torch.float", Dtype::Float32),
            ("half", Dtype::Float16),
            ("double", Dtype::Float64),
            ("long", Dtype::Int64),
            ("int", Dtype::Int32),
            ("short", Dtype::Int16),
            ("chalf", Dtype::Complex32),
            ("cfloat", Dtype::Complex64),
            ("torch.cdouble", Dtype::Complex128),
        ] {
            assert_eq!(Dtype::from_name(alias), Some(d), "{alias}");
        }
        for unknown in [
            "float8",
            "float8_e4m3",
            "qint8",
            "quint4x2",
            "bits8",
            "uint4",
            "int1",
            "bcomplex32",
            "Float32",
            "float8-e4m3fn",
            "torch.",
            "",
            "torch.torch.float32",
            "float32 ",
        ] {
            assert_eq!(Dtype::from_name(unknown), None, "{unknown:?}");
        }
    }
}
