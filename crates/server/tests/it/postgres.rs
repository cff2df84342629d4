//! The real daemon on PostgreSQL: two daemons sharing one database never
//! touch each other's agents, and a store outage answers 503 quickly,
//! loses nothing and heals without a restart. PostgreSQL comes from
//! `scripts/postgres.sh` (never skipped: the script starts it if needed).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::daemon::{fresh_database, pg, wait_until, Daemon, Dir, BIN, FAST_RECONCILE};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// The daemon on the store at `state` (reconcile every second), serving
/// alone (`--no-fleet`): these tests are about hosts that share a database
/// and nothing else.
fn start(dir: &Dir, state: &str) -> Daemon {
    let mut args = FAST_RECONCILE.to_vec();
    args.extend(["--state", state, "--no-fleet"]);
    Daemon::start(dir, &args, &[])
}

/// `POST /v1/scale` that must spawn; the agent.
fn spawn(d: &Daemon, job: &str) -> String {
    let (status, body) = d.scale(job, &["local"]);
    assert_eq!(status, 202, "{body}");
    body["agentId"].as_str().unwrap().to_owned()
}

/// Processes in the agent's tracking cgroup of `instance`.
fn agent_pids(dir: &Dir, agent: &str) -> usize {
    let instance = std::fs::read_to_string(dir.path("state/instance-id")).unwrap();
    let leaf = Path::new("/sys/fs/cgroup/unified/kici-scaler")
        .join(instance.trim())
        .join("local")
        .join(agent)
        .join("cgroup.procs");
    std::fs::read_to_string(leaf)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[test]
fn serial_two_daemons_on_one_postgres_never_touch_each_others_agents() {
    let url = fresh_database(54329);
    let (da, db) = (Dir::bare_metal(4), Dir::bare_metal(4));
    let mut a = start(&da, &url);
    let b = start(&db, &url);
    let a1 = spawn(&a, "a1");
    let a2 = spawn(&a, "a2");
    let b1 = spawn(&b, "b1");
    // Booted: the spawn finished (a spawn cut short by the crash would be
    // a failed spawn, destroyed on recovery — another test's subject).
    wait_until("every agent is up", || {
        a.state_of(&a1) == "booted" && a.state_of(&a2) == "booted" && b.state_of(&b1) == "booted"
    });
    assert!(agent_pids(&da, &a1) == 1 && agent_pids(&da, &a2) == 1 && agent_pids(&db, &b1) == 1);
    // A crashes and comes back: it takes back its own two, and B's agent
    // and B's view are untouched through A's recovery and reconcile passes.
    let _ = a.child.kill();
    let _ = a.child.wait();
    let mut a = start(&da, &url);
    assert_eq!(a.recovery["adopted"], 2, "{}", a.recovery);
    a.expect_log("reconcile pass");
    a.expect_log("reconcile pass");
    a.expect_log("reconcile pass");
    assert_eq!(a.agents(), BTreeSet::from([a1.clone(), a2.clone()]));
    assert_eq!(b.agents(), BTreeSet::from([b1.clone()]));
    assert_eq!(agent_pids(&db, &b1), 1, "B's agent still runs");
    assert_eq!(agent_pids(&da, &a1), 1);
    // One identity, one daemon: a clone of A's state dir is refused by the
    // advisory lock even though the state-dir lock is another file.
    let clone = Dir::bare_metal(4);
    std::fs::create_dir_all(clone.path("state")).unwrap();
    for f in ["instance-id", "machine-id"] {
        std::fs::copy(
            da.path(&format!("state/{f}")),
            clone.path(&format!("state/{f}")),
        )
        .unwrap();
    }
    let out = Command::new(BIN)
        .env(
            "KICI_SCALER_API_TOKEN",
            crate::common::daemon::TEST_API_TOKEN,
        )
        // Joins a fleet (no --no-fleet), which needs a fleet key to start.
        .env(
            "KICI_SCALER_FLEET_KEY",
            "postgres-test-fleet-key-0123456789abcdef",
        )
        .arg("serve")
        .arg("--config")
        .arg(clone.path("scalers.yaml"))
        .arg("--state-dir")
        .arg(clone.path("state"))
        .args([
            "--state",
            &url,
            "--listen",
            "127.0.0.1:0",
            "--gateway-listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already in use"), "{err}");
    a.terminate();
    b.terminate();
    assert_eq!(
        agent_pids(&da, &a1) + agent_pids(&da, &a2) + agent_pids(&db, &b1),
        0
    );
}

#[test]
fn serial_a_store_outage_answers_503_loses_nothing_and_heals_without_restart() {
    // A private server, so stopping it disturbs no other test.
    let port = 54339;
    let url = fresh_database(port);
    let dir = Dir::bare_metal(4);
    let d = start(&dir, &url);
    let before = spawn(&d, "before");
    wait_until("the agent runs", || agent_pids(&dir, &before) == 1);

    pg("stop", port);
    let asked = Instant::now();
    let (status, body) = d.scale("during", &["local"]);
    let body = body.to_string();
    let took = asked.elapsed();
    pg("start", port);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("store-unavailable"), "{body}");
    // The pool's acquire bound (1 s) is what answers; generous slack for a
    // loaded machine, but far below a hung request.
    assert!(took < Duration::from_secs(5), "503 took {took:?}");
    assert_eq!(
        d.agents(),
        BTreeSet::from([before.clone()]),
        "nothing started"
    );

    // Back without a restart: new requests spawn, the old agent is intact.
    wait_until("the store answers again", || {
        d.scale("after", &["local"]).0 == 202
    });
    let after = d.agents();
    assert!(after.contains(&before) && after.len() == 2, "{after:?}");
    d.terminate();
    assert_eq!(agent_pids(&dir, &before), 0);
}
