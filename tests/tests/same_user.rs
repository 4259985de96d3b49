//! Another process of `stowd`'s own user, on the real binary: it cannot
//! open `stowd`'s memory (`/proc/<pid>/mem`) or descriptors
//! (`/proc/<pid>/fd`), because `stowd serve` makes itself non-dumpable at
//! start; and `stowd` itself still reaches its own `/proc/self/fd` (a
//! channel socket whose path is too long for a socket address is bound
//! through it).
//!
//! CI runs as root, and root may open any process's memory: there `stowd`
//! runs as `nobody` and the intruder is another process of `nobody`.

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

use stowage_host::batch::Field;
use stowage_tests::client::FdChannel;
use stowage_tests::data::{assert_cells, cells, f32_rows, wire_cells};
use stowage_tests::{NativeClient, Stowd, temp_dir};

const NOBODY: u32 = 65534;

/// This process's effective uid.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// The real uid `/proc/<pid>/status` gives.
fn uid_of(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

// The review found a stored row rewritten through `/proc/<stowd pid>/mem`
// by another process of stowd's user, and the next get returned it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_of_stowds_user_cannot_open_its_memory() {
    // Root: stowd and the intruder are nobody. Otherwise both are this user.
    let user = if euid() == 0 { NOBODY } else { euid() };
    // Long enough that the channel socket's path (this, a 52-byte
    // directory and `sock`) does not fit a socket address.
    let shm = temp_dir("same-user").join("a-shm-dir-with-a-name-long-enough-for-proc-self-fd");
    std::fs::create_dir(&shm).unwrap();
    std::os::unix::fs::chown(&shm, Some(user), Some(user)).unwrap();
    let config = format!("[shm]\ndir = \"{}\"\n", shm.display());
    let stowd = if user == euid() {
        Stowd::start(&config)
    } else {
        Stowd::start_as(user, &config)
    };
    let pid = stowd.pid();
    assert_eq!(uid_of(pid), user);
    // Its token, from its endpoints file (that user's own token file).
    let token = stowd
        .endpoints
        .token
        .clone()
        .expect("stowd asks for a token");
    let c = NativeClient::with_token(stowd.native(), &token);
    let field = Field::Regular(f32_rows(4, 256, 7));
    c.put_ok(&[0, 1, 2, 3], &[("x".into(), field.clone())])
        .await;

    // Non-dumpable: the kernel gives its /proc files to root.
    for file in ["mem", "fd", "maps", "environ"] {
        let owner = std::fs::symlink_metadata(format!("/proc/{pid}/{file}"))
            .unwrap()
            .uid();
        assert_eq!(
            owner, 0,
            "/proc/{pid}/{file} belongs to uid {owner}, not root"
        );
    }
    // A process of stowd's user cannot open its memory or its descriptors.
    let intruder = |what: &str| {
        let mut command = Command::new("sh");
        command.arg("-c").arg(what);
        if user != euid() {
            command.uid(user).gid(user);
        }
        command.output().unwrap()
    };
    for attempt in [
        format!("exec 3<>/proc/{pid}/mem"),
        format!("exec 3</proc/{pid}/mem"),
        format!("ls /proc/{pid}/fd/"),
    ] {
        let out = intruder(&attempt);
        assert!(
            !out.status.success(),
            "{attempt:?} as uid {user} succeeded: stowd's memory is open to its user"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("Permission denied"), "{attempt:?}: {err}");
    }

    // stowd still serves, and reached its own /proc/self/fd to bind the
    // channel socket under the long [shm] dir.
    let channel = FdChannel::open(&c).await;
    assert!(
        channel.path.as_os_str().len() > 107,
        "{}",
        channel.path.display()
    );
    let got = c.get_ok(&[0, 1, 2, 3], &["x"]).await;
    assert_cells(
        "after the attempts",
        &wire_cells(got[0].1.clone()),
        &cells(&field),
    );
    stowd.stop();
}
