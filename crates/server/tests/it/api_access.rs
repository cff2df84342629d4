#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Who can reach the control API, tried as another local user would: the
//! default listener is a unix socket only the daemon's user can open, and a
//! TCP listener (loopback included) answers nothing without the token.
//!
//! The API runs jobs as the agents' user: whoever reaches it runs code on
//! the machine. Before these defaults a token-less loopback port let any
//! local user run a job as root.

use crate::common::daemon::{Daemon, Dir, BIN};
use crate::common::users::LocalUser;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

const SYSTEM_SOCKET: &str = "/run/kici-scaler/api.sock";

/// A job an attacker would submit: who am I, and root's secrets.
const ATTACK: &[&str] = &["sh", "-c", "id; head -c 40 /etc/shadow"];

/// `serve` with no `--listen` serves on `/run/kici-scaler/api.sock`, mode
/// 0600 and owned by the daemon's user; no TCP port is opened. The client
/// commands find it without `--server`; another local user can neither
/// read the status nor submit a job through it.
#[test]
fn serial_the_default_api_is_a_unix_socket_only_its_owner_can_use() {
    let dir = Dir::bare_metal(2);
    // Serve as the packaged unit does: no --listen, and no token at all.
    let mut cmd = dir.serve_command(&[]);
    cmd.env_remove("KICI_SCALER_API_TOKEN");
    let d = Daemon::spawn(cmd).unwrap_or_else(|s| panic!("the daemon died at start: {s:?}"));
    assert_eq!(d.addr, format!("unix:{SYSTEM_SOCKET}"));
    let meta = std::fs::metadata(SYSTEM_SOCKET).unwrap();
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "the socket's mode"
    );
    assert_eq!(meta.uid(), rustix::process::geteuid().as_raw(), "its owner");
    let listening = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let port_7878 = format!(":{:04X} ", 7878);
    assert!(
        !listening.lines().any(|l| l
            .split_whitespace()
            .nth(1)
            .is_some_and(|a| a.ends_with(&port_7878[..5]))
            && l.split_whitespace().nth(3) == Some("0A")),
        "nothing listens on TCP 7878"
    );

    // The owner's client finds the socket by default.
    let status = dir
        .command(&["status", "--json"])
        .env_remove("KICI_SCALER_API_TOKEN")
        .output()
        .unwrap();
    assert_eq!(
        status.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );

    // Another local user gets nowhere: not the status, not a job.
    let user = LocalUser::create("kici-atk-");
    let denied = user.run(BIN, &["status"]);
    assert_ne!(denied.status.code(), Some(0));
    let err = String::from_utf8_lossy(&denied.stderr);
    assert!(err.contains("ermission denied"), "{err}");
    let mut run = vec![
        "run",
        "--server",
        "unix:/run/kici-scaler/api.sock",
        "--labels",
        "local",
        "--",
    ];
    run.extend_from_slice(ATTACK);
    let attack = user.run(BIN, &run);
    assert_eq!(attack.status.code(), Some(125), "{attack:?}");
    assert!(!String::from_utf8_lossy(&attack.stdout).contains("uid=0"));
    assert_eq!(agents_ever_via_default_socket(&dir), 0, "no job ran");
    d.terminate();
    assert!(
        !Path::new(SYSTEM_SOCKET).exists(),
        "the socket is removed at exit"
    );
}

/// Through a TCP listener (loopback) another local user without the token
/// is refused 401 and nothing runs; the owner with it is served.
#[test]
fn another_user_without_the_token_cannot_use_a_loopback_listener() {
    let dir = Dir::bare_metal(2);
    let d = Daemon::start(&dir, &["--listen", "127.0.0.1:0"], &[]);
    let server = format!("http://{}", d.addr);
    let user = LocalUser::create("kici-atk-");
    let mut run = vec!["run", "--server", &server, "--labels", "local", "--"];
    run.extend_from_slice(ATTACK);
    let attack = user.run(BIN, &run);
    assert_eq!(attack.status.code(), Some(125), "{attack:?}");
    let err = String::from_utf8_lossy(&attack.stderr);
    assert!(err.contains("unauthorized"), "{err}");
    let (status, body) = d.http("GET", "/v1/agents?all=true", None);
    assert_eq!(status, 200, "the owner, with the token, is served: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["agents"].as_array().unwrap().len(),
        0,
        "nothing ran: {body}"
    );
    // The same request without the token is refused too.
    let (status, _) =
        crate::common::daemon::http(&d.addr, "GET", "/v1/agents", &[("Authorization", "")], None);
    assert_eq!(status, 401);
}

/// Every agent the daemon ever made (gone ones too), read through the
/// owner's client on the default socket: a job would have made one.
fn agents_ever_via_default_socket(dir: &Dir) -> usize {
    let out = dir
        .command(&["agents", "--all", "--json"])
        .env_remove("KICI_SCALER_API_TOKEN")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["agents"].as_array().unwrap().len()
}
