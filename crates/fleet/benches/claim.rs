//! Claim throughput: 2,000 queued requests claimed to the last by 1 host,
//! then by 3 concurrent hosts (each its own connection pool and lease), in
//! the same run on the same database; requests in one pool (every claim
//! serialised on the pool row) and spread over four pools. Ample capacity:
//! no caps, so what is measured is the claim transaction itself. At the
//! end the 3-host / 1-host ratio of each layout is printed.
//!
//!   scripts/postgres.sh start
//!   cargo bench -p kici-fleet --bench claim
//!
//! PostgreSQL: `KICI_SCALER_TEST_POSTGRES` (an admin URL; a scratch database
//! is created and dropped), else the URL `scripts/postgres.sh url` prints.
//! With no server reachable the bench says so and measures nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kici_fleet::{Caps, Fleet, FleetOptions, HostSpec, Membership, PoolDefinition};
use sqlx::Connection;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const REQUESTS: i64 = 2000;

/// Measured time and rounds per (pools, claimers).
type Rates = BTreeMap<(usize, u32), (Duration, u64)>;

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

fn pools(n: usize) -> Vec<PoolDefinition> {
    (0..n)
        .map(|i| PoolDefinition {
            name: format!("p{i}"),
            label_sets: serde_json::json!([{"labels": ["linux", format!("p{i}")]}]),
            fleet_caps: Caps::default(),
            host_max_agents: None,
        })
        .collect()
}

struct Layout {
    fleet: Fleet,
    hosts: Vec<(Fleet, Membership)>,
    pools: Vec<String>,
}

static ROUND: AtomicU32 = AtomicU32::new(0);

async fn layout(url: &str, name: &str, claimers: u32, pool_count: usize) -> Layout {
    let fleet = Fleet::connect(url, name, FleetOptions::default())
        .await
        .unwrap();
    let defs = pools(pool_count);
    let mut hosts = Vec::new();
    for n in 0..claimers {
        let f = Fleet::connect(
            url,
            name,
            FleetOptions {
                max_connections: 2,
                ..FleetOptions::default()
            },
        )
        .await
        .unwrap();
        let mut spec = HostSpec::new(format!("{:08x}", n + 1).parse().unwrap(), "bench", "0");
        spec.pools = defs.clone();
        spec.lease = Duration::from_secs(3600);
        spec.margin = Duration::from_secs(60);
        let m = f.join(spec).await.unwrap();
        hosts.push((f, m));
    }
    Layout {
        fleet,
        hosts,
        pools: defs.into_iter().map(|d| d.name).collect(),
    }
}

/// Queues `REQUESTS` requests round-robin over the pools in one statement
/// (setup, not measured), claims them all with every host at once, and
/// returns the time to the last claim.
async fn round(l: &Layout) -> Duration {
    let r = ROUND.fetch_add(1, Ordering::SeqCst);
    sqlx::query(
        "INSERT INTO fleet_requests (fleet, job_id, kind, pool, body, answer, milli_cpu, memory_bytes, \
             entry_host, state, arrived_at) \
         SELECT $1, 'r' || $2 || '-' || g, 'scale', ($3::TEXT[])[1 + g % array_length($3::TEXT[], 1)], \
             '{}', '{}', 100, 1048576, '00000001', 'queued', fleet_now_ms() \
         FROM generate_series(1, $4) g ORDER BY g",
    )
    .bind(l.fleet.name())
    .bind(i64::from(r))
    .bind(&l.pools)
    .bind(REQUESTS)
    .execute(l.fleet.pool())
    .await
    .unwrap();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (f, m) in &l.hosts {
        let q = f.queue();
        let guard = m.guard().clone();
        let pools = l.pools.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0i64;
            while q.claim(&guard, &pools).await.unwrap().is_some() {
                n += 1;
            }
            n
        }));
    }
    let mut claimed = 0;
    for t in tasks {
        claimed += t.await.unwrap();
    }
    let took = started.elapsed();
    assert_eq!(claimed, REQUESTS);
    sqlx::query("DELETE FROM fleet_requests WHERE fleet = $1")
        .bind(l.fleet.name())
        .execute(l.fleet.pool())
        .await
        .unwrap();
    took
}

fn claim(c: &mut Criterion) {
    let admin = admin_url();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let reachable = !admin.is_empty()
        && rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(3), sqlx::PgConnection::connect(&admin))
                .await
                .is_ok_and(|c| c.is_ok())
        });
    if !reachable {
        eprintln!(
            "claim bench skipped: no PostgreSQL reachable (set KICI_SCALER_TEST_POSTGRES or run scripts/postgres.sh start)"
        );
        return;
    }
    let db = format!("kici_fleet_bench_{}", std::process::id());
    rt.block_on(async {
        let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
        sqlx::query(&format!("CREATE DATABASE {db}"))
            .execute(&mut c)
            .await
            .unwrap();
    });
    let url = with_database(&admin, &db);

    // Requests/s per (layout, claimers), over every measured round.
    let rates: Arc<Mutex<Rates>> = Arc::default();
    let mut group = c.benchmark_group("fleet_claim_2000");
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(20));
    group.throughput(Throughput::Elements(u64::try_from(REQUESTS).unwrap()));
    for pool_count in [1usize, 4] {
        for claimers in [1u32, 3] {
            let l = rt.block_on(layout(
                &url,
                &format!("bench-{pool_count}-{claimers}"),
                claimers,
                pool_count,
            ));
            let rates = rates.clone();
            group.bench_function(format!("{pool_count}_pools_{claimers}_claimers"), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        total += rt.block_on(round(&l));
                    }
                    let mut r = rates.lock().unwrap();
                    let e = r.entry((pool_count, claimers)).or_default();
                    e.0 += total;
                    e.1 += iters;
                    total
                });
            });
            rt.block_on(async {
                for (f, m) in l.hosts {
                    m.leave().await.unwrap();
                    f.close().await;
                }
                l.fleet.close().await;
            });
        }
    }
    group.finish();

    let rates = rates.lock().unwrap();
    let per_second = |k: &(usize, u32)| {
        rates
            .get(k)
            .map(|(t, n)| (REQUESTS as f64) * (*n as f64) / t.as_secs_f64().max(f64::MIN_POSITIVE))
    };
    for pool_count in [1usize, 4] {
        if let (Some(one), Some(three)) =
            (per_second(&(pool_count, 1)), per_second(&(pool_count, 3)))
        {
            println!(
                "claim throughput, {pool_count} pool(s): 1 claimer {one:.0} req/s, 3 claimers {three:.0} req/s, ratio {:.2}",
                three / one
            );
        }
    }
    rt.block_on(async {
        let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
        sqlx::query(&format!("DROP DATABASE {db} WITH (FORCE)"))
            .execute(&mut c)
            .await
            .unwrap();
    });
}

/// Live agents behind the capped pool of [`claim_cost`].
const LIVE_AGENTS: [i64; 2] = [0, 20_000];
/// Claim-and-release cycles per measured round.
const CYCLES: u32 = 200;

/// The cost of one claim as the pool's live agents grow: a pool with a cap
/// (so the claim checks usage) and 0 or 20,000 live agents; one queued
/// request claimed and released again, `CYCLES` times a round. Printed: the
/// time per claim at each size and the ratio of the largest to none (1.0:
/// the claim's cost does not grow with the agents it counts).
fn claim_cost(c: &mut Criterion) {
    let admin = admin_url();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let reachable = !admin.is_empty()
        && rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(3), sqlx::PgConnection::connect(&admin))
                .await
                .is_ok_and(|c| c.is_ok())
        });
    if !reachable {
        eprintln!("claim-cost bench skipped: no PostgreSQL reachable");
        return;
    }
    let db = format!("kici_fleet_cost_{}", std::process::id());
    rt.block_on(async {
        let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
        sqlx::query(&format!("CREATE DATABASE {db}"))
            .execute(&mut c)
            .await
            .unwrap();
    });
    let url = with_database(&admin, &db);
    let mut per_claim: BTreeMap<i64, Duration> = BTreeMap::new();
    let mut group = c.benchmark_group("fleet_claim_cost");
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(10));
    group.throughput(Throughput::Elements(u64::from(CYCLES)));
    for live in LIVE_AGENTS {
        let name = format!("cost-{live}");
        let (fleet, membership) = rt.block_on(async {
            let fleet = Fleet::connect(&url, &name, FleetOptions::default())
                .await
                .unwrap();
            let mut spec = HostSpec::new("00000001".parse().unwrap(), "bench", "0");
            spec.pools = vec![PoolDefinition {
                name: "p".into(),
                label_sets: serde_json::json!([{"labels": ["p"]}]),
                fleet_caps: Caps {
                    max_agents: Some(10_000_000),
                    ..Caps::default()
                },
                host_max_agents: None,
            }];
            spec.lease = Duration::from_secs(3600);
            spec.margin = Duration::from_secs(60);
            let m = fleet.join(spec).await.unwrap();
            sqlx::query(
                "INSERT INTO fleet_agents (fleet, agent_id, instance_id, epoch, pool, job_id, milli_cpu, \
                     memory_bytes, state, created_at, updated_at) \
                 SELECT $1, 'a' || g, '00000001', 1, 'p', 'j' || g, 100, 1048576, 'live', 0, 0 \
                 FROM generate_series(1, $2) g",
            )
            .bind(&name)
            .bind(live)
            .execute(fleet.pool())
            .await
            .unwrap();
            sqlx::query(
                "INSERT INTO fleet_requests (fleet, job_id, kind, pool, body, answer, milli_cpu, memory_bytes, \
                     entry_host, state, arrived_at) \
                 VALUES ($1, 'the-request', 'scale', 'p', '{}', '{}', 100, 1048576, '00000001', 'queued', 0)",
            )
            .bind(&name)
            .execute(fleet.pool())
            .await
            .unwrap();
            sqlx::query("ANALYZE fleet_agents")
                .execute(fleet.pool())
                .await
                .unwrap();
            (fleet, m)
        });
        let q = fleet.queue();
        let pools = vec!["p".to_owned()];
        let total = Arc::new(Mutex::new((Duration::ZERO, 0u64)));
        group.bench_function(format!("{live}_live_agents"), |b| {
            b.iter_custom(|iters| {
                let took = rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        for _ in 0..CYCLES {
                            let claim = q.claim(membership.guard(), &pools).await.unwrap().unwrap();
                            assert!(q.release(&claim).await.unwrap());
                        }
                    }
                    start.elapsed()
                });
                let mut t = total.lock().unwrap();
                t.0 += took;
                t.1 += iters * u64::from(CYCLES);
                took
            });
        });
        let (t, n) = *total.lock().unwrap();
        per_claim.insert(live, t / u32::try_from(n.max(1)).unwrap_or(u32::MAX));
        rt.block_on(async {
            membership.leave().await.unwrap();
            fleet.close().await;
        });
    }
    group.finish();
    if let (Some(none), Some(many)) = (per_claim.get(&0), per_claim.get(&20_000)) {
        println!(
            "claim + release: {none:?} with no live agents, {many:?} with 20,000; ratio {:.2}",
            many.as_secs_f64() / none.as_secs_f64().max(f64::MIN_POSITIVE)
        );
    }
    rt.block_on(async {
        let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
        sqlx::query(&format!("DROP DATABASE {db} WITH (FORCE)"))
            .execute(&mut c)
            .await
            .unwrap();
    });
}

criterion_group!(benches, claim, claim_cost);
criterion_main!(benches);
