//! Helpers for the fleet tests: the PostgreSQL server (the same convention
//! as kici-store's tests: `KICI_SCALER_TEST_POSTGRES`, else the server
//! `scripts/postgres.sh start` runs; never skipped), a database per test,
//! and hosts.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use kici_fleet::{
    Caps, Fleet, FleetOptions, HostSpec, Membership, NewRequest, PoolDefinition, RequestKind,
};
use kici_model::{InstanceId, MemoryBytes, MilliCpu};
use sqlx::Connection;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/postgres.sh")
}

fn pg_script(cmd: &str) -> String {
    let out = Command::new("bash")
        .arg(script())
        .arg(cmd)
        .output()
        .expect("run scripts/postgres.sh");
    assert!(
        out.status.success(),
        "postgres.sh {cmd} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// `KICI_SCALER_TEST_POSTGRES`, else the server `scripts/postgres.sh start` runs.
pub fn pg_admin_url() -> String {
    match std::env::var("KICI_SCALER_TEST_POSTGRES") {
        Ok(u) if !u.is_empty() => u,
        _ => {
            pg_script("start");
            pg_script("url")
        }
    }
}

/// `url` with its database replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
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

/// A database of its own, so tests run in parallel on one server.
pub struct TestDb {
    pub admin: String,
    pub name: String,
    pub url: String,
}

impl TestDb {
    pub async fn new() -> Self {
        let admin = pg_admin_url();
        let name = format!("kici_fleet_test_{}", InstanceId::random());
        let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut c)
            .await
            .unwrap();
        c.close().await.unwrap();
        let url = with_database(&admin, &name);
        Self { admin, name, url }
    }

    pub async fn fleet(&self, name: &str) -> Fleet {
        Fleet::connect(&self.url, name, FleetOptions::default())
            .await
            .unwrap()
    }

    pub async fn conn(&self) -> sqlx::PgConnection {
        sqlx::PgConnection::connect(&self.url).await.unwrap()
    }

    /// Every pool's and host's usage counters equal a recount of the rows
    /// they stand for (claimed requests + live agents), in every fleet of
    /// the database.
    pub async fn assert_counters_exact(&self) {
        let mut c = self.conn().await;
        /// fleet, pool, counters (agents, cpu, memory), recounts (same).
        type PoolCounts = (String, String, i64, i64, i64, i64, i64, i64);
        let pools: Vec<PoolCounts> = sqlx::query_as(
            "SELECT p.fleet, p.pool, p.used_agents, p.used_cpu, p.used_memory, \
                 count(u.*), COALESCE(sum(u.milli_cpu), 0)::BIGINT, COALESCE(sum(u.memory_bytes), 0)::BIGINT \
             FROM fleet_pools p LEFT JOIN ( \
                 SELECT fleet, pool, milli_cpu, memory_bytes FROM fleet_requests WHERE state = 'claimed' \
                 UNION ALL SELECT fleet, pool, milli_cpu, memory_bytes FROM fleet_agents WHERE state = 'live') u \
               ON u.fleet = p.fleet AND u.pool = p.pool \
             GROUP BY p.fleet, p.pool, p.used_agents, p.used_cpu, p.used_memory",
        )
        .fetch_all(&mut c)
        .await
        .unwrap();
        for (fleet, pool, n, cpu, mem, rn, rcpu, rmem) in pools {
            assert_eq!(
                (n, cpu, mem),
                (rn, rcpu, rmem),
                "pool {pool} of fleet {fleet}: counters vs recount"
            );
        }
        let hosts: Vec<(String, String, i64, i64)> = sqlx::query_as(
            "SELECT hp.instance_id, hp.pool, hp.used_agents, \
                 (SELECT count(*) FROM fleet_requests r WHERE r.fleet = hp.fleet AND r.pool = hp.pool \
                     AND r.state = 'claimed' AND r.claimed_by = hp.instance_id) \
               + (SELECT count(*) FROM fleet_agents a WHERE a.fleet = hp.fleet AND a.pool = hp.pool \
                     AND a.state = 'live' AND a.instance_id = hp.instance_id) \
             FROM fleet_host_pools hp",
        )
        .fetch_all(&mut c)
        .await
        .unwrap();
        for (host, pool, n, recount) in hosts {
            assert_eq!(n, recount, "host {host} in pool {pool}: counter vs recount");
        }
    }

    pub async fn drop_db(self) {
        let mut c = sqlx::PgConnection::connect(&self.admin).await.unwrap();
        sqlx::query(&format!("DROP DATABASE {} WITH (FORCE)", self.name))
            .execute(&mut c)
            .await
            .unwrap();
    }
}

pub fn id(n: u32) -> InstanceId {
    format!("{n:08x}").parse().unwrap()
}

pub fn pool(name: &str, caps: Caps) -> PoolDefinition {
    PoolDefinition {
        name: name.into(),
        label_sets: serde_json::json!([{"labels": ["linux", name]}]),
        fleet_caps: caps,
        host_max_agents: None,
    }
}

pub fn max_agents(n: u32) -> Caps {
    Caps {
        max_agents: Some(n),
        ..Caps::default()
    }
}

pub fn spec(n: u32, pools: Vec<PoolDefinition>, lease: Duration) -> HostSpec {
    let mut s = HostSpec::new(id(n), &format!("host-{n}"), "0.1.0");
    s.url = Some(format!("http://10.0.0.{n}:8080"));
    s.pools = pools;
    s.lease = lease;
    s.margin = lease / 3;
    s
}

pub async fn join(
    fleet: &Fleet,
    n: u32,
    pools: Vec<PoolDefinition>,
    lease: Duration,
) -> Membership {
    fleet.join(spec(n, pools, lease)).await.unwrap()
}

pub fn request(job: &str, pool: &str, cpu: u64) -> NewRequest {
    NewRequest {
        job_id: job.into(),
        kind: RequestKind::Scale,
        pool: pool.into(),
        body: format!(r#"{{"jobId":"{job}","labels":["linux","{pool}"]}}"#),
        answer: format!(r#"{{"jobId":"{job}","state":"pending"}}"#),
        cpu: MilliCpu::from_millis(cpu),
        memory: MemoryBytes::from_bytes(1 << 30),
        entry_host: id(1).to_string(),
        secret: None,
    }
}
