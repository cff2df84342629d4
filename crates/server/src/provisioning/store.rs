//! [`StoreClaims`]: `kici-provision`'s [`ClaimStore`] on the daemon's state
//! store (SQLite or PostgreSQL), where a redemption is one conditional
//! `UPDATE` — atomic across every daemon sharing the database.

use kici_model::{AgentId, ScalerName, UnixMillis};
use kici_provision::{
    ClaimFailure, ClaimHash, ClaimRecord, ClaimStore, ClaimStoreError, Redemption, Timestamp,
};
use kici_store::{ClaimRedemption, ClaimRow, StateStore};
use std::sync::Arc;
use std::time::Duration;

/// Claims in the state store.
#[derive(Clone)]
pub struct StoreClaims(pub Arc<dyn StateStore>);

#[derive(Debug, thiserror::Error)]
enum ConvertError {
    #[error("claim for an invalid agent id {0:?}")]
    AgentId(String),
}

fn backend(e: impl std::error::Error + Send + Sync + 'static) -> ClaimStoreError {
    ClaimStoreError::Backend(Box::new(e))
}

pub(crate) fn millis(t: Timestamp) -> UnixMillis {
    UnixMillis(i64::try_from(t.unix_millis()).unwrap_or(i64::MAX))
}

pub(crate) fn timestamp(t: UnixMillis) -> Timestamp {
    Timestamp::from_unix_millis(u64::try_from(t.0).unwrap_or(0))
}

fn to_row(r: &ClaimRecord) -> Result<ClaimRow, ClaimStoreError> {
    let agent_id: AgentId = r
        .agent_id
        .parse()
        .map_err(|_| backend(ConvertError::AgentId(r.agent_id.clone())))?;
    Ok(ClaimRow {
        code_hash: *r.code_hash.as_bytes(),
        agent_id,
        scaler: ScalerName::new(&r.scaler),
        labels: r.labels.clone(),
        gateway_url: r.gateway_url.clone(),
        agent_token_ttl_ms: u64::try_from(r.agent_token_ttl.as_millis()).unwrap_or(u64::MAX),
        issued_at: millis(r.issued_at),
        expires_at: millis(r.expires_at),
        consumed_at: r.consumed_at.map(millis),
    })
}

fn from_row(r: ClaimRow) -> ClaimRecord {
    ClaimRecord {
        code_hash: ClaimHash::from_bytes(r.code_hash),
        agent_id: r.agent_id.to_string(),
        scaler: r.scaler.to_string(),
        labels: r.labels,
        gateway_url: r.gateway_url,
        agent_token_ttl: Duration::from_millis(r.agent_token_ttl_ms),
        issued_at: timestamp(r.issued_at),
        expires_at: timestamp(r.expires_at),
        consumed_at: r.consumed_at.map(timestamp),
    }
}

#[async_trait::async_trait]
impl ClaimStore for StoreClaims {
    async fn insert(&self, record: ClaimRecord) -> Result<(), ClaimStoreError> {
        self.0
            .insert_claim(&to_row(&record)?)
            .await
            .map_err(backend)
    }

    async fn redeem(
        &self,
        hash: &ClaimHash,
        now: Timestamp,
    ) -> Result<Redemption, ClaimStoreError> {
        Ok(
            match self
                .0
                .redeem_claim(hash.as_bytes(), millis(now))
                .await
                .map_err(backend)?
            {
                ClaimRedemption::Granted(row) => Redemption::Granted(from_row(row)),
                ClaimRedemption::Unknown => Redemption::Refused(ClaimFailure::Unknown),
                ClaimRedemption::Consumed => Redemption::Refused(ClaimFailure::Consumed),
                ClaimRedemption::Expired => Redemption::Refused(ClaimFailure::Expired),
            },
        )
    }

    async fn invalidate(&self, agent_id: &str) -> Result<usize, ClaimStoreError> {
        let Ok(agent) = agent_id.parse::<AgentId>() else {
            return Ok(0);
        };
        let n = self.0.invalidate_claims(&agent).await.map_err(backend)?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    async fn purge(&self, horizon: Timestamp) -> Result<usize, ClaimStoreError> {
        let n = self
            .0
            .purge_claims(millis(horizon))
            .await
            .map_err(backend)?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }
}
