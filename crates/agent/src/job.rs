//! Running one job: its process group, its output, its end.
//!
//! The job's program is started in a new process group (its pid is the
//! group id) with stdin closed, stdout and stderr piped, and an environment
//! built from scratch: the agent's host basics ([`base_env`]) under the
//! job's own `env`. Output is read as it comes, in chunks of at most
//! `MAX_OUTPUT_CHUNK_BYTES`, and handed to the session in read order.
//!
//! When the program exits, whatever it left behind in its group is killed
//! (a CI job does not outlive its step), then the pipes are drained. On a
//! timeout or a cancel the group gets SIGTERM, then SIGKILL after
//! [`KILL_GRACE`]. On a lost connection the session calls
//! [`RunningJob::kill_now`]: SIGKILL at once.

use kici_model::contract::BARE_METAL_SYSTEM_ALLOWLIST;
use kici_model::{BackpressureMode, JobId};
use kici_protocol::{ChunkData, JobEnd, JobResult, JobSpec, OutputStream, MAX_OUTPUT_CHUNK_BYTES};
use rustix::process::{Pid, Signal};
use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::Instrument;

/// Between SIGTERM and SIGKILL on a timeout or cancel.
pub const KILL_GRACE: Duration = Duration::from_secs(5);

/// How long output may still trickle in after the group was killed (a
/// process that left the group may hold the pipes open).
pub const DRAIN_LIMIT: Duration = Duration::from_secs(5);

/// Chunks buffered between the job and the connection. In `pause` mode a
/// full buffer stops reading the pipes (the job then blocks on its writes);
/// in `drop` mode chunks that do not fit are discarded and counted.
const EVENT_BUFFER: usize = 64;

/// `PATH` when the agent itself has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The host basics every job starts with: the contract's bare-metal system
/// allowlist taken from the agent's environment, and a `PATH`.
pub fn base_env(agent_env: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = BARE_METAL_SYSTEM_ALLOWLIST
        .iter()
        .filter_map(|name| {
            agent_env
                .get(*name)
                .map(|v| ((*name).to_owned(), v.clone()))
        })
        .collect();
    env.entry("PATH".to_owned())
        .or_insert_with(|| DEFAULT_PATH.to_owned());
    env
}

/// What a running job tells the session.
#[derive(Debug)]
pub enum JobEvent {
    Output(OutputStream, ChunkData),
    /// Always the last event.
    Ended(JobEnd),
}

enum Stop {
    Cancel,
}

/// A started job.
pub struct RunningJob {
    pub job_id: JobId,
    pgid: Pid,
    /// Its `Ended` event was received: the supervisor already cleaned up.
    ended: bool,
    stop: Option<oneshot::Sender<Stop>>,
    pub events: mpsc::Receiver<JobEvent>,
    task: JoinHandle<()>,
}

impl RunningJob {
    /// Starts `spec`. An `Err` is the spawn failure's description (the
    /// program was not found, is not executable, …).
    pub fn start(
        spec: &JobSpec,
        base_env: &BTreeMap<String, String>,
        backpressure: BackpressureMode,
    ) -> Result<Self, String> {
        let argv = spec.argv();
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .env_clear()
            .envs(base_env)
            .envs(spec.env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| format!("{}: {e}", argv[0]))?;
        let pid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(Pid::from_raw)
            .ok_or_else(|| format!("{}: exited before its pid was read", argv[0]))?;

        let (events_tx, events) = mpsc::channel(EVENT_BUFFER);
        let (stop_tx, stop_rx) = oneshot::channel();
        let readers = [
            child
                .stdout
                .take()
                .map(|s| pump(s, OutputStream::Stdout, events_tx.clone(), backpressure)),
            child
                .stderr
                .take()
                .map(|s| pump(s, OutputStream::Stderr, events_tx.clone(), backpressure)),
        ];
        let timeout = spec.timeout_seconds().map(Duration::from_secs);
        let job_id = spec.job_id().clone();
        let span = tracing::info_span!("job", job_id = %job_id);
        let task = tokio::spawn(
            supervise(
                child,
                pid,
                timeout,
                stop_rx,
                readers.into_iter().flatten().collect(),
                events_tx,
            )
            .instrument(span),
        );
        Ok(Self {
            job_id,
            pgid: pid,
            ended: false,
            stop: Some(stop_tx),
            events,
            task,
        })
    }

    /// Asks for a cancel: SIGTERM, SIGKILL after the grace period; the job
    /// then ends `Cancelled`. Idempotent.
    pub fn cancel(&mut self) {
        if let Some(stop) = self.stop.take() {
            // The supervisor may already have finished; nothing to stop then.
            let _ = stop.send(Stop::Cancel);
        }
    }

    /// The job's `Ended` event arrived: its group was already killed and its
    /// pid reaped, so dropping it must not signal that (reusable) id again.
    pub fn finished(mut self) {
        self.ended = true;
    }

    /// SIGKILL to the whole group now, and stop following it (its events
    /// are no longer wanted: the connection is gone).
    pub fn kill_now(self) {
        kill_group(self.pgid, Signal::KILL);
        self.task.abort();
    }
}

impl Drop for RunningJob {
    fn drop(&mut self) {
        // Whatever path drops a job (shutdown, a lost connection, an
        // early return), its processes must not outlive the agent's interest.
        if !self.ended && !self.task.is_finished() {
            kill_group(self.pgid, Signal::KILL);
            self.task.abort();
        }
    }
}

fn kill_group(pgid: Pid, signal: Signal) {
    // ESRCH (the group is already empty) is the expected outcome after an
    // exit; any other failure leaves nothing better to do than log it.
    if let Err(e) = rustix::process::kill_process_group(pgid, signal) {
        if e != rustix::io::Errno::SRCH {
            tracing::warn!(pgid = pgid.as_raw_nonzero().get(), error = %e, "kill of the job's process group failed");
        }
    }
}

fn result_of(status: ExitStatus) -> JobResult {
    match (status.code(), status.signal()) {
        (Some(code), _) => JobResult::exited(code),
        // A signal number from the kernel is always positive.
        (None, Some(sig)) => JobResult::signalled(sig).unwrap_or(JobResult::exited(-1)),
        // Neither is impossible on Unix; report a failure rather than panic.
        (None, None) => JobResult::exited(-1),
    }
}

fn pump<R>(
    mut pipe: R,
    stream: OutputStream,
    tx: mpsc::Sender<JobEvent>,
    backpressure: BackpressureMode,
) -> JoinHandle<u64>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut buf = vec![0u8; MAX_OUTPUT_CHUNK_BYTES];
        let mut dropped: u64 = 0;
        loop {
            let n = match pipe.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            // `buf` is MAX_OUTPUT_CHUNK_BYTES long, so the chunk fits.
            let Ok(chunk) = ChunkData::new(buf[..n].to_vec()) else {
                break;
            };
            let event = JobEvent::Output(stream, chunk);
            match backpressure {
                BackpressureMode::Pause => {
                    if tx.send(event).await.is_err() {
                        break;
                    }
                }
                BackpressureMode::Drop => match tx.try_send(event) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        dropped = dropped.saturating_add(n as u64);
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => break,
                },
            }
        }
        dropped
    })
}

async fn supervise(
    mut child: tokio::process::Child,
    pgid: Pid,
    timeout: Option<Duration>,
    stop: oneshot::Receiver<Stop>,
    readers: Vec<JoinHandle<u64>>,
    events: mpsc::Sender<JobEvent>,
) {
    let deadline = async {
        match timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    let stop = async {
        match stop.await {
            Ok(s) => s,
            // The handle is gone without a cancel: keep running until the
            // session kills the group.
            Err(_) => std::future::pending().await,
        }
    };
    enum Why {
        Exited(std::io::Result<ExitStatus>),
        TimedOut,
        Cancelled,
    }
    let why = tokio::select! {
        status = child.wait() => Why::Exited(status),
        () = deadline => Why::TimedOut,
        Stop::Cancel = stop => Why::Cancelled,
    };
    let end = match why {
        Why::Exited(status) => match status {
            Ok(s) => JobEnd::Completed(result_of(s)),
            Err(e) => JobEnd::SpawnFailed {
                error: format!("waiting for the job failed: {e}"),
            },
        },
        Why::TimedOut | Why::Cancelled => {
            kill_group(pgid, Signal::TERM);
            let status = match tokio::time::timeout(KILL_GRACE, child.wait()).await {
                Ok(status) => status,
                Err(_) => {
                    kill_group(pgid, Signal::KILL);
                    child.wait().await
                }
            };
            let result = match status {
                Ok(s) => result_of(s),
                Err(_) => JobResult::exited(-1),
            };
            if matches!(why, Why::TimedOut) {
                JobEnd::TimedOut(result)
            } else {
                JobEnd::Cancelled(result)
            }
        }
    };
    // The leader is gone; nothing else of the job may stay behind. Its pid
    // was reaped just now, so the group id could in principle name a new
    // group already; that needs the kernel to cycle through every pid in
    // between, which it does not do in the microseconds this takes.
    kill_group(pgid, Signal::KILL);
    let mut dropped = 0u64;
    for reader in readers {
        let abort = reader.abort_handle();
        match tokio::time::timeout(DRAIN_LIMIT, reader).await {
            Ok(Ok(n)) => dropped = dropped.saturating_add(n),
            Ok(Err(_)) => {}
            Err(_) => {
                abort.abort();
                tracing::warn!(
                    "job output still open after its process group was killed; stopped reading it"
                );
            }
        }
    }
    if dropped > 0 {
        tracing::warn!(
            dropped_bytes = dropped,
            "output dropped (KICI_BACKPRESSURE_MODE=drop)"
        );
    }
    // The session may have stopped listening (connection lost); then the
    // end has nobody to go to.
    let _ = events.send(JobEvent::Ended(end)).await;
}
