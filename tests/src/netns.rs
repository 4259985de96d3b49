//! Network namespaces standing in for other hosts: made with `ip`
//! (iproute2), joined by veth pairs, and removed when their guard drops,
//! panics included. Needs root.
//!
//! The tests of one binary run at once, so a test picks its subnets while
//! it holds [`creating`]: the next one sees its routes and takes others.

use std::process::Command;
use std::sync::{Mutex, MutexGuard};

/// `ip args...`; Err with its stderr.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Whether namespaces can be made here: root, and `ip` installed.
pub fn available() -> Result<(), String> {
    if Command::new("ip").arg("-V").output().is_err() {
        return Err("`ip` (iproute2) is not installed".into());
    }
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Err(format!("not root (effective uid {euid})"));
    }
    Ok(())
}

/// Held while a test picks its subnets and makes its links (see the
/// module docs); also numbers the picks, for unique names.
pub fn creating() -> MutexGuard<'static, u32> {
    static CREATING: Mutex<u32> = Mutex::new(0);
    let mut n = CREATING.lock().unwrap_or_else(|p| p.into_inner());
    *n += 1;
    n
}

/// A third octet `b` such that none of `prefix.b.` to `prefix.(b + count
/// - 1).` is routed here yet: `count` free /24 subnets under `prefix`
/// (`"10.77"`), tried from one derived from the pid.
pub fn free_subnets(prefix: &str, count: u8) -> Result<u8, String> {
    let routes = Command::new("ip")
        .args(["-4", "route", "show"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    let slots = 250 / u32::from(count.max(1));
    let pid = std::process::id();
    (0..slots)
        .map(|k| (((pid + k) % slots) * u32::from(count)) as u8)
        .find(|b| (0..count).all(|i| !routes.contains(&format!("{prefix}.{}.", b + i))))
        .ok_or_else(|| format!("no {count} free {prefix}.x.0/24 subnets"))
}

/// A network namespace with its loopback up; deleted on drop (with the
/// veth ends in it, and so their peers).
#[derive(Debug)]
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn add(name: &str) -> Result<Netns, String> {
        ip(&["netns", "add", name])?;
        let ns = Netns { name: name.into() };
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("cleanup: {e}");
        }
    }
}

/// One end of a veth pair: its namespace (`None`: the test's own), its
/// name, and its address with prefix length (`10.77.3.1/24`).
pub struct End<'a> {
    pub ns: Option<&'a str>,
    pub name: &'a str,
    pub addr: &'a str,
}

/// A veth pair between `a` and `b`, both addressed and up.
pub fn veth(a: &End<'_>, b: &End<'_>) -> Result<(), String> {
    let mut add = vec![];
    if let Some(ns) = a.ns {
        add.extend(["-n", ns]);
    }
    add.extend([
        "link", "add", a.name, "type", "veth", "peer", "name", b.name,
    ]);
    if let Some(ns) = b.ns {
        add.extend(["netns", ns]);
    }
    ip(&add)?;
    for end in [a, b] {
        let n: Vec<&str> = end.ns.map(|ns| vec!["-n", ns]).unwrap_or_default();
        ip(&[&n[..], &["addr", "add", end.addr, "dev", end.name]].concat())?;
        ip(&[&n[..], &["link", "set", end.name, "up"]].concat())?;
    }
    Ok(())
}

/// Deletes a link of the test's own namespace if it is still there (a
/// veth whose peer never moved into a namespace).
pub fn del_link(name: &str) {
    if std::path::Path::new(&format!("/sys/class/net/{name}")).exists()
        && let Err(e) = ip(&["link", "del", name])
    {
        eprintln!("cleanup: {e}");
    }
}
