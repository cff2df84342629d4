//! A fleet at the size a stock PostgreSQL must carry: fifty hosts on
//! loopback against a private server started with `max_connections = 100`
//! (the stock default), each host holding at most `--database-connections
//! 2` (its session and one for queries). Every host starts, joins and
//! serves a request; the server never counts more of the fleet's
//! connections than the hosts' budgets add up to; after shutdown none is
//! left.
//!
//! Connections are counted from the server's backend processes (their
//! titles name the database), not with a query: with every slot taken by
//! the fleet there is no slot for a counting session, and there must not
//! need to be.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use common::firecracker::free_port;

use common::daemon::{http, pg, pg_with, Daemon, Dir, PATIENCE};
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};

/// A private server: its max_connections is the stock one, unlike the
/// shared test server's.
const PG_PORT: u16 = 54341;
const HOSTS: usize = 50;
const CONNECTIONS_PER_HOST: usize = 2;
const STOCK_MAX_CONNECTIONS: &str = "100";
const TOKEN: &str = "fleet-scale-operator-token-0123456789";
const KEY: &str = "fleet-scale-test-key-0123456789abcdef01";

/// Stops the private server however the test ends.
struct PrivateServer;

impl Drop for PrivateServer {
    fn drop(&mut self) {
        pg("stop", PG_PORT);
    }
}

/// The server's backend processes connected to `database` (their process
/// titles read `postgres: USER DATABASE ADDR STATE`).
fn backends_of(database: &str) -> usize {
    let mut n = 0;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let title = String::from_utf8_lossy(&cmdline);
        if title.starts_with("postgres: ") && title.split_whitespace().nth(2) == Some(database) {
            n += 1;
        }
    }
    n
}

fn call(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let auth = format!("Bearer {TOKEN}");
    let (status, text) = http(addr, method, path, &[("Authorization", &auth)], body);
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[test]
fn serial_fleet_fifty_hosts_start_and_serve_on_a_stock_postgres() {
    // A server left running by an earlier run may have other settings.
    pg("stop", PG_PORT);
    pg_with(
        "start",
        PG_PORT,
        &[("KICI_PG_MAX_CONNECTIONS", STOCK_MAX_CONNECTIONS)],
    );
    let _server = PrivateServer;
    let admin = pg("url", PG_PORT);
    let database = format!("kici_scale_{:08x}", rand::random::<u32>());
    let out = Command::new("psql")
        .args([&admin, "-v", "ON_ERROR_STOP=1", "-At", "-c"])
        .arg(format!("CREATE DATABASE {database}"))
        .args(["-c", "SHOW max_connections"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .ends_with(STOCK_MAX_CONNECTIONS),
        "the private server runs with the stock max_connections"
    );
    let url = format!("{}/{database}", admin.rsplit_once('/').unwrap().0);
    let limit = CONNECTIONS_PER_HOST.to_string();

    let sampler_stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let stop = sampler_stop.clone();
        let database = database.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                peak = peak.max(backends_of(&database));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        })
    };

    let started = Instant::now();
    let mut hosts: Vec<Daemon> = Vec::new();
    let mut dirs: Vec<Dir> = Vec::new();
    for _ in 0..HOSTS {
        let host_dir = Dir::bare_metal(1);
        let listen = format!("127.0.0.1:{}", free_port());
        let mut cmd = host_dir.serve_command(&[
            "--memory-backends",
            "--listen",
            &listen,
            "--state",
            &url,
            "--fleet",
            "scale",
            "--database-connections",
            &limit,
        ]);
        cmd.envs([
            ("KICI_SCALER_API_TOKEN", TOKEN),
            ("KICI_SCALER_FLEET_KEY", KEY),
        ]);
        let daemon = Daemon::spawn(cmd)
            .unwrap_or_else(|status| panic!("host {} died at start: {status:?}", hosts.len()));
        hosts.push(daemon);
        dirs.push(host_dir);
    }
    let start_up = started.elapsed();

    // Every host is a live member (as any host sees the fleet).
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (status, fleet) = call(&hosts[0].addr, "GET", "/v1/fleet", None);
        let up = fleet["hosts"]
            .as_array()
            .map(|hs| hs.iter().filter(|h| h["state"] == "up").count())
            .unwrap_or(0);
        if status == 200 && up == HOSTS {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{up} of {HOSTS} hosts up after {PATIENCE:?}: {status} {fleet}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // Each host serves a request.
    for (i, h) in hosts.iter().enumerate() {
        let body = format!(r#"{{"jobId": "job-{i:02}", "labels": ["local"]}}"#);
        let (status, v) = call(&h.addr, "POST", "/v1/scale", Some(&body));
        assert!(status == 200 || status == 202, "host {i}: {status} {v}");
    }
    let deadline = Instant::now() + PATIENCE;
    let mut served = 0;
    while served < HOSTS {
        served = hosts
            .iter()
            .map(|h| {
                let (_, v) = call(&h.addr, "GET", "/v1/agents?local=true", None);
                v["agents"]
                    .as_array()
                    .map(|a| a.iter().filter(|a| a["jobId"].is_string()).count())
                    .unwrap_or(0)
            })
            .sum();
        assert!(
            Instant::now() < deadline,
            "{served} of {HOSTS} requests served after {PATIENCE:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(served, HOSTS, "one agent per request, no more");
    // Nobody was refused a connection on the way.
    for (i, h) in hosts.iter_mut().enumerate() {
        for line in h.lines_so_far() {
            assert!(
                !line.contains("too many clients") && !line.contains("remaining connection slots"),
                "host {i} was refused a connection: {line}"
            );
        }
    }

    for h in hosts.iter() {
        h.signal(rustix::process::Signal::TERM);
    }
    for h in hosts.iter_mut() {
        let status = h.wait_exit();
        assert!(
            status.success(),
            "a host did not shut down cleanly: {status:?}"
        );
    }
    sampler_stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let peak = sampler.join().unwrap();
    eprintln!("fifty hosts: start-up {start_up:?}, peak connections {peak}");
    assert!(
        peak > HOSTS,
        "the sampler saw the fleet's connections ({peak})"
    );
    assert!(
        peak <= HOSTS * CONNECTIONS_PER_HOST,
        "{peak} connections for {HOSTS} hosts of {CONNECTIONS_PER_HOST}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while backends_of(&database) > 0 {
        assert!(Instant::now() < deadline, "connections left after shutdown");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(dirs);
}
