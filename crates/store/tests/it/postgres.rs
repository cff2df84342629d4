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

/// The connections of `owner`'s store, as the server counts them.
async fn connections_of(admin: &mut sqlx::PgConnection, owner: InstanceId) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(format!("kici-scaler {owner}"))
        .fetch_one(admin)
        .await
        .unwrap()
}

/// Whether backend `pid` holds `owner`'s identity lock.
async fn holds_identity(admin: &mut sqlx::PgConnection, pid: i32) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND pid = $1 AND classid = 1802068841)",
    )
    .bind(pid)
    .fetch_one(admin)
    .await
    .unwrap()
}

/// A store's pool is everything it holds: under forty concurrent writers a
/// store of two connections never has a third open, and the identity lock
/// sits on one of the two (the session), not on an extra connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_holds_no_more_connections_than_its_pool_session_included() {
    use sqlx::Connection;
    let db = TestDb::new().await;
    let owner = InstanceId::random();
    let options = StoreOptions {
        max_connections: 2,
        acquire_timeout: std::time::Duration::from_secs(10),
        ..StoreOptions::default()
    };
    let store = open(&db.url, owner, options).await.unwrap();
    let mut admin = sqlx::PgConnection::connect(&db.admin).await.unwrap();
    let session = store
        .postgres()
        .expect("a PostgreSQL store shares its connections")
        .session;
    let pid = session.backend_pid().await.unwrap();
    assert!(
        holds_identity(&mut admin, pid).await,
        "the session holds the identity lock"
    );

    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        let admin_url = db.admin.clone();
        tokio::spawn(async move {
            let mut admin = sqlx::PgConnection::connect(&admin_url).await.unwrap();
            let mut peak = 0;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                peak = peak.max(connections_of(&mut admin, owner).await);
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            peak
        })
    };
    let writers: Vec<_> = (0..40u32)
        .map(|n| {
            let store = store.clone();
            tokio::spawn(async move {
                for i in 0..10u32 {
                    let seq = u64::from(n * 100 + i + 1);
                    store
                        .append_event(seq, kici_store::UnixMillis::now(), "{}")
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let peak = sampler.await.unwrap();
    assert!(peak >= 1, "the sampler saw the store's connections");
    assert!(peak <= 2, "a store of 2 connections had {peak} open");
    assert_eq!(store.events_after(0, 1000).await.unwrap().len(), 400);
    store.close().await;
    // A backend leaves pg_stat_activity a moment after its client hung up.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while connections_of(&mut admin, owner).await > 0 {
        assert!(std::time::Instant::now() < deadline, "closed means closed");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    db.drop_db().await;
}

/// The session is lost (its backend terminated, as a server restart or a
/// partition would): subscribers hear a reset, the generation moves on,
/// notifications arrive again on the new connection, and the store's next
/// ping takes the identity lock back — so a clone started meanwhile is
/// still refused afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_session_is_announced_and_the_identity_lock_taken_back() {
    use kici_store::Notice;
    use sqlx::Connection;
    use std::time::Duration;
    let db = TestDb::new().await;
    let owner = InstanceId::random();
    let store = open(&db.url, owner, StoreOptions::default()).await.unwrap();
    let session = store.postgres().unwrap().session;
    session.listen("kici_test_channel").await.unwrap();
    let mut notices = session.subscribe();
    // NOTIFY is per database: the store's.
    let mut admin = sqlx::PgConnection::connect(&with_database(&db.admin, &db.name))
        .await
        .unwrap();
    async fn notify(admin: &mut sqlx::PgConnection) {
        sqlx::query("SELECT pg_notify('kici_test_channel', 'hello')")
            .execute(admin)
            .await
            .unwrap();
    }
    async fn next(notices: &mut tokio::sync::broadcast::Receiver<Notice>) -> Notice {
        tokio::time::timeout(Duration::from_secs(10), notices.recv())
            .await
            .expect("a notice within 10 s")
            .unwrap()
    }
    notify(&mut admin).await;
    assert_eq!(
        next(&mut notices).await,
        Notice::Notification {
            channel: "kici_test_channel".into(),
            payload: "hello".into()
        }
    );

    let generation = session.generation();
    let pid = session.backend_pid().await.unwrap();
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert!(killed);
    assert_eq!(next(&mut notices).await, Notice::Reset);
    assert!(session.generation() > generation);

    // The next ping takes the lock back, on the new session.
    let start = std::time::Instant::now();
    loop {
        if store.ping().await.is_ok() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "ping never recovered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let new_pid = session.backend_pid().await.unwrap();
    assert_ne!(new_pid, pid);
    assert!(holds_identity(&mut admin, new_pid).await);
    match open(&db.url, owner, StoreOptions::default()).await {
        Err(StoreError::IdentityInUse { .. }) => {}
        Err(e) => panic!("expected IdentityInUse, got {e}"),
        Ok(_) => panic!("a clone opened after the session came back"),
    }
    // And it listens again.
    notify(&mut admin).await;
    assert!(matches!(
        next(&mut notices).await,
        Notice::Notification { .. }
    ));
    store.close().await;
    db.drop_db().await;
}
