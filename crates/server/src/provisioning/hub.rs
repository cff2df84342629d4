//! [`Provisioning`]: what every `type: event` scaler of one daemon shares.
//!
//! - the **claim key** (a 0600 file in the state dir, never in the store
//!   that holds the claim hashes): a scale-up's code is derived from it, the
//!   agent id and the issue time, so the outbox keeps a scale-up
//!   redeliverable without ever storing its code;
//! - the **state store** (claims and the outbox);
//! - the **binding** to the running engine, made once the stack is up: the
//!   runtime (to put events on `/v1/events`), the token store (to mint an
//!   agent token on redemption) and the claim URL events carry. A spawn
//!   issued before it waits for it;
//! - a lock per agent, so one agent's scale-up is always handled before
//!   its scale-down (a redelivery after a restart races the engine's own
//!   destroys otherwise);
//! - the per-source-address rate limiter of the claim endpoint.

use crate::gateway::token::TokenStore;
use crate::provisioning::store::{millis, timestamp, StoreClaims};
use kici_engine::runtime::Runtime;
use kici_engine::ProvisionNotice;
use kici_model::{AgentId, InstanceId, Label, LabelSet, ScalerName};
use kici_provision::{
    ClaimCode, ClaimKey, ClaimRecord, ClaimedCredentials, Deliverer, EventKind, ProvisionEvent,
    RateLimit, RateLimiter, RedeemError, Timestamp,
};
use kici_store::{OutboxRecord, StateStore, UnixMillis};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The claim key's file in the state dir.
pub const CLAIM_KEY_FILE: &str = "provision-claim.key";

/// How long a spawn waits for the daemon to bind the engine.
const BIND_WAIT: Duration = Duration::from_secs(60);

/// What only exists once the stack runs.
#[derive(Clone)]
pub struct Binding {
    pub runtime: Runtime,
    pub tokens: Arc<TokenStore>,
    /// `http(s)://…/v1/claims`, the `claimUrl` of every scale-up.
    pub claim_url: String,
}

/// Daemon-wide provisioning state. See the module docs.
pub struct Provisioning {
    pub(crate) instance: InstanceId,
    pub(crate) store: Arc<dyn StateStore>,
    pub(crate) claims: StoreClaims,
    pub(crate) key: ClaimKey,
    binding: watch::Sender<Option<Binding>>,
    locks: Mutex<HashMap<AgentId, Arc<tokio::sync::Mutex<()>>>>,
    limiter: Mutex<RateLimiter<IpAddr>>,
    /// Failed redemptions, all sources together ([`FAILED_REDEMPTIONS`]).
    failures: Mutex<RateLimiter<()>>,
}

/// The budget of failed redemptions (unknown, consumed, expired codes) the
/// claim endpoint answers, whatever their source: 100 at once, then 10 a
/// second. The per-address limit alone lets an attacker with many addresses
/// guess (hopelessly: codes are 256 bits) at whatever rate their addresses
/// add up to; this caps the work they cause. Past it every redemption is
/// answered 429 with Retry-After until the budget refills — legitimate
/// instances retry, and a valid code is never spent by a refusal.
const FAILED_REDEMPTIONS: RateLimit = RateLimit {
    burst: 100,
    refill_every: Duration::from_millis(100),
    max_keys: 1,
};

/// Why provisioning could not start.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("claim key {path}: {source}")]
    Key {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("claim key {0}: not 64 hex digits (delete it to have a new one made; unredeemed codes die with it)")]
    Malformed(String),
}

impl Provisioning {
    /// Reads (or creates, mode 0600) the claim key in `state_dir`.
    pub fn open(
        instance: InstanceId,
        state_dir: &Path,
        store: Arc<dyn StateStore>,
    ) -> Result<Arc<Self>, HubError> {
        let key = load_or_create_key(&state_dir.join(CLAIM_KEY_FILE))?;
        Ok(Arc::new(Self {
            instance,
            claims: StoreClaims(Arc::clone(&store)),
            store,
            key,
            binding: watch::channel(None).0,
            locks: Mutex::new(HashMap::new()),
            limiter: Mutex::new(RateLimiter::new(RateLimit::default())),
            failures: Mutex::new(RateLimiter::new(FAILED_REDEMPTIONS)),
        }))
    }

    /// Binds the running engine; spawns waiting for it go on.
    pub fn bind(&self, binding: Binding) {
        self.binding.send_replace(Some(binding));
    }

    /// The binding, waiting for it (bounded).
    pub(crate) async fn binding(&self) -> Option<Binding> {
        let mut rx = self.binding.subscribe();
        let got = tokio::time::timeout(BIND_WAIT, rx.wait_for(Option::is_some)).await;
        match got {
            Ok(Ok(b)) => b.clone(),
            _ => None,
        }
    }

    pub(crate) fn agent_lock(&self, agent: AgentId) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(self.locks.lock().entry(agent).or_default())
    }

    pub(crate) fn forget_lock(&self, agent: AgentId) {
        self.locks.lock().remove(&agent);
    }

    /// Puts `event` on the event stream (when bound).
    pub(crate) fn announce(&self, binding: &Binding, event: &ProvisionEvent) {
        let Ok(agent_id) = event.agent_id().parse::<AgentId>() else {
            return;
        };
        let notice = match event {
            ProvisionEvent::ScaleUp(e) => ProvisionNotice::ScaleUp {
                request_id: e.request_id.to_string(),
                agent_id,
                scaler: ScalerName::new(&e.scaler),
                labels: e.labels.clone(),
                resources: resources_back(&e.resources),
                claim_code: kici_model::Secret::new(e.claim_code.expose()),
                claim_url: e.claim_url.clone(),
                expires_at: e.expires_at.to_string(),
                job_id: e.job_id.as_deref().and_then(|j| j.parse().ok()),
            },
            ProvisionEvent::ScaleDown(e) => ProvisionNotice::ScaleDown {
                request_id: e.request_id.to_string(),
                agent_id,
                scaler: ScalerName::new(&e.scaler),
                reason: e.reason.to_string(),
            },
        };
        binding.runtime.announce(notice);
    }

    /// Records `event` in the outbox (a scale-up without its code; its
    /// `created_at` is the claim's issue time, from which the code is
    /// derived again).
    pub(crate) async fn record(
        &self,
        event: &ProvisionEvent,
        created_at: UnixMillis,
    ) -> Result<(), kici_store::StoreError> {
        let mut body = serde_json::to_value(event)
            .map_err(|e| kici_store::StoreError::Database(e.to_string()))?;
        if let Some(o) = body.as_object_mut() {
            o.remove("claimCode");
        }
        let agent_id = event
            .agent_id()
            .parse::<AgentId>()
            .map_err(|e| kici_store::StoreError::Database(e.to_string()))?;
        self.store
            .put_outbox(&OutboxRecord {
                request_id: event.request_id().to_string(),
                agent_id,
                kind: event.kind().as_str().to_owned(),
                body: body.to_string(),
                created_at,
                delivered_at: None,
            })
            .await
    }

    /// An outbox row back to the event it recorded (a scale-up with its
    /// code derived again).
    pub(crate) fn rebuild(&self, row: &OutboxRecord) -> Option<ProvisionEvent> {
        let mut body: serde_json::Value = serde_json::from_str(&row.body).ok()?;
        if row.kind == EventKind::ScaleUp.as_str() {
            let code = ClaimCode::derive(
                &self.key,
                &row.agent_id.to_string(),
                timestamp(row.created_at),
            );
            body.as_object_mut()?
                .insert("claimCode".into(), code.expose().into());
        }
        serde_json::from_value(body).ok()
    }

    /// Delivers `event` to its scaler's provisioner (nothing to deliver
    /// without one: the event stream is then the only consumer, and the
    /// event counts as delivered) and marks it delivered when it was.
    pub(crate) async fn deliver(
        &self,
        deliverer: Option<&Deliverer>,
        event: &ProvisionEvent,
    ) -> Result<(), String> {
        if let Some(d) = deliverer {
            let outcome = d.deliver(event).await;
            if let Some(why) = outcome.failure_summary() {
                return Err(why);
            }
        }
        if let Err(e) = self
            .store
            .mark_outbox_delivered(event.request_id().as_str(), UnixMillis::now())
            .await
        {
            // Delivered all the same; a redelivery after a restart is a
            // duplicate the provisioner drops by request id.
            tracing::warn!(request_id = %event.request_id(), error = %e, "cannot mark a provisioner event delivered");
        }
        Ok(())
    }

    /// Sends every recorded event no provisioner confirmed (after a crash,
    /// or a delivery that gave up), in the background. A scale-up whose
    /// agent already has a scale-down recorded is skipped: the instance is
    /// being torn down.
    pub fn redeliver(
        self: &Arc<Self>,
        deliverer_for: impl Fn(&str) -> Option<Arc<Deliverer>> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let hub = Arc::clone(self);
        tokio::spawn(async move {
            let rows = match hub.store.outbox().await {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the provisioner outbox; nothing redelivered now (the reconciler retries teardowns)");
                    return;
                }
            };
            let Some(binding) = hub.binding().await else {
                return;
            };
            for row in rows.iter().filter(|r| r.delivered_at.is_none()) {
                let lock = hub.agent_lock(row.agent_id);
                let _held = lock.lock().await;
                if row.kind == EventKind::ScaleUp.as_str()
                    && scale_down_recorded(&hub.store, row.agent_id).await
                {
                    continue;
                }
                let Some(event) = hub.rebuild(row) else {
                    tracing::warn!(request_id = %row.request_id, "unreadable provisioner outbox row left as is");
                    continue;
                };
                tracing::info!(request_id = %row.request_id, event = %row.kind, "redelivering a provisioner event recorded before a restart");
                hub.announce(&binding, &event);
                let deliverer = deliverer_for(event.scaler());
                match hub.deliver(deliverer.as_deref(), &event).await {
                    Ok(()) if row.kind == EventKind::ScaleDown.as_str() => {
                        let _ = hub.store.delete_outbox_agent(&row.agent_id).await;
                        let _ = hub.store.invalidate_claims(&row.agent_id).await;
                    }
                    Ok(()) => {}
                    Err(why) => {
                        tracing::warn!(request_id = %row.request_id, failure = %why, "redelivery failed; kept for the next start")
                    }
                }
            }
        })
    }

    /// One redemption from `source`: rate limit, consume, mint.
    pub async fn redeem(
        &self,
        source: IpAddr,
        code_text: &str,
    ) -> Result<ClaimedCredentials, Redeem> {
        if let Err(limited) = self
            .limiter
            .lock()
            .check(&kici_provision::source_key(source), Instant::now())
        {
            return Err(Redeem::Limited(limited.retry_after));
        }
        if let Err(limited) = self.failures.lock().peek(&(), Instant::now()) {
            return Err(Redeem::Limited(limited.retry_after));
        }
        let Some(binding) = self.binding().await else {
            return Err(Redeem::Failed(RedeemError::Mint(
                "the daemon is not ready".into(),
            )));
        };
        let tokens = Arc::clone(&binding.tokens);
        kici_provision::redeem(
            &self.claims,
            code_text,
            Timestamp::now(),
            move |record: &ClaimRecord| mint(&tokens, record),
        )
        .await
        .map_err(|e| {
            if matches!(e, RedeemError::Malformed | RedeemError::Refused(_)) {
                // Spent only by failures; running dry refuses the next ones.
                let _ = self.failures.lock().check(&(), Instant::now());
            }
            Redeem::Failed(e)
        })
    }
}

/// A redemption that produced no credentials.
#[derive(Debug)]
pub enum Redeem {
    Limited(Duration),
    Failed(RedeemError),
}

#[derive(Debug, thiserror::Error)]
enum MintFailure {
    #[error("claim for an invalid agent id")]
    AgentId,
    #[error(transparent)]
    Mint(#[from] crate::gateway::token::MintError),
}

fn mint(tokens: &TokenStore, record: &ClaimRecord) -> Result<String, MintFailure> {
    let agent: AgentId = record.agent_id.parse().map_err(|_| MintFailure::AgentId)?;
    let scope = LabelSet::from_labels(record.labels.iter().filter_map(|l| Label::parse(l).ok()));
    // Replaces the token minted at spawn (never handed out for an event
    // agent): the redeemed one is the agent's only credential.
    let token = tokens.mint(agent, record.agent_token_ttl, scope)?;
    Ok(token.expose().to_owned())
}

async fn scale_down_recorded(store: &Arc<dyn StateStore>, agent: AgentId) -> bool {
    store.outbox().await.is_ok_and(|rows| {
        rows.iter()
            .any(|r| r.agent_id == agent && r.kind == EventKind::ScaleDown.as_str())
    })
}

fn resources_back(r: &kici_provision::EventResources) -> kici_model::EffectiveResources {
    let side = |a: &kici_provision::ResourceAmount| {
        // Whole millicores went in; a negative or NaN one reads as none.
        let millis = (a.cpus * 1000.0).round().max(0.0) as u64;
        kici_model::Resources::new(
            kici_model::MilliCpu::from_millis(millis),
            kici_model::MemoryBytes::from_bytes(a.memory_bytes),
        )
    };
    kici_model::EffectiveResources {
        requests: side(&r.requests),
        limits: side(&r.limits),
    }
}

fn load_or_create_key(path: &Path) -> Result<ClaimKey, HubError> {
    let io = |source| HubError::Key {
        path: path.display().to_string(),
        source,
    };
    match std::fs::read_to_string(path) {
        Ok(text) => {
            ClaimKey::from_hex(&text).ok_or_else(|| HubError::Malformed(path.display().to_string()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let key = ClaimKey::generate();
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(io)?;
            f.write_all(key.to_hex().as_bytes()).map_err(io)?;
            f.sync_all().map_err(io)?;
            Ok(key)
        }
        Err(e) => Err(io(e)),
    }
}

/// `t` as the store's instant type.
pub(crate) fn stored(t: Timestamp) -> UnixMillis {
    millis(t)
}
