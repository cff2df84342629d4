//! The store contract on a real PostgreSQL (`KICI_SCALER_TEST_POSTGRES`, or
//! the server `scripts/postgres.sh start` runs; never skipped). Each test
//! gets a database of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::*;
use kici_model::InstanceId;
use kici_store::{open, StoreError, StoreKind, StoreOptions};

#[tokio::test]
async fn agents_pending_events() {
    let db = TestDb::new().await;
    let a = open_fresh(&db.url).await;
    let b = open_fresh(&db.url).await;
    assert_eq!(a.kind(), StoreKind::Postgres);
    a.ping().await.unwrap();
    agents_round_trip(a.as_ref(), b.as_ref()).await;
    pending_round_trip(a.as_ref(), b.as_ref()).await;
    jobs_round_trip(a.as_ref(), b.as_ref()).await;
    events_round_trip(a.as_ref(), b.as_ref()).await;
    a.close().await;
    b.close().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_allocators_never_duplicate() {
    let db = TestDb::new().await;
    let options = StoreOptions {
        max_connections: 32,
        ..StoreOptions::default()
    };
    let store = open(&db.url, InstanceId::random(), options).await.unwrap();
    concurrent_allocations_are_unique(store.clone(), "10.42.0.0/16".parse().unwrap()).await;
    store.close().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exhaustion_at_range_size_and_reuse() {
    let db = TestDb::new().await;
    let store = open_fresh(&db.url).await;
    same_agent_concurrently(store.clone(), "10.43.0.32/27".parse().unwrap()).await;
    exhaustion_and_reuse(store.as_ref(), "10.43.0.32/27".parse().unwrap()).await;
    store.close().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_share_one_pool_without_duplicates() {
    let db = TestDb::new().await;
    let a = open_fresh(&db.url).await;
    let b = open_fresh(&db.url).await;
    two_owners_share_a_pool(a.clone(), b.clone(), "10.44.0.0/27".parse().unwrap()).await;
    a.close().await;
    b.close().await;
    db.drop_db().await;
}

/// Two daemons cloned from one image (one instance id) cannot both open
/// the store; once the first closes, the id is free again.
#[tokio::test]
async fn one_instance_id_one_session() {
    let db = TestDb::new().await;
    let owner = InstanceId::random();
    let first = open(&db.url, owner, StoreOptions::default()).await.unwrap();
    match open(&db.url, owner, StoreOptions::default()).await {
        Err(StoreError::IdentityInUse { owner: o }) => assert_eq!(o, owner),
        Err(e) => panic!("expected IdentityInUse, got {e}"),
        Ok(_) => panic!("a second store opened with the same instance id"),
    }
    // Another id is fine alongside.
    let other = open_fresh(&db.url).await;
    first.ping().await.unwrap();
    first.close().await;
    let again = open(&db.url, owner, StoreOptions::default()).await.unwrap();
    again.close().await;
    other.close().await;
    db.drop_db().await;
}

#[tokio::test]
async fn address_pools_are_scoped_by_machine() {
    let db = TestDb::new().await;
    address_pools_are_scoped(&db.url).await;
    db.drop_db().await;
}
