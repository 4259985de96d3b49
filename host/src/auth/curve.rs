//! stowd's CURVE keys (`[security] auth = "curve"`): made at first start in
//! `[security] curve_dir`, in pyzmq's certificate format so that
//! `zmq.auth.load_certificate` reads them and `zmq.auth.create_certificates`
//! can make them:
//!
//! | file | what | mode |
//! |---|---|---|
//! | `server.key` | the native endpoint's public key | 0644 |
//! | `server.key_secret` | its key pair | 0600 |
//! | `client.key` | the public key of stowd's own client key pair | 0644 |
//! | `client.key_secret` | that key pair: what stowd presents to its peers, and what a client of stowd's own user finds | 0600 |
//!
//! The native endpoint takes `client.key`'s key and `[security]
//! curve_clients`; the check compares every allowed key in constant time,
//! and a refusal names none.

use std::path::{Path, PathBuf};

use subtle::ConstantTimeEq;

use crate::config::SecurityConfig;
use crate::transport::curve::{KEY_LEN, KeyCheck, Keypair, z85_decode, z85_encode};

/// stowd's CURVE key pairs and the client keys it takes.
pub struct CurveKeys {
    /// The native endpoint's key pair.
    pub server: Keypair,
    /// The key pair stowd presents to its peers.
    pub client: Keypair,
    /// Peers' server public key.
    pub peer_server: [u8; KEY_LEN],
    /// (what the key is called in logs, the key).
    allowed: Vec<(String, [u8; KEY_LEN])>,
}

impl std::fmt::Debug for CurveKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CurveKeys")
            .field("server", &self.server)
            .field("allowed", &self.allowed.len())
            .finish_non_exhaustive()
    }
}

impl CurveKeys {
    /// The keys of `security` (`curve_dir`, made when missing, and
    /// `curve_clients`).
    pub fn load_or_make(security: &SecurityConfig) -> Result<CurveKeys, String> {
        let dir = &security.curve_dir;
        let server = load_or_make_pair(dir, "server")?;
        let client = load_or_make_pair(dir, "client")?;
        let mut allowed = vec![("stowd's client.key".to_string(), *client.public())];
        for (i, k) in security.curve_clients.iter().enumerate() {
            let key = z85_decode(k).map_err(|e| format!("[security] curve_clients[{i}]: {e}"))?;
            allowed.push((format!("[security] curve_clients[{i}]"), key));
        }
        let peer_server = match security.peer_curve_server_key.as_str() {
            "" => *server.public(),
            k => z85_decode(k).map_err(|e| format!("[security] peer_curve_server_key: {e}"))?,
        };
        Ok(CurveKeys {
            server,
            client,
            peer_server,
            allowed,
        })
    }

    /// The server's public key in Z85.
    pub fn server_public(&self) -> String {
        z85_encode(self.server.public())
    }
}

impl KeyCheck for CurveKeys {
    fn check(&self, client: &[u8; KEY_LEN]) -> Result<String, String> {
        let mut found = None;
        for (name, key) in &self.allowed {
            if bool::from(key.as_slice().ct_eq(client.as_slice())) {
                found.get_or_insert(name);
            }
        }
        found.cloned().ok_or_else(|| {
            "client key not allowed: stowd takes its own client.key (in its curve_dir) and \
             [security] curve_clients"
                .into()
        })
    }
}

/// The certificate text of `keys`: the public key, and the secret key
/// when `secret`.
fn certificate(keys: &Keypair, secret: bool) -> String {
    let mut t = String::from(if secret {
        "#   ZeroMQ CURVE **Secret** Certificate, made by stowd\n\
         #   Give it to no one, and keep its mode 0600.\n\n"
    } else {
        "#   ZeroMQ CURVE Public Certificate, made by stowd\n\n"
    });
    t.push_str("metadata\ncurve\n");
    t.push_str(&format!(
        "    public-key = \"{}\"\n",
        z85_encode(keys.public())
    ));
    if secret {
        t.push_str(&format!(
            "    secret-key = \"{}\"\n",
            z85_encode(&keys.secret_bytes())
        ));
    }
    t
}

/// A key named `name` in certificate text (pyzmq's reading: a line that
/// starts with it, the value after `=`, quotes and blanks stripped).
fn field(text: &str, name: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_once('='))
        .map(|(_, v)| {
            v.trim_matches(|c: char| c == ' ' || c == '\t' || c == '"' || c == '\'')
                .to_string()
        })
}

/// The key pair in a secret certificate file, `None` if there is none.
pub fn read_pair(path: &Path) -> Result<Option<Keypair>, String> {
    let shown = path.display();
    let Some(text) = super::read_private(path)? else {
        return Ok(None);
    };
    let secret = field(&text, "secret-key").ok_or_else(|| format!("{shown}: no secret-key"))?;
    let keys =
        Keypair::from_secret(z85_decode(&secret).map_err(|e| format!("{shown}: secret-key: {e}"))?);
    if let Some(public) = field(&text, "public-key") {
        let public = z85_decode(&public).map_err(|e| format!("{shown}: public-key: {e}"))?;
        if public != *keys.public() {
            return Err(format!("{shown}: public-key is not the secret key's"));
        }
    }
    Ok(Some(keys))
}

/// The public key in a certificate file.
pub fn read_public(path: &Path) -> Result<[u8; KEY_LEN], String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("{shown}: {e}"))?;
    let public = field(&text, "public-key").ok_or_else(|| format!("{shown}: no public-key"))?;
    z85_decode(&public).map_err(|e| format!("{shown}: public-key: {e}"))
}

/// `<dir>/<name>.key_secret`'s key pair, made (with `<name>.key`) when
/// missing.
fn load_or_make_pair(dir: &Path, name: &str) -> Result<Keypair, String> {
    let secret_path = dir.join(format!("{name}.key_secret"));
    let public_path = dir.join(format!("{name}.key"));
    let keys = match read_pair(&secret_path)? {
        Some(k) => k,
        None => {
            super::make_private_dir(&secret_path)?;
            let made = Keypair::generate().map_err(|e| e.to_string())?;
            if super::publish(&secret_path, certificate(&made, true).as_bytes(), 0o600)? {
                tracing::info!(file = %secret_path.display(), "made a CURVE key pair (mode 0600)");
                made
            } else {
                read_pair(&secret_path)?.ok_or_else(|| {
                    format!("{}: vanished while it was made", secret_path.display())
                })?
            }
        }
    };
    // The public file follows the secret one: rewritten when it does not
    // say the same key.
    if read_public(&public_path).ok() != Some(*keys.public()) {
        let tmp = public_path.with_extension(format!("tmp.{}", std::process::id()));
        std::fs::write(&tmp, certificate(&keys, false))
            .and_then(|()| std::fs::rename(&tmp, &public_path))
            .map_err(|e| format!("{}: {e}", public_path.display()))?;
    }
    Ok(keys)
}

/// The CURVE keys a client of this user presents to a stowd that asks for
/// CURVE, found as the Python client finds them: `client.key_secret` in
/// `$STOWAGE_CURVE_DIR`, else in the default `[security] curve_dir`; the
/// server key `$STOWAGE_CURVE_SERVER_KEY`, else `server.key` there.
pub fn client_keys() -> Option<(Keypair, [u8; KEY_LEN])> {
    let dir = std::env::var_os("STOWAGE_CURVE_DIR")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| SecurityConfig::default().curve_dir);
    let client = read_pair(&dir.join("client.key_secret")).ok().flatten()?;
    let server = match std::env::var("STOWAGE_CURVE_SERVER_KEY") {
        Ok(k) if !k.is_empty() => z85_decode(&k).ok()?,
        _ => read_public(&dir.join("server.key")).ok()?,
    };
    Some((client, server))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn keys_are_made_once_in_certificate_files_and_only_allowed_clients_pass() {
        let d = std::env::temp_dir().join(format!("stowage-curve-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let other = Keypair::generate().unwrap();
        let sec = SecurityConfig {
            auth: "curve".into(),
            curve_dir: d.join("curve"),
            curve_clients: vec![z85_encode(other.public())],
            ..SecurityConfig::default()
        };
        let k = CurveKeys::load_or_make(&sec).unwrap();
        for (f, mode) in [
            ("server.key_secret", 0o600),
            ("client.key_secret", 0o600),
            ("server.key", 0o644),
            ("client.key", 0o644),
        ] {
            let m = super::super::mode_of(&d.join("curve").join(f));
            if mode == 0o600 {
                assert_eq!(m, 0o600, "{f}");
            } else {
                assert_eq!(
                    m & 0o077,
                    m & 0o044,
                    "{f}: public, never writable by others"
                );
            }
        }
        assert_eq!(super::super::mode_of(&d.join("curve")), 0o700);
        assert_eq!(
            read_public(&d.join("curve/server.key")).unwrap(),
            *k.server.public()
        );
        let again = CurveKeys::load_or_make(&sec).unwrap();
        assert_eq!(
            again.server.public(),
            k.server.public(),
            "the same keys at the next start"
        );
        assert_eq!(again.client.public(), k.client.public());
        assert_eq!(k.peer_server, *k.server.public());
        assert_eq!(k.check(k.client.public()).unwrap(), "stowd's client.key");
        assert_eq!(
            k.check(other.public()).unwrap(),
            "[security] curve_clients[0]"
        );
        let e = k.check(Keypair::generate().unwrap().public()).unwrap_err();
        assert!(e.contains("not allowed"));
        // A secret file others can read is refused; so is one whose public
        // key is another's.
        let secret = d.join("curve/server.key_secret");
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(
            CurveKeys::load_or_make(&sec)
                .unwrap_err()
                .contains("chmod 600")
        );
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let text = std::fs::read_to_string(&secret).unwrap();
        let forged = text.replace(&z85_encode(k.server.public()), &z85_encode(other.public()));
        std::fs::write(&secret, forged).unwrap();
        assert!(
            CurveKeys::load_or_make(&sec)
                .unwrap_err()
                .contains("not the secret key's")
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
