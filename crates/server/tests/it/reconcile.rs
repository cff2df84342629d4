//! The daemon's reconciler against the real world: one orphan of each kind
//! the bare-metal backend and the store can leave, a young in-flight one,
//! and another instance's, planted; the daemon's passes (mark, then reap)
//! remove exactly the orphans, once each, counted by kind in
//! `kici_orch_scaler_orphans_reaped_total{kind}`; checked against cgroupfs,
//! `/proc`, the agent directories and the store's rows.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::daemon::{metric, rows, wait_until, Daemon, Dir, CGROUP_V2};
use kici_model::{AgentId, MemoryBytes, MilliCpu, ScalerName, ScalerType};
use kici_store::{AgentRecord, Ipv4Pool, StateStore, UnixMillis};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

const REAPED: &str = "kici_orch_scaler_orphans_reaped_total";
/// The daemon's age threshold: everything planted as "old" is an hour old,
/// the young orphan a few seconds.
const AGE: &str = "600";

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// A second handle on the instance's SQLite store (allowed beside the
/// daemon).
async fn store(dir: &Dir) -> Arc<dyn StateStore> {
    let url: kici_store::StoreUrl = dir.sqlite_url().parse().unwrap();
    kici_store::open(
        &url,
        dir.instance().parse().unwrap(),
        kici_store::StoreOptions::default(),
    )
    .await
    .unwrap()
}

fn leaf(dir: &Dir, agent: &str) -> PathBuf {
    Path::new(CGROUP_V2)
        .join("kici-scaler")
        .join(dir.instance())
        .join("local")
        .join(agent)
}

fn pids(dir: &Dir, agent: &str) -> Vec<i32> {
    std::fs::read_to_string(leaf(dir, agent).join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s.rsplit(')').next().unwrap_or("").split_whitespace().next();
            state != Some("Z")
        })
        .unwrap_or(false)
}

/// Backdates a resource's creation time (what the backend reads as its
/// age) by an hour.
fn age_by_an_hour(path: &Path) {
    let out = Command::new("touch")
        .args(["-d", "1 hour ago"])
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

fn spawn(d: &Daemon, job: &str) -> String {
    let (status, body) = d.scale(job, &["local"]);
    assert_eq!(status, 202, "{body}");
    let agent = body["agentId"].as_str().unwrap().to_owned();
    d.wait_state(&agent, "booted");
    agent
}

fn start(dir: &Dir) -> Daemon {
    Daemon::start(
        dir,
        &[
            "--listen",
            "127.0.0.1:0",
            "--reconcile-age-seconds",
            AGE,
            "--reconcile-interval-seconds",
            "1",
        ],
        &[],
    )
}

fn reaped(d: &Daemon) -> (f64, f64, f64, f64) {
    let m = d.metrics();
    let by = |kind: &str| metric(&m, REAPED, &format!("kind=\"{kind}\""));
    let total: f64 = [
        "container",
        "process",
        "vm",
        "tap",
        "chroot",
        "cgroup",
        "nftables-rule",
        "ip-lease",
        "ledger-row",
    ]
    .iter()
    .map(|k| by(k))
    .sum();
    (by("process"), by("cgroup"), by("ip-lease"), total)
}

#[test]
fn serial_reconcile_reaps_each_orphan_once_and_spares_young_and_foreign_ones() {
    // Another instance's agent, left behind by a crash with its row gone
    // and an hour old: an orphan, but not ours.
    let other = Dir::bare_metal(2);
    let mut b = start(&other);
    let foreign = spawn(&b, "foreign");
    b.kill9();
    block_on(async {
        let s = store(&other).await;
        assert!(s
            .delete_agent(&foreign.parse::<AgentId>().unwrap())
            .await
            .unwrap());
        s.close().await;
    });
    age_by_an_hour(&leaf(&other, &foreign));
    let foreign_pids = pids(&other, &foreign);
    assert_eq!(foreign_pids.len(), 1);

    let dir = Dir::bare_metal(8);
    let mut a = start(&dir);
    let orphan = spawn(&a, "orphan");
    let young = spawn(&a, "young");
    let gone = spawn(&a, "gone");
    let keep = spawn(&a, "keep");
    a.kill9();
    let orphan_pids = pids(&dir, &orphan);
    let young_pids = pids(&dir, &young);
    let gone_pids = pids(&dir, &gone);
    assert_eq!((orphan_pids.len(), young_pids.len()), (1, 1));
    // orphan, young: cgroup + process + directory with our marker, no row
    // (a spawn whose record was lost); orphan is an hour old.
    // gone: recorded, its process killed while the daemon was down.
    // A lease of an agent nobody knows.
    let pool = Ipv4Pool::new("10.213.7.0/28".parse().unwrap()).unwrap();
    let leased_to = AgentId::random(ScalerType::BareMetal);
    block_on(async {
        let s = store(&dir).await;
        for agent in [&orphan, &young] {
            assert!(s
                .delete_agent(&agent.parse::<AgentId>().unwrap())
                .await
                .unwrap());
        }
        s.allocate(&pool, &leased_to).await.unwrap();
        s.close().await;
    });
    age_by_an_hour(&leaf(&dir, &orphan));
    age_by_an_hour(&dir.path(&format!("state/agents/{orphan}")));
    std::fs::write(leaf(&dir, &gone).join("cgroup.kill"), "1").unwrap();
    wait_until("gone's process is dead", || {
        gone_pids.iter().all(|p| !alive(*p))
    });

    let mut a = start(&dir);
    assert_eq!(a.recovery["adopted"], 1, "{}", a.recovery);
    assert_eq!(a.recovery["released"], 1, "{}", a.recovery);
    // A stale row: written after recovery (a `Forget` that never made it),
    // last changed an hour ago, of an agent the engine does not have.
    let stale = AgentId::random(ScalerType::BareMetal);
    block_on(async {
        let s = store(&dir).await;
        let hour_ago = UnixMillis::from(SystemTime::now() - Duration::from_secs(3600));
        s.put_agent(&AgentRecord {
            agent_id: stale,
            scaler: ScalerName::new("local"),
            backend: ScalerType::BareMetal,
            label_set_index: 0,
            label_set_key: "local".into(),
            state: "booted".into(),
            mode: "orchestrator".into(),
            job_id: None,
            run_id: None,
            warm: false,
            milli_cpu: MilliCpu::from_millis(0),
            memory_bytes: MemoryBytes::from_bytes(0),
            machine_pool: None,
            resource_id: None,
            resources: Default::default(),
            token_hash: None,
            token_expires_at: None,
            failure: None,
            created_at: hour_ago,
            updated_at: hour_ago,
        })
        .await
        .unwrap();
        s.close().await;
    });

    // Mark, then reap: at most a few passes.
    wait_until("the orphan, the lease and the stale row are gone", || {
        let r = rows(&dir.sqlite_url(), &dir.instance());
        !leaf(&dir, &orphan).exists()
            && r.leases.is_empty()
            && !r.agents.iter().any(|a| a.agent_id == stale)
    });
    let first = reaped(&a);
    // Two more passes change nothing: each was reaped exactly once.
    a.expect_log("reconcile pass");
    a.expect_log("reconcile pass");
    let (process, cgroup, lease, total) = reaped(&a);
    assert_eq!((process, cgroup, lease, total), first);
    assert_eq!(process + cgroup, 1.0, "one bare-metal orphan");
    assert_eq!(lease, 1.0, "one lease");
    assert_eq!(total, 2.0, "nothing else was counted");

    // The real world.
    assert!(orphan_pids.iter().all(|p| !alive(*p)), "orphan's process");
    assert!(!dir.path(&format!("state/agents/{orphan}")).exists());
    assert!(!leaf(&dir, &gone).exists(), "the gone agent's cgroup");
    assert!(
        young_pids.iter().all(|p| alive(*p)),
        "the young orphan is untouched"
    );
    assert!(leaf(&dir, &young).exists());
    assert!(dir.path(&format!("state/agents/{young}")).exists());
    assert!(
        foreign_pids.iter().all(|p| alive(*p)),
        "another instance's agent is untouched"
    );
    assert!(leaf(&other, &foreign).exists());
    assert_eq!(a.agents(), BTreeSet::from([keep.clone()]));
    assert_eq!(pids(&dir, &keep).len(), 1);
    let recorded: BTreeSet<String> = rows(&dir.sqlite_url(), &dir.instance())
        .agents
        .iter()
        .map(|r| r.agent_id.to_string())
        .collect();
    assert_eq!(recorded, BTreeSet::from([keep]));
    a.terminate();
}

// ----- crashes in the middle of a pass -------------------------------------

/// Every reconcile step with a failpoint; each has a crash test below.
const RECONCILE_STEPS: &[&str] = &[
    "kici_scaler::reconcile::reaped",
    "kici_scaler::reconcile::lease_released",
    "kici_scaler::reconcile::settled",
];

#[test]
fn every_reconcile_step_has_a_failpoint_and_a_crash_test() {
    let out = Command::new(common::daemon::BIN)
        .arg("failpoints")
        .output()
        .unwrap();
    assert!(out.status.success());
    let listed: BTreeSet<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    for step in RECONCILE_STEPS {
        assert!(
            listed.contains(*step),
            "no failpoint for {step}: {listed:?}"
        );
    }
    for fp in listed
        .iter()
        .filter(|f| f.starts_with("kici_scaler::reconcile::"))
    {
        assert!(
            RECONCILE_STEPS.contains(&fp.as_str()),
            "{fp} has no crash test"
        );
    }
}

fn start_crashing(dir: &Dir, fp: &str) -> std::process::ExitStatus {
    use std::os::unix::process::ExitStatusExt;
    let env = [("KICI_SCALER_CRASH_AT", fp)];
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--reconcile-age-seconds",
        AGE,
        "--reconcile-interval-seconds",
        "1",
    ];
    let status = match Daemon::try_start(dir, &args, &env) {
        Err(status) => status,
        Ok(mut d) => d.wait_exit(),
    };
    assert_eq!(
        status.signal(),
        Some(9),
        "{fp}: the daemon was to die there"
    );
    status
}

/// After a restart and a few passes: the live agents are exactly the
/// recorded ones and the instance's cgroups, each with its process.
fn assert_consistent(d: &mut Daemon, dir: &Dir, context: &str) {
    for _ in 0..3 {
        d.expect_log("reconcile pass");
    }
    let live = d.agents();
    let r = rows(&dir.sqlite_url(), &dir.instance());
    let recorded: BTreeSet<String> = r.agents.iter().map(|a| a.agent_id.to_string()).collect();
    assert_eq!(recorded, live, "{context}: rows vs live agents");
    let cgroups: BTreeSet<String> = std::fs::read_dir(
        Path::new(CGROUP_V2)
            .join("kici-scaler")
            .join(dir.instance())
            .join("local"),
    )
    .map(|e| {
        e.flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    })
    .unwrap_or_default();
    assert_eq!(cgroups, live, "{context}: cgroups vs live agents");
    for agent in &live {
        assert_eq!(pids(dir, agent).len(), 1, "{context}: {agent}'s process");
    }
    assert!(r.leases.is_empty(), "{context}: leases {:?}", r.leases);
}

#[test]
fn serial_crash_after_reaping_an_orphan_leaks_nothing() {
    let fp = RECONCILE_STEPS[0];
    let dir = Dir::bare_metal(4);
    let mut a = start(&dir);
    let orphan = spawn(&a, "orphan");
    let keep = spawn(&a, "keep");
    a.kill9();
    let orphan_pids = pids(&dir, &orphan);
    block_on(async {
        let s = store(&dir).await;
        s.delete_agent(&orphan.parse::<AgentId>().unwrap())
            .await
            .unwrap();
        s.close().await;
    });
    age_by_an_hour(&leaf(&dir, &orphan));
    // Marked by the first pass, reaped by the second: the crash comes
    // right after the reap, before it is counted.
    start_crashing(&dir, fp);
    assert!(
        !leaf(&dir, &orphan).exists(),
        "{fp}: reaped before the crash"
    );
    let mut d = start(&dir);
    assert_consistent(&mut d, &dir, fp);
    assert_eq!(d.agents(), BTreeSet::from([keep]));
    assert!(orphan_pids.iter().all(|p| !alive(*p)));
    assert!(!dir.path(&format!("state/agents/{orphan}")).exists());
    d.terminate();
}

#[test]
fn serial_crash_after_releasing_a_lease_leaks_nothing() {
    let fp = RECONCILE_STEPS[1];
    let dir = Dir::bare_metal(4);
    let mut a = start(&dir);
    let keep = spawn(&a, "keep");
    a.kill9();
    let pool = Ipv4Pool::new("10.213.8.0/28".parse().unwrap()).unwrap();
    block_on(async {
        let s = store(&dir).await;
        s.allocate(&pool, &AgentId::random(ScalerType::BareMetal))
            .await
            .unwrap();
        s.close().await;
    });
    start_crashing(&dir, fp);
    assert!(rows(&dir.sqlite_url(), &dir.instance()).leases.is_empty());
    let mut d = start(&dir);
    assert_consistent(&mut d, &dir, fp);
    assert_eq!(d.agents(), BTreeSet::from([keep]));
    d.terminate();
}

#[test]
fn serial_crash_in_sweep_after_settling_a_gone_agent_leaks_nothing() {
    use std::os::unix::process::ExitStatusExt;
    let fp = RECONCILE_STEPS[2];
    let dir = Dir::bare_metal(4);
    let mut a = start(&dir);
    let gone = spawn(&a, "gone");
    let keep = spawn(&a, "keep");
    a.kill9();
    std::fs::write(leaf(&dir, &gone).join("cgroup.kill"), "1").unwrap();
    let gone_pids = pids(&dir, &gone);
    wait_until("gone's process is dead", || {
        gone_pids.iter().all(|p| !alive(*p))
    });
    let sweep = |crash: Option<&str>| {
        let mut cmd = dir.command(&["sweep", "--json", "--age-seconds", AGE]);
        cmd.arg("--config")
            .arg(dir.path("scalers.yaml"))
            .arg("--state-dir")
            .arg(dir.path("state"));
        if let Some(fp) = crash {
            cmd.env("KICI_SCALER_CRASH_AT", fp);
        }
        cmd.output().unwrap()
    };
    let crashed = sweep(Some(fp));
    assert_eq!(crashed.status.signal(), Some(9), "{crashed:?}");
    // The crash came after the destroy, before the row was forgotten.
    assert!(!leaf(&dir, &gone).exists());
    assert!(rows(&dir.sqlite_url(), &dir.instance())
        .agents
        .iter()
        .any(|r| r.agent_id.to_string() == gone));
    let again = sweep(None);
    assert!(again.status.success(), "{again:?}");
    let report: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(
        report["goneRecorded"],
        serde_json::json!([gone]),
        "{report}"
    );
    let mut d = start(&dir);
    assert_consistent(&mut d, &dir, fp);
    assert_eq!(d.agents(), BTreeSet::from([keep]));
    d.terminate();
}

// ----- Firecracker ----------------------------------------------------------

/// Everything of the Firecracker world the sweep may touch.
#[derive(Debug, PartialEq, Eq)]
struct FirecrackerWorld {
    vm_dirs: BTreeSet<String>,
    /// `(interface, agent)` tagged for our instance.
    our_links: BTreeSet<(String, String)>,
    /// Those of the watched interfaces that exist.
    links: BTreeSet<String>,
    leases: BTreeSet<String>,
    foreign_leases: BTreeSet<String>,
    rows: BTreeSet<String>,
    rules: BTreeSet<String>,
    vmms: BTreeSet<String>,
}

fn firecracker_world(
    world: &common::firecracker_standin::World,
    other: kici_model::InstanceId,
    watch: &[&str],
) -> FirecrackerWorld {
    let instance: kici_model::InstanceId = world.dir.instance().parse().unwrap();
    let url = world.dir.sqlite_url();
    let ours = rows(&url, &world.dir.instance());
    let links: serde_json::Value =
        serde_json::from_str(&common::daemon::tool("ip", &["-j", "link", "show"])).unwrap();
    FirecrackerWorld {
        vm_dirs: world.vm_dirs(),
        our_links: common::firecracker_standin::links_tagged(instance)
            .into_iter()
            .collect(),
        links: links
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|l| l["ifname"].as_str())
            .filter(|name| watch.contains(name))
            .map(str::to_owned)
            .collect(),
        leases: ours
            .leases
            .iter()
            .map(|l| format!("{} {}", l.ip, l.agent))
            .collect(),
        foreign_leases: rows(&url, &other.to_string())
            .leases
            .iter()
            .map(|l| format!("{} {}", l.ip, l.agent))
            .collect(),
        rows: ours.agents.iter().map(|a| a.agent_id.to_string()).collect(),
        rules: common::daemon::agents_with_rules(instance),
        vmms: world.running_vmms().into_iter().collect(),
    }
}

/// A VM directory with an owner marker `tag` as a spawn's first step makes
/// it, dated `age` ago.
fn plant_vm_dir(
    world: &common::firecracker_standin::World,
    agent: &AgentId,
    tag: &str,
    age: Duration,
) {
    let dir = world.dir.path(&format!("jail/firecracker/{agent}"));
    std::fs::create_dir_all(&dir).unwrap();
    let marker = dir.join(kici_firecracker::names::OWNER_MARKER);
    std::fs::write(&marker, tag).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&marker)
        .unwrap()
        .set_modified(SystemTime::now() - age)
        .unwrap();
}

/// `kici-scaler sweep --json --age-seconds <age> [extra]` on the world's
/// state dir; its report.
fn sweep_firecracker(
    world: &common::firecracker_standin::World,
    age: &str,
    extra: &[&str],
) -> serde_json::Value {
    let out = world
        .dir
        .command(&["sweep", "--json", "--age-seconds", age])
        .args(extra)
        .arg("--config")
        .arg(world.dir.path("scalers.yaml"))
        .arg("--state-dir")
        .arg(world.dir.path("state"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `(kind, id)` of a report's orphans.
fn orphans_by_kind(report: &serde_json::Value) -> BTreeSet<(String, String)> {
    report["orphans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                o["kind"].as_str().unwrap().to_owned(),
                o["id"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// One orphan of each Firecracker kind — a running VM nobody records, a
/// VM directory cut short after its marker, a TAP on its own, a lease of
/// an agent that does not exist, a recorded VM whose process died — beside
/// a young VM (a spawn in flight: directory, lease, TAP, rules, process),
/// another instance's directory, TAP and lease, a TAP with our tag but not
/// the name derived from its agent, and a bridge named like one of our
/// TAPs. `kici-scaler sweep --dry-run` changes nothing; `sweep` removes
/// exactly the orphans, by kind in its report; a second pass does nothing.
#[test]
fn serial_sweep_removes_exactly_the_firecracker_orphans() {
    use common::firecracker_standin::{plant_lease, PlantedTap, World};
    use kici_firecracker::names::owner_tag;
    let world = World::with_tap_shaped_bridge();
    let mut a = Daemon::start(
        &world.dir,
        &[
            "--listen",
            "127.0.0.1:0",
            "--reconcile-age-seconds",
            AGE,
            "--reconcile-interval-seconds",
            "3600",
        ],
        &[],
    );
    let instance: kici_model::InstanceId = world.dir.instance().parse().unwrap();
    let boot = |job: &str| {
        let (status, body) = a.scale(job, &["linux", "vm"]);
        assert_eq!(status, 202, "{body}");
        let agent = body["agentId"].as_str().unwrap().to_owned();
        a.wait_state(&agent, "booted");
        agent
    };
    let orphan_vm = boot("orphan-vm");
    let young = boot("young");
    let gone = boot("gone");
    let keep = boot("keep");
    a.kill9();
    let vmm_of = |agent: &str| {
        std::fs::read_to_string(world.dir.path(&format!("pids/{agent}")))
            .unwrap()
            .trim()
            .to_owned()
    };
    // Their records lost (orphan-vm, young); gone's VMM dies while no
    // daemon runs.
    block_on(async {
        let s = store(&world.dir).await;
        for agent in [&orphan_vm, &young] {
            assert!(s
                .delete_agent(&agent.parse::<AgentId>().unwrap())
                .await
                .unwrap());
        }
        s.close().await;
    });
    let gone_vmm = vmm_of(&gone);
    common::daemon::tool("kill", &["-9", &gone_vmm]);
    wait_until("gone's VMM is dead", || !alive(gone_vmm.parse().unwrap()));
    let hour = Duration::from_secs(3600);
    let marker = |agent: &str| {
        world.dir.path(&format!(
            "jail/firecracker/{agent}/{}",
            kici_firecracker::names::OWNER_MARKER
        ))
    };
    std::fs::File::options()
        .write(true)
        .open(marker(&orphan_vm))
        .unwrap()
        .set_modified(SystemTime::now() - hour)
        .unwrap();
    let cut_short = AgentId::random(ScalerType::Firecracker);
    plant_vm_dir(&world, &cut_short, &owner_tag(instance, &cut_short), hour);
    let lone_tap_agent = AgentId::random(ScalerType::Firecracker);
    let lone_tap = PlantedTap::new(
        &lone_tap_agent,
        &world.bridge,
        &owner_tag(instance, &lone_tap_agent),
    );
    let nobody = AgentId::random(ScalerType::Firecracker);
    plant_lease(&world.dir.sqlite_url(), instance, &world.subnet, &nobody);
    // Not ours: another instance's directory, TAP and lease; a TAP with
    // our tag whose name is not its agent's.
    let other: kici_model::InstanceId = "0f0e0d0c".parse().unwrap();
    assert_ne!(other, instance);
    let foreign = AgentId::random(ScalerType::Firecracker);
    plant_vm_dir(&world, &foreign, &owner_tag(other, &foreign), hour);
    let foreign_tap = PlantedTap::new(&foreign, &world.bridge, &owner_tag(other, &foreign));
    plant_lease(&world.dir.sqlite_url(), other, &world.subnet, &foreign);
    let misnamed_agent = AgentId::random(ScalerType::Firecracker);
    let misnamed = PlantedTap::new(
        &AgentId::random(ScalerType::Firecracker),
        &world.bridge,
        &owner_tag(instance, &misnamed_agent),
    );

    let watch = [
        world.bridge.as_str(),
        lone_tap.name.as_str(),
        foreign_tap.name.as_str(),
        misnamed.name.as_str(),
    ];
    let before = firecracker_world(&world, other, &watch);
    assert_eq!(before.links.len(), 4, "{before:?}");
    let expected: BTreeSet<(String, String)> = [
        ("vm".to_owned(), orphan_vm.clone()),
        ("chroot".to_owned(), cut_short.to_string()),
        ("tap".to_owned(), lone_tap_agent.to_string()),
    ]
    .into();

    // A dry run reports and changes nothing.
    let dry = sweep_firecracker(&world, AGE, &["--dry-run"]);
    assert_eq!(dry["dryRun"], true, "{dry}");
    assert_eq!(orphans_by_kind(&dry), expected, "{dry}");
    assert_eq!(dry["goneRecorded"], serde_json::json!([gone]), "{dry}");
    assert_eq!(dry["young"], 1, "{dry}");
    assert_eq!(dry["reaped"], serde_json::json!([]), "{dry}");
    // orphan-vm's and nobody's; never the young spawn's.
    assert_eq!(dry["leasesReleased"].as_array().unwrap().len(), 2, "{dry}");
    assert_eq!(dry["errors"], serde_json::json!([]), "{dry}");
    assert_eq!(
        firecracker_world(&world, other, &watch),
        before,
        "the dry run"
    );

    // The pass: exactly the orphans go, each counted by its kind.
    let report = sweep_firecracker(&world, AGE, &[]);
    assert_eq!(orphans_by_kind(&report), expected, "{report}");
    let reaped: BTreeSet<String> = report["reaped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        reaped,
        expected.iter().map(|(_, id)| id.clone()).collect(),
        "{report}"
    );
    assert_eq!(
        report["goneRecorded"],
        serde_json::json!([gone]),
        "{report}"
    );
    assert_eq!(report["young"], 1, "{report}");
    assert_eq!(report["errors"], serde_json::json!([]), "{report}");
    let nobody_lease = before
        .leases
        .iter()
        .find(|l| l.ends_with(&nobody.to_string()))
        .unwrap()
        .clone();
    assert_eq!(
        report["leasesReleased"].as_array().unwrap().len(),
        1,
        "only the lease of nobody is left to release on its own: {report}"
    );

    let after = firecracker_world(&world, other, &watch);
    let survivors: BTreeSet<String> = [young.clone(), keep.clone()].into();
    assert_eq!(
        after.vm_dirs,
        survivors
            .iter()
            .cloned()
            .chain([foreign.to_string()])
            .collect(),
        "VM directories"
    );
    let tapped: BTreeSet<String> = after.our_links.iter().map(|(_, a)| a.clone()).collect();
    assert_eq!(
        tapped,
        survivors
            .iter()
            .cloned()
            .chain([misnamed_agent.to_string()])
            .collect(),
        "TAPs tagged for this instance"
    );
    assert!(!lone_tap.exists(), "the lone TAP");
    assert!(foreign_tap.exists() && misnamed.exists(), "TAPs not ours");
    assert!(after.links.contains(&world.bridge), "the bridge");
    let leased: BTreeSet<String> = after
        .leases
        .iter()
        .map(|l| l.rsplit(' ').next().unwrap().to_owned())
        .collect();
    assert_eq!(leased, survivors, "leases (the young spawn keeps its own)");
    assert!(!after.leases.contains(&nobody_lease));
    assert_eq!(after.foreign_leases, before.foreign_leases, "foreign lease");
    assert_eq!(after.rows, BTreeSet::from([keep.clone()]), "rows");
    assert_eq!(after.rules, survivors, "rules");
    assert_eq!(
        after.vmms,
        [vmm_of(&young), vmm_of(&keep)].into(),
        "running VMMs"
    );
    assert!(!alive(vmm_of(&orphan_vm).parse().unwrap()));

    // A second pass finds nothing to do.
    let again = sweep_firecracker(&world, AGE, &[]);
    for field in [
        "orphans",
        "reaped",
        "goneRecorded",
        "leasesReleased",
        "errors",
    ] {
        assert_eq!(again[field], serde_json::json!([]), "{field}: {again}");
    }
    assert_eq!(again["young"], 1, "{again}");
    assert_eq!(
        firecracker_world(&world, other, &watch),
        after,
        "the second pass"
    );

    // Once old enough, the young one goes too; the daemon then takes keep
    // back and destroys it at shutdown.
    let late = sweep_firecracker(&world, "0", &[]);
    assert_eq!(
        orphans_by_kind(&late),
        [("vm".to_owned(), young.clone())].into(),
        "{late}"
    );
    let d = Daemon::start(&world.dir, &["--listen", "127.0.0.1:0"], &[]);
    assert_eq!(d.agents(), BTreeSet::from([keep]));
    d.terminate();
    let end = firecracker_world(&world, other, &watch);
    assert_eq!(end.vm_dirs, BTreeSet::from([foreign.to_string()]));
    assert_eq!(
        end.our_links
            .iter()
            .map(|(_, a)| a.clone())
            .collect::<BTreeSet<_>>(),
        BTreeSet::from([misnamed_agent.to_string()])
    );
    assert!(end.leases.is_empty() && end.rows.is_empty() && end.rules.is_empty());
    assert!(end.vmms.is_empty());
}
