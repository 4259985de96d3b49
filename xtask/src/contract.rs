//! Released WIT contracts are frozen, the way Zed freezes its extension
//! API: each released version of `stowage:policy` lives in its own
//! directory, `wit/since_vX.Y.Z/`, and [`RELEASED`] pins the SHA-256 of
//! every file in it. `cargo xtask test` (and `cargo xtask contract`) fails
//! when a released directory differs: a file changed, added or removed. A
//! plugin built against a released version must keep loading, so a change
//! is a new version in a new directory (docs/plugins.md, "The policy contract").
//! The hashes are here, in code, rather than in a file beside the WIT, so
//! that a commit that edits a released contract has to edit this table too,
//! in plain sight.

use std::fs;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::Result;

/// A released contract: its directory under `wit/` and every file in it
/// with its SHA-256 (hex), sorted by name.
#[derive(Debug)]
pub struct Release {
    pub dir: &'static str,
    pub files: &'static [(&'static str, &'static str)],
}

/// Every released contract. A version is added here when it is released
/// (until then its directory may still change).
pub const RELEASED: &[Release] = &[
    Release {
        dir: "since_v0.1.0",
        files: &[(
            "policy.wit",
            "4fa679aa5250dadac832e3f4ce2ca4dcb0b01189aa98af751c91b40abffc672b",
        )],
    },
    Release {
        dir: "since_v0.2.0",
        files: &[(
            "policy.wit",
            "19090baedbd931ca3ab108dc7924d058734081138395619f84d839adac064a81",
        )],
    },
];

/// What to do, printed under every failure.
const HELP: &str = "released contracts are frozen: a plugin built against a released version must keep \
loading. Undo the change (`git checkout -- wit/`) and add the new version beside it, in \
wit/since_vX.Y.Z/ (see docs/plugins.md, \"The policy contract\")";

/// `cargo xtask contract`: checks the released contracts under `wit/`.
pub fn contract(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        return Err(format!("unknown argument `{a}`").into());
    }
    check(&crate::workspace_root().join("wit"), RELEASED)?;
    eprintln!("xtask: released contracts unchanged: {}", names(RELEASED));
    Ok(())
}

fn names(released: &[Release]) -> String {
    released
        .iter()
        .map(|r| format!("wit/{}", r.dir))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Fails, saying what to do, if a released directory under `wit` holds
/// other files or other bytes than `released` pins.
pub fn check(wit: &Path, released: &[Release]) -> Result<()> {
    let mut faults = Vec::new();
    for r in released {
        let dir = wit.join(r.dir);
        let mut found: Vec<String> = match fs::read_dir(&dir) {
            Ok(entries) => entries
                .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect::<std::io::Result<_>>()?,
            Err(e) => {
                faults.push(format!("wit/{}: {e}", r.dir));
                continue;
            }
        };
        found.sort();
        for name in &found {
            let Some((_, want)) = r.files.iter().find(|(n, _)| n == name) else {
                faults.push(format!(
                    "wit/{}/{name}: added to a released contract",
                    r.dir
                ));
                continue;
            };
            let got = sha256_hex(&fs::read(dir.join(name))?);
            if got != *want {
                faults.push(format!(
                    "wit/{}/{name}: changed (sha256 {got}, released as {want})",
                    r.dir
                ));
            }
        }
        for (name, _) in r.files {
            if !found.iter().any(|f| f == name) {
                faults.push(format!(
                    "wit/{}/{name}: removed from a released contract",
                    r.dir
                ));
            }
        }
    }
    if faults.is_empty() {
        return Ok(());
    }
    Err(format!("{}\n{HELP}", faults.join("\n")).into())
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch copy of the repository's `wit/`.
    fn copy_of_wit(tag: &str) -> std::path::PathBuf {
        let to = std::env::temp_dir().join(format!("xtask-contract-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&to);
        for r in RELEASED {
            fs::create_dir_all(to.join(r.dir)).unwrap();
            for (name, _) in r.files {
                let from = crate::workspace_root().join("wit").join(r.dir).join(name);
                fs::copy(from, to.join(r.dir).join(name)).unwrap();
            }
        }
        to
    }

    #[test]
    fn the_committed_contracts_match_their_hashes() {
        check(&crate::workspace_root().join("wit"), RELEASED).unwrap();
    }

    #[test]
    fn an_edited_added_or_removed_file_fails_and_says_what_to_do() {
        let wit = copy_of_wit("edit");
        let file = wit.join("since_v0.1.0/policy.wit");
        let mut text = fs::read_to_string(&file).unwrap();
        text.push_str("\n// a comment is a change too\n");
        fs::write(&file, text).unwrap();
        let err = check(&wit, RELEASED).unwrap_err().to_string();
        assert!(
            err.contains("wit/since_v0.1.0/policy.wit: changed"),
            "{err}"
        );
        assert!(err.contains("released contracts are frozen"), "{err}");
        assert!(err.contains("wit/since_vX.Y.Z/"), "{err}");

        fs::write(wit.join("since_v0.1.0/extra.wit"), "package a:b;").unwrap();
        fs::remove_file(&file).unwrap();
        let err = check(&wit, RELEASED).unwrap_err().to_string();
        assert!(err.contains("wit/since_v0.1.0/extra.wit: added"), "{err}");
        assert!(
            err.contains("wit/since_v0.1.0/policy.wit: removed"),
            "{err}"
        );
        fs::remove_dir_all(&wit).unwrap();
    }
}
