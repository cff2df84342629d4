//! Standalone jobs (see docs/deviations.md, D-standalone-mode): kici-scaler as the dispatcher.
//!
//! A job arrives through `POST /v1/jobs` or `kici-scaler run` as labels, a
//! command (argv), env, resources and a timeout. [`submit`] mints its id,
//! records it here and asks the engine for an agent (a scale request in
//! standalone mode). From then on the job's record follows three sources:
//!
//! - the engine's effects ([`JobBook::apply`], every one, in the engine's
//!   order — never its observer event stream): admitted from the pending
//!   queue → `spawning` with its agent; a warm agent took it → dispatched;
//!   the agent destroyed (or failed) before the job ended → `failed` with
//!   the reason; the pending request expired or cancelled by a reload →
//!   `failed`;
//! - the agent gateway: the job dispatched and acknowledged → `running`;
//!   output chunks; the terminal `job.status` → `succeeded`, `failed` or
//!   `cancelled` with the exit code or signal;
//! - the API: a cancel.
//!
//! Output is kept in memory per job, in arrival order, bounded by
//! [`OUTPUT_CAP_BYTES`]: when a job writes more, its oldest chunks are
//! dropped and a reader that had not read them yet is told which it missed.
//! Finished jobs stay readable until [`FINISHED_KEPT`] newer ones finished.
//!
//! With a state store ([`JobBook::durable`]) a job also outlives a crash of
//! the daemon: its record (labels, command — never its environment —,
//! state, agent, end) is written before the job is acknowledged and again
//! at every change of state, through the state writer of the event stream
//! ([`crate::durable::persist`]), and deleted when the job is forgotten; its output
//! is appended to a file as it arrives (`spool`). After a restart,
//! [`JobBook::restore`] shows every recorded job again: one that had ended
//! as it ended, one that had not as `failed`, `end: aborted`, with why (the
//! agent of a started job is destroyed by the recovery, like every
//! standalone agent with a job), and its output so far readable — or, when
//! its file cannot be read, `outputLost`.
//!
//! A job whose agent fails before running it is not retried on another
//! agent: the engine, which knows the job is a standalone one, does not
//! re-queue it and ends it with the reason, so `run` can say what went
//! wrong at once.

mod spool;

use crate::durable::persist::{JobRecorder, PendingNotRecorded, RecordAck};
use kici_engine::runtime::Runtime;
use kici_engine::{JobEffect, JobLost, Mode, StopCause};
use kici_engine::{PendingEnd, ScaleError, ScaleOutcome, ScaleRequest};
use kici_model::{AgentId, JobId, LabelSet, ResourceRequest};
use kici_protocol::{ChunkData, JobEnd, JobSpec, OutputStream};
use kici_store::{JobRecord, UnixMillis};
use parking_lot::Mutex;
use rand::RngCore;
use serde::de::DeserializeOwned;
use serde::Serialize;
use spool::{Spool, SpoolFile};
use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;
use tokio::sync::watch;

/// Most output bytes kept in memory per job (4 MiB); beyond, the oldest
/// chunks are dropped.
pub const OUTPUT_CAP_BYTES: usize = 4 * 1024 * 1024;
/// Finished jobs kept readable (state and output); older ones are forgotten.
pub const FINISHED_KEPT: usize = 256;
/// Most chunks handed to a reader per call.
const READ_BATCH: usize = 64;
/// The directory in the daemon's state dir that holds every job's output
/// file (see `spool`).
pub const OUTPUT_DIR: &str = "job-output";

/// Why a job that ran when the daemon died ended (its agent is destroyed
/// by the recovery; running it again is not ours to decide).
pub const RESTARTED_WHILE_RUNNING: &str = "kici-scaler restarted while the job ran";
/// Why a fleet's job ended whose host was lost while it ran: the host died
/// (back or not), or was cut off from the fleet past its lease. One
/// reason wherever the job is shown: its host's own book after a restart,
/// any other host reading the fleet's queue (whose outcome is `host
/// lost`), the host cut off once it is back.
pub const HOST_LOST_WHILE_RUNNING: &str =
    "host lost while the job ran: the host running it died or was cut off from the fleet, and the fleet gave the job up";
/// Why a job whose agent was being provisioned when the daemon died ended.
pub const RESTARTED_BEFORE_START: &str =
    "kici-scaler restarted before the job's agent reported it started; the agent was destroyed";

// A job's state, end and view are the control API's types: their names
// are spelled once, in `kici-api` (also what the store records).
pub use kici_api::{EndKind, JobState, JobView};

/// One chunk of a job's output, numbered from 0 in arrival order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub index: u64,
    pub stream: OutputStream,
    pub data: ChunkData,
}

/// What a reader gets next ([`JobBook::read`]).
#[derive(Debug)]
pub enum Read {
    /// Chunks after the reader's position; `missed` is the range of chunk
    /// indexes it asked for that were dropped (the buffer's cap).
    Chunks {
        missed: Option<(u64, u64)>,
        chunks: Vec<Chunk>,
    },
    /// Nothing new yet: wait for a change, then read again.
    Wait(watch::Receiver<u64>),
    /// Everything was read and the job ended.
    End(Box<JobView>),
}

/// What the gateway must do because of an engine effect
/// ([`JobBook::apply`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// A warm agent took the job: the gateway must dispatch it on the
    /// agent's open connection.
    Dispatch { agent: AgentId, spec: JobSpec },
}

#[derive(Debug, Default)]
struct Output {
    chunks: VecDeque<Chunk>,
    next_index: u64,
    kept_bytes: usize,
    total_bytes: u64,
    dropped_bytes: u64,
}

impl Output {
    fn push(&mut self, stream: OutputStream, data: ChunkData, cap: usize) {
        let len = data.as_bytes().len();
        self.total_bytes += len as u64;
        self.kept_bytes += len;
        self.chunks.push_back(Chunk {
            index: self.next_index,
            stream,
            data,
        });
        self.next_index += 1;
        while self.kept_bytes > cap {
            let Some(old) = self.chunks.pop_front() else {
                break;
            };
            let n = old.data.as_bytes().len();
            self.kept_bytes -= n;
            self.dropped_bytes += n as u64;
        }
    }

    fn first_index(&self) -> u64 {
        self.chunks.front().map_or(self.next_index, |c| c.index)
    }
}

#[derive(Debug, Clone)]
struct Ending {
    kind: EndKind,
    exit_code: Option<i32>,
    signal: Option<i32>,
    reason: Option<String>,
}

#[derive(Debug)]
struct Job {
    spec: JobSpec,
    labels: LabelSet,
    state: JobState,
    agent: Option<AgentId>,
    ending: Option<Ending>,
    output: Output,
    /// Bumped on every change; readers wait on it.
    changed: watch::Sender<u64>,
    /// When it was submitted (kept in its record).
    created_at: UnixMillis,
    /// Its output file while it runs (durable books).
    spool: Option<SpoolFile>,
    /// See [`JobView::output_lost`].
    output_lost: bool,
}

impl Job {
    fn view(&self) -> JobView {
        let ending = self.ending.as_ref();
        JobView {
            job_id: self.spec.job_id().to_string(),
            state: self.state,
            labels: self.labels.iter().map(|l| l.to_string()).collect(),
            command: self.spec.argv().to_vec(),
            agent_id: self.agent.map(|a| a.to_string()),
            host: None,
            end: ending.map(|e| e.kind),
            exit_code: ending.and_then(|e| e.exit_code),
            signal: ending.and_then(|e| e.signal),
            reason: ending.and_then(|e| e.reason.clone()),
            output_bytes: self.output.total_bytes,
            dropped_bytes: self.output.dropped_bytes,
            output_lost: self.output_lost,
        }
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// The job's record as of now.
    fn record(&self) -> JobRecord {
        let ending = self.ending.as_ref();
        JobRecord {
            job_id: self.spec.job_id().clone(),
            labels: self.labels.iter().map(|l| l.as_str().to_owned()).collect(),
            command: self.spec.argv().to_vec(),
            state: wire_name(self.state),
            agent_id: self.agent,
            end: ending.map(|e| wire_name(e.kind)),
            exit_code: ending.and_then(|e| e.exit_code),
            signal: ending.and_then(|e| e.signal),
            reason: ending.and_then(|e| e.reason.clone()),
            output_bytes: self.output.total_bytes,
            dropped_bytes: self.output.dropped_bytes,
            created_at: self.created_at,
            updated_at: UnixMillis::now(),
        }
    }
}

/// A state's or an end's name on the wire (its serde name): the one
/// spelling, also in the store.
fn wire_name<T: Serialize>(value: T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => s,
        // Unit variants serialize as strings.
        _ => String::new(),
    }
}

/// The value a wire name names, if any.
fn from_wire_name<T: DeserializeOwned>(name: &str) -> Option<T> {
    serde_json::from_value(serde_json::Value::String(name.to_owned())).ok()
}

/// Where a durable book writes what must outlive the daemon.
#[derive(Debug)]
struct Durable {
    recorder: JobRecorder,
    /// `None`: no output directory (or it could not be created); output
    /// then lives in memory only and is lost with the daemon.
    spool: Option<Spool>,
}

/// What [`JobBook::restore`] did with the recorded jobs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobsRestored {
    /// Had ended: shown as they ended.
    pub finished: usize,
    /// Were running: ended aborted ([`RESTARTED_WHILE_RUNNING`], in a
    /// fleet [`HOST_LOST_WHILE_RUNNING`]).
    pub aborted_running: Vec<JobId>,
    /// Had not started: ended aborted.
    pub aborted_unstarted: Vec<JobId>,
    /// Whose output before the restart could not be read back.
    pub output_lost: Vec<JobId>,
    /// Records that did not decode, with why (deleted).
    pub unreadable: Vec<(JobId, String)>,
    /// Output files of no recorded job, removed.
    pub stray_files: usize,
}

#[derive(Debug, Default)]
struct Books {
    jobs: HashMap<JobId, Job>,
    /// Finished jobs, oldest first, for eviction.
    finished: VecDeque<JobId>,
}

/// Every standalone job this daemon knows. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct JobBook {
    books: Mutex<Books>,
    output_cap: usize,
    finished_kept: usize,
    durable: Option<Durable>,
    /// In a fleet: this host's instance id, named in every view.
    host: std::sync::OnceLock<String>,
    /// Why a job that ran when the daemon died ended: set in a fleet
    /// ([`HOST_LOST_WHILE_RUNNING`]), else [`RESTARTED_WHILE_RUNNING`].
    died_running: std::sync::OnceLock<&'static str>,
}

impl Default for JobBook {
    fn default() -> Self {
        Self::new()
    }
}

impl JobBook {
    pub fn new() -> Self {
        Self::with_limits(OUTPUT_CAP_BYTES, FINISHED_KEPT)
    }

    pub fn with_limits(output_cap: usize, finished_kept: usize) -> Self {
        Self {
            books: Mutex::new(Books::default()),
            output_cap: output_cap.max(1),
            finished_kept: finished_kept.max(1),
            durable: None,
            host: std::sync::OnceLock::new(),
            died_running: std::sync::OnceLock::new(),
        }
    }

    /// A book whose jobs outlive the daemon: records through `recorder`,
    /// output files in `output_dir` (created 0700 if needed; without it, or
    /// if it cannot be created, output is in memory only and a restart
    /// reports it lost).
    pub fn durable(recorder: JobRecorder, output_dir: Option<&Path>) -> Self {
        Self::new().recorded(recorder, output_dir)
    }

    /// This book, durable (see [`JobBook::durable`]).
    fn recorded(self, recorder: JobRecorder, output_dir: Option<&Path>) -> Self {
        let spool = output_dir.and_then(|dir| match Spool::open(dir) {
            Ok(spool) => Some(spool),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot create the job output directory; job output is kept in memory only and lost if kici-scaler crashes");
                None
            }
        });
        Self {
            durable: Some(Durable { recorder, spool }),
            ..self
        }
    }

    /// Whether jobs are recorded in a state store ([`JobBook::durable`]).
    pub fn is_durable(&self) -> bool {
        self.durable.is_some()
    }

    /// Sends `job`'s record to the store (durable books); the answer says
    /// whether it was committed.
    fn save(&self, job: &Job) -> Option<RecordAck> {
        self.durable.as_ref().map(|d| d.recorder.save(job.record()))
    }

    /// Deletes what a forgotten job left in the store and on disk.
    fn forget(&self, id: &JobId) {
        if let Some(d) = &self.durable {
            d.recorder.forget(id.clone());
            if let Some(spool) = &d.spool {
                spool.remove(id);
            }
        }
    }

    fn spool(&self) -> Option<&Spool> {
        self.durable.as_ref().and_then(|d| d.spool.as_ref())
    }

    /// A fleet's host: a job that ran when this daemon died was lost with
    /// its host, and [`JobBook::restore`] ends it with the fleet's reason
    /// ([`HOST_LOST_WHILE_RUNNING`]). Set before the restore.
    pub fn set_in_fleet(&self) {
        let _ = self.died_running.set(HOST_LOST_WHILE_RUNNING);
    }

    /// Names this host (its instance id) in every job's view: in a fleet,
    /// a job shown by any host says which host runs it.
    pub fn set_host(&self, instance: String) {
        let _ = self.host.set(instance);
    }

    fn viewed(&self, job: &Job) -> JobView {
        let mut view = job.view();
        view.host = self.host.get().cloned();
        view
    }

    /// A fresh job id: `job-` + 16 hex.
    pub fn mint_id() -> JobId {
        let mut bytes = [0u8; 8];
        rand::thread_rng().fill_bytes(&mut bytes);
        // `job-` + hex is always a valid job id (printable, no whitespace,
        // far below the length limit).
        format!("job-{}", hex::encode(bytes))
            .parse()
            .unwrap_or_else(|_| unreachable!("job-<hex> is a valid job id"))
    }

    /// Records a new job (`pending`); with a store, the answer says when
    /// its record is committed.
    fn insert(&self, spec: JobSpec, labels: LabelSet) -> Option<RecordAck> {
        let job = Job {
            spec,
            labels,
            state: JobState::Pending,
            agent: None,
            ending: None,
            output: Output::default(),
            changed: watch::channel(0).0,
            created_at: UnixMillis::now(),
            spool: None,
            output_lost: false,
        };
        let id = job.spec.job_id().clone();
        let mut b = self.books.lock();
        let ack = self.save(&job);
        b.jobs.insert(id, job);
        ack
    }

    /// Forgets a job (its record and output too).
    pub(crate) fn remove(&self, id: &JobId) {
        let mut b = self.books.lock();
        if let Some(job) = b.jobs.remove(id) {
            self.forget(id);
            job.bump();
        }
    }

    pub fn view(&self, id: &JobId) -> Option<JobView> {
        let b = self.books.lock();
        b.jobs.get(id).map(|job| self.viewed(job))
    }

    /// Every job this host records (finished ones it still keeps), in no
    /// particular order.
    pub fn list(&self) -> Vec<JobView> {
        let b = self.books.lock();
        b.jobs.values().map(|job| self.viewed(job)).collect()
    }

    /// The job's view once it has ended, waiting at most `within` for
    /// that; `None` if it is unknown or still running then.
    pub async fn wait_end(&self, id: &JobId, within: std::time::Duration) -> Option<JobView> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            // Subscribed under the lock that read the state: no change
            // between the check and the wait goes unseen.
            let mut changed = {
                let b = self.books.lock();
                let job = b.jobs.get(id)?;
                if job.state.is_terminal() {
                    return Some(self.viewed(job));
                }
                job.changed.subscribe()
            };
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                return None;
            }
        }
    }

    /// How many jobs are recorded (finished ones included).
    pub fn len(&self) -> usize {
        self.books.lock().jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The engine's answer to job `id`'s scale request: its agent, when
    /// one was chosen (bound, with whether it was warm); `None` when the
    /// job waits. A refusal removes the job.
    fn bind_outcome(
        &self,
        id: &JobId,
        outcome: Result<ScaleOutcome, ScaleError>,
    ) -> Result<Option<(AgentId, bool)>, SubmitError> {
        match outcome {
            Ok(ScaleOutcome::Spawning { agent_id, warm, .. }) => {
                let mut b = self.books.lock();
                self.bind(&mut b, id, agent_id);
                Ok(Some((agent_id, warm)))
            }
            Ok(ScaleOutcome::Pending { .. }) => Ok(None),
            // The outcomes left are the refusals.
            Ok(refused) => {
                self.remove(id);
                Err(SubmitError::refusal(refused)
                    .unwrap_or(SubmitError::Scale(ScaleError::ShuttingDown)))
            }
            Err(e) => {
                self.remove(id);
                Err(e.into())
            }
        }
    }

    /// The job's agent was chosen (admitted, or a warm agent took it).
    fn bind(&self, b: &mut Books, id: &JobId, agent: AgentId) {
        let Some(job) = b.jobs.get_mut(id) else {
            return;
        };
        if job.state.is_terminal() {
            return;
        }
        let old = job.agent.replace(agent);
        let pending = job.state == JobState::Pending;
        if pending {
            job.state = JobState::Spawning;
        }
        if pending || old != Some(agent) {
            let _ = self.save(job);
        }
        job.bump();
    }

    fn finish(&self, b: &mut Books, id: &JobId, state: JobState, ending: Ending) -> bool {
        let Some(job) = b.jobs.get_mut(id) else {
            return false;
        };
        if job.state.is_terminal() {
            return false;
        }
        job.state = state;
        job.ending = Some(ending);
        if let Some(mut file) = job.spool.take() {
            // What stays on disk is what stays readable.
            if file.larger_than(job.output.kept_bytes, job.output.chunks.len()) {
                if let Err(e) = rewrite_spool(&mut file, &job.output) {
                    // The file is still whole (the old one, or the new).
                    tracing::debug!(job_id = %id, error = %e, "shrinking the finished job's output file failed");
                }
            }
        }
        let _ = self.save(job);
        job.bump();
        tracing::info!(
            job_id = %id,
            state = state.as_str(),
            agent_id = job.agent.map(|a| a.to_string()),
            "job ended"
        );
        b.finished.push_back(id.clone());
        self.evict(b);
        true
    }

    /// Forgets the oldest finished jobs beyond the limit.
    fn evict(&self, b: &mut Books) {
        while b.finished.len() > self.finished_kept {
            if let Some(old) = b.finished.pop_front() {
                if let Some(job) = b.jobs.remove(&old) {
                    self.forget(&old);
                    job.bump();
                }
            }
        }
    }

    // ----- the gateway ----------------------------------------------------

    /// The job to dispatch to `agent`, if `id` is a standalone job that has
    /// not ended, with its labels (for the mandatory-label gate).
    pub fn dispatchable(&self, id: &JobId) -> Option<(JobSpec, LabelSet)> {
        let b = self.books.lock();
        let job = b.jobs.get(id)?;
        (!job.state.is_terminal()).then(|| (job.spec.clone(), job.labels.clone()))
    }

    /// Whether `agent` acknowledged the job and it has not ended (what a
    /// reconnecting agent may still be running).
    pub fn running_on(&self, id: &JobId, agent: AgentId) -> bool {
        let b = self.books.lock();
        b.jobs
            .get(id)
            .is_some_and(|job| job.state == JobState::Running && job.agent == Some(agent))
    }

    /// The agent acknowledged the job.
    pub fn started(&self, id: &JobId, agent: AgentId) {
        let mut b = self.books.lock();
        self.bind(&mut b, id, agent);
        if let Some(job) = b.jobs.get_mut(id) {
            if matches!(job.state, JobState::Pending | JobState::Spawning) {
                job.state = JobState::Running;
                // The file exists from the start: after a crash, it also
                // tells a job that ran from one whose record had not caught
                // up yet.
                job.spool = self.spool().and_then(|spool| {
                    spool
                        .create(id)
                        .map_err(|e| {
                            tracing::warn!(job_id = %id, error = %e, "cannot create the job's output file; its output is lost if kici-scaler crashes")
                        })
                        .ok()
                });
                let _ = self.save(job);
                job.bump();
                tracing::info!(job_id = %id, agent_id = %agent, "job running");
            }
        }
    }

    /// A piece of the job's output.
    pub fn output(&self, id: &JobId, stream: OutputStream, data: ChunkData) {
        let mut b = self.books.lock();
        if let Some(job) = b.jobs.get_mut(id) {
            if !job.state.is_terminal() {
                let index = job.output.next_index;
                if let Some(mut file) = job.spool.take() {
                    // Under the book's lock, so chunks land in the file in
                    // their order; a page-cache write, no fsync.
                    match file.append(index, stream, &data) {
                        Ok(()) => job.spool = Some(file),
                        Err(e) => self.spool_failed(id, e),
                    }
                }
                job.output.push(stream, data, self.output_cap);
                if let Some(mut file) = job.spool.take() {
                    let rewritten = if file.wants_compaction(self.output_cap) {
                        rewrite_spool(&mut file, &job.output)
                    } else {
                        Ok(())
                    };
                    match rewritten {
                        Ok(()) => job.spool = Some(file),
                        Err(e) => self.spool_failed(id, e),
                    }
                }
                job.bump();
            }
        }
    }

    /// The job's output file could not be written: it is deleted, so that
    /// a restart reports the output lost instead of showing part of it.
    fn spool_failed(&self, id: &JobId, e: std::io::Error) {
        tracing::warn!(job_id = %id, error = %e, "writing the job's output file failed; its output is lost if kici-scaler crashes");
        if let Some(spool) = self.spool() {
            spool.remove(id);
        }
    }

    /// The agent reported the job's end.
    pub fn ended(&self, id: &JobId, end: &JobEnd) {
        let result = end.result();
        let (state, kind, reason) = match end {
            JobEnd::Completed(r) if r.is_success() => (JobState::Succeeded, EndKind::Exited, None),
            JobEnd::Completed(_) => (JobState::Failed, EndKind::Exited, None),
            JobEnd::TimedOut(_) => (
                JobState::Failed,
                EndKind::TimedOut,
                Some("the command ran longer than its timeout and was killed".to_owned()),
            ),
            JobEnd::Cancelled(_) => (
                JobState::Cancelled,
                EndKind::Cancelled,
                Some("cancelled".to_owned()),
            ),
            JobEnd::SpawnFailed { error } => (
                JobState::Failed,
                EndKind::StartFailed,
                Some(format!("the command could not be started: {error}")),
            ),
        };
        let ending = Ending {
            kind,
            exit_code: result.and_then(|r| r.exit_code()),
            signal: result.and_then(|r| r.signal()),
            reason,
        };
        let mut b = self.books.lock();
        self.finish(&mut b, id, state, ending);
    }

    /// A job recorded before a restart that will not run (see
    /// [`kici_engine::Engine::recover_pending`]): shown `failed` with `reason`,
    /// forgotten like any finished job. A job [`JobBook::restore`] already
    /// took back is left as it is.
    pub fn restore_aborted(&self, id: JobId, labels: LabelSet, argv: Vec<String>, reason: String) {
        if self.books.lock().jobs.contains_key(&id) {
            return;
        }
        let Some(spec) = recorded_spec(&id, argv) else {
            return;
        };
        let _ = self.insert(spec, labels);
        self.abort(&id, reason);
    }

    /// Takes back the jobs recorded before a restart (before the API
    /// serves and before any engine effect about them is applied): a job
    /// that had ended is shown as it ended; one that had not is ended now —
    /// `failed`, `end: aborted`, with why — and its record rewritten. Its
    /// output so far is read back from its file; a job that had output but
    /// whose file cannot be read is marked [`JobView::output_lost`]. Output
    /// files of no recorded job are removed. Finished jobs beyond the limit
    /// are forgotten, oldest first.
    pub fn restore(&self, records: Vec<JobRecord>) -> JobsRestored {
        let mut done = JobsRestored::default();
        let mut b = self.books.lock();
        let mut records = records;
        // Eviction order: the oldest end first.
        records.sort_by_key(|r| (r.updated_at, r.created_at));
        let mut known = HashSet::new();
        for r in records {
            let id = r.job_id.clone();
            known.insert(id.as_str().to_owned());
            let Some(state) = from_wire_name::<JobState>(&r.state) else {
                done.unreadable
                    .push((id.clone(), format!("unknown state {:?}", r.state)));
                self.forget(&id);
                continue;
            };
            let labels = match LabelSet::parse(r.labels.iter()) {
                Ok(l) => l,
                Err(e) => {
                    done.unreadable.push((id.clone(), format!("labels: {e}")));
                    self.forget(&id);
                    continue;
                }
            };
            let Some(spec) = recorded_spec(&id, r.command.clone()) else {
                done.unreadable
                    .push((id.clone(), "unusable job id".to_owned()));
                self.forget(&id);
                continue;
            };
            let recovered = match self.spool().map(|s| s.recover(&id)) {
                Some(Ok(found)) => found,
                Some(Err(e)) => {
                    tracing::warn!(job_id = %id, error = %e, "the job's output file is unreadable");
                    None
                }
                None => None,
            };
            // The output file is created when the job starts: a record
            // still saying `spawning` is only behind.
            let ran =
                state == JobState::Running || (state == JobState::Spawning && recovered.is_some());
            let mut output = Output::default();
            let mut lost = false;
            match recovered {
                Some(found) => {
                    output.next_index = found.first_index;
                    output.total_bytes = found.dropped_bytes;
                    output.dropped_bytes = found.dropped_bytes;
                    for (stream, data) in found.chunks {
                        output.push(stream, data, self.output_cap);
                    }
                    if output.total_bytes < r.output_bytes {
                        // The file lost its tail (torn, or gone and an
                        // older copy found): say so rather than show less.
                        lost = true;
                    }
                }
                None => lost = ran || r.output_bytes > 0,
            }
            if lost {
                done.output_lost.push(id.clone());
                if output.total_bytes < r.output_bytes {
                    output.dropped_bytes += r.output_bytes - output.total_bytes;
                    output.total_bytes = r.output_bytes;
                }
            }
            let ending = if state.is_terminal() {
                done.finished += 1;
                Some(Ending {
                    kind: r
                        .end
                        .as_deref()
                        .and_then(from_wire_name)
                        .unwrap_or(EndKind::Aborted),
                    exit_code: r.exit_code,
                    signal: r.signal,
                    reason: r.reason.clone(),
                })
            } else {
                let reason = if ran {
                    done.aborted_running.push(id.clone());
                    self.died_running
                        .get()
                        .copied()
                        .unwrap_or(RESTARTED_WHILE_RUNNING)
                } else {
                    done.aborted_unstarted.push(id.clone());
                    match state {
                        JobState::Spawning => RESTARTED_BEFORE_START,
                        _ => crate::durable::persist::STANDALONE_LOST,
                    }
                };
                Some(Ending {
                    kind: EndKind::Aborted,
                    exit_code: None,
                    signal: None,
                    reason: Some(reason.to_owned()),
                })
            };
            let job = Job {
                spec,
                labels,
                state: if state.is_terminal() {
                    state
                } else {
                    JobState::Failed
                },
                agent: r.agent_id,
                ending,
                output,
                changed: watch::channel(0).0,
                created_at: r.created_at,
                spool: None,
                output_lost: lost,
            };
            if !state.is_terminal() {
                let _ = self.save(&job);
            }
            if !state.is_terminal() {
                tracing::info!(job_id = %id, was = state.as_str(), reason = job.ending.as_ref().and_then(|e| e.reason.as_deref()), output_lost = lost, "job ended by the restart");
            }
            b.jobs.insert(id.clone(), job);
            b.finished.push_back(id);
        }
        if let Some(spool) = self.spool() {
            done.stray_files = spool.remove_others(|job| known.contains(job));
        }
        self.evict(&mut b);
        done
    }

    /// kici-scaler gives up on the job (`reason` says why).
    pub fn abort(&self, id: &JobId, reason: String) -> bool {
        let mut b = self.books.lock();
        self.finish(
            &mut b,
            id,
            JobState::Failed,
            Ending {
                kind: EndKind::Aborted,
                exit_code: None,
                signal: None,
                reason: Some(reason),
            },
        )
    }

    /// Marks the job cancelled (if it has not ended). Returns its state
    /// before and its agent, for the caller to withdraw the request or
    /// destroy the agent; `None` if the job is unknown.
    pub fn cancel(&self, id: &JobId, reason: &str) -> Option<(JobState, Option<AgentId>)> {
        let mut b = self.books.lock();
        let job = b.jobs.get(id)?;
        let before = (job.state, job.agent);
        self.finish(
            &mut b,
            id,
            JobState::Cancelled,
            Ending {
                kind: EndKind::Cancelled,
                exit_code: None,
                signal: None,
                reason: Some(reason.to_owned()),
            },
        );
        Some(before)
    }

    // ----- readers --------------------------------------------------------

    /// The output after chunk `next - 1` (a new reader passes 0), or a
    /// receiver to wait on, or the end. `None`: the job is unknown (or was
    /// forgotten).
    pub fn read(&self, id: &JobId, next: u64) -> Option<Read> {
        let b = self.books.lock();
        let job = b.jobs.get(id)?;
        let first = job.output.first_index();
        let missed = (next < first).then(|| (next, first - 1));
        let from = next.max(first);
        // Chunk indexes are contiguous: the offset into the deque is exact.
        let skip = usize::try_from(from - first).unwrap_or(usize::MAX);
        let chunks: Vec<Chunk> = job
            .output
            .chunks
            .iter()
            .skip(skip)
            .take(READ_BATCH)
            .cloned()
            .collect();
        if !chunks.is_empty() || missed.is_some() {
            return Some(Read::Chunks { missed, chunks });
        }
        if job.state.is_terminal() {
            return Some(Read::End(Box::new(self.viewed(job))));
        }
        Some(Read::Wait(job.changed.subscribe()))
    }

    // ----- the engine's effects ---------------------------------------------

    /// Applies one of the engine's effects on standalone jobs (in the
    /// engine's order; see [`kici_engine::JobEffect`]); returns what the
    /// gateway must do.
    pub fn apply(&self, effect: JobEffect) -> Option<Action> {
        let mut b = self.books.lock();
        match effect {
            JobEffect::Bound { job, agent } => {
                self.bind(&mut b, &job, agent);
                None
            }
            JobEffect::Dispatch { job, agent } => {
                self.bind(&mut b, &job, agent);
                let spec = b
                    .jobs
                    .get(&job)
                    .filter(|j| !j.state.is_terminal())?
                    .spec
                    .clone();
                Some(Action::Dispatch { agent, spec })
            }
            JobEffect::Ended { job, lost } => {
                let (state, kind, reason) = match lost {
                    JobLost::Pending(end) => {
                        let reason = match end {
                            PendingEnd::Admitted => return None,
                            PendingEnd::Cancelled => "the scale request was cancelled",
                            PendingEnd::Expired => {
                                "no capacity freed up for the job within the pending TTL"
                            }
                            PendingEnd::NoBackend => {
                                "after a reload, no scaler accepts the job's labels any more"
                            }
                            PendingEnd::TooLarge => {
                                "after a reload, the job no longer fits under the caps"
                            }
                        };
                        if end == PendingEnd::Cancelled {
                            (JobState::Cancelled, EndKind::Cancelled, reason.to_owned())
                        } else {
                            (JobState::Failed, EndKind::Aborted, reason.to_owned())
                        }
                    }
                    JobLost::Cancelled { .. } => (
                        JobState::Cancelled,
                        EndKind::Cancelled,
                        "the scale request was cancelled".to_owned(),
                    ),
                    JobLost::AgentFailed { agent, .. } | JobLost::AgentStopped { agent, .. } => {
                        // Only the job's own agent ends it (a job already
                        // bound to another agent is not this agent's).
                        let bound_here = b
                            .jobs
                            .get(&job)
                            .is_some_and(|j| j.agent.is_none_or(|a| a == agent));
                        if !bound_here {
                            return None;
                        }
                        (JobState::Failed, EndKind::Aborted, lost_agent_reason(&lost))
                    }
                };
                self.finish(
                    &mut b,
                    &job,
                    state,
                    Ending {
                        kind,
                        exit_code: None,
                        signal: None,
                        reason: Some(reason),
                    },
                );
                None
            }
        }
    }
}

/// Rewrites a job's output file from what memory keeps (the newest
/// [`OUTPUT_CAP_BYTES`]).
fn rewrite_spool(file: &mut SpoolFile, output: &Output) -> std::io::Result<()> {
    let chunks = output.chunks.iter().map(|c| (c.stream, &c.data));
    file.rewrite(output.first_index(), output.dropped_bytes, chunks)
}

/// A recorded job's spec: its command as recorded (a placeholder if that
/// no longer passes the checks), no environment, no timeout.
fn recorded_spec(id: &JobId, argv: Vec<String>) -> Option<JobSpec> {
    let argv = if argv.is_empty() {
        vec!["?".to_owned()]
    } else {
        argv
    };
    JobSpec::new(id.clone(), argv, Default::default(), None)
        .or_else(|_| JobSpec::new(id.clone(), vec!["?".to_owned()], Default::default(), None))
        .ok()
}

/// Why a job whose agent left before the job ended failed.
fn lost_agent_reason(lost: &JobLost) -> String {
    match lost {
        JobLost::AgentFailed {
            agent,
            reason,
            detail,
        } => {
            let detail = detail
                .as_deref()
                .map(|d| format!(": {d}"))
                .unwrap_or_default();
            format!("agent {agent} failed ({}){detail}", reason.as_str())
        }
        JobLost::AgentStopped { agent, cause } => match cause {
            StopCause::Shutdown => format!("kici-scaler shut down; agent {agent} was destroyed"),
            StopCause::Disconnected => {
                format!("agent {agent} disconnected before the job ended")
            }
            other => format!(
                "agent {agent} was destroyed before the job ended ({})",
                other.as_str()
            ),
        },
        JobLost::Cancelled { agent } => {
            format!("agent {agent} was destroyed before the job ended (cancelled)")
        }
        JobLost::Pending(end) => format!("the scale request ended: {}", end.as_str()),
    }
}

// ----- submitting --------------------------------------------------------

/// A job as submitted.
#[derive(Debug, Clone)]
pub struct JobRequest {
    pub labels: LabelSet,
    pub resources: Option<ResourceRequest>,
    /// Carries the job id (see [`JobBook::mint_id`]).
    pub spec: JobSpec,
}

impl JobRequest {
    /// The scale request for this job's agent (standalone mode).
    pub fn scale_request(&self) -> ScaleRequest {
        ScaleRequest {
            job: self.spec.job_id().clone(),
            run_id: None,
            labels: self.labels.clone(),
            exclude: LabelSet::default(),
            resources: self.resources,
            mode: Mode::Standalone,
        }
    }
}

/// Why a job was not accepted.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SubmitError {
    #[error("no-backend: {0}")]
    NoBackend(String),
    #[error("too-large ({cap}): {detail}")]
    TooLarge { cap: String, detail: String },
    #[error("{0}")]
    Scale(#[from] ScaleError),
    /// The state store could not record the job (or, when it had to
    /// wait, its pending request): it was withdrawn.
    #[error("state store: {0}")]
    Store(String),
}

impl SubmitError {
    /// A final refusal of a job's scale request as the job's error (`None`
    /// for an outcome that is not one).
    pub fn refusal(outcome: ScaleOutcome) -> Option<Self> {
        match outcome {
            ScaleOutcome::NoBackend { explanation } => Some(Self::NoBackend(explanation)),
            ScaleOutcome::TooLarge { cap, detail } => Some(Self::TooLarge {
                cap: cap.to_string(),
                detail,
            }),
            ScaleOutcome::Spawning { .. } | ScaleOutcome::Pending { .. } => None,
        }
    }
}

/// Records the job and asks the engine for an agent. On `Err` nothing is
/// kept. A durable book's record of the job is committed before the
/// engine is asked (a job the store cannot record is not run: a crash
/// would forget it); a job that has to wait is acknowledged only once its
/// pending request's record (the engine's journal) is committed.
pub async fn submit_recorded(
    runtime: &Runtime,
    jobs: &JobBook,
    request: JobRequest,
) -> Result<JobView, SubmitError> {
    let id = request.spec.job_id().clone();
    if let Some(ack) = jobs.insert(request.spec.clone(), request.labels.clone()) {
        if let Err(e) = JobRecorder::committed(ack).await {
            // A record that lands late is deleted by this (ordered after
            // it).
            jobs.remove(&id);
            tracing::warn!(job_id = %id, error = %e, "job not recorded; refused");
            return Err(SubmitError::Store(e.to_string()));
        }
    }
    let (view, ack) = submit_with(runtime, jobs, request)?;
    if let Err(e) = crate::durable::persist::pending_committed(runtime, &id, ack).await {
        jobs.remove(&id);
        return Err(SubmitError::Store(store_error_text(&e)));
    }
    Ok(view)
}

/// The error and its sources, for the API's message.
fn store_error_text(e: &PendingNotRecorded) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Records the job and asks the engine for an agent, without waiting for
/// a state store. On `Err` nothing is kept.
pub fn submit(
    runtime: &Runtime,
    jobs: &JobBook,
    request: JobRequest,
) -> Result<JobView, SubmitError> {
    // No store to wait for here (`run`): a durable book still writes the
    // record, unawaited.
    let _ = jobs.insert(request.spec.clone(), request.labels.clone());
    submit_with(runtime, jobs, request).map(|(view, _)| view)
}

/// Asks the engine for an agent for a job [`JobBook::insert`] recorded;
/// on `Err` the job is removed. With the acknowledgement of its pending
/// request's record when it has to wait (and the runtime keeps a journal).
fn submit_with(
    runtime: &Runtime,
    jobs: &JobBook,
    request: JobRequest,
) -> Result<(JobView, Option<kici_engine::runtime::RecordAck>), SubmitError> {
    let id = request.spec.job_id().clone();
    // The job is in the book already: the engine's effects about it may be
    // applied before `request_scale` returns.
    let (outcome, ack) = runtime.request_scale_recorded(request.scale_request());
    jobs.bind_outcome(&id, outcome)?;
    let view = jobs
        .view(&id)
        .ok_or(SubmitError::Scale(ScaleError::ShuttingDown))?;
    tracing::info!(job_id = %id, state = view.state.as_str(), agent_id = view.agent_id.as_deref(), "job submitted");
    Ok((view, ack))
}

/// A job that another queue keeps (a fleet claim), served now or not at
/// all: recorded (committed, with a store), then admitted by the engine
/// only if an agent can be provisioned now or a warm one takes it —
/// `Ok(Some((agent, warm)))`. `Ok(None)`: no capacity now; nothing is
/// kept (the caller gives the job back to its queue). `Err`: refused for
/// good (no backend, can never fit); nothing is kept.
pub async fn submit_now(
    runtime: &Runtime,
    jobs: &JobBook,
    request: JobRequest,
) -> Result<Option<(AgentId, bool)>, SubmitError> {
    let id = request.spec.job_id().clone();
    if let Some(ack) = jobs.insert(request.spec.clone(), request.labels.clone()) {
        if let Err(e) = JobRecorder::committed(ack).await {
            jobs.remove(&id);
            return Err(SubmitError::Store(e.to_string()));
        }
    }
    let outcome = runtime.request_scale_now(request.scale_request());
    if let Err(ScaleError::QueueFull(_)) = outcome {
        jobs.remove(&id);
        return Ok(None);
    }
    match jobs.bind_outcome(&id, outcome)? {
        Some((agent_id, warm)) => {
            tracing::info!(job_id = %id, agent_id = %agent_id, "job taken from the fleet's queue");
            Ok(Some((agent_id, warm)))
        }
        // Not now: nothing is kept.
        None => {
            jobs.remove(&id);
            Ok(None)
        }
    }
}

/// Cancels a job: marks it cancelled, withdraws its scale request or
/// destroys its agent. `None`: unknown job.
pub fn cancel(runtime: &Runtime, jobs: &JobBook, id: &JobId, reason: &str) -> Option<JobView> {
    let (before, agent) = jobs.cancel(id, reason)?;
    if !before.is_terminal() {
        // A pending request is withdrawn; an unregistered agent is stopped.
        let withdrawn = runtime.cancel_scale(id);
        if !withdrawn {
            if let Some(agent) = agent {
                if let Err(e) = runtime.destroy_agent(agent) {
                    tracing::debug!(agent_id = %agent, error = %e, "cancel: agent already gone");
                }
            }
        }
        tracing::info!(job_id = %id, was = before.as_str(), "job cancelled");
    }
    jobs.view(id)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kici_model::ScalerType;
    use kici_protocol::JobResult;
    use std::collections::BTreeMap;

    fn spec(id: &str) -> JobSpec {
        JobSpec::new(
            id.parse().unwrap(),
            vec!["sh".into(), "-c".into(), "true".into()],
            BTreeMap::new(),
            None,
        )
        .unwrap()
    }

    fn book_with(id: &str, cap: usize) -> (JobBook, JobId) {
        let book = JobBook::with_limits(cap, 2);
        book.insert(spec(id), LabelSet::parse(["linux"]).unwrap());
        (book, id.parse().unwrap())
    }

    fn agent(n: u8) -> AgentId {
        AgentId::new(ScalerType::BareMetal, [0, 0, 0, n])
    }

    fn data(s: &str) -> ChunkData {
        ChunkData::new(s.as_bytes().to_vec()).unwrap()
    }

    #[test]
    fn output_is_read_in_order_then_the_end() {
        let (book, id) = book_with("j1", 1024);
        book.started(&id, agent(1));
        book.output(&id, OutputStream::Stdout, data("a"));
        book.output(&id, OutputStream::Stderr, data("b"));
        let Some(Read::Chunks { missed, chunks }) = book.read(&id, 0) else {
            panic!("chunks expected");
        };
        assert_eq!(missed, None);
        assert_eq!(
            chunks
                .iter()
                .map(|c| (c.index, c.stream, c.data.as_bytes().to_vec()))
                .collect::<Vec<_>>(),
            [
                (0, OutputStream::Stdout, b"a".to_vec()),
                (1, OutputStream::Stderr, b"b".to_vec())
            ]
        );
        let Some(Read::Wait(rx)) = book.read(&id, 2) else {
            panic!("wait expected");
        };
        book.ended(&id, &JobEnd::Completed(JobResult::exited(3)));
        assert!(rx.has_changed().unwrap());
        let Some(Read::End(view)) = book.read(&id, 2) else {
            panic!("end expected");
        };
        assert_eq!(view.state, JobState::Failed);
        assert_eq!(view.exit_code, Some(3));
        assert_eq!(view.run_exit_code(), Some(3));
        assert_eq!(view.output_bytes, 2);
    }

    #[test]
    fn the_buffer_drops_the_oldest_chunks_and_tells_the_reader() {
        let (book, id) = book_with("j1", 4);
        for s in ["ab", "cd", "ef"] {
            book.output(&id, OutputStream::Stdout, data(s));
        }
        let Some(Read::Chunks { missed, chunks }) = book.read(&id, 0) else {
            panic!("chunks expected");
        };
        assert_eq!(missed, Some((0, 0)));
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0].index, 1);
        let view = book.view(&id).unwrap();
        assert_eq!((view.output_bytes, view.dropped_bytes), (6, 2));
    }

    #[test]
    fn an_agent_lost_before_the_end_fails_the_job() {
        let (book, id) = book_with("j1", 1024);
        let a = agent(1);
        assert!(book
            .apply(JobEffect::Bound {
                job: id.clone(),
                agent: a
            })
            .is_none());
        assert_eq!(book.view(&id).unwrap().state, JobState::Spawning);
        assert_eq!(book.view(&id).unwrap().agent_id, Some(a.to_string()));
        let failed = JobEffect::Ended {
            job: id.clone(),
            lost: JobLost::AgentFailed {
                agent: a,
                reason: kici_engine::FailureReason::RegistrationTimeout,
                detail: None,
            },
        };
        assert_eq!(book.apply(failed), None);
        let view = book.view(&id).unwrap();
        assert_eq!(view.state, JobState::Failed);
        assert_eq!(view.end, Some(EndKind::Aborted));
        assert!(view.reason.unwrap().contains("registration-timeout"));
        assert_eq!(book.view(&id).unwrap().run_exit_code(), Some(125));
        // A later end changes nothing.
        let cancelled = JobEffect::Ended {
            job: id.clone(),
            lost: JobLost::Pending(PendingEnd::Cancelled),
        };
        assert!(book.apply(cancelled).is_none());
        assert_eq!(book.view(&id).unwrap().state, JobState::Failed);
    }

    #[test]
    fn a_completed_job_ignores_its_agents_destroy() {
        let (book, id) = book_with("j1", 1024);
        let a = agent(1);
        book.started(&id, a);
        book.ended(&id, &JobEnd::Completed(JobResult::signalled(9).unwrap()));
        assert!(book
            .apply(JobEffect::Ended {
                job: id.clone(),
                lost: JobLost::AgentStopped {
                    agent: a,
                    cause: StopCause::Disconnected
                },
            })
            .is_none());
        let view = book.view(&id).unwrap();
        assert_eq!(view.state, JobState::Failed);
        assert_eq!(view.signal, Some(9));
        assert_eq!(view.run_exit_code(), Some(137));
    }

    #[test]
    fn an_end_from_another_agent_than_the_jobs_is_ignored() {
        let (book, id) = book_with("j1", 1024);
        book.started(&id, agent(2));
        assert!(book
            .apply(JobEffect::Ended {
                job: id.clone(),
                lost: JobLost::AgentStopped {
                    agent: agent(1),
                    cause: StopCause::Operator
                },
            })
            .is_none());
        assert_eq!(book.view(&id).unwrap().state, JobState::Running);
    }

    #[test]
    fn a_warm_agent_taking_the_job_asks_for_a_dispatch() {
        let (book, id) = book_with("j1", 1024);
        let a = agent(7);
        let action = book.apply(JobEffect::Dispatch {
            job: id.clone(),
            agent: a,
        });
        assert_eq!(
            action,
            Some(Action::Dispatch {
                agent: a,
                spec: spec("j1")
            })
        );
    }

    #[test]
    fn finished_jobs_are_forgotten_beyond_the_limit() {
        let book = JobBook::with_limits(1024, 2);
        for n in 0..3 {
            let id = format!("j{n}");
            book.insert(spec(&id), LabelSet::default());
            book.abort(&id.parse().unwrap(), "test".into());
        }
        assert_eq!(book.len(), 2);
        assert!(book.view(&"j0".parse().unwrap()).is_none());
    }

    // ----- durability ----------------------------------------------------

    use crate::durable::persist::Persister;
    use crate::events::EventLog;
    use kici_store::StateStore;
    use std::sync::Arc;
    use std::time::Duration;

    struct Stored {
        dir: tempfile::TempDir,
        store: Arc<dyn StateStore>,
    }

    impl Stored {
        async fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let url = kici_store::StoreUrl::default_in(dir.path());
            let store = kici_store::open(
                &url,
                kici_model::InstanceId::random(),
                kici_store::StoreOptions::default(),
            )
            .await
            .unwrap();
            Self { dir, store }
        }

        /// A durable book (output files in the dir unless `no_files`) and
        /// its writer.
        fn book(&self, cap: usize, no_files: bool) -> (JobBook, Persister) {
            let p = Persister::start(Arc::clone(&self.store), Arc::new(EventLog::new(4)), 4);
            let dir = self.dir.path().join(OUTPUT_DIR);
            let book = JobBook::with_limits(cap, 8)
                .recorded(p.job_recorder(), (!no_files).then_some(dir.as_path()));
            (book, p)
        }

        fn files(&self) -> Vec<String> {
            let mut names: Vec<String> = std::fs::read_dir(self.dir.path().join(OUTPUT_DIR))
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            names
        }
    }

    /// Every chunk of the job's output now readable, as text.
    fn all_output(book: &JobBook, id: &JobId) -> String {
        let mut text = String::new();
        let mut next = 0;
        while let Some(Read::Chunks { chunks, .. }) = book.read(id, next) {
            for c in chunks {
                text.push_str(std::str::from_utf8(c.data.as_bytes()).unwrap());
                next = c.index + 1;
            }
        }
        text
    }

    fn id(s: &str) -> JobId {
        s.parse().unwrap()
    }

    #[tokio::test]
    async fn a_restart_ends_what_had_not_ended_and_keeps_the_output() {
        let s = Stored::new().await;
        let (book, writer) = s.book(1024, false);
        let labels = LabelSet::parse(["linux"]).unwrap();
        // Running, with output.
        let ran = id("job-a");
        let ack = book.insert(spec("job-a"), labels.clone()).unwrap();
        crate::durable::persist::JobRecorder::committed(ack)
            .await
            .unwrap();
        book.started(&ran, agent(1));
        book.output(
            &ran,
            OutputStream::Stdout,
            data(
                "one
",
            ),
        );
        book.output(
            &ran,
            OutputStream::Stderr,
            data(
                "two
",
            ),
        );
        // Its agent provisioned, not started.
        let spawning = id("job-b");
        let _ = book.insert(spec("job-b"), labels.clone());
        book.bind(&mut book.books.lock(), &spawning, agent(2));
        // Waiting for capacity.
        let pending = id("job-c");
        let _ = book.insert(spec("job-c"), labels.clone());
        // Ended on its own.
        let done = id("job-d");
        let _ = book.insert(spec("job-d"), labels.clone());
        book.started(&done, agent(4));
        book.output(
            &done,
            OutputStream::Stdout,
            data(
                "bye
",
            ),
        );
        book.ended(&done, &JobEnd::Completed(JobResult::exited(3)));
        // Started, but its record never caught up: its output file says
        // it ran.
        let behind = id("job-e");
        let _ = book.insert(spec("job-e"), labels.clone());
        book.bind(&mut book.books.lock(), &behind, agent(5));
        {
            let spool = book.spool().unwrap();
            let mut f = spool.create(&behind).unwrap();
            f.append(
                0,
                OutputStream::Stdout,
                &data(
                    "e
",
                ),
            )
            .unwrap();
        }
        // A file of a job nobody recorded.
        let _ = book.spool().unwrap().create(&id("job-zz")).unwrap();
        assert!(writer.finish(Duration::from_secs(5)).await);
        drop(book); // the crash

        let records = s.store.jobs().await.unwrap();
        assert_eq!(records.len(), 5);
        assert!(records
            .iter()
            .all(|r| !r.command.is_empty() && r.labels == ["linux"]));
        let (book, writer) = s.book(1024, false);
        let restored = book.restore(records);
        assert_eq!(restored.finished, 1);
        assert_eq!(restored.aborted_running, [ran.clone(), behind.clone()]);
        assert_eq!(
            restored.aborted_unstarted,
            [spawning.clone(), pending.clone()]
        );
        assert!(restored.output_lost.is_empty(), "{restored:?}");
        assert_eq!(restored.stray_files, 1);

        let view = book.view(&ran).unwrap();
        assert_eq!(view.state, JobState::Failed);
        assert_eq!(view.end, Some(EndKind::Aborted));
        assert_eq!(view.reason.as_deref(), Some(RESTARTED_WHILE_RUNNING));
        assert_eq!(view.agent_id, Some(agent(1).to_string()));
        assert_eq!((view.output_bytes, view.output_lost), (8, false));
        assert_eq!(view.run_exit_code(), Some(125));
        assert_eq!(
            all_output(&book, &ran),
            "one
two
"
        );
        assert!(matches!(book.read(&ran, 2), Some(Read::End(_))));
        let view = book.view(&behind).unwrap();
        assert_eq!(view.reason.as_deref(), Some(RESTARTED_WHILE_RUNNING));
        assert_eq!(
            all_output(&book, &behind),
            "e
"
        );
        let view = book.view(&spawning).unwrap();
        assert_eq!(view.reason.as_deref(), Some(RESTARTED_BEFORE_START));
        assert_eq!(view.end, Some(EndKind::Aborted));
        let view = book.view(&pending).unwrap();
        assert_eq!(
            view.reason.as_deref(),
            Some(crate::durable::persist::STANDALONE_LOST)
        );
        let view = book.view(&done).unwrap();
        assert_eq!(
            (view.state, view.end, view.exit_code),
            (JobState::Failed, Some(EndKind::Exited), Some(3))
        );
        assert_eq!(
            all_output(&book, &done),
            "bye
"
        );
        // Nothing new happens to a restored job.
        book.started(&ran, agent(1));
        book.output(
            &ran,
            OutputStream::Stdout,
            data(
                "late
",
            ),
        );
        assert_eq!(
            all_output(&book, &ran),
            "one
two
"
        );
        assert_eq!(
            s.files(),
            ["job-a.out", "job-d.out", "job-e.out"],
            "the stray file went"
        );

        // The ends are recorded: a second restart shows the same.
        assert!(writer.finish(Duration::from_secs(5)).await);
        let records = s.store.jobs().await.unwrap();
        let a = records.iter().find(|r| r.job_id == ran).unwrap();
        assert_eq!(
            (a.state.as_str(), a.end.as_deref()),
            ("failed", Some("aborted"))
        );
        assert_eq!(a.output_bytes, 8);
        let (again, _writer) = s.book(1024, false);
        let restored = again.restore(records);
        assert_eq!(restored.finished, 5);
        assert_eq!(again.view(&ran), book.view(&ran));
        assert_eq!(
            all_output(&again, &ran),
            "one
two
"
        );
    }

    #[tokio::test]
    async fn output_kept_in_memory_only_is_reported_lost() {
        let s = Stored::new().await;
        let (book, writer) = s.book(1024, true);
        let ran = id("job-a");
        let _ = book.insert(spec("job-a"), LabelSet::default());
        book.started(&ran, agent(1));
        book.output(
            &ran,
            OutputStream::Stdout,
            data(
                "gone
",
            ),
        );
        let quiet = id("job-b");
        let _ = book.insert(spec("job-b"), LabelSet::default());
        assert!(writer.finish(Duration::from_secs(5)).await);
        drop(book);
        let (book, _writer) = s.book(1024, true);
        let restored = book.restore(s.store.jobs().await.unwrap());
        assert_eq!(restored.output_lost, std::slice::from_ref(&ran));
        let view = book.view(&ran).unwrap();
        assert!(view.output_lost);
        assert_eq!(view.reason.as_deref(), Some(RESTARTED_WHILE_RUNNING));
        assert!(!book.view(&quiet).unwrap().output_lost);
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["outputLost"], true);
        let json = serde_json::to_value(book.view(&quiet).unwrap()).unwrap();
        assert!(json.get("outputLost").is_none());
    }

    #[tokio::test]
    async fn the_output_file_stays_bounded_and_forgotten_jobs_leave_nothing() {
        let s = Stored::new().await;
        let cap = 1024;
        let (book, writer) = s.book(cap, false);
        let big = id("job-big");
        let _ = book.insert(spec("job-big"), LabelSet::default());
        book.started(&big, agent(1));
        let line = "x".repeat(999)
            + "
";
        for _ in 0..300 {
            book.output(&big, OutputStream::Stdout, data(&line));
        }
        let file = s.dir.path().join(OUTPUT_DIR).join("job-big.out");
        let len = std::fs::metadata(&file).unwrap().len();
        assert!(len < 3 * cap as u64 + 70_000, "{len} bytes");
        book.ended(&big, &JobEnd::Completed(JobResult::exited(0)));
        let len = std::fs::metadata(&file).unwrap().len();
        assert!(len < cap as u64 + 70_000, "{len} bytes after the end");
        assert!(writer.finish(Duration::from_secs(5)).await);
        let (again, writer) = s.book(cap, false);
        again.restore(s.store.jobs().await.unwrap());
        let view = again.view(&big).unwrap();
        assert_eq!(view, book.view(&big).unwrap());
        assert_eq!((view.output_bytes, view.dropped_bytes), (300_000, 299_000));
        assert_eq!(all_output(&again, &big), line);
        let Some(Read::Chunks { missed, .. }) = again.read(&big, 0) else {
            panic!("chunks expected");
        };
        assert_eq!(missed, Some((0, 298)));

        // Finished jobs beyond the limit (8) take their record and file.
        for n in 0..8 {
            let j = id(&format!("job-{n}"));
            let _ = again.insert(spec(j.as_str()), LabelSet::default());
            again.started(&j, agent(2));
            again.abort(&j, "test".into());
        }
        assert!(again.view(&big).is_none());
        assert!(!file.exists());
        assert!(writer.finish(Duration::from_secs(5)).await);
        let left = s.store.jobs().await.unwrap();
        assert_eq!(left.len(), 8);
        assert!(left.iter().all(|r| r.job_id != big));
    }

    #[test]
    fn exit_codes_for_run() {
        let view = |end, exit_code, signal, reason: Option<&str>| JobView {
            job_id: "j".into(),
            state: JobState::Failed,
            labels: vec![],
            command: vec![],
            agent_id: None,
            host: None,
            end: Some(end),
            exit_code,
            signal,
            reason: reason.map(str::to_owned),
            output_bytes: 0,
            dropped_bytes: 0,
            output_lost: false,
        };
        assert_eq!(
            view(EndKind::Exited, Some(0), None, None).run_exit_code(),
            Some(0)
        );
        assert_eq!(
            view(EndKind::TimedOut, None, Some(15), None).run_exit_code(),
            Some(143)
        );
        assert_eq!(
            view(
                EndKind::StartFailed,
                None,
                None,
                Some("x: No such file or directory (os error 2)")
            )
            .run_exit_code(),
            Some(127)
        );
        assert_eq!(
            view(
                EndKind::StartFailed,
                None,
                None,
                Some("x: Permission denied (os error 13)")
            )
            .run_exit_code(),
            Some(126)
        );
        assert_eq!(
            view(EndKind::Aborted, None, None, None).run_exit_code(),
            Some(125)
        );
    }
}
