//! Loading errors, and the contract check: a plugin's exports are read
//! (with `wasmparser`) before it is compiled, so a component built for
//! another contract version is refused with a message that says what to do.

use crate::policy::Refusal;

/// Why a plugin could not be loaded.
///
/// wasmtime reports its own errors as `anyhow::Error`, which is not a
/// `std::error::Error`; at this boundary they are kept as their formatted
/// chain (`{:#}`) in `reason`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a Stowage policy for stowage:policy@0.1.x or @0.2.x: {reason}")]
    Contract { path: String, reason: ContractError },
    #[error("{path}: compiling the component failed: {reason}")]
    Compile { path: String, reason: String },
    #[error("{path}: the component does not link against this host: {reason}")]
    Link { path: String, reason: String },
    #[error("{path}: describe() failed: {reason}")]
    Describe { path: String, reason: String },
    #[error("{path}: refused by the conformance suite: {reason}")]
    Check { path: String, reason: Refusal },
}

/// Why a file is not a policy for this host's contract.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ContractError {
    #[error("not a valid Wasm binary ({0})")]
    NotWasm(String),
    #[error("a core Wasm module, not a component (build for wasm32-wasip2)")]
    CoreModule,
    #[error("bad export section ({0})")]
    BadExports(String),
    #[error("it does not export `{required}` (exports: {exports:?})")]
    Missing {
        required: &'static str,
        exports: Vec<String>,
    },
    #[error(
        "it exports `{found}`, built for contract version {version:?}; this host speaks 0.1.x and 0.2.x (rebuild the plugin against this host's stowage-guest)"
    )]
    Version { found: String, version: String },
}

/// The WIT interfaces a policy must export, without version.
const REQUIRED_EXPORTS: [&str; 3] = [
    "stowage:policy/meta",
    "stowage:policy/selection",
    "stowage:policy/packing",
];

/// Reads the component's exports before compiling it and checks that it
/// speaks `stowage:policy@0.1.x` or `@0.2.x`, every interface the same
/// version. Returns the exact version found.
pub fn check_contract(bytes: &[u8]) -> Result<String, ContractError> {
    let mut exports: Vec<String> = Vec::new();
    let mut depth = 0usize;
    for payload in wasmparser::Parser::new(0).parse_all(bytes) {
        let payload = payload.map_err(|e| ContractError::NotWasm(e.to_string()))?;
        match payload {
            wasmparser::Payload::Version { encoding, .. } => {
                if depth == 0 && encoding != wasmparser::Encoding::Component {
                    return Err(ContractError::CoreModule);
                }
                depth += 1;
            }
            wasmparser::Payload::End(_) => depth = depth.saturating_sub(1),
            wasmparser::Payload::ComponentExportSection(reader) if depth == 1 => {
                for export in reader {
                    let export = export.map_err(|e| ContractError::BadExports(e.to_string()))?;
                    exports.push(export.name.name.to_string());
                }
            }
            _ => {}
        }
    }
    let mut version = None;
    for required in REQUIRED_EXPORTS {
        let found = exports
            .iter()
            .find(|e| e.split('@').next() == Some(required));
        let Some(found) = found else {
            return Err(ContractError::Missing { required, exports });
        };
        let v = found
            .split_once('@')
            .map(|(_, v)| v.to_string())
            .unwrap_or_default();
        let mut parts = v.split('.');
        let compatible = parts.next() == Some("0") && matches!(parts.next(), Some("1") | Some("2"));
        let mixed = version.as_ref().is_some_and(|seen| *seen != v);
        if !compatible || mixed {
            return Err(ContractError::Version {
                found: found.clone(),
                version: v,
            });
        }
        version = Some(v);
    }
    Ok(version.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_check_refuses_non_components() {
        assert!(matches!(
            check_contract(b"not wasm"),
            Err(ContractError::NotWasm(_))
        ));
        let core = check_contract(b"\0asm\x01\0\0\0").unwrap_err();
        assert_eq!(core, ContractError::CoreModule);
        assert!(core.to_string().contains("core Wasm module"));
    }
}
