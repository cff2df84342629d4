//! A crash right after each store step's side effect (the failpoints the
//! daemon turns into `kill -9`) leaves state the next call cleans up: a
//! lease committed but never reported is returned again to the same agent
//! (allocation is idempotent), and a release that was committed stays done.
//! Needs `--features failpoints`.
#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::*;
use kici_store::{AllocError, Ipv4Pool, StateStore, FAILPOINTS};

async fn lease_survives_a_crash_after_claim(store: &dyn StateStore) {
    let pool: Ipv4Pool = "10.60.0.0/29".parse().unwrap();
    fail::cfg("kici_store::ip::claimed", "return").unwrap();
    let failed = store.allocate(&pool, &agent_id(1)).await;
    fail::remove("kici_store::ip::claimed");
    assert!(matches!(failed, Err(AllocError::Store(_))), "{failed:?}");
    // The claim was committed: the address is held, by that agent.
    let held = store.leases().await.unwrap();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].agent, agent_id(1));
    // The retried spawn gets the same address: nothing leaked.
    let lease = store.allocate(&pool, &agent_id(1)).await.unwrap();
    assert_eq!(lease, held[0]);

    fail::cfg("kici_store::ip::released", "return").unwrap();
    let failed = store.release_agent(&agent_id(1)).await;
    assert!(matches!(failed, Err(AllocError::Store(_))), "{failed:?}");
    let failed = store.release_ip(pool.network(), lease.ip).await;
    assert!(matches!(failed, Err(AllocError::Store(_))), "{failed:?}");
    fail::remove("kici_store::ip::released");
    // The release was committed before the failure.
    assert!(store.leases().await.unwrap().is_empty());
    assert_eq!(store.release_agent(&agent_id(1)).await.unwrap(), 0);
}

// One test function: fail's configuration is process-global.
#[tokio::test]
async fn crash_points_leave_recoverable_state() {
    let scenario = fail::FailScenario::setup();
    assert_eq!(
        FAILPOINTS,
        ["kici_store::ip::claimed", "kici_store::ip::released"]
    );
    let dir = tempfile::tempdir().unwrap();
    let lite = open_fresh(&sqlite_url(&dir)).await;
    lease_survives_a_crash_after_claim(lite.as_ref()).await;
    let db = TestDb::new().await;
    let pg = open_fresh(&db.url).await;
    lease_survives_a_crash_after_claim(pg.as_ref()).await;
    pg.close().await;
    db.drop_db().await;
    scenario.teardown();
}
