//! Crash recovery of the real daemon with real bare-metal agents: kill -9
//! at every named failpoint and at random moments, restart, reconcile, and
//! check the real world — `/proc`, cgroupfs, the agent directories and the
//! store's rows — for leaks and for agents tracked other than exactly once.
//!
//! The binary is the test build (`failpoints` feature): the daemon kills
//! itself with SIGKILL when it reaches the failpoint named in
//! `KICI_SCALER_CRASH_AT`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::daemon::{http, rows, Daemon, Dir, CGROUP_V2, FAST_RECONCILE, PATIENCE};
use serde_json::Value;
use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Starts the daemon as the recovery tests run it (reconcile every second,
/// no age threshold), crashing at `crash_at` if given; `Err` if it died
/// before the API listened.
fn start(dir: &Dir, crash_at: Option<&str>) -> Result<Daemon, std::process::ExitStatus> {
    let mut args = FAST_RECONCILE.to_vec();
    args.extend(["--shutdown-grace-seconds", "20"]);
    let env: Vec<(&str, &str)> = crash_at
        .map(|fp| ("KICI_SCALER_CRASH_AT", fp))
        .into_iter()
        .collect();
    Daemon::try_start(dir, &args, &env)
}

/// What the host holds for this instance: agent cgroups with their pids,
/// and agent directories.
#[derive(Debug, Default)]
struct Reality {
    cgroups: BTreeSet<String>,
    pids: BTreeSet<(String, i32)>,
    agent_dirs: BTreeSet<String>,
}

fn reality(dir: &Dir) -> Reality {
    let mut r = Reality::default();
    let root = Path::new(CGROUP_V2)
        .join("kici-scaler")
        .join(dir.instance());
    if let Ok(scalers) = std::fs::read_dir(&root) {
        for scaler in scalers.flatten() {
            let Ok(leaves) = std::fs::read_dir(scaler.path()) else {
                continue;
            };
            for leaf in leaves.flatten() {
                if !leaf.path().is_dir() {
                    continue;
                }
                let agent = leaf.file_name().to_string_lossy().into_owned();
                let procs =
                    std::fs::read_to_string(leaf.path().join("cgroup.procs")).unwrap_or_default();
                for pid in procs.lines().filter_map(|l| l.trim().parse().ok()) {
                    r.pids.insert((agent.clone(), pid));
                }
                r.cgroups.insert(agent);
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(dir.path("state/agents")) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() && name != "retired" {
                r.agent_dirs.insert(name);
            }
        }
    }
    r
}

/// The agents recorded in the store (SQLite allows a reader beside the
/// daemon).
fn recorded(dir: &Dir) -> BTreeSet<String> {
    rows(&dir.sqlite_url(), &dir.instance())
        .agents
        .into_iter()
        .map(|r| r.agent_id.to_string())
        .collect()
}

/// After recovery and two reconcile passes (mark, then reap): every live
/// agent is tracked exactly once — one cgroup, one directory, one row,
/// processes only in tracked cgroups — and nothing else remains.
fn assert_consistent(d: &mut Daemon, dir: &Dir, context: &str) {
    d.wait_for_log("reconcile pass").unwrap();
    d.wait_for_log("reconcile pass").unwrap();
    d.wait_for_log("reconcile pass").unwrap();
    wait_settled(d, context);
    let live = d.agents();
    let r = reality(dir);
    assert_eq!(r.cgroups, live, "{context}: cgroups vs live agents");
    assert_eq!(r.agent_dirs, live, "{context}: agent dirs vs live agents");
    assert_eq!(recorded(dir), live, "{context}: store rows vs live agents");
    for (agent, pid) in &r.pids {
        assert!(
            live.contains(agent),
            "{context}: pid {pid} in untracked cgroup {agent}"
        );
    }
}

/// Waits until no agent is between states (a destroy half done would make
/// the comparison racy).
fn wait_settled(d: &Daemon, context: &str) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (_, body) = d.http("GET", "/v1/agents", None);
        let v: Value = serde_json::from_str(&body).unwrap_or_default();
        let moving = v["agents"].as_array().is_none_or(|a| {
            a.iter().any(|a| {
                matches!(
                    a["state"].as_str(),
                    Some("requested" | "provisioning" | "destroying")
                )
            })
        });
        if !moving {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{context}: agents never settled: {body}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM: every agent destroyed, exit 0, nothing left anywhere.
fn assert_clean_shutdown(mut d: Daemon, dir: &Dir, context: &str) {
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&d.child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    assert_eq!(d.wait_exit().code(), Some(0), "{context}: shutdown exit");
    let r = reality(dir);
    assert!(
        r.cgroups.is_empty(),
        "{context}: cgroups left {:?}",
        r.cgroups
    );
    assert!(r.pids.is_empty(), "{context}: processes left {:?}", r.pids);
    assert!(
        r.agent_dirs.is_empty(),
        "{context}: dirs left {:?}",
        r.agent_dirs
    );
    assert!(recorded(dir).is_empty(), "{context}: rows left");
}

fn scale(d: &Daemon, job: &str) -> Option<String> {
    let (status, body) = d.http(
        "POST",
        "/v1/scale",
        Some(&format!(r#"{{"jobId":"{job}","labels":["local"]}}"#)),
    );
    if status != 202 {
        return None;
    }
    serde_json::from_str::<Value>(&body).ok()?["agentId"]
        .as_str()
        .map(str::to_owned)
}

/// Every failpoint the binary has; each provisioning, release and
/// reconcile step of every backend must have one (the list below is kept by
/// hand, so a step whose failpoint disappears fails here). The crash tests
/// below cover the bare-metal backend's and the runtime's; `reconcile.rs`
/// the reconciler's.
fn failpoints() -> Vec<String> {
    let out = Command::new(common::daemon::BIN)
        .arg("failpoints")
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_step_of_every_backend_has_a_failpoint() {
    let fps = failpoints();
    for step in [
        "kici_engine::spawn::recorded",
        "kici_engine::spawn::backend_done",
        "kici_engine::destroy::backend_done",
        "kici_bare_metal::spawn::dir",
        "kici_bare_metal::spawn::cgroup",
        "kici_bare_metal::spawn::limits",
        "kici_bare_metal::spawn::process",
        "kici_bare_metal::spawn::marker",
        "kici_bare_metal::spawn::watch",
        "kici_bare_metal::destroy::signal",
        "kici_bare_metal::destroy::kill",
        "kici_bare_metal::destroy::cgroup",
        "kici_bare_metal::destroy::files",
        "kici_bare_metal::list::scan",
        "kici_bare_metal::adopt::check",
        "kici_bare_metal::adopt::watch",
        "kici_scaler::reconcile::reaped",
        "kici_scaler::reconcile::lease_released",
        "kici_scaler::reconcile::settled",
        "kici_scaler::registration::record",
        "kici_store::ip::claimed",
        "kici_store::ip::released",
        // The container backend: every provisioning and release step.
        "kici_container::spawn::lease",
        "kici_container::spawn::pull",
        "kici_container::spawn::create",
        "kici_container::spawn::rules",
        "kici_container::spawn::start",
        "kici_container::destroy::stop",
        "kici_container::destroy::remove",
        "kici_container::destroy::rules",
        "kici_container::destroy::lease",
        // Its egress rules.
        "kici_netpolicy::ensure::table",
        "kici_netpolicy::ensure::docker_user",
        "kici_netpolicy::install::applied",
        "kici_netpolicy::remove::deleted",
        "kici_netpolicy::sweep::deleted",
        // The Firecracker backend.
        "kici_firecracker::spawn::vm_dir",
        "kici_firecracker::spawn::lease",
        "kici_firecracker::spawn::tap",
        "kici_firecracker::spawn::attach",
        "kici_firecracker::spawn::rules",
        "kici_firecracker::spawn::chroot",
        "kici_firecracker::spawn::overlay",
        "kici_firecracker::spawn::jailer",
        "kici_firecracker::spawn::socket",
        "kici_firecracker::spawn::configure",
        "kici_firecracker::spawn::mmds",
        "kici_firecracker::spawn::start",
        "kici_firecracker::mmds::clear",
        "kici_firecracker::destroy::stop",
        "kici_firecracker::destroy::rules",
        "kici_firecracker::destroy::tap",
        "kici_firecracker::destroy::lease",
        "kici_firecracker::destroy::chroot",
        "kici_firecracker::sweep::tap",
        "kici_firecracker::sweep::leases",
    ] {
        assert!(
            fps.iter().any(|f| f == step),
            "no failpoint for {step}: {fps:?}"
        );
    }
    // And a crash test below for each of those that a request reaches.
    let covered: BTreeSet<&str> = SPAWN_STEPS
        .iter()
        .chain(DESTROY_STEPS)
        .chain(RESTART_STEPS)
        .copied()
        .collect();
    for fp in &fps {
        if fp.starts_with("kici_bare_metal::") || fp.starts_with("kici_engine::") {
            assert!(covered.contains(fp.as_str()), "{fp} has no crash test");
        }
    }
}

const SPAWN_STEPS: &[&str] = &[
    "kici_engine::spawn::recorded",
    "kici_bare_metal::spawn::dir",
    "kici_bare_metal::spawn::cgroup",
    "kici_bare_metal::spawn::limits",
    "kici_bare_metal::spawn::process",
    "kici_bare_metal::spawn::marker",
    "kici_bare_metal::spawn::watch",
    "kici_engine::spawn::backend_done",
];
const DESTROY_STEPS: &[&str] = &[
    "kici_bare_metal::destroy::signal",
    "kici_bare_metal::destroy::kill",
    "kici_bare_metal::destroy::cgroup",
    "kici_bare_metal::destroy::files",
    "kici_engine::destroy::backend_done",
];
/// Reached only when a daemon starts over recorded agents.
const RESTART_STEPS: &[&str] = &[
    "kici_bare_metal::list::scan",
    "kici_bare_metal::adopt::check",
    "kici_bare_metal::adopt::watch",
];

/// Crash at `fp` (the trigger returns the agents that must survive it),
/// then restart, check, and shut down cleanly.
fn crash_then_recover(dir: &Dir, fp: &str, trigger: impl FnOnce(&mut Daemon) -> Vec<String>) {
    let mut d = start(dir, Some(fp)).unwrap_or_else(|s| panic!("{fp}: died at start: {s:?}"));
    let survivors = trigger(&mut d);
    let status = d.wait_exit();
    assert_eq!(
        status.signal(),
        Some(9),
        "{fp}: the daemon was to kill itself there"
    );
    let mut d = start(dir, None).unwrap();
    assert_consistent(&mut d, dir, fp);
    let live = d.agents();
    for s in &survivors {
        assert!(
            live.contains(s),
            "{fp}: {s} survived the crash but was not re-adopted"
        );
        let pids = reality(dir).pids;
        assert!(pids.iter().any(|(a, _)| a == s), "{fp}: {s} has no process");
    }
    assert_clean_shutdown(d, dir, fp);
}

#[test]
fn serial_crash_at_each_spawn_step_leaks_nothing() {
    for fp in SPAWN_STEPS {
        let dir = Dir::bare_metal(4);
        // One agent that survives the crash, then the one being spawned.
        let mut first = start(&dir, None).unwrap();
        let survivor = scale(&first, "survivor").unwrap();
        first.wait_state(&survivor, "booted");
        first.kill9();
        crash_then_recover(&dir, fp, |d| {
            scale(d, "crashing");
            vec![survivor]
        });
    }
}

#[test]
fn serial_crash_at_each_destroy_step_leaks_nothing() {
    for fp in DESTROY_STEPS {
        let dir = Dir::bare_metal(4);
        crash_then_recover(&dir, fp, |d| {
            let keep = scale(d, "keep").unwrap();
            let agent = scale(d, "victim").unwrap();
            d.wait_state(&keep, "booted");
            d.wait_state(&agent, "booted");
            let (status, body) = d.http("DELETE", &format!("/v1/agents/{agent}"), None);
            assert!(status == 202 || status == 0, "{status} {body}");
            vec![keep]
        });
    }
}

#[test]
fn serial_crash_while_restarting_over_recorded_agents_leaks_nothing() {
    for fp in RESTART_STEPS {
        let dir = Dir::bare_metal(4);
        let mut first = start(&dir, None).unwrap();
        let a = scale(&first, "a").unwrap();
        first.wait_state(&a, "booted");
        first.kill9();
        // The crash comes during start-up (recovery or the first pass).
        let status = match start(&dir, Some(fp)) {
            Err(status) => status,
            Ok(mut d) => d.wait_exit(),
        };
        assert_eq!(status.signal(), Some(9), "{fp}");
        let mut d = start(&dir, None).unwrap();
        assert_consistent(&mut d, &dir, fp);
        assert!(
            d.agents().contains(&a),
            "{fp}: the live agent was re-adopted"
        );
        assert_clean_shutdown(d, &dir, fp);
    }
}

/// 100+ kill -9 at random moments under a stream of requests and
/// deletions; after each restart the world matches the daemon's view.
#[test]
fn serial_random_kills_under_load_leak_nothing() {
    use rand::Rng;
    let dir = Dir::bare_metal(6);
    let mut rng = rand::thread_rng();
    let mut job = 0u32;
    let mut seen_alive = 0;
    for round in 0..110 {
        let mut d = start(&dir, None).unwrap();
        let addr = d.addr.clone();
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let first_job = job;
        let load = std::thread::spawn(move || {
            let mut n = first_job;
            let mut agents = Vec::new();
            while stop_rx.try_recv().is_err() {
                n += 1;
                let (status, body) = http(
                    &addr,
                    "POST",
                    "/v1/scale",
                    &[],
                    Some(&format!(r#"{{"jobId":"j{n}","labels":["local"]}}"#)),
                );
                if status == 0 {
                    break;
                }
                if let Ok(v) = serde_json::from_str::<Value>(&body) {
                    if let Some(a) = v["agentId"].as_str() {
                        agents.push(a.to_owned());
                    }
                }
                if n.is_multiple_of(3) {
                    if let Some(a) = agents.pop() {
                        http(&addr, "DELETE", &format!("/v1/agents/{a}"), &[], None);
                    }
                }
            }
            n
        });
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..150)));
        d.kill9();
        let _ = stop_tx.send(());
        job = load.join().unwrap() + 1;
        if round % 25 == 24 {
            // Now and then, a full check mid-way.
            let mut d = start(&dir, None).unwrap();
            assert_consistent(&mut d, &dir, &format!("round {round}"));
            seen_alive += d.agents().len();
            d.kill9();
        }
    }
    let mut d = start(&dir, None).unwrap();
    assert_consistent(&mut d, &dir, "after the last kill");
    seen_alive += d.agents().len();
    assert!(
        seen_alive > 0,
        "the load never left an agent to recover: the test proved nothing"
    );
    assert!(job > 110, "the load sent too few requests ({job})");
    assert_clean_shutdown(d, &dir, "after the last kill");
}
