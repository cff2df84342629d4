//! The store contract on embedded SQLite (a fresh file per test).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::*;
use kici_model::InstanceId;
use kici_store::{open, StoreError, StoreKind, StoreOptions, StoreUrl};

#[tokio::test]
async fn agents_pending_events() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(&dir);
    let a = open_fresh(&url).await;
    let b = open_fresh(&url).await;
    assert_eq!(a.kind(), StoreKind::Sqlite);
    a.ping().await.unwrap();
    a.reachable().await.unwrap();
    agents_round_trip(a.as_ref(), b.as_ref()).await;
    pending_round_trip(a.as_ref(), b.as_ref()).await;
    jobs_round_trip(a.as_ref(), b.as_ref()).await;
    events_round_trip(a.as_ref(), b.as_ref()).await;
}

#[tokio::test]
async fn rows_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(&dir);
    let owner = InstanceId::random();
    let s = open(&url, owner, StoreOptions::default()).await.unwrap();
    s.put_agent(&sample_agent(7)).await.unwrap();
    let lease = s
        .allocate(&"10.9.0.0/24".parse().unwrap(), &agent_id(7))
        .await
        .unwrap();
    s.close().await;
    drop(s);
    let s = open(&url, owner, StoreOptions::default()).await.unwrap();
    assert_eq!(s.agents().await.unwrap(), vec![sample_agent(7)]);
    assert_eq!(s.leases().await.unwrap(), vec![lease]);
}

/// The store holds job command lines: its file, `-wal` and `-shm` are the
/// owner's only wherever it lives (`--state sqlite:/path` outside the state
/// dir too), a missing parent dir is created 0700, and a file an older
/// version left 0644 is tightened.
#[tokio::test]
async fn the_database_and_its_wal_and_shm_are_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let dir = tempfile::tempdir().unwrap();
    let parent = dir.path().join("elsewhere");
    let db = parent.join("state.db");
    let url = StoreUrl::Sqlite(db.clone());
    let s = open(&url, InstanceId::random(), StoreOptions::default())
        .await
        .unwrap();
    s.put_agent(&sample_agent(1)).await.unwrap();
    assert_eq!(mode(&parent), 0o700, "parent dir");
    for name in ["state.db", "state.db-wal", "state.db-shm"] {
        assert_eq!(mode(&parent.join(name)), 0o600, "{name}");
    }
    s.close().await;
    drop(s);
    for name in ["state.db", "state.db-wal", "state.db-shm"] {
        let p = parent.join(name);
        if p.exists() {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
    }
    let s = open(&url, InstanceId::random(), StoreOptions::default())
        .await
        .unwrap();
    s.put_agent(&sample_agent(2)).await.unwrap();
    for name in ["state.db", "state.db-wal", "state.db-shm"] {
        assert_eq!(mode(&parent.join(name)), 0o600, "{name} after reopen");
    }
}

#[tokio::test]
async fn unwritable_path_is_an_error_not_a_fallback() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let url = StoreUrl::Sqlite(file.join("state.db"));
    match open(&url, InstanceId::random(), StoreOptions::default()).await {
        Err(StoreError::Io { path, .. }) => assert_eq!(path, file),
        Err(e) => panic!("expected Io, got {e}"),
        Ok(_) => panic!("opened a store below a regular file"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_allocators_never_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_fresh(&sqlite_url(&dir)).await;
    concurrent_allocations_are_unique(store, "10.42.0.0/16".parse().unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exhaustion_at_range_size_and_reuse() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_fresh(&sqlite_url(&dir)).await;
    same_agent_concurrently(store.clone(), "10.43.0.32/27".parse().unwrap()).await;
    exhaustion_and_reuse(store.as_ref(), "10.43.0.32/27".parse().unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_owners_on_one_file_share_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(&dir);
    let a = open_fresh(&url).await;
    let b = open_fresh(&url).await;
    two_owners_share_a_pool(a, b, "10.44.0.0/27".parse().unwrap()).await;
}

#[tokio::test]
async fn wal_and_a_clear_error_for_pools_too_large_to_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(&dir);
    let store = open_fresh(&url).await;
    match store
        .allocate(&"10.0.0.0/8".parse().unwrap(), &agent_id(1))
        .await
    {
        Err(kici_store::AllocError::Store(m)) => assert!(m.contains("/12"), "{m}"),
        other => panic!("expected a Store error, got {other:?}"),
    }
    let StoreUrl::Sqlite(path) = url else {
        unreachable!()
    };
    use sqlx::Connection;
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite:{}", path.display()))
        .await
        .unwrap();
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    // open recorded the instance; ping refreshes its heartbeat.
    store.ping().await.unwrap();
    let (host, started, beat): (String, i64, i64) =
        sqlx::query_as("SELECT hostname, started_at, heartbeat_at FROM instances WHERE owner = $1")
            .bind(store.owner().to_string())
            .fetch_one(&mut c)
            .await
            .unwrap();
    assert!(!host.is_empty());
    assert!(beat >= started && started > 0, "{started} {beat}");
}

#[tokio::test]
async fn address_pools_are_scoped_by_machine() {
    let dir = tempfile::tempdir().unwrap();
    address_pools_are_scoped(&sqlite_url(&dir)).await;
}
