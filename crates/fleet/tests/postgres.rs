//! The fleet layer against a real PostgreSQL (`KICI_SCALER_TEST_POSTGRES`,
//! or the server `scripts/postgres.sh start` runs; never skipped). Each test
//! has a database of its own, so they run in parallel.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kici_fleet::{
    Adopted, Caps, Enqueued, Entered, Fleet, FleetError, FleetOptions, RequestKind, RequestState,
};
use kici_model::MilliCpu;
use sqlx::Row;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(60);

/// 8 hosts, each with its own connection pool, claim 300 requests of three
/// pools under tight caps (per pool and global) while a sampler checks the
/// usage inside the database, in one statement, all along: no cap is ever
/// exceeded, each request is claimed exactly once, and claims within a pool
/// follow arrival order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claimers_never_exceed_fleet_caps() {
    const REQUESTS: usize = 300;
    const GLOBAL_MAX: i64 = 8;
    let db = TestDb::new().await;
    let fleet_name = "caps";
    let pool_a = pool("a", max_agents(3));
    let pool_b = pool(
        "b",
        Caps {
            max_agents: Some(4),
            max_cpu: Some(MilliCpu::from_millis(2000)),
            max_memory: None,
        },
    );
    let pool_c = pool("c", Caps::default());
    let caps: BTreeMap<&str, (i64, Option<i64>)> = BTreeMap::from([
        ("a", (3, None)),
        ("b", (4, Some(2000))),
        ("c", (i64::MAX, None)),
    ]);

    let mut hosts = Vec::new();
    for n in 0..8u32 {
        let fleet = Fleet::connect(
            &db.url,
            fleet_name,
            FleetOptions {
                max_connections: 1,
                ..FleetOptions::default()
            },
        )
        .await
        .unwrap();
        let pools = if n < 4 {
            vec![pool_a.clone(), pool_b.clone(), pool_c.clone()]
        } else {
            vec![pool_b.clone(), pool_a.clone()]
        };
        let mut s = spec(n + 1, pools, LONG);
        s.global_caps = Caps {
            max_agents: Some(u32::try_from(GLOBAL_MAX).unwrap()),
            ..Caps::default()
        };
        let m = fleet.join(s).await.unwrap();
        hosts.push((fleet, m));
    }

    let entry = db.fleet(fleet_name).await;
    let q = entry.queue();
    for i in 0..REQUESTS {
        let pool = ["a", "b", "c"][i % 3];
        let cpu = if i % 2 == 0 { 500 } else { 1000 };
        let r = q
            .enqueue(&request(&format!("job-{i:04}"), pool, cpu))
            .await
            .unwrap();
        assert!(matches!(r, Enqueued::New { .. }));
    }

    let done = Arc::new(AtomicBool::new(false));
    let finished = Arc::new(AtomicUsize::new(0));
    let claims = Arc::new(Mutex::new(Vec::<(String, i64, i64, String)>::new()));

    // The sampler: one statement, so one snapshot, per sample.
    let sampler = {
        let done = done.clone();
        let mut conn = db.conn().await;
        let caps = caps.clone();
        tokio::spawn(async move {
            let mut samples = 0u64;
            let mut peak: BTreeMap<String, i64> = BTreeMap::new();
            let mut peak_total = 0i64;
            while !done.load(Ordering::SeqCst) {
                let rows = sqlx::query(
                    "SELECT pool, count(*) AS n, COALESCE(sum(milli_cpu), 0)::BIGINT AS cpu FROM ( \
                       SELECT pool, milli_cpu FROM fleet_requests WHERE fleet = $1 AND state = 'claimed' \
                       UNION ALL \
                       SELECT pool, milli_cpu FROM fleet_agents WHERE fleet = $1 AND state = 'live') u \
                     GROUP BY pool",
                )
                .bind("caps")
                .fetch_all(&mut conn)
                .await
                .unwrap();
                let mut total = 0;
                for r in rows {
                    let pool: String = r.get("pool");
                    let n: i64 = r.get("n");
                    let cpu: i64 = r.get("cpu");
                    let (max_n, max_cpu) = caps[pool.as_str()];
                    assert!(n <= max_n, "pool {pool}: {n} agents > cap {max_n}");
                    if let Some(m) = max_cpu {
                        assert!(cpu <= m, "pool {pool}: {cpu}m cpu > cap {m}m");
                    }
                    let p = peak.entry(pool).or_default();
                    *p = (*p).max(n);
                    total += n;
                }
                assert!(
                    total <= GLOBAL_MAX,
                    "fleet: {total} agents > global cap {GLOBAL_MAX}"
                );
                peak_total = peak_total.max(total);
                samples += 1;
            }
            (samples, peak, peak_total)
        })
    };

    // The leader's chores run all along: with every host alive they must
    // change nothing (and not deadlock with claims).
    let chores = {
        let done = done.clone();
        let mut leader = entry.leader(id(1));
        tokio::spawn(async move {
            assert!(leader.try_lead().await.unwrap());
            let mut rounds = 0;
            while !done.load(Ordering::SeqCst) {
                let r = leader.run_chores(LONG).await.unwrap();
                assert!(r.lost_hosts.is_empty() && r.requeued.is_empty(), "{r:?}");
                rounds += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            leader.step_down().await;
            rounds
        })
    };

    let mut tasks = Vec::new();
    for (n, (fleet, m)) in hosts.into_iter().enumerate() {
        let finished = finished.clone();
        let claims = claims.clone();
        tasks.push(tokio::spawn(async move {
            let q = fleet.queue();
            let pools: Vec<String> = m.spec().pools.iter().map(|p| p.name.clone()).collect();
            let mut k = 0u64;
            while finished.load(Ordering::SeqCst) < REQUESTS {
                let Some(c) = q.claim(m.guard(), &pools).await.unwrap() else {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                };
                claims
                    .lock()
                    .unwrap()
                    .push((c.pool.clone(), c.seq, c.claim_seq, c.job_id.clone()));
                k += 1;
                // Most claims start an agent; some finish straight from the
                // claim (an agent that failed to start, say).
                if !k.is_multiple_of(5) {
                    q.start(m.guard(), &c, &format!("agent-{n}-{k}"))
                        .await
                        .unwrap();
                }
                // Agents live a while, so the caps bind — long enough
                // beside a claim transaction that every host holds one at
                // once even on a loaded machine (the peak is sampled).
                tokio::time::sleep(Duration::from_millis(30 + k % 10)).await;
                assert!(q.complete(m.instance(), &c.job_id, "ok").await.unwrap());
                finished.fetch_add(1, Ordering::SeqCst);
            }
            m.leave().await.unwrap();
            fleet.close().await;
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    done.store(true, Ordering::SeqCst);
    let (samples, peak, peak_total) = sampler.await.unwrap();
    assert!(chores.await.unwrap() > 0);
    eprintln!("samples {samples}, peak per pool {peak:?}, peak total {peak_total}");
    assert!(samples > 10, "the sampler ran only {samples} times");
    assert_eq!(peak.get("a"), Some(&3), "pool a never reached its cap");
    assert_eq!(peak_total, GLOBAL_MAX, "the global cap was never reached");

    let claims = claims.lock().unwrap().clone();
    assert_eq!(claims.len(), REQUESTS);
    let unique: HashSet<&String> = claims.iter().map(|c| &c.3).collect();
    assert_eq!(unique.len(), REQUESTS, "a request was claimed twice");
    for p in ["a", "b", "c"] {
        let mut in_pool: Vec<_> = claims.iter().filter(|c| c.0 == p).collect();
        in_pool.sort_by_key(|c| c.2);
        for w in in_pool.windows(2) {
            assert!(
                w[0].1 < w[1].1,
                "pool {p}: claimed out of arrival order: {w:?}"
            );
        }
    }
    let not_once: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fleet_requests WHERE fleet = 'caps' AND (claims <> 1 OR state <> 'finished')",
    )
    .fetch_one(entry.pool())
    .await
    .unwrap();
    assert_eq!(not_once, 0);
    entry.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// A host stops renewing: its own fence closes before its lease ends; the
/// leader declares it lost and returns its unstarted claims in their
/// original order; another host claims them, in that order, before the
/// later arrivals; the lost host's agent is reported lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lapsed_lease_returns_claims_in_order_to_another_host() {
    let db = TestDb::new().await;
    let fleet = db.fleet("lapse").await;
    let p = vec![pool("p", Caps::default())];
    let short = Duration::from_secs(3);
    let a = join(&fleet, 1, p.clone(), short).await;
    let b = join(&fleet, 2, p.clone(), LONG).await;
    let q = fleet.queue();
    for i in 0..6 {
        q.enqueue(&request(&format!("j{i}"), "p", 100))
            .await
            .unwrap();
    }
    let pools = vec!["p".to_owned()];
    let first = q.claim(a.guard(), &pools).await.unwrap().unwrap();
    q.start(a.guard(), &first, "agent-a-0").await.unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(q.claim(a.guard(), &pools).await.unwrap().unwrap());
    }
    assert_eq!(
        held.iter().map(|c| c.job_id.as_str()).collect::<Vec<_>>(),
        ["j1", "j2", "j3"]
    );
    // B takes j4 meanwhile; j5 stays queued.
    assert_eq!(
        q.claim(b.guard(), &pools).await.unwrap().unwrap().job_id,
        "j4"
    );

    // A stops renewing. Its fence closes at lease − margin (2 s after its
    // join was sent), a margin before the database's lease (3 s) ends.
    let t = Instant::now();
    while a.guard().is_valid() {
        assert!(
            t.elapsed() < Duration::from_secs(4),
            "the fence never closed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(matches!(
        q.claim(a.guard(), &pools).await,
        Err(FleetError::LeaseLapsed { .. })
    ));
    assert!(matches!(
        q.start(a.guard(), &held[0], "agent-a-1").await,
        Err(FleetError::LeaseLapsed { .. })
    ));
    let mut leader = fleet.leader(id(2));
    assert!(leader.try_lead().await.unwrap());
    // Not yet expired in the database: nothing to do.
    let early = leader.run_chores(LONG).await.unwrap();
    assert!(early.lost_hosts.is_empty(), "{early:?}");
    let report = loop {
        let r = leader.run_chores(LONG).await.unwrap();
        if !r.lost_hosts.is_empty() {
            break r;
        }
        assert!(
            t.elapsed() < Duration::from_secs(6),
            "A was never declared lost"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(report.lost_hosts.len(), 1);
    assert_eq!(report.lost_hosts[0].instance_id, id(1).to_string());
    let mut requeued = report.requeued.clone();
    requeued.sort();
    assert_eq!(requeued, ["j1", "j2", "j3"]);
    assert_eq!(report.lost_agents.len(), 1);
    assert_eq!(report.lost_agents[0].agent_id, "agent-a-0");
    assert_eq!(report.lost_agents[0].job_id.as_deref(), Some("j0"));
    assert_eq!(
        q.state("j0").await.unwrap(),
        Some((RequestState::Lost, Some(id(1).to_string())))
    );

    // B gets A's claims back in their original order, then the later arrival.
    let mut order = Vec::new();
    while let Some(c) = q.claim(b.guard(), &pools).await.unwrap() {
        order.push(c.job_id);
    }
    assert_eq!(order, ["j1", "j2", "j3", "j5"]);

    // A notices: its renewal fails; it rejoins under a new epoch, and its
    // old claim cannot be started.
    assert!(matches!(a.renew().await, Err(FleetError::LeaseLost { .. })));
    let mut a = a;
    let old_epoch = held[0].epoch;
    assert!(a.rejoin().await.unwrap() > old_epoch);
    assert!(matches!(
        q.start(a.guard(), &held[0], "agent-a-1").await,
        Err(FleetError::StaleEpoch { .. })
    ));
    // The lost agent: its host, back, takes it over under the new epoch
    // (say it had registered and kept its job)...
    assert_eq!(
        q.adopt(a.guard(), "agent-a-0").await.unwrap(),
        Adopted::Live
    );
    assert_eq!(
        q.state("j0").await.unwrap(),
        Some((RequestState::Started, Some(id(1).to_string())))
    );
    // B's five claims and the adopted agent.
    assert_eq!(q.pool_usage("p").await.unwrap().agents, 6);
    // ...or puts its request back to be served again (it had not).
    assert!(q.requeue(&id(1).to_string(), "j0").await.unwrap());
    assert_eq!(
        q.claim(b.guard(), &pools).await.unwrap().unwrap().job_id,
        "j0"
    );
    // The request moved: the agent is not A's to keep.
    assert_eq!(
        q.adopt(a.guard(), "agent-a-0").await.unwrap(),
        Adopted::NotOurs
    );
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// Two memberships with one instance id (the host rejoined from a second
/// process): the older epoch's claims are returned at the new join, and
/// every claim, start or renewal under the older epoch is refused by the
/// database.
#[tokio::test]
async fn stale_epoch_claim_is_refused() {
    let db = TestDb::new().await;
    let fleet = db.fleet("epochs").await;
    let p = vec![pool("p", Caps::default())];
    let q = fleet.queue();
    let pools = vec!["p".to_owned()];
    q.enqueue(&request("j0", "p", 100)).await.unwrap();
    q.enqueue(&request("j1", "p", 100)).await.unwrap();
    let old = join(&fleet, 7, p.clone(), LONG).await;
    let claim = q.claim(old.guard(), &pools).await.unwrap().unwrap();
    assert_eq!(claim.job_id, "j0");
    let new = join(&fleet, 7, p.clone(), LONG).await;
    assert_eq!(new.epoch(), old.epoch() + 1);
    assert_eq!(
        q.state("j0").await.unwrap(),
        Some((RequestState::Queued, None))
    );

    match q.claim(old.guard(), &pools).await {
        Err(FleetError::StaleEpoch { held, current, .. }) => {
            assert_eq!(held, old.epoch());
            assert_eq!(current, Some(new.epoch()));
        }
        other => panic!("expected StaleEpoch, got {other:?}"),
    }
    assert!(matches!(
        q.start(old.guard(), &claim, "agent-x").await,
        Err(FleetError::StaleEpoch { .. })
    ));
    // An entry under the old epoch is refused too, and writes nothing.
    match q
        .enqueue_started(old.guard(), &request("j9", "p", 100), "agent-z")
        .await
    {
        Err(FleetError::StaleEpoch { held, current, .. }) => {
            assert_eq!(held, old.epoch());
            assert_eq!(current, Some(new.epoch()));
        }
        other => panic!("expected StaleEpoch, got {other:?}"),
    }
    assert_eq!(q.state("j9").await.unwrap(), None, "nothing written");
    assert!(matches!(
        old.renew().await,
        Err(FleetError::LeaseLost { .. })
    ));
    assert!(!old.guard().is_valid());
    // The current epoch claims j0 again, first.
    let again = q.claim(new.guard(), &pools).await.unwrap().unwrap();
    assert_eq!((again.job_id.as_str(), again.epoch), ("j0", new.epoch()));
    new.renew().await.unwrap();
    q.start(new.guard(), &again, "agent-y").await.unwrap();
    // A release of the stale claim changes nothing.
    assert!(!q.release(&claim).await.unwrap());
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// The leader's session dies (terminated by the server): another candidate
/// takes leadership; the old leader finds it lost and cannot take it back
/// while the new one holds it; a clean step-down hands it over at once.
#[tokio::test]
async fn leadership_moves_when_the_leaders_session_dies() {
    let db = TestDb::new().await;
    // Two hosts: two handles, each with its own session.
    let fleet = db.fleet("lead").await;
    let fleet_b = db.fleet("lead").await;
    let _a = join(&fleet, 1, vec![], LONG).await;
    let _b = join(&fleet_b, 2, vec![], LONG).await;
    let mut la = fleet.leader(id(1));
    let mut lb = fleet_b.leader(id(2));
    assert!(la.try_lead().await.unwrap());
    assert!(!lb.try_lead().await.unwrap());
    assert!(la.try_lead().await.unwrap(), "a leader keeps leading");
    let leaders = |hosts: Vec<kici_fleet::HostStatus>| {
        hosts
            .into_iter()
            .filter(|h| h.leader)
            .map(|h| h.instance_id)
            .collect::<Vec<_>>()
    };
    assert_eq!(leaders(_a.hosts().await.unwrap()), [id(1).to_string()]);

    let pid = la.session_pid().await.unwrap();
    let mut admin = db.conn().await;
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert!(killed);
    let start = Instant::now();
    while !lb.try_lead().await.unwrap() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "leadership did not move"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !la.try_lead().await.unwrap(),
        "the old leader took leadership back"
    );
    assert!(!la.is_leader());
    assert_eq!(leaders(_a.hosts().await.unwrap()), [id(2).to_string()]);

    lb.step_down().await;
    let start = Instant::now();
    while !la.try_lead().await.unwrap() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "step-down did not free leadership"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fleet.close().await;
    fleet_b.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// A database migrated by a newer binary is refused with a clear error.
#[tokio::test]
async fn schema_newer_than_binary_is_refused() {
    let db = TestDb::new().await;
    let fleet = db.fleet("schema").await;
    // Connecting again is a no-op migration.
    db.fleet("schema").await.close().await;
    sqlx::query(
        "INSERT INTO fleet_schema_versions (version, description) VALUES (999, 'from the future')",
    )
    .execute(fleet.pool())
    .await
    .unwrap();
    match Fleet::connect(&db.url, "schema", FleetOptions::default()).await {
        Err(
            e @ FleetError::SchemaTooNew {
                database: 999,
                binary,
            },
        ) => {
            assert_eq!(binary, kici_fleet::SCHEMA_VERSION);
            assert!(e.to_string().contains("newer than this binary"), "{e}");
        }
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// Concurrent first connections migrate once (the lock), and agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_apply_once() {
    let db = TestDb::new().await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let url = db.url.clone();
        tasks.push(tokio::spawn(async move {
            Fleet::connect(&url, "m", FleetOptions::default())
                .await
                .unwrap()
        }));
    }
    for t in tasks {
        t.await.unwrap().close().await;
    }
    let mut c = db.conn().await;
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM fleet_schema_versions")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert_eq!(n, kici_fleet::SCHEMA_VERSION);
    drop(c);
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// A pool defined differently from the live hosts' definition is refused,
/// naming the pool, the hosts and what differs; so are different global
/// caps. Once the other host is gone, the new definition is accepted.
#[tokio::test]
async fn pool_definition_mismatch_is_refused() {
    let db = TestDb::new().await;
    let fleet = db.fleet("defs").await;
    let a = join(
        &fleet,
        1,
        vec![pool("fc", Caps::default()), pool("ct", Caps::default())],
        LONG,
    )
    .await;

    let mut other_labels = pool("fc", Caps::default());
    other_labels.label_sets = serde_json::json!([{"labels": ["linux", "arm64"]}]);
    match fleet
        .join(spec(
            2,
            vec![other_labels.clone(), pool("ct", Caps::default())],
            LONG,
        ))
        .await
    {
        Err(e @ FleetError::PoolMismatch(_)) => {
            let FleetError::PoolMismatch(m) = &e else {
                unreachable!()
            };
            assert_eq!(m.len(), 1);
            assert_eq!(m[0].pool, "fc");
            assert_eq!(m[0].hosts, [format!("{} (host-1)", id(1))]);
            assert!(
                m[0].difference.contains("label sets differ"),
                "{}",
                m[0].difference
            );
            assert!(m[0].difference.contains("arm64"), "{}", m[0].difference);
            let text = e.to_string();
            assert!(
                text.contains("pool `fc`") && text.contains("host-1"),
                "{text}"
            );
        }
        other => panic!("expected PoolMismatch, got {other:?}"),
    }
    match fleet
        .join(spec(2, vec![pool("fc", max_agents(4))], LONG))
        .await
    {
        Err(FleetError::PoolMismatch(m)) => {
            assert!(
                m[0].difference.contains("fleet caps differ"),
                "{}",
                m[0].difference
            );
            assert!(
                !m[0].difference.contains("label sets"),
                "{}",
                m[0].difference
            );
        }
        other => panic!("expected PoolMismatch, got {other:?}"),
    }
    let mut capped = spec(2, vec![pool("fc", Caps::default())], LONG);
    capped.global_caps = max_agents(10);
    assert!(matches!(
        fleet.join(capped).await,
        Err(FleetError::GlobalCapsMismatch { .. })
    ));
    // The refused host left nothing behind.
    assert_eq!(a.hosts().await.unwrap().len(), 1);
    // The same definition joins fine, in another order of keys.
    let b = join(&fleet, 3, vec![pool("fc", Caps::default())], LONG).await;
    b.leave().await.unwrap();

    a.leave().await.unwrap();
    let c = join(&fleet, 2, vec![other_labels], LONG).await;
    let fp: String = sqlx::query_scalar(
        "SELECT fingerprint FROM fleet_pools WHERE fleet = 'defs' AND pool = 'fc'",
    )
    .fetch_one(fleet.pool())
    .await
    .unwrap();
    assert_eq!(fp, c.spec().pools[0].fingerprint());
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// Dedupe by job id, fleet-wide: the same body gets the first answer, a
/// different body a conflict; concurrent duplicates write one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedupe_by_job_id() {
    let db = TestDb::new().await;
    let fleet = db.fleet("dedupe").await;
    let other_fleet = db.fleet("dedupe-2").await;
    let q = fleet.queue();
    let r = request("job-1", "p", 100);
    assert!(matches!(q.enqueue(&r).await.unwrap(), Enqueued::New { .. }));
    match q.enqueue(&r).await.unwrap() {
        Enqueued::Existing { answer, state } => {
            assert_eq!(answer, r.answer);
            assert_eq!(state, RequestState::Queued);
        }
        other => panic!("expected Existing, got {other:?}"),
    }
    let mut changed = r.clone();
    changed.body = r#"{"jobId":"job-1","labels":["other"]}"#.into();
    changed.answer = "ignored".into();
    assert!(matches!(
        q.enqueue(&changed).await,
        Err(FleetError::Conflict { job_id }) if job_id == "job-1"
    ));
    // Another fleet in the same database has its own job ids.
    assert!(matches!(
        other_fleet.queue().enqueue(&changed).await.unwrap(),
        Enqueued::New { .. }
    ));

    let mut tasks = Vec::new();
    for _ in 0..8 {
        let q = q.clone();
        tasks.push(tokio::spawn(async move {
            q.enqueue(&request("job-2", "p", 100)).await.unwrap()
        }));
    }
    let mut new = 0;
    for t in tasks {
        if matches!(t.await.unwrap(), Enqueued::New { .. }) {
            new += 1;
        }
    }
    assert_eq!(new, 1);
    fleet.close().await;
    other_fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// Handover: a leaving host's unstarted claims are back in the queue at
/// once, in order, and it claims nothing more; its renewals keep its lease
/// (its agents still run) without reopening the fence.
#[tokio::test]
async fn hand_back_returns_claims_at_once() {
    let db = TestDb::new().await;
    let fleet = db.fleet("handover").await;
    let p = vec![pool("p", Caps::default())];
    let a = join(&fleet, 1, p.clone(), LONG).await;
    let b = join(&fleet, 2, p.clone(), LONG).await;
    let q = fleet.queue();
    let pools = vec!["p".to_owned()];
    for i in 0..4 {
        q.enqueue(&request(&format!("h{i}"), "p", 100))
            .await
            .unwrap();
    }
    let started = q.claim(a.guard(), &pools).await.unwrap().unwrap();
    q.start(a.guard(), &started, "agent-a").await.unwrap();
    q.claim(a.guard(), &pools).await.unwrap().unwrap();
    q.claim(a.guard(), &pools).await.unwrap().unwrap();
    let mut back = a.hand_back().await.unwrap();
    back.sort();
    assert_eq!(back, ["h1", "h2"]);
    assert!(matches!(
        q.claim(a.guard(), &pools).await,
        Err(FleetError::LeaseLapsed { .. })
    ));
    a.renew().await.unwrap();
    assert!(!a.guard().is_valid());
    let mut order = Vec::new();
    while let Some(c) = q.claim(b.guard(), &pools).await.unwrap() {
        order.push(c.job_id);
    }
    assert_eq!(order, ["h1", "h2", "h3"]);
    // The leaving host finishes its running agent's request.
    assert!(q.complete(a.instance(), "h0", "ok").await.unwrap());
    a.leave().await.unwrap();
    let states: Vec<String> = b
        .hosts()
        .await
        .unwrap()
        .into_iter()
        .map(|h| h.state)
        .collect();
    assert!(states.contains(&"left".to_owned()), "{states:?}");
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// The waker returns at once on an arrival in its pools, ignores other
/// pools and fleets, and otherwise returns within the fallback poll. Every
/// step is bounded: a hang fails naming the step instead of stalling until
/// the runner's timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waker_wakes_on_arrival_and_polls_otherwise() {
    async fn step<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(20), f)
            .await
            .unwrap_or_else(|_| panic!("{what}: did not finish within 20 s"))
    }
    let db = step("create the database", TestDb::new()).await;
    let fleet = step("connect the fleet", db.fleet("wake")).await;
    let other = step("connect the other fleet", db.fleet("wake-other")).await;
    let mut waker = fleet.waker(&["p".to_owned()]);

    let t = Instant::now();
    assert!(
        !step("the idle wait", waker.wait()).await,
        "woken with nothing sent"
    );
    let idle = t.elapsed();
    assert!(
        idle >= Duration::from_millis(900) && idle < Duration::from_millis(1500),
        "{idle:?}"
    );

    let q = fleet.queue();
    let oq = other.queue();
    let send = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        q.enqueue(&request("w-other-pool", "z", 1)).await.unwrap();
        oq.enqueue(&request("w-other-fleet", "p", 1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        q.enqueue(&request("w1", "p", 1)).await.unwrap();
    });
    let t = Instant::now();
    assert!(step("the wait for an arrival", waker.wait()).await);
    let woke = t.elapsed();
    assert!(
        woke >= Duration::from_millis(180) && woke < Duration::from_millis(800),
        "{woke:?}"
    );
    step("the enqueues", send).await.unwrap();
    drop(waker);
    step("close the fleet", fleet.close()).await;
    step("close the other fleet", other.close()).await;
    step("drop the database", db.drop_db()).await;
}

/// Purge: finished requests and departed hosts older than the retention go.
#[tokio::test]
async fn chores_purge_old_rows() {
    let db = TestDb::new().await;
    let fleet = db.fleet("purge").await;
    let p = vec![pool("p", Caps::default())];
    let a = join(&fleet, 1, p.clone(), LONG).await;
    let q = fleet.queue();
    q.enqueue(&request("old", "p", 1)).await.unwrap();
    let c = q
        .claim(a.guard(), &["p".to_owned()])
        .await
        .unwrap()
        .unwrap();
    q.start(a.guard(), &c, "agent-old").await.unwrap();
    assert!(q.complete(a.instance(), "old", "ok").await.unwrap());
    let b = join(&fleet, 2, p.clone(), LONG).await;
    a.leave().await.unwrap();
    let mut leader = fleet.leader(id(2));
    assert!(leader.try_lead().await.unwrap());
    let kept = leader.run_chores(LONG).await.unwrap();
    assert_eq!(kept.purged, 0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let report = leader.run_chores(Duration::from_millis(1)).await.unwrap();
    assert_eq!(report.purged, 3, "{report:?}"); // request, agent, host
    assert_eq!(q.state("old").await.unwrap(), None);
    assert_eq!(b.hosts().await.unwrap().len(), 1);
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// A request whose host was lost and that nobody requeued or finished is
/// finished `host lost` once the retention has passed.
#[tokio::test]
async fn lost_requests_are_abandoned_after_the_retention() {
    let db = TestDb::new().await;
    let fleet = db.fleet("abandon").await;
    let p = vec![pool("p", Caps::default())];
    let a = join(&fleet, 1, p.clone(), Duration::from_millis(600)).await;
    let q = fleet.queue();
    q.enqueue(&request("gone", "p", 1)).await.unwrap();
    let c = q
        .claim(a.guard(), &["p".to_owned()])
        .await
        .unwrap()
        .unwrap();
    q.start(a.guard(), &c, "agent-gone").await.unwrap();
    let mut leader = fleet.leader(id(2));
    assert!(leader.try_lead().await.unwrap());
    let t = Instant::now();
    let mut lost = Vec::new();
    let abandoned = loop {
        let r = leader.run_chores(Duration::from_millis(100)).await.unwrap();
        lost.extend(r.lost_agents);
        if !r.abandoned.is_empty() {
            break r.abandoned;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "never abandoned");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(abandoned, ["gone"]);
    assert_eq!(lost.len(), 1);
    assert_eq!(
        q.state("gone").await.unwrap(),
        Some((RequestState::Finished, Some(id(1).to_string())))
    );
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// A standalone job whose agent registered on a host that is then lost is
/// finished `host lost` by the same chores (never run twice; the host, if
/// it returns, cannot adopt it); one whose agent never registered stays
/// for the daemon to requeue. A job's secret is handed over with the claim
/// and erased when it finishes; `held` lists what a host holds with an
/// agent.
#[tokio::test]
async fn lost_hosts_jobs_that_ran_are_aborted_and_secrets_do_not_outlive_them() {
    let db = TestDb::new().await;
    let fleet = db.fleet("jobs-lost").await;
    let p = vec![pool("p", Caps::default())];
    let a = join(&fleet, 1, p.clone(), Duration::from_millis(600)).await;
    let q = fleet.queue();
    let job = |name: &str| {
        let mut r = request(name, "p", 1);
        r.kind = RequestKind::Job;
        r.secret = Some(format!(r#"{{"TOKEN":"{name}"}}"#));
        r
    };
    for name in ["ran", "unstarted"] {
        q.enqueue(&job(name)).await.unwrap();
        let c = q
            .claim(a.guard(), &["p".to_owned()])
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.job_id, name);
        assert_eq!(
            c.secret.as_deref(),
            Some(&*format!(r#"{{"TOKEN":"{name}"}}"#))
        );
        q.start(a.guard(), &c, &format!("agent-{name}"))
            .await
            .unwrap();
    }
    assert!(q
        .mark_registered(&id(1).to_string(), "agent-ran")
        .await
        .unwrap());
    let held: Vec<String> = q
        .held(&id(1).to_string())
        .await
        .unwrap()
        .into_iter()
        .map(|h| h.job_id)
        .collect();
    assert_eq!(held, ["ran", "unstarted"]);
    let secret = |name: &'static str| {
        let pool = fleet.pool().clone();
        async move {
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT secret FROM fleet_requests WHERE job_id = $1",
            )
            .bind(name)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert!(secret("ran").await.is_some());
    let mut leader = fleet.leader(id(2));
    assert!(leader.try_lead().await.unwrap());
    let t = Instant::now();
    let report = loop {
        let r = leader.run_chores(LONG).await.unwrap();
        if !r.lost_hosts.is_empty() {
            break r;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "never lost");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(report.aborted_jobs, ["ran"]);
    let ran = q.lookup("ran").await.unwrap().unwrap();
    assert_eq!(ran.state, RequestState::Finished);
    assert_eq!(ran.outcome.as_deref(), Some(kici_fleet::HOST_LOST));
    assert_eq!(secret("ran").await, None, "a finished job keeps no secret");
    assert_eq!(
        q.state("unstarted").await.unwrap().map(|s| s.0),
        Some(RequestState::Lost)
    );
    assert!(q.requeue(&id(1).to_string(), "unstarted").await.unwrap());
    assert!(
        secret("unstarted").await.is_some(),
        "kept for the next host"
    );
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// Requests that waited past their time are finished `expired` (a job's
/// secret erased); younger ones, and claimed ones, stay.
#[tokio::test]
async fn queued_requests_expire_after_their_time() {
    let db = TestDb::new().await;
    let fleet = db.fleet("expire").await;
    let p = vec![pool("p", Caps::default())];
    let a = join(&fleet, 1, p.clone(), LONG).await;
    let q = fleet.queue();
    let mut old = request("old", "p", 1);
    old.kind = RequestKind::Job;
    old.secret = Some("{}".into());
    q.enqueue(&old).await.unwrap();
    q.enqueue(&request("mid", "p", 1)).await.unwrap();
    let held = q
        .claim(a.guard(), &["p".to_owned()])
        .await
        .unwrap()
        .unwrap();
    assert_eq!(held.job_id, "old");
    q.enqueue(&request("young", "p", 1)).await.unwrap();
    // "old" and "mid" arrived an hour ago (by the database's clock).
    sqlx::query(
        "UPDATE fleet_requests SET arrived_at = arrived_at - 3600000 WHERE job_id IN ('old', 'mid')",
    )
    .execute(fleet.pool())
    .await
    .unwrap();
    let mut leader = fleet.leader(id(2));
    assert!(leader.try_lead().await.unwrap());
    // Claimed requests and young ones stay.
    let window = Duration::from_secs(600);
    assert_eq!(leader.expire_queued(window).await.unwrap(), ["mid"]);
    let mid = q.lookup("mid").await.unwrap().unwrap();
    assert_eq!(mid.state, RequestState::Finished);
    assert_eq!(mid.outcome.as_deref(), Some(kici_fleet::EXPIRED));
    assert_eq!(
        q.state("young").await.unwrap().map(|s| s.0),
        Some(RequestState::Queued)
    );
    // Given back, it waited since its arrival: it expires too, secret and
    // all.
    q.release(&held).await.unwrap();
    assert_eq!(leader.expire_queued(window).await.unwrap(), ["old"]);
    let secrets: i64 =
        sqlx::query_scalar("SELECT count(*) FROM fleet_requests WHERE secret IS NOT NULL")
            .fetch_one(fleet.pool())
            .await
            .unwrap();
    assert_eq!(secrets, 0);
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// What the daemon spawns must be `Send` futures (checked at compile
/// time; never called).
#[allow(dead_code)]
fn futures_are_spawnable(
    fleet: Fleet,
    mut m: kici_fleet::Membership,
    claim: kici_fleet::Claim,
    mut w: kici_fleet::Waker,
) {
    fn send<T: Send>(_: T) {}
    let q = fleet.queue();
    let mut leader = fleet.leader(id(1));
    send(Fleet::connect("", "", FleetOptions::default()));
    send(fleet.join(spec(1, vec![], LONG)));
    send(fleet.waker(&[]));
    send(m.renew());
    send(m.rejoin());
    send(m.hand_back());
    send(q.enqueue(&request("j", "p", 1)));
    send(q.claim(m.guard(), &[]));
    send(q.start(m.guard(), &claim, "a"));
    send(q.release(&claim));
    send(q.adopt(m.guard(), "a"));
    send(q.complete("", "", ""));
    send(q.requeue("", ""));
    send(q.pool_loads(""));
    send(leader.try_lead());
    send(leader.run_chores(LONG));
    send(w.wait());
    send(m.leave());
}

/// The entry host's one-transaction path: the head of its pool under the
/// caps is written started with the caller's agent; behind an older queued
/// request, or at a cap, it is only queued; a repeat is `Existing`.
#[tokio::test]
async fn enqueue_started_starts_only_the_head_under_the_caps() {
    let db = TestDb::new().await;
    let fleet = db.fleet("entry").await;
    let a = join(&fleet, 1, vec![pool("p", max_agents(2))], LONG).await;
    let q = fleet.queue();
    let first = request("e1", "p", 100);
    assert!(matches!(
        q.enqueue_started(a.guard(), &first, "agent-1")
            .await
            .unwrap(),
        Entered::Started { .. }
    ));
    assert_eq!(
        q.lookup("e1").await.unwrap().unwrap().agent_id.as_deref(),
        Some("agent-1")
    );
    assert_eq!(q.pool_usage("p").await.unwrap().agents, 1);
    assert!(matches!(
        q.enqueue_started(a.guard(), &first, "agent-x")
            .await
            .unwrap(),
        Entered::Existing {
            state: RequestState::Started,
            ..
        }
    ));
    // An older request waits: the new one queues behind it (FIFO), and the
    // entry host, which has room, claims the older one instead.
    assert!(matches!(
        q.enqueue(&request("e2", "p", 100)).await.unwrap(),
        Enqueued::New { .. }
    ));
    let Entered::ClaimedHead { head, .. } = q
        .enqueue_started(a.guard(), &request("e3", "p", 100), "agent-3")
        .await
        .unwrap()
    else {
        panic!("the head was not claimed");
    };
    assert_eq!(head.job_id, "e2");
    assert_eq!(
        q.state("e3").await.unwrap(),
        Some((RequestState::Queued, None))
    );
    q.start(a.guard(), &head, "agent-2").await.unwrap();
    // The cap (2) is reached: e3 waits, a later arrival queues behind it
    // and claims nothing.
    assert!(matches!(
        q.enqueue_started(a.guard(), &request("e4", "p", 100), "agent-4")
            .await
            .unwrap(),
        Entered::Queued { .. }
    ));
    assert_eq!(q.pool_usage("p").await.unwrap().agents, 2, "the cap held");
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// A claim whose pool row is held by someone else for long gives up within
/// its lock timeout (nothing claimed, nothing changed) instead of holding
/// one of the host's few connections while it waits; once the row is free
/// the request is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_a_busy_pool_row_gives_up_quickly() {
    use sqlx::Connection;
    let db = TestDb::new().await;
    let fleet = db.fleet("busy").await;
    let host = join(&fleet, 1, vec![pool("p", Caps::default())], LONG).await;
    let q = fleet.queue();
    let pools = vec!["p".to_owned()];
    q.enqueue(&request("j0", "p", 100)).await.unwrap();

    let mut other = db.conn().await;
    let mut tx = other.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM fleet_pools WHERE fleet = 'busy' AND pool = 'p' FOR UPDATE")
        .execute(&mut *tx)
        .await
        .unwrap();
    let t = Instant::now();
    let claimed = q.claim(host.guard(), &pools).await.unwrap();
    let waited = t.elapsed();
    assert!(claimed.is_none(), "claimed through a locked pool row");
    assert!(
        waited < Duration::from_secs(2),
        "the claim waited {waited:?} for the busy row"
    );
    assert_eq!(
        q.state("j0").await.unwrap(),
        Some((RequestState::Queued, None))
    );
    tx.rollback().await.unwrap();
    let claim = q.claim(host.guard(), &pools).await.unwrap().unwrap();
    assert_eq!(claim.job_id, "j0");
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}

/// A repeat of a request that is being started elsewhere (its row locked
/// by the start's transaction, which then takes the pool's row through the
/// usage trigger) is answered at once, without waiting on that row: a
/// repeat that took the pool's row first and then waited on the request's
/// deadlocked with the start, and PostgreSQL rolled one of them back —
/// in the three-host test, the start, so its claim went back to the queue
/// and a later request was started ahead of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_does_not_wait_on_a_request_being_started() {
    use sqlx::Connection;
    let db = TestDb::new().await;
    let fleet = db.fleet("repeat").await;
    let host = join(&fleet, 1, vec![pool("p", Caps::default())], LONG).await;
    let q = fleet.queue();
    let req = request("r1", "p", 100);
    q.enqueue(&req).await.unwrap();
    let claim = q
        .claim(host.guard(), &["p".to_owned()])
        .await
        .unwrap()
        .unwrap();

    // What the start does, in its order: the request's row first…
    let mut starter = db.conn().await;
    let mut tx = starter.begin().await.unwrap();
    sqlx::query("UPDATE fleet_requests SET state = 'started', agent_id = 'a1' WHERE job_id = 'r1'")
        .execute(&mut *tx)
        .await
        .unwrap();
    // …while the same request arrives again, through both entry paths.
    let t = Instant::now();
    let repeat = tokio::time::timeout(Duration::from_secs(5), q.enqueue(&req)).await;
    let entered = tokio::time::timeout(
        Duration::from_secs(5),
        q.enqueue_started(host.guard(), &req, "a2"),
    )
    .await;
    let waited = t.elapsed();
    // …then the pool's row (the trigger's update); it commits.
    sqlx::query(
        "UPDATE fleet_pools SET used_agents = used_agents WHERE fleet = 'repeat' AND pool = 'p'",
    )
    .execute(&mut *tx)
    .await
    .expect("the start was not rolled back");
    tx.commit().await.unwrap();
    assert!(
        matches!(
            repeat,
            Ok(Ok(Enqueued::Existing {
                state: RequestState::Claimed,
                ..
            }))
        ),
        "{repeat:?}"
    );
    assert!(
        matches!(
            entered,
            Ok(Ok(Entered::Existing {
                state: RequestState::Claimed,
                ..
            }))
        ),
        "{entered:?}"
    );
    assert!(
        waited < Duration::from_secs(1),
        "the repeats waited {waited:?} on the request's row"
    );
    assert_eq!(
        q.state("r1").await.unwrap().map(|(s, _)| s),
        Some(RequestState::Started)
    );
    drop(claim);
    fleet.close().await;
    db.assert_counters_exact().await;
    db.drop_db().await;
}
