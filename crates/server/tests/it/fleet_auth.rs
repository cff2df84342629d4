//! How fleet hosts trust each other, with real daemons on loopback sharing
//! one PostgreSQL database (`scripts/postgres.sh`): a fleet host needs a
//! fleet key to start; peer calls are signed with it and refused without
//! it; a host URL rewritten in the database never receives the operator's
//! API token; hosts advertised as `https` are called over TLS verified
//! against the fleet's CA.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::daemon::{fresh_database, http, psql, wait_until, Daemon, Dir, BIN, PATIENCE};
use kici_scaler::fleet::auth::{unix_now, Call, FleetKeys, HEADER};
use serde_json::Value;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The shared test server (other PostgreSQL tests use it too, each with a
/// database of its own).
const PG_PORT: u16 = 54329;
const TOKEN: &str = "fleet-auth-operator-token-0123456789";
const KEY: &str = "fleet-auth-test-key-0123456789abcdef0123";
const WRONG_KEY: &str = "fleet-auth-WRONG-key-0123456789abcdef012";

/// A free loopback port (the daemon advertises its --listen address, so
/// it must be known before it starts).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One fleet host on `port` of the database at `url`, with `extra` args.
fn host(dir: &Dir, url: &str, port: u16, extra: &[&str]) -> Daemon {
    let listen = format!("127.0.0.1:{port}");
    let mut args = vec![
        "--memory-backends",
        "--listen",
        &listen,
        "--state",
        url,
        "--fleet",
        "auth",
    ];
    args.extend_from_slice(extra);
    Daemon::start(
        dir,
        &args,
        &[
            ("KICI_SCALER_API_TOKEN", TOKEN),
            ("KICI_SCALER_FLEET_KEY", KEY),
        ],
    )
}

fn bearer() -> String {
    format!("Bearer {TOKEN}")
}

/// `GET /v1/status` of the host at `addr` (with the API token).
fn status(addr: &str) -> Value {
    let auth = bearer();
    let (code, body) = http(addr, "GET", "/v1/status", &[("Authorization", &auth)], None);
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The instance ids of the other hosts whose status a host's carries (an
/// empty list is left out of the answer).
fn peer_ids(status: &Value) -> Vec<String> {
    status["hosts"]
        .as_array()
        .map(|hosts| {
            hosts
                .iter()
                .map(|h| h["instanceId"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_fleet_host_without_a_fleet_key_refuses_to_start_and_says_what_to_set() {
    let dir = Dir::bare_metal(1);
    // Nothing listens on port 1: a daemon that got past its settings would
    // fail on the database instead, with another message.
    let state = "postgres://postgres@127.0.0.1:1/none";
    let run = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec![
            "--memory-backends",
            "--listen",
            "127.0.0.1:0",
            "--state",
            state,
        ];
        args.extend_from_slice(extra);
        let mut cmd = dir.serve_command(&args);
        cmd.envs(env.iter().copied());
        let out = cmd.output().unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let missing = run(&[], &[]);
    assert!(
        missing.contains("KICI_SCALER_FLEET_KEY") && missing.contains("--fleet-key-file"),
        "{missing}"
    );
    let short = run(&[], &[("KICI_SCALER_FLEET_KEY", "too-short")]);
    assert!(short.contains("at least 32"), "{short}");
    // A key file group or others can read is refused by path and mode.
    let file = dir.path("fleet.key");
    std::fs::write(&file, format!("{KEY}\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
    let exposed = run(&["--fleet-key-file", file.to_str().unwrap()], &[]);
    assert!(
        exposed.contains(file.to_str().unwrap()) && exposed.contains("0640"),
        "{exposed}"
    );
    // The key is never printed, even in a refusal about it.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let both = run(
        &["--fleet-key-file", file.to_str().unwrap()],
        &[("KICI_SCALER_FLEET_KEY", KEY)],
    );
    assert!(both.contains("set one") && !both.contains(KEY), "{both}");
    // Serving alone needs no key: it goes on to the database.
    let alone = run(&["--no-fleet"], &[]);
    assert!(!alone.contains("KICI_SCALER_FLEET_KEY"), "{alone}");
}

/// Two hosts of one fleet on loopback, plain HTTP.
struct Pair {
    _dirs: (Dir, Dir),
    a: Daemon,
    _b: Daemon,
    a_id: String,
    b_id: String,
    local_url: String,
}

fn pair() -> Pair {
    let url = fresh_database(PG_PORT);
    let (da, db) = (Dir::bare_metal(1), Dir::bare_metal(1));
    let a = host(&da, &url, free_port(), &[]);
    let b = host(&db, &url, free_port(), &[]);
    let (a_id, b_id) = (da.instance(), db.instance());
    // Peer calls work: A's status carries B's.
    wait_until("A shows B's status", || {
        peer_ids(&status(&a.addr)) == [b_id.clone()]
    });
    Pair {
        _dirs: (da, db),
        a,
        _b: b,
        a_id,
        b_id,
        local_url: url,
    }
}

/// A header signing `method path` from B to A with `key`, now.
fn signed(key: &str, from: &str, to: &str, method: &str, path: &str) -> String {
    let keys = FleetKeys::parse(key, "test").unwrap();
    let nonce = format!("{:032x}", rand::random::<u128>());
    let call = Call {
        from,
        to,
        method,
        path,
        body: b"",
    };
    keys.sign(&call, unix_now(), &nonce)
}

#[test]
fn a_peer_call_without_the_fleet_key_is_refused_401() {
    let p = pair();
    let path = "/v1/status?local=true";
    // Only the headers given: no bearer token (an empty one is left out).
    let get = |extra: &[(&str, &str)]| {
        let mut headers = vec![("Authorization", "")];
        headers.extend_from_slice(extra);
        http(&p.a.addr, "GET", path, &headers, None)
    };
    // No credential at all, and a signature made with another key.
    assert_eq!(get(&[]).0, 401);
    let forged = signed(WRONG_KEY, &p.b_id, &p.a_id, "GET", path);
    let (code, body) = get(&[(HEADER, &forged)]);
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("does not verify"), "{body}");
    // The fleet's key opens the call, once: the same header again is a
    // replay.
    let good = signed(KEY, &p.b_id, &p.a_id, "GET", path);
    let (code, body) = get(&[(HEADER, &good)]);
    assert_eq!(code, 200, "{body}");
    assert_eq!(get(&[(HEADER, &good)]).0, 401);
    // A signature addressed to another host, or for another call.
    let elsewhere = signed(KEY, &p.a_id, &p.b_id, "GET", path);
    assert_eq!(get(&[(HEADER, &elsewhere)]).0, 401);
    let other_path = signed(KEY, &p.b_id, &p.a_id, "GET", "/v1/agents?local=true");
    assert_eq!(get(&[(HEADER, &other_path)]).0, 401);
    // The fleet key opens the calls hosts make on each other only, not
    // the operator's.
    let reload = signed(KEY, &p.b_id, &p.a_id, "POST", "/v1/reload");
    let (code, body) = http(
        &p.a.addr,
        "POST",
        "/v1/reload",
        &[("Authorization", ""), (HEADER, &reload)],
        None,
    );
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("only on the calls hosts make"), "{body}");
    // A stale signature: made 60 s ago.
    let keys = FleetKeys::parse(KEY, "test").unwrap();
    let call = Call {
        from: &p.b_id,
        to: &p.a_id,
        method: "GET",
        path,
        body: b"",
    };
    let stale = keys.sign(&call, unix_now() - 60, "0123456789abcdef");
    let (code, body) = get(&[(HEADER, &stale)]);
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("clock"), "{body}");
}

/// Every request a loopback listener the test owns receives within
/// `within`, head and body as text.
fn capture(within: Duration) -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    std::thread::spawn(move || {
        let end = Instant::now() + within;
        while Instant::now() < end {
            let Ok((mut s, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            s.set_nonblocking(false).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            record
                .lock()
                .unwrap()
                .push(String::from_utf8_lossy(&request).into_owned());
            let _ = s.write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        }
    });
    (port, seen)
}

#[test]
fn a_host_url_rewritten_in_the_database_never_receives_the_api_token() {
    let p = pair();
    // A database writer points B's row at a listener of theirs.
    let (port, seen) = capture(Duration::from_secs(20));
    psql(
        &p.local_url,
        &format!(
            "UPDATE fleet_hosts SET url = 'http://127.0.0.1:{port}' WHERE instance_id = '{}'",
            p.b_id
        ),
    );
    // Fleet-wide reads ask "B" there, each a peer call.
    let s = status(&p.a.addr);
    assert_eq!(
        s["unreachableHosts"][0]["instanceId"],
        p.b_id.as_str(),
        "{s}"
    );
    let auth = bearer();
    let (code, _) = http(
        &p.a.addr,
        "GET",
        "/v1/agents",
        &[("Authorization", &auth)],
        None,
    );
    assert_eq!(code, 200);
    wait_until("the listener saw both calls", || {
        seen.lock().unwrap().len() >= 2
    });
    for request in seen.lock().unwrap().iter() {
        let lower = request.to_ascii_lowercase();
        assert!(
            !request.contains(TOKEN) && !lower.contains("\nauthorization:"),
            "a peer call carried the API token: {request}"
        );
        assert!(lower.contains(&format!("\n{HEADER}: v1 ")), "{request}");
        assert!(!request.contains(KEY), "{request}");
    }
}

/// A CA, and a certificate it signed for 127.0.0.1 and localhost, as PEM
/// files in `dir`: (ca, cert, key).
fn tls_files(dir: &Dir) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    let paths = (
        dir.path("ca.pem"),
        dir.path("cert.pem"),
        dir.path("key.pem"),
    );
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

/// `kici-scaler status --json` against `server`, trusting `ca`.
fn cli_status(server: &str, ca: &Path) -> Value {
    let out = Command::new(BIN)
        .args(["status", "--json", "--server", server, "--ca-cert"])
        .arg(ca)
        .env("KICI_SCALER_API_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn hosts_advertised_as_https_are_called_over_tls_verified_against_the_fleet_ca() {
    let url = fresh_database(PG_PORT);
    let certs = Dir::bare_metal(1);
    let (ca, cert, key) = tls_files(&certs);
    let (ca, cert, key) = (
        ca.to_str().unwrap().to_owned(),
        cert.to_str().unwrap().to_owned(),
        key.to_str().unwrap().to_owned(),
    );
    let tls_host = |dir: &Dir, port: u16| {
        let advertise = format!("https://127.0.0.1:{port}");
        host(
            dir,
            &url,
            port,
            &[
                "--tls-cert",
                &cert,
                "--tls-key",
                &key,
                "--advertise-url",
                &advertise,
                "--fleet-ca-cert",
                &ca,
            ],
        )
    };
    let (da, db) = (Dir::bare_metal(1), Dir::bare_metal(1));
    let (pa, pb) = (free_port(), free_port());
    let _a = tls_host(&da, pa);
    let _b = tls_host(&db, pb);
    let server = format!("https://127.0.0.1:{pa}");
    let deadline = Instant::now() + PATIENCE;
    let s = loop {
        let s = cli_status(&server, Path::new(&ca));
        if peer_ids(&s) == [db.instance()] || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(peer_ids(&s), [db.instance()], "{s}");
    // (An empty list is left out of the answer.)
    assert_eq!(s.get("unreachableHosts"), None, "{s}");

    // A host that does not trust the fleet's CA (the platform's roots only)
    // cannot call them: its peers' certificates are verified.
    let dc = Dir::bare_metal(1);
    let pc = free_port();
    let advertise = format!("https://127.0.0.1:{pc}");
    let _c = host(
        &dc,
        &url,
        pc,
        &[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--advertise-url",
            &advertise,
        ],
    );
    let s = cli_status(&format!("https://127.0.0.1:{pc}"), Path::new(&ca));
    assert!(peer_ids(&s).is_empty(), "{s}");
    let reasons = s["unreachableHosts"].to_string();
    assert!(
        reasons.contains("certificate") || reasons.contains("issuer"),
        "{s}"
    );
}
