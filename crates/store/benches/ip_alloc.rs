//! IP allocations per second with N concurrent allocators, as a ratio to
//! raw single-row INSERT transactions per second measured in the same run,
//! on the same database, with the same concurrency and durability settings
//! (performance target: ratio ≥ 0.5). Driven by
//! `bench/ip-alloc.sh`; not a criterion bench because what is measured is
//! throughput under concurrency, not one call's latency.
//!
//! Arguments (after `--`): `--seconds S` per phase (default 3),
//! `--concurrency N` (default 16), `--rounds R` (default 2: baseline and
//! allocations alternate so machine noise hits both), `--only sqlite|postgres`.
//! PostgreSQL: `KICI_SCALER_TEST_POSTGRES` (an admin URL; a scratch database
//! is created and dropped), else `scripts/postgres.sh start`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_model::{AgentId, InstanceId, ScalerType};
use kici_store::{open, Ipv4Pool, StateStore, StoreOptions, StoreUrl};
use sqlx::Connection;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Args {
    seconds: f64,
    concurrency: u32,
    rounds: u32,
    only: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        seconds: 3.0,
        concurrency: 16,
        rounds: 2,
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seconds" => a.seconds = it.next().unwrap().parse().unwrap(),
            "--concurrency" => a.concurrency = it.next().unwrap().parse().unwrap(),
            "--rounds" => a.rounds = it.next().unwrap().parse().unwrap(),
            "--only" => a.only = it.next(),
            // `cargo bench` passes `--bench`; ignore it and filters.
            _ => {}
        }
    }
    a
}

/// Runs `op(task, n)` in `concurrency` tasks for `seconds`; returns ops/s.
async fn throughput<F, Fut>(concurrency: u32, seconds: f64, op: F) -> f64
where
    F: Fn(u32, u32) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let done = Arc::new(AtomicU32::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..concurrency {
        let (op, done) = (op.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            while Instant::now() < deadline {
                op(t, n).await;
                n += 1;
            }
            done.fetch_add(n, Ordering::Relaxed);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    f64::from(done.load(Ordering::Relaxed)) / start.elapsed().as_secs_f64()
}

/// Agent ids unique across rounds: round, task and sequence packed in 32 bits.
fn agent(round: u32, task: u32, n: u32) -> AgentId {
    AgentId::new(
        ScalerType::Firecracker,
        ((round << 28) | (task << 20) | n).to_be_bytes(),
    )
}

struct Baseline {
    insert: Box<dyn Fn(i64) -> futures_like::BoxFuture + Send + Sync>,
}

mod futures_like {
    pub type BoxFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
}

async fn compare(name: &str, store: Arc<dyn StateStore>, baseline: Baseline, a: &Args) {
    let pool: Ipv4Pool = "10.128.0.0/12".parse().unwrap();
    // Fill the pool (one-time per network) outside the measurement.
    store.allocate(&pool, &agent(15, 0, 0)).await.unwrap();
    let insert = Arc::new(baseline.insert);
    let (mut base_total, mut alloc_total) = (0.0, 0.0);
    for round in 0..a.rounds {
        let ins = insert.clone();
        let base = throughput(a.concurrency, a.seconds, move |t, n| {
            let id = (i64::from(round) << 40) | (i64::from(t) << 24) | i64::from(n);
            ins(id)
        })
        .await;
        let s = store.clone();
        let alloc = throughput(a.concurrency, a.seconds, move |t, n| {
            let s = s.clone();
            async move {
                s.allocate(&pool, &agent(round, t, n)).await.unwrap();
            }
        })
        .await;
        println!(
            "{name} round {round}: raw INSERT {base:.0} tx/s, allocate {alloc:.0}/s, ratio {:.2}",
            alloc / base
        );
        base_total += base;
        alloc_total += alloc;
    }
    let (base, alloc) = (
        base_total / f64::from(a.rounds),
        alloc_total / f64::from(a.rounds),
    );
    println!(
        "{name}: concurrency {}, raw INSERT {base:.0} tx/s, allocate {alloc:.0}/s, ratio {:.2} (target >= 0.5)",
        a.concurrency,
        alloc / base
    );
}

async fn postgres(a: &Args) {
    let admin = match std::env::var("KICI_SCALER_TEST_POSTGRES") {
        Ok(u) if !u.is_empty() => u,
        _ => {
            let script =
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/postgres.sh");
            let ok = std::process::Command::new("bash")
                .arg(&script)
                .arg("start")
                .status()
                .unwrap();
            assert!(ok.success());
            let out = std::process::Command::new("bash")
                .arg(&script)
                .arg("url")
                .output()
                .unwrap();
            String::from_utf8(out.stdout).unwrap().trim().to_owned()
        }
    };
    let name = format!("kici_bench_{}", InstanceId::random());
    let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
    for setting in ["fsync", "synchronous_commit"] {
        let v: String = sqlx::query_scalar(&format!("SHOW {setting}"))
            .fetch_one(&mut c)
            .await
            .unwrap();
        println!("postgres: {setting} = {v}");
    }
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut c)
        .await
        .unwrap();
    let url = match admin.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{name}"),
        None => unreachable!("a postgres URL has a path"),
    };
    let options = StoreOptions {
        max_connections: a.concurrency,
        acquire_timeout: Duration::from_secs(10),
        ..StoreOptions::default()
    };
    let store = open(
        &url.parse::<StoreUrl>().unwrap(),
        InstanceId::random(),
        options,
    )
    .await
    .unwrap();
    let raw = sqlx::postgres::PgPoolOptions::new()
        .max_connections(a.concurrency)
        .connect(&url)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE bench_insert (id BIGINT PRIMARY KEY, owner TEXT NOT NULL, at BIGINT NOT NULL)")
        .execute(&raw)
        .await
        .unwrap();
    let baseline = Baseline {
        insert: Box::new(move |id| {
            let raw = raw.clone();
            Box::pin(async move {
                sqlx::query("INSERT INTO bench_insert (id, owner, at) VALUES ($1, $2, $3)")
                    .bind(id)
                    .bind("bench")
                    .bind(id)
                    .execute(&raw)
                    .await
                    .unwrap();
            })
        }),
    };
    compare("postgres", store.clone(), baseline, a).await;
    store.close().await;
    sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .execute(&mut c)
        .await
        .unwrap();
}

async fn sqlite(a: &Args) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let options = StoreOptions {
        max_connections: a.concurrency,
        acquire_timeout: Duration::from_secs(10),
        ..StoreOptions::default()
    };
    let store = open(
        &StoreUrl::Sqlite(path.clone()),
        InstanceId::random(),
        options,
    )
    .await
    .unwrap();
    // The same settings as the store's writer: one connection, WAL,
    // synchronous=NORMAL.
    let raw = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(&path)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(5)),
        )
        .await
        .unwrap();
    sqlx::query("CREATE TABLE bench_insert (id BIGINT PRIMARY KEY, owner TEXT NOT NULL, at BIGINT NOT NULL)")
        .execute(&raw)
        .await
        .unwrap();
    let baseline = Baseline {
        insert: Box::new(move |id| {
            let raw = raw.clone();
            Box::pin(async move {
                sqlx::query("INSERT INTO bench_insert (id, owner, at) VALUES ($1, $2, $3)")
                    .bind(id)
                    .bind("bench")
                    .bind(id)
                    .execute(&raw)
                    .await
                    .unwrap();
            })
        }),
    };
    println!("sqlite: WAL, synchronous=NORMAL, one writer connection");
    compare("sqlite", store.clone(), baseline, a).await;
    store.close().await;
}

fn main() {
    let a = args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        if a.only.as_deref() != Some("sqlite") {
            postgres(&a).await;
        }
        if a.only.as_deref() != Some("postgres") {
            sqlite(&a).await;
        }
    });
}
