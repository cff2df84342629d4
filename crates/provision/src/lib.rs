//! External provisioning for `type: event` scalers: the parts that do not
//! depend on the engine or the daemon.
//!
//! A `type: event` scaler runs nothing locally. Spawning an agent emits a
//! **scale-up** event carrying a single-use **claim code** to the operator's
//! provisioner, which boots an instance anywhere (a cloud VM, a spare
//! machine); the agent there redeems the code for a short-lived token and
//! registers as the agent id the scaler chose. Destroying the agent emits a
//! **scale-down** event, which tears the instance down.
//!
//! This crate owns:
//!
//! | module | what |
//! |---|---|
//! | [`event`] | the two events, their JSON, `requestId`, scale-down reasons |
//! | [`config`] | `x-kici-scaler: { provisioner: … }` → [`ProvisionerConfig`], errors with field paths |
//! | [`deliver`] | [`Deliverer`]: one event to every target, retried, a typed [`DeliveryOutcome`] |
//! | [`command`] | one run of a provisioner command (stdin, process group, timeout, bounded output) |
//! | [`webhook`], [`signature`] | one signed `POST`; [`signature::verify_signature`] for receivers |
//! | [`retry`] | exponential backoff with jitter, bounded attempts |
//! | [`claim`], [`claim_store`] | claim codes, the redemption rule, the [`ClaimStore`] trait and an in-memory store |
//! | [`redeem`](mod@redeem) | one redemption end to end: consume atomically, then mint; the HTTP status and body of each failure |
//! | [`rate_limit`] | a per-source-address token bucket for redemptions |
//! | [`time`] | RFC 3339 timestamps (`expiresAt`) |
//!
//! The daemon wires these to the engine (an event backend behind the
//! engine's `Backend` trait), to its store (a durable outbox and a SQL
//! [`ClaimStore`]), to `POST /v1/claims` and to the gateway's
//! `scaler.claim-credentials`.
//!
//! # The events
//!
//! ```json
//! {"event": "scale-up", "requestId": "0a1b2c3d.scaler-event-4e5f6a7b.scale-up",
//!  "agentId": "scaler-event-4e5f6a7b", "scaler": "cloud", "labels": ["linux"],
//!  "resources": {"requests": {"cpus": 2.0, "memoryBytes": 4294967296},
//!                "limits": {"cpus": 2.0, "memoryBytes": 4294967296}},
//!  "claimCode": "kcc_<64 hex>", "claimUrl": "https://ci.example.com/v1/claims",
//!  "expiresAt": "2026-12-02T01:15:00.000Z", "jobId": "build-42"}
//! {"event": "scale-down", "requestId": "0a1b2c3d.scaler-event-4e5f6a7b.scale-down",
//!  "agentId": "scaler-event-4e5f6a7b", "scaler": "cloud", "reason": "job-end"}
//! ```
//!
//! # Delivery guarantees
//!
//! - **At least once.** An event is recorded before it is delivered and
//!   delivered again until a target confirms it (a command exiting 0, a
//!   webhook answering 2xx) — across retries here and across daemon
//!   restarts in the daemon's outbox. A provisioner must therefore tolerate
//!   a duplicate: **deduplicate on `requestId`**, which is the same for
//!   every delivery of one event ([`event::RequestId::derive`]).
//! - **A scale-down for every scale-up** whose agent is destroyed, whatever
//!   the reason ([`event::ScaleDownReason`]); it may arrive for an instance
//!   that never booted (make teardown idempotent).
//! - **No ordering across agents**; for one agent, its scale-down is emitted
//!   after its scale-up was attempted.
//! - The claim code is the only secret in an event: it is single use,
//!   expires (`claimTtlSeconds`, default 300 s) and is void once the agent is
//!   destroyed. Webhook requests are signed (HMAC-SHA256 over
//!   `<timestamp>.<body>`); a receiver enforces a replay window of
//!   [`signature::REPLAY_WINDOW`] (5 minutes).
//!
//! # Claims
//!
//! `POST <claimUrl>` with `{"claimCode": "kcc_…"}` answers
//! `{"agentToken", "agentId", "gatewayUrl", "labels"}` once; afterwards,
//! and for unknown or expired codes, 403 with
//! `{"error": {"code": "claim-refused", "message", "reason": "unknown" | "consumed" | "expired"}}`.
//! The decision is [`claim::decide`]; a [`ClaimStore`] applies it
//! atomically, and [`redeem()`] mints the token only after the consumption
//! is committed.

pub mod claim;
pub mod claim_store;
#[cfg(feature = "delivery")]
pub mod command;
pub mod config;
#[cfg(feature = "delivery")]
pub mod deliver;
pub mod event;
pub mod rate_limit;
pub mod redeem;
pub mod retry;
pub mod signature;
pub mod time;
#[cfg(feature = "delivery")]
pub mod webhook;

pub use claim::{
    decide, ClaimCode, ClaimErrorBody, ClaimFailure, ClaimHash, ClaimKey, ClaimRecord,
    ClaimRequest, ClaimSpec, ClaimedCredentials, DEFAULT_CLAIM_TTL,
};
pub use claim_store::{ClaimStore, ClaimStoreError, MemoryClaimStore, Redemption};
pub use config::{parse_provisioner, ProvisionerConfig, ProvisionerConfigError};
#[cfg(feature = "delivery")]
pub use deliver::{Deliverer, DelivererError, DeliveryOutcome, TargetKind, TargetReport};
pub use event::{
    EventKind, EventResources, ProvisionEvent, RequestId, ResourceAmount, ScaleDown,
    ScaleDownReason, ScaleUp,
};
pub use rate_limit::{source_key, RateLimit, RateLimiter};
pub use redeem::{redeem, RedeemError};
pub use retry::RetryPolicy;
pub use time::Timestamp;
