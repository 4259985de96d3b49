//! ZMTP 3.0 framing without I/O: frame headers, the greeting, command
//! frames, and the commands of the NULL and PLAIN security mechanisms
//! (READY; HELLO, WELCOME, INITIATE; ERROR), parsed from byte slices and
//! written into buffers.
//!
//! Both readers of the protocol stand on this module: [`crate::zmtp`]'s
//! tokio [`FrameReader`](crate::zmtp::FrameReader), which parses headers in
//! place in its read buffer, and the Python client's Rust core, which reads
//! a blocking socket and parses them in its read-ahead buffer (or, for a
//! header split across two reads, a stack buffer). A parser is handed the
//! bytes that have arrived and answers [`Decoded::Needs`] (how many bytes
//! it needs in all) until they are enough; the caller owns the buffer and
//! the reading, so nothing here copies, allocates on the success path of a
//! header, or waits.
//!
//! A frame is a header then its body. The header is a flags byte (MORE:
//! another frame of the message follows; LONG: the size takes 8 bytes
//! rather than 1; COMMAND: a command, not a message frame; the other bits
//! reserved, refused) and the body's size, big-endian. A command's body is
//! its name (a length byte, then the name) and its data; READY's data is
//! properties (a name length byte, the name, a 4-byte value length, the
//! value). What a size may be is the caller's policy (per message for
//! `stowd`, per frame for the client), except a command's, which
//! [`Header::command_size`] bounds by [`MAX_COMMAND`] for both.
//!
//! The greeting names the security mechanism and whether its sender is
//! the server ([`Greeting`]). NULL (RFC 23) has each side send READY.
//! PLAIN (RFC 24) has the client send HELLO with a username and password,
//! the server answer WELCOME (or ERROR), the client send INITIATE with its
//! properties and the server READY with its own: the credentials go in the
//! clear, so PLAIN authenticates a peer without costing a byte of the data
//! frames, and protects nothing from a reader of the wire.

use bytes::{BufMut, Bytes, BytesMut};

/// Flag: another frame of the same message follows.
pub const FLAG_MORE: u8 = 0x01;
/// Flag: the size is 8 bytes, not 1.
pub const FLAG_LONG: u8 = 0x02;
/// Flag: a command frame (READY, PING, ERROR, ...).
pub const FLAG_COMMAND: u8 = 0x04;
/// Longest frame header: the flags byte and an 8-byte size.
pub const MAX_HEADER: usize = 9;
/// Bytes of the greeting.
pub const GREETING_LEN: usize = 64;
/// Largest command body taken; commands are small.
pub const MAX_COMMAND: u64 = 1 << 20;

/// A parse's outcome on the bytes given so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded<T> {
    /// More bytes are needed: this many in all (more than were given).
    Needs(usize),
    /// Parsed from the first bytes given.
    Done(T),
}

/// A frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Another frame of the message follows.
    pub more: bool,
    /// A command frame.
    pub command: bool,
    /// Bytes of the body, as declared: not checked against any limit.
    pub size: u64,
    /// Bytes of the header itself: 2 (short) or [`MAX_HEADER`] (long).
    pub header_len: usize,
}

/// A frame, greeting or command that breaks ZMTP. The messages are the
/// ones `stowd` reports (after "ZMTP protocol error: ").
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    #[error("frame flags {0:#04x} have reserved bits set")]
    ReservedFlags(u8),
    #[error("command frame of {0} bytes")]
    CommandSize(u64),
    #[error("truncated command name")]
    CommandName,
    #[error("not a ZMTP peer (bad greeting signature)")]
    Signature,
    #[error("ZMTP major version {0} is not supported (3 or later is)")]
    Version(u8),
    #[error("security mechanism {0:?} is not supported (NULL, PLAIN and CURVE are)")]
    Mechanism(String),
    #[error("truncated HELLO: a username and a password, each a length byte and its bytes")]
    Hello,
    #[error("truncated greeting")]
    TruncatedGreeting,
    #[error("truncated READY property")]
    ReadyProperty,
    #[error("truncated READY property {0:?}")]
    ReadyValue(String),
}

/// Parses the frame header at the start of `bytes` (bytes after it are
/// left alone). The flags are checked as soon as they are there, so a
/// reserved bit is refused before the size arrives.
pub fn parse_header(bytes: &[u8]) -> Result<Decoded<Header>, FrameError> {
    let Some(&flags) = bytes.first() else {
        return Ok(Decoded::Needs(1));
    };
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(FrameError::ReservedFlags(flags));
    }
    let (size, header_len) = if flags & FLAG_LONG != 0 {
        match bytes.get(1..MAX_HEADER) {
            Some(b) => (
                u64::from_be_bytes(b.try_into().expect("8 bytes")),
                MAX_HEADER,
            ),
            None => return Ok(Decoded::Needs(MAX_HEADER)),
        }
    } else {
        match bytes.get(1) {
            Some(&b) => (u64::from(b), 2),
            None => return Ok(Decoded::Needs(2)),
        }
    };
    Ok(Decoded::Done(Header {
        more: flags & FLAG_MORE != 0,
        command: flags & FLAG_COMMAND != 0,
        size,
        header_len,
    }))
}

impl Header {
    /// The header of a message frame of `size` bytes: short when the size
    /// fits a byte.
    pub fn message(size: u64, more: bool) -> Header {
        Header {
            more,
            command: false,
            size,
            header_len: if size > 255 { MAX_HEADER } else { 2 },
        }
    }

    /// The header of a command frame whose body is `size` bytes.
    pub fn command(size: u64) -> Header {
        Header {
            command: true,
            ..Header::message(size, false)
        }
    }

    /// The flags byte.
    pub fn flags(&self) -> u8 {
        let mut f = 0;
        if self.more {
            f |= FLAG_MORE;
        }
        if self.command {
            f |= FLAG_COMMAND;
        }
        if self.is_long() {
            f |= FLAG_LONG;
        }
        f
    }

    /// Whether the header is the long form: as parsed, or because the
    /// size needs it.
    fn is_long(&self) -> bool {
        self.header_len == MAX_HEADER || self.size > 255
    }

    /// Writes the header into `out` and returns its bytes (the first 2 or
    /// [`MAX_HEADER`]). A parsed header is written back as it was read.
    pub fn encode<'a>(&self, out: &'a mut [u8; MAX_HEADER]) -> &'a [u8] {
        out[0] = self.flags();
        if self.is_long() {
            out[1..].copy_from_slice(&self.size.to_be_bytes());
            &out[..]
        } else {
            out[1] = self.size as u8;
            &out[..2]
        }
    }

    /// Appends the header to `out`.
    pub fn put(&self, out: &mut impl BufMut) {
        let mut b = [0u8; MAX_HEADER];
        out.put_slice(self.encode(&mut b));
    }

    /// The body size of a command frame, checked: 1 to [`MAX_COMMAND`]
    /// bytes (its name's length byte at least).
    pub fn command_size(&self) -> Result<usize, FrameError> {
        if self.size > MAX_COMMAND || self.size == 0 {
            return Err(FrameError::CommandSize(self.size));
        }
        Ok(self.size as usize)
    }
}

/// Appends the header of a message frame of `len` bytes (`more`: another
/// frame of the message follows).
pub fn put_header(out: &mut BytesMut, len: usize, more: bool) {
    Header::message(len as u64, more).put(out);
}

/// Whether `bytes` begin with a whole message: frames up to one without
/// the MORE flag, each header and body all there. For a reader that must
/// not wait (the Python client's core, before it reads a reply on an
/// event loop): walks the headers only. A header that breaks the protocol,
/// or an absurd size, counts as whole, for the reader to refuse.
pub fn message_complete(bytes: &[u8]) -> bool {
    let mut at = 0usize;
    loop {
        let h = match parse_header(&bytes[at..]) {
            Ok(Decoded::Done(h)) => h,
            Ok(Decoded::Needs(_)) => return false,
            Err(_) => return true,
        };
        let Some(end) = (at as u64)
            .checked_add(h.header_len as u64)
            .and_then(|e| e.checked_add(h.size))
        else {
            return true;
        };
        if end > bytes.len() as u64 {
            return false;
        }
        at = end as usize;
        if !h.more {
            return true;
        }
    }
}

/// A ZMTP security mechanism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mechanism {
    /// RFC 23: no authentication.
    Null,
    /// RFC 24: a username and a password, in the clear.
    Plain,
    /// RFC 25/26: CurveZMQ, authenticated and encrypted ([`crate::curve`]).
    Curve,
}

impl Mechanism {
    /// The name the greeting carries.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Null => "NULL",
            Mechanism::Plain => "PLAIN",
            Mechanism::Curve => "CURVE",
        }
    }
}

/// What a peer's greeting says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Greeting {
    pub mechanism: Mechanism,
    /// The peer is the mechanism's server (PLAIN, CURVE; always false for
    /// NULL).
    pub as_server: bool,
}

/// Our greeting: ZMTP 3.0, NULL, not a server.
pub fn greeting() -> [u8; GREETING_LEN] {
    greeting_as(Mechanism::Null, false)
}

/// Our greeting: ZMTP 3.0, `mechanism`, as its server or not.
pub fn greeting_as(mechanism: Mechanism, as_server: bool) -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    let name = mechanism.name().as_bytes();
    g[12..12 + name.len()].copy_from_slice(name);
    g[32] = u8::from(as_server);
    g
}

/// Parses a peer's greeting at the start of `bytes`, step by step: the
/// signature's first byte tells a ZMTP peer from anything else, and the
/// signature and major version (11 bytes) refuse an old peer, before the
/// whole greeting ([`GREETING_LEN`] bytes, which such a peer never sends)
/// is waited for.
pub fn parse_greeting(bytes: &[u8]) -> Result<Decoded<Greeting>, FrameError> {
    match bytes.len() {
        0 => Ok(Decoded::Needs(1)),
        1..11 if bytes[0] != 0xff => Err(FrameError::Signature),
        1..11 => Ok(Decoded::Needs(11)),
        11..GREETING_LEN => {
            check_greeting_start(bytes)?;
            Ok(Decoded::Needs(GREETING_LEN))
        }
        _ => Ok(Decoded::Done(check_greeting(&bytes[..GREETING_LEN])?)),
    }
}

/// Checks the signature and major version (the first 11 bytes).
fn check_greeting_start(g: &[u8]) -> Result<(), FrameError> {
    if g.len() < 11 || g[0] != 0xff || g[9] & 0x01 == 0 {
        return Err(FrameError::Signature);
    }
    if g[10] < 3 {
        return Err(FrameError::Version(g[10]));
    }
    Ok(())
}

/// Checks a peer's whole greeting and reads its mechanism.
pub fn check_greeting(g: &[u8]) -> Result<Greeting, FrameError> {
    if g.len() < GREETING_LEN {
        return Err(FrameError::TruncatedGreeting);
    }
    check_greeting_start(g)?;
    let mechanism = &g[12..32];
    let name_end = mechanism
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(mechanism.len());
    let known = match &mechanism[..name_end] {
        b"NULL" => Some(Mechanism::Null),
        b"PLAIN" => Some(Mechanism::Plain),
        b"CURVE" => Some(Mechanism::Curve),
        _ => None,
    };
    match known {
        Some(mechanism) if mechanism_padded(&g[12..32], name_end) => Ok(Greeting {
            mechanism,
            as_server: mechanism != Mechanism::Null && g[32] == 1,
        }),
        _ => Err(FrameError::Mechanism(
            String::from_utf8_lossy(&mechanism[..name_end]).into_owned(),
        )),
    }
}

/// The mechanism field is its name then only zero bytes.
fn mechanism_padded(field: &[u8], name_end: usize) -> bool {
    field[name_end..].iter().all(|&b| b == 0)
}

/// A command's body split into its name and its data.
pub fn split_command(body: &[u8]) -> Result<(&[u8], &[u8]), FrameError> {
    let Some(&n) = body.first() else {
        return Err(FrameError::CommandName);
    };
    let n = n as usize;
    if body.len() < 1 + n {
        return Err(FrameError::CommandName);
    }
    Ok((&body[1..1 + n], &body[1 + n..]))
}

/// Encodes a command frame whose body (name included) is `body`.
pub fn command_with_body(body: &[u8]) -> BytesMut {
    let mut out = BytesMut::with_capacity(body.len() + MAX_HEADER);
    Header::command(body.len() as u64).put(&mut out);
    out.put_slice(body);
    out
}

/// Encodes a command frame.
pub fn command_frame(name: &str, data: &[u8]) -> BytesMut {
    let mut body = BytesMut::with_capacity(1 + name.len() + data.len());
    body.put_u8(name.len() as u8);
    body.put_slice(name.as_bytes());
    body.put_slice(data);
    command_with_body(&body)
}

/// The body of a READY command with `properties`.
pub fn ready(properties: &[(&str, &[u8])]) -> BytesMut {
    properties_body("READY", properties)
}

/// The body of a command `name` whose data is `properties` (READY, and
/// PLAIN's INITIATE).
fn properties_body(name: &str, properties: &[(&str, &[u8])]) -> BytesMut {
    let mut body = BytesMut::new();
    body.put_u8(name.len() as u8);
    body.put_slice(name.as_bytes());
    put_properties(&mut body, properties);
    body
}

/// `properties` encoded as READY carries them (CURVE's metadata, which
/// INITIATE's and READY's boxes hold).
pub fn properties(properties: &[(&str, &[u8])]) -> BytesMut {
    let mut out = BytesMut::new();
    put_properties(&mut out, properties);
    out
}

fn put_properties(out: &mut BytesMut, properties: &[(&str, &[u8])]) {
    for (name, value) in properties {
        out.put_u8(name.len() as u8);
        out.put_slice(name.as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value);
    }
}

/// A whole READY command frame with `properties`.
pub fn ready_command(properties: &[(&str, &[u8])]) -> BytesMut {
    command_with_body(&ready(properties))
}

/// A whole INITIATE command frame (PLAIN's client, after WELCOME) with
/// `properties`.
pub fn initiate_command(properties: &[(&str, &[u8])]) -> BytesMut {
    command_with_body(&properties_body("INITIATE", properties))
}

/// A whole HELLO command frame (PLAIN's client): `username` and
/// `password`, each cut to 255 bytes (a length byte each).
pub fn hello_command(username: &[u8], password: &[u8]) -> BytesMut {
    let (u, p) = (
        &username[..username.len().min(255)],
        &password[..password.len().min(255)],
    );
    let mut data = Vec::with_capacity(2 + u.len() + p.len());
    data.push(u.len() as u8);
    data.extend_from_slice(u);
    data.push(p.len() as u8);
    data.extend_from_slice(p);
    command_frame("HELLO", &data)
}

/// The username and password of a HELLO command's data (after the name);
/// bytes after the password are refused.
pub fn parse_hello(data: &[u8]) -> Result<(&[u8], &[u8]), FrameError> {
    let field = |at: usize| -> Result<(&[u8], usize), FrameError> {
        let n = *data.get(at).ok_or(FrameError::Hello)? as usize;
        let bytes = data.get(at + 1..at + 1 + n).ok_or(FrameError::Hello)?;
        Ok((bytes, at + 1 + n))
    };
    let (username, at) = field(0)?;
    let (password, end) = field(at)?;
    if end != data.len() {
        return Err(FrameError::Hello);
    }
    Ok((username, password))
}

/// A whole WELCOME command frame (PLAIN's server: the credentials are
/// taken).
pub fn welcome_command() -> BytesMut {
    command_frame("WELCOME", &[])
}

/// A whole ERROR command frame: `reason`, cut to 255 bytes at a character
/// boundary.
pub fn error_command(reason: &str) -> BytesMut {
    let mut end = reason.len().min(255);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut data = Vec::with_capacity(1 + end);
    data.push(end as u8);
    data.extend_from_slice(&reason.as_bytes()[..end]);
    command_frame("ERROR", &data)
}

/// The reason of an ERROR command's data (after the name), as text.
pub fn error_reason(data: &[u8]) -> String {
    let n = data.first().map_or(0, |&n| n as usize);
    let reason = data.get(1..1 + n).or(data.get(1..)).unwrap_or_default();
    String::from_utf8_lossy(reason).into_owned()
}

/// Parses READY properties from a command's data (after the name).
pub fn ready_properties(mut body: &[u8]) -> Result<Vec<(String, Bytes)>, FrameError> {
    let mut out = Vec::new();
    while !body.is_empty() {
        let n = body[0] as usize;
        if body.len() < 1 + n + 4 {
            return Err(FrameError::ReadyProperty);
        }
        let name = String::from_utf8_lossy(&body[1..1 + n]).into_owned();
        body = &body[1 + n..];
        let len = u32::from_be_bytes(body[..4].try_into().expect("4 bytes")) as usize;
        body = &body[4..];
        if body.len() < len {
            return Err(FrameError::ReadyValue(name));
        }
        out.push((name, Bytes::copy_from_slice(&body[..len])));
        body = &body[len..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
