//! The machine-pool ledger: upstream's `machine-ledger.test.ts` checklist adapted to our
//! format, plus liveness, expiry, reconciliation and failure paths.
// Under `--cfg loom` the sync primitives only work inside `loom::model`.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::{agent, demand, res, ConfigBuilder, GIB};
use kici_admission::ledger::{Clock, LedgerOptions, PoolCap, ReserveOutcome};
use kici_admission::{Admission, AdmitError, Cap, Holds, LedgerError, MachineLedger};
use kici_model::{AgentId, InstanceId, Resources};
use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const DAY: Duration = Duration::from_secs(24 * 3600);

fn inst(s: &str) -> InstanceId {
    s.parse().unwrap()
}

fn cap4() -> PoolCap {
    PoolCap {
        max_cpu_millis: Some(4000),
        max_memory_bytes: Some(4 * GIB),
    }
}

fn open(dir: &Path, instance: &str) -> MachineLedger {
    let l = MachineLedger::open_with(Some(dir), inst(instance), fast_options()).unwrap();
    l.register_pools([("pool", cap4())]).unwrap();
    l
}

fn fast_options() -> LedgerOptions {
    LedgerOptions {
        lock_timeout: Duration::from_secs(10),
        owner_lock_timeout: Duration::from_millis(20),
        ..LedgerOptions::default()
    }
}

fn reserve(l: &MachineLedger, a: u32, cpu: u64, mem: u64) -> ReserveOutcome {
    l.try_reserve("pool", agent(a), res(cpu, mem), Resources::ZERO, DAY)
        .unwrap()
}

fn refused_cap(o: ReserveOutcome) -> Cap {
    match o {
        ReserveOutcome::Refused(r) => r.cap,
        ReserveOutcome::Reserved => panic!("expected a refusal"),
    }
}

#[test]
fn first_reservation_is_granted_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path(), "0000000a");
    assert_eq!(reserve(&a, 1, 1000, GIB), ReserveOutcome::Reserved);
    let u = a.usage("pool").unwrap();
    assert_eq!((u.cpu_millis, u.memory_bytes, u.rows.len()), (1000, GIB, 1));
    assert_eq!(u.cap, Some(cap4()));
    assert_eq!(u.rows[0].instance, inst("0000000a"));
    assert_eq!(u.rows[0].agent, agent(1));
    assert_eq!(
        u.rows[0].expires_at_ms - u.rows[0].reserved_at_ms,
        DAY.as_millis() as u64
    );
    // The file is version 2, readable by people.
    let text = std::fs::read_to_string(dir.path().join("pool.json")).unwrap();
    assert!(
        text.contains("\"version\": 2") && text.contains("\"maxCpuMillis\": 4000"),
        "{text}"
    );
}

#[test]
fn cpu_and_memory_caps() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path(), "0000000a");
    assert_eq!(reserve(&a, 1, 3000, 0), ReserveOutcome::Reserved);
    assert_eq!(refused_cap(reserve(&a, 2, 2000, 0)), Cap::PoolCpu);
    assert_eq!(
        reserve(&a, 3, 1000, 0),
        ReserveOutcome::Reserved,
        "exactly the cap fits"
    );
    let b = open(dir.path(), "0000000b");
    assert_eq!(reserve(&b, 4, 0, 3 * GIB), ReserveOutcome::Reserved);
    match reserve(&b, 5, 0, 2 * GIB) {
        ReserveOutcome::Refused(r) => {
            assert_eq!(
                (r.cap, r.requested, r.used, r.held, r.limit),
                (Cap::PoolMemory, 2 * GIB, 3 * GIB, 0, 4 * GIB)
            )
        }
        other => panic!("{other:?}"),
    }
    // Held capacity counts against the pool.
    let held = res(0, GIB);
    let o = b
        .try_reserve("pool", agent(6), res(0, 1), held, DAY)
        .unwrap();
    assert_eq!(refused_cap(o), Cap::PoolMemory);
}

#[test]
fn instances_coordinate_and_release_returns_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path(), "0000000a");
    let b = open(dir.path(), "0000000b");
    assert_eq!(reserve(&a, 1, 3000, 0), ReserveOutcome::Reserved);
    assert_eq!(refused_cap(reserve(&b, 2, 3000, 0)), Cap::PoolCpu);
    assert_eq!(reserve(&b, 3, 1000, 0), ReserveOutcome::Reserved);
    assert!(a.release("pool", agent(1)).unwrap());
    assert!(!a.release("pool", agent(1)).unwrap(), "idempotent");
    assert_eq!(reserve(&b, 2, 3000, 0), ReserveOutcome::Reserved);
    assert_eq!(b.usage("pool").unwrap().cpu_millis, 4000);
}

#[test]
fn release_only_touches_own_rows() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path(), "0000000a");
    let b = open(dir.path(), "0000000b");
    // Both instances use the same agent id (ids are only unique per
    // instance).
    assert_eq!(reserve(&a, 1, 1000, 0), ReserveOutcome::Reserved);
    assert_eq!(reserve(&b, 1, 1000, 0), ReserveOutcome::Reserved);
    assert!(b.release("pool", agent(1)).unwrap());
    let rows = a.usage("pool").unwrap().rows;
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (rows[0].instance, rows[0].agent),
        (inst("0000000a"), agent(1))
    );
    assert!(
        !b.release("pool", agent(1)).unwrap(),
        "B has nothing left; A's row stays"
    );

    // release_all_own only clears own rows.
    assert_eq!(reserve(&b, 2, 500, 0), ReserveOutcome::Reserved);
    assert_eq!(reserve(&b, 3, 500, 0), ReserveOutcome::Reserved);
    let dropped = b.release_all_own().unwrap();
    assert_eq!(dropped.len(), 2);
    let rows = a.usage("pool").unwrap().rows;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].instance, inst("0000000a"));
}

#[test]
fn unregistered_pool_and_bad_names_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path(), "0000000a");
    let err = a
        .try_reserve("other", agent(1), res(1, 1), Resources::ZERO, DAY)
        .unwrap_err();
    assert!(matches!(err, LedgerError::NotRegistered { .. }), "{err}");
    assert!(err.to_string().contains("not registered"));
    let err = a.register_pools([("../escape", cap4())]).unwrap_err();
    assert!(matches!(err, LedgerError::InvalidPoolName(_)), "{err}");
    let err = a.release("a/b", agent(1)).unwrap_err();
    assert!(matches!(err, LedgerError::InvalidPoolName(_)), "{err}");
    assert!(!dir.path().join("a").exists());
}

#[test]
fn cap_mismatch_with_the_file_is_rejected_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path(), "0000000a");
    assert_eq!(reserve(&a, 1, 1000, 0), ReserveOutcome::Reserved);
    let before = std::fs::read(dir.path().join("pool.json")).unwrap();
    let c = MachineLedger::open_with(Some(dir.path()), inst("0000000c"), fast_options()).unwrap();
    let other = PoolCap {
        max_cpu_millis: Some(8000),
        max_memory_bytes: Some(4 * GIB),
    };
    // All or nothing: a good new pool listed first is not registered either.
    let err = c
        .register_pools([("fresh", cap4()), ("pool", other)])
        .unwrap_err();
    assert!(matches!(err, LedgerError::CapMismatch { .. }), "{err}");
    assert!(err.to_string().contains("cap"), "{err}");
    assert_eq!(c.registered_cap("fresh"), None);
    assert!(!dir.path().join("fresh.json").exists());
    assert_eq!(std::fs::read(dir.path().join("pool.json")).unwrap(), before);

    // Registration creates the file so a mismatching process is refused at
    // start-up, before any reservation.
    c.register_pools([("fresh", cap4())]).unwrap();
    assert!(dir.path().join("fresh.json").exists());
    // A file whose cap changed behind a registered ledger's back.
    let err = a.register_pools([("fresh", other)]).unwrap_err();
    assert!(matches!(err, LedgerError::CapMismatch { .. }));
    // Through Admission: start-up refused.
    let config = ConfigBuilder::new(10)
        .pool("pool", Some(8000), Some(4 * GIB))
        .scaler("s", 5, None, None, Some("pool"))
        .build();
    let d = MachineLedger::open_with(Some(dir.path()), inst("0000000d"), fast_options()).unwrap();
    let err = Admission::new(&config, Some(d)).unwrap_err();
    assert!(err.to_string().contains("cap"), "{err}");
}

#[test]
fn ten_concurrent_one_cpu_reservations_into_four_cpus_grant_exactly_four() {
    let dir = tempfile::tempdir().unwrap();
    let ledgers = [open(dir.path(), "0000000a"), open(dir.path(), "0000000b")];
    let granted = AtomicU64::new(0);
    std::thread::scope(|s| {
        for i in 0..10u32 {
            let l = &ledgers[(i % 2) as usize];
            let granted = &granted;
            s.spawn(move || {
                if reserve(l, i, 1000, 0) == ReserveOutcome::Reserved {
                    granted.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    assert_eq!(granted.load(Ordering::SeqCst), 4);
    let u = ledgers[0].usage("pool").unwrap();
    assert_eq!((u.rows.len(), u.cpu_millis), (4, 4000));
}

#[test]
fn upstream_version_1_files_and_lock_dirs_are_refused_loudly() {
    let dir = tempfile::tempdir().unwrap();
    let v1 = r#"{"version":1,"cap":{"maxCpu":4},"reservations":[{"instanceId":"x","pid":1,"bootId":"b","agentId":"a","cpus":1,"memBytes":0,"reservedAt":0}]}"#;
    std::fs::write(dir.path().join("pool.json"), v1).unwrap();
    let a = MachineLedger::open_with(Some(dir.path()), inst("0000000a"), fast_options()).unwrap();
    let err = a.register_pools([("pool", cap4())]).unwrap_err();
    assert!(matches!(err, LedgerError::ForeignVersion1 { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("version 1") && msg.contains("different"),
        "{msg}"
    );
    let err = a.release("pool", agent(1)).unwrap_err();
    assert!(matches!(err, LedgerError::ForeignVersion1 { .. }), "{err}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("pool.json")).unwrap(),
        v1,
        "untouched"
    );
    // Pools we do not use are skipped by reconciliation, not fatal.
    assert!(a.reconcile_own(&HashSet::new()).unwrap().is_empty());

    std::fs::create_dir(dir.path().join("other.lock")).unwrap();
    let err = a.register_pools([("other", cap4())]).unwrap_err();
    assert!(matches!(err, LedgerError::ForeignLock { .. }), "{err}");

    std::fs::write(dir.path().join("v3.json"), r#"{"version":3}"#).unwrap();
    let err = a.register_pools([("v3", cap4())]).unwrap_err();
    assert!(
        matches!(err, LedgerError::UnsupportedVersion { .. }),
        "{err}"
    );
    std::fs::write(dir.path().join("bad.json"), "{not json").unwrap();
    let err = a.register_pools([("bad", cap4())]).unwrap_err();
    assert!(matches!(err, LedgerError::Corrupt { .. }), "{err}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("bad.json")).unwrap(),
        "{not json"
    );
}

#[test]
fn an_instance_can_be_open_only_once() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path(), "0000000a");
    let err =
        MachineLedger::open_with(Some(dir.path()), inst("0000000a"), fast_options()).unwrap_err();
    assert!(matches!(err, LedgerError::InstanceInUse { .. }), "{err}");
    assert!(err.to_string().contains("already open"), "{err}");
    let clone = a.clone();
    drop(a);
    assert!(
        MachineLedger::open_with(Some(dir.path()), inst("0000000a"), fast_options()).is_err(),
        "a clone keeps the lock"
    );
    drop(clone);
    assert!(MachineLedger::open_with(Some(dir.path()), inst("0000000a"), fast_options()).is_ok());
}

/// A test clock: milliseconds that the test moves by hand.
fn manual_clock(start: u64) -> (Clock, Arc<AtomicU64>) {
    let now = Arc::new(AtomicU64::new(start));
    let n = now.clone();
    (Clock::from_fn(move || n.load(Ordering::SeqCst)), now)
}

fn open_at(dir: &Path, instance: &str, clock: Clock) -> MachineLedger {
    let options = LedgerOptions {
        clock,
        ..fast_options()
    };
    let l = MachineLedger::open_with(Some(dir), inst(instance), options).unwrap();
    l.register_pools([("pool", cap4())]).unwrap();
    l
}

#[test]
fn dead_owners_rows_are_kept_until_they_expire() {
    let dir = tempfile::tempdir().unwrap();
    let (clock, now) = manual_clock(1_000_000);
    let dead = open_at(dir.path(), "0000dead", clock.clone());
    dead.try_reserve(
        "pool",
        agent(1),
        res(3000, 0),
        Resources::ZERO,
        Duration::from_secs(60),
    )
    .unwrap();
    drop(dead);
    let live = open_at(dir.path(), "00000a11", clock.clone());
    live.try_reserve(
        "pool",
        agent(2),
        res(1000, 0),
        Resources::ZERO,
        Duration::from_secs(1),
    )
    .unwrap();
    let watcher = open_at(dir.path(), "0000000b", clock);

    // Not expired: a dead owner's row still counts (its agent may run).
    assert_eq!(refused_cap(reserve(&watcher, 3, 1000, 0)), Cap::PoolCpu);
    assert_eq!(watcher.usage("pool").unwrap().rows.len(), 2);

    // Past both expiries: the dead owner's row is reaped, the live owner's
    // row is kept (a live instance answers for its own rows).
    now.fetch_add(60_001, Ordering::SeqCst);
    let reaped = watcher.reap_expired("pool").unwrap();
    assert_eq!(reaped.len(), 1);
    assert_eq!(
        (reaped[0].pool.as_str(), reaped[0].row.agent),
        ("pool", agent(1))
    );
    let rows = watcher.usage("pool").unwrap().rows;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].instance, inst("00000a11"));
    assert_eq!(reserve(&watcher, 3, 3000, 0), ReserveOutcome::Reserved);

    // Once the live one dies too, try_reserve reaps its expired row itself.
    drop(live);
    assert_eq!(reserve(&watcher, 4, 1000, 0), ReserveOutcome::Reserved);
    assert_eq!(watcher.usage("pool").unwrap().cpu_millis, 4000);
    let report = watcher.maintain();
    assert!(report.errors.is_empty() && report.reaped.is_empty());
}

#[test]
fn reconcile_own_drops_only_this_instances_unkept_rows() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path(), "0000000a");
    a.register_pools([("pool", cap4()), ("second", cap4())])
        .unwrap();
    for i in 1..=3 {
        assert_eq!(reserve(&a, i, 500, 0), ReserveOutcome::Reserved);
    }
    a.try_reserve("second", agent(4), res(500, 0), Resources::ZERO, DAY)
        .unwrap();
    let b = open(dir.path(), "0000000b");
    assert_eq!(reserve(&b, 1, 500, 0), ReserveOutcome::Reserved);
    drop(a); // "crash"

    let a = open(dir.path(), "0000000a");
    let keep: HashSet<AgentId> = [agent(2)].into();
    let mut dropped: Vec<(String, AgentId)> = a
        .reconcile_own(&keep)
        .unwrap()
        .into_iter()
        .map(|d| (d.pool, d.row.agent))
        .collect();
    dropped.sort();
    assert_eq!(
        dropped,
        [
            ("pool".to_owned(), agent(1)),
            ("pool".to_owned(), agent(3)),
            ("second".to_owned(), agent(4))
        ]
    );
    let rows = a.usage("pool").unwrap().rows;
    let mut left: Vec<_> = rows.iter().map(|r| (r.instance, r.agent)).collect();
    left.sort();
    assert_eq!(
        left,
        [(inst("0000000a"), agent(2)), (inst("0000000b"), agent(1))]
    );
    assert!(a.reconcile_own(&keep).unwrap().is_empty(), "idempotent");
}

#[test]
fn a_failed_release_is_queued_and_applied_later() {
    let dir = tempfile::tempdir().unwrap();
    let options = LedgerOptions {
        lock_timeout: Duration::from_millis(10),
        ..fast_options()
    };
    let a = MachineLedger::open_with(Some(dir.path()), inst("0000000a"), options).unwrap();
    a.register_pools([("pool", cap4())]).unwrap();
    assert_eq!(reserve(&a, 1, 4000, 0), ReserveOutcome::Reserved);

    // Someone holds the pool lock (a stopped process).
    let blocker = std::fs::File::open(dir.path().join("pool.lock")).unwrap();
    rustix::fs::flock(&blocker, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let err = a.release("pool", agent(1)).unwrap_err();
    assert!(matches!(err, LedgerError::LockTimeout { .. }), "{err}");
    assert!(err.to_string().contains("timed out"));
    drop(blocker);

    // The row is still on disk, but the next write of the pool applies the
    // queued release first: agent 2 fits.
    assert_eq!(
        a.usage("pool").unwrap().rows.len(),
        0,
        "applied by the next access"
    );
    assert_eq!(reserve(&a, 2, 4000, 0), ReserveOutcome::Reserved);

    // Re-using an id whose release is queued: the new row survives.
    let blocker = std::fs::File::open(dir.path().join("pool.lock")).unwrap();
    rustix::fs::flock(&blocker, rustix::fs::FlockOperation::LockExclusive).unwrap();
    assert!(a.release("pool", agent(2)).is_err());
    drop(blocker);
    assert_eq!(reserve(&a, 2, 1000, 0), ReserveOutcome::Reserved);
    let rows = a.usage("pool").unwrap().rows;
    assert_eq!((rows.len(), rows[0].cpu_millis), (1, 1000));
}

#[test]
fn admission_reserves_and_releases_ledger_rows() {
    let dir = tempfile::tempdir().unwrap();
    let config = ConfigBuilder::new(10)
        .pool("pool", Some(4000), Some(4 * GIB))
        .scaler("s", 10, None, None, Some("pool"))
        .build();
    let other = open(dir.path(), "0000000b");
    assert_eq!(reserve(&other, 9, 2000, 0), ReserveOutcome::Reserved);

    let ledger =
        MachineLedger::open_with(Some(dir.path()), inst("0000000a"), fast_options()).unwrap();
    let adm = Admission::new(&config, Some(ledger.clone())).unwrap();
    let r1 = adm
        .try_reserve(demand(1, "s", 1000, GIB, Some("pool")), &Holds::none())
        .unwrap();
    // The other process's 2000m counts: 1000 + 2000 + 1500 > 4000.
    let err = adm
        .try_reserve(demand(2, "s", 1500, 0, Some("pool")), &Holds::none())
        .unwrap_err();
    match err {
        AdmitError::Refused(r) => assert_eq!((r.cap, r.used, r.limit), (Cap::PoolCpu, 3000, 4000)),
        other => panic!("{other}"),
    }
    assert_eq!(
        adm.usage().global.agents,
        1,
        "the pool refusal reserved nothing"
    );
    assert_eq!(
        adm.usage().pools["pool"].cpu.millis(),
        1000,
        "this process's share"
    );
    let rows = ledger.usage("pool").unwrap().rows;
    assert_eq!(rows.len(), 2);
    let ours = rows
        .iter()
        .find(|r| r.instance == inst("0000000a"))
        .unwrap();
    assert_eq!(
        ours.expires_at_ms - ours.reserved_at_ms,
        24 * 3600 * 1000,
        "maxLifetime of the scaler"
    );

    drop(r1);
    assert_eq!(
        ledger.usage("pool").unwrap().rows.len(),
        1,
        "drop removed our row"
    );
    assert_eq!(adm.usage().global.agents, 0);

    // A ledger failure (here: the file became unreadable) reserves nothing
    // anywhere.
    std::fs::write(dir.path().join("pool.json"), "garbage").unwrap();
    let err = adm
        .try_reserve(demand(3, "s", 100, 0, Some("pool")), &Holds::none())
        .unwrap_err();
    assert!(
        matches!(err, AdmitError::Ledger(LedgerError::Corrupt { .. })),
        "{err}"
    );
    let u = adm.usage();
    assert_eq!((u.global.agents, u.pools["pool"].agents), (0, 0));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("pool.json")).unwrap(),
        "garbage"
    );
}

#[test]
fn admission_drop_releases_counters_even_when_the_ledger_is_stuck() {
    let dir = tempfile::tempdir().unwrap();
    let config = ConfigBuilder::new(10)
        .pool("pool", Some(4000), None)
        .scaler("s", 10, None, None, Some("pool"))
        .build();
    let options = LedgerOptions {
        lock_timeout: Duration::from_millis(10),
        ..fast_options()
    };
    let ledger = MachineLedger::open_with(Some(dir.path()), inst("0000000a"), options).unwrap();
    let adm = Admission::new(&config, Some(ledger.clone())).unwrap();
    let r = adm
        .try_reserve(demand(1, "s", 4000, 0, Some("pool")), &Holds::none())
        .unwrap();
    let blocker = std::fs::File::open(dir.path().join("pool.lock")).unwrap();
    rustix::fs::flock(&blocker, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let mut signal = adm.subscribe_releases();
    drop(r);
    assert!(signal.take_released());
    assert_eq!(adm.usage().global.agents, 0, "in-memory counters released");
    drop(blocker);
    // maintain() retries the queued release.
    let report = ledger.maintain();
    assert!(report.errors.is_empty());
    assert!(ledger.usage("pool").unwrap().rows.is_empty());
    assert!(adm
        .try_reserve(demand(2, "s", 4000, 0, Some("pool")), &Holds::none())
        .is_ok());
}

#[test]
fn adopt_keeps_an_existing_row_and_drop_releases_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = ConfigBuilder::new(10)
        .pool("pool", Some(4000), Some(4 * GIB))
        .scaler("s", 10, None, None, Some("pool"))
        .build();
    let (clock, _now) = manual_clock(5_000);
    let first = open_at(dir.path(), "0000000a", clock.clone());
    first
        .try_reserve("pool", agent(1), res(1000, 0), Resources::ZERO, DAY)
        .unwrap();
    drop(first);

    let (later, _) = manual_clock(9_000);
    let options = LedgerOptions {
        clock: later,
        ..fast_options()
    };
    let ledger = MachineLedger::open_with(Some(dir.path()), inst("0000000a"), options).unwrap();
    let adm = Admission::new(&config, Some(ledger.clone())).unwrap();
    ledger.reconcile_own(&[agent(1)].into()).unwrap();
    let r = adm.adopt(demand(1, "s", 1000, 0, Some("pool"))).unwrap();
    let rows = ledger.usage("pool").unwrap().rows;
    assert_eq!(
        (rows.len(), rows[0].reserved_at_ms),
        (1, 5_000),
        "the original row is kept"
    );
    // Adopting an agent whose row was lost restores it.
    let r2 = adm.adopt(demand(2, "s", 500, 0, Some("pool"))).unwrap();
    assert_eq!(ledger.usage("pool").unwrap().cpu_millis, 1500);
    drop((r, r2));
    assert!(ledger.usage("pool").unwrap().rows.is_empty());
}
