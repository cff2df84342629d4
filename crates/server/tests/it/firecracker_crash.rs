//! `kill -9` of the real daemon at every Firecracker spawn and destroy
//! failpoint, then restart, recovery and reconcile passes: no VM directory,
//! TAP, nftables rule, IP lease or row is left that no live agent owns, and
//! a clean shutdown then leaves none at all. The VMM and jailer are the
//! kici-firecracker tests' stand-ins (a Python Firecracker API and a shell
//! jailer); the bridge, TAPs, rules, chroots and store are real.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::daemon::{agents_with_rules, rows, wait_until, Daemon, Dir, FAST_RECONCILE};
use common::firecracker::agents_with_taps;
use common::firecracker_standin::{plant_lease, PlantedTap, World};
use kici_model::{AgentId, InstanceId, ScalerType};
use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;

/// After restart and reconcile: VM directories, TAPs, leases and rows are
/// exactly the live agents'; rules belong to live agents only.
fn assert_consistent(d: &mut Daemon, world: &World, context: &str) {
    let instance: InstanceId = world.dir.instance().parse().unwrap();
    d.settle(context);
    let live = d.agents();
    assert_eq!(
        world.vm_dirs(),
        live,
        "{context}: VM directories vs live agents"
    );
    assert_eq!(
        agents_with_taps(instance),
        live,
        "{context}: TAPs vs live agents"
    );
    let r = rows(&world.dir.sqlite_url(), &world.dir.instance());
    let recorded: BTreeSet<String> = r.agents.iter().map(|a| a.agent_id.to_string()).collect();
    assert_eq!(recorded, live, "{context}: rows vs live agents");
    let leased: Vec<String> = r.leases.iter().map(|l| l.agent.to_string()).collect();
    assert_eq!(
        leased.iter().cloned().collect::<BTreeSet<_>>(),
        live,
        "{context}: leases vs live agents"
    );
    assert_eq!(leased.len(), live.len(), "{context}: one lease per agent");
    let ruled = agents_with_rules(instance);
    assert!(
        ruled.is_subset(&live),
        "{context}: rules of agents that are gone: {:?}",
        ruled.difference(&live).collect::<Vec<_>>()
    );
}

/// The steps of other crates a Firecracker spawn goes through.
const SPAWN_SHARED_STEPS: &[&str] = &[
    "kici_store::ip::claimed",
    "kici_netpolicy::install::applied",
];

const DESTROY_STEPS: &[&str] = &[
    "kici_store::ip::released",
    "kici_netpolicy::remove::deleted",
    "kici_firecracker::destroy::stop",
    "kici_firecracker::destroy::rules",
    "kici_firecracker::destroy::tap",
    "kici_firecracker::destroy::lease",
    "kici_firecracker::destroy::chroot",
];

/// Steps no daemon crash test reaches, each with why. None now: the MMDS
/// clear after a guest agent's `config.ack` needs a real guest agent
/// (`firecracker_testkit_e2e.rs` crashes there), the sweep's are below.
const NOT_CRASHED_HERE: &[&str] = &[];

/// The backend's own sweep, each step of which removes one orphan.
const SWEEP_STEPS: &[&str] = &[
    "kici_firecracker::sweep::tap",
    "kici_firecracker::sweep::leases",
];

fn scale(d: &Daemon, job: &str) -> Option<String> {
    let (status, body) = d.scale(job, &["linux", "vm"]);
    (status == 202).then(|| body["agentId"].as_str().unwrap().to_owned())
}

fn start(dir: &Dir, crash_at: Option<&str>) -> Result<Daemon, std::process::ExitStatus> {
    let env: Vec<(&str, &str)> = crash_at
        .map(|fp| ("KICI_SCALER_CRASH_AT", fp))
        .into_iter()
        .collect();
    Daemon::try_start(dir, FAST_RECONCILE, &env)
}

/// Crash at `fp` while `trigger` runs, restart, check, shut down cleanly.
fn crash_then_recover(fp: &str, trigger: impl FnOnce(&Daemon) -> Vec<String>) {
    let world = World::new();
    let mut d =
        start(&world.dir, Some(fp)).unwrap_or_else(|s| panic!("{fp}: died at start: {s:?}"));
    let survivors = trigger(&d);
    let status = d.wait_exit();
    assert_eq!(
        status.signal(),
        Some(9),
        "{fp}: the daemon was to die there"
    );
    let mut d = start(&world.dir, None).unwrap();
    assert_consistent(&mut d, &world, fp);
    let live = d.agents();
    for s in &survivors {
        assert!(live.contains(s), "{fp}: {s} was not re-adopted");
    }
    d.terminate();
    assert_nothing_left(&world, fp);
}

/// After a clean shutdown: no VM directory, VMM, TAP, rule, lease or row.
fn assert_nothing_left(world: &World, fp: &str) {
    let instance: InstanceId = world.dir.instance().parse().unwrap();
    assert!(world.vm_dirs().is_empty(), "{fp}: VM directories left");
    assert_eq!(
        world.running_vmms(),
        Vec::<String>::new(),
        "{fp}: VMMs left"
    );
    assert!(agents_with_taps(instance).is_empty(), "{fp}: TAPs left");
    assert!(agents_with_rules(instance).is_empty(), "{fp}: rules left");
    let r = rows(&world.dir.sqlite_url(), &world.dir.instance());
    assert!(r.leases.is_empty(), "{fp}: leases left");
    assert!(r.agents.is_empty(), "{fp}: rows left");
}

#[test]
fn serial_firecracker_crash_at_each_spawn_step_leaks_nothing() {
    for fp in kici_firecracker::fp::SPAWN.iter().chain(SPAWN_SHARED_STEPS) {
        let crashing = std::cell::RefCell::new(None);
        crash_then_recover(fp, |d| {
            *crashing.borrow_mut() = scale(d, "crashing");
            vec![]
        });
        // Untagged (a crash between creating and attaching it), a TAP
        // escapes the checks by owner tag: none by its name either.
        if let Some(agent) = crashing.into_inner() {
            let tap = kici_firecracker::names::tap_name(&agent.parse().unwrap());
            let link = common::daemon::tool("ip", &["-j", "link", "show", "dev", &tap]);
            assert!(!link.contains("ifname"), "{fp}: {tap} left: {link}");
        }
    }
}

#[test]
fn serial_firecracker_crash_at_each_destroy_step_leaks_nothing() {
    for fp in DESTROY_STEPS {
        crash_then_recover(fp, |d| {
            let keep = scale(d, "keep").unwrap();
            let victim = scale(d, "victim").unwrap();
            for agent in [&keep, &victim] {
                wait_until(&format!("{agent} is up"), || {
                    d.state_of(agent).as_str() == "booted"
                });
            }
            let (status, body) = d.http("DELETE", &format!("/v1/agents/{victim}"), None);
            assert!(status == 202 || status == 0, "{status} {body}");
            vec![keep]
        });
    }
}

/// The daemon dies while it creates its rules table at start-up (before
/// any agent): the next start completes the table and works normally.
#[test]
fn serial_firecracker_crash_while_ensuring_the_rules_table_at_start_up_leaks_nothing() {
    let world = World::new();
    let fp = "kici_netpolicy::ensure::table";
    // Backends start after the API is up: the daemon may answer first.
    let status = match start(&world.dir, Some(fp)) {
        Err(status) => status,
        Ok(mut d) => d.wait_exit(),
    };
    assert_eq!(status.signal(), Some(9), "{fp}");
    let mut d = start(&world.dir, None).unwrap();
    assert_consistent(&mut d, &world, fp);
    let agent = scale(&d, "after").unwrap();
    wait_until(&format!("{agent} is up"), || {
        d.state_of(&agent).as_str() == "booted"
    });
    assert_consistent(&mut d, &world, fp);
    d.terminate();
    let instance: InstanceId = world.dir.instance().parse().unwrap();
    assert!(world.vm_dirs().is_empty() && world.running_vmms().is_empty());
    assert!(agents_with_taps(instance).is_empty() && agents_with_rules(instance).is_empty());
}

/// The backend's own sweep every second, and no periodic reconcile pass
/// (only the start-up one): an orphan planted once the daemon is up is
/// the sweep's to remove.
const SWEEP_EVERY_SECOND: &[&str] = &[
    "--listen",
    "127.0.0.1:0",
    "--reconcile-age-seconds",
    "0",
    "--reconcile-interval-seconds",
    "3600",
    "--firecracker-sweep-interval-seconds",
    "1",
];

/// What a test planted for the sweep to remove.
enum Orphan {
    Tap(PlantedTap),
    Lease(kici_store::Lease),
}

impl Orphan {
    fn gone(&self, world: &World) -> bool {
        match self {
            Orphan::Tap(tap) => !tap.exists(),
            Orphan::Lease(lease) => !rows(&world.dir.sqlite_url(), &world.dir.instance())
                .leases
                .contains(lease),
        }
    }
}

/// The daemon runs an agent; `plant` leaves one orphan of this instance;
/// the backend's periodic sweep removes it and the daemon is killed right
/// there (`fp`). Restarted without the failpoint, recovery, the reconciler
/// and the sweep find nothing more to remove: the orphan went once, the
/// agent runs on (same VMM) and is tracked once, nothing leaked.
fn crash_in_the_sweep(fp: &str, plant: impl FnOnce(&World, InstanceId) -> Orphan) {
    let world = World::new();
    let env = [("KICI_SCALER_CRASH_AT", fp)];
    let mut d = Daemon::try_start(&world.dir, SWEEP_EVERY_SECOND, &env)
        .unwrap_or_else(|s| panic!("{fp}: died at start: {s:?}"));
    let instance: InstanceId = world.dir.instance().parse().unwrap();
    let keep = scale(&d, "keep").unwrap();
    wait_until(&format!("{keep} is up"), || {
        d.state_of(&keep).as_str() == "booted"
    });
    let vmms = world.running_vmms();
    assert_eq!(vmms.len(), 1, "{fp}: keep's VMM");
    let orphan = plant(&world, instance);
    let status = d.wait_exit();
    assert_eq!(
        status.signal(),
        Some(9),
        "{fp}: the daemon was to die there"
    );
    assert!(orphan.gone(&world), "{fp}: removed before the crash");

    let mut args = FAST_RECONCILE.to_vec();
    args.extend(["--firecracker-sweep-interval-seconds", "1"]);
    let mut d = Daemon::start(&world.dir, &args, &[]);
    assert_consistent(&mut d, &world, fp);
    // Two whole sweeps after the restart: nothing of this instance left
    // for them.
    for _ in 0..2 {
        let sweep = d.expect_log("Firecracker orphan sweep");
        for field in ["vms", "taps", "leases", "rules", "errors"] {
            assert_eq!(
                sweep[field], 0,
                "{fp}: the sweep after the restart: {sweep}"
            );
        }
    }
    assert_consistent(&mut d, &world, fp);
    assert!(orphan.gone(&world), "{fp}: the orphan came back");
    let m = d.metrics();
    for kind in ["vm", "tap", "chroot", "ip-lease", "nftables-rule"] {
        assert_eq!(
            common::daemon::metric(
                &m,
                "kici_orch_scaler_orphans_reaped_total",
                &format!("kind=\"{kind}\"")
            ),
            0.0,
            "{fp}: the reconciler found a {kind} to reap"
        );
    }
    let (_, body) = d.http("GET", "/v1/agents", None);
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
    let ids: Vec<&str> = listed["agents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a["agentId"].as_str())
        .collect();
    assert_eq!(ids, [keep.as_str()], "{fp}: keep, once");
    assert_eq!(world.running_vmms(), vmms, "{fp}: keep's VMM runs on");
    d.terminate();
    drop(orphan);
    assert_nothing_left(&world, fp);
}

#[test]
fn serial_firecracker_crash_in_the_sweep_after_removing_an_orphaned_tap_leaks_nothing() {
    crash_in_the_sweep("kici_firecracker::sweep::tap", |world, instance| {
        let agent = AgentId::random(ScalerType::Firecracker);
        let tag = kici_firecracker::names::owner_tag(instance, &agent);
        Orphan::Tap(PlantedTap::new(&agent, &world.bridge, &tag))
    });
}

#[test]
fn serial_firecracker_crash_in_the_sweep_after_releasing_an_orphaned_lease_leaks_nothing() {
    crash_in_the_sweep("kici_firecracker::sweep::leases", |world, instance| {
        let agent = AgentId::random(ScalerType::Firecracker);
        Orphan::Lease(plant_lease(
            &world.dir.sqlite_url(),
            instance,
            &world.subnet,
            &agent,
        ))
    });
}

/// What the backend's own sweep removes is counted by kind in
/// `kici_orch_scaler_orphans_reaped_total`, like the reconciler's reaps.
#[test]
fn serial_firecracker_periodic_sweep_counts_what_it_removes_by_kind() {
    let world = World::new();
    let mut d = Daemon::start(&world.dir, SWEEP_EVERY_SECOND, &[]);
    let instance: InstanceId = world.dir.instance().parse().unwrap();
    let keep = scale(&d, "keep").unwrap();
    wait_until(&format!("{keep} is up"), || {
        d.state_of(&keep).as_str() == "booted"
    });
    let tapped = AgentId::random(ScalerType::Firecracker);
    let tap = Orphan::Tap(PlantedTap::new(
        &tapped,
        &world.bridge,
        &kici_firecracker::names::owner_tag(instance, &tapped),
    ));
    let lease = Orphan::Lease(plant_lease(
        &world.dir.sqlite_url(),
        instance,
        &world.subnet,
        &AgentId::random(ScalerType::Firecracker),
    ));
    let (mut taps, mut leases) = (0, 0);
    while taps == 0 || leases == 0 {
        let sweep = d.expect_log("Firecracker orphan sweep");
        assert!(sweep["vms"] == 0 && sweep["errors"] == 0, "{sweep}");
        taps += sweep["taps"].as_u64().unwrap();
        leases += sweep["leases"].as_u64().unwrap();
    }
    assert_eq!((taps, leases), (1, 1));
    assert!(tap.gone(&world) && lease.gone(&world));
    let reaped = |kind: &str| {
        common::daemon::metric(
            &d.metrics(),
            "kici_orch_scaler_orphans_reaped_total",
            &format!("kind=\"{kind}\""),
        )
    };
    wait_until("the sweep's removals are counted", || {
        reaped("tap") == 1.0 && reaped("ip-lease") == 1.0
    });
    assert_eq!((reaped("vm"), reaped("chroot")), (0.0, 0.0));
    assert_eq!(d.agents(), BTreeSet::from([keep]));
    d.terminate();
    assert_nothing_left(&world, "periodic sweep");
}

#[test]
fn every_firecracker_step_has_a_daemon_crash_test_or_says_why_not() {
    let out = Command::new(common::daemon::BIN)
        .arg("failpoints")
        .output()
        .unwrap();
    assert!(out.status.success());
    let listed = String::from_utf8(out.stdout).unwrap();
    let covered: BTreeSet<&str> = kici_firecracker::fp::SPAWN
        .iter()
        .chain(SPAWN_SHARED_STEPS)
        .chain(DESTROY_STEPS)
        .chain(["kici_netpolicy::ensure::table"].iter())
        .chain(SWEEP_STEPS)
        .chain(NOT_CRASHED_HERE)
        .chain(common::firecracker::CRASHED_IN_TESTKIT_E2E)
        .copied()
        .collect();
    for fp in &covered {
        assert!(listed.lines().any(|l| l == *fp), "no failpoint {fp}");
    }
    for fp in listed
        .lines()
        .filter(|l| l.starts_with("kici_firecracker::") || l.starts_with("kici_store::ip::"))
    {
        assert!(covered.contains(fp), "{fp} has no crash test");
    }
}
