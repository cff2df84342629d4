//! The daemon's durable state: the engine's journal written to the state
//! store, and records read back into what recovery needs.
//!
//! [`StoreJournal`] is the engine's [`Journal`], the one durability path of
//! agents and pending scale requests: each agent snapshot becomes one
//! `agents` row (with its token's hash, so a re-adopted agent can still
//! register), each `Forget` deletes it; a request entering the pending
//! queue becomes one `pending_requests` row, deleted when it leaves.
//! [`durable_from_record`] and [`pending_from_record`] are the way back; a
//! row that does not decode is reported, never guessed at.

use crate::gateway::token::TokenStore;
use async_trait::async_trait;
use kici_engine::{
    AgentState, DurableAgent, DurablePending, FailureReason, Journal, JournalEntry, JournalError,
    JournalErrorKind, Mode, ResourceHandle, ScaleRequest,
};
use kici_model::{LabelSet, MemoryBytes, MilliCpu, ResourceRequest, ResourceSpec, Resources};
use kici_store::{AgentRecord, PendingRecord, StateStore, StoreError, UnixMillis};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Separates labels in `label_set_key` (labels never contain a comma).
const LABEL_SEPARATOR: char = ',';

/// Writes the engine's journal to the state store.
pub struct StoreJournal {
    store: Arc<dyn StateStore>,
    tokens: Arc<TokenStore>,
}

impl StoreJournal {
    pub fn new(store: Arc<dyn StateStore>, tokens: Arc<TokenStore>) -> Self {
        Self { store, tokens }
    }
}

#[async_trait]
impl Journal for StoreJournal {
    async fn write(&self, entry: &JournalEntry, at: SystemTime) -> Result<(), JournalError> {
        let result = match entry {
            JournalEntry::Save(d) => {
                let token = self.tokens.export(d.agent);
                self.store
                    .put_agent(&record_from_durable(d, at, token))
                    .await
            }
            JournalEntry::Forget(agent) => self.store.delete_agent(agent).await.map(|_| ()),
            JournalEntry::SavePending(p) => {
                let arrived = at.checked_sub(p.waited).unwrap_or(at);
                self.store
                    .put_pending(&pending_record(&p.request, None, arrived))
                    .await
            }
            JournalEntry::ForgetPending(job) => self.store.delete_pending(job).await.map(|_| ()),
        };
        result.map_err(journal_error)
    }
}

/// The store's error as the journal's: an outage is retried, anything
/// else is a refusal; the store's error stays the source.
pub fn journal_error(e: StoreError) -> JournalError {
    let kind = if e.is_unavailable() {
        JournalErrorKind::Unavailable
    } else {
        JournalErrorKind::Refused
    };
    JournalError::new(kind, e)
}

/// One `agents` row for a snapshot taken at `at`.
pub fn record_from_durable(
    d: &DurableAgent,
    at: SystemTime,
    token: Option<(String, Duration)>,
) -> AgentRecord {
    let created = at.checked_sub(d.age).unwrap_or(at);
    let (token_hash, token_expires_at) = match token {
        Some((hash, remaining)) => (
            Some(hash),
            Some(UnixMillis::from(at.checked_add(remaining).unwrap_or(at))),
        ),
        None => (None, None),
    };
    AgentRecord {
        agent_id: d.agent,
        scaler: d.scaler.clone(),
        backend: d.backend,
        label_set_index: u32::try_from(d.label_set_index).unwrap_or(u32::MAX),
        label_set_key: label_set_key(&d.label_set),
        state: d.state.as_str().to_owned(),
        mode: d.mode.as_str().to_owned(),
        job_id: d.job.clone(),
        run_id: d.run_id.clone(),
        warm: d.warm,
        milli_cpu: d.requests.cpu,
        memory_bytes: d.requests.memory,
        machine_pool: d.machine_pool.clone(),
        resource_id: d.handle.as_ref().map(|h| h.id.clone()),
        resources: d
            .handle
            .as_ref()
            .map(|h| h.extra.clone())
            .unwrap_or_default(),
        token_hash,
        token_expires_at,
        failure: d.failure.map(|f| f.as_str().to_owned()),
        created_at: UnixMillis::from(created),
        updated_at: UnixMillis::from(at),
    }
}

pub fn label_set_key(labels: &LabelSet) -> String {
    let mut key = String::new();
    for (i, l) in labels.iter().enumerate() {
        if i > 0 {
            key.push(LABEL_SEPARATOR);
        }
        key.push_str(l.as_str());
    }
    key
}

/// A recorded token: its hash and when it expires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedToken {
    pub hash: String,
    pub expires_at: SystemTime,
}

/// The engine's view of a recorded agent (and its token), as of `now`.
pub fn durable_from_record(
    r: &AgentRecord,
    now: SystemTime,
) -> Result<(DurableAgent, Option<RecordedToken>), String> {
    let bad = |what: &str, e: String| format!("agent {}: {what}: {e}", r.agent_id);
    let label_set = if r.label_set_key.is_empty() {
        LabelSet::default()
    } else {
        LabelSet::parse(r.label_set_key.split(LABEL_SEPARATOR))
            .map_err(|e| bad("label set", e.to_string()))?
    };
    let state: AgentState = r.state.parse().map_err(|e| bad("state", e))?;
    let mode: Mode = r.mode.parse().map_err(|e| bad("mode", e))?;
    let failure = r
        .failure
        .as_deref()
        .map(str::parse::<FailureReason>)
        .transpose()
        .map_err(|e| bad("failure", e))?;
    let handle = match (&r.resource_id, r.resources.is_empty()) {
        (None, true) => None,
        (id, _) => Some(ResourceHandle {
            id: id.clone().unwrap_or_default(),
            extra: r.resources.clone(),
        }),
    };
    let age = now
        .duration_since(r.created_at.to_system_time())
        .unwrap_or_default();
    let token = r.token_hash.clone().map(|hash| RecordedToken {
        hash,
        expires_at: r
            .token_expires_at
            .map(UnixMillis::to_system_time)
            .unwrap_or(now),
    });
    Ok((
        DurableAgent {
            agent: r.agent_id,
            scaler: r.scaler.clone(),
            backend: r.backend,
            label_set_index: r.label_set_index as usize,
            label_set,
            state,
            job: r.job_id.clone(),
            run_id: r.run_id.clone(),
            mode,
            warm: r.warm,
            requests: Resources {
                cpu: r.milli_cpu,
                memory: r.memory_bytes,
            },
            machine_pool: r.machine_pool.clone(),
            handle,
            failure,
            age,
        },
        token,
    ))
}

// ----- the record's shape ------------------------------------------------

/// `pending_requests.request`: what re-queues the request after a restart.
/// A standalone job's environment is not kept (it may carry secrets, and a
/// standalone job is never re-run after a restart, see
/// [`kici_engine::Engine::recover_pending`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StoredRequest {
    mode: String,
    #[serde(default)]
    exclude: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    requests: Option<StoredSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    limits: Option<StoredSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    command: Option<Vec<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StoredSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    milli_cpu: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    memory_bytes: Option<u64>,
}

impl From<ResourceSpec> for StoredSpec {
    fn from(s: ResourceSpec) -> Self {
        Self {
            milli_cpu: s.cpus.map(MilliCpu::millis),
            memory_bytes: s.memory.map(MemoryBytes::bytes),
        }
    }
}

impl From<StoredSpec> for ResourceSpec {
    fn from(s: StoredSpec) -> Self {
        Self {
            cpus: s.milli_cpu.map(MilliCpu::from_millis),
            memory: s.memory_bytes.map(MemoryBytes::from_bytes),
        }
    }
}

fn labels_text(labels: &LabelSet) -> Vec<String> {
    labels.iter().map(|l| l.as_str().to_owned()).collect()
}

/// The record of `request`, queued at `at` (`argv`: a standalone job's
/// command; the journal does not carry it, a job's own record does).
pub fn pending_record(
    request: &ScaleRequest,
    argv: Option<&[String]>,
    at: SystemTime,
) -> PendingRecord {
    let stored = StoredRequest {
        mode: request.mode.as_str().to_owned(),
        exclude: labels_text(&request.exclude),
        requests: request
            .resources
            .and_then(|r| r.requests)
            .map(StoredSpec::from),
        limits: request
            .resources
            .and_then(|r| r.limits)
            .map(StoredSpec::from),
        command: argv.map(<[String]>::to_vec),
    };
    PendingRecord {
        job_id: request.job.clone(),
        labels: labels_text(&request.labels),
        // A plain struct of strings and numbers always serializes.
        request: serde_json::to_value(&stored).unwrap_or(serde_json::Value::Null),
        run_id: request.run_id.clone(),
        created_at: UnixMillis::from(at),
    }
}

/// The request a record holds, and a standalone job's command.
pub fn request_from_record(
    r: &PendingRecord,
) -> Result<(ScaleRequest, Option<Vec<String>>), String> {
    let stored: StoredRequest =
        serde_json::from_value(r.request.clone()).map_err(|e| format!("request: {e}"))?;
    let mode: Mode = stored.mode.parse().map_err(|e| format!("mode: {e}"))?;
    let labels = LabelSet::parse(r.labels.iter()).map_err(|e| format!("labels: {e}"))?;
    let exclude = LabelSet::parse(stored.exclude.iter()).map_err(|e| format!("exclude: {e}"))?;
    let resources = match (stored.requests, stored.limits) {
        (None, None) => None,
        (requests, limits) => Some(ResourceRequest {
            requests: requests.map(ResourceSpec::from),
            limits: limits.map(ResourceSpec::from),
        }),
    };
    Ok((
        ScaleRequest {
            job: r.job_id.clone(),
            run_id: r.run_id.clone(),
            labels,
            exclude,
            resources,
            mode,
        },
        stored.command,
    ))
}

/// The engine's view of a recorded pending request, as of `now`.
pub fn pending_from_record(r: &PendingRecord, now: SystemTime) -> Result<DurablePending, String> {
    let (request, _) = request_from_record(r)?;
    let waited = now
        .duration_since(r.created_at.to_system_time())
        .unwrap_or_default();
    Ok(DurablePending { request, waited })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kici_model::{AgentId, MemoryBytes, MilliCpu, ScalerType};
    use std::collections::BTreeMap;

    fn durable() -> DurableAgent {
        DurableAgent {
            agent: AgentId::new(ScalerType::Container, [1, 2, 3, 4]),
            scaler: kici_model::ScalerName::new("docker"),
            backend: ScalerType::Container,
            label_set_index: 1,
            label_set: LabelSet::parse(["linux", "docker", "gpu"]).unwrap(),
            state: AgentState::Busy,
            job: Some("job-1".parse().unwrap()),
            run_id: Some("run-9".into()),
            mode: Mode::Orchestrator,
            warm: false,
            requests: Resources {
                cpu: MilliCpu::from_millis(1500),
                memory: MemoryBytes::from_bytes(1 << 30),
            },
            machine_pool: Some("pool-a".into()),
            handle: Some(ResourceHandle {
                id: "c0ffee".into(),
                extra: BTreeMap::from([("ip".to_owned(), "172.29.0.9".to_owned())]),
            }),
            failure: None,
            age: Duration::from_secs(90),
        }
    }

    #[test]
    fn a_snapshot_survives_the_round_trip_through_a_row() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let d = durable();
        let row = record_from_durable(&d, at, Some(("ab".repeat(32), Duration::from_secs(60))));
        assert_eq!(row.state, "busy");
        assert_eq!(row.mode, "orchestrator");
        assert_eq!(
            row.created_at,
            UnixMillis::from(at - Duration::from_secs(90))
        );
        let later = at + Duration::from_secs(10);
        let (back, token) = durable_from_record(&row, later).unwrap();
        assert_eq!(back.age, Duration::from_secs(100));
        assert_eq!(DurableAgent { age: d.age, ..back }, d);
        let token = token.unwrap();
        assert_eq!(token.hash, "ab".repeat(32));
        assert_eq!(token.expires_at, at + Duration::from_secs(60));
    }

    #[test]
    fn a_row_that_does_not_decode_says_which_field() {
        let at = SystemTime::now();
        let mut row = record_from_durable(&durable(), at, None);
        row.state = "napping".into();
        let err = durable_from_record(&row, at).unwrap_err();
        assert!(err.contains("state") && err.contains("napping"), "{err}");
        let mut row = record_from_durable(&durable(), at, None);
        row.mode = "x".into();
        assert!(durable_from_record(&row, at).unwrap_err().contains("mode"));
    }

    #[test]
    fn a_request_survives_its_record() {
        let request = ScaleRequest {
            job: "job-1".parse().unwrap(),
            run_id: Some("run-7".into()),
            labels: LabelSet::parse(["linux", "x64"]).unwrap(),
            exclude: LabelSet::parse(["gpu"]).unwrap(),
            resources: Some(ResourceRequest {
                requests: Some(ResourceSpec {
                    cpus: Some(MilliCpu::from_millis(1500)),
                    memory: None,
                }),
                limits: Some(ResourceSpec {
                    cpus: Some(MilliCpu::from_millis(2000)),
                    memory: Some(MemoryBytes::from_bytes(1 << 30)),
                }),
            }),
            mode: Mode::Orchestrator,
        };
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let record = pending_record(&request, None, at);
        assert_eq!(record.created_at, UnixMillis(1_000_000));
        assert_eq!(
            request_from_record(&record).unwrap(),
            (request.clone(), None)
        );
        let back = pending_from_record(&record, at + Duration::from_secs(5)).unwrap();
        assert_eq!(back.request, request);
        assert_eq!(back.waited, Duration::from_secs(5));

        let standalone = ScaleRequest {
            job: "job-2".parse().unwrap(),
            run_id: None,
            labels: LabelSet::parse(["linux"]).unwrap(),
            exclude: LabelSet::default(),
            resources: None,
            mode: Mode::Standalone,
        };
        let argv = vec!["sh".to_owned(), "-c".to_owned(), "true".to_owned()];
        let record = pending_record(&standalone, Some(&argv), at);
        assert_eq!(
            request_from_record(&record).unwrap(),
            (standalone, Some(argv))
        );
    }
}
