//! CurveZMQ (RFC 26, carried by ZMTP as RFC 25) without I/O: keys, the
//! handshake of both roles, and the codecs that turn a plaintext ZMTP frame
//! stream into MESSAGE commands and back.
//!
//! The handshake, as libzmq 4.x speaks it (`C`/`c` the client's long-term
//! public/secret key, `S`/`s` the server's, primes the per-connection
//! transient keys, `Box[x](A->B)` a NaCl `crypto_box` of `x` from `A`'s
//! secret key to `B`'s public key, its 16-byte tag first):
//!
//! | command | from | body after its name |
//! |---|---|---|
//! | HELLO | client | version 1.0, 72 zero bytes, `C'`, short nonce, `Box[64 zeros](C'->S)` |
//! | WELCOME | server | long nonce, `Box[S' + cookie](S->C')` |
//! | INITIATE | client | cookie, short nonce, `Box[C + vouch + metadata](C'->S')` |
//! | READY | server | short nonce, `Box[metadata](S'->C')` |
//! | MESSAGE | either | short nonce, `Box[flags + frame](C'->S' or S'->C')` |
//!
//! The cookie is `Box[C' + s']` under a key only the server holds, the
//! vouch `Box[C' + S](C->S')`: it proves that the holder of `C` made `C'`.
//! So the server learns the client's long-term key, which it checks
//! against its allowlist ([`ServerHandshake::initiate`]), and each side
//! knows the other holds its secret key before a byte of data moves.
//! Every frame afterwards is one MESSAGE: its flags byte carries MORE
//! (0x01) and COMMAND (0x02, a ZMTP command such as PING), its short nonce
//! counts up in each direction from 1, and a nonce that does not rise is
//! refused (a replayed or reordered frame).
//!
//! [`Encrypter`] and [`Decrypter`] are byte-stream codecs: the plaintext
//! side is ordinary ZMTP framing, so the frame reader and writers of
//! [`crate::zmtp`] (and the Python client's core) run unchanged over them.
//!
//! The crypto is RustCrypto's: `crypto_box` (X25519, HSalsa20,
//! XSalsa20-Poly1305, NaCl's `crypto_box`) and `crypto_secretbox` (the
//! cookie). Keys are written in Z85 (RFC 32), as libzmq and pyzmq write
//! them, through the `z85` crate.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use crypto_box::aead::AeadInPlace;
use crypto_box::aead::generic_array::GenericArray;
use crypto_box::{PublicKey, SalsaBox, SecretKey};
use crypto_secretbox::{KeyInit, XSalsa20Poly1305};

use crate::frame::{self, Decoded, FLAG_COMMAND, FLAG_MORE, FrameError, Header, MAX_HEADER};

/// Bytes of a key, public or secret.
pub const KEY_LEN: usize = 32;
/// Bytes of a key in Z85.
pub const KEY_Z85_LEN: usize = 40;
/// Bytes of a box's tag (Poly1305), before the ciphertext.
const TAG: usize = 16;
/// Bytes of a HELLO body.
const HELLO_LEN: usize = 200;
/// Bytes of a WELCOME body.
const WELCOME_LEN: usize = 168;
/// Bytes of a cookie: its long nonce and its box.
const COOKIE_LEN: usize = 96;
/// Fewest bytes of an INITIATE body: name, cookie, nonce, the box of `C`
/// and the vouch.
const INITIATE_MIN: usize = 9 + COOKIE_LEN + 8 + TAG + KEY_LEN + 96;
/// Fewest bytes of a READY body.
const READY_MIN: usize = 6 + 8 + TAG;
/// Bytes of a MESSAGE body before its frame: name, nonce, tag, flags.
pub const MESSAGE_OVERHEAD: usize = 8 + 8 + TAG + 1;

/// Why a CURVE handshake or message was refused. The texts name no key
/// material.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CurveError {
    #[error("malformed CURVE {0}")]
    Malformed(&'static str),
    #[error("CURVE {0} did not decrypt: {1}")]
    Forged(&'static str, &'static str),
    #[error("CURVE version {0}.{1} is not supported (1.0 is)")]
    Version(u8, u8),
    #[error("CURVE {0} nonce did not rise (a replayed or reordered frame)")]
    Replay(&'static str),
    #[error("CURVE client key refused: {0}")]
    Refused(String),
    #[error("expected a CURVE MESSAGE command, got {0}")]
    NotMessage(String),
    #[error("peer sent ERROR: {0}")]
    PeerError(String),
    #[error("CURVE frame of {0} bytes is over the limit of {1}")]
    TooLarge(u64, u64),
    #[error("{0}")]
    Frame(#[from] frame::FrameError),
    #[error("not a CURVE key: {0}")]
    Key(String),
    #[error("no randomness: {0}")]
    Random(String),
}

fn random<const N: usize>() -> Result<[u8; N], CurveError> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| CurveError::Random(e.to_string()))?;
    Ok(b)
}

/// A long-term (or transient) key pair.
#[derive(Clone)]
pub struct Keypair {
    public: [u8; KEY_LEN],
    secret: SecretKey,
}

impl std::fmt::Debug for Keypair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keypair")
            .field("public", &z85_encode(&self.public))
            .finish_non_exhaustive()
    }
}

impl Keypair {
    /// A fresh key pair from the OS's randomness.
    pub fn generate() -> Result<Keypair, CurveError> {
        Ok(Keypair::from_secret(random()?))
    }

    /// The key pair of this secret key.
    pub fn from_secret(secret: [u8; KEY_LEN]) -> Keypair {
        let secret = SecretKey::from(secret);
        Keypair {
            public: *secret.public_key().as_bytes(),
            secret,
        }
    }

    pub fn public(&self) -> &[u8; KEY_LEN] {
        &self.public
    }

    /// The secret key's bytes (for writing it to its file).
    pub fn secret_bytes(&self) -> [u8; KEY_LEN] {
        self.secret.to_bytes()
    }
}

/// `key` in Z85 (40 characters).
pub fn z85_encode(key: &[u8; KEY_LEN]) -> String {
    z85::encode(key)
}

/// A key from its Z85 text (40 characters, surrounding whitespace allowed).
pub fn z85_decode(text: &str) -> Result<[u8; KEY_LEN], CurveError> {
    let t = text.trim();
    if t.len() != KEY_Z85_LEN {
        return Err(CurveError::Key(format!(
            "{} characters, not the {KEY_Z85_LEN} of a Z85 key",
            t.len()
        )));
    }
    let bytes = z85::decode(t).map_err(|e| CurveError::Key(format!("not Z85: {e}")))?;
    bytes
        .try_into()
        .map_err(|_| CurveError::Key("not 32 bytes".into()))
}

/// A 24-byte nonce: a 16-byte prefix then an 8-byte short nonce, or an
/// 8-byte prefix then a 16-byte long nonce.
fn nonce(prefix: &[u8], rest: &[u8]) -> GenericArray<u8, crypto_box::aead::consts::U24> {
    debug_assert_eq!(prefix.len() + rest.len(), 24);
    let mut n = GenericArray::default();
    n[..prefix.len()].copy_from_slice(prefix);
    n[prefix.len()..].copy_from_slice(rest);
    n
}

/// `Box[plain]` (tag then ciphertext) under `cipher`, appended to `out`.
fn seal_to<A: AeadInPlace>(
    cipher: &A,
    n: &GenericArray<u8, A::NonceSize>,
    plain: &[u8],
    out: &mut Vec<u8>,
) {
    let at = out.len();
    out.resize(at + TAG, 0);
    out.extend_from_slice(plain);
    let tag = cipher
        .encrypt_in_place_detached(n, b"", &mut out[at + TAG..])
        .expect("a box of any length seals");
    out[at..at + TAG].copy_from_slice(&tag);
}

/// Opens `sealed` (tag then ciphertext) under `cipher`: the plaintext.
fn open<A: AeadInPlace>(
    cipher: &A,
    n: &GenericArray<u8, A::NonceSize>,
    sealed: &[u8],
    what: &'static str,
    why: &'static str,
) -> Result<Vec<u8>, CurveError> {
    if sealed.len() < TAG {
        return Err(CurveError::Malformed(what));
    }
    let mut plain = sealed[TAG..].to_vec();
    cipher
        .decrypt_in_place_detached(n, b"", &mut plain, GenericArray::from_slice(&sealed[..TAG]))
        .map_err(|_| CurveError::Forged(what, why))?;
    Ok(plain)
}

/// The box from `ours` to `theirs`, refused if `theirs` is of small order
/// (the X25519 output all zeros, so the box's key would be known to
/// anyone), as libsodium, and so libzmq, refuses it.
fn salsa_box(theirs: &PublicKey, ours: &SecretKey) -> Result<SalsaBox, CurveError> {
    let shared = curve25519_dalek::montgomery::MontgomeryPoint(*theirs.as_bytes())
        .mul_clamped(ours.to_bytes());
    if shared.0 == [0u8; KEY_LEN] {
        return Err(CurveError::Key("a public key of small order".into()));
    }
    Ok(SalsaBox::new(theirs, ours))
}

fn key(bytes: &[u8]) -> PublicKey {
    let k: [u8; KEY_LEN] = bytes.try_into().expect("32 bytes");
    PublicKey::from(k)
}

fn command_body(name: &str, capacity: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(1 + name.len() + capacity);
    b.push(name.len() as u8);
    b.extend_from_slice(name.as_bytes());
    b
}

/// The data of a command body whose name is `name` (`body` is the body,
/// name included).
fn data_of<'a>(body: &'a [u8], name: &'static str) -> Result<&'a [u8], CurveError> {
    let (n, data) = frame::split_command(body)?;
    if n == b"ERROR" {
        return Err(CurveError::PeerError(frame::error_reason(data)));
    }
    if n != name.as_bytes() {
        return Err(CurveError::Malformed(name));
    }
    Ok(data)
}

/// The handshake's client side.
pub struct ClientHandshake {
    long: Keypair,
    server: PublicKey,
    transient: Keypair,
    /// `C'` to `S`: HELLO's box and WELCOME's.
    to_server: SalsaBox,
    nonce: u64,
    /// `C'` to `S'`, once WELCOME is read.
    session: Option<SalsaBox>,
}

impl ClientHandshake {
    /// A client with key pair `long` to the server whose public key is
    /// `server`.
    pub fn new(long: &Keypair, server: &[u8; KEY_LEN]) -> Result<ClientHandshake, CurveError> {
        let server = PublicKey::from(*server);
        let transient = Keypair::generate()?;
        Ok(ClientHandshake {
            long: long.clone(),
            to_server: salsa_box(&server, &transient.secret)?,
            server,
            transient,
            nonce: 1,
            session: None,
        })
    }

    fn next_nonce(&mut self) -> [u8; 8] {
        let n = self.nonce.to_be_bytes();
        self.nonce += 1;
        n
    }

    /// The HELLO command's body.
    pub fn hello(&mut self) -> Vec<u8> {
        let short = self.next_nonce();
        let mut body = command_body("HELLO", HELLO_LEN);
        body.extend_from_slice(&[1, 0]);
        body.extend_from_slice(&[0u8; 72]);
        body.extend_from_slice(&self.transient.public);
        body.extend_from_slice(&short);
        seal_to(
            &self.to_server,
            &nonce(b"CurveZMQHELLO---", &short),
            &[0u8; 64],
            &mut body,
        );
        debug_assert_eq!(body.len(), HELLO_LEN);
        body
    }

    /// Reads WELCOME (a body, name included) and answers INITIATE's body,
    /// carrying `metadata` (ZMTP properties).
    pub fn welcome(&mut self, body: &[u8], metadata: &[u8]) -> Result<Vec<u8>, CurveError> {
        let data = data_of(body, "WELCOME")?;
        if body.len() != WELCOME_LEN {
            return Err(CurveError::Malformed("WELCOME"));
        }
        let plain = open(
            &self.to_server,
            &nonce(b"WELCOME-", &data[..16]),
            &data[16..],
            "WELCOME",
            "the server does not hold the secret key of the public key this client was given",
        )?;
        let server_transient = key(&plain[..KEY_LEN]);
        let cookie = &plain[KEY_LEN..];
        // The vouch: C' and S, from C to S'.
        let vouch_nonce: [u8; 16] = random()?;
        let mut vouch = Vec::with_capacity(16 + TAG + 64);
        vouch.extend_from_slice(&vouch_nonce);
        let mut vouched = [0u8; 64];
        vouched[..KEY_LEN].copy_from_slice(&self.transient.public);
        vouched[KEY_LEN..].copy_from_slice(self.server.as_bytes());
        seal_to(
            &salsa_box(&server_transient, &self.long.secret)?,
            &nonce(b"VOUCH---", &vouch_nonce),
            &vouched,
            &mut vouch,
        );
        let mut inner = Vec::with_capacity(KEY_LEN + vouch.len() + metadata.len());
        inner.extend_from_slice(&self.long.public);
        inner.extend_from_slice(&vouch);
        inner.extend_from_slice(metadata);
        let session = salsa_box(&server_transient, &self.transient.secret)?;
        let short = self.next_nonce();
        let mut out = command_body("INITIATE", COOKIE_LEN + 8 + TAG + inner.len());
        out.extend_from_slice(cookie);
        out.extend_from_slice(&short);
        seal_to(
            &session,
            &nonce(b"CurveZMQINITIATE", &short),
            &inner,
            &mut out,
        );
        self.session = Some(session);
        Ok(out)
    }

    /// Reads READY (a body, name included): the server's metadata and the
    /// connection's codecs.
    pub fn ready(self, body: &[u8]) -> Result<(Vec<u8>, Session), CurveError> {
        let data = data_of(body, "READY")?;
        let session = self
            .session
            .ok_or(CurveError::Malformed("READY before WELCOME"))?;
        if body.len() < READY_MIN {
            return Err(CurveError::Malformed("READY"));
        }
        let short = u64::from_be_bytes(data[..8].try_into().expect("8 bytes"));
        let metadata = open(
            &session,
            &nonce(b"CurveZMQREADY---", &data[..8]),
            &data[8..],
            "READY",
            "not from the server this client greeted",
        )?;
        Ok((metadata, Session::new(session, true, self.nonce, short)))
    }
}

/// Who a CURVE server takes: the user a client key names (for logs), or
/// why it is refused (sent to the client in ERROR).
pub trait KeyCheck: Send + Sync {
    fn check(&self, client: &[u8; KEY_LEN]) -> Result<String, String>;
}

/// What the server learned from INITIATE.
#[derive(Debug, Clone)]
pub struct Initiated {
    /// The client's long-term public key, vouched for.
    pub client: [u8; KEY_LEN],
    /// The user [`KeyCheck::check`] named.
    pub user: String,
    /// The client's metadata (ZMTP properties).
    pub metadata: Vec<u8>,
}

/// The handshake's server side.
pub struct ServerHandshake {
    long: Keypair,
    transient: Keypair,
    cookie_key: [u8; KEY_LEN],
    client_transient: Option<PublicKey>,
    client_nonce: u64,
    session: Option<SalsaBox>,
}

impl ServerHandshake {
    /// A server with key pair `long`.
    pub fn new(long: &Keypair) -> Result<ServerHandshake, CurveError> {
        Ok(ServerHandshake {
            long: long.clone(),
            transient: Keypair::generate()?,
            cookie_key: random()?,
            client_transient: None,
            client_nonce: 0,
            session: None,
        })
    }

    /// Reads HELLO (a body, name included) and answers WELCOME's body.
    pub fn hello(&mut self, body: &[u8]) -> Result<Vec<u8>, CurveError> {
        let data = data_of(body, "HELLO")?;
        if body.len() != HELLO_LEN {
            return Err(CurveError::Malformed("HELLO"));
        }
        if data[0] != 1 || data[1] != 0 {
            return Err(CurveError::Version(data[0], data[1]));
        }
        let client_transient = key(&data[74..106]);
        let short = &data[106..114];
        let b = salsa_box(&client_transient, &self.long.secret)?;
        open(
            &b,
            &nonce(b"CurveZMQHELLO---", short),
            &data[114..],
            "HELLO",
            "the client was given another server's public key",
        )?;
        self.client_nonce = u64::from_be_bytes(short.try_into().expect("8 bytes"));
        // The cookie: C' and s', under a key only this server holds.
        let cookie_nonce: [u8; 16] = random()?;
        let mut cookie = Vec::with_capacity(COOKIE_LEN);
        cookie.extend_from_slice(&cookie_nonce);
        let mut kept = [0u8; 64];
        kept[..KEY_LEN].copy_from_slice(client_transient.as_bytes());
        kept[KEY_LEN..].copy_from_slice(&self.transient.secret_bytes());
        seal_to(
            &XSalsa20Poly1305::new(GenericArray::from_slice(&self.cookie_key)),
            &nonce(b"COOKIE--", &cookie_nonce),
            &kept,
            &mut cookie,
        );
        let mut inner = Vec::with_capacity(KEY_LEN + COOKIE_LEN);
        inner.extend_from_slice(&self.transient.public);
        inner.extend_from_slice(&cookie);
        let long_nonce: [u8; 16] = random()?;
        let mut out = command_body("WELCOME", WELCOME_LEN);
        out.extend_from_slice(&long_nonce);
        seal_to(&b, &nonce(b"WELCOME-", &long_nonce), &inner, &mut out);
        debug_assert_eq!(out.len(), WELCOME_LEN);
        self.client_transient = Some(client_transient);
        Ok(out)
    }

    /// Reads INITIATE (a body, name included): the client's vouched key,
    /// checked by `check`, and its metadata.
    pub fn initiate(&mut self, body: &[u8], check: &dyn KeyCheck) -> Result<Initiated, CurveError> {
        let data = data_of(body, "INITIATE")?;
        let client_transient = self
            .client_transient
            .clone()
            .ok_or(CurveError::Malformed("INITIATE before HELLO"))?;
        if body.len() < INITIATE_MIN {
            return Err(CurveError::Malformed("INITIATE"));
        }
        let cookie = &data[..COOKIE_LEN];
        let kept = open(
            &XSalsa20Poly1305::new(GenericArray::from_slice(&self.cookie_key)),
            &nonce(b"COOKIE--", &cookie[..16]),
            &cookie[16..],
            "INITIATE cookie",
            "not this server's cookie",
        )?;
        if kept[..KEY_LEN] != *client_transient.as_bytes()
            || kept[KEY_LEN..] != self.transient.secret_bytes()
        {
            return Err(CurveError::Forged(
                "INITIATE cookie",
                "made for another connection",
            ));
        }
        let short_bytes = &data[COOKIE_LEN..COOKIE_LEN + 8];
        let short = u64::from_be_bytes(short_bytes.try_into().expect("8 bytes"));
        if short <= self.client_nonce {
            return Err(CurveError::Replay("INITIATE"));
        }
        let session = salsa_box(&client_transient, &self.transient.secret)?;
        let inner = open(
            &session,
            &nonce(b"CurveZMQINITIATE", short_bytes),
            &data[COOKIE_LEN + 8..],
            "INITIATE",
            "not from the client that sent HELLO",
        )?;
        let client: [u8; KEY_LEN] = inner[..KEY_LEN].try_into().expect("32 bytes");
        let vouch = &inner[KEY_LEN..KEY_LEN + 96];
        let vouched = open(
            &salsa_box(&PublicKey::from(client), &self.transient.secret)?,
            &nonce(b"VOUCH---", &vouch[..16]),
            &vouch[16..],
            "INITIATE vouch",
            "the client does not hold the secret key of the public key it names",
        )?;
        if vouched[..KEY_LEN] != *client_transient.as_bytes()
            || vouched[KEY_LEN..] != self.long.public
        {
            return Err(CurveError::Forged(
                "INITIATE vouch",
                "vouches for another connection",
            ));
        }
        let user = check.check(&client).map_err(CurveError::Refused)?;
        self.client_nonce = short;
        self.session = Some(session);
        Ok(Initiated {
            client,
            user,
            metadata: inner[KEY_LEN + 96..].to_vec(),
        })
    }

    /// READY's body carrying `metadata`, and the connection's codecs.
    pub fn ready(self, metadata: &[u8]) -> Result<(Vec<u8>, Session), CurveError> {
        let session = self
            .session
            .ok_or(CurveError::Malformed("READY before INITIATE"))?;
        let short = 1u64.to_be_bytes();
        let mut out = command_body("READY", 8 + TAG + metadata.len());
        out.extend_from_slice(&short);
        seal_to(
            &session,
            &nonce(b"CurveZMQREADY---", &short),
            metadata,
            &mut out,
        );
        Ok((out, Session::new(session, false, 2, self.client_nonce)))
    }
}

/// A connection's codecs after the handshake.
pub struct Session {
    pub encrypter: Encrypter,
    pub decrypter: Decrypter,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").finish_non_exhaustive()
    }
}

impl Session {
    fn new(cipher: SalsaBox, client: bool, next: u64, peer_last: u64) -> Session {
        let cipher = Arc::new(cipher);
        let (ours, theirs): (&[u8; 16], &[u8; 16]) = if client {
            (b"CurveZMQMESSAGEC", b"CurveZMQMESSAGES")
        } else {
            (b"CurveZMQMESSAGES", b"CurveZMQMESSAGEC")
        };
        Session {
            encrypter: Encrypter {
                cipher: cipher.clone(),
                prefix: *ours,
                nonce: next,
                frames: Gather::default(),
            },
            decrypter: Decrypter {
                cipher,
                prefix: *theirs,
                last: peer_last,
                frames: Gather::default(),
                max_frame: u64::MAX,
                plain: VecDeque::new(),
                plain_len: 0,
            },
        }
    }
}

/// A ZMTP frame stream cut into frames, whatever the cuts: a header parsed
/// across them, then a body gathered into a buffer the caller chose.
#[derive(Default)]
struct Gather {
    head: [u8; MAX_HEADER],
    head_len: usize,
    /// The body being gathered, and how many of its bytes are still to come.
    body: Option<(Vec<u8>, usize)>,
}

/// What [`Gather::step`] found.
enum Step {
    /// A frame's header: the caller starts its body ([`Gather::start`]).
    Header(Header),
    /// A frame's body, whole.
    Body(Vec<u8>),
}

impl Gather {
    /// Takes bytes from the front of `bytes` until a header is parsed or a
    /// body completes: how many it took, and what it found.
    fn step(&mut self, bytes: &[u8]) -> Result<(usize, Option<Step>), FrameError> {
        if let Some((buf, left)) = &mut self.body {
            let n = (*left).min(bytes.len());
            buf.extend_from_slice(&bytes[..n]);
            *left -= n;
            if *left > 0 {
                return Ok((n, None));
            }
            let (buf, _) = self.body.take().expect("a body");
            return Ok((n, Some(Step::Body(buf))));
        }
        let n = (MAX_HEADER - self.head_len).min(bytes.len());
        self.head[self.head_len..self.head_len + n].copy_from_slice(&bytes[..n]);
        match frame::parse_header(&self.head[..self.head_len + n])? {
            Decoded::Needs(_) => {
                self.head_len += n;
                Ok((n, None))
            }
            Decoded::Done(h) => {
                // Of the bytes just copied, those past the header are the
                // body's.
                let used = h.header_len - self.head_len;
                self.head_len = 0;
                Ok((used, Some(Step::Header(h))))
            }
        }
    }

    /// Gathers the next `len` bytes (at least 1) after what `buf` holds.
    fn start(&mut self, buf: Vec<u8>, len: usize) {
        self.body = Some((buf, len));
    }

    fn mid_frame(&self) -> bool {
        self.body.is_some() || self.head_len != 0
    }
}

/// Plaintext ZMTP frames in, MESSAGE frames out (each a single-frame
/// message whose body is the MESSAGE command, as libzmq frames it).
pub struct Encrypter {
    cipher: Arc<SalsaBox>,
    prefix: [u8; 16],
    nonce: u64,
    frames: Gather,
}

/// Where a MESSAGE's flags byte is in its wire frame (a data frame of
/// [`MAX_HEADER`] bytes of header, then the name, nonce and tag).
const FLAGS_AT: usize = MAX_HEADER + 8 + 8 + TAG;

impl Encrypter {
    /// Takes all of `plain` (ZMTP frames, cut anywhere); each frame whose
    /// last byte it holds is pushed to `out` as one MESSAGE frame.
    pub fn feed(&mut self, mut plain: &[u8], out: &mut VecDeque<Bytes>) -> Result<(), CurveError> {
        while !plain.is_empty() {
            let (n, step) = self.frames.step(plain)?;
            plain = &plain[n..];
            match step {
                None => {}
                Some(Step::Body(buf)) => out.push_back(self.seal(buf)),
                Some(Step::Header(h)) => {
                    let size = usize::try_from(h.size)
                        .map_err(|_| CurveError::TooLarge(h.size, usize::MAX as u64))?;
                    // Room for the longest header, written at seal time.
                    let capacity = size.checked_add(FLAGS_AT + 1).ok_or(CurveError::TooLarge(
                        h.size,
                        (usize::MAX - FLAGS_AT - 1) as u64,
                    ))?;
                    let mut buf = Vec::with_capacity(capacity);
                    buf.resize(FLAGS_AT, 0);
                    buf.push(u8::from(h.more) | (u8::from(h.command) << 1));
                    if size == 0 {
                        out.push_back(self.seal(buf));
                    } else {
                        self.frames.start(buf, size);
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether a frame is partly fed.
    pub fn mid_frame(&self) -> bool {
        self.frames.mid_frame()
    }

    /// Seals a gathered frame (`buf`: [`FLAGS_AT`] bytes of room, the flags
    /// byte, the frame) into its MESSAGE wire frame.
    fn seal(&mut self, mut buf: Vec<u8>) -> Bytes {
        let short = self.nonce.to_be_bytes();
        self.nonce += 1;
        let tag = self
            .cipher
            .encrypt_in_place_detached(&nonce(&self.prefix, &short), b"", &mut buf[FLAGS_AT..])
            .expect("a box of any length seals");
        let body = buf.len() - MAX_HEADER;
        // A data frame, as libzmq sends it: MORE and COMMAND are inside the
        // box. Its header ends where the body starts.
        let mut hb = [0u8; MAX_HEADER];
        let head = Header::message(body as u64, false).encode(&mut hb).len();
        let at = MAX_HEADER - head;
        buf[at..MAX_HEADER].copy_from_slice(&hb[..head]);
        buf[MAX_HEADER..MAX_HEADER + 8].copy_from_slice(b"\x07MESSAGE");
        buf[MAX_HEADER + 8..MAX_HEADER + 16].copy_from_slice(&short);
        buf[MAX_HEADER + 16..FLAGS_AT].copy_from_slice(&tag);
        Bytes::from(buf).slice(at..)
    }
}

/// MESSAGE frames in (data or command frames), plaintext ZMTP frames out.
pub struct Decrypter {
    cipher: Arc<SalsaBox>,
    prefix: [u8; 16],
    last: u64,
    frames: Gather,
    max_frame: u64,
    plain: VecDeque<Bytes>,
    plain_len: usize,
}

/// First allocation for a MESSAGE body; it then grows with the bytes that
/// arrive, so a declared size alone costs at most this.
const FIRST_CHUNK: usize = 1 << 20;

impl Decrypter {
    /// Refuses a frame of more than `max` bytes before reading it.
    pub fn set_max_frame(&mut self, max: u64) {
        self.max_frame = max;
    }

    /// Takes all of `wire` (MESSAGE frames, cut anywhere); each frame it
    /// completes is opened and its plaintext ZMTP frame kept for
    /// [`Decrypter::read`].
    pub fn feed(&mut self, mut wire: &[u8]) -> Result<(), CurveError> {
        while !wire.is_empty() {
            let (n, step) = self.frames.step(wire)?;
            wire = &wire[n..];
            match step {
                None => {}
                Some(Step::Body(body)) => self.open(body)?,
                Some(Step::Header(h)) => {
                    if h.more {
                        // Each MESSAGE is a frame of its own; MORE is in
                        // its box.
                        return Err(CurveError::NotMessage("a frame with MORE set".into()));
                    }
                    let limit = self.max_frame.saturating_add(MESSAGE_OVERHEAD as u64);
                    if h.size > limit {
                        return Err(CurveError::TooLarge(h.size, self.max_frame));
                    }
                    if h.size == 0 {
                        return Err(CurveError::NotMessage("an empty frame".into()));
                    }
                    let size = h.size as usize;
                    self.frames
                        .start(Vec::with_capacity(size.min(FIRST_CHUNK)), size);
                }
            }
        }
        Ok(())
    }

    fn open(&mut self, mut body: Vec<u8>) -> Result<(), CurveError> {
        let (name, _) = frame::split_command(&body)?;
        if name == b"ERROR" {
            let (_, data) = frame::split_command(&body)?;
            return Err(CurveError::PeerError(frame::error_reason(data)));
        }
        if name != b"MESSAGE" {
            return Err(CurveError::NotMessage(
                String::from_utf8_lossy(name).into_owned(),
            ));
        }
        if body.len() < MESSAGE_OVERHEAD {
            return Err(CurveError::Malformed("MESSAGE"));
        }
        let short = u64::from_be_bytes(body[8..16].try_into().expect("8 bytes"));
        if short <= self.last {
            return Err(CurveError::Replay("MESSAGE"));
        }
        let tag = *GenericArray::from_slice(&body[16..16 + TAG]);
        let n = nonce(&self.prefix, &body[8..16]);
        self.cipher
            .decrypt_in_place_detached(&n, b"", &mut body[16 + TAG..], &tag)
            .map_err(|_| CurveError::Forged("MESSAGE", "forged or garbled"))?;
        self.last = short;
        let flags = body[16 + TAG];
        if flags & !0x03 != 0 {
            return Err(CurveError::Malformed("MESSAGE flags"));
        }
        let size = body.len() - MESSAGE_OVERHEAD;
        let h = if flags & 0x02 != 0 {
            if size as u64 > frame::MAX_COMMAND {
                return Err(CurveError::Malformed("MESSAGE command"));
            }
            Header::command(size as u64)
        } else {
            Header::message(size as u64, flags & 0x01 != 0)
        };
        debug_assert!(flags & 0x01 == 0 || h.flags() & FLAG_MORE != 0);
        debug_assert!(flags & 0x02 == 0 || h.flags() & FLAG_COMMAND != 0);
        let mut hb = [0u8; MAX_HEADER];
        let head = Bytes::copy_from_slice(h.encode(&mut hb));
        self.plain_len += head.len() + size;
        self.plain.push_back(head);
        if size > 0 {
            self.plain
                .push_back(Bytes::from(body).slice(MESSAGE_OVERHEAD..));
        }
        Ok(())
    }

    /// Plaintext bytes ready to be read.
    pub fn ready(&self) -> usize {
        self.plain_len
    }

    /// Copies up to `out.len()` plaintext bytes into `out`: how many.
    pub fn read(&mut self, out: &mut [u8]) -> usize {
        let mut n = 0;
        while n < out.len() {
            let Some(front) = self.plain.front_mut() else {
                break;
            };
            let k = front.len().min(out.len() - n);
            out[n..n + k].copy_from_slice(&front[..k]);
            n += k;
            if k == front.len() {
                self.plain.pop_front();
            } else {
                bytes::Buf::advance(front, k);
            }
        }
        self.plain_len -= n;
        n
    }
}

#[cfg(test)]
mod tests;
