//! Who may talk to the native endpoint: stowd's token, made at first start
//! and kept in its state directory (mode 0600), and the authenticator that
//! checks a client's ZMTP PLAIN credentials against it and `[security]
//! tokens`.
//!
//! The token is the PLAIN password; the username is not checked (libzmq's
//! PLAIN clients must send one; `stowage` by convention). A client that
//! can read the token file, or the endpoints file stowd writes it into
//! (mode 0600 too), can connect: on one node that is stowd's own user and
//! root, with no configuration. Tokens are compared in constant time, and
//! neither a log line nor an error reply ever carries one.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use subtle::ConstantTimeEq;

use crate::transport::zmtp::Authenticator;

pub mod curve;
pub use curve::CurveKeys;

/// The username stowd presents to its peers and its clients present to it.
pub const USERNAME: &str = "stowage";

/// Bytes of randomness in a token made by stowd (hex: twice as many
/// characters).
const TOKEN_BYTES: usize = 32;

/// stowd's token from `path`: read if the file exists (it must be a
/// regular file of this user, readable by no one else), else made and
/// written there mode 0600, published whole (written to a temporary file,
/// then linked into place) so that two stowds starting at once agree on
/// one token.
pub fn load_or_make(path: &Path) -> Result<String, String> {
    let shown = path.display();
    match read(path) {
        Ok(Some(t)) => return Ok(t),
        Ok(None) => {}
        Err(e) => return Err(e),
    }
    make_private_dir(path)?;
    let mut bytes = [0u8; TOKEN_BYTES];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness for a token: {e}"))?;
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    if publish(path, token.as_bytes(), 0o600)? {
        tracing::info!(file = %shown, "made stowd's token (mode 0600)");
        Ok(token)
    } else {
        read(path)?.ok_or_else(|| format!("{shown}: vanished while it was made"))
    }
}

/// Makes `path`'s directory (mode 0700) if it is missing.
pub(crate) fn make_private_dir(path: &Path) -> Result<(), String> {
    match path.parent() {
        Some(dir) => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("{}: {e}", dir.display())),
        None => Ok(()),
    }
}

/// Writes `contents` to `path` whole, mode `mode`, unless a file is
/// there already: written to a temporary file, then linked into place,
/// so that two stowds starting at once agree on one. `Ok(false)`: the
/// other one was first.
pub(crate) fn publish(path: &Path, contents: &[u8], mode: u32) -> Result<bool, String> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(contents)?;
            f.sync_all()
        });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("{}: {e}", tmp.display()));
    }
    // link(2) fails if the name exists: whoever linked first wins.
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// The token in `path`, `None` if there is no such file. Refused: a file
/// of another user, one others may read or write, or an empty one.
fn read(path: &Path) -> Result<Option<String>, String> {
    let Some(text) = read_private(path)? else {
        return Ok(None);
    };
    let token = text.trim();
    if !crate::config::token_ok(token) {
        return Err(format!(
            "{}: not a token (1 to 255 bytes, no whitespace)",
            path.display()
        ));
    }
    Ok(Some(token.to_string()))
}

/// The text of a secret file, `None` if there is no such file. Refused: a
/// link, a file of another user, or one others may read or write.
pub(crate) fn read_private(path: &Path) -> Result<Option<String>, String> {
    let shown = path.display();
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{shown}: {e}")),
    };
    let uid = rustix::process::geteuid().as_raw();
    if !meta.is_file() {
        return Err(format!("{shown}: not a regular file"));
    }
    if std::os::unix::fs::MetadataExt::uid(&meta) != uid {
        return Err(format!("{shown}: owned by another user"));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "{shown}: readable or writable by others (mode {:o}); chmod 600 it",
            meta.permissions().mode() & 0o777
        ));
    }
    std::fs::read_to_string(path)
        .map(Some)
        .map_err(|e| format!("{shown}: {e}"))
}

/// The token a client of this user offers (only to a server that asks):
/// `$STOWAGE_TOKEN`, else the token file of this user's stowd
/// (`$STOWAGE_TOKEN_FILE`, else the default `[security] token_file`), if
/// it can be read as a token.
pub fn client_token() -> Option<String> {
    if let Some(t) = std::env::var("STOWAGE_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
    {
        return Some(t);
    }
    let path = std::env::var_os("STOWAGE_TOKEN_FILE")
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| crate::config::SecurityConfig::default().token_file);
    read(&path).ok().flatten()
}

/// `peer`, offering this user's token ([`client_token`]) to a server that
/// asks for one (PLAIN), and this user's stowd's CURVE client key
/// ([`curve::client_keys`]) to one that asks for CURVE.
pub fn with_client_credentials(peer: crate::transport::Peer) -> crate::transport::Peer {
    let peer = match curve::client_keys() {
        Some((keys, server)) => peer.with_curve(keys, server),
        None => peer,
    };
    match client_token() {
        Some(t) => peer.with_credentials(USERNAME.as_bytes(), t.as_bytes()),
        None => peer,
    }
}

/// Checks PLAIN credentials against stowd's token and `[security] tokens`.
pub struct Tokens {
    /// (what the token is called in logs, the token).
    accepted: Vec<(String, Vec<u8>)>,
}

impl Tokens {
    /// stowd's `own` token and the `others` of `[security] tokens`.
    pub fn new(own: &str, others: &[String]) -> Tokens {
        let mut accepted = vec![("stowd's token".to_string(), own.as_bytes().to_vec())];
        for (i, t) in others.iter().enumerate() {
            accepted.push((format!("[security] tokens[{i}]"), t.as_bytes().to_vec()));
        }
        Tokens { accepted }
    }
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens")
            .field("accepted", &self.accepted.len())
            .finish()
    }
}

impl Authenticator for Tokens {
    fn authenticate(&self, _username: &[u8], password: &[u8]) -> Result<String, String> {
        // Every token is compared, so the time taken does not say which
        // one (or how much of one) matched.
        let mut found = None;
        for (name, token) in &self.accepted {
            if bool::from(token.as_slice().ct_eq(password)) {
                found.get_or_insert(name);
            }
        }
        found.cloned().ok_or_else(|| {
            "wrong or missing token: stowd takes its own token (its token file, or the \
             endpoints file) or one of [security] tokens"
                .into()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("stowage-auth-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_token_is_made_once_mode_0600_and_read_back() {
        let d = dir("make");
        let path = d.join("state").join("token");
        let t = load_or_make(&path).unwrap();
        assert_eq!(t.len(), 2 * TOKEN_BYTES);
        assert!(t.chars().all(|c| c.is_ascii_hexdigit()));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(
            std::fs::metadata(d.join("state"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o700
        );
        assert_eq!(
            load_or_make(&path).unwrap(),
            t,
            "the same token at the next start"
        );
        // No temporary file left behind.
        assert_eq!(std::fs::read_dir(d.join("state")).unwrap().count(), 1);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_token_file_others_can_read_or_that_is_empty_is_refused() {
        let d = dir("refuse");
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("token");
        std::fs::write(&path, "abc").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(load_or_make(&path).unwrap_err().contains("chmod 600"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(load_or_make(&path).unwrap(), "abc");
        std::fs::write(&path, " \n").unwrap();
        assert!(load_or_make(&path).unwrap_err().contains("not a token"));
        let link = d.join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(
            load_or_make(&link)
                .unwrap_err()
                .contains("not a regular file")
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn only_the_listed_tokens_are_taken_and_refusals_name_none() {
        let tokens = Tokens::new("own-token", &["other".into()]);
        assert_eq!(
            tokens.authenticate(b"x", b"own-token").unwrap(),
            "stowd's token"
        );
        assert_eq!(
            tokens.authenticate(b"stowage", b"other").unwrap(),
            "[security] tokens[0]"
        );
        for wrong in [&b""[..], b"own-toke", b"own-token2", b"OTHER"] {
            let e = tokens.authenticate(b"stowage", wrong).unwrap_err();
            assert!(e.contains("wrong or missing token") && !e.contains("own-token"));
        }
        assert!(!format!("{tokens:?}").contains("own-token"));
    }
}
