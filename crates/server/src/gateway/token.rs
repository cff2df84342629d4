//! Agent bootstrap tokens and the other secrets the daemon handles.
//!
//! This module owns the ephemeral agent token store (KiCI's token contract,
//! hardened: revoked on destroy, only a hash kept): a token is `kat_` + 64 lowercase hex (256
//! bits from the OS RNG), minted once per spawn, bound to one agent id, valid
//! for the scaler's `maxLifetime` (so a long job is never cut off), revoked
//! when the agent is destroyed. Only the SHA-256 of a token is kept;
//! presented tokens are hashed and compared in constant time.
//!
//! [`TokenBootstrapper`] is the engine's [`Bootstrapper`]: it mints the token
//! and picks the URL the agent connects back to. The agent gateway (`/ws`)
//! checks tokens with [`TokenStore::verify`], as `POST
//! /v1/agents/{id}/registered` does.
//!
//! Tokens are [`kici_model::Secret`]s (re-exported here as [`Secret`]): their
//! `Debug` and `Display` redact.

use kici_engine::runtime::{Bootstrap, Bootstrapper};
use kici_engine::SpawnOrder;
use kici_model::{AgentId, Label, LabelSet};
use parking_lot::Mutex;
use rand::RngCore;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;

pub use kici_model::Secret;

/// The token prefix of the KiCI contract.
pub const TOKEN_PREFIX: &str = "kat_";
/// Random bytes per token (256 bits).
const TOKEN_BYTES: usize = 32;

fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

/// Why a presented token was refused. The API answers every kind with the
/// same 401 (a caller learns nothing about other agents' tokens); the kinds
/// exist for the log and the tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenRejection {
    #[error("no live token was minted for this agent")]
    NoToken,
    #[error("the token does not match the one minted for this agent")]
    Mismatch,
    #[error("the token has expired")]
    Expired,
}

/// Why a token could not be minted.
#[derive(Debug, thiserror::Error)]
#[error("the OS random number generator failed: {0}")]
pub struct MintError(rand::Error);

#[derive(Debug, Clone)]
struct TokenRecord {
    hash: [u8; 32],
    expires: Instant,
    /// The labels handed to the agent (`KICI_LABELS`): what it may register
    /// with, beside its own host labels.
    scope: LabelSet,
}

/// What a valid token authorises: one agent id and its label scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenGrant {
    pub agent: AgentId,
    pub scope: LabelSet,
}

/// Where a [`TokenStore`] reads the time (tests move it by hand).
pub type Clock = std::sync::Arc<dyn Fn() -> Instant + Send + Sync>;

/// Hashes of the live tokens, one per agent.
pub struct TokenStore {
    tokens: Mutex<HashMap<AgentId, TokenRecord>>,
    clock: Clock,
}

impl Default for TokenStore {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for TokenStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenStore")
            .field("tokens", &self.len())
            .finish_non_exhaustive()
    }
}

impl TokenStore {
    pub fn new() -> Self {
        Self::with_clock(std::sync::Arc::new(Instant::now))
    }

    pub fn with_clock(clock: Clock) -> Self {
        Self {
            tokens: Mutex::new(HashMap::new()),
            clock,
        }
    }

    /// Mints a fresh token for `agent`, valid for `ttl` from now, authorising
    /// the labels in `scope`, replacing any earlier one. The plaintext is
    /// returned once and not kept.
    pub fn mint(
        &self,
        agent: AgentId,
        ttl: Duration,
        scope: LabelSet,
    ) -> Result<Secret, MintError> {
        let now = (self.clock)();
        let mut bytes = [0u8; TOKEN_BYTES];
        rand::rngs::OsRng
            .try_fill_bytes(&mut bytes)
            .map_err(MintError)?;
        let token = format!("{TOKEN_PREFIX}{}", hex::encode(bytes));
        let record = TokenRecord {
            hash: sha256(token.as_bytes()),
            // A TTL too large for the clock means "for the agent's life".
            expires: now
                .checked_add(ttl)
                .or_else(|| now.checked_add(CENTURY))
                .unwrap_or(now),
            scope,
        };
        let mut tokens = self.tokens.lock();
        // Expired records are dropped here, so the map is bounded by the
        // agents minted within one TTL even if a revoke was missed.
        tokens.retain(|_, r| r.expires > now);
        tokens.insert(agent, record);
        Ok(Secret::new(token))
    }

    /// Checks `presented` against the token minted for `agent`.
    pub fn verify(&self, agent: AgentId, presented: &str) -> Result<(), TokenRejection> {
        let now = (self.clock)();
        let tokens = self.tokens.lock();
        let record = tokens.get(&agent).ok_or(TokenRejection::NoToken)?;
        let presented = sha256(presented.as_bytes());
        if !bool::from(record.hash.ct_eq(&presented)) {
            return Err(TokenRejection::Mismatch);
        }
        if record.expires <= now {
            return Err(TokenRejection::Expired);
        }
        Ok(())
    }

    /// Finds the agent `presented` was minted for (the agent gateway's
    /// `auth.request` carries only the token). Every live record is compared
    /// in constant time, without an early exit, so the time taken depends on
    /// the number of tokens only, never on how much of one matched.
    pub fn identify(&self, presented: &str) -> Result<TokenGrant, TokenRejection> {
        let now = (self.clock)();
        let presented = sha256(presented.as_bytes());
        let tokens = self.tokens.lock();
        let mut found: Option<(&AgentId, &TokenRecord)> = None;
        for (agent, record) in tokens.iter() {
            if bool::from(record.hash.ct_eq(&presented)) {
                found = Some((agent, record));
            }
        }
        let (agent, record) = found.ok_or(TokenRejection::Mismatch)?;
        if record.expires <= now {
            return Err(TokenRejection::Expired);
        }
        Ok(TokenGrant {
            agent: *agent,
            scope: record.scope.clone(),
        })
    }

    /// The hash of `agent`'s token (hex) and the time it has left, for the
    /// state store: a re-adopted agent keeps the token it was given.
    pub fn export(&self, agent: AgentId) -> Option<(String, Duration)> {
        let now = (self.clock)();
        let tokens = self.tokens.lock();
        let r = tokens.get(&agent)?;
        Some((
            hex::encode(r.hash),
            r.expires.saturating_duration_since(now),
        ))
    }

    /// Re-installs a token recorded by [`TokenStore::export`] before a
    /// restart. A malformed hash is refused (the agent then cannot register
    /// and is reaped by its registration deadline).
    pub fn restore(
        &self,
        agent: AgentId,
        hash_hex: &str,
        remaining: Duration,
        scope: LabelSet,
    ) -> Result<(), TokenRejection> {
        let mut hash = [0u8; 32];
        hex::decode_to_slice(hash_hex, &mut hash).map_err(|_| TokenRejection::Mismatch)?;
        let now = (self.clock)();
        self.tokens.lock().insert(
            agent,
            TokenRecord {
                hash,
                expires: now.checked_add(remaining).unwrap_or(now),
                scope,
            },
        );
        Ok(())
    }

    /// Forgets `agent`'s token. Returns whether there was one.
    pub fn revoke(&self, agent: AgentId) -> bool {
        self.tokens.lock().remove(&agent).is_some()
    }

    /// Live (minted, not revoked) token count, expired ones included until
    /// the next mint sweeps them.
    pub fn len(&self) -> usize {
        self.tokens.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Far enough ahead to mean "never".
const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The engine's [`Bootstrapper`]: a token per spawn and the URL to connect
/// back to.
pub struct TokenBootstrapper {
    store: std::sync::Arc<TokenStore>,
    gateway_url: String,
    /// Per backend type, the gateway URL on that backend's network.
    per_backend: std::collections::BTreeMap<kici_model::ScalerType, String>,
}

impl TokenBootstrapper {
    /// `gateway` is `--gateway-listen`; agents of scalers without an
    /// `orchestratorUrl` connect there.
    pub fn new(store: std::sync::Arc<TokenStore>, gateway: SocketAddr) -> Self {
        Self {
            store,
            gateway_url: gateway_url(gateway),
            per_backend: Default::default(),
        }
    }

    /// Agents of `kind` connect to `addr` (their network's gateway address)
    /// instead of the main listener.
    pub fn with_backend_gateway(mut self, kind: kici_model::ScalerType, addr: SocketAddr) -> Self {
        self.per_backend.insert(kind, gateway_url(addr));
        self
    }

    pub fn gateway_url(&self) -> &str {
        &self.gateway_url
    }
}

/// `ws://<gateway>/ws`. An unspecified bind address (`0.0.0.0`, `::`) is not
/// an address to connect to: agents get loopback. (The per-backend choice —
/// the container network's or the bridge's gateway — arrives with those
/// backends.)
pub fn gateway_url(gateway: SocketAddr) -> String {
    let mut addr = gateway;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    format!("ws://{addr}/ws")
}

impl Bootstrapper for TokenBootstrapper {
    fn bootstrap(&self, order: &SpawnOrder) -> Bootstrap {
        let scaler = order.scaler();
        let ttl = scaler.ext.deadlines.max_lifetime;
        // `KICI_LABELS` as the backend writes it: the agent may register
        // with these (plus its own host labels) and nothing else.
        let scope = LabelSet::from_labels(
            order
                .agent_labels
                .iter()
                .filter_map(|raw| Label::parse(raw).ok()),
        );
        let token = match self.store.mint(order.agent, ttl, scope) {
            Ok(token) => Some(token),
            Err(e) => {
                // The agent cannot register without one and is reaped by its
                // registration deadline; nothing else can be done here.
                tracing::error!(agent_id = %order.agent, error = %e, "cannot mint an agent token");
                None
            }
        };
        Bootstrap {
            orchestrator_url: scaler.orchestrator_url.clone().unwrap_or_else(|| {
                self.per_backend
                    .get(&scaler.kind)
                    .unwrap_or(&self.gateway_url)
                    .clone()
            }),
            token,
        }
    }

    fn revoke(&self, agent: AgentId) {
        self.store.revoke(agent);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kici_model::ScalerType;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// A store whose clock moves only when the returned handle is advanced.
    fn store() -> (TokenStore, Arc<AtomicU64>) {
        let start = Instant::now();
        let offset = Arc::new(AtomicU64::new(0));
        let o = offset.clone();
        let clock: Clock = Arc::new(move || start + Duration::from_secs(o.load(Ordering::SeqCst)));
        (TokenStore::with_clock(clock), offset)
    }

    fn agent(n: u8) -> AgentId {
        AgentId::new(ScalerType::BareMetal, [0, 0, 0, n])
    }

    fn scope() -> LabelSet {
        LabelSet::parse(["linux", "kici:agent:bare-metal"]).unwrap()
    }

    #[test]
    fn an_exported_token_restored_in_a_new_store_still_verifies_until_its_expiry() {
        let (old, clock) = store();
        let token = old
            .mint(agent(1), Duration::from_secs(60), scope())
            .unwrap();
        clock.store(20, Ordering::SeqCst);
        let (hash, remaining) = old.export(agent(1)).unwrap();
        assert_eq!(remaining, Duration::from_secs(40));
        assert!(!hash.contains("kat_"), "only the hash leaves the store");
        let (new, clock2) = store();
        new.restore(agent(1), &hash, remaining, scope()).unwrap();
        assert_eq!(new.verify(agent(1), token.expose()), Ok(()));
        assert_eq!(new.identify(token.expose()).unwrap().scope, scope());
        clock2.store(40, Ordering::SeqCst);
        assert_eq!(
            new.verify(agent(1), token.expose()),
            Err(TokenRejection::Expired)
        );
        assert!(new.restore(agent(2), "zz", remaining, scope()).is_err());
        assert_eq!(old.export(agent(9)), None);
    }

    #[test]
    fn identify_finds_the_agent_and_scope_of_a_live_token() {
        let (store, clock) = store();
        let a = store
            .mint(agent(1), Duration::from_secs(60), scope())
            .unwrap();
        let b = store
            .mint(agent(2), Duration::from_secs(120), LabelSet::default())
            .unwrap();
        assert_eq!(
            store.identify(a.expose()),
            Ok(TokenGrant {
                agent: agent(1),
                scope: scope()
            })
        );
        assert_eq!(store.identify(b.expose()).unwrap().agent, agent(2));
        assert_eq!(store.identify("kat_00"), Err(TokenRejection::Mismatch));
        clock.store(60, Ordering::SeqCst);
        assert_eq!(store.identify(a.expose()), Err(TokenRejection::Expired));
        assert!(store.revoke(agent(2)));
        assert_eq!(
            store.identify(b.expose()),
            Err(TokenRejection::Mismatch),
            "a revoked token is unknown"
        );
    }

    #[test]
    fn a_token_is_kat_and_64_lowercase_hex_and_unique() {
        let store = TokenStore::new();
        let a = store
            .mint(agent(1), Duration::from_secs(60), scope())
            .unwrap();
        let b = store
            .mint(agent(2), Duration::from_secs(60), scope())
            .unwrap();
        for t in [&a, &b] {
            let hex = t.expose().strip_prefix("kat_").unwrap();
            assert_eq!(hex.len(), 64);
            assert!(hex.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')));
        }
        assert_ne!(a, b);
    }

    #[test]
    fn verify_accepts_only_the_agents_own_live_token() {
        let (store, clock) = store();
        let ttl = Duration::from_secs(60);
        let mine = store.mint(agent(1), ttl, scope()).unwrap();
        let other = store.mint(agent(2), ttl, scope()).unwrap();
        assert_eq!(store.verify(agent(1), mine.expose()), Ok(()));
        // Reconnects within the TTL authenticate again (not single-use).
        clock.store(59, Ordering::SeqCst);
        assert_eq!(store.verify(agent(1), mine.expose()), Ok(()));
        assert_eq!(
            store.verify(agent(1), other.expose()),
            Err(TokenRejection::Mismatch),
            "a token bound to another agent"
        );
        assert_eq!(
            store.verify(agent(1), "kat_00"),
            Err(TokenRejection::Mismatch)
        );
        assert_eq!(
            store.verify(agent(3), mine.expose()),
            Err(TokenRejection::NoToken)
        );
        clock.store(60, Ordering::SeqCst);
        assert_eq!(
            store.verify(agent(1), mine.expose()),
            Err(TokenRejection::Expired)
        );
    }

    #[test]
    fn revoke_forgets_the_token() {
        let store = TokenStore::new();
        let t = store
            .mint(agent(1), Duration::from_secs(60), scope())
            .unwrap();
        assert!(store.revoke(agent(1)));
        assert!(!store.revoke(agent(1)));
        assert_eq!(
            store.verify(agent(1), t.expose()),
            Err(TokenRejection::NoToken)
        );
    }

    #[test]
    fn expired_records_are_swept_by_the_next_mint() {
        let (store, clock) = store();
        store
            .mint(agent(1), Duration::from_secs(1), scope())
            .unwrap();
        clock.store(2, Ordering::SeqCst);
        store
            .mint(agent(2), Duration::from_secs(60), scope())
            .unwrap();
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn secrets_never_format_their_value() {
        let s = Secret::new("kat_deadbeef");
        assert_eq!(format!("{s}"), "<redacted>");
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        assert!(!format!("{:?}", Some(&s)).contains("deadbeef"));
        assert!(s.matches("kat_deadbeef"));
        assert!(!s.matches("kat_deadbeeF"));
        assert!(!s.matches(""));
    }

    #[test]
    fn the_gateway_url_never_names_an_unspecified_address() {
        assert_eq!(
            gateway_url("0.0.0.0:7879".parse().unwrap()),
            "ws://127.0.0.1:7879/ws"
        );
        assert_eq!(
            gateway_url("[::]:7879".parse().unwrap()),
            "ws://[::1]:7879/ws"
        );
        assert_eq!(
            gateway_url("10.1.2.3:9000".parse().unwrap()),
            "ws://10.1.2.3:9000/ws"
        );
    }
}
