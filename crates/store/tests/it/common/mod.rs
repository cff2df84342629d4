//! Shared test scenarios, run against SQLite and PostgreSQL alike, and the
//! helpers that make a fresh store of each kind.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use kici_model::{AgentId, InstanceId, JobId, MemoryBytes, MilliCpu, ScalerName, ScalerType};
use kici_store::{
    open, AgentRecord, AllocError, Ipv4Pool, JobRecord, PendingRecord, StateStore, StoreError,
    StoreOptions, StoreUrl, UnixMillis,
};
use std::collections::{BTreeMap, HashSet};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/postgres.sh")
}

/// Runs `scripts/postgres.sh <cmd>` with `KICI_PG_PORT=port` (None: the
/// script's default) and returns its stdout.
pub fn pg_script(cmd: &str, port: Option<u16>) -> String {
    let mut c = Command::new("bash");
    c.arg(script()).arg(cmd);
    if let Some(p) = port {
        c.env("KICI_PG_PORT", p.to_string());
    }
    let out = c.output().expect("run scripts/postgres.sh");
    assert!(
        out.status.success(),
        "postgres.sh {cmd} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// The server tests use: `KICI_SCALER_TEST_POSTGRES`, else the one
/// `scripts/postgres.sh start` runs (PostgreSQL tests are never skipped).
pub fn pg_admin_url() -> String {
    match std::env::var("KICI_SCALER_TEST_POSTGRES") {
        Ok(u) if !u.is_empty() => u,
        _ => {
            pg_script("start", None);
            pg_script("url", None)
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

/// A database of its own on the test server, so tests sharing the server
/// do not share IP pools. Dropped by [`TestDb::drop_db`].
pub struct TestDb {
    pub admin: String,
    pub name: String,
    pub url: StoreUrl,
}

impl TestDb {
    pub async fn new() -> Self {
        Self::on(&pg_admin_url()).await
    }

    pub async fn on(admin: &str) -> Self {
        use sqlx::Connection;
        let name = format!("kici_test_{}", InstanceId::random());
        let mut c = sqlx::PgConnection::connect(admin).await.unwrap();
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut c)
            .await
            .unwrap();
        c.close().await.unwrap();
        let url = with_database(admin, &name).parse().unwrap();
        Self {
            admin: admin.to_owned(),
            name,
            url,
        }
    }

    pub async fn drop_db(self) {
        use sqlx::Connection;
        let mut c = sqlx::PgConnection::connect(&self.admin).await.unwrap();
        sqlx::query(&format!("DROP DATABASE {} WITH (FORCE)", self.name))
            .execute(&mut c)
            .await
            .unwrap();
    }
}

pub fn sqlite_url(dir: &tempfile::TempDir) -> StoreUrl {
    StoreUrl::Sqlite(dir.path().join("nested/dir/state.db"))
}

pub async fn open_fresh(url: &StoreUrl) -> Arc<dyn StateStore> {
    open(url, InstanceId::random(), StoreOptions::default())
        .await
        .unwrap()
}

pub fn agent_id(n: u32) -> AgentId {
    AgentId::new(ScalerType::Firecracker, n.to_be_bytes())
}

pub fn sample_agent(n: u32) -> AgentRecord {
    AgentRecord {
        agent_id: agent_id(n),
        scaler: ScalerName::new("fc-small"),
        backend: ScalerType::Firecracker,
        label_set_index: 2,
        label_set_key: "linux,x64".into(),
        state: "provisioning".into(),
        mode: "orchestrator".into(),
        job_id: Some(format!("job-{n}").parse::<JobId>().unwrap()),
        run_id: Some("run-7".into()),
        warm: false,
        milli_cpu: MilliCpu::from_millis(1500),
        memory_bytes: MemoryBytes::from_bytes(2 << 30),
        machine_pool: Some("pool-a".into()),
        resource_id: None,
        resources: BTreeMap::from([
            ("tap".to_owned(), format!("kici-{:08x}", n)),
            ("pid".to_owned(), "4242:123456".to_owned()),
        ]),
        token_hash: Some("sha256:abcd".into()),
        token_expires_at: Some(UnixMillis(1_700_000_360_000)),
        failure: None,
        created_at: UnixMillis(1_700_000_000_000 + i64::from(n)),
        updated_at: UnixMillis(1_700_000_000_000 + i64::from(n)),
    }
}

/// Agents: upsert, read back, update in place, delete; another owner on the
/// same database sees none of them and cannot take their ids.
pub async fn agents_round_trip(a: &dyn StateStore, b: &dyn StateStore) {
    let one = sample_agent(1);
    let mut two = sample_agent(2);
    two.job_id = None;
    two.run_id = None;
    two.warm = true;
    two.machine_pool = None;
    two.token_hash = None;
    two.token_expires_at = None;
    two.resources.clear();
    a.put_agent(&one).await.unwrap();
    a.put_agent(&two).await.unwrap();
    assert_eq!(a.agent(&one.agent_id).await.unwrap(), Some(one.clone()));
    assert_eq!(a.agents().await.unwrap(), vec![one.clone(), two.clone()]);

    let mut moved = one.clone();
    moved.state = "failed".into();
    moved.resource_id = Some("vm-1".into());
    moved.failure = Some("boot timeout".into());
    moved.updated_at = UnixMillis(one.updated_at.0 + 5);
    a.put_agent(&moved).await.unwrap();
    assert_eq!(a.agent(&one.agent_id).await.unwrap(), Some(moved.clone()));
    assert_eq!(a.agents().await.unwrap().len(), 2);

    // Another instance: sees nothing, cannot overwrite or delete.
    assert_eq!(b.agents().await.unwrap(), vec![]);
    assert_eq!(b.agent(&one.agent_id).await.unwrap(), None);
    match b.put_agent(&one).await {
        Err(StoreError::AgentIdTaken { other_owner, .. }) => {
            assert_eq!(other_owner, a.owner().to_string())
        }
        other => panic!("expected AgentIdTaken, got {other:?}"),
    }
    assert!(!b.delete_agent(&one.agent_id).await.unwrap());
    assert_eq!(a.agent(&one.agent_id).await.unwrap(), Some(moved));

    assert!(a.delete_agent(&one.agent_id).await.unwrap());
    assert!(!a.delete_agent(&one.agent_id).await.unwrap());
    assert_eq!(a.agents().await.unwrap(), vec![two]);
}

pub async fn pending_round_trip(a: &dyn StateStore, b: &dyn StateStore) {
    let p1 = PendingRecord {
        job_id: "job-a".parse().unwrap(),
        labels: vec!["linux".into(), "X64".into()],
        request: serde_json::json!({"jobId": "job-a", "labels": ["linux", "X64"], "resources": {"cpus": 2}}),
        run_id: Some("r1".into()),
        created_at: UnixMillis(10),
    };
    let mut p2 = p1.clone();
    p2.job_id = "job-b".parse().unwrap();
    p2.run_id = None;
    p2.created_at = UnixMillis(5);
    a.put_pending(&p1).await.unwrap();
    a.put_pending(&p2).await.unwrap();
    // Same job id, other owner: its own row.
    b.put_pending(&p1).await.unwrap();
    assert_eq!(a.pending().await.unwrap(), vec![p2.clone(), p1.clone()]);
    let mut p1b = p1.clone();
    p1b.labels = vec!["gpu".into()];
    a.put_pending(&p1b).await.unwrap();
    assert_eq!(a.pending().await.unwrap(), vec![p2.clone(), p1b]);
    assert!(a.delete_pending(&p2.job_id).await.unwrap());
    assert!(!a.delete_pending(&p2.job_id).await.unwrap());
    assert_eq!(a.pending().await.unwrap().len(), 1);
    assert_eq!(b.pending().await.unwrap(), vec![p1]);
}

/// Standalone jobs: upsert, read back oldest first, update in place (an
/// end, an agent), delete; another owner's row of the same job id is its
/// own.
pub async fn jobs_round_trip(a: &dyn StateStore, b: &dyn StateStore) {
    let running = JobRecord {
        job_id: "job-00000000000000aa".parse().unwrap(),
        labels: vec!["linux".into(), "local".into()],
        command: vec!["sh".into(), "-c".into(), "echo 'é'; sleep 9".into()],
        state: "running".into(),
        agent_id: Some(agent_id(3)),
        end: None,
        exit_code: None,
        signal: None,
        reason: None,
        output_bytes: 1 << 40,
        dropped_bytes: 7,
        created_at: UnixMillis(20),
        updated_at: UnixMillis(25),
    };
    let pending = JobRecord {
        job_id: "job-00000000000000bb".parse().unwrap(),
        state: "pending".into(),
        agent_id: None,
        output_bytes: 0,
        dropped_bytes: 0,
        created_at: UnixMillis(10),
        updated_at: UnixMillis(10),
        ..running.clone()
    };
    a.put_job(&running).await.unwrap();
    a.put_job(&pending).await.unwrap();
    b.put_job(&running).await.unwrap();
    assert_eq!(
        a.jobs().await.unwrap(),
        vec![pending.clone(), running.clone()]
    );

    let ended = JobRecord {
        state: "failed".into(),
        end: Some("aborted".into()),
        exit_code: Some(-1),
        signal: Some(9),
        reason: Some("kici-scaler restarted while the job ran".into()),
        updated_at: UnixMillis(30),
        ..running.clone()
    };
    a.put_job(&ended).await.unwrap();
    assert_eq!(a.jobs().await.unwrap(), vec![pending.clone(), ended]);
    assert!(a.delete_job(&pending.job_id).await.unwrap());
    assert!(!a.delete_job(&pending.job_id).await.unwrap());
    assert_eq!(a.jobs().await.unwrap().len(), 1);
    assert_eq!(b.jobs().await.unwrap(), vec![running]);
}

pub async fn events_round_trip(a: &dyn StateStore, b: &dyn StateStore) {
    assert_eq!(a.last_event_seq().await.unwrap(), None);
    for seq in 1..=10u64 {
        let body = format!(r#"{{"seq":{seq},"type":"agent.state"}}"#);
        a.append_event(seq, UnixMillis(1000 + seq as i64), &body)
            .await
            .unwrap();
    }
    b.append_event(1, UnixMillis(1), "{}").await.unwrap();
    assert!(a.append_event(3, UnixMillis(0), "{}").await.is_err());
    let got = a.events_after(3, 4).await.unwrap();
    assert_eq!(
        got.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![4, 5, 6, 7]
    );
    assert_eq!(got[0].at, UnixMillis(1004));
    assert_eq!(got[0].body, r#"{"seq":4,"type":"agent.state"}"#);
    assert_eq!(a.last_event_seq().await.unwrap(), Some(10));
    assert_eq!(a.trim_events(6).await.unwrap(), 4);
    assert_eq!(
        a.events_after(0, 100)
            .await
            .unwrap()
            .iter()
            .map(|e| e.seq)
            .collect::<Vec<_>>(),
        vec![5, 6, 7, 8, 9, 10]
    );
    assert_eq!(a.trim_events(6).await.unwrap(), 0);
    assert_eq!(a.trim_events(0).await.unwrap(), 6);
    assert_eq!(b.events_after(0, 10).await.unwrap().len(), 1);
    // A batch is all or nothing: one taken seq refuses the whole batch.
    let batch = |from: u64, to: u64| -> Vec<kici_store::EventRecord> {
        (from..=to)
            .map(|seq| kici_store::EventRecord {
                seq,
                at: UnixMillis(seq as i64),
                body: format!("{{\"n\":{seq}}}"),
            })
            .collect()
    };
    a.append_events(&batch(11, 13)).await.unwrap();
    assert!(a.append_events(&batch(13, 15)).await.is_err());
    assert_eq!(a.last_event_seq().await.unwrap(), Some(13));
    a.append_events(&[]).await.unwrap();
    let got = a.events_after(10, 10).await.unwrap();
    assert_eq!(got, batch(11, 13));
}

pub const TASKS: u32 = 32;
pub const PER_TASK: u32 = 200;

/// 32 concurrent allocators × 200 allocations on a /16: every address
/// distinct, in the store's leases and in the database rows; all released;
/// the same again (reuse).
pub async fn concurrent_allocations_are_unique(store: Arc<dyn StateStore>, pool: Ipv4Pool) {
    for round in 0..2 {
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let mut got = Vec::new();
                for i in 0..PER_TASK {
                    let agent = agent_id(t * 10_000 + i);
                    let lease = store.allocate(&pool, &agent).await.unwrap();
                    assert_eq!(lease.agent, agent);
                    assert!(pool.contains(lease.ip), "{} outside {pool}", lease.ip);
                    got.push(lease.ip);
                }
                got
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        let total = (TASKS * PER_TASK) as usize;
        assert_eq!(all.len(), total);
        let distinct: HashSet<Ipv4Addr> = all.iter().copied().collect();
        assert_eq!(distinct.len(), total, "round {round}: duplicate addresses");
        let leases = store.leases().await.unwrap();
        assert_eq!(leases.len(), total, "round {round}: rows in the database");
        let rows: HashSet<Ipv4Addr> = leases.iter().map(|l| l.ip).collect();
        assert_eq!(rows, distinct);
        assert!(leases.iter().all(|l| l.owner == store.owner()));
        let mut releases = Vec::new();
        for t in 0..TASKS {
            let store = store.clone();
            releases.push(tokio::spawn(async move {
                for i in 0..PER_TASK {
                    let agent = agent_id(t * 10_000 + i);
                    assert_eq!(store.release_agent(&agent).await.unwrap(), 1);
                }
            }));
        }
        for r in releases {
            r.await.unwrap();
        }
        assert!(store.leases().await.unwrap().is_empty());
    }
}

/// Eight concurrent allocations for one agent (a retried spawn racing
/// itself) get one address, and exactly one row holds it.
pub async fn same_agent_concurrently(store: Arc<dyn StateStore>, pool: Ipv4Pool) {
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store.allocate(&pool, &agent_id(4242)).await.unwrap()
        }));
    }
    let mut leases = Vec::new();
    for t in tasks {
        leases.push(t.await.unwrap());
    }
    assert!(leases.iter().all(|l| *l == leases[0]), "{leases:?}");
    assert_eq!(store.leases().await.unwrap(), vec![leases[0].clone()]);
    assert_eq!(store.release_agent(&agent_id(4242)).await.unwrap(), 1);
}

/// A /27 has 29 assignable addresses: the 30th allocation is Exhausted,
/// repeat allocations are idempotent, release by IP and by agent make the
/// addresses reusable, all 29 again.
pub async fn exhaustion_and_reuse(store: &dyn StateStore, pool: Ipv4Pool) {
    assert_eq!(pool.capacity(), 29);
    let mut first = Vec::new();
    for n in 0..29 {
        first.push(store.allocate(&pool, &agent_id(n)).await.unwrap());
    }
    // Lowest first: .2 … .30.
    assert_eq!(first[0].ip, pool.assignable().next().unwrap());
    assert_eq!(first[28].ip, pool.assignable().last().unwrap());
    match store.allocate(&pool, &agent_id(99)).await {
        Err(AllocError::Exhausted { network, capacity }) => {
            assert_eq!((network, capacity), (pool.network(), 29))
        }
        other => panic!("expected Exhausted, got {other:?}"),
    }
    // Idempotent per agent and network.
    let again = store.allocate(&pool, &agent_id(3)).await.unwrap();
    assert_eq!(again, first[3]);
    assert_eq!(again.mac(), first[3].mac());

    assert!(store.release_ip(pool.network(), first[5].ip).await.unwrap());
    assert!(!store.release_ip(pool.network(), first[5].ip).await.unwrap());
    let reused = store.allocate(&pool, &agent_id(99)).await.unwrap();
    assert_eq!(reused.ip, first[5].ip);

    for n in (0..29).chain([99]) {
        store.release_agent(&agent_id(n)).await.unwrap();
    }
    assert!(store.leases().await.unwrap().is_empty());
    let mut second = HashSet::new();
    for n in 100..129 {
        second.insert(store.allocate(&pool, &agent_id(n)).await.unwrap().ip);
    }
    assert_eq!(second, pool.assignable().collect::<HashSet<_>>());
    assert!(matches!(
        store.allocate(&pool, &agent_id(200)).await,
        Err(AllocError::Exhausted { .. })
    ));
    for n in 100..129 {
        assert_eq!(store.release_agent(&agent_id(n)).await.unwrap(), 1);
    }
}

/// Two instances on one database and one network: concurrently they fill
/// the pool with no address given twice, and neither can release the
/// other's leases.
pub async fn two_owners_share_a_pool(
    a: Arc<dyn StateStore>,
    b: Arc<dyn StateStore>,
    pool: Ipv4Pool,
) {
    let cap = pool.capacity();
    let run = |s: Arc<dyn StateStore>, base: u32| async move {
        let mut got = Vec::new();
        for n in 0..cap {
            match s.allocate(&pool, &agent_id(base + n)).await {
                Ok(l) => got.push(l),
                Err(AllocError::Exhausted { .. }) => break,
                Err(e) => panic!("{e}"),
            }
        }
        got
    };
    let (la, lb) = tokio::join!(
        tokio::spawn(run(a.clone(), 1_000)),
        tokio::spawn(run(b.clone(), 2_000))
    );
    let (la, lb) = (la.unwrap(), lb.unwrap());
    assert_eq!((la.len() + lb.len()) as u32, cap, "the pool is shared");
    let ips: HashSet<Ipv4Addr> = la.iter().chain(&lb).map(|l| l.ip).collect();
    assert_eq!(ips.len() as u32, cap, "an address went to both instances");
    assert_eq!(a.leases().await.unwrap(), la);
    assert_eq!(b.leases().await.unwrap(), lb);
    // Neither can free the other's leases.
    for l in &lb {
        assert!(!a.release_ip(pool.network(), l.ip).await.unwrap());
        assert_eq!(a.release_agent(&l.agent).await.unwrap(), 0);
    }
    assert_eq!(b.leases().await.unwrap(), lb);
    for l in la {
        assert!(a.release_ip(pool.network(), l.ip).await.unwrap());
    }
    for l in lb {
        assert_eq!(b.release_agent(&l.agent).await.unwrap(), 1);
    }
}

/// A store of `url` with owner `owner` and address scope `scope`.
pub async fn open_scoped(
    url: &StoreUrl,
    owner: InstanceId,
    scope: Option<&str>,
) -> Arc<dyn StateStore> {
    let options = kici_store::StoreOptions {
        address_scope: scope.map(|s| s.parse().unwrap()),
        ..kici_store::StoreOptions::default()
    };
    kici_store::open(url, owner, options).await.unwrap()
}

/// Address pools are keyed by scope and network: two machines' stores on
/// one database each get every address of the same network, while stores
/// of one scope share its pool; an instance's leases from before it was
/// scoped move into its scope when it first uses the network (so the agents
/// it adopted keep their addresses and no address is handed out twice),
/// leaving them free in the unscoped pool.
pub async fn address_pools_are_scoped(url: &StoreUrl) {
    let pool: Ipv4Pool = "10.45.0.0/29".parse().unwrap();
    let first = Ipv4Addr::new(10, 45, 0, 2);
    // One instance leases two addresses before it is scoped...
    let owner = InstanceId::random();
    let unscoped = open_scoped(url, owner, None).await;
    assert_eq!(
        unscoped.allocate(&pool, &agent_id(1)).await.unwrap().ip,
        first
    );
    assert_eq!(
        unscoped.allocate(&pool, &agent_id(2)).await.unwrap().ip,
        Ipv4Addr::new(10, 45, 0, 3)
    );
    unscoped.close().await;
    drop(unscoped);

    // ...and is then opened in scope `machine-a`: its agents keep their
    // addresses, a new agent gets the next one.
    let a = open_scoped(url, owner, Some("machine-a")).await;
    let again = a.allocate(&pool, &agent_id(1)).await.unwrap();
    assert_eq!((again.ip, again.network), (first, pool.network()));
    assert_eq!(
        a.allocate(&pool, &agent_id(3)).await.unwrap().ip,
        Ipv4Addr::new(10, 45, 0, 4)
    );
    let held: Vec<Ipv4Addr> = a.leases().await.unwrap().iter().map(|l| l.ip).collect();
    assert_eq!(
        held,
        [
            first,
            Ipv4Addr::new(10, 45, 0, 3),
            Ipv4Addr::new(10, 45, 0, 4)
        ]
    );

    // Another machine's store starts from the first address of its own pool.
    let b = open_scoped(url, InstanceId::random(), Some("machine-b")).await;
    assert_eq!(b.allocate(&pool, &agent_id(10)).await.unwrap().ip, first);
    // A second daemon of machine a shares a's pool.
    let a2 = open_scoped(url, InstanceId::random(), Some("machine-a")).await;
    assert_eq!(
        a2.allocate(&pool, &agent_id(20)).await.unwrap().ip,
        Ipv4Addr::new(10, 45, 0, 5)
    );
    // The moved leases were freed in the unscoped pool.
    let other = open_scoped(url, InstanceId::random(), None).await;
    assert_eq!(
        other.allocate(&pool, &agent_id(30)).await.unwrap().ip,
        first
    );

    // Releasing works per scope: b's release frees b's address only.
    assert!(b.release_ip(pool.network(), first).await.unwrap());
    assert!(a.leases().await.unwrap().iter().any(|l| l.ip == first));
    assert_eq!(a.release_agent(&agent_id(1)).await.unwrap(), 1);
    assert_eq!(a2.allocate(&pool, &agent_id(21)).await.unwrap().ip, first);
    for s in [a, a2, b, other] {
        s.close().await;
    }
}
