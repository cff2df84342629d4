//! Where pending claims live, behind [`ClaimStore`], and the in-memory
//! implementation.
//!
//! The contract every implementation keeps:
//!
//! - **Redemption is atomic.** [`ClaimStore::redeem`] decides ([`decide`])
//!   and marks the record consumed in one step: of any number of concurrent
//!   redemptions of one code — in one process or, for a shared SQL store, on
//!   several daemons — exactly one is granted. The caller mints the agent
//!   token only after `redeem` returned `Granted`, so the consumption is
//!   committed before the token exists: a failed mint does not reopen the
//!   code (fail closed).
//! - **Invalidation is by agent.** [`ClaimStore::invalidate`] removes every
//!   record of an agent (called when it is destroyed); its code is then
//!   `unknown`.
//! - **Consumed records stay until purged**, so a replay is answered
//!   `consumed`, not `unknown`; [`ClaimStore::purge`] drops records whose
//!   expiry is older than a horizon.

use crate::claim::{decide, ClaimFailure, ClaimHash, ClaimRecord};
use crate::time::Timestamp;
use parking_lot::Mutex;
use std::collections::HashMap;

/// The outcome of a redemption.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Redemption {
    /// The record as it now is (consumed): mint a token for it.
    Granted(ClaimRecord),
    Refused(ClaimFailure),
}

/// A store that could not answer.
#[derive(Debug, thiserror::Error)]
pub enum ClaimStoreError {
    /// A record with this hash exists (a generated code never collides; this
    /// is a wiring bug such as inserting a record twice).
    #[error("a claim with hash {0:?} already exists")]
    Duplicate(ClaimHash),
    /// The backing store failed (SQL implementations).
    #[error("claim store: {0}")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Pending claims. See the module docs for the contract.
#[async_trait::async_trait]
pub trait ClaimStore: Send + Sync {
    async fn insert(&self, record: ClaimRecord) -> Result<(), ClaimStoreError>;

    /// Decide and consume in one atomic step.
    async fn redeem(&self, hash: &ClaimHash, now: Timestamp)
        -> Result<Redemption, ClaimStoreError>;

    /// Removes every record of `agent_id`; returns how many there were.
    async fn invalidate(&self, agent_id: &str) -> Result<usize, ClaimStoreError>;

    /// Removes records that expired before `horizon` (consumed or not);
    /// returns how many.
    async fn purge(&self, horizon: Timestamp) -> Result<usize, ClaimStoreError>;
}

/// Claims in this process's memory: enough for one daemon with an
/// in-memory or single-host store, and the reference for the contract.
#[derive(Debug, Default)]
pub struct MemoryClaimStore {
    records: Mutex<HashMap<ClaimHash, ClaimRecord>>,
}

impl MemoryClaimStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.records.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.lock().is_empty()
    }
}

#[async_trait::async_trait]
impl ClaimStore for MemoryClaimStore {
    async fn insert(&self, record: ClaimRecord) -> Result<(), ClaimStoreError> {
        let mut records = self.records.lock();
        if records.contains_key(&record.code_hash) {
            return Err(ClaimStoreError::Duplicate(record.code_hash));
        }
        records.insert(record.code_hash, record);
        Ok(())
    }

    async fn redeem(
        &self,
        hash: &ClaimHash,
        now: Timestamp,
    ) -> Result<Redemption, ClaimStoreError> {
        // Decision and consumption under one lock: the atomic step.
        let mut records = self.records.lock();
        let record = records.get_mut(hash);
        if let Err(failure) = decide(record.as_deref(), now) {
            return Ok(Redemption::Refused(failure));
        }
        match record {
            Some(r) => {
                r.consumed_at = Some(now);
                Ok(Redemption::Granted(r.clone()))
            }
            // `decide` refuses a missing record; kept total without a panic.
            None => Ok(Redemption::Refused(ClaimFailure::Unknown)),
        }
    }

    async fn invalidate(&self, agent_id: &str) -> Result<usize, ClaimStoreError> {
        let mut records = self.records.lock();
        let before = records.len();
        records.retain(|_, r| r.agent_id != agent_id);
        Ok(before - records.len())
    }

    async fn purge(&self, horizon: Timestamp) -> Result<usize, ClaimStoreError> {
        let mut records = self.records.lock();
        let before = records.len();
        records.retain(|_, r| r.expires_at >= horizon);
        Ok(before - records.len())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::claim::{ClaimCode, ClaimSpec, DEFAULT_CLAIM_TTL};
    use std::sync::Arc;
    use std::time::Duration;

    fn spec(agent: &str) -> ClaimSpec {
        ClaimSpec {
            agent_id: agent.into(),
            scaler: "cloud".into(),
            labels: vec!["linux".into()],
            gateway_url: "ws://10.0.0.1:9090/ws".into(),
            agent_token_ttl: Duration::from_secs(600),
            claim_ttl: DEFAULT_CLAIM_TTL,
        }
    }

    const T0: Timestamp = Timestamp::from_unix_millis(1_000_000);

    #[tokio::test]
    async fn redeem_once_then_consumed_and_expired_and_unknown() {
        let store = MemoryClaimStore::new();
        let (code, rec) = ClaimRecord::issue(spec("a1"), T0);
        let expires = rec.expires_at;
        store.insert(rec.clone()).await.unwrap();
        assert!(matches!(
            store.insert(rec).await,
            Err(ClaimStoreError::Duplicate(_))
        ));
        let Redemption::Granted(got) = store.redeem(&code.hash(), T0).await.unwrap() else {
            panic!("first redemption refused")
        };
        assert_eq!(got.agent_id, "a1");
        assert_eq!(got.consumed_at, Some(T0));
        assert_eq!(
            store.redeem(&code.hash(), T0).await.unwrap(),
            Redemption::Refused(ClaimFailure::Consumed)
        );
        let (late, rec) = ClaimRecord::issue(spec("a2"), T0);
        store.insert(rec).await.unwrap();
        assert_eq!(
            store.redeem(&late.hash(), expires).await.unwrap(),
            Redemption::Refused(ClaimFailure::Expired)
        );
        assert_eq!(
            store
                .redeem(&ClaimCode::generate().hash(), T0)
                .await
                .unwrap(),
            Redemption::Refused(ClaimFailure::Unknown)
        );
    }

    #[tokio::test]
    async fn invalidated_codes_are_unknown() {
        let store = MemoryClaimStore::new();
        let (code, rec) = ClaimRecord::issue(spec("a1"), T0);
        store.insert(rec).await.unwrap();
        let (other, rec) = ClaimRecord::issue(spec("a2"), T0);
        store.insert(rec).await.unwrap();
        assert_eq!(store.invalidate("a1").await.unwrap(), 1);
        assert_eq!(store.invalidate("a1").await.unwrap(), 0);
        assert_eq!(
            store.redeem(&code.hash(), T0).await.unwrap(),
            Redemption::Refused(ClaimFailure::Unknown)
        );
        assert!(matches!(
            store.redeem(&other.hash(), T0).await.unwrap(),
            Redemption::Granted(_)
        ));
    }

    #[tokio::test]
    async fn purge_drops_records_expired_before_the_horizon() {
        let store = MemoryClaimStore::new();
        let (_, rec) = ClaimRecord::issue(spec("a1"), T0);
        let expires = rec.expires_at;
        store.insert(rec).await.unwrap();
        assert_eq!(store.purge(expires).await.unwrap(), 0);
        assert_eq!(
            store
                .purge(expires.saturating_add(Duration::from_millis(1)))
                .await
                .unwrap(),
            1
        );
        assert!(store.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn thirty_two_concurrent_redemptions_grant_exactly_one() {
        for _ in 0..20 {
            let store = Arc::new(MemoryClaimStore::new());
            let (code, rec) = ClaimRecord::issue(spec("a1"), T0);
            store.insert(rec).await.unwrap();
            let start = Arc::new(tokio::sync::Barrier::new(32));
            let tasks: Vec<_> = (0..32)
                .map(|_| {
                    let (store, start, hash) = (store.clone(), start.clone(), code.hash());
                    tokio::spawn(async move {
                        start.wait().await;
                        store.redeem(&hash, T0).await.unwrap()
                    })
                })
                .collect();
            let mut granted = 0;
            for t in tasks {
                match t.await.unwrap() {
                    Redemption::Granted(_) => granted += 1,
                    Redemption::Refused(f) => assert_eq!(f, ClaimFailure::Consumed),
                }
            }
            assert_eq!(granted, 1);
        }
    }
}
