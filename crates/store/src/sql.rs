//! What both stores share: the SQL (portable between SQLite ≥ 3.35 and
//! PostgreSQL ≥ 13 except the one claim statement each store supplies), row
//! decoding, and [`impl_state_store!`], which implements [`crate::StateStore`]
//! and [`crate::IpAllocator`] once for both drivers.
//!
//! A store type using the macro provides fields `owner: InstanceId`,
//! `owner_text: String`, `filled: tokio::sync::Mutex<HashSet<Ipv4Net>>` and
//! methods `reader()`, `writer()` (pools), `begin_write()` (a write
//! transaction), `ping_impl()`, `close_impl()` and the constant `CLAIM_IP`: one statement (binds: network,
//! agent, owner, now) that returns the agent's existing lease in the network
//! or claims the lowest free address, or returns no row.

use crate::error::StoreError;
use crate::record::{
    AgentRecord, EventRecord, JobRecord, PendingRecord, ResourceNames, UnixMillis,
};
use ipnet::Ipv4Net;
use kici_model::{AgentId, JobId, MemoryBytes, MilliCpu, ScalerName, ScalerType};
use std::net::Ipv4Addr;

pub(crate) const AGENT_COLUMNS: &str = "agent_id, scaler, backend, label_set_index, label_set_key, state, mode, job_id, run_id, warm, milli_cpu, memory_bytes, machine_pool, resource_id, resources, token_hash, token_expires_at, failure, created_at, updated_at";

/// Upsert guarded by owner: a row of another instance with the same id is
/// left alone and the statement affects 0 rows.
pub(crate) const PUT_AGENT: &str = "INSERT INTO agents (agent_id, owner, scaler, backend, label_set_index, label_set_key, state, mode, job_id, run_id, warm, milli_cpu, memory_bytes, machine_pool, resource_id, resources, token_hash, token_expires_at, failure, created_at, updated_at) \
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21) \
ON CONFLICT (agent_id) DO UPDATE SET scaler = excluded.scaler, backend = excluded.backend, label_set_index = excluded.label_set_index, label_set_key = excluded.label_set_key, state = excluded.state, mode = excluded.mode, job_id = excluded.job_id, run_id = excluded.run_id, warm = excluded.warm, milli_cpu = excluded.milli_cpu, memory_bytes = excluded.memory_bytes, machine_pool = excluded.machine_pool, resource_id = excluded.resource_id, resources = excluded.resources, token_hash = excluded.token_hash, token_expires_at = excluded.token_expires_at, failure = excluded.failure, created_at = excluded.created_at, updated_at = excluded.updated_at \
WHERE agents.owner = excluded.owner";

pub(crate) const AGENT_OWNER: &str = "SELECT owner FROM agents WHERE agent_id = $1";
pub(crate) const DELETE_AGENT: &str = "DELETE FROM agents WHERE owner = $1 AND agent_id = $2";

pub(crate) const PUT_PENDING: &str = "INSERT INTO pending_requests (owner, job_id, labels, request, run_id, created_at) VALUES ($1, $2, $3, $4, $5, $6) \
ON CONFLICT (owner, job_id) DO UPDATE SET labels = excluded.labels, request = excluded.request, run_id = excluded.run_id, created_at = excluded.created_at";
pub(crate) const DELETE_PENDING: &str =
    "DELETE FROM pending_requests WHERE owner = $1 AND job_id = $2";
pub(crate) const PENDING: &str = "SELECT job_id, labels, request, run_id, created_at FROM pending_requests WHERE owner = $1 ORDER BY created_at, job_id";

pub(crate) const PUT_JOB: &str = "INSERT INTO jobs (owner, job_id, labels, command, state, agent_id, end_kind, exit_code, signal, reason, output_bytes, dropped_bytes, created_at, updated_at) \
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) \
ON CONFLICT (owner, job_id) DO UPDATE SET labels = excluded.labels, command = excluded.command, state = excluded.state, agent_id = excluded.agent_id, end_kind = excluded.end_kind, exit_code = excluded.exit_code, signal = excluded.signal, reason = excluded.reason, output_bytes = excluded.output_bytes, dropped_bytes = excluded.dropped_bytes, created_at = excluded.created_at, updated_at = excluded.updated_at";
pub(crate) const DELETE_JOB: &str = "DELETE FROM jobs WHERE owner = $1 AND job_id = $2";
pub(crate) const JOBS: &str = "SELECT job_id, labels, command, state, agent_id, end_kind, exit_code, signal, reason, output_bytes, dropped_bytes, created_at, updated_at FROM jobs WHERE owner = $1 ORDER BY created_at, job_id";

pub(crate) const APPEND_EVENT: &str =
    "INSERT INTO events (owner, seq, at, body) VALUES ($1, $2, $3, $4)";
pub(crate) const EVENTS_AFTER: &str =
    "SELECT seq, at, body FROM events WHERE owner = $1 AND seq > $2 ORDER BY seq LIMIT $3";
pub(crate) const LAST_EVENT_SEQ: &str = "SELECT MAX(seq) FROM events WHERE owner = $1";
/// Deletes every event at or below the (keep+1)-th newest.
pub(crate) const TRIM_EVENTS: &str = "DELETE FROM events WHERE owner = $1 AND seq <= (SELECT seq FROM events WHERE owner = $1 ORDER BY seq DESC LIMIT 1 OFFSET $2)";

pub(crate) const INSERT_CLAIM: &str = "INSERT INTO provision_claims (code_hash, owner, agent_id, scaler, labels, gateway_url, agent_token_ttl_ms, issued_at, expires_at, consumed_at) \
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";
/// The atomic step of a redemption: only an unconsumed, unexpired row this
/// instance issued is updated, and the update returns it. A code of another
/// daemon sharing the store is not ours to redeem: its agent registers with
/// that daemon, so a token minted here could only burn the code.
pub(crate) const REDEEM_CLAIM: &str = "UPDATE provision_claims SET consumed_at = $2 \
WHERE code_hash = $1 AND owner = $3 AND consumed_at IS NULL AND expires_at > $2 \
RETURNING code_hash, agent_id, scaler, labels, gateway_url, agent_token_ttl_ms, issued_at, expires_at, consumed_at";
/// Why a redemption was refused (read after the update matched nothing);
/// another daemon's code reads as unknown.
pub(crate) const CLAIM_STATE: &str =
    "SELECT consumed_at FROM provision_claims WHERE code_hash = $1 AND owner = $2";
pub(crate) const INVALIDATE_CLAIMS: &str =
    "DELETE FROM provision_claims WHERE owner = $1 AND agent_id = $2";
pub(crate) const PURGE_CLAIMS: &str =
    "DELETE FROM provision_claims WHERE owner = $1 AND expires_at < $2";
pub(crate) const PUT_OUTBOX: &str = "INSERT INTO provision_outbox (owner, request_id, agent_id, kind, body, created_at, delivered_at) \
VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (owner, request_id) DO NOTHING";
pub(crate) const MARK_OUTBOX_DELIVERED: &str =
    "UPDATE provision_outbox SET delivered_at = $3 WHERE owner = $1 AND request_id = $2";
pub(crate) const DELETE_OUTBOX_AGENT: &str =
    "DELETE FROM provision_outbox WHERE owner = $1 AND agent_id = $2";
pub(crate) const OUTBOX: &str = "SELECT request_id, agent_id, kind, body, created_at, delivered_at FROM provision_outbox WHERE owner = $1 ORDER BY created_at, request_id";

pub(crate) const PUT_INSTANCE: &str = "INSERT INTO instances (owner, hostname, started_at, heartbeat_at) VALUES ($1, $2, $3, $3) \
ON CONFLICT (owner) DO UPDATE SET hostname = excluded.hostname, started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at";

/// The largest pool whose rows are pre-filled (a /12: 1,048,574 rows); a
/// larger one is refused rather than written row by row for minutes.
pub(crate) const MAX_PREFILL: u32 = (1 << 20) - 2;

/// Refreshed by every ping: a sweep (or an operator) can tell a live
/// instance from one that stopped.
pub(crate) const HEARTBEAT: &str = "UPDATE instances SET heartbeat_at = $2 WHERE owner = $1";

pub(crate) const NETWORK_FILLED: &str = "SELECT capacity FROM ip_networks WHERE network = $1";
/// Every assignable address of `$1` from `$2` to `$3` (u32 values), once.
/// `WHERE true` resolves SQLite's INSERT … SELECT … ON CONFLICT ambiguity.
pub(crate) const FILL_NETWORK: &str = "WITH RECURSIVE addr(n) AS (SELECT CAST($2 AS BIGINT) UNION ALL SELECT n + 1 FROM addr WHERE n < CAST($3 AS BIGINT)) \
INSERT INTO ip_leases (network, ip) SELECT $1, n FROM addr WHERE true ON CONFLICT (network, ip) DO NOTHING";
pub(crate) const MARK_FILLED: &str = "INSERT INTO ip_networks (network, capacity, filled_at) VALUES ($1, $2, $3) ON CONFLICT (network) DO NOTHING";
/// Whether `$1` has a free address (a claim found none: exhausted, or all
/// free rows locked by concurrent claims?).
pub(crate) const ANY_FREE: &str =
    "SELECT EXISTS (SELECT 1 FROM ip_leases WHERE network = $1 AND agent_id IS NULL)";
pub(crate) const RELEASE_AGENT: &str = "UPDATE ip_leases SET agent_id = NULL, owner = NULL, leased_at = NULL WHERE owner = $1 AND agent_id = $2";
pub(crate) const RELEASE_IP: &str = "UPDATE ip_leases SET agent_id = NULL, owner = NULL, leased_at = NULL WHERE owner = $1 AND network = $2 AND ip = $3";
pub(crate) const LEASES: &str =
    "SELECT network, ip, agent_id FROM ip_leases WHERE owner = $1 ORDER BY network, ip";
/// This owner's leases in pool key `$1` (to move them into a scoped key).
pub(crate) const OWNED_IN: &str =
    "SELECT ip, agent_id, leased_at FROM ip_leases WHERE network = $1 AND owner = $2 AND agent_id IS NOT NULL";
/// Takes address `$2` of pool key `$1` for an agent moving in, if free.
pub(crate) const TAKE_IP: &str = "UPDATE ip_leases SET agent_id = $3, owner = $4, leased_at = $5 WHERE network = $1 AND ip = $2 AND agent_id IS NULL";

/// The `network` column's value for `network` in `scope`: the CIDR alone
/// (unscoped, one pool per network for the whole database) or
/// `CIDR@scope`. A scope never contains `/` or `@`, so the two forms cannot
/// collide, and a stored key always parses back into its CIDR.
pub(crate) fn pool_key(network: Ipv4Net, scope: Option<&crate::AddressScope>) -> String {
    match scope {
        None => network.to_string(),
        Some(scope) => format!("{network}@{scope}"),
    }
}

/// The CIDR of a stored pool key (either form of [`pool_key`]).
pub(crate) fn network_of_key(key: &str) -> Option<Ipv4Net> {
    key.split_once('@')
        .map_or(key, |(cidr, _)| cidr)
        .parse()
        .ok()
}

/// An `agents` row as stored.
#[derive(sqlx::FromRow)]
pub(crate) struct AgentRow {
    agent_id: String,
    scaler: String,
    backend: String,
    label_set_index: i64,
    label_set_key: String,
    state: String,
    mode: String,
    job_id: Option<String>,
    run_id: Option<String>,
    warm: bool,
    milli_cpu: i64,
    memory_bytes: i64,
    machine_pool: Option<String>,
    resource_id: Option<String>,
    resources: String,
    token_hash: Option<String>,
    token_expires_at: Option<i64>,
    failure: Option<String>,
    created_at: i64,
    updated_at: i64,
}

fn corrupt(table: &'static str, what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        table,
        reason: what.to_string(),
    }
}

fn non_negative(table: &'static str, field: &str, v: i64) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| corrupt(table, format_args!("{field} = {v} is negative")))
}

pub(crate) fn to_i64(field: &'static str, value: u64) -> Result<i64, StoreError> {
    i64::try_from(value).map_err(|_| StoreError::OutOfRange { field, value })
}

impl TryFrom<AgentRow> for AgentRecord {
    type Error = StoreError;
    fn try_from(r: AgentRow) -> Result<Self, StoreError> {
        const T: &str = "agents";
        let agent_id: AgentId = r.agent_id.parse().map_err(|e| corrupt(T, e))?;
        let job_id = r
            .job_id
            .map(|j| j.parse::<JobId>())
            .transpose()
            .map_err(|e| corrupt(T, e))?;
        let resources: ResourceNames = serde_json::from_str(&r.resources)
            .map_err(|e| corrupt(T, format_args!("resources of {agent_id}: {e}")))?;
        Ok(Self {
            agent_id,
            scaler: ScalerName::new(&r.scaler),
            backend: r.backend.parse::<ScalerType>().map_err(|e| corrupt(T, e))?,
            label_set_index: u32::try_from(r.label_set_index).map_err(|_| {
                corrupt(
                    T,
                    format_args!("label_set_index {} out of range", r.label_set_index),
                )
            })?,
            label_set_key: r.label_set_key,
            state: r.state,
            mode: r.mode,
            job_id,
            run_id: r.run_id,
            warm: r.warm,
            milli_cpu: MilliCpu::from_millis(non_negative(T, "milli_cpu", r.milli_cpu)?),
            memory_bytes: MemoryBytes::from_bytes(non_negative(T, "memory_bytes", r.memory_bytes)?),
            machine_pool: r.machine_pool,
            resource_id: r.resource_id,
            resources,
            token_hash: r.token_hash,
            token_expires_at: r.token_expires_at.map(UnixMillis),
            failure: r.failure,
            created_at: UnixMillis(r.created_at),
            updated_at: UnixMillis(r.updated_at),
        })
    }
}

/// An [`AgentRecord`] converted to bindable column values (in
/// [`PUT_AGENT`] order, owner excluded).
pub(crate) struct AgentParams {
    pub agent_id: String,
    pub scaler: String,
    pub backend: &'static str,
    pub label_set_index: i64,
    pub label_set_key: String,
    pub state: String,
    pub mode: String,
    pub job_id: Option<String>,
    pub run_id: Option<String>,
    pub warm: bool,
    pub milli_cpu: i64,
    pub memory_bytes: i64,
    pub machine_pool: Option<String>,
    pub resource_id: Option<String>,
    pub resources: String,
    pub token_hash: Option<String>,
    pub token_expires_at: Option<i64>,
    pub failure: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

impl AgentParams {
    pub(crate) fn new(a: &AgentRecord) -> Result<Self, StoreError> {
        Ok(Self {
            agent_id: a.agent_id.to_string(),
            scaler: a.scaler.to_string(),
            backend: a.backend.as_str(),
            label_set_index: i64::from(a.label_set_index),
            label_set_key: a.label_set_key.clone(),
            state: a.state.clone(),
            mode: a.mode.clone(),
            job_id: a.job_id.as_ref().map(ToString::to_string),
            run_id: a.run_id.clone(),
            warm: a.warm,
            milli_cpu: to_i64("milli_cpu", a.milli_cpu.millis())?,
            memory_bytes: to_i64("memory_bytes", a.memory_bytes.bytes())?,
            machine_pool: a.machine_pool.clone(),
            resource_id: a.resource_id.clone(),
            // A BTreeMap<String, String> always serializes.
            resources: serde_json::to_string(&a.resources)
                .map_err(|e| StoreError::Database(e.to_string()))?,
            token_hash: a.token_hash.clone(),
            token_expires_at: a.token_expires_at.map(|t| t.0),
            failure: a.failure.clone(),
            created_at: a.created_at.0,
            updated_at: a.updated_at.0,
        })
    }
}

/// A `pending_requests` row as stored.
#[derive(sqlx::FromRow)]
pub(crate) struct PendingRow {
    job_id: String,
    labels: String,
    request: String,
    run_id: Option<String>,
    created_at: i64,
}

impl TryFrom<PendingRow> for PendingRecord {
    type Error = StoreError;
    fn try_from(r: PendingRow) -> Result<Self, StoreError> {
        const T: &str = "pending_requests";
        Ok(Self {
            job_id: r.job_id.parse().map_err(|e| corrupt(T, e))?,
            labels: serde_json::from_str(&r.labels).map_err(|e| corrupt(T, e))?,
            request: serde_json::from_str(&r.request).map_err(|e| corrupt(T, e))?,
            run_id: r.run_id,
            created_at: UnixMillis(r.created_at),
        })
    }
}

/// A `jobs` row as stored.
#[derive(sqlx::FromRow)]
pub(crate) struct JobRow {
    job_id: String,
    labels: String,
    command: String,
    state: String,
    agent_id: Option<String>,
    end_kind: Option<String>,
    exit_code: Option<i64>,
    signal: Option<i64>,
    reason: Option<String>,
    output_bytes: i64,
    dropped_bytes: i64,
    created_at: i64,
    updated_at: i64,
}

fn small_int(table: &'static str, field: &str, v: Option<i64>) -> Result<Option<i32>, StoreError> {
    v.map(|v| {
        i32::try_from(v).map_err(|_| corrupt(table, format_args!("{field} = {v} is out of range")))
    })
    .transpose()
}

impl TryFrom<JobRow> for JobRecord {
    type Error = StoreError;
    fn try_from(r: JobRow) -> Result<Self, StoreError> {
        const T: &str = "jobs";
        let job_id: JobId = r.job_id.parse().map_err(|e| corrupt(T, e))?;
        Ok(Self {
            labels: serde_json::from_str(&r.labels)
                .map_err(|e| corrupt(T, format_args!("labels of {job_id}: {e}")))?,
            command: serde_json::from_str(&r.command)
                .map_err(|e| corrupt(T, format_args!("command of {job_id}: {e}")))?,
            state: r.state,
            agent_id: r
                .agent_id
                .map(|a| a.parse::<AgentId>())
                .transpose()
                .map_err(|e| corrupt(T, e))?,
            end: r.end_kind,
            exit_code: small_int(T, "exit_code", r.exit_code)?,
            signal: small_int(T, "signal", r.signal)?,
            reason: r.reason,
            output_bytes: non_negative(T, "output_bytes", r.output_bytes)?,
            dropped_bytes: non_negative(T, "dropped_bytes", r.dropped_bytes)?,
            created_at: UnixMillis(r.created_at),
            updated_at: UnixMillis(r.updated_at),
            job_id,
        })
    }
}

/// A [`JobRecord`] converted to bindable column values (in [`PUT_JOB`]
/// order, owner excluded).
pub(crate) struct JobParams {
    pub job_id: String,
    pub labels: String,
    pub command: String,
    pub state: String,
    pub agent_id: Option<String>,
    pub end: Option<String>,
    pub exit_code: Option<i64>,
    pub signal: Option<i64>,
    pub reason: Option<String>,
    pub output_bytes: i64,
    pub dropped_bytes: i64,
    pub created_at: i64,
    pub updated_at: i64,
}

impl JobParams {
    pub(crate) fn new(j: &JobRecord) -> Result<Self, StoreError> {
        // A Vec<String> always serializes.
        let json = |v: &Vec<String>| {
            serde_json::to_string(v).map_err(|e| StoreError::Database(e.to_string()))
        };
        Ok(Self {
            job_id: j.job_id.to_string(),
            labels: json(&j.labels)?,
            command: json(&j.command)?,
            state: j.state.clone(),
            agent_id: j.agent_id.as_ref().map(ToString::to_string),
            end: j.end.clone(),
            exit_code: j.exit_code.map(i64::from),
            signal: j.signal.map(i64::from),
            reason: j.reason.clone(),
            output_bytes: to_i64("output_bytes", j.output_bytes)?,
            dropped_bytes: to_i64("dropped_bytes", j.dropped_bytes)?,
            created_at: j.created_at.0,
            updated_at: j.updated_at.0,
        })
    }
}

/// An `events` row as stored.
#[derive(sqlx::FromRow)]
pub(crate) struct EventRow {
    seq: i64,
    at: i64,
    body: String,
}

impl TryFrom<EventRow> for EventRecord {
    type Error = StoreError;
    fn try_from(r: EventRow) -> Result<Self, StoreError> {
        Ok(Self {
            seq: non_negative("events", "seq", r.seq)?,
            at: UnixMillis(r.at),
            body: r.body,
        })
    }
}

/// A `provision_claims` row as stored.
#[derive(sqlx::FromRow)]
pub(crate) struct ClaimDbRow {
    code_hash: String,
    agent_id: String,
    scaler: String,
    labels: String,
    gateway_url: String,
    agent_token_ttl_ms: i64,
    issued_at: i64,
    expires_at: i64,
    consumed_at: Option<i64>,
}

impl TryFrom<ClaimDbRow> for crate::record::ClaimRow {
    type Error = StoreError;
    fn try_from(r: ClaimDbRow) -> Result<Self, StoreError> {
        const T: &str = "provision_claims";
        let mut code_hash = [0u8; 32];
        hex::decode_to_slice(&r.code_hash, &mut code_hash)
            .map_err(|e| corrupt(T, format_args!("code_hash: {e}")))?;
        Ok(Self {
            code_hash,
            agent_id: r
                .agent_id
                .parse()
                .map_err(|e| corrupt(T, format_args!("agent_id: {e}")))?,
            scaler: ScalerName::new(&r.scaler),
            labels: serde_json::from_str(&r.labels)
                .map_err(|e| corrupt(T, format_args!("labels: {e}")))?,
            gateway_url: r.gateway_url,
            agent_token_ttl_ms: non_negative(T, "agent_token_ttl_ms", r.agent_token_ttl_ms)?,
            issued_at: UnixMillis(r.issued_at),
            expires_at: UnixMillis(r.expires_at),
            consumed_at: r.consumed_at.map(UnixMillis),
        })
    }
}

/// A `provision_outbox` row as stored.
#[derive(sqlx::FromRow)]
pub(crate) struct OutboxRow {
    request_id: String,
    agent_id: String,
    kind: String,
    body: String,
    created_at: i64,
    delivered_at: Option<i64>,
}

impl TryFrom<OutboxRow> for crate::record::OutboxRecord {
    type Error = StoreError;
    fn try_from(r: OutboxRow) -> Result<Self, StoreError> {
        Ok(Self {
            request_id: r.request_id,
            agent_id: r
                .agent_id
                .parse()
                .map_err(|e| corrupt("provision_outbox", format_args!("agent_id: {e}")))?,
            kind: r.kind,
            body: r.body,
            created_at: UnixMillis(r.created_at),
            delivered_at: r.delivered_at.map(UnixMillis),
        })
    }
}

/// An `ip_leases` column value back to an address.
pub(crate) fn ip_from_i64(v: i64) -> Result<Ipv4Addr, StoreError> {
    u32::try_from(v)
        .map(Ipv4Addr::from)
        .map_err(|_| corrupt("ip_leases", format_args!("ip {v} is not an IPv4 address")))
}

/// The machine's host name for the `instances` row (best effort: it is
/// informational).
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// Implements [`crate::StateStore`] and [`crate::IpAllocator`] for a store
/// type (see the module docs for what it must provide). One body for both
/// drivers keeps their behaviour identical.
macro_rules! impl_state_store {
    ($store:ty, $kind:expr) => {
        #[async_trait::async_trait]
        impl $crate::StateStore for $store {
            fn owner(&self) -> kici_model::InstanceId {
                self.owner
            }

            fn kind(&self) -> $crate::StoreKind {
                $kind
            }

            async fn ping(&self) -> Result<(), $crate::StoreError> {
                self.ping_impl().await
            }

            fn postgres(&self) -> Option<$crate::SharedPostgres> {
                self.postgres_impl()
            }

            async fn reachable(&self) -> Result<(), $crate::StoreError> {
                sqlx::query("SELECT 1")
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(())
            }

            async fn put_agent(
                &self,
                agent: &$crate::AgentRecord,
            ) -> Result<(), $crate::StoreError> {
                use $crate::error::classify;
                let p = $crate::sql::AgentParams::new(agent)?;
                let done = sqlx::query($crate::sql::PUT_AGENT)
                    .bind(&p.agent_id)
                    .bind(&self.owner_text)
                    .bind(&p.scaler)
                    .bind(p.backend)
                    .bind(p.label_set_index)
                    .bind(&p.label_set_key)
                    .bind(&p.state)
                    .bind(&p.mode)
                    .bind(&p.job_id)
                    .bind(&p.run_id)
                    .bind(p.warm)
                    .bind(p.milli_cpu)
                    .bind(p.memory_bytes)
                    .bind(&p.machine_pool)
                    .bind(&p.resource_id)
                    .bind(&p.resources)
                    .bind(&p.token_hash)
                    .bind(p.token_expires_at)
                    .bind(&p.failure)
                    .bind(p.created_at)
                    .bind(p.updated_at)
                    .execute(self.writer())
                    .await
                    .map_err(classify)?;
                if done.rows_affected() == 0 {
                    let other: Option<String> = sqlx::query_scalar($crate::sql::AGENT_OWNER)
                        .bind(&p.agent_id)
                        .fetch_optional(self.reader())
                        .await
                        .map_err(classify)?;
                    return Err($crate::StoreError::AgentIdTaken {
                        agent: p.agent_id,
                        other_owner: other.unwrap_or_else(|| "?".to_owned()),
                    });
                }
                Ok(())
            }

            async fn agent(
                &self,
                id: &kici_model::AgentId,
            ) -> Result<Option<$crate::AgentRecord>, $crate::StoreError> {
                let q = format!(
                    "SELECT {} FROM agents WHERE owner = $1 AND agent_id = $2",
                    $crate::sql::AGENT_COLUMNS
                );
                let row: Option<$crate::sql::AgentRow> = sqlx::query_as(&q)
                    .bind(&self.owner_text)
                    .bind(id.to_string())
                    .fetch_optional(self.reader())
                    .await
                    .map_err($crate::error::classify)?;
                row.map($crate::AgentRecord::try_from).transpose()
            }

            async fn agents(&self) -> Result<Vec<$crate::AgentRecord>, $crate::StoreError> {
                let q = format!(
                    "SELECT {} FROM agents WHERE owner = $1 ORDER BY created_at, agent_id",
                    $crate::sql::AGENT_COLUMNS
                );
                let rows: Vec<$crate::sql::AgentRow> = sqlx::query_as(&q)
                    .bind(&self.owner_text)
                    .fetch_all(self.reader())
                    .await
                    .map_err($crate::error::classify)?;
                rows.into_iter()
                    .map($crate::AgentRecord::try_from)
                    .collect()
            }

            async fn delete_agent(
                &self,
                id: &kici_model::AgentId,
            ) -> Result<bool, $crate::StoreError> {
                let done = sqlx::query($crate::sql::DELETE_AGENT)
                    .bind(&self.owner_text)
                    .bind(id.to_string())
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(done.rows_affected() > 0)
            }

            async fn put_pending(
                &self,
                pending: &$crate::PendingRecord,
            ) -> Result<(), $crate::StoreError> {
                // Vec<String> and serde_json::Value always serialize.
                let labels = serde_json::to_string(&pending.labels)
                    .map_err(|e| $crate::StoreError::Database(e.to_string()))?;
                let request = serde_json::to_string(&pending.request)
                    .map_err(|e| $crate::StoreError::Database(e.to_string()))?;
                sqlx::query($crate::sql::PUT_PENDING)
                    .bind(&self.owner_text)
                    .bind(pending.job_id.as_str())
                    .bind(labels)
                    .bind(request)
                    .bind(&pending.run_id)
                    .bind(pending.created_at.0)
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(())
            }

            async fn delete_pending(
                &self,
                job: &kici_model::JobId,
            ) -> Result<bool, $crate::StoreError> {
                let done = sqlx::query($crate::sql::DELETE_PENDING)
                    .bind(&self.owner_text)
                    .bind(job.as_str())
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(done.rows_affected() > 0)
            }

            async fn pending(&self) -> Result<Vec<$crate::PendingRecord>, $crate::StoreError> {
                let rows: Vec<$crate::sql::PendingRow> = sqlx::query_as($crate::sql::PENDING)
                    .bind(&self.owner_text)
                    .fetch_all(self.reader())
                    .await
                    .map_err($crate::error::classify)?;
                rows.into_iter()
                    .map($crate::PendingRecord::try_from)
                    .collect()
            }

            async fn put_job(&self, job: &$crate::JobRecord) -> Result<(), $crate::StoreError> {
                let p = $crate::sql::JobParams::new(job)?;
                sqlx::query($crate::sql::PUT_JOB)
                    .bind(&self.owner_text)
                    .bind(&p.job_id)
                    .bind(&p.labels)
                    .bind(&p.command)
                    .bind(&p.state)
                    .bind(&p.agent_id)
                    .bind(&p.end)
                    .bind(p.exit_code)
                    .bind(p.signal)
                    .bind(&p.reason)
                    .bind(p.output_bytes)
                    .bind(p.dropped_bytes)
                    .bind(p.created_at)
                    .bind(p.updated_at)
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(())
            }

            async fn delete_job(
                &self,
                job: &kici_model::JobId,
            ) -> Result<bool, $crate::StoreError> {
                let done = sqlx::query($crate::sql::DELETE_JOB)
                    .bind(&self.owner_text)
                    .bind(job.as_str())
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(done.rows_affected() > 0)
            }

            async fn jobs(&self) -> Result<Vec<$crate::JobRecord>, $crate::StoreError> {
                let rows: Vec<$crate::sql::JobRow> = sqlx::query_as($crate::sql::JOBS)
                    .bind(&self.owner_text)
                    .fetch_all(self.reader())
                    .await
                    .map_err($crate::error::classify)?;
                rows.into_iter().map($crate::JobRecord::try_from).collect()
            }

            async fn append_event(
                &self,
                seq: u64,
                at: $crate::UnixMillis,
                body: &str,
            ) -> Result<(), $crate::StoreError> {
                sqlx::query($crate::sql::APPEND_EVENT)
                    .bind(&self.owner_text)
                    .bind($crate::sql::to_i64("seq", seq)?)
                    .bind(at.0)
                    .bind(body)
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(())
            }

            async fn append_events(
                &self,
                events: &[$crate::EventRecord],
            ) -> Result<(), $crate::StoreError> {
                use $crate::error::classify;
                if events.is_empty() {
                    return Ok(());
                }
                let mut tx = self.begin_write().await.map_err(classify)?;
                for e in events {
                    sqlx::query($crate::sql::APPEND_EVENT)
                        .bind(&self.owner_text)
                        .bind($crate::sql::to_i64("seq", e.seq)?)
                        .bind(e.at.0)
                        .bind(&e.body)
                        .execute(&mut *tx)
                        .await
                        .map_err(classify)?;
                }
                tx.commit().await.map_err(classify)?;
                Ok(())
            }

            async fn events_after(
                &self,
                seq: u64,
                limit: u32,
            ) -> Result<Vec<$crate::EventRecord>, $crate::StoreError> {
                let rows: Vec<$crate::sql::EventRow> = sqlx::query_as($crate::sql::EVENTS_AFTER)
                    .bind(&self.owner_text)
                    .bind($crate::sql::to_i64("seq", seq)?)
                    .bind(i64::from(limit))
                    .fetch_all(self.reader())
                    .await
                    .map_err($crate::error::classify)?;
                rows.into_iter()
                    .map($crate::EventRecord::try_from)
                    .collect()
            }

            async fn last_event_seq(&self) -> Result<Option<u64>, $crate::StoreError> {
                let max: Option<i64> = sqlx::query_scalar($crate::sql::LAST_EVENT_SEQ)
                    .bind(&self.owner_text)
                    .fetch_one(self.reader())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(max.and_then(|m| u64::try_from(m).ok()))
            }

            async fn trim_events(&self, keep: u64) -> Result<u64, $crate::StoreError> {
                let done = sqlx::query($crate::sql::TRIM_EVENTS)
                    .bind(&self.owner_text)
                    .bind($crate::sql::to_i64("keep", keep)?)
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(done.rows_affected())
            }

            async fn insert_claim(
                &self,
                claim: &$crate::ClaimRow,
            ) -> Result<(), $crate::StoreError> {
                let labels = serde_json::to_string(&claim.labels)
                    .map_err(|e| $crate::StoreError::Database(e.to_string()))?;
                sqlx::query($crate::sql::INSERT_CLAIM)
                    .bind(hex::encode(claim.code_hash))
                    .bind(&self.owner_text)
                    .bind(claim.agent_id.to_string())
                    .bind(claim.scaler.as_str())
                    .bind(labels)
                    .bind(&claim.gateway_url)
                    .bind($crate::sql::to_i64("agent_token_ttl_ms", claim.agent_token_ttl_ms)?)
                    .bind(claim.issued_at.0)
                    .bind(claim.expires_at.0)
                    .bind(claim.consumed_at.map(|t| t.0))
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(())
            }

            async fn redeem_claim(
                &self,
                code_hash: &[u8; 32],
                now: $crate::UnixMillis,
            ) -> Result<$crate::ClaimRedemption, $crate::StoreError> {
                use $crate::error::classify;
                let hash = hex::encode(code_hash);
                let granted: Option<$crate::sql::ClaimDbRow> =
                    sqlx::query_as($crate::sql::REDEEM_CLAIM)
                        .bind(&hash)
                        .bind(now.0)
                        .bind(&self.owner_text)
                        .fetch_optional(self.writer())
                        .await
                        .map_err(classify)?;
                if let Some(row) = granted {
                    return Ok($crate::ClaimRedemption::Granted($crate::ClaimRow::try_from(row)?));
                }
                let state: Option<Option<i64>> = sqlx::query_scalar($crate::sql::CLAIM_STATE)
                    .bind(&hash)
                    .bind(&self.owner_text)
                    .fetch_optional(self.writer())
                    .await
                    .map_err(classify)?;
                Ok(match state {
                    None => $crate::ClaimRedemption::Unknown,
                    Some(Some(_)) => $crate::ClaimRedemption::Consumed,
                    Some(None) => $crate::ClaimRedemption::Expired,
                })
            }

            async fn invalidate_claims(
                &self,
                agent: &kici_model::AgentId,
            ) -> Result<u64, $crate::StoreError> {
                let done = sqlx::query($crate::sql::INVALIDATE_CLAIMS)
                    .bind(&self.owner_text)
                    .bind(agent.to_string())
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(done.rows_affected())
            }

            async fn purge_claims(
                &self,
                horizon: $crate::UnixMillis,
            ) -> Result<u64, $crate::StoreError> {
                let done = sqlx::query($crate::sql::PURGE_CLAIMS)
                    .bind(&self.owner_text)
                    .bind(horizon.0)
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(done.rows_affected())
            }

            async fn put_outbox(
                &self,
                event: &$crate::OutboxRecord,
            ) -> Result<(), $crate::StoreError> {
                sqlx::query($crate::sql::PUT_OUTBOX)
                    .bind(&self.owner_text)
                    .bind(&event.request_id)
                    .bind(event.agent_id.to_string())
                    .bind(&event.kind)
                    .bind(&event.body)
                    .bind(event.created_at.0)
                    .bind(event.delivered_at.map(|t| t.0))
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(())
            }

            async fn mark_outbox_delivered(
                &self,
                request_id: &str,
                at: $crate::UnixMillis,
            ) -> Result<bool, $crate::StoreError> {
                let done = sqlx::query($crate::sql::MARK_OUTBOX_DELIVERED)
                    .bind(&self.owner_text)
                    .bind(request_id)
                    .bind(at.0)
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(done.rows_affected() > 0)
            }

            async fn delete_outbox_agent(
                &self,
                agent: &kici_model::AgentId,
            ) -> Result<u64, $crate::StoreError> {
                let done = sqlx::query($crate::sql::DELETE_OUTBOX_AGENT)
                    .bind(&self.owner_text)
                    .bind(agent.to_string())
                    .execute(self.writer())
                    .await
                    .map_err($crate::error::classify)?;
                Ok(done.rows_affected())
            }

            async fn outbox(&self) -> Result<Vec<$crate::OutboxRecord>, $crate::StoreError> {
                let rows: Vec<$crate::sql::OutboxRow> = sqlx::query_as($crate::sql::OUTBOX)
                    .bind(&self.owner_text)
                    .fetch_all(self.reader())
                    .await
                    .map_err($crate::error::classify)?;
                rows.into_iter()
                    .map($crate::OutboxRecord::try_from)
                    .collect()
            }

            async fn close(&self) {
                self.close_impl().await
            }
        }

        impl $store {
            /// The `network` column's value for `pool` in this store's
            /// address scope.
            fn pool_key(&self, network: ipnet::Ipv4Net) -> String {
                $crate::sql::pool_key(network, self.address_scope.as_ref())
            }

            /// Inserts a row per assignable address of `pool` unless this
            /// store (or any instance, per `ip_networks`) already did. The
            /// in-process mutex keeps concurrent first allocations from all
            /// inserting the same rows; across processes the inserts are
            /// idempotent (`ON CONFLICT DO NOTHING`). In a scoped store, the
            /// addresses this instance still holds in the unscoped pool (an
            /// earlier version's leases, their agents adopted) move into
            /// the scoped one in the same transaction, so no address is
            /// handed out twice across the upgrade.
            async fn ensure_pool(&self, pool: &$crate::Ipv4Pool) -> Result<(), $crate::StoreError> {
                use $crate::error::classify;
                if pool.capacity() > $crate::sql::MAX_PREFILL {
                    return Err($crate::StoreError::Database(format!(
                        "address pool {} has {} addresses; at most {} (a /12) are pre-filled: use a smaller network",
                        pool.network(),
                        pool.capacity(),
                        $crate::sql::MAX_PREFILL
                    )));
                }
                let mut filled = self.filled.lock().await;
                if filled.contains(&pool.network()) {
                    return Ok(());
                }
                let network = self.pool_key(pool.network());
                let known: Option<i64> = sqlx::query_scalar($crate::sql::NETWORK_FILLED)
                    .bind(&network)
                    .fetch_optional(self.writer())
                    .await
                    .map_err(classify)?;
                let unscoped = pool.network().to_string();
                let moving: Vec<(i64, String, Option<i64>)> = if self.address_scope.is_some() {
                    sqlx::query_as($crate::sql::OWNED_IN)
                        .bind(&unscoped)
                        .bind(&self.owner_text)
                        .fetch_all(self.writer())
                        .await
                        .map_err(classify)?
                } else {
                    Vec::new()
                };
                if known.is_none() || !moving.is_empty() {
                    let mut tx = self.begin_write().await.map_err(classify)?;
                    if known.is_none() {
                        let first = pool.assignable().next().map(u32::from).unwrap_or(0);
                        let last = pool.assignable().last().map(u32::from).unwrap_or(0);
                        sqlx::query($crate::sql::FILL_NETWORK)
                            .bind(&network)
                            .bind(i64::from(first))
                            .bind(i64::from(last))
                            .execute(&mut *tx)
                            .await
                            .map_err(classify)?;
                        sqlx::query($crate::sql::MARK_FILLED)
                            .bind(&network)
                            .bind(i64::from(pool.capacity()))
                            .bind($crate::UnixMillis::now().0)
                            .execute(&mut *tx)
                            .await
                            .map_err(classify)?;
                    }
                    for (ip, agent, leased_at) in &moving {
                        let taken = sqlx::query($crate::sql::TAKE_IP)
                            .bind(&network)
                            .bind(ip)
                            .bind(agent)
                            .bind(&self.owner_text)
                            .bind(leased_at)
                            .execute(&mut *tx)
                            .await
                            .map_err(classify)?;
                        if taken.rows_affected() == 0 {
                            // Another daemon of this scope (this machine)
                            // holds it: the lease stays where it is, still
                            // counted, and the operator is told.
                            tracing::warn!(
                                network = %pool.network(),
                                ip = %$crate::sql::ip_from_i64(*ip)?,
                                agent = %agent,
                                "an address this instance leased before address pools were scoped is held by another daemon of this machine; its old lease is kept"
                            );
                            continue;
                        }
                        sqlx::query($crate::sql::RELEASE_IP)
                            .bind(&self.owner_text)
                            .bind(&unscoped)
                            .bind(ip)
                            .execute(&mut *tx)
                            .await
                            .map_err(classify)?;
                    }
                    tx.commit().await.map_err(classify)?;
                }
                filled.insert(pool.network());
                Ok(())
            }
        }

        #[async_trait::async_trait]
        impl $crate::IpAllocator for $store {
            async fn allocate(
                &self,
                pool: &$crate::Ipv4Pool,
                agent: &kici_model::AgentId,
            ) -> Result<$crate::Lease, $crate::AllocError> {
                self.ensure_pool(pool).await?;
                let network = self.pool_key(pool.network());
                let agent_text = agent.to_string();
                // Retries: a unique violation means a concurrent call for the
                // same agent claimed first (the retry returns that lease); no
                // row under SKIP LOCKED can mean every free row is being
                // claimed or released right now, so it is only exhaustion
                // once no free row is left at all.
                let mut retries = 8;
                let ip = loop {
                    let claimed: Result<Option<i64>, sqlx::Error> =
                        sqlx::query_scalar(Self::CLAIM_IP)
                            .bind(&network)
                            .bind(&agent_text)
                            .bind(&self.owner_text)
                            .bind($crate::UnixMillis::now().0)
                            .fetch_optional(self.writer())
                            .await;
                    match claimed {
                        Ok(Some(ip)) => break ip,
                        Ok(None) => {
                            let free: bool = sqlx::query_scalar($crate::sql::ANY_FREE)
                                .bind(&network)
                                .fetch_one(self.writer())
                                .await
                                .map_err(|e| {
                                    $crate::AllocError::from($crate::error::classify(e))
                                })?;
                            if !free || retries == 0 {
                                return Err($crate::AllocError::Exhausted {
                                    network: pool.network(),
                                    capacity: pool.capacity(),
                                });
                            }
                            retries -= 1;
                            tokio::task::yield_now().await;
                        }
                        Err(e) if retries > 0 && $crate::error::is_unique_violation(&e) => {
                            retries -= 1;
                        }
                        Err(e) => return Err($crate::error::classify(e).into()),
                    }
                };
                fail::fail_point!("kici_store::ip::claimed", |_| Err(
                    $crate::AllocError::Store("failpoint kici_store::ip::claimed".to_owned())
                ));
                Ok($crate::Lease {
                    network: pool.network(),
                    ip: $crate::sql::ip_from_i64(ip)?,
                    agent: *agent,
                    owner: self.owner,
                })
            }

            async fn release_agent(
                &self,
                agent: &kici_model::AgentId,
            ) -> Result<u64, $crate::AllocError> {
                let done = sqlx::query($crate::sql::RELEASE_AGENT)
                    .bind(&self.owner_text)
                    .bind(agent.to_string())
                    .execute(self.writer())
                    .await
                    .map_err(|e| $crate::AllocError::from($crate::error::classify(e)))?;
                fail::fail_point!("kici_store::ip::released", |_| Err(
                    $crate::AllocError::Store("failpoint kici_store::ip::released".to_owned())
                ));
                Ok(done.rows_affected())
            }

            async fn release_ip(
                &self,
                network: ipnet::Ipv4Net,
                ip: std::net::Ipv4Addr,
            ) -> Result<bool, $crate::AllocError> {
                let done = sqlx::query($crate::sql::RELEASE_IP)
                    .bind(&self.owner_text)
                    .bind(self.pool_key(network))
                    .bind(i64::from(u32::from(ip)))
                    .execute(self.writer())
                    .await
                    .map_err(|e| $crate::AllocError::from($crate::error::classify(e)))?;
                fail::fail_point!("kici_store::ip::released", |_| Err(
                    $crate::AllocError::Store("failpoint kici_store::ip::released".to_owned())
                ));
                Ok(done.rows_affected() > 0)
            }

            async fn leases(&self) -> Result<Vec<$crate::Lease>, $crate::AllocError> {
                let rows: Vec<(String, i64, String)> = sqlx::query_as($crate::sql::LEASES)
                    .bind(&self.owner_text)
                    .fetch_all(self.reader())
                    .await
                    .map_err(|e| $crate::AllocError::from($crate::error::classify(e)))?;
                rows.into_iter()
                    .map(|(network, ip, agent)| {
                        let bad = |what: String| {
                            $crate::AllocError::from($crate::StoreError::Corrupt {
                                table: "ip_leases",
                                reason: what,
                            })
                        };
                        Ok($crate::Lease {
                            network: $crate::sql::network_of_key(&network)
                                .ok_or_else(|| bad(format!("network {network:?}")))?,
                            ip: $crate::sql::ip_from_i64(ip)?,
                            agent: agent.parse().map_err(|_| bad(format!("agent {agent:?}")))?,
                            owner: self.owner,
                        })
                    })
                    .collect()
            }
        }
    };
}

pub(crate) use impl_state_store;
