//! The daemon's reconciler against the real world: one orphan of each kind
//! the bare-metal backend and the store can leave, a young in-flight one,
//! and another instance's, planted; the daemon's passes (mark, then reap)
//! remove exactly the orphans, once each, counted by kind in
//! `kici_orch_scaler_orphans_reaped_total{kind}`; checked against cgroupfs,
//! `/proc`, the agent directories and the store's rows.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

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
