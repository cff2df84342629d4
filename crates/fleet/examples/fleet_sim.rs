//! A simulated fleet: many hosts in one process sharing a few PostgreSQL
//! connections, to see the claim path and the leases at a scale no test
//! machine can run as real daemons.
//!
//! Every simulated host joins the fleet with an instance id of its own,
//! renews its lease every third of it (as a daemon does) and claims from
//! the one shared queue whenever its [`kici_fleet::Waker`] wakes it (a
//! NOTIFY of its pool, or the 1 s fallback poll): claim, start (bind an
//! agent), and complete after the agent's hold time. A producer keeps the
//! queue from running dry through `enqueue`, and one host leads and runs
//! the leader's chores. Everything shares one [`Fleet`] handle: one
//! session (`LISTEN`, leadership) and a pool of `--connections` in all.
//!
//! At the end it prints claims/s, the claim call's latency, the lease
//! renewals' latency (p50/p99/max), renewals that failed, leases lost (a
//! renewal refused, or a host the leader declared lost), and PostgreSQL's
//! commits (`pg_stat_database.xact_commit`) per claimed request.
//!
//!   scripts/postgres.sh start
//!   cargo run --release -p kici-fleet --example fleet_sim -- --hosts 500 --connections 8
//!
//! Options: `--hosts N` (500), `--connections N` (8, the session included),
//! `--seconds N` (30, measured after every host joined), `--lease N` (15,
//! seconds), `--hold-ms N` (1000: how long each agent lives), `--cap N`
//! (the pool's fleet cap, 100000: high enough never to bind, but set so
//! that every claim sums the pool's usage as a capped pool does),
//! `--depth N` (200: requests the producer keeps queued).
//!
//! PostgreSQL: `KICI_SCALER_TEST_POSTGRES` (an admin URL; a scratch database
//! is created and dropped), else the URL `scripts/postgres.sh url` prints.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_fleet::{
    Caps, Fleet, FleetError, FleetOptions, HostSpec, Membership, NewRequest, PoolDefinition,
    RequestKind,
};
use kici_model::{MemoryBytes, MilliCpu};
use sqlx::Connection;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const POOL: &str = "sim";

struct Args {
    hosts: u32,
    connections: u32,
    seconds: u64,
    lease: u64,
    hold: Duration,
    cap: u32,
    depth: u64,
}

fn args() -> Args {
    let mut a = Args {
        hosts: 500,
        connections: 8,
        seconds: 30,
        lease: 15,
        hold: Duration::from_millis(1000),
        cap: 100_000,
        depth: 200,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = || -> u64 {
            panic!("{flag}: expected a number after it");
        };
        let mut num = || {
            it.next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or_else(value)
        };
        match flag.as_str() {
            "--hosts" => a.hosts = num() as u32,
            "--connections" => a.connections = num() as u32,
            "--seconds" => a.seconds = num(),
            "--lease" => a.lease = num(),
            "--hold-ms" => a.hold = Duration::from_millis(num()),
            "--cap" => a.cap = num() as u32,
            "--depth" => a.depth = num(),
            other => panic!("unknown option {other}"),
        }
    }
    a
}

fn admin_url() -> String {
    if let Ok(u) = std::env::var("KICI_SCALER_TEST_POSTGRES") {
        if !u.is_empty() {
            return u;
        }
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/postgres.sh");
    std::process::Command::new("bash")
        .arg(script)
        .arg("url")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn with_database(url: &str, db: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (authority, query) = match rest.split_once('/') {
        Some((a, path)) => (a, path.split_once('?').map(|(_, q)| q)),
        None => (rest, None),
    };
    match query {
        Some(q) => format!("{scheme}://{authority}/{db}?{q}"),
        None => format!("{scheme}://{authority}/{db}"),
    }
}

/// Latencies in microseconds.
#[derive(Default)]
struct Samples(Mutex<Vec<u64>>);

impl Samples {
    fn add(&self, d: Duration) {
        self.0.lock().unwrap().push(d.as_micros() as u64);
    }
    fn summary(&self) -> (usize, f64, f64, f64) {
        let mut v = self.0.lock().unwrap().clone();
        v.sort_unstable();
        let ms = |x: u64| x as f64 / 1000.0;
        let at = |q: f64| v.get(((v.len() as f64 * q) as usize).min(v.len().saturating_sub(1)));
        (
            v.len(),
            at(0.5).copied().map_or(0.0, ms),
            at(0.99).copied().map_or(0.0, ms),
            v.last().copied().map_or(0.0, ms),
        )
    }
}

#[derive(Default)]
struct Stats {
    measuring: AtomicBool,
    enqueued: AtomicU64,
    claimed: AtomicU64,
    completed: AtomicU64,
    claim_errors: AtomicU64,
    enqueue_errors: AtomicU64,
    renew_failed: AtomicU64,
    leases_lost: AtomicU64,
    declared_lost: AtomicU64,
    renewals: Samples,
    claims: Samples,
}

async fn xact_commit(admin: &str, db: &str) -> i64 {
    let mut c = sqlx::PgConnection::connect(admin).await.unwrap();
    sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
        .bind(db)
        .fetch_one(&mut c)
        .await
        .unwrap()
}

async fn renew_loop(m: Arc<Membership>, lease: Duration, stats: Arc<Stats>, offset: Duration) {
    tokio::time::sleep(offset).await;
    let mut tick = tokio::time::interval(lease / 3);
    loop {
        tick.tick().await;
        let t = Instant::now();
        let r = m.renew().await;
        if stats.measuring.load(Ordering::Relaxed) {
            stats.renewals.add(t.elapsed());
        }
        match r {
            Ok(()) => {}
            Err(FleetError::LeaseLost { .. }) => {
                stats.leases_lost.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Err(_) => {
                stats.renew_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

async fn claim_loop(fleet: Fleet, m: Arc<Membership>, hold: Duration, stats: Arc<Stats>) {
    let pools = vec![POOL.to_owned()];
    let queue = fleet.queue();
    let mut waker = fleet.waker(&pools);
    let mut agents = 0u64;
    loop {
        loop {
            let t = Instant::now();
            let claim = match queue.claim(m.guard(), &pools).await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(FleetError::LeaseLapsed { .. } | FleetError::StaleEpoch { .. }) => return,
                Err(_) => {
                    stats.claim_errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            };
            if stats.measuring.load(Ordering::Relaxed) {
                stats.claims.add(t.elapsed());
            }
            agents += 1;
            let agent = format!("sim-{}-{agents}", m.instance());
            if queue.start(m.guard(), &claim, &agent).await.is_err() {
                stats.claim_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            stats.claimed.fetch_add(1, Ordering::Relaxed);
            let (queue, instance, stats) = (queue.clone(), m.instance().to_owned(), stats.clone());
            tokio::spawn(async move {
                tokio::time::sleep(hold).await;
                if let Ok(true) = queue.complete(&instance, &claim.job_id, "ok").await {
                    stats.completed.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        waker.wait().await;
    }
}

async fn produce(fleet: Fleet, depth: u64, stats: Arc<Stats>, worker: u32) {
    let queue = fleet.queue();
    let mut n = 0u64;
    loop {
        let queued = stats.enqueued.load(Ordering::Relaxed) - stats.claimed.load(Ordering::Relaxed);
        if queued >= depth {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        n += 1;
        let req = NewRequest {
            job_id: format!("job-{worker}-{n}"),
            kind: RequestKind::Scale,
            pool: POOL.to_owned(),
            body: "{}".to_owned(),
            secret: None,
            answer: "{}".to_owned(),
            cpu: MilliCpu::from_millis(100),
            memory: MemoryBytes::from_bytes(1 << 20),
            entry_host: "00000001".to_owned(),
        };
        match queue.enqueue(&req).await {
            Ok(_) => {
                stats.enqueued.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                // A failed enqueue returns at once: without a pause the
                // producer would spin and starve every other task of the
                // runtime (one holding a transaction open among them).
                if stats.enqueue_errors.fetch_add(1, Ordering::Relaxed) == 0 {
                    eprintln!("enqueue failed (first of possibly many): {e}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn lead(fleet: Fleet, lease: Duration, stats: Arc<Stats>) {
    let mut leader = fleet.leader("00000001".parse().unwrap());
    let mut tick = tokio::time::interval(lease / 3);
    loop {
        tick.tick().await;
        if !leader.try_lead().await.unwrap_or(false) {
            continue;
        }
        if let Ok(report) = leader.run_chores(Duration::from_secs(3600)).await {
            stats
                .declared_lost
                .fetch_add(report.lost_hosts.len() as u64, Ordering::Relaxed);
        }
    }
}

async fn run(a: Args, admin: String) {
    let db = format!("kici_fleet_sim_{}", std::process::id());
    {
        let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
        sqlx::query(&format!("CREATE DATABASE {db}"))
            .execute(&mut c)
            .await
            .unwrap();
    }
    let url = with_database(&admin, &db);
    let fleet = Fleet::connect(
        &url,
        "sim",
        FleetOptions {
            max_connections: a.connections,
            ..FleetOptions::default()
        },
    )
    .await
    .unwrap();
    let lease = Duration::from_secs(a.lease);
    let stats = Arc::new(Stats::default());
    let pool = PoolDefinition {
        name: POOL.to_owned(),
        label_sets: serde_json::json!([{"labels": ["linux", "sim"]}]),
        fleet_caps: Caps {
            max_agents: Some(a.cap),
            ..Caps::default()
        },
        host_max_agents: None,
    };
    let joining = Instant::now();
    let mut members = Vec::new();
    for n in 0..a.hosts {
        let mut spec = HostSpec::new(format!("{:08x}", n + 1).parse().unwrap(), "sim", "0");
        spec.pools = vec![pool.clone()];
        spec.lease = lease;
        let m = Arc::new(fleet.join(spec).await.unwrap());
        // Renewals spread over the third of the lease, as hosts started at
        // different times would be.
        let offset = lease / 3 * n / a.hosts;
        tokio::spawn(renew_loop(m.clone(), lease, stats.clone(), offset));
        members.push(m);
    }
    let joined = joining.elapsed();
    tokio::spawn(lead(fleet.clone(), lease, stats.clone()));
    for m in &members {
        tokio::spawn(claim_loop(fleet.clone(), m.clone(), a.hold, stats.clone()));
    }
    for w in 0..2 {
        tokio::spawn(produce(fleet.clone(), a.depth, stats.clone(), w));
    }
    // Warm-up: the queue fills, agents reach their steady number.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let commits0 = xact_commit(&admin, &db).await;
    let claimed0 = stats.claimed.load(Ordering::Relaxed);
    let started = Instant::now();
    stats.measuring.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(a.seconds)).await;
    stats.measuring.store(false, Ordering::Relaxed);
    let took = started.elapsed();
    let claimed = stats.claimed.load(Ordering::Relaxed) - claimed0;
    // The statistics of a busy backend reach pg_stat_database within a
    // second; the count keeps running meanwhile, so it is read at once and
    // the second read only checks how much came late.
    let commits1 = xact_commit(&admin, &db).await;
    let live: i64 = sqlx::query_scalar("SELECT count(*) FROM fleet_agents WHERE state = 'live'")
        .fetch_one(fleet.pool())
        .await
        .unwrap_or(-1);
    let commits = commits1 - commits0;
    let secs = took.as_secs_f64();
    let (rn, r50, r99, rmax) = stats.renewals.summary();
    let (_, c50, c99, cmax) = stats.claims.summary();
    let renewals_per_s = f64::from(a.hosts) / (lease.as_secs_f64() / 3.0);
    println!(
        "hosts {} | connections {} | lease {} s | hold {} ms | joined in {:.1} s",
        a.hosts,
        a.connections,
        a.lease,
        a.hold.as_millis(),
        joined.as_secs_f64()
    );
    println!(
        "claims/s {:.0} ({claimed} in {secs:.1} s) | live agents at the end {live}",
        claimed as f64 / secs
    );
    println!("claim call ms p50 {c50:.1} p99 {c99:.1} max {cmax:.1}");
    println!(
        "renewal ms p50 {r50:.1} p99 {r99:.1} max {rmax:.1} ({rn} renewals, {:.0}/s expected) | renewals failed {} | leases lost {} | hosts declared lost {}",
        renewals_per_s,
        stats.renew_failed.load(Ordering::Relaxed),
        stats.leases_lost.load(Ordering::Relaxed),
        stats.declared_lost.load(Ordering::Relaxed),
    );
    println!(
        "commits/s {:.0} | commits per claimed request {:.1} (renewals {:.0}/s and idle polls included) | claim errors {} | enqueue errors {}",
        commits as f64 / secs,
        commits as f64 / claimed.max(1) as f64,
        renewals_per_s,
        stats.claim_errors.load(Ordering::Relaxed),
        stats.enqueue_errors.load(Ordering::Relaxed),
    );
    fleet.close().await;
    let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
    let _ = sqlx::query(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .execute(&mut c)
        .await;
    std::process::exit(0);
}

fn main() {
    let a = args();
    let admin = admin_url();
    if admin.is_empty() {
        eprintln!("no PostgreSQL: set KICI_SCALER_TEST_POSTGRES or run scripts/postgres.sh start");
        std::process::exit(2);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(a, admin));
}
