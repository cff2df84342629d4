//! Standalone jobs and the SSE event stream in the state store: what lets
//! them survive a daemon restart. (Agents and pending scale requests go
//! through the engine's journal instead: [`crate::durable::state`].)
//!
//! [`Persister`] is the one writer of these tables. Everything it writes
//! arrives on one channel in the order it happened:
//!
//! - every engine event, under its stream id, is recorded *before* SSE
//!   readers see it, in batches: an id a client has seen is always
//!   recorded, so numbering continues after a crash without reusing one.
//!   While the store is down events wait (up to [`MAX_BACKLOG`]; beyond,
//!   the oldest are dropped and readers see a `reset` for them). The newest
//!   `keep` events are kept (bounded retention; never fewer than one, the
//!   highest id is what numbering continues from);
//! - a standalone job's record ([`JobRecorder`], sent by the
//!   [`JobBook`](crate::jobs::JobBook) under its lock at every change, so in
//!   the order the changes happened): written before the job is
//!   acknowledged (a job the store could not record is withdrawn and
//!   answered 503, like a pending request), rewritten when it gets an
//!   agent, starts and ends, deleted when the job is forgotten. A write
//!   that fails because the store is down is retried (a newer write of the
//!   same job supersedes it).
//!
//! A scale request that waits is answered only once its record (a journal
//! entry of the engine) is committed: [`pending_committed`].

use crate::events::{EventLog, LoggedEvent};
use crate::jobs::JobsRestored;
use kici_engine::runtime::Runtime;
use kici_engine::JournalError;
use kici_model::JobId;
use kici_store::{JobRecord, StateStore, StoreError, UnixMillis};
use std::collections::{BTreeMap, VecDeque};
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
    Event(Arc<LoggedEvent>, UnixMillis),
    Flush(oneshot::Sender<bool>),
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

/// Answered once a job's record is committed (or failed).
pub type RecordAck = oneshot::Receiver<Result<(), StoreError>>;

/// Records standalone jobs (held by the [`JobBook`](crate::jobs::JobBook)).
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
            failed_jobs: BTreeMap::new(),
            since_trim: 0,
            down: false,
        };
        let task = tokio::spawn(writer.run(rx));
        Self { tx, task }
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

/// Waits (up to [`RECORD_LIMIT`]) for the record of a scale request that
/// entered the pending queue ([`Runtime::request_scale_recorded`]); on
/// failure the request is withdrawn — not recorded means a crash would
/// forget it, so it must not wait — and the error returned.
pub async fn pending_committed(
    runtime: &Runtime,
    job: &JobId,
    ack: Option<kici_engine::runtime::RecordAck>,
) -> Result<(), PendingNotRecorded> {
    let Some(ack) = ack else { return Ok(()) };
    let result = match tokio::time::timeout(RECORD_LIMIT, ack).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(e))) => Err(PendingNotRecorded::Store(e)),
        Ok(Err(_)) => Err(PendingNotRecorded::Store(JournalError::stopped())),
        Err(_) => Err(PendingNotRecorded::TooSlow(RECORD_LIMIT)),
    };
    if let Err(e) = &result {
        // A record that lands late is deleted by the cancel's own entry,
        // ordered after it.
        runtime.cancel_scale(job);
        tracing::warn!(job_id = %job, error = %e, "pending request not recorded; withdrawn");
    }
    result
}

/// Why a waiting scale request was withdrawn ([`pending_committed`]).
#[derive(Debug, thiserror::Error)]
pub enum PendingNotRecorded {
    #[error("recording the pending request failed")]
    Store(#[source] JournalError),
    #[error("recording the pending request took longer than {0:?}")]
    TooSlow(Duration),
}

struct Writer {
    store: Arc<dyn StateStore>,
    log: Arc<EventLog>,
    keep: u64,
    backlog: VecDeque<(Arc<LoggedEvent>, UnixMillis)>,
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
                    self.retry_jobs().await;
                }
            }
        }
        self.write_events().await;
        self.retry_jobs().await;
    }

    fn behind(&self) -> bool {
        !self.backlog.is_empty() || !self.failed_jobs.is_empty()
    }

    async fn apply(&mut self, op: Op) {
        match op {
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
}

// ----- after a restart ---------------------------------------------------

/// Why a standalone job recorded as waiting before a restart failed: it is
/// not run later (see [`kici_engine::Engine::recover_pending`]).
pub const STANDALONE_LOST: &str =
    "kici-scaler restarted before the job got an agent; it was not run (its submitter's connection ended with the old daemon)";

/// Logs what [`crate::jobs::JobBook::restore`] did.
pub fn log_jobs_restored(r: &JobsRestored) {
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
