//! Pending scale requests, standalone jobs and the SSE event stream in the
//! state store: what lets them survive a daemon restart.
//!
//! [`Persister`] is the one writer of these tables. Everything it writes
//! arrives on one channel in the order it happened:
//!
//! - a scale request that entered the pending queue is recorded
//!   ([`PendingRecorder::record_if_queued`]); the record is sent from inside
//!   the engine call that queued it, so it is ahead of every later event
//!   about that job, and the API answers only once it is committed (a
//!   request the store could not record is withdrawn and answered 503:
//!   nothing waits that a crash would forget);
//! - the request leaves the queue (`pending-ended`: admitted, cancelled,
//!   expired, …) → its record is deleted (retried until the store answers;
//!   a newer record of the same job id supersedes a failed delete);
//! - every engine event, under its stream id, is recorded *before* SSE
//!   readers see it, in batches: an id a client has seen is always
//!   recorded, so numbering continues after a crash without reusing one.
//!   While the store is down events wait (up to [`MAX_BACKLOG`]; beyond,
//!   the oldest are dropped and readers see a `reset` for them). The newest
//!   `keep` events are kept (bounded retention; never fewer than one, the
//!   highest id is what numbering continues from);
//! - a standalone job's record ([`JobRecorder`], sent by the
//!   [`JobBook`] under its lock at every change, so in
//!   the order the changes happened): written before the job is
//!   acknowledged (a job the store could not record is withdrawn and
//!   answered 503, like a pending request), rewritten when it gets an
//!   agent, starts and ends, deleted when the job is forgotten. A write
//!   that fails because the store is down is retried (a newer write of the
//!   same job supersedes it).
//!
//! After a restart, [`restore`] takes the recorded jobs back first (a job
//! that had not ended is shown ended, aborted, with why: see
//! [`crate::jobs::JobBook::restore`]), then re-queues the recorded requests
//! with their original arrival time (so their place and their TTL), see
//! [`restore_pending`] for which ones.

use crate::events::{EventLog, LoggedEvent};
use crate::jobs::{JobBook, JobsRestored};
use kici_engine::runtime::Runtime;
use kici_engine::{Mode, ScaleError, ScaleOutcome, ScaleRequest};
use kici_model::{JobId, LabelSet, MemoryBytes, MilliCpu, ResourceRequest, ResourceSpec};
use kici_store::{JobRecord, PendingRecord, StateStore, StoreError, UnixMillis};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Most events waiting for the store (an outage); beyond, the oldest go.
pub const MAX_BACKLOG: usize = 65_536;
/// Most events written in one transaction.
const BATCH: usize = 256;
/// How often failed writes are retried.
const RETRY_EVERY: Duration = Duration::from_millis(500);
/// How long a scale request waits for its record before it is withdrawn.
pub const RECORD_LIMIT: Duration = Duration::from_secs(2);

enum Op {
    Put(PendingRecord, oneshot::Sender<Result<(), StoreError>>),
    Delete(JobId),
    Event(Arc<LoggedEvent>, UnixMillis),
    Flush(oneshot::Sender<bool>),
    /// Pending-ended events may have been missed (the pump fell behind):
    /// delete every record whose job no longer waits.
    Resync(Runtime),
    /// A standalone job's record, as of now; the sender (if any) is told
    /// how the first attempt went.
    PutJob(JobRecord, Option<oneshot::Sender<Result<(), StoreError>>>),
    DeleteJob(JobId),
}

/// The writer task (owned by the event pump, which feeds it events).
pub struct Persister {
    tx: mpsc::UnboundedSender<Op>,
    task: JoinHandle<()>,
}

/// Answered once a pending request's record is committed (or failed).
pub type RecordAck = oneshot::Receiver<Result<(), StoreError>>;

/// Records pending requests (held by the API and the job submitter).
#[derive(Clone)]
pub struct PendingRecorder {
    tx: mpsc::UnboundedSender<Op>,
}

/// Records standalone jobs (held by the [`JobBook`]).
#[derive(Clone)]
pub struct JobRecorder {
    tx: mpsc::UnboundedSender<Op>,
}

impl std::fmt::Debug for JobRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobRecorder")
    }
}

impl Persister {
    /// Starts the writer: recorded events go to `log` once committed; the
    /// newest `keep` are kept in the store.
    pub fn start(store: Arc<dyn StateStore>, log: Arc<EventLog>, keep: u64) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let writer = Writer {
            store,
            log,
            keep: keep.max(1),
            backlog: VecDeque::new(),
            failed_deletes: BTreeSet::new(),
            failed_jobs: BTreeMap::new(),
            since_trim: 0,
            down: false,
        };
        let task = tokio::spawn(writer.run(rx));
        Self { tx, task }
    }

    pub fn recorder(&self) -> PendingRecorder {
        PendingRecorder {
            tx: self.tx.clone(),
        }
    }

    pub fn job_recorder(&self) -> JobRecorder {
        JobRecorder {
            tx: self.tx.clone(),
        }
    }

    /// An event to record, then publish.
    pub fn event(&self, event: LoggedEvent, at: SystemTime) {
        // The task ends only after `finish`.
        let _ = self
            .tx
            .send(Op::Event(Arc::new(event), UnixMillis::from(at)));
    }

    /// A pending request left the queue.
    pub fn pending_ended(&self, job: JobId) {
        let _ = self.tx.send(Op::Delete(job));
    }

    /// The pump missed events: records of requests that left the queue
    /// meanwhile are found and deleted.
    pub fn resync(&self, runtime: Runtime) {
        let _ = self.tx.send(Op::Resync(runtime));
    }

    /// Writes what can be written (bounded by `limit`), then stops.
    pub async fn finish(self, limit: Duration) -> bool {
        let (done, flushed) = oneshot::channel();
        let _ = self.tx.send(Op::Flush(done));
        let ok = matches!(tokio::time::timeout(limit, flushed).await, Ok(Ok(true)));
        drop(self.tx);
        self.task.abort();
        ok
    }
}

impl PendingRecorder {
    /// Runs `request` through the engine and, if it entered the pending
    /// queue just now (a retry of a waiting job is not recorded again),
    /// sends its record — under the engine's lock, ahead of any event about
    /// it. `argv`: a standalone job's command, kept for its record.
    pub fn record_if_queued(
        &self,
        runtime: &Runtime,
        request: ScaleRequest,
        argv: Option<&[String]>,
    ) -> (Result<ScaleOutcome, ScaleError>, Option<RecordAck>) {
        let record = pending_record(&request, argv, SystemTime::now());
        let job = request.job.clone();
        runtime.call(|e, now| {
            let known = e.is_pending(&job);
            let outcome = e.request_scale(request, now);
            let queued =
                matches!(outcome, Ok(ScaleOutcome::Pending { .. })) && !known && e.is_pending(&job);
            let ack = queued.then(|| {
                let (tx, rx) = oneshot::channel();
                let _ = self.tx.send(Op::Put(record, tx));
                rx
            });
            (outcome, ack)
        })
    }

    /// Waits for a record sent by [`PendingRecorder::record_if_queued`];
    /// on failure the request is withdrawn (and the error returned).
    pub async fn committed(
        runtime: &Runtime,
        job: &JobId,
        ack: Option<RecordAck>,
    ) -> Result<(), StoreError> {
        let Some(ack) = ack else { return Ok(()) };
        let result = match tokio::time::timeout(RECORD_LIMIT, ack).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(StoreError::Unavailable("the state writer stopped".into())),
            Err(_) => Err(StoreError::Unavailable(format!(
                "recording the pending request took longer than {RECORD_LIMIT:?}"
            ))),
        };
        if let Err(e) = &result {
            // Not recorded means a crash would forget it: it must not wait.
            // (A record that lands late is deleted by the cancel's event.)
            runtime.cancel_scale(job);
            tracing::warn!(job_id = %job, error = %e, "pending request not recorded; withdrawn");
        }
        result
    }

    /// Deletes a record (ordered after every record sent before).
    pub fn forget(&self, job: JobId) {
        let _ = self.tx.send(Op::Delete(job));
    }
}

impl JobRecorder {
    /// Writes `record` (ordered after every record sent before); the
    /// answer says whether the first attempt was committed. Dropping it is
    /// fine: a write that failed because the store is down is retried
    /// either way, until a newer record of the job replaces it.
    pub fn save(&self, record: JobRecord) -> RecordAck {
        let (tx, rx) = oneshot::channel();
        let _ = self.tx.send(Op::PutJob(record, Some(tx)));
        rx
    }

    /// Deletes a job's record (ordered after every record sent before).
    pub fn forget(&self, job: JobId) {
        let _ = self.tx.send(Op::DeleteJob(job));
    }

    /// Waits (up to [`RECORD_LIMIT`]) for the answer of [`JobRecorder::save`].
    pub async fn committed(ack: RecordAck) -> Result<(), StoreError> {
        match tokio::time::timeout(RECORD_LIMIT, ack).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(StoreError::Unavailable("the state writer stopped".into())),
            Err(_) => Err(StoreError::Unavailable(format!(
                "recording the job took longer than {RECORD_LIMIT:?}"
            ))),
        }
    }
}

struct Writer {
    store: Arc<dyn StateStore>,
    log: Arc<EventLog>,
    keep: u64,
    backlog: VecDeque<(Arc<LoggedEvent>, UnixMillis)>,
    failed_deletes: BTreeSet<JobId>,
    /// Job records the store was down for: the newest of each job (`None`:
    /// its delete), retried.
    failed_jobs: BTreeMap<JobId, Option<JobRecord>>,
    since_trim: u64,
    /// The last write failed (log once per outage).
    down: bool,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Op>) {
        let mut retry = tokio::time::interval(RETRY_EVERY);
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                op = rx.recv() => {
                    let Some(op) = op else { break };
                    self.apply(op).await;
                    // Whatever else is queued joins the same batch.
                    while let Ok(op) = rx.try_recv() {
                        self.apply(op).await;
                        if self.backlog.len() >= BATCH {
                            self.write_events().await;
                        }
                    }
                    self.write_events().await;
                }
                _ = retry.tick(), if self.behind() => {
                    self.write_events().await;
                    self.retry_deletes().await;
                    self.retry_jobs().await;
                }
            }
        }
        self.write_events().await;
        self.retry_deletes().await;
        self.retry_jobs().await;
    }

    fn behind(&self) -> bool {
        !self.backlog.is_empty() || !self.failed_deletes.is_empty() || !self.failed_jobs.is_empty()
    }

    async fn apply(&mut self, op: Op) {
        match op {
            Op::Put(record, ack) => {
                self.failed_deletes.remove(&record.job_id);
                let _ = ack.send(self.store.put_pending(&record).await);
            }
            Op::Delete(job) => self.delete(job).await,
            Op::Event(event, at) => {
                if self.backlog.len() >= MAX_BACKLOG {
                    if let Some((dropped, _)) = self.backlog.pop_front() {
                        tracing::warn!(
                            event_id = dropped.id,
                            "the state store is down and the event backlog is full; event dropped"
                        );
                    }
                }
                self.backlog.push_back((event, at));
            }
            Op::Resync(runtime) => self.resync(&runtime).await,
            Op::PutJob(record, ack) => {
                self.failed_jobs.remove(&record.job_id);
                let result = self.write_job(&record.job_id, Some(&record), true).await;
                if let Some(ack) = ack {
                    let _ = ack.send(result);
                }
            }
            Op::DeleteJob(job) => {
                self.failed_jobs.remove(&job);
                let _ = self.write_job(&job, None, true).await;
            }
            Op::Flush(done) => {
                self.write_events().await;
                self.retry_deletes().await;
                self.retry_jobs().await;
                let _ = done.send(!self.behind());
            }
        }
    }

    /// Writes (`Some`) or deletes (`None`) a job's record; kept for a retry
    /// if the store is down (said once per write, not at every retry).
    async fn write_job(
        &mut self,
        job: &JobId,
        record: Option<&JobRecord>,
        first: bool,
    ) -> Result<(), StoreError> {
        let result = match record {
            Some(r) => self.store.put_job(r).await,
            None => self.store.delete_job(job).await.map(|_| ()),
        };
        match &result {
            Ok(()) => {}
            Err(e) if e.is_unavailable() => {
                if first {
                    tracing::warn!(job_id = %job, error = %e, "recording a job failed; retrying");
                }
                self.failed_jobs.insert(job.clone(), record.cloned());
            }
            // Not an outage: a retry would fail the same way.
            Err(e) => {
                tracing::error!(job_id = %job, error = %e, "a job's record could not be written")
            }
        }
        result
    }

    async fn retry_jobs(&mut self) {
        let jobs = std::mem::take(&mut self.failed_jobs);
        let mut left = jobs.into_iter();
        while let Some((job, record)) = left.next() {
            let _ = self.write_job(&job, record.as_ref(), false).await;
            if self.failed_jobs.contains_key(&job) {
                // Still down: keep the rest for the next tick.
                self.failed_jobs.extend(left);
                return;
            }
        }
    }

    /// Records the backlog in batches and publishes what was recorded.
    async fn write_events(&mut self) {
        while !self.backlog.is_empty() {
            let n = self.backlog.len().min(BATCH);
            let rows: Vec<_> = self
                .backlog
                .iter()
                .take(n)
                .map(|(e, at)| e.to_record(*at))
                .collect();
            match self.store.append_events(&rows).await {
                Ok(()) => {
                    if self.down {
                        tracing::info!("the state store answers again; events recorded");
                        self.down = false;
                    }
                    for (e, _) in self.backlog.drain(..n) {
                        self.log.push(e);
                    }
                    self.since_trim += n as u64;
                }
                Err(StoreError::Unavailable(e)) => {
                    if !self.down {
                        tracing::warn!(error = %e, waiting = self.backlog.len(), "recording events failed; SSE readers wait until the store answers");
                        self.down = true;
                    }
                    return;
                }
                Err(e) => {
                    // Not an outage: retrying would block every later event.
                    // Unrecorded, they are not published (readers see a gap).
                    tracing::error!(error = %e, events = n, "events could not be recorded; dropped");
                    self.backlog.drain(..n);
                }
            }
        }
        if self.since_trim >= self.keep.div_ceil(4).max(64) {
            match self.store.trim_events(self.keep).await {
                Ok(_) => self.since_trim = 0,
                Err(e) => tracing::debug!(error = %e, "trimming recorded events failed; next time"),
            }
        }
    }

    async fn delete(&mut self, job: JobId) {
        if let Err(e) = self.store.delete_pending(&job).await {
            tracing::warn!(job_id = %job, error = %e, "deleting a pending request's record failed; retrying");
            self.failed_deletes.insert(job);
        }
    }

    async fn resync(&mut self, runtime: &Runtime) {
        let recorded = match self.store.pending().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "re-reading pending records failed");
                return;
            }
        };
        // Asked under the engine's lock: a record sent after this answer
        // is behind us in the channel, so deleting now cannot undo it.
        let gone: Vec<JobId> = runtime.call(|e, _| {
            recorded
                .into_iter()
                .map(|r| r.job_id)
                .filter(|j| !e.is_pending(j))
                .collect()
        });
        for job in gone {
            self.delete(job).await;
        }
    }

    async fn retry_deletes(&mut self) {
        let jobs = std::mem::take(&mut self.failed_deletes);
        for (i, job) in jobs.iter().enumerate() {
            if self.store.delete_pending(job).await.is_err() {
                // Still down: keep this one and the rest.
                self.failed_deletes.extend(jobs.into_iter().skip(i));
                return;
            }
        }
    }
}

// ----- the record's shape ------------------------------------------------

/// `pending_requests.request`: what re-queues the request after a restart.
/// A standalone job's environment is not kept (it may carry secrets, and a
/// standalone job is never re-run after a restart, see [`restore_pending`]).
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

/// The record of `request`, queued at `at`.
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
fn request_from_record(r: &PendingRecord) -> Result<(ScaleRequest, Option<Vec<String>>), String> {
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

// ----- after a restart ---------------------------------------------------

/// What [`restore_pending`] did with each recorded request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingRestored {
    /// Waiting again (or admitted at once), in arrival order.
    pub requeued: Vec<JobId>,
    /// Standalone jobs, failed: their submitter's connection died with the
    /// daemon.
    pub standalone_failed: Vec<JobId>,
    /// TTL ran out while the daemon was down.
    pub expired: Vec<JobId>,
    /// Admitted before the crash (a recorded agent holds the job): only
    /// the record was left behind.
    pub already_admitted: Vec<JobId>,
    /// Could not be re-queued (no scaler accepts it any more, too large,
    /// unreadable record, …), with why.
    pub dropped: Vec<(JobId, String)>,
}

/// Takes back what was recorded before a restart besides agents: the
/// standalone jobs first ([`JobBook::restore`]: every one shown again, one
/// that had not ended ended now, with why), then the pending requests
/// ([`restore_pending`]). Must run where [`restore_pending`] must.
pub fn restore(
    runtime: &Runtime,
    recorder: &PendingRecorder,
    jobs: &JobBook,
    job_records: Vec<JobRecord>,
    pending: Vec<PendingRecord>,
    jobs_of_recorded_agents: &HashSet<JobId>,
    now: SystemTime,
) -> PendingRestored {
    let restored = jobs.restore(job_records);
    log_jobs_restored(&restored);
    restore_pending(
        runtime,
        recorder,
        jobs,
        pending,
        jobs_of_recorded_agents,
        now,
    )
}

fn log_jobs_restored(r: &JobsRestored) {
    tracing::info!(
        finished = r.finished,
        aborted_running = r.aborted_running.len(),
        aborted_unstarted = r.aborted_unstarted.len(),
        output_lost = r.output_lost.len(),
        unreadable = r.unreadable.len(),
        stray_output_files = r.stray_files,
        "recorded jobs restored"
    );
    for (job, why) in &r.unreadable {
        tracing::warn!(job_id = %job, reason = %why, "recorded job unreadable; its record is deleted");
    }
}

/// Why a restored standalone job failed.
pub const STANDALONE_LOST: &str =
    "kici-scaler restarted before the job got an agent; it was not run (its submitter's connection ended with the old daemon)";

/// Re-queues the requests recorded before a restart. Must run after the
/// recorded agents were recovered and before the engine's first tick
/// ([`Runtime::recover_then_start`]).
///
/// - Orchestrator mode: re-queued with its original arrival time, so its
///   place in the queue and its expiry (`pendingTtl` counts from the
///   arrival); dedupe by job id works as before the restart (a retry with
///   the same body gets the current answer, another body a conflict).
/// - Standalone mode: **not** re-queued. Its submitter (`kici-scaler run`,
///   or a client following `/v1/jobs/{id}/logs`) lost its connection when
///   the daemon died and was told the job failed; running it later, unseen,
///   could run it twice if the user re-submits. This is the same decision
///   as for standalone agents with a job, which recovery destroys. The job
///   is shown `failed` (reason [`STANDALONE_LOST`]) by `GET /v1/jobs/{id}`
///   until it is forgotten like any finished job.
/// - A request whose job a recorded agent already holds was admitted just
///   before the crash (its record's delete was not written yet): dropped.
///
/// Every record that is not waiting afterwards is deleted (through
/// `recorder`, so in order with later records).
pub fn restore_pending(
    runtime: &Runtime,
    recorder: &PendingRecorder,
    jobs: &JobBook,
    records: Vec<PendingRecord>,
    jobs_of_recorded_agents: &HashSet<JobId>,
    now: SystemTime,
) -> PendingRestored {
    let mut done = PendingRestored::default();
    for record in records {
        let job = record.job_id.clone();
        if jobs_of_recorded_agents.contains(&job) {
            recorder.forget(job.clone());
            done.already_admitted.push(job);
            continue;
        }
        let (request, command) = match request_from_record(&record) {
            Ok(r) => r,
            Err(e) => {
                recorder.forget(job.clone());
                done.dropped.push((job, format!("unreadable record: {e}")));
                continue;
            }
        };
        if request.mode == Mode::Standalone {
            // Usually [`JobBook::restore`] already showed it from its own
            // record; this covers a request recorded without one.
            jobs.restore_aborted(
                job.clone(),
                request.labels.clone(),
                command.unwrap_or_default(),
                STANDALONE_LOST.to_owned(),
            );
            recorder.forget(job.clone());
            done.standalone_failed.push(job);
            continue;
        }
        let waited = now
            .duration_since(record.created_at.to_system_time())
            .unwrap_or_default();
        match runtime.call(|e, at| e.restore_pending(request, waited, at)) {
            Ok(Some(ScaleOutcome::Pending { .. } | ScaleOutcome::Spawning { .. })) => {
                // Admitted at once: its `pending-ended` event deletes the
                // record. Still waiting: the record stays as it is.
                done.requeued.push(job);
            }
            Ok(None) => {
                recorder.forget(job.clone());
                done.expired.push(job);
            }
            Ok(Some(ScaleOutcome::NoBackend { explanation })) => {
                recorder.forget(job.clone());
                done.dropped
                    .push((job, format!("no-backend: {explanation}")));
            }
            Ok(Some(ScaleOutcome::TooLarge { cap, detail })) => {
                recorder.forget(job.clone());
                done.dropped
                    .push((job, format!("too-large ({cap}): {detail}")));
            }
            Err(e) => {
                recorder.forget(job.clone());
                done.dropped.push((job, e.to_string()));
            }
        }
    }
    done
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

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
        assert_eq!(request_from_record(&record).unwrap(), (request, None));

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
