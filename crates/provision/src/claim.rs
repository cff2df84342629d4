//! Claim codes: the single-use credential a scale-up event carries instead
//! of an agent token.
//!
//! A code is 256 bits from the operating system's random source, written
//! `kcc_` + 64 lowercase hex (URL-safe, and the prefix lets secret scanners
//! find a leaked one). The daemon keeps only its SHA-256 ([`ClaimHash`]) in a
//! [`ClaimRecord`], so a read of the store never yields a redeemable secret.
//! A code is redeemable once, until its record's `expires_at` (by default
//! [`DEFAULT_CLAIM_TTL`] after issue), and not at all once its agent is
//! destroyed (the record is invalidated).
//!
//! A code can also be **derived** ([`ClaimCode::derive`]) from a per-daemon
//! [`ClaimKey`] (itself 256 bits from the OS), the agent id and the issue
//! time. That is how a crash-safe outbox keeps a scale-up redeliverable
//! without ever storing its code: it stores the agent id and issue time,
//! and re-derives the same code when it delivers again.
//!
//! [`decide`] is the redemption rule as a pure function of a record and
//! `now`; a [`crate::claim_store::ClaimStore`] applies it atomically. The
//! HTTP exchange (`POST {"claimCode": …}` → [`ClaimedCredentials`], or a
//! [`ClaimErrorBody`] naming a [`ClaimFailure`]) is typed here too, so the
//! daemon and `kici-agent-lite` share one definition.

use crate::time::Timestamp;
use rand::rngs::OsRng;
use rand::RngCore;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};
use std::fmt;
use std::time::Duration;

/// `claimTtlSeconds` when a scaler does not set it.
pub const DEFAULT_CLAIM_TTL: Duration = Duration::from_secs(300);
/// The code's prefix.
pub const CODE_PREFIX: &str = "kcc_";
/// Longest claim code text accepted anywhere (a generated one is 68).
pub const MAX_CODE_LEN: usize = 256;

/// A claim code in clear. `Debug` and `Display` redact it; read it with
/// [`ClaimCode::expose`].
#[derive(Clone, PartialEq, Eq)]
pub struct ClaimCode(String);

impl ClaimCode {
    /// A fresh code: 32 bytes from the OS random source.
    pub fn generate() -> Self {
        let mut bytes = [0u8; 32];
        OsRng.fill_bytes(&mut bytes);
        Self(format!("{CODE_PREFIX}{}", hex::encode(bytes)))
    }

    /// A code as a client sent it: any printable ASCII, 1 to
    /// [`MAX_CODE_LEN`] bytes (a malformed code is simply unknown; its shape
    /// is not checked further, so the answer does not depend on it).
    pub fn from_wire(s: &str) -> Result<Self, ClaimCodeError> {
        if s.is_empty() || s.len() > MAX_CODE_LEN || !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ClaimCodeError);
        }
        Ok(Self(s.to_owned()))
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// What the store keeps.
    pub fn hash(&self) -> ClaimHash {
        ClaimHash(Sha256::digest(self.0.as_bytes()).into())
    }
}

impl fmt::Debug for ClaimCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClaimCode(<redacted>)")
    }
}

impl fmt::Display for ClaimCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Serialize for ClaimCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ClaimCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::from_wire(&s).map_err(serde::de::Error::custom)
    }
}

impl ClaimCode {
    /// `kcc_` + hex HMAC-SHA256(`key`, `"kici-claim-v1\0" agent_id "\0" issued_at`):
    /// the same inputs give the same code, unguessable without the key.
    pub fn derive(key: &ClaimKey, agent_id: &str, issued_at: Timestamp) -> Self {
        use hmac::{Hmac, Mac};
        // HMAC accepts keys of any length; a 32-byte key always fits.
        #[allow(clippy::expect_used)]
        let mut mac = Hmac::<Sha256>::new_from_slice(&key.0).expect("HMAC accepts any key length");
        mac.update(b"kici-claim-v1\0");
        mac.update(agent_id.as_bytes());
        mac.update(b"\0");
        mac.update(issued_at.unix_millis().to_string().as_bytes());
        Self(format!(
            "{CODE_PREFIX}{}",
            hex::encode(mac.finalize().into_bytes())
        ))
    }
}

/// A daemon's secret for [`ClaimCode::derive`]: 32 bytes from the OS,
/// persisted by the daemon (e.g. a 0600 file in its state dir, never in the
/// store that holds the claim hashes). `Debug` redacts it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClaimKey([u8; 32]);

impl ClaimKey {
    pub fn generate() -> Self {
        let mut b = [0u8; 32];
        OsRng.fill_bytes(&mut b);
        Self(b)
    }

    pub fn from_bytes(b: [u8; 32]) -> Self {
        Self(b)
    }

    /// For persisting; keep it secret.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        let mut b = [0u8; 32];
        hex::decode_to_slice(s.trim(), &mut b).ok()?;
        Some(Self(b))
    }
}

impl fmt::Debug for ClaimKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClaimKey(<redacted>)")
    }
}

/// A claim code that is empty, too long or not printable ASCII.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a claim code is 1 to 256 printable ASCII characters")]
pub struct ClaimCodeError;

/// SHA-256 of a code's text: the only form a store keeps.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimHash([u8; 32]);

impl ClaimHash {
    pub fn from_bytes(b: [u8; 32]) -> Self {
        Self(b)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        let mut b = [0u8; 32];
        hex::decode_to_slice(s, &mut b).ok()?;
        Some(Self(b))
    }
}

impl fmt::Debug for ClaimHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A prefix identifies a record in logs; the hash is not a secret.
        write!(f, "ClaimHash({}…)", &self.to_hex()[..12])
    }
}

/// A pending claim: what redeeming its code yields, and its state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRecord {
    pub code_hash: ClaimHash,
    /// The agent id the instance must register with.
    pub agent_id: String,
    pub scaler: String,
    /// The labels the minted token is bound to.
    pub labels: Vec<String>,
    /// The WebSocket URL the agent connects to.
    pub gateway_url: String,
    /// How long the token minted on redemption lives (`agentTokenTtlSeconds`).
    pub agent_token_ttl: Duration,
    pub issued_at: Timestamp,
    pub expires_at: Timestamp,
    /// Set, once, by the one redemption that succeeded.
    pub consumed_at: Option<Timestamp>,
}

/// What [`ClaimRecord::issue`] needs besides the clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimSpec {
    pub agent_id: String,
    pub scaler: String,
    pub labels: Vec<String>,
    pub gateway_url: String,
    pub agent_token_ttl: Duration,
    /// `claimTtlSeconds`.
    pub claim_ttl: Duration,
}

impl ClaimRecord {
    /// A fresh code and the record to store for it. The code goes into the
    /// scale-up event and nowhere else.
    pub fn issue(spec: ClaimSpec, now: Timestamp) -> (ClaimCode, Self) {
        let code = ClaimCode::generate();
        let record = Self::for_code(&code, spec, now);
        (code, record)
    }

    /// Like [`Self::issue`] with a derived code ([`ClaimCode::derive`]), so
    /// the code can be re-derived for a redelivery from `key`, the agent id
    /// and `now` (the record's `issued_at`).
    pub fn issue_derived(spec: ClaimSpec, key: &ClaimKey, now: Timestamp) -> (ClaimCode, Self) {
        let code = ClaimCode::derive(key, &spec.agent_id, now);
        let record = Self::for_code(&code, spec, now);
        (code, record)
    }

    fn for_code(code: &ClaimCode, spec: ClaimSpec, now: Timestamp) -> Self {
        Self {
            code_hash: code.hash(),
            agent_id: spec.agent_id,
            scaler: spec.scaler,
            labels: spec.labels,
            gateway_url: spec.gateway_url,
            agent_token_ttl: spec.agent_token_ttl,
            issued_at: now,
            expires_at: now.saturating_add(spec.claim_ttl),
            consumed_at: None,
        }
    }
}

/// Why a code was refused. The wire strings are the `reason` of the
/// refusal; nothing else about the code is revealed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "kebab-case")]
pub enum ClaimFailure {
    /// No such code (never issued, or its agent was destroyed).
    #[error("unknown")]
    Unknown,
    /// Already redeemed once.
    #[error("consumed")]
    Consumed,
    /// Its TTL passed.
    #[error("expired")]
    Expired,
}

impl ClaimFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Consumed => "consumed",
            Self::Expired => "expired",
        }
    }

    /// The HTTP status of a refusal: the same for every reason (403), so a
    /// status line alone tells a prober nothing.
    pub const HTTP_STATUS: u16 = 403;
}

/// The redemption rule: a code is redeemable when its record exists, was
/// not consumed and `now` is before its expiry. A consumed record reports
/// `consumed` even once expired (a replay is the more useful diagnosis).
pub fn decide(record: Option<&ClaimRecord>, now: Timestamp) -> Result<(), ClaimFailure> {
    let record = record.ok_or(ClaimFailure::Unknown)?;
    if record.consumed_at.is_some() {
        return Err(ClaimFailure::Consumed);
    }
    if now >= record.expires_at {
        return Err(ClaimFailure::Expired);
    }
    Ok(())
}

/// `POST <claimUrl>`'s body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimRequest {
    pub claim_code: ClaimCode,
}

/// A successful redemption's answer (200).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimedCredentials {
    /// Freshly minted, bound to `agent_id` and `labels`, short-lived.
    pub agent_token: String,
    pub agent_id: String,
    /// The WebSocket URL to connect to (`KICI_ORCHESTRATOR_URL`).
    pub gateway_url: String,
    pub labels: Vec<String>,
}

impl fmt::Debug for ClaimedCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClaimedCredentials")
            .field("agent_token", &"<redacted>")
            .field("agent_id", &self.agent_id)
            .field("gateway_url", &self.gateway_url)
            .field("labels", &self.labels)
            .finish()
    }
}

/// A refusal's answer: the control API's error shape plus `reason`:
/// `{"error": {"code": "claim-refused", "message": "…", "reason": "expired"}}`
/// (status [`ClaimFailure::HTTP_STATUS`]). Other failures (rate limit 429,
/// malformed body 400) use the same shape without `reason`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimErrorBody {
    pub error: ClaimErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimErrorDetail {
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<ClaimFailure>,
}

/// The `code` of a refusal.
pub const REFUSED_CODE: &str = "claim-refused";

impl ClaimErrorBody {
    pub fn refused(failure: ClaimFailure) -> Self {
        let message = match failure {
            ClaimFailure::Unknown => "no such claim code",
            ClaimFailure::Consumed => "this claim code was already redeemed",
            ClaimFailure::Expired => "this claim code expired",
        };
        Self {
            error: ClaimErrorDetail {
                code: REFUSED_CODE.into(),
                message: message.into(),
                reason: Some(failure),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn record(now: Timestamp) -> (ClaimCode, ClaimRecord) {
        ClaimRecord::issue(
            ClaimSpec {
                agent_id: "scaler-event-4e5f6a7b".into(),
                scaler: "cloud".into(),
                labels: vec!["linux".into()],
                gateway_url: "ws://10.0.0.1:9090/ws".into(),
                agent_token_ttl: Duration::from_secs(600),
                claim_ttl: DEFAULT_CLAIM_TTL,
            },
            now,
        )
    }

    #[test]
    fn generated_codes_are_long_url_safe_and_distinct() {
        let a = ClaimCode::generate();
        let b = ClaimCode::generate();
        assert_ne!(a, b);
        let text = a.expose();
        assert_eq!(text.len(), CODE_PREFIX.len() + 64);
        assert!(text.starts_with(CODE_PREFIX));
        assert!(text[4..]
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_eq!(format!("{a} {a:?}"), "<redacted> ClaimCode(<redacted>)");
    }

    #[test]
    fn only_the_hash_is_recorded() {
        let (code, rec) = record(Timestamp::from_unix_millis(1_000));
        assert_eq!(rec.code_hash, code.hash());
        assert_eq!(
            rec.code_hash.to_hex(),
            hex::encode(Sha256::digest(code.expose().as_bytes()))
        );
        assert_eq!(
            ClaimHash::from_hex(&rec.code_hash.to_hex()),
            Some(rec.code_hash)
        );
        assert!(!format!("{rec:?}").contains(code.expose()));
    }

    #[test]
    fn derived_codes_are_stable_per_inputs_and_keyed() {
        let key = ClaimKey::generate();
        let t = Timestamp::from_unix_millis(42);
        let spec = || ClaimSpec {
            agent_id: "scaler-event-4e5f6a7b".into(),
            scaler: "cloud".into(),
            labels: vec![],
            gateway_url: "ws://h/ws".into(),
            agent_token_ttl: Duration::from_secs(60),
            claim_ttl: DEFAULT_CLAIM_TTL,
        };
        let (code, rec) = ClaimRecord::issue_derived(spec(), &key, t);
        assert_eq!(rec.code_hash, code.hash());
        assert_eq!(ClaimCode::derive(&key, "scaler-event-4e5f6a7b", t), code);
        assert_eq!(code.expose().len(), CODE_PREFIX.len() + 64);
        assert_ne!(ClaimCode::derive(&key, "scaler-event-4e5f6a7c", t), code);
        assert_ne!(
            ClaimCode::derive(
                &key,
                "scaler-event-4e5f6a7b",
                Timestamp::from_unix_millis(43)
            ),
            code
        );
        assert_ne!(
            ClaimCode::derive(&ClaimKey::generate(), "scaler-event-4e5f6a7b", t),
            code
        );
        let again = ClaimKey::from_hex(&key.to_hex()).unwrap();
        assert_eq!(ClaimCode::derive(&again, "scaler-event-4e5f6a7b", t), code);
        assert_eq!(format!("{key:?}"), "ClaimKey(<redacted>)");
    }

    #[test]
    fn decide_follows_the_rule() {
        let t0 = Timestamp::from_unix_millis(1_000_000);
        let (_, mut rec) = record(t0);
        assert_eq!(rec.expires_at, t0.saturating_add(DEFAULT_CLAIM_TTL));
        assert_eq!(decide(None, t0), Err(ClaimFailure::Unknown));
        assert_eq!(decide(Some(&rec), t0), Ok(()));
        let last_ms = Timestamp::from_unix_millis(rec.expires_at.unix_millis() - 1);
        assert_eq!(decide(Some(&rec), last_ms), Ok(()));
        assert_eq!(
            decide(Some(&rec), rec.expires_at),
            Err(ClaimFailure::Expired)
        );
        rec.consumed_at = Some(t0);
        assert_eq!(decide(Some(&rec), t0), Err(ClaimFailure::Consumed));
        assert_eq!(
            decide(Some(&rec), rec.expires_at),
            Err(ClaimFailure::Consumed)
        );
    }

    #[test]
    fn wire_shapes() {
        let req: ClaimRequest = serde_json::from_str(r#"{"claimCode":"kcc_00"}"#).unwrap();
        assert_eq!(req.claim_code.expose(), "kcc_00");
        assert!(serde_json::from_str::<ClaimRequest>(r#"{"claimCode":""}"#).is_err());
        assert!(serde_json::from_str::<ClaimRequest>(r#"{"claimCode":"a b"}"#).is_err());
        assert!(serde_json::from_str::<ClaimRequest>(r#"{"code":"x"}"#).is_err());
        let body = serde_json::to_value(ClaimErrorBody::refused(ClaimFailure::Expired)).unwrap();
        assert_eq!(body["error"]["code"], "claim-refused");
        assert_eq!(body["error"]["reason"], "expired");
        let creds = ClaimedCredentials {
            agent_token: "kat_secret".into(),
            agent_id: "a".into(),
            gateway_url: "ws://h/ws".into(),
            labels: vec![],
        };
        let v = serde_json::to_value(&creds).unwrap();
        assert_eq!(v["agentToken"], "kat_secret");
        assert_eq!(v["gatewayUrl"], "ws://h/ws");
        assert!(!format!("{creds:?}").contains("kat_secret"));
    }
}
