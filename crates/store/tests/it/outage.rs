//! PostgreSQL going away under a running store: calls fail with
//! `Unavailable` (bounded by the 1 s acquire timeout, not hanging), nothing
//! recorded is lost, and the same store handle works again once the server
//! is back, advisory lock included.
//!
//! It stops and starts a private server (`KICI_PG_OUTAGE_PORT`, default
//! 54341) so the other tests' server is never disturbed, and restarts it
//! even when an assertion fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::*;
use kici_model::InstanceId;
use kici_store::{open, AllocError, Ipv4Pool, StoreError, StoreOptions, UnixMillis};

/// Restarts the private server when dropped while stopped (a failed
/// assertion between stop and start).
struct RestartOnDrop {
    port: u16,
    stopped: bool,
}

impl RestartOnDrop {
    fn stop(&mut self) {
        pg_script("stop", Some(self.port));
        self.stopped = true;
    }

    fn start(&mut self) {
        pg_script("start", Some(self.port));
        self.stopped = false;
    }
}

impl Drop for RestartOnDrop {
    fn drop(&mut self) {
        if self.stopped {
            // No assert here: a panic while unwinding would abort.
            let _ = std::process::Command::new("bash")
                .arg(script())
                .arg("start")
                .env("KICI_PG_PORT", self.port.to_string())
                .status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_postgres_outage_fails_fast_and_recovers() {
    let port: u16 = std::env::var("KICI_PG_OUTAGE_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(54341);
    // Serialise with any other run of this test on the machine (another
    // session's `cargo test`, a CI run): nextest's serial group only covers
    // its own run, and two runs stopping one server would fail each other.
    let lock_path = std::path::PathBuf::from(
        std::env::var("KICI_PG_BASE").unwrap_or_else(|_| "/var/tmp/kici-scaler-pg".into()),
    );
    std::fs::create_dir_all(&lock_path).unwrap();
    let lock = std::fs::File::create(lock_path.join(format!(".outage-test-{port}.lock"))).unwrap();
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let mut server = RestartOnDrop {
        port,
        stopped: false,
    };
    server.start();
    let db = TestDb::on(&pg_script("url", Some(port))).await;
    let owner = InstanceId::random();
    let store = open(&db.url, owner, StoreOptions::default()).await.unwrap();
    let pool: Ipv4Pool = "10.50.0.0/24".parse().unwrap();

    let mut leases = Vec::new();
    for n in 0..50 {
        store.put_agent(&sample_agent(n)).await.unwrap();
        leases.push(store.allocate(&pool, &agent_id(n)).await.unwrap());
        store
            .append_event(u64::from(n) + 1, UnixMillis(i64::from(n)), "{}")
            .await
            .unwrap();
    }

    server.stop();
    match store.put_agent(&sample_agent(100)).await {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("put_agent during the outage: expected Unavailable, got {other:?}"),
    }
    match store.agents().await {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("agents during the outage: expected Unavailable, got {other:?}"),
    }
    match store.allocate(&pool, &agent_id(100)).await {
        Err(AllocError::Unavailable(_)) => {}
        other => panic!("allocate during the outage: expected Unavailable, got {other:?}"),
    }
    assert!(store.ping().await.unwrap_err().is_unavailable());
    assert!(store.reachable().await.unwrap_err().is_unavailable());

    server.start();
    // The same handle, no reopen: the pool reconnects by itself.
    store.ping().await.unwrap();
    store.reachable().await.unwrap();
    let agents = store.agents().await.unwrap();
    assert_eq!(agents, (0..50).map(sample_agent).collect::<Vec<_>>());
    assert_eq!(store.leases().await.unwrap(), leases);
    assert_eq!(store.events_after(0, 100).await.unwrap().len(), 50);
    // Nothing of the failed calls was half-written.
    assert_eq!(store.agent(&agent_id(100)).await.unwrap(), None);
    store.put_agent(&sample_agent(100)).await.unwrap();
    let l = store.allocate(&pool, &agent_id(100)).await.unwrap();
    assert!(!leases.iter().any(|x| x.ip == l.ip));
    // ping took the advisory lock again: the identity is still exclusive.
    match open(&db.url, owner, StoreOptions::default()).await {
        Err(StoreError::IdentityInUse { .. }) => {}
        Err(e) => panic!("expected IdentityInUse, got {e}"),
        Ok(_) => panic!("a second store opened with the same instance id after the restart"),
    }
    store.close().await;
    db.drop_db().await;
    drop(server);
    drop(lock);
}
