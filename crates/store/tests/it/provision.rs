//! Claims and the provisioner outbox, on SQLite and on PostgreSQL: the
//! same contract run against both.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use kici_model::{AgentId, ScalerName, ScalerType, UnixMillis};
use kici_store::{ClaimRedemption, ClaimRow, OutboxRecord, StateStore};
use std::sync::Arc;

fn event_agent(n: u32) -> AgentId {
    AgentId::new(ScalerType::Event, n.to_be_bytes())
}

fn claim(n: u8, agent: AgentId, expires_at: i64) -> ClaimRow {
    ClaimRow {
        code_hash: [n; 32],
        agent_id: agent,
        scaler: ScalerName::new("cloud"),
        labels: vec!["linux".into(), "kici:scaler:cloud".into()],
        gateway_url: "ws://10.0.0.1:9090/ws".into(),
        agent_token_ttl_ms: 600_000,
        issued_at: UnixMillis(1_000),
        expires_at: UnixMillis(expires_at),
        consumed_at: None,
    }
}

/// Single use, expiry, unknown codes, invalidation by agent, purge; and a
/// code issued by one instance is unknown to another sharing the store (its
/// agent registers with the issuer: a token minted elsewhere would only
/// burn the code).
async fn claims_contract(a: Arc<dyn StateStore>, b: Arc<dyn StateStore>) {
    let agent = event_agent(1);
    let row = claim(1, agent, 10_000);
    a.insert_claim(&row).await.unwrap();
    assert!(a.insert_claim(&row).await.is_err(), "a hash is unique");

    assert_eq!(
        b.redeem_claim(&[1; 32], UnixMillis(2_000)).await.unwrap(),
        ClaimRedemption::Unknown,
        "another instance's code"
    );
    match a.redeem_claim(&[1; 32], UnixMillis(2_000)).await.unwrap() {
        ClaimRedemption::Granted(got) => {
            assert_eq!(got.agent_id, agent);
            assert_eq!(got.labels, row.labels);
            assert_eq!(got.gateway_url, row.gateway_url);
            assert_eq!(got.agent_token_ttl_ms, 600_000);
            assert_eq!(got.consumed_at, Some(UnixMillis(2_000)));
        }
        other => panic!("expected a grant, got {other:?}"),
    }
    assert_eq!(
        a.redeem_claim(&[1; 32], UnixMillis(2_001)).await.unwrap(),
        ClaimRedemption::Consumed
    );
    assert_eq!(
        b.redeem_claim(&[1; 32], UnixMillis(2_001)).await.unwrap(),
        ClaimRedemption::Unknown,
        "consumed or not, another instance's code says nothing"
    );
    // A consumed code stays `consumed` after its expiry.
    assert_eq!(
        a.redeem_claim(&[1; 32], UnixMillis(20_000)).await.unwrap(),
        ClaimRedemption::Consumed
    );
    assert_eq!(
        a.redeem_claim(&[9; 32], UnixMillis(2_000)).await.unwrap(),
        ClaimRedemption::Unknown
    );

    a.insert_claim(&claim(2, event_agent(2), 10_000))
        .await
        .unwrap();
    assert_eq!(
        a.redeem_claim(&[2; 32], UnixMillis(10_000)).await.unwrap(),
        ClaimRedemption::Expired,
        "refused from its expiry instant on"
    );

    a.insert_claim(&claim(3, event_agent(3), 10_000))
        .await
        .unwrap();
    assert_eq!(a.invalidate_claims(&event_agent(3)).await.unwrap(), 1);
    assert_eq!(
        a.redeem_claim(&[3; 32], UnixMillis(2_000)).await.unwrap(),
        ClaimRedemption::Unknown,
        "a destroyed agent's code is unknown"
    );

    assert_eq!(a.purge_claims(UnixMillis(10_001)).await.unwrap(), 2);
    assert_eq!(
        a.redeem_claim(&[1; 32], UnixMillis(2_000)).await.unwrap(),
        ClaimRedemption::Unknown
    );
}

/// Many concurrent redemptions of one code, through the issuer and another
/// instance: exactly one grant, by the issuer; the other instance never
/// consumes it.
async fn one_grant_among_concurrent(a: Arc<dyn StateStore>, b: Arc<dyn StateStore>) {
    a.insert_claim(&claim(7, event_agent(7), i64::MAX))
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let (s, issuer) = if i % 2 == 0 {
            (a.clone(), true)
        } else {
            (b.clone(), false)
        };
        tasks.push(tokio::spawn(async move {
            (
                issuer,
                s.redeem_claim(&[7; 32], UnixMillis(5_000)).await.unwrap(),
            )
        }));
    }
    let mut granted = 0;
    for t in tasks {
        match t.await.unwrap() {
            (true, ClaimRedemption::Granted(_)) => granted += 1,
            (true, ClaimRedemption::Consumed) | (false, ClaimRedemption::Unknown) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(granted, 1);
}

async fn outbox_contract(a: Arc<dyn StateStore>, b: Arc<dyn StateStore>) {
    let agent = event_agent(4);
    let up = OutboxRecord {
        request_id: format!("i.{agent}.scale-up"),
        agent_id: agent,
        kind: "scale-up".into(),
        body: r#"{"event":"scale-up"}"#.into(),
        created_at: UnixMillis(1),
        delivered_at: None,
    };
    a.put_outbox(&up).await.unwrap();
    // A redelivery keeps the first record.
    a.put_outbox(&OutboxRecord {
        body: "changed".into(),
        ..up.clone()
    })
    .await
    .unwrap();
    assert_eq!(a.outbox().await.unwrap(), std::slice::from_ref(&up));
    assert!(b.outbox().await.unwrap().is_empty(), "rows are per owner");
    assert!(a
        .mark_outbox_delivered(&up.request_id, UnixMillis(2))
        .await
        .unwrap());
    assert!(!b
        .mark_outbox_delivered(&up.request_id, UnixMillis(2))
        .await
        .unwrap());
    let down = OutboxRecord {
        request_id: format!("i.{agent}.scale-down"),
        kind: "scale-down".into(),
        created_at: UnixMillis(3),
        ..up.clone()
    };
    a.put_outbox(&down).await.unwrap();
    let rows = a.outbox().await.unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].delivered_at, Some(UnixMillis(2)));
    assert_eq!(rows[1].delivered_at, None);
    assert_eq!(a.delete_outbox_agent(&agent).await.unwrap(), 2);
    assert!(a.outbox().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_claims_and_outbox() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(&dir);
    let (a, b) = (open_fresh(&url).await, open_fresh(&url).await);
    claims_contract(a.clone(), b.clone()).await;
    one_grant_among_concurrent(a.clone(), b.clone()).await;
    outbox_contract(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_claims_and_outbox() {
    let db = TestDb::new().await;
    let (a, b) = (open_fresh(&db.url).await, open_fresh(&db.url).await);
    claims_contract(a.clone(), b.clone()).await;
    one_grant_among_concurrent(a.clone(), b.clone()).await;
    outbox_contract(a.clone(), b.clone()).await;
    a.close().await;
    b.close().await;
    db.drop_db().await;
}
