//! External provisioning (`type: event` scalers) inside the daemon.
//!
//! `kici-provision` owns the events, their delivery, claim codes and the
//! redemption rule; this module owns what ties them to the daemon:
//!
//! | module | what |
//! |---|---|
//! | [`hub`] | [`Provisioning`]: the daemon-wide state (claim key, store, engine binding, per-agent ordering) |
//! | [`backend`] | [`EventBackend`]: the engine's backend for `type: event`: spawn = record + deliver a scale-up, destroy = record + deliver a scale-down |
//! | [`store`] | the durable [`kici_provision::ClaimStore`] over the state store |
//! | [`claims`] | the `--claims-listen` listener: `POST /v1/claims` and nothing else |
//!
//! Crash safety rests on the state store: every event is recorded in its
//! outbox before it is delivered and marked once a provisioner confirmed
//! it; at start-up [`Provisioning::redeliver`] sends what was never
//! confirmed, and an agent whose scale-down never went out keeps its
//! outbox rows, which `EventBackend`'s `list_owned` reports to the
//! reconciler as a resource to tear down.

pub mod backend;
pub mod claims;
pub mod hub;
pub mod store;

pub use backend::EventBackend;
pub use hub::Provisioning;

use crate::daemon::settings::ClaimsListen;
use crate::gateway::token::TokenStore;
use kici_engine::runtime::Runtime;
use kici_model::{Config, ScalerType};
use std::sync::Arc;

/// The claims listener, bound at start-up before any agent exists.
pub struct ClaimsBound {
    listener: std::net::TcpListener,
    url: String,
}

/// Binds `--claims-listen` when set. A configuration with `type: event`
/// scalers needs it: their instances have nowhere else to redeem codes.
pub fn bind_claims(
    claims: Option<&ClaimsListen>,
    config: &Config,
) -> Result<Option<ClaimsBound>, String> {
    let events: Vec<String> = config
        .scalers
        .iter()
        .filter(|s| s.kind == ScalerType::Event)
        .map(|s| s.name.to_string())
        .collect();
    let Some(c) = claims else {
        if events.is_empty() {
            return Ok(None);
        }
        return Err(format!(
            "type: event scalers ({}) need --claims-listen: the listener their instances redeem claim codes at",
            events.join(", ")
        ));
    };
    let listener = std::net::TcpListener::bind(c.addr)
        .map_err(|e| format!("cannot listen on {} (claims-listen): {e}", c.addr))?;
    Ok(Some(ClaimsBound {
        listener,
        url: c.url.clone(),
    }))
}

/// Once the stack runs: binds the engine to the provisioning state, serves
/// the claims listener (and the gateway's `scaler.claim-credentials`) and
/// sends what the outbox holds undelivered. Returns the listener's task
/// (abort it at shutdown).
pub fn start(
    hub: Option<Arc<Provisioning>>,
    claims: Option<ClaimsBound>,
    runtime: &Runtime,
    tokens: &Arc<TokenStore>,
    gateway: &Arc<crate::gateway::Gateway>,
    limits: crate::daemon::serving::ConnectionLimits,
    metrics: crate::daemon::serving::ListenerMetrics,
) -> Result<Option<crate::daemon::serving::Server>, String> {
    let (Some(hub), Some(claims)) = (hub, claims) else {
        return Ok(None);
    };
    gateway.serve_claims(Arc::clone(&hub));
    let addr = claims.listener.local_addr().ok();
    hub.bind(hub::Binding {
        runtime: runtime.clone(),
        tokens: Arc::clone(tokens),
        claim_url: claims.url.clone(),
    });
    let task = claims::serve(claims.listener, Arc::clone(&hub), limits, metrics)
        .map_err(|e| format!("claims listener: {e}"))?;
    tracing::info!(addr = ?addr, url = %claims.url, "claims listener serving POST /v1/claims");
    let rt = runtime.clone();
    hub.redeliver(move |scaler| {
        let entry = rt.call(|e, _| e.config().scaler(scaler).cloned())?;
        match &entry.backend {
            kici_model::BackendSettings::Event(es) => es
                .provisioner
                .as_ref()
                .and_then(|p| backend::deliverer(p).ok())
                .map(Arc::new),
            _ => None,
        }
    });
    Ok(Some(task))
}
