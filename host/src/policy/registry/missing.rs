//! Chain entries that name no live plugin, and what each chain holds.
//!
//! Chain entries are `describe()` names (`constant-stride`), not file names
//! (`constant_stride.wasm`). An entry that names no loaded plugin, or a
//! plugin without the capability its list needs (a selection-only plugin in
//! `pack`), is a [`MissingEntry`]: `stowd` and `stowd config` refuse the
//! configuration ([`MissingEntries`]) unless the chain says
//! `allow_missing`; on hot reload each new one is a WARN and
//! `stowd_chain_missing_entries` counts them. Each names the loaded plugins
//! of the needed kind and the closest name ([`strsim`]'s edit distance).

use std::fmt;

use super::super::Capability;
use super::super::chain::{Backoff, FailStrategy};

/// A chain entry with no live plugin behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingEntry {
    /// The chain's field-name pattern.
    pub pattern: String,
    /// The list it is in.
    pub capability: Capability,
    /// The name as configured.
    pub name: String,
    /// A plugin of this name is loaded but lacks the capability.
    pub lacks_capability: bool,
    /// `describe()` names of the loaded plugins with the capability.
    pub loaded: Vec<String>,
    /// The loaded name closest to `name`, if one is close.
    pub closest: Option<String>,
    /// The chain allows missing entries (`allow_missing = true`).
    pub allowed: bool,
}

/// The chain list a capability fills.
pub fn list_name(capability: Capability) -> &'static str {
    match capability {
        Capability::Selection => "select",
        Capability::Packing => "pack",
    }
}

fn kind(capability: Capability) -> &'static str {
    match capability {
        Capability::Selection => "selection",
        Capability::Packing => "packing",
    }
}

impl fmt::Display for MissingEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (list, kind) = (list_name(self.capability), kind(self.capability));
        write!(f, "chain {:?} {list} entry {:?} ", self.pattern, self.name)?;
        if self.lacks_capability {
            write!(f, "is loaded but is not a {kind} plugin")?;
        } else {
            write!(f, "names no loaded plugin")?;
        }
        if let Some(c) = &self.closest {
            write!(f, " (closest: {c:?})")?;
        }
        match self.loaded.is_empty() {
            true => write!(f, "; no {kind} plugin is loaded"),
            false => write!(f, "; loaded {kind} plugins: {}", self.loaded.join(", ")),
        }
    }
}

/// The loaded name closest to `name`: within an edit distance of a third
/// of its length (at least 2), so `constant_stride` finds
/// `constant-stride` and `gather` does not find `runs`.
pub fn closest<'a>(name: &str, loaded: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let most = (name.chars().count() / 3).max(2);
    loaded
        .into_iter()
        .map(|l| (strsim::damerau_levenshtein(name, l), l))
        .filter(|(d, _)| *d <= most)
        .min()
        .map(|(_, l)| l.to_string())
}

/// Chain entries that name no live plugin, refused at start and by
/// `stowd config`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct MissingEntries(pub Vec<MissingEntry>);

impl fmt::Display for MissingEntries {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len();
        write!(
            f,
            "{n} chain {} no loaded plugin (chain entries are describe() names, not file \
             names; `allow_missing = true` in a [[chain]] skips its missing entries):",
            if n == 1 {
                "entry names"
            } else {
                "entries name"
            }
        )?;
        for m in &self.0 {
            write!(f, "\n  - {m}")?;
        }
        Ok(())
    }
}

/// What a chain holds: its live policies in order and its settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainSummary {
    pub pattern: String,
    /// Live selection policies, in the order they are asked.
    pub select: Vec<String>,
    /// Live packing policies, in order.
    pub pack: Vec<String>,
    pub fail: FailStrategy,
    pub max_faults: u64,
    pub backoff: Option<Backoff>,
    pub allow_missing: bool,
    /// Configured `select` names that are not live.
    pub missing_select: Vec<String>,
    /// Configured `pack` names that are not live.
    pub missing_pack: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closest_names() {
        let loaded = ["constant-stride", "gather", "runs", "single-row"];
        assert_eq!(
            closest("constant_stride", loaded).as_deref(),
            Some("constant-stride")
        );
        assert_eq!(closest("rusn", loaded).as_deref(), Some("runs"));
        assert_eq!(closest("coalesce", loaded), None);
        assert_eq!(closest("x", []), None);
    }

    #[test]
    fn messages_name_the_loaded_plugins_and_the_closest() {
        let m = MissingEntry {
            pattern: "*".into(),
            capability: Capability::Selection,
            name: "constant_stride".into(),
            lacks_capability: false,
            loaded: vec!["constant-stride".into(), "runs".into()],
            closest: Some("constant-stride".into()),
            allowed: false,
        };
        assert_eq!(
            m.to_string(),
            "chain \"*\" select entry \"constant_stride\" names no loaded plugin (closest: \
             \"constant-stride\"); loaded selection plugins: constant-stride, runs"
        );
        let p = MissingEntry {
            capability: Capability::Packing,
            name: "runs".into(),
            lacks_capability: true,
            loaded: vec![],
            closest: None,
            ..m.clone()
        };
        assert_eq!(
            p.to_string(),
            "chain \"*\" pack entry \"runs\" is loaded but is not a packing plugin; no packing \
             plugin is loaded"
        );
        let all = MissingEntries(vec![m, p]).to_string();
        assert!(
            all.starts_with("2 chain entries name no loaded plugin"),
            "{all}"
        );
        assert_eq!(all.lines().count(), 3, "{all}");
    }
}
