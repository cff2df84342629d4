//! One redemption from start to answer, shared by every door a code comes
//! in through (`POST /v1/claims`, the gateway's `scaler.claim-credentials`):
//! parse the code, consume it atomically in the [`ClaimStore`], and only
//! then mint the agent token.
//!
//! The order is the security property: consumption is committed before a
//! token exists, so two concurrent redemptions (on two daemons sharing a
//! store too) mint at most one token, and a mint that fails leaves the code
//! consumed (fail closed) — the provision then times out and is torn down
//! like any agent that never registered.
//!
//! Rate limiting is the caller's (it knows the source address): check a
//! [`crate::RateLimiter`] before calling [`redeem`].

use crate::claim::{
    ClaimCode, ClaimErrorBody, ClaimErrorDetail, ClaimFailure, ClaimRecord, ClaimedCredentials,
};
use crate::claim_store::{ClaimStore, ClaimStoreError, Redemption};
use crate::time::Timestamp;

/// Why a redemption produced no credentials.
#[derive(Debug, thiserror::Error)]
pub enum RedeemError {
    /// Not a claim code at all (empty, too long, not printable ASCII).
    #[error("malformed claim code")]
    Malformed,
    /// Unknown, consumed or expired.
    #[error("claim refused: {0}")]
    Refused(ClaimFailure),
    /// The store could not answer; the code may or may not be consumed.
    #[error(transparent)]
    Store(#[from] ClaimStoreError),
    /// The code was consumed but no token could be minted.
    #[error("minting the agent token failed: {0}")]
    Mint(String),
}

impl RedeemError {
    /// The HTTP status to answer with.
    pub fn http_status(&self) -> u16 {
        match self {
            Self::Malformed => 400,
            Self::Refused(_) => ClaimFailure::HTTP_STATUS,
            Self::Store(_) => 503,
            Self::Mint(_) => 500,
        }
    }

    /// The body to answer with (the control API's error shape). Internal
    /// failures say nothing about the store or the token beyond their kind.
    pub fn body(&self) -> ClaimErrorBody {
        let plain = |code: &str, message: &str| ClaimErrorBody {
            error: ClaimErrorDetail {
                code: code.to_owned(),
                message: message.to_owned(),
                reason: None,
            },
        };
        match self {
            Self::Refused(f) => ClaimErrorBody::refused(*f),
            Self::Malformed => plain("invalid-value", "claimCode is not a claim code"),
            Self::Store(_) => plain("store-unavailable", "the claim store did not answer; retry"),
            Self::Mint(_) => plain("internal", "the agent token could not be minted"),
        }
    }
}

/// Redeems `code_text` at `now`: consume, then `mint(record)` the token
/// (bound to the record's agent id and labels, living
/// `record.agent_token_ttl`).
pub async fn redeem<S, M, E>(
    store: &S,
    code_text: &str,
    now: Timestamp,
    mint: M,
) -> Result<ClaimedCredentials, RedeemError>
where
    S: ClaimStore + ?Sized,
    M: FnOnce(&ClaimRecord) -> Result<String, E>,
    E: std::fmt::Display,
{
    let code = ClaimCode::from_wire(code_text).map_err(|_| RedeemError::Malformed)?;
    let record = match store.redeem(&code.hash(), now).await? {
        Redemption::Granted(r) => r,
        Redemption::Refused(f) => return Err(RedeemError::Refused(f)),
    };
    let agent_token = mint(&record).map_err(|e| RedeemError::Mint(e.to_string()))?;
    Ok(ClaimedCredentials {
        agent_token,
        agent_id: record.agent_id,
        gateway_url: record.gateway_url,
        labels: record.labels,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::claim::{ClaimSpec, DEFAULT_CLAIM_TTL};
    use crate::claim_store::MemoryClaimStore;
    use std::time::Duration;

    const T0: Timestamp = Timestamp::from_unix_millis(5_000_000);

    async fn issued(store: &MemoryClaimStore) -> ClaimCode {
        let (code, rec) = ClaimRecord::issue(
            ClaimSpec {
                agent_id: "scaler-event-0a1b2c3d".into(),
                scaler: "cloud".into(),
                labels: vec!["linux".into()],
                gateway_url: "ws://10.0.0.1:9090/ws".into(),
                agent_token_ttl: Duration::from_secs(600),
                claim_ttl: DEFAULT_CLAIM_TTL,
            },
            T0,
        );
        store.insert(rec).await.unwrap();
        code
    }

    #[tokio::test]
    async fn consumes_then_mints_once() {
        let store = MemoryClaimStore::new();
        let code = issued(&store).await;
        let creds = redeem(&store, code.expose(), T0, |r: &ClaimRecord| {
            assert!(r.consumed_at.is_some(), "consumed before the mint");
            assert_eq!(r.agent_token_ttl, Duration::from_secs(600));
            Ok::<_, String>("kat_minted".to_owned())
        })
        .await
        .unwrap();
        assert_eq!(creds.agent_token, "kat_minted");
        assert_eq!(creds.agent_id, "scaler-event-0a1b2c3d");
        assert_eq!(creds.gateway_url, "ws://10.0.0.1:9090/ws");
        assert_eq!(creds.labels, ["linux"]);

        let err = redeem(
            &store,
            code.expose(),
            T0,
            |_: &ClaimRecord| -> Result<String, String> { panic!("a refused code must not mint") },
        )
        .await
        .unwrap_err();
        assert!(matches!(err, RedeemError::Refused(ClaimFailure::Consumed)));
        assert_eq!(err.http_status(), 403);
        let body = serde_json::to_value(err.body()).unwrap();
        assert_eq!(body["error"]["reason"], "consumed");
    }

    #[tokio::test]
    async fn a_failed_mint_leaves_the_code_consumed() {
        let store = MemoryClaimStore::new();
        let code = issued(&store).await;
        let err = redeem(&store, code.expose(), T0, |_: &ClaimRecord| {
            Err::<String, _>("token store down")
        })
        .await
        .unwrap_err();
        assert!(matches!(err, RedeemError::Mint(_)));
        assert_eq!(err.http_status(), 500);
        let again = redeem(&store, code.expose(), T0, |_: &ClaimRecord| {
            Ok::<_, String>("kat_x".to_owned())
        })
        .await
        .unwrap_err();
        assert!(matches!(
            again,
            RedeemError::Refused(ClaimFailure::Consumed)
        ));
    }

    #[tokio::test]
    async fn malformed_and_unknown() {
        let store = MemoryClaimStore::new();
        let mint = |_: &ClaimRecord| Ok::<_, String>("kat_x".to_owned());
        let err = redeem(&store, "", T0, mint).await.unwrap_err();
        assert!(matches!(err, RedeemError::Malformed));
        assert_eq!(err.http_status(), 400);
        let err = redeem(&store, "kcc_nope", T0, mint).await.unwrap_err();
        assert!(matches!(err, RedeemError::Refused(ClaimFailure::Unknown)));
    }
}
